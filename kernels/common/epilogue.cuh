// Activations fused into GEMM epilogues (fp32 in, fp32 out).  The code is a run-time argument: the branch is
// uniform across the grid and costs nothing next to the main loop, and it keeps the variant count down.
#pragma once

namespace sc {

enum Activation : int { ACT_NONE = 0, ACT_SILU = 1, ACT_GELU = 2, ACT_GELU_TANH = 3, ACT_RELU = 4 };

__device__ __forceinline__ float activate(float x, int act) {
  switch (act) {
    case ACT_SILU: return x / (1.f + __expf(-x));
    case ACT_GELU: return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
    case ACT_GELU_TANH: {
      const float u = 0.79788456080286536f * (x + 0.044715f * x * x * x);
      return 0.5f * x * (1.f + tanhf(u));
    }
    case ACT_RELU: return fmaxf(x, 0.f);
    default: return x;
  }
}

}  // namespace sc
