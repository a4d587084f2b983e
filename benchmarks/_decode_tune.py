"""Tuning sweep for the paged decode kernel (not a bench suite: prints a table).

python benchmarks/_decode_tune.py  -- sweeps (warps, stages) and num_splits at the bench shapes.
"""
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from speedcore import decode as D  # noqa: E402
from speedcore import _arrays as A  # noqa: E402
from speedcore._compile import Kernel, compile_kernel  # noqa: E402

CONFIGS = [(4, 3, 2), (4, 2, 2)]
SWEEP = {
    (64, 4096, 32, 8, 128): [1, 2],
    (8, 32768, 32, 8, 128): [4, 8, 16],
    (1, 131072, 32, 8, 128): [33, 66, 128],
    (16, 8192, 32, 8, 128): [1, 2, 3],
    (32, 2048, 64, 8, 128): [1, 2],
}


def kern(cfg):
    return Kernel(D.SOURCE, f"paged_decode_kernel<__nv_bfloat16, 128, {cfg[0]}, {cfg[1]}, {cfg[2]}>")


def _compile(cfg):
    c = compile_kernel(kern(cfg), "sm_90")
    return cfg, c.resources["registers"], c.resources["spill_stores"]


def main():
    t0 = time.time()
    with ProcessPoolExecutor(8) as ex:
        for cfg, regs, spill in ex.map(_compile, CONFIGS):
            print(f"compiled {cfg} regs={regs} spill={spill}", flush=True)
    print(f"compile {time.time() - t0:.1f}s", flush=True)
    from speedcore.bench import Bench

    b = Bench(quick=True)
    torch = b.torch
    orig = D.decode_config
    orig_kernel = D._attn_kernel
    for (batch, seqlen, heads, kvh, hd), splits_list in SWEEP.items():
        q = torch.randn(batch, heads, hd, device="cuda", dtype=torch.bfloat16)
        nblocks = batch * seqlen // 16
        kc = torch.randn(nblocks, 16, kvh, hd, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        table = torch.randperm(nblocks, device="cuda").view(batch, -1).int()
        lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        nbytes = 2 * kc.numel() * 2
        wr = [A.wrap(x, n) for x, n in ((q, "q"), (kc, "k_cache"), (vc, "v_cache"), (table, "block_table"),
                                         (lens, "seq_lens"), (out, "out"))]
        default = D._plan_paged_decode(*wr, None, 0.0, -1, sms=132, smem_per_sm=233472)["num_splits"]
        for cfg in CONFIGS:
            w, s, hint = cfg
            smem = max(w * s * 2 * 16 * hd * 2, w * 8 * hd * 4 + w * 64)
            D.decode_config = lambda d, w=w, s=s, smem=smem: (w, s, smem)
            D._attn_kernel = lambda dtype, d, cfg=cfg: kern(cfg)
            D._DECODE_PLANS.clear()
            row = []
            for ns in sorted(set(splits_list + [default])):
                ms = b.time_ms(lambda: D._paged_decode(*wr, None, 0.0, -1, False, num_splits=ns))
                row.append(f"s{ns}{'*' if ns == default else ''}={nbytes / ms / 1e9:.3f}")
            print(f"B{batch} S{seqlen} H{heads}/{kvh} cfg{cfg}: " + " ".join(row), flush=True)
        D.decode_config = orig
        D._attn_kernel = orig_kernel
        D._DECODE_PLANS.clear()
        fn = lambda: D._paged_decode(*wr, None, 0.0, -1, False)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            D._decode_plan(*wr, None, 0.0, -1, None)
        host_us = (time.perf_counter() - t0) / 200 * 1e6
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        launch_us = (time.perf_counter() - t0) / 50 * 1e6
        s_ev, e_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s_ev.record()
        for _ in range(20):
            fn()
        e_ev.record()
        torch.cuda.synchronize()
        ms = s_ev.elapsed_time(e_ev) / 20
        print(f"  default back-to-back (no flush) {nbytes / ms / 1e9:.3f} TB/s; host plan hit {host_us:.1f} us, "
              f"host call {launch_us:.1f} us", flush=True)
        D.decode_config = orig
        D._attn_kernel = orig_kernel
        D._DECODE_PLANS.clear()
        del kc, vc
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
