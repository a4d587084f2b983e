// Weight and activation reorderings of the quantized linears (speedcore/quant/prepack.py): the fragment-major
// copies of a layer (gemv_pack_*_kernel; the layout is described in common/quant.cuh), GPTQ act-order's k
// permutation of the weight and the matching column gather of x.  (The tile-major copy of quant_mma_kernel is
// made by pack_tiles_kernel in kernels/quant_mma.cu, beside the loader whose shared-memory order it mirrors.)
#include "common/types.cuh"
#include "common/quant.cuh"

namespace quant {

// out[m, k] = x[m, perm[k]]: activations in the k order of an act-order GPTQ weight repacked by g_idx.
template <typename T>
__global__ void __launch_bounds__(256) gather_columns_kernel(T* __restrict__ out, const T* __restrict__ x,
                                                             const int* __restrict__ perm, int M, int K,
                                                             long long ldx) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)M * K) return;
  const int m = (int)(idx / K), k = (int)(idx % K);
  out[idx] = x[(long long)m * ldx + perm[k]];
}

// GPTQ qweight rows permuted along k: out nibble k = in nibble perm[k] (both packed 8 per int32 along k).
__global__ void __launch_bounds__(256) gptq_permute_k_kernel(int* __restrict__ out, const int* __restrict__ qw,
                                                             const int* __restrict__ perm, int K, int N,
                                                             long long ldq) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)(K / 8) * N) return;
  const int r = (int)(idx / N), n = (int)(idx % N);
  unsigned word = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int src = perm[8 * r + i];
    const unsigned q = ((unsigned)qw[(long long)(src / 8) * ldq + n] >> (4 * (src % 8))) & 15u;
    word |= q << (4 * i);
  }
  out[idx] = (int)word;
}

// Fragment-major INT4 copy for gemv_kernel: one 32-bit word per thread.  Word (b, s, h, lane, t) holds the 8
// nibbles of channels n = 64 b + 16 t + g (+ 8) at k = 32 s + 16 h + 4 c + (0..3), in the order described in
// common/quant.cuh.
template <int FMT>
__global__ void __launch_bounds__(256) gemv_pack_int4_kernel(unsigned* __restrict__ out, const int* __restrict__ qw,
                                                             int KS, long long ldq, long long total) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int t = (int)(idx & 3), lane = (int)((idx >> 2) & 31), h = (int)((idx >> 7) & 1);
  const long long rest = idx >> 8;
  const int s = (int)(rest % KS), b = (int)(rest / KS);
  const int g = lane >> 2, c = lane & 3;
  const int n_base = 64 * b + 16 * t + g, k_base = 32 * s + 16 * h + 4 * c;
  unsigned word = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int k = k_base + ((i >> 2) & 1) + ((i & 2) ? 2 : 0);
    const int n = n_base + 8 * (i & 1);
    unsigned q;
    if constexpr (FMT == AWQ) {
      const int o = n & 7;
      const int pos = (o & 1) ? 4 + (o >> 1) : (o >> 1);
      q = ((unsigned)qw[(long long)k * ldq + (n >> 3)] >> (4 * pos)) & 15u;
    } else {
      q = ((unsigned)qw[(long long)(k >> 3) * ldq + n] >> (4 * (k & 7))) & 15u;
    }
    word |= q << (4 * i);
  }
  out[idx] = word;
}

// INT4 group records for gemv_kernel: one thread per (block, group, lane group g): 8 scales (raw 16-bit) and
// 8 zero-point bytes of channels 64 b + 16 t + g + 8 h, o = 2 t + h.
template <int FMT>
__global__ void __launch_bounds__(256) gemv_pack_groups_kernel(unsigned char* __restrict__ out,
                                                               const int* __restrict__ qz,
                                                               const unsigned short* __restrict__ scales, int NG,
                                                               long long ldz, long long lds, long long total) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int g = (int)(idx & 7);
  const long long rest = idx >> 3;
  const int grp = (int)(rest % NG), b = (int)(rest / NG);
  unsigned short sv[8];
  unsigned zb[2] = {0u, 0u};
#pragma unroll
  for (int o = 0; o < 8; ++o) {
    const int n = 64 * b + 16 * (o >> 1) + g + 8 * (o & 1);
    sv[o] = scales[(long long)grp * lds + n];
    const unsigned zw = (unsigned)qz[(long long)grp * ldz + (n >> 3)];
    unsigned z;
    if constexpr (FMT == AWQ) {
      const int on = n & 7;
      z = (zw >> (4 * ((on & 1) ? 4 + (on >> 1) : (on >> 1)))) & 15u;
    } else {
      z = ((zw >> (4 * (n & 7))) & 15u) + 1u;
    }
    zb[o >> 2] |= z << (8 * (o & 3));
  }
  unsigned char* rec = out + ((long long)b * NG + grp) * 192;
  uint4 s4;
  s4.x = sv[0] | ((unsigned)sv[1] << 16);
  s4.y = sv[2] | ((unsigned)sv[3] << 16);
  s4.z = sv[4] | ((unsigned)sv[5] << 16);
  s4.w = sv[6] | ((unsigned)sv[7] << 16);
  *reinterpret_cast<uint4*>(rec + 16 * g) = s4;
  *reinterpret_cast<uint2*>(rec + 128 + 8 * g) = make_uint2(zb[0], zb[1]);
}

// Fragment-major INT8 copy for gemv_kernel: word (b, s, h, lane, j) with t = j / 2, p = j % 2 holds the bytes
// [W(g, k), W(g, k + 1), W(g + 8, k), W(g + 8, k + 1)] of channels 32 b + 16 t + g, k = 32 s + 16 h + 4 c + 2 p.
__global__ void __launch_bounds__(256) gemv_pack_int8_kernel(unsigned* __restrict__ out,
                                                             const unsigned char* __restrict__ w, int KS,
                                                             long long ldw, long long total) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int j = (int)(idx & 3), lane = (int)((idx >> 2) & 31), h = (int)((idx >> 7) & 1);
  const long long rest = idx >> 8;
  const int s = (int)(rest % KS), b = (int)(rest / KS);
  const int g = lane >> 2, c = lane & 3;
  const int n = 32 * b + 16 * (j >> 1) + g, k = 32 * s + 16 * h + 4 * c + 2 * (j & 1);
  const unsigned char* r0 = w + (long long)n * ldw + k;
  const unsigned char* r1 = r0 + 8 * ldw;
  out[idx] = (unsigned)r0[0] | ((unsigned)r0[1] << 8) | ((unsigned)r1[0] << 16) | ((unsigned)r1[1] << 24);
}

}  // namespace quant
