"""Same-run probe of the INT4 paths at 1 < M <= 16 (not a suite): on prepacked AWQ layers (random packed words,
group 128), each M times gemv_stream_kernel (today's dispatch, and with its split / warp overrides),
w4_wgmma_kernel forced down to that M, quant_marlin_kernel forced, and cuBLAS (F.linear, same dtype); every output
checked against the stream kernel's (rel diff; "!!" above 1e-2).

    PYTHONPATH=. python3 benchmarks/probes/quant_small_m_probe.py [NxK ...]   (default 4096x4096 8192x8192)

$MS: the M values (default 9,12,16); $FULL=0: only the stream kernel's split counts and w4_wgmma_kernel.
"""
import os
import sys

import torch
import torch.nn.functional as F

from speedcore import quant as Q
from speedcore.bench import Bench

import speedcore

b = Bench(quick=True)
G = 128
SIZES = [tuple(int(v) for v in a.split("x")) for a in sys.argv[1:]] or [(4096, 4096), (8192, 8192)]
MS = tuple(int(v) for v in os.environ.get("MS", "9,12,16").split(","))
FULL = os.environ.get("FULL", "1") != "0"


def layer(n, k, dt):
    Q._W4WGMMA_MODE = "on"  # prepack builds the wgmma-major copy only with the switch on
    scales = (torch.rand(k // G, n, device=b.device) * 0.01 + 0.001).to(dt)
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device=b.device)
    qz = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, device=b.device)
    return Q.prepack_awq(qw, qz, scales, group_size=G)


def mode(name):
    """Dispatch switches for one path."""
    Q._STREAM_MODE = "on" if name == "stream" else "off"
    Q._W4WGMMA_MODE = "on" if name == "w4wgmma" else "off"
    Q.W4WGMMA_M_RANGE = (1, 8192)
    Q._MARLIN_MODE = "on" if name == "marlin" else "off"
    Q._MARLIN_M_RANGE = (1, 128)


def rel(a, ref):
    return ((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


sms = torch.cuda.get_device_properties(b.device).multi_processor_count
for n, k in SIZES:
    for dt in (torch.bfloat16, torch.float16):
        lay = layer(n, k, dt)
        w = torch.randn(n, k, device=b.device, dtype=dt) * 0.01
        for m in MS:
            x = torch.randn(m, k, device=b.device, dtype=dt)
            row = []
            mode("stream")
            ref = speedcore.awq_linear(x, lay)
            cfg = Q.stream_config(m, n, k, Q.KIND_INT4, sms)
            variants = [("stream", "stream", {})]
            for sp in sorted({1, 2, 4} - {cfg.splits}):
                variants.append((f"stream s{sp}", "stream", {"splits": sp}))
            if FULL:
                for wp in sorted({4, 6, 8} - {cfg.warps}):
                    variants.append((f"stream w{wp}", "stream", {"warps": wp}))
            variants += [("w4wgmma", "w4wgmma", {})] + ([("marlin", "marlin", {})] if FULL else [])
            for tag, md, ov in variants:
                mode(md)
                Q._STREAM_OVERRIDE.clear()
                Q._STREAM_OVERRIDE.update(ov)
                try:
                    y = speedcore.awq_linear(x, lay)
                    e = rel(y, ref)
                    t = b.time_ms(lambda: speedcore.awq_linear(x, lay))
                    row.append(f"{tag} {t * 1e3:5.1f}" + ("" if e < 1e-2 else f"(!! {e:.1e})"))
                except Exception as exc:  # noqa: BLE001
                    row.append(f"{tag} failed: {type(exc).__name__}: {str(exc)[:60]}")
                finally:
                    Q._STREAM_OVERRIDE.clear()
            mode("stream")
            cub = b.time_ms(lambda: F.linear(x, w))
            print(f"{n}x{k} {str(dt)[6:]:8s} M={m:<3d} cuBLAS {cub * 1e3:5.1f} | stream cfg w{cfg.warps} s{cfg.splits} "
                  f"nbc{cfg.nbc} | " + " | ".join(row), flush=True)
        del lay, w
        torch.cuda.empty_cache()
