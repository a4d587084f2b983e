"""gemv_stream_kernel (kernels/quant_stream.cu): the small-M (M <= 16) register-streaming kernel on the
fragment-major layout (or, INT4, on w4_wgmma_kernel's wgmma-major copy: a compact layer's only copy), its one-wave
launch shape (stream_config) and dispatch (use_stream)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .. import _arrays as A
from .._compile import Kernel
from .._launch import LaunchConfig, chained, device_info, launch
from .formats import KIND_INT4, KIND_INT8
from ._common import _alloc_out
from .gemv import GEMV_MAX_M, GEMV_STEP_K, _gemv_scratch, gemv_block_n, gemv_supported

SOURCE = "quant_stream.cu"

# The register-streaming small-M kernel (gemv_stream_kernel) on the same layout; must match kernels/quant_stream.cu.
STREAM_CHUNK_K = 128        # k per chunk (4 steps): K and (INT4) G must be multiples of it
STREAM_PREFETCH = 0         # chunks prefetched into L2 ahead of the one being loaded (H200: 1-3 were slower)
STREAM_NBC_CHOICES = (1, 2, 4)  # blocks per CTA of gemv_stream_kernel built (its NBC; > 1 at M > 8 only)
STREAM_INT8_MIN_WARPS = (8, 4)  # INT8: at least this many warps per 32-channel block (M <= 8, M <= 16)
STREAM_SPLIT_COST_CHUNKS = 1.5  # INT4 at M > 8: a K split's cost in chunk loads per warp (stream_config)


def stream_max_warps(kind: int, mt: int) -> int:
    """Warps per CTA of gemv_stream_kernel<T, kind, mt> (its launch bounds, StreamWarps<> in kernels/quant_stream.cu),
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


def chunk_order(order: int, kc: int, wpb: int, gw: int, b: int) -> list:
    """The chunks warp gw of a block's wpb warps streams, in order (mirrors ChunkOrder in
    kernels/common/quant_stream.cuh; for tests): 0 its contiguous run, 1 every wpb-th chunk from gw, 2 its run started
    at a per-warp rotation."""
    if order == 1:
        return list(range(gw, kc, wpb))
    base, end = gw * kc // wpb, (gw + 1) * kc // wpb
    n = end - base
    rot = (7 * b + 3 * gw) % n if (order == 2 and n > 0) else 0
    return [base + (i + rot) % n for i in range(n)]


# Extra -D options for the streaming kernels, for same-run A/B measurements (never set by the library; see
# kernels/common/quant_stream.cuh and kernels/quant_stream.cu): -DSC_QUANT_XSUM_MT2 (INT4 at M > 8 also takes
# magic + zero point off per chunk through sum_k x and scales the chunk's fp32 sums), -DSC_QUANT_PIPELINE_MT2
# (gemv_stream_kernel's register pipeline at M > 8 too), -DSC_QUANT_STREAM_UNPIPELINED (no register pipeline at any
# M: the schedule before it).  gemv_bulk_kernel is built with them too.
_STREAM_DEFINES: tuple = ()


# gemv_stream_kernel's WL: which copy of a layer it reads
WL_FRAGMENT = 0  # the fragment-major copy (_GemvLayer.weight / groups)
WL_WGMMA = 1     # INT4: w4_wgmma_kernel's wgmma-major copy (_GemvLayer.w4_weight / w4_groups)


@lru_cache(maxsize=None)
def _stream_kernel(dtype: str, kind: int, mt: int, defines: tuple = (), nbc: int = 1, wl: int = WL_FRAGMENT) -> Kernel:
    if wl not in (WL_FRAGMENT, WL_WGMMA) or (wl == WL_WGMMA and kind != KIND_INT4):
        raise ValueError(f"gemv_stream_kernel: wl must be {WL_FRAGMENT} or (INT4) {WL_WGMMA}, got {wl}")
    tail = "" if nbc == 1 and wl == WL_FRAGMENT else f", {nbc}" + ("" if wl == WL_FRAGMENT else f", {wl}")
    return Kernel(SOURCE, f"quant::gemv_stream_kernel<{A.CTYPE[dtype]}, {kind}, {mt}{tail}>", options=defines)


def stream_layout(gl) -> int:
    """The copy gemv_stream_kernel reads for fragment-major layer ``gl`` (a _GemvLayer): its fragment-major words
    where it has them, else (a compact INT4 layer) the wgmma-major copy."""
    return WL_FRAGMENT if gl.w_ptr else WL_WGMMA


