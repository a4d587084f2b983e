// Hopper (sm_90a) INT4 weight-only GEMM for AWQ / GPTQ layers at M >= 17: y = x @ dequant(W) (+ bias).
//
// Why: mma.sync kernels (quant_mma_kernel, quant_marlin_kernel) top out near 140-200 TFLOP/s on the H200, while
// cuBLAS bf16 runs ~700; at M = 64 on 8192 x 8192 the weights are 32 MB (~8 us at HBM rate) and the math 8.6 GFLOP
// (~14 us at 600 TFLOP/s), so a wgmma kernel that overlaps the weight stream with the math can reach ~2x cuBLAS.
//
// The product is computed transposed, Y^T = W^T x^T, per CTA tile of 64 BLOCKS output channels x MT rows of x:
// * wgmma m64nMTk16 with A = 64 dequantized weight channels x 16 k taken from REGISTERS (the RS form), so INT4
//   is expanded in registers (lop3 into the magic number 1024 / 128, one fma2 for magic + zero point, one for
//   the scale: (q - z) s rounded once to T), and B = the x tile in shared memory: x is (M, K) row-major, which is
//   a K-major B operand as TMA writes it (64 k = 128 bytes per row, 128-byte swizzle), no transpose.
// * The weights come from a prepacked "wgmma-major" INT4 layout (w4wgmma_pack_kernel below, NumPy mirror
//   speedcore.quant.w4wgmma_pack_reference): word (b / 4, kb, b % 4, t, lane, s) is the m16n8k16 A fragment
//   (rows 16 t..16 t + 15 of 64-channel block b; k = 64 kb + 16 s + natural mma k order) of lane 4 g + c, so warp t
//   of a consumer warpgroup reads its 4 k16 steps of one 64-k chunk as one conflict-free 16-byte shared load per
//   lane.  (The fragment-major copy of the streaming kernels permutes k inside each k16 to match 8-byte x reads; a
//   B operand read by wgmma from shared memory must be in natural k order, hence the new copy.)  Scales / zero
//   points come from the streaming kernels' group records (gemv_pack_groups_kernel, 192 bytes per block and group)
//   reordered as the weights ((block / 4, group, block % 4), speedcore.quant._w4wgmma_groups).
// * 384 threads: warpgroup 0 is the producer (setmaxnreg down; per stage, one thread of warp 0 issues KS TMA boxes
//   of x (KS = 1 or 2 chunks of 64 k), one of warp 1 the bulk copy of the CTA's weights and one of warp 2 that of
//   its group records: one copy each where the blocks are adjacent) into a STAGES-deep ring guarded by full / empty
//   mbarriers; warpgroups 1 and 2 are consumers owning BLK blocks each (2 x 64 BLK channels per CTA).  A consumer
//   issues a stage's 4 KS k16 steps as wgmma groups of GS steps (GS = 1, 2 or 4), and dequantizes the next group's
//   A fragments while the previous group is in flight (two A sets; wgmma.wait_group 1); it releases a stage once
//   the group that read its x tile has retired.
// * Split-K over `splits` CTAs per tile where the tiles alone do not fill the SMs: the tile's CTAs are a cluster and
//   sum their fp32 accumulators through distributed shared memory, in split order (deterministic); else y is
//   written straight from the accumulators.
// * BLK = 1 (128-channel CTAs: twice the tiles of BLK = 2) allows MT = 256 (a 64 x 256 fp32 accumulator is 128
//   registers per consumer thread).
// * Accumulator (blk, r) of a consumer thread (warp w, lane 4 g + c) is channel 64 (cw BLK + blk) + 16 w + g
//   (+ 8 when r % 4 >= 2) of the CTA and row 8 (r / 4) + 2 c + (r % 2) of its x tile.  Rows >= M: TMA zero-fills
//   x there and the stores are masked.
// Requires: N % (128 BLK) == 0, K % 64 == 0, G % 64 == 0 and K % G == 0 (a stage is inside one group), x rows
// 16-byte aligned (TMA), compute capability 9.0.
#include "common/types.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "common/int4.cuh"

// Diagnostics (benchmarks/_quant_w4_trace.py): with -DW4_TRACE, CTA c stamps w4_trace[c][slot]: 0 globaltimer and
// 1 clock64() at entry, 2 the SM, 3 the consumers' loop end, 5 the end of the stores, 6 globaltimer at exit; 8 + i
// the return of consumer warpgroup 1's full wait of stage i, W4_TRACE_PROD + i the x producer's empty wait of stage
// i, W4_TRACE_PROD_X + i its x boxes issued, W4_TRACE_PROD_W + i the weight producer's copy issued (clock64, up to
// 242 stages); W4_TRACE_EPI + 0..4 the epilogue's phases: past the consumers' barrier, the slots written and past the
// cluster barrier (split-K only), the y tile written, past its barrier; + 5, + 6 (two-rank split-K) the loads of the
// other rank's slots issued, the first two row groups summed into the tile.
#ifdef W4_TRACE
#define W4_TRACE_SLOTS 1056
#define W4_TRACE_PROD 264
#define W4_TRACE_PROD_X 528  // the producer past its x box of stage i
#define W4_TRACE_PROD_W 792  // past its weight copy of stage i
#define W4_TRACE_EPI 250  // epilogue phases (stage stamps past 242 stages collide)
extern "C" __device__ long long w4_trace[512 * W4_TRACE_SLOTS];
#define W4_MARK(slot, v)                                                                       \
  do {                                                                                         \
    if (blockIdx.x < 512 && (slot) < W4_TRACE_SLOTS) w4_trace[blockIdx.x * W4_TRACE_SLOTS + (slot)] = (v); \
  } while (0)
#else
#define W4_MARK(slot, v) \
  do {                   \
  } while (0)
#endif

