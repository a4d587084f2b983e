"""w4_wgmma_kernel (kernels/quant_sm90.cu): the Hopper INT4 GEMM for AWQ / GPTQ layers at M >= 17.

CPU: the wgmma-major layout (NumPy reference, the pack kernel's index math mirrored in NumPy, the consumer's reads),
a NumPy mirror of the kernel's whole data flow (stage bytes, fragment reads, group records, accumulator mapping,
split-K sums, masked stores) against x @ W, the config heuristic, the shared-memory budget, the dispatch switch, the
compiled variants.  GPU (marked gpu): against float64 x @ dequant(W) for odd M, both dtypes, AWQ and GPTQ (act-order
included), bias, poisoned outputs, repeated calls, forced split-K, one-hot rows (exact).
"""
import contextlib

import numpy as np
import pytest

from speedcore import quant as Q

from quant_fakes import FakeTensor, act_order_gptq, assert_picks_rows, install_fake_gpu, launched, pow2_scaled
from quant_fakes import linear as _linear


@contextlib.contextmanager
def _w4(mode="on", **override):
    """Turn w4_wgmma_kernel on ("on") or off for prepacked INT4 layers (set before prepacking), and its overrides."""
    old = (Q._W4WGMMA_MODE, dict(Q._W4WGMMA_OVERRIDE))
    Q._W4WGMMA_MODE = mode
    Q._W4WGMMA_OVERRIDE.clear()
    Q._W4WGMMA_OVERRIDE.update(override)
    try:
        yield
    finally:
        Q._W4WGMMA_MODE = old[0]
        Q._W4WGMMA_OVERRIDE.clear()
        Q._W4WGMMA_OVERRIDE.update(old[1])


# ------------------------------------------------------------------------------------------------- layout (CPU)

