"""A CPU stand-in for the GPU engine: the engine's own request loop, scheduler and block manager
(``LLM._with_runner``) over a scripted runner, NumPy in place of CuPy, and a word-per-token tokenizer.

The rule: after token ``t`` comes ``t + 1`` (after a special token comes ``FIRST_WORD``), and the word below the
first special id is followed by EOS.  So the prompt "t5 t6" continues " t7 t8 t9 ...", and a chat reply starts
" t1 t2 ...".  ``step_delay`` seconds of sleep per engine step make streams slow enough to cancel mid-way.
"""
from __future__ import annotations

import re
import time
import zlib
from typing import Dict, List, Optional, Sequence

import numpy as np

ROLES = ("system", "user", "assistant", "tool")
FIRST_WORD = 1  # the first token of a reply to a prompt that ends in a special token


class NumberTokenizer:
    """Token id ``i`` is the word ``t{i}``; the top ids of the vocabulary are special: ``<s>``, ``</s>`` and one
    ``<|role|>`` marker per chat role.  Any other word encodes to a fixed id from its CRC.  Duck-types the
    engine's Tokenizer (encode, decode, apply_chat_template, eos/bos ids), so the engine's incremental detokenizer
    and stop strings work on it.  It also lets the random-weight presets serve text ("t17 t4 ..." in and out)."""

    _word = re.compile(r"t(\d+)\Z")

    def __init__(self, vocab_size: int, *, bos_token_id: Optional[int] = None, eos_token_id: Optional[int] = None):
        if vocab_size < 16:
            raise ValueError(f"vocab_size: expected >= 16, got {vocab_size}")
        self._vocab_size = int(vocab_size)
        top = self._vocab_size - 1
        self.bos_token_id = top if bos_token_id is None else int(bos_token_id)
        self.eos_token_id = top - 1 if eos_token_id is None else int(eos_token_id)
        self.role_token_ids = {r: top - 2 - i for i, r in enumerate(ROLES)}
        self.names: Dict[int, str] = {self.bos_token_id: "<s>", self.eos_token_id: "</s>"}
        self.names.update({i: f"<|{r}|>" for r, i in self.role_token_ids.items()})
        self.ids = {name: i for i, name in self.names.items()}
        self.special_ids = set(self.names)
        self._words = None
        self.first_special = min(self.special_ids)
        self.chat_template = "number-tokenizer"  # rendered in Python (apply_chat_template), not jinja
        self.bos_token, self.eos_token = "<s>", "</s>"

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _word_id(self, w: str) -> int:
        i = self.ids.get(w)
        if i is not None:
            return i
        m = self._word.match(w)
        if m and int(m.group(1)) < self._vocab_size:
            return int(m.group(1))
        i = zlib.crc32(w.encode("utf-8", "surrogatepass")) % self._vocab_size
        while i in self.special_ids:
            i = (i + 1) % self._vocab_size
        return i

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        ids = [self.bos_token_id] if add_special_tokens else []
        return ids + [self._word_id(w) for w in text.split()]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        names, words = self.names, self._words
        if words is None:  # every id's word, once (the engine decodes a short window twice per token)
            words = self._words = [names.get(i, f"t{i}") for i in range(self._vocab_size)]
        n = len(words)
        return " ".join([words[i] if 0 <= i < n else f"t{i}" for i in ids
                         if not (skip_special_tokens and i in names)])

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, chat_template=None,
                            **kwargs) -> str:
        parts = ["<s>"]
        for m in messages:
            role = m.get("role")
            if role not in self.role_token_ids:
                raise ValueError(f"messages: role {role!r} is not one of {', '.join(ROLES)}")
            parts += [f"<|{role}|>", m.get("content") or ""]
        if add_generation_prompt:
            parts.append("<|assistant|>")
        return " ".join(p for p in parts if p)


