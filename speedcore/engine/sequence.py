"""One request's state: its tokens, how many have K/V in the cache, its pages."""
from __future__ import annotations

import enum
import itertools
from typing import List, Optional

from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


class Sequence:
    def __init__(self, token_ids: List[int], params: SamplingParams, *, seed: int = 0, request_id=None):
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids: List[int] = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.seed = seed  # the request's sampling seed (its own, or drawn from the engine's)
        self.status = Status.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_prefix = 0  # of which found by prefix caching at the last admission
        # KV pages; grows by append or is replaced by another list (BlockManager), never edited in place:
        # build_step keeps it as an int32 array between steps on that promise (_table_cache)
        self.block_table: List[int] = []
        self._table_cache = None
        self.num_hashed_blocks = 0  # leading blocks registered in the prefix cache
        self.last_block_hash = None  # chain hash of the last of them
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> List[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def __repr__(self):
        return (f"Sequence({self.seq_id}, {self.status.value}, tokens={len(self)}, "
                f"computed={self.num_computed_tokens}, "
                f"blocks={self.block_table})")
