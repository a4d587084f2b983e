"""Ad-hoc same-process A/B for the GEMM kernels (not a bench suite: not recorded).

Times cuBLAS, the previous kernels (kernels/gemm_sm90_prev.cu / gemm_prev.cu: copies of the last committed
versions, made by the caller) and the current ones with the heuristic's and forced configs, interleaved per shape
so clocks drift alike.  Prints one table (TFLOP/s or TB/s; ratio to cuBLAS in brackets).

    PYTHONPATH=. python3 benchmarks/probes/gemm_ab.py precompile       # parallel NVRTC into the disk cache first
    PYTHONPATH=. python3 benchmarks/probes/gemm_ab.py [hopper] [small] [ampere] [ampere_cfgs] [epilogue] [skinny] [mid]

The previous kernels (those of 869ced9) are made beside the current ones with
    git show 869ced9:kernels/gemm_sm90.cu | sed 's/gemm_wgmma_kernel(/gemm_wgmma_prev_kernel(/' > kernels/gemm_sm90_prev.cu
    git show 869ced9:kernels/gemm.cu | sed 's/gemm_mma_kernel(/gemm_mma_prev_kernel(/' > kernels/gemm_prev.cu
(untracked; without them the "old" columns are left out).  The ampere section's "prev" column needs only
    git show <commit>:kernels/gemm.cu | sed 's/gemm_mma_tile_kernel(/gemm_mma_tile_prev_kernel(/; s/gemm_mma_kernel(/gemm_mma_prev_kernel(/' > kernels/gemm_prev.cu
with a commit that has gemm_mma_tile_kernel (563fe1d or later).
"""
import math
import sys
from concurrent.futures import ProcessPoolExecutor

import os

import numpy as np

from speedcore import gemm
from speedcore._compile import Kernel, compile_kernel

SMS = 132
HAVE_PREV = all(os.path.exists(os.path.join(os.path.dirname(__file__), "..", "..", "kernels", f))
                for f in ("gemm_sm90_prev.cu", "gemm_prev.cu"))
CT = "__nv_bfloat16"
OPT = ("-default-device",)


NK = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192), (8192, 8192)]
_C = gemm.MmaConfig
# Large tiles of gemm_mma_tile_kernel (BK = 64).
AMPERE_CFGS = [_C(256, 128, 64, 4, 2, 1, 3), _C(256, 128, 64, 4, 2, 1, 4), _C(128, 256, 64, 2, 4, 1, 3),
               _C(128, 256, 64, 2, 4, 1, 4), _C(128, 128, 64, 2, 4, 1, 6)]
# Skinny (decode) alternatives.
SKINNY_CFGS = {"s16x32x256w8s4": _C(16, 32, 256, 1, 1, 8, 4), "s16x32x128w8s8": _C(16, 32, 128, 1, 1, 8, 8),
               "s16x64x128w4s8": _C(16, 64, 128, 1, 2, 4, 8), "s64x32x128w8s4": _C(64, 32, 128, 1, 1, 8, 4)}


# -- the previous Hopper kernel and its heuristic ------------------------------------------------------------
def old_wgmma_cfg(m, n, k):
    best, best_key = None, None
    for bm, bn in ((128, 256), (256, 128), (128, 128), (128, 64)):
        tiles = math.ceil(m / bm) * math.ceil(n / bn)
        waves = math.ceil(tiles / SMS)
        last = tiles - (waves - 1) * SMS
        useful = (m * n) / (math.ceil(m / bm) * bm * math.ceil(n / bn) * bn)
        key = (waves / useful, -last / SMS, -(bm * bn))
        if best_key is None or key < best_key:
            best, best_key = (bm, bn), key
    bm, bn = best
    st = 8
    while st > 2 and st * (bm + bn) * 128 + 1024 + 16 * st > 232448:
        st -= 1
    return bm, bn, st


