#!/usr/bin/env bash
# quant family, one GPU call: compile, GPU tests || memcheck subset, then the bench suite; compact summary last.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPEEDCORE_CACHE_DIR=/tmp/scc SPEEDCORE_COMMIT=$(git rev-parse --short=12 HEAD 2>/dev/null || echo wip)
O=${OUT:-/tmp/out}; mkdir -p $O; t0=$SECONDS
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m speedcore compile --arch sm_90 --family quant > $O/compile.log 2>&1; echo "compile rc=$? $((SECONDS-t0))s $(tail -n1 $O/compile.log)"
timeout ${T_TEST:-120} python3 -m pytest -q -rs -m gpu tests/test_quant.py > $O/pytest.log 2>&1 &
p1=$!
timeout ${T_SAN:-120} compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 python3 -m pytest -q -x -m gpu tests/test_quant.py -k "${SAN_K:-exact_rows or int8_extreme or int8_linear_small}" > $O/memcheck.log 2>&1 &
p2=$!
wait $p1; echo "pytest rc=$? $((SECONDS-t0))s"; grep -E "^(FAILED|ERROR)|passed|failed" $O/pytest.log | cut -c1-220 | tail -n 30
wait $p2; echo "memcheck rc=$? $((SECONDS-t0))s"; grep -E "ERROR SUMMARY|passed|failed|Invalid" $O/memcheck.log | head -n 5
[ -n "${SKIP_BENCH:-}" ] && exit 0
timeout ${T_BENCH:-150} python3 -m speedcore bench quant ${BENCH_ARGS:-} --json $O/quant.json > $O/bench.log 2>&1; echo "bench rc=$? $((SECONDS-t0))s"
grep -E "FAILED|Error" $O/bench.log | head -n 5
python3 - $O/quant.json <<'PY'
import json, sys, collections
recs = json.load(open(sys.argv[1]))
rows = collections.OrderedDict()
for r in recs:
    if r["op"] == "ceiling":
        print("ceiling", r["case"], round(r["ours"], 3)); continue
    k = (r["op"], r["case"]); rows.setdefault(k, {"ours": r["ours"], "unit": r["unit"]})
    if r["peer"] != "-": rows[k][r["peer"][:4]] = r["ratio"]
for (op, case), v in rows.items():
    f = lambda x: "-" if x is None else f"{x:.2f}"
    if v["ours"] is None:
        print(op, case, "ERROR"); continue
    print(f"{op[:16]:16s} {case:22s} {v['ours']:.3g}{v['unit'][:2]} cublas x{f(v.get('F.li'))} tg x{f(v.get('tiny'))}")
PY
