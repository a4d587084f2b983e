"""Skinny GEMM on small layers (not a suite): the same-size ceilings (a device copy moving the layer's bytes, half
read and half written, and a read-only int32 max) under the bench's protocol (L2 flushed by a read, medians), then
at M = 1 / 16 on 4096x4096 and 14336x4096 cuBLAS, the shipped dispatch and forced skinny configurations (deeper
rings, 16- / 64-column tiles, 64-k tiles), five interleaved rounds, TB/s of weights.

    PYTHONPATH=. python3 benchmarks/_gemm_skinny_ab.py
"""
import statistics, torch, torch.nn.functional as F
import speedcore
from speedcore import gemm as G
from speedcore.bench import Bench
b = Bench(quick=True)
orig = G.mma_config
C = G.MmaConfig
ALTS = {"deep8": C(16, 32, 128, 1, 1, 8, 8), "deep12": C(16, 32, 128, 1, 1, 8, 12), "deep16": C(16, 32, 128, 1, 1, 8, 16),
        "n16": C(16, 16, 128, 1, 1, 8, 8), "k64s16": C(16, 32, 64, 1, 1, 4, 16), "n64": C(16, 64, 128, 1, 2, 4, 8)}
def forced(cfg):
    def f(m, n, k, sms, smem, skinny, kmajor=True):
        return cfg if skinny else orig(m, n, k, sms, smem, skinny, kmajor)
    return f
def t_forced(cfg, x, w):
    G.mma_config = forced(cfg); G._plan.cache_clear()
    try:
        y = speedcore.linear(x, w); return b.time_ms(lambda: speedcore.linear(x, w)), y
    finally:
        G.mma_config = orig; G._plan.cache_clear()
for nbytes in (32 << 20, 117 << 20):
    src = torch.randint(0, 100, (nbytes // 8,), dtype=torch.int32, device="cuda"); dst = torch.empty_like(src)
    rd = torch.randint(0, 100, (nbytes // 4,), dtype=torch.int32, device="cuda")
    tc = statistics.median(b.time_ms(lambda: dst.copy_(src)) for _ in range(5))
    tr = statistics.median(b.time_ms(lambda: rd.max()) for _ in range(5))
    print(f"{nbytes >> 20} MB: copy (half read, half written) {nbytes / tc / 1e9:.2f} TB/s, read (int32 max) {nbytes / tr / 1e9:.2f} TB/s", flush=True)
for n, k in ((4096, 4096), (14336, 4096)):
    for m in (1, 16):
        for dt in (torch.bfloat16,):
            x = torch.randn(m, k, device="cuda", dtype=dt); w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
            ref = speedcore.linear(x, w); res = {}
            for _ in range(5):
                res.setdefault("cuBLAS", []).append(b.time_ms(lambda: F.linear(x, w)))
                res.setdefault("ours", []).append(b.time_ms(lambda: speedcore.linear(x, w)))
                for tag, cfg in ALTS.items():
                    t, y = t_forced(cfg, x, w); res.setdefault(tag, []).append(t)
                    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2, tag
            gb = n * k * 2 / 1e9
            print(f"{m}x{n}x{k}: " + " | ".join(f"{t} {gb / statistics.median(v):.2f}" for t, v in res.items()), flush=True)
