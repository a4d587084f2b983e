// Attention of many query tokens per sequence over vLLM's paged KV cache (num_blocks, block_size, heads_kv, D):
// chunked prefill, prefix caching and speculative verification.
//
// paged_prefill_kernel: FlashAttention-2's forward loop (mma.sync m16n8k16 + ldmatrix + multi-stage cp.async,
// online base-2 softmax in registers, sm_80 and newer), the loop of kernels/attention.cu's flash_fwd_kernel with
// the K/V tiles gathered through the block table: token t of sequence b lives in page block_table[b, t / block_size]
// at slot t % block_size.  The query tokens of sequence b are the last ones of its seqused_k[b] cached tokens (this
// step's K/V are in the cache already), so the causal diagonal is aligned to the bottom-right corner as in
// flash-attn.  Two ways to find a tile's rows, a template parameter:
//   PAGE_TILE (block_size % BN == 0): the BN rows of a tile are consecutive slots of one page; one block-table
//     entry per tile, and the tile is copied exactly as a contiguous one (row stride = the cache's token stride).
//   otherwise: every thread resolves the page of each row it copies (block sizes 16, 1, 7, ...); K and V share the
//     offset.  Either way the next tile's block-table entries are loaded one iteration ahead, so their latency
//     hides under a tile of math instead of preceding the copies.
// Rows at or past the sequence's length are zero-filled and never read, so unowned cache memory (even NaN) is
// harmless, and block-table entries past a sequence's last page are never read.
//
// paged_verify_kernel (a few query tokens per sequence: speculative verification) and paged_prefill_sm90_kernel
// (sm_90a) follow below, each with its own header.
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/softmax.cuh"
#include "common/reduce.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"

namespace pa {

template <typename T> __device__ __forceinline__ unsigned ones_x2();
template <> __device__ __forceinline__ unsigned ones_x2<__half>() { return 0x3c003c00u; }
template <> __device__ __forceinline__ unsigned ones_x2<__nv_bfloat16>() { return 0x3f803f80u; }

// An opaque copy of x: values derived from it inside a loop are not hoisted out of the loop and kept live in
// registers (load addresses are cheap to recompute; kept live they would cost tens of registers).
__device__ __forceinline__ int opaque(int x) {
  int y;
  asm volatile("mov.b32 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// ROWS x D elements (rows `row_stride` elements apart, ROWS * row_stride < 2^31) into shared rows of PITCH
// elements with 16-byte cp.async; rows at or past rows_valid and chunks at or past chunks_valid are zero-filled.
// The Q tile, and a K/V tile inside one page (PAGE_TILE).
template <typename T, int ROWS, int D, int PITCH, int NUM_THREADS, bool FULL>
__device__ __forceinline__ void load_rows_async(unsigned saddr, const T* gmem, int row_stride, int rows_valid,
                                                int chunks_valid, int tid) {
  constexpr int CHUNKS = D / 8;
  constexpr int RSTEP = NUM_THREADS / CHUNKS;
  constexpr int RPT = (ROWS + RSTEP - 1) / RSTEP;
  static_assert(NUM_THREADS % CHUNKS == 0, "every pass covers whole rows");
  const int stride = opaque(row_stride);
  const int r0 = tid / CHUNKS, ch = tid % CHUNKS;
  const bool ch_ok = ch < chunks_valid;
  const char* const base = reinterpret_cast<const char*>(gmem);
  const unsigned off0 = (unsigned)(r0 * stride + (ch_ok ? ch * 8 : 0)) * (unsigned)sizeof(T);
  const unsigned step = (unsigned)(RSTEP * stride) * (unsigned)sizeof(T);
  const unsigned dst0 = saddr + (unsigned)(r0 * PITCH + ch * 8) * (unsigned)sizeof(T);
#pragma unroll
  for (int i = 0; i < RPT; ++i) {
    const int r = r0 + i * RSTEP;
    if (ROWS % RSTEP == 0 || r < ROWS) {
      const bool row_ok = FULL || r < rows_valid;
      const char* src = base + (row_ok ? off0 + i * step : 0u);
      sc::cp_async16_s(dst0 + i * RSTEP * PITCH * (int)sizeof(T), src, row_ok && ch_ok);
    }
  }
}

// Where the rows of one K/V tile live.  PAGE_TILE: the page of the whole tile (-1: no row is valid).  Otherwise
// the page of each of the RPT rows this thread copies (-1: past the sequence, zero-filled).
template <bool PAGE_TILE, int RPT> struct TilePages {
  int page[PAGE_TILE ? 1 : RPT];
};

struct PageTable {
  const int* row;  // block_table[b]
  int block_size, bs_shift, num_blocks, seq_len;
  // page and slot of token tok (0 <= tok < seq_len): a shift and a mask for power-of-two block sizes
  __device__ __forceinline__ int block_of(int tok) const {
    return bs_shift >= 0 ? tok >> bs_shift : tok / block_size;
  }
  __device__ __forceinline__ int slot_of(int tok) const {
    return bs_shift >= 0 ? tok & (block_size - 1) : tok - (tok / block_size) * block_size;
  }
  // min() with num_blocks - 1 keeps a corrupt block table from faulting
  __device__ __forceinline__ int page_of(int tok) const {
    return (int)min((unsigned)row[block_of(tok)], (unsigned)(num_blocks - 1));
  }
};

// Block-table entries of the tile of keys [n0, n0 + BN).
template <bool PAGE_TILE, int BN, int D, int NUM_THREADS>
__device__ __forceinline__ void resolve_pages(TilePages<PAGE_TILE, (BN + NUM_THREADS / (D / 8) - 1) / (NUM_THREADS / (D / 8))>& tp,
                                              const PageTable& pt, int n0, int tid) {
  constexpr int CHUNKS = D / 8;
  constexpr int RSTEP = NUM_THREADS / CHUNKS;
  constexpr int RPT = (BN + RSTEP - 1) / RSTEP;
  if constexpr (PAGE_TILE) {
    tp.page[0] = n0 < pt.seq_len ? pt.page_of(n0) : -1;
  } else {
    const int r0 = tid / CHUNKS;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int tok = n0 + r0 + i * RSTEP;
      tp.page[i] = (BN % RSTEP == 0 || r0 + i * RSTEP < BN) && tok < pt.seq_len ? pt.page_of(tok) : -1;
    }
  }
}

// K and V of the tile of keys [n0, n0 + BN) into their shared tiles (V KV_TILE elements after K).  k, v: the
// caches at this KV head.  FULL: every row of the tile is inside the sequence (known at compile time).
template <typename T, bool PAGE_TILE, int BN, int D, int PITCH, int NUM_THREADS, bool FULL>
__device__ __forceinline__ void load_kv_tile(unsigned dst, const T* k, const T* v, long long stride_block,
                                             int stride_tok, const PageTable& pt,
                                             const TilePages<PAGE_TILE, (BN + NUM_THREADS / (D / 8) - 1) / (NUM_THREADS / (D / 8))>& tp,
                                             int n0, int chunks_valid, int tid) {
  constexpr int ES = (int)sizeof(T);
  constexpr unsigned V_OFF = BN * PITCH * ES;
  if constexpr (PAGE_TILE) {
    const int page = tp.page[0];
    const long long off = page >= 0 ? (long long)page * stride_block + (long long)pt.slot_of(n0) * stride_tok : 0;
    const int rows = page >= 0 ? pt.seq_len - n0 : 0;
    load_rows_async<T, BN, D, PITCH, NUM_THREADS, FULL>(dst, k + off, stride_tok, rows, chunks_valid, tid);
    load_rows_async<T, BN, D, PITCH, NUM_THREADS, FULL>(dst + V_OFF, v + off, stride_tok, rows, chunks_valid, tid);
  } else {
    constexpr int CHUNKS = D / 8;
    constexpr int RSTEP = NUM_THREADS / CHUNKS;
    constexpr int RPT = (BN + RSTEP - 1) / RSTEP;
    const int r0 = tid / CHUNKS, ch = tid % CHUNKS;
    const bool ch_ok = ch < chunks_valid;
    const unsigned dst0 = dst + (unsigned)(r0 * PITCH + ch * 8) * (unsigned)ES;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int r = r0 + i * RSTEP;
      if (BN % RSTEP == 0 || r < BN) {
        const int page = tp.page[i];
        const bool ok = page >= 0 && ch_ok;
        // a zero-filled copy reads nothing, but its address must still be valid: chunk 0 of page 0
        const long long off =
            ok ? (long long)page * stride_block + (long long)pt.slot_of(n0 + r) * stride_tok + ch * 8 : 0;
        const unsigned d = dst0 + i * RSTEP * PITCH * ES;
        sc::cp_async16_s(d, k + off, ok);
        sc::cp_async16_s(d + V_OFF, v + off, ok);
      }
    }
  }
}

}  // namespace pa

