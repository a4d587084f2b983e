"""torch.ops.speedcore.*: schemas, fake implementations, the torch.compile redirect of the public functions, and
(GPU) opcheck of every op, a compiled Llama decoder layer and its CUDA-graph replays.

Without a GPU the ops get CPU reference kernels (registered by the ``cpu_reference_kernels`` fixture, removed
after the module), so that opcheck and torch.compile run end to end here: what they check (declared mutations,
fake vs real shapes/strides, no graph break) does not depend on which kernel computes the values.
"""
import inspect
import math
import subprocess
import sys
import textwrap
import timeit
import types

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import speedcore  # noqa: E402
from speedcore import _torch_hook  # noqa: E402
from speedcore.integrations import torch_ops as T  # noqa: E402

OUT_OPS = [n for n in T.SCHEMAS if n.endswith("_out")]
MUTATED = {n: {"out"} for n in OUT_OPS}
MUTATED.update(reshape_and_cache={"k_cache", "v_cache"}, rotary_embedding={"q", "k"},
               add_rms_norm_residual_out={"residual_out"}, add_rms_norm_out_residual_out={"out", "residual_out"})
RETURN_NEW = {"add_rms_norm_out", "add_rms_norm_residual_out"}  # writing ops that also return a new tensor


def public(name):
    """speedcore.<name> once its host path starts with the _torch_hook redirect; until then a wrapper that starts
    with the same two lines (what the public functions will do)."""
    fn = getattr(speedcore, name)
    if "_torch_hook" in getattr(getattr(fn, "__code__", None), "co_names", ()):
        return fn

    def redirected(*args, **kw):
        if _torch_hook.compiling():
            return _torch_hook.op(name)(*args, **kw)
        return fn(*args, **kw)

    return redirected


# ---- references, device-agnostic (float32 math), with the ops' calling conventions ----

def ref_rms_norm(x, weight, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def ref_add_rms_norm(x, residual, weight, eps=1e-6):
    h = x + residual  # rounded to the input dtype, as the kernel's h
    return ref_rms_norm(h, weight, eps), h


def ref_add_rms_norm_into(x, residual, weight, eps, out, residual_out):
    y, h = ref_add_rms_norm(x, residual, weight, eps)
    out.copy_(y)
    residual_out.copy_(h)


def ref_attention(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0):
    """(out, lse) of flash_attn for (batch, seqlen, heads, head_dim) inputs."""
    sq, sk, d = q.shape[1], k.shape[1], q.shape[3]
    group = q.shape[2] // k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    kf = k.float().repeat_interleave(group, 2)
    vf = v.float().repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        visible &= j <= i + right
    if left >= 0:
        visible &= j >= i - left
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), torch.zeros_like(s))
    out = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    return out.to(q.dtype).contiguous(), lse.contiguous()


def ref_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(cq) - 1):
        o, l = ref_attention(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]], **kw)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)


def ref_prefill(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, *,
                causal=True, **kw):
    cq, bs = cu_seqlens_q.tolist(), k_cache.shape[1]
    outs, lses = [], []
    for b in range(len(cq) - 1):
        t = torch.arange(int(seqused_k[b]), device=q.device)
        pages = block_table[b, t // bs].long()
        o, l = ref_attention(q[None, cq[b]:cq[b + 1]], k_cache[pages, t % bs][None], v_cache[pages, t % bs][None],
                             causal=causal, **kw)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)


def ref_linear(x, weight, bias=None, *, activation=None):
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    act = {None: lambda t: t, "silu": F.silu, "gelu": F.gelu, "relu": F.relu,
           "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation]
    return act(y).to(x.dtype)


def _nibbles(words, order):
    """int32 words -> their 8 nibbles (last dim x8), nibble i of each word at position order[i]."""
    shifts = torch.tensor([4 * order.index(p) for p in range(8)], device=words.device, dtype=torch.int32)
    return ((words[..., None] >> shifts) & 15).flatten(-2)


def ref_awq_linear(x, qweight, qzeros, scales, *, group_size=128, bias=None):
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    k = qweight.shape[0]
    g = k if group_size == -1 else group_size
    q, z = _nibbles(qweight, order), _nibbles(qzeros, order)
    w = (q - z.repeat_interleave(g, 0)).float() * scales.float().repeat_interleave(g, 0)
    return ref_linear(x, w.t().to(x.dtype), bias)


def ref_gptq_linear(x, qweight, qzeros, scales, g_idx=None, *, group_size=128, bias=None):
    k = qweight.shape[0] * 8
    g = k if group_size == -1 else group_size
    q = _nibbles(qweight.t(), list(range(8))).t()  # (K, N): nibble i of word r is row 8r + i
    z = _nibbles(qzeros, list(range(8))) + 1
    groups = (torch.arange(k, device=x.device) // g) if g_idx is None else g_idx.long()
    w = (q - z[groups]).float() * scales.float()[groups]
    return ref_linear(x, w.t().to(x.dtype), bias)


def ref_int8_linear(x, weight, scales, *, bias=None):
    y = (x.float() @ weight.float().t()) * scales.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def ref_decode(q, k_cache, v_cache, block_table, seq_lens, *, softmax_scale=None, softcap=0.0, window_left=-1):
    batch, heads, d = q.shape
    bs, group = k_cache.shape[1], heads // k_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    out = torch.zeros(batch, heads, d, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        t = torch.arange(n, device=q.device)
        pages = block_table[b, t // bs].long()
        kb = k_cache[pages, t % bs].float().repeat_interleave(group, 1)
        vb = v_cache[pages, t % bs].float().repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), kb) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        if window_left >= 0:
            s[:, t < n - 1 - window_left] = float("-inf")
        lse[b] = torch.logsumexp(s, -1)
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vb)
    return out.to(q.dtype), lse


