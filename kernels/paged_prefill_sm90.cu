// Chunked prefill on sm_90a (H100/H200): the warp-specialized wgmma / TMA kernel of kernels/attention_sm90.cu (see
// its header for the pipeline: a producer warpgroup issuing TMA loads into an mbarrier ring, two or three consumer
// warpgroups overlapping the softmax of one key block with the P V wgmma of the previous, a persistent grid claiming
// tiles from a per-stream counter), copied here because its producer's K/V loads and its tile descriptor differ.
#include "common/types.cuh"
#include "common/softmax.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"

namespace pa90 {

// Where the epilogue stages O for its TMA store: its own buffer when Q, the K/V ring and O fit in 200 KB (head
// dims up to 128), else Q's buffer (each consumer overwrites only its own 64 rows of Q, after its last S; Q is
// then released only once the store has read them).  speedcore/attention.py's smem_bytes_sm90 mirrors this.
__host__ __device__ constexpr bool o_has_own_buffer(int q_bytes, int kv_ring_bytes) {
  return 2 * q_bytes + kv_ring_bytes <= 200 * 1024;
}

// n / d for 0 <= n < 2^31 and 1 <= d < 2^31 by a multiply and a shift (the round-up method, "add" variant): the
// multiplier is computed once per thread, and a tile's descriptor then costs no division.
struct FastDiv {
  unsigned mul;
  int shift, d;
  __device__ __forceinline__ explicit FastDiv(int divisor) : d(divisor) {
    shift = 32 - __clz(divisor - 1);
    mul = (unsigned)(((1ull << 32) * ((1ull << shift) - (unsigned)divisor)) / (unsigned)divisor + 1);
  }
  __device__ __forceinline__ int div(int n) const { return (int)((__umulhi((unsigned)n, mul) + (unsigned)n) >> shift); }
};
// The producer's choice: its 32 registers cannot hold the multipliers, and its divisions are off the critical path.
struct PlainDiv {
  int d;
  __device__ __forceinline__ int div(int n) const { return n / d; }
};

// Everything about one tile, derived from its index.  The producer derives it and hands it to two consumers
// through shared memory (three consumers, short of registers, derive it again from `index`): derived on the
// consumers' path it cost about 0.5 us per tile (two integer divisions and a long dependent chain of uniform-
// datapath arithmetic, measured with -DFA90_TRACE), all of it between one tile's epilogue and the next tile's
// first GEMM.  `index` is the tile's number (num_tiles or more: no more tiles).  In shared memory: three 16-byte
// words (k_off, which the consumers do not use, is not read back).
struct Tile {
  int m0, head, batch, q_off, k_off, sq, sk, rows_q, n_begin, n_end, index;
};
__device__ __forceinline__ void store_tile(int4* to, const Tile& t) {
  to[0] = make_int4(t.m0, t.head, t.batch, t.q_off);
  to[1] = make_int4(t.k_off, t.sq, t.sk, t.rows_q);
  to[2] = make_int4(t.n_begin, t.n_end, t.index, 0);
}
// Every lane gets lane 0's copy: provably warp-uniform values keep ptxas from serializing the wgmmas (and let it
// keep them in uniform registers).
__device__ __forceinline__ Tile load_tile_uniform(const int4* from) {
  const volatile int* const f = reinterpret_cast<const volatile int*>(from);
  auto u = [&](int i) { return __shfl_sync(0xffffffffu, f[i], 0); };
  Tile t;
  t.m0 = u(0), t.head = u(1), t.batch = u(2), t.q_off = u(3);
  t.k_off = 0, t.sq = u(5), t.sk = u(6), t.rows_q = u(7);
  t.n_begin = u(8), t.n_end = u(9), t.index = u(10);
  return t;
}

template <typename Div>
__device__ __forceinline__ Tile tile_info(int tile, const Div& group, int group_log2, int num_m, const Div& nheads,
                                          int reverse_m, const int* cu_q, const int* seqused_k, int total_q,
                                          int max_len, int window_left, int window_right, int bm, int bn) {
  Tile t;
  // Tiles come in groups of 2^group_log2 (batch, head) pairs, m-blocks outermost within a group: masked problems
  // then take every pair's heaviest m-block first, so the tiles claimed last (the kernel's tail) are light ones,
  // while a group's K and V stay small enough for L2 (speedcore/attention.py, sm90_head_group_log2).
  const int g = group.div(tile), r = tile - g * group.d;
  const int m_idx = r >> group_log2, rest = (g << group_log2) + (r & ((1 << group_log2) - 1));
  const int m_block = reverse_m ? num_m - 1 - m_idx : m_idx;
  t.batch = nheads.div(rest);
  t.head = rest - t.batch * nheads.d;
  // clamped so that a bad cu_seqlens_q / seqused_k cannot address out of bounds
  t.q_off = min(max(cu_q[t.batch], 0), total_q);
  t.sq = min(max(cu_q[t.batch + 1], t.q_off), total_q) - t.q_off;
  t.k_off = 0;
  t.sk = min(max(seqused_k[t.batch], 0), max_len);
  // Masked problems (reverse_m: causal or a right window) make their first m-block the partial one (rows 0 to
  // r - 1, r = what is left over by full blocks aligned to the sequence's end) instead of the last: the first
  // is the lightest, the last the heaviest.  The first tile still computes bm rows; those past r are the next
  // block's and are not stored.
  t.m0 = m_block * bm;
  if (reverse_m && m_block > 0) t.m0 -= (t.sq + bm - 1) / bm * bm - t.sq;
  t.rows_q = min(bm, t.sq - t.m0);
  if (reverse_m && m_block == 0 && t.sq > 0) t.rows_q = t.sq - ((t.sq + bm - 1) / bm - 1) * bm;
  // key j is visible to query i iff lo(i) <= j < hi(i) (see kernels/attention.cu)
  const int diag = t.sk - t.sq;
  const int lo_first = max(0, t.m0 + diag - window_left);
  const int hi_last = min(t.sk, t.m0 + t.rows_q - 1 + diag + window_right + 1);
  t.n_begin = lo_first / bn;
  t.n_end = hi_last > lo_first ? (hi_last + bn - 1) / bn : t.n_begin;
  return t;
}

}  // namespace pa90