// One CTA of NUM_WARPS warps computes one BM-row tile of the query tokens of one (sequence, head); each warp owns
// 16 MT rows and streams the visible key range through an NS-stage cp.async ring of BN-key K/V tiles, from the last
// tile to the first (the tiles crossing the causal diagonal first).  Masking as in kernels/attention.cu: key j is
// visible to query i iff i + diag - left <= j <= i + diag + right and j < sk, with diag = sk - sq.
//
// q, out: (total_q, heads, D) with row and head strides; sequence b holds rows [cu_seqlens_q[b], cu_seqlens_q[b+1])
// (clamped to total_q).  K/V: cache strides (block, token, head; the same for both).  sk = seqused_k[b], clamped
// to [0, max_len] (max_len = the block table's width x block_size).  lse (optional): float32 (heads, total_q).
// scale_log2, softcap_pre, softcap_post: as in kernels/attention.cu.
template <typename T, int D, int BN, int MT, int NUM_WARPS, int MIN_CTAS, bool HAS_SOFTCAP, int Q_REG_KS,
          bool ROWSUM_MMA, int NS, bool PAGE_TILE>
__global__ void __launch_bounds__(NUM_WARPS * 32, MIN_CTAS) paged_prefill_kernel(
    T* __restrict__ out, float* __restrict__ lse, const T* __restrict__ q, const T* __restrict__ k_cache,
    const T* __restrict__ v_cache, const int* __restrict__ cu_seqlens_q, const int* __restrict__ seqused_k,
    const int* __restrict__ block_table, long long q_row_stride, long long q_head_stride, long long o_row_stride,
    long long o_head_stride, long long c_stride_block, long long c_stride_tok, long long c_stride_head,
    long long bt_stride, int total_q, int max_len, int block_size, int num_blocks, int head_dim, int heads_per_kv,
    int window_left, int window_right, float scale_log2, float softcap_pre, float softcap_post, int reverse_m) {
  using namespace pa;
  using namespace fa;
  constexpr int NUM_THREADS = NUM_WARPS * 32;
  constexpr int BM = 16 * MT * NUM_WARPS;
  constexpr int PITCH = D + 8;
  constexpr int KV_TILE = BN * PITCH;
  constexpr int STAGE = 2 * KV_TILE;
  constexpr int NKS = D / 16;
  constexpr bool Q_IN_REGS = MT * D <= 128;
  constexpr int Q_KS = Q_IN_REGS ? NKS : Q_REG_KS;
  static_assert(Q_KS >= 0 && Q_KS <= NKS, "Q k-steps in registers");
  constexpr int NNT = BN / 8;
  constexpr int NDT = D / 8;
  constexpr int RPT = (BN + NUM_THREADS / (D / 8) - 1) / (NUM_THREADS / (D / 8));
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

  const int q_off = min(max(cu_seqlens_q[batch], 0), total_q);
  const int sq = min(max(cu_seqlens_q[batch + 1], q_off), total_q) - q_off;
  const int m0 = m_block * BM;
  if (m0 >= sq) return;
  const int sk = min(max(seqused_k[batch], 0), max_len);

  PageTable pt;
  pt.row = block_table + (long long)batch * bt_stride;
  pt.block_size = block_size;
  pt.bs_shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;
  pt.num_blocks = num_blocks;
  pt.seq_len = sk;

  const T* const q_base = q + (long long)(q_off + m0) * q_row_stride + head * q_head_stride;
  const T* const k_head = k_cache + kv_head * c_stride_head;
  const T* const v_head = v_cache + kv_head * c_stride_head;
  const int tok_stride = (int)c_stride_tok;
  auto o_tile = [&]() { return out + (long long)(q_off + m0) * o_row_stride + head * o_head_stride; };
  auto lse_tile = [&]() { return lse + (long long)head * total_q + q_off + m0; };
  const int chunks_valid = head_dim >> 3;
  const int rows_q = min(BM, sq - m0);

  const int diag = sk - sq;
  const int m_last = m0 + rows_q - 1;
  const int lo_first = max(0, m0 + diag - window_left);
  const int lo_last = max(0, m_last + diag - window_left);
  const int hi_first = min(sk, m0 + diag + window_right + 1);
  const int hi_last = min(sk, m_last + diag + window_right + 1);
  const int n_begin = lo_first / BN;
  const int n_end = hi_last > lo_first ? (hi_last + BN - 1) / BN : n_begin;

  const int g = lane >> 2, t = lane & 3;
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

  // Prologue: Q (its own cp.async group), then the first NS - 1 key tiles, one group each; then the block-table
  // entries of the tile the first loop iteration copies.
  load_rows_async<T, BM, D, PITCH, NUM_THREADS, false>(sQ_u32, q_base, (int)q_row_stride, rows_q, chunks_valid, tid);
  sc::cp_async_commit();
  int n_block = n_end - 1;
  TilePages<PAGE_TILE, RPT> pages;
#pragma unroll
  for (int j = 0; j < NS - 1; ++j) {
    const int nb = n_block - j;
    if (nb >= n_begin) {
      resolve_pages<PAGE_TILE, BN, D, NUM_THREADS>(pages, pt, nb * BN, tid);
      load_kv_tile<T, PAGE_TILE, BN, D, PITCH, NUM_THREADS, false>(smem_u32 + j * STAGE * ES, k_head, v_head,
                                                                   c_stride_block, tok_stride, pt, pages, nb * BN,
                                                                   chunks_valid, tid);
    }
    sc::cp_async_commit();
  }
  if (n_block - (NS - 1) >= n_begin) resolve_pages<PAGE_TILE, BN, D, NUM_THREADS>(pages, pt, (n_block - (NS - 1)) * BN, tid);

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
        load_kv_tile<T, PAGE_TILE, BN, D, PITCH, NUM_THREADS, true>(dst, k_head, v_head, c_stride_block, tok_stride,
                                                                    pt, pages, nb * BN, chunks_valid, tid);
        // the next tile's entries, in flight during this tile's math
        if (nb - 1 >= n_begin) resolve_pages<PAGE_TILE, BN, D, NUM_THREADS>(pages, pt, (nb - 1) * BN, tid);
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

    // Online softmax (the running max may lag the true one by up to 8 in base 2, as in kernels/attention.cu: O is
    // rescaled only when some row of the warp outgrows that); P overwrites S in place.
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
        grow |= (mx - row_max[mt][h]) * scale_log2 > 8.f;
      }
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float m_new = fmaxf(row_max[mt][h], tile_max[mt][h]);
          const float corr = m_new == neg_inf() ? 1.f : sc::fast_exp2((row_max[mt][h] - m_new) * scale_log2);
          row_max[mt][h] = m_new;
          if constexpr (ROWSUM_MMA) {
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
        const float m_scaled = row_max[mt][h] == neg_inf() ? 0.f : row_max[mt][h] * scale_log2;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NNT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = sc::fast_exp2(fmaf(s[mt][nt][2 * h + e], scale_log2, -m_scaled));
            s[mt][nt][2 * h + e] = pv;
            if constexpr (!ROWSUM_MMA) sum += pv;
          }
        if constexpr (!ROWSUM_MMA) row_sum[mt][h] += sum;
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
      if constexpr (ROWSUM_MMA) {
        const unsigned ones[2] = {ones_x2<T>(), ones_x2<T>()};
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) sc::mma_16816<T>(row_sum_mma[mt], p[mt][kk], ones);
      }
    }
    stage = stage == NS - 1 ? 0 : stage + 1;
  }

  // Epilogue: normalize, stage O through shared memory for 16-byte stores, write lse.
  sc::cp_async_wait<0>();
  __syncthreads();  // every warp is done reading K and V
  T* const sO = smem;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l;
      if constexpr (ROWSUM_MMA) {
        l = row_sum_mma[mt][2 * h];
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

// ------------------------------------------------------------------------------------------------------------
// Speculative verification (2 to 16 query tokens per sequence): paged_verify_kernel, decode-style split-KV.
//
// The prefill kernel's 16-row m-tiles would be mostly empty at a few query tokens per sequence, and each (query
// tile, head) CTA would read the KV head's pages again.  Here one CTA per (sequence, KV head, column group, split)
// reads each K/V page once for every query of that KV head: its NCOL = 8 NT columns are (query token, query head of
// the GQA group) pairs, token-major, and are the N dimension of mma.m16n8k16 in the transposed orientation of
// kernels/decode.cu's paged_decode_kernel:
//   S^T (16 keys x NCOL) = K_tile (16 x D) . Q^T (D x NCOL)       A = K (ldmatrix), B = Q^T (ldmatrix from shared)
//   O^T (D x NCOL)      += V_tile^T (D x 16) . P^T (16 x NCOL)    A = V (ldmatrix.trans), B = P^T (movmatrix)
// Q^T stays in shared memory (NCOL x D, rows padded by 16 bytes) rather than in registers: at D = 128 and 32
// columns the O^T accumulators alone take 128 registers per lane.  Each column has its own causal / window bound
// (query token i sees keys [i + diag - left, i + diag + right], diag = sk - sq); the CTA streams the union of its
// columns' ranges in 16-key tiles.  Each warp owns its own STAGES-deep cp.async ring of tiles (every WARPS-th
// tile of the split), as in paged_decode_kernel: no CTA-wide barrier in the main loop; the warps merge through
// shared memory at the end.  With num_splits > 1 each CTA writes normalized fp32 partials and log2-sum-exps, and
// paged_verify_merge_kernel combines them.
namespace pa {

__device__ __forceinline__ float ninf() { return __int_as_float(0xff800000u); }

__device__ __forceinline__ unsigned movmatrix_trans(unsigned x) {
  unsigned y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// cp.async with an L2 evict-first policy: K/V are read once (paged_decode_kernel measured +0.5-2% with it)
__device__ __forceinline__ void cp_async_evict_first(unsigned saddr, const void* gmem, bool pred,
                                                     unsigned long long policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(saddr), "l"(gmem),
               "r"(pred ? 16 : 0), "l"(policy)
               : "memory");
}
__device__ __forceinline__ unsigned long long evict_first_policy() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}

// tanh through exp2 (absolute error ~1e-7; tanh.approx's ~5e-4 times a softcap of 30 would move logits by 1e-2)
__device__ __forceinline__ float tanh_exp(float x) {
  const float t = sc::fast_exp2(x * 2.8853900817779268f);  // 2 log2(e)
  return 1.f - __fdividef(2.f, t + 1.f);
}

__device__ __forceinline__ void ldmatrix_x2_s(unsigned* r, unsigned saddr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(saddr));
}

}  // namespace pa

