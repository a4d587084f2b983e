"""The OpenAI-compatible server (``python -m speedcore serve``) on the engine, end to end on loopback (op ``serve``).

Per preset (random weights with the word-per-token tokenizer, speedcore/server/fake_engine.py):
1. identity: the openai client (completions and chat, streaming and not, one request at a time) against the
   server; greedy tokens must equal offline ``llm.generate`` / ``llm.chat`` on the same prompts;
2. throughput: N streaming requests of mixed lengths (256 concurrent clients in up to 8 worker processes), against
   offline ``llm.generate`` on the same prompts (run before and after; the better of the two): output tokens/s,
   client-side TTFT and inter-chunk latency, the engine's steps in both runs;
3. robustness: N/4 streaming requests, 10% of the clients disconnecting mid-stream, while the bad inputs of the
   issue (malformed JSON, invalid UTF-8, wrong types, unknown model, n > 1, too long, too large, no key) are sent
   and must each get their error code: 0 lost or duplicated, every completed stream ends with one [DONE] and
   exactly its tokens, KV blocks and GPU memory back to their idle figures afterwards.

    python benchmarks/serve.py --preset llama-3.2-1b            # standalone, prints progress and a summary
    python benchmarks/serve.py --preset llama-3-8b --requests 2000
    python -m speedcore bench serve --json benchmarks/results/h200.json   # as a suite (env: see cases())
    python benchmarks/serve.py --fake --requests 200 --concurrency 32     # no GPU: the CPU stand-in engine
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import types

import numpy as np

API_KEY = "bench-key"


def _log(msg):
    print(f"[serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def _range(s):
    a, _, b = str(s).partition(":")
    return int(a), int(b or a)


def _build(opts):
    """(the engine: a speedcore.LLM, or with --engine-process a RemoteBackend over one, its name)."""
    from speedcore.server.fake_engine import attach_number_tokenizer, make_fake_llm

    in_hi, out_hi = _range(opts.input_len)[1], _range(opts.output_len)[1]
    max_len = max(opts.max_model_len or 0, in_hi + out_hi + 64)
    if opts.engine_process:  # the CLI's own factory, in a spawned process
        import functools

        from speedcore.server.cli import _engine_of
        from speedcore.server.engine_process import RemoteBackend

        ns = argparse.Namespace(fake_engine=opts.fake, preset=None if opts.fake else opts.preset, model=None,
                                max_model_len=max_len, max_num_seqs=opts.max_num_seqs,
                                max_num_batched_tokens=opts.max_num_batched_tokens, block_size=16,
                                fake_step_delay=opts.fake_step_ms / 1e3, enable_prefix_caching=True, seed=opts.seed,
                                dtype="auto", gpu_memory_utilization=opts.gpu_memory_utilization,
                                enforce_eager=False, served_model_name=None)
        return RemoteBackend(functools.partial(_engine_of, ns)), "fake" if opts.fake else opts.preset
    if opts.fake:
        return make_fake_llm(vocab_size=4096, max_model_len=max_len, max_num_seqs=opts.max_num_seqs,
                             max_num_batched_tokens=opts.max_num_batched_tokens,
                             step_delay=opts.fake_step_ms / 1e3), "fake"
    from speedcore.engine import LLM

    llm = LLM(f"preset:{opts.preset}", max_model_len=max_len, max_num_seqs=opts.max_num_seqs,
              max_num_batched_tokens=opts.max_num_batched_tokens, gpu_memory_utilization=opts.gpu_memory_utilization,
              seed=opts.seed, log=_log)
    attach_number_tokenizer(llm)
    return llm, opts.preset


def _steps(engine, what, wall_s):
    """Log and return the engine's steps of the run just done: how many, the time inside them against the run's
    wall time (what the engine loop spends between steps: commands, results), by kind and phase."""
    from speedcore.server import loadgen

    report, steps, busy = engine.call(loadgen.take_step_report).result(60)
    _log(f"{what}: {steps} engine steps, {1e3 * busy / max(1, steps):.2f} ms each inside the step, "
         f"{1e3 * wall_s / max(1, steps):.2f} ms of wall time each\n{report}")
    return dict(steps=steps, busy_s=busy, wall_s=wall_s, report=report)


def _words(ids):
    return " ".join(f"t{int(i)}" for i in ids)


def _identity(server, name, rng, n_prompts, failures):
    """Greedy server output == offline output, one request at a time, the prefix cache emptied before each run
    (a cache hit takes another prefill path, which may differ in the last bits)."""
    import functools

    import openai

    from speedcore.server import loadgen

    engine = server.engine
    hi = engine.backend.tokenizer.first_special
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    checked = mismatched = 0
    for k in range(n_prompts):
        text = _words(rng.integers(0, hi, int(rng.integers(8, min(200, engine.backend.max_model_len - 64)))))
        msgs = [dict(role="system", content=_words(rng.integers(0, hi, 6))), dict(role="user", content=text)]
        ref_c, ref_chat = (types.SimpleNamespace(token_ids=ids, text=t) for ids, t in engine.call(
            functools.partial(loadgen.offline_references, text=text, messages=msgs, max_tokens=32)).result(600))
        for kind in ("completion", "chat"):
            for stream in (False, True):
                engine.call(loadgen.reset_prefix_cache).result(60)
                kw = dict(model=name, max_tokens=32, temperature=0, extra_body=dict(return_token_ids=True))
                if kind == "completion":
                    ref = ref_c
                    if stream:
                        chunks = list(client.completions.create(prompt=text, stream=True, **kw))
                        got_text = "".join(c.choices[0].text for c in chunks if c.choices)
                        got_ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
                    else:
                        c = client.completions.create(prompt=text, **kw).choices[0]
                        got_text, got_ids = c.text, c.model_extra["token_ids"]
                else:
                    ref = ref_chat
                    if stream:
                        chunks = list(client.chat.completions.create(messages=msgs, stream=True, **kw))
                        got_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                        got_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {})
                                   .get("token_ids", [])]
                    else:
                        c = client.chat.completions.create(messages=msgs, **kw).choices[0]
                        got_text, got_ids = c.message.content, c.model_extra["token_ids"]
                checked += 1
                if got_ids != list(ref.token_ids) or got_text != ref.text:
                    mismatched += 1
                    failures.append(f"identity {kind} stream={stream} prompt {k}: server {got_ids[:8]}... "
                                    f"!= offline {list(ref.token_ids)[:8]}...")
    _log(f"identity: {checked - mismatched}/{checked} server outputs identical to offline generate/chat")
    return dict(checked=checked, identical=checked - mismatched)


def _jobs(prompts, out_lens, name, drop_every=0, rng=None, drop_len=256):
    jobs = []
    for i, (p, n) in enumerate(zip(prompts, out_lens)):
        body = dict(model=name, prompt=p, max_tokens=int(n), temperature=0, stream=True, ignore_eos=True,
                    skip_special_tokens=False, stream_options=dict(include_usage=True))
        drop = None
        if drop_every and i % drop_every == drop_every // 2:  # a long request, left after 2-5 events
            drop = int(rng.integers(2, 6))
            body["max_tokens"] = int(max(n, drop_len))
        jobs.append(dict(i=i, path="/v1/completions", body=body, drop_after=drop))
    return jobs


def _check_records(recs, jobs, failures, what):
    """0 lost or duplicated: one record per job; each completed one has one [DONE], its usage, and exactly
    max_tokens words of text (skip_special_tokens false: one word per token)."""
    if [r["i"] for r in recs] != [j["i"] for j in jobs]:
        failures.append(f"{what}: {len(recs)} records for {len(jobs)} jobs")
    completed = dropped = 0
    for r, j in zip(recs, jobs):
        if r["error"] or r["status"] != 200:
            failures.append(f"{what}: request {r['i']} failed: status {r['status']}, {r['error']}")
            continue
        if r["dropped"]:
            dropped += 1
            continue
        completed += 1
        n = j["body"]["max_tokens"]
        words = len(r["text"].split())
        if r["done"] != 1 or not r["usage"] or r["usage"]["completion_tokens"] != n or words != n:
            failures.append(f"{what}: request {r['i']}: [DONE] x{r['done']}, usage {r['usage']}, {words} words "
                            f"for max_tokens {n}")
    return completed, dropped


BAD_INPUTS = [  # (what, path, raw body, headers, status)
    ("malformed JSON", "/v1/completions", b'{"prompt": ', None, 400),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "t1 \xc3\x28"}', None, 400),
    ("wrong type", "/v1/completions", b'{"prompt": "t1", "max_tokens": "many"}', None, 400),
    ("n > 1", "/v1/completions", b'{"prompt": "t1", "n": 3}', None, 400),
    ("max_tokens past the context", "/v1/completions", b'{"prompt": "t1", "max_tokens": 10000000}', None, 400),
    ("unknown model", "/v1/completions", b'{"model": "gpt-5", "prompt": "t1"}', None, 404),
    ("chat: messages not a list", "/v1/chat/completions", b'{"messages": "hi"}', None, 400),
    ("body too large", "/v1/completions", b'{"prompt": "' + b"t1 " * (1 << 20) + b'"}', None, 413),
    ("no API key", "/v1/completions", b'{"prompt": "t1"}', {}, 401),
    ("wrong API key", "/v1/completions", b'{"prompt": "t1"}', {"Authorization": "Bearer nope"}, 401),
]


def _prober(url, stop, failures, counts):
    """Send every bad input, again and again (bounded), while the load runs: each must get its status."""
    import httpx

    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    with httpx.Client(timeout=60) as c:
        for _ in range(50):
            for what, path, body, headers, status in BAD_INPUTS:
                h = auth if headers is None else {"Content-Type": "application/json", **headers}
                try:
                    r = c.post(url + path, content=body, headers=h)
                    ok = r.status_code == status and set(r.json().get("error", {})) == {"message", "type", "param",
                                                                                       "code"}
                except Exception as e:
                    ok, r = False, e
                counts[what] = counts.get(what, 0) + 1
                if not ok:
                    failures.append(f"bad input {what!r}: expected {status}, got {getattr(r, 'status_code', r)}")
            if stop.wait(0.2):
                return


def run(opts) -> dict:
    import functools

    from speedcore.server import loadgen
    from speedcore.server.loadgen import run_clients
    from speedcore.server.runner import ServerThread, make_app

    failures = []
    t_all = time.perf_counter()
    llm, name = _build(opts)
    res = dict(op="serve", model=name, requests=opts.requests, concurrency=opts.concurrency,
               input_len=opts.input_len, output_len=opts.output_len, max_num_seqs=opts.max_num_seqs,
               engine_process=bool(opts.engine_process))
    try:
        app = make_app(llm, served_model_name=name, api_key=API_KEY, max_queue=max(opts.requests, 256))
        with ServerThread(app) as server:
            engine = server.engine
            V = engine.backend.tokenizer.first_special
            rng = np.random.default_rng(opts.seed)
            in_lo, in_hi = _range(opts.input_len)
            out_lo, out_hi = _range(opts.output_len)
            n = opts.requests
            prompts = [rng.integers(0, V, int(L)).tolist() for L in rng.integers(in_lo, in_hi + 1, n)]
            out_lens = rng.integers(out_lo, out_hi + 1, n)
            # offline reference throughput on the same prompts, on the engine (its thread, or its process) while
            # the server is idle, after a warm-up on a batch of the workload's shapes (compiling what start-up did
            # not: else the offline run, first, would pay for it)
            _log(f"offline generate: {n} prompts ...")
            offline_tokens, offline_s = engine.call(functools.partial(
                loadgen.offline_generate, prompts=prompts, max_tokens=[int(o) for o in out_lens],
                warmup_rows=opts.max_num_seqs)).result(3600)
            res.update(offline_s=offline_s, offline_tok_s=offline_tokens / offline_s)
            _log(f"offline: {offline_tokens} tokens in {offline_s:.2f} s = {offline_tokens / offline_s:.0f} tok/s")
            res["offline_steps"] = _steps(engine, "offline", offline_s)
            res["identity"] = _identity(server, name, rng, opts.check_prompts, failures)

            _log(f"throughput: {n} streaming requests, {opts.concurrency} concurrent ...")
            engine.call(loadgen.reset_prefix_cache).result(60)
            jobs = _jobs(prompts, out_lens, name)
            tokens0 = engine.metrics.generation_tokens.value()
            engine.call(loadgen.take_step_report).result(60)  # the identity check's steps: not this run's
            engine.reset_window()
            recs = run_clients(server.url, jobs, concurrency=opts.concurrency, processes=opts.client_processes,
                               api_key=API_KEY)
            engine_tok_s = (engine.metrics.generation_tokens.value() - tokens0) / max(
                1e-9, engine.last_token_time - engine.first_arrival)
            completed, _ = _check_records(recs, jobs, failures, "throughput")
            wall = max(r["end"] for r in recs) - min(r["start"] for r in recs)
            tokens = sum((r["usage"] or {}).get("completion_tokens", 0) for r in recs)
            ttft = [r["ttft_s"] for r in recs if r["ttft_s"] is not None]
            gaps = [g for r in recs for g in r["gaps_s"]]
            st = engine.metrics
            res["server_steps"] = _steps(engine, "server", engine.last_token_time - engine.first_arrival)
            # offline again, after the server's run: the peer is the better of the two (one offline figure moved by
            # 20% between machines and runs; the served figure must not gain from a slow one)
            again_tokens, again_s = engine.call(functools.partial(
                loadgen.offline_generate, prompts=prompts, max_tokens=[int(o) for o in out_lens])).result(3600)
            _log(f"offline again: {again_tokens / again_s:.0f} tok/s (first: {res['offline_tok_s']:.0f})")
            engine.call(loadgen.take_step_report).result(60)
            res.update(offline_first_tok_s=res["offline_tok_s"], offline_again_tok_s=again_tokens / again_s,
                       offline_tok_s=max(res["offline_tok_s"], again_tokens / again_s))
            res.update(server_s=wall, server_tok_s=tokens / wall, server_engine_tok_s=engine_tok_s,
                       ratio_to_offline=(tokens / wall) / res["offline_tok_s"],
                       completed=completed, ttft_ms=dict(p50=_pct(ttft, 50) * 1e3, p99=_pct(ttft, 99) * 1e3),
                       chunk_gap_ms=dict(p50=_pct(gaps, 50) * 1e3, p99=_pct(gaps, 99) * 1e3),
                       server_itl_ms=dict(mean=st.itl.sum / max(1, st.itl.count) * 1e3),
                       preemptions=engine.stats().get("preemptions"))
            _log(f"server: {tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tok/s as the clients saw them "
                 f"({res['ratio_to_offline']:.3f}x offline; {engine_tok_s:.0f} tok/s from the first arrival to the "
                 f"last token in the engine); TTFT p50 {res['ttft_ms']['p50']:.1f} ms p99 "
                 f"{res['ttft_ms']['p99']:.1f} ms; inter-chunk p50 {res['chunk_gap_ms']['p50']:.2f} ms p99 "
                 f"{res['chunk_gap_ms']['p99']:.2f} ms")
            gpu_idle = engine.call(loadgen.idle_state).result(60)[4]

            m = max(32, n // 4)
            _log(f"robustness: {m} streaming requests, every 10th client disconnecting, bad inputs alongside ...")
            aborted0, finished0 = st.requests_aborted.value(), st.requests_finished.value(finished_reason="length")
            jobs = _jobs(prompts[:m], out_lens[:m], name, drop_every=10, rng=rng, drop_len=out_hi)
            stop, counts = threading.Event(), {}
            prober = threading.Thread(target=_prober, args=(server.url, stop, failures, counts), daemon=True)
            prober.start()
            try:
                recs = run_clients(server.url, jobs, concurrency=opts.concurrency, processes=opts.client_processes,
                                   api_key=API_KEY)
            finally:
                stop.set()
                prober.join(120)
            completed, dropped = _check_records(recs, jobs, failures, "robustness")
            deadline = time.monotonic() + 30
            while True:  # aborts land before the engine's next step; the last ones may still be in the queue
                idle = engine.call(loadgen.idle_state).result(60)
                if (not idle[0] and not idle[1] and idle[2] == idle[3] and engine.num_in_flight == 0) or \
                        time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if idle[0] or idle[1] or idle[2] != idle[3] or engine.num_in_flight:
                failures.append(f"not idle after the load: unfinished {idle[0]}/{idle[1]}, free blocks "
                                f"{idle[2]}/{idle[3]}, {engine.num_in_flight} in flight")
            aborted = st.requests_aborted.value() - aborted0
            finished = st.requests_finished.value(finished_reason="length") - finished0
            if aborted + finished != m or aborted > dropped:  # a client may leave just after its last token
                failures.append(f"robustness: {m} requests, {finished} finished and {aborted} aborted in the "
                                f"engine, {dropped} clients disconnected")
            gpu_after = idle[4]
            if abs(gpu_after - gpu_idle) > 64 << 20:
                failures.append(f"GPU memory in use {gpu_after / 2**20:.0f} MiB after the load, "
                                f"{gpu_idle / 2**20:.0f} MiB before")
            res.update(robustness=dict(requests=m, completed=completed, disconnected=dropped, aborted=aborted,
                                       bad_inputs_sent=sum(counts.values()), kv_free_blocks=idle[2],
                                       kv_blocks=idle[3], gpu_used_mib_before=gpu_idle / 2**20,
                                       gpu_used_mib_after=gpu_after / 2**20))
            _log(f"robustness: {completed} completed, {dropped} disconnected ({aborted} aborted in the engine), "
                 f"{sum(counts.values())} bad inputs answered; KV blocks free {idle[2]}/{idle[3]}; GPU memory in "
                 f"use {gpu_idle / 2**20:.0f} -> {gpu_after / 2**20:.0f} MiB")
    finally:
        llm.close()
    res["failures"] = failures
    res["elapsed_s"] = time.perf_counter() - t_all
    _log(f"{name}: {'PASS' if not failures else 'FAIL'} in {res['elapsed_s']:.0f} s" +
         "".join(f"\n  {f}" for f in failures[:20]))
    return res


def _parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-3.2-1b", help="llama-3.2-1b (default), llama-3-8b, tiny")
    p.add_argument("--fake", action="store_true", help="the CPU stand-in engine (no GPU): checks the script itself")
    p.add_argument("--fake-step-ms", type=float, default=0.0,
                   help="with --fake: a sleep per engine step (the interpreter lock released, as in a GPU wait)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine in a process of its own (default, as speedcore serve; --no-engine-process: in "
                        "a thread of the server)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=256)
    # enough client processes that parsing 256 streams is not what the benchmark measures; the server's process
    # needs about two cores (the engine thread and the event loop)
    p.add_argument("--client-processes", type=int, default=max(2, min(8, (os.cpu_count() or 4) // 2)))
    p.add_argument("--input-len", default="32:1024")
    p.add_argument("--output-len", default="16:256")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--check-prompts", type=int, default=4, help="prompts of the identity check (x4 requests each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    return p


def cases(b):
    """Suite mode: SPEEDCORE_SERVE_PRESETS (default llama-3.2-1b,llama-3-8b), SPEEDCORE_SERVE_REQUESTS (default
    2000, as the issue's acceptance names for every preset; 300 with --quick), SPEEDCORE_SERVE_ENGINE_PROCESS=0
    (--no-engine-process)."""
    presets = os.environ.get("SPEEDCORE_SERVE_PRESETS", "llama-3.2-1b,llama-3-8b").split(",")
    n = int(os.environ.get("SPEEDCORE_SERVE_REQUESTS", 300 if b.quick else 2000))

    process = os.environ.get("SPEEDCORE_SERVE_ENGINE_PROCESS", "1") == "1"

    def case(b, preset):
        opts = _parser().parse_args(["--preset", preset, "--requests", str(n)]
                                    + ([] if process else ["--no-engine-process"]))
        r = run(opts)
        what = (f"{preset}, {opts.requests} streaming requests, {opts.concurrency} clients"
                + (", engine process" if process else ""))
        b.add("serve", f"{what}: output tok/s", "tok/s", r["server_tok_s"],
              {"offline LLM.generate": r["offline_tok_s"]})
        b.add("serve", f"{what}: output tok/s, engine side", "tok/s", r["server_engine_tok_s"],
              {"offline LLM.generate": r["offline_tok_s"]})
        b.add("serve", f"{what}: TTFT p50", "ms", r["ttft_ms"]["p50"], {}, higher_is_better=False)
        b.add("serve", f"{what}: TTFT p99", "ms", r["ttft_ms"]["p99"], {}, higher_is_better=False)
        b.add("serve", f"{what}: inter-chunk p50", "ms", r["chunk_gap_ms"]["p50"], {}, higher_is_better=False)
        b.add("serve", f"{what}: inter-chunk p99", "ms", r["chunk_gap_ms"]["p99"], {}, higher_is_better=False)
        if r["failures"]:
            raise AssertionError(f"{len(r['failures'])} checks failed, e.g. {r['failures'][0]}")

    return [(f"serve {p}", lambda b, p=p: case(b, p)) for p in presets if p]


def main(argv=None) -> int:
    opts = _parser().parse_args(argv)
    r = run(opts)
    print(json.dumps({k: v for k, v in r.items() if k != "failures"}, indent=1))
    print(f"{len(r['failures'])} failed checks" + "".join(f"\n  {f}" for f in r["failures"]))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(r, f, indent=1)
    return 1 if r["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
