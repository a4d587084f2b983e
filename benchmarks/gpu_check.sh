#!/usr/bin/env bash
# One call on a GPU machine: every variant compiled by this machine's NVRTC (no spills), the GPU tests with the
# sanitizer passes beside them (memcheck, and racecheck on a subset), the benchmark suites one by one (each
# merged into benchmarks/results/<gpu>.json as soon as it finishes), and a short summary last.
#
#   SPEEDCORE_COMMIT=$(git rev-parse --short=12 HEAD) bash benchmarks/gpu_check.sh [suites...]
#
# TESTS: pytest paths (default tests); SANITIZE_K / RACECHECK_K: pytest -k filters for the sanitizer passes;
# SANITIZE_TIMEOUT: seconds per sanitizer pass (exit 124 when cut); QUICK_SUITES: suites benchmarked with
# --quick; SKIP_BENCH=1 / SKIP_SANITIZE=1.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export SPEEDCORE_CACHE_DIR="${SPEEDCORE_CACHE_DIR:-/tmp/speedcore-cache}"
out="${OUT:-/tmp/speedcore-gpu-check}"
mkdir -p "$out"
tests="${TESTS:-tests}"
summary=()
t0=$SECONDS

python3 -m speedcore info > "$out/info.txt" 2>&1
python3 -m speedcore compile >> "$out/info.txt" 2>&1
summary+=("compile:   exit $?  $(tail -n 1 "$out/info.txt")  ($((SECONDS - t0)) s)")

if [ -z "${SKIP_SANITIZE:-}" ]; then
  (
    timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
      python3 -m pytest -q -p no:cacheprovider -m "gpu and not big" ${SANITIZE_K:+-k "$SANITIZE_K"} $tests \
      > "$out/memcheck.log" 2>&1
    echo "exit $?" >> "$out/memcheck.log"
    timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool racecheck --error-exitcode 99 --print-limit 20 \
      python3 -m pytest -q -p no:cacheprovider -m "gpu and not big" -k "${RACECHECK_K:-rms_norm_torch and float16}" \
      $tests > "$out/racecheck.log" 2>&1
    echo "exit $?" >> "$out/racecheck.log"
  ) &
  sanitizers=$!
fi

python3 benchmarks/sass_check.py /tmp/speedcore-sass > "$out/sass.txt" 2>&1
summary+=("sass:      exit $?  $(tr '\n' ';' < "$out/sass.txt" | cut -c1-400)")

t1=$SECONDS
python3 -m pytest -q -rs -p no:cacheprovider -m gpu $tests > "$out/pytest.log" 2>&1
summary+=("gpu tests: exit $?  $(tail -n 1 "$out/pytest.log")  ($((SECONDS - t1)) s)")

if [ -z "${SKIP_SANITIZE:-}" ]; then
  wait "$sanitizers"
  for tool in memcheck racecheck; do
    summary+=("$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|^exit' "$out/$tool.log" | tail -n 3 | tr '\n' ' ')")
  done
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  gpu=$(python3 -c "import torch; from speedcore.bench import gpu_slug; print(gpu_slug(torch.cuda.get_device_name()))")
  results="benchmarks/results/$gpu.json"
  suites=("$@")
  [ ${#suites[@]} -eq 0 ] && suites=($(python3 -c "from speedcore.bench import suites; print(' '.join(suites()))"))
  for s in "${suites[@]}"; do
    quick=""
    case " ${QUICK_SUITES:-} " in *" $s "*) quick="--quick" ;; esac
    t1=$SECONDS
    python3 -m speedcore bench "$s" $quick --json "$results" 2>> "$out/bench.err" | tee -a "$out/bench.txt"
    summary+=("bench $s $quick: exit ${PIPESTATUS[0]}  ($((SECONDS - t1)) s)")
    cp "$results" "${results%.json}.md" "$out/" 2>/dev/null
  done
fi

echo
echo "==== summary ($((SECONDS - t0)) s) ===="
printf '%s\n' "${summary[@]}"
grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -n 20
