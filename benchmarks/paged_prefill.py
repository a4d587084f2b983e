"""paged_prefill_attention (op ``paged_prefill``) against its peers in the same run, on the same data.

Chunked prefill, Llama-3-8B attention (32 query / 8 KV heads of 128, bf16): query chunks of 512 and 2048 tokens
(the last tokens of each sequence, causal bottom-right) against 0, 4k and 16k earlier cached tokens, 8192 query
tokens per call, pages of 16 and 256 tokens shuffled as an allocator leaves them.  TFLOP/s counts the visible
(query, key) pairs: 4 * heads * head_dim per pair.  Peers: our contiguous ``flash_attn_varlen`` on the same K/V
laid out contiguously, and torch SDPA's cuDNN backend on (batch, heads, seqlen, head_dim) copies where it can
express the case (a bottom-right causal mask: ``is_causal`` without cached tokens, else
``causal_lower_right`` where the backend takes it).

Speculative verification: 4 and 8 query tokens per sequence, batch 64, 4k cached tokens, pages of 16: effective
TB/s = K and V bytes / time, against ``paged_decode_attention`` (one query token per sequence) on the same cache.
"""
import speedcore
from speedcore import paged_attention

OP = "paged_prefill"
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
QUERY_TOKENS = 8192


def _paged(torch, k, block_size, device):
    """(batch, seqlen, kv_heads, d) -> shuffled pages (num_blocks, block_size, kv_heads, d) and the block table."""
    batch, s, kvh, d = k.shape
    per_seq = s // block_size
    perm = torch.randperm(batch * per_seq, device=device)
    pages = torch.empty(batch * per_seq, block_size, kvh, d, device=device, dtype=k.dtype)
    pages[perm] = k.reshape(batch * per_seq, block_size, kvh, d)
    return pages, perm.view(batch, per_seq).int()


