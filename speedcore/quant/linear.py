"""The public linears awq_linear, gptq_linear and int8_linear, and the dispatch among the kernel families."""
from __future__ import annotations

import numpy as np

from .. import _arrays as A
from .. import _torch_hook
from .._arrays import sig
from .._launch import device_info
from . import bulk as _bulk_mod
from . import gemv as _gemv
from . import stream as _stream_mod
from ._common import (_aligned_rows, _aligned_rows_x, _as_dtype, _check_aligned, _check_common, _finish, _row_stride,
                      _rows_copy, _validate_awq, _validate_gptq, _x_rows)
from .bulk import _launch_bulk, use_bulk
from .dense import _dense_int4, _dequant_int8_launch, use_dense
from .formats import FMT_AWQ, FMT_GPTQ, FMT_INT8, KIND_INT4
from .gemv import GEMV_MAX_M, GEMV_STEP_K, _launch_gemv, use_gemv
from .marlin import _launch_marlin, _marlin_fits, use_marlin
from .mma import _check_packed, _launch_mma
from .prepack import (AWQWeight, GPTQWeight, Int8Weight, _FastLayer, _classify_g_idx, _fast_group_ok, _gather_x,
                      _permute_gptq, _to_device_like)
from .stream import _launch_stream, stream_supported, use_stream
from .w4wgmma import _launch_w4wgmma, _w4_applies


def _choose(gemv, xa, rows: int, n: int, k: int) -> str:
    """The kernel family of a quantized linear's call (see _launch_linear)."""
    if rows and _w4_applies(gemv, xa, rows, n, k):
        return "w4wgmma"
    if (gemv is not None and gemv.w_ptr and gemv.kind == KIND_INT4 and gemv.dtype == xa.dtype
            and use_marlin(rows, n, k, gemv.spg * GEMV_STEP_K) and _marlin_fits(xa.device, rows)):
        return "marlin"
    if (gemv is not None and not gemv.w_ptr and gemv.w4_ptr and gemv.kind == KIND_INT4 and 0 < rows <= GEMV_MAX_M
            and gemv.dtype == xa.dtype and stream_supported(gemv.kind, k, n, gemv.spg * GEMV_STEP_K)):
        return "stream"  # a compact layer (the wgmma-major copy only): gemv_stream_kernel reads that copy
    if (gemv is not None and gemv.w_ptr and 0 < rows <= GEMV_MAX_M
            and (gemv.dtype is None or gemv.dtype == xa.dtype)):
        if use_bulk(gemv.kind, rows, n, k, gemv.spg * GEMV_STEP_K, device_info(xa.device).cc):
            return "bulk"
        if use_stream(gemv.kind, rows, n, k, gemv.spg * GEMV_STEP_K):
            return "stream"
        mode = _gemv._GEMV_MODE
        if mode == "on" or (mode == "auto" and use_gemv(gemv.kind, rows, n, k)):
            return "gemv"
    return "mma"


def _launch_linear(fmt, xa, rows, k, ldx, qw_ptr, ldq, qz_ptr, ldz, scales_ptr, lds, bias_ptr, n, group,
                   packed: bool, gemv=None):
    """Allocate y (rows, N) and run quant_mma_kernel, or, when the layer has the fragment-major copy (``gemv``)
    for x's dtype, quant_marlin_kernel (use_marlin: INT4, 17 <= M <= 128) or a streaming
    kernel for M <= 16; returns y (the caller's library).  Before all of these: w4_wgmma_kernel where
    _w4_applies (use_w4wgmma: sm_90, 17 <= M <= 1024 by default, to 8192 from N = 4096)."""
    how = _choose(gemv, xa, rows, n, k)
    if how == "w4wgmma":
        return _launch_w4wgmma(gemv, xa, rows, k, ldx, bias_ptr, n, scales_ptr)
    if how == "marlin":
        return _launch_marlin(gemv, xa, rows, k, ldx, bias_ptr, n)
    if how == "bulk":
        return _launch_bulk(gemv, xa, rows, k, ldx, scales_ptr, bias_ptr, n)
    if how == "stream":
        return _launch_stream(gemv, xa, rows, k, ldx, scales_ptr, bias_ptr, n)
    if how == "gemv":
        return _launch_gemv(gemv, xa, rows, k, ldx, scales_ptr, bias_ptr, n)
    return _launch_mma(fmt, xa, rows, k, ldx, qw_ptr, ldq, qz_ptr, ldz, scales_ptr, lds, bias_ptr, n, group, packed)


