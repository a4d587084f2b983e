"""Model runner: the KV cache (sized by a profiling step), one forward per step, CUDA-graph decode, attention.

All GPU work runs on one non-blocking CuPy stream.  CUDA graphs: decode-only steps are captured once per
batch-size bucket into static input buffers; ops allocate their outputs (and split-KV workspaces) inside the
capture, so capture allocates from a private memory pool that nothing outside the graphs uses (blocks freed
inside one capture are reused by the next capture only: graphs replay one at a time on one stream), and the
logits each graph writes stay allocated with it.

Tensor parallelism: every rank has a runner over its shard (its KV heads in its cache).  Rank 0's runner builds
each step and hands it to ``step_listener`` (the engine sends it to the other ranks) before running it; the
others run rank 0's steps with :meth:`run_step` / :meth:`replay_step`, so that every rank launches the same
kernels and collectives in the same order.
"""
from __future__ import annotations

import math
import os
import time
from typing import Dict, List, Optional

import numpy as np

from .config import ModelConfig
from .models.llama import ForwardContext, LlamaModel
from .scheduler import ScheduledBatch, StepBatch, build_step
from .sequence import Sequence


def graph_buckets(max_num_seqs: int) -> List[int]:
    """Decode batch sizes with a CUDA graph: 1, 2, 4, 8, then steps of 8 to 64 and of 16 above."""
    b = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, max_num_seqs + 16, 16))
    out = sorted({x for x in b if x < max_num_seqs} | {max_num_seqs})
    return out


class _Step:
    """GPU views of a step buffer by name."""

    def __init__(self, dev, offsets):
        self.dev, self.offsets = dev, offsets

    def __getitem__(self, name):
        start, shape = self.offsets[name]
        return self.dev[start:start + int(np.prod(shape))].reshape(shape)


