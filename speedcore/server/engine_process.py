"""The engine in a process of its own: the HTTP side (event loop, SSE encoding, JSON) and the engine (scheduling,
the step's Python, sampling, detokenizing) then no longer share one interpreter lock.

``RemoteBackend`` duck-types :class:`~speedcore.server.async_engine.LLMBackend` for ``AsyncEngine``.  The child
(``_engine_main``, spawned) builds the engine from a picklable ``factory`` (``factory()`` returns a
``speedcore.LLM``, GPU or fake_engine's) and runs free: while it has requests it steps back to back and sends
each step's deltas as one message, taking the commands that arrived meanwhile (adds, aborts) between steps
without waiting for them; idle, it sleeps in ``recv``.  The engine so never waits for the HTTP process: a
lock-step exchange (one request, one reply per step) left the GPU idle while the HTTP side, busy with its
streams, got round to asking for the next step.  The parent sends adds and aborts as they come (``flush``) and
``step`` returns every delta that arrived, waiting for the next message only while a request is unfinished.
``call`` runs ``fn(LLMBackend)`` between two steps (``fn`` picklable: a module-level function or a
``functools.partial`` of one).  A child that dies fails the requests in flight and every later step with its
exit code.
"""
from __future__ import annotations

import array
import multiprocessing as mp
import queue
import signal
import threading
import time
import traceback
from typing import Callable, List, Optional

from .async_engine import Delta, LLMBackend

_START_TIMEOUT_S = 600.0  # a cold kernel cache compiles at start-up


class EngineProcessError(RuntimeError):
    """The engine process failed to start, died, or a call into it raised."""


def _engine_main(conn, factory) -> None:
    # Ctrl-C reaches the whole process group: the server shuts down and then stops this process (or closes the
    # pipe); an interrupt of its own would only leave a traceback behind
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        backend = LLMBackend(factory())
    except BaseException as e:  # noqa: B902 - reported to the parent, which raises it
        # a bad checkpoint, option or memory budget is the user's to fix: its message says it all; anything else
        # is a bug, with where it happened
        user = isinstance(e, (FileNotFoundError, ValueError, MemoryError))
        conn.send(("failed", f"{type(e).__name__}: {e}" + ("" if user else f"\n{traceback.format_exc(limit=6)}")))
        return
    llm = backend.llm
    conn.send(("ready", dict(tokenizer=backend.tokenizer, max_model_len=backend.max_model_len,
                             vocab_size=backend.vocab_size, max_num_seqs=backend.max_num_seqs,
                             stats=backend.stats())))
    # Replies go out from a thread of their own: were the step loop to block in send (the parent not reading,
    # the pipe full) while the parent blocks sending it commands, neither would ever read again.
    outbox: "queue.SimpleQueue" = queue.SimpleQueue()
    sender = threading.Thread(target=_send_all, args=(conn, outbox), name="speedcore-engine-sender", daemon=True)
    sender.start()
    send = outbox.put
    clock = time.perf_counter
    # seconds between steps while busy: taking commands (adds, aborts), queueing the step's reply (take_step_report)
    backend.loop_s = loop_s = {"commands": 0.0, "reply": 0.0}
    try:
        while True:
            out: List[tuple] = []  # Delta rows
            t0 = clock()
            busy = backend.has_unfinished()
            # idle: sleep until a message comes; busy: only what has already arrived, then the next step
            while not backend.has_unfinished() or conn.poll():
                if not backend.has_unfinished():
                    busy = False  # this pass's time is mostly waiting: not counted
                msg = conn.recv()
                kind = msg[0]
                if kind == "cmds":
                    for cmd in msg[1]:
                        if cmd[0] == "add":
                            failed = backend.add(*cmd[1:])
                            if failed is not None:
                                out.append(failed.row())
                        else:  # ("abort", request_id)
                            backend.abort(cmd[1])
                elif kind == "call":
                    try:
                        reply = ("call", True, msg[1](backend))
                    except BaseException as e:  # noqa: B902 - handed to the caller
                        reply = ("call", False, f"{type(e).__name__}: {e}")
                    send(reply)
                elif kind == "stop":
                    backend.abort_all()
                    send(("stopped",))
                    return
                if out and not backend.has_unfinished():
                    break  # refused requests only: answer them now
            if busy:
                loop_s["commands"] += clock() - t0
            if backend.has_unfinished():
                try:
                    out += backend.step_rows()
                except Exception as e:
                    out += [d.row() for d in backend.fail_all(f"the engine step failed: {type(e).__name__}: {e}")]
            t1 = clock()
            send(("deltas", out, backend.stats()))
            loop_s["reply"] += clock() - t1
    except (EOFError, OSError):  # the parent went away
        return
    finally:
        outbox.put(None)
        sender.join(10)
        try:
            llm.close()
        except Exception:
            pass