def prefill_inputs(torch, dev, q_len, cached, block_size):
    """One chunked-prefill case's tensors (bf16): (batch, sk, q, k, v, k_cache, v_cache, block_table, cu_seqlens_q,
    cu_seqlens_k, seqused_k); k and v contiguous (batch, sk, kv_heads, d), the caches their shuffled pages."""
    dt = torch.bfloat16
    batch = max(1, QUERY_TOKENS // q_len)
    sk = cached + q_len
    q = torch.randn(batch * q_len, HEADS, HEAD_DIM, device=dev, dtype=dt)
    k = torch.randn(batch, sk, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
    v = torch.randn_like(k)
    kc, table = _paged(torch, k, block_size, dev)
    vc = torch.empty_like(kc)
    vc[table.view(-1).long()] = v.reshape(-1, block_size, KV_HEADS, HEAD_DIM)
    cu_q = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * q_len
    cu_k = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * sk
    lens = torch.full((batch,), sk, device=dev, dtype=torch.int32)
    return batch, sk, q, k, v, kc, vc, table, cu_q, cu_k, lens


def _prefill_case(b, q_len, cached, block_size):
    torch = b.torch
    batch, sk, q, k, v, kc, vc, table, cu_q, cu_k, lens = prefill_inputs(torch, b.device, q_len, cached, block_size)
    pairs = batch * (q_len * cached + q_len * (q_len + 1) // 2)
    flops = 4 * HEADS * HEAD_DIM * pairs
    out = torch.empty_like(q)

    ours_ms = b.time_ms(lambda: speedcore.paged_prefill_attention(q, kc, vc, cu_q, lens, table, q_len, sk,
                                                                  causal=True, out=out))
    got = out.clone()
    path = paged_attention.prefill_path(HEAD_DIM, torch.cuda.get_device_capability(), False, block_size)
    sm80_ms = None
    if path != "sm80":  # the portable kernel too, against the same peer timings
        sm80_ms = b.time_ms(lambda: speedcore.paged_prefill_attention(q, kc, vc, cu_q, lens, table, q_len, sk,
                                                                      causal=True, out=out, _path="sm80"))
    peers = {}
    kf, vf = k.view(-1, KV_HEADS, HEAD_DIM), v.view(-1, KV_HEADS, HEAD_DIM)
    ref = torch.empty_like(q)
    ms = b.time_ms(lambda: speedcore.flash_attn_varlen(q, kf, vf, cu_q, cu_k, q_len, sk, causal=True, out=ref))
    peers["speedcore flash_attn_varlen (contiguous)"] = flops / ms / 1e9
    err = (got.float() - ref.float()).abs().max().item()
    if not err < 5e-2:
        raise AssertionError(f"paged prefill disagrees with flash_attn_varlen by {err}")
    peers["torch SDPA CUDNN (contiguous)"] = _sdpa_cudnn(b, q.view(batch, q_len, HEADS, HEAD_DIM), k, v, flops)
    case = f"bf16 H{HEADS}/{KV_HEADS} D{HEAD_DIM} q{q_len} cached{cached} x{batch} bs{block_size}"
    b.add(OP, f"{case} [{path}]", "TFLOP/s", flops / ours_ms / 1e9, peers, ceiling="matmul")
    if sm80_ms is not None:
        b.add(OP, f"{case} [sm80]", "TFLOP/s", flops / sm80_ms / 1e9, peers, ceiling="matmul")


def _sdpa_cudnn(b, q, k, v, flops):
    """TFLOP/s of torch SDPA's cuDNN backend with a bottom-right causal mask, or None where it refuses the case."""
    torch = b.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F = torch.nn.functional
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    sq, sk = qt.shape[2], kt.shape[2]
    try:
        if sq == sk:
            kw = dict(is_causal=True)
        else:
            from torch.nn.attention.bias import causal_lower_right

            kw = dict(attn_mask=causal_lower_right(sq, sk))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True, **kw)  # noqa: E731
            fn()
            return flops / b.time_ms(fn) / 1e9
    except Exception as e:  # a backend that cannot express the case is reported, not fatal
        print(f"  SDPA CUDNN q{sq} k{sk}: unavailable: {type(e).__name__}: {str(e)[:100]}", flush=True)
        return None


def _spec_case(b, q_per_seq, batch=64, cached=4096, block_size=16):
    torch = b.torch
    dev, dt = b.device, torch.bfloat16
    sk = cached
    k = torch.randn(batch, sk, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
    kc, table = _paged(torch, k, block_size, dev)
    vc = torch.randn_like(kc)
    del k
    lens = torch.full((batch,), sk, device=dev, dtype=torch.int32)
    nbytes = 2 * kc.numel() * kc.element_size()
    q = torch.randn(batch * q_per_seq, HEADS, HEAD_DIM, device=dev, dtype=dt)
    cu_q = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * q_per_seq
    out = torch.empty_like(q)
    ours_ms = b.time_ms(lambda: speedcore.paged_prefill_attention(q, kc, vc, cu_q, lens, table, q_per_seq, sk,
                                                                  causal=True, out=out))
    q1 = torch.randn(batch, HEADS, HEAD_DIM, device=dev, dtype=dt)
    out1 = torch.empty_like(q1)
    dec_ms = b.time_ms(lambda: speedcore.paged_decode_attention(q1, kc, vc, table, lens, out=out1))
    case = f"spec verify bf16 B{batch} q{q_per_seq} cached{cached} H{HEADS}/{KV_HEADS} D{HEAD_DIM} bs{block_size}"
    print(f"  {case}: ours {ours_ms * 1e3:.1f} us, paged_decode_attention (1 token) {dec_ms * 1e3:.1f} us", flush=True)
    b.add(OP, case, "TB/s", nbytes / ours_ms / 1e9,
          {"paged_decode_attention (1 query token)": nbytes / dec_ms / 1e9}, ceiling="copy")


def cases(b):
    out = []
    grid = [(q, c, bs) for q in (512, 2048) for c in (0, 4096, 16384) for bs in (16, 256)]
    if b.quick:
        grid = [(512, 4096, 16), (2048, 16384, 256)]
    for q_len, cached, bs in grid:
        out.append((f"{OP} q{q_len} cached{cached} bs{bs}",
                    lambda b, q_len=q_len, cached=cached, bs=bs: _prefill_case(b, q_len, cached, bs)))
    for n in (4, 8):
        out.append((f"{OP} spec verify q{n}", lambda b, n=n: _spec_case(b, n)))
    return out
