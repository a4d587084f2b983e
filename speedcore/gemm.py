"""Tensor Core GEMM with a fused bias + activation epilogue (kernels/gemm.cu, kernels/gemm_sm90.cu).

Three paths, picked by :func:`gemm_path`, a pure function of the problem and the device:

* ``"hopper"`` (sm_90): TMA loads into a multi-stage shared-memory ring guarded by mbarriers, wgmma by two
  consumer warpgroups, one producer warpgroup, register reallocation, a persistent tile scheduler; the
  epilogue goes out through a swizzled staging buffer by asynchronous TMA stores, so the next tile's wgmmas
  start while the last tile's writes drain.  B may be K-major (a Linear weight (N, K)) or N-major (a row-major
  (K, N) matrix, read transposed by wgmma).  Where decode-sized M leaves SMs without a tile, the tiles' K is split
  (:func:`wgmma_splits`; fp32 partials summed in split order by each tile's last unit, deterministic).
* ``"ampere"`` (sm_80+): mma.sync + ldmatrix from a cp.async ring of swizzled tiles, 64 x 64 warp tiles whose
  fragments are double-buffered in registers (gemm_mma_tile_kernel).
* ``"skinny"`` (decode: M <= 64, or M <= 32 on sm_90): an mma.sync kernel with narrow N tiles, deep K tiles and
  warps splitting K (gemm_mma_kernel), so the weight streams once at HBM bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from . import _arrays as A
from . import _torch_hook
from ._arrays import sig
from ._compile import Kernel
from ._launch import LaunchConfig, bind, chained, device_info, plan_cache

SOURCE = "gemm.cu"
SOURCE_SM90 = "gemm_sm90.cu"
ACTIVATIONS = {None: 0, "silu": 1, "gelu": 2, "gelu_tanh": 3, "relu": 4}
PATHS = ("hopper", "ampere", "skinny")
SKINNY_MAX_M = 64      # the skinny kernel's range without wgmma (sm_80, sm_86, sm_89)
SKINNY_MAX_M_HOPPER = 32
# M in (32, 64] on the H200 goes to the wgmma kernel's 64-row tiles (see wgmma_config): same-run A/B at fc2acbb
# (benchmarks/_gemm_ab.py small, bf16, M = 64, ratio to cuBLAS) 8192^2 0.98 against the skinny kernel's 0.76,
# 14336 x 4096 1.00 against 0.65, 28672 x 8192 1.01 against 0.62, 4096^2 0.84 against 0.81, 4096 x 14336 0.83
# against 0.83.  At M = 32 the skinny kernel stayed ahead for N <= 8192 (1.02 / 0.96 against 0.80 / 0.77).
GROUP_M = 8


@dataclass(frozen=True)
class MmaConfig:
    """CTA tile (bm, bn, bk), warps along M, N and K, pipeline stages of the mma.sync kernel."""
    bm: int
    bn: int
    bk: int
    wm: int
    wn: int
    wk: int
    stages: int

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn * self.wk

    @property
    def smem(self) -> int:
        ring = self.stages * (self.bm + self.bn) * self.bk * 2
        reduce = (self.wk - 1) * self.bm * self.bn * 4
        return max(ring, reduce)


# Large tiles for big problems (gemm_mma_tile_kernel: 64 x 64 warp tiles with double-buffered fragments), a
# 128 x 128 tile with 64 x 32 warp tiles and a 64-row tile for M in the low hundreds.  Same-run H200 A/Bs (forced
# Ampere path, 8192^3 bf16, two calls; cuBLAS itself moved 704-799 TFLOP/s between rows): linear 256 x 128
# 406-418 TFLOP/s with 3 or 4 stages, 128 x 256 400-409; matmul (N-major B) 128 x 256 / 3 stages 422-431 against
# 388-398 for 256 x 128; 128 x 128 / 6 stages 326-367.  Three stages (144 KB) also fit an A100; tiles whose ring
# does not fit the SM (sm_86 / sm_89: 100 KB) are skipped.  The old kernel (no fragment double buffering, index
# math per load) reached 272-309.  With the cp.asyncs interleaved into the mma.syncs (67ecf92) 128 x 256 leads
# for both B layouts (mma_config); ties go to the earlier tile.
MMA_LARGE = (MmaConfig(128, 256, 64, 2, 4, 1, 3), MmaConfig(256, 128, 64, 4, 2, 1, 3),
             MmaConfig(128, 128, 64, 2, 4, 1, 4), MmaConfig(64, 128, 64, 2, 2, 1, 4))
# Skinny: one row tile covers all of M; 32 columns per CTA so that N = 4096 already gives ~one CTA per SM;
# 8 warps split each stage's K slice.
MMA_SKINNY = {16: MmaConfig(16, 32, 256, 1, 1, 8, 4), 32: MmaConfig(32, 32, 256, 1, 1, 8, 4),
              64: MmaConfig(64, 32, 128, 1, 1, 8, 4)}
# For M > 16 every CTA re-reads its x tile from L2: with 32 columns that is 1-2x the weight bytes (measured on
# the H200: M = 64, N = 28672 streamed at 1.9 TB/s against 4.0 TB/s for M = 16).  When N is wide enough to
# give every SM a CTA with 64 columns, these halve that traffic.
MMA_SKINNY_WIDE = {32: MmaConfig(32, 64, 128, 1, 2, 4, 4), 64: MmaConfig(64, 64, 128, 1, 2, 4, 4)}
# M <= 16 with at most one CTA per SM (N <= 32 x SMs): nothing else hides a CTA's load latency, so a deeper
# ring of shallower k-tiles (7 in flight).  H200, 16 x 4096 x 4096: 2.52 TB/s against 2.39 (M = 1: 2.53 / 2.39).
MMA_SKINNY_DEEP = MmaConfig(16, 32, 128, 1, 1, 8, 8)
# M <= 16 with an N-major B (matmul): a 32-column tile reads 64-byte pieces of each B row; 64 columns read whole
# 128-byte lines.  H200, matmul 16 x 14336 x 4096: 3.55 TB/s (0.97x cuBLAS) against 3.03 (0.83x).
MMA_SKINNY_NMAJOR = MmaConfig(16, 64, 128, 1, 2, 4, 8)
_MMA_EFFICIENCY = {MMA_LARGE[0]: 1.0, MMA_LARGE[1]: 1.0, MMA_LARGE[2]: 0.85, MMA_LARGE[3]: 0.75}
# Deeper rings of the same tiles where shared memory allows (H100/H200: 227 KB per block).
MMA_DEEP = {MMA_LARGE[2]: MmaConfig(128, 128, 64, 2, 4, 1, 6)}


@dataclass(frozen=True)
class WgmmaConfig:
    """Hopper kernel: CTA tile bm x bn (bk = 64, one 128-byte swizzle row), ring stages.  bm = 64 tiles split
    their columns between the two consumer warpgroups, larger ones their rows."""
    bm: int
    bn: int
    stages: int

    bk = 64
    threads = 384  # one producer + two consumer warpgroups

    @property
    def wg_n(self) -> int:
        return self.bn // 2 if self.bm == 64 else self.bn

    @property
    def store_box_cols(self) -> int:
        """Columns of the epilogue's TMA store box (64 rows high); its rows are swizzled at their width."""
        return 64 if self.wg_n % 64 == 0 else (32 if self.wg_n % 32 == 0 else 16)

    @property
    def staging(self) -> int:
        """Bytes of one consumer's epilogue staging buffer (kernels/gemm_sm90.cu: EPI_BYTES)."""
        wg_m = 64 if self.bm == 64 else self.bm // 2
        return min(wg_m * self.wg_n * 2, _WGMMA_STAGING_MAX)

    @property
    def smem(self) -> int:
        # ring + two staging buffers + one mbarrier pair per stage + the split-K flag (the kernel aligns the ring
        # to 1024 bytes)
        return self.stages * (self.bm + self.bn) * self.bk * 2 + 2 * self.staging + 1024 + 16 * self.stages + 16


