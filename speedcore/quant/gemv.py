"""gemv_kernel (kernels/quant_gemv.cu): the small-M (M <= 16) cp.async-ring kernel on the fragment-major layout,
its stream-K launch shape, shared-memory budget and dispatch (use_gemv); the layout's constants."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .. import _arrays as A
from .._compile import Kernel
from .._launch import LaunchConfig, device_info, launch
from .formats import KIND_INT4, KIND_INT8
from ._common import _alloc_out

SOURCE = "quant_gemv.cu"

# The small-M streaming kernel (gemv_kernel) on its fragment-major prepacked layout; must match kernels/quant_gemv.cu.
GEMV_MAX_M = 16             # rows of x it handles (two 8-row mma tiles)
GEMV_WARPS = 8
GEMV_STEP_K = 32            # k per pipeline stage
GEMV_GROUP_BYTES = 192      # INT4 group record per (block, group)
GEMV_CTAS_PER_SM = 2


def gemv_block_n(kind: int) -> int:
    """Output channels per block of the fragment-major layout: 64 (INT4, 4 mma tiles) or 32 (INT8, 2)."""
    return 64 if kind == KIND_INT4 else 32


def gemv_stages(kind: int, mt: int) -> int:
    """cp.async ring depth per warp of gemv_kernel<T, kind, mt> (Gemv<>::D in kernels/quant_gemv.cu)."""
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


@lru_cache(maxsize=None)
def _gemv_kernel(dtype: str, kind: int, mt: int) -> Kernel:
    return Kernel(SOURCE, f"quant::gemv_kernel<{A.CTYPE[dtype]}, {kind}, {mt}>")


# "auto": use_gemv decides; "on": gemv_kernel wherever the layer has its layout (prepack builds it for every
# format); "off": quant_mma_kernel only.  Tests and benchmarks switch it to run both kernels on one layer.
_GEMV_MODE = "auto"


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
