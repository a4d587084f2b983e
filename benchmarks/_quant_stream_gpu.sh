#!/usr/bin/env bash
# One device call for the small-M streaming kernels: compile (device NVRTC), quant GPU tests (stream/bulk ones
# first) || memcheck subset, then the same-run probe (benchmarks/_quant_stream_probe.py); its table prints last.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPEEDCORE_CACHE_DIR=/tmp/scc
O=${OUT:-/tmp/out}; mkdir -p $O; t0=$SECONDS
timeout ${T_COMPILE:-60} python3 -m speedcore compile --arch sm_90 --family quant > $O/compile.log 2>&1; echo "compile rc=$? $((SECONDS-t0))s $(tail -n1 $O/compile.log)"
( timeout ${T_TEST1:-70} python3 -m pytest -q -rs -m gpu --maxfail=10 tests/test_quant.py -k "stream" > $O/pytest1.log 2>&1; echo "pytest(stream) rc=$? $((SECONDS-t0))s" > $O/rc1
  timeout ${T_TEST2:-50} python3 -m pytest -q -rs -m gpu --maxfail=10 tests/test_quant.py -k "not stream" > $O/pytest2.log 2>&1; echo "pytest(rest) rc=$? $((SECONDS-t0))s" > $O/rc2 ) &
p1=$!
timeout ${T_SAN:-110} compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 python3 -m pytest -q -x -m gpu tests/test_quant.py -k "${SAN_K:-(stream_rows_offset and (9-256-128 or 13-192) and -0-) or (stream_exact_rows and override1) or previous}" > $O/memcheck.log 2>&1 &
p2=$!
wait $p1; cat $O/rc1 $O/rc2 2>/dev/null; grep -hE "^(FAILED|ERROR)|passed|failed" $O/pytest1.log $O/pytest2.log | cut -c1-240 | tail -n 14
wait $p2; echo "memcheck rc=$? $((SECONDS-t0))s"; grep -E "ERROR SUMMARY|passed|failed|Invalid" $O/memcheck.log | head -n 5
grep -h -B5 -A30 "^_____" $O/pytest1.log $O/pytest2.log | grep -E "^E |Error" | head -n 16
[ -n "${SKIP_PROBE:-}" ] && exit 0
timeout ${T_PROBE:-60} python3 benchmarks/_quant_stream_probe.py > $O/probe.log 2>&1; echo "probe rc=$? $((SECONDS-t0))s"
cut -c1-230 $O/probe.log
