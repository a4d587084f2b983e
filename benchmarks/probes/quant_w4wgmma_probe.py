"""Same-run probe for w4_wgmma_kernel (not a suite): on prepacked AWQ layers (random packed words, group 128; the
switch on while prepacking so that the wgmma-major copy exists), "w4wgmma" (the kernel, its heuristic launch shape),
"current" (today's dispatch: the switch off at call time: quant_marlin_kernel / quant_mma_kernel at M <= 128, the
dense path (dequantize + cuBLAS) above) and cuBLAS (F.linear with a bf16 weight of the same shape), at M = 64, 128,
256, 1024, 2048 on 8192x8192 and 28672x8192, bf16; a split-K and tile-height sweep on 8192x8192 at M = 64, 128,
256 ("s<S> <us>", "mt<MT> <us>"); one fp16 and one GPTQ row.  Each output is checked against the current dispatch
(rel diff; "!!" above 1e-2).  One line per case, the summary table last.

    SPEEDCORE_QUANT_W4WGMMA=1 PYTHONPATH=. python3 benchmarks/probes/quant_w4wgmma_probe.py [M ...]

With M values given: only those, on 8192x8192 and 28672x8192 (bf16) and 8192x8192 (fp16), no sweeps.

    SPEEDCORE_QUANT_W4WGMMA=1 PYTHONPATH=. python3 benchmarks/probes/quant_w4wgmma_probe.py --tune [M ...]

--tune: the launch-shape sweep instead (AWQ bf16, 8192x8192, 28672x8192, 4096x4096 and 8192x28672, M = 64, 128, 256, 1024, 2048 unless
given): today's default shape ("def", blk 2) against shapes forced through _W4WGMMA_OVERRIDE: b<BLK>m<MT> (blk = 1:
128-channel CTAs; the heuristic's split-K), b<BLK>m<MT>s<S> (S splits);
"...g<GS>": wgmma groups of GS k16 steps; "...k2": 128-k ring stages; "/g<N>" is the grid; each output checked against the current dispatch; one line per (layer, M), then a table of
the best shape per case.
"""
import sys
import time

import torch
import torch.nn.functional as F

from speedcore import quant as Q
from speedcore.bench import Bench

import speedcore

b = Bench(quick=True)
t0 = time.time()
G = 128
summary = []


def timed(call, x, mode, **override):
    saved = (Q._W4WGMMA_MODE, dict(Q._W4WGMMA_OVERRIDE))
    Q._W4WGMMA_MODE = mode
    Q._W4WGMMA_OVERRIDE.clear()
    Q._W4WGMMA_OVERRIDE.update(override)
    try:
        y = call(x)
        return b.time_ms(lambda: call(x)), y
    finally:
        Q._W4WGMMA_MODE = saved[0]
        Q._W4WGMMA_OVERRIDE.clear()
        Q._W4WGMMA_OVERRIDE.update(saved[1])


def layer_of(fmt, n, k, dt):
    dev = b.device
    Q._W4WGMMA_MODE = "on"  # prepack builds the wgmma-major copy only with the switch on
    scales = (torch.rand(k // G, n, device=dev) * 0.01 + 0.001).to(dt)
    if fmt == "gptq":
        qw = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev)
        qz = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, device=dev)
        layer = Q.prepack_gptq(qw, qz, scales, group_size=G)
        assert layer.gemv is not None and layer.gemv.w4_ptr
        return lambda x: speedcore.gptq_linear(x, layer)
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device=dev)
    qz = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, device=dev)
    layer = Q.prepack_awq(qw, qz, scales, group_size=G)
    assert layer.gemv is not None and layer.gemv.w4_ptr
    return lambda x: speedcore.awq_linear(x, layer)