namespace quant_sm90 {

enum : int { AWQ = 0, GPTQ = 1 };
enum : int { W_INT4 = 0, W_INT8 = 1 };  // the weights' kind (KIND)
constexpr int kBK = 64;            // k per chunk (KS chunks per ring stage): one 128-byte TMA row of x
constexpr int kRecBytes = 192;     // group record of one INT4 block (64 scales + 64 zero bytes)
constexpr int W4_MAX_SPLITS = 8;   // a tile's splits are one cluster (speedcore.quant.W4WGMMA_MAX_SPLITS)
// Weights of one 64-channel block x 64 k: 2 KB of INT4, 4 KB of INT8.
template <int KIND> constexpr int kBlockBytesOf = KIND == W_INT8 ? 4096 : 2048;

// A ring stage holds KS chunks of 64 k: KS x tiles (MT x 64), the CTA's weights of those chunks ([chunk][block]) and
// one group record per block (G % 128 == 0: a stage of up to 128 k lies in one group).
template <int MT, int BLK, int KS = 1, int KIND = W_INT4> struct W4Tile {
  static constexpr int BLOCKS = 2 * BLK;  // 64-channel blocks per CTA (BLK per consumer warpgroup)
  static constexpr int X_CHUNK = MT * 128;
  static constexpr int X_BYTES = KS * X_CHUNK;
  static constexpr int W_BYTES = KS * BLOCKS * kBlockBytesOf<KIND>;
  static constexpr int G_BYTES = KIND == W_INT8 ? 0 : BLOCKS * kRecBytes;  // INT8: per-channel scales, no records
  static constexpr int STAGE = X_BYTES + W_BYTES + G_BYTES;
  static_assert(X_CHUNK % 1024 == 0, "x tiles keep the 1024-byte alignment of the 128-byte swizzle");
};

// The lane's constants of one group: scales of its rows g (scl[0]) and g + 8 (scl[1]) in both halves, and the
// (magic + zero point) terms to subtract.  sw: the two 16-bit scales, zw: the two zero bytes (GPTQ's +1 applied).
template <typename T>
__device__ __forceinline__ void group_consts(unsigned sw, unsigned zw, unsigned (&scl)[2], unsigned (&zc)[2]) {
  scl[0] = __byte_perm(sw, 0u, 0x1010u);
  scl[1] = __byte_perm(sw, 0u, 0x3232u);
  zc[0] = sc::int4_zero_term<T>(zw & 0xffu, false);
  zc[1] = sc::int4_zero_term<T>((zw >> 8) & 0xffu, true);  // row g + 8: fp16 reads its nibbles at bits 4-7
}

// The (m tile, n tile) of tile t: tiles in groups of m_group m tiles (the last group may be smaller), m fastest
// inside a group, then the n tile, then the group.  m_group = m_tiles is plain m-fastest order (CTAs running
// together read the same weights); fewer bound the x rows a wave of CTAs reads where x is the bigger operand.
__device__ __forceinline__ void tile_coords(int t, int m_tiles, int n_tiles, int m_group, int& m_tile, int& n_tile) {
  const int grp = t / (m_group * n_tiles), r = t - grp * m_group * n_tiles;
  const int gm = min(m_group, m_tiles - grp * m_group);
  m_tile = grp * m_group + r % gm;
  n_tile = r / gm;
}

__device__ __forceinline__ unsigned tid_x() {
  unsigned r;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(r));
  return r;
}

// Row groups (8 rows) of a tile owned by each rank of a split-K cluster: an even count, so that the owner writes its
// y tile two row groups per stmatrix (speedcore.quant.w4wgmma_epilogue_bytes mirrors it).
__device__ __forceinline__ int w4_rows_per_rank(int row_groups, int splits) {
  return 2 * ((row_groups + 2 * splits - 1) / (2 * splits));
}

// Two floats rounded to one word of two T (low half first) by one packed conversion.
template <typename T> __device__ __forceinline__ unsigned pack_rn(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack_rn<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}
template <> __device__ __forceinline__ unsigned pack_rn<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}

// The two ranks of a split-K cluster hand each other half of their fp32 partials through distributed shared memory,
// whose rate on the H200 (about 11-16 bytes per clock per SM, benchmarks/_dsmem_probe.py: 40 KB each way ~3800
// cycles, 20 KB ~1850) makes the bytes the epilogue's cost.  So the partials go packed, eight floats (four of row
// group j, four of j + 1) at a time, W4_SPLIT_PACK = 24 bits per float: each float's top three bytes (sign,
// exponent, 15 mantissa bits) in six words, the fourth float of each four spread over the low bytes of the other
// three's words; the receiver uses those words as they are (relative error below 2^-15 per partial, under y's
// rounding: 2^-9 for bf16, 2^-11 for fp16).  (bf16 partials raised the error 1.3x for bf16 and 6x for fp16 outputs,
// fp32 ones were slower: 4096^2 M = 320 22.3 us pulled against 21.7 for 24-bit pushes; session 16 in
// benchmarks/results/h200-ab-2026-11-30.md.  Both were removed.)
constexpr int W4_SPLIT_PACK = 24;
constexpr int W4_PACK_WORDS = W4_SPLIT_PACK / 4;  // words per thread for eight floats

__device__ __forceinline__ void w4_pack8(const float* a, const float* b, unsigned (&w)[W4_PACK_WORDS]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float* f = h ? b : a;
    const unsigned d = __float_as_uint(f[3]);
    w[3 * h + 0] = __byte_perm(__float_as_uint(f[0]), d, 0x3215);  // [d.b1, f0.b1, f0.b2, f0.b3]
    w[3 * h + 1] = __byte_perm(__float_as_uint(f[1]), d, 0x3216);  // [d.b2, f1.b1 ..]
    w[3 * h + 2] = __byte_perm(__float_as_uint(f[2]), d, 0x3217);  // [d.b3, f2.b1 ..]
  }
}
__device__ __forceinline__ void w4_unpack8(const unsigned (&w)[W4_PACK_WORDS], float* a, float* b) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float* f = h ? b : a;
    const unsigned w0 = w[3 * h], w1 = w[3 * h + 1], w2 = w[3 * h + 2];
    f[0] = __uint_as_float(w0);
    f[1] = __uint_as_float(w1);
    f[2] = __uint_as_float(w2);
    f[3] = __uint_as_float(__byte_perm(__byte_perm(w0, w1, 0x4000), w2, 0x4310));  // [., w0.b0, w1.b0, w2.b0]
  }
}

