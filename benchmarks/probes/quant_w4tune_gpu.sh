#!/usr/bin/env bash
# One device call for w4_wgmma_kernel (kernels/quant_sm90.cu): every w4wgmma variant (the tile shapes of
# W4WGMMA_SHAPES, each with wgmma groups of 1 / 2 / 4 k16 steps: what w4wgmma_shape and _W4WGMMA_OVERRIDE reach)
# compiled for sm_90a with the device NVRTC (resources printed; the rest of the quant family for sm_90 beside them,
# which the tests' "current" comparisons launch), the GPU tests of tests/test_quant_w4wgmma.py || a
# compute-sanitizer memcheck of the small cases (test_w4wgmma_memcheck_case_small), then
# `benchmarks/probes/quant_w4wgmma_probe.py $PROBE_ARGS` (default --tune: each shape against the default, the current
# dispatch and cuBLAS, outputs cross-checked; PROBE_ARGS="32 64 256": w4wgmma against current and cuBLAS at those M)
# with its table last.  Every step is timeout-wrapped; worst case 50 + 130 + 100 = 280 s.
#
#   SPEEDCORE_COMMIT=<hash> bash benchmarks/probes/quant_w4tune_gpu.sh
#
# SKIP_PROBE=1 stops after the tests; T_COMPILE / T_TEST / T_SAN / T_PROBE override the step timeouts (seconds);
# TUNE_M="64 256" limits the sweep's M values.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPEEDCORE_CACHE_DIR=${SPEEDCORE_CACHE_DIR:-/tmp/scc}
O=${OUT:-/tmp/out}; mkdir -p $O; t0=$SECONDS
echo "commit ${SPEEDCORE_COMMIT:-?}; $(python3 -m speedcore info 2>&1 | grep -i nvrtc | head -n 1)"
NV=$(python3 -c "from speedcore import quant as Q; print(sum(k.source == Q.W4WGMMA_SOURCE for k in Q.all_kernels()))")
for i in $(seq 0 $((NV - 1))); do
  timeout ${T_COMPILE:-50} python3 -c "
from speedcore import quant as Q, _compile
k = [k for k in Q.all_kernels() if k.source == Q.W4WGMMA_SOURCE][$i]
c = _compile.compile_kernel(k, 'sm_90a')
print(k.name, c.resources)" > $O/compile_$i.tmp 2>&1 &
done
timeout ${T_COMPILE:-50} python3 -m speedcore compile --arch sm_90 --family quant > $O/compile_family.log 2>&1 &
wait; echo "compile $((SECONDS-t0))s ($NV w4wgmma variants): $(tail -n 1 $O/compile_family.log)"
cat $O/compile_*.tmp > $O/compile.log; rm -f $O/compile_*.tmp
grep -E "registers|Error|error" $O/compile.log | sed -E "s/'warnings': \[\], //" | cut -c1-200
( timeout ${T_TEST:-130} python3 -m pytest -q -rs -m gpu --maxfail=10 tests/test_quant_w4wgmma.py > $O/pytest.log 2>&1
  echo "pytest rc=$? $((SECONDS-t0))s" > $O/rc ) &
p1=$!
timeout ${T_SAN:-130} compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 python3 -m pytest -q -x \
  -m gpu tests/test_quant_w4wgmma.py -k "memcheck_case" > $O/memcheck.log 2>&1 &
p2=$!
wait $p1; cat $O/rc; grep -hE "^(FAILED|ERROR)|passed|failed" $O/pytest.log | cut -c1-240 | tail -n 14
grep -h -A40 "^_____" $O/pytest.log | grep -E "^E " | head -n 16 | cut -c1-240
wait $p2; echo "memcheck rc=$? $((SECONDS-t0))s"; grep -E "ERROR SUMMARY|passed|failed|Invalid|Error" $O/memcheck.log | head -n 6
[ -n "${SKIP_PROBE:-}" ] && exit 0
SPEEDCORE_QUANT_W4WGMMA=1 timeout ${T_PROBE:-100} python3 benchmarks/probes/quant_w4wgmma_probe.py ${PROBE_ARGS:---tune} ${TUNE_M:-} \
  > $O/tune.log 2>&1; echo "tune rc=$? $((SECONDS-t0))s"
cut -c1-300 $O/tune.log
