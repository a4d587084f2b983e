"""speedcore: LLM-inference CUDA kernels compiled at run time by NVRTC, for PyTorch and CuPy.

Importing speedcore touches no GPU and compiles nothing: each public function is loaded on first access, and
each kernel variant is compiled (or read from the disk cache) on its first launch.
"""
from __future__ import annotations

import importlib

from ._compile import CompileError, Kernel  # light: no CuPy import at module level

__version__ = "0.1.0"

# public name -> module that defines it (one module per op family, paired with kernels/<family>.cu).  No
# module is named like a function: importing speedcore.<module> would replace the function attribute.
_EXPORTS = {
    "rms_norm": "norm",
    "flash_attn": "attention",
    "flash_attn_varlen": "attention",
    "matmul": "gemm",
    "linear": "gemm",
    "awq_linear": "quant",
    "gptq_linear": "quant",
    "int8_linear": "quant",
    "paged_decode_attention": "decode",
    "paged_prefill_attention": "paged_attention",
    "reshape_and_cache": "decode",
    "rotary_embedding": "decode",
    "rotary_embedding_and_cache": "decode",
    "silu_and_mul": "decode",
    "gelu_and_mul": "decode",
    "LLM": "engine",
    "SamplingParams": "engine",
}
_SUBMODULES = ("quant",)

__all__ = ["CompileError", "Kernel", "__version__"] + list(_EXPORTS)


def __getattr__(name):
    mod = _EXPORTS.get(name)
    if mod is not None:
        try:
            value = getattr(importlib.import_module(f".{mod}", __name__), name)
        except ModuleNotFoundError as e:
            if e.name == f"{__name__}.{mod}":
                raise AttributeError(f"speedcore.{name} is not available in this version") from None
            raise
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'speedcore' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
