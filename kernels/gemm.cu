// Tensor Core GEMM for sm_80+: mma.sync m16n8k16 fed by ldmatrix from a multi-stage cp.async ring of
// XOR-swizzled shared-memory tiles, fp32 accumulation, and a fused epilogue (bias + activation).
//
//   out[m, n] = act(sum_k a[m, k] * B(k, n) + bias[n])
//
// B_KMAJOR: B(k, n) = b[n * ldb + k] (a torch.nn.Linear weight, shape (N, K)); otherwise B(k, n) =
// b[k * ldb + n] (a row-major (K, N) matrix).  K and N are multiples of 8 so every 16-byte chunk of a row is
// either wholly inside or wholly outside the matrix: out-of-range chunks are zero-filled by cp.async.
//
// Two kernels:
//  * gemm_mma_tile_kernel (large M): warps tile the CTA's BM x BN output, BK = 64.  Tuned for issue
//    bandwidth: each warp double-buffers its ldmatrix fragments in registers (k-step i + 1 is loaded while
//    k-step i's mma.syncs issue), the one barrier per k-tile sits behind the second-to-last k-step's mmas, and
//    the next k-tile's cp.asyncs use per-thread pointers and row masks set up once (no per-load index math);
//  * gemm_mma_kernel (skinny M, decode, M <= 64): a narrow BN, a deep BK and WK warps splitting each stage's K
//    slice; the partial sums meet in shared memory at the end.  The weight streams through the ring once, so
//    the kernel is bound by HBM bandwidth, with (STAGES - 1) stages of loads in flight per CTA.
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/epilogue.cuh"
#include "common/pdl.cuh"

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

// Grouped raster: GROUP_M row tiles sweep the column tiles together, so their B tiles stay in L2.
__device__ __forceinline__ void grouped_tile(int pid, int m_tiles, int n_tiles, int group_m, int& tile_m,
                                             int& tile_n) {
  const int per_group = group_m * n_tiles;
  const int first_m = (pid / per_group) * group_m;
  const int gsize = min(m_tiles - first_m, group_m);
  tile_m = first_m + (pid % per_group) % gsize;
  tile_n = (pid % per_group) / gsize;
}

}  // namespace

