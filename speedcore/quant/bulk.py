"""gemv_bulk_kernel (kernels/quant_bulk.cu, sm_90+): gemv_stream_kernel's chunks by cp.async.bulk into per-warp
shared-memory rings, its launch shape (bulk_config), shared-memory budget and dispatch (use_bulk)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .. import _arrays as A
from .._compile import Kernel
from .._launch import LaunchConfig
from .formats import KIND_INT4
from .gemv import GEMV_GROUP_BYTES, GEMV_STEP_K, gemv_block_n
from .stream import _launch_chunks, _packing_warps, use_stream

SOURCE = "quant_bulk.cu"

# gemv_bulk_kernel (sm_90+): the same chunks through cp.async.bulk into per-warp shared-memory rings.
BULK_MAX_WARPS = 16
BULK_X_PITCH = 288          # bytes per staged row of x (256 + 32: conflict-free 8-byte reads)
BULK_SMEM_PER_SM = 233472   # 228 KB per SM (Hopper), 1 KB of it reserved per CTA
BULK_SMEM_PER_CTA = 232448  # 227 KB


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


@lru_cache(maxsize=None)
def _bulk_kernel(dtype: str, kind: int, mt: int, defines: tuple = ()) -> Kernel:
    return Kernel(SOURCE, f"quant::gemv_bulk_kernel<{A.CTYPE[dtype]}, {kind}, {mt}>", options=defines)


# "auto": use_bulk decides; "on": gemv_bulk_kernel on sm_90+ wherever gemv_stream_kernel would run (before it);
# "off": never.  _BULK_OVERRIDE: keyword overrides of bulk_config (warps, splits, stages, order), for measurements.
_BULK_MODE = "auto"
_BULK_OVERRIDE: dict = {}


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


@lru_cache(maxsize=8192)
def _bulk_plan(kind: int, dtype: str, rows: int, n: int, k: int, spg: int, ng: int, sms: int, override: tuple,
               defines: tuple = ()):
    cfg = bulk_config(rows, n, k, kind, sms, **dict(override))
    scalars = (np.int32(rows), np.int32(n), np.int32(cfg.steps), np.int32(spg), np.int32(ng), np.int32(cfg.blocks),
               np.int32(cfg.splits), np.int32(cfg.stages), np.int32(cfg.order))
    return (cfg, _bulk_kernel(dtype, kind, cfg.mt, defines), LaunchConfig((cfg.grid,), (cfg.warps * 32,), cfg.smem),
            scalars)


def _launch_bulk(gl, xa, rows, k, ldx, scales_ptr, bias_ptr, n):
    """y (rows, N) by gemv_bulk_kernel (gemv_stream_kernel's arguments and -D options, _STREAM_DEFINES)."""
    return _launch_chunks(_bulk_plan, _BULK_OVERRIDE, gl, xa, rows, k, ldx, scales_ptr, bias_ptr, n)
