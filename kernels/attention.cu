// FlashAttention-2 forward for sm_80 and newer: mma.sync m16n8k16, ldmatrix, cp.async, online softmax.
//
// One CTA of NUM_WARPS warps (4, or 8) computes one BM-row tile of queries of one (batch, head).  Each warp owns 16*MT
// consecutive query rows and streams the whole key range of the tile through shared memory, BN keys at a
// time, double buffered: the cp.async copies of tile j+1 are issued right after the barrier that opens
// tile j, so a whole tile of math hides each load.  S = Q K^T and O += P V run on tensor cores with fp32
// accumulators; P never leaves registers (the S accumulator layout of m16n8k16 is the A-operand layout once
// packed to 16 bits).  Softmax is online, in base 2, with the softmax scale folded into one FFMA per score.
//
// Shared memory rows are padded by 16 bytes (PITCH = D + 8 elements): the 8 row addresses of one ldmatrix
// phase then fall on 8 distinct 16-byte bank groups for every head dim, including 96 and 192 whose rows are
// not a multiple of 128 bytes (an XOR swizzle would need a power-of-two row).
//
// Masking (causal, sliding window, the end of the key sequence) is one rule: key j is visible to query i iff
// lo(i) <= j < hi(i) with lo = max(0, i + sk - sq - left) and hi = min(sk, i + sk - sq + right + 1), i.e. the
// diagonal aligned to the bottom-right corner as in flash-attn 2.1+; causal is right = 0, "unbounded" is a
// large number.  The CTA only visits the key tiles that intersect [lo(first row), hi(last row)), and only
// tiles crossing a boundary pay for the per-element mask (a warp-uniform branch).
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/softmax.cuh"

#ifndef FA_LAZY_RESCALE
#define FA_LAZY_RESCALE 1
#endif

