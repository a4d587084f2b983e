"""CUDA arrays from PyTorch and CuPy, described the same way for validation and launch.

Nothing is copied: a kernel gets the caller's device pointer and element strides, runs on the caller's
current stream (``torch.cuda.current_stream()`` for tensors, CuPy's current stream for ``cupy.ndarray``),
and its outputs are allocated by the caller's library, so a torch call returns torch tensors and a CuPy call
CuPy arrays.  Every check raises before anything is launched.
"""
from __future__ import annotations

import os
import sys

import numpy as np

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1, "int16": 2,
            "int32": 4, "int64": 8, "bool": 1}
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
HALF_DTYPES = ("float16", "bfloat16")
# The C++ type each dtype maps to inside kernels/.
CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "int32": "int", "int8": "signed char",
         "uint8": "unsigned char", "int64": "long long"}


class Array:
    """A CUDA array's pointer, shape, strides (in elements), dtype name and device index."""

    __slots__ = ("obj", "lib", "ptr", "shape", "strides", "dtype", "device", "name")

    def __init__(self, obj, lib, ptr, shape, strides, dtype, device, name):
        self.obj, self.lib, self.ptr, self.shape, self.strides = obj, lib, ptr, tuple(shape), tuple(strides)
        self.dtype, self.device, self.name = dtype, device, name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def is_contiguous(self) -> bool:
        expect = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != expect:
                return False
            expect *= size
        return True

    def rows(self) -> tuple:
        """View (..., n) as (rows, n): returns (rows, row_stride).  The last dim must be unit-stride and the
        leading dims must collapse to one stride (any contiguous tensor, a column slice, a row-strided view)."""
        if self.ndim == 0:
            raise ValueError(f"{self.name}: expected at least one dimension, got a scalar")
        n = self.shape[-1]
        if n > 1 and self.strides[-1] != 1:
            raise ValueError(f"{self.name}: the last dimension must be contiguous (stride 1), got strides "
                             f"{self.strides}")
        rows = 1
        for s in self.shape[:-1]:
            rows *= s
        if all(s == 1 for s in self.shape[:-1]):
            return rows, n
        return rows, self.lead_stride(self.ndim - 1, "rows")

    def lead_stride(self, nlead: int, what: str) -> int:
        """The one element stride that steps through the first ``nlead`` dims as a single flat index (0 when
        they are all of size 1); a ValueError naming ``what`` when no single stride describes them."""
        lead = [(sz, st) for sz, st in zip(self.shape[:nlead], self.strides[:nlead]) if sz != 1]
        if not lead:
            return 0
        stride = expect = lead[-1][1]
        for sz, st in reversed(lead):
            if st != expect:
                raise ValueError(f"{self.name}: the leading dimensions of shape {self.shape} with strides "
                                 f"{self.strides} cannot be viewed as {what} of one stride; pass .contiguous()")
            expect = st * sz
        return stride

    def aligned(self, nbytes: int) -> bool:
        return self.ptr % nbytes == 0


def _torch():
    return sys.modules.get("torch")


def _cupy():
    return sys.modules.get("cupy")


_TORCH_DTYPE_NAMES: dict = {}  # torch.dtype -> name ("bfloat16"), filled on first use


def _torch_dtype_name(dt) -> str:
    name = _TORCH_DTYPE_NAMES.get(dt)
    if name is None:
        name = _TORCH_DTYPE_NAMES[dt] = str(dt).replace("torch.", "")
    return name


