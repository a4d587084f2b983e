"""Are greedy outputs of one prompt the same from run to run?  (The 8B serve identity check failed at 4c9c8e5:
two server requests of one prompt, each after a prefix-cache reset, disagreed.)  One engine per configuration
(--chain 0/1: SPEEDCORE_CHAIN_LAUNCHES, --eager), each prompt generated alone --repeats times with the prefix
cache reset before each, other traffic in between (a batch of random prompts, so that KV pages are reused; --dirty N
prompts after the first repeat, optionally followed by filling the KV cache with zeros or NaN); prints how many
distinct outputs each prompt gave and where the later runs and one batched run diverge from the first.

    python benchmarks/probes/determinism_probe.py --preset llama-3-8b --chain 1
    python benchmarks/probes/determinism_probe.py --gpu-memory-utilization 0.85 --dirty 3000 --after-dirty nan
"""
import argparse
import os
import sys

import numpy as np


def diverges(first, other):
    """The first step where ``other`` leaves ``first`` (None: never)."""
    return next((t for t in range(len(first)) if t >= len(other) or other[t] != first[t]), None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--chain", default="1")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--dirty", type=int, default=0, help="prompts of 100-1024 tokens run after the first repeat (the "
                   "serve bench's offline run went through most of the KV pool before its identity check)")
    p.add_argument("--after-dirty", choices=("none", "zero", "nan"), default="none",
                   help="then fill the whole KV cache with zeros or NaN (stale pages or block ids?)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    a = p.parse_args()
    os.environ["SPEEDCORE_CHAIN_LAUNCHES"] = a.chain
    from speedcore.engine import LLM, SamplingParams

    llm = LLM(f"preset:{a.preset}", max_model_len=2048, gpu_memory_utilization=a.gpu_memory_utilization,
              enforce_eager=a.eager, log=lambda m: None)
    rng = np.random.default_rng(0)
    V = 120000  # ordinary token ids (the presets' specials start at 128000); the prompts docs/server.md reports
    sp = SamplingParams(temperature=0.0, max_tokens=32)
    prompts = [rng.integers(0, V, int(rng.integers(8, 200))).tolist() for _ in range(a.prompts)]
    outs = [[] for _ in prompts]
    for r in range(a.repeats):
        for i, ids in enumerate(prompts):
            llm.block_manager.reset_prefix_cache()
            out = llm.generate([dict(prompt_token_ids=ids)], sp, use_tqdm=False)[0].outputs[0]
            outs[i].append(tuple(out.token_ids))
        if r == 0 and a.dirty:
            big = [dict(prompt_token_ids=rng.integers(0, V, int(rng.integers(100, 1024))).tolist())
                   for _ in range(a.dirty)]
            llm.generate(big, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
            if a.after_dirty != "none":
                llm.runner.kv.fill(0 if a.after_dirty == "zero" else float("nan"))
        if a.after_dirty != "none":
            continue  # keep the filled pages for the repeats
        other = [dict(prompt_token_ids=rng.integers(0, V, int(rng.integers(8, 600))).tolist()) for _ in range(32)]
        llm.generate(other, SamplingParams(temperature=0.0, max_tokens=int(rng.integers(4, 64)), ignore_eos=True),
                     use_tqdm=False)
    llm.block_manager.reset_prefix_cache()
    batched = [tuple(o.outputs[0].token_ids) for o in llm.generate([dict(prompt_token_ids=x) for x in prompts], sp,
                                                                    use_tqdm=False)]
    tag = f"{a.preset} chain={a.chain} eager={a.eager}"
    for i, runs in enumerate(outs):
        print(f"{tag} prompt {i} (len {len(prompts[i])}): {len(set(runs))} distinct of {len(runs)}; "
              f"repeats diverge at {[diverges(runs[0], o) for o in runs[1:]]}; "
              f"batched run diverges at {diverges(runs[0], batched[i])}", flush=True)
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
