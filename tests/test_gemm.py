"""speedcore.matmul / speedcore.linear: heuristics here; correctness of every path on the GPU."""
import dataclasses
import math

import pytest

from speedcore import gemm

ACTS = [None, "silu", "gelu", "gelu_tanh", "relu"]


# -- CPU: heuristics and tensor-map checks ------------------------------------------------------------------
def test_dispatch_is_pure_and_sensible():
    assert gemm.gemm_path(1, 4096, 4096, "bfloat16", (9, 0), True) == "skinny"
    assert gemm.gemm_path(64, 4096, 4096, "bfloat16", (9, 0), True) == "hopper"
    assert gemm.gemm_path(32, 4096, 4096, "bfloat16", (9, 0), True) == "skinny"
    assert gemm.gemm_path(32, 28672, 8192, "bfloat16", (9, 0), True) == "skinny"
    assert gemm.gemm_path(33, 28672, 8192, "bfloat16", (9, 0), True) == "hopper"
    assert gemm.gemm_path(64, 14336, 4096, "bfloat16", (9, 0), True) == "hopper"
    assert gemm.gemm_path(64, 8192, 8192, "bfloat16", (9, 0), True) == "hopper"
    assert gemm.gemm_path(64, 28672, 8192, "bfloat16", (8, 0), True) == "skinny"
    assert gemm.gemm_path(65, 4096, 4096, "bfloat16", (9, 0), True) == "hopper"
    assert gemm.gemm_path(8192, 8192, 8192, "float16", (9, 0), False) == "hopper"
    assert gemm.gemm_path(8192, 8192, 8192, "float16", (8, 0), True) == "ampere"
    assert gemm.gemm_path(8192, 8192, 8192, "float16", (8, 9), True) == "ampere"


