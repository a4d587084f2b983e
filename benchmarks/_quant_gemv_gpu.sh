#!/usr/bin/env bash
# One device call for the quant small-M work: compile (device NVRTC), gemv GPU tests, lean bench, other GPU tests.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPEEDCORE_CACHE_DIR=/tmp/scc
O=${OUT:-/tmp/out}; mkdir -p $O; t0=$SECONDS
python3 -m speedcore compile --arch sm_90 --family quant > $O/compile.log 2>&1; echo "compile rc=$? $((SECONDS-t0))s $(tail -n1 $O/compile.log)"
timeout ${T1:-50} python3 -m pytest -q -m gpu --maxfail=8 tests/test_quant.py -k "gemv" > $O/pytest_gemv.log 2>&1; echo "pytest gemv rc=$? $((SECONDS-t0))s"
grep -E "^(FAILED|ERROR)|passed|failed|Error" $O/pytest_gemv.log | cut -c1-300 | tail -n 12
timeout ${T2:-75} python3 benchmarks/_quant_gemv_probe.py ${PLAN:-full} > $O/bench.log 2>&1; echo "bench rc=$? $((SECONDS-t0))s"
timeout ${T3:-50} python3 -m pytest -q -m gpu --maxfail=8 tests/test_quant.py -k "not gemv" > $O/pytest_rest.log 2>&1; echo "pytest rest rc=$? $((SECONDS-t0))s"
grep -E "^(FAILED|ERROR)|passed|failed" $O/pytest_rest.log | cut -c1-300 | tail -n 10
grep -B2 -A25 "^_____" $O/pytest_gemv.log | grep -E "Error|assert|^E " | head -n 20
cat $O/bench.log
