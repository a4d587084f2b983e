"""Same-run probe for the small-M paths (not a suite): gemv_stream_kernel (default launch shape and a sweep of
warps / splits / L2 prefetch distance), the previous dispatch on the same prepacked layer (stream off), and
cuBLAS (F.linear, same dtype); read-bandwidth references.  Prints one line per case, a summary table last."""
import sys
import time

import torch
import torch.nn.functional as F

import speedcore
from speedcore import quant as Q
from speedcore.bench import Bench

b = Bench(quick=True)
t0 = time.time()
G = 128
summary = []


def tb(nbytes, ms):
    return nbytes / ms / 1e9


def timed(call, x, mode="on", **override):
    Q._STREAM_MODE = mode
    Q._STREAM_OVERRIDE.clear()
    Q._STREAM_OVERRIDE.update(override)
    try:
        return b.time_ms(lambda: call(x))
    finally:
        Q._STREAM_MODE = "on"
        Q._STREAM_OVERRIDE.clear()


def layer_int4(fmt, n, k, dt):
    dev = b.device
    scales = (torch.rand(k // G, n, device=dev) * 0.01 + 0.001).to(dt)
    if fmt == "awq":
        qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device=dev)
        qz = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, device=dev)
        layer = Q.prepack_awq(qw, qz, scales, group_size=G)
        return layer, (lambda x: speedcore.awq_linear(x, layer))
    qw = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev)
    qz = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, device=dev)
    layer = Q.prepack_gptq(qw, qz, scales, group_size=G)
    return layer, (lambda x: speedcore.gptq_linear(x, layer))


def case(fmt, n, k, dt, ms, sweep=()):
    dev = b.device
    if fmt == "int8":
        w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=dev)
        s = (torch.rand(n, device=dev) * 0.01 + 0.001).to(dt)
        layer = Q.prepack_int8(w8, s)
        call = lambda x: speedcore.int8_linear(x, layer)  # noqa: E731
        kind = Q.KIND_INT8
    else:
        layer, call = layer_int4(fmt, n, k, dt)
        kind = Q.KIND_INT4
    w = torch.randn(n, k, device=dev, dtype=dt) * 0.01
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=dt)
        nbytes = (k * n if fmt == "int8" else k * n // 2 + (k // G) * n * 3) + 2 * m * (k + n)
        ours = timed(call, x)
        old = timed(call, x, "off")
        cub = b.time_ms(lambda: F.linear(x, w))
        cfg = Q.stream_config(m, n, k, kind, 132)
        label = f"{fmt:4s} {str(dt)[6:]:8s} M={m:<2d} {n:>5d}x{k:<5d}"
        print(f"{label} stream {ours*1e3:6.1f}us {tb(nbytes, ours):4.2f}TB/s x{cub/ours:4.2f} | old {old*1e3:6.1f}us "
              f"x{cub/old:4.2f} | cuBLAS {cub*1e3:6.1f}us  [W{cfg.warps} sp{cfg.splits} pf{cfg.prefetch} "
              f"grid {cfg.grid}]", flush=True)
        summary.append((label, ours, old, cub))
        if m in (1, 16) or m == ms[0]:
            for ov in sweep:
                t = timed(call, x, **ov)
                print(f"    {ov} {t*1e3:6.1f}us {tb(nbytes, t):4.2f}TB/s x{cub/t:4.2f}", flush=True)
    del layer, w
    torch.cuda.empty_cache()


print("copy ceiling TB/s", round(b.ceiling("copy"), 3), flush=True)
for mb in (35.0, 122.0):
    a = torch.ones(int(mb * 1e6) // 4, dtype=torch.float32, device=b.device)
    t = b.time_ms(lambda: a.sum())
    print(f"read reference: torch.sum over {mb} MB: {t*1e3:.1f} us = {mb*1e6/t/1e9:.2f} TB/s", flush=True)
    del a
tiny = torch.ones(1, device=b.device)
print(f"launch floor: tiny add_ {b.time_ms(lambda: tiny.add_(1.0))*1e3:.1f} us", flush=True)

bf, fp = torch.bfloat16, torch.float16
PF = [{"prefetch": p} for p in (0, 2, 3)]
case("awq", 8192, 8192, bf, [1, 4, 8, 9, 16],
     PF + [{"warps": 8, "splits": 2}, {"warps": 12}, {"warps": 8}, {"warps": 4, "splits": 4}, {"warps": 16, "splits": 2}])
case("awq", 28672, 8192, bf, [1, 16], PF + [{"warps": 2}, {"warps": 8}, {"warps": 3}])
case("awq", 8192, 28672, bf, [1, 16], PF + [{"warps": 8}])
case("awq", 4096, 4096, bf, [1, 16], PF + [{"warps": 16, "splits": 1}, {"warps": 8, "splits": 4}])
case("awq", 8192, 8192, fp, [1, 16])
case("gptq", 8192, 8192, bf, [1, 16])
case("int8", 8192, 8192, bf, [1, 16], PF + [{"warps": 4}, {"warps": 16}])
case("int8", 28672, 8192, bf, [1], PF)
case("int8", 8192, 8192, fp, [1])

print(f"\nprobe done in {time.time() - t0:.0f}s\nsummary (us; ratio = cuBLAS / ours)")
for label, ours, old, cub in summary:
    print(f"{label} stream {ours*1e3:6.1f} x{cub/ours:4.2f} | old {old*1e3:6.1f} x{cub/old:4.2f} | cuBLAS {cub*1e3:6.1f}")
