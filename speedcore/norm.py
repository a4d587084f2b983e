"""RMSNorm and fused add + RMSNorm (kernels/norm.cu)."""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import _arrays as A
from . import _torch_hook
from ._arrays import sig
from ._compile import Kernel
from ._launch import LaunchConfig, bind, chained, plan_cache

SOURCE = "norm.cu"
MAX_HIDDEN = 16384
MAX_THREADS = 512
_NV_CHOICES = (1, 2, 4, 8)


@lru_cache(maxsize=4096)
def rms_norm_config(hidden: int, itemsize: int, vectorized: bool) -> tuple:
    """(vectors per thread, threads per block) for one row of ``hidden`` elements.

    Vectorized rows (16-byte accesses) are kept in registers.  Bandwidth needs bytes in flight: four 16-byte
    loads per thread issued together, with small blocks (128 threads for a 4096-wide bf16 row) so that many
    rows are in flight per SM; more vectors per thread only when a row would need more than 512 threads.
    Other rows (odd sizes, unaligned views) use the row-loop kernel (vectors per thread 0).
    """
    if not vectorized:
        return 0, min(MAX_THREADS, max(32, -(-hidden // 32) * 32))
    nvec = hidden // (16 // itemsize)
    nv = 1
    while nv < 4 and nv * 32 < nvec:
        nv *= 2
    while -(-nvec // nv) > MAX_THREADS:
        nv *= 2
    threads = -(-nvec // nv)
    return nv, max(32, -(-threads // 32) * 32)


@lru_cache(maxsize=None)
def _kernel(dtype: str, nv: int, residual: bool) -> Kernel:
    r = "true" if residual else "false"
    if nv == 0:
        return Kernel(SOURCE, f"rms_norm_rowloop_kernel<{A.CTYPE[dtype]}, {r}>")
    return Kernel(SOURCE, f"rms_norm_kernel<{A.CTYPE[dtype]}, {nv}, {r}>")


def all_kernels() -> list:
    """Every variant :func:`rms_norm` can launch (for ``python -m speedcore compile``)."""
    out = []
    for dtype in A.FLOAT_DTYPES:
        max_nv = rms_norm_config(MAX_HIDDEN, A.ITEMSIZE[dtype], True)[0]
        for nv in (0,) + tuple(n for n in _NV_CHOICES if n <= max_nv):
            for residual in (False, True):
                out.append(_kernel(dtype, nv, residual))
    return out


def rms_norm(x, weight, eps: float = 1e-6, *, residual=None, out=None, residual_out=None):
    """Root-mean-square layer norm over the last dimension, optionally fused with a residual add.

    ``y = x / sqrt(mean(x**2, -1) + eps) * weight``.  With ``residual``: ``h = x + residual`` (rounded to the
    input dtype) and the call returns ``(rms_norm(h) * weight, h)`` in one pass over memory.

    Parameters
    ----------
    x : torch.Tensor or cupy.ndarray, shape (..., hidden)
        float16, bfloat16 or float32 on a CUDA device; 1 <= hidden <= 16384.  The last dimension must be
        contiguous; the leading dimensions may be any view that collapses to one row stride.
    weight : same library, shape (hidden,), contiguous, same dtype as ``x``.
    eps : float
        Added to the mean square.
    residual : optional, same shape and dtype as ``x``.
    out : optional, same shape and dtype as ``x``; written in place and returned.  May be ``x`` itself.
    residual_out : optional, with ``residual``: where ``h`` is written (same shape and dtype; may be
        ``residual`` itself or ``x`` itself, as vLLM's in-place ``fused_add_rms_norm``, but must not otherwise
        overlap an operand).  By default ``h`` is a new array.  Nothing is allocated when both ``out`` and
        ``residual_out`` are given (what a CUDA-graph capture needs).

    Returns
    -------
    out, or (out, h) when ``residual`` is given; arrays of the input's library (torch or CuPy), on the
    caller's current stream.
    """
    if _torch_hook.compiling():
        return _torch_hook.op("rms_norm")(x, weight, eps, residual=residual, out=out, residual_out=residual_out)
    try:
        plan = _PLANS.get((sig(x), sig(weight), None if residual is None else sig(residual),
                           None if out is None else sig(out), None if residual_out is None else sig(residual_out),
                           eps))
    except TypeError:  # an unhashable eps: the full check names it
        plan = None
    if plan is not None:
        result = plan(x, weight, residual, out, residual_out)
        if result is not None:
            return result
    return _rms_norm_checked(x, weight, eps, residual, out, residual_out)


# (x, weight, residual, out, residual_out signatures, eps) -> the validated launch for that call signature; see _arrays.sig
_PLANS: dict = plan_cache()
_MAX_PLANS = 1024


def _rms_norm_checked(x, weight, eps, residual, out, residual_out):
    xa = A.wrap(x, "x")
    wa = A.wrap(weight, "weight")
    ra = A.wrap(residual, "residual", optional=True)
    oa = A.wrap(out, "out", optional=True)
    hga = A.wrap(residual_out, "residual_out", optional=True)
    if hga is not None and ra is None:
        raise ValueError("residual_out: needs residual (h = x + residual is what it receives)")
    A.check_dtype(xa, A.FLOAT_DTYPES)
    A.check_same_dtype(xa, wa, ra, oa, hga)
    A.check_same_device(xa, wa, ra, oa, hga)
    hidden = xa.shape[-1] if xa.ndim else 0
    rows, x_stride = xa.rows()
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"x: hidden size (last dimension) must be between 1 and {MAX_HIDDEN}, got {hidden}")
    A.check_shape(wa, (hidden,))
    if hidden > 1 and wa.strides[-1] != 1:
        raise ValueError(f"weight: must be contiguous, got stride {wa.strides[-1]}")
    eps = float(eps)
    if not eps >= 0.0:
        raise ValueError(f"eps: must be a non-negative float, got {eps}")
    r_stride = 0
    if ra is not None:
        A.check_shape(ra, xa.shape)
        _, r_stride = ra.rows()
    if oa is None:
        oa = A.empty(xa, xa.shape, xa.dtype)
    else:
        A.check_shape(oa, xa.shape)
        A.check_no_overlap(oa, wa, ra)
    _, o_stride = oa.rows()
    ha = None
    h_stride = 0
    if hga is not None:
        A.check_shape(hga, xa.shape)
        _, h_stride = hga.rows()
        # h may replace residual or x element by element (each is read before h is written), nothing else
        others = [a for a in (ra, xa) if not (a.ptr == hga.ptr and a.strides == hga.strides)]
        A.check_no_overlap(hga, wa, *others)
        if A.extent(hga) and A.extent(oa) and hga.ptr < oa.ptr + A.extent(oa) and oa.ptr < hga.ptr + A.extent(hga):
            raise ValueError("residual_out: overlaps out in memory")
        ha = hga
    elif ra is not None:
        ha = A.empty(xa, xa.shape, xa.dtype, name="h")
        h_stride = hidden

    result = (oa.obj, ha.obj) if ha is not None else oa.obj
    if rows == 0:
        return result  # not cached: nothing to launch

    vec_bytes = 16
    vec_elems = vec_bytes // xa.itemsize
    operands = [(a, s) for a, s in ((xa, x_stride), (oa, o_stride), (ra, r_stride), (ha, h_stride)) if a is not None]
    vectorized = hidden % vec_elems == 0 and wa.aligned(vec_bytes) and all(
        a.aligned(vec_bytes) and (s * a.itemsize) % vec_bytes == 0 for a, s in operands)
    nv, threads = rms_norm_config(hidden, xa.itemsize, vectorized)
    kernel = _kernel(xa.dtype, nv, ra is not None)
    args = (oa.ptr, ha.ptr if ha is not None else 0, xa.ptr, ra.ptr if ra is not None else 0, wa.ptr,
            np.int32(hidden), np.int64(x_stride), np.int64(r_stride), np.int64(o_stride), np.int64(h_stride),
            np.float32(eps))
    bl = bind(kernel, chained(LaunchConfig((rows,), (threads,)), xa.device), xa.device)
    bl(A.stream_of(xa).ptr, args)
    key = (sig(x), sig(weight), sig(residual), sig(out), sig(residual_out), eps)
    if A.cacheable(key):
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = _plan(xa, wa, ra, oa if out is not None else None, hga, bl.prepacked((int,) * 5, args[5:]))
    return result


def _overlap(a: int, a_ext: int, b: int, b_ext: int) -> bool:
    return a < b + b_ext and b < a + a_ext


def _plan(xa, wa, ra, oa, ha, launch):
    """The launch of one validated call signature (``oa`` / ``ha``: the given out / residual_out, else None): per
    call only pointers, the allocations, the overlap checks of given outputs, the stream and the launch; returns
    None where an overlap check fails, so the full path raises."""
    lib = A.fast_lib(xa.lib)
    ptr, stream, empty_like = lib.ptr, lib.stream, lib.empty_like
    device = xa.device
    x_ext, w_ext = A.extent(xa), A.extent(wa)
    r_ext = A.extent(ra) if ra is not None else 0
    o_ext = A.extent(oa) if oa is not None else 0
    h_ext = A.extent(ha) if ha is not None else 0
    # out may be residual itself, h residual or x itself (same layout: each element is read before it is
    # written), never a shifted view
    r_inplace_ok = ra is not None and oa is not None and ra.strides == oa.strides
    h_may_be = (ha.strides == ra.strides, ha.strides == xa.strides) if ha is not None else (False, False)

    def run(x, weight, residual, out, residual_out):
        xp, wp = ptr(x), ptr(weight)
        rp = ptr(residual) if residual is not None else 0
        if residual_out is not None:
            hp = ptr(residual_out)
            if (_overlap(wp, w_ext, hp, h_ext) or (_overlap(rp, r_ext, hp, h_ext) and not (rp == hp and h_may_be[0]))
                    or (_overlap(xp, x_ext, hp, h_ext) and not (xp == hp and h_may_be[1]))):
                return None
        if out is None:
            out = empty_like(x)
            op = ptr(out)
        else:
            op = ptr(out)
            if _overlap(wp, w_ext, op, o_ext) or (residual_out is not None and _overlap(hp, h_ext, op, o_ext)):
                return None
            if residual is not None and _overlap(rp, r_ext, op, o_ext) and not (rp == op and r_inplace_ok):
                return None
        if residual is None:
            launch(stream(device), op, 0, xp, 0, wp)
            return out
        h = residual_out if residual_out is not None else empty_like(x)
        launch(stream(device), op, ptr(h), xp, rp, wp)
        return out, h

    return run