// paged_prefill_sm90_kernel: kernels/attention_sm90.cu's flash_fwd_sm90_kernel (its varlen path) with the K/V
// tiles gathered through the block table by the producer.  tmap_q: (head_dim, total_q, nheads, 1) with box (64,
// BM, 1, 1); tmap_o: out's, box (64, 64, 1, 1); tmap_k / tmap_v: the caches as (head_dim, block_size, nheads_kv,
// num_blocks) with box (64, page_rows, 1, 1), page_rows = min(BN, block_size) (block_size % BN == 0 or BN %
// block_size == 0, a multiple of 16): a BN-key tile is BN / page_rows boxes, each at (column chunk, slot, KV head,
// page).  The 128-byte swizzle is a function of the shared-memory address (page_rows x 128 bytes is a multiple of
// its 1024-byte period), so the boxes compose the same tile layout as one BN-row box.  Slots past the sequence
// are in bounds for TMA (no zero fill) and may hold anything, NaN included: their scores are masked, and the
// consumers zero their V rows before the first P V of a tile (0 x NaN would poison O).
template <typename T, int D, int BN, int STAGES, bool HAS_SOFTCAP, bool PINGPONG, int NC>
__global__ void __launch_bounds__(128 * (NC + 1), 1) paged_prefill_sm90_kernel(
    const __grid_constant__ sc::TmaMap tmap_q, const __grid_constant__ sc::TmaMap tmap_k,
    const __grid_constant__ sc::TmaMap tmap_v, const __grid_constant__ sc::TmaMap tmap_o, T* __restrict__ out,
    float* __restrict__ lse,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ seqused_k, const int* __restrict__ block_table,
    long long o_row_stride, long long o_head_stride, long long bt_stride, int total_q, int max_len, int block_size,
    int num_blocks, int page_rows, int head_dim, int nheads, int heads_per_kv, int num_m, int num_tiles,
    int window_left, int window_right, float scale_log2, float softcap_pre, float softcap_post, int reverse_m,
    int head_group_log2, int* __restrict__ tile_counter) {
  using namespace fa;
  constexpr int BM = 64 * NC;  // query rows per tile: NC consumer warpgroups of 64
  constexpr int DC = D / 64;                 // 128-byte column chunks of a row
  constexpr int Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;
  constexpr int NS = BN / 2;                 // S accumulators per thread (m64 x BN)
  constexpr int NO = D / 2;                  // O accumulators per thread (m64 x D)
  constexpr int KP = BN / 16;                // k-steps of P V
  static_assert(D % 64 == 0 && D <= 256 && BN % 16 == 0 && BN <= 192 && (NC == 2 || NC == 3), "unsupported tile");
  constexpr int CONSUMER_WARPS = 4 * NC;
  // Registers: the CTA starts with LAUNCH_REGS per thread (what __launch_bounds__(.., 1) lets ptxas use); the
  // producer gives back down to 24 and the consumers may take only what it gave (setmaxnreg.inc waits for free
  // registers: asking for more would hang), in multiples of 8, at most 240.
  constexpr int LAUNCH_REGS = (65536 / (128 * (NC + 1))) / 8 * 8;
  // 40 where it costs the consumers nothing (two consumers: 232 registers either way); the paged producer (block
  // table row, page and slot arithmetic) spills at 32
  constexpr int PRODUCER_REGS = NC == 2 ? 40 : 32;
  constexpr int CONSUMER_SHARE = (LAUNCH_REGS + (LAUNCH_REGS - PRODUCER_REGS) / NC) / 8 * 8;
  constexpr int CONSUMER_REGS = CONSUMER_SHARE > 240 ? 240 : CONSUMER_SHARE;
  static_assert(PRODUCER_REGS + NC * CONSUMER_REGS <= (NC + 1) * LAUNCH_REGS, "setmaxnreg would deadlock");

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The 128-byte swizzle repeats every 1024 bytes and the wgmma descriptors assume tiles aligned to it.
  unsigned char* const smem = smem_raw + ((1024u - (sc::smem_addr(smem_raw) & 1023u)) & 1023u);
  unsigned char* const sQ = smem;
  unsigned char* const sK = sQ + Q_BYTES;
  unsigned char* const sV = sK + STAGES * KV_BYTES;
  constexpr bool O_OWN = pa90::o_has_own_buffer(Q_BYTES, 2 * STAGES * KV_BYTES);
  // Head dim 256 keeps the stores from registers: the staging code costs it a spill in the main loop.
  constexpr bool O_TMA = D <= 192;
  constexpr bool Q_EARLY = O_OWN || !O_TMA;  // Q is released after the tile's last S, not after its epilogue
  unsigned char* const sO = O_OWN ? sV + STAGES * KV_BYTES : sQ;
  unsigned long long* const bars = reinterpret_cast<unsigned long long*>(sV + STAGES * KV_BYTES +
                                                                         (O_OWN ? Q_BYTES : 0));
  unsigned long long* const q_full = bars;
  unsigned long long* const q_empty = bars + 1;
  unsigned long long* const k_full = bars + 2;
  unsigned long long* const k_empty = k_full + STAGES;
  unsigned long long* const v_full = k_empty + STAGES;
  unsigned long long* const v_empty = v_full + STAGES;
  unsigned long long* const tile_full = v_empty + STAGES;  // [2]
  unsigned long long* const tile_empty = tile_full + 2;    // [2]
  int4* const tile_ring = reinterpret_cast<int4*>(tile_empty + 2);  // [2][3]: pa90::Tile, 16-byte aligned

  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    sc::mbar_init(q_full, 1);
    sc::mbar_init(q_empty, CONSUMER_WARPS);
    for (int s = 0; s < STAGES; ++s) {
      sc::mbar_init(&k_full[s], 1);
      sc::mbar_init(&k_empty[s], CONSUMER_WARPS);
      sc::mbar_init(&v_full[s], 1);
      sc::mbar_init(&v_empty[s], CONSUMER_WARPS);
    }
    for (int s = 0; s < 2; ++s) {
      sc::mbar_init(&tile_full[s], 1);
      sc::mbar_init(&tile_empty[s], CONSUMER_WARPS);
    }
    sc::fence_mbar_init();
  }
  __syncthreads();

  // (a macro, not a generic lambda: NVRTC 13.0 rejects those)
