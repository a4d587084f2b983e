"""Device properties, launch configurations, and launching a compiled variant on a stream."""
from __future__ import annotations

import ctypes
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
                 "max_threads", "checked")

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
        self.checked: set = set()  # configurations that passed check(): launches repeat a few shapes

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

    def __call__(self, cfg: LaunchConfig, args: tuple, stream) -> None:
        if cfg not in self.checked:
            self.check(cfg)
            self.checked.add(cfg)
        self.allow_smem(cfg.smem)
        if cfg.cluster == 1 and not cfg.overlap:
            self.func(cfg.grid, cfg.block, args, cfg.smem, stream)
        else:
            _launch_cluster(self.func.ptr, cfg, args, stream)


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


_U64 = struct.Struct("<Q")
_PACK = {np.int32: struct.Struct("<i"), np.int64: struct.Struct("<q"), np.uint32: struct.Struct("<I"),
         np.uint64: struct.Struct("<Q"), np.float32: struct.Struct("<f")}


def _param_bytes(a) -> bytes:
    """A kernel argument's bytes as CuPy passes them: Python ints as 8 bytes, NumPy scalars and (by value) small
    NumPy arrays, such as a TMA tensor map, at their own size.  (By exact type: this runs per argument per launch.)"""
    t = type(a)
    if t is int:
        return _U64.pack(a & 0xFFFFFFFFFFFFFFFF)
    f = _PACK.get(t)
    if f is not None:
        return f.pack(a)
    if t is np.ndarray or (isinstance(a, np.generic) and t is not np.bool_):
        return a.tobytes()
    raise TypeError(f"kernel arguments: cannot pass {t.__name__} to a cluster launch (flags as numpy.int32)")


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


def _launch_cluster(func_ptr: int, cfg: LaunchConfig, args: tuple, stream) -> None:
    """cuLaunchKernelEx with a cluster dimension and (cfg.overlap) programmatic stream serialization (CuPy launches
    have no launch attributes).  The arguments go in one buffer, each at an 8-byte aligned offset (the driver copies
    each from its pointer)."""
    parts = [_param_bytes(a) for a in args]
    offsets, at = [], 0
    for p in parts:
        offsets.append(at)
        at += -(-len(p) // 8) * 8
    buf = ctypes.create_string_buffer(b"".join(p.ljust(-(-len(p) // 8) * 8, b"\0") for p in parts), max(at, 1))
    base = ctypes.addressof(buf)
    params = (ctypes.c_void_p * max(1, len(parts)))(*[base + o for o in offsets])
    c, _ = _config_ex(cfg, getattr(stream, "ptr", stream))
    err = _driver().cuLaunchKernelEx(ctypes.byref(c), ctypes.c_void_p(func_ptr), params, None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {err} (grid {cfg.grid}, cluster {cfg.cluster})")


_loaded: dict = {}
_load_lock = threading.Lock()
_runtime = None  # cupy.cuda.runtime, imported on the first launch


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
    """Launch ``kernel`` with ``cfg`` on ``stream`` (a CuPy stream object) of ``device``.

    ``args`` are passed as CuPy does: pointers as Python ints (8 bytes), numpy scalars at their own size.
    """
    global _runtime
    if _runtime is None:
        from cupy.cuda import runtime as _runtime
    runtime = _runtime
    prev = runtime.getDevice()
    if prev != device:
        runtime.setDevice(device)
        try:
            get_kernel(kernel, device)(cfg, args, stream)
        finally:
            runtime.setDevice(prev)
    else:
        get_kernel(kernel, device)(cfg, args, stream)
