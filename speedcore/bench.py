"""Benchmark harness behind ``python -m speedcore bench``.

Each suite (``benchmarks/<op>.py``, shipped in the wheel too; the probes in ``benchmarks/probes/`` are not)
defines ``cases(b)`` returning a list of ``(label, run)``; ``run(b)`` times our kernel and its peers on the same inputs with :meth:`Bench.time_ms` and
records the comparison with :meth:`Bench.add`.  Times are medians of CUDA-event-timed runs after a warm-up,
with the L2 cache flushed before every run.  The two ceilings (device-to-device copy bandwidth and cuBLAS
bf16 matmul rate) are measured in the same process.
"""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from .report import _fmt  # one number format for the console table and the results page


def benchmarks_dir() -> Path:
    here = Path(__file__).resolve().parent
    for cand in (here / "_benchmarks", here.parent / "benchmarks"):
        if cand.is_dir():
            return cand
    raise FileNotFoundError(f"speedcore: cannot find the benchmark suites near {here}")


def suites() -> dict:
    """{name: path} of the suites: ``benchmarks/*.py`` files that define ``cases(b)`` (read as text, not imported:
    sass_check.py beside them is a script that runs when imported)."""
    out = {}
    for p in sorted(benchmarks_dir().glob("*.py")):
        if p.stem.startswith("_") or "\ndef cases(" not in p.read_text():
            continue
        out[p.stem] = p
    return out


def load_suite(path: Path):
    spec = importlib.util.spec_from_file_location(f"speedcore_bench_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def current_commit() -> str:
    """SPEEDCORE_COMMIT, else git's HEAD, marked "+modified" where tracked files differ from it (a copied working
    tree can carry a stale .git: its HEAD alone would name the wrong commit)."""
    c = os.environ.get("SPEEDCORE_COMMIT")
    if c:
        return c
    here = Path(__file__).resolve().parent
    try:
        def git(*args):
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=here, timeout=10).stdout.strip()

        head = git("rev-parse", "--short=12", "HEAD") or "unknown"
        if head != "unknown" and git("status", "--porcelain", "--untracked-files=no"):
            head += "+modified"
        return head
    except Exception:
        return "unknown"


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200' (the results file name)."""
    words = [w for w in name.lower().replace("-", " ").split() if w not in ("nvidia", "tesla", "geforce")]
    return "_".join(words) or "gpu"


