"""Where w4_wgmma_kernel's time goes, per CTA: the kernel built with -DW4_TRACE (kernels/quant_sm90.cu) stamps
clock64() at entry, at each ring stage's full / empty wait, at the loop end and in the split-K epilogue; this prints,
per case, the phases in microseconds (medians over CTAs unless said).

    PYTHONPATH=. python3 benchmarks/probes/quant_w4_trace.py [N:K:M ...] [--defs "-DNAME=VALUE ..." ...]

Each --defs string is one more traced build of every case (extra compiler options, e.g. the
experiment switches one adds for a measurement); the plain build is always traced first.

Columns: plain / traced = kernel time (median of runs, L2 flushed) without / with the stamps; span = first entry to
last exit in the traced run; skew = spread of the CTAs' entries; first = entry to the first stage's data;
step = median time between stages in the steady state (stages 2..n-1); lat = a stage's full wait returning minus
the producer's empty wait for it (time from issue to the consumers having it, when the consumers wait); tail = last
stage's data to the loop end; epi = loop end to the last store; tail_cta = the last exit minus the median exit.
Then the epilogue's phases, p50 / p90 over CTAs: the consumers' barrier; with split-K through ring slots the
partials stored to the CTA's own slots ("slots"), the cluster barrier ("cluster"), the owner's reads of every rank's
slots with the sum and y tile ("pull+tile"); with a two-rank push into the receive buffer the check that the other
rank's receive barrier is set up ("slots"), the st.async pushes and the wait for the other rank's half ("cluster"),
the sum and y tile; without a split, the y tile; then the tile's barrier and the copy to y.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

import speedcore  # noqa: E402
from speedcore import _launch, quant as Q  # noqa: E402
from speedcore._compile import Kernel  # noqa: E402
from speedcore.bench import Bench  # noqa: E402

SLOTS, PROD, PROD_X, PROD_W, EPI, CTAS = 1056, 264, 528, 792, 250, 512
G = 128
CASES = [(8192, 8192, 256), (4096, 4096, 256), (4096, 4096, 64), (8192, 8192, 64), (28672, 8192, 256),
         (8192, 8192, 2048)]


def layer(n, k, dt):
    dev = "cuda"
    scales = (torch.rand(k // G, n, device=dev) * 0.01 + 0.001).to(dt)
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device=dev)
    qz = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, device=dev)
    return Q.prepack_awq(qw, qz, scales, group_size=G)


def run(b, n, k, m, defs=()):
    import cupy

    dt = torch.bfloat16
    lay = layer(n, k, dt)
    x = torch.randn(m, k, device="cuda", dtype=dt)
    call = lambda: speedcore.awq_linear(x, lay)  # noqa: E731
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    y0 = call()
    cfg = Q._w4wgmma_plan("bfloat16", m, n, k, G, 0, sms, ())[0]  # as launched (split counts that fit clusters)
    plain = b.time_ms(call)
    orig = Q._w4wgmma_kernel

    def traced_kernel(*a, **kw):
        kern = orig(*a, **kw)
        return Kernel(kern.source, kern.name, kern.options + ("-DW4_TRACE",) + tuple(defs), hopper=True)

    Q._w4wgmma_kernel = traced_kernel
    Q._w4wgmma_plan.cache_clear()
    try:
        y1 = call()
        if not defs:
            assert torch.equal(y0, y1), "the traced build must compute the same bits"
        elif not torch.equal(y0, y1):
            print(f"  ({' '.join(defs)}: output differs from the plain build)")
        kern = traced_kernel("bfloat16", cfg.mt, cfg.blk, cfg.stages, gs=cfg.gs, ks=cfg.ks)
        lk = _launch.get_kernel(kern, 0)
        buf = lk.module.get_global_var("w4_trace")
        total = CTAS * SLOTS
        mem = cupy.cuda.UnownedMemory(int(buf), total * 8, None)
        arr = cupy.ndarray((total,), dtype=cupy.int64, memptr=cupy.cuda.MemoryPointer(mem, 0))
        traced = b.time_ms(call)
        arr.fill(0)
        torch.cuda.synchronize()
        b._flush.max()
        torch.cuda._sleep(200_000)
        call()
        torch.cuda.synchronize()
        tr = cupy.asnumpy(arr).reshape(CTAS, SLOTS)
    finally:
        Q._w4wgmma_kernel = orig
        Q._w4wgmma_plan.cache_clear()
    grid = min(cfg.grid, CTAS)
    tr = tr[:grid]
    kb = k // (64 * cfg.ks)
    nst = [(s + 1) * kb // cfg.splits - s * kb // cfg.splits for s in range(cfg.splits)]
    ghz = np.median((tr[:, 5] - tr[:, 1]) / np.maximum(tr[:, 6] - tr[:, 0], 1))
    us = lambda c: c / ghz / 1e3  # noqa: E731
    n_st = min(nst)
    full = tr[:, 8:8 + n_st]
    prod = tr[:, PROD:PROD + n_st]
    first = np.median(us(full[:, 0] - tr[:, 1]))
    step = np.median(us(np.median(np.diff(full[:, 2:], axis=1), axis=1))) if n_st > 3 else float("nan")
    lat = np.median(us(full[:, 2:] - prod[:, 2:])) if n_st > 3 else float("nan")
    tail = np.median(us(tr[:, 3] - full[:, n_st - 1]))
    epi = np.median(us(tr[:, 5] - tr[:, 3]))
    span = (tr[:, 6].max() - tr[:, 0].min()) / 1e3
    skew = (tr[:, 0].max() - tr[:, 0].min()) / 1e3
    tail_cta = (tr[:, 6].max() - np.median(tr[:, 6])) / 1e3
    shape = f"b{cfg.blk} m{cfg.mt} g{cfg.gs} k{cfg.ks} s{cfg.splits} st{cfg.stages} grid {cfg.grid} stages/CTA {n_st}"
    print(f"{n}x{k} M={m:<5} {shape} {' '.join(defs) or '(plain build)'}")
    print(f"  plain {plain * 1e3:7.1f} us  traced {traced * 1e3:7.1f}  span {span:7.1f}  skew {skew:5.2f}  "
          f"first {first:5.2f}  step {step:5.3f}  lat {lat:5.2f}  tail {tail:5.2f}  epi {epi:5.2f}  "
          f"tail_cta {tail_cta:5.2f}  clock {ghz:.2f} GHz", flush=True)
    # the producers (warp 0: x boxes, warp 1: weights): time to issue a stage's x box, and how long before the
    # consumers took the stage each producer had issued it (the ring's lead; small = the consumers waited on it)
    px, pw = tr[:, PROD_X:PROD_X + n_st], tr[:, PROD_W:PROD_W + n_st]
    if px.any():
        pr = lambda a: f"{np.median(us(a[:, :4])):5.3f}/{np.median(us(a[:, 4:])):5.3f}"  # noqa: E731
        print(f"  producers (first 4 stages / the rest): x issue {pr(px - prod)}  lead of x {pr(full - px)}  "
              f"lead of weights {pr(full - pw)}")
    # the epilogue's phases, p50 / p90 over CTAs, us
    marks = [("bar", 3, EPI), ("slots", EPI, EPI + 1), ("cluster", EPI + 1, EPI + 2), ("pull+tile", EPI + 2, EPI + 3)] \
        if cfg.splits > 1 else [("bar", 3, EPI), ("tile", EPI, EPI + 3)]
    marks += [("bar", EPI + 3, EPI + 4), ("copy", EPI + 4, 5)]
    print("  epilogue " + "  ".join(f"{nm} {np.percentile(us(tr[:, b] - tr[:, a]), 50):5.2f}/"
                                     f"{np.percentile(us(tr[:, b] - tr[:, a]), 90):5.2f}" for nm, a, b in marks))
    if os.environ.get("OUT"):
        tag = "".join(d.replace("-DW4_EXP_", "_").replace("=", "") for d in defs)
        np.save(os.path.join(os.environ["OUT"], f"w4trace_{n}x{k}_m{m}{tag}.npy"), tr)
    return dict(case=f"{n}x{k} M={m}", plain=plain * 1e3, step=step, first=first, epi=epi, lat=lat)


def main():
    b = Bench(quick=True)
    args, variants = sys.argv[1:], [()]
    while "--defs" in args:
        i = args.index("--defs")
        variants.append(tuple(args[i + 1].split()))
        del args[i:i + 2]
    cases = [tuple(int(v) for v in a.split(":")) for a in args] or CASES
    for n, k, m in cases:
        for defs in variants:
            run(b, n, k, m, defs)


if __name__ == "__main__":
    main()
