"""The prepacked layouts in NumPy (for tests): what the pack kernels make, and inverses written from the
consumer kernels' side (fragment-major INT4 / INT8 and group records; wgmma-major INT4 / INT8)."""
from __future__ import annotations

import numpy as np

from .gemv import GEMV_GROUP_BYTES


def w4wgmma_pack_reference(q) -> np.ndarray:
    """The wgmma-major INT4 layout of q (K, N) values 0..15, as uint32 words (NumPy; what w4wgmma_pack_kernel makes
    on the GPU; N % 256 == 0).  Word [b // 4, kb, b % 4, t, lane, s] (lane = 4 g + c; super-blocks of 4 blocks,
    stage-major inside) holds channels n0 = 64 b + 16 t + g and n0 + 8 at
    k = 64 kb + 16 s + {2c, 2c+1, 2c+8, 2c+9}: nibble i = r + 4 e is channel n0 + 8 (r % 2), k offset
    2 c + e + 8 (r // 2)."""
    q = np.asarray(q, np.uint32)
    k, n = q.shape
    nb, kbs = n // 64, k // 64
    # q as (kb, s, p, c, e, b, t, j, g): k = 64 kb + 16 s + 8 p + 2 c + e, n = 64 b + 16 t + 8 j + g
    v = q.reshape(kbs, 4, 2, 4, 2, nb, 4, 2, 8)
    words = np.zeros((nb // 4, kbs, 4, 4, 8, 4, 4), np.uint32)  # [b // 4, kb, b % 4, t, g, c, s]
    for i in range(8):
        r, e = i % 4, i // 4
        part = v[:, :, r // 2, :, e, :, :, r % 2, :]     # (kb, s, c, b, t, g)
        part = part.reshape(kbs, 4, 4, nb // 4, 4, 4, 8)  # (kb, s, c, b // 4, b % 4, t, g)
        words |= part.transpose(3, 0, 4, 5, 6, 2, 1) << np.uint32(4 * i)
    return words.reshape(-1)


def w8wgmma_pack_reference(w) -> np.ndarray:
    """The wgmma-major INT8 layout of an int8 weight (N, K) as uint32 words (NumPy; what w8wgmma_pack_kernel makes;
    N % 256 == 0, K % 64 == 0).  Word [b // 4, kc, b % 4, t, lane, s, h] (lane = 4 g + c) holds channel
    n = 64 b + 16 t + g + 8 h at k = 64 kc + 16 s + (2 c, 2 c + 1, 2 c + 8, 2 c + 9) in bytes 0-3."""
    w = np.asarray(w, np.int8).view(np.uint8).astype(np.uint32)
    n, k = w.shape
    # w as (sb, b4, t, h, g, kc, s, p, c, e): n = 64 (4 sb + b4) + 16 t + 8 h + g, k = 64 kc + 16 s + 8 p + 2 c + e
    v = w.reshape(n // 256, 4, 4, 2, 8, k // 64, 4, 2, 4, 2)
    words = np.zeros((n // 256, k // 64, 4, 4, 8, 4, 4, 2), np.uint32)  # [sb, kc, b4, t, g, c, s, h]
    for byte in range(4):
        p, e = byte // 2, byte % 2
        part = v[:, :, :, :, :, :, :, p, :, e]            # (sb, b4, t, h, g, kc, s, c)
        words |= part.transpose(0, 5, 1, 2, 4, 7, 6, 3) << np.uint32(8 * byte)
    return words.reshape(-1)


def w8wgmma_unpack_reference(words, k: int, n: int) -> np.ndarray:
    """Inverse of w8wgmma_pack_reference from the consumer's side (mirrors w4_wgmma_kernel<..., W_INT8>'s reads):
    warp t of a consumer warpgroup loads 32 bytes per lane at byte 32 (32 t + lane) of its block's 4 KB chunk
    (b // 4, kc, b % 4); words 2 s and 2 s + 1 are k16 step s, rows g and g + 8; sc::int8_pair takes bytes 0-1 to A
    registers 0 / 1 (k 2c, 2c + 1) and bytes 2-3 to registers 2 / 3 (k 2c + 8, 2c + 9).  Returns int8 (N, K); raises
    if any element is read twice or never."""
    wd = np.asarray(words, np.uint32).reshape(n // 256, k // 64, 4, 128 * 8)
    out = np.zeros((n, k), np.int16)
    seen = np.zeros((n, k), np.int8)
    for b in range(n // 64):
        for kc in range(k // 64):
            chunk = wd[b // 4, kc, b % 4]
            for t in range(4):
                for lane in range(32):
                    g, c = lane // 4, lane % 4
                    for s in range(4):
                        for h in range(2):
                            word = int(chunk[(32 * t + lane) * 8 + 2 * s + h])
                            for byte in range(4):
                                row = 64 * b + 16 * t + g + 8 * h
                                col = 64 * kc + 16 * s + 2 * c + 8 * (byte // 2) + byte % 2
                                if seen[row, col]:
                                    raise AssertionError(f"(n={row}, k={col}) read twice")
                                seen[row, col] = 1
                                val = (word >> (8 * byte)) & 255
                                out[row, col] = val - 256 if val >= 128 else val
    if not seen.all():
        raise AssertionError("some weights never read")
    return out.astype(np.int8)


def w4wgmma_groups_reference(recs, n: int, ng: int) -> np.ndarray:
    """The group records as w4_wgmma_kernel reads them (NumPy mirror of _w4wgmma_groups): record (block // 4,
    group, block % 4), from gemv_pack_groups_reference's (block, group) order."""
    r = np.asarray(recs, np.uint8).reshape(n // 256, 4, ng, GEMV_GROUP_BYTES)
    return r.transpose(0, 2, 1, 3).reshape(-1)


def w4wgmma_unpack_reference(words, k: int, n: int) -> np.ndarray:
    """Inverse of w4wgmma_pack_reference written from the consumer's side (mirrors w4_wgmma_kernel's reads): warp t
    of a consumer warpgroup loads 16 bytes per lane at byte 16 (32 t + lane) of its block's 2 KB stage chunk
    (b // 4, kb, b % 4);
    word s is the A fragment of k16 step s; sc::int4_fragment makes register r from nibbles (r, r + 4), and the m16n8k16
    A layout puts register r at row g + 8 (r % 2), columns 2 c + 8 (r // 2) + (0, 1).  Raises if any (k, n) is
    read twice or never."""
    w = np.asarray(words, np.uint32).reshape(n // 256, k // 64, 4, 4 * 32 * 4)
    q = np.full((k, n), 255, np.uint8)
    for b in range(n // 64):
        for kb in range(k // 64):
            chunk = w[b // 4, kb, b % 4]
            for t in range(4):
                for lane in range(32):
                    g, c = lane // 4, lane % 4
                    for s in range(4):
                        wd = int(chunk[(32 * t + lane) * 4 + s])
                        for r in range(4):
                            for e in range(2):
                                val = (wd >> (4 * (r + 4 * e))) & 15
                                row = 64 * b + 16 * t + g + 8 * (r % 2)
                                col = 64 * kb + 16 * s + 2 * c + 8 * (r // 2) + e
                                if q[col, row] != 255:
                                    raise AssertionError(f"(k={col}, n={row}) read twice")
                                q[col, row] = val
    if (q == 255).any():
        raise AssertionError("some weights are never read")
    return q


_AWQ_NIB = tuple((o >> 1) if o % 2 == 0 else 4 + (o >> 1) for o in range(8))  # == _AWQ_POS


def gemv_pack_int4_reference(q) -> np.ndarray:
    """The fragment-major INT4 layout of q (K, N) values 0..15, as uint32 words (NumPy; what
    gemv_pack_int4_kernel makes on the GPU).  Word [b, s, h, lane, t]: channels n = 64 b + 16 t + g + 8 j,
    k = 32 s + 16 h + 4 c + d (lane = 4 g + c); nibble i holds (d, j) = (i // 4 + 2 ((i // 2) % 2), i % 2)."""
    q = np.asarray(q, np.uint32)
    k, n = q.shape
    nb, ks = n // 64, k // 32
    # (ks, h, c, d, nb, t, j, g) view of q: k = 32 s + 16 h + 4 c + d; n = 64 b + 16 t + 8 j + g
    v = q.reshape(ks, 2, 4, 4, nb, 4, 2, 8)
    words = np.zeros((nb, ks, 2, 8, 4, 4), np.uint32)  # [b, s, h, g, c, t]
    for i in range(8):
        d = i // 4 + 2 * ((i // 2) % 2)
        j = i % 2
        part = v[:, :, :, d, :, :, j, :]             # (ks, h, c, nb, t, g)
        words |= part.transpose(3, 0, 1, 5, 2, 4) << np.uint32(4 * i)
    return words.reshape(-1)


def gemv_unpack_int4_reference(words, k: int, n: int) -> np.ndarray:
    """Inverse of gemv_pack_int4_reference, written from the consumer's side: each lane's word t of half h is
    the A fragment of mma tile t (a0..a3 = nibble pairs (0,4), (1,5), (2,6), (3,7); a0/a2 row g, a1/a3 row
    g + 8; a0/a1 mma k slots 2c, 2c+1, a2/a3 slots 2c+8, 2c+9), and mma k slots 2c, 2c+1, 2c+8, 2c+9 of a lane
    stand for k = 4c, 4c+1, 4c+2, 4c+3 (its 8 bytes of x)."""
    w = np.asarray(words, np.uint32).reshape(n // 64, k // 32, 2, 32, 4)
    q = np.zeros((k, n), np.uint8)
    slot_to_k = {}
    for cc in range(4):
        slot_to_k[2 * cc], slot_to_k[2 * cc + 1], slot_to_k[2 * cc + 8], slot_to_k[2 * cc + 9] = (
            4 * cc, 4 * cc + 1, 4 * cc + 2, 4 * cc + 3)
    for lane in range(32):
        g, cc = lane // 4, lane % 4
        for reg, (lo_nib, row_off, slot0) in enumerate(((0, 0, 2 * cc), (1, 8, 2 * cc), (2, 0, 2 * cc + 8),
                                                         (3, 8, 2 * cc + 8))):
            for half in range(2):
                nib = lo_nib + 4 * half
                kk = slot_to_k[slot0 + half]
                for t in range(4):
                    vals = (w[:, :, :, lane, t] >> np.uint32(4 * nib)) & 15     # (nb, ks, h)
                    for h in range(2):
                        rows = 32 * np.arange(k // 32) + 16 * h + kk
                        cols = 64 * np.arange(n // 64) + 16 * t + g + row_off
                        q[np.ix_(rows, cols)] = vals[:, :, h].T
    return q


def gemv_pack_groups_reference(zeros, scales_u16) -> np.ndarray:
    """INT4 group records (uint8, 192 bytes per (block, group)) from zero points (NG, N) (true zeros, GPTQ's
    +1 applied) and the scales' 16-bit patterns (NG, N)."""
    z = np.asarray(zeros, np.uint8)
    s = np.asarray(scales_u16, np.uint16)
    ng, n = z.shape
    nb = n // 64
    # channel order inside a record: [g][o], o = 2 t + j, n = 64 b + 16 t + g + 8 j
    zv = z.reshape(ng, nb, 4, 2, 8).transpose(1, 0, 4, 2, 3).reshape(nb, ng, 64)
    sv = s.reshape(ng, nb, 4, 2, 8).transpose(1, 0, 4, 2, 3).reshape(nb, ng, 64)
    rec = np.zeros((nb, ng, 192), np.uint8)
    rec[:, :, :128] = sv.astype("<u2").view(np.uint8).reshape(nb, ng, 128)
    rec[:, :, 128:] = zv
    return rec.reshape(-1)


def gemv_pack_int8_reference(weight) -> np.ndarray:
    """The fragment-major INT8 layout of weight (N, K) int8 as uint32 words (what gemv_pack_int8_kernel makes)."""
    w = np.asarray(weight).view(np.uint8).astype(np.uint32)
    n, k = w.shape
    nb, ks = n // 32, k // 32
    # (nb, t, j, g, ks, h, c, p, e): n = 32 b + 16 t + 8 j + g, k = 32 s + 16 h + 4 c + 2 p + e
    v = w.reshape(nb, 2, 2, 8, ks, 2, 4, 2, 2)
    word = (v[:, :, 0, :, :, :, :, :, 0] | v[:, :, 0, :, :, :, :, :, 1] << 8
            | v[:, :, 1, :, :, :, :, :, 0] << 16 | v[:, :, 1, :, :, :, :, :, 1] << 24)  # (nb, t, g, ks, h, c, p)
    return word.transpose(0, 3, 4, 2, 5, 1, 6).reshape(-1).astype(np.uint32)  # [b, s, h, g, c, t, p]
