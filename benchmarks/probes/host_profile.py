"""Where the host time of one eager call goes: the pieces of a cached rms_norm / linear call timed alone
(signature keys, allocation, stream query, launch), beside the whole call and the torch op."""
import time

import torch

import speedcore
from speedcore import _arrays as A
from speedcore import _launch, norm


def us(fn, n=2000):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n // 5):
            fn()
        best = min(best, (time.perf_counter() - t) / (n // 5) * 1e6)
        torch.cuda.synchronize()
    return best


x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
wl = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
dev = torch.device("cuda", 0)
rows = [
    ("speedcore.rms_norm", lambda: speedcore.rms_norm(x, w)),
    ("F.rms_norm", lambda: torch.nn.functional.rms_norm(x, (4096,), w, 1e-6)),
    ("speedcore.linear 1x4096x4096", lambda: speedcore.linear(x, wl)),
    ("F.linear", lambda: torch.nn.functional.linear(x, wl)),
    ("sig(x)", lambda: A.sig(x)),
    ("key of 4 + dict get", lambda: {}.get((A.sig(x), A.sig(w), A.sig(None), A.sig(None), 1e-6))),
    ("torch.empty((1,4096))", lambda: torch.empty((1, 4096), dtype=torch.bfloat16, device=dev)),
    ("x.new_empty", lambda: x.new_empty((1, 4096))),
    ("raw stream", lambda: A._torch_stream_ptr(0)),
    ("data_ptr", lambda: x.data_ptr()),
    ("compiling()", lambda: speedcore._torch_hook.compiling()),
    ("cupy getDevice", lambda: _launch._get_device()),
]
speedcore.rms_norm(x, w)
plan = next(iter(norm._PLANS.values()))
rows.append(("rms_norm plan only", lambda: plan(x, w, None, None)))
rows.append(("torch.empty_like(x)", lambda: torch.empty_like(x)))
fl = next(iter(next(iter(_launch._loaded.values())).bound.values()))
lay = _launch.arg_layout((int,) * 5 + (type(1),) * 0)
args = (x.data_ptr(), 0, x.data_ptr(), 0, w.data_ptr())
rows.append(("pack 5 ints", lambda: lay.pack(args)))
import cupy
from cupy.cuda import driver
k = next(iter(_launch._loaded.values()))
func = k.func.ptr
import numpy as np
full = (x.data_ptr(), 0, x.data_ptr(), 0, w.data_ptr(), np.int32(4096), np.int64(4096), np.int64(0), np.int64(4096),
        np.int64(0), np.float32(1e-6))
lay2 = _launch.arg_layout(tuple(map(type, full)))
pp = lay2.pack(full)
rows.append(("pack 11 args", lambda: lay2.pack(full)))
out = torch.empty_like(x)
full2 = (out.data_ptr(),) + full[1:]
pp2 = lay2.pack(full2)
rows.append(("driver.launchKernel only", lambda: driver.launchKernel(func, 1, 1, 1, 128, 1, 1, 0, 0, pp2, 0)))
bl = k.bind(_launch.LaunchConfig((1,), (128,)))
rows.append(("BoundLaunch.launch_packed", lambda: bl.launch_packed(0, pp2)))
for name, fn in rows:
    print(f"{name:34s} {us(fn):8.2f} us")
