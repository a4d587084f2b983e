// RMSNorm and fused add + RMSNorm.
#include "common/types.cuh"
#include "common/reduce.cuh"
#include "common/pdl.cuh"

// One block per row, 16-byte accesses.  Each thread holds its NV vectors of the row in registers (as raw
// 16-byte words, not floats, to keep the register cost at 4 per vector) from the sum-of-squares pass to the
// scaling pass, so the row crosses HBM once each way.  All loads are issued before the first use.
//
// With RESIDUAL, h = x + residual is rounded to T, written to h_out, and normalized from its rounded value,
// so the returned h and the normalized output agree (as in vLLM's fused_add_rms_norm).
template <typename T, int NV, bool RESIDUAL>
__global__ void __launch_bounds__(512) rms_norm_kernel(
    T* __restrict__ out, T* __restrict__ h_out, const T* __restrict__ x, const T* __restrict__ residual,
    const T* __restrict__ weight, int hidden, long long x_stride, long long r_stride, long long o_stride,
    long long h_stride, float eps) {
  constexpr int VEC = 16 / sizeof(T);
  __shared__ float scratch[32];
  const long long row = blockIdx.x;
  const int nvec = hidden / VEC;
  const uint4* xr = reinterpret_cast<const uint4*>(x + row * x_stride);
  const uint4* rr = reinterpret_cast<const uint4*>(residual + row * r_stride);

  // The weight is loaded first, before the chain's wait (no kernel of a chain writes a weight): after the
  // reduction it would be one more memory latency on the critical path, and even beside the row it is the slower
  // load (a decode step's norms run on one row, and the weights streamed since evict it from L2).
  const uint4* wr = reinterpret_cast<const uint4*>(weight);
  uint4 a[NV];
  uint4 b[NV];
  uint4 wv[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int idx = threadIdx.x + i * blockDim.x;
    if (idx < nvec) wv[i] = wr[idx];
  }
  sc::chain_after_previous();
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int idx = threadIdx.x + i * blockDim.x;
    if (idx < nvec) {
      a[i] = xr[idx];
      if constexpr (RESIDUAL) b[i] = rr[idx];
    }
  }

  using P = sc::Pack16<T>;
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int idx = threadIdx.x + i * blockDim.x;
    if (idx < nvec) {
      float f[VEC];
      P::unpack(a[i], f);
      if constexpr (RESIDUAL) {
        float g[VEC];
        P::unpack(b[i], g);
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] += g[j];
        a[i] = P::pack(f);
        reinterpret_cast<uint4*>(h_out + row * h_stride)[idx] = a[i];
        P::unpack(a[i], f);  // normalize the rounded h that is returned
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) ss = fmaf(f[j], f[j], ss);
    }
  }
  ss = sc::block_sum(ss, scratch);
  const float rstd = rsqrtf(ss / (float)hidden + eps);

  uint4* orow = reinterpret_cast<uint4*>(out + row * o_stride);
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int idx = threadIdx.x + i * blockDim.x;
    if (idx < nvec) {
      float f[VEC], w[VEC];
      P::unpack(a[i], f);
      P::unpack(wv[i], w);
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] = f[j] * rstd * w[j];
      orow[idx] = P::pack(f);
    }
  }
}

// Any hidden size and alignment, one element per access: the row is read again for the scaling pass (from
// L1/L2, where it still is) instead of being kept in registers.
template <typename T, bool RESIDUAL>
__global__ void __launch_bounds__(512) rms_norm_rowloop_kernel(
    T* __restrict__ out, T* __restrict__ h_out, const T* __restrict__ x, const T* __restrict__ residual,
    const T* __restrict__ weight, int hidden, long long x_stride, long long r_stride, long long o_stride,
    long long h_stride, float eps) {
  __shared__ float scratch[32];
  const long long row = blockIdx.x;
  const T* xr = x + row * x_stride;
  T* hr = h_out + row * h_stride;
  float ss = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    T v = xr[i];
    if constexpr (RESIDUAL) {
      v = sc::from_float<T>(sc::to_float(v) + sc::to_float(residual[row * r_stride + i]));
      hr[i] = v;
    }
    const float f = sc::to_float(v);
    ss = fmaf(f, f, ss);
  }
  ss = sc::block_sum(ss, scratch);
  const float rstd = rsqrtf(ss / (float)hidden + eps);
  const T* src = RESIDUAL ? hr : xr;  // each thread re-reads only elements it wrote itself
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    out[row * o_stride + i] = sc::from_float<T>(sc::to_float(src[i]) * rstd * sc::to_float(weight[i]));
}
