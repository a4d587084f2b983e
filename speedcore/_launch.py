"""Device properties, launch configurations, and launching a compiled variant on a stream."""
from __future__ import annotations

import ctypes
import os
import struct
import threading
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ._compile import Kernel, compile_kernel

# cudaDeviceAttr values (stable across CUDA versions).
_ATTR_MAX_THREADS_PER_BLOCK = 1
_ATTR_MAX_SMEM_PER_BLOCK = 8
_ATTR_SM_COUNT = 16
_ATTR_L2_BYTES = 38
_ATTR_CC_MAJOR = 75
_ATTR_CC_MINOR = 76
_ATTR_MAX_SMEM_PER_SM = 81
_ATTR_MAX_SMEM_PER_BLOCK_OPTIN = 97

DEFAULT_DYNAMIC_SMEM = 48 * 1024


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    cc: tuple
    sms: int
    max_threads_per_block: int
    smem_per_block: int
    smem_per_block_optin: int
    smem_per_sm: int
    l2_bytes: int

    @property
    def arch(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"

    def arch_for(self, kernel: Kernel) -> str:
        if kernel.hopper:
            if self.cc != (9, 0):
                raise RuntimeError(f"{kernel.name} needs an sm_90 GPU (H100/H200); {self.name} is {self.arch}")
            return "sm_90a"
        return self.arch


@lru_cache(maxsize=None)
def device_info(index: int) -> DeviceInfo:
    from cupy.cuda import runtime

    def attr(a):
        return runtime.deviceGetAttribute(a, index)

    props = runtime.getDeviceProperties(index)
    name = props.get("name", b"")
    name = name.decode() if isinstance(name, bytes) else str(name)
    return DeviceInfo(
        index=index,
        name=name,
        cc=(attr(_ATTR_CC_MAJOR), attr(_ATTR_CC_MINOR)),
        sms=attr(_ATTR_SM_COUNT),
        max_threads_per_block=attr(_ATTR_MAX_THREADS_PER_BLOCK),
        smem_per_block=attr(_ATTR_MAX_SMEM_PER_BLOCK),
        smem_per_block_optin=attr(_ATTR_MAX_SMEM_PER_BLOCK_OPTIN),
        smem_per_sm=attr(_ATTR_MAX_SMEM_PER_SM),
        l2_bytes=attr(_ATTR_L2_BYTES),
    )


@dataclass(frozen=True)
class LaunchConfig:
    grid: tuple
    block: tuple
    smem: int = 0  # dynamic shared memory, bytes
    cluster: int = 1  # CTAs per thread-block cluster along x (compute capability 9.0; at most 8)
    # Programmatic dependent launch (compute capability 9.0): the kernel may start before the stream's previous one
    # has finished, once every CTA of that one has run griddepcontrol.launch_dependents (or exited).  Only for a
    # kernel that reads nothing the previous one writes, or that waits for it (griddepcontrol.wait) first.
    overlap: bool = False

    def __post_init__(self):
        object.__setattr__(self, "grid", tuple(int(g) for g in (self.grid if isinstance(self.grid, tuple) else (self.grid,))))
        object.__setattr__(self, "block", tuple(int(b) for b in (self.block if isinstance(self.block, tuple) else (self.block,))))

    @property
    def threads(self) -> int:
        n = 1
        for b in self.block:
            n *= b
        return n


class LoadedKernel:
    """A variant loaded into one device's context, with the dynamic shared memory limit it was given."""

    __slots__ = ("kernel", "device", "module", "func", "compiled", "dyn_smem_limit", "num_regs", "static_smem",
                 "max_threads", "bound")

    def __init__(self, kernel: Kernel, device: DeviceInfo):
        from cupy.cuda import driver
        from cupy.cuda import function

        self.kernel = kernel
        self.device = device
        self.compiled = compile_kernel(kernel, device.arch_for(kernel))
        self.module = function.Module()
        self.module.load(self.compiled.cubin)
        self.func = self.module.get_function(self.compiled.lowered_name)
        self.num_regs = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_NUM_REGS, self.func.ptr)
        self.static_smem = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, self.func.ptr)
        self.max_threads = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, self.func.ptr)
        self.dyn_smem_limit = DEFAULT_DYNAMIC_SMEM
        self.bound: dict = {}  # LaunchConfig -> BoundLaunch: configurations that passed check()

    def check(self, cfg: LaunchConfig) -> None:
        """Raise instead of launching a configuration the device cannot run."""
        name = self.kernel.name
        if cfg.threads > self.max_threads:
            raise ValueError(f"{name}: {cfg.threads} threads per block; this variant allows {self.max_threads} "
                             f"({self.num_regs} registers per thread)")
        total = cfg.smem + self.static_smem
        if total > self.device.smem_per_block_optin:
            raise ValueError(f"{name}: needs {total} bytes of shared memory per block ({cfg.smem} dynamic + "
                             f"{self.static_smem} static); {self.device.name} allows "
                             f"{self.device.smem_per_block_optin}")
        if any(g < 1 for g in cfg.grid) or cfg.grid[0] >= 2**31 or any(g >= 2**16 for g in cfg.grid[1:]):
            raise ValueError(f"{name}: grid {cfg.grid} is out of range")
        if cfg.cluster != 1:
            if not 1 <= cfg.cluster <= MAX_CLUSTER or cfg.grid[0] % cfg.cluster:
                raise ValueError(f"{name}: clusters of {cfg.cluster} CTAs need 1 to {MAX_CLUSTER} CTAs dividing the "
                                 f"grid's x dimension {cfg.grid[0]}")
            if self.device.cc < (9, 0):
                raise ValueError(f"{name}: thread-block clusters need compute capability 9.0, {self.device.name} is "
                                 f"{self.device.arch}")
        if cfg.overlap and self.device.cc < (9, 0):
            raise ValueError(f"{name}: programmatic dependent launch needs compute capability 9.0, "
                             f"{self.device.name} is {self.device.arch}")

    def allow_smem(self, smem: int) -> None:
        """Raise the variant's dynamic shared memory limit to ``smem`` bytes (before a launch or a query)."""
        if smem > self.dyn_smem_limit:
            from cupy.cuda import driver

            driver.funcSetAttribute(self.func.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
            self.dyn_smem_limit = smem

    def max_cluster_ctas(self, cfg: LaunchConfig) -> int:
        """How many CTAs of ``cfg``'s block, shared memory and cluster size can be resident at once: clusters
        are placed inside one GPC, so with one CTA per SM the SMs a GPC has beyond a multiple of the cluster
        size stay idle (e.g. 120 of the H200's 132 SMs for clusters of 4 at ~200 KB per CTA)."""
        self.allow_smem(cfg.smem)
        c, _ = _config_ex(LaunchConfig((cfg.cluster,), cfg.block, cfg.smem, cfg.cluster), None)
        n = ctypes.c_int(0)
        err = _driver().cuOccupancyMaxActiveClusters(ctypes.byref(n), ctypes.c_void_p(self.func.ptr), ctypes.byref(c))
        if err:
            raise RuntimeError(f"cuOccupancyMaxActiveClusters failed with CUresult {err} ({self.kernel.name})")
        return n.value * cfg.cluster

    def bind(self, cfg: LaunchConfig) -> "BoundLaunch":
        """This variant at ``cfg``, checked (and its shared memory limit raised) once."""
        bl = self.bound.get(cfg)
        if bl is None:
            self.check(cfg)
            self.allow_smem(cfg.smem)
            bl = self.bound[cfg] = BoundLaunch(self, cfg)
        return bl

    def __call__(self, cfg: LaunchConfig, args: tuple, stream) -> None:
        self.bind(cfg)(getattr(stream, "ptr", stream), args)


MAX_CLUSTER = 8  # the portable cluster size
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4  # CUlaunchAttributeID, cuda.h
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfigEx(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


@lru_cache(maxsize=None)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfigEx), ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p]
    lib.cuOccupancyMaxActiveClusters.restype = ctypes.c_int
    lib.cuOccupancyMaxActiveClusters.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                 ctypes.POINTER(_LaunchConfigEx)]
    return lib


