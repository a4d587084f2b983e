"""Interleaved A/B of w4_wgmma_kernel against an older copy (not a suite): kernels/_quant_sm90_old.cu, when it
exists, is an earlier kernels/quant_sm90.cu (``git show 2faa9c8:kernels/quant_sm90.cu``: split-K through global
partials, the epilogue storing accumulators straight to y), launched with its own argument list on the same
prepacked layers and today's launch shape, on cases without a K split (where the two grids are the same).  Medians
of interleaved rounds, outputs compared, cuBLAS in the same run.

    PYTHONPATH=. python3 benchmarks/_quant_w4_old_ab.py [--same-args] N:K:M ...

--same-args: the old copy takes today's argument list but m_group and the cluster launch (a kernel from 62b9c88 to
b482bb8), so cases with a K split are compared too (one-wave grids only: its tiles are m-fastest).
--today-args: the old copy takes today's argument list but tile_base (a kernel from 1d1efd2 to 7ccefa9): every case.
--all-args: the old copy takes today's whole argument list (a kernel from 4eeba42 on): every case.
Today's launch is planned without a tail launch (tail_splits = 1), which the old copies do not have.
"""
import statistics
import sys

import numpy as np
import torch
import torch.nn.functional as F

import speedcore
from speedcore import _tma, quant as Q
from speedcore._compile import Kernel
from speedcore._launch import launch
from speedcore.bench import Bench

G = 128


def main():
    b = Bench(quick=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    args = sys.argv[1:]
    all_args = "--all-args" in args
    today_args = "--today-args" in args or all_args
    same_args = "--same-args" in args or today_args
    args = [a for a in args if a not in ("--same-args", "--today-args", "--all-args")]
    for arg in args:
        n, k, m = (int(v) for v in arg.split(":"))
        scales = (torch.rand(k // G, n, device="cuda") * 0.01 + 0.001).to(torch.bfloat16)
        qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device="cuda")
        qz = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, device="cuda")
        lay = Q.prepack_awq(qw, qz, scales, group_size=G)
        gl = lay.gemv
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.01
        Q._W4WGMMA_OVERRIDE["tail_splits"] = 1
        cfg, kern, lcfg, scalars, tail = Q._w4wgmma_plan("bfloat16", m, n, k, G, 0, sms, (("tail_splits", 1),))
        assert tail is None
        assert same_args or cfg.splits == 1, "the old kernel's grid order differs with a K split"
        assert today_args or cfg.m_group in (0, cfg.m_tiles), "the old kernel's tiles are m-fastest"
        old_scalars = scalars if all_args else scalars[:-1] if today_args else scalars[:-2]
        old = Kernel("_quant_sm90_old.cu", kern.name, hopper=True)
        y_old = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        tmap = _tma.tile_map_2d(x.data_ptr(), "bfloat16", rows=m, cols=k, row_stride=k, box_rows=cfg.mt, box_cols=64)
        stream = Q.A.stream_of(Q.A.wrap(x, "x"))

        def call_old():
            if same_args:
                launch(old, lcfg, (tmap, y_old.data_ptr(), gl.w4_ptr, gl.w4_g_ptr, 0) + old_scalars, device=0,
                       stream=stream)
            else:
                launch(old, lcfg, (tmap, y_old.data_ptr(), 0, 0, gl.w4_ptr, gl.w4_g_ptr, 0) + old_scalars, device=0,
                       stream=stream)

        y_new = speedcore.awq_linear(x, lay)
        call_old()
        torch.cuda.synchronize()
        same = torch.equal(y_new, y_old)
        t = {"new": [], "old": []}
        for r in range(6):
            for name in (("new", "old") if r % 2 == 0 else ("old", "new")):
                fn = (lambda: speedcore.awq_linear(x, lay)) if name == "new" else call_old
                t[name].append(b.time_ms(fn) * 1e3)
        cub = b.time_ms(lambda: F.linear(x, w)) * 1e3
        tn, to = statistics.median(t["new"]), statistics.median(t["old"])
        diff = np.float32((y_new.float() - y_old.float()).abs().max().item())
        print(f"{n}x{k} M={m} b{cfg.blk} m{cfg.mt} s{cfg.splits}: new {tn:7.1f} us  old {to:7.1f}  new/old {tn / to:.3f}  "
              f"cuBLAS {cub:7.1f}  same bits {same}  max diff {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
