"""Quantized checkpoints in the engine: ``quantization_config`` parsing, the tensors each quantized linear stores,
fusion of q/k/v and gate/up on the host, and the GPU layer (prepacked once with ``speedcore.quant.prepack_*``).

Formats (docs/quantization.md; bit-exact definitions in speedcore/quant/formats.py):

* ``awq``: AutoAWQ's GEMM checkpoints (``version`` "gemm", ``zero_point`` true, 4 bits): per linear ``qweight``
  int32 (K, N/8), ``qzeros`` int32 (K/G, N/8), ``scales`` (K/G, N).
* ``gptq``: AutoGPTQ's ``checkpoint_format`` "gptq" (4 bits, ``desc_act``, ``sym``): ``qweight`` int32 (K/8, N),
  ``qzeros`` int32 (ceil(K/G), N/8) storing zero - 1, ``scales`` (ceil(K/G), N), ``g_idx`` int32 (K).
* ``speedcore_int8``: INT8 weight-only, ``weight`` int8 (N, K) and ``weight_scale`` (N,) (one per output channel).

Fusion (one GEMM for q/k/v and one for gate/up, as the float model): the parts are concatenated along N with
their groups.  AWQ packs 8 output channels per int32 column of qweight and qzeros, so each part's N (a multiple
of 8) stays whole in its words; GPTQ packs qweight along K (columns are channels: plain concatenation) and qzeros
along N (8 per word, each part's N a multiple of 8); scales are per (group, channel).  GPTQ with act-order fuses
only where the parts' g_idx are equal (GPTQ's act-order comes from the inputs' Hessian, which q/k/v and gate/up
share); otherwise the layer keeps its parts separate and concatenates their outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .checkpoint import Checkpoint, to_dtype_bits

METHODS = ("awq", "gptq", "speedcore_int8")  # quant_method values the engine loads
METHOD_ALIASES = {"int8": "speedcore_int8"}  # the short names LLM(quantization=...) and the CLIs take
AWQ_GROUPS = (32, 64, 128)
GPTQ_GROUPS = (32, 64, 128, -1)
INT8_SUFFIXES = ("weight", "weight_scale")

# the engine's fused linears: name -> checkpoint modules (in order along N)
LINEAR_GROUPS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
                 "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}

# the layout copies prepack keeps (quant_copies): "compact" (the default) one INT4 copy per layer where
# speedcore.quant.compact_applies (sm_90, N % 256 == 0, K and G multiples of 128: the wgmma-major copy that
# gemv_stream_kernel reads at M <= 16 and w4_wgmma_kernel above), elsewhere (other GPUs and shapes, INT8) as "all";
# "all" as speedcore.quant builds them; "no-wgmma" without the wgmma-major copy (sm_90: M 17..128 then take
# quant_marlin_kernel, larger M the dense path); "tile-only" with only the stored tensors and the tile-major copy
# (every M <= 128 on quant_mma_kernel)
QUANT_COPIES = ("compact", "all", "no-wgmma", "tile-only")


class QuantConfigError(ValueError):
    """quantization_config names an unsupported method, format, bit width or group size."""


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "awq", "gptq" or "speedcore_int8"
    bits: int
    group_size: int  # G; -1: one group over K (GPTQ)
    desc_act: bool = False
    sym: bool = True
    modules_to_not_convert: Tuple[str, ...] = ()

    def converts(self, module: str) -> bool:
        """Whether checkpoint module ``module`` (``model.layers.0.self_attn.q_proj``) is stored quantized: every
        linear of the decoder layers but those matching an entry of modules_to_not_convert (a substring match, as
        AutoAWQ and transformers do)."""
        return not any(key in module for key in self.modules_to_not_convert)

    def group(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size

    def tensor_shapes(self, module: str, n: int, k: int) -> Dict[str, Tuple[int, ...]]:
        """The tensors a quantized linear of N outputs and K inputs stores, by checkpoint name, with their shapes
        (GPTQ's g_idx is optional unless desc_act)."""
        p = module + "."
        if self.method == "speedcore_int8":
            return {p + "weight": (n, k), p + "weight_scale": (n,)}
        g = self.group(k)
        groups = -(-k // g)
        if self.method == "awq":
            return {p + "qweight": (k, n // 8), p + "qzeros": (k // g, n // 8), p + "scales": (k // g, n)}
        s = {p + "qweight": (k // 8, n), p + "qzeros": (groups, n // 8), p + "scales": (groups, n)}
        if self.desc_act:
            s[p + "g_idx"] = (k,)
        return s

    def tensor_dtypes(self, module: str) -> Dict[str, Tuple[str, ...]]:
        """Allowed dtypes of the non-float tensors of ``module`` (the others: bfloat16, float16, float32)."""
        p = module + "."
        if self.method == "speedcore_int8":
            return {p + "weight": ("int8",)}
        return {p + n: ("int32",) for n in ("qweight", "qzeros", "g_idx")}

    def check_shape(self, module: str, n: int, k: int, where: str) -> None:
        """Raise QuantConfigError where the layer's shape cannot be stored in this format."""
        if self.method == "speedcore_int8":
            return
        if n % 8:
            raise QuantConfigError(f"{where}: {module} has {n} output features, not a multiple of 8 (4-bit "
                                   f"{self.method} packs 8 per int32)")
        g = self.group(k)
        if self.method == "awq" and k % g:
            raise QuantConfigError(f"{where}: {module} has {k} input features, not a multiple of group_size {g}")
        if self.method == "gptq" and k % 8:
            raise QuantConfigError(f"{where}: {module} has {k} input features, not a multiple of 8")


def _field(qc: dict, names: Sequence[str], default=None):
    for n in names:
        if n in qc:
            return n, qc[n]
    return names[0], default


def _bool(qc: dict, name: str, default: bool, where: str) -> bool:
    v = qc.get(name, default)
    if not isinstance(v, bool):
        raise QuantConfigError(f"{where}: quantization_config.{name} must be true or false, got {v!r}")
    return v


def parse_quantization(qc: Optional[dict], where: str = "config.json") -> Optional[QuantConfig]:
    """A :class:`QuantConfig` from config.json's ``quantization_config`` (None: a float checkpoint).  Anything
    the engine cannot load raises :class:`QuantConfigError` naming the field and the supported values."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantConfigError(f"{where}: quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    method = METHOD_ALIASES.get(str(method).lower(), str(method).lower()) if method is not None else None
    if method not in METHODS:
        raise QuantConfigError(f"{where}: quantization_config.quant_method {qc.get('quant_method')!r} is not "
                               f"supported; supported: {', '.join(METHODS)}")
    bits_name, bits = _field(qc, ("bits", "w_bit"))
    want_bits = 8 if method == "speedcore_int8" else 4
    if bits is None and method == "speedcore_int8":
        bits = 8
    if bits != want_bits or isinstance(bits, bool):
        raise QuantConfigError(f"{where}: quantization_config.{bits_name} {bits!r} is not supported for {method} "
                               f"(supported: {want_bits})")
    skip = qc.get("modules_to_not_convert") or ()
    if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
        raise QuantConfigError(f"{where}: quantization_config.modules_to_not_convert must be a list of module "
                               f"names or null, got {skip!r}")
    skip = tuple(skip)
    if method == "speedcore_int8":
        g = qc.get("group_size", -1)
        if g != -1:
            raise QuantConfigError(f"{where}: quantization_config.group_size {g!r} is not supported for "
                                   f"speedcore_int8 (supported: -1, one scale per output channel)")
        return QuantConfig(method, 8, -1, modules_to_not_convert=skip)
    g_name, g = _field(qc, ("group_size", "q_group_size"))
    if method == "awq":
        # AutoAWQ writes "version"; transformers 5 writes "format" too
        v_name, version = _field(qc, ("version", "format"), "gemm")
        if str(version).lower() != "gemm":
            raise QuantConfigError(f"{where}: quantization_config.{v_name} {version!r} is not supported for awq "
                                   f"(supported: gemm)")
        if not _bool(qc, "zero_point", True, where):
            raise QuantConfigError(f"{where}: quantization_config.zero_point false is not supported for awq "
                                   f"(supported: true)")
        if g not in AWQ_GROUPS or isinstance(g, bool):
            raise QuantConfigError(f"{where}: quantization_config.{g_name} {g!r} is not supported for awq "
                                   f"(supported: {', '.join(map(str, AWQ_GROUPS))})")
        return QuantConfig("awq", 4, g, modules_to_not_convert=skip)
    # AutoGPTQ writes "checkpoint_format" (older: "is_marlin_format"); transformers 5 / GPTQModel "format"
    f_name, fmt = _field(qc, ("checkpoint_format", "format"), "gptq")
    if qc.get("is_marlin_format"):
        f_name, fmt = "is_marlin_format", "marlin"
    if str(fmt).lower() != "gptq":
        raise QuantConfigError(f"{where}: quantization_config.{f_name} {fmt!r} is not supported for gptq "
                               f"(supported: gptq)")
    if g not in GPTQ_GROUPS or isinstance(g, bool):
        raise QuantConfigError(f"{where}: quantization_config.{g_name} {g!r} is not supported for gptq "
                               f"(supported: {', '.join(map(str, GPTQ_GROUPS))})")
    return QuantConfig("gptq", 4, g, desc_act=_bool(qc, "desc_act", False, where), sym=_bool(qc, "sym", True, where),
                       modules_to_not_convert=skip)


def preset_quantization(method: str, group_size: int = 128) -> QuantConfig:
    """The QuantConfig of a random-weight preset quantized with ``method`` (awq, gptq or int8)."""
    m = METHOD_ALIASES.get(method, method)
    if m not in METHODS:
        raise QuantConfigError(f"quantization: {method!r} is not supported; supported: awq, gptq, int8")
    if m == "speedcore_int8":
        return QuantConfig(m, 8, -1)
    return QuantConfig(m, 4, group_size)


# -- host side: the stored tensors of one fused linear -------------------------------------------------------------
@dataclass
class HostQuantLinear:
    """A fused linear as the loader builds it on the host, before upload: ``parts`` holds one dict of arrays per
    GEMM (one where the checkpoint modules fuse; GPTQ parts with different act-orders stay separate) with the
    output features of each; arrays as the format stores them (scales already in the compute dtype)."""
    method: str
    group_size: int  # the format's G (-1 resolved to K)
    in_features: int
    parts: List[Dict[str, np.ndarray]]
    part_features: List[int]

    @property
    def out_features(self) -> int:
        return sum(self.part_features)


def _float32(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def read_quant_linear(ck: Checkpoint, modules: Sequence[str], qc: QuantConfig, k: int, compute_dtype: str,
                      readers=None) -> HostQuantLinear:
    """Read the stored tensors of ``modules`` (consecutive parts along N of one engine linear) and fuse them.
    ``readers``: one ``read(name)`` per module (a tensor-parallel rank's slices, engine/parallel.py; ``k`` is then
    the rank's K); default: whole tensors."""
    import ml_dtypes

    half = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[compute_dtype]
    read = ck.read

    def scales(name):
        info = ck.tensors[name]
        return to_dtype_bits(read(name), info.dtype, compute_dtype).view(half)

    per = []
    for mi, m in enumerate(modules):
        read = ck.read if readers is None else readers[mi]
        if qc.method == "speedcore_int8":
            d = {"weight": read(m + ".weight"), "scales": scales(m + ".weight_scale").reshape(-1)}
            n = d["weight"].shape[0]
        else:
            d = {"qweight": read(m + ".qweight"), "qzeros": read(m + ".qzeros"), "scales": scales(m + ".scales")}
            n = d["scales"].shape[1]
            if qc.method == "gptq":
                g = read(m + ".g_idx").astype(np.int32) if m + ".g_idx" in ck.tensors else None
                if g is not None and np.array_equal(g, np.arange(k, dtype=np.int32) // qc.group(k)):
                    g = None  # the plain layout stored explicitly
                d["g_idx"] = g
        per.append((d, n))
    groups: List[List[Tuple[dict, int]]] = []
    for d, n in per:  # consecutive parts with equal g_idx fuse
        if groups and (qc.method != "gptq" or _same(groups[-1][0][0].get("g_idx"), d.get("g_idx"))):
            groups[-1].append((d, n))
        else:
            groups.append([(d, n)])
    parts, feats = [], []
    for grp in groups:
        ds = [d for d, _ in grp]
        if qc.method == "speedcore_int8":
            fused = {"weight": np.concatenate([d["weight"] for d in ds], 0),
                     "scales": np.concatenate([d["scales"] for d in ds], 0)}
        else:
            # every array keeps N (or N/8 words of 8 whole channels) as its last axis
            fused = {key: np.ascontiguousarray(np.concatenate([d[key] for d in ds], 1))
                     for key in ("qweight", "qzeros", "scales")}
            if qc.method == "gptq":
                fused["g_idx"] = ds[0]["g_idx"]
        parts.append(fused)
        feats.append(sum(n for _, n in grp))
    return HostQuantLinear(qc.method, qc.group(k), k, parts, feats)


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return np.array_equal(a, b)


def dequantize_host(hl: HostQuantLinear) -> np.ndarray:
    """The float32 weight W (K, N) of a host-side linear with speedcore.quant's reference dequantizers (tests)."""
    from ..quant import formats as F

    ws = []
    for p in hl.parts:
        if hl.method == "awq":
            ws.append(F.dequantize_awq_reference(p["qweight"], p["qzeros"], p["scales"], hl.group_size))
        elif hl.method == "gptq":
            ws.append(F.dequantize_gptq_reference(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], hl.group_size))
        else:
            ws.append(F.dequantize_int8_reference(p["weight"], p["scales"]))
    return np.concatenate(ws, axis=1)


# -- GPU side --------------------------------------------------------------------------------------------------
def prepacked_nbytes(obj) -> int:
    """Bytes of every array a prepacked layer (AWQWeight / GPTQWeight / Int8Weight) keeps alive: the stored
    tensors, the tile-major, fragment-major and wgmma-major copies, group records, act-order permutation (each
    array counted once)."""
    seen, total = set(), 0

    def walk(o):
        nonlocal total
        if o is None or isinstance(o, (int, float, str, bool, np.integer)) or id(o) in seen:
            return
        seen.add(id(o))
        if is_dataclass(o) and not isinstance(o, type):
            for f in fields(o):
                walk(getattr(o, f.name))
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        elif hasattr(o, "nbytes") and hasattr(o, "shape"):
            total += int(o.nbytes)

    walk(obj)
    return total


def expected_prepacked_bytes(method: str, n: int, k: int, group_size: int = 128, *, act_order: bool = False,
                             copies: str = "compact", cc: Tuple[int, int] = (9, 0)) -> Dict[str, int]:
    """The bytes ``speedcore.quant.prepack_*`` keeps for one layer of N outputs and K inputs, by copy, from the
    same shape predicates prepack uses (no GPU; the GPU test checks it against the arrays prepack makes): the
    stored tensors, the tile-major copy (quant_mma_kernel), the fragment-major copy and its group records (the
    M <= 16 streaming kernels, quant_marlin_kernel), the wgmma-major copy and its group records (w4_wgmma_kernel,
    sm_90), the act-order permutation.  ``copies`` as LLM(quant_copies=...)."""
    from .. import quant as Q
    from ..quant import gemv as _gemv, mma as _mma, w4wgmma as _w4

    m = METHOD_ALIASES.get(method, method)
    out = {}
    with _Switches(Q, copies):
        g = k if group_size == -1 else group_size
        if copies == "compact" and m != "speedcore_int8" and Q.compact_applies(n, k, g, cc):
            ng = k // g
            out["wgmma-major"] = n * k // 2 + (n // 64) * ng * _gemv.GEMV_GROUP_BYTES
            if act_order:
                out["act-order perm"] = 4 * k
            return out
        if m == "speedcore_int8":
            out["stored"] = n * k + 2 * n
            if n % 64 == 0 and k % 16 == 0:
                out["tile-major"] = 4 * _mma.packed_shape(Q.FMT_INT8, k, n)[0]
                if Q._want_gemv_layout(Q.KIND_INT8, n, k):
                    out["fragment-major"] = n * k
                if _w4._W8WGMMA_MODE != "off" and tuple(cc) == (9, 0) and _w4.w8wgmma_supported(k, n):
                    out["wgmma-major"] = n * k
            return out
        g = k if group_size == -1 else group_size
        ng = -(-k // g)
        out["stored"] = n * k // 2 + ng * n // 2 + 2 * ng * n
        fmt = Q.FMT_AWQ if m == "awq" else Q.FMT_GPTQ
        if n % 64 == 0 and Q._fast_group_ok(g) and k % 8 == 0:
            out["tile-major"] = 4 * _mma.packed_shape(fmt, k, n)[0]
            if Q._want_gemv_layout(Q.KIND_INT4, n, k, g):
                recs = (n // 64) * ng * _gemv.GEMV_GROUP_BYTES
                out["fragment-major"] = n * k // 2 + recs
                if _w4._W4WGMMA_MODE != "off" and tuple(cc) == (9, 0) and _w4.w4wgmma_supported(k, n, g):
                    out["wgmma-major"] = n * k // 2 + recs
        if act_order:
            out["act-order perm"] = 4 * k
    return out


def _upload(cp, a):
    if not isinstance(a, np.ndarray):  # made on the device already (random presets)
        return a
    if a.dtype.itemsize == 2 and a.dtype.kind not in "iu":  # halves: copied as bit patterns (ml_dtypes bf16)
        out = cp.empty(a.shape, dtype=a.dtype)
        out.view(np.uint16).set(np.ascontiguousarray(a).view(np.uint16))
        return out
    return cp.asarray(np.ascontiguousarray(a))


class _Switches:
    """Dispatch switches of speedcore.quant set while a layer is prepacked (quant_copies), restored after."""

    OFF = {"compact": {}, "all": {}, "no-wgmma": {"_W4WGMMA_MODE": "off", "_W8WGMMA_MODE": "off"},
           "tile-only": {"_W4WGMMA_MODE": "off", "_W8WGMMA_MODE": "off", "_GEMV_MODE": "off", "_STREAM_MODE": "off"}}

    def __init__(self, Q, copies: str):
        self.Q, self.set = Q, self.OFF[copies]

    def __enter__(self):
        self.old = {k: getattr(self.Q, k) for k in self.set}
        for k, v in self.set.items():
            setattr(self.Q, k, v)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            setattr(self.Q, k, v)
        return False


class QuantLinear:
    """A quantized linear on the GPU: one prepacked weight per part (one part where q/k/v or gate/up fused)."""

    def __init__(self, method: str, weights: list, part_features: List[int], stored_bytes: int):
        self.method = method
        self.weights = weights
        self.part_features = list(part_features)
        self.out_features = sum(part_features)
        self.stored_bytes = stored_bytes  # the checkpoint's tensors of this linear (one copy, as streamed)

    @classmethod
    def from_host(cls, hl: HostQuantLinear, copies: str = "compact") -> "QuantLinear":
        import cupy

        from .. import quant as Q

        if copies not in QUANT_COPIES:
            raise ValueError(f"quant_copies: expected one of {', '.join(QUANT_COPIES)}, got {copies!r}")
        weights, stored = [], 0
        with _Switches(Q, copies):
            for p in hl.parts:
                stored += sum(int(a.nbytes) for a in p.values() if a is not None)
                d = {k: (_upload(cupy, a) if a is not None else None) for k, a in p.items()}
                pc = "compact" if copies == "compact" else "all"
                if hl.method == "awq":
                    w = Q.prepack_awq(d["qweight"], d["qzeros"], d["scales"], group_size=hl.group_size, copies=pc)
                elif hl.method == "gptq":
                    w = Q.prepack_gptq(d["qweight"], d["qzeros"], d["scales"], d["g_idx"], group_size=hl.group_size,
                                       copies=pc)
                else:
                    w = Q.prepack_int8(d["weight"], d["scales"])
                weights.append(w)
        return cls(hl.method, weights, hl.part_features, stored)

    def nbytes(self) -> int:
        """GPU bytes this linear keeps (every copy prepack made)."""
        return sum(prepacked_nbytes(w) for w in self.weights)

    def __call__(self, x, bias=None):
        from .. import quant as Q

        fn = {"awq": Q.awq_linear, "gptq": Q.gptq_linear, "speedcore_int8": Q.int8_linear}[self.method]
        if len(self.weights) == 1:
            return fn(x, self.weights[0], bias=bias)
        import cupy

        ys, a = [], 0
        for w, n in zip(self.weights, self.part_features):
            ys.append(fn(x, w, bias=None if bias is None else bias[a:a + n]))
            a += n
        return cupy.concatenate(ys, axis=-1)


def random_linear(qc: QuantConfig, n: int, k: int, xp, rng, compute_dtype: str, std: float = 0.02
                  ) -> HostQuantLinear:
    """Random stored tensors of one linear (weights of std ``std``) made directly in the format with array module
    ``xp`` (CuPy for the bench presets: no host round trip; NumPy in tests) and its generator ``rng``: codes from
    hashed bit patterns of the generator's float32 normals (uniform enough for timing), zero points 8 (GPTQ: stored
    as 7), one scale per format group.  The presets need the shapes and the bytes, not a trained model."""
    import ml_dtypes

    half = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[compute_dtype]

    def words(*shape):  # 32-bit words: a float32 normal's bits times an odd constant, folded (a bijection mix)
        z = rng.standard_normal(int(np.prod(shape)), dtype=np.float32).view(np.uint32)
        return ((z * np.uint32(2654435761)) ^ (z >> np.uint32(13))).view(np.int32).reshape(shape)

    def full(shape, value):
        out = xp.empty(shape, dtype=half)
        out.view(np.uint16).fill(int(np.array(value, half).view(np.uint16)))
        return out

    if qc.method == "speedcore_int8":
        w = words(n, k // 4).view(np.int8).reshape(n, k)  # uniform bytes: std ~74 steps
        return HostQuantLinear(qc.method, -1, k, [{"weight": w, "scales": full((n,), std / 73.9)}], [n])
    g = qc.group(k)
    groups = -(-k // g)
    scale = full((groups, n), std / 4.61)  # codes uniform in 0..15 around 8: std 4.61 steps
    if qc.method == "awq":
        p = {"qweight": words(k, n // 8), "qzeros": xp.full((k // g, n // 8), 0x88888888 - (1 << 32), np.int32),
             "scales": scale}
    else:
        p = {"qweight": words(k // 8, n), "qzeros": xp.full((groups, n // 8), 0x77777777, np.int32), "scales": scale,
             "g_idx": None}
    return HostQuantLinear(qc.method, g, k, [p], [n])
