"""Same-process A/B of the Hopper GEMM's tile for two 64-row blocks (M = 96-128) on decode-sized layers (not a
suite): the shipped choice ("def") against forced 128 x 64, 128 x 128 and 64 x 64 tiles, each with the splits
wgmma_splits gives it, three interleaved rounds (best of each), next to cuBLAS (F.linear); outputs checked against
each other.  The numbers behind WGMMA_ROWS128_MIN_K (speedcore/gemm.py).

    PYTHONPATH=. python3 benchmarks/_gemm_rows128_ab.py
"""
import torch, torch.nn.functional as F
import speedcore
from speedcore import gemm
from speedcore.bench import Bench
b = Bench(quick=True)
SMS = 132
orig = gemm.wgmma_config
def forced(bm, bn):
    def f(m, n, k, sms, smem, kmajor=True):
        return gemm.WgmmaConfig(bm, bn, gemm._wgmma_stages(bm, bn, smem))
    return f
def timed(x, w, cfgf):
    gemm.wgmma_config = cfgf; gemm._plan.cache_clear()
    try:
        y = speedcore.linear(x, w); return b.time_ms(lambda: speedcore.linear(x, w)), y
    finally:
        gemm.wgmma_config = orig; gemm._plan.cache_clear()
for dt in (torch.bfloat16, torch.float16):
    for m, n, k in [(128, 4096, 14336), (128, 4096, 4096), (96, 4096, 14336), (128, 4096, 11008), (128, 8192, 8192), (128, 14336, 4096)]:
        x = torch.randn(m, k, device="cuda", dtype=dt); w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
        res = {}
        alts = {"def": orig, "128x64": forced(128, 64), "128x128": forced(128, 128), "64x64": forced(64, 64)}
        ref = None
        for _ in range(3):
            for tag, f in alts.items():
                t, y = timed(x, w, f); res.setdefault(tag, []).append(t)
                if ref is None: ref = y
                else: assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2, tag
            res.setdefault("cuBLAS", []).append(b.time_ms(lambda: F.linear(x, w)))
        cub = min(res["cuBLAS"])
        cfg = orig(m, n, k, SMS, 232448, True)
        sp = {t: gemm.wgmma_splits(m, n, k, (cfg if t == "def" else gemm.WgmmaConfig(int(t.split('x')[0]), int(t.split('x')[1]), 4)), SMS) for t in alts}
        print(f"{str(dt)[6:]} {m}x{n}x{k} cuBLAS {cub*1e3:.1f}us | " + " | ".join(f"{t}(s{sp[t]}) {min(v)*1e3:.1f} {cub/min(v):.3f}" for t, v in res.items() if t != "cuBLAS"), flush=True)
