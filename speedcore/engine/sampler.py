"""Token sampling on the GPU (CuPy): greedy argmax, temperature, top-k, top-p, min-p, seeded per request.

Random draws use the Gumbel-max trick with noise from a counter-based hash of (request seed, output index,
token id): a request's draws depend on its seed and position only, not on the batch it shares or the engine's
history, so the same seed gives the same tokens (and no generator state lives on the GPU).
"""
from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Sequence

import numpy as np

from .sampling_params import SamplingParams

_gumbel_kernel = None


def _gumbel(seeds, steps, vocab: int):
    import cupy

    global _gumbel_kernel
    if _gumbel_kernel is None:
        _gumbel_kernel = cupy.ElementwiseKernel(
            "uint64 seed, uint64 step, int64 vocab", "float32 g",
            """
            unsigned long long z = seed ^ (step * 0x9E3779B97F4A7C15ULL)
                                 ^ ((unsigned long long)(i % vocab) * 0xC2B2AE3D27D4EB4FULL);
            for (int r = 0; r < 2; ++r) {  // splitmix64 finalizer, twice
                z += 0x9E3779B97F4A7C15ULL;
                z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
                z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
                z ^= z >> 31;
            }
            float u = ((float)(z >> 40) + 0.5f) * (1.0f / 16777216.0f);  // in (0, 1)
            g = -logf(-logf(u));
            """, "speedcore_engine_gumbel")
    out = cupy.empty((seeds.shape[0], vocab), dtype=cupy.float32)
    return _gumbel_kernel(seeds[:, None], steps[:, None], np.int64(vocab), out)


@lru_cache(maxsize=None)
def _chunks(vocab: int) -> int:
    """The number of equal chunks argmax_rows splits a row of ``vocab`` into: a divisor of it in [64, 1024]
    (Llama 3's 128256 = 256 x 501), 0 when there is none (the row is padded instead)."""
    for c in range(256, 1025):
        if vocab % c == 0:
            return c
    for c in range(255, 63, -1):
        if vocab % c == 0:
            return c
    return 0


def argmax_rows(x, xp):
    """``xp.argmax(x, axis=1)`` of a (rows, V) float32 array, its first index of the maximum (or of the first NaN),
    in two passes when there are few rows: CuPy's one-pass reduction gives each row to one thread block, 61 us
    for a row of 128256 on an H200, and the two passes (chunks of a row, then the chunks' maxima) take a few."""
    rows, vocab = x.shape
    if rows >= 32 or vocab < 8192:
        return xp.argmax(x, axis=1)
    c = _chunks(vocab)
    if c == 0:  # pad the row with -inf up to 256 equal chunks
        c = 256
        width = -(-vocab // c)
        padded = xp.full((rows, c * width), -xp.inf, dtype=x.dtype)
        padded[:, :vocab] = x
        x = padded
    parts = x.reshape(rows, c, -1)
    inner = xp.argmax(parts, axis=2)                                  # (rows, c): each chunk's first maximum
    best = xp.take_along_axis(parts, inner[:, :, None], axis=2)[:, :, 0]
    chunk = xp.argmax(best, axis=1)                                   # the first chunk holding the row's maximum
    return chunk * parts.shape[2] + xp.take_along_axis(inner, chunk[:, None], axis=1)[:, 0]


class SampleResult:
    def __init__(self, tokens: np.ndarray, logprobs: Optional[List]):
        self.tokens = tokens  # (S,) int64
        self.logprobs = logprobs  # per row: None or (sampled logprob, [(token, logprob), ...top-n])


def sample(logits, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]) -> SampleResult:
    """One token per row of float32 ``logits`` (S, V) (rows already masked for min_tokens etc.)."""
    import cupy

    S, V = logits.shape
    tokens = argmax_rows(logits, cupy)
    rows = [r for r, p in enumerate(params) if not p.greedy]
    if rows:
        idx = cupy.asarray(np.array(rows, np.int64))
        sub = [params[r] for r in rows]
        temp = cupy.asarray(np.array([p.temperature for p in sub], np.float32))
        lg = logits[idx] / temp[:, None]
        thr = cupy.full((len(rows),), -cupy.inf, dtype=cupy.float32)
        top_k = np.array([p.top_k if 0 < p.top_k < V else V for p in sub], np.int64)
        top_p = np.array([p.top_p for p in sub], np.float32)
        if (top_k < V).any() or (top_p < 1).any():
            srt = -cupy.sort(-lg, axis=1)  # descending
            ar = cupy.arange(len(rows))
            kk = cupy.asarray(top_k)
            thr = cupy.maximum(thr, srt[ar, kk - 1])
            if (top_p < 1).any():  # nucleus of the top-k-renormalized distribution
                masked = cupy.where(cupy.arange(V)[None, :] < kk[:, None], srt, -cupy.inf)
                prob = cupy.exp(masked - masked[:, :1])
                prob /= prob.sum(axis=1, keepdims=True)
                before = cupy.cumsum(prob, axis=1) - prob
                count = cupy.maximum((before < cupy.asarray(top_p)[:, None]).sum(axis=1), 1)
                thr = cupy.maximum(thr, srt[ar, count - 1])
        min_p = np.array([p.min_p for p in sub], np.float32)
        if (min_p > 0).any():
            with np.errstate(divide="ignore"):
                log_min_p = cupy.asarray(np.log(min_p))
            thr = cupy.maximum(thr, lg.max(axis=1) + log_min_p)
        lg = cupy.where(lg >= thr[:, None], lg, -cupy.inf)
        seed_arr = cupy.asarray(np.array([seeds[r] % (1 << 64) for r in rows], np.uint64))
        step_arr = cupy.asarray(np.array([steps[r] for r in rows], np.uint64))
        tokens[idx] = argmax_rows(lg + _gumbel(seed_arr, step_arr, V), cupy)
    tokens_h = tokens.get()
    lp_rows = [r for r, p in enumerate(params) if p.logprobs is not None]
    logprobs = None
    if lp_rows:
        logprobs = [None] * S
        idx = cupy.asarray(np.array(lp_rows, np.int64))
        lg = logits[idx]
        lse = cupy.log(cupy.exp(lg - lg.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True)) + lg.max(
            axis=1, keepdims=True)
        lsm = lg - lse
        chosen = lsm[cupy.arange(len(lp_rows)), cupy.asarray(tokens_h[lp_rows])].get()
        n_top = max(params[r].logprobs for r in lp_rows)
        top_idx = cupy.argsort(-lsm, axis=1)[:, :n_top] if n_top else None
        top_val = cupy.take_along_axis(lsm, top_idx, axis=1).get() if n_top else None
        top_idx = top_idx.get() if n_top else None
        for j, r in enumerate(lp_rows):
            n = params[r].logprobs
            logprobs[r] = (float(chosen[j]), [(int(top_idx[j, t]), float(top_val[j, t])) for t in range(n)])
    return SampleResult(tokens_h.astype(np.int64), logprobs)
