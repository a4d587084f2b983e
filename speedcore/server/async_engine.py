"""The asynchronous front of the synchronous engine.

``speedcore.LLM`` is a step loop with no request-level API, so ``LLMBackend`` is a thin adapter over its request
internals (``_add``, ``_step``, ``scheduler.finish``): add a request, abort it, run one step and collect each
request's new tokens and text.  ``AsyncEngine`` runs the backend in one background thread, the only thread that
touches the engine (and the GPU).  The asyncio handlers talk to it through a thread-safe command queue (add,
abort, call); the engine thread hands back each step's output in one ``call_soon_threadsafe`` per step, onto one
asyncio queue per request.  New requests join the running batch at the next step; an abort (a client that went
away) is applied before the next step, which gives the request's KV blocks back.  With
``engine_process.RemoteBackend`` in place of ``LLMBackend`` the engine runs in a process of its own, and the
engine thread here only exchanges one message per step with it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from .metrics import ServerMetrics

log = logging.getLogger("speedcore.server")


@dataclass
class Delta:
    """One request's progress in one engine step (or its failure)."""
    request_id: str
    token_ids: List[int]
    text: str
    logprobs: Optional[List[dict]]  # per new token: {token_id: logprob}, the sampled token included
    finished: bool
    finish_reason: Optional[str] = None  # "stop", "length", "error"
    stop_reason: object = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: Optional[str] = None
    time: float = 0.0  # time.perf_counter() when the tokens were sampled

    def row(self) -> tuple:
        """The fields in order (``Delta(*d.row())`` is ``d``)."""
        return (self.request_id, self.token_ids, self.text, self.logprobs, self.finished, self.finish_reason,
                self.stop_reason, self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens, self.error,
                self.time)

    def merge(self, later: "Delta") -> "Delta":
        """This delta followed by ``later`` of the same request, as one (a slow reader gets one chunk)."""
        lp = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        return Delta(self.request_id, self.token_ids + later.token_ids, self.text + later.text, lp, later.finished,
                     later.finish_reason, later.stop_reason, later.num_prompt_tokens, later.num_output_tokens,
                     later.num_cached_tokens, later.error, later.time)


