"""`python -m speedcore bench --report [--plot]`: the results page and charts from recorded JSON, no GPU, no torch."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speedcore import bench, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rec(op, case, unit, ours, peer="-", peer_value=None, ratio=None, frac=None, commit="abc1234",
         date="2026-12-01"):
    return {"op": op, "case": case, "unit": unit, "ours": ours, "peer": peer, "peer_value": peer_value,
            "ratio": ratio, "ceiling_fraction": frac, "commit": commit, "date": date, "gpu": "NVIDIA H200"}


RECORDS = [
    _rec("ceiling", "device copy 2048 MiB", "TB/s", 4.27, frac=1.0),
    _rec("ceiling", "cuBLAS bf16 8192^3", "TFLOP/s", 680.0, frac=1.0),
    _rec("rms_norm", "4096x8192 bf16", "TB/s", 4.10, "torch.nn.functional.rms_norm", 2.55, 4.10 / 2.55, 0.96),
    _rec("rms_norm", "4096x8192 bf16", "TB/s", 4.10, "torch eager (HF Llama)", 0.5, 8.2, 0.96),
    _rec("rms_norm", "16384x4096 bf16", "TB/s", 4.08, "torch.nn.functional.rms_norm", 3.34, 4.08 / 3.34, 0.955),
    _rec("linear", "8192x8192x8192 bfloat16", "TFLOP/s", 690.0, "F.linear (cuBLAS)", 680.0, 690 / 680, 1.01),
    _rec("linear", "1x4096x4096 bfloat16", "TB/s", 2.4, "F.linear (cuBLAS)", 2.0, 1.2, 0.56),
    _rec("linear[ampere]", "8192x8192x8192 bfloat16", "TFLOP/s", 400.0, "F.linear (cuBLAS)", 677.0, 0.591, 0.59),
    _rec("linear", "64x4096x4096 bfloat16", "TB/s", 1.9, "F.linear (cuBLAS)", 2.3, 0.807, 0.45, commit="old9999",
         date="2026-11-29"),
    _rec("runtime", "import speedcore", "ms", 9.04),
    _rec("runtime", "host time per call, rms_norm 1x4096 bf16", "us", 28.3, "torch.nn.functional.rms_norm", 9.73,
         0.344),
]


@pytest.fixture
def results(tmp_path):
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(RECORDS, indent=1))
    (tmp_path / "h200-ab-2026-11-30.md").write_text("# hand-written A/B notes\n")
    return path


def _run(*args, cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "speedcore", "bench", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


def test_report_page_content(results):
    p = _run("--report", "--results", str(results))
    assert p.returncode == 0, p.stderr
    page = (results.parent / "h200.md").read_text()
    assert str(results.parent / "h200.md") in p.stdout
    assert page.startswith("# Benchmark results: NVIDIA H200\n")
    assert "Generated from `h200.json`" in page
    assert f"{len(RECORDS)} records, 2026-11-29 to 2026-12-01" in page
    assert "[h200-ab-2026-11-30.md](h200-ab-2026-11-30.md)" in page  # notes beside the page are linked
    # Every record is a row of the full tables, formatted as the bench's page always did.
    assert ("| rms_norm | 4096x8192 bf16 | TB/s | 4.1 | torch.nn.functional.rms_norm | 2.55 | 1.61 | 0.96 | "
            "2026-12-01 | abc1234 |") in page
    assert "| ceiling | cuBLAS bf16 8192^3 | TFLOP/s | 680 | - | - | - | 1 | 2026-12-01 | abc1234 |" in page
    assert "| runtime | import speedcore | ms | 9.04 | - | - | - | - | 2026-12-01 | abc1234 |" in page
    rows = [line for line in page.splitlines() if line.startswith("| ") and line.count("|") == 11
            and not line.startswith("| op |")]
    assert len(rows) == len(RECORDS)
    # Sections per op family, ceilings first; variants ("linear[ampere]") in their family's section.
    heads = [line for line in page.splitlines() if line.startswith("## ")]
    assert heads == ["## Summary", "## ceiling", "## rms_norm", "## linear", "## runtime"]
    linear = page.split("## linear\n", 1)[1].split("## runtime", 1)[0]
    assert "| linear[ampere] |" in linear
    # Summary: per (op, peer, commit), min / median / max of the ratio.
    assert "| rms_norm | torch.nn.functional.rms_norm | 2 | 1.22 | 1.41 | 1.61 | 0.96 | 2026-12-01 | abc1234 |" in page
    assert "| linear | F.linear (cuBLAS) | 2 | 1.01 | 1.11 | 1.2 | 0.79 | 2026-12-01 | abc1234 |" in page
    assert "| linear | F.linear (cuBLAS) | 1 | 0.807 | 0.807 | 0.807 | 0.45 | 2026-11-29 | old9999 |" in page
    assert ".png" not in page  # no charts written, none beside it


def test_report_out_dir_and_same_page_as_bench_save(results, tmp_path):
    """`bench --json` (bench.save) writes beside the JSON the page `--report` regenerates from it."""
    saved = tmp_path / "saved" / "h200.json"
    bench.save(RECORDS, saved)
    page = (saved.parent / "h200.md").read_text()
    out = tmp_path / "site"
    p = _run("--report", "--results", str(saved), "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert (out / "h200.md").read_text() == page
    assert sorted(f.name for f in out.iterdir()) == ["h200.md"]  # nothing else written without --plot


def test_report_imports_no_torch_and_no_matplotlib(results):
    code = ("import sys; from speedcore import report; report.write(sys.argv[1]); "
            "print(sorted(m for m in ('torch', 'cupy', 'matplotlib') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code, str(results)], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


@pytest.mark.parametrize("content, message", [
    ("[]", "holds no records"),
    ("{not json", "is not valid JSON"),
    ('{"op": "x"}', "not a list of records"),
    ('[{"op": "x"}]', "record 0 lacks case"),
])
def test_report_errors_name_the_file(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    p = _run("--report", "--results", str(path))
    assert p.returncode != 0
    assert message in p.stderr and "--results" in p.stderr and str(path) in p.stderr
    assert "Traceback" not in p.stderr


def test_report_missing_results(tmp_path):
    p = _run("--report", "--results", str(tmp_path / "nope.json"))
    assert p.returncode != 0 and "--results: no such file or directory" in p.stderr
    p = _run("--report", "--results", str(tmp_path / "*.json"))
    assert p.returncode != 0 and "matches no JSON file" in p.stderr
    p = _run("--report", "rms_norm", "--results", str(tmp_path))
    assert p.returncode != 0 and "runs no suites" in p.stderr


def test_report_default_results(tmp_path, monkeypatch):
    """Without --results: benchmarks/results/*.json of the working directory, else the checkout's."""
    monkeypatch.chdir(tmp_path)
    assert report.find_results() == sorted((Path(ROOT) / "benchmarks" / "results").glob("*.json"))
    d = tmp_path / "benchmarks" / "results"
    d.mkdir(parents=True)
    (d / "a100.json").write_text(json.dumps(RECORDS))
    assert report.find_results() == [d / "a100.json"]


def test_plot_without_matplotlib_says_how_to_install(results, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(report.ReportError, match=r"pip install speedcore\[plot\]"):
        report.write(results, with_plots=True)


def test_plot_writes_charts_and_links_them(results, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: pip install speedcore[plot]")
    out = tmp_path / "charts"
    p = _run("--report", "--plot", "--results", str(results), "--out", str(out))
    assert p.returncode == 0, p.stderr
    pngs = sorted(f.name for f in out.glob("*.png"))
    # linear has 4 (op, case) rows, its own chart; rms_norm's 2 and runtime's 1 share the small-ops chart.
    assert pngs == ["h200-linear.png", "h200-overview.png", "h200-small-ops.png"]
    for name in pngs:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    page = (out / "h200.md").read_text()
    # The overview and the shared chart under the summary, each family's chart in its own section.
    summary = page.split("## Summary\n", 1)[1].split("\n## ", 1)[0]
    assert "![h200-overview.png](h200-overview.png)" in summary and "h200-small-ops.png" in summary
    assert "![h200-linear.png](h200-linear.png)" in page.split("## linear\n", 1)[1].split("\n## ", 1)[0]
    # Regenerating the page without --plot keeps linking the charts beside it.
    assert _run("--report", "--results", str(results), "--out", str(out)).returncode == 0
    assert (out / "h200.md").read_text() == page
