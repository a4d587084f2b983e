"""Attention of many query tokens per sequence over a paged KV cache: chunked prefill, prefix caching and
speculative verification, with flash-attn's ``flash_attn_varlen_func(..., block_table=...)`` argument names and
semantics.  Kernels: kernels/paged_prefill.cu, kernels/paged_prefill_sm90.cu and kernels/paged_verify.cu.

q is packed (total_q, heads, head_dim) with int32 ``cu_seqlens_q``; K and V come from vLLM's flash layout caches
(num_blocks, block_size, heads_kv, head_dim) through an int32 ``block_table`` (batch, max_blocks), and
``seqused_k[b]`` is the number of cached tokens of sequence b, this step's included.  The query tokens are the
last ones of their sequence: causal masking is aligned to the bottom-right corner, as in flash-attn.

Kernels, picked by :func:`kernel_choice` from max_seqlen_q and the head dim, then :func:`prefill_path`:
- ``paged_prefill_sm90_kernel`` (sm_90a, H100/H200): kernels/attention_sm90.cu's warp-specialized wgmma / TMA
  kernel with the producer loading each K/V tile as page-sized TMA boxes through the block table (chunked prefill,
  prefix caching).  Launch heuristic :func:`prefill_sm90_config`.
- ``paged_prefill_kernel`` (mma.sync, every GPU from sm_80 on, and what sm_90 cannot take: odd block sizes, head
  dims <= 32, head dim 256 with softcap): FlashAttention-2's forward loop with the K/V tiles gathered through the
  block table by cp.async.  Launch heuristic :func:`prefill_config`, a pure function of the head dim, the block size
  and the shared memory budget.
- ``paged_verify_kernel`` (at most VERIFY_MAX_Q query tokens per sequence: speculative verification, decode):
  decode-style split-KV, one CTA per (sequence, KV head, group of up to 32 (query token, query head) columns,
  split) that reads each K/V page once for all of them, plus ``paged_verify_merge_kernel`` where the KV range is
  split.  Launch heuristic :func:`verify_config` and :func:`verify_num_splits`.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from . import _arrays as A
from . import _torch_hook
from . import _tma
from ._compile import Kernel
from ._arrays import sig
from ._launch import LaunchConfig, bind, device_info, plan_cache

SOURCE = "paged_prefill.cu"  # paged_prefill_kernel (mma.sync, sm_80 on)
SOURCE_SM90 = "paged_prefill_sm90.cu"  # paged_prefill_sm90_kernel (wgmma / TMA, sm_90a)
SOURCE_VERIFY = "paged_verify.cu"  # paged_verify_kernel, paged_verify_merge_kernel
# Kernel head dims; any multiple of 8 up to 256 runs on the next one up (the columns past the real head dim are
# zero-filled in shared memory, so a padded head dim costs the compute of the kernel's).
HEAD_DIMS = (64, 128, 256)
MAX_HEAD_DIM = 256
UNBOUNDED = 1 << 29        # an unbounded window side, inside the kernel's int32 index arithmetic
MAX_TOKENS = 1 << 28       # longest sequence / most query tokens per call (int32 arithmetic with the window terms)
MAX_ROW_STRIDE = 1 << 23   # q / out / cache token strides (elements): int32 offsets inside a tile
_LOG2E = 1.4426950408889634
SMEM_BUDGET = 227 * 1024   # A100 / H100 / H200 opt-in shared memory per block; sm_86 / sm_89 have 99 KB
_SMEM_BUDGETS = (227 * 1024, 99 * 1024)

# (keys per tile BN, 16-row m-tiles per warp MT, warps, CTAs per SM the registers are capped for, Q k-steps held
# in registers where Q does not stay in registers, row sums by mma, K/V stages) per kernel head dim: the tiles of
# kernels/attention.cu's flash_fwd_kernel (measured there on an H200), whose loop this kernel keeps; the paged
# copies add 0-3 registers (sm_80: 232 / 240 / 239 against 229 / 242 / 238 for d64 / d128 / d256), no spills.
_TILES = {64: (64, 2, 4, 2, 0, 1, 3), 128: (32, 2, 4, 2, 0, 1, 3), 256: (32, 1, 4, 2, 0, 0, 2)}


def kernel_head_dim(head_dim: int) -> int:
    """The head dim of the variant that runs ``head_dim`` (the smallest of HEAD_DIMS >= it)."""
    for d in HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim {head_dim} is above {MAX_HEAD_DIM}")


def block_m(m_tiles: int, warps: int) -> int:
    """Query rows per CTA."""
    return 16 * m_tiles * warps


def smem_bytes(d: int, bn: int, mt: int, warps: int, stages: int) -> int:
    """Dynamic shared memory of one CTA: ``stages`` K and V tiles of BN rows (rows padded by 16 bytes against bank
    conflicts), plus the Q tile where Q does not stay in registers (MT * D > 128)."""
    pitch = d + 8
    ring = stages * 2 * bn * pitch * 2
    return ring + (0 if mt * d <= 128 else block_m(mt, warps) * pitch * 2)


@lru_cache(maxsize=None)
def prefill_config(head_dim: int, block_size: int, smem_budget: int = SMEM_BUDGET) -> tuple:
    """(kernel head dim D, keys per tile BN, m-tiles per warp MT, warps, CTAs per SM, Q k-steps in registers, row
    sums by mma, stages, page_tile) of ``paged_prefill_kernel`` for a head dim, a cache block size and a shared
    memory budget per CTA (bytes).

    Stages, then BN, shrink until the CTA fits ``smem_budget`` (99 KB on sm_86 / sm_89: head dim 256 takes 16-key
    tiles).  ``page_tile``: block_size % BN == 0, so every K/V tile lies inside one page and is copied as a
    contiguous one (one block-table entry per tile); otherwise each copied row resolves its own page.
    """
    d = kernel_head_dim(head_dim)
    bn, mt, warps, ctas, q_ks, rowsum_mma, stages = _TILES[d]
    while smem_bytes(d, bn, mt, warps, stages) > smem_budget and stages > 2:
        stages -= 1
    while smem_bytes(d, bn, mt, warps, stages) > smem_budget and bn > 16:
        bn //= 2
    if smem_bytes(d, bn, mt, warps, stages) > smem_budget:
        raise ValueError(f"paged_prefill_attention: head_dim {head_dim} needs "
                         f"{smem_bytes(d, bn, mt, warps, stages)} bytes of shared memory per block; the device "
                         f"allows {smem_budget}")
    return d, bn, mt, warps, ctas, q_ks, rowsum_mma, stages, block_size % bn == 0


@lru_cache(maxsize=None)
def _prefill_kernel(dtype: str, d: int, bn: int, mt: int, warps: int, ctas: int, q_ks: int, rowsum_mma: bool,
                    stages: int, page_tile: bool, softcap: bool) -> Kernel:
    b = lambda x: "true" if x else "false"  # noqa: E731
    return Kernel(SOURCE, f"paged_prefill_kernel<{A.CTYPE[dtype]}, {d}, {bn}, {mt}, {warps}, {ctas}, {b(softcap)}, "
                          f"{q_ks}, {b(rowsum_mma)}, {stages}, {b(page_tile)}>")


# -- chunked prefill on sm_90: paged_prefill_sm90_kernel --------------------------------------------------------
PREFILL_SM90 = True  # False: every prefill runs paged_prefill_kernel (the sm_80 path)
PATHS = ("sm80", "sm90")
# (keys per tile BN, K/V ring stages, consumer warpgroups, pingpong) per kernel head dim: the masked (causal, varlen)
# tiles of speedcore/attention.py's _SM90_TILES (measured there on an H200), except head dim 64, which takes the
# two-consumer tile attention.py uses for short masked problems: with three consumers (160 registers each) the
# paged producer's page arithmetic costs a spill.
_SM90_TILES = {64: (128, 4, 2, False), 128: (128, 2, 2, True), 256: (64, 2, 2, False)}


def smem_bytes_sm90(d: int, bn: int, stages: int, nc: int) -> int:
    """Q, the K and V stages, O's staging buffer where they fit in 200 KB (else O is staged in Q's buffer), the
    mbarriers, the two-slot ring of tile descriptors and 1 KB to align the tiles to the 128-byte swizzle's period
    (kernels/paged_prefill_sm90.cu, as attention.smem_bytes_sm90)."""
    q, ring = 64 * nc * d * 2, 2 * stages * bn * d * 2
    o = q if 2 * q + ring <= 200 * 1024 else 0
    return q + ring + o + (2 + 4 * stages + 4) * 8 + 2 * 48 + 1024


@lru_cache(maxsize=None)
def prefill_sm90_config(head_dim: int, softcap: bool = False) -> tuple:
    """(kernel head dim D, keys per tile BN, stages, consumer warpgroups, pingpong) of paged_prefill_sm90_kernel."""
    d = kernel_head_dim(head_dim)
    bn, stages, nc, pingpong = _SM90_TILES[d]
    return d, bn, stages, nc, pingpong


def prefill_path(head_dim: int, cc: tuple, softcap: bool, block_size: int) -> str:
    """"sm90" on sm_90 devices for head dims 33 to 256 (except 256 with softcap, whose wgmma variant would spill, as
    in attention.attention_path) and block sizes whose pages TMA boxes tile: multiples of 16 that divide the key
    tile or that it divides (16 to 256 by powers of two, 384, ...); "sm80" otherwise or with PREFILL_SM90 off."""
    return _prefill_path(head_dim, tuple(cc), bool(softcap), block_size) if PREFILL_SM90 else "sm80"


@lru_cache(maxsize=4096)
def _prefill_path(head_dim: int, cc: tuple, softcap: bool, block_size: int) -> str:
    if cc != (9, 0) or head_dim <= 32:
        return "sm80"
    d, bn = prefill_sm90_config(head_dim, softcap)[:2]
    if softcap and d == 256:
        return "sm80"
    if block_size % 16 or (block_size % bn and bn % block_size):
        return "sm80"
    return "sm90"


@lru_cache(maxsize=None)
def _prefill_sm90_kernel(dtype: str, d: int, bn: int, stages: int, nc: int, pingpong: bool, softcap: bool) -> Kernel:
    b = lambda x: "true" if x else "false"  # noqa: E731
    return Kernel(SOURCE_SM90, f"paged_prefill_sm90_kernel<{A.CTYPE[dtype]}, {d}, {bn}, {stages}, {b(softcap)}, "
                               f"{b(pingpong)}, {nc}>", hopper=True)


def _tma_view(dims: tuple, strides: tuple) -> tuple:
    """Strides (elements) for a tensor map of dims (innermost first): dimensions of size 1 may carry any stride in the
    caller's array; they get a harmless one (a multiple of 16 bytes)."""
    inner = -(-dims[0] // 8) * 8
    out = []
    for size, st in zip(dims[1:], strides):
        if size == 1 or st <= 0:
            st = inner
        out.append(st)
        inner = max(inner, st * size)
    return tuple(out)


# -- speculative verification: paged_verify_kernel -------------------------------------------------------------
VERIFY_MAX_Q = 16          # query tokens per sequence up to which paged_verify_kernel runs
VERIFY_HEAD_DIMS = (64, 128, 256)  # it reads whole rows (no zero-padded head dims)
VERIFY_TILE = 16           # keys per tile (the mma M dimension)
# (warps, stages) of the per-warp cp.async rings per head dim: paged_decode_kernel's, measured on the H200 for the
# same streaming loop (kernels/decode.cu, speedcore/decode.py's decode_config)
_VERIFY_RING = {64: (4, 4), 128: (4, 3), 256: (4, 3)}
VERIFY_MAX_SPLITS = 256
VERIFY_MIN_TILES_PER_SPLIT = 32  # 512 keys: below this a split's fixed costs (Q load, partials, merge) dominate
VERIFY_SPLIT_PENALTY = 0.01      # cost of splitting, as a fraction of the kernel time (partials + merge pass)
_REGS_PER_SM = 65536
_RESERVED_SMEM_PER_CTA = 1024


@lru_cache(maxsize=4096)
def kernel_choice(max_seqlen_q: int, head_dim: int) -> str:
    """"verify" (paged_verify_kernel) for 1 to VERIFY_MAX_Q query tokens per sequence at head dims 64 / 128 / 256,
    "prefill" (paged_prefill_kernel) otherwise: with a few query tokens the prefill kernel's 16-row m-tiles would be
    mostly empty, and each (query tile, query head) CTA would read its KV head's pages again."""
    return "verify" if 1 <= max_seqlen_q <= VERIFY_MAX_Q and head_dim in VERIFY_HEAD_DIMS else "prefill"


def verify_n_tiles(head_dim: int, columns: int) -> int:
    """8-column n-tiles per CTA for ``columns`` = max_seqlen_q x GQA group (query token, query head) pairs: 1, 2 or
    4 (32 columns; 2 at head dim 256, where 4 would spill: the O^T accumulators alone are 4 x head_dim / 4
    registers per lane).  More columns than that take more CTAs per KV head (which read its pages again, mostly
    from L2)."""
    if columns <= 8:
        return 1
    return 2 if columns <= 16 or head_dim == 256 else 4


def verify_smem_bytes(d: int, warps: int, stages: int, nt: int) -> int:
    """Q^T (8 nt rows of d + 8 elements) and every warp's ring of ``stages`` 16-key K and V tiles, or the cross-warp
    merge (each warp's fp32 O^T, max and sum per column) that reuses them at the end: the larger."""
    ring = 8 * nt * (d + 8) * 2 + warps * stages * 2 * VERIFY_TILE * d * 2
    merge = (warps * 8 * nt * d + 2 * warps * 8 * nt) * 4
    return max(ring, merge)


@lru_cache(maxsize=4096)
def verify_config(head_dim: int, columns: int, smem_budget: int = SMEM_BUDGET) -> tuple:
    """(warps, stages, n-tiles, dynamic shared memory bytes) of paged_verify_kernel; stages (to 2), then warps (to 1)
    shrink until the CTA fits ``smem_budget`` (99 KB on sm_86 / sm_89: head dim 256 runs 2 warps x 2 stages)."""
    warps, stages = _VERIFY_RING[head_dim]
    nt = verify_n_tiles(head_dim, columns)
    while verify_smem_bytes(head_dim, warps, stages, nt) > smem_budget and stages > 2:
        stages -= 1
    while verify_smem_bytes(head_dim, warps, stages, nt) > smem_budget and warps > 1:
        warps //= 2
    smem = verify_smem_bytes(head_dim, warps, stages, nt)
    if smem > smem_budget:
        raise ValueError(f"paged_prefill_attention: head_dim {head_dim} needs {smem} bytes of shared memory per "
                         f"block; the device allows {smem_budget}")
    return warps, stages, nt, smem


def verify_ctas_per_sm(smem: int, threads: int, smem_per_sm: int) -> int:
    """Resident CTAs per SM: shared memory, and the registers at the launch bounds' 255 per thread."""
    return max(1, min(smem_per_sm // (smem + _RESERVED_SMEM_PER_CTA), _REGS_PER_SM // (256 * threads),
                      2048 // threads))


@lru_cache(maxsize=4096)
def verify_num_splits(work: int, max_len: int, sms: int, ctas_per_sm: int) -> int:
    """CTAs sharing one (sequence, KV head, column group) along the keys (flash-decoding), as
    ``decode.decode_num_splits``: from two full waves of resident CTAs on, none; below that the split count whose
    ``work * splits`` CTAs fill their last wave best, a split costing VERIFY_SPLIT_PENALTY, ties to fewer splits, no
    split shorter than VERIFY_MIN_TILES_PER_SPLIT tiles of the longest possible sequence (``max_len``, the block
    table's capacity: no device-to-host sync)."""
    slots = max(1, sms * ctas_per_sm)
    work = max(1, work)
    if work >= 2 * slots:
        return 1
    tiles = -(-max(1, max_len) // VERIFY_TILE)
    top = max(1, min(VERIFY_MAX_SPLITS, tiles // VERIFY_MIN_TILES_PER_SPLIT, max(4, -(-2 * slots // work))))
    best, best_score = 1, -1.0
    for s in range(1, top + 1):
        ctas = work * s
        score = ctas / (-(-ctas // slots) * slots) - (VERIFY_SPLIT_PENALTY if s > 1 else 0.0)
        if score > best_score + 1e-9:
            best, best_score = s, score
    return best


@lru_cache(maxsize=None)
def _verify_kernel(dtype: str, d: int, warps: int, stages: int, nt: int, page16: bool) -> Kernel:
    return Kernel(SOURCE_VERIFY, f"paged_verify_kernel<{A.CTYPE[dtype]}, {d}, {warps}, {stages}, {nt}, "
                                 f"{'true' if page16 else 'false'}>")


@lru_cache(maxsize=None)
def _verify_merge_kernel(dtype: str, d: int) -> Kernel:
    return Kernel(SOURCE_VERIFY, f"paged_verify_merge_kernel<{A.CTYPE[dtype]}, {d}>")


def all_kernels() -> list:
    """Every variant :func:`paged_prefill_attention` launches, on GPUs with 227 KB (A100, H100, H200) or 99 KB
    (sm_86, sm_89) of shared memory per block (for ``python -m speedcore compile``)."""
    out = []
    for dtype in A.HALF_DTYPES:
        for d in HEAD_DIMS:
            for softcap in (False, True):
                if prefill_path(d, (9, 0), softcap, 16) == "sm90":
                    out.append(_prefill_sm90_kernel(dtype, *prefill_sm90_config(d, softcap), softcap))
    for dtype in A.HALF_DTYPES:
        for d in HEAD_DIMS:
            for smem in _SMEM_BUDGETS:
                for block_size in (256, 16):  # a tile inside one page, and per-row page lookups
                    cfg = prefill_config(d, block_size, smem)
                    for softcap in (False, True):
                        out.append(_prefill_kernel(dtype, *cfg, softcap))
        for d in VERIFY_HEAD_DIMS:
            for smem in _SMEM_BUDGETS:
                for columns in (8, 16, 32):
                    warps, stages, nt, _ = verify_config(d, columns, smem)
                    for page16 in (True, False):
                        out.append(_verify_kernel(dtype, d, warps, stages, nt, page16))
            out.append(_verify_merge_kernel(dtype, d))
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------------------------------- validation

def _check_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    value = int(value)
    if value < 0:
        raise ValueError(f"{name}: must be >= 0, got {value}")
    return value


def _check_options(causal, softmax_scale, window_size, softcap, head_dim) -> tuple:
    """(softmax_scale, left, right, softcap) with -1 for an unbounded side; causal sets right = 0."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"softmax_scale: expected a float, got {type(softmax_scale).__name__}")
    softmax_scale = float(softmax_scale)
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale: must be a positive finite float, got {softmax_scale}")
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size: expected a pair of ints (left, right), got {window_size!r}") from None
    for side in (left, right):
        if isinstance(side, bool) or not isinstance(side, (int, np.integer)):
            raise TypeError(f"window_size: expected a pair of ints (left, right), got {window_size!r}")
    left, right = int(left), int(right)
    if left < -1 or right < -1:
        raise ValueError(f"window_size: each side must be >= 0, or -1 for unbounded, got {(left, right)}")
    if left >= UNBOUNDED or right >= UNBOUNDED:
        left, right = (-1 if left >= UNBOUNDED else left), (-1 if right >= UNBOUNDED else right)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating, np.integer)):
        raise TypeError(f"softcap: expected a float, got {type(softcap).__name__}")
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap: must be a finite float >= 0 (0 disables it), got {softcap}")
    if causal:
        right = 0
    return softmax_scale, left, right, softcap


def _rows_ok(a) -> bool:
    """16-byte cp.async / stores of rows: 16-byte aligned base, other strides multiples of 8 elements (>= 0)."""
    return a.aligned(16) and all(s % 8 == 0 and s >= 0 for sz, s in zip(a.shape[:-1], a.strides[:-1]) if sz > 1)


def _check_index(a, name: str, shape: tuple, what: str) -> None:
    if a.dtype != "int32":
        raise TypeError(f"{name}: dtype must be int32, got {a.dtype}")
    if a.ndim != len(shape) or any(want is not None and got != want for got, want in zip(a.shape, shape)):
        raise ValueError(f"{name}: expected shape {what}, got {a.shape}")
    if a.shape[-1] > 1 and a.strides[-1] != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous, got strides {a.strides}")
    if a.ndim == 2 and a.shape[0] > 1 and a.strides[0] < a.shape[1]:
        raise ValueError(f"{name}: rows must not overlap, got strides {a.strides}")


def _plan(qa, ka, va, cqa, sua, bta, oa, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size,
          softcap) -> dict:
    """Validate every argument (wrapped arrays) and compute the launch parameters; raises before any launch."""
    A.check_dtype(qa, A.HALF_DTYPES, " (paged_prefill_attention computes in float16 or bfloat16)")
    A.check_same_dtype(qa, ka, va, oa)
    A.check_same_device(qa, ka, va, cqa, sua, bta, oa)
    if qa.ndim != 3:
        raise ValueError(f"q: expected shape (total_q, num_heads, head_dim), got {qa.shape}")
    total_q, heads, head_dim = qa.shape
    if not (8 <= head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0):
        raise ValueError(f"q: head_dim must be a multiple of 8 between 8 and {MAX_HEAD_DIM}, got {head_dim}")
    for c in (ka, va):
        if c.ndim != 4:
            raise ValueError(f"{c.name}: expected shape (num_blocks, block_size, num_kv_heads, head_dim), got "
                             f"{c.shape}")
    num_blocks, block_size, heads_kv, kd = ka.shape
    if kd != head_dim:
        raise ValueError(f"k_cache: head_dim {kd} does not match q's {head_dim}")
    if num_blocks < 1 or block_size < 1 or heads_kv < 1:
        raise ValueError(f"k_cache: needs at least one block, block slot and KV head, got shape {ka.shape}")
    if num_blocks * block_size >= 2 ** 31:
        raise ValueError(f"k_cache: {num_blocks} blocks of {block_size} slots exceed 2**31 slots")
    A.check_shape(va, ka.shape)
    if va.strides != ka.strides:
        raise ValueError(f"v_cache: strides {va.strides} must equal k_cache's {ka.strides}")
    if heads < 1 or heads % heads_kv:
        raise ValueError(f"q: num_heads {heads} must be a positive multiple of k_cache's num_kv_heads {heads_kv}")
    if heads >= 65536:
        raise ValueError(f"q: at most 65535 heads, got {heads}")
    for c in (ka, va):
        if c.strides[3] != 1 or not _rows_ok(c) or c.strides[0] <= 0 or c.strides[1] <= 0 or c.strides[2] <= 0:
            raise ValueError(f"{c.name}: head_dim must be contiguous, the other strides positive multiples of 8 "
                             f"elements (16 bytes) and the pointer 16-byte aligned, got strides {c.strides}")
        if c.strides[1] > MAX_ROW_STRIDE:
            raise ValueError(f"{c.name}: the stride between tokens ({c.strides[1]} elements) is above "
                             f"{MAX_ROW_STRIDE}")
    if qa.strides[2] != 1 and head_dim > 1:
        raise ValueError(f"q: the last dimension (head_dim) must be contiguous (stride 1), got strides {qa.strides}")
    if abs(qa.strides[0]) > MAX_ROW_STRIDE and total_q > 1:
        raise ValueError(f"q: the stride between tokens ({qa.strides[0]} elements) is above {MAX_ROW_STRIDE}")
    _check_index(cqa, "cu_seqlens_q", (None,), "(batch + 1,)")
    if cqa.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q: expected shape (batch + 1,), got {cqa.shape}")
    batch = cqa.shape[0] - 1
    if batch >= 65536:
        raise ValueError(f"cu_seqlens_q: at most 65535 sequences per call, got batch {batch}")
    _check_index(sua, "seqused_k", (batch,), f"({batch},) (one length per sequence of cu_seqlens_q)")
    _check_index(bta, "block_table", (batch, None), f"({batch}, max_blocks_per_seq)")
    if bta.shape[1] < 1:
        raise ValueError(f"block_table: needs at least one column, got shape {bta.shape}")
    max_seqlen_q = _check_int("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _check_int("max_seqlen_k", max_seqlen_k)
    capacity = bta.shape[1] * block_size
    if max_seqlen_k > capacity:
        raise ValueError(f"max_seqlen_k: {max_seqlen_k} tokens do not fit the block table's {bta.shape[1]} blocks "
                         f"of {block_size} tokens ({capacity})")
    if capacity > MAX_TOKENS:
        raise ValueError(f"block_table: {bta.shape[1]} blocks of {block_size} tokens exceed {MAX_TOKENS} tokens per "
                         f"sequence")
    if max(total_q, max_seqlen_q) > MAX_TOKENS:
        raise ValueError(f"q: more than {MAX_TOKENS} query tokens are not supported")
    max_seqlen_q = min(max_seqlen_q, total_q)  # no sequence holds more query rows than q has
    softmax_scale, left, right, softcap = _check_options(causal, softmax_scale, window_size, softcap, head_dim)
    if oa is not None:
        A.check_shape(oa, qa.shape)
        if not _rows_ok(oa) or (head_dim > 1 and oa.strides[2] != 1):
            raise ValueError("out: needs a contiguous head_dim, a 16-byte aligned base pointer and strides that are "
                             f"multiples of 8 elements, got strides {oa.strides}")
        if abs(oa.strides[0]) > MAX_ROW_STRIDE and total_q > 1:
            raise ValueError(f"out: the stride between tokens ({oa.strides[0]} elements) is above {MAX_ROW_STRIDE}")
        # out may be q itself (each CTA reads its rows of q before it writes them), nothing else
        A.check_no_overlap(oa, qa, ka, va, cqa, sua, bta)
    return dict(total_q=total_q, heads=heads, heads_kv=heads_kv, head_dim=head_dim, batch=batch,
                num_blocks=num_blocks, block_size=block_size, capacity=capacity, max_seqlen_q=max_seqlen_q,
                scale=softmax_scale, left=left, right=right, softcap=softcap)


def _contiguous_copy(a):
    if a.lib == "torch":
        return A.wrap(a.obj.contiguous(), a.name)
    import cupy

    with cupy.cuda.Device(a.device):
        return A.wrap(cupy.ascontiguousarray(a.obj), a.name)


# ---------------------------------------------------------------------------------------------- launch

def _choose_path(device: int, p: dict, path) -> str:
    auto = prefill_path(p["head_dim"], device_info(device).cc, p["softcap"] > 0, p["block_size"])
    if path is None:
        return auto
    if path not in PATHS:
        raise ValueError(f"_path: expected one of {PATHS}, got {path!r}")
    if path == "sm90" and auto != "sm90":
        raise ValueError(f"_path='sm90' needs an sm_90 GPU and a head dim, softcap and block size the sm_90 kernel "
                         f"serves (see prefill_path), got head_dim {p['head_dim']}, block_size {p['block_size']}")
    return path


# Each builder returns run(stream_ptr, o, lse, q, k, v, cu_seqlens_q, seqused_k, block_table) (pointers; lse 0 when
# not returned) for the layouts it was built from: the checked call runs it once, and a call signature seen again
# runs it with no checks but the pointer overlaps (_paged_plan).

def _prefill_runner(p, oa, lse, qa, ka, va, cqa, sua, bta, config=None):
    dev = device_info(qa.device)
    cfg = config or prefill_config(p["head_dim"], p["block_size"], dev.smem_per_block_optin)
    d, bn, mt, warps, ctas, q_ks, rowsum_mma, stages, page_tile = cfg
    num_m = -(-p["max_seqlen_q"] // block_m(mt, warps))
    if p["softcap"] > 0:
        scale_log2, cap_pre, cap_post = 1.0, 2.0 * _LOG2E * p["scale"] / p["softcap"], p["softcap"] * _LOG2E
    else:
        scale_log2, cap_pre, cap_post = p["scale"] * _LOG2E, 0.0, 0.0
    left, right = p["left"], p["right"]
    # the diagonal of the last query sees the most keys: heavy tiles first balances the tail
    reverse = 1 if right >= 0 else 0
    i32, i64 = np.int32, np.int64
    scalars = (i64(qa.strides[0]), i64(qa.strides[1]), i64(oa.strides[0]), i64(oa.strides[1]),
               i64(ka.strides[0]), i64(ka.strides[1]), i64(ka.strides[2]), i64(bta.strides[0]),
               i32(p["total_q"]), i32(p["capacity"]), i32(p["block_size"]), i32(p["num_blocks"]), i32(p["head_dim"]),
               i32(p["heads"] // p["heads_kv"]), i32(left if left >= 0 else UNBOUNDED),
               i32(right if right >= 0 else UNBOUNDED), np.float32(scale_log2), np.float32(cap_pre),
               np.float32(cap_post), i32(reverse))
    lc = LaunchConfig((num_m, p["heads"], p["batch"]), (32 * warps,), smem_bytes(d, bn, mt, warps, stages))
    launch = bind(_prefill_kernel(qa.dtype, *cfg, p["softcap"] > 0), lc, qa.device).prepacked((int,) * 8, scalars)
    return launch


def _tile_counter(ref, stream):
    """Two int32 zeros per (library, device, stream) for the sm_90 kernel's dynamic tile schedule: the kernel leaves
    them zero when it ends, and launches on one stream run in order, so they can share them."""
    return A.stream_buffer("paged_attention_tiles", ref, stream, 2, "int32", min_n=2, zeroed=True)


def _prefill_sm90_runner(p, oa, lse, qa, ka, va, cqa, sua, bta):
    dev = device_info(qa.device)
    head_dim, heads, batch, total_q = p["head_dim"], p["heads"], p["batch"], p["total_q"]
    d, bn, stages, nc, pingpong = prefill_sm90_config(head_dim, p["softcap"] > 0)
    bm = 64 * nc
    num_m = -(-p["max_seqlen_q"] // bm)
    num_tiles = num_m * heads * batch
    page_rows = min(bn, p["block_size"])
    rows = lambda a: ((head_dim, total_q, heads, 1), _tma_view((head_dim, total_q, heads, 1),  # noqa: E731
                                                               (a.strides[0], a.strides[1], 0)))
    cache_dims = (head_dim, p["block_size"], p["heads_kv"], p["num_blocks"])
    cache_strides = _tma_view(cache_dims, (ka.strides[1], ka.strides[2], ka.strides[0]))
    # (dims, strides, box, swizzle) of q, k, v and out's tensor maps, encoded per pointer (cached by _tma)
    maps = [(*rows(qa), (64, bm, 1, 1)), (cache_dims, cache_strides, (64, page_rows, 1, 1)),
            (cache_dims, cache_strides, (64, page_rows, 1, 1)), (*rows(oa), (64, 64, 1, 1))]
    for a, (dims, strides, box) in zip((qa, ka, va, oa), maps):
        _tma.check_nd(a.ptr, a.dtype, dims, strides, box)
    qm, km, vm, om = (m + (_tma.SWIZZLE_128B,) for m in maps)
    if p["softcap"] > 0:
        scale_log2, cap_pre, cap_post = 1.0, 2.0 * _LOG2E * p["scale"] / p["softcap"], p["softcap"] * _LOG2E
    else:
        scale_log2, cap_pre, cap_post = p["scale"] * _LOG2E, 0.0, 0.0
    left, right = p["left"], p["right"]
    i32, i64 = np.int32, np.int64
    scalars = (i64(oa.strides[0]), i64(oa.strides[1]), i64(bta.strides[0]), i32(total_q), i32(p["capacity"]),
               i32(p["block_size"]), i32(p["num_blocks"]), i32(page_rows), i32(head_dim), i32(heads),
               i32(heads // p["heads_kv"]), i32(num_m), i32(num_tiles), i32(left if left >= 0 else UNBOUNDED),
               i32(right if right >= 0 else UNBOUNDED), np.float32(scale_log2), np.float32(cap_pre),
               np.float32(cap_post), i32(1 if right >= 0 else 0), i32(0))
    cfg = LaunchConfig((min(num_tiles, dev.sms),), (128 * (nc + 1),), smem_bytes_sm90(d, bn, stages, nc))
    launch = bind(_prefill_sm90_kernel(qa.dtype, d, bn, stages, nc, pingpong, p["softcap"] > 0), cfg,
                  qa.device).fixed((bytes,) * 4 + (int,) * 5 + tuple(map(type, scalars)) + (int,))
    dtype, tile_map = qa.dtype, _tma._tile_map_bytes
    scratch = A.scratch_ref(qa.lib, qa.device)

    def run(stream_ptr, o_ptr, lse_ptr, q_ptr, k_ptr, v_ptr, cq_ptr, su_ptr, bt_ptr):
        launch(stream_ptr, (tile_map(q_ptr, dtype, *qm), tile_map(k_ptr, dtype, *km), tile_map(v_ptr, dtype, *vm),
                            tile_map(o_ptr, dtype, *om), o_ptr, lse_ptr, cq_ptr, su_ptr, bt_ptr) + scalars
               + (_tile_counter(scratch, stream_ptr).ptr,))

    return run


def _verify_runner(p, oa, lse, qa, ka, va, cqa, sua, bta, num_splits=None):
    dev = device_info(qa.device)
    d, heads, heads_kv, batch, total_q = p["head_dim"], p["heads"], p["heads_kv"], p["batch"], p["total_q"]
    group = heads // heads_kv
    columns = p["max_seqlen_q"] * group
    warps, stages, nt, smem = verify_config(d, columns, dev.smem_per_block_optin)
    qgroups = -(-columns // (8 * nt))
    units = heads_kv * qgroups
    if num_splits is None:
        num_splits = verify_num_splits(batch * units, p["capacity"], dev.sms,
                                       verify_ctas_per_sm(smem, 32 * warps, dev.smem_per_sm))
    if batch * units * num_splits >= 2 ** 31:
        raise ValueError("q: batch x heads x splits is too large for one launch")
    if p["softcap"] > 0:
        scale_a, cap_log2 = p["scale"] / p["softcap"], p["softcap"] * _LOG2E
    else:
        scale_a, cap_log2 = p["scale"] * _LOG2E, 0.0
    left, right = p["left"], p["right"]
    i32, i64 = np.int32, np.int64
    scalars = (i32(total_q), i32(heads), i32(group), i32(qgroups), i32(units), i32(num_splits), i32(p["block_size"]),
               i32(p["num_blocks"]), i32(p["capacity"]), i64(qa.strides[0]), i64(qa.strides[1]), i64(oa.strides[0]),
               i64(oa.strides[1]), i64(ka.strides[0]), i64(ka.strides[1]), i64(ka.strides[2]), i64(bta.strides[0]),
               np.float32(scale_a), np.float32(cap_log2), i32(p["softcap"] > 0),
               i32(left if left >= 0 else UNBOUNDED), i32(right if right >= 0 else UNBOUNDED))
    kernel = _verify_kernel(qa.dtype, d, warps, stages, nt, p["block_size"] % VERIFY_TILE == 0)
    attn = bind(kernel, LaunchConfig((batch * units * num_splits,), (32 * warps,), smem),
                qa.device).prepacked((int,) * 10, scalars)
    if num_splits == 1:
        return lambda s, o, lse_ptr, q, k, v, cq, su, bt: attn(s, o, lse_ptr, 0, 0, q, k, v, cq, su, bt)
    # one stream workspace: the fp32 partial outputs, then the partial log2-sum-exps (16-byte aligned: d % 64 == 0)
    partial = total_q * heads * num_splits
    merge = bind(_verify_merge_kernel(qa.dtype, d), LaunchConfig((total_q, -(-heads // 4)), (128,)),
                 qa.device).prepacked((int,) * 5, (i32(batch), i32(total_q), i32(heads), i32(num_splits),
                                                   i64(oa.strides[0]), i64(oa.strides[1])))
    scratch = A.scratch_ref(qa.lib, qa.device)

    def run(stream_ptr, o_ptr, lse_ptr, q_ptr, k_ptr, v_ptr, cq_ptr, su_ptr, bt_ptr):
        ws = A.stream_buffer("paged_verify_workspace", scratch, stream_ptr, partial * d + partial, "float32").ptr
        part_o, part_l = ws, ws + 4 * partial * d
        attn(stream_ptr, o_ptr, 0, part_o, part_l, q_ptr, k_ptr, v_ptr, cq_ptr, su_ptr, bt_ptr)
        merge(stream_ptr, o_ptr, lse_ptr, part_o, part_l, cq_ptr)

    return run


def _paged_plan(run, qa, ka, va, cqa, sua, bta, oa, lse_shape):
    """A cached call signature: per call the pointers, the outputs (or, with ``out``, its overlap checks: None where
    one fails, so the full path raises), the stream and the launch."""
    lib = A.fast_lib(qa.lib)
    ptr, stream, empty = lib.ptr, lib.stream, lib.empty
    shape, dtype, device = qa.shape, qa.dtype, qa.device
    ins = (qa, ka, va, cqa, sua, bta)
    exts = tuple(A.extent(a) for a in ins)
    o_ext = A.extent(oa) if oa is not None else 0
    # out may alias an input of its very layout (q itself), as A.check_no_overlap allows
    same = tuple(oa is not None and a.shape == oa.shape and a.strides == oa.strides for a in ins)

    def plan(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, out):
        ps = (ptr(q), ptr(k_cache), ptr(v_cache), ptr(cu_seqlens_q), ptr(seqused_k), ptr(block_table))
        if out is None:
            out = empty(shape, dtype, device)
            op = ptr(out)
        else:
            op = ptr(out)
            if o_ext:
                for ip, ie, sm in zip(ps, exts, same):
                    if ie and ip < op + o_ext and op < ip + ie and not (ip == op and sm):
                        return None
        s = stream(device)
        if lse_shape is None:
            if run is not None:
                run(s, op, 0, *ps)
            return out
        lse = empty(lse_shape, "float32", device)
        if run is not None:
            run(s, op, ptr(lse), *ps)
        return out, lse

    return plan


# paged_prefill_attention call signatures -> their launch; see _arrays.sig
_PAGED_PLANS: dict = plan_cache()
_MAX_PLANS = 1024


def paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
                            *, causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0, return_lse=False,
                            out=None, _kernel=None, _num_splits=None, _path=None):
    """Attention of packed query tokens over a paged KV cache, as ``flash_attn.flash_attn_varlen_func(q, k_cache,
    v_cache, cu_seqlens_q, None, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k, block_table=block_table, ...)``.

    Sequence b has query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (sq of them) and ``seqused_k[b]`` (sk) cached
    tokens, this step's included: token t lives in page ``block_table[b, t // block_size]`` at slot
    ``t % block_size``.  Query i (0 <= i < sq) sees key j iff ``i + sk - sq - left <= j <= i + sk - sq + right`` and
    ``j < sk`` (flash-attn's bottom-right alignment; a side of -1 is unbounded, ``causal`` sets right = 0).  Scores
    are ``softmax_scale * q . k`` (or ``softcap * tanh(score / softcap)``), accumulated in float32.  A query that
    sees no key (sk = 0) gets zeros and lse = -inf.

    Parameters
    ----------
    q : (total_q, num_heads, head_dim), float16 or bfloat16, CUDA torch.Tensor or cupy.ndarray; head_dim a
        multiple of 8 up to 256 (64, 128, 256 run unpadded), contiguous (q is copied if its other strides are not
        multiples of 8 elements or its pointer not 16-byte aligned).
    k_cache, v_cache : (num_blocks, block_size, num_kv_heads, head_dim), q's dtype, the same shape and strides;
        head_dim contiguous, other strides multiples of 8 elements.  Any block size: multiples of the key tile
        (32 or 64 keys) copy whole tiles from one page, others resolve a page per row.  num_heads a multiple of
        num_kv_heads (GQA, MQA).
    cu_seqlens_q : int32 (batch + 1,), contiguous, non-decreasing from 0 (clamped to total_q, never read out of
        bounds; not read on the host).
    seqused_k : int32 (batch,), contiguous: 0 <= seqused_k[b] <= block_table.shape[1] * block_size (clamped to that);
        it should be >= the sequence's query count (the queries are its last tokens).
    block_table : int32 (batch, max_blocks_per_seq), rows contiguous; entries past a sequence's last page are
        never read; entries must lie in [0, num_blocks) (others are clamped, never read out of bounds).  Sequences
        may share pages (a shared prefix).
    max_seqlen_q : int, at least the longest query sequence (rows past it are not computed).
    max_seqlen_k : int, at most the block table's capacity (block_table.shape[1] * block_size).
    causal : bool, default True.
    softmax_scale : float > 0, default 1 / sqrt(head_dim).
    window_size : (left, right), ints >= -1; -1 is unbounded.
    softcap : float >= 0; 0 disables it.
    return_lse : bool; also return the natural log-sum-exp, float32 (num_heads, total_q).
    out : optional, shaped like q, same dtype, head_dim contiguous, other strides multiples of 8 elements; may be
        q itself, must not overlap anything else.

    Returns
    -------
    out, or (out, lse); arrays of q's library, computed on its current stream.
    """
    if _torch_hook.compiling():
        return _torch_hook.op("paged_prefill_attention")(
            q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, causal=causal,
            softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, return_lse=return_lse, out=out)
    try:
        key = (sig(q), sig(k_cache), sig(v_cache), sig(cu_seqlens_q), sig(seqused_k), sig(block_table), sig(out),
               type(max_seqlen_q), max_seqlen_q, type(max_seqlen_k), max_seqlen_k, causal, softmax_scale,
               window_size, softcap, return_lse is True, _kernel, _num_splits, _path)
        plan = _PAGED_PLANS.get(key)
    except TypeError:  # an unhashable option: the full check names it
        key = plan = None
    if plan is not None and not A.CHECK_INDICES:
        result = plan(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, out)
        if result is not None:
            return result
    qa, ka, va = A.wrap(q, "q"), A.wrap(k_cache, "k_cache"), A.wrap(v_cache, "v_cache")
    cqa, sua, bta = A.wrap(cu_seqlens_q, "cu_seqlens_q"), A.wrap(seqused_k, "seqused_k"), A.wrap(block_table,
                                                                                                 "block_table")
    oa = A.wrap(out, "out", optional=True)
    p = _plan(qa, ka, va, cqa, sua, bta, oa, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size, softcap)
    if A.CHECK_INDICES:
        _check_indices(cqa, sua, bta, ka.shape[0], ka.shape[1], int(max_seqlen_q), qa.shape[0])
    copied = not _rows_ok(qa)
    if copied:
        qa = _contiguous_copy(qa)
    given_out = oa
    if oa is None:
        oa = A.empty(qa, qa.shape, qa.dtype, "out")
    lse = A.empty(qa, (p["heads"], p["total_q"]), "float32", "lse") if return_lse else None
    choice = kernel_choice(p["max_seqlen_q"], p["head_dim"])
    if _kernel is not None:  # tests: one input through either kernel
        if _kernel not in ("prefill", "verify") or (_kernel == "verify" and p["head_dim"] not in VERIFY_HEAD_DIMS):
            raise ValueError(f"_kernel: expected 'prefill', or 'verify' at head dims {VERIFY_HEAD_DIMS}, got "
                             f"{_kernel!r}")
        choice = _kernel
    if _num_splits is not None and not (isinstance(_num_splits, int) and 1 <= _num_splits <= VERIFY_MAX_SPLITS):
        raise ValueError(f"_num_splits: expected 1 to {VERIFY_MAX_SPLITS}, got {_num_splits!r}")
    run = None
    if p["total_q"] > 0 and p["batch"] > 0 and p["max_seqlen_q"] > 0:
        if choice == "verify":
            run = _verify_runner(p, oa, lse, qa, ka, va, cqa, sua, bta, _num_splits)
        elif _choose_path(qa.device, p, _path) == "sm90":
            run = _prefill_sm90_runner(p, oa, lse, qa, ka, va, cqa, sua, bta)
        else:
            run = _prefill_runner(p, oa, lse, qa, ka, va, cqa, sua, bta)
        run(A.stream_of(qa).ptr, oa.ptr, lse.ptr if lse is not None else 0, qa.ptr, ka.ptr, va.ptr, cqa.ptr,
            sua.ptr, bta.ptr)
    if key is not None and not copied and A.cacheable(key):  # a plan skips the copy: not cached then
        if len(_PAGED_PLANS) >= _MAX_PLANS:
            _PAGED_PLANS.clear()
        _PAGED_PLANS[key] = _paged_plan(run, qa, ka, va, cqa, sua, bta, given_out,
                                        (p["heads"], p["total_q"]) if return_lse else None)
    return (oa.obj, lse.obj) if return_lse else oa.obj


def _check_indices(cqa, sua, bta, num_blocks: int, block_size: int, max_seqlen_q: int, total_q: int) -> None:
    """SPEEDCORE_CHECK_INDICES=1: cu_seqlens_q, seqused_k and the block ids a launch reads, read back (a sync)."""
    cu = A.to_host(cqa.obj).astype(np.int64)
    lens = np.diff(cu)
    if cu[0] != 0 or (lens.size and lens.min() < 0) or cu[-1] > total_q:
        raise ValueError(f"cu_seqlens_q: must start at 0, be non-decreasing and end at most at q's {total_q} tokens, "
                         f"got {cu[:8].tolist()}{'...' if cu.size > 8 else ''} (last {cu[-1]})")
    if lens.size and lens.max() > max_seqlen_q:
        raise ValueError(f"cu_seqlens_q: a sequence of {lens.max()} query tokens is longer than max_seqlen_q="
                         f"{max_seqlen_q}")
    used = A.to_host(sua.obj).astype(np.int64)
    cap = bta.shape[1] * block_size
    if used.size and (used.min() < 0 or used.max() > cap):
        raise ValueError(f"seqused_k: values must lie in [0, {cap}] (block_table's capacity), got "
                         f"{used.min()}..{used.max()}")
    if lens.size and (lens > used).any():
        b = int(np.argmax(lens > used))
        raise ValueError(f"seqused_k: sequence {b} has {lens[b]} query tokens but only {used[b]} cached tokens "
                         f"(this step's are included)")
    table = A.to_host(bta.obj)
    for b, n in enumerate(-(-used // block_size)):
        row = table[b, :n]
        if row.size and (row.min() < 0 or row.max() >= num_blocks):
            raise ValueError(f"block_table: row {b} holds block ids outside [0, {num_blocks}) within its first {n} "
                             f"entries (seqused_k[{b}] = {used[b]})")

