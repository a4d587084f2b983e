// The chunk math, epilogue and chunk order shared by gemv_stream_kernel (kernels/quant_stream.cu) and
// gemv_bulk_kernel (kernels/quant_bulk.cu).
#pragma once

#include "quant.cuh"

namespace quant {

// The math of one chunk (4 steps x 16 k x 2 halves) of gemv_stream_kernel / gemv_bulk_kernel: wf(u, h) gives the
// lane's 16 weight bytes of step u, half h; xf(u, h, mt) its 8 bytes of x (rows 8 mt + g); sv / zv the lane's
// scales / zero points of the chunk's group (INT4); dep a zero that every dequant constant depends on; after(u, h)
// runs once the piece (u, h) has been read (gemv_stream_kernel refills its registers with the next chunk there).
//
// INT4 (XSUM): the weights go to the mma as the raw magic-number words, (magic + q) (bf16: 128 + q; fp16: 1024 + q
// for channel g, 1024 + 16 q for channel g + 8), one lop3 per pair and no per-weight zero point or scale; the
// chunk (128 k, one group) is summed in fp32 per channel, and magic + zero point come off once per chunk through
// sum_k x (one mma per 16 k and 8 rows with an all-ones A): acc += s (sum_k (magic + q) x - (magic + z) sum_k x).
// The scale is applied once per channel and chunk, to an fp32 sum (no rounding of (q - z) s to T per weight).
// Used at M <= 8 only.  At M > 8 (two 8-row x tiles) it measured slower on the H200 than the per-weight
// (q - z) s path below (same run, bf16, with the register pipeline: 8192^2 23.2 vs 22.8 us, 28672x8192 67.4 vs
// 60.4 us): the extra sum_k x mmas and the second accumulator set (166 registers) cost more than the per-weight
// fma pairs, which are not what limits M = 16 (its x words are as many bytes as the weights: each 64-channel
// CTA reads all of x from L2).  -DSC_QUANT_XSUM_MT2 turns it on at M > 8 (for A/B measurements).
#ifdef SC_QUANT_XSUM_MT2
#define SC_QUANT_XSUM_MT 2
#else
#define SC_QUANT_XSUM_MT 1
#endif
template <typename T, int KIND, int MT, typename WF, typename XF, typename AF>
__device__ __forceinline__ void stream_chunk_math(float (&acc)[MT][KIND == KIND_INT4 ? 4 : 2][4], WF wf, XF xf,
                                                  uint4 sv, uint2 zv, unsigned dep, AF after) {
  constexpr bool INT4 = KIND == KIND_INT4;
  constexpr int NT = INT4 ? 4 : 2, U = kStreamChunkSteps;
  constexpr bool XSUM = INT4 && MT <= SC_QUANT_XSUM_MT;
  constexpr bool HALF = is_half<T>::value;
  constexpr unsigned MAGIC = sc::int4_magic<T>;
  const unsigned mask_lo = 0x000f000fu, mask_hi = 0x00f000f0u;
  const unsigned magic = MAGIC | dep;
  if constexpr (XSUM) {
    float accg[MT][NT][4], xs[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      xs[mt][0] = xs[mt][1] = 0.f;
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) accg[mt][t][j] = 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 wu = wf(u, h);
        unsigned bx[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint2 xw = xf(u, h, mt);
          bx[mt][0] = xw.x;
          bx[mt][1] = xw.y;
          const unsigned ones[4] = {Bits<T>::ONE | dep, Bits<T>::ONE, Bits<T>::ONE, Bits<T>::ONE};
          float d[4] = {xs[mt][0], xs[mt][1], 0.f, 0.f};
          sc::mma_16816<T>(d, ones, bx[mt]);
          xs[mt][0] = d[0];
          xs[mt][1] = d[1];
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const unsigned wd = sc::word(wu, t);
          unsigned a[4];
          if constexpr (HALF) {
            const unsigned w8 = wd >> 8;
            a[0] = and_or(wd, mask_lo, magic);
            a[1] = and_or(wd, mask_hi, magic);  // 1024 + 16 q: the flush divides channel g + 8 by 16
            a[2] = and_or(w8, mask_lo, magic);
            a[3] = and_or(w8, mask_hi, magic);
          } else {
            a[0] = and_or(wd, mask_lo, magic);
            a[1] = and_or(wd >> 4, mask_lo, magic);
            a[2] = and_or(wd >> 8, mask_lo, magic);
            a[3] = and_or(wd >> 12, mask_lo, magic);
          }
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) sc::mma_16816<T>(accg[mt][t], a, bx[mt]);
        }
        after(u, h);
      }
    // acc += s (sum (magic + q) x - (magic + z) sum x), per channel o = 2 t + hh of this lane; fp16 channel g + 8
    // (hh = 1) summed (1024 + 16 q) x: s / 16 and 1024 + 16 z (exact powers of two apart).
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int o = 2 * t + hh;
        const float2 sp = sc::unpack2<T>(sc::word(sv, o / 2));
        float s = (o & 1) ? sp.y : sp.x;
        const unsigned z = ((o < 4 ? zv.x : zv.y) >> (8 * (o & 3))) & 0xffu;
        float zf;
        if constexpr (HALF) {
          zf = hh ? fmaf(16.f, (float)z, 1024.f) : (float)z + 1024.f;
          if (hh) s *= 0.0625f;
        } else {
          zf = (float)z + 128.f;
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = 2 * hh + e;
            acc[mt][t][j] = fmaf(s, fmaf(-zf, xs[mt][e], accg[mt][t][j]), acc[mt][t][j]);
          }
      }
  } else if constexpr (INT4) {
    unsigned scl[8], zc[8];
    int4_group_consts<T>(sv, zv, scl, zc);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 wu = wf(u, h);
        uint2 xw[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) xw[mt] = xf(u, h, mt);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const unsigned wd = sc::word(wu, t);
          unsigned a[4];
          sc::int4_fragment<T>(a, wd, scl[2 * t], scl[2 * t + 1], zc[2 * t], zc[2 * t + 1], magic);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const unsigned bx[2] = {xw[mt].x, xw[mt].y};
            sc::mma_16816<T>(acc[mt][t], a, bx);
          }
        }
        after(u, h);
      }
  } else {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 wu = wf(u, h);
        uint2 xw[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) xw[mt] = xf(u, h, mt);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const unsigned u0w = sc::word(wu, 2 * t) ^ dep, u1w = sc::word(wu, 2 * t + 1) ^ dep;
          const unsigned a[4] = {int8_pair<T, 0x4140u>(u0w), int8_pair<T, 0x4342u>(u0w),
                                 int8_pair<T, 0x4140u>(u1w), int8_pair<T, 0x4342u>(u1w)};
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const unsigned bx[2] = {xw[mt].x, xw[mt].y};
            sc::mma_16816<T>(acc[mt][t], a, bx);
          }
        }
        after(u, h);
      }
  }
}

