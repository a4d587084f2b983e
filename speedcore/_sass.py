"""SASS of a compiled variant, through the CUDA toolkit's ``nvdisasm`` (pip: nvidia-cuda-nvdisasm): for checks
that the Hopper kernels really run wgmma (HGMMA) and touch no local memory, on machines without a GPU.

nvdisasm 13.5 refuses the whole cubins NVRTC 13 writes ("invalid ELF file"), so each kernel's ``.text``
section is cut out of the ELF here and disassembled as a raw instruction binary.
"""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path


def find_nvdisasm() -> str | None:
    """nvdisasm on PATH, or from the nvidia-cuda-nvdisasm wheel; None if neither is there."""
    tool = shutil.which("nvdisasm")
    if tool:
        return tool
    for base in map(Path, sys.path):
        for sub in ("nvidia/cu13/bin/nvdisasm", "nvidia/cuda_nvdisasm/bin/nvdisasm"):
            p = base / sub
            if p.is_file():
                if not os.access(p, os.X_OK):
                    try:
                        p.chmod(p.stat().st_mode | 0o111)
                    except OSError:
                        continue
                return str(p)
    return None


def text_sections(cubin: bytes) -> dict:
    """{section name: instruction bytes} of the ``.text.*`` sections of an ELF64 cubin."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    str_off = sections[shstrndx][4]

    def name(off):
        end = cubin.index(b"\0", str_off + off)
        return cubin[str_off + off:end].decode()

    out = {}
    for sh_name, sh_type, _, _, off, size, *_ in sections:
        n = name(sh_name)
        if n.startswith(".text.") and sh_type == 1:  # PROGBITS
            out[n[len(".text."):]] = cubin[off:off + size]
    return out


def sass(cubin: bytes, arch: str, tool: str | None = None) -> dict:
    """{mangled kernel name: SASS text} of every kernel in ``cubin`` (arch as in "sm_90a")."""
    tool = tool or find_nvdisasm()
    if tool is None:
        raise RuntimeError("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    target = "SM" + arch.split("_", 1)[1]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kname, code in text_sections(cubin).items():
            raw = Path(tmp) / "text.bin"
            raw.write_bytes(code)
            r = subprocess.run([tool, "-b", target, str(raw)], capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"nvdisasm failed on {kname}: {r.stderr.strip()[:500]}")
            out[kname] = r.stdout
    return out


def count(text: str, opcode: str) -> int:
    """Instructions whose mnemonic starts with ``opcode`` (e.g. "HGMMA", "STL")."""
    n = 0
    for line in text.splitlines():
        body = line.split("*/", 1)[-1].strip().lstrip("{").strip()
        if body.startswith("@"):  # predicate
            body = body.split(None, 1)[-1] if " " in body else ""
        n += body.startswith(opcode)
    return n
