"""Redirect of the public functions to ``torch.ops.speedcore.*`` while torch.compile traces.

Dynamo cannot trace speedcore's host path (it reads raw pointers and launches through CuPy), so every public
function starts with::

    if _torch_hook.compiling():
        return _torch_hook.op("rms_norm")(x, weight, eps, residual=residual, out=out)

Eagerly, :func:`compiling` costs 0.15-0.3 us, call included: a ``sys.modules`` lookup until torch is imported,
then one ``torch.compiler.is_dynamo_compiling()`` call and a flag read.  While dynamo traces, that call folds to True
and :func:`op` returns the integration's wrapper for that function, which calls the registered
``torch.ops.speedcore.*`` op; dynamo puts that op into the graph instead of tracing the host path.

This module imports nothing at module level but ``sys``: the torch integration
(``speedcore.integrations.torch_ops``, a plugin) fills :data:`OPS` when it is imported, which :func:`op` does
on first use, so ``import speedcore`` never imports torch.
"""
from __future__ import annotations

import sys

# public function name -> callable with the public function's signature that calls torch.ops.speedcore.*.
# Filled by the plugin, speedcore.integrations.torch_ops, when it is imported.
OPS: dict = {}


_compiler = None  # torch.compiler, bound on the first call that finds torch imported


def compiling() -> bool:
    """True only while dynamo / torch.compile traces the caller (or torch.export traces it); False eagerly and
    when torch is not imported."""
    compiler = _compiler
    if compiler is None:
        # Inline: CuPy-only callers pay this check on every call.
        return "torch" in sys.modules and _bind_torch()
    # is_dynamo_compiling() is `return False` eagerly (cheaper than is_compiling(), which also asks TorchScript)
    # and folds to True in dynamo; the flag is torch.export's (non-strict export runs this code on fake tensors).
    return compiler.is_dynamo_compiling() or compiler._is_compiling_flag


def _bind_torch() -> bool:
    compiler = sys.modules["torch"].compiler
    if compiler.is_compiling():
        # Bound on the next eager call instead: a global stored in a trace is a side effect (torch.export warns).
        return True
    global _compiler
    if hasattr(compiler, "is_dynamo_compiling") and hasattr(compiler, "_is_compiling_flag"):
        _compiler = compiler
    else:  # older torch: the public predicate (dynamo folds it to True as well)
        _compiler = _CompilerShim(compiler.is_compiling)
    return False


class _CompilerShim:
    _is_compiling_flag = False

    def __init__(self, is_compiling):
        self.is_dynamo_compiling = is_compiling


def op(name: str):
    """The callable that replaces public function ``name`` while tracing (same positional and keyword
    arguments); it calls ``torch.ops.speedcore.*``, picking the ``*_out`` op when ``out=`` is given."""
    # The plugin imports torch, which this module must not do at import, so it is imported here; its import
    # registers the ops and fills OPS.  An import statement, not importlib.import_module: dynamo runs IMPORT_NAME
    # at trace time but graph-breaks on importlib.  Imported before OPS is read, every time (op() runs only while
    # tracing): dynamo guards on what it reads, and an OPS read before the import filled it fails its own guard.
    import speedcore.integrations.torch_ops  # noqa: F401
    fn = OPS.get(name)
    if fn is None:
        raise NotImplementedError(f"speedcore.{name} has no torch.ops.speedcore op to trace into")
    return fn
