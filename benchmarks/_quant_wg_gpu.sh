#!/usr/bin/env bash
# One device call for the Hopper quant kernel: GPU tests (wg first) || memcheck subset, then the same-run probe.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPEEDCORE_CACHE_DIR=/tmp/scc SPEEDCORE_TEST_WG=1
O=${OUT:-/tmp/out}; mkdir -p $O; t0=$SECONDS
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout ${T2:-90} compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 5 python3 -m pytest -q -x -m gpu tests/test_quant.py -k "${SAN_K:-wg_exact_rows or act_order_wg}" > $O/memcheck.log 2>&1 &
p2=$!
timeout ${T1:-70} python3 -m pytest -q -m gpu --maxfail=6 tests/test_quant.py -k "${TK:-wg}" > $O/pytest_wg.log 2>&1
echo "pytest ${TK:-wg} rc=$? $((SECONDS-t0))s"; grep -E "^(FAILED|ERROR)|passed|failed|Error" $O/pytest_wg.log | cut -c1-300 | tail -n 8
grep -E "^E " $O/pytest_wg.log | head -n 12
wait $p2; echo "memcheck rc=$? $((SECONDS-t0))s"; grep -E "ERROR SUMMARY|passed|failed|Invalid" $O/memcheck.log | head -n 6
timeout ${T3:-90} python3 benchmarks/_quant_wg_probe.py ${PLAN:-full} > $O/probe.log 2>&1; echo "probe rc=$? $((SECONDS-t0))s"
cat $O/probe.log | tail -n 60