#define PA90_TILE_INFO(tile, group_div, nheads_div)                                                             \
  pa90::tile_info(tile, group_div, head_group_log2, num_m, nheads_div, reverse_m, cu_seqlens_q, seqused_k, total_q, \
                  max_len, window_left, window_right, BM, BN)

  constexpr bool varlen = true;

  if (wg == 0) {
    sc::setmaxnreg_dec<PRODUCER_REGS>();
    // The producer is the first warp: every lane follows the same tiles (their descriptors computed by each, the
    // claimed index broadcast from lane 0), waits on the same barriers, and lane 0 alone arrives, stores the
    // tile ring and issues Q; each of a K/V tile's page boxes is issued by a lane of its own, its page looked up
    // by that lane.  (One thread issuing a page-16 tile's 16 boxes per operand, each behind a block-table load,
    // kept the consumers waiting: 0.48x the contiguous kernel's rate; with the loads hoisted, 0.78x.)
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      if (lane == 0) {
        sc::tma_prefetch_map(&tmap_q);
        sc::tma_prefetch_map(&tmap_k);
        sc::tma_prefetch_map(&tmap_v);
        sc::tma_prefetch_map(&tmap_o);
      }
      int stage = 0, tslot = 0;
      unsigned phase = 0, q_phase = 0, tphase = 0;
      // A K/V tile is BN / page_rows boxes of page_rows rows per 128-byte column chunk: lane l issues box l / DC
      // of chunk l % DC (block blk0 + box from slot slot0; slot0 = 0 when pages are at most BN rows, a multiple of
      // them).  Rows past the sequence come from page 0 (any page will do: their scores are masked and their V
      // rows zeroed); min() keeps a corrupt block table from faulting.
      static_assert((BN / 16) * DC <= 32, "one lane per box and column chunk");
      const int boxes = BN / page_rows, box = lane / DC, chunk = lane % DC;
      const bool issues = lane < boxes * DC;
      // Dynamic schedule: after its first tile (blockIdx.x) a CTA takes the next unclaimed one from a global
      // counter, so SMs that drew light tiles (causal, short sequences) take more of them.  The tile index
      // reaches the consumers through a two-slot ring; num_tiles or more means "done".  (Claiming a tile ahead
      // and prefetching its Q into L2 was measured: no faster.)
      int tile = blockIdx.x;
      for (;;) {
        pa90::Tile t{};
        if (tile < num_tiles)
          t = PA90_TILE_INFO(tile, pa90::PlainDiv{num_m << head_group_log2}, pa90::PlainDiv{nheads});
        t.index = tile;
        sc::mbar_wait(&tile_empty[tslot], tphase ^ 1);
        if (lane == 0) {
          pa90::store_tile(tile_ring + 3 * tslot, t);  // published by the arrive's release
          sc::mbar_arrive(&tile_full[tslot]);
        }
        if (++tslot == 2) {
          tslot = 0;
          tphase ^= 1;
        }
        if (tile >= num_tiles) break;
        if (t.rows_q > 0 && t.n_begin < t.n_end) {
          const int bc = varlen ? 0 : t.batch, kv_head = t.head / heads_per_kv;
          sc::mbar_wait(q_empty, q_phase ^ 1);
          q_phase ^= 1;
          if (lane == 0) {
            sc::mbar_arrive_expect_tx(q_full, Q_BYTES);
#pragma unroll
            for (int c = 0; c < DC; ++c)
              sc::tma_load_4d(sQ + c * BM * 128, &tmap_q, c * 64, t.q_off + t.m0, t.head, bc, q_full);
          }
          // key blocks from the last to the first: the blocks crossing the causal diagonal come first
          const int* const bt_row = block_table + (long long)t.batch * bt_stride;
          for (int nb = t.n_end - 1; nb >= t.n_begin; --nb) {
            const int tok0 = nb * BN;
            const int blk0 = tok0 / block_size, slot0 = tok0 - blk0 * block_size;
            // this lane's page, loaded before the wait (once for K and V)
            const int page = issues && tok0 + box * page_rows < t.sk
                                 ? (int)min((unsigned)bt_row[blk0 + box], (unsigned)(num_blocks - 1)) : 0;
            const int dst = chunk * BN * 128 + box * page_rows * 128;
            sc::mbar_wait(&k_empty[stage], phase ^ 1);
            if (lane == 0) sc::mbar_arrive_expect_tx(&k_full[stage], KV_BYTES);  // before any box lands
            __syncwarp();
            if (issues)
              sc::tma_load_4d(sK + stage * KV_BYTES + dst, &tmap_k, chunk * 64, slot0, kv_head, page, &k_full[stage]);
            sc::mbar_wait(&v_empty[stage], phase ^ 1);
            if (lane == 0) sc::mbar_arrive_expect_tx(&v_full[stage], KV_BYTES);
            __syncwarp();
            if (issues)
              sc::tma_load_4d(sV + stage * KV_BYTES + dst, &tmap_v, chunk * 64, slot0, kv_head, page, &v_full[stage]);
            if (++stage == STAGES) {
              stage = 0;
              phase ^= 1;
            }
          }
        }
        int claimed = 0;
        if (lane == 0) claimed = atomicAdd(tile_counter, 1);
        tile = gridDim.x + __shfl_sync(0xffffffffu, claimed, 0);
      }
      // The last CTA out resets the counters for the next launch on this stream (no memset needed).
      if (lane == 0 && atomicAdd(tile_counter + 1, 1) == (int)gridDim.x - 1) {
        atomicExch(tile_counter, 0);
        atomicExch(tile_counter + 1, 0);
      }
    }
    return;
  }

  sc::setmaxnreg_inc<CONSUMER_REGS>();
  const pa90::FastDiv group_div(num_m << head_group_log2), nheads_div(nheads);
  const int cw = wg - 1;  // consumer index: rows 64 cw .. 64 cw + 63 of the tile
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, q4 = lane % 4;
  const int row_in_tile = cw * 64 + warp * 16 + g;  // and + 8
  int stage = 0;
  unsigned phase = 0, q_phase = 0;
  // Pingpong: the consumers take turns issuing their GEMMs, round robin (named barrier 1 + cw is "cw's turn"),
  // so that one's softmax runs while another's GEMMs occupy the tensor cores.  Consumer 0 goes first.
  auto turn_begin = [&]() {
    if constexpr (PINGPONG) sc::named_bar_sync(1 + cw, 256);
  };
  auto turn_end = [&]() {
    if constexpr (PINGPONG) sc::named_bar_arrive(1 + (cw + 1) % NC, 256);
  };
  if (PINGPONG && cw == NC - 1) sc::named_bar_arrive(1, 256);

  for (unsigned titer = 0;; ++titer) {  // slot titer % 2, phase (titer / 2) % 2
    const int tslot = titer & 1;
    sc::mbar_wait(&tile_full[tslot], (titer >> 1) & 1);
    // Three consumers have 160 registers each: the descriptor's fields held in registers cost them a spill
    // (derived from the index they live in uniform registers), so they derive it again.
    constexpr bool DERIVE = NC > 2;
    pa90::Tile t;
    if constexpr (DERIVE)
      t.index = __shfl_sync(0xffffffffu, reinterpret_cast<const volatile int*>(tile_ring + 3 * tslot)[10], 0);
    else
      t = pa90::load_tile_uniform(tile_ring + 3 * tslot);
    if (lane == 0) sc::mbar_arrive(&tile_empty[tslot]);
    const int tile = t.index;
    if (tile >= num_tiles) break;
    if constexpr (DERIVE) t = PA90_TILE_INFO(tile, group_div, nheads_div);
    if (t.rows_q <= 0) continue;
    T* const o_rows_p = out + (long long)(t.q_off + t.m0) * o_row_stride + t.head * o_head_stride;
    float* const lse_rows_p = lse + (long long)t.head * total_q + t.q_off + t.m0;
    auto o_rows = [&]() { return o_rows_p; };
    auto lse_rows = [&]() { return lse_rows_p; };
    if (t.n_begin >= t.n_end) {  // no query row of this tile sees any key: zeros, lse = -inf
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row_in_tile + 8 * h;
        if (r >= t.rows_q) continue;
        for (int c = 8 * q4; c < head_dim; c += 32)
          *reinterpret_cast<uint4*>(o_rows() + r * o_row_stride + c) = make_uint4(0, 0, 0, 0);
        if (lse != nullptr && q4 == 0) lse_rows()[r] = neg_inf();
      }
      continue;
    }

    const int diag = t.sk - t.sq;
    const int m_last = t.m0 + t.rows_q - 1;
    const int lo_last = max(0, m_last + diag - window_left);
    const int hi_first = min(t.sk, t.m0 + diag + window_right + 1);
    const int rel_lo = diag - window_left, rel_hi = diag + window_right;

    float o[NO];
