"""Where the paging cost comes from: our decode kernel on the same K/V in 16-token pages placed in different orders
(same process, interleaved with SDPA's cuDNN backend on the contiguous tensors; ratios to cuDNN).

  rand    a random permutation of all pages (the bench's layout)
  sorted  each sequence's random pages, ascending in the block table (same pages as rand, other order)
  local   pages shuffled only inside groups of 64 (2 MB of K per group), groups in order
  chunkG  runs of G consecutive pages in a random order (G = 4 runs a CTA's 4 warps' concurrent tiles in 128 KB)
  ident   pages in order (heads still interleaved: a head's 256-byte rows at a 2 KB stride)
  contig  the peers' (batch, kv_heads, seqlen, hd) tensors as one page per sequence (each head's rows contiguous)

and, for each cluster size in $CLUSTERS (e.g. "2,4,8"), the rand layout launched in thread-block clusters of that
many consecutive CTAs (the KV heads of one sequence run in one GPC at the same time).

python benchmarks/probes/decode_layout_probe.py [rounds]
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from speedcore import decode as D  # noqa: E402
from speedcore import _arrays as A  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_diag import paged_caches  # noqa: E402

SHAPES = [(64, 4096, 32, 8, 128), (8, 32768, 32, 8, 128), (1, 131072, 32, 8, 128), (256, 1024, 32, 32, 128),
          (16, 8192, 32, 8, 128)]
LAYOUTS = os.environ.get("LAYOUTS", "rand,sorted,local,ident,contig").split(",")
CLUSTERS = [int(c) for c in os.environ.get("CLUSTERS", "").split(",") if c]
_PLAN = D._decode_plan


def clustered(c):
    def plan(*a):
        p = _PLAN(*a)
        return {**p, "cfg": dataclasses.replace(p["cfg"], cluster=c)}
    return plan


def perm_for(torch, layout, batch, n):
    if layout == "rand":
        return torch.randperm(n, device="cuda")
    if layout == "sorted":
        return torch.randperm(n, device="cuda").view(batch, -1).sort(dim=1).values.flatten()
    if layout == "local":
        key = torch.arange(n, device="cuda") // 64 + torch.rand(n, device="cuda") * 0.5
        return key.argsort()
    if layout.startswith("chunk"):
        g = int(layout[5:])
        runs = torch.randperm(n // g, device="cuda")
        return (runs.view(-1, 1) * g + torch.arange(g, device="cuda")).flatten()
    return torch.arange(n, device="cuda")


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    from speedcore.bench import Bench
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = Bench(quick=False)
    torch = b.torch
    F = torch.nn.functional
    lines = []
    for batch, seqlen, heads, kvh, hd in SHAPES:
        dt = torch.bfloat16
        q = torch.randn(batch, heads, hd, device="cuda", dtype=dt)
        k = torch.randn(batch, kvh, seqlen, hd, device="cuda", dtype=dt)
        v = torch.randn_like(k)
        q4 = q.view(batch, heads, 1, hd)
        nbytes = 2 * k.numel() * 2
        n = batch * seqlen // 16
        lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=heads != kvh)  # noqa: E731
            ref = cudnn().view_as(q).float()
        res = {}
        for layout in LAYOUTS:
            if layout == "contig":
                kc, vc = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
                table = torch.arange(batch, dtype=torch.int32, device="cuda").view(batch, 1)
            else:
                kc, vc, table = paged_caches(torch, k, v, perm_for(torch, layout, batch, n))
            wr = [A.wrap(x, nm) for x, nm in ((q, "q"), (kc, "k_cache"), (vc, "v_cache"), (table, "block_table"),
                                               (lens, "seq_lens"), (out, "out"))]
            for c in [1] + (CLUSTERS if layout == "rand" else []):
                def fn(wr=wr, c=c):
                    D._decode_plan = clustered(c) if c > 1 else _PLAN
                    D._paged_decode(*wr, None, 0.0, -1, False)
                name = layout if c == 1 else f"{layout}/c{c}"
                out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                err = (out.float() - ref).abs().max().item()
                if not err < 5e-2:
                    print(f"  WRONG {name}: max err {err}", flush=True)
                res[name] = (fn, [])
        res["cudnn"] = (cudnn, [])
        for _ in range(rounds):
            for name, (fn, ts) in res.items():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ts.append(nbytes / b.time_ms(fn) / 1e9)
        base = max(res["cudnn"][1])
        case = f"B{batch} S{seqlen} H{heads}/{kvh}"
        row = " ".join(f"{nm}={max(ts):.3f}({max(ts) / base:.3f})" for nm, (fn, ts) in res.items())
        print(f"{case}: {row}", flush=True)
        lines.append(f"{case}: " + " ".join(f"{nm}={max(ts) / base:.3f}" for nm, (fn, ts) in res.items()))
        del res, kc, vc, cudnn
        torch.cuda.empty_cache()
    print("---- ratios to cuDNN (best of rounds) ----")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