// A thread's W4_PACK_WORDS words of one pair slot: the first four at `first`, the other two at `rest`; to
// this CTA's shared memory, to a cluster CTA's (st.async, completing on its mbarrier `bar`), and back.
__device__ __forceinline__ void w4_st_words(unsigned first, unsigned rest, const unsigned (&w)[W4_PACK_WORDS]) {
  sc::st_shared_v4(first, __uint_as_float(w[0]), __uint_as_float(w[1]), __uint_as_float(w[2]), __uint_as_float(w[3]));
  sc::st_shared_v2(rest, __uint_as_float(w[4]), __uint_as_float(w[5]));
}
__device__ __forceinline__ void w4_st_async_words(unsigned first, unsigned rest, const unsigned (&w)[W4_PACK_WORDS],
                                                  unsigned bar) {
  sc::st_async_v4(first, __uint_as_float(w[0]), __uint_as_float(w[1]), __uint_as_float(w[2]), __uint_as_float(w[3]),
                  bar);
  sc::st_async_v2(rest, __uint_as_float(w[4]), __uint_as_float(w[5]), bar);
}
__device__ __forceinline__ void w4_ld_cluster_words(unsigned first, unsigned rest, unsigned (&w)[W4_PACK_WORDS]) {
  const float4 v = sc::ld_cluster_v4(first);
  w[0] = __float_as_uint(v.x);
  w[1] = __float_as_uint(v.y);
  w[2] = __float_as_uint(v.z);
  w[3] = __float_as_uint(v.w);
  const float2 u = sc::ld_cluster_v2(rest);
  w[4] = __float_as_uint(u.x);
  w[5] = __float_as_uint(u.y);
}
__device__ __forceinline__ void w4_ld_words(const unsigned char* first, const unsigned char* rest,
                                            unsigned (&w)[W4_PACK_WORDS]) {
  const uint4 v = *reinterpret_cast<const uint4*>(first);
  w[0] = v.x;
  w[1] = v.y;
  w[2] = v.z;
  w[3] = v.w;
  const uint2 u = *reinterpret_cast<const uint2*>(rest);
  w[4] = u.x;
  w[5] = u.y;
}

// Split-K over two ranks by pushes, where the receive buffer fits: each rank's buffer for the half of the tile it
// owns (its H / 2 pairs of row groups x BLK blocks, packed: w4_pack8), past the ring, its mbarriers and the tile's
// coordinates, behind a receive mbarrier of its own (speedcore.quant.w4wgmma_rx_bytes mirrors this).  A dedicated
// buffer lets the other rank send as soon as its own main loop ends, without the cluster barrier that ring slots
// would need (the receiver must be done with them), and the owner read its half locally.
constexpr int W4_SMEM_LIMIT = 232448;  // 227 KB per block on sm_90 (speedcore.quant.W4WGMMA_SMEM_LIMIT)
template <int MT, int BLK, int STAGES, int KS, int KIND> struct W4Rx {
  static constexpr int BYTES = (MT / 32) * BLK * 256 * 4 * W4_PACK_WORDS;
  static constexpr int RING_END = STAGES * (W4Tile<MT, BLK, KS, KIND>::STAGE + 16) + 16;
  static constexpr bool FITS = 1024 + RING_END + 16 + BYTES <= W4_SMEM_LIMIT;
};

// Split-K epilogue of 3 to 8 ranks, owner side: row groups [j0, j0 + n) (n even) of every block summed over the
// cluster's nsrc ranks in rank order (src_at: this thread's 16 bytes of slot (0, 0) in each rank's shared memory,
// slots (j, blk) of 4 KB) and handed to tile_pair(owner-local row group, blk, sums of it, of the next).  The loads of
// two row groups from every rank are issued before the first is used.
template <int BLK, typename TilePair>
__device__ __forceinline__ void w4_owner_sums(const unsigned (&src_at)[W4_MAX_SPLITS], int nsrc, int j0, int n,
                                              TilePair& tile_pair) {
  constexpr int SLOT = 256 * 16;
#pragma unroll 1
  for (int j = 0; j < n; j += 2) {
#pragma unroll
    for (int blk = 0; blk < BLK; ++blk) {
      float4 x[2][W4_MAX_SPLITS];
#pragma unroll
      for (int p = 0; p < 2; ++p)
#pragma unroll
        for (int src = 0; src < W4_MAX_SPLITS; ++src)
          if (src < nsrc) x[p][src] = sc::ld_cluster_v4(src_at[src] + ((j0 + j + p) * BLK + blk) * SLOT);
      float v[2][4];
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        v[p][0] = x[p][0].x;
        v[p][1] = x[p][0].y;
        v[p][2] = x[p][0].z;
        v[p][3] = x[p][0].w;
#pragma unroll
        for (int src = 1; src < W4_MAX_SPLITS; ++src) {
          if (src < nsrc) {
            v[p][0] += x[p][src].x;
            v[p][1] += x[p][src].y;
            v[p][2] += x[p][src].z;
            v[p][3] += x[p][src].w;
          }
        }
      }
      tile_pair(j, blk, v[0], v[1]);
    }
  }
}

// Keep the compiler from moving an A-fragment register's reuse across wgmma issue / wait points.
__device__ __forceinline__ void fence_reg(unsigned& r) { asm volatile("" : "+r"(r)::"memory"); }


