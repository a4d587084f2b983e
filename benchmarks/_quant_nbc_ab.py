"""Interleaved A/B of gemv_stream_kernel with several 64-channel blocks per CTA sharing x (``nbc``; not a suite):
the shipped dispatch ("ours") against the stream kernel forced with nbc blocks per CTA ("n<nbc>w<warps>s<splits>"),
and cuBLAS (F.linear, same run).  M > 8 only (at M <= 8 the kernel takes one block per CTA; the M = 1 / 4
rows of the session-10 record were measured before that).  Every variant of a case is timed once per round, rounds
repeated, medians reported; outputs checked against the shipped dispatch (benchmarks/_quant_m1_ab.py's loop).

    PYTHONPATH=. python3 benchmarks/_quant_nbc_ab.py [rounds]      (default 5)
"""
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _quant_m1_ab import ab  # noqa: E402

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

print("\nsummary: us (ratio to cuBLAS)")
print("\n".join(ab(CASES, ROUNDS)))
