"""Tensor parallelism without a GPU: the shard math (every weight's slices reassemble it, KV heads replicated
where fewer than the ranks, vocabulary padding), the validation errors, tp = 1 through the sharded code path, the
one-process check (every rank's shard run as a thread with the loopback communicator, whose collectives sum /
gather the ranks' partial outputs) against the unsharded model, and the process group's failure handling with a
fake communicator.  NumPy stand-ins for the kernels and CuPy: tests/test_engine_model_cpu.py's."""
import threading
import time

import numpy as np
import pytest

from speedcore.engine.checkpoint import Checkpoint
from speedcore.engine.config import load_config, parse_config
from speedcore.engine.parallel import (LoopbackGroup, ParallelConfig, ProcessGroup, RankError, ShardPlan,
                                       SingleRankCommunicator, ThreadGroup, parallel_config)
from speedcore.engine.quantization import dequantize_host, read_quant_linear

from test_engine_model_cpu import _hf, fake_gpu  # noqa: F401  (the fixture)
from test_engine_quant_cpu import fake_quant, module_weight
from test_quant_checkpoint import tiny_llama_config, write_tiny_llama

ENGINE_KW = dict(dtype="float16", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                 skip_tokenizer_init=True, num_gpu_blocks=32, block_size=4, enforce_eager=True)


def llama_cfg(**kw):
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=1000)
    base.update(kw)
    return parse_config(base)


