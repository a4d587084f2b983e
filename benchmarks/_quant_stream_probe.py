"""Same-run probe for the small-M paths (not a suite): gemv_bulk_kernel (default launch shape and a sweep of
warps / splits / ring stages), gemv_stream_kernel, the previous dispatch on the same prepacked layer (neither),
and cuBLAS (F.linear, same dtype); read-bandwidth references.  Prints one line per case, a summary table last."""
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


def timed(call, x, which, **override):
    """which: "bulk" (gemv_bulk_kernel), "stream" (gemv_stream_kernel), "old" (neither: the previous dispatch)."""
    modes = (Q._STREAM_MODE, Q._BULK_MODE)
    Q._STREAM_MODE = "off" if which == "old" else "on"
    Q._BULK_MODE = "on" if which == "bulk" else "off"
    ov = Q._BULK_OVERRIDE if which == "bulk" else Q._STREAM_OVERRIDE
    ov.clear()
    ov.update(override)
    try:
        return b.time_ms(lambda: call(x))
    finally:
        Q._STREAM_MODE, Q._BULK_MODE = modes
        Q._STREAM_OVERRIDE.clear()
        Q._BULK_OVERRIDE.clear()


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
    else:
        layer, call = layer_int4(fmt, n, k, dt)
    w = torch.randn(n, k, device=dev, dtype=dt) * 0.01
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=dt)
        nbytes = (k * n if fmt == "int8" else k * n // 2 + (k // G) * n * 3) + 2 * m * (k + n)
        ours = b.time_ms(lambda: call(x))  # the dispatch as shipped
        old = timed(call, x, "old")
        cub = b.time_ms(lambda: F.linear(x, w))
        label = f"{fmt:4s} {str(dt)[6:]:8s} M={m:<2d} {n:>5d}x{k:<5d}"
        print(f"{label} default {ours*1e3:6.1f}us {tb(nbytes, ours):4.2f}TB/s x{cub/ours:4.2f} | old "
              f"{old*1e3:6.1f}us x{cub/old:4.2f} | cuBLAS {cub*1e3:6.1f}us", flush=True)
        row = {"default": ours}
        if m in (1, 16):
            for name, which, ov in sweep:
                if m > 8 and ov.get("stages", 0) > 4:
                    continue
                t = timed(call, x, which, **ov)
                row[name] = t
                print(f"    {name:14s} {t*1e3:6.1f}us {tb(nbytes, t):4.2f}TB/s x{cub/t:4.2f}", flush=True)
        summary.append((label, row, old, cub))
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
V = [("stream o0", "stream", {"order": 0}), ("stream o1", "stream", {"order": 1}),
     ("stream o2", "stream", {"order": 2}),
     ("stream o1 W8", "stream", {"order": 1, "warps": 8}), ("bulk o0 S2", "bulk", {"order": 0, "stages": 2}),
     ("bulk o1", "bulk", {"order": 1}), ("bulk o1 S2", "bulk", {"order": 1, "stages": 2}),
     ("bulk o2", "bulk", {"order": 2}), ("bulk o2 S2", "bulk", {"order": 2, "stages": 2})]
for nn, kk in ((2048, 8192), (7168, 8192)):
    wd = torch.randn(nn, kk, device=b.device, dtype=bf)
    xd = torch.randn(1, kk, device=b.device, dtype=bf)
    t = b.time_ms(lambda: F.linear(xd, wd))
    print(f"equal-bytes reference: cuBLAS M=1 {nn}x{kk} bf16 ({nn * kk * 2 / 1e6:.1f} MB): {t*1e3:.1f} us = "
          f"{nn * kk * 2 / t / 1e9:.2f} TB/s", flush=True)
    del wd
case("awq", 8192, 8192, bf, [1, 4, 8, 9, 16], V)
case("awq", 28672, 8192, bf, [1, 16], V)
case("awq", 8192, 28672, bf, [1, 16], V)
case("awq", 4096, 4096, bf, [1, 16], V)
case("awq", 8192, 8192, fp, [1, 16], V[:4])
case("awq", 28672, 8192, fp, [1, 16])
case("gptq", 8192, 8192, bf, [1, 16], V[:4])
case("int8", 8192, 8192, bf, [1, 16], V)
case("int8", 28672, 8192, bf, [1], V)
case("int8", 8192, 8192, fp, [1], V[:4])

print(f"\nprobe done in {time.time() - t0:.0f}s\nsummary (us; xR = cuBLAS / time)")
names = ["default"] + [v[0] for v in V]
print(f"{'case':34s} " + " ".join(f"{nm[:11]:>11s}" for nm in names) + "      old  cuBLAS")
for label, row, old, cub in summary:
    cells = " ".join((f"{row[nm]*1e3:5.1f}x{cub/row[nm]:4.2f}" if nm in row else " " * 10).rjust(11)
                     for nm in names)
    print(f"{label:34s} {cells} {old*1e3:5.1f}x{cub/old:4.2f} {cub*1e3:6.1f}")