def rel(a, ref):
    return ((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def case(fmt, n, k, dt, ms, sweep=()):
    call = layer_of(fmt, n, k, dt)
    w = torch.randn(n, k, device=b.device, dtype=dt) * 0.01
    sms = torch.cuda.get_device_properties(b.device).multi_processor_count
    for m in ms:
        x = torch.randn(m, k, device=b.device, dtype=dt)
        cur, y_cur = timed(call, x, "off")
        ours, y = timed(call, x, "on")
        cfg = Q.w4wgmma_config(m, n, k, sms)
        e = rel(y, y_cur)
        flag = "" if e < 1e-2 else f"  !! w4wgmma vs current: rel diff {e:.2e}"
        extra = []
        if m in sweep:
            alts = [("s%d" % s, {"splits": s}) for s in sorted({1, 2, 4, 8} - {cfg.splits})]
            alts.append(("mt%d" % (192 - cfg.mt), {"mt": 192 - cfg.mt}))  # the other tile height (64 <-> 128)
            for tag, ov in alts:
                t, ys = timed(call, x, "on", **ov)
                es = rel(ys, y_cur)
                extra.append(f"{tag} {t * 1e3:5.1f}" + ("" if es < 1e-2 else f"(!! {es:.1e})"))
        cub = b.time_ms(lambda: F.linear(x, w))
        tflops = 2e-9 * m * n * k / ours
        label = f"{fmt:4s} {str(dt)[6:]:8s} M={m:<4d} {n:>5d}x{k:<5d}"
        print(f"{label} w4wgmma {ours * 1e3:7.1f}us x{cub / ours:4.2f} {tflops:4.0f}TF/s (grid {cfg.grid}, mt{cfg.mt}, "
              f"s{cfg.splits}) | current {cur * 1e3:7.1f}us x{cub / cur:4.2f} | cuBLAS {cub * 1e3:7.1f}us"
              + (" | " + " ".join(extra) if extra else "") + flag, flush=True)
        summary.append((label, ours, cur, cub, e))
    del w
    torch.cuda.empty_cache()


def tune_variants(m, n, k, sms):
    """(tag, override, config) of the shapes the sweep times at M: blk = 1 at each tile height up to 2 M (mt 256
    from M = 128; from M = 1024 not mt 64, which reads the weights once per 64 rows), with the heuristic's splits
    and, up to M = 256, 1 and 2; plus blk = 2 without split-K; duplicates of today's default launch dropped; then
    each of these (and the default) with the other wgmma group sizes ("...g<GS>")."""
    base = Q.w4wgmma_config(m, n, k, sms)
    seen = {(base.blk, base.mt, base.splits)}
    out = []
    cands = [(1, mt) for mt in Q.W4WGMMA_SHAPES[1] if mt <= max(64, 2 * m) and (m < 1024 or mt >= 128)]
    cands.append((2, min(base.mt, 128)))
    for blk, mt in cands:
        heur = Q.w4wgmma_config(m, n, k, sms, blk=blk, mt=mt).splits
        for s in ([heur, 1, 2] if blk == 1 and m <= 256 else [heur] if blk != 2 else [1]):
            cfg = Q.w4wgmma_config(m, n, k, sms, blk=blk, mt=mt, splits=s)
            key = (cfg.blk, cfg.mt, cfg.splits)
            if key in seen:
                continue
            seen.add(key)
            tag = f"b{blk}m{mt}" + ("" if s == heur and blk != 2 else f"s{cfg.splits}")
            out.append((tag, {"blk": blk, "mt": mt, "splits": cfg.splits}, cfg))
    grouped = []
    for tag, ov, cfg in [(f"b{base.blk}m{base.mt}s{base.splits}", {"blk": base.blk, "mt": base.mt,
                                                                    "splits": base.splits}, base)] + out:
        for gs in Q.W4WGMMA_GROUP_STEPS:
            if gs != cfg.gs and not (gs == 4 and not Q.w4wgmma_gs4_built(cfg.blk, cfg.mt, cfg.ks)):
                grouped.append((f"{tag}g{gs}", {**ov, "gs": gs}, Q.w4wgmma_config(m, n, k, sms, **ov, gs=gs)))
    out += grouped
    if m <= 128:  # 128-k ring stages at 64-row tiles (two of them from M = 65)
        for blk in (2, 1):
            if n % (128 * blk) == 0:
                for gs in (1, 4):
                    cfg = Q.w4wgmma_config(m, n, k, sms, blk=blk, mt=64, gs=gs, ks=2)
                    out.append((f"b{blk}m64s{cfg.splits}g{gs}k2", {"blk": blk, "mt": 64, "gs": gs, "ks": 2}, cfg))
    return base, out


def tune_case(n, k, ms, dt=torch.bfloat16):
    call = layer_of("awq", n, k, dt)
    w = torch.randn(n, k, device=b.device, dtype=dt) * 0.01
    sms = torch.cuda.get_device_properties(b.device).multi_processor_count
    for m in ms:
        x = torch.randn(m, k, device=b.device, dtype=dt)
        cur, y_cur = timed(call, x, "off")
        base, variants = tune_variants(m, n, k, sms)
        ours, y = timed(call, x, "on")
        e = rel(y, y_cur)
        results = [(f"def(b{base.blk}m{base.mt}s{base.splits})", ours, base.grid, e)]
        for tag, ov, cfg in variants:
            try:
                t, ys = timed(call, x, "on", **ov)
                results.append((tag, t, cfg.grid, rel(ys, y_cur)))
            except Exception as ex:  # one failing shape must not hide the others
                print(f"!! {tag} M={m} {n}x{k} failed: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                torch.cuda.synchronize()
        cub = b.time_ms(lambda: F.linear(x, w))
        bad = [f"{tag}({er:.1e})" for tag, _, _, er in results if not er < 1e-2]
        best = min([r for r in results if r[3] < 1e-2] or results, key=lambda r: r[1])  # wrong outputs never win
        label = f"M={m:<4d} {n:>5d}x{k:<5d}"
        print(f"{label} cuBLAS {cub * 1e3:7.1f} current {cur * 1e3:7.1f} | "
              + " ".join(f"{tag} {t * 1e3:.1f}/g{g}" for tag, t, g, _ in results)
              + (f"  !! rel diff vs current: {' '.join(bad)}" if bad else ""), flush=True)
        summary.append((label, ours, best, cur, cub, bad))
    del w
    torch.cuda.empty_cache()


bf, fp = torch.bfloat16, torch.float16
if sys.argv[1:2] == ["--tune"]:
    MS = [int(a) for a in sys.argv[2:]] or [64, 128, 256, 1024, 2048]
    for n, k in ((8192, 8192), (28672, 8192), (4096, 4096), (8192, 28672)):
        try:
            tune_case(n, k, MS)
        except Exception as e:
            print(f"!! tune {n}x{k} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            torch.cuda.synchronize()
    print(f"\ntune summary ({time.time() - t0:.0f} s): us; x = cuBLAS / time (same run); best of the swept shapes")
    print(f"{'case':20s} {'default':>8s} {'x':>5s} {'best shape':>16s} {'best':>8s} {'x':>5s} {'current':>8s} "
          f"{'cuBLAS':>8s}")
    for label, ours, (tag, t, g, _), cur, cub, bad in summary:
        print(f"{label:20s} {ours * 1e3:8.1f} {cub / ours:5.2f} {tag:>16s} {t * 1e3:8.1f} {cub / t:5.2f} "
              f"{cur * 1e3:8.1f} {cub * 1e3:8.1f}" + ("  !! " + " ".join(bad) if bad else ""))
    sys.exit(0)
tiny = torch.ones(1, device=b.device)
print(f"launch floor: tiny add_ {b.time_ms(lambda: tiny.add_(1.0)) * 1e3:.1f} us", flush=True)
CASES = ((("awq", 8192, 8192, bf, [64, 128, 256, 1024, 2048]), {"sweep": (64, 128, 256)}),
         (("awq", 28672, 8192, bf, [64, 128, 256, 1024, 2048]), {}),
         (("awq", 8192, 8192, fp, [64]), {}), (("gptq", 8192, 8192, bf, [64]), {}))
if sys.argv[1:]:
    MS = [int(a) for a in sys.argv[1:]]
    CASES = ((("awq", 8192, 8192, bf, MS), {}), (("awq", 28672, 8192, bf, MS), {}), (("awq", 8192, 8192, fp, MS), {}))
for args, kw in CASES:
    try:
        case(*args, **kw)
    except Exception as e:  # keep the rest of the table: one failing case must not hide the others
        print(f"!! case {args[:3]} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        torch.cuda.synchronize()
print(f"\nsummary ({time.time() - t0:.0f} s): time in us, speed-up over cuBLAS (F.linear) in the same run")
print(f"{'case':36s} {'w4wgmma':>8s} {'x':>5s} {'current':>8s} {'x':>5s} {'cuBLAS':>8s} {'rel diff':>9s}")
for label, ours, cur, cub, e in summary:
    print(f"{label:36s} {ours * 1e3:8.1f} {cub / ours:5.2f} {cur * 1e3:8.1f} {cub / cur:5.2f} {cub * 1e3:8.1f} {e:9.1e}")
