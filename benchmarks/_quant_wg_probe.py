"""Same-run probe for the quant dispatch (not a suite): qgemm_sm90_kernel ("wg"), the previous dispatch on the
same prepacked layer ("old": gemv_kernel / quant_mma_kernel for M <= 128, dequantize + cuBLAS above), cuBLAS
(F.linear, same dtype).  One line per case: times in us and ratios against cuBLAS."""
import sys
import time

import torch
import torch.nn.functional as F

import speedcore
from speedcore import quant as Q
from speedcore.bench import Bench

Q.WG_ENABLED = True  # build the wgmma copy at prepack; "off" timings still leave it out of the dispatch
b = Bench(quick=True)
t0 = time.time()
G = 128


def timed(call, x, wg_mode, cps=0):
    """wg_mode "on": qgemm_sm90_kernel at every M (no dense fallback); "off": the dispatch without it."""
    old_mode, old_cps, old_max = Q._WG_MODE, Q._WG_CTAS_PER_SM, Q.WG_MAX_M
    Q._WG_MODE, Q._WG_CTAS_PER_SM = wg_mode, cps
    if wg_mode == "on":
        Q.WG_MAX_M = 1 << 20
    try:
        return b.time_ms(lambda: call(x)) * 1e3
    finally:
        Q._WG_MODE, Q._WG_CTAS_PER_SM, Q.WG_MAX_M = old_mode, old_cps, old_max


def int4(fmt, n, k, dt, ms, cps_ms=()):
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
    assert layer.wg is not None
    w = torch.randn(n, k, device=dev, dtype=dt) * 0.01
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=dt)
        new = timed(call, x, "on")
        old = timed(call, x, "off")
        cub = b.time_ms(lambda: F.linear(x, w)) * 1e3
        extra = ""
        if m in cps_ms:
            for cps in (1, 2):
                t = timed(call, x, "on", cps)
                extra += f" | cps{cps} {t:7.1f}us x{cub / t:4.2f}"
        cfg = Q.wg_config(m, n, k, 132)
        print(f"{fmt:4s} {str(dt)[6:]:8s} M={m:<5d} {n:>5d}x{k:<5d} wg {new:8.1f}us x{cub / new:5.2f} | "
              f"old {old:8.1f}us x{cub / old:5.2f} | cuBLAS {cub:8.1f}us  [bm {cfg.bm} grid {cfg.grid} "
              f"tiles {cfg.tiles}]{extra}", flush=True)
    del layer, w, qw, qz
    torch.cuda.empty_cache()


bf, fp = torch.bfloat16, torch.float16
plan = sys.argv[1] if len(sys.argv) > 1 else "full"
MS = [1, 16, 17, 32, 64, 128, 256, 512, 1024, 2048]
if plan == "lean":
    int4("awq", 8192, 8192, bf, [1, 16, 32, 64, 128, 256, 512, 1024], cps_ms=(1, 16))
    int4("awq", 28672, 8192, bf, [1, 16, 64, 256], cps_ms=(1,))
    int4("awq", 4096, 4096, bf, [16, 32, 64, 128, 256])
    int4("awq", 8192, 28672, fp, [1, 64])
    print(f"probe done in {time.time() - t0:.0f}s", flush=True)
    sys.exit(0)
int4("awq", 8192, 8192, bf, MS, cps_ms=(1, 16, 32))
int4("awq", 28672, 8192, bf, MS, cps_ms=(1, 32))
int4("awq", 8192, 28672, bf, [1, 16, 32, 64, 256, 1024])
int4("awq", 4096, 4096, bf, [1, 16, 32, 64, 128, 256, 512, 1024, 2048], cps_ms=(16,))
int4("awq", 8192, 8192, fp, [16, 64, 256, 1024])
int4("gptq", 8192, 8192, bf, [64, 256])
print(f"probe done in {time.time() - t0:.0f}s", flush=True)
