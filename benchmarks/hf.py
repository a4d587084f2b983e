"""A Llama-3-8B-shaped transformers model (random normal weights, std 0.02, bf16) with speedcore against transformers'
own sdpa model, same weights, same run (issue #32's acceptance):

- logits error against the float32 model (relative Frobenius norm over the valid positions), on a plain batch and
  on a left-padded batch of ragged prompts: ours and sdpa's (ratio = sdpa's error / ours: >= 1/1.2 passes);
- eager ``generate`` tokens/s at batch 1 and 32 (128-token prompts, 128 new tokens, greedy, no early stop);
- ``generate`` with a static cache and transformers' compiled decode (``CompileConfig(fullgraph=True)``, CUDA
  graphs) at batch 1 (target >= 150 tokens/s); sdpa's peer figure only outside ``--quick``.

The model is built on the GPU directly (float32 first, for the reference logits, then cast to bf16 in place with
RoPE's inv_freq kept in float32, as ``from_pretrained(dtype=bf16)`` keeps it).  ``--quick``: 8 layers instead of
32, no compiled sdpa peer.  About 4 minutes in full, most of it the two compilations.
"""
import sys
import time

OP = "hf"
PROMPT, NEW = 128, 128
_state: dict = {}


def _log(msg):
    print(f"\n  hf: {msg}", file=sys.stderr, flush=True)


def cases(b):
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("hf: transformers is not installed, skipping the suite", file=sys.stderr)
        return []
    return [("hf build Llama-3-8B-shaped model + float32 reference logits", _build),
            ("hf transformers sdpa bf16: logits, eager generate, compiled generate", _sdpa),
            ("hf speedcore: apply(), logits, eager generate, compiled generate (records)", _ours)]


def _config(b):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=8 if b.quick else 32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.02)


def _prompts(torch, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    plain = torch.randint(3, 128256, (4, PROMPT), generator=g)
    padded = plain.clone()
    mask = torch.ones_like(padded)
    for i, n in enumerate((PROMPT, 100, 77, 40)):  # ragged prompts, left-padded as generate pads them
        padded[i, : PROMPT - n] = 0
        mask[i, : PROMPT - n] = 0
    b32 = torch.randint(3, 128256, (32, PROMPT), generator=g)
    return {k: v.to(device) for k, v in dict(plain=plain, padded=padded, mask=mask, b32=b32).items()}


def _logits(model, ids, mask):
    import torch

    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float()


def _rel_err(x, ref):
    return ((x - ref).norm() / ref.norm()).item()


def _build(b):
    import torch
    import transformers

    t0 = time.perf_counter()
    torch.manual_seed(0)
    cfg = _config(b)
    with torch.device(b.device):
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    model.eval()
    _state["prompts"] = p = _prompts(torch, b.device)
    _state["ref_plain"] = _logits(model, p["plain"], None)
    valid = p["mask"].bool()
    _state["ref_padded"] = _logits(model, p["padded"], p["mask"])[valid]
    inv = {n: (m.inv_freq.clone(), m.original_inv_freq.clone()) for n, m in model.named_modules()
           if hasattr(m, "inv_freq")}
    model.to(torch.bfloat16)  # in place: the float32 weights are freed as each is cast
    for n, m in model.named_modules():
        if n in inv:
            m.inv_freq, m.original_inv_freq = inv[n]
    _state["model"] = model
    torch.cuda.synchronize()
    _log(f"built and ran the float32 reference in {time.perf_counter() - t0:.1f}s")


def _tokens_per_s(model, ids, **kw):
    import torch

    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0, **kw)
    model.generate(ids, **kw)  # warm-up: kernels compiled, torch.compile graphs built and captured
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate(ids, **kw)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + NEW, out.shape
    return ids.shape[0] * NEW / dt


def _measure(b, model, label, compiled_peer=True, chained=False):
    from transformers import CompileConfig

    p = _state["prompts"]
    res = {}
    t0 = time.perf_counter()
    res["err_plain"] = _rel_err(_logits(model, p["plain"], None), _state["ref_plain"])
    res["err_padded"] = _rel_err(_logits(model, p["padded"], p["mask"])[p["mask"].bool()], _state["ref_padded"])
    _log(f"{label}: logits error {res['err_plain']:.3e} plain, {res['err_padded']:.3e} padded")
    eager = dict(disable_compile=True)
    res["b1"] = _tokens_per_s(model, p["plain"][:1], **eager)
    _log(f"{label}: eager batch 1 {res['b1']:.1f} tok/s")
    res["b32"] = _tokens_per_s(model, p["b32"], **eager)
    _log(f"{label}: eager batch 32 {res['b32']:.0f} tok/s")
    if compiled_peer:
        from speedcore import _launch

        # speedcore's kernels chained in the captured graphs (SPEEDCORE_CHAIN_LAUNCHES, docs/ops.md): no launch gap
        prev = _launch.set_chained_launches(True) if chained else None
        try:  # a failed compilation leaves the eager figures recorded
            res["compiled_b1"] = _tokens_per_s(model, p["plain"][:1], cache_implementation="static",
                                               compile_config=CompileConfig(fullgraph=True))
            _log(f"{label}: compiled static batch 1 {res['compiled_b1']:.1f} tok/s")
        except Exception as exc:
            _log(f"{label}: compiled static generate FAILED: {type(exc).__name__}: {str(exc)[:2000]}")
        finally:
            if chained:
                _launch.set_chained_launches(prev)
    _log(f"{label}: {time.perf_counter() - t0:.0f}s")
    return res


def _sdpa(b):
    model = _state["model"]
    model.set_attn_implementation("sdpa")
    _state["sdpa"] = _measure(b, model, "sdpa", compiled_peer=not b.quick)
    import torch

    torch._dynamo.reset()


def _ours(b):
    import speedcore.integrations.transformers as st

    model = st.apply(_state.pop("model"))
    ours = _measure(b, model, "speedcore", chained=True)
    sdpa = _state.get("sdpa", {})
    layers = model.config.num_hidden_layers
    shape = f"Llama-3-8B-shaped ({layers} layers) bf16"
    peer = "transformers sdpa bf16"
    for key, what in (("err_plain", "4x128 prompts"), ("err_padded", "4 ragged prompts, left-padded")):
        b.add(OP, f"{shape} logits rel. error vs float32, {what}", "rel err", ours[key],
              {peer: sdpa[key]} if key in sdpa else {}, higher_is_better=False)
    for key, what in (("b1", "batch 1"), ("b32", "batch 32")):
        b.add(OP, f"{shape} eager generate {what}, {PROMPT}+{NEW} tokens greedy", "tok/s", ours[key],
              {peer: sdpa[key]} if key in sdpa else {})
    if "compiled_b1" in ours:
        b.add(OP, f"{shape} static cache + torch.compile (fullgraph, CUDA graphs, chained launches) generate batch 1, "
                  f"{PROMPT}+{NEW}",
              "tok/s", ours["compiled_b1"], {f"{peer} (same compile)": sdpa["compiled_b1"]} if "compiled_b1" in sdpa
              else {})
    _state.clear()
