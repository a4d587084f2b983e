"""The engine at the model level on the Llama-3-8B preset (op ``engine``): each run is its own
``python -m speedcore bench-engine`` process (so that start-up is measured as a user meets it), recorded with the
peer of the same run.

- bf16: batch-1 decode (tok/s, inter-token latency), offline throughput (256 prompts of 100-1024 tokens + 256
  each), TTFT of one 8191-token prompt, start-up with a warm kernel cache; each with its fraction of the roofline
  that ``bench-engine`` prints (weights and KV bytes at the copy rate, FLOPs at the GEMM rate);
- quant: AWQ, GPTQ and INT8 batch-1 decode and weight memory against bf16's of the same run (the default
  quant_copies, "compact": one INT4 copy per linear); quant_copies: AWQ batch 1 and weight memory with
  ``--quant-copies all`` (every layout copy) against the default's;
- b64: batch-64 decode, AWQ against bf16; offline_quant: AWQ on the offline workload against bf16's;
- hf_peer: transformers ``generate_batch`` (paged sdpa) on the offline workload, same prompts' shapes (~2.5 min).

    python -m speedcore bench engine --json benchmarks/results/h200.json
    SPEEDCORE_ENGINE_CASES=bf16,quant python -m speedcore bench engine     # a subset (default: all but hf_peer)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

PRESET = "llama-3-8b"
B1 = ["--batch", "1", "--num-prompts", "4", "--input-len", "128", "--output-len", "256"]
OFFLINE = ["--num-prompts", "256", "--input-len", "100:1024", "--output-len", "256"]
TTFT = ["--batch", "1", "--num-prompts", "1", "--input-len", "8191", "--output-len", "1"]
B64 = ["--batch", "64", "--num-prompts", "64", "--input-len", "128", "--output-len", "256"]
_NAMES = {None: "bf16", "awq": "AWQ g128", "gptq": "GPTQ g128", "int8": "INT8 per-channel"}


def bench_engine(args, quantization=None, timeout=600) -> dict:
    """One ``bench-engine`` run in a fresh process; its JSON result."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "res.json")
        cmd = [sys.executable, "-m", "speedcore", "bench-engine", "--preset", PRESET, *args, "--json", out]
        if quantization:
            cmd += ["--quantization", quantization]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{' '.join(cmd[2:])} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        print("\n".join(line for line in p.stdout.splitlines() if line.split(":")[0] in
                        ("throughput", "TTFT ms", "start-up", "roofline", "weights on the GPU")), file=sys.stderr)
        with open(out) as f:
            return json.load(f)


