"""speedcore.linear / speedcore.matmul against cuBLAS (torch.nn.functional.linear, torch.matmul).

Square 4096^3 and 8192^3; M in {1, 16, 64, 128, 512, 2048, 8192} x (N, K) of Llama-style projections.
M <= 64 is bandwidth-bound: recorded in TB/s (weights + activations + output) against the copy ceiling;
larger M in TFLOP/s against the cuBLAS matmul ceiling.  The forced Ampere (mma.sync) path is recorded too, for
both B layouts.  Ours and cuBLAS are timed in ABBA order (see _pair).
"""
import speedcore

NK = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192), (8192, 8192)]
MS = [1, 16, 64, 128, 512, 2048, 8192]


def cases(b):
    torch = b.torch
    dtypes = [torch.bfloat16] if b.quick else [torch.bfloat16, torch.float16]
    ms = [1, 16, 64, 128, 512, 2048] if b.quick else MS
    out = []
    for dtype in dtypes:
        d = str(dtype)[6:]
        for s in (4096, 8192):
            out.append((f"linear {s}^3 {d}", lambda b, s=s, dtype=dtype: _linear(b, s, s, s, dtype)))
            out.append((f"matmul {s}^3 {d}", lambda b, s=s, dtype=dtype: _matmul(b, s, s, s, dtype)))
        out.append((f"linear[ampere] 8192^3 {d}",
                    lambda b, dtype=dtype: _linear(b, 8192, 8192, 8192, dtype, path="ampere")))
        out.append((f"matmul[ampere] 8192^3 {d}",
                    lambda b, dtype=dtype: _matmul(b, 8192, 8192, 8192, dtype, path="ampere")))
        out.append((f"matmul 16x14336x4096 {d}", lambda b, dtype=dtype: _matmul(b, 16, 14336, 4096, dtype)))
        out.append((f"linear+bias+silu 4096x14336x4096 {d}",
                    lambda b, dtype=dtype: _linear(b, 4096, 14336, 4096, dtype, act="silu")))
        for n, k in NK:
            for m in ms:
                out.append((f"linear {m}x{n}x{k} {d}", lambda b, m=m, n=n, k=k, dtype=dtype: _linear(b, m, n, k, dtype)))
    return out


def _record(b, op, m, n, k, dtype, ours_ms, peers_ms):
    d = str(dtype)[6:]
    case = f"{m}x{n}x{k} {d}"
    if m <= 64:
        nbytes = 2 * (m * k + n * k + m * n)
        f = lambda ms: nbytes / ms / 1e9  # noqa: E731
        b.add(op, case, "TB/s", f(ours_ms), {p: f(v) for p, v in peers_ms.items()}, ceiling="copy")
    else:
        f = lambda ms: 2 * m * n * k / ms / 1e9  # noqa: E731
        b.add(op, case, "TFLOP/s", f(ours_ms), {p: f(v) for p, v in peers_ms.items()}, ceiling="matmul")


def _pair(b, ours, peer):
    """(ours ms, peer ms) timed in ABBA order, each the faster of its two medians.  The H200's clocks drift with
    power over a few hundred ms (in same-run A/Bs a kernel timed right after an 8192^3 cuBLAS call ran ~10% slower
    than the same kernel timed later); ABBA treats both sides alike and cancels a linear drift."""
    o1 = b.time_ms(ours)
    p1 = b.time_ms(peer)
    p2 = b.time_ms(peer)
    o2 = b.time_ms(ours)
    return min(o1, o2), min(p1, p2)


def _linear(b, m, n, k, dtype, act=None, path=None):
    torch = b.torch
    F = torch.nn.functional
    x = torch.randn(m, k, dtype=dtype, device=b.device)
    w = torch.randn(n, k, dtype=dtype, device=b.device) / k ** 0.5
    bias = torch.randn(n, dtype=dtype, device=b.device) if act else None
    if act:
        peer_fn = lambda: F.silu(F.linear(x, w, bias))  # noqa: E731
        name = "F.silu(F.linear) (cuBLAS + eager)"
    else:
        peer_fn = lambda: F.linear(x, w)  # noqa: E731
        name = "F.linear (cuBLAS)"
    ours, peer = _pair(b, lambda: speedcore.linear(x, w, bias, activation=act, _path=path), peer_fn)
    op = "linear" + (f"[{path}]" if path else "") + (f"+bias+{act}" if act else "")
    _record(b, op, m, n, k, dtype, ours, {name: peer})


def _matmul(b, m, n, k, dtype, path=None):
    torch = b.torch
    x = torch.randn(m, k, dtype=dtype, device=b.device)
    w = torch.randn(k, n, dtype=dtype, device=b.device) / k ** 0.5
    ours, peer = _pair(b, lambda: speedcore.matmul(x, w, _path=path), lambda: torch.matmul(x, w))
    _record(b, "matmul" + (f"[{path}]" if path else ""), m, n, k, dtype, ours, {"torch.matmul (cuBLAS)": peer})
