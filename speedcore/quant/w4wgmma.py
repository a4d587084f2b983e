"""w4_wgmma_kernel (kernels/quant_sm90.cu, sm_90a): the INT4 / INT8 GEMM on wgmma with the dequantized weights as
the register A operand, its tile shape and split heuristic (w4wgmma_shape, w4wgmma_config), shared-memory budget,
dispatch (use_w4wgmma, use_w8wgmma) and wgmma-major copies."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .. import _arrays as A
from .._compile import Kernel
from .._launch import LaunchConfig, MAX_CLUSTER, device_info, get_kernel, launch
from .formats import FMT_AWQ, FMT_GPTQ, KIND_INT4, KIND_INT8
from ._common import _alloc_out, _env_switch, _row_stride
from .gemv import GEMV_GROUP_BYTES, GEMV_MAX_M, GEMV_STEP_K
from .stream import stream_supported

SOURCE = "quant_sm90.cu"

# w4_wgmma_kernel (sm_90a, kernels/quant_sm90.cu): INT4 GEMM on wgmma with A from registers; must match it.
W4WGMMA_SOURCE = SOURCE
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
# the M sweep of benchmarks/probes/quant_w4_msweep.py at b482bb8 (three producer warps), where the consumers' wgmma
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


# w4_wgmma_kernel (sm_90a) for prepacked INT4 layers at M in W4WGMMA_M_RANGE where the shape fits
# (w4wgmma_supported), before every other choice, including the dense path above MAX_MMA_M.  "off" by default until
# measured on the GPU; SPEEDCORE_QUANT_W4WGMMA=1 (read at import) turns it on.  It must be on when the layer is
# prepacked (prepack then also builds the wgmma-major copy, the weight's size again).  _W4WGMMA_OVERRIDE: keyword
# overrides of w4wgmma_config (splits, mt, blk, gs), for measurements (benchmarks/probes/quant_w4wgmma_probe.py).
_W4WGMMA_MODE = _env_switch("SPEEDCORE_QUANT_W4WGMMA")
# "auto" takes w4_wgmma_kernel where it measured ahead of every other path (H200, same-process probe
# benchmarks/probes/quant_w4wgmma_probe.py, us, w4wgmma / previous dispatch / cuBLAS, bf16): 8192 x 8192 M = 17
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
    """Whether this call of a layer with fragment-major copy ``gl`` takes w4_wgmma_kernel (INT4, or INT8).  A
    compact layer (the wgmma-major copy only, no fragment-major words: prepack's ``copies="compact"``) takes it at
    every M above GEMV_MAX_M, whatever the switches say (nothing else reads that copy there), and where use_w4wgmma
    says so below (gemv_stream_kernel's wgmma-major variant takes the rest)."""
    if gl is None or gl.w4_ptr == 0:
        return False
    if gl.kind == KIND_INT8:
        return use_w8wgmma(rows, n, k, device_info(xa.device).cc)
    if gl.dtype != xa.dtype:
        return False
    if not gl.w_ptr and rows > GEMV_MAX_M:
        return True
    return use_w4wgmma(rows, n, k, gl.spg * GEMV_STEP_K, device_info(xa.device).cc)


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
    from .. import _tma

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
