"""Run-time compilation of the CUDA sources in ``kernels/`` through NVRTC.

One *variant* is one template instantiation (a name expression) of one ``.cu`` file with one set of
options, compiled for one arch into a CUBIN.  Our own headers are pasted into the source text before
compilation, so the cache key (a hash of that text, the name expression, every option and the NVRTC
version) changes whenever any header changes; CUDA's own headers come from the ``-I`` directory of the
installed ``cuda-toolkit`` and are covered by the NVRTC version.

Nothing here needs a GPU: the CLI's ``compile --arch`` and CI call :func:`compile_kernel` with an explicit
arch, exactly as the launch path does with the device's arch.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tempfile
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

CACHE_FORMAT = 2  # 2: the header stores the CUBIN's SHA-256, checked on every read
_MAGIC = b"SPEEDCORE-CUBIN\n"
_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.M)
_PRAGMA_ONCE_RE = re.compile(r'^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$', re.M)


class CompileError(RuntimeError):
    """NVRTC rejected a kernel variant.  Carries the kernel, the options and the compiler log."""

    def __init__(self, kernel: "Kernel", arch: str, options: tuple, log: str):
        self.kernel = kernel
        self.arch = arch
        self.options = options
        self.log = log
        super().__init__(
            f"NVRTC failed to compile {kernel.name} from kernels/{kernel.source} for {arch}\n"
            f"options: {' '.join(options)}\n{log.strip()}"
        )


@dataclass(frozen=True)
class Kernel:
    """One compilable variant: a name expression in a ``kernels/`` source file plus extra options.

    ``hopper=True`` marks kernels that use sm_90a-only instructions (wgmma, setmaxnreg); they compile for
    ``sm_90a`` and refuse other archs.
    """

    source: str
    name: str
    options: tuple = ()
    hopper: bool = False

    def archs(self, requested) -> list:
        """The archs among ``requested`` this variant is built for (Hopper kernels only for sm_90a)."""
        if self.hopper:
            return [a for a in requested if a == "sm_90a"]
        return list(requested)


@dataclass
class Compiled:
    kernel: Kernel
    arch: str
    cubin: bytes
    lowered_name: str
    log: str
    resources: dict = field(default_factory=dict)
    from_disk: bool = False


def kernels_dir() -> Path:
    """The folder holding the .cu sources: shipped inside the wheel, or kernels/ of a source checkout."""
    here = Path(__file__).resolve().parent
    for cand in (here / "_kernels", here.parent / "kernels"):
        if cand.is_dir():
            return cand
    raise FileNotFoundError(f"speedcore: cannot find the kernels folder near {here}")


def assemble_source(source: str, root: Path | None = None) -> str:
    """The text NVRTC compiles: ``kernels/<source>`` with every quoted include pasted in, once each."""
    root = root or kernels_dir()
    seen: set = set()

    def expand(path: Path) -> str:
        text = path.read_text()
        rel = path.relative_to(root).as_posix()
        once = bool(_PRAGMA_ONCE_RE.search(text))
        if once:
            if path in seen:
                return ""
            seen.add(path)
            text = _PRAGMA_ONCE_RE.sub("", text)
        out = []
        pos = 0
        for m in _INCLUDE_RE.finditer(text):
            out.append(text[pos:m.start()])
            target = (path.parent / m.group(1)).resolve()
            if not target.is_file():
                target = (root / m.group(1)).resolve()
            if not target.is_file():
                raise FileNotFoundError(f"{rel}: included file {m.group(1)!r} not found under {root}")
            line = text.count("\n", 0, m.end()) + 2
            out.append(expand(target) + f'\n#line {line} "{rel}"\n')
            pos = m.end() + 1
        out.append(text[pos:])
        return f'#line 1 "{rel}"\n' + "".join(out)

    return expand((root / source).resolve())


@lru_cache(maxsize=None)
def cuda_include_dir() -> str:
    """CUDA's runtime headers (cuda_fp16.h, cuda_bf16.h): the pip ``cuda-toolkit`` first, then CUDA_PATH."""
    try:
        from cuda import pathfinder

        d = pathfinder.find_nvidia_header_directory("cudart")
        if d:
            return str(d)
    except Exception:
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            d = Path(os.environ[env]) / "include"
            if (d / "cuda_fp16.h").is_file():
                return str(d)
    d = Path("/usr/local/cuda/include")
    if (d / "cuda_fp16.h").is_file():
        return str(d)
    raise RuntimeError(
        "speedcore: CUDA's runtime headers (cuda_fp16.h) were not found; install "
        "'speedcore[cuda13]' (or [cuda12]), which brings cuda-toolkit[nvrtc,cudart], or set CUDA_PATH"
    )