def wrap(x, name: str, *, optional: bool = False):
    """Describe ``x`` (a CUDA ``torch.Tensor`` or ``cupy.ndarray``); raise a TypeError naming ``name`` otherwise."""
    if x is None:
        if optional:
            return None
        raise TypeError(f"{name}: expected a CUDA torch.Tensor or cupy.ndarray, got None")
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if not x.is_cuda:
            raise TypeError(f"{name}: expected a CUDA tensor, got a tensor on {x.device}")
        return Array(x, "torch", x.data_ptr(), x.shape, x.stride(), _torch_dtype_name(x.dtype), x.get_device(), name)
    cupy = _cupy()
    if cupy is not None and isinstance(x, cupy.ndarray):
        dtype = x.dtype.name
        item = x.dtype.itemsize
        strides = tuple(s // item for s in x.strides)
        return Array(x, "cupy", x.data.ptr, x.shape, strides, dtype, x.device.id, name)
    kind = f"{type(x).__module__}.{type(x).__qualname__}"
    hint = " (host memory)" if type(x).__module__.startswith("numpy") else ""
    raise TypeError(f"{name}: expected a CUDA torch.Tensor or cupy.ndarray, got {kind}{hint}")


# SPEEDCORE_CHECK_INDICES=1: device-side metadata (cu_seqlens, block tables, sequence lengths) is read back and
# validated before each launch that uses it, raising a ValueError naming the argument.  Off by default: it costs a
# device-to-host copy and a synchronization per call (and cannot run inside CUDA-graph capture).  Read at import;
# tests set this attribute.
CHECK_INDICES = os.environ.get("SPEEDCORE_CHECK_INDICES", "").lower() in ("1", "true", "yes")


def to_host(obj) -> np.ndarray:
    """A CUDA array's values as a NumPy array (synchronizes with the caller's stream)."""
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    return obj.get()


# -- the fast path ---------------------------------------------------------------------------------------------
# A public op validates a call signature once and caches its launch plan under the key that `sig` gives each
# argument: everything a check reads except the pointer value (library and dtype through the dtype object,
# shape, strides, device, the pointer's offset from 16-byte alignment).  A cached plan thus stands for checks
# that passed on exactly this layout; checks of pointer values (outputs overlapping inputs) still run each call.
_UNSUPPORTED = object()  # the key part of anything that is neither: never cached, so the full check names it


def _torch_sig(t):
    return (t.dtype, t.shape, t.stride(), t.get_device(), t.data_ptr() & 15)


def _cupy_sig(a):
    return (a.dtype, a.shape, a.strides, a.data.device_id, a.data.ptr & 15)


def _unsupported_sig(x):
    return _UNSUPPORTED


_SIGS: dict = {type(None): lambda x: None}  # exact type -> its key function


def sig(x):
    """The plan-cache key of one argument (None for None)."""
    f = _SIGS.get(type(x))
    if f is None:
        f = _sig_fn(type(x))
    return f(x)


def _sig_fn(t):
    torch, cupy = _torch(), _cupy()
    if torch is not None and issubclass(t, torch.Tensor):
        # a torch tensor subclass that changes what data_ptr/stride mean (a FakeTensor, a wrapper subclass) is
        # not cached: the full path handles it
        f = _torch_sig if t in (torch.Tensor, torch.nn.Parameter) else _unsupported_sig
    elif cupy is not None and issubclass(t, cupy.ndarray):
        f = _cupy_sig
    else:
        return _unsupported_sig
    _SIGS[t] = f
    return f


def cacheable(key: tuple) -> bool:
    """Whether a plan may be stored under ``key`` (no argument of a kind the fast path does not describe)."""
    return not any(k is _UNSUPPORTED for k in key)


class FastLib:
    """The per-call pieces of one library that a cached plan needs: ``ptr(x)``, ``stream(device)`` (raw
    cudaStream_t of the caller's current stream) and ``empty(shape, dtype_name, device)``."""

    __slots__ = ("ptr", "stream", "empty", "zeros", "empty_like", "new_empty")

    def __init__(self, ptr, stream, empty, zeros, empty_like, new_empty):
        self.ptr, self.stream, self.empty, self.zeros = ptr, stream, empty, zeros
        # empty_like(x): contiguous, x's shape and dtype; new_empty(x, shape): x's dtype and device.  Cheaper
        # than empty() (torch: 2-3 us of argument parsing less per call)
        self.empty_like, self.new_empty = empty_like, new_empty


_FAST_LIBS: dict = {}


def fast_lib(lib: str) -> FastLib:
    f = _FAST_LIBS.get(lib)
    if f is None:
        f = _FAST_LIBS[lib] = _torch_fast_lib() if lib == "torch" else _cupy_fast_lib()
    return f


def _torch_fast_lib() -> FastLib:
    import torch

    devices: dict = {}

    def dev(i):
        d = devices.get(i)
        if d is None:
            d = devices[i] = torch.device("cuda", i)
        return d

    t_empty, t_zeros = torch.empty, torch.zeros

    def empty(shape, dtype, device):
        return t_empty(shape, dtype=getattr(torch, dtype), device=dev(device))

    def zeros(shape, dtype, device):
        return t_zeros(shape, dtype=getattr(torch, dtype), device=dev(device))

    contiguous = torch.contiguous_format
    t_empty_like = torch.empty_like

    def empty_like(x):
        return t_empty_like(x, memory_format=contiguous)

    return FastLib(torch.Tensor.data_ptr, _torch_stream_ptr, empty, zeros, empty_like, torch.Tensor.new_empty)


def _cupy_fast_lib() -> FastLib:
    import cupy

    get_device = cupy.cuda.runtime.getDevice
    current_stream = cupy.cuda.get_current_stream

    def ptr(a):
        return a.data.ptr

    def stream(device):
        if get_device() == device:
            return current_stream().ptr
        with cupy.cuda.Device(device):
            return current_stream().ptr

    def alloc(fn, shape, dtype, device):
        dtype = _cupy_dtype(dtype) if type(dtype) is str else dtype
        if get_device() == device:
            return fn(shape, dtype=dtype)
        with cupy.cuda.Device(device):
            return fn(shape, dtype=dtype)

    def empty(shape, dtype, device):
        return alloc(cupy.empty, shape, dtype, device)

    def zeros(shape, dtype, device):
        return alloc(cupy.zeros, shape, dtype, device)

    def empty_like(x):
        return alloc(cupy.empty, x.shape, x.dtype, x.data.device_id)

    def new_empty(x, shape):
        return alloc(cupy.empty, shape, x.dtype, x.data.device_id)

    return FastLib(ptr, stream, empty, zeros, empty_like, new_empty)


def check_dtype(a: Array, allowed, what: str = "") -> None:
    if a.dtype not in allowed:
        raise TypeError(f"{a.name}: dtype {a.dtype} is not supported{what}; expected one of {', '.join(allowed)}")


def check_same_dtype(ref: Array, *others) -> None:
    for o in others:
        if o is not None and o.dtype != ref.dtype:
            raise TypeError(f"{o.name}: dtype {o.dtype} does not match {ref.name}'s {ref.dtype}")


def check_same_device(ref: Array, *others) -> None:
    for o in others:
        if o is None:
            continue
        if o.lib != ref.lib:
            raise TypeError(f"{o.name}: is a {'torch.Tensor' if o.lib == 'torch' else 'cupy.ndarray'} but "
                            f"{ref.name} is a {'torch.Tensor' if ref.lib == 'torch' else 'cupy.ndarray'}; "
                            f"pass arrays of one library")
        if o.device != ref.device:
            raise ValueError(f"{o.name}: is on cuda:{o.device} but {ref.name} is on cuda:{ref.device}")


def check_shape(a: Array, shape: tuple) -> None:
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{a.name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")


def check_no_overlap(out: Array, *inputs) -> None:
    """Outputs that partially overlap an input would be read after being written."""
    lo = out.ptr
    hi = out.ptr + extent(out)
    for i in inputs:
        if i is None:
            continue
        ilo, ihi = i.ptr, i.ptr + extent(i)
        if ilo < hi and lo < ihi and not (ilo == lo and i.strides == out.strides and i.shape == out.shape):
            raise ValueError(f"{out.name}: overlaps {i.name} in memory")


def extent(a: Array) -> int:
    """Bytes from ``a``'s pointer to one past its last element (0 when empty)."""
    if a.numel == 0:
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(a.shape, a.strides))) * a.itemsize


