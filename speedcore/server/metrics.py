"""Prometheus text-format metrics, written by hand (no client library): counters, gauges and histograms that
the engine thread updates and the /metrics handler renders (a lock each, so a scrape sees whole updates)."""
from __future__ import annotations

import bisect
import math
import threading
from typing import Callable, Dict, List, Sequence, Tuple

PREFIX = "speedcore_"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)


def _fmt(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    return repr(float(v)) if isinstance(v, float) else str(v)


def _labels(labels: Tuple[Tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    esc = (lambda s: str(s).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"'))
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels) + "}"


class Counter:
    def __init__(self, name: str, doc: str):
        self.name, self.doc = PREFIX + name, doc
        self._values: Dict[tuple, float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1, **labels) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def value(self, **labels) -> float:
        return self._values.get(tuple(sorted(labels.items())), 0)

    def render(self) -> List[str]:
        with self._lock:
            items = sorted(self._values.items()) or [((), 0)]
        return [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} counter"] + \
            [f"{self.name}{_labels(k)} {_fmt(v)}" for k, v in items]


class Gauge:
    """A value read when scraped (``fn``); ``kind="counter"`` for a count the engine keeps itself."""

    def __init__(self, name: str, doc: str, fn: Callable[[], float], kind: str = "gauge"):
        self.name, self.doc, self.fn, self.kind = PREFIX + name, doc, fn, kind

    def render(self) -> List[str]:
        return [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} {self.kind}", f"{self.name} {_fmt(self.fn())}"]


class Histogram:
    def __init__(self, name: str, doc: str, buckets: Sequence[float]):
        self.name, self.doc = PREFIX + name, doc
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, v: float) -> None:
        self.observe_many((v,))

    def observe_many(self, values) -> None:
        if not values:
            return
        idx = [bisect.bisect_left(self.bounds, v) for v in values]
        total = sum(values)
        with self._lock:
            for i in idx:
                self.counts[i] += 1
            self.sum += total
            self.count += len(idx)

    def render(self) -> List[str]:
        with self._lock:
            counts, total, n = list(self.counts), self.sum, self.count
        out = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        acc = 0
        for b, c in zip(self.bounds + [math.inf], counts):
            acc += c
            out.append(f'{self.name}_bucket{{le="{_fmt(b)}"}} {acc}')
        out += [f"{self.name}_sum {_fmt(total)}", f"{self.name}_count {n}"]
        return out


class ServerMetrics:
    """What /metrics shows.  The gauges read ``stats()`` (the engine thread's last snapshot)."""

    def __init__(self, stats: Callable[[], dict]):
        self.prompt_tokens = Counter("prompt_tokens_total", "Prompt tokens of the requests admitted to the engine.")
        self.generation_tokens = Counter("generation_tokens_total", "Tokens generated.")
        self.requests_finished = Counter("request_success_total",
                                         "Requests that finished, by finish reason (stop, length).")
        self.requests_aborted = Counter("request_aborted_total",
                                        "Requests cancelled before their end (the client went away).")
        self.requests_failed = Counter("request_failed_total", "Requests the engine failed (finish reason error).")
        self.requests_rejected = Counter("request_rejected_total",
                                         "Requests refused with 503 because the queue was full.")
        self.http_responses = Counter("http_responses_total", "HTTP responses, by status code.")
        self.ttft = Histogram("time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first generated token.", TTFT_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds", "Seconds between a request's consecutive tokens.",
                             ITL_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Seconds from arrival to the last token.", E2E_BUCKETS)

        def s(key):
            return lambda: stats().get(key, 0)

        self.gauges = [
            Gauge("num_requests_running", "Requests in the engine's running batch.", s("running")),
            Gauge("num_requests_waiting", "Requests accepted but not yet in the running batch.", s("waiting")),
            Gauge("kv_cache_usage_perc", "Fraction of the KV cache blocks in use (1 = full).", s("kv_usage")),
            Gauge("kv_cache_free_blocks", "KV cache blocks free (cached prefixes included).", s("free_blocks")),
            Gauge("kv_cache_blocks", "KV cache blocks in all.", s("num_blocks")),
            Gauge("num_preemptions_total", "Sequences preempted (blocks dropped, recomputed later) since start.",
                  s("preemptions"), "counter"),
            Gauge("prefix_cache_hit_tokens_total", "Prompt tokens found in the prefix cache since start.",
                  s("prefix_hits"), "counter"),
            Gauge("prefix_cache_query_tokens_total", "Prompt tokens looked up in the prefix cache since start.",
                  s("prefix_queries"), "counter"),
        ]

    def render(self) -> str:
        lines: List[str] = []
        for g in self.gauges:
            lines += g.render()
        for m in (self.prompt_tokens, self.generation_tokens, self.requests_finished, self.requests_aborted,
                  self.requests_failed, self.requests_rejected, self.http_responses, self.ttft, self.itl, self.e2e):
            lines += m.render()
        return "\n".join(lines) + "\n"
