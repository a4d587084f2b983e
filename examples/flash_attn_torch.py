"""speedcore.flash_attn / flash_attn_varlen on PyTorch tensors, checked against torch SDPA."""
import torch

import speedcore

F = torch.nn.functional
b, s, h, hkv, d = 2, 1000, 16, 4, 128
qkv = torch.randn(b, s, h + 2 * hkv, d, device="cuda", dtype=torch.bfloat16)
q, k, v = qkv.split([h, hkv, hkv], dim=2)  # views of one packed projection: no copy

out, lse = speedcore.flash_attn(q, k, v, causal=True, return_lse=True)
ref = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
                                     is_causal=True, enable_gqa=True).transpose(1, 2)
print("causal GQA: max abs error vs SDPA (float32):", (out.float() - ref).abs().max().item(), "lse", lse.shape)

# varlen: three sequences of different lengths packed along the token dimension
lens = [300, 1, 699]
cu = torch.tensor([0, 300, 301, 1000], device="cuda", dtype=torch.int32)
qp, kp, vp = (torch.randn(sum(lens), h, d, device="cuda", dtype=torch.float16) for _ in range(3))
out = speedcore.flash_attn_varlen(qp, kp, vp, cu, cu, max(lens), max(lens), causal=True, window_size=(256, 0))
print("varlen + sliding window:", tuple(out.shape), out.dtype)
