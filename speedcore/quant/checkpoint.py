"""Round-to-nearest quantization of a Hugging Face checkpoint into the files AutoAWQ / AutoGPTQ write (NumPy and
the safetensors format only: no torch, no GPU, no calibration data).

``quantize_checkpoint(src_dir, dst_dir, method)`` reads a bf16 / fp16 / fp32 checkpoint (one safetensors file or
shards with ``model.safetensors.index.json``) one tensor at a time and writes, beside copies of the other files
(tokenizer, generation config, ...):

* ``method="awq"``: AutoAWQ's GEMM format (``WQLinear_GEMM``): per decoder linear ``qweight`` int32 (K, N/8) with 8
  output channels per word in the order [0, 2, 4, 6, 1, 3, 5, 7], ``qzeros`` int32 (K/G, N/8) packed alike,
  ``scales`` float16 (K/G, N), biases float16; config.json's ``quantization_config`` as AutoAWQ's
  ``to_transformers_dict``: ``{"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": true, "version":
  "gemm", "modules_to_not_convert": null}``.
* ``method="gptq"``: AutoGPTQ's ``QuantLinear.pack`` (checkpoint_format "gptq"): ``qweight`` int32 (K/8, N) with 8
  input rows per word in plain order, ``qzeros`` int32 (ceil(K/G), N/8) packed along N storing zero - 1,
  ``scales`` float16 (ceil(K/G), N), ``g_idx`` int32 (K), biases float16; ``quantization_config`` (and
  quantize_config.json) as AutoGPTQ's ``BaseQuantizeConfig.to_dict``.
* ``method="int8"``: speedcore's own INT8 weight-only layout (docs/quantization.md): ``weight`` int8 (N, K) and
  ``weight_scale`` float16 (N,), ``quantization_config`` ``{"quant_method": "speedcore_int8", "bits": 8,
  "group_size": -1, "sym": true, "modules_to_not_convert": null}``.

Quantized are the decoder layers' q/k/v/o and gate/up/down projections (AutoAWQ's and AutoGPTQ's choice for Llama);
embeddings, norms and lm_head are written as stored.  The values are round-to-nearest (speedcore.quant.formats'
quantizers: AWQ min/max with zero points, GPTQ symmetric or min/max, INT8 absmax), without AWQ's activation-aware
scaling or GPTQ's error feedback: the format is exact, the accuracy is RTN's.

GPTQ ``desc_act=True`` (act-order) needs an order of the input channels; GPTQ takes the Hessian diagonal of the
layer's inputs, descending.  Without calibration data this writes the order of the input channels' weight energy,
descending: ``sum over the linears that read this input of ||W[:, k]||^2`` (stable sort), so q/k/v share one order
and gate/up another, as in real act-order checkpoints (their Hessian is the same input's).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
from typing import Dict, List, Optional, Tuple

import numpy as np

from .formats import quantize_awq, quantize_gptq, quantize_int8

METHODS = ("awq", "gptq", "int8")
# the linears AutoAWQ / AutoGPTQ quantize in a Llama-family decoder layer, by their input
_LINEAR = re.compile(r"^(model\.layers\.(\d+)\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj))\.weight$")
_SHARED_INPUT = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "gate_up", "up": "gate_up", "down": "down"}
_ST_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "int64": "I64", "int32": "I32",
             "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_WEIGHT_FILES = re.compile(r"(\.safetensors|\.safetensors\.index\.json|\.bin|\.bin\.index\.json|\.pt|\.pth|\.ckpt|"
                           r"\.h5|\.msgpack)$")


def _parse_size(s) -> int:
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B)\s*", str(s).upper())
    if not m:
        raise ValueError(f"max_shard_size: expected bytes or e.g. '5GB', got {s!r}")
    return int(float(m.group(1)) * {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9}[m.group(2)])


def quantization_config(method: str, group_size: int, *, desc_act: bool = False, sym: bool = True) -> dict:
    """The ``quantization_config`` entry of config.json that AutoAWQ / AutoGPTQ write (int8: speedcore's)."""
    if method == "awq":  # AutoAWQ AwqConfig.to_transformers_dict
        return {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": 4, "version": "gemm",
                "modules_to_not_convert": None}
    if method == "gptq":  # AutoGPTQ BaseQuantizeConfig.to_dict
        return {"bits": 4, "group_size": group_size, "damp_percent": 0.01, "desc_act": desc_act,
                "static_groups": False, "sym": sym, "true_sequential": True, "model_name_or_path": None,
                "model_file_base_name": "model", "quant_method": "gptq", "checkpoint_format": "gptq"}
    return {"quant_method": "speedcore_int8", "bits": 8, "group_size": -1, "sym": True, "modules_to_not_convert": None}


def _float32(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":  # read as uint16 bit patterns
        return (a.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(a, np.float32)


def _act_order(weights: List[np.ndarray]) -> np.ndarray:
    """The act-order permutation of the input channels of linears sharing one input: descending weight energy
    (stand-in for GPTQ's Hessian diagonal; see the module docstring), stable."""
    energy = sum(np.square(w.astype(np.float64)).sum(0) for w in weights)
    return np.argsort(-energy, kind="stable").astype(np.int64)


class _Writer:
    """safetensors files written tensor by tensor: the header (names, dtypes, shapes, offsets) is known from the
    plan, so a shard never has to be held in memory."""

    def __init__(self, dst_dir: str, plan: List[Tuple[str, str, Tuple[int, ...]]], max_shard_bytes: int):
        shards: List[List[Tuple[str, str, Tuple[int, ...]]]] = [[]]
        size = 0
        for entry in plan:
            nbytes = int(np.prod(entry[2], dtype=np.int64)) * _ITEMSIZE[entry[1]]
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(entry)
            size += nbytes
        self.dst_dir = dst_dir
        n = len(shards)
        self.files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                                             for i in range(n)]
        self.shards = shards
        self.total = sum(int(np.prod(s, dtype=np.int64)) * _ITEMSIZE[d] for _, d, s in plan)

    def write(self, produce) -> None:
        """``produce(name)`` -> the tensor's array (its dtype and shape as planned), called in plan order."""
        weight_map = {}
        for fname, shard in zip(self.files, self.shards):
            header, off = {}, 0
            for name, dt, shape in shard:
                nbytes = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dt]
                header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + nbytes]}
                off += nbytes
                weight_map[name] = fname
            header["__metadata__"] = {"format": "pt"}
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
            with open(os.path.join(self.dst_dir, fname), "wb") as f:
                f.write(struct.pack("<Q", len(raw)))
                f.write(raw)
                for name, dt, shape in shard:
                    a = np.ascontiguousarray(produce(name))
                    if tuple(a.shape) != tuple(shape) or a.dtype.itemsize != _ITEMSIZE[dt]:
                        raise AssertionError(f"{name}: produced {a.dtype} {a.shape}, planned {dt} {shape}")
                    f.write(a.tobytes())
        if len(self.files) > 1:
            with open(os.path.join(self.dst_dir, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2,
                          sort_keys=True)


def _progress_bar(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="tensor", dynamic_ncols=True)
    except ImportError:
        return None


def quantize_checkpoint(src_dir: str, dst_dir: str, method: str = "awq", group_size: int = 128, *,
                        desc_act: bool = False, sym: bool = True, progress: bool = True,
                        max_shard_size="5GB", modules_to_not_convert: Optional[List[str]] = None) -> dict:
    """Quantize the Hugging Face checkpoint in ``src_dir`` into ``dst_dir`` (created; must not be ``src_dir``) in
    AutoAWQ's GEMM format (``method="awq"``), AutoGPTQ's (``"gptq"``; ``desc_act``, ``sym``) or speedcore's INT8
    weight-only layout (``"int8"``; ``group_size`` ignored).  ``group_size=-1`` is one group over K (GPTQ).
    Shards of at most ``max_shard_size`` (AutoAWQ's default, 5GB) with ``model.safetensors.index.json`` where
    there are several.  Linears whose module name contains an entry of ``modules_to_not_convert`` stay as stored
    (AutoAWQ's and transformers' substring match).  Returns the ``quantization_config`` written."""
    from ..engine.checkpoint import Checkpoint

    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
    if method == "int8":
        group_size = -1
    elif isinstance(group_size, bool) or not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise ValueError(f"group_size: expected a positive int or -1, got {group_size!r}")
    if method == "awq" and group_size == -1:
        raise ValueError("group_size: AutoAWQ's GEMM format needs a group size (e.g. 128), got -1")
    if desc_act and method != "gptq":
        raise ValueError(f"desc_act: act-order is a GPTQ option, got method={method!r}")
    if not sym and method != "gptq":
        raise ValueError(f"sym: asymmetric quantization is a GPTQ option (AWQ is always zero-point), got "
                         f"method={method!r}")
    if os.path.abspath(src_dir) == os.path.abspath(dst_dir):
        raise ValueError("dst_dir: must differ from src_dir")
    cfg_path = os.path.join(src_dir, "config.json")
    try:
        with open(cfg_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"src_dir: cannot read {cfg_path} ({e})") from None
    if config.get("quantization_config"):
        raise ValueError(f"src_dir: {cfg_path} already has a quantization_config "
                         f"({config['quantization_config'].get('quant_method')!r}); quantize a float checkpoint")
    ck = Checkpoint(src_dir)
    skip = list(modules_to_not_convert or [])
    if not all(isinstance(k, str) for k in skip):
        raise ValueError(f"modules_to_not_convert: expected a list of module names, got {modules_to_not_convert!r}")

    # the plan: every output tensor's name, safetensors dtype and shape, in the source's order
    plan: List[Tuple[str, str, Tuple[int, ...]]] = []
    sources: Dict[str, Tuple[str, str]] = {}  # output name -> (kind, source module or tensor)
    linears: Dict[str, Tuple[int, int]] = {}  # quantized module -> (N, K)
    bias_of = set()
    for name, info in ck.tensors.items():
        m = _LINEAR.match(name)
        if m and len(info.shape) == 2 and not any(key in m.group(1) for key in skip):
            linears[m.group(1)] = info.shape
    for name, info in ck.tensors.items():
        m = _LINEAR.match(name)
        if m and m.group(1) in linears:
            mod = m.group(1)
            n, k = info.shape
            g = k if group_size == -1 else group_size
            if info.dtype not in ("bfloat16", "float16", "float32"):
                raise ValueError(f"src_dir: {name} is {info.dtype}, expected a float weight")
            if method != "int8" and n % 8:
                raise ValueError(f"src_dir: {name} has N={n} output features, not a multiple of 8 (4-bit packing)")
            if method == "awq" and k % g:
                raise ValueError(f"group_size: {g} does not divide {name}'s K={k} input features (AWQ)")
            if method == "gptq" and k % 8:
                raise ValueError(f"src_dir: {name} has K={k} input features, not a multiple of 8 (GPTQ packing)")
            ng = -(-k // g)
            if method == "awq":
                outs = [("qweight", "I32", (k, n // 8)), ("qzeros", "I32", (k // g, n // 8)),
                        ("scales", "F16", (k // g, n))]
            elif method == "gptq":
                outs = [("qweight", "I32", (k // 8, n)), ("qzeros", "I32", (ng, n // 8)), ("scales", "F16", (ng, n)),
                        ("g_idx", "I32", (k,))]
            else:
                outs = [("weight", "I8", (n, k)), ("weight_scale", "F16", (n,))]
            for suffix, dt, shape in outs:
                plan.append((f"{mod}.{suffix}", dt, shape))
                sources[f"{mod}.{suffix}"] = ("quant", mod)
            continue
        if name.endswith(".bias") and name[:-5] in linears and method != "int8":
            # AutoAWQ / AutoGPTQ store the biases of quantized linears in float16
            plan.append((name, "F16", info.shape))
            sources[name] = ("bias", name)
            bias_of.add(name)
            continue
        plan.append((name, _ST_NAMES[info.dtype], info.shape))
        sources[name] = ("copy", name)
    if not linears:
        raise ValueError(f"src_dir: {src_dir} has no decoder-layer linears (model.layers.N.self_attn.q_proj.weight "
                         f"...) to quantize")

    os.makedirs(dst_dir, exist_ok=True)
    writer = _Writer(dst_dir, plan, _parse_size(max_shard_size))
    perms: Dict[Tuple[str, str], np.ndarray] = {}
    cache: Dict[str, Dict[str, np.ndarray]] = {}

    def weight(mod):
        info = ck.tensors[mod + ".weight"]
        return _float32(ck.read(mod + ".weight"), info.dtype)

    def perm_of(mod):
        m = _LINEAR.match(mod + ".weight")
        key = (m.group(2), _SHARED_INPUT[m.group(4) or m.group(5)])
        if key not in perms:
            prefix = f"model.layers.{key[0]}."
            peers = [p for p in linears if p.startswith(prefix) and
                     _SHARED_INPUT[_LINEAR.match(p + ".weight").group(4) or _LINEAR.match(p + ".weight").group(5)]
                     == key[1]]
            perms[key] = _act_order([weight(p) for p in sorted(peers)])
        return perms[key]

    def quantized(mod):
        if mod not in cache:
            cache.clear()  # one module's outputs at a time
            w = weight(mod)
            if method == "awq":
                qw, qz, sc = quantize_awq(w, group_size, scale_dtype="float16")
                cache[mod] = {"qweight": qw, "qzeros": qz, "scales": sc}
            elif method == "gptq":
                perm = perm_of(mod) if desc_act else None
                qw, qz, sc, gi = quantize_gptq(w, group_size, perm=perm, sym=sym, scale_dtype="float16")
                cache[mod] = {"qweight": qw, "qzeros": qz, "scales": sc, "g_idx": gi}
            else:
                q, sc = quantize_int8(w, scale_dtype="float16")
                cache[mod] = {"weight": q, "weight_scale": sc}
        return cache[mod]

    bar = _progress_bar(len(plan), progress, f"quantize {method}")

    def produce(name):
        kind, src = sources[name]
        if kind == "quant":
            out = quantized(src)[name[len(src) + 1:]]
        elif kind == "bias":
            info = ck.tensors[src]
            out = _float32(ck.read(src), info.dtype).astype(np.float16)
        else:
            out = ck.read(src)
        if bar is not None:
            bar.update(1)
        return out

    try:
        writer.write(produce)
    finally:
        if bar is not None:
            bar.close()
    qcfg = quantization_config(method, group_size, desc_act=desc_act, sym=sym)
    if skip:
        qcfg["modules_to_not_convert"] = skip
    config["quantization_config"] = qcfg
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if method == "gptq":  # AutoGPTQ writes it beside config.json (its own loader reads it first)
        with open(os.path.join(dst_dir, "quantize_config.json"), "w") as f:
            json.dump(qcfg, f, indent=2)
    for fname in sorted(os.listdir(src_dir)):  # tokenizer, generation config, chat template, ...
        path = os.path.join(src_dir, fname)
        if (os.path.isfile(path) and fname not in ("config.json", "quantize_config.json", "quant_config.json")
                and not _WEIGHT_FILES.search(fname)):
            shutil.copy2(path, os.path.join(dst_dir, fname))
    if progress and bar is None:
        print(f"quantize_checkpoint: {len(linears)} linears to {method}, {len(plan)} tensors written to {dst_dir}",
              file=sys.stderr)
    return qcfg