// stream_chunk_math's INT4 math in gemv_stream_kernel's WL = 1 order (the wgmma-major copy, kernels/quant_stream.cu):
// there each of the chunk's eight 16-byte pieces is one tile's four k16 steps (piece q: 64-k half q / 4, tile q % 4),
// so the math walks piece by piece, and after(q) runs as soon as piece q has been read: the register pipeline
// refills it there (and the x words of half p after piece 4 p + 3), as early as WL = 0's per-step refills.  Walked
// step by step instead, a piece would be free only after the fourth of its steps: half the loads in flight.
// wq(q): piece q's 16 bytes; xf(u, h, mt) as for stream_chunk_math.
template <typename T, int MT, typename WQ, typename XF, typename AF>
__device__ __forceinline__ void stream_chunk_math_pieces(float (&acc)[MT][4][4], WQ wq, XF xf, uint4 sv, uint2 zv,
                                                         unsigned dep, AF after) {
  constexpr int U = kStreamChunkSteps, NT = 4;
  constexpr bool XSUM = MT <= SC_QUANT_XSUM_MT;
  constexpr bool HALF = is_half<T>::value;
  constexpr unsigned MAGIC = sc::int4_magic<T>;
  const unsigned mask_lo = 0x000f000fu, mask_hi = 0x00f000f0u;
  const unsigned magic = MAGIC | dep;
  auto bx = [&](int st, int mt, int i) {
    const uint2 xw = xf(st >> 1, st & 1, mt);
    return i ? xw.y : xw.x;
  };
  if constexpr (XSUM) {
    float accg[MT][NT][4], xs[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      xs[mt][0] = xs[mt][1] = 0.f;
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) accg[mt][t][j] = 0.f;
    }
#pragma unroll
    for (int st = 0; st < 2 * U; ++st)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const unsigned b[2] = {bx(st, mt, 0), bx(st, mt, 1)};
        const unsigned ones[4] = {Bits<T>::ONE | dep, Bits<T>::ONE, Bits<T>::ONE, Bits<T>::ONE};
        float d[4] = {xs[mt][0], xs[mt][1], 0.f, 0.f};
        sc::mma_16816<T>(d, ones, b);
        xs[mt][0] = d[0];
        xs[mt][1] = d[1];
      }
