"""Where a compiled transformers decode step's time goes (#32: static cache + torch.compile at batch 1): wall time
per token against the GPU's kernel time per token, and the kernels by total time, for the speedcore-applied
Llama-3-8B-shaped model (random bf16 weights) and, with --peer, transformers' own sdpa model.

    PYTHONPATH=. python benchmarks/probes/hf_compiled_profile.py [--layers 32] [--peer]
"""
import argparse
import time

import torch
import transformers
from transformers import CompileConfig

PROMPT, NEW = 128, 128


def build(layers):
    cfg = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return model.eval()


def profile(model, label):
    ids = torch.randint(3, 128256, (1, PROMPT), device="cuda")
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0, cache_implementation="static",
              compile_config=CompileConfig(fullgraph=True))
    model.generate(ids, **kw)
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(ids, **kw)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        model.generate(ids, **kw)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in events)
    print(f"{label}: {NEW / wall:.1f} tok/s, wall {1e3 * wall / NEW:.3f} ms/token, kernels {gpu_us / 1e3 / NEW:.3f} "
          f"ms/token (prefill included)")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:22]:
        print(f"  {e.self_device_time_total / NEW:9.1f} us/token {e.count / NEW:7.1f} calls/token  {e.key[:110]}")
    cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    print(f"{label}: host, self time per token")
    for e in cpu:
        print(f"  {e.self_cpu_time_total / NEW:9.1f} us/token {e.count / NEW:7.1f} calls/token  {e.key[:110]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--peer", action="store_true")
    a = ap.parse_args()
    model = build(a.layers)
    if a.peer:
        profile(model, "sdpa")
        torch._dynamo.reset()
    import speedcore.integrations.transformers as st
    from speedcore import _launch

    _launch.set_chained_launches(True)
    profile(st.apply(model), "speedcore")


if __name__ == "__main__":
    main()
