"""The op families: every public module of the package that lists its kernel variants."""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path


def op_modules(errors: dict | None = None) -> dict:
    """name -> module, for each ``speedcore/<family>.py`` that defines ``all_kernels()``.

    A module that fails to import is left out and its exception stored in ``errors`` when given, else raised.
    """
    pkg = Path(__file__).resolve().parent
    mods = {}
    for info in sorted(pkgutil.iter_modules([str(pkg)]), key=lambda i: i.name):
        if info.name.startswith("_") or info.name in ("cli", "bench"):
            continue
        try:
            mod = importlib.import_module(f"speedcore.{info.name}")
        except Exception as e:
            if errors is None:
                raise
            errors[info.name] = e
            continue
        if hasattr(mod, "all_kernels"):
            mods[info.name] = mod
    return mods


def all_kernels(families=None) -> list:
    out = []
    for name, mod in op_modules().items():
        if families and name not in families:
            continue
        out.extend(mod.all_kernels())
    return out


def spills_allowed(kernel) -> tuple:
    """(spill store bytes, spill load bytes) a family accepts for one of its variants (``spills_allowed`` in the
    family module, documented there); (0, 0) for every other variant."""
    for mod in op_modules().values():
        fn = getattr(mod, "spills_allowed", None)
        if fn is not None:
            allowed = fn(kernel)
            if allowed != (0, 0):
                return tuple(allowed)
    return (0, 0)