def _dispatch_state() -> tuple:
    """What a cached plan's kernel choice depends on besides the call signature: the measurement switches (on the
    per-call path: the overrides are empty but in measurements)."""
    so, bo = _stream_mod._STREAM_OVERRIDE, _bulk_mod._BULK_OVERRIDE
    return (_gemv._GEMV_MODE, _stream_mod._STREAM_MODE, _bulk_mod._BULK_MODE,
            tuple(sorted(so.items())) if so else (), tuple(sorted(bo.items())) if bo else ())


def _fast_call(f: _FastLayer, x, bias):
    """The prepacked path with per-call checks reduced to x and bias.  Returns None for anything unusual
    (dtype or device mismatch, wrong K, dense-path sizes, odd bias): the general path then converts or raises.
    Decode-sized calls that take a streaming kernel are cached per call signature (f.plans): a signature seen
    before launches with no checks at all."""
    try:
        key = (sig(x), sig(bias), _dispatch_state())
        plan = f.plans.get(key)
    except TypeError:  # not an array: the checks below name it
        key = plan = None
    if plan is not None:
        return plan(x, bias)
    xa = A.wrap(x, "x")
    if xa.dtype != f.dtype or xa.lib != f.lib or xa.device != f.device or xa.ndim == 0 or xa.shape[-1] != f.k:
        return None
    rows, ldx = xa.rows()
    if use_dense(rows, xa.lib, xa.dtype) and not _w4_applies(f.gemv, xa, rows, f.n, f.k):
        return None
    bias_ptr = 0
    if bias is not None:
        ba = A.wrap(bias, "bias")
        if (ba.dtype != xa.dtype or tuple(ba.shape) != (f.n,) or ba.lib != xa.lib or ba.device != xa.device
                or (f.n > 1 and ba.strides[0] != 1)):
            return None
        bias_ptr = ba.ptr
    out_shape = tuple(xa.shape[:-1]) + (f.n,)
    if f.perm is not None:  # compact act-order GPTQ: x's columns in the repacked k order (never a cached plan)
        if rows:
            xa = _gather_x(xa, rows, f.k, ldx, f.perm)
            ldx = f.k
    elif rows and not _aligned_rows_x(xa, ldx):
        xa = _rows_copy(xa, rows, f.k)
        ldx = f.k
    elif key is not None and A.cacheable(key) and (how := _choose(f.gemv, xa, rows, f.n, f.k)) in ("bulk", "stream"):
        plan_fn, override = ((_bulk_mod._bulk_plan, _bulk_mod._BULK_OVERRIDE) if how == "bulk"
                             else (_stream_mod._stream_plan, _stream_mod._STREAM_OVERRIDE))
        run = _stream_mod._chunks_runner(plan_fn, override, f.gemv, xa, rows, f.k, ldx, f.scales_ptr, f.n)
        if len(f.plans) >= 64:
            f.plans.clear()
        f.plans[key] = _chunks_plan(run, xa, out_shape)  # from the next call of this signature on
    y = _launch_linear(f.fmt, xa, rows, f.k, ldx, f.qw_ptr, f.ldq, f.qz_ptr, f.ldz, f.scales_ptr, f.lds, bias_ptr, f.n,
                       f.group, True, f.gemv)
    return y.reshape(out_shape)


