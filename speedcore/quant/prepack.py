"""Prepacked layers (kernels/quant_pack.cu): the weight classes prepack_awq / prepack_gptq / prepack_int8 return,
the fragment-major copies, and GPTQ act-order's reordering of the weight and of x."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from .. import _arrays as A
from .._compile import Kernel
from .._launch import LaunchConfig, device_info, launch
from .formats import FMT_AWQ, FMT_GPTQ, FMT_INT8, KIND_INT4, KIND_INT8
from ._common import _aligned_rows, _as_dtype, _row_stride, _validate_awq, _validate_gptq
from .mma import _pack
from . import gemv as _gemv, stream as _stream
from .gemv import GEMV_GROUP_BYTES, GEMV_MAX_M, GEMV_STEP_K, gemv_supported, use_gemv
from .stream import stream_supported
from . import w4wgmma as _w4mod
from .w4wgmma import _w4wgmma_groups, _w4wgmma_pack, _w8wgmma_pack, w4wgmma_supported

SOURCE = "quant_pack.cu"


@lru_cache(maxsize=None)
def _gather_kernel(dtype: str) -> Kernel:
    return Kernel(SOURCE, f"quant::gather_columns_kernel<{A.CTYPE[dtype]}>")


_PERMUTE_KERNEL = Kernel(SOURCE, "quant::gptq_permute_k_kernel")


_GEMV_PACK_INT4 = {fmt: Kernel(SOURCE, f"quant::gemv_pack_int4_kernel<{fmt}>") for fmt in (FMT_AWQ, FMT_GPTQ)}
_GEMV_PACK_GROUPS = {fmt: Kernel(SOURCE, f"quant::gemv_pack_groups_kernel<{fmt}>") for fmt in (FMT_AWQ, FMT_GPTQ)}
_GEMV_PACK_INT8 = Kernel(SOURCE, "quant::gemv_pack_int8_kernel")


@dataclass(frozen=True)
class AWQWeight:
    """An AWQ layer checked once (``prepack_awq``): the stored tensors, scales in the activation dtype, and
    ``packed``, the tile-major copy of qweight that the fast kernel streams (None where it does not apply)."""
    qweight: object
    qzeros: object
    scales: object
    group_size: int
    in_features: int
    out_features: int
    packed: object = None
    fast: object = field(default=None, repr=False, compare=False)
    gemv: object = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class GPTQWeight:
    """A GPTQ layer prepared once (``prepack_gptq``).  Act-order checkpoints have their k rows repacked in
    group order (``perm``: new row i is old row ``perm[i]``); ``g_idx`` is kept only when its groups are not
    G consecutive rows after sorting (then only the dense path can use it).  ``packed`` is the tile-major copy
    the fast kernel streams (None where the fast kernel does not apply)."""
    qweight: object
    qzeros: object
    scales: object
    group_size: int
    in_features: int
    out_features: int
    perm: object = None
    g_idx: object = None
    packed: object = None
    fast: object = field(default=None, repr=False, compare=False)
    gemv: object = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Int8Weight:
    """An INT8 layer prepared once (``prepack_int8``): the stored tensors plus the tile-major copy."""
    weight: object
    scales: object
    in_features: int
    out_features: int
    packed: object = None
    fast: object = field(default=None, repr=False, compare=False)
    gemv: object = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class _GemvLayer:
    """The fragment-major copy for gemv_kernel (M <= 16): weight words, INT4 group records (scales of
    ``dtype`` + zero bytes; INT8: none, dtype None = any), steps per group, groups."""
    kind: int
    dtype: object
    weight: object
    groups: object
    w_ptr: int
    g_ptr: int
    spg: int
    ng: int
    w4_weight: object = None  # the wgmma-major INT4 copy for w4_wgmma_kernel (sm_90, unless switched off)
    w4_ptr: int = 0
    w4_groups: object = None  # its group records, group-major (the CTA's blocks of a group adjacent)
    w4_g_ptr: int = 0


def _want_gemv_layout(kind: int, n: int, k: int, group: int = 0) -> bool:
    """Whether prepack should build the fragment-major copy: the shape fits it and some M would use it."""
    if not gemv_supported(kind, k, n, group):
        return False
    if _stream._STREAM_MODE == "on" and stream_supported(kind, k, n, group):
        return True
    if _gemv._GEMV_MODE == "off":
        return False
    return _gemv._GEMV_MODE == "on" or any(use_gemv(kind, m, n, k) for m in range(1, GEMV_MAX_M + 1))


def _obj_ptr(a) -> tuple:
    """(object, device pointer) of an optional copy: (None, 0) where it was not made."""
    return (a.obj, a.ptr) if a is not None else (None, 0)


# prepack_awq / prepack_gptq's ``copies``: "all" keeps the stored tensors and every copy some kernel streams;
# "compact" keeps, where compact_applies, the wgmma-major copy and its group records alone (one INT4 copy for every
# M: gemv_stream_kernel's wgmma-major variant at M <= 16, w4_wgmma_kernel above), elsewhere what "all" keeps.
PREPACK_COPIES = ("all", "compact")


def compact_applies(n: int, k: int, group: int, cc: tuple) -> bool:
    """Whether an INT4 layer of N outputs, K inputs and groups of ``group`` can keep the wgmma-major copy alone on a
    GPU of compute capability ``cc``: sm_90 with w4_wgmma_kernel on (its copy) and both readers' shapes (N % 256 == 0,
    K and G multiples of 128)."""
    return (_w4mod._W4WGMMA_MODE != "off" and tuple(cc) == (9, 0) and w4wgmma_supported(k, n, group)
            and stream_supported(KIND_INT4, k, n, group))


def _check_copies(copies: str) -> None:
    if copies not in PREPACK_COPIES:
        raise ValueError(f"copies: expected one of {', '.join(map(repr, PREPACK_COPIES))}, got {copies!r}")


def _gemv_pack(fmt, qa, za, sa, k, n, group, compact: bool = False):
    """The fragment-major copy (and INT4 group records) of a checked layer, made on the GPU; ``compact`` (INT4,
    where compact_applies): the wgmma-major copy and its records instead, and no fragment-major words."""
    stream = A.stream_of(qa)
    if fmt == FMT_INT8:
        # Either copy may be wanted without the other (the gemv kernels are off for INT8 by default): the layer
        # holds what some M will use, w_ptr = 0 where the fragment-major copy was not made.
        words = None
        if _want_gemv_layout(KIND_INT8, n, k):
            words = A.empty(qa, (n * k // 4,), "int32", name="gemv_weight")
            total = words.shape[0]
            launch(_GEMV_PACK_INT8, LaunchConfig((-(-total // 256),), (256,)),
                   (words.ptr, qa.ptr, np.int32(k // GEMV_STEP_K), np.int64(_row_stride(qa)), np.int64(total)),
                   device=qa.device, stream=stream)
        w8 = _w8wgmma_pack(qa, k, n)
        if words is None and w8 is None:
            return None
        (w_obj, w_ptr), (w8_obj, w8_ptr) = _obj_ptr(words), _obj_ptr(w8)
        return _GemvLayer(KIND_INT8, None, w_obj, None, w_ptr, 0, 1, 1, w8_obj, w8_ptr)
    words = None
    if not compact:
        words = A.empty(qa, (n * k // 8,), "int32", name="gemv_weight")
        total = words.shape[0]
        launch(_GEMV_PACK_INT4[fmt], LaunchConfig((-(-total // 256),), (256,)),
               (words.ptr, qa.ptr, np.int32(k // GEMV_STEP_K), np.int64(_row_stride(qa)), np.int64(total)),
               device=qa.device, stream=stream)
    ng = -(-k // group)
    nb = n // 64
    recs = A.empty(qa, (nb * ng * GEMV_GROUP_BYTES,), "uint8", name="gemv_groups")
    total = nb * ng * 8
    launch(_GEMV_PACK_GROUPS[fmt], LaunchConfig((-(-total // 256),), (256,)),
           (recs.ptr, za.ptr, sa.ptr, np.int32(ng), np.int64(_row_stride(za)), np.int64(_row_stride(sa)),
            np.int64(total)), device=qa.device, stream=stream)
    w4 = _w4wgmma_pack(fmt, qa, k, n, group)
    w4g = _w4wgmma_groups(recs, nb, ng) if w4 is not None else None
    if compact:  # the records in fragment-major order were only the source of w4g's
        if w4 is None:
            raise AssertionError("compact prepacking without the wgmma-major copy (see compact_applies)")
        return _GemvLayer(KIND_INT4, sa.dtype, None, None, 0, 0, group // GEMV_STEP_K, ng, *_obj_ptr(w4),
                          *_obj_ptr(w4g))
    return _GemvLayer(KIND_INT4, sa.dtype, words.obj, recs.obj, words.ptr, recs.ptr, group // GEMV_STEP_K, ng,
                      *_obj_ptr(w4), *_obj_ptr(w4g))


@dataclass(frozen=True)
class _FastLayer:
    """What a prepacked layer's calls need, checked once: pointers, strides, sizes, dtype, device."""
    fmt: int
    dtype: str
    lib: str
    device: int
    k: int
    n: int
    group: int
    qw_ptr: int
    ldq: int
    qz_ptr: int
    ldz: int
    scales_ptr: int
    lds: int
    gemv: object = None
    perm: object = None  # act-order GPTQ (compact layers only): x's columns are gathered in this order per call
    # call signature -> cached launch (quant.linear._fast_call); not part of the layer's identity
    plans: dict = field(default_factory=dict, compare=False, hash=False, repr=False)


