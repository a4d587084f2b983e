"""Where does the 8B prefill's result move after traffic?  (determinism_probe: one 68-token prompt's first greedy
token changes after 3,000 prompts went through the KV pool.)  Runs that prompt's prefill straight through the
runner with chosen block tables (low ids, high ids, shuffled), with chained launches on and off, after the memory
pool was filled with NaN garbage, and before / after --dirty prompts; fingerprints the weights; records every
linear's output per layer and prints the first op where a run leaves the reference run.

    python benchmarks/probes/placement_probe.py --dirty 3000
"""
import argparse
import hashlib
import sys
import time

import numpy as np


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--dirty", type=int, default=3000)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    a = p.parse_args()
    import cupy

    from speedcore import _launch
    from speedcore.engine import LLM, SamplingParams
    from speedcore.engine.models import llama
    from speedcore.engine.scheduler import ScheduledBatch
    from speedcore.engine.sequence import Sequence

    llm = LLM(f"preset:{a.preset}", max_model_len=2048, gpu_memory_utilization=a.gpu_memory_utilization,
              log=lambda m: None)
    runner = llm.runner
    rng = np.random.default_rng(0)
    V = 120000
    prompts = [rng.integers(0, V, int(rng.integers(8, 200))).tolist() for _ in range(4)]
    prompt = next((x for x in prompts if len(x) == 68), prompts[0])
    nb = -(-len(prompt) // runner.block_size)
    N = runner.num_blocks
    print(f"blocks {N}, prompt {len(prompt)} tokens, {nb} blocks", flush=True)

    trace = None  # a list while prefill() traces
    orig_linear = llama._linear

    def traced_linear(sc, x, w, bias=None):
        y = orig_linear(sc, x, w, bias)
        if trace is not None:
            trace.append(hashlib.sha1(cupy.asnumpy(y.view(np.uint16)).tobytes()).hexdigest()[:12])
        return y

    llama._linear = traced_linear

    def prefill(table):
        nonlocal trace
        trace = []
        s = Sequence(prompt, SamplingParams(temperature=0.0, max_tokens=1))
        s.block_table = list(table)
        with runner.stream:
            lg = runner.run(ScheduledBatch([s], [len(prompt)], 0))
            out = cupy.asnumpy(lg)
        runner.stream.synchronize()
        out_trace, trace = trace, None
        return out, out_trace

    def weights_fingerprint():
        h = hashlib.sha1()
        m = runner.model
        arrays = [m.embed, m.norm, m.lm_head]
        for L in m.layers:
            arrays += [getattr(L, f) for f in L.__dataclass_fields__] if hasattr(L, "__dataclass_fields__") else \
                [v for v in vars(L).values()]
        for arr in arrays:
            if isinstance(arr, cupy.ndarray):
                h.update(np.float64(cupy.asnumpy(arr.view(np.uint16).astype(np.float64).sum())).tobytes())
        return h.hexdigest()[:16]

    runs = {}

    def record(name, table, chain=None):
        prev = _launch.set_chained_launches(chain) if chain is not None else None
        runs[name] = lg, tr = prefill(table)
        if chain is not None:
            _launch.set_chained_launches(prev)
        ref_logits, ref_trace = runs["low"]
        first = next((i for i, (x, y) in enumerate(zip(ref_trace, tr)) if x != y), None)
        where = "never" if first is None else \
            f"op {first} (layer {first // 4}, {['qkv', 'o', 'gate_up', 'down'][first % 4]})"
        d = float(np.abs(lg.astype(np.float64) - ref_logits).max())
        print(f"{name:28s} argmax {int(lg[-1].argmax()):6d}  max|dlogit| {d:.3e}  NaN {bool(np.isnan(lg).any())}  "
              f"first differing linear: {where}", flush=True)

    low = list(range(nb))
    high = list(range(N - nb, N))
    shuffled = [int(b) for b in rng.choice(N, nb, replace=False)]
    w0 = weights_fingerprint()
    record("low", low)
    record("low again", low)
    record("high", high)
    record("shuffled", shuffled)
    record("low chain off", low, chain=False)
    record("low chain on", low, chain=True)
    pool = cupy.get_default_memory_pool()
    junk = [cupy.full(int(n), np.nan, np.float32) for n in rng.integers(1 << 16, 1 << 24, 64)]
    del junk
    record("low after NaN pool", low)
    from speedcore import _arrays

    zeroed_kinds = ("tickets", "attention_tiles", "gemv_tickets", "paged_attention_tiles", "gemv_ws")

    def zeroed_buffers():
        """(kind, cupy array) of every zeroed per-stream scratch buffer, retired ones (graphs' copies) too."""
        live = [(k[0], b) for k, b in _arrays._stream_buffers.items()]
        return [(kind, cupy.asarray(b.obj)) for kind, b in live + list(zip([k[0] for k in _arrays._retired_keys],
                                                                            _arrays._retired_buffers))
                if kind in zeroed_kinds]

    def counters():
        """Non-zero entries of the zeroed scratch buffers (counters kernels must leave at zero)."""
        out = {}
        for i, (kind, arr) in enumerate(zeroed_buffers()):
            host = cupy.asnumpy(arr)
            nz = np.nonzero(host)[0]
            if nz.size:
                out[f"{kind}#{i}"] = (int(nz.size), nz[:8].tolist(), host[nz[:8]].tolist())
        return out

    print(f"counters before traffic: {counters()}", flush=True)
    orig_run, step_no, leaks = runner.run, [0], [0]

    def checked_run(batch, **kw):
        lg = orig_run(batch, **kw)
        runner.stream.synchronize()
        step_no[0] += 1
        c = counters()
        if c:
            leaks[0] += 1
            if leaks[0] <= 5:
                print(f"step {step_no[0]} (decode {batch.num_decode}, seqs {len(batch.seqs)}, tokens "
                      f"{sum(batch.num_tokens)}, graphs {bool(runner.graphs)}) left counters {c}", flush=True)
            for _, arr in zeroed_buffers():
                arr.fill(0)
            runner.stream.synchronize()
        return lg

    if a.dirty:
        runner.run = checked_run
        t0 = time.perf_counter()
        big = [dict(prompt_token_ids=rng.integers(0, V, int(rng.integers(100, 1024))).tolist())
               for _ in range(a.dirty)]
        llm.generate(big, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        print(f"{a.dirty} dirty prompts in {time.perf_counter() - t0:.0f} s ({step_no[0]} steps, {leaks[0]} left "
              f"counters, reset each time)", flush=True)
        runner.run = orig_run
    w1 = weights_fingerprint()
    print(f"weights fingerprint before {w0} after {w1}: {'same' if w0 == w1 else 'CHANGED'}", flush=True)
    record("low after dirty", low)
    record("high after dirty", high)
    record("low after dirty chain off", low, chain=False)
    junk = [cupy.full(int(n), np.nan, np.float32) for n in rng.integers(1 << 16, 1 << 24, 64)]
    del junk
    record("low after dirty + NaN pool", low)
    pool.free_all_blocks()
    record("low after free_all_blocks", low)
    llm.block_manager.reset_prefix_cache()
    eng = llm.generate([dict(prompt_token_ids=prompt)], SamplingParams(temperature=0.0, max_tokens=1),
                       use_tqdm=False)[0].outputs[0].token_ids[0]

    print(f"engine first token after dirty {eng}; reference argmax {int(runs['low'][0][-1].argmax())}")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
