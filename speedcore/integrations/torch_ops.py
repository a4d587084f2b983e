"""``torch.ops.speedcore.*``: every public function as a torch.library op, for torch.compile and CUDA graphs.

Importing this module registers the ops once per process (``torch.library.Library("speedcore", "DEF")``
definitions, a CUDA kernel that calls the speedcore function, and a fake implementation that gives the exact
output shapes, dtypes and strides), and fills ``speedcore._torch_hook.OPS``: there, for each public function, a
callable with the public signature that calls these ops.  The public functions call it themselves while
torch.compile traces them, so users never need to import this module.

Schemas: optional arguments map to ``?`` types with the public defaults; arguments that are written are
declared ``Tensor(a!)``.  A call with ``out=`` maps to a separate ``*_out`` op that writes ``out`` and returns
nothing (or only new tensors: the ``h`` of the fused add, the lse), since a mutating op must not return what it
mutates; ``out`` is positional, because dynamo graph-breaks on an op called with a non-contiguous ``out=`` keyword
(its rule for torch's out= variants, which may resize).  Each public function whose result count depends on a flag (``residual``, ``return_lse``) maps to one op
per case, so that every op has a fixed result type.

The Library path is used rather than ``torch.library.custom_op`` for its host cost: ``custom_op`` adds ~10 us
per eager call.  The dispatcher's trip through a Python kernel still costs several microseconds (8 us measured
on a busy CPU), also in a compiled graph, which calls the op the same way; CUDA graphs (``mode="reduce-overhead"``)
replay the launches without it.  Eager code should call the speedcore functions themselves.
"""
from __future__ import annotations

import torch

import speedcore
from speedcore import _torch_hook

NAMESPACE = "speedcore"

_ATTN_KW = "bool causal=False, float? softmax_scale=None, int[2] window_size=[-1, -1], float softcap=0.0"
_VARLEN_ARGS = ("Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
                "SymInt max_seqlen_k")
_PREFILL_ARGS = ("Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor seqused_k, Tensor block_table, "
                 "SymInt max_seqlen_q, SymInt max_seqlen_k")
_PREFILL_KW = _ATTN_KW.replace("causal=False", "causal=True")
_DECODE_ARGS = "Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens"
_DECODE_KW = "float? softmax_scale=None, float softcap=0.0, int window_left=-1"

