"""Same-run probe for INT8 on w4_wgmma_kernel (KIND = W_INT8; not a suite): prepacked INT8 layers (random bytes,
per-channel scales) with the SPEEDCORE_QUANT_W8WGMMA switch on while prepacking, "w8wgmma" (switch on at call time),
"current" (switch off: quant_mma_kernel up to MAX_MMA_M, dequant_int8_kernel + cuBLAS above) and cuBLAS (F.linear
with a bf16 / fp16 weight of the same shape), bf16 and fp16, at M = 17, 64, 256, 1024, 2048 on 8192x8192 and
28672x8192 unless M values are given.  Each output is checked against the current path (rel diff; "!!" above 1e-2).

    PYTHONPATH=. python3 benchmarks/probes/quant_w8wgmma_probe.py [M ...]
"""
import sys

import torch
import torch.nn.functional as F

from speedcore import quant as Q
from speedcore.bench import Bench

import speedcore

b = Bench(quick=True)
MS = [int(a) for a in sys.argv[1:]] or [17, 64, 256, 1024, 2048]
rows = []
for dt in (torch.bfloat16, torch.float16):
    for n, k in ((8192, 8192), (28672, 8192)):
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=b.device)
        s = (torch.rand(n, device=b.device) * 0.01 + 0.001).to(dt)
        Q._W8WGMMA_MODE = "on"
        layer = Q.prepack_int8(q, s)
        assert layer.gemv is not None and layer.gemv.w4_ptr
        w = torch.randn(n, k, device=b.device, dtype=dt) * 0.01
        for m in MS:
            x = torch.randn(m, k, device=b.device, dtype=dt)
            Q._W8WGMMA_MODE = "off"
            y_cur = speedcore.int8_linear(x, layer)
            cur = b.time_ms(lambda: speedcore.int8_linear(x, layer))
            Q._W8WGMMA_MODE = "on"
            y = speedcore.int8_linear(x, layer)
            ours = b.time_ms(lambda: speedcore.int8_linear(x, layer))
            cub = b.time_ms(lambda: F.linear(x, w))
            e = ((y.float() - y_cur.float()).norm() / y_cur.float().norm()).item()
            cfg = Q.w4wgmma_config(m, n, k, torch.cuda.get_device_properties(b.device).multi_processor_count,
                                   kind=Q.KIND_INT8)
            rows.append((f"int8 {str(dt)[6:]:8s} M={m:<4d} {n:>5d}x{k:<5d}", ours, cur, cub, e,
                         f"b{cfg.blk}m{cfg.mt}s{cfg.splits}g{cfg.gs}"))
            print(rows[-1][0], f"w8wgmma {ours * 1e3:.1f} current {cur * 1e3:.1f} cuBLAS {cub * 1e3:.1f} us",
                  "" if e < 1e-2 else f"!! rel diff {e:.1e}", flush=True)
        del layer, q, w
        torch.cuda.empty_cache()
print("\nsummary: us; x = cuBLAS / time (same run)")
print(f"{'case':34s} {'w8wgmma':>8s} {'x':>5s} {'current':>8s} {'x':>5s} {'cuBLAS':>8s} shape")
for label, ours, cur, cub, e, shape in rows:
    print(f"{label:34s} {ours * 1e3:8.1f} {cub / ours:5.2f} {cur * 1e3:8.1f} {cub / cur:5.2f} {cub * 1e3:8.1f} {shape}"
          + ("" if e < 1e-2 else f"  !! {e:.1e}"))