class CountingRunner:
    """The model of the stand-in: logits that make ``next_token`` the argmax (score 10) and the token after it
    the second best (score 5), so sampled runs and logprobs have something to show."""

    def __init__(self, tokenizer: NumberTokenizer, step_delay: float = 0.0):
        self.tok = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.step_delay = float(step_delay)
        self.num_steps = 0
        self.num_tokens = 0

    def next_token(self, last: int) -> int:
        if last in self.tok.special_ids:
            return FIRST_WORD
        return last + 1 if last + 1 < self.tok.first_special else self.tok.eos_token_id

    def run(self, batch, logits_all: bool = False):
        if self.step_delay:
            time.sleep(self.step_delay)
        self.num_steps += 1
        self.num_tokens += batch.total_tokens
        V = self.vocab_size
        rows = [self.next_token(seq.token_ids[-1]) for seq, n in zip(batch.seqs, batch.num_tokens)
                if seq.num_computed_tokens + n == len(seq)]
        logits = np.zeros((len(rows), V), np.float32)
        r = np.arange(len(rows))
        t = np.asarray(rows, np.int64)
        logits[r, (t + 1) % V] = 5.0
        logits[r, t] = 10.0
        return logits

    def close(self) -> None:
        pass


def numpy_sample(logits, params, seeds, steps):
    """The engine sampler's contract on NumPy: argmax for temperature 0, else Gumbel-max over the top-k of
    logits / temperature with noise from (seed, step); logprobs of the untempered distribution."""
    from ..engine.sampler import SampleResult

    S, V = logits.shape
    tokens = logits.argmax(axis=1).astype(np.int64)
    for r, p in enumerate(params):
        if p.greedy:
            continue
        lg = logits[r] / p.temperature
        if 0 < p.top_k < V:
            kth = np.partition(lg, V - p.top_k)[V - p.top_k]
            lg = np.where(lg >= kth, lg, -np.inf)
        rng = np.random.default_rng([int(seeds[r]) % (1 << 64), int(steps[r])])
        tokens[r] = int(np.argmax(lg + rng.gumbel(size=V)))
    logprobs = None
    if any(p.logprobs is not None for p in params):
        logprobs = [None] * S
        mx = logits.max(axis=1, keepdims=True)
        lsm = logits - (np.log(np.exp(logits - mx).sum(axis=1, keepdims=True)) + mx)
        for r, p in enumerate(params):
            if p.logprobs is None:
                continue
            top = np.argsort(-lsm[r], kind="stable")[:p.logprobs]
            logprobs[r] = (float(lsm[r, tokens[r]]), [(int(t), float(lsm[r, t])) for t in top])
    return SampleResult(tokens, logprobs)


def make_fake_llm(*, vocab_size: int = 1000, max_model_len: int = 512, max_num_seqs: int = 64,
                  max_num_batched_tokens: int = 2048, block_size: int = 16, num_blocks: Optional[int] = None,
                  step_delay: float = 0.0, enable_prefix_caching: bool = True, seed: int = 0):
    """A ``speedcore.LLM`` on the CPU whose "model" counts (see the module doc); ``num_blocks`` defaults to
    enough KV blocks for ``max_num_seqs`` sequences of ``max_model_len`` tokens."""
    from ..engine.config import parse_config
    from ..engine.llm import LLM

    tok = NumberTokenizer(vocab_size)
    cfg = parse_config(dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                            num_hidden_layers=1, num_attention_heads=4, vocab_size=vocab_size,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            max_position_embeddings=max_model_len), "fake engine")
    if num_blocks is None:
        num_blocks = max_num_seqs * -(-max_model_len // block_size) + 1
    llm = LLM._with_runner(cfg, CountingRunner(tok, step_delay), array_module=np, tokenizer=tok,
                           num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           enable_prefix_caching=enable_prefix_caching, seed=seed, sample=numpy_sample)
    llm.close = lambda *args, **kwargs: None  # no GPU memory to give back (LLM.close frees CuPy's pools)
    return llm


def attach_number_tokenizer(llm) -> NumberTokenizer:
    """Give a tokenizer-less engine (a random-weight preset) the word-per-token tokenizer, so that text prompts,
    chat and text output work; returns it."""
    cfg = llm.config
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    tok = NumberTokenizer(cfg.vocab_size, bos_token_id=cfg.bos_token_id, eos_token_id=eos)
    llm.tokenizer = tok
    return tok