#pragma unroll
    for (int i = 0; i < NO; ++i) o[i] = 0.f;
    float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};
    float s[NS];
    unsigned p[KP][4];

    sc::mbar_wait(q_full, q_phase);
    q_phase ^= 1;
    // Descriptors of this consumer's Q tile and of the first K / V stage; every wgmma's is one of them advanced by
    // a 32-bit add (sc::wgmma_desc_advance: no uniform-datapath chain rebuilding it from an address before each).
    const unsigned long long q_desc = sc::wgmma_desc_k128(sQ + cw * 64 * 128);
    const unsigned long long k_desc0 = sc::wgmma_desc_k128(sK);
    const unsigned long long v_desc0 = sc::wgmma_desc_mn128(sV, BN * 128);
    auto issue_s = [&](int st) {  // S = Q K^T from the K tile of stage st
      const unsigned long long k_desc = sc::wgmma_desc_advance(k_desc0, st * KV_BYTES);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int c = kk / 4, off = (kk % 4) * 32;
        sc::Wgmma<BN, T, 0>::mma(s, sc::wgmma_desc_advance(q_desc, c * BM * 128 + off),
                                 sc::wgmma_desc_advance(k_desc, c * BN * 128 + off), kk > 0 ? 1 : 0);
      }
      sc::wgmma_commit();
    };
    auto issue_pv = [&](int st) {  // O += P V from the V tile of stage st
      const unsigned long long v_desc = sc::wgmma_desc_advance(v_desc0, st * KV_BYTES);
#pragma unroll
      for (int kk = 0; kk < KP; ++kk)
        sc::WgmmaRS<D, T, 1>::mma(o, p[kk], sc::wgmma_desc_advance(v_desc, kk * 16 * 128));
      sc::wgmma_commit();
    };
    auto fence_s = [&]() {
#pragma unroll
      for (int i = 0; i < NS; ++i) sc::wgmma_fence_operand(s[i]);
    };
    auto fence_o = [&]() {
#pragma unroll
      for (int i = 0; i < NO; ++i) sc::wgmma_fence_operand(o[i]);
    };
    // Softcap, mask and the online softmax of block nb: S becomes unnormalized P (fp32, in place); returns
    // whether some row's max grew (then O must be multiplied by corr).
    auto softmax = [&](int nb, float* corr) {
      if constexpr (HAS_SOFTCAP) {
#pragma unroll
        for (int i = 0; i < NS; ++i) s[i] = softcap_log2(s[i], softcap_pre, softcap_post);
      }
      const int n0 = nb * BN;
      if (n0 < lo_last || n0 + BN > hi_first) {  // a boundary block: visible iff rel_lo <= col - row <= rel_hi
        const int rel0 = n0 + 2 * q4 - (t.m0 + row_in_tile);
        const int cols_left = t.sk - n0 - 2 * q4;
#pragma unroll
        for (int i = 0; i < NS; ++i) {
          const int dc = (i / 4) * 8 + (i % 2), rel = rel0 + dc - ((i % 4) >= 2 ? 8 : 0);
          if (rel < rel_lo || rel > rel_hi || dc >= cols_left) s[i] = neg_inf();
        }
      }
      // base 2; the running max lags by up to 8 before O is rescaled (see attention.cu).  -inf - -inf is
      // NaN, which compares false: a row with no key yet needs nothing.
      bool grow = false;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = neg_inf();
#pragma unroll
        for (int i = 0; i < NS / 4; ++i) mx = fmaxf(mx, fmaxf(s[4 * i + 2 * h], s[4 * i + 2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        corr[h] = 1.f;
        if ((mx - row_max[h]) * scale_log2 > 8.f) {
          grow = true;
          corr[h] = row_max[h] == neg_inf() ? 1.f : sc::fast_exp2((row_max[h] - mx) * scale_log2);
          row_max[h] = mx;
        }
        // subtract 0 rather than -inf for a row with no key yet, so that exp2 gives 0, not NaN
        const float m_scaled = row_max[h] == neg_inf() ? 0.f : row_max[h] * scale_log2;
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < NS / 4; ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = sc::fast_exp2(fmaf(s[4 * i + 2 * h + e], scale_log2, -m_scaled));
            s[4 * i + 2 * h + e] = pv;
            sum += pv;
          }
        row_sum[h] = row_sum[h] * corr[h] + sum;
      }
      return __any_sync(0xffffffffu, grow);
    };
    auto pack_p = [&]() {
#pragma unroll
      for (int kk = 0; kk < KP; ++kk) {
        p[kk][0] = pack_f32x2<T>(s[8 * kk + 0], s[8 * kk + 1]);
        p[kk][1] = pack_f32x2<T>(s[8 * kk + 2], s[8 * kk + 3]);
        p[kk][2] = pack_f32x2<T>(s[8 * kk + 4], s[8 * kk + 5]);
        p[kk][3] = pack_f32x2<T>(s[8 * kk + 6], s[8 * kk + 7]);
      }
    };
    // The tile's first P V is of its last key block (n_end - 1): where that block runs past the sequence, its V rows
    // there are zeroed first (each consumer zeroes them all before its own wgmma reads them: the other's writes are
    // the same zeros), made visible to the async proxy that wgmma reads through.
    // It runs before the wgmma fences, and its stores are predicated rather than branched around (ptxas serializes
    // every wgmma of a kernel with divergent code between a fence and the wgmma it orders).
    bool v_tail = t.n_end * BN > t.sk;
    auto zero_v_tail = [&](int st, unsigned ph) {
      if (!v_tail) return;
      v_tail = false;
      sc::mbar_wait(&v_full[st], ph);
      const int first_unit = (t.sk - (t.n_end - 1) * BN) * 8;  // 16-byte units of the rows inside the sequence
      unsigned char* const v_tile = sV + st * KV_BYTES;
#pragma unroll
      for (int c = 0; c < DC; ++c)
#pragma unroll
        for (int i = 0; i < BN * 8 / 128; ++i) {
          const int u = tid + i * 128;
          if (u >= first_unit) *reinterpret_cast<uint4*>(v_tile + c * BN * 128 + u * 16) = make_uint4(0, 0, 0, 0);
        }
      sc::fence_proxy_async();
      sc::named_bar_sync(8 + cw, 128);
    };
    auto advance = [&]() {
      if (++stage == STAGES) {
        stage = 0;
        phase ^= 1;
      }
    };

    // The first block (the last key block): S alone.
    int nb = t.n_end - 1;
    sc::mbar_wait(&k_full[stage], phase);
    fence_s();
    sc::wgmma_fence();
    turn_begin();
    issue_s(stage);
    turn_end();
    sc::wgmma_wait<0>();
    fence_s();
    if (lane == 0) {
      sc::mbar_arrive(&k_empty[stage]);
      if (Q_EARLY && nb == t.n_begin) sc::mbar_arrive(q_empty);
    }
    {
      float corr[2];
      softmax(nb, corr);  // O is still zero: nothing to rescale
    }
    pack_p();
    advance();
    // the stage (and its phase) of the block whose P V is pending: the one before `stage`
    auto prev = [&]() { return stage == 0 ? STAGES - 1 : stage - 1; };
    auto prev_phase = [&]() { return stage == 0 ? phase ^ 1 : phase; };
    // Then S of block nb and P V of block nb + 1 in flight together; the softmax of nb runs behind P V.
    for (--nb; nb >= t.n_begin; --nb) {
      sc::mbar_wait(&k_full[stage], phase);
      zero_v_tail(prev(), prev_phase());
      fence_s();
      fence_o();
      sc::wgmma_fence();
      sc::mbar_wait(&v_full[prev()], prev_phase());
      turn_begin();
      issue_s(stage);
      issue_pv(prev());
      turn_end();
      sc::wgmma_wait<1>();
      fence_s();
      if (lane == 0) {
        sc::mbar_arrive(&k_empty[stage]);
        if (Q_EARLY && nb == t.n_begin) sc::mbar_arrive(q_empty);
      }
      float corr[2];
      const bool grow = softmax(nb, corr);
      sc::wgmma_wait<0>();
      fence_o();
      if (lane == 0) sc::mbar_arrive(&v_empty[prev()]);
      if (grow) {
#pragma unroll
        for (int i = 0; i < NO; ++i) o[i] *= corr[(i % 4) >= 2 ? 1 : 0];
      }
      pack_p();
      advance();
    }
    // The last block's P V.
    zero_v_tail(prev(), prev_phase());
    sc::mbar_wait(&v_full[prev()], prev_phase());
    fence_o();
    sc::wgmma_fence();
    turn_begin();
    issue_pv(prev());
    turn_end();
    sc::wgmma_wait<0>();
    fence_o();
    if (lane == 0) sc::mbar_arrive(&v_empty[prev()]);

    // Epilogue: normalize; this warpgroup's 64 rows go out by one TMA store per 64 columns, staged in shared
    // memory in the 128-byte-swizzled layout the tensor map expects (conflict-free: the 8 rows g of a warp's
    // 4-byte writes land in 8 different 16-byte units).  Varlen rows past the sequence belong to the next one,
    // so a partial 64-row block is stored from the registers instead.
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = row_sum[h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      inv[h] = l > 0.f ? 1.f / l : 0.f;
      const int r = row_in_tile + 8 * h;
      if (r < t.rows_q && lse != nullptr && q4 == 0)
        lse_rows()[r] = l > 0.f ? (row_max[h] * scale_log2 + __log2f(l)) * LN2 : neg_inf();
    }
    // The TMA store writes all 64 rows of this warpgroup, or those before the end of the tensor's sequence (the
    // map clips the rest): not where rows past rows_q belong to another sequence (varlen) or another m-block.
    const int wg_rows = t.rows_q - cw * 64;
    if (O_TMA && (wg_rows >= 64 || (!varlen && wg_rows > 0 && t.m0 + t.rows_q == t.sq))) {
      unsigned char* const o_tile = sO + cw * 64 * 128;
      if (O_OWN) {  // the previous tile's store must have read the buffer
        if (tid == 0) sc::bulk_wait_group_read<0>();
        sc::named_bar_sync(8 + cw, 128);
      }
      unsigned char* const o_thread = o_tile + (warp * 16 + g) * 128 + q4 * 4;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        unsigned char* const o_unit = o_thread + (j / 8) * BM * 128 + (((j % 8) ^ g) * 16);
#pragma unroll
        for (int h = 0; h < 2; ++h)
          *reinterpret_cast<unsigned*>(o_unit + h * 8 * 128) =
              pack_f32x2<T>(o[4 * j + 2 * h] * inv[h], o[4 * j + 2 * h + 1] * inv[h]);
      }
      sc::fence_proxy_async();
      sc::named_bar_sync(8 + cw, 128);
      if (tid == 0) {
        const int bc = varlen ? 0 : t.batch;
#pragma unroll
        for (int c = 0; c < DC; ++c)
          if (c * 64 < head_dim)
            sc::tma_store_4d(&tmap_o, o_tile + c * BM * 128, c * 64, t.q_off + t.m0 + cw * 64, t.head, bc);
        sc::bulk_commit_group();
        if (!O_OWN) sc::bulk_wait_group_read<0>();  // Q's buffer is refilled once every consumer releases it
      }
      if (!O_OWN) sc::named_bar_sync(8 + cw, 128);
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row_in_tile + 8 * h;
        if (r < t.rows_q) {
          T* const o_row = o_rows() + r * o_row_stride + 2 * q4;
#pragma unroll
          for (int j = 0; j < D / 8; ++j)
            if (j * 8 < head_dim)
              *reinterpret_cast<unsigned*>(o_row + j * 8) =
                  pack_f32x2<T>(o[4 * j + 2 * h] * inv[h], o[4 * j + 2 * h + 1] * inv[h]);
        }
      }
    }
    if (O_TMA && !O_OWN && lane == 0) sc::mbar_arrive(q_empty);
  }
  if (PINGPONG && cw == 0) sc::named_bar_sync(1, 256);  // the last consumer's last hand-over
  if (tid == 0) sc::bulk_wait_group<0>();  // shared memory must outlive the stores reading it
}
#undef PA90_TILE_INFO
