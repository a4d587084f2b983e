"""Interleaved A/B of w4_wgmma_kernel's two-rank split-K epilogue (not a suite): builds with -DW4_SPLIT_PACK=32 / 24
/ 16 (the partials the two ranks of a cluster hand each other: fp32, top 24 bits, bf16; kernels/quant_sm90.cu), by
pulls from ring slots (-DW4_NO_PUSH) or pushes into a receive buffer where it fits (the default), same launch,
same process, medians of interleaved rounds, cuBLAS in the same run; and each build's error against a float64
reference (max |y - ref| / max |ref|) and the fraction of y elements that differ from the fp32 build.

    PYTHONPATH=. python3 benchmarks/_quant_w4_pack_ab.py [--variants BITS:PUSH:STAGES,...] N:K:M ...

--variants: the builds compared, BITS:PUSH:STAGES[:NAME], the first the reference of "differ" (default
32:0:0,24:0:0,24:1:0,16:1:0); STAGES caps the ring's stages (0: as configured), e.g. to make room for the receive
buffer; NAME a macro defined in that build (-DNAME, an experiment switch of kernels/quant_sm90.cu).
"""
import statistics
import sys

import numpy as np
import torch
import torch.nn.functional as F

import speedcore
from speedcore import quant as Q
from speedcore._compile import Kernel
from speedcore.bench import Bench

G = 128
# (bits, push, stages): the old pull of fp32, the pull of 24-bit partials, the push of 24 / 16 bits
PACKS = ((32, False, 0, ""), (24, False, 0, ""), (24, True, 0, ""), (16, True, 0, ""))
NAMES = {}
_stages = Q.w4wgmma_stages


def build(pack):
    orig = build.orig
    defs = (f"-DW4_SPLIT_PACK={pack[0]}",) + (() if pack[1] else ("-DW4_NO_PUSH",)) + \
        ((f"-D{pack[3]}",) if pack[3] else ())

    def kern(*a, **kw):
        k = orig(*a, **kw)
        return Kernel(k.source, k.name, k.options + defs, hopper=True)
    return kern


build.orig = Q._w4wgmma_kernel


def use(pack):
    Q._w4wgmma_kernel = build(pack)
    Q.W4WGMMA_SPLIT_PACK = pack[0]  # the receive buffer's size, as the build computes it

    def stages(mt, blk=Q.W4WGMMA_BLK, ks=1, kind=Q.KIND_INT4, splits=1):
        # pulls through ring slots: the whole ring, as before the receive buffer
        return min(_stages(mt, blk, ks, kind, splits if pack[1] else 1), pack[2] or 99)
    Q.w4wgmma_stages = stages
    for f in vars(Q).values():
        if hasattr(f, "cache_clear"):
            f.cache_clear()


def main():
    global PACKS
    args = sys.argv[1:]
    if "--variants" in args:
        i = args.index("--variants")
        PACKS = tuple((int(f[0]), bool(int(f[1])), int(f[2]), f[3] if len(f) > 3 else "")
                      for f in (v.split(":") for v in args[i + 1].split(",")))
        del args[i:i + 2]
    NAMES.update({p: f"{'push' if p[1] else 'pull'}{p[0]}" + (f"st{p[2]}" if p[2] else "") +
                  (f"+{p[3]}" if p[3] else "") for p in PACKS})
    b = Bench(quick=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    Q._W4WGMMA_OVERRIDE["tail_splits"] = 1
    for arg in args:
        n, k, m = (int(v) for v in arg.split(":"))
        for dt in (torch.bfloat16, torch.float16):
            rng = np.random.default_rng(n + k + m)
            q = rng.integers(0, 16, (k, n))
            z = rng.integers(0, 16, (k // G, n))
            s = (rng.random((k // G, n)) * 0.01 + 0.001).astype(np.float32)
            qw = torch.from_numpy(Q.pack_awq(q).view(np.int32)).cuda()
            qz = torch.from_numpy(Q.pack_awq(z).view(np.int32)).cuda()
            scales = torch.from_numpy(s).cuda().to(dt)
            lay = Q.prepack_awq(qw, qz, scales, group_size=G)
            wd = ((torch.from_numpy(q).cuda().double() - torch.from_numpy(z).cuda().double().repeat_interleave(G, 0))
                  * scales.double().repeat_interleave(G, 0))
            x = torch.randn(m, k, device="cuda", dtype=dt)
            ref = x.double() @ wd
            cfg = Q._w4wgmma_plan(str(dt).split(".")[1], m, n, k, G, 0, sms, (("tail_splits", 1),))[0]
            ys = {}
            for p in PACKS:
                use(p)
                ys[p] = speedcore.awq_linear(x, lay)
            torch.cuda.synchronize()
            errs = {p: ((ys[p].double() - ref).abs().max() / ref.abs().max()).item() for p in PACKS}
            diff = {p: (ys[p] != ys[PACKS[0]]).float().mean().item() for p in PACKS}
            line = f"{n}x{k} M={m} {str(dt)[6:]:8s} b{cfg.blk} m{cfg.mt} s{cfg.splits}:"
            if dt == torch.bfloat16:
                t = {p: [] for p in PACKS}
                for r in range(5):
                    for p in (PACKS if r % 2 == 0 else PACKS[::-1]):
                        use(p)
                        t[p].append(b.time_ms(lambda: speedcore.awq_linear(x, lay)) * 1e3)
                w = torch.randn(n, k, device="cuda", dtype=dt) * 0.01
                cub = b.time_ms(lambda: F.linear(x, w)) * 1e3
                med = {p: statistics.median(t[p]) for p in PACKS}
                line += "".join(f"  {NAMES[p]} {med[p]:6.1f} us" for p in PACKS) + f"  cuBLAS {cub:6.1f}  ratio " + \
                    " / ".join(f"{cub / med[p]:.3f}" for p in PACKS)
            line += "  err " + " / ".join(f"{errs[p]:.2e}" for p in PACKS) + "  differ " + \
                " / ".join(f"{diff[p]:.4f}" for p in PACKS)
            print(line, flush=True)
    use((24, True, 0, ""))


if __name__ == "__main__":
    main()
