// Speculative verification over vLLM's paged KV cache (2 to 16 query tokens per sequence): paged_verify_kernel,
// decode-style split-KV, and paged_verify_merge_kernel.
//
// The 16-row m-tiles of the prefill kernel (kernels/paged_prefill.cu) would be mostly empty at a few query tokens
// per sequence, and each (query tile, head) CTA would read the KV head's pages again.  Here one CTA per (sequence,
// KV head, column group, split) reads each K/V page once for every query of that KV head: its NCOL = 8 NT columns
// are (query token, query head of the GQA group) pairs, token-major, and are the N dimension of mma.m16n8k16 in the
// transposed orientation of kernels/decode.cu's paged_decode_kernel:
//   S^T (16 keys x NCOL) = K_tile (16 x D) . Q^T (D x NCOL)       A = K (ldmatrix), B = Q^T (ldmatrix from shared)
//   O^T (D x NCOL)      += V_tile^T (D x 16) . P^T (16 x NCOL)    A = V (ldmatrix.trans), B = P^T (movmatrix)
// Q^T stays in shared memory (NCOL x D, rows padded by 16 bytes) rather than in registers: at D = 128 and 32
// columns the O^T accumulators alone take 128 registers per lane.  Each column has its own causal / window bound
// (query token i sees keys [i + diag - left, i + diag + right], diag = sk - sq); the CTA streams the union of its
// columns' ranges in 16-key tiles.  Each warp owns its own STAGES-deep cp.async ring of tiles (every WARPS-th
// tile of the split), as in paged_decode_kernel: no CTA-wide barrier in the main loop; the warps merge through
// shared memory at the end.  With num_splits > 1 each CTA writes normalized fp32 partials and log2-sum-exps, and
// paged_verify_merge_kernel combines them.
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/softmax.cuh"
#include "common/reduce.cuh"

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