def _compact_error(f: _FastLayer, x, bias) -> Exception:
    """The error for a call that a compact layer (the wgmma-major copy only, no stored tensors to convert from)
    cannot take: _fast_call returned None, so x or bias differ from what the layer was prepacked for."""
    xa = A.wrap(x, "x")
    want = f"{f.dtype} {f.lib} arrays on device {f.device}"
    if xa.dtype != f.dtype or xa.lib != f.lib or xa.device != f.device:
        return TypeError(f"x: a layer prepacked with copies='compact' takes {want}, got {xa.dtype} {xa.lib} on device "
                         f"{xa.device} (prepack with dtype={xa.dtype!r}, or with copies='all' to convert per call)")
    if xa.ndim == 0 or xa.shape[-1] != f.k:
        return ValueError(f"x: expected shape (..., {f.k}) (the layer's in_features), got {tuple(xa.shape)}")
    return ValueError(f"bias: expected a contiguous ({f.n},) array of {want}, got "
                      f"{A.wrap(bias, 'bias').dtype} of shape {tuple(A.wrap(bias, 'bias').shape)}")


def _chunks_plan(run, xa, out_shape):
    """A cached call of a prepacked layer: a new output, the stream, the launch."""
    lib = A.fast_lib(xa.lib)
    ptr, stream, new_empty, device = lib.ptr, lib.stream, lib.new_empty, xa.device

    def plan(x, bias):
        y = new_empty(x, out_shape)
        run(stream(device), ptr(y), ptr(x), ptr(bias) if bias is not None else 0)
        return y

    return plan


def awq_linear(x, qweight, qzeros=None, scales=None, *, group_size: int = 128, bias=None):
    """``y = x @ W (+ bias)`` for an AWQ 4-bit weight (GEMM format, zero points) as stored in the checkpoint.

    Parameters
    ----------
    x : torch.Tensor or cupy.ndarray, shape (..., K), float16 or bfloat16, on a CUDA device.  The last
        dimension must be contiguous; leading dimensions may be any view that collapses to one row stride.
    qweight : int32 (K, N/8), AWQ-packed (order [0, 2, 4, 6, 1, 3, 5, 7] along N); or an :class:`AWQWeight`
        from :func:`prepack_awq` (then ``qzeros``/``scales``/``group_size`` are taken from it).
    qzeros : int32 (K/G, N/8), packed the same way.
    scales : float16 or bfloat16 (K/G, N); converted to x's dtype per call if it differs (prepack to avoid).
    group_size : G, default 128; -1 means one group over K.  K must be a multiple of G.
    bias : optional (N,), x's dtype.

    Returns
    -------
    (..., N) in x's dtype and library, on the caller's current stream.

    Notes
    -----
    M = prod(x.shape[:-1]) <= MAX_MMA_M = 128 (or CuPy bfloat16): one tensor-core kernel that streams the packed
    weights once per 64 rows of x (fastest with the tile-major copy made by :func:`prepack_awq`, which also skips
    the per-call weight checks).  With a prepacked layer, M <= 16 takes a streaming kernel on the fragment-major
    copy instead: ``gemv_stream_kernel`` / ``gemv_bulk_kernel`` where K and G are multiples of 128
    (:func:`use_stream`, :func:`use_bulk`), else ``gemv_kernel`` (:func:`use_gemv`; K % 32 == 0 and
    G % 32 == 0).  Where :func:`use_marlin` says so (INT4, 17 <= M <= 128), such a layer
    takes ``quant_marlin_kernel``; on sm_90, where :func:`use_w4wgmma` says so (INT4, 17 <= M <= 1024 and up to
    8192 from N = 4096, N % 256 == 0), ``w4_wgmma_kernel``.  Larger M: dequantize to a dense weight, then cuBLAS.
    The fast kernels need N % 64 == 0 and G == 32 or G % 64 == 0; other shapes take the dense path (torch, or CuPy
    float16).
    """
    if _torch_hook.compiling():
        return _torch_hook.op("awq_linear")(x, qweight, qzeros, scales, group_size=group_size, bias=bias)
    if isinstance(qweight, AWQWeight) and qweight.fast is not None and qzeros is None and scales is None:
        y = _fast_call(qweight.fast, x, bias)
        if y is not None:
            return y
        if qweight.qweight is None:
            raise _compact_error(qweight.fast, x, bias)
    packed = gemv = None
    if isinstance(qweight, AWQWeight):
        pw = qweight
        if qzeros is not None or scales is not None:
            raise TypeError("awq_linear: pass either an AWQWeight or (qweight, qzeros, scales), not both")
        qweight, qzeros, scales, group_size, packed, gemv = (pw.qweight, pw.qzeros, pw.scales, pw.group_size,
                                                             pw.packed, pw.gemv)
    elif qzeros is None or scales is None:
        raise TypeError("awq_linear: qzeros and scales are required with a stored qweight")
    xa, rows, k, ldx = _x_rows(x)
    qa, za, sa, k, n, g = _validate_awq(qweight, qzeros, scales, group_size, k)
    pk = _check_packed(A.wrap(packed, "packed", optional=True), FMT_AWQ, k, n, qa)
    ba = A.wrap(bias, "bias", optional=True)
    _check_common(xa, (qa, za, sa), ba, n)
    sa = _as_dtype(sa, xa.dtype, "scales")
    fast = n % 64 == 0 and _fast_group_ok(g) and k % 8 == 0
    if not fast or (use_dense(rows, xa.lib, xa.dtype) and not _w4_applies(gemv, xa, rows, n, k)):
        if not fast and xa.lib != "torch" and xa.dtype != "float16":
            raise ValueError(f"awq_linear: N={n}, group_size={g} needs the dense path, which needs torch or "
                             f"float16 with CuPy (the fast kernel needs N % 64 == 0 and G == 32 or G % 64 == 0)")
        for a in (qa, za, sa):
            if not a.is_contiguous():
                raise ValueError(f"{a.name}: must be contiguous for this shape")
        if rows == 0:
            return _finish(xa, A.empty(xa, (0, n), xa.dtype), 0, n)
        y = _dense_int4(FMT_AWQ, xa, rows, k, ldx, qa, za, sa, None, ba, n, g)
        return y.reshape(tuple(xa.shape[:-1]) + (n,))
    for a in (qa, za, sa):
        _check_aligned(a)
    out_shape = tuple(xa.shape[:-1]) + (n,)
    if rows and not (_aligned_rows_x(xa, ldx)):
        xa = _rows_copy(xa, rows, k)
        ldx = k
    y = _launch_linear(FMT_AWQ, xa, rows, k, ldx, pk.ptr if pk is not None else qa.ptr, _row_stride(qa), za.ptr,
                    _row_stride(za), sa.ptr, _row_stride(sa), ba.ptr if ba is not None else 0, n, g, pk is not None,
                    gemv)
    return y.reshape(out_shape)


