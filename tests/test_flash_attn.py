"""flash_attn / flash_attn_varlen: configuration (CPU), validation (CPU, on described arrays), and the GPU grid
against a float32 reference: odd lengths, seqlen_q != seqlen_k with causal, GQA/MQA, windows, softcap,
non-contiguous views, varlen with empty sequences, every head dim, both dtypes, lse."""
import importlib
import math

import pytest

from speedcore import _arrays as A

fa = importlib.import_module("speedcore.attention")


# ---------------------------------------------------------------- CPU: heuristic and variant list

@pytest.mark.parametrize("head_dim", list(range(8, 257, 8)))
def test_config_fits_and_is_listed(head_dim):
    d, bn, mt, warps, ctas, q_ks, rowsum_mma, stages = fa.flash_attn_config(head_dim)
    assert d >= head_dim and d in fa.HEAD_DIMS
    bm = fa.block_m(mt, warps)
    assert fa.smem_bytes(d, bn, mt, warps, stages) <= 227 * 1024
    # the CTAs per SM that the registers are capped for also fit in shared memory
    assert ctas * fa.smem_bytes(d, bn, mt, warps, stages) <= 228 * 1024 - ctas * 1024
    if mt * d <= 128:  # Q staged in the second pipeline stage
        assert bm <= 2 * bn
    assert bm <= 2 * stages * bn
    names = {k.name for k in fa.all_kernels()}
    for dtype in A.HALF_DTYPES:
        for softcap in (False, True):
            assert fa._kernel(dtype, d, bn, mt, warps, ctas, q_ks, rowsum_mma, stages, softcap).name in names


@pytest.mark.parametrize("head_dim", fa.HEAD_DIMS)
def test_config_shrinks_tiles_for_small_shared_memory(head_dim):
    cfg = fa.flash_attn_config(head_dim, 99 * 1024)  # sm_86 / sm_89 (RTX 30x0, 40x0, L40)
    assert fa.smem_bytes(*cfg[:4], cfg[7]) <= 99 * 1024
    assert fa._kernel("float16", *cfg, True).name in {k.name for k in fa.all_kernels()}


def test_kernel_head_dim():
    assert [fa.kernel_head_dim(x) for x in (8, 32, 40, 64, 80, 96, 128, 160, 192, 200, 256)] == \
        [32, 32, 64, 64, 96, 96, 128, 192, 192, 256, 256]
    with pytest.raises(ValueError):
        fa.kernel_head_dim(264)


# ---------------------------------------------------------------- CPU: validation on described arrays

def _arr(name, shape, dtype="bfloat16", strides=None, ptr=1 << 20, lib="torch", device=0):
    if strides is None:
        strides, acc = [], 1
        for s in reversed(shape):
            strides.append(acc)
            acc *= s
        strides = tuple(reversed(strides))
    return A.Array(None, lib, ptr, shape, strides, dtype, device, name)


def test_check_qkv_accepts_gqa():
    q, k, v = _arr("q", (2, 5, 8, 64)), _arr("k", (2, 7, 2, 64)), _arr("v", (2, 7, 2, 64))
    assert fa._check_qkv(q, k, v, 4, "") == (64, 8, 2)


@pytest.mark.parametrize("case, exc, match", [
    (dict(q=_arr("q", (2, 5, 6, 64)), k=_arr("k", (2, 7, 4, 64)), v=_arr("v", (2, 7, 4, 64))), ValueError,
     "multiple"),
    (dict(q=_arr("q", (2, 5, 8, 264)), k=_arr("k", (2, 7, 8, 264)), v=_arr("v", (2, 7, 8, 264))), ValueError,
     "head_dim"),
    (dict(q=_arr("q", (2, 5, 8, 60)), k=_arr("k", (2, 7, 8, 60)), v=_arr("v", (2, 7, 8, 60))), ValueError,
     "head_dim"),
    (dict(k=_arr("k", (2, 7, 8, 64), dtype="float16")), TypeError, "dtype"),
    (dict(q=_arr("q", (2, 5, 8, 64), dtype="float32"), k=_arr("k", (2, 7, 8, 64), dtype="float32"),
          v=_arr("v", (2, 7, 8, 64), dtype="float32")), TypeError, "float16 or bfloat16"),
    (dict(v=_arr("v", (2, 7, 8, 32))), ValueError, "head_dim"),
    (dict(v=_arr("v", (2, 7, 4, 64))), ValueError, "heads"),
    (dict(q=_arr("q", (5, 8, 64))), ValueError, "dimensions"),
    (dict(k=_arr("k", (2, 7, 8, 64), device=1)), ValueError, "cuda:1"),
    (dict(k=_arr("k", (2, 7, 8, 64), lib="cupy")), TypeError, "library"),
])
def test_check_qkv_rejects(case, exc, match):
    args = dict(q=_arr("q", (2, 5, 8, 64)), k=_arr("k", (2, 7, 8, 64)), v=_arr("v", (2, 7, 8, 64)))
    args.update(case)
    with pytest.raises(exc, match=match):
        fa._check_qkv(args["q"], args["k"], args["v"], 4, "")


