"""flash_attn against torch SDPA's FLASH (FlashAttention-2) and CUDNN backends, flash-attn's convention:
batch * seqlen = 16384, nheads * head_dim = 2048, TFLOP/s = 4 * b * h * sq * sk * d (halved for causal).
Plus a GQA case and a varlen case (against torch's FlashAttention-2 varlen entry point)."""
import speedcore
from speedcore import attention

OP = "flash_attn"


def _tflops(flops, ms):
    return flops / ms / 1e9


def cases(b):
    torch = b.torch
    if b.quick:
        grid = [(torch.bfloat16, d, c, s) for d in (64, 128) for c in (False, True) for s in (2048, 8192)]
    else:
        grid = [(dt, d, c, s) for dt in (torch.bfloat16, torch.float16) for d in (64, 128) for c in (False, True)
                for s in (512, 1024, 2048, 4096, 8192, 16384)]
        grid += [(torch.bfloat16, 256, c, s) for c in (False, True) for s in (2048, 8192)]
    out = []
    for dtype, d, causal, s in grid:
        label = f"{OP} {str(dtype)[6:]} d{d} {'causal' if causal else 'full'} s{s}"
        out.append((label, lambda b, dtype=dtype, d=d, causal=causal, s=s, label=label:
                    _dense(b, dtype, d, causal, s, label)))
    out.append((f"{OP} gqa", lambda b: _gqa(b)))
    out.append((f"{OP} varlen", lambda b: _varlen(b)))
    return out


def _sdpa(b, backend, q, k, v, causal, gqa=False):
    """Milliseconds of torch SDPA with one backend on (b, h, s, d) tensors, or None where it does not run."""
    torch = b.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F = torch.nn.functional
    kw = {"enable_gqa": True} if gqa else {}
    try:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)
            return b.time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw))
    except Exception:
        return None


def _dense(b, dtype, d, causal, s, label):
    torch = b.torch
    batch, h = max(1, 16384 // s), 2048 // d
    # ours: (b, s, h, d); the peers get their own contiguous (b, h, s, d) copies, their fastest layout
    q, k, v = (torch.randn(batch, s, h, d, device=b.device, dtype=dtype) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    flops = 4 * batch * h * s * s * d / (2 if causal else 1)
    ours = b.time_ms(lambda: speedcore.flash_attn(q, k, v, causal=causal))
    peers = {}
    for name, backend in (("torch SDPA FLASH", "FLASH_ATTENTION"), ("torch SDPA CUDNN", "CUDNN_ATTENTION")):
        ms = _sdpa(b, backend, qt, kt, vt, causal)
        peers[name] = _tflops(flops, ms) if ms else None
    path = attention.attention_path(d, torch.cuda.get_device_capability(), False)
    b.add(OP, f"{label[len(OP) + 1:]} [{path}]", "TFLOP/s", _tflops(flops, ours), peers, ceiling="matmul")
    if path != "sm80":  # the portable kernel too, against the same peer timings
        sm80 = b.time_ms(lambda: speedcore.flash_attn(q, k, v, causal=causal, _path="sm80"))
        b.add(OP, f"{label[len(OP) + 1:]} [sm80]", "TFLOP/s", _tflops(flops, sm80), peers, ceiling="matmul")


def _gqa(b):
    torch = b.torch
    batch, s, h, hkv, d = 4, 4096, 32, 8, 128
    q = torch.randn(batch, s, h, d, device=b.device, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, s, hkv, d, device=b.device, dtype=torch.bfloat16) for _ in range(2))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    flops = 4 * batch * h * s * s * d / 2
    ours = b.time_ms(lambda: speedcore.flash_attn(q, k, v, causal=True))
    peers = {}
    for name, backend in (("torch SDPA FLASH", "FLASH_ATTENTION"), ("torch SDPA CUDNN", "CUDNN_ATTENTION")):
        ms = _sdpa(b, backend, qt, kt, vt, True, gqa=True)
        peers[name] = _tflops(flops, ms) if ms else None
    b.add(OP, f"bf16 d{d} causal gqa {h}/{hkv} b{batch} s{s}", "TFLOP/s", _tflops(flops, ours), peers,
          ceiling="matmul")


def _varlen(b):
    torch = b.torch
    gen = torch.Generator().manual_seed(0)
    lens = (torch.randint(256, 3840, (8,), generator=gen)).tolist()
    h, d = 16, 128
    total = sum(lens)
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], device=b.device, dtype=torch.int32)
    q, k, v = (torch.randn(total, h, d, device=b.device, dtype=torch.bfloat16) for _ in range(3))
    mx = max(lens)
    flops = sum(4 * h * n * n * d / 2 for n in lens)
    ours = b.time_ms(lambda: speedcore.flash_attn_varlen(q, k, v, cu, cu, mx, mx, causal=True))
    peers = {}
    try:
        fwd = torch.ops.aten._flash_attention_forward

        def peer():
            return fwd(q, k, v, cu, cu, mx, mx, 0.0, True, False)

        peer()
        peers["torch FA2 varlen (aten._flash_attention_forward)"] = _tflops(flops, b.time_ms(peer))
    except Exception:
        peers["torch FA2 varlen (aten._flash_attention_forward)"] = None
    b.add(OP, f"varlen bf16 d{d} causal {len(lens)} seqs total {total}", "TFLOP/s", _tflops(flops, ours), peers,
          ceiling="matmul")
