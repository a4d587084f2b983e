import numpy as np
import pytest

from speedcore import norm

# ---------------------------------------------------------------- CPU: the launch heuristic and the variant list


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("hidden", [8, 64, 111 * 8, 4096, 8192, 12288, 16384])
def test_config_covers_row_in_one_block(hidden, itemsize):
    vec = 16 // itemsize
    if hidden % vec:
        pytest.skip("not vectorizable")
    nv, threads = norm.rms_norm_config(hidden, itemsize, True)
    assert threads % 32 == 0 and 32 <= threads <= norm.MAX_THREADS
    assert nv * threads * vec >= hidden  # the whole row fits in the block's registers
    assert nv <= 4 or (nv // 2) * norm.MAX_THREADS * vec < hidden  # no more vectors per thread than needed
    assert nv >= 4 or nv * 32 * vec >= hidden  # but four in flight per thread when the row is long enough


def test_rowloop_config_for_unaligned_rows():
    nv, threads = norm.rms_norm_config(111, 2, False)
    assert nv == 0 and threads == 128


def test_all_kernels_lists_every_launchable_variant():
    names = {k.name for k in norm.all_kernels()}
    for dtype, item in (("float16", 2), ("bfloat16", 2), ("float32", 4)):
        for hidden in range(16 // item, norm.MAX_HIDDEN + 1, 16 // item * 37):
            for vectorized in (True, False):
                nv, _ = norm.rms_norm_config(hidden, item, vectorized)
                for residual in (False, True):
                    assert norm._kernel(dtype, nv, residual).name in names


# ---------------------------------------------------------------- GPU

def _ref(x, w, eps, r=None):
    import torch

    h = x if r is None else (x + r)  # rounded to the input dtype, as the kernel returns it
    hd = h.double()
    y = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    return y, h


def _tol(dtype):
    import torch

    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]


def _relerr(a, b):
    a = a.double()
    b = b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(1, 8), (3, 111), (7, 1000), (33, 4096), (5, 8192), (2, 16384), (2, 3, 1536),
                                   (4, 12)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_torch(dtype, shape, residual):
    import speedcore

    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(hash((dtype, shape, residual)) % 2**31)
    x = torch.randn(shape, device="cuda", dtype=dt, generator=g) * 3 + 0.5
    w = torch.randn(shape[-1], device="cuda", dtype=dt, generator=g)
    r = torch.randn(shape, device="cuda", dtype=dt, generator=g) if residual else None
    out = torch.full_like(x, float("nan"))
    res = speedcore.rms_norm(x, w, 1e-5, residual=r, out=out)
    y_ref, h_ref = _ref(x, w, 1e-5, r)
    if residual:
        y, h = res
        assert torch.equal(h, h_ref)
        assert h.data_ptr() not in (x.data_ptr(), r.data_ptr())
    else:
        y = res
    assert y is out  # written in place, zero-copy
    assert torch.isfinite(y).all()
    assert _relerr(y, y_ref) < _tol(dt)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rms_norm_strided_views(dtype):
    import speedcore

    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)
    big = torch.randn(64, 3 * 2048, device="cuda", dtype=dt)
    x = big[:, 2048:4096]          # row stride 6144, 16-byte aligned: vectorized path
    x_odd = big[:, 1:2001]         # misaligned start: row-loop path
    w = torch.randn(2048, device="cuda", dtype=dt)
    for view in (x, x_odd, big.view(64, 3, 2048)[:, 1]):
        ww = w[: view.shape[-1]].contiguous()
        y = speedcore.rms_norm(view, ww)
        assert y.is_contiguous() and y.shape == view.shape
        assert _relerr(y, _ref(view, ww, 1e-6)[0]) < _tol(dt)
    # output into a strided view of a larger buffer
    outbuf = torch.full((64, 4096), float("nan"), device="cuda", dtype=dt)
    speedcore.rms_norm(x, w, out=outbuf[:, 1024:3072])
    assert _relerr(outbuf[:, 1024:3072], _ref(x, w, 1e-6)[0]) < _tol(dt)
    assert torch.isnan(outbuf[:, :1024]).all() and torch.isnan(outbuf[:, 3072:]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_rms_norm_cupy(dtype):
    import speedcore

    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(1)
    cdt = speedcore._arrays._cupy_dtype(dtype)
    x64 = rng.standard_normal((37, 4096))
    w64 = rng.standard_normal(4096)
    r64 = rng.standard_normal((37, 4096))
    x = cupy.asarray(x64.astype(np.float32)).astype(cdt)
    w = cupy.asarray(w64.astype(np.float32)).astype(cdt)
    r = cupy.asarray(r64.astype(np.float32)).astype(cdt)
    y, h = speedcore.rms_norm(x, w, residual=r)
    assert isinstance(y, cupy.ndarray) and isinstance(h, cupy.ndarray) and y.dtype == x.dtype
    hd = (x.astype(np.float32) + r.astype(np.float32)).astype(cdt).astype(np.float64)
    assert cupy.array_equal(h.astype(np.float64), hd)
    ref = hd / cupy.sqrt((hd ** 2).mean(-1, keepdims=True) + 1e-6) * w.astype(np.float64)
    err = float(cupy.linalg.norm(y.astype(np.float64) - ref) / cupy.linalg.norm(ref))
    assert err < {"float32": 1e-5, "float16": 2e-3, "bfloat16": 8e-3}[dtype]


@pytest.mark.gpu
def test_rms_norm_cupy_stream():
    import speedcore

    cupy = pytest.importorskip("cupy")
    x = cupy.random.standard_normal((256, 2048), dtype=np.float32)
    w = cupy.random.standard_normal(2048, dtype=np.float32)
    cupy.cuda.Device().synchronize()  # a non-blocking stream does not wait for work on the default stream
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        y = speedcore.rms_norm(x, w)
        s.synchronize()
    ref = x / cupy.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6) * w
    assert float(cupy.abs(y - ref).max()) < 1e-4


