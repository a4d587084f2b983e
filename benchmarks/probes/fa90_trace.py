"""Where the sm_90 attention kernel's time goes, per tile: the kernel compiled with -DFA90_TRACE stamps clock64()
at each phase of each tile (kernels/attention_sm90.cu); this prints the mean phase durations in microseconds.

    PYTHONPATH=. python3 benchmarks/probes/fa90_trace.py [--ab=-DSWITCH[,-DOTHER]]... [--cases=d:causal:seqlen,...]

Each --ab= also times the kernels built with those extra options against the default build, in one process.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import speedcore  # noqa: E402
from speedcore import attention as att  # noqa: E402
from speedcore import _launch  # noqa: E402

ITERS, EVENTS = 256, 12
CASES = [  # (d, causal, seqlen): batch * seqlen = 16k, heads * d = 2048, as the bench
    (128, False, 512), (64, True, 512), (64, True, 2048),
]
CONS = ["tile wait", "q wait", "k0 wait", "first S+sm", "loop", "last PV", "epilogue"]
PROD = ["ring wait", "q_empty wait", "k_empty wait", "loads"]


def kernel_for(dtype, d, causal, s, softcap=False):
    short = s <= att.SM90_SHORT
    cfg = att.flash_attn_sm90_config(d, causal, softcap, short)
    return att._kernel_sm90(dtype, *cfg, softcap), cfg


def trace(b, d, causal, s):
    torch = b.torch
    batch, h = max(1, 16384 // s), 2048 // d
    q, k, v = (torch.randn(batch, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * batch * h * s * s * d / (2 if causal else 1)
    ms_plain = b.time_ms(lambda: speedcore.flash_attn(q, k, v, causal=causal))
    kern, cfg = kernel_for("bfloat16", d, causal, s)
    traced = att.Kernel(kern.source, kern.name, kern.options + ("-DFA90_TRACE",), hopper=True)
    orig = att._kernel_sm90
    att._kernel_sm90 = lambda *a: traced
    try:
        speedcore.flash_attn(q, k, v, causal=causal)  # compile + load
        lk = _launch.get_kernel(traced, 0)
        import cupy

        buf = lk.module.get_global_var("fa90_trace")
        n = 160 * 4 * ITERS * EVENTS
        mem = cupy.cuda.UnownedMemory(int(buf), n * 8, None)
        arr = cupy.ndarray((n,), dtype=cupy.int64, memptr=cupy.cuda.MemoryPointer(mem, 0))
        ms_traced = b.time_ms(lambda: speedcore.flash_attn(q, k, v, causal=causal))
        arr.fill(0)
        torch.cuda.synchronize()
        speedcore.flash_attn(q, k, v, causal=causal)
        torch.cuda.synchronize()
        tr = cupy.asnumpy(arr).reshape(160, 4, ITERS, EVENTS)
    finally:
        att._kernel_sm90 = orig
    if os.environ.get("OUT"):
        np.save(os.path.join(os.environ["OUT"], f"trace_d{d}_{'causal' if causal else 'full'}_s{s}.npy"), tr)
    grid = min(132, (tr[:, 0, ITERS - 2, 0] != 0).sum())
    tr = tr[:grid]
    # cycles per ns from each CTA's clock64 and globaltimer spans (consumer end stamps are on warpgroup 1)
    st_c, st_g = tr[:, 0, ITERS - 2, 0], tr[:, 0, ITERS - 2, 1]
    en_c, en_g = tr[:, 1, ITERS - 2, 2], tr[:, 1, ITERS - 2, 3]
    ghz = np.median((en_c - st_c) / np.maximum(en_g - st_g, 1))
    us = lambda c: c / ghz / 1e3  # noqa: E731
    span_us = (en_g - st_g.min()) / 1e3
    print(f"\n== d{d} {'causal' if causal else 'full'} s{s} b{batch} h{h} cfg(D,BN,stages,NC,pp)={cfg} "
          f"{flops / ms_plain / 1e9:.0f} TFLOP/s ({ms_plain * 1e3:.1f} us; traced {ms_traced * 1e3:.1f} us) "
          f"clock {ghz:.2f} GHz; CTA end p0/p50/p100 {np.percentile(span_us, 0):.1f}/"
          f"{np.percentile(span_us, 50):.1f}/{span_us.max():.1f} us; "
          f"start spread {(st_g.max() - st_g.min()) / 1e3:.1f} us")
    for wg in range(1, 4):
        c = tr[:, wg]
        valid = c[:, :ITERS - 2, 7] != 0
        if not valid.any():
            continue
        nblk = c[:, :ITERS - 2, 9][valid]
        ph = [us(c[:, :ITERS - 2, i + 1][valid] - c[:, :ITERS - 2, i][valid]) for i in range(7)]
        tiles_per_cta = valid.sum(1)
        per_tile = us(c[:, :ITERS - 2, 7][valid] - c[:, :ITERS - 2, 0][valid])
        loop_per_blk = ph[4] / np.maximum(nblk - 1, 1)
        print(f"  consumer {wg}: tiles/CTA {tiles_per_cta.min()}-{tiles_per_cta.max()}, blocks/tile "
              f"{nblk.mean():.1f}, tile {per_tile.mean():.2f} us: " +
              ", ".join(f"{n} {p.mean():.2f}" for n, p in zip(CONS, ph)) +
              f"; loop/block {loop_per_blk[nblk > 1].mean() if (nblk > 1).any() else 0:.2f}")
        e6, e10, e11, e7 = (c[:, :ITERS - 2, i][valid] for i in (6, 10, 11, 7))
        tma = e10 != 0
        if tma.any():
            print(f"    epilogue by TMA ({tma.mean() * 100:.0f}% of tiles): "
                  f"to staging free {us(e10 - e6)[tma].mean():.2f}, "
                  f"smem writes+fence {us(e11 - e10)[tma].mean():.2f}, barrier+issue {us(e7 - e11)[tma].mean():.2f}")
    p = tr[:, 0]
    valid = p[:, :ITERS - 2, 5] != 0
    claims = []
    for cta in range(grid):
        idx = np.nonzero(valid[cta])[0]
        if len(idx) > 1:
            claims.append(us(p[cta, idx[1:], 0] - p[cta, idx[:-1], 5]))
    ph = [us(p[:, :ITERS - 2, i + 1][valid] - p[:, :ITERS - 2, i][valid]) for i in range(3)]
    ph.append(us(p[:, :ITERS - 2, 5][valid] - p[:, :ITERS - 2, 3][valid]))
    print("  producer: " + ", ".join(f"{n} {x.mean():.2f}" for n, x in zip(PROD, ph)) +
          (f", claim {np.concatenate(claims).mean():.2f}" if claims else ""))
    return ms_plain


AB_CASES = [(64, True, 512), (64, True, 1024), (64, True, 2048), (64, True, 4096), (64, True, 8192),
            (64, False, 512), (64, False, 1024), (128, False, 512), (128, False, 1024), (128, True, 512),
            (128, True, 2048), (256, False, 2048), (256, True, 2048)]


def with_options(extra):
    """A stand-in for attention._kernel_sm90 that adds compile options (-D switches) to every variant."""
    orig = att._kernel_sm90

    def make(*a):
        k = orig(*a)
        return att.Kernel(k.source, k.name, k.options + tuple(extra), hopper=True)

    return make


def bench_case(b, d, causal, s, dtype):
    """The bench's (b, s, h, d) problem for one cell (batch * s = 16k, h * d = 2048): q, k, v, its FLOPs, and
    cuDNN's TFLOP/s on contiguous (b, h, s, d) copies."""
    torch = b.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, h = max(1, 16384 // s), 2048 // d
    q, k, v = (torch.randn(batch, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    flops = 4 * batch * h * s * s * d / (2 if causal else 1)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        f = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa: E731
        f()
        cudnn = flops / b.time_ms(f) / 1e9
    return q, k, v, flops, cudnn


def ab(b, variants):
    """ours (default build) and each variant (extra -D options) against cuDNN, same process, bf16."""
    torch = b.torch
    orig = att._kernel_sm90
    for d, causal, s in AB_CASES:
        q, k, v, flops, cudnn = bench_case(b, d, causal, s, torch.bfloat16)
        run = lambda: speedcore.flash_attn(q, k, v, causal=causal)  # noqa: E731
        line = f"d{d} {'causal' if causal else 'full'} s{s}: cudnn {cudnn:.0f}"
        for name, extra in [("default", ())] + variants:
            att._kernel_sm90 = with_options(extra) if extra else orig
            try:
                run()
                t = flops / b.time_ms(run) / 1e9
                line += f" | {name} {t:.0f} ({t / cudnn:.3f})"
            except Exception as exc:  # noqa: BLE001
                line += f" | {name}: {type(exc).__name__}: {exc}"[:200]
            finally:
                att._kernel_sm90 = orig
        print(line, flush=True)


def _compile_one(k):
    from speedcore._compile import compile_kernel

    compile_kernel(k, "sm_90a")
    return k.name


def precompile():
    """Fill the disk cache in parallel (NVRTC is single-threaded; the GPU machine has 16 cores)."""
    from concurrent.futures import ProcessPoolExecutor

    ks = []
    extras = [("-DFA90_TRACE",)] + [tuple(a[5:].split(",")) for a in sys.argv[1:] if a.startswith("--ab=")]
    for d, causal, s in CASES + AB_CASES:
        for dtype in ("bfloat16", "float16"):
            kern, _ = kernel_for(dtype, d, causal, s)
            for k in [kern] + [att.Kernel(kern.source, kern.name, kern.options + e, hopper=True) for e in extras]:
                if k not in ks:
                    ks.append(k)
    with ProcessPoolExecutor(min(len(ks), os.cpu_count() or 1)) as ex:
        list(ex.map(_compile_one, ks))


def _cases_from_argv():
    """--cases=d:causal:seqlen,... (causal 0 or 1) replaces CASES (traced) and AB_CASES (timed)."""
    global CASES, AB_CASES
    for a in sys.argv[1:]:
        if a.startswith("--cases="):
            CASES = AB_CASES = [tuple(int(x) for x in c.split(":")) for c in a[8:].split(",")]
            CASES = AB_CASES = [(d, bool(c), s) for d, c, s in CASES]


def main():
    from speedcore.bench import Bench

    _cases_from_argv()

    precompile()

    b = Bench(quick=False)
    for d, causal, s in CASES:
        trace(b, d, causal, s)
    variants = [(a[5:], tuple(a[5:].split(","))) for a in sys.argv[1:] if a.startswith("--ab=")]
    if variants:
        print()
        ab(b, variants)


if __name__ == "__main__":
    main()
