// Small-M register-streaming kernel (gemv_stream_kernel, M <= 16) on the fragment-major layout (common/quant.cuh).
//
// Why a second small-M kernel: at M <= 16 the op is a read of the packed weights (N K / 2 bytes) and nothing
// else, so the time is launch + bytes / HBM rate + the latency of the last loads + the reduction.  The
// cp.async ring of gemv_kernel pays shared-memory round trips, ring bookkeeping and a stream-K schedule whose
// partial blocks go through fp32 atomics; this kernel keeps the bytes in registers:
// * each warp streams a contiguous run of its block's steps in chunks of 4 steps (128 k, 4 KB): eight 16-byte
//   loads per lane straight into the mma A fragments, plus the lane's x words and the chunk's group record
//   (a chunk never straddles a group: G % 128 == 0), all issued before any of them is used; at M <= 8 each piece's
//   registers are reloaded with the next chunk's piece as soon as the math has read them (register pipeline);
// * the next chunk(s) are prefetched into L2 (one 128-byte line per lane), so a warp's effective bytes in flight
//   are 4 KB in registers plus 4 KB per prefetch distance, without registers;
// * a CTA is one 64-channel block (32 for INT8) and W warps that split its K, so the reduction is one pass
//   through shared memory and y is written directly; only when blocks x W cannot fill the GPU does K split
//   over `splits` CTAs per block (fp32 partials in a zeroed workspace, last CTA by ticket writes y).
// Single wave: the grid is sized so that every warp is resident at once (16 warps per SM at <= 128 registers)
// and all warps have equal work, so there is no tail wave.
//
// WL = 1 (INT4 only): the same math on w4_wgmma_kernel's wgmma-major copy (kernels/quant_sm90.cu,
// speedcore.quant.layouts.w4wgmma_pack_reference), so that an sm_90 layer can keep that copy alone ("compact"
// prepacking: one INT4 copy for every M).  Its words hold the same nibbles per A register as the fragment-major
// layout but at the true mma k slots (2c, 2c+1, 2c+8, 2c+9), and one 16-byte load per lane is one tile's four k16
// steps (of 64 k) instead of one k16 step's four tiles: a 128-k chunk is still eight 16-byte loads per lane (two
// 2 KB pieces, 8 KB apart), the lane's x words are two 4-byte loads per k16 step, and its group records are in
// (block / 4, group, block % 4) order.
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/quant.cuh"
#include "common/quant_stream.cuh"
#include "common/pdl.cuh"

