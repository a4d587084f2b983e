"""The runtime's own costs: import, first compile of a variant, loading it from the disk cache in a new
process, and the host time of one launch (against torch.nn.functional.rms_norm's)."""
import json
import os
import subprocess
import sys
import tempfile
import time

OP = "runtime"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LOAD_PROBE = r"""
import json, time
import cupy
cupy.cuda.runtime.getDevice(); cupy.cuda.Device(0).synchronize()   # CUDA context up before timing
from speedcore import norm
from speedcore._launch import get_kernel
k = norm._kernel("bfloat16", 1, True)
t = time.perf_counter()
lk = get_kernel(k, 0)
print(json.dumps({"seconds": time.perf_counter() - t, "from_disk": lk.compiled.from_disk}))
"""

_IMPORT_PROBE = "import time; t = time.perf_counter(); import speedcore; print(time.perf_counter() - t)"


def _python(code, env):
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    return p.stdout.strip().splitlines()[-1]


def compile_and_load_times(cache_dir):
    """(seconds for the first use of a variant with an empty cache, seconds in a new process from disk)."""
    import speedcore

    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(speedcore.__file__)))
    env = dict(os.environ, SPEEDCORE_CACHE_DIR=str(cache_dir), PYTHONPATH=pkg_parent)
    first = json.loads(_python(_LOAD_PROBE, env))
    second = json.loads(_python(_LOAD_PROBE, env))
    assert not first["from_disk"] and second["from_disk"]
    return first["seconds"], second["seconds"]


def import_seconds():
    import speedcore

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(speedcore.__file__))))
    return min(float(_python(_IMPORT_PROBE, env)) for _ in range(5))


def cases(b):
    return [("runtime import/compile/cache", _costs), ("runtime launch overhead", _launch_overhead)]


def _costs(b):
    b.add(OP, "import speedcore", "ms", import_seconds() * 1e3, {}, higher_is_better=False)
    with tempfile.TemporaryDirectory() as d:
        first, second = compile_and_load_times(d)
    b.add(OP, "first use of a variant: NVRTC compile + load", "ms", first * 1e3, {}, higher_is_better=False)
    b.add(OP, "new process: variant from the disk cache", "ms", second * 1e3, {}, higher_is_better=False)


def _launch_overhead(b):
    import speedcore

    torch = b.torch
    x = torch.randn(1, 4096, device=b.device, dtype=torch.bfloat16)
    w = torch.randn(4096, device=b.device, dtype=torch.bfloat16)
    out = torch.empty_like(x)

    def host_us(fn, n=3000):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t
        torch.cuda.synchronize()
        return dt / n * 1e6

    ours = host_us(lambda: speedcore.rms_norm(x, w, out=out))
    peer = host_us(lambda: torch.nn.functional.rms_norm(x, (4096,), w, 1e-6))
    b.add(OP, "host time per call, rms_norm 1x4096 bf16", "us", ours, {"torch.nn.functional.rms_norm": peer},
          higher_is_better=False)
