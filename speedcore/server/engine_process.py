"""The engine in a process of its own: the HTTP side (event loop, SSE encoding, JSON) and the engine (scheduling,
the step's Python, sampling, detokenizing) then no longer share one interpreter lock.

``RemoteBackend`` duck-types :class:`~speedcore.server.async_engine.LLMBackend` for ``AsyncEngine``: adds and
aborts are queued here and sent with the next step, one message each way per step over a pipe (the engine
thread of ``AsyncEngine`` waits in ``recv`` with the lock released while the child steps).  The child
(``_engine_main``, spawned) builds the engine from a picklable ``factory`` (``factory()`` returns a
``speedcore.LLM``, GPU or fake_engine's) and serves one message at a time: ``step`` (apply the queued commands,
run a step), ``call`` (run ``fn(LLMBackend)`` between steps: ``fn`` must be picklable, a module-level function or
a ``functools.partial`` of one) and ``stop``.  A child that dies fails the requests in flight and every later
step with its exit code.
"""
from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Callable, List, Optional

from .async_engine import Delta, LLMBackend

_START_TIMEOUT_S = 600.0  # a cold kernel cache compiles at start-up


class EngineProcessError(RuntimeError):
    """The engine process failed to start, died, or a call into it raised."""


def _engine_main(conn, factory) -> None:
    try:
        backend = LLMBackend(factory())
    except BaseException as e:  # noqa: B902 - reported to the parent, which raises it
        conn.send(("failed", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"))
        return
    llm = backend.llm
    conn.send(("ready", dict(tokenizer=backend.tokenizer, max_model_len=backend.max_model_len,
                             vocab_size=backend.vocab_size, max_num_seqs=backend.max_num_seqs,
                             stats=backend.stats())))
    try:
        while True:
            msg = conn.recv()
            kind = msg[0]
            if kind == "step":
                out: List[Delta] = []
                for cmd in msg[1]:
                    if cmd[0] == "add":
                        failed = backend.add(*cmd[1:])
                        if failed is not None:
                            out.append(failed)
                    else:  # ("abort", request_id)
                        backend.abort(cmd[1])
                if backend.has_unfinished():
                    try:
                        out += backend.step()
                    except Exception as e:
                        out += backend.fail_all(f"the engine step failed: {type(e).__name__}: {e}")
                conn.send(("step", out, backend.stats()))
            elif kind == "call":
                try:
                    conn.send(("call", True, msg[1](backend)))
                except BaseException as e:  # noqa: B902 - handed to the caller
                    conn.send(("call", False, f"{type(e).__name__}: {e}"))
            elif kind == "stop":
                backend.abort_all()
                conn.send(("stopped",))
                return
    except (EOFError, OSError):  # the parent went away
        return
    finally:
        try:
            llm.close()
        except Exception:
            pass


class RemoteBackend:
    """An engine in a spawned process, with LLMBackend's methods (run on AsyncEngine's engine thread only)."""

    def __init__(self, factory: Callable[[], object], *, start_timeout: float = _START_TIMEOUT_S):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_engine_main, args=(child, factory), name="speedcore-engine-core",
                                   daemon=True)
        self.process.start()
        child.close()
        if not self._conn.poll(start_timeout):
            self.process.terminate()
            raise EngineProcessError(f"the engine process did not start within {start_timeout:.0f} s")
        try:
            kind, info = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise EngineProcessError(f"the engine process exited during start-up (exit code "
                                     f"{self.process.exitcode})") from None
        if kind != "ready":
            self.process.join(5)
            raise EngineProcessError(f"the engine process failed to start: {info}")
        self.tokenizer = info["tokenizer"]
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self.max_num_seqs = info["max_num_seqs"]
        self._stats = info["stats"]
        self._pending: list = []  # ("add", ...) / ("abort", rid) for the next step
        self._unfinished: set = set()  # request ids added and not yet finished
        self._dead: Optional[str] = None

    def _exchange(self, msg):
        if self._dead is not None:
            raise EngineProcessError(self._dead)
        try:
            self._conn.send(msg)
            return self._conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self.process.join(5)
            self._dead = f"the engine process died (exit code {self.process.exitcode})"
            raise EngineProcessError(self._dead) from None

    # -- LLMBackend's interface ---------------------------------------------------------------------------------
    def add(self, request_id: str, prompt, prompt_token_ids, params) -> Optional[Delta]:
        self._pending.append(("add", request_id, prompt, list(prompt_token_ids), params))
        self._unfinished.add(request_id)
        return None  # a refused request comes back as a finished Delta from the next step

    def abort(self, request_id: str) -> bool:
        if request_id not in self._unfinished:
            return False
        self._unfinished.discard(request_id)
        self._pending.append(("abort", request_id))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._unfinished) or bool(self._pending)

    def step(self) -> List[Delta]:
        cmds, self._pending = self._pending, []
        _, deltas, self._stats = self._exchange(("step", cmds))
        for d in deltas:
            if d.finished:
                self._unfinished.discard(d.request_id)
        return deltas

    def fail_all(self, why: str) -> List[Delta]:
        now = time.perf_counter()
        out = [Delta(rid, [], "", None, True, "error", error=why, time=now) for rid in self._unfinished]
        self._unfinished.clear()
        self._pending = [c for c in self._pending if c[0] != "add"]
        return out

    def stats(self) -> dict:
        return dict(self._stats)

    def run_call(self, fn):
        """``fn(LLMBackend)`` in the engine process (``fn`` picklable); its result, or EngineProcessError."""
        try:
            _, ok, value = self._exchange(("call", fn))
        except (TypeError, AttributeError) as e:  # pickling fn: a lambda or a local function
            raise EngineProcessError(f"engine calls in another process need a picklable function (a module-level "
                                     f"function or functools.partial of one), got {fn!r}: {e}") from None
        if not ok:
            raise EngineProcessError(f"the call raised in the engine process: {value}")
        return value

    def close(self, timeout: float = 30.0) -> None:
        if self.process.is_alive() and self._dead is None:
            try:
                self._exchange(("stop",))
            except EngineProcessError:
                pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        self._conn.close()