// Q^T tile bytes of a CTA (NCOL rows of D + 8 elements), rounded to 16 bytes; the K/V rings follow it.
template <int D, int NT> __host__ __device__ constexpr int verify_q_bytes() { return 8 * NT * (D + 8) * 2; }

// q, out: (total_q, heads, D) rows; lse (optional): (heads, total_q).  part_out / part_lse (num_splits > 1): row
// r = token * heads + head holds splits [r * num_splits, (r + 1) * num_splits), D floats each / one log2-sum-exp
// each.  scale_a: softmax_scale log2(e), or softmax_scale / softcap with use_softcap (then cap_log2 = softcap
// log2(e)).  window_left / window_right: UNBOUNDED (2^29) where unbounded; causal is window_right = 0.
template <typename T, int D, int WARPS, int STAGES, int NT, bool PAGE16>
__global__ void __launch_bounds__(WARPS * 32, 1) paged_verify_kernel(
    T* __restrict__ out, float* __restrict__ lse_out, float* __restrict__ part_out, float* __restrict__ part_lse,
    const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ seqused_k, const int* __restrict__ block_table,
    int total_q, int num_heads, int group, int qgroups, int units, int num_splits, int block_size, int num_blocks,
    int max_len, long long q_stride_t, long long q_stride_h, long long o_stride_t, long long o_stride_h,
    long long c_stride_block, long long c_stride_tok, long long c_stride_head, long long bt_stride, float scale_a,
    float cap_log2, int use_softcap, int window_left, int window_right) {
  constexpr int NCOL = 8 * NT;
  constexpr int QPITCH = D + 8;             // elements per Q^T row in shared memory
  constexpr int CPR = D / 8;                // 16-byte chunks per row
  constexpr int RPI = 32 / CPR > 0 ? 32 / CPR : 1;  // rows one warp-wide cp.async covers
  constexpr int LPR = 32 / RPI;             // lanes per row in one cp.async instruction
  constexpr int NI = 16 / RPI;              // cp.async instructions per 16-row tile
  constexpr int TILE = 16 * CPR;            // uint4 per 16-row tile
  constexpr int KT = D / 16;                // k-steps of S^T and m-tiles of O^T
  static_assert(D % 64 == 0 && D <= 256, "head dim 64, 128 or 256");
  static_assert(LPR * RPI == 32 && LPR == CPR, "lane mapping: one 16-byte chunk of a row per lane");
  static_assert(NT == 1 || NT % 2 == 0, "n-tiles are read in pairs");

  extern __shared__ uint4 smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int bid = blockIdx.x;
  const int unit = bid % units;
  bid /= units;
  const int split = bid % num_splits;
  const int b = bid / num_splits;
  const int kvh = unit / qgroups, qg = unit - kvh * qgroups;

  // (seqused_k is loaded with cu_seqlens_q, not after the early exit: one dependent round trip fewer before the
  // first K/V copies)
  const int sk = min(max(seqused_k[b], 0), max_len);
  const int q_off = min(max(cu_seqlens_q[b], 0), total_q);
  const int sq = min(max(cu_seqlens_q[b + 1], q_off), total_q) - q_off;
  // (query token, head of the group) pairs of this KV head, at most what the grid's column groups cover (a sequence
  // longer than max_seqlen_q must not overflow sq x group)
  const int pairs = (int)min((long long)sq * group, (long long)qgroups * NCOL);
  const int p0 = qg * NCOL;                 // this CTA's first pair
  if (p0 >= pairs) return;                  // no column (uniform over the CTA)
  const int diag = sk - sq;
  T* const sq_tile = reinterpret_cast<T*>(smem);

  // The keys visible to this lane's accumulator columns nt * 8 + 2 (lane % 4) + e: [col_lo, col_hi).
  int col_lo[NT][2], col_hi[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int p = p0 + nt * 8 + 2 * (lane & 3) + e;
      const int i = p / group;
      col_lo[nt][e] = p < pairs ? max(0, i + diag - window_left) : 0x7fffffff;
      col_hi[nt][e] = p < pairs ? min(sk, i + diag + window_right + 1) : 0;
    }
  // This CTA's range: the union of its columns' ranges (the first column's token sees the fewest keys).
  const int i_first = p0 / group, i_last = (min(pairs, p0 + NCOL) - 1) / group;
  const int lo = max(0, i_first + diag - window_left);
  const int hi = max(0, min(sk, i_last + diag + window_right + 1));
  const int tile_lo = lo >> 4, tile_hi = hi > lo ? (hi + 15) >> 4 : tile_lo;
  const int per_split = (tile_hi - tile_lo + num_splits - 1) / num_splits;
  const int t_begin = tile_lo + split * per_split;
  const int t_end = min(t_begin + per_split, tile_hi);

  const int* bt_row = block_table + (long long)b * bt_stride;
  const T* kbase = k_cache + (long long)kvh * c_stride_head;
  const T* vbase = v_cache + (long long)kvh * c_stride_head;
  uint4* ring = smem + verify_q_bytes<D, NT>() / 16 + warp * (STAGES * 2 * TILE);
  const unsigned long long policy = pa::evict_first_policy();
  const int bs_shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;

  // This warp's tiles: first + j * WARPS for j < njobs.
  const int first = t_begin + warp;
  const int njobs = t_end > first ? (t_end - first + WARPS - 1) / WARPS : 0;
  // Where the rows of tile j live (as paged_decode_kernel): PAGE16 (block_size % 16 == 0), every lane resolves
  // the tile's first token; otherwise lane r < 16 resolves row r.  ok: the tile / row holds attended keys.
  auto fetch_row = [&](int j, int& page, int& slot) -> bool {
    const int tile_tok = (first + j * WARPS) * 16, tok = PAGE16 ? tile_tok : tile_tok + lane;
    const bool ok = PAGE16 ? j < njobs && tile_tok < hi && tile_tok + 15 >= lo
                           : lane < 16 && j < njobs && tok >= lo && tok < hi;
    page = 0;
    slot = 0;
    if (ok) {
      const int blk = bs_shift >= 0 ? tok >> bs_shift : tok / block_size;
      page = bt_row[blk];
      slot = tok - blk * block_size;
    }
    return ok;
  };
  // Shared addresses: stage s of this warp's ring at ring_s + s * SLOT (K tile, then V tile), 16-byte chunks
  // XOR-swizzled within 8-row groups (each ldmatrix phase then hits 8 distinct bank groups).
  constexpr unsigned SLOT = 2 * TILE * 16;
  const unsigned ring_s = sc::smem_addr(ring);
  constexpr int IP = NI < 8 / RPI ? NI : 8 / RPI;  // cp.async rows repeat their swizzle every IP instructions
  unsigned cp_pat[IP];
#pragma unroll
  for (int i = 0; i < IP; ++i) {
    const int row = i * RPI + lane / LPR, chunk = lane % LPR;
    cp_pat[i] = (row * CPR + (chunk ^ (row & 7))) * 16;
  }
  unsigned k_pat[4], v_pat[4];  // ldmatrix: k-step / m-tile kk repeats pattern kk % 4, 128 bytes on per 4
  {
    const int rk = (lane & 7) + ((lane >> 3) & 1) * 8, rv = (lane & 7) + (lane >> 4) * 8;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      k_pat[p] = (rk * CPR + ((2 * p + (lane >> 4)) ^ (rk & 7))) * 16;
      v_pat[p] = TILE * 16 + (rv * CPR + ((2 * p + ((lane >> 3) & 1)) ^ (rv & 7))) * 16;
    }
  }
  // Q^T B fragments by ldmatrix: lanes 0-7 rows (columns) 0-7 at d 0-7, lanes 8-15 the same rows at d 8-15, lanes
  // 16-31 the next n-tile (x4), so one ldmatrix gives b[0..1] of n-tile 2m and b[2..3] of n-tile 2m + 1.
  const unsigned q_s = sc::smem_addr(sq_tile) +
                       (unsigned)(((lane & 7) + (NT > 1 ? (lane >> 4) * 8 : 0)) * QPITCH + ((lane >> 3) & 1) * 8) * 2u;

  auto issue = [&](int j, unsigned st, int page, int slot, bool ok) {
    const long long off =
        ok ? (long long)min((unsigned)page, (unsigned)(num_blocks - 1)) * c_stride_block +
                 (long long)slot * c_stride_tok
           : 0;
    const int chunk = lane % LPR, tile_tok = (first + j * WARPS) * 16;
    const bool whole = PAGE16 && ok && tile_tok >= lo && tile_tok + 16 <= hi;
    auto copy = [&](bool check) {
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        const int row = i * RPI + lane / LPR;
        long long roff;
        bool rok;
        if (PAGE16) {
          roff = off + (long long)row * c_stride_tok;
          rok = !check || (ok && tile_tok + row >= lo && tile_tok + row < hi);
        } else {
          roff = __shfl_sync(0xffffffffu, off, row);
          rok = __shfl_sync(0xffffffffu, ok, row);
        }
        const unsigned dst = st + cp_pat[i % IP] + (i / IP) * (8 * CPR * 16);
        pa::cp_async_evict_first(dst, kbase + roff + chunk * 8, rok, policy);
        pa::cp_async_evict_first(dst + TILE * 16, vbase + roff + chunk * 8, rok, policy);
      }
    };
    if (whole) copy(false);
    else copy(true);
  };

  float oacc[KT][NT][4];
