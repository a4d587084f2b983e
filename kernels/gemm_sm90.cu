// Hopper (sm_90a) GEMM: TMA -> multi-stage shared-memory ring (mbarriers) -> wgmma, warp-specialized and
// persistent, with the fused bias + activation epilogue of kernels/gemm.cu.
//
//   out[m, n] = act(sum_k a[m, k] * B(k, n) + bias[n])
//
// a is (M, K) row-major.  B_KMAJOR: B(k, n) = b[n, k] (a Linear weight (N, K)); its ring tile is BN rows of
// 64 k.  Otherwise B(k, n) = b[k, n] (row-major (K, N)); TMA loads it as BN / 64 column blocks of 64 k rows
// x 64 n (128 bytes, swizzled), and wgmma reads it transposed (MN-major descriptor).
//
// 384 threads: warpgroup 0 is the producer (one thread issues every TMA load; its registers are given
// back with setmaxnreg.dec), warpgroups 1 and 2 are consumers that each own BM / 2 rows of the BM x BN tile
// and run m64nBNk16 wgmmas from the ring.  Tiles are handed out statically (tile = blockIdx.x + i * grid) in
// grouped order, so the producer runs ahead into the next tile while the consumers write the last one.
//
// Ring slot s holds A (BM x 64) and B (BN x 64), each row 128 bytes with the 128-byte swizzle.  full[s]
// completes when the slot's TMA bytes have landed; empty[s] completes when all 8 consumer warps are done
// reading it.  Each consumer keeps one wgmma group in flight: slot s is released after the group of slot
// s + 1 was issued and the group of slot s has retired.
#include "common/types.cuh"
#include "common/epilogue.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"

template <typename T, int BM, int BN, int STAGES, bool B_KMAJOR>
__global__ void __launch_bounds__(384, 1) gemm_wgmma_kernel(
    const __grid_constant__ sc::TmaMap tmap_a, const __grid_constant__ sc::TmaMap tmap_b, T* __restrict__ out,
    const T* __restrict__ bias, int M, int N, int K, long long ldo, int act, int group_m) {
  constexpr int BK = 64;
  constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
  constexpr int WG_M = BM / 2;     // rows per consumer warpgroup
  constexpr int MI = WG_M / 64;    // m64 blocks per consumer
  constexpr int NACC = BN / 2;     // accumulators per m64 block per thread
  static_assert(WG_M % 64 == 0 && BN % 64 == 0 && BN <= 256, "unsupported tile");

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The 128-byte swizzle pattern repeats every 1024 bytes and wgmma descriptors assume tiles aligned to it.
  unsigned char* smem = smem_raw + ((1024u - (sc::smem_addr(smem_raw) & 1023u)) & 1023u);
  unsigned char* ring_a = smem;
  unsigned char* ring_b = smem + STAGES * A_BYTES;
  unsigned long long* full = reinterpret_cast<unsigned long long*>(smem + STAGES * (A_BYTES + B_BYTES));
  unsigned long long* empty = full + STAGES;

  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      sc::mbar_init(&full[s], 1);
      sc::mbar_init(&empty[s], 8);
    }
    sc::fence_mbar_init();
  }
  __syncthreads();

  const int m_tiles = (M + BM - 1) / BM, n_tiles = (N + BN - 1) / BN, tiles = m_tiles * n_tiles;
  const int per_group = group_m * n_tiles;
  const int k_blocks = (K + BK - 1) / BK;
  auto tile_origin = [&](int tile, int& m0, int& n0) {
    const int first_m = (tile / per_group) * group_m;
    const int gsize = min(m_tiles - first_m, group_m);
    m0 = (first_m + (tile % per_group) % gsize) * BM;
    n0 = ((tile % per_group) / gsize) * BN;
  };

  if (wg == 0) {
    sc::setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      sc::tma_prefetch_map(&tmap_a);
      sc::tma_prefetch_map(&tmap_b);
      int stage = 0;
      unsigned phase = 0;
      for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int m0, n0;
        tile_origin(tile, m0, n0);
        for (int kb = 0; kb < k_blocks; ++kb) {
          sc::mbar_wait(&empty[stage], phase ^ 1);
          sc::mbar_arrive_expect_tx(&full[stage], A_BYTES + B_BYTES);
          sc::tma_load_2d(ring_a + stage * A_BYTES, &tmap_a, kb * BK, m0, &full[stage]);
          if constexpr (B_KMAJOR) {
            sc::tma_load_2d(ring_b + stage * B_BYTES, &tmap_b, kb * BK, n0, &full[stage]);
          } else {
#pragma unroll
            for (int i = 0; i < BN / 64; ++i)
              sc::tma_load_2d(ring_b + stage * B_BYTES + i * (BK * 128), &tmap_b, n0 + i * 64, kb * BK, &full[stage]);
          }
          if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
    return;
  }

  sc::setmaxnreg_inc<232>();
  const int cw = wg - 1;
  const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
  float acc[MI][NACC];
  int stage = 0;
  unsigned phase = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int m0, n0;
    tile_origin(tile, m0, n0);
    int prev_stage = -1;
    for (int kb = 0; kb < k_blocks; ++kb) {
      sc::mbar_wait(&full[stage], phase);
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int i = 0; i < NACC; ++i) sc::wgmma_fence_operand(acc[mi][i]);
      sc::wgmma_fence();
      const unsigned char* a_tile = ring_a + stage * A_BYTES + cw * WG_M * 128;
      const unsigned char* b_tile = ring_b + stage * B_BYTES;
#pragma unroll
      for (int k16 = 0; k16 < BK / 16; ++k16) {
        const unsigned long long db = B_KMAJOR ? sc::wgmma_desc_k128(b_tile + k16 * 32)
                                               : sc::wgmma_desc_mn128(b_tile + k16 * 16 * 128, BK * 128);
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
          sc::Wgmma<BN, T, B_KMAJOR ? 0 : 1>::mma(acc[mi], sc::wgmma_desc_k128(a_tile + mi * 64 * 128 + k16 * 32), db,
                                (kb > 0 || k16 > 0) ? 1 : 0);
      }
      sc::wgmma_commit();
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int i = 0; i < NACC; ++i) sc::wgmma_fence_operand(acc[mi][i]);
      // The previous slot's group has retired once at most this one is pending.
      sc::wgmma_wait<1>();
      if (prev_stage >= 0 && lane == 0) sc::mbar_arrive(&empty[prev_stage]);
      prev_stage = stage;
      if (++stage == STAGES) {
        stage = 0;
        phase ^= 1;
      }
    }
    sc::wgmma_wait<0>();
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int i = 0; i < NACC; ++i) sc::wgmma_fence_operand(acc[mi][i]);
    if (lane == 0) sc::mbar_arrive(&empty[prev_stage]);

    const int g = lane / 4, q = lane % 4;
    sc::store_fragments<T, MI, BN / 8>(out, ldo, bias, act, M, N, m0 + cw * WG_M + warp * 16 + g, 64, n0 + 2 * q,
                                       m0 + BM <= M && n0 + BN <= N,
                                       [&](int mi, int j, int e) { return acc[mi][4 * j + e]; });
  }
}