def empty(ref: Array, shape, dtype: str, name: str = "out", *, zeroed: bool = False) -> Array:
    """A new array of ``ref``'s library on ``ref``'s device (filled with zeros when ``zeroed``)."""
    if ref.lib == "torch":
        torch = _torch()
        alloc = torch.zeros if zeroed else torch.empty
        return wrap(alloc(tuple(shape), dtype=getattr(torch, dtype), device=torch.device("cuda", ref.device)), name)
    cupy = _cupy()
    alloc = cupy.zeros if zeroed else cupy.empty
    with cupy.cuda.Device(ref.device):
        c = alloc(tuple(shape), dtype=_cupy_dtype(dtype))
    return wrap(c, name)


_stream_buffers: dict = {}
_retired_buffers: list = []  # outgrown scratch buffers (grow-only, powers of two: at most the live size again)
_retired_keys: list = []     # the stream key each retired buffer belonged to (release_stream_buffers)


def stream_buffer(kind: str, ref: Array, stream, n: int, dtype: str, *, min_n: int = 4096,
                  zeroed: bool = False) -> Array:
    """A grow-only scratch buffer of at least ``n`` elements, one per (kind, library, device, stream): launches on
    one stream run in order, so they can share it.  ``zeroed`` buffers start as zeros; kernels that use them as
    counters leave them zero when they end."""
    key = (kind, ref.lib, ref.device, stream if type(stream) is int else getattr(stream, "ptr", 0))
    buf = _stream_buffers.get(key)
    if buf is None or buf.numel < n:
        if buf is not None:
            # A CUDA graph captured with the old buffer still reads and writes it on replay: keep it allocated.
            _retired_buffers.append(buf)
            _retired_keys.append(key)
        shape = (max(min_n, 1 << max(0, n - 1).bit_length()),)
        if _torch_capturing() if ref.lib == "torch" else _cupy_capturing():
            buf = empty(ref, shape, dtype, kind, zeroed=zeroed)  # only the capturing library's allocator may run
        else:
            # Scratch outlives the call, so it comes from CuPy's default pool: not torch's allocator (torch.compile's
            # CUDA graphs allocate into a private pool and refuse to replay while a tensor of theirs that no graph
            # output holds is still alive), nor an allocator the caller set for its temporaries (the engine's decode
            # graphs share one pool, whose blocks each graph's activations reuse: a replay wrote floats over split-K
            # tickets grown there).
            cupy = _cupy()
            with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
                buf = empty(scratch_ref("cupy", ref.device), shape, dtype, kind, zeroed=zeroed)
            if zeroed and ref.lib == "torch":  # zeroing ran on CuPy's stream: wait for it
                _sync_device(ref.device)
        _stream_buffers[key] = buf
    return buf


