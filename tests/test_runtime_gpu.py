"""The runtime on a GPU: compile time, disk-cache load time, device properties, launch checks."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = r"""
import json, sys, time
import cupy
cupy.cuda.runtime.getDevice(); cupy.cuda.Device(0).synchronize()   # CUDA context up before timing
from speedcore import norm
from speedcore._launch import get_kernel
k = norm._kernel("bfloat16", 1, True)
t = time.perf_counter()
lk = get_kernel(k, 0)
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "from_disk": lk.compiled.from_disk, "regs": lk.num_regs}))
"""


@pytest.mark.gpu
@pytest.mark.big
def test_first_compile_and_disk_cache_load_times(tmp_path):
    env = dict(os.environ, SPEEDCORE_CACHE_DIR=str(tmp_path), PYTHONPATH=ROOT)
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, cwd=ROOT)
        assert p.returncode == 0, p.stderr
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    first, second = runs
    print(f"\nfirst use (NVRTC compile + load): {first['seconds'] * 1e3:.0f} ms; "
          f"new process from disk cache: {second['seconds'] * 1e3:.1f} ms")
    assert not first["from_disk"] and second["from_disk"]
    assert first["seconds"] < 3.0
    assert second["seconds"] < 0.05


@pytest.mark.gpu
def test_device_info_and_launch_checks():
    from speedcore._launch import LaunchConfig, device_info, get_kernel
    from speedcore import norm

    d = device_info(0)
    assert d.sms > 0 and d.smem_per_block_optin >= 48 * 1024 and d.cc >= (8, 0)
    lk = get_kernel(norm._kernel("float16", 1, False), 0)
    with pytest.raises(ValueError, match="shared memory per block"):
        lk.check(LaunchConfig((1,), (128,), d.smem_per_block_optin + 1))
    with pytest.raises(ValueError, match="threads per block"):
        lk.check(LaunchConfig((1,), (2048,)))
    with pytest.raises(ValueError, match="grid"):
        lk.check(LaunchConfig((0,), (128,)))
