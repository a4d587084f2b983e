"""Decode-time kernels against their peers.

Paged decode attention: effective TB/s = K and V bytes read / time, ours on a paged cache (block size 16,
shuffled pages) against torch SDPA's cuDNN and FLASH backends reading the same data laid out contiguously
(batch, kv_heads, seqlen, head_dim), one query token.  Block size 16 against 256 on the same data.
Fused ops on 16384 tokens of a Llama-3-8B layer (hidden 4096, 32 query / 8 KV heads of 128, intermediate
14336), bf16, against torch eager; TB/s = bytes read + written / time, as fractions of the copy bandwidth.
"""
SHAPES = [(64, 4096, 32, 8, 128), (8, 32768, 32, 8, 128), (1, 131072, 32, 8, 128), (256, 1024, 32, 32, 128)]
TOKENS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 16384, 4096, 32, 8, 128, 14336


def _paged_copy(torch, k, block_size, perm):
    """(batch, kv_heads, seqlen, d) -> pages (num_blocks, block_size, kv_heads, d) in the order ``perm``."""
    batch, kvh, s, d = k.shape
    pages = k.view(batch, kvh, s // block_size, block_size, d).permute(0, 2, 3, 1, 4).reshape(-1, block_size, kvh, d)
    out = torch.empty_like(pages)
    out[perm] = pages
    return out


def _decode_case(b, batch, seqlen, heads, kv_heads, head_dim):
    import speedcore
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch = b.torch
    F = torch.nn.functional
    dt = torch.bfloat16
    q = torch.randn(batch, heads, head_dim, device=b.device, dtype=dt)
    k = torch.randn(batch, kv_heads, seqlen, head_dim, device=b.device, dtype=dt)
    v = torch.randn_like(k)
    nbytes = 2 * k.numel() * k.element_size()
    case = f"B{batch} S{seqlen} H{heads}/{kv_heads} D{head_dim} bf16"

    bs = 16
    nblocks = batch * seqlen // bs
    perm = torch.randperm(nblocks, device=b.device)
    kc = _paged_copy(torch, k, bs, perm)
    vc = _paged_copy(torch, v, bs, perm)
    table = perm.view(batch, seqlen // bs).int()
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device=b.device)
    out = torch.empty_like(q)
    ours_ms = b.time_ms(lambda: speedcore.paged_decode_attention(q, kc, vc, table, lens, out=out))
    del kc, vc

    q4 = q.view(batch, heads, 1, head_dim)
    peers = {}
    ref = None
    for name, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                fn = lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=heads != kv_heads)  # noqa: E731
                r = fn()
                ms = b.time_ms(fn)
            ref = r if ref is None else ref
            peers[name] = nbytes / ms / 1e9
        except Exception as e:  # a backend that refuses the shape is reported, not fatal
            print(f"  {case}: {name} unavailable: {type(e).__name__}: {str(e)[:100]}", flush=True)
            peers[name] = None
    if ref is not None:
        err = (out.float() - ref.view_as(out).float()).abs().max().item()
        print(f"  {case}: ours {nbytes / ours_ms / 1e9:.3f} TB/s ({ours_ms * 1e3:.1f} us), max |ours - sdpa| {err:.3g}",
              flush=True)
        if not err < 5e-2:
            raise AssertionError(f"paged decode disagrees with SDPA by {err}")
    b.add("paged_decode", case + " bs16", "TB/s", nbytes / ours_ms / 1e9, peers, ceiling="copy")


