"""Per-kernel GPU time of the engine's decode step (batch 1 by default) on a preset, through torch.profiler
(CUPTI sees every kernel in the process, CuPy's and those replayed from CUDA graphs included).

  PYTHONPATH=. python benchmarks/probes/decode_profile.py --preset llama-3-8b --batch 1 [--eager] [--quantization awq]

Run it with SPEEDCORE_CHAIN_LAUNCHES=0: a chained kernel starts before its predecessor ends and waits inside, so
its recorded duration includes that wait (the per-kernel times overlap and add up to more than the step).
"""
import argparse
import collections

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from speedcore.engine import LLM, SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="llama-3-8b")
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--input-len", type=int, default=128)
ap.add_argument("--steps", type=int, default=32)
ap.add_argument("--eager", action="store_true")
ap.add_argument("--top", type=int, default=30)
ap.add_argument("--quantization", choices=("awq", "gptq", "int8"), default=None)
a = ap.parse_args()

llm = LLM(f"preset:{a.preset}", max_model_len=a.input_len + a.steps + 64, max_num_seqs=a.batch,
          enforce_eager=a.eager, skip_tokenizer_init=True, quantization=a.quantization)
rng = np.random.default_rng(0)
prompts = [rng.integers(0, llm.config.vocab_size, a.input_len).tolist() for _ in range(a.batch)]
sp = SamplingParams(max_tokens=a.steps, ignore_eos=True, temperature=0.0)
llm.generate(prompts, sp, use_tqdm=False)  # warm-up
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    llm.generate(prompts, sp, use_tqdm=False)
tot = collections.Counter()
cnt = collections.Counter()
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        tot[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        cnt[e.name] += 1
steps = a.steps
all_us = sum(tot.values())
print(f"{'graph' if not a.eager else 'eager'} batch {a.batch}: {all_us / steps:.1f} us of kernels per step "
      f"({len(tot)} kernels; prefill included once)")
for name, us in tot.most_common(a.top):
    print(f"{us / steps:9.1f} us/step {cnt[name] / steps:6.1f}x  {name[:110]}")
llm.close()
