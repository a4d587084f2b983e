"""Interleaved A/B of gemv_stream_kernel with several 64-channel blocks per CTA sharing x (``nbc``; not a suite):
the shipped dispatch ("ours") against the stream kernel forced with nbc blocks per CTA ("n<nbc>w<warps>s<splits>"),
and cuBLAS (F.linear, same run).  M > 8 only (at M <= 8 the kernel takes one block per CTA; the M = 1 / 4
rows of the session-10 record were measured before that).  Every variant of a case is timed once per round, rounds repeated, medians
reported; outputs checked against the shipped dispatch.

    PYTHONPATH=. python3 benchmarks/_quant_nbc_ab.py [rounds]      (default 5)
"""
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _quant_stream_probe import b, layer_of, run_as  # noqa: E402

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5


def v(nbc, warps, splits=0):
    ov = {"nbc": nbc, "warps": warps}
    if splits:
        ov["splits"] = splits
    return (f"n{nbc}w{warps}" + (f"s{splits}" if splits else ""), "stream", ov)


BF, FP = torch.bfloat16, torch.float16
CASES = [
    ("awq", 28672, 8192, 16, BF, [v(2, 6), v(4, 12)]),
    ("awq", 28672, 8192, 16, FP, [v(4, 12)]),
    ("awq", 8192, 28672, 16, BF, [v(2, 12), v(4, 12)]),
    ("awq", 8192, 8192, 16, BF, [v(2, 12), v(4, 12)]),
    ("awq", 8192, 8192, 16, FP, [v(2, 12), v(4, 12)]),
    ("awq", 4096, 4096, 16, BF, [v(2, 12), v(4, 12)]),
    ("int8", 28672, 8192, 16, BF, [v(2, 8), v(4, 16)]),
    ("int8", 8192, 8192, 16, BF, [v(2, 8), v(4, 16)]),
]

print(f"{'case':34s} {'variant':>10s} {'median us':>9s} {'min':>6s} {'x cuBLAS':>8s}")
summary = []
for fmt, n, k, m, dt, vs in CASES:
    call = layer_of(fmt, n, k, dt)
    x = torch.randn(m, k, device=b.device, dtype=dt)
    w = torch.randn(n, k, device=b.device, dtype=dt) * 0.01
    y = call(x)
    times = {"ours": [], "cuBLAS": []}
    for tag, _, _ in vs:
        times[tag] = []
    for _ in range(ROUNDS):
        times["ours"].append(b.time_ms(lambda: call(x)))
        times["cuBLAS"].append(b.time_ms(lambda: F.linear(x, w)))
        for tag, which, ov in vs:
            t, yv = run_as(call, x, which, **ov)
            err = ((yv.float() - y.float()).norm() / y.float().norm()).item()
            assert err < 1e-3, (tag, err)
            times[tag].append(t)
    cub = statistics.median(times["cuBLAS"])
    label = f"{fmt} {str(dt)[6:]} M={m} {n}x{k}"
    cells = []
    for tag, ts in times.items():
        med = statistics.median(ts)
        print(f"{label:34s} {tag:>10s} {med * 1e3:9.1f} {min(ts) * 1e3:6.1f} {cub / med:8.2f}", flush=True)
        cells.append(f"{tag} {med * 1e3:.1f} ({cub / med:.2f})")
    summary.append(f"{label:34s} " + " | ".join(cells))
    del call, w
    torch.cuda.empty_cache()
print("\nsummary: us (ratio to cuBLAS)")
print("\n".join(summary))
