"""Decode-time kernels (kernels/decode.cu): paged-KV decode attention with split-KV and GQA, the KV-cache
append ``reshape_and_cache``, ``rotary_embedding``, and the gated activations ``silu_and_mul`` /
``gelu_and_mul``.  Semantics follow vLLM's kernels of the same names; the cache layout is vLLM's flash layout
``(num_blocks, block_size, num_kv_heads, head_dim)``.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from . import _arrays as A
from . import _torch_hook
from ._arrays import sig
from ._compile import Kernel
from ._launch import LaunchConfig, bind, chained, device_info, plan_cache

SOURCE = "decode.cu"

# -- paged decode attention ---------------------------------------------------------------------------------
HEAD_DIMS = (64, 128, 256)
TILE_TOKENS = 16           # tokens per tile of the attention kernel (one mma M dimension)
QUERIES_PER_CTA = 8        # query heads of one KV head served by one CTA (the mma N dimension)
MAX_SPLITS = 256           # the merge kernel holds the split lse values in registers, 8 per lane
MIN_TILES_PER_SPLIT = 32   # 512 tokens: below this a split's fixed costs (Q load, merge traffic) dominate
SPLIT_PENALTY = 0.01       # cost of splitting, as a fraction of the kernel time (partials + merge pass)
L2_HINT = 2                # cp.async with an L2 evict-first policy: K/V are read once (measured +0.5-2%)
_RESERVED_SMEM_PER_CTA = 1024


@lru_cache(maxsize=None)
def decode_config(head_dim: int) -> tuple:
    """(warps, stages, dynamic shared memory bytes) of the attention kernel for one head dim.

    Each warp streams its own ring of ``stages`` tiles of 16 tokens (K and V, 16 x head_dim each), so
    ``warps * (stages - 1)`` tiles are in flight per CTA: 96 KB of K/V per CTA at head_dim 128 (two CTAs,
    ~128 KB in flight per SM, several times the ~35 KB that HBM latency x bandwidth per SM asks for).  Measured
    on the H200 at head_dim 128: 2 warps x 3 stages (four CTAs per SM, so 512 units run as one wave instead of
    two) is no faster at (64, 4096) and 1-9% slower where the sequence is split.
    """
    warps, stages = DECODE_CONFIGS[head_dim]
    return warps, stages, _decode_smem(head_dim, warps, stages)


DECODE_CONFIGS = {64: (4, 4), 128: (4, 3), 256: (4, 3)}  # head_dim -> (warps, stages)


def _decode_smem(head_dim: int, warps: int, stages: int) -> int:
    ring = warps * stages * 2 * TILE_TOKENS * head_dim * 2
    # the end: every warp's output, max and sum, then the CTA's normalized output and lse (read by a pair partner)
    merge = (warps * QUERIES_PER_CTA * head_dim + warps * 2 * QUERIES_PER_CTA
             + QUERIES_PER_CTA * head_dim + QUERIES_PER_CTA) * 4
    return max(ring, merge)


PAIR_MERGE = True  # sm_90: two splits as one thread-block cluster, merged through DSMEM (no merge kernel)


def pair_merge(cc: tuple, num_splits: int) -> bool:
    """Whether a launch of ``num_splits`` splits merges them in-kernel: on sm_90 the two splits of a unit run as one
    cluster and combine their results through distributed shared memory, so no merge kernel (and no wait for the
    whole grid) follows.  Clusters of 4 or 8 cost resident slots on the H200 (its GPCs' SM counts), 2 does not."""
    return PAIR_MERGE and num_splits == 2 and tuple(cc) >= (9, 0)


@lru_cache(maxsize=4096)
def decode_num_splits(batch: int, units: int, max_len: int, sms: int, ctas_per_sm: int) -> int:
    """How many CTAs share one (sequence, KV head, query group) along the KV length (flash-decoding).

    ``units`` = KV heads x query groups of 8.  From two full waves of ``sms * ctas_per_sm`` resident CTA slots
    on, no split.  Below that the CTAs of a uniform batch all take the same time, so what counts is wave
    quantization: the split count whose ``batch * units * splits`` CTAs fill their last wave best, a split
    costing ``SPLIT_PENALTY`` (partial results and the merge pass), ties going to fewer splits.  No split is
    shorter than ``MIN_TILES_PER_SPLIT`` tiles of the longest possible sequence (``max_len``, the block
    table's capacity, so no device-to-host sync is needed).

    Measured on the H200 (bf16, 32/8 heads, d 128, TB/s): (64, 4096) 1 split 4.41, 2: 4.35; (8, 32768)
    4 splits 4.35, 8: 4.35, 9: 4.07 (576 CTAs: a third wave of 48), 16: 4.35; (1, 131072) 33 splits 4.16,
    66: 4.04, 128: 3.99; (16, 8192) 2 splits 4.18, 3: 3.96, 5: 3.98; (32, 2048, 64/8 heads) 1: 3.97, 2: 3.59.
    """
    slots = max(1, sms * ctas_per_sm)
    work = max(1, batch * units)
    if work >= 2 * slots:  # two waves or more: CTAs desynchronize, and splitting only adds the merge
        return 1
    tiles = -(-max(1, max_len) // TILE_TOKENS)
    top = max(1, min(MAX_SPLITS, tiles // MIN_TILES_PER_SPLIT, max(4, -(-2 * slots // work))))
    best, best_score = 1, -1.0
    for s in range(1, top + 1):
        ctas = work * s
        fill = ctas / (-(-ctas // slots) * slots)
        score = fill - (SPLIT_PENALTY if s > 1 else 0.0)
        if score > best_score + 1e-9:
            best, best_score = s, score
    return best


def _ctas_per_sm(smem: int, threads: int, smem_per_sm: int) -> int:
    return max(1, min(smem_per_sm // (smem + _RESERVED_SMEM_PER_CTA), 2048 // threads, 32))


def _attn_kernel(dtype: str, head_dim: int, page16: bool = True, pair: bool = False) -> Kernel:
    """``page16``: block_size % TILE_TOKENS == 0, so every tile lies inside one page (no per-row page lookup);
    ``pair``: two splits in one cluster, merged through DSMEM (sm_90, ``pair_merge``)."""
    warps, stages, _ = decode_config(head_dim)
    return Kernel(SOURCE, f"paged_decode_kernel<{A.CTYPE[dtype]}, {head_dim}, {warps}, {stages}, {L2_HINT}, "
                          f"{'true' if page16 else 'false'}, {'true' if pair else 'false'}>")


def _merge_kernel(dtype: str, head_dim: int) -> Kernel:
    return Kernel(SOURCE, f"decode_merge_kernel<{A.CTYPE[dtype]}, {head_dim}>")


@lru_cache(maxsize=1024)
def merge_threads(num_splits: int, head_dim: int) -> int:
    """One warp per 1 (2 at head_dim 64) splits, up to 8 warps: a row's splits are all loaded at once."""
    per_warp = 2 if head_dim == 64 else 1
    return 32 * max(1, min(8, -(-num_splits // per_warp)))


# -- the memory-bound elementwise ops -------------------------------------------------------------------------
_WORD_TYPES = {16: "uint4", 4: "unsigned int", 2: "unsigned short"}
CACHE_DTYPES = ("float16", "bfloat16", "float32")
MAX_ROT_DIM = 1024
_ACTS = {"silu": 0, "gelu": 1}


def _cache_kernel(word_bytes: int) -> Kernel:
    return Kernel(SOURCE, f"reshape_and_cache_kernel<{_WORD_TYPES[word_bytes]}>")


def _rotary_kernel(dtype: str, cs_dtype: str, neox: bool, vec: bool) -> Kernel:
    return Kernel(SOURCE, f"rotary_embedding_kernel<{A.CTYPE[dtype]}, {A.CTYPE[cs_dtype]}, "
                          f"{'true' if neox else 'false'}, {'true' if vec else 'false'}>")


def _rotary_cache_kernel(dtype: str, cs_dtype: str, neox: bool) -> Kernel:
    return Kernel(SOURCE, f"rotary_cache_kernel<{A.CTYPE[dtype]}, {A.CTYPE[cs_dtype]}, {'true' if neox else 'false'}>")


def _act_kernel(dtype: str, act: str, vec: bool) -> Kernel:
    return Kernel(SOURCE, f"gated_act_kernel<{A.CTYPE[dtype]}, {_ACTS[act]}, {'true' if vec else 'false'}>")


def all_kernels() -> list:
    """Every variant this module can launch (for ``python -m speedcore compile``)."""
    out = []
    for dtype in A.HALF_DTYPES:
        for d in HEAD_DIMS:
            for page16 in (True, False):
                for pair in (False, True):
                    out.append(_attn_kernel(dtype, d, page16, pair))
            out.append(_merge_kernel(dtype, d))
    for w in sorted(_WORD_TYPES):
        out.append(_cache_kernel(w))
    for dtype in A.FLOAT_DTYPES:
        for cs in sorted({dtype, "float32"}):
            for neox in (True, False):
                for vec in (True, False):
                    out.append(_rotary_kernel(dtype, cs, neox, vec))
                out.append(_rotary_cache_kernel(dtype, cs, neox))
        for act in _ACTS:
            for vec in (True, False):
                out.append(_act_kernel(dtype, act, vec))
    return out


# -- helpers ----------------------------------------------------------------------------------------------------



def _aligned16(a: A.Array, strides) -> bool:
    return a.aligned(16) and all((s * a.itemsize) % 16 == 0 for s in strides)


def _check_float(name: str, value, *, low: float | None = None, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or (low is not None and value < low):
        bound = f" >= {low}" if low is not None else ""
        raise ValueError(f"{name}: expected a finite float{bound}, got {value}")
    return value


# -- paged decode attention ---------------------------------------------------------------------------------
def _plan_paged_decode(qa, ka, va, bta, sla, oa, softmax_scale, softcap, window_left, *, sms: int,
                       smem_per_sm: int, num_splits=None) -> dict:
    """Validate the arguments (already wrapped) and choose the launch; raises before anything is launched."""
    A.check_dtype(qa, A.HALF_DTYPES)
    A.check_same_dtype(qa, ka, va, oa)
    A.check_same_device(qa, ka, va, bta, sla, oa)
    A.check_dtype(bta, ("int32",))
    A.check_dtype(sla, ("int32",))
    if qa.ndim != 3:
        raise ValueError(f"q: expected shape (batch, num_heads, head_dim), got {qa.shape}")
    batch, heads, head_dim = qa.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"q: head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if qa.strides[2] != 1 or not qa.aligned(4) or qa.strides[0] % 2 or qa.strides[1] % 2:
        raise ValueError(f"q: the head_dim dimension must be contiguous with even strides and a 4-byte aligned "
                         f"pointer, got strides {qa.strides}")
    if ka.ndim != 4:
        raise ValueError(f"k_cache: expected shape (num_blocks, block_size, num_kv_heads, head_dim), got {ka.shape}")
    num_blocks, block_size, kv_heads, kd = ka.shape
    if kd != head_dim:
        raise ValueError(f"k_cache: head_dim {kd} does not match q's {head_dim}")
    if num_blocks < 1 or block_size < 1 or kv_heads < 1:
        raise ValueError(f"k_cache: needs at least one block, block slot and KV head, got shape {ka.shape}")
    if heads < 1 or heads % kv_heads:
        raise ValueError(f"q: num_heads {heads} must be a positive multiple of k_cache's num_kv_heads {kv_heads}")
    A.check_shape(va, ka.shape)
    if va.strides != ka.strides:
        raise ValueError(f"v_cache: strides {va.strides} must equal k_cache's {ka.strides}")
    for c in (ka, va):
        if c.strides[3] != 1 or not _aligned16(c, c.strides[:3]):
            raise ValueError(f"{c.name}: head_dim must be contiguous, the other strides multiples of 16 bytes and "
                             f"the pointer 16-byte aligned, got strides {c.strides}")
    if bta.ndim != 2 or bta.shape[0] != batch or bta.shape[1] < 1:
        raise ValueError(f"block_table: expected shape ({batch}, max_blocks_per_seq >= 1), got {bta.shape}")
    if bta.shape[1] > 1 and bta.strides[1] != 1:
        raise ValueError(f"block_table: rows must be contiguous, got strides {bta.strides}")
    A.check_shape(sla, (batch,))
    max_len = bta.shape[1] * block_size
    if max_len >= 2 ** 31 - TILE_TOKENS:
        raise ValueError(f"block_table: {bta.shape[1]} blocks of {block_size} tokens exceed 2**31 tokens")
    if oa is not None:
        A.check_shape(oa, qa.shape)
        if oa.strides[2] != 1:
            raise ValueError(f"out: the head_dim dimension must be contiguous, got strides {oa.strides}")
        A.check_no_overlap(oa, qa, ka, va, bta, sla)
    scale = _check_float("softmax_scale", softmax_scale, allow_none=True)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    cap = _check_float("softcap", softcap, low=0.0)
    if isinstance(window_left, bool) or not isinstance(window_left, (int, np.integer)):
        raise TypeError(f"window_left: expected an int, got {type(window_left).__name__}")
    window_left = int(window_left)
    if window_left < -1 or window_left >= 2 ** 31:
        raise ValueError(f"window_left: expected -1 (no window) or a non-negative int32, got {window_left}")
    group = heads // kv_heads
    qgroups = -(-group // QUERIES_PER_CTA)
    units = kv_heads * qgroups
    warps, stages, smem = decode_config(head_dim)
    if num_splits is None:
        num_splits = decode_num_splits(batch, units, max_len, sms, _ctas_per_sm(smem, warps * 32, smem_per_sm))
    elif not 1 <= int(num_splits) <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected 1 to {MAX_SPLITS}, got {num_splits}")
    num_splits = int(num_splits)
    if batch * num_splits * units >= 2 ** 31:
        raise ValueError("q: batch x heads x splits is too large for one launch")
    if cap > 0.0:
        scale_a, cap_log2 = scale / cap, cap * math.log2(math.e)
    else:
        scale_a, cap_log2 = scale * math.log2(math.e), 0.0
    return dict(batch=batch, heads=heads, head_dim=head_dim, kv_heads=kv_heads, group=group, qgroups=qgroups,
                units=units, num_splits=num_splits, block_size=block_size, num_blocks=num_blocks, max_len=max_len,
                warps=warps, smem=smem, scale_a=scale_a, cap_log2=cap_log2, use_softcap=cap > 0.0,
                window_left=window_left)


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, *, softmax_scale=None, softcap=0.0,
                           window_left=-1, out=None, return_lse=False):
    """Attention of one new token per sequence over a paged KV cache (decode), with GQA and split-KV.

    Query head ``h`` attends KV head ``h // (num_heads // num_kv_heads)``.  Sequence ``b`` has
    ``seq_lens[b]`` cached tokens; token ``t`` lives in page ``block_table[b, t // block_size]`` at slot
    ``t % block_size``.  The new token is the last one (its K/V must already be in the cache, e.g. by
    :func:`reshape_and_cache`), so it attends tokens ``[max(0, seq_len - 1 - window_left), seq_len)``.
    Logits are ``softmax_scale * q.k``, or ``softcap * tanh(softmax_scale * q.k / softcap)`` when
    ``softcap > 0``.  Accumulation is in float32.

    Parameters
    ----------
    q : torch.Tensor or cupy.ndarray, shape (batch, num_heads, head_dim)
        float16 or bfloat16; head_dim 64, 128 or 256; head_dim contiguous (any other strides, even).
    k_cache, v_cache : shape (num_blocks, block_size, num_kv_heads, head_dim), q's dtype
        Same shape and strides; head_dim contiguous, other strides multiples of 16 bytes.  Any block size
        (16 and above is as fast as 256); num_heads must be a multiple of num_kv_heads.
    block_table : int32, shape (batch, max_blocks_per_seq), rows contiguous
        Entries past a sequence's last page are never read; entries must lie in [0, num_blocks).
    seq_lens : int32, shape (batch,)
        0 <= seq_lens[b] <= max_blocks_per_seq * block_size (larger values are clamped to that bound).  A
        sequence of length 0 gives zeros (and lse = -inf).
    softmax_scale : float, default 1 / sqrt(head_dim)
    softcap : float >= 0, default 0 (off)
    window_left : int, default -1 (no window); otherwise the number of earlier tokens attended.
    out : optional, shape (batch, num_heads, head_dim), q's dtype, head_dim contiguous; written and returned.
    return_lse : bool
        Also return the float32 log-sum-exp (natural log) of the logits, shape (batch, num_heads).

    Returns
    -------
    out, or (out, lse) with ``return_lse``; arrays of q's library, computed on the caller's current stream.
    """
    if _torch_hook.compiling():
        return _torch_hook.op("paged_decode_attention")(q, k_cache, v_cache, block_table, seq_lens,
                                                        softmax_scale=softmax_scale, softcap=softcap,
                                                        window_left=window_left, out=out, return_lse=return_lse)
    try:
        run = _FAST_DECODE.get((sig(q), sig(k_cache), sig(v_cache), sig(block_table), sig(seq_lens), sig(out),
                                type(softmax_scale), softmax_scale, type(softcap), softcap, type(window_left),
                                window_left, return_lse is True))
    except TypeError:  # an unhashable argument: the full check names it
        run = None
    if run is not None and not A.CHECK_INDICES:
        result = run(q, k_cache, v_cache, block_table, seq_lens, out)
        if result is not None:
            return result
    qa = A.wrap(q, "q")
    ka = A.wrap(k_cache, "k_cache")
    va = A.wrap(v_cache, "v_cache")
    bta = A.wrap(block_table, "block_table")
    sla = A.wrap(seq_lens, "seq_lens")
    oa = A.wrap(out, "out", optional=True)
    return _paged_decode(qa, ka, va, bta, sla, oa, softmax_scale, softcap, window_left, return_lse)


# paged_decode_attention's arguments (signatures and scalars) -> its launch; see _arrays.sig
_FAST_DECODE: dict = plan_cache()


_MAX_PLANS = 256


def _decode_plan(qa, ka, va, bta, sla, oa, softmax_scale, softcap, window_left, num_splits) -> dict:
    """Validate the arguments and build the launch plan (kernels, configurations, scalar arguments); a repeated
    call signature skips this through the cached launch in _FAST_DECODE."""
    dev = device_info(qa.device)
    p = _plan_paged_decode(qa, ka, va, bta, sla, oa, softmax_scale, softcap, window_left, sms=dev.sms,
                           smem_per_sm=dev.smem_per_sm, num_splits=num_splits)
    batch, heads, head_dim, splits = p["batch"], p["heads"], p["head_dim"], p["num_splits"]
    o_strides = oa.strides[:2] if oa is not None else (heads * head_dim, head_dim)
    pair = pair_merge(dev.cc, splits)
    plan = dict(
        batch=batch, heads=heads, head_dim=head_dim, splits=splits, pair=pair, max_len=p["max_len"],
        block_size=p["block_size"], num_blocks=p["num_blocks"],
        kernel=_attn_kernel(qa.dtype, head_dim, p["block_size"] % TILE_TOKENS == 0, pair),
        cfg=LaunchConfig((max(1, batch * splits * p["units"]),), (p["warps"] * 32,), p["smem"],
                         cluster=2 if pair else 1),
        scalars=(np.int32(heads), np.int32(p["group"]), np.int32(p["qgroups"]), np.int32(p["units"]), np.int32(splits),
                 np.int32(p["block_size"]), np.int32(p["num_blocks"]), np.int32(p["max_len"]),
                 np.int64(qa.strides[0]), np.int64(qa.strides[1]), np.int64(o_strides[0]), np.int64(o_strides[1]),
                 np.int64(ka.strides[0]), np.int64(ka.strides[1]), np.int64(ka.strides[2]),
                 np.int64(bta.strides[0]), np.int64(sla.strides[0]), np.float32(p["scale_a"]),
                 np.float32(p["cap_log2"]), np.int32(p["use_softcap"]), np.int32(p["window_left"])),
        merge_kernel=_merge_kernel(qa.dtype, head_dim),
        # sm_90: a programmatic dependent launch (it waits for the attention kernel in-kernel: griddepcontrol)
        merge_cfg=LaunchConfig((max(1, batch * heads),), (merge_threads(splits, head_dim),),
                               overlap=dev.cc >= (9, 0)),
        merge_scalars=(np.int32(heads), np.int32(splits), np.int64(o_strides[0]), np.int64(o_strides[1])),
        partial_floats=batch * heads * splits * head_dim)
    return plan


def _paged_decode(qa, ka, va, bta, sla, oa, softmax_scale, softcap, window_left, return_lse, num_splits=None):
    p = _decode_plan(qa, ka, va, bta, sla, oa, softmax_scale, softcap, window_left, num_splits)
    if A.CHECK_INDICES:
        _check_decode_indices(bta, sla, p)
    run = _decode_launch(p, qa, ka, va, bta, sla, oa, bool(return_lse))
    result = run(qa.obj, ka.obj, va.obj, bta.obj, sla.obj, oa.obj if oa is not None else None)
    if num_splits is None and p["batch"]:
        key = (sig(qa.obj), sig(ka.obj), sig(va.obj), sig(bta.obj), sig(sla.obj), sig(oa.obj if oa is not None else None),
               type(softmax_scale), softmax_scale, type(softcap), softcap, type(window_left), window_left,
               return_lse is True)
        if A.cacheable(key):
            if len(_FAST_DECODE) >= _MAX_PLANS:
                _FAST_DECODE.clear()
            _FAST_DECODE[key] = run
    return result


def _check_decode_indices(bta, sla, p) -> None:
    """SPEEDCORE_CHECK_INDICES=1: the block ids a launch would read and the sequence lengths, read back (a sync)."""
    lens = A.to_host(sla.obj).astype(np.int64)
    if lens.size and (lens.min() < 0 or lens.max() > p["max_len"]):
        raise ValueError(f"seq_lens: values must lie in [0, {p['max_len']}] (block_table's capacity), got "
                         f"{lens.min()}..{lens.max()}")
    table = A.to_host(bta.obj)
    used = -(-lens // p["block_size"])
    for b, n in enumerate(used):
        row = table[b, :n]
        if row.size and (row.min() < 0 or row.max() >= p["num_blocks"]):
            raise ValueError(f"block_table: row {b} holds block ids outside [0, {p['num_blocks']}) within its "
                             f"first {n} entries (seq_lens[{b}] = {lens[b]})")


def _decode_launch(p, qa, ka, va, bta, sla, oa, return_lse: bool):
    """``run(q, k_cache, v_cache, block_table, seq_lens, out)``: one validated call signature's launches; per call
    the pointers, the outputs (and split workspace) allocated, the overlap check with ``out`` (None where it
    fails, so the full path raises) and one or two launches."""
    lib = A.fast_lib(qa.lib)
    ptr, stream, empty, empty_like = lib.ptr, lib.stream, lib.empty, lib.empty_like
    batch, heads, splits = p["batch"], p["heads"], p["splits"]
    shape, dtype, device = qa.shape, qa.dtype, qa.device
    merge = splits > 1 and not p["pair"]
    ws_floats = p["partial_floats"] + batch * heads * splits
    part_l_offset = 4 * p["partial_floats"]
    exts = tuple(A.extent(a) for a in (qa, ka, va, bta, sla))
    o_ext = A.extent(oa) if oa is not None else 0
    same_layout = tuple(oa is not None and a.shape == oa.shape and a.strides == oa.strides
                        for a in (qa, ka, va, bta, sla))
    scratch = A.scratch_ref(qa.lib, device)
    if batch:
        attn = bind(p["kernel"], chained(p["cfg"], device), device).prepacked((int,) * 9, p["scalars"])
        if merge:
            merge_launch = bind(p["merge_kernel"], p["merge_cfg"], device).prepacked((int,) * 4,
                                                                                    p["merge_scalars"])

    def run(q, k_cache, v_cache, block_table, seq_lens, out):
        ptrs = (ptr(q), ptr(k_cache), ptr(v_cache), ptr(block_table), ptr(seq_lens))
        if out is None:
            out = empty_like(q)
            op = ptr(out)
        else:
            op = ptr(out)
            for ip, ie, same in zip(ptrs, exts, same_layout):
                # out may be q itself (as the full check allows): each CTA reads its q rows before any output
                if o_ext and ie and ip < op + o_ext and op < ip + ie and not (ip == op and same):
                    return None
        lse = empty((batch, heads), "float32", device) if return_lse else None
        result = (out, lse) if return_lse else out
        if not batch:
            return result
        lse_ptr = ptr(lse) if return_lse else 0
        s = stream(device)
        if merge:
            # one workspace: partial outputs, then the partial log-sum-exps (16-byte aligned: head_dim % 64 == 0).
            # The stream's scratch buffer (launches on one stream run in order): no allocation per call, and none
            # inside a CUDA-graph capture (graphs captured on one stream share it: replay them in order).
            part_o = A.stream_buffer("decode_workspace", scratch, s, ws_floats, "float32").ptr
            part_l = part_o + part_l_offset
            attn(s, op, 0, part_o, part_l, *ptrs)
            merge_launch(s, op, lse_ptr, part_o, part_l)
        else:
            attn(s, op, lse_ptr, 0, 0, *ptrs)
        return result

    return run


# -- reshape_and_cache ----------------------------------------------------------------------------------------
def _plan_reshape_and_cache(ka, va, kca, vca, sma) -> dict:
    A.check_dtype(ka, CACHE_DTYPES)
    A.check_same_dtype(ka, va, kca, vca)
    A.check_same_device(ka, va, kca, vca, sma)
    A.check_dtype(sma, ("int64", "int32"))
    if ka.ndim != 3:
        raise ValueError(f"k: expected shape (num_tokens, num_kv_heads, head_dim), got {ka.shape}")
    A.check_shape(va, ka.shape)
    tokens, heads, head_dim = ka.shape
    if kca.ndim != 4 or kca.shape[2:] != (heads, head_dim):
        raise ValueError(f"k_cache: expected shape (num_blocks, block_size, {heads}, {head_dim}), got {kca.shape}")
    A.check_shape(vca, kca.shape)
    if vca.strides != kca.strides:
        raise ValueError(f"v_cache: strides {vca.strides} must equal k_cache's {kca.strides}")
    for a in (ka, va, kca, vca):
        if head_dim > 1 and a.strides[-1] != 1:
            raise ValueError(f"{a.name}: head_dim must be contiguous, got strides {a.strides}")
    if sma.ndim != 1 or sma.shape[0] != tokens or (tokens > 1 and sma.strides[0] != 1):
        raise ValueError(f"slot_mapping: expected a contiguous shape ({tokens},), got shape {sma.shape} "
                         f"strides {sma.strides}")
    A.check_no_overlap(kca, ka, va, sma)
    A.check_no_overlap(vca, ka, va, sma, kca)
    num_blocks, block_size = kca.shape[:2]
    if num_blocks * block_size >= 2 ** 31:
        raise ValueError(f"k_cache: {num_blocks} blocks of {block_size} slots exceed 2**31 slots")
    item = ka.itemsize
    word = 16 if ((head_dim * item) % 16 == 0 and _aligned16(ka, ka.strides[:2]) and _aligned16(va, va.strides[:2])
                  and _aligned16(kca, kca.strides[:3]) and _aligned16(vca, vca.strides[:3])) else item
    f = word // item
    return dict(tokens=tokens, heads=heads, word=word, words_per_head=head_dim // f, block_size=block_size,
                num_slots=num_blocks * block_size,
                k_strides=(ka.strides[0] // f, ka.strides[1] // f), v_strides=(va.strides[0] // f, va.strides[1] // f),
                c_strides=tuple(s // f for s in kca.strides[:3]))


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    """Write new tokens' K and V into their slots of the paged caches (in place), as vLLM's kernel.

    Token ``t`` goes to page ``slot_mapping[t] // block_size``, row ``slot_mapping[t] % block_size``.  Slots
    that are negative (vLLM pads with -1) or >= num_blocks * block_size are skipped.

    Parameters
    ----------
    k, v : shape (num_tokens, num_kv_heads, head_dim); float16, bfloat16 or float32; head_dim contiguous
        (any token and head strides, e.g. slices of a fused QKV projection).
    k_cache, v_cache : shape (num_blocks, block_size, num_kv_heads, head_dim), k's dtype, same strides,
        head_dim contiguous.
    slot_mapping : int64 or int32, contiguous, shape (num_tokens,)

    Returns
    -------
    None (the caches are updated on the caller's current stream).
    """
    if _torch_hook.compiling():
        return _torch_hook.op("reshape_and_cache")(k, v, k_cache, v_cache, slot_mapping)
    key = (sig(k), sig(v), sig(k_cache), sig(v_cache), sig(slot_mapping))
    run = _FAST_CACHE.get(key)
    if run is not None and run(k, v, k_cache, v_cache, slot_mapping):
        return None
    ka = A.wrap(k, "k")
    va = A.wrap(v, "v")
    kca = A.wrap(k_cache, "k_cache")
    vca = A.wrap(v_cache, "v_cache")
    sma = A.wrap(slot_mapping, "slot_mapping")
    p = _plan_reshape_and_cache(ka, va, kca, vca, sma)
    if p["tokens"] == 0 or p["heads"] * p["words_per_head"] == 0:
        return None
    per_token = p["heads"] * p["words_per_head"]
    scalars = (np.int32(sma.dtype == "int64"), np.int32(p["words_per_head"]), np.int32(p["heads"]),
               np.int32(p["block_size"]), np.int64(p["num_slots"]), np.int64(p["k_strides"][0]),
               np.int64(p["k_strides"][1]), np.int64(p["v_strides"][0]), np.int64(p["v_strides"][1]),
               np.int64(p["c_strides"][0]), np.int64(p["c_strides"][1]), np.int64(p["c_strides"][2]))
    lcfg = chained(LaunchConfig((p["tokens"], -(-per_token // 128)), (128,)), ka.device)
    launch = bind(_cache_kernel(p["word"]), lcfg, ka.device).prepacked((int,) * 5, scalars)
    launch(A.stream_of(ka).ptr, kca.ptr, vca.ptr, ka.ptr, va.ptr, sma.ptr)
    if A.cacheable(key):
        if len(_FAST_CACHE) >= _MAX_PLANS:
            _FAST_CACHE.clear()
        _FAST_CACHE[key] = _cache_plan(launch, scalars, ka, va, kca, vca, sma)
    return None


_FAST_CACHE: dict = plan_cache()  # reshape_and_cache's argument signatures -> its launch


def _caches_overlap(kcp: int, vcp: int, c_ext: int, inputs) -> bool:
    """Whether the caches (``c_ext`` bytes each from kcp / vcp) overlap each other or an input's (pointer, extent)
    span: the cached plans' per-call form of the full path's ``check_no_overlap``."""
    for cp in (kcp, vcp):
        for ip, ie in inputs:
            if ip < cp + c_ext and cp < ip + ie:
                return True
    return kcp < vcp + c_ext and vcp < kcp + c_ext


def _cache_plan(launch, scalars, ka, va, kca, vca, sma):
    """Per call: pointers, the caches' overlap checks (False where one fails, so the full path raises), the
    launch."""
    lib = A.fast_lib(ka.lib)
    ptr, stream, device = lib.ptr, lib.stream, ka.device
    k_ext, v_ext, c_ext, s_ext = A.extent(ka), A.extent(va), A.extent(kca), A.extent(sma)

    def run(k, v, k_cache, v_cache, slot_mapping):
        kp, vp, kcp, vcp, sp = ptr(k), ptr(v), ptr(k_cache), ptr(v_cache), ptr(slot_mapping)
        if _caches_overlap(kcp, vcp, c_ext, ((kp, k_ext), (vp, v_ext), (sp, s_ext))):
            return False
        launch(stream(device), kcp, vcp, kp, vp, sp)
        return True

    return run


# -- rotary_embedding -------------------------------------------------------------------------------------------
def _plan_rotary(pa, qa, ka, csa, is_neox) -> dict:
    A.check_dtype(pa, ("int64", "int32"))
    A.check_dtype(qa, A.FLOAT_DTYPES)
    A.check_same_dtype(qa, ka)
    A.check_same_device(qa, pa, ka, csa)
    if csa.dtype not in ("float32", qa.dtype):
        raise TypeError(f"cos_sin_cache: dtype {csa.dtype} is not supported; expected float32 or q's {qa.dtype}")
    if not isinstance(is_neox, (bool, np.bool_)):
        raise TypeError(f"is_neox: expected a bool, got {type(is_neox).__name__}")
    if pa.numel > 1 and not pa.is_contiguous():
        raise ValueError(f"positions: must be contiguous, got strides {pa.strides}")
    lead = tuple(pa.shape)
    if qa.ndim != len(lead) + 2 or tuple(qa.shape[:-2]) != lead:
        raise ValueError(f"q: expected shape {lead + ('num_heads', 'head_size')} (positions' shape, then heads "
                         f"and head size), got {qa.shape}")
    tokens = pa.numel
    q_heads, head_size = qa.shape[-2:]
    if ka is not None:
        if ka.ndim != qa.ndim or tuple(ka.shape[:-2]) != lead or ka.shape[-1] != head_size:
            raise ValueError(f"k: expected shape {lead + ('num_kv_heads', head_size)}, got {ka.shape}")
    k_heads = ka.shape[-2] if ka is not None else 0
    if csa.ndim != 2:
        raise ValueError(f"cos_sin_cache: expected shape (max_position, rot_dim), got {csa.shape}")
    max_pos, rot_dim = csa.shape
    if rot_dim < 2 or rot_dim % 2 or rot_dim > min(head_size, MAX_ROT_DIM) or max_pos < 1:
        raise ValueError(f"cos_sin_cache: rot_dim (last dimension) must be even, >= 2 and <= min(head_size="
                         f"{head_size}, {MAX_ROT_DIM}), and max_position >= 1; got shape {csa.shape}")
    if csa.strides[1] != 1:
        raise ValueError(f"cos_sin_cache: the last dimension must be contiguous, got strides {csa.strides}")
    strides = {}
    for a in (qa, ka):
        if a is None:
            continue
        if head_size > 1 and a.strides[-1] != 1:
            raise ValueError(f"{a.name}: head_size must be contiguous, got strides {a.strides}")
        strides[a.name] = (a.lead_stride(len(lead), "tokens"), a.strides[-2])
    n = 16 // qa.itemsize
    span = rot_dim // 2 if is_neox else rot_dim
    # the cos/sin values of one task are read as one vector of (n or n/2) values: check its alignment
    cs_bytes = (n if is_neox else n // 2) * csa.itemsize
    cs_align = 16 if cs_bytes % 16 == 0 else cs_bytes if cs_bytes in (4, 8) else 0
    cs_vec = cs_align > 0 and csa.aligned(cs_align) and (csa.strides[0] * csa.itemsize) % cs_align == 0 and (
        (rot_dim // 2) * csa.itemsize) % cs_align == 0
    vec = span % n == 0 and cs_vec and all(_aligned16(a, strides[a.name]) for a in (qa, ka) if a is not None)
    per_token = (q_heads + k_heads) * (span // n if vec else rot_dim // 2)
    if tokens * per_token >= 2 ** 31:
        raise ValueError(f"q: {tokens} tokens x {per_token} rotary tasks per token exceed 2**31; split the call")
    return dict(tokens=tokens, q_heads=q_heads, k_heads=k_heads, rot_dim=rot_dim, max_pos=max_pos, vec=vec,
                tasks=tokens * per_token,
                q_strides=strides["q"], k_strides=strides.get("k", (0, 0)))


def rotary_embedding(positions, q, k, cos_sin_cache, *, is_neox=True):
    """Rotary position embedding applied in place to ``q`` and ``k``, as vLLM's ``rotary_embedding``.

    ``cos_sin_cache[p]`` holds ``[cos(p * f_0..f_{r/2-1}), sin(...)]`` for rot_dim ``r``; the first ``r`` dims
    of every head are rotated, the rest are left unchanged (partial rotary).  ``is_neox`` pairs dim ``i`` with
    ``i + r/2`` (GPT-NeoX / Llama); otherwise dims ``2i`` and ``2i+1`` (GPT-J).  Math in float32.

    Parameters
    ----------
    positions : int64 or int32, contiguous, any shape (num_tokens,) or (batch, seq)
        Values must lie in [0, max_position) (they are clamped to it).
    q : shape (*positions.shape, num_heads, head_size); float16, bfloat16 or float32; head_size contiguous,
        the token dims collapsible to one stride (any head stride: slices of a fused QKV work).
    k : same layout with num_kv_heads heads and q's head_size and dtype, or None.  q and k may be views of one
        fused QKV tensor but must not share elements.
    cos_sin_cache : shape (max_position, rot_dim), float32 or q's dtype; rot_dim even, <= head_size, <= 1024.
    is_neox : bool, default True.

    Returns
    -------
    (q, k), the same objects, rotated in place on the caller's current stream.
    """
    if _torch_hook.compiling():
        return _torch_hook.op("rotary_embedding")(positions, q, k, cos_sin_cache, is_neox=is_neox)
    try:
        key = (sig(positions), sig(q), sig(k), sig(cos_sin_cache), type(is_neox), is_neox)
        run = _FAST_ROTARY.get(key)
    except TypeError:  # an unhashable is_neox: the full check names it
        key = run = None
    if run is not None and run(positions, q, k, cos_sin_cache):
        return q, k
    pa = A.wrap(positions, "positions")
    qa = A.wrap(q, "q")
    ka = A.wrap(k, "k", optional=True)
    csa = A.wrap(cos_sin_cache, "cos_sin_cache")
    p = _plan_rotary(pa, qa, ka, csa, is_neox)
    if p["tokens"] == 0 or p["q_heads"] + p["k_heads"] == 0:
        return q, k
    scalars = (np.int64(csa.strides[0]), np.int32(p["rot_dim"]), np.int32(p["max_pos"]), np.int32(p["q_heads"]),
               np.int32(p["k_heads"]), np.int64(p["q_strides"][0]), np.int64(p["q_strides"][1]),
               np.int64(p["k_strides"][0]), np.int64(p["k_strides"][1]), np.int32(p["tokens"]))
    kern = _rotary_kernel(qa.dtype, csa.dtype, bool(is_neox), p["vec"])
    is64 = np.int32(pa.dtype == "int64")
    launch = bind(kern, chained(LaunchConfig((-(-p["tasks"] // 256),), (256,)), qa.device), qa.device).fixed(
        (int, int, int, np.int32, int) + tuple(map(type, scalars)))
    launch(A.stream_of(qa).ptr, (qa.ptr, ka.ptr if ka is not None else 0, pa.ptr, is64, csa.ptr) + scalars)
    if key is not None and A.cacheable(key):
        if len(_FAST_ROTARY) >= _MAX_PLANS:
            _FAST_ROTARY.clear()
        _FAST_ROTARY[key] = _rotary_plan(launch, is64, scalars, pa, qa, ka, csa)
    return q, k


_FAST_ROTARY: dict = plan_cache()  # rotary_embedding's argument signatures -> its launch


def _rotary_plan(launch, is64, scalars, pa, qa, ka, csa):
    """Per call: the pointers and the launch (the full path checks no pointer values here either)."""
    lib = A.fast_lib(qa.lib)
    ptr, stream, device = lib.ptr, lib.stream, qa.device

    def run(positions, q, k, cos_sin_cache):
        launch(stream(device), (ptr(q), ptr(k) if k is not None else 0, ptr(positions), is64, ptr(cos_sin_cache))
               + scalars)
        return True

    return run


# -- rotary_embedding_and_cache --------------------------------------------------------------------------------
def rotary_embedding_and_cache(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, *, is_neox=True):
    """:func:`rotary_embedding` of ``q`` and ``k`` in place, then :func:`reshape_and_cache` of the rotated ``k`` and
    of ``v``, in one kernel where it can (a decode step's one launch between the QKV projection and attention).

    Arguments as those two functions take them (positions, q, k and v of shape (num_tokens, heads, head_size),
    one token dimension; q, k and v may be views of one fused QKV tensor but must not share elements).  One kernel
    (``rotary_cache_kernel``) where the rotation covers the whole head (rot_dim = head_size) and every row is
    16-byte aligned; otherwise the two kernels, with the same result.

    Returns
    -------
    (q, k), rotated in place; the caches are updated, on the caller's current stream.
    """
    if _torch_hook.compiling():
        rotary_embedding(positions, q, k, cos_sin_cache, is_neox=is_neox)
        reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
        return q, k
    try:
        key = (sig(positions), sig(q), sig(k), sig(v), sig(cos_sin_cache), sig(k_cache), sig(v_cache),
               sig(slot_mapping), type(is_neox), is_neox)
        run = _FAST_ROTARY_CACHE.get(key)
    except TypeError:  # an unhashable is_neox: the full check names it
        key = run = None
    if run is not None and run(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping):
        return q, k
    pa = A.wrap(positions, "positions")
    qa, ka, va = A.wrap(q, "q"), A.wrap(k, "k"), A.wrap(v, "v")
    csa = A.wrap(cos_sin_cache, "cos_sin_cache")
    kca, vca = A.wrap(k_cache, "k_cache"), A.wrap(v_cache, "v_cache")
    sma = A.wrap(slot_mapping, "slot_mapping")
    if pa.ndim != 1:
        raise ValueError(f"positions: expected shape (num_tokens,), got {pa.shape}")
    pr = _plan_rotary(pa, qa, ka, csa, is_neox)
    pc = _plan_reshape_and_cache(ka, va, kca, vca, sma)
    A.check_no_overlap(kca, qa)
    A.check_no_overlap(vca, qa)
    # (the two plans already require one dtype for q, k, v and the caches)
    per_head = (pr["rot_dim"] // 2 if is_neox else pr["rot_dim"]) // (16 // qa.itemsize)
    tasks = pr["tokens"] * (pr["q_heads"] + 2 * pr["k_heads"]) * per_head
    if not (pr["vec"] and pr["rot_dim"] == qa.shape[-1] and pc["word"] == 16 and tasks < 2 ** 31):
        rotary_embedding(positions, q, k, cos_sin_cache, is_neox=is_neox)
        reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
        return q, k
    if tasks == 0:
        return q, k
    i32, i64 = np.int32, np.int64
    scalars = (i64(csa.strides[0]), i32(pr["rot_dim"]), i32(pr["max_pos"]), i32(pr["q_heads"]), i32(pr["k_heads"]),
               i64(pr["q_strides"][0]), i64(pr["q_strides"][1]), i64(pr["k_strides"][0]), i64(pr["k_strides"][1]),
               i64(va.strides[0]), i64(va.strides[1]), i64(kca.strides[0]), i64(kca.strides[1]),
               i64(kca.strides[2]), i32(pc["block_size"]), i64(pc["num_slots"]), i32(pr["tokens"]))
    flags = (i32(pa.dtype == "int64"), i32(sma.dtype == "int64"))
    kern = _rotary_cache_kernel(qa.dtype, csa.dtype, bool(is_neox))
    launch = bind(kern, chained(LaunchConfig((-(-tasks // 256),), (256,)), qa.device), qa.device).fixed(
        (int,) * 6 + (np.int32, int, np.int32, int) + tuple(map(type, scalars)))

    def args(pp, qp, kp, vp, csp, kcp, vcp, sp):
        return (qp, kp, vp, kcp, vcp, pp, flags[0], sp, flags[1], csp) + scalars

    launch(A.stream_of(qa).ptr, args(pa.ptr, qa.ptr, ka.ptr, va.ptr, csa.ptr, kca.ptr, vca.ptr, sma.ptr))
    if key is not None and A.cacheable(key):
        if len(_FAST_ROTARY_CACHE) >= _MAX_PLANS:
            _FAST_ROTARY_CACHE.clear()
        _FAST_ROTARY_CACHE[key] = _rotary_cache_plan(launch, args, qa, ka, va, kca, sma)
    return q, k


_FAST_ROTARY_CACHE: dict = plan_cache()  # rotary_embedding_and_cache's argument signatures -> its launch


def _rotary_cache_plan(launch, args, qa, ka, va, kca, sma):
    """Per call: pointers, the caches' overlap checks against every input (False where one fails, so the full path
    raises), the launch."""
    lib = A.fast_lib(qa.lib)
    ptr, stream, device = lib.ptr, lib.stream, qa.device
    exts = [A.extent(a) for a in (qa, ka, va, sma)]
    c_ext = A.extent(kca)

    def run(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping):
        ins = (ptr(q), ptr(k), ptr(v), ptr(slot_mapping))
        kcp, vcp = ptr(k_cache), ptr(v_cache)
        if _caches_overlap(kcp, vcp, c_ext, zip(ins, exts)):
            return False
        launch(stream(device), args(ptr(positions), ins[0], ins[1], ins[2], ptr(cos_sin_cache), kcp, vcp, ins[3]))
        return True

    return run


# -- gated activations ------------------------------------------------------------------------------------------
def _plan_gated(xa, oa) -> dict:
    A.check_dtype(xa, A.FLOAT_DTYPES)
    A.check_same_dtype(xa, oa)
    A.check_same_device(xa, oa)
    if xa.ndim == 0 or xa.shape[-1] % 2 or xa.shape[-1] == 0:
        raise ValueError(f"x: the last dimension must be even and non-zero (2 * d), got shape {xa.shape}")
    d = xa.shape[-1] // 2
    rows, x_stride = xa.rows()
    out_shape = tuple(xa.shape[:-1]) + (d,)
    if oa is not None:
        A.check_shape(oa, out_shape)
        A.check_no_overlap(oa, xa)
    return dict(d=d, rows=rows, x_stride=x_stride, out_shape=out_shape)


def _gated(x, out, act: str):
    key = (sig(x), sig(out), act)
    run = _FAST_GATED.get(key)
    if run is not None:
        result = run(x, out)
        if result is not None:
            return result
    xa = A.wrap(x, "x")
    oa = A.wrap(out, "out", optional=True)
    p = _plan_gated(xa, oa)
    given = oa is not None
    if oa is None:
        oa = A.empty(xa, p["out_shape"], xa.dtype)
    _, o_stride = oa.rows()
    d, rows = p["d"], p["rows"]
    if rows == 0:
        return oa.obj
    n = 16 // xa.itemsize
    vec = d % n == 0 and _aligned16(xa, (p["x_stride"],)) and _aligned16(oa, (o_stride,))
    cols = d // n if vec else d
    if -(-cols // 256) >= 2 ** 16:
        raise ValueError(f"x: d = {d} is too large (at most {(2 ** 16 - 1) * 256 * (n if vec else 1)})")
    scalars = (np.int32(d), np.int64(p["x_stride"]), np.int64(o_stride))
    launch = bind(_act_kernel(xa.dtype, act, vec), chained(LaunchConfig((rows, -(-cols // 256)), (256,)), xa.device),
                  xa.device).prepacked((int, int), scalars)
    launch(A.stream_of(xa).ptr, oa.ptr, xa.ptr)
    # a new output's alignment is the allocator's (256 bytes), so it is only cached for out= calls or aligned ones
    if A.cacheable(key) and (given or oa.aligned(16)):
        if len(_FAST_GATED) >= _MAX_PLANS:
            _FAST_GATED.clear()
        _FAST_GATED[key] = _gated_plan(launch, xa, oa if given else None, p["out_shape"])
    return oa.obj


_FAST_GATED: dict = plan_cache()  # (x, out signatures, activation) -> the launch


def _gated_plan(launch, xa, oa, out_shape):
    lib = A.fast_lib(xa.lib)
    ptr, stream, new_empty = lib.ptr, lib.stream, lib.new_empty
    device = xa.device
    x_ext, o_ext = A.extent(xa), A.extent(oa) if oa is not None else 0

    def run(x, out):
        xp = ptr(x)
        if out is None:
            out = new_empty(x, out_shape)
            op = ptr(out)
        else:
            op = ptr(out)
            if xp < op + o_ext and op < xp + x_ext:
                return None
        launch(stream(device), op, xp)
        return out

    return run


def silu_and_mul(x, *, out=None):
    """SwiGLU gate: ``silu(x[..., :d]) * x[..., d:]`` for x of shape (..., 2d), as vLLM's ``silu_and_mul``.

    Parameters
    ----------
    x : shape (..., 2d); float16, bfloat16 or float32; last dim contiguous, leading dims collapsible to one
        row stride.
    out : optional, shape (..., d), x's dtype; written and returned.

    Returns
    -------
    out (computed in float32, rounded once), an array of x's library on the caller's current stream.
    """
    if _torch_hook.compiling():
        return _torch_hook.op("silu_and_mul")(x, out=out)
    return _gated(x, out, "silu")


def gelu_and_mul(x, *, out=None):
    """GeGLU gate: ``gelu(x[..., :d]) * x[..., d:]`` with the exact (erf) GELU, as vLLM's ``gelu_and_mul``.

    Parameters and result as :func:`silu_and_mul`.
    """
    if _torch_hook.compiling():
        return _torch_hook.op("gelu_and_mul")(x, out=out)
    return _gated(x, out, "gelu")