def _send_all(conn, outbox) -> None:
    while True:
        msg = outbox.get()
        if msg is None:
            return
        try:
            conn.send(msg)
        except (OSError, BrokenPipeError):  # the parent went away; the step loop sees it in recv
            return
        except Exception as e:  # pickling (done before anything is written): a call's result, or a delta's field
            why = f"{type(e).__name__}: {e}"
            if msg[0] == "call":
                conn.send(("call", False, f"its result could not be sent back: {why}"))
            else:  # the step's requests end with the reason rather than wait forever
                conn.send(("deltas", [(r[0], [], "", None, True, "error", None, *r[7:10],
                                       f"the engine's output could not be sent: {why}", r[11]) for r in msg[1]],
                           msg[2]))


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
        self._pending: list = []  # ("add", ...) / ("abort", rid) not sent yet
        self._unfinished: set = set()  # request ids added and not yet finished (nor aborted)
        self._inbox: List[Delta] = []  # deltas received and not yet handed out by step()
        self._dead: Optional[str] = None

    def _died(self):
        self.process.join(5)
        self._dead = f"the engine process died (exit code {self.process.exitcode})"
        return EngineProcessError(self._dead)

    def _send(self, msg) -> None:
        if self._dead is not None:
            raise EngineProcessError(self._dead)
        try:
            self._conn.send(msg)
        except (OSError, BrokenPipeError):
            raise self._died() from None

    def _recv(self, kind: str):
        """The next message of ``kind``; the steps' deltas that come before it are kept for ``step``."""
        while True:
            try:
                msg = self._conn.recv()  # the lock is released while it waits
            except (EOFError, OSError):
                raise self._died() from None
            if msg[0] == "deltas":
                self._inbox += [Delta(*row) for row in msg[1]]
                self._stats = msg[2]
                if kind == "deltas":
                    return msg
            elif msg[0] == kind:
                return msg

    def _flush(self) -> None:
        if self._pending:
            cmds, self._pending = self._pending, []
            self._send(("cmds", cmds))

    # -- LLMBackend's interface ---------------------------------------------------------------------------------
    def add(self, request_id: str, prompt, prompt_token_ids, params) -> Optional[Delta]:
        try:  # int64 array: pickled as bytes, unpickled ~9x faster than a list of ints, range-checked in NumPy
            ids = array.array("q", prompt_token_ids)
        except (OverflowError, TypeError):  # not int64-sized ints: as a list, for the engine to refuse
            ids = list(prompt_token_ids)
        self._pending.append(("add", request_id, prompt, ids, params))
        self._unfinished.add(request_id)
        return None  # a refused request comes back as a finished Delta from a later step

    def abort(self, request_id: str) -> bool:
        if request_id not in self._unfinished:
            return False
        self._unfinished.discard(request_id)
        self._pending.append(("abort", request_id))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._unfinished) or bool(self._pending) or bool(self._inbox)

    def step(self) -> List[Delta]:
        """Every delta the engine sent since the last call (waiting for its next step if none came yet and a
        request is unfinished); the queued adds and aborts go out first."""
        self._flush()
        if self._dead is not None:
            raise EngineProcessError(self._dead)
        if not self._inbox and self._unfinished:
            self._recv("deltas")
        while self._conn.poll():  # steps that finished meanwhile: hand them over at once
            self._recv("deltas")
        deltas, self._inbox = [d for d in self._inbox if d.request_id in self._unfinished], []
        for d in deltas:
            if d.finished:
                self._unfinished.discard(d.request_id)
        return deltas

    def fail_all(self, why: str) -> List[Delta]:
        now = time.perf_counter()
        out = [Delta(rid, [], "", None, True, "error", error=why, time=now) for rid in self._unfinished]
        self._unfinished.clear()
        self._pending = [c for c in self._pending if c[0] != "add"]
        self._inbox = []
        return out

    def stats(self) -> dict:
        return dict(self._stats)

    def run_call(self, fn):
        """``fn(LLMBackend)`` in the engine process (``fn`` picklable); its result, or EngineProcessError."""
        self._flush()
        try:
            self._send(("call", fn))
            _, ok, value = self._recv("call")
        except (TypeError, AttributeError) as e:  # pickling fn: a lambda or a local function
            raise EngineProcessError(f"engine calls in another process need a picklable function (a module-level "
                                     f"function or functools.partial of one), got {fn!r}: {e}") from None
        if not ok:
            raise EngineProcessError(f"the call raised in the engine process: {value}")
        return value

    def close(self, timeout: float = 30.0) -> None:
        if self.process.is_alive() and self._dead is None:
            try:
                self._flush()
                self._send(("stop",))
                self._recv("stopped")
            except EngineProcessError:
                pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        self._conn.close()
