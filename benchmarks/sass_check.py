"""SASS of the Hopper kernels as dispatched: HGMMA (wgmma) count and local-memory traffic of the main variants,
from their cubins (no GPU needed; nvdisasm from PATH or the nvidia-cuda-nvdisasm wheel).  Local memory fails the
check except in the variants a family documents (``spills_allowed``).

    python3 benchmarks/sass_check.py
"""
import sys

from speedcore import _registry, _sass, attention, gemm
from speedcore._compile import compile_kernel

kernels = [attention._kernel_sm90("bfloat16", *attention.flash_attn_sm90_config(d, masked), False)
           for d in (64, 128, 256) for masked in (False, True)]
kernels += [k for k in gemm.all_kernels() if k.hopper][:2]
failed = 0
allowances = _registry.spill_allowances(kernels)
for k in dict.fromkeys(kernels):
    c = compile_kernel(k, "sm_90a")
    for name, text in _sass.sass(c.cubin, "sm_90a").items():
        hgmma, local = _sass.count(text, "HGMMA"), _sass.count(text, "STL") + _sass.count(text, "LDL")
        allowed = allowances[k] != (0, 0)  # documented by the family (attention.spills_allowed)
        failed += hgmma == 0 or (local > 0 and not allowed)
        print(f"{k.name}: {hgmma} HGMMA, {local} local-memory instructions{' (allowed)' if local and allowed else ''}, "
              f"{c.resources['registers']} registers")
sys.exit(1 if failed else 0)
