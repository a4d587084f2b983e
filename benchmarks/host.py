"""Host time per call of every public op at decode sizes (and one prefill size), against the torch op that a
model would run for the same job, same process.

Eager decoding is bound by host time: a model step is hundreds of small launches.  Each figure is the time the
host spends issuing one call, measured over bursts of calls short enough that the GPU never fills the launch
queue (so a slow kernel does not stall the host and inflate the figure), median of the bursts.
"""
import time

OP = "host"
BURST = 100
ROUNDS = 30


def host_us(torch, fn) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        for _ in range(BURST):
            fn()
        times.append((time.perf_counter() - t) / BURST * 1e6)
        torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2]


def cases(b):
    return [("host time per call", _host)]


def _host(b):
    import speedcore

    torch = b.torch
    F = torch.nn.functional
    dev, bf16 = b.device, torch.bfloat16

    def rand(*shape, dtype=bf16):
        return torch.randn(*shape, device=dev, dtype=dtype)

    def add(case, ours_fn, peer_name, peer_fn):
        ours, peer = host_us(torch, ours_fn), host_us(torch, peer_fn)
        b.add(OP, case, "us", ours, {peer_name: peer}, higher_is_better=False)

    x1 = rand(1, 4096)
    for rows, size in ((1, "decode"), (512, "prefill")):
        x, r, w = rand(rows, 4096), rand(rows, 4096), rand(4096)
        add(f"rms_norm {rows}x4096 ({size})", lambda: speedcore.rms_norm(x, w, 1e-6),
            "F.rms_norm", lambda: F.rms_norm(x, (4096,), w, 1e-6))
        add(f"add + rms_norm {rows}x4096 ({size})", lambda: speedcore.rms_norm(x, w, 1e-6, residual=r),
            "x + r; F.rms_norm", lambda: F.rms_norm(x + r, (4096,), w, 1e-6))
        wl = rand(4096, 4096) / 64
        add(f"linear {rows}x4096x4096 ({size})", lambda: speedcore.linear(x, wl), "F.linear", lambda: F.linear(x, wl))
        g = rand(rows, 2 * 14336)
        add(f"silu_and_mul {rows}x28672 ({size})", lambda: speedcore.silu_and_mul(g),
            "F.silu(a) * b", lambda: F.silu(g[..., :14336]) * g[..., 14336:])

    xm, wm = rand(1, 4096), rand(4096, 4096) / 64
    add("matmul 1x4096x4096 (decode)", lambda: speedcore.matmul(xm, wm), "torch.matmul", lambda: torch.matmul(xm, wm))
    g = rand(1, 2 * 14336)
    add("gelu_and_mul 1x28672 (decode)", lambda: speedcore.gelu_and_mul(g),
        "F.gelu(a) * b", lambda: F.gelu(g[..., :14336]) * g[..., 14336:])

    # rotary on a fused qkv projection's q and k (Llama-3-8B: 32 / 8 heads of 128), neox style, 8 tokens
    tokens = 8
    qkv = rand(tokens, 48 * 128)
    q, k = qkv[:, :4096].view(tokens, 32, 128), qkv[:, 4096:5120].view(tokens, 8, 128)
    pos = torch.arange(100, 100 + tokens, device=dev)
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device=dev, dtype=torch.float32) / 128))
    freqs = torch.outer(torch.arange(8192, device=dev, dtype=torch.float32), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def torch_rotary():  # what transformers' apply_rotary_pos_emb does, on the same q and k
        cos, sin = cos_sin[pos].chunk(2, dim=-1)
        cos, sin = torch.cat([cos, cos], -1)[:, None].to(bf16), torch.cat([sin, sin], -1)[:, None].to(bf16)

        def rot(t):
            return torch.cat((-t[..., 64:], t[..., :64]), dim=-1)

        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    add(f"rotary_embedding {tokens} tokens 32/8 heads d128",
        lambda: speedcore.rotary_embedding(pos, q, k, cos_sin, is_neox=True), "apply_rotary_pos_emb", torch_rotary)

    kc = torch.zeros(1024, 16, 8, 128, device=dev, dtype=bf16)
    vc = torch.zeros_like(kc)
    kn, vn = rand(tokens, 8, 128), rand(tokens, 8, 128)
    slots = torch.randperm(1024 * 16, device=dev)[:tokens]

    def torch_cache():
        kc.view(-1, 8, 128)[slots] = kn
        vc.view(-1, 8, 128)[slots] = vn

    add(f"reshape_and_cache {tokens} tokens 8 heads d128", lambda: speedcore.reshape_and_cache(kn, vn, kc, vc, slots),
        "index_put x2", torch_cache)

    # attention of one new token against 1024 keys (32/8 heads, d128), contiguous: flash_attn vs sdpa
    qa, ka, va = rand(1, 1, 32, 128), rand(1, 1024, 8, 128), rand(1, 1024, 8, 128)
    qt, kt, vt = qa.transpose(1, 2), ka.transpose(1, 2), va.transpose(1, 2)
    add("flash_attn q 1, k 1024, 32/8 heads d128", lambda: speedcore.flash_attn(qa, ka, va, causal=True),
        "F.scaled_dot_product_attention", lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
    qp, kp, vp = rand(1, 512, 32, 128), rand(1, 512, 8, 128), rand(1, 512, 8, 128)
    qpt, kpt, vpt = qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2)
    add("flash_attn causal 512 tokens, 32/8 heads d128 (prefill)", lambda: speedcore.flash_attn(qp, kp, vp, causal=True),
        "F.scaled_dot_product_attention",
        lambda: F.scaled_dot_product_attention(qpt, kpt, vpt, is_causal=True, enable_gqa=True))

    # paged decode, batch 8 of 1024 cached tokens, block size 16; the peer is sdpa on the contiguous cache
    batch, seq = 8, 1024
    blocks = batch * seq // 16
    kpc, vpc = rand(blocks, 16, 8, 128), rand(blocks, 16, 8, 128)
    table = torch.randperm(blocks, device=dev, dtype=torch.int32).view(batch, seq // 16)
    lens = torch.full((batch,), seq, device=dev, dtype=torch.int32)
    qd = rand(batch, 32, 128)
    qdt, kdt, vdt = rand(batch, 32, 1, 128), rand(batch, 8, seq, 128), rand(batch, 8, seq, 128)
    add(f"paged_decode_attention B {batch}, S {seq}, 32/8 heads d128",
        lambda: speedcore.paged_decode_attention(qd, kpc, vpc, table, lens),
        "F.scaled_dot_product_attention", lambda: F.scaled_dot_product_attention(qdt, kdt, vdt, enable_gqa=True))

    # varlen attention of 8 sequences of 64 tokens (prefill of a small batch); the peer is sdpa on the padded batch
    cu = torch.arange(0, 9 * 64, 64, device=dev, dtype=torch.int32)
    qv, kv, vv = rand(512, 32, 128), rand(512, 8, 128), rand(512, 8, 128)
    qb, kb, vb = rand(8, 32, 64, 128), rand(8, 8, 64, 128), rand(8, 8, 64, 128)
    add("flash_attn_varlen 8 x 64 tokens, 32/8 heads d128",
        lambda: speedcore.flash_attn_varlen(qv, kv, vv, cu, cu, 64, 64, causal=True),
        "F.scaled_dot_product_attention",
        lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True))

    # paged prefill: a 64-token chunk of each of 8 sequences over 1024 cached tokens in 16-token pages
    if hasattr(speedcore, "paged_prefill_attention"):
        seqused = torch.full((batch,), seq, device=dev, dtype=torch.int32)
        add(f"paged_prefill_attention 8 x 64 queries over {seq} cached, 32/8 heads d128",
            lambda: speedcore.paged_prefill_attention(qv, kpc, vpc, cu, seqused, table, 64, seq, causal=True),
            "F.scaled_dot_product_attention",
            lambda: F.scaled_dot_product_attention(qb, kdt, vdt, enable_gqa=True))

    # a 4-bit AWQ layer, prepacked, at decode size: the torch op a model would run is F.linear on bf16 weights
    from speedcore import quant

    wq = (torch.randn(4096, 4096) * 0.02).numpy()
    qw, qz, sc = (torch.from_numpy(a).to(dev) for a in quant.quantize_awq(wq, 128))
    layer = quant.prepack_awq(qw, qz, sc.to(bf16), group_size=128)
    add("awq_linear 1x4096x4096 g128 (prepacked)", lambda: speedcore.awq_linear(x1, layer), "F.linear (bf16)",
        lambda: F.linear(x1, wl))

    # chained launches (cuLaunchKernelEx with programmatic stream serialization, what speedcore.LLM's graphs use):
    # their host cost decides whether eager callers could have them too
    from speedcore import _launch

    prev = _launch.set_chained_launches(True)
    try:
        add("rms_norm 1x4096 (decode), chained launch", lambda: speedcore.rms_norm(x1, w, 1e-6),
            "F.rms_norm", lambda: F.rms_norm(x1, (4096,), w, 1e-6))
        add("linear 1x4096x4096 (decode), chained launch", lambda: speedcore.linear(x1, wl), "F.linear",
            lambda: F.linear(x1, wl))
    finally:
        _launch.set_chained_launches(prev)
