#!/usr/bin/env bash
# One device call: every GPU test (8 workers), memcheck over the new paged-attention and fast-path tests, and a
# short summary last.  Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 SPEEDCORE_CACHE_DIR=/tmp/sc-cache
out="${OUT:-/tmp/sc-out}"; mkdir -p "$out"
t0=$SECONDS
if [ -n "${CANARY:-}" ]; then  # kernels changed since their last GPU run, alone first with a short limit (a hang)
  eval timeout "${CANARY_TIMEOUT:-120}" python3 -m pytest -q -x -p no:cacheprovider "$CANARY" > "$out/canary.log" 2>&1
  echo "canary exit $? ($((SECONDS - t0)) s)" | tee -a "$out/canary.log"
fi
timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -n 8 -p no:cacheprovider ${TESTS:-tests} > "$out/tests.log" 2>&1
echo "tests exit $? ($((SECONDS - t0)) s)" >> "$out/tests.log"
if [ -n "${MEMCHECK:-}" ]; then
  # eval: MEMCHECK holds pytest arguments with their own quotes (-k "a and b")
  eval timeout "${MEMCHECK_TIMEOUT:-120}" compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 \
    python3 -m pytest -q -p no:cacheprovider -m "'gpu and not big'" "$MEMCHECK" > "$out/memcheck.log" 2>&1
  echo "memcheck exit $?" >> "$out/memcheck.log"
fi
grep -E "^(FAILED|ERROR)" "$out/tests.log" | cut -c1-220 | head -40
tail -n 2 "$out/tests.log"
[ -f "$out/memcheck.log" ] && grep -E "ERROR SUMMARY|exit|passed|failed" "$out/memcheck.log" | tail -4
