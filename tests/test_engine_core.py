"""speedcore.engine without a GPU: sampling parameters, config parsing per family, checkpoint index, tokenizer."""
import json

import numpy as np
import pytest

from speedcore.engine.checkpoint import Checkpoint, CheckpointError, to_dtype_bits
from speedcore.engine.config import ConfigError, load_config, parse_config, preset_config
from speedcore.engine.sampling_params import SamplingParams

LLAMA = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=100, rms_norm_eps=1e-5, rope_theta=500000.0,
             max_position_embeddings=256, torch_dtype="bfloat16", eos_token_id=[1, 2], bos_token_id=0)


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"), (dict(min_p=2), "min_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(stop=3), "stop"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(seed="x"), "seed"), (dict(logprobs=-1), "logprobs"),
    (dict(ignore_eos=1), "ignore_eos"), (dict(temperature=float("nan")), "temperature"), (dict(n=2), "n")])
def test_sampling_params_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}:"):
        SamplingParams(**kw)


def test_sampling_params_defaults():
    p = SamplingParams(temperature=0, stop="END", stop_token_ids=(7,), max_tokens=None)
    assert p.greedy and p.stop_strings == ["END"] and p.stop_token_ids == [7] and p.top_k == -1
    assert SamplingParams().stop_strings == [] and not SamplingParams().greedy


def test_config_llama3_rope_scaling_and_tied():
    cfg = dict(LLAMA, tie_word_embeddings=True, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                                   high_freq_factor=4.0,
                                                                   original_max_position_embeddings=64))
    mc = parse_config(cfg)
    assert (mc.family, mc.head_dim, mc.num_kv_heads, mc.eos_token_ids) == ("llama", 16, 2, [1, 2])
    assert "lm_head.weight" not in mc.weight_shapes() and not mc.qkv_bias and not mc.qk_norm
    base = 1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16)
    inv = mc.inv_freq()
    wavelen = 2 * np.pi / base
    assert np.allclose(inv[wavelen < 64 / 4], base[wavelen < 64 / 4])  # high frequencies untouched
    assert np.allclose(inv[wavelen > 64], base[wavelen > 64] / 8)  # low frequencies divided by the factor
    cs = mc.cos_sin_cache(10)
    assert cs.shape == (10, 16) and cs.dtype == np.float32 and np.allclose(cs[0], [1] * 8 + [0] * 8)
    # transformers 5's rope_parameters
    mc5 = parse_config(dict(LLAMA, rope_theta=None, rope_parameters=dict(cfg["rope_scaling"], rope_theta=500000.0)))
    assert np.allclose(mc5.inv_freq(), inv)


def test_config_families():
    mistral = parse_config(dict(LLAMA, architectures=["MistralForCausalLM"], sliding_window=32))
    assert mistral.family == "mistral" and mistral.window_left == [31, 31]
    qwen2 = parse_config(dict(LLAMA, architectures=["Qwen2ForCausalLM"], sliding_window=32, use_sliding_window=False))
    assert qwen2.qkv_bias and qwen2.window_left == [-1, -1]
    assert "model.layers.0.self_attn.k_proj.bias" in qwen2.weight_shapes()
    qwen3 = parse_config(dict(LLAMA, architectures=["Qwen3ForCausalLM"], head_dim=32))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.q_size == 128
    assert qwen3.weight_shapes()["model.layers.1.self_attn.q_norm.weight"] == (32,)
    assert qwen3.weight_shapes()["model.layers.1.self_attn.o_proj.weight"] == (64, 128)
    assert preset_config("llama-3-8b").num_params() == pytest.approx(8.03e9, rel=0.01)


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not supported; supported: LlamaForCausalLM, MistralForCausalLM"):
        parse_config(dict(LLAMA, architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ConfigError, match="rope_scaling: type 'yarn'"):
        parse_config(dict(LLAMA, rope_scaling=dict(type="yarn", factor=2.0)))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        parse_config(dict(LLAMA, num_key_value_heads=3))
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    (tmp_path / "generation_config.json").write_text(json.dumps(dict(eos_token_id=[2, 9])))
    assert load_config(str(tmp_path)).eos_token_ids == [2, 9]


def _write_checkpoint(d, shapes, shards=1, dtype=np.float32, drop=(), reshape=None):
    from safetensors.numpy import save_file

    names = sorted(shapes)
    rng = np.random.default_rng(0)
    data = {n: rng.standard_normal(shapes[n]).astype(dtype) for n in names if n not in drop}
    if reshape:
        data[reshape] = np.zeros((3,), dtype)
    if shards == 1:
        save_file(data, str(d / "model.safetensors"))
        return data
    weight_map = {}
    for i in range(shards):
        part = {n: data[n] for j, n in enumerate(sorted(data)) if j % shards == i}
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(d / fname))
        weight_map.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps(dict(metadata={}, weight_map=weight_map)))
    return data


@pytest.mark.parametrize("shards", [1, 3])
def test_checkpoint_index(tmp_path, shards):
    mc = parse_config(LLAMA)
    data = _write_checkpoint(tmp_path, mc.weight_shapes(), shards)
    ck = Checkpoint(str(tmp_path))
    ck.check(mc.weight_shapes())
    assert len(ck.files) == shards and sum(len(v) for v in ck.by_file(data).values()) == len(data)
    name = "model.layers.1.mlp.up_proj.weight"
    assert np.array_equal(ck.read(name), data[name]) and ck.tensors[name].dtype == "float32"


