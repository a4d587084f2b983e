// Hopper (sm_90a) GEMM: TMA -> multi-stage shared-memory ring (mbarriers) -> wgmma, warp-specialized and
// persistent, with the fused bias + activation epilogue written back by TMA stores.
//
//   out[m, n] = act(sum_k a[m, k] * B(k, n) + bias[n])
//
// a is (M, K) row-major.  B_KMAJOR: B(k, n) = b[n, k] (a Linear weight (N, K)); its ring tile is BN rows of
// 64 k.  Otherwise B(k, n) = b[k, n] (row-major (K, N)); TMA loads it as BN / 64 column blocks of 64 k rows
// x 64 n (128 bytes, swizzled), and wgmma reads it transposed (MN-major descriptor).
//
// 384 threads: warpgroup 0 is the producer (one thread issues every TMA load; its registers are given
// back with setmaxnreg.dec), warpgroups 1 and 2 are consumers.  With BM >= 128 each consumer owns BM / 2 rows
// of the BM x BN tile; with BM = 64 (decode-sized M) each owns BN / 2 columns of it.  Tiles are handed out
// statically (tile = blockIdx.x + i * grid) in grouped order, so the producer runs ahead into the next tile
// while the consumers finish the last one.
//
// Ring slot s holds A (BM x 64) and B (BN x 64), each row 128 bytes with the 128-byte swizzle.  full[s]
// completes when the slot's TMA bytes have landed; empty[s] completes when all 8 consumer warps are done
// reading it.  Each consumer keeps one wgmma group in flight: slot s is released after the group of slot
// s + 1 was issued and the group of slot s has retired.
//
// Split-K (splits > 1, decode-sized M whose tiles alone leave SMs idle): a work unit is (tile, split), the splits
// of a tile adjacent in the unit order, split s taking k blocks [s KB / splits, (s + 1) KB / splits).  Each unit
// writes its fp32 partial to ws (splits x M x N) and takes a ticket of its tile (tickets: one zeroed int32 per tile,
// left zeroed); the tile's last unit sums the partials in split order (the same bits whichever unit is last) into
// its accumulators and runs the epilogue.
//
// Epilogue: each consumer converts its accumulators (+ bias, activation) into a swizzled staging buffer of its
// own and one of its threads stores it with TMA (asynchronously: the consumer goes on with the next tile's
// wgmmas while the global writes drain, so the Tensor Cores no longer idle for the whole store).  The store
// clips at M and N, so partial tiles need no predicates.  A warpgroup tile larger than the staging buffer
// goes out in rounds; a round waits only until the previous round's TMA store has read the buffer.
#include "common/types.cuh"
#include "common/epilogue.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"

namespace {

// The epilogue's store boxes: 64 rows x SB columns, rows of SB * 2 bytes stored with the swizzle of that width
// (128, 64 or 32 bytes), which spreads one warp's 8 rows x 16 bytes over all 32 banks.
template <int WG_N> struct StoreBox {
  static constexpr int SB = WG_N % 64 == 0 ? 64 : (WG_N % 32 == 0 ? 32 : 16);
  static constexpr int BYTES = 64 * SB * 2;
  static constexpr int MASK = SB * 2 / 16 - 1;  // 16-byte chunks per row, minus one
  static __device__ __forceinline__ int offset(int row, int col) {
    const int o = row * (SB * 2) + col * 2;
    return o ^ (((o >> 7) & MASK) << 4);
  }
};

constexpr int kEpiBytes = 16384;  // staging buffer per consumer warpgroup (at most)

}  // namespace

