"""Llama-family decoder (Llama 2/3/3.1/3.2, Mistral, Qwen2, Qwen3) on speedcore's ops and CuPy.

Per-family switches: Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm, Mistral's sliding window (per layer),
Llama 3's rope scaling (in the cos/sin table), tied embeddings.  q/k/v and gate/up are fused at load (one GEMM
each); weights stay in the checkpoint's layout otherwise.  Quantized checkpoints (AWQ, GPTQ, INT8: see
engine/quantization.py) hold a :class:`QuantLinear` in place of each quantized float weight, prepacked at load.

Tensor parallelism (engine/parallel.py): the model holds one rank's shard (``shard``, a :class:`ShardPlan`; tp = 1
is the whole model as rank 0's shard) and calls ``comm`` for the collectives: an all-reduce after o and after down,
an all-reduce of the vocab-parallel embedding and an all-gather of the lm_head's logit slices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import numpy as np

from ..checkpoint import Checkpoint, to_dtype_bits
from ..config import ModelConfig
from ..parallel import Communicator, ShardPlan, SingleRankCommunicator
from ..quantization import LINEAR_GROUPS, QUANT_COPIES, QuantLinear, random_linear, read_quant_linear


def compute_dtype(name: str):
    """The array dtype for "bfloat16" / "float16" (ml_dtypes' bfloat16 is what speedcore's CuPy path reads)."""
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    if name == "float16":
        return np.float16
    raise ValueError(f"dtype: expected bfloat16 or float16, got {name!r}")


@dataclass
class LayerWeights:
    in_norm: object
    post_norm: object
    qkv: object  # (q_size + 2 kv_size, hidden), or a QuantLinear (so are o, gate_up and down)
    qkv_bias: Optional[object]
    o: object
    q_norm: Optional[object]
    k_norm: Optional[object]
    gate_up: object  # (2 intermediate, hidden)
    down: object


@dataclass
class ForwardContext:
    """One step's GPU inputs (views of the step buffer) and the runner's attention."""
    input_ids: object
    positions: object
    slot_mapping: object
    logits_idx: Optional[object]  # rows whose logits are needed; None: every row
    # attend(layer, q, k, v, out, cos_sin): rotates q and k in place (NEOX, ctx.positions), writes k and v to the
    # layer's cache, and out (T, H, D) <- attention of this step's tokens
    attend: Callable


class LlamaModel:
    def __init__(self, cfg: ModelConfig, dtype: str, quant_copies: str = "compact", shard: Optional[ShardPlan] = None,
                 comm: Optional[Communicator] = None):
        import cupy

        self.cfg = cfg
        self.shard = sh = shard if shard is not None else ShardPlan.whole(cfg)
        self.comm = comm if comm is not None else SingleRankCommunicator()
        if self.comm.size != sh.size:
            raise ValueError(f"comm: a communicator of {self.comm.size} ranks for a shard of {sh.size}")
        # this rank's sizes (the whole model's at tp = 1)
        self.num_heads, self.num_kv_heads = sh.num_heads, sh.num_kv_heads
        self.q_size, self.kv_size, self.intermediate_size = sh.q_size, sh.kv_size, sh.intermediate_size
        if quant_copies not in QUANT_COPIES:
            raise ValueError(f"quant_copies: expected one of {', '.join(QUANT_COPIES)}, got {quant_copies!r}")
        self.quant_copies = quant_copies  # the layout copies quantized linears keep (quantization.QUANT_COPIES)
        self.dtype_name = dtype
        self.dtype = compute_dtype(dtype)
        h, i = cfg.hidden_size, sh.intermediate_size
        qkv_rows = sh.q_size + 2 * sh.kv_size
        empty = lambda *shape: cupy.empty(shape, dtype=self.dtype)  # noqa: E731
        self.embed = empty(sh.vocab_rows, h)  # this rank's vocabulary rows
        self.norm = empty(h)
        # GEMM sizes must be multiples of 8: a vocabulary that is not gets zero rows (sliced off the logits); at
        # tp = N each rank's slice is vocab_per_rank rows, the vocabulary padded to N of them
        self.vocab_padded = sh.vocab_per_rank * sh.size
        self.lm_head = self.embed if cfg.tie_word_embeddings and sh.vocab_per_rank == sh.vocab_rows else None
        if self.lm_head is None:
            self.lm_head = cupy.zeros((sh.vocab_per_rank, h), dtype=self.dtype)
        # quantized linears: None until load / init_random builds their QuantLinear
        fl = lambda layer, group, *shape: None if cfg.quantized_group(layer, group) else empty(*shape)  # noqa: E731
        self.layers: List[LayerWeights] = [LayerWeights(
            in_norm=empty(h), post_norm=empty(h), qkv=fl(li, "qkv", qkv_rows, h),
            qkv_bias=empty(qkv_rows) if cfg.qkv_bias else None, o=fl(li, "o", h, sh.q_size),
            q_norm=empty(cfg.head_dim) if cfg.qk_norm else None, k_norm=empty(cfg.head_dim) if cfg.qk_norm else None,
            gate_up=fl(li, "gate_up", 2 * i, h), down=fl(li, "down", h, i)) for li in range(cfg.num_layers)]

    # -- weights ------------------------------------------------------------------------------------------------
    def destination(self, name: str):
        """(array, first row, last row) that checkpoint tensor ``name`` (this rank's slice of it,
        ``self.shard.float_slice(name)``) fills; None for a tensor the model skips."""
        cfg = self.cfg
        if name == "model.embed_tokens.weight":
            return self.embed, 0, self.shard.vocab_rows
        if name == "model.norm.weight":
            return self.norm, 0, cfg.hidden_size
        if name == "lm_head.weight":
            return self.lm_head, 0, self.shard.vocab_rows
        if not name.startswith("model.layers."):
            return None
        idx, rest = name[len("model.layers."):].split(".", 1)
        L = self.layers[int(idx)]
        q, kv, i = self.q_size, self.kv_size, self.intermediate_size
        table = {
            "input_layernorm.weight": (L.in_norm, 0, cfg.hidden_size),
            "post_attention_layernorm.weight": (L.post_norm, 0, cfg.hidden_size),
            "self_attn.q_proj.weight": (L.qkv, 0, q), "self_attn.k_proj.weight": (L.qkv, q, q + kv),
            "self_attn.v_proj.weight": (L.qkv, q + kv, q + 2 * kv),
            "self_attn.o_proj.weight": (L.o, 0, cfg.hidden_size),
            "self_attn.q_norm.weight": (L.q_norm, 0, cfg.head_dim),
            "self_attn.k_norm.weight": (L.k_norm, 0, cfg.head_dim),
            "mlp.gate_proj.weight": (L.gate_up, 0, i), "mlp.up_proj.weight": (L.gate_up, i, 2 * i),
            "mlp.down_proj.weight": (L.down, 0, cfg.hidden_size)}
        if cfg.qkv_bias:
            table.update({"self_attn.q_proj.bias": (L.qkv_bias, 0, q), "self_attn.k_proj.bias": (L.qkv_bias, q, q + kv),
                          "self_attn.v_proj.bias": (L.qkv_bias, q + kv, q + 2 * kv)})
        d = table.get(rest)
        # None arrays: Qwen3-only norms elsewhere, and quantized linears (their tensors go to load_quantized)
        return d if d is not None and d[0] is not None and not isinstance(d[0], QuantLinear) else None

    def load(self, ck: Checkpoint, progress=None) -> None:
        """Stream the checkpoint to the GPU shard by shard, one tensor at a time on the host."""
        import cupy

        names = [n for n in self.cfg.weight_shapes() if self.destination(n) is not None]
        for _, group in ck.by_file(names).items():
            for name in group:
                dst, a, b = self.destination(name)
                rows, cols = self.shard.float_slice(name)  # this rank's rows / columns only
                host = to_dtype_bits(ck.read_slice(name, rows, cols), ck.tensors[name].dtype, self.dtype_name)
                dst.view(np.uint16)[a:b].set(np.ascontiguousarray(host).view(np.uint16))
                if progress is not None:
                    progress(name)
        self._tie()
        self.load_quantized(ck, progress)
        cupy.cuda.get_current_stream().synchronize()

    def quantized_linears(self):
        """(layer, group name, checkpoint modules) of every quantized linear, in layer order."""
        for li in range(self.cfg.num_layers):
            for group, modules in LINEAR_GROUPS.items():
                if self.cfg.quantized_group(li, group):
                    yield li, group, [f"model.layers.{li}.{m}" for m in modules]

    def load_quantized(self, ck: Checkpoint, progress=None) -> None:
        """Each quantized linear: its parts read and fused on the host (one fused linear at a time), uploaded, and
        prepacked once; the raw upload is dropped unless prepack keeps it."""
        lin = self.cfg.linear_shapes()
        qc, sh = self.cfg.quantization, self.shard
        for li, group, modules in self.quantized_linears():
            k = lin[LINEAR_GROUPS[group][0]][1]
            readers = [sh.quant_reader(ck, qc, m, k) for m in modules]  # this rank's slices of each part
            host = read_quant_linear(ck, modules, qc, sh.local_k(modules[0], k), self.dtype_name, readers)
            setattr(self.layers[li], group, QuantLinear.from_host(host, self.quant_copies))
            if progress is not None:
                progress(f"model.layers.{li}.{group}")
        if self.cfg.quantization is not None:  # raw uploads prepack replaced: back to the device before profiling
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()

    def _tie(self) -> None:
        if self.cfg.tie_word_embeddings and self.lm_head is not self.embed:
            self.lm_head.view(np.uint16)[:self.shard.vocab_rows] = self.embed.view(np.uint16)

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights (normal, std 0.02; norms 1), generated on the GPU: the bench presets."""
        import cupy

        rng = cupy.random.default_rng(seed + 7919 * self.shard.rank)  # ranks: different random shards
        for name in self.cfg.weight_shapes():
            if self.destination(name) is None:  # quantized linears: below
                continue
            dst, a, b = self.destination(name)
            part = dst.view(np.uint16)[a:b]  # copies as bit patterns
            if name.endswith("norm.weight"):
                part.fill(0x3F80 if self.dtype_name == "bfloat16" else 0x3C00)  # 1.0
                continue
            rows = max(1, (1 << 26) // max(1, int(np.prod(part.shape[1:]))))  # 256 MB of float32 at a time
            for r in range(0, part.shape[0], rows):
                chunk = part[r:r + rows]
                chunk[...] = (rng.standard_normal(chunk.shape, dtype=cupy.float32) * std).astype(self.dtype).view(
                    np.uint16)
        self._tie()
        # quantized presets: random codes and scales made in the format on the GPU (no float weights to quantize)
        lin, sh = self.cfg.linear_shapes(), self.shard
        local_n = {"qkv": sh.q_size + 2 * sh.kv_size, "o": self.cfg.hidden_size, "gate_up": 2 * sh.intermediate_size,
                   "down": self.cfg.hidden_size}
        for li, group, _ in self.quantized_linears():
            mods = LINEAR_GROUPS[group]
            n, k = local_n[group], sh.local_k(mods[0], lin[mods[0]][1])
            made = random_linear(self.cfg.quantization, n, k, cupy, rng, self.dtype_name, std)
            setattr(self.layers[li], group, QuantLinear.from_host(made, self.quant_copies))

    def _arrays(self):
        arrays = [self.embed, self.norm] + ([self.lm_head] if self.lm_head is not self.embed else [])
        for L in self.layers:
            arrays += [x for x in vars(L).values() if x is not None]
        return arrays

    def nbytes(self) -> int:
        """Bytes of the weights on the GPU: float arrays, and every copy the quantized linears' prepack keeps."""
        return sum(x.nbytes() if isinstance(x, QuantLinear) else int(x.nbytes) for x in self._arrays())

    def streamed_bytes(self) -> int:
        """Bytes a forward reads from the weights (the roofline's): float arrays, and one copy of each quantized
        linear's stored tensors."""
        return sum(x.stored_bytes if isinstance(x, QuantLinear) else int(x.nbytes) for x in self._arrays())

    def weights_summary(self) -> str:
        """What the weights are, for the start-up line: dtype, quantization, bytes by kind."""
        q = self.cfg.quantization
        if q is None:
            return f"{self.dtype_name}"
        quant = [x for x in self._arrays() if isinstance(x, QuantLinear)]
        qb = sum(x.nbytes() for x in quant)
        g = f" g{q.group_size}" if q.group_size != -1 else ""
        return (f"{q.method} {q.bits}-bit{g}{' act-order' if q.desc_act else ''}, {len(quant)} quantized linears "
                f"{qb / 1e9:.2f} GB (stored {sum(x.stored_bytes for x in quant) / 1e9:.2f} GB; copies: "
                f"{self.quant_copies}), other weights {(self.nbytes() - qb) / 1e9:.2f} GB {self.dtype_name}")

    # -- forward ------------------------------------------------------------------------------------------------
    def forward(self, ctx: ForwardContext, cos_sin):
        """Logits (rows of ``ctx.logits_idx``, vocab) in the compute dtype, for this step's tokens."""
        import cupy

        import speedcore as sc

        cfg, comm = self.cfg, self.comm
        eps = cfg.rms_norm_eps
        H, Hkv, D = self.num_heads, self.num_kv_heads, cfg.head_dim  # this rank's heads
        q_size, kv_size = self.q_size, self.kv_size
        T = ctx.input_ids.shape[0]
        x = self._embed(cupy, ctx.input_ids)  # (T, hidden)
        residual = None
        for li, L in enumerate(self.layers):
            if residual is None:
                y, residual = sc.rms_norm(x, L.in_norm, eps), x
            else:
                y, residual = sc.rms_norm(x, L.in_norm, eps, residual=residual)
            qkv = _linear(sc, y, L.qkv, L.qkv_bias)
            q = qkv[:, :q_size].reshape(T, H, D)
            k = qkv[:, q_size:q_size + kv_size].reshape(T, Hkv, D)
            v = qkv[:, q_size + kv_size:].reshape(T, Hkv, D)
            if L.q_norm is not None:  # Qwen3: RMSNorm over each head before the rotation
                # (strided head views do not collapse to one row stride: copied as bit patterns first)
                q = sc.rms_norm(cupy.ascontiguousarray(q.view(np.uint16)).view(self.dtype), L.q_norm, eps)
                k = sc.rms_norm(cupy.ascontiguousarray(k.view(np.uint16)).view(self.dtype), L.k_norm, eps)
            attn = cupy.empty((T, H, D), dtype=self.dtype)
            ctx.attend(li, q, k, v, attn, cos_sin)
            # row-parallel o and down: each rank's partial sum, one all-reduce each (on the engine's stream: a
            # CUDA graph captured there captures the NCCL calls with the rest of the step)
            o = comm.all_reduce(_linear(sc, attn.reshape(T, q_size), L.o))
            y, residual = sc.rms_norm(o, L.post_norm, eps, residual=residual)
            x = comm.all_reduce(_linear(sc, sc.silu_and_mul(_linear(sc, y, L.gate_up)), L.down))
        y, _ = sc.rms_norm(x, self.norm, eps, residual=residual)
        if ctx.logits_idx is not None:
            y = y.view(np.uint16)[ctx.logits_idx].view(self.dtype)
        logits = sc.linear(y, self.lm_head)  # this rank's vocab_per_rank columns
        if comm.size > 1:  # (size, rows, V') -> (rows, size V'): the ranks' slices side by side
            parts = comm.all_gather(logits)
            logits = cupy.ascontiguousarray(parts.view(np.uint16).transpose(1, 0, 2)).reshape(
                logits.shape[0], -1).view(self.dtype)
        return logits if self.vocab_padded == cfg.vocab_size else logits[:, :cfg.vocab_size]

    def _embed(self, cupy, ids):
        """Embedding rows of ``ids``; vocab-parallel: rows outside this rank's slice are zeros, summed over the
        ranks by an all-reduce."""
        table = self.embed.view(np.uint16)
        if self.comm.size == 1:
            return table[ids].view(self.dtype)
        local = ids - np.int32(self.shard.vocab_start)
        mine = (local >= 0) & (local < self.shard.vocab_rows)
        if self.shard.vocab_rows == 0:  # a vocabulary smaller than the ranks' padded slices
            rows = cupy.zeros((ids.shape[0], self.cfg.hidden_size), np.uint16)
        else:
            rows = table[cupy.where(mine, local, 0)]
            rows = cupy.where(mine[:, None], rows, np.uint16(0))  # +0.0 bits
        return self.comm.all_reduce(cupy.ascontiguousarray(rows).view(self.dtype))


def _linear(sc, x, w, bias=None):
    """``x @ w.T (+ bias)``: speedcore.linear on a float weight, the quantized linear's kernels on a QuantLinear."""
    if isinstance(w, QuantLinear):
        return w(x, bias)
    return sc.linear(x, w, bias)
