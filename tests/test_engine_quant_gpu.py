"""speedcore.LLM on quantized checkpoints (AWQ, GPTQ with and without act-order, INT8) on the GPU, against
transformers' float32 model running the same weights dequantized: teacher-forced logits within 1.2x of transformers'
own bf16-vs-float32 error on those weights; the bytes prepack keeps against expected_prepacked_bytes; every
quant_copies setting; the quantized bench preset.

Run: python -m pytest -q -rs -s tests/test_engine_quant_gpu.py   (needs CuPy and a GPU; transformers + torch).
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

PROMPT, DECODE = 40, 16  # 40 prefill rows (the w4_wgmma / marlin range), then 16 decode steps (M = 1)
BOUND = 1.2
# hidden 512, 8 heads of 64, 2 KV heads: fused qkv N = 768 and gate_up N = 2048 are multiples of 256 and K of 128,
# so g128 layers take w4_wgmma_kernel on sm_90 and the streaming kernels at M = 1; g32 / g64 take the others
SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
             eos_token_id=2, tie_word_embeddings=False)
CASES = {"awq-g128": ("awq", 128, {}), "awq-g64": ("awq", 64, {}), "awq-g32": ("awq", 32, {}),
         "gptq-g128": ("gptq", 128, {}), "gptq-act-g128": ("gptq", 128, dict(desc_act=True)),
         "gptq-act-g32-asym": ("gptq", 32, dict(desc_act=True, sym=False)), "gptq-g-1": ("gptq", -1, {}),
         "int8": ("int8", -1, {})}


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.02 if "embed" not in name else 1.0)
    d = tmp_path_factory.mktemp("float")
    m.save_pretrained(str(d))
    return str(d)


@pytest.fixture(scope="module", params=list(CASES))
def quantized(request, float_checkpoint, tmp_path_factory):
    """(case, directory, token ids, float32 logits, bf16 logits) of transformers on the dequantized weights."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from speedcore.engine.checkpoint import Checkpoint
    from speedcore.engine.config import load_config
    from speedcore.engine.quantization import dequantize_host, read_quant_linear
    from speedcore.quant.checkpoint import quantize_checkpoint

    method, group, kw = CASES[request.param]
    d = str(tmp_path_factory.mktemp(request.param))
    quantize_checkpoint(float_checkpoint, d, method, group, progress=False, **kw)
    mc, ck = load_config(d), Checkpoint(d)
    m = transformers.AutoModelForCausalLM.from_pretrained(float_checkpoint, torch_dtype=torch.float32,
                                                          attn_implementation="eager")
    sd = m.state_dict()
    with torch.no_grad():
        for li in range(mc.num_layers):
            for mod, (n, k) in mc.linear_shapes().items():
                name = f"model.layers.{li}.{mod}"
                w = dequantize_host(read_quant_linear(ck, [name], mc.quantization, k, "float16"))
                sd[name + ".weight"].copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
    ids = np.random.default_rng(1).integers(3, 512, PROMPT + DECODE).tolist()
    refs = []
    for dt in (torch.float32, torch.bfloat16):
        mm = m.to(dt).cuda().eval()
        with torch.no_grad():
            refs.append(mm(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy())
    del m, mm
    torch.cuda.empty_cache()
    return request.param, d, ids, refs[0], refs[1]


def _llm(path, **kw):
    from speedcore import LLM

    args = dict(dtype="bfloat16", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128,
                skip_tokenizer_init=True, num_gpu_blocks=256)
    args.update(kw)
    return LLM(path, **args)


def _check(ours, start, ref32, ref16, what):
    err = lambda a, b: float(np.abs(a - b).mean())  # noqa: E731
    for part, rows in (("prefill", slice(0, PROMPT - start)), ("decode", slice(PROMPT - start, ours.shape[0]))):
        o, r32, r16 = ours[rows], ref32[start:][rows], ref16[start:][rows]
        e_ours, e_hf = err(o, r32), err(r16, r32)
        print(f"{what} {part}: ours {e_ours:.5f}, transformers bf16 {e_hf:.5f} ({e_ours / e_hf:.3f}x)")
        assert e_ours <= BOUND * e_hf, f"{what} {part}: mean |error| {e_ours:.5f} > {BOUND} x {e_hf:.5f}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_teacher_forced_logits(quantized, dtype):
    case, path, ids, ref32, ref16 = quantized
    for eager in (True, False):
        logs = []
        with _llm(path, dtype=dtype, enforce_eager=eager, enable_prefix_caching=False, log=logs.append) as llm:
            start, ours = llm._debug_logits(ids, PROMPT)
            _check(ours, 0, ref32, ref16, f"{case} {dtype} eager={eager}")
            print(logs[-1])
        if dtype == "bfloat16":  # chunked prefill over cached pages (M = 7 chunks: the small-M kernels)
            with _llm(path, dtype=dtype) as llm:
                _, ours = llm._debug_logits(ids, PROMPT, chunk=7)
                _check(ours, 0, ref32, ref16, f"{case} chunked")


def test_prepacked_bytes_match_the_expected_copies(quantized):
    """Each fused linear keeps exactly the copies expected_prepacked_bytes predicts (printed per copy)."""
    from speedcore.engine.quantization import QUANT_COPIES, expected_prepacked_bytes

    case, path = quantized[:2]
    for copies in QUANT_COPIES:
        with _llm(path, quant_copies=copies, enforce_eager=True) as llm:
            q = llm.config.quantization
            for group in ("qkv", "o", "gate_up", "down"):
                ql = getattr(llm.model.layers[0], group)
                k = ql.weights[0].in_features
                exp = expected_prepacked_bytes(q.method, ql.out_features, k, q.group_size, act_order=q.desc_act,
                                               copies=copies)
                got = ql.nbytes()
                print(f"{case} {copies} {group} ({ql.out_features}x{k}): {got} bytes, expected {exp}")
                assert len(ql.weights) == 1 and got == sum(exp.values()), (case, copies, group)
                if copies == "compact" and case in ("awq-g128", "gptq-g128", "gptq-act-g128", "gptq-g-1"):
                    # one INT4 copy: the wgmma-major one (SHAPE's layers fit it on sm_90)
                    assert list(exp) in (["wgmma-major"], ["wgmma-major", "act-order perm"]), exp
                    assert ql.weights[0].qweight is None and ql.weights[0].gemv.w_ptr == 0


def test_quant_copies_give_the_same_logits(quantized):
    case, path, ids, ref32, ref16 = quantized
    for copies in ("all", "no-wgmma", "tile-only"):  # (the default, "compact": test_teacher_forced_logits)
        with _llm(path, quant_copies=copies, enforce_eager=True) as llm:
            _, ours = llm._debug_logits(ids, PROMPT)
            _check(ours, 0, ref32, ref16, f"{case} copies={copies}")


def test_quantized_bench_presets(tmp_path):
    import json

    from speedcore.cli import main

    for method in ("awq", "gptq", "int8"):
        out = tmp_path / f"{method}.json"
        assert main(["bench-engine", "--preset", "tiny", "--quantization", method, "--num-prompts", "8",
                     "--input-len", "8:64", "--output-len", "16", "--batch", "8", "--gpu-memory-utilization", "0.3",
                     "--json", str(out)]) == 0
        res = json.loads(out.read_text())
        assert res["quantization"] == {"int8": "speedcore_int8"}.get(method, method)
        assert res["output_tokens"] == 128 and res["weight_bytes"] > 0