namespace fa {

template <typename T> __device__ __forceinline__ unsigned ones_x2();
template <> __device__ __forceinline__ unsigned ones_x2<__half>() { return 0x3c003c00u; }
template <> __device__ __forceinline__ unsigned ones_x2<__nv_bfloat16>() { return 0x3f803f80u; }

// An opaque copy of x: values derived from it inside a loop are not hoisted out of the loop and kept live in
// registers (the load addresses below are cheap to recompute and would otherwise hold ~50 registers).
__device__ __forceinline__ int opaque(int x) {
  int y;
  asm volatile("mov.b32 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// Copy ROWS x D elements (rows of `row_stride` elements in global memory; ROWS * row_stride < 2^31) to the
// shared rows of PITCH elements at `saddr` with 16-byte cp.async.  Rows at or past `rows_valid` and 16-byte
// chunks at or past `chunks_valid` are zero-filled, so partial tiles and padded head dims read as zeros.
// FULL (rows_valid >= ROWS, known at compile time) drops the per-row predicate: the loop-resident loads then
// cost one 64-bit add per 16-byte copy.
template <typename T, int ROWS, int D, int PITCH, int NUM_THREADS, bool FULL>
__device__ __forceinline__ void load_tile_async(unsigned saddr, const T* gmem, int row_stride, int rows_valid,
                                                int chunks_valid, int tid) {
  constexpr int CHUNKS = D / 8;
  constexpr int TOTAL = ROWS * CHUNKS;
  const int stride = opaque(row_stride);
  if constexpr (NUM_THREADS % CHUNKS == 0) {
    // every pass covers whole rows: the same chunk of rows RSTEP apart
    constexpr int RSTEP = NUM_THREADS / CHUNKS;
    const int r0 = tid / CHUNKS, ch = tid % CHUNKS;
    const bool ch_ok = ch < chunks_valid;
    // 32-bit byte offsets from the tile's base (ROWS * row_stride < 2^31 elements): one add and one wide
    // multiply-add per copy.  A zero-filled copy reads nothing, but its address still has to be a valid
    // one: chunk 0 of row 0.
    const char* const base = reinterpret_cast<const char*>(gmem);
    const unsigned off0 = (unsigned)(r0 * stride + (ch_ok ? ch * 8 : 0)) * (unsigned)sizeof(T);
    const unsigned step = (unsigned)(RSTEP * stride) * (unsigned)sizeof(T);
    const unsigned dst0 = saddr + (unsigned)(r0 * PITCH + ch * 8) * (unsigned)sizeof(T);
#pragma unroll
    for (int i = 0; i < (TOTAL + NUM_THREADS - 1) / NUM_THREADS; ++i) {
      const int r = r0 + i * RSTEP;
      if (TOTAL % NUM_THREADS == 0 || r < ROWS) {
        const bool row_ok = FULL || r < rows_valid;
        const char* src = base + (row_ok ? off0 + i * step : 0u);
        sc::cp_async16_s(dst0 + i * RSTEP * PITCH * (int)sizeof(T), src, row_ok && ch_ok);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < (TOTAL + NUM_THREADS - 1) / NUM_THREADS; ++i) {
      const int c = tid + i * NUM_THREADS;
      if (TOTAL % NUM_THREADS == 0 || c < TOTAL) {
        const int r = c / CHUNKS, ch = c % CHUNKS;
        const bool ok = (FULL || r < rows_valid) && ch < chunks_valid;
        const T* src = gmem + (ok ? r * stride + ch * 8 : 0);
        sc::cp_async16_s(saddr + (unsigned)(r * PITCH + ch * 8) * (unsigned)sizeof(T), src, ok);
      }
    }
  }
}

}  // namespace fa

// out, q: rows of one (batch, head) are `*_row_stride` apart; k, v: likewise with head kv_head = head /
// heads_per_kv.  With cu_seqlens_q/k (varlen) the batch strides are 0 and sequence b spans rows
// [cu[b], cu[b+1]) (clamped to total_q / total_k so that a bad cu_seqlens cannot read out of bounds).
// lse (optional): float32 at lse + b * lse_batch_stride + h * lse_head_stride + (row offset of b) + i.
// HAS_SOFTCAP: a template flag because its registers are needed only when it is used.
// MIN_CTAS caps the registers so that this many CTAs fit on one SM (4 warps: 2 -> 255 registers, 3 -> 168).
// scale_log2 multiplies raw scores (softmax_scale * log2 e, or 1 with softcap, whose transform already
// yields base-2 scores); softcap_pre = 2 log2(e) softmax_scale / softcap, softcap_post = softcap log2(e).
template <typename T, int D, int BN, int MT, int NUM_WARPS, int MIN_CTAS, bool HAS_SOFTCAP, int Q_REG_KS,
          bool ROWSUM_MMA, int NS>
__global__ void __launch_bounds__(NUM_WARPS * 32, MIN_CTAS) flash_fwd_kernel(
    T* __restrict__ out, float* __restrict__ lse, const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ v, const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
    long long q_batch_stride, long long q_row_stride, long long q_head_stride, long long k_batch_stride,
    long long k_row_stride, long long k_head_stride, long long v_batch_stride, long long v_row_stride,
    long long v_head_stride, long long o_batch_stride, long long o_row_stride, long long o_head_stride,
    long long lse_batch_stride, long long lse_head_stride, int seqlen_q, int seqlen_k, int total_q, int total_k,
    int head_dim, int heads_per_kv, int window_left, int window_right, float scale_log2, float softcap_pre,
    float softcap_post, int reverse_m) {
  using namespace fa;
  constexpr int NUM_THREADS = NUM_WARPS * 32;
  constexpr int BM = 16 * MT * NUM_WARPS;
  constexpr int PITCH = D + 8;
  constexpr int KV_TILE = BN * PITCH;  // elements of one K or V tile
  constexpr int STAGE = 2 * KV_TILE;   // K then V
  constexpr int NKS = D / 16;    // k-steps of Q K^T
  // NS pipeline stages of K and V: the copies of tile j + NS - 1 are issued when tile j starts.
  // Q fragments stay in registers for the whole CTA when they are few; then Q is staged through the
  // last pipeline stage before the first key tile needs it, and costs no shared memory of its own.
  // Otherwise Q keeps its own tile in shared memory, and its first Q_REG_KS k-steps are held in registers
  // (fewer ldmatrix per MMA in Q K^T, where registers allow).
  constexpr bool Q_IN_REGS = MT * D <= 128;
  constexpr int Q_KS = Q_IN_REGS ? NKS : Q_REG_KS;
  static_assert(Q_KS >= 0 && Q_KS <= NKS, "Q k-steps in registers");
  constexpr int NNT = BN / 8;    // n-tiles of S
  constexpr int NDT = D / 8;     // n-tiles of O
  static_assert(D % 16 == 0 && BN % 16 == 0, "tile shapes");
  static_assert(!Q_IN_REGS || BM <= 2 * BN, "Q is staged in one pipeline stage");
  static_assert(BM <= 2 * NS * BN, "the O tile is staged in the pipeline stages");
  static_assert(NS >= 2, "at least double buffering");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const smem = reinterpret_cast<T*>(smem_raw);
  T* const sQ = Q_IN_REGS ? smem + (NS - 1) * STAGE : smem + NS * STAGE;
  constexpr int ES = (int)sizeof(T);
  const unsigned smem_u32 = sc::smem_addr(smem);
  const unsigned sQ_u32 = sc::smem_addr(sQ);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int m_block = reverse_m ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x;
  const int head = blockIdx.y, batch = blockIdx.z;
  const int kv_head = head / heads_per_kv;

  int q_off = 0, k_off = 0, sq = seqlen_q, sk = seqlen_k;
  if (cu_seqlens_q != nullptr) {
    q_off = min(max(cu_seqlens_q[batch], 0), total_q);
    sq = min(max(cu_seqlens_q[batch + 1], q_off), total_q) - q_off;
    k_off = min(max(cu_seqlens_k[batch], 0), total_k);
    sk = min(max(cu_seqlens_k[batch + 1], k_off), total_k) - k_off;
  }
  const int m0 = m_block * BM;
  if (m0 >= sq) return;

  const T* const q_base = q + batch * q_batch_stride + (long long)(q_off + m0) * q_row_stride + head * q_head_stride;
  const T* const k_base = k + batch * k_batch_stride + (long long)k_off * k_row_stride + kv_head * k_head_stride;
  const T* const v_base = v + batch * v_batch_stride + (long long)k_off * v_row_stride + kv_head * v_head_stride;
  // Output pointers are formed where they are used, so that they do not hold registers through the main loop.
  auto o_tile = [&]() {
    return out + batch * o_batch_stride + (long long)(q_off + m0) * o_row_stride + head * o_head_stride;
  };
  auto lse_tile = [&]() { return lse + batch * lse_batch_stride + head * lse_head_stride + q_off + m0; };
  const int chunks_valid = head_dim >> 3;
  const int rows_q = min(BM, sq - m0);

  // Key range of this tile of queries, and the part of it that needs no mask.
  const int diag = sk - sq;
  const int m_last = m0 + rows_q - 1;
  const int lo_first = max(0, m0 + diag - window_left);
  const int lo_last = max(0, m_last + diag - window_left);
  const int hi_first = min(sk, m0 + diag + window_right + 1);
  const int hi_last = min(sk, m_last + diag + window_right + 1);
  const int n_begin = lo_first / BN;
  const int n_end = hi_last > lo_first ? (hi_last + BN - 1) / BN : n_begin;

  const int g = lane >> 2, t = lane & 3;  // mma fragment coordinates: row group, thread in group
  const int warp_row0 = warp * 16 * MT;

  if (n_begin >= n_end) {  // no query row of this tile sees any key: zeros, lse = -inf
    T* const o_base = o_tile();
    for (int c = tid; c < rows_q * chunks_valid; c += NUM_THREADS) {
      const int r = c / chunks_valid, ch = c % chunks_valid;
      *reinterpret_cast<uint4*>(o_base + (long long)r * o_row_stride + ch * 8) = make_uint4(0, 0, 0, 0);
    }
    if (lse != nullptr)
      for (int r = tid; r < rows_q; r += NUM_THREADS) lse_tile()[r] = neg_inf();
    return;
  }

  // Prologue: Q (its own cp.async group), then the first NS - 1 key tiles, one group each (empty groups
  // keep the count uniform).  Key tiles are visited from the last to the first: the tiles crossing the
  // causal diagonal come first.
  load_tile_async<T, BM, D, PITCH, NUM_THREADS, false>(sQ_u32, q_base, (int)q_row_stride, rows_q, chunks_valid, tid);
  sc::cp_async_commit();
  int n_block = n_end - 1;
#pragma unroll
  for (int j = 0; j < NS - 1; ++j) {
    const int nb = n_block - j;
    if (nb >= n_begin) {
      const int rows_k = sk - nb * BN;
      const unsigned dst = smem_u32 + j * STAGE * ES;
      load_tile_async<T, BN, D, PITCH, NUM_THREADS, false>(dst, k_base + (long long)nb * BN * k_row_stride,
                                                           (int)k_row_stride, rows_k, chunks_valid, tid);
      load_tile_async<T, BN, D, PITCH, NUM_THREADS, false>(dst + KV_TILE * ES, v_base + (long long)nb * BN * v_row_stride,
                                                           (int)v_row_stride, rows_k, chunks_valid, tid);
    }
    sc::cp_async_commit();
  }

  // Per-lane ldmatrix offsets (elements) inside a tile.
  //  Q (A operand, x4): lanes 0-15 rows 0-15 at column 0, lanes 16-31 the same rows at column 8.
  //  K (B operand of S, x4): matrices (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15).
  //  V (B operand of O, x4.trans): matrices (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 8-15).
  const int q_lane = (lane & 15) * PITCH + (lane >> 4) * 8;
  const int k_lane = ((lane >> 4) * 8 + (lane & 7)) * PITCH + ((lane >> 3) & 1) * 8;
  const int v_lane = (((lane >> 3) & 1) * 8 + (lane & 7)) * PITCH + (lane >> 4) * 8;
  const unsigned q_addr = sQ_u32 + ((warp_row0 * PITCH) + q_lane) * ES;

  unsigned q_frag[MT][Q_KS > 0 ? Q_KS : 1][4];
  if constexpr (Q_KS > 0) {
    sc::cp_async_wait<NS - 1>();  // the Q group is complete
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int ks = 0; ks < Q_KS; ++ks)
        sc::ldmatrix_x4_s(q_frag[mt][ks], q_addr + ((mt * 16) * PITCH + ks * 16) * ES);
  }

  float o_acc[MT][NDT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NDT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[mt][nt][e] = 0.f;
  // ROWSUM_MMA: row sums of P on the tensor cores (P times a column of ones: one extra mma per 16 keys per
  // m-tile instead of one FADD per score); they then sum the 16-bit P that O sums too.
  constexpr bool MMA_ROWSUM = ROWSUM_MMA;
  // row sums: per lane partial sums (FADD path), or the mma accumulator of P x ones (c0 row g, c2 row g + 8)
  float row_max[MT][2], row_sum[MT][2], row_sum_mma[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[mt][h] = neg_inf();
      row_sum[mt][h] = 0.f;
      row_sum_mma[mt][2 * h] = row_sum_mma[mt][2 * h + 1] = 0.f;
    }

  int stage = 0;
  for (; n_block >= n_begin; --n_block) {
    sc::cp_async_wait<NS - 2>();
    __syncthreads();  // tile n_block is in shared memory, and every warp is done with the previous stage
    {
      const int nb = n_block - (NS - 1);
      if (nb >= n_begin) {  // a full tile: only the first one visited can be partial
        const unsigned dst = smem_u32 + (stage == 0 ? NS - 1 : stage - 1) * STAGE * ES;
        load_tile_async<T, BN, D, PITCH, NUM_THREADS, true>(dst, k_base + (long long)nb * BN * k_row_stride,
                                                            (int)k_row_stride, BN, chunks_valid, tid);
        load_tile_async<T, BN, D, PITCH, NUM_THREADS, true>(dst + KV_TILE * ES, v_base + (long long)nb * BN * v_row_stride,
                                                            (int)v_row_stride, BN, chunks_valid, tid);
      }
      sc::cp_async_commit();
    }
    const unsigned k_addr = smem_u32 + stage * STAGE * ES + k_lane * ES;
    const unsigned v_addr = smem_u32 + (stage * STAGE + KV_TILE) * ES + v_lane * ES;

    // S = Q K^T
    float s[MT][NNT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < NKS; ++ks) {
      unsigned a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (ks < Q_KS) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mt][e] = q_frag[mt][ks < Q_KS ? ks : 0][e];
        } else {
          sc::ldmatrix_x4_s(a[mt], q_addr + ((mt * 16) * PITCH + ks * 16) * ES);
        }
      }
#pragma unroll
      for (int np = 0; np < NNT / 2; ++np) {
        unsigned b[4];
        sc::ldmatrix_x4_s(b, k_addr + (np * 16 * PITCH + ks * 16) * ES);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          sc::mma_16816<T>(s[mt][2 * np], a[mt], b);
          sc::mma_16816<T>(s[mt][2 * np + 1], a[mt], b + 2);
        }
      }
    }

