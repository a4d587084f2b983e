"""A load generator for the server (benchmarks/serve.py): streaming clients in worker processes (so their JSON
parsing does not share the server's interpreter), each process running many concurrent requests on asyncio and
httpx.  Loopback targets only; bounded by the job list and a per-request timeout."""
from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from typing import List, Optional


def run_clients(url: str, jobs: List[dict], *, concurrency: int, processes: int = 4, api_key: Optional[str] = None,
                timeout: float = 600.0, start_delay: float = 3.0) -> List[dict]:
    """Run ``jobs`` against ``url`` (http://127.0.0.1:PORT) with ``concurrency`` requests in flight in all;
    returns one record per job (see ``_one``).  A job: {"i", "path", "body", "drop_after": events or None}."""
    host = url.split("//", 1)[-1].split(":", 1)[0]
    if host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
        raise ValueError(f"url: the load generator targets loopback only, got {url!r}")
    processes = max(1, min(processes, len(jobs)))
    groups = [jobs[p::processes] for p in range(processes)]
    per = max(1, math.ceil(concurrency / processes))
    start_at = time.monotonic() + start_delay  # every process starts together, after its imports
    ctx = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA and server threads
    with ProcessPoolExecutor(max_workers=processes, mp_context=ctx) as ex:
        futs = [ex.submit(_worker, url, g, per, api_key, timeout, start_at) for g in groups]
        out = []
        for f in futs:
            out += f.result(timeout + start_delay + 60)
    return sorted(out, key=lambda r: r["i"])


def _worker(url, jobs, concurrency, api_key, timeout, start_at):
    return asyncio.run(_main(url, jobs, concurrency, api_key, timeout, start_at))


async def _main(url, jobs, concurrency, api_key, timeout, start_at):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout, connect=30.0)) as client:
        async def guarded(job):
            async with sem:
                return await _one(client, job)

        return await asyncio.gather(*(guarded(j) for j in jobs))


async def _one(client, job) -> dict:
    """Record: i, status, events (data: lines), done ([DONE] seen, once), text, token_ids, usage, ttft_s (to the
    first event with tokens), gaps_s (between events with tokens), start/end (monotonic), dropped, error."""
    rec = dict(i=job["i"], status=None, events=0, done=0, text="", token_ids=[], usage=None, ttft_s=None,
               gaps_s=[], start=time.monotonic(), end=None, dropped=False, error=None, finish_reason=None)
    drop = job.get("drop_after")
    last = None
    try:
        async with client.stream("POST", job["path"], json=job["body"]) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = (await r.aread()).decode("utf-8", "replace")[:300]
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                rec["events"] += 1
                if data == "[DONE]":
                    rec["done"] += 1
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    rec["error"] = obj["error"].get("message")
                    continue
                if obj.get("usage"):
                    rec["usage"] = obj["usage"]
                for ch in obj.get("choices") or []:
                    text = ch["delta"].get("content") if "delta" in ch else ch.get("text")
                    ids = ch.get("token_ids") or []
                    if text or ids:
                        now = time.monotonic()
                        if last is None:
                            rec["ttft_s"] = now - rec["start"]
                        else:
                            rec["gaps_s"].append(now - last)
                        last = now
                    rec["text"] += text or ""
                    rec["token_ids"] += ids
                    if ch.get("finish_reason"):
                        rec["finish_reason"] = ch["finish_reason"]
                if drop is not None and rec["events"] >= drop:
                    rec["dropped"] = True
                    break  # leaving the block closes the connection: the server must abort the request
    except Exception as e:  # a transport error is a lost request: recorded, counted by the caller
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        rec["end"] = time.monotonic()
    return rec


# -- engine-side steps of benchmarks/serve.py: run through AsyncEngine.call (on the engine thread, or in the engine
# process: hence module-level functions, picklable with functools.partial) -------------------------------------
def reset_prefix_cache(backend) -> None:
    backend.llm.block_manager.reset_prefix_cache()


def offline_generate(backend, prompts, max_tokens, warmup_rows: int = 0) -> tuple:
    """(output tokens, seconds) of ``LLM.generate`` over token-id prompts, greedy, no early stop, the prefix
    cache emptied first; ``warmup_rows`` prompts run 4 tokens each before (compiling what start-up did not)."""
    from ..engine import SamplingParams

    llm = backend.llm
    if warmup_rows:
        llm.generate(prompts[:warmup_rows], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.block_manager.reset_prefix_cache()
    llm.step_stats.clear()  # take_step_report then gives this run's steps alone
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [SamplingParams(max_tokens=int(m), ignore_eos=True, temperature=0)
                                  for m in max_tokens], use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0


def take_step_report(backend) -> tuple:
    """(the engine's step report since the last call, steps, seconds inside them): what the steps of a run cost, by
    kind and phase (LLM.step_report), to set beside the run's wall time, with the engine process's time between
    steps and the garbage collector's in all; the counts start again from zero."""
    from ..engine.llm import gc_clock

    llm = backend.llm
    stats = llm.step_stats
    steps, busy = sum(v[0] for v in stats.values()), sum(sum(v[2:6]) for v in stats.values())
    report = llm.step_report()
    stats.clear()
    loop_s = getattr(backend, "loop_s", None)  # set by the engine process's loop
    if loop_s and steps:
        report += "\nbetween steps, ms/step: " + ", ".join(f"{k} {1e3 * v / steps:.3f}" for k, v in loop_s.items())
        for k in loop_s:
            loop_s[k] = 0.0
    now = gc_clock()
    before = getattr(backend, "gc_mark", ((0, 0.0),) * 3)
    backend.gc_mark = now
    report += "\ngarbage collector, generation: collections, ms in all: " + "; ".join(
        f"{g}: {n - n0}, {1e3 * (s - s0):.1f}" for g, ((n, s), (n0, s0)) in enumerate(zip(now, before)))
    return report, steps, busy


def offline_references(backend, text: str, messages: list, max_tokens: int) -> tuple:
    """Greedy offline (token ids, text) of a completion and of a chat, each from an empty prefix cache."""
    from ..engine import SamplingParams

    llm = backend.llm
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.block_manager.reset_prefix_cache()
    c = llm.generate([text], sp, use_tqdm=False)[0].outputs[0]
    llm.block_manager.reset_prefix_cache()
    ch = llm.chat(messages, sp, use_tqdm=False)[0].outputs[0]
    return (list(c.token_ids), c.text), (list(ch.token_ids), ch.text)


def idle_state(backend) -> tuple:
    """(requests unfinished in the backend, in the scheduler, free KV blocks, KV blocks, GPU bytes in use)."""
    llm = backend.llm
    gpu = 0
    try:
        import cupy

        if getattr(llm, "_cp", None) is cupy:
            gpu = int(cupy.get_default_memory_pool().used_bytes())
    except Exception:
        pass
    return (backend.has_unfinished(), llm.scheduler.has_unfinished(), llm.block_manager.num_free_blocks,
            llm.block_manager.num_blocks, gpu)
