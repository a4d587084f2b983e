"""quant_marlin_kernel (kernels/quant_marlin.cu): the INT4 tensor-core kernel for 17 <= M <= 128 on the
fragment-major layout, its stream-K grid (marlin_config), shared-memory budget and dispatch (use_marlin)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .. import _arrays as A
from .._compile import Kernel
from .._launch import LaunchConfig, device_info, launch
from .formats import KIND_INT4
from ._common import _alloc_out, _env_switch
from .gemv import GEMV_GROUP_BYTES, GEMV_STEP_K
from .stream import STREAM_CHUNK_K, stream_supported
from .bulk import BULK_SMEM_PER_CTA

SOURCE = "quant_marlin.cu"

# quant_marlin_kernel (17 <= M <= 128, INT4 on the fragment-major layout); must match kernels/quant_marlin.cu.
MARLIN_BLOCKS = 4           # 64-channel blocks per CTA (256 channels), one per warp column
MARLIN_WARPS = 8            # MARLIN_BLOCKS x 2 halves of each 128-k chunk
MARLIN_X_PITCH = 288        # bytes per staged row of x (128 k + 32: conflict-free 8-byte reads)
MARLIN_MT_CHOICES = (4, 8)  # 8-row x tiles per CTA: M <= 32, M <= 64 per m-chunk


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


# Extra -D options for quant_marlin_kernel, for same-run A/B measurements (never set by the library).
_MARLIN_DEFINES: tuple = ()


@lru_cache(maxsize=None)
def _marlin_kernel(dtype: str, mt: int, defines: tuple = ()) -> Kernel:
    return Kernel(SOURCE, f"quant::quant_marlin_kernel<{A.CTYPE[dtype]}, {mt}>", options=defines)


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
    (benchmarks/probes/quant_marlin_probe.py at 677bebe: 35.6 against 37.4 us at M = 17; elsewhere in 17-128 it was
    ahead by 0-7%, or behind by 1.4% at bf16 M = 128 on 28672 x 8192)."""
    lo, hi = _MARLIN_M_RANGE
    if _MARLIN_MODE == "off" or not (max(lo, 1) <= m <= hi and marlin_supported(k, n, group)):
        return False
    return _MARLIN_MODE == "on" or m >= 32 or n * k > 8192 * 8192


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
