"""Safetensors checkpoints (one file or shards with ``model.safetensors.index.json``): headers only, no torch.

The header format: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets:
[begin, end]}} (offsets relative to the end of the header), then the data.  Tensors are read one at a time
into host memory (``read``), so loading holds about one tensor on the host, far less than one shard.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np

# safetensors dtype -> (numpy dtype used to read the bytes, name); bf16 is read as its bit pattern
_DTYPES = {"BF16": (np.uint16, "bfloat16"), "F16": (np.float16, "float16"), "F32": (np.float32, "float32"),
           "F64": (np.float64, "float64"), "I64": (np.int64, "int64"), "I32": (np.int32, "int32"),
           "I16": (np.int16, "int16"), "I8": (np.int8, "int8"), "U8": (np.uint8, "uint8"), "BOOL": (np.bool_, "bool")}


class CheckpointError(ValueError):
    """The checkpoint is missing, unreadable, or lacks / mis-shapes a tensor the model needs."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: str  # "bfloat16", "float16", "float32", ...
    shape: Tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: str) -> Dict[str, TensorInfo]:
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            size = os.fstat(f.fileno()).st_size
            if n > min(size - 8, 100 << 20):
                raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: not a safetensors file (the header is not JSON)") from None
    out = {}
    for name, d in header.items():
        if name == "__metadata__":
            continue
        if d.get("dtype") not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {d.get('dtype')!r}")
        begin, end = d["data_offsets"]
        shape = tuple(int(s) for s in d["shape"])
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[d["dtype"]][0]).itemsize
        if end - begin != nbytes or 8 + n + end > size:
            raise CheckpointError(f"{path}: tensor {name} has inconsistent offsets (truncated file?)")
        out[name] = TensorInfo(name, path, _DTYPES[d["dtype"]][1], shape, 8 + n + begin, nbytes)
    return out