#pragma unroll
    for (int q = 0; q < 2 * U; ++q) {
      const int p = q >> 2, t = q & 3;
      const uint4 wu = wq(q);
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const unsigned wd = sc::word(wu, s);
        unsigned a[4];
        if constexpr (HALF) {
          const unsigned w8 = wd >> 8;
          a[0] = and_or(wd, mask_lo, magic);
          a[1] = and_or(wd, mask_hi, magic);
          a[2] = and_or(w8, mask_lo, magic);
          a[3] = and_or(w8, mask_hi, magic);
        } else {
          a[0] = and_or(wd, mask_lo, magic);
          a[1] = and_or(wd >> 4, mask_lo, magic);
          a[2] = and_or(wd >> 8, mask_lo, magic);
          a[3] = and_or(wd >> 12, mask_lo, magic);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const unsigned b[2] = {bx(4 * p + s, mt, 0), bx(4 * p + s, mt, 1)};
          sc::mma_16816<T>(accg[mt][t], a, b);
        }
      }
      after(q);
    }
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int o = 2 * t + hh;
        const float2 sp = sc::unpack2<T>(sc::word(sv, o / 2));
        float sc_ = (o & 1) ? sp.y : sp.x;
        const unsigned z = ((o < 4 ? zv.x : zv.y) >> (8 * (o & 3))) & 0xffu;
        float zf;
        if constexpr (HALF) {
          zf = hh ? fmaf(16.f, (float)z, 1024.f) : (float)z + 1024.f;
          if (hh) sc_ *= 0.0625f;
        } else {
          zf = (float)z + 128.f;
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = 2 * hh + e;
            acc[mt][t][j] = fmaf(sc_, fmaf(-zf, xs[mt][e], accg[mt][t][j]), acc[mt][t][j]);
          }
      }
  } else {
    unsigned scl[8], zc[8];
    int4_group_consts<T>(sv, zv, scl, zc);
#pragma unroll
    for (int q = 0; q < 2 * U; ++q) {
      const int p = q >> 2, t = q & 3;
      const uint4 wu = wq(q);
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        unsigned a[4];
        sc::int4_fragment<T>(a, sc::word(wu, s), scl[2 * t], scl[2 * t + 1], zc[2 * t], zc[2 * t + 1], magic);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const unsigned b[2] = {bx(4 * p + s, mt, 0), bx(4 * p + s, mt, 1)};
          sc::mma_16816<T>(acc[mt][t], a, b);
        }
      }
      after(q);
    }
  }
}