def ref_reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    slots = slot_mapping.long()
    valid = (slots >= 0) & (slots < k_cache.shape[0] * k_cache.shape[1])
    k_cache.view(-1, *k_cache.shape[2:])[slots[valid]] = k[valid]
    v_cache.view(-1, *v_cache.shape[2:])[slots[valid]] = v[valid]


def _rotate(positions, x, cos_sin_cache, is_neox):
    rot = cos_sin_cache.shape[1]
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[..., None, : rot // 2], cs[..., None, rot // 2:]
    r = x[..., :rot].float()
    if is_neox:
        a, b = r[..., : rot // 2], r[..., rot // 2:]
        r = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    else:
        a, b = r[..., 0::2], r[..., 1::2]
        r = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    x[..., :rot] = r.to(x.dtype)


def ref_rotary_embedding(positions, q, k, cos_sin_cache, *, is_neox=True):
    _rotate(positions, q, cos_sin_cache, is_neox)
    if k is not None:
        _rotate(positions, k, cos_sin_cache, is_neox)


def ref_gated(act):
    def gated(x):
        d = x.shape[-1] // 2
        return (act(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)
    return gated


def _into_out(ref):
    """The *_out kernel of a reference: writes its (first) result into out (the last positional argument), returns
    the rest."""
    def kernel(*args, **kw):
        *args, out = args
        res = ref(*args, **kw)
        first = res[0] if isinstance(res, tuple) else res
        out.copy_(first)
        return res[1] if isinstance(res, tuple) else None
    return kernel


def _first(ref):
    return lambda *args, **kw: ref(*args, **kw)[0]


def _window(ref):
    return lambda *args, window_size=(-1, -1), **kw: ref(*args, window_size=tuple(window_size), **kw)


_flash = _window(ref_attention)
_varlen = _window(ref_attention_varlen)
_prefill = _window(ref_prefill)
REFERENCES = {
    "rms_norm": ref_rms_norm, "rms_norm_out": _into_out(ref_rms_norm),
    "add_rms_norm": ref_add_rms_norm, "add_rms_norm_out": _into_out(ref_add_rms_norm),
    "add_rms_norm_residual_out": _into_out(lambda *args: ref_add_rms_norm(*args)[::-1]),
    "add_rms_norm_out_residual_out": ref_add_rms_norm_into,
    "flash_attn": _first(_flash), "flash_attn_lse": _flash, "flash_attn_out": _into_out(_first(_flash)),
    "flash_attn_lse_out": _into_out(_flash),
    "flash_attn_varlen": _first(_varlen), "flash_attn_varlen_lse": _varlen,
    "flash_attn_varlen_out": _into_out(_first(_varlen)), "flash_attn_varlen_lse_out": _into_out(_varlen),
    "paged_prefill_attention": _first(_prefill), "paged_prefill_attention_lse": _prefill,
    "paged_prefill_attention_out": _into_out(_first(_prefill)), "paged_prefill_attention_lse_out": _into_out(_prefill),
    "matmul": lambda a, b: (a.float() @ b.float()).to(a.dtype),
    "matmul_out": _into_out(lambda a, b: (a.float() @ b.float()).to(a.dtype)),
    "linear": ref_linear, "linear_out": _into_out(ref_linear),
    "awq_linear": ref_awq_linear, "gptq_linear": ref_gptq_linear, "int8_linear": ref_int8_linear,
    "paged_decode_attention": _first(ref_decode), "paged_decode_attention_lse": ref_decode,
    "paged_decode_attention_out": _into_out(_first(ref_decode)),
    "paged_decode_attention_lse_out": _into_out(ref_decode),
    "reshape_and_cache": ref_reshape_and_cache, "rotary_embedding": ref_rotary_embedding,
    "silu_and_mul": ref_gated(F.silu), "silu_and_mul_out": _into_out(ref_gated(F.silu)),
    "gelu_and_mul": ref_gated(F.gelu), "gelu_and_mul_out": _into_out(ref_gated(F.gelu)),
}


@pytest.fixture(scope="module")
def cpu_reference_kernels():
    lib = torch.library.Library(T.NAMESPACE, "IMPL")
    for name, ref in REFERENCES.items():
        lib.impl(name, ref, "CPU")
    yield
    lib._destroy()


# ---- one small valid call of every op ----

def _randn(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def samples(device, dtype=torch.float16, seed=0):
    """op name -> (args, kwargs): small inputs that every kernel accepts."""
    g = torch.Generator().manual_seed(seed)

    def rn(*shape, dt=dtype, scale=1.0):
        return _randn(shape, dt, device, g, scale)

    def ints(lo, hi, *shape, dt=torch.int32):
        return torch.randint(lo, hi, shape, generator=g, dtype=dt).to(device)

    x, w, r = rn(4, 64), rn(64), rn(4, 64)
    q, k, v = rn(2, 16, 4, 64), rn(2, 24, 2, 64), rn(2, 24, 2, 64)
    attn_kw = dict(causal=True, softmax_scale=0.2, window_size=[8, -1], softcap=0.0)
    vq, vk, vv = rn(20, 4, 64), rn(26, 2, 64), rn(26, 2, 64)
    cu_q = torch.tensor([0, 7, 7, 20], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 12, 26], dtype=torch.int32, device=device)
    varlen = (vq, vk, vv, cu_q, cu_k, 13, 14)
    pq = rn(12, 4, 64)
    prefill = (pq, rn(10, 16, 2, 64), rn(10, 16, 2, 64), torch.tensor([0, 5, 12], dtype=torch.int32, device=device),
               torch.tensor([20, 7], dtype=torch.int32, device=device),
               torch.tensor([[4, 0, 9], [6, 2, 3]], dtype=torch.int32, device=device), 7, 20)
    a, b = rn(16, 64), rn(64, 32)
    lx, lw, lb = rn(2, 8, 64), rn(32, 64, scale=0.1), rn(32)
    qx = rn(3, 128)
    awq = (qx, ints(-2**31, 2**31 - 1, 128, 8), ints(-2**31, 2**31 - 1, 2, 8), rn(2, 64, scale=0.01))
    gptq = (qx, ints(-2**31, 2**31 - 1, 16, 64), ints(-2**31, 2**31 - 1, 2, 8), rn(2, 64, scale=0.01))
    int8 = (qx, ints(-128, 128, 64, 128, dt=torch.int8), rn(64, scale=0.01))
    dq, kc, vc = rn(3, 8, 64), rn(10, 16, 2, 64), rn(10, 16, 2, 64)
    table = torch.tensor([[3, 1, 7, 0], [2, 9, 0, 0], [5, 4, 6, 8]], dtype=torch.int32, device=device)
    decode = (dq, kc, vc, table, torch.tensor([40, 17, 64], dtype=torch.int32, device=device))
    decode_kw = dict(softmax_scale=None, softcap=30.0, window_left=24)
    slots = torch.tensor([5, -1, 17, 63, 40], dtype=torch.int64, device=device)
    positions = ints(0, 32, 6, dt=torch.int64)
    freqs = torch.arange(32)[:, None] * (10000.0 ** (-torch.arange(32) / 32.0))[None]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1).to(device)
    gx = rn(4, 128)
    return {
        "rms_norm": ((x, w, 1e-5), {}),
        "rms_norm_out": ((x, w, 1e-5, torch.empty_like(x)), {}),
        "add_rms_norm": ((x, r, w, 1e-5), {}),
        "add_rms_norm_out": ((x, r, w, 1e-5, torch.empty_like(x)), {}),
        "add_rms_norm_residual_out": ((x, r, w, 1e-5, torch.empty_like(x)), {}),
        "add_rms_norm_out_residual_out": ((x, r, w, 1e-5, torch.empty_like(x), torch.empty_like(x)), {}),
        "flash_attn": ((q, k, v), attn_kw),
        "flash_attn_lse": ((q, k, v), dict(attn_kw, causal=False, softcap=20.0)),
        "flash_attn_out": ((q, k, v, torch.empty_like(q)), attn_kw),
        "flash_attn_lse_out": ((q, k, v, torch.empty_like(q)), attn_kw),
        "flash_attn_varlen": (varlen, attn_kw),
        "flash_attn_varlen_lse": (varlen, dict(attn_kw, window_size=[-1, -1])),
        "flash_attn_varlen_out": (varlen + (torch.empty_like(vq),), attn_kw),
        "flash_attn_varlen_lse_out": (varlen + (torch.empty_like(vq),), attn_kw),
        "paged_prefill_attention": (prefill, {}),
        "paged_prefill_attention_lse": (prefill, dict(causal=False, softcap=10.0)),
        "paged_prefill_attention_out": (prefill + (torch.empty_like(pq),), dict(window_size=[4, 0])),
        "paged_prefill_attention_lse_out": (prefill + (torch.empty_like(pq),), {}),
        "matmul": ((a, b), {}),
        "matmul_out": ((a, b, a.new_empty(16, 32)), {}),
        "linear": ((lx, lw, lb), dict(activation="silu")),
        "linear_out": ((lx, lw, None, lx.new_empty(2, 8, 32)), dict(activation="gelu_tanh")),
        "awq_linear": (awq, dict(group_size=64)),
        "gptq_linear": (gptq + (None,), dict(group_size=64, bias=rn(64))),
        "int8_linear": (int8, {}),
        "paged_decode_attention": (decode, decode_kw),
        "paged_decode_attention_lse": (decode, {}),
        "paged_decode_attention_out": (decode + (torch.empty_like(dq),), decode_kw),
        "paged_decode_attention_lse_out": (decode + (torch.empty_like(dq),), {}),
        "reshape_and_cache": ((rn(5, 2, 64), rn(5, 2, 64), kc.clone(), vc.clone(), slots), {}),
        "rotary_embedding": ((positions, rn(6, 4, 64), rn(6, 2, 64), cos_sin), dict(is_neox=True)),
        "silu_and_mul": ((gx,), {}),
        "silu_and_mul_out": ((gx, gx.new_empty(4, 64)), {}),
        "gelu_and_mul": ((gx,), {}),
        "gelu_and_mul_out": ((gx, gx.new_empty(4, 64)), {}),
    }


def _op(name):
    return getattr(torch.ops.speedcore, name).default


def _meta(t):
    return (tuple(t.shape), t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t


def _metas(res):
    return [_meta(t) for t in res] if isinstance(res, (tuple, list)) else _meta(res)


# ---- CPU: registration, schemas, fakes, the redirect ----

def test_import_speedcore_does_not_import_torch():
    code = textwrap.dedent("""
        import sys, speedcore
        from speedcore import _torch_hook
        assert not _torch_hook.compiling() and not _torch_hook.OPS
        speedcore.rms_norm  # the host path module, which pastes the redirect, imports no torch either
        assert "torch" not in sys.modules, [m for m in sys.modules if m.startswith("torch")]
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compiling_is_false_eagerly_and_cheap():
    assert _torch_hook.compiling() is False
    per_call_us = min(timeit.repeat(_torch_hook.compiling, number=100_000, repeat=5)) * 10
    print(f"_torch_hook.compiling(): {per_call_us:.3f} us per eager call")
    assert per_call_us < 1.0  # 0.15 us on a quiet core; the bound leaves room for shared CI machines


def test_every_public_function_has_a_traced_twin_with_its_signature():
    functions = {n for n in speedcore._EXPORTS if not n[0].isupper()}  # not the classes (LLM, SamplingParams)
    assert set(T.TRACED) == functions
    assert _torch_hook.OPS == T.TRACED
    for name, traced in T.TRACED.items():
        assert _torch_hook.op(name) is traced
        # the public parameters, in order, with their defaults; the private knobs (_path, ...) go to **private
        params = [p for p in inspect.signature(getattr(speedcore, name)).parameters.values()
                  if not p.name.startswith("_")]
        *twin_params, private = inspect.signature(traced).parameters.values()
        assert twin_params == params, name
        assert private.kind is inspect.Parameter.VAR_KEYWORD


def test_op_names_an_unknown_function_and_refuses_private_knobs():
    with pytest.raises(NotImplementedError, match="speedcore.nope"):
        _torch_hook.op("nope")
    x = torch.ones(2, 8)
    with pytest.raises(NotImplementedError, match="_path"):
        _torch_hook.op("linear")(x, x, _path="hopper")


@pytest.mark.parametrize("name", list(T.SCHEMAS))
def test_schema_declares_what_the_op_writes(name):
    schema = _op(name)._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == MUTATED.get(name, set())
    assert schema.is_mutable == bool(written)
    assert all(r.alias_info is None for r in schema.returns)  # nothing returned aliases an input
    if name in MUTATED and not name.endswith("lse_out") and name not in RETURN_NEW:
        assert len(schema.returns) == 0
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"speedcore::{name}", "CUDA")


def test_registration_is_idempotent():
    import importlib

    lib = T.LIBRARY
    importlib.reload(T)
    assert T.LIBRARY is lib
    assert _torch_hook.OPS["rms_norm"] is T.rms_norm
    assert torch.ops.speedcore.rms_norm.default._schema.name == "speedcore::rms_norm"


@pytest.mark.parametrize("name", list(T.SCHEMAS))
def test_opcheck_with_reference_kernels(name, cpu_reference_kernels):
    args, kw = samples("cpu")[name]
    torch.library.opcheck(_op(name), args, kw)


@pytest.mark.parametrize("name", list(T.SCHEMAS))
def test_fake_results_on_cuda_match_the_reference(name, cpu_reference_kernels):
    """On fake CUDA tensors (no GPU needed), every op's fake result has the shapes, strides and dtypes of the real
    (here: reference) result."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kw = samples("cpu")[name]
    expected = _metas(_op(name)(*args, **kw))
    with FakeTensorMode() as mode:
        fargs, fkw = torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda"), (args, kw))
        res = _op(name)(*fargs, **fkw)
    assert _metas(res) == expected
    assert all(t.device.type == "cuda" for t in torch.utils._pytree.tree_leaves(res) if isinstance(t, torch.Tensor))


class GraphRecorder:
    """A torch.compile backend that keeps the FX graphs dynamo hands it and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self):
        return [str(n.target) for g in self.graphs for n in g.graph.nodes if n.op == "call_function"]


def test_compile_traces_rms_norm_into_the_op(cpu_reference_kernels):
    rms_norm = public("rms_norm")

    def f(x, w, r):
        y, h = rms_norm(x, w, 1e-5, residual=r)
        return rms_norm(y * 2, w, 1e-5) + h

    x, w, r = (torch.randn(4, 64, dtype=torch.float16) for _ in range(3))
    w = w[0]
    rec = GraphRecorder()
    got = torch.compile(f, fullgraph=True, backend=rec)(x, w, r)
    assert len(rec.graphs) == 1
    assert "speedcore.add_rms_norm" in rec.targets() and "speedcore.rms_norm" in rec.targets()
    y, h = ref_add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(got, ref_rms_norm(y * 2, w, 1e-5) + h)


def test_compile_traces_out_and_inplace_variants(cpu_reference_kernels):
    names = ("silu_and_mul", "rotary_embedding", "reshape_and_cache")
    s = samples("cpu")
    positions, q, k, cos_sin = s["rotary_embedding"][0]
    kc, vc, slots = s["reshape_and_cache"][0][2:]
    gx = s["silu_and_mul"][0][0]

    def f(sc, gx, out, positions, q, k, cos_sin, kc, vc):
        sc.silu_and_mul(gx, out=out)
        q2, k2 = sc.rotary_embedding(positions, q, k, cos_sin)
        sc.reshape_and_cache(k2[:5], k2[:5], kc, vc, slots)
        return out * 1, q2 + 0

    expected_args = [t.clone() for t in (gx, gx.new_zeros(4, 64), positions, q, k, cos_sin, kc, vc)]
    sc = _namespace({n: public(n) for n in names})
    args = [t.clone() for t in expected_args]
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(sc, *args)
    rec = GraphRecorder()
    torch.compile(f, fullgraph=True, backend=rec)(sc, *[t.clone() for t in expected_args])
    assert {"speedcore.silu_and_mul_out", "speedcore.rotary_embedding", "speedcore.reshape_and_cache"} <= set(
        rec.targets())
    # eager through the ops (reference kernels here): the same values and the same writes into the inputs
    torch.testing.assert_close(got, f(_namespace(T.TRACED), *expected_args))
    for a, e in zip(args, expected_args):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("name", sorted(T.TRACED))
def test_compile_traces_every_public_function_into_its_op(name, cpu_reference_kernels):
    """Each public function (with its redirect, or the stand-in of public() until the host path has it) becomes its
    op in one graph, called with the arguments of that op's sample."""
    args, kw = samples("cpu")[name]
    fn = public(name)
    torch._dynamo.reset()  # one lambda for every name: without a reset its recompiles hit dynamo's limit
    rec = GraphRecorder()
    got = torch.compile(lambda *a, **k: fn(*a, **k), fullgraph=True, backend=rec)(*args, **kw)
    assert len(rec.graphs) == 1 and f"speedcore.{name}" in rec.targets()
    args, kw = samples("cpu")[name]  # fresh: the call may have written its inputs
    torch.testing.assert_close(got, T.TRACED[name](*args, **kw))


def test_compile_fused_add_rms_norm_in_place(cpu_reference_kernels):
    """vLLM's in-place fused add + RMSNorm (h written over the residual, y over x), traced through the twin."""
    def f(x, r, w):
        y, h = T.rms_norm(x, w, 1e-5, residual=r, out=x, residual_out=r)
        y2, h2 = T.rms_norm(y * 2, w, 1e-5, residual=h, residual_out=h)
        return y2, h2

    g = torch.Generator().manual_seed(3)
    x, r, w = (_randn(shape, torch.float16, "cpu", g) for shape in ((4, 64), (4, 64), (64,)))
    args, expected_args = [x.clone(), r.clone(), w], [x.clone(), r.clone(), w]
    rec = GraphRecorder()
    torch.compile(f, fullgraph=True, backend=rec)(*[t.clone() for t in args])
    assert {"speedcore.add_rms_norm_out_residual_out", "speedcore.add_rms_norm_residual_out"} <= set(rec.targets())
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    torch.testing.assert_close(got, f(*expected_args))
    for a, e in zip(args, expected_args):
        torch.testing.assert_close(a, e)
    y, h = ref_add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(args[0], y)


def test_compile_imports_the_integration_in_the_trace():
    """In a fresh process that never imported speedcore.integrations.torch_ops, the first traced call imports it
    (dynamo runs the import statement at trace time) with no graph break."""
    code = textwrap.dedent(f"""
        import sys, torch, speedcore
        from speedcore import _torch_hook
        rms_norm = speedcore.rms_norm
        if "_torch_hook" not in rms_norm.__code__.co_names:  # the host path without the redirect yet: as in public()
            def rms_norm(x, w):
                if _torch_hook.compiling():
                    return _torch_hook.op("rms_norm")(x, w)
                raise AssertionError("not traced")
        graphs = []
        def backend(gm, example_inputs):  # records the graph; stands in for running it (no CUDA kernel here)
            graphs.append(gm)
            return lambda *args: (args[0].clone(),)
        assert "speedcore.integrations.torch_ops" not in sys.modules
        torch.compile(lambda x, w: rms_norm(x, w), fullgraph=True, backend=backend)(torch.ones(2, 8), torch.ones(8))
        assert "speedcore.integrations.torch_ops" in sys.modules
        assert any("speedcore.rms_norm" in str(n.target) for n in graphs[0].graph.nodes), graphs[0].code
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- a Llama decoder layer built from speedcore ops ----

def llama_layer(sc, x, p, positions, cos_sin, heads=8, kv_heads=2):
    """One pre-norm Llama decoder layer; ``sc`` holds the speedcore functions (public ones, or the traced twins)."""
    batch, seq, hidden = x.shape
    head_dim = hidden // heads
    h = x
    x = sc.rms_norm(x, p["ln1"], 1e-5)
    qkv = sc.linear(x, p["qkv"])
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q = q.reshape(batch * seq, heads, head_dim)  # copies (q is a column slice): rotary then writes the copy
    k = k.reshape(batch * seq, kv_heads, head_dim)
    q, k = sc.rotary_embedding(positions.reshape(-1), q, k, cos_sin)
    o = sc.flash_attn(q.view(batch, seq, heads, head_dim), k.view(batch, seq, kv_heads, head_dim),
                      v.reshape(batch, seq, kv_heads, head_dim), causal=True)
    o = sc.linear(o.reshape(batch, seq, hidden), p["o"])
    x, h = sc.rms_norm(o, p["ln2"], 1e-5, residual=h)
    x = sc.silu_and_mul(sc.linear(x, p["gate_up"]))
    return sc.linear(x, p["down"]) + h


def llama_params(device, hidden=256, inter=512, heads=8, kv_heads=2, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def w(*shape, scale):
        return _randn(shape, dtype, device, g, scale)

    p = dict(ln1=1 + w(hidden, scale=0.1), ln2=1 + w(hidden, scale=0.1),
             qkv=w((heads + 2 * kv_heads) * head_dim, hidden, scale=hidden ** -0.5),
             o=w(hidden, hidden, scale=hidden ** -0.5), gate_up=w(2 * inter, hidden, scale=hidden ** -0.5),
             down=w(hidden, inter, scale=inter ** -0.5))
    freqs = torch.arange(512)[:, None] * (10000.0 ** (-torch.arange(head_dim // 2) / (head_dim // 2)))[None]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1).float().to(device)
    return p, cos_sin


def layer_inputs(device, batch=2, seq=32, hidden=256, dtype=torch.float16, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = _randn((batch, seq, hidden), dtype, device, g)
    start = torch.randint(0, 400, (batch, 1), generator=g)
    return x, (start + torch.arange(seq)).to(device)


def _namespace(fns):
    return types.SimpleNamespace(**fns)


PUBLIC_NAMES = ("rms_norm", "linear", "rotary_embedding", "flash_attn", "silu_and_mul")


def _ref_rotary_public(positions, q, k, cos_sin_cache, *, is_neox=True):
    ref_rotary_embedding(positions, q, k, cos_sin_cache, is_neox=is_neox)
    return q, k


# the layer's functions with the public signatures, computed by the references
REFERENCE_LAYER = types.SimpleNamespace(
    rms_norm=lambda x, w, eps=1e-6, *, residual=None: (
        ref_rms_norm(x, w, eps) if residual is None else ref_add_rms_norm(x, residual, w, eps)),
    linear=ref_linear, rotary_embedding=_ref_rotary_public,
    flash_attn=lambda q, k, v, **kw: ref_attention(q, k, v, **kw)[0], silu_and_mul=ref_gated(F.silu))


def test_llama_layer_compiles_in_one_graph(cpu_reference_kernels):
    p, cos_sin = llama_params("cpu")
    x, positions = layer_inputs("cpu")
    sc = _namespace({n: public(n) for n in PUBLIC_NAMES})
    rec = GraphRecorder()
    got = torch.compile(llama_layer, fullgraph=True, backend=rec)(sc, x, p, positions, cos_sin)
    assert len(rec.graphs) == 1
    assert {f"speedcore.{n}" for n in PUBLIC_NAMES} | {"speedcore.add_rms_norm"} <= set(rec.targets())
    got_aot = torch.compile(llama_layer, fullgraph=True, backend="aot_eager")(sc, x, p, positions, cos_sin)
    expected = llama_layer(_namespace(T.TRACED), x, p, positions, cos_sin)  # eager, through the ops
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_aot, expected)
    torch.testing.assert_close(expected, llama_layer(REFERENCE_LAYER, x, p, positions, cos_sin))


def test_llama_layer_compiles_once_for_dynamic_shapes(cpu_reference_kernels):
    """The fake implementations take symbolic sizes: one graph serves every batch and sequence length."""
    p, cos_sin = llama_params("cpu")
    sc = _namespace({n: public(n) for n in PUBLIC_NAMES})
    rec = GraphRecorder()
    compiled = torch.compile(llama_layer, fullgraph=True, dynamic=True, backend=rec)
    for batch, seq in ((2, 24), (3, 17), (4, 40)):  # not 0 or 1, and no size equal to another (both specialize)
        x, positions = layer_inputs("cpu", batch=batch, seq=seq)
        torch.testing.assert_close(compiled(sc, x, p, positions, cos_sin),
                                   llama_layer(REFERENCE_LAYER, x, p, positions, cos_sin))
    assert len(rec.graphs) == 1


# ---- GPU ----

def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(T.SCHEMAS))
def test_opcheck_gpu(name):
    _cuda()
    args, kw = samples("cuda")[name]
    torch.library.opcheck(_op(name), args, kw)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(T.SCHEMAS))
def test_op_matches_reference_gpu(name):
    """The ops compute what the references compute (float16 inputs; quantized ones against a dequantized weight)."""
    _cuda()
    s = samples("cuda")
    args, kw = s[name]
    ref_args, ref_kw = samples("cuda")[name]  # a second copy: the op may write its inputs
    got = _op(name)(*args, **kw)
    expected = REFERENCES[name](*ref_args, **ref_kw)
    tol = dict(atol=2e-2, rtol=2e-2)
    if name in MUTATED:  # compare what each wrote
        written = [a for a in _op(name)._schema.arguments if a.name in MUTATED[name]]
        for a in written:
            i = [x.name for x in _op(name)._schema.arguments].index(a.name)
            got_w = kw[a.name] if a.name in kw else args[i]
            exp_w = ref_kw[a.name] if a.name in ref_kw else ref_args[i]
            torch.testing.assert_close(got_w, exp_w, **tol)
    if got is not None:
        torch.testing.assert_close(got, expected if not isinstance(expected, tuple) or isinstance(got, tuple)
                                   else expected[-1], **tol)


def _gpu_layer_setup():
    _cuda()
    torch.manual_seed(0)
    p, cos_sin = llama_params("cuda")
    return p, cos_sin, _namespace({n: public(n) for n in PUBLIC_NAMES}), _namespace(
        {n: getattr(speedcore, n) for n in PUBLIC_NAMES})


@pytest.mark.gpu
def test_llama_layer_compiled_matches_eager_gpu():
    p, cos_sin, sc, eager = _gpu_layer_setup()
    torch._dynamo.reset()
    rec = GraphRecorder()
    recorded = torch.compile(llama_layer, fullgraph=True, backend=rec)
    compiled = torch.compile(llama_layer, fullgraph=True)  # inductor
    x, positions = layer_inputs("cuda")
    expected = llama_layer(eager, x, p, positions, cos_sin)
    tol = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(expected, llama_layer(REFERENCE_LAYER, x, p, positions, cos_sin), **tol)
    torch.testing.assert_close(recorded(sc, x, p, positions, cos_sin), expected, **tol)
    assert len(rec.graphs) == 1
    assert {f"speedcore.{n}" for n in PUBLIC_NAMES} | {"speedcore.add_rms_norm"} <= set(rec.targets())
    torch.testing.assert_close(compiled(sc, x, p, positions, cos_sin), expected, **tol)


@pytest.mark.gpu
def test_llama_layer_reduce_overhead_replays_on_new_inputs_gpu():
    from torch._dynamo.utils import counters

    p, cos_sin, sc, eager = _gpu_layer_setup()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(llama_layer, fullgraph=True, mode="reduce-overhead")
    for seed in range(5):  # warm-up, recording, then replays of the CUDA graph on fresh data
        x, positions = layer_inputs("cuda", seed=10 + seed)
        got = compiled(sc, x, p, positions, cos_sin).clone()  # clone: the next replay reuses the output buffer
        torch.testing.assert_close(got, llama_layer(eager, x, p, positions, cos_sin), atol=2e-2, rtol=2e-2)
    assert counters["inductor"]["cudagraph_skips"] == 0  # the replays were CUDA graphs


# ---- a paged decode step: writes into the caches (graph inputs), then reads them ----

def decode_step(sc, q, k, v, k_cache, v_cache, slot_mapping, block_table, seq_lens, out):
    sc.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    o, lse = sc.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, return_lse=True, softcap=30.0)
    sc.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, out=out)
    return o, lse


def decode_inputs(device, seed):
    g = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, d, bs = 3, 8, 2, 64, 16
    lens = torch.tensor([9, 33, 48], dtype=torch.int32)
    table = torch.tensor([[4, 0, 0], [1, 7, 3], [8, 2, 5]], dtype=torch.int32)
    last = lens.long() - 1  # the new token's slot
    slots = table[torch.arange(batch), last // bs].long() * bs + last % bs
    q, k, v, k_cache, v_cache = (_randn(shape, torch.float16, device, g) for shape in (
        (batch, heads, d), (batch, kv_heads, d), (batch, kv_heads, d), (10, bs, kv_heads, d), (10, bs, kv_heads, d)))
    return [q, k, v, k_cache, v_cache, slots.to(device), table.to(device), lens.to(device), q.new_empty(q.shape)]


DECODE_NAMES = ("reshape_and_cache", "paged_decode_attention")


def _check_decode_step(device, backend):
    sc = _namespace({n: public(n) for n in DECODE_NAMES})
    eager = _namespace(T.TRACED if device == "cpu" else {n: getattr(speedcore, n) for n in DECODE_NAMES})
    rec = GraphRecorder()
    torch.compile(decode_step, fullgraph=True, backend=rec)(sc, *decode_inputs(device, 0))
    assert {"speedcore.reshape_and_cache", "speedcore.paged_decode_attention_lse",
            "speedcore.paged_decode_attention_out"} <= set(rec.targets())
    compiled = torch.compile(decode_step, fullgraph=True, backend=backend)
    for seed in range(3):
        args, expected_args = decode_inputs(device, seed), decode_inputs(device, seed)
        got = compiled(sc, *args)
        expected = decode_step(eager, *expected_args)
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
        for a, e in zip(args, expected_args):  # the caches and out were written alike
            torch.testing.assert_close(a, e, atol=2e-2, rtol=2e-2)


def test_decode_step_compiles_with_its_writes(cpu_reference_kernels):
    _check_decode_step("cpu", "aot_eager")


@pytest.mark.gpu
def test_decode_step_compiled_matches_eager_gpu():
    _cuda()
    torch._dynamo.reset()
    _check_decode_step("cuda", "inductor")


def decode_step_into_cache(sc, q, k, v, k_cache, v_cache, slot_mapping, block_table, seq_lens):
    sc.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    return sc.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, return_lse=True)


@pytest.mark.gpu
def test_decode_steps_reduce_overhead_with_static_caches_gpu():
    """Decode steps as a server runs them: the caches are static (marked, as transformers' static cache does), so the
    CUDA graph writes them in place; each step brings new q/k/v and one more token per sequence."""
    from torch._dynamo.utils import counters

    _cuda()
    torch._dynamo.reset()
    counters.clear()
    sc = _namespace({n: public(n) for n in DECODE_NAMES})
    eager = _namespace({n: getattr(speedcore, n) for n in DECODE_NAMES})
    _, _, _, k_cache, v_cache, _, table, _, _ = decode_inputs("cuda", 0)
    eager_k_cache, eager_v_cache = k_cache.clone(), v_cache.clone()
    torch._dynamo.mark_static_address(k_cache)
    torch._dynamo.mark_static_address(v_cache)
    compiled = torch.compile(decode_step_into_cache, fullgraph=True, mode="reduce-overhead")
    g = torch.Generator().manual_seed(5)
    for step in range(5):
        lens = torch.tensor([9, 33, 40]) + step
        last = lens - 1
        slots = (table.cpu()[torch.arange(3), last // 16].long() * 16 + last % 16).cuda()
        q, k, v = (_randn(shape, torch.float16, "cuda", g) for shape in ((3, 8, 64), (3, 2, 64), (3, 2, 64)))
        lens = lens.int().cuda()
        got = [t.clone() for t in compiled(sc, q, k, v, k_cache, v_cache, slots, table, lens)]
        expected = decode_step_into_cache(eager, q, k, v, eager_k_cache, eager_v_cache, slots, table, lens)
        torch.testing.assert_close(got, list(expected), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(k_cache, eager_k_cache, atol=0, rtol=0)
        torch.testing.assert_close(v_cache, eager_v_cache, atol=0, rtol=0)
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_export_traces_the_public_functions_into_the_ops(cpu_reference_kernels):
    """torch.export (strict: dynamo; non-strict: the export flag that compiling() also reads) records the ops."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(64, dtype=torch.float16))

        def forward(self, x, r):
            y, h = public("rms_norm")(x, self.weight, 1e-5, residual=r)
            return public("silu_and_mul")(torch.cat([y, h], -1))

    x, r = torch.randn(4, 64, dtype=torch.float16), torch.randn(4, 64, dtype=torch.float16)
    y, h = ref_add_rms_norm(x, r, torch.ones(64, dtype=torch.float16), 1e-5)
    for strict in (True, False):
        ep = torch.export.export(Block(), (x, r), strict=strict)
        targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
        assert "speedcore.add_rms_norm.default" in targets and "speedcore.silu_and_mul.default" in targets
        torch.testing.assert_close(ep.module()(x, r), ref_gated(F.silu)(torch.cat([y, h], -1)))


# ---- writes into views and into the inputs themselves ----

EDGE_NAMES = ("rms_norm", "flash_attn", "rotary_embedding", "silu_and_mul")


def writes_in_place(sc, x, w, q, k, v, positions, cos_sin, wide):
    sc.rms_norm(x, w, out=x)  # out is the input
    o = sc.flash_attn(q, k, v, causal=True, out=q)  # out is q
    q2, no_k = sc.rotary_embedding(positions, q.view(-1, 4, 64), None, cos_sin)
    sc.silu_and_mul(x.repeat(1, 2), out=wide[:, :64])  # out is a column slice of an input (not contiguous)
    return x * 1, o * 1, q2 * 1, wide * 1


def edge_inputs(device):
    g = torch.Generator().manual_seed(0)
    freqs = torch.arange(64)[:, None] * (10000.0 ** (-torch.arange(32) / 32.0))[None]
    args = [_randn(shape, torch.float16, device, g) for shape in ((4, 64), (64,), (2, 8, 4, 64), (2, 8, 2, 64),
                                                                   (2, 8, 2, 64))]
    return args + [(torch.arange(16) % 64).to(device), torch.cat([freqs.cos(), freqs.sin()], -1).to(device),
                   torch.zeros(4, 128, dtype=torch.float16, device=device)]


def _check_writes_in_place(device, backend, eager):
    sc = _namespace({n: public(n) for n in EDGE_NAMES})
    expected_args = edge_inputs(device)
    expected = writes_in_place(eager, *expected_args)
    args = edge_inputs(device)
    got = torch.compile(writes_in_place, fullgraph=True, backend=backend)(sc, *args)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    for a, e in zip(args, expected_args):
        torch.testing.assert_close(a, e, atol=2e-2, rtol=2e-2)


def test_compile_writes_into_inputs_and_views(cpu_reference_kernels):
    _check_writes_in_place("cpu", "aot_eager", _namespace(T.TRACED))


@pytest.mark.gpu
def test_compile_writes_into_inputs_and_views_gpu():
    _cuda()
    torch._dynamo.reset()
    _check_writes_in_place("cuda", "inductor", _namespace({n: getattr(speedcore, n) for n in EDGE_NAMES}))
