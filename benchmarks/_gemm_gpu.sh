#!/usr/bin/env bash
# gemm family, one GPU call: parallel compile, a smoke test, the same-process A/B (benchmarks/_gemm_ab.py: cuBLAS,
# previous and current kernels), then the GPU tests || a memcheck subset; compact summary last.
#   AB="hopper small ampere" T_AB=150 T_TEST=120 bash benchmarks/_gemm_gpu.sh
# kernels/gemm_sm90_prev.cu and kernels/gemm_prev.cu (copies of the committed kernels with _prev names) must exist.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPEEDCORE_CACHE_DIR=/tmp/scc
O=${OUT:-/tmp/out}; mkdir -p $O; t0=$SECONDS
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
timeout ${T_COMPILE:-200} python3 benchmarks/_gemm_ab.py precompile > $O/compile.log 2>&1; echo "compile rc=$? $((SECONDS-t0))s $(tail -n1 $O/compile.log)"
timeout 60 python3 - <<'PY'
import torch, speedcore
x = torch.randn(1000, 1064, device="cuda", dtype=torch.bfloat16); w = torch.randn(264, 1064, device="cuda", dtype=torch.bfloat16) / 32
bias = torch.randn(264, device="cuda", dtype=torch.bfloat16)
y = speedcore.linear(x, w, bias, activation="gelu"); ref = torch.nn.functional.gelu(x.float() @ w.float().t() + bias.float())
print("smoke max err", ((y.float() - ref).abs().max() / ref.abs().max()).item())
PY
echo "smoke rc=$? $((SECONDS-t0))s"
timeout ${T_AB:-150} python3 benchmarks/_gemm_ab.py ${AB:-hopper small ampere} > $O/ab.log 2>&1; echo "ab rc=$? $((SECONDS-t0))s"
timeout ${T_TEST:-120} python3 -m pytest -q -x -rs -m gpu -p no:cacheprovider tests/test_gemm.py > $O/pytest.log 2>&1 &
p1=$!
timeout ${T_SAN:-120} compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_gemm.py -k "${SAN_K:-every_tile and bfloat16 or odd_m and bfloat16 and hopper}" > $O/memcheck.log 2>&1 &
p2=$!
wait $p1; echo "pytest rc=$? $((SECONDS-t0))s"; grep -E "^(FAILED|ERROR)|passed|failed|Error" $O/pytest.log | cut -c1-300 | tail -n 12
wait $p2; echo "memcheck rc=$? $((SECONDS-t0))s"; grep -E "ERROR SUMMARY|passed|failed|Invalid" $O/memcheck.log | head -n 5
grep -E "Error|Traceback|skip" $O/ab.log | head -n 5
sed -n '/==== A\/B summary/,$p' $O/ab.log
