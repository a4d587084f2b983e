"""Weight-only quantized linear layers (kernels/quant.cu): INT4 AWQ and GPTQ checkpoints as stored, and INT8.

Formats (bit-exact; ``y = x @ W`` with ``W`` of shape (K, N), K = in_features, N = out_features):

* AWQ "GEMM" (AutoAWQ / llm-awq, 4 bits, zero points): ``qweight`` int32 (K, N/8) packs 8 values along N in the
  order [0, 2, 4, 6, 1, 3, 5, 7] (``qweight[k, j] |= q[k, 8j + AWQ_ORDER[i]] << 4i``); ``qzeros`` int32
  (K/G, N/8) packed the same way; ``scales`` (K/G, N).  ``W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]``.
* GPTQ (AutoGPTQ, checkpoint_format "gptq"): ``qweight`` int32 (K/8, N) packs 8 values along K in plain order;
  ``qzeros`` int32 (ceil(K/G), N/8) packs along N in plain order and stores zero - 1; ``scales`` (ceil(K/G), N);
  ``g_idx`` int32 (K) (act-order when it is not ``k // G``).
  ``W[k, n] = s[g_idx[k], n] * (q[k, n] - (zeros[g_idx[k], n] + 1))``.
* INT8 weight-only: ``weight`` int8 (N, K) (the nn.Linear layout), one scale per output channel:
  ``W[k, n] = weight[n, k] * scales[n]``.

The linear functions take the checkpoint tensors as stored, or the result of ``prepack_awq`` / ``prepack_gptq``
/ ``prepack_int8`` (checked once, a tile-major copy of the weight the kernel streams as contiguous 16 KB blocks,
act-order rows sorted by group): prepack once per layer for speed.  Prepacking also builds a second,
fragment-major copy (same size as the weight; INT4 plus per-group scale/zero records, ~5%) for the M <= 16
streaming kernels: ``gemv_stream_kernel`` (every warp streams 4 KB chunks straight into mma fragments) where
K and G are multiples of 128 (``use_stream``), its cp.async.bulk twin ``gemv_bulk_kernel`` for INT4 at M = 1 on
large layers with N <= K on sm_90+ (``use_bulk``), else ``gemv_kernel`` or the tile-major kernel (``use_gemv``),
all from H200 measurements.  INT4 layers with that copy can also take ``quant_marlin_kernel`` at 17 <= M <= 128 (a
tensor-core kernel that stages x once per 256-channel CTA, stream-K over the SMs; ``use_marlin``, where it
measured ahead; ``SPEEDCORE_QUANT_MARLIN=1`` / ``0`` forces it on / off).  On sm_90 (H100/H200),
prepack also builds a wgmma-major INT4 copy (the packed weight's size again) and INT4 layers with N % 256 == 0, K
and G multiples of 128 take ``w4_wgmma_kernel`` at 17 <= M <= 1024 (up to M = 8192 from N = 4096; tile shape per
problem: ``w4wgmma_shape``; kernels/quant_sm90.cu: wgmma with the dequantized weights as the register A operand, TMA
x tiles, split-K where the tiles do not fill the GPU), before every other choice including the dense path
(``use_w4wgmma``, where it measured ahead; ``SPEEDCORE_QUANT_W4WGMMA=1`` extends it to 17 <= M <= 8192, ``0`` turns
it and the copy off).  INT8 layers with N % 256 == 0 and K % 64 == 0 get a wgmma-major INT8 copy as well and take
the kernel's INT8 variant at 17 <= M <= 8192 (``use_w8wgmma``; ``SPEEDCORE_QUANT_W8WGMMA=0`` turns it off).  Split-K
launches use a per-stream scratch buffer and zeroed counters kept by this module (an outgrown buffer stays
allocated, so CUDA graphs captured with it stay valid; graphs captured on one stream share it: replay them in
order, not concurrently).

This module also holds round-to-nearest quantizers producing exactly these formats from a float weight (N, K),
NumPy reference dequantizers, a safetensors reader, and GPU dequantizers.  NumPy-only functions need no GPU.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from . import _arrays as A
from ._compile import Kernel
from ._launch import MAX_CLUSTER, LaunchConfig, device_info, get_kernel, launch

SOURCE = "quant.cu"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_POS = tuple(AWQ_ORDER.index(i) for i in range(8))  # nibble position of channel offset i

FMT_AWQ, FMT_GPTQ, FMT_INT8 = 0, 1, 2
_FMT_NAMES = {FMT_AWQ: "awq", FMT_GPTQ: "gptq", FMT_INT8: "int8"}

# Must match kernels/quant.cu.
THREADS = 256
BLOCK_N = 512
STAGES = 4
W_STAGE_BYTES = 16384
MT_CHOICES = (1, 2, 4, 8)   # 8-row tiles of x per CTA: M <= 8, 16, 32, 64 per chunk
MAX_MMA_M = 128             # above this (and where a dense matmul is available) dequantize + cuBLAS
_ITEM = {"float16": 2, "bfloat16": 2}

# The small-M streaming kernel (gemv_kernel) on its fragment-major prepacked layout; must match kernels/quant.cu.
KIND_INT4, KIND_INT8 = 0, 1
GEMV_MAX_M = 16             # rows of x it handles (two 8-row mma tiles)
GEMV_WARPS = 8
GEMV_STEP_K = 32            # k per pipeline stage
GEMV_GROUP_BYTES = 192      # INT4 group record per (block, group)
GEMV_CTAS_PER_SM = 2

# The register-streaming small-M kernel (gemv_stream_kernel) on the same layout; must match kernels/quant.cu.
STREAM_CHUNK_K = 128        # k per chunk (4 steps): K and (INT4) G must be multiples of it
STREAM_PREFETCH = 0         # chunks prefetched into L2 ahead of the one being loaded (H200: 1-3 were slower)
STREAM_NBC_CHOICES = (1, 2, 4)  # blocks per CTA of gemv_stream_kernel built (its NBC; > 1 at M > 8 only)
STREAM_INT8_MIN_WARPS = (8, 4)  # INT8: at least this many warps per 32-channel block (M <= 8, M <= 16)
STREAM_SPLIT_COST_CHUNKS = 1.5  # INT4 at M > 8: a K split's cost in chunk loads per warp (stream_config)
# gemv_bulk_kernel (sm_90+): the same chunks through cp.async.bulk into per-warp shared-memory rings.
BULK_MAX_WARPS = 16
BULK_X_PITCH = 288          # bytes per staged row of x (256 + 32: conflict-free 8-byte reads)
BULK_SMEM_PER_SM = 233472   # 228 KB per SM (Hopper), 1 KB of it reserved per CTA
BULK_SMEM_PER_CTA = 232448  # 227 KB
# quant_marlin_kernel (17 <= M <= 128, INT4 on the fragment-major layout); must match kernels/quant.cu.
MARLIN_BLOCKS = 4           # 64-channel blocks per CTA (256 channels), one per warp column
MARLIN_WARPS = 8            # MARLIN_BLOCKS x 2 halves of each 128-k chunk
MARLIN_X_PITCH = 288        # bytes per staged row of x (128 k + 32: conflict-free 8-byte reads)
MARLIN_MT_CHOICES = (4, 8)  # 8-row x tiles per CTA: M <= 32, M <= 64 per m-chunk
# w4_wgmma_kernel (sm_90a, kernels/quant_sm90.cu): INT4 GEMM on wgmma with A from registers; must match it.
W4WGMMA_SOURCE = "quant_sm90.cu"
W4WGMMA_BK = 64               # k per chunk (a ring stage holds ks chunks: W4WGMMA_STAGE_CHUNKS)
W4WGMMA_STAGE_CHUNKS = (1, 2)  # 64-k chunks per ring stage (ks); the first is the default
W4WGMMA_BLOCK_BYTES = 2048    # INT4 weights of one 64-channel block x 64 k in the wgmma-major layout
W8WGMMA_BLOCK_BYTES = 4096    # INT8 weights of one block x 64 k (w4_wgmma_kernel with KIND = W_INT8)
W4WGMMA_BLK = 2               # blocks per consumer warpgroup where an override leaves it open (CTA: 128 BLK channels)
# Every compiled (mt, blk) shape: 256-channel CTAs at 64 / 128 rows, 128-channel CTAs (twice the tiles) with mt up
# to 256 (a 64 x 256 fp32 accumulator: 128 registers per consumer thread, which fits the 232 of setmaxnreg only with
# one block per warpgroup).  (512-channel CTAs at 64 rows, which read each x tile half as often, were slower in
# every case of the H200 sweep at dc766cf, e.g. 8192^2 M = 64 56.6 against 33.1 us, and were removed.)
W4WGMMA_SHAPES = {2: (64, 128), 1: (64, 96, 128, 160, 192, 256)}
W4WGMMA_MAX_STAGES = 8
W4WGMMA_MAX_SPLITS = MAX_CLUSTER  # a tile's splits are one thread-block cluster (kernel: W4_MAX_SPLITS)
W4WGMMA_GROUP_STEPS = (1, 2, 4)  # k16 steps per wgmma group (commit / wait granularity); the first is the default
# (blk, mt) without gs = 4: 256-row tiles spill 8 bytes there (and measured slower).  And INT4 at blk = 1 takes gs = 4
# only with 128-k stages (ks = 2, the 64-row tiles the heuristic picks): with 64-k stages ptxas serializes its
# wgmma since the packed split-K epilogue (session 16), and the heuristic never chose them (w4wgmma_gs4_built).
W4WGMMA_NO_GS4 = {(1, 256)}
# INT8 (KIND = W_INT8) variants built: the shapes w4wgmma_shape chooses among (W4WGMMA_CANDIDATES), and ks = 1 /
# gs = 1 of some for comparison.
W8WGMMA_VARIANTS = {(2, 64, 4, 2), (1, 64, 4, 2), (2, 128, 1, 1), (1, 128, 1, 1), (1, 256, 2, 1), (1, 128, 4, 1),
                    (1, 128, 2, 1), (1, 192, 2, 1), (1, 96, 2, 1), (1, 160, 2, 1), (2, 64, 4, 1), (1, 64, 4, 1),
                    (2, 64, 1, 1), (1, 64, 1, 1), (1, 256, 1, 1)}
W4WGMMA_SMEM_LIMIT = 232448   # 227 KB per block on sm_90
# Bits per fp32 partial that the two ranks of a split-K cluster hand each other (kernels/quant_sm90.cu
# W4_SPLIT_PACK: 24 = sign, exponent and 15 mantissa bits; the exchange's bytes are its cost).
W4WGMMA_SPLIT_PACK = 24
W4WGMMA_PUSH_MIN_STAGES = 4  # fewest ring stages a two-rank split keeps to make room for its receive buffer
W4WGMMA_M_RANGE = (17, 8192)


def _block_k(fmt: int) -> int:
    return 32 if fmt == FMT_INT8 else 64


def _x_stride(fmt: int) -> int:
    return _block_k(fmt) + {FMT_AWQ: 16, FMT_GPTQ: 32, FMT_INT8: 64}[fmt]


def smem_bytes(fmt: int, mt: int) -> int:
    """Dynamic shared memory of quant_mma_kernel<T, fmt, mt> (the layout in kernels/quant.cu)."""
    x_bytes = mt * 8 * _x_stride(fmt) * 2
    s_bytes = 0 if fmt == FMT_INT8 else 2 * BLOCK_N * 2 + 2 * (BLOCK_N // 8) * 4
    return STAGES * (W_STAGE_BYTES + x_bytes + s_bytes)


# ---------------------------------------------------------------------------------------------------------------
# NumPy: packing, quantizers, reference dequantizers, safetensors
# ---------------------------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------------------------
# Launch configuration
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MMAConfig:
    mt: int               # 8-row tiles of x per CTA
    m_chunks: int         # CTAs along M (each re-reads the weights, from L2 when they fit)
    n_tiles: int          # CTAs along N (512 channels each)
    splits: int           # CTAs along K
    tiles_per_split: int  # k-tiles per split
    smem: int             # dynamic shared memory per CTA

    @property
    def grid(self) -> int:
        return self.m_chunks * self.n_tiles * self.splits


@lru_cache(maxsize=8192)
def mma_config(m: int, n: int, k: int, fmt: int, sms: int) -> MMAConfig:
    """Tile and split-K choice for quant_mma_kernel (a pure function of the problem and the SM count).

    M goes in chunks of up to 64 rows (the smallest 8-row multiple that holds M).  Split-K is chosen by a
    small cost model: waves of CTAs times k-tiles per CTA (plus a pipeline fill of 2 tiles), plus the fp32
    partials each split writes and the last CTA reads back, in the same units (16 KB weight tiles streamed by
    all resident CTAs at once).
    """
    rows = min(m, 64)
    mt = next(t for t in MT_CHOICES if 8 * t >= rows)
    m_chunks = -(-m // (8 * mt))
    n_tiles = -(-n // BLOCK_N)
    k_tiles = -(-k // _block_k(fmt))
    per_sm = 2 if mt <= 2 else 1
    slots = sms * per_sm
    base = m_chunks * n_tiles
    best = None
    for s in range(1, min(k_tiles, 64) + 1):
        tps = -(-k_tiles // s)
        s_eff = -(-k_tiles // tps)
        waves = -(-(base * s_eff) // slots)
        partial = 0.0 if s_eff == 1 else s_eff * m * n * 8 / (W_STAGE_BYTES * slots)
        cost = waves * (tps + 2) + partial
        if best is None or cost < best[0] - 1e-9:
            best = (cost, s_eff, tps)
    _, splits, tps = best
    return MMAConfig(mt, m_chunks, n_tiles, splits, tps, smem_bytes(fmt, mt))


def gemv_block_n(kind: int) -> int:
    """Output channels per block of the fragment-major layout: 64 (INT4, 4 mma tiles) or 32 (INT8, 2)."""
    return 64 if kind == KIND_INT4 else 32


def gemv_stages(kind: int, mt: int) -> int:
    """cp.async ring depth per warp of gemv_kernel<T, kind, mt> (Gemv<>::D in kernels/quant.cu)."""
    if kind == KIND_INT4:
        return 7 if mt == 1 else 5
    return 8 if mt == 1 else 6


def gemv_smem_bytes(kind: int, mt: int) -> int:
    """Dynamic shared memory of gemv_kernel: per-warp rings (weights, x, group records) + the reduction rows."""
    slot = 1024 + 512 * mt + (GEMV_GROUP_BYTES if kind == KIND_INT4 else 0)
    red = GEMV_WARPS * 8 * (gemv_block_n(kind) + 4) * 4
    return GEMV_WARPS * gemv_stages(kind, mt) * slot + red


def gemv_supported(kind: int, k: int, n: int, group: int = 0) -> bool:
    """Shapes the fragment-major layout covers: K % 32 == 0, N a multiple of the block, G % 32 == 0 (INT4)."""
    if k <= 0 or n <= 0 or k % GEMV_STEP_K or n % gemv_block_n(kind):
        return False
    return kind == KIND_INT8 or (group > 0 and group % GEMV_STEP_K == 0)


@dataclass(frozen=True)
class GemvConfig:
    mt: int       # 8-row mma tiles of x (M <= 8: 1, M <= 16: 2)
    blocks: int   # NB: channel blocks
    steps: int    # KS: 32-k steps per block
    grid: int     # persistent CTAs; each owns an equal run of the NB x KS steps (stream-K)
    smem: int


@lru_cache(maxsize=8192)
def gemv_config(m: int, n: int, k: int, kind: int, sms: int) -> GemvConfig:
    """Launch shape of gemv_kernel (a pure function of the problem and the SM count): two CTAs per SM, each
    with an equal share of the steps, but at least 16 steps (two per warp) per CTA on small problems."""
    mt = 1 if m <= 8 else 2
    nb, ks = n // gemv_block_n(kind), k // GEMV_STEP_K
    units = nb * ks
    grid = max(1, min(GEMV_CTAS_PER_SM * sms, units // 16))
    return GemvConfig(mt, nb, ks, grid, gemv_smem_bytes(kind, mt))


def stream_max_warps(kind: int, mt: int) -> int:
    """Warps per CTA of gemv_stream_kernel<T, kind, mt> (its launch bounds, StreamWarps<> in kernels/quant.cu),
    which is also the resident warps per SM the single-wave grid is sized for: 16 at <= 128 registers, 12 for
    INT4 at M > 8 (<= 168 registers)."""
    return 12 if (kind == KIND_INT4 and mt == 2) else 16


def stream_supported(kind: int, k: int, n: int, group: int = 0) -> bool:
    """Shapes gemv_stream_kernel covers: the fragment-major layout, K % 128 == 0 and (INT4) G % 128 == 0, so
    that a 4-step chunk never straddles a group."""
    if not gemv_supported(kind, k, n, group) or k % STREAM_CHUNK_K:
        return False
    return kind == KIND_INT8 or group % STREAM_CHUNK_K == 0


@dataclass(frozen=True)
class StreamConfig:
    mt: int        # 8-row mma tiles of x (M <= 8: 1, M <= 16: 2)
    blocks: int    # NB: channel blocks (64 INT4, 32 INT8)
    steps: int     # KS: 32-k steps per block
    warps: int     # W: warps per CTA, each a contiguous share of the block's chunks
    splits: int    # CTAs per block along K (> 1 only when blocks x 16 warps cannot fill the GPU)
    prefetch: int  # L2 prefetch distance in chunks
    smem: int      # dynamic shared memory: the cross-warp reduction rows
    order: int = 0  # which chunks each warp takes, in what order (ChunkOrder)
    nbc: int = 1    # blocks per CTA whose warps read the same chunks of x (x from L2 once per group, not per block)

    @property
    def grid(self) -> int:
        return self.blocks // self.nbc * self.splits


def _packing_warps(per_block: int, per_sm: int) -> int:
    """Warps per CTA for a one-wave grid that wants ``per_block`` warps per block: below ``per_sm`` (the warps an
    SM holds), the count in [per_block / 2, per_block] whose whole CTAs hold the most warps per SM, the larger on
    ties (a divisor of per_sm where one is in range: 9-warp CTAs, one per SM under a 16-warp limit, ran 14336x8192
    INT4 in two waves: 32.0 us against 23.9 with 8 warps, H200, bf16, M = 1)."""
    if per_block >= per_sm:
        return per_block
    return max(range((per_block + 1) // 2, per_block + 1), key=lambda w: ((per_sm // w) * w, w))


@lru_cache(maxsize=8192)
def stream_config(m: int, n: int, k: int, kind: int, sms: int, warps: int = 0, splits: int = 0,
                  prefetch: int = -1, order: int = -1, nbc: int = 0) -> StreamConfig:
    """Launch shape of gemv_stream_kernel (a pure function of the problem and the SM count; the keyword
    arguments override the heuristic, for measurements).

    One wave of equal warps: about stream_max_warps() warps per SM in all, each block's K shared by
    W <= stream_max_warps() warps of one CTA (the reduction stays in shared memory) and, only where N is too
    small for that to fill the GPU, by several CTAs (fp32 partials).  Every warp gets at least one 128-k chunk.
    ``nbc``: blocks per CTA, ``warps / nbc`` warps each, the warps of the nbc blocks reading the same x chunks
    together.  By default 1, but for INT4 at M > 8 where the one-wave warps per block leave room in the CTA without
    splitting K (nbc = stream_max_warps / warps): 28672 x 8192 M = 16, 448 blocks of 3 warps -> 112 CTAs of 4 blocks
    (H200, bf16, against the one-block kernel in the same process: 60.6 -> 60.1 us with nbc a template parameter;
    61.7 -> 58.4 when it was a runtime argument, which however slowed the one-block launches by up to 5%).  Where
    sharing needed split-K it lost (8192^2 M = 16 23.0 -> 29.5, 8192 x 28672 52.3 -> 58.6), and INT8 gained nothing
    (28672 x 8192 M = 16 81.5 -> 88.0)."""
    mt = 1 if m <= 8 else 2
    nb, ks = n // gemv_block_n(kind), k // GEMV_STEP_K
    kc = ks // 4
    wmax = stream_max_warps(kind, mt)
    per_block = max(1, min(kc, (wmax * sms) // nb))
    if kind == KIND_INT8:
        # INT8 on wide layers (many 32-channel blocks): a deeper stream per block beats one exact wave (H200, bf16,
        # 28672x8192, medians of 7 interleaved rounds: M = 1 2 -> 8 warps 67.6 -> 64.4 us, M = 16 2 -> 4 warps
        # 90.7 -> 79.8 us; 8192x8192 unchanged at 8).
        per_block = max(per_block, min(kc, STREAM_INT8_MIN_WARPS[mt - 1]))
    w = min(warps or _packing_warps(per_block, wmax), wmax)
    if not nbc:
        nbc = wmax // w if (kind == KIND_INT4 and mt == 2 and not warps and wmax % w == 0 and nb % (wmax // w) == 0
                            and per_block == w) else 1
        w *= nbc
    if nbc not in STREAM_NBC_CHOICES or nb % nbc or w % nbc or (nbc > 1 and mt == 1):
        raise ValueError(f"stream_config: nbc must be one of {STREAM_NBC_CHOICES}, divide the {nb} blocks and the {w} "
                         f"warps per CTA, and be 1 at M <= 8 (one block per CTA there), got nbc = {nbc} at M = {m}")
    sp = splits or max(1, min(per_block // (w // nbc), kc // (w // nbc)))
    if not splits and sp > 1 and kind == KIND_INT4 and mt == 2 and nbc == 1:
        # At M > 8 a split's fp32 partials, ticket and final pass cost about STREAM_SPLIT_COST_CHUNKS chunk loads of
        # latency, so it must save more than that per warp (H200, same run, AWQ bf16, us, 1 / 2 splits: 4096^2
        # M = 16 14.2 / 16.2, M = 12 13.6 / 14.9; 2048 x 4096 M = 16 13.9 / 14.5; 4096 x 14336 29.4 / 24.4).
        per_warp = lambda s: -(-kc // ((w // nbc) * s))  # noqa: E731
        if per_warp(1) <= per_warp(sp) + STREAM_SPLIT_COST_CHUNKS:
            sp = 1
    pf = STREAM_PREFETCH if prefetch < 0 else prefetch
    smem = w * max(m, 1) * (gemv_block_n(kind) + 4) * 4
    if order < 0:
        # INT4 at M > 8: rotated runs (H200: 8192x28672 52.5 vs 57.4 us, the other shapes within 1%); else the
        # contiguous runs in order.
        order = 2 if (kind == KIND_INT4 and mt == 2) else 0
    return StreamConfig(mt, nb, ks, w, sp, pf, smem, order, nbc)


@dataclass(frozen=True)
class BulkConfig:
    mt: int        # 8-row mma tiles of x (M <= 8: 1, M <= 16: 2)
    blocks: int    # NB: channel blocks (64 INT4, 32 INT8)
    steps: int     # KS: 32-k steps per block
    warps: int     # W: warps per CTA, each a contiguous share of the block's chunks
    splits: int    # CTAs per block along K
    stages: int    # S: ring stages per warp (S - 1 chunks in flight)
    smem: int      # dynamic shared memory per CTA
    order: int = 0  # which chunks each warp takes, in what order (ChunkOrder)

    @property
    def grid(self) -> int:
        return self.blocks * self.splits


def bulk_stage_bytes(kind: int, m: int) -> int:
    """One ring stage of gemv_bulk_kernel: 4 KB of weights, the INT4 group record, M rows of x."""
    return 4096 + (GEMV_GROUP_BYTES if kind == KIND_INT4 else 0) + m * BULK_X_PITCH


def bulk_smem_bytes(kind: int, m: int, warps: int, stages: int) -> int:
    """Dynamic shared memory of gemv_bulk_kernel: mbarriers (128-byte aligned), then the rings (which the
    reduction rows, warps * M * (BN + 4) floats, reuse)."""
    bars = (warps * stages * 8 + 127) // 128 * 128
    red = warps * m * (gemv_block_n(kind) + 4) * 4
    return bars + max(warps * stages * bulk_stage_bytes(kind, m), red)


@lru_cache(maxsize=8192)
def bulk_config(m: int, n: int, k: int, kind: int, sms: int, warps: int = 0, splits: int = 0,
                stages: int = 0, order: int = -1) -> BulkConfig:
    """Launch shape of gemv_bulk_kernel (a pure function of the problem and the SM count; the keyword arguments
    override the heuristic, for measurements).

    S = 2 stages per warp (one chunk in flight while the other is read: deeper rings, 3-6, were slower on the
    H200) and the interleaved chunk order (the CTA's warps sweep their block side by side); as many warps per
    SM as their rings fit in shared memory (<= 16), in one wave: each block's K is shared by the W warps of one
    CTA, and by several CTAs only where N is too small to fill the GPU otherwise.  Every warp gets at least one
    128-k chunk."""
    mt = 1 if m <= 8 else 2
    nb, ks = n // gemv_block_n(kind), k // GEMV_STEP_K
    kc = ks // 4
    s = stages or 2
    warp_bytes = s * bulk_stage_bytes(kind, m) + 8 * s
    per_sm = max(1, min(BULK_MAX_WARPS, (BULK_SMEM_PER_CTA - 128) // warp_bytes))
    per_block = max(1, min(kc, (per_sm * sms) // nb))
    w = min(warps or _packing_warps(per_block, per_sm), per_sm)
    sp = splits or max(1, min(per_block // w, kc // w))
    return BulkConfig(mt, nb, ks, w, sp, s, bulk_smem_bytes(kind, m, w, s), 1 if order < 0 else order)


def marlin_stages(mt: int) -> int:
    """cp.async ring depth of quant_marlin_kernel<T, mt> (Marlin<MT>::STAGES): 6 for mt 4 (M <= 32, bound by the
    weight stream), 4 for mt 8 (bound by the mma rate; within sm_80's 163 KB)."""
    return 6 if mt <= 4 else 4


def marlin_smem_bytes(mt: int) -> int:
    """Dynamic shared memory of quant_marlin_kernel<T, mt>: marlin_stages(mt) ring stages, each the weights of the
    CTA's blocks for one 128-k chunk (4 KB each), their group records (192 bytes each) and 8 mt rows of x."""
    return marlin_stages(mt) * (MARLIN_BLOCKS * (4096 + GEMV_GROUP_BYTES) + 8 * mt * MARLIN_X_PITCH)


def marlin_supported(k: int, n: int, group: int) -> bool:
    """Shapes quant_marlin_kernel covers: those of gemv_stream_kernel for INT4 (N % 64 == 0, K % 128 == 0,
    G % 128 == 0; a chunk never straddles a group)."""
    return stream_supported(KIND_INT4, k, n, group)


@dataclass(frozen=True)
class MarlinConfig:
    mt: int        # 8-row x tiles per m chunk (M <= 32: 4, else 8)
    m_chunks: int  # chunks of 8 mt rows of x (each re-reads its weights, from L2 when they run together)
    n_tiles: int   # 256-channel tiles (the last may hold fewer blocks)
    ctas: int      # P: the grid; CTA c takes work units [c U / P, (c + 1) U / P) of U = n_tiles m_chunks KC
    smem: int      # dynamic shared memory per CTA

    @property
    def grid(self) -> int:
        return self.ctas


def marlin_ranges(units: int, ctas: int) -> list:
    """The stream-K ranges of quant_marlin_kernel (mirrors marlin_unit_begin): CTA c takes [c U / P, (c + 1) U / P)."""
    return [(c * units // ctas, (c + 1) * units // ctas) for c in range(ctas)]


def marlin_segments(lo: int, hi: int, kc: int) -> list:
    """The segments (tile-and-m-chunk index, first chunk, chunk count) of a range of units, as the kernel walks it."""
    out = []
    u = lo
    while u < hi:
        tm, c0 = divmod(u, kc)
        n = min(hi, (tm + 1) * kc) - u
        out.append((tm, c0, n))
        u += n
    return out


def _marlin_cost(tms: int, kc: int, p: int, slots: int, rows: int) -> float:
    """Time of P CTAs in units of one chunk (16 KB of weights per CTA): the longest CTA (its chunks plus one ring
    refill per extra segment) times the waves, plus the fp32 partial slots (written, then read by the tiles' last
    CTAs: counted at half the weight bytes' weight, in chunk units over all slots).  Segment counts in closed
    form (vectorized over the CTAs; marlin_segments walks them one by one)."""
    c = np.arange(p, dtype=np.int64)
    lo, hi = c * (tms * kc) // p, (c + 1) * (tms * kc) // p
    nonempty = hi > lo
    segs = np.where(nonempty, (np.maximum(hi, 1) - 1) // kc - lo // kc + 1, 0)
    full = np.maximum(0, hi // kc - (lo + kc - 1) // kc)
    worst = float(np.max(hi - lo + np.maximum(segs - 1, 0)))
    partial = int(np.sum(segs - full))
    waves = -(-p // slots)
    partial_bytes = partial * rows * MARLIN_BLOCKS * 64 * 4 * 2
    return waves * (worst + 1) + 0.5 * partial_bytes / (MARLIN_BLOCKS * 4096 * slots)


@lru_cache(maxsize=8192)
def marlin_config(m: int, n: int, k: int, sms: int, ctas: int = 0) -> MarlinConfig:
    """Launch shape of quant_marlin_kernel (a pure function of the problem and the SM count; ``ctas`` overrides
    the grid, for measurements).

    The grid P is the cheapest (by _marlin_cost) of the split-K shapes tiles x s (s = 1..min(KC, 64), aligned
    to tiles when s divides KC) and of one full wave of stream-K (P = SMs), e.g. M = 64: 8192^2 -> 32 tiles x 4
    splits (128 CTAs), 28672x8192 -> 132 CTAs of 54-55 chunks each (against 112 tiles of 64).  One CTA per SM (its
    launch bounds).  Not tuned on a GPU yet."""
    if m <= 0 or n <= 0 or k <= 0:
        raise ValueError(f"marlin_config: m, n, k must be positive, got {m}, {n}, {k}")
    mt = 4 if m <= 32 else 8
    m_chunks = -(-m // (8 * mt))
    n_tiles = -(-(n // 64) // MARLIN_BLOCKS)
    kc = k // STREAM_CHUNK_K
    units = n_tiles * m_chunks * kc
    rows = min(m, 8 * mt)
    if ctas:
        p = max(1, min(ctas, units))
    else:
        tms = n_tiles * m_chunks
        cands = sorted({tms * s for s in range(1, min(kc, 64) + 1)} | {min(sms, units)})
        p = min(cands, key=lambda c: (_marlin_cost(tms, kc, c, sms, rows), c))
    return MarlinConfig(mt, m_chunks, n_tiles, p, marlin_smem_bytes(mt))


def marlin_workspace_floats(cfg: MarlinConfig) -> int:
    """fp32 partial slots of quant_marlin_kernel: two per CTA (its range's first and last segment), 8 mt x 256."""
    return 2 * cfg.ctas * 8 * cfg.mt * MARLIN_BLOCKS * 64


def w4wgmma_gs4_built(blk: int, mt: int, ks: int) -> bool:
    """Whether INT4 w4_wgmma_kernel is built with wgmma groups of 4 k16 steps for this tile shape (W4WGMMA_NO_GS4)."""
    return (blk, mt) not in W4WGMMA_NO_GS4 and not (blk == 1 and ks == 1)


def w4wgmma_stage_bytes(mt: int, blk: int = W4WGMMA_BLK, ks: int = 1, kind: int = KIND_INT4) -> int:
    """One ring stage of w4_wgmma_kernel: ks chunks of 64 k, each an x tile (mt rows x 128 bytes) and 2 blk blocks of
    weights (2 KB each of INT4, 4 KB of INT8), and (INT4) one group record per block (192 bytes)."""
    if kind == KIND_INT8:
        return ks * (mt * 128 + 2 * blk * W8WGMMA_BLOCK_BYTES)
    return ks * (mt * 128 + 2 * blk * W4WGMMA_BLOCK_BYTES) + 2 * blk * GEMV_GROUP_BYTES


def w4wgmma_stages(mt: int, blk: int = W4WGMMA_BLK, ks: int = 1, kind: int = KIND_INT4, splits: int = 1) -> int:
    """Ring depth: as many stages as fit in 227 KB (1 KB of it for the 1024-byte alignment), at most 8.  For a
    launch split over two ranks, as many as leave room for the receive buffer (w4wgmma_rx_bytes), where that keeps
    at least W4WGMMA_PUSH_MIN_STAGES (H200, AWQ bf16, same process: 4096^2 M = 512 in 256-row tiles 30.0 us with 6
    stages and the exchange through ring slots, 29.5 with 4 and the receive buffer; 8192^2 M = 256 49.6 / 49.2)."""
    budget = W4WGMMA_SMEM_LIMIT - 1024 - 16
    full = min(W4WGMMA_MAX_STAGES, budget // (w4wgmma_stage_bytes(mt, blk, ks, kind) + 16))
    if splits == 2:
        for stages in range(full, W4WGMMA_PUSH_MIN_STAGES - 1, -1):
            if w4wgmma_rx_bytes(mt, blk, stages, ks, kind):
                return stages
    return full


def w4wgmma_smem_bytes(mt: int, blk: int = W4WGMMA_BLK, stages: int = 0, ks: int = 1, kind: int = KIND_INT4) -> int:
    """Dynamic shared memory of w4_wgmma_kernel: alignment slack, the ring, 2 mbarriers per stage, the tile's
    coordinates (16 bytes), and where it fits the two-rank split-K receive buffer (w4wgmma_rx_bytes)."""
    stages = stages or w4wgmma_stages(mt, blk, ks, kind)
    return 1024 + stages * (w4wgmma_stage_bytes(mt, blk, ks, kind) + 16) + 16 + w4wgmma_rx_bytes(mt, blk, stages, ks,
                                                                                                  kind)


def w4wgmma_rx_bytes(mt: int, blk: int, stages: int, ks: int = 1, kind: int = KIND_INT4) -> int:
    """Shared memory of w4_wgmma_kernel's two-rank split-K receive buffer (kernels/quant_sm90.cu W4Rx): its mbarrier
    (16 bytes) and the half of the tile a rank owns, packed at W4WGMMA_SPLIT_PACK bits per partial; 0 where it does
    not fit past the ring (those variants hand the partials over through ring slots and a cluster barrier)."""
    body = (mt // 32) * blk * 256 * W4WGMMA_SPLIT_PACK
    ring_end = stages * (w4wgmma_stage_bytes(mt, blk, ks, kind) + 16) + 16
    return 16 + body if 1024 + ring_end + 16 + body <= W4WGMMA_SMEM_LIMIT else 0


def w4wgmma_supported(k: int, n: int, group: int) -> bool:
    """Shapes w4_wgmma_kernel covers: N % 256 == 0 (whole CTA tiles of the default blk = 2, hence of blk = 1 too),
    and the fragment-major layout's streaming shapes for the group records (K % 128 == 0, G % 128 == 0,
    K % G == 0)."""
    return n % (128 * W4WGMMA_BLK) == 0 and stream_supported(KIND_INT4, k, n, group) and k % group == 0


@dataclass(frozen=True)
class W4WgmmaConfig:
    mt: int       # rows of x per tile (wgmma N)
    blk: int      # 64-channel blocks per consumer warpgroup
    m_tiles: int
    n_tiles: int  # 128 blk-channel tiles
    splits: int   # CTAs per tile along K: one cluster, summing its fp32 partials through distributed shared memory
    stages: int
    smem: int
    gs: int = 1       # k16 steps per wgmma group (W4WGMMA_GROUP_STEPS)
    ks: int = 1       # 64-k chunks per ring stage (W4WGMMA_STAGE_CHUNKS); splits count stages
    kind: int = 0     # KIND_INT4, or KIND_INT8 (per-channel scales, no group records)
    m_group: int = 0  # m tiles per group of the tile order (tile_coords; 0: all of them)
    tail_tiles: int = 0   # the last tiles (in tile order), launched apart with tail_splits CTAs each (the tail launch)
    tail_splits: int = 1

    @property
    def tail_base(self) -> int:
        """The tail launch's first tile (tile order); the first launch takes the tiles before it."""
        return self.m_tiles * self.n_tiles - self.tail_tiles

    @property
    def grid(self) -> int:
        """CTAs of the first launch: every tile but the tail's, ``splits`` CTAs each."""
        return self.tail_base * self.splits

    @property
    def tail_grid(self) -> int:
        """CTAs of the tail launch (0: none)."""
        return self.tail_tiles * self.tail_splits


# Per-CTA time of one 64-k stage of w4_wgmma_kernel by (blk, mt) (H200, us): the traces' steady-state steps and
# the M sweep of benchmarks/_quant_w4_msweep.py at b482bb8 (three producer warps), where the consumers' wgmma
# stream and dequantization set the pace.  Relative values are what matter: they pick the launch shape.
W4WGMMA_STEP_US = {(1, 64): 0.285, (2, 64): 0.50, (1, 96): 0.36, (1, 128): 0.43, (2, 128): 0.75, (1, 160): 0.475,
                   (1, 192): 0.52, (1, 256): 0.64}
# The shapes the heuristic chooses among, (blk, mt, gs, ks): 64-row tiles in 128-k stages of one wgmma group, the
# others in groups of 2 k16 steps (1 at blk = 2, where two A sets of 2 would crowd the 64-row accumulators).
W4WGMMA_CANDIDATES = ((1, 64, 4, 2), (2, 64, 4, 2), (1, 96, 2, 1), (1, 128, 2, 1), (2, 128, 1, 1), (1, 160, 2, 1),
                      (1, 192, 2, 1), (1, 256, 2, 1))
W4WGMMA_CTA_US = 3.0  # launch, the first stage's latency and the pipeline's drain, per wave
# What a tail launch costs beyond its CTAs' own time, the first launch's end included (H200, 256- and 160-row tiles:
# 3.8-9 us; they start as the first launch's CTAs finish, unevenly, and clusters need two free SMs of one GPC).
W4WGMMA_TAIL_GAP_US = 6.0
# A tail launch only where it is estimated this much faster: its measured gains below ~3% were within the noise
# (28672 x 8192 M = 4096: +1.0% in one run, -1.9% in another; M = 8192: -3.6%, estimated +1.0%).
W4WGMMA_TAIL_MIN_GAIN = 0.03


def _w4wgmma_time(m: int, n: int, k: int, sms: int, blk: int, mt: int, splits: int) -> float:
    """Estimated time (us) of w4_wgmma_kernel on an (M, N, K) layer with tiles of mt rows x 128 blk channels and
    `splits` CTAs per tile (_w4wgmma_tiles_time of its tiles)."""
    return _w4wgmma_tiles_time(-(-m // mt) * (n // (128 * blk)), k, sms, blk, mt, splits)


def _w4wgmma_tiles_time(tiles: int, k: int, sms: int, blk: int, mt: int, splits: int) -> float:
    """Estimated time (us) of one launch of w4_wgmma_kernel over `tiles` tiles of mt rows x 128 blk channels,
    `splits` CTAs per tile: waves x (fixed cost + K / 64 / splits stages x W4WGMMA_STEP_US + the epilogue).  The
    epilogue writes the mt x 128 blk tile (fp32 accumulators: ~64 KB / us through shared memory); with a split the
    cluster's CTAs first hand each other (splits - 1) / splits of them (~32 KB / us of distributed shared memory,
    fitted when 40 KB went in 1.5-1.7 us at 4096^2 M = 320, H200) and each sums its share.  Two ranks now hand over
    24-bit partials by pushes, ~0.8 us faster there (benchmarks/results/h200-ab-2026-11-30.md, session 16); an
    estimate recalibrated to that moved 4 of 77 launch picks on the H200 and lost 0.6% on them, so it stays.  (A
    split grid is one wave: _w4wgmma_splits admits no other.)"""
    waves = -(-tiles * splits // sms)
    acc_kb = mt * 128 * blk * 4 / 1024
    if splits == 1:
        epi = 0.5 + acc_kb / 64
    else:  # + the cluster barriers' skew, growing with the cluster (4096^2 M = 17: 6 splits of 256 channels 18.6 us,
        # 3 of 128 channels 15.5)
        epi = 2.0 + 0.5 * (splits - 2) + acc_kb * (splits - 1) / splits / 32 + acc_kb / splits / 64
    return waves * (W4WGMMA_CTA_US + k / 64 / splits * W4WGMMA_STEP_US[(blk, mt)] + epi)


def _w4wgmma_splits(m: int, n: int, k: int, sms: int, blk: int, mt: int, ks: int, cluster_ctas: tuple = (),
                    tiles: int = 0) -> list:
    """Split counts w4_wgmma_kernel can take for a tile shape: 1, and 2..8 (one cluster per tile) while every CTA
    keeps at least 4 ring stages and the whole grid is resident at once (``cluster_ctas[s - 1]``, where given, is
    how many CTAs clusters of s keep resident; splitting into a second wave only adds one: 28672 x 8192 M = 17 took
    91.4 us in 784 CTAs against 74.7 in 112, H200).  ``tiles``: a launch of that many tiles (a tail launch) instead
    of the layer's."""
    tiles = tiles or -(-m // mt) * (n // (128 * blk))
    kb = max(1, k // (W4WGMMA_BK * ks))
    out = [1]
    for c in range(2, min(W4WGMMA_MAX_SPLITS, kb // 4) + 1):
        if tiles * c <= min(sms, cluster_ctas[c - 1] if cluster_ctas else sms):
            out.append(c)
    return out


def _w4wgmma_best_split(m: int, n: int, k: int, sms: int, blk: int, mt: int, ks: int, kind: int,
                        cluster_ctas: tuple = ()):
    """(estimated us, split count) of least _w4wgmma_time for one tile shape, among the _w4wgmma_splits whose
    epilogue fits the ring (w4wgmma_epilogue_bytes); None where none does."""
    return min(((round(_w4wgmma_time(m, n, k, sms, blk, mt, c), 3), c)
                for c in _w4wgmma_splits(m, n, k, sms, blk, mt, ks, cluster_ctas)
                if _w4wgmma_epilogue_fits(mt, blk, ks, kind, c, w4wgmma_stages(mt, blk, ks, kind, c))), default=None)


def _w4wgmma_epilogue_fits(mt: int, blk: int, ks: int, kind: int, splits: int, stages: int) -> bool:
    """Whether the epilogue of a launch split `splits` ways fits a ring of `stages` stages (w4wgmma_epilogue_bytes;
    a two-rank split with a receive buffer keeps only the y tile in the ring)."""
    push = splits == 2 and w4wgmma_rx_bytes(mt, blk, stages, ks, kind) > 0
    return w4wgmma_epilogue_bytes(mt, blk, splits, push) <= stages * w4wgmma_stage_bytes(mt, blk, ks, kind)


def _w4wgmma_tail(m: int, n: int, k: int, sms: int, blk: int, mt: int, ks: int, kind: int, cluster_ctas: tuple = (),
                  tail_tiles: int = 0):
    """(estimated us, tail tiles, tail splits) of the best tail launch for one tile shape, or None.  A grid of
    several waves whose last wave is partly empty runs its whole waves unsplit, then the remaining tiles (or the
    last ``tail_tiles``, where given) split-K in a second launch that fills the SMs again: the last wave then
    takes 1/s of a wave's stages plus the split epilogue and W4WGMMA_TAIL_GAP_US (the second launch is a
    programmatic dependent launch: its CTAs start as the first launch's finish).  Measured on the H200 (us, the
    same tile shape without the tail, same process): 28672 x 8192 M = 320 217.0 (238.5), M = 512 309.9 (342.2),
    M = 1536 952.0 (960.9)."""
    tiles = -(-m // mt) * (n // (128 * blk))
    tail = tail_tiles or (tiles % sms if tiles > sms else 0)
    if not 0 < tail < tiles:
        return None
    stages = w4wgmma_stages(mt, blk, ks, kind)  # the first launch's kernel, unsplit
    head = _w4wgmma_tiles_time(tiles - tail, k, sms, blk, mt, 1) + W4WGMMA_TAIL_GAP_US - W4WGMMA_CTA_US
    return min(((round(head + _w4wgmma_tiles_time(tail, k, sms, blk, mt, c), 3), tail, c)
                for c in _w4wgmma_splits(m, n, k, sms, blk, mt, ks, cluster_ctas, tiles=tail)
                if c > 1 and _w4wgmma_epilogue_fits(mt, blk, ks, kind, c, stages)), default=None)


def _w4wgmma_pick(m: int, n: int, k: int, sms: int, blk: int, mt: int, ks: int, kind: int, cluster_ctas: tuple = (),
                  tail: bool = True):
    """(estimated us, splits, tail tiles, tail splits) for one tile shape: _w4wgmma_best_split's launch, or (with
    ``tail``) the _w4wgmma_tail launch where it is estimated W4WGMMA_TAIL_MIN_GAIN faster; None where no split
    count's epilogue fits the ring."""
    one = _w4wgmma_best_split(m, n, k, sms, blk, mt, ks, kind, cluster_ctas)
    tail = _w4wgmma_tail(m, n, k, sms, blk, mt, ks, kind, cluster_ctas) if tail else None
    if tail is not None and (one is None or tail[0] < one[0] * (1 - W4WGMMA_TAIL_MIN_GAIN)):
        return (tail[0], 1, tail[1], tail[2])
    return None if one is None else one + (0, 1)


@lru_cache(maxsize=8192)
def w4wgmma_shape(m: int, n: int, k: int, sms: int, cluster_ctas: tuple = (), kind: int = KIND_INT4) -> tuple:
    """The default (blk, mt, gs, ks) of w4_wgmma_kernel for an (M, N, K) layer (pure): the W4WGMMA_CANDIDATES shape
    (INT8: those built, W8WGMMA_VARIANTS) and split count of least _w4wgmma_time.  Tiles of 192 and 256 rows keep
    the rows past M few (8192^2 M = 192: 42.1 us at 192 rows against 57.3 at 128, H200) and count waves (M = 768:
    four 192-row tiles x 64 in 138.7 us, three 256-row ones in 172.6); 64-row tiles below M = 64, 256 channels only
    where their tiles alone nearly fill the GPU (28672 x 8192 M = 64: 64.5 us against 73.5 with 128 channels;
    8192 x 28672: 64.7 with 128 channels x 2 splits against 75.5).  Shapes are ranked without a tail launch: one
    taller tile shape that the tail estimate preferred lost to the 192-row tiles in whole waves (8192^2 M = 768:
    141.0 us with 256 rows and a tail against 137.4; 4096^2 M = 1536: 78.7 against 73.6)."""
    best = None
    for blk, mt, gs, ks in W4WGMMA_CANDIDATES:
        if n % (128 * blk) or k % (W4WGMMA_BK * ks):
            continue
        if kind == KIND_INT8 and (blk, mt, gs, ks) not in W8WGMMA_VARIANTS:
            continue
        pick = _w4wgmma_best_split(m, n, k, sms, blk, mt, ks, kind, cluster_ctas)
        if pick is not None and (best is None or pick + (-mt,) < best[0]):
            best = (pick + (-mt,), (blk, mt, gs, ks))
    if best is None:
        raise ValueError(f"w4wgmma_shape: no w4_wgmma_kernel shape takes N = {n}, K = {k}")
    return best[1]


@lru_cache(maxsize=8192)
def w4wgmma_config(m: int, n: int, k: int, sms: int, splits: int = 0, mt: int = 0, blk: int = 0,
                   gs: int = 0, ks: int = 0, kind: int = KIND_INT4, cluster_ctas: tuple = (),
                   m_group: int = 0, tail_tiles: int = 0, tail_splits: int = 0) -> W4WgmmaConfig:
    """Launch shape of w4_wgmma_kernel (a pure function of the problem and the SM count).  Tile shape (blk, mt, gs,
    ks) from w4wgmma_shape unless one of ``blk`` / ``mt`` / ``gs`` is given (for measurements: then the others
    default to blk = 2, mt = 64 for M <= 64 else 128, gs = 1; blk in W4WGMMA_SHAPES, mt in W4WGMMA_SHAPES[blk], gs
    in W4WGMMA_GROUP_STEPS); ``ks`` the 64-k chunks per ring stage (1, or 2 at mt = 64).  ``splits`` overrides the K
    split (a cluster of s CTAs per tile, 1..8); else _w4wgmma_best_split's: least _w4wgmma_time among the
    _w4wgmma_splits whose epilogue fits the ring (``cluster_ctas[s - 1]``, where given, is how many CTAs clusters
    of s keep resident: 120 for 4 on the H200).  (A stream-K variant, a persistent grid splitting the tiles x K
    stages evenly, measured slower than these split-K grids in every swept case and was removed.)  Multi-wave grids
    take the tiles in groups of m_group m tiles (tile_coords in kernels/quant_sm90.cu): w4wgmma_m_group's unless
    ``m_group`` is given.  Where _w4wgmma_pick estimates it faster, the tiles past the last whole wave are a tail
    launch of their own, split-K (_w4wgmma_tail); ``tail_splits`` = 1 turns it off, ``tail_splits`` >= 2 or
    ``tail_tiles`` > 0 force one (the last ``tail_tiles`` tiles, default those past the last whole wave, in
    ``tail_splits`` CTAs each, default the estimate's) after an unsplit first launch."""
    if m <= 0 or n <= 0 or k <= 0:
        raise ValueError(f"w4wgmma_config: m, n, k must be positive, got {m}, {n}, {k}")
    if not (blk or mt or gs):
        blk, mt, gs, ks_default = w4wgmma_shape(m, n, k, sms, cluster_ctas, kind)
        ks = ks or ks_default
    gs = gs or W4WGMMA_GROUP_STEPS[0]
    if gs not in W4WGMMA_GROUP_STEPS:
        raise ValueError(f"w4wgmma_config: gs must be one of {W4WGMMA_GROUP_STEPS}, got {gs}")
    blk = blk or W4WGMMA_BLK
    if blk not in W4WGMMA_SHAPES:
        raise ValueError(f"w4wgmma_config: blk must be one of {tuple(W4WGMMA_SHAPES)}, got {blk}")
    mt = mt or (64 if m <= 64 else 128)
    if mt not in W4WGMMA_SHAPES[blk]:
        raise ValueError(f"w4wgmma_config: mt must be one of {W4WGMMA_SHAPES[blk]} with blk = {blk}, got {mt}")
    ks = ks or W4WGMMA_STAGE_CHUNKS[0]
    if gs == 4 and kind == KIND_INT4 and not w4wgmma_gs4_built(blk, mt, ks):
        raise ValueError(f"w4wgmma_config: gs = 4 is not built for blk = {blk}, mt = {mt}, ks = {ks} (at blk = 1 "
                         f"only with ks = 2)")
    if n % (128 * blk):
        raise ValueError(f"w4wgmma_config: blk = {blk} needs N % {128 * blk} == 0, got N = {n}")
    if ks != 1 and (mt != 64 or gs == 2):
        raise ValueError(f"w4wgmma_config: ks = {ks} is built for mt = 64 with gs 1 or 4 only")
    if ks not in W4WGMMA_STAGE_CHUNKS or k % (W4WGMMA_BK * ks):
        raise ValueError(f"w4wgmma_config: ks must be one of {W4WGMMA_STAGE_CHUNKS} with K % (64 ks) == 0, got "
                         f"ks = {ks}, K = {k}")
    m_tiles = -(-m // mt)
    n_tiles = -(-n // (128 * blk))
    kb = max(1, k // (W4WGMMA_BK * ks))  # ring stages along K
    tiles = m_tiles * n_tiles
    tt, ts = 0, 1  # the tail launch: tiles, splits
    for name, v in (("splits", splits), ("tail_splits", tail_splits)):
        if min(v, kb) > W4WGMMA_MAX_SPLITS:
            raise ValueError(f"w4wgmma_config: at most {W4WGMMA_MAX_SPLITS} {name} (one cluster per tile), got {v}")
    if splits:
        s = max(1, min(splits, kb))
    if tail_splits > 1 or tail_tiles > 0:
        if splits and s != 1:
            raise ValueError(f"w4wgmma_config: a tail launch follows an unsplit first launch, got splits = {splits}")
        s = 1
        tt = tail_tiles or (tiles % sms if tiles > sms else 0)
        if not 0 < tt < tiles:
            raise ValueError(f"w4wgmma_config: tail_tiles must be 1 to {tiles - 1} (the grid has {tiles} tiles), got "
                             f"{tt}")
        if tail_splits > 1:
            ts = min(tail_splits, kb)
        else:
            pick = _w4wgmma_tail(m, n, k, sms, blk, mt, ks, kind, cluster_ctas, tail_tiles=tt)
            ts = pick[2] if pick is not None else 1
    elif not splits:
        pick = _w4wgmma_pick(m, n, k, sms, blk, mt, ks, kind, cluster_ctas, tail=tail_splits != 1)
        s, tt, ts = pick[1:] if pick is not None else (1, 0, 1)  # (none fits: the check below says so)
    if kind == KIND_INT8 and (blk, mt, gs, ks) not in W8WGMMA_VARIANTS:
        raise ValueError(f"w4wgmma_config: INT8 is built for (blk, mt, gs, ks) in {sorted(W8WGMMA_VARIANTS)}, got "
                         f"{(blk, mt, gs, ks)}")
    stages = w4wgmma_stages(mt, blk, ks, kind, s)
    for c in (s, ts):
        if not _w4wgmma_epilogue_fits(mt, blk, ks, kind, c, stages):
            raise ValueError(f"w4wgmma_config: the epilogue of {c} splits does not fit the ring of mt = {mt}, "
                             f"blk = {blk}")
    return W4WgmmaConfig(mt, blk, m_tiles, n_tiles, s, stages, w4wgmma_smem_bytes(mt, blk, stages, ks, kind), gs, ks,
                         kind, min(m_group, m_tiles) or w4wgmma_m_group(m_tiles, n_tiles, s, sms, mt, blk, kind),
                         tt, ts if tt else 1)


def w4wgmma_m_group(m_tiles: int, n_tiles: int, splits: int, sms: int, mt: int, blk: int, kind: int = KIND_INT4) -> int:
    """m tiles per group of w4_wgmma_kernel's tile order (tile_coords): all of them (m fastest: the CTAs running
    together share weights) unless the grid takes several waves; then about sqrt(tiles per wave x weight tile /
    x tile) m tiles, so that a wave reads few x rows and few weight tiles (e.g. 256-row tiles of 128 channels: 4 m
    tiles x 33 channel tiles per wave of 132)."""
    if m_tiles * n_tiles * splits <= sms or m_tiles == 1:
        return m_tiles
    w_bytes = 128 * blk * (1 if kind == KIND_INT8 else 0.5)  # per k
    g = round((sms / splits * w_bytes / (mt * 2)) ** 0.5)
    return max(1, min(m_tiles, g))


def w4wgmma_epilogue_bytes(mt: int, blk: int, splits: int, push: bool = False) -> int:
    """Shared memory of w4_wgmma_kernel's epilogue, inside the ring: with a split through ring slots, room for every
    row group (8 rows; J = mt / 8) of the CTA's fp32 accumulators (J x blk blocks x 256 threads x 16 bytes), which
    the cluster's other CTAs read; then the y tile of the rows the CTA owns, 8 jmax rows x 128 blk channels of 2-byte
    values (jmax = w4wgmma_rows_per_rank).  ``push``: a two-rank split into the receive buffer past the ring
    (w4wgmma_rx_bytes), so the y tile alone."""
    jmax = w4wgmma_rows_per_rank(mt // 8, splits)
    return (mt // 8 * blk * 256 * 16 if splits > 1 and not push else 0) + 8 * jmax * 128 * blk * 2


def w4wgmma_rows_per_rank(row_groups: int, splits: int) -> int:
    """Row groups of a tile that each CTA of a split-K cluster sums and stores (w4_rows_per_rank in
    kernels/quant_sm90.cu): an even count, two row groups per stmatrix."""
    return 2 * -(-row_groups // (2 * splits))


def w4wgmma_work(cfg: W4WgmmaConfig, k: int) -> list:
    """The work of each CTA of w4_wgmma_kernel, as Python (mirrors the kernel's blockIdx decomposition; for tests):
    a list over CTAs (the first launch's, then the tail launch's) of (m tile, split, n tile, first 64-channel
    block, first 64-k chunk, chunk end, the tile's split count): splits are whole ring stages of cfg.ks chunks."""
    kb = k // (W4WGMMA_BK * cfg.ks)
    out = []
    for grid, splits, tile_base in ((cfg.grid, cfg.splits, 0), (cfg.tail_grid, cfg.tail_splits, cfg.tail_base)):
        for cta in range(grid):
            split, t = cta % splits, tile_base + cta // splits
            gm_full = cfg.m_group or cfg.m_tiles
            grp, r = divmod(t, gm_full * cfg.n_tiles)
            gm = min(gm_full, cfg.m_tiles - grp * gm_full)
            m_tile, n_tile = grp * gm_full + r % gm, r // gm
            out.append((m_tile, split, n_tile, n_tile * 2 * cfg.blk, split * kb // splits * cfg.ks,
                        (split + 1) * kb // splits * cfg.ks, splits))
    return out


def w4wgmma_pack_reference(q) -> np.ndarray:
    """The wgmma-major INT4 layout of q (K, N) values 0..15, as uint32 words (NumPy; what w4wgmma_pack_kernel makes
    on the GPU; N % 256 == 0).  Word [b // 4, kb, b % 4, t, lane, s] (lane = 4 g + c; super-blocks of 4 blocks,
    stage-major inside) holds channels n0 = 64 b + 16 t + g and n0 + 8 at
    k = 64 kb + 16 s + {2c, 2c+1, 2c+8, 2c+9}: nibble i = r + 4 e is channel n0 + 8 (r % 2), k offset
    2 c + e + 8 (r // 2)."""
    q = np.asarray(q, np.uint32)
    k, n = q.shape
    nb, kbs = n // 64, k // 64
    # q as (kb, s, p, c, e, b, t, j, g): k = 64 kb + 16 s + 8 p + 2 c + e, n = 64 b + 16 t + 8 j + g
    v = q.reshape(kbs, 4, 2, 4, 2, nb, 4, 2, 8)
    words = np.zeros((nb // 4, kbs, 4, 4, 8, 4, 4), np.uint32)  # [b // 4, kb, b % 4, t, g, c, s]
    for i in range(8):
        r, e = i % 4, i // 4
        part = v[:, :, r // 2, :, e, :, :, r % 2, :]     # (kb, s, c, b, t, g)
        part = part.reshape(kbs, 4, 4, nb // 4, 4, 4, 8)  # (kb, s, c, b // 4, b % 4, t, g)
        words |= part.transpose(3, 0, 4, 5, 6, 2, 1) << np.uint32(4 * i)
    return words.reshape(-1)


def w8wgmma_pack_reference(w) -> np.ndarray:
    """The wgmma-major INT8 layout of an int8 weight (N, K) as uint32 words (NumPy; what w8wgmma_pack_kernel makes;
    N % 256 == 0, K % 64 == 0).  Word [b // 4, kc, b % 4, t, lane, s, h] (lane = 4 g + c) holds channel
    n = 64 b + 16 t + g + 8 h at k = 64 kc + 16 s + (2 c, 2 c + 1, 2 c + 8, 2 c + 9) in bytes 0-3."""
    w = np.asarray(w, np.int8).view(np.uint8).astype(np.uint32)
    n, k = w.shape
    # w as (sb, b4, t, h, g, kc, s, p, c, e): n = 64 (4 sb + b4) + 16 t + 8 h + g, k = 64 kc + 16 s + 8 p + 2 c + e
    v = w.reshape(n // 256, 4, 4, 2, 8, k // 64, 4, 2, 4, 2)
    words = np.zeros((n // 256, k // 64, 4, 4, 8, 4, 4, 2), np.uint32)  # [sb, kc, b4, t, g, c, s, h]
    for byte in range(4):
        p, e = byte // 2, byte % 2
        part = v[:, :, :, :, :, :, :, p, :, e]            # (sb, b4, t, h, g, kc, s, c)
        words |= part.transpose(0, 5, 1, 2, 4, 7, 6, 3) << np.uint32(8 * byte)
    return words.reshape(-1)


def w8wgmma_unpack_reference(words, k: int, n: int) -> np.ndarray:
    """Inverse of w8wgmma_pack_reference from the consumer's side (mirrors w4_wgmma_kernel<..., W_INT8>'s reads):
    warp t of a consumer warpgroup loads 32 bytes per lane at byte 32 (32 t + lane) of its block's 4 KB chunk
    (b // 4, kc, b % 4); words 2 s and 2 s + 1 are k16 step s, rows g and g + 8; sc::int8_pair takes bytes 0-1 to A
    registers 0 / 1 (k 2c, 2c + 1) and bytes 2-3 to registers 2 / 3 (k 2c + 8, 2c + 9).  Returns int8 (N, K); raises
    if any element is read twice or never."""
    wd = np.asarray(words, np.uint32).reshape(n // 256, k // 64, 4, 128 * 8)
    out = np.zeros((n, k), np.int16)
    seen = np.zeros((n, k), np.int8)
    for b in range(n // 64):
        for kc in range(k // 64):
            chunk = wd[b // 4, kc, b % 4]
            for t in range(4):
                for lane in range(32):
                    g, c = lane // 4, lane % 4
                    for s in range(4):
                        for h in range(2):
                            word = int(chunk[(32 * t + lane) * 8 + 2 * s + h])
                            for byte in range(4):
                                row = 64 * b + 16 * t + g + 8 * h
                                col = 64 * kc + 16 * s + 2 * c + 8 * (byte // 2) + byte % 2
                                if seen[row, col]:
                                    raise AssertionError(f"(n={row}, k={col}) read twice")
                                seen[row, col] = 1
                                val = (word >> (8 * byte)) & 255
                                out[row, col] = val - 256 if val >= 128 else val
    if not seen.all():
        raise AssertionError("some weights never read")
    return out.astype(np.int8)


def w4wgmma_groups_reference(recs, n: int, ng: int) -> np.ndarray:
    """The group records as w4_wgmma_kernel reads them (NumPy mirror of _w4wgmma_groups): record (block // 4,
    group, block % 4), from gemv_pack_groups_reference's (block, group) order."""
    r = np.asarray(recs, np.uint8).reshape(n // 256, 4, ng, GEMV_GROUP_BYTES)
    return r.transpose(0, 2, 1, 3).reshape(-1)


def w4wgmma_unpack_reference(words, k: int, n: int) -> np.ndarray:
    """Inverse of w4wgmma_pack_reference written from the consumer's side (mirrors w4_wgmma_kernel's reads): warp t
    of a consumer warpgroup loads 16 bytes per lane at byte 16 (32 t + lane) of its block's 2 KB stage chunk
    (b // 4, kb, b % 4);
    word s is the A fragment of k16 step s; sc::int4_fragment makes register r from nibbles (r, r + 4), and the m16n8k16
    A layout puts register r at row g + 8 (r % 2), columns 2 c + 8 (r // 2) + (0, 1).  Raises if any (k, n) is
    read twice or never."""
    w = np.asarray(words, np.uint32).reshape(n // 256, k // 64, 4, 4 * 32 * 4)
    q = np.full((k, n), 255, np.uint8)
    for b in range(n // 64):
        for kb in range(k // 64):
            chunk = w[b // 4, kb, b % 4]
            for t in range(4):
                for lane in range(32):
                    g, c = lane // 4, lane % 4
                    for s in range(4):
                        wd = int(chunk[(32 * t + lane) * 4 + s])
                        for r in range(4):
                            for e in range(2):
                                val = (wd >> (4 * (r + 4 * e))) & 15
                                row = 64 * b + 16 * t + g + 8 * (r % 2)
                                col = 64 * kb + 16 * s + 2 * c + 8 * (r // 2) + e
                                if q[col, row] != 255:
                                    raise AssertionError(f"(k={col}, n={row}) read twice")
                                q[col, row] = val
    if (q == 255).any():
        raise AssertionError("some weights are never read")
    return q


def chunk_order(order: int, kc: int, wpb: int, gw: int, b: int) -> list:
    """The chunks warp gw of a block's wpb warps streams, in order (mirrors ChunkOrder in kernels/quant.cu; for
    tests): 0 its contiguous run, 1 every wpb-th chunk from gw, 2 its run started at a per-warp rotation."""
    if order == 1:
        return list(range(gw, kc, wpb))
    base, end = gw * kc // wpb, (gw + 1) * kc // wpb
    n = end - base
    rot = (7 * b + 3 * gw) % n if (order == 2 and n > 0) else 0
    return [base + (i + rot) % n for i in range(n)]


def gemv_schedule(units_per_block: int, blocks: int, grid: int, warps: int = GEMV_WARPS):
    """The stream-K schedule of gemv_kernel, as Python (mirrors the kernel's index math; for tests): a list
    over CTAs of lists of (block, segment start, segment end, [(piece start, piece end) per warp])."""
    total = blocks * units_per_block
    out = []
    for c in range(grid):
        u0, u1 = total * c // grid, total * (c + 1) // grid
        segs = []
        if u0 < u1:
            for b in range(u0 // units_per_block, (u1 - 1) // units_per_block + 1):
                base = b * units_per_block
                s0, s1 = max(u0, base) - base, min(u1, base + units_per_block) - base
                pieces = [(s0 + (w * (s1 - s0)) // warps, s0 + ((w + 1) * (s1 - s0)) // warps) for w in range(warps)]
                segs.append((b, s0, s1, pieces))
        out.append(segs)
    return out


_AWQ_NIB = tuple((o >> 1) if o % 2 == 0 else 4 + (o >> 1) for o in range(8))  # == _AWQ_POS


def gemv_pack_int4_reference(q) -> np.ndarray:
    """The fragment-major INT4 layout of q (K, N) values 0..15, as uint32 words (NumPy; what
    gemv_pack_int4_kernel makes on the GPU).  Word [b, s, h, lane, t]: channels n = 64 b + 16 t + g + 8 j,
    k = 32 s + 16 h + 4 c + d (lane = 4 g + c); nibble i holds (d, j) = (i // 4 + 2 ((i // 2) % 2), i % 2)."""
    q = np.asarray(q, np.uint32)
    k, n = q.shape
    nb, ks = n // 64, k // 32
    # (ks, h, c, d, nb, t, j, g) view of q: k = 32 s + 16 h + 4 c + d; n = 64 b + 16 t + 8 j + g
    v = q.reshape(ks, 2, 4, 4, nb, 4, 2, 8)
    words = np.zeros((nb, ks, 2, 8, 4, 4), np.uint32)  # [b, s, h, g, c, t]
    for i in range(8):
        d = i // 4 + 2 * ((i // 2) % 2)
        j = i % 2
        part = v[:, :, :, d, :, :, j, :]             # (ks, h, c, nb, t, g)
        words |= part.transpose(3, 0, 1, 5, 2, 4) << np.uint32(4 * i)
    return words.reshape(-1)


def gemv_unpack_int4_reference(words, k: int, n: int) -> np.ndarray:
    """Inverse of gemv_pack_int4_reference, written from the consumer's side: each lane's word t of half h is
    the A fragment of mma tile t (a0..a3 = nibble pairs (0,4), (1,5), (2,6), (3,7); a0/a2 row g, a1/a3 row
    g + 8; a0/a1 mma k slots 2c, 2c+1, a2/a3 slots 2c+8, 2c+9), and mma k slots 2c, 2c+1, 2c+8, 2c+9 of a lane
    stand for k = 4c, 4c+1, 4c+2, 4c+3 (its 8 bytes of x)."""
    w = np.asarray(words, np.uint32).reshape(n // 64, k // 32, 2, 32, 4)
    q = np.zeros((k, n), np.uint8)
    slot_to_k = {}
    for cc in range(4):
        slot_to_k[2 * cc], slot_to_k[2 * cc + 1], slot_to_k[2 * cc + 8], slot_to_k[2 * cc + 9] = (
            4 * cc, 4 * cc + 1, 4 * cc + 2, 4 * cc + 3)
    for lane in range(32):
        g, cc = lane // 4, lane % 4
        for reg, (lo_nib, row_off, slot0) in enumerate(((0, 0, 2 * cc), (1, 8, 2 * cc), (2, 0, 2 * cc + 8),
                                                         (3, 8, 2 * cc + 8))):
            for half in range(2):
                nib = lo_nib + 4 * half
                kk = slot_to_k[slot0 + half]
                for t in range(4):
                    vals = (w[:, :, :, lane, t] >> np.uint32(4 * nib)) & 15     # (nb, ks, h)
                    for h in range(2):
                        rows = 32 * np.arange(k // 32) + 16 * h + kk
                        cols = 64 * np.arange(n // 64) + 16 * t + g + row_off
                        q[np.ix_(rows, cols)] = vals[:, :, h].T
    return q


def gemv_pack_groups_reference(zeros, scales_u16) -> np.ndarray:
    """INT4 group records (uint8, 192 bytes per (block, group)) from zero points (NG, N) (true zeros, GPTQ's
    +1 applied) and the scales' 16-bit patterns (NG, N)."""
    z = np.asarray(zeros, np.uint8)
    s = np.asarray(scales_u16, np.uint16)
    ng, n = z.shape
    nb = n // 64
    # channel order inside a record: [g][o], o = 2 t + j, n = 64 b + 16 t + g + 8 j
    zv = z.reshape(ng, nb, 4, 2, 8).transpose(1, 0, 4, 2, 3).reshape(nb, ng, 64)
    sv = s.reshape(ng, nb, 4, 2, 8).transpose(1, 0, 4, 2, 3).reshape(nb, ng, 64)
    rec = np.zeros((nb, ng, 192), np.uint8)
    rec[:, :, :128] = sv.astype("<u2").view(np.uint8).reshape(nb, ng, 128)
    rec[:, :, 128:] = zv
    return rec.reshape(-1)


def gemv_pack_int8_reference(weight) -> np.ndarray:
    """The fragment-major INT8 layout of weight (N, K) int8 as uint32 words (what gemv_pack_int8_kernel makes)."""
    w = np.asarray(weight).view(np.uint8).astype(np.uint32)
    n, k = w.shape
    nb, ks = n // 32, k // 32
    # (nb, t, j, g, ks, h, c, p, e): n = 32 b + 16 t + 8 j + g, k = 32 s + 16 h + 4 c + 2 p + e
    v = w.reshape(nb, 2, 2, 8, ks, 2, 4, 2, 2)
    word = (v[:, :, 0, :, :, :, :, :, 0] | v[:, :, 0, :, :, :, :, :, 1] << 8
            | v[:, :, 1, :, :, :, :, :, 0] << 16 | v[:, :, 1, :, :, :, :, :, 1] << 24)  # (nb, t, g, ks, h, c, p)
    return word.transpose(0, 3, 4, 2, 5, 1, 6).reshape(-1).astype(np.uint32)  # [b, s, h, g, c, t, p]


@lru_cache(maxsize=None)
def _mma_kernel(dtype: str, fmt: int, mt: int) -> Kernel:
    return Kernel(SOURCE, f"quant::quant_mma_kernel<{A.CTYPE[dtype]}, {fmt}, {mt}>")


@lru_cache(maxsize=None)
def _dequant_kernel(dtype: str, fmt: int) -> Kernel:
    return Kernel(SOURCE, f"quant::dequant_int4_kernel<{A.CTYPE[dtype]}, {fmt}>")


@lru_cache(maxsize=None)
def _dequant_int8_kernel(dtype: str) -> Kernel:
    return Kernel(SOURCE, f"quant::dequant_int8_kernel<{A.CTYPE[dtype]}>")


@lru_cache(maxsize=None)
def _gather_kernel(dtype: str) -> Kernel:
    return Kernel(SOURCE, f"quant::gather_columns_kernel<{A.CTYPE[dtype]}>")


_PERMUTE_KERNEL = Kernel(SOURCE, "quant::gptq_permute_k_kernel")
_PACK_KERNELS = {fmt: Kernel(SOURCE, f"quant::pack_tiles_kernel<{fmt}>") for fmt in (FMT_AWQ, FMT_GPTQ, FMT_INT8)}
_GEMV_PACK_INT4 = {fmt: Kernel(SOURCE, f"quant::gemv_pack_int4_kernel<{fmt}>") for fmt in (FMT_AWQ, FMT_GPTQ)}
_GEMV_PACK_GROUPS = {fmt: Kernel(SOURCE, f"quant::gemv_pack_groups_kernel<{fmt}>") for fmt in (FMT_AWQ, FMT_GPTQ)}
_GEMV_PACK_INT8 = Kernel(SOURCE, "quant::gemv_pack_int8_kernel")


@lru_cache(maxsize=None)
def _gemv_kernel(dtype: str, kind: int, mt: int) -> Kernel:
    return Kernel(SOURCE, f"quant::gemv_kernel<{A.CTYPE[dtype]}, {kind}, {mt}>")


# Extra -D options for the streaming kernels, for same-run A/B measurements (never set by the library; see
# kernels/quant.cu): -DSC_QUANT_XSUM_MT2 (INT4 at M > 8 also takes magic + zero point off per chunk through sum_k x
# and scales the chunk's fp32 sums), -DSC_QUANT_PIPELINE_MT2 (gemv_stream_kernel's register pipeline at M > 8 too),
# -DSC_QUANT_STREAM_UNPIPELINED (no register pipeline at any M: the schedule before it).
_STREAM_DEFINES: tuple = ()


@lru_cache(maxsize=None)
def _stream_kernel(dtype: str, kind: int, mt: int, defines: tuple = (), nbc: int = 1) -> Kernel:
    tail = "" if nbc == 1 else f", {nbc}"
    return Kernel(SOURCE, f"quant::gemv_stream_kernel<{A.CTYPE[dtype]}, {kind}, {mt}{tail}>", options=defines)


@lru_cache(maxsize=None)
def _bulk_kernel(dtype: str, kind: int, mt: int, defines: tuple = ()) -> Kernel:
    return Kernel(SOURCE, f"quant::gemv_bulk_kernel<{A.CTYPE[dtype]}, {kind}, {mt}>", options=defines)


# Extra -D options for quant_marlin_kernel, for same-run A/B measurements (never set by the library).
_MARLIN_DEFINES: tuple = ()


@lru_cache(maxsize=None)
def _marlin_kernel(dtype: str, mt: int, defines: tuple = ()) -> Kernel:
    return Kernel(SOURCE, f"quant::quant_marlin_kernel<{A.CTYPE[dtype]}, {mt}>", options=defines)


@lru_cache(maxsize=None)
def _w4wgmma_kernel(dtype: str, mt: int, blk: int = W4WGMMA_BLK, stages: int = 0, gs: int = 1,
                    ks: int = 1, kind: int = KIND_INT4) -> Kernel:
    stages = stages or w4wgmma_stages(mt, blk, ks, kind)
    tail = ("" if gs == 1 else f", {gs}") if ks == 1 else f", {gs}, {ks}"
    if kind == KIND_INT8:
        tail = f", {gs}, {ks}, 1"
    return Kernel(W4WGMMA_SOURCE, f"quant_sm90::w4_wgmma_kernel<{A.CTYPE[dtype]}, {mt}, {blk}, {stages}{tail}>",
                  hopper=True)


_W8WGMMA_PACK = Kernel(W4WGMMA_SOURCE, "quant_sm90::w8wgmma_pack_kernel<1>", hopper=True)
_W4WGMMA_PACK = {fmt: Kernel(W4WGMMA_SOURCE, f"quant_sm90::w4wgmma_pack_kernel<{fmt}>", hopper=True)
                 for fmt in (FMT_AWQ, FMT_GPTQ)}


def all_kernels() -> list:
    """Every variant this module can launch (for ``python -m speedcore compile``)."""
    out = []
    for dtype in A.HALF_DTYPES:
        for fmt in (FMT_AWQ, FMT_GPTQ, FMT_INT8):
            for mt in MT_CHOICES:
                out.append(_mma_kernel(dtype, fmt, mt))
        for fmt in (FMT_AWQ, FMT_GPTQ):
            out.append(_dequant_kernel(dtype, fmt))
        out.append(_dequant_int8_kernel(dtype))
        out.append(_gather_kernel(dtype))
        for kind in (KIND_INT4, KIND_INT8):
            for mt in (1, 2):
                out.append(_gemv_kernel(dtype, kind, mt))
                out.append(_stream_kernel(dtype, kind, mt))
                if mt == 2:
                    out.extend(_stream_kernel(dtype, kind, mt, nbc=c) for c in STREAM_NBC_CHOICES[1:])
                out.append(_bulk_kernel(dtype, kind, mt))
        for mt in MARLIN_MT_CHOICES:
            out.append(_marlin_kernel(dtype, mt))

        def w4(mt, blk, gs=1, ks=1, kind=KIND_INT4):  # the unsplit ring, and the two-rank split's where it differs
            for stages in dict.fromkeys(w4wgmma_stages(mt, blk, ks, kind, splits) for splits in (1, 2)):
                out.append(_w4wgmma_kernel(dtype, mt, blk, stages, gs=gs, ks=ks, kind=kind))
        for blk, mts in W4WGMMA_SHAPES.items():
            for mt in mts:
                w4(mt, blk)
                for gs in W4WGMMA_GROUP_STEPS[1:]:
                    if gs != 4 or w4wgmma_gs4_built(blk, mt, 1):
                        w4(mt, blk, gs=gs)
                if mt == 64:  # 128-k stages (ks = 2): gs 4 the default, gs 1 for measurements
                    for gs in (1, 4):
                        w4(mt, blk, gs=gs, ks=2)
        for blk, mt, gs, ks in sorted(W8WGMMA_VARIANTS):
            w4(mt, blk, gs=gs, ks=ks, kind=KIND_INT8)
    out.append(_PERMUTE_KERNEL)
    out.extend(_PACK_KERNELS.values())
    out.extend(_GEMV_PACK_INT4.values())
    out.extend(_GEMV_PACK_GROUPS.values())
    out.append(_GEMV_PACK_INT8)
    out.extend(_W4WGMMA_PACK.values())
    out.append(_W8WGMMA_PACK)
    return out


def use_dense(m: int, lib: str, dtype: str) -> bool:
    """Dispatch: dequantize once and call cuBLAS (torch.matmul / cupy.matmul) for M above MAX_MMA_M, where the
    GEMM is compute-bound and the one-time dequantization is amortized.  CuPy has no bfloat16 matmul, so
    CuPy bfloat16 always takes the tensor-core kernel."""
    if m <= MAX_MMA_M:
        return False
    return lib == "torch" or dtype == "float16"


# ---------------------------------------------------------------------------------------------------------------
# Prepacked weights
# ---------------------------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------------------------
# Helpers shared by the public functions
# ---------------------------------------------------------------------------------------------------------------

def _lib_module(a):
    if a.lib == "torch":
        import torch

        return torch
    import cupy

    return cupy


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


@lru_cache(maxsize=8192)
def _plan(fmt: int, dtype: str, rows: int, n: int, k: int, group: int, sms: int):
    """Everything about a launch that depends only on the problem: config, variant, grid, scalar arguments."""
    cfg = mma_config(rows, n, k, fmt, sms)
    if fmt == FMT_INT8:
        tiles_per_group, num_groups = 1, 1
    else:
        tiles_per_group, num_groups = (0 if group == 32 else group // 64), -(-k // group)
    head = (np.int32(rows), np.int32(n), np.int32(k), np.int32(tiles_per_group), np.int32(num_groups))
    tail = (np.int32(cfg.n_tiles), np.int32(cfg.m_chunks), np.int32(cfg.tiles_per_split))
    return cfg, _mma_kernel(dtype, fmt, cfg.mt), LaunchConfig((cfg.grid,), (THREADS,), cfg.smem), head, tail


def _alloc_out(xa, rows: int, n: int):
    """y (rows, N) in x's dtype and library: (object, pointer)."""
    if xa.lib == "torch":
        t = xa.obj.new_empty((rows, n))
        return t, t.data_ptr()
    ya = A.empty(xa, (rows, n), xa.dtype, name="out")
    return ya.obj, ya.ptr


def _launch_mma(fmt, xa, rows, k, ldx, qw_ptr, ldq, qz_ptr, ldz, scales_ptr, lds, bias_ptr, n, group,
                packed: bool, gemv=None):
    """Allocate y (rows, N) and run quant_mma_kernel, or, when the layer has the fragment-major copy (``gemv``)
    for x's dtype, quant_marlin_kernel (use_marlin: INT4, 17 <= M <= 128) or a streaming
    kernel for M <= 16; returns y (the caller's library).  Before all of these: w4_wgmma_kernel where
    _w4_applies (use_w4wgmma: sm_90, 17 <= M <= 1024 by default, to 8192 from N = 4096)."""
    if rows and _w4_applies(gemv, xa, rows, n, k):
        return _launch_w4wgmma(gemv, xa, rows, k, ldx, bias_ptr, n, scales_ptr)
    if (gemv is not None and gemv.kind == KIND_INT4 and gemv.dtype == xa.dtype
            and use_marlin(rows, n, k, gemv.spg * GEMV_STEP_K) and _marlin_fits(xa.device, rows)):
        return _launch_marlin(gemv, xa, rows, k, ldx, bias_ptr, n)
    if (gemv is not None and gemv.w_ptr and 0 < rows <= GEMV_MAX_M
            and (gemv.dtype is None or gemv.dtype == xa.dtype)):
        if use_bulk(gemv.kind, rows, n, k, gemv.spg * GEMV_STEP_K, device_info(xa.device).cc):
            return _launch_chunks(True, gemv, xa, rows, k, ldx, scales_ptr, bias_ptr, n)
        if use_stream(gemv.kind, rows, n, k, gemv.spg * GEMV_STEP_K):
            return _launch_chunks(False, gemv, xa, rows, k, ldx, scales_ptr, bias_ptr, n)
        if _GEMV_MODE == "on" or (_GEMV_MODE == "auto" and use_gemv(gemv.kind, rows, n, k)):
            return _launch_gemv(gemv, xa, rows, k, ldx, scales_ptr, bias_ptr, n)
    y, y_ptr = _alloc_out(xa, rows, n)
    if rows == 0:
        return y
    cfg, kernel, lcfg, head, tail = _plan(fmt, xa.dtype, rows, n, k, group, device_info(xa.device).sms)
    stream = A.stream_of(xa)
    partial_ptr = tickets_ptr = 0
    if cfg.splits > 1:
        partial_ptr, tickets_ptr = A.split_k_scratch(xa, stream, cfg.splits * rows * n * 4, cfg.m_chunks * cfg.n_tiles)
    args = (y_ptr, partial_ptr, tickets_ptr, xa.ptr, qw_ptr, qz_ptr, scales_ptr, bias_ptr) + head + (
        np.int64(ldx), np.int64(ldq), np.int64(ldz), np.int64(lds)) + tail + (np.int32(1 if packed else 0),)
    launch(kernel, lcfg, args, device=xa.device, stream=stream)
    return y


def _env_switch(name: str) -> str:
    """A dispatch switch read from the environment at import: "on" (1, on, true), "off" (0, off, false), else
    "auto"."""
    v = os.environ.get(name, "auto").lower()
    return "on" if v in ("1", "on", "true") else "off" if v in ("0", "off", "false") else "auto"


# "auto": use_gemv decides; "on": gemv_kernel wherever the layer has its layout (prepack builds it for every
# format); "off": quant_mma_kernel only.  Tests and benchmarks switch it to run both kernels on one layer.
_GEMV_MODE = "auto"
# "on": gemv_stream_kernel for 1 <= M <= 16 wherever the layer has the fragment-major copy and the shape fits
# (stream_supported), before the choice above; "off": never.  _STREAM_OVERRIDE: keyword overrides of
# stream_config (warps, splits, prefetch), for measurements.
_STREAM_MODE = "on"
_STREAM_OVERRIDE: dict = {}
# "auto": use_bulk decides; "on": gemv_bulk_kernel on sm_90+ wherever gemv_stream_kernel would run (before it);
# "off": never.  _BULK_OVERRIDE: keyword overrides of bulk_config (warps, splits, stages, order), for measurements.
_BULK_MODE = "auto"
_BULK_OVERRIDE: dict = {}
# quant_marlin_kernel for prepacked INT4 layers at M in _MARLIN_M_RANGE (inclusive), where the shape fits
# (marlin_supported), before every choice but w4_wgmma_kernel.  "auto" (default; see use_marlin), "on" or "off"; the
# environment variable SPEEDCORE_QUANT_MARLIN=1 / 0 (read at import) forces it on / off.  _MARLIN_OVERRIDE: keyword
# overrides of marlin_config (ctas).
_MARLIN_MODE = _env_switch("SPEEDCORE_QUANT_MARLIN")
_MARLIN_M_RANGE = (17, 128)
_MARLIN_OVERRIDE: dict = {}


def use_marlin(m: int, n: int, k: int, group: int) -> bool:
    """Dispatch for prepacked INT4 layers (a pure function but for the _MARLIN_MODE / _MARLIN_M_RANGE switches):
    quant_marlin_kernel for M in _MARLIN_M_RANGE where its shape constraints hold (marlin_supported).  In "auto"
    mode it is left out at M < 32 on layers of at most 8192 x 8192, where quant_mma_kernel was ahead on the H200
    (benchmarks/_quant_marlin_probe.py at 677bebe: 35.6 against 37.4 us at M = 17; elsewhere in 17-128 it was
    ahead by 0-7%, or behind by 1.4% at bf16 M = 128 on 28672 x 8192)."""
    lo, hi = _MARLIN_M_RANGE
    if _MARLIN_MODE == "off" or not (max(lo, 1) <= m <= hi and marlin_supported(k, n, group)):
        return False
    return _MARLIN_MODE == "on" or m >= 32 or n * k > 8192 * 8192


# w4_wgmma_kernel (sm_90a) for prepacked INT4 layers at M in W4WGMMA_M_RANGE where the shape fits
# (w4wgmma_supported), before every other choice, including the dense path above MAX_MMA_M.  "off" by default until
# measured on the GPU; SPEEDCORE_QUANT_W4WGMMA=1 (read at import) turns it on.  It must be on when the layer is
# prepacked (prepack then also builds the wgmma-major copy, the weight's size again).  _W4WGMMA_OVERRIDE: keyword
# overrides of w4wgmma_config (splits, mt, blk, gs), for measurements (benchmarks/_quant_w4wgmma_probe.py).
_W4WGMMA_MODE = _env_switch("SPEEDCORE_QUANT_W4WGMMA")
# "auto" takes w4_wgmma_kernel where it measured ahead of every other path (H200, same-process probe
# benchmarks/_quant_w4wgmma_probe.py, us, w4wgmma / previous dispatch / cuBLAS, bf16): 8192 x 8192 M = 17
# 31.9 / 35.6 / 36.0, M = 32 33.4 / 41.6 / 37.1, M = 48 35.3 / 56.3 / 36.4, M = 64 37.9 / 62.8 / 38.6, M = 128
# 53.4 / 80.8 / 37.6, M = 256 76.1 / 117.8 / 47.6, M = 1024 215 / 239 / 178 (fp16 alike); 28672 x 8192 M = 48
# 95.6 / 130.0 / 119.4, M = 64 98.1 / 138.2 / 119.6, M = 256 215 / 399 / 183, M = 1024 764 / 829 / 618.  With
# w4wgmma_shape's tiles (--tune sweep), 28672 x 8192 M = 17 / 32 / 48 106.0 / 86.4 / 87.1 against
# quant_marlin_kernel's 89.2 / 93.7 / 129.9, and since 128-k stages and one-wave splits (5891054) 74.7 at M = 17
# against 88.3 (8192 x 28672: 61.2 against 89.3), and M = 2048 is ahead of dequantize +
# cuBLAS from N = 8192 on (8192^2 380 / 404, 28672 x 8192 1357 / 1490, 8192 x 28672 1330 / 1479); since the three
# producer warps and 256-row tiles (1d1efd2) at 4096^2 too (M = 2048 96.5 against the dense path's ~109, M = 8192
# 367-373 against cuBLAS alone 343-351).
W4WGMMA_AUTO_M = (17, 1024)
# From M = 9 on narrow layers (N <= W4WGMMA_AUTO_NARROW_N), where gemv_stream_kernel's two 8-row x tiles have too
# few channel blocks to hide its latency (H200, same run, AWQ, us, stream / w4wgmma / cuBLAS at M = 16: 1024 x 4096
# 13.5 / 11.2 / 9.8, 2048 x 4096 14.5 / 12.7 / 12.4, 1024 x 8192 13.5 / 12.5 / 11.3; at 4096 x 4096 14.2 / 15.1 /
# 15.1 the stream kernel stays ahead).
W4WGMMA_AUTO_NARROW_M = 9
W4WGMMA_AUTO_NARROW_N = 2048
W4WGMMA_AUTO_WIDE_MAX_M = 8192  # the upper end on layers with N >= W4WGMMA_AUTO_WIDE_N
W4WGMMA_AUTO_WIDE_N = 4096
_W4WGMMA_OVERRIDE: dict = {}


# INT8 on w4_wgmma_kernel (KIND = W_INT8), on unless SPEEDCORE_QUANT_W8WGMMA=0 (read at import; also read at
# prepack, which builds the wgmma-major INT8 copy: the weight's size again).  H200, same run (a492636, us, bf16):
# 8192^2 M = 64 30.6 against 72.9 for quant_mma_kernel (cuBLAS 38.9), M = 256 62.5 against 105.9 for
# dequant_int8_kernel + cuBLAS (47.2), M = 2048 355 against 393 (344); 28672 x 8192 M = 17 109 against 123 (123),
# M = 2048 1416 against 1517 (1287); fp16 alike (28672 x 8192 M = 2048 1455 against 1434: a tie).
_W8WGMMA_MODE = _env_switch("SPEEDCORE_QUANT_W8WGMMA")
W8WGMMA_M_RANGE = (17, 8192)


def w8wgmma_supported(k: int, n: int) -> bool:
    """INT8 shapes w4_wgmma_kernel covers: N % 256 == 0 (super-blocks), K % 64 == 0."""
    return n % 256 == 0 and k % W4WGMMA_BK == 0 and k > 0


def use_w8wgmma(m: int, n: int, k: int, cc: tuple = (9, 0)) -> bool:
    """Dispatch for prepacked INT8 layers with the wgmma-major copy: M in W8WGMMA_M_RANGE unless the switch is off."""
    return (_W8WGMMA_MODE != "off" and tuple(cc) == (9, 0) and w8wgmma_supported(k, n)
            and W8WGMMA_M_RANGE[0] <= m <= W8WGMMA_M_RANGE[1])


def use_w4wgmma(m: int, n: int, k: int, group: int, cc: tuple = (9, 0)) -> bool:
    """Dispatch for prepacked INT4 layers (a pure function but for the _W4WGMMA_MODE switch): w4_wgmma_kernel on
    compute capability 9.0 where w4wgmma_supported holds, for M in W4WGMMA_AUTO_M ("auto", the default; up to
    W4WGMMA_AUTO_WIDE_MAX_M where N >= W4WGMMA_AUTO_WIDE_N, from W4WGMMA_AUTO_NARROW_M where N <=
    W4WGMMA_AUTO_NARROW_N) or in W4WGMMA_M_RANGE ("on")."""
    if _W4WGMMA_MODE == "off" or tuple(cc) != (9, 0) or not w4wgmma_supported(k, n, group):
        return False
    lo, hi = W4WGMMA_M_RANGE if _W4WGMMA_MODE == "on" else W4WGMMA_AUTO_M
    if _W4WGMMA_MODE == "auto" and n >= W4WGMMA_AUTO_WIDE_N:
        hi = W4WGMMA_AUTO_WIDE_MAX_M
    if _W4WGMMA_MODE == "auto" and n <= W4WGMMA_AUTO_NARROW_N:
        lo = W4WGMMA_AUTO_NARROW_M
    return lo <= m <= hi


def _w4_applies(gl, xa, rows: int, n: int, k: int) -> bool:
    """Whether this call of a layer with fragment-major copy ``gl`` takes w4_wgmma_kernel (INT4, or INT8)."""
    if gl is None or gl.w4_ptr == 0:
        return False
    if gl.kind == KIND_INT8:
        return use_w8wgmma(rows, n, k, device_info(xa.device).cc)
    return gl.dtype == xa.dtype and use_w4wgmma(rows, n, k, gl.spg * GEMV_STEP_K, device_info(xa.device).cc)


def use_stream(kind: int, m: int, n: int, k: int, group: int = 0) -> bool:
    """Dispatch for 1 <= M <= 16 on prepacked layers (a pure function but for the _STREAM_MODE switch):
    gemv_stream_kernel wherever its shape constraints hold (stream_supported), before use_gemv's choice."""
    return _STREAM_MODE == "on" and 1 <= m <= GEMV_MAX_M and stream_supported(kind, k, n, group)


def use_bulk(kind: int, m: int, n: int, k: int, group: int = 0, cc: tuple = (9, 0)) -> bool:
    """gemv_bulk_kernel (cp.async.bulk, compute capability >= 9.0) instead of gemv_stream_kernel: INT4 at M = 1
    on layers of N K >= 2^26 with N <= K (a pure function but for the _BULK_MODE switch).

    Measured on the H200 (same runs, both kernels on the same prepacked layers, bf16): at M = 1 its 2-stage
    rings with the interleaved chunk order took 15.6 / 42.5 / 35.9 us against 16.5 / 43.5 / 38.2 us for
    8192x8192 / 28672x8192 / 8192x28672; at 4096x4096, at M >= 4 and for INT8 it was as fast or slower.  Not
    where N > K: once gemv_stream_kernel took prefetch 0, it read 28672x8192 in 41.3 / 37.3 us (bf16 / fp16)
    against the bulk kernel's 42.2 / 41.0 (medians of 7 interleaved rounds, benchmarks/_quant_m1_ab.py); at
    8192x8192 and 8192x28672 the two stayed within 2%, the bulk kernel ahead or level."""
    if _BULK_MODE == "off" or tuple(cc) < (9, 0) or not use_stream(kind, m, n, k, group):
        return False
    return _BULK_MODE == "on" or (kind == KIND_INT4 and m == 1 and n * k >= 1 << 26 and n <= k)


def use_gemv(kind: int, m: int, n: int, k: int) -> bool:
    """Dispatch for 1 <= M <= 16 on prepacked layers: gemv_kernel or quant_mma_kernel (a pure function).

    Measured on the H200 in one run (both kernels on the same prepacked layers, bf16 and fp16 alike): for
    INT4, gemv_kernel is 5-12% faster at M < 8 on large weights (N K >= 2^27: 28672x8192, 8192x28672) and
    5-35% faster at M >= 8 on smaller ones (8192x8192, 4096x4096); quant_mma_kernel is 3-10% faster in the
    other two corners.  For INT8 quant_mma_kernel was as fast or faster everywhere."""
    if kind != KIND_INT4 or not 1 <= m <= GEMV_MAX_M:
        return False
    large = n * k >= 1 << 27
    return large if m < 8 else not large


def _want_gemv_layout(kind: int, n: int, k: int, group: int = 0) -> bool:
    """Whether prepack should build the fragment-major copy: the shape fits it and some M would use it."""
    if not gemv_supported(kind, k, n, group):
        return False
    if _STREAM_MODE == "on" and stream_supported(kind, k, n, group):
        return True
    if _GEMV_MODE == "off":
        return False
    return _GEMV_MODE == "on" or any(use_gemv(kind, m, n, k) for m in range(1, GEMV_MAX_M + 1))


@lru_cache(maxsize=8192)
def _gemv_plan(kind: int, dtype: str, rows: int, n: int, k: int, spg: int, ng: int, sms: int):
    cfg = gemv_config(rows, n, k, kind, sms)
    scalars = (np.int32(rows), np.int32(n), np.int32(cfg.steps), np.int32(cfg.blocks), np.int32(spg), np.int32(ng))
    return cfg, _gemv_kernel(dtype, kind, cfg.mt), LaunchConfig((cfg.grid,), (GEMV_WARPS * 32,), cfg.smem), scalars


def _gemv_scratch(xa, stream, floats: int, tickets: int):
    """Zeroed fp32 partial sums and int32 tickets for gemv_kernel's split blocks; the kernel leaves both zeroed
    again, so launches on one stream can share them."""
    return (A.stream_buffer("gemv_ws", xa, stream, floats, "float32", zeroed=True).ptr,
            A.stream_buffer("gemv_tickets", xa, stream, tickets, "int32", zeroed=True).ptr)


def _launch_gemv(gl, xa, rows, k, ldx, scales_ptr, bias_ptr, n):
    y, y_ptr = _alloc_out(xa, rows, n)
    cfg, kernel, lcfg, scalars = _gemv_plan(gl.kind, xa.dtype, rows, n, k, gl.spg, gl.ng,
                                            device_info(xa.device).sms)
    stream = A.stream_of(xa)
    ws_ptr, tickets_ptr = _gemv_scratch(xa, stream, rows * n, cfg.blocks)
    args = (y_ptr, ws_ptr, tickets_ptr, xa.ptr, gl.w_ptr, gl.g_ptr,
            scales_ptr if gl.kind == KIND_INT8 else 0, bias_ptr) + scalars + (np.int64(ldx),)
    launch(kernel, lcfg, args, device=xa.device, stream=stream)
    return y


@lru_cache(maxsize=8192)
def _stream_plan(kind: int, dtype: str, rows: int, n: int, k: int, spg: int, ng: int, sms: int, override: tuple,
                 defines: tuple = ()):
    cfg = stream_config(rows, n, k, kind, sms, **dict(override))
    scalars = (np.int32(rows), np.int32(n), np.int32(cfg.steps), np.int32(spg), np.int32(ng), np.int32(cfg.blocks),
               np.int32(cfg.splits), np.int32(cfg.prefetch), np.int32(cfg.order), np.uint32(0))
    return (cfg, _stream_kernel(dtype, kind, cfg.mt, defines, cfg.nbc),
            LaunchConfig((cfg.grid,), (cfg.warps * 32,), cfg.smem), scalars)


def _launch_chunks(bulk: bool, gl, xa, rows, k, ldx, scales_ptr, bias_ptr, n):
    """gemv_bulk_kernel (bulk) or gemv_stream_kernel: the same arguments, each with its own plan."""
    y, y_ptr = _alloc_out(xa, rows, n)
    plan, override = (_bulk_plan, _BULK_OVERRIDE) if bulk else (_stream_plan, _STREAM_OVERRIDE)
    cfg, kernel, lcfg, scalars = plan(gl.kind, xa.dtype, rows, n, k, gl.spg, gl.ng, device_info(xa.device).sms,
                                      tuple(sorted(override.items())), _STREAM_DEFINES)
    stream = A.stream_of(xa)
    ws_ptr = tickets_ptr = 0
    if cfg.splits > 1:
        ws_ptr, tickets_ptr = _gemv_scratch(xa, stream, rows * n, cfg.blocks)
    args = (y_ptr, ws_ptr, tickets_ptr, xa.ptr, gl.w_ptr, gl.g_ptr,
            scales_ptr if gl.kind == KIND_INT8 else 0, bias_ptr) + scalars + (np.int64(ldx),)
    launch(kernel, lcfg, args, device=xa.device, stream=stream)
    return y


@lru_cache(maxsize=8192)
def _bulk_plan(kind: int, dtype: str, rows: int, n: int, k: int, spg: int, ng: int, sms: int, override: tuple,
               defines: tuple = ()):
    cfg = bulk_config(rows, n, k, kind, sms, **dict(override))
    scalars = (np.int32(rows), np.int32(n), np.int32(cfg.steps), np.int32(spg), np.int32(ng), np.int32(cfg.blocks),
               np.int32(cfg.splits), np.int32(cfg.stages), np.int32(cfg.order))
    return (cfg, _bulk_kernel(dtype, kind, cfg.mt, defines), LaunchConfig((cfg.grid,), (cfg.warps * 32,), cfg.smem),
            scalars)


@lru_cache(maxsize=8192)
def _marlin_plan(dtype: str, rows: int, n: int, k: int, spg: int, ng: int, sms: int, override: tuple,
                 defines: tuple = ()):
    cfg = marlin_config(rows, n, k, sms, **dict(override))
    scalars = (np.int32(rows), np.int32(n), np.int32(k // GEMV_STEP_K), np.int32(spg), np.int32(ng),
               np.int32(cfg.n_tiles), np.int32(cfg.m_chunks))
    return (cfg, _marlin_kernel(dtype, cfg.mt, defines), LaunchConfig((cfg.grid,), (MARLIN_WARPS * 32,), cfg.smem),
            scalars)


def _marlin_fits(device: int, rows: int) -> bool:
    """Whether the device's per-block shared memory holds quant_marlin_kernel's ring (not on 99 KB parts)."""
    mt = 4 if rows <= 32 else 8
    return marlin_smem_bytes(mt) <= getattr(device_info(device), "smem_per_block_optin", BULK_SMEM_PER_CTA)


def _launch_marlin(gl, xa, rows, k, ldx, bias_ptr, n):
    y, y_ptr = _alloc_out(xa, rows, n)
    cfg, kernel, lcfg, scalars = _marlin_plan(xa.dtype, rows, n, k, gl.spg, gl.ng, device_info(xa.device).sms,
                                              tuple(sorted(_MARLIN_OVERRIDE.items())), _MARLIN_DEFINES)
    stream = A.stream_of(xa)
    ws_ptr = tickets_ptr = 0
    if cfg.ctas != cfg.n_tiles * cfg.m_chunks:  # some tile is split over CTAs
        ws_ptr, tickets_ptr = A.split_k_scratch(xa, stream, marlin_workspace_floats(cfg) * 4,
                                                cfg.m_chunks * cfg.n_tiles)
    args = (y_ptr, ws_ptr, tickets_ptr, xa.ptr, gl.w_ptr, gl.g_ptr, bias_ptr) + scalars + (np.int64(ldx),)
    launch(kernel, lcfg, args, device=xa.device, stream=stream)
    return y


@lru_cache(maxsize=64)
def _w4_cluster_ctas(kernel: Kernel, device: int, smem: int) -> tuple:
    """CTAs of ``kernel`` (384 threads, ``smem`` bytes) resident at once in clusters of 1..W4WGMMA_MAX_SPLITS."""
    lk = get_kernel(kernel, device)
    return tuple(lk.max_cluster_ctas(LaunchConfig((s,), (384,), smem, cluster=s))
                 for s in range(1, W4WGMMA_MAX_SPLITS + 1))


@lru_cache(maxsize=8192)
def _w4wgmma_plan(dtype: str, rows: int, n: int, k: int, group: int, device: int, sms: int, override: tuple,
                  kind: int = KIND_INT4):
    """(config, kernel, launch config, scalar arguments, tail) of w4_wgmma_kernel; tail: None, or the tail launch's
    (launch config, scalar arguments)."""
    cfg = w4wgmma_config(rows, n, k, sms, **dict(override), kind=kind)
    if cfg.splits > 1 or cfg.tail_tiles:  # the split counts again, knowing where clusters fit
        kern = _w4wgmma_kernel(dtype, cfg.mt, cfg.blk, cfg.stages, gs=cfg.gs, ks=cfg.ks, kind=kind)
        cfg = w4wgmma_config(rows, n, k, sms, **dict(override), kind=kind,
                             cluster_ctas=_w4_cluster_ctas(kern, device, cfg.smem))
    spg, ng = (group // W4WGMMA_BK, k // group) if kind == KIND_INT4 else (1, 1)  # INT8: no groups
    common = (np.int32(rows), np.int32(n), np.int32(k // (W4WGMMA_BK * cfg.ks)), np.int32(spg), np.int32(ng),
              np.int32(cfg.m_tiles))
    m_group = np.int32(cfg.m_group or cfg.m_tiles)
    scalars = common + (np.int32(cfg.splits), m_group, np.int32(0))
    kernel = _w4wgmma_kernel(dtype, cfg.mt, cfg.blk, cfg.stages, gs=cfg.gs, ks=cfg.ks, kind=kind)
    tail = None
    if cfg.tail_tiles:
        # overlap: the tail's CTAs take SMs as the first launch's last wave frees them (they write other tiles)
        tail = (LaunchConfig((cfg.tail_grid,), (384,), cfg.smem, cluster=cfg.tail_splits, overlap=True),
                common + (np.int32(cfg.tail_splits), m_group, np.int32(cfg.tail_base)))
    return cfg, kernel, LaunchConfig((cfg.grid,), (384,), cfg.smem, cluster=cfg.splits), scalars, tail


def _launch_w4wgmma(gl, xa, rows, k, ldx, bias_ptr, n, scales_ptr=0):
    """y (rows, N) by w4_wgmma_kernel; x rows must be 16-byte aligned (TMA).  INT8 layers: ``scales_ptr``, the
    per-channel scales in x's dtype, takes the group records' place."""
    from . import _tma

    y, y_ptr = _alloc_out(xa, rows, n)
    group = gl.spg * GEMV_STEP_K if gl.kind == KIND_INT4 else 0
    cfg, kernel, lcfg, scalars, tail = _w4wgmma_plan(xa.dtype, rows, n, k, group, xa.device,
                                                     device_info(xa.device).sms,
                                                     tuple(sorted(_W4WGMMA_OVERRIDE.items())), gl.kind)
    tmap_x = _tma.tile_map_2d(xa.ptr, xa.dtype, rows=rows, cols=k, row_stride=ldx, box_rows=cfg.mt,
                              box_cols=W4WGMMA_BK)
    stream = A.stream_of(xa)
    g_ptr = gl.w4_g_ptr if gl.kind == KIND_INT4 else scales_ptr
    args = (tmap_x, y_ptr, gl.w4_ptr, g_ptr, bias_ptr)
    launch(kernel, lcfg, args + scalars, device=xa.device, stream=stream)
    if tail is not None:
        launch(kernel, tail[0], args + tail[1], device=xa.device, stream=stream)
    return y


def _w4wgmma_pack(fmt, qa, k, n, group):
    """The wgmma-major INT4 copy (w4wgmma_pack_kernel), or None where w4_wgmma_kernel cannot run."""
    if (_W4WGMMA_MODE == "off" or device_info(qa.device).cc != (9, 0) or not w4wgmma_supported(k, n, group)):
        return None
    words = A.empty(qa, (n * k // 8,), "int32", name="w4wgmma_weight")
    total = words.shape[0]
    launch(_W4WGMMA_PACK[fmt], LaunchConfig((-(-total // 256),), (256,)),
           (words.ptr, qa.ptr, np.int32(k // W4WGMMA_BK), np.int64(_row_stride(qa)), np.int64(total)),
           device=qa.device, stream=A.stream_of(qa))
    return words


def _w4wgmma_groups(recs, nb: int, ng: int):
    """The group records in w4_wgmma_kernel's order, record (block // 4, group, block % 4), from the streaming
    kernels' (block, group) order (a transposed copy, nb x ng x 192 bytes; nb % 4 == 0)."""
    shape = (nb // 4, 4, ng, GEMV_GROUP_BYTES)
    if recs.lib == "torch":
        t = recs.obj.view(shape).transpose(1, 2).contiguous().view(-1)
    else:
        import cupy

        t = cupy.ascontiguousarray(recs.obj.reshape(shape).transpose(0, 2, 1, 3)).reshape(-1)
    return A.wrap(t, "w4wgmma_groups")


def _obj_ptr(a) -> tuple:
    """(object, device pointer) of an optional copy: (None, 0) where it was not made."""
    return (a.obj, a.ptr) if a is not None else (None, 0)


def _w8wgmma_pack(wa, k, n):
    """The wgmma-major INT8 copy (w8wgmma_pack_kernel), or None where the INT8 w4_wgmma_kernel is off or cannot run."""
    if _W8WGMMA_MODE == "off" or device_info(wa.device).cc != (9, 0) or not w8wgmma_supported(k, n):
        return None
    words = A.empty(wa, (n * k // 4,), "int32", name="w8wgmma_weight")
    total = words.shape[0]
    launch(_W8WGMMA_PACK, LaunchConfig((-(-total // 256),), (256,)),
           (words.ptr, wa.ptr, np.int32(k // W4WGMMA_BK), np.int64(_row_stride(wa)), np.int64(total)),
           device=wa.device, stream=A.stream_of(wa))
    return words


def _gemv_pack(fmt, qa, za, sa, k, n, group):
    """The fragment-major copy (and INT4 group records) of a checked layer, made on the GPU."""
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


def _fast_call(f: _FastLayer, x, bias):
    """The prepacked path with per-call checks reduced to x and bias.  Returns None for anything unusual
    (dtype or device mismatch, wrong K, dense-path sizes, odd bias): the general path then converts or raises."""
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
    if rows and not _aligned_rows_x(xa, ldx):
        xa = _rows_copy(xa, rows, f.k)
        ldx = f.k
    y = _launch_mma(f.fmt, xa, rows, f.k, ldx, f.qw_ptr, f.ldq, f.qz_ptr, f.ldz, f.scales_ptr, f.lds, bias_ptr, f.n,
                    f.group, True, f.gemv)
    return y.reshape(out_shape)


def _make_fast(fmt, packed_obj, qa, za, sa, k, n, g, gemv=None):
    pa = A.wrap(packed_obj, "packed")
    return _FastLayer(fmt, sa.dtype, qa.lib, qa.device, k, n, g, pa.ptr, _row_stride(qa),
                      za.ptr if za is not None else 0, _row_stride(za) if za is not None else 0, sa.ptr,
                      _row_stride(sa) if sa.ndim == 2 else 0, gemv)


def packed_shape(fmt: int, k: int, n: int) -> tuple:
    """int32 elements of the tile-major copy: ceil(N/512) x ceil(K/BK) tiles of 16 KB."""
    return (-(-n // BLOCK_N) * -(-k // _block_k(fmt)) * W_STAGE_BYTES // 4,)


def _pack(fmt, qa, k, n):
    """The tile-major copy of a stored weight (pack_tiles_kernel), for the fast kernel's linear loads."""
    out = A.empty(qa, packed_shape(fmt, k, n), "int32", name="packed")
    total = out.shape[0] // 4
    launch(_PACK_KERNELS[fmt], LaunchConfig((-(-total // 256),), (256,)),
           (out.ptr, qa.ptr, np.int32(k), np.int32(n), np.int64(_row_stride(qa)), np.int32(-(-k // _block_k(fmt))),
            np.int64(total)), device=qa.device, stream=A.stream_of(qa))
    return out


def _check_packed(pa, fmt, k, n, ref):
    if pa is None:
        return None
    A.check_dtype(pa, ("int32",))
    A.check_shape(pa, packed_shape(fmt, k, n))
    A.check_same_device(ref, pa)
    if not pa.is_contiguous() or not pa.aligned(16):
        raise ValueError("packed: must be the contiguous buffer made by prepack")
    return pa


def _finish(xa, ya, rows, n):
    """Reshape y (rows, N) to x's leading shape."""
    return ya.obj.reshape(tuple(xa.shape[:-1]) + (n,))


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


DEQUANT_ROWS = 4  # k rows per thread of dequant_int4_kernel (must match kernels/quant.cu)


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


def _check_common(xa, others, bias, n):
    A.check_same_device(xa, *others, bias)
    if bias is not None:
        A.check_dtype(bias, (xa.dtype,), " (bias must have x's dtype)")
        A.check_shape(bias, (n,))
        if n > 1 and bias.strides[0] != 1:
            raise ValueError(f"bias: must be contiguous, got stride {bias.strides[0]}")


def _fast_group_ok(group: int) -> bool:
    return group == 32 or group % 64 == 0


# ---------------------------------------------------------------------------------------------------------------
# AWQ
# ---------------------------------------------------------------------------------------------------------------

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


def prepack_awq(qweight, qzeros, scales, *, group_size: int = 128, dtype=None) -> AWQWeight:
    """Prepare an AWQ layer once for :func:`awq_linear`: checks, scales converted to the activation dtype
    (``dtype``: "float16" or "bfloat16", default the scales' dtype), and a tile-major copy of qweight (same
    size) that the fast kernel streams as contiguous 16 KB blocks.  The stored tensors are kept too."""
    qa, za, sa, k, n, g = _validate_awq(qweight, qzeros, scales, group_size)
    if dtype is not None:
        dtype = str(dtype).replace("torch.", "")
        if dtype not in A.HALF_DTYPES:
            raise TypeError(f"dtype: expected float16 or bfloat16, got {dtype}")
        sa = _as_dtype(sa, dtype, "scales")
    packed = fast = gemv = None
    if n % 64 == 0 and _fast_group_ok(g) and k % 8 == 0 and all(_aligned_rows(a) for a in (qa, za, sa)):
        packed = _pack(FMT_AWQ, qa, k, n).obj
        if _want_gemv_layout(KIND_INT4, n, k, g):
            gemv = _gemv_pack(FMT_AWQ, qa, za, sa, k, n, g)
        fast = _make_fast(FMT_AWQ, packed, qa, za, sa, k, n, g, gemv)
    return AWQWeight(qa.obj, za.obj, sa.obj, g, k, n, packed, fast, gemv)


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
    if isinstance(qweight, AWQWeight) and qweight.fast is not None and qzeros is None and scales is None:
        y = _fast_call(qweight.fast, x, bias)
        if y is not None:
            return y
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
    y = _launch_mma(FMT_AWQ, xa, rows, k, ldx, pk.ptr if pk is not None else qa.ptr, _row_stride(qa), za.ptr,
                    _row_stride(za), sa.ptr, _row_stride(sa), ba.ptr if ba is not None else 0, n, g, pk is not None,
                    gemv)
    return y.reshape(out_shape)


def _aligned_rows_x(xa, ldx) -> bool:
    return xa.aligned(16) and (ldx * xa.itemsize) % 16 == 0 and xa.shape[-1] % 8 == 0


# ---------------------------------------------------------------------------------------------------------------
# GPTQ
# ---------------------------------------------------------------------------------------------------------------

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


def prepack_gptq(qweight, qzeros, scales, g_idx=None, *, group_size: int = 128, dtype=None) -> GPTQWeight:
    """Prepare a GPTQ layer once for :func:`gptq_linear`.

    Makes a tile-major copy of qweight (same size) that the fast kernel streams as contiguous 16 KB blocks.
    With act-order, the k rows of ``qweight`` are first repacked in group order (a nibble gather on the GPU)
    and the permutation is kept, so each call only gathers the columns of x (M x K elements).  ``dtype`` converts the
    scales to the activation dtype once.  Copies g_idx to the host (a synchronization).
    """
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
    if n % 64 == 0 and _fast_group_ok(g) and all(_aligned_rows(a) for a in (qa, za, sa)):
        packed = _pack(FMT_GPTQ, qa, k, n).obj
        if _want_gemv_layout(KIND_INT4, n, k, g):
            gemv = _gemv_pack(FMT_GPTQ, qa, za, sa, k, n, g)
        if perm_obj is None:
            fast = _make_fast(FMT_GPTQ, packed, qa, za, sa, k, n, g, gemv)
    return GPTQWeight(qa.obj, za.obj, sa.obj, g, k, n, perm=perm_obj, packed=packed, fast=fast, gemv=gemv)


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
    if (isinstance(qweight, GPTQWeight) and qweight.fast is not None and qzeros is None and scales is None
            and g_idx is None):
        y = _fast_call(qweight.fast, x, bias)
        if y is not None:
            return y
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
    y = _launch_mma(FMT_GPTQ, xa, rows, k, ldx, pk.ptr if pk is not None else qa.ptr, _row_stride(qa), za.ptr,
                    _row_stride(za), sa.ptr, _row_stride(sa), ba.ptr if ba is not None else 0, n, g, pk is not None,
                    gemv)
    return y.reshape(out_shape)


def _gather_x(xa, rows, k, ldx, pa):
    out = A.empty(xa, (rows, k), xa.dtype, name="x")
    total = rows * k
    launch(_gather_kernel(xa.dtype), LaunchConfig((-(-total // 256),), (256,)),
           (out.ptr, xa.ptr, pa.ptr, np.int32(rows), np.int32(k), np.int64(ldx)),
           device=xa.device, stream=A.stream_of(xa))
    return out


# ---------------------------------------------------------------------------------------------------------------
# INT8
# ---------------------------------------------------------------------------------------------------------------

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
    y = _launch_mma(FMT_INT8, xa, rows, k, ldx, pk.ptr if pk is not None else wa.ptr, _row_stride(wa), 0, 0, sa.ptr,
                    0, ba.ptr if ba is not None else 0, n, 0, pk is not None, gemv)
    return y.reshape(out_shape)


# ---------------------------------------------------------------------------------------------------------------
# GPU dequantizers (the dense path; bit-exact with the NumPy references rounded to the scales' dtype)
# ---------------------------------------------------------------------------------------------------------------

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
