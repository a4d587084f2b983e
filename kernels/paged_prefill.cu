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
// The other paged kernels: paged_verify_kernel (a few query tokens per sequence: speculative verification) in
// kernels/paged_verify.cu, paged_prefill_sm90_kernel (sm_90a) in kernels/paged_prefill_sm90.cu.
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/softmax.cuh"

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
