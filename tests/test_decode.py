"""Decode-time kernels: paged decode attention, reshape_and_cache, rotary_embedding, silu/gelu_and_mul.

CPU tests cover the argument checks (on array descriptions, no GPU needed), the launch heuristics and the
variant list; GPU tests compare against float32 references on fresh random data, with poisoned outputs and
poisoned (NaN) unused cache memory.
"""
import math

import pytest

from speedcore import _arrays as A
from speedcore import decode as D


# -- CPU: argument checks on array descriptions ------------------------------------------------------------
def fake(name, shape, dtype, strides=None, ptr=1 << 20, device=0, lib="cupy"):
    if strides is None:
        strides, acc = [], 1
        for s in reversed(shape):
            strides.insert(0, acc)
            acc *= s
    return A.Array(None, lib, ptr, shape, strides, dtype, device, name)


def decode_args(batch=3, heads=8, kv_heads=2, head_dim=128, blocks=40, block_size=16, max_blocks=5,
                dtype="bfloat16"):
    base = 1 << 24
    q = fake("q", (batch, heads, head_dim), dtype, ptr=base)
    k = fake("k_cache", (blocks, block_size, kv_heads, head_dim), dtype, ptr=base * 2)
    v = fake("v_cache", (blocks, block_size, kv_heads, head_dim), dtype, ptr=base * 3)
    bt = fake("block_table", (batch, max_blocks), "int32", ptr=base * 4)
    sl = fake("seq_lens", (batch,), "int32", ptr=base * 5)
    return dict(qa=q, ka=k, va=v, bta=bt, sla=sl, oa=None)


def plan(args, scale=None, softcap=0.0, window_left=-1, **kw):
    return D._plan_paged_decode(args["qa"], args["ka"], args["va"], args["bta"], args["sla"], args["oa"], scale,
                                softcap, window_left, sms=132, smem_per_sm=233472, **kw)


def test_plan_accepts_good_arguments():
    p = plan(decode_args())
    assert p["group"] == 4 and p["units"] == 2 and p["num_splits"] >= 1
    p = plan(decode_args(heads=12, kv_heads=1))
    assert p["qgroups"] == 2 and p["units"] == 2


@pytest.mark.parametrize("change, exc, match", [
    (dict(q=("q", (3, 8, 128), "float32")), TypeError, "q: dtype float32"),
    (dict(k=("k_cache", (40, 16, 2, 128), "float16")), TypeError, "k_cache: dtype float16"),
    (dict(bt=("block_table", (3, 5), "int64")), TypeError, "block_table: dtype int64"),
    (dict(sl=("seq_lens", (3,), "int64")), TypeError, "seq_lens: dtype int64"),
    (dict(q=("q", (3, 8, 96), "bfloat16")), ValueError, "head_dim must be one of"),
    (dict(q=("q", (3, 8, 64), "bfloat16")), ValueError, "does not match"),
    (dict(q=("q", (3, 7, 128), "bfloat16")), ValueError, "multiple of"),
    (dict(q=("q", (3, 8, 128, 1), "bfloat16")), ValueError, "q: expected shape"),
    (dict(k=("k_cache", (40, 16, 256), "bfloat16")), ValueError, "k_cache: expected shape"),
    (dict(v=("v_cache", (40, 16, 2, 64), "bfloat16")), ValueError, "v_cache: expected shape"),
    (dict(bt=("block_table", (2, 5), "int32")), ValueError, "block_table: expected shape"),
    (dict(sl=("seq_lens", (4,), "int32")), ValueError, "seq_lens: expected shape"),
])
def test_plan_rejects_bad_arguments(change, exc, match):
    args = decode_args()
    key = {"q": "qa", "k": "ka", "v": "va", "bt": "bta", "sl": "sla"}
    for k, (name, shape, dtype) in change.items():
        args[key[k]] = fake(name, shape, dtype, ptr=args[key[k]].ptr)
    with pytest.raises(exc, match=match):
        plan(args)