#pragma unroll
  for (int i = 0; i < KT; ++i)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) oacc[i][nt][0] = oacc[i][nt][1] = oacc[i][nt][2] = oacc[i][nt][3] = 0.f;
  float m[NT][2], l[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) m[nt][0] = m[nt][1] = pa::ninf(), l[nt][0] = l[nt][1] = 0.f;

#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j) {
    int page, slot;
    const bool ok = fetch_row(j, page, slot);
    if (j < njobs) issue(j, ring_s + j * SLOT, page, slot, ok);
    sc::cp_async_commit();
  }
  int pf_page, pf_slot;
  bool pf_ok = fetch_row(STAGES - 1, pf_page, pf_slot);
  // Q^T: NCOL rows (pairs) of D elements, pairs past the sequence's zeros; loaded once the first K/V copies are
  // in flight, since only the first mma needs it.
  for (int c = threadIdx.x; c < NCOL * CPR; c += WARPS * 32) {
    const int col = c / CPR, ch = c - col * CPR, p = p0 + col;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (p < pairs) {
      const int i = p / group, h = kvh * group + (p - i * group);
      val = *reinterpret_cast<const uint4*>(q + (long long)(q_off + i) * q_stride_t + (long long)h * q_stride_h + ch * 8);
    }
    *reinterpret_cast<uint4*>(sq_tile + col * QPITCH + ch * 8) = val;
  }
  __syncthreads();  // Q^T is in shared memory

  unsigned st = ring_s, prev = ring_s + (STAGES - 1) * SLOT;
  for (int j = 0; j < njobs; ++j) {
#pragma unroll
    for (int p = 0; p < 4; ++p) asm volatile("" : "+r"(k_pat[p]), "+r"(v_pat[p]));
#pragma unroll
    for (int i = 0; i < IP; ++i) asm volatile("" : "+r"(cp_pat[i]));
    sc::cp_async_wait<STAGES - 2>();
    __syncwarp();
    // Refill the slot consumed in the previous iteration (every lane is past it after __syncwarp).
    if (j + STAGES - 1 < njobs) issue(j + STAGES - 1, prev, pf_page, pf_slot, pf_ok);
    sc::cp_async_commit();
    pf_ok = fetch_row(j + STAGES, pf_page, pf_slot);

    float s[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
      unsigned a[4];
      sc::ldmatrix_x4_s(a, st + k_pat[kk % 4] + (kk / 4) * 128);
      if constexpr (NT == 1) {
        unsigned bq[2];
        pa::ldmatrix_x2_s(bq, q_s + kk * 32);
        sc::mma_16816<T>(s[0], a, bq);
      } else {
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          unsigned bq[4];
          sc::ldmatrix_x4_s(bq, q_s + (np * 16 * QPITCH + kk * 16) * 2);
          sc::mma_16816<T>(s[2 * np], a, bq);
          sc::mma_16816<T>(s[2 * np + 1], a, bq + 2);
        }
      }
    }
    const int tok_a = (first + j * WARPS) * 16 + (lane >> 2), tok_b = tok_a + 8;
    float pbuf[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float raw = s[nt][i];
        const int e = i & 1, tok = i < 2 ? tok_a : tok_b;
        const float x = use_softcap ? cap_log2 * pa::tanh_exp(raw * scale_a) : raw * scale_a;
        s[nt][i] = tok >= col_lo[nt][e] && tok < col_hi[nt][e] ? x : pa::ninf();
      }
      // Online softmax in the log2 domain; lanes sharing lane % 4 own the same two columns.
      float mx0 = fmaxf(s[nt][0], s[nt][2]), mx1 = fmaxf(s[nt][1], s[nt][3]);
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
      }
      const float mn0 = fmaxf(m[nt][0], mx0), mn1 = fmaxf(m[nt][1], mx1);
      const float base0 = mn0 == pa::ninf() ? 0.f : mn0, base1 = mn1 == pa::ninf() ? 0.f : mn1;
      // While the running max stays, alpha is exactly 1 and the rescale is skipped (bit for bit the same).
      if (__any_sync(0xffffffffu, mn0 != m[nt][0] || mn1 != m[nt][1])) {
        const float alpha0 = sc::fast_exp2(m[nt][0] - base0), alpha1 = sc::fast_exp2(m[nt][1] - base1);
        l[nt][0] *= alpha0;
        l[nt][1] *= alpha1;
#pragma unroll
        for (int mt = 0; mt < KT; ++mt) {
          oacc[mt][nt][0] *= alpha0;
          oacc[mt][nt][1] *= alpha1;
          oacc[mt][nt][2] *= alpha0;
          oacc[mt][nt][3] *= alpha1;
        }
      }
      m[nt][0] = mn0;
      m[nt][1] = mn1;
      pbuf[nt][0] = sc::fast_exp2(s[nt][0] - base0);
      pbuf[nt][1] = sc::fast_exp2(s[nt][1] - base1);
      pbuf[nt][2] = sc::fast_exp2(s[nt][2] - base0);
      pbuf[nt][3] = sc::fast_exp2(s[nt][3] - base1);
      l[nt][0] += pbuf[nt][0] + pbuf[nt][2];
      l[nt][1] += pbuf[nt][1] + pbuf[nt][3];
    }
    unsigned pb[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      pb[nt][0] = pa::movmatrix_trans(sc::pack2<T>(pbuf[nt][0], pbuf[nt][1]));
      pb[nt][1] = pa::movmatrix_trans(sc::pack2<T>(pbuf[nt][2], pbuf[nt][3]));
    }
