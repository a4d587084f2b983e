"""Compact prepacking (``prepack_awq`` / ``prepack_gptq`` with ``copies="compact"``): one INT4 copy per layer, the
wgmma-major one, read by gemv_stream_kernel's wgmma-major variant (WL = 1) at M <= 16 and by w4_wgmma_kernel above.
CPU: what prepack keeps and which kernel each M launches with which pointers (on the fake sm_90 GPU of
quant_fakes.py); GPU: outputs against the reference dequantization over every M range, act-order, the errors."""
import numpy as np
import pytest

from quant_fakes import FakeTensor, act_order_gptq, install_fake_gpu, launched
from speedcore import quant as Q


@pytest.fixture
def fake_gpu(monkeypatch):
    return install_fake_gpu(monkeypatch, w4_copy=True)


def _awq(k, n, g, dtype="bfloat16", **kw):
    return Q.prepack_awq(FakeTensor((k, n // 8), "int32"), FakeTensor((k // g, n // 8), "int32"),
                         FakeTensor((k // g, n), dtype), group_size=g, **kw)


def test_copies_argument_is_checked():
    for fn in (Q.prepack_awq, Q.prepack_gptq):
        with pytest.raises(ValueError, match="copies: expected one of 'all', 'compact', got 'one'"):
            fn(None, None, None, copies="one")


def test_compact_applies_only_where_both_readers_run():
    assert Q.compact_applies(6144, 4096, 128, (9, 0)) and Q.compact_applies(4096, 14336, 128, (9, 0))
    assert not Q.compact_applies(6144, 4096, 128, (8, 0))  # no w4_wgmma_kernel: the fragment-major copies
    assert not Q.compact_applies(6144, 4096, 64, (9, 0))   # G % 128 != 0 (neither reader takes it)
    assert not Q.compact_applies(576, 4096, 128, (9, 0))   # N % 256 != 0
    assert not Q.compact_applies(4096, 4160, 64, (9, 0))   # K % 128 != 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compact_layer_keeps_one_copy_and_every_m_reads_it(fake_gpu, dtype):
    calls, _ = fake_gpu
    k, n, g = 1024, 2560, 128  # N > W4WGMMA_AUTO_NARROW_N: w4_wgmma_kernel from M = 17 on (narrower: from 9, as "all")
    pw = _awq(k, n, g, dtype, copies="compact")
    assert (pw.qweight, pw.qzeros, pw.scales, pw.packed) == (None, None, None, None)
    assert pw.gemv.w_ptr == 0 and pw.gemv.g_ptr == 0 and pw.gemv.w4_ptr and pw.gemv.w4_g_ptr
    bias = FakeTensor((n,), dtype)
    for m in (1, 5, 8, 9, 16):  # gemv_stream_kernel on the wgmma-major copy and its group-major records
        calls.clear()
        Q.awq_linear(FakeTensor((m, k), dtype), pw, bias=bias)
        (kernel, lcfg, args), = calls
        cfg = Q.stream_config(m, n, k, Q.KIND_INT4, 132)
        assert kernel.name == Q._stream_kernel(dtype, Q.KIND_INT4, cfg.mt, (), cfg.nbc, Q.WL_WGMMA).name
        assert kernel.name.endswith(", 1>") and tuple(lcfg.grid) == (cfg.grid,)
        assert (args[4], args[5], args[6], args[7]) == (pw.gemv.w4_ptr, pw.gemv.w4_g_ptr, 0, bias.ptr)
    for m in (17, 300, 9000):  # w4_wgmma_kernel, also past the dispatch's 8192 (nothing else reads this copy)
        calls.clear()
        Q.awq_linear(FakeTensor((m, k), dtype), pw)
        assert len(calls) == 1 and "w4_wgmma_kernel" in calls[0][0].name and calls[0][2][2] == pw.gemv.w4_ptr
    old = Q._STREAM_MODE
    try:  # the measurement switch that turns the streaming kernel off cannot strand a compact layer
        Q._STREAM_MODE = "off"
        calls.clear()
        Q.awq_linear(FakeTensor((1, k), dtype), pw)
        assert "gemv_stream_kernel" in calls[0][0].name
    finally:
        Q._STREAM_MODE = old


def test_compact_gptq_and_the_shapes_it_does_not_apply_to(fake_gpu):
    calls, _ = fake_gpu
    k, n, g = 1024, 1536, 128
    pg = Q.prepack_gptq(FakeTensor((k // 8, n), "int32"), FakeTensor((k // g, n // 8), "int32"),
                        FakeTensor((k // g, n), "bfloat16"), group_size=g, copies="compact")
    assert pg.qweight is None and pg.gemv.w_ptr == 0 and pg.fast.perm is None
    Q.gptq_linear(FakeTensor((1, k), "bfloat16"), pg)
    assert calls[-1][0].name.endswith(", 1>") and calls[-1][2][4] == pg.gemv.w4_ptr
    # N % 256 != 0 and G = 64: no single copy serves every M there, so "compact" keeps what "all" keeps
    for kk, nn, gg in ((1024, 576, 128), (1024, 1536, 64)):
        pw = _awq(kk, nn, gg, copies="compact")
        assert pw.qweight is not None and pw.packed is not None and pw.gemv.w_ptr != 0


def test_compact_layer_rejects_what_it_cannot_convert(fake_gpu):
    k, n, g = 1024, 1536, 128
    pw = _awq(k, n, g, copies="compact")
    with pytest.raises(TypeError, match="x: a layer prepacked with copies='compact' takes bfloat16"):
        Q.awq_linear(FakeTensor((1, k), "float16"), pw)
    with pytest.raises(ValueError, match=r"x: expected shape \(\.\.\., 1024\)"):
        Q.awq_linear(FakeTensor((1, k + 128), "bfloat16"), pw)
    with pytest.raises(ValueError, match=r"bias: expected a contiguous \(1536,\) array"):
        Q.awq_linear(FakeTensor((1, k), "bfloat16"), pw, bias=FakeTensor((n,), "float16"))


# -------------------------------------------------------------------------------------------------- GPU tests

def _gpu_layer(torch, fmt, n, k, g, td, rng, copies):
    w = rng.standard_normal((n, k)).astype(np.float32)
    if fmt == Q.FMT_AWQ:
        qw, qz, s = Q.quantize_awq(w, g)
        ref = Q.dequantize_awq_reference(qw, qz, s, g)
    else:
        qw, qz, s, gi = Q.quantize_gptq(w, g)
        ref = Q.dequantize_gptq_reference(qw, qz, s, gi, g)
    t = [torch.from_numpy(a).cuda() for a in (qw, qz)] + [torch.from_numpy(s).cuda().to(td)]
    ref = (Q.dequantize_awq_reference if fmt == Q.FMT_AWQ else
           (lambda a, b, c, gg: Q.dequantize_gptq_reference(a, b, c, None, gg)))(qw, qz, t[2].float().cpu().numpy(), g)
    pre = Q.prepack_awq if fmt == Q.FMT_AWQ else Q.prepack_gptq
    return pre(*t, group_size=g, copies=copies), ref


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fmt", [Q.FMT_AWQ, Q.FMT_GPTQ])
@pytest.mark.parametrize("n,k,g", [(768, 512, 128), (1536, 1024, 256), (6144, 4096, 128), (4096, 14336, 128)])
def test_compact_layer_matches_the_reference_at_every_m(dtype, fmt, n, k, g):
    """A compact layer's outputs (poisoned y, with bias, x a row-strided view) at M = 1..16 (gemv_stream_kernel on
    the wgmma-major copy), 17..300 and past 8192 (w4_wgmma_kernel) against float64 x @ W, and bit for bit against
    the same layer prepacked with every copy where both take w4_wgmma_kernel."""
    torch = pytest.importorskip("torch")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("compact layers need sm_90 (w4_wgmma_kernel's copy)")
    td = getattr(torch, dtype)
    rng = np.random.default_rng(n + k + g)
    layer, w_kn = _gpu_layer(torch, fmt, n, k, g, td, rng, "compact")
    full, _ = _gpu_layer(torch, fmt, n, k, g, td, np.random.default_rng(n + k + g), "all")
    assert layer.gemv.w_ptr == 0 and layer.qweight is None
    bias = (0.1 * torch.randn(n, device="cuda")).to(td)
    linear = Q.awq_linear if fmt == Q.FMT_AWQ else Q.gptq_linear
    for m in (1, 2, 3, 7, 8, 9, 12, 16, 17, 64, 300) + ((8200,) if n * k <= 1 << 23 else ()):
        big = torch.randn(m, k + 64, device="cuda").to(td)
        x = big[:, :k]  # rows 16-byte aligned, row stride k + 64
        with launched() as names:
            y = linear(x, layer, bias=bias)
        w4 = m > 16 or Q.use_w4wgmma(m, n, k, g)  # narrow layers (N <= 2048) from M = 9, as with every copy
        want = "w4_wgmma_kernel" if w4 else "gemv_stream_kernel"
        assert len(names) == 1 and want in names[0] and (w4 or names[0].endswith(", 1>")), (m, names)
        ref = x.double().cpu().numpy() @ w_kn.astype(np.float64) + bias.double().cpu().numpy()
        err = np.abs(y.double().cpu().numpy() - ref).max() / (np.abs(ref).max() + 1e-30)
        assert err < (2e-2 if dtype == "bfloat16" else 4e-3), (m, err)
        if w4:
            assert torch.equal(y, linear(x, full, bias=bias)), m
        else:  # the fragment-major stream kernel sums the same products in another k order: close, not equal
            yf = linear(x, full, bias=bias).double()
            assert (y.double() - yf).abs().max().item() <= 2 * err * np.abs(ref).max() + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compact_act_order_gptq(dtype):
    """Act-order GPTQ, compact: x's columns are gathered in the repacked order on the fast path, at M = 1 and 64,
    eager and inside a CUDA graph."""
    torch = pytest.importorskip("torch")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("compact layers need sm_90")
    td = getattr(torch, dtype)
    (qw, qz, s, gi), w_kn = act_order_gptq(torch, td, np.random.default_rng(3), n=512, k=1024, g=128)
    layer = Q.prepack_gptq(qw, qz, s, gi, group_size=128, copies="compact")
    assert layer.qweight is None and layer.fast.perm is not None
    for m in (1, 64):
        x = torch.randn(m, 1024, device="cuda").to(td)
        ref = x.double().cpu().numpy() @ w_kn.astype(np.float64)
        y = Q.gptq_linear(x, layer)
        assert np.abs(y.double().cpu().numpy() - ref).max() / np.abs(ref).max() < 2e-2, m
        y2 = Q.gptq_linear(x, layer)  # a second call of the signature: no cached plan skips the gather
        assert torch.equal(y, y2)
