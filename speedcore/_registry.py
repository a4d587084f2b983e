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
