"""speedcore.quant.quantize_checkpoint without a GPU: a tiny random Llama checkpoint (safetensors + NumPy) quantized
to AWQ / GPTQ / INT8; the written tensors' names, dtypes and shapes and config.json's quantization_config against
AutoAWQ's WQLinear_GEMM / AutoGPTQ's QuantLinear conventions (their unpacking re-implemented here, independently of
speedcore.quant.formats), the dequantized weights against the originals within the quantization step."""
import json
import os

import numpy as np
import pytest

from speedcore.quant.checkpoint import _Writer, quantize_checkpoint

H, I, HEADS, KV, D, V, LAYERS = 128, 256, 2, 1, 64, 96, 2
LINEARS = {"self_attn.q_proj": (HEADS * D, H), "self_attn.k_proj": (KV * D, H), "self_attn.v_proj": (KV * D, H),
           "self_attn.o_proj": (H, HEADS * D), "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H),
           "mlp.down_proj": (H, I)}
INPUT_OF = {"self_attn.q_proj": "qkv", "self_attn.k_proj": "qkv", "self_attn.v_proj": "qkv", "self_attn.o_proj": "o",
            "mlp.gate_proj": "gate_up", "mlp.up_proj": "gate_up", "mlp.down_proj": "down"}


def tiny_llama_tensors(seed=0, qkv_bias=False):
    """float32 tensors of a tiny Llama (2 layers, hidden 128, 2 heads of 64, 1 KV head, vocabulary 96)."""
    rng = np.random.default_rng(seed)
    t = {"model.embed_tokens.weight": rng.standard_normal((V, H), dtype=np.float32),
         "model.norm.weight": 1 + 0.1 * rng.standard_normal(H, dtype=np.float32),
         "lm_head.weight": 0.1 * rng.standard_normal((V, H), dtype=np.float32)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        for name, shape in LINEARS.items():
            # columns of different scales, so that act-order has an order to find
            t[p + name + ".weight"] = (0.1 * rng.standard_normal(shape, dtype=np.float32)
                                       * rng.uniform(0.2, 2.0, shape[1]).astype(np.float32))
        if qkv_bias:
            for name in ("q", "k", "v"):
                t[p + f"self_attn.{name}_proj.bias"] = 0.1 * rng.standard_normal(LINEARS[f"self_attn.{name}_proj"][0],
                                                                                 dtype=np.float32)
        t[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(H, dtype=np.float32)
        t[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(H, dtype=np.float32)
    return t


def tiny_llama_config(**kw):
    return dict(dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=H, intermediate_size=I,
                     num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D,
                     vocab_size=V, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                     torch_dtype="float32", tie_word_embeddings=False, hidden_act="silu"), **kw)


def bf16_bits(a):
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_tiny_llama(d, dtype="float32", shard_bytes=None, seed=0, qkv_bias=False):
    """A tiny Llama checkpoint in directory ``d``: config.json, safetensors (one file, or shards of at most
    ``shard_bytes`` with an index), a tokenizer file and generation_config.json to be copied.  Returns the float32
    tensors (the values as stored, after rounding to ``dtype``)."""
    os.makedirs(d, exist_ok=True)
    t = tiny_llama_tensors(seed, qkv_bias)
    st = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[dtype]
    stored = {}
    for k, a in t.items():
        if dtype == "bfloat16":
            stored[k] = bf16_bits(a)
            t[k] = (stored[k].astype(np.uint32) << 16).view(np.float32)
        else:
            stored[k] = a.astype(dtype)
            t[k] = stored[k].astype(np.float32)
    w = _Writer(str(d), [(k, st, a.shape) for k, a in stored.items()], shard_bytes or 1 << 40)
    w.write(lambda k: stored[k])
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(tiny_llama_config(torch_dtype=dtype, attention_bias=qkv_bias), f)
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        f.write('{"fake": "tokenizer"}')
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 2}, f)
    return t


def read_all(d):
    """Every tensor of a checkpoint directory (through the safetensors library where torch is installed, an
    independent reader of the files we write; else speedcore's)."""
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    out, dtypes = {}, {}
    try:
        from safetensors import safe_open

        import torch  # noqa: F401
        for f in files:
            with safe_open(os.path.join(d, f), "pt") as sf:
                for k in sf.keys():
                    x = sf.get_tensor(k)
                    dtypes[k] = str(x.dtype).replace("torch.", "")
                    out[k] = x.view(torch.int16).numpy().view(np.uint16) if x.dtype == torch.bfloat16 else x.numpy()
    except ImportError:
        from speedcore.engine.checkpoint import Checkpoint

        ck = Checkpoint(d)
        for k, info in ck.tensors.items():
            out[k], dtypes[k] = ck.read(k), info.dtype
    return out, dtypes


