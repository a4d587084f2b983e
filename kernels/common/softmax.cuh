// Pieces of the attention softmax shared by the sm_80 and sm_90 kernels: -inf, 16-bit packing of P, and the
// tanh softcap in base 2.
#pragma once
#include "types.cuh"
#include "mma.cuh"

namespace fa {

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }
constexpr float LN2 = 0.6931471805599453f;

template <typename T> __device__ __forceinline__ unsigned pack_f32x2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack_f32x2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);  // one cvt.rn.f16x2.f32
  return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack_f32x2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // one cvt.rn.bf16x2.f32
  return *reinterpret_cast<unsigned*>(&h);
}

__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// softcap * tanh(x) in base-2 score units, with tanh(x) = 1 - 2 / (1 + e^(2x)) (absolute error ~1e-7):
// pre = 2 log2(e) softmax_scale / softcap, post = softcap log2(e).
__device__ __forceinline__ float softcap_log2(float raw, float pre, float post) {
  return fmaf(-2.f * post, fast_rcp(1.f + sc::fast_exp2(raw * pre)), post);
}

}  // namespace fa
