// Element types, conversions and vector types shared by every kernel family.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace sc {

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// N elements of T moved as one access (16 bytes for 8 halves or 4 floats).
template <typename T, int N> struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Two floats to one 32-bit word of two 16-bit values (low half first: the layout of mma.sync operands and of
// memory), and back.  Bit operations only, so nothing is forced into local memory.
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
  return (unsigned)__half_as_ushort(__float2half_rn(lo)) | ((unsigned)__half_as_ushort(__float2half_rn(hi)) << 16);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
  return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
         ((unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}
template <typename T> __device__ __forceinline__ float2 unpack2(unsigned w);
template <> __device__ __forceinline__ float2 unpack2<__half>(unsigned w) {
  return make_float2(__half2float(__ushort_as_half((unsigned short)(w & 0xffffu))),
                     __half2float(__ushort_as_half((unsigned short)(w >> 16))));
}
template <> __device__ __forceinline__ float2 unpack2<__nv_bfloat16>(unsigned w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

__device__ __forceinline__ unsigned word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
__device__ __forceinline__ void set_word(uint4& v, int i, unsigned w) {
  if (i == 0) v.x = w; else if (i == 1) v.y = w; else if (i == 2) v.z = w; else v.w = w;
}

// A 16-byte word of T (8 halves or 4 floats) to floats and back; call with compile-time loop indices.
template <typename T> struct Pack16 {
  static constexpr int N = 16 / sizeof(T);
  static __device__ __forceinline__ void unpack(const uint4& v, float* f) {
    if constexpr (sizeof(T) == 4) {
#pragma unroll
      for (int k = 0; k < 4; ++k) f[k] = __uint_as_float(word(v, k));
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 p = unpack2<T>(word(v, k));
        f[2 * k] = p.x;
        f[2 * k + 1] = p.y;
      }
    }
  }
  static __device__ __forceinline__ uint4 pack(const float* f) {
    uint4 v;
    if constexpr (sizeof(T) == 4) {
#pragma unroll
      for (int k = 0; k < 4; ++k) set_word(v, k, __float_as_uint(f[k]));
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) set_word(v, k, pack2<T>(f[2 * k], f[2 * k + 1]));
    }
    return v;
  }
};

}  // namespace sc