#pragma unroll
    for (int mt = 0; mt < KT; ++mt) {
      unsigned a[4];
      sc::ldmatrix_x4_trans_s(a, st + v_pat[mt % 4] + (mt / 4) * 128);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) sc::mma_16816<T>(oacc[mt][nt], a, pb[nt]);
    }
    prev = st;
    st = st + SLOT == ring_s + STAGES * SLOT ? ring_s : st + SLOT;
  }
  sc::cp_async_wait<0>();

  // Row sums: each lane summed only its own keys.
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      l[nt][0] += __shfl_xor_sync(0xffffffffu, l[nt][0], o);
      l[nt][1] += __shfl_xor_sync(0xffffffffu, l[nt][1], o);
    }
  __syncthreads();  // every warp is done with Q^T and its ring: shared memory now holds the cross-warp merge
  float* red_o = reinterpret_cast<float*>(smem);      // [WARPS][NCOL][D]
  float* red_m = red_o + WARPS * NCOL * D;             // [WARPS][NCOL]
  float* red_l = red_m + WARPS * NCOL;                 // [WARPS][NCOL]
  {
    float* ow = red_o + warp * NCOL * D;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int ca = nt * 8 + 2 * (lane & 3);
#pragma unroll
      for (int mt = 0; mt < KT; ++mt) {
        const int d = mt * 16 + (lane >> 2);
        ow[ca * D + d] = oacc[mt][nt][0];
        ow[(ca + 1) * D + d] = oacc[mt][nt][1];
        ow[ca * D + d + 8] = oacc[mt][nt][2];
        ow[(ca + 1) * D + d + 8] = oacc[mt][nt][3];
      }
      if (lane < 4) {
        red_m[warp * NCOL + ca] = m[nt][0];
        red_m[warp * NCOL + ca + 1] = m[nt][1];
        red_l[warp * NCOL + ca] = l[nt][0];
        red_l[warp * NCOL + ca + 1] = l[nt][1];
      }
    }
  }
  __syncthreads();
  const int ncols = min(NCOL, pairs - p0);
  for (int idx = threadIdx.x; idx < ncols * D; idx += WARPS * 32) {
    const int c = idx / D, d = idx - c * D;
    float mmax = pa::ninf();
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mmax = fmaxf(mmax, red_m[w * NCOL + c]);
    float lsum = 0.f, o = 0.f;
    if (mmax != pa::ninf()) {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float f = sc::fast_exp2(red_m[w * NCOL + c] - mmax);
        lsum += red_l[w * NCOL + c] * f;
        o += red_o[(w * NCOL + c) * D + d] * f;
      }
    }
    const bool empty = !(lsum > 0.f);
    o = empty ? 0.f : o * __frcp_rn(lsum);
    const int p = p0 + c, i = p / group, h = kvh * group + (p - i * group);
    const int tok = q_off + i;
    if (num_splits == 1) {
      out[(long long)tok * o_stride_t + (long long)h * o_stride_h + d] = sc::from_float<T>(o);
      if (lse_out != nullptr && d == 0)
        lse_out[(long long)h * total_q + tok] = empty ? pa::ninf() : (mmax + __log2f(lsum)) * fa::LN2;
    } else {
      const long long row = ((long long)tok * num_heads + h) * num_splits + split;
      part_out[row * D + d] = o;
      if (d == 0) part_lse[row] = empty ? pa::ninf() : mmax + __log2f(lsum);  // log2 domain
    }
  }
}

