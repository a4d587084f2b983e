// Activations fused into GEMM epilogues (fp32 in, fp32 out).
//
// The activation is a compile-time tag inside the epilogue loops: a kernel reads the run-time code once and
// branches to one fully unrolled store loop per activation (with_activation).  A run-time switch inside
// every element's code (as before) inlined all activations 100+ times per thread: ~200 KB of code whose
// instruction-cache misses cost ~50 us per output tile on the H200.
#pragma once
#include "types.cuh"

namespace sc {

enum Activation : int { ACT_NONE = 0, ACT_SILU = 1, ACT_GELU = 2, ACT_GELU_TANH = 3, ACT_RELU = 4 };

template <int ACT> struct ActTag {
  static constexpr int value = ACT;
};

template <int ACT> __device__ __forceinline__ float activate(float x) {
  if constexpr (ACT == ACT_SILU) {
    // fast divide: x / (1 + e^-x) compiled to the IEEE division routine, ~20 instructions per element of a
    // 128-element-per-thread epilogue; where 1 + e^-x overflows (x < -88) __fdividef gives 0, the limit
    return __fdividef(x, 1.f + __expf(-x));
  } else if constexpr (ACT == ACT_GELU) {
    // erf by Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7, far under a bf16/fp16 ulp of the
    // result): branch-free and light on registers, where erff's branches and temporaries made the wgmma
    // kernel's epilogue (128 live accumulators) spill.
    const float z = fabsf(x) * 0.70710678118654752f;
    const float t = __fdividef(1.f, 1.f + 0.3275911f * z);
    const float p = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
    const float erf_abs = 1.f - p * __expf(-z * z);
    return 0.5f * x * (1.f + copysignf(erf_abs, x));
  } else if constexpr (ACT == ACT_GELU_TANH) {
    // tanh(u) = 1 - 2 / (1 + e^2u): a few instructions where tanhf is a long branchy routine; the absolute
    // error (~1e-7) is far below a bf16/fp16 ulp of the result, and e^2u = inf gives exactly 1
    const float u = 0.79788456080286536f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (2.f - __fdividef(2.f, 1.f + __expf(2.f * u)));
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

// out = act(acc + bias) for an accumulator tile in the m16n8 C-fragment layout (that of mma.sync m16n8 and of
// wgmma's m64nN per 8-column block): frag(mt, nt, e) is element e of 16-row block mt, 8-column block nt, at row
// row0 + mt * row_step (+ 8 for e >= 2) and columns col0 + 8 nt (+ 1 for odd e); row0 and col0 already hold the
// lane's offsets (g, 2t).  `full`: the tile lies inside M x N, so the common no-bias no-activation case stores
// without predicates.
template <typename T, int MT, int NT8, typename Frag>
__device__ __forceinline__ void store_fragments(T* __restrict__ out, long long ldo, const T* __restrict__ bias,
                                                int act, int M, int N, int row0, int row_step, int col0, bool full,
                                                Frag&& frag) {
  if (act == ACT_NONE && bias == nullptr && full) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      T* r0 = out + (long long)(row0 + mt * row_step) * ldo + col0;
      T* r8 = r0 + 8 * ldo;
#pragma unroll
      for (int nt = 0; nt < NT8; ++nt) {
        *reinterpret_cast<unsigned*>(r0 + nt * 8) = pack2<T>(frag(mt, nt, 0), frag(mt, nt, 1));
        *reinterpret_cast<unsigned*>(r8 + nt * 8) = pack2<T>(frag(mt, nt, 2), frag(mt, nt, 3));
      }
    }
    return;
  }
  with_activation(act, [&](auto tag) {
    constexpr int ACT = decltype(tag)::value;
#pragma unroll
    for (int nt = 0; nt < NT8; ++nt) {
      const int col = col0 + nt * 8;
      if (col >= N) continue;
      float b0 = 0.f, b1 = 0.f;
      if (bias != nullptr) {
        const float2 bb = unpack2<T>(*reinterpret_cast<const unsigned*>(bias + col));
        b0 = bb.x;
        b1 = bb.y;
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int row = row0 + mt * row_step;
        if (row < M)
          *reinterpret_cast<unsigned*>(out + row * ldo + col) =
              pack2<T>(activate<ACT>(frag(mt, nt, 0) + b0), activate<ACT>(frag(mt, nt, 1) + b1));
        if (row + 8 < M)
          *reinterpret_cast<unsigned*>(out + (row + 8) * ldo + col) =
              pack2<T>(activate<ACT>(frag(mt, nt, 2) + b0), activate<ACT>(frag(mt, nt, 3) + b1));
      }
    }
  });
}

}  // namespace sc