def old_wgmma_kernel(bm, bn, st, kmajor=True):
    return Kernel("gemm_sm90_prev.cu", f"gemm_wgmma_prev_kernel<{CT}, {bm}, {bn}, {st}, {'true' if kmajor else 'false'}>",
                  OPT, hopper=True)


def old_hopper_fn(x, w, out, kmajor=True):
    m, k = x.shape
    n = w.shape[0] if kmajor else w.shape[1]
    bm, bn, st = old_wgmma_cfg(m, n, k)
    ta = _tma.tile_map_2d(x.data_ptr(), "bfloat16", rows=m, cols=k, row_stride=k, box_rows=bm, box_cols=64)
    if kmajor:
        tb = _tma.tile_map_2d(w.data_ptr(), "bfloat16", rows=n, cols=k, row_stride=k, box_rows=bn, box_cols=64)
    else:
        tb = _tma.tile_map_2d(w.data_ptr(), "bfloat16", rows=k, cols=n, row_stride=n, box_rows=64, box_cols=64)
    tiles = math.ceil(m / bm) * math.ceil(n / bn)
    cfg = LaunchConfig((min(tiles, SMS),), (384,), st * (bm + bn) * 128 + 1024 + 16 * st)
    args = (ta, tb, out.data_ptr(), 0, np.int32(m), np.int32(n), np.int32(k), np.int64(n), np.int32(0), np.int32(8))
    kern = old_wgmma_kernel(bm, bn, st, kmajor)
    stream = A.stream_of(A.wrap(x, "x"))
    return lambda: launch(kern, cfg, args, device=0, stream=stream)


def old_mma_kernel(c, kmajor=True):
    return Kernel("gemm_prev.cu", f"gemm_mma_prev_kernel<{CT}, {c.bm}, {c.bn}, {c.bk}, {c.wm}, {c.wn}, {c.wk}, "
                                  f"{c.stages}, {'true' if kmajor else 'false'}>", OPT)


def old_mma_fn(x, w, out, c):
    m, k = x.shape
    n = w.shape[0]
    grid = math.ceil(m / c.bm) * math.ceil(n / c.bn)
    cfg = LaunchConfig((grid,), (c.threads,), c.smem)
    args = (out.data_ptr(), x.data_ptr(), w.data_ptr(), 0, np.int32(m), np.int32(n), np.int32(k), np.int64(k),
            np.int64(k), np.int64(n), np.int32(0), np.int32(8))
    kern = old_mma_kernel(c)
    stream = A.stream_of(A.wrap(x, "x"))
    return lambda: launch(kern, cfg, args, device=0, stream=stream)


def time_forced(fn, wgmma=None, mma=None):
    """Time fn with gemm's config functions replaced (the module looks them up at call time)."""
    saved = gemm.wgmma_config, gemm.mma_config
    try:
        if wgmma is not None:
            gemm.wgmma_config = lambda *a, **kw: gemm.WgmmaConfig(wgmma[0], wgmma[1],
                                                                  gemm._wgmma_stages(wgmma[0], wgmma[1], 232448))
        if mma is not None:
            gemm.mma_config = lambda *a, **kw: mma
        gemm._plan.cache_clear()
        return b.time_ms(fn)
    finally:
        gemm.wgmma_config, gemm.mma_config = saved
        gemm._plan.cache_clear()


rows = []


def report(label, m, n, k, times):
    flops = 2 * m * n * k
    nbytes = 2 * (m * k + n * k + m * n)
    bw = m <= 64
    val = {name: (nbytes / ms / 1e9 if bw else flops / ms / 1e9) for name, ms in times.items()}
    ref = val.get("cublas")
    cells = [f"{name}={v:.3g}" + (f"({v / ref:.3f})" if ref and name != "cublas" else "") for name, v in val.items()]
    line = f"{label:28s} {'TB/s' if bw else 'TF/s'}  " + "  ".join(cells)
    rows.append(line)
    print(line, flush=True)


def _compile_one(kk):
    compile_kernel(kk, "sm_90a" if kk.hopper else "sm_90")


