"""Weight-only quantized linear layers: formats (CPU, bit-exact), heuristics, and the GPU kernels."""
import contextlib
import json
import struct

import numpy as np
import pytest

from speedcore import quant as Q

from quant_fakes import FakeTensor, act_order_gptq, assert_picks_rows, install_fake_gpu, launched
from quant_fakes import linear as _linear
from quant_fakes import pow2_scaled as _pow2_scaled

RNG = np.random.default_rng(1234)


# ------------------------------------------------------------------------------------------------ formats (CPU)

def test_awq_packing_order_hand_made():
    # channel n of the 8 in a word holds value n: nibble i must hold channel AWQ_ORDER[i]
    q = np.arange(8, dtype=np.uint8)[None, :]
    word = Q.pack_awq(q).view(np.uint32)[0, 0]
    assert word == 0x75316420
    assert np.array_equal(Q.unpack_awq(np.array([[0x75316420]], np.uint32).view(np.int32)), q)
    # one non-zero channel at a time
    for n in range(8):
        q = np.zeros((1, 8), np.uint8)
        q[0, n] = 0xF
        w = int(Q.pack_awq(q).view(np.uint32)[0, 0])
        assert w == 0xF << (4 * Q.AWQ_ORDER.index(n))


def test_gptq_packing_order_hand_made():
    q = np.arange(8, dtype=np.uint8)[:, None] * np.ones((1, 2), np.uint8)
    q[:, 1] = 15 - q[:, 1]
    words = Q.pack_rows(q).view(np.uint32)
    assert words[0, 0] == 0x76543210 and words[0, 1] == 0x89ABCDEF
    z = np.arange(8, dtype=np.uint8)[None, :]
    assert Q.pack_cols(z).view(np.uint32)[0, 0] == 0x76543210
    assert np.array_equal(Q.unpack_rows(Q.pack_rows(q)), q)
    assert np.array_equal(Q.unpack_cols(Q.pack_cols(z)), z)


def test_pack_roundtrip_random():
    q = RNG.integers(0, 16, size=(64, 48), dtype=np.uint8)
    assert np.array_equal(Q.unpack_awq(Q.pack_awq(q)), q)
    assert np.array_equal(Q.unpack_rows(Q.pack_rows(q)), q)
    assert np.array_equal(Q.unpack_cols(Q.pack_cols(q)), q)
    assert Q.pack_awq(q).dtype == np.int32 and Q.pack_awq(q).shape == (64, 6)
    assert Q.pack_rows(q).shape == (8, 48)


def test_awq_reference_hand_made():
    # K=2, N=8, G=1: W[k, n] = (q - z) * s
    q = np.array([[0, 1, 2, 3, 4, 5, 6, 7], [15, 14, 13, 12, 11, 10, 9, 8]], np.uint8)
    z = np.array([[1] * 8, [8] * 8], np.uint8)
    s = np.array([[0.5] * 8, [2.0] * 8], np.float16)
    w = Q.dequantize_awq_reference(Q.pack_awq(q), Q.pack_awq(z), s, group_size=1)
    expect = (q.astype(np.float32) - z) * s.astype(np.float32)
    assert np.array_equal(w, expect)
    assert w[0, 0] == -0.5 and w[1, 7] == 0.0 and w[1, 0] == 14.0


def test_gptq_reference_hand_made_zero_minus_one_and_g_idx():
    k, n = 8, 8
    q = np.full((k, n), 9, np.uint8)
    stored = np.array([[7] * 8, [3] * 8], np.uint8)  # zeros 8 and 4
    s = np.array([[1.0] * 8, [0.25] * 8], np.float16)
    g_idx = np.array([0, 1, 0, 1, 0, 1, 0, 1], np.int32)
    w = Q.dequantize_gptq_reference(Q.pack_rows(q), Q.pack_cols(stored), s, g_idx, group_size=4)
    assert np.array_equal(w[0::2], np.full((4, 8), 1.0, np.float32))      # (9 - 8) * 1
    assert np.array_equal(w[1::2], np.full((4, 8), 1.25, np.float32))     # (9 - 4) * 0.25
    w2 = Q.dequantize_gptq_reference(Q.pack_rows(q), Q.pack_cols(stored), s, None, group_size=4)
    assert np.array_equal(w2[:4], np.full((4, 8), 1.0, np.float32))


