#!/usr/bin/env bash
# One device call for w4_wgmma_kernel's split-K epilogue (session 15's open question: the owner's pulls of the other
# CTA's 40 KB through distributed shared memory take ~1.5 us in the kernel and ~0.4 us in benchmarks/_dsmem_probe.py):
# the probe (mode 6 = the pulls by one base register + constant offsets, as the kernel compiles them), then traces of
# 4096^2 M = 320 and 8192^2 M = 256 with and without -DW4_EXP_SEPADDR (each pull from a mapa of its own), then the
# same-process A/B against an older kernel copy when kernels/_quant_sm90_old.cu exists.  About 60 s.
#
#   bash benchmarks/_quant_w4_epi_gpu.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPEEDCORE_CACHE_DIR=${SPEEDCORE_CACHE_DIR:-/tmp/scc}
t0=$SECONDS
timeout 60 python3 benchmarks/_dsmem_probe.py 2>&1 | tail -n 20
echo "probe $((SECONDS-t0))s"
timeout 150 python3 benchmarks/_quant_w4_trace.py 4096:4096:320 8192:8192:256 --defs "-DW4_EXP_SEPADDR" 2>&1 | tail -n 16
echo "trace $((SECONDS-t0))s"
if [ -f kernels/_quant_sm90_old.cu ]; then
  timeout 200 python3 benchmarks/_quant_w4_old_ab.py --all-args 4096:4096:320 4096:4096:512 8192:8192:256 2>&1 | tail -n 4
fi
echo "total $((SECONDS-t0))s"
