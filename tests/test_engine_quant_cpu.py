"""The engine on quantized checkpoints without a GPU: quantization_config parsing and its errors, the loader's fused
host-side arrays (dequantized: exactly the checkpoint's modules side by side), and the model on the CPU stand-ins of
tests/test_engine_model_cpu.py (NumPy for CuPy and the kernels; here also for speedcore.quant's prepack and linears)
against transformers' float32 model built from the dequantized weights."""
import json
import os
from dataclasses import dataclass

import numpy as np
import pytest

from speedcore.engine.checkpoint import Checkpoint
from speedcore.engine.config import ConfigError, load_config, parse_config, preset_config
from speedcore.engine.quantization import (QuantConfigError, dequantize_host, parse_quantization, prepacked_nbytes,
                                           read_quant_linear)
from speedcore.quant.checkpoint import quantize_checkpoint

from test_engine_model_cpu import GArr, fake_gpu  # noqa: F401  (the fixture)
from test_quant_checkpoint import LAYERS, LINEARS, tiny_llama_config, write_tiny_llama

# teacher-forced logits against transformers' float32: the float16 stand-ins' own rounding reaches ~5e-3 of the
# largest logit on this model (the float checkpoint alike); a wrong fusion or packing is off by O(1)
TOL = 6e-3
GROUPS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
          "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def module_weight(ck, qc, mod, k):
    """The float32 weight (K, N) of one checkpoint module, dequantized with the reference dequantizers."""
    return dequantize_host(read_quant_linear(ck, [mod], qc, k, "float16"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("q")
    src = str(d / "float")
    write_tiny_llama(src, qkv_bias=False)
    out = {"float": src}
    for name, method, g, kw in (("awq32", "awq", 32, {}), ("awq128", "awq", 128, {}), ("gptq64", "gptq", 64, {}),
                                ("gptq_act", "gptq", 32, dict(desc_act=True)), ("gptq_asym_all", "gptq", -1,
                                                                               dict(sym=False)),
                                ("int8", "int8", -1, {})):
        out[name] = str(d / name)
        quantize_checkpoint(src, out[name], method, g, progress=False, **kw)
    return out


@pytest.mark.parametrize("name", ["awq32", "awq128", "gptq64", "gptq_act", "gptq_asym_all", "int8"])
def test_fused_host_arrays_dequantize_to_the_parts(checkpoints, name):
    d = checkpoints[name]
    mc = load_config(d)
    ck = Checkpoint(d)
    ck.check(mc.weight_shapes(), mc.weight_dtypes())
    qc = mc.quantization
    for layer in range(LAYERS):
        for group, mods in GROUPS.items():
            k = LINEARS[mods[0]][1]
            names = [f"model.layers.{layer}.{m}" for m in mods]
            hl = read_quant_linear(ck, names, qc, k, "float16")
            assert len(hl.parts) == 1  # act-order parts share their g_idx (one input): fused too
            assert hl.out_features == sum(LINEARS[m][0] for m in mods) and hl.part_features == [hl.out_features]
            ref = np.concatenate([module_weight(ck, qc, n, k) for n in names], axis=1)
            assert np.array_equal(dequantize_host(hl), ref)
            p = hl.parts[0]
            if qc.method == "gptq" and qc.desc_act:
                assert p["g_idx"] is not None
            elif qc.method == "gptq":
                assert p["g_idx"] is None  # the stored g_idx is k // G: the plain layout


def separate_act_order_checkpoint(checkpoints, tmp_path):
    """The act-order checkpoint with layer 0's k_proj given an act-order of its own (unlike q and v)."""
    import shutil

    from speedcore.engine.checkpoint import read_header
    from speedcore.quant.checkpoint import _Writer
    from speedcore.quant.formats import quantize_gptq

    d = str(tmp_path / "sep")
    shutil.copytree(checkpoints["gptq_act"], d)
    path = os.path.join(d, "model.safetensors")
    ck = Checkpoint(d)
    tensors = {n: ck.read(n) for n in ck.tensors}
    rng = np.random.default_rng(5)
    w = 0.1 * rng.standard_normal((64, 128)).astype(np.float32)  # the size of the other weights
    qw, qz, sc, gi = quantize_gptq(w, 32, perm=rng.permutation(128))
    for suffix, a in zip(("qweight", "qzeros", "scales", "g_idx"), (qw, qz, sc, gi)):
        tensors[f"model.layers.0.self_attn.k_proj.{suffix}"] = a
    hdr = read_header(path)
    st = {"float16": "F16", "float32": "F32", "int32": "I32", "bfloat16": "BF16"}
    plan = [(n, st[hdr[n].dtype], tensors[n].shape) for n in tensors]
    _Writer(d, plan, 1 << 40).write(lambda n: tensors[n])
    return d


def test_act_order_parts_that_differ_stay_separate(checkpoints, tmp_path):
    """GPTQ act-order q/k/v with different g_idx (each module its own order): three GEMMs, outputs side by side."""
    d = separate_act_order_checkpoint(checkpoints, tmp_path)
    ck = Checkpoint(d)
    qc = load_config(d).quantization
    names = [f"model.layers.0.{m}" for m in GROUPS["qkv"]]
    hl = read_quant_linear(ck, names, qc, 128, "float16")
    assert hl.part_features == [128, 64, 64]
    ref = np.concatenate([module_weight(ck, qc, n, 128) for n in names], axis=1)
    assert np.array_equal(dequantize_host(hl), ref)


BAD = [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported; supported: awq, gptq"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv", "zero_point": True},
     "quantization_config.version 'gemv' is not supported for awq (supported: gemm)"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama", "zero_point": True},
     "version 'exllama' is not supported"),
    ({"quant_method": "awq", "w_bit": 3, "q_group_size": 128, "version": "gemm", "zero_point": True},
     "quantization_config.w_bit 3 is not supported for awq (supported: 4)"),
    ({"quant_method": "awq", "bits": 4, "group_size": 256, "version": "gemm", "zero_point": True},
     "quantization_config.group_size 256 is not supported for awq (supported: 32, 64, 128)"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": False},
     "zero_point false is not supported"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "quantization_config.bits 8 is not supported for gptq"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin' is not supported for gptq (supported: gptq)"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"}, "'gptq_v2'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True}, "is_marlin_format"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "group_size 16 is not supported for gptq (supported: 32, "
                                                            "64, 128, -1)"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": "yes"}, "desc_act must be true or false"),
    ({"quant_method": "speedcore_int8", "bits": 4}, "bits 4 is not supported for speedcore_int8 (supported: 8)"),
    ({"quant_method": "speedcore_int8", "bits": 8, "group_size": 128}, "group_size 128 is not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "'compressed-tensors' is not supported"),
]


@pytest.mark.parametrize("qc, message", BAD)
def test_unsupported_configs_raise_naming_the_field(qc, message):
    with pytest.raises(QuantConfigError) as e:
        parse_quantization(qc)
    assert message in str(e.value)
    with pytest.raises(ConfigError, match="quantization_config"):  # through the model config too
        parse_config(tiny_llama_config(quantization_config=qc))


def test_supported_config_variants():
    assert parse_quantization(None) is None
    q = parse_quantization({"quant_method": "AWQ", "w_bit": 4, "q_group_size": 64, "version": "GEMM",
                            "zero_point": True, "modules_to_not_convert": None})
    assert (q.method, q.bits, q.group_size) == ("awq", 4, 64)
    q = parse_quantization({"quant_method": "awq", "bits": 4, "group_size": 32, "format": "gemm"})  # transformers 5
    assert q.group_size == 32
    q = parse_quantization({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": True, "sym": False,
                            "format": "gptq", "damp_percent": 0.1, "use_exllama": True})
    assert (q.group_size, q.desc_act, q.sym) == (-1, True, False)
    with pytest.raises(ConfigError, match="not a multiple of 8"):  # a shape the packing cannot store
        parse_config(tiny_llama_config(intermediate_size=252, quantization_config={
            "quant_method": "awq", "bits": 4, "group_size": 32}))
    with pytest.raises(ConfigError, match="keeps only some of layer 0's qkv parts float"):
        parse_config(tiny_llama_config(quantization_config={
            "quant_method": "awq", "bits": 4, "group_size": 32, "modules_to_not_convert": ["layers.0.self_attn.q"]}))
    with pytest.raises(ConfigError, match="quantization: 'nf4' is not supported"):
        preset_config("tiny", "nf4")


def test_older_autogptq_quantize_config_json(checkpoints, tmp_path):
    import shutil

    d = str(tmp_path / "old")
    shutil.copytree(checkpoints["gptq64"], d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    del cfg["quantization_config"]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    q = load_config(d).quantization
    assert (q.method, q.group_size) == ("gptq", 64)


# -- the model on CPU stand-ins ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class FakePrepacked:
    """speedcore.quant's prepacked weight, stood in for: the stored arrays as given."""
    method: str
    arrays: dict
    group_size: int


def fake_quant(monkeypatch):
    """prepack_* / *_linear of speedcore.quant as NumPy: the reference dequantizer, float32 math, rounded once to
    x's dtype (as the kernels round their float32 accumulators)."""
    from speedcore import quant as Q
    from speedcore.quant import formats as F

    calls = []

    def pre(method):
        def prepack(*arrays, group_size=128, dtype=None, copies=None):
            calls.append((method, copies))
            names = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx"),
                     "int8": ("weight", "scales")}[method]
            return FakePrepacked(method, {n: (None if a is None else np.asarray(a)) for n, a in zip(names, arrays)},
                                 group_size)
        return prepack

    def lin(method):
        def linear(x, w, *, bias=None):
            a, g = w.arrays, w.group_size
            if method == "awq":
                W = F.dequantize_awq_reference(a["qweight"], a["qzeros"], a["scales"], g)
            elif method == "gptq":
                W = F.dequantize_gptq_reference(a["qweight"], a["qzeros"], a["scales"], a["g_idx"], g)
            else:
                W = F.dequantize_int8_reference(a["weight"], a["scales"])
            y = np.asarray(x, np.float32) @ W
            if bias is not None:
                y = y + bias.astype(np.float32)
            return y.astype(x.dtype).view(GArr)
        return linear

    for m in ("awq", "gptq", "int8"):
        monkeypatch.setattr(Q, f"prepack_{m}", pre(m))
        monkeypatch.setattr(Q, f"{m}_linear", lin(m))
    return calls


def dequantized_hf_model(d, float_dir):
    """transformers' float32 Llama with every quantized linear replaced by its dequantized weight."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    m = transformers.AutoModelForCausalLM.from_pretrained(float_dir, torch_dtype=torch.float32)
    mc = load_config(d)
    ck = Checkpoint(d)
    sd = m.state_dict()
    with torch.no_grad():
        for layer in range(mc.num_layers):
            for mod, (n, k) in mc.linear_shapes().items():
                name = f"model.layers.{layer}.{mod}"
                if mc.quantization.converts(name):
                    w = module_weight(ck, mc.quantization, name, k)
                    sd[name + ".weight"].copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
                else:  # a float linear: as the float16 engine stores it
                    sd[name + ".weight"].copy_(sd[name + ".weight"].half().float())
    return m.eval()


@pytest.mark.parametrize("name", ["awq32", "awq128", "gptq64", "gptq_act", "gptq_asym_all", "int8"])
def test_model_matches_transformers_on_dequantized_weights(checkpoints, name, fake_gpu, monkeypatch):  # noqa: F811
    torch = pytest.importorskip("torch")
    calls = fake_quant(monkeypatch)
    d = checkpoints[name]
    hf = dequantized_hf_model(d, checkpoints["float"])
    from speedcore.engine.llm import LLM

    ids = np.random.default_rng(0).integers(0, 96, 30).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    logs = []
    llm = LLM(d, dtype="float16", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              skip_tokenizer_init=True, num_gpu_blocks=32, block_size=4, enforce_eager=True, log=logs.append)
    # one prepack per fused linear: qkv, o, gate_up, down per layer
    assert len(calls) == 4 * LAYERS
    # INT4 layers prepacked with one copy by default (quant_copies="compact"); INT8 has no such choice
    assert {c for m, c in calls} == ({None} if name == "int8" else {"compact"})
    L = llm.model.layers[0]
    assert [L.qkv.part_features, L.gate_up.part_features] == [[256], [512]]
    assert "weights on the GPU" in logs[-1] and llm.config.quantization.method in logs[-1]
    tol = TOL * np.abs(ref).max()
    start, got = llm._debug_logits(ids, 20)
    assert start == 0 and np.abs(got - ref).max() < tol
    start, got = llm._debug_logits(ids, 20, chunk=7)  # a prefix hit, then chunks over cached pages
    assert np.abs(got - ref[start:]).max() < tol
    # the float model's logits are not that close: the comparison sees the quantization
    float_ref = pytest.importorskip("transformers").AutoModelForCausalLM.from_pretrained(
        checkpoints["float"], torch_dtype=torch.float32)
    with torch.no_grad():
        fref = float_ref(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(fref - ref).max() > 2 * tol or name == "int8"


def test_mixed_float_and_quantized_layers(checkpoints, tmp_path, fake_gpu, monkeypatch):  # noqa: F811
    """modules_to_not_convert keeps layer 1's MLP float: the engine runs it on speedcore.linear."""
    torch = pytest.importorskip("torch")
    fake_quant(monkeypatch)
    d = str(tmp_path / "mixed")
    quantize_checkpoint(checkpoints["float"], d, "awq", 64, progress=False, modules_to_not_convert=["layers.1.mlp"])
    hf = dequantized_hf_model(d, checkpoints["float"])
    from speedcore.engine.llm import LLM
    from speedcore.engine.quantization import QuantLinear

    llm = LLM(d, dtype="float16", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              skip_tokenizer_init=True, num_gpu_blocks=32, block_size=4, enforce_eager=True)
    L1 = llm.model.layers[1]
    assert isinstance(L1.qkv, QuantLinear) and not isinstance(L1.gate_up, QuantLinear)
    ids = np.random.default_rng(1).integers(0, 96, 24).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    _, got = llm._debug_logits(ids, 16)
    assert np.abs(got - ref).max() < TOL * np.abs(ref).max()


def test_separate_act_order_parts_in_the_model(checkpoints, tmp_path, fake_gpu, monkeypatch):  # noqa: F811
    torch = pytest.importorskip("torch")
    calls = fake_quant(monkeypatch)
    d = separate_act_order_checkpoint(checkpoints, tmp_path)
    from speedcore.engine.llm import LLM

    llm = LLM(d, dtype="float16", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              skip_tokenizer_init=True, num_gpu_blocks=32, block_size=4, enforce_eager=True)
    assert llm.model.layers[0].qkv.part_features == [128, 64, 64] and len(calls) == 4 * LAYERS + 2
    hf = dequantized_hf_model(d, checkpoints["float"])
    ids = np.random.default_rng(2).integers(0, 96, 24).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    _, got = llm._debug_logits(ids, 16)
    assert np.abs(got - ref).max() < TOL * np.abs(ref).max()


@pytest.mark.parametrize("method", ["awq", "gptq", "int8"])
def test_quantized_preset(method, fake_gpu, monkeypatch):  # noqa: F811
    """preset:tiny with random codes in the format: it runs; the weight bytes count the quantized layers."""
    fake_quant(monkeypatch)
    from speedcore.engine.llm import LLM
    from speedcore.engine.sampling_params import SamplingParams

    llm = LLM("preset:tiny", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, num_gpu_blocks=16,
              enforce_eager=True, quantization=method)
    cfg = llm.config
    linear_params = cfg.num_layers * sum(a * b for a, b in cfg.linear_shapes().values())
    other = 2 * (cfg.num_params() - linear_params)
    bits = 8 if method == "int8" else 4
    q_bytes = llm.model.nbytes() - other
    assert linear_params * bits / 8 < q_bytes < linear_params * bits / 8 * 1.15  # codes + scales (+ zeros)
    assert llm.model.streamed_bytes() == llm.model.nbytes()  # the stand-in keeps no extra copies
    o, = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(o.outputs[0].token_ids) == 3 and o.error is None


def test_quantization_argument_must_match_the_checkpoint(checkpoints, fake_gpu):  # noqa: F811
    from speedcore.engine.llm import LLM

    with pytest.raises(ValueError, match="quantization: 'gptq' differs from the checkpoint's quantization_config"):
        LLM(checkpoints["awq32"], quantization="gptq", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="none: a float checkpoint"):
        LLM(checkpoints["float"], quantization="awq", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="quant_copies"):
        LLM("preset:tiny", quantization="awq", quant_copies="one", num_gpu_blocks=16)


def test_prepacked_nbytes_counts_each_array_once():
    from speedcore.quant.prepack import AWQWeight, _GemvLayer

    qw, qz, sc = np.zeros((128, 8), np.int32), np.zeros((1, 8), np.int32), np.zeros((1, 64), np.float16)
    packed, words, recs = np.zeros(1024, np.int32), np.zeros(1024, np.int32), np.zeros(192, np.uint8)
    gl = _GemvLayer(0, "float16", words, recs, 1, 2, 4, 1, words, 3, recs, 4)  # w4 copy aliasing the words
    w = AWQWeight(qw, qz, sc, 128, 128, 64, packed, None, gl)
    assert prepacked_nbytes(w) == qw.nbytes + qz.nbytes + sc.nbytes + packed.nbytes + words.nbytes + recs.nbytes


@pytest.mark.parametrize("method, group", [("awq", 32), ("gptq", 64)])
def test_qwen2_biases_and_sharded_source(method, group, tmp_path, fake_gpu, monkeypatch):  # noqa: F811
    """Qwen2 (q/k/v biases, stored float16 beside the quantized weights) from a sharded float32 checkpoint."""
    torch = pytest.importorskip("torch")
    from test_engine_model_cpu import _hf

    src = tmp_path / "qwen2"
    _hf("qwen2", src)  # hidden 64, 2 layers, shards of 20 KB
    assert os.path.isfile(src / "model.safetensors.index.json")
    d = str(tmp_path / "q")
    quantize_checkpoint(str(src), d, method, group, progress=False)
    fake_quant(monkeypatch)
    hf = dequantized_hf_model(d, str(src))
    with torch.no_grad():  # the engine adds the biases as stored (float16)
        for name, p in hf.named_parameters():
            if name.endswith("proj.bias"):
                p.copy_(p.half().float())
    from speedcore.engine.llm import LLM

    llm = LLM(d, dtype="float16", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              skip_tokenizer_init=True, num_gpu_blocks=32, block_size=4, enforce_eager=True)
    assert llm.model.layers[0].qkv_bias is not None
    ids = np.random.default_rng(0).integers(0, 100, 30).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    _, got = llm._debug_logits(ids, 20)
    assert np.abs(got - ref).max() < TOL * np.abs(ref).max()


def test_compact_8b_weights_are_within_the_issue_bound():
    """Llama-3-8B shapes, 4-bit g128 on sm_90, from expected_prepacked_bytes (what the GPU test checks prepack
    against): quant_copies="compact" keeps one INT4 copy per linear, at most 0.40x the bf16 model's bytes (0.36x is
    the floor with embeddings and lm_head as stored); "all" kept about as much as bf16."""
    from speedcore.engine.quantization import expected_prepacked_bytes

    hidden, inter, layers, vocab = 4096, 14336, 32, 128256
    shapes = {"qkv": (6144, hidden), "o": (hidden, hidden), "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    other = 2 * vocab * hidden * 2 + (2 * layers + 1) * hidden * 2  # embeddings, lm_head, norms (bf16)
    bf16 = layers * sum(2 * n * k for n, k in shapes.values()) + other

    def total(copies):
        return layers * sum(sum(expected_prepacked_bytes("awq", n, k, 128, copies=copies).values())
                            for n, k in shapes.values()) + other

    assert abs(bf16 / 1e9 - 16.06) < 0.01
    assert total("compact") / bf16 <= 0.40 and abs(total("compact") / bf16 - 0.358) < 0.002
    assert abs(total("all") / bf16 - 1.03) < 0.01
    assert expected_prepacked_bytes("awq", 6144, 4096, 128, copies="compact").keys() == {"wgmma-major"}
    assert "stored" in expected_prepacked_bytes("awq", 6144, 4096, 128, copies="compact", cc=(8, 0))
