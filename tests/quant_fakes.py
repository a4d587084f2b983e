"""Test scaffolding shared by test_quant.py and test_quant_w4wgmma.py: a stand-in CUDA tensor and a fake GPU under
which speedcore.quant's Python launch paths run without one (their launches recorded), a spy on the real
launches of a GPU test, and the exact-rows check of the GPU tests."""
import contextlib

import numpy as np

from speedcore import quant as Q


class FakeTensor:
    """Stands in for a CUDA tensor so that the Python launch paths can run without a GPU."""
    _next = [1 << 20]

    def __init__(self, shape, dtype, strides=None):
        self.shape = tuple(shape)
        self.dtype = dtype
        st, acc = [], 1
        for d in reversed(self.shape):
            st.append(acc)
            acc *= max(d, 1)
        self.strides = tuple(strides) if strides is not None else tuple(reversed(st))
        self.ptr = FakeTensor._next[0]
        FakeTensor._next[0] += 1 << 24

    def new_empty(self, shape):
        t = FakeTensor(shape, self.dtype)
        t.ptr = 0xABC000
        return t

    def data_ptr(self):
        return self.ptr

    def reshape(self, shape):
        return FakeTensor(shape, self.dtype)


def install_fake_gpu(monkeypatch, w4_copy: bool):
    """Patch speedcore.quant for FakeTensor inputs on a 132-SM sm_90 device: launches are appended to `calls` as
    (kernel, cfg, args), TMA maps to `maps`, and prepacked layers get fake fragment-major copies (plus the
    wgmma-major INT4 copy where ``w4_copy`` and the w4_wgmma switch and shape allow it).  Returns (calls, maps)."""
    from speedcore import _arrays as A
    from speedcore import _tma

    real_wrap = A.wrap

    def wrap(x, name, *, optional=False):
        if isinstance(x, FakeTensor):
            return A.Array(x, "torch", x.ptr, x.shape, x.strides, x.dtype, 0, name)
        return real_wrap(x, name, optional=optional)

    calls, maps = [], []
    monkeypatch.setattr(A, "wrap", wrap)
    monkeypatch.setattr(A, "stream_of", lambda ref: type("S", (), {"ptr": 0})())
    monkeypatch.setattr(Q, "device_info", lambda i: type("D", (), {"sms": 132, "cc": (9, 0)})())
    monkeypatch.setattr(Q, "launch", lambda kernel, cfg, args, device, stream: calls.append((kernel, cfg, args)))
    monkeypatch.setattr(A, "split_k_scratch", lambda ref, stream, partial_bytes, tickets: (0x5000, 0x6000))
    monkeypatch.setattr(Q, "_pack", lambda fmt, qa, k, n: wrap(FakeTensor(Q.packed_shape(fmt, k, n), "int32"), "p"))
    monkeypatch.setattr(Q, "_gemv_scratch", lambda xa, stream, floats, tickets: (0x7000, 0x8000))
    monkeypatch.setattr(_tma, "tile_map_2d", lambda *a, **kw: maps.append((a, kw)) or "tmap")
    monkeypatch.setattr(Q, "_w4_cluster_ctas", lambda kernel, device, smem: ())  # every split count fits

    def gemv_pack(fmt, qa, za, sa, k, n, group, compact=False):
        w = FakeTensor((n * k // 8,), "int32")
        kind = Q.KIND_INT8 if fmt == Q.FMT_INT8 else Q.KIND_INT4
        w4 = None
        if w4_copy and kind == Q.KIND_INT4 and Q._W4WGMMA_MODE != "off" and Q.w4wgmma_supported(k, n, group):
            w4 = FakeTensor((n * k // 8,), "int32")
        if w4_copy and kind == Q.KIND_INT8 and Q._W8WGMMA_MODE != "off" and Q.w8wgmma_supported(k, n):
            w4 = FakeTensor((n * k // 4,), "int32")  # the wgmma-major INT8 copy
        if kind == Q.KIND_INT8 and not Q._want_gemv_layout(kind, n, k):  # as _gemv_pack: either copy alone
            if w4 is None:
                return None
            w = type("NoCopy", (), {"ptr": 0})()
        if compact:  # as _gemv_pack(compact=True): the wgmma-major copy and its records alone
            assert w4 is not None
            return Q._GemvLayer(kind, sa.dtype, None, None, 0, 0, max(group // 32, 1), -(-k // group), w4, w4.ptr,
                                None, 0xA000)
        return Q._GemvLayer(kind, None if kind == Q.KIND_INT8 else sa.dtype, w, None, w.ptr, 0x9000,
                            max(group // 32, 1), -(-k // group) if group else 1, w4,
                            w4.ptr if w4 is not None else 0, None,
                            0xA000 if w4 is not None and kind == Q.KIND_INT4 else 0)

    monkeypatch.setattr(Q, "_gemv_pack", gemv_pack)
    return calls, maps


@contextlib.contextmanager
def launched():
    """The kernel names launched inside the block (speedcore.quant.launch wrapped)."""
    names = []
    real = Q.launch

    def spy(kernel, cfg, args, **kw):
        names.append(kernel.name)
        return real(kernel, cfg, args, **kw)

    Q.launch = spy
    try:
        yield names
    finally:
        Q.launch = real


def linear(fmt, x, layer, bias=None):
    f = {Q.FMT_AWQ: Q.awq_linear, Q.FMT_GPTQ: Q.gptq_linear, Q.FMT_INT8: Q.int8_linear}[fmt]
    return f(x, layer, bias=bias)


def pow2_scaled(torch, fmt, layer, k, n, g, td, rng):
    """The INT4 layer's weights again with power-of-two scales (every (q - z) s exact in T), prepacked, and their
    reference dequantization (K, N): one-hot rows of x must then give exact outputs."""
    s = torch.from_numpy((2.0 ** rng.integers(-4, 2, (k // g, n))).astype(np.float16)).cuda().to(td)
    qw, qz = (layer.qweight, layer.qzeros)
    layer = (Q.prepack_awq if fmt == Q.FMT_AWQ else Q.prepack_gptq)(qw, qz, s, group_size=g)
    ref_fn = Q.dequantize_awq_reference if fmt == Q.FMT_AWQ else Q.dequantize_gptq_reference
    args = (qw.cpu().numpy(), qz.cpu().numpy(), s.float().cpu().numpy())
    return layer, ref_fn(*args, group_size=g) if fmt == Q.FMT_AWQ else ref_fn(*args, None, g)


def assert_picks_rows(torch, fmt, layer, w_kn, td, row_slices, kernel=None):
    """x = rows ``row_slices`` of the identity pick those rows of W (``w_kn``, K x N, exact in ``td``): the outputs
    must equal them bit for bit (and, given ``kernel``, come from a launch of it)."""
    k = w_kn.shape[0]
    for rows in row_slices:
        eye = torch.eye(k, device="cuda", dtype=td)[rows]
        with launched() as names:
            y = linear(fmt, eye, layer)
        if kernel is not None:
            assert any(kernel in nm for nm in names), names
        expect = torch.from_numpy(w_kn[rows].astype(np.float32)).to(td).float().numpy()
        assert np.array_equal(y.float().cpu().numpy(), expect), (fmt, td, rows)


def act_order_gptq(torch, td, rng, n=512, k=1024, g=128):
    """An act-order GPTQ checkpoint (quantize_gptq with a random permutation, asymmetric) as CUDA tensors (qweight,
    qzeros, scales in ``td``, g_idx) and its reference dequantization W (K, N)."""
    w = rng.standard_normal((n, k)).astype(np.float32)
    qw, qz, s, g_idx = Q.quantize_gptq(w, g, perm=rng.permutation(k), sym=False)
    s_t = torch.from_numpy((s.astype(np.float32) * 0.05).astype(np.float16)).cuda().to(td)
    ref_w = Q.dequantize_gptq_reference(qw, qz, s_t.float().cpu().numpy(), g_idx, g)
    return (torch.from_numpy(qw).cuda(), torch.from_numpy(qz).cuda(), s_t, torch.from_numpy(g_idx).cuda()), ref_w
