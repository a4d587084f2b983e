"""Same-run A/B of w4_wgmma_kernel launch shapes forced through _W4WGMMA_OVERRIDE on one layer (AWQ bf16):

    PYTHONPATH=. python3 benchmarks/_quant_w4_split_ab.py N:K:M "blk=2,splits=3" "blk=1,splits=2" ...

Prints us per shape (medians, L2 flushed), the default shape first, rounds interleaved, and cuBLAS F.linear."""
import sys

import torch

import speedcore
from speedcore import quant as Q
from speedcore.bench import Bench

G = 128


def main():
    b = Bench(quick=True)
    n, k, m = (int(v) for v in sys.argv[1].split(":"))
    shapes = [{}] + [{kv.split("=")[0]: int(kv.split("=")[1]) for kv in a.split(",")} for a in sys.argv[2:]]
    dev = "cuda"
    scales = (torch.rand(k // G, n, device=dev) * 0.01 + 0.001).to(torch.bfloat16)
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device=dev)
    qz = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, device=dev)
    lay = Q.prepack_awq(qw, qz, scales, group_size=G)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.01
    times = {i: [] for i in range(len(shapes))}
    ref = None
    for rnd in range(3):
        order = range(len(shapes)) if rnd % 2 == 0 else reversed(range(len(shapes)))
        for i in order:
            Q._W4WGMMA_OVERRIDE.clear()
            Q._W4WGMMA_OVERRIDE.update(shapes[i])
            y = speedcore.awq_linear(x, lay)
            if ref is None:
                ref = y
            assert torch.equal(y, ref) or (y.float() - ref.float()).abs().max() < 1e-2 * ref.float().abs().max()
            times[i].append(b.time_ms(lambda: speedcore.awq_linear(x, lay)) * 1e3)
    Q._W4WGMMA_OVERRIDE.clear()
    cub = b.time_ms(lambda: torch.nn.functional.linear(x, w)) * 1e3
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for i, sh in enumerate(shapes):
        cfg = Q._w4wgmma_plan("bfloat16", m, n, k, G, 0, sms, tuple(sorted(sh.items())))[0]
        t = sorted(times[i])[1]
        tail = f" + tail {cfg.tail_tiles} x {cfg.tail_splits}" if cfg.tail_tiles else ""
        print(f"{n}x{k} M={m} {sh or 'default'} b{cfg.blk} m{cfg.mt} s{cfg.splits} grid {cfg.grid}{tail}: {t:7.1f} us  "
              f"cuBLAS {cub:7.1f}  ratio {cub / t:.3f}", flush=True)


if __name__ == "__main__":
    main()
