"""speedcore.rms_norm on PyTorch tensors, checked against torch's own rms_norm."""
import torch

import speedcore

x = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16)
res = torch.randn_like(x)
w = torch.randn(8192, device="cuda", dtype=torch.bfloat16)

y = speedcore.rms_norm(x, w, eps=1e-6)
ref = torch.nn.functional.rms_norm(x.float(), (8192,), w.float(), 1e-6)
print("rms_norm max abs error vs torch (float32):", (y.float() - ref).abs().max().item())

y, h = speedcore.rms_norm(x, w, residual=res)
ref = torch.nn.functional.rms_norm(h.float(), (8192,), w.float(), 1e-6)
print("fused add + rms_norm max abs error:", (y.float() - ref).abs().max().item())
