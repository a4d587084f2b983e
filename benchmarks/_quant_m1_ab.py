"""Interleaved A/B of the M <= 16 streaming kernels' launch shapes (not a suite): the cases where
benchmarks/_quant_m1_sweep.py (one pass, quick timing) saw a variant beat the shipped dispatch by > 3%.  Every
variant of a case is timed once per round, rounds repeated, medians reported next to cuBLAS (F.linear, same run);
outputs checked against the shipped dispatch.

    PYTHONPATH=. python3 benchmarks/_quant_m1_ab.py [rounds]      (default 5)
"""
import statistics
import sys

import torch
import torch.nn.functional as F


sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _quant_stream_probe import b, layer_of, run_as  # noqa: E402  (same layers, same forcing)

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5


def strm(w, pf=0):
    return (f"strm w{w}f{pf}", "stream", {"warps": w, "prefetch": pf})


def bulk(w=0, s=2):
    return (f"bulk w{w or 'd'}s{s}", "bulk", {"warps": w, "stages": s} if w else {"stages": s})


# The shipped dispatch ("ours") against what it replaced: bulk at INT4 M = 1 with N > K, one-wave INT8 warps
# (checked on 28672x8192, 14336x4096, 8192x8192, 4096x14336, 57344x8192 at M = 1 / 4 / 16 at d7fe10a), warps per
# block that do not divide the SM's (14336x8192: 9 -> 8, 11008x4096: 12 -> 8, ...).
CASES = [
    ("awq", 28672, 8192, 1, torch.bfloat16, [bulk(), strm(8)]),
    ("awq", 14336, 8192, 1, torch.bfloat16, [bulk(), bulk(9), strm(9)]),
    ("awq", 14336, 8192, 1, torch.float16, [bulk(), strm(9)]),
    ("awq", 11008, 4096, 1, torch.bfloat16, [strm(12)]),
    ("awq", 14336, 8192, 16, torch.bfloat16, [strm(7)]),
    ("awq", 11008, 4096, 16, torch.bfloat16, [strm(9)]),
    ("int8", 6144, 4096, 1, torch.bfloat16, [strm(11)]),
    ("int8", 28672, 8192, 16, torch.bfloat16, [strm(2)]),
]

def ab(cases, rounds):
    """Times every case's variants (run_as overrides) against the dispatch and cuBLAS, interleaved over rounds;
    prints a line per variant and returns a summary line per case."""
    print(f"{'case':34s} {'variant':>10s} {'median us':>9s} {'min':>6s} {'x cuBLAS':>8s}")
    summary = []
    for fmt, n, k, m, dt, vs in cases:
        call = layer_of(fmt, n, k, dt)
        x = torch.randn(m, k, device=b.device, dtype=dt)
        w = torch.randn(n, k, device=b.device, dtype=dt) * 0.01
        y = call(x)
        times = {"ours": [], "cuBLAS": []}
        for tag, _, _ in vs:
            times[tag] = []
        for _ in range(rounds):
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
        call = w = None  # free the layer before the next case
        torch.cuda.empty_cache()
    return summary


if __name__ == "__main__":
    ab(CASES, ROUNDS)