@pytest.mark.parametrize("kw, exc", [
    (dict(softmax_scale=0.0), ValueError), (dict(softmax_scale=float("nan")), ValueError),
    (dict(window_size=(-2, 0)), ValueError), (dict(window_size=5), TypeError), (dict(softcap=-1.0), ValueError),
    (dict(causal="yes"), TypeError),
])
def test_check_options_rejects(kw, exc):
    args = dict(causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0)
    args.update(kw)
    with pytest.raises(exc):
        fa._check_options(args["causal"], args["softmax_scale"], args["window_size"], args["softcap"], 64)


def test_check_options_defaults_and_causal_window():
    scale, left, right, cap = fa._check_options(True, None, (16, 5), 0.0, 64)
    assert scale == pytest.approx(1 / 8) and (left, right) == (16, 0) and cap == 0.0


def test_row_view_needs_contiguous_head_dim_and_reports_alignment():
    with pytest.raises(ValueError, match="contiguous"):
        fa._row_view(_arr("q", (2, 5, 8, 64), strides=(5 * 8 * 128, 8 * 128, 128, 2)), "q")
    assert fa._row_view(_arr("q", (2, 5, 8, 64), strides=(5 * 3 * 8 * 64, 3 * 8 * 64, 64, 1)), "q")  # qkv slice
    assert not fa._row_view(_arr("q", (2, 5, 8, 64), strides=(5 * 8 * 65, 8 * 65, 65, 1)), "q")  # copied
    assert not fa._row_view(_arr("q", (2, 5, 8, 64), ptr=(1 << 20) + 2), "q")
    with pytest.raises(ValueError, match="stride between tokens"):
        fa._row_view(_arr("q", (2, 5, 8, 64), strides=(1 << 30, 1 << 24, 64, 1)), "q")


def test_out_must_not_overlap_k_or_v():
    q, k, v = _arr("q", (2, 5, 8, 64)), _arr("k", (2, 5, 8, 64), ptr=1 << 24), _arr("v", (2, 5, 8, 64), ptr=1 << 26)
    fa._check_out(_arr("out", (2, 5, 8, 64), ptr=1 << 28), q, k, v)
    fa._check_out(_arr("out", (2, 5, 8, 64)), q, k, v)  # out is q: allowed
    with pytest.raises(ValueError, match="overlaps k"):
        fa._check_out(_arr("out", (2, 5, 8, 64), ptr=1 << 24), q, k, v)
    with pytest.raises(ValueError, match="shape"):
        fa._check_out(_arr("out", (2, 5, 8, 32), ptr=1 << 28), q, k, v)


# ---------------------------------------------------------------- GPU: both kernels

@pytest.fixture(params=["sm80", "sm90"])
def path(request, monkeypatch):
    """Runs a GPU test once on each kernel: "sm80" forces kernels/attention.cu; "sm90" keeps the dispatcher's
    choice (kernels/attention_sm90.cu wherever it applies) and needs an sm_90 GPU."""
    if request.param == "sm90":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the sm_90 attention kernel needs an H100/H200")
        return "sm90"
    monkeypatch.setattr(fa, "attention_path", lambda head_dim, cc, softcap: "sm80")
    return "sm80"


