"""Packaging: the wheel ships the kernels, and importing speedcore is cheap and GPU-free."""
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_touches_no_gpu_library_and_is_fast():
    code = ("import sys, time; t = time.perf_counter(); import speedcore; dt = time.perf_counter() - t; "
            "bad = [m for m in ('cupy', 'torch', 'cupy_backends') if m in sys.modules]; print(dt, bad)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    dt, bad = p.stdout.split(" ", 1)
    assert bad.strip() == "[]"
    assert float(dt) < 0.3


def test_wheel_ships_package_kernels_and_suites_only(tmp_path):
    """The wheel holds speedcore/, the kernels as speedcore/_kernels and the bench suites as speedcore/_benchmarks:
    no probe scripts, results, check scripts or tests.  Built without build isolation (nothing downloaded)."""
    pytest.importorskip("hatchling", reason="the build backend (hatchling) is not installed: pip install hatchling")
    from speedcore import bench

    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path), ROOT], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    (wheel,) = tmp_path.glob("speedcore-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {n for n in names if n.startswith("speedcore/_kernels/")}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "kernels")):
        for f in files:
            if f.endswith((".cu", ".cuh")):
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, "kernels")).replace(os.sep, "/")
                assert f"speedcore/_kernels/{rel}" in shipped
    assert "speedcore/_kernels/norm.cu" in shipped
    assert "speedcore/_kernels/common/types.cuh" in shipped
    assert "speedcore/cli.py" in names and "speedcore/bench.py" in names
    # Exactly the suites `python -m speedcore bench` runs from this tree (a new suite missing from pyproject's
    # force-include list fails here).
    suites = {f"speedcore/_benchmarks/{name}.py" for name in bench.suites()}
    assert {"speedcore/_benchmarks/rms_norm.py", "speedcore/_benchmarks/decode.py"} <= suites
    assert {n for n in names if n.startswith("speedcore/_benchmarks/")} == suites
    assert all(n.startswith(("speedcore/", "speedcore-")) for n in names)  # the package and its .dist-info
    for n in names:
        base = n.rsplit("/", 1)[-1]
        assert "probes/" not in n and "/results/" not in n and not n.startswith("tests/"), n
        assert not (base.startswith("test_") or base.endswith(".sh") or base == "sass_check.py"), n


def test_kernels_found_from_installed_layout(tmp_path):
    """An installed wheel finds speedcore/_kernels (no source checkout beside it)."""
    import shutil

    pkg = tmp_path / "speedcore"
    shutil.copytree(os.path.join(ROOT, "speedcore"), pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(ROOT, "kernels"), pkg / "_kernels")
    code = "import speedcore._compile as c; print(c.kernels_dir())"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert p.stdout.strip() == str(pkg / "_kernels")


def test_cli_info_runs_without_gpu():
    p = subprocess.run([sys.executable, "-m", "speedcore", "info"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "speedcore" in p.stdout and "kernels norm" in p.stdout


def test_bench_commit_label(monkeypatch, tmp_path):
    """Records carry SPEEDCORE_COMMIT when set; otherwise git's HEAD, marked when tracked files differ from it."""
    import os
    import subprocess

    from speedcore import bench

    monkeypatch.setenv("SPEEDCORE_COMMIT", "abc123")
    assert bench.current_commit() == "abc123"
    monkeypatch.delenv("SPEEDCORE_COMMIT")
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "bench.py").write_text("x = 1\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}

    def run(*args):
        return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, env=env)

    run("init", "-q")
    run("add", "pkg/bench.py")
    run("commit", "-qm", "c")
    head = run("rev-parse", "--short=12", "HEAD").stdout.decode().strip()
    monkeypatch.setattr(bench, "__file__", str(repo / "pkg" / "bench.py"))
    assert bench.current_commit() == head
    (repo / "pkg" / "bench.py").write_text("x = 2\n")
    assert bench.current_commit() == head + "+modified"
