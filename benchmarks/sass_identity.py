"""Proof that a refactor moved kernel code without changing it: every variant that a git ref's families list is
compiled from that ref's kernels/ and from the working tree's, and their SASS is compared per kernel, matched by
the variant's name expression and options (the template names stay; the .cu file a variant lives in may change).

    python3 benchmarks/sass_identity.py --ref HEAD~1 --family quant --arch sm_80,sm_90a
    python3 benchmarks/sass_identity.py --ref 4b935dc --family quant --match gemv_stream --jobs 2

No GPU is needed (NVRTC, and nvdisasm from PATH or the nvidia-cuda-nvdisasm wheel).  The ref's tree is exported
with ``git archive`` into a temporary folder (kernels/ and speedcore/ only; the working tree's index and
worktrees are not touched).  Both sides are compiled by the working tree's NVRTC with the same options
(``_compile.build_options``): the ref's sources directly, the working tree's through ``_compile.compile_kernel`` (its
disk cache, keyed by the whole input, so a later ``python -m speedcore compile`` finds them).  The ref's variants are
listed by the ref's own ``speedcore._registry`` (in a subprocess).  Compared is the disassembly of the variant's
own entry (``.text.<lowered name>``, instruction words included), not the cubin bytes: a source file's name or a
``#line`` number may enter the ELF's other sections.  Exit status 1 when any variant's SASS differs, a ref variant
is missing from the working tree, or a compile fails.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_LIST = """
import json, sys
sys.path.insert(0, sys.argv[1])
from speedcore import _registry
fams = sys.argv[2].split(",") if sys.argv[2] else None
print(json.dumps([(k.source, k.name, list(k.options), k.hopper) for k in _registry.all_kernels(fams)]))
"""


def list_variants(tree: Path, families: str) -> list:
    """(source, name, options, hopper) of every variant the tree's families list."""
    p = subprocess.run([sys.executable, "-c", _LIST, str(tree), families], capture_output=True, text=True,
                       cwd=tempfile.gettempdir())
    if p.returncode != 0:
        raise RuntimeError(f"listing the variants of {tree} failed:\n{p.stderr[-3000:]}")
    return [(s, n, tuple(o), h) for s, n, o, h in json.loads(p.stdout)]


def export_ref(ref: str, dest: Path) -> str:
    """kernels/ and speedcore/ of ``ref`` under ``dest``; returns the commit."""
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", commit, "kernels", "speedcore"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return commit


def entry_sass(job) -> tuple:
    """(key, arch, SASS text of the variant's entry, or an error) for one side of one comparison."""
    side, kernels_root, source, name, options, hopper, arch = job
    sys.path.insert(0, str(ROOT))
    from speedcore import _compile, _sass

    kernel = _compile.Kernel(source, name, options, hopper)
    try:
        if side == "new" and Path(kernels_root) == _compile.kernels_dir():
            # the launch path's compile (and disk cache, keyed by the whole input): a later `speedcore compile`
            # of the same variants reads these
            c = _compile.compile_kernel(kernel, arch)
        else:
            text = _compile.assemble_source(source, Path(kernels_root))
            c = _compile._nvrtc_compile(kernel, arch, text, _compile.build_options(kernel, arch))
        entries = _sass.sass(c.cubin, arch)
        return side, name, options, arch, entries[c.lowered_name], None
    except Exception as e:  # reported, and the check fails
        return side, name, options, arch, None, f"{type(e).__name__}: {str(e)[:2000]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", default="HEAD", help="the git ref to compare against (default HEAD)")
    ap.add_argument("--family", default="", help="comma-separated op families (default: all)")
    ap.add_argument("--arch", default="sm_80,sm_90a", help="comma-separated archs (default sm_80,sm_90a)")
    ap.add_argument("--match", default="", help="only variants whose name matches this regular expression")
    ap.add_argument("--jobs", type=int, default=1, help="compiles in parallel (default 1)")
    args = ap.parse_args(argv)
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]

    with tempfile.TemporaryDirectory(prefix="sass-identity-") as tmp:
        old_tree = Path(tmp)
        commit = export_ref(args.ref, old_tree)
        old = list_variants(old_tree, args.family)
        new = list_variants(ROOT, args.family)
        rx = re.compile(args.match) if args.match else None
        if rx:
            old = [v for v in old if rx.search(v[1])]
            new = [v for v in new if rx.search(v[1])]
        new_by_key = {(n, o, h): s for s, n, o, h in new}
        old_keys = {(n, o, h) for _, n, o, h in old}
        missing = [v for v in old if (v[1], v[2], v[3]) not in new_by_key]
        added = [(s, n, o, h) for (n, o, h), s in new_by_key.items() if (n, o, h) not in old_keys]
        jobs = []
        for s, n, o, h in dict.fromkeys(old):
            if (n, o, h) not in new_by_key:
                continue
            kernel_archs = [a for a in archs if not h or a == "sm_90a"]
            for a in kernel_archs:
                jobs.append(("old", str(old_tree / "kernels"), s, n, o, h, a))
                jobs.append(("new", str(ROOT / "kernels"), new_by_key[(n, o, h)], n, o, h, a))
        print(f"ref {args.ref} ({commit[:12]}): {len(old)} variants; working tree: {len(new)}; "
              f"{len(jobs) // 2} comparisons over {', '.join(archs)}", flush=True)
        t0 = time.perf_counter()
        results = {}
        with ProcessPoolExecutor(max(1, args.jobs)) as pool:
            for i, (side, n, o, a, text, err) in enumerate(pool.map(entry_sass, jobs, chunksize=1)):
                results[(side, n, o, a)] = (text, err)
                if (i + 1) % 50 == 0:
                    print(f"  {i + 1} / {len(jobs)} compiles, {time.perf_counter() - t0:.0f} s", flush=True)

    same = differ = failed = 0
    per_source = {}
    for s, n, o, h in dict.fromkeys(old):
        key = (n, o, h)
        if key not in new_by_key:
            continue
        for a in [a for a in archs if not h or a == "sm_90a"]:
            (t_old, e_old), (t_new, e_new) = results[("old", n, o, a)], results[("new", n, o, a)]
            label = f"{n}{' ' + ' '.join(o) if o else ''} [{a}]"
            if e_old or e_new:
                failed += 1
                print(f"COMPILE FAILED {label}: {e_old or ''} {e_new or ''}")
            elif t_old == t_new:
                same += 1
                pair = f"{s} -> {new_by_key[key]}"
                per_source[pair] = per_source.get(pair, 0) + 1
            else:
                differ += 1
                lines_old, lines_new = t_old.splitlines(), t_new.splitlines()
                first = next((i for i, (x, y) in enumerate(zip(lines_old, lines_new)) if x != y),
                             min(len(lines_old), len(lines_new)))
                print(f"SASS DIFFERS {label}: {len(lines_old)} / {len(lines_new)} lines, first difference at line "
                      f"{first + 1}:\n  old: {lines_old[first] if first < len(lines_old) else '<end>'}\n"
                      f"  new: {lines_new[first] if first < len(lines_new) else '<end>'}")
    for s, n, o, h in missing:
        print(f"MISSING from the working tree: {n} {' '.join(o)} (was kernels/{s})")
    for s, n, o, h in added:
        print(f"new in the working tree (not compared): {n} {' '.join(o)} (kernels/{s})")
    for pair, count in sorted(per_source.items()):
        print(f"identical: {count} variant-archs {pair}")
    print(f"{same} identical, {differ} different, {failed} failed to compile, {len(missing)} missing "
          f"({time.perf_counter() - t0:.0f} s)")
    return 0 if differ == failed == len(missing) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
