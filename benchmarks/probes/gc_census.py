"""What Python's garbage collector walks in a busy engine (the serve bench's offline workload on the 1B preset):
collections and their time by generation, and a census of the tracked objects by type at mid-run, with the
element count of the largest containers.  For the serve bench's full collections of ~60 ms (H200 machine, 1B
preset, 2000 requests).

    PYTHONPATH=. python benchmarks/probes/gc_census.py [--requests 2000] [--preset llama-3.2-1b]
"""
import argparse
import collections
import gc
import time

import numpy as np


def census(top=15):
    objs = gc.get_objects()
    by_type = collections.Counter(type(o).__name__ for o in objs)
    sizes = sorted(((len(o), type(o).__name__) for o in objs if isinstance(o, (list, dict, set, tuple))),
                   reverse=True)[:8]
    print(f"tracked objects: {len(objs)} (frozen: {gc.get_freeze_count()})")
    for name, n in by_type.most_common(top):
        print(f"  {n:9d} {name}")
    print("largest containers:", sizes)
    t = time.perf_counter()
    gc.collect()
    print(f"a full collection now: {1e3 * (time.perf_counter() - t):.1f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--unfreeze", action="store_true", help="undo the engine's gc.freeze() after start-up")
    ap.add_argument("--threshold2", type=int, default=0, help="gc.set_threshold's third value (default kept)")
    a = ap.parse_args()
    from speedcore.engine import LLM, SamplingParams
    from speedcore.engine.llm import gc_clock

    llm = LLM(f"preset:{a.preset}", max_model_len=1024 + 256 + 64, max_num_seqs=256)
    if a.unfreeze:
        gc.unfreeze()
    if a.threshold2:
        t0, t1, _ = gc.get_threshold()
        gc.set_threshold(t0, t1, a.threshold2)
    rng = np.random.default_rng(0)
    V = llm.config.vocab_size
    prompts = [rng.integers(0, V, int(n)).tolist() for n in rng.integers(32, 1025, a.requests)]
    outs = rng.integers(16, 257, a.requests)
    print("after start-up:")
    census()
    step, seen = llm._step, [0]

    def counted(by_seq):
        seen[0] += 1
        if seen[0] == 600:
            print("at step 600:")
            census()
        return step(by_seq)

    llm._step = counted
    g0 = gc_clock()
    t = time.perf_counter()
    llm.generate(prompts, [SamplingParams(max_tokens=int(m), ignore_eos=True, temperature=0) for m in outs],
                 use_tqdm=False)
    g1 = gc_clock()
    print(f"unfreeze {a.unfreeze} threshold2 {a.threshold2}: {seen[0]} steps in {time.perf_counter() - t:.1f} s; "
          "collections, ms by generation:", [(n1 - n0, round(1e3 * (s1 - s0), 1)) for (n0, s0), (n1, s1) in zip(g0, g1)])


if __name__ == "__main__":
    main()