@pytest.mark.gpu
def test_sm90_kernel_serves_the_default_path(monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 attention kernel needs an H100/H200")
    launches = []
    real = fa._launcher_sm90
    monkeypatch.setattr(fa, "_launcher_sm90", lambda *a, **kw: (launches.append(kw["head_dim"]), real(*a, **kw))[1])
    fa._FAST_ATTN.clear()  # calls cached by an earlier test would not reach the launcher
    for d in (64, 96, 128, 192, 256):
        _run("bfloat16", 1, 300, 300, 2, 1, d, causal=True, seed=d)
    _varlen_case("float16", 128, False, [100, 0, 300], [120, 5, 300], seed=3)
    assert launches == [64, 96, 128, 192, 256, 128]


def test_sm90_head_group():
    lg = fa.sm90_head_group_log2
    assert lg(256, 512 << 10, False) == 0            # unmasked tiles weigh alike: head-major
    assert lg(256, 512 << 10, True) == 5             # 32 pairs x 512 KB of K and V = 16 MB
    assert lg(256, 4 << 20, True) == 2               # longer sequences: fewer pairs per group
    assert lg(1024, 1 << 10, True) == fa.MAX_HEAD_GROUP_LOG2
    assert lg(24, 1 << 10, True) == 3                # a power of two that divides batch x heads
    assert lg(25, 1 << 10, True) == 0
    assert lg(2, 64 << 20, True) == 0                # one pair's K and V already exceed the budget


def test_attention_path():
    assert fa.attention_path(128, (9, 0), False) == "sm90"
    assert fa.attention_path(96, (9, 0), True) == "sm90"
    assert fa.attention_path(256, (9, 0), True) == "sm80"
    assert fa.attention_path(200, (9, 0), False) == "sm90"
    assert fa.attention_path(32, (9, 0), False) == "sm80"
    assert fa.attention_path(128, (8, 0), False) == "sm80"
    assert fa.attention_path(128, (10, 0), False) == "sm80"
    assert [fa.sm90_head_dim(d) for d in (40, 64, 72, 128, 136, 192, 256)] == [64, 64, 128, 128, 192, 192, 256]
    for d in fa.SM90_HEAD_DIMS:
        for masked in (False, True):
            assert fa.smem_bytes_sm90(*fa.flash_attn_sm90_config(d, masked)[:4]) <= 227 * 1024


def test_forced_path_is_checked():
    from speedcore import _launch

    h200 = _launch.DeviceInfo(0, "H200", (9, 0), 132, 1024, 49152, 232448, 233472, 60 << 20)
    a100 = _launch.DeviceInfo(0, "A100", (8, 0), 108, 1024, 49152, 166912, 167936, 40 << 20)
    assert fa._choose_path(h200, 128, 0.0, None) == "sm90"
    assert fa._choose_path(h200, 128, 0.0, "sm80") == "sm80"
    with pytest.raises(ValueError, match="sm_90"):
        fa._choose_path(a100, 128, 0.0, "sm90")
    with pytest.raises(ValueError, match="sm_90"):
        fa._choose_path(h200, 256, 30.0, "sm90")
    with pytest.raises(ValueError, match="_path"):
        fa._choose_path(h200, 128, 0.0, "hopper")


def test_tma_view_of_packed_and_varlen_tensors():
    qkv = A.Array(None, "torch", 1 << 20, (2, 203, 4, 64), (203 * 3 * 4 * 64, 3 * 4 * 64, 64, 1), "bfloat16", 0, "q")
    assert fa._tma_strides(qkv, False) == ((64, 203, 4, 2), (768, 64, 203 * 768))
    one = A.Array(None, "torch", 1 << 20, (1, 1, 1, 128), (7, 7, 7, 1), "bfloat16", 0, "q")
    dims, strides = fa._tma_strides(one, False)
    assert dims == (128, 1, 1, 1) and all(s % 8 == 0 and s > 0 for s in strides)
    var = A.Array(None, "torch", 1 << 20, (300, 8, 128), (1024, 128, 1), "float16", 0, "q")
    assert fa._tma_strides(var, True) == ((128, 300, 8, 1), (1024, 128, 300 * 1024))


# ---------------------------------------------------------------- GPU: reference

def _reference(q, k, v, causal=False, scale=None, window=(-1, -1), softcap=0.0):
    """float32 attention over (b, s, h, d) tensors with flash-attn 2 semantics; returns out (b, sq, h, d)
    and lse (b, h, sq) with zeros / -inf for rows that see no key."""
    import torch

    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = scale if scale is not None else 1 / math.sqrt(d)
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        visible &= j >= i + sk - sq - left
    if right >= 0:
        visible &= j <= i + sk - sq + right
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = (p @ vf).transpose(1, 2)
    return out, lse


def _relerr(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(out, lse, ref_out, ref_lse, tol=5e-3):
    import torch

    assert not torch.isnan(out).any()
    err = _relerr(out, ref_out)
    assert err <= tol, f"relative L2 error {err:.2e}"
    if lse is not None:
        empty = torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(lse), empty)
        assert torch.allclose(lse[~empty], ref_lse[~empty], atol=2e-3, rtol=1e-4)
        # rows that see no key are exactly zero
        rows_empty = empty.transpose(1, 2) if out.dim() == 4 else empty.transpose(0, 1)
        assert (out[rows_empty] == 0).all()


def _rand(torch, shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, device="cuda", dtype=torch.float32, generator=gen) * scale).to(dtype)


