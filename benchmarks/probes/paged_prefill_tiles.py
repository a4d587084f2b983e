"""Same-process A/B of paged_prefill_sm90_kernel tile configurations (BN, stages, consumers, pingpong) at head dim
128 on the bench suite's chunked-prefill cases (Llama-3-8B attention, pages shuffled), against our contiguous
flash_attn_varlen on the same data: for paged_attention._SM90_TILES.  Not a bench suite: not recorded.

    PYTHONPATH=. python3 benchmarks/probes/paged_prefill_tiles.py [--page 16] [--rounds 2]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import speedcore  # noqa: E402
from speedcore import paged_attention as P  # noqa: E402
from speedcore.bench import Bench  # noqa: E402
from paged_prefill import HEAD_DIM, KV_HEADS, prefill_inputs  # noqa: E402

TILES = [(128, 2, 2, True), (128, 3, 2, True), (128, 3, 2, False), (128, 2, 2, False)]


def _set_tile(tile):
    P._SM90_TILES[HEAD_DIM] = tile
    for f in (P.prefill_sm90_config, P._prefill_path):
        f.cache_clear()
    P._PAGED_PLANS.clear()


def case(b, q_len, cached, bs, rounds):
    torch = b.torch
    batch, sk, q, k, v, kc, vc, table, cu_q, cu_k, lens = prefill_inputs(torch, b.device, q_len, cached, bs)
    out, ref = torch.empty_like(q), torch.empty_like(q)
    kf, vf = k.view(-1, KV_HEADS, HEAD_DIM), v.view(-1, KV_HEADS, HEAD_DIM)
    contig = lambda: speedcore.flash_attn_varlen(q, kf, vf, cu_q, cu_k, q_len, sk, causal=True, out=ref)  # noqa
    paged = lambda: speedcore.paged_prefill_attention(q, kc, vc, cu_q, lens, table, q_len, sk, causal=True,  # noqa
                                                      out=out)
    contig()
    res = {t: [] for t in TILES}
    res["contig"] = []
    for _ in range(rounds):
        for t in TILES:
            _set_tile(t)
            res[t].append(b.time_ms(paged))
            err = (out.float() - ref.float()).abs().max().item()
            if not err < 5e-2:
                print(f"  {t}: max error {err} against flash_attn_varlen", flush=True)
        res["contig"].append(b.time_ms(contig))
    _set_tile(TILES[0])
    best = {n: min(x) for n, x in res.items()}
    print(f"q{q_len} cached{cached} bs{bs}: contig {best['contig'] * 1e3:.1f} us; " + "; ".join(
        f"{t} {best[t] * 1e3:.1f} us {best['contig'] / best[t]:.3f}x" for t in TILES), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    b = Bench()
    for q_len in (512, 2048):
        for cached in (0, 4096, 16384):
            case(b, q_len, cached, a.page, a.rounds)


if __name__ == "__main__":
    main()
