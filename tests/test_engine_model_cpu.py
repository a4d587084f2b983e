"""The engine's model assembly (weights, fusion, rope, paged cache, chunked prefill, prefix cache, sliding window)
against transformers' float32 model, without a GPU: NumPy stands in for CuPy and NumPy reference ops (float32
math, rounded to the compute dtype after every op, as the kernels do) for speedcore's kernels.  Skipped where
transformers or torch is missing."""
import contextlib
import sys
import types

import numpy as np
import pytest


# Stream capture, faked: while a capture is open every recorded call (the reference ops, the shim's functions,
# advanced indexing) runs and is appended to TAPE; a graph's launch re-runs its tape, writing each call's new
# result into the array the capture returned (later calls hold that array), as a CUDA graph replays its kernels
# on the same buffers.
TAPE = None


def _record(fn, args, kwargs, result):
    if TAPE is not None:
        TAPE.append((fn, args, kwargs, result))
    return result


class _Graph:
    def __init__(self, tape):
        self.tape = tape

    def launch(self, stream=None):
        for fn, args, kwargs, result in self.tape:
            new = fn(*args, **kwargs)
            pairs = zip(result, new) if isinstance(result, tuple) else [(result, new)]
            for r, n in pairs:
                if isinstance(r, np.ndarray) and n is not r:
                    r[...] = n


def recorded(fn):
    def call(*a, **k):
        return _record(fn, a, k, fn(*a, **k))
    call.__name__ = fn.__name__
    return call


class GArr(np.ndarray):
    """A NumPy array with CuPy's host-transfer methods."""

    def set(self, a, stream=None):
        self[...] = np.asarray(a).reshape(self.shape)

    def get(self, stream=None):
        return np.array(self)

    def __getitem__(self, idx):
        r = super().__getitem__(idx)
        if isinstance(idx, np.ndarray) or (isinstance(idx, tuple) and any(isinstance(i, np.ndarray) for i in idx)):
            _record(np.ndarray.__getitem__, (self, idx), {}, r)  # a copy (a gather kernel)
        return r


class _Shim(types.ModuleType):
    def __getattr__(self, name):
        f = getattr(np, name)
        if callable(f) and not isinstance(f, type):
            def call(*a, **k):
                r = f(*a, **k)
                return _record(f, a, k, r.view(GArr) if isinstance(r, np.ndarray) else r)
            return call
        return f


class _Stream:
    ptr = 1

    def __init__(self, *a, **k):
        pass

    def begin_capture(self):
        global TAPE
        TAPE = []

    def end_capture(self):
        global TAPE
        tape, TAPE = TAPE, None
        return _Graph(tape)

    def __enter__(self):
        return self

    def __exit__(self, *e):
        return False

    def synchronize(self):
        pass


