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


def spill_allowances(kernels) -> dict:
    """kernel -> (spill store bytes, spill load bytes) its family accepts (``spills_allowed`` in the family
    module, documented there); (0, 0) for every other variant.  The families are looked up once."""
    fns = [mod.spills_allowed for mod in op_modules().values() if hasattr(mod, "spills_allowed")]
    out = {}
    for k in kernels:
        out[k] = next((tuple(a) for a in (fn(k) for fn in fns) if tuple(a) != (0, 0)), (0, 0))
    return out
