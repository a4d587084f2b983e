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


def check_2d(ptr: int, dtype: str, rows: int, cols: int, row_stride: int, box_rows: int, box_cols: int) -> None:
    """Raise ValueError for a layout TMA cannot describe (what cuTensorMapEncodeTiled would reject)."""
    item = _ITEMSIZE[dtype]
    if ptr % 16:
        raise ValueError("TMA needs a 16-byte aligned base address")
    if (row_stride * item) % 16 or row_stride * item >= 1 << 40:
        raise ValueError(f"TMA needs a row stride that is a multiple of 16 bytes, got {row_stride * item}")
    if not (1 <= box_rows <= 256 and 1 <= box_cols <= 256) or (box_cols * item) % 16:
        raise ValueError(f"bad TMA box {box_rows} x {box_cols}")
    if not (1 <= rows < 1 << 32 and 1 <= cols < 1 << 32):
        raise ValueError(f"bad TMA extent {rows} x {cols}")


@lru_cache(maxsize=1024)
def _tile_map_bytes(ptr: int, dtype: str, rows: int, cols: int, row_stride: int, box_rows: int, box_cols: int,
                    swizzle: int) -> bytes:
    check_2d(ptr, dtype, rows, cols, row_stride, box_rows, box_cols)
    item = _ITEMSIZE[dtype]
    # The driver wants the CUtensorMap it writes to be 64-byte aligned.
    buf = ctypes.create_string_buffer(128 + 64)
    tmap_addr = (ctypes.addressof(buf) + 63) & ~63
    gdim = (ctypes.c_uint64 * 2)(cols, rows)
    gstride = (ctypes.c_uint64 * 1)(row_stride * item)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    estride = (ctypes.c_uint32 * 2)(1, 1)
    rc = _encode_fn()(tmap_addr, _DTYPE[dtype], 2, ctypes.c_void_p(ptr), ctypes.addressof(gdim),
                      ctypes.addressof(gstride), ctypes.addressof(box), ctypes.addressof(estride), 0, swizzle,
                      _L2_PROMOTION_256B, 0)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {rc} (rows={rows}, cols={cols}, "
                           f"row_stride={row_stride}, box={box_rows}x{box_cols})")
    return ctypes.string_at(tmap_addr, 128)


def tile_map_2d(ptr: int, dtype: str, *, rows: int, cols: int, row_stride: int, box_rows: int, box_cols: int,
                swizzle: int = SWIZZLE_128B) -> np.ndarray:
    """A tensor map of the row-major (rows, cols) matrix at ``ptr`` (row stride in elements) that loads
    (box_rows, box_cols) boxes; out-of-range elements read as zero.  Cached: the same arguments give the same
    array (a map depends on nothing else), which callers must not modify."""
    return _tile_map_array(ptr, dtype, rows, cols, row_stride, box_rows, box_cols, swizzle)


@lru_cache(maxsize=1024)
def _tile_map_array(ptr, dtype, rows, cols, row_stride, box_rows, box_cols, swizzle) -> np.ndarray:
    arr = np.zeros(1, dtype=MAP_DTYPE)
    arr["words"][0] = np.frombuffer(
        _tile_map_bytes(ptr, dtype, rows, cols, row_stride, box_rows, box_cols, swizzle), dtype=np.uint64)
    return arr