def _run(dtype, b, sq, sk, h, hkv, d, causal=False, window=(-1, -1), softcap=0.0, scale=None, seed=0,
         qk_scale=1.0):
    import speedcore

    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = _rand(torch, (b, sq, h, d), dt, gen, qk_scale)
    k = _rand(torch, (b, sk, hkv, d), dt, gen, qk_scale)
    v = _rand(torch, (b, sk, hkv, d), dt, gen)
    out = torch.full_like(q, float("nan"))
    res, lse = speedcore.flash_attn(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                    softmax_scale=scale, return_lse=True, out=out)
    assert res is out and lse.dtype == torch.float32 and lse.shape == (b, h, sq)
    ref_out, ref_lse = _reference(q, k, v, causal, scale, window, softcap)
    _check(out, lse, ref_out, ref_lse)
    return out


# ---------------------------------------------------------------- GPU: the grid

SMALL_LENGTHS = [(1, 1), (17, 17), (1, 130), (130, 1), (17, 127)]
LENGTHS = SMALL_LENGTHS + [(127, 127), (1000, 1000), (127, 1000), (1000, 127), (513, 64)]


@pytest.mark.gpu
@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", LENGTHS)
def test_flash_attn_grid(dtype, d, causal, sq, sk):
    _run(dtype, 2, sq, sk, 3, 3, d, causal=causal, seed=sq * 7 + sk + d)


@pytest.mark.gpu
@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [8, 40, 80, 160, 200])
def test_padded_head_dims_small(dtype, d):
    _run(dtype, 2, 77, 150, 2, 1, d, causal=True, seed=d)