// Combines the splits of one (token, head) row per warp (grid: tokens x ceil(heads / 4), 128 threads) with weights 2^(lse_s - max): each lane reads every split's
// log2-sum-exp (a few, just written, in L2), then its 4-float columns of each split.  Rows at or past cu_seqlens_q's
// last entry belong to no sequence and are left alone, as the prefill kernel leaves them.
template <typename T, int D>
__global__ void __launch_bounds__(128) paged_verify_merge_kernel(
    T* __restrict__ out, float* __restrict__ lse_out, const float* __restrict__ part_out,
    const float* __restrict__ part_lse, const int* __restrict__ cu_seqlens_q, int batch, int total_q, int num_heads,
    int num_splits, long long o_stride_t, long long o_stride_h) {
  constexpr int V4 = D / 4;
  // grid (tokens, heads / 4): one warp per (token, head); no 64-bit division
  const int tok = blockIdx.x, h = blockIdx.y * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (h >= num_heads || tok >= min(max(cu_seqlens_q[batch], 0), total_q)) return;
  const long long row = (long long)tok * num_heads + h;
  const float* lse = part_lse + row * num_splits;
  float mx = pa::ninf();
  for (int s = lane; s < num_splits; s += 32) mx = fmaxf(mx, lse[s]);
  mx = sc::warp_max(mx);
  const bool empty = mx == pa::ninf();
  float total = 0.f;
  for (int s = lane; s < num_splits; s += 32) total += empty ? 0.f : sc::fast_exp2(lse[s] - mx);
  total = sc::warp_sum(total);
  const float inv = total > 0.f ? __frcp_rn(total) : 0.f;
  const float4* src = reinterpret_cast<const float4*>(part_out) + row * num_splits * V4;
  for (int c = lane; c < V4; c += 32) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < num_splits; ++s) {
      const float w = empty ? 0.f : sc::fast_exp2(lse[s] - mx);
      const float4 x = src[(long long)s * V4 + c];
      acc.x += w * x.x;
      acc.y += w * x.y;
      acc.z += w * x.z;
      acc.w += w * x.w;
    }
    T* o = out + (long long)tok * o_stride_t + (long long)h * o_stride_h + c * 4;
    o[0] = sc::from_float<T>(acc.x * inv);
    o[1] = sc::from_float<T>(acc.y * inv);
    o[2] = sc::from_float<T>(acc.z * inv);
    o[3] = sc::from_float<T>(acc.w * inv);
  }
  if (lse_out != nullptr && lane == 0)
    lse_out[(long long)h * total_q + tok] = total > 0.f ? (mx + __log2f(total)) * fa::LN2 : pa::ninf();
}