def gptq_linear(x, qweight, qzeros=None, scales=None, g_idx=None, *, group_size: int = 128, bias=None):
    """``y = x @ W (+ bias)`` for a GPTQ 4-bit weight (AutoGPTQ "gptq" format) as stored, act-order included.

    Parameters
    ----------
    x : torch.Tensor or cupy.ndarray, shape (..., K), float16 or bfloat16; K % 8 == 0.
    qweight : int32 (K/8, N) packed along K; or a :class:`GPTQWeight` from :func:`prepack_gptq` (then the
        other weight arguments come from it).
    qzeros : int32 (ceil(K/G), N/8), packed along N, storing zero - 1.
    scales : float16 or bfloat16 (ceil(K/G), N); converted to x's dtype per call if it differs.
    g_idx : optional int32 (K).  ``k // G`` (or None) is the plain layout.  An act-order g_idx works as stored
        but is classified on the host and the weight repacked on every call: use :func:`prepack_gptq` once.
    group_size : G, default 128 (-1: one group).  The last group may be short.
    bias : optional (N,), x's dtype.

    Returns
    -------
    (..., N) in x's dtype and library.
    """
    if _torch_hook.compiling():
        return _torch_hook.op("gptq_linear")(x, qweight, qzeros, scales, g_idx, group_size=group_size, bias=bias)
    if (isinstance(qweight, GPTQWeight) and qweight.fast is not None and qzeros is None and scales is None
            and g_idx is None):
        y = _fast_call(qweight.fast, x, bias)
        if y is not None:
            return y
        if qweight.qweight is None:
            raise _compact_error(qweight.fast, x, bias)
    perm = packed = gemv = None
    if isinstance(qweight, GPTQWeight):
        pw = qweight
        if qzeros is not None or scales is not None or g_idx is not None:
            raise TypeError("gptq_linear: pass either a GPTQWeight or (qweight, qzeros, scales, g_idx), not both")
        qweight, qzeros, scales, g_idx, group_size, perm, packed, gemv = (
            pw.qweight, pw.qzeros, pw.scales, pw.g_idx, pw.group_size, pw.perm, pw.packed, pw.gemv)
    elif qzeros is None or scales is None:
        raise TypeError("gptq_linear: qzeros and scales are required with a stored qweight")
    xa, rows, k, ldx = _x_rows(x)
    qa, za, sa, ga, k, n, g = _validate_gptq(qweight, qzeros, scales, g_idx, group_size, k)
    ba = A.wrap(bias, "bias", optional=True)
    pa = A.wrap(perm, "perm", optional=True)
    pk = _check_packed(A.wrap(packed, "packed", optional=True), FMT_GPTQ, k, n, qa)
    _check_common(xa, (qa, za, sa, ga, pa), ba, n)
    sa = _as_dtype(sa, xa.dtype, "scales")
    irregular = False
    if ga is not None and pa is None:
        kind, host_perm = _classify_g_idx(ga, k, g)
        if kind == "act":
            pa = _to_device_like(qa, host_perm)
            qa = _permute_gptq(qa, pa, k, n)
            ga = None
        elif kind == "plain":
            ga = None
        else:
            irregular = True
    fast = not irregular and n % 64 == 0 and _fast_group_ok(g)
    if not fast or (use_dense(rows, xa.lib, xa.dtype) and not _w4_applies(gemv, xa, rows, n, k)):
        if not fast and xa.lib != "torch" and xa.dtype != "float16":
            raise ValueError(f"gptq_linear: this layer (N={n}, group_size={g}, irregular g_idx={irregular}) needs "
                             f"the dense path, which needs torch or float16 with CuPy")
        for a in (qa, za, sa):
            if not a.is_contiguous():
                raise ValueError(f"{a.name}: must be contiguous for this shape")
        if rows == 0:
            return _finish(xa, A.empty(xa, (0, n), xa.dtype), 0, n)
        if pa is not None:
            # Repacked act-order weight: dequantize it in sorted order, then put the rows back in x's order.
            xa = _gather_x(xa, rows, k, ldx, pa)
            ldx = k
        y = _dense_int4(FMT_GPTQ, xa, rows, k, ldx, qa, za, sa, ga, ba, n, g)
        return y.reshape(tuple(x.shape[:-1]) + (n,))
    for a in (qa, za, sa):
        _check_aligned(a)
    out_shape = tuple(xa.shape[:-1]) + (n,)
    if pa is not None:
        if rows:
            xa = _gather_x(xa, rows, k, ldx, pa)
            ldx = k
    elif rows and not _aligned_rows_x(xa, ldx):
        xa = _rows_copy(xa, rows, k)
        ldx = k
    y = _launch_linear(FMT_GPTQ, xa, rows, k, ldx, pk.ptr if pk is not None else qa.ptr, _row_stride(qa), za.ptr,
                    _row_stride(za), sa.ptr, _row_stride(sa), ba.ptr if ba is not None else 0, n, g, pk is not None,
                    gemv)
    return y.reshape(out_shape)


