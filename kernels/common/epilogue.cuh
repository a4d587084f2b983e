// Activations fused into GEMM epilogues (fp32 in, fp32 out).
//
// The activation is a compile-time tag inside the epilogue loops: a kernel reads the run-time code once and
// branches to one fully unrolled store loop per activation (with_activation).  A run-time switch inside
// every element's code (as before) inlined all activations 100+ times per thread: ~200 KB of code whose
// instruction-cache misses cost ~50 us per output tile on the H200.
#pragma once

namespace sc {

enum Activation : int { ACT_NONE = 0, ACT_SILU = 1, ACT_GELU = 2, ACT_GELU_TANH = 3, ACT_RELU = 4 };

template <int ACT> struct ActTag {
  static constexpr int value = ACT;
};

template <int ACT> __device__ __forceinline__ float activate(float x) {
  if constexpr (ACT == ACT_SILU) {
    return x / (1.f + __expf(-x));
  } else if constexpr (ACT == ACT_GELU) {
    return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
  } else if constexpr (ACT == ACT_GELU_TANH) {
    const float u = 0.79788456080286536f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.f + tanhf(u));
  } else if constexpr (ACT == ACT_RELU) {
    return fmaxf(x, 0.f);
  } else {
    return x;
  }
}

// Calls body(ActTag<A>{}) for the activation code `act` (unknown codes act as ACT_NONE).
template <typename F> __device__ __forceinline__ void with_activation(int act, F&& body) {
  switch (act) {
    case ACT_SILU: body(ActTag<ACT_SILU>{}); break;
    case ACT_GELU: body(ActTag<ACT_GELU>{}); break;
    case ACT_GELU_TANH: body(ActTag<ACT_GELU_TANH>{}); break;
    case ACT_RELU: body(ActTag<ACT_RELU>{}); break;
    default: body(ActTag<ACT_NONE>{}); break;
  }
}

}  // namespace sc
