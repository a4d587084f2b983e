"""``python -m speedcore {info,compile,bench,generate,bench-engine,quantize,serve}``."""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def _info(args) -> int:
    import speedcore
    from . import _compile, _registry

    print(f"speedcore {speedcore.__version__}")
    try:
        import cupy

        print(f"cupy {cupy.__version__}")
        print(f"nvrtc {'.'.join(map(str, _compile.nvrtc_version()))}")
    except Exception as e:
        print(f"cupy: unavailable ({e})")
    try:
        print(f"cuda headers {_compile.cuda_include_dir()}")
    except Exception as e:
        print(f"cuda headers: {e}")
    try:
        from cupy.cuda import runtime

        print(f"driver {runtime.driverGetVersion()}")
        from ._launch import device_info

        for i in range(runtime.getDeviceCount()):
            d = device_info(i)
            print(f"gpu {i}: {d.name} {d.arch}, {d.sms} SMs, {d.smem_per_block_optin // 1024} KiB shared memory "
                  f"per block, {d.l2_bytes >> 20} MiB L2")
    except Exception as e:
        print(f"gpus: none ({type(e).__name__}: {e})")
    cdir = _compile.cache_dir()
    files = list(cdir.glob("*.cubin")) if cdir.is_dir() else []
    size = sum(f.stat().st_size for f in files)
    print(f"cache {cdir}: {len(files)} variants, {size / 1e6:.1f} MB")
    errors: dict = {}
    for name, mod in _registry.op_modules(errors).items():
        ks = mod.all_kernels()
        print(f"kernels {name}: {len(ks)} variants from kernels/{ks[0].source if ks else '?'}")
    for name, e in errors.items():
        print(f"kernels {name}: cannot import ({type(e).__name__}: {e})")
    return 0


def _compile_one(job):
    kernel, arch = job
    from ._compile import CompileError, compile_kernel

    t0 = time.perf_counter()
    try:
        c = compile_kernel(kernel, arch)
        return kernel, arch, c.resources, None, time.perf_counter() - t0
    except CompileError as e:
        return kernel, arch, None, str(e), time.perf_counter() - t0


def _compile(args) -> int:
    from . import _registry

    if args.arch:
        archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    else:
        from cupy.cuda import runtime

        from ._launch import device_info

        d = device_info(runtime.getDevice())
        archs = [d.arch] + (["sm_90a"] if d.cc == (9, 0) else [])
    families = args.family.split(",") if args.family else None
    kernels = _registry.all_kernels(families)
    allowances = _registry.spill_allowances(kernels)
    jobs = [(k, a) for k in kernels for a in k.archs(archs)]
    print(f"compiling {len(jobs)} variants ({len(kernels)} kernels) for {', '.join(archs)}", flush=True)
    errors = spills = serialized = allowed = 0
    t0 = time.perf_counter()
    workers = args.jobs or min(len(jobs), os.cpu_count() or 1) or 1
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for kernel, arch, res, err, dt in pool.map(_compile_one, jobs, chunksize=1):
            if err:
                errors += 1
                print(f"ERROR {arch} {kernel.name}\n{err}", flush=True)
                continue
            spilled = res["spill_stores"] or res["spill_loads"]
            max_st, max_ld = allowances[kernel]
            within = bool(spilled) and res["spill_stores"] <= max_st and res["spill_loads"] <= max_ld
            allowed += within
            spilled = spilled and not within
            spills += bool(spilled)
            serial = res.get("wgmma_serialized", False)
            serialized += serial
            if args.verbose or spilled or serial or within:
                tag = "SPILL" if spilled else "SERIAL" if serial else "ALLOW" if within else "ok   "
                print(f"{tag} {arch:7s} regs={res['registers']:3d} smem={res['smem']:6d} "
                      f"stack={res['stack']:4d} spill={res['spill_stores']}/{res['spill_loads']} {dt:5.2f}s "
                      f"{kernel.source}:{kernel.name}", flush=True)
    print(f"{len(jobs) - errors} compiled, {errors} errors, {spills} with spills, {serialized} with serialized "
          f"wgmma, {allowed} within their documented spill allowance, {time.perf_counter() - t0:.1f}s", flush=True)
    return 1 if errors or spills or serialized else 0


def _bench(args) -> int:
    if args.report or args.plot:
        return _bench_report(args)
    if args.results or args.out:
        raise SystemExit("speedcore bench: --results and --out go with --report (or --plot)")
    from . import bench

    bench.run(args.ops, quick=args.quick, json_path=args.json, device=args.device)
    return 0


def _bench_report(args) -> int:
    """Regenerate the results pages (and charts) from recorded JSON: no GPU, no torch, no suite runs."""
    from . import report

    if args.ops or args.json or args.quick:
        raise SystemExit("speedcore bench --report: regenerates pages from recorded JSON and runs no suites; "
                         "drop the suite names, --json and --quick (or run the suites first, without --report)")
    try:
        for path in report.find_results(args.results):
            for written in report.write(path, args.out, with_plots=args.plot):
                print(written)
    except report.ReportError as e:
        raise SystemExit(f"speedcore bench: {e}") from None
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m speedcore", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="versions, GPUs, cache, kernels")
    c = sub.add_parser("compile", help="compile every kernel variant (no GPU needed with --arch)")
    c.add_argument("--arch", help="comma-separated targets, e.g. sm_80,sm_90,sm_90a (default: this GPU's)")
    c.add_argument("--family", help="comma-separated op families (default: all)")
    c.add_argument("--jobs", type=int, default=0, help="parallel compiler processes (default: CPU count)")
    c.add_argument("--verbose", action="store_true", help="print the resource report of every variant")
    b = sub.add_parser("bench", help="time our kernels against their peers on this GPU")
    b.add_argument("ops", nargs="*", help="suites to run (default: all)")
    b.add_argument("--quick", action="store_true", help="smaller ceilings, fewer repetitions")
    b.add_argument("--json", help="merge the records into this JSON file (and write its results page beside it)")
    b.add_argument("--device", type=int, default=0)
    b.add_argument("--report", action="store_true",
                   help="regenerate the results page(s) from the recorded JSON instead of running (no GPU needed)")
    b.add_argument("--plot", action="store_true",
                   help="with --report (implied): also write PNG charts (needs matplotlib: pip install speedcore[plot])")
    b.add_argument("--results", action="append", metavar="PATH",
                   help="results JSON for --report: a file, directory or glob, repeatable "
                        "(default: benchmarks/results/*.json)")
    b.add_argument("--out", metavar="DIR", help="where --report writes (default: beside each JSON file)")
    from .engine.cli import add_parsers  # generate, bench-engine (speedcore/engine/cli.py)

    from .server.cli import add_parser as add_serve_parser  # serve (speedcore/server/cli.py)

    handlers = {"info": _info, "compile": _compile, "bench": _bench, **add_parsers(sub), **add_serve_parser(sub)}
    args = p.parse_args(argv)
    return handlers[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
