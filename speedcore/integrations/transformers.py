"""speedcore inside Hugging Face transformers (5.x) models: an attention implementation and fused modules.

Two independent pieces:

- ``attn_implementation="speedcore"``: :func:`register` (run on import) registers :func:`attention_forward` with
  transformers' ``AttentionInterface`` and :func:`attention_mask` with its ``AttentionMaskInterface``, so
  ``from_pretrained(..., attn_implementation="speedcore")`` or ``model.set_attn_implementation("speedcore")``
  runs every attention layer on speedcore's kernels: causal prefill without padding on ``flash_attn`` (no mask
  tensor at all), padded batches unpadded onto ``flash_attn_varlen``, decode steps (one query per sequence,
  DynamicCache or StaticCache) on ``paged_decode_attention`` over the cache's own memory; GQA without repeat_kv;
  the sliding window, softcap and scaling each layer passes.
- :func:`apply` swaps the decoder layers of a loaded Llama / Mistral / Qwen2 / Qwen3 model (found by duck typing)
  for fused ones: one QKV GEMM (weights concatenated once), RoPE in place by ``rotary_embedding``, the residual
  add fused into the post-attention RMSNorm, a SwiGLU MLP of one gate+up GEMM, ``silu_and_mul`` and the down GEMM;
  RMSNorm and the LM head on speedcore too.

The mask object (:class:`SpeedcoreMask`) is made once per forward (or once per generation step, by ``generate``
for a static cache) and read by every layer: its kinds are documented on the class.  On CPU tensors every op
falls back to a PyTorch reference of the same semantics (:class:`TorchReference`), so the wiring can be tested
without a GPU.  See docs/transformers.md.
"""
from __future__ import annotations

import math
import types

import torch
from torch import nn

import speedcore

__all__ = ["register", "apply", "attention_forward", "attention_mask", "SpeedcoreMask", "SpeedcoreAttention",
           "SpeedcoreMLP", "SpeedcoreRMSNorm", "SpeedcoreLinear", "TorchReference", "ATTN_IMPLEMENTATION"]

ATTN_IMPLEMENTATION = "speedcore"
# paged_decode_attention's head dims; decode steps of other head dims take the varlen path.
DECODE_HEAD_DIMS = (64, 128, 256)
_HALF = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------------- CPU reference

