"""Where the paged decode kernel's time goes: kernel durations (torch profiler) of ours and cuDNN's, and a
per-CTA timeline (%globaltimer, kernel compiled with -DDECODE_TRACE)."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from speedcore import decode as D  # noqa: E402
from speedcore import _arrays as A  # noqa: E402
from speedcore._compile import Kernel  # noqa: E402
from speedcore._launch import launch  # noqa: E402

SHAPES = [(64, 4096, 32, 8, 128), (8, 32768, 32, 8, 128), (1, 131072, 32, 8, 128)]
# $DIAG_SHAPES: a subset, as batchxseqlen (e.g. "1x131072"); $DECODE_LAYOUT=ident: pages in order instead of shuffled
if os.environ.get("DIAG_SHAPES"):
    SHAPES = [s for s in SHAPES if f"{s[0]}x{s[1]}" in os.environ["DIAG_SHAPES"].split(",")]


def pct(x, ps=(0, 10, 50, 90, 100)):
    return " ".join(f"p{p}={np.percentile(x, p):.2f}" for p in ps)


def paged_caches(torch, k, v, perm):
    """k, v (batch, kv_heads, seqlen, hd) as paged caches (num_pages, 16, kv_heads, hd), logical page i of the
    batch's sequences at physical page perm[i]; returns the caches and the block table."""
    batch, kvh, seqlen, hd = k.shape

    def paged(x):
        pages = x.view(batch, kvh, seqlen // 16, 16, hd).permute(0, 2, 3, 1, 4).reshape(-1, 16, kvh, hd)
        out = torch.empty_like(pages)
        out[perm] = pages
        return out

    return paged(k), paged(v), perm.view(batch, -1).int()


def paged_problem(torch, batch, seqlen, heads, kvh, hd):
    """One decode step's data, bf16: q (batch, heads, hd) and contiguous k, v (batch, kvh, seqlen, hd) for the
    SDPA peers; the same K and V in shuffled 16-token pages for ours.  Returns q, k, v, the paged caches, the
    block table, seq_lens, out, the wrapped arguments of speedcore.decode, q as (batch, heads, 1, hd) and the
    K+V bytes."""
    dt = torch.bfloat16
    q = torch.randn(batch, heads, hd, device="cuda", dtype=dt)
    k = torch.randn(batch, kvh, seqlen, hd, device="cuda", dtype=dt)
    v = torch.randn_like(k)
    n = batch * seqlen // 16
    perm = torch.arange(n, device="cuda") if os.environ.get("DECODE_LAYOUT") == "ident" else torch.randperm(n, device="cuda")
    kc, vc, table = paged_caches(torch, k, v, perm)
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    wr = [A.wrap(x, n) for x, n in ((q, "q"), (kc, "k_cache"), (vc, "v_cache"), (table, "block_table"),
                                     (lens, "seq_lens"), (out, "out"))]
    return q, k, v, kc, vc, table, lens, out, wr, q.view(batch, heads, 1, hd), 2 * k.numel() * 2


def contiguous_args(torch, wr, k, v):
    """paged_problem's wrapped arguments with the peers' contiguous k, v (batch, kv_heads, seqlen, hd) as the cache:
    views (batch, seqlen, kv_heads, hd), one page per sequence, so each head's rows are read contiguously."""
    batch = k.shape[0]
    out = list(wr)
    out[1] = A.wrap(k.permute(0, 2, 1, 3), "k_cache")
    out[2] = A.wrap(v.permute(0, 2, 1, 3), "v_cache")
    out[3] = A.wrap(torch.arange(batch, dtype=torch.int32, device="cuda").view(batch, 1), "block_table")
    return out


def ours_and_cudnn(torch, wr, q4, k, v):
    """Callables running our paged decode (default launch) and SDPA's cuDNN backend on the same problem."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kvh = q4.shape[1], k.shape[1]

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=heads != kvh)

    return (lambda: D._paged_decode(*wr, None, 0.0, -1, False)), cudnn


def main():
    from speedcore.bench import Bench

    b = Bench(quick=False)
    torch = b.torch
    for batch, seqlen, heads, kvh, hd in SHAPES:
        q, k, v, kc, vc, table, lens, out, wr, q4, nbytes = paged_problem(torch, batch, seqlen, heads, kvh, hd)
        ours, cudnn = ours_and_cudnn(torch, wr, q4, k, v)

        case = f"B{batch} S{seqlen} H{heads}/{kvh}"
        ev = {n: b.time_ms(f) * 1e3 for n, f in (("ours", ours), ("cudnn", cudnn))}
        print(f"{case}: event-timed us: " + " ".join(f"{n}={t:.1f} ({nbytes / t / 1e6:.3f} TB/s)" for n, t in ev.items()),
              flush=True)
        # kernel durations and gaps from the profiler
        from torch.profiler import ProfilerActivity, profile

        for name, fn in (("ours", ours), ("cudnn", cudnn)):
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(8):
                    b._flush.max()
                    torch.cuda._sleep(200_000)
                    fn()
                torch.cuda.synchronize()
            kern = [e for e in prof.events() if e.device_type.name == "CUDA"]
            kern.sort(key=lambda e: e.time_range.start)
            # group: after each flush reduction, the kernels of fn
            groups, cur = [], None
            for e in kern:
                n = e.name
                if "reduce" in n.lower() or "sleep" in n.lower() or "spin" in n.lower():
                    if cur:
                        groups.append(cur)
                    cur = []
                    continue
                if cur is not None:
                    cur.append(e)
            if cur:
                groups.append(cur)
            spans, lines = [], []
            for g in groups[1:]:
                if not g:
                    continue
                t0 = g[0].time_range.start
                spans.append(g[-1].time_range.end - t0)
                lines.append(" | ".join(f"{e.name[:40]}@{e.time_range.start - t0:.1f}+{e.time_range.end - e.time_range.start:.1f}"
                                        for e in g))
            print(f"  {name}: profiler span us {pct(spans, (0, 50, 100))}; e.g. {lines[len(lines) // 2] if lines else ''}",
                  flush=True)
        # per-CTA timeline of ours
        p = D._decode_plan(*wr, None, 0.0, -1, None)
        kt = Kernel(D.SOURCE, p["kernel"].name, options=("-DDECODE_TRACE",))
        grid = p["cfg"].grid[0]
        trace = torch.zeros(grid * 8, dtype=torch.int64, device="cuda")
        splits = p["splits"]
        ws = torch.empty(p["partial_floats"] + batch * heads * splits, dtype=torch.float32, device="cuda")
        part_o, part_l = (ws.data_ptr(), ws.data_ptr() + 4 * p["partial_floats"]) if splits > 1 else (0, 0)
        stream = A.stream_of(wr[0])
        rows = []
        for it in range(5):
            b._flush.max()
            torch.cuda._sleep(200_000)
            launch(kt, p["cfg"], (out.data_ptr(), trace.data_ptr(), part_o, part_l, q.data_ptr(), kc.data_ptr(),
                                  vc.data_ptr(), table.data_ptr(), lens.data_ptr()) + p["scalars"], device=0,
                   stream=stream)
            torch.cuda.synchronize()
            rows.append(trace.view(grid, 8).cpu().numpy().astype(np.float64))
        tr = rows[2]
        t0 = tr[:, 0].min()
        st, fi, le, ex = (tr[:, i] - t0 for i in range(4))
        res = np.unique(np.diff(np.unique(tr[:, 0])))
        print(f"  trace ({grid} CTAs, {splits} splits, timer step {res[:3] if len(res) else '-'} ns), us:", flush=True)
        print(f"    start      {pct(st / 1e3)}")
        print(f"    first data {pct((fi - st) / 1e3)} (after start)")
        print(f"    loop end   {pct(le / 1e3)}")
        print(f"    epilogue   {pct((ex - le) / 1e3)}")
        print(f"    exit       {pct(ex / 1e3)}; span {ex.max() / 1e3:.1f} us = {nbytes / ex.max() / 1e3:.3f} TB/s")
        dur = (ex - st) / 1e3
        print(f"    CTA time   {pct(dur)}")
        # aggregate bandwidth over time: bytes per CTA assumed uniform over its loop
        per_cta = nbytes / grid
        edges = np.arange(0, ex.max() / 1e3 + 2, 2.0)
        bw = []
        for a, c in zip(edges[:-1], edges[1:]):
            ov = np.clip(np.minimum(le / 1e3, c) - np.maximum(fi / 1e3, a), 0, None)
            rate = per_cta / np.maximum((le - fi) / 1e3, 1e-3)  # bytes per us
            bw.append((ov * rate).sum() / (c - a) / 1e6)
        print("    TB/s per 2us bin: " + " ".join(f"{x:.2f}" for x in bw[:6]) + " ... " +
              " ".join(f"{x:.2f}" for x in bw[-8:]), flush=True)
        print(f"    active at end: loop ends in last 10 us before max: "
              f"{np.histogram(le / 1e3, bins=np.arange(le.max() / 1e3 - 10, le.max() / 1e3 + 1.01, 1.0))[0].tolist()}")
        del kc, vc, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