@pytest.mark.gpu
def test_rms_norm_side_stream_and_graph():
    import speedcore

    torch = pytest.importorskip("torch")
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x2 = x * 2  # produced on the side stream: the kernel must run after it, on the same stream
        y = speedcore.rms_norm(x2, w)
    torch.cuda.current_stream().wait_stream(s)
    assert _relerr(y, _ref(x * 2, w, 1e-6)[0]) < 8e-3

    # capture and replay
    xs = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(xs)
    speedcore.rms_norm(xs, w, out=out)  # compile + load outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        speedcore.rms_norm(xs, w, out=out)
    for _ in range(2):
        xs.copy_(torch.randn_like(xs))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert _relerr(out, _ref(xs, w, 1e-6)[0]) < 8e-3


@pytest.mark.gpu
def test_rms_norm_empty_rows():
    import speedcore

    torch = pytest.importorskip("torch")
    x = torch.randn(0, 4096, device="cuda", dtype=torch.float16)
    w = torch.randn(4096, device="cuda", dtype=torch.float16)
    assert speedcore.rms_norm(x, w).shape == (0, 4096)


@pytest.mark.gpu
def test_rms_norm_errors():
    import speedcore

    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    x = torch.randn(8, 256, device="cuda", dtype=torch.float16)
    w = torch.randn(256, device="cuda", dtype=torch.float16)
    with pytest.raises(TypeError, match="x: expected a CUDA tensor"):
        speedcore.rms_norm(x.cpu(), w)
    with pytest.raises(TypeError, match="x: expected a CUDA torch.Tensor or cupy.ndarray.*numpy"):
        speedcore.rms_norm(np.zeros((8, 256), np.float16), w)
    with pytest.raises(TypeError, match="weight: dtype bfloat16 does not match x's float16"):
        speedcore.rms_norm(x, w.bfloat16())
    with pytest.raises(TypeError, match="x: dtype int32 is not supported"):
        speedcore.rms_norm(x.int(), w.int())
    with pytest.raises(ValueError, match=r"weight: expected shape \(256,\)"):
        speedcore.rms_norm(x, w[:128])
    with pytest.raises(ValueError, match="hidden size"):
        speedcore.rms_norm(torch.randn(2, 16392, device="cuda", dtype=torch.float16),
                           torch.randn(16392, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        speedcore.rms_norm(x.t(), torch.randn(8, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="residual: expected shape"):
        speedcore.rms_norm(x, w, residual=x[:4])
    with pytest.raises(TypeError, match="weight: is a cupy.ndarray but x is a torch.Tensor"):
        speedcore.rms_norm(x, cupy.asarray(w.cpu().numpy()))
    with pytest.raises(ValueError, match="eps"):
        speedcore.rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="out: overlaps weight"):
        buf = torch.randn(8 * 256 + 256, device="cuda", dtype=torch.float16)
        speedcore.rms_norm(x, buf[:256], out=buf[128:128 + 8 * 256].view(8, 256))
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="is on cuda:1"):
            speedcore.rms_norm(x, w.to("cuda:1"))