class ModelRunner:
    def __init__(self, model: LlamaModel, *, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, stream, log=print):
        import cupy

        from .._launch import set_chained_launches

        # The decode chain's kernels as programmatic dependents of one another (speedcore._launch): in a replayed
        # graph no launch gap separates them.
        # SPEEDCORE_CHAIN_LAUNCHES=0 keeps plain launches.
        if os.environ.get("SPEEDCORE_CHAIN_LAUNCHES") != "0":
            set_chained_launches(True)
        self.cp = cupy
        self.model = model
        self.cfg: ModelConfig = model.cfg
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.stream = stream
        self.log = log
        self.scale = 1.0 / math.sqrt(self.cfg.head_dim)
        with stream:
            self.cos_sin = cupy.asarray(self.cfg.cos_sin_cache(max_model_len))
            self._meta = cupy.empty(0, np.int32)
        self.table_width = -(-max_model_len // block_size)
        self.kv = None
        self.k_caches: List = []
        self.v_caches: List = []
        self.num_blocks = 0
        self.graphs: Dict[int, tuple] = {}
        self.graph_pool = None
        self.graph_input = None
        self.timings: Dict[str, float] = {}
        # tensor parallelism (rank 0): step_listener(op, step, *args) gets every step before it runs
        self.step_listener = None
        self.tp_failure = None  # () -> why another rank failed, or None
        self.tp_abort = None  # (why) -> stop the other ranks (rank 0 failed mid-step: they would wait for it)
        # attention of prefill chunks over cached tokens: "gather" (the stopgap, default) or "paged"
        # (speedcore.paged_prefill_attention straight from the pages)
        self.prefill_mode = os.environ.get("SPEEDCORE_ENGINE_PREFILL", "gather")
        if self.prefill_mode not in ("gather", "paged"):
            raise ValueError(f"SPEEDCORE_ENGINE_PREFILL: expected gather or paged, got {self.prefill_mode!r}")

    # -- KV cache -----------------------------------------------------------------------------------------------
    def block_bytes(self) -> int:
        c = self.cfg
        return 2 * c.num_layers * self.block_size * self.model.num_kv_heads * c.head_dim * np.dtype(
            self.model.dtype).itemsize

    def _set_cache(self, num_blocks: int) -> None:
        c = self.cfg
        self.kv = None
        with self.stream:
            self.kv = self.cp.empty((c.num_layers, 2, num_blocks, self.block_size, self.model.num_kv_heads, c.head_dim),
                                    dtype=self.model.dtype)
        self.k_caches = [self.kv[i, 0] for i in range(c.num_layers)]
        self.v_caches = [self.kv[i, 1] for i in range(c.num_layers)]
        self.num_blocks = num_blocks

    def profile_and_allocate(self, gpu_memory_utilization: float, num_blocks: Optional[int] = None) -> int:
        """Run the largest step (max_num_batched_tokens tokens over up to max_num_seqs sequences, then sampling)
        on a 1-block dummy cache, so that the memory pool holds its peak; the KV cache gets what is left below
        ``gpu_memory_utilization`` of the device, less room for the graphs."""
        cp = self.cp
        t0 = time.perf_counter()
        self._set_cache(1)
        n_seqs = max(1, min(self.max_num_seqs, self.max_num_batched_tokens))
        tokens = self.max_num_batched_tokens
        lens = [tokens // n_seqs + (1 if i < tokens % n_seqs else 0) for i in range(n_seqs)]
        lens = [min(max(1, n), self.max_model_len) for n in lens]
        seqs = []
        far = 1 << 20  # slots past the dummy cache: reshape_and_cache skips them
        # tensor parallelism: every rank runs this same dummy step itself (rank 0 does not send it)
        listener, self.step_listener = self.step_listener, None
        for i, n in enumerate(lens):
            s = Sequence([i % self.cfg.vocab_size] * n, _PROFILE_PARAMS)
            s.block_table = [far] * (-(-n // self.block_size))
            seqs.append(s)
        from .sampler import argmax_rows, sample

        try:
            with self.stream:
                logits = self.run(ScheduledBatch(seqs, lens, 0))
                sample(logits, [_PROFILE_PARAMS] * len(seqs), [0] * len(seqs), [0] * len(seqs))
                del logits
                # argmax over fewer than 32 rows takes two passes of their own reductions (CuPy compiles one per
                # shape rank: one row collapses to another): compiled here, not in the first request's step
                # (2.8 s in the first prefill of a 256-sequence benchmark)
                for rows in (1, 2, 32):
                    argmax_rows(cp.zeros((rows, self.cfg.vocab_size), cp.float32), cp)
            self.stream.synchronize()
        finally:
            self.step_listener = listener
        free, total = cp.cuda.runtime.memGetInfo()
        self.kv = None
        self.k_caches = self.v_caches = []
        graph_reserve = 0 if num_blocks is not None else 256 << 20
        budget = free - (1.0 - gpu_memory_utilization) * total - graph_reserve
        if num_blocks is None:
            num_blocks = int(budget // self.block_bytes())
        if num_blocks < 1:
            raise MemoryError(
                f"no memory left for the KV cache: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB after the "
                f"weights and a {self.max_num_batched_tokens}-token warm-up step; raise gpu_memory_utilization "
                f"({gpu_memory_utilization}) or lower max_num_batched_tokens / max_num_seqs")
        self._set_cache(num_blocks)
        self.timings["profile_s"] = time.perf_counter() - t0
        return num_blocks

    def set_num_blocks(self, num_blocks: int) -> None:
        """Reallocate the cache with ``num_blocks`` (tensor parallelism: the fewest any rank fits)."""
        if num_blocks != self.num_blocks:
            self.kv = None
            self.k_caches = self.v_caches = []
            self._set_cache(num_blocks)

    # -- one step -----------------------------------------------------------------------------------------------
    def _upload(self, host: np.ndarray):
        if self._meta.size < host.size:
            self._meta = self.cp.empty(max(host.size, 2 * self._meta.size, 4096), np.int32)
        dev = self._meta[:host.size]
        dev.set(host)
        return dev

    def run(self, batch: ScheduledBatch, *, logits_all: bool = False):
        """Float32 logits (rows, vocab) of one scheduled step: one row per sequence that reaches its end (or
        every token with ``logits_all``)."""
        try:
            return self._run(batch, logits_all)
        except Exception as e:
            why = self.tp_failure() if self.tp_failure is not None else None
            if why is not None:  # a collective aborted because another rank failed: say which and why
                from .parallel import RankError

                raise RankError(why) from e
            if self.tp_abort is not None:
                self.tp_abort(f"tensor-parallel rank 0 failed: {type(e).__name__}: {e}")
            raise

    def _run(self, batch: ScheduledBatch, logits_all: bool):
        seqs, n, nd = batch.seqs, batch.num_tokens, batch.num_decode
        if self.graphs and nd == len(seqs) and nd <= self.max_graph_batch and not logits_all:
            return self._replay(batch)
        # decode rows use the graphs' block-table width, so that eager and graph steps launch the same decode
        # attention plan (its KV split depends on the width) and give identical tokens
        st = build_step(seqs, n, nd, self.block_size, logits_all=logits_all, table_width=self.table_width,
                        paged_prefill=self.prefill_mode == "paged")
        return self.run_step(st)

    def run_step(self, st: StepBatch):
        """Float32 logits of one built step, run eagerly (every rank runs rank 0's steps through here)."""
        if self.step_listener is not None:
            self.step_listener("eager", st)
        with self.stream:
            g = _Step(self._upload(st.host), st.offsets)
            logits = self._forward(g, st.num_decode, st, logits_idx=g["logits_idx"])
            return logits.astype(np.float32)

    def _forward(self, g, num_decode: int, st: Optional[StepBatch], logits_idx):
        import speedcore as sc

        block_tables, seq_lens, slots = g["block_tables"], g["seq_lens"], g["slot_mapping"]
        if st is not None and st.num_prefill:
            paged = st.has_cached and self.prefill_mode == "paged"
            pre = dict(cu_q=g["cu_seqlens_q"], cu_k=g["cu_seqlens_k"], max_q=st.max_q, max_k=st.max_k,
                       gather=g["gather_slots"] if st.has_cached and not paged else None,
                       tables=g["prefill_tables"] if paged else None, seqused_k=g["seqused_k"])
        else:
            pre = None

        positions = g["positions"]

        def attend(layer, q, k, v, out, cos_sin):
            kc, vc = self.k_caches[layer], self.v_caches[layer]
            sc.rotary_embedding_and_cache(positions, q, k, v, cos_sin, kc, vc, slots, is_neox=True)
            wl = self.cfg.window_left[layer]
            if num_decode:
                sc.paged_decode_attention(q[:num_decode], kc, vc, block_tables, seq_lens, softmax_scale=self.scale,
                                          window_left=wl, out=out[:num_decode])
            if pre is not None:
                self.prefill_attention(q[num_decode:], k[num_decode:], v[num_decode:], kc, vc, pre, wl,
                                       out[num_decode:])

        ctx = ForwardContext(g["input_ids"], g["positions"], slots, logits_idx, attend)
        return self.model.forward(ctx, self.cos_sin)

    def prefill_attention(self, q, k, v, k_cache, v_cache, pre: dict, window_left: int, out):
        """Causal attention of prefill chunks (packed, cu_seqlens) over their sequences' cached and new tokens.

        Chunks without cached tokens: flash_attn_varlen on their own K/V.  Chunks that continue cached tokens (a
        prefix-cache hit, a later chunk), by default (the stopgap): their sequences' whole K/V gathered from the
        pages (the new tokens are already written there) into contiguous buffers, then flash_attn_varlen over
        them; with SPEEDCORE_ENGINE_PREFILL=paged: paged_prefill_attention straight from the pages.  Causal masks
        align bottom-right, so each chunk's queries see exactly their own prefix.
        """
        import speedcore as sc

        window = (window_left, 0) if window_left >= 0 else (-1, -1)
        if pre["tables"] is not None:
            return sc.paged_prefill_attention(q, k_cache, v_cache, pre["cu_q"], pre["seqused_k"], pre["tables"],
                                              pre["max_q"], pre["max_k"], causal=True, softmax_scale=self.scale,
                                              window_size=window, out=out)
        if pre["gather"] is None:
            return sc.flash_attn_varlen(q, k, v, pre["cu_q"], pre["cu_q"], pre["max_q"], pre["max_q"], causal=True,
                                        softmax_scale=self.scale, window_size=window, out=out)
        H_kv, D = k_cache.shape[2:]
        kg = k_cache.view(np.uint16).reshape(-1, H_kv, D)[pre["gather"]].view(k_cache.dtype)
        vg = v_cache.view(np.uint16).reshape(-1, H_kv, D)[pre["gather"]].view(v_cache.dtype)
        return sc.flash_attn_varlen(q, kg, vg, pre["cu_q"], pre["cu_k"], pre["max_q"], pre["max_k"], causal=True,
                                    softmax_scale=self.scale, window_size=window, out=out)

    # -- CUDA graphs --------------------------------------------------------------------------------------------
    @property
    def max_graph_batch(self) -> int:
        return max(self.graphs) if self.graphs else 0

    def capture_graphs(self) -> float:
        cp = self.cp
        t0 = time.perf_counter()
        buckets = graph_buckets(self.max_num_seqs)
        mb, W = buckets[-1], self.table_width
        with self.stream:
            self.graph_input = cp.zeros(4 * mb + mb * W, np.int32)
            self.graph_input[2 * mb:3 * mb] = -1  # slot -1: the warm-up runs write nothing to the cache
        self.graph_pool = cp.cuda.MemoryPool()
        gi = self.graph_input
        with cp.cuda.using_allocator(self.graph_pool.malloc), self.stream:
            for bs in reversed(buckets):  # largest first: the smaller ones reuse its freed blocks
                offsets = {"input_ids": (0, (bs,)), "positions": (mb, (bs,)), "slot_mapping": (2 * mb, (bs,)),
                           "seq_lens": (3 * mb, (bs,)), "block_tables": (4 * mb, (bs, W))}
                g = _Step(gi, offsets)
                self._forward(g, bs, None, None)  # warm-up: compiles and plans every launch outside the capture
                self.stream.synchronize()
                self.stream.begin_capture()
                try:
                    logits = self._forward(g, bs, None, None)
                finally:
                    graph = self.stream.end_capture()
                self.graphs[bs] = (graph, logits)
        self.stream.synchronize()
        self._buckets = sorted(self.graphs)
        dt = time.perf_counter() - t0
        self.timings["capture_s"] = dt
        return dt

    def _replay(self, batch: ScheduledBatch):
        B = batch.num_decode
        bs = next(b for b in self._buckets if b >= B)
        mb = self._buckets[-1]
        st = build_step(batch.seqs, batch.num_tokens, B, self.block_size, graph_batch=mb, graph_rows=bs,
                        table_width=self.table_width)
        return self.replay_step(st, B, bs)

    def replay_step(self, st: StepBatch, B: int, bs: int):
        """A decode step of ``B`` sequences on bucket ``bs``'s graph (its all-reduces and all-gather inside)."""
        if self.step_listener is not None:
            self.step_listener("replay", st, B, bs)
        self.graph_input[:st.host.size].set(st.host, stream=self.stream)  # the bucket's rows of the tables
        graph, logits = self.graphs[bs]
        graph.launch(self.stream)
        with self.stream:
            return logits[:B].astype(np.float32)

    def close(self) -> None:
        self.graphs = {}
        self.graph_input = self.kv = self.cos_sin = self._meta = None
        self.k_caches = self.v_caches = []
        if self.graph_pool is not None:
            self.graph_pool.free_all_blocks()
        self.graph_pool = None


from .sampling_params import SamplingParams  # noqa: E402

# the profiling step samples with every filter on, so that the sort buffers count in the peak
_PROFILE_PARAMS = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, max_tokens=1)