namespace quant {

// Warps per CTA (and resident per SM): 16 at <= 128 registers; INT4 at M <= 16 holds twice the x words and
// the per-weight scale/zero pairs, which need up to 168 registers (12 warps).
template <int KIND, int MT> struct StreamWarps {
  static constexpr int MAX = (KIND == KIND_INT4 && MT == 2) ? 12 : 16;
};

// The lane's four tiles' weight words of k16 step 2u + h of a chunk held in wv (see load_w in gemv_stream_kernel).
template <int WL>
__device__ __forceinline__ uint4 step_words(const uint4 (&wv)[kStreamChunkSteps][2], int u, int h) {
  if constexpr (WL == 0) {
    return wv[u][h];
  } else {
    const int st = 2 * u + h, p = st >> 2, s = st & 3;
    return make_uint4(sc::word(wv[2 * p][0], s), sc::word(wv[2 * p][1], s), sc::word(wv[2 * p + 1][0], s),
                      sc::word(wv[2 * p + 1][1], s));
  }
}

// volatile: the compiler keeps every load of a chunk ahead of the math (left to itself it sinks some of them
// next to their first use, which puts a second memory round trip into every chunk).
__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ldg16_nc(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ldg8_nc(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// y[m, n] = sum_k x[m, k] W[k, n] for M <= 8 MT.  Grid: (NB / NBC) x splits CTAs of W = blockDim.x / 32 warps
// (W % NBC == 0); CTA group cb = blockIdx.x % (NB / NBC) owns blocks cb NBC .. cb NBC + NBC - 1, split =
// blockIdx.x / (NB / NBC); warp w takes block cb NBC + w % NBC as warp gw = split W / NBC + w / NBC of the block's
// W / NBC x splits warps, its chunks in the given order (ChunkOrder, the same for every block of the group).  So
// with NBC > 1 the group's NBC warps of one gw read the same x words at about the same time: one L2 read of x per
// SM instead of NBC (at M = 16, x is as many bytes as the INT4 weights).  NBC is a template parameter: as a
// runtime argument its arithmetic changed ptxas's schedule of the NBC = 1 kernels (4096^2 M = 16 5% slower, H200).
// Requires KS % 4 == 0 and (INT4) SPG % 4 == 0.  Dynamic shared memory: W * M * (BN + 4) floats.  `zero` must be
// 0 (see dep below).  WL: the weight layout (0 fragment-major, 1 wgmma-major; see above).
template <typename T, int KIND, int MT, int NBC = 1, int WL = 0>
__global__ void __launch_bounds__(StreamWarps<KIND, MT>::MAX * 32, 1) gemv_stream_kernel(
    T* __restrict__ y, float* __restrict__ ws, int* __restrict__ tickets, const T* __restrict__ x,
    const uint4* __restrict__ wpk, const unsigned char* __restrict__ grec, const T* __restrict__ scales,
    const T* __restrict__ bias, int M, int N, int KS, int SPG, int NG, int NB, int splits, int prefetch,
    int order, unsigned zero, long long ldx) {
  // In the register pipeline (M <= 8) the first chunk's weights and group record (constants: no kernel of the chain
  // writes them) are loaded before the wait on the chain's previous kernel, so a CTA that gets its SM while other
  // SMs still run that kernel's tail streams at once (engine, Llama-3-8B AWQ batch 1 on compact layers, H200,
  // alternated runs: 2.43 against 2.50 ms per token).  -DSC_QUANT_STREAM_LATE_W (an A/B switch): every load after
  // the wait, as before.
#if defined(SC_QUANT_STREAM_LATE_W)
  constexpr bool EARLY_W = false;
#else
  constexpr bool EARLY_W = MT == 1;
#endif
  if constexpr (!EARLY_W) sc::chain_after_previous();
  constexpr bool INT4 = KIND == KIND_INT4;
  constexpr int NT = INT4 ? 4 : 2, BN = 16 * NT, U = kStreamChunkSteps, RS = BN + 4;
  extern __shared__ __align__(16) float red[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  static_assert(NBC == 1 || MT == 2, "several blocks per CTA only at M > 8 (the register pipeline has no room)");
  static_assert(WL == 0 || KIND == KIND_INT4, "the wgmma-major layout is INT4's");
  const int W = blockDim.x >> 5, groups = NB / NBC, wk = W / NBC;
  const int cb = blockIdx.x % groups, split = blockIdx.x / groups;
  const int b = cb * NBC + warp % NBC;
  const int KC = KS / U, wpb = wk * splits, gw = split * wk + warp / NBC;
  const ChunkOrder chunk(order, KC, wpb, gw, cb);

  // WL 0: block b's KS steps of 1 KB; WL 1: 2 KB pieces [b / 4][64-k block][b % 4], piece (kb, b) at
  // wb + 512 kb (uint4) with wb at b's first piece.
  const uint4* wb = WL == 0 ? wpk + (long long)b * KS * 64 : wpk + ((long long)(b >> 2) * (KS / 2) * 4 + (b & 3)) * 128;
  const unsigned char* gb = WL == 0 ? grec + (long long)b * NG * 192 : grec + ((long long)(b >> 2) * NG * 4 + (b & 3)) * 192;
  constexpr int GSTRIDE = WL == 0 ? 192 : 4 * 192;  // bytes from one group's record of block b to the next
  // Rows of x past M read row M - 1 (a valid address); their output columns are never stored.  WL 0: the lane's
  // k 4c .. 4c+3 of a k16 step; WL 1: k 2c, 2c+1 and 2c+8, 2c+9.
  const T* xr[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) xr[mt] = x + (long long)min(8 * mt + g, M - 1) * ldx + (WL == 0 ? 4 : 2) * c;

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mt][t][j] = 0.f;

  auto prefetch_chunk = [&](int i) {
    if (i < chunk.n) {
      if constexpr (WL == 0)
        prefetch_l2(reinterpret_cast<const unsigned char*>(wb + (long long)U * chunk(i) * 64) + 128 * lane);
      else  // the chunk's two 2 KB pieces, 16 lines each
        prefetch_l2(reinterpret_cast<const unsigned char*>(wb + (long long)(2 * chunk(i) + (lane >> 4)) * 512) +
                    128 * (lane & 15));
    }
  };
  for (int d = 1; d < prefetch; ++d) prefetch_chunk(d);
  // Register slot (u, h) of wv: WL 0 the lane's four tiles' words of k16 step 2u + h; WL 1 the four k16 steps of
  // tile q % 4 in the chunk's 64-k piece q / 4, q = 2u + h.
  auto load_w = [&](int cc, int u, int h) {
    if constexpr (WL == 0) return ldg_stream(wb + (long long)U * cc * 64 + lane + u * 64 + h * 32);
    const int q = 2 * u + h;
    return ldg_stream(wb + (long long)(2 * cc + (q >> 2)) * 512 + (q & 3) * 32 + lane);
  };
  auto load_x = [&](int cc, int u, int h, int mt) {
    if constexpr (WL == 0) return ldg8_nc(xr[mt] + (U * cc + u) * 32 + 16 * h);
    const T* p = xr[mt] + (U * cc + u) * 32 + 16 * h;
    return make_uint2(__ldg(reinterpret_cast<const unsigned*>(p)), __ldg(reinterpret_cast<const unsigned*>(p + 8)));
  };
  auto group_rec = [&](int cc) { return gb + (long long)((U * cc) / SPG) * GSTRIDE; };

  // The register pipeline below at M <= 8 (H200, same run, bf16: INT8 8192^2 22.4 vs 24.3 us, 28672x8192 67.8 vs
  // 72.6 us; INT4 M = 4 16.0 vs 16.8 us); at M > 8 (166 registers) it was slower (INT8 M = 16 29.4 vs 28.2 us),
  // so there the chunk's loads come first, then its math.  -DSC_QUANT_PIPELINE_MT2 / -DSC_QUANT_STREAM_UNPIPELINED
  // force either schedule (for A/B measurements).
#if defined(SC_QUANT_STREAM_UNPIPELINED)
  constexpr bool PIPELINED = false;
#elif defined(SC_QUANT_PIPELINE_MT2)
  constexpr bool PIPELINED = true;
#else
  constexpr bool PIPELINED = MT == 1;
#endif
  if constexpr (!PIPELINED) {
  // All loads of a chunk, then its math.
#pragma unroll 1
  for (int i = 0; i < chunk.n; ++i) {
    const int cc = chunk(i);
    uint4 wv[U][2];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) wv[u][h] = load_w(cc, u, h);
    uint2 xv[U][2][MT];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) xv[u][h][mt] = load_x(cc, u, h, mt);
    uint4 sv = make_uint4(0u, 0u, 0u, 0u);
    uint2 zv = make_uint2(0u, 0u);
    if constexpr (INT4) {
      sv = ldg16_nc(group_rec(cc) + 16 * g);
      zv = ldg8_nc(group_rec(cc) + 128 + 8 * g);
    }
    if (prefetch > 0) prefetch_chunk(i + prefetch);
    // Every dequant constant depends on an XOR of all loaded words, masked by a zero the compiler cannot see:
    // all loads of the chunk stay ahead of its math.
    unsigned dep = sv.x ^ sv.y ^ sv.z ^ sv.w ^ zv.x ^ zv.y;
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        dep ^= wv[u][h].x ^ wv[u][h].y ^ wv[u][h].z ^ wv[u][h].w;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) dep ^= xv[u][h][mt].x ^ xv[u][h][mt].y;
      }
    dep &= zero;
    stream_chunk_math<T, KIND, MT>(
        acc, [&](int u, int h) { return step_words<WL>(wv, u, h); }, [&](int u, int h, int mt) { return xv[u][h][mt]; },
        sv, zv, dep, [](int, int) {});
  }
  } else {
  // Register pipeline: the chunk's 4 KB of weights and its x words sit in registers; as soon as the math has
  // read piece (u, h) of chunk i, that piece's registers are reloaded with piece (u, h) of chunk i + 1.  So a
  // warp keeps ~4 KB in flight during its math too (the unpipelined schedule had none in flight between its
  // last load's arrival and the next chunk's first load), with no more registers.
  uint4 wv[U][2];
  uint2 xv[U][2][MT];
  uint4 sv = make_uint4(0u, 0u, 0u, 0u);
  uint2 zv = make_uint2(0u, 0u);
  if constexpr (EARLY_W) {
    if (chunk.n > 0) {
      const int cc = chunk(0);
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int h = 0; h < 2; ++h) wv[u][h] = load_w(cc, u, h);
      if constexpr (INT4) {
        sv = ldg16_nc(group_rec(cc) + 16 * g);
        zv = ldg8_nc(group_rec(cc) + 128 + 8 * g);
      }
    }
    sc::chain_after_previous();  // x (and y, the workspace) only after the previous kernel has finished
    if (chunk.n > 0) {
      const int cc = chunk(0);
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) xv[u][h][mt] = load_x(cc, u, h, mt);
    }
  } else if (chunk.n > 0) {
    const int cc = chunk(0);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wv[u][h] = load_w(cc, u, h);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) xv[u][h][mt] = load_x(cc, u, h, mt);
      }
    if constexpr (INT4) {
      sv = ldg16_nc(group_rec(cc) + 16 * g);
      zv = ldg8_nc(group_rec(cc) + 128 + 8 * g);
    }
  }