// Large tiles.  Shared memory: STAGES x (A tile BM x 64, B tile) with 128-byte rows for A and a K-major B (the
// 16-byte chunk c of row r at chunk c ^ (r & 7)), and BN * 2-byte rows for an N-major B (the same XOR on the
// low three chunk bits).  Because every row a thread loads or an ldmatrix lane reads has the same r & 7 at every
// k-step, the swizzled addresses are a per-thread base XOR a compile-time constant.
template <typename T, int BM, int BN, int WM, int WN, int STAGES, bool B_KMAJOR>
__global__ void __launch_bounds__(WM * WN * 32, 1) gemm_mma_tile_kernel(
    T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b, const T* __restrict__ bias, int M,
    int N, int K, long long lda, long long ldb, long long ldo, int act, int group_m) {
  constexpr int BK = 64, KSTEPS = BK / 16, NT = WM * WN * 32;
  constexpr int WTM = BM / WM, WTN = BN / WN, MT = WTM / 16, NT8 = WTN / 8;
  constexpr int A_STAGE = BM * BK * 2, B_STAGE = BN * BK * 2;  // bytes
  constexpr int B_ROW = B_KMAJOR ? BK * 2 : BN * 2;            // bytes per shared B row
  // cp.async geometry: a thread loads chunk column *_c of rows *_r0 + l * *_STEP.
  constexpr int A_CH = BK / 8, A_STEP = NT / A_CH, NA = BM / A_STEP;
  constexpr int B_CH = B_ROW / 16, B_STEP = NT / B_CH, NB = (B_KMAJOR ? BN : BK) / B_STEP;
  constexpr int NLOAD = NA + NB, LOADS_PER_STEP = (NLOAD + KSTEPS - 2) / (KSTEPS - 1);
  static_assert(WTM % 16 == 0 && WTN % 16 == 0 && (WTN & (WTN - 1)) == 0, "bad warp tiling");
  static_assert(NT % B_CH == 0 && A_STEP % 8 == 0 && B_STEP % 8 == 0, "rows of one thread must share r & 7");
  static_assert(BM % A_STEP == 0 && (B_KMAJOR ? BN : BK) % B_STEP == 0 && NLOAD <= 32, "tile loads must split");
  static_assert(B_KMAJOR || BN % 64 == 0, "an N-major B tile is whole 128-byte swizzle rows");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  const unsigned sA = sc::smem_addr(smem_raw), sB = sA + STAGES * A_STAGE;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp / WN, wn = warp % WN;
  int tile_m, tile_n;
  grouped_tile(blockIdx.x, (M + BM - 1) / BM, (N + BN - 1) / BN, group_m, tile_m, tile_n);
  const int m0 = tile_m * BM, n0 = tile_n * BN;

  // -- cp.async state: per-thread pointers at the k-tile being loaded (advanced once per k-tile), 32-bit row
  // offsets (the wrapper keeps BM x lda and BN x ldb below 2^31 elements), row masks and K bounds --------------
  const int a_r0 = tid / A_CH, a_c = tid % A_CH;
  const T* a_cur = a + (long long)(m0 + a_r0) * lda + a_c * 8;
  const int a_step = A_STEP * (int)lda;
  const int a_kend = K - a_c * 8;
  const unsigned a_dst = sA + a_r0 * (BK * 2) + ((a_c ^ (a_r0 & 7)) << 4);
  unsigned a_rows = 0;
#pragma unroll
  for (int l = 0; l < NA; ++l) a_rows |= (m0 + a_r0 + l * A_STEP < M ? 1u : 0u) << l;
  const int b_r0 = tid / B_CH, b_c = tid % B_CH;
  const T* b_cur = B_KMAJOR ? b + (long long)(n0 + b_r0) * ldb + b_c * 8 : b + (long long)b_r0 * ldb + n0 + b_c * 8;
  const int b_step = B_STEP * (int)ldb;
  const long long b_advance = B_KMAJOR ? BK : BK * ldb;
  const int b_kend = K - (B_KMAJOR ? b_c * 8 : b_r0);
  const unsigned b_dst = sB + b_r0 * B_ROW + ((b_c ^ (b_r0 & 7)) << 4);
  unsigned b_rows = 0;  // K-major: rows (n) inside N; N-major: the column chunk inside N (bit 0)
  if constexpr (B_KMAJOR) {
#pragma unroll
    for (int l = 0; l < NB; ++l) b_rows |= (n0 + b_r0 + l * B_STEP < N ? 1u : 0u) << l;
  } else {
    b_rows = n0 + b_c * 8 < N ? 1u : 0u;
  }
  int k_load = 0;  // first k of the k-tile the pointers are at
  // Load l of that k-tile into ring slot `slot` (l < NA: A, else B).  Past K (or M, N) cp.async zero-fills.
  auto load = [&](int l, int slot) {
    if (l < NA) {
      const bool ok = ((a_rows >> l) & 1u) && k_load < a_kend;
      sc::cp_async16_s(a_dst + slot * A_STAGE + l * A_STEP * (BK * 2), ok ? a_cur + l * a_step : a, ok);
    } else {
      const int lb = l - NA;
      const bool ok = B_KMAJOR ? ((b_rows >> lb) & 1u) && k_load < b_kend : b_rows && k_load + lb * B_STEP < b_kend;
      sc::cp_async16_s(b_dst + slot * B_STAGE + lb * B_STEP * B_ROW, ok ? b_cur + lb * b_step : b, ok);
    }
  };
  auto next_k_tile = [&]() {
    a_cur += BK;
    b_cur += b_advance;
    k_load += BK;
  };

  // -- ldmatrix addresses: base of slot 0, k-step 0; the k-step (and the N-major column pair) is an XOR ------
  // A: lane reads row (lane & 15), chunk 2 ks + (lane >> 4) of each 16-row block.
  const unsigned a_lds = sA + (wm * WTM + (lane & 15)) * (BK * 2);
  const unsigned a_x = ((lane >> 4) ^ (lane & 7)) << 4;
  // K-major B: row (lane & 7) + 8 (lane >> 4), chunk 2 ks + ((lane >> 3) & 1) of each 16-row block.
  // N-major B: row 16 ks + (lane & 7) + 8 ((lane >> 3) & 1), chunk WTN / 8 wn + 2 np + (lane >> 4).
  const unsigned b_lds = B_KMAJOR ? sB + (wn * WTN + (lane & 7) + ((lane >> 4) << 3)) * B_ROW
                                  : sB + ((lane & 7) + (((lane >> 3) & 1) << 3)) * B_ROW;
  const unsigned b_x = B_KMAJOR ? (((lane >> 3) & 1) ^ (lane & 7)) << 4
                                : ((wn * (WTN / 8)) ^ (lane >> 4) ^ (lane & 7)) << 4;

  unsigned af[2][MT][4], bf[2][NT8][2];
  auto load_frags = [&](int buf, int slot, int ks) {
    const unsigned a_base = a_lds + slot * A_STAGE + (a_x ^ (ks * 32));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) sc::ldmatrix_x4_s(af[buf][mt], a_base + mt * 16 * (BK * 2));
#pragma unroll
    for (int np = 0; np < NT8 / 2; ++np) {
      unsigned r[4];
      if constexpr (B_KMAJOR) {
        sc::ldmatrix_x4_s(r, b_lds + slot * B_STAGE + (b_x ^ (ks * 32)) + np * 16 * B_ROW);
      } else {
        sc::ldmatrix_x4_trans_s(r, b_lds + slot * B_STAGE + (b_x ^ (np * 32)) + ks * 16 * B_ROW);
      }
      bf[buf][2 * np][0] = r[0];
      bf[buf][2 * np][1] = r[1];
      bf[buf][2 * np + 1][0] = r[2];
      bf[buf][2 * np + 1][1] = r[3];
    }
  };

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
#pragma unroll
    for (int l = 0; l < NLOAD; ++l) load(l, s);
    sc::cp_async_commit();
    next_k_tile();
  }
  sc::cp_async_wait<STAGES - 2>();
  __syncthreads();
  load_frags(0, 0, 0);

  int read_slot = 0, write_slot = STAGES - 1;
  for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      // Fragments of the next k-step (the next k-tile's first at the last step; its slot passed the barrier).
      if (ks < KSTEPS - 1 || kt + 1 < KT) load_frags((ks + 1) & 1, read_slot, (ks + 1) % KSTEPS);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < NT8; ++nt) sc::mma_16816<T>(acc[mt][nt], af[ks & 1][mt], bf[ks & 1][nt]);
        // k-tile kt + STAGES - 1 goes into the slot last read at k-tile kt - 1 (before its barrier), a share of
        // its cp.asyncs behind each row of mma.syncs.  No branch around them: past the last k-tile the K bound
        // fails and cp.async zero-fills a slot nobody reads again.  (A branch kept the address math in one
        // block after the k-step's mma.syncs, where it stalled the warp and, with the warps in step after the
        // barrier, the Tensor Cores.)
        if (ks < KSTEPS - 1) {
#pragma unroll
          for (int i = mt * LOADS_PER_STEP / MT; i < (mt + 1) * LOADS_PER_STEP / MT; ++i)
            if (ks * LOADS_PER_STEP + i < NLOAD) load(ks * LOADS_PER_STEP + i, write_slot);
        }
      }
      if (ks == KSTEPS - 2) {
        // After this barrier k-tile kt + 1 has landed and is visible to every warp, and every warp has read
        // all of k-tile kt's fragments (the last k-step's just above), so k-tile kt + 1's loop may refill its
        // slot.  The mma.syncs issued before it keep the Tensor Cores busy across the wait.
        sc::cp_async_commit();
        next_k_tile();
        sc::cp_async_wait<STAGES - 2>();
        __syncthreads();
        read_slot = read_slot + 1 == STAGES ? 0 : read_slot + 1;
      }
    }
    write_slot = write_slot + 1 == STAGES ? 0 : write_slot + 1;
  }
  sc::cp_async_wait<0>();  // the zero-fills past the end must not land in the next CTA's shared memory

  const int g = lane >> 2, t = lane & 3;
  sc::store_fragments<T, MT, NT8>(out, ldo, bias, act, M, N, m0 + wm * WTM + g, 16, n0 + wn * WTN + 2 * t,
                                  m0 + BM <= M && n0 + BN <= N,
                                  [&](int mt, int nt, int e) { return acc[mt][nt][e]; });
}

