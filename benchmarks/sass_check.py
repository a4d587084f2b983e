"""SASS of the Hopper kernels: compiles one variant of each sm_90a family here (any machine with NVRTC), writes
the cubin, and counts the HGMMA instructions cuobjdump finds (needs cuobjdump, e.g. on the GPU image).

    python3 benchmarks/sass_check.py [outdir]
"""
import shutil
import subprocess
import sys
from pathlib import Path

from speedcore import attention, gemm
from speedcore._compile import compile_kernel

out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/speedcore-sass")
out.mkdir(parents=True, exist_ok=True)
tool = shutil.which("cuobjdump")
kernels = [k for k in attention.all_kernels() if k.hopper][:1] + [k for k in gemm.all_kernels() if k.hopper][:1]
kernels += [attention._kernel_sm90("bfloat16", *attention.flash_attn_sm90_config(128, False), False)]
failed = 0
for i, k in enumerate(kernels):
    c = compile_kernel(k, "sm_90a")
    path = out / f"{i}-{k.name.split('<')[0]}.cubin"
    path.write_bytes(c.cubin)
    if tool is None:
        print(f"{k.name}: cubin at {path} (no cuobjdump here)")
        continue
    r = subprocess.run([tool, "--dump-sass", str(path)], capture_output=True, text=True)
    n = sum("HGMMA" in line for line in r.stdout.splitlines())
    if n == 0:
        print(f"cuobjdump exit {r.returncode}: {r.stderr.strip()[:300]} | {r.stdout[:300]!r}")
    failed += n == 0
    print(f"{k.name}: {n} HGMMA instructions, registers {c.resources['registers']}, "
          f"spills {c.resources['spill_stores']}/{c.resources['spill_loads']}, "
          f"serialized wgmma: {c.resources.get('wgmma_serialized')}")
sys.exit(1 if failed else 0)
