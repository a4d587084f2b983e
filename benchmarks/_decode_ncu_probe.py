"""One launch each of ours (paged, and on a contiguous view) and cuDNN at one decode shape, for ncu:
ncu --kernel-name regex:'paged_decode|cudnn_generated' --metrics ... python benchmarks/_decode_ncu_probe.py B S H KVH"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from speedcore import _arrays as A  # noqa: E402
from speedcore import decode as D  # noqa: E402
from _decode_diag import paged_problem  # noqa: E402


def main():
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, seqlen, heads, kvh = (int(x) for x in sys.argv[1:5])
    q, k, v, kc, vc, table, lens, out, wr, q4, nbytes = paged_problem(torch, batch, seqlen, heads, kvh, 128)
    wr_c = list(wr)
    wr_c[1] = A.wrap(k.permute(0, 2, 1, 3), "k_cache")
    wr_c[2] = A.wrap(v.permute(0, 2, 1, 3), "v_cache")
    wr_c[3] = A.wrap(torch.arange(batch, dtype=torch.int32, device="cuda").view(batch, 1), "block_table")
    D._paged_decode(*wr, None, 0.0, -1, False)
    D._paged_decode(*wr_c, None, 0.0, -1, False)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=heads != kvh)
    torch.cuda.synchronize()
    print("bytes", nbytes)


if __name__ == "__main__":
    main()
