#!/usr/bin/env bash
# One device call for w4_wgmma_kernel (kernels/quant_sm90.cu): its sm_90a variants compiled with the device NVRTC
# (resources and serialization printed; beside them the rest of the quant family for sm_90, which the tests' "current"
# comparisons launch), its GPU tests (tests/test_quant_w4wgmma.py) || a compute-sanitizer memcheck of 2 small cases,
# then the same-process probe (benchmarks/_quant_w4wgmma_probe.py: w4wgmma vs current dispatch vs cuBLAS F.linear,
# outputs cross-checked) with its summary table last.  Every step is timeout-wrapped; worst case 70 + 100 + 110 =
# 280 s (expected ~3 min).
#
#   SPEEDCORE_COMMIT=<hash> bash benchmarks/_quant_w4wgmma_gpu.sh
#
# SKIP_PROBE=1 stops after the tests; T_COMPILE / T_TEST / T_SAN / T_PROBE override the step timeouts (seconds).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPEEDCORE_CACHE_DIR=${SPEEDCORE_CACHE_DIR:-/tmp/scc}
O=${OUT:-/tmp/out}; mkdir -p $O; t0=$SECONDS
echo "commit ${SPEEDCORE_COMMIT:-?}; $(python3 -m speedcore info 2>&1 | grep -i nvrtc | head -n 1)"
for i in 0 1 2 3 4 5; do
  timeout ${T_COMPILE:-70} python3 -c "
from speedcore import quant as Q, _compile
k = [k for k in Q.all_kernels() if k.source == Q.W4WGMMA_SOURCE][$i]
c = _compile.compile_kernel(k, 'sm_90a')
print(k.name, c.resources)" >> $O/compile.log 2>&1 &
done
timeout ${T_COMPILE:-70} python3 -m speedcore compile --arch sm_90 --family quant > $O/compile_family.log 2>&1 &
wait; echo "compile $((SECONDS-t0))s: $(tail -n 1 $O/compile_family.log)"
grep -E "registers|Error|error" $O/compile.log | cut -c1-220
( timeout ${T_TEST:-100} python3 -m pytest -q -rs -m gpu --maxfail=10 tests/test_quant_w4wgmma.py > $O/pytest.log 2>&1
  echo "pytest rc=$? $((SECONDS-t0))s" > $O/rc ) &
p1=$!
timeout ${T_SAN:-100} compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 python3 -m pytest -q -x \
  -m gpu tests/test_quant_w4wgmma.py -k "memcheck_case" > $O/memcheck.log 2>&1 &
p2=$!
wait $p1; cat $O/rc; grep -hE "^(FAILED|ERROR)|passed|failed" $O/pytest.log | cut -c1-240 | tail -n 14
grep -h -A40 "^_____" $O/pytest.log | grep -E "^E " | head -n 16 | cut -c1-240
wait $p2; echo "memcheck rc=$? $((SECONDS-t0))s"; grep -E "ERROR SUMMARY|passed|failed|Invalid|Error" $O/memcheck.log | head -n 6
[ -n "${SKIP_PROBE:-}" ] && exit 0
timeout ${T_PROBE:-110} python3 benchmarks/_quant_w4wgmma_probe.py > $O/probe.log 2>&1; echo "probe rc=$? $((SECONDS-t0))s"
cut -c1-260 $O/probe.log