# op name -> schema (without the name).  Returns: "()" for ops that only write their (a!) arguments.
SCHEMAS = {
    "rms_norm": "(Tensor x, Tensor weight, float eps=1e-06) -> Tensor",
    "rms_norm_out": "(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()",
    "add_rms_norm": "(Tensor x, Tensor residual, Tensor weight, float eps=1e-06) -> (Tensor, Tensor)",
    "add_rms_norm_out": "(Tensor x, Tensor residual, Tensor weight, float eps, Tensor(a!) out) -> Tensor",
    "add_rms_norm_residual_out": "(Tensor x, Tensor residual, Tensor weight, float eps, Tensor(a!) residual_out) "
                                 "-> Tensor",
    "add_rms_norm_out_residual_out": "(Tensor x, Tensor residual, Tensor weight, float eps, Tensor(a!) out, "
                                     "Tensor(b!) residual_out) -> ()",
    "flash_attn": f"(Tensor q, Tensor k, Tensor v, *, {_ATTN_KW}) -> Tensor",
    "flash_attn_lse": f"(Tensor q, Tensor k, Tensor v, *, {_ATTN_KW}) -> (Tensor, Tensor)",
    "flash_attn_out": f"(Tensor q, Tensor k, Tensor v, Tensor(a!) out, *, {_ATTN_KW}) -> ()",
    "flash_attn_lse_out": f"(Tensor q, Tensor k, Tensor v, Tensor(a!) out, *, {_ATTN_KW}) -> Tensor",
    "flash_attn_varlen": f"({_VARLEN_ARGS}, *, {_ATTN_KW}) -> Tensor",
    "flash_attn_varlen_lse": f"({_VARLEN_ARGS}, *, {_ATTN_KW}) -> (Tensor, Tensor)",
    "flash_attn_varlen_out": f"({_VARLEN_ARGS}, Tensor(a!) out, *, {_ATTN_KW}) -> ()",
    "flash_attn_varlen_lse_out": f"({_VARLEN_ARGS}, Tensor(a!) out, *, {_ATTN_KW}) -> Tensor",
    "paged_prefill_attention": f"({_PREFILL_ARGS}, *, {_PREFILL_KW}) -> Tensor",
    "paged_prefill_attention_lse": f"({_PREFILL_ARGS}, *, {_PREFILL_KW}) -> (Tensor, Tensor)",
    "paged_prefill_attention_out": f"({_PREFILL_ARGS}, Tensor(a!) out, *, {_PREFILL_KW}) -> ()",
    "paged_prefill_attention_lse_out": f"({_PREFILL_ARGS}, Tensor(a!) out, *, {_PREFILL_KW}) -> Tensor",
    "matmul": "(Tensor a, Tensor b) -> Tensor",
    "matmul_out": "(Tensor a, Tensor b, Tensor(a!) out) -> ()",
    "linear": "(Tensor x, Tensor weight, Tensor? bias=None, *, str? activation=None) -> Tensor",
    "linear_out": "(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out, *, str? activation=None) -> ()",
    "awq_linear": "(Tensor x, Tensor qweight, Tensor qzeros, Tensor scales, *, int group_size=128, "
                  "Tensor? bias=None) -> Tensor",
    "gptq_linear": "(Tensor x, Tensor qweight, Tensor qzeros, Tensor scales, Tensor? g_idx=None, *, "
                   "int group_size=128, Tensor? bias=None) -> Tensor",
    "int8_linear": "(Tensor x, Tensor weight, Tensor scales, *, Tensor? bias=None) -> Tensor",
    "paged_decode_attention": f"({_DECODE_ARGS}, *, {_DECODE_KW}) -> Tensor",
    "paged_decode_attention_lse": f"({_DECODE_ARGS}, *, {_DECODE_KW}) -> (Tensor, Tensor)",
    "paged_decode_attention_out": f"({_DECODE_ARGS}, Tensor(a!) out, *, {_DECODE_KW}) -> ()",
    "paged_decode_attention_lse_out": f"({_DECODE_ARGS}, Tensor(a!) out, *, {_DECODE_KW}) -> Tensor",
    "reshape_and_cache": "(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()",
    "rotary_embedding": "(Tensor positions, Tensor(a!) q, Tensor(b!)? k, Tensor cos_sin_cache, *, "
                        "bool is_neox=True) -> ()",
    "silu_and_mul": "(Tensor x) -> Tensor",
    "silu_and_mul_out": "(Tensor x, Tensor(a!) out) -> ()",
    "gelu_and_mul": "(Tensor x) -> Tensor",
    "gelu_and_mul_out": "(Tensor x, Tensor(a!) out) -> ()",
}


# ---- CUDA kernels: the speedcore functions (defaults repeated: the dispatcher passes only given keywords) ----

def _rms_norm(x, weight, eps=1e-6):
    return speedcore.rms_norm(x, weight, eps)


def _rms_norm_out(x, weight, eps, out):
    speedcore.rms_norm(x, weight, eps, out=out)


def _add_rms_norm(x, residual, weight, eps=1e-6):
    return speedcore.rms_norm(x, weight, eps, residual=residual)


def _add_rms_norm_out(x, residual, weight, eps, out):
    return speedcore.rms_norm(x, weight, eps, residual=residual, out=out)[1]


def _add_rms_norm_residual_out(x, residual, weight, eps, residual_out):
    return speedcore.rms_norm(x, weight, eps, residual=residual, residual_out=residual_out)[0]


def _add_rms_norm_out_residual_out(x, residual, weight, eps, out, residual_out):
    speedcore.rms_norm(x, weight, eps, residual=residual, out=out, residual_out=residual_out)


