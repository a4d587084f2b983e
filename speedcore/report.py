"""The results page and charts behind ``python -m speedcore bench --report [--plot]``.

Reads the JSON records ``python -m speedcore bench --json`` writes (a list of dicts: op, case, unit, ours, peer,
peer_value, ratio, ceiling_fraction, commit, date, gpu) and writes, per JSON file, a markdown page beside it
(``h200.json`` -> ``h200.md``) and with ``--plot`` PNG charts (``h200-<op>.png``, ``h200-overview.png``).  Needs
neither a GPU nor torch; the charts need matplotlib (``pip install speedcore[plot]``), imported only for them.
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

FIELDS = ("op", "case", "unit", "ours", "peer", "peer_value", "ratio", "ceiling_fraction", "commit", "date", "gpu")
# Rows per chart: a family with more (case, variant) rows is drawn over several PNGs so labels stay readable.
CHART_ROWS = 64
# Families with fewer rows than this share one chart (``<stem>-small-ops.png``) rather than one PNG per bar.
SMALL_FAMILY_ROWS = 4


class ReportError(ValueError):
    """A results file is missing, unreadable or holds no records (the message names it and the option)."""


def _fmt(v, digits=3):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def family(op: str) -> str:
    """'awq_linear[as stored]' -> 'awq_linear': variants of one op share a page section and a chart."""
    return op.split("[", 1)[0]


def find_results(patterns=None) -> list:
    """The JSON files named by ``patterns`` (files, directories or glob patterns; default:
    benchmarks/results/*.json under the working directory, else beside the package's checkout)."""
    if not patterns:
        here = Path.cwd() / "benchmarks" / "results"
        checkout = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
        for d in (here, checkout):
            found = sorted(d.glob("*.json"))
            if found:
                return found
        raise ReportError(f"--results: no benchmarks/results/*.json in {here} or {checkout}; "
                          "record some with `python -m speedcore bench --json benchmarks/results/<gpu>.json`")
    out = []
    for pat in patterns:
        p = Path(pat)
        if p.is_dir():
            found = sorted(p.glob("*.json"))
        elif any(c in pat for c in "*?["):
            found = sorted(Path(x) for x in _glob(pat))
        elif p.is_file():
            found = [p]
        else:
            raise ReportError(f"--results: no such file or directory: {pat}")
        if not found:
            raise ReportError(f"--results: {pat} matches no JSON file")
        out.extend(found)
    return list(dict.fromkeys(out))


def _glob(pattern: str):
    import glob

    return glob.glob(pattern)


def load_records(path) -> list:
    """The records of one results file, checked: a JSON list of dicts with every field of FIELDS."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ReportError(f"--results: cannot read {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise ReportError(f"--results: {path} is not valid JSON: {e}") from e
    if not isinstance(data, list):
        raise ReportError(f"--results: {path} holds a JSON {type(data).__name__}, not a list of records")
    if not data:
        raise ReportError(f"--results: {path} holds no records")
    for i, r in enumerate(data):
        missing = [f for f in FIELDS if not isinstance(r, dict) or f not in r]
        if missing:
            raise ReportError(f"--results: {path} record {i} lacks {', '.join(missing)}")
    return data


def _sections(records: list) -> dict:
    """family -> records, the ceilings first, then the families in the file's order."""
    out: dict = {"ceiling": []}
    for r in records:
        out.setdefault(family(r["op"]), []).append(r)
    return {k: v for k, v in out.items() if v}


def _table(records: list) -> list:
    head = "| op | case | unit | ours | peer | peer value | ratio (>1: ours faster) | of ceiling | date | commit |"
    out = [head, "|" + "---|" * 10]
    for r in records:
        out.append(f"| {r['op']} | {r['case']} | {r['unit']} | {_fmt(r['ours'])} | {r['peer']} | "
                   f"{_fmt(r['peer_value'])} | {_fmt(r['ratio'])} | {_fmt(r['ceiling_fraction'], 2)} | "
                   f"{r['date']} | {r['commit']} |")
    return out


def _summary(records: list) -> list:
    """One row per (op, peer, commit): how many cases, the ratio's min / median / max and the median fraction of
    the ceiling.  Per commit, because a merge keeps the records of cases a later run no longer measures (renamed or
    dropped cases), and a range over two versions of a kernel would describe neither."""
    groups: dict = {}
    for r in records:
        if r["op"] != "ceiling" and r["ratio"] is not None:
            groups.setdefault((r["op"], r["peer"], r["commit"]), []).append(r)
    out = ["| op | peer | cases | ratio min | median | max | of ceiling (median) | date | commit |",
           "|" + "---|" * 9]
    for (op, peer, commit), rs in groups.items():
        ratios = [r["ratio"] for r in rs]
        fracs = [r["ceiling_fraction"] for r in rs if r["ceiling_fraction"] is not None]
        dates = sorted({r["date"] for r in rs})
        out.append(f"| {op} | {peer} | {len(rs)} | {_fmt(min(ratios))} | {_fmt(statistics.median(ratios))} | "
                   f"{_fmt(max(ratios))} | {_fmt(statistics.median(fracs), 2) if fracs else '-'} | "
                   f"{' to '.join(dict.fromkeys((dates[0], dates[-1])))} | {commit} |")
    return out


def page(records: list, source: str, charts=(), notes=()) -> str:
    """The markdown page for the records of one results file (``source``: its file name)."""
    if not records:
        raise ReportError(f"--results: {source} holds no records")
    gpus = ", ".join(dict.fromkeys(r["gpu"] for r in records))
    dates = sorted({r["date"] for r in records})
    lines = [f"# Benchmark results: {gpus}", "",
             f"Generated from `{source}` by `python -m speedcore bench --report` (and by every "
             f"`python -m speedcore bench --json {source}`); edit the JSON or the generator, not this page. "
             "ratio = ours / peer (peer / ours for times), > 1: ours faster, measured in the same run; of ceiling = "
             "ours as a fraction of that run's device copy (TB/s) or cuBLAS bf16 matmul (TFLOP/s) ceiling. "
             f"{len(records)} records, {dates[0]} to {dates[-1]}.", ""]
    if notes:
        lines += ["Notes beside this page: " + ", ".join(f"[{n}]({n})" for n in notes) + ".", ""]
    stem = Path(source).stem
    sections = _sections(records)

    def charts_of(fam):
        return [c for c in charts if re.fullmatch(re.escape(f"{stem}-{_slug(fam)}") + r"(-\d+)?\.png", c)]

    placed = {c for fam in sections for c in charts_of(fam)}
    general = [c for c in charts if c not in placed]  # the overview, the small-ops chart
    lines += ["## Summary", "", *[f"![{c}]({c})" for c in general], *([""] if general else []),
              *_summary(records), ""]
    for fam, rs in sections.items():
        lines += [f"## {fam}", ""]
        lines += [f"![{c}]({c})" for c in charts_of(fam)] + ([""] if charts_of(fam) else [])
        lines += [*_table(rs), ""]
    return "\n".join(lines)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "op"


def _chart_rows(records: list) -> dict:
    """family -> [(label, {peer: ratio}, ceiling fraction, unit)], one row per (op, case) in the file's order;
    rows with neither a ratio nor a fraction (the ceilings, the runtime's costs) are left out."""
    rows: dict = {}
    commits: dict = {}
    for r in records:
        commits.setdefault(family(r["op"]), set()).add(r["commit"])
    for r in records:
        if r["op"] == "ceiling" or (r["ratio"] is None and r["ceiling_fraction"] is None):
            continue
        variant = r["op"][len(family(r["op"])):]
        # The commit joins the label where a family's rows come from several runs (a merge keeps the cases a
        # later run no longer measures), so old and new kernels are not read as one series.
        at = f" @{r['commit']}" if len(commits[family(r["op"])]) > 1 else ""
        label = f"{variant} {r['case']}{at}".strip()
        fam = rows.setdefault(family(r["op"]), {})
        row = fam.setdefault(label, [label, {}, r["ceiling_fraction"], r["unit"]])
        if r["ratio"] is not None:
            row[1][r["peer"]] = r["ratio"]
    small = {f: list(v.values()) for f, v in rows.items() if len(v) < SMALL_FAMILY_ROWS}
    out = {f: list(v.values()) for f, v in rows.items() if len(v) >= SMALL_FAMILY_ROWS}
    if small:
        out["small-ops"] = [[f"{f} {label}", peers, frac, unit] for f, v in small.items()
                            for label, peers, frac, unit in v]
    return out


def _matplotlib():
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ReportError("--plot needs matplotlib: pip install speedcore[plot]") from e
    return Figure, FigureCanvasAgg


_CEILING_NAME = {"TB/s": "of device copy", "TFLOP/s": "of cuBLAS bf16 matmul"}


def _frac_limit(fractions) -> float:
    """The ceiling panel's x range: to 1.05, or past the largest fraction (a read-only kernel can pass the copy
    ceiling, which counts bytes read and written)."""
    return max([1.05] + [f * 1.05 for f in fractions if f is not None])


def _save(fig, canvas_cls, path: Path) -> None:
    # 90 dpi keeps the committed charts small; no version stamp: the same records give the same bytes.
    fig.savefig(path, dpi=90, bbox_inches="tight", metadata={"Software": None})


def _family_chart(Figure, canvas_cls, rows, title, path) -> None:
    """Two panels on shared rows: ratio to each peer (grouped bars, 1.0 marked) and the fraction of the ceiling."""
    peers = list(dict.fromkeys(p for _, ps, _, _ in rows for p in ps))
    n = len(rows)
    fig = Figure(figsize=(13, 1.6 + 0.26 * n * max(1, min(len(peers), 3)) ** 0.5))
    canvas_cls(fig)  # before tight_layout, which measures the labels with the canvas's renderer
    ax, axc = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 1.3]})
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:gray"]
    for j, peer in enumerate(peers):
        ys, vals, heights = [], [], []
        for i, (_, ps, _, _) in enumerate(rows):
            if peer in ps:  # a row's bars split its height among the peers it was measured against
                here = [p for p in peers if p in ps]
                h = 0.8 / len(here)
                ys.append(i - 0.4 + h * (here.index(peer) + 0.5))
                heights.append(h)
                vals.append(ps[peer])
        ax.barh(ys, vals, height=heights, color=colors[j % len(colors)], label=f"vs {peer}")
        for y, v in zip(ys, vals):
            ax.text(v, y, f" {v:.2f}", va="center", fontsize=6)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(n))
    ax.set_yticklabels([label for label, _, _, _ in rows], fontsize=7)
    ax.set_ylim(n - 0.5, -0.5)  # first row on top, no empty margin
    ax.set_xlabel("ratio to the peer, same run (> 1: ours faster)")
    if peers:  # above the bars, right of the title: a legend inside would hide rows of a long chart
        ax.legend(fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=min(3, len(peers)), frameon=False)
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    for unit, color in (("TB/s", "tab:cyan"), ("TFLOP/s", "tab:red")):
        ys = [i for i, (_, _, f, u) in enumerate(rows) if f is not None and u == unit]
        vals = [f for _, _, f, u in rows if f is not None and u == unit]
        if ys:
            axc.barh(ys, vals, height=0.7, color=color, label=_CEILING_NAME[unit])
    axc.set_xlim(0, _frac_limit(f for _, _, f, _ in rows))
    axc.axvline(1.0, color="black", linewidth=0.8)
    axc.set_xlabel("ours as a fraction of the ceiling")
    if any(f is not None for _, _, f, _ in rows):
        axc.legend(fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=2, frameon=False)
    fig.tight_layout()
    _save(fig, canvas_cls, path)


def _overview_chart(Figure, canvas_cls, records, title, path) -> None:
    """Per (op, peer): the median ratio with its min-max range; per op: median and best fraction of the ceiling."""
    groups: dict = {}
    fracs: dict = {}
    commits: dict = {}
    for r in records:
        commits.setdefault(r["op"], set()).add(r["commit"])
    for r in records:
        if r["op"] == "ceiling":
            continue
        if r["ratio"] is not None:  # per commit where an op's records come from several runs, as the summary
            at = f" @{r['commit']}" if len(commits[r["op"]]) > 1 else ""
            groups.setdefault(f"{r['op']} vs {r['peer']}{at}", []).append(r["ratio"])
        if r["ceiling_fraction"] is not None:
            fracs.setdefault((r["op"], r["case"]), (r["op"], r["ceiling_fraction"]))
    per_op: dict = {}
    for op, f in fracs.values():
        per_op.setdefault(op, []).append(f)
    n = max(len(groups), len(per_op), 1)
    fig = Figure(figsize=(17, 1.8 + 0.28 * n))
    canvas_cls(fig)
    ax, axc = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    labels = list(groups)
    med = [statistics.median(groups[k]) for k in labels]
    lo = [m - min(groups[k]) for m, k in zip(med, labels)]
    hi = [max(groups[k]) - m for m, k in zip(med, labels)]
    ax.barh(range(len(labels)), med, xerr=[lo, hi], color="tab:blue", ecolor="gray", capsize=2)
    for i, (m, k) in enumerate(zip(med, labels)):
        ax.text(m + hi[i], i, f" {m:.2f} ({min(groups[k]):.2f}-{max(groups[k]):.2f}, {len(groups[k])})",
                va="center", fontsize=6)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xscale("log")
    ax.set_xlabel("ratio to the peer: median, min-max whiskers (log scale; > 1: ours faster)")
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    ops = list(per_op)
    axc.barh(range(len(ops)), [max(per_op[o]) for o in ops], color="tab:cyan", label="best case")
    axc.barh(range(len(ops)), [statistics.median(per_op[o]) for o in ops], height=0.4, color="tab:blue",
             label="median case")
    axc.set_yticks(range(len(ops)))
    axc.set_yticklabels(ops, fontsize=7)
    axc.set_ylim(len(ops) - 0.5, -0.5)
    axc.set_xlim(0, _frac_limit(f for fs in per_op.values() for f in fs))
    axc.axvline(1.0, color="black", linewidth=0.8)
    axc.set_xlabel("fraction of the copy (TB/s) / GEMM (TFLOP/s) ceiling")
    axc.legend(fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=2, frameon=False)
    fig.tight_layout()
    _save(fig, canvas_cls, path)


def plot(records: list, out_dir, stem: str) -> list:
    """Write the PNG charts of one results file into ``out_dir``; returns their file names."""
    Figure, canvas_cls = _matplotlib()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = ", ".join(dict.fromkeys(r["gpu"] for r in records))
    names = [f"{stem}-overview.png"]
    _overview_chart(Figure, canvas_cls, records, f"{gpu}: all ops", out_dir / names[0])
    for fam, rows in _chart_rows(records).items():
        count = -(-len(rows) // CHART_ROWS)
        size = -(-len(rows) // count)  # even chunks: 88 rows as 44 + 44, not 64 + 24
        chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
        for k, chunk in enumerate(chunks):
            suffix = f"-{k + 1}" if len(chunks) > 1 else ""
            name = f"{stem}-{_slug(fam)}{suffix}.png"
            part = f" ({k + 1}/{len(chunks)})" if len(chunks) > 1 else ""
            _family_chart(Figure, canvas_cls, chunk, f"{fam}{part}: {gpu}", out_dir / name)
            names.append(name)
    return names


def _existing_charts(out_dir: Path, stem: str) -> list:
    """Charts a previous ``--plot`` left beside the page (linked again when the page is regenerated without one)."""
    found = sorted(p.name for p in out_dir.glob(f"{stem}-*.png"))
    return sorted(found, key=lambda n: n != f"{stem}-overview.png")


def write(json_path, out_dir=None, with_plots: bool = False, records=None) -> list:
    """Regenerate the page (and with ``with_plots`` the charts) of one results file; returns the paths written.
    ``out_dir`` defaults to the JSON file's directory."""
    json_path = Path(json_path)
    records = load_records(json_path) if records is None else records
    out = Path(out_dir) if out_dir is not None else json_path.parent
    out.mkdir(parents=True, exist_ok=True)
    stem = json_path.stem
    written = []
    if with_plots:
        for old in out.glob(f"{stem}-*.png"):  # charts of families no longer recorded must not linger
            old.unlink()
        charts = plot(records, out, stem)
        written += [out / c for c in charts]
    else:
        charts = _existing_charts(out, stem)
    page_path = out / f"{stem}.md"
    notes = sorted(p.name for p in out.glob(f"{stem}-*.md"))
    page_path.write_text(page(records, json_path.name, charts, notes))
    return [page_path] + written
