"""A transformers Llama on speedcore: attn_implementation="speedcore", then apply() for the fused modules.

    python examples/transformers_llama.py                      # a small random Llama (no download)
    python examples/transformers_llama.py --model PATH_OR_ID   # any Llama / Mistral / Qwen2 / Qwen3 checkpoint

Prints the greedy continuation of a left-padded batch with and without speedcore, and tokens/s of each.
"""
import argparse
import tempfile
import time

import torch
import transformers

import speedcore.integrations.transformers as speedcore_hf  # registers attn_implementation="speedcore"


def random_llama(path):
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                                   pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def timed_generate(model, ids, mask, new_tokens):
    kw = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              pad_token_id=0)
    model.generate(ids, **kw)  # warm-up: speedcore compiles its kernel variants on first use
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate(ids, **kw)
    torch.cuda.synchronize()
    return out, ids.shape[0] * new_tokens / (time.perf_counter() - t)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a local path or hub id (default: a small random Llama)")
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or random_llama(tmp)
        load = transformers.AutoModelForCausalLM.from_pretrained
        sdpa = load(path, attn_implementation="sdpa", dtype=torch.bfloat16).cuda().eval()
        ours = load(path, attn_implementation="speedcore", dtype=torch.bfloat16).cuda().eval()
    speedcore_hf.apply(ours)  # fused QKV / gate+up GEMMs, RMSNorm, residual adds, LM head
    print(ours.model.layers[0])

    g = torch.Generator().manual_seed(0)
    vocab = ours.config.vocab_size
    ids = torch.randint(1, vocab, (3, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = mask[2, :11] = 0  # ragged prompts, left-padded as a tokenizer pads them for generate
    ids = (ids * mask).cuda()
    mask = mask.cuda()
    want, tps_sdpa = timed_generate(sdpa, ids, mask, args.new_tokens)
    got, tps_ours = timed_generate(ours, ids, mask, args.new_tokens)
    n = ids.shape[1]
    print("sdpa     :", want[:, n:n + 12].tolist(), f"{tps_sdpa:.0f} tok/s")
    print("speedcore:", got[:, n:n + 12].tolist(), f"{tps_ours:.0f} tok/s")
    agree = (got[:, n:] == want[:, n:]).float().mean().item()
    print(f"tokens agreeing with sdpa: {agree:.0%} (bf16 rounding may flip near-ties of random weights)")


if __name__ == "__main__":
    main()
