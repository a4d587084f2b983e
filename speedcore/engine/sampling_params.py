"""Per-request sampling parameters, named as vLLM's ``SamplingParams``."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Union


@dataclass
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    temperature 0 is exact argmax (greedy); top_k -1 or 0 and top_p 1 and min_p 0 turn those filters off.  A
    request with ``seed`` draws the same tokens whatever else is in the batch; without one its draws come from
    the engine's seed.  ``logprobs=n`` returns the sampled token's log-probability and the top-n of each step
    (of the model's distribution, before temperature and filters, as vLLM).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    seed: Optional[int] = None
    logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    _stop_list: List[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name}: {why}, got {getattr(self, name)!r}")

        def integer(name, low, allow_none=False):
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int):
                bad(name, "expected an int" + (" or None" if allow_none else ""))
            if v < low:
                bad(name, f"must be >= {low}")

        def real(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, "expected a finite float")
            setattr(self, name, float(v))

        for name in ("temperature", "top_p", "min_p"):
            real(name)
        if self.temperature < 0:
            bad("temperature", "must be >= 0 (0 is greedy)")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        integer("top_k", -1)
        integer("max_tokens", 1, allow_none=True)
        integer("min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        integer("seed", -(2 ** 63), allow_none=True)
        integer("logprobs", 0, allow_none=True)
        integer("n", 1)
        if self.n != 1:
            bad("n", "only n = 1 is supported (submit the prompt n times, with different seeds)")
        if self.stop is None:
            self._stop_list = []
        elif isinstance(self.stop, str):
            self._stop_list = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self._stop_list = list(self.stop)
        else:
            bad("stop", "expected a string or a list of strings")
        if any(not s for s in self._stop_list):
            bad("stop", "stop strings must not be empty")
        ids = self.stop_token_ids
        if ids is None:
            self.stop_token_ids = []
        elif not isinstance(ids, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                                        for i in ids):
            bad("stop_token_ids", "expected a list of non-negative ints")
        else:
            self.stop_token_ids = list(ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "expected a bool")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_strings(self) -> List[str]:
        return self._stop_list
