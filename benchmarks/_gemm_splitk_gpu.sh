#!/usr/bin/env bash
# One device call for split-K on the Hopper GEMM path (branch gemm-sm90-splitk): the GEMM GPU tests, memcheck of
# the split-K test (partials and tickets through global memory), the same-process A/B (benchmarks/_gemm_splitk_ab.py)
# and, the tests passing, the gemm grid merged into $OUT/h200.json.  Worst case ~330 s.
#
#   SPEEDCORE_COMMIT=<hash> bash benchmarks/_gemm_splitk_gpu.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPEEDCORE_CACHE_DIR=${SPEEDCORE_CACHE_DIR:-/tmp/scc}
O=${OUT:-/tmp/out}; mkdir -p $O; t0=$SECONDS
( timeout 150 python3 -m pytest -q -m gpu --maxfail=5 tests/test_gemm.py > $O/t.log 2>&1
  echo "tests rc=$? $((SECONDS-t0))s" >> $O/t.log ) &
sleep 10
( timeout 120 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 python3 -m pytest -q -x -m gpu \
  tests/test_gemm.py -k "split_k" > $O/mc.log 2>&1
  echo "memcheck rc=$? $((SECONDS-t0))s" >> $O/mc.log ) &
wait
grep -hE "^(FAILED|ERROR)|passed|failed|rc=|ERROR SUMMARY" $O/t.log $O/mc.log | cut -c1-240 | tail -n 10
grep -h -A30 "^_____" $O/t.log | grep -E "^E " | head -n 8 | cut -c1-240
if grep -q "tests rc=0" $O/t.log; then
  timeout 60 python3 benchmarks/_gemm_splitk_ab.py > $O/ab.log 2>&1; echo "ab rc=$? $((SECONDS-t0))s"; cat $O/ab.log
  cp benchmarks/results/h200.json $O/h200.json
  timeout 100 python3 -m speedcore bench gemm --json $O/h200.json > $O/bench.log 2>&1; echo "bench rc=$? $((SECONDS-t0))s"
  grep -E "^linear +(64|128)x4096x" $O/bench.log | cut -c1-160
fi
