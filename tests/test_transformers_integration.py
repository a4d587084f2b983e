"""speedcore.integrations.transformers: registration, the module swap and the mask / unpadding logic on CPU (the
integration's PyTorch reference ops), and on the GPU the models against transformers' float32 reference."""
import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import speedcore.integrations.transformers as st  # noqa: E402


def _tiny(family, **over):
    """A tiny random config of one family (head_dim 64, GQA 4/2, two layers)."""
    base = dict(vocab_size=96, hidden_size=256, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=128, pad_token_id=0)
    if family == "llama":
        cfg = transformers.LlamaConfig(**base)
    elif family == "mistral":
        cfg = transformers.MistralConfig(**base, sliding_window=5)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**base, use_sliding_window=False)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**base)
    elif family == "gemma2":
        cfg = transformers.Gemma2Config(**base, attn_logit_softcapping=20.0, final_logit_softcapping=None,
                                        sliding_window=6, query_pre_attn_scalar=64)
    else:
        raise ValueError(family)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def _model(family, seed=0, **over):
    torch.manual_seed(seed)
    cfg = _tiny(family, **over)
    cls = transformers.AutoModelForCausalLM.from_config
    m = cls(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # larger weights than the default init, so attention is not uniform
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return m


def _ragged(batch=3, length=11, vocab=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for b in range(1, batch):
        mask[b, : 2 * b + 1] = 0  # left padding
        ids[b, : 2 * b + 1] = 0
    return ids, mask


# ------------------------------------------------------------------------------------------------- registration

def test_registered():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    st.register()
    st.register()  # idempotent
    assert AttentionInterface()["speedcore"] is st.attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["speedcore"] is st.attention_mask


def test_set_attn_implementation():
    m = _model("llama")
    m.set_attn_implementation("speedcore")
    assert m.config._attn_implementation == "speedcore"


# ----------------------------------------------------------------------------------------------------- the swap

@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_apply_replaces_modules_and_concatenates_weights(family):
    m = _model(family)
    layer0 = m.model.layers[0]
    q, k, v = (getattr(layer0.self_attn, n).weight.detach().clone() for n in ("q_proj", "k_proj", "v_proj"))
    biases = [getattr(layer0.self_attn, n).bias for n in ("q_proj", "k_proj", "v_proj")]
    gate, up = layer0.mlp.gate_proj.weight.detach().clone(), layer0.mlp.up_proj.weight.detach().clone()
    down = layer0.mlp.down_proj.weight
    o = layer0.self_attn.o_proj.weight
    norm_w = layer0.input_layernorm.weight
    head_w = m.lm_head.weight
    assert st.apply(m) is m
    assert m.config._attn_implementation == "speedcore"
    for layer in m.model.layers:
        assert isinstance(layer.self_attn, st.SpeedcoreAttention)
        assert isinstance(layer.mlp, st.SpeedcoreMLP)
        assert isinstance(layer.input_layernorm, st.SpeedcoreRMSNorm)
        assert isinstance(layer.post_attention_layernorm, st.SpeedcoreRMSNorm)
        assert layer.forward.__func__ is st._fused_decoder_forward
    assert isinstance(m.model.norm, st.SpeedcoreRMSNorm)
    assert isinstance(m.lm_head, st.SpeedcoreLinear)
    a = m.model.layers[0].self_attn
    assert torch.equal(a.qkv_weight, torch.cat([q, k, v]))
    if biases[0] is not None:
        assert torch.equal(a.qkv_bias, torch.cat([b.detach() for b in biases]))
    else:
        assert a.qkv_bias is None
    assert torch.equal(m.model.layers[0].mlp.gate_up_weight, torch.cat([gate, up]))
    # the rest are the original Parameters, not copies
    assert m.model.layers[0].mlp.down_weight is down
    assert a.o_weight is o
    assert m.model.layers[0].input_layernorm.weight is norm_w
    assert m.lm_head.weight is head_w
    if family == "qwen3":
        assert a.q_norm is not None and a.k_norm is not None
    if family == "mistral":
        assert a.window_left == 4
    keys = set(m.state_dict())
    assert not any(".q_proj." in k or ".gate_proj." in k for k in keys)
    assert "model.layers.0.self_attn.qkv_weight" in keys and "model.layers.0.mlp.gate_up_weight" in keys


def test_apply_frees_the_replaced_weights():
    import gc
    import weakref

    m = _model("llama")
    attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
    refs = [weakref.ref(t) for t in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
                                     mlp.gate_proj.weight, mlp.up_proj.weight)]
    del attn, mlp
    st.apply(m)
    gc.collect()
    assert all(r() is None for r in refs)


def test_dynamic_rope_keeps_transformers_rotary():
    ref = _model("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    ours = st.apply(copy.deepcopy(ref))
    assert ours.model.layers[0].self_attn.rope_cos_sin is None
    ids, mask = _ragged()
    valid = mask.bool()
    torch.testing.assert_close(_logits(ours, ids, mask)[valid], _logits(ref, ids, mask)[valid], rtol=1e-4,
                               atol=1e-4)


def test_apply_leaves_other_architectures():
    m = _model("gemma2")
    st.apply(m)
    assert not any(isinstance(x, (st.SpeedcoreAttention, st.SpeedcoreMLP, st.SpeedcoreRMSNorm)) for x in m.modules())


def test_rope_table_matches_transformers():
    m = _model("llama", rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 32})
    rot = m.model.rotary_emb
    table = st.rope_table(rot, 100, "cpu")
    pos = torch.arange(100)[None]
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    half = table.shape[1] // 2
    torch.testing.assert_close(table[:, :half], cos[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(table[:, half:], sin[0, :, :half], rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------ whole models on CPU

def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_applied_model_matches_transformers_cpu(family):
    ref = _model(family)
    ours = st.apply(copy.deepcopy(ref))
    ids, mask = _ragged()
    valid = mask.bool()
    torch.testing.assert_close(_logits(ours, ids, mask)[valid], _logits(ref, ids, mask)[valid], rtol=1e-4,
                               atol=1e-4)
    plain = ids[:1]
    torch.testing.assert_close(_logits(ours, plain, None), _logits(ref, plain, None), rtol=1e-4, atol=1e-4)
    for cache in ("dynamic", "static"):
        kw = dict(max_new_tokens=5, do_sample=False, cache_implementation=cache, pad_token_id=0)
        want = ref.generate(ids, attention_mask=mask, **kw)
        got = ours.generate(ids, attention_mask=mask, **kw)
        assert torch.equal(got, want), (cache, got[:, ids.shape[1]:], want[:, ids.shape[1]:])


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_attention_implementation_alone_cpu(family):
    """attn_implementation='speedcore' without apply(): transformers' own modules call attention_forward."""
    ref = _model(family)
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation("speedcore")
    ids, mask = _ragged()
    valid = mask.bool()
    torch.testing.assert_close(_logits(ours, ids, mask)[valid], _logits(ref, ids, mask)[valid], rtol=1e-4,
                               atol=1e-4)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, attention_mask=mask, **kw), ref.generate(ids, attention_mask=mask, **kw))


def test_compiled_static_generate_fullgraph_cpu():
    """The glue traces with fullgraph (dynamo only, the CPU reference ops inside): the mask object passes through
    the compiled forward, prefill and decode graphs give the eager tokens."""
    ours = st.apply(_model("llama"))
    ids, mask = _ragged()
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static")
    want, want_plain = ours.generate(ids, attention_mask=mask, **kw), ours.generate(ids[:1], **kw)
    torch._dynamo.reset()
    ours.forward = torch.compile(ours.forward, backend="eager", fullgraph=True)
    try:
        got, got_plain = ours.generate(ids, attention_mask=mask, **kw), ours.generate(ids[:1], **kw)
    finally:
        del ours.forward
        torch._dynamo.reset()
    assert torch.equal(got, want) and torch.equal(got_plain, want_plain)


# --------------------------------------------------------------------------------------------- mask and unpadding

def _dense_reference(q, key, value, valid_keys, q_pos, k_pos, scale, window_left, softcap):
    """Masked attention with an explicit (batch, q, k) mask: key j is seen by query i when it is valid, not after
    it, and (with a window) fewer than window_left + 1 positions before it."""
    batch, s, h, d = q.shape
    hk = key.shape[1]
    kf = key.float().repeat_interleave(h // hk, 1)
    vf = value.float().repeat_interleave(h // hk, 1)
    logits = torch.einsum("bqhd,bhkd->bhqk", q.float(), kf) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    ok = valid_keys[:, None, :] & (k_pos[None, None, :] <= q_pos[None, :, None])
    if window_left >= 0:
        ok &= q_pos[None, :, None] - k_pos[None, None, :] <= window_left
    logits = logits.masked_fill(~ok[:, None], float("-inf"))
    p = torch.softmax(logits, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bqhd", p, vf)


@pytest.mark.parametrize("case", ["prefill_left", "prefill_right", "prefill_plain", "static_prefill", "decode_left",
                                  "decode_static", "decode_sliding_offset", "chunk_with_past", "decode_dim32"])
@pytest.mark.parametrize("window_left", [-1, 3])
def test_mask_kinds_against_dense_reference(case, window_left):
    g = torch.Generator().manual_seed(hash(case) % 1000)
    batch, heads, kv_heads, d = 3, 4, 2, 64
    mask_len, q_len, kv_length, kv_offset = 9, 9, 9, 0
    pads = [0, 2, 5]
    if case == "prefill_right":
        pads = None
    if case == "static_prefill":
        kv_length = 14
    if case in ("decode_left", "decode_dim32"):
        q_len, mask_len, kv_length = 1, 10, 10
        d = 32 if case == "decode_dim32" else 64
    if case == "decode_static":
        q_len, mask_len, kv_length = 1, 7, 16
    if case == "decode_sliding_offset":  # a sliding-window cache holding the last 6 of 12 tokens
        q_len, mask_len, kv_length, kv_offset = 1, 12, 6, 6
        pads = [0, 7, 3]
    if case == "chunk_with_past":
        q_len, mask_len, kv_length = 3, 9, 9
    mask2d = torch.ones(batch, mask_len, dtype=torch.bool)
    if case == "prefill_right":
        mask2d[1, 6:] = False
        mask2d[2, 4:] = False
    elif case not in ("prefill_plain", "static_prefill"):
        for b, p in enumerate(pads):
            mask2d[b, :p] = False
    q = torch.randn(batch, q_len, heads, d, generator=g)
    key = torch.randn(batch, kv_heads, kv_length, d, generator=g)
    value = torch.randn(batch, kv_heads, kv_length, d, generator=g)
    m = st.make_mask(mask2d, batch, q_len, kv_length, mask_len - q_len, kv_offset, kv_heads=kv_heads, head_dim=d,
                     device="cpu")
    expected_kind = {"prefill_plain": None, "static_prefill": "slice", "decode_left": "paged",
                     "decode_static": "paged", "decode_sliding_offset": "paged"}.get(case, "varlen")
    assert (m.kind if m is not None else None) == expected_kind
    scale, cap = 0.125, (15.0 if case.startswith("decode") else 0.0)
    got = st.attend(q, key, value, m, scale, window_left, cap)
    k_pos = torch.arange(kv_length) + kv_offset
    valid_keys = torch.zeros(batch, kv_length, dtype=torch.bool)
    inside = k_pos < mask_len
    valid_keys[:, inside] = mask2d[:, k_pos[inside]]
    q_pos = torch.arange(mask_len - q_len, mask_len)
    want = _dense_reference(q, key, value, valid_keys, q_pos, k_pos, scale, window_left, cap)
    q_valid = mask2d[:, mask_len - q_len:]
    torch.testing.assert_close(got[q_valid], want[q_valid].to(got.dtype), rtol=1e-4, atol=1e-4)
    assert torch.isfinite(got).all()


def test_paged_mask_layout():
    mask2d = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    m = st.make_mask(mask2d, 2, 1, 6, 3, 0, kv_heads=2, head_dim=128, device="cpu")
    assert m.kind == "paged"
    assert m.seq_lens.tolist() == [4, 2] and m.seq_lens.dtype == torch.int32
    base = 2 * 6  # kv_heads x kv_length pages per sequence
    assert m.block_table[0, :4].tolist() == [0, 1, 2, 3]
    assert m.block_table[1, :2].tolist() == [base + 2, base + 3]
    assert m.block_table.dtype == torch.int32 and m.block_table.is_contiguous()


def test_varlen_mask_layout():
    mask2d = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    m = st.make_mask(mask2d, 3, 5, 5, 0, 0, kv_heads=1, head_dim=64, device="cpu")
    assert m.kind == "varlen"
    assert m.cu_seqlens_q.tolist() == [0, 5, 5, 8, 10, 13, 15] == m.cu_seqlens_k.tolist()
    rows, cols = m.q_index
    assert rows.tolist() == [0] * 5 + [1] * 5 + [2] * 5
    assert cols.tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 0, 1, 0, 1, 2, 3, 4]
    flat = rows * 5 + cols
    assert torch.equal(flat[m.q_inverse], torch.arange(15))


def test_mask_passes_through_when_prebuilt():
    m = st.SpeedcoreMask("paged", 1, 1, 4)
    cfg = _tiny("llama")
    assert st.attention_mask(1, 1, 4, attention_mask=m, config=cfg) is m
    assert m.ndim == 4 and m.shape == (1, 1, 1, 4)


def test_attention_forward_errors_name_the_argument():
    class M:
        is_causal = True

    q = torch.zeros(1, 2, 3, 64)
    with pytest.raises(ValueError, match="dropout"):
        st.attention_forward(M(), q, q[:, :1], q[:, :1], None, dropout=0.1)
    with pytest.raises(ValueError, match="is_causal"):
        st.attention_forward(M(), q, q[:, :1], q[:, :1], None, is_causal=False)
    with pytest.raises(TypeError, match="attention_mask"):
        st.attention_forward(M(), q, q[:, :1], q[:, :1], torch.ones(1, 1, 3, 3, dtype=torch.bool))


# ------------------------------------------------------------------------------------------------------ GPU tests

def _rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def _saved(tmp_path, family, **over):
    """A random model saved in float32 (the reference loads from it: casting a model would round RoPE's
    inv_freq)."""
    m = _model(family, **over)
    path = tmp_path / family
    m.save_pretrained(path)
    return path


def _load(path, impl, dtype):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=impl).cuda().eval()


GPU_FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
# head dim 128 with MQA; head dim 96 (decode on the varlen path: paged_decode_attention has 64 / 128 / 256)
_VARIANTS = {"llama_d128": dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=1, head_dim=128),
             "llama_d96": dict(hidden_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=96)}


def _family(name):
    return ("llama", _VARIANTS[name]) if name in _VARIANTS else (name, {})


@pytest.mark.gpu
@pytest.mark.parametrize("family", GPU_FAMILIES + ["gemma2", "llama_d128", "llama_d96"])
def test_logits_vs_float32_gpu(tmp_path, family):
    fam, over = _family(family)
    path = _saved(tmp_path, fam, **over)
    ref = _load(path, "eager", torch.float32)
    base_impl = "eager" if fam == "gemma2" else "sdpa"  # transformers' sdpa has no softcap
    base = _load(path, base_impl, torch.bfloat16)
    ours = _load(path, "speedcore", torch.bfloat16)
    if fam != "gemma2":
        st.apply(ours)
    ids, mask = _ragged(batch=4, length=37)
    ids, mask = ids.cuda(), mask.cuda()
    for m in (mask, None):
        valid = (m if m is not None else torch.ones_like(ids)).bool()
        want = _logits(ref, ids, m)[valid]
        e_ours = _rel_err(_logits(ours, ids, m)[valid], want)
        e_base = _rel_err(_logits(base, ids, m)[valid], want)
        assert e_ours <= 1.2 * e_base, (family, m is None, e_ours, e_base)


@pytest.mark.gpu
@pytest.mark.parametrize("family", GPU_FAMILIES + ["llama_d96"])
def test_generate_eager_and_compiled_gpu(tmp_path, family):
    """Greedy tokens: DynamicCache eager == StaticCache eager == StaticCache with transformers' compiled decode
    (fullgraph, CUDA graphs), on a left-padded batch and on one prompt; for Llama also with the whole forward
    compiled by hand (prefill and decode graphs)."""
    from transformers import CompileConfig

    fam, over = _family(family)
    path = _saved(tmp_path, fam, **over)
    ours = st.apply(_load(path, "speedcore", torch.bfloat16))
    ids, mask = _ragged(batch=3, length=21)
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    static = dict(cache_implementation="static")
    for i, (prompt, m) in enumerate(((ids, mask), (ids[:1], None))):
        dynamic = ours.generate(prompt, attention_mask=m, disable_compile=True, **kw)
        eager_static = ours.generate(prompt, attention_mask=m, disable_compile=True, **static, **kw)
        assert torch.equal(eager_static, dynamic)
        if i == 0 or family == "llama":  # each compilation costs device time: one per family, two for Llama
            compiled = ours.generate(prompt, attention_mask=m, compile_config=CompileConfig(fullgraph=True),
                                     **static, **kw)
            assert torch.equal(compiled, eager_static)
    if family == "llama":
        torch._dynamo.reset()
        ours.forward = torch.compile(ours.forward, fullgraph=True)
        try:
            got = ours.generate(ids, attention_mask=mask, disable_compile=True, **static, **kw)
        finally:
            del ours.forward
        assert torch.equal(got, ours.generate(ids, attention_mask=mask, disable_compile=True, **static, **kw))


@pytest.mark.gpu
def test_generate_matches_sdpa_tokens_gpu(tmp_path):
    """Greedy tokens of ours and of transformers' bf16 sdpa agree on a model whose logits are far from ties
    (a few tokens; random weights can have near-ties, where bf16 rounding may pick either)."""
    path = _saved(tmp_path, "llama")
    ours = st.apply(_load(path, "speedcore", torch.bfloat16))
    ref = _load(path, "eager", torch.float32)
    ids = _ragged(batch=1, length=16)[0].cuda()
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = ours.generate(ids, **kw)
    want = ref.generate(ids, **kw)
    # compare only up to the first position where the float32 reference's top-2 margin is small
    with torch.no_grad():
        logits = ref(want).logits[0, ids.shape[1] - 1: -1]
    top2 = logits.topk(2, -1).values
    safe = (top2[:, 0] - top2[:, 1] > 0.05).int().cumprod(0).sum().item()
    n = ids.shape[1]
    assert torch.equal(got[0, n: n + safe], want[0, n: n + safe])


@pytest.mark.gpu
def test_padded_decode_uses_no_kv_copy_gpu(tmp_path):
    """Decode steps read the cache in place (paged view), prefill without padding has no mask at all."""
    path = _saved(tmp_path, "llama")
    ours = st.apply(_load(path, "speedcore", torch.bfloat16))
    kinds = []
    orig = st.attend

    def spy(q, key, value, mask, *a):
        kinds.append(None if mask is None else mask.kind)
        return orig(q, key, value, mask, *a)

    st.attend = spy
    try:
        ids = _ragged(batch=1, length=8)[0].cuda()
        ours.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    finally:
        st.attend = orig
    n_layers = ours.config.num_hidden_layers
    assert kinds[:n_layers] == [None] * n_layers
    assert set(kinds[n_layers:]) == {"paged"}