def _make_fast(fmt, packed_obj, qa, za, sa, k, n, g, gemv=None):
    pa = A.wrap(packed_obj, "packed")
    return _FastLayer(fmt, sa.dtype, qa.lib, qa.device, k, n, g, pa.ptr, _row_stride(qa),
                      za.ptr if za is not None else 0, _row_stride(za) if za is not None else 0, sa.ptr,
                      _row_stride(sa) if sa.ndim == 2 else 0, gemv)


def _fast_group_ok(group: int) -> bool:
    return group == 32 or group % 64 == 0


def _make_compact(fmt, qa, za, sa, k, n, g, perm=None):
    """(_FastLayer, _GemvLayer) of a compact layer: the wgmma-major copy and its records (_gemv_pack(compact=True)),
    no stored tensors (their pointers 0: quant.linear._choose never picks a kernel that reads them for it)."""
    gemv = _gemv_pack(fmt, qa, za, sa, k, n, g, compact=True)
    return _FastLayer(fmt, sa.dtype, qa.lib, qa.device, k, n, g, 0, 0, 0, 0, 0, 0, gemv,
                      A.wrap(perm, "perm") if perm is not None else None), gemv


def _cc(a) -> tuple:
    return device_info(a.device).cc


def prepack_awq(qweight, qzeros, scales, *, group_size: int = 128, dtype=None, copies: str = "all") -> AWQWeight:
    """Prepare an AWQ layer once for :func:`awq_linear`: checks, scales converted to the activation dtype
    (``dtype``: "float16" or "bfloat16", default the scales' dtype), and a tile-major copy of qweight (same
    size) that the fast kernel streams as contiguous 16 KB blocks.  The stored tensors are kept too.

    ``copies="compact"``: on sm_90, for layers with N % 256 == 0 and K, G multiples of 128 (compact_applies), only
    the wgmma-major copy and its group records (0.52 bytes per weight at G = 128; neither the stored tensors nor the
    other copies are kept): every M runs from that copy, and calls take x in the scales' (or ``dtype``'s) dtype
    only.  Elsewhere as "all"."""
    _check_copies(copies)
    qa, za, sa, k, n, g = _validate_awq(qweight, qzeros, scales, group_size)
    if dtype is not None:
        dtype = str(dtype).replace("torch.", "")
        if dtype not in A.HALF_DTYPES:
            raise TypeError(f"dtype: expected float16 or bfloat16, got {dtype}")
        sa = _as_dtype(sa, dtype, "scales")
    packed = fast = gemv = None
    aligned = all(_aligned_rows(a) for a in (qa, za, sa))
    if copies == "compact" and aligned and compact_applies(n, k, g, _cc(qa)):
        fast, gemv = _make_compact(FMT_AWQ, qa, za, sa, k, n, g)
        return AWQWeight(None, None, None, g, k, n, None, fast, gemv)
    if n % 64 == 0 and _fast_group_ok(g) and k % 8 == 0 and aligned:
        packed = _pack(FMT_AWQ, qa, k, n).obj
        if _want_gemv_layout(KIND_INT4, n, k, g):
            gemv = _gemv_pack(FMT_AWQ, qa, za, sa, k, n, g)
        fast = _make_fast(FMT_AWQ, packed, qa, za, sa, k, n, g, gemv)
    return AWQWeight(qa.obj, za.obj, sa.obj, g, k, n, packed, fast, gemv)