class TorchReference:
    """PyTorch versions of the speedcore ops this module calls, with their semantics (float32 math, one rounding
    to the input dtype), used for CPU tensors: tests exercise the whole integration on CPU with them."""

    @staticmethod
    def rms_norm(x, weight, eps=1e-6, *, residual=None):
        h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
        hf = h.float()
        y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
        return y if residual is None else (y, h)

    @staticmethod
    def linear(x, weight, bias=None):
        return torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)

    @staticmethod
    def silu_and_mul(x):
        d = x.shape[-1] // 2
        xf = x.float()
        return (torch.nn.functional.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)

    @staticmethod
    def rotary_embedding(positions, q, k, cos_sin_cache, *, is_neox=True):
        rot = cos_sin_cache.shape[-1]
        cs = cos_sin_cache[positions.long()].float()  # (*tokens, rot)
        cos, sin = cs[..., None, : rot // 2], cs[..., None, rot // 2:]
        for t in (q, k):
            if t is None:
                continue
            x1, x2 = t[..., : rot // 2].float(), t[..., rot // 2: rot].float()
            r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
            t[..., : rot // 2] = r1.to(t.dtype)
            t[..., rot // 2: rot] = r2.to(t.dtype)
        return q, k

    @staticmethod
    def _dense(q, k, v, ok, scale, softcap):
        """q (..., S, H, D), k/v (..., L, Hk, D), ok (..., S, L) bool: masked attention, zeros where a row sees no
        key (as the kernels)."""
        h, hk = q.shape[-2], k.shape[-2]
        kf = k.float().repeat_interleave(h // hk, dim=-2)
        vf = v.float().repeat_interleave(h // hk, dim=-2)
        s = torch.einsum("...qhd,...khd->...hqk", q.float(), kf) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~ok.unsqueeze(-3), float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        return torch.einsum("...hqk,...khd->...qhd", p, vf).to(q.dtype)

    @staticmethod
    def _visible(i, j, left, right):
        """Key position j seen from (aligned) query position i under flash-attn 2's window rules."""
        ok = torch.ones(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool, device=i.device)
        if left >= 0:
            ok = ok & (j >= i - left)
        if right >= 0:
            ok = ok & (j <= i + right)
        return ok

    @staticmethod
    def flash_attn(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0):
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        left, right = window_size
        right = 0 if causal else right
        s_q, s_k = q.shape[1], k.shape[1]
        i = torch.arange(s_q, device=q.device)[:, None] + (s_k - s_q)  # bottom-right alignment
        j = torch.arange(s_k, device=q.device)[None, :]
        ok = TorchReference._visible(i, j, left, right).expand(q.shape[0], s_q, s_k)
        return TorchReference._dense(q, k, v, ok, scale, softcap)

    @staticmethod
    def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                          softmax_scale=None, window_size=(-1, -1), softcap=0.0):
        # dense over all rows with a same-sequence mask: no host read of cu_seqlens (traceable by torch.compile)
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        left, right = window_size
        right = 0 if causal else right
        cq, ck = cu_seqlens_q.long(), cu_seqlens_k.long()
        rq = torch.arange(q.shape[0], device=q.device)
        rk = torch.arange(k.shape[0], device=q.device)
        seq_q = torch.searchsorted(cq[1:], rq, right=True)
        seq_k = torch.searchsorted(ck[1:], rk, right=True)
        pos_q, pos_k = rq - cq[seq_q], rk - ck[seq_k]
        diag = (ck[1:] - ck[:-1])[seq_q] - (cq[1:] - cq[:-1])[seq_q]
        ok = (seq_q[:, None] == seq_k[None, :]) & TorchReference._visible((pos_q + diag)[:, None], pos_k[None, :],
                                                                          left, right)
        return TorchReference._dense(q, k, v, ok, scale, softcap)

    @staticmethod
    def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, *, softmax_scale=None, softcap=0.0,
                               window_left=-1):
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        batch, n_blocks = block_table.shape
        bs = k_cache.shape[1]
        pages = block_table.long()
        k = k_cache[pages].reshape(batch, n_blocks * bs, *k_cache.shape[2:])
        v = v_cache[pages].reshape(batch, n_blocks * bs, *v_cache.shape[2:])
        t = torch.arange(n_blocks * bs, device=q.device)[None, :]
        n = seq_lens.long()[:, None]
        ok = t < n
        if window_left >= 0:
            ok = ok & (t >= n - 1 - window_left)
        return TorchReference._dense(q[:, None], k, v, ok[:, None, :], scale, softcap)[:, 0]


class _Speedcore:
    """speedcore's functions, looked up once here: speedcore resolves its names lazily (a module import on first
    access), which a torch.compile trace reaching an op for the first time (decode's attention, compiled while
    prefill ran eagerly) should not have to do."""

    rms_norm = staticmethod(speedcore.rms_norm)
    linear = staticmethod(speedcore.linear)
    silu_and_mul = staticmethod(speedcore.silu_and_mul)
    rotary_embedding = staticmethod(speedcore.rotary_embedding)
    flash_attn = staticmethod(speedcore.flash_attn)
    flash_attn_varlen = staticmethod(speedcore.flash_attn_varlen)
    paged_decode_attention = staticmethod(speedcore.paged_decode_attention)


def _ops(x):
    """speedcore for CUDA tensors, the PyTorch reference otherwise."""
    return _Speedcore if x.is_cuda else TorchReference


# ---------------------------------------------------------------------------------------------------------- masks

class SpeedcoreMask:
    """What :func:`attention_mask` hands every attention layer of one forward (transformers passes it through as
    the layer's ``attention_mask``).  ``None`` instead of a mask means: no padding, every key valid, causal
    (queries are the last ``q_length`` keys): ``flash_attn(causal=True)`` on the layer's K/V as they are.

    ``kind``:

    - ``"slice"``: no padding, only the first ``n_keys`` key slots valid (a StaticCache's prefill): flash_attn on
      ``key[:, :, :n_keys]``, a view.
    - ``"paged"`` (one query per sequence): the layer's cache K/V (batch, kv_heads, kv_length, head_dim) read in
      place by ``paged_decode_attention`` as pages of one token: ``block_table[b]`` lists the valid slots of
      sequence b in order, as page ids ``b * kv_heads * kv_length + slot`` of the view
      ``key.as_strided((n_pages, 1, kv_heads, head_dim), (head_dim, head_dim, kv_length * head_dim, 1))``;
      ``seq_lens[b]`` counts them.  Padding (left or anywhere) and a StaticCache's empty slots cost nothing.
    - ``"varlen"``: padded queries (a padded prefill): per sequence, the valid queries and keys are gathered first
      (``q_index``, ``k_index``: (batch, position) pairs of a permutation of all rows, the valid ones first), the
      rest of each sequence becomes an extra sequence of its own (``cu_seqlens_*`` of 2 * batch sequences), so
      every shape is known without reading the mask on the host; ``flash_attn_varlen`` then runs causal, and
      ``q_inverse`` puts its output rows back in place.  Padded query rows get finite values that nothing reads.

    ``ndim`` and ``shape`` (batch, 1, q_length, kv_length) make transformers pass the object through unchanged
    when ``generate`` builds it ahead of a compiled forward.
    """

    ndim = 4

    def __init__(self, kind, batch, q_length, kv_length, **fields):
        self.kind = kind
        self.shape = (batch, 1, q_length, kv_length)
        self.kv_length = kv_length
        self.n_keys = fields.pop("n_keys", kv_length)
        self.kv_heads = fields.pop("kv_heads", 0)
        self.seq_lens = fields.pop("seq_lens", None)
        self.block_table = fields.pop("block_table", None)
        self.q_index = fields.pop("q_index", None)
        self.k_index = fields.pop("k_index", None)
        self.q_inverse = fields.pop("q_inverse", None)
        self.cu_seqlens_q = fields.pop("cu_seqlens_q", None)
        self.cu_seqlens_k = fields.pop("cu_seqlens_k", None)
        if fields:
            raise TypeError(f"SpeedcoreMask: unknown fields {sorted(fields)}")

    def __repr__(self):
        return f"SpeedcoreMask({self.kind!r}, shape={self.shape})"


def _valid_keys(attention_mask, batch, q_length, kv_length, q_offset, kv_offset, device):
    """(batch, kv_length) bool: key slot j holds token ``kv_offset + j`` of the 2D mask, valid where that token
    exists and is not padding; and the (batch, q_length) validity of the queries (the mask's last tokens)."""
    j = torch.arange(kv_length, device=device) + kv_offset
    if attention_mask is None:
        n = q_offset + q_length  # an int, or a StaticCache's length tensor: no host read
        keys = (j < n).expand(batch, kv_length)
        return keys, None
    m = attention_mask.to(device=device, dtype=torch.bool)
    mask_len = m.shape[-1]
    cols = m[:, kv_offset: kv_offset + kv_length]
    if cols.shape[-1] < kv_length:
        cols = torch.nn.functional.pad(cols, (0, kv_length - cols.shape[-1]), value=False)
    q_valid = m[:, mask_len - q_length:] if mask_len >= q_length else None
    return cols, q_valid


def _compacted(valid):
    """(order, counts): per row, the column indices with the valid ones first (in order), and how many."""
    order = torch.sort((~valid).to(torch.uint8), dim=-1, stable=True).indices
    return order, valid.sum(-1)


def _cu_seqlens_with_rest(counts, length):
    """[0, c0, L, L + c1, 2L, ...]: each row's valid part and its rest as two sequences (int32, 2 * batch + 1)."""
    batch = counts.shape[0]
    starts = torch.arange(batch, device=counts.device) * length
    cu = torch.stack((starts, starts + counts), 1).reshape(-1)
    return torch.cat((cu, cu.new_full((1,), batch * length))).to(torch.int32)


def make_mask(attention_mask, batch, q_length, kv_length, q_offset=0, kv_offset=0, *, kv_heads, head_dim,
              device, check_padding=True):
    """The :class:`SpeedcoreMask` (or None) for one forward; see :func:`attention_mask`."""
    keys, q_valid = _valid_keys(attention_mask, batch, q_length, kv_length, q_offset, kv_offset, device)
    if q_length == 1 and head_dim in DECODE_HEAD_DIMS:
        order, counts = _compacted(keys)
        base = torch.arange(batch, device=device)[:, None] * (kv_heads * kv_length)
        return SpeedcoreMask("paged", batch, q_length, kv_length, kv_heads=kv_heads,
                             seq_lens=counts.to(torch.int32), block_table=(order + base).to(torch.int32))
    if check_padding and not torch.compiler.is_compiling():
        # One host read per forward (as transformers' flash-attention mask does): is there any padding?
        if attention_mask is None:
            n = q_offset + q_length
            n = int(n) - kv_offset
            padded = False
        else:
            mask_len = attention_mask.shape[-1]
            n = min(mask_len - kv_offset, kv_length)
            padded = not bool(attention_mask[:, kv_offset: kv_offset + n].all())
        if not padded and n >= q_length:
            if n == kv_length:
                return None
            return SpeedcoreMask("slice", batch, q_length, kv_length, n_keys=n)
    if q_valid is None:
        q_valid = torch.ones(batch, q_length, dtype=torch.bool, device=device)
    q_order, q_counts = _compacted(q_valid)
    k_order, k_counts = _compacted(keys)
    rows_q = torch.arange(batch, device=device)[:, None].expand(batch, q_length).reshape(-1)
    rows_k = torch.arange(batch, device=device)[:, None].expand(batch, kv_length).reshape(-1)
    q_flat = q_order + torch.arange(batch, device=device)[:, None] * q_length
    return SpeedcoreMask("varlen", batch, q_length, kv_length,
                         q_index=(rows_q, q_order.reshape(-1)), k_index=(rows_k, k_order.reshape(-1)),
                         q_inverse=torch.argsort(q_flat.reshape(-1)),
                         cu_seqlens_q=_cu_seqlens_with_rest(q_counts, q_length),
                         cu_seqlens_k=_cu_seqlens_with_rest(k_counts, kv_length))


def _config_dims(config):
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim


def attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask=None, config=None, device=None, **kwargs):
    """transformers' mask function for ``attn_implementation="speedcore"`` (``AttentionMaskInterface``).

    Called once per forward (per mask type: full or sliding layers) with the 2D padding mask; returns None
    (causal, no padding, every key slot valid) or a :class:`SpeedcoreMask`.  The sliding window is not part of
    the mask: each layer passes its own to :func:`attention_forward`.  Other mask functions
    (``or_mask_function`` / ``and_mask_function`` overlays of multimodal models) are not supported.
    """
    if isinstance(attention_mask, SpeedcoreMask):  # built ahead by generate (compileable caches)
        return attention_mask
    if config is None:
        raise ValueError("config: the speedcore mask needs the model config (transformers passes it)")
    if device is None:
        device = attention_mask.device if attention_mask is not None else "cpu"
    kv_heads, head_dim = _config_dims(config.get_text_config() if hasattr(config, "get_text_config") else config)
    return make_mask(attention_mask, batch_size, q_length, kv_length, q_offset, kv_offset, kv_heads=kv_heads,
                     head_dim=head_dim, device=device)


# ------------------------------------------------------------------------------------------------------ attention

def attend(q, key, value, mask, scale, window_left, softcap):
    """q (batch, q_len, heads, head_dim) (any strides with a contiguous last dim); key/value (batch, kv_heads,
    kv_len, head_dim) as transformers' caches return them.  Returns (batch, q_len, heads, head_dim)."""
    ops = _ops(q)
    if mask is None:
        return ops.flash_attn(q, key.transpose(1, 2), value.transpose(1, 2), causal=True, softmax_scale=scale,
                              window_size=(window_left, -1), softcap=softcap)
    kind = mask.kind
    if kind == "paged":
        batch, kv_heads, kv_len, head_dim = key.shape
        if kv_heads != mask.kv_heads or kv_len != mask.kv_length:
            raise ValueError(f"key: shape {tuple(key.shape)} does not match the mask's {mask.kv_heads} KV heads x "
                             f"{mask.kv_length} slots (config.num_key_value_heads / the cache's length)")
        if not key.is_contiguous():
            key = key.contiguous()
        if not value.is_contiguous():
            value = value.contiguous()
        n_pages = (batch - 1) * kv_heads * kv_len + kv_len
        size, stride = (n_pages, 1, kv_heads, head_dim), (head_dim, head_dim, kv_len * head_dim, 1)
        out = ops.paged_decode_attention(q[:, 0], key.as_strided(size, stride), value.as_strided(size, stride),
                                         mask.block_table, mask.seq_lens, softmax_scale=scale, softcap=softcap,
                                         window_left=window_left)
        return out.unsqueeze(1)
    if kind == "slice":
        n = mask.n_keys
        return ops.flash_attn(q, key.transpose(1, 2)[:, :n], value.transpose(1, 2)[:, :n], causal=True,
                              softmax_scale=scale, window_size=(window_left, -1), softcap=softcap)
    # varlen: gather the valid rows first (one gather each), attend, put the rows back
    batch, q_len, heads, head_dim = q.shape
    kv_len = key.shape[2]
    if mask.shape[2] != q_len or mask.kv_length != kv_len:
        raise ValueError(f"q, key: {q_len} queries x {kv_len} keys do not match the mask's {mask.shape}")
    qb, qs = mask.q_index
    kb, ks = mask.k_index
    kt, vt = key.transpose(1, 2), value.transpose(1, 2)
    out = ops.flash_attn_varlen(q[qb, qs], kt[kb, ks], vt[kb, ks], mask.cu_seqlens_q, mask.cu_seqlens_k, q_len,
                                kv_len, causal=True, softmax_scale=scale, window_size=(window_left, -1),
                                softcap=softcap)
    return out.index_select(0, mask.q_inverse).view(batch, q_len, heads, head_dim)


def _window_left(sliding_window):
    # transformers' sliding window: key j is seen from query i when i - j < sliding_window
    return int(sliding_window) - 1 if sliding_window else -1


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, **kwargs):
    """``AttentionInterface`` function for ``attn_implementation="speedcore"``.

    query (batch, heads, q_len, head_dim), key/value (batch, kv_heads, kv_len, head_dim), as transformers' attention
    modules pass them (read through transposed views, never copied, except by a padded prefill's gather);
    ``attention_mask`` from :func:`attention_mask`.  Returns ((batch, q_len, heads, head_dim), None).
    """
    if dropout:
        raise ValueError(f"dropout: speedcore attention is inference-only, got dropout={dropout}")
    if is_causal is False or not getattr(module, "is_causal", True):
        raise ValueError("is_causal: speedcore attention implements causal (decoder) attention only")
    if kwargs.get("s_aux") is not None:
        raise ValueError("s_aux: attention sinks are not supported by speedcore attention")
    if query.is_cuda and query.dtype not in _HALF:
        raise TypeError(f"query: speedcore attention runs float16 / bfloat16, got {query.dtype} (load the model "
                        f"with dtype=torch.bfloat16)")
    if attention_mask is not None and not isinstance(attention_mask, SpeedcoreMask):
        raise TypeError(f"attention_mask: expected the mask of attn_implementation='speedcore' (or None), got "
                        f"{type(attention_mask).__name__}")
    if sliding_window is None:
        sliding_window = getattr(module, "sliding_window", None)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = attend(query.transpose(1, 2), key, value, attention_mask, scale, _window_left(sliding_window),
                 float(softcap or 0.0))
    return out, None


_REGISTERED = False


def register() -> None:
    """Register ``"speedcore"`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``
    (idempotent; importing this module does it)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, attention_mask)
    _REGISTERED = True


# -------------------------------------------------------------------------------------------------------- modules

def _param(t):
    return nn.Parameter(t, requires_grad=False)


class SpeedcoreRMSNorm(nn.Module):
    """RMSNorm on speedcore's kernel; ``forward(x, residual)`` returns (norm(x + residual), x + residual).  Holds
    the replaced module's weight Parameter itself (no copy)."""

    def __init__(self, weight, eps):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else _param(weight)
        self.variance_epsilon = float(eps)

    @classmethod
    def from_hf(cls, norm):
        return cls(norm.weight, norm.variance_epsilon)

    def forward(self, x, residual=None):
        if residual is None:
            return _ops(x).rms_norm(x, self.weight, self.variance_epsilon)
        return _ops(x).rms_norm(x, self.weight, self.variance_epsilon, residual=residual)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class SpeedcoreLinear(nn.Module):
    """``speedcore.linear`` with the replaced ``nn.Linear``'s own weight and bias Parameters (shared, so tied
    embeddings stay tied)."""

    def __init__(self, weight, bias=None):
        super().__init__()
        self.weight = weight
        self.bias = bias

    @classmethod
    def from_hf(cls, linear):
        return cls(linear.weight, linear.bias)

    def forward(self, x):
        return _ops(x).linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, bias={self.bias is not None}"


def _cat_weights(linears):
    """One (sum N, K) weight (and bias) from Linears of the same input; each source Parameter is released as
    soon as it is copied, so the peak is one extra copy of one source, not of the whole set."""
    weight = torch.cat([lin.weight.detach() for lin in linears], 0)
    biases = [lin.bias for lin in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else weight.new_zeros(lin.weight.shape[0])
                          for b, lin in zip(biases, linears)])
    return _param(weight), (_param(bias) if bias is not None else None)


class SpeedcoreMLP(nn.Module):
    """SwiGLU MLP: ``down(silu_and_mul(x @ [gate; up]^T))``: one GEMM for gate and up (their weights concatenated
    once into ``gate_up_weight``, rows [0, I) gate, [I, 2I) up), ``silu_and_mul``, then the down GEMM."""

    def __init__(self, gate_up_weight, gate_up_bias, down_weight, down_bias):
        super().__init__()
        self.gate_up_weight = gate_up_weight
        self.gate_up_bias = gate_up_bias
        self.down_weight = down_weight
        self.down_bias = down_bias

    def extra_repr(self):
        return f"gate_up_weight={tuple(self.gate_up_weight.shape)}, down_weight={tuple(self.down_weight.shape)}"

    @classmethod
    def from_hf(cls, mlp):
        w, b = _cat_weights([mlp.gate_proj, mlp.up_proj])
        return cls(w, b, mlp.down_proj.weight, mlp.down_proj.bias)

    def forward(self, x):
        ops = _ops(x)
        return ops.linear(ops.silu_and_mul(ops.linear(x, self.gate_up_weight, self.gate_up_bias)), self.down_weight,
                          self.down_bias)


def rope_table(rotary_emb, max_positions, device):
    """float32 (max_positions, rot_dim) ``[cos(p f), sin(p f)] * attention_scaling`` from a transformers rotary
    embedding module (its ``inv_freq``, computed as transformers does: fp32 products, no bf16 rounding)."""
    inv_freq = rotary_emb.inv_freq.detach().to(device=device, dtype=torch.float32)
    scaling = float(getattr(rotary_emb, "attention_scaling", 1.0))
    freqs = torch.arange(max_positions, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1).contiguous()


def _static_rope(rotary_emb) -> bool:
    """Rope types whose inv_freq never changes with the sequence length (dynamic NTK and longrope do)."""
    rope_type = str(getattr(rotary_emb, "rope_type", "default"))
    return hasattr(rotary_emb, "inv_freq") and "dynamic" not in rope_type and "longrope" not in rope_type


class SpeedcoreAttention(nn.Module):
    """Llama-family self-attention: one QKV GEMM (``qkv_weight`` = [q; k; v] rows, bias likewise), optional
    per-head q/k RMSNorm (Qwen3), RoPE in place on the GEMM's output (``rotary_embedding`` with a float32 table
    of ``max_positions`` positions) or transformers' ``apply_rotary_pos_emb`` for rope types that change with the
    length, the cache update, :func:`attend`, and the output GEMM.  Everything the forward needs per call is an
    attribute set once here."""

    def __init__(self, attn, config, rope_cos_sin):
        super().__init__()
        kv_heads, head_dim = _config_dims(config)
        self.layer_idx = attn.layer_idx
        self.heads = config.num_attention_heads
        self.kv_heads = kv_heads
        self.head_dim = attn.head_dim if hasattr(attn, "head_dim") else head_dim
        self.q_width = self.heads * self.head_dim
        self.split_heads = (self.heads, self.kv_heads, self.kv_heads)
        self.kv_width = self.kv_heads * self.head_dim
        self.scaling = float(attn.scaling)
        sliding = getattr(attn, "sliding_window", getattr(config, "sliding_window", None))
        self.window_left = _window_left(sliding)
        self.softcap = float(getattr(attn, "attn_logit_softcapping", None) or getattr(config, "attn_logit_softcapping",
                                                                                        None) or 0.0)
        self.is_causal = True
        self.qkv_weight, self.qkv_bias = _cat_weights([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_weight, self.o_bias = attn.o_proj.weight, attn.o_proj.bias
        self.q_norm = SpeedcoreRMSNorm.from_hf(attn.q_norm) if getattr(attn, "q_norm", None) is not None else None
        self.k_norm = SpeedcoreRMSNorm.from_hf(attn.k_norm) if getattr(attn, "k_norm", None) is not None else None
        self.rope_cos_sin = rope_cos_sin  # shared by all layers; a plain attribute (not a buffer: no 32 copies)

    def extra_repr(self):
        rope = "table" if self.rope_cos_sin is not None else "transformers"
        return (f"heads={self.heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, qkv_weight="
                f"{tuple(self.qkv_weight.shape)}, window_left={self.window_left}, softcap={self.softcap}, rope={rope}, "
                f"qk_norm={self.q_norm is not None}")

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                cache=None, position_ids=None, **kwargs):
        ops = _ops(hidden_states)
        batch, q_len = hidden_states.shape[0], hidden_states.shape[1]
        hd = self.head_dim
        qkv = ops.linear(hidden_states, self.qkv_weight, self.qkv_bias)
        # views of the one GEMM output: (batch, q_len, heads, head_dim) with the token stride of the fused row
        q, k, v = qkv.view(batch, q_len, self.heads + 2 * self.kv_heads, hd).split(self.split_heads, 2)
        if self.q_norm is not None:  # per-head norms over views that do not collapse to rows: one copy each
            # (rows, head_dim): reshape copies whenever the rows have no single stride (always, but at batch 1)
            q = self.q_norm(q.reshape(-1, hd)).view(batch, q_len, self.heads, hd)
            k = self.k_norm(k.reshape(-1, hd)).view(batch, q_len, self.kv_heads, hd)
        if self.rope_cos_sin is not None:
            if position_ids.shape[0] != batch:
                position_ids = position_ids.expand(batch, q_len).contiguous()
            ops.rotary_embedding(position_ids, q, k, self.rope_cos_sin)
        else:
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

            cos, sin = position_embeddings
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
        cache = cache if cache is not None else past_key_values
        key, value = k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        out = attend(q, key, value, attention_mask, self.scaling, self.window_left, self.softcap)
        return ops.linear(out.reshape(batch, q_len, self.q_width), self.o_weight, self.o_bias), None


def _fused_decoder_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                           use_cache=False, position_embeddings=None, cache=None, **kwargs):
    """A Llama-family decoder layer with the residual add fused into the post-attention RMSNorm."""
    # the cache under the name the attention module takes: transformers renamed past_key_values to cache in 5.2x
    kwargs[self._speedcore_cache_kwarg] = cache if cache is not None else past_key_values
    # Our own submodules are called through .forward: nn.Module.__call__ costs a few us of host time per call,
    # and nothing hooks them (transformers records outputs on its own layer and attention classes).
    attn = self.self_attn
    attn_out = (attn.forward if type(attn) is SpeedcoreAttention else attn)(
        self.input_layernorm.forward(hidden_states), position_embeddings=position_embeddings,
        attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache, **kwargs)[0]
    normed, residual = self.post_attention_layernorm.forward(attn_out, residual=hidden_states)
    mlp = self.mlp
    return residual + (mlp.forward(normed) if type(mlp) is SpeedcoreMLP else mlp(normed))


def _cache_kwarg(attn) -> str:
    if isinstance(attn, SpeedcoreAttention):
        return "cache"
    import inspect

    params = inspect.signature(type(attn).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _is_llama_rmsnorm(m) -> bool:
    # Llama / Mistral / Qwen2 / Qwen3 RMSNorm: weight * x / rms(x) with `variance_epsilon`; Gemma's (1 + weight)
    # norms keep `eps` and are left alone.
    name = type(m).__name__
    return (name.endswith("RMSNorm") and "Gemma" not in name and hasattr(m, "variance_epsilon")
            and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 1
            and getattr(m, "bias", None) is None)


def _is_swiglu_mlp(m) -> bool:
    act = getattr(m, "act_fn", None)
    return (all(isinstance(getattr(m, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
            and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"))


def _is_llama_attention(m) -> bool:
    return (all(isinstance(getattr(m, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
            and hasattr(m, "layer_idx") and hasattr(m, "scaling")
            and not getattr(m, "attn_logit_softcapping", None))


_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


def _is_llama_decoder_layer(m) -> bool:
    children = {n for n, _ in m.named_children()}
    return (children == _LAYER_CHILDREN and _is_llama_attention(m.self_attn) and _is_swiglu_mlp(m.mlp)
            and _is_llama_rmsnorm(m.input_layernorm) and _is_llama_rmsnorm(m.post_attention_layernorm))


def _find_rotary(model):
    for m in model.modules():
        if type(m).__name__.endswith("RotaryEmbedding") and hasattr(m, "inv_freq"):
            return m
    return None


def apply(model, *, attention=True, mlp=True, norms=True, lm_head=True, max_positions=None):
    """Put speedcore's fused modules into a loaded transformers model, in place, and return it.

    Decoder layers shaped like Llama's (Llama, Mistral, Qwen2, Qwen3; found by their modules, not their class
    names: q/k/v/o and gate/up/down ``nn.Linear``s, SiLU, Llama-style RMSNorms) get:

    - ``attention``: :class:`SpeedcoreAttention` (fused QKV GEMM, RoPE in place, cache update, :func:`attend`) and
      ``attn_implementation="speedcore"`` for the model (its mask function);
    - ``mlp``: :class:`SpeedcoreMLP` (gate and up concatenated);
    - ``norms``: :class:`SpeedcoreRMSNorm` for every Llama-style RMSNorm, and the decoder layer's forward with the
      residual add fused into the post-attention norm (where the layer is Llama-shaped);
    - ``lm_head``: :class:`SpeedcoreLinear` sharing the head's weight.

    Weights: the concatenated QKV and gate/up weights are new tensors and the original q/k/v/gate/up Parameters
    are dropped with their modules (freed as each layer is converted: no second copy stays in GPU memory); every
    other weight is the original Parameter, shared.  The state dict therefore has ``self_attn.qkv_weight`` and
    ``mlp.gate_up_weight`` in place of the separate projections: save checkpoints from an unconverted model.
    ``max_positions`` (default ``config.max_position_embeddings``) sizes the RoPE table; positions past it are
    clamped by the kernel.  Call after moving the model to its GPU and dtype (fp16 / bf16).
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point() and p.is_cuda}
    if not dtypes <= set(_HALF):  # (CPU models run the PyTorch reference ops in any dtype)
        raise TypeError(f"model: speedcore runs float16 / bfloat16 models, this one has {sorted(map(str, dtypes))} "
                        f"parameters (load it with dtype=torch.bfloat16)")
    register()
    rope = None
    rotary = _find_rotary(model)
    if attention and rotary is not None and _static_rope(rotary):
        n = int(max_positions or getattr(config, "max_position_embeddings", 0) or 8192)
        rope = rope_table(rotary, n, rotary.inv_freq.device)
    layers = [m for m in model.modules() if _is_llama_decoder_layer(m)]
    for layer in layers:
        if attention:
            old = layer.self_attn
            layer.self_attn = SpeedcoreAttention(old, config, rope)
            del old
        if mlp:
            old = layer.mlp
            layer.mlp = SpeedcoreMLP.from_hf(old)
            del old
        if norms:
            layer.input_layernorm = SpeedcoreRMSNorm.from_hf(layer.input_layernorm)
            layer.post_attention_layernorm = SpeedcoreRMSNorm.from_hf(layer.post_attention_layernorm)
            layer._speedcore_cache_kwarg = _cache_kwarg(layer.self_attn)
            layer.forward = types.MethodType(_fused_decoder_forward, layer)
    if norms:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if _is_llama_rmsnorm(child):
                    setattr(parent, name, SpeedcoreRMSNorm.from_hf(child))
    if lm_head:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if isinstance(head, nn.Linear):
            model.set_output_embeddings(SpeedcoreLinear.from_hf(head))
    if attention and layers:
        if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return model


register()