// ------------------------------------------------------------------------------------------------------------
// Chunked prefill on sm_90a (H100/H200): the warp-specialized wgmma / TMA kernel of kernels/attention_sm90.cu (see
// its header for the pipeline: a producer warpgroup issuing TMA loads into an mbarrier ring, two or three consumer
// warpgroups overlapping the softmax of one key block with the P V wgmma of the previous, a persistent grid claiming
// tiles from a per-stream counter), copied here because its producer's K/V loads and its tile descriptor differ.
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
    if (threadIdx.x == 0) {
      sc::tma_prefetch_map(&tmap_q);
      sc::tma_prefetch_map(&tmap_k);
      sc::tma_prefetch_map(&tmap_v);
      sc::tma_prefetch_map(&tmap_o);
      int stage = 0, tslot = 0;
      unsigned phase = 0, q_phase = 0, tphase = 0;
      // Dynamic schedule: after its first tile (blockIdx.x) a CTA takes the next unclaimed one from a global
      // counter, so SMs that drew light tiles (causal, short sequences) take more of them.  The tile index
      // reaches the consumers through a two-slot ring; num_tiles or more means "done".  (Claiming a tile ahead
      // and prefetching its Q into L2 was measured: no faster.)
      int piter = 0;
      for (int tile = blockIdx.x;; tile = gridDim.x + atomicAdd(tile_counter, 1), ++piter) {
        pa90::Tile t{};
        if (tile < num_tiles)
          t = PA90_TILE_INFO(tile, pa90::PlainDiv{num_m << head_group_log2}, pa90::PlainDiv{nheads});
        t.index = tile;
        sc::mbar_wait(&tile_empty[tslot], tphase ^ 1);
        pa90::store_tile(tile_ring + 3 * tslot, t);  // published by the arrive's release
        sc::mbar_arrive(&tile_full[tslot]);
        if (++tslot == 2) {
          tslot = 0;
          tphase ^= 1;
        }
        if (tile >= num_tiles) break;
        if (t.rows_q <= 0 || t.n_begin >= t.n_end) continue;
        const int bc = varlen ? 0 : t.batch, kv_head = t.head / heads_per_kv;
        sc::mbar_wait(q_empty, q_phase ^ 1);
        q_phase ^= 1;
        sc::mbar_arrive_expect_tx(q_full, Q_BYTES);
#pragma unroll
        for (int c = 0; c < DC; ++c)
          sc::tma_load_4d(sQ + c * BM * 128, &tmap_q, c * 64, t.q_off + t.m0, t.head, bc, q_full);
        // key blocks from the last to the first: the blocks crossing the causal diagonal come first
        const int* const bt_row = block_table + (long long)t.batch * bt_stride;
        // The page and slot of token tok: rows past the sequence come from page 0 (any page will do: their scores
        // are masked and their V rows zeroed); min() keeps a corrupt block table from faulting.
        auto page_of = [&](int tok, int& slot) {
          const int blk = tok / block_size;
          slot = tok - blk * block_size;
          return tok < t.sk ? (int)min((unsigned)bt_row[blk], (unsigned)(num_blocks - 1)) : 0;
        };
        for (int nb = t.n_end - 1; nb >= t.n_begin; --nb) {
          const int tok0 = nb * BN;
          sc::mbar_wait(&k_empty[stage], phase ^ 1);
          sc::mbar_arrive_expect_tx(&k_full[stage], KV_BYTES);  // BN / page_rows boxes of page_rows x 128 bytes
          for (int r = 0; r < BN; r += page_rows) {
            int slot;
            const int page = page_of(tok0 + r, slot);
#pragma unroll
            for (int c = 0; c < DC; ++c)
              sc::tma_load_4d(sK + stage * KV_BYTES + c * BN * 128 + r * 128, &tmap_k, c * 64, slot, kv_head, page,
                              &k_full[stage]);
          }
          sc::mbar_wait(&v_empty[stage], phase ^ 1);
          sc::mbar_arrive_expect_tx(&v_full[stage], KV_BYTES);
          for (int r = 0; r < BN; r += page_rows) {
            int slot;
            const int page = page_of(tok0 + r, slot);
#pragma unroll
            for (int c = 0; c < DC; ++c)
              sc::tma_load_4d(sV + stage * KV_BYTES + c * BN * 128 + r * 128, &tmap_v, c * 64, slot, kv_head, page,
                              &v_full[stage]);
          }
          if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
      // The last CTA out resets the counters for the next launch on this stream (no memset needed).
      if (atomicAdd(tile_counter + 1, 1) == (int)gridDim.x - 1) {
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
