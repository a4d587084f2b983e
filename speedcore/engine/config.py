"""Model configuration from a Hugging Face ``config.json`` (Llama 2/3/3.1/3.2, Mistral, Qwen2, Qwen3)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

# architecture name in config.json -> family (one model file, per-family switches)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class ConfigError(ValueError):
    """config.json is missing, unreadable, of an unsupported architecture or inconsistent."""


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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Every tensor the model reads, by its checkpoint name, with its shape."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        s: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            s["lm_head.weight"] = (self.vocab_size, h)
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}."
            s[p + "input_layernorm.weight"] = (h,)
            s[p + "post_attention_layernorm.weight"] = (h,)
            for name, rows in (("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size)):
                s[p + f"self_attn.{name}_proj.weight"] = (rows, h)
                if self.qkv_bias:
                    s[p + f"self_attn.{name}_proj.bias"] = (rows,)
            s[p + "self_attn.o_proj.weight"] = (h, self.q_size)
            if self.qk_norm:
                s[p + "self_attn.q_norm.weight"] = (d,)
                s[p + "self_attn.k_norm.weight"] = (d,)
            s[p + "mlp.gate_proj.weight"] = (i, h)
            s[p + "mlp.up_proj.weight"] = (i, h)
            s[p + "mlp.down_proj.weight"] = (h, i)
        return s

    def num_params(self) -> int:
        return sum(int(np.prod(v)) for v in self.weight_shapes().values())

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
    "tiny": dict(architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096),
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"preset {name!r} is unknown; presets: {', '.join(PRESETS)}")
    return parse_config(dict(PRESETS[name], torch_dtype="bfloat16"), f"preset {name}")
