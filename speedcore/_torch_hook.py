"""Redirect of the public functions to ``torch.ops.speedcore.*`` while torch.compile traces.

Dynamo cannot trace speedcore's host path (it reads raw pointers and launches through CuPy), so every public
function starts with::

    if _torch_hook.compiling():
        return _torch_hook.op("rms_norm")(x, weight, eps, residual=residual, out=out)

Eagerly, :func:`compiling` is one ``sys.modules`` lookup (and, once torch is imported, one
``torch.compiler.is_compiling()`` call).  While dynamo traces, ``torch.compiler.is_compiling()`` folds to
True and :func:`op` returns the integration's wrapper for that function, which calls the registered
``torch.ops.speedcore.*`` op; dynamo puts that op into the graph instead of tracing the host path.

This module imports nothing of speedcore statically: the torch integration
(``speedcore.integrations.torch_ops``, a plugin) fills :data:`OPS` when it is imported, which :func:`op` does
by name on first use, so ``import speedcore`` never imports torch.
"""
from __future__ import annotations

import importlib
import sys

# public function name -> callable with the public function's signature that calls torch.ops.speedcore.*.
# Filled by the plugin module below when it is imported.
OPS: dict = {}
TORCH_OPS_MODULE = "speedcore.integrations.torch_ops"


def compiling() -> bool:
    """True only while dynamo / torch.compile traces the caller; False eagerly and when torch is not imported."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def op(name: str):
    """The callable that replaces public function ``name`` while tracing (same positional and keyword
    arguments); it calls ``torch.ops.speedcore.*``, picking the ``*_out`` op when ``out=`` is given."""
    fn = OPS.get(name)
    if fn is None:
        # By name: the plugin imports torch, which this module must not do.  Its import registers the ops and
        # fills OPS; dynamo runs it at trace time (see tests/test_torch_ops.py).
        importlib.import_module(TORCH_OPS_MODULE)
        fn = OPS.get(name)
        if fn is None:
            raise NotImplementedError(f"speedcore.{name} has no torch.ops.speedcore op to trace into")
    return fn