# -- AutoAWQ's and AutoGPTQ's unpacking, as their own dequantizers do it (awq/utils/packing_utils.py's reverse
# order; auto_gptq qlinear_cuda_old's wf shifts), re-implemented here without speedcore.quant.formats ---------------
def awq_unpack(packed):
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    vals = (packed.view(np.uint32)[:, :, None] >> shifts) & 15  # nibble i of each word
    vals = vals.reshape(packed.shape[0], -1)
    reverse = [0, 4, 1, 5, 2, 6, 3, 7]  # AWQ_REVERSE_ORDER: channel j of a word sits in nibble reverse[j]
    idx = (np.arange(vals.shape[1]) // 8) * 8 + np.array(reverse * (vals.shape[1] // 8))
    return vals[:, idx].astype(np.float32)


def awq_dequant(qweight, qzeros, scales, g):
    w, z = awq_unpack(qweight), awq_unpack(qzeros)
    grp = np.arange(w.shape[0]) // g
    return (w - z[grp]) * scales.astype(np.float32)[grp]  # (K, N)


def gptq_dequant(qweight, qzeros, scales, g_idx):
    wf = np.arange(0, 32, 4, dtype=np.uint32)
    z = ((qzeros.view(np.uint32)[:, :, None] >> wf) & 15).reshape(qzeros.shape[0], -1).astype(np.float32) + 1
    w = ((qweight.view(np.uint32)[:, None, :] >> wf[None, :, None]) & 15).reshape(-1, qweight.shape[1])
    return scales.astype(np.float32)[g_idx] * (w.astype(np.float32) - z[g_idx])  # (K, N)


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "float"
    return str(d), write_tiny_llama(str(d))


def _check_copied(src_dir, dst_dir, orig, got, dtypes):
    for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
              "model.layers.1.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"):
        assert dtypes[k] == "float32" and np.array_equal(got[k], orig[k]), k
    assert open(os.path.join(dst_dir, "tokenizer.json")).read() == '{"fake": "tokenizer"}'
    assert json.load(open(os.path.join(dst_dir, "generation_config.json"))) == {"eos_token_id": 2}
    cfg = json.load(open(os.path.join(dst_dir, "config.json")))
    src_cfg = json.load(open(os.path.join(src_dir, "config.json")))
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == src_cfg
    return cfg["quantization_config"]