def _fake_cupy():
    cp = _Shim("cupy")
    pool = types.SimpleNamespace(free_all_blocks=lambda: None, malloc=None)
    cp.cuda = types.SimpleNamespace(
        Stream=_Stream, Device=lambda *a: _Stream(), get_current_stream=lambda: _Stream(),
        runtime=types.SimpleNamespace(memGetInfo=lambda: (1 << 34, 1 << 35)),
        MemoryPool=lambda: pool, using_allocator=lambda *a: contextlib.nullcontext())
    cp.cuda.Device = type("Device", (_Stream,), {"use": lambda self: None})
    cp.get_default_memory_pool = cp.get_default_pinned_memory_pool = lambda: pool
    cp.random = types.SimpleNamespace(default_rng=np.random.default_rng)

    def elementwise_kernel(*a, **k):  # the sampler's Gumbel noise kernel, the same hash in NumPy
        def run(seed, step, vocab, out):
            with np.errstate(over="ignore"):
                i = np.arange(out.size, dtype=np.uint64).reshape(out.shape)
                z = np.asarray(seed, np.uint64) ^ (np.asarray(step, np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ (
                    (i % np.uint64(vocab)) * np.uint64(0xC2B2AE3D27D4EB4F))
                for _ in range(2):
                    z = z + np.uint64(0x9E3779B97F4A7C15)
                    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
                    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
                    z = z ^ (z >> np.uint64(31))
            u = ((z >> np.uint64(40)).astype(np.float32) + 0.5) / 16777216.0
            out[...] = -np.log(-np.log(u))
            return out
        return run
    cp.ElementwiseKernel = elementwise_kernel
    return cp


# -- NumPy reference ops, with speedcore's signatures -----------------------------------------------------------
f32 = np.float32


def rms_norm(x, weight, eps=1e-6, *, residual=None, out=None):
    h = None
    xf = np.asarray(x, f32)
    if residual is not None:
        h = (xf + np.asarray(residual, f32)).astype(x.dtype)
        xf = h.astype(f32)
    y = (xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + eps) * weight.astype(f32)).astype(x.dtype).view(GArr)
    return (y, h.view(GArr)) if residual is not None else y


def linear(x, weight, bias=None, *, out=None):
    y = np.asarray(x, f32) @ weight.astype(f32).T
    if bias is not None:
        y = y + bias.astype(f32)
    return y.astype(x.dtype).view(GArr)


def silu_and_mul(x, *, out=None):
    d = x.shape[-1] // 2
    a = x[..., :d].astype(f32)
    return (a / (1 + np.exp(-a)) * x[..., d:].astype(f32)).astype(x.dtype).view(GArr)


def rotary_embedding(positions, q, k, cos_sin_cache, *, is_neox=True):
    half = cos_sin_cache.shape[1] // 2
    cos = cos_sin_cache[positions, :half][:, None, :]
    sin = cos_sin_cache[positions, half:][:, None, :]
    for a in (q, k):
        x1, x2 = a[..., :half].astype(f32), a[..., half:2 * half].astype(f32)
        a[..., :half] = (x1 * cos - x2 * sin).astype(a.dtype)
        a[..., half:2 * half] = (x2 * cos + x1 * sin).astype(a.dtype)
    return q, k


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    nb, bs, H, D = k_cache.shape
    ok = (slot_mapping >= 0) & (slot_mapping < nb * bs)
    for src, dst in ((k, k_cache), (v, v_cache)):
        flat = dst.reshape(-1, H, D)
        assert np.shares_memory(flat, dst)
        flat[slot_mapping[ok]] = src[ok]


def rotary_embedding_and_cache(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, *, is_neox=True):
    rotary_embedding(positions, q, k, cos_sin_cache, is_neox=is_neox)
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def _attend(q, k, v, scale, allowed):
    """q (nq, H, D), k/v (nk, Hkv, D), allowed (nq, nk) -> (nq, H, D) in float32."""
    group = q.shape[1] // k.shape[1]
    kf = np.repeat(k.astype(f32), group, axis=1)
    vf = np.repeat(v.astype(f32), group, axis=1)
    s = np.einsum("qhd,khd->hqk", q.astype(f32), kf) * scale
    s = np.where(allowed[None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.where(allowed[None], np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-30)
    return np.einsum("hqk,khd->qhd", p, vf)


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, *, softmax_scale=None, window_left=-1,
                           out=None, softcap=0.0, return_lse=False):
    nb, bs, H, D = k_cache.shape
    for b in range(q.shape[0]):
        L = int(seq_lens[b])
        if L == 0:  # a padding row of a graph bucket
            out[b] = 0
            continue
        pos = np.arange(max(0, L - 1 - window_left) if window_left >= 0 else 0, L)
        slots = block_table[b, pos // bs] * bs + pos % bs
        k, v = k_cache.reshape(-1, H, D)[slots], v_cache.reshape(-1, H, D)[slots]
        out[b] = _attend(q[b:b + 1], k, v, softmax_scale, np.ones((1, len(pos)), bool))[0].astype(out.dtype)
    return out


def paged_prefill_attention(q, k_cache, v_cache, cu_q, seqused_k, block_table, max_q, max_k, *, causal=True,
                            softmax_scale=None, window_size=(-1, -1), out=None, softcap=0.0, return_lse=False):
    nb, bs, H, D = k_cache.shape
    cu_k = np.concatenate([[0], np.cumsum(seqused_k)])
    slots = np.concatenate([block_table[b, np.arange(n) // bs] * bs + np.arange(n) % bs
                            for b, n in enumerate(seqused_k)])
    return flash_attn_varlen(q, k_cache.reshape(-1, H, D)[slots], v_cache.reshape(-1, H, D)[slots], cu_q, cu_k,
                             max_q, max_k, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                             out=out)


def flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal=False, softmax_scale=None,
                      window_size=(-1, -1), out=None, softcap=0.0, return_lse=False):
    assert causal and window_size[1] in (0, -1)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        nq, nk = q1 - q0, k1 - k0
        qpos = np.arange(nq)[:, None] + (nk - nq)  # bottom-right aligned
        kpos = np.arange(nk)[None, :]
        allowed = kpos <= qpos
        if window_size[0] >= 0:
            allowed &= kpos >= qpos - window_size[0]
        out[q0:q1] = _attend(q[q0:q1], k[k0:k1], v[k0:k1], softmax_scale, allowed).astype(out.dtype)
    return out


@pytest.fixture
def fake_gpu(monkeypatch):
    import speedcore
    from speedcore.engine import sampler

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(sampler, "_gumbel_kernel", None)  # built from the fake, dropped after the test
    for fn in (rms_norm, linear, silu_and_mul, rotary_embedding, reshape_and_cache, rotary_embedding_and_cache,
               paged_decode_attention, flash_attn_varlen, paged_prefill_attention):
        monkeypatch.setattr(speedcore, fn.__name__, recorded(fn), raising=False)


def _hf(family, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100, max_position_embeddings=256, rms_norm_eps=1e-5,
                  head_dim=64)  # q size 256 != hidden 64: o_proj (64, 256)
    if family == "llama":
        cls, cfg = transformers.LlamaForCausalLM, transformers.LlamaConfig(
            **common, tie_word_embeddings=True, rope_parameters=dict(
                rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=16))
    elif family == "mistral":
        cls, cfg = transformers.MistralForCausalLM, transformers.MistralConfig(**common, sliding_window=8)
    elif family == "qwen2":
        cls, cfg = transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**common)
    else:
        cls, cfg = transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**common)
    torch.manual_seed(0)
    m = cls(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * (
                1.0 if "embed" in name else 0.1))
    m.save_pretrained(str(tmp_path), max_shard_size="20KB" if family == "qwen2" else "10GB")
    return m.eval()


@pytest.mark.parametrize("family, prefill", [("llama", "gather"), ("mistral", "gather"), ("qwen2", "gather"),
                                             ("qwen3", "gather"), ("llama", "paged"), ("mistral", "paged")])
def test_model_matches_transformers(family, prefill, tmp_path, fake_gpu, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("SPEEDCORE_ENGINE_PREFILL", prefill)
    hf = _hf(family, tmp_path)
    from speedcore.engine.llm import LLM

    ids = np.random.default_rng(0).integers(0, 100, 30).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    llm = LLM(str(tmp_path), dtype="float16", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              skip_tokenizer_init=True, num_gpu_blocks=32, block_size=4, enforce_eager=True)
    tol = 4e-3 * np.abs(ref).max()  # correct: ~1e-4 of max (fp16); a wrong rope scaling or window: > 2e-2
    start, got = llm._debug_logits(ids, 20)  # 20 prefill positions + 10 decode steps
    assert start == 0 and np.abs(got - ref).max() < tol
    start, got = llm._debug_logits(ids, 20, chunk=6)  # prefix hit (16 tokens), then a chunk over cached pages
    assert start == 16 and np.abs(got - ref[16:]).max() < tol
    llm.block_manager.reset_prefix_cache()
    start, got = llm._debug_logits(ids, 20, chunk=7)  # chunked prefill, no prefix hit
    assert start == 0 and np.abs(got - ref).max() < tol
    # batched generation (greedy, decode and prefill mixed) gives the teacher-forced argmax chain
    from speedcore.engine.sampling_params import SamplingParams

    outs = llm.generate([ids[:12], ids[:20], ids[:5]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    for o, n in zip(outs, (12, 20, 5)):
        chain = list(ids[:n])
        for _ in range(6):
            with torch.no_grad():
                chain.append(int(hf(torch.tensor([chain])).logits[0, -1].argmax()))
        assert o.outputs[0].token_ids == chain[n:]


def test_sampler_filters_and_seeds(fake_gpu):
    from speedcore.engine.sampler import sample
    from speedcore.engine.sampling_params import SamplingParams as SP

    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32)).view(GArr)
    n = 4000

    def freq(p, seed=3):
        toks = [int(sample(logits, [p], [seed], [t]).tokens[0]) for t in range(n)]
        return np.bincount(toks, minlength=4) / n

    assert np.abs(freq(SP(temperature=1.0)) - [0.5, 0.3, 0.15, 0.05]).max() < 0.03
    assert np.abs(freq(SP(temperature=1.0, top_k=2)) - [0.625, 0.375, 0, 0]).max() < 0.03
    assert np.abs(freq(SP(temperature=1.0, top_p=0.7)) - [0.625, 0.375, 0, 0]).max() < 0.03  # 0.5 + 0.3 >= 0.7
    assert np.abs(freq(SP(temperature=1.0, min_p=0.5)) - [0.625, 0.375, 0, 0]).max() < 0.03  # p >= 0.25
    assert freq(SP(temperature=0.0))[0] == 1.0
    # a request's draws depend on (seed, step) only: the same in any batch
    rows = np.repeat(logits, 3, axis=0).view(GArr)
    p = SP(temperature=1.0)
    a = sample(rows, [p, SP(temperature=0), p], [11, 0, 12], [5, 0, 5]).tokens
    assert a[0] == sample(logits, [p], [11], [5]).tokens[0] and a[2] == sample(logits, [p], [12], [5]).tokens[0]
    r = sample(logits, [SP(temperature=1.0, logprobs=2)], [1], [0])
    lp, top = r.logprobs[0]
    assert [t for t, _ in top] == [0, 1] and np.isclose(top[0][1], np.log(0.5), atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_graph_replay_matches_eager(family, tmp_path, fake_gpu):
    """The capture / replay wiring: static input layout, buckets, padding rows (with the fake capture)."""
    torch = pytest.importorskip("torch")
    _hf(family, tmp_path)
    from speedcore.engine.llm import LLM
    from speedcore.engine.sampling_params import SamplingParams

    ids = np.random.default_rng(0).integers(0, 100, 30).tolist()
    kw = dict(dtype="float16", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, skip_tokenizer_init=True,
              num_gpu_blocks=64, block_size=4, enable_prefix_caching=False)
    eager = LLM(str(tmp_path), enforce_eager=True, **kw)
    graphs = LLM(str(tmp_path), enforce_eager=False, **kw)
    assert sorted(graphs.runner.graphs) == [1, 2, 4] and not eager.runner.graphs
    _, a = eager._debug_logits(ids, 20)
    _, b = graphs._debug_logits(ids, 20)
    assert np.array_equal(a, b)
    prompts = [ids[:12], ids[:20], ids[:5]]  # three decoding together: bucket 4 with a padding row
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, sp, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in graphs.generate(prompts, sp, use_tqdm=False)]
    assert TAPE is None


def test_preset_random_weights(fake_gpu):
    from speedcore.engine.llm import LLM
    from speedcore.engine.sampling_params import SamplingParams

    llm = LLM("preset:tiny", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, num_gpu_blocks=16,
              enforce_eager=True)
    assert llm.tokenizer is None and llm.model.nbytes() == 2 * llm.config.num_params()
    assert np.all(llm.model.layers[0].in_norm == 1) and 0.015 < float(np.std(llm.model.layers[1].down.astype(np.float32))) < 0.025
    o, = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True, seed=2 ** 70), use_tqdm=False)
    assert len(o.outputs[0].token_ids) == 3 and o.error is None
