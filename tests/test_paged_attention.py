"""paged_prefill_attention: argument checks and the launch heuristic (CPU, on described arrays), and the GPU grid
against a float64 reference (pages gathered to contiguous K/V, then exact softmax attention): shuffled block tables,
ragged cached lengths (0, 1, mid-block, 32k), ragged query lengths, shared prefix pages, GQA/MQA, causal, windows,
softcap, lse, every head dim (padded ones too), block sizes 1 to 256, poisoned outputs and unowned cache slots (NaN),
strided views, CuPy arrays."""
import math

import pytest

from speedcore import _arrays as A
from speedcore import paged_attention as P


# ---------------------------------------------------------------- CPU: heuristic and variant list

def test_kernel_head_dim():
    assert [P.kernel_head_dim(x) for x in (8, 40, 64, 72, 96, 128, 136, 200, 256)] == \
        [64, 64, 64, 128, 128, 128, 256, 256, 256]
    with pytest.raises(ValueError):
        P.kernel_head_dim(264)


@pytest.mark.parametrize("head_dim", list(range(8, 257, 8)))
@pytest.mark.parametrize("smem", [227 * 1024, 99 * 1024])
def test_config_fits_and_is_listed(head_dim, smem):
    names = {k.name for k in P.all_kernels()}
    for block_size in (1, 5, 16, 24, 32, 48, 64, 128, 256):
        d, bn, mt, warps, ctas, q_ks, rowsum_mma, stages, page_tile = P.prefill_config(head_dim, block_size, smem)
        assert d >= head_dim and d in P.HEAD_DIMS
        assert P.smem_bytes(d, bn, mt, warps, stages) <= smem
        assert page_tile == (block_size % bn == 0)
        bm = P.block_m(mt, warps)
        if mt * d <= 128:  # Q staged in the last pipeline stage
            assert bm <= 2 * bn
        assert bm <= 2 * stages * bn  # the O tile is staged in the pipeline stages
        if smem == 227 * 1024:  # the CTAs per SM the registers are capped for also fit in shared memory
            assert ctas * P.smem_bytes(d, bn, mt, warps, stages) <= 228 * 1024 - ctas * 1024
        for dtype in A.HALF_DTYPES:
            for softcap in (False, True):
                cfg = P.prefill_config(head_dim, block_size, smem)
                assert P._prefill_kernel(dtype, *cfg, softcap).name in names


def test_config_page_tile_and_budget():
    assert P.prefill_config(128, 256)[-1] and P.prefill_config(128, 32)[-1]
    assert not P.prefill_config(128, 16)[-1] and not P.prefill_config(128, 1)[-1]
    assert P.prefill_config(64, 64)[-1] and not P.prefill_config(64, 32)[-1]
    with pytest.raises(ValueError, match="shared memory"):
        P.prefill_config(256, 16, 40 * 1024)


def test_kernel_choice():
    assert P.kernel_choice(1, 128) == "verify" and P.kernel_choice(16, 64) == "verify"
    assert P.kernel_choice(4, 256) == "verify"
    assert P.kernel_choice(17, 128) == "prefill" and P.kernel_choice(512, 128) == "prefill"
    assert P.kernel_choice(4, 96) == "prefill"  # padded head dims: the prefill kernel zero-fills the columns
    assert P.kernel_choice(0, 128) == "prefill"


@pytest.mark.parametrize("d", P.VERIFY_HEAD_DIMS)
@pytest.mark.parametrize("smem", [227 * 1024, 99 * 1024])
def test_verify_config_fits_and_is_listed(d, smem):
    names = {k.name for k in P.all_kernels()}
    for columns in range(1, 16 * 8 + 1):
        warps, stages, nt, bytes_ = P.verify_config(d, columns, smem)
        assert bytes_ == P.verify_smem_bytes(d, warps, stages, nt) <= smem and stages >= 2
        assert nt in (1, 2, 4) and (nt < 4 or d < 256)
        assert 8 * nt >= min(columns, 16 if d == 256 else 32)
        for dtype in A.HALF_DTYPES:
            for page16 in (True, False):
                assert P._verify_kernel(dtype, d, warps, stages, nt, page16).name in names
            assert P._verify_merge_kernel(dtype, d).name in names