@lru_cache(maxsize=256)
def _config_ex(cfg: LaunchConfig, stream_ptr) -> tuple:
    """A CUlaunchConfig for ``cfg`` on a stream, with its cluster dimension and (cfg.overlap) programmatic stream
    serialization (and the attributes it points to, kept alive); cached, since a launch site repeats one
    configuration."""
    attrs = (_LaunchAttribute * 2)()
    attrs[0].id = _CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attrs[0].value[0], attrs[0].value[1], attrs[0].value[2] = cfg.cluster, 1, 1
    attrs[1].id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attrs[1].value[0] = 1
    grid = tuple(cfg.grid) + (1,) * (3 - len(cfg.grid))
    block = tuple(cfg.block) + (1,) * (3 - len(cfg.block))
    c = _LaunchConfigEx((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), cfg.smem,
                        ctypes.c_void_p(stream_ptr or None), attrs, 2 if cfg.overlap else 1)
    return c, attrs


def _launch_ex(func_ptr: int, cfg: LaunchConfig, stream_ptr: int, params_addr: int, config=None) -> None:
    """cuLaunchKernelEx with a cluster dimension and (cfg.overlap) programmatic stream serialization (CuPy launches
    have no launch attributes), the arguments packed as for any launch (:class:`ArgLayout`); ``config``: this
    (cfg, stream)'s ``_config_ex`` where the caller keeps it."""
    c = (config or _config_ex(cfg, stream_ptr))[0]
    err = _driver().cuLaunchKernelEx(ctypes.byref(c), ctypes.c_void_p(func_ptr), ctypes.c_void_p(params_addr), None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {err} (grid {cfg.grid}, cluster {cfg.cluster})")


# -- packing kernel arguments -------------------------------------------------------------------------------
# A launch gives the driver an array of pointers, one per kernel parameter, from which it copies each
# parameter's bytes.  CuPy builds one Python object per argument per launch (~0.5-1 us each, 10-30 arguments per
# kernel here); instead each distinct tuple of argument types gets one struct layout, every argument at an
# 8-byte aligned offset of a per-thread buffer whose pointer array is built once, so a launch is one
# ``Struct.pack_into`` and one driver call.
_FORMATS = {int: ("q", 8), np.int32: ("i", 4), np.int64: ("q", 8), np.uint32: ("I", 4), np.uint64: ("Q", 8),
            np.float32: ("f", 4), bytes: ("128s", 128), np.ndarray: ("128s", 128)}


def _arg_types(args: tuple) -> tuple:
    return tuple(map(type, args))


class ArgLayout:
    """How one tuple of argument types is packed.  Python ints go as 8 bytes (as CuPy passes them: pointers and
    int64 parameters), NumPy scalars at their own size, 128-byte TMA maps (a NumPy array or bytes) by value.
    Python floats and bools are refused (their size would be a guess): pass numpy.float32 / numpy.int32.  A fast
    path that reuses a layout (:meth:`BoundLaunch.fixed`) may pass plain ints and floats where the layout has
    NumPy scalars: ``pack_into`` stores them at the layout's size."""

    __slots__ = ("struct", "offsets", "size", "maps", "buffers")

    def __init__(self, types: tuple):
        fmt, offsets, at = ["<"], [], 0
        for t in types:
            code, size = _FORMATS[t]
            align = 64 if size > 8 else 8
            pad = -at % align
            if pad:
                fmt.append(f"{pad}x")
                at += pad
            offsets.append(at)
            fmt.append(code)
            at += size
            if size % 8:
                fmt.append(f"{8 - size % 8}x")
                at += 8 - size % 8
        self.struct = struct.Struct("".join(fmt))
        self.offsets = tuple(offsets)
        self.size = max(at, 8)
        self.maps = tuple(i for i, t in enumerate(types) if t is np.ndarray)  # passed as their bytes
        self.buffers: dict = {}  # thread id -> (buffer, pointer array): launches from two threads never share one

    def new_buffer(self) -> tuple:
        """(buffer, offset of the 64-byte aligned layout in it, kernelParams address, the pointer array): one
        thread's argument storage, each pointer aimed at its argument's offset."""
        buf = ctypes.create_string_buffer(self.size + 64)
        off = (-ctypes.addressof(buf)) % 64
        base = ctypes.addressof(buf) + off
        params = (ctypes.c_void_p * max(1, len(self.offsets)))(*[base + o for o in self.offsets])
        return buf, off, ctypes.addressof(params), params

    def _buffers(self) -> tuple:
        tid = threading.get_ident()
        b = self.buffers.get(tid)
        if b is None:
            b = self.buffers[tid] = self.new_buffer()
        return b

    def pack(self, args: tuple) -> int:
        """Write ``args`` into this thread's buffer; returns the address of its kernelParams array (valid until
        this thread's next launch with this layout: the driver copies the values at the launch)."""
        if self.maps:
            args = list(args)
            for i in self.maps:
                args[i] = args[i].tobytes()
        buf, off, params_addr, _ = self._buffers()
        self.struct.pack_into(buf, off, *args)
        return params_addr


_layouts: dict = {}


def arg_layout(types: tuple) -> ArgLayout:
    lay = _layouts.get(types)
    if lay is None:
        for t in types:
            if t not in _FORMATS:
                raise TypeError(f"kernel arguments: cannot pass {t.__name__} (pointers as int, flags as numpy.int32)")
        lay = _layouts[types] = ArgLayout(types)
    return lay


_launch_kernel = None  # cupy.cuda.driver.launchKernel: a thin binding of cuLaunchKernel
_get_device = None


def _bind_driver() -> None:
    global _launch_kernel, _get_device
    from cupy.cuda import driver, runtime

    _launch_kernel, _get_device = driver.launchKernel, runtime.getDevice


class BoundLaunch:
    """A loaded variant at one checked launch configuration.  ``bl(stream_ptr, args)`` launches it on the stream
    (a raw ``cudaStream_t``) with the current device switched to the variant's for the call if it differs."""

    __slots__ = ("func_ptr", "cfg", "dims", "device", "ex", "_ex_configs")

    def __init__(self, lk: LoadedKernel, cfg: LaunchConfig):
        if _launch_kernel is None:
            _bind_driver()
        self.func_ptr = lk.func.ptr
        self.cfg = cfg
        grid = tuple(cfg.grid) + (1,) * (3 - len(cfg.grid))
        block = tuple(cfg.block) + (1,) * (3 - len(cfg.block))
        self.dims = grid + block + (cfg.smem,)
        self.device = lk.device.index
        self.ex = cfg.cluster != 1 or cfg.overlap
        self._ex_configs: dict = {}  # stream pointer -> (CUlaunchConfig, its attributes): built once per stream

    def __call__(self, stream_ptr: int, args: tuple) -> None:
        self.launch_packed(stream_ptr, arg_layout(tuple(map(type, args))).pack(args))

    def fixed(self, types: tuple) -> "FixedLaunch":
        """This launch for arguments of exactly ``types`` every call (a fast path's own argument tuple)."""
        return FixedLaunch(self, arg_layout(tuple(types)))

    def prepacked(self, variable_types: tuple, constants: tuple) -> "PrepackedLaunch":
        """This launch with ``constants`` as its trailing arguments on every call (see :class:`PrepackedLaunch`)."""
        return PrepackedLaunch(self, variable_types, constants)

    def launch_packed(self, stream_ptr: int, params_addr: int) -> None:
        dev = _get_device()
        if dev != self.device:
            from cupy.cuda import runtime

            runtime.setDevice(self.device)
            try:
                self._launch(stream_ptr, params_addr)
            finally:
                runtime.setDevice(dev)
        else:
            self._launch(stream_ptr, params_addr)

    def _launch(self, stream_ptr: int, params_addr: int) -> None:
        if self.ex:
            c = self._ex_configs.get(stream_ptr)
            if c is None:
                c = self._ex_configs[stream_ptr] = _config_ex(self.cfg, stream_ptr)
            _launch_ex(self.func_ptr, self.cfg, stream_ptr, params_addr, c)
        else:
            gx, gy, gz, bx, by, bz, smem = self.dims
            _launch_kernel(self.func_ptr, gx, gy, gz, bx, by, bz, smem, stream_ptr, params_addr, 0)


class FixedLaunch:
    """A :class:`BoundLaunch` with its argument layout resolved once: ``fl(stream_ptr, args)``."""

    __slots__ = ("bound", "pack")

    def __init__(self, bound: BoundLaunch, layout: ArgLayout):
        self.bound, self.pack = bound, layout.pack

    def __call__(self, stream_ptr: int, args: tuple) -> None:
        self.bound.launch_packed(stream_ptr, self.pack(args))


class PrepackedLaunch:
    """A :class:`BoundLaunch` whose trailing arguments are fixed: they are packed once into this launch's own
    per-thread buffer, and a call packs only the leading ones (the pointers): ``pl(stream_ptr, *pointers)``."""

    __slots__ = ("bound", "layout", "prefix", "constants", "buffers")

    def __init__(self, bound: BoundLaunch, variable_types: tuple, constants: tuple):
        self.bound = bound
        self.layout = ArgLayout(tuple(variable_types) + tuple(map(type, constants)))
        self.prefix = ArgLayout(tuple(variable_types)).struct.pack_into  # same offsets: laid out in order
        self.constants = constants
        self.buffers: dict = {}

    def _buffers(self) -> tuple:
        lay = self.layout
        b = self.buffers[threading.get_ident()] = lay.new_buffer()
        nvar = len(lay.offsets) - len(self.constants)
        lay.struct.pack_into(b[0], b[1], *((0,) * nvar + tuple(c.tobytes() if type(c) is np.ndarray else c
                                                               for c in self.constants)))
        return b

    def __call__(self, stream_ptr: int, *pointers) -> None:
        b = self.buffers.get(threading.get_ident()) or self._buffers()
        self.prefix(b[0], b[1], *pointers)
        self.bound.launch_packed(stream_ptr, b[2])


# Programmatic dependent launches of the decode chain (norms, decode-sized GEMMs, rotary, cache writes, paged
# decode, gated activations): off by default, since cuLaunchKernelEx costs a little more host time per call than a
# plain launch; an engine that replays CUDA graphs turns it on (speedcore.engine.runner).  Kernels that can be
# chained wait for their predecessor in-kernel whether or not the launch was chained, so the setting never
# changes a result, only when a kernel may start.
_chain_launches = [os.environ.get("SPEEDCORE_CHAIN_LAUNCHES", "0") == "1"]


_plan_caches: list = []


def plan_cache() -> dict:
    """A dict of cached launch plans (call signature -> launch) of an op module: emptied whenever chaining is
    switched, since a plan holds its launch configuration."""
    d: dict = {}
    _plan_caches.append(d)
    return d


def set_chained_launches(enabled: bool) -> bool:
    """Launch the chainable kernels as programmatic dependents of the stream's previous kernel (compute capability
    9.0): each may be scheduled while that one still runs and waits for it in-kernel, so no launch gap separates
    a decode step's ~400 kernels (engine, Llama-3-8B batch 1 on an H200: 4.55 ms per token against 4.85).  Takes
    effect at once (the op modules' cached plans are dropped when the setting changes); returns the previous
    setting.  While it is on, some inputs are read before the wait, as constants of the chain: the weights of
    ``linear``, of the quantized linears and of ``rms_norm``, the positions, cos/sin cache and slot mapping of
    ``rotary_embedding`` / ``rotary_embedding_and_cache``, and the block table and sequence lengths of
    ``paged_decode_attention``.  Such an input must not be written by the kernel
    launched just before its use on the same stream (load, then synchronize or launch anything else, as the engine
    does)."""
    prev = _chain_launches[0]
    _chain_launches[0] = bool(enabled)
    if prev != _chain_launches[0]:
        for d in _plan_caches:
            d.clear()
    return prev


def chained(cfg: LaunchConfig, device: int) -> LaunchConfig:
    """``cfg`` as a programmatic dependent launch where chaining is on and the device supports it."""
    if not _chain_launches[0] or cfg.overlap or device_info(device).cc < (9, 0):
        return cfg
    return LaunchConfig(cfg.grid, cfg.block, cfg.smem, cfg.cluster, overlap=True)


def bind(kernel: Kernel, cfg: LaunchConfig, device: int) -> BoundLaunch:
    """The checked launch of ``kernel`` at ``cfg`` on ``device`` (compiling or loading the variant on first use):
    what a cached launch plan holds."""
    return get_kernel(kernel, device).bind(cfg)


_loaded: dict = {}
_load_lock = threading.Lock()


def get_kernel(kernel: Kernel, device_index: int) -> LoadedKernel:
    """The loaded variant for a device, compiling it (or reading it from the disk cache) on first use."""
    key = (kernel, device_index)
    lk = _loaded.get(key)
    if lk is None:
        with _load_lock:
            lk = _loaded.get(key)
            if lk is None:
                lk = LoadedKernel(kernel, device_info(device_index))
                _loaded[key] = lk
    return lk


def launch(kernel: Kernel, cfg: LaunchConfig, args: tuple, *, device: int, stream) -> None:
    """Launch ``kernel`` with ``cfg`` on ``stream`` (a CuPy stream object or a raw stream pointer) of ``device``.

    ``args`` are passed as CuPy does: pointers as Python ints (8 bytes), numpy scalars at their own size.
    """
    lk = _loaded.get((kernel, device))
    if lk is None:
        lk = get_kernel(kernel, device)
    bl = lk.bound.get(cfg)
    if bl is None:
        bl = lk.bind(cfg)
    bl(getattr(stream, "ptr", stream), args)
