"""Model configuration from a Hugging Face ``config.json`` (Llama 2/3/3.1/3.2, Mistral, Qwen2, Qwen3)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from .quantization import LINEAR_GROUPS, QuantConfig, QuantConfigError, parse_quantization, preset_quantization

# architecture name in config.json -> family (one model file, per-family switches)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class ConfigError(ValueError):
    """config.json is missing, unreadable, of an unsupported architecture or inconsistent."""


# an unsupported quantization_config is a config problem too (raised as both)
class QuantizationError(ConfigError, QuantConfigError):
    pass


@dataclass
class ModelConfig:
    architecture: str
    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    # per layer: the number of earlier tokens a token attends (window - 1), or -1 (full attention)
    window_left: List[int] = field(default_factory=list)
    dtype: str = "bfloat16"  # the checkpoint's dtype
    bos_token_id: Optional[int] = None
    eos_token_ids: List[int] = field(default_factory=list)
    quantization: Optional[QuantConfig] = None  # quantization_config of a quantized checkpoint

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> Dict[str, Tuple[int, int]]:
        """(N, K) of every linear of layer 0's checkpoint modules (``self_attn.q_proj`` ...)."""
        h, i = self.hidden_size, self.intermediate_size
        return {"self_attn.q_proj": (self.q_size, h), "self_attn.k_proj": (self.kv_size, h),
                "self_attn.v_proj": (self.kv_size, h), "self_attn.o_proj": (h, self.q_size),
                "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}

    def quantized_group(self, layer: int, group: str) -> bool:
        """Whether the engine linear ``group`` (qkv, o, gate_up, down) of ``layer`` is stored quantized; raises
        :class:`ConfigError` where modules_to_not_convert keeps only some of its fused parts float."""
        qc = self.quantization
        if qc is None:
            return False
        conv = [qc.converts(f"model.layers.{layer}.{m}") for m in LINEAR_GROUPS[group]]
        if any(conv) and not all(conv):
            raise QuantizationError(f"quantization_config.modules_to_not_convert {list(qc.modules_to_not_convert)} "
                                    f"keeps only some of layer {layer}'s {group} parts float; the engine fuses them "
                                    f"(keep all or none of {', '.join(LINEAR_GROUPS[group])})")
        return all(conv)

    def weight_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Every tensor the model reads, by its checkpoint name, with its shape (quantized linears: the tensors
        their format stores)."""
        h, d = self.hidden_size, self.head_dim
        s: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            s["lm_head.weight"] = (self.vocab_size, h)
        lin = self.linear_shapes()
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}."
            s[p + "input_layernorm.weight"] = (h,)
            s[p + "post_attention_layernorm.weight"] = (h,)
            for group, modules in LINEAR_GROUPS.items():
                quant = self.quantized_group(layer, group)
                for m in modules:
                    n, k = lin[m]
                    if quant:
                        s.update(self.quantization.tensor_shapes(p + m, n, k))
                    else:
                        s[p + m + ".weight"] = (n, k)
            if self.qkv_bias:
                for name, rows in (("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size)):
                    s[p + f"self_attn.{name}_proj.bias"] = (rows,)
            if self.qk_norm:
                s[p + "self_attn.q_norm.weight"] = (d,)
                s[p + "self_attn.k_norm.weight"] = (d,)
        return s

    def weight_dtypes(self) -> Dict[str, Tuple[str, ...]]:
        """Allowed dtypes of the tensors that are not floats (quantized linears' packed words, INT8 weights)."""
        out: Dict[str, Tuple[str, ...]] = {}
        if self.quantization is None:
            return out
        for layer in range(self.num_layers):
            for group, modules in LINEAR_GROUPS.items():
                if self.quantized_group(layer, group):
                    for m in modules:
                        out.update(self.quantization.tensor_dtypes(f"model.layers.{layer}.{m}"))
        return out

    def num_params(self) -> int:
        """Parameters of the float model (a quantized checkpoint's count as the weights they stand for)."""
        h = self.hidden_size
        n = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        per = 2 * h + sum(a * b for a, b in self.linear_shapes().values())
        per += (self.q_size + 2 * self.kv_size) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        return n + per * self.num_layers

    def inv_freq(self) -> np.ndarray:
        """Rotary inverse frequencies (float64), with the checkpoint's rope scaling applied."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        sc = self.rope_scaling
        if not sc:
            return inv
        kind = sc.get("rope_type", sc.get("type"))
        if kind in (None, "default"):
            return inv
        factor = float(sc.get("factor", 1.0))
        if kind == "linear":
            return inv / factor
        if kind == "llama3":
            low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
            old = float(sc.get("original_max_position_embeddings", 8192))
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > old / low, inv / factor, inv)
            smooth = (old / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old / high) & (wavelen <= old / low)
            return np.where(medium, smoothed, scaled)
        raise ConfigError(f"rope_scaling: type {kind!r} is not supported (supported: default, linear, llama3)")

    def cos_sin_cache(self, max_positions: int) -> np.ndarray:
        """(max_positions, head_dim) float32: [cos(p f), sin(p f)] as rotary_embedding reads it."""
        freqs = np.outer(np.arange(max_positions, dtype=np.float64), self.inv_freq())
        return np.concatenate([np.cos(freqs), np.sin(freqs)], axis=1).astype(np.float32)


def _int(cfg: dict, key: str, where: str) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{where}: {key} must be a positive int, got {v!r}")
    return v


def parse_config(cfg: dict, where: str = "config.json") -> ModelConfig:
    """A :class:`ModelConfig` from the parsed JSON of a config.json (raises :class:`ConfigError`)."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(f"{where}: architecture {archs or cfg.get('model_type')!r} is not supported; supported: "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    family = SUPPORTED_ARCHITECTURES[arch]
    hidden = _int(cfg, "hidden_size", where)
    heads = _int(cfg, "num_attention_heads", where)
    kv_heads = cfg.get("num_key_value_heads") or heads
    layers = _int(cfg, "num_hidden_layers", where)
    head_dim = cfg.get("head_dim") or hidden // heads
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if family != "qwen3" and cfg.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    # transformers 5 moves rope_theta and the scaling into rope_parameters
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    layer_types = cfg.get("layer_types")
    if layer_types and len(layer_types) != layers:
        raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries for {layers} layers")
    if window:
        if layer_types:
            wl = [window - 1 if t == "sliding_attention" else -1 for t in layer_types]
        elif family in ("qwen2", "qwen3"):
            first = cfg.get("max_window_layers", layers)
            wl = [window - 1 if i >= first else -1 for i in range(layers)]
        else:
            wl = [window - 1] * layers
    else:
        wl = [-1] * layers
    eos = cfg.get("eos_token_id")
    eos_ids = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    mc = ModelConfig(
        architecture=arch, family=family, hidden_size=hidden, intermediate_size=_int(cfg, "intermediate_size", where),
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        vocab_size=_int(cfg, "vocab_size", where), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta), rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)), qk_norm=family == "qwen3",
        window_left=wl, dtype=dtype, bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")
    if cfg.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias is not supported")
    mc.inv_freq()  # reject unknown rope scaling types here, not at the first step
    try:
        mc.quantization = parse_quantization(cfg.get("quantization_config"), where)
        if mc.quantization is not None:
            for m, (n, k) in mc.linear_shapes().items():
                mc.quantization.check_shape(m, n, k, where)
            mc.weight_shapes()  # modules_to_not_convert that splits a fused linear
    except QuantConfigError as e:
        raise QuantizationError(str(e)) from None
    return mc


