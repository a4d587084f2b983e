#!/usr/bin/env bash
# One call on a GPU machine: the GPU tests, the same tests under compute-sanitizer (memcheck, and racecheck on
# a subset), the benchmarks (results merged into benchmarks/results/<gpu>.json), and a short summary last.
#
#   SPEEDCORE_COMMIT=$(git rev-parse --short=12 HEAD) bash benchmarks/gpu_check.sh [bench suites...]
#
# TESTS: pytest paths (default tests); SANITIZE_K / RACECHECK_K: pytest -k filters for the sanitizer passes;
# BENCH_ARGS: extra arguments for `speedcore bench` (e.g. --quick); SKIP_BENCH=1 / SKIP_SANITIZE=1.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export SPEEDCORE_CACHE_DIR="${SPEEDCORE_CACHE_DIR:-/tmp/speedcore-cache}"
out="${OUT:-/tmp/speedcore-gpu-check}"
mkdir -p "$out"
tests="${TESTS:-tests}"
summary=()
t0=$SECONDS

python3 -m speedcore info | tee "$out/info.txt"

python3 -m pytest -q -rs -m gpu $tests 2>&1 | tee "$out/pytest.log"
summary+=("gpu tests:       exit ${PIPESTATUS[0]}  $(tail -n 1 "$out/pytest.log")  ($((SECONDS - t0)) s)")

if [ -z "${SKIP_SANITIZE:-}" ]; then
  t1=$SECONDS
  compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
    python3 -m pytest -q -x -m "gpu and not big" ${SANITIZE_K:+-k "$SANITIZE_K"} $tests > "$out/memcheck.log" 2>&1
  rc=$?
  summary+=("memcheck:        exit $rc  $(grep -E 'ERROR SUMMARY|passed|failed' "$out/memcheck.log" | tail -n 2 | tr '\n' ' ') ($((SECONDS - t1)) s)")
  t1=$SECONDS
  compute-sanitizer --tool racecheck --error-exitcode 99 --print-limit 20 \
    python3 -m pytest -q -x -m "gpu and not big" -k "${RACECHECK_K:-rms_norm_torch and float16}" $tests > "$out/racecheck.log" 2>&1
  rc=$?
  summary+=("racecheck:       exit $rc  $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|passed|failed' "$out/racecheck.log" | tail -n 2 | tr '\n' ' ') ($((SECONDS - t1)) s)")
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  gpu=$(python3 -c "import torch; from speedcore.bench import gpu_slug; print(gpu_slug(torch.cuda.get_device_name()))")
  results="benchmarks/results/$gpu.json"
  python3 -m speedcore bench "$@" ${BENCH_ARGS:-} --json "$results" 2> "$out/bench.err" | tee "$out/bench.txt"
  summary+=("bench:           exit ${PIPESTATUS[0]}  -> $results")
  cp "$results" "${results%.json}.md" "$out/" 2>/dev/null
fi

echo
echo "==== summary ($((SECONDS - t0)) s) ===="
printf '%s\n' "${summary[@]}"
grep -E "FAILED|ERROR" "$out/pytest.log" | head -n 20
