"""``speedcore.LLM``: offline generation, named as vLLM's ``LLM`` (generate, chat, SamplingParams, RequestOutput)."""
from __future__ import annotations

import array
import gc
import os
import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence as Seq, Union

import numpy as np

from .block_manager import BlockManager
from .checkpoint import Checkpoint
from .config import ModelConfig, load_config, preset_config
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, Status


# Time in Python's cyclic garbage collector, process-wide: [collections, seconds] per generation.  The step report
# shows each step kind's share (an engine's heap is large: one full collection can cost milliseconds).
_GC_CLOCK = [[0, 0.0], [0, 0.0], [0, 0.0]]
_GC_START = [0.0]  # when the running collection began
_GC_SECONDS = [0.0]  # the three generations' seconds in one figure: what a step reads before and after itself
_GC_FULL_EVERY = 100  # generation-1 collections between full ones, once an engine has started (default 10)


def _gc_timer(phase, info) -> None:
    if phase == "start":
        _GC_START[0] = time.perf_counter()
    else:
        dt = time.perf_counter() - _GC_START[0]
        gen = _GC_CLOCK[info["generation"]]
        gen[0] += 1
        gen[1] += dt
        _GC_SECONDS[0] += dt


def gc_clock() -> tuple:
    """((collections, seconds) of generation 0, 1, 2) of Python's garbage collector in this process since the
    first engine started."""
    return tuple((n, s) for n, s in _GC_CLOCK)


def settle_heap() -> None:
    """After an engine's start-up: its objects out of the garbage collector's way (see the comments)."""
    # What start-up made (modules, weights' wrappers, graphs, plans) lives as long as the engine: out of the
    # collector's generations, so that a full collection during serving walks only the requests' objects
    # (vLLM freezes its heap after start-up for the same reason).
    gc.collect()
    gc.freeze()
    # And full collections ten times rarer: frozen objects no longer count towards the heap whose growth by a
    # quarter triggers one, so with the default threshold a busy engine ran one every ~250 steps, 60-100 ms
    # each (its requests' token lists, the plans' closures), a stall in every stream.  H200, 1B preset, the
    # serve bench's 2000-request offline workload (benchmarks/probes/gc_census.py): 4 automatic full
    # collections, 0.30 s, against none; the young generations still collect as before.
    g0, g1, g2 = gc.get_threshold()
    if 0 < g2 < _GC_FULL_EVERY:
        gc.set_threshold(g0, g1, _GC_FULL_EVERY)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list] = None  # per token: {token_id: logprob} of the top-n and the sampled token
    finish_reason: Optional[str] = None  # "stop", "length", "error"
    stop_reason: Union[int, str, None] = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    token_times: List[float] = field(default_factory=list)  # when each output token was sampled

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: Optional[str] = None  # why the request failed (outputs[0].finish_reason == "error")


@dataclass
class StreamDelta:
    """One streaming event: new text (whole characters) and tokens of request ``index``."""
    index: int
    request_id: str
    text: str
    token_ids: List[int]
    finished: bool
    output: RequestOutput


class _Request:
    def __init__(self, index, prompt, ids, params, seq, detok):
        self.index, self.prompt, self.ids, self.params, self.seq, self.detok = index, prompt, ids, params, seq, detok
        self.text = ""
        self.logprobs = [] if params.logprobs is not None else None
        self.cum_logprob = 0.0 if params.logprobs is not None else None
        self.metrics = RequestMetrics(time.perf_counter())
        self.error = None
        self.new_text = ""
        self.new_ids: List[int] = []


