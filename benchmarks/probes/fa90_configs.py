"""Same-process A/B of sm_90 attention tile configurations (BN, stages, NC, pingpong) against cuDNN, for the
pure table in speedcore/attention.py (_SM90_TILES).  Not a bench suite: not recorded.

    PYTHONPATH=. python3 benchmarks/probes/fa90_configs.py
"""
import os
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from speedcore import attention as att  # noqa: E402

# (d, causal, seqlen, dtype, alternatives): short masked head dim 64 (the table's SM90_SHORT entry).
D64S = [(128, 4, 3, False), (128, 2, 2, False), (128, 3, 2, False), (128, 4, 2, True)]
CASES = [(64, True, 512, "bfloat16", D64S), (64, True, 512, "float16", D64S), (64, True, 1024, "bfloat16", D64S)]
ROUNDS = 2


def _compile(k):
    from speedcore._compile import compile_kernel

    compile_kernel(k, "sm_90a")


def main():
    ks = []
    for d, causal, s, dt, alts in CASES:
        for alt in alts:
            k = att._kernel_sm90(dt, d, *alt, False)
            if k not in ks and att.smem_bytes_sm90(d, alt[0], alt[1], alt[2]) <= 227 * 1024:
                ks.append(k)
        k = att._kernel_sm90(dt, *att.flash_attn_sm90_config(d, causal, False, s <= att.SM90_SHORT), False)
        if k not in ks:
            ks.append(k)
    with ProcessPoolExecutor(16) as ex:
        list(ex.map(_compile, ks))

    import speedcore
    from speedcore.bench import Bench
    from fa90_trace import bench_case

    b = Bench(quick=True)
    torch = b.torch
    for d, causal, s, dt, alts in CASES:
        q, k, v, flops, cudnn = bench_case(b, d, causal, s, getattr(torch, dt))
        run = lambda: speedcore.flash_attn(q, k, v, causal=causal)  # noqa: E731
        cfg = att.flash_attn_sm90_config(d, causal, False, s <= att.SM90_SHORT)[1:]
        line = f"{dt[:4]} d{d} {'causal' if causal else 'full'} s{s}: cudnn {cudnn:.0f}"
        orig = att.flash_attn_sm90_config
        for _ in range(ROUNDS):
            base = flops / b.time_ms(run) / 1e9
            line += f" || default {cfg} {base / cudnn:.3f}"
            for alt in alts:
                if att.smem_bytes_sm90(d, alt[0], alt[1], alt[2]) > 227 * 1024:
                    continue
                att.flash_attn_sm90_config = (lambda hd, m=False, sc=False, sh=False, alt=alt:
                                              (att.sm90_head_dim(hd), *alt))
                try:
                    run()
                    t = flops / b.time_ms(run) / 1e9
                    line += f" | {alt} {t / cudnn:.3f}"
                except Exception as exc:  # noqa: BLE001
                    line += f" | {alt} {type(exc).__name__}"
                finally:
                    att.flash_attn_sm90_config = orig
        if causal:  # the tile order: head-major instead of grouped (attention.sm90_head_group_log2)
            orig_group = att.sm90_head_group_log2
            att.sm90_head_group_log2 = lambda *a: 0
            try:
                t = flops / b.time_ms(run) / 1e9
                line += f" | head-major {t / cudnn:.3f}"
            finally:
                att.sm90_head_group_log2 = orig_group
        print(line, flush=True)


if __name__ == "__main__":
    main()
