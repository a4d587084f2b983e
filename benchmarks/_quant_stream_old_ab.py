"""Interleaved A/B of gemv_stream_kernel against an older copy of it (not a suite): kernels/_quant_old.cu, when it
exists, is an earlier kernels/quant.cu (before the nbc argument: ``git show e7a9257:kernels/quant.cu``), launched
with its own argument list on the same prepacked layers and launch shapes (nbc = 1); "new" is the shipped dispatch
(the stream kernel forced on, today's launch shape).  Medians of interleaved rounds, outputs checked against each
other, cuBLAS (F.linear) in the same run.

    PYTHONPATH=. python3 benchmarks/_quant_stream_old_ab.py [rounds] [--split]      (default 7; --split: the
    split-K cases instead)
"""
import statistics
import sys

import numpy as np
import torch
import torch.nn.functional as F

import speedcore
from speedcore import _arrays as A
from speedcore import quant as Q
from speedcore._compile import Kernel
from speedcore._launch import LaunchConfig, launch
from speedcore.bench import Bench

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 7
b = Bench(quick=True)
G = 128


def layer_of(fmt, n, k, dt):
    dev = b.device
    if fmt == "int8":
        w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=dev)
        return Q.prepack_int8(w8, (torch.rand(n, device=dev) * 0.01 + 0.001).to(dt))
    scales = (torch.rand(k // G, n, device=dev) * 0.01 + 0.001).to(dt)
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device=dev)
    qz = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, device=dev)
    return Q.prepack_awq(qw, qz, scales, group_size=G)


def call_new(fmt, layer, x):
    Q._STREAM_MODE, Q._BULK_MODE = "on", "off"
    return speedcore.int8_linear(x, layer) if fmt == "int8" else speedcore.awq_linear(x, layer)


_BUFS = {}


def call_old(fmt, layer, x, old_cfg):
    """The old kernel on the same layer with the old launch shape (nbc = 1); output, workspace and tickets made
    once per case (outside the timed calls, as the shipped path's are; the kernel leaves them zeroed)."""
    gl = layer.gemv
    m, k = x.shape
    n = layer.out_features
    kind = gl.kind
    kern = Kernel("_quant_old.cu", f"quant::gemv_stream_kernel<{A.CTYPE[str(x.dtype)[6:]]}, {kind}, {old_cfg.mt}>")
    key = (m, n, str(x.dtype))
    if key not in _BUFS:
        _BUFS.clear()
        _BUFS[key] = (torch.empty(m, n, device=x.device, dtype=x.dtype),
                      torch.zeros(m * n, device=x.device, dtype=torch.float32),
                      torch.zeros(old_cfg.blocks, device=x.device, dtype=torch.int32))
    y, ws, tk = _BUFS[key]
    scales_ptr = layer.fast.scales_ptr if kind == Q.KIND_INT8 else 0
    args = (y.data_ptr(), ws.data_ptr(), tk.data_ptr(), x.data_ptr(), gl.w_ptr, gl.g_ptr, scales_ptr, 0,
            np.int32(m), np.int32(n), np.int32(old_cfg.steps), np.int32(gl.spg), np.int32(gl.ng),
            np.int32(old_cfg.blocks), np.int32(old_cfg.splits), np.int32(old_cfg.prefetch), np.int32(old_cfg.order),
            np.uint32(0), np.int64(k))
    lc = LaunchConfig((old_cfg.blocks * old_cfg.splits,), (old_cfg.warps * 32,), old_cfg.smem)
    launch(kern, lc, args, device=x.device.index or 0, stream=A.stream_of(A.wrap(x, "x")))
    return y


BF, FP = torch.bfloat16, torch.float16
CASES = [("awq", 28672, 8192, 1, BF), ("awq", 28672, 8192, 1, FP), ("awq", 28672, 8192, 4, BF),
         ("awq", 28672, 8192, 16, BF), ("awq", 8192, 8192, 16, BF), ("awq", 4096, 4096, 1, BF),
         ("int8", 28672, 8192, 1, BF), ("int8", 8192, 8192, 1, BF), ("int8", 8192, 8192, 16, BF)]
# split-K launches (the epilogue's atomics and ticket pass): 4096^2 M = 16 (2 CTAs a block), 4096 x 14336 M = 16
CASES_SPLIT = [("awq", 4096, 4096, 16, BF), ("awq", 4096, 4096, 16, FP), ("awq", 4096, 14336, 16, BF),
               ("awq", 4096, 4096, 4, BF)]
if "--split" in sys.argv:
    CASES = CASES_SPLIT

sms = torch.cuda.get_device_properties(0).multi_processor_count
summary = []
for fmt, n, k, m, dt in CASES:
    layer = layer_of(fmt, n, k, dt)
    x = torch.randn(m, k, device=b.device, dtype=dt)
    w = torch.randn(n, k, device=b.device, dtype=dt) * 0.01
    kind = Q.KIND_INT8 if fmt == "int8" else Q.KIND_INT4
    old_cfg = Q.stream_config(m, n, k, kind, sms, nbc=1)
    new_cfg = Q.stream_config(m, n, k, kind, sms)
    y_new, y_old = call_new(fmt, layer, x), call_old(fmt, layer, x, old_cfg)
    err = ((y_new.float() - y_old.float()).norm() / y_old.float().norm()).item()
    assert err < 1e-3, err
    t = {"new": [], "old": [], "cuBLAS": []}
    runs = {"new": lambda: call_new(fmt, layer, x), "old": lambda: call_old(fmt, layer, x, old_cfg),
            "cuBLAS": lambda: F.linear(x, w)}
    for r in range(ROUNDS):  # the order alternates between rounds
        for tag in (("new", "old", "cuBLAS") if r % 2 == 0 else ("old", "new", "cuBLAS")):
            t[tag].append(b.time_ms(runs[tag]))
    med = {kk: statistics.median(v) * 1e3 for kk, v in t.items()}
    label = f"{fmt} {str(dt)[6:]} M={m} {n}x{k}"
    line = (f"{label:32s} new {med['new']:7.1f} (nbc {new_cfg.nbc}) | old {med['old']:7.1f} | cuBLAS "
            f"{med['cuBLAS']:7.1f} | new/old {med['old'] / med['new']:.3f}")
    print(line, flush=True)
    summary.append(line)
    layer = w = None  # free the layer before the next case
    torch.cuda.empty_cache()
print("\nsummary: us, medians of", ROUNDS)
print("\n".join(summary))
