"""Same-process A/B of split-K on the Hopper GEMM path (not a suite): decode-sized M on N = 4096 (64 tiles of
64 x 64 without splits, half the H200's SMs idle) and a few neighbours, with the heuristic's splits against
WGMMA_MAX_SPLITS = 1 (no split), interleaved ABAB per shape, next to cuBLAS (F.linear, same dtype); outputs checked
against each other.  TB/s of the weight read (ratio to cuBLAS in brackets).

    PYTHONPATH=. python3 benchmarks/_gemm_splitk_ab.py
"""
import torch
import torch.nn.functional as F

import speedcore
from speedcore import gemm
from speedcore.bench import Bench

b = Bench(quick=True)
SMS = torch.cuda.get_device_properties(0).multi_processor_count
CASES = [(64, 4096, 4096), (64, 4096, 14336), (48, 4096, 14336), (64, 4096, 11008), (40, 2048, 8192),
         (64, 8192, 8192), (128, 4096, 4096), (64, 14336, 4096)]


def timed(x, w, max_splits):
    old = gemm.WGMMA_MAX_SPLITS
    gemm.WGMMA_MAX_SPLITS = max_splits
    gemm._plan.cache_clear()
    try:
        y = speedcore.linear(x, w)
        return b.time_ms(lambda: speedcore.linear(x, w)), y
    finally:
        gemm.WGMMA_MAX_SPLITS = old
        gemm._plan.cache_clear()


print(f"{'case':22s} {'splits':>6s} {'split-K':>14s} {'no split':>14s} {'cuBLAS':>8s}")
for dt in (torch.bfloat16,):
    for m, n, k in CASES:
        x = torch.randn(m, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
        cfg = gemm.wgmma_config(m, n, k, SMS, 232448, True)
        s = gemm.wgmma_splits(m, n, k, cfg, SMS)
        ts, tn = [], []
        for _ in range(2):
            t, y_s = timed(x, w, gemm.WGMMA_MAX_SPLITS)
            ts.append(t)
            t, y_n = timed(x, w, 1)
            tn.append(t)
        cub = b.time_ms(lambda: F.linear(x, w))
        err = ((y_s.float() - y_n.float()).norm() / y_n.float().norm()).item()
        gb = n * k * 2 / 1e9
        t_s, t_n = min(ts), min(tn)
        print(f"{m}x{n}x{k:<6d}{' ':3s} {s:6d} {gb / t_s:6.2f} ({cub / t_s:4.2f}) {gb / t_n:6.2f} ({cub / t_n:4.2f}) "
              f"{gb / cub:6.2f}" + ("" if err < 1e-2 else f"  !! rel diff {err:.1e}"), flush=True)