// y (M, N) = x (M, K) @ W (+ bias) for a layer in the wgmma-major INT4 layout (wq) with its group records (grec:
// record (block / 4, group, block % 4) at byte 192 (((block / 4) NG + group) 4 + block % 4)).
// Grid: splits x (tiles from tile_base on) CTAs, split fastest, then the tile in tile_coords' order (groups of
// m_group m tiles).  A grid of several waves whose last wave is partly empty is launched twice (speedcore.quant's
// tail launch): its whole waves unsplit from tile_base 0, then the remaining tiles split-K from their first tile.
// CTA (split, m tile, n tile) covers x rows [MT m, MT m + MT), channels [128 BLK n, ...) and k stages
// [split KB / splits, (split + 1) KB / splits).  KB = K / (64 KS) stages, SPG = G / 64, NG = K / G.
// splits > 1: launched in clusters of `splits` CTAs (one tile's splits; at most 8), whose ring shared memory must
// hold the reduce-scatter slots (speedcore.quant.w4wgmma_config checks it).
// KIND = W_INT8 (w8wgmma_pack_kernel's layout): the same with signed bytes converted exactly (sc::int8_pair), no
// group records, and y scaled per channel in the epilogue by grec read as T scales[N].
template <typename T, int MT, int BLK, int STAGES, int GS = 1, int KS = 1, int KIND = W_INT4>
__global__ void __launch_bounds__(384, 1) w4_wgmma_kernel(
    const __grid_constant__ sc::TmaMap tmap_x, T* __restrict__ y, const unsigned char* __restrict__ wq,
    const unsigned char* __restrict__ grec, const T* __restrict__ bias, int M, int N, int KB, int SPG, int NG,
    int m_tiles, int splits, int m_group, int tile_base) {
  using L = W4Tile<MT, BLK, KS, KIND>;
  constexpr int kBlockBytes = kBlockBytesOf<KIND>;
  constexpr int kProducers = KIND == W_INT8 ? 2 : 3;  // producer threads (x, weights, group records)
  constexpr int NACC = MT / 2;
  constexpr int STEPS = 4 * KS;  // k16 steps per stage
  static_assert(KS == 1 || KS == 2, "a stage is 64 or 128 k");
  static_assert(BLK == 1 || BLK == 2, "a CTA's 2 or 4 blocks lie in one super-block");
  static_assert(GS == 1 || GS == 2 || GS == 4, "a wgmma group is 1, 2 or 4 of a stage's k16 steps");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (sc::smem_addr(smem_raw) & 1023u)) & 1023u);
  unsigned char* ring_x = smem;
  unsigned char* ring_w = ring_x + STAGES * L::X_BYTES;
  unsigned char* ring_g = ring_w + STAGES * L::W_BYTES;
  unsigned long long* full = reinterpret_cast<unsigned long long*>(ring_g + STAGES * L::G_BYTES);
  unsigned long long* empty = full + STAGES;
  // The CTA's (split, m tile, n tile), for the epilogue: kept in registers across the main loop they spilled at MT x
  // BLK = 256 (128 accumulator registers), and derived anew they cost integer divisions of cold code.
  int* tile_info = reinterpret_cast<int*>(empty + STAGES);
  using RX = W4Rx<MT, BLK, STAGES, KS, KIND>;
  unsigned long long* rx_full = reinterpret_cast<unsigned long long*>(tile_info + 4);
  unsigned char* rx_buf = reinterpret_cast<unsigned char*>(rx_full + 2);

  const int split = blockIdx.x % splits;  // the CTA's rank in its cluster (the tile's splits)
  const int n_tiles = N / (64 * L::BLOCKS);
  int m_tile, n_tile;
  tile_coords(tile_base + (int)blockIdx.x / splits, m_tiles, n_tiles, m_group, m_tile, n_tile);
  const int m0 = m_tile * MT, nb0 = n_tile * L::BLOCKS;
  const int kb_begin = (int)((long long)split * KB / splits);
  const int kb_end = (int)((long long)(split + 1) * KB / splits);

  const int wg = threadIdx.x / 128;
  const bool push = RX::FITS && splits == 2;  // two-rank split-K by pushes into rx_buf
  // Every CTA has started: a tail launch waiting on this grid (LaunchConfig.overlap) may take the SMs it frees.
  sc::launch_dependents();
  if (threadIdx.x == 0) {
#ifdef W4_TRACE
    W4_MARK(0, (long long)sc::globaltimer_ns());
    W4_MARK(1, clock64());
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    W4_MARK(2, (long long)smid);
#endif
    for (int s = 0; s < STAGES; ++s) {
      sc::mbar_init(&full[s], kProducers);
      sc::mbar_init(&empty[s], 8);
    }
    if (push) {
      sc::mbar_init(rx_full, 1);
      sc::mbar_arrive_expect_tx(rx_full, RX::BYTES);  // the other rank's half of the tile
    }
    sc::fence_mbar_init();
    tile_info[0] = split;
    tile_info[1] = m_tile;
    tile_info[2] = n_tile;
  }
  __syncthreads();
  // Waited for before the first push: the other rank's receive barrier is initialized.
  if (push) sc::cluster_arrive_relaxed();

  if (wg == 0) {
    sc::setmaxnreg_dec<40>();
    // Three producer warps, one thread each, fill every ring stage: warp 0 the x boxes, warp 1 the weights, warp 2
    // the group records (INT8 has none).  Each stage's full barrier counts one arrival per producer.  (One thread
    // issuing all three, ~100 instructions per stage with the record's group index divided out, was the kernel's
    // bottleneck: the traces showed it 0.45-0.7 us per stage behind its free ring slots, the consumers waiting on
    // it.)
    const int pw = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0 && pw < kProducers) {
      if (pw == 0) sc::tma_prefetch_map(&tmap_x);
      // Super-block layout (4 blocks, stage-major inside): the CTA's 2 or 4 blocks of a stage are adjacent (one copy
      // each for weights and records: one per block ran the copy queue long, -8 to -13% time at M <= 64 with 4
      // blocks, H200) and its stages follow each other (a plain stage-major layout, N / 64 x 2 KB between stages,
      // cost 4-8% at M >= 256).  (KS = 2 with 4 blocks: both chunks in one copy.)
      constexpr int CHUNKS_PER_COPY = L::BLOCKS == 4 ? KS : 1;  // [chunk][block] in shared memory too
      const long long sb = nb0 >> 2, b4 = nb0 & 3;
      const unsigned char* w_src = wq + ((sb * KB * KS + (long long)kb_begin * KS) * 4 + b4) * kBlockBytes;
      int g_idx = kb_begin * KS / SPG, g_rem = kb_begin * KS % SPG;  // the stage's group, its first chunk in it
      const unsigned char* g_src = grec + ((sb * NG + g_idx) * 4 + b4) * kRecBytes;
      int stage = 0;
      unsigned phase = 0;
#ifdef W4_TRACE
      int traced = 0;
#endif
      for (int kb = kb_begin; kb < kb_end; ++kb) {
        sc::mbar_wait(&empty[stage], phase ^ 1);
        if (pw == 0) {
#ifdef W4_TRACE
          W4_MARK(W4_TRACE_PROD + traced, clock64());
#endif
          sc::mbar_arrive_expect_tx(&full[stage], L::X_BYTES);
#pragma unroll
          for (int ch = 0; ch < KS; ++ch)
            sc::tma_load_2d(ring_x + stage * L::X_BYTES + ch * L::X_CHUNK, &tmap_x, (kb * KS + ch) * kBK, m0,
                            &full[stage]);
#ifdef W4_TRACE
          W4_MARK(W4_TRACE_PROD_X + traced, clock64());
#endif
        } else if (pw == 1) {
          sc::mbar_arrive_expect_tx(&full[stage], L::W_BYTES);
#pragma unroll
          for (int ch = 0; ch < KS; ch += CHUNKS_PER_COPY)
            sc::bulk_copy_g2s(ring_w + stage * L::W_BYTES + ch * L::BLOCKS * kBlockBytes,
                              w_src + ch * 4 * kBlockBytes, CHUNKS_PER_COPY * L::BLOCKS * kBlockBytes,
                              &full[stage]);
          w_src += KS * 4 * kBlockBytes;
#ifdef W4_TRACE
          W4_MARK(W4_TRACE_PROD_W + traced, clock64());
#endif
        } else {
          sc::mbar_arrive_expect_tx(&full[stage], L::G_BYTES);
          sc::bulk_copy_g2s(ring_g + stage * L::G_BYTES, g_src, L::BLOCKS * kRecBytes, &full[stage]);
          g_rem += KS;  // a stage lies inside one group (KS <= SPG)
          if (g_rem >= SPG) {
            g_rem = 0;
            g_src += 4 * kRecBytes;
          }
        }
#ifdef W4_TRACE
        ++traced;
#endif
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    if (push) {  // the consumers' cluster barriers (split-K epilogue)
      sc::cluster_wait();
      sc::cluster_arrive_relaxed();
      sc::cluster_wait();
    } else if (splits > 1) {
      sc::cluster_arrive_relaxed();
      sc::cluster_wait();
      sc::cluster_arrive_relaxed();
      sc::cluster_wait();
    }
    return;
  }

  sc::setmaxnreg_inc<232>();
  const int cw = wg - 1;
  const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32, g = lane / 4;
  float acc[BLK][NACC];
#pragma unroll
  for (int blk = 0; blk < BLK; ++blk)
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[blk][i] = 0.f;
  // A fragments: two sets of GS k16 steps (the group in flight and the one being dequantized).
  unsigned afrag[2][GS][BLK][4];
  int stage = 0, prev_stage = -1;
  unsigned phase = 0;
#ifdef W4_TRACE
  int traced = 0;
#endif
  // The x ring's first tile; each step's descriptor is this one advanced (wgmma_desc_advance).
  const unsigned long long x_desc0 = sc::wgmma_desc_k128(ring_x);
  // One ring stage (STEPS = 4 KS k16 steps) as STEPS / GS wgmma groups.  PAR: the stage's parity, which picks the A
  // set of a group when a stage is one group (STEPS = GS = 4); the calls pass it as a literal, so that once inlined
  // the set index is a compile-time constant (NVRTC 13.0 takes a generic lambda for a host function).
  auto stage_body = [&](const int PAR) {
    sc::mbar_wait(&full[stage], phase);
#ifdef W4_TRACE
    if (threadIdx.x == 128) W4_MARK(8 + traced, clock64());
    ++traced;
#endif
    // A lane's 4 k16 steps of one chunk and block: 16 bytes of INT4 (a word per step), 32 of INT8 (two per step).
    constexpr int LANE_WORDS = KIND == W_INT8 ? 2 : 1;  // 16-byte loads per lane, chunk and block
    const unsigned char* wst = ring_w + stage * L::W_BYTES + cw * BLK * kBlockBytes + t * 16 * LANE_WORDS;
    const unsigned char* gst = ring_g + stage * L::G_BYTES + cw * BLK * kRecBytes;
    uint4 wv[KS][BLK][LANE_WORDS];
    unsigned scl[BLK][2], zc[BLK][2];
#pragma unroll
    for (int blk = 0; blk < BLK; ++blk) {
#pragma unroll
      for (int ch = 0; ch < KS; ++ch)
#pragma unroll
        for (int h = 0; h < LANE_WORDS; ++h)
          wv[ch][blk][h] = *reinterpret_cast<const uint4*>(wst + (ch * L::BLOCKS + blk) * kBlockBytes + 16 * h);
      if constexpr (KIND == W_INT4) {
        const unsigned char* rec = gst + blk * kRecBytes;
        const unsigned sw = *reinterpret_cast<const unsigned*>(rec + 16 * g + 4 * warp);
        const unsigned zw = *reinterpret_cast<const unsigned short*>(rec + 128 + 8 * g + 2 * warp);
        group_consts<T>(sw, zw, scl[blk], zc[blk]);
      }
    }
    const unsigned long long xd = sc::wgmma_desc_advance(x_desc0, stage * L::X_BYTES);
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      const int set = ((STEPS * PAR + s) / GS) & 1, j = s % GS;
#pragma unroll
      for (int blk = 0; blk < BLK; ++blk) {
        if constexpr (KIND == W_INT4) {
          sc::int4_fragment<T>(afrag[set][j][blk], sc::word(wv[s / 4][blk][0], s % 4), scl[blk][0], scl[blk][1],
                               zc[blk][0], zc[blk][1], sc::int4_magic<T>);
        } else {
          // Step s % 4 of the chunk: words 2 (s % 4) (channel row g) and + 1 (row g + 8), bytes k = 2c, 2c + 1,
          // 2c + 8, 2c + 9: registers 0 / 1 from bytes 0-1, 2 / 3 from bytes 2-3.
          const int sl = s % 4;
          const unsigned w0 = sc::word(wv[s / 4][blk][sl / 2], 2 * (sl % 2));
          const unsigned w1 = sc::word(wv[s / 4][blk][sl / 2], 2 * (sl % 2) + 1);
          afrag[set][j][blk][0] = sc::int8_pair<T, 0x4140u>(w0);
          afrag[set][j][blk][1] = sc::int8_pair<T, 0x4140u>(w1);
          afrag[set][j][blk][2] = sc::int8_pair<T, 0x4342u>(w0);
          afrag[set][j][blk][3] = sc::int8_pair<T, 0x4342u>(w1);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) fence_reg(afrag[set][j][blk][i]);
      }
      if (j != GS - 1) continue;
#pragma unroll
      for (int blk = 0; blk < BLK; ++blk)
#pragma unroll
        for (int i = 0; i < NACC; ++i) sc::wgmma_fence_operand(acc[blk][i]);
      sc::wgmma_fence();
#pragma unroll
      for (int jj = 0; jj < GS; ++jj) {
        const int sj = s - GS + 1 + jj;  // the k16 step: chunk sj / 4, 32 bytes per step inside the chunk's rows
        const unsigned long long db = sc::wgmma_desc_advance(xd, (sj / 4) * L::X_CHUNK + (sj % 4) * 32);
#pragma unroll
        for (int blk = 0; blk < BLK; ++blk) sc::WgmmaRS<MT, T, 0>::mma(acc[blk], afrag[set][jj][blk], db);
      }
      sc::wgmma_commit();
#pragma unroll
      for (int blk = 0; blk < BLK; ++blk)
#pragma unroll
        for (int i = 0; i < NACC; ++i) sc::wgmma_fence_operand(acc[blk][i]);
      // At most this group is pending: the previous one (the other A set, and at the stage's first group the last
      // reader of the previous stage's x tile) has retired.
      sc::wgmma_wait<1>();
#pragma unroll
      for (int jj = 0; jj < GS; ++jj)
#pragma unroll
        for (int blk = 0; blk < BLK; ++blk)
#pragma unroll
          for (int i = 0; i < 4; ++i) fence_reg(afrag[set ^ 1][jj][blk][i]);
      if (s == GS - 1 && prev_stage >= 0 && lane == 0) sc::mbar_arrive(&empty[prev_stage]);
    }
    prev_stage = stage;
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1;
    }
  };
  // acc += the product over k stages [kb0, kb1) of the tile whose stages the producer queued next.
  auto consume = [&](int kb0, int kb1) {
    for (int kb = kb0; kb < kb1; ++kb) {
      if (STEPS / GS == 1 && (kb & 1)) stage_body(1);
      else stage_body(0);
    }
    sc::wgmma_wait<0>();
#pragma unroll
    for (int blk = 0; blk < BLK; ++blk)
#pragma unroll
      for (int i = 0; i < NACC; ++i) sc::wgmma_fence_operand(acc[blk][i]);
  };
  // Epilogue through shared memory (the ring, free once every consumer of the cluster is past its last wgmma).
  // 1. Split-K (the tile's splits are one cluster): rank r owns row groups [r jmax, (r + 1) jmax) of the tile (row
  //    group j: accumulators 4 j .. 4 j + 3 of each block, tile rows 8 j + 2 c + e, channels n_lane + 64 blk + 8 h
  //    as [2 h + e]).  Two ranks (the common case): each keeps its own half in registers and hands the other half
  //    over packed (w4_pack8): by st.async pushes into the other rank's receive buffer where it fits (W4Rx), else
  //    through its own ring slots that the owner pulls after a cluster barrier.  3 to 8 ranks: each thread stores
  //    every row group to its CTA's slots (j, blk) of 256 threads x 16 bytes (constant offsets: one instruction per
  //    slot), and after a cluster barrier each owner reads its row groups' slots from the other ranks (distributed
  //    shared memory) and sums them in rank order (the same bits whichever CTA finishes first).
  // 2. The bias is added (INT8: the scales applied first), the values rounded to T and written to a row-major tile
  //    of the CTA's rows (16-byte chunks XOR-swizzled by row, so that the rows of a store fall in different banks)
  //    by stmatrix.trans: one instruction per two row groups of a block (the accumulator pairs (2 c, 2 c + 1) of a
  //    channel are an 8 x 8 matrix fragment whose transpose is the row-major tile).  Without a split straight from
  //    the accumulators.
  // 3. The 256 consumer threads store the tile's rows to y in whole 16-byte chunks: storing the accumulator order
  //    straight to y writes partial sectors, and one bulk copy per row took 1.3 us at 160 rows (H200).
  // It runs once per CTA, cold, hence few instructions per accumulator and loops where the registers allow.
  constexpr int J = MT / 8;
  constexpr int Y_ROW = 128 * BLK * (int)sizeof(T);
  constexpr int PIECES = Y_ROW / 16;  // 16-byte chunks per row
  constexpr int SLOT = 256 * 16;      // one block's row group: 16 bytes per consumer thread
  consume(kb_begin, kb_end);