def precompile_all():
    """Every kernel the sections use, compiled in parallel into the disk cache (before CUDA is touched)."""
    C = gemm.MmaConfig
    kern = set()
    shapes = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 28672, 8192), (8192, 4096, 4096)]
    shapes += [(m, n, k) for m in (512, 2048) for n, k in NK]
    if HAVE_PREV:
        for m, n, k in shapes:
            kern.add(old_wgmma_kernel(*old_wgmma_cfg(m, n, k)))
        for s in (4096, 8192):
            kern.add(old_wgmma_kernel(*old_wgmma_cfg(s, s, s), kmajor=False))
        for m in (16, 32, 64):
            for n, k in NK:
                kern.add(old_mma_kernel(gemm.mma_config(m, n, k, SMS, 233472, True)))
        kern.add(old_mma_kernel(C(128, 256, 64, 2, 4, 1, 4)))
    for c in AMPERE_CFGS:
        kern.add(gemm._mma_kernel("bfloat16", c, True))
    for c in AMPERE_CFGS[:3]:
        kern.add(gemm._mma_kernel("bfloat16", c, False))
    if HAVE_PREV_TILE:
        for kmajor in (True, False):
            c = gemm.mma_config(8192, 8192, 8192, SMS, 233472, False, kmajor)
            kern.add(Kernel("gemm_prev.cu", f"gemm_mma_tile_prev_kernel<{CT}, {c.bm}, {c.bn}, {c.wm}, {c.wn}, "
                                            f"{c.stages}, {'true' if kmajor else 'false'}>", OPT))
    for c in SKINNY_CFGS.values():
        kern.add(gemm._mma_kernel("bfloat16", c, True))
        kern.add(gemm._mma_kernel("bfloat16", c, False))
    kern.update(gemm.all_kernels())
    kern = sorted(kern, key=lambda kk: kk.name)
    with ProcessPoolExecutor(16) as ex:
        list(ex.map(_compile_one, kern))
    print(f"precompiled {len(kern)} kernels", flush=True)


def hopper_section():
    shapes = [(4096, 4096, 4096), (8192, 8192, 8192)]
    shapes += [(m, n, k) for m in (512, 2048) for n, k in NK]
    shapes += [(8192, 28672, 8192), (8192, 4096, 4096)]
    for m, n, k in shapes:
        x = torch.randn(m, k, dtype=DT, device="cuda")
        w = torch.randn(n, k, dtype=DT, device="cuda") / k ** 0.5
        out = torch.empty(m, n, dtype=DT, device="cuda")
        cfg = gemm.wgmma_config(m, n, k, SMS, 232448, True)
        t = {"cublas": b.time_ms(lambda: torch.nn.functional.linear(x, w)),
             f"new{cfg.bm}x{cfg.bn}": b.time_ms(lambda: speedcore.linear(x, w, out=out))}
        if HAVE_PREV:
            t["old"] = b.time_ms(old_hopper_fn(x, w, out))
        if (cfg.bm, cfg.bn) != (128, 256):
            t["new128x256"] = time_forced(lambda: speedcore.linear(x, w, out=out), wgmma=(128, 256))
        report(f"linear {m}x{n}x{k}", m, n, k, t)
    for s in (4096, 8192):
        x = torch.randn(s, s, dtype=DT, device="cuda")
        w = torch.randn(s, s, dtype=DT, device="cuda") / s ** 0.5
        out = torch.empty(s, s, dtype=DT, device="cuda")
        t = {"cublas": b.time_ms(lambda: torch.matmul(x, w)),
             "new": b.time_ms(lambda: speedcore.matmul(x, w, out=out))}
        if HAVE_PREV:
            t["old"] = b.time_ms(old_hopper_fn(x, w, out, kmajor=False))
        report(f"matmul {s}^3", s, s, s, t)
    x = torch.randn(4096, 4096, dtype=DT, device="cuda")
    w = torch.randn(14336, 4096, dtype=DT, device="cuda") / 64
    bias = torch.randn(14336, dtype=DT, device="cuda")
    F = torch.nn.functional
    t = {"cublas": b.time_ms(lambda: F.silu(F.linear(x, w, bias))),
         "new": b.time_ms(lambda: speedcore.linear(x, w, bias, activation="silu"))}
    report("linear+bias+silu 4096x14336", 4096, 14336, 4096, t)