def load_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None
    qpath = os.path.join(model_dir, "quantize_config.json")
    if "quantization_config" not in cfg and os.path.isfile(qpath):  # older AutoGPTQ: only quantize_config.json
        try:
            with open(qpath) as f:
                cfg["quantization_config"] = dict({"quant_method": "gptq"}, **json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{qpath}: cannot read ({e})") from None
    mc = parse_config(cfg, path)
    gen = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen):  # generation_config's eos list (Llama 3 instruct: <|eot_id|> too) takes precedence
        try:
            with open(gen) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                mc.eos_token_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        except (OSError, json.JSONDecodeError):
            pass
    return mc


# Shapes of the bench presets (random weights; no download)
PRESETS = {
    "llama-3-8b": dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192),
    "llama-3.2-1b": dict(architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                         tie_word_embeddings=True,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    # Llama 3 / 3.1 70B's shape (Llama 3's rope; 140 GB of bf16: tensor_parallel_size 2 and up on 141 GB GPUs)
    "llama-3-70b": dict(architectures=["LlamaForCausalLM"], hidden_size=8192, intermediate_size=28672,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192),
    "tiny": dict(architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096),
}


def preset_config(name: str, quantization: Optional[str] = None, group_size: int = 128) -> ModelConfig:
    """A preset's config; ``quantization`` (awq, gptq, int8) makes its linears quantized (random codes)."""
    if name not in PRESETS:
        raise ConfigError(f"preset {name!r} is unknown; presets: {', '.join(PRESETS)}")
    mc = parse_config(dict(PRESETS[name], torch_dtype="bfloat16"), f"preset {name}")
    if quantization is not None:
        try:
            mc.quantization = preset_quantization(quantization, group_size)
            for m, (n, k) in mc.linear_shapes().items():
                mc.quantization.check_shape(m, n, k, f"preset {name}")
        except QuantConfigError as e:
            raise QuantizationError(str(e)) from None
    return mc