#ifdef W4_TRACE
  if (threadIdx.x == 128) W4_MARK(3, clock64());
#endif
  sc::named_bar_sync(1, 256);  // both consumer warpgroups are done reading the ring
#ifdef W4_TRACE
  if (threadIdx.x == 128) W4_MARK(W4_TRACE_EPI + 0, clock64());
#endif
  {
    // The tile's coordinates from shared memory and the thread's indices read anew (opaque to the compiler): kept
    // live across the main loop they spilled.
    const int e_split = tile_info[0], e_m_tile = tile_info[1], e_n_tile = tile_info[2];
    const int tid = (int)tid_x() - 128;
    const int cw = tid / 128, warp = (tid / 32) % 4, lane = tid % 32, g = lane / 4;
    const int jmax = w4_rows_per_rank(J, splits);
    const int my_j0 = min(J, e_split * jmax), my_jn = min(J, my_j0 + jmax) - my_j0;
    unsigned char* y_tile = smem + (splits > 1 && !push ? J * BLK * SLOT : 0);  // past the slots
    // stmatrix.trans of row groups (j, j + 1) of block blk: matrix q = 2 (j parity) + h; lane 8 q + i gives the
    // address of tile row 8 (j + q / 2) + i, chunk (cw BLK + blk) 8 + 2 warp + h of it (swizzled by i = row % 8).
    const int sq = lane >> 3, si = lane & 7;
    const unsigned y_lane = sc::smem_addr(y_tile) + (8 * (sq >> 1) + si) * Y_ROW;
    auto y_addr = [&](int j, int blk) {
      return y_lane + 8 * j * Y_ROW + ((((cw * BLK + blk) * 8 + 2 * warp + (sq & 1)) ^ si) << 4);
    };
    // Channel of (blk, h): n_lane + 64 blk + 8 h.
    const int n_lane = (e_n_tile * L::BLOCKS + cw * BLK) * 64 + 16 * warp + g;
    float bv[BLK][2], sv[BLK][2];  // bias, and (INT8) the channel's scale
    const bool affine = KIND == W_INT8 || bias != nullptr;
#pragma unroll
    for (int blk = 0; blk < BLK; ++blk)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        bv[blk][h] = bias != nullptr ? sc::to_float<T>(bias[n_lane + 64 * blk + 8 * h]) : 0.f;
        sv[blk][h] =
            KIND == W_INT8 ? sc::to_float<T>(reinterpret_cast<const T*>(grec)[n_lane + 64 * blk + 8 * h]) : 1.f;
      }
    // Two row groups (v0: j, v1: j + 1) of block blk, after scale and bias, rounded into the y tile.
    auto tile_pair = [&](int j, int blk, const float* v0, const float* v1) {
      unsigned r[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float* v = (q >> 1) ? v1 : v0;
        const int h = q & 1;
        float lo = v[2 * h], hi = v[2 * h + 1];
        if (affine) {
          lo = fmaf(lo, sv[blk][h], bv[blk][h]);
          hi = fmaf(hi, sv[blk][h], bv[blk][h]);
        }
        r[q] = pack_rn<T>(lo, hi);
      }
      sc::stmatrix_x4_trans(y_addr(j, blk), r[0], r[1], r[2], r[3]);
    };
    // Split-K: every rank's slots are written (release / acquire: the other ranks read them next).
    auto slots_written = [&]() {
#ifdef W4_TRACE
      if (threadIdx.x == 128) W4_MARK(W4_TRACE_EPI + 1, clock64());
#endif
      sc::cluster_arrive_release();
      sc::cluster_wait();
#ifdef W4_TRACE
      if (threadIdx.x == 128) W4_MARK(W4_TRACE_EPI + 2, clock64());
#endif
    };
    if (splits == 1) {
#pragma unroll
      for (int j = 0; j < J; j += 2)
#pragma unroll
        for (int blk = 0; blk < BLK; ++blk) tile_pair(j, blk, &acc[blk][4 * j], &acc[blk][4 * j + 4]);
    } else if (splits == 2) {
      // Two ranks: each keeps the half of the tile it owns in registers and hands over the other half, so that half
      // the bytes cross shared memory (8192^2 M = 256: 2.6 us of pulls through the cluster window when all J row
      // groups went to the slots), packed (w4_pack8): rank r hands over row groups [(1 - r) H, (2 - r) H), in slots
      // of PSLOT bytes per pair of row groups and block (every thread's first four words, then the rest), and adds
      // what it gets to its own rows (own + other).  Where the receive buffer fits (RX), by st.async pushes into the
      // other rank's buffer as soon as its own main loop is done; else to its own ring slots, which the other rank
      // pulls after a cluster barrier.  The two ranks' copies of the code differ only in which accumulators they
      // take.
      constexpr int H = J / 2, PW = W4_PACK_WORDS, PSLOT = 256 * 4 * PW;
      static_assert(H % 2 == 0, "row groups are handed over in pairs");
      const int first = tid * 16, rest = 256 * 16 + tid * 4 * (PW - 4);  // a thread's words in slot 0
      const unsigned other = (unsigned)(1 - e_split);
      // Pair (jj, jj + 1) of block blk: own + the other rank's words w, into the y tile.
      auto add_pair = [&](const int base, const int jj, const int blk, const unsigned (&w)[PW]) {
        float o[2][4], v[2][4];
        w4_unpack8(w, o[0], o[1]);
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const float* a = &acc[blk][4 * (base + jj + q)];
#pragma unroll
          for (int e = 0; e < 4; ++e) v[q][e] = a[e] + o[q][e];
        }
        tile_pair(jj, blk, v[0], v[1]);
#ifdef W4_TRACE
        if (jj == 0 && blk == 0 && threadIdx.x == 128) W4_MARK(W4_TRACE_EPI + 6, clock64());
#endif
      };
      // Where the half this rank hands over goes: the other rank's receive buffer (pushes), or its own ring slots.
      unsigned dst, dst_rest, dst_bar = 0;
      if constexpr (RX::FITS) {
        const unsigned rx = sc::smem_addr(rx_buf);
        dst = sc::cluster_map(rx + first, other);
        dst_rest = sc::cluster_map(rx + rest, other);
        dst_bar = sc::cluster_map(sc::smem_addr(rx_full), other);
      } else {
        dst = sc::smem_addr(smem) + first;
        dst_rest = sc::smem_addr(smem) + rest;
      }
      // That half (row groups from base), packed pair by pair.  (Not a generic lambda: the GPU image's NVRTC 13.0
      // rejects one in JIT mode.)
      auto pack_pairs = [&](const int base) {
#pragma unroll
        for (int jj = 0; jj < H; jj += 2)
#pragma unroll
          for (int blk = 0; blk < BLK; ++blk) {
            unsigned w[PW];
            w4_pack8(&acc[blk][4 * (base + jj)], &acc[blk][4 * (base + jj + 1)], w);
            const int at = (jj / 2 * BLK + blk) * PSLOT;
            if constexpr (RX::FITS) w4_st_async_words(dst + at, dst_rest + at, w, dst_bar);
            else w4_st_words(dst + at, dst_rest + at, w);
          }
      };
      if constexpr (RX::FITS) {
        sc::cluster_wait();  // the other rank's receive barrier is initialized (its arrive at the start)
#ifdef W4_TRACE
        if (threadIdx.x == 128) W4_MARK(W4_TRACE_EPI + 1, clock64());
#endif
        if (e_split == 0) pack_pairs(H);
        else pack_pairs(0);
        sc::mbar_wait(rx_full, 0);
#ifdef W4_TRACE
        if (threadIdx.x == 128) W4_MARK(W4_TRACE_EPI + 2, clock64());
#endif
        auto sum_own = [&](const int base) {
#pragma unroll
          for (int jj = 0; jj < H; jj += 2)
#pragma unroll
            for (int blk = 0; blk < BLK; ++blk) {
              const int at = (jj / 2 * BLK + blk) * PSLOT;
              unsigned w[PW];
              w4_ld_words(rx_buf + at + first, rx_buf + at + rest, w);
              add_pair(base, jj, blk, w);
            }
        };
        if (e_split == 0) sum_own(0);
        else sum_own(H);
      } else {
        if (e_split == 0) pack_pairs(H);
        else pack_pairs(0);
        slots_written();
        const unsigned from = sc::cluster_map(dst, other), from_rest = sc::cluster_map(dst_rest, other);
        auto sum_own = [&](const int base) {
          unsigned x[H / 2][BLK][PW];  // every load in flight before the first is used
#pragma unroll
          for (int jj = 0; jj < H; jj += 2)
#pragma unroll
            for (int blk = 0; blk < BLK; ++blk) {
              const int at = (jj / 2 * BLK + blk) * PSLOT;
              w4_ld_cluster_words(from + at, from_rest + at, x[jj / 2][blk]);
            }
#ifdef W4_TRACE
          if (threadIdx.x == 128) W4_MARK(W4_TRACE_EPI + 5, clock64());
#endif
#pragma unroll
          for (int jj = 0; jj < H; jj += 2)
#pragma unroll
            for (int blk = 0; blk < BLK; ++blk) add_pair(base, jj, blk, x[jj / 2][blk]);
        };
        if (e_split == 0) sum_own(0);
        else sum_own(H);
      }
      sc::cluster_arrive_relaxed();  // waited for before exit: no CTA leaves while the other still sends or reads
    } else {
      const unsigned mine = sc::smem_addr(smem) + tid * 16;  // this thread's 16 bytes of slot (0, 0)
#pragma unroll
      for (int j = 0; j < J; ++j)
#pragma unroll
        for (int blk = 0; blk < BLK; ++blk)
          sc::st_shared_v4(mine + (j * BLK + blk) * SLOT, acc[blk][4 * j], acc[blk][4 * j + 1], acc[blk][4 * j + 2],
                           acc[blk][4 * j + 3]);
      slots_written();
      unsigned src_at[W4_MAX_SPLITS];  // this thread's 16 bytes of slot (0, 0) in each rank's shared memory
#pragma unroll
      for (int src = 0; src < W4_MAX_SPLITS; ++src) src_at[src] = src < splits ? sc::cluster_map(mine, src) : 0u;
      w4_owner_sums<BLK>(src_at, splits, my_j0, my_jn, tile_pair);
      sc::cluster_arrive_relaxed();  // waited for before exit: no CTA leaves while another still reads its slots
    }
