"""The cached launch plans (one per call signature): a repeated call takes the plan, and gives the same results
as the first (checked) call on fresh data; what a plan cannot know (pointer values) is still checked."""
import numpy as np
import pytest

from speedcore import _arrays as A


def test_signature_keys_without_a_gpu():
    """Unsupported kinds of argument are never cached; None keys as None; a plain tensor keys everything the
    checks read (dtype, shape, strides, device, alignment offset) but not the pointer."""
    assert A.sig(None) is None
    assert not A.cacheable((A.sig(np.zeros(3)), None))
    assert not A.cacheable((A.sig([1, 2]),))
    assert A.cacheable((None, 1e-6, "silu"))
    torch = pytest.importorskip("torch")
    a, b = torch.zeros(4, 8), torch.zeros(4, 8)
    assert A.sig(a) == A.sig(b) and A.sig(a) != A.sig(a.t()) and A.sig(a) != A.sig(a.half())
    assert A.sig(a) != A.sig(a.view(-1)[1:].view(-1)[:31])  # another shape and alignment offset
    assert A.sig(torch.nn.Parameter(a)) == A.sig(a)


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch


def _close(torch, got, ref, tol=2e-2):
    got, ref = got.float(), ref.float()
    assert torch.isfinite(got).all()
    err = (got - ref).norm() / ref.norm().clamp_min(1e-6)
    assert err < tol, float(err)


@pytest.mark.gpu
def test_repeated_calls_take_the_plan_and_stay_correct():
    torch = _torch()
    import speedcore
    from speedcore import decode, gemm, norm

    F = torch.nn.functional
    bf = torch.bfloat16
    for call in range(3):  # the first call validates and caches; the next two run the plan on fresh data
        x, r, w = (torch.randn(*s, device="cuda", dtype=bf) for s in ((5, 4096), (5, 4096), (4096,)))
        y = speedcore.rms_norm(x, w, 1e-5)
        _close(torch, y, F.rms_norm(x.float(), (4096,), w.float(), 1e-5))
        y, h = speedcore.rms_norm(x, w, 1e-5, residual=r)
        _close(torch, h, x + r)
        _close(torch, y, F.rms_norm((x + r).float(), (4096,), w.float(), 1e-5))
        wl = torch.randn(1024, 4096, device="cuda", dtype=bf) / 64
        _close(torch, speedcore.linear(x, wl), x.float() @ wl.float().t())
        g = torch.randn(3, 2 * 1000, device="cuda", dtype=bf)
        _close(torch, speedcore.silu_and_mul(g), F.silu(g[:, :1000].float()) * g[:, 1000:].float())
        out = torch.full((5, 1024), float("nan"), device="cuda", dtype=bf)
        assert speedcore.linear(x, wl, out=out) is out
        _close(torch, out, x.float() @ wl.float().t())
        bm = torch.randn(4096, 520, device="cuda", dtype=bf) / 64  # N-major, and K-major through .t()
        _close(torch, speedcore.matmul(x, bm), x.float() @ bm.float())
        _close(torch, speedcore.matmul(x, wl.t()), x.float() @ wl.float().t())
        out = torch.full((5, 520), float("nan"), device="cuda", dtype=bf)
        assert speedcore.matmul(x, bm, out=out) is out
        _close(torch, out, x.float() @ bm.float())
    assert norm._PLANS and gemm._LINEAR_PLANS and gemm._MATMUL_PLANS and decode._FAST_GATED