def _attention_kernels(public_name, causal_default=False):
    """The four kernels of one attention function: plain, with lse, into out, with lse into out."""
    def public(*args, **kw):  # looked up per call: importing this module imports no kernel module
        return getattr(speedcore, public_name)(*args, **kw)

    def kernel(*args, causal=causal_default, softmax_scale=None, window_size=(-1, -1), softcap=0.0):
        return public(*args, causal=causal, softmax_scale=softmax_scale, window_size=tuple(window_size),
                      softcap=softcap)

    def kernel_lse(*args, causal=causal_default, softmax_scale=None, window_size=(-1, -1), softcap=0.0):
        return tuple(public(*args, causal=causal, softmax_scale=softmax_scale, window_size=tuple(window_size),
                            softcap=softcap, return_lse=True))

    def kernel_out(*args, causal=causal_default, softmax_scale=None, window_size=(-1, -1), softcap=0.0):
        *args, out = args
        public(*args, causal=causal, softmax_scale=softmax_scale, window_size=tuple(window_size), softcap=softcap,
               out=out)

    def kernel_lse_out(*args, causal=causal_default, softmax_scale=None, window_size=(-1, -1), softcap=0.0):
        *args, out = args
        return public(*args, causal=causal, softmax_scale=softmax_scale, window_size=tuple(window_size),
                      softcap=softcap, return_lse=True, out=out)[1]

    return kernel, kernel_lse, kernel_out, kernel_lse_out


def _matmul(a, b):
    return speedcore.matmul(a, b)


def _matmul_out(a, b, out):
    speedcore.matmul(a, b, out=out)


def _linear(x, weight, bias=None, *, activation=None):
    return speedcore.linear(x, weight, bias, activation=activation)


def _linear_out(x, weight, bias, out, *, activation=None):
    speedcore.linear(x, weight, bias, activation=activation, out=out)


def _awq_linear(x, qweight, qzeros, scales, *, group_size=128, bias=None):
    return speedcore.awq_linear(x, qweight, qzeros, scales, group_size=group_size, bias=bias)


def _gptq_linear(x, qweight, qzeros, scales, g_idx=None, *, group_size=128, bias=None):
    return speedcore.gptq_linear(x, qweight, qzeros, scales, g_idx, group_size=group_size, bias=bias)


def _int8_linear(x, weight, scales, *, bias=None):
    return speedcore.int8_linear(x, weight, scales, bias=bias)


def _decode(q, k_cache, v_cache, block_table, seq_lens, *, softmax_scale=None, softcap=0.0, window_left=-1):
    return speedcore.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, softmax_scale=softmax_scale,
                                            softcap=softcap, window_left=window_left)


def _decode_lse(q, k_cache, v_cache, block_table, seq_lens, *, softmax_scale=None, softcap=0.0, window_left=-1):
    return tuple(speedcore.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens,
                                                  softmax_scale=softmax_scale, softcap=softcap,
                                                  window_left=window_left, return_lse=True))


def _decode_out(q, k_cache, v_cache, block_table, seq_lens, out, *, softmax_scale=None, softcap=0.0,
                window_left=-1):
    speedcore.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, softmax_scale=softmax_scale,
                                     softcap=softcap, window_left=window_left, out=out)


def _decode_lse_out(q, k_cache, v_cache, block_table, seq_lens, out, *, softmax_scale=None, softcap=0.0,
                    window_left=-1):
    return speedcore.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, softmax_scale=softmax_scale,
                                            softcap=softcap, window_left=window_left, out=out, return_lse=True)[1]


def _reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    speedcore.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)


def _rotary_embedding(positions, q, k, cos_sin_cache, *, is_neox=True):
    speedcore.rotary_embedding(positions, q, k, cos_sin_cache, is_neox=is_neox)


def _silu_and_mul(x):
    return speedcore.silu_and_mul(x)


def _silu_and_mul_out(x, out):
    speedcore.silu_and_mul(x, out=out)


def _gelu_and_mul(x):
    return speedcore.gelu_and_mul(x)


def _gelu_and_mul_out(x, out):
    speedcore.gelu_and_mul(x, out=out)


_flash, _flash_lse, _flash_out, _flash_lse_out = _attention_kernels("flash_attn")
_varlen, _varlen_lse, _varlen_out, _varlen_lse_out = _attention_kernels("flash_attn_varlen")
_prefill, _prefill_lse, _prefill_out, _prefill_lse_out = _attention_kernels("paged_prefill_attention", True)