def hf_generate_batch_tok_s(num_prompts=256, seed=1) -> float:
    """transformers' continuous batching (``generate_batch``, paged sdpa) on the Llama-3-8B shape, random bf16
    weights, prompts of 100-1024 random tokens with 256 new each (the offline workload's shape)."""
    import time

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    model.set_attn_implementation("paged|sdpa")
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(100, 1025, (num_prompts,), generator=g).tolist()
    inputs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    gc = GenerationConfig(max_new_tokens=256, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(inputs[:8], generation_config=gc)
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate_batch(inputs, generation_config=gc)
    torch.cuda.synchronize()
    el = time.perf_counter() - t
    n = sum(len(o.generated_tokens) for o in out.values())
    del model
    torch.cuda.empty_cache()
    return n / el


def _tok_s(r):
    return r["output_tok_per_s"]


def cases(b):
    want = set(os.environ.get("SPEEDCORE_ENGINE_CASES", "bf16,quant,quant_copies,b64,offline_quant").split(","))
    P = "Llama-3-8B preset"
    runs = {}  # (workload, quantization) -> result, shared by the cases that compare against it

    def run(name, args, q=None):
        if (name, q) not in runs:
            runs[name, q] = bench_engine(args, q)
        return runs[name, q]

    def rec(b, case, unit, ours, peers=None, frac=None, higher_is_better=True):
        b.add("engine", case, unit, ours, peers or {}, higher_is_better=higher_is_better, fraction=frac)

    def bf16_b1(b):
        r = run("b1", B1)
        rec(b, f"{P} bf16, batch 1, 128+256 tokens, graphs: output tok/s", "tok/s", _tok_s(r),
            frac=r["roofline_fraction"])
        rec(b, f"{P} bf16, batch 1: inter-token latency p50", "ms", r["itl_s"]["p50"] * 1e3, higher_is_better=False)

    def bf16_offline(b):
        r = run("offline", OFFLINE)
        peers = {}
        if "hf_peer" in want:
            peers["transformers generate_batch (paged sdpa, same run)"] = hf_generate_batch_tok_s()
        rec(b, f"{P} bf16, 256 prompts 100-1024 + 256: output tok/s", "tok/s", _tok_s(r), peers,
            frac=r["roofline_fraction"])

    def bf16_ttft(b):
        r = run("ttft", TTFT)
        rec(b, f"{P} bf16, one 8191-token prompt: TTFT", "ms", r["ttft_s"]["p50"] * 1e3, higher_is_better=False,
            frac=r["roofline_fraction"])
        rec(b, f"{P} bf16: start-up with a warm kernel cache", "s", r["startup_s"]["total"], higher_is_better=False)

    def quant_b1(q):
        def case(b):
            r, r16 = run("b1", B1, q), run("b1", B1)
            peer = "bf16 preset (same run)"
            rec(b, f"{P} {_NAMES[q]} (random), batch 1, 128+256 tokens: output tok/s", "tok/s", _tok_s(r),
                {peer: _tok_s(r16)}, frac=r["roofline_fraction"])
            rec(b, f"{P} {_NAMES[q]}, batch 1: inter-token latency p50", "ms", r["itl_s"]["p50"] * 1e3,
                {peer: r16["itl_s"]["p50"] * 1e3}, higher_is_better=False)
            rec(b, f"{P} {_NAMES[q]}: weight memory on the GPU after load", "GB", r["weight_bytes"] / 1e9,
                {peer: r16["weight_bytes"] / 1e9}, higher_is_better=False)
        return case

    def awq_copies(b):
        r, rc = run("b1 all copies", B1 + ["--quant-copies", "all"], "awq"), run("b1", B1, "awq")
        peer = "AWQ with quant_copies compact (same run)"
        rec(b, f"{P} AWQ g128 (random), every layout copy, batch 1, 128+256 tokens: output tok/s", "tok/s", _tok_s(r),
            {peer: _tok_s(rc)}, frac=r["roofline_fraction"])
        rec(b, f"{P} AWQ g128, every layout copy: weight memory on the GPU after load", "GB", r["weight_bytes"] / 1e9,
            {peer: rc["weight_bytes"] / 1e9}, higher_is_better=False)

    def awq_b64(b):
        r16, r4 = run("b64", B64), run("b64", B64, "awq")
        rec(b, f"{P} AWQ g128 (random), batch 64, 128+256 tokens: output tok/s", "tok/s", _tok_s(r4),
            {"bf16 preset (same run)": _tok_s(r16)}, frac=r4["roofline_fraction"])

    def awq_offline(b):
        r16, r4 = run("offline", OFFLINE), run("offline", OFFLINE, "awq")
        rec(b, f"{P} AWQ g128 (random), 256 prompts 100-1024 + 256: output tok/s", "tok/s", _tok_s(r4),
            {"bf16 preset (same run)": _tok_s(r16)}, frac=r4["roofline_fraction"])

    todo = []
    if "bf16" in want:
        todo += [("engine bf16 batch 1", bf16_b1), ("engine bf16 offline", bf16_offline),
                 ("engine bf16 TTFT 8191", bf16_ttft)]
    elif "hf_peer" in want:
        todo.append(("engine bf16 offline", bf16_offline))
    if "quant" in want:
        todo += [(f"engine {q} batch 1", quant_b1(q)) for q in ("awq", "gptq", "int8")]
    if "quant_copies" in want:
        todo.append(("engine AWQ batch 1, every copy", awq_copies))
    if "b64" in want:
        todo.append(("engine AWQ batch 64", awq_b64))
    if "offline_quant" in want:
        todo.append(("engine AWQ offline", awq_offline))
    return todo