_WGMMA_STAGING_MAX = 16384
# Tiles the heuristic picks from, with their relative Tensor Core efficiency (a guess from the instruction
# shapes: per-warpgroup m64n256 keeps shared-memory reads per FLOP lowest; narrower wgmmas read A again for
# fewer columns).  Tiles marked K-major only need B (k, n) = weight[n, k]: an N-major B is read in 64-column
# blocks.
WGMMA_TILE_EFFICIENCY = {(128, 256): 1.0, (256, 128): 1.0, (128, 224): 0.97, (128, 128): 0.9, (128, 64): 0.75}
WGMMA_TILES = tuple(WGMMA_TILE_EFFICIENCY)
# 64-row tiles (the consumers split N) for decode-sized M, where the problem is bound by bytes per SM rather than
# by the Tensor Cores: what counts is how many SMs stream the weight.  Measured (same A/B as above, M = 128):
# 4096^2 0.92 (64 x 64) against 0.87 (default then), 8192^2 0.99 (64 x 128) against 0.95, 4096 x 14336 0.82
# (64 x 64) against 0.74; with two 64-row blocks and N >= 14336 the 128-row tiles stayed ahead (128 x 224 at
# 1.11 for 28672 x 8192).
WGMMA_DECODE_TILES = ((64, 128), (64, 64), (64, 32))
# Two 64-row blocks on few weight tiles with long K: 128 x 64 tiles with split-K instead of 64 x 64 (H200, same
# run, benchmarks/_gemm_rows128_ab.py, ratio to cuBLAS, bf16 / fp16, 3 rounds: 128x4096x14336 0.815 / 0.799 ->
# 0.938 / 0.947, 128x4096x11008 0.856 / 0.833 -> 0.956 / 0.951, 96x4096x14336 0.774 / 0.723 -> 0.805 / 0.804;
# 128x4096x4096 lost: 0.901 -> 0.834).
WGMMA_ROWS128_MIN_K = 8192
WGMMA_KMAJOR_ONLY = frozenset({(128, 224), (64, 64), (64, 32)})
WGMMA_MAX_STAGES = 12