class Checkpoint:
    """Every tensor of a model directory's safetensors files, by name (headers read, no data)."""

    def __init__(self, model_dir: str):
        self.dir = model_dir
        index = os.path.join(model_dir, "model.safetensors.index.json")
        single = os.path.join(model_dir, "model.safetensors")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: cannot read its weight_map ({e})") from None
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(single):
            weight_map, files = None, ["model.safetensors"]
        else:
            others = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")) if os.path.isdir(
                model_dir) else []
            if not others:
                raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json (only "
                                      f"safetensors checkpoints are supported)")
            weight_map, files = None, others
        self.files: List[str] = [os.path.join(model_dir, f) for f in files]
        self.tensors: Dict[str, TensorInfo] = {}
        for path in self.files:
            if not os.path.isfile(path):
                raise CheckpointError(f"{index}: shard {os.path.basename(path)} is missing")
            for name, info in read_header(path).items():
                if weight_map is not None and weight_map.get(name, os.path.basename(path)) != os.path.basename(path):
                    continue  # the index names another shard for it
                self.tensors[name] = info
        if weight_map is not None:
            lost = [n for n in weight_map if n not in self.tensors]
            if lost:
                raise CheckpointError(f"{index}: {len(lost)} tensors listed in the index are not in their shards "
                                      f"(first: {lost[0]} in {weight_map[lost[0]]})")

    def check(self, expected: Mapping[str, Tuple[int, ...]],
              dtypes: Optional[Mapping[str, Tuple[str, ...]]] = None) -> None:
        """Raise :class:`CheckpointError` naming missing or mis-shaped tensors (unused extra tensors are fine).
        Tensors must be floats, or of the dtypes ``dtypes`` names for them (quantized linears' int32 / int8)."""
        missing = [n for n in expected if n not in self.tensors]
        wrong = [f"{n}: {self.tensors[n].shape} (expected {tuple(s)})" for n, s in expected.items()
                 if n in self.tensors and self.tensors[n].shape != tuple(s)]
        float_types = ("bfloat16", "float16", "float32")
        dtypes = dtypes or {}
        bad_types = [f"{n}: {self.tensors[n].dtype} (expected {' or '.join(dtypes.get(n, float_types))})"
                     for n in expected
                     if n in self.tensors and self.tensors[n].dtype not in dtypes.get(n, float_types)]
        msgs = []
        if missing:
            msgs.append(f"{len(missing)} missing tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if wrong:
            msgs.append(f"{len(wrong)} mis-shaped tensors: {'; '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}")
        if bad_types:
            msgs.append(f"tensors of unsupported dtypes: {'; '.join(bad_types[:5])}")
        if msgs:
            raise CheckpointError(f"{self.dir}: " + "; ".join(msgs))

    def by_file(self, names: Iterable[str]) -> Dict[str, List[str]]:
        """The names grouped by shard, in file order (load shard after shard)."""
        groups: Dict[str, List[str]] = {f: [] for f in self.files}
        for n in names:
            groups[self.tensors[n].file].append(n)
        return {f: v for f, v in groups.items() if v}

    def read(self, name: str) -> np.ndarray:
        """The tensor's data as a host array (bfloat16 as uint16 bit patterns)."""
        info = self.tensors[name]
        np_dtype = next(t for t, n in _DTYPES.values() if n == info.dtype)
        with open(info.file, "rb") as f:
            f.seek(info.offset)
            buf = f.read(info.nbytes)
        if len(buf) != info.nbytes:
            raise CheckpointError(f"{info.file}: tensor {name} is truncated")
        return np.frombuffer(buf, dtype=np_dtype).reshape(info.shape)

    def read_slice(self, name: str, rows: Optional[Tuple[int, int]] = None,
                   cols: Optional[Tuple[int, int]] = None) -> np.ndarray:
        """Rows ``[rows[0], rows[1])`` and columns ``[cols[0], cols[1])`` of a tensor (None: all), reading only
        those bytes: a row range is one contiguous read; a column range goes through a memory map of the tensor
        (strided), so a tensor-parallel rank never holds more than its slice (tensors of 1 or 2 dimensions)."""
        info = self.tensors[name]
        if rows is None and cols is None:
            return self.read(name)
        np_dtype = np.dtype(next(t for t, n in _DTYPES.values() if n == info.dtype))
        shape = info.shape
        r0, r1 = rows if rows is not None else (0, shape[0])
        if not 0 <= r0 <= r1 <= shape[0]:
            raise CheckpointError(f"{name}: rows [{r0}, {r1}) outside its {shape[0]}")
        row_elems = int(np.prod(shape[1:], dtype=np.int64))
        if cols is None:
            with open(info.file, "rb") as f:
                f.seek(info.offset + r0 * row_elems * np_dtype.itemsize)
                n = (r1 - r0) * row_elems * np_dtype.itemsize
                buf = f.read(n)
            if len(buf) != n:
                raise CheckpointError(f"{info.file}: tensor {name} is truncated")
            return np.frombuffer(buf, dtype=np_dtype).reshape((r1 - r0,) + tuple(shape[1:]))
        if len(shape) != 2 or not 0 <= cols[0] <= cols[1] <= shape[1]:
            raise CheckpointError(f"{name}: columns {cols} of a tensor of shape {shape}")
        mm = np.memmap(info.file, dtype=np_dtype, mode="r", offset=info.offset, shape=shape)
        out = np.array(mm[r0:r1, cols[0]:cols[1]])
        del mm
        return out


def to_dtype_bits(a: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Host conversion of a float tensor to ``dst`` ("bfloat16" as uint16 bits, or "float16"), round to nearest even."""
    if src == dst:
        return a
    if src == "bfloat16":
        a = (a.astype(np.uint32) << 16).view(np.float32)
    f32 = np.ascontiguousarray(a, dtype=np.float32)
    if dst == "float16":
        return f32.astype(np.float16)
    u = f32.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