def _torch_capturing() -> bool:
    return bool(_torch().cuda.is_current_stream_capturing())


def _cupy_capturing() -> bool:
    return _cupy().cuda.get_current_stream().is_capturing()


def _sync_device(device: int) -> None:
    _cupy().cuda.Device(device).synchronize()


def release_stream_buffers(stream) -> int:
    """Free every scratch buffer kept for ``stream`` (a stream object or raw pointer), outgrown ones included;
    returns how many.  Only once no launch on that stream is pending and no CUDA graph that used them will be
    replayed again (an engine's ``close()``)."""
    ptr = stream if type(stream) is int else getattr(stream, "ptr", 0)
    n = 0
    for key in [k for k in _stream_buffers if k[3] == ptr]:
        del _stream_buffers[key]
        n += 1
    keep = [(b, k) for b, k in zip(_retired_buffers, _retired_keys) if k[3] != ptr]
    n += len(_retired_buffers) - len(keep)
    _retired_buffers[:] = [b for b, _ in keep]
    _retired_keys[:] = [k for _, k in keep]
    return n


def scratch_ref(lib: str, device: int) -> Array:
    """A stand-in for an operand in :func:`stream_buffer` / :func:`split_k_scratch` calls from a cached plan
    (which must hold no reference to the caller's arrays)."""
    return Array(None, lib, 0, (), (), "uint8", device, "scratch")


def split_k_scratch(ref: Array, stream, partial_bytes: int, tickets: int) -> tuple:
    """(partials pointer, tickets pointer) of a split-K launch on ``stream``: fp32 partial sums (bytes, at least
    1 MiB) and zeroed int32 per-tile counters.  Shared by every split-K kernel (GEMM, quantized linears): launches
    on one stream run in order, and each kernel leaves the counters zero again."""
    return (stream_buffer("workspace", ref, stream, partial_bytes, "uint8", min_n=1 << 20).ptr,
            stream_buffer("tickets", ref, stream, tickets, "int32", zeroed=True).ptr)


def _cupy_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return dtype


_ext_streams: dict = {}


def _torch_stream_ptr(device: int) -> int:
    global _raw_stream
    if _raw_stream is None:
        torch = _torch()
        # what Triton uses: no Stream object per call
        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _raw_stream(device)


_raw_stream = None


def stream_of(ref: Array):
    """The stream to launch on: torch's current stream for tensors, CuPy's current stream for CuPy arrays."""
    if ref.lib == "torch":
        ptr = _torch_stream_ptr(ref.device)
        s = _ext_streams.get((ptr, ref.device))
        if s is None:
            import warnings

            import cupy

            with warnings.catch_warnings():  # CuPy 14 prefers Stream.from_external, which older CuPy lacks
                warnings.simplefilter("ignore", DeprecationWarning)
                s = cupy.cuda.ExternalStream(ptr, ref.device)
            _ext_streams[(ptr, ref.device)] = s
        return s
    import cupy

    with cupy.cuda.Device(ref.device):
        return cupy.cuda.get_current_stream()