@pytest.mark.gpu
def test_plans_still_check_pointer_overlap():
    """A plan knows the layouts, not the pointers: an ``out`` that overlaps an input raises on every call."""
    torch = _torch()
    import speedcore

    bf = torch.bfloat16
    x = torch.randn(4, 256, device="cuda", dtype=bf)
    w = torch.randn(256, device="cuda", dtype=bf)
    buf = torch.empty(8, 256, device="cuda", dtype=bf)
    speedcore.rms_norm(x, w, out=buf[:4])  # cached for this layout
    with pytest.raises(ValueError, match="overlaps"):
        speedcore.rms_norm(x, buf[4, :], out=buf[4:])  # weight inside out
    big = torch.randn(2, 512, device="cuda", dtype=bf)
    wl = torch.randn(256, 512, device="cuda", dtype=bf)
    o = torch.empty(2, 256, device="cuda", dtype=bf)
    speedcore.linear(big, wl, out=o)
    with pytest.raises(ValueError, match="overlaps"):
        speedcore.linear(big, wl, out=big.view(-1)[:512].view(2, 256))
    speedcore.matmul(big, wl.t(), out=o)
    with pytest.raises(ValueError, match="overlaps"):
        speedcore.matmul(big, wl.t(), out=big.view(-1)[:512].view(2, 256))
    g = torch.randn(2, 512, device="cuda", dtype=bf)
    speedcore.silu_and_mul(g, out=torch.empty(2, 256, device="cuda", dtype=bf))
    with pytest.raises(ValueError, match="overlaps"):
        speedcore.silu_and_mul(g, out=g[:, :256])


@pytest.mark.gpu
def test_attention_plans_on_fresh_data():
    torch = _torch()
    import speedcore

    bf = torch.bfloat16
    for _ in range(3):
        q = torch.randn(2, 7, 8, 64, device="cuda", dtype=bf)
        k = torch.randn(2, 33, 2, 64, device="cuda", dtype=bf)
        v = torch.randn(2, 33, 2, 64, device="cuda", dtype=bf)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(), enable_gqa=True)
        _close(torch, speedcore.flash_attn(q, k, v), ref.transpose(1, 2))
        o, lse = speedcore.flash_attn(q, k, v, return_lse=True)
        _close(torch, o, ref.transpose(1, 2))
        assert lse.shape == (2, 8, 7)


@pytest.mark.gpu
def test_check_indices_names_the_bad_metadata(monkeypatch):
    torch = _torch()
    import speedcore

    bf = torch.bfloat16
    monkeypatch.setattr(A, "CHECK_INDICES", True)
    kc = torch.randn(4, 16, 2, 64, device="cuda", dtype=bf)
    q = torch.randn(2, 4, 64, device="cuda", dtype=bf)
    table = torch.tensor([[0, 1], [2, 3]], device="cuda", dtype=torch.int32)
    lens = torch.tensor([20, 32], device="cuda", dtype=torch.int32)
    speedcore.paged_decode_attention(q, kc, kc, table, lens)  # valid
    with pytest.raises(ValueError, match="block_table"):
        speedcore.paged_decode_attention(q, kc, kc, torch.tensor([[0, 9], [2, 3]], device="cuda",
                                                                 dtype=torch.int32), lens)
    with pytest.raises(ValueError, match="seq_lens"):
        speedcore.paged_decode_attention(q, kc, kc, table, torch.tensor([20, 33], device="cuda", dtype=torch.int32))
    qv = torch.randn(10, 4, 64, device="cuda", dtype=bf)
    kv = torch.randn(12, 2, 64, device="cuda", dtype=bf)
    cu_q = torch.tensor([0, 4, 10], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], device="cuda", dtype=torch.int32)
    speedcore.flash_attn_varlen(qv, kv, kv, cu_q, cu_k, 6, 7)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        speedcore.flash_attn_varlen(qv, kv, kv, cu_q, torch.tensor([0, 5, 13], device="cuda", dtype=torch.int32), 6, 8)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        speedcore.flash_attn_varlen(qv, kv, kv, torch.tensor([0, 6, 5], device="cuda", dtype=torch.int32), cu_k, 6, 7)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        speedcore.flash_attn_varlen(qv, kv, kv, cu_q, cu_k, 5, 7)