KERNELS = {
    "rms_norm": _rms_norm, "rms_norm_out": _rms_norm_out,
    "add_rms_norm": _add_rms_norm, "add_rms_norm_out": _add_rms_norm_out,
    "add_rms_norm_residual_out": _add_rms_norm_residual_out,
    "add_rms_norm_out_residual_out": _add_rms_norm_out_residual_out,
    "flash_attn": _flash, "flash_attn_lse": _flash_lse, "flash_attn_out": _flash_out,
    "flash_attn_lse_out": _flash_lse_out,
    "flash_attn_varlen": _varlen, "flash_attn_varlen_lse": _varlen_lse, "flash_attn_varlen_out": _varlen_out,
    "flash_attn_varlen_lse_out": _varlen_lse_out,
    "paged_prefill_attention": _prefill, "paged_prefill_attention_lse": _prefill_lse,
    "paged_prefill_attention_out": _prefill_out, "paged_prefill_attention_lse_out": _prefill_lse_out,
    "matmul": _matmul, "matmul_out": _matmul_out, "linear": _linear, "linear_out": _linear_out,
    "awq_linear": _awq_linear, "gptq_linear": _gptq_linear, "int8_linear": _int8_linear,
    "paged_decode_attention": _decode, "paged_decode_attention_lse": _decode_lse,
    "paged_decode_attention_out": _decode_out, "paged_decode_attention_lse_out": _decode_lse_out,
    "reshape_and_cache": _reshape_and_cache, "rotary_embedding": _rotary_embedding,
    "silu_and_mul": _silu_and_mul, "silu_and_mul_out": _silu_and_mul_out,
    "gelu_and_mul": _gelu_and_mul, "gelu_and_mul_out": _gelu_and_mul_out,
}


# ---- fake (meta) implementations: the real ops return new contiguous tensors ----

def _new(ref, shape, dtype=None):
    return ref.new_empty(tuple(shape), dtype=ref.dtype if dtype is None else dtype)


def _fake_rms_norm(x, weight, eps=1e-6):
    return _new(x, x.shape)


def _fake_add_rms_norm(x, residual, weight, eps=1e-6):
    return _new(x, x.shape), _new(x, x.shape)


def _fake_add_rms_norm_out(x, residual, weight, eps, out):  # h; also add_rms_norm_residual_out's y
    return _new(x, x.shape)


def _fake_flash_lse(q, *args, **kw):
    return _new(q, q.shape), _new(q, (q.shape[0], q.shape[2], q.shape[1]), torch.float32)


def _fake_varlen_lse(q, *args, **kw):  # also paged prefill's: q (total_q, heads, head_dim)
    return _new(q, q.shape), _new(q, (q.shape[1], q.shape[0]), torch.float32)


def _fake_linear(x, weight, bias=None, *, activation=None):
    return _new(x, tuple(x.shape[:-1]) + (weight.shape[0],))


def _fake_awq_linear(x, qweight, qzeros, scales, *, group_size=128, bias=None):
    return _new(x, tuple(x.shape[:-1]) + (qweight.shape[1] * 8,))


def _fake_gptq_linear(x, qweight, qzeros, scales, g_idx=None, *, group_size=128, bias=None):
    return _new(x, tuple(x.shape[:-1]) + (qweight.shape[1],))


def _fake_decode_lse(q, *args, **kw):
    return _new(q, q.shape), _new(q, q.shape[:2], torch.float32)


