"""Helpers shared by the quant modules: environment switches, array wrapping, dtype conversion, the checks of
the stored checkpoint tensors, row strides and output allocation."""
from __future__ import annotations

import os

import numpy as np

from .. import _arrays as A
from .formats import _group


def _as_dtype(a, dtype: str, name: str):
    """``a`` converted to ``dtype`` (a new array of its library); ``a`` itself when it already is."""
    if a.dtype == dtype:
        return a
    if a.lib == "torch":
        import torch

        return A.wrap(a.obj.to(getattr(torch, dtype)), name)
    try:
        return A.wrap(a.obj.astype(A._cupy_dtype(dtype)), name)
    except Exception as e:
        raise TypeError(f"{name}: dtype {a.dtype} cannot be converted to {dtype} with CuPy ({e}); pass {name} "
                        f"in {dtype}") from None


def _check_matrix(a, dtype, shape, what: str) -> None:
    A.check_dtype(a, (dtype,) if isinstance(dtype, str) else dtype, what)
    A.check_shape(a, shape)
    if a.ndim == 2 and a.shape[1] > 1 and a.strides[1] != 1:
        raise ValueError(f"{a.name}: the last dimension must be contiguous (stride 1), got strides {a.strides}")


def _row_stride(a) -> int:
    return a.strides[0] if a.shape[0] > 1 else a.shape[1]


def _aligned_rows(a) -> bool:
    return a.aligned(16) and (_row_stride(a) * a.itemsize) % 16 == 0


def _check_aligned(a) -> None:
    if not _aligned_rows(a):
        raise ValueError(f"{a.name}: rows must start at 16-byte boundaries (pointer {a.ptr:#x}, row stride "
                         f"{_row_stride(a)} elements); pass a contiguous copy")


def _rows_copy(xa, rows: int, k: int):
    """A contiguous (rows, K) copy of x (for views whose rows are not 16-byte aligned)."""
    obj = xa.obj
    if xa.lib == "torch":
        c = obj.reshape(rows, k).clone(memory_format=__import__("torch").contiguous_format)
    else:
        import cupy

        c = cupy.array(obj.reshape(rows, k), copy=True, order="C")
    return A.wrap(c, "x")


def _x_rows(x, k_expected=None):
    xa = A.wrap(x, "x")
    A.check_dtype(xa, A.HALF_DTYPES)
    if xa.ndim == 0:
        raise ValueError("x: expected shape (..., K), got a scalar")
    k = xa.shape[-1]
    if k_expected is not None and k != k_expected:
        raise ValueError(f"x: last dimension must be in_features={k_expected}, got {k}")
    rows, ldx = xa.rows()
    return xa, rows, k, ldx


def _alloc_out(xa, rows: int, n: int):
    """y (rows, N) in x's dtype and library: (object, pointer)."""
    if xa.lib == "torch":
        t = xa.obj.new_empty((rows, n))
        return t, t.data_ptr()
    ya = A.empty(xa, (rows, n), xa.dtype, name="out")
    return ya.obj, ya.ptr


def _env_switch(name: str) -> str:
    """A dispatch switch read from the environment at import: "on" (1, on, true), "off" (0, off, false), else
    "auto"."""
    v = os.environ.get(name, "auto").lower()
    return "on" if v in ("1", "on", "true") else "off" if v in ("0", "off", "false") else "auto"


def _finish(xa, ya, rows, n):
    """Reshape y (rows, N) to x's leading shape."""
    return ya.obj.reshape(tuple(xa.shape[:-1]) + (n,))


def _check_common(xa, others, bias, n):
    A.check_same_device(xa, *others, bias)
    if bias is not None:
        A.check_dtype(bias, (xa.dtype,), " (bias must have x's dtype)")
        A.check_shape(bias, (n,))
        if n > 1 and bias.strides[0] != 1:
            raise ValueError(f"bias: must be contiguous, got stride {bias.strides[0]}")


def _validate_awq(qweight, qzeros, scales, group_size, k=None):
    qa = A.wrap(qweight, "qweight")
    A.check_dtype(qa, ("int32",), " (AWQ qweight is packed int32)")
    if qa.ndim != 2:
        raise ValueError(f"qweight: expected shape (K, N/8), got {tuple(qa.shape)}")
    kk, n8 = qa.shape
    if k is not None and kk != k:
        raise ValueError(f"qweight: expected {k} rows (x's last dimension K), got shape {tuple(qa.shape)}")
    k, n = kk, 8 * n8
    if k == 0 or n == 0:
        raise ValueError(f"qweight: empty weight of shape {tuple(qa.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
        raise TypeError(f"group_size: expected an int, got {type(group_size).__name__}")
    g = _group(group_size, k)
    if k % g:
        raise ValueError(f"group_size: K={k} is not a multiple of group_size={g}")
    za = A.wrap(qzeros, "qzeros")
    sa = A.wrap(scales, "scales")
    _check_matrix(qa, "int32", (k, n8), "")
    _check_matrix(za, "int32", (k // g, n8), " (AWQ qzeros is packed int32)")
    _check_matrix(sa, A.HALF_DTYPES, (k // g, n), "")
    A.check_same_device(qa, za, sa)
    return qa, za, sa, k, n, g


def _aligned_rows_x(xa, ldx) -> bool:
    return xa.aligned(16) and (ldx * xa.itemsize) % 16 == 0 and xa.shape[-1] % 8 == 0


def _validate_gptq(qweight, qzeros, scales, g_idx, group_size, k=None):
    qa = A.wrap(qweight, "qweight")
    A.check_dtype(qa, ("int32",), " (GPTQ qweight is packed int32)")
    if qa.ndim != 2:
        raise ValueError(f"qweight: expected shape (K/8, N), got {tuple(qa.shape)}")
    k8, n = qa.shape
    if k is not None:
        if k % 8:
            raise ValueError(f"x: K={k} must be a multiple of 8 for GPTQ (8 values per int32 along K)")
        if k8 * 8 != k:
            raise ValueError(f"qweight: expected shape (K/8, N) = ({k // 8}, N) for K={k}, got {tuple(qa.shape)}")
    k = 8 * k8
    if k == 0 or n == 0:
        raise ValueError(f"qweight: empty weight of shape {tuple(qa.shape)}")
    if n % 8:
        raise ValueError(f"qweight: N={n} must be a multiple of 8 (qzeros packs 8 channels per int32)")
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
        raise TypeError(f"group_size: expected an int, got {type(group_size).__name__}")
    g = _group(group_size, k)
    groups = -(-k // g)
    za = A.wrap(qzeros, "qzeros")
    sa = A.wrap(scales, "scales")
    _check_matrix(qa, "int32", (k8, n), "")
    _check_matrix(za, "int32", (groups, n // 8), " (GPTQ qzeros is packed int32)")
    _check_matrix(sa, A.HALF_DTYPES, (groups, n), "")
    ga = A.wrap(g_idx, "g_idx", optional=True)
    if ga is not None:
        A.check_dtype(ga, ("int32",))
        A.check_shape(ga, (k,))
        if k > 1 and ga.strides[0] != 1:
            raise ValueError(f"g_idx: must be contiguous, got stride {ga.strides[0]}")
    A.check_same_device(qa, za, sa, ga)
    return qa, za, sa, ga, k, n, g