#pragma unroll 1
  for (int i = 0; i < chunk.n; ++i) {
    const bool more = i + 1 < chunk.n;
    const int cn = more ? chunk(i + 1) : 0;
    if (prefetch > 0) prefetch_chunk(i + prefetch);
    if constexpr (WL == 0) {
      stream_chunk_math<T, KIND, MT>(
          acc, [&](int u, int h) { return wv[u][h]; }, [&](int u, int h, int mt) { return xv[u][h][mt]; }, sv, zv,
          0u, [&](int u, int h) {
            if (more) {
              wv[u][h] = load_w(cn, u, h);
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) xv[u][h][mt] = load_x(cn, u, h, mt);
            }
          });
    } else {  // piece by piece (stream_chunk_math_pieces): slot q refilled once its tile's four steps are read
      stream_chunk_math_pieces<T, MT>(
          acc, [&](int q) { return wv[q >> 1][q & 1]; }, [&](int u, int h, int mt) { return xv[u][h][mt]; }, sv, zv,
          0u, [&](int q) {
            if (more) {
              wv[q >> 1][q & 1] = load_w(cn, q >> 1, q & 1);
              if ((q & 3) == 3) {  // the last piece of half p: its four steps' x words are free
                const int p = q >> 2;
#pragma unroll
                for (int u = 2 * p; u < 2 * p + 2; ++u)
#pragma unroll
                  for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) xv[u][h][mt] = load_x(cn, u, h, mt);
              }
            }
          });
    }
    if (INT4 && more) {
      sv = ldg16_nc(group_rec(cn) + 16 * g);
      zv = ldg8_nc(group_rec(cn) + 128 + 8 * g);
    }
  }
  }

  stream_epilogue<T, KIND, MT, NBC>(acc, red, y, ws, tickets, scales, bias, M, N, cb, splits);
}

}  // namespace quant
