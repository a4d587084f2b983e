"""Checkpoint formats of the quantized linears, in NumPy: packers, round-to-nearest quantizers, reference
dequantizers and a safetensors reader (no GPU needed)."""
from __future__ import annotations

import json
import struct

import numpy as np


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_POS = tuple(AWQ_ORDER.index(i) for i in range(8))  # nibble position of channel offset i

FMT_AWQ, FMT_GPTQ, FMT_INT8 = 0, 1, 2
_FMT_NAMES = {FMT_AWQ: "awq", FMT_GPTQ: "gptq", FMT_INT8: "int8"}

# Weight kinds of the fragment-major and wgmma-major prepacked layouts (the streaming kernels, quant_marlin_kernel,
# w4_wgmma_kernel); must match KIND_INT4 / KIND_INT8 in kernels/common/quant.cuh.
KIND_INT4, KIND_INT8 = 0, 1


def pack_awq(q) -> np.ndarray:
    """(R, N) values 0..15 -> int32 (R, N/8) in AWQ's interleaved order."""
    q = np.asarray(q)
    r, n = q.shape
    if n % 8:
        raise ValueError(f"q: the packed dimension must be a multiple of 8, got {n}")
    q = q.astype(np.uint32).reshape(r, n // 8, 8)
    out = np.zeros((r, n // 8), np.uint32)
    for i, o in enumerate(AWQ_ORDER):
        out |= (q[:, :, o] & 15) << np.uint32(4 * i)
    return np.ascontiguousarray(out).view(np.int32)


def unpack_awq(packed) -> np.ndarray:
    """int32 (R, N/8) in AWQ order -> uint8 (R, N)."""
    p = np.asarray(packed).view(np.uint32) if np.asarray(packed).dtype == np.int32 else np.asarray(packed, np.uint32)
    r, j = p.shape
    out = np.empty((r, j, 8), np.uint8)
    for i, o in enumerate(AWQ_ORDER):
        out[:, :, o] = (p >> np.uint32(4 * i)) & 15
    return out.reshape(r, 8 * j)


def pack_rows(q) -> np.ndarray:
    """(K, N) values 0..15 -> int32 (K/8, N), 8 consecutive rows per word in plain order (GPTQ qweight)."""
    q = np.asarray(q)
    k, n = q.shape
    if k % 8:
        raise ValueError(f"q: the packed dimension must be a multiple of 8, got {k}")
    q = q.astype(np.uint32).reshape(k // 8, 8, n)
    out = np.zeros((k // 8, n), np.uint32)
    for i in range(8):
        out |= (q[:, i, :] & 15) << np.uint32(4 * i)
    return out.view(np.int32)


def unpack_rows(packed) -> np.ndarray:
    """int32 (K/8, N) -> uint8 (K, N)."""
    p = np.ascontiguousarray(packed).view(np.uint32)
    r, n = p.shape
    out = np.empty((r, 8, n), np.uint8)
    for i in range(8):
        out[:, i, :] = (p >> np.uint32(4 * i)) & 15
    return out.reshape(8 * r, n)


def pack_cols(q) -> np.ndarray:
    """(R, N) values 0..15 -> int32 (R, N/8), 8 consecutive columns per word in plain order (GPTQ qzeros)."""
    q = np.asarray(q)
    r, n = q.shape
    if n % 8:
        raise ValueError(f"q: the packed dimension must be a multiple of 8, got {n}")
    q = q.astype(np.uint32).reshape(r, n // 8, 8)
    out = np.zeros((r, n // 8), np.uint32)
    for i in range(8):
        out |= (q[:, :, i] & 15) << np.uint32(4 * i)
    return out.view(np.int32)


def unpack_cols(packed) -> np.ndarray:
    """int32 (R, N/8) plain order -> uint8 (R, N)."""
    p = np.ascontiguousarray(packed).view(np.uint32)
    r, j = p.shape
    out = np.empty((r, j, 8), np.uint8)
    for i in range(8):
        out[:, :, i] = (p >> np.uint32(4 * i)) & 15
    return out.reshape(r, 8 * j)


def _group(group_size: int, k: int) -> int:
    g = int(group_size)
    if g == -1:
        return k
    if g <= 0:
        raise ValueError(f"group_size: must be positive (or -1 for one group per column), got {group_size}")
    return g


def _np_float(dtype):
    if dtype in ("float16", np.float16):
        return np.float16
    if dtype in ("bfloat16",):
        import ml_dtypes

        return ml_dtypes.bfloat16
    if dtype in ("float32", np.float32):
        return np.float32
    return np.dtype(dtype).type


def quantize_awq(weight, group_size: int = 128, *, scale_dtype="float16"):
    """Round-to-nearest asymmetric 4-bit quantization of ``weight`` (N, K) into the AWQ GEMM format.

    Returns ``(qweight int32 (K, N/8), qzeros int32 (K/G, N/8), scales (K/G, N))``, NumPy arrays; per group
    of G input rows and output channel: ``s = (max - min) / 15`` (rounded to ``scale_dtype``),
    ``z = clip(round(-min / s), 0, 15)``, ``q = clip(round(w / s) + z, 0, 15)``.  K must be a multiple of G and
    N of 8; ``group_size=-1`` is one group (per-channel).
    """
    w = np.asarray(weight, np.float32)
    if w.ndim != 2:
        raise ValueError(f"weight: expected (N, K), got shape {w.shape}")
    n, k = w.shape
    g = _group(group_size, k)
    if k % g:
        raise ValueError(f"weight: K={k} is not a multiple of group_size={g}")
    if n % 8:
        raise ValueError(f"weight: N={n} is not a multiple of 8")
    wt = w.T.reshape(k // g, g, n)
    lo, hi = wt.min(1), wt.max(1)
    s = (hi - lo) / 15.0
    s = np.where(s > 0, s, 1.0).astype(_np_float(scale_dtype)).astype(np.float32)
    z = np.clip(np.rint(-lo / s), 0, 15)
    q = np.clip(np.rint(wt / s[:, None, :]) + z[:, None, :], 0, 15).astype(np.uint8).reshape(k, n)
    return pack_awq(q), pack_awq(z.astype(np.uint8)), np.ascontiguousarray(s.astype(_np_float(scale_dtype)))


def quantize_gptq(weight, group_size: int = 128, *, perm=None, sym: bool = True, scale_dtype="float16"):
    """Round-to-nearest 4-bit quantization of ``weight`` (N, K) into AutoGPTQ's format (no Hessian updates).

    ``perm`` (optional, a permutation of range(K)) gives an act-order: input rows are grouped in the order
    ``perm`` (``g_idx[perm[i]] = i // G``), as GPTQ with ``desc_act=True`` does.  ``sym=True``: zero 8 and
    ``s = max|w| / 7.5``-style symmetric scales (``s = 2 max|w| / 15``); ``sym=False``: min/max scales with
    zeros in 1..15.  K must be a multiple of 8 and N of 8; the last group may be short (ceil(K/G) groups).

    Returns ``(qweight int32 (K/8, N), qzeros int32 (ceil(K/G), N/8), scales (ceil(K/G), N), g_idx int32 (K))``.
    """
    w = np.asarray(weight, np.float32)
    if w.ndim != 2:
        raise ValueError(f"weight: expected (N, K), got shape {w.shape}")
    n, k = w.shape
    g = _group(group_size, k)
    if k % 8 or n % 8:
        raise ValueError(f"weight: N={n} and K={k} must be multiples of 8")
    order = np.arange(k) if perm is None else np.asarray(perm, np.int64)
    if sorted(order.tolist()) != list(range(k)):
        raise ValueError("perm: must be a permutation of range(K)")
    g_idx = np.empty(k, np.int32)
    g_idx[order] = np.arange(k) // g
    groups = -(-k // g)
    wt = w.T  # (K, N)
    scales = np.empty((groups, n), np.float32)
    zeros = np.empty((groups, n), np.float32)
    for j in range(groups):
        rows = wt[g_idx == j]
        if sym:
            amax = np.abs(rows).max(0)
            s = 2 * amax / 15.0
            z = np.full(n, 8.0, np.float32)
        else:
            lo, hi = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
            s = (hi - lo) / 15.0
            z = None
        s = np.where(s > 0, s, 1.0).astype(_np_float(scale_dtype)).astype(np.float32)
        if z is None:
            z = np.clip(np.rint(-lo / s), 1, 15)
        scales[j], zeros[j] = s, z
    q = np.clip(np.rint(wt / scales[g_idx]) + zeros[g_idx], 0, 15).astype(np.uint8)
    qzeros = pack_cols((zeros - 1).astype(np.uint8))
    return pack_rows(q), qzeros, np.ascontiguousarray(scales.astype(_np_float(scale_dtype))), g_idx


def quantize_int8(weight, *, scale_dtype="float16"):
    """Symmetric per-output-channel INT8: ``s = max|w| / 127``, ``q = clip(round(w / s), -127, 127)``.

    ``weight`` (N, K) -> ``(weight int8 (N, K), scales (N,))`` NumPy arrays.
    """
    w = np.asarray(weight, np.float32)
    if w.ndim != 2:
        raise ValueError(f"weight: expected (N, K), got shape {w.shape}")
    s = np.abs(w).max(1) / 127.0
    s = np.where(s > 0, s, 1.0).astype(_np_float(scale_dtype)).astype(np.float32)
    q = np.clip(np.rint(w / s[:, None]), -127, 127).astype(np.int8)
    return np.ascontiguousarray(q), np.ascontiguousarray(s.astype(_np_float(scale_dtype)))


def dequantize_awq_reference(qweight, qzeros, scales, group_size: int = 128) -> np.ndarray:
    """The AWQ weight W (K, N) in float32, exactly ``(q - z) * s``."""
    q = unpack_awq(np.asarray(qweight))
    k, n = q.shape
    g = _group(group_size, k)
    z = unpack_awq(np.asarray(qzeros)).astype(np.float32)
    s = np.asarray(scales).astype(np.float32)
    grp = np.arange(k) // g
    return (q.astype(np.float32) - z[grp]) * s[grp]


def dequantize_gptq_reference(qweight, qzeros, scales, g_idx=None, group_size: int = 128) -> np.ndarray:
    """The GPTQ weight W (K, N) in float32, exactly ``s[g] * (q - (zeros[g] + 1))`` with ``g = g_idx[k]``."""
    q = unpack_rows(np.asarray(qweight))
    k, n = q.shape
    g = _group(group_size, k)
    z = unpack_cols(np.asarray(qzeros)).astype(np.float32) + 1
    s = np.asarray(scales).astype(np.float32)
    grp = np.arange(k) // g if g_idx is None else np.asarray(g_idx, np.int64)
    return s[grp] * (q.astype(np.float32) - z[grp])


def dequantize_int8_reference(weight, scales) -> np.ndarray:
    """The INT8 weight as W (K, N) in float32: ``weight.T * scales``."""
    return np.asarray(weight).astype(np.float32).T * np.asarray(scales).astype(np.float32)[None, :]


_ST_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "I8": "int8",
              "U8": "uint8", "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool"}


def load_safetensors(path, prefix: str = "") -> dict:
    """The tensors of a ``.safetensors`` file whose names start with ``prefix``, as NumPy arrays keyed by the
    rest of the name (``load_safetensors(f, "model.layers.0.mlp.down_proj.")`` -> ``{"qweight": ...,
    "qzeros": ..., "scales": ..., "g_idx": ...}``).  bfloat16 comes back as ``ml_dtypes.bfloat16``.  Reads the
    format directly (8-byte header length, JSON header, raw little-endian data); no extra dependency.
    """
    out = {}
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise ValueError(f"{path}: not a safetensors file (header of {n} bytes)")
        header = json.loads(f.read(n))
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__" or not name.startswith(prefix):
                continue
            dt = _ST_DTYPES.get(info["dtype"])
            if dt is None:
                raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
            start, end = info["data_offsets"]
            f.seek(base + start)
            raw = f.read(end - start)
            arr = np.frombuffer(raw, dtype=_np_float(dt) if dt == "bfloat16" else np.dtype(dt).newbyteorder("<"))
            out[name[len(prefix):]] = arr.reshape(info["shape"]).copy()
    return out