def test_verify_splits_fill_the_gpu():
    warps, stages, nt, smem = P.verify_config(128, 4 * 4)
    per_sm = P.verify_ctas_per_sm(smem, 32 * warps, 233472)
    assert per_sm == 2  # 107 KB of rings, and 255 registers per thread
    slots = 132 * per_sm
    assert P.verify_num_splits(64 * 8, 4096, 132, per_sm) == 1  # the bench shape: one wave without splitting
    assert P.verify_num_splits(2 * slots, 1 << 20, 132, per_sm) == 1
    assert P.verify_num_splits(8, 512, 132, per_sm) == 1  # 32 tiles: too short to split
    for work, max_len in [(8, 32768), (1, 131072), (24, 8192), (100, 4096)]:
        s = P.verify_num_splits(work, max_len, 132, per_sm)
        assert 1 <= s <= P.VERIFY_MAX_SPLITS and s <= max(1, max_len // 16 // P.VERIFY_MIN_TILES_PER_SPLIT)
        ctas = work * s
        assert s == 1 or ctas / (-(-ctas // slots) * slots) >= 0.9 or s == max_len // 16 // 32
    assert P.verify_num_splits(8, 32768, 132, per_sm) > 1


def test_all_kernels_are_distinct():
    ks = P.all_kernels()
    assert len(ks) == len({k.name for k in ks})
    sources = {"paged_prefill_kernel": P.SOURCE, "paged_prefill_sm90_kernel": P.SOURCE_SM90,
               "paged_verify_kernel": P.SOURCE_VERIFY, "paged_verify_merge_kernel": P.SOURCE_VERIFY}
    assert all(k.source == sources[k.name.split("<")[0]] for k in ks)
    assert all(k.hopper == ("sm90" in k.name) for k in ks)


def test_prefill_path():
    h200 = (9, 0)
    assert P.prefill_path(128, h200, False, 16) == "sm90"
    for bs in (32, 64, 128, 256, 384, 512):
        assert P.prefill_path(128, h200, False, bs) == "sm90"
    for bs in (1, 7, 8, 24, 48, 80):  # not tiled by 16-row TMA boxes (or not dividing / divided by the key tile)
        assert P.prefill_path(128, h200, False, bs) == "sm80"
    assert P.prefill_path(128, (8, 0), False, 16) == "sm80" and P.prefill_path(128, (8, 9), False, 16) == "sm80"
    assert P.prefill_path(32, h200, False, 16) == "sm80"
    assert P.prefill_path(40, h200, False, 16) == "sm90"  # zero-padded to 64 by the tensor maps
    assert P.prefill_path(256, h200, True, 16) == "sm80" and P.prefill_path(256, h200, False, 16) == "sm90"
    assert P.prefill_path(128, h200, True, 16) == "sm90"
    P.PREFILL_SM90 = False
    try:
        assert P.prefill_path(128, h200, False, 16) == "sm80"
    finally:
        P.PREFILL_SM90 = True
    names = {k.name for k in P.all_kernels()}
    for d in P.HEAD_DIMS:
        for softcap in (False, True):
            if P.prefill_path(d, h200, softcap, 16) == "sm90":
                cfg = P.prefill_sm90_config(d, softcap)
                assert P.smem_bytes_sm90(*cfg[:4]) <= 227 * 1024
                assert P._prefill_sm90_kernel("bfloat16", *cfg, softcap).name in names


def test_tma_view_strides():
    assert P._tma_view((128, 300, 8, 1), (1024, 128, 0)) == (1024, 128, 300 * 1024)
    assert P._tma_view((64, 16, 8, 100), (512, 64, 8192)) == (512, 64, 8192)
    dims = (64, 1, 1, 5)  # size-1 dimensions get a harmless stride
    assert P._tma_view(dims, (7, 7, 64)) == (64, 64, 64)


# ---------------------------------------------------------------- CPU: validation on described arrays

def fake(name, shape, dtype="bfloat16", strides=None, ptr=1 << 20, device=0, lib="torch"):
    if strides is None:
        strides, acc = [], 1
        for s in reversed(shape):
            strides.insert(0, acc)
            acc *= s
    return A.Array(None, lib, ptr, shape, strides, dtype, device, name)


def args(batch=3, total_q=40, heads=8, kv_heads=2, head_dim=128, blocks=64, block_size=16, max_blocks=10,
         dtype="bfloat16"):
    base = 1 << 28
    return dict(qa=fake("q", (total_q, heads, head_dim), dtype, ptr=base),
                ka=fake("k_cache", (blocks, block_size, kv_heads, head_dim), dtype, ptr=2 * base),
                va=fake("v_cache", (blocks, block_size, kv_heads, head_dim), dtype, ptr=3 * base),
                cqa=fake("cu_seqlens_q", (batch + 1,), "int32", ptr=4 * base),
                sua=fake("seqused_k", (batch,), "int32", ptr=5 * base),
                bta=fake("block_table", (batch, max_blocks), "int32", ptr=6 * base), oa=None)


def plan(a, max_seqlen_q=20, max_seqlen_k=100, causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0):
    return P._plan(a["qa"], a["ka"], a["va"], a["cqa"], a["sua"], a["bta"], a["oa"], max_seqlen_q, max_seqlen_k,
                   causal, softmax_scale, window_size, softcap)


def test_plan_accepts_good_arguments():
    p = plan(args())
    assert (p["batch"], p["heads"], p["heads_kv"], p["capacity"]) == (3, 8, 2, 160)
    assert p["right"] == 0 and p["left"] == -1 and p["scale"] == pytest.approx(1 / math.sqrt(128))
    p = plan(args(heads=7, kv_heads=1, head_dim=40, block_size=1, max_blocks=300), max_seqlen_k=300,
             causal=False, window_size=(16, 4), softcap=30.0)
    assert (p["left"], p["right"], p["softcap"]) == (16, 4, 30.0)
    p = plan(args(), max_seqlen_q=1000)
    assert p["max_seqlen_q"] == 40  # clamped to q's tokens
    a = args()
    a["oa"] = a["qa"]  # out may be q itself
    plan(a)


@pytest.mark.parametrize("change, exc, match", [
    (dict(qa=("q", (40, 8, 128), "float32")), TypeError, "q: dtype float32"),
    (dict(ka=("k_cache", (64, 16, 2, 128), "float16")), TypeError, "k_cache: dtype float16"),
    (dict(cqa=("cu_seqlens_q", (4,), "int64")), TypeError, "cu_seqlens_q: dtype must be int32"),
    (dict(sua=("seqused_k", (3,), "int64")), TypeError, "seqused_k: dtype must be int32"),
    (dict(bta=("block_table", (3, 10), "int64")), TypeError, "block_table: dtype must be int32"),
    (dict(qa=("q", (40, 8, 60), "bfloat16")), ValueError, "q: head_dim must be a multiple of 8"),
    (dict(qa=("q", (40, 8, 264), "bfloat16")), ValueError, "q: head_dim must be a multiple of 8"),
    (dict(qa=("q", (40, 8, 64), "bfloat16")), ValueError, "k_cache: head_dim 128 does not match"),
    (dict(qa=("q", (40, 7, 128), "bfloat16")), ValueError, "multiple of k_cache's num_kv_heads"),
    (dict(qa=("q", (2, 20, 8, 128), "bfloat16")), ValueError, "q: expected shape"),
    (dict(ka=("k_cache", (64, 16, 256), "bfloat16")), ValueError, "k_cache: expected shape"),
    (dict(va=("v_cache", (64, 16, 2, 64), "bfloat16")), ValueError, "v_cache: expected shape"),
    (dict(va=("v_cache", (64, 8, 2, 128), "bfloat16")), ValueError, "v_cache: expected shape"),
    (dict(cqa=("cu_seqlens_q", (4, 1), "int32")), ValueError, "cu_seqlens_q: expected shape"),
    (dict(cqa=("cu_seqlens_q", (0,), "int32")), ValueError, "cu_seqlens_q: expected shape"),
    (dict(sua=("seqused_k", (4,), "int32")), ValueError, "seqused_k: expected shape"),
    (dict(bta=("block_table", (2, 10), "int32")), ValueError, "block_table: expected shape"),
    (dict(bta=("block_table", (3, 0), "int32")), ValueError, "block_table: needs at least one column"),
    (dict(ka=("k_cache", (0, 16, 2, 128), "bfloat16"), va=("v_cache", (0, 16, 2, 128), "bfloat16")), ValueError,
     "k_cache: needs at least one block"),
])
def test_plan_rejects_bad_arguments(change, exc, match):
    a = args()
    for key, (name, shape, dtype) in change.items():
        a[key] = fake(name, shape, dtype, ptr=a[key].ptr)
    with pytest.raises(exc, match=match):
        plan(a)


def test_plan_rejects_bad_layouts():
    a = args()
    a["ka"] = fake("k_cache", (64, 16, 2, 128), strides=(4096, 256, 128, 1), ptr=(2 << 28) + 8)
    with pytest.raises(ValueError, match="k_cache: head_dim must be contiguous.*16-byte aligned"):
        plan(a)
    a = args()
    a["va"] = fake("v_cache", (64, 16, 2, 128), strides=(8192, 256, 128, 1), ptr=3 << 28)
    with pytest.raises(ValueError, match="v_cache: strides"):
        plan(a)
    a = args()
    a["ka"] = fake("k_cache", (64, 16, 2, 128), strides=(4096, 256, 1, 2), ptr=2 << 28)
    a["va"] = fake("v_cache", (64, 16, 2, 128), strides=(4096, 256, 1, 2), ptr=3 << 28)
    with pytest.raises(ValueError, match="k_cache: head_dim must be contiguous"):
        plan(a)
    a = args()
    a["qa"] = fake("q", (40, 8, 128), strides=(1024, 1, 8), ptr=1 << 28)
    with pytest.raises(ValueError, match="q: the last dimension"):
        plan(a)
    a = args()
    a["bta"] = fake("block_table", (3, 10), "int32", strides=(10, 2), ptr=6 << 28)
    with pytest.raises(ValueError, match="block_table: the last dimension must be contiguous"):
        plan(a)
    a = args()
    a["cqa"] = fake("cu_seqlens_q", (4,), "int32", strides=(2,), ptr=4 << 28)
    with pytest.raises(ValueError, match="cu_seqlens_q: the last dimension must be contiguous"):
        plan(a)
    a = args()
    a["oa"] = fake("out", (40, 8, 128), ptr=(1 << 28) + 512)  # overlaps q, shifted
    with pytest.raises(ValueError, match="out: overlaps q"):
        plan(a)
    a = args()
    a["oa"] = fake("out", (40, 8, 128), ptr=2 << 28)
    with pytest.raises(ValueError, match="out: overlaps k_cache"):
        plan(a)
    a = args()
    a["oa"] = fake("out", (40, 8, 64), ptr=7 << 28)
    with pytest.raises(ValueError, match="out: expected shape"):
        plan(a)
    a = args()
    a["oa"] = fake("out", (40, 8, 128), strides=(1028, 128, 1), ptr=7 << 28)
    with pytest.raises(ValueError, match="out: needs"):
        plan(a)
    a = args()
    a["oa"] = fake("out", (40, 8, 128), dtype="float16", ptr=7 << 28)
    with pytest.raises(TypeError, match="out: dtype float16"):
        plan(a)
    a = args()
    a["bta"] = fake("block_table", (3, 10), "int32", lib="cupy", ptr=6 << 28)
    with pytest.raises(TypeError, match="one library"):
        plan(a)
    a = args()
    a["sua"] = fake("seqused_k", (3,), "int32", device=1, ptr=5 << 28)
    with pytest.raises(ValueError, match="seqused_k: is on cuda:1"):
        plan(a)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(max_seqlen_k=161), ValueError, "max_seqlen_k: 161 tokens do not fit"),
    (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k: must be >= 0"),
    (dict(max_seqlen_q=2.0), TypeError, "max_seqlen_q: expected an int"),
    (dict(max_seqlen_q=True), TypeError, "max_seqlen_q: expected an int"),
    (dict(causal="yes"), TypeError, "causal"),
    (dict(softmax_scale=0.0), ValueError, "softmax_scale"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(window_size=5), TypeError, "window_size"),
    (dict(window_size=(1.5, 0)), TypeError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
])
def test_plan_rejects_bad_options(kw, exc, match):
    with pytest.raises(exc, match=match):
        plan(args(), **kw)


def test_plan_rejects_tables_above_the_int32_range():
    with pytest.raises(ValueError, match="block_table: .* exceed"):
        plan(args(block_size=256, max_blocks=(1 << 20) + 1, blocks=16), max_seqlen_k=100)
    with pytest.raises(ValueError, match="k_cache: .* exceed 2\\*\\*31 slots"):
        plan(args(block_size=256, blocks=1 << 23))


def test_window_and_causal_options():
    p = plan(args(), causal=True, window_size=(16, 5))
    assert (p["left"], p["right"]) == (16, 0)
    p = plan(args(), causal=False, window_size=(-1, 1 << 30))
    assert (p["left"], p["right"]) == (-1, -1)  # a side larger than any sequence is unbounded


# ---------------------------------------------------------------- GPU: reference and cases

@pytest.fixture(params=["sm80", "sm90"])
def path(request):
    """Runs a prefill test on each kernel: "sm80" forces paged_prefill_kernel; "sm90" keeps the dispatcher's choice
    (paged_prefill_sm90_kernel wherever prefill_path gives it) and needs an sm_90 GPU."""
    if request.param == "sm90":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the sm_90 paged prefill kernel needs an H100/H200")
    return request.param


def _torch():
    return pytest.importorskip("torch")


def make_paged(torch, seq_lens, kv_heads, head_dim, block_size, dtype, *, share=(), spare=3, seed=0, scale=1.0):
    """K/V caches with shuffled pages and a block table; every slot no sequence owns is NaN, table entries past a
    sequence's pages are -1.  ``share``: (b_from, b_to, pages): sequence b_to's first ``pages`` pages are b_from's
    (a shared prefix; b_to's own pages start after them)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    shared = {b_to: (b_from, n) for b_from, b_to, n in share}
    own = [need[b] - shared.get(b, (0, 0))[1] for b in range(len(seq_lens))]
    total = sum(own) + spare
    perm = torch.randperm(total, device="cuda", generator=g)
    shape = (total, block_size, kv_heads, head_dim)
    k = (torch.randn(shape, device="cuda", generator=g) * scale).to(dtype)
    v = torch.randn(shape, device="cuda", generator=g).to(dtype)
    width = max(max(need), 1) + 1
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32, device="cuda")
    pos = 0
    for b in range(len(seq_lens)):
        first = 0
        if b in shared:
            b_from, n = shared[b]
            table[b, :n] = table[b_from, :n]
            first = n
        table[b, first:need[b]] = perm[pos:pos + own[b]].int()
        pos += own[b]
    used = torch.zeros(total, block_size, dtype=torch.bool, device="cuda")
    for b, n in enumerate(seq_lens):
        t = torch.arange(n, device="cuda")
        used[table[b, t // block_size].long(), t % block_size] = True
    k[~used] = float("nan")
    v[~used] = float("nan")
    return k, v, table, torch.tensor(seq_lens, dtype=torch.int32, device="cuda")


def reference(torch, q, k, v, cu_q, table, seq_lens, causal=True, scale=None, window=(-1, -1), softcap=0.0):
    """float64 out (total_q, heads, d) and lse (heads, total_q): each sequence's pages gathered to contiguous K/V,
    then exact softmax attention with flash-attn's bottom-right-aligned masks; zeros / -inf for rows without keys."""
    total_q, heads, d = q.shape
    bs, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    left, right = window
    if causal:
        right = 0
    out = torch.zeros(total_q, heads, d, dtype=torch.float64, device=q.device)
    lse = torch.full((heads, total_q), float("-inf"), dtype=torch.float64, device=q.device)
    cu = cu_q.tolist()
    for b in range(len(cu) - 1):
        q0, q1, sk = cu[b], cu[b + 1], int(seq_lens[b])
        sq = q1 - q0
        if sq == 0 or sk == 0:
            continue
        t = torch.arange(sk, device=q.device)
        pages = table[b, t // bs].long()
        kb = k[pages, t % bs].double().repeat_interleave(group, dim=1).transpose(0, 1)  # (heads, sk, d)
        vb = v[pages, t % bs].double().repeat_interleave(group, dim=1).transpose(0, 1)
        i = torch.arange(sq, device=q.device)[:, None]
        j = t[None, :]
        visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
        if left >= 0:
            visible &= j >= i + sk - sq - left
        if right >= 0:
            visible &= j <= i + sk - sq + right
        for r0 in range(0, sq, 256):  # query chunks bound the (heads, rows, sk) float64 scores
            r1 = min(sq, r0 + 256)
            qb = q[q0 + r0:q0 + r1].double().transpose(0, 1)  # (heads, rows, d)
            s = (qb @ kb.transpose(-1, -2)) * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            s = s.masked_fill(~visible[r0:r1], float("-inf"))
            l = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - l[..., None]).nan_to_num(0.0)
            out[q0 + r0:q0 + r1] = (p @ vb).transpose(0, 1)
            lse[:, q0 + r0:q0 + r1] = l
    return out, lse


def check(torch, out, lse, ref, ref_lse, tol=5e-3, lse_atol=2e-3):
    assert not torch.isnan(out).any(), "NaN in out (an unwritten row, or a read of an unowned cache slot)"
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err <= tol, f"relative L2 error {err:.2e}"
    if lse is not None:
        empty = torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(lse), empty)
        assert torch.allclose(lse[~empty].double(), ref_lse[~empty], atol=lse_atol, rtol=1e-4)
        assert (out.transpose(0, 1)[empty] == 0).all()  # rows that see no key are exactly zero


def run_case(q_lens, k_lens, *, heads=4, kv_heads=2, d=128, block_size=16, dtype="bfloat16", causal=True,
             window=(-1, -1), softcap=0.0, scale=None, share=(), seed=0, qk_scale=1.0, out_view=False, kernel=None,
             num_splits=None, path=None):
    """One call on fresh random data with a NaN-poisoned out; returns out."""
    import speedcore

    torch = _torch()
    dt = getattr(torch, dtype)
    k, v, table, lens = make_paged(torch, k_lens, kv_heads, d, block_size, dt, share=share, seed=seed,
                                   scale=qk_scale)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    total_q = sum(q_lens)
    q = (torch.randn(total_q, heads, d, device="cuda", generator=g) * qk_scale).to(dt)
    cu_q = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(len(q_lens))], dtype=torch.int32, device="cuda")
    if out_view:  # an out with the head outermost and padded rows: nothing may be written past the view
        big = torch.full((heads, total_q, d + 8), float("nan"), device="cuda", dtype=dt)
        out = big[..., :d].transpose(0, 1)
    else:
        out = torch.full_like(q, float("nan"))
    res, lse = speedcore.paged_prefill_attention(q, k, v, cu_q, lens, table, max(q_lens), max(k_lens),
                                                 causal=causal, softmax_scale=scale, window_size=window,
                                                 softcap=softcap, return_lse=True, out=out, _kernel=kernel,
                                                 _num_splits=num_splits,
                                                 _path="sm80" if path == "sm80" else None)
    assert res is out and lse.shape == (heads, total_q) and lse.dtype == torch.float32
    ref, ref_lse = reference(torch, q, k, v, cu_q, table, lens, causal, scale, window, softcap)
    check(torch, out, lse, ref, ref_lse, lse_atol=2e-3 if softcap == 0 else 5e-3)
    if out_view:
        assert torch.isnan(big[..., d:]).all()
    return out


