"""Same-run probe for the small-M paths (not a suite): the shipped dispatch ("ours"), the same kernels without the
register pipeline ("prev": -DSC_QUANT_STREAM_UNPIPELINED, the schedule of 4cac392), with the per-chunk zero point /
scale and the pipeline also at M > 8 ("mt2 xsum": -DSC_QUANT_XSUM_MT2 -DSC_QUANT_PIPELINE_MT2), gemv_stream_kernel and
gemv_bulk_kernel forced with a few launch shapes, and cuBLAS (F.linear, same dtype).  Every variant's output is
checked against the shipped one (relative error printed when above 1e-3).  Prints one line per case, a summary
table last.  The layers and the forcing (``layer_of``, ``run_as``) serve quant_m1_sweep.py too."""
import time

import torch
import torch.nn.functional as F

import speedcore
from speedcore import quant as Q
from speedcore.bench import Bench

b = Bench(quick=True)
t0 = time.time()
G = 128
PREV = ("-DSC_QUANT_STREAM_UNPIPELINED",)
MT2 = ("-DSC_QUANT_XSUM_MT2", "-DSC_QUANT_PIPELINE_MT2")
summary = []


def run_as(call, x, which, defines=(), **override):
    """which: "ours" (the dispatch), "stream" / "bulk" (that kernel forced, launch-shape overrides)."""
    saved = (Q._STREAM_MODE, Q._BULK_MODE, Q._STREAM_DEFINES)
    if which != "ours":
        Q._STREAM_MODE = "on"
        Q._BULK_MODE = "on" if which == "bulk" else "off"
        (Q._BULK_OVERRIDE if which == "bulk" else Q._STREAM_OVERRIDE).update(override)
    Q._STREAM_DEFINES = tuple(defines)
    try:
        y = call(x)
        return b.time_ms(lambda: call(x)), y
    finally:
        Q._STREAM_MODE, Q._BULK_MODE, Q._STREAM_DEFINES = saved
        Q._STREAM_OVERRIDE.clear()
        Q._BULK_OVERRIDE.clear()


def layer_of(fmt, n, k, dt):
    dev = b.device
    if fmt == "int8":
        w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=dev)
        s = (torch.rand(n, device=dev) * 0.01 + 0.001).to(dt)
        layer = Q.prepack_int8(w8, s)
        return lambda x: speedcore.int8_linear(x, layer)
    scales = (torch.rand(k // G, n, device=dev) * 0.01 + 0.001).to(dt)
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device=dev)
    qz = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, device=dev)
    layer = Q.prepack_awq(qw, qz, scales, group_size=G)
    return lambda x: speedcore.awq_linear(x, layer)


def case(fmt, n, k, dt, ms, variants=()):
    call = layer_of(fmt, n, k, dt)
    w = torch.randn(n, k, device=b.device, dtype=dt) * 0.01
    for m in ms:
        x = torch.randn(m, k, device=b.device, dtype=dt)
        ours, y = run_as(call, x, "ours")
        row = {"ours": ours}
        for name, which, defines, ov in [("prev", "ours", PREV, {})] + list(variants):
            t, yv = run_as(call, x, which, defines, **ov)
            row[name] = t
            err = ((yv.float() - y.float()).norm() / y.float().norm()).item()
            if not err < 1e-3:
                print(f"    !! {name}: relative difference to ours {err:.2e}", flush=True)
        cub = b.time_ms(lambda: F.linear(x, w))
        label = f"{fmt:4s} {str(dt)[6:]:8s} M={m:<2d} {n:>5d}x{k:<5d}"
        print(f"{label} " + " ".join(f"{nm} {t*1e3:5.1f}us x{cub/t:4.2f}" for nm, t in row.items())
              + f" | cuBLAS {cub*1e3:5.1f}us", flush=True)
        summary.append((label, row, cub))
    del w
    torch.cuda.empty_cache()


def main():
    bf, fp = torch.bfloat16, torch.float16
    tiny = torch.ones(1, device=b.device)
    print(f"launch floor: tiny add_ {b.time_ms(lambda: tiny.add_(1.0))*1e3:.1f} us", flush=True)
    S16 = [("stream", "stream", (), {}), ("bulk", "bulk", (), {}), ("mt2 xsum", "ours", MT2, {}),
           ("bulk xsum", "bulk", MT2, {})]
    S1 = [("stream", "stream", (), {}), ("bulk", "bulk", (), {})]
    case("awq", 8192, 8192, bf, [16, 12, 9], S16)
    case("awq", 8192, 8192, bf, [1, 4], S1)
    case("awq", 28672, 8192, bf, [16], S16)
    case("awq", 28672, 8192, bf, [1], S1)
    case("awq", 8192, 28672, bf, [1, 16], S16[:2])
    case("awq", 4096, 4096, bf, [1, 16], S16[:2])
    case("awq", 8192, 8192, fp, [1, 16], S16[:2])
    case("int8", 8192, 8192, bf, [1, 16], S1)
    case("int8", 8192, 8192, fp, [1], S1)
    case("int8", 28672, 8192, bf, [1], S1)

    print(f"\nprobe done in {time.time() - t0:.0f}s\nsummary (us, xR = cuBLAS / time)")
    names = ["ours", "prev"] + [v[0] for v in S16]
    print(f"{'case':30s} " + " ".join(f"{nm[:10]:>11s}" for nm in names) + "  cuBLAS")
    for label, row, cub in summary:
        cells = " ".join((f"{row[nm]*1e3:5.1f}x{cub/row[nm]:4.2f}" if nm in row else "").rjust(11) for nm in names)
        print(f"{label:30s} {cells} {cub*1e3:6.1f}")


if __name__ == "__main__":
    main()
