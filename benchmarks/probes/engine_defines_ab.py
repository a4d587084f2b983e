"""Engine batch-1 decode with and without extra -D options of the quantized streaming kernels and the dense GEMMs,
alternated (same machine, same process image): each round runs ``bench-engine`` once per variant in a fresh
process, with ``speedcore.quant._STREAM_DEFINES`` and ``speedcore.gemm._OPTIONS`` extended before the engine is
built (so every gemv_stream_kernel and gemm_mma_kernel launch of that run compiles and takes the variant).
``--quantization none``: the bf16 preset.

    PYTHONPATH=. python3 benchmarks/probes/engine_defines_ab.py --quantization awq --rounds 2 \\
        --variant early=-DSC_QUANT_STREAM_EARLY_W --variant all="; --quant-copies all" \
        --variant nol2="; ; G.L2_AHEAD_BYTES = 0; Q.stream.STREAM_L2_AHEAD_BYTES = 0"

A variant is NAME=DEFINES[; EXTRA bench-engine ARGUMENTS][; PYTHON], the Python run after the imports (G is
speedcore.gemm, Q speedcore.quant) and before the engine is built.

Prints per round and variant the inter-token latency p50 (ms) and output tok/s, then the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

RUN = """import json, sys
import speedcore.gemm as G
import speedcore.quant as Q
Q._STREAM_DEFINES = tuple(sys.argv[2].split()) if sys.argv[2] else ()
G._OPTIONS = G._OPTIONS + Q._STREAM_DEFINES
exec(sys.argv[3])
from speedcore.cli import main
sys.exit(main(json.loads(sys.argv[1])))
"""


def one(args, spec, preset, quantization):
    defines, extra, code = (spec.split(";", 2) + ["", ""])[:3]
    defines = defines.strip()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        cli = ["bench-engine", "--preset", preset, "--batch", "1", "--num-prompts", "4", "--input-len", "128",
               "--output-len", "256", "--json", out] + (["--quantization", quantization] if quantization not in ("", "none") else [])
        cli += extra.split()
        p = subprocess.run([sys.executable, "-c", RUN, json.dumps(cli), defines, code.strip()], capture_output=True, text=True,
                           timeout=args.timeout)
        if p.returncode:
            raise RuntimeError(p.stderr[-2000:])
        with open(out) as f:
            r = json.load(f)
    return r["itl_s"]["p50"] * 1e3, r["output_tok_per_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--quantization", default="awq")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=-DX [-DY][; bench-engine arguments]: a variant beside the default")
    a = ap.parse_args()
    variants = [("default", "")] + [tuple(v.split("=", 1)) for v in a.variant]
    got = {n: [] for n, _ in variants}
    for r in range(a.rounds):
        for name, defines in (variants if r % 2 == 0 else variants[::-1]):
            itl, tok = one(a, defines, a.preset, a.quantization)
            got[name].append((itl, tok))
            print(f"round {r} {name:>10}: ITL p50 {itl:.3f} ms, {tok:.1f} tok/s", flush=True)
    for name, v in got.items():
        print(f"median {name:>10}: ITL p50 {statistics.median(x for x, _ in v):.3f} ms, "
              f"{statistics.median(t for _, t in v):.1f} tok/s")


if __name__ == "__main__":
    main()
