#!/usr/bin/env bash
# One device call for two CTAs per SM in w4_wgmma_kernel (branch quant-w4-minb2, measurement variant minb = 2):
# the w4wgmma GPU tests (the minb = 2 cases are override10-12 of test_w4wgmma_group_steps_small), memcheck and racecheck of those
# cases, then the tile-shape sweep at M = 17, 32, 64, 128 ("...x2" rows: two CTAs per SM) and its summary.
# Worst case ~300 s.
#
#   SPEEDCORE_COMMIT=<hash> bash benchmarks/_quant_w4minb_gpu.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPEEDCORE_CACHE_DIR=${SPEEDCORE_CACHE_DIR:-/tmp/scc}
O=${OUT:-/tmp/out}; mkdir -p $O; t0=$SECONDS
( timeout 150 python3 -m pytest -q -m gpu --maxfail=5 tests/test_quant_w4wgmma.py > $O/t.log 2>&1
  echo "tests rc=$? $((SECONDS-t0))s" >> $O/t.log ) &
sleep 10
( timeout 120 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 python3 -m pytest -q -x -m gpu \
  tests/test_quant_w4wgmma.py -k "group_steps and (override10 or override11 or override12)" > $O/mc.log 2>&1
  echo "memcheck rc=$? $((SECONDS-t0))s" >> $O/mc.log
  timeout 100 compute-sanitizer --tool racecheck --error-exitcode 99 --print-limit 10 python3 -m pytest -q -x -m gpu \
  tests/test_quant_w4wgmma.py -k "group_steps and (override10 or override11 or override12) and bfloat16" > $O/rc.log 2>&1
  echo "racecheck rc=$? $((SECONDS-t0))s" >> $O/rc.log ) &
wait
grep -hE "^(FAILED|ERROR)|passed|failed|rc=|ERROR SUMMARY|RACECHECK SUMMARY" $O/t.log $O/mc.log $O/rc.log | cut -c1-240 | tail -n 12
grep -h -A30 "^_____" $O/t.log | grep -E "^E " | head -n 8 | cut -c1-240
if grep -q "tests rc=0" $O/t.log; then
  timeout 90 python3 benchmarks/_quant_w4wgmma_probe.py --tune 17 32 64 128 > $O/tune.log 2>&1; echo "tune rc=$? $((SECONDS-t0))s"
  grep -A20 "^tune summary" $O/tune.log | cut -c1-120
  for m in 17 32 64 128; do grep "^M=$m " $O/tune.log | tr '|' '\n' | tr ' ' '\n' | grep -E "^def|x2$" -A1 | grep -v "^--" | paste -s -d' ' | cut -c1-220; done
fi