# Ragged query and cached lengths: (query tokens, cached tokens including them).  No prior cache (q == k),
# decode-like (1 query), mid-block, a query chunk over a long prefix, an empty query, a sequence with no key.
Q_LENS = [20, 1, 17, 64, 0, 130, 3, 5]
K_LENS = [20, 1, 40, 300, 100, 130, 1000, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 256, 32, 64, 1, 7, 24, 48])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_grid(d, block_size, causal, path):
    run_case(Q_LENS, K_LENS, d=d, block_size=block_size, causal=causal, seed=d + block_size, path=path)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_prefill_dtypes(dtype, d, path):
    run_case([300, 7, 64], [300, 519, 1024], heads=6, kv_heads=3, d=d, block_size=16, dtype=dtype, seed=d, path=path)
    run_case([33, 128], [77, 128], heads=2, kv_heads=2, d=d, block_size=128, dtype=dtype, causal=False, seed=d + 1,
             path=path)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [8, 40, 80, 96, 136, 200])
def test_padded_head_dims(d, path):
    run_case([77, 5], [150, 33], heads=4, kv_heads=1, d=d, block_size=16, seed=d, path=path)
    run_case([50], [300], heads=2, kv_heads=2, d=d, block_size=64, dtype="float16", seed=d + 1, path=path)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads", [(8, 1), (16, 2), (6, 3), (32, 8), (5, 5)])