    if constexpr (HAS_SOFTCAP) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[mt][nt][e] = softcap_log2(s[mt][nt][e], softcap_pre, softcap_post);
    }

    const int n0 = n_block * BN;
    if (n0 < lo_last || n0 + BN > hi_first) {  // a boundary tile
      // visible iff diag - left <= col - row <= diag + right and col < sk; the per-element offsets are
      // compile-time constants, so the whole mask costs four live registers
      const int col0 = n0 + 2 * t;
      const int rel0 = col0 - (m0 + warp_row0 + g);
      const int rel_lo = diag - window_left, rel_hi = diag + window_right, cols_left = sk - col0;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int nt = 0; nt < NNT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int rel = rel0 + (nt * 8 + e - mt * 16 - 8 * h);
              if (rel < rel_lo || rel > rel_hi || nt * 8 + e >= cols_left) s[mt][nt][2 * h + e] = neg_inf();
            }
    }

    // Online softmax; P overwrites S in place, rounded to T as the A operand of P V.
    float tile_max[MT][2];
    bool grow = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = s[mt][0][2 * h];
#pragma unroll
        for (int nt = 0; nt < NNT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        tile_max[mt][h] = mx;
#if FA_LAZY_RESCALE
        // The running max may lag the true one by up to 8 (base 2): P <= 256 stays exact enough in fp32 sums
        // and in 16-bit P, and O is rescaled only when some row of the warp outgrows that (rarely, after the
        // first tiles).  -inf - -inf is NaN, which compares false: a row with no key yet needs nothing.
        grow |= (mx - row_max[mt][h]) * scale_log2 > 8.f;
#else
        grow |= mx > row_max[mt][h];
#endif
      }
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float m_new = fmaxf(row_max[mt][h], tile_max[mt][h]);
          // a row that has seen no key keeps max -inf and has nothing to rescale
          const float corr = m_new == neg_inf() ? 1.f : sc::fast_exp2((row_max[mt][h] - m_new) * scale_log2);
          row_max[mt][h] = m_new;
          if constexpr (MMA_ROWSUM) {
            row_sum_mma[mt][2 * h] *= corr;
            row_sum_mma[mt][2 * h + 1] *= corr;
          } else {
            row_sum[mt][h] *= corr;
          }
