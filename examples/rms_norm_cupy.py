"""speedcore.rms_norm on CuPy arrays, checked against a NumPy-style CuPy expression."""
import cupy

import speedcore

x = cupy.random.standard_normal((4096, 8192), dtype=cupy.float32).astype(cupy.float16)
w = cupy.random.standard_normal(8192, dtype=cupy.float32).astype(cupy.float16)

y = speedcore.rms_norm(x, w, eps=1e-6)
xf = x.astype(cupy.float32)
ref = xf / cupy.sqrt((xf * xf).mean(axis=-1, keepdims=True) + 1e-6) * w.astype(cupy.float32)
print(type(y).__name__, y.dtype, "max abs error:", float(cupy.abs(y.astype(cupy.float32) - ref).max()))
