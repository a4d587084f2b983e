"""The INT4 dense path's parts on small and large layers (not a suite): dequantize_awq alone (TB/s of its int4
read + 16-bit write), awq_linear at M = 256-2048 as dispatched, forced onto the dense path (w4_wgmma_kernel off:
dequantize + cuBLAS) and forced onto w4_wgmma_kernel, next to cuBLAS on the float weight.  us, medians, bf16.

    PYTHONPATH=. python3 benchmarks/_quant_dense_probe.py
"""
import torch
import torch.nn.functional as F

import speedcore
from speedcore import quant as Q
from speedcore.bench import Bench

b = Bench(quick=True)
G = 128
for n, k in ((4096, 4096), (8192, 8192), (14336, 4096)):
    dt = torch.bfloat16
    scales = (torch.rand(k // G, n, device="cuda") * 0.01 + 0.001).to(dt)
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device="cuda")
    qz = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, device="cuda")
    t = b.time_ms(lambda: Q.dequantize_awq(qw, qz, scales, group_size=G))
    print(f"{n}x{k} dequantize_awq {t * 1e3:.1f} us, {(k * n // 2 + k * n * 2) / t / 1e9:.2f} TB/s", flush=True)
    layer = Q.prepack_awq(qw, qz, scales, group_size=G)
    w = torch.randn(n, k, device="cuda", dtype=dt) * 0.01
    for m in (256, 512, 1024, 2048):
        x = torch.randn(m, k, device="cuda", dtype=dt)
        row = {"auto": b.time_ms(lambda: speedcore.awq_linear(x, layer))}
        for mode in ("off", "on"):
            old = Q._W4WGMMA_MODE
            Q._W4WGMMA_MODE = mode
            try:
                row["dense" if mode == "off" else "w4wgmma"] = b.time_ms(lambda: speedcore.awq_linear(x, layer))
            except Exception as exc:  # noqa: BLE001
                row[mode] = float("nan")
                print("  ", mode, type(exc).__name__, exc)
            finally:
                Q._W4WGMMA_MODE = old
        cub = b.time_ms(lambda: F.linear(x, w))
        print(f"  M={m}: " + " | ".join(f"{kk} {v * 1e3:.1f}" for kk, v in row.items()) + f" | cuBLAS {cub * 1e3:.1f}",
              flush=True)
