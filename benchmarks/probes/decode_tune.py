"""Tuning sweep for the paged decode kernel (not a bench suite: prints a table).

python benchmarks/probes/decode_tune.py [rounds]  -- at each shape, torch SDPA's cuDNN backend and our kernel (w4s3: the
shipped 4 warps x 3 stages; nopg: the same with PAGE16 off, i.e. a page lookup per row; the (warps, stages)
configurations named in $DECODE_CONFIGS, e.g. "w3s4,w8s3"), interleaved, in the same process and on the same data
(ours on a shuffled paged copy).  A variant named ``old`` runs kernels/_decode_old.cu when that file exists (a copy
of an earlier kernels/decode.cu, for A/B runs; its merge as a plain launch unless the copy's merge waits
in-kernel).
The variants named in $DECODE_CONTIG (default w4s3) also run on a contiguous cache: views (batch, seqlen,
kv_heads, hd) of the peers' (batch, kv_heads, seqlen, hd) tensors, one page per sequence, so each head's rows are
read contiguously as cuDNN reads them.  Every variant's output is checked against cuDNN's.
"""
import dataclasses
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from speedcore import decode as D  # noqa: E402
from speedcore._compile import Kernel, compile_kernel  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_diag import contiguous_args, paged_problem  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OLD_PATH = os.path.join(HERE, "..", "..", "kernels", "_decode_old.cu")
OLD = os.path.exists(OLD_PATH)
OLD_TEXT = open(OLD_PATH).read() if OLD else ""
OLD_PDL = "grid_dependency_wait" in OLD_TEXT  # its merge waits in-kernel: launched as the current one is
OLD_PAGE16 = "PAGE16" in OLD_TEXT
OLD_PAIR = "bool PAIR" in OLD_TEXT
# name -> (source, warps, stages)
# nopg: PAGE16 off (per-row page lookup); hN ($DECODE_HINTS, e.g. "0,1"): the shipped kernel with cp.async L2 hint N
# instead of L2_HINT (see cp_async_kv)
VARIANTS = {"w4s3": ("decode.cu", 4, 3), "nopg": ("decode.cu", 4, 3)}
VARIANTS.update({f"h{h}": ("decode.cu", 4, 3) for h in os.environ.get("DECODE_HINTS", "").split(",") if h})
# $DECODE_CONFIGS: more (warps, stages) configurations of the current kernel, e.g. "w3s4,w8s3", run at every shape
# with the split heuristic's count.
for _c in filter(None, os.environ.get("DECODE_CONFIGS", "").split(",")):
    VARIANTS[_c] = ("decode.cu", int(_c[1:].split("s")[0]), int(_c.split("s")[1]))
CONTIG = tuple(os.environ.get("DECODE_CONTIG", "w4s3").split(","))
if OLD:
    VARIANTS = {"old": ("_decode_old.cu", 4, 3), **VARIANTS}
# (batch, seqlen, heads, kv_heads, head_dim) -> {variant: split counts (None: the heuristic's)}
SWEEP = {
    (64, 4096, 32, 8, 128): {"old": [None], "nopg": [None], "w4s3": [None, 2]},
    (8, 32768, 32, 8, 128): {"old": [None], "nopg": [None], "w4s3": [None]},
    (1, 131072, 32, 8, 128): {"old": [None], "nopg": [None], "w4s3": [None]},
    (256, 1024, 32, 32, 128): {"old": [None], "nopg": [None], "w4s3": [None]},
    (16, 8192, 32, 8, 128): {"old": [None], "nopg": [None], "w4s3": [None]},
    (32, 2048, 64, 8, 128): {"old": [None], "nopg": [None], "w4s3": [None, 2]},
}


def kernels(name, page16=True, pair=False):
    src, w, s = VARIANTS[name]
    # The old copy may predate the PAGE16 / PAIR template parameters (then it takes the defaults).
    tail = "" if name == "old" and not OLD_PAGE16 else f", {'true' if page16 and name != 'nopg' else 'false'}"
    if name != "old" or OLD_PAIR:
        tail += f", {'true' if pair else 'false'}"
    hint = int(name[1:]) if name[0] == "h" and name[1:].isdigit() else D.L2_HINT
    return (Kernel(src, f"paged_decode_kernel<__nv_bfloat16, 128, {w}, {s}, {hint}{tail}>"),
            Kernel(src, "decode_merge_kernel<__nv_bfloat16, 128>"))