def small_section():
    tiles = [(64, 32), (64, 64), (64, 128), (128, 64), (128, 128), (128, 224)]
    for m in (32, 64, 128):
        for n, k in NK:
            x = torch.randn(m, k, dtype=DT, device="cuda")
            w = torch.randn(n, k, dtype=DT, device="cuda") / k ** 0.5
            out = torch.empty(m, n, dtype=DT, device="cuda")
            t = {"cublas": b.time_ms(lambda: torch.nn.functional.linear(x, w)),
                 "default": b.time_ms(lambda: speedcore.linear(x, w, out=out))}
            if m <= 64:
                t["skinny"] = b.time_ms(lambda: speedcore.linear(x, w, out=out, _path="skinny"))
                c = gemm.mma_config(m, n, k, SMS, dev.smem_per_sm, True)
                if HAVE_PREV:
                    t["skinny_old"] = b.time_ms(old_mma_fn(x, w, out, c))
            for bm, bn in tiles:
                t[f"h{bm}x{bn}"] = time_forced(lambda: speedcore.linear(x, w, out=out, _path="hopper"),
                                               wgmma=(bm, bn))
            report(f"linear {m}x{n}x{k}", m, n, k, t)
    for n, k in [(4096, 4096), (14336, 4096), (28672, 8192), (8192, 8192)]:
        m = 16
        x = torch.randn(m, k, dtype=DT, device="cuda")
        w = torch.randn(n, k, dtype=DT, device="cuda") / k ** 0.5
        out = torch.empty(m, n, dtype=DT, device="cuda")
        c = gemm.mma_config(m, n, k, SMS, dev.smem_per_sm, True)
        t = {"cublas": b.time_ms(lambda: torch.nn.functional.linear(x, w)),
             "skinny": b.time_ms(lambda: speedcore.linear(x, w, out=out))}
        if HAVE_PREV:
            t["skinny_old"] = b.time_ms(old_mma_fn(x, w, out, c))
        report(f"linear {m}x{n}x{k}", m, n, k, t)


def prev_tile_fn(x, w, out, c, kmajor):
    """The large-tile kernel of kernels/gemm_prev.cu (renamed gemm_mma_tile_prev_kernel), launched as _gemm does."""
    m, k = x.shape
    n = w.shape[0] if kmajor else w.shape[1]
    kern = Kernel("gemm_prev.cu", f"gemm_mma_tile_prev_kernel<{CT}, {c.bm}, {c.bn}, {c.wm}, {c.wn}, {c.stages}, "
                                  f"{'true' if kmajor else 'false'}>", OPT)
    cfg = LaunchConfig((math.ceil(m / c.bm) * math.ceil(n / c.bn),), (c.threads,), c.smem)
    args = (out.data_ptr(), x.data_ptr(), w.data_ptr(), 0, np.int32(m), np.int32(n), np.int32(k), np.int64(k),
            np.int64(k if kmajor else n), np.int64(n), np.int32(0), np.int32(8))
    stream = A.stream_of(A.wrap(x, "x"))
    return lambda: launch(kern, cfg, args, device=0, stream=stream)


HAVE_PREV_TILE = os.path.exists(os.path.join(os.path.dirname(__file__), "..", "..", "kernels", "gemm_prev.cu"))