class LLMBackend:
    """Request-level access to a ``speedcore.LLM`` (GPU, or the CPU stand-in of ``fake_engine``); every method
    runs on the engine thread only."""

    def __init__(self, llm):
        self.llm = llm
        self._reqs: Dict[str, object] = {}  # server request id -> the engine's _Request
        self._by_seq: Dict[int, object] = {}  # seq_id -> _Request, as LLM._step wants it
        self._rid_of: Dict[int, str] = {}

    # -- what the HTTP layer reads (immutable after start) ------------------------------------------------------
    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.llm.config.vocab_size

    @property
    def max_num_seqs(self) -> int:
        return self.llm.scheduler.max_num_seqs

    # -- requests -----------------------------------------------------------------------------------------------
    def add(self, request_id: str, prompt: Optional[str], prompt_token_ids: List[int], params) -> Optional[Delta]:
        """Queue a request; returns its failure as a finished Delta if the engine refuses it."""
        try:
            req = self.llm._add(0, {"prompt": prompt, "prompt_token_ids": prompt_token_ids}, params)
        except Exception as e:  # the engine's own checks fail requests without raising; this is a bug's net
            log.exception("speedcore engine: adding a request failed")
            return Delta(request_id, [], "", None, True, "error", None, len(prompt_token_ids), 0, 0,
                         f"{type(e).__name__}: {e}", time.perf_counter())
        if req.error is not None:
            return Delta(request_id, [], "", None, True, "error", None, len(req.ids), 0, 0, req.error,
                         time.perf_counter())
        self._reqs[request_id] = req
        self._by_seq[req.seq.seq_id] = req
        self._rid_of[req.seq.seq_id] = request_id
        return None

    def _drop(self, request_id: str):
        req = self._reqs.pop(request_id, None)
        if req is not None:
            self._by_seq.pop(req.seq.seq_id, None)
            self._rid_of.pop(req.seq.seq_id, None)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request now and give back its KV blocks; False if it is not running (finished or unknown)."""
        req = self._drop(request_id)
        if req is None or req.seq.is_finished:
            return False
        self.llm.scheduler.finish(req.seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self._reqs)

    def abort_all(self) -> None:
        for rid in list(self._reqs):
            self.abort(rid)

    def step(self) -> List[Delta]:
        return [Delta(*row) for row in self.step_rows()]

    def step_rows(self) -> List[tuple]:
        """One engine step's deltas as tuples of Delta's fields in order (what the engine process sends: tuples
        pickle several times faster than dataclass instances)."""
        reqs = self.llm._step(self._by_seq)
        now = time.perf_counter()
        out = []
        rid_of = self._rid_of
        for r in reqs:
            seq = r.seq
            rid = rid_of[seq.seq_id]
            ids, text = r.new_ids, r.new_text
            r.new_ids, r.new_text = [], ""
            lp = r.logprobs[len(r.logprobs) - len(ids):] if r.logprobs is not None else None
            finished = seq.is_finished
            out.append((rid, ids, text, lp, finished, seq.finish_reason if finished else None,
                        seq.stop_reason if finished else None, seq.num_prompt_tokens, seq.num_output_tokens,
                        seq.num_cached_prefix, None, now))
            if finished:
                self._drop(rid)
        return out

    def fail_all(self, why: str) -> List[Delta]:
        """After a step raised: end every request with ``why`` (the engine keeps serving new ones)."""
        now = time.perf_counter()
        out = []
        for rid in list(self._reqs):
            req = self._drop(rid)
            if not req.seq.is_finished:
                self.llm.scheduler.finish(req.seq, "error")
            out.append(Delta(rid, [], "", None, True, "error", None, req.seq.num_prompt_tokens,
                             req.seq.num_output_tokens, 0, why, now))
        return out

    def run_call(self, fn):
        """``fn(self)`` (AsyncEngine.call); the engine-process backend runs it in that process."""
        return fn(self)

    def stats(self) -> dict:
        sch, bm = self.llm.scheduler, self.llm.block_manager
        free = bm.num_free_blocks
        return dict(running=len(sch.running), engine_waiting=len(sch.waiting), num_blocks=bm.num_blocks,
                    free_blocks=free, kv_usage=1.0 - free / bm.num_blocks, preemptions=sch.num_preemptions,
                    prefix_hits=bm.hits, prefix_queries=bm.queries, unfinished=len(self._reqs))


class QueueFull(Exception):
    """The server holds as many requests as it accepts (running + --max-queue waiting)."""


_CANCELLED = object()  # put on a stream's queue when it is aborted


class RequestStream:
    """The asyncio side of one request: ``await next()`` gives its next Delta (several merged if they piled up),
    or None once it was aborted.  ``abort()`` is idempotent and safe after the end."""

    def __init__(self, engine: "AsyncEngine", request_id: str, arrival: float, num_prompt_tokens: int):
        self.engine = engine
        self.request_id = request_id
        self.arrival = arrival
        self.num_prompt_tokens = num_prompt_tokens
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.aborted = False
        self.released = False
        # written by the engine thread only (latency metrics)
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None

    async def next(self) -> Optional[Delta]:
        d = await self.queue.get()
        if d is _CANCELLED:
            return None
        while not d.finished and not self.queue.empty():
            nxt = self.queue.get_nowait()
            if nxt is _CANCELLED:
                return None
            d = d.merge(nxt)
        return d

    def abort(self) -> None:
        if self.finished or self.aborted:
            return
        self.aborted = True
        self.queue.put_nowait(_CANCELLED)
        self.engine._abort(self)


class AsyncEngine:
    """The engine thread and the queues around it.  ``max_queue``: how many requests may wait beyond the
    ``max_num_seqs`` the engine runs at once; a request past that is refused (QueueFull -> 503)."""

    def __init__(self, backend: LLMBackend, *, max_queue: int = 256):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue: expected an int >= 0, got {max_queue!r}")
        self.backend = backend
        self.max_queue = max_queue
        self.capacity = backend.max_num_seqs + max_queue
        self.metrics = ServerMetrics(self.stats)
        self._cmds: "queue.Queue" = queue.Queue()
        self._live: Dict[str, RequestStream] = {}  # engine thread only
        self._ids = itertools.count()
        self._stats = dict(backend.stats())
        self._stats["waiting"] = 0
        self.num_in_flight = 0  # event-loop thread only
        # throughput windows (benchmarks): the first arrival since reset_window(), the last token sampled
        self.first_arrival: Optional[float] = None
        self.last_token_time = 0.0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None  # what ended the engine thread, if it died

    # -- lifetime -----------------------------------------------------------------------------------------------
    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Start the engine thread; results go to ``loop`` (default: the running one)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="speedcore-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is in flight and stop the engine thread (the LLM itself stays open)."""
        if self._thread is None:
            return
        self._cmds.put(("stop", None))
        self._thread.join(timeout)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the event-loop side ------------------------------------------------------------------------------------
    def submit(self, prompt: Optional[str], prompt_token_ids: List[int], params, *,
               arrival: Optional[float] = None) -> RequestStream:
        """Queue a request (from the event loop); raises QueueFull when the server is full."""
        if self.num_in_flight >= self.capacity:
            self.metrics.requests_rejected.inc()
            raise QueueFull(f"the server is full ({self.num_in_flight} requests: {self.backend.max_num_seqs} "
                            f"running at most, --max-queue {self.max_queue} waiting); retry later")
        if not self.alive:
            raise RuntimeError(f"the engine thread is not running ({self.error!r})")
        rid = f"{next(self._ids)}"
        stream = RequestStream(self, rid, time.perf_counter() if arrival is None else arrival,
                               len(prompt_token_ids))
        if self.first_arrival is None:
            self.first_arrival = stream.arrival
        self.num_in_flight += 1
        self._cmds.put(("add", (stream, prompt, list(prompt_token_ids), params)))
        return stream

    def _abort(self, stream: RequestStream) -> None:
        self._release(stream)
        self._cmds.put(("abort", stream))

    def _release(self, stream: RequestStream) -> None:
        if not stream.released:
            stream.released = True
            self.num_in_flight -= 1

    def _deliver(self, items) -> None:
        for stream, d in items:
            if stream.aborted:
                continue
            if d.finished:
                stream.finished = True
                self._release(stream)
            stream.queue.put_nowait(d)

    def reset_window(self) -> None:
        """Start a throughput window: tokens / (last_token_time - first_arrival) from the next request on."""
        self.first_arrival = None

    def call(self, fn: Callable[[LLMBackend], object]) -> concurrent.futures.Future:
        """Run ``fn(backend)`` on the engine thread between steps (inspection in tests and benchmarks)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("call", (fn, fut)))
        return fut

    def stats(self) -> dict:
        st = dict(self._stats)
        st["waiting"] = max(0, self.num_in_flight - st.get("running", 0))
        st["in_flight"] = self.num_in_flight
        return st

    # -- the engine thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop_body()
        except BaseException as e:  # noqa: B902 - recorded for /health, then the thread ends
            self.error = e
            log.exception("speedcore engine thread died")
            for stream in list(self._live.values()):
                self._post([(stream, Delta(stream.request_id, [], "", None, True, "error", error=f"engine: {e}"))])
            self._live.clear()

    def _post(self, items) -> None:
        if items:
            try:
                self._loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the event loop is closed (shutting down)
                pass

    def _loop_body(self) -> None:
        backend, cmds, m = self.backend, self._cmds, self.metrics
        while True:
            batch = []
            if not backend.has_unfinished():
                batch.append(cmds.get())  # idle: sleep until something arrives
            while True:
                try:
                    batch.append(cmds.get_nowait())
                except queue.Empty:
                    break
            out = []
            for kind, arg in batch:
                if kind == "add":
                    stream, prompt, ids, params = arg
                    if stream.aborted:
                        continue
                    failed = backend.add(stream.request_id, prompt, ids, params)
                    if failed is not None:
                        m.requests_failed.inc()
                        out.append((stream, failed))
                    else:
                        self._live[stream.request_id] = stream
                        m.prompt_tokens.inc(len(ids))
                elif kind == "abort":
                    if self._live.pop(arg.request_id, None) is not None:
                        backend.abort(arg.request_id)
                        m.requests_aborted.inc()
                elif kind == "call":
                    fn, fut = arg
                    try:
                        fut.set_result(backend.run_call(fn))
                    except BaseException as e:  # noqa: B902 - handed to the caller
                        fut.set_exception(e)
                elif kind == "stop":
                    for rid in list(self._live):
                        backend.abort(rid)
                        m.requests_aborted.inc()
                        out.append((self._live.pop(rid), Delta(rid, [], "", None, True, "error",
                                                               error="the server is shutting down")))
                    self._post(out)
                    return
            if backend.has_unfinished():
                try:
                    deltas = backend.step()
                except Exception as e:
                    log.exception("speedcore engine step failed; failing the requests in flight")
                    deltas = backend.fail_all(f"the engine step failed: {type(e).__name__}: {e}")
                stepped = []
                for d in deltas:
                    stream = self._live.get(d.request_id)
                    if stream is None:
                        continue
                    if d.finished:
                        del self._live[d.request_id]
                    stepped.append((stream, d))
                self._account(stepped)
                out += stepped
            st = backend.stats()  # before the results go out: a client that scrapes /metrics next sees this step
            st["running"] = min(st["running"], len(self._live))
            self._stats = st
            self._post(out)

    def _account(self, stepped) -> None:
        """Latency and token metrics of one step's (stream, delta) pairs, one lock per metric per step."""
        m = self.metrics
        n_tok, ttft, itl, e2e, failed, reasons = 0, [], [], [], 0, {}
        for stream, d in stepped:
            n = len(d.token_ids)
            if n:
                n_tok += n
                if stream.first_token_time is None:
                    stream.first_token_time = d.time
                    ttft.append(d.time - stream.arrival)
                else:
                    itl.append(d.time - stream.last_token_time)
                stream.last_token_time = d.time
            if d.finished:
                if d.finish_reason == "error":
                    failed += 1
                else:
                    reasons[d.finish_reason] = reasons.get(d.finish_reason, 0) + 1
                    e2e.append(d.time - stream.arrival)
        if n_tok:
            m.generation_tokens.inc(n_tok)
            self.last_token_time = max(d.time for _, d in stepped)
        m.ttft.observe_many(ttft)
        m.itl.observe_many(itl)
        m.e2e.observe_many(e2e)
        if failed:
            m.requests_failed.inc(failed)
        for reason, k in reasons.items():
            m.requests_finished.inc(k, finished_reason=reason)
