"""Tuning sweep for the paged decode kernel (not a bench suite: prints a table).

python benchmarks/_decode_tune.py [rounds]  -- at each shape, torch SDPA's cuDNN (and FLASH) backend and our kernel
in several configurations (warps, stages, units per CTA, fused merge, even splits) and split counts, interleaved
round by round, in the same process and on the same data (ours on a shuffled paged copy, block size 16).  Every
variant's output is checked against cuDNN's after its timing runs.  ``v1`` is paged_decode_kernel (the default),
the others paged_decode_v2_kernel configurations (speedcore.decode.DECODE_V2).
"""
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from speedcore import decode as D  # noqa: E402
from speedcore import _arrays as A  # noqa: E402
from speedcore._compile import compile_kernel  # noqa: E402

# name -> None for paged_decode_kernel (the default), or paged_decode_v2_kernel's (warps, stages, units per CTA,
# fused merge, even splits, one-page tiles (FAST), lazy rescale)
VARIANTS = {
    "v1": None,
    "v2": (4, 3, 1, False, True, True, True),
    "v2fuse": (4, 3, 1, True, True, True, True),
    "v2nolazy": (4, 3, 1, False, True, True, False),
    "v2nofast": (4, 3, 1, False, True, False, True),
    "w4s2": (4, 2, 1, False, True, True, True),
    "w6s2": (6, 2, 1, False, True, True, True),
    "u2": (8, 3, 2, False, True, True, True),
    "u8": (8, 3, 8, False, True, True, True),
}
# (batch, seqlen, heads, kv_heads, head_dim) -> {variant: split counts (None: the heuristic's)}
SWEEP = {
    (64, 4096, 32, 8, 128): {"v1": [None], "v2": [1, 2, 4], "v2fuse": [1, 2], "v2nolazy": [None], "v2nofast": [None],
                             "w4s2": [1, 2, 3], "w6s2": [1, 2], "u2": [1, 2], "u8": [4, 8]},
    (8, 32768, 32, 8, 128): {"v1": [None], "v2": [4, 8, 16], "v2fuse": [4, 8], "v2nolazy": [None],
                             "v2nofast": [None], "w4s2": [6, 12], "w6s2": [4, 8], "u2": [4, 8], "u8": [16, 33]},
    (1, 131072, 32, 8, 128): {"v1": [None], "v2": [33, 66], "v2fuse": [33], "v2nolazy": [None], "v2nofast": [None],
                              "w4s2": [49, 99], "w6s2": [33, 66], "u2": [33, 66]},
    (256, 1024, 32, 32, 128): {"v1": [None], "v2": [1], "v2nolazy": [None], "v2nofast": [None], "w4s2": [1],
                               "w6s2": [1], "u2": [1], "u8": [1]},
}
_FAST_PAGES = D.fast_pages


def use(name):
    """Point the module at one variant (kernel, config, merge mode, split rule; plans and heuristics recomputed)."""
    cfg = VARIANTS[name]
    D.DECODE_V2 = cfg is not None
    D.fast_pages = _FAST_PAGES
    if cfg is not None:
        w, s, upc, fuse, even, fast, lazy = cfg
        D.V2_CONFIGS[128] = (w, s, upc)
        D.V2_FUSED_MERGE, D.V2_EVEN_SPLITS, D.V2_LAZY_RESCALE = fuse, even, lazy
        D.fast_pages = _FAST_PAGES if fast else (lambda block_size: False)
    D.decode_config_v2.cache_clear()
    D.decode_num_splits.cache_clear()
    D._DECODE_PLANS.clear()


def variant_kernels():
    ks = []
    for name, cfg in VARIANTS.items():
        use(name)
        ks.append(D._attn_kernel_v2("bfloat16", 128, D.fast_pages(16)) if cfg else D._attn_kernel("bfloat16", 128))
    ks.append(D._merge_kernel("bfloat16", 128))
    use("v1")
    return ks


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    t0 = time.time()
    ks = variant_kernels()
    with ThreadPoolExecutor(8) as ex:
        for k, c in zip(ks, ex.map(lambda k: compile_kernel(k, "sm_90"), ks)):
            r = c.resources
            print(f"compiled {k.name} regs={r['registers']} spill={r['spill_stores']}", flush=True)
    print(f"compile {time.time() - t0:.1f}s", flush=True)
    from speedcore.bench import Bench
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = Bench(quick=True)
    torch = b.torch
    F = torch.nn.functional
    summary = []
    for (batch, seqlen, heads, kvh, hd), plan in SWEEP.items():
        dt = torch.bfloat16
        q = torch.randn(batch, heads, hd, device="cuda", dtype=dt)
        k = torch.randn(batch, kvh, seqlen, hd, device="cuda", dtype=dt)
        v = torch.randn_like(k)
        nblocks = batch * seqlen // 16
        perm = torch.randperm(nblocks, device="cuda")

        def paged(x):
            pages = x.view(batch, kvh, seqlen // 16, 16, hd).permute(0, 2, 3, 1, 4).reshape(-1, 16, kvh, hd)
            out = torch.empty_like(pages)
            out[perm] = pages
            return out

        kc, vc = paged(k), paged(v)
        table = perm.view(batch, -1).int()
        lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        nbytes = 2 * k.numel() * 2
        wr = [A.wrap(x, n) for x, n in ((q, "q"), (kc, "k_cache"), (vc, "v_cache"), (table, "block_table"),
                                         (lens, "seq_lens"), (out, "out"))]
        q4 = q.view(batch, heads, 1, hd)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=heads != kvh)  # noqa: E731
            ref = cudnn().view_as(q).float()
        results = {}
        for _ in range(rounds):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                results.setdefault("cudnn", []).append(nbytes / b.time_ms(cudnn) / 1e9)
            try:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    fl = lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=heads != kvh)  # noqa: E731
                    results.setdefault("flash", []).append(nbytes / b.time_ms(fl) / 1e9)
            except Exception as e:  # noqa: BLE001
                print(f"  flash unavailable: {str(e)[:80]}", flush=True)
            for name, splits_list in plan.items():
                use(name)
                default = D._plan_paged_decode(*wr, None, 0.0, -1, sms=132, smem_per_sm=233472)["num_splits"]
                for ns in splits_list:
                    ns = ns or default
                    fn = lambda: D._paged_decode(*wr, None, 0.0, -1, False, num_splits=ns)  # noqa: E731
                    out.fill_(float("nan"))
                    ms = b.time_ms(fn)
                    torch.cuda.synchronize()
                    err = (out.float() - ref).abs().max().item()
                    if not err < 5e-2:
                        print(f"  WRONG {name} s{ns}: max err {err}", flush=True)
                    tag = f"{name}/s{ns}{'*' if ns == default else ''}"
                    results.setdefault(tag, []).append(nbytes / ms / 1e9)
        case = f"B{batch} S{seqlen} H{heads}/{kvh}"
        base = max(results["cudnn"])
        row = " ".join(f"{t}={max(v):.3f}({max(v) / base:.3f})[{min(v):.3f}]" for t, v in results.items())
        print(f"{case}: {row}", flush=True)
        best = sorted(((max(v) / base, t) for t, v in results.items() if t not in ("cudnn", "flash")), reverse=True)
        summary.append(f"{case}: cudnn={base:.3f} TB/s; best " + " ".join(f"{t}={r:.3f}" for r, t in best[:6]))
        del kc, vc, k, v
        torch.cuda.empty_cache()
    print("---- ratios to cuDNN (best of rounds) ----")
    for line in summary:
        print(line)


if __name__ == "__main__":
    main()