def test_layout_roundtrip_reads_every_weight_once():
    rng = np.random.default_rng(1)
    for k, n in ((64, 256), (256, 768), (512, 512)):  # N % 256: super-blocks of 4 x 64 channels
        q = rng.integers(0, 16, (k, n)).astype(np.uint8)
        words = Q.w4wgmma_pack_reference(q)
        assert words.dtype == np.uint32 and words.shape == (k * n // 8,)
        assert np.array_equal(Q.w4wgmma_unpack_reference(words, k, n), q)  # raises on a double or missing read


def test_layout_hand_made():
    """One non-zero weight at a time lands in the word and nibble the m16n8k16 A fragment says."""
    k, n = 128, 512
    for (kk, nn) in ((0, 0), (1, 0), (8, 0), (9, 8), (2, 1), (17, 16), (63, 63), (64, 64), (127, 127), (70, 77),
                     (65, 200), (127, 256), (3, 511)):
        q = np.zeros((k, n), np.uint8)
        q[kk, nn] = 0xF
        words = Q.w4wgmma_pack_reference(q)
        (idx,) = np.nonzero(words)
        b, t, g, j = nn // 64, (nn % 64) // 16, nn % 8, (nn % 16) // 8
        kb, s, p, c, e = kk // 64, (kk % 64) // 16, (kk % 16) // 8, (kk % 8) // 2, kk % 2
        lane = 4 * g + c
        expect_idx = (((((b // 4) * (k // 64) + kb) * 4 + b % 4) * 4 + t) * 32 + lane) * 4 + s  # super-blocks
        r = j + 2 * p  # register: rows g / g + 8 alternate, k columns 8..15 in registers 2, 3
        assert list(idx) == [expect_idx], (kk, nn)
        assert words[idx[0]] == 0xF << (4 * (r + 4 * e)), (kk, nn, hex(words[idx[0]]))


def _pack_kernel_mirror(fmt, qw, k, n):
    """w4wgmma_pack_kernel's index math, vectorized over the thread index (one word per thread)."""
    kbs = k // 64
    idx = np.arange(n * k // 8, dtype=np.int64)
    s, lane, t = idx & 3, (idx >> 2) & 31, (idx >> 7) & 3
    kb, b = (idx >> 11) % kbs, (idx >> 11) // kbs * 4 + ((idx >> 9) & 3)
    g, c = lane >> 2, lane & 3
    n_base, k_base = 64 * b + 16 * t + g, 64 * kb + 16 * s + 2 * c
    qw = np.asarray(qw).view(np.uint32).astype(np.int64)
    word = np.zeros(idx.shape, np.int64)
    for i in range(8):
        r, e = i & 3, i >> 2
        nn, kk = n_base + 8 * (r & 1), k_base + e + 8 * (r >> 1)
        if fmt == Q.FMT_AWQ:
            o = nn & 7
            pos = np.where(o & 1, 4 + (o >> 1), o >> 1)
            qv = (qw[kk, nn >> 3] >> (4 * pos)) & 15
        else:
            qv = (qw[kk >> 3, nn] >> (4 * (kk & 7))) & 15
        word |= qv << (4 * i)
    return word.astype(np.uint32)


@pytest.mark.parametrize("fmt", [Q.FMT_AWQ, Q.FMT_GPTQ])
def test_pack_kernel_index_math_matches_reference(fmt):
    rng = np.random.default_rng(2 + fmt)
    k, n = 384, 512
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    qw = Q.pack_awq(q) if fmt == Q.FMT_AWQ else Q.pack_rows(q)
    assert np.array_equal(_pack_kernel_mirror(fmt, qw, k, n), Q.w4wgmma_pack_reference(q))


def test_w8_layout_roundtrip_and_hand_made():
    """INT8 wgmma-major layout: every byte read once from the consumer's side; single bytes land in the word and
    byte position the m16n8k16 A fragment says (int8_pair: bytes 0-1 registers 0 / 1, bytes 2-3 registers 2 / 3)."""
    rng = np.random.default_rng(11)
    for n, k in ((256, 64), (512, 192)):
        w = rng.integers(-128, 128, (n, k)).astype(np.int8)
        words = Q.w8wgmma_pack_reference(w)
        assert words.dtype == np.uint32 and words.shape == (n * k // 4,)
        assert np.array_equal(Q.w8wgmma_unpack_reference(words, k, n), w)
    n, k = 512, 128
    for (nn, kk) in ((0, 0), (0, 1), (0, 8), (8, 9), (3, 2), (16, 17), (63, 63), (64, 64), (255, 127), (300, 70),
                     (511, 5)):
        w = np.zeros((n, k), np.int8)
        w[nn, kk] = -3
        words = Q.w8wgmma_pack_reference(w)
        (idx,) = np.nonzero(words)
        b, t, h, g = nn // 64, (nn % 64) // 16, (nn % 16) // 8, nn % 8
        kc, s, p, c, e = kk // 64, (kk % 64) // 16, (kk % 16) // 8, (kk % 8) // 2, kk % 2
        expect = (((((b // 4) * (k // 64) + kc) * 4 + b % 4) * 128 + 32 * t + 4 * g + c) * 8 + 2 * s + h)
        assert list(idx) == [expect], (nn, kk)
        assert words[idx[0]] == 0xFD << (8 * (2 * p + e)), (nn, kk, hex(words[idx[0]]))


def _w8_pack_kernel_mirror(w, k, n):
    """w8wgmma_pack_kernel's index math, vectorized over the thread index (one word per thread)."""
    kc_count = k // 64
    idx = np.arange(n * k // 4, dtype=np.int64)
    h, s, lane, t = idx & 1, (idx >> 1) & 3, (idx >> 3) & 31, (idx >> 8) & 3
    rest = idx >> 12
    kc, b = rest % kc_count, rest // kc_count * 4 + ((idx >> 10) & 3)
    g, c = lane >> 2, lane & 3
    row = 64 * b + 16 * t + g + 8 * h
    col = 64 * kc + 16 * s + 2 * c
    u = np.asarray(w, np.int8).view(np.uint8).astype(np.int64)
    word = u[row, col] | (u[row, col + 1] << 8) | (u[row, col + 8] << 16) | (u[row, col + 9] << 24)
    return word.astype(np.uint32)


def test_w8_pack_kernel_index_math_matches_reference():
    rng = np.random.default_rng(12)
    n, k = 768, 320
    w = rng.integers(-128, 128, (n, k)).astype(np.int8)
    assert np.array_equal(_w8_pack_kernel_mirror(w, k, n), Q.w8wgmma_pack_reference(w))


def test_w8_config_and_switch():
    """INT8 configs: the INT4 default shapes with 4 KB blocks and no records (more stages fit less), other shapes
    refused; the switch is off by default (not yet measured) and gates prepack's copy and the dispatch."""
    c = Q.w4wgmma_config(32, 8192, 8192, 132, kind=Q.KIND_INT8)
    assert (c.blk, c.mt, c.gs, c.ks, c.kind) == (2, 64, 4, 2, Q.KIND_INT8)
    assert Q.w4wgmma_stage_bytes(64, 2, 1, Q.KIND_INT8) == 64 * 128 + 4 * 4096
    assert Q.w4wgmma_stage_bytes(64, 2, 2, Q.KIND_INT8) == 2 * (64 * 128 + 4 * 4096)
    assert c.smem == Q.w4wgmma_smem_bytes(64, 2, c.stages, 2, Q.KIND_INT8) <= Q.W4WGMMA_SMEM_LIMIT
    for m in (17, 65, 200, 1000, 8192):
        for n, k in ((8192, 8192), (28672, 8192), (4096, 4096)):
            c = Q.w4wgmma_config(m, n, k, 132, kind=Q.KIND_INT8)
            assert (c.blk, c.mt, c.gs, c.ks) in Q.W8WGMMA_VARIANTS and c.smem <= Q.W4WGMMA_SMEM_LIMIT
    with pytest.raises(ValueError):
        Q.w4wgmma_config(64, 8192, 8192, 132, blk=4, kind=Q.KIND_INT8)
    with pytest.raises(ValueError):
        Q.w4wgmma_config(64, 8192, 8192, 132, ks=2, mt=64, kind=Q.KIND_INT8)  # gs 1 with ks 2: not built
    assert Q.w8wgmma_supported(64, 256) and not Q.w8wgmma_supported(64, 192) and not Q.w8wgmma_supported(96, 256)
    old = Q._W8WGMMA_MODE
    try:
        Q._W8WGMMA_MODE = "off"
        assert not Q.use_w8wgmma(64, 8192, 8192)
        Q._W8WGMMA_MODE = "auto"  # the default: on
        assert Q.use_w8wgmma(17, 8192, 8192) and Q.use_w8wgmma(8192, 8192, 8192)
        assert not Q.use_w8wgmma(16, 8192, 8192) and not Q.use_w8wgmma(64, 8192, 8192, cc=(8, 0))
    finally:
        Q._W8WGMMA_MODE = old


def _to_half_bits(v, dtype):
    """float64 values rounded once to fp16 / bf16 (round to nearest even), as 16-bit patterns."""
    v = np.asarray(v, np.float64)
    if dtype == "float16":
        return v.astype(np.float16).view(np.uint16)
    u = v.astype(np.float32).view(np.uint32).astype(np.uint64)  # exact here: the products below fit in fp32
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_int4_fragment_constants_emulated(dtype):
    """sc::int4_fragment / int4_zero_term (kernels/common/int4.cuh) as group_consts of kernels/quant_sm90.cu
    feeds them, on bit patterns: the magic-number nibble extraction
    (fp16 odd registers read at bits 4-7 as (1024 + 16 q) and scaled by 1/16), -(magic + z) for every z in 0..16
    (GPTQ's 16), then one rounding of (q - z) s; registers 0 / 2 take row g's constants, 1 / 3 row g + 8's."""
    rng = np.random.default_rng(11)
    f = lambda bits: _half_bits_to_float(np.uint16(bits), dtype)  # noqa: E731
    for z0 in range(17):
        z1 = 16 - z0
        s = rng.random(2) * 0.02 + 0.001
        s_bits = _to_half_bits(s, dtype)
        s_f = _half_bits_to_float(s_bits, dtype)
        word = int(rng.integers(0, 1 << 32))
        nib = [(word >> (4 * i)) & 15 for i in range(8)]
        for r in range(4):
            row = r % 2
            z = (z0, z1)[row]
            out = []
            for e in range(2):
                q = nib[r + 4 * e]
                if dtype == "float16":
                    if row == 0:  # (word >> 8 r/2) & 0x000f000f | 0x6400: 1024 + q, fma(., 1, -(1024 + z))
                        v = f(0x6400 | q) * 1.0 + f(0xE400 | z)
                    else:         # & 0x00f000f0 | 0x6400: 1024 + 16 q, fma(., 1/16, -(64 + z))
                        v = f(0x6400 | (q << 4)) * f(0x2C00) + f(0xD400 + (z << 4))
                else:             # (word >> 4 r) & 0x000f000f | 0x4300: 128 + q, fma(., 1, -(128 + z))
                    v = f(0x4300 | q) * 1.0 + f(0xC300 | z)
                assert v == q - z  # exact small integers before the scale
                out.append(_half_bits_to_float(_to_half_bits(v * s_f[row], dtype), dtype))
            expect = _half_bits_to_float(_to_half_bits((np.array([nib[r], nib[r + 4]]) - z) * s_f[row], dtype),
                                         dtype)
            assert np.array_equal(np.array(out), expect)


# ------------------------------------------------------------------------------------- kernel mirror (CPU)

def _half_bits_to_float(u16, dtype):
    u16 = np.asarray(u16, np.uint16)
    if dtype == "float16":
        return u16.view(np.float16).astype(np.float64)
    return (u16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _fragment_maps():
    """Per (warp, lane, k16 step s, register r, half e) of a consumer warpgroup: the row / column of the 64 x 64
    weight tile the kernel's A fragment holds, the word it reads (16 (32 warp + lane) bytes + 4 s into the block's
    stage chunk), the nibble, and the group-record bytes of its scale / zero (row g: o = 2 warp, g + 8: 2 warp + 1)."""
    warp, lane, s, r, e = np.meshgrid(np.arange(4), np.arange(32), np.arange(4), np.arange(4), np.arange(2),
                                      indexing="ij")
    warp, lane, s, r, e = (a.reshape(-1) for a in (warp, lane, s, r, e))
    g, c = lane // 4, lane % 4
    row = 16 * warp + g + 8 * (r % 2)
    col = 16 * s + 2 * c + 8 * (r // 2) + e
    word = (32 * warp + lane) * 4 + s
    shift = 4 * (r + 4 * e)
    scale_off = 16 * g + 4 * warp + 2 * (r % 2)
    zero_off = 128 + 8 * g + 2 * warp + (r % 2)
    return row, col, word, shift, scale_off, zero_off


def _kernel_mirror(x, words, recs, m, n, k, g, cfg, dtype, bias=None):
    """w4_wgmma_kernel's data flow in NumPy (float64 math), index for index: per CTA (w4wgmma_work) the producer's
    stage bytes (x tile rows past M zero, each block's 2 KB chunk and group record), each consumer warpgroup's
    dequantized A tiles from the fragment maps, the wgmma products, the accumulator-to-(m, n) mapping of the
    epilogue, and with split-K the cluster's reduce-scatter: each row group of 8 tile rows summed over the splits in
    rank order and stored by its owner rank.  Returns y and a count of writes per element.
    words: w4wgmma_pack_reference's super-blocks, recs: w4wgmma_groups_reference's order."""
    kbs, spg, ng = k // 64, g // 64, k // g
    mt, blk = cfg.mt, cfg.blk
    row, col, widx, shift, soff, zoff = _fragment_maps()
    assert len(np.unique(row * 64 + col)) == 64 * 64 == row.size  # every weight of a stage chunk read once
    y = np.full((m, n), np.nan)
    writes = np.zeros((m, n), np.int64)
    ws = np.zeros((max(cfg.splits, cfg.tail_splits), m, n))
    arrived = {}
    rgroups = mt // 8
    owners = {}
    for splits in {cfg.splits, cfg.tail_splits}:
        jmax = Q.w4wgmma_rows_per_rank(rgroups, splits)  # rank r owns row groups [r jmax, (r + 1) jmax)
        owners[splits] = np.arange(rgroups) // jmax
        assert jmax % 2 == 0 and owners[splits][0] == 0 and owners[splits][-1] < splits
    # epilogue map of a consumer thread's accumulators: (warp, lane, r) -> (channel in block, x row in tile)
    ew, el, er = (a.reshape(-1) for a in np.meshgrid(np.arange(4), np.arange(32), np.arange(mt // 2), indexing="ij"))
    e_row = 16 * ew + el // 4 + 8 * ((er >> 1) & 1)
    e_col = 8 * (er // 4) + 2 * (el % 4) + (er & 1)
    assert len(np.unique(e_row * mt + e_col)) == 64 * mt == e_row.size
    for (m_tile, split, n_tile, nb0, kb0, kb1, splits) in Q.w4wgmma_work(cfg, k):
        m0 = m_tile * mt
        acc = np.zeros((2 * blk, 64, mt))
        for kb in range(kb0, kb1):
            xt = np.zeros((mt, 64))
            rows = x[m0:m0 + mt, 64 * kb:64 * kb + 64]
            xt[:rows.shape[0]] = rows
            for bl in range(2 * blk):  # consumer warpgroup bl // blk, its block bl % blk
                b = nb0 + bl
                chunk = words[(((b // 4) * kbs + kb) * 4 + b % 4) * 512:][:512]
                rec = recs[(((b // 4) * ng + kb // spg) * 4 + b % 4) * 192:][:192]
                qv = (chunk[widx] >> shift.astype(np.uint32)) & 15
                sc = _half_bits_to_float(rec[soff].astype(np.uint16) | (rec[soff + 1].astype(np.uint16) << 8), dtype)
                a = np.zeros((64, 64))
                a[row, col] = (qv.astype(np.float64) - rec[zoff]) * sc
                acc[bl] += a @ xt.T
        for bl in range(2 * blk):
            nn = (nb0 + bl) * 64 + e_row
            mm = m0 + e_col
            ok = mm < m
            vals = acc[bl][e_row, e_col]
            if splits > 1:
                ws[split, mm[ok], nn[ok]] = vals[ok]
            else:
                y[mm[ok], nn[ok]] = vals[ok] + (bias[nn[ok]] if bias is not None else 0.0)
                np.add.at(writes, (mm[ok], nn[ok]), 1)
        if splits > 1:
            key = (n_tile, m_tile)
            arrived[key] = arrived.get(key, 0) + 1
            if arrived[key] == splits:  # the whole cluster is past its main loop: each rank sums its row groups
                for rank in range(splits):
                    for bl in range(2 * blk):
                        nn = (nb0 + bl) * 64 + e_row
                        mm = m0 + e_col
                        ok = (mm < m) & (owners[splits][e_col // 8] == rank)
                        v = np.zeros(int(ok.sum()))
                        for sp in range(splits):
                            v = v + ws[sp, mm[ok], nn[ok]]
                        y[mm[ok], nn[ok]] = v + (bias[nn[ok]] if bias is not None else 0.0)
                        np.add.at(writes, (mm[ok], nn[ok]), 1)
    return y, writes


@pytest.mark.parametrize("fmt", [Q.FMT_AWQ, Q.FMT_GPTQ])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k,g,override", [
    (17, 256, 256, 128, {}), (100, 512, 512, 256, {"splits": 3}), (64, 256, 1024, 128, {"splits": 4}),
    (129, 256, 128, 128, {}), (40, 768, 384, 128, {"mt": 128, "splits": 2}),
    # blk = 1 (128-channel CTAs) at every tile height, direct and split
    (33, 512, 256, 128, {"blk": 1, "mt": 64}), (130, 256, 512, 256, {"blk": 1, "splits": 3}),
    (300, 768, 256, 128, {"blk": 1, "mt": 256}), (257, 256, 512, 128, {"blk": 1, "mt": 256, "splits": 2}),
    # groups of 2 / 4 k16 steps (the same products)
    (70, 768, 512, 128, {"gs": 4}), (200, 256, 384, 128, {"gs": 2, "blk": 1, "mt": 256}),
    (33, 1024, 512, 128, {"mt": 64, "splits": 3}), (64, 512, 256, 128, {"mt": 64, "gs": 2}),
    # 128-k ring stages (ks = 2)
    (70, 768, 1408, 128, {"ks": 2, "mt": 64, "splits": 4}), (40, 1024, 1024, 256, {"ks": 2, "mt": 64, "blk": 1}),
    # a tail launch: the last tiles split-K after the others unsplit (tile order in groups of m tiles)
    (300, 768, 512, 128, {"mt": 128, "tail_tiles": 4, "tail_splits": 2}),
    (200, 512, 768, 128, {"blk": 1, "mt": 64, "m_group": 2, "tail_tiles": 7, "tail_splits": 3})])
def test_kernel_mirror_matches_x_at_w(fmt, dtype, m, n, k, g, override):
    rng = np.random.default_rng(m + n + k + fmt)
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    z = rng.integers(0, 17 if fmt == Q.FMT_GPTQ else 16, (k // g, n)).astype(np.uint8)  # GPTQ's zero 16 too
    s = (rng.random((k // g, n)) * 0.02 + 0.001).astype(np.float32)
    if dtype == "float16":
        s16 = s.astype(np.float16).view(np.uint16)
    else:
        s16 = (s.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16 bits
    s_f = _half_bits_to_float(s16, dtype)
    w_kn = (q.astype(np.float64) - np.repeat(z, g, axis=0)) * np.repeat(s_f, g, axis=0)
    words = Q.w4wgmma_pack_reference(q)
    recs = Q.w4wgmma_groups_reference(Q.gemv_pack_groups_reference(z, s16), n, k // g)
    x = rng.standard_normal((m, k))
    bias = rng.standard_normal(n)
    cfg = Q.w4wgmma_config(m, n, k, 132, **override)
    y, writes = _kernel_mirror(x, words, recs, m, n, k, g, cfg, dtype, bias)
    assert (writes == 1).all()
    assert np.allclose(y, x @ w_kn + bias, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------------- config, budget (CPU)

@pytest.mark.parametrize("m", [17, 33, 64, 65, 100, 128, 257, 1000, 2048, 8192])
@pytest.mark.parametrize("n,k", [(8192, 8192), (28672, 8192), (8192, 28672), (4096, 4096), (256, 128), (768, 384)])
def test_config_is_consistent_and_covers_every_stage_once(m, n, k):
    cfg = Q.w4wgmma_config(m, n, k, 132)
    assert (cfg.blk, cfg.mt, cfg.gs, cfg.ks) == Q.w4wgmma_shape(m, n, k, 132)
    assert cfg.mt in Q.W4WGMMA_SHAPES[cfg.blk] and cfg.gs in Q.W4WGMMA_GROUP_STEPS
    assert cfg.m_tiles * cfg.mt >= m > (cfg.m_tiles - 1) * cfg.mt
    assert cfg.n_tiles * 128 * cfg.blk == n
    kbs = k // 64
    assert 1 <= cfg.splits <= max(1, min(Q.W4WGMMA_MAX_SPLITS, kbs // 4))
    assert Q.w4wgmma_epilogue_bytes(cfg.mt, cfg.blk, cfg.splits) <= cfg.stages * Q.w4wgmma_stage_bytes(
        cfg.mt, cfg.blk, cfg.ks)
    assert cfg.smem == Q.w4wgmma_smem_bytes(cfg.mt, cfg.blk, cfg.stages, cfg.ks) <= Q.W4WGMMA_SMEM_LIMIT
    if cfg.grid <= 4096:
        seen = np.zeros((cfg.m_tiles, n // 64, kbs), np.int64)
        for (m_tile, split, n_tile, nb0, kb0, kb1, _) in Q.w4wgmma_work(cfg, k):
            assert kb1 > kb0  # every split has at least one stage (the ring waits on it)
            seen[m_tile, nb0:nb0 + 2 * cfg.blk, kb0:kb1] += 1
        assert (seen == 1).all()


def test_config_heuristic_choices():
    # the shape and split count of least _w4wgmma_time, with an H200's cluster capacity (120 CTAs in clusters of 4)
    caps = (132, 132, 132, 120, 130, 126, 126, 128)
    pick = lambda m, n, k, **kw: Q.w4wgmma_config(m, n, k, 132, cluster_ctas=caps, **kw)  # noqa: E731
    shape = lambda c: (c.blk, c.mt, c.gs, c.ks, c.splits)  # noqa: E731
    # M <= 64: 64-row tiles in 128-k stages; 256 channels only where their tiles alone nearly fill the GPU
    assert shape(pick(64, 8192, 8192)) == shape(pick(17, 8192, 8192)) == (1, 64, 4, 2, 2)
    assert shape(pick(64, 28672, 8192)) == (2, 64, 4, 2, 1)   # 112 tiles
    assert shape(pick(64, 8192, 28672)) == (1, 64, 4, 2, 2)   # 64 x 2 CTAs (32 x 4 do not fit in clusters of 4)
    assert shape(pick(64, 4096, 4096)) == (1, 64, 4, 2, 3)
    assert Q.w4wgmma_config(64, 4096, 4096, 132).splits == 4  # without the capacity: 32 tiles x 4
    # tile heights: few padded rows, whole waves
    assert shape(pick(192, 8192, 8192)) == (1, 192, 2, 1, 2)
    assert shape(pick(256, 8192, 8192)) == shape(pick(256, 8192, 28672)) == (1, 256, 2, 1, 2)
    assert shape(pick(256, 28672, 8192)) == (1, 256, 2, 1, 1)
    assert shape(pick(384, 8192, 8192)) == (1, 192, 2, 1, 1)   # 2 x 64 tiles of 192 rows (256 rows: 25% padding)
    c = pick(768, 8192, 8192)
    assert (c.mt, c.m_tiles, c.grid, c.tail_tiles) == (192, 4, 256, 0)  # 2 whole waves (3 x 64 tiles of 256: 1.45)
    # the tiles past the last whole wave split-K in a tail launch, for the shape chosen without one
    c = pick(512, 28672, 8192)  # 448 tiles of 256 rows: 3 waves, then 52 tiles x 2
    assert (c.mt, c.grid, c.tail_tiles, c.tail_splits, c.tail_grid) == (256, 396, 52, 2, 104)
    assert pick(512, 28672, 8192, tail_splits=1).grid == 448
    c = pick(1536, 28672, 8192)  # a tail of 24 tiles in clusters of 5 (24 x 5 <= 130 resident)
    assert (c.grid, c.tail_tiles, c.tail_splits, c.tail_grid) == (1320, 24, 5, 120)
    assert pick(256, 28672, 8192).tail_tiles == pick(2048, 4096, 4096).tail_tiles == 0  # whole waves: none
    assert pick(768, 28672, 8192).tail_tiles == 0  # 104 tiles past 6 waves: 2 splits would not fit at once
    assert Q._w4wgmma_tail(256, 28672, 8192, 132, 1, 256, 1, 0) is None  # one wave
    # forced tails (measurements, tests): the tiles past the last whole wave, or any count; splits 1 turns it off
    c = Q.w4wgmma_config(512, 28672, 8192, 132, tail_splits=4)
    assert (c.splits, c.tail_tiles, c.tail_splits) == (1, (c.m_tiles * c.n_tiles) % 132, 4)
    c = Q.w4wgmma_config(300, 768, 512, 132, mt=128, tail_tiles=4)
    assert (c.grid, c.tail_tiles, c.tail_grid) == (5, 4, 4 * c.tail_splits) and c.tail_splits > 1
    with pytest.raises(ValueError, match="tail_tiles must be 1 to 8"):
        Q.w4wgmma_config(300, 768, 512, 132, mt=128, tail_tiles=9)
    with pytest.raises(ValueError, match="unsplit first launch"):
        Q.w4wgmma_config(300, 768, 512, 132, mt=128, splits=2, tail_splits=2)
    with pytest.raises(ValueError, match="at most 8 tail_splits"):
        Q.w4wgmma_config(512, 28672, 8192, 132, tail_splits=9)
    assert pick(1024, 8192, 8192).mt == pick(2048, 4096, 4096).mt == 256
    assert shape(pick(256, 4096, 4096)) == (1, 128, 2, 1, 2)
    # the tile order: m tiles in groups where the grid takes several waves (x the bigger operand)
    c = pick(8192, 4096, 4096)
    assert (c.mt, c.m_tiles, c.n_tiles, c.m_group) == (256, 32, 32, 4)
    assert pick(256, 8192, 8192).m_group == 1 and pick(384, 8192, 8192).m_group == 2  # one wave: all m tiles
    assert Q.w4wgmma_m_group(8, 64, 1, 132, 256, 1) == 4
    assert Q.w4wgmma_m_group(8, 64, 1, 132, 64, 2) == 8  # capped at the m tiles
    # the estimate itself: more splits cost more epilogue, more waves more time
    assert Q._w4wgmma_time(256, 8192, 8192, 132, 1, 256, 2) < Q._w4wgmma_time(256, 8192, 8192, 132, 1, 256, 1)
    assert Q._w4wgmma_splits(64, 4096, 4096, 132, 1, 64, 2, caps) == [1, 2, 3]  # 32 x 4 CTAs do not fit: 120
    assert Q._w4wgmma_splits(64, 4096, 4096, 132, 1, 64, 2) == [1, 2, 3, 4]
    # every estimated choice is a shape the heuristic may take and (INT8) one that is built
    for m in (17, 100, 300, 700, 3000):
        for n, k in ((8192, 8192), (4096, 4096), (28672, 8192), (1024, 192)):
            c = Q.w4wgmma_config(m, n, k, 132, kind=Q.KIND_INT8)
            assert (c.blk, c.mt, c.gs, c.ks) in Q.W8WGMMA_VARIANTS
            assert Q.w4wgmma_shape(m, n, k, 132) in Q.W4WGMMA_CANDIDATES
    c = Q.w4wgmma_config(32, 8192, 8192, 132, splits=2)   # splits alone keep the heuristic's tile shape
    assert (c.blk, c.mt, c.gs, c.ks, c.splits) == Q.w4wgmma_shape(32, 8192, 8192, 132) + (2,)
    c = Q.w4wgmma_config(64, 1024, 192, 132, kind=Q.KIND_INT8)  # K % 128 == 64 (INT8): 64-k stages only
    assert c.ks == 1
    c = Q.w4wgmma_config(300, 8192, 8192, 132, blk=1)     # a tile override: the others at blk 2's defaults
    assert (c.blk, c.mt, c.gs) == (1, 128, 1)
    assert Q.w4wgmma_config(64, 8192, 8192, 132, splits=3).splits == 3
    assert Q.w4wgmma_config(64, 256, 128, 132, splits=9).splits == 1  # at most one split per (128-k) stage
    with pytest.raises(ValueError, match="at most 8 splits"):
        Q.w4wgmma_config(64, 8192, 8192, 132, splits=9)  # a tile's splits are one cluster of at most 8 CTAs
    assert Q.w4wgmma_config(64, 256, 128, 132, splits=9, ks=1, mt=64, blk=1, gs=2).splits == 2
    with pytest.raises(ValueError, match="gs = 4 is not built"):  # INT4 at blk = 1: gs = 4 with 128-k stages only
        Q.w4wgmma_config(64, 256, 128, 132, ks=1, mt=64, blk=1, gs=4)
    assert Q.w4wgmma_config(20, 8192, 8192, 132, mt=128).mt == 128
    with pytest.raises(ValueError):
        Q.w4wgmma_config(0, 8192, 8192, 132)
    with pytest.raises(ValueError):
        Q.w4wgmma_config(64, 8192, 8192, 132, mt=32)
    with pytest.raises(ValueError):
        Q.w4wgmma_config(64, 8192, 8192, 132, mt=256)           # 256 rows only with one block per warpgroup
    with pytest.raises(ValueError):
        Q.w4wgmma_config(64, 8192, 8192, 132, blk=3)
    with pytest.raises(ValueError):
        Q.w4wgmma_config(64, 8192, 8192, 132, blk=4)            # 512-channel CTAs: measured slower, removed
    with pytest.raises(ValueError):
        Q.w4wgmma_config(64, 8320, 8192, 132, blk=2)            # N % 256
    # blk = 1 (the override the probe sweeps): twice the channel tiles, so fewer splits for the same fill
    c = Q.w4wgmma_config(64, 28672, 8192, 132, blk=1)
    assert (c.blk, c.mt, c.n_tiles, c.splits, c.grid) == (1, 64, 224, 1, 224)
    c = Q.w4wgmma_config(256, 8192, 8192, 132, blk=1)
    assert (c.mt, c.m_tiles, c.n_tiles, c.splits, c.grid) == (128, 2, 64, 1, 128)   # M = 256 without split-K
    c = Q.w4wgmma_config(256, 8192, 8192, 132, blk=1, mt=256)
    # two ranks: 4 ring stages instead of 6, to make room for the receive buffer
    assert (c.mt, c.m_tiles, c.n_tiles, c.splits, c.stages) == (256, 1, 64, 2, 4)
    assert c.smem == Q.w4wgmma_smem_bytes(256, 1, 4) == 1024 + 4 * (37248 + 16) + 16 + 16 + 8 * 256 * 24
    c = Q.w4wgmma_config(2048, 8192, 8192, 132, blk=1, mt=256)
    assert (c.m_tiles, c.n_tiles, c.splits, c.grid, c.stages) == (8, 64, 1, 512, 6)
    with pytest.raises(TypeError):
        Q.w4wgmma_config(64, 28672, 8192, 132, streamk=1)  # the stream-K variant is gone


def test_split_epilogue_layout():
    # each rank of a split-K cluster owns an even number of row groups (stmatrix writes two at once), the fewest
    # that cover the tile; the epilogue keeps every row group's fp32 slot (read by the other ranks) and the owned
    # rows' y tile inside the ring
    for mt in (64, 96, 128, 160, 192, 256):
        j = mt // 8
        for splits in range(1, Q.W4WGMMA_MAX_SPLITS + 1):
            jmax = Q.w4wgmma_rows_per_rank(j, splits)
            assert jmax % 2 == 0 and jmax * splits >= j and (jmax - 2) * splits < j
            for blk in (1, 2):
                slots = j * blk * 256 * 16 if splits > 1 else 0
                assert Q.w4wgmma_epilogue_bytes(mt, blk, splits) == slots + 8 * jmax * 256 * blk
    assert Q.w4wgmma_epilogue_bytes(160, 1, 2) == 20 * 4096 + 80 * 256


def test_smem_budget_matches_the_kernel_layout():
    # stage: x tile (mt rows x 128 bytes) + 4 blocks x (2048 weight bytes + 192 record bytes); 2 mbarriers a stage
    assert Q.w4wgmma_stage_bytes(64) == 8192 + 4 * 2240 == 17152
    assert Q.w4wgmma_stage_bytes(128) == 16384 + 4 * 2240 == 25344
    assert Q.w4wgmma_stages(64) == Q.w4wgmma_stages(128) == 8
    # + the two-rank split-K receive buffer where it fits: its mbarrier and the owned half of the tile at 24 bits a
    # partial (mt / 32 pairs of row groups x blk blocks x 256 threads x 24 bytes)
    assert Q.W4WGMMA_SPLIT_PACK == 24
    assert Q.w4wgmma_rx_bytes(64, 2, 8) == 16 + 2 * 2 * 256 * 24 == 24592
    assert Q.w4wgmma_smem_bytes(64) == 1024 + 8 * (17152 + 16) + 16 + 24592 == 162976
    assert Q.w4wgmma_rx_bytes(160, 1, 8) == 16 + 5 * 256 * 24 and Q.w4wgmma_rx_bytes(128, 2, 8) == 0
    assert Q.w4wgmma_rx_bytes(256, 1, 6) == 0  # no room past the ring: through ring slots
    assert Q.w4wgmma_smem_bytes(128) == 1024 + 8 * (25344 + 16) + 16 == 203920
    for mt in Q.W4WGMMA_SHAPES[2]:
        assert Q.w4wgmma_smem_bytes(mt) <= 232448
        assert (mt * 128) % 1024 == 0  # x tiles keep the 128-byte swizzle's 1024-byte alignment
    # blk = 1: 2 blocks a stage
    assert Q.w4wgmma_stage_bytes(64, 1) == 8192 + 2 * 2240 == 12672
    assert Q.w4wgmma_stage_bytes(128, 1) == 16384 + 2 * 2240 == 20864
    assert Q.w4wgmma_stage_bytes(256, 1) == 32768 + 2 * 2240 == 37248
    assert Q.w4wgmma_stages(64, 1) == Q.w4wgmma_stages(128, 1) == 8 and Q.w4wgmma_stages(256, 1) == 6
    assert Q.w4wgmma_smem_bytes(256, 1) == 1024 + 6 * (37248 + 16) + 16 == 224624
    for blk, mts in Q.W4WGMMA_SHAPES.items():
        for mt in mts:
            assert Q.w4wgmma_smem_bytes(mt, blk) <= Q.W4WGMMA_SMEM_LIMIT and Q.w4wgmma_stages(mt, blk) >= 4
            assert (mt * 128) % 1024 == 0 and mt <= 256  # 1024-byte swizzle alignment; the TMA box's 256 rows


def test_supported_shapes_and_switch():
    assert Q.w4wgmma_supported(8192, 8192, 128) and Q.w4wgmma_supported(8192, 28672, 8192)
    assert not Q.w4wgmma_supported(8192, 8192 + 64, 128)   # N % 256
    assert not Q.w4wgmma_supported(8192 - 64, 8192, 128)   # K % 128
    assert not Q.w4wgmma_supported(8192, 8192, 64)         # G % 128 (the group records of the streaming copy)
    with _w4("off"):
        assert not Q.use_w4wgmma(64, 8192, 8192, 128)
    with _w4("auto"):
        assert Q.use_w4wgmma(17, 8192, 8192, 128) and Q.use_w4wgmma(1024, 28672, 8192, 128)
        assert Q.use_w4wgmma(17, 28672, 8192, 128) and Q.use_w4wgmma(17, 8192, 28672, 128)  # every layer from M = 17
        assert not Q.use_w4wgmma(16, 8192, 8192, 128) and not Q.use_w4wgmma(1025, 2048, 4096, 128)
        assert Q.use_w4wgmma(1024, 2048, 4096, 128)
        assert Q.use_w4wgmma(8192, 8192, 8192, 128) and not Q.use_w4wgmma(8193, 8192, 8192, 128)  # from N = 4096
        assert Q.use_w4wgmma(2048, 4096, 4096, 128)
        assert not Q.use_w4wgmma(256, 8192, 8192, 128, cc=(8, 0))
        # narrow layers from M = 9 (the stream kernel's two x tiles); wider ones keep it up to M = 16
        assert Q.use_w4wgmma(9, 2048, 4096, 128) and Q.use_w4wgmma(16, 1024, 8192, 128)
        assert not Q.use_w4wgmma(8, 2048, 4096, 128) and not Q.use_w4wgmma(16, 4096, 4096, 128)
    with _w4("on"):
        assert Q.use_w4wgmma(17, 8192, 8192, 128) and Q.use_w4wgmma(8192, 8192, 8192, 128)
        assert not Q.use_w4wgmma(16, 8192, 8192, 128) and not Q.use_w4wgmma(8193, 8192, 8192, 128)
        assert not Q.use_w4wgmma(64, 8192, 8192, 128, cc=(8, 0))
        assert not Q.use_w4wgmma(64, 8192, 8192, 128, cc=(10, 0))
        assert not Q.use_w4wgmma(64, 8192 + 64, 8192, 128)


def test_switch_reads_the_environment():
    import subprocess
    import sys

    code = "from speedcore import quant; print(quant._W4WGMMA_MODE)"
    for env, expect in (("1", "on"), ("0", "off"), ("", "auto"), ("auto", "auto")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**__import__("os").environ, "SPEEDCORE_QUANT_W4WGMMA": env})
        assert out.stdout.strip() == expect, out.stderr


def test_variants_listed_and_hopper_only():
    ks = [k for k in Q.all_kernels() if k.source == Q.W4WGMMA_SOURCE]
    names = {k.name for k in ks}
    assert len(ks) == 103 and all(k.hopper for k in ks)  # with the two-rank splits' shorter rings
    assert "quant_sm90::w8wgmma_pack_kernel<1>" in names
    for dt in ("__half", "__nv_bfloat16"):  # INT8 (KIND = 1): the INT4 default shapes
        for blk, mt, gs, ks_ in Q.W8WGMMA_VARIANTS:
            for splits in (1, 2):
                stages = Q.w4wgmma_stages(mt, blk, ks_, Q.KIND_INT8, splits)
                assert f"quant_sm90::w4_wgmma_kernel<{dt}, {mt}, {blk}, {stages}, {gs}, {ks_}, 1>" in names
    for dt in ("__half", "__nv_bfloat16"):  # 128-k stages at 64 rows
        for shape in ("2, 6, 1, 2", "2, 6, 4, 2", "1, 8, 1, 2", "1, 8, 4, 2"):
            assert f"quant_sm90::w4_wgmma_kernel<{dt}, 64, {shape}>" in names
    for dt in ("__half", "__nv_bfloat16"):
        for mt in Q.W4WGMMA_SHAPES[2]:
            assert f"quant_sm90::w4_wgmma_kernel<{dt}, {mt}, 2, 8>" in names
        for mt, stages in ((64, 8), (128, 8), (256, 6)):
            assert f"quant_sm90::w4_wgmma_kernel<{dt}, {mt}, 1, {stages}>" in names
        for blk, mt, stages in ((2, 64, 8), (2, 128, 8), (1, 64, 8), (1, 128, 8), (1, 256, 6)):
            for gs in (2, 4):  # wgmma groups of gs k16 steps (gs = 4 at blk = 1: 128-k stages only)
                name = f"quant_sm90::w4_wgmma_kernel<{dt}, {mt}, {blk}, {stages}, {gs}>"
                assert (name in names) == (gs == 2 or blk == 2)
        assert not any(f"<{dt}, 64, 4, " in nm for nm in names)  # no 512-channel CTAs
    assert {"quant_sm90::w4wgmma_pack_kernel<0>", "quant_sm90::w4wgmma_pack_kernel<1>"} <= names


def test_compiled_variants_use_wgmma_without_spills():
    """sm_90a: 0 spills, no serialized wgmma, and (with nvdisasm) HGMMA in the main loop and no local memory."""
    from speedcore import _compile, _sass

    shapes = [(blk, mt) for blk, mts in Q.W4WGMMA_SHAPES.items() for mt in mts]
    for blk, mt, gs in [(blk, mt, gs) for blk, mt in shapes for gs in (1, 2)]:
        c = _compile.compile_kernel(Q._w4wgmma_kernel("bfloat16", mt, blk, gs=gs), "sm_90a")
        assert c.resources["spill_stores"] == c.resources["spill_loads"] == 0, c.resources
        assert not c.resources.get("wgmma_serialized"), c.log
        if _sass.find_nvdisasm() is not None:
            text = next(iter(_sass.sass(c.cubin, "sm_90a").values()))
            assert _sass.count(text, "HGMMA") >= 4 * blk  # 4 k16 steps x blk blocks per stage
            assert _sass.count(text, "STL") == 0 and _sass.count(text, "LDL") == 0


# ---------------------------------------------------------------------------------- launch arguments (CPU)

@pytest.fixture
def fake_gpu(monkeypatch):
    return install_fake_gpu(monkeypatch, w4_copy=True)


@pytest.mark.parametrize("m", [17, 64, 257, 1000])
def test_dispatch_launch_arguments(fake_gpu, m):
    """Switch on at prepack and call: a prepacked AWQ / GPTQ layer at 17 <= M (also above MAX_MMA_M, where the dense
    path ran before) launches w4_wgmma_kernel with the x tensor map, the wgmma-major and group-record pointers and
    the configured grid, through the fast and the checked path alike; switch off at call time: not this kernel."""
    import dataclasses

    calls, maps = fake_gpu
    k, n, g = 1024, 1536, 128
    x = FakeTensor((m, k), "bfloat16")
    bias = FakeTensor((n,), "bfloat16")
    with _w4("on"):
        pw = Q.prepack_awq(FakeTensor((k, n // 8), "int32"), FakeTensor((k // g, n // 8), "int32"),
                           FakeTensor((k // g, n), "bfloat16"), group_size=g)
        assert pw.gemv.w4_ptr != 0
        Q.awq_linear(x, pw, bias=bias)
        Q.awq_linear(x, dataclasses.replace(pw, fast=None), bias=bias)
        pg = Q.prepack_gptq(FakeTensor((k // 8, n), "int32"), FakeTensor((k // g, n // 8), "int32"),
                            FakeTensor((k // g, n), "bfloat16"), group_size=g)
        Q.gptq_linear(x, pg)
    cfg = Q.w4wgmma_config(m, n, k, 132)
    assert len(calls) == 3
    for kernel, lcfg, args in calls:
        assert kernel.name == Q._w4wgmma_kernel("bfloat16", cfg.mt, cfg.blk, cfg.stages, gs=cfg.gs, ks=cfg.ks).name
        assert kernel.hopper and kernel.name.startswith(f"quant_sm90::w4_wgmma_kernel<__nv_bfloat16, {cfg.mt}, ")
        assert tuple(lcfg.grid) == (cfg.grid,) and tuple(lcfg.block) == (384,) and lcfg.smem == cfg.smem
        assert len(args) == 14 and args[0] == "tmap"
        assert [int(a) for a in args[5:]] == [m, n, k // (64 * cfg.ks), g // 64, k // g, cfg.m_tiles, cfg.splits,
                                            cfg.m_group or cfg.m_tiles, 0]
        assert all(type(a) is np.int32 for a in args[5:])
        assert lcfg.cluster == cfg.splits  # a tile's splits are one cluster
    assert calls[0][2][2] == pw.gemv.w4_ptr and calls[0][2][3] == pw.gemv.w4_g_ptr and calls[0][2][4] == bias.ptr
    assert pw.gemv.w4_g_ptr not in (0, pw.gemv.g_ptr)  # the group-major copy of the records
    assert calls[2][2][2] == pg.gemv.w4_ptr and calls[2][2][4] == 0
    for u, v in zip(calls[0][2], calls[1][2]):
        assert type(u) is type(v) and u == v
    assert maps[0][1] == dict(rows=m, cols=k, row_stride=k, box_rows=cfg.mt, box_cols=64)
    calls.clear()
    if m <= Q.MAX_MMA_M:
        with _w4("off"):
            Q.awq_linear(x, pw, bias=bias)
        assert calls and "w4_wgmma" not in calls[0][0].name
    with _w4("off"):
        p_off = Q.prepack_awq(FakeTensor((k, n // 8), "int32"), FakeTensor((k // g, n // 8), "int32"),
                              FakeTensor((k // g, n), "bfloat16"), group_size=g)
    assert p_off.gemv.w4_ptr == 0  # prepacked with the switch off: no wgmma-major copy


@pytest.mark.parametrize("m,override,name", [
    (100, {"blk": 1}, "w4_wgmma_kernel<__half, 128, 1, 8>"),
    (300, {"blk": 1, "mt": 256, "splits": 2}, "w4_wgmma_kernel<__half, 256, 1, 4>"),  # 4 stages + receive buffer
    (64, {"gs": 4, "blk": 2}, "w4_wgmma_kernel<__half, 64, 2, 8, 4>"),
    (300, {"gs": 2, "blk": 1, "mt": 256}, "w4_wgmma_kernel<__half, 256, 1, 6, 2>")])
def test_override_launch_arguments(fake_gpu, m, override, name):
    """_W4WGMMA_OVERRIDE reaches the launch: the blk = 1 / gs variants, their grid (twice the channel tiles at
    blk = 1), the cluster of a split tile, the tile height in the x tensor map's box, and the default shape again once
    the override is gone."""
    calls, maps = fake_gpu
    k, n, g = 1024, 1536, 128
    x = FakeTensor((m, k), "float16")
    with _w4("on", **override):
        pw = Q.prepack_awq(FakeTensor((k, n // 8), "int32"), FakeTensor((k // g, n // 8), "int32"),
                           FakeTensor((k // g, n), "float16"), group_size=g)
        Q.awq_linear(x, pw)
    with _w4("on"):
        Q.awq_linear(x, pw)
    cfg = Q.w4wgmma_config(m, n, k, 132, **override)
    assert cfg.n_tiles == n // (128 * cfg.blk)
    (kernel, lcfg, args), (kernel2, _, _) = calls
    assert kernel.name == "quant_sm90::" + name and tuple(lcfg.grid) == (cfg.grid,) and lcfg.smem == cfg.smem
    assert [int(a) for a in args[5:]] == [m, n, k // 64, g // 64, k // g, cfg.m_tiles, cfg.splits,
                                            cfg.m_group or cfg.m_tiles, 0]
    assert lcfg.cluster == cfg.splits
    assert maps[0][1]["box_rows"] == cfg.mt
    d = Q.w4wgmma_config(m, n, k, 132)
    assert kernel2.name == Q._w4wgmma_kernel("float16", d.mt, d.blk, d.stages, gs=d.gs, ks=d.ks).name


def test_tail_launch_arguments(fake_gpu):
    """A config with a tail launches w4_wgmma_kernel twice on the same stream: the first tiles unsplit from tile 0,
    then the tail's tiles in clusters of tail_splits from the first tail tile (the kernel's tile_base)."""
    calls, maps = fake_gpu
    k, n, g, m = 1024, 1536, 128, 300
    override = {"mt": 128, "tail_tiles": 4, "tail_splits": 3}
    x = FakeTensor((m, k), "bfloat16")
    with _w4("on", **override):
        pw = Q.prepack_awq(FakeTensor((k, n // 8), "int32"), FakeTensor((k // g, n // 8), "int32"),
                           FakeTensor((k // g, n), "bfloat16"), group_size=g)
        Q.awq_linear(x, pw)
    cfg = Q.w4wgmma_config(m, n, k, 132, **override)
    assert (cfg.m_tiles * cfg.n_tiles, cfg.grid, cfg.tail_grid) == (18, 14, 12)
    (k1, l1, a1), (k2, l2, a2) = calls
    assert k1.name == k2.name and l1.smem == l2.smem == cfg.smem
    assert (tuple(l1.grid), l1.cluster, tuple(l2.grid), l2.cluster) == ((14,), 1, (12,), 3)
    assert not l1.overlap and l2.overlap  # the tail may start while the first launch's last CTAs run
    assert a1[:5] == a2[:5] and len(a1) == len(a2) == 14
    assert [int(a) for a in a1[10:]] == [cfg.m_tiles, 1, cfg.m_group or cfg.m_tiles, 0]
    assert [int(a) for a in a2[10:]] == [cfg.m_tiles, 3, cfg.m_group or cfg.m_tiles, 14]


def test_w8_copy_without_fragment_major_copy(fake_gpu):
    """K % 128 != 0 (no streaming kernel, and gemv_kernel is off for INT8): with the W8 switch on, prepack_int8 makes
    the wgmma-major copy alone (w_ptr = 0), M <= 16 takes quant_mma_kernel, M = 17 the INT8 w4_wgmma_kernel."""
    calls, _ = fake_gpu
    k, n = 320, 768
    old = Q._W8WGMMA_MODE
    try:
        Q._W8WGMMA_MODE = "on"
        pw = Q.prepack_int8(FakeTensor((n, k), "int8"), FakeTensor((n,), "bfloat16"))
        assert pw.gemv is not None and pw.gemv.w_ptr == 0 and pw.gemv.w4_ptr != 0
        calls.clear()
        Q.int8_linear(FakeTensor((8, k), "bfloat16"), pw)
        assert len(calls) == 1 and "quant_mma_kernel" in calls[0][0].name, [c[0].name for c in calls]
        calls.clear()
        Q.int8_linear(FakeTensor((17, k), "bfloat16"), pw)
        assert len(calls) == 1 and "w4_wgmma_kernel" in calls[0][0].name, [c[0].name for c in calls]
        Q._W8WGMMA_MODE = "off"
        assert Q.prepack_int8(FakeTensor((n, k), "int8"), FakeTensor((n,), "bfloat16")).gemv is None
    finally:
        Q._W8WGMMA_MODE = old


@pytest.mark.parametrize("m", [17, 64, 300])
def test_w8_launch_arguments(fake_gpu, m):
    """INT8 with the W8 switch on: prepack_int8 keeps the wgmma-major INT8 copy, and int8_linear launches the INT8
    w4_wgmma_kernel (also above MAX_MMA_M, where the dense path ran) with the per-channel scales in the records'
    place and no groups; switch off: neither."""
    calls, maps = fake_gpu
    k, n = 1024, 1536
    x = FakeTensor((m, k), "bfloat16")
    old = Q._W8WGMMA_MODE
    try:
        Q._W8WGMMA_MODE = "on"
        pw = Q.prepack_int8(FakeTensor((n, k), "int8"), FakeTensor((n,), "bfloat16"))
        assert pw.gemv is not None and pw.gemv.w4_ptr != 0 and pw.gemv.w4_g_ptr == 0
        Q.int8_linear(x, pw)
        cfg = Q.w4wgmma_config(m, n, k, 132, kind=Q.KIND_INT8)
        (kernel, lcfg, args), = calls
        assert kernel.name == Q._w4wgmma_kernel("bfloat16", cfg.mt, cfg.blk, cfg.stages, gs=cfg.gs, ks=cfg.ks,
                                                kind=Q.KIND_INT8).name and kernel.name.endswith(", 1>")
        assert tuple(lcfg.grid) == (cfg.grid,) and lcfg.smem == cfg.smem
        assert args[2] == pw.gemv.w4_ptr and args[3] == pw.fast.scales_ptr != 0
        assert [int(a) for a in args[5:]] == [m, n, k // (64 * cfg.ks), 1, 1, cfg.m_tiles, cfg.splits,
                                            cfg.m_group or cfg.m_tiles, 0]
        calls.clear()
        Q._W8WGMMA_MODE = "off"
        if m <= Q.MAX_MMA_M:  # (above, the dense path, which the fakes cannot run)
            Q.int8_linear(x, pw)
            assert calls and "w4_wgmma" not in calls[0][0].name
    finally:
        Q._W8WGMMA_MODE = old


# -------------------------------------------------------------------------------------------------- GPU tests

def _torch():
    return pytest.importorskip("torch")


def _w4wgmma_name(dtype, m, n, k, override):
    """The variant w4_wgmma_kernel launches for (M, N, K) under ``override`` on this GPU."""
    import torch

    cfg = Q.w4wgmma_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count, **override)
    return Q._w4wgmma_kernel(dtype, cfg.mt, cfg.blk, cfg.stages, gs=cfg.gs, ks=cfg.ks).name


def _layer(torch, fmt, n, k, g, td, rng):
    """Random AWQ / GPTQ tensors (every nibble; GPTQ zero points up to 16), prepacked with the switch on; float W."""
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    ng = k // g
    q = rng.integers(0, 16, (k, n))
    z = rng.integers(0, 16, (ng, n))
    s_t = t((rng.random((ng, n)) * 0.02 + 0.001).astype(np.float16)).to(td)
    s_f = s_t.float().cpu().numpy()
    if fmt == Q.FMT_AWQ:
        args = (t(Q.pack_awq(q)), t(Q.pack_awq(z)), s_t)
        return Q.prepack_awq(*args, group_size=g), Q.dequantize_awq_reference(Q.pack_awq(q), Q.pack_awq(z), s_f, g)
    args = (t(Q.pack_rows(q)), t(Q.pack_cols(z)), s_t)
    return Q.prepack_gptq(*args, group_size=g), Q.dequantize_gptq_reference(Q.pack_rows(q), Q.pack_cols(z), s_f,
                                                                             None, g)


def _ref(x, w_kn, bias=None):
    r = x.float().cpu().numpy().astype(np.float64) @ w_kn.astype(np.float64)
    if bias is not None:
        r = r + bias.float().cpu().numpy()
    return r


def _poisoned_calls(torch, call, shape, td, ref, count=3):
    """``call()`` ``count`` times, each right after a NaN-filled block of the output's shape was freed (an element the
    kernel misses shows), each launching w4_wgmma_kernel and within 1e-2 per row of ``ref``.  Returns the outputs
    and each call's launched kernel names."""
    ys, launches = [], []
    for _ in range(count):
        poison = torch.full(shape, float("nan"), device="cuda", dtype=td)
        del poison
        with launched() as names:
            ys.append(call())
        assert any("w4_wgmma_kernel" in nm for nm in names), names
        assert _row_err(ys[-1], ref) < 1e-2
        launches.append(names)
    return ys, launches


def _row_err(y, ref):
    yf = y.float().cpu().numpy().astype(np.float64)
    assert np.isfinite(yf).all()
    return (np.linalg.norm(yf - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)).max()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [Q.FMT_AWQ, Q.FMT_GPTQ])
def test_pack_kernel_matches_reference_small(fmt):
    torch = _torch()
    rng = np.random.default_rng(7 + fmt)
    k, n, g = 512, 768, 128
    with _w4("on"):
        layer, _ = _layer(torch, fmt, n, k, g, torch.float16, rng)
    assert layer.gemv is not None and layer.gemv.w4_ptr != 0
    qw = layer.qweight.cpu().numpy()
    q = Q.unpack_awq(qw) if fmt == Q.FMT_AWQ else Q.unpack_rows(qw)
    got = layer.gemv.w4_weight.cpu().numpy().view(np.uint32)
    assert np.array_equal(got, Q.w4wgmma_pack_reference(q))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fmt", [Q.FMT_AWQ, Q.FMT_GPTQ])
@pytest.mark.parametrize("m,n,k,g,override", [
    (17, 512, 1024, 128, {}), (33, 768, 2048, 256, {}), (100, 256, 640, 128, {"splits": 3}),
    (257, 1024, 1024, 128, {}), (1000, 512, 512, 128, {}), (64, 4096, 4096, 128, {}), (40, 256, 128, 128, {}),
    (300, 2048, 2048, 128, {"splits": 4}), (64, 8192, 1024, 1024, {"mt": 128}),
    (200, 512, 1024, 128, {"mt": 128, "splits": 2})])
def test_w4wgmma_small(dtype, fmt, m, n, k, g, override):
    """Odd M (x rows past M zero-filled by TMA, masked stores; several m tiles), split-K (chosen and forced),
    groups of one and several stages, one-stage-per-split K, both tile heights; against float64 x @ W (per-row
    rel err 1e-2), outputs poisoned with NaN, three calls (bit-identical), a strided 3-D view of x with bias,
    and the same layer through today's dispatch (switch off at call time)."""
    torch = _torch()
    td = getattr(torch, dtype)
    rng = np.random.default_rng(m * 31 + n + k + fmt)
    with _w4("on", **override):
        layer, w_kn = _layer(torch, fmt, n, k, g, td, rng)
        x = torch.randn(m, k, device="cuda", dtype=td)
        ys, _ = _poisoned_calls(torch, lambda: _linear(fmt, x, layer), (m, n), td, _ref(x, w_kn))
        y = ys[-1]
        assert all(torch.equal(ys[0], v) for v in ys[1:])  # split-K sums in rank order: the same bits every call
        xb = torch.randn(m, k + 64, device="cuda", dtype=td)[:, 32:32 + k]
        bias = torch.randn(n, device="cuda", dtype=td)
        with launched() as names:
            y3 = _linear(fmt, xb.reshape(1, m, k), layer, bias)
        assert any("w4_wgmma_kernel" in nm for nm in names), names
        assert y3.shape == (1, m, n)
        assert _row_err(y3.reshape(m, n), _ref(xb, w_kn, bias)) < 1e-2
    with _w4("off"):
        y_old = _linear(fmt, x, layer)
    assert (y.float() - y_old.float()).abs().max().item() <= 2e-2 * y_old.float().abs().max().item() + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k", [(9, 1024, 4096), (16, 2048, 1024), (12, 512, 2048)])
def test_w4wgmma_narrow_layers_from_m9(dtype, m, n, k):
    """Today's dispatch ("auto") takes w4_wgmma_kernel from M = 9 on layers of N <= 2048: right answers there."""
    torch = _torch()
    td = getattr(torch, dtype)
    rng = np.random.default_rng(m + n + k)
    with _w4("auto"):
        layer, w_kn = _layer(torch, Q.FMT_AWQ, n, k, 128, td, rng)
        x = torch.randn(m, k, device="cuda", dtype=td)
        _poisoned_calls(torch, lambda: _linear(Q.FMT_AWQ, x, layer), (m, n), td, _ref(x, w_kn))  # launches, checks


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fmt", [Q.FMT_AWQ, Q.FMT_GPTQ])
@pytest.mark.parametrize("m,n,k,g,override", [
    (17, 512, 1024, 128, {"blk": 1}), (100, 256, 640, 128, {"blk": 1, "splits": 3}),
    (257, 768, 1024, 256, {"blk": 1, "mt": 128}), (300, 512, 2048, 128, {"blk": 1, "mt": 256}),
    (513, 256, 1024, 128, {"blk": 1, "mt": 256, "splits": 4}), (40, 1024, 512, 128, {"blk": 1, "mt": 256}),
    (150, 512, 1024, 128, {"blk": 1, "mt": 192}), (385, 256, 1152, 128, {"blk": 1, "mt": 192, "splits": 3, "gs": 2}),
    (300, 512, 1024, 128, {"blk": 1, "mt": 256, "splits": 2}),
    (77, 768, 1024, 128, {"blk": 1, "mt": 96, "gs": 2, "splits": 2}), (170, 256, 896, 128, {"blk": 1, "mt": 160}),
    # several waves: m tiles in groups of 8 (32 m tiles; 21, the last group of 5)
    (2000, 1024, 512, 128, {"blk": 1, "mt": 64, "gs": 4, "ks": 2}), (1300, 1536, 512, 128, {"blk": 1, "mt": 64, "gs": 2})])
def test_w4wgmma_blk1_small(dtype, fmt, m, n, k, g, override):
    """The blk = 1 variants (128-channel CTAs; mt 64 / 96 / 128 / 160 / 192 / 256) forced through _W4WGMMA_OVERRIDE:
    odd M (partial m tiles, a 256-row box over 40 rows), split-K, multi-wave grids in m groups, both dtypes, AWQ and
    GPTQ; against float64 x @ W with NaN-poisoned outputs, twice, a strided view with bias, and against blk = 2 on
    the same layer (within 2e-2 of the largest output)."""
    torch = _torch()
    td = getattr(torch, dtype)
    rng = np.random.default_rng(m * 17 + n + k + fmt)
    with _w4("on", **override):
        layer, w_kn = _layer(torch, fmt, n, k, g, td, rng)
        x = torch.randn(m, k, device="cuda", dtype=td)
        ref = _ref(x, w_kn)
        for _ in range(2):
            poison = torch.full((m, n), float("nan"), device="cuda", dtype=td)
            del poison  # the output is allocated from this freed NaN block
            with launched() as names:
                y = _linear(fmt, x, layer)
            cfg = Q.w4wgmma_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count, **override)
            assert any(f"w4_wgmma_kernel<{Q.A.CTYPE[dtype]}, {cfg.mt}, 1, " in nm for nm in names), names
            assert _row_err(y, ref) < 1e-2
        xb = torch.randn(m, k + 64, device="cuda", dtype=td)[:, 64:64 + k]
        bias = torch.randn(n, device="cuda", dtype=td)
        y3 = _linear(fmt, xb, layer, bias)
        assert _row_err(y3, _ref(xb, w_kn, bias)) < 1e-2
    with _w4("on", blk=2):
        with launched() as names:
            y_def = _linear(fmt, x, layer)
        c2 = Q.w4wgmma_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count, blk=2)
        assert any(f", 2, {c2.stages}>" in nm for nm in names), names
    assert (y.float() - y_def.float()).abs().max().item() <= 2e-2 * y_def.float().abs().max().item() + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k,g,override", [
    (17, 512, 1024, 128, {"gs": 2}), (100, 256, 640, 128, {"gs": 4, "splits": 3}),
    (70, 768, 1408, 128, {"gs": 4, "mt": 64, "splits": 4}), (300, 512, 2048, 128, {"gs": 2, "blk": 1, "mt": 256}),
    (257, 256, 1152, 384, {"gs": 2, "blk": 1, "mt": 128, "splits": 2}), (129, 256, 768, 256, {"gs": 4, "splits": 5}),
    (40, 1024, 1024, 128, {"gs": 2, "blk": 2, "mt": 64, "splits": 3}),
    # 128-k ring stages (ks = 2): 11 stages split 4 ways, groups of 1 and 4 steps (2 per stage)
    (70, 768, 1408, 128, {"ks": 2, "mt": 64, "gs": 4, "splits": 4}), (17, 512, 1024, 256, {"ks": 2, "mt": 64,
                                                                                           "blk": 1, "gs": 4}),
    (100, 1024, 1408, 128, {"ks": 2, "mt": 64, "blk": 2, "gs": 1, "splits": 3})])
def test_w4wgmma_group_steps_small(dtype, m, n, k, g, override):
    """wgmma groups of 2 / 4 k16 steps (gs) forced through _W4WGMMA_OVERRIDE, with odd stage counts and split-K
    ranges that begin on odd stages (the A set of gs = 4 follows the stage's parity): against float64 x @ W with
    NaN-poisoned outputs, and bit-identical to gs = 1 of the same shape (the same wgmmas in the same order)."""
    torch = _torch()
    td = getattr(torch, dtype)
    rng = np.random.default_rng(m * 7 + n + k)
    base = {**override, "gs": 1}
    with _w4("on", **override):
        layer, w_kn = _layer(torch, Q.FMT_AWQ, n, k, g, td, rng)
        x = torch.randn(m, k, device="cuda", dtype=td)
        bias = torch.randn(n, device="cuda", dtype=td)
        poison = torch.full((m, n), float("nan"), device="cuda", dtype=td)
        del poison
        with launched() as names:
            y = _linear(Q.FMT_AWQ, x, layer, bias)
        assert _w4wgmma_name(dtype, m, n, k, override) in names, names
        assert _row_err(y, _ref(x, w_kn, bias)) < 1e-2
    with _w4("on", **base):
        with launched() as names:
            y1 = _linear(Q.FMT_AWQ, x, layer, bias)
        assert _w4wgmma_name(dtype, m, n, k, base) in names, names
    assert torch.equal(y, y1)


@contextlib.contextmanager
def _w8(mode):
    old = Q._W8WGMMA_MODE
    Q._W8WGMMA_MODE = mode
    try:
        yield
    finally:
        Q._W8WGMMA_MODE = old


@pytest.mark.gpu
def test_w8_pack_kernel_matches_reference_small():
    torch = _torch()
    rng = np.random.default_rng(21)
    n, k = 768, 320
    w = rng.integers(-128, 128, (n, k)).astype(np.int8)
    with _w8("on"):
        layer = Q.prepack_int8(torch.from_numpy(w).cuda(), torch.ones(n, device="cuda", dtype=torch.bfloat16))
    assert layer.gemv is not None and layer.gemv.w4_ptr != 0
    got = layer.gemv.w4_weight.cpu().numpy().view(np.uint32)
    assert np.array_equal(got, Q.w8wgmma_pack_reference(w))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k,override", [
    (17, 512, 1024, {}), (64, 768, 2048, {}), (100, 256, 640, {"splits": 3}), (130, 1024, 512, {}),
    (300, 512, 1024, {}), (1000, 256, 256, {}), (40, 2048, 1024, {"gs": 1}), (257, 512, 768, {"blk": 1, "mt": 256}),
    (300, 1024, 1024, {"tail_tiles": 3, "tail_splits": 2})])
def test_w8wgmma_small(dtype, m, n, k, override):
    """INT8 on w4_wgmma_kernel (switch on at prepack and call): every byte value, per-channel scales, bias, odd M
    (also above MAX_MMA_M, instead of the dense path), split-K, a tail launch; NaN-poisoned outputs, twice; against
    float64 x @ (q s)^T per row (1e-2), and within 2e-2 of the switch-off path on the same layer."""
    torch = _torch()
    td = getattr(torch, dtype)
    rng = np.random.default_rng(m * 5 + n + k)
    q = ((np.arange(n * k) * 37 + rng.integers(0, 256)) % 256 - 128).astype(np.int8).reshape(n, k)
    s_t = torch.from_numpy((rng.random(n) * 0.02 + 0.001).astype(np.float32)).cuda().to(td)
    w_nk = q.astype(np.float64) * s_t.double().cpu().numpy()[:, None]
    x = torch.randn(m, k, device="cuda", dtype=td)
    bias = torch.randn(n, device="cuda", dtype=td)
    ref = (x.double().cpu().numpy() @ w_nk.T) + bias.double().cpu().numpy()
    with _w8("on"), _w4("on", **override):
        layer = Q.prepack_int8(torch.from_numpy(q).cuda(), s_t)
        assert layer.gemv is not None and layer.gemv.w4_ptr != 0
        for _ in range(2):
            poison = torch.full((m, n), float("nan"), device="cuda", dtype=td)
            del poison
            with launched() as names:
                y = Q.int8_linear(x, layer, bias=bias)
            assert any("w4_wgmma_kernel" in nm and nm.endswith(", 1>") for nm in names), names
            err = (torch.from_numpy(ref) - y.double().cpu()).norm(dim=1) / torch.from_numpy(ref).norm(dim=1)
            assert bool(torch.isfinite(y).all()) and err.max().item() < 1e-2
    with _w8("off"):
        y_old = Q.int8_linear(x, layer, bias=bias)
    assert (y.float() - y_old.float()).abs().max().item() <= 2e-2 * y_old.float().abs().max().item() + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("override", [{}, {"splits": 3}])
def test_w4wgmma_exact_rows_small(override):
    """x = one-hot rows pick rows of W exactly (every nibble, zero point, power-of-two scale), fp16 and bf16."""
    torch = _torch()
    rng = np.random.default_rng(31)
    k, n, g = 1024, 512, 128
    with _w4("on", **override):
        for fmt in (Q.FMT_AWQ, Q.FMT_GPTQ):
            for td in (torch.float16, torch.bfloat16):
                layer, _ = _layer(torch, fmt, n, k, g, td, rng)
                layer, w_kn = pow2_scaled(torch, fmt, layer, k, n, g, td, rng)
                assert_picks_rows(torch, fmt, layer, w_kn, td, (slice(0, 17), slice(960, 1024), slice(101, 230)),
                                  "w4_wgmma_kernel")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m", [17, 257])
def test_w4wgmma_gptq_act_order_small(dtype, m):
    """Act-order GPTQ: prepack_gptq repacks the rows in group order (the wgmma-major copy is built from that), x is
    gathered per call, then w4_wgmma_kernel; against float64 x @ W with the checkpoint's g_idx."""
    torch = _torch()
    td = getattr(torch, dtype)
    n, k, g = 512, 1024, 128
    rng = np.random.default_rng(m + 9)
    args, ref_w = act_order_gptq(torch, td, rng, n, k, g)
    with _w4("on"):
        packed = Q.prepack_gptq(*args, group_size=g)
        assert packed.perm is not None and packed.gemv is not None and packed.gemv.w4_ptr != 0
        x = torch.randn(m, k, device="cuda", dtype=td)
        with launched() as names:
            y = Q.gptq_linear(x, packed)
        assert any("w4_wgmma_kernel" in nm for nm in names), names
    assert _row_err(y, _ref(x, ref_w)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k,override", [
    (320, 12288, 4096, {}),  # the heuristic's own tail: 2 x 96 tiles of 160 rows, the last 60 in clusters of 2
    (300, 2048, 2048, {"mt": 128, "tail_tiles": 5, "tail_splits": 3}),
    (2000, 1024, 512, {"blk": 1, "mt": 64, "gs": 4, "ks": 2, "tail_tiles": 9, "tail_splits": 4}),  # across m groups
    (1000, 512, 512, {"tail_tiles": 3, "tail_splits": 2})])                                # 128-k stages
def test_w4wgmma_tail_small(dtype, m, n, k, override):
    """The tail launch (the last tiles split-K in a second launch from tile_base): planned where the estimate says
    so, NaN-poisoned output, against float64 x @ W per row (1e-2), the same bits on three calls, and within 2e-2 of
    the same layer without a tail."""
    torch = _torch()
    td = getattr(torch, dtype)
    rng = np.random.default_rng(m + n + k)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with _w4("on", **override):
        plan = Q._w4wgmma_plan(dtype, m, n, k, 128, 0, sms, tuple(sorted(Q._W4WGMMA_OVERRIDE.items())))
        assert plan[0].tail_tiles > 0 and plan[4] is not None, plan[0]
        layer, w_kn = _layer(torch, Q.FMT_AWQ, n, k, 128, td, rng)
        x = torch.randn(m, k, device="cuda", dtype=td)
        ys, names = _poisoned_calls(torch, lambda: Q.awq_linear(x, layer), (m, n), td, _ref(x, w_kn))
        assert all(sum("w4_wgmma_kernel" in nm for nm in c) == 2 for c in names), names
        assert all(torch.equal(ys[0], v) for v in ys[1:])
    with _w4("on", **{**override, "tail_splits": 1, "tail_tiles": 0}):
        with launched() as names:
            y_one = Q.awq_linear(x, layer)
        assert sum("w4_wgmma_kernel" in nm for nm in names) == 1, names
    assert (ys[0].float() - y_one.float()).abs().max().item() <= 2e-2 * y_one.float().abs().max().item() + 1e-3


@pytest.mark.gpu
def test_w4wgmma_tail_in_cuda_graph():
    """A layer whose launch has a tail (its second launch a programmatic dependent launch) captured by
    torch.cuda.graph: replays with new inputs match float64, and a kernel reading y right after sees all of it."""
    torch = _torch()
    rng = np.random.default_rng(43)
    m, n, k = 300, 2048, 2048
    with _w4("on", mt=128, tail_tiles=5, tail_splits=3):
        layer, w_kn = _layer(torch, Q.FMT_AWQ, n, k, 128, torch.bfloat16, rng)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile outside the capture
            Q.awq_linear(x, layer)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = Q.awq_linear(x, layer)
            total = y.float().sum(dim=1)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            ref = _ref(x, w_kn)
            assert _row_err(y, ref) < 1e-2
            assert torch.allclose(total, y.float().sum(dim=1), rtol=0, atol=0)


@pytest.mark.gpu
def test_cluster_capacity_query():
    """cuOccupancyMaxActiveClusters through _launch: one CTA per SM alone; clusters of s fill whole multiples of s
    and never more SMs than the GPU has; a launch config's plan never asks for more CTAs than fit."""
    torch = _torch()
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("thread-block clusters need sm_90")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = Q.w4wgmma_config(64, 4096, 4096, sms)
    kern = Q._w4wgmma_kernel("bfloat16", cfg.mt, cfg.blk, cfg.stages, gs=cfg.gs, ks=cfg.ks)
    caps = Q._w4_cluster_ctas(kern, 0, cfg.smem)
    assert caps[0] == sms
    for s, c in enumerate(caps, start=1):
        assert c % s == 0 and sms - 8 * s < c <= sms, caps
    planned = Q._w4wgmma_plan("bfloat16", 64, 4096, 4096, 128, 0, sms, ())[0]
    assert planned.grid <= caps[planned.splits - 1]


@pytest.mark.gpu
def test_w4wgmma_memcheck_case_small():
    """Small launches for compute-sanitizer (benchmarks/_quant_w4tune_gpu.sh):
    split-K with a partial m tile, a 2-m-tile direct store, the blk = 1 variants (mt 256 split over 70 rows;
    mt 64 direct; mt 96 / 160 / 192; two-rank splits by pushes into the receive buffer and through ring slots),
    groups of 4 k16 steps over a split starting on an odd stage, and a
    multi-wave grid in groups of m tiles (tile_coords) with a smaller last group, a tail launch."""
    torch = _torch()
    rng = np.random.default_rng(5)
    cases = ((33, 512, 512, {"splits": 2}), (150, 256, 256, {}), (70, 256, 512, {"blk": 1, "mt": 256, "splits": 2}),
             (33, 512, 256, {"blk": 1}), (70, 1280, 640, {"gs": 4, "splits": 3}),
             (150, 512, 512, {"gs": 2, "blk": 1, "mt": 256}), (170, 256, 384, {"blk": 1, "mt": 160, "gs": 2}),
             (100, 512, 512, {"blk": 1, "mt": 96, "gs": 2, "splits": 2}),
             (150, 512, 1024, {"blk": 1, "mt": 160, "gs": 2, "splits": 2}),
             (200, 256, 512, {"blk": 1, "mt": 192, "gs": 2, "splits": 2}),
             (1300, 1536, 256, {"blk": 1, "mt": 64, "gs": 2}),
             (300, 1024, 512, {"mt": 128, "tail_tiles": 3, "tail_splits": 2}))
    for (m, n, k, override) in cases:
        with _w4("on", **override):
            layer, w_kn = _layer(torch, Q.FMT_AWQ, n, k, 128, torch.bfloat16, rng)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            with launched() as names:
                y = Q.awq_linear(x, layer)
            assert any("w4_wgmma_kernel" in nm for nm in names), names
            torch.cuda.synchronize()
        assert _row_err(y, _ref(x, w_kn)) < 1e-2


@pytest.mark.gpu
def test_quantized_linear_in_cuda_graph():
    """Prepacked INT4 layers captured by torch.cuda.graph (the M = 1 streaming kernel with split-K partials and
    w4_wgmma_kernel at M = 64) replay correctly with new inputs."""
    torch = _torch()
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("w4_wgmma_kernel needs sm_90")
    rng = np.random.default_rng(41)
    n, k, g = 4096, 4096, 128
    with _w4("on"):
        layer, w_kn = _layer(torch, Q.FMT_AWQ, n, k, g, torch.bfloat16, rng)
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in (1, 64)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile outside the capture
            for x in xs:
                _linear(Q.FMT_AWQ, x, layer)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ys = [_linear(Q.FMT_AWQ, x, layer) for x in xs]
        for _ in range(2):
            for x in xs:
                x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            for x, y in zip(xs, ys):
                assert _row_err(y, _ref(x, w_kn)) < 1e-2
