"""Tensor parallelism (Megatron-style) for the Llama-family model: the shard math, the communicators, and the
process group that runs one rank per GPU.

Sharding over N ranks (rank r):

* qkv, column-parallel: rank r computes q heads [r H/N, (r+1) H/N) and the KV heads they attend with: KV heads
  [r Hkv/N, (r+1) Hkv/N) where Hkv >= N, else the one KV head r // (N / Hkv) (each KV head replicated on N / Hkv
  ranks).  Its rows of q_proj, k_proj and v_proj are fused into one per-rank weight (one GEMM), as unsharded.
* gate/up, column-parallel: rank r's intermediate channels [r I/N, (r+1) I/N) of gate and of up, fused per rank.
* o and down, row-parallel: rank r's K columns (its heads' channels, its intermediate channels); the partial
  outputs are summed by one all-reduce each per layer.
* embedding, vocab-parallel: rank r holds vocabulary rows [r V', (r+1) V') of the vocabulary padded to N V' (V' a
  multiple of 8, the GEMMs' need); a token outside its slice embeds to zeros; one all-reduce.  lm_head: rank r's
  slice of the logits, then an all-gather (rows past the vocabulary are zero weights, sliced off).
* quantized linears (engine/quantization.py) along their packing: column-parallel slices N in whole packed words
  (AWQ qweight / qzeros and GPTQ qzeros hold 8 channels a word), row-parallel slices K in whole groups (AWQ,
  GPTQ: qzeros / scales rows K/G; GPTQ qweight rows K/8; GPTQ group_size -1: the one group's row on every rank,
  its scales and zeros replicated); INT8: weight rows (column) or columns (row), the per-channel scales with the
  rows (column) or whole (row).  GPTQ act-order (desc_act) with N > 1 is refused at validation: a rank's K rows of
  o_proj / down_proj reference groups all over K, and speedcore.quant's GPTQ layers take only ceil(K/G) groups of
  their own K (vLLM keeps every group's scales on every rank and its kernels gather them; ours do not yet).

Each rank reads only its slices of the safetensors (row ranges: contiguous bytes; column ranges: a memory map of
the tensor, strided).  Rank 0 runs the scheduler; each step's host buffer (the runner's StepBatch) goes to every
other rank, which runs the same forward; only rank 0's logits are sampled.  tp = 1 runs the same code with the
whole model as rank 0's shard and :class:`SingleRankCommunicator` (no-ops).
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

# NVLink multicast (NVLS) off in every rank's environment: on the shared multi-GPU hosts a program using it can
# put the host's GPUs out of service (the device tool's KINDS.md); set before NCCL, PyTorch or NVSHMEM load.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

Range = Tuple[int, int]


class RankError(RuntimeError):
    """A tensor-parallel rank failed (raised, died or stopped answering); the message names it."""


# -- validation ---------------------------------------------------------------------------------------------------
def visible_gpus() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceCount())


@dataclass(frozen=True)
class ParallelConfig:
    """``tensor_parallel_size`` validated against a model config (see :func:`parallel_config`)."""
    tensor_parallel_size: int
    kv_replication: int  # ranks holding each KV head: 1 where num_key_value_heads >= N, else N / num_kv_heads
    vocab_per_rank: int  # rows of each rank's embedding / lm_head slice (a multiple of 8)

    @property
    def size(self) -> int:
        return self.tensor_parallel_size

    def plan(self, cfg, rank: int) -> "ShardPlan":
        return ShardPlan.build(cfg, self, rank)


def parallel_config(cfg, tensor_parallel_size: int = 1, device_count: Optional[Callable[[], int]] = None
                    ) -> ParallelConfig:
    """Check that ``cfg`` (a ModelConfig) shards over ``tensor_parallel_size`` ranks; raises ValueError naming
    the argument and the model field.  The visible GPUs are counted (``device_count``, default CuPy's
    getDeviceCount) only where N > 1."""
    n = tensor_parallel_size
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel_size: expected an int >= 1, got {n!r}")
    H, Hkv, D, I = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    if H % n:
        raise ValueError(f"tensor_parallel_size {n}: num_attention_heads {H} is not divisible by it")
    if Hkv >= n and Hkv % n:
        raise ValueError(f"tensor_parallel_size {n}: num_key_value_heads {Hkv} is not divisible by it")
    if Hkv < n and n % Hkv:
        raise ValueError(f"tensor_parallel_size {n}: num_key_value_heads {Hkv} is fewer than the ranks and does not "
                         f"divide them (each KV head must be replicated on the same number of ranks)")
    if I % n:
        raise ValueError(f"tensor_parallel_size {n}: intermediate_size {I} is not divisible by it")
    if (I // n) % 8:
        raise ValueError(f"tensor_parallel_size {n}: intermediate_size {I} / {n} = {I // n} per rank is not a "
                         f"multiple of 8 (the GEMMs need it)")
    qc = cfg.quantization
    if qc is not None and n > 1 and qc.method in ("awq", "gptq"):
        # row-parallel K (o: the q heads' channels, down: the intermediate channels) splits on group boundaries
        for module, k in (("self_attn.o_proj", H * D), ("mlp.down_proj", I)):
            if not any(qc.converts(f"model.layers.{li}.{module}") for li in range(cfg.num_layers)):
                continue
            if qc.method == "gptq" and qc.desc_act:
                raise ValueError(f"tensor_parallel_size {n}: GPTQ act-order (desc_act) checkpoints are not supported "
                                 f"above 1: {module}'s rows on a rank reference groups all over K (use tp = 1 or a "
                                 f"desc_act=false checkpoint)")
            if qc.group_size != -1 and (k // n) % qc.group_size:
                raise ValueError(f"tensor_parallel_size {n}: {module} (row-parallel) has K = {k}, {k // n} per rank, "
                                 f"not a multiple of the quantization group_size {qc.group_size} (ranks must split K "
                                 f"on group boundaries)")
            if qc.method == "gptq" and (k // n) % 8:
                raise ValueError(f"tensor_parallel_size {n}: {module} has K = {k}, {k // n} per rank, not a multiple "
                                 f"of 8 (GPTQ packs 8 rows of K a word)")
    if n > 1:
        have = (device_count or visible_gpus)()
        if n > have:
            raise ValueError(f"tensor_parallel_size {n} is larger than the visible GPUs ({have})")
    per = -(-cfg.vocab_size // (8 * n)) * 8
    return ParallelConfig(n, max(1, n // Hkv), per)


# -- shard math ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank``'s part of every weight, as ranges of the checkpoint's rows (output features) or columns."""
    size: int
    rank: int
    head_dim: int
    q_heads: Range  # global q heads this rank computes
    kv_heads: Range  # global KV heads it holds (one, replicated, where num_kv_heads < size)
    kv_replication: int
    intermediate: Range
    vocab: Range  # the checkpoint's vocabulary rows this rank holds (may be fewer than vocab_per_rank)
    vocab_per_rank: int
    vocab_size: int

    @classmethod
    def build(cls, cfg, pc: ParallelConfig, rank: int) -> "ShardPlan":
        n = pc.size
        if not 0 <= rank < n:
            raise ValueError(f"rank: expected 0 <= rank < {n}, got {rank}")
        H, Hkv, I = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
        hq = H // n
        if Hkv >= n:
            kv = (rank * Hkv // n, (rank + 1) * Hkv // n)
        else:
            k = rank // pc.kv_replication
            kv = (k, k + 1)
        v0 = rank * pc.vocab_per_rank
        v1 = min(cfg.vocab_size, v0 + pc.vocab_per_rank)
        return cls(n, rank, cfg.head_dim, (rank * hq, (rank + 1) * hq), kv, pc.kv_replication,
                   (rank * I // n, (rank + 1) * I // n), (min(v0, v1), v1), pc.vocab_per_rank, cfg.vocab_size)

    @classmethod
    def whole(cls, cfg) -> "ShardPlan":
        """tp = 1: the whole model (vocabulary padded to a multiple of 8)."""
        return cls.build(cfg, ParallelConfig(1, 1, -(-cfg.vocab_size // 8) * 8), 0)

    # local sizes
    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_rows(self) -> int:
        return self.vocab[1] - self.vocab[0]

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    # checkpoint ranges
    def q_rows(self) -> Range:
        return self.q_heads[0] * self.head_dim, self.q_heads[1] * self.head_dim

    def kv_rows(self) -> Range:
        return self.kv_heads[0] * self.head_dim, self.kv_heads[1] * self.head_dim

    def module_range(self, module: str) -> Tuple[str, Range]:
        """("rows", range of output features) for a column-parallel checkpoint module (``self_attn.q_proj`` ...),
        ("cols", range of input features) for a row-parallel one."""
        if module.endswith("q_proj"):
            return "rows", self.q_rows()
        if module.endswith(("k_proj", "v_proj")):
            return "rows", self.kv_rows()
        if module.endswith(("gate_proj", "up_proj")):
            return "rows", self.intermediate
        if module.endswith("o_proj"):
            return "cols", self.q_rows()
        if module.endswith("down_proj"):
            return "cols", self.intermediate
        raise KeyError(module)

    def float_slice(self, name: str) -> Tuple[Optional[Range], Optional[Range]]:
        """(rows, cols) of checkpoint float tensor ``name`` this rank reads (None: all of that axis)."""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return self.vocab, None
        for suffix in (".weight", ".bias"):
            if name.endswith("_proj" + suffix):
                axis, r = self.module_range(name[:-len(suffix)])
                if axis == "rows":
                    return r, None
                return None, r  # row-parallel weights; the family has no o / down biases
        return None, None  # norms: replicated

    def quant_slices(self, qc, module: str, k: int) -> Dict[str, Tuple[Optional[Range], Optional[Range]]]:
        """(rows, cols) of each stored tensor of quantized ``module`` (K = ``k`` input features, unsharded) on
        this rank, by suffix (qweight, qzeros, scales, g_idx, weight, weight_scale)."""
        axis, (a, b) = self.module_range(module)
        if qc.method == "speedcore_int8":  # weight (N, K), weight_scale (N,)
            if axis == "rows":
                return {"weight": ((a, b), None), "weight_scale": ((a, b), None)}
            return {"weight": (None, (a, b)), "weight_scale": (None, None)}
        g = qc.group(k)
        if axis == "rows":  # N in whole words of 8 channels
            if a % 8 or b % 8:
                raise ValueError(f"{module}: output features [{a}, {b}) do not split on 8-channel words")
            words = (a // 8, b // 8)
            if qc.method == "awq":  # qweight (K, N/8), qzeros (K/G, N/8), scales (K/G, N)
                return {"qweight": (None, words), "qzeros": (None, words), "scales": (None, (a, b))}
            # GPTQ: qweight (K/8, N), qzeros (groups, N/8), scales (groups, N), g_idx (K)
            return {"qweight": (None, (a, b)), "qzeros": (None, words), "scales": (None, (a, b)),
                    "g_idx": (None, None)}
        if qc.method == "gptq" and qc.desc_act and self.size > 1:
            raise ValueError(f"{module}: GPTQ act-order does not shard along K (see parallel_config)")
        if self.size > 1 and g != k and (a % g or b % g):
            raise ValueError(f"{module}: input features [{a}, {b}) do not split on groups of {g}")
        groups = (0, 1) if g == k else (a // g, b // g)  # group_size -1: the one group, replicated
        if qc.method == "awq":
            return {"qweight": ((a, b), None), "qzeros": (groups, None), "scales": (groups, None)}
        return {"qweight": ((a // 8, b // 8), None), "qzeros": (groups, None), "scales": (groups, None),
                "g_idx": ((a, b), None)}

    def quant_reader(self, ck, qc, module: str, k: int):
        """A ``read(name)`` for engine.quantization.read_quant_linear: this rank's slice of each stored tensor of
        ``module`` (g_idx re-based to the rank's first group)."""
        slices = self.quant_slices(qc, module, k)
        axis, (a, _) = self.module_range(module)

        def read(name):
            suffix = name.rsplit(".", 1)[1]
            rows, cols = slices[suffix]
            out = ck.read_slice(name, rows, cols)
            if suffix == "g_idx" and axis == "cols":
                out = out.astype(np.int32) - (a // qc.group(k) if qc.group(k) != k else 0)
            return out
        return read

    def local_k(self, module: str, k: int) -> int:
        axis, (a, b) = self.module_range(module)
        return b - a if axis == "cols" else k


# -- communicators ------------------------------------------------------------------------------------------------
class Communicator:
    """The collectives the sharded model calls.  Arrays are CuPy (NumPy in the CPU tests); ``stream`` is the CuPy
    stream the GPU work runs on (None: the current one).  all_reduce sums in place and returns its input;
    all_gather returns a new (size, *x.shape) array; broadcast copies root's array into every rank's, in place."""
    rank = 0
    size = 1

    def all_reduce(self, x, stream=None):
        raise NotImplementedError

    def all_gather(self, x, stream=None):
        raise NotImplementedError

    def broadcast(self, x, root: int = 0, stream=None):
        raise NotImplementedError

    def abort(self) -> None:
        """Stop collectives in flight (another rank died): called from a watchdog thread."""


class SingleRankCommunicator(Communicator):
    """tp = 1: every collective is the identity."""

    def all_reduce(self, x, stream=None):
        return x

    def all_gather(self, x, stream=None):
        return x[None]

    def broadcast(self, x, root: int = 0, stream=None):
        return x


class LoopbackGroup:
    """N ranks as threads of one process (the one-process check): each collective waits for every rank, then
    every rank gets the float32 sum (in rank order, rounded once to the dtype) or the gathered slices.  A rank that
    fails calls :meth:`abort`, and the others' collectives raise :class:`RankError` instead of waiting."""

    def __init__(self, size: int, timeout: float = 120.0):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: List = [None] * size
        self.result = None
        self.failure: Optional[str] = None

    def communicator(self, rank: int) -> "LoopbackCommunicator":
        return LoopbackCommunicator(self, rank)

    def abort(self, why: str) -> None:
        if self.failure is None:
            self.failure = why
        self.barrier.abort()

    def _wait(self):
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise RankError(self.failure or "a tensor-parallel rank stopped answering a collective") from None


class LoopbackCommunicator(Communicator):
    def __init__(self, group: LoopbackGroup, rank: int):
        self.group, self.rank, self.size = group, rank, group.size

    def _exchange(self, x, combine):
        g = self.group
        g.slots[self.rank] = x
        g._wait()
        if self.rank == 0:
            g.result = combine(g.slots)
        g._wait()
        out = g.result
        g._wait()  # every rank has read the result before the slots are reused
        return out

    def all_reduce(self, x, stream=None):
        def total(xs):
            acc = xs[0].astype(np.float32)
            for y in xs[1:]:
                acc = acc + y.astype(np.float32)
            return acc.astype(x.dtype)
        s = self._exchange(x, total)
        x[...] = s
        return x

    def all_gather(self, x, stream=None):
        g = self._exchange(x, lambda xs: np.stack([np.asarray(y) for y in xs]))
        return g.copy().view(type(x))

    def broadcast(self, x, root: int = 0, stream=None):
        s = self._exchange(x, lambda xs: xs[root].copy())
        x[...] = s
        return x

    def abort(self) -> None:
        self.group.abort(f"rank {self.rank} aborted")


class NcclCommunicator(Communicator):
    """NCCL through CuPy (``cupy.cuda.nccl``, NCCL from the nvidia-nccl pip wheel), one communicator per rank.

    The collectives are enqueued on the engine's stream, so that a CUDA graph captured on that stream captures
    them with the rest of the decode step (NCCL supports stream capture since 2.9; replaying the graph replays the
    all-reduces).  Not run in this repository's CI: it needs several GPUs.
    """

    def __init__(self, size: int, unique_id, rank: int):
        from cupy.cuda import nccl

        if not nccl.available:
            raise RuntimeError("tensor_parallel_size > 1 needs NCCL: cupy.cuda.nccl is not available (install the "
                               "nvidia-nccl-cu12 / -cu13 wheel matching CuPy)")
        self._nccl = nccl
        self.rank, self.size = rank, size
        self.comm = nccl.NcclCommunicator(size, unique_id, rank)

    @classmethod
    def connect(cls, size: int, unique_id, rank: int, group: "RankGroup", device: int = 0,
                timeout: float = 600.0) -> "NcclCommunicator":
        """Rank 0's communicator, made on a helper thread: ncclCommInitRank waits for every rank, and a rank that
        fails before it joins must raise here (the group's failure), not hang."""
        out: dict = {}

        def init():
            try:
                import cupy

                cupy.cuda.Device(device).use()  # the current device is per thread
                out["comm"] = cls(size, unique_id, rank)
            except BaseException as e:  # noqa: BLE001
                out["error"] = e

        t = threading.Thread(target=init, daemon=True, name="tp-nccl-init")
        t.start()
        deadline = time.monotonic() + timeout
        while t.is_alive():
            t.join(0.2)
            group.check()
            if time.monotonic() > deadline:
                group.fail(f"NCCL initialization did not finish within {timeout:.0f} s")
                group.check()
        if "error" in out:
            raise out["error"]
        return out["comm"]

    @staticmethod
    def unique_id():
        from cupy.cuda import nccl

        return nccl.get_unique_id()

    def _dtype(self, x):
        n = self._nccl
        name = str(x.dtype)
        table = {"float32": n.NCCL_FLOAT32, "float16": n.NCCL_FLOAT16, "int32": n.NCCL_INT32,
                 "bfloat16": getattr(n, "NCCL_BFLOAT16", 9)}  # ncclBfloat16 == 9 (NCCL >= 2.10)
        if name not in table:
            raise TypeError(f"NcclCommunicator: dtype {name} is not supported")
        return table[name]

    @staticmethod
    def _stream(stream):
        import cupy

        return (stream or cupy.cuda.get_current_stream()).ptr

    def all_reduce(self, x, stream=None):
        assert x.flags.c_contiguous
        self.comm.allReduce(x.data.ptr, x.data.ptr, x.size, self._dtype(x), self._nccl.NCCL_SUM, self._stream(stream))
        return x

    def all_gather(self, x, stream=None):
        import cupy

        assert x.flags.c_contiguous
        out = cupy.empty((self.size,) + tuple(x.shape), dtype=x.dtype)
        self.comm.allGather(x.data.ptr, out.data.ptr, x.size, self._dtype(x), self._stream(stream))
        return out

    def broadcast(self, x, root: int = 0, stream=None):
        self.comm.broadcast(x.data.ptr, x.data.ptr, x.size, self._dtype(x), root, self._stream(stream))
        return x

    def abort(self) -> None:
        try:
            self.comm.abort()
        except Exception:
            pass


# -- the ranks' side: messages from rank 0 ------------------------------------------------------------------------
@dataclass
class RankSpec:
    """What a rank other than 0 needs to build its shard (picklable: goes through the spawn pipe)."""
    model: str  # a directory or "preset:NAME"
    dtype: str
    quantization: Optional[str]
    quant_copies: str
    seed: int
    tensor_parallel_size: int
    runner_kwargs: dict
    backend: str = "nccl"  # "nccl" (processes) or "loopback" (threads, CPU check)


def build_rank(spec: RankSpec, rank: int, comm: Communicator, stream, cfg=None):
    """(model, runner) of one rank: its shard loaded (or random) and its runner; rank 0's LLM does the same."""
    from .checkpoint import Checkpoint
    from .config import load_config, preset_config
    from .models.llama import LlamaModel
    from .runner import ModelRunner

    preset = spec.model[len("preset:"):] if spec.model.startswith("preset:") else None
    if cfg is None:
        cfg = preset_config(preset, spec.quantization) if preset else load_config(spec.model)
    pc = parallel_config(cfg, spec.tensor_parallel_size, device_count=lambda: spec.tensor_parallel_size)
    model = LlamaModel(cfg, spec.dtype, spec.quant_copies, shard=pc.plan(cfg, rank), comm=comm)
    if preset:
        model.init_random(spec.seed)
    else:
        model.load(Checkpoint(spec.model))
    runner = ModelRunner(model, stream=stream, **spec.runner_kwargs)
    return model, runner


def serve_rank(runner, recv: Callable, reply: Callable) -> None:
    """A rank's loop: run what rank 0 sends, in order, until "close".  Messages: ("profile", utilization,
    num_blocks) -> reply num_blocks; ("blocks", n); ("capture",) -> reply; ("eager", StepBatch);
    ("replay", StepBatch, batch, bucket); ("close",)."""
    while True:
        msg = recv()
        op = msg[0]
        if op == "close":
            return
        if op == "eager":
            runner.run_step(msg[1])
        elif op == "replay":
            runner.replay_step(msg[1], msg[2], msg[3])
        elif op == "profile":
            reply(runner.profile_and_allocate(msg[1], msg[2]))
        elif op == "blocks":
            runner.set_num_blocks(msg[1])
            reply(msg[1])
        elif op == "capture":
            reply(runner.capture_graphs())
        else:
            raise ValueError(f"serve_rank: unknown message {op!r}")


# -- rank 0's side: the group ---------------------------------------------------------------------------------------
class RankGroup:
    """Rank 0's handle on ranks 1..N-1: send a message to all, gather one reply from each (with a timeout).  A
    rank's failure (an error it reported, its death, no reply in time) raises :class:`RankError` naming it, after
    stopping the others; ``on_failure`` callbacks (rank 0's communicator abort) run from the watchdog, so that a
    collective rank 0 is blocked in returns."""

    def __init__(self, size: int, timeout: float):
        self.size = size
        self.timeout = timeout
        self.replies = [queue.Queue() for _ in range(size)]  # index: rank (0 unused)
        self.failure: Optional[str] = None
        self.on_failure: List[Callable[[], None]] = []
        self._lock = threading.Lock()

    def fail(self, why: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = why
        for cb in list(self.on_failure):
            try:
                cb()
            except Exception:
                pass
        self._stop_others()

    def _stop_others(self) -> None:
        pass

    def check(self) -> None:
        if self.failure is not None:
            raise RankError(self.failure)

    def send_all(self, msg) -> None:
        self.check()
        for r in range(1, self.size):
            self._send(r, msg)
        self.check()

    def gather(self, timeout: Optional[float] = None) -> list:
        timeout = self.timeout if timeout is None else timeout
        out = []
        deadline = time.monotonic() + timeout
        for r in range(1, self.size):
            while True:
                self.check()
                try:
                    out.append(self.replies[r].get(timeout=min(0.2, max(0.0, deadline - time.monotonic()))))
                    break
                except queue.Empty:
                    if time.monotonic() >= deadline:
                        self.fail(f"tensor-parallel rank {r} did not answer within {timeout:.0f} s")
                        self.check()
        return out

    def close(self, timeout: float = 10.0) -> None:
        raise NotImplementedError


class ThreadGroup(RankGroup):
    """Ranks 1..N-1 as threads of this process (the loopback backend: the CPU one-process check)."""

    def __init__(self, size: int, target: Callable, timeout: float = 120.0):
        super().__init__(size, timeout)
        self.inboxes = [queue.Queue() for _ in range(size)]
        self.threads = []
        for r in range(1, size):
            t = threading.Thread(target=self._main, args=(r, target), name=f"tp-rank-{r}", daemon=True)
            self.threads.append(t)
            t.start()

    def _send(self, r, msg):
        self.inboxes[r].put(msg)

    def _main(self, rank, target):
        def recv():
            while True:
                try:
                    return self.inboxes[rank].get(timeout=0.2)
                except queue.Empty:
                    if self.failure is not None:
                        raise RankError(f"rank {rank}: stopping: {self.failure}")

        try:
            target(rank, recv, self.replies[rank].put)
        except BaseException as e:  # noqa: BLE001  (reported to rank 0, which raises)
            if self.failure is None:
                self.fail(f"tensor-parallel rank {rank} failed: {type(e).__name__}: {e}\n"
                          f"{traceback.format_exc(limit=6)}")

    def close(self, timeout: float = 10.0) -> None:
        for r in range(1, self.size):
            self._send(r, ("close",))
        for t in self.threads:
            t.join(timeout)


def _process_main(rank, size, conn, abort_flag, target, args, env):
    """Entry of a spawned rank: the environment, a watchdog (rank 0 gone or another rank failed: abort the
    communicator and exit with a message), then ``target(rank, size, recv, reply, on_abort, *args)``."""
    os.environ.update(env)
    parent = os.getppid()
    on_abort: List[Callable[[], None]] = []
    failing = threading.Event()  # this rank raised: it exits with its own message, not the watchdog's

    def stop(why):
        print(f"speedcore tensor-parallel rank {rank}: stopping: {why}", file=sys.stderr, flush=True)
        for cb in on_abort:
            try:
                cb()
            except Exception:
                pass
        os._exit(3)

    def watchdog():
        while True:
            time.sleep(0.25)
            if abort_flag.value:
                if failing.is_set():
                    return
                stop("another rank failed")
            if os.getppid() != parent:
                stop("rank 0 exited")

    threading.Thread(target=watchdog, daemon=True, name="tp-watchdog").start()

    def recv():
        try:
            return conn.recv()
        except (EOFError, OSError):
            stop("rank 0 closed the pipe")

    def reply(value):
        conn.send(("ok", value))

    try:
        target(rank, size, recv, reply, on_abort, *args)
        conn.send(("closed", None))
    except BaseException as e:  # noqa: BLE001
        failing.set()
        try:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
        except Exception:
            pass
        abort_flag.value = 1
        print(f"speedcore tensor-parallel rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)


class ProcessGroup(RankGroup):
    """Ranks 1..N-1 as processes (multiprocessing spawn), each with a pipe to rank 0.  ``target(rank, size, recv,
    reply, on_abort, *args)`` runs in each (a module-level function).  A watchdog thread here reads every pipe and
    watches every process: an error reported, a process that exits, makes the group fail (rank 0's ``on_failure``
    callbacks, the others told to stop through a shared event, then terminated after ``grace`` seconds)."""

    def __init__(self, size: int, target: Callable, args: tuple = (), timeout: float = 600.0,
                 env: Optional[dict] = None, grace: float = 5.0):
        import multiprocessing as mp

        super().__init__(size, timeout)
        ctx = mp.get_context("spawn")
        # A lock-free shared byte, not an Event: a multiprocessing Event's set() waits for every process that
        # sleeps in wait() to wake, and hangs (holding the Event's lock) when one of them exited meanwhile.
        self.abort_flag = ctx.RawValue("b", 0)
        self.grace = grace
        self._closing = False
        # Process.join / exitcode from two threads race: one thread's waitpid reaps the child while the
        # other's gets ECHILD and reports no exit code.  Every reap here takes this lock.
        self._reap_lock = threading.Lock()
        env = dict(NCCL_ENV, **(env or {}))
        self.conns, self.procs = [None], [None]
        for r in range(1, size):
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(target=_process_main, args=(r, size, child_end, self.abort_flag, target, args, env),
                            name=f"speedcore-tp-rank-{r}", daemon=True)
            p.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(p)
        self._watch = threading.Thread(target=self._watchdog, daemon=True, name="tp-watchdog")
        self._watch.start()

    def _send(self, r, msg):
        try:
            self.conns[r].send(msg)
        except (OSError, EOFError, BrokenPipeError) as e:
            self.fail(f"tensor-parallel rank {r}: its pipe is closed ({e})")

    def _watchdog(self):
        from multiprocessing.connection import wait

        live = {self.conns[r]: r for r in range(1, self.size)}
        sentinels = {self.procs[r].sentinel: r for r in range(1, self.size)}
        while live or sentinels:
            ready = wait(list(live) + list(sentinels), timeout=0.5)
            for obj in ready:
                if obj in live:
                    r = live[obj]
                    try:
                        kind, value = obj.recv()
                    except (EOFError, OSError):
                        del live[obj]
                        continue
                    if kind == "ok":
                        self.replies[r].put(value)
                    elif kind == "error":
                        self.fail(f"tensor-parallel rank {r} failed: {value}")
                    elif kind == "closed":
                        del live[obj]
                else:
                    r = sentinels.pop(obj)
                    code = self._reap(self.procs[r], 1.0)  # reaped here, so that its exit code is known
                    if not self._closing and self.failure is None:
                        # a reply or error still in the pipe arrives first where there is one
                        time.sleep(0.2)
                        while self.conns[r].poll():
                            try:
                                kind, value = self.conns[r].recv()
                            except (EOFError, OSError):
                                break
                            if kind == "error":
                                self.fail(f"tensor-parallel rank {r} failed: {value}")
                        self.fail(f"tensor-parallel rank {r} exited (exit code {code})")

    def _stop_others(self):
        self.abort_flag.value = 1

        def reap():
            self.exit_codes(self.grace)
            for p in self.procs[1:]:
                with self._reap_lock:
                    if p.exitcode is None:
                        p.terminate()
        threading.Thread(target=reap, daemon=True).start()

    def _reap(self, p, timeout: float):
        # join in short slices so that another thread's reap is never held up for long
        deadline = time.monotonic() + timeout
        while True:
            with self._reap_lock:
                p.join(min(0.05, max(0.0, deadline - time.monotonic())))
                code = p.exitcode
            if code is not None or time.monotonic() >= deadline:
                return code

    def exit_codes(self, timeout: float = 0.0) -> list:
        """Ranks 1..N-1's exit codes (None: still running), waiting up to ``timeout`` seconds in all."""
        deadline = time.monotonic() + timeout
        return [self._reap(p, max(0.0, deadline - time.monotonic())) for p in self.procs[1:]]

    def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        if self.failure is None:
            for r in range(1, self.size):
                self._send(r, ("close",))
        self.exit_codes(timeout)
        for p in self.procs[1:]:
            with self._reap_lock:
                if p.exitcode is None:
                    p.terminate()
            self._reap(p, 1.0)


def nccl_rank_main(rank, size, recv, reply, on_abort, spec: RankSpec):
    """A spawned engine rank: its GPU, NCCL (the unique id from rank 0's first message), its shard, then
    :func:`serve_rank`."""
    import cupy

    cupy.cuda.Device(rank).use()
    stream = cupy.cuda.Stream(non_blocking=True)
    op, uid = recv()
    assert op == "nccl_id"
    comm = NcclCommunicator(size, uid, rank)
    on_abort.append(comm.abort)
    with stream:
        model, runner = build_rank(spec, rank, comm, stream)
        stream.synchronize()
        reply(model.nbytes())
        serve_rank(runner, recv, reply)
        runner.close()