@pytest.mark.parametrize("block_size", [16, 256])
def test_gqa_mqa(heads, kv_heads, block_size, path):
    run_case([100, 9, 17], [300, 9, 513], heads=heads, kv_heads=kv_heads, block_size=block_size, seed=heads, path=path)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(16, 0), (32, 8), (-1, 16), (100, -1), (0, 0), (5000, 5000)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_size, d", [(16, 128), (256, 64), (5, 128), (64, 256)])
def test_sliding_window(window, causal, block_size, d, path):
    run_case([200, 40, 1, 300], [450, 40, 77, 300], d=d, block_size=block_size, causal=causal, window=window,
             seed=window[0] + block_size, path=path)


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [5.0, 30.0])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 256])
def test_softcap(softcap, d, block_size, path):
    run_case([200, 3], [333, 64], heads=2, kv_heads=1, d=d, block_size=block_size, softcap=softcap, qk_scale=3.0,
             seed=d + int(softcap), path=path)
    run_case([64], [64], heads=2, kv_heads=1, d=d, block_size=block_size, softcap=softcap, causal=False,
             window=(20, 3), seed=d, path=path)


@pytest.mark.gpu
def test_softmax_scale_and_large_scores(path):
    run_case([150, 20], [150, 600], d=64, scale=0.5, dtype="float16", seed=1, path=path)
    run_case([150, 20], [400, 600], d=128, qk_scale=4.0, seed=2, path=path)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256, 7])
