// Tensor Core GEMM for sm_80+: mma.sync m16n8k16 fed by ldmatrix from a multi-stage cp.async ring of
// XOR-swizzled shared-memory tiles, fp32 accumulation, and a fused epilogue (bias + activation).
//
//   out[m, n] = act(sum_k a[m, k] * B(k, n) + bias[n])
//
// B_KMAJOR: B(k, n) = b[n * ldb + k] (a torch.nn.Linear weight, shape (N, K)); otherwise B(k, n) =
// b[k * ldb + n] (a row-major (K, N) matrix).  K and N are multiples of 8 so every 16-byte chunk of a row is
// either wholly inside or wholly outside the matrix: out-of-range chunks are zero-filled by cp.async.
//
// One kernel covers two regimes:
//  * large M: WK = 1, warps tile the CTA's BM x BN output;
//  * skinny M (decode, M <= 64): a narrow BN, a deep BK and WK warps splitting each stage's K slice; the
//    partial sums meet in shared memory at the end.  The weight streams through the ring once, so the kernel
//    is bound by HBM bandwidth, with (STAGES - 1) stages of loads in flight per CTA.
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/epilogue.cuh"

namespace {

// Element offset of 16-byte chunk `c` of row `r` in a tile of CHUNKS chunks per row.  The XOR spreads the
// 8 rows that one ldmatrix (or ldmatrix.trans) phase reads over the 8 distinct 16-byte bank groups of a
// 128-byte line, so neither cp.async stores nor ldmatrix loads conflict.
template <int CHUNKS> __device__ __forceinline__ int swizzle(int r, int c) {
  static_assert(CHUNKS == 2 || CHUNKS == 4 || CHUNKS % 8 == 0, "unsupported tile width");
  if constexpr (CHUNKS % 8 == 0) return r * CHUNKS * 8 + ((c ^ (r & 7)) << 3);
  else if constexpr (CHUNKS == 4) return r * 32 + ((c ^ ((r >> 1) & 3)) << 3);
  else return r * 16 + ((c ^ ((r >> 2) & 1)) << 3);
}

}  // namespace

