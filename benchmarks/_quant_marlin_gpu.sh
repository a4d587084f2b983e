#!/usr/bin/env bash
# One device call for quant_marlin_kernel: compile its variants with the device NVRTC (in parallel, then the rest of
# the quant family for sm_90), GPU tests (the marlin ones, then the rest of quant with the kernel forced on for
# 17 <= M <= 128 through SPEEDCORE_QUANT_MARLIN=1) || a memcheck subset, then the same-run probe
# (benchmarks/_quant_marlin_probe.py); its summary table prints last.  Every step is timeout-wrapped.
#
#   SPEEDCORE_COMMIT=<hash> bash benchmarks/_quant_marlin_gpu.sh   (worst case with every step cut by its timeout:
#   90 + 90 + 80 + 150 + 150 = 560 s; expected ~5 min)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPEEDCORE_CACHE_DIR=/tmp/scc
O=${OUT:-/tmp/out}; mkdir -p $O; t0=$SECONDS
for v in "__nv_bfloat16, 4|" "__nv_bfloat16, 8|" "__half, 4|" "__half, 8|"; do
  timeout ${T_COMPILE:-90} python3 -c "
from speedcore._compile import Kernel, compile_kernel
name, opt = '$v'.split('|')
c = compile_kernel(Kernel('quant.cu', 'quant::quant_marlin_kernel<' + name + '>', options=(opt,) if opt else ()), 'sm_90')
print('$v', c.resources)" >> $O/compile.log 2>&1 &
done
wait; echo "marlin compile $((SECONDS-t0))s"; grep -E "registers|Error|error" $O/compile.log | cut -c1-200
timeout ${T_COMPILE:-90} python3 -m speedcore compile --arch sm_90 --family quant >> $O/compile.log 2>&1
echo "family compile rc=$? $((SECONDS-t0))s $(tail -n1 $O/compile.log)"
( timeout ${T_TEST1:-80} python3 -m pytest -q -rs -m gpu --maxfail=10 tests/test_quant.py -k "marlin" > $O/pytest1.log 2>&1
  echo "pytest(marlin) rc=$? $((SECONDS-t0))s" > $O/rc1
  SPEEDCORE_QUANT_MARLIN=1 timeout ${T_TEST2:-150} python3 -m pytest -q -rs -m gpu --maxfail=10 tests/test_quant.py \
    -k "not marlin" > $O/pytest2.log 2>&1
  echo "pytest(rest, marlin on) rc=$? $((SECONDS-t0))s" > $O/rc2 ) &
p1=$!
timeout ${T_SAN:-170} compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 python3 -m pytest -q -x \
  -m gpu tests/test_quant.py -k "${SAN_K:-marlin_small and (17-512 or 100-192 or 33-320) and bfloat16}" \
  > $O/memcheck.log 2>&1 &
p2=$!
wait $p1; cat $O/rc1 $O/rc2 2>/dev/null; grep -hE "^(FAILED|ERROR)|passed|failed" $O/pytest1.log $O/pytest2.log | cut -c1-240 | tail -n 14
wait $p2; echo "memcheck rc=$? $((SECONDS-t0))s"; grep -E "ERROR SUMMARY|passed|failed|Invalid" $O/memcheck.log | head -n 5
grep -h -B5 -A30 "^_____" $O/pytest1.log $O/pytest2.log | grep -E "^E |Error" | head -n 16
[ -n "${SKIP_PROBE:-}" ] && exit 0
timeout ${T_PROBE:-150} python3 benchmarks/_quant_marlin_probe.py > $O/probe.log 2>&1; echo "probe rc=$? $((SECONDS-t0))s"
cut -c1-230 $O/probe.log