def _fake_gated(x):
    return _new(x, tuple(x.shape[:-1]) + (x.shape[-1] // 2,))


def _writes_only(*args, **kw):
    return None


FAKES = {
    "rms_norm": _fake_rms_norm, "rms_norm_out": _writes_only,
    "add_rms_norm": _fake_add_rms_norm, "add_rms_norm_out": _fake_add_rms_norm_out,
    "add_rms_norm_residual_out": _fake_add_rms_norm_out, "add_rms_norm_out_residual_out": _writes_only,
    "flash_attn": lambda q, k, v, **kw: _new(q, q.shape), "flash_attn_lse": _fake_flash_lse,
    "flash_attn_out": _writes_only, "flash_attn_lse_out": lambda q, *args, **kw: _fake_flash_lse(q)[1],
    "flash_attn_varlen": lambda q, *args, **kw: _new(q, q.shape), "flash_attn_varlen_lse": _fake_varlen_lse,
    "flash_attn_varlen_out": _writes_only,
    "flash_attn_varlen_lse_out": lambda q, *args, **kw: _fake_varlen_lse(q)[1],
    "paged_prefill_attention": lambda q, *args, **kw: _new(q, q.shape), "paged_prefill_attention_lse": _fake_varlen_lse,
    "paged_prefill_attention_out": _writes_only,
    "paged_prefill_attention_lse_out": lambda q, *args, **kw: _fake_varlen_lse(q)[1],
    "matmul": lambda a, b: _new(a, (a.shape[0], b.shape[1])), "matmul_out": _writes_only,
    "linear": _fake_linear, "linear_out": _writes_only,
    "awq_linear": _fake_awq_linear, "gptq_linear": _fake_gptq_linear,
    "int8_linear": lambda x, weight, scales, *, bias=None: _new(x, tuple(x.shape[:-1]) + (weight.shape[0],)),
    "paged_decode_attention": lambda q, *args, **kw: _new(q, q.shape),
    "paged_decode_attention_lse": _fake_decode_lse,
    "paged_decode_attention_out": _writes_only,
    "paged_decode_attention_lse_out": lambda q, *args, **kw: _fake_decode_lse(q)[1],
    "reshape_and_cache": _writes_only, "rotary_embedding": _writes_only,
    "silu_and_mul": _fake_gated, "silu_and_mul_out": _writes_only,
    "gelu_and_mul": _fake_gated, "gelu_and_mul_out": _writes_only,
}


# ---- what the public functions call while torch.compile traces: their signatures, these ops ----

ops = torch.ops.speedcore


def rms_norm(x, weight, eps: float = 1e-6, *, residual=None, out=None, residual_out=None, **private):
    _no_private(private)
    if residual is None:
        if residual_out is not None:
            raise ValueError("residual_out: needs residual")
        if out is None:
            return ops.rms_norm(x, weight, eps)
        ops.rms_norm_out(x, weight, eps, out)
        return out
    if residual_out is None:
        if out is None:
            return ops.add_rms_norm(x, residual, weight, eps)
        return out, ops.add_rms_norm_out(x, residual, weight, eps, out)
    if out is None:
        return ops.add_rms_norm_residual_out(x, residual, weight, eps, residual_out), residual_out
    ops.add_rms_norm_out_residual_out(x, residual, weight, eps, out, residual_out)
    return out, residual_out


def _no_private(private):
    """The public functions' private keywords (test and tuning knobs such as _path) are not in the schemas: they are
    accepted at their defaults (None), so the host path can pass them on."""
    given = sorted(k for k, v in private.items() if v is not None)
    if given or any(not k.startswith("_") for k in private):
        raise NotImplementedError(f"{sorted(private)}: not part of the torch.ops.speedcore schemas (torch.compile "
                                  f"traces the public arguments only)")


def _attention(op, op_lse, op_out, op_lse_out, args, return_lse, out, kw):
    if out is None:
        return op_lse(*args, **kw) if return_lse else op(*args, **kw)
    if return_lse:
        return out, op_lse_out(*args, out, **kw)
    op_out(*args, out, **kw)
    return out


def flash_attn(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, return_lse=False,
               out=None, **private):
    _no_private(private)
    kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=list(window_size), softcap=softcap)
    return _attention(ops.flash_attn, ops.flash_attn_lse, ops.flash_attn_out, ops.flash_attn_lse_out, (q, k, v),
                      return_lse, out, kw)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                      softmax_scale=None, window_size=(-1, -1), softcap=0.0, return_lse=False, out=None,
                      block_table=None, seqused_k=None, **private):
    _no_private(private)
    if block_table is not None:  # a paged cache: speedcore.flash_attn_varlen routes it to paged prefill too
        if seqused_k is None:
            seqused_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        return paged_prefill_attention(q, k, v, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
                                       causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                       softcap=softcap, return_lse=return_lse, out=out)
    kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=list(window_size), softcap=softcap)
    return _attention(ops.flash_attn_varlen, ops.flash_attn_varlen_lse, ops.flash_attn_varlen_out,
                      ops.flash_attn_varlen_lse_out,
                      (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), return_lse, out, kw)


def paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
                            *, causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0, return_lse=False,
                            out=None, **private):
    _no_private(private)
    kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=list(window_size), softcap=softcap)
    return _attention(ops.paged_prefill_attention, ops.paged_prefill_attention_lse, ops.paged_prefill_attention_out,
                      ops.paged_prefill_attention_lse_out,
                      (q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k),
                      return_lse, out, kw)


def matmul(a, b, *, out=None, **private):
    _no_private(private)
    if out is None:
        return ops.matmul(a, b)
    ops.matmul_out(a, b, out)
    return out