def _block_size_case(b):
    import speedcore

    torch = b.torch
    batch, seqlen, heads, kv_heads, head_dim = SHAPES[0]
    dt = torch.bfloat16
    q = torch.randn(batch, heads, head_dim, device=b.device, dtype=dt)
    k = torch.randn(batch, kv_heads, seqlen, head_dim, device=b.device, dtype=dt)
    v = torch.randn_like(k)
    nbytes = 2 * k.numel() * k.element_size()
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device=b.device)
    out = torch.empty_like(q)
    tbps = {}
    outs = {}
    for bs in (16, 256, 1):
        nblocks = batch * seqlen // bs
        perm = torch.randperm(nblocks, device=b.device)
        kc = _paged_copy(torch, k, bs, perm)
        vc = _paged_copy(torch, v, bs, perm)
        table = perm.view(batch, seqlen // bs).int()
        ms = b.time_ms(lambda: speedcore.paged_decode_attention(q, kc, vc, table, lens, out=out))
        outs[bs] = out.clone()
        tbps[bs] = nbytes / ms / 1e9
        del kc, vc
    assert torch.equal(outs[16], outs[256])
    case = f"B{batch} S{seqlen} H{heads}/{kv_heads} D{head_dim} bf16"
    b.add("paged_decode_block_size", case + " bs16", "TB/s", tbps[16], {"ours bs256": tbps[256]}, ceiling="copy")
    b.add("paged_decode_block_size", case + " bs1", "TB/s", tbps[1], {"ours bs256": tbps[256]}, ceiling="copy")


def _reshape_and_cache_case(b):
    import speedcore

    torch = b.torch
    dt = torch.bfloat16
    bs = 16
    k = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, device=b.device, dtype=dt)
    v = torch.randn_like(k)
    nblocks = 2 * TOKENS // bs
    kc = torch.zeros(nblocks, bs, KV_HEADS, HEAD_DIM, device=b.device, dtype=dt)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(nblocks * bs, device=b.device)[:TOKENS]
    nbytes = 4 * k.numel() * k.element_size() + slots.numel() * 8
    ms = b.time_ms(lambda: speedcore.reshape_and_cache(k, v, kc, vc, slots))
    kf, vf = kc.view(-1, KV_HEADS, HEAD_DIM), vc.view(-1, KV_HEADS, HEAD_DIM)

    def eager():
        kf.index_copy_(0, slots, k)
        vf.index_copy_(0, slots, v)

    peer_ms = b.time_ms(eager)
    b.add("reshape_and_cache", f"{TOKENS} tok {KV_HEADS}x{HEAD_DIM} bf16 bs{bs}", "TB/s", nbytes / ms / 1e9,
          {"torch index_copy_": nbytes / peer_ms / 1e9}, ceiling="copy")


def _rotary_case(b):
    import speedcore

    torch = b.torch
    dt = torch.bfloat16
    max_pos = 8192
    positions = torch.randint(0, max_pos, (TOKENS,), device=b.device)
    inv = 1.0 / (500000 ** (torch.arange(0, HEAD_DIM, 2, device=b.device).float() / HEAD_DIM))
    ang = torch.arange(max_pos, device=b.device).float()[:, None] * inv[None]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1).to(dt)
    q = torch.randn(TOKENS, HEADS, HEAD_DIM, device=b.device, dtype=dt)
    k = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, device=b.device, dtype=dt)
    nbytes = 2 * (q.numel() + k.numel()) * 2 + TOKENS * (8 + HEAD_DIM * 2)
    ms = b.time_ms(lambda: speedcore.rotary_embedding(positions, q, k, cos_sin, is_neox=True))

    def eager():
        cs = cos_sin[positions]
        cos, sin = cs[:, None, : HEAD_DIM // 2], cs[:, None, HEAD_DIM // 2:]
        for x in (q, k):
            x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
            r1 = x1 * cos - x2 * sin
            r2 = x2 * cos + x1 * sin
            x.copy_(torch.cat([r1, r2], dim=-1))

    peer_ms = b.time_ms(eager)
    b.add("rotary_embedding", f"{TOKENS} tok q{HEADS}+k{KV_HEADS}x{HEAD_DIM} neox bf16", "TB/s", nbytes / ms / 1e9,
          {"torch eager": nbytes / peer_ms / 1e9}, ceiling="copy")


def _gated_case(b, act):
    import speedcore

    torch = b.torch
    F = torch.nn.functional
    x = torch.randn(TOKENS, 2 * INTER, device=b.device, dtype=torch.bfloat16)
    out = torch.empty(TOKENS, INTER, device=b.device, dtype=torch.bfloat16)
    nbytes = 3 * TOKENS * INTER * 2
    fn = speedcore.silu_and_mul if act == "silu" else speedcore.gelu_and_mul
    ms = b.time_ms(lambda: fn(x, out=out))
    torch_act = F.silu if act == "silu" else F.gelu
    peer_ms = b.time_ms(lambda: torch_act(x[:, :INTER]) * x[:, INTER:])
    b.add(f"{act}_and_mul", f"{TOKENS} x {INTER} bf16", "TB/s", nbytes / ms / 1e9,
          {"torch eager": nbytes / peer_ms / 1e9}, ceiling="copy")


def cases(b):
    out = []
    shapes = SHAPES[:2] if b.quick else SHAPES
    for s in shapes:
        out.append((f"paged_decode B{s[0]} S{s[1]} H{s[2]}/{s[3]}", lambda b, s=s: _decode_case(b, *s)))
    out.append(("paged_decode_block_size 16 vs 256", _block_size_case))
    out.append(("reshape_and_cache", _reshape_and_cache_case))
    out.append(("rotary_embedding", _rotary_case))
    out.append(("silu_and_mul", lambda b: _gated_case(b, "silu")))
    out.append(("gelu_and_mul", lambda b: _gated_case(b, "gelu")))
    return out