#ifdef W4_TRACE
    if (threadIdx.x == 128) W4_MARK(W4_TRACE_EPI + 3, clock64());
#endif
    sc::named_bar_sync(1, 256);
#ifdef W4_TRACE
    if (threadIdx.x == 128) W4_MARK(W4_TRACE_EPI + 4, clock64());
#endif
    const int r0 = e_m_tile * MT + 8 * my_j0;  // the first x row of the CTA's y tile
    const int pieces = min(8 * my_jn, M - r0) * PIECES;
    T* const ybase = y + (long long)r0 * N + e_n_tile * L::BLOCKS * 64;
#pragma unroll 4
    for (int i = tid; i < pieces; i += 256) {
      const int r = i / PIECES, q = i % PIECES;
      *reinterpret_cast<uint4*>(ybase + (long long)r * N + q * (16 / (int)sizeof(T))) =
          *reinterpret_cast<const uint4*>(y_tile + r * Y_ROW + ((q ^ (r & 7)) << 4));
    }
  }
#ifdef W4_TRACE
  if (threadIdx.x == 128) {
    W4_MARK(5, clock64());
    W4_MARK(6, (long long)sc::globaltimer_ns());
  }
#endif
  if (splits > 1) sc::cluster_wait();
  // A tail launch may have started before the previous launch of the layer ended (programmatic dependent launch:
  // it reads nothing that one writes): it ends after it, so whatever follows in the stream sees all of y.
  sc::grid_dependency_wait();
}

