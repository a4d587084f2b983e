"""speedcore.awq_linear / gptq_linear / int8_linear against cuBLAS (F.linear, same activation dtype) and
torch's int4 tinygemm (torch.ops.aten._weight_int4pack_mm, group 128, bfloat16 only), in the same run.

M in {1, 4, 16, 64, 256, 2048} x (N, K) in {(8192, 8192), (28672, 8192), (8192, 28672), (4096, 4096)} for AWQ
(bf16 and fp16); GPTQ and INT8 on a subset.  M <= 64 is recorded in TB/s of the bytes our op must move
(packed weights + scales + zeros + x + y; peers converted with the same byte count, so ratio = time ratio)
against the copy ceiling; larger M in TFLOP/s.  At M = 1 also a cuBLAS GEMV of the same weight bytes (SAME_BYTES).
Weights are random packed words (all nibble values).
The main records use the prepacked layers (prepack_*: one-time tile-major and fragment-major copies, made
outside the timed region as Marlin does); "[as stored]" records call with the checkpoint tensors directly.
"""
import speedcore
from speedcore import quant as Q

NK = [(8192, 8192), (28672, 8192), (8192, 28672), (4096, 4096)]
# At M = 1, a cuBLAS GEMV that reads as many weight bytes as ours (N/4 rows of bf16/fp16 for INT4, N/2 for INT8):
# what the same read costs cuBLAS, launch and ramp included (on the H200 a 33.6 MB GEMV takes ~15 us, so the
# ratio to the full-size F.linear cannot approach the 4x byte ratio on an 8192x8192 layer).
SAME_BYTES = "cuBLAS GEMV, same bytes"
MS = [1, 4, 16, 64, 256, 2048]
GROUP = 128


def cases(b):
    torch = b.torch
    out = []
    if b.quick:
        for dtype in (torch.bfloat16,):
            out.append(("awq_linear 8192x8192 bf16 quick",
                        lambda b, dtype=dtype: _int4(b, "awq", 8192, 8192, dtype, [1, 16, 64, 2048])))
            out.append(("awq_linear 28672x8192 bf16 quick",
                        lambda b, dtype=dtype: _int4(b, "awq", 28672, 8192, dtype, [1, 16])))
            out.append(("int8_linear 8192x8192 bf16 quick", lambda b, dtype=dtype: _int8(b, 8192, 8192, dtype, [1])))
        return out
    for dtype in (torch.bfloat16, torch.float16):
        d = str(dtype)[6:]
        for n, k in NK:
            out.append((f"awq_linear {n}x{k} {d}", lambda b, n=n, k=k, dtype=dtype: _int4(b, "awq", n, k, dtype, MS)))
        for n, k in NK[:2]:
            out.append((f"gptq_linear {n}x{k} {d}",
                        lambda b, n=n, k=k, dtype=dtype: _int4(b, "gptq", n, k, dtype, [1, 16, 64, 256])))
            out.append((f"int8_linear {n}x{k} {d}",
                        lambda b, n=n, k=k, dtype=dtype: _int8(b, n, k, dtype, [1, 16, 64, 256, 2048])))
    out.append(("gptq_linear act-order 8192x8192 bf16",
                lambda b: _int4(b, "gptq-act", 8192, 8192, torch.bfloat16, [1, 16, 64])))
    return out


def _record(b, op, m, n, k, dtype, nbytes, ours_ms, peers_ms):
    d = str(dtype)[6:]
    case = f"{m}x{n}x{k} {d}"
    if m <= 64:
        f = lambda ms: nbytes / ms / 1e9  # noqa: E731
        b.add(op, case, "TB/s", f(ours_ms), {p: f(v) for p, v in peers_ms.items()}, ceiling="copy")
    else:
        f = lambda ms: 2 * m * n * k / ms / 1e9  # noqa: E731
        b.add(op, case, "TFLOP/s", f(ours_ms), {p: f(v) for p, v in peers_ms.items()}, ceiling="matmul")


def _rand_int32(torch, shape, device):
    return torch.randint(-2 ** 31, 2 ** 31 - 1, shape, dtype=torch.int32, device=device)


