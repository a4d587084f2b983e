"""The NVRTC compile path, its cache, and the CI check that every variant builds for every target arch."""
import multiprocessing as mp
import os
import subprocess
import sys

import pytest

from speedcore import _compile
from speedcore._compile import CompileError, Kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fake_kernels(tmp_path, monkeypatch):
    """A private kernels/ folder and cache folder, so the tests can edit sources freely."""
    kdir = tmp_path / "kernels"
    (kdir / "common").mkdir(parents=True)
    (kdir / "common" / "h.cuh").write_text("#pragma once\n#define SCALE 2.0f\n")
    (kdir / "common" / "g.cuh").write_text('#pragma once\n#include "h.cuh"\n')
    (kdir / "k.cu").write_text(
        '#include "common/h.cuh"\n#include "common/g.cuh"\n'
        "template <int N> __global__ void scale(float* x) { x[threadIdx.x] *= SCALE * N; }\n")
    monkeypatch.setattr(_compile, "kernels_dir", lambda: kdir)
    monkeypatch.setenv("SPEEDCORE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(_compile, "_mem_cache", {})
    return kdir


def test_assemble_inlines_each_header_once(fake_kernels):
    text = _compile.assemble_source("k.cu", fake_kernels)
    assert text.count("#define SCALE") == 1
    assert "#include \"" not in text and "#pragma once" not in text
    assert '#line 3 "k.cu"' in text  # errors point back into the original file


def test_missing_include_is_reported(fake_kernels):
    (fake_kernels / "bad.cu").write_text('#include "common/nope.cuh"\n')
    with pytest.raises(FileNotFoundError, match="nope.cuh"):
        _compile.assemble_source("bad.cu", fake_kernels)


def test_cache_key_covers_headers_options_and_compiler(fake_kernels, monkeypatch):
    k = Kernel("k.cu", "scale<3>")
    opts = _compile.build_options(k, "sm_80")
    key = _compile.cache_key(_compile.assemble_source("k.cu"), k.name, opts)
    assert key == _compile.cache_key(_compile.assemble_source("k.cu"), k.name, opts)
    (fake_kernels / "common" / "h.cuh").write_text("#pragma once\n#define SCALE 3.0f\n")
    key_header = _compile.cache_key(_compile.assemble_source("k.cu"), k.name, opts)
    assert key_header != key
    assert _compile.cache_key(_compile.assemble_source("k.cu"), k.name, opts + ("-DX=1",)) != key_header
    assert _compile.cache_key(_compile.assemble_source("k.cu"), "scale<4>", opts) != key_header
    monkeypatch.setattr(_compile, "nvrtc_version", lambda: (99, 0))
    assert _compile.cache_key(_compile.assemble_source("k.cu"), k.name, opts) != key_header


def test_compile_disk_cache_roundtrip_and_corruption(fake_kernels, tmp_path):
    k = Kernel("k.cu", "scale<3>")
    c1 = _compile.compile_kernel(k, "sm_80")
    assert not c1.from_disk and c1.cubin and c1.lowered_name.startswith("_Z")
    assert c1.resources["registers"] > 0
    files = list((tmp_path / "cache").glob("*.cubin"))
    assert len(files) == 1
    _compile._mem_cache.clear()
    c2 = _compile.compile_kernel(k, "sm_80")
    assert c2.from_disk and c2.cubin == c1.cubin and c2.lowered_name == c1.lowered_name
    files[0].write_bytes(files[0].read_bytes()[:-7])  # truncated file: recompiled, not loaded
    _compile._mem_cache.clear()
    c3 = _compile.compile_kernel(k, "sm_80")
    assert not c3.from_disk and c3.cubin == c1.cubin
    # flipped bytes of the same length (the file stays well-formed): the checksum catches them, and the
    # recompiled CUBIN replaces the file
    data = bytearray(files[0].read_bytes())
    data[-40:-8] = bytes(b ^ 0xFF for b in data[-40:-8])
    files[0].write_bytes(bytes(data))
    _compile._mem_cache.clear()
    c5 = _compile.compile_kernel(k, "sm_80")
    assert not c5.from_disk and c5.cubin == c1.cubin
    _compile._mem_cache.clear()
    assert _compile.compile_kernel(k, "sm_80").from_disk  # rewritten whole
    # a changed header misses the cache
    (fake_kernels / "common" / "h.cuh").write_text("#pragma once\n#define SCALE 5.0f\n")
    c4 = _compile.compile_kernel(k, "sm_80")
    assert not c4.from_disk
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == 2


def _compile_in_child(args):
    kdir, cache = args
    os.environ["SPEEDCORE_CACHE_DIR"] = cache
    _compile.kernels_dir = lambda: __import__("pathlib").Path(kdir)
    c = _compile.compile_kernel(Kernel("k.cu", "scale<7>"), "sm_90")
    return len(c.cubin)


def test_two_processes_compiling_the_same_variant_both_succeed(fake_kernels, tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        sizes = pool.map(_compile_in_child, [(str(fake_kernels), str(tmp_path / "cache"))] * 4)
    assert len(set(sizes)) == 1 and sizes[0] > 0
    assert not list((tmp_path / "cache").glob(".tmp-*"))  # no temporary files left behind


def test_compile_error_carries_name_options_and_log(fake_kernels):
    (fake_kernels / "broken.cu").write_text("template <int N> __global__ void f(float* x) { x[0] = undefined_name; }\n")
    with pytest.raises(CompileError) as ei:
        _compile.compile_kernel(Kernel("broken.cu", "f<1>"), "sm_80")
    e = ei.value
    assert e.kernel.name == "f<1>" and "-arch=sm_80" in e.options
    assert "undefined_name" in e.log and "f<1>" in str(e) and "broken.cu" in str(e)


def test_hopper_kernels_only_build_for_sm90a():
    k = Kernel("norm.cu", "x", hopper=True)
    assert k.archs(["sm_80", "sm_90", "sm_90a"]) == ["sm_90a"]
    with pytest.raises(ValueError, match="sm_90a"):
        _compile.build_options(k, "sm_90")


def test_ptxas_report_parsing():
    log = ("ptxas info    : Compiling entry function '_Z1fv' for 'sm_90'\n"
           "ptxas info    : Function properties for _Z1fv\n"
           "ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 4096 bytes smem\n"
           "ptxas info    : Compiling entry function '_Z1gv' for 'sm_90'\n"
           "ptxas info    : Used 10 registers\n")
    r = _compile.parse_ptxas_report(log, "_Z1fv")
    assert (r["registers"], r["smem"], r["stack"], r["spill_stores"], r["spill_loads"]) == (255, 4096, 24, 8, 12)
    assert _compile.parse_ptxas_report(log, "_Z1gv")["registers"] == 10
    assert not r["wgmma_serialized"]
    serial = log + ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized "
                    "due to non wgmma instructions defining accumulator registers in the function '_Z1gv' in line 5\n")
    assert _compile.parse_ptxas_report(serial, "_Z1gv")["wgmma_serialized"]
    assert not _compile.parse_ptxas_report(serial, "_Z1fv")["wgmma_serialized"]


def test_every_variant_compiles_for_every_arch_without_spills(tmp_path):
    """The CI check: the same source assembly and options as a GPU run, for sm_80, sm_90 and sm_90a."""
    env = dict(os.environ, SPEEDCORE_CACHE_DIR=str(tmp_path / "cache"))
    p = subprocess.run([sys.executable, "-m", "speedcore", "compile", "--arch", "sm_80,sm_90,sm_90a"],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    print(p.stdout[-4000:], p.stderr[-4000:])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert " 0 errors, 0 with spills, 0 with serialized wgmma" in p.stdout


# The NVRTC of the lent H200's image (CuPy there reports 13.0): CI's pip brings a newer 13.x, and the two have
# disagreed (a generic lambda in device code; register allocation), so CI compiles with both.
GPU_IMAGE_NVRTC = "nvidia-cuda-nvrtc==13.0.88"


def test_every_variant_compiles_with_the_gpu_images_nvrtc(tmp_path):
    import zipfile

    dl = tmp_path / "wheel"
    p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--only-binary=:all:", "-d",
                        str(dl), GPU_IMAGE_NVRTC], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"{GPU_IMAGE_NVRTC} could not be downloaded here: {p.stderr.strip()[-200:]}")
    (wheel,) = dl.glob("*.whl")
    zipfile.ZipFile(wheel).extractall(tmp_path / "x")
    (lib,) = [p for p in (tmp_path / "x").rglob("libnvrtc.so.*") if ".alt." not in p.name]
    env = dict(os.environ, SPEEDCORE_CACHE_DIR=str(tmp_path / "cache"), SPEEDCORE_NVRTC_LIBRARY=str(lib))
    info = subprocess.run([sys.executable, "-m", "speedcore", "info"], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    assert "nvrtc 13.0" in info.stdout, info.stdout + info.stderr
    p = subprocess.run([sys.executable, "-m", "speedcore", "compile", "--arch", "sm_80,sm_90,sm_90a"],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    print(p.stdout[-4000:], p.stderr[-4000:])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert " 0 errors, 0 with spills, 0 with serialized wgmma" in p.stdout


def test_hopper_kernels_run_wgmma_without_local_memory():
    """The SASS of the dispatched sm_90a variants: HGMMA in the main loop (wgmma survived NVRTC and ptxas) and
    no local-memory loads or stores (nothing spilled, no register array demoted to the stack)."""
    from speedcore import _sass, attention, gemm

    if _sass.find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    kernels = [attention._kernel_sm90("bfloat16", *attention.flash_attn_sm90_config(d, masked), False)
               for d in (64, 128) for masked in (False, True)]
    kernels.append(next(k for k in gemm.all_kernels() if k.hopper))
    for k in dict.fromkeys(kernels):
        texts = _sass.sass(_compile.compile_kernel(k, "sm_90a").cubin, "sm_90a")
        assert len(texts) == 1, k.name
        text = next(iter(texts.values()))
        assert _sass.count(text, "HGMMA") >= 4, k.name
        assert _sass.count(text, "STL") == 0 and _sass.count(text, "LDL") == 0, k.name


def test_sass_helpers_parse_elf_and_count():
    from speedcore import _sass

    with pytest.raises(ValueError, match="ELF"):
        _sass.text_sections(b"not an elf")
    text = ("        /*2530*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR20], RZ, !UPT ;\n"
            "        /*2540*/              @!P0 STL [R1], R2 ;\n"
            "        /*2550*/                   MOV R3, R4 ;\n")
    assert (_sass.count(text, "HGMMA"), _sass.count(text, "STL"), _sass.count(text, "LDL")) == (1, 1, 0)


def test_spill_allowance_is_only_for_the_documented_variants():
    """Only the sm_90 head-dim-256 variants with 80-key tiles may spill (attention.spills_allowed says why)."""
    from speedcore import _registry, attention

    kernels = _registry.all_kernels()
    allowances = _registry.spill_allowances(kernels)
    allowed = [k for k in kernels if allowances[k] != (0, 0)]
    assert allowed, "the head dim 256 unmasked sm_90 variants are dispatched"
    assert all(k.source == attention.SOURCE_SM90 and ", 256, 80, " in k.name for k in allowed)
    assert all(allowances[k] == (32, 64) for k in allowed)


def test_launch_packs_arguments_as_cupy_does():
    """Every launch passes each argument's bytes as CuPy's launch would: Python ints as 8 bytes, NumPy scalars at
    their own size, a small NumPy array (a TMA map) by value; flags and floats must be explicit NumPy scalars."""
    import ctypes

    import numpy as np

    from speedcore import _launch

    def packed(*args):
        lay = _launch.arg_layout(_launch._arg_types(args))
        ptrs = ctypes.cast(lay.pack(args), ctypes.POINTER(ctypes.c_void_p))
        sizes = [{np.int32: 4, np.uint32: 4, np.float32: 4, np.ndarray: 128}.get(type(a), 8) for a in args]
        assert all(ptrs[i] % 8 == 0 for i in range(len(args)))
        return [ctypes.string_at(ptrs[i], n) for i, n in enumerate(sizes)]

    assert packed(0x1234) == [(0x1234).to_bytes(8, "little")]
    assert packed(-1) == [b"\xff" * 8]
    assert packed(np.int32(-2), np.int64(5)) == [np.int32(-2).tobytes(), np.int64(5).tobytes()]
    m = np.zeros(1, dtype=[("words", np.uint64, 16)])
    m["words"][0] = np.arange(16, dtype=np.uint64)
    assert packed(np.int32(3), m, 7) == [np.int32(3).tobytes(), m.tobytes(), (7).to_bytes(8, "little")]
    # a reused layout (a fast path's) stores plain Python numbers at the layout's sizes
    lay = _launch.arg_layout((int, np.int32, np.float32))
    ptrs = ctypes.cast(lay.pack((5, 6, 2.5)), ctypes.POINTER(ctypes.c_void_p))
    assert [ctypes.string_at(ptrs[i], n) for i, n in enumerate((8, 4, 4))] == [
        (5).to_bytes(8, "little"), np.int32(6).tobytes(), np.float32(2.5).tobytes()]
    with pytest.raises(TypeError, match="bool"):
        packed(True)
    with pytest.raises(TypeError, match="float"):
        packed(1.5)
    # cuda.h's layouts: CUlaunchAttribute is 72 bytes (value at 8), CUlaunchConfig 56 (stream at 32)
    assert ctypes.sizeof(_launch._LaunchAttribute) == 72 and _launch._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_launch._LaunchConfigEx) == 56 and _launch._LaunchConfigEx.stream.offset == 32
    c, _ = _launch._config_ex(_launch.LaunchConfig((128,), (384,), 1000, cluster=2), 0x1234)
    assert list(c.grid) == [128, 1, 1] and list(c.block) == [384, 1, 1] and c.smem == 1000 and c.stream == 0x1234
    assert c.num_attrs == 1 and c.attrs.contents.id == 4 and list(c.attrs.contents.value)[:3] == [2, 1, 1]
    c, _ = _launch._config_ex(_launch.LaunchConfig((128,), (384,), 1000, cluster=2, overlap=True), 0x1234)
    assert c.num_attrs == 2 and c.attrs[0].id == 4 and list(c.attrs[0].value)[:3] == [2, 1, 1]
    assert c.attrs[1].id == 6 and c.attrs[1].value[0] == 1  # programmatic stream serialization allowed


def test_cluster_launch_passes_each_argument_at_its_pointer(monkeypatch):
    """A cluster launch (_launch_ex) gets the packed arguments: each kernelParams pointer reads that argument's bytes,
    and the launch config carries grid, block, shared memory, stream and cluster size."""
    import ctypes

    import numpy as np

    from speedcore import _launch

    seen = {}

    class Driver:
        def cuLaunchKernelEx(self, c, func, params, extra):
            cfg = c._obj
            seen["cfg"] = (list(cfg.grid), list(cfg.block), cfg.smem, cfg.stream, list(cfg.attrs.contents.value)[:3])
            ptrs = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
            seen["args"] = [ctypes.string_at(ptrs[i], n) for i, n in enumerate((128, 8, 4, 8, 4))]
            seen["func"] = func.value
            return 0

    monkeypatch.setattr(_launch, "_driver", lambda: Driver())
    m = np.zeros(1, dtype=[("words", np.uint64, 16)])
    m["words"][0] = np.arange(16, dtype=np.uint64) * 3
    args = (m, 0xDEADBEEF12, np.int32(-7), np.int64(1 << 40), np.float32(1.5))
    params = _launch.arg_layout(_launch._arg_types(args)).pack(args)
    _launch._launch_ex(0x1000, _launch.LaunchConfig((8,), (384,), 4096, cluster=4), 0x77, params)
    assert seen["func"] == 0x1000
    assert seen["cfg"] == ([8, 1, 1], [384, 1, 1], 4096, 0x77, [4, 1, 1])
    assert seen["args"] == [m.tobytes(), (0xDEADBEEF12).to_bytes(8, "little"), np.int32(-7).tobytes(),
                            np.int64(1 << 40).tobytes(), np.float32(1.5).tobytes()]
    assert seen["args"][1] == (0xDEADBEEF12).to_bytes(8, "little") and seen["args"][2] == np.int32(-7).tobytes()


def test_prepacked_launch_packs_constants_once_and_pointers_per_call():
    """A PrepackedLaunch's buffer holds its constant trailing arguments from the start; each call rewrites only the
    leading pointers, and every kernelParams entry reads its argument's bytes."""
    import ctypes

    import numpy as np

    from speedcore import _launch

    class Bound:  # what launch_packed receives: the kernelParams address
        def launch_packed(self, stream_ptr, params_addr):
            self.seen = (stream_ptr, params_addr)

    def args(addr, sizes):
        ptrs = ctypes.cast(addr, ctypes.POINTER(ctypes.c_void_p))
        return [ctypes.string_at(ptrs[i], n) for i, n in enumerate(sizes)]

    b = Bound()
    consts = (np.int32(5), np.int64(-3), np.float32(1.5))
    pl = _launch.PrepackedLaunch(b, (int, int), consts)
    sizes = (8, 8, 4, 8, 4)
    tail = [c.tobytes() for c in consts]
    pl(0x77, 11, 22)
    assert b.seen[0] == 0x77 and args(b.seen[1], sizes) == [(11).to_bytes(8, "little"), (22).to_bytes(8, "little")] + tail
    pl(0x78, 33, 1 << 40)
    assert args(b.seen[1], sizes) == [(33).to_bytes(8, "little"), (1 << 40).to_bytes(8, "little")] + tail
