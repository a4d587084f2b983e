"""Array description and validation logic (no GPU needed: Array objects are built by hand)."""
import numpy as np
import pytest

from speedcore import _arrays as A


def arr(shape, strides, dtype="float16", name="x", ptr=4096, lib="torch", device=0):
    return A.Array(None, lib, ptr, shape, strides, dtype, device, name)


def test_rows_of_contiguous_and_views():
    assert arr((4, 5, 8), (40, 8, 1)).rows() == (20, 8)
    assert arr((4, 8), (24, 1)).rows() == (4, 24)           # column slice of a wider matrix
    assert arr((2, 3, 8), (72, 24, 1)).rows() == (6, 24)    # collapsible leading dims
    assert arr((1, 3, 8), (999, 24, 1)).rows() == (3, 24)   # size-1 dims don't matter
    assert arr((8,), (1,)).rows() == (1, 8)


def test_rows_rejects_what_no_single_stride_describes():
    with pytest.raises(ValueError, match="x: the last dimension must be contiguous"):
        arr((4, 8), (1, 4)).rows()
    with pytest.raises(ValueError, match="cannot be viewed as rows of one stride"):
        arr((2, 3, 8), (8, 16, 1)).rows()  # a transposed batch
    with pytest.raises(ValueError, match="scalar"):
        arr((), ()).rows()


def test_contiguity_and_alignment():
    assert arr((4, 8), (8, 1)).is_contiguous()
    assert not arr((4, 8), (16, 1)).is_contiguous()
    assert arr((4, 8), (8, 1), ptr=4096 + 16).aligned(16)
    assert not arr((4, 8), (8, 1), ptr=4096 + 2).aligned(16)


def test_dtype_device_and_shape_checks():
    x = arr((4, 8), (8, 1))
    with pytest.raises(TypeError, match="x: dtype int32 is not supported"):
        A.check_dtype(arr((4, 8), (8, 1), dtype="int32"), A.FLOAT_DTYPES)
    with pytest.raises(TypeError, match="w: dtype bfloat16 does not match x's float16"):
        A.check_same_dtype(x, arr((8,), (1,), dtype="bfloat16", name="w"))
    with pytest.raises(ValueError, match="w: is on cuda:1 but x is on cuda:0"):
        A.check_same_device(x, arr((8,), (1,), name="w", device=1))
    with pytest.raises(TypeError, match="w: is a cupy.ndarray but x is a torch.Tensor"):
        A.check_same_device(x, arr((8,), (1,), name="w", lib="cupy"))
    with pytest.raises(ValueError, match=r"w: expected shape \(8,\), got \(7,\)"):
        A.check_shape(arr((7,), (1,), name="w"), (8,))
    A.check_same_device(x, None, arr((8,), (1,), name="w"))


def test_overlap_detection():
    out = arr((4, 8), (8, 1), name="out", ptr=1000)
    with pytest.raises(ValueError, match="out: overlaps w"):
        A.check_no_overlap(out, arr((8,), (1,), name="w", ptr=1000 + 16))
    A.check_no_overlap(out, arr((8,), (1,), name="w", ptr=1000 + 64))   # just past the end
    A.check_no_overlap(out, arr((4, 8), (8, 1), name="x", ptr=1000))     # exactly in place is fine


def test_wrap_rejects_host_and_foreign_objects():
    with pytest.raises(TypeError, match="x: expected a CUDA torch.Tensor or cupy.ndarray, got numpy.ndarray"):
        A.wrap(np.zeros(3), "x")
    with pytest.raises(TypeError, match="w: expected a CUDA torch.Tensor or cupy.ndarray, got builtins.list"):
        A.wrap([1, 2], "w")
    with pytest.raises(TypeError, match="got None"):
        A.wrap(None, "x")
    assert A.wrap(None, "r", optional=True) is None


def test_cpu_torch_tensor_is_rejected():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="x: expected a CUDA tensor, got a tensor on cpu"):
        A.wrap(torch.zeros(3), "x")


def test_stream_buffer_grows_and_keeps_outgrown_buffers(monkeypatch):
    """Scratch is shared per (kind, stream), grows to powers of two, and an outgrown buffer stays allocated (a CUDA
    graph captured with it still uses it on replay)."""
    from types import SimpleNamespace

    made = []

    import cupy

    def fake_empty(ref, shape, dtype, name, zeroed=False):
        made.append(SimpleNamespace(numel=shape[0], zeroed=zeroed, lib=ref.lib, allocator=cupy.cuda.get_allocator()))
        return made[-1]

    capturing, synced = [False], []
    monkeypatch.setattr(A, "empty", fake_empty)
    monkeypatch.setattr(A, "_torch_capturing", lambda: capturing[0])
    monkeypatch.setattr(A, "_cupy_capturing", lambda: capturing[0])
    monkeypatch.setattr(A, "_sync_device", synced.append)
    monkeypatch.setattr(A, "_stream_buffers", {})
    monkeypatch.setattr(A, "_retired_buffers", [])
    ref = SimpleNamespace(lib="torch", device=0)
    s1, s2 = SimpleNamespace(ptr=1), SimpleNamespace(ptr=2)
    a = A.stream_buffer("ws", ref, s1, 100, "float32", min_n=16, zeroed=True)
    assert a.numel == 128 and a.zeroed and A.stream_buffer("ws", ref, s1, 128, "float32") is a
    assert A.stream_buffer("ws", ref, s2, 10, "float32", min_n=16) is not a        # another stream, its own
    b = A.stream_buffer("ws", ref, s1, 129, "float32", min_n=16)
    assert b.numel == 256 and A._retired_buffers == [a]
    assert A.stream_buffer("ws", ref, s1, 64, "float32") is b                      # never shrinks
    # torch's scratch comes from CuPy's pool (outside torch.compile's graph pools), zeroed before first use;
    # inside a capture, from torch (the only allocator that may run there)
    assert [m.lib for m in made] == ["cupy"] * 3 and synced == [0]
    capturing[0] = True
    assert A.stream_buffer("ws", ref, s1, 1000, "float32").lib == "torch"
    A._retired_buffers.pop()
    monkeypatch.setattr(A, "_retired_keys", [("ws", "torch", 0, 1)])
    assert A.release_stream_buffers(s1) == 2 and not A._retired_buffers               # live + outgrown
    assert list(A._stream_buffers) == [("ws", "torch", 0, 2)]                          # the other stream's stays
    # a CuPy caller's own allocator (the engine's decode graphs share a pool whose blocks their activations reuse)
    # never holds scratch: it comes from the default pool; inside a capture, from the current allocator
    capturing[0] = False
    cref, graph_pool = SimpleNamespace(lib="cupy", device=0), cupy.cuda.MemoryPool()
    with cupy.cuda.using_allocator(graph_pool.malloc):
        c = A.stream_buffer("tickets", cref, s1, 10, "int32", min_n=16, zeroed=True)
        capturing[0] = True
        d = A.stream_buffer("tickets", cref, s1, 100, "int32", min_n=16)
    assert c.allocator == cupy.get_default_memory_pool().malloc and c.lib == "cupy" and synced == [0]
    assert d.allocator == graph_pool.malloc