_PLAN = D._decode_plan


def _plain_merge_plan(*a):
    p = _PLAN(*a)
    return {**p, "merge_cfg": dataclasses.replace(p["merge_cfg"], overlap=False)}


def use(name):
    """Point the module at one variant (kernels, config and the split heuristic's occupancy)."""
    _, w, s = VARIANTS[name]
    D.DECODE_CONFIGS[128] = (w, s)
    D.PAIR_MERGE = name != "old" or OLD_PAIR  # two splits merged in-kernel (sm_90 clusters)
    D._decode_plan = _plain_merge_plan if name == "old" and not OLD_PDL else _PLAN
    D.decode_config.cache_clear()
    D.decode_num_splits.cache_clear()
    D._attn_kernel = lambda dtype, d, page16=True, pair=False: kernels(name, page16, pair)[0]
    D._merge_kernel = lambda dtype, d: kernels(name)[1]
    D._FAST_DECODE.clear()  # launches cached with the previous variant's kernels


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    t0 = time.time()
    ks = [k for n in VARIANTS for k in kernels(n)] + [kernels("w4s3", False)[0]]
    with ThreadPoolExecutor(8) as ex:
        for k, c in zip(ks, ex.map(lambda k: compile_kernel(k, "sm_90"), ks)):
            r = c.resources
            print(f"compiled {k.source} {k.name} regs={r['registers']} spill={r['spill_stores']}", flush=True)
    print(f"compile {time.time() - t0:.1f}s", flush=True)
    from speedcore.bench import Bench
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = Bench(quick=False)
    torch = b.torch
    F = torch.nn.functional
    summary = []
    for (batch, seqlen, heads, kvh, hd), plan in SWEEP.items():
        q, k, v, kc, vc, table, lens, out, wr, q4, nbytes = paged_problem(torch, batch, seqlen, heads, kvh, hd)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=heads != kvh)  # noqa: E731
            ref = cudnn().view_as(q).float()
        results = {}
        wr_c = contiguous_args(torch, wr, k, v)
        if heads != kvh or batch * heads <= 8192:
            try:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    fl = lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=heads != kvh)  # noqa: E731
                    results["flash"] = [nbytes / b.time_ms(fl) / 1e9]
            except Exception as e:  # noqa: BLE001
                print(f"  flash unavailable: {e}", flush=True)
        for _ in range(rounds):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                results.setdefault("cudnn", []).append(nbytes / b.time_ms(cudnn) / 1e9)
            extra = {n: [None] for n in VARIANTS if n not in plan}
            for name, splits_list in {**plan, **extra}.items():
                if name not in VARIANTS:
                    continue
                use(name)
                default = D._plan_paged_decode(*wr, None, 0.0, -1, sms=132, smem_per_sm=233472)["num_splits"]
                for ns in splits_list:
                    ns = ns or default
                    tag = f"{name}/s{ns}{'*' if ns == default else ''}"
                    for args, suffix in [(wr, "")] + ([(wr_c, "/contig")] if name in CONTIG else []):
                        fn = lambda: D._paged_decode(*args, None, 0.0, -1, False, num_splits=ns)  # noqa: E731
                        fn()
                        torch.cuda.synchronize()
                        err = (out.float() - ref).abs().max().item()
                        if not err < 5e-2:
                            print(f"  WRONG {tag}{suffix}: max err {err}", flush=True)
                        results.setdefault(tag + suffix, []).append(nbytes / b.time_ms(fn) / 1e9)
        case = f"B{batch} S{seqlen} H{heads}/{kvh}"
        base = max(results["cudnn"])
        row = " ".join(f"{t}={max(v):.3f}({max(v) / base:.3f})[{min(v):.3f}]" for t, v in results.items())
        print(f"{case}: {row}", flush=True)
        summary.append(f"{case}: " + " ".join(f"{t}={max(v) / base:.3f}" for t, v in results.items()))
        del kc, vc, k, v
        torch.cuda.empty_cache()
    print("---- ratios to cuDNN (best of rounds) ----")
    for line in summary:
        print(line)


if __name__ == "__main__":
    main()