def test_checkpoint_errors(tmp_path):
    mc = parse_config(LLAMA)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        Checkpoint(str(tmp_path))
    _write_checkpoint(tmp_path, mc.weight_shapes(), drop=("model.norm.weight",),
                      reshape="model.layers.0.input_layernorm.weight")
    ck = Checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"1 missing tensors: model.norm.weight; 1 mis-shaped tensors: "
                                              r"model.layers.0.input_layernorm.weight: \(3,\) \(expected \(64,\)\)"):
        ck.check(mc.weight_shapes())
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 20)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        Checkpoint(str(tmp_path))


def test_dtype_bits():
    x = np.array([1.0, -2.5, 3.14159, 1e-3], np.float32)
    bf = to_dtype_bits(x, "float32", "bfloat16")
    back = (bf.astype(np.uint32) << 16).view(np.float32)
    assert bf.dtype == np.uint16 and np.allclose(back, x, rtol=1 / 128)
    assert np.array_equal(to_dtype_bits(bf, "bfloat16", "float16"), back.astype(np.float16))


# -- tokenizer ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    d = tmp_path_factory.mktemp("tok")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox", "héllo wörld"] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(d / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps(dict(bos_token="<s>", eos_token={"content": "</s>"},
                                                             chat_template=template)))
    return str(d)


def test_tokenizer_and_chat_template(tok_dir):
    from speedcore.engine.tokenizer import Tokenizer

    t = Tokenizer(tok_dir)
    ids = t.encode("hello world")
    assert ids[0] == 0 == t.bos_token_id and t.eos_token_id == 1 and t.decode(ids) == "hello world"
    text = t.apply_chat_template([dict(role="user", content="hi")])
    assert text == "<s><user>hi</s><assistant>"


def test_incremental_detokenizer_never_splits_characters(tok_dir):
    from speedcore.engine.tokenizer import IncrementalDetokenizer, Tokenizer

    t = Tokenizer(tok_dir)
    text = "hello 😀 wörld 日本語 fox"
    ids = t.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # the emoji and CJK characters are several byte tokens each
    prompt = t.encode("the quick")
    det = IncrementalDetokenizer(t, prompt)
    pieces = [det.add(i) for i in ids]
    pieces.append(det.flush())
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) == text == det.text


def _metaspace_dir(tmp_path):
    """A SentencePiece-style tokenizer (Metaspace, byte fallback): the one that drops a leading space when a token
    is decoded alone (Llama 2, Mistral)."""
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(["hello world, the quick brown fox", "héllo wörld"] * 20, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"] + bytes_))
    tok.save(str(tmp_path / "tokenizer.json"))
    return str(tmp_path)


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_incremental_detokenizer_stream_path_matches_the_window_path(kind, tok_dir, tmp_path):
    """The DecodeStream path gives the same pieces as the two-decode window path, token by token, special tokens
    skipped or kept, through ids past the vocabulary (ignored by both, as decode does) and through a fall-back to
    the window path mid-stream."""
    from speedcore.engine import tokenizer as T

    if T._DecodeStream is None:
        pytest.skip("tokenizers < 0.21: no DecodeStream")
    t = T.Tokenizer(tok_dir if kind == "byte-level" else _metaspace_dir(tmp_path))
    rng = np.random.default_rng(0)
    text = "hello 😀 wörld 日本語 fox, the  quick"
    script = t.encode(text, add_special_tokens=False) + [1, 2] + rng.integers(0, t.vocab_size, 200).tolist()
    prompt = t.encode("the quick")
    for skip in (True, False):
        fast, slow = T.IncrementalDetokenizer(t, prompt, skip), T.IncrementalDetokenizer(t, prompt, skip)
        slow._stream = None
        assert fast._stream is not None
        for i in script:
            assert fast.add(i) == slow.add(i)
        if kind == "byte-level":  # Metaspace's Strip decoder can make a window's text no prefix of the next
            assert fast._stream is not None  # one: DecodeStream raises, and the window path takes over
        assert fast.flush() == slow.flush() and fast.text == slow.text
        assert "wörld" in fast.text and "fox, the  quick" in fast.text
    det, ref = T.IncrementalDetokenizer(t, prompt), T.IncrementalDetokenizer(t, prompt)
    ref._stream = None
    pieces = [det.add(i) for i in script[:5]]
    class Broken:  # what DecodeStream raises on (e.g. a window whose text is no prefix of the next one)
        def step(self, tok, i):
            raise Exception("DecodeStreamError")

    det._stream = Broken()  # the window path continues from the same offsets
    pieces += [det.add(i) for i in script[5:]] + [det.flush()]
    assert det._stream is None
    assert pieces == [ref.add(i) for i in script] + [ref.flush()]


def test_missing_tokenizer(tmp_path):
    from speedcore.engine.tokenizer import Tokenizer, TokenizerError

    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer(str(tmp_path))


@pytest.mark.parametrize("vocab", [128256, 32000, 151936, 10007, 9000])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_argmax_rows_matches_argmax(vocab, rows):
    """The two-pass argmax: the first index of the maximum, ties and NaN as numpy's, odd vocabularies padded."""
    from speedcore.engine.sampler import argmax_rows

    rng = np.random.default_rng(vocab + rows)
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    x[0, [7, vocab - 1]] = 50.0                  # a tie: the first wins
    if rows > 1:
        x[1, [vocab // 2, vocab - 3]] = np.nan   # NaN: the first NaN, as numpy
    if rows > 2:
        x[2, :] = -np.inf
    got = argmax_rows(x, np)
    assert got.tolist() == np.argmax(x, axis=1).tolist()