def test_plan_rejects_bad_layouts_and_values():
    args = decode_args()
    args["ka"] = fake("k_cache", (40, 16, 2, 128), "bfloat16", strides=(4096, 256, 128, 1), ptr=(1 << 24) + 8)
    with pytest.raises(ValueError, match="16-byte aligned"):
        plan(args)
    args = decode_args()
    args["va"] = fake("v_cache", (40, 16, 2, 128), "bfloat16", strides=(8192, 256, 128, 1), ptr=3 << 24)
    with pytest.raises(ValueError, match="v_cache: strides"):
        plan(args)
    args = decode_args()
    args["qa"] = fake("q", (3, 8, 128), "bfloat16", strides=(1024, 1, 8), ptr=1 << 24)
    with pytest.raises(ValueError, match="q: the head_dim"):
        plan(args)
    args = decode_args()
    args["oa"] = fake("out", (3, 8, 128), "bfloat16", ptr=(1 << 24) + 256)  # overlaps q, shifted
    with pytest.raises(ValueError, match="out: overlaps q"):
        plan(args)
    args = decode_args()
    args["bta"] = fake("block_table", (3, 5), "int32", lib="torch", ptr=4 << 24)
    with pytest.raises(TypeError, match="one library"):
        plan(args)
    with pytest.raises(ValueError, match="softcap"):
        plan(decode_args(), softcap=-1.0)
    with pytest.raises(ValueError, match="softmax_scale"):
        plan(decode_args(), scale=float("nan"))
    with pytest.raises(TypeError, match="window_left"):
        plan(decode_args(), window_left=2.5)
    with pytest.raises(ValueError, match="window_left"):
        plan(decode_args(), window_left=-2)
    with pytest.raises(ValueError, match="num_splits"):
        plan(decode_args(), num_splits=0)