def wgmma_tiles(b_kmajor: bool, decode: bool = False) -> tuple:
    """The heuristic's candidate tiles for a B layout (with ``decode``, the 64-row tiles instead)."""
    tiles = WGMMA_DECODE_TILES if decode else WGMMA_TILES
    return tuple(t for t in tiles if b_kmajor or t not in WGMMA_KMAJOR_ONLY)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@lru_cache(maxsize=4096)
def gemm_path(m: int, n: int, k: int, dtype: str, cc: tuple, b_kmajor: bool) -> str:
    """Which kernel serves an (m, n, k) problem: "skinny", "hopper" or "ampere" (see the module docstring)."""
    hopper = tuple(cc) == (9, 0)
    if m <= (SKINNY_MAX_M_HOPPER if hopper else SKINNY_MAX_M):
        return "skinny"
    return "hopper" if hopper else "ampere"


@lru_cache(maxsize=4096)
def mma_config(m: int, n: int, k: int, sms: int, smem_per_sm: int, skinny: bool, b_kmajor: bool = True) -> MmaConfig:
    """The mma.sync tile: for skinny M the smallest row tile covering M; otherwise the tile that minimizes
    (waves x tile area / efficiency), where a wave is one CTA on every SM (or two, when two fit), among the tiles
    whose ring fits the SM's shared memory."""
    if skinny:
        bm = next((b for b in MMA_SKINNY if m <= b), 64)
        if bm == 16:
            if not b_kmajor and _ceil(n, 64) >= 0.9 * sms and MMA_SKINNY_NMAJOR.smem + 1024 <= smem_per_sm:
                return MMA_SKINNY_NMAJOR
            if _ceil(n, 32) <= sms:
                return MMA_SKINNY_DEEP
        if bm in MMA_SKINNY_WIDE and _ceil(n, 64) >= 0.9 * sms:
            return MMA_SKINNY_WIDE[bm]
        return MMA_SKINNY[bm]
    # ties go to the earlier tile: 128 x 256 (H200, forced Ampere path at 8192^3, benchmarks/_gemm_ab.py
    # ampere_cfgs, two rounds: K-major B 0.567 / 0.574x cuBLAS against 0.553 / 0.532 for 256 x 128, N-major
    # 0.685 / 0.687 against 0.585 / 0.529)
    fits = [c for c in MMA_LARGE if c.smem + 1024 <= smem_per_sm] or [MMA_LARGE[-1]]
    best, best_cost = None, None
    for cfg in fits:
        per_sm = max(1, min(2, smem_per_sm // (cfg.smem + 1024)))
        tiles = _ceil(m, cfg.bm) * _ceil(n, cfg.bn)
        # a wave runs per_sm CTAs on each SM, sharing its Tensor Cores
        cost = _ceil(tiles, sms * per_sm) * per_sm * cfg.bm * cfg.bn / _MMA_EFFICIENCY[cfg]
        if best_cost is None or cost < best_cost:
            best, best_cost = cfg, cost
    deep = MMA_DEEP.get(best)
    if deep is not None and deep.smem + 1024 <= smem_per_sm - 1024:
        return deep
    return best


@lru_cache(maxsize=4096)
def wgmma_config(m: int, n: int, k: int, sms: int, smem_per_block: int, b_kmajor: bool = True) -> WgmmaConfig:
    """DeepGEMM-style pure heuristic: the tile with the least time on ``sms`` SMs, counted as waves (a wave: one
    tile on every SM of the persistent grid) x tile area / tile efficiency, so padding and a partial last
    wave both count; ties go to the earlier (larger) tile.  Then as many stages as shared memory holds.

    Decode-sized M (one 64-row block, or two when 64 x 128 tiles still make at most ~1.25 waves) takes 64-row
    tiles instead: 64 x 128 where that gives at least ~3/4 of a wave, else 64 x 64 (K-major B only), or with
    two row blocks and K >= WGMMA_ROWS128_MIN_K 128 x 64 tiles split along K."""
    row_blocks = _ceil(m, 64)
    tiles_128 = row_blocks * _ceil(n, 128)
    if row_blocks == 1 or (row_blocks == 2 and tiles_128 <= 1.25 * sms):
        bn = 128 if tiles_128 >= 0.75 * sms or not b_kmajor else 64
        if row_blocks == 2 and bn == 64 and k >= WGMMA_ROWS128_MIN_K:
            # one 128-row tile reads each weight tile once, split-K (wgmma_splits) refills the SMs
            return WgmmaConfig(128, 64, _wgmma_stages(128, 64, smem_per_block))
        return WgmmaConfig(64, bn, _wgmma_stages(64, bn, smem_per_block))
    best, best_cost = None, None
    for bm, bn in wgmma_tiles(b_kmajor):
        tiles = _ceil(m, bm) * _ceil(n, bn)
        cost = _ceil(tiles, sms) * bm * bn / WGMMA_TILE_EFFICIENCY[(bm, bn)]
        if best_cost is None or cost < best_cost * (1 - 1e-9):
            best, best_cost = (bm, bn), cost
    return WgmmaConfig(best[0], best[1], _wgmma_stages(best[0], best[1], smem_per_block))


WGMMA_MAX_SPLITS = 16
WGMMA_MIN_SPLIT_BLOCKS = 4  # 64-k blocks per split at least (the ring's fill and the partials' cost)


def wgmma_splits(m: int, n: int, k: int, cfg: WgmmaConfig, sms: int) -> int:
    """K splits of the Hopper kernel (pure): 1 where the tiles give at least ~3/4 of a wave, else as many as fill
    one wave of ``sms`` units, at least WGMMA_MIN_SPLIT_BLOCKS k blocks each.  (64 x 4096 x 14336 runs 64 tiles of
    64 x 64: without splits half the H200's SMs idled, 0.80x cuBLAS.)"""
    tiles = _ceil(m, cfg.bm) * _ceil(n, cfg.bn)
    if tiles >= 0.75 * sms:
        return 1
    return max(1, min(sms // tiles, _ceil(k, cfg.bk) // WGMMA_MIN_SPLIT_BLOCKS, WGMMA_MAX_SPLITS))


def _wgmma_stages(bm: int, bn: int, smem_per_block: int) -> int:
    stages = WGMMA_MAX_STAGES
    while stages > 2 and WgmmaConfig(bm, bn, stages).smem > smem_per_block:
        stages -= 1
    return stages


# The epilogues pass a generic lambda to sc::with_activation; NVRTC 13.0 treats an unannotated lambda in
# device code as a host function unless -default-device is given (13.5 does not need it).
_OPTIONS = ("-default-device",)


@lru_cache(maxsize=None)
def _mma_kernel(dtype: str, cfg: MmaConfig, b_kmajor: bool, early_b: bool = False) -> Kernel:
    """The variant for ``cfg``; ``early_b`` (skinny tiles only): its first B stages are loaded before the chain's
    dependency wait (kernels/gemm.cu EARLY_B: for a weight B, never for one the previous kernel may write)."""
    kmajor = 'true' if b_kmajor else 'false'
    if cfg.wk == 1:  # large tiles: the fragment-double-buffered kernel (BK = 64)
        assert cfg.bk == 64 and not early_b, cfg
        return Kernel(SOURCE, f"gemm_mma_tile_kernel<{A.CTYPE[dtype]}, {cfg.bm}, {cfg.bn}, {cfg.wm}, {cfg.wn}, "
                              f"{cfg.stages}, {kmajor}>", _OPTIONS)
    return Kernel(SOURCE, f"gemm_mma_kernel<{A.CTYPE[dtype]}, {cfg.bm}, {cfg.bn}, {cfg.bk}, {cfg.wm}, {cfg.wn}, "
                          f"{cfg.wk}, {cfg.stages}, {kmajor}{', true' if early_b else ''}>", _OPTIONS)


@lru_cache(maxsize=None)
def _wgmma_kernel(dtype: str, cfg: WgmmaConfig, b_kmajor: bool) -> Kernel:
    return Kernel(SOURCE_SM90, f"gemm_wgmma_kernel<{A.CTYPE[dtype]}, {cfg.bm}, {cfg.bn}, {cfg.stages}, "
                               f"{'true' if b_kmajor else 'false'}>", _OPTIONS, hopper=True)


# H100/H200: 227 KB of shared memory per block; the stage counts the heuristic can pick there.
_SM90_SMEM = 232448


def all_kernels() -> list:
    """Every variant :func:`matmul` and :func:`linear` can launch."""
    out = []
    for dtype in A.HALF_DTYPES:
        for kmajor in (True, False):
            for cfg in (MMA_LARGE + tuple(MMA_DEEP.values()) + tuple(MMA_SKINNY.values())
                        + tuple(MMA_SKINNY_WIDE.values()) + (MMA_SKINNY_DEEP, MMA_SKINNY_NMAJOR)):
                out.append(_mma_kernel(dtype, cfg, kmajor))
                if cfg.wk > 1:  # linear()'s chained decode GEMMs (weights as B)
                    out.append(_mma_kernel(dtype, cfg, kmajor, early_b=True))
        for kmajor in (True, False):
            for bm, bn in wgmma_tiles(kmajor) + wgmma_tiles(kmajor, decode=True):
                out.append(_wgmma_kernel(dtype, WgmmaConfig(bm, bn, _wgmma_stages(bm, bn, _SM90_SMEM)), kmajor))
    return out


# ---------------------------------------------------------------------------------------------------------
def _check_rows_operand(x: A.Array, what: str) -> tuple:
    """(rows, row_stride) of a (..., K) operand whose last dim is contiguous."""
    return x.rows()


def _gemm(aa: A.Array, m: int, k: int, lda: int, ba: A.Array, n: int, ldb: int, b_kmajor: bool, bias,
          activation, oa: A.Array, ldo: int, path: str | None, b_weight: bool = False):
    """Validate one GEMM and return its launch, ``run(stream_ptr, a_ptr, b_ptr, bias_ptr, out_ptr)``, which
    depends on the operands' layouts only (None when M = 0: nothing to launch).  ``b_weight``: B is a weight
    (linear()), which no kernel of a decode chain writes, so a chained skinny launch may load it before its wait."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of None, 'silu', 'gelu', 'gelu_tanh', 'relu', got "
                         f"{activation!r}")
    if k % 8 or n % 8:
        raise ValueError(f"K and N must be multiples of 8 (16-byte rows), got K={k}, N={n}")
    if k == 0:
        raise ValueError("K must be at least 8, got 0")
    for arr, ld, what in ((aa, lda, "row stride"), (ba, ldb, "leading stride"), (oa, ldo, "row stride")):
        if not arr.aligned(16) or (ld * arr.itemsize) % 16:
            raise ValueError(f"{arr.name}: needs a 16-byte aligned data pointer and a {what} that is a multiple of "
                             f"8 elements (got pointer offset {arr.ptr % 16} bytes, {what} {ld})")
    if bias is not None and not bias.aligned(16):
        raise ValueError(f"{bias.name}: needs a 16-byte aligned data pointer")
    if path is not None and path not in PATHS:
        raise ValueError(f"_path: expected one of {PATHS}, got {path!r}")
    if m == 0:
        return None
    dev = device_info(aa.device)
    if path is None:
        path = gemm_path(m, n, k, aa.dtype, dev.cc, b_kmajor)
    if path == "hopper" and dev.cc != (9, 0):
        raise ValueError("_path='hopper' needs an sm_90 GPU (H100/H200)")
    if path == "ampere" and max(lda, ldb) >= _AMPERE_MAX_LD:
        # gemm_mma_tile_kernel keeps a tile's row offsets (up to 256 rows x the stride) in 32 bits
        raise ValueError(f"the mma.sync path needs row strides below {_AMPERE_MAX_LD} elements, got lda={lda}, "
                         f"ldb={ldb}")
    act = _ACT_ARG[activation]
    cfg, kernel, lcfg, sizes = _plan(path, aa.dtype, m, n, k, b_kmajor, dev.sms, dev.smem_per_sm,
                                     dev.smem_per_block_optin, b_weight and path == "skinny")
    # decode-sized GEMMs chain onto the previous kernel (speedcore._launch.chained)
    bl = bind(kernel, chained(lcfg, aa.device) if path == "skinny" else lcfg, aa.device)
    if path != "hopper":
        pl = bl.prepacked((int, int, int, int), sizes + (np.int64(lda), np.int64(ldb), np.int64(ldo), act,
                                                         _GROUP_ARG))

        def run(stream_ptr, a_ptr, b_ptr, bias_ptr, o_ptr):
            pl(stream_ptr, o_ptr, a_ptr, b_ptr, bias_ptr)

        return run
    from . import _tma

    dtype = aa.dtype
    # the TMA maps of one call, as _tma.tile_map_2d builds them (cached by pointer: decode loops reuse buffers)
    a_map = ((k, m), (lda,), (64, cfg.bm), _tma.SWIZZLE_128B)
    b_map = ((k, n), (ldb,), (64, cfg.bn), _tma.SWIZZLE_128B) if b_kmajor else ((n, k), (ldb,), (64, 64),
                                                                               _tma.SWIZZLE_128B)
    box = cfg.store_box_cols
    o_map = ((n, m), (ldo,), (box, 64), _STORE_SWIZZLE[box])
    for ptr_, (dims, strides, boxd, _) in ((aa.ptr, a_map), (ba.ptr, b_map), (oa.ptr, o_map)):
        _tma.check_nd(ptr_, dtype, dims, strides, boxd)
    splits, tiles = sizes[3:]
    scratch = A.scratch_ref(aa.lib, aa.device)
    fl = bl.fixed((bytes, bytes, bytes, int, np.int32, np.int32, np.int32, np.int32, np.int32, int, int, np.int32))
    mid = sizes[:3] + (act, _GROUP_ARG)
    last = np.int32(splits)
    tile_map = _tma._tile_map_bytes

    def run(stream_ptr, a_ptr, b_ptr, bias_ptr, o_ptr):
        ws_ptr = tickets_ptr = 0
        if splits > 1:
            ws_ptr, tickets_ptr = A.split_k_scratch(scratch, stream_ptr, splits * m * n * 4, tiles)
        fl(stream_ptr, (tile_map(a_ptr, dtype, *a_map), tile_map(b_ptr, dtype, *b_map), tile_map(o_ptr, dtype, *o_map),
                        bias_ptr) + mid + (ws_ptr, tickets_ptr, last))

    return run


_ACT_ARG = {name: np.int32(code) for name, code in ACTIVATIONS.items()}
_AMPERE_MAX_LD = 1 << 23
_GROUP_ARG = np.int32(GROUP_M)
# CUtensorMapSwizzle for the epilogue's store box width (columns): rows of 128, 64 or 32 bytes.
_STORE_SWIZZLE = {64: 3, 32: 2, 16: 1}


@lru_cache(maxsize=8192)
def _plan(path: str, dtype: str, m: int, n: int, k: int, b_kmajor: bool, sms: int, smem_per_sm: int,
          smem_per_block: int, early_b: bool = False) -> tuple:
    """What a launch needs that depends only on the problem and the device: the tile config, the variant, the
    launch configuration and the size arguments (cached: the host time of a call matters for decode shapes)."""
    sizes = (np.int32(m), np.int32(n), np.int32(k))
    if path == "hopper":
        cfg = wgmma_config(m, n, k, sms, smem_per_block, b_kmajor)
        splits = wgmma_splits(m, n, k, cfg, sms)
        tiles = _ceil(m, cfg.bm) * _ceil(n, cfg.bn)
        grid = min(tiles * splits, sms)  # persistent: at most one CTA per SM
        return (cfg, _wgmma_kernel(dtype, cfg, b_kmajor), LaunchConfig((grid,), (cfg.threads,), cfg.smem),
                sizes + (splits, tiles))
    cfg = mma_config(m, n, k, sms, smem_per_sm, path == "skinny", b_kmajor)
    grid = _ceil(m, cfg.bm) * _ceil(n, cfg.bn)
    kernel = _mma_kernel(dtype, cfg, b_kmajor, early_b and cfg.wk > 1)
    return cfg, kernel, LaunchConfig((grid,), (cfg.threads,), cfg.smem), sizes


def _out(out, ref: A.Array, shape: tuple, inputs) -> A.Array:
    if out is None:
        return A.empty(ref, shape, ref.dtype)
    oa = A.wrap(out, "out")
    A.check_same_dtype(ref, oa)
    A.check_same_device(ref, oa)
    A.check_shape(oa, shape)
    for i in inputs:
        if i is not None and i.numel and oa.numel:
            lo, hi = oa.ptr, oa.ptr + A.extent(oa)
            ilo, ihi = i.ptr, i.ptr + A.extent(i)
            if ilo < hi and lo < ihi:
                raise ValueError(f"out: overlaps {i.name} in memory")
    return oa


def matmul(a, b, *, out=None, _path=None):
    """``a @ b`` on Tensor Cores with fp32 accumulation.

    Parameters
    ----------
    a : torch.Tensor or cupy.ndarray, shape (M, K), float16 or bfloat16, on a CUDA device.  Any M >= 0;
        the last dimension contiguous, 16-byte aligned rows (row stride a multiple of 8 elements).
    b : same library and dtype, shape (K, N); either row-major (stride (ldb, 1)) or a transposed view of a
        row-major (N, K) matrix (stride (1, ldb)), with ldb a multiple of 8.  K and N multiples of 8.
    out : optional (M, N) array of the same dtype, row-major rows; written and returned.

    Returns
    -------
    (M, N) array in the input dtype, of the input's library, on the caller's current stream.
    """
    if _torch_hook.compiling():
        return _torch_hook.op("matmul")(a, b, out=out)
    plan = _MATMUL_PLANS.get((sig(a), sig(b), None if out is None else sig(out), _path))
    if plan is not None:
        result = plan(a, b, None, out)
        if result is not None:
            return result
    return _matmul_checked(a, b, out, _path)


# (a, b, out signatures, _path) -> the validated launch; see _arrays.sig
_MATMUL_PLANS: dict = plan_cache()


def _matmul_checked(a, b, out, _path):
    aa = A.wrap(a, "a")
    ba = A.wrap(b, "b")
    A.check_dtype(aa, A.HALF_DTYPES)
    A.check_same_dtype(aa, ba)
    A.check_same_device(aa, ba)
    if aa.ndim != 2 or ba.ndim != 2:
        raise ValueError(f"a and b: expected 2-D arrays, got shapes {aa.shape} and {ba.shape}")
    m, k = aa.shape
    if ba.shape[0] != k:
        raise ValueError(f"b: expected {k} rows to match a's shape {aa.shape}, got shape {ba.shape}")
    n = ba.shape[1]
    if k > 1 and aa.strides[1] != 1:
        raise ValueError(f"a: the last dimension must be contiguous, got strides {aa.strides}")
    if n == 1 or ba.strides[1] == 1:
        b_kmajor, ldb = False, ba.strides[0]
    elif ba.strides[0] == 1:
        b_kmajor, ldb = True, ba.strides[1]
    else:
        raise ValueError(f"b: one of its dimensions must be contiguous, got strides {ba.strides}")
    oa = _out(out, aa, (m, n), (aa, ba))
    ldo = oa.strides[0] if m > 1 else n
    if n > 1 and oa.strides[1] != 1:
        raise ValueError(f"out: the last dimension must be contiguous, got strides {oa.strides}")
    lda = aa.strides[0] if m > 1 else k
    run = _gemm(aa, m, k, lda, ba, n, ldb, b_kmajor, None, None, oa, ldo, _path)
    if run is None:
        return oa.obj  # M = 0: not cached, nothing to launch
    run(A.stream_of(aa).ptr, aa.ptr, ba.ptr, 0, oa.ptr)
    key = (sig(a), sig(b), sig(out), _path)
    if A.cacheable(key):
        if len(_MATMUL_PLANS) >= _MAX_PLANS:
            _MATMUL_PLANS.clear()
        _MATMUL_PLANS[key] = _cached_plan(run, (m, n), aa, ba, None, oa if out is not None else None)
    return oa.obj


def linear(x, weight, bias=None, *, activation=None, out=None, _path=None):
    """``activation(x @ weight.T + bias)`` as ``torch.nn.functional.linear`` followed by the activation,
    with the bias and the activation fused into the GEMM's epilogue.

    Parameters
    ----------
    x : torch.Tensor or cupy.ndarray, shape (..., K), float16 or bfloat16, on a CUDA device.  The last
        dimension contiguous; the leading ones must collapse to one row stride (a multiple of 8 elements).
    weight : same library and dtype, shape (N, K), last dimension contiguous, row stride a multiple of 8.
        K and N multiples of 8.
    bias : optional, shape (N,), contiguous, same dtype.
    activation : None, "silu", "gelu" (erf), "gelu_tanh" or "relu"; applied in fp32 after the bias.
    out : optional, shape (..., N), same dtype; written and returned.

    Returns
    -------
    (..., N) array in the input dtype, of the input's library, on the caller's current stream.  Inputs must
    be 16-byte aligned.
    """
    if _torch_hook.compiling():
        return _torch_hook.op("linear")(x, weight, bias, activation=activation, out=out)
    try:
        plan = _LINEAR_PLANS.get((sig(x), sig(weight), None if bias is None else sig(bias),
                                  None if out is None else sig(out), activation, _path))
    except TypeError:  # an unhashable activation: the full check names it
        plan = None
    if plan is not None:
        result = plan(x, weight, bias, out)
        if result is not None:
            return result
    return _linear_checked(x, weight, bias, activation, out, _path)


# (x, weight, bias, out signatures, activation, _path) -> the validated launch; see _arrays.sig
_LINEAR_PLANS: dict = plan_cache()
_MAX_PLANS = 1024


def _linear_checked(x, weight, bias, activation, out, _path):
    xa = A.wrap(x, "x")
    wa = A.wrap(weight, "weight")
    ba = A.wrap(bias, "bias", optional=True)
    A.check_dtype(xa, A.HALF_DTYPES)
    A.check_same_dtype(xa, wa, ba)
    A.check_same_device(xa, wa, ba)
    if xa.ndim < 1:
        raise ValueError("x: expected at least one dimension, got a scalar")
    if wa.ndim != 2:
        raise ValueError(f"weight: expected shape (N, K), got {wa.shape}")
    k = xa.shape[-1]
    n = wa.shape[0]
    if wa.shape[1] != k:
        raise ValueError(f"weight: expected shape (N, {k}) to match x's last dimension, got {wa.shape}")
    if ba is not None:
        A.check_shape(ba, (n,))
        if n > 1 and ba.strides[0] != 1:
            raise ValueError(f"bias: must be contiguous, got stride {ba.strides[0]}")
    m, lda = xa.rows()
    if m == 1:
        lda = k
    _, ldw = wa.rows()
    if n == 1:
        ldw = k
    oa = _out(out, xa, tuple(xa.shape[:-1]) + (n,), (xa, wa, ba))
    _, ldo = oa.rows()
    if m == 1:
        ldo = n
    run = _gemm(xa, m, k, lda, wa, n, ldw, True, ba, activation, oa, ldo, _path, b_weight=True)
    if run is None:
        return oa.obj  # M = 0: not cached, nothing to launch
    run(A.stream_of(xa).ptr, xa.ptr, wa.ptr, ba.ptr if ba is not None else 0, oa.ptr)
    key = (sig(x), sig(weight), sig(bias), sig(out), activation, _path)
    if A.cacheable(key):
        if len(_LINEAR_PLANS) >= _MAX_PLANS:
            _LINEAR_PLANS.clear()
        _LINEAR_PLANS[key] = _cached_plan(run, tuple(xa.shape[:-1]) + (n,), xa, wa, ba,
                                          oa if out is not None else None)
    return oa.obj


def _cached_plan(run, out_shape, xa, wa, ba, oa):
    """A linear's or a matmul's cached launch: per call, the pointers, the output allocation (or, with ``out``,
    its overlap check: None where it fails, so the full path raises), the stream and the launch."""
    lib = A.fast_lib(xa.lib)
    ptr, stream, new_empty = lib.ptr, lib.stream, lib.new_empty
    device = xa.device
    exts = (A.extent(xa), A.extent(wa), A.extent(ba) if ba is not None else 0)
    o_ext = A.extent(oa) if oa is not None else 0

    def plan(x, weight, bias, out):
        xp, wp = ptr(x), ptr(weight)
        bp = ptr(bias) if bias is not None else 0
        if out is None:
            out = new_empty(x, out_shape)
            op = ptr(out)
        else:
            op = ptr(out)
            if o_ext:
                for ip, ie in ((xp, exts[0]), (wp, exts[1]), (bp, exts[2])):
                    if ie and ip < op + o_ext and op < ip + ie:
                        return None
        run(stream(device), xp, wp, bp, op)
        return out

    return plan