// The wgmma-major INT4 copy of a stored AWQ / GPTQ qweight: word (b / 4, kb, b % 4, t, lane, s) (index
// ((((b / 4) KB + kb) 4 + b % 4) 4 + t) 32 + lane) 4 + s) holds, for lane = 4 g + c, channels n0 = 64 b + 16 t + g
// and n0 + 8, k = 64 kb + 16 s + (2 c, 2 c + 1, 2 c + 8, 2 c + 9): nibble i = r + 4 e is channel n0 + 8 (r % 2) at k
// offset 2 c + e + 8 (r / 2) (the m16n8k16 A fragment, register r, low half e = 0).  Super-blocks of 4 blocks,
// stage-major inside: a CTA's 2 or 4 blocks of a stage are one 4 / 8 KB piece, its stages consecutive pieces.
template <int FMT>
__global__ void __launch_bounds__(256) w4wgmma_pack_kernel(unsigned* __restrict__ out, const int* __restrict__ qw,
                                                           int KB, long long ldq, long long total) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int s = (int)(idx & 3), lane = (int)((idx >> 2) & 31), t = (int)((idx >> 7) & 3);
  const long long rest = idx >> 11;  // (super-block, kb)
  const int kb = (int)(rest % KB), b = (int)(rest / KB) * 4 + (int)((idx >> 9) & 3);
  const int g = lane >> 2, c = lane & 3;
  const int n_base = 64 * b + 16 * t + g, k_base = 64 * kb + 16 * s + 2 * c;
  unsigned word = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = i & 3, e = i >> 2;
    const int n = n_base + 8 * (r & 1), k = k_base + e + 8 * (r >> 1);
    unsigned q;
    if constexpr (FMT == AWQ) {
      const int o = n & 7;
      const int pos = (o & 1) ? 4 + (o >> 1) : (o >> 1);  // AWQ packs offsets [0, 2, 4, 6, 1, 3, 5, 7]
      q = ((unsigned)qw[(long long)k * ldq + (n >> 3)] >> (4 * pos)) & 15u;
    } else {
      q = ((unsigned)qw[(long long)(k >> 3) * ldq + n] >> (4 * (k & 7))) & 15u;
    }
    word |= q << (4 * i);
  }
  out[idx] = word;
}