# "on": gemv_stream_kernel for 1 <= M <= 16 wherever the layer has the fragment-major copy and the shape fits
# (stream_supported), before use_gemv's choice; "off": never.  _STREAM_OVERRIDE: keyword overrides of
# stream_config (warps, splits, prefetch), for measurements.
_STREAM_MODE = "on"
_STREAM_OVERRIDE: dict = {}


def use_stream(kind: int, m: int, n: int, k: int, group: int = 0) -> bool:
    """Dispatch for 1 <= M <= 16 on prepacked layers (a pure function but for the _STREAM_MODE switch):
    gemv_stream_kernel wherever its shape constraints hold (stream_supported), before use_gemv's choice."""
    return _STREAM_MODE == "on" and 1 <= m <= GEMV_MAX_M and stream_supported(kind, k, n, group)


@lru_cache(maxsize=8192)
def _stream_plan(kind: int, dtype: str, rows: int, n: int, k: int, spg: int, ng: int, sms: int, override: tuple,
                 defines: tuple = (), wl: int = WL_FRAGMENT):
    cfg = stream_config(rows, n, k, kind, sms, **dict(override))
    scalars = (np.int32(rows), np.int32(n), np.int32(cfg.steps), np.int32(spg), np.int32(ng), np.int32(cfg.blocks),
               np.int32(cfg.splits), np.int32(cfg.prefetch), np.int32(cfg.order), np.uint32(0))
    return (cfg, _stream_kernel(dtype, kind, cfg.mt, defines, cfg.nbc, wl),
            LaunchConfig((cfg.grid,), (cfg.warps * 32,), cfg.smem), scalars)


def _launch_stream(gl, xa, rows, k, ldx, scales_ptr, bias_ptr, n):
    """y (rows, N) by gemv_stream_kernel."""
    return _launch_chunks(_stream_plan, _STREAM_OVERRIDE, gl, xa, rows, k, ldx, scales_ptr, bias_ptr, n)


def _launch_chunks(plan, override: dict, gl, xa, rows, k, ldx, scales_ptr, bias_ptr, n):
    """gemv_stream_kernel or gemv_bulk_kernel (bulk.py): the same arguments, each with its own plan (``plan``, with
    the keyword overrides ``override``)."""
    y, y_ptr = _alloc_out(xa, rows, n)
    run = _chunks_runner(plan, override, gl, xa, rows, k, ldx, scales_ptr, n)
    run(A.stream_of(xa).ptr, y_ptr, xa.ptr, bias_ptr)
    return y


def _chunks_runner(plan, override: dict, gl, xa, rows, k, ldx, scales_ptr, n):
    """run(stream_ptr, y_ptr, x_ptr, bias_ptr) of _launch_chunks' kernel for x's layout (cached per call signature
    by a prepacked layer: quant.linear._fast_call)."""
    wl = stream_layout(gl)
    layout = () if wl == WL_FRAGMENT else (wl,)  # gemv_bulk_kernel's plan reads the fragment-major copy only
    cfg, kernel, lcfg, scalars = plan(gl.kind, xa.dtype, rows, n, k, gl.spg, gl.ng, device_info(xa.device).sms,
                                      tuple(sorted(override.items())), _STREAM_DEFINES, *layout)
    lcfg = chained(lcfg, xa.device)  # the decode chain's GEMVs (speedcore._launch.set_chained_launches)
    tail = tuple(scalars) + (np.int64(ldx),)
    w_ptr, g_ptr = (gl.w_ptr, gl.g_ptr) if wl == WL_FRAGMENT else (gl.w4_ptr, gl.w4_g_ptr)
    s_ptr = scales_ptr if gl.kind == KIND_INT8 else 0
    splits, floats, blocks, device = cfg.splits, rows * n, cfg.blocks, xa.device
    scratch = A.scratch_ref(xa.lib, xa.device)

    def run(stream_ptr, y_ptr, x_ptr, bias_ptr):
        ws_ptr = tickets_ptr = 0
        if splits > 1:
            ws_ptr, tickets_ptr = _gemv_scratch(scratch, stream_ptr, floats, blocks)
        # the module's launch (not a prepacked one): the tests' fakes and kernel spies replace it
        launch(kernel, lcfg, (y_ptr, ws_ptr, tickets_ptr, x_ptr, w_ptr, g_ptr, s_ptr, bias_ptr) + tail,
               device=device, stream=stream_ptr)

    return run
