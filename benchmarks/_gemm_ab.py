"""Ad-hoc: skinny vs Hopper (split-K as the heuristic picks, and forced off) vs cuBLAS for decode-to-prefill M."""
import torch
import speedcore
from speedcore import gemm
from speedcore.bench import Bench

b = Bench(quick=True)
F = torch.nn.functional
real = gemm.wgmma_splits
for m in (48, 64, 96, 128):
    for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        tb = lambda ms: (n * k * 2 + m * k * 2 + m * n * 2) / ms / 1e9  # noqa: E731
        row = [f"{m}x{n}x{k}: cuBLAS {tb(b.time_ms(lambda: F.linear(x, w))):.2f}"]
        paths = (["skinny"] if m <= 64 else []) + ["hopper"]
        for p in paths:
            gemm.wgmma_splits = real
            gemm._plan.cache_clear()
            row.append(f"{p} {tb(b.time_ms(lambda: speedcore.linear(x, w, _path=p))):.2f}")
        cfg = gemm.wgmma_config(m, n, k, 132, 232448)
        if real(m, n, k, cfg, 132) > 1:
            gemm.wgmma_splits = lambda *a: 1
            gemm._plan.cache_clear()
            row.append(f"hopper-nosplit {tb(b.time_ms(lambda: speedcore.linear(x, w, _path='hopper'))):.2f}")
            row.append(f"(splits {real(m, n, k, cfg, 132)})")
        gemm.wgmma_splits = real
        gemm._plan.cache_clear()
        print(" | ".join(row), "TB/s", flush=True)