def _classify_g_idx(ga, k, g):
    """'plain' (g_idx == k // G), 'act' (G consecutive rows per group after a stable sort; returns the
    permutation as a device array), or 'irregular'.  Copies g_idx to the host (a synchronization)."""
    if ga.lib == "torch":
        host = ga.obj.detach().cpu().numpy()
    else:
        host = ga.obj.get()
    groups = -(-k // g)
    if host.min(initial=0) < 0 or host.max(initial=0) >= groups:
        raise ValueError(f"g_idx: values must be in [0, {groups}), got [{host.min()}, {host.max()}]")
    expect = np.arange(k, dtype=np.int64) // g
    if np.array_equal(host, expect):
        return "plain", None
    perm = np.argsort(host, kind="stable").astype(np.int32)
    if np.array_equal(host[perm], expect):
        return "act", perm
    return "irregular", None


def _to_device_like(ref, arr):
    if ref.lib == "torch":
        import torch

        return A.wrap(torch.from_numpy(np.ascontiguousarray(arr)).to(ref.obj.device), "perm")
    import cupy

    with cupy.cuda.Device(ref.device):
        return A.wrap(cupy.asarray(arr), "perm")


def _permute_gptq(qa, perm_a, k, n):
    out = A.empty(qa, (k // 8, n), "int32", name="qweight")
    total = (k // 8) * n
    launch(_PERMUTE_KERNEL, LaunchConfig((-(-total // 256),), (256,)),
           (out.ptr, qa.ptr, perm_a.ptr, np.int32(k), np.int32(n), np.int64(_row_stride(qa))),
           device=qa.device, stream=A.stream_of(qa))
    return out


def prepack_gptq(qweight, qzeros, scales, g_idx=None, *, group_size: int = 128, dtype=None,
                 copies: str = "all") -> GPTQWeight:
    """Prepare a GPTQ layer once for :func:`gptq_linear`.

    Makes a tile-major copy of qweight (same size) that the fast kernel streams as contiguous 16 KB blocks.
    With act-order, the k rows of ``qweight`` are first repacked in group order (a nibble gather on the GPU)
    and the permutation is kept, so each call only gathers the columns of x (M x K elements).  ``dtype`` converts the
    scales to the activation dtype once.  Copies g_idx to the host (a synchronization).  ``copies`` as
    :func:`prepack_awq` ("compact": the wgmma-major copy alone, act-order included: x's columns gathered per call).
    """
    _check_copies(copies)
    qa, za, sa, ga, k, n, g = _validate_gptq(qweight, qzeros, scales, g_idx, group_size)
    if dtype is not None:
        dtype = str(dtype).replace("torch.", "")
        if dtype not in A.HALF_DTYPES:
            raise TypeError(f"dtype: expected float16 or bfloat16, got {dtype}")
        sa = _as_dtype(sa, dtype, "scales")
    kind, perm = ("plain", None) if ga is None else _classify_g_idx(ga, k, g)
    if kind == "irregular":
        return GPTQWeight(qa.obj, za.obj, sa.obj, g, k, n, g_idx=ga.obj)
    perm_obj = None
    if kind == "act":
        perm_a = _to_device_like(qa, perm)
        qa = _permute_gptq(qa, perm_a, k, n)
        perm_obj = perm_a.obj
    packed = fast = gemv = None
    aligned = all(_aligned_rows(a) for a in (qa, za, sa))
    if copies == "compact" and aligned and compact_applies(n, k, g, _cc(qa)):
        fast, gemv = _make_compact(FMT_GPTQ, qa, za, sa, k, n, g, perm_obj)
        return GPTQWeight(None, None, None, g, k, n, perm=perm_obj, fast=fast, gemv=gemv)
    if n % 64 == 0 and _fast_group_ok(g) and aligned:
        packed = _pack(FMT_GPTQ, qa, k, n).obj
        if _want_gemv_layout(KIND_INT4, n, k, g):
            gemv = _gemv_pack(FMT_GPTQ, qa, za, sa, k, n, g)
        if perm_obj is None:
            fast = _make_fast(FMT_GPTQ, packed, qa, za, sa, k, n, g, gemv)
    return GPTQWeight(qa.obj, za.obj, sa.obj, g, k, n, perm=perm_obj, packed=packed, fast=fast, gemv=gemv)


def _gather_x(xa, rows, k, ldx, pa):
    out = A.empty(xa, (rows, k), xa.dtype, name="x")
    total = rows * k
    launch(_gather_kernel(xa.dtype), LaunchConfig((-(-total // 256),), (256,)),
           (out.ptr, xa.ptr, pa.ptr, np.int32(rows), np.int32(k), np.int64(ldx)),
           device=xa.device, stream=A.stream_of(xa))
    return out


def prepack_int8(weight, scales, *, dtype=None) -> Int8Weight:
    """Prepare an INT8 layer once for :func:`int8_linear`: checks, scales converted to ``dtype`` (the activation
    dtype) and a tile-major copy of the weight (same size) that the fast kernel streams as contiguous blocks; where
    the shape fits, also the fragment-major copy of the M <= 16 streaming kernels and, on sm_90 (N % 256 == 0,
    K % 64 == 0, unless SPEEDCORE_QUANT_W8WGMMA=0), the wgmma-major copy of w4_wgmma_kernel's INT8 variant (each the
    weight's size)."""
    wa = A.wrap(weight, "weight")
    A.check_dtype(wa, ("int8",))
    if wa.ndim != 2 or wa.shape[0] == 0 or wa.shape[1] == 0:
        raise ValueError(f"weight: expected a non-empty (N, K) matrix, got shape {tuple(wa.shape)}")
    n, k = wa.shape
    if k > 1 and wa.strides[1] != 1:
        raise ValueError(f"weight: the last dimension must be contiguous, got strides {wa.strides}")
    sa = A.wrap(scales, "scales")
    A.check_dtype(sa, A.FLOAT_DTYPES)
    A.check_shape(sa, (n,))
    A.check_same_device(wa, sa)
    if dtype is not None:
        dtype = str(dtype).replace("torch.", "")
        if dtype not in A.HALF_DTYPES:
            raise TypeError(f"dtype: expected float16 or bfloat16, got {dtype}")
        sa = _as_dtype(sa, dtype, "scales")
    packed = fast = gemv = None
    if n % 64 == 0 and k % 16 == 0 and _aligned_rows(wa) and sa.is_contiguous():
        packed = _pack(FMT_INT8, wa, k, n).obj
        gemv = _gemv_pack(FMT_INT8, wa, None, sa, k, n, 0)
        fast = _make_fast(FMT_INT8, packed, wa, None, sa, k, n, 0, gemv)
    return Int8Weight(wa.obj, sa.obj, k, n, packed, fast, gemv)
