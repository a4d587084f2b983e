"""One launch each of ours (paged, and on a contiguous view) and cuDNN at one decode shape, for ncu:
ncu --kernel-name regex:'paged_decode|cudnn_generated' --metrics ... python benchmarks/probes/decode_ncu_probe.py B S H KVH"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from speedcore import decode as D  # noqa: E402
from decode_diag import contiguous_args, paged_problem  # noqa: E402


def main():
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, seqlen, heads, kvh = (int(x) for x in sys.argv[1:5])
    q, k, v, kc, vc, table, lens, out, wr, q4, nbytes = paged_problem(torch, batch, seqlen, heads, kvh, 128)
    wr_c = contiguous_args(torch, wr, k, v)
    D._paged_decode(*wr, None, 0.0, -1, False)
    D._paged_decode(*wr_c, None, 0.0, -1, False)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=heads != kvh)
    torch.cuda.synchronize()
    print("bytes", nbytes)


if __name__ == "__main__":
    main()
