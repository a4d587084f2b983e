#!/usr/bin/env bash
# One device call for the decode family: precompile (16 threads), GPU tests with a memcheck subset beside them
# (-k "small or v2"),
# then the tune sweep and/or the bench suite.  Logs under $OUT.  STEPS: any of "tests tune bench diag".
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 SPEEDCORE_CACHE_DIR=/tmp/sc-dec
OUT="${OUT:-/tmp/dec-out}"; mkdir -p "$OUT"
STEPS="${STEPS:-tests tune}"
t0=$SECONDS
python3 - <<'PY' > "$OUT/compile.log" 2>&1
import sys; sys.path.insert(0, "benchmarks")
from concurrent.futures import ThreadPoolExecutor
from speedcore import decode as D
from speedcore._compile import compile_kernel
import _decode_tune as T
ks = D.all_kernels() + T.variant_kernels()
with ThreadPoolExecutor(16) as ex:
    for k, c in zip(ks, ex.map(lambda k: compile_kernel(k, "sm_90"), ks)):
        print(k.name, c.resources["registers"], c.resources["spill_stores"])
PY
echo "compile exit $? ($((SECONDS - t0)) s)"
if [[ $STEPS == *tests* ]]; then
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
    python3 -m pytest -x -q -p no:cacheprovider tests/test_decode.py -k "small or v2" > "$OUT/memcheck.log" 2>&1 &
  mc=$!
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py > "$OUT/pytest.log" 2>&1
  echo "pytest exit $? ($((SECONDS - t0)) s): $(tail -n 1 "$OUT/pytest.log")"
  wait $mc
  echo "memcheck exit $? ($((SECONDS - t0)) s): $(grep -E 'passed|failed|ERROR SUMMARY' "$OUT/memcheck.log" | tr '\n' ' ')"
fi
if [[ $STEPS == *tune* ]]; then
  timeout 150 python3 benchmarks/_decode_tune.py "${ROUNDS:-3}" > "$OUT/tune.log" 2>&1
  echo "tune exit $? ($((SECONDS - t0)) s)"
fi
if [[ $STEPS == *bench* ]]; then
  timeout 300 python3 -m speedcore bench decode --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench exit $? ($((SECONDS - t0)) s)"
fi
if [[ $STEPS == *diag* ]]; then
  timeout 200 python3 benchmarks/_decode_diag.py > "$OUT/diag.log" 2>&1
  echo "diag exit $? ($((SECONDS - t0)) s)"
fi
grep -E "FAIL|Error|WRONG" "$OUT"/pytest.log "$OUT"/tune.log 2>/dev/null | head -20
[ -f "$OUT/tune.log" ] && sed -n '/---- ratios/,$p' "$OUT/tune.log"
[ -f "$OUT/bench.log" ] && grep -E "paged|TB/s|x " "$OUT/bench.log" | tail -20
exit 0
