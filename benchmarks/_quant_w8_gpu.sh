#!/usr/bin/env bash
# One device call for INT8 on w4_wgmma_kernel (branch quant-w8-wgmma): the w4wgmma + quant GPU tests (the INT8 ones
# among them), a compute-sanitizer memcheck of the INT8 cases (bf16), then (tests passing) the INT8 probe (w8wgmma
# vs the current INT8 path vs cuBLAS).  Worst case ~330 s.
#
#   SPEEDCORE_COMMIT=<hash> bash benchmarks/_quant_w8_gpu.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPEEDCORE_CACHE_DIR=${SPEEDCORE_CACHE_DIR:-/tmp/scc}
O=${OUT:-/tmp/out}; mkdir -p $O; t0=$SECONDS
( timeout 170 python3 -m pytest -q -m gpu --maxfail=5 tests/test_quant_w4wgmma.py tests/test_quant.py > $O/t.log 2>&1
  echo "tests rc=$? $((SECONDS-t0))s" >> $O/t.log ) &
sleep 10
( timeout 120 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 python3 -m pytest -q -x -m gpu \
  tests/test_quant_w4wgmma.py -k "w8 and bfloat16" > $O/mc.log 2>&1
  echo "memcheck rc=$? $((SECONDS-t0))s" >> $O/mc.log ) &
wait
grep -hE "^(FAILED|ERROR)|passed|failed|rc=|ERROR SUMMARY" $O/t.log $O/mc.log | cut -c1-240 | tail -n 12
grep -h -A30 "^_____" $O/t.log | grep -E "^E " | head -n 8 | cut -c1-240
if grep -q "tests rc=0" $O/t.log; then
  timeout 120 python3 benchmarks/_quant_w8wgmma_probe.py > $O/probe.log 2>&1; echo "probe rc=$? $((SECONDS-t0))s"
  grep -A30 "^summary" $O/probe.log | cut -c1-140
fi
