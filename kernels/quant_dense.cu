// The dense path of the weight-only quantized linears (speedcore/quant/dense.py): the INT4 and INT8 weights
// dequantized once to fp16 / bf16, for a dense GEMM above the M the tensor-core kernels take.
#include "common/types.cuh"
#include "common/quant.cuh"

namespace quant {

// Dense dequantization W[k, n] = (q - z) * s, rounded once to T (bit-exact with the NumPy references).
// Thread (x, y) takes 8 consecutive channels (one packed word) of DEQUANT_ROWS consecutive k rows, rows striding
// by gridDim.y: 32-bit indices from the 2-D grid (one thread per word with a 64-bit index division ran at about
// half the copy rate on the H200: 20 us for 4096^2), several independent loads and 16-byte stores per thread.
// g_idx (GPTQ, may be null) gives each k's group.
constexpr int DEQUANT_ROWS = 4;

template <typename T, int FMT>
__global__ void __launch_bounds__(256) dequant_int4_kernel(T* __restrict__ out, const int* __restrict__ qw,
                                                           const int* __restrict__ qz, const T* __restrict__ scales,
                                                           const int* __restrict__ g_idx, int K, int N, int group,
                                                           long long ldq, long long ldz, long long lds) {
  const int jn = N / 8;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= jn) return;
  for (int k0 = blockIdx.y * DEQUANT_ROWS; k0 < K; k0 += gridDim.y * DEQUANT_ROWS) {
#pragma unroll
    for (int r = 0; r < DEQUANT_ROWS; ++r) {
      const int k = k0 + r;
      if (k >= K) break;
      const int grp = g_idx != nullptr ? g_idx[k] : k / group;
      const unsigned zw = (unsigned)qz[grp * ldz + j];
      float sv[8];
      sc::Pack16<T>::unpack(*reinterpret_cast<const uint4*>(scales + grp * lds + 8 * j), sv);
      unsigned qv[8];
      if constexpr (FMT == AWQ) {
        const unsigned w = (unsigned)qw[k * ldq + j];
#pragma unroll
        for (int o = 0; o < 8; ++o) qv[o] = w >> (4 * ((o & 1) ? 4 + o / 2 : o / 2));
      } else {
        const uint4* p = reinterpret_cast<const uint4*>(qw + (k / 8) * ldq + 8 * j);
        const uint4 a = p[0], b = p[1];
        const unsigned sh = 4 * (k % 8);
        qv[0] = a.x >> sh; qv[1] = a.y >> sh; qv[2] = a.z >> sh; qv[3] = a.w >> sh;
        qv[4] = b.x >> sh; qv[5] = b.y >> sh; qv[6] = b.z >> sh; qv[7] = b.w >> sh;
      }
      float f[8];
#pragma unroll
      for (int o = 0; o < 8; ++o) {
        const unsigned z = FMT == AWQ ? (zw >> (4 * ((o & 1) ? 4 + o / 2 : o / 2))) & 15u
                                      : ((zw >> (4 * o)) & 15u) + 1u;
        f[o] = ((float)(qv[o] & 15u) - (float)z) * sv[o];
      }
      *reinterpret_cast<uint4*>(out + (long long)k * N + 8 * j) = sc::Pack16<T>::pack(f);
    }
  }
}

// Dense INT8 dequantization W[n, k] = q * s[n], rounded once to T (the product is exact in float32).  One thread
// per (n, 16 consecutive k): one 16-byte load, two 16-byte stores.  (torch's int8 -> bfloat16 conversion ran at
// ~0.6 TB/s on the H200: 171 us for 8192 x 8192, three times this kernel's work at copy speed.)
template <typename T>
__global__ void __launch_bounds__(256) dequant_int8_kernel(T* __restrict__ out, const signed char* __restrict__ w,
                                                           const T* __restrict__ scales, int N, int K,
                                                           long long ldw) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int jk = K / 16;
  if (idx >= (long long)N * jk) return;
  const int n = (int)(idx / jk), j = (int)(idx % jk);
  const uint4 q = __ldcs(reinterpret_cast<const uint4*>(w + (long long)n * ldw + 16 * j));
  const float s = sc::to_float<T>(scales[n]);
  float f[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) f[i] = (float)(signed char)(sc::word(q, i / 4) >> (8 * (i % 4))) * s;
  uint4* o = reinterpret_cast<uint4*>(out + (long long)n * K + 16 * j);
  o[0] = sc::Pack16<T>::pack(f);
  o[1] = sc::Pack16<T>::pack(f + 8);
}

}  // namespace quant