@pytest.mark.gpu
def test_cupy_arrays_take_plans_too():
    cp = pytest.importorskip("cupy")
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception:
        pytest.skip("needs a CUDA GPU")
    import speedcore

    for _ in range(3):
        x = cp.random.standard_normal((3, 512)).astype(cp.float16)
        w = cp.random.standard_normal(512).astype(cp.float16)
        y = speedcore.rms_norm(x, w)
        xf = x.astype(cp.float32)
        ref = xf / cp.sqrt((xf * xf).mean(-1, keepdims=True) + 1e-6) * w.astype(cp.float32)
        assert isinstance(y, cp.ndarray)
        assert float(cp.abs(y.astype(cp.float32) - ref).max()) < 2e-2 * float(cp.abs(ref).max())


@pytest.mark.gpu
def test_rms_norm_residual_out_in_place():
    """vLLM's fused_add_rms_norm in place: h into residual, the normalized rows into x; nothing allocated."""
    torch = _torch()
    import speedcore

    bf = torch.bfloat16
    for _ in range(3):  # checked call, then the plan
        x = torch.randn(6, 1024, device="cuda", dtype=bf)
        r = torch.randn(6, 1024, device="cuda", dtype=bf)
        w = torch.randn(1024, device="cuda", dtype=bf)
        h_ref = x + r
        y_ref = torch.nn.functional.rms_norm(h_ref.float(), (1024,), w.float(), 1e-6)
        y, h = speedcore.rms_norm(x, w, residual=r, out=x, residual_out=r)
        assert y is x and h is r
        _close(torch, r, h_ref, 1e-3)
        _close(torch, x, y_ref)
    with pytest.raises(ValueError, match="residual_out"):
        speedcore.rms_norm(x, w, residual=r, residual_out=w.view(1, 1024).expand(6, 1024))
    with pytest.raises(ValueError, match="needs residual"):
        speedcore.rms_norm(x, w, residual_out=r)
    with pytest.raises(ValueError, match="residual_out"):
        speedcore.rms_norm(x, w, residual=r, out=x, residual_out=x)


@pytest.mark.gpu
def test_check_indices_paged_prefill(monkeypatch):
    torch = _torch()
    import speedcore

    bf = torch.bfloat16
    monkeypatch.setattr(A, "CHECK_INDICES", True)
    kc = torch.randn(4, 16, 2, 64, device="cuda", dtype=bf)
    q = torch.randn(6, 4, 64, device="cuda", dtype=bf)
    cu = torch.tensor([0, 2, 6], device="cuda", dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 3]], device="cuda", dtype=torch.int32)
    used = torch.tensor([20, 32], device="cuda", dtype=torch.int32)
    speedcore.paged_prefill_attention(q, kc, kc, cu, used, table, 4, 32)  # valid
    with pytest.raises(ValueError, match="block_table"):
        speedcore.paged_prefill_attention(q, kc, kc, cu, used, torch.tensor([[0, 7], [2, 3]], device="cuda",
                                                                            dtype=torch.int32), 4, 32)
    with pytest.raises(ValueError, match="seqused_k"):
        speedcore.paged_prefill_attention(q, kc, kc, cu, torch.tensor([20, 40], device="cuda", dtype=torch.int32),
                                          table, 4, 32)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        speedcore.paged_prefill_attention(q, kc, kc, cu, used, table, 3, 32)


@pytest.mark.gpu
def test_paged_decode_out_may_be_q():
    """out=q is allowed by the full check; the cached launch must allow it too (not fall through to a None)."""
    torch = _torch()
    import speedcore

    bf = torch.bfloat16
    kc = torch.randn(4, 16, 2, 64, device="cuda", dtype=bf)
    table = torch.tensor([[0, 1], [2, 3]], device="cuda", dtype=torch.int32)
    lens = torch.tensor([20, 32], device="cuda", dtype=torch.int32)
    for _ in range(3):  # checked call, then the cached launch
        q = torch.randn(2, 4, 64, device="cuda", dtype=bf)
        ref = speedcore.paged_decode_attention(q, kc, kc, table, lens)
        got = speedcore.paged_decode_attention(q, kc, kc, table, lens, out=q)
        assert got is q
        _close(torch, got, ref, 1e-3)