@pytest.mark.gpu
@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("h, hkv", [(8, 1), (16, 2), (6, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_mqa_small(h, hkv, causal):
    _run("bfloat16", 2, 100, 300, h, hkv, 128, causal=causal, seed=h + hkv)
    _run("float16", 1, 129, 129, h, hkv, 64, causal=causal, seed=h * hkv)


@pytest.mark.gpu
@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("window", [(16, 0), (32, 8), (-1, 16), (100, -1), (0, 0), (5000, 5000)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", [(300, 300), (200, 450), (450, 200)])
@pytest.mark.parametrize("d", [64, 128])
def test_sliding_window_small(window, causal, sq, sk, d):
    _run("bfloat16", 2, sq, sk, 2, 2, d, causal=causal, window=window, seed=sq + sk + window[0])


@pytest.mark.gpu
@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("softcap", [5.0, 30.0])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_softcap_small(softcap, causal, d):
    _run("bfloat16", 2, 200, 333, 2, 1, d, causal=causal, softcap=softcap, qk_scale=3.0, seed=d)


@pytest.mark.gpu
@pytest.mark.usefixtures("path")
def test_softmax_scale_and_large_scores_small():
    _run("float16", 2, 150, 150, 2, 2, 64, scale=0.5, seed=1)
    _run("bfloat16", 2, 150, 150, 2, 2, 128, causal=True, qk_scale=4.0, seed=2)


@pytest.mark.gpu
@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
def test_packed_qkv_views_and_strided_out_small(dtype, d):
    import speedcore

    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(d)
    b, s, h = 2, 203, 4
    qkv = _rand(torch, (b, s, 3, h, d), dt, gen)
    q, k, v = qkv.unbind(2)  # views with row stride 3 * h * d
    big = torch.full((b, h, s, d + 8), float("nan"), device="cuda", dtype=dt)
    out = big[..., :d].transpose(1, 2)  # (b, s, h, d) with the head as the outer stride
    res = speedcore.flash_attn(q, k, v, causal=True, out=out)
    assert res is out
    ref, _ = _reference(q, k, v, causal=True)
    _check(out, None, ref, None)
    assert torch.isnan(big[..., d:]).all()  # nothing written past the view
    # (b, h, s, d) tensors transposed to (b, s, h, d), as from a model that keeps heads outer
    qt, kt, vt = (_rand(torch, (b, h, s, d), dt, gen).transpose(1, 2) for _ in range(3))
    _check(speedcore.flash_attn(qt, kt, vt), None, _reference(qt, kt, vt)[0], None)
    # strides that are not multiples of 8 elements: copied, still correct
    odd = _rand(torch, (b, s, h, d + 1), dt, gen)[..., :d]
    _check(speedcore.flash_attn(odd, k, v), None, _reference(odd, k, v)[0], None)


@pytest.mark.gpu
@pytest.mark.usefixtures("path")
def test_out_may_be_q_small():
    import speedcore

    torch = pytest.importorskip("torch")
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (_rand(torch, (2, 300, 4, 128), torch.bfloat16, gen) for _ in range(3))
    ref, _ = _reference(q, k, v, causal=True)
    res = speedcore.flash_attn(q, k, v, causal=True, out=q)
    assert res is q
    _check(q, None, ref, None)


@pytest.mark.gpu
@pytest.mark.usefixtures("path")
def test_fully_masked_rows_small():
    import speedcore

    torch = pytest.importorskip("torch")
    gen = torch.Generator(device="cuda").manual_seed(4)
    # causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k queries see nothing
    q = _rand(torch, (1, 200, 2, 64), torch.float16, gen)
    k, v = (_rand(torch, (1, 50, 2, 64), torch.float16, gen) for _ in range(2))
    out, lse = speedcore.flash_attn(q, k, v, causal=True, return_lse=True)
    assert (out[:, :150] == 0).all() and torch.isneginf(lse[:, :, :150]).all()
    assert torch.isfinite(lse[:, :, 150:]).all()
    ref, ref_lse = _reference(q, k, v, causal=True)
    _check(out, lse, ref, ref_lse)
    # seqlen_k == 0: every row is empty
    k0 = torch.empty((1, 0, 2, 64), device="cuda", dtype=torch.float16)
    out, lse = speedcore.flash_attn(q, k0, k0, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
    # seqlen_q == 0
    out = speedcore.flash_attn(q[:, :0], k, v)
    assert out.shape == (1, 0, 2, 64)


def _varlen_case(dtype, d, causal, lens_q, lens_k, h=4, hkv=2, window=(-1, -1), softcap=0.0, seed=0):
    import speedcore

    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cu_q = torch.tensor([0] + list(_cumsum(lens_q)), device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0] + list(_cumsum(lens_k)), device="cuda", dtype=torch.int32)
    q = _rand(torch, (sum(lens_q), h, d), dt, gen)
    k = _rand(torch, (sum(lens_k), hkv, d), dt, gen)
    v = _rand(torch, (sum(lens_k), hkv, d), dt, gen)
    out = torch.full_like(q, float("nan"))
    res, lse = speedcore.flash_attn_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                           window_size=window, softcap=softcap, return_lse=True, out=out)
    assert res is out and lse.shape == (h, sum(lens_q))
    ref_out = torch.zeros_like(q, dtype=torch.float32)
    ref_lse = torch.full((h, sum(lens_q)), float("-inf"), device="cuda")
    for i in range(len(lens_q)):
        qs, qe, ks, ke = cu_q[i].item(), cu_q[i + 1].item(), cu_k[i].item(), cu_k[i + 1].item()
        if qe == qs:
            continue
        if ke == ks:
            continue  # zeros, -inf
        o, l = _reference(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], causal, None, window, softcap)
        ref_out[qs:qe] = o[0]
        ref_lse[:, qs:qe] = l[0]
    _check(out, lse, ref_out, ref_lse)


def _cumsum(xs):
    acc = 0
    for x in xs:
        acc += x
        yield acc


@pytest.mark.gpu
@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_small(dtype, d, causal):
    lens_q = [37, 0, 1, 200, 64, 5]
    lens_k = [37, 10, 0, 300, 64, 129]
    _varlen_case(dtype, d, causal, lens_q, lens_k, seed=d)


@pytest.mark.gpu
@pytest.mark.usefixtures("path")
def test_varlen_window_softcap_small():
    _varlen_case("bfloat16", 128, True, [100, 17, 250], [120, 17, 250], window=(32, 0), softcap=20.0, seed=5)
    _varlen_case("float16", 96, False, [90, 1], [70, 333], h=8, hkv=1, window=(10, 20), seed=6)


@pytest.mark.gpu
@pytest.mark.usefixtures("path")
def test_long_sequence():
    _run("bfloat16", 1, 4096, 4096, 2, 1, 128, causal=True, seed=11)
    _run("float16", 1, 3000, 5000, 2, 2, 64, causal=False, seed=12)


@pytest.mark.gpu
def test_cupy_arrays_small():
    import speedcore

    cupy = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    rs = cupy.random.RandomState(0)
    q, k, v = (rs.standard_normal((2, 70, 4, 64), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
    out = speedcore.flash_attn(q, k, v, causal=True)
    assert isinstance(out, cupy.ndarray) and out.dtype == cupy.float16
    ref, _ = _reference(*(torch.from_dlpack(x) for x in (q, k, v)), causal=True)
    _check(torch.from_dlpack(out), None, ref, None)


@pytest.mark.gpu
def test_bad_input_raises_before_launch():
    import speedcore

    torch = pytest.importorskip("torch")
    q = torch.randn(2, 16, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 16, 3, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple"):
        speedcore.flash_attn(q, k, k)
    with pytest.raises(TypeError, match="dtype"):
        speedcore.flash_attn(q, q.half(), q)
    with pytest.raises(TypeError, match="CUDA"):
        speedcore.flash_attn(q.cpu(), q, q)
    with pytest.raises(ValueError, match="head_dim"):
        x = torch.randn(2, 16, 8, 72 + 4, device="cuda", dtype=torch.bfloat16)
        speedcore.flash_attn(x, x, x)
    with pytest.raises(ValueError, match="batch"):
        speedcore.flash_attn(q, q[:1], q[:1])
    qv = q.reshape(32, 8, 64)
    cu = torch.tensor([0, 16, 32], device="cuda", dtype=torch.int64)
    with pytest.raises(TypeError, match="int32"):
        speedcore.flash_attn_varlen(qv, qv, qv, cu, cu, 16, 16)
    cu32 = cu.int()
    with pytest.raises(ValueError, match="length"):
        speedcore.flash_attn_varlen(qv, qv, qv, cu32, cu32[:2], 16, 16)
    with pytest.raises(TypeError, match="CUDA"):
        speedcore.flash_attn_varlen(qv, qv, qv, cu32.cpu(), cu32, 16, 16)


def test_varlen_seqused_k_needs_a_block_table():
    import speedcore

    with pytest.raises(ValueError, match="seqused_k"):
        speedcore.flash_attn_varlen(None, None, None, None, None, 1, 1, seqused_k=object())


@pytest.mark.gpu
def test_varlen_with_block_table_is_paged_prefill():
    """flash-attn's block_table= form: K/V are paged caches; the same result as paged_prefill_attention, with
    seqused_k given or derived from cu_seqlens_k."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import speedcore

    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    kc = torch.randn(12, 16, 2, 64, device="cuda", dtype=bf, generator=g)
    vc = torch.randn(12, 16, 2, 64, device="cuda", dtype=bf, generator=g)
    table = torch.randperm(12, device="cuda", generator=g).to(torch.int32).view(2, 6)
    used = torch.tensor([40, 90], device="cuda", dtype=torch.int32)
    cu_q = torch.tensor([0, 5, 12], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, 40, 130], device="cuda", dtype=torch.int32)
    q = torch.randn(12, 8, 64, device="cuda", dtype=bf, generator=g)
    ref = speedcore.paged_prefill_attention(q, kc, vc, cu_q, used, table, 7, 90, causal=True)
    got = speedcore.flash_attn_varlen(q, kc, vc, cu_q, None, 7, 90, causal=True, block_table=table, seqused_k=used)
    got2 = speedcore.flash_attn_varlen(q, kc, vc, cu_q, cu_k, 7, 90, causal=True, block_table=table)
    assert torch.equal(got, ref) and torch.equal(got2, ref)