def test_split_heuristic_fills_the_gpu():
    warps, stages, smem = D.decode_config(128)
    per_sm = D._ctas_per_sm(smem, warps * 32, 233472)
    assert per_sm == 2
    slots = 132 * per_sm
    # the choices that measured best on the H200 (see decode_num_splits)
    expect = {(256, 32, 1024): 1, (64, 8, 4096): 1, (8, 8, 32768): 4, (1, 8, 131072): 33, (16, 8, 8192): 2,
              (32, 8, 2048): 1}
    for (batch, units, max_len), want in expect.items():
        assert D.decode_num_splits(batch, units, max_len, 132, per_sm) == want, (batch, units, max_len)
    for batch, units, max_len in [(8, 8, 32768), (1, 8, 131072), (3, 8, 4096), (4, 1, 1 << 20), (1, 1, 1 << 24)]:
        s = D.decode_num_splits(batch, units, max_len, 132, per_sm)
        assert 1 < s <= D.MAX_SPLITS
        ctas = batch * units * s
        # the last wave is at least 90% full, or the split count hit its cap
        assert ctas / (-(-ctas // slots) * slots) >= 0.9 or s in (D.MAX_SPLITS, max_len // 16 // D.MIN_TILES_PER_SPLIT)
    # short sequences are not split below the minimum chunk
    assert D.decode_num_splits(1, 8, 512, 132, per_sm) == 1


def test_decode_config_fits_shared_memory():
    for d in D.HEAD_DIMS:
        warps, stages, smem = D.decode_config(d)
        assert smem <= 227 * 1024 and stages >= 2
        assert smem >= warps * D.QUERIES_PER_CTA * d * 4  # the cross-warp merge reuses the ring


def test_cache_rotary_activation_plans():
    k = fake("k", (10, 2, 128), "float16", strides=(768, 128, 1))  # a slice of a fused QKV
    v = fake("v", (10, 2, 128), "float16", strides=(768, 128, 1), ptr=(1 << 20) + 512)
    kc = fake("k_cache", (4, 16, 2, 128), "float16", ptr=1 << 26)
    vc = fake("v_cache", (4, 16, 2, 128), "float16", ptr=2 << 26)
    sm = fake("slot_mapping", (10,), "int64", ptr=3 << 26)
    p = D._plan_reshape_and_cache(k, v, kc, vc, sm)
    assert p["word"] == 16 and p["words_per_head"] == 16 and p["k_strides"] == (96, 16)
    with pytest.raises(TypeError, match="slot_mapping: dtype"):
        D._plan_reshape_and_cache(k, v, kc, vc, fake("slot_mapping", (10,), "float32", ptr=3 << 26))
    with pytest.raises(ValueError, match="k_cache: expected shape"):
        D._plan_reshape_and_cache(k, v, fake("k_cache", (4, 16, 3, 128), "float16", ptr=1 << 26), vc, sm)
    with pytest.raises(ValueError, match="slot_mapping: expected"):
        D._plan_reshape_and_cache(k, v, kc, vc, fake("slot_mapping", (9,), "int64", ptr=3 << 26))
    k20 = fake("k", (10, 2, 20), "float16")
    p = D._plan_reshape_and_cache(k20, fake("v", (10, 2, 20), "float16", ptr=1 << 22),
                                  fake("k_cache", (4, 16, 2, 20), "float16", ptr=1 << 26),
                                  fake("v_cache", (4, 16, 2, 20), "float16", ptr=2 << 26), sm)
    assert p["word"] == 2

    pos = fake("positions", (10,), "int64", ptr=1 << 28)
    q = fake("q", (10, 4, 128), "bfloat16", ptr=2 << 28)
    kk = fake("k", (10, 2, 128), "bfloat16", ptr=3 << 28)
    cs = fake("cos_sin_cache", (4096, 128), "float32", ptr=4 << 28)
    p = D._plan_rotary(pos, q, kk, cs, True)
    assert p["vec"] and p["rot_dim"] == 128 and p["q_strides"] == (512, 128)
    p = D._plan_rotary(pos, q, None, fake("cos_sin_cache", (4096, 24), "float32", ptr=4 << 28), True)
    assert not p["vec"]
    with pytest.raises(ValueError, match="rot_dim"):
        D._plan_rotary(pos, q, kk, fake("cos_sin_cache", (4096, 130), "float32", ptr=4 << 28), True)
    with pytest.raises(TypeError, match="cos_sin_cache: dtype"):
        D._plan_rotary(pos, q, kk, fake("cos_sin_cache", (4096, 128), "float16", ptr=4 << 28), True)
    with pytest.raises(ValueError, match="q: expected shape"):
        D._plan_rotary(pos, fake("q", (10, 512), "bfloat16", ptr=2 << 28), kk, cs, True)
    with pytest.raises(TypeError, match="is_neox"):
        D._plan_rotary(pos, q, kk, cs, 1)

    x = fake("x", (7, 8192), "bfloat16")
    p = D._plan_gated(x, None)
    assert p["d"] == 4096 and p["out_shape"] == (7, 4096)
    with pytest.raises(ValueError, match="must be even"):
        D._plan_gated(fake("x", (7, 33), "bfloat16"), None)
    with pytest.raises(ValueError, match="out: expected shape"):
        D._plan_gated(x, fake("out", (7, 8192), "bfloat16", ptr=1 << 30))
    with pytest.raises(TypeError, match="x: dtype int32"):
        D._plan_gated(fake("x", (7, 8), "int32"), None)


def test_caches_overlap():
    # the cached plans' per-call check: caches of 100 bytes at 1000 and 2000
    assert not D._caches_overlap(1000, 2000, 100, [(0, 1000), (1100, 900), (2100, 50)])
    assert D._caches_overlap(1000, 2000, 100, [(0, 1001)])      # an input's last byte inside k_cache
    assert D._caches_overlap(1000, 2000, 100, [(2099, 10)])     # an input's first byte inside v_cache
    assert D._caches_overlap(1000, 1050, 100, [])               # the caches overlap each other
    assert not D._caches_overlap(1000, 1100, 100, iter([(1200, 8)]))


def test_all_kernels_are_distinct():
    ks = D.all_kernels()
    assert len(ks) == len({k.name for k in ks})
    assert len(ks) <= 80  # 24 attention variants (dtype x head dim x PAGE16 x PAIR), the rest small
    assert sum("paged_decode_kernel" in k.name for k in ks) == 24
    assert sum("rotary_cache_kernel" in k.name for k in ks) == 10  # (dtype, cos/sin dtype) x NEOX


# -- GPU ------------------------------------------------------------------------------------------------------
def _torch():
    return pytest.importorskip("torch")


def make_paged(torch, seq_lens, kv_heads, head_dim, block_size, dtype, spare_blocks=3, seed=0):
    """K/V caches with shuffled pages; every slot no sequence owns is NaN."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [max(1, -(-n // block_size)) for n in seq_lens]
    width = max(need) + 1
    total = sum(need) + spare_blocks
    perm = torch.randperm(total, device="cuda", generator=g)
    shape = (total, block_size, kv_heads, head_dim)
    k = torch.randn(shape, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    v = torch.randn(shape, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    used = torch.zeros(total, block_size, dtype=torch.bool, device="cuda")
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32, device="cuda")
    pos = 0
    for b, n in enumerate(seq_lens):
        pages = perm[pos:pos + need[b]]
        pos += need[b]
        table[b, :need[b]] = pages.int()
        t = torch.arange(n, device="cuda")
        used[pages[t // block_size], t % block_size] = True
    k[~used] = float("nan")
    v[~used] = float("nan")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return k, v, table, lens


def reference_decode(torch, q, k, v, table, lens, scale=None, softcap=0.0, window_left=-1):
    batch, heads, head_dim = q.shape
    bs, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(batch, heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(lens[b])
        if n == 0:
            continue
        t = torch.arange(n, device=q.device)
        pages = table[b, (t // bs)].long()
        kb = k[pages, t % bs].float().repeat_interleave(group, dim=1)  # (n, heads, d)
        vb = v[pages, t % bs].float().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), kb) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        if window_left >= 0:
            s[:, t < n - 1 - window_left] = float("-inf")
        lse[b] = torch.logsumexp(s, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), vb)
    return out, lse


def tol(torch, dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=6e-3, rtol=6e-3)


def run_decode(torch, *, batch_lens, heads, kv_heads, head_dim, block_size, dtype, num_splits=None, softcap=0.0,
               window_left=-1, scale=None, seed=0):
    import speedcore

    k, v, table, lens = make_paged(torch, batch_lens, kv_heads, head_dim, block_size, dtype, seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    q = torch.randn(len(batch_lens), heads, head_dim, device="cuda", generator=g).to(dtype)
    out = torch.full_like(q, float("nan"))
    if num_splits is None:
        got, lse = speedcore.paged_decode_attention(q, k, v, table, lens, softmax_scale=scale, softcap=softcap,
                                                    window_left=window_left, out=out, return_lse=True)
    else:
        wrap = A.wrap
        got, lse = D._paged_decode(wrap(q, "q"), wrap(k, "k_cache"), wrap(v, "v_cache"), wrap(table, "block_table"),
                                   wrap(lens, "seq_lens"), wrap(out, "out"), scale, softcap, window_left, True,
                                   num_splits=num_splits)
    torch.cuda.synchronize()
    assert got is out
    ref, ref_lse = reference_decode(torch, q, k, v, table, lens, scale, softcap, window_left)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), ref, **tol(torch, dtype))
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=2e-3 if softcap == 0 else 1e-2, rtol=1e-3)
    return got


LENS = [1, 37, 16, 300, 129, 2, 700]
BLOCK_SIZES = [16, 1, 5, 32, 256, 8, 24, 128]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
def test_paged_decode_gqa_ratios(dtype_name, group):
    torch = _torch()
    run_decode(torch, batch_lens=LENS, heads=2 * group, kv_heads=2, head_dim=128,
               block_size=BLOCK_SIZES[group % len(BLOCK_SIZES)], dtype=getattr(torch, dtype_name), seed=group)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_decode_head_dims(dtype_name, head_dim, group):
    torch = _torch()
    run_decode(torch, batch_lens=LENS[::-1], heads=3 * group, kv_heads=3, head_dim=head_dim,
               block_size=BLOCK_SIZES[(group + head_dim) % len(BLOCK_SIZES)], dtype=getattr(torch, dtype_name),
               seed=head_dim + group)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, num_splits", [(128, 1), (128, 2), (128, 7), (128, 64), (128, 256), (64, 5),
                                                  (64, 256), (256, 9), (256, 256), (64, 2), (256, 2)])
def test_paged_decode_split_paths(head_dim, num_splits):
    torch = _torch()
    run_decode(torch, batch_lens=[1, 999, 17, 4096, 0], heads=8, kv_heads=2, head_dim=head_dim, block_size=16,
               dtype=torch.bfloat16, num_splits=num_splits, seed=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("window_left", [0, 5, 100, 5000])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("block_size", [32, 7])  # whole tiles per page (PAGE16) or a per-row page lookup
def test_paged_decode_softcap_and_window(window_left, softcap, block_size):
    torch = _torch()
    # a large scale makes the logits big enough for the cap to matter
    for splits in (None, 5, 2):
        run_decode(torch, batch_lens=[1, 700, 33, 2000], heads=16, kv_heads=4, head_dim=128, block_size=block_size,
                   dtype=torch.float16, softcap=softcap, window_left=window_left, scale=0.5 if softcap else None,
                   num_splits=splits, seed=window_left)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 2])
@pytest.mark.parametrize("heads, kv_heads", [(32, 2), (12, 1), (40, 5)])
def test_paged_decode_large_groups(heads, kv_heads, num_splits):
    torch = _torch()
    run_decode(torch, batch_lens=[5, 300, 64], heads=heads, kv_heads=kv_heads, head_dim=128, block_size=16,
               dtype=torch.bfloat16, num_splits=num_splits, seed=heads)


def test_pair_merge_only_for_two_splits_on_sm90():
    assert D.pair_merge((9, 0), 2)
    assert not D.pair_merge((8, 0), 2) and not D.pair_merge((9, 0), 1) and not D.pair_merge((9, 0), 3)


@pytest.mark.gpu
def test_paged_decode_pair_merge_launch():
    """Two splits on sm_90: one cluster per unit, no merge kernel, and the same result as the merge kernel's."""
    torch = _torch()
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("thread-block clusters need sm_90")
    k, v, table, lens = make_paged(torch, [700, 1, 2000, 0], 3, 64, 24, torch.float16, seed=3)
    q = torch.randn(4, 15, 64, device="cuda", dtype=torch.float16)
    outs = []
    for pair in (True, False):
        D.PAIR_MERGE = pair
        try:
            out = torch.full_like(q, float("nan"))
            wrapped = (A.wrap(q, "q"), A.wrap(k, "k_cache"), A.wrap(v, "v_cache"), A.wrap(table, "block_table"),
                       A.wrap(lens, "seq_lens"), A.wrap(out, "out"))
            p = D._decode_plan(*wrapped, None, 0.0, -1, 2)
            assert p["pair"] == pair and p["cfg"].cluster == (2 if pair else 1)
            _, lse = D._paged_decode(*wrapped, None, 0.0, -1, True, num_splits=2)
            torch.cuda.synchronize()
            outs.append((out, lse))
        finally:
            D.PAIR_MERGE = True
    ref, ref_lse = reference_decode(torch, q, k, v, table, lens)
    for out, lse in outs:
        torch.testing.assert_close(out.float(), ref, atol=6e-3, rtol=6e-3)
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        torch.testing.assert_close(lse[finite], ref_lse[finite], atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [6, 2])
def test_paged_decode_split_in_cuda_graph(num_splits):
    """A split decode (on sm_90 the merge is a programmatic dependent launch of the attention kernel) captured by
    torch.cuda.graph: replays with new queries match the reference, and an op reading the output right after the
    merge sees all of it."""
    torch = _torch()
    k, v, table, lens = make_paged(torch, [3000, 17, 1], 2, 128, 16, torch.bfloat16, seed=7)
    q = torch.randn(3, 8, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    wrapped = (A.wrap(q, "q"), A.wrap(k, "k_cache"), A.wrap(v, "v_cache"), A.wrap(table, "block_table"),
               A.wrap(lens, "seq_lens"), A.wrap(out, "out"))
    call = lambda: D._paged_decode(*wrapped, None, 0.0, -1, False, num_splits=num_splits)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and plan outside the capture
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
        total = out.float().sum(dim=-1)
    for _ in range(2):
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = reference_decode(torch, q, k, v, table, lens)
        torch.testing.assert_close(out.float(), ref, **tol(torch, torch.bfloat16))
        assert torch.equal(total, out.float().sum(dim=-1))


@pytest.mark.gpu
def test_paged_decode_long_sequence_default_split():
    torch = _torch()
    run_decode(torch, batch_lens=[20000], heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)


@pytest.mark.gpu
def test_paged_decode_views_and_empty_sequence():
    torch = _torch()
    import speedcore

    k, v, table, lens = make_paged(torch, [0, 50, 3], 2, 64, 16, torch.float16)
    big = torch.randn(3, 4, 3 * 64, device="cuda").half()
    q = big[:, :, 64:128]  # strided view
    out_big = torch.full((3, 4, 2 * 64), float("nan"), device="cuda", dtype=torch.float16)
    out = out_big[:, :, :64]
    got, lse = speedcore.paged_decode_attention(q, k, v, table, lens, out=out, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = reference_decode(torch, q, k, v, table, lens)
    torch.testing.assert_close(got.float(), ref, atol=6e-3, rtol=6e-3)
    assert torch.isnan(out_big[:, :, 64:]).all()  # nothing written outside the view
    assert (got[0] == 0).all() and torch.isinf(lse[0]).all() and (lse[0] < 0).all()
    # default output allocation, no lse
    got2 = speedcore.paged_decode_attention(q, k, v, table, lens)
    torch.testing.assert_close(got2, got)


@pytest.mark.gpu
def test_paged_decode_bad_inputs_raise_before_launch():
    torch = _torch()
    import speedcore

    k, v, table, lens = make_paged(torch, [10, 20], 2, 128, 16, torch.bfloat16)
    q = torch.randn(2, 4, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    with pytest.raises(TypeError, match="q: dtype float32"):
        speedcore.paged_decode_attention(q.float(), k, v, table, lens, out=out)
    with pytest.raises(TypeError, match="block_table: dtype int64"):
        speedcore.paged_decode_attention(q, k, v, table.long(), lens, out=out)
    with pytest.raises(ValueError, match="multiple of"):
        speedcore.paged_decode_attention(q[:, :3], k, v, table, lens, out=out[:, :3])
    with pytest.raises(TypeError, match="seq_lens"):
        speedcore.paged_decode_attention(q, k, v, table, lens.cpu(), out=out)
    with pytest.raises(ValueError, match="v_cache"):
        speedcore.paged_decode_attention(q, k, v[:, :8], table, lens, out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out).all()
    # the overlap check runs on every call, also when the layout's launch plan is already cached
    speedcore.paged_decode_attention(q, k, v, table, lens, out=torch.empty_like(q))
    inside_k = k.view(-1)[8:8 + q.numel()].view(q.shape)
    with pytest.raises(ValueError, match="out: overlaps k_cache"):
        speedcore.paged_decode_attention(q, k, v, table, lens, out=inside_k)
    with pytest.raises(TypeError, match="window_left"):
        speedcore.paged_decode_attention(q, k, v, table, lens, out=torch.empty_like(q), window_left=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name, head_dim, block_size, slot_dtype", [
    ("bfloat16", 128, 16, "int64"), ("float16", 20, 5, "int32"), ("float32", 64, 1, "int64"),
    ("float16", 256, 256, "int32"),
])
def test_reshape_and_cache(dtype_name, head_dim, block_size, slot_dtype):
    torch = _torch()
    import speedcore

    dtype = getattr(torch, dtype_name)
    tokens, kv_heads, blocks = 37, 3, max(4, -(-60 // block_size))
    qkv = torch.randn(tokens, 4 + 2 * kv_heads, head_dim, device="cuda").to(dtype)
    k, v = qkv[:, 4:4 + kv_heads], qkv[:, 4 + kv_heads:]
    kc = torch.randn(blocks, block_size, kv_heads, head_dim, device="cuda").to(dtype)
    vc = torch.randn_like(kc)
    slots = torch.randperm(blocks * block_size, device="cuda")[:tokens]
    slots[::5] = -1
    slots = slots.to(getattr(torch, slot_dtype))
    want_k, want_v = kc.clone(), vc.clone()
    keep = slots >= 0
    want_k.view(-1, kv_heads, head_dim)[slots[keep].long()] = k[keep]
    want_v.view(-1, kv_heads, head_dim)[slots[keep].long()] = v[keep]
    assert speedcore.reshape_and_cache(k, v, kc, vc, slots) is None
    torch.cuda.synchronize()
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def reference_rotary(torch, positions, x, cos_sin, is_neox):
    rot = cos_sin.shape[1]
    cs = cos_sin[positions.long()].float()  # (*lead, rot)
    cos, sin = cs[..., : rot // 2].unsqueeze(-2), cs[..., rot // 2:].unsqueeze(-2)
    x = x.float().clone()
    r = x[..., :rot]
    if is_neox:
        a, b = r[..., : rot // 2], r[..., rot // 2:]
        r = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    else:
        a, b = r[..., 0::2], r[..., 1::2]
        r = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    x[..., :rot] = r
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype_name, head_size, rot_dim, cs_same, pos2d", [
    ("bfloat16", 128, 128, False, False), ("float16", 128, 64, True, True), ("float32", 80, 32, False, False),
    ("bfloat16", 64, 24, True, False), ("float16", 96, 96, False, True),
])
def test_rotary_embedding(is_neox, dtype_name, head_size, rot_dim, cs_same, pos2d):
    torch = _torch()
    import speedcore

    dtype = getattr(torch, dtype_name)
    lead = (3, 11) if pos2d else (29,)
    max_pos = 500
    positions = torch.randint(0, max_pos, lead, device="cuda", dtype=torch.int32 if pos2d else torch.int64)
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, device="cuda").float() / rot_dim))
    ang = torch.arange(max_pos, device="cuda").float()[:, None] * inv[None]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1)
    if cs_same:
        cos_sin = cos_sin.to(dtype)
    qkv = torch.randn(*lead, 6 + 2 + 2, head_size, device="cuda").to(dtype)
    q, k = qkv[..., :6, :], qkv[..., 6:8, :]
    want_q = reference_rotary(torch, positions, q, cos_sin, is_neox)
    want_k = reference_rotary(torch, positions, k, cos_sin, is_neox)
    untouched = qkv[..., 8:, :].clone()
    rq, rk = speedcore.rotary_embedding(positions, q, k, cos_sin, is_neox=is_neox)
    torch.cuda.synchronize()
    assert rq is q and rk is k
    t = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(q.float(), want_q, **t)
    torch.testing.assert_close(k.float(), want_k, **t)
    assert torch.equal(qkv[..., 8:, :], untouched)
    # k may be None (the reference is taken before the in-place call: for float32, .to() returns the tensor)
    q2 = want_q.to(dtype).clone()
    want_q2 = reference_rotary(torch, positions, q2, cos_sin, is_neox)
    speedcore.rotary_embedding(positions, q2, None, cos_sin, is_neox=is_neox)
    torch.testing.assert_close(q2.float(), want_q2, **t)


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype_name, head_size, rot_dim, cs_same, block_size, int64", [
    ("bfloat16", 128, 128, False, 16, True), ("float16", 64, 64, True, 5, False), ("float32", 128, 128, False, 1, True),
    ("bfloat16", 256, 256, True, 256, False),
    ("bfloat16", 128, 64, False, 16, True),  # partial rotary: the two-kernel fallback
])
def test_rotary_embedding_and_cache(is_neox, dtype_name, head_size, rot_dim, cs_same, block_size, int64):
    """The fused kernel (or its fallback) gives exactly what rotary_embedding then reshape_and_cache give: q, k
    rotated in place, the rotated k and v at their slots (-1 and past-the-end slots skipped), the rest untouched."""
    torch = _torch()
    import speedcore

    dtype = getattr(torch, dtype_name)
    tokens, heads, kv_heads, max_pos = 37, 6, 2, 500
    idx = torch.int64 if int64 else torch.int32
    positions = torch.randint(0, max_pos, (tokens,), device="cuda", dtype=idx)
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, device="cuda").float() / rot_dim))
    ang = torch.arange(max_pos, device="cuda").float()[:, None] * inv[None]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1)
    if cs_same:
        cos_sin = cos_sin.to(dtype)
    blocks = max(4, -(-60 // block_size))
    slots = torch.randperm(blocks * block_size, device="cuda")[:tokens]
    slots[::5] = -1
    slots[1] = blocks * block_size  # past the caches: skipped
    slots = slots.to(idx)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_size, device="cuda").to(dtype)  # views of a fused QKV
    kc = torch.randn(blocks, block_size, kv_heads, head_size, device="cuda").to(dtype)
    vc = torch.randn_like(kc)
    want_qkv, want_kc, want_vc = qkv.clone(), kc.clone(), vc.clone()
    wq, wk, wv = want_qkv[:, :heads], want_qkv[:, heads:heads + kv_heads], want_qkv[:, heads + kv_heads:]
    speedcore.rotary_embedding(positions, wq, wk, cos_sin, is_neox=is_neox)
    speedcore.reshape_and_cache(wk, wv, want_kc, want_vc, slots)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    for _ in range(2):  # the full path, then the cached plan (on fresh copies)
        got_qkv, got_kc, got_vc = qkv.clone(), kc.clone(), vc.clone()
        gq, gk, gv = got_qkv[:, :heads], got_qkv[:, heads:heads + kv_heads], got_qkv[:, heads + kv_heads:]
        rq, rk = speedcore.rotary_embedding_and_cache(positions, gq, gk, gv, cos_sin, got_kc, got_vc, slots,
                                                      is_neox=is_neox)
        torch.cuda.synchronize()
        assert rq is gq and rk is gk
        assert torch.equal(got_qkv, want_qkv) and torch.equal(got_kc, want_kc) and torch.equal(got_vc, want_vc)
    with pytest.raises(ValueError, match="k_cache"):
        speedcore.rotary_embedding_and_cache(positions, q, k, v, cos_sin, kc[:, :, :1], vc[:, :, :1], slots)
    with pytest.raises(ValueError, match="positions"):
        speedcore.rotary_embedding_and_cache(positions.view(1, -1), q.unsqueeze(0), k.unsqueeze(0), v, cos_sin, kc,
                                             vc, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("dtype_name, shape", [
    ("bfloat16", (7, 2 * 4096)), ("float16", (3, 5, 2 * 37)), ("float32", (9, 2 * 1000)), ("bfloat16", (1, 2 * 8)),
])
def test_gated_activations(act, dtype_name, shape):
    torch = _torch()
    import speedcore

    dtype = getattr(torch, dtype_name)
    x = (3 * torch.randn(*shape, device="cuda")).to(dtype)
    d = shape[-1] // 2
    a, g = x[..., :d].float(), x[..., d:].float()
    want = (torch.nn.functional.silu(a) if act == "silu" else torch.nn.functional.gelu(a)) * g
    fn = speedcore.silu_and_mul if act == "silu" else speedcore.gelu_and_mul
    out = torch.full(shape[:-1] + (d,), float("nan"), device="cuda", dtype=dtype)
    assert fn(x, out=out) is out
    got2 = fn(x)
    torch.cuda.synchronize()
    t = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(out.float(), want, **t)
    assert torch.equal(got2, out)
    # a column slice (row stride != 2d) and a strided out
    wide = torch.randn(shape[0], shape[-1] + 8, device="cuda").to(dtype) if len(shape) == 2 else None
    if wide is not None:
        xs = wide[:, 8:]
        o_wide = torch.full((shape[0], d + 8), float("nan"), device="cuda", dtype=dtype)
        fn(xs, out=o_wide[:, :d])
        torch.cuda.synchronize()
        a, g = xs[:, :d].float(), xs[:, d:].float()
        want = (torch.nn.functional.silu(a) if act == "silu" else torch.nn.functional.gelu(a)) * g
        torch.testing.assert_close(o_wide[:, :d].float(), want, **t)
        assert torch.isnan(o_wide[:, d:]).all()


@pytest.mark.gpu
def test_small_everything_once():
    """One small call of every kernel family, for compute-sanitizer (``-k small``)."""
    torch = _torch()
    import speedcore

    for splits in (1, 3):
        run_decode(torch, batch_lens=[1, 40, 17], heads=4, kv_heads=2, head_dim=64, block_size=5,
                   dtype=torch.bfloat16, num_splits=splits, window_left=20)
    run_decode(torch, batch_lens=[3, 33], heads=2, kv_heads=1, head_dim=256, block_size=16, dtype=torch.float16)
    k = torch.randn(5, 2, 64, device="cuda").half()
    kc = torch.zeros(3, 4, 2, 64, device="cuda").half()
    vc = torch.zeros_like(kc)
    slots = torch.tensor([0, -1, 11, 5, 12], device="cuda")
    speedcore.reshape_and_cache(k, k, kc, vc, slots)
    cs = torch.randn(16, 64, device="cuda")
    q = torch.randn(5, 3, 64, device="cuda").half()
    speedcore.rotary_embedding(torch.arange(5, device="cuda"), q, k, cs, is_neox=False)
    speedcore.silu_and_mul(torch.randn(5, 24, device="cuda").bfloat16())
    speedcore.gelu_and_mul(torch.randn(5, 22, device="cuda").half())
    torch.cuda.synchronize()
