"""Lean same-run comparison for the small-M path (not a suite): ours (gemv_kernel), the previous kernel on the
same prepacked layer (quant_mma_kernel), cuBLAS (F.linear) and tinygemm; prints one line per case."""
import sys
import time

import torch
import torch.nn.functional as F

import speedcore
from speedcore import quant as Q
from speedcore.bench import Bench

b = Bench(quick=True)
Q._GEMV_MODE = "on"  # build the fragment-major copy for every layer (INT8 too)
t0 = time.time()
G = 128
rows = []


def line(op, m, n, k, dt, nbytes, ours, old, cub, tg=None):
    tb = lambda ms: nbytes / ms / 1e9  # noqa: E731
    s = (f"{op:5s} {str(dt)[6:]:8s} M={m:<3d} {n:>5d}x{k:<5d} ours {ours*1e3:7.1f}us {tb(ours):5.2f}TB/s | "
         f"mma {old*1e3:7.1f}us | cuBLAS {cub*1e3:7.1f}us x{cub/ours:4.2f}")
    if tg is not None:
        s += f" | tinygemm {tg*1e3:7.1f}us x{tg/ours:4.2f}"
    print(s, flush=True)


def both(call, x):
    Q._GEMV_MODE = "on"
    try:
        ours = b.time_ms(lambda: call(x))
        Q._GEMV_MODE = "off"
        old = b.time_ms(lambda: call(x))
    finally:
        Q._GEMV_MODE = "on"
    return ours, old


def int4(fmt, n, k, dt, ms, tiny):
    dev = b.device
    scales = (torch.rand(k // G, n, device=dev) * 0.01 + 0.001).to(dt)
    if fmt == "awq":
        qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device=dev)
        qz = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, device=dev)
        layer = Q.prepack_awq(qw, qz, scales, group_size=G)
        call = lambda x: speedcore.awq_linear(x, layer)  # noqa: E731
    else:
        qw = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev)
        qz = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, device=dev)
        layer = Q.prepack_gptq(qw, qz, scales, group_size=G)
        call = lambda x: speedcore.gptq_linear(x, layer)  # noqa: E731
    w = torch.randn(n, k, device=dev, dtype=dt) * 0.01
    tg = None
    if tiny and dt == torch.bfloat16:
        wi = torch.randint(0, 16, (n, k), dtype=torch.int32, device=dev)
        wu8 = (wi[:, ::2] << 4 | wi[:, 1::2]).to(torch.uint8)
        del wi
        tg = (torch.ops.aten._convert_weight_to_int4pack(wu8, 8),
              torch.rand(k // G, n, 2, device=dev, dtype=torch.bfloat16) * 0.01)
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=dt)
        ours, old = both(call, x)
        cub = b.time_ms(lambda: F.linear(x, w))
        t = None
        if tg is not None:
            t = b.time_ms(lambda: torch.ops.aten._weight_int4pack_mm(x, tg[0], G, tg[1]))
        nbytes = k * n // 2 + (k // G) * n * 2 + (k // G) * n // 2 + 2 * m * (k + n)
        line(fmt, m, n, k, dt, nbytes, ours, old, cub, t)
    del layer, w, qw, qz, tg
    torch.cuda.empty_cache()


def int8(n, k, dt, ms):
    dev = b.device
    w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=dev)
    s = (torch.rand(n, device=dev) * 0.01 + 0.001).to(dt)
    layer = Q.prepack_int8(w8, s)
    w = torch.randn(n, k, device=dev, dtype=dt) * 0.01
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=dt)
        ours, old = both(lambda x: speedcore.int8_linear(x, layer), x)
        cub = b.time_ms(lambda: F.linear(x, w))
        line("int8", m, n, k, dt, k * n + 2 * n + 2 * m * (k + n), ours, old, cub)
    del layer, w, w8
    torch.cuda.empty_cache()


print("copy ceiling TB/s", round(b.ceiling("copy"), 3), flush=True)
for mb in (33.5, 117.4):
    a = torch.ones(int(mb * 1e6) // 4, dtype=torch.float32, device=b.device)
    ms = b.time_ms(lambda: a.sum())
    print(f"read-only reference: torch.sum over {mb} MB: {ms*1e3:.1f} us = {mb*1e6/ms/1e9:.2f} TB/s", flush=True)
    del a
bf, fp = torch.bfloat16, torch.float16
plan = sys.argv[1] if len(sys.argv) > 1 else "full"
int4("awq", 8192, 8192, bf, [1, 4, 8, 9, 16], True)
int4("awq", 28672, 8192, bf, [1, 16], True)
int4("awq", 8192, 8192, fp, [1, 16], False)
int4("awq", 28672, 8192, fp, [1, 16], False)
int8(8192, 8192, bf, [1, 8, 16])
int8(28672, 8192, bf, [1, 16])
int8(8192, 8192, fp, [1])
int8(28672, 8192, fp, [1])
if plan == "full":
    int4("awq", 8192, 28672, bf, [1, 16], True)
    int4("awq", 4096, 4096, bf, [1, 16], True)
    int4("awq", 4096, 4096, fp, [1, 16], False)
    int4("gptq", 8192, 8192, bf, [1, 16], False)
print(f"bench done in {time.time() - t0:.0f}s", flush=True)
