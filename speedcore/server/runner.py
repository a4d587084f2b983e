"""Run the app: ``ServerThread`` (uvicorn in a background thread, for tests and benchmarks) and ``serve``
(uvicorn in the foreground, for ``python -m speedcore serve``)."""
from __future__ import annotations

import sys
import threading
import time
from typing import Optional

from .app import ServerConfig, build_app
from .async_engine import AsyncEngine, LLMBackend


def make_app(llm, *, served_model_name: str, api_key: Optional[str] = None, max_queue: int = 256, **config):
    """The ASGI app serving ``llm`` (a speedcore.LLM, GPU or fake_engine's, or an engine_process.RemoteBackend:
    the engine in its own process); its engine is ``app.state.engine``."""
    from .engine_process import RemoteBackend

    backend = llm if isinstance(llm, RemoteBackend) else LLMBackend(llm)
    engine = AsyncEngine(backend, max_queue=max_queue)
    return build_app(engine, ServerConfig(served_model_name, api_key=api_key, **config))


# The engine thread and the event loop share one interpreter lock.  When the engine thread comes back from a GPU
# wait while the busy event loop holds the lock, it waits out the switch interval (5 ms by default): a whole
# decode step of a small model.  1 ms keeps that wait short at a negligible cost in switches.
SWITCH_INTERVAL_S = 0.001


def uvicorn_config(app, host: str, port: int, log_level: str = "warning", **kw):
    import uvicorn

    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
    # keep-alive long enough for a benchmark's pooled connections; no uvicorn-level limit on connections (the
    # app answers 503 past --max-queue itself, in OpenAI's format)
    # shutdown: open streams get 10 s, then their tasks are cancelled (each cancellation aborts its request)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30,
                          timeout_graceful_shutdown=10, access_log=False, lifespan="on", **kw)


class ServerThread:
    """uvicorn serving ``app`` on ``host`` (127.0.0.1) and a free port, in a daemon thread: a context manager;
    ``url`` is its base URL ("http://127.0.0.1:PORT")."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 30.0):
        import uvicorn

        self.app = app
        self.server = uvicorn.Server(uvicorn_config(app, host, port))
        self.thread = threading.Thread(target=self.server.run, name="speedcore-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup_timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread ended during start-up (see its log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {startup_timeout} s")
            time.sleep(0.01)
        sock = self.server.servers[0].sockets[0]
        self.host, self.port = sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"

    @property
    def engine(self) -> AsyncEngine:
        return self.app.state.engine

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