@pytest.mark.parametrize("m", [1, 7, 16, 17, 33, 64, 65, 999])
def test_skinny_config_covers_m(m):
    for n in (4096, 28672):
        cfg = gemm.mma_config(m, n, 4096, 132, 233472, True)
        assert cfg in list(gemm.MMA_SKINNY.values()) + list(gemm.MMA_SKINNY_WIDE.values()) + [gemm.MMA_SKINNY_DEEP]
        assert cfg.smem <= 232448
        if m <= 64:
            assert cfg.bm >= m and (cfg.bm == 16 or cfg.bm // 2 < m)
        assert (cfg.bn == 64) == (n == 28672 and m > 16)


@pytest.mark.parametrize("mnk", [(128, 8192, 8192), (512, 4096, 4096), (8192, 8192, 8192), (100, 264, 200)])
def test_mma_config_fits(mnk):
    for smem_per_sm in (233472, 167936):  # H200, A100
        cfg = gemm.mma_config(*mnk, 132, smem_per_sm, False)
        assert cfg in gemm.MMA_LARGE + tuple(gemm.MMA_DEEP.values())
        assert cfg.smem <= smem_per_sm - 1024 and cfg.threads <= 1024


def test_mma_config_large_problem_uses_largest_tile():
    assert gemm.mma_config(8192, 8192, 8192, 132, 233472, False) == gemm.MmaConfig(128, 256, 64, 2, 4, 1, 3)
    assert gemm.mma_config(8192, 8192, 8192, 132, 233472, False, False) == gemm.MmaConfig(128, 256, 64, 2, 4, 1, 3)
    assert gemm.mma_config(8192, 8192, 8192, 108, 167936, False) == gemm.MmaConfig(128, 256, 64, 2, 4, 1, 3)
    # sm_86 / sm_89: 100 KB of shared memory per SM, only the 64 x 128 ring fits
    cfg = gemm.mma_config(8192, 8192, 8192, 84, 102400, False)
    assert cfg.smem + 1024 <= 102400 and cfg in gemm.MMA_LARGE


def test_skinny_config_m16_rules():
    # one CTA per SM: the deep ring; more: the default; an N-major B with N >= ~0.9 x 64 x SMs: 64 columns
    assert gemm.mma_config(16, 4096, 4096, 132, 233472, True) == gemm.MMA_SKINNY_DEEP
    assert gemm.mma_config(1, 4096, 4096, 132, 233472, True, False) == gemm.MMA_SKINNY_DEEP
    assert gemm.mma_config(16, 8192, 8192, 132, 233472, True) == gemm.MMA_SKINNY[16]
    assert gemm.mma_config(16, 14336, 4096, 132, 233472, True, False) == gemm.MMA_SKINNY_NMAJOR
    assert gemm.mma_config(16, 14336, 4096, 132, 233472, True, True) == gemm.MMA_SKINNY[16]
    assert gemm.mma_config(17, 14336, 4096, 132, 233472, True, False) == gemm.MMA_SKINNY_WIDE[32]
    assert gemm.mma_config(16, 14336, 4096, 84, 102400, True, False) == gemm.MMA_SKINNY[16]  # 100 KB SMs


@pytest.mark.parametrize("kmajor", [True, False])
@pytest.mark.parametrize("mnk", [(4096, 4096, 4096), (8192, 8192, 8192), (512, 14336, 4096), (2048, 4096, 14336),
                                 (129, 8, 8), (999, 264, 200), (128, 28672, 8192), (512, 28672, 8192)])
def test_wgmma_config_minimizes_time_and_fits(mnk, kmajor):
    m, n, k = mnk
    cfg = gemm.wgmma_config(m, n, k, 132, 232448, kmajor)
    assert (cfg.bm, cfg.bn) in gemm.wgmma_tiles(kmajor)
    assert 2 <= cfg.stages <= gemm.WGMMA_MAX_STAGES and cfg.smem <= 232448

    def cost(bm, bn):
        return math.ceil(math.ceil(m / bm) * math.ceil(n / bn) / 132) * bm * bn / gemm.WGMMA_TILE_EFFICIENCY[(bm, bn)]

    assert all(cost(cfg.bm, cfg.bn) <= cost(bm, bn) * (1 + 1e-9) for bm, bn in gemm.wgmma_tiles(kmajor))


def test_wgmma_config_picks_whole_waves():
    # 512 x 28672: 448 tiles of 128 x 256 need 3.4 waves; 512 tiles of 128 x 224 fill 3.9.
    assert (gemm.wgmma_config(512, 28672, 8192, 132, 232448, True).bn) == 224
    assert (gemm.wgmma_config(512, 28672, 8192, 132, 232448, False).bn) != 224  # N-major B: 64-column blocks
    assert gemm.wgmma_config(8192, 8192, 8192, 132, 232448, True) == gemm.WgmmaConfig(128, 256, 4)
    # decode-sized M: 64-row tiles, 64 x 128 from ~3/4 of a wave on, else 64 x 64 (K-major B only)
    pick = lambda m, n, kmajor=True: (lambda c: (c.bm, c.bn))(gemm.wgmma_config(m, n, 4096, 132, 232448, kmajor))  # noqa
    assert pick(64, 4096) == (64, 64) and pick(64, 8192) == (64, 64) and pick(33, 4096) == (64, 64)
    assert pick(64, 14336) == (64, 128) and pick(64, 28672) == (64, 128) and pick(64, 4096, False) == (64, 128)
    assert pick(128, 4096) == (64, 64) and pick(128, 8192) == (64, 128)
    assert pick(128, 14336)[0] == 128 and pick(128, 28672)[0] == 128 and pick(129, 4096)[0] == 128
    # two row blocks, few weight tiles, long K: 128 x 64 tiles, split along K
    assert gemm.wgmma_config(128, 4096, 14336, 132, 232448, True) == gemm.WgmmaConfig(128, 64, 8)
    assert gemm.wgmma_config(96, 4096, 8192, 132, 232448, True).bm == 128
    assert gemm.wgmma_config(128, 4096, 4096, 132, 232448, True).bm == 64  # short K: 64 x 64 stayed ahead
    assert gemm.wgmma_config(64, 4096, 14336, 132, 232448, True).bm == 64  # one row block


def test_wgmma_staging_matches_kernel():
    """WgmmaConfig.staging / store_box_cols mirror EPI_BYTES / StoreBox in kernels/gemm_sm90.cu."""
    for bm, bn in gemm.WGMMA_TILES + gemm.WGMMA_DECODE_TILES:
        cfg = gemm.WgmmaConfig(bm, bn, 4)
        wg_m = 64 if bm == 64 else bm // 2
        assert cfg.wg_n * (2 if bm == 64 else 1) == bn
        box_bytes = 64 * cfg.store_box_cols * 2
        assert cfg.wg_n % cfg.store_box_cols == 0 and cfg.staging % box_bytes == 0
        assert cfg.staging == min(wg_m * cfg.wg_n * 2, 16384)


def test_every_launchable_variant_is_listed():
    names = {k.name for k in gemm.all_kernels()}
    for dtype in ("float16", "bfloat16"):
        for m, n, k in [(1, 4096, 4096), (40, 4096, 4096), (64, 8, 8), (999, 264, 200), (8192, 8192, 8192),
                        (128, 8192, 8192), (512, 14336, 4096)]:
            for skinny in (True, False):
                cfg = gemm.mma_config(m, n, k, 132, 233472, skinny)
                for kmajor in (True, False):
                    assert gemm._mma_kernel(dtype, cfg, kmajor).name in names
            for kmajor in (True, False):
                w = gemm.wgmma_config(m, n, k, 132, 232448, kmajor)
                assert gemm._wgmma_kernel(dtype, w, kmajor).name in names


@pytest.mark.parametrize("path", gemm.PATHS)
@pytest.mark.parametrize("mnk", [(1, 4096, 4096), (999, 264, 200), (8192, 8192, 8192)])
def test_plan_matches_heuristics(path, mnk):
    m, n, k = mnk
    cfg, kernel, lcfg, sizes = gemm._plan(path, "bfloat16", m, n, k, True, 132, 233472, 232448)
    assert [int(v) for v in sizes[:3]] == [m, n, k]
    assert lcfg.smem == cfg.smem and lcfg.threads == cfg.threads
    assert kernel.name in {kk.name for kk in gemm.all_kernels()}
    tiles = math.ceil(m / cfg.bm) * math.ceil(n / cfg.bn)
    if path == "hopper":
        splits = gemm.wgmma_splits(m, n, k, cfg, 132)
        assert sizes[3:] == (splits, tiles) and lcfg.grid == (min(tiles * splits, 132),)
    else:
        assert len(sizes) == 3 and lcfg.grid == (tiles,)


@pytest.mark.parametrize("mnk", [(64, 4096, 14336), (64, 4096, 4096), (40, 512, 4096), (33, 264, 200),
                                 (64, 8, 8), (128, 4096, 14336), (8192, 8192, 8192), (64, 28672, 8192)])
def test_wgmma_splits_fill_one_wave_and_cover_k_once(mnk):
    """Split-K of the Hopper kernel: only where the tiles leave SMs idle, within one wave, at least 4 k blocks per
    split; the kernel's unit decomposition (tile = u / splits, k blocks [s KB / S, (s + 1) KB / S)) covers each
    tile's k blocks once."""
    m, n, k = mnk
    cfg = gemm.wgmma_config(m, n, k, 132, 232448, True)
    s = gemm.wgmma_splits(m, n, k, cfg, 132)
    tiles = math.ceil(m / cfg.bm) * math.ceil(n / cfg.bn)
    kb = math.ceil(k / 64)
    assert 1 <= s <= gemm.WGMMA_MAX_SPLITS
    if tiles >= 0.75 * 132:
        assert s == 1
    else:
        assert tiles * s <= 132 and (s == 1 or kb // s >= gemm.WGMMA_MIN_SPLIT_BLOCKS)
    seen = [[0] * kb for _ in range(tiles)]
    for u in range(tiles * s):
        t, sp = u // s, u % s
        for b in range(sp * kb // s, (sp + 1) * kb // s):
            seen[t][b] += 1
    assert all(c == 1 for row in seen for c in row)
    assert all((sp + 1) * kb // s > sp * kb // s for sp in range(s))  # no empty unit


def test_wgmma_splits_choices():
    split = lambda m, n, k: gemm.wgmma_splits(m, n, k, gemm.wgmma_config(m, n, k, 132, 232448, True), 132)  # noqa
    assert split(64, 4096, 14336) == 2       # 64 tiles of 64 x 64 -> 128 units
    assert split(40, 512, 4096) == 16        # 8 tiles, 64 k blocks: 16 splits of 4
    assert split(64, 28672, 8192) == 1 and split(8192, 8192, 8192) == 1 and split(128, 4096, 4096) == 1
    assert split(128, 4096, 14336) == 2      # 64 tiles of 128 x 64 -> 128 units
    assert split(64, 8, 8) == 1              # one k block


def test_tma_checks():
    from speedcore import _tma

    _tma.check_2d(1 << 20, "bfloat16", rows=100, cols=64, row_stride=64, box_rows=128, box_cols=64)
    with pytest.raises(ValueError, match="16-byte aligned"):
        _tma.check_2d(8, "bfloat16", rows=100, cols=64, row_stride=64, box_rows=128, box_cols=64)
    with pytest.raises(ValueError, match="row stride"):
        _tma.check_2d(1 << 20, "bfloat16", rows=100, cols=60, row_stride=60, box_rows=128, box_cols=64)


# -- GPU -------------------------------------------------------------------------------------------------------
def _torch():
    return pytest.importorskip("torch")


def _ref(torch, x, w_nk, bias, act):
    y = x.float() @ w_nk.float().t()
    if bias is not None:
        y = y + bias.float()
    F = torch.nn.functional
    if act == "silu":
        y = F.silu(y)
    elif act == "gelu":
        y = F.gelu(y)
    elif act == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    elif act == "relu":
        y = F.relu(y)
    return y


def _assert_close(out, ref, what=""):
    o = out.float()
    assert not o.isnan().any(), f"{what}: NaN in output (unwritten elements?)"
    err = (o - ref).abs().max().item()
    scale = ref.abs().max().item() + 1e-6
    assert err <= 1e-2 * scale, f"{what}: max error {err} vs scale {scale}"


def _dev_cc(torch):
    return torch.cuda.get_device_capability()


def _paths(torch):
    return ["ampere", "skinny"] + (["hopper"] if _dev_cc(torch) == (9, 0) else [])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("path", ["ampere", "skinny", "hopper"])
@pytest.mark.parametrize("m", [1, 7, 64, 999])
def test_linear_odd_m_every_path(path, dtype, m):
    torch = _torch()
    if path not in _paths(torch):
        pytest.skip("the hopper path needs an sm_90 GPU")
    import speedcore

    dt = getattr(torch, dtype)
    torch.manual_seed(m)
    n, k = 264, 1064
    x = torch.randn(m, k, device="cuda", dtype=dt)
    w = torch.randn(n, k, device="cuda", dtype=dt) / math.sqrt(k)
    bias = torch.randn(n, device="cuda", dtype=dt)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dt)
    got = speedcore.linear(x, w, bias, out=out, _path=path)
    assert got is out
    _assert_close(out, _ref(torch, x, w, bias, None), f"{path} m={m}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("path", ["ampere", "skinny", "hopper"])
@pytest.mark.parametrize("act", ACTS)
def test_linear_epilogues(path, dtype, act):
    torch = _torch()
    if path not in _paths(torch):
        pytest.skip("the hopper path needs an sm_90 GPU")
    import speedcore

    dt = getattr(torch, dtype)
    torch.manual_seed(1)
    m, n, k = (33 if path == "skinny" else 301), 136, 200
    x = torch.randn(m, k, device="cuda", dtype=dt)
    w = torch.randn(n, k, device="cuda", dtype=dt) / math.sqrt(k)
    for bias in (None, torch.randn(n, device="cuda", dtype=dt)):
        y = speedcore.linear(x, w, bias, activation=act, _path=path)
        _assert_close(y, _ref(torch, x, w, bias, act), f"{path} {act} bias={bias is not None}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("path", ["ampere", "skinny", "hopper"])
@pytest.mark.parametrize("b_layout", ["kn", "nk_view"])
def test_matmul_layouts(path, dtype, b_layout):
    torch = _torch()
    if path not in _paths(torch):
        pytest.skip("the hopper path needs an sm_90 GPU")
    import speedcore

    dt = getattr(torch, dtype)
    torch.manual_seed(2)
    for m in (5, 130):
        n, k = 392, 328
        a = torch.randn(m, k, device="cuda", dtype=dt)
        if b_layout == "kn":
            b = torch.randn(k, n, device="cuda", dtype=dt) / math.sqrt(k)
        else:
            b = (torch.randn(n, k, device="cuda", dtype=dt) / math.sqrt(k)).t()
        ref = a.float() @ b.float()
        _assert_close(speedcore.matmul(a, b, _path=path), ref, f"{path} {b_layout} m={m}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("tile", gemm.WGMMA_TILES + gemm.WGMMA_DECODE_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_hopper_every_tile(tile, dtype, monkeypatch):
    """Each wgmma tile (forced), both B layouts where it serves them: partial tiles in M and N (store boxes
    clipped by TMA), several tiles per CTA (grid capped at 7 CTAs), bias + activation, a strided out view."""
    torch = _torch()
    if _dev_cc(torch) != (9, 0):
        pytest.skip("the hopper path needs an sm_90 GPU")
    import speedcore

    bm, bn = tile
    monkeypatch.setattr(gemm, "wgmma_config", lambda m, n, k, sms, smem, kmajor=True: gemm.WgmmaConfig(
        bm, bn, gemm._wgmma_stages(bm, bn, smem)))
    monkeypatch.setattr(gemm, "_plan", gemm._plan.__wrapped__)
    real_info = gemm.device_info
    monkeypatch.setattr(gemm, "device_info", lambda i: dataclasses.replace(real_info(i), sms=7))
    dt = getattr(torch, dtype)
    torch.manual_seed(bm + bn)
    for m, n, k in [(3 * bm - 5, 4 * bn + 8, 328), (1, 24, 64)]:
        x = torch.randn(m, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt) / math.sqrt(k)
        bias = torch.randn(n, device="cuda", dtype=dt)
        out_big = torch.full((m, n + 8), float("nan"), device="cuda", dtype=dt)
        out = out_big[:, :n]
        speedcore.linear(x, w, bias, activation="gelu", out=out, _path="hopper")
        _assert_close(out, _ref(torch, x, w, bias, "gelu"), f"{tile} linear {m}x{n}x{k}")
        assert out_big[:, n:].isnan().all(), "wrote outside the out view"
        if tile not in gemm.WGMMA_KMAJOR_ONLY:
            b = torch.randn(k, n, device="cuda", dtype=dt) / math.sqrt(k)
            _assert_close(speedcore.matmul(x, b, _path="hopper"), x.float() @ b.float(), f"{tile} matmul {m}x{n}x{k}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mnk", [(40, 512, 4096), (64, 4096, 1000), (5, 264, 1064), (100, 1032, 2056),
                                 (100, 1032, 8200)])
def test_hopper_split_k(mnk, dtype):
    """Split-K on the Hopper path (few tiles, long K): K not a multiple of 64 or of the splits, partial tiles in M
    and N, bias + activation into a NaN-poisoned strided out view; twice (the tickets reset themselves) with the same
    bits (the partials are summed in split order); an N-major B as well."""
    torch = _torch()
    if _dev_cc(torch) != (9, 0):
        pytest.skip("the hopper path needs an sm_90 GPU")
    import speedcore

    m, n, k = mnk
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = gemm.wgmma_config(m, n, k, sms, 232448, True)
    assert gemm.wgmma_splits(m, n, k, cfg, sms) > 1, "the case must split K"
    dt = getattr(torch, dtype)
    torch.manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", dtype=dt)
    w = torch.randn(n, k, device="cuda", dtype=dt) / math.sqrt(k)
    bias = torch.randn(n, device="cuda", dtype=dt)
    outs = []
    for _ in range(2):
        out_big = torch.full((m, n + 8), float("nan"), device="cuda", dtype=dt)
        out = out_big[:, :n]
        speedcore.linear(x, w, bias, activation="silu", out=out, _path="hopper")
        _assert_close(out, _ref(torch, x, w, bias, "silu"), f"split-K linear {m}x{n}x{k}")
        assert out_big[:, n:].isnan().all(), "wrote outside the out view"
        outs.append(out.clone())
    assert torch.equal(outs[0], outs[1])
    b = torch.randn(k, n, device="cuda", dtype=dt) / math.sqrt(k)
    _assert_close(speedcore.matmul(x, b, _path="hopper"), x.float() @ b.float(), f"split-K matmul {m}x{n}x{k}")


@pytest.mark.gpu
def test_hopper_split_k_in_cuda_graph():
    """Split-K launches captured by torch.cuda.graph replay correctly with new inputs, also after a larger
    problem has grown the shared scratch (the captured graph keeps its own buffer)."""
    torch = _torch()
    if _dev_cc(torch) != (9, 0):
        pytest.skip("the hopper path needs an sm_90 GPU")
    import speedcore

    m, n, k = 64, 4096, 8200
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert gemm.wgmma_splits(m, n, k, gemm.wgmma_config(m, n, k, sms, 232448, True), sms) > 1
    torch.manual_seed(7)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and allocate outside the capture
        speedcore.linear(x, w, out=out)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        speedcore.linear(x, w, out=out)
    big_m, big_k = 128, 16400  # a larger split-K problem (128 x 64 tiles, twice the partials): the scratch grows
    assert gemm.wgmma_splits(big_m, n, big_k, gemm.wgmma_config(big_m, n, big_k, sms, 232448, True), sms) > 1
    xb = torch.randn(big_m, big_k, device="cuda", dtype=torch.bfloat16)
    wb = torch.randn(n, big_k, device="cuda", dtype=torch.bfloat16) / math.sqrt(big_k)
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        yb = speedcore.linear(xb, wb)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        g.replay()
        g2.replay()
        torch.cuda.synchronize()
        _assert_close(out, _ref(torch, x, w, None, "none"), "graph replay")
        _assert_close(yb, _ref(torch, xb, wb, None, "none"), "second graph replay")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cfg", sorted(set(gemm.MMA_LARGE + tuple(gemm.MMA_DEEP.values())), key=str),
                         ids=lambda c: f"{c.bm}x{c.bn}w{c.wm}{c.wn}s{c.stages}")
def test_ampere_every_tile(cfg, dtype, monkeypatch):
    """Each large mma.sync tile (forced), both B layouts: partial tiles in M, N and K (K not a multiple of 64,
    fewer k-tiles than stages), bias + activation, a strided out view."""
    torch = _torch()
    import speedcore

    monkeypatch.setattr(gemm, "mma_config", lambda *a, **kw: cfg)
    monkeypatch.setattr(gemm, "_plan", gemm._plan.__wrapped__)
    dt = getattr(torch, dtype)
    torch.manual_seed(cfg.bm + cfg.bn + cfg.stages)
    for m, n, k in [(2 * cfg.bm + 3, 2 * cfg.bn + 72, 1000), (cfg.bm - 1, cfg.bn - 8, 72), (5, 24, 8)]:
        x = torch.randn(m, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt) / math.sqrt(k)
        bias = torch.randn(n, device="cuda", dtype=dt)
        out_big = torch.full((m, n + 8), float("nan"), device="cuda", dtype=dt)
        out = out_big[:, :n]
        speedcore.linear(x, w, bias, activation="silu", out=out, _path="ampere")
        _assert_close(out, _ref(torch, x, w, bias, "silu"), f"{cfg} linear {m}x{n}x{k}")
        assert out_big[:, n:].isnan().all(), "wrote outside the out view"
        b = torch.randn(k, n, device="cuda", dtype=dt) / math.sqrt(k)
        _assert_close(speedcore.matmul(x, b, _path="ampere"), x.float() @ b.float(), f"{cfg} matmul {m}x{n}x{k}")
        _assert_close(speedcore.matmul(x, w.t(), _path="ampere"), x.float() @ w.float().t(), f"{cfg} nk {m}x{n}x{k}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_default_dispatch_many_tiles(dtype):
    """Default path on big-ish problems: more tiles than SMs (persistent loop, ring phases wrap)."""
    torch = _torch()
    import speedcore

    dt = getattr(torch, dtype)
    torch.manual_seed(3)
    for m, n, k in [(1999, 4104, 136), (1024, 1024, 1024), (16, 4096, 4096), (3, 11008, 512), (40, 8448, 264),
                    (20, 8448, 136), (9, 8448, 200)]:
        x = torch.randn(m, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt) / math.sqrt(k)
        _assert_close(speedcore.linear(x, w, activation="silu"), _ref(torch, x, w, None, "silu"), f"{m}x{n}x{k}")
        b = torch.randn(k, n, device="cuda", dtype=dt) / math.sqrt(k)
        _assert_close(speedcore.matmul(x, b), x.float() @ b.float(), f"matmul {m}x{n}x{k}")


@pytest.mark.gpu
@pytest.mark.parametrize("path", [None, "ampere", "skinny", "hopper"])
def test_views_batched_and_strided_out(path):
    torch = _torch()
    if path is not None and path not in _paths(torch):
        pytest.skip("the hopper path needs an sm_90 GPU")
    import speedcore

    dt = torch.bfloat16
    torch.manual_seed(4)
    k, n = 256, 200
    big = torch.randn(3, 41, k + 64, device="cuda", dtype=dt)
    x = big[..., 32:32 + k]  # rows of stride k + 64, a 16-byte aligned offset
    w_big = torch.randn(n, k + 8, device="cuda", dtype=dt) / 16
    w = w_big[:, :k]
    bias = torch.randn(n, device="cuda", dtype=dt)
    out_big = torch.full((3, 41, n + 16), float("nan"), device="cuda", dtype=dt)
    out = out_big[..., :n]
    speedcore.linear(x, w, bias, activation="gelu_tanh", out=out, _path=path)
    _assert_close(out, _ref(torch, x.reshape(-1, k), w, bias, "gelu_tanh").reshape(3, 41, n), f"{path}")
    assert out_big[..., n:].isnan().all(), "wrote outside the out view"


@pytest.mark.gpu
def test_bad_inputs_raise_before_launch():
    torch = _torch()
    import speedcore

    h = torch.float16
    x = torch.randn(4, 64, device="cuda", dtype=h)
    w = torch.randn(32, 64, device="cuda", dtype=h)
    with pytest.raises(TypeError, match="dtype"):
        speedcore.linear(x.float(), w.float())
    with pytest.raises(TypeError, match="does not match"):
        speedcore.linear(x, w.bfloat16())
    with pytest.raises(TypeError, match="CUDA"):
        speedcore.linear(x.cpu(), w)
    with pytest.raises(ValueError, match="multiples of 8"):
        speedcore.linear(torch.randn(4, 60, device="cuda", dtype=h), torch.randn(32, 60, device="cuda", dtype=h))
    with pytest.raises(ValueError, match="multiples of 8"):
        speedcore.linear(x, torch.randn(30, 64, device="cuda", dtype=h))
    with pytest.raises(ValueError, match="weight"):
        speedcore.linear(x, torch.randn(32, 72, device="cuda", dtype=h))
    with pytest.raises(ValueError, match="16-byte"):
        speedcore.linear(torch.randn(4, 72, device="cuda", dtype=h)[:, 1:65], w)
    with pytest.raises(ValueError, match="activation"):
        speedcore.linear(x, w, activation="tanh")
    with pytest.raises(ValueError, match="bias"):
        speedcore.linear(x, w, torch.randn(31, device="cuda", dtype=h))
    with pytest.raises(ValueError, match="out"):
        speedcore.linear(x, w, out=torch.empty(4, 31, device="cuda", dtype=h))
    with pytest.raises(ValueError, match="rows"):
        speedcore.matmul(x, torch.randn(72, 32, device="cuda", dtype=h))
    with pytest.raises(ValueError, match="_path"):
        speedcore.linear(x, w, _path="turing")


@pytest.mark.gpu
def test_empty_m_and_cupy_arrays():
    torch = _torch()
    import speedcore

    x = torch.randn(0, 64, device="cuda", dtype=torch.float16)
    w = torch.randn(32, 64, device="cuda", dtype=torch.float16)
    assert speedcore.linear(x, w).shape == (0, 32)
    cp = pytest.importorskip("cupy")
    a = cp.random.standard_normal((70, 128)).astype(cp.float16)
    b = (cp.random.standard_normal((128, 96)) / 11).astype(cp.float16)
    y = speedcore.matmul(a, b)
    assert isinstance(y, cp.ndarray)
    ref = a.astype(cp.float32) @ b.astype(cp.float32)
    assert float(cp.abs(y.astype(cp.float32) - ref).max()) <= 1e-2 * float(cp.abs(ref).max())


def test_launch_arguments_without_a_gpu(monkeypatch):
    """The wrapper's argument packing for each path, with the launch, device and stream stubbed out: the
    kernel signatures in kernels/gemm.cu and kernels/gemm_sm90.cu take exactly these types in this order."""
    import numpy as np

    from speedcore import _arrays as A
    from speedcore import _launch, _tma

    calls = []

    class Bound:  # what _launch.bind returns: .fixed(types) gives the launch of exactly those argument types
        def __init__(self, kernel, cfg):
            self.kernel, self.cfg = kernel, cfg

        def fixed(self, types):
            types = tuple(types)

            def run(stream_ptr, args):
                assert len(args) == len(types)
                calls.append((self.kernel, self.cfg, args, types))
            return run

        def prepacked(self, variable_types, constants):
            types = tuple(variable_types) + tuple(map(type, constants))

            def run(stream_ptr, *pointers):
                assert len(pointers) == len(variable_types)
                calls.append((self.kernel, self.cfg, pointers + tuple(constants), types))
            return run

    monkeypatch.setattr(gemm, "bind", lambda kernel, cfg, device: Bound(kernel, cfg))

    def gemm_call(*a):
        run = gemm._gemm(*a)
        run(0, a[0].ptr, a[4].ptr, a[8].ptr if a[8] is not None else 0, a[10].ptr)
        return calls[-1]
    monkeypatch.setattr(gemm, "device_info", lambda i: _launch.DeviceInfo(0, "H200", (9, 0), 132, 1024, 49152,
                                                                          232448, 233472, 60 << 20))
    monkeypatch.setattr(_tma, "_tile_map_bytes", lambda *a: bytes(128))
    scratch = []
    monkeypatch.setattr(A, "stream_buffer", lambda kind, ref, stream, n, dtype, **kw: scratch.append(
        (kind, n, dtype, kw)) or type("B", (), {"ptr": 0x7000 if kind == "workspace" else 0x8000})())

    def arr(name, shape, strides, ptr):
        return A.Array(None, "torch", ptr, shape, strides, "bfloat16", 0, name)

    m, n, k = 300, 264, 200
    a = arr("x", (m, k), (k, 1), 1 << 20)
    w = arr("weight", (n, k), (k, 1), 2 << 20)
    o = arr("out", (m, n), (n, 1), 3 << 20)
    bias = arr("bias", (n,), (1,), 4 << 20)
    for path in gemm.PATHS:
        kernel, cfg, args, types = gemm_call(a, m, k, k, w, n, k, True, bias, "gelu", o, n, path)
        if path == "hopper":
            assert kernel.hopper and kernel.source == "gemm_sm90.cu"
            assert types[:3] == (bytes,) * 3 and all(len(v) == 128 for v in args[:3]) and args[3] == 4 << 20
            assert types[3:] == (int,) + (np.int32,) * 5 + (int, int, np.int32)
            assert [int(v) for v in args[4:]] == [m, n, k, 2, gemm.GROUP_M, 0, 0, 1]  # no split: no scratch
        else:
            assert not kernel.hopper and kernel.source == "gemm.cu"
            assert args[:4] == (3 << 20, 1 << 20, 2 << 20, 4 << 20)
            assert types == (int,) * 4 + (np.int32,) * 3 + (np.int64,) * 3 + (np.int32, np.int32)
            assert [int(v) for v in args[4:]] == [m, n, k, k, k, n, 2, gemm.GROUP_M]
    kernel, cfg, args, types = gemm_call(a, m, k, k, arr("b", (k, n), (n, 1), 5 << 20), n, n, False, None, None, o,
                                         n, None)
    assert kernel.hopper and kernel.name.endswith("false>") and args[3] == 0
    assert [int(v) for v in args[4:]] == [m, n, k, 0, gemm.GROUP_M, 0, 0, 1]
    assert not scratch
    # split-K (decode-sized M on few tiles): fp32 partials in bytes in the shared "workspace", tickets per tile
    m2, n2, k2 = 40, 512, 4096
    kernel, cfg, args, types = gemm_call(arr("x", (m2, k2), (k2, 1), 1 << 20), m2, k2, k2,
                                         arr("weight", (n2, k2), (k2, 1), 2 << 20), n2, k2, True, None, None,
                                         arr("out", (m2, n2), (n2, 1), 3 << 20), n2, "hopper")
    assert [int(v) for v in args[4:]] == [m2, n2, k2, 0, gemm.GROUP_M, 0x7000, 0x8000, 16]
    assert scratch == [("workspace", 16 * m2 * n2 * 4, "uint8", {"min_n": 1 << 20}),
                       ("tickets", 8, "int32", {"zeroed": True})]
    assert cfg.grid == (8 * 16,)
    with pytest.raises(ValueError, match="16-byte"):
        gemm._gemm(arr("x", (m, k), (k, 1), (1 << 20) + 2), m, k, k, w, n, k, True, None, None, o, n, None)
    big = 1 << 23
    with pytest.raises(ValueError, match="row strides"):
        gemm._gemm(arr("x", (m, k), (big, 1), 1 << 20), m, k, big, w, n, k, True, None, None, o, n, "ampere")
