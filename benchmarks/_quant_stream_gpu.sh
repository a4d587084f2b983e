#!/usr/bin/env bash
# One device call for the small-M streaming kernel: compile (device NVRTC), quant GPU tests || memcheck subset,
# then the same-run probe (benchmarks/_quant_stream_probe.py); its summary table prints last.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPEEDCORE_CACHE_DIR=/tmp/scc
O=${OUT:-/tmp/out}; mkdir -p $O; t0=$SECONDS
timeout 90 python3 -m speedcore compile --arch sm_90 --family quant > $O/compile.log 2>&1; echo "compile rc=$? $((SECONDS-t0))s $(tail -n1 $O/compile.log)"
timeout ${T_TEST:-150} python3 -m pytest -q -rs -m gpu --maxfail=10 tests/test_quant.py ${TEST_K:+-k "$TEST_K"} > $O/pytest.log 2>&1 &
p1=$!
timeout ${T_SAN:-150} compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 python3 -m pytest -q -x -m gpu tests/test_quant.py -k "${SAN_K:-stream_exact_rows or (stream_small and bfloat16 and (1-256-1024 or 12-320-2048 or 9-192-384 or 3-512-4096))}" > $O/memcheck.log 2>&1 &
p2=$!
wait $p1; echo "pytest rc=$? $((SECONDS-t0))s"; grep -E "^(FAILED|ERROR)|passed|failed" $O/pytest.log | cut -c1-240 | tail -n 14
wait $p2; echo "memcheck rc=$? $((SECONDS-t0))s"; grep -E "ERROR SUMMARY|passed|failed|Invalid" $O/memcheck.log | head -n 5
grep -B5 -A30 "^_____" $O/pytest.log | grep -E "^E |Error" | head -n 16
[ -n "${SKIP_PROBE:-}" ] && exit 0
timeout ${T_PROBE:-120} python3 benchmarks/_quant_stream_probe.py > $O/probe.log 2>&1; echo "probe rc=$? $((SECONDS-t0))s"
cat $O/probe.log | cut -c1-200
