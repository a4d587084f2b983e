"""Pages of the KV cache: reference counts, free-block accounting and prefix caching by hashes of full blocks.

A full block's hash chains the previous block's hash with the block's token ids, so equal hashes mean an equal
whole prefix.  Freed blocks keep their hash and contents until they are handed out again (least recently
freed first), so a later request with the same prefix finds them.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Dict, List, Optional

import numpy as np

from .sequence import Sequence


def block_hash(prev: Optional[bytes], token_ids) -> bytes:
    h = hashlib.blake2b(prev or b"", digest_size=16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: List[Optional[bytes]] = [None] * num_blocks
        self.cached: Dict[bytes, int] = {}  # hash -> block holding that prefix block
        # free blocks: never-used ones (ids fresh_start.. num_blocks-1, handed out first) and freed ones in the
        # order they were freed (they may still hold a cached prefix); a tiny model's cache has millions of blocks
        self.fresh_start = 0
        self.free: "OrderedDict[int, None]" = OrderedDict()
        self.hits = self.queries = 0  # prefix-cache token counters

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.fresh_start + len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------------------------
    def _prefix_hits(self, seq: Sequence) -> tuple:
        """Cached blocks holding seq's leading full blocks; the last token is always left to compute (its logits
        are needed)."""
        bs, hits, h, last = self.block_size, [], None, None
        if not self.prefix_caching:
            return hits, last
        for i in range((len(seq) - 1) // bs):
            h = block_hash(h, seq.token_ids[i * bs:(i + 1) * bs])
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
            last = h
        return hits, last

    def admissible(self, seq: Sequence, budget: int, reserve: int = 0) -> int:
        """How many tokens of a waiting seq (no blocks) to schedule now: its uncached tokens up to ``budget``, or 0
        if its cached prefix plus their blocks do not fit while keeping ``reserve`` blocks free."""
        hits, _ = self._prefix_hits(seq)
        revived = sum(1 for b in hits if self.ref_count[b] == 0)  # cached but free: taken from the free list
        cached = len(hits) * self.block_size
        n = min(len(seq) - cached, budget)
        need = self.blocks_needed(cached + n) - len(hits)
        return n if n > 0 and revived + need + reserve <= self.num_free_blocks else 0

    def admit(self, seq: Sequence) -> int:
        """Give a waiting seq (no blocks) its cached prefix blocks; returns the number of cached tokens."""
        assert not seq.block_table
        hits, last = self._prefix_hits(seq)
        for b in hits:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
        seq.block_table = list(hits)
        seq.num_hashed_blocks, seq.last_block_hash = len(hits), last
        seq.num_computed_tokens = seq.num_cached_prefix = len(hits) * self.block_size
        self.queries += len(seq)
        self.hits += seq.num_computed_tokens
        return seq.num_computed_tokens

    # -- allocation ---------------------------------------------------------------------------------------------
    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= self.num_free_blocks

    def _take(self) -> int:
        if self.fresh_start < self.num_blocks:
            self.fresh_start += 1
            self.ref_count[self.fresh_start - 1] = 1
            return self.fresh_start - 1
        b, _ = self.free.popitem(last=False)
        h = self.hash_of[b]
        if h is not None:  # evict its old contents from the prefix cache
            if self.cached.get(h) == b:
                del self.cached[h]
            self.hash_of[b] = None
        self.ref_count[b] = 1
        return b

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Append blocks so that seq has slots for ``num_new_tokens`` more tokens (check can_grow first)."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free_blocks} free")
        for _ in range(max(0, need)):
            seq.block_table.append(self._take())

    def commit(self, seq: Sequence) -> None:
        """Register the blocks that became full of computed tokens in the prefix cache (after a step)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens, len(seq)) // bs
        h = seq.last_block_hash
        for i in range(seq.num_hashed_blocks, full):
            h = block_hash(h, seq.token_ids[i * bs:(i + 1) * bs])
            b = seq.block_table[i]
            if h not in self.cached:  # else the same prefix is cached in another block: this one stays private
                self.cached[h] = b
                self.hash_of[b] = h
        if full > seq.num_hashed_blocks:
            seq.num_hashed_blocks, seq.last_block_hash = full, h

    def release(self, seq: Sequence) -> None:
        """Drop seq's blocks (in reverse, so a prefix's tail is reused before its head)."""
        for b in reversed(seq.block_table):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free[b] = None
        seq.block_table = []
        seq.num_hashed_blocks, seq.last_block_hash = 0, None

    def reset_prefix_cache(self) -> None:
        for h, b in list(self.cached.items()):
            if self.ref_count[b] == 0:
                del self.cached[h]
                self.hash_of[b] = None
