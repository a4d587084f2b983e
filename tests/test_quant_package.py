"""speedcore.quant as a package (issue #26): found as one op family, each kernel family's module paired with its
kernels/ source, and patching the package reaching the submodules that read the patched name (CPU only)."""
import os
from pathlib import Path

from speedcore import _registry
from speedcore import quant as Q

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = (Q.mma, Q.dense, Q.gemv, Q.stream, Q.bulk, Q.marlin, Q.w4wgmma, Q.prepack)


def test_registry_finds_quant_as_one_family():
    mods = _registry.op_modules()
    assert mods["quant"] is Q
    assert not any(name.startswith("quant.") or name in ("mma", "gemv", "marlin") for name in mods)
    assert len(_registry.all_kernels(["quant"])) == len(Q.all_kernels())


def test_every_variant_comes_from_its_family_module_source():
    sources = {m.SOURCE: m for m in FAMILIES}
    assert len(sources) == len(FAMILIES)  # one .cu per family module
    used = set()
    for k in Q.all_kernels():
        assert k.source in sources, k
        assert (ROOT / "kernels" / k.source).is_file()
        used.add(k.source)
    assert used == set(sources)
    assert Q.W4WGMMA_SOURCE == Q.w4wgmma.SOURCE


def test_patching_the_package_reaches_the_submodules(monkeypatch):
    # a switch read by its own module and by another one
    assert Q.use_marlin(64, 8192, 8192, 128)
    monkeypatch.setattr(Q, "_MARLIN_MODE", "off")
    assert Q.marlin._MARLIN_MODE == "off" and not Q.use_marlin(64, 8192, 8192, 128)
    monkeypatch.setattr(Q, "_STREAM_MODE", "off")
    assert Q.stream._STREAM_MODE == "off" and not Q.use_stream(Q.KIND_INT4, 1, 4096, 4096, 128)
    # a function imported by several submodules
    spy = object()
    monkeypatch.setattr(Q, "launch", spy)
    assert Q.mma.launch is Q.stream.launch is Q.w4wgmma.launch is Q.prepack.launch is spy
    monkeypatch.undo()
    assert Q.marlin._MARLIN_MODE == Q._MARLIN_MODE and Q.stream._STREAM_MODE == "on"
    assert Q.mma.launch is Q.launch is not spy
    # plain assignment, as benchmarks do
    old = Q._W4WGMMA_OVERRIDE
    try:
        Q._W4WGMMA_OVERRIDE = {"splits": 2}
        assert Q.w4wgmma._W4WGMMA_OVERRIDE == {"splits": 2}
    finally:
        Q._W4WGMMA_OVERRIDE = old
    assert Q.w4wgmma._W4WGMMA_OVERRIDE is old


def test_quant_files_stay_under_a_thousand_lines():
    files = list((ROOT / "speedcore" / "quant").glob("*.py")) + list((ROOT / "kernels").glob("quant*.cu"))
    files += list((ROOT / "kernels" / "common").glob("quant*.cuh"))
    assert len(files) > 10
    for f in files:
        with open(f) as fh:
            assert sum(1 for _ in fh) <= 1000, os.path.relpath(f, ROOT)
