"""Test scaffolding shared by test_quant.py and test_quant_w4wgmma.py: a stand-in CUDA tensor and a fake GPU under
which speedcore.quant's Python launch paths run without one (their launches recorded), and a spy on the real
launches of a GPU test."""
import contextlib

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
    monkeypatch.setattr(Q, "_workspace_ptr", lambda xa, stream, nbytes: 0x5000)
    monkeypatch.setattr(Q, "_ticket_buffer", lambda xa, stream, count: type("T", (), {"ptr": 0x6000})())
    monkeypatch.setattr(Q, "_pack", lambda fmt, qa, k, n: wrap(FakeTensor(Q.packed_shape(fmt, k, n), "int32"), "p"))
    monkeypatch.setattr(Q, "_gemv_scratch", lambda xa, stream, floats, tickets: (0x7000, 0x8000))
    monkeypatch.setattr(_tma, "tile_map_2d", lambda *a, **kw: maps.append((a, kw)) or "tmap")

    def gemv_pack(fmt, qa, za, sa, k, n, group):
        w = FakeTensor((n * k // 8,), "int32")
        kind = Q.KIND_INT8 if fmt == Q.FMT_INT8 else Q.KIND_INT4
        w4 = None
        if w4_copy and kind == Q.KIND_INT4 and Q._W4WGMMA_MODE != "off" and Q.w4wgmma_supported(k, n, group):
            w4 = FakeTensor((n * k // 8,), "int32")
        return Q._GemvLayer(kind, None if kind == Q.KIND_INT8 else sa.dtype, w, None, w.ptr, 0x9000,
                            max(group // 32, 1), -(-k // group) if group else 1, w4,
                            w4.ptr if w4 is not None else 0)

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