class _LibNvrtc:
    """NVRTC loaded from an explicit library (``SPEEDCORE_NVRTC_LIBRARY``), through ctypes.

    CI compiles every variant a second time with the NVRTC of the GPU image (an older release than the one pip
    installs here): the two can disagree on what they accept and on register allocation.
    """

    def __init__(self, path: str):
        import ctypes
        import glob

        self.ct = ctypes
        # libnvrtc dlopens its builtins library by name; load the one beside it first so that name resolves
        # without LD_LIBRARY_PATH.
        for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.*"))):
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(path)

    def version(self) -> tuple:
        ct = self.ct
        major, minor = ct.c_int(), ct.c_int()
        self._check(self.lib.nvrtcVersion(ct.byref(major), ct.byref(minor)), "nvrtcVersion")
        return major.value, minor.value

    def _check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed with NVRTC status {rc}")

    def compile(self, source_text: str, filename: str, name: str, options: tuple):
        """(ok, log, lowered name, cubin)."""
        ct, lib = self.ct, self.lib
        prog = ct.c_void_p()
        self._check(lib.nvrtcCreateProgram(ct.byref(prog), source_text.encode(), filename.encode(), 0, None, None),
                    "nvrtcCreateProgram")
        try:
            self._check(lib.nvrtcAddNameExpression(prog, name.encode()), "nvrtcAddNameExpression")
            opts = (ct.c_char_p * len(options))(*[o.encode() for o in options])
            rc = lib.nvrtcCompileProgram(prog, len(options), opts)
            n = ct.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ct.byref(n))
            buf = ct.create_string_buffer(n.value)
            lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
            if rc != 0:
                return False, log, None, None
            lowered = ct.c_char_p()
            self._check(lib.nvrtcGetLoweredName(prog, name.encode(), ct.byref(lowered)), "nvrtcGetLoweredName")
            lowered = lowered.value.decode()
            self._check(lib.nvrtcGetCUBINSize(prog, ct.byref(n)), "nvrtcGetCUBINSize")
            cubin = ct.create_string_buffer(n.value)
            self._check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return True, log, lowered, cubin.raw
        finally:
            lib.nvrtcDestroyProgram(ct.byref(prog))


@lru_cache(maxsize=None)
def _lib_nvrtc(path: str) -> _LibNvrtc:
    return _LibNvrtc(path)


def _explicit_nvrtc():
    path = os.environ.get("SPEEDCORE_NVRTC_LIBRARY")
    return _lib_nvrtc(path) if path else None


def nvrtc_version() -> tuple:
    lib = _explicit_nvrtc()
    return lib.version() if lib is not None else _cupy_nvrtc_version()


@lru_cache(maxsize=None)
def _cupy_nvrtc_version() -> tuple:
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getVersion())


def build_options(kernel: Kernel, arch: str) -> tuple:
    if kernel.hopper and arch != "sm_90a":
        raise ValueError(f"{kernel.name} uses Hopper-only instructions and needs sm_90a, not {arch}")
    return (
        "--std=c++17",
        f"-arch={arch}",
        "--ptxas-options=-v",
        "-DNDEBUG",
        f"-I{cuda_include_dir()}",
    ) + tuple(kernel.options)


def cache_key(source_text: str, name: str, options: tuple) -> str:
    h = hashlib.sha256()
    for part in (f"format={CACHE_FORMAT}", f"nvrtc={nvrtc_version()}", name, "\0".join(options), source_text):
        h.update(part.encode())
        h.update(b"\0\1")
    return h.hexdigest()


def cache_dir() -> Path:
    d = os.environ.get("SPEEDCORE_CACHE_DIR")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "speedcore"


def _disk_cache_enabled() -> bool:
    return os.environ.get("SPEEDCORE_DISABLE_DISK_CACHE", "") not in ("1", "true", "yes")