// The end of gemv_stream_kernel / gemv_bulk_kernel: sum the CTA's warps through shared memory (red: W * M rows of
// BN + 4 floats, rows < M only; warp w holds block cb NBC + w % NBC), then store y, or (split-K) add into the zeroed
// fp32 workspace, where the last of the block group's CTAs (ticket cb) writes y and leaves workspace and ticket
// zeroed.
template <typename T, int KIND, int MT, int NBC>
__device__ __forceinline__ void stream_epilogue(const float (&acc)[MT][KIND == KIND_INT4 ? 4 : 2][4], float* red,
                                                T* __restrict__ y, float* __restrict__ ws, int* __restrict__ tickets,
                                                const T* __restrict__ scales, const T* __restrict__ bias, int M, int N,
                                                int cb, int splits) {
  constexpr bool INT4 = KIND == KIND_INT4;
  constexpr int NT = INT4 ? 4 : 2, BN = 16 * NT, RS = BN + 4;
  __shared__ int s_last;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int W = blockDim.x >> 5;
  // Sum the W warps through shared memory: red[(warp M + row) RS + channel], rows < M only.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int row = 8 * mt + 2 * c + (j & 1);
        if (row < M) red[(warp * M + row) * RS + 16 * t + g + 8 * (j >> 1)] = acc[mt][t][j];
      }
  __syncthreads();
  const int n0 = cb * NBC * BN;
  auto store_y = [&](int row, int n, float v) {
    if constexpr (!INT4) v *= sc::to_float(scales[n]);
    if (bias != nullptr) v += sc::to_float(bias[n]);
    y[(long long)row * N + n] = sc::from_float<T>(v);
  };
  // Block j of the group: channels n0 + j BN + ch, summed over its warps j, j + NBC, ...
#pragma unroll
  for (int j = 0; j < NBC; ++j) {
    for (int item = tid; item < M * BN; item += blockDim.x) {
      const int row = item / BN, ch = item % BN, n = n0 + j * BN + ch;
      float v = 0.f;
      for (int w = j; w < W; w += NBC) v += red[(w * M + row) * RS + ch];
      if (splits == 1) store_y(row, n, v);
      else atomicAdd(ws + (long long)row * N + n, v);
    }
  }
  if (splits == 1) return;
  __threadfence();  // this thread's partial sums are visible before the ticket counts them
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(tickets + cb, 1) == splits - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
#pragma unroll
  for (int j = 0; j < NBC; ++j) {
    for (int item = tid; item < M * BN; item += blockDim.x) {
      const int row = item / BN, n = n0 + j * BN + item % BN;
      float* p = ws + (long long)row * N + n;
      const float v = __ldcg(p);
      __stcg(p, 0.f);  // the workspace stays zero between launches
      store_y(row, n, v);
    }
  }
  if (tid == 0) tickets[cb] = 0;
}

// Which chunks a warp streams, and in what order.  Warp gw of the wpb warps of a block (over its splits CTAs):
//   order 0: the contiguous run [gw KC / wpb, (gw + 1) KC / wpb), in order;
//   order 1: chunks gw, gw + wpb, gw + 2 wpb, ... (a CTA's warps sweep the block side by side);
//   order 2: order 0's run, started at a per-warp rotation (concurrent reads spread over addresses).
struct ChunkOrder {
  int base, n, stride, rot;
  __device__ __forceinline__ ChunkOrder(int order, int KC, int wpb, int gw, int b) {
    if (order == 1) {
      base = gw;
      stride = wpb;
      n = gw < KC ? (KC - gw + wpb - 1) / wpb : 0;
      rot = 0;
    } else {
      base = (int)((long long)gw * KC / wpb);
      n = (int)((long long)(gw + 1) * KC / wpb) - base;
      stride = 1;
      rot = (order == 2 && n > 0) ? (int)((7u * (unsigned)b + 3u * (unsigned)gw) % (unsigned)n) : 0;
    }
  }
  // i-th chunk, 0 <= i < n
  __device__ __forceinline__ int operator()(int i) const {
    int j = i + rot;
    if (j >= n) j -= n;
    return base + j * stride;
  }
};

}  // namespace quant