def int8_linear(x, weight, scales=None, *, bias=None):
    """``y = (x @ weight.T) * scales (+ bias)`` for an INT8 weight-only layer.

    Parameters
    ----------
    x : (..., K), float16 or bfloat16, CUDA.
    weight : int8 (N, K) (nn.Linear layout), rows 16-byte aligned; K % 16 == 0 and N % 64 == 0 for the fast
        kernel (other shapes: dense path, torch or CuPy float16); or an :class:`Int8Weight` from
        :func:`prepack_int8` (then ``scales`` comes from it).
    scales : (N,) one per output channel, float16, bfloat16 or float32 (used in x's dtype).
    bias : optional (N,), x's dtype.

    Returns
    -------
    (..., N) in x's dtype and library.
    """
    if _torch_hook.compiling():
        return _torch_hook.op("int8_linear")(x, weight, scales, bias=bias)
    if isinstance(weight, Int8Weight) and weight.fast is not None and scales is None:
        y = _fast_call(weight.fast, x, bias)
        if y is not None:
            return y
    packed = gemv = None
    if isinstance(weight, Int8Weight):
        if scales is not None:
            raise TypeError("int8_linear: pass either an Int8Weight or (weight, scales), not both")
        weight, scales, packed, gemv = weight.weight, weight.scales, weight.packed, weight.gemv
    elif scales is None:
        raise TypeError("int8_linear: scales is required with a stored weight")
    xa, rows, k, ldx = _x_rows(x)
    wa = A.wrap(weight, "weight")
    A.check_dtype(wa, ("int8",))
    if wa.ndim != 2 or wa.shape[1] != k:
        raise ValueError(f"weight: expected shape (N, K) with K={k} (x's last dimension), got {tuple(wa.shape)}")
    n = wa.shape[0]
    if n == 0 or k == 0:
        raise ValueError(f"weight: empty weight of shape {tuple(wa.shape)}")
    if k > 1 and wa.strides[1] != 1:
        raise ValueError(f"weight: the last dimension must be contiguous, got strides {wa.strides}")
    sa = A.wrap(scales, "scales")
    A.check_dtype(sa, A.FLOAT_DTYPES)
    A.check_shape(sa, (n,))
    if n > 1 and sa.strides[0] != 1:
        raise ValueError(f"scales: must be contiguous, got stride {sa.strides[0]}")
    ba = A.wrap(bias, "bias", optional=True)
    _check_common(xa, (wa, sa), ba, n)
    pk = _check_packed(A.wrap(packed, "packed", optional=True), FMT_INT8, k, n, wa)
    sa = _as_dtype(sa, xa.dtype, "scales")
    fast = n % 64 == 0 and k % 16 == 0 and _aligned_rows(wa)
    if not fast or (use_dense(rows, xa.lib, xa.dtype) and not _w4_applies(gemv, xa, rows, n, k)):
        if not fast and xa.lib != "torch" and xa.dtype != "float16":
            raise ValueError(f"int8_linear: N={n}, K={k} needs the dense path, which needs torch or float16 "
                             f"with CuPy (the fast kernel needs N % 64 == 0, K % 16 == 0, 16-byte aligned rows)")
        if rows == 0:
            return _finish(xa, A.empty(xa, (0, n), xa.dtype), 0, n)
        x2 = xa.obj.reshape(rows, k) if xa.is_contiguous() else _rows_copy(xa, rows, k).obj
        if fast:  # the weight dequantized by our kernel (W s rounded once to x's dtype), then cuBLAS
            w = _dequant_int8_launch(xa, wa, sa, n, k).obj
            y = x2 @ (w.t() if xa.lib == "torch" else w.T)
        elif xa.lib == "torch":
            import torch

            w = wa.obj.to(getattr(torch, xa.dtype))
            y = torch.matmul(x2, w.t()) * sa.obj
        else:
            w = wa.obj.astype(xa.dtype)
            y = (x2 @ w.T) * sa.obj
        if ba is not None:
            y += ba.obj
        return y.reshape(tuple(xa.shape[:-1]) + (n,))
    out_shape = tuple(xa.shape[:-1]) + (n,)
    if rows and not _aligned_rows_x(xa, ldx):
        xa = _rows_copy(xa, rows, k)
        ldx = k
    y = _launch_linear(FMT_INT8, xa, rows, k, ldx, pk.ptr if pk is not None else wa.ptr, _row_stride(wa), 0, 0, sa.ptr,
                    0, ba.ptr if ba is not None else 0, n, 0, pk is not None, gemv)
    return y.reshape(out_shape)
