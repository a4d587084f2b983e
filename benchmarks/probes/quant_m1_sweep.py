"""Launch-shape sweep of the M <= 16 streaming kernels (not a suite): on prepacked AWQ / INT8 layers, the shipped
dispatch ("ours") against gemv_bulk_kernel and gemv_stream_kernel forced with other launch shapes (warps per CTA,
ring stages / prefetch depth, K splits), next to cuBLAS (F.linear, same dtype) and a cuBLAS GEMV reading as many
weight bytes as ours ("gemv=": N/4 rows of bf16 for INT4, N/2 for INT8: the data rate cuBLAS reaches on this read).
Every forced variant's output is checked against ours (relative difference printed above 1e-3).

Why: at M = 1 the bulk kernel reads 28672x8192 INT4 at ~2.8 TB/s where the same-bytes GEMV reads at ~3.5; with
2 stages each warp has one 4 KB chunk in flight, ~7 MB in all, which at a loaded latency of ~2.5 us is that rate
(Little's law), so deeper rings (or more warps per block) should help the large layers even though they did not
help 8192^2 when the default was picked.  One line per case with every variant, then the best per case.

    PYTHONPATH=. python3 benchmarks/probes/quant_m1_sweep.py [M ...]      (default M = 1 16)
"""
import sys
import time

import torch
import torch.nn.functional as F

from speedcore import quant as Q

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from quant_stream_probe import b, layer_of, run_as  # noqa: E402  (the same layers and forcing)

t0 = time.time()
MS = [int(a) for a in sys.argv[1:] if a.isdigit()] or [1, 16]
best_rows = []


def variants(kind, m, n, k, sms):
    """(tag, which, override): bulk at 2-4 stages and 1-2x the default warps (and 2 splits), stream at prefetch
    0-2 and 1-2x the default warps."""
    out, seen = [], set()
    bd = Q.bulk_config(m, n, k, kind, sms)
    for w in sorted({bd.warps, min(2 * bd.warps, Q.BULK_MAX_WARPS)}):
        for s in (2, 3, 4):
            for sp in sorted({bd.splits, 2 * bd.splits}):
                c = Q.bulk_config(m, n, k, kind, sms, warps=w, stages=s, splits=sp)
                if c.smem <= Q.BULK_SMEM_PER_CTA and (c.warps, c.stages, c.splits) not in seen:
                    seen.add((c.warps, c.stages, c.splits))
                    out.append((f"bulk w{c.warps}s{c.stages}p{c.splits}", "bulk",
                                {"warps": w, "stages": s, "splits": sp}))
    sd = Q.stream_config(m, n, k, kind, sms)
    for w in sorted({sd.warps, min(2 * sd.warps, Q.stream_max_warps(kind, sd.mt))}):
        for pf in (0, 1, 2):
            out.append((f"strm w{w}f{pf}", "stream", {"warps": w, "prefetch": pf}))
    return out


def case(fmt, n, k, dt):
    call = layer_of(fmt, n, k, dt)
    kind = Q.KIND_INT8 if fmt == "int8" else Q.KIND_INT4
    w = torch.randn(n, k, device=b.device, dtype=dt) * 0.01
    w_same = torch.randn(n // (2 if fmt == "int8" else 4), k, device=b.device, dtype=dt) * 0.01
    sms = torch.cuda.get_device_properties(b.device).multi_processor_count
    for m in MS:
        x = torch.randn(m, k, device=b.device, dtype=dt)
        y = call(x)
        ours = b.time_ms(lambda: call(x))
        cub = b.time_ms(lambda: F.linear(x, w))
        same = b.time_ms(lambda: F.linear(x, w_same)) if m == 1 else float("nan")
        cells = []
        best = ("ours", ours)
        for tag, which, ov in variants(kind, m, n, k, sms):
            try:
                t, yv = run_as(call, x, which, **ov)
            except Exception as exc:  # noqa: BLE001 (a shape the kernel refuses: say so, go on)
                cells.append(f"{tag} {type(exc).__name__}")
                continue
            err = ((yv.float() - y.float()).norm() / y.float().norm()).item()
            cells.append(f"{tag} {t * 1e3:.1f}" + ("" if err < 1e-3 else f" !!{err:.0e}"))
            if t < best[1] and err < 1e-3:
                best = (tag, t)
        label = f"{fmt:4s} {str(dt)[6:]:8s} M={m:<2d} {n:>5d}x{k:<5d}"
        print(f"{label} ours {ours * 1e3:.1f} cuBLAS {cub * 1e3:.1f} gemv= {same * 1e3:.1f} | " + " | ".join(cells),
              flush=True)
        best_rows.append((label, ours, best, cub, same))


def main():
    for fmt, n, k in (("awq", 28672, 8192), ("awq", 8192, 28672), ("awq", 8192, 8192), ("awq", 4096, 4096),
                      ("int8", 8192, 8192), ("int8", 28672, 8192)):
        case(fmt, n, k, torch.bfloat16)
        torch.cuda.empty_cache()
    case("awq", 28672, 8192, torch.float16)

    print(f"\nsweep done in {time.time() - t0:.0f}s\nbest per case: us; x = cuBLAS / time (same run)")
    print(f"{'case':32s} {'ours':>6s} {'x':>5s} {'best shape':>16s} {'best':>6s} {'x':>5s} {'cuBLAS':>7s} {'gemv=':>6s}")
    for label, ours, (tag, t), cub, same in best_rows:
        print(f"{label:32s} {ours * 1e3:6.1f} {cub / ours:5.2f} {tag:>16s} {t * 1e3:6.1f} {cub / t:5.2f} "
              f"{cub * 1e3:7.1f} {same * 1e3:6.1f}")


if __name__ == "__main__":
    main()
