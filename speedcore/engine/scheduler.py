"""Continuous batching: first come first served, chunked prefill mixed into decode steps, preemption by recompute.

Every sequence is "tokens whose K/V are cached" followed by "tokens still to compute": a decode step computes
one token, a prefill chunk many, and a preempted sequence (its blocks dropped) recomputes its prompt and its
output so far as one longer prompt.  Each step first serves the running sequences in arrival order (so decodes
and unfinished prefills go first), then admits waiting ones while the token budget, ``max_num_seqs`` and the free
blocks allow.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional

import numpy as np

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: List[Sequence]  # one-token (decode) sequences first, then prefill chunks
    num_tokens: List[int]
    num_decode: int
    preempted: List[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 watermark: float = 0.01):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # blocks kept free when admitting, so that running sequences can grow without preempting at once
        self.watermark_blocks = max(1, int(watermark * block_manager.num_blocks)) if watermark > 0 else 0
        self.waiting: Deque[Sequence] = deque()
        self.running: List[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.bm.release(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chosen: Dict[Sequence, int] = {}
        preempted: List[Sequence] = []
        queue = list(self.running)
        kept: List[Sequence] = []
        while queue:
            seq = queue.pop(0)
            n = min(seq.num_uncomputed, budget)
            if n <= 0:
                kept.append(seq)
                continue
            while not self.bm.can_grow(seq, n):
                victim = queue.pop() if queue else seq  # the latest arrival goes first
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != Status.RUNNING:
                continue
            self.bm.grow(seq, n)
            chosen[seq] = n
            budget -= n
            kept.append(seq)
        self.running = kept
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                n = self.bm.admissible(seq, budget, reserve=self.watermark_blocks if self.running else 0)
                if n == 0:
                    break
                self.waiting.popleft()
                self.bm.admit(seq)
                self.bm.grow(seq, n)
                seq.status = Status.RUNNING
                self.running.append(seq)
                chosen[seq] = n
                budget -= n
        decode = [s for s in chosen if chosen[s] == 1 and s.num_computed_tokens > 0]
        prefill = [s for s in chosen if not (chosen[s] == 1 and s.num_computed_tokens > 0)]
        seqs = decode + prefill
        return ScheduledBatch(seqs, [chosen[s] for s in seqs], len(decode), preempted)

    def advance(self, batch: ScheduledBatch) -> List[Sequence]:
        """After the step ran: its tokens are cached.  Returns the sequences whose next token was sampled (those
        whose scheduled tokens reached their end), in batch order."""
        done = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            self.bm.commit(seq)
            if seq.num_computed_tokens == len(seq):
                done.append(seq)
        return done

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.bm.release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)


# -- per-step metadata --------------------------------------------------------------------------------------------
@dataclass
class StepBatch:
    """The int32 inputs of one forward, as views of one host buffer (copied to the GPU in one transfer).

    Token rows: the decode tokens first (row i is decode sequence i), then each prefill chunk in order.
    """
    host: np.ndarray
    offsets: Dict[str, tuple]  # name -> (start, shape)
    num_tokens: int
    num_decode: int
    num_prefill: int
    max_q: int  # longest prefill chunk
    max_k: int  # longest prefill sequence (cached + chunk)
    has_cached: bool  # some prefill chunk continues cached tokens (prefix hit or a later chunk)
    sample_rows: int  # len(logits_idx)

    def __getitem__(self, name: str) -> np.ndarray:
        start, shape = self.offsets[name]
        return self.host[start:start + int(np.prod(shape))].reshape(shape)


def _pack(fields) -> tuple:
    sizes = [(name, tuple(int(s) for s in np.shape(a))) for name, a in fields]
    total = sum(int(np.prod(s)) for _, s in sizes)
    host = np.empty(total, np.int32)
    offsets, pos = {}, 0
    for (name, a), (_, shape) in zip(fields, sizes):
        n = int(np.prod(shape))
        host[pos:pos + n] = np.asarray(a, np.int32).reshape(-1)
        offsets[name] = (pos, shape)
        pos += n
    return host, offsets


def _slots(block_table: List[int], start: int, stop: int, block_size: int) -> np.ndarray:
    pos = np.arange(start, stop)
    return np.asarray(block_table, np.int64)[pos // block_size] * block_size + pos % block_size


def _table_array(seq: Sequence) -> np.ndarray:
    """``seq.block_table`` as int32, kept on the sequence between steps.  A table grows by append or is replaced
    by another list (never edited in place: sequence.py), so the kept array is current when it was made from this
    very list at this length, and one made at a shorter length only lacks the appended tail."""
    t = seq.block_table
    kept = seq._table_cache
    if kept is not None and kept[0] is t:
        arr = kept[1]
        if len(arr) == len(t):
            return arr
        if len(arr) < len(t):
            arr = np.concatenate((arr, np.array(t[len(arr):], np.int32)))
            seq._table_cache = (t, arr)
            return arr
    arr = np.array(t, np.int32)
    seq._table_cache = (t, arr)  # holding the list: its id cannot come back as another list's
    return arr


def _fill_tables(out: np.ndarray, seqs: List[Sequence]) -> None:
    """Row i of ``out`` (zeros) starts with ``seqs[i]``'s block table: one flat array and one masked assignment
    (row-major, so the flat order is the rows' order)."""
    if not seqs:
        return
    arrays = [_table_array(s) for s in seqs]
    lens = np.fromiter(map(len, arrays), np.int64, len(arrays))
    out[:len(arrays)][np.arange(out.shape[1]) < lens[:, None]] = np.concatenate(arrays)


def build_step(seqs: List[Sequence], num_tokens: List[int], num_decode: int, block_size: int, *,
               logits_all: bool = False, graph_batch: Optional[int] = None, graph_rows: Optional[int] = None,
               table_width: Optional[int] = None, paged_prefill: bool = False) -> StepBatch:
    """Metadata of one step.  ``graph_batch`` (decode-only steps): the fixed layout of the CUDA-graph input
    buffer, ids / positions / slots / seq_lens padded to that many rows (slot -1: nothing written; seq_len 0:
    nothing read), then the block tables of ``graph_rows`` rows (the bucket's).  ``logits_all``: logits of every
    token (teacher forcing in tests), else of the last token of each sequence that reaches its end.
    ``paged_prefill``: prefill chunks that continue cached tokens get block tables and seqused_k (the paged
    prefill kernel) instead of gather slots."""
    dec = seqs[:num_decode]
    tables_of = [s.block_table for s in dec]
    width = table_width or max([len(t) for t in tables_of] + [1])
    # decode rows (one token each) from Python lists, one array assignment per field, and the block tables from
    # arrays kept between steps: numpy calls per sequence took 13.4 ms for a mixed step of 256 on the CI CPU and
    # 1.8 for a graph step; this takes about 1.4 and 1.3
    d_c = [s.num_computed_tokens for s in dec]
    d_ids = [s.token_ids[c] for s, c in zip(dec, d_c)]
    d_slots = [t[c // block_size] * block_size + c % block_size for t, c in zip(tables_of, d_c)]
    if graph_batch is not None:
        assert num_decode == len(seqs) and num_decode <= graph_batch
        mb, rows, T = graph_batch, graph_rows or graph_batch, num_decode
        host = np.zeros(4 * mb + rows * width, np.int32)
        host[2 * mb:3 * mb] = -1
        host[:T] = d_ids
        host[mb:mb + T] = d_c
        host[2 * mb:2 * mb + T] = d_slots
        host[3 * mb:3 * mb + T] = [c + 1 for c in d_c]
        _fill_tables(host[4 * mb:].reshape(rows, width), dec)
        offsets = {"input_ids": (0, (mb,)), "positions": (mb, (mb,)), "slot_mapping": (2 * mb, (mb,)),
                   "seq_lens": (3 * mb, (mb,)), "block_tables": (4 * mb, (rows, width))}
        return StepBatch(host, offsets, T, num_decode, 0, 0, 0, False, T)
    ids, pos, slots = [np.array(d_ids, np.int64)], [np.array(d_c, np.int64)], [np.array(d_slots, np.int64)]
    for seq, n in zip(seqs[num_decode:], num_tokens[num_decode:]):
        c = seq.num_computed_tokens
        ids.append(np.asarray(seq.token_ids[c:c + n], np.int64))
        pos.append(np.arange(c, c + n))
        slots.append(_slots(seq.block_table, c, c + n, block_size))
    cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64))
    ids, pos, slots = cat(ids), cat(pos), cat(slots)
    T = len(ids)
    seq_lens = np.array([c + 1 for c in d_c], np.int64)
    tables = np.zeros((len(dec), width), np.int32)
    _fill_tables(tables, dec)
    pre = list(zip(seqs[num_decode:], num_tokens[num_decode:]))
    q_lens = np.array([n for _, n in pre], np.int64)
    k_lens = np.array([s.num_computed_tokens + n for s, n in pre], np.int64)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int64)
    has_cached = any(s.num_computed_tokens > 0 for s, _ in pre)
    gather = np.zeros(0, np.int64)
    pre_tables = np.zeros((0, 1), np.int32)
    if has_cached and paged_prefill:
        pre_tables = np.zeros((len(pre), max(len(s.block_table) for s, _ in pre)), np.int32)
        for i, (s, _) in enumerate(pre):
            pre_tables[i, :len(s.block_table)] = s.block_table
    elif has_cached:
        gather = cat([_slots(s.block_table, 0, s.num_computed_tokens + n, block_size) for s, n in pre])
    if logits_all:
        logits_idx = np.arange(T)
    else:
        rows, r = [], 0
        for seq, n in zip(seqs, num_tokens):
            r += n
            if seq.num_computed_tokens + n == len(seq):
                rows.append(r - 1)
        logits_idx = np.array(rows, np.int64)
    host, offsets = _pack([("input_ids", ids), ("positions", pos), ("slot_mapping", slots), ("seq_lens", seq_lens),
                           ("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k), ("logits_idx", logits_idx),
                           ("gather_slots", gather), ("seqused_k", k_lens), ("prefill_tables", pre_tables),
                           ("block_tables", tables)])
    return StepBatch(host, offsets, T, num_decode, len(pre), int(q_lens.max(initial=0)), int(k_lens.max(initial=0)),
                     has_cached, len(logits_idx))
