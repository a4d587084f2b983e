"""TMA tensor maps (CUtensorMap) built on the host with libcuda's cuTensorMapEncodeTiled through ctypes.

A map is returned as a size-1 NumPy structured array of 128 bytes, which CuPy passes by value to a
``const __grid_constant__ sc::TmaMap`` kernel parameter (kernels/common/tma.cuh).
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np

# CUtensorMapDataType, CUtensorMapSwizzle, CUtensorMapL2promotion values from cuda.h (stable ABI).
_DTYPE = {"float16": 6, "bfloat16": 9, "float32": 7}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
MAP_DTYPE = np.dtype([("words", np.uint64, 16)], align=True)


@lru_cache(maxsize=None)
def _encode_fn():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:  # pragma: no cover - only without a driver
        raise RuntimeError(f"speedcore: libcuda.so.1 is needed for TMA tensor maps ({e})") from None
    f = lib.cuTensorMapEncodeTiled
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p,
                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_int]
    return f


def check_nd(ptr: int, dtype: str, dims: tuple, strides: tuple, box: tuple) -> None:
    """Raise ValueError for an N-D layout TMA cannot describe.  ``dims`` and ``box`` run from the innermost
    (contiguous) dimension out; ``strides`` (elements) are those of dims[1:]."""
    item = _ITEMSIZE[dtype]
    if ptr % 16:
        raise ValueError("TMA needs a 16-byte aligned base address")
    if not 1 <= len(dims) <= 5 or len(strides) != len(dims) - 1 or len(box) != len(dims):
        raise ValueError(f"bad TMA rank: dims {dims}, strides {strides}, box {box}")
    for i, s in enumerate(strides):
        if (s * item) % 16 or not 0 <= s * item < 1 << 40:
            what = "row stride" if i == 0 else f"stride of dimension {i + 1}"
            raise ValueError(f"TMA needs a {what} that is a multiple of 16 bytes, got {s * item}")
    if any(not 1 <= b <= 256 for b in box) or (box[0] * item) % 16:
        raise ValueError(f"bad TMA box {box}")
    if any(not 1 <= d < 1 << 32 for d in dims):
        raise ValueError(f"bad TMA extent {dims}")


def check_2d(ptr: int, dtype: str, rows: int, cols: int, row_stride: int, box_rows: int, box_cols: int) -> None:
    """Raise ValueError for a layout TMA cannot describe (what cuTensorMapEncodeTiled would reject)."""
    check_nd(ptr, dtype, (cols, rows), (row_stride,), (box_cols, box_rows))


@lru_cache(maxsize=1024)
def _tile_map_bytes(ptr: int, dtype: str, dims: tuple, strides: tuple, box: tuple, swizzle: int) -> bytes:
    check_nd(ptr, dtype, dims, strides, box)
    item = _ITEMSIZE[dtype]
    rank = len(dims)
    # The driver wants the CUtensorMap it writes to be 64-byte aligned.
    buf = ctypes.create_string_buffer(128 + 64)
    tmap_addr = (ctypes.addressof(buf) + 63) & ~63
    gdim = (ctypes.c_uint64 * rank)(*dims)
    gstride = (ctypes.c_uint64 * max(1, rank - 1))(*(s * item for s in strides))
    boxd = (ctypes.c_uint32 * rank)(*box)
    estride = (ctypes.c_uint32 * rank)(*([1] * rank))
    rc = _encode_fn()(tmap_addr, _DTYPE[dtype], rank, ctypes.c_void_p(ptr), ctypes.addressof(gdim),
                      ctypes.addressof(gstride), ctypes.addressof(boxd), ctypes.addressof(estride), 0, swizzle,
                      _L2_PROMOTION_256B, 0)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {rc} (dims={dims}, strides={strides}, "
                           f"box={box})")
    return ctypes.string_at(tmap_addr, 128)


def tile_map(ptr: int, dtype: str, dims: tuple, strides: tuple, box: tuple, swizzle: int = SWIZZLE_128B) -> np.ndarray:
    """A tensor map of the N-D array at ``ptr``: ``dims`` and ``box`` from the innermost (contiguous) dimension
    out, ``strides`` in elements for dims[1:].  Out-of-range elements read as zero.  Cached: the same arguments
    give the same array (a map depends on nothing else), which callers must not modify."""
    return _tile_map_array(ptr, dtype, tuple(dims), tuple(strides), tuple(box), swizzle)


def tile_map_2d(ptr: int, dtype: str, *, rows: int, cols: int, row_stride: int, box_rows: int, box_cols: int,
                swizzle: int = SWIZZLE_128B) -> np.ndarray:
    """A tensor map of the row-major (rows, cols) matrix at ``ptr`` (row stride in elements) that loads
    (box_rows, box_cols) boxes (see :func:`tile_map`)."""
    return tile_map(ptr, dtype, (cols, rows), (row_stride,), (box_cols, box_rows), swizzle)


@lru_cache(maxsize=1024)
def _tile_map_array(ptr, dtype, dims, strides, box, swizzle) -> np.ndarray:
    arr = np.zeros(1, dtype=MAP_DTYPE)
    arr["words"][0] = np.frombuffer(_tile_map_bytes(ptr, dtype, dims, strides, box, swizzle), dtype=np.uint64)
    return arr
