"""The LLM request loop without a GPU: a fake runner (scripted logits) and NumPy in place of CuPy."""
import numpy as np
import pytest

from speedcore.engine.config import parse_config
from speedcore.engine.llm import LLM
from speedcore.engine.sampler import SampleResult
from speedcore.engine.sampling_params import SamplingParams

V = 64
CFG = parse_config(dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, vocab_size=V, eos_token_id=2))


class FakeRunner:
    """Logits that favour next = f(sequence): by default (last token + 1) % V, with (next + 1) second best."""

    def __init__(self, next_token=None):
        self.next_token = next_token or (lambda seq: (seq.token_ids[-1] + 1) % V)
        self.steps = []

    def run(self, batch, logits_all=False):
        self.steps.append((batch.num_decode, list(batch.num_tokens)))
        rows = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.num_computed_tokens + n == len(seq):
                row = np.zeros(V, np.float32)
                t = self.next_token(seq)
                row[t], row[(t + 1) % V] = 10.0, 5.0
                rows.append(row)
        return np.stack(rows) if rows else np.zeros((0, V), np.float32)

    def close(self):
        pass


def greedy(logits, params, seeds, steps):
    return SampleResult(np.argmax(logits, axis=1).astype(np.int64), None)


def make(runner=None, **kw):
    return LLM._with_runner(CFG, runner or FakeRunner(), array_module=np, sample=greedy, **kw)


