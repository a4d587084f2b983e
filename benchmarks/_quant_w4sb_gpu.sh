#!/usr/bin/env bash
# One device call for the super-block layout of w4_wgmma_kernel (branch quant-w4-superblock): the quant and w4wgmma
# GPU tests, a compute-sanitizer memcheck of the small w4wgmma / group-step cases (bf16), then (tests passing) the
# w4wgmma probe at M = 32, 64, 256, the tile-shape sweep at M = 32, 64 (512-channel CTAs b4m64 among the shapes) and
# the full quant grid merged into $OUT/h200.json.  Worst case ~380 s (expected ~250 s).
#
#   SPEEDCORE_COMMIT=<hash> [RECORD_ALL=1] bash benchmarks/_quant_w4sb_gpu.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPEEDCORE_CACHE_DIR=${SPEEDCORE_CACHE_DIR:-/tmp/scc}
O=${OUT:-/tmp/out}; mkdir -p $O; t0=$SECONDS
( timeout 170 python3 -m pytest -q -m gpu --maxfail=5 tests/test_quant_w4wgmma.py tests/test_quant.py > $O/t.log 2>&1
  echo "tests rc=$? $((SECONDS-t0))s" >> $O/t.log ) &
sleep 10
( timeout 120 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 python3 -m pytest -q -x -m gpu \
  tests/test_quant_w4wgmma.py -k "(w4wgmma_small or group_steps) and bfloat16" > $O/mc.log 2>&1
  echo "memcheck rc=$? $((SECONDS-t0))s" >> $O/mc.log ) &
wait
grep -hE "^(FAILED|ERROR)|passed|failed|rc=|ERROR SUMMARY" $O/t.log $O/mc.log | cut -c1-240 | tail -n 12
grep -h -A30 "^_____" $O/t.log | grep -E "^E " | head -n 8 | cut -c1-240
if grep -q "tests rc=0" $O/t.log; then
  timeout 40 python3 benchmarks/_quant_w4wgmma_probe.py 32 64 256 > $O/probe.log 2>&1; grep -A12 "^summary" $O/probe.log | cut -c1-120
  # the tile shapes at small M, 512-channel CTAs (b4m64) among them
  SPEEDCORE_QUANT_W4WGMMA=1 timeout 60 python3 benchmarks/_quant_w4wgmma_probe.py --tune 32 64 > $O/tune.log 2>&1
  grep -A12 "^tune summary" $O/tune.log | cut -c1-120
  for m in 32 64; do grep "^M=$m " $O/tune.log | tr '|' '\n' | tr ' ' '\n' | grep -A1 "^b4\|^def" | paste -s -d' ' | cut -c1-200; done
  cp benchmarks/results/h200.json $O/h200.json
  timeout 150 python3 -m speedcore bench quant --json $O/h200.json > $O/bench.log 2>&1; echo "bench rc=$? $((SECONDS-t0))s"
  grep -E "^(awq|gptq)_linear  " $O/bench.log | grep -E "cuBLAS\)" | awk '{print $1, $2, $3, $(NF-1)}' | paste -d' ' - - -
fi
# RECORD_ALL=1: also re-record the flash_attn and gemm grids into the same JSON (~100 s; their short cells sit on the
# noise line), so one warm machine serves both.
if [ -n "${RECORD_ALL:-}" ]; then
  [ -f $O/h200.json ] || cp benchmarks/results/h200.json $O/h200.json
  timeout 200 python3 -m speedcore bench flash_attn gemm --json $O/h200.json > $O/bench_all.log 2>&1
  echo "bench flash_attn gemm rc=$? $((SECONDS-t0))s"
  grep -E "flash_attn .*(s512|s4096).*(causal|full)|8192x28672x8192" $O/bench_all.log | cut -c1-160 | head -n 16
fi