class Bench:
    def __init__(self, quick: bool = False, device: int = 0):
        import torch

        self.torch = torch
        self.quick = quick
        self.device = torch.device("cuda", device)
        torch.cuda.set_device(self.device)
        self.gpu = torch.cuda.get_device_name(self.device)
        self.records: list = []
        # Flushing by reading leaves L2 full of clean lines; a write (zero_) would leave dirty lines whose
        # write-back lands inside the next timed kernel.
        self._flush = torch.ones((128 if quick else 256) << 18, dtype=torch.int32, device=self.device)
        self._ceilings: dict = {}
        self.commit = current_commit()
        self.date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")

    # -- timing ---------------------------------------------------------------------------------------------
    def time_ms(self, fn, *, budget_ms: float | None = None, flush: bool = True) -> float:
        """Median milliseconds of ``fn()`` over many runs, each after an L2 flush.

        After the flush the GPU also spins ~100 us before the start event, so the host has queued ``fn``'s
        launches before the GPU reaches them: the time is the GPU's, for ours and the peers alike, even for
        calls whose host cost exceeds their GPU time (the runtime suite reports host cost per call apart)."""
        torch = self.torch
        budget_ms = budget_ms or (60.0 if self.quick else 300.0)
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        est = max(s.elapsed_time(e), 1e-3)
        n = int(min(max(budget_ms / est, 7), 200 if not self.quick else 50))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            if flush:
                self._flush.max()
                torch.cuda._sleep(200_000)
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends))
        return times[len(times) // 2]

    # -- ceilings -------------------------------------------------------------------------------------------
    def ceiling(self, kind: str) -> float:
        """'copy' (TB/s, bytes read + written) or 'matmul' (cuBLAS bf16 TFLOP/s), measured once per run."""
        if kind not in self._ceilings:
            torch = self.torch
            if kind == "copy":
                n = (512 if self.quick else 2048) << 20
                x = torch.empty(n, dtype=torch.uint8, device=self.device).random_(0, 255)
                y = torch.empty_like(x)
                ms = self.time_ms(lambda: y.copy_(x), flush=False)
                self._ceilings[kind] = 2 * n / ms / 1e9
                case = f"device copy {n >> 20} MiB"
                unit = "TB/s"
            elif kind == "matmul":
                m = 4096 if self.quick else 8192
                a = torch.randn(m, m, dtype=torch.bfloat16, device=self.device)
                b = torch.randn(m, m, dtype=torch.bfloat16, device=self.device)
                ms = self.time_ms(lambda: a @ b, flush=False)
                self._ceilings[kind] = 2 * m ** 3 / ms / 1e9
                case = f"cuBLAS bf16 {m}^3"
                unit = "TFLOP/s"
            else:
                raise ValueError(kind)
            self.records.append(self._record("ceiling", case, unit, self._ceilings[kind], "-", None, None, 1.0))
        return self._ceilings[kind]

    # -- recording ------------------------------------------------------------------------------------------
    def _record(self, op, case, unit, ours, peer, peer_value, ratio, frac):
        return {"op": op, "case": case, "unit": unit, "ours": ours, "peer": peer, "peer_value": peer_value,
                "ratio": ratio, "ceiling_fraction": frac, "commit": self.commit, "date": self.date,
                "gpu": self.gpu}

    def add(self, op: str, case: str, unit: str, ours: float, peers: dict, ceiling: str | None = None,
            higher_is_better: bool = True, fraction: float | None = None) -> None:
        """Record ``ours`` against each peer.  The ratio is > 1 when ours is better: ours / peer for
        throughputs (TB/s, TFLOP/s), peer / ours for costs (ms, us) with ``higher_is_better=False``.
        ``ceiling_fraction``: ours over the measured ``ceiling`` kind, or ``fraction`` where the caller knows it
        (a model-level roofline)."""
        frac = ours / self.ceiling(ceiling) if ceiling else fraction
        for peer, value in peers.items():
            if higher_is_better:
                ratio = ours / value if value else None
            else:
                ratio = value / ours if ours else None
            self.records.append(self._record(op, case, unit, ours, peer, value, ratio, frac))
        if not peers:
            self.records.append(self._record(op, case, unit, ours, "-", None, None, frac))


def table(records: list) -> str:
    rows = [("op", "case", "unit", "ours", "peer", "peer value", "ratio", "of ceiling")]
    for r in records:
        rows.append((r["op"], r["case"], r["unit"], _fmt(r["ours"]), r["peer"], _fmt(r["peer_value"]),
                     _fmt(r["ratio"]), _fmt(r["ceiling_fraction"], 2)))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def save(records: list, path: Path) -> None:
    """Merge into the JSON list at ``path`` (a record replaces the older one of the same op, case and peer),
    and write the results page beside it (:func:`speedcore.report.write`)."""
    path = Path(path)
    old = []
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            old = []
    key = lambda r: (r["op"], r["case"], r["peer"])  # noqa: E731
    new_keys = {key(r) for r in records}
    merged = [r for r in old if key(r) not in new_keys] + records
    merged.sort(key=lambda r: (r["op"] != "ceiling", r["op"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=1) + "\n")
    from . import report

    report.write(path, records=merged)  # the same page `--report` writes


def run(ops: list, quick: bool = False, json_path: str | None = None, device: int = 0) -> list:
    available = suites()
    names = ops or list(available)
    for n in names:
        if n not in available:
            raise SystemExit(f"speedcore bench: no suite {n!r}; available: {', '.join(available)}")
    b = Bench(quick=quick, device=device)
    todo = []
    for n in names:
        mod = load_suite(available[n])
        todo.extend(mod.cases(b))
    b.ceiling("copy")
    b.ceiling("matmul")
    tty = sys.stderr.isatty()
    for i, (label, fn) in enumerate(todo):
        done = int(20 * i / max(1, len(todo)))
        msg = f"[{'#' * done}{'.' * (20 - done)}] {i + 1}/{len(todo)} {label}"
        print(("\r" + msg.ljust(100)) if tty else msg, end="" if tty else "\n", file=sys.stderr, flush=True)
        try:
            fn(b)
        except Exception as exc:  # a failing case is reported, the rest still run
            print(f"\n  {label}: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            b.records.append(b._record(label.split()[0], label, "error", None, "-", None, None, None))
        finally:
            b.torch.cuda.empty_cache()
    if tty:
        print(file=sys.stderr)
    if json_path:
        save(b.records, Path(json_path))
    print(table(b.records))
    return b.records
