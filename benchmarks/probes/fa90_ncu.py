"""One launch each of ours and torch SDPA's cuDNN kernel between cudaProfilerStart/Stop, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \
        python3 benchmarks/probes/fa90_ncu.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import speedcore  # noqa: E402

CASES = [(128, False, 512), (64, True, 512), (128, False, 4096)]

for d, causal, s in CASES:
    batch, h = max(1, 16384 // s), 2048 // d
    q, k, v = (torch.randn(batch, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        peer = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa
        for _ in range(3):
            peer()
            speedcore.flash_attn(q, k, v, causal=causal)
        torch.cuda.synchronize()
        print(f"case d{d} causal={causal} s{s}", flush=True)
        torch.cuda.profiler.start()
        speedcore.flash_attn(q, k, v, causal=causal)
        peer()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