# -- shard math ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_plans_partition_heads_channels_and_vocab(n):
    cfg = llama_cfg()
    pc = parallel_config(cfg, n, device_count=lambda: 8)
    plans = [pc.plan(cfg, r) for r in range(n)]
    assert pc.kv_replication == max(1, n // 2) and pc.vocab_per_rank % 8 == 0 and n * pc.vocab_per_rank >= 1000
    assert [p.q_rows() for p in plans] == [(r * 512 // n, (r + 1) * 512 // n) for r in range(n)]
    assert [p.intermediate for p in plans] == [(r * 512 // n, (r + 1) * 512 // n) for r in range(n)]
    group = cfg.num_heads // cfg.num_kv_heads
    for p in plans:  # a rank's KV heads are the ones its q heads attend with
        assert {h // group for h in range(*p.q_heads)} == set(range(*p.kv_heads))
        assert p.num_kv_heads == max(1, 2 // n)
    # each KV head on kv_replication ranks
    assert sorted(h for p in plans for h in range(*p.kv_heads)) == sorted(list(range(2)) * pc.kv_replication)
    # vocabulary: consecutive slices of vocab_per_rank rows, the last ones short (padded with zero rows)
    assert [p.vocab_start for p in plans] == [r * pc.vocab_per_rank for r in range(n)]
    assert sum(p.vocab_rows for p in plans) == 1000 and plans[0].vocab[0] == 0 and plans[-1].vocab[1] == 1000


def test_vocab_padding():
    cfg = llama_cfg(vocab_size=100)
    assert ShardPlan.whole(cfg).vocab_per_rank == 104
    pc = parallel_config(cfg, 4, device_count=lambda: 4)
    plans = [pc.plan(cfg, r) for r in range(4)]
    assert pc.vocab_per_rank == 32 and [p.vocab_rows for p in plans] == [32, 32, 32, 4]
    pc = parallel_config(llama_cfg(vocab_size=128256), 8, device_count=lambda: 8)
    assert pc.vocab_per_rank == 16032 and 8 * 16032 == 128256  # Llama 3: no padding


def _cat_unique(parts_and_ranges, axis):
    """Slices (array, (start, stop)) put back in place; replicated slices (KV heads) must agree."""
    out = {}
    for a, rng in parts_and_ranges:
        if rng in out:
            assert np.array_equal(out[rng], a)
        out[rng] = a
    return np.concatenate([out[k] for k in sorted(out)], axis=axis)


@pytest.mark.parametrize("family, n", [("llama", 2), ("llama", 4), ("qwen2", 4)])
def test_float_slices_reassemble_every_tensor(family, n, tmp_path):
    _hf(family, tmp_path)  # heads 4, KV heads 2, q size 256, hidden 64, intermediate 128, vocab 100
    cfg = load_config(str(tmp_path))
    ck = Checkpoint(str(tmp_path))
    pc = parallel_config(cfg, n, device_count=lambda: n)
    plans = [pc.plan(cfg, r) for r in range(n)]
    if n == 4:
        assert pc.kv_replication == 2 and all(p.num_kv_heads == 1 for p in plans)
    for name in cfg.weight_shapes():
        full = ck.read(name)
        pieces = []
        for p in plans:
            rows, cols = p.float_slice(name)
            part = ck.read_slice(name, rows, cols)
            if rows is None and cols is None:
                assert np.array_equal(part, full)  # norms: replicated
                continue
            pieces.append((part, rows or cols))
        if pieces:
            axis = 1 if plans[0].float_slice(name)[1] is not None else 0
            assert np.array_equal(_cat_unique(pieces, axis), full), name


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    from speedcore.quant.checkpoint import quantize_checkpoint

    d = tmp_path_factory.mktemp("tpq")
    src = str(d / "float")
    write_tiny_llama(src)  # hidden 128, heads 2, KV 1, intermediate 256
    out = {"float": src}
    for name, method, g, kw in (("awq32", "awq", 32, {}), ("gptq32", "gptq", 32, {}),
                                ("gptq_all", "gptq", -1, dict(sym=False)), ("int8", "int8", -1, {}),
                                ("gptq_act", "gptq", 32, dict(desc_act=True))):
        out[name] = str(d / name)
        quantize_checkpoint(src, out[name], method, g, progress=False, **kw)
    return out


@pytest.mark.parametrize("name", ["awq32", "gptq32", "gptq_all", "int8"])
def test_quantized_slices_dequantize_to_the_full_weight(quantized, name):
    """Column-parallel parts sliced along N in whole words, row-parallel along K in whole groups: each rank's
    dequantized slice is the full weight's slice."""
    d = quantized[name]
    cfg = load_config(d)
    ck = Checkpoint(d)
    qc = cfg.quantization
    pc = parallel_config(cfg, 2, device_count=lambda: 2)
    plans = [pc.plan(cfg, r) for r in range(2)]
    for mod, (n_out, k) in cfg.linear_shapes().items():
        name_ = f"model.layers.1.{mod}"
        full = module_weight(ck, qc, name_, k)  # (K, N)
        pieces = []
        for p in plans:
            hl = read_quant_linear(ck, [name_], qc, p.local_k(mod, k), "float16", [p.quant_reader(ck, qc, name_, k)])
            axis, rng = p.module_range(mod)
            pieces.append((dequantize_host(hl), rng))
        axis = 1 if plans[0].module_range(mod)[0] == "rows" else 0  # rows of the checkpoint = N = W's columns
        assert np.array_equal(_cat_unique(pieces, axis), full), mod


# -- validation ---------------------------------------------------------------------------------------------------
def _never():
    raise AssertionError("the GPUs are counted only where tensor_parallel_size > 1")


@pytest.mark.parametrize("kw, n, message", [
    (dict(num_attention_heads=8), 3, "tensor_parallel_size 3: num_attention_heads 8 is not divisible by it"),
    (dict(num_attention_heads=12, num_key_value_heads=6, hidden_size=768), 4,
     "num_key_value_heads 6 is not divisible by it"),
    (dict(num_attention_heads=12, num_key_value_heads=4, hidden_size=768), 6,
     "num_key_value_heads 4 is fewer than the ranks and does not divide them"),
    (dict(intermediate_size=520), 8, "intermediate_size 520 / 8 = 65 per rank is not a multiple of 8"),
    (dict(intermediate_size=522), 4, "intermediate_size 522 is not divisible by it"),
])
def test_validation_errors(kw, n, message):
    with pytest.raises(ValueError) as e:
        parallel_config(llama_cfg(**kw), n, device_count=lambda: 8)
    assert message in str(e.value)


def test_validation_counts_gpus_only_above_one():
    cfg = llama_cfg()
    assert parallel_config(cfg, 1, device_count=_never) == ParallelConfig(1, 1, 1000)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 is larger than the visible GPUs \(2\)"):
        parallel_config(cfg, 4, device_count=lambda: 2)
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size: expected an int >= 1"):
            parallel_config(cfg, bad, device_count=lambda: 8)


def test_validation_of_quantized_groups():
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
    cfg = parse_config(tiny_llama_config(num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                                         quantization_config=awq))  # o: K 256, down: K 512
    parallel_config(cfg, 2, device_count=lambda: 2)
    with pytest.raises(ValueError, match=r"self_attn.o_proj \(row-parallel\) has K = 256, 64 per rank, not a multiple "
                                         r"of the quantization group_size 128"):
        parallel_config(cfg, 4, device_count=lambda: 4)
    act = dict(awq, quant_method="gptq", desc_act=True, group_size=32)
    cfg = parse_config(tiny_llama_config(quantization_config=act))
    parallel_config(cfg, 1)
    with pytest.raises(ValueError, match="GPTQ act-order"):
        parallel_config(cfg, 2, device_count=lambda: 2)
    # modules_to_not_convert keeps the row-parallel layers float: no group constraint
    cfg = parse_config(tiny_llama_config(num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                                         quantization_config=dict(awq, modules_to_not_convert=["o_proj", "down"])))
    parallel_config(cfg, 4, device_count=lambda: 4)


def test_llm_validates_before_loading(tmp_path, fake_gpu, monkeypatch):
    import sys

    _hf("llama", tmp_path)
    from speedcore.engine.llm import LLM

    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible"):
        LLM(str(tmp_path), tensor_parallel_size=3, **ENGINE_KW)
    monkeypatch.setattr(sys.modules["cupy"].cuda.runtime, "getDeviceCount", lambda: 1, raising=False)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 is larger than the visible GPUs \(1\)"):
        LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE_KW)


# -- the model: tp = 1 and the one-process check ------------------------------------------------------------------
def _ref(hf, ids):
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def test_tp1_runs_the_sharded_path(tmp_path, fake_gpu):
    pytest.importorskip("torch")
    hf = _hf("llama", tmp_path)
    from speedcore.engine.llm import LLM

    ids = np.random.default_rng(0).integers(0, 100, 30).tolist()
    ref = _ref(hf, ids)
    tp1 = LLM(str(tmp_path), tensor_parallel_size=1, **ENGINE_KW)
    plain = LLM(str(tmp_path), **ENGINE_KW)
    assert tp1.model.shard == ShardPlan.whole(tp1.config) and isinstance(tp1.model.comm, SingleRankCommunicator)
    assert tp1._tp_group is None and tp1.model.vocab_padded == 104  # vocab 100, tied: lm_head padded apart
    _, a = tp1._debug_logits(ids, 20)
    _, b = plain._debug_logits(ids, 20)
    assert np.array_equal(a, b) and np.abs(a - ref).max() < 4e-3 * np.abs(ref).max()


@pytest.mark.parametrize("family, n", [("llama", 2), ("llama", 4), ("qwen2", 2), ("qwen2", 4)])
def test_shard_and_sum_matches_the_unsharded_model(family, n, tmp_path, fake_gpu):
    """Every rank's shard in its own thread; the loopback collectives sum the o / down / embedding partials and
    gather the logit slices.  llama: tied embeddings, GQA (n = 4: 2 KV heads on 4 ranks, each replicated twice);
    qwen2: q/k/v biases, a sharded checkpoint."""
    pytest.importorskip("torch")
    hf = _hf(family, tmp_path)
    from speedcore.engine.llm import LLM

    ids = np.random.default_rng(1).integers(0, 100, 30).tolist()
    ref = _ref(hf, ids)
    plain = LLM(str(tmp_path), **ENGINE_KW)
    tp = LLM(str(tmp_path), tensor_parallel_size=n, _tp_backend="loopback", **ENGINE_KW)
    try:
        assert tp.model.num_heads == 4 // n and tp.model.num_kv_heads == max(1, 2 // n)
        assert tp.model.embed.shape[0] == tp.model.shard.vocab_rows and tp.runner.num_blocks == 32
        _, want = plain._debug_logits(ids, 20)
        _, got = tp._debug_logits(ids, 20)  # 20 prefill positions + 10 decode steps
        scale = np.abs(ref).max()
        # the partial sums round to float16 before the all-reduce: close to the unsharded model, not equal
        assert np.abs(got - want).max() < 2e-3 * scale
        assert np.abs(got - ref).max() < 4e-3 * scale
        start, got = tp._debug_logits(ids, 20, chunk=6)  # a prefix hit, then chunks over cached pages
        assert start == 16 and np.abs(got - ref[16:]).max() < 4e-3 * scale
        from speedcore.engine.sampling_params import SamplingParams

        outs = tp.generate([ids[:12], ids[:20], ids[:5]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4, 4] and all(o.error is None for o in outs)
    finally:
        tp.close()
    assert all(not t.is_alive() for t in tp_threads(tp))


def tp_threads(llm):
    return [t for t in threading.enumerate() if t.name.startswith("tp-rank-")]


def test_shard_and_sum_awq(quantized, fake_gpu, monkeypatch):
    """AWQ g32 at tp = 2: qkv / gate_up sliced in whole packed words, o / down along K in whole groups; one KV
    head replicated on both ranks."""
    fake_quant(monkeypatch)
    from speedcore.engine.llm import LLM

    d = quantized["awq32"]
    ids = np.random.default_rng(2).integers(0, 96, 24).tolist()
    plain = LLM(d, **ENGINE_KW)
    tp = LLM(d, tensor_parallel_size=2, _tp_backend="loopback", **ENGINE_KW)
    try:
        L = tp.model.layers[0]
        assert L.qkv.part_features == [64 + 2 * 64] and L.gate_up.part_features == [256]
        assert L.o.weights[0].arrays["qweight"].shape == (64, 16)  # K 128 / 2 rows, N 128 / 8 words
        _, want = plain._debug_logits(ids, 16)
        _, got = tp._debug_logits(ids, 16)
        assert np.abs(got - want).max() < 2e-3 * np.abs(want).max()
    finally:
        tp.close()


def test_loopback_rank_failure_stops_the_others():
    """A rank that raises: the rank blocked in a collective raises RankError naming it, not a hang."""
    loop = LoopbackGroup(3, timeout=30)

    def rank_main(rank, recv, reply):
        comm = loop.communicator(rank)
        while recv()[0] != "close":
            if rank == 2:
                raise ValueError("boom on rank 2")
            comm.all_reduce(np.ones(4, np.float32))

    group = ThreadGroup(3, rank_main)
    group.on_failure.append(lambda: loop.abort(group.failure))
    group.send_all(("step",))
    t0 = time.monotonic()
    with pytest.raises(RankError, match="rank 2 failed: ValueError: boom on rank 2"):
        loop.communicator(0).all_reduce(np.ones(4, np.float32))
    assert time.monotonic() - t0 < 10
    for t in group.threads:
        t.join(5)
        assert not t.is_alive()
    with pytest.raises(RankError, match="boom"):
        group.send_all(("step",))


# -- the process group, with a fake communicator ------------------------------------------------------------------
class BlockingCommunicator:
    """A collective that waits for peers that never come, until aborted (as NCCL's would, a rank gone)."""

    def __init__(self):
        self.aborted = threading.Event()

    def all_reduce(self, x, stream=None):
        if not self.aborted.wait(60):
            raise AssertionError("never aborted")
        raise RuntimeError("aborted")

    def abort(self):
        self.aborted.set()


def fake_rank(rank, size, recv, reply, on_abort, fail_rank):
    comm = BlockingCommunicator()
    on_abort.append(comm.abort)
    while True:
        msg = recv()
        if msg[0] == "close":
            return
        if msg[0] == "ping":
            reply(("pong", rank))
            continue
        if rank == fail_rank:
            raise ValueError(f"boom on rank {rank}")
        comm.all_reduce(None)


def test_process_group_replies_and_closes():
    group = ProcessGroup(3, fake_rank, (-1,), timeout=60)
    try:
        group.send_all(("ping",))
        assert group.gather() == [("pong", 1), ("pong", 2)]
    finally:
        group.close()
    assert group.exit_codes(20) == [0, 0] and group.failure is None


def test_process_group_rank_that_raises_stops_the_others(capfd):
    group = ProcessGroup(3, fake_rank, (1,), timeout=60, grace=10)
    rank0 = BlockingCommunicator()
    group.on_failure.append(rank0.abort)
    try:
        group.send_all(("ping",))
        group.gather()
        t0 = time.monotonic()
        group.send_all(("step",))  # rank 1 raises; rank 2 and rank 0 wait in their collective
        with pytest.raises(RuntimeError, match="aborted"):
            rank0.all_reduce(None)
        assert time.monotonic() - t0 < 20
        assert "tensor-parallel rank 1 failed: ValueError: boom on rank 1" in group.failure
        assert group.exit_codes(20) == [1, 3]  # 3: stopped by the watchdog
        with pytest.raises(RankError, match="rank 1 failed"):
            group.send_all(("step",))
    finally:
        group.close()
    err = capfd.readouterr().err
    assert "speedcore tensor-parallel rank 2: stopping: another rank failed" in err


def test_process_group_rank_that_dies():
    group = ProcessGroup(2, fake_rank, (-1,), timeout=60)
    try:
        group.procs[1].kill()
        t0 = time.monotonic()
        with pytest.raises(RankError, match=r"tensor-parallel rank 1 exited \(exit code -9\)"):
            group.gather(timeout=30)
        assert time.monotonic() - t0 < 10
    finally:
        group.close()


def test_spawned_ranks_get_nvlink_multicast_off(monkeypatch):
    from speedcore.engine.parallel import NCCL_ENV

    assert NCCL_ENV == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    group = ProcessGroup(2, env_rank, (), timeout=60)
    try:
        group.send_all(("env",))
        assert group.gather() == [NCCL_ENV]
    finally:
        group.close()


def env_rank(rank, size, recv, reply, on_abort):
    import os

    while recv()[0] != "close":
        reply({k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                              "NVSHMEM_DISABLE_NVLS")})


def test_seventy_b_preset_and_the_tp_roofline():
    from speedcore.engine.cli import roofline
    from speedcore.engine.config import preset_config

    cfg = preset_config("llama-3-70b")
    assert 70e9 < cfg.num_params() < 71e9
    for n in (2, 4, 8):
        pc = parallel_config(cfg, n, device_count=lambda: 8)
        p = pc.plan(cfg, n - 1)
        assert (p.num_heads, p.num_kv_heads, p.intermediate_size) == (64 // n, 8 // n, 28672 // n)
    w = cfg.num_params() * 2
    one = roofline(cfg, w, 2, [128], [256], 1)
    four = roofline(cfg, w // 4, 2, [128], [256], 1, 4, 2)  # one rank's bytes and KV heads
    assert four["memory_s"] == pytest.approx(one["memory_s"] / 4, rel=1e-3)
    assert four["compute_s"] == pytest.approx(one["compute_s"] / 4)


def test_cli_takes_the_tensor_parallel_size():
    import argparse

    from speedcore.engine.cli import add_parsers

    sub = argparse.ArgumentParser().add_subparsers(dest="cmd")
    add_parsers(sub)
    parser = sub.choices["bench-engine"]
    assert parser.parse_args(["--preset", "llama-3-70b", "--tensor-parallel-size", "8"]).tensor_parallel_size == 8
    assert sub.choices["generate"].parse_args(["--model", "m", "hi"]).tensor_parallel_size == 1


def test_rank0_nccl_init_raises_when_a_rank_fails(fake_gpu, monkeypatch):
    """ncclCommInitRank waits for every rank: rank 0 makes it on a helper thread and raises the group's failure."""
    from speedcore.engine.parallel import NcclCommunicator

    released = threading.Event()
    monkeypatch.setattr(NcclCommunicator, "__init__", lambda self, *a: released.wait(30))

    def rank_main(rank, recv, reply):
        raise ValueError("no GPU for rank 1")

    group = ThreadGroup(2, rank_main)
    t0 = time.monotonic()
    try:
        with pytest.raises(RankError, match="rank 1 failed: ValueError: no GPU for rank 1"):
            NcclCommunicator.connect(2, None, 0, group, timeout=20)
        assert time.monotonic() - t0 < 10
    finally:
        released.set()


def test_rank0_failure_mid_step_stops_the_other_ranks(tmp_path, fake_gpu, monkeypatch):
    import speedcore

    _hf("llama", tmp_path)
    from speedcore.engine.llm import LLM

    tp = LLM(str(tmp_path), tensor_parallel_size=2, _tp_backend="loopback", **ENGINE_KW)
    real = speedcore.silu_and_mul

    def fails_on_rank0(x, **k):
        if threading.current_thread() is threading.main_thread():
            raise FloatingPointError("rank 0's kernel failed")
        return real(x, **k)

    monkeypatch.setattr(speedcore, "silu_and_mul", fails_on_rank0)
    with pytest.raises(FloatingPointError):
        tp._debug_logits([1, 2, 3, 4, 5], 4)
    assert tp._tp_group.failure.startswith("tensor-parallel rank 0 failed: FloatingPointError")
    for t in tp._tp_group.threads:
        t.join(10)
        assert not t.is_alive()  # rank 1 left its collective instead of waiting for rank 0
    with pytest.raises(RankError, match="rank 0 failed"):
        tp._debug_logits([1, 2, 3, 4, 5], 4)
    tp.close()


def test_ranks_read_only_their_slices(tmp_path, fake_gpu, monkeypatch):
    """Loading at tp = 2: every sharded tensor is read as the rank's rows / columns; whole reads are the norms."""
    _hf("qwen2", tmp_path)
    from speedcore.engine.llm import LLM

    whole, sliced = [], []
    real_read, real_slice = Checkpoint.read, Checkpoint.read_slice

    def read(self, name):
        whole.append(name)
        return real_read(self, name)

    def read_slice(self, name, rows=None, cols=None):
        out = real_slice(self, name, rows, cols)
        if rows is not None or cols is not None:
            sliced.append((name, out.nbytes, self.tensors[name].nbytes))
        return out

    monkeypatch.setattr(Checkpoint, "read", read)
    monkeypatch.setattr(Checkpoint, "read_slice", read_slice)
    tp = LLM(str(tmp_path), tensor_parallel_size=2, _tp_backend="loopback", **ENGINE_KW)
    tp.close()
    assert whole and all(n.endswith("norm.weight") for n in whole)
    assert {n for n, _, _ in sliced} == {n for n in tp.config.weight_shapes() if not n.endswith("norm.weight")}
    per_tensor = {}
    for name, got, full in sliced:  # each rank a part; both parts together: the tensor, once (no KV replication)
        assert got < full, name
        per_tensor[name] = per_tensor.get(name, 0) + got
    assert all(per_tensor[n] == tp.config.weight_shapes()[n][0] * int(np.prod(tp.config.weight_shapes()[n][1:]))
               * 4 for n in per_tensor)  # float32 on disk
