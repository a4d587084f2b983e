"""quant_mma_kernel (kernels/quant_mma.cu): the tile-major tensor-core kernel of every format at M <= 128, its
split-K heuristic, shared-memory budget and tile-major copy (pack_tiles_kernel)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .. import _arrays as A
from .._compile import Kernel
from .._launch import LaunchConfig, device_info, launch
from .formats import FMT_AWQ, FMT_GPTQ, FMT_INT8
from ._common import _alloc_out, _row_stride

SOURCE = "quant_mma.cu"

# Must match kernels/quant_mma.cu.
THREADS = 256
BLOCK_N = 512
STAGES = 4
W_STAGE_BYTES = 16384
MT_CHOICES = (1, 2, 4, 8)   # 8-row tiles of x per CTA: M <= 8, 16, 32, 64 per chunk
MAX_MMA_M = 128             # above this (and where a dense matmul is available) dequantize + cuBLAS
_ITEM = {"float16": 2, "bfloat16": 2}


def _block_k(fmt: int) -> int:
    return 32 if fmt == FMT_INT8 else 64


def _x_stride(fmt: int) -> int:
    return _block_k(fmt) + {FMT_AWQ: 16, FMT_GPTQ: 32, FMT_INT8: 64}[fmt]


def smem_bytes(fmt: int, mt: int) -> int:
    """Dynamic shared memory of quant_mma_kernel<T, fmt, mt> (the layout in kernels/quant_mma.cu)."""
    x_bytes = mt * 8 * _x_stride(fmt) * 2
    s_bytes = 0 if fmt == FMT_INT8 else 2 * BLOCK_N * 2 + 2 * (BLOCK_N // 8) * 4
    return STAGES * (W_STAGE_BYTES + x_bytes + s_bytes)


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


@lru_cache(maxsize=None)
def _mma_kernel(dtype: str, fmt: int, mt: int) -> Kernel:
    return Kernel(SOURCE, f"quant::quant_mma_kernel<{A.CTYPE[dtype]}, {fmt}, {mt}>")


_PACK_KERNELS = {fmt: Kernel(SOURCE, f"quant::pack_tiles_kernel<{fmt}>") for fmt in (FMT_AWQ, FMT_GPTQ, FMT_INT8)}


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


def _launch_mma(fmt, xa, rows, k, ldx, qw_ptr, ldq, qz_ptr, ldz, scales_ptr, lds, bias_ptr, n, group, packed: bool):
    """Allocate y (rows, N) and run quant_mma_kernel on the stored weight or (``packed``) its tile-major copy;
    returns y (the caller's library)."""
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