// The wgmma-major INT8 copy of an int8 weight (N, K) (row stride ldw bytes) for w4_wgmma_kernel<..., W_INT8>: the
// INT4 copy's order with 4 KB chunks, word (b / 4, kc, b % 4, t, lane, s, h) (index ((((b / 4) KC + kc) 4 + b % 4)
// 128 + 32 t + lane) 8 + 2 s + h) holds, for lane = 4 g + c, channel n0 = 64 b + 16 t + g + 8 h at k = 64 kc + 16 s
// + (2 c, 2 c + 1, 2 c + 8, 2 c + 9) in bytes 0-3: bytes 0-1 make A register h of the m16n8k16 fragment, 2-3
// register h + 2 (sc::int8_pair).
// (A template only so that the other variants' modules leave it out: NVRTC compiles every non-template kernel.)
template <int WIDTH>
__global__ void __launch_bounds__(256) w8wgmma_pack_kernel(unsigned* __restrict__ out,
                                                           const signed char* __restrict__ w, int KC, long long ldw,
                                                           long long total) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int h = (int)(idx & 1), s = (int)((idx >> 1) & 3), lane = (int)((idx >> 3) & 31), t = (int)((idx >> 8) & 3);
  const long long rest = idx >> 12;  // (super-block, kc)
  const int kc = (int)(rest % KC), b = (int)(rest / KC) * 4 + (int)((idx >> 10) & 3);
  const int g = lane >> 2, c = lane & 3;
  static_assert(WIDTH == 1, "signed bytes");
  const signed char* row = w + (long long)(64 * b + 16 * t + g + 8 * h) * ldw + 64 * kc + 16 * s + 2 * c;
  const unsigned b0 = (unsigned char)row[0], b1 = (unsigned char)row[1], b2 = (unsigned char)row[8],
                 b3 = (unsigned char)row[9];
  out[idx] = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24);
}

}  // namespace quant_sm90