@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_format(src, tmp_path, group):
    src_dir, orig = src
    dst = str(tmp_path / "awq")
    qc = quantize_checkpoint(src_dir, dst, "awq", group, progress=False)
    got, dtypes = read_all(dst)
    assert _check_copied(src_dir, dst, orig, got, dtypes) == qc == {
        "quant_method": "awq", "zero_point": True, "group_size": group, "bits": 4, "version": "gemm",
        "modules_to_not_convert": None}
    assert sorted(os.listdir(dst)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    for layer in range(LAYERS):
        for name, (n, k) in LINEARS.items():
            p = f"model.layers.{layer}.{name}."
            assert p + "weight" not in got
            assert (dtypes[p + "qweight"], got[p + "qweight"].shape) == ("int32", (k, n // 8))
            assert (dtypes[p + "qzeros"], got[p + "qzeros"].shape) == ("int32", (k // group, n // 8))
            assert (dtypes[p + "scales"], got[p + "scales"].shape) == ("float16", (k // group, n))
            w = awq_dequant(got[p + "qweight"], got[p + "qzeros"], got[p + "scales"], group)
            from speedcore.quant.formats import dequantize_awq_reference

            assert np.array_equal(w, dequantize_awq_reference(got[p + "qweight"], got[p + "qzeros"],
                                                              got[p + "scales"], group))
            step = got[p + "scales"].astype(np.float32)[np.arange(k) // group]
            err = np.abs(w - orig[p + "weight"].T)
            assert np.all(err <= step * 0.51)  # half a step (and the scale's float16 rounding)
            assert err.mean() < 0.3 * step.mean()  # round to nearest: ~step / 4 on average


@pytest.mark.parametrize("group, desc_act, sym", [(128, False, True), (32, True, True), (64, False, False),
                                                  (-1, False, True), (64, True, False)])
def test_gptq_format(src, tmp_path, group, desc_act, sym):
    src_dir, orig = src
    dst = str(tmp_path / "gptq")
    qc = quantize_checkpoint(src_dir, dst, "gptq", group, desc_act=desc_act, sym=sym, progress=False)
    got, dtypes = read_all(dst)
    expect = {"bits": 4, "group_size": group, "damp_percent": 0.01, "desc_act": desc_act, "static_groups": False,
              "sym": sym, "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model",
              "quant_method": "gptq", "checkpoint_format": "gptq"}
    assert _check_copied(src_dir, dst, orig, got, dtypes) == qc == expect
    assert json.load(open(os.path.join(dst, "quantize_config.json"))) == expect
    for layer in range(LAYERS):
        g_by_input = {}
        for name, (n, k) in LINEARS.items():
            p = f"model.layers.{layer}.{name}."
            g = k if group == -1 else group
            ng = -(-k // g)
            assert (dtypes[p + "qweight"], got[p + "qweight"].shape) == ("int32", (k // 8, n))
            assert (dtypes[p + "qzeros"], got[p + "qzeros"].shape) == ("int32", (ng, n // 8))
            assert (dtypes[p + "scales"], got[p + "scales"].shape) == ("float16", (ng, n))
            assert (dtypes[p + "g_idx"], got[p + "g_idx"].shape) == ("int32", (k,))
            gi = got[p + "g_idx"]
            if desc_act:  # an act-order: each group holds G input rows, not the consecutive ones
                assert np.array_equal(np.bincount(gi, minlength=ng), np.bincount(np.arange(k) // g, minlength=ng))
                assert not np.array_equal(gi, np.arange(k) // g)
            else:
                assert np.array_equal(gi, np.arange(k) // g)
            if sym:  # zero 8, stored as 7 in every nibble
                assert np.all(got[p + "qzeros"].view(np.uint32) == 0x77777777)
            w = gptq_dequant(got[p + "qweight"], got[p + "qzeros"], got[p + "scales"], gi)
            from speedcore.quant.formats import dequantize_gptq_reference

            assert np.array_equal(w, dequantize_gptq_reference(got[p + "qweight"], got[p + "qzeros"],
                                                               got[p + "scales"], gi, g))
            step = got[p + "scales"].astype(np.float32)[gi]
            err = np.abs(w - orig[p + "weight"].T)
            # half a step; asymmetric: zero points start at 1 (stored zero - 1 >= 0), a step at the top end
            assert np.all(err <= step * (0.51 if sym else 1.01))
            g_by_input.setdefault(INPUT_OF[name], []).append(gi)
        # q/k/v read one input, gate/up another: one act-order each (their Hessian is the same)
        for gis in g_by_input.values():
            assert all(np.array_equal(gis[0], x) for x in gis)


def test_int8_format(src, tmp_path):
    src_dir, orig = src
    dst = str(tmp_path / "int8")
    qc = quantize_checkpoint(src_dir, dst, "int8", progress=False)
    got, dtypes = read_all(dst)
    assert _check_copied(src_dir, dst, orig, got, dtypes) == qc == {
        "quant_method": "speedcore_int8", "bits": 8, "group_size": -1, "sym": True, "modules_to_not_convert": None}
    from speedcore.quant.formats import dequantize_int8_reference

    for name, (n, k) in LINEARS.items():
        p = f"model.layers.0.{name}."
        assert (dtypes[p + "weight"], got[p + "weight"].shape) == ("int8", (n, k))
        assert (dtypes[p + "weight_scale"], got[p + "weight_scale"].shape) == ("float16", (n,))
        w = dequantize_int8_reference(got[p + "weight"], got[p + "weight_scale"])
        s = got[p + "weight_scale"].astype(np.float32)
        assert np.all(np.abs(w - orig[p + "weight"].T) <= 0.51 * s[None, :])


def test_sharded_bf16_source_and_output(tmp_path):
    """A bf16 source in shards (index.json): copied tensors keep their bf16 bits; output sharded with an index."""
    src_dir = str(tmp_path / "bf16")
    orig = write_tiny_llama(src_dir, "bfloat16", shard_bytes=60_000)
    assert os.path.isfile(os.path.join(src_dir, "model.safetensors.index.json"))
    dst = str(tmp_path / "awq")
    quantize_checkpoint(src_dir, dst, "awq", 64, progress=False, max_shard_size="50KB")
    index = json.load(open(os.path.join(dst, "model.safetensors.index.json")))
    got, dtypes = read_all(dst)
    assert set(index["weight_map"]) == set(got) and len(set(index["weight_map"].values())) > 1
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in got.values())
    assert dtypes["model.embed_tokens.weight"] == "bfloat16"
    assert np.array_equal(got["model.embed_tokens.weight"], bf16_bits(orig["model.embed_tokens.weight"]))
    from speedcore.quant.formats import dequantize_awq_reference

    p = "model.layers.1.mlp.down_proj."
    w = dequantize_awq_reference(got[p + "qweight"], got[p + "qzeros"], got[p + "scales"], 64)
    step = got[p + "scales"].astype(np.float32)[np.arange(I) // 64]
    assert np.all(np.abs(w - orig[p + "weight"].T) <= step + 1e-6)


def test_biases_and_modules_to_not_convert(tmp_path):
    src_dir = str(tmp_path / "f")
    orig = write_tiny_llama(src_dir, qkv_bias=True)
    dst = str(tmp_path / "q")
    qc = quantize_checkpoint(src_dir, dst, "gptq", 64, progress=False, modules_to_not_convert=["layers.1.mlp"])
    got, dtypes = read_all(dst)
    assert qc["modules_to_not_convert"] == ["layers.1.mlp"]
    b = "model.layers.0.self_attn.k_proj.bias"
    assert dtypes[b] == "float16" and np.array_equal(got[b], orig[b].astype(np.float16))  # AutoGPTQ: bias.half()
    assert "model.layers.1.mlp.down_proj.weight" in got and "model.layers.1.mlp.down_proj.qweight" not in got
    assert "model.layers.1.self_attn.o_proj.qweight" in got


def test_transformers_reads_the_configs(src, tmp_path):
    """transformers' AwqConfig / GPTQConfig take the written quantization_config (loading the model itself needs
    their optional kernel packages, which the engine does not use)."""
    transformers = pytest.importorskip("transformers")
    src_dir, _ = src
    quantize_checkpoint(src_dir, str(tmp_path / "a"), "awq", 64, progress=False)
    quantize_checkpoint(src_dir, str(tmp_path / "g"), "gptq", 32, desc_act=True, progress=False)
    a = transformers.AwqConfig.from_dict(json.load(open(tmp_path / "a" / "config.json"))["quantization_config"])
    g = transformers.GPTQConfig.from_dict(json.load(open(tmp_path / "g" / "config.json"))["quantization_config"])
    a = a.to_dict()  # transformers 5 keeps AWQ's version as format (and version) in to_dict
    assert (a["bits"], a["group_size"], a["zero_point"], str(a.get("version", a.get("format"))).lower()) == (
        4, 64, True, "gemm")
    assert (g.bits, g.group_size, g.desc_act, g.sym) == (4, 32, True, True)


def test_errors(src, tmp_path):
    src_dir, _ = src
    with pytest.raises(ValueError, match="method"):
        quantize_checkpoint(src_dir, str(tmp_path / "x"), "nf4", progress=False)
    with pytest.raises(ValueError, match="group_size: 96 does not divide"):
        quantize_checkpoint(src_dir, str(tmp_path / "x"), "awq", 96, progress=False)
    with pytest.raises(ValueError, match="group_size: AutoAWQ"):
        quantize_checkpoint(src_dir, str(tmp_path / "x"), "awq", -1, progress=False)
    with pytest.raises(ValueError, match="desc_act"):
        quantize_checkpoint(src_dir, str(tmp_path / "x"), "awq", desc_act=True, progress=False)
    with pytest.raises(ValueError, match="dst_dir"):
        quantize_checkpoint(src_dir, src_dir, "awq", progress=False)
    quantize_checkpoint(src_dir, str(tmp_path / "q"), "awq", 64, progress=False)
    with pytest.raises(ValueError, match="already has a quantization_config"):
        quantize_checkpoint(str(tmp_path / "q"), str(tmp_path / "qq"), "awq", progress=False)


def test_cli(src, tmp_path, capsys):
    from speedcore.cli import main

    src_dir, _ = src
    dst = str(tmp_path / "cli")
    assert main(["quantize", src_dir, dst, "--method", "gptq", "--group-size", "64", "--desc-act",
                 "--no-progress"]) == 0
    cfg = json.load(open(os.path.join(dst, "config.json")))["quantization_config"]
    assert (cfg["quant_method"], cfg["group_size"], cfg["desc_act"]) == ("gptq", 64, True)
    assert "quantization_config" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="group_size"):
        main(["quantize", src_dir, str(tmp_path / "bad"), "--group-size", "96", "--no-progress"])