_RES_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "smem": re.compile(r"(\d+) bytes smem"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def parse_ptxas_report(log: str, lowered_name: str) -> dict:
    """Registers, static shared memory, stack and spill bytes of one entry from ``ptxas -v`` output."""
    res = {k: 0 for k in _RES_RE}
    block = []
    capture = False
    for line in log.splitlines():
        if "Compiling entry function" in line:
            capture = f"'{lowered_name}'" in line
            continue
        if capture:
            block.append(line)
    text = "\n".join(block)
    for k, rx in _RES_RE.items():
        m = rx.search(text)
        if m:
            res[k] = int(m.group(1))
    res["warnings"] = [l.strip() for l in block if "warning" in l.lower()]
    # ptxas inserts waits after every wgmma when it cannot prove that no other instruction touches an
    # accumulator in flight: correct, but the asynchrony (and the speed) is gone.
    res["wgmma_serialized"] = any("wgmma.mma_async instructions are serialized" in l and lowered_name in l
                                  for l in log.splitlines())
    return res


def _read_disk(path: Path):
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if not data.startswith(_MAGIC):
        return None
    off = len(_MAGIC)
    try:
        (n,) = struct.unpack_from("<I", data, off)
        meta = json.loads(data[off + 4:off + 4 + n])
    except Exception:
        return None
    cubin = data[off + 4 + n:]
    # A length check alone lets flipped bytes through, and a corrupt CUBIN can load and then kill the process
    # (CUDA_ERROR_ILLEGAL_INSTRUCTION): a file whose digest does not match is recompiled and rewritten.
    if len(cubin) != meta.get("cubin_bytes") or hashlib.sha256(cubin).hexdigest() != meta.get("cubin_sha256"):
        return None
    return meta, cubin


def _write_disk(path: Path, meta: dict, cubin: bytes) -> None:
    """Atomic: a reader sees the old file, no file, or the whole new one; concurrent writers both win."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(meta, cubin_bytes=len(cubin), cubin_sha256=hashlib.sha256(cubin).hexdigest())
        blob = json.dumps(meta).encode()
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + struct.pack("<I", len(blob)) + blob + cubin)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except OSError:
        pass  # a read-only cache directory only costs a recompile next time


_mem_cache: dict = {}
_lock = threading.Lock()


def compile_kernel(kernel: Kernel, arch: str) -> Compiled:
    """Compile one variant for ``arch`` (memory cache, then disk cache, then NVRTC)."""
    source_text = assemble_source(kernel.source)
    options = build_options(kernel, arch)
    key = cache_key(source_text, kernel.name, options)
    hit = _mem_cache.get(key)
    if hit is not None:
        return hit
    with _lock:
        hit = _mem_cache.get(key)
        if hit is not None:
            return hit
        path = cache_dir() / f"{key}.cubin"
        got = _read_disk(path) if _disk_cache_enabled() else None
        if got is not None:
            meta, cubin = got
            c = Compiled(kernel, arch, cubin, meta["lowered_name"], meta.get("log", ""), meta.get("resources", {}),
                         from_disk=True)
        else:
            c = _nvrtc_compile(kernel, arch, source_text, options)
            if _disk_cache_enabled():
                _write_disk(path, {"name": kernel.name, "source": kernel.source, "arch": arch,
                                   "lowered_name": c.lowered_name, "log": c.log, "resources": c.resources}, c.cubin)
        _mem_cache[key] = c
        return c


def _nvrtc_compile(kernel: Kernel, arch: str, source_text: str, options: tuple) -> Compiled:
    lib = _explicit_nvrtc()
    if lib is not None:
        ok, log, lowered, cubin = lib.compile(source_text, kernel.source, kernel.name, options)
        if not ok:
            raise CompileError(kernel, arch, options, log)
        return Compiled(kernel, arch, cubin, lowered, log, parse_ptxas_report(log, lowered))

    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(source_text, kernel.source, [], [])
    try:
        nvrtc.addNameExpression(prog, kernel.name)
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError:
            raise CompileError(kernel, arch, options, nvrtc.getProgramLog(prog)) from None
        log = nvrtc.getProgramLog(prog)
        lowered = nvrtc.getLoweredName(prog, kernel.name)
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return Compiled(kernel, arch, cubin, lowered, log, parse_ptxas_report(log, lowered))