def test_shared_prefix_pages(block_size, path):
    # sequences 1 and 2 reuse sequence 0's first pages (a cached system prompt), with their own suffixes and
    # different query chunks; sequence 3 is a fork of sequence 1 that shares all its full pages
    pages = max(1, 600 // block_size)
    run_case([64, 200, 1, 32], [700, 900, 650, 899], block_size=block_size,
             share=((0, 1, pages), (0, 2, pages), (1, 3, 899 // block_size)), seed=block_size, path=path)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_long_prefix_32k(block_size, path):
    run_case([512, 1], [32768, 32768 - 5], heads=8, kv_heads=2, d=128, block_size=block_size, seed=7, path=path)


@pytest.mark.gpu
def test_block_size_does_not_change_the_result(path):
    """The same logical K/V in pages of 16, 32, 64 and 256 tokens: each kernel runs the same tiles in the same order
    whichever way it finds their rows, so its outputs are bitwise equal."""
    import speedcore

    torch = _torch()
    g = torch.Generator(device="cuda").manual_seed(5)
    lens_q, lens_k = [100, 1, 260], [1024, 512, 768]
    heads, kv_heads, d = 8, 2, 128
    ks = [torch.randn(n, kv_heads, d, device="cuda", generator=g).bfloat16() for n in lens_k]
    vs = [torch.randn(n, kv_heads, d, device="cuda", generator=g).bfloat16() for n in lens_k]
    q = torch.randn(sum(lens_q), heads, d, device="cuda", generator=g).bfloat16()
    cu_q = torch.tensor([0, 100, 101, 361], dtype=torch.int32, device="cuda")
    lens = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    outs = []
    for bs in (16, 32, 64, 256):
        need = [n // bs for n in lens_k]
        perm = torch.randperm(sum(need), device="cuda", generator=g)
        kc = torch.empty(sum(need), bs, kv_heads, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.empty_like(kc)
        table = torch.zeros(3, max(need), dtype=torch.int32, device="cuda")
        pos = 0
        for b, n in enumerate(need):
            pages = perm[pos:pos + n]
            pos += n
            table[b, :n] = pages.int()
            kc[pages] = ks[b].view(n, bs, kv_heads, d)
            vc[pages] = vs[b].view(n, bs, kv_heads, d)
        outs.append(speedcore.paged_prefill_attention(q, kc, vc, cu_q, lens, table, 260, 1024,
                                                      _path="sm80" if path == "sm80" else None))
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


@pytest.mark.gpu
def test_matches_contiguous_flash_attn_varlen(path):
    import speedcore

    torch = _torch()
    lens_q, lens_k = [300, 1, 64], [700, 33, 64]
    k, v, table, lens = make_paged(torch, lens_k, 2, 128, 16, torch.bfloat16, seed=3)
    q = torch.randn(sum(lens_q), 8, 128, device="cuda").bfloat16()
    cu_q = torch.tensor([0, 300, 301, 365], dtype=torch.int32, device="cuda")
    got = speedcore.paged_prefill_attention(q, k, v, cu_q, lens, table, 300, 700,
                                            _path="sm80" if path == "sm80" else None)
    kk = torch.cat([k[table[b, torch.arange(n, device="cuda") // 16].long(), torch.arange(n, device="cuda") % 16]
                    for b, n in enumerate(lens_k)])
    vv = torch.cat([v[table[b, torch.arange(n, device="cuda") // 16].long(), torch.arange(n, device="cuda") % 16]
                    for b, n in enumerate(lens_k)])
    cu_k = torch.tensor([0, 700, 733, 797], dtype=torch.int32, device="cuda")
    want = speedcore.flash_attn_varlen(q, kk, vv, cu_q, cu_k, 300, 700, causal=True)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_no_cached_prefix_and_empty_sequences(block_size, path):
    # every sequence holds only this step's tokens (seqused_k == query count), some sequences are empty, one has
    # queries but no key at all (zeros, lse = -inf)
    run_case([1, 0, 33, 128, 20], [1, 0, 33, 128, 0], block_size=block_size, seed=block_size, path=path)
    run_case([0, 0, 50], [0, 10, 50], block_size=block_size, causal=False, seed=block_size + 1, path=path)


@pytest.mark.gpu
def test_strided_views_and_out_is_q(path):
    import speedcore

    torch = _torch()
    run_case([77, 300], [100, 300], out_view=True, seed=11, path=path)
    run_case([77, 300], [100, 300], d=64, out_view=True, block_size=256, seed=12, path=path)
    heads, kv_heads, d = 4, 2, 64
    k, v, table, lens = make_paged(torch, [90, 200], kv_heads, d, 16, torch.float16, seed=12)
    qkv = torch.randn(290, heads + 2 * kv_heads, d, device="cuda").half()
    q = qkv[:, :heads]  # a slice of a packed qkv projection: token stride (heads + 2 kv_heads) d
    cu_q = torch.tensor([0, 90, 290], dtype=torch.int32, device="cuda")
    lens_q = torch.tensor([90, 200], dtype=torch.int32, device="cuda")
    ref, _ = reference(torch, q, k, v, cu_q, table, lens_q)
    got = speedcore.paged_prefill_attention(q, k, v, cu_q, lens_q, table, 200, 200)
    check(torch, got, None, ref, None)
    odd = torch.randn(290, heads, d + 1, device="cuda").half()[..., :d]  # strides not multiples of 8: copied
    ref, _ = reference(torch, odd, k, v, cu_q, table, lens_q)
    check(torch, speedcore.paged_prefill_attention(odd, k, v, cu_q, lens_q, table, 200, 200), None, ref, None)
    q2 = torch.randn(290, heads, d, device="cuda").half()
    ref, _ = reference(torch, q2, k, v, cu_q, table, lens_q)
    res = speedcore.paged_prefill_attention(q2, k, v, cu_q, lens_q, table, 200, 200, out=q2)
    assert res is q2
    check(torch, q2, None, ref, None)


@pytest.mark.gpu
def test_cupy_arrays():
    import speedcore

    cupy = pytest.importorskip("cupy")
    torch = _torch()
    k, v, table, lens = make_paged(torch, [70, 150], 2, 64, 16, torch.float16, seed=13)
    q = torch.randn(80, 4, 64, device="cuda").half()
    cu_q = torch.tensor([0, 30, 80], dtype=torch.int32, device="cuda")
    ref, _ = reference(torch, q, k, v, cu_q, table, lens)
    cp = [cupy.from_dlpack(x) for x in (q, k, v, cu_q, lens, table)]
    out = speedcore.paged_prefill_attention(*cp, 50, 150)
    assert isinstance(out, cupy.ndarray) and out.dtype == cupy.float16
    check(torch, torch.from_dlpack(out), None, ref, None)


@pytest.mark.gpu
def test_bad_input_raises_before_launch():
    import speedcore

    torch = _torch()
    k, v, table, lens = make_paged(torch, [70, 150], 2, 64, 16, torch.bfloat16, seed=14)
    q = torch.randn(80, 4, 64, device="cuda").bfloat16()
    cu_q = torch.tensor([0, 30, 80], dtype=torch.int32, device="cuda")
    with pytest.raises(TypeError, match="q: expected a CUDA tensor"):
        speedcore.paged_prefill_attention(q.cpu(), k, v, cu_q, lens, table, 50, 150)
    with pytest.raises(TypeError, match="cu_seqlens_q: dtype must be int32"):
        speedcore.paged_prefill_attention(q, k, v, cu_q.long(), lens, table, 50, 150)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        speedcore.paged_prefill_attention(q, k, v, cu_q, lens, table, 50, table.shape[1] * 16 + 1)
    with pytest.raises(TypeError, match="k_cache: dtype"):
        speedcore.paged_prefill_attention(q, k.half(), v, cu_q, lens, table, 50, 150)


# ---------------------------------------------------------------- GPU: speculative verification (paged_verify_kernel)

V_Q_LENS = [4, 1, 8, 16, 0, 3, 2, 5, 7]
V_K_LENS = [300, 1, 40, 1000, 100, 17, 0, 5, 4096]


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 256, 1, 7, 48])
@pytest.mark.parametrize("causal", [True, False])
def test_verify_grid(d, block_size, causal):
    run_case(V_Q_LENS, V_K_LENS, heads=8, kv_heads=2, d=d, block_size=block_size, causal=causal, kernel="verify",
             seed=d + block_size)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_verify_splits(num_splits, d):
    run_case(V_Q_LENS, V_K_LENS, heads=8, kv_heads=2, d=d, block_size=16, kernel="verify", num_splits=num_splits,
             seed=num_splits)
    run_case([4, 8], [2000, 3000], heads=4, kv_heads=1, d=d, block_size=32, dtype="float16", window=(100, 0),
             softcap=20.0, qk_scale=2.0, kernel="verify", num_splits=num_splits, seed=num_splits + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (8, 1), (6, 3), (40, 5), (64, 1), (5, 5)])
@pytest.mark.parametrize("q_len", [1, 2, 4, 8, 16])
def test_verify_gqa_and_query_counts(heads, kv_heads, q_len):
    # columns = q_len x group: 1 to 1024, so 1 to 32 column groups of 8, 16 or 32 per KV head
    run_case([q_len, q_len, max(1, q_len // 2)], [513, q_len, 2048], heads=heads, kv_heads=kv_heads,
             block_size=16, seed=heads + q_len)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(16, 0), (0, 0), (-1, 2), (100, -1), (3, 3)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_verify_window_softcap(window, causal, softcap):
    run_case([8, 3, 16], [700, 3, 129], heads=8, kv_heads=2, d=128, block_size=16, causal=causal, window=window,
             softcap=softcap, qk_scale=3.0 if softcap else 1.0, seed=window[0] + 7)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256, 5])
def test_verify_shared_prefix_and_fp16(block_size):
    pages = max(1, 600 // block_size)
    run_case([4, 4, 8], [700, 900, 650], block_size=block_size, dtype="float16",
             share=((0, 1, pages), (0, 2, pages)), seed=block_size)


@pytest.mark.gpu
def test_verify_matches_prefill_and_decode():
    """The same inputs through both kernels agree; one query token per sequence agrees with paged_decode_attention."""
    import speedcore

    torch = _torch()
    lens_k = [300, 1, 4096, 77]  # 1 cached token under 4 or 16 queries: the first queries see no key
    k, v, table, lens = make_paged(torch, lens_k, 2, 128, 16, torch.bfloat16, seed=21)
    for q_len in (1, 4, 16):
        q = torch.randn(4 * q_len, 8, 128, device="cuda").bfloat16()
        cu_q = torch.arange(0, 5, dtype=torch.int32, device="cuda") * q_len
        a = speedcore.paged_prefill_attention(q, k, v, cu_q, lens, table, q_len, 4096, _kernel="verify")
        b = speedcore.paged_prefill_attention(q, k, v, cu_q, lens, table, q_len, 4096, _kernel="prefill")
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
        if q_len == 1:
            c = speedcore.paged_decode_attention(q, k, v, table, lens)
            torch.testing.assert_close(a, c, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_verify_long_prefix_32k():
    run_case([8, 2], [32768, 32000], heads=32, kv_heads=8, d=128, block_size=16, seed=31)
    run_case([8, 2], [32768, 32000], heads=32, kv_heads=8, d=128, block_size=256, num_splits=16, kernel="verify",
             seed=32)


@pytest.mark.gpu
def test_sm90_serves_the_default_prefill_path(monkeypatch):
    import speedcore

    torch = _torch()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 paged prefill kernel needs an H100/H200")
    launched = []
    real = P._prefill_sm90_runner
    monkeypatch.setattr(P, "_prefill_sm90_runner", lambda p, *a: (launched.append(p["block_size"]), real(p, *a))[1])
    monkeypatch.setattr(P, "_PAGED_PLANS", {})  # every call takes the checked path, which picks the kernel
    for bs in (16, 256, 7):
        run_case([100, 30], [300, 30], block_size=bs, seed=bs)
    assert launched == [16, 256]  # block size 7 runs paged_prefill_kernel
    del speedcore


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["prefill", "verify", None])
def test_repeated_calls_take_the_plan_and_stay_correct(kernel):
    """The second and third calls of a signature run its cached plan on fresh data (pages, lengths, queries), with
    the same results as the checked path; an out that overlaps an input still raises."""
    import speedcore

    torch = _torch()
    dev, bf = "cuda", torch.bfloat16
    heads, kv_heads, d, bs, nblk = 8, 2, 128, 16, 64
    P._PAGED_PLANS.clear()
    for call in range(3):
        g = torch.Generator(device="cpu").manual_seed(40 + call)
        sq = [5, 3] if kernel == "verify" else [40, 17]
        sk = [200 + 9 * call, 90 + call]
        cu = torch.tensor([0, sq[0], sq[0] + sq[1]], dtype=torch.int32, device=dev)
        used = torch.tensor(sk, dtype=torch.int32, device=dev)
        table = torch.randperm(nblk, generator=g)[:2 * 16].view(2, 16).to(torch.int32).to(dev)
        kc = torch.randn(nblk, bs, kv_heads, d, generator=g).to(dev, bf)
        vc = torch.randn(nblk, bs, kv_heads, d, generator=g).to(dev, bf)
        q = torch.randn(sum(sq), heads, d, generator=g).to(dev, bf)
        kw = dict(causal=True, return_lse=True, _kernel=kernel)
        got, lse = speedcore.paged_prefill_attention(q, kc, vc, cu, used, table, max(sq), 16 * bs, **kw)
        saved = dict(P._PAGED_PLANS)
        P._PAGED_PLANS.clear()
        want, want_lse = speedcore.paged_prefill_attention(q, kc, vc, cu, used, table, max(sq), 16 * bs, **kw)
        P._PAGED_PLANS.update(saved)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    assert len(P._PAGED_PLANS) == 1
    o = torch.empty_like(q)
    assert speedcore.paged_prefill_attention(q, kc, vc, cu, used, table, max(sq), 16 * bs, out=o) is o  # cached
    with pytest.raises(ValueError, match="overlaps"):  # same layout, so the plan's own check must refuse it
        speedcore.paged_prefill_attention(q, kc, vc, cu, used, table, max(sq), 16 * bs,
                                          out=kc.view(-1)[:q.numel()].view(q.shape))
