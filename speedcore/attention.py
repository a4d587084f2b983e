"""FlashAttention forward with flash-attn 2's API and semantics (kernels/attention.cu).

``flash_attn`` takes (batch, seqlen, heads, head_dim) tensors, ``flash_attn_varlen`` packed
(total_tokens, heads, head_dim) tensors with int32 ``cu_seqlens``.  Both support causal masking aligned to
the bottom-right corner, sliding windows, tanh softcap, GQA/MQA, and return the log-sum-exp on request.

Two kernels, picked by :func:`attention_path` (a pure function of the head dim, the options and the device):
"sm90" (kernels/attention_sm90.cu: TMA, wgmma, warp specialization; H100/H200) wherever it applies, and "sm80"
(kernels/attention.cu: mma.sync; every GPU from sm_80 on) for the rest: head dims of 32 and below, and head dim
256 (kernel dim above 192) with softcap, whose sm_90 variant would spill registers.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from . import _arrays as A
from . import _tma, _torch_hook
from ._arrays import sig
from ._compile import Kernel
from ._launch import LaunchConfig, bind, device_info, plan_cache

SOURCE = "attention.cu"
# The kernel's head dims; any multiple of 8 up to 256 runs on the next one up (zero-padded in shared memory).
HEAD_DIMS = (32, 64, 96, 128, 192, 256)
MAX_HEAD_DIM = 256
# "Unbounded" window side, and the longest sequence the kernel's int32 index arithmetic allows with it.
UNBOUNDED = 1 << 29
MAX_SEQLEN = 1 << 28
_LOG2E = 1.4426950408889634
# (keys per tile BN, 16-row m-tiles per warp MT, warps per CTA, CTAs per SM the registers are capped for,
# k-steps of Q held in registers where all of Q does not fit, row sums of P by mma (1) or FADD (0), K/V
# pipeline stages) per kernel head dim.  Q rows per CTA
# BM = 16 * MT * warps.  Every entry compiles without spills for sm_80 and sm_90 (tests/test_compile.py).
# 64 and 128 were picked on an H200 (benchmarks/flash_attn.py cells, against torch SDPA FLASH) among the
# spill-free candidates; 64 keys per tile for head dim 128 measured as fast but spills registers.
_TILES = {32: (64, 2, 4, 2, 0, 0, 2), 64: (64, 2, 4, 2, 0, 1, 3), 96: (64, 1, 4, 2, 0, 0, 2),
          128: (32, 2, 4, 2, 0, 1, 3), 192: (32, 1, 4, 2, 0, 0, 2), 256: (32, 1, 4, 2, 0, 0, 2)}
# Strides are int32 inside a tile (rows * stride < 2^31).
MAX_ROW_STRIDE = 1 << 23


def kernel_head_dim(head_dim: int) -> int:
    """The head dim of the kernel variant that runs ``head_dim`` (the smallest of HEAD_DIMS >= it)."""
    for d in HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim {head_dim} is above {MAX_HEAD_DIM}")


def smem_bytes(head_dim: int, block_n: int, m_tiles: int, warps: int, stages: int = 2) -> int:
    """Dynamic shared memory of one CTA: the pipeline stages of K and V tiles (rows padded by 16 bytes), plus
    the Q tile where Q does not stay in registers (see kernels/attention.cu)."""
    pitch = head_dim + 8
    stages = stages * 2 * block_n * pitch * 2
    q_in_regs = m_tiles * head_dim <= 128
    return stages + (0 if q_in_regs else block_m(m_tiles, warps) * pitch * 2)


@lru_cache(maxsize=None)
def flash_attn_config(head_dim: int, smem_per_block: int = 227 * 1024) -> tuple:
    """(kernel head dim D, keys per tile BN, m-tiles per warp MT, warps per CTA, CTAs per SM, Q k-steps in
    registers, row sums by mma, K/V pipeline stages) for a head dim.

    Each warp owns 16 * MT query rows (BM = 16 * MT * warps per CTA) and keeps them in registers with the
    O accumulator; BN is the largest key tile that leaves the registers for two or three CTAs per SM without
    spills, and BN = 32 for the large head dims keeps the double-buffered K/V tiles small.  BN shrinks if the
    device has less shared memory per block.
    """
    d = kernel_head_dim(head_dim)
    bn, mt, warps, ctas, q_ks, rowsum_mma, stages = _TILES[d]
    while smem_bytes(d, bn, mt, warps, stages) > smem_per_block and stages > 2:
        stages -= 1
    while smem_bytes(d, bn, mt, warps, stages) > smem_per_block and bn > 16:
        bn //= 2
    return d, bn, mt, warps, ctas, q_ks, rowsum_mma, stages


def block_m(m_tiles: int, warps: int) -> int:
    return 16 * m_tiles * warps


_OPTIONS = ()  # extra NVRTC options for every variant (experiments: ("-DFA_LAZY_RESCALE=0",))


@lru_cache(maxsize=None)
def _kernel(dtype: str, d: int, bn: int, mt: int, warps: int, ctas: int, q_ks: int, rowsum_mma: int, stages: int,
            softcap: bool = False) -> Kernel:
    b = lambda x: "true" if x else "false"  # noqa: E731
    return Kernel(SOURCE, f"flash_fwd_kernel<{A.CTYPE[dtype]}, {d}, {bn}, {mt}, {warps}, {ctas}, {b(softcap)}, "
                          f"{q_ks}, {b(rowsum_mma)}, {stages}>", _OPTIONS)


def all_kernels() -> list:
    """Every variant :func:`flash_attn` and :func:`flash_attn_varlen` launch on GPUs with 227 KB (A100, H100)
    or 99 KB (sm_86, sm_89) of shared memory per block (for ``python -m speedcore compile``)."""
    out = []
    for dtype in A.HALF_DTYPES:
        for d in HEAD_DIMS:
            for smem in (227 * 1024, 99 * 1024):
                for softcap in (False, True):
                    k = _kernel(dtype, *flash_attn_config(d, smem), softcap)
                    if k not in out:
                        out.append(k)
    return out + all_kernels_sm90()


SOURCE_SM90 = "attention_sm90.cu"
PATHS = ("sm80", "sm90")
SM90_HEAD_DIMS = (64, 128, 192, 256)
# (keys per tile BN, K/V ring stages, consumer warpgroups NC, pingpong) per (kernel head dim, masked): BN x D
# tiles of K and V per stage, a (64 NC) x D tile of Q.  "masked" tiles (causal, windows, varlen) have unequal
# work.  Picked on an H200 (benchmarks/_fa90_tune.py, then benchmarks/_fa90_configs.py) among the spill-free
# candidates.  Head dim 64 dropped pingpong once the tile descriptor came from the producer and the masked tile
# order was grouped (same run, ratio to cuDNN, pingpong -> free-running): causal s2048 1.013 -> 1.019, s8192
# 1.084 -> 1.095, s16384 1.033 -> 1.050, full s2048-16384 1.009-1.035 -> 1.031-1.051, s512 0.959 -> 0.952.
# Head dim 256 with BN = 32 and 4-5 stages (a deeper ring) measured 0.70-0.85 against 0.99-1.08 for BN = 64.
_SM90_TILES = {(64, False): (128, 4, 3, False), (64, True): (128, 4, 3, False),
               (128, False): (128, 2, 2, False), (128, True): (128, 2, 2, True),
               (192, False): (64, 3, 2, True), (192, True): (64, 3, 2, True),
               (256, False): (80, 2, 2, False), (256, True): (64, 2, 2, False)}
# Head dim 256 unmasked takes 80-key tiles (as FlashAttention-3 does): same run, ratio to cuDNN, BN 64 -> 80, two
# rounds each: bf16 s2048 1.009 / 1.007 -> 1.041 / 1.025, fp16 s2048 0.999 / 0.943 -> 1.031 / 0.986, bf16 s8192
# 0.949 / 0.942 -> 0.978 / 0.990 (benchmarks/_fa90_configs.py at 0d8d94e).  Those variants spill a few
# registers (spills_allowed).
# Masked problems of at most SM90_SHORT keys per sequence: few key blocks per tile, where fewer, shorter tiles
# per CTA balance better.  Measured at head dim 64, bf16, causal (benchmarks/_fa90_configs.py, same run, ratio to
# cuDNN): seqlen 512 0.85 with two consumers against 0.84 with three, 1024 0.87 against 0.90 (three consumers lost
# more at 512 before masked m-blocks were aligned to the sequence end: 0.79 against 0.86).
SM90_SHORT = 512
_SM90_TILES_SHORT_MASKED = {64: (128, 4, 2, False)}


def sm90_head_dim(head_dim: int) -> int:
    """The kernel head dim of the sm_90 path for ``head_dim`` (a multiple of 64: TMA loads 128-byte columns
    chunks and zero-fills the columns past the real head dim)."""
    return next(d for d in SM90_HEAD_DIMS if head_dim <= d)


def smem_bytes_sm90(d: int, bn: int, stages: int, nc: int = 2) -> int:
    """Q, the K and V stages, O's staging buffer for its TMA store where they fit in 200 KB (else O is staged in
    Q's buffer: kernels/attention_sm90.cu, o_has_own_buffer), the mbarriers, the two-slot ring of tile descriptors
    (48 bytes each), and 1 KB to align the tiles to the 128-byte swizzle's period."""
    q, ring = 64 * nc * d * 2, 2 * stages * bn * d * 2
    o = q if 2 * q + ring <= 200 * 1024 else 0
    return q + ring + o + (2 + 4 * stages + 4) * 8 + 2 * 48 + 1024


