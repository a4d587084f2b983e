"""speedcore.LLM: an offline LLM engine on speedcore's kernels (see docs/engine.md).

Importing this package is light (no CuPy, no torch): the GPU parts load when an ``LLM`` is made.
"""
from __future__ import annotations

from .sampling_params import SamplingParams


def __getattr__(name):
    if name in ("LLM", "RequestOutput", "CompletionOutput", "RequestMetrics"):
        from . import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'speedcore.engine' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
