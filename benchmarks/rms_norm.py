"""rms_norm against torch.nn.functional.rms_norm and the unfused eager expression (HF Llama's RMSNorm)."""
import speedcore

OP = "rms_norm"


def _eager(x, w, eps, r=None):
    h = x if r is None else x + r
    hf = h.float()
    y = hf * (hf.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return (w * y.to(x.dtype), h)


def cases(b):
    torch = b.torch
    shapes = [(16384, 4096), (4096, 8192)] if b.quick else [(16384, 4096), (4096, 8192), (32768, 8192), (8192, 16384),
                                                           (4096, 111 * 16)]
    dtypes = [torch.bfloat16] if b.quick else [torch.bfloat16, torch.float16]
    out = []
    for rows, hidden in shapes:
        for dtype in dtypes:
            for residual in (False, True):
                label = f"{OP} {rows}x{hidden} {str(dtype)[6:]}{' +residual' if residual else ''}"
                out.append((label, lambda b, rows=rows, hidden=hidden, dtype=dtype, residual=residual, label=label:
                            _run(b, rows, hidden, dtype, residual, label)))
    return out


def _run(b, rows, hidden, dtype, residual, label):
    torch = b.torch
    F = torch.nn.functional
    eps = 1e-6
    x = torch.randn(rows, hidden, dtype=dtype, device=b.device)
    w = torch.randn(hidden, dtype=dtype, device=b.device)
    r = torch.randn_like(x) if residual else None
    nbytes = x.numel() * x.element_size() * (4 if residual else 2) + w.numel() * w.element_size()
    if residual:
        ours = b.time_ms(lambda: speedcore.rms_norm(x, w, eps, residual=r))
        t_f = b.time_ms(lambda: (lambda h: (F.rms_norm(h, (hidden,), w, eps), h))(x + r))
        t_e = b.time_ms(lambda: _eager(x, w, eps, r))
    else:
        ours = b.time_ms(lambda: speedcore.rms_norm(x, w, eps))
        t_f = b.time_ms(lambda: F.rms_norm(x, (hidden,), w, eps))
        t_e = b.time_ms(lambda: _eager(x, w, eps))
    tbps = lambda ms: nbytes / ms / 1e9  # noqa: E731
    b.add(OP, label[len(OP) + 1:], "TB/s", tbps(ours),
          {"torch.nn.functional.rms_norm": tbps(t_f), "torch eager (HF Llama)": tbps(t_e)}, ceiling="copy")