@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_quantize_awq_roundtrip(group):
    w = RNG.standard_normal((64, 256)).astype(np.float32)
    qw, qz, s = Q.quantize_awq(w, group)
    g = 256 if group == -1 else group
    assert qw.shape == (256, 8) and qz.shape == (256 // g, 8) and s.shape == (256 // g, 64)
    assert qw.dtype == np.int32 and qz.dtype == np.int32 and s.dtype == np.float16
    wd = Q.dequantize_awq_reference(qw, qz, s, g)
    err = np.abs(wd - w.T)
    bound = s.astype(np.float32)[np.arange(256) // g] * 0.5 + 1e-3 + np.abs(w.T) * 2e-3
    assert (err <= bound).all()
    # the dequantizer is bit-exact with (q - z) * s over the unpacked values
    q, z = Q.unpack_awq(qw).astype(np.float32), Q.unpack_awq(qz).astype(np.float32)
    grp = np.arange(256) // g
    assert np.array_equal(wd, (q - z[grp]) * s.astype(np.float32)[grp])


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_quantize_gptq_roundtrip(sym, act_order):
    k, n, g = 320, 64, 128  # last group short
    w = RNG.standard_normal((n, k)).astype(np.float32)
    perm = RNG.permutation(k) if act_order else None
    qw, qz, s, g_idx = Q.quantize_gptq(w, g, perm=perm, sym=sym)
    assert qw.shape == (40, 64) and qz.shape == (3, 8) and s.shape == (3, 64) and g_idx.shape == (k,)
    if act_order:
        assert not np.array_equal(g_idx, np.arange(k) // g)
        assert np.bincount(g_idx).tolist() == [128, 128, 64]
    else:
        assert np.array_equal(g_idx, np.arange(k) // g)
    wd = Q.dequantize_gptq_reference(qw, qz, s, g_idx, g)
    err = np.abs(wd - w.T)
    assert (err <= s.astype(np.float32)[g_idx] * 0.5 + 1e-3 + np.abs(w.T) * 2e-3).all()
    if sym:
        assert (Q.unpack_cols(qz) == 7).all()


def test_quantize_int8_roundtrip():
    w = RNG.standard_normal((48, 80)).astype(np.float32)
    q, s = Q.quantize_int8(w)
    assert q.dtype == np.int8 and s.shape == (48,)
    wd = Q.dequantize_int8_reference(q, s)
    assert wd.shape == (80, 48)
    assert np.array_equal(wd, q.T.astype(np.float32) * s.astype(np.float32))
    assert (np.abs(wd - w.T) <= s.astype(np.float32) * 0.5 + 1e-4).all()


def test_quantizer_errors():
    with pytest.raises(ValueError, match="multiple of group_size"):
        Q.quantize_awq(np.zeros((8, 100), np.float32), 64)
    with pytest.raises(ValueError):
        Q.quantize_awq(np.zeros((12, 128), np.float32), 64)
    with pytest.raises(ValueError, match="permutation"):
        Q.quantize_gptq(np.zeros((8, 16), np.float32), 8, perm=[0] * 16)
    with pytest.raises(ValueError, match="group_size"):
        Q.quantize_awq(np.zeros((8, 128), np.float32), 0)


def _write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    names = {"float16": "F16", "float32": "F32", "int32": "I32", "int8": "I8", "bfloat16": "BF16"}
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": names[str(arr.dtype)], "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_load_safetensors(tmp_path):
    import ml_dtypes

    w = RNG.standard_normal((64, 256)).astype(np.float32)
    qw, qz, s = Q.quantize_awq(w, 128)
    other = RNG.standard_normal((3, 5)).astype(ml_dtypes.bfloat16)
    path = tmp_path / "layer.safetensors"
    _write_safetensors(path, {"model.l0.q.qweight": qw, "model.l0.q.qzeros": qz, "model.l0.q.scales": s,
                              "model.l1.q.qweight": qw[:8], "other": other})
    got = Q.load_safetensors(path, "model.l0.q.")
    assert set(got) == {"qweight", "qzeros", "scales"}
    assert np.array_equal(got["qweight"], qw) and got["qweight"].dtype == np.int32
    assert np.array_equal(got["scales"], s) and got["scales"].dtype == np.float16
    o = Q.load_safetensors(path, "other")
    assert o[""].dtype == other.dtype and np.array_equal(o[""].astype(np.float32), other.astype(np.float32))
    try:
        from safetensors.numpy import save_file
    except ImportError:
        return
    p2 = tmp_path / "b.safetensors"
    save_file({"x.qzeros": qz, "x.scales": s}, str(p2))
    got = Q.load_safetensors(p2, "x.")
    assert np.array_equal(got["qzeros"], qz) and np.array_equal(got["scales"], s)


def test_load_safetensors_rejects_garbage(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(b"abc")
    with pytest.raises(ValueError, match="not a safetensors"):
        Q.load_safetensors(p)


# ------------------------------------------------------------------------------------------------ heuristics (CPU)

@pytest.mark.parametrize("m", [1, 3, 8, 16, 17, 32, 64, 100, 512])
@pytest.mark.parametrize("n,k", [(8192, 8192), (28672, 8192), (8192, 28672), (4096, 4096), (192, 96), (512, 4096)])
@pytest.mark.parametrize("fmt", [Q.FMT_AWQ, Q.FMT_GPTQ, Q.FMT_INT8])
def test_mma_config_is_consistent(m, n, k, fmt):
    cfg = Q.mma_config(m, n, k, fmt, 132)
    k_tiles = -(-k // (32 if fmt == Q.FMT_INT8 else 64))
    assert 8 * cfg.mt * cfg.m_chunks >= m and 8 * cfg.mt * (cfg.m_chunks - 1) < m
    assert cfg.n_tiles * Q.BLOCK_N >= n
    assert cfg.splits * cfg.tiles_per_split >= k_tiles
    assert (cfg.splits - 1) * cfg.tiles_per_split < k_tiles  # no empty split
    assert cfg.smem <= 227 * 1024
    if cfg.mt <= 2:
        assert 2 * (cfg.smem + 1024) <= 228 * 1024  # two CTAs per SM fit
    assert cfg.grid < 2 ** 31


def test_mma_config_fills_the_gpu_at_m1():
    for n, k in [(8192, 8192), (28672, 8192), (8192, 28672)]:
        cfg = Q.mma_config(1, n, k, Q.FMT_AWQ, 132)
        assert cfg.grid >= 132, (n, k, cfg)


def test_all_kernels_listed():
    names = [k.name for k in Q.all_kernels()]
    assert len(names) == len(set(names)) == 188
    assert "quant_sm90::w4_wgmma_kernel<__nv_bfloat16, 64, 2, 8>" in names
    assert "quant_sm90::w4_wgmma_kernel<__half, 256, 1, 6>" in names  # blk = 1 shapes: measurements only
    assert "quant_sm90::w4_wgmma_kernel<__half, 256, 1, 4>" in names  # split over two ranks: room for the receive buffer
    assert "quant_sm90::w4_wgmma_kernel<__half, 128, 2, 8, 4>" in names  # wgmma groups of 4 k16 steps
    assert "quant_sm90::w4_wgmma_kernel<__half, 128, 1, 8, 4>" not in names  # at blk = 1 with 128-k stages only
    assert "quant_sm90::w4_wgmma_kernel<__half, 128, 2, 8>" in names
    assert "quant::quant_marlin_kernel<__half, 4>" in names and "quant::quant_marlin_kernel<__nv_bfloat16, 8>" in names
    assert "quant::gemv_stream_kernel<__half, 1, 2>" in names and "quant::gemv_bulk_kernel<__half, 0, 1>" in names
    for nbc in Q.STREAM_NBC_CHOICES[1:]:  # x-sharing block groups, M > 8 only
        assert f"quant::gemv_stream_kernel<__nv_bfloat16, 0, 2, {nbc}>" in names
        assert f"quant::gemv_stream_kernel<__nv_bfloat16, 0, 1, {nbc}>" not in names
    for mt, nbcs in ((1, (1,)), (2, Q.STREAM_NBC_CHOICES)):  # on the wgmma-major copy (compact layers), INT4 only
        for nbc in nbcs:
            assert f"quant::gemv_stream_kernel<__half, 0, {mt}, {nbc}, 1>" in names
            assert f"quant::gemv_stream_kernel<__half, 1, {mt}, {nbc}, 1>" not in names
    assert "quant::gemv_kernel<__nv_bfloat16, 0, 1>" in names
    assert "quant::quant_mma_kernel<__nv_bfloat16, 1, 8>" in names


def test_dispatch():
    assert not Q.use_dense(1, "torch", "bfloat16")
    assert not Q.use_dense(Q.MAX_MMA_M, "torch", "float16")
    assert Q.use_dense(Q.MAX_MMA_M + 1, "torch", "bfloat16")
    assert not Q.use_dense(4096, "cupy", "bfloat16")


# ------------------------------------------------------------------------------------------------ gemv layout (CPU)

def test_gemv_int4_layout_roundtrip_and_hand_made():
    rng = np.random.default_rng(21)
    for k, n in [(32, 64), (96, 128), (320, 192)]:
        q = rng.integers(0, 16, (k, n)).astype(np.uint8)
        words = Q.gemv_pack_int4_reference(q)
        assert words.dtype == np.uint32 and words.size == k * n // 8
        assert np.array_equal(Q.gemv_unpack_int4_reference(words, k, n), q)
    # lane 4 g + c = 5 (g 1, c 1), tile t = 2, half 0: channels 33 (nibbles 0 2 4 6) and 41 (1 3 5 7),
    # k = 4 .. 7 as (k 4, k 5) at nibbles (0, 4) / (1, 5) and (k 6, k 7) at (2, 6) / (3, 7)
    q = np.zeros((32, 64), np.uint8)
    q[4, 33], q[5, 33], q[6, 33], q[7, 33] = 1, 2, 3, 4
    q[4, 41], q[5, 41], q[6, 41], q[7, 41] = 5, 6, 7, 8
    words = Q.gemv_pack_int4_reference(q).reshape(1, 1, 2, 32, 4)
    assert words[0, 0, 0, 5, 2] == 0x84627351
    assert np.count_nonzero(words) == 1


def test_gemv_int8_and_group_layouts_hand_made():
    w = np.zeros((32, 32), np.int8)
    # lane 4 g + c = 9 (g 2, c 1), half 1, tile 1, word p = 1: channels 18 / 26, k = 16 + 4 + 2 = 22, 23
    w[18, 22], w[18, 23], w[26, 22], w[26, 23] = 1, -1, 127, -128
    words = Q.gemv_pack_int8_reference(w).reshape(1, 1, 2, 32, 4)
    assert words[0, 0, 1, 9, 3] == 0x807FFF01
    assert np.count_nonzero(words) == 1
    z = np.arange(2 * 128).reshape(2, 128) % 17          # zero points up to 16 (GPTQ's stored 15 + 1)
    s = np.arange(2 * 128, dtype=np.uint16).reshape(2, 128) + 1000
    rec = Q.gemv_pack_groups_reference(z, s).reshape(2, 2, 192)   # (block, group, bytes)
    b, grp, g = 1, 1, 3
    for o in range(8):
        n = 64 * b + 16 * (o // 2) + g + 8 * (o % 2)
        assert rec[b, grp, 16 * g + 2 * o: 16 * g + 2 * o + 2].view("<u2")[0] == s[grp, n]
        assert rec[b, grp, 128 + 8 * g + o] == z[grp, n]


@pytest.mark.parametrize("blocks,steps,grid", [(128, 256, 264), (448, 256, 264), (8, 32, 16), (3, 5, 7), (1, 1, 1),
                                               (16, 4, 4), (64, 96, 264)])
def test_gemv_schedule_covers_every_step_once(blocks, steps, grid):
    sched = Q.gemv_schedule(steps, blocks, grid)
    seen = np.zeros((blocks, steps), np.int32)
    ticket = np.zeros(blocks, np.int64)
    for segs in sched:
        for b, s0, s1, pieces in segs:
            assert 0 <= s0 < s1 <= steps
            assert pieces[0][0] == s0 and pieces[-1][1] == s1
            for (lo, hi), (lo2, _) in zip(pieces, pieces[1:] + [(s1, s1)]):
                assert lo <= hi == lo2
                seen[b, lo:hi] += 1
            if not (s0 == 0 and s1 == steps):
                ticket[b] += s1 - s0
    assert (seen == 1).all()
    # a block is either covered by one CTA (direct store) or its partial CTAs' tickets add up to KS
    assert all(t in (0, steps) for t in ticket)


def test_dequant_int4_grid():
    assert Q.dequant_int4_grid(4096, 4096) == (2, 1024)
    assert Q.dequant_int4_grid(384, 2056) == (2, 96) and Q.dequant_int4_grid(6, 8) == (1, 2)
    assert Q.dequant_int4_grid(1 << 20, 64) == (1, 65535)  # rows beyond 65535 x 4 are grid-strided


@pytest.mark.parametrize("m,n,k", [(1, 8192, 8192), (1, 28672, 8192), (16, 8192, 28672), (9, 4096, 4096),
                                   (1, 512, 1024), (3, 64, 32)])
def test_gemv_config(m, n, k):
    for kind in (Q.KIND_INT4, Q.KIND_INT8):
        cfg = Q.gemv_config(m, n, k, kind, 132)
        assert cfg.mt == (1 if m <= 8 else 2)
        assert cfg.blocks * Q.gemv_block_n(kind) == n and cfg.steps * 32 == k
        assert 1 <= cfg.grid <= 264
        assert cfg.smem <= 227 * 1024 and 2 * (cfg.smem + 16 + 1024) <= 228 * 1024  # two CTAs per SM
        if n * k >= 8192 * 8192:
            assert cfg.grid == 264
    assert Q.gemv_supported(Q.KIND_INT4, 4096, 4096, 128) and not Q.gemv_supported(Q.KIND_INT4, 4096, 4096, 48)
    assert not Q.gemv_supported(Q.KIND_INT4, 4112, 4096, 16) and not Q.gemv_supported(Q.KIND_INT8, 4096, 4080)
    assert Q.gemv_supported(Q.KIND_INT8, 96, 32) and not Q.gemv_supported(Q.KIND_INT4, 96, 32, 32)


def test_use_gemv_dispatch():
    # the measured corners: small M on large weights, larger M on smaller weights; INT8 stays on the mma kernel
    assert Q.use_gemv(Q.KIND_INT4, 1, 28672, 8192) and Q.use_gemv(Q.KIND_INT4, 4, 8192, 28672)
    assert not Q.use_gemv(Q.KIND_INT4, 1, 8192, 8192) and not Q.use_gemv(Q.KIND_INT4, 16, 28672, 8192)
    assert Q.use_gemv(Q.KIND_INT4, 16, 8192, 8192) and Q.use_gemv(Q.KIND_INT4, 8, 4096, 4096)
    assert not Q.use_gemv(Q.KIND_INT4, 17, 4096, 4096) and not Q.use_gemv(Q.KIND_INT4, 0, 4096, 4096)
    assert not any(Q.use_gemv(Q.KIND_INT8, m, 28672, 8192) for m in range(1, 17))
    assert Q._want_gemv_layout(Q.KIND_INT4, 4096, 4096, 128) and not Q._want_gemv_layout(Q.KIND_INT4, 4096, 4096, 48)
    # INT8 gets the fragment-major copy only for gemv_stream_kernel (K % 128 == 0)
    assert Q._want_gemv_layout(Q.KIND_INT8, 4096, 4096) and not Q._want_gemv_layout(Q.KIND_INT8, 4096, 4080)


def test_stream_supported():
    assert Q.stream_supported(Q.KIND_INT4, 8192, 8192, 128) and Q.stream_supported(Q.KIND_INT4, 4096, 512, 4096)
    assert not Q.stream_supported(Q.KIND_INT4, 8192, 8192, 64) and not Q.stream_supported(Q.KIND_INT4, 8192, 8192, 32)
    assert not Q.stream_supported(Q.KIND_INT4, 4160, 8192, 4160)    # K % 128 != 0
    assert Q.stream_supported(Q.KIND_INT8, 4096, 32) and not Q.stream_supported(Q.KIND_INT8, 4064, 64)


def _stream_chunks(cfg, order=None):
    """(block, chunk) -> how many warps of the launch cover it, mirroring gemv_stream_kernel's index math."""
    kc = cfg.steps // 4
    seen = np.zeros((cfg.blocks, kc), np.int32)
    nbc = getattr(cfg, "nbc", 1)  # gemv_bulk_kernel: one block per CTA
    groups, wk = cfg.blocks // nbc, cfg.warps // nbc
    wpb = wk * cfg.splits
    for cta in range(cfg.grid):
        cb, split = cta % groups, cta // groups
        chunks = {}
        for w in range(cfg.warps):
            b, gw = cb * nbc + w % nbc, split * wk + w // nbc
            got = Q.chunk_order(cfg.order if order is None else order, kc, wpb, gw, cb)
            assert chunks.setdefault(w // nbc, got) == got  # a group's warps of one gw read the same x chunks
            for c in got:
                seen[b, c] += 1
    return seen


@pytest.mark.parametrize("kc,wpb", [(64, 16), (64, 12), (7, 3), (5, 8), (1, 1), (224, 12), (32, 5)])
def test_chunk_orders_cover_every_chunk_once(kc, wpb):
    for order in (0, 1, 2):
        for b in (0, 5, 127):
            got = sorted(c for gw in range(wpb) for c in Q.chunk_order(order, kc, wpb, gw, b))
            assert got == list(range(kc)), (order, b)
    # order 2 starts the warps of a block at different offsets of their runs
    starts = {Q.chunk_order(2, 64, 16, gw, 3)[0] - 4 * gw for gw in range(16)}
    assert len(starts) > 1


@pytest.mark.parametrize("m,n,k", [(1, 8192, 8192), (1, 28672, 8192), (16, 8192, 28672), (9, 4096, 4096),
                                   (1, 512, 1024), (16, 64, 128), (4, 4096, 4096), (1, 4096, 14336), (16, 28672, 8192)])
def test_bulk_config(m, n, k):
    for kind in (Q.KIND_INT4, Q.KIND_INT8):
        cfg = Q.bulk_config(m, n, k, kind, 132)
        assert cfg.mt == (1 if m <= 8 else 2) and cfg.stages == 2 and cfg.order == 1
        assert cfg.blocks * Q.gemv_block_n(kind) == n and cfg.steps * 32 == k
        assert 1 <= cfg.warps <= Q.BULK_MAX_WARPS and cfg.splits >= 1
        assert cfg.warps * cfg.splits <= cfg.steps // 4
        assert cfg.smem == Q.bulk_smem_bytes(kind, m, cfg.warps, cfg.stages) <= Q.BULK_SMEM_PER_CTA
        # one wave: the CTAs each SM must hold fit its shared memory together
        per_sm = -(-cfg.grid // 132)
        assert per_sm * (cfg.smem + 1024) <= Q.BULK_SMEM_PER_SM or cfg.grid <= 132, (kind, cfg)
        assert (_stream_chunks(cfg) == 1).all()
    c = Q.bulk_config(1, 8192, 8192, Q.KIND_INT4, 132)
    assert (c.warps, c.splits, c.grid) == (16, 1, 128)
    c = Q.bulk_config(1, 28672, 8192, Q.KIND_INT4, 132)
    assert (c.warps, c.splits, c.grid) == (4, 1, 448)
    c = Q.bulk_config(1, 8192, 8192, Q.KIND_INT4, 132, stages=4)
    assert (c.warps, c.splits, c.grid) == (12, 1, 128)
    c = Q.bulk_config(1, 512, 4096, Q.KIND_INT8, 132, warps=3, splits=3, stages=2)
    assert (c.warps, c.splits, c.stages, c.grid) == (3, 3, 2, 48) and (_stream_chunks(c) == 1).all()
    # dispatch: INT4, M = 1, N K >= 2^26, N <= K, sm_90+
    assert Q.use_bulk(Q.KIND_INT4, 1, 8192, 8192, 128, (9, 0)) and Q.use_bulk(Q.KIND_INT4, 1, 8192, 28672, 128)
    assert not Q.use_bulk(Q.KIND_INT4, 1, 28672, 8192, 128)
    assert not Q.use_bulk(Q.KIND_INT4, 2, 8192, 8192, 128) and not Q.use_bulk(Q.KIND_INT4, 1, 4096, 4096, 128)
    assert not Q.use_bulk(Q.KIND_INT8, 1, 8192, 8192) and not Q.use_bulk(Q.KIND_INT4, 1, 8192, 8192, 128, (8, 9))
    with _stream("on", "on"):
        assert Q.use_bulk(Q.KIND_INT4, 1, 8192, 8192, 128, (9, 0))
        assert not Q.use_bulk(Q.KIND_INT4, 1, 8192, 8192, 128, (8, 0))
        assert not Q.use_bulk(Q.KIND_INT4, 17, 8192, 8192, 128) and not Q.use_bulk(Q.KIND_INT4, 1, 8192, 8192, 64)


@pytest.mark.parametrize("m,n,k", [(1, 8192, 8192), (1, 28672, 8192), (16, 8192, 28672), (9, 4096, 4096),
                                   (1, 512, 1024), (16, 64, 128), (4, 4096, 4096), (1, 4096, 14336)])
def test_stream_config(m, n, k):
    for kind in (Q.KIND_INT4, Q.KIND_INT8):
        cfg = Q.stream_config(m, n, k, kind, 132)
        wmax = Q.stream_max_warps(kind, cfg.mt)
        assert cfg.mt == (1 if m <= 8 else 2)
        assert cfg.blocks * Q.gemv_block_n(kind) == n and cfg.steps * 32 == k
        assert 1 <= cfg.warps <= wmax and cfg.splits >= 1
        assert cfg.warps // cfg.nbc * cfg.splits <= cfg.steps // 4    # every warp has at least one chunk
        assert cfg.grid * cfg.warps <= wmax * 132 or cfg.splits == 1  # one wave (splits only where it fits)
        assert cfg.smem == cfg.warps * m * (Q.gemv_block_n(kind) + 4) * 4 and cfg.smem <= 227 * 1024
        for order in (0, 1, 2):
            assert (_stream_chunks(cfg, order) == 1).all()
    # the acceptance shapes: one CTA per 64-channel block, no split-K, a full wave
    c = Q.stream_config(1, 8192, 8192, Q.KIND_INT4, 132)
    assert (c.warps, c.splits, c.grid, c.prefetch, c.order) == (16, 1, 128, 0, 0)
    assert Q.stream_config(16, 8192, 8192, Q.KIND_INT4, 132).order == 2
    assert Q.stream_config(16, 8192, 8192, Q.KIND_INT8, 132).order == 0
    c = Q.stream_config(1, 28672, 8192, Q.KIND_INT4, 132)
    assert (c.warps, c.splits, c.grid) == (4, 1, 448)
    c = Q.stream_config(1, 4096, 4096, Q.KIND_INT4, 132)
    assert (c.warps, c.splits, c.grid) == (16, 2, 128)
    # INT4 at M > 8: a split only where it saves more than STREAM_SPLIT_COST_CHUNKS chunks per warp
    assert [Q.stream_config(m, 4096, 4096, Q.KIND_INT4, 132).splits for m in (9, 16)] == [1, 1]  # 3 chunks vs 2
    assert Q.stream_config(16, 4096, 14336, Q.KIND_INT4, 132).splits == 2  # 10 chunks vs 5
    assert Q.stream_config(16, 1024, 8192, Q.KIND_INT4, 132).splits == 5  # 6 chunks vs 2
    assert Q.stream_config(16, 2048, 4096, Q.KIND_INT4, 132).splits == 1
    assert Q.stream_config(16, 2048, 4096, Q.KIND_INT8, 132).splits == 2  # INT8 keeps the one-wave split
    # INT8 on wide layers: at least 8 (M <= 8) / 4 (M <= 16) warps per block, past one wave
    assert [Q.stream_config(m, 28672, 8192, Q.KIND_INT8, 132).warps for m in (1, 16)] == [8, 4]
    assert [Q.stream_config(m, 8192, 8192, Q.KIND_INT8, 132).warps for m in (1, 16)] == [8, 8]
    # whole CTAs per SM: 9 (INT4, M = 1) / 7 (M = 16) warps per block for 224 blocks round down to 8 / 6
    assert [Q.stream_config(m, 14336, 8192, Q.KIND_INT4, 132).warps for m in (1, 16)] == [8, 6]
    assert Q.bulk_config(1, 14336, 8192, Q.KIND_INT4, 132).warps == 8
    # the packing rule: the largest divisor of a 16- / 12-warp SM (the kernels' limits) ...
    for per_sm in (12, 16):
        divisors = [max(d for d in range(1, b + 1) if per_sm % d == 0) for b in range(1, per_sm)]
        assert [Q._packing_warps(b, per_sm) for b in range(1, per_sm)] == divisors
    # ... and no collapse to 1-warp CTAs where the SM's count is prime (bulk rings at M = 16: 13 warps)
    assert Q._packing_warps(9, 13) == 6 and Q._packing_warps(20, 16) == 20
    # overrides (for measurements) are honoured within the kernel's limits
    c = Q.stream_config(1, 512, 4096, Q.KIND_INT4, 132, warps=3, splits=3, prefetch=2)
    assert (c.warps, c.splits, c.prefetch, c.grid) == (3, 3, 2, 24) and (_stream_chunks(c) == 1).all()
    # blocks per CTA sharing x (nbc): the CTA's warps split over its blocks, the splits keep each block's warp count
    # (by default where the CTAs have room without a K split: INT4 M > 8, 448 blocks of 3 warps -> 4 blocks a CTA)
    c = Q.stream_config(16, 28672, 8192, Q.KIND_INT4, 132)
    assert (c.warps, c.nbc, c.splits, c.grid) == (12, 4, 1, 112) and (_stream_chunks(c) == 1).all()
    assert Q.stream_config(16, 28672, 8192, Q.KIND_INT4, 132, nbc=1).grid == 448
    assert Q.stream_config(8, 28672, 8192, Q.KIND_INT4, 132).nbc == Q.stream_config(16, 28672, 8192, 1, 132).nbc == 1
    assert Q.stream_config(16, 8192, 8192, Q.KIND_INT4, 132).nbc == 1  # sharing would need split-K there
    c = Q.stream_config(16, 8192, 8192, Q.KIND_INT4, 132, nbc=2)
    assert (c.warps, c.nbc, c.splits, c.grid) == (12, 2, 2, 128) and (_stream_chunks(c) == 1).all()
    for order in (0, 1, 2):
        c = Q.stream_config(9, 512, 2048, Q.KIND_INT4, 132, warps=6, nbc=2, splits=3, order=order)
        assert c.grid == 12 and (_stream_chunks(c) == 1).all()
    for bad in ({"nbc": 3}, {"warps": 6, "nbc": 4}):  # 128 blocks / 6 warps not divisible
        with pytest.raises(ValueError):
            Q.stream_config(16, 8192, 8192, Q.KIND_INT4, 132, **bad)
    with pytest.raises(ValueError):  # M <= 8: one block per CTA (no such variant is built)
        Q.stream_config(8, 8192, 8192, Q.KIND_INT4, 132, warps=16, nbc=2)


# ------------------------------------------------------------------------------------------------ GPU

def _torch():
    return pytest.importorskip("torch")


def _rel_err(y, ref):
    y = y.float().cpu().numpy().astype(np.float64)
    return np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30), np.isfinite(y).all()


def _other_copy(torch, m, n, k, g):
    """Whether a prepacked INT4 layer at this M takes a kernel on another copy than the tile-major one
    (quant_marlin_kernel or w4_wgmma_kernel), so its bits may differ from the as-stored call's."""
    return Q.use_marlin(m, n, k, g) or Q.use_w4wgmma(m, n, k, g, torch.cuda.get_device_capability())


def _ref(x, w_kn, bias=None):
    r = x.float().cpu().numpy().astype(np.float64) @ w_kn.astype(np.float64)
    if bias is not None:
        r = r + bias.float().cpu().numpy()
    return r


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k,g", [(1, 512, 1024, 128), (3, 192, 384, 64), (16, 1024, 512, 32), (33, 576, 256, -1),
                                     (64, 512, 2048, 128), (100, 256, 640, 128), (7, 512, 4096, 128)])
def test_awq_linear_small(dtype, m, n, k, g):
    torch = _torch()
    td = getattr(torch, dtype)
    rng = np.random.default_rng(m * 7 + n)
    w = rng.standard_normal((n, k)).astype(np.float32)
    qw, qz, s = Q.quantize_awq(w, g)
    s = (s.astype(np.float32) * 0.05).astype(np.float16)
    s_t = torch.from_numpy(s).cuda().to(td)
    ref_w = Q.dequantize_awq_reference(qw, qz, s_t.float().cpu().numpy(), g)
    x = torch.randn(m, k, device="cuda", dtype=td)
    bias = torch.randn(n, device="cuda", dtype=td) if m % 2 else None
    y = Q.awq_linear(x, torch.from_numpy(qw).cuda(), torch.from_numpy(qz).cuda(), s_t, group_size=g, bias=bias)
    assert y.shape == (m, n) and y.dtype == td
    err, finite = _rel_err(y, _ref(x, ref_w, bias))
    assert finite and err < 1e-2, err
    # repeated call (split-K tickets must have been reset) gives the same bits
    y2 = Q.awq_linear(x, torch.from_numpy(qw).cuda(), torch.from_numpy(qz).cuda(), s_t, group_size=g, bias=bias)
    assert torch.equal(y, y2)
    packed = Q.prepack_awq(torch.from_numpy(qw).cuda(), torch.from_numpy(qz).cuda(), s_t, group_size=g)
    assert packed.packed is not None
    if packed.gemv is not None and (m <= Q.GEMV_MAX_M or _other_copy(torch, m, n, k, k if g == -1 else g)):
        # M <= 16 takes gemv_kernel on the fragment-major copy, larger M quant_marlin_kernel or w4_wgmma_kernel
        # where they apply (split-K order differs: compare values)
        err, finite = _rel_err(Q.awq_linear(x, packed, bias=bias), _ref(x, ref_w, bias))
        assert finite and err < 1e-2, err
    else:
        # the tile-major prepacked copy feeds the same shared-memory image: the same bits
        assert torch.equal(Q.awq_linear(x, packed, bias=bias), y)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("m,n,k,g", [(1, 512, 1024, 128), (5, 192, 320, 128), (16, 512, 512, 32), (64, 256, 1024, 64),
                                     (2, 1024, 4096, 128)])
def test_gptq_linear_small(dtype, act_order, m, n, k, g):
    torch = _torch()
    td = getattr(torch, dtype)
    rng = np.random.default_rng(m * 11 + k)
    w = rng.standard_normal((n, k)).astype(np.float32)
    perm = rng.permutation(k) if act_order else None
    qw, qz, s, g_idx = Q.quantize_gptq(w, g, perm=perm, sym=not act_order)
    s_t = torch.from_numpy((s.astype(np.float32) * 0.05).astype(np.float16)).cuda().to(td)
    ref_w = Q.dequantize_gptq_reference(qw, qz, s_t.float().cpu().numpy(), g_idx, g)
    x = torch.randn(m, k, device="cuda", dtype=td)
    ref = _ref(x, ref_w)
    args = (torch.from_numpy(qw).cuda(), torch.from_numpy(qz).cuda(), s_t, torch.from_numpy(g_idx).cuda())
    y = Q.gptq_linear(x, *args, group_size=g)
    err, finite = _rel_err(y, ref)
    assert finite and err < 1e-2, err
    packed = Q.prepack_gptq(*args, group_size=g)
    assert (packed.perm is not None) == act_order
    y2 = Q.gptq_linear(x, packed)
    err2, finite2 = _rel_err(y2, ref)
    assert finite2 and err2 < 1e-2, err2
    assert packed.packed is not None
    if not act_order:
        y3 = Q.gptq_linear(x, *args[:3], group_size=g)
        assert torch.equal(y, y3)
        if (packed.gemv is None or m > Q.GEMV_MAX_M) and not _other_copy(torch, m, n, k, k if g == -1 else g):
            assert torch.equal(y, y2)


@contextlib.contextmanager
def _stream(mode="on", bulk="off", **override):
    """Force gemv_stream_kernel ("on", with bulk "off") or gemv_bulk_kernel (bulk "on") for M <= 16, or neither
    (mode "off"), and override the chosen kernel's launch shape (stream: warps, splits, prefetch; bulk: warps,
    splits, and stages = prefetch + 2)."""
    old = (Q._STREAM_MODE, Q._BULK_MODE, dict(Q._STREAM_OVERRIDE), dict(Q._BULK_OVERRIDE))
    Q._STREAM_MODE, Q._BULK_MODE = mode, bulk
    Q._STREAM_OVERRIDE.clear()
    Q._BULK_OVERRIDE.clear()
    if bulk == "on":
        Q._BULK_OVERRIDE.update({k: v for k, v in override.items() if k in ("warps", "splits", "order")})
        if "prefetch" in override:
            Q._BULK_OVERRIDE["stages"] = override["prefetch"] + 2
    else:
        Q._STREAM_OVERRIDE.update(override)
    try:
        yield
    finally:
        Q._STREAM_MODE, Q._BULK_MODE = old[0], old[1]
        Q._STREAM_OVERRIDE.clear()
        Q._STREAM_OVERRIDE.update(old[2])
        Q._BULK_OVERRIDE.clear()
        Q._BULK_OVERRIDE.update(old[3])


@contextlib.contextmanager
def _gemv_mode(mode):
    """Force the small-M dispatch ("on": gemv_kernel wherever prepack built its layout, "off": never)."""
    old = Q._GEMV_MODE
    Q._GEMV_MODE = mode
    try:
        yield
    finally:
        Q._GEMV_MODE = old


def _gemv_layer(torch, fmt, n, k, g, td, rng):
    """Random packed INT4 / INT8 tensors (every nibble / byte value), the prepacked layer, the float W (K, N)."""
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    if fmt == Q.FMT_INT8:
        q = rng.integers(-128, 128, (n, k)).astype(np.int8)
        s = (rng.random(n) * 0.02 + 0.001).astype(np.float16)
        s_t = t(s).to(td)
        return Q.prepack_int8(t(q), s_t), Q.dequantize_int8_reference(q, s_t.float().cpu().numpy()), (t(q), s_t)
    gg = k if g == -1 else g
    ng = -(-k // gg)
    q = rng.integers(0, 16, (k, n))
    s = (rng.random((ng, n)) * 0.02 + 0.001).astype(np.float16)
    s_t = t(s).to(td)
    s_f = s_t.float().cpu().numpy()
    if fmt == Q.FMT_AWQ:
        z = rng.integers(0, 16, (ng, n))
        args = (t(Q.pack_awq(q)), t(Q.pack_awq(z)), s_t)
        return (Q.prepack_awq(*args, group_size=g), Q.dequantize_awq_reference(Q.pack_awq(q), Q.pack_awq(z), s_f, gg),
                args)
    z = rng.integers(0, 16, (ng, n))  # stored zero - 1: 15 means a zero point of 16
    args = (t(Q.pack_rows(q)), t(Q.pack_cols(z)), s_t)
    return (Q.prepack_gptq(*args, group_size=g),
            Q.dequantize_gptq_reference(Q.pack_rows(q), Q.pack_cols(z), s_f, None, gg), args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fmt", [Q.FMT_AWQ, Q.FMT_GPTQ, Q.FMT_INT8])
@pytest.mark.parametrize("m,n,k,g", [(1, 512, 4096, 128), (5, 4096, 4096, 128), (8, 14336, 512, 64),
                                     (9, 192, 320, 128), (16, 1024, 1024, 32), (3, 64, 32, -1), (16, 1024, 8192, 128)])
def test_gemv_small(dtype, fmt, m, n, k, g):
    """gemv_kernel (M <= 16, prepacked): values against float64, stream-K splits with partial and whole blocks,
    repeated calls (zeroed workspace and tickets restored), and the same layer through quant_mma_kernel."""
    torch = _torch()
    td = getattr(torch, dtype)
    if fmt == Q.FMT_INT8 and n % 32:
        pytest.skip("INT8 blocks are 32 channels")
    if fmt == Q.FMT_AWQ and g > 0 and k % g:
        g = 64  # AWQ has whole groups only (GPTQ keeps the short last group)
    rng = np.random.default_rng(m * 31 + n + k + fmt)
    with _gemv_mode("on"), _stream("off"):
        layer, w_kn, _ = _gemv_layer(torch, fmt, n, k, g, td, rng)
        assert layer.gemv is not None
        x = torch.randn(m, k, device="cuda", dtype=td)
        bias = torch.randn(n, device="cuda", dtype=td) if m % 2 else None
        ref = _ref(x, w_kn, bias)
        y = torch.full((m, n), float("nan"), device="cuda", dtype=td)
        for _ in range(3):
            y = _linear(fmt, x, layer, bias)
            err, finite = _rel_err(y, ref)
            assert finite and err < 1e-2, err
    with _gemv_mode("off"):
        y_mma = _linear(fmt, x, layer, bias)
    assert (y.float() - y_mma.float()).abs().max().item() <= 2e-2 * y_mma.float().abs().max().item() + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [Q.FMT_AWQ, Q.FMT_GPTQ, Q.FMT_INT8])
def test_gemv_pack_kernels_match_references_small(fmt):
    with _gemv_mode("on"):
        _check_gemv_pack_kernels(fmt)


def _check_gemv_pack_kernels(fmt):
    torch = _torch()
    rng = np.random.default_rng(40 + fmt)
    k, n, g = 320, 192, 64
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    if fmt == Q.FMT_INT8:
        q = rng.integers(-128, 128, (n, k)).astype(np.int8)
        layer = Q.prepack_int8(t(q), t(np.ones(n, np.float16)))
        got = layer.gemv.weight.cpu().numpy().view(np.uint32)
        assert np.array_equal(got, Q.gemv_pack_int8_reference(q))
        return
    q = rng.integers(0, 16, (k, n))
    z = rng.integers(0, 16, (k // g, n))
    s = (rng.random((k // g, n)) + 0.5).astype(np.float16)
    if fmt == Q.FMT_AWQ:
        layer = Q.prepack_awq(t(Q.pack_awq(q)), t(Q.pack_awq(z)), t(s), group_size=g)
        zeros = z
    else:
        layer = Q.prepack_gptq(t(Q.pack_rows(q)), t(Q.pack_cols(z)), t(s), group_size=g)
        zeros = z + 1
    assert np.array_equal(layer.gemv.weight.cpu().numpy().view(np.uint32), Q.gemv_pack_int4_reference(q))
    assert np.array_equal(layer.gemv.groups.cpu().numpy(), Q.gemv_pack_groups_reference(zeros, s.view(np.uint16)))


@pytest.mark.gpu
def test_gemv_exact_rows_small():
    """x = one-hot rows (M = 16 and 5) pick rows of W exactly through gemv_kernel: every nibble / byte, zero
    point (GPTQ's 16 included) and scale position, whole blocks and split ones."""
    with _gemv_mode("on"), _stream("off"):
        _check_gemv_exact_rows()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fmt", [Q.FMT_AWQ, Q.FMT_GPTQ, Q.FMT_INT8])
@pytest.mark.parametrize("m,n,k,g,override", [
    (1, 512, 4096, 128, {}), (5, 4096, 4096, 128, {}), (8, 1024, 1024, -1, {}), (9, 192, 384, 128, {}),
    (16, 1024, 8192, 128, {"order": 1}), (16, 4096, 1024, 256, {"order": 2}), (1, 8192, 1024, 128, {"order": 2}),
    (3, 512, 4096, 128, {"warps": 3, "splits": 3, "prefetch": 2, "order": 2}), (4, 512, 4096, 128, {"order": 1}),
    (12, 320, 2048, 128, {"warps": 5, "splits": 2, "order": 1}),
    (1, 256, 1024, 128, {"warps": 1, "splits": 8, "prefetch": 0}), (2, 128, 512, 128, {"warps": 2, "prefetch": 3}),
    # blocks per CTA sharing x (stream only; the bulk kernel ignores nbc)
    (16, 1024, 8192, 128, {"warps": 8, "nbc": 4, "order": 2}), (9, 512, 2048, 128, {"warps": 6, "nbc": 2, "splits": 3}),
    (16, 4096, 1024, 256, {"warps": 12, "nbc": 4}), (10, 768, 1024, 128, {"warps": 4, "nbc": 2, "order": 1}),
    (13, 768, 1024, 128, {"warps": 6, "nbc": 2, "order": 0})])
@pytest.mark.parametrize("bulk", ["off", "on"])
def test_stream_small(dtype, fmt, m, n, k, g, override, bulk):
    """gemv_stream_kernel and gemv_bulk_kernel (M <= 16, prepacked, K and G multiples of 128): values against
    float64 through the default launch shape and forced ones (split-K with tickets, odd warp counts, prefetch
    distances / ring depths), repeated calls (workspace and tickets left zeroed), and the same layer through
    quant_mma_kernel."""
    torch = _torch()
    if bulk == "on" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("gemv_bulk_kernel needs sm_90")
    td = getattr(torch, dtype)
    if fmt == Q.FMT_INT8 and n % 64:
        pytest.skip("the INT8 fast path needs N % 64 == 0")
    rng = np.random.default_rng(m * 37 + n + k + fmt)
    with _stream("on", bulk, **override):
        layer, w_kn, _ = _gemv_layer(torch, fmt, n, k, g, td, rng)
        assert layer.gemv is not None
        kind = Q.KIND_INT8 if fmt == Q.FMT_INT8 else Q.KIND_INT4
        assert Q.stream_supported(kind, k, n, layer.gemv.spg * 32)
        x = torch.randn(m, k, device="cuda", dtype=td)
        bias = torch.randn(n, device="cuda", dtype=td) if m % 2 else None
        ref = _ref(x, w_kn, bias)
        for _ in range(3):
            y = _linear(fmt, x, layer, bias)
            err, finite = _rel_err(y, ref)
            assert finite and err < 1e-2, err
        # a strided view of x (rows 16-byte aligned) and 3-D leading shape
        xb = torch.randn(m, k + 64, device="cuda", dtype=td)[:, 32:32 + k]
        y3 = _linear(fmt, xb.reshape(1, m, k), layer, bias)
        assert y3.shape == (1, m, n)
        err, finite = _rel_err(y3.reshape(m, n), _ref(xb, w_kn, bias))
        assert finite and err < 1e-2, err
    with _gemv_mode("off"), _stream("off"):
        y_mma = _linear(fmt, x, layer, bias)
    assert (y.float() - y_mma.float()).abs().max().item() <= 2e-2 * y_mma.float().abs().max().item() + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("override", [{}, {"warps": 3, "splits": 2}, {"warps": 3, "splits": 2, "order": 1},
                                      {"warps": 5, "order": 2}])
@pytest.mark.parametrize("bulk", ["off", "on"])
def test_stream_exact_rows_small(override, bulk):
    """x = one-hot rows (M = 16, 5 and 1) pick rows of W exactly through gemv_stream_kernel / gemv_bulk_kernel:
    every nibble / byte,
    zero point (GPTQ's 16 included) and scale position, with and without split-K."""
    torch = _torch()
    if bulk == "on" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("gemv_bulk_kernel needs sm_90")
    rng = np.random.default_rng(13)
    with _stream("on", bulk, **override):
        for fmt in (Q.FMT_AWQ, Q.FMT_GPTQ, Q.FMT_INT8):
            for td in (torch.float16, torch.bfloat16):
                k, n, g = 1024, 512, 128
                layer, w_kn, _ = _gemv_layer(torch, fmt, n, k, g, td, rng)
                if fmt != Q.FMT_INT8:
                    layer, w_kn = _pow2_scaled(torch, fmt, layer, k, n, g, td, rng)
                assert_picks_rows(torch, fmt, layer, w_kn, td, (slice(0, 16), slice(101, 106), slice(1000, 1001)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fmt", [Q.FMT_AWQ, Q.FMT_GPTQ, Q.FMT_INT8])
@pytest.mark.parametrize("m,n,k,g,override", [
    (9, 256, 128, 128, {}), (11, 128, 384, 128, {"warps": 5}), (13, 192, 1024, 256, {"warps": 3, "splits": 2}),
    (15, 512, 2048, -1, {"order": 1}), (16, 64, 512, 128, {"warps": 6, "order": 2}), (2, 128, 640, 128, {}),
    (7, 320, 256, 128, {"warps": 4, "splits": 3})])
@pytest.mark.parametrize("bulk", ["off", "on"])
def test_stream_rows_offset_x_poisoned_small(dtype, fmt, m, n, k, g, override, bulk):
    """The per-chunk zero point and scale (INT4 at M <= 8: magic + zero point off through sum_k x, the scale on the
    chunk's fp32 sums), the per-weight path (M > 8) and the register pipeline of gemv_stream_kernel: odd M 2..16, one-chunk K (warps
    with no chunk), groups of one, two and all chunks, split-K, warps with uneven runs; x with a large common
    offset (the subtraction of (magic + z) sum x must not cancel away the result); every row within 1e-2 of
    float64; the output memory poisoned with NaN before each call (the caching allocator hands the block back)."""
    torch = _torch()
    if bulk == "on" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("gemv_bulk_kernel needs sm_90")
    td = getattr(torch, dtype)
    rng = np.random.default_rng(m * 41 + n + k + fmt)
    with _stream("on", bulk, **override):
        layer, w_kn, _ = _gemv_layer(torch, fmt, n, k, g, td, rng)
        assert layer.gemv is not None
        for offset in (0.0, 4.0):
            x = torch.randn(m, k, device="cuda", dtype=td) + offset
            ref = _ref(x, w_kn)
            for _ in range(2):
                poison = torch.full((m, n), float("nan"), device="cuda", dtype=td)
                del poison
                y = _linear(fmt, x, layer)
                yf = y.float().cpu().numpy().astype(np.float64)
                assert np.isfinite(yf).all()
                row_err = np.linalg.norm(yf - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)
                assert row_err.max() < 1e-2, (offset, row_err.max())


@pytest.mark.gpu
@pytest.mark.parametrize("bulk", ["off", "on"])
def test_stream_previous_schedules_small(bulk):
    """The -D variants kept for same-run A/B measurements (per-chunk zero point / scale and the register pipeline
    at M > 8, no pipeline at any M) still compute the same values (benchmarks/_quant_stream_probe.py times them)."""
    torch = _torch()
    if bulk == "on" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("gemv_bulk_kernel needs sm_90")
    rng = np.random.default_rng(77)
    old = Q._STREAM_DEFINES
    try:
        with _stream("on", bulk):
            for fmt in (Q.FMT_AWQ, Q.FMT_INT8):
                for td in (torch.bfloat16, torch.float16):
                    layer, w_kn, _ = _gemv_layer(torch, fmt, 256, 1024, 128, td, rng)
                    for m in (1, 12):
                        x = torch.randn(m, 1024, device="cuda", dtype=td)
                        outs = []
                        for defines in (("-DSC_QUANT_XSUM_MT2", "-DSC_QUANT_PIPELINE_MT2"),
                                        ("-DSC_QUANT_STREAM_UNPIPELINED",), ()):
                            Q._STREAM_DEFINES = defines
                            outs.append(_linear(fmt, x, layer))
                        for out in outs:
                            err, finite = _rel_err(out, _ref(x, w_kn))
                            assert finite and err < 1e-2, (fmt, td, m, err)
    finally:
        Q._STREAM_DEFINES = old


def _check_gemv_exact_rows():
    torch = _torch()
    Q._STREAM_MODE = "off"  # G = 32: gemv_kernel (restored by the callers' contexts)
    rng = np.random.default_rng(12)
    for fmt in (Q.FMT_AWQ, Q.FMT_GPTQ, Q.FMT_INT8):
        for td in (torch.float16, torch.bfloat16):
            k, n, g = 1024, 512, 32  # 8 blocks x 32 steps on 16 CTAs: every block split between two
            layer, w_kn, _ = _gemv_layer(torch, fmt, n, k, g, td, rng)
            if fmt != Q.FMT_INT8:
                layer, w_kn = _pow2_scaled(torch, fmt, layer, k, n, g, td, rng)
            assert_picks_rows(torch, fmt, layer, w_kn, td, (slice(0, 16), slice(101, 106)))


@pytest.mark.gpu
def test_gptq_irregular_g_idx_small():
    torch = _torch()
    rng = np.random.default_rng(5)
    k, n, g = 256, 128, 64
    qw = Q.pack_rows(rng.integers(0, 16, (k, n)))
    qz = Q.pack_cols(rng.integers(0, 16, (k // g, n)))
    s = (rng.random((k // g, n)) * 0.05 + 0.01).astype(np.float16)
    g_idx = rng.integers(0, k // g, k).astype(np.int32)  # groups of unequal sizes
    x = torch.randn(3, k, device="cuda", dtype=torch.float16)
    t = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
    y = Q.gptq_linear(x, t(qw), t(qz), t(s), t(g_idx), group_size=g)
    err, finite = _rel_err(y, _ref(x, Q.dequantize_gptq_reference(qw, qz, s, g_idx, g)))
    assert finite and err < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k", [(1, 512, 1024), (5, 192, 96), (16, 1024, 2048), (64, 512, 512), (70, 256, 4096)])
def test_int8_linear_small(dtype, m, n, k):
    torch = _torch()
    td = getattr(torch, dtype)
    rng = np.random.default_rng(m + n + k)
    w = rng.standard_normal((n, k)).astype(np.float32)
    q, s = Q.quantize_int8(w)
    s_t = torch.from_numpy(s).cuda().to(td)
    ref_w = Q.dequantize_int8_reference(q, s_t.float().cpu().numpy())
    x = torch.randn(m, k, device="cuda", dtype=td)
    bias = torch.randn(n, device="cuda", dtype=td)
    y = Q.int8_linear(x, torch.from_numpy(q).cuda(), s_t, bias=bias)
    err, finite = _rel_err(y, _ref(x, ref_w, bias))
    assert finite and err < 1e-2, err
    packed = Q.prepack_int8(torch.from_numpy(q).cuda(), s_t)
    assert packed.packed is not None
    yp = Q.int8_linear(x, packed, bias=bias)
    if packed.gemv is not None:  # the streaming kernels (M <= 16) or w4_wgmma_kernel's INT8 variant: another order
        err, finite = _rel_err(yp, _ref(x, ref_w, bias))
        assert finite and err < 1e-2, err
    else:
        assert torch.equal(yp, y)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k", [(129, 256, 96), (300, 192, 1024), (257, 100, 64)])
def test_int8_linear_dense_small(dtype, m, n, k):
    """Above MAX_MMA_M: dequant_int8_kernel (W s rounded once) + matmul where the shape allows 16-byte rows, the
    plain conversion elsewhere (N = 100); every byte value with power-of-two scales picked out exactly by one-hot
    rows; bias; against float64 x @ W."""
    torch = _torch()
    td = getattr(torch, dtype)
    rng = np.random.default_rng(m * 3 + n + k)
    q = ((np.arange(n * k) * 37 + rng.integers(0, 256)) % 256 - 128).astype(np.int8).reshape(n, k)
    s = torch.from_numpy((2.0 ** rng.integers(-6, 2, n)).astype(np.float32)).cuda().to(td)
    x = torch.randn(m, k, device="cuda", dtype=td)
    bias = torch.randn(n, device="cuda", dtype=td)
    ref_w = Q.dequantize_int8_reference(q, s.float().cpu().numpy())
    with launched() as names:
        y = Q.int8_linear(x, torch.from_numpy(q).cuda(), s, bias=bias)
    assert ("quant::dequant_int8_kernel<" in " ".join(names)) == (n % 64 == 0)
    err, finite = _rel_err(y, _ref(x, ref_w, bias))
    assert finite and err < 1e-2, err
    eye = torch.zeros(m, k, device="cuda", dtype=td)
    eye[torch.arange(m), torch.arange(m) % k] = 1
    y1 = Q.int8_linear(eye, torch.from_numpy(q).cuda(), s)
    want = torch.from_numpy(ref_w[np.arange(m) % k].astype(np.float32))
    assert torch.equal(y1.float().cpu(), want)


@pytest.mark.gpu
def test_int8_extreme_bytes_small():
    # every byte value in every position: the magic-number conversions must be exact
    torch = _torch()
    n, k = 64, 256
    q = ((np.arange(n * k) * 37) % 256 - 128).astype(np.int8).reshape(n, k)
    for td in (torch.float16, torch.bfloat16):
        s = torch.ones(n, device="cuda", dtype=td)
        eye = torch.eye(k, device="cuda", dtype=td)[:64]
        y = Q.int8_linear(eye, torch.from_numpy(q).cuda(), s)  # rows of W^T picked out exactly
        assert torch.equal(y.float().cpu(), torch.from_numpy(q.T[:64].astype(np.float32)))


@pytest.mark.gpu
def test_int4_exact_rows_small():
    # x = one-hot rows pick rows of W exactly (every nibble, zero and scale position)
    torch = _torch()
    rng = np.random.default_rng(9)
    k, n, g = 128, 512, 32
    q = rng.integers(0, 16, (k, n))
    z = rng.integers(0, 16, (k // g, n))
    s = (2.0 ** rng.integers(-4, 2, (k // g, n))).astype(np.float16)
    for td in (torch.float16, torch.bfloat16):
        eye = torch.eye(k, device="cuda", dtype=td)[:64]
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
        y = Q.awq_linear(eye, t(Q.pack_awq(q)), t(Q.pack_awq(z)), t(s).to(td), group_size=g)
        ref = Q.dequantize_awq_reference(Q.pack_awq(q), Q.pack_awq(z), s, g)[:64]
        assert np.array_equal(y.float().cpu().numpy(), ref)
        zg = np.minimum(z, 14)
        y = Q.gptq_linear(eye, t(Q.pack_rows(q)), t(Q.pack_cols(zg)), t(s).to(td), group_size=g)
        ref = Q.dequantize_gptq_reference(Q.pack_rows(q), Q.pack_cols(zg), s, None, g)[:64]
        assert np.array_equal(y.float().cpu().numpy(), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("k,n,g", [(256, 192, 64), (384, 2056, 128)])  # one partial block; 257 words: two blocks
def test_gpu_dequantizers_bit_exact_small(dtype, k, n, g):
    torch = _torch()
    ml_dtypes = pytest.importorskip("ml_dtypes")
    td = getattr(torch, dtype)
    npd = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(3)
    w = rng.standard_normal((n, k)).astype(np.float32)
    qw, qz, s = Q.quantize_awq(w, g)
    s_t = torch.from_numpy(s).cuda().to(td)
    got = Q.dequantize_awq(torch.from_numpy(qw).cuda(), torch.from_numpy(qz).cuda(), s_t, group_size=g)
    ref = Q.dequantize_awq_reference(qw, qz, s_t.float().cpu().numpy(), g).astype(npd)
    assert np.array_equal(got.cpu().view(torch.int16).numpy(), ref.view(np.int16))
    qw, qz, s, g_idx = Q.quantize_gptq(w, g, perm=rng.permutation(k), sym=False)
    s_t = torch.from_numpy(s).cuda().to(td)
    got = Q.dequantize_gptq(torch.from_numpy(qw).cuda(), torch.from_numpy(qz).cuda(), s_t,
                            torch.from_numpy(g_idx).cuda(), group_size=g)
    ref = Q.dequantize_gptq_reference(qw, qz, s_t.float().cpu().numpy(), g_idx, g).astype(npd)
    assert np.array_equal(got.cpu().view(torch.int16).numpy(), ref.view(np.int16))


@pytest.mark.gpu
def test_views_batch_dims_and_dense_path_small():
    torch = _torch()
    rng = np.random.default_rng(4)
    n, k, g = 256, 512, 128
    w = rng.standard_normal((n, k)).astype(np.float32)
    qw, qz, s = Q.quantize_awq(w, g)
    s = (s.astype(np.float32) * 0.05).astype(np.float16)
    ref_w = Q.dequantize_awq_reference(qw, qz, s, g)
    args = (torch.from_numpy(qw).cuda(), torch.from_numpy(qz).cuda(), torch.from_numpy(s).cuda())
    big = torch.randn(2, 3, k + 24, device="cuda", dtype=torch.float16)
    x = big[..., :k]                      # row-strided view
    y = Q.awq_linear(x, *args, group_size=g)
    assert y.shape == (2, 3, n)
    err, ok = _rel_err(y.reshape(6, n), _ref(x.reshape(6, k), ref_w))
    assert ok and err < 1e-2
    flat = torch.randn(6 * k + 1, device="cuda", dtype=torch.float16)
    xm = flat[1:].view(2, 3, k)           # rows not 16-byte aligned: copied
    ym = Q.awq_linear(xm, *args, group_size=g)
    assert ym.shape == (2, 3, n)
    err, ok = _rel_err(ym.reshape(6, n), _ref(xm.reshape(6, k), ref_w))
    assert ok and err < 1e-2
    xl = torch.randn(Q.MAX_MMA_M + 3, k, device="cuda", dtype=torch.float16)  # dense path
    err, ok = _rel_err(Q.awq_linear(xl, *args, group_size=g), _ref(xl, ref_w))
    assert ok and err < 1e-2
    packed = Q.prepack_awq(*args, group_size=g, dtype="bfloat16")
    xb = x.to(torch.bfloat16)
    err, ok = _rel_err(Q.awq_linear(xb, packed).reshape(6, n), _ref(xb.reshape(6, k), ref_w))
    assert ok and err < 1e-2
    assert Q.awq_linear(x[:0], *args, group_size=g).shape == (0, 3, n)


@pytest.mark.gpu
def test_cupy_inputs_small():
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(6)
    n, k, g = 512, 256, 128
    w = rng.standard_normal((n, k)).astype(np.float32)
    qw, qz, s = Q.quantize_awq(w, g)
    s = (s.astype(np.float32) * 0.05).astype(np.float16)
    x = rng.standard_normal((3, k)).astype(np.float16)
    y = Q.awq_linear(cupy.asarray(x), cupy.asarray(qw), cupy.asarray(qz), cupy.asarray(s), group_size=g)
    assert isinstance(y, cupy.ndarray)
    ref = x.astype(np.float64) @ Q.dequantize_awq_reference(qw, qz, s, g)
    yh = cupy.asnumpy(y).astype(np.float64)
    assert np.linalg.norm(yh - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.gpu
def test_bad_input_small():
    torch = _torch()
    k, n, g = 256, 128, 128
    qw = torch.zeros(k, n // 8, dtype=torch.int32, device="cuda")
    qz = torch.zeros(k // g, n // 8, dtype=torch.int32, device="cuda")
    s = torch.ones(k // g, n, dtype=torch.float16, device="cuda")
    x = torch.randn(2, k, dtype=torch.float16, device="cuda")
    with pytest.raises(TypeError, match="x"):
        Q.awq_linear(x.float(), qw, qz, s)
    with pytest.raises(TypeError, match="qweight"):
        Q.awq_linear(x, qw.float(), qz, s)
    with pytest.raises(ValueError, match="qweight"):
        Q.awq_linear(x[:, :128], qw, qz, s)
    with pytest.raises(ValueError, match="group_size"):
        Q.awq_linear(x, qw, qz, s, group_size=96)
    with pytest.raises(ValueError, match="scales"):
        Q.awq_linear(x, qw, qz, s[:, :64])
    with pytest.raises(ValueError, match="qzeros"):
        Q.awq_linear(x, qw, qz[:, :4], s)
    with pytest.raises(TypeError, match="qzeros"):
        Q.awq_linear(x, qw, qz.to(torch.int64), s)
    with pytest.raises(ValueError, match="bias"):
        Q.awq_linear(x, qw, qz, s, bias=torch.zeros(n + 1, dtype=torch.float16, device="cuda"))
    with pytest.raises(TypeError, match="bias"):
        Q.awq_linear(x, qw, qz, s, bias=torch.zeros(n, dtype=torch.float32, device="cuda"))
    with pytest.raises(TypeError):
        Q.awq_linear(x, qw.cpu(), qz, s)
    gq = torch.zeros(k // 8, n, dtype=torch.int32, device="cuda")
    gz = torch.zeros(2, n // 8, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="qweight"):
        Q.gptq_linear(x, gq.t().contiguous(), gz, s)
    with pytest.raises(ValueError, match="g_idx"):
        Q.gptq_linear(x, gq, gz, s, torch.zeros(k - 1, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="g_idx"):
        Q.gptq_linear(x, gq, gz, s, torch.full((k,), 7, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="x"):
        Q.gptq_linear(torch.randn(2, 260, dtype=torch.float16, device="cuda"), gq, gz, s)
    w8 = torch.zeros(n, k, dtype=torch.int8, device="cuda")
    with pytest.raises(ValueError, match="weight"):
        Q.int8_linear(x, w8[:, :128], torch.ones(n, device="cuda"))
    with pytest.raises(ValueError, match="scales"):
        Q.int8_linear(x, w8, torch.ones(n + 1, device="cuda"))
    with pytest.raises(TypeError, match="weight"):
        Q.int8_linear(x, w8.to(torch.uint8), torch.ones(n, device="cuda"))


# ------------------------------------------------------------------------------------------------ launch arguments (CPU)

@pytest.fixture
def fake_gpu(monkeypatch):
    return install_fake_gpu(monkeypatch, w4_copy=False)[0]


def _same_launch(a, b):
    ka, ca, aa = a
    kb, cb, ab = b
    assert ka == kb and ca == cb
    assert len(aa) == len(ab) == (15 if "gemv_kernel" in ka.name or "quant_marlin" in ka.name
                                  else 19 if "gemv_stream" in ka.name else 18 if "gemv_bulk" in ka.name else 21)
    for u, v in zip(aa, ab):
        assert type(u) is type(v) and u == v, (aa, ab)


@pytest.mark.parametrize("m", [1, 16, 100])
def test_prepacked_fast_path_launches_like_the_checked_path(fake_gpu, m):
    import dataclasses

    calls = fake_gpu
    k, n, g = 1024, 1536, 128
    x = FakeTensor((m, k), "bfloat16")
    bias = FakeTensor((n,), "bfloat16")
    pw = Q.prepack_awq(FakeTensor((k, n // 8), "int32"), FakeTensor((k // g, n // 8), "int32"),
                       FakeTensor((k // g, n), "bfloat16"), group_size=g)
    assert pw.fast is not None
    Q.awq_linear(x, pw, bias=bias)
    Q.awq_linear(x, dataclasses.replace(pw, fast=None), bias=bias)
    _same_launch(calls[0], calls[1])
    args = calls[0][2]
    if Q.use_marlin(m, n, k, g):
        assert "quant_marlin_kernel" in calls[0][0].name
        assert args[4] == pw.gemv.w_ptr and args[5] == pw.gemv.g_ptr and args[6] == bias.ptr and int(args[7]) == m
    elif Q.use_bulk(Q.KIND_INT4, m, n, k, g, (9, 0)):
        assert "gemv_bulk_kernel" in calls[0][0].name
        assert args[4] == pw.gemv.w_ptr and args[5] == pw.gemv.g_ptr and int(args[-1]) == k
    elif Q.use_stream(Q.KIND_INT4, m, n, k, g):
        assert "gemv_stream_kernel" in calls[0][0].name
        assert args[4] == pw.gemv.w_ptr and args[5] == pw.gemv.g_ptr and int(args[-1]) == k
    elif Q.use_gemv(Q.KIND_INT4, m, n, k):
        assert "gemv_kernel" in calls[0][0].name
        assert args[4] == pw.gemv.w_ptr and args[5] == pw.gemv.g_ptr and int(args[-1]) == k
    else:
        assert "quant_mma_kernel" in calls[0][0].name
        assert args[4] == pw.fast.qw_ptr and int(args[-1]) == 1
    if not Q.use_marlin(m, n, k, g):
        assert args[7] == bias.ptr and int(args[8]) == m
    pg = Q.prepack_gptq(FakeTensor((k // 8, n), "int32"), FakeTensor((k // g, n // 8), "int32"),
                        FakeTensor((k // g, n), "bfloat16"), group_size=g)
    Q.gptq_linear(x, pg)
    Q.gptq_linear(x, dataclasses.replace(pg, fast=None))
    _same_launch(calls[2], calls[3])
    p8 = Q.prepack_int8(FakeTensor((n, k), "int8"), FakeTensor((n,), "bfloat16"))
    Q.int8_linear(x, p8, bias=bias)
    Q.int8_linear(x, dataclasses.replace(p8, fast=None), bias=bias)
    _same_launch(calls[4], calls[5])
    # a dtype mismatch leaves the fast path (the checked path converts or raises)
    with pytest.raises(TypeError, match="bias"):
        Q.awq_linear(x, pw, bias=FakeTensor((n,), "float16"))


# ------------------------------------------------------------------------------------ quant_marlin_kernel (CPU)

@contextlib.contextmanager
def _marlin(mode="on", m_range=None, **override):
    """Force quant_marlin_kernel on ("on") or off for prepacked INT4 layers, its M range and launch overrides.
    "on" also turns w4_wgmma_kernel off, which would otherwise come first at 17 <= M <= 1024 on sm_90."""
    old = (Q._MARLIN_MODE, Q._MARLIN_M_RANGE, dict(Q._MARLIN_OVERRIDE), Q._W4WGMMA_MODE)
    Q._MARLIN_MODE = mode
    if mode == "on":
        Q._W4WGMMA_MODE = "off"
    if m_range is not None:
        Q._MARLIN_M_RANGE = m_range
    Q._MARLIN_OVERRIDE.clear()
    Q._MARLIN_OVERRIDE.update(override)
    try:
        yield
    finally:
        Q._MARLIN_MODE, Q._MARLIN_M_RANGE, Q._W4WGMMA_MODE = old[0], old[1], old[3]
        Q._MARLIN_OVERRIDE.clear()
        Q._MARLIN_OVERRIDE.update(old[2])


@pytest.mark.parametrize("m", [17, 32, 33, 64, 65, 100, 128])
@pytest.mark.parametrize("n,k", [(8192, 8192), (28672, 8192), (8192, 28672), (4096, 4096), (320, 512), (64, 128)])
def test_marlin_config(m, n, k):
    cfg = Q.marlin_config(m, n, k, 132)
    kc = k // 128
    assert cfg.mt == (4 if m <= 32 else 8)
    assert cfg.m_chunks * 8 * cfg.mt >= m > (cfg.m_chunks - 1) * 8 * cfg.mt
    assert cfg.n_tiles * Q.MARLIN_BLOCKS * 64 >= n > (cfg.n_tiles - 1) * Q.MARLIN_BLOCKS * 64
    units = cfg.n_tiles * cfg.m_chunks * kc
    assert 1 <= cfg.ctas <= units and cfg.grid == cfg.ctas
    assert cfg.smem == Q.marlin_smem_bytes(cfg.mt) <= 227 * 1024
    # the ranges cover every unit once, in order, none empty
    ranges = Q.marlin_ranges(units, cfg.ctas)
    assert ranges[0][0] == 0 and ranges[-1][1] == units
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and all(h > l for l, h in ranges)
    if (n, k) in ((8192, 8192), (8192, 28672), (28672, 8192)):
        assert 112 <= cfg.grid <= 132, cfg  # one full wave
    assert Q.marlin_config(m, n, k, 132, ctas=7).ctas == min(7, units)


def test_marlin_heuristic_choices():
    # M = 64: 8192^2 as plain split-K (32 tiles x 4, aligned); 28672x8192 as one stream-K wave of 132 CTAs
    assert Q.marlin_config(64, 8192, 8192, 132).ctas == 128
    assert Q.marlin_config(64, 28672, 8192, 132).ctas == 132
    assert Q.marlin_config(64, 28672, 8192, 114).ctas in (112, 114)


@pytest.mark.parametrize("tms,kc,p", [(32, 64, 128), (112, 64, 132), (3, 5, 7), (1, 1, 1), (2, 3, 6), (5, 4, 3),
                                      (64, 224, 132), (7, 2, 13)])
def test_marlin_cost_segments_closed_form(tms, kc, p):
    """_marlin_cost's closed-form segment counts agree with walking the ranges (marlin_segments)."""
    ranges = Q.marlin_ranges(tms * kc, p)
    covered = np.zeros(tms * kc, np.int64)
    worst, partial = 0, 0
    for lo, hi in ranges:
        segs = Q.marlin_segments(lo, hi, kc)
        assert sum(nn for _, _, nn in segs) == hi - lo
        for tm, c0, nn in segs:
            assert 0 <= c0 and c0 + nn <= kc
            covered[tm * kc + c0:tm * kc + c0 + nn] += 1
        worst = max(worst, (hi - lo) + max(len(segs) - 1, 0))
        partial += sum(1 for _, _, nn in segs if nn < kc)
    assert (covered == 1).all()
    rows = 64
    expect = -(-p // 132) * (worst + 1) + 0.5 * partial * rows * 256 * 8 / (16384 * 132)
    assert Q._marlin_cost(tms, kc, p, 132, rows) == pytest.approx(expect)


def test_marlin_smem_matches_the_kernel_layout():
    # Marlin<MT>::SMEM in kernels/quant_marlin.cu: stages x (4 x 4 KB weights + 4 x 192 B records + 8 MT rows of 288 B)
    assert Q.marlin_smem_bytes(8) == 4 * (16384 + 768 + 64 * 288) == 142336
    assert Q.marlin_smem_bytes(4) == 6 * (16384 + 768 + 32 * 288) == 158208
    assert max(Q.marlin_smem_bytes(mt) for mt in Q.MARLIN_MT_CHOICES) <= 166912  # sm_80's opt-in limit
    # the second half-chunk's accumulators (4 blocks x MT x 16 floats x 32 lanes) fit the drained ring
    for mt in Q.MARLIN_MT_CHOICES:
        assert 4 * mt * 16 * 32 * 4 <= Q.marlin_smem_bytes(mt)


def test_use_marlin_switch_and_shapes():
    with _marlin("off"):
        assert not Q.use_marlin(64, 8192, 8192, 128)
    with _marlin("auto"):
        assert Q.use_marlin(64, 8192, 8192, 128) and Q.use_marlin(32, 8192, 8192, 128)
        assert not Q.use_marlin(17, 8192, 8192, 128) and not Q.use_marlin(31, 4096, 4096, 128)
        assert Q.use_marlin(17, 28672, 8192, 128) and not Q.use_marlin(129, 28672, 8192, 128)
    with _marlin("on"):
        assert Q.use_marlin(64, 8192, 8192, 128) and Q.use_marlin(17, 8192, 8192, 128)
        assert Q.use_marlin(128, 28672, 8192, 256)
        assert not Q.use_marlin(16, 8192, 8192, 128) and not Q.use_marlin(129, 8192, 8192, 128)
        assert not Q.use_marlin(64, 8192, 8192, 64)      # a chunk would straddle groups
        assert not Q.use_marlin(64, 8192, 8160, 128)     # K % 128
        assert not Q.use_marlin(64, 8200, 8192, 128)     # N % 64
    with _marlin("on", m_range=(1, 256)):
        assert Q.use_marlin(1, 8192, 8192, 128) and Q.use_marlin(256, 8192, 8192, 128)


@pytest.mark.parametrize("m", [17, 64, 100])
def test_marlin_dispatch_launch_arguments(fake_gpu, m):
    """With the switch on, a prepacked AWQ / GPTQ layer at M in range launches quant_marlin_kernel with the
    fragment-major pointers, the problem scalars and the configured grid; off, the previous kernel."""
    import dataclasses

    calls = fake_gpu
    k, n, g = 1024, 1536, 128
    x = FakeTensor((m, k), "bfloat16")
    bias = FakeTensor((n,), "bfloat16")
    pw = Q.prepack_awq(FakeTensor((k, n // 8), "int32"), FakeTensor((k // g, n // 8), "int32"),
                       FakeTensor((k // g, n), "bfloat16"), group_size=g)
    with _marlin("on"):
        Q.awq_linear(x, pw, bias=bias)
        Q.awq_linear(x, dataclasses.replace(pw, fast=None), bias=bias)
        pg = Q.prepack_gptq(FakeTensor((k // 8, n), "int32"), FakeTensor((k // g, n // 8), "int32"),
                            FakeTensor((k // g, n), "bfloat16"), group_size=g)
        Q.gptq_linear(x, pg)
        # fp16 x with bf16 scales records: not this kernel (the checked path converts the scales)
    with _marlin("off"):
        Q.awq_linear(x, pw, bias=bias)
    cfg = Q.marlin_config(m, n, k, 132)
    for kernel, lcfg, args in calls[:3]:
        assert kernel.name == f"quant::quant_marlin_kernel<__nv_bfloat16, {cfg.mt}>"
        assert tuple(lcfg.grid) == (cfg.grid,) and tuple(lcfg.block) == (256,) and lcfg.smem == cfg.smem
        assert len(args) == 15
        assert [int(a) for a in args[7:14]] == [m, n, k // 32, g // 32, k // g, cfg.n_tiles, cfg.m_chunks]
        assert int(args[14]) == k and type(args[14]) is np.int64
        assert all(type(a) is np.int32 for a in args[7:14])
        split = cfg.ctas != cfg.n_tiles * cfg.m_chunks
        assert (args[1] != 0) == split and (args[2] != 0) == split
    assert calls[0][2][4] == pw.gemv.w_ptr and calls[0][2][5] == pw.gemv.g_ptr and calls[0][2][6] == bias.ptr
    assert calls[2][2][4] == pg.gemv.w_ptr and calls[2][2][6] == 0
    for u, v in zip(calls[0][2], calls[1][2]):
        assert type(u) is type(v) and u == v
    assert "quant_marlin_kernel" not in calls[3][0].name


def _marlin_mirror(x16, words, recs, m, n, k, g, cfg, bias=None):
    """The data flow of quant_marlin_kernel in NumPy, index for index: the ring stages' bytes as the cp.async
    copies place them, each warp's 16-byte weight reads and 8-byte x reads, the m16n8k16 fragment semantics
    (A: a0 (g, 2c..2c+1), a1 (g + 8, 2c..), a2 (g, 2c + 8..), a3 (g + 8, 2c + 8..); B: b0 rows 2c..2c+1, b1 rows
    2c + 8..2c + 9, column g; D: d_j at (g + 8 (j // 2), 2 c + j % 2)), the half-chunk reduction, the epilogue's
    (row, channel) of every accumulator and the split-K sum.  Dequantized weights and sums in float64.
    Returns y (M, N) float64 and how many times each element was written."""
    ks, spg, ng, kc = k // 32, g // 32, k // g, k // 128
    wbytes = np.ascontiguousarray(words, np.uint32).view(np.uint8)
    xbytes = np.ascontiguousarray(x16).view(np.uint8).reshape(m, 2 * k)
    W, G = 4 * 4096, 4 * 192
    stage_bytes = W + G + 8 * cfg.mt * 288
    y = np.zeros((m, n))
    written = np.zeros((m, n), np.int64)
    slot_floats = 8 * cfg.mt * 256
    ws = np.full(2 * cfg.ctas * slot_floats, np.nan)
    tickets = {}
    lanes = np.arange(32)
    gl, cl = lanes >> 2, lanes & 3
    units, p = cfg.n_tiles * cfg.m_chunks * kc, cfg.ctas
    ubegin = lambda c: c * units // p  # noqa: E731

    def cta_of(v):
        c = v * p // units
        while c + 1 < p and ubegin(c + 1) <= v:
            c += 1
        while c > 0 and ubegin(c) > v:
            c -= 1
        return c

    for cta in range(p):
        u_begin, u_end = ubegin(cta), ubegin(cta + 1)
        u = u_begin
        while u < u_end:
            tm, c0 = divmod(u, kc)
            nch = min(u_end, (tm + 1) * kc) - u
            tile, mc = divmod(tm, cfg.m_chunks)
            blocks_here = min(4, n // 64 - tile * 4)
            m0, b0 = mc * 8 * cfg.mt, tile * 4
            acc = np.zeros((8, cfg.mt, 4, 4, 32))
            for i in range(nch):
                ch = c0 + i
                st = np.full(stage_bytes, 0xFF, np.uint8)  # unloaded bytes are garbage (NaN patterns)
                for idx in range(1024):
                    j, off = idx >> 8, idx & 255
                    if j < blocks_here:
                        src = ((b0 + j) * ks + 4 * ch) * 1024 + off * 16
                        st[j * 4096 + off * 16:j * 4096 + off * 16 + 16] = wbytes[src:src + 16]
                for tid in range(48):
                    j, piece = tid // 12, tid % 12
                    grp = (4 * ch) // spg
                    if j < blocks_here:
                        src = ((b0 + j) * ng + grp) * 192 + piece * 16
                        st[W + j * 192 + piece * 16:W + j * 192 + piece * 16 + 16] = recs[src:src + 16]
                for idx in range(128 * cfg.mt):
                    r, pp = idx >> 4, idx & 15
                    row = m0 + r
                    dst = W + G + r * 288 + pp * 16
                    if row < m:
                        st[dst:dst + 16] = xbytes[row, 2 * (128 * ch + 8 * pp):2 * (128 * ch + 8 * pp) + 16]
                    else:
                        st[dst:dst + 16] = 0
                for warp in range(8):
                    wn, wk = warp & 3, warp >> 2
                    if wn >= blocks_here:
                        continue
                    gb = W + wn * 192
                    sv = np.stack([st[gb + 16 * gg:gb + 16 * gg + 16].view(np.float16) for gg in gl]).astype(float)
                    zv = np.stack([st[gb + 128 + 8 * gg:gb + 136 + 8 * gg] for gg in gl]).astype(np.float64)
                    for up in range(2):
                        for h in range(2):
                            base = wn * 4096 + wk * 2048 + up * 1024 + h * 512
                            wu = np.stack([st[base + 16 * ln:base + 16 * ln + 16].view(np.uint32) for ln in lanes])
                            amat = np.zeros((4, 16, 16))
                            for t in range(4):
                                for ai in range(4):
                                    o = 2 * t + (ai & 1)
                                    for half in range(2):
                                        q = (wu[:, t] >> np.uint32(4 * (ai + 4 * half))) & np.uint32(15)
                                        val = (q.astype(np.float64) - zv[lanes, o]) * sv[lanes, o]
                                        amat[t, gl + 8 * (ai & 1), 2 * cl + 8 * (ai >> 1) + half] = val
                            for mt in range(cfg.mt):
                                xo = (8 * mt + gl) * 288 + wk * 128 + cl * 8 + up * 64 + h * 32
                                xw = np.stack([st[W + G + a:W + G + a + 8].view(np.float16) for a in xo]).astype(float)
                                bmat = np.zeros((16, 8))
                                for e in range(4):
                                    bmat[2 * cl + 8 * (e >> 1) + (e & 1), gl] = xw[:, e]
                                for t in range(4):
                                    d = amat[t] @ bmat
                                    for j in range(4):
                                        acc[warp, mt, t, j] += d[gl + 8 * (j >> 1), 2 * cl + (j & 1)]
            slot = (2 * cta + (0 if u == u_begin else 1)) * slot_floats
            for wn in range(blocks_here):
                acc[wn] += acc[wn + 4]
                for mt in range(cfg.mt):
                    for t in range(4):
                        for j in range(4):
                            r = 8 * mt + 2 * cl + (j & 1)
                            col = wn * 64 + 16 * t + gl + 8 * (j >> 1)
                            ok = m0 + r < m
                            if nch == kc:
                                ns = b0 * 64 + col[ok]
                                v = acc[wn, mt, t, j][ok] + (bias[ns] if bias is not None else 0.0)
                                y[m0 + r[ok], ns] = v
                                written[m0 + r[ok], ns] += 1
                            else:
                                ws[slot + r[ok] * 256 + col[ok]] = acc[wn, mt, t, j][ok]
            if nch < kc:
                tickets[tm] = tickets.get(tm, 0) + nch
                assert tickets[tm] <= kc
                if tickets[tm] == kc:
                    c_lo, c_hi = cta_of(tm * kc), cta_of((tm + 1) * kc - 1)
                    rows_here, cols4 = min(m - m0, 8 * cfg.mt), blocks_here * 16
                    for item in range(rows_here * cols4):
                        r, c4 = item // cols4, 4 * (item % cols4)
                        for e in range(4):
                            v = 0.0
                            for cc in range(c_lo, c_hi + 1):
                                cb = ubegin(cc)
                                if cb == ubegin(cc + 1):
                                    continue
                                v += ws[(2 * cc + (0 if cb >= tm * kc else 1)) * slot_floats + r * 256 + c4 + e]
                            nn = b0 * 64 + c4 + e
                            y[m0 + r, nn] = v + (bias[nn] if bias is not None else 0.0)
                            written[m0 + r, nn] += 1
                    tickets[tm] = 0
            u += nch
    return y, written


@pytest.mark.parametrize("m,n,k,g,ctas", [(17, 320, 512, 128, 0), (40, 256, 384, 128, 2), (70, 192, 768, 256, 5),
                                          (33, 64, 128, 128, 0), (20, 640, 640, 128, 4), (100, 320, 384, 128, 3),
                                          (24, 128, 1024, 256, 3)])
def test_marlin_mirror_matches_x_at_w(m, n, k, g, ctas):
    """The kernel's index math, mirrored in NumPy on the fragment-major words and group records made by the
    reference packers, gives x @ W (AWQ) with every output written exactly once: odd M (zero-filled rows, two
    m-chunks), a partial last channel tile, groups of one and two chunks, stream-K ranges that split tiles over
    2-3 CTAs, cover several tiles, or one tile in pieces (first and last segment slots)."""
    rng = np.random.default_rng(m + n + k)
    q = rng.integers(0, 16, (k, n))
    z = rng.integers(0, 16, (k // g, n))
    s = (rng.random((k // g, n)) * 0.02 + 0.001).astype(np.float16)
    w_kn = Q.dequantize_awq_reference(Q.pack_awq(q), Q.pack_awq(z), s.astype(np.float32), g).astype(np.float64)
    words = Q.gemv_pack_int4_reference(q)
    recs = Q.gemv_pack_groups_reference(z, s.view(np.uint16))
    x16 = rng.standard_normal((m, k)).astype(np.float16)
    bias = rng.standard_normal(n)
    cfg = Q.marlin_config(m, n, k, 132, ctas=ctas)
    if ctas:
        assert cfg.ctas == ctas
    y, written = _marlin_mirror(x16, words, recs, m, n, k, g, cfg, bias)
    assert (written == 1).all()
    ref = x16.astype(np.float64) @ w_kn + bias
    np.testing.assert_allclose(y, ref, rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------------------------ quant_marlin_kernel (GPU)

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fmt", [Q.FMT_AWQ, Q.FMT_GPTQ])
@pytest.mark.parametrize("m,n,k,g,override", [
    (17, 512, 1024, 128, {}), (33, 320, 2048, 256, {"ctas": 5}), (64, 1024, 4096, 128, {}),
    (100, 192, 640, 128, {"ctas": 3}), (128, 4096, 1024, 128, {}), (64, 256, 128, 128, {}),
    (40, 8192, 1024, -1, {}), (24, 4096, 2048, 128, {"ctas": 13})])
def test_marlin_small(dtype, fmt, m, n, k, g, override):
    """quant_marlin_kernel (forced on) on prepacked AWQ / GPTQ layers: odd M (rows past M zero-filled, two m-chunks
    at M > 64), a partial last 256-channel tile, groups of one, two and all chunks, split-K (forced and chosen),
    one-chunk K, stream-K ranges (forced grids); against float64 x @ W (rel err 1e-2 per row), outputs poisoned with NaN before each call, three
    calls (tickets left zeroed), a strided 3-D view of x with bias, and the same layer through quant_mma_kernel."""
    torch = _torch()
    td = getattr(torch, dtype)
    rng = np.random.default_rng(m * 53 + n + k + fmt)
    layer, w_kn, _ = _gemv_layer(torch, fmt, n, k, g, td, rng)
    assert layer.gemv is not None
    with _marlin("on", **override):
        x = torch.randn(m, k, device="cuda", dtype=td)
        ref = _ref(x, w_kn)
        for _ in range(3):
            poison = torch.full((m, n), float("nan"), device="cuda", dtype=td)
            del poison
            with launched() as names:
                y = _linear(fmt, x, layer)
            assert any("quant_marlin_kernel" in nm for nm in names), names
            yf = y.float().cpu().numpy().astype(np.float64)
            assert np.isfinite(yf).all()
            row_err = np.linalg.norm(yf - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)
            assert row_err.max() < 1e-2, row_err.max()
        xb = torch.randn(m, k + 64, device="cuda", dtype=td)[:, 32:32 + k]
        bias = torch.randn(n, device="cuda", dtype=td)
        y3 = _linear(fmt, xb.reshape(1, m, k), layer, bias)
        assert y3.shape == (1, m, n)
        err, finite = _rel_err(y3.reshape(m, n), _ref(xb, w_kn, bias))
        assert finite and err < 1e-2, err
    with _marlin("off"), _gemv_mode("off"), _stream("off"):
        y_mma = _linear(fmt, x, layer)
    assert (y.float() - y_mma.float()).abs().max().item() <= 2e-2 * y_mma.float().abs().max().item() + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("override", [{}, {"ctas": 3}])
def test_marlin_exact_rows_small(override):
    """x = one-hot rows (M = 17 and 64) pick rows of W exactly through quant_marlin_kernel: every nibble, zero
    point (GPTQ's 16 included) and power-of-two scale position, bf16 and fp16, with and without split-K."""
    torch = _torch()
    rng = np.random.default_rng(29)
    with _marlin("on", **override):
        for fmt in (Q.FMT_AWQ, Q.FMT_GPTQ):
            for td in (torch.float16, torch.bfloat16):
                k, n, g = 1024, 512, 128
                layer, _, _ = _gemv_layer(torch, fmt, n, k, g, td, rng)
                layer, w_kn = _pow2_scaled(torch, fmt, layer, k, n, g, td, rng)
                assert_picks_rows(torch, fmt, layer, w_kn, td, (slice(0, 17), slice(960, 1024), slice(101, 165)),
                                  "quant_marlin_kernel")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m", [17, 64])
def test_marlin_gptq_act_order_small(dtype, m):
    """Act-order GPTQ through prepack_gptq (rows repacked in group order, x gathered per call) and
    quant_marlin_kernel: against float64 x @ W with the checkpoint's g_idx."""
    torch = _torch()
    td = getattr(torch, dtype)
    n, k, g = 512, 1024, 128
    rng = np.random.default_rng(m + 5)
    args, ref_w = act_order_gptq(torch, td, rng, n, k, g)
    with _marlin("on"):
        packed = Q.prepack_gptq(*args, group_size=g)
        assert packed.perm is not None and packed.gemv is not None
        x = torch.randn(m, k, device="cuda", dtype=td)
        with launched() as names:
            y = Q.gptq_linear(x, packed)
        assert any("quant_marlin_kernel" in nm for nm in names), names
    err, finite = _rel_err(y, _ref(x, ref_w))
    assert finite and err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
def test_prepacked_plans_replay_on_fresh_inputs(m):
    """A decode-sized call of a prepacked layer is cached per call signature: the later calls (fresh x, with and
    without bias) run the plan and match the checked path bit for bit."""
    torch = _torch()
    rng = np.random.default_rng(70 + m)
    k, n, g = 4096, 1024, 128
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    q, z = rng.integers(0, 16, (k, n)), rng.integers(0, 16, (k // g, n))
    s = (rng.random((k // g, n)) * 0.01 + 0.005).astype(np.float16)
    layer = Q.prepack_awq(t(Q.pack_awq(q)), t(Q.pack_awq(z)), t(s), group_size=g, dtype="bfloat16")
    import dataclasses

    plain = dataclasses.replace(layer, fast=None)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for call in range(3):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for b in (None, bias):
            torch.testing.assert_close(Q.awq_linear(x, layer, bias=b), Q.awq_linear(x, plain, bias=b), atol=0, rtol=0)
    if Q.use_stream(Q.KIND_INT4, m, n, k, g) or Q.use_bulk(Q.KIND_INT4, m, n, k, g, (9, 0)):
        assert len(layer.fast.plans) == 2
