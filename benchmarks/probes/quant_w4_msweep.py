"""Sweep of w4_wgmma_kernel launch shapes over M (not a suite): per layer and M, today's heuristic shape and each
candidate tile shape forced through _W4WGMMA_OVERRIDE (its split count still chosen by w4wgmma_config), against
cuBLAS F.linear in the same process; AWQ bf16, group 128, L2 flushed, medians.  One line per (layer, M): the ratio
to cuBLAS of the default and of the best candidate, then every candidate's us.

    SPEEDCORE_QUANT_W4WGMMA=1 PYTHONPATH=. python3 benchmarks/probes/quant_w4_msweep.py N:K[:Mmax] ... \\
        [--m 17,64,256] [--cands "mt=192,blk=1,gs=2;mt=256,blk=1,gs=2"]
"""
import sys

import torch
import torch.nn.functional as F

import speedcore
from speedcore import quant as Q
from speedcore.bench import Bench

G = 128
MS = [17, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024, 2048, 4096, 8192]
CANDS = ["mt=64,blk=1,gs=4,ks=2", "mt=64,blk=2,gs=4,ks=2", "mt=128,blk=1,gs=2", "mt=128,blk=2,gs=1",
         "mt=192,blk=1,gs=2", "mt=256,blk=1,gs=2"]


def label(cfg):
    tail = f"+t{cfg.tail_tiles}x{cfg.tail_splits}" if cfg.tail_tiles else ""
    return f"b{cfg.blk}m{cfg.mt}g{cfg.gs}k{cfg.ks}s{cfg.splits}/mg{cfg.m_group}{tail}"


def parse(c):
    return {kv.split("=")[0]: int(kv.split("=")[1]) for kv in c.split(",")}


def main():
    args = sys.argv[1:]
    ms, cands = MS, CANDS
    if "--m" in args:
        i = args.index("--m")
        ms = [int(v) for v in args[i + 1].split(",")]
        del args[i:i + 2]
    if "--cands" in args:
        i = args.index("--cands")
        cands = args[i + 1].split(";")
        del args[i:i + 2]
    b = Bench(quick=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for layer in args:
        parts = [int(v) for v in layer.split(":")]
        n, k = parts[:2]
        m_max = parts[2] if len(parts) > 2 else max(ms)
        scales = (torch.rand(k // G, n, device="cuda") * 0.01 + 0.001).to(torch.bfloat16)
        qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device="cuda")
        qz = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, device="cuda")
        lay = Q.prepack_awq(qw, qz, scales, group_size=G)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.01
        for m in [v for v in ms if v <= m_max]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cub = b.time_ms(lambda: F.linear(x, w)) * 1e3
            res = {}
            for c in ["default"] + cands:
                ov = {} if c == "default" else parse(c)
                try:
                    Q.w4wgmma_config(m, n, k, sms, **ov)
                except ValueError:
                    continue
                Q._W4WGMMA_OVERRIDE.clear()
                Q._W4WGMMA_OVERRIDE.update(ov)
                try:
                    cfg = Q._w4wgmma_plan("bfloat16", m, n, k, G, 0, sms, tuple(sorted(ov.items())))[0]
                    res[label(cfg) if c != "default" else c] = (b.time_ms(lambda: speedcore.awq_linear(x, lay)) * 1e3,
                                                                 cfg)
                finally:
                    Q._W4WGMMA_OVERRIDE.clear()
            d = res["default"]
            best = min((v for kk, v in res.items() if kk != "default"), key=lambda v: v[0], default=d)
            bc = best[1]
            dc = d[1]
            print(f"{n}x{k} M={m:<5} cuBLAS {cub:8.1f}  default {label(dc)} {d[0]:8.1f} ({cub / d[0]:.3f})  best "
                  f"{label(bc)} {best[0]:8.1f} ({cub / best[0]:.3f})  | "
                  + " ".join(f"{kk} {v[0]:.1f}" for kk, v in res.items() if kk != "default"), flush=True)


if __name__ == "__main__":
    main()
