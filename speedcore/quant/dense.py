"""The dense path (kernels/quant_dense.cu): the weight dequantized once on the GPU, then the dense GEMM of torch
or CuPy, for M above MAX_MMA_M; and the public GPU dequantizers."""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from .. import _arrays as A
from .._compile import Kernel
from .._launch import LaunchConfig, launch
from .formats import FMT_AWQ, FMT_GPTQ
from ._common import _aligned_rows, _row_stride, _rows_copy, _validate_awq, _validate_gptq
from .mma import MAX_MMA_M

SOURCE = "quant_dense.cu"


@lru_cache(maxsize=None)
def _dequant_kernel(dtype: str, fmt: int) -> Kernel:
    return Kernel(SOURCE, f"quant::dequant_int4_kernel<{A.CTYPE[dtype]}, {fmt}>")


@lru_cache(maxsize=None)
def _dequant_int8_kernel(dtype: str) -> Kernel:
    return Kernel(SOURCE, f"quant::dequant_int8_kernel<{A.CTYPE[dtype]}>")


def use_dense(m: int, lib: str, dtype: str) -> bool:
    """Dispatch: dequantize once and call cuBLAS (torch.matmul / cupy.matmul) for M above MAX_MMA_M, where the
    GEMM is compute-bound and the one-time dequantization is amortized.  CuPy has no bfloat16 matmul, so
    CuPy bfloat16 always takes the tensor-core kernel."""
    if m <= MAX_MMA_M:
        return False
    return lib == "torch" or dtype == "float16"


def _lib_module(a):
    if a.lib == "torch":
        import torch

        return torch
    import cupy

    return cupy


def _dense_int4(fmt, xa, rows, k, ldx, qw, qz, scales, g_idx, bias, n, group):
    w = _dequant_launch(fmt, xa, qw, qz, scales, g_idx, k, n, group)
    x2 = xa.obj.reshape(rows, k) if xa.is_contiguous() else _rows_copy(xa, rows, k).obj
    lib = _lib_module(xa)
    if bias is not None and xa.lib == "torch":
        return lib.addmm(bias.obj, x2, w.obj)
    y = lib.matmul(x2, w.obj)
    if bias is not None:
        y += bias.obj
    return y


def _aligned_copy(a):
    """``a`` itself when its rows are 16-byte aligned, else an aligned contiguous copy."""
    if _aligned_rows(a):
        return a
    return A.wrap(a.obj.clone() if a.lib == "torch" else a.obj.copy(), a.name)


DEQUANT_ROWS = 4  # k rows per thread of dequant_int4_kernel (must match kernels/quant_dense.cu)


def dequant_int4_grid(k: int, n: int) -> tuple:
    """dequant_int4_kernel's grid: x over the N / 8 packed words (256 threads per block), y over the k rows,
    DEQUANT_ROWS per thread (grid-strided past the 65535-block limit of y)."""
    return (-(-(n // 8) // 256), min(-(-k // DEQUANT_ROWS), 65535))


def _dequant_launch(fmt, ref, qw, qz, scales, g_idx, k, n, group):
    qw, scales = _aligned_copy(qw), _aligned_copy(scales)
    wa = A.empty(ref, (k, n), scales.dtype, name="weight")
    if k * n:
        args = (wa.ptr, qw.ptr, qz.ptr, scales.ptr, g_idx.ptr if g_idx is not None else 0, np.int32(k),
                np.int32(n), np.int32(group), np.int64(_row_stride(qw)), np.int64(_row_stride(qz)),
                np.int64(_row_stride(scales)))
        launch(_dequant_kernel(scales.dtype, fmt), LaunchConfig(dequant_int4_grid(k, n), (256,)), args,
               device=ref.device, stream=A.stream_of(ref))
    return wa


def _dequant_int8_launch(ref, wa, sa, n, k):
    """W (N, K) = weight * scales[:, None] in the scales' dtype (dequant_int8_kernel; K % 16 == 0, 16-byte
    aligned rows, contiguous scales)."""
    out = A.empty(ref, (n, k), sa.dtype, name="weight")
    total = n * (k // 16)
    if total:
        launch(_dequant_int8_kernel(sa.dtype), LaunchConfig((-(-total // 256),), (256,)),
               (out.ptr, wa.ptr, sa.ptr, np.int32(n), np.int32(k), np.int64(_row_stride(wa))),
               device=ref.device, stream=A.stream_of(ref))
    return out


def dequantize_awq(qweight, qzeros, scales, *, group_size: int = 128):
    """W (K, N) in the scales' dtype on the GPU: ``(q - z) * s`` computed in float32, rounded once."""
    qa, za, sa, k, n, g = _validate_awq(qweight, qzeros, scales, group_size)
    for a in (qa, za, sa):
        if not a.is_contiguous():
            raise ValueError(f"{a.name}: must be contiguous")
    return _dequant_launch(FMT_AWQ, qa, qa, za, sa, None, k, n, g).obj


def dequantize_gptq(qweight, qzeros, scales, g_idx=None, *, group_size: int = 128):
    """W (K, N) in the scales' dtype on the GPU: ``s[g] * (q - (zeros[g] + 1))`` in float32, rounded once."""
    qa, za, sa, ga, k, n, g = _validate_gptq(qweight, qzeros, scales, g_idx, group_size)
    for a in (qa, za, sa):
        if not a.is_contiguous():
            raise ValueError(f"{a.name}: must be contiguous")
    if ga is not None:
        host = ga.obj.detach().cpu().numpy() if ga.lib == "torch" else ga.obj.get()
        groups = -(-k // g)
        if host.min(initial=0) < 0 or host.max(initial=0) >= groups:
            raise ValueError(f"g_idx: values must be in [0, {groups})")
    return _dequant_launch(FMT_GPTQ, qa, qa, za, sa, ga, k, n, g).obj