def ampere_section():
    """Forced Ampere path at 8192^3 against cuBLAS, timed ABBA (cuBLAS, new, prev | prev, new, cuBLAS) so a
    drift of the clocks hits every column alike; each column is the faster of its two medians."""
    s = 8192
    x = torch.randn(s, s, dtype=DT, device="cuda")
    w = torch.randn(s, s, dtype=DT, device="cuda") / s ** 0.5
    out = torch.empty(s, s, dtype=DT, device="cuda")
    b_kn = w.t().contiguous()
    for op in ("linear", "matmul"):
        if op == "linear":
            fns = {"cublas": lambda: torch.nn.functional.linear(x, w),
                   "new": lambda: speedcore.linear(x, w, out=out, _path="ampere")}
            c = gemm.mma_config(s, s, s, SMS, dev.smem_per_sm, False, True)
            if HAVE_PREV_TILE:
                fns["prev"] = prev_tile_fn(x, w, out, c, True)
        else:
            fns = {"cublas": lambda: torch.matmul(x, b_kn),
                   "new": lambda: speedcore.matmul(x, b_kn, out=out, _path="ampere")}
            c = gemm.mma_config(s, s, s, SMS, dev.smem_per_sm, False, False)
            if HAVE_PREV_TILE:
                fns["prev"] = prev_tile_fn(x, b_kn, out, c, False)
        for rep in range(2):
            order = list(fns) + list(reversed(list(fns)))
            best = {}
            for name in order:
                best[name] = min(best.get(name, 1e9), b.time_ms(fns[name]))
            report(f"ampere {op} {c.bm}x{c.bn}s{c.stages} #{rep}", s, s, s, best)
    for m, n, k in [(4096, 4096, 4096), (2048, 14336, 4096)]:
        x2 = torch.randn(m, k, dtype=DT, device="cuda")
        w2 = torch.randn(n, k, dtype=DT, device="cuda") / k ** 0.5
        t = {"cublas": b.time_ms(lambda: torch.nn.functional.linear(x2, w2)),
             "default": b.time_ms(lambda: speedcore.linear(x2, w2, _path="ampere"))}
        report(f"ampere linear {m}x{n}x{k}", m, n, k, t)


def ampere_cfgs_section():
    """Forced Ampere path at 8192^3, every large-tile config (AMPERE_CFGS) against cuBLAS, two rounds."""
    s = 8192
    x = torch.randn(s, s, dtype=DT, device="cuda")
    w = torch.randn(s, s, dtype=DT, device="cuda") / s ** 0.5
    out = torch.empty(s, s, dtype=DT, device="cuda")
    b_kn = w.t().contiguous()
    for rep in range(2):
        for op, cfgs in (("linear", AMPERE_CFGS), ("matmul", AMPERE_CFGS[:3])):
            fn = ((lambda: speedcore.linear(x, w, out=out, _path="ampere")) if op == "linear" else
                  (lambda: speedcore.matmul(x, b_kn, out=out, _path="ampere")))
            t = {"cublas": b.time_ms(lambda: torch.nn.functional.linear(x, w)) if op == "linear" else
                 b.time_ms(lambda: torch.matmul(x, b_kn))}
            for c in cfgs:
                t[f"{c.bm}x{c.bn}s{c.stages}"] = time_forced(fn, mma=c)
            report(f"ampere {op} cfgs #{rep}", s, s, s, t)


def epilogue_section():
    """The fused bias + activation epilogue against the plain GEMM at the bench's fused shape, and the peers."""
    F = torch.nn.functional
    m, n, k = 4096, 14336, 4096
    x = torch.randn(m, k, dtype=DT, device="cuda")
    w = torch.randn(n, k, dtype=DT, device="cuda") / k ** 0.5
    bias = torch.randn(n, dtype=DT, device="cuda")
    fns = {"cublas": lambda: F.linear(x, w), "cublas+bias+silu": lambda: F.silu(F.linear(x, w, bias)),
           "plain": lambda: speedcore.linear(x, w)}
    for act in ("silu", "gelu", "gelu_tanh", "relu"):
        fns[act] = lambda act=act: speedcore.linear(x, w, bias, activation=act)
    for rep in range(2):
        report(f"epilogue {m}x{n}x{k} #{rep}", m, n, k, {name: b.time_ms(fn) for name, fn in fns.items()})