def test_generate_many_prompts_in_order():
    llm = make(max_num_seqs=3, max_num_batched_tokens=8)
    prompts = [[10 + i] * (3 + i) for i in range(7)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    for i, o in enumerate(outs):
        assert o.finished and o.outputs[0].finish_reason == "length" and o.error is None
        assert o.outputs[0].token_ids == [11 + i, 12 + i, 13 + i, 14 + i]
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert len(m.token_times) == 4
    assert any(nd and len(n) > nd for nd, n in llm.runner.steps)  # decodes mixed with prefill chunks
    assert max(sum(n) for _, n in llm.runner.steps) <= 8


def test_bad_requests_fail_alone():
    llm = make(max_model_len=16)
    outs = llm.generate([[5, 6], [], [1] * 16, [3, V + 1], "text"], SamplingParams(max_tokens=2, ignore_eos=True),
                        use_tqdm=False)
    assert outs[0].error is None and outs[0].outputs[0].token_ids == [7, 8]
    assert "empty" in outs[1].error and outs[1].outputs[0].finish_reason == "error"
    assert "max_model_len 16" in outs[2].error
    assert "token ids must lie in" in outs[3].error
    assert "tokenizer" in outs[4].error
    assert not llm.scheduler.has_unfinished() and llm.block_manager.num_free_blocks == 64


def test_eos_min_tokens_stop_token_ids_and_max_model_len():
    llm = make(runner=FakeRunner(lambda seq: 2), max_model_len=12)  # always proposes EOS (id 2), then 3
    o, = llm.generate([[9, 9]], SamplingParams(max_tokens=8), use_tqdm=False)
    assert o.outputs[0].token_ids == [2] and o.outputs[0].finish_reason == "stop"
    o, = llm.generate([[9, 9]], SamplingParams(max_tokens=8, min_tokens=3), use_tqdm=False)
    assert o.outputs[0].token_ids == [3, 3, 3, 2]
    o, = llm.generate([[9, 9]], SamplingParams(max_tokens=8, stop_token_ids=[3], ignore_eos=True, min_tokens=0),
                      use_tqdm=False)
    assert o.outputs[0].token_ids == [2, 2, 2, 2, 2, 2, 2, 2]  # EOS ignored; 3 never chosen
    o, = llm.generate([[9] * 10], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(o.outputs[0].token_ids) == 2 and o.outputs[0].finish_reason == "length"


def test_preemption_gives_the_same_tokens():
    prompts = [[20 + i] * 6 for i in range(4)]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    roomy = make(num_blocks=64, max_num_seqs=4).generate(prompts, sp, use_tqdm=False)
    tight = make(num_blocks=12, max_num_seqs=4)
    outs = tight.generate(prompts, sp, use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]


def test_prefix_cache_hits_are_reported():
    llm = make(num_blocks=64)
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate([[7] * 13], sp, use_tqdm=False)
    o, = llm.generate([[7] * 13], sp, use_tqdm=False)
    assert o.metrics.num_cached_tokens == 12 and o.outputs[0].token_ids == [8]


def test_stop_strings_and_stream(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from speedcore.engine.tokenizer import Tokenizer

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world 😀 fox"] * 10, trainers.BpeTrainer(
        vocab_size=V, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:0], special_tokens=["<s>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    t = Tokenizer(str(tmp_path))
    script = t.encode("hello 😀 world fox", add_special_tokens=False)
    assert max(script) < V
    runner = FakeRunner(lambda seq: script[seq.num_output_tokens % len(script)])
    llm = make(runner=runner, tokenizer=t)
    o, = llm.generate(["fox"], SamplingParams(max_tokens=len(script), ignore_eos=True), use_tqdm=False)
    assert o.outputs[0].text == "hello 😀 world fox" and o.prompt == "fox"
    o, = llm.generate(["fox"], SamplingParams(max_tokens=50, stop="world", ignore_eos=True), use_tqdm=False)
    assert o.outputs[0].text == "hello 😀 " and o.outputs[0].stop_reason == "world"
    deltas = list(llm.generate_stream(["fox", "hello"], SamplingParams(max_tokens=len(script), ignore_eos=True)))
    for i in (0, 1):
        mine = [d for d in deltas if d.index == i]
        assert "".join(d.text for d in mine) == "hello 😀 world fox" and mine[-1].finished
        assert all("\ufffd" not in d.text for d in mine)


def test_cli_parsers_and_roofline():
    from speedcore.cli import main  # noqa: F401  (the hook imports)
    from speedcore.engine.cli import roofline
    from speedcore.engine.config import preset_config

    cfg = preset_config("llama-3-8b")
    w = cfg.num_params() * 2
    r = roofline(cfg, w, 2, [1], [256], 1)  # batch-1 decode: 256 steps, each reading the weights
    assert r["min_steps"] == 256 and r["memory_s"] == pytest.approx(256 * w / 4.3e12, rel=0.01)
    assert r["roofline_s"] == r["memory_s"] > r["compute_s"]
    with pytest.raises(SystemExit):
        main(["bench-engine", "--preset", "tiny", "--model", "x"])  # mutually exclusive


def test_step_stats():
    llm = make(max_num_seqs=3, max_num_batched_tokens=8)
    llm.generate([[1] * 10, [2] * 3], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert set(llm.step_stats) <= {"prefill", "mixed", "decode"} and "decode" in llm.step_stats
    assert sum(v[1] for v in llm.step_stats.values()) == 13 + 2 * 2  # every prompt token, then the decodes
    assert "decode" in llm.step_report()


def test_step_stats_count_garbage_collection_inside_steps():
    import gc

    llm = make(max_num_seqs=3, max_num_batched_tokens=8)
    inner = llm.runner.run

    def run_with_a_collection(batch):
        gc.collect()  # a full collection inside the step's forward
        return inner(batch)

    llm.runner.run = run_with_a_collection
    llm.generate([[1] * 3], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    gc_s = sum(v[6] for v in llm.step_stats.values())
    forward_s = sum(v[3] for v in llm.step_stats.values())
    assert 0 < gc_s <= forward_s
    assert "(gc)" in llm.step_report()


def test_settle_heap_freezes_and_makes_full_collections_rarer():
    import gc

    from speedcore.engine.llm import settle_heap

    old = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        junk = [[i] for i in range(1000)]  # tracked objects made "at start-up"
        settle_heap()
        assert gc.get_freeze_count() >= len(junk)
        assert gc.get_threshold() == (700, 10, 100)
        gc.set_threshold(700, 10, 0)  # the collector's full collections off: left so
        settle_heap()
        assert gc.get_threshold() == (700, 10, 0)
    finally:
        gc.unfreeze()
        gc.set_threshold(*old)


def test_prompt_ids_as_an_int64_array_are_checked_like_a_list():
    import array

    llm = make(max_num_seqs=2, max_num_batched_tokens=8)
    ok = llm._add(0, {"prompt": None, "prompt_token_ids": array.array("q", [1, 2, 3])}, SamplingParams(max_tokens=2))
    assert ok.error is None and ok.seq.token_ids == [1, 2, 3] and type(ok.seq.token_ids[0]) is int
    bad = llm._add(1, {"prompt": None, "prompt_token_ids": array.array("q", [1, -4])}, SamplingParams(max_tokens=2))
    assert bad.error is not None and "-4..1" in bad.error
    empty = llm._add(2, {"prompt": None, "prompt_token_ids": array.array("q")}, SamplingParams(max_tokens=2))
    assert empty.error == "the prompt is empty"