def _tinygemm(b, n, k):
    torch = b.torch
    try:
        wi = torch.randint(0, 16, (n, k), dtype=torch.int32, device=b.device)
        wu8 = (wi[:, ::2] << 4 | wi[:, 1::2]).to(torch.uint8)
        del wi
        packed = torch.ops.aten._convert_weight_to_int4pack(wu8, 8)
        sz = torch.rand(k // GROUP, n, 2, device=b.device, dtype=torch.bfloat16) * 0.01
        return packed, sz
    except Exception:
        return None


def _int4(b, fmt, n, k, dtype, ms):
    torch = b.torch
    F = torch.nn.functional
    dev = b.device
    g = GROUP
    scales = (torch.rand(k // g, n, device=dev) * 0.01 + 0.001).to(dtype)
    stored = None
    if fmt == "awq":
        qw = _rand_int32(torch, (k, n // 8), dev)
        qz = _rand_int32(torch, (k // g, n // 8), dev)
        packed = Q.prepack_awq(qw, qz, scales, group_size=g)
        op = "awq_linear"
        call = lambda x: speedcore.awq_linear(x, packed)  # noqa: E731
        stored = lambda x: speedcore.awq_linear(x, qw, qz, scales, group_size=g)  # noqa: E731
    else:
        qw = _rand_int32(torch, (k // 8, n), dev)
        qz = _rand_int32(torch, (k // g, n // 8), dev)
        op = "gptq_linear"
        if fmt == "gptq-act":
            g_idx = (torch.randperm(k, device=dev) // g).to(torch.int32)
            packed = Q.prepack_gptq(qw, qz, scales, g_idx, group_size=g)
            op = "gptq_linear[act-order, prepacked]"
            call = lambda x: speedcore.gptq_linear(x, packed)  # noqa: E731
        else:
            packed = Q.prepack_gptq(qw, qz, scales, group_size=g)
            call = lambda x: speedcore.gptq_linear(x, packed)  # noqa: E731
            stored = lambda x: speedcore.gptq_linear(x, qw, qz, scales, group_size=g)  # noqa: E731
    w = (torch.randn(n, k, device=dev, dtype=dtype) * 0.01)
    tg = _tinygemm(b, n, k) if (dtype == torch.bfloat16 and fmt == "awq") else None
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=dtype)
        nbytes = k * n // 2 + (k // g) * n * 2 + (k // g) * n // 2 + 2 * m * (k + n)
        ours = b.time_ms(lambda: call(x))
        peers = {"F.linear (cuBLAS)": b.time_ms(lambda: F.linear(x, w))}
        if m == 1:
            peers[SAME_BYTES] = b.time_ms(lambda: F.linear(x, w[:n // 4]))
        if tg is not None:
            packed_tg, sz = tg
            peers["tinygemm int4 (torch)"] = b.time_ms(
                lambda: torch.ops.aten._weight_int4pack_mm(x, packed_tg, g, sz))
        _record(b, op, m, n, k, dtype, nbytes, ours, peers)
        lo, hi = Q._MARLIN_M_RANGE
        if Q._MARLIN_MODE == "off" and lo <= m <= hi:
            # quant_marlin_kernel while it is off by default (not yet measured): the same layer with it on
            Q._MARLIN_MODE = "on"
            try:
                t_marlin = b.time_ms(lambda: call(x))
            finally:
                Q._MARLIN_MODE = "off"
            _record(b, op + "[marlin]", m, n, k, dtype, nbytes, t_marlin,
                    {"F.linear (cuBLAS)": peers["F.linear (cuBLAS)"]})
        if stored is not None and m <= 256:
            _record(b, op + "[as stored]", m, n, k, dtype, nbytes, b.time_ms(lambda: stored(x)),
                    {"F.linear (cuBLAS)": peers["F.linear (cuBLAS)"]})


def _int8(b, n, k, dtype, ms):
    torch = b.torch
    F = torch.nn.functional
    dev = b.device
    w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=dev)
    s = (torch.rand(n, device=dev) * 0.01 + 0.001).to(dtype)
    w = (torch.randn(n, k, device=dev, dtype=dtype) * 0.01)
    packed = Q.prepack_int8(w8, s)
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=dtype)
        nbytes = k * n + 2 * n + 2 * m * (k + n)
        ours = b.time_ms(lambda: speedcore.int8_linear(x, packed))
        peers = {"F.linear (cuBLAS)": b.time_ms(lambda: F.linear(x, w))}
        if m == 1:
            peers[SAME_BYTES] = b.time_ms(lambda: F.linear(x, w[:n // 2]))
        _record(b, "int8_linear", m, n, k, dtype, nbytes, ours, peers)
        if m <= 256:
            _record(b, "int8_linear[as stored]", m, n, k, dtype, nbytes,
                    b.time_ms(lambda: speedcore.int8_linear(x, w8, s)), {"F.linear (cuBLAS)": peers["F.linear (cuBLAS)"]})