def skinny_section():
    """M = 1 / 16 decode shapes: the default (new rules) and forced skinny configs against cuBLAS, linear (K-major)
    and matmul (N-major); and a 4 KB copy, whose time is the fixed cost of one timed launch."""
    tiny = torch.empty(4096, dtype=torch.uint8, device="cuda")
    tiny2 = torch.empty_like(tiny)
    print(f"fixed cost of a timed launch (4 KB copy): {b.time_ms(lambda: tiny2.copy_(tiny)) * 1e3:.2f} us", flush=True)
    for m, n, k in [(16, 4096, 4096), (1, 4096, 4096), (16, 14336, 4096), (16, 8192, 8192)]:
        x = torch.randn(m, k, dtype=DT, device="cuda")
        w = torch.randn(n, k, dtype=DT, device="cuda") / k ** 0.5
        out = torch.empty(m, n, dtype=DT, device="cuda")
        b_kn = w.t().contiguous()
        for op in ("linear", "matmul"):
            if op == "linear":
                fn = lambda: speedcore.linear(x, w, out=out)  # noqa: E731
                fs = lambda: speedcore.linear(x, w, out=out, _path="skinny")  # noqa: E731
                t = {"cublas": b.time_ms(lambda: torch.nn.functional.linear(x, w))}
            else:
                fn = lambda: speedcore.matmul(x, b_kn, out=out)  # noqa: E731
                fs = lambda: speedcore.matmul(x, b_kn, out=out, _path="skinny")  # noqa: E731
                t = {"cublas": b.time_ms(lambda: torch.matmul(x, b_kn))}
            t["default"] = b.time_ms(fn)
            for name, c in list(SKINNY_CFGS.items())[:3]:
                t[name] = time_forced(fs, mma=c)
            report(f"{op} {m}x{n}x{k}", m, n, k, t)


def mid_section():
    """M = 64 / 128 (the issue's rows nearest 0.8x): the default dispatch against cuBLAS and the alternatives."""
    for m, n, k in [(64, 4096, 4096), (128, 4096, 4096), (64, 4096, 14336), (128, 4096, 14336), (64, 14336, 4096),
                    (128, 8192, 8192)]:
        x = torch.randn(m, k, dtype=DT, device="cuda")
        w = torch.randn(n, k, dtype=DT, device="cuda") / k ** 0.5
        out = torch.empty(m, n, dtype=DT, device="cuda")
        t = {"cublas": b.time_ms(lambda: torch.nn.functional.linear(x, w)),
             "default": b.time_ms(lambda: speedcore.linear(x, w, out=out))}
        for bm, bn in [(64, 32), (64, 64), (64, 128)] + ([(128, 64)] if m == 128 else []):
            t[f"h{bm}x{bn}"] = time_forced(lambda: speedcore.linear(x, w, out=out, _path="hopper"), wgmma=(bm, bn))
        if m == 64:
            t["skinny64"] = time_forced(lambda: speedcore.linear(x, w, out=out, _path="skinny"),
                                        mma=SKINNY_CFGS["s64x32x128w8s4"])
        t["default#2"] = b.time_ms(lambda: speedcore.linear(x, w, out=out))
        report(f"linear {m}x{n}x{k}", m, n, k, t)


if __name__ == "__main__":
    if sys.argv[1:] == ["precompile"]:
        precompile_all()
        sys.exit(0)
    import torch

    import speedcore
    from speedcore import _arrays as A
    from speedcore import _tma
    from speedcore._launch import LaunchConfig, device_info, launch
    from speedcore.bench import Bench

    b = Bench(quick=True)
    dev = device_info(0)
    SMS = dev.sms
    DT = torch.bfloat16
    parts = sys.argv[1:] or ["hopper", "small", "ampere"]
    for p in parts:
        {"hopper": hopper_section, "small": small_section, "ampere": ampere_section, "ampere_cfgs": ampere_cfgs_section, "epilogue": epilogue_section, "skinny": skinny_section,
         "mid": mid_section}[p]()
    print("\n==== A/B summary (ratio to cuBLAS in brackets) ====")
    print("\n".join(rows))