template <typename T, int BM, int BN, int BK, int WM, int WN, int WK, int STAGES, bool B_KMAJOR, bool EARLY_B = false>
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
  // Decode-sized M runs chained (speedcore._launch.chained).  (Prefetching this CTA's first weight rows into L2
  // before the wait was measured: engine batch-1 decode 4.8 ms per token with it against 4.55 without, same H200
  // run.)  EARLY_B (speedcore.gemm.linear's chained decode GEMMs, whose B is a weight that no kernel of the chain
  // writes): the first stages' B tiles go into shared memory before the wait, the A tiles after it (one commit group
  // then holds every early B tile and stage 0's A tile), so a CTA that gets its SM while the previous kernel's last
  // CTAs still run starts streaming at once (engine, Llama-3-8B bf16 batch 1, H200, alternated runs: 4.48 against
  // 4.62 ms per token).
  if constexpr (EARLY_B) {
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < KT) {
#pragma unroll
      for (int l = NA; l < NA + NB; ++l) load_chunk(s, s, l);
    }
  sc::chain_after_previous();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT) {
#pragma unroll
      for (int l = 0; l < NA; ++l) load_chunk(s, s, l);
    }
    sc::cp_async_commit();
  }
  } else {
  sc::chain_after_previous();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT) load_stage(s, s);
    sc::cp_async_commit();
  }
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
