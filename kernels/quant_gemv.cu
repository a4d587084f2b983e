// Small-M streaming kernel (gemv_kernel, M <= 16) on the fragment-major layout made by the gemv_pack_* kernels.
// (The layout is described in common/quant.cuh.)
//
// Schedule: a persistent grid of P CTAs (2 per SM) splits the NB x KS steps evenly (stream-K): CTA c owns steps
// [c U / P, (c + 1) U / P) of the block-major order, i.e. one to a few block segments, and each of its 8 warps
// takes a contiguous eighth of every segment.  A warp streams its steps through its own ring of D cp.async
// stages (D x 1 KB of weights in flight per warp, 16 warps per SM); the ring runs on across segment ends, so the
// next segment's loads are in flight while the CTA reduces the previous one through shared memory.  A block
// that one CTA covers entirely is written directly; otherwise its CTAs add fp32 partials into a zeroed
// workspace, and the one that completes the block's step count (an atomic ticket) writes y and re-zeroes both.
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/quant.cuh"

namespace quant {

constexpr int kGemvWarps = 8;

template <int KIND, int MT> struct Gemv {
  static constexpr int NT = KIND == KIND_INT4 ? 4 : 2;  // mma tiles (16 channels) per block
  static constexpr int BN = 16 * NT;
  static constexpr int D = KIND == KIND_INT4 ? (MT == 1 ? 7 : 5) : (MT == 1 ? 8 : 6);  // ring stages
  static constexpr int W_SLOT = 1024;
  static constexpr int X_SLOT = 512 * MT;
  static constexpr int G_SLOT = KIND == KIND_INT4 ? 192 : 0;
  static constexpr int WARP_BYTES = D * (W_SLOT + X_SLOT + G_SLOT);
  static constexpr int RED_STRIDE = BN + 4;  // padded rows: the fragment-order writes hit distinct banks
  static constexpr int RED_BYTES = kGemvWarps * 8 * RED_STRIDE * 4;
  static constexpr int SMEM = kGemvWarps * WARP_BYTES + RED_BYTES;
};

// cp.async with 32-bit shared addresses (computed once per slot, not converted per copy).
__device__ __forceinline__ void cp16_s(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp8_s(unsigned dst, const void* src, unsigned src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ uint4 lds128_s(unsigned a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ uint2 lds64_s(unsigned a) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(a));
  return v;
}

// Two CTAs per SM need 2 x ~110 KB of shared memory: Hopper has it, sm_80-class parts (164 KB) run one.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define SC_GEMV_MIN_CTAS 1
#else
#define SC_GEMV_MIN_CTAS 2
#endif

template <typename T, int KIND, int MT>
__global__ void __launch_bounds__(kGemvWarps * 32, SC_GEMV_MIN_CTAS) gemv_kernel(
    T* __restrict__ y, float* __restrict__ ws, int* __restrict__ tickets, const T* __restrict__ x,
    const uint4* __restrict__ wpk, const unsigned char* __restrict__ grec, const T* __restrict__ scales,
    const T* __restrict__ bias, int M, int N, int KS, int NB, int SPG, int NG, long long ldx) {
  using C = Gemv<KIND, MT>;
  constexpr int D = C::D, NT = C::NT, BN = C::BN;
  constexpr bool INT4 = KIND == KIND_INT4;
  // M <= 8 INT4: feed (magic + q) to the mma as is and remove magic + zero point once per group, through
  // sum_k x (one extra mma per 16 k with an all-ones A): no per-weight subtraction.  M <= 16 keeps per-weight
  // (q - z) (no registers for the extra accumulators).
  constexpr bool XSUM = INT4 && MT == 1;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_last;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const unsigned ring_w = sc::smem_addr(smem) + warp * C::WARP_BYTES;
  const unsigned ring_x = ring_w + D * C::W_SLOT;
  const unsigned ring_g = ring_x + D * C::X_SLOT;
  float* red = reinterpret_cast<float*>(smem + kGemvWarps * C::WARP_BYTES);

  const long long U = (long long)NB * KS;
  const long long u0 = U * blockIdx.x / gridDim.x, u1 = U * (blockIdx.x + 1) / gridDim.x;
  if (u0 >= u1) return;
  const int b_first = (int)(u0 / KS), b_last = (int)((u1 - 1) / KS);
  // This CTA's segment of block b is [s0, s1); this warp's piece of it [lo, hi).
  auto segment = [&](int b, int& s0, int& s1) {
    const long long base = (long long)b * KS;
    s0 = (int)(max(u0, base) - base);
    s1 = (int)(min(u1, base + KS) - base);
  };
  auto piece = [&](int b, int& lo, int& hi) {
    int s0, s1;
    segment(b, s0, s1);
    lo = s0 + (warp * (s1 - s0)) / kGemvWarps;
    hi = s0 + ((warp + 1) * (s1 - s0)) / kGemvWarps;
  };

  // Loader: running source pointers of the next step to copy, steps left in the current piece, position in
  // the current group.  Everything per step is an add; a new piece (rare) recomputes them.
  const unsigned char* lw = nullptr;
  const unsigned char* lx = nullptr;
  const unsigned char* lg = nullptr;
  int lb = b_first - 1, lrem = 0, lgpos = 0, lslot = 0;
  bool lfirst = false;
  // Rows of x past M read as zeros (src-size 0) from a valid address (row 0).
  const long long x_row_bytes = ldx * (long long)sizeof(T);
  const unsigned char* x_lane = reinterpret_cast<const unsigned char*>(x) + 8 * c;
  unsigned x_bytes[MT];
  long long x_off[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const bool ok = 8 * mt + g < M;
    x_bytes[mt] = ok ? 8u : 0u;
    x_off[mt] = ok ? (8 * mt + g) * x_row_bytes : 0;
  }
  auto next_piece = [&]() {
    while (lrem == 0 && lb < b_last) {
      ++lb;
      int lo, hi;
      piece(lb, lo, hi);
      lrem = hi - lo;
      const int grp = lo / SPG;
      lgpos = lo - grp * SPG;
      lfirst = true;
      lw = reinterpret_cast<const unsigned char*>(wpk + ((long long)lb * KS + lo) * 64 + lane);
      lx = x_lane + 64LL * lo;
      lg = grec + ((long long)lb * NG + grp) * 192 + lane * 16;
    }
  };
  next_piece();
  auto issue = [&]() {
    if (lrem > 0) {
      const unsigned dw = ring_w + lslot * C::W_SLOT + lane * 16;
      cp16_s(dw, lw);
      cp16_s(dw + 512, lw + 512);
      const unsigned dx = ring_x + lslot * C::X_SLOT + lane * 8;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) cp8_s(dx + (h * MT + mt) * 256, lx + x_off[mt] + 32 * h, x_bytes[mt]);
      if constexpr (INT4) {
        if ((lfirst || lgpos == 0) && lane < 12) cp16_s(ring_g + lslot * C::G_SLOT + lane * 16, lg);
        if (++lgpos == SPG) {
          lgpos = 0;
          lg += 192;
        }
      }
      lfirst = false;
      lw += 1024;
      lx += 64;
      if (--lrem == 0) next_piece();
    }
    sc::cp_async_commit();
    if (++lslot == D) lslot = 0;
  };
#pragma unroll 1
  for (int i = 0; i < D - 1; ++i) issue();

  float acc[MT][NT][4];
  float accg[INT4 ? MT : 1][NT][4];
  float xs[XSUM ? MT : 1][2];
  float sf[8], zf[8];
  unsigned zc[8];
#pragma unroll
  for (int o = 0; o < 8; ++o) {
    sf[o] = 0.f;
    zf[o] = 0.f;
    zc[o] = 0u;
  }
#pragma unroll
  for (int mt = 0; mt < (INT4 ? MT : 1); ++mt)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) accg[mt][t][j] = 0.f;
#pragma unroll
  for (int mt = 0; mt < (XSUM ? MT : 1); ++mt) xs[mt][0] = xs[mt][1] = 0.f;
  auto flush = [&]() {
    if constexpr (INT4) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float v = accg[mt][t][j];
            if constexpr (XSUM) v = fmaf(-zf[2 * t + (j >> 1)], xs[mt][j & 1], v);
            acc[mt][t][j] = fmaf(sf[2 * t + (j >> 1)], v, acc[mt][t][j]);
            accg[mt][t][j] = 0.f;
          }
      if constexpr (XSUM) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) xs[mt][0] = xs[mt][1] = 0.f;
      }
    }
  };
  auto store_y = [&](int row, int n, float v) {
    if constexpr (!INT4) v *= sc::to_float(scales[n]);
    if (bias != nullptr) v += sc::to_float(bias[n]);
    y[(long long)row * N + n] = sc::from_float<T>(v);
  };
  constexpr unsigned MAGIC = sc::int4_magic<T>;
  // fp16 high nibbles come out as 1024 + 16 q: (.) / 16 + 960 = 1024 + q; no-XSUM: (.) / 16 - (64 + z).
  const unsigned mask_lo = 0x000f000fu, mask_hi = 0x00f000f0u, magic = MAGIC;
  const unsigned ones[4] = {Bits<T>::ONE, Bits<T>::ONE, Bits<T>::ONE, Bits<T>::ONE};

  int cslot = 0;
  for (int b = b_first; b <= b_last; ++b) {
    int lo, hi;
    piece(b, lo, hi);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[mt][t][j] = 0.f;
    int gleft = 0;
    for (int s = lo; s < hi; ++s) {
      __syncwarp();  // every lane is done reading the slot the next issue overwrites
      issue();
      sc::cp_async_wait<D - 1>();
      __syncwarp();  // the group record was copied by lanes 0..11: make it visible to all
      if constexpr (INT4) {
        if (s == lo || gleft == 0) {
          flush();
          gleft = s == lo ? SPG - lo % SPG : SPG;
          const unsigned gr = ring_g + cslot * C::G_SLOT;
          const uint4 sv = lds128_s(gr + 16 * g);
          const uint2 zv = lds64_s(gr + 128 + 8 * g);
#pragma unroll
          for (int o = 0; o < 8; ++o) {
            const float2 f = sc::unpack2<T>(sc::word(sv, o / 2));
            sf[o] = (o & 1) ? f.y : f.x;
            const unsigned z = ((o < 4 ? zv.x : zv.y) >> (8 * (o & 3))) & 0xffu;
            if constexpr (XSUM) {
              zf[o] = (float)z + (is_half<T>::value ? 1024.f : 128.f);
            } else {
              zc[o] = sc::int4_zero_term<T>(z, o & 1);  // channel g + 8 (odd o) is read as (1024 + 16 q) / 16
            }
          }
        }
        --gleft;
      }
      const unsigned wbase = ring_w + cslot * C::W_SLOT + lane * 16;
      const unsigned xbase = ring_x + cslot * C::X_SLOT + lane * 8;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 wv = lds128_s(wbase + h * 512);
        unsigned bx[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint2 xv = lds64_s(xbase + (h * MT + mt) * 256);
          bx[mt][0] = xv.x;
          bx[mt][1] = xv.y;
        }
        if constexpr (INT4) {
          if constexpr (XSUM) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              float d[4] = {xs[mt][0], xs[mt][1], 0.f, 0.f};
              sc::mma_16816<T>(d, ones, bx[mt]);
              xs[mt][0] = d[0];
              xs[mt][1] = d[1];
            }
          }
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const unsigned wd = sc::word(wv, t);
            unsigned a[4];
            if constexpr (is_half<T>::value) {
              const unsigned w8 = wd >> 8;
              const unsigned p0 = and_or(wd, mask_lo, magic), p1 = and_or(wd, mask_hi, magic);
              const unsigned p2 = and_or(w8, mask_lo, magic), p3 = and_or(w8, mask_hi, magic);
              if constexpr (XSUM) {
                a[0] = p0;
                a[1] = fma2<T>(p1, Bits<T>::SIXTEENTH, 0x63806380u);  // + 960
                a[2] = p2;
                a[3] = fma2<T>(p3, Bits<T>::SIXTEENTH, 0x63806380u);
              } else {
                a[0] = fma2<T>(p0, Bits<T>::ONE, zc[2 * t]);
                a[1] = fma2<T>(p1, Bits<T>::SIXTEENTH, zc[2 * t + 1]);
                a[2] = fma2<T>(p2, Bits<T>::ONE, zc[2 * t]);
                a[3] = fma2<T>(p3, Bits<T>::SIXTEENTH, zc[2 * t + 1]);
              }
            } else {
              const unsigned p0 = and_or(wd, mask_lo, magic), p1 = and_or(wd >> 4, mask_lo, magic);
              const unsigned p2 = and_or(wd >> 8, mask_lo, magic), p3 = and_or(wd >> 12, mask_lo, magic);
              if constexpr (XSUM) {
                a[0] = p0;
                a[1] = p1;
                a[2] = p2;
                a[3] = p3;
              } else {
                a[0] = fma2<T>(p0, Bits<T>::ONE, zc[2 * t]);
                a[1] = fma2<T>(p1, Bits<T>::ONE, zc[2 * t + 1]);
                a[2] = fma2<T>(p2, Bits<T>::ONE, zc[2 * t]);
                a[3] = fma2<T>(p3, Bits<T>::ONE, zc[2 * t + 1]);
              }
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) sc::mma_16816<T>(accg[mt][t], a, bx[mt]);
          }
        } else {
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const unsigned u0w = sc::word(wv, 2 * t), u1w = sc::word(wv, 2 * t + 1);
            const unsigned a[4] = {int8_pair<T, 0x4140u>(u0w), int8_pair<T, 0x4342u>(u0w),
                                   int8_pair<T, 0x4140u>(u1w), int8_pair<T, 0x4342u>(u1w)};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) sc::mma_16816<T>(acc[mt][t], a, bx[mt]);
          }
        }
      }
      if (++cslot == D) cslot = 0;
    }
    flush();

    // Reduce the 8 warps' partials of this segment (8 rows of x at a time), then store or accumulate.
    int s0, s1;
    segment(b, s0, s1);
    const bool full = s0 == 0 && s1 == KS;
    const int n0 = b * BN;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (8 * mt < M) {
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int j = 0; j < 4; ++j)
            red[(warp * 8 + 2 * c + (j & 1)) * C::RED_STRIDE + 16 * t + g + 8 * (j >> 1)] = acc[mt][t][j];
        __syncthreads();
        for (int item = threadIdx.x; item < 8 * BN; item += kGemvWarps * 32) {
          const int r = item / BN, ch = item % BN, row = 8 * mt + r;
          if (row < M) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < kGemvWarps; ++w) v += red[(w * 8 + r) * C::RED_STRIDE + ch];
            if (full) store_y(row, n0 + ch, v);
            else atomicAdd(ws + (long long)row * N + n0 + ch, v);
          }
        }
        __syncthreads();
      }
    }
    if (!full) {
      __threadfence();  // this thread's partial sums are visible before the ticket counts them
      __syncthreads();
      if (tid == 0) {
        const int prev = atomicAdd(tickets + b, s1 - s0);
        s_last = prev + (s1 - s0) == KS;
      }
      __syncthreads();
      if (s_last) {
        __threadfence();
        for (int item = threadIdx.x; item < M * BN; item += kGemvWarps * 32) {
          const int row = item / BN, ch = item % BN;
          float* p = ws + (long long)row * N + n0 + ch;
          const float v = __ldcg(p);
          __stcg(p, 0.f);  // the workspace stays zero between launches
          store_y(row, n0 + ch, v);
        }
        if (tid == 0) tickets[b] = 0;
      }
    }
  }
  sc::cp_async_wait<0>();
}

}  // namespace quant
