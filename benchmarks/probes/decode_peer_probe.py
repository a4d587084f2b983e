"""Launch shapes of cuDNN's decode kernels against ours (torch profiler trace: grid, block, registers, shared
memory, duration), at the decode bench shapes."""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_diag import ours_and_cudnn, paged_problem  # noqa: E402

SHAPES = [(64, 4096, 32, 8, 128), (8, 32768, 32, 8, 128), (1, 131072, 32, 8, 128), (256, 1024, 32, 32, 128)]


def main():
    import torch
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for batch, seqlen, heads, kvh, hd in SHAPES:
        q, k, v, kc, vc, table, lens, out, wr, q4, nbytes = paged_problem(torch, batch, seqlen, heads, kvh, hd)
        ours, cudnn = ours_and_cudnn(torch, wr, q4, k, v)

        for name, fn in (("ours", ours), ("cudnn", cudnn)):
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    flush.zero_()
                    torch.cuda._sleep(200_000)
                    fn()
                torch.cuda.synchronize()
            path = os.path.join(tempfile.gettempdir(), "trace.json")
            prof.export_chrome_trace(path)
            ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
            seen = set()
            for e in ev:
                a = e.get("args", {})
                if "fill" in e["name"] or "sleep" in e["name"] or "elementwise" in e["name"].lower():
                    continue
                key = e["name"][:60]
                durs = [x["dur"] for x in ev if x["name"][:60] == key]
                if key in seen:
                    continue
                seen.add(key)
                print(f"B{batch} S{seqlen} {name}: {e['name'][:110]} grid={a.get('grid')} block={a.get('block')} "
                      f"regs={a.get('registers per thread')} smem={a.get('shared memory')} "
                      f"occ={a.get('est. achieved occupancy %')} dur_us={[round(d, 1) for d in durs]}", flush=True)
        del kc, vc, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