class LLM:
    """An offline engine: continuous batching over a paged KV cache with prefix caching, chunked prefill and
    CUDA-graph decode, on speedcore's kernels and CuPy (torch is not needed).

    ``model``: a Hugging Face model directory (config.json, safetensors, tokenizer.json) or ``"preset:NAME"``
    (random weights of a known shape, built on the GPU; NAME in llama-3-8b, llama-3.2-1b, llama-3-70b, tiny; no
    tokenizer: prompts are token-id lists).  ``tensor_parallel_size`` N > 1 shards the model over GPUs 0..N-1, one
    process each (engine/parallel.py, NCCL); rank 0 is this process.
    """

    def __init__(self, model: str, *, tokenizer: Optional[str] = None, dtype: str = "auto",
                 max_model_len: Optional[int] = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 gpu_memory_utilization: float = 0.9, block_size: int = 16, enable_prefix_caching: bool = True,
                 enforce_eager: bool = False, seed: int = 0, skip_tokenizer_init: bool = False,
                 num_gpu_blocks: Optional[int] = None, device: int = 0, log=None,
                 quantization: Optional[str] = None, quant_copies: str = "compact", tensor_parallel_size: int = 1,
                 _tp_backend: str = "nccl"):
        t_start = time.perf_counter()
        self._closed = True
        self.log = log or (lambda *a: None)
        for name, v, low in (("max_num_seqs", max_num_seqs, 1), ("max_num_batched_tokens", max_num_batched_tokens, 1),
                             ("block_size", block_size, 1), ("seed", seed, -(2 ** 63))):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {v!r}")
        if not 0.0 < float(gpu_memory_utilization) <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization}")
        preset = model[len("preset:"):] if isinstance(model, str) and model.startswith("preset:") else None
        if preset is not None:
            cfg = preset_config(preset, quantization)
            ck = None
            skip_tokenizer_init = True
        else:
            if not isinstance(model, str) or not os.path.isdir(model):
                raise FileNotFoundError(f"model: {model!r} is not a directory (a Hugging Face checkpoint) or "
                                        f"'preset:NAME'")
            cfg = load_config(model)
            ck = Checkpoint(model)
            if quantization is not None and (cfg.quantization is None or cfg.quantization.method != {
                    "int8": "speedcore_int8"}.get(quantization, quantization)):
                raise ValueError(f"quantization: {quantization!r} differs from the checkpoint's quantization_config "
                                 f"({cfg.quantization.method if cfg.quantization else 'none: a float checkpoint'}); "
                                 f"a checkpoint's own config decides (pass None)")
            ck.check(cfg.weight_shapes(), cfg.weight_dtypes())
        if cfg.head_dim not in (64, 128, 256):
            raise ValueError(f"{model}: head_dim {cfg.head_dim} is not supported (paged decode attention takes 64, "
                             f"128 or 256)")
        for name in ("hidden_size", "intermediate_size", "q_size", "kv_size"):
            if getattr(cfg, name) % 8:
                raise ValueError(f"{model}: {name} {getattr(cfg, name)} is not a multiple of 8 (the GEMMs need it)")
        if _tp_backend not in ("nccl", "loopback"):
            raise ValueError(f"_tp_backend: expected 'nccl' or 'loopback', got {_tp_backend!r}")
        from .parallel import parallel_config

        # the loopback backend (threads of this process: the CPU check) needs no GPUs
        self.parallel = parallel_config(cfg, tensor_parallel_size, device_count=(
            (lambda: tensor_parallel_size) if _tp_backend == "loopback" else None))
        if self.parallel.size > 1 and device != 0:
            raise ValueError(f"device: tensor_parallel_size {self.parallel.size} runs rank r on GPU r (device 0 for "
                             f"rank 0), got device {device}")
        self.config: ModelConfig = cfg
        self.tokenizer = None
        if not skip_tokenizer_init:
            from .tokenizer import Tokenizer

            self.tokenizer = Tokenizer(tokenizer or model)
        if dtype == "auto":
            dtype = cfg.dtype if cfg.dtype in ("bfloat16", "float16") else "bfloat16"
        if dtype not in ("bfloat16", "float16"):
            raise ValueError(f"dtype: expected 'auto', 'bfloat16' or 'float16', got {dtype!r}")
        self.dtype = dtype
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
            raise ValueError(f"max_model_len: expected an int >= 2, got {max_model_len!r}")
        if max_model_len is not None and max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len: {max_model_len} exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        user_len = max_model_len
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None and not cfg.eos_token_ids:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self._next_id = 0

        import cupy

        from .models.llama import LlamaModel
        from .runner import ModelRunner

        self._cp = cupy
        self.device = cupy.cuda.Device(device)
        self.device.use()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._closed = False
        self.timings = {}
        self._tp_group = None
        runner_kwargs = dict(block_size=block_size, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, max_model_len=self.max_model_len)
        try:
            with self.device, self.stream:
                t0 = time.perf_counter()
                comm = self._start_ranks(model, dtype, quantization, quant_copies, seed, runner_kwargs, _tp_backend)
                self.model = LlamaModel(cfg, dtype, quant_copies, shard=self.parallel.plan(cfg, 0), comm=comm)
                if ck is None:
                    self.model.init_random(seed)
                else:
                    self.model.load(ck)
                self.stream.synchronize()
                group = self._tp_group
                if group is not None:
                    group.gather()  # every rank's shard loaded
                self.timings["load_s"] = time.perf_counter() - t0
                self.runner = ModelRunner(self.model, stream=self.stream, **runner_kwargs)
                if group is not None:  # every rank profiles its own peak; all take the fewest blocks
                    group.send_all(("profile", float(gpu_memory_utilization), num_gpu_blocks))
                nb = self.runner.profile_and_allocate(float(gpu_memory_utilization), num_gpu_blocks)
                if group is not None:
                    nb = min([nb] + group.gather())
                    group.send_all(("blocks", nb))
                    self.runner.set_num_blocks(nb)
                    group.gather()
                self.timings["profile_s"] = self.runner.timings["profile_s"]
                capacity = nb * block_size
                if capacity < self.max_model_len:
                    if user_len is not None:
                        raise MemoryError(f"max_model_len {user_len} needs {-(-user_len // block_size)} KV blocks; "
                                          f"only {nb} fit: raise gpu_memory_utilization or lower max_model_len")
                    self.max_model_len = capacity
                if group is not None and not enforce_eager:
                    group.send_all(("capture",))  # every rank captures its graphs (their collectives inside)
                self.timings["capture_s"] = 0.0 if enforce_eager else self.runner.capture_graphs()
                if group is not None:
                    if not enforce_eager:
                        group.gather()
                    self.runner.step_listener = lambda *msg: group.send_all(msg)
                    self.runner.tp_failure = lambda: group.failure
                    self.runner.tp_abort = group.fail
        except BaseException:
            if self._tp_group is not None and self._tp_group.failure is None:
                self._tp_group.fail("rank 0 failed while starting")
            self.close()
            raise
        self._init_state(nb, block_size, enable_prefix_caching, max_num_seqs, max_num_batched_tokens)
        settle_heap()
        self.timings["startup_s"] = time.perf_counter() - t_start
        tp = f" tensor_parallel_size {self.parallel.size}, per rank:" if self.parallel.size > 1 else ""
        self.log(f"speedcore.LLM: {cfg.architecture}{tp} weights on the GPU {self.model.nbytes() / 1e9:.2f} GB "
                 f"({self.model.weights_summary()}), KV cache {nb} blocks "
                 f"of {block_size} ({nb * self.runner.block_bytes() / 2**30:.2f} GiB), graphs "
                 f"{sorted(self.runner.graphs) if self.runner.graphs else 'off'}; load {self.timings['load_s']:.2f}s, "
                 f"profile {self.timings['profile_s']:.2f}s, capture {self.timings['capture_s']:.2f}s")

    def _start_ranks(self, model, dtype, quantization, quant_copies, seed, runner_kwargs, backend):
        """tp > 1: ranks 1..N-1 started (processes with NCCL, or threads with the loopback communicator) and rank
        0's communicator; tp = 1: None (the model's SingleRankCommunicator)."""
        n = self.parallel.size
        if n == 1:
            return None
        from . import parallel as P

        spec = P.RankSpec(model, dtype, quantization, quant_copies, seed, n, runner_kwargs, backend)
        if backend == "loopback":
            loop = P.LoopbackGroup(n)
            cfg, cp = self.config, self._cp

            def rank_main(rank, recv, reply):
                stream = cp.cuda.Stream(non_blocking=True)
                model_r, runner = P.build_rank(spec, rank, loop.communicator(rank), stream, cfg)
                reply(model_r.nbytes())
                P.serve_rank(runner, recv, reply)

            self._tp_group = group = P.ThreadGroup(n, rank_main)
            group.on_failure.append(lambda: loop.abort(group.failure))
            return loop.communicator(0)
        # NVLink multicast off for rank 0's NCCL too (read when the communicator is made), as for the spawned ranks
        os.environ.update(P.NCCL_ENV)
        self._tp_group = group = P.ProcessGroup(n, P.nccl_rank_main, (spec,))
        uid = P.NcclCommunicator.unique_id()
        group.send_all(("nccl_id", uid))  # the unique id through the spawn pipes; then every rank joins
        comm = P.NcclCommunicator.connect(n, uid, 0, group)
        group.on_failure.append(comm.abort)
        return comm

    def _init_state(self, num_blocks, block_size, enable_prefix_caching, max_num_seqs, max_num_batched_tokens):
        from .sampler import sample

        self.step_stats = {}
        if _gc_timer not in gc.callbacks:
            gc.callbacks.append(_gc_timer)
        self.profile = False  # True: NVTX range per step, and a sync after each forward (GPU time per phase)
        self._nvtx = None
        try:
            from cupy.cuda import nvtx

            self._nvtx = nvtx
        except Exception:
            pass

        self._sample = sample
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens)
        self.num_gpu_blocks = num_blocks

    @classmethod
    def _with_runner(cls, cfg: ModelConfig, runner, *, array_module, tokenizer=None, num_blocks=64, block_size=4,
                     max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, enable_prefix_caching=True,
                     seed=0, sample=None):
        """An engine around a given runner (``run(batch) -> logits``) and array module: the CPU tests' fake."""
        import contextlib

        self = cls.__new__(cls)
        self._closed, self.log, self.config, self.tokenizer = False, (lambda *a: None), cfg, tokenizer
        self.max_model_len, self.seed, self._rng, self._next_id = max_model_len, seed, np.random.default_rng(seed), 0
        self.eos_token_ids = set(cfg.eos_token_ids)
        self._cp, self.runner, self.device, self.stream = array_module, runner, contextlib.nullcontext(), \
            contextlib.nullcontext()
        self.timings = {}
        self._init_state(num_blocks, block_size, enable_prefix_caching, max_num_seqs, max_num_batched_tokens)
        if sample is not None:
            self._sample = sample
        return self

    # -- lifetime -----------------------------------------------------------------------------------------------
    def close(self, _collect: bool = True) -> None:
        """Give back every byte of GPU memory this engine holds (weights, KV cache, graphs, pools)."""
        if self._closed:
            return
        self._closed = True
        cp = self._cp
        try:
            self.stream.synchronize()
        except Exception:
            pass
        try:  # the ops' per-stream scratch buffers of our stream (split-K partials, tile counters), outgrown too
            from .. import _arrays

            _arrays.release_stream_buffers(self.stream)
        except Exception:
            pass
        group = getattr(self, "_tp_group", None)
        if group is not None:  # the other ranks first: they run only what rank 0 sends
            self._tp_group = None
            try:
                group.close()
            except Exception:
                pass
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()
        self.runner = self.model = None
        if _collect:  # arrays still referenced from cycles (not from __del__: no collection inside a collection)
            gc.unfreeze()  # this engine's start-up objects, frozen after it: collectable again
            gc.collect()
        cp.get_default_memory_pool().free_all_blocks()
        cp.get_default_pinned_memory_pool().free_all_blocks()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close(_collect=False)
        except Exception:
            pass

    # -- requests -----------------------------------------------------------------------------------------------
    def _fail(self, req: _Request, why: str) -> None:
        req.error = why
        req.seq.status = Status.FINISHED
        req.seq.finish_reason = "error"
        req.metrics.finished_time = time.perf_counter()

    def _add(self, index: int, prompt, params) -> _Request:
        if params is None:
            params = SamplingParams()
        text, ids, why = None, None, None
        if isinstance(prompt, dict):
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        elif isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = [int(t) for t in prompt]
        else:
            why = f"prompt: expected a string, a list of token ids or a dict, got {type(prompt).__name__}"
        if not isinstance(params, SamplingParams):
            why = f"sampling_params: expected SamplingParams, got {type(params).__name__}"
            params = SamplingParams()
        if why is None and ids is None:
            if self.tokenizer is None:
                why = "text prompts need a tokenizer (this engine has none: pass token ids)"
            else:
                ids = self.tokenizer.encode(text)
        packed = None  # ids as an int64 array (the engine process's pipe sends them so): range checked in NumPy
        if isinstance(ids, array.array) and ids.typecode == "q":
            packed = np.frombuffer(ids, dtype=np.int64) if len(ids) else np.zeros(0, np.int64)
            ids = packed.tolist()
        else:
            ids = list(ids or [])
        if why is None:
            if not ids:
                why = "the prompt is empty"
            elif len(ids) >= self.max_model_len:
                why = f"the prompt has {len(ids)} tokens; max_model_len {self.max_model_len} leaves no room for output"
            else:
                lo, hi = (int(packed.min()), int(packed.max())) if packed is not None else (min(ids), max(ids))
                if lo < 0 or hi >= self.config.vocab_size:
                    why = f"token ids must lie in [0, {self.config.vocab_size}), got {lo}..{hi}"
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2 ** 63))
        seq = Sequence(ids, params, seed=seed, request_id=str(self._next_id))
        self._next_id += 1
        detok = None
        if self.tokenizer is not None and why is None:
            from .tokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        req = _Request(index, text, ids, params, seq, detok)
        if why is not None:
            self._fail(req, why)
        else:
            self.scheduler.add(seq)
        return req

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        m = req.metrics
        m.num_cached_tokens, m.num_preemptions = seq.num_cached_prefix, seq.num_preemptions
        comp = CompletionOutput(0, req.text, seq.output_token_ids, req.cum_logprob, req.logprobs, seq.finish_reason,
                                seq.stop_reason)
        return RequestOutput(seq.request_id, req.prompt, req.ids, [comp], seq.is_finished, m, req.error)

    def _check_stop(self, req: _Request, tok: int) -> Optional[str]:
        seq, p = req.seq, req.params
        n_out = seq.num_output_tokens
        if tok in p.stop_token_ids:
            seq.stop_reason = tok
            return "stop"
        if not p.ignore_eos and tok in self.eos_token_ids:
            return "stop"
        if req.detok is not None:
            delta = req.detok.add(tok)
            if delta:
                stops = p.stop_strings
                start = max(0, len(req.text) - max(len(s) for s in stops)) if stops else 0
                req.text += delta
                req.new_text += delta
                for s in stops:
                    at = req.text.find(s, start)
                    if at >= 0:
                        cut = at + (len(s) if p.include_stop_str_in_output else 0)
                        req.new_text = req.new_text[:max(0, len(req.new_text) - (len(req.text) - cut))]
                        req.text = req.text[:cut]
                        seq.stop_reason = s
                        return "stop"
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return "length"
        if len(seq) >= self.max_model_len:
            return "length"
        return None

    def _step(self, reqs_by_seq) -> List[_Request]:
        """One engine step; returns the requests that got a token."""
        cp = self._cp
        t0 = time.perf_counter()
        gc0 = _GC_SECONDS[0]
        batch: ScheduledBatch = self.scheduler.schedule()
        if not batch:
            if batch.preempted:  # a sequence gave its blocks back this step: it is admitted again next step
                return []
            raise RuntimeError("the scheduler found nothing to run with requests pending (KV cache too small?)")
        now = time.perf_counter()
        for s in batch.seqs:
            r = reqs_by_seq[s.seq_id]
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
        nd, n = batch.num_decode, len(batch.seqs)
        kind = ("decode" if nd == n else "mixed" if nd else "prefill") + (
            " (graph)" if nd == n and getattr(self.runner, "graphs", None) and nd <= self.runner.max_graph_batch
            else "")
        with self.device, self.stream:
            if self.profile:
                self._nvtx.RangePush(kind)
            t1 = time.perf_counter()
            logits = self.runner.run(batch)
            if self.profile:  # the forward's GPU time lands in this phase, not in sampling
                self.stream.synchronize()
                self._nvtx.RangePop()
            t2 = time.perf_counter()
            done = self.scheduler.advance(batch)
            if not done:
                self._account(kind, batch, t1 - t0, t2 - t1, 0.0, 0.0, _GC_SECONDS[0] - gc0)
                return []
            reqs = [reqs_by_seq[s.seq_id] for s in done]
            # min_tokens: no EOS / stop token before it
            rows, cols = [], []
            for r_i, r in enumerate(reqs):
                if r.seq.num_output_tokens < r.params.min_tokens:
                    banned = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else self.eos_token_ids)
                    banned = [t for t in banned if t < logits.shape[1]]
                    rows += [r_i] * len(banned)
                    cols += banned
            if rows:
                logits[cp.asarray(np.array(rows)), cp.asarray(np.array(cols))] = -np.inf
            res = self._sample(logits, [r.params for r in reqs], [r.seq.seed for r in reqs],
                               [r.seq.num_output_tokens for r in reqs])
        now = t3 = time.perf_counter()
        tokens = res.tokens.tolist()  # Python ints at once (one numpy scalar per row costs more)
        for r_i, r in enumerate(reqs):
            tok = tokens[r_i]
            r.seq.token_ids.append(tok)
            r.new_ids.append(tok)
            m = r.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            m.token_times.append(now)
            if res.logprobs is not None and res.logprobs[r_i] is not None:
                lp, top = res.logprobs[r_i]
                r.cum_logprob += lp
                d = dict(top)
                d[tok] = lp
                r.logprobs.append(d)
            reason = self._check_stop(r, tok)
            if reason is not None:
                if r.detok is not None and not isinstance(r.seq.stop_reason, str):
                    tail = r.detok.flush()
                    r.text += tail
                    r.new_text += tail
                self.scheduler.finish(r.seq, reason)
                m.finished_time = now
        self._account(kind, batch, t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3, _GC_SECONDS[0] - gc0)
        return reqs

    def _account(self, kind, batch, schedule_s, forward_s, sample_s, post_s, gc_s=0.0) -> None:
        """Per step kind: steps, tokens, seconds in scheduling, the forward (host enqueue time; with profile=True
        its GPU time too), sampling (waits for the GPU when not profiling) and bookkeeping, and the seconds of
        garbage collection inside those four."""
        st = self.step_stats.setdefault(kind, [0, 0, 0.0, 0.0, 0.0, 0.0, 0.0])
        st[0] += 1
        st[1] += batch.total_tokens
        st[2] += schedule_s
        st[3] += forward_s
        st[4] += sample_s
        st[5] += post_s
        st[6] += gc_s

    def step_report(self) -> str:
        lines = [f"{'step kind':16s} {'steps':>7s} {'tokens':>9s} {'ms/step: schedule':>18s} {'forward':>8s} "
                 f"{'sample':>8s} {'post':>8s} {'(gc)':>8s}"]
        for kind, (n, tok, a, b, c, d, g) in sorted(self.step_stats.items()):
            lines.append(f"{kind:16s} {n:7d} {tok:9d} {1e3 * a / n:18.3f} {1e3 * b / n:8.3f} {1e3 * c / n:8.3f} "
                         f"{1e3 * d / n:8.3f} {1e3 * g / n:8.3f}")
        return "\n".join(lines)

    def _normalize(self, prompts, sampling_params):
        single = isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts and
                                                       isinstance(prompts[0], (int, np.integer)))
        plist = [prompts] if single else list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(plist):
                raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(plist)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(plist)
        return plist, params

    def _run(self, prompts, sampling_params, use_tqdm: bool) -> Iterator[tuple]:
        if self._closed:
            raise RuntimeError("this LLM is closed")
        plist, params = self._normalize(prompts, sampling_params)
        reqs = [self._add(i, p, sp) for i, p, sp in zip(range(len(plist)), plist, params)]
        by_seq = {r.seq.seq_id: r for r in reqs}
        bar = None
        if use_tqdm:
            try:
                from tqdm import tqdm

                bar = tqdm(total=len(reqs), desc="generate", unit="req", dynamic_ncols=True)
            except ImportError:
                bar = None
        try:
            for r in reqs:
                if r.error is not None:
                    if bar is not None:
                        bar.update(1)
                    yield r
            n_out = 0
            t0 = time.perf_counter()
            while self.scheduler.has_unfinished():
                for r in self._step(by_seq):
                    n_out += 1
                    if bar is not None and r.seq.is_finished:
                        bar.update(1)
                    yield r
                if bar is not None:
                    bar.set_postfix_str(f"{n_out / max(1e-9, time.perf_counter() - t0):.0f} out tok/s", refresh=False)
        finally:
            if bar is not None:
                bar.close()
            for r in reqs:  # an abandoned stream: drop what is still queued
                if not r.seq.is_finished and r.error is None:
                    self.scheduler.finish(r.seq, "abort")
        self._last_reqs = reqs

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> List[RequestOutput]:
        """Generate for one prompt or a list (strings, token-id lists, or {"prompt": ...} /
        {"prompt_token_ids": [...]} dicts); returns one RequestOutput per prompt, in order.  A bad request
        (empty, longer than max_model_len, ...) gets a failed output with the reason while the rest run."""
        reqs = {}
        for r in self._run(prompts, sampling_params, use_tqdm):
            reqs[r.index] = r
        return [self._output(r) for r in self._last_reqs]

    def generate_stream(self, prompts, sampling_params=None) -> Iterator[StreamDelta]:
        """As generate, yielding each request's new text (whole characters only) and tokens as they come."""
        for r in self._run(prompts, sampling_params, use_tqdm=False):
            text, ids = r.new_text, r.new_ids
            r.new_text, r.new_ids = "", []
            yield StreamDelta(r.index, r.seq.request_id, text, ids, r.seq.is_finished, self._output(r))

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, *, add_generation_prompt: bool = True,
             chat_template: Optional[str] = None, **template_kwargs) -> List[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list of them, rendered
        with the checkpoint's chat template."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (this engine has none)")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                      chat_template=chat_template, **template_kwargs)
            # the template writes the BOS itself: encode without adding another
            prompts.append(dict(prompt=text, prompt_token_ids=self.tokenizer.encode(text, add_special_tokens=False)))
        return self.generate(prompts, sampling_params, use_tqdm)

    # -- test hook ----------------------------------------------------------------------------------------------
    def _debug_logits(self, token_ids: Seq[int], num_prompt: int, *, chunk: Optional[int] = None):
        """Teacher-forced float32 logits: prefill ``token_ids[:num_prompt]`` (in chunks of ``chunk`` tokens),
        then feed the remaining tokens one decode step each (CUDA graphs unless enforce_eager).  Returns
        (first position, logits (len(token_ids) - first position, vocab)) as NumPy: the positions a prefix-cache
        hit skips have no logits."""
        bm = self.block_manager
        seq = Sequence(list(token_ids[:num_prompt]), SamplingParams())
        out = []
        try:
            start = bm.admit(seq)
            with self.device, self.stream:
                while seq.num_computed_tokens < len(seq):
                    n = min(chunk or len(seq), len(seq) - seq.num_computed_tokens)
                    bm.grow(seq, n)
                    nd = 1 if n == 1 and seq.num_computed_tokens > 0 else 0
                    b = ScheduledBatch([seq], [n], nd)
                    out.append(self.runner.run(b, logits_all=True).get())
                    seq.num_computed_tokens += n
                    bm.commit(seq)
                for t in token_ids[num_prompt:]:
                    seq.token_ids.append(int(t))
                    bm.grow(seq, 1)
                    out.append(self.runner.run(ScheduledBatch([seq], [1], 1)).get())
                    seq.num_computed_tokens += 1
                    bm.commit(seq)
        finally:
            bm.release(seq)
        return start, np.concatenate(out, axis=0)