#pragma unroll
          for (int nt = 0; nt < NDT; ++nt) {
            o_acc[mt][nt][2 * h] *= corr;
            o_acc[mt][nt][2 * h + 1] *= corr;
          }
        }
    }
    unsigned p[MT][BN / 16][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // subtract 0 rather than -inf for a row with no key yet, so that exp2 gives 0, not NaN
        const float m_scaled = row_max[mt][h] == neg_inf() ? 0.f : row_max[mt][h] * scale_log2;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NNT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = sc::fast_exp2(fmaf(s[mt][nt][2 * h + e], scale_log2, -m_scaled));
            s[mt][nt][2 * h + e] = pv;
            if constexpr (!MMA_ROWSUM) sum += pv;
          }
        if constexpr (!MMA_ROWSUM) row_sum[mt][h] += sum;
      }
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        p[mt][kk][0] = pack_f32x2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        p[mt][kk][1] = pack_f32x2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        p[mt][kk][2] = pack_f32x2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        p[mt][kk][3] = pack_f32x2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
    }

    // O += P V
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        unsigned b[4];
        sc::ldmatrix_x4_trans_s(b, v_addr + (kk * 16 * PITCH + dp * 16) * ES);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          sc::mma_16816<T>(o_acc[mt][2 * dp], p[mt][kk], b);
          sc::mma_16816<T>(o_acc[mt][2 * dp + 1], p[mt][kk], b + 2);
        }
      }
      if constexpr (MMA_ROWSUM) {
        const unsigned ones[2] = {ones_x2<T>(), ones_x2<T>()};
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) sc::mma_16816<T>(row_sum_mma[mt], p[mt][kk], ones);
      }
    }
    stage = stage == NS - 1 ? 0 : stage + 1;
  }

  // Epilogue: normalize, stage O through shared memory for 16-byte stores, write lse.
  __syncthreads();  // every warp is done reading K and V
  T* const sO = smem;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l;
      if constexpr (MMA_ROWSUM) {
        l = row_sum_mma[mt][2 * h];  // the mma already summed over every key of the row
      } else {
        l = row_sum[mt][h];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int r = warp_row0 + mt * 16 + g + 8 * h;
#pragma unroll
      for (int nt = 0; nt < NDT; ++nt)
        *reinterpret_cast<unsigned*>(sO + r * PITCH + nt * 8 + 2 * t) =
            pack_f32x2<T>(o_acc[mt][nt][2 * h] * inv, o_acc[mt][nt][2 * h + 1] * inv);
      if (lse != nullptr && t == 0 && r < rows_q)
        lse_tile()[r] = l > 0.f ? (row_max[mt][h] * scale_log2 + __log2f(l)) * LN2 : neg_inf();
    }
  __syncwarp();
  constexpr int WARP_CHUNKS = 16 * MT * (D / 8);
  T* const o_base = o_tile();
#pragma unroll
  for (int i = 0; i < WARP_CHUNKS / 32; ++i) {
    const int c = lane + i * 32;
    const int r = warp_row0 + c / (D / 8), ch = c % (D / 8);
    if (r < rows_q && ch < chunks_valid)
      *reinterpret_cast<uint4*>(o_base + (long long)r * o_row_stride + ch * 8) =
          *reinterpret_cast<const uint4*>(sO + r * PITCH + ch * 8);
  }
}