template <typename T, int BM, int BN, int BK, int WM, int WN, int WK, int STAGES, bool B_KMAJOR>
__global__ void __launch_bounds__(WM * WN * WK * 32, 1) gemm_mma_kernel(
    T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b, const T* __restrict__ bias, int M,
    int N, int K, long long lda, long long ldb, long long ldo, int act, int group_m) {
  constexpr int NT = WM * WN * WK * 32;
  constexpr int WTM = BM / WM, WTN = BN / WN;  // one warp's output tile
  constexpr int MT = WTM / 16, NT8 = WTN / 8;
  constexpr int KSTEPS = BK / 16 / WK;        // k16 steps per stage for one warp
  constexpr int A_CH = BK / 8;                // 16-byte chunks per A row
  constexpr int B_CH = B_KMAJOR ? BK / 8 : BN / 8;
  constexpr int A_TILE = BM * BK, B_TILE = BN * BK;  // elements
  static_assert(WTM % 16 == 0 && WTN % 16 == 0 && (BK / 16) % WK == 0, "bad warp tiling");
  static_assert((BM * BK / 8) % NT == 0 && (BN * BK / 8) % NT == 0, "tile loads must split evenly");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sA = reinterpret_cast<T*>(smem_raw);
  T* sB = sA + STAGES * A_TILE;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wk = warp / (WM * WN), wmn = warp % (WM * WN), wm = wmn / WN, wn = wmn % WN;

  // Grouped raster: GROUP_M row tiles sweep the column tiles together, so their B tiles stay in L2.
  const int m_tiles = (M + BM - 1) / BM, n_tiles = (N + BN - 1) / BN;
  const int per_group = group_m * n_tiles;
  const int pid = blockIdx.x;
  const int first_m = (pid / per_group) * group_m;
  const int gsize = min(m_tiles - first_m, group_m);
  const int tile_m = first_m + (pid % per_group) % gsize;
  const int tile_n = (pid % per_group) / gsize;
  const int m0 = tile_m * BM, n0 = tile_n * BN;

  // Loads of one stage: NA chunks of A then NB of B per thread, one cp.async each.
  constexpr int NA = BM * BK / 8 / NT, NB = BN * BK / 8 / NT;
  auto load_chunk = [&](int stage, int kt, int l) {
    const int k0 = kt * BK;
    if (l < NA) {
      const int idx = tid + l * NT, r = idx / A_CH, c = idx % A_CH;
      const int gm = m0 + r, gk = k0 + c * 8;
      const bool ok = gm < M && gk < K;
      sc::cp_async16(sA + stage * A_TILE + swizzle<A_CH>(r, c), ok ? a + gm * lda + gk : a, ok);
    } else {
      const int idx = tid + (l - NA) * NT, r = idx / B_CH, c = idx % B_CH;
      T* dB = sB + stage * B_TILE + swizzle<B_CH>(r, c);
      if constexpr (B_KMAJOR) {
        const int gn = n0 + r, gk = k0 + c * 8;
        const bool ok = gn < N && gk < K;
        sc::cp_async16(dB, ok ? b + gn * ldb + gk : b, ok);
      } else {
        const int gk = k0 + r, gn = n0 + c * 8;
        const bool ok = gk < K && gn < N;
        sc::cp_async16(dB, ok ? b + gk * ldb + gn : b, ok);
      }
    }
  };
  auto load_stage = [&](int stage, int kt) {
#pragma unroll
    for (int l = 0; l < NA + NB; ++l) load_chunk(stage, kt, l);
  };
  // Large tiles (WK = 1): the next stage's loads are spread over the k16 steps, each share issued behind that
  // step's mma.syncs, so address arithmetic and cp.async issue overlap the Tensor Core work instead of sitting
  // between the barrier and the first mma (where both warps of an SM sub-partition stalled on them).  Skinny
  // tiles (WK > 1) are bound by HBM and issue every load at once, as early as possible.
  constexpr bool SPREAD_LOADS = WK == 1;
  constexpr int LOADS_PER_STEP = (NA + NB + KSTEPS - 1) / KSTEPS;

  float acc[MT][NT8][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  const int KT = (K + BK - 1) / BK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT) load_stage(s, s);
    sc::cp_async_commit();
  }

  for (int kt = 0; kt < KT; ++kt) {
    sc::cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage kt is visible to all; stage kt - 1 is no longer read by anyone
    const bool load_next = kt + STAGES - 1 < KT;
    const int next_stage = (kt + STAGES - 1) % STAGES;
    if (!SPREAD_LOADS) {
      if (load_next) load_stage(next_stage, kt + STAGES - 1);
      sc::cp_async_commit();
    }

    const T* tA = sA + (kt % STAGES) * A_TILE;
    const T* tB = sB + (kt % STAGES) * B_TILE;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      const int kc = (wk * KSTEPS + ks) * 2;  // first 16-byte chunk of this k16 step
      unsigned af[MT][4], bf[NT8][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int r = wm * WTM + mt * 16 + (lane & 15);
        sc::ldmatrix_x4(af[mt][0], af[mt][1], af[mt][2], af[mt][3], tA + swizzle<A_CH>(r, kc + (lane >> 4)));
      }
#pragma unroll
      for (int np = 0; np < NT8 / 2; ++np) {
        if constexpr (B_KMAJOR) {
          const int r = wn * WTN + np * 16 + (lane & 7) + ((lane >> 4) << 3);
          sc::ldmatrix_x4(bf[2 * np][0], bf[2 * np][1], bf[2 * np + 1][0], bf[2 * np + 1][1],
                          tB + swizzle<B_CH>(r, kc + ((lane >> 3) & 1)));
        } else {
          const int r = kc * 8 + (lane & 7) + (((lane >> 3) & 1) << 3);
          const int c = (wn * WTN + np * 16) / 8 + (lane >> 4);
          sc::ldmatrix_x4_trans(bf[2 * np][0], bf[2 * np][1], bf[2 * np + 1][0], bf[2 * np + 1][1],
                                tB + swizzle<B_CH>(r, c));
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT8; ++nt) sc::mma_16816<T>(acc[mt][nt], af[mt], bf[nt]);
      if (SPREAD_LOADS && load_next) {
#pragma unroll
        for (int l = ks * LOADS_PER_STEP; l < (ks + 1) * LOADS_PER_STEP && l < NA + NB; ++l)
          load_chunk(next_stage, kt + STAGES - 1, l);
      }
    }
    if (SPREAD_LOADS) sc::cp_async_commit();
  }

  if constexpr (WK > 1) {
    // Warps that shared a stage's K range add their partial sums into the wk == 0 warps.
    constexpr int PER_WARP = MT * NT8 * 4 * 32;
    sc::cp_async_wait<0>();
    __syncthreads();
    float* red = reinterpret_cast<float*>(smem_raw);
    if (wk > 0) {
      float* dst = red + ((wk - 1) * (WM * WN) + wmn) * PER_WARP;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) dst[((mt * NT8 + nt) * 4 + e) * 32 + lane] = acc[mt][nt][e];
    }
    __syncthreads();
    if (wk > 0) return;
#pragma unroll
    for (int w = 1; w < WK; ++w) {
      const float* src = red + ((w - 1) * (WM * WN) + wmn) * PER_WARP;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] += src[((mt * NT8 + nt) * 4 + e) * 32 + lane];
    }
  }

  // Fragment layout of m16n8: c0, c1 at (row g, cols 2t, 2t+1); c2, c3 at row g + 8.
  const int g = lane >> 2, t = lane & 3;
  sc::store_fragments<T, MT, NT8>(out, ldo, bias, act, M, N, m0 + wm * WTM + g, 16, n0 + wn * WTN + 2 * t,
                                  m0 + BM <= M && n0 + BN <= N,
                                  [&](int mt, int nt, int e) { return acc[mt][nt][e]; });
}