template <typename T, int BM, int BN, int STAGES, bool B_KMAJOR>
__global__ void __launch_bounds__(384, 1) gemm_wgmma_kernel(
    const __grid_constant__ sc::TmaMap tmap_a, const __grid_constant__ sc::TmaMap tmap_b,
    const __grid_constant__ sc::TmaMap tmap_out, const T* __restrict__ bias, int M, int N, int K, int act,
    int group_m, float* __restrict__ ws, int* __restrict__ tickets, int splits) {
  constexpr int BK = 64;
  constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
  constexpr bool SPLIT_N = BM == 64;             // consumers split the columns instead of the rows
  constexpr int WG_M = SPLIT_N ? 64 : BM / 2;    // rows per consumer warpgroup
  constexpr int WG_N = SPLIT_N ? BN / 2 : BN;    // columns per consumer warpgroup
  constexpr int MI = WG_M / 64;                  // m64 blocks per consumer
  constexpr int NACC = WG_N / 2;                 // accumulators per m64 block per thread
  static_assert(WG_M % 64 == 0 && WG_N % 16 == 0 && WG_N <= 256, "unsupported tile");
  static_assert(B_KMAJOR || WG_N % 64 == 0, "an N-major B is read in 64-column blocks");
  static_assert(A_BYTES % 1024 == 0 && B_BYTES % 1024 == 0, "ring tiles must keep 1024-byte alignment");
  using Box = StoreBox<WG_N>;
  constexpr int NBOX_N = WG_N / Box::SB, NBOX = MI * NBOX_N;
  constexpr int EPI_BYTES = NBOX * Box::BYTES < kEpiBytes ? NBOX * Box::BYTES : kEpiBytes;
  constexpr int BOX_PER_ROUND = EPI_BYTES / Box::BYTES;
  constexpr int ROUNDS = (NBOX + BOX_PER_ROUND - 1) / BOX_PER_ROUND;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The 128-byte swizzle pattern repeats every 1024 bytes and wgmma descriptors assume tiles aligned to it.
  unsigned char* smem = smem_raw + ((1024u - (sc::smem_addr(smem_raw) & 1023u)) & 1023u);
  unsigned char* ring_a = smem;
  unsigned char* ring_b = smem + STAGES * A_BYTES;
  unsigned char* staging = ring_b + STAGES * B_BYTES;
  unsigned long long* full = reinterpret_cast<unsigned long long*>(staging + 2 * EPI_BYTES);
  unsigned long long* empty = full + STAGES;
  volatile int* s_last = reinterpret_cast<volatile int*>(empty + STAGES);  // split-K: this unit sums the tile

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
  const int units = tiles * splits;  // splits <= k_blocks (the host's choice): every unit has a k block
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
      for (int u = blockIdx.x; u < units; u += gridDim.x) {
        int m0, n0;
        tile_origin(u / splits, m0, n0);
        const int split = u % splits;
        for (int kb = split * k_blocks / splits; kb < (split + 1) * k_blocks / splits; ++kb) {
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
  const int wg_m0 = SPLIT_N ? 0 : cw * WG_M, wg_n0 = SPLIT_N ? cw * WG_N : 0;  // this consumer's sub-tile
  unsigned char* epi = staging + cw * EPI_BYTES;
  if (t == 0) sc::tma_prefetch_map(&tmap_out);
  // One copy of the consumer loop per activation (the launch runs one): a switch inside the loop kept
  // values live across five epilogues and made the 256 x 128 tile spill.
  sc::with_activation(act, [&](auto tag) {
    constexpr int ACT = decltype(tag)::value;
    float acc[MI][NACC];
    int stage = 0;
    unsigned phase = 0;
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
      int m0, n0;
      const int tile = u / splits, split = u % splits;
      tile_origin(tile, m0, n0);
      int prev_stage = -1;
      const int kb0 = split * k_blocks / splits, kb1 = (split + 1) * k_blocks / splits;
      for (int kb = kb0; kb < kb1; ++kb) {
        sc::mbar_wait(&full[stage], phase);
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int i = 0; i < NACC; ++i) sc::wgmma_fence_operand(acc[mi][i]);
        sc::wgmma_fence();
        const unsigned char* a_tile = ring_a + stage * A_BYTES + wg_m0 * 128;
        const unsigned char* b_tile =
            ring_b + stage * B_BYTES + (B_KMAJOR ? wg_n0 * 128 : (wg_n0 / 64) * (BK * 128));
#pragma unroll
        for (int k16 = 0; k16 < BK / 16; ++k16) {
          const unsigned long long db = B_KMAJOR ? sc::wgmma_desc_k128(b_tile + k16 * 32)
                                                 : sc::wgmma_desc_mn128(b_tile + k16 * 16 * 128, BK * 128);
#pragma unroll
          for (int mi = 0; mi < MI; ++mi)
            sc::Wgmma<WG_N, T, B_KMAJOR ? 0 : 1>::mma(acc[mi], sc::wgmma_desc_k128(a_tile + mi * 64 * 128 + k16 * 32),
                                                    db, (kb > kb0 || k16 > 0) ? 1 : 0);
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

      // Accumulator (mi, 8-column block j, e) sits at row mi * 64 + 16 warp + g (+ 8 for e >= 2) and column
      // 8 j + 2 q (+ 1 for odd e) of this consumer's sub-tile.
      const int g = lane / 4, q = lane % 4;
      if (splits > 1) {
        // This lane's accumulators (mi, j, 2 h + e) are row r0 + 64 mi + 8 h and column c0 + 8 j + e of the output;
        // columns come in pairs (N % 8 == 0: a pair is inside N or outside it).
        const int r0 = m0 + wg_m0 + 16 * warp + g, c0 = n0 + wg_n0 + 2 * q;
        float* const part = ws + (long long)split * M * N;
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = r0 + 64 * mi + 8 * h;
            if (row < M) {
#pragma unroll
              for (int j = 0; j < WG_N / 8; ++j)
                if (c0 + 8 * j < N)
                  *reinterpret_cast<float2*>(part + (long long)row * N + c0 + 8 * j) =
                      make_float2(acc[mi][4 * j + 2 * h], acc[mi][4 * j + 2 * h + 1]);
            }
          }
        __threadfence();
        sc::named_bar_sync(3, 256);  // both consumers' partials are out
        if (threadIdx.x == 128) {
          const int done = atomicAdd(&tickets[tile], 1);
          *s_last = done == splits - 1;
          if (done == splits - 1) tickets[tile] = 0;
        }
        sc::named_bar_sync(3, 256);
        if (!*s_last) continue;  // another unit of this tile finishes it
        __threadfence();
        // The tile's sum in split order, this unit's own partial read back with the others: the same bits whichever
        // unit is last.  Split by split with all of a split's loads in flight together (one L2 round trip per
        // split, not per element and split).  Rows and columns outside the output stay 0 (the TMA store clips them).
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int i = 0; i < NACC; ++i) acc[mi][i] = 0.f;
        for (int sp = 0; sp < splits; ++sp) {
          const float* const p = ws + (long long)sp * M * N;
#pragma unroll
          for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int row = r0 + 64 * mi + 8 * h;
              if (row < M) {
                const float* const prow = p + (long long)row * N + c0;
#pragma unroll
                for (int j = 0; j < WG_N / 8; ++j)
                  if (c0 + 8 * j < N) {
                    const float2 v = __ldcg(reinterpret_cast<const float2*>(prow + 8 * j));
                    acc[mi][4 * j + 2 * h] += v.x;
                    acc[mi][4 * j + 2 * h + 1] += v.y;
                  }
              }
            }
        }
      }
      // This lane's byte offsets in a store box (rows g and g + 8 of its warp's 16, column 2 q); column block j
      // adds 16 j bytes, which the swizzle turns into an XOR on the chunk bits (rows are 16 and 8 apart, so
      // the row's swizzle bits are those of g).
      const int lane_offset[2] = {Box::offset(16 * warp + g, 2 * q), Box::offset(16 * warp + g + 8, 2 * q)};
#pragma unroll
      for (int r = 0; r < ROUNDS; ++r) {
        // The staging buffer is free once the previous TMA store has read it.
        if (t == 0) sc::bulk_wait_group_read<0>();
        sc::named_bar_sync(1 + cw, 128);
#pragma unroll
        for (int j = 0; j < WG_N / 8; ++j) {
          float b0 = 0.f, b1 = 0.f;
          const int col = n0 + wg_n0 + 8 * j + 2 * q;
          if (bias != nullptr && col < N) {
            const float2 bb = sc::unpack2<T>(*reinterpret_cast<const unsigned*>(bias + col));
            b0 = bb.x;
            b1 = bb.y;
          }
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            const int box = mi * NBOX_N + (8 * j) / Box::SB;
            if (box / BOX_PER_ROUND != r) continue;
            unsigned char* dst = epi + (box % BOX_PER_ROUND) * Box::BYTES;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float v0 = sc::activate<ACT>(acc[mi][4 * j + 2 * h] + b0);
              const float v1 = sc::activate<ACT>(acc[mi][4 * j + 2 * h + 1] + b1);
              *reinterpret_cast<unsigned*>(dst + (lane_offset[h] ^ (((8 * j) % Box::SB) * 2))) = sc::pack2<T>(v0, v1);
            }
          }
        }
        sc::fence_proxy_async();
        sc::named_bar_sync(1 + cw, 128);
        if (t == 0) {
#pragma unroll
          for (int b = r * BOX_PER_ROUND; b < NBOX && b < (r + 1) * BOX_PER_ROUND; ++b)
            sc::tma_store_2d(&tmap_out, epi + (b % BOX_PER_ROUND) * Box::BYTES,
                             n0 + wg_n0 + (b % NBOX_N) * Box::SB, m0 + wg_m0 + (b / NBOX_N) * 64);
          sc::bulk_commit_group();
        }
      }
    }
  });
  // Shared memory must outlive the stores' reads; the writes complete before the grid does.
  if (t == 0) sc::bulk_wait_group<0>();
}
