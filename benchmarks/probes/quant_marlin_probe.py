"""Same-run probe for quant_marlin_kernel (not a suite): on prepacked AWQ layers (random packed words, group 128),
"marlin" (the kernel forced on, its heuristic launch shape), "current" (the dispatch with it off: quant_mma_kernel
at M > 16) and cuBLAS (F.linear, same dtype), at M = 17, 32, 64, 128 on 8192x8192 and 28672x8192, bf16 and fp16;
a grid sweep (bf16: P = tiles x {1, 2, 4}, SMs, 2 SMs; "g<P> <us>") against the heuristic's P; one GPTQ row.
Each variant's output is checked against the current dispatch (relative difference printed when above 1e-2).  One line per case, then the summary table last.

    PYTHONPATH=. python3 benchmarks/probes/quant_marlin_probe.py
"""
import time

import torch
import torch.nn.functional as F

from speedcore import quant as Q
from speedcore.bench import Bench

import speedcore

b = Bench(quick=True)
t0 = time.time()
G = 128
summary = []


def timed(call, x, mode, defines=(), **override):
    saved = (Q._MARLIN_MODE, dict(Q._MARLIN_OVERRIDE), Q._MARLIN_DEFINES)
    Q._MARLIN_MODE = mode
    Q._MARLIN_OVERRIDE.clear()
    Q._MARLIN_OVERRIDE.update(override)
    Q._MARLIN_DEFINES = tuple(defines)
    try:
        y = call(x)
        return b.time_ms(lambda: call(x)), y
    finally:
        Q._MARLIN_MODE = saved[0]
        Q._MARLIN_OVERRIDE.clear()
        Q._MARLIN_OVERRIDE.update(saved[1])
        Q._MARLIN_DEFINES = saved[2]


def layer_of(fmt, n, k, dt):
    dev = b.device
    scales = (torch.rand(k // G, n, device=dev) * 0.01 + 0.001).to(dt)
    if fmt == "gptq":
        qw = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev)
        qz = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, device=dev)
        layer = Q.prepack_gptq(qw, qz, scales, group_size=G)
        return lambda x: speedcore.gptq_linear(x, layer)
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device=dev)
    qz = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, device=dev)
    layer = Q.prepack_awq(qw, qz, scales, group_size=G)
    return lambda x: speedcore.awq_linear(x, layer)


def rel(a, ref):
    return ((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def case(fmt, n, k, dt, ms, sweep=False):
    call = layer_of(fmt, n, k, dt)
    w = torch.randn(n, k, device=b.device, dtype=dt) * 0.01
    sms = torch.cuda.get_device_properties(b.device).multi_processor_count
    for m in ms:
        x = torch.randn(m, k, device=b.device, dtype=dt)
        cur, y_cur = timed(call, x, "off")
        ours, y = timed(call, x, "on")
        cfg = Q.marlin_config(m, n, k, sms)
        e = rel(y, y_cur)
        flag = "" if e < 1e-2 else f"  !! marlin vs current: rel diff {e:.2e}"
        extra = []
        tms = cfg.n_tiles * cfg.m_chunks
        units = tms * (k // 128)
        grids = sorted({min(units, p) for p in (tms, 2 * tms, 4 * tms, sms, 2 * sms)} - {cfg.ctas}) if sweep else []
        for p in grids:
            t, ys = timed(call, x, "on", ctas=p)
            es = rel(ys, y_cur)
            extra.append(f"g{p} {t * 1e3:5.1f}" + ("" if es < 1e-2 else f"(!! {es:.1e})"))
        cub = b.time_ms(lambda: F.linear(x, w))
        label = f"{fmt:4s} {str(dt)[6:]:8s} M={m:<3d} {n:>5d}x{k:<5d}"
        print(f"{label} marlin {ours * 1e3:6.1f}us x{cub / ours:4.2f} (grid {cfg.grid}, {tms} tiles, mt{cfg.mt}) | "
              f"current {cur * 1e3:6.1f}us x{cub / cur:4.2f} | cuBLAS {cub * 1e3:6.1f}us"
              + (" | " + " ".join(extra) if extra else "") + flag, flush=True)
        summary.append((label, ours, cur, cub, e))
    del w
    torch.cuda.empty_cache()


bf, fp = torch.bfloat16, torch.float16
tiny = torch.ones(1, device=b.device)
print(f"launch floor: tiny add_ {b.time_ms(lambda: tiny.add_(1.0)) * 1e3:.1f} us", flush=True)
for dt in (bf, fp):
    for n, k in ((8192, 8192), (28672, 8192)):
        sweep = dt is bf
        case("awq", n, k, dt, [17, 32, 64, 128], sweep)
case("gptq", 8192, 8192, bf, [64])
print(f"\nsummary ({time.time() - t0:.0f} s): time in us, speed-up over cuBLAS (F.linear) in the same run")
print(f"{'case':34s} {'marlin':>8s} {'x':>5s} {'current':>8s} {'x':>5s} {'cuBLAS':>8s} {'rel diff':>9s}")
for label, ours, cur, cub, e in summary:
    print(f"{label:34s} {ours * 1e3:8.1f} {cub / ours:5.2f} {cur * 1e3:8.1f} {cub / cur:5.2f} {cub * 1e3:8.1f} {e:9.1e}")
