#!/usr/bin/env bash
# One device call after session_tests.sh: the suites and model-level benches whose figures the open issues ask
# for, each recorded into benchmarks/results/ as it finishes (copy them back from $OUT), a short summary last.
#   SPEEDCORE_COMMIT=$(git rev-parse --short=12 HEAD) bash benchmarks/probes/session_bench.sh
# BENCH: which of host hf paged_prefill engine serve (default all); ENGINE_QUANT=1 adds the AWQ / GPTQ / INT8 runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 SPEEDCORE_CACHE_DIR="${SPEEDCORE_CACHE_DIR:-/tmp/sc-cache}"
out="${OUT:-/tmp/sc-out}"; mkdir -p "$out"
want="${BENCH:-host hf paged_prefill engine serve}"
res="$out/h200.json"
cp benchmarks/results/h200.json "$res"
t0=$SECONDS
for suite in host paged_prefill hf serve; do
  case " $want " in *" $suite "*) ;; *) continue ;; esac
  timeout 420 python3 -m speedcore bench "$suite" --json "$res" > "$out/bench-$suite.log" 2>&1
  echo "bench $suite: exit $? ($((SECONDS - t0)) s)"
done
case " $want " in *" engine "*)
  e="python3 -m speedcore bench-engine --preset llama-3-8b"
  timeout 300 $e --batch 1 --num-prompts 4 --input-len 128 --output-len 256 --json "$out/engine-b1.json" > "$out/engine.log" 2>&1
  timeout 400 $e --num-prompts 256 --input-len 100:1024 --output-len 256 --json "$out/engine-tput.json" >> "$out/engine.log" 2>&1
  timeout 200 $e --batch 1 --num-prompts 1 --input-len 8191 --output-len 1 --json "$out/engine-ttft.json" >> "$out/engine.log" 2>&1
  if [ -n "${ENGINE_QUANT:-}" ]; then
    for q in awq gptq int8; do
      timeout 300 $e --batch 1 --num-prompts 4 --input-len 128 --output-len 256 --quantization $q \
        --json "$out/engine-b1-$q.json" >> "$out/engine.log" 2>&1
    done
  fi
  echo "engine: ($((SECONDS - t0)) s)"; grep -iE "tok/s|ttft|start" "$out/engine.log" | tail -12 ;;
esac
python3 - "$res" <<'PY'
import json, sys
recs = [r for r in json.load(open(sys.argv[1])) if r["op"] in ("host", "hf", "paged_prefill", "serve")]
for r in recs[-60:]:
    print(f'{r["op"]:14s} {r["case"][:60]:60s} {r["ours"]:10.4g} {r["peer"][:28]:28s} {r["ratio"] if r["ratio"] is None else round(r["ratio"], 3)}')
PY