def test_rms_norm_plan_overlap_rules_without_a_gpu(monkeypatch):
    """The cached rms_norm launch refuses (None: the full check then raises) exactly the overlaps the full check
    refuses: h and out may be residual / x themselves in the same layout, never shifted views or each other."""
    from types import SimpleNamespace as NS

    from speedcore import norm

    calls = []
    monkeypatch.setattr(A, "fast_lib", lambda lib: A.FastLib(lambda a: a.ptr, lambda d: 7, None, None,
                                                             lambda x: NS(ptr=9000), None))

    def arr(name, ptr, shape=(4, 64), strides=(64, 1)):
        return A.Array(None, "torch", ptr, shape, strides, "float16", 0, name)

    def obj(p):
        return NS(ptr=p)

    xa, wa, ra = arr("x", 0), arr("weight", 1000, (64,), (1,)), arr("residual", 2000)  # 512 / 128 / 512 bytes
    launch = lambda stream, *p: calls.append(p)  # noqa: E731
    run = norm._plan(xa, wa, ra, arr("out", 3000), arr("h", 2000), launch)
    x, w, r = obj(0), obj(1000), obj(2000)
    out, h = run(x, w, r, obj(3000), r)
    assert h is r and calls[-1] == (3000, 2000, 0, 2000, 1000)     # h into residual itself
    assert run(x, w, r, obj(3000), obj(2002)) is None               # h a shifted view of residual
    assert run(x, w, r, obj(3000), obj(1064)) is None               # h over the weight
    assert run(x, w, r, obj(1000), r) is None                       # out over the weight
    assert run(x, w, r, obj(2000), r) is None                       # out and h the same array
    assert run(x, w, r, obj(3000), x) is not None and calls[-1][1] == 0  # h into x itself
    run2 = norm._plan(xa, wa, ra, arr("out", 2000), None, launch)
    out, h = run2(x, w, r, r, None)
    assert out is r and h.ptr == 9000 and calls[-1] == (2000, 9000, 0, 2000, 1000)  # out = residual, h allocated
    assert run2(x, w, r, obj(2010), None) is None                  # out a shifted view of residual
    run3 = norm._plan(xa, wa, None, None, None, launch)
    assert run3(x, w, None, None, None).ptr == 9000 and calls[-1] == (9000, 0, 0, 0, 1000)


def test_chained_launches_only_where_enabled_and_supported(monkeypatch):
    """Chaining (programmatic dependent launch) is off unless turned on, and never asked of a GPU before sm_90."""
    from types import SimpleNamespace

    from speedcore import _launch as L

    cc = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(L, "device_info", lambda d: SimpleNamespace(cc=cc[d]))
    cfg = L.LaunchConfig((4,), (128,), 1024)
    prev = L.set_chained_launches(False)
    try:
        assert L.chained(cfg, 0) is cfg
        assert L.set_chained_launches(True) is False
        c = L.chained(cfg, 0)
        assert c.overlap and (c.grid, c.block, c.smem, c.cluster) == (cfg.grid, cfg.block, cfg.smem, cfg.cluster)
        assert L.chained(cfg, 1) is cfg
    finally:
        L.set_chained_launches(prev)


def test_switching_chained_launches_drops_cached_plans():
    """A plan holds its launch configuration: switching chaining empties every op module's plan cache."""
    from speedcore import _launch as L
    from speedcore import attention, decode, gemm, norm, paged_attention

    caches = (norm._PLANS, gemm._LINEAR_PLANS, gemm._MATMUL_PLANS, decode._FAST_DECODE, decode._FAST_CACHE,
              decode._FAST_ROTARY, decode._FAST_GATED, attention._FAST_ATTN, paged_attention._PAGED_PLANS)
    prev = L.set_chained_launches(False)
    try:
        for d in caches:
            d["k"] = "plan"
        L.set_chained_launches(False)  # no change: kept
        assert all(d == {"k": "plan"} for d in caches)
        L.set_chained_launches(True)
        assert not any(caches)
    finally:
        L.set_chained_launches(prev)
        for d in caches:
            d.pop("k", None)