def linear(x, weight, bias=None, *, activation=None, out=None, **private):
    _no_private(private)
    if out is None:
        return ops.linear(x, weight, bias, activation=activation)
    ops.linear_out(x, weight, bias, out, activation=activation)
    return out


# A prepacked layer (prepack_awq / prepack_gptq / prepack_int8) is not a tensor, so it cannot enter a schema: under
# torch.compile its stored tensors go to the op instead (the same result, without the prepacked fast kernels).

def awq_linear(x, qweight, qzeros=None, scales=None, *, group_size: int = 128, bias=None, **private):
    _no_private(private)
    if not isinstance(qweight, torch.Tensor):  # AWQWeight
        qweight, qzeros, scales, group_size = qweight.qweight, qweight.qzeros, qweight.scales, qweight.group_size
    return ops.awq_linear(x, qweight, qzeros, scales, group_size=group_size, bias=bias)


def gptq_linear(x, qweight, qzeros=None, scales=None, g_idx=None, *, group_size: int = 128, bias=None, **private):
    _no_private(private)
    if not isinstance(qweight, torch.Tensor):  # GPTQWeight: act-order rows repacked in group order (perm)
        layer = qweight
        qweight, qzeros, scales, g_idx, group_size = (layer.qweight, layer.qzeros, layer.scales, layer.g_idx,
                                                      layer.group_size)
        if layer.perm is not None:
            x = x.index_select(-1, layer.perm)
    return ops.gptq_linear(x, qweight, qzeros, scales, g_idx, group_size=group_size, bias=bias)


def int8_linear(x, weight, scales=None, *, bias=None, **private):
    _no_private(private)
    if not isinstance(weight, torch.Tensor):  # Int8Weight
        weight, scales = weight.weight, weight.scales
    return ops.int8_linear(x, weight, scales, bias=bias)


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, *, softmax_scale=None, softcap=0.0,
                           window_left=-1, out=None, return_lse=False, **private):
    _no_private(private)
    kw = dict(softmax_scale=softmax_scale, softcap=softcap, window_left=window_left)
    return _attention(ops.paged_decode_attention, ops.paged_decode_attention_lse, ops.paged_decode_attention_out,
                      ops.paged_decode_attention_lse_out, (q, k_cache, v_cache, block_table, seq_lens), return_lse,
                      out, kw)


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, **private):
    _no_private(private)
    ops.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)


def rotary_embedding(positions, q, k, cos_sin_cache, *, is_neox=True, **private):
    _no_private(private)
    ops.rotary_embedding(positions, q, k, cos_sin_cache, is_neox=is_neox)
    return q, k


def silu_and_mul(x, *, out=None, **private):
    _no_private(private)
    if out is None:
        return ops.silu_and_mul(x)
    ops.silu_and_mul_out(x, out)
    return out


def gelu_and_mul(x, *, out=None, **private):
    _no_private(private)
    if out is None:
        return ops.gelu_and_mul(x)
    ops.gelu_and_mul_out(x, out)
    return out


TRACED = {
    "rms_norm": rms_norm, "flash_attn": flash_attn, "flash_attn_varlen": flash_attn_varlen,
    "paged_prefill_attention": paged_prefill_attention, "matmul": matmul,
    "linear": linear, "awq_linear": awq_linear, "gptq_linear": gptq_linear, "int8_linear": int8_linear,
    "paged_decode_attention": paged_decode_attention, "reshape_and_cache": reshape_and_cache,
    "rotary_embedding": rotary_embedding, "silu_and_mul": silu_and_mul, "gelu_and_mul": gelu_and_mul,
}


def _register():
    """Define, implement and fake every op; returns the Library, which must stay alive (dropping it unregisters
    the ops)."""
    lib = torch.library.Library(NAMESPACE, "DEF")
    for name, schema in SCHEMAS.items():
        lib.define(name + schema)
        lib.impl(name, KERNELS[name], "CUDA")
        torch.library.register_fake(f"{NAMESPACE}::{name}", FAKES[name], lib=lib)
    return lib


# A reload re-runs this file in the same namespace: keep the first Library (a second "DEF" of the namespace would
# raise, and dropping the first would unregister the ops).
LIBRARY = globals().get("LIBRARY") or _register()
_torch_hook.OPS.update(TRACED)