@lru_cache(maxsize=None)
def flash_attn_sm90_config(head_dim: int, masked: bool = False, softcap: bool = False, short: bool = False) -> tuple:
    """(kernel head dim D, keys per tile BN, stages, consumer warpgroups, pingpong) of the sm_90 path.  Softcap
    needs a few more registers: its variants keep BN <= 128 and two consumers (spill-free)."""
    d = sm90_head_dim(head_dim)
    bn, stages, nc, pingpong = _SM90_TILES[(d, bool(masked))]
    if masked and short and d in _SM90_TILES_SHORT_MASKED:
        bn, stages, nc, pingpong = _SM90_TILES_SHORT_MASKED[d]
    if softcap and (bn > 128 or nc > 2):
        bn, stages, nc = 128, max(2, (200 * 1024 - 128 * d * 2) // (4 * 128 * d)), 2
        stages = min(stages, 4)
    return d, bn, stages, nc, pingpong


@lru_cache(maxsize=4096)
def attention_path(head_dim: int, cc: tuple, softcap: bool) -> str:
    """"sm90" on sm_90 devices for head dims 33 to 256, except head dim 256 with softcap; "sm80" otherwise."""
    if tuple(cc) != (9, 0) or head_dim <= 32:
        return "sm80"
    if softcap and sm90_head_dim(head_dim) == 256:
        return "sm80"
    return "sm90"


@lru_cache(maxsize=None)
def _kernel_sm90(dtype: str, d: int, bn: int, stages: int, nc: int, pingpong: bool, softcap: bool) -> Kernel:
    b = lambda x: "true" if x else "false"  # noqa: E731
    return Kernel(SOURCE_SM90, f"flash_fwd_sm90_kernel<{A.CTYPE[dtype]}, {d}, {bn}, {stages}, {b(softcap)}, "
                               f"{b(pingpong)}, {nc}>", _OPTIONS, hopper=True)


# ptxas spill bytes (stores, loads) accepted for a variant; any other spill fails `python -m speedcore compile`.
# Head dim 256 with 80-key tiles: O (128 registers), S and P of the next block leave the consumers (232
# registers) a few short.  The spilled values are per-tile (row offsets and output pointers kept for the
# epilogue) and two mask terms reloaded only on boundary key blocks, not in the unmasked key loop; the measured
# gain above includes them.  NVRTC 13.0 and 13.5 both report 24 bytes stored, 60 loaded.
_SPILLS_D256_BN80 = (32, 64)


def spills_allowed(kernel) -> tuple:
    """(spill store bytes, spill load bytes) that ``python -m speedcore compile`` accepts for ``kernel``."""
    if kernel.source == SOURCE_SM90 and ", 256, 80, " in kernel.name:
        return _SPILLS_D256_BN80
    return (0, 0)


def all_kernels_sm90() -> list:
    out = []
    for dtype in A.HALF_DTYPES:
        for d in SM90_HEAD_DIMS:
            for masked in (False, True):
                for softcap in (False, True):
                    for short in (False, True):
                        k = _kernel_sm90(dtype, *flash_attn_sm90_config(d, masked, softcap, short), softcap)
                        if attention_path(d, (9, 0), softcap) == "sm90" and k not in out:
                            out.append(k)
    return out


# ---------------------------------------------------------------------------------------------- validation

def _check_qkv(qa, ka, va, ndim: int, layout: str):
    for a in (qa, ka, va):
        A.check_dtype(a, A.HALF_DTYPES, " (flash_attn computes in float16 or bfloat16)")
    A.check_same_dtype(qa, ka, va)
    A.check_same_device(qa, ka, va)
    for a in (qa, ka, va):
        if a.ndim != ndim:
            raise ValueError(f"{a.name}: expected {ndim} dimensions {layout}, got shape {a.shape}")
    head_dim = qa.shape[-1]
    for a in (ka, va):
        if a.shape[-1] != head_dim:
            raise ValueError(f"{a.name}: head_dim {a.shape[-1]} differs from q's {head_dim}")
    if not (1 <= head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0):
        raise ValueError(f"q: head_dim must be a multiple of 8 between 8 and {MAX_HEAD_DIM}, got {head_dim}")
    nheads, nheads_kv = qa.shape[-2], ka.shape[-2]
    if va.shape[-2] != nheads_kv:
        raise ValueError(f"v: {va.shape[-2]} heads but k has {nheads_kv}")
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(f"q: nheads ({nheads}) must be a multiple of k's nheads_kv ({nheads_kv})")
    if nheads >= 65536:
        raise ValueError(f"q: at most 65535 heads, got {nheads}")
    return head_dim, nheads, nheads_kv


def _check_options(causal, softmax_scale, window_size, softcap, head_dim):
    if not isinstance(causal, (bool, np.bool_, int, np.integer)):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    causal = bool(causal)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    softmax_scale = float(softmax_scale)
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale: must be a positive finite float, got {softmax_scale}")
    try:
        left, right = window_size
        left, right = int(left), int(right)
    except (TypeError, ValueError):
        raise TypeError(f"window_size: expected a pair of ints (left, right), got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size: each side must be >= 0, or -1 for unbounded, got {(left, right)}")
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap: must be a finite float >= 0 (0 disables it), got {softcap}")
    if causal:
        right = 0
    return softmax_scale, left, right, softcap


def _row_view(a, name):
    """Strides must let cp.async move 16-byte chunks: last dim contiguous, others multiples of 8 elements."""
    if a.shape[-1] > 1 and a.strides[-1] != 1:
        raise ValueError(f"{name}: the last dimension (head_dim) must be contiguous (stride 1), got strides "
                         f"{a.strides}")
    row_stride = a.strides[-3] if a.ndim == 4 else a.strides[0]
    if a.shape[-3 if a.ndim == 4 else 0] > 1 and abs(row_stride) > MAX_ROW_STRIDE:
        raise ValueError(f"{name}: the stride between tokens ({row_stride} elements) is above {MAX_ROW_STRIDE}")
    return a.aligned(16) and all(s % 8 == 0 and s >= 0 for sz, s in zip(a.shape[:-1], a.strides[:-1]) if sz > 1)


def _contiguous_copy(a):
    if a.lib == "torch":
        return A.wrap(a.obj.contiguous(), a.name)
    import cupy

    with cupy.cuda.Device(a.device):
        return A.wrap(cupy.ascontiguousarray(a.obj), a.name)


def _aligned_input(a):
    """Inputs whose rows are not 16-byte aligned are copied once (rare: odd strides or offsets)."""
    if _row_view(a, a.name):
        return a
    c = _contiguous_copy(a)
    if not _row_view(c, a.name):
        raise ValueError(f"{a.name}: needs a 16-byte aligned base pointer")
    return c


def _overlaps(a, b) -> bool:
    if a.numel == 0 or b.numel == 0:
        return False
    return a.ptr < b.ptr + A.extent(b) and b.ptr < a.ptr + A.extent(a)


def _check_out(oa, qa, ka, va):
    A.check_same_dtype(qa, oa)
    A.check_same_device(qa, oa)
    A.check_shape(oa, qa.shape)
    if not _row_view(oa, "out"):
        raise ValueError("out: needs a 16-byte aligned base pointer and strides that are multiples of 8 elements "
                         f"(got strides {oa.strides})")
    A.check_no_overlap(oa, qa)  # out may be q itself: each CTA reads its rows of q before writing them
    for i in (ka, va):
        if _overlaps(oa, i):
            raise ValueError(f"out: overlaps {i.name} in memory")


# ---------------------------------------------------------------------------------------------- launch

def _choose_path(dev, head_dim: int, softcap: float, path) -> str:
    auto = attention_path(head_dim, dev.cc, softcap > 0)
    if path is None:
        return auto
    if path not in PATHS:
        raise ValueError(f"_path: expected one of {PATHS}, got {path!r}")
    if path == "sm90" and auto != "sm90":
        raise ValueError(f"_path='sm90' needs an sm_90 GPU (H100/H200) and a head dim / softcap the sm_90 kernel "
                         f"serves (see attention_path), got head_dim {head_dim} on sm_{dev.cc[0]}{dev.cc[1]}")
    return path


def _tma_strides(a, varlen: bool) -> tuple:
    """(dims, strides) of the (head_dim, tokens, heads, batch) view of a for a tensor map.  Dimensions of size 1
    may carry any stride in the caller's tensor; they get a harmless one (a multiple of 16 bytes)."""
    if varlen:
        shape = (a.shape[2], a.shape[0], a.shape[1], 1)
        strides = [a.strides[0], a.strides[1], 0]
    else:
        shape = (a.shape[3], a.shape[1], a.shape[2], a.shape[0])
        strides = [a.strides[1], a.strides[2], a.strides[0]]
    inner = -(-shape[0] // 8) * 8
    for i in range(3):
        if shape[i + 1] == 1 or strides[i] <= 0:
            strides[i] = inner
        inner = max(inner, strides[i] * shape[i + 1])
    return shape, tuple(strides)


HEAD_GROUP_L2_BYTES = 16 << 20  # K and V of one tile group: a fraction of the H100/H200's 50-60 MB L2
MAX_HEAD_GROUP_LOG2 = 6


@lru_cache(maxsize=4096)
def sm90_head_group_log2(batch_heads: int, kv_bytes_per_head: int, masked: bool) -> int:
    """log2 of the (batch, head) pairs per tile group of the sm_90 schedule (kernels/attention_sm90.cu,
    tile_info): within a group the m-blocks are outermost, so a masked problem's heaviest m-blocks are claimed
    first and its lightest last, which shortens the tail where SMs wait for the last heavy tiles (causal d64
    s2048: CTA end times spread over 28 us of 367).  A power of two dividing ``batch_heads``, and small enough
    that the group's K and V stay in L2; 0 (head-major order) for unmasked problems, whose tiles weigh alike."""
    if not masked:
        return 0
    lg = 0
    while (lg < MAX_HEAD_GROUP_LOG2 and batch_heads % (2 << lg) == 0
           and (2 << lg) * kv_bytes_per_head <= HEAD_GROUP_L2_BYTES):
        lg += 1
    return lg


def _tile_counter(ref, stream):
    """Two int32 zeros per (library, device, stream) for the sm_90 kernel's dynamic tile schedule: the kernel
    leaves them zero when it ends, and launches on one stream run in order, so they can share them."""
    return A.stream_buffer("attention_tiles", ref, stream, 2, "int32", min_n=2, zeroed=True)


def _launcher_sm90(oa, qa, ka, va, dev, *, batch, max_seqlen_q, seqlen_q, seqlen_k, total_q, total_k,
                 varlen, nheads, nheads_kv, head_dim, left, right, softcap, scale_log2, softcap_pre, softcap_post,
                 reverse, lse_strides):
    # A persistent grid, one CTA per SM, whose producer prefetches the next tile during the current one's
    # epilogue; tiles are claimed dynamically (a counter per stream), so unequal work (causal, windows, varlen)
    # balances itself.  "Masked" problems get their own tile shapes.
    uniform = not varlen and left < 0 and right < 0
    short = (max_seqlen_q if varlen else seqlen_k) <= SM90_SHORT
    d, bn, stages, nc, pingpong = flash_attn_sm90_config(head_dim, not uniform, softcap > 0, short)
    bm = 64 * nc
    num_m = -(-max_seqlen_q // bm)
    num_tiles = num_m * nheads * batch
    # Head-major order for varlen (its sequences differ in length anyway) and for short sequences, whose heaviest
    # tiles are short too: d64 causal s512, same run, ratio to cuDNN: head-major 0.915 against grouped 0.900
    # (s1024: 0.905 against 0.936).
    grouped = not uniform and not varlen and not short
    group_log2 = sm90_head_group_log2(batch * nheads, seqlen_k * head_dim * 4, grouped)
    maps = []  # (dims, strides, box) of q, k, v and out's tensor maps: built per pointer (cached by _tma)
    for a, rows in ((qa, bm), (ka, bn), (va, bn), (oa, 64)):
        dims, strides = _tma_strides(a, varlen)
        box = (64, rows, 1, 1)
        _tma.check_nd(a.ptr, a.dtype, dims, strides, box)
        maps.append((dims, strides, box, _tma.SWIZZLE_128B))
    os_ = (0, oa.strides[0], oa.strides[1]) if varlen else (oa.strides[0], oa.strides[1], oa.strides[2])
    i64, i32 = np.int64, np.int32
    scalars = (*(i64(x) for x in os_ + lse_strides), i32(seqlen_q), i32(seqlen_k),
               i32(total_q), i32(total_k), i32(head_dim), i32(nheads), i32(nheads // nheads_kv), i32(num_m),
               i32(num_tiles), i32(left if left >= 0 else UNBOUNDED), i32(right if right >= 0 else UNBOUNDED),
               np.float32(scale_log2), np.float32(softcap_pre), np.float32(softcap_post), i32(reverse), i32(group_log2))
    grid = min(num_tiles, dev.sms)
    cfg = LaunchConfig((grid,), (128 * (nc + 1),), smem_bytes_sm90(d, bn, stages, nc))
    launch = bind(_kernel_sm90(qa.dtype, d, bn, stages, nc, pingpong, softcap > 0), cfg, qa.device).fixed(
        (bytes,) * 4 + (int,) * 4 + tuple(map(type, scalars)) + (int,))
    dtype, (qm, km, vm, om) = qa.dtype, maps
    tile_map = _tma._tile_map_bytes
    scratch = A.scratch_ref(qa.lib, qa.device)

    def run(stream_ptr, o_ptr, lse_ptr, q_ptr, k_ptr, v_ptr, cuq_ptr, cuk_ptr):
        launch(stream_ptr, (tile_map(q_ptr, dtype, *qm), tile_map(k_ptr, dtype, *km), tile_map(v_ptr, dtype, *vm),
                            tile_map(o_ptr, dtype, *om), o_ptr, lse_ptr, cuq_ptr, cuk_ptr) + scalars
               + (_tile_counter(scratch, stream_ptr).ptr,))

    return run


def _launcher(oa, qa, ka, va, *, batch, max_seqlen_q, seqlen_q, seqlen_k, total_q, total_k,
            varlen, nheads, nheads_kv, head_dim, softmax_scale, left, right, softcap, causal, config=None, path=None):
    """Validate the launch of one attention call signature and return it, ``run(stream_ptr, out_ptr, lse_ptr,
    q_ptr, k_ptr, v_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr)`` (0 for an absent array), or None where there is
    nothing to launch."""
    dev = device_info(qa.device)
    if max_seqlen_q == 0 or batch == 0 or nheads == 0:
        return None
    path = "sm80" if config is not None else _choose_path(dev, head_dim, softcap, path)
    if (total_k if varlen else seqlen_k) == 0:
        path = "sm80"  # no key at all: zeros and -inf, and no tensor map of an empty K
    d, bn, mt, warps, ctas, q_ks, rowsum_mma, stages = config or flash_attn_config(head_dim, dev.smem_per_block_optin)
    bm = block_m(mt, warps)
    num_m = -(-max_seqlen_q // bm)
    if softcap > 0:
        scale_log2 = 1.0
        softcap_pre = 2.0 * _LOG2E * softmax_scale / softcap
        softcap_post = softcap * _LOG2E
    else:
        scale_log2 = softmax_scale * _LOG2E
        softcap_pre = softcap_post = 0.0
    # The diagonal of the last query is the one that sees the most keys: heavy tiles first balances the tail.
    reverse = 1 if right >= 0 else 0
    lse_strides = (0, total_q) if varlen else (nheads * seqlen_q, seqlen_q)
    if path == "sm90":
        return _launcher_sm90(oa, qa, ka, va, dev, batch=batch, max_seqlen_q=max_seqlen_q, seqlen_q=seqlen_q,
                     seqlen_k=seqlen_k, total_q=total_q, total_k=total_k, varlen=varlen, nheads=nheads,
                     nheads_kv=nheads_kv, head_dim=head_dim, left=left, right=right, softcap=softcap,
                     scale_log2=scale_log2, softcap_pre=softcap_pre, softcap_post=softcap_post, reverse=reverse,
                     lse_strides=lse_strides)
    if varlen:
        qs = (0, qa.strides[0], qa.strides[1])
        ks = (0, ka.strides[0], ka.strides[1])
        vs = (0, va.strides[0], va.strides[1])
        os_ = (0, oa.strides[0], oa.strides[1])
    else:
        qs = (qa.strides[0], qa.strides[1], qa.strides[2])
        ks = (ka.strides[0], ka.strides[1], ka.strides[2])
        vs = (va.strides[0], va.strides[1], va.strides[2])
        os_ = (oa.strides[0], oa.strides[1], oa.strides[2])
    i64 = np.int64
    scalars = (*(i64(x) for x in qs + ks + vs + os_ + lse_strides),
               np.int32(seqlen_q), np.int32(seqlen_k), np.int32(total_q), np.int32(total_k), np.int32(head_dim),
               np.int32(nheads // nheads_kv), np.int32(left if left >= 0 else UNBOUNDED),
               np.int32(right if right >= 0 else UNBOUNDED), np.float32(scale_log2), np.float32(softcap_pre),
               np.float32(softcap_post), np.int32(reverse))
    cfg = LaunchConfig((num_m, nheads, batch), (32 * warps,), smem_bytes(d, bn, mt, warps, stages))
    return bind(_kernel(qa.dtype, d, bn, mt, warps, ctas, q_ks, rowsum_mma, stages, softcap > 0), cfg,
                qa.device).prepacked((int,) * 7, scalars)


def _attn_plan(run, qa, ka, va, oa, lse_shape, varlen: bool):
    """A cached call signature of flash_attn / flash_attn_varlen: per call the pointers, the outputs (or the
    overlap checks with ``out``: None where one fails, so the full path raises), the stream and the launch."""
    lib = A.fast_lib(qa.lib)
    ptr, stream, empty = lib.ptr, lib.stream, lib.empty
    shape, dtype, device = qa.shape, qa.dtype, qa.device
    q_ext, k_ext, v_ext = A.extent(qa), A.extent(ka), A.extent(va)
    o_ext = A.extent(oa) if oa is not None else 0
    # out may be q itself (same layout: each CTA reads its rows of q before writing them)
    q_same = oa is not None and oa.strides == qa.strides

    def plan(q, k, v, out, cu_q, cu_k):
        qp, kp, vp = ptr(q), ptr(k), ptr(v)
        if out is None:
            out = empty(shape, dtype, device)
            op = ptr(out)
        else:
            op = ptr(out)
            if o_ext:
                if qp < op + o_ext and op < qp + q_ext and not (qp == op and q_same):
                    return None
                if (kp < op + o_ext and op < kp + k_ext) or (vp < op + o_ext and op < vp + v_ext):
                    return None
        s = stream(device)
        if lse_shape is None:
            if run is not None:
                run(s, op, 0, qp, kp, vp, ptr(cu_q) if varlen else 0, ptr(cu_k) if varlen else 0)
            return out
        lse = empty(lse_shape, "float32", device)
        if run is not None:
            run(s, op, ptr(lse), qp, kp, vp, ptr(cu_q) if varlen else 0, ptr(cu_k) if varlen else 0)
        return out, lse

    return plan


def _inputs_and_out(qa, ka, va, oa):
    """Check ``out`` and the row views, copy inputs the kernel cannot read in place, allocate ``out``."""
    if oa is not None:
        _check_out(oa, qa, ka, va)
    for a in (qa, ka, va):
        _row_view(a, a.name)
    qa, ka, va = (_aligned_input(a) for a in (qa, ka, va))
    if oa is None:
        oa = A.empty(qa, qa.shape, qa.dtype, "out")
    return qa, ka, va, oa


def flash_attn(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, return_lse=False,
               out=None, _path=None):
    """Scaled dot-product attention forward, as ``flash_attn.flash_attn_func`` (flash-attn 2).

    ``out[b, i, h] = sum_j softmax_j(s_ij) v[b, j, h // (nheads // nheads_kv)]`` with
    ``s_ij = softmax_scale * q[b, i, h] . k[b, j, h_kv]`` (or ``softcap * tanh(s_ij / softcap)``), over the keys j
    visible to query i: with ``diag = seqlen_k - seqlen_q`` (the bottom-right alignment of flash-attn >= 2.1),
    ``i + diag - left <= j <= i + diag + right`` where a side of -1 is unbounded and ``causal`` sets
    ``right = 0``.  A query that sees no key gets zeros, and lse = -inf.

    Parameters
    ----------
    q : torch.Tensor or cupy.ndarray, (batch, seqlen_q, nheads, head_dim)
        float16 or bfloat16 on a CUDA device.  head_dim a multiple of 8 up to 256 (32, 64, 96, 128, 192, 256
        run without padding).  Only the last dimension must be contiguous: slices of a packed qkv tensor work
        without a copy (other strides should be multiples of 8 elements; otherwise the input is copied).
    k, v : (batch, seqlen_k, nheads_kv, head_dim), same dtype and device; nheads a multiple of nheads_kv (GQA,
        MQA).  seqlen_q and seqlen_k may differ; any length from 0 on.
    causal : bool
    softmax_scale : float > 0, default 1 / sqrt(head_dim).
    window_size : (left, right), ints >= -1; -1 is unbounded.
    softcap : float >= 0; 0 disables it.
    return_lse : bool
        Also return the natural log-sum-exp of the scaled scores, float32 (batch, nheads, seqlen_q).
    out : optional, shaped like q, same dtype; written and returned (may be q itself, must not overlap k or v).

    Returns
    -------
    out, or (out, lse) with ``return_lse``; arrays of the inputs' library, computed on its current stream.
    """
    if _torch_hook.compiling():
        return _torch_hook.op("flash_attn")(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                            window_size=window_size, softcap=softcap, return_lse=return_lse,
                                            out=out)
    try:
        key = (sig(q), sig(k), sig(v), sig(out), causal, softmax_scale, window_size, softcap, return_lse is True,
               _path)
        plan = _FAST_ATTN.get(key)
    except TypeError:  # an unhashable option: the full check names it
        key = plan = None
    if plan is not None:
        result = plan(q, k, v, out, None, None)
        if result is not None:
            return result
    qa, ka, va = A.wrap(q, "q"), A.wrap(k, "k"), A.wrap(v, "v")
    oa = A.wrap(out, "out", optional=True)
    head_dim, nheads, nheads_kv = _check_qkv(qa, ka, va, 4, "(batch, seqlen, nheads, head_dim)")
    batch, seqlen_q = qa.shape[0], qa.shape[1]
    seqlen_k = ka.shape[1]
    if ka.shape[0] != batch or va.shape[0] != batch:
        raise ValueError(f"k, v: batch sizes {ka.shape[0]}, {va.shape[0]} must equal q's {batch}")
    if va.shape[1] != seqlen_k:
        raise ValueError(f"v: seqlen {va.shape[1]} differs from k's {seqlen_k}")
    if max(seqlen_q, seqlen_k) > MAX_SEQLEN:
        raise ValueError(f"q, k: sequence lengths above {MAX_SEQLEN} are not supported")
    if batch >= 65536:
        raise ValueError(f"q: at most 65535 sequences per call, got batch {batch}")
    softmax_scale_, left, right, softcap_ = _check_options(causal, softmax_scale, window_size, softcap, head_dim)
    given = (qa, ka, va, oa)
    qa, ka, va, oa = _inputs_and_out(qa, ka, va, oa)
    lse = A.empty(qa, (batch, nheads, seqlen_q), "float32", "lse") if return_lse else None
    run = None
    if seqlen_q > 0:
        run = _launcher(oa, qa, ka, va, batch=batch, max_seqlen_q=seqlen_q, seqlen_q=seqlen_q,
                        seqlen_k=seqlen_k, total_q=0, total_k=0, varlen=False, nheads=nheads, nheads_kv=nheads_kv,
                        head_dim=head_dim, softmax_scale=softmax_scale_, left=left, right=right, softcap=softcap_,
                        causal=causal, path=_path)
        if run is not None:
            run(A.stream_of(qa).ptr, oa.ptr, lse.ptr if lse is not None else 0, qa.ptr, ka.ptr, va.ptr, 0, 0)
    _cache_attn(key, run, given, (qa, ka, va), oa, (batch, nheads, seqlen_q) if return_lse else None, False)
    return (oa.obj, lse.obj) if return_lse else oa.obj


# flash_attn / flash_attn_varlen call signatures -> their launch; see _arrays.sig
_FAST_ATTN: dict = plan_cache()
_MAX_PLANS = 1024


def _cache_attn(key, run, given, inputs, oa, lse_shape, varlen: bool) -> None:
    """Store the plan of a validated call, unless an input had to be copied (the plan would skip the copy)."""
    if key is None or not A.cacheable(key) or any(a is not b for a, b in zip(given[:3], inputs)):
        return
    if len(_FAST_ATTN) >= _MAX_PLANS:
        _FAST_ATTN.clear()
    _FAST_ATTN[key] = _attn_plan(run, *inputs, oa if given[3] is not None else None, lse_shape, varlen)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                      softmax_scale=None, window_size=(-1, -1), softcap=0.0, return_lse=False, out=None,
                      block_table=None, seqused_k=None, _path=None):
    """Attention over a batch of sequences of different lengths packed along the token dimension, as
    ``flash_attn.flash_attn_varlen_func``.

    Sequence b holds query tokens ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key tokens
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; the masking rules of :func:`flash_attn` apply per sequence (with its
    own seqlen_q and seqlen_k).  Empty sequences are allowed.

    Parameters
    ----------
    q : (total_q, nheads, head_dim); k, v : (total_k, nheads_kv, head_dim)
        float16 or bfloat16, as in :func:`flash_attn`.
    cu_seqlens_q, cu_seqlens_k : int32, (batch + 1,), non-decreasing, starting at 0, on q's device.  Not read
        on the host (no synchronization); values past total_q / total_k are clamped, never read out of bounds.
    max_seqlen_q : int, at least the longest query sequence (rows past it are not computed).
    max_seqlen_k : int, the longest key sequence (accepted for flash-attn compatibility).
    causal, softmax_scale, window_size, softcap, out : as in :func:`flash_attn`.
    block_table : optional int32 (batch, max_blocks_per_seq): k and v are then paged caches (num_blocks,
        block_size, nheads_kv, head_dim), as flash-attn's ``block_table=``, and the call is
        :func:`speedcore.paged_prefill_attention` (the query tokens are the last ones of each sequence).
    seqused_k : optional int32 (batch,), with ``block_table``: each sequence's cached tokens, this step's
        included; by default ``cu_seqlens_k[1:] - cu_seqlens_k[:-1]``.
    return_lse : bool
        Also return the log-sum-exp, float32 (nheads, total_q).

    Returns
    -------
    out (total_q, nheads, head_dim), or (out, lse).
    """
    if block_table is not None:
        return _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                             softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                             return_lse=return_lse, out=out, block_table=block_table, seqused_k=seqused_k)
    if seqused_k is not None:
        raise ValueError("seqused_k: only with block_table (a paged KV cache); contiguous K/V use cu_seqlens_k")
    if _torch_hook.compiling():
        return _torch_hook.op("flash_attn_varlen")(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   causal=causal, softmax_scale=softmax_scale,
                                                   window_size=window_size, softcap=softcap, return_lse=return_lse,
                                                   out=out)
    try:
        key = (sig(q), sig(k), sig(v), sig(out), sig(cu_seqlens_q), sig(cu_seqlens_k), type(max_seqlen_q),
               max_seqlen_q, type(max_seqlen_k), max_seqlen_k, causal, softmax_scale, window_size, softcap,
               return_lse is True, _path)
        plan = _FAST_ATTN.get(key)
    except TypeError:  # an unhashable option: the full check names it
        key = plan = None
    if plan is not None and not A.CHECK_INDICES:
        result = plan(q, k, v, out, cu_seqlens_q, cu_seqlens_k)
        if result is not None:
            return result
    qa, ka, va = A.wrap(q, "q"), A.wrap(k, "k"), A.wrap(v, "v")
    cq, ck = A.wrap(cu_seqlens_q, "cu_seqlens_q"), A.wrap(cu_seqlens_k, "cu_seqlens_k")
    oa = A.wrap(out, "out", optional=True)
    head_dim, nheads, nheads_kv = _check_qkv(qa, ka, va, 3, "(total_tokens, nheads, head_dim)")
    for c in (cq, ck):
        if c.dtype != "int32":
            raise TypeError(f"{c.name}: dtype must be int32, got {c.dtype}")
        A.check_same_device(qa, c)
        if c.ndim != 1 or c.shape[0] < 1:
            raise ValueError(f"{c.name}: expected shape (batch + 1,), got {c.shape}")
        if c.shape[0] > 1 and c.strides[0] != 1:
            raise ValueError(f"{c.name}: must be contiguous, got stride {c.strides[0]}")
    if cq.shape[0] != ck.shape[0]:
        raise ValueError(f"cu_seqlens_k: length {ck.shape[0]} differs from cu_seqlens_q's {cq.shape[0]}")
    batch = cq.shape[0] - 1
    if batch >= 65536:
        raise ValueError(f"cu_seqlens_q: at most 65535 sequences per call, got {batch}")
    total_q, total_k = qa.shape[0], ka.shape[0]
    if va.shape[0] != total_k:
        raise ValueError(f"v: {va.shape[0]} tokens but k has {total_k}")
    for name, val in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(val).__name__}")
        if val < 0:
            raise ValueError(f"{name}: must be >= 0, got {val}")
    if max(total_q, total_k, int(max_seqlen_q), int(max_seqlen_k)) > MAX_SEQLEN:
        raise ValueError(f"q, k: more than {MAX_SEQLEN} tokens are not supported")
    softmax_scale_, left, right, softcap_ = _check_options(causal, softmax_scale, window_size, softcap, head_dim)
    if A.CHECK_INDICES:
        _check_cu_seqlens(cq, total_q, int(max_seqlen_q))
        _check_cu_seqlens(ck, total_k, None)
    given = (qa, ka, va, oa)
    qa, ka, va, oa = _inputs_and_out(qa, ka, va, oa)
    lse = A.empty(qa, (nheads, total_q), "float32", "lse") if return_lse else None
    run = None
    if total_q > 0 and batch > 0 and max_seqlen_q > 0:
        run = _launcher(oa, qa, ka, va, batch=batch, max_seqlen_q=int(max_seqlen_q), seqlen_q=0, seqlen_k=0,
                        total_q=total_q, total_k=total_k, varlen=True, nheads=nheads, nheads_kv=nheads_kv,
                        head_dim=head_dim, softmax_scale=softmax_scale_, left=left, right=right, softcap=softcap_,
                        causal=causal, path=_path)
        if run is not None:
            run(A.stream_of(qa).ptr, oa.ptr, lse.ptr if lse is not None else 0, qa.ptr, ka.ptr, va.ptr, cq.ptr,
                ck.ptr)
    _cache_attn(key, run, given, (qa, ka, va), oa, (nheads, total_q) if return_lse else None, True)
    return (oa.obj, lse.obj) if return_lse else oa.obj


def _check_cu_seqlens(c, total: int, max_seqlen) -> None:
    """SPEEDCORE_CHECK_INDICES=1: cu_seqlens read back (a sync) and checked: starts at 0, non-decreasing, within
    the tensor's token count, and (queries) no sequence longer than max_seqlen_q."""
    vals = A.to_host(c.obj).astype(np.int64)
    lens = np.diff(vals)
    if vals[0] != 0 or (lens.size and lens.min() < 0) or vals[-1] > total:
        raise ValueError(f"{c.name}: must start at 0, be non-decreasing and end at most at the {total} tokens of "
                         f"its tensor, got {vals[:8].tolist()}{'...' if vals.size > 8 else ''} (last {vals[-1]})")
    if max_seqlen is not None and lens.size and lens.max() > max_seqlen:
        raise ValueError(f"{c.name}: a sequence of {lens.max()} tokens is longer than max_seqlen_q={max_seqlen}")


def _paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, block_table,
                  seqused_k, **kw):
    """flash_attn_varlen over a paged cache: paged_prefill_attention, with seqused_k from cu_seqlens_k if absent."""
    from .paged_attention import paged_prefill_attention

    if seqused_k is None:
        if cu_seqlens_k is None:
            raise ValueError("seqused_k: with block_table, pass seqused_k (or cu_seqlens_k to derive it from)")
        ck = A.wrap(cu_seqlens_k, "cu_seqlens_k")
        if ck.dtype != "int32" or ck.ndim != 1 or ck.shape[0] < 1:
            raise TypeError(f"cu_seqlens_k: expected int32 of shape (batch + 1,), got {ck.dtype} {ck.shape}")
        seqused_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    return paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q,
                                   max_seqlen_k, **kw)
