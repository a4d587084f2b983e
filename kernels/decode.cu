// Decode-time kernels: paged-KV decode attention (split-KV, GQA) and its merge step, the KV-cache append
// (reshape_and_cache), rotary embedding, and the gated activations SiLU/GELU-and-mul.  All of them are
// memory-bound; each is written so that every byte crosses HBM once, in 16-byte accesses where the layout
// allows, with enough independent loads in flight to saturate the memory system.
#include "common/types.cuh"
#include "common/reduce.cuh"
#include "common/mma.cuh"
#include "common/pdl.cuh"
#include "common/tma.cuh"

namespace dec {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

// Entry i of an int32 or int64 index array (positions, slot mappings: either dtype is taken as given).  I: the
// caller's index type, kept so that the address arithmetic stays the caller's.
template <typename I> __device__ __forceinline__ long long load_index(const void* p, int is_64, I i) {
  return is_64 ? static_cast<const long long*>(p)[i] : (long long)static_cast<const int*>(p)[i];
}

// Transpose an 8x8 matrix of 16-bit values held one row-pair per lane (the mma accumulator layout) so each
// lane holds a column pair: turns a score tile (tokens x queries) into the B operand (queries by column) of
// the next mma without going through shared memory.
__device__ __forceinline__ unsigned movmatrix_trans(unsigned x) {
  unsigned y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// 16-byte cp.async of one K/V row chunk.  HINT 0: plain; 1: with an L2 prefetch of the surrounding 256 bytes
// (a K/V row of one head is 128 to 512 contiguous bytes); 2: with an L2 evict-first policy (K/V are read once).
template <int HINT>
__device__ __forceinline__ void cp_async_kv(unsigned saddr, const void* gmem, bool pred, unsigned long long policy) {
  if constexpr (HINT == 1) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(gmem),
                 "r"(pred ? 16 : 0)
                 : "memory");
  } else if constexpr (HINT == 2) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(saddr),
                 "l"(gmem), "r"(pred ? 16 : 0), "l"(policy)
                 : "memory");
  } else {
    sc::cp_async16_s(saddr, gmem, pred);
  }
}
__device__ __forceinline__ unsigned long long evict_first_policy() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}

// tanh through exp2: 1 - 2 / (e^2x + 1).  Absolute error ~1e-7, where tanh.approx.f32's ~5e-4 relative error,
// multiplied by a softcap of 30 or 50, would move logits by 1e-2.
__device__ __forceinline__ float tanh_exp(float x) {
  const float t = sc::fast_exp2(x * 2.8853900817779268f);  // 2 log2(e)
  return 1.f - __fdividef(2.f, t + 1.f);
}

}  // namespace dec

// ------------------------------------------------------------------------------------------------------------
// Paged decode attention.
//
// One CTA per (sequence, KV head, group of up to 8 query heads, split).  The query heads that share a KV head
// are served from one read of its K and V (GQA).  Work is done on 16-token tiles with tensor cores, in the
// transposed orientation so the (at most 8) queries are the N=8 side of mma.m16n8k16 instead of being padded
// to 16 rows:
//   S^T (16 tokens x 8 queries) = K_tile (16 x D) . Q^T (D x 8)        A = K from shared memory (ldmatrix)
//   O^T (D x 8 queries)        += V_tile^T (D x 16) . P^T (16 x 8)     A = V (ldmatrix.trans), B = P^T
// P^T comes from the S^T accumulators by one movmatrix.trans per 8x8 half.
//
// Each warp owns its own STAGES-deep cp.async ring of tiles (every WARPS-th tile of the CTA's range), so the
// main loop has no CTA-wide barrier; warps keep their own running max/sum/output and are merged through
// shared memory at the end.  Where block_size % 16 == 0 (PAGE16) a tile lies inside one page and is resolved once;
// otherwise its rows are gathered through the block table one token at a time, so any block size works (a 16-token
// tile may span pages when block_size < 16).  Rows outside the attended range [lo, hi) are zero-filled rather than
// read, so unused cache memory (even NaN) is harmless.
//
// With num_splits > 1 the CTA writes its normalized partial output (fp32) and its log-sum-exp to the
// workspace, and decode_merge_kernel combines the splits.
//
// Measured on the H200 (benchmarks/_decode_diag.py): the CTAs of one launch stream at rates up to ~20% apart,
// so the last ~10 us of a 130-250 us launch run below full bandwidth.  Sharing a unit's tiles among its warps
// and splits by atomic tickets (chunks of 2 tiles) was 2-12% slower at every bench shape: the KV heads of a
// sequence then no longer walk the same pages at the same time (the cache interleaves heads within a page).  So
// was a pool of a split range's last 1/4 or 1/8 of tiles taken one at a time (1/16: within noise), and each warp
// writing its own split partial was no faster (benchmarks/results/h200-ab-2026-11-30.md, session 17).
template <typename T, int D, int WARPS, int STAGES, int HINT = 0, bool PAGE16 = false, bool PAIR = false>
__global__ void __launch_bounds__(WARPS * 32, 1) paged_decode_kernel(
    T* __restrict__ out, float* __restrict__ lse_out, float* __restrict__ part_out, float* __restrict__ part_lse,
    const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int* __restrict__ block_table, const int* __restrict__ seq_lens, int num_heads, int group,
    int qgroups, int units, int num_splits, int block_size, int num_blocks, int max_len, long long q_stride_b,
    long long q_stride_h, long long o_stride_b, long long o_stride_h, long long c_stride_block,
    long long c_stride_tok, long long c_stride_head, long long bt_stride, long long sl_stride, float scale_a,
    float cap_log2, int use_softcap, int window_left) {
  constexpr int CPR = D / 8;            // 16-byte chunks per row
  constexpr int RPI = 32 / CPR > 0 ? 32 / CPR : 1;  // rows one warp-wide cp.async covers
  constexpr int LPR = 32 / RPI;         // lanes per row in one cp.async instruction
  constexpr int NI = 16 / RPI;          // cp.async instructions per 16-row tile
  constexpr int TILE = 16 * CPR;        // uint4 per 16-row tile
  constexpr int KT = D / 16;            // k-steps of QK^T and m-tiles of O^T
  static_assert(D % 64 == 0 && D <= 256, "head dim 64, 128 or 256");
  static_assert(LPR * RPI == 32 && LPR == CPR, "lane mapping: one 16-byte chunk of a row per lane");

  extern __shared__ uint4 smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // On sm_90 the merge is this kernel's programmatic dependent (speedcore.decode): it may be scheduled as soon as
  // every CTA here has started, and waits in-kernel for the partials, so no launch gap separates the two.  This
  // kernel may itself be its predecessor's dependent (speedcore._launch.chained): it waits for it once its
  // block-table entries and sequence length are loaded (step inputs no kernel of the chain writes), before q, K
  // and V (the previous kernel wrote this step's rows).
#ifdef DECODE_TRACE
  auto gtime = sc::globaltimer_ns;
  unsigned long long* trace = reinterpret_cast<unsigned long long*>(lse_out) + (long long)blockIdx.x * 8;
  if (threadIdx.x == 0) { unsigned smid; asm volatile("mov.u32 %0, %smid;" : "=r"(smid)); trace[0] = gtime(); trace[4] = smid; }
  lse_out = nullptr;
#endif

  // PAIR (sm_90, num_splits == 2): the two splits of a unit are one thread-block cluster, adjacent in x, and are
  // merged through distributed shared memory at the end instead of by decode_merge_kernel.  A template parameter, so
  // that the other launches' code is not touched by it.
  int bid = blockIdx.x;
  int unit, split;
  if constexpr (PAIR) {
    split = bid & 1;
    bid >>= 1;
    unit = bid % units;
    bid /= units;
  } else {
    unit = bid % units;
    bid /= units;
    split = bid % num_splits;
    bid /= num_splits;
  }
  const int b = bid;
  const int kvh = unit / qgroups;
  const int q0 = (unit % qgroups) * 8;            // first query of this CTA inside the KV head's group
  const int nq = min(8, group - q0);              // queries served by this CTA
  const int h0 = kvh * group + q0;                // first query head

  // Attended range [lo, hi) of a sequence of length len: the whole sequence, or the last window_left + 1
  // tokens; this split's tiles [t_begin, t_end).
  auto range = [&](int len, int& lo, int& hi, int& t_begin, int& t_end) {
    hi = max(len, 0);
    lo = window_left >= 0 ? max(0, hi - 1 - window_left) : 0;
    const int tile_lo = lo >> 4, tile_hi = (hi + 15) >> 4;
    const int ntiles = max(tile_hi - tile_lo, 0);
    // Not rounded to whole warps: (1, 131072) in 33 splits then leaves the last split 224 tiles instead of 128,
    // and most warps one tile fewer.
    const int per_split = (ntiles + num_splits - 1) / num_splits;
    t_begin = tile_lo + split * per_split;
    t_end = min(t_begin + per_split, tile_hi);
  };
  const int* bt_row = block_table + (long long)b * bt_stride;
  // The block-table entries of this warp's first STAGES tiles are loaded together with seq_lens[b], for the
  // range a sequence of full length (max_len, the table's capacity) would give: they are the right entries
  // whenever the real range starts on the same tile and no earlier token (always for split 0 without a window,
  // and for full sequences), which takes one dependent memory round trip off the start of every CTA.
  int spec_lo, spec_hi, spec_begin, spec_end;
  range(max_len, spec_lo, spec_hi, spec_begin, spec_end);
  const int spec_first = spec_begin + warp;
  // PAGE16 (block_size % 16 == 0): a tile's 16 rows are consecutive slots of one page, so every lane resolves the
  // tile's first token (one broadcast load) and issue() needs no shuffles.
  constexpr bool aligned = PAGE16;
  int spec_page[STAGES];
#pragma unroll
  for (int j = 0; j < STAGES; ++j) {
    const int tile_tok = (spec_first + j * WARPS) * 16, tok = aligned ? tile_tok : tile_tok + lane;
    const bool in = aligned ? tile_tok < spec_hi && tile_tok + 15 >= spec_lo
                            : lane < 16 && tok >= spec_lo && tok < spec_hi;
    spec_page[j] = in ? bt_row[tok / block_size] : 0;
  }
  const int seq_len = seq_lens[b * sl_stride];
  sc::chain_after_previous();
  int lo, hi, t_begin, t_end;
  range(min(seq_len, max_len), lo, hi, t_begin, t_end);

  // Q^T as the B operand of S^T = K Q^T: lane holds Q[query lane/4][d = 16kk + 2(lane%4) + {0,1}] and d + 8.
  unsigned qf[KT][2];
  {
    const int qi = lane >> 2;
    const bool ok = qi < nq;
    const T* qp = q + (long long)b * q_stride_b + (long long)(h0 + (ok ? qi : 0)) * q_stride_h + 2 * (lane & 3);
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
      qf[kk][0] = ok ? *reinterpret_cast<const unsigned*>(qp + kk * 16) : 0u;
      qf[kk][1] = ok ? *reinterpret_cast<const unsigned*>(qp + kk * 16 + 8) : 0u;
    }
  }

  const T* kbase = k_cache + (long long)kvh * c_stride_head;
  const T* vbase = v_cache + (long long)kvh * c_stride_head;
  uint4* ring = smem + warp * (STAGES * 2 * TILE);
  const unsigned long long policy = HINT == 2 ? dec::evict_first_policy() : 0ull;

  // A power-of-two block size (vLLM's are) turns the per-tile page index into a shift.
  const int bs_shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;

  // This warp's tiles: t_begin + warp + j * WARPS for j < njobs.
  const int first = t_begin + warp;
  const int njobs = t_end > first ? (t_end - first + WARPS - 1) / WARPS : 0;
  const bool use_spec = first == spec_first && lo >= spec_lo;  // [lo, hi) lies inside the speculated range

  // Lane r < 16 resolves row r of a tile: its page (loaded early, to hide the block-table latency) and slot.
  // spec: one of the first STAGES tiles (j a compile-time index after unrolling), whose entries may have been
  // loaded speculatively.
  // Aligned: every lane resolves the tile's first token; ok then means the tile has attended rows.
  auto fetch_row = [&](bool spec, int j, int& page, int& slot) -> bool {
    const int tile_tok = (first + j * WARPS) * 16, tok = aligned ? tile_tok : tile_tok + lane;
    const bool ok = aligned ? j < njobs && tile_tok < hi && tile_tok + 15 >= lo
                            : lane < 16 && j < njobs && tok >= lo && tok < hi;
    page = 0;
    slot = 0;
    if (ok) {
      const int blk = bs_shift >= 0 ? tok >> bs_shift : tok / block_size;
      page = spec && use_spec ? spec_page[j] : bt_row[blk];
      slot = tok - blk * block_size;
    }
    return ok;
  };
  // Shared addresses: stage j of this warp's ring at ring_s + (j % STAGES) * SLOT (K tile, then V tile), 16-byte
  // chunks XOR-swizzled within 8-row groups.  The swizzle repeats every 8 rows and every 8 chunks, so each address
  // below is a loop-invariant per-lane pattern plus a compile-time offset.
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
  // Tile j into the stage at shared address st.
  auto issue = [&](int j, unsigned st, int page, int slot, bool ok) {
    // min() with num_blocks - 1 keeps a corrupt block table from faulting.
    const long long off =
        ok ? (long long)min((unsigned)page, (unsigned)(num_blocks - 1)) * c_stride_block +
                 (long long)slot * c_stride_tok
           : 0;
    const int chunk = lane % LPR, tile_tok = (first + j * WARPS) * 16;
    // Aligned: a tile wholly inside [lo, hi) (all but the first and last) needs no per-row predicate.
    const bool whole = aligned && ok && tile_tok >= lo && tile_tok + 16 <= hi;
    auto copy = [&](bool check) {
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        const int row = i * RPI + lane / LPR;
        long long roff;
        bool rok;
        if (aligned) {
          roff = off + (long long)row * c_stride_tok;
          rok = !check || (ok && tile_tok + row >= lo && tile_tok + row < hi);
        } else {
          roff = __shfl_sync(0xffffffffu, off, row);
          rok = __shfl_sync(0xffffffffu, ok, row);
        }
        const unsigned dst = st + cp_pat[i % IP] + (i / IP) * (8 * CPR * 16);
        dec::cp_async_kv<HINT>(dst, kbase + roff + chunk * 8, rok, policy);
        dec::cp_async_kv<HINT>(dst + TILE * 16, vbase + roff + chunk * 8, rok, policy);
      }
    };
    if (whole) copy(false);
    else copy(true);
  };

  float oacc[KT][4];
#pragma unroll
  for (int i = 0; i < KT; ++i) oacc[i][0] = oacc[i][1] = oacc[i][2] = oacc[i][3] = 0.f;
  float m0 = dec::neg_inf(), m1 = dec::neg_inf(), l0 = 0.f, l1 = 0.f;

#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j) {
    int page, slot;
    const bool ok = fetch_row(true, j, page, slot);
    if (j < njobs) issue(j, ring_s + j * SLOT, page, slot, ok);
    sc::cp_async_commit();
  }
  int pf_page, pf_slot;
  bool pf_ok = fetch_row(true, STAGES - 1, pf_page, pf_slot);

  // st: tile j's stage; prev: the stage tile j - 1 had, which tile j + STAGES - 1 takes.
  unsigned st = ring_s, prev = ring_s + (STAGES - 1) * SLOT;
  for (int j = 0; j < njobs; ++j) {
    // Kept in registers: left to itself ptxas recomputes these from the lane index in every iteration.
#pragma unroll
    for (int p = 0; p < 4; ++p) asm volatile("" : "+r"(k_pat[p]), "+r"(v_pat[p]));
#pragma unroll
    for (int i = 0; i < IP; ++i) asm volatile("" : "+r"(cp_pat[i]));
    sc::cp_async_wait<STAGES - 2>();
    __syncwarp();
#ifdef DECODE_TRACE
    if (j == 0 && threadIdx.x == 0) trace[1] = gtime();
#endif
    // Refill the slot consumed in the previous iteration (every lane is past it after __syncwarp).
    if (j + STAGES - 1 < njobs) issue(j + STAGES - 1, prev, pf_page, pf_slot, pf_ok);
    sc::cp_async_commit();
    pf_ok = fetch_row(false, j + STAGES, pf_page, pf_slot);

    float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
      unsigned a[4];
      sc::ldmatrix_x4_s(a, st + k_pat[kk % 4] + (kk / 4) * 128);
      sc::mma_16816<T>((kk & 1) ? sb : sa, a, qf[kk]);  // two accumulators halve the dependency chain
    }
    const int tok_a = (first + j * WARPS) * 16 + (lane >> 2);
    const int tok_b = tok_a + 8;
    const bool va = tok_a >= lo && tok_a < hi, vb = tok_b >= lo && tok_b < hi;
    float s[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float raw = sa[i] + sb[i];
      s[i] = use_softcap ? cap_log2 * dec::tanh_exp(raw * scale_a) : raw * scale_a;
    }
    if (!va) s[0] = s[1] = dec::neg_inf();
    if (!vb) s[2] = s[3] = dec::neg_inf();
    // Online softmax in the log2 domain; lanes sharing lane%4 own the same two queries.
    float mx0 = fmaxf(s[0], s[2]), mx1 = fmaxf(s[1], s[3]);
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float base0 = mn0 == dec::neg_inf() ? 0.f : mn0, base1 = mn1 == dec::neg_inf() ? 0.f : mn1;
    // The running max rarely rises after the first tiles; while it stays, alpha is exactly 1 and the rescale of
    // the output accumulators (4 KT multiplies) is skipped, bit for bit the same result.
    if (__any_sync(0xffffffffu, mn0 != m0 || mn1 != m1)) {
      const float alpha0 = sc::fast_exp2(m0 - base0), alpha1 = sc::fast_exp2(m1 - base1);
      l0 *= alpha0;
      l1 *= alpha1;
#pragma unroll
      for (int mt = 0; mt < KT; ++mt) {
        oacc[mt][0] *= alpha0;
        oacc[mt][1] *= alpha1;
        oacc[mt][2] *= alpha0;
        oacc[mt][3] *= alpha1;
      }
    }
    m0 = mn0;
    m1 = mn1;
    const float p0 = sc::fast_exp2(s[0] - base0), p1 = sc::fast_exp2(s[1] - base1);
    const float p2 = sc::fast_exp2(s[2] - base0), p3 = sc::fast_exp2(s[3] - base1);
    l0 += p0 + p2;
    l1 += p1 + p3;
    unsigned pb[2];
    pb[0] = dec::movmatrix_trans(sc::pack2<T>(p0, p1));
    pb[1] = dec::movmatrix_trans(sc::pack2<T>(p2, p3));
#pragma unroll
    for (int mt = 0; mt < KT; ++mt) {
      unsigned a[4];
      sc::ldmatrix_x4_trans_s(a, st + v_pat[mt % 4] + (mt / 4) * 128);
      sc::mma_16816<T>(oacc[mt], a, pb);
    }
    prev = st;
    st = st + SLOT == ring_s + STAGES * SLOT ? ring_s : st + SLOT;
  }
  sc::cp_async_wait<0>();
#ifdef DECODE_TRACE
  if (threadIdx.x == 0) trace[2] = gtime();
#endif

  // Row sums: each lane summed only its own tokens.
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o);
  }
  __syncthreads();  // every warp is done with its ring: reuse shared memory for the merge across warps
  float* red_o = reinterpret_cast<float*>(smem);      // [WARPS][8][D]
  float* red_m = red_o + WARPS * 8 * D;                // [WARPS][8]
  float* red_l = red_m + WARPS * 8;                    // [WARPS][8]
  {
    const int qa = 2 * (lane & 3);
    float* ow = red_o + warp * 8 * D;
#pragma unroll
    for (int mt = 0; mt < KT; ++mt) {
      const int d = mt * 16 + (lane >> 2);
      ow[qa * D + d] = oacc[mt][0];
      ow[(qa + 1) * D + d] = oacc[mt][1];
      ow[qa * D + d + 8] = oacc[mt][2];
      ow[(qa + 1) * D + d + 8] = oacc[mt][3];
    }
    if (lane < 4) {
      red_m[warp * 8 + qa] = m0;
      red_m[warp * 8 + qa + 1] = m1;
      red_l[warp * 8 + qa] = l0;
      red_l[warp * 8 + qa + 1] = l1;
    }
  }
  float* pair_o = red_l + WARPS * 8;                   // [8][D]: this split's normalized output (PAIR)
  float* pair_lse = pair_o + 8 * D;                    // [8]: its log2-sum-exp
  __syncthreads();
  const bool direct = num_splits == 1;
  for (int idx = threadIdx.x; idx < nq * D; idx += WARPS * 32) {
    const int qi = idx / D, d = idx - qi * D;
    float mmax = dec::neg_inf();
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mmax = fmaxf(mmax, red_m[w * 8 + qi]);
    float lsum = 0.f, o = 0.f;
    if (mmax != dec::neg_inf()) {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float f = sc::fast_exp2(red_m[w * 8 + qi] - mmax);
        lsum += red_l[w * 8 + qi] * f;
        o += red_o[(w * 8 + qi) * D + d] * f;
      }
    }
    const bool empty = !(lsum > 0.f);
    o = empty ? 0.f : o * __frcp_rn(lsum);
    const int h = h0 + qi;
    if constexpr (PAIR) {
      pair_o[idx] = o;
      if (d == 0) pair_lse[qi] = empty ? dec::neg_inf() : mmax + __log2f(lsum);  // log2 domain
      continue;
    }
    const float lse = empty ? dec::neg_inf() : (mmax + __log2f(lsum)) * 0.6931471805599453f  /* ln 2 */;
    if (direct) {
      out[(long long)b * o_stride_b + (long long)h * o_stride_h + d] = sc::from_float<T>(o);
      if (lse_out != nullptr && d == 0) lse_out[(long long)b * num_heads + h] = lse;
    } else {
      const long long row = ((long long)b * num_heads + h) * num_splits + split;
      part_out[row * D + d] = o;
      if (d == 0) part_lse[row] = lse;
    }
  }
#if __CUDA_ARCH__ >= 900
  if constexpr (PAIR) {
    // Each CTA of the pair finalizes half of the outputs from both splits' shared memory (this split's, and its
    // partner's through DSMEM), always combined in split order so that the result does not depend on which CTA
    // computes it.  The release/acquire barrier publishes the partials; the second keeps each CTA's shared
    // memory alive until its partner has read it.
    sc::cluster_arrive_release();
    sc::cluster_wait();
    const unsigned mine = sc::smem_addr(pair_o), theirs = sc::cluster_map(mine, split ^ 1);
    const unsigned o0 = split == 0 ? mine : theirs, o1 = split == 0 ? theirs : mine;
    constexpr int V4 = D / 4;
    const int items = nq * V4, half = (items + 1) >> 1, end = min(items, (split + 1) * half);
    for (int i = split * half + threadIdx.x; i < end; i += WARPS * 32) {
      const int qi = i / V4, c = i - qi * V4;
      const float la = sc::ld_cluster_f32(o0 + (8 * D + qi) * 4), lb = sc::ld_cluster_f32(o1 + (8 * D + qi) * 4);
      const float4 xa = sc::ld_cluster_v4(o0 + i * 16), xb = sc::ld_cluster_v4(o1 + i * 16);
      const float m = fmaxf(la, lb);
      float wa = 0.f, wb = 0.f, lse = dec::neg_inf();
      if (m != dec::neg_inf()) {
        wa = sc::fast_exp2(la - m);
        wb = sc::fast_exp2(lb - m);
        const float sum = wa + wb, r = __frcp_rn(sum);
        wa *= r;
        wb *= r;
        lse = (m + __log2f(sum)) * 0.6931471805599453f;
      }
      const int h = h0 + qi;
      T* dst = out + (long long)b * o_stride_b + (long long)h * o_stride_h + 4 * c;
      dst[0] = sc::from_float<T>(wa * xa.x + wb * xb.x);
      dst[1] = sc::from_float<T>(wa * xa.y + wb * xb.y);
      dst[2] = sc::from_float<T>(wa * xa.z + wb * xb.z);
      dst[3] = sc::from_float<T>(wa * xa.w + wb * xb.w);
      if (lse_out != nullptr && c == 0) lse_out[(long long)b * num_heads + h] = lse;
    }
    sc::cluster_arrive_relaxed();
    sc::cluster_wait();
  }
#else
  if constexpr (PAIR) __trap();  // clusters need sm_90; the host never picks this variant below it
#endif
#ifdef DECODE_TRACE
  __syncthreads();
  if (threadIdx.x == 0) trace[3] = gtime();
#endif
}

// Combines the splits of one (sequence, query head) per CTA with weights exp(lse_s - max).  Latency-bound (a
// few KB per row, just written, so in L2): every load is issued before any result is used, so the kernel costs
// one L2 round trip plus the arithmetic.  Warps take interleaved splits and lanes 4-float columns, each lane
// holding up to BATCH splits in registers; every lane also loads all the split lse values itself (at most 256,
// 8 per lane) for the max and the total, so no block-wide reduction precedes the sums.  One shared-memory pass
// sums the warps.  The host picks the warp count (1 to 8) from the number of splits.
template <typename T, int D>
__global__ void __launch_bounds__(256) decode_merge_kernel(T* __restrict__ out, float* __restrict__ lse_out,
                                                           const float* __restrict__ part_out,
                                                           const float* __restrict__ part_lse, int num_heads,
                                                           int num_splits, long long o_stride_b,
                                                           long long o_stride_h) {
  constexpr int V4 = D / 4;                 // float4 columns of a row
  constexpr int LPS = V4 < 32 ? V4 : 32;    // lanes per split row
  constexpr int SPW = 32 / LPS;             // splits a warp reads per step
  constexpr int VPL = V4 / LPS;             // float4 per lane
  constexpr int BATCH = 8 / SPW;            // splits per lane loaded at once: 64 per CTA of 8 warps
  constexpr int LSE_PER_LANE = 8;           // MAX_SPLITS / 32
  __shared__ float4 red[8][V4];
  const int row = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const float* lse = part_lse + (long long)row * num_splits;
  const int sub = lane / LPS, v = lane - sub * LPS;
  const int step = nwarps * SPW;
  const int s0 = warp * SPW + sub;
  const float4* src = reinterpret_cast<const float4*>(part_out) + (long long)row * num_splits * V4 + v;
  sc::grid_dependency_wait();  // the attention kernel's partials (on sm_90 this is its programmatic dependent)

  float4 x[BATCH][VPL];
  float xl[BATCH];
#pragma unroll
  for (int i = 0; i < BATCH; ++i) {
    const int s = s0 + i * step;
    const bool ok = s < num_splits;
#pragma unroll
    for (int k = 0; k < VPL; ++k) x[i][k] = ok ? src[(long long)s * V4 + k * LPS] : make_float4(0.f, 0.f, 0.f, 0.f);
    xl[i] = ok ? lse[s] : dec::neg_inf();
  }
  float lv[LSE_PER_LANE];
#pragma unroll
  for (int i = 0; i < LSE_PER_LANE; ++i) {
    const int s = lane + 32 * i;
    lv[i] = s < num_splits ? lse[s] : dec::neg_inf();
  }
  float mx = lv[0];
#pragma unroll
  for (int i = 1; i < LSE_PER_LANE; ++i) mx = fmaxf(mx, lv[i]);
  mx = sc::warp_max(mx);
  const bool empty = mx == dec::neg_inf();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < LSE_PER_LANE; ++i) total += empty ? 0.f : __expf(lv[i] - mx);
  total = sc::warp_sum(total);

  float4 acc[VPL];
#pragma unroll
  for (int k = 0; k < VPL; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  auto add = [&](float w, const float4* xs) {
#pragma unroll
    for (int k = 0; k < VPL; ++k) {
      acc[k].x += w * xs[k].x;
      acc[k].y += w * xs[k].y;
      acc[k].z += w * xs[k].z;
      acc[k].w += w * xs[k].w;
    }
  };
#pragma unroll
  for (int i = 0; i < BATCH; ++i) add(empty || xl[i] == dec::neg_inf() ? 0.f : __expf(xl[i] - mx), x[i]);
  // More splits than one batch covers (over 64 splits at 8 warps): the rest, a few in flight per lane.
#pragma unroll 4
  for (int s = s0 + BATCH * step; s < num_splits; s += step) {
    float4 xs[VPL];
#pragma unroll
    for (int k = 0; k < VPL; ++k) xs[k] = src[(long long)s * V4 + k * LPS];
    add(empty ? 0.f : __expf(lse[s] - mx), xs);
  }
  if constexpr (SPW == 2) {  // two splits per warp step: fold the upper half-warp into the lower
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      acc[i].x += __shfl_xor_sync(0xffffffffu, acc[i].x, 16);
      acc[i].y += __shfl_xor_sync(0xffffffffu, acc[i].y, 16);
      acc[i].z += __shfl_xor_sync(0xffffffffu, acc[i].z, 16);
      acc[i].w += __shfl_xor_sync(0xffffffffu, acc[i].w, 16);
    }
  }
  if (sub == 0) {
#pragma unroll
    for (int i = 0; i < VPL; ++i) red[warp][v + i * LPS] = acc[i];
  }
  __syncthreads();
  const float inv = total > 0.f ? __frcp_rn(total) : 0.f;
  const int b = row / num_heads, h = row - b * num_heads;
  for (int c = threadIdx.x; c < V4; c += blockDim.x) {
    float4 sum = red[0][c];
    for (int w = 1; w < nwarps; ++w) {
      const float4 x = red[w][c];
      sum.x += x.x;
      sum.y += x.y;
      sum.z += x.z;
      sum.w += x.w;
    }
    T* o = out + (long long)b * o_stride_b + (long long)h * o_stride_h + c * 4;
    o[0] = sc::from_float<T>(sum.x * inv);
    o[1] = sc::from_float<T>(sum.y * inv);
    o[2] = sc::from_float<T>(sum.z * inv);
    o[3] = sc::from_float<T>(sum.w * inv);
  }
  if (lse_out != nullptr && threadIdx.x == 0) lse_out[row] = total > 0.f ? mx + __logf(total) : dec::neg_inf();
}

// ------------------------------------------------------------------------------------------------------------
// reshape_and_cache: token t's K and V rows (heads x words) go to slot slot_mapping[t] of the paged caches;
// slots outside [0, num_slots) (vLLM pads with -1) are skipped.  W is the unit moved: a 16-byte word when
// every row, stride and pointer allows it, otherwise one element.  Strides are in units of W.
template <typename W>
__global__ void __launch_bounds__(128) reshape_and_cache_kernel(
    W* __restrict__ k_cache, W* __restrict__ v_cache, const W* __restrict__ k, const W* __restrict__ v,
    const void* __restrict__ slot_mapping, int slot_is_64, int words_per_head, int heads, int block_size,
    long long num_slots, long long k_stride_tok, long long k_stride_head, long long v_stride_tok,
    long long v_stride_head, long long c_stride_block, long long c_stride_tok, long long c_stride_head) {
  sc::chain_after_previous();
  const long long t = blockIdx.x;
  const int i = blockIdx.y * 128 + threadIdx.x;
  if (i >= heads * words_per_head) return;
  const int h = i / words_per_head, w = i - h * words_per_head;
  // The three loads are independent: issue K and V before the slot decides whether they are stored.
  const W kw = k[t * k_stride_tok + h * k_stride_head + w];
  const W vw = v[t * v_stride_tok + h * v_stride_head + w];
  const long long slot = slot_is_64 ? static_cast<const long long*>(slot_mapping)[t]
                                    : (long long) static_cast<const int*>(slot_mapping)[t];
  if (slot < 0 || slot >= num_slots) return;
  const int blk = (int)slot / block_size, off = (int)slot - blk * block_size;  // num_slots < 2**31
  const long long dst = blk * c_stride_block + off * c_stride_tok + h * c_stride_head + w;
  k_cache[dst] = kw;
  v_cache[dst] = vw;
}

// ------------------------------------------------------------------------------------------------------------
// Rotary embedding in place, vLLM semantics: cos_sin_cache[pos] = [cos(rot/2) | sin(rot/2)]; the first
// rot_dim dims of each head rotate, the rest are untouched.  NEOX pairs x[i] with x[i + rot/2]; GPT-J pairs
// x[2i] with x[2i+1].
//
// A flat grid of independent tasks (token, head, column group), one per thread, no barrier: a thread issues
// its q/k loads at once, alongside the position and cos/sin loads (the cos/sin rows are a few KB per token,
// re-read by every head from L1/L2, so HBM sees each once).  VEC: a task is one 16-byte word of each rotated
// half (NEOX: N pairs x[c*N..], x[half + c*N..]; GPT-J: one word = N/2 interleaved pairs), with the matching
// cos/sin loaded as vectors (the host checks the alignment); otherwise a task is one pair.
namespace dec {
// M consecutive values of CS as floats, in 16-, 8- or 4-byte loads when the byte count allows.
template <typename CS, int M> __device__ __forceinline__ void load_floats(const CS* p, float* f) {
  constexpr int BYTES = M * (int)sizeof(CS);
  if constexpr (BYTES % 16 == 0) {
    constexpr int PER = 16 / sizeof(CS);
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i)
      sc::Pack16<CS>::unpack(__ldg(reinterpret_cast<const uint4*>(p) + i), f + i * PER);
  } else if constexpr (BYTES == 8 && sizeof(CS) == 4) {
    const uint2 w = __ldg(reinterpret_cast<const uint2*>(p));
    f[0] = __uint_as_float(w.x);
    f[1] = __uint_as_float(w.y);
  } else if constexpr (BYTES == 8) {
    const uint2 w = __ldg(reinterpret_cast<const uint2*>(p));
    const float2 a = sc::unpack2<CS>(w.x), b = sc::unpack2<CS>(w.y);
    f[0] = a.x;
    f[1] = a.y;
    f[2] = b.x;
    f[3] = b.y;
  } else {
#pragma unroll
    for (int i = 0; i < M; ++i) f[i] = sc::to_float(p[i]);
  }
}

// Token t's row [cos(rot/2) | sin(rot/2)] of the cos/sin cache; its position is clamped to [0, max_pos), so a bad
// position reads a wrong row, never out of bounds.
template <typename CS, typename I>
__device__ __forceinline__ const CS* cos_sin_row(const CS* cos_sin, long long cs_stride, const void* positions,
                                                 int pos_is_64, I t, int max_pos) {
  const long long pos = min(max(load_index(positions, pos_is_64, t), 0LL), (long long)max_pos - 1);
  return cos_sin + pos * cs_stride;
}

// NEOX: N pairs (x[e], y[e]) rotated by (cv[e], sv[e]).
template <int N> __device__ __forceinline__ void rotate_neox(float* x, float* y, const float* cv, const float* sv) {
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const float xr = x[e] * cv[e] - y[e] * sv[e];
    y[e] = y[e] * cv[e] + x[e] * sv[e];
    x[e] = xr;
  }
}

// GPT-J: the N / 2 interleaved pairs (x[2e], x[2e + 1]) rotated by (cv[e], sv[e]).
template <int N> __device__ __forceinline__ void rotate_gptj(float* x, const float* cv, const float* sv) {
#pragma unroll
  for (int e = 0; e < N / 2; ++e) {
    const float a = x[2 * e], b = x[2 * e + 1];
    x[2 * e] = a * cv[e] - b * sv[e];
    x[2 * e + 1] = b * cv[e] + a * sv[e];
  }
}
}  // namespace dec

template <typename T, typename CS, bool NEOX, bool VEC>
__global__ void __launch_bounds__(256) rotary_embedding_kernel(
    T* __restrict__ q, T* __restrict__ k, const void* __restrict__ positions, int pos_is_64,
    const CS* __restrict__ cos_sin, long long cs_stride, int rot_dim, int max_pos, int q_heads, int k_heads,
    long long q_stride_tok, long long q_stride_head, long long k_stride_tok, long long k_stride_head,
    int num_tokens) {
  constexpr int N = VEC ? 16 / sizeof(T) : 1;
  const int half = rot_dim / 2;
  // tasks per head: VEC NEOX half/N words, VEC GPT-J rot/N words, scalar half pairs
  const int per_head = VEC ? (NEOX ? half / N : rot_dim / N) : half;
  const int heads = q_heads + k_heads;
  const unsigned per_token = (unsigned)(heads * per_head);
  const unsigned g = blockIdx.x * 256u + threadIdx.x;  // host: num_tokens * per_token < 2**31
  const unsigned t = g / per_token;
  if ((int)t >= num_tokens) {
    sc::chain_after_previous();
    return;
  }
  const unsigned r = g - t * per_token;
  const int hh = (int)(r / (unsigned)per_head), c = (int)(r - (unsigned)hh * per_head);
  T* base = hh < q_heads ? q + (long long)t * q_stride_tok + (long long)hh * q_stride_head
                         : k + (long long)t * k_stride_tok + (long long)(hh - q_heads) * k_stride_head;
  // The position and its cos/sin row are read before the chain's wait: no kernel of the chain writes them (the
  // engine's positions are copied in before the step), and the wait is then the only latency before q / k.
  const CS* cosr = dec::cos_sin_row(cos_sin, cs_stride, positions, pos_is_64, t, max_pos);
  const CS* sinr = cosr + half;
  if constexpr (VEC) {
    using P = sc::Pack16<T>;
    if constexpr (NEOX) {
      float x[N], y[N], cv[N], sv[N];
      dec::load_floats<CS, N>(cosr + c * N, cv);
      dec::load_floats<CS, N>(sinr + c * N, sv);
      sc::chain_after_previous();
      uint4* px = reinterpret_cast<uint4*>(base + c * N);
      uint4* py = reinterpret_cast<uint4*>(base + half + c * N);
      const uint4 wx = *px, wy = *py;
      P::unpack(wx, x);
      P::unpack(wy, y);
      dec::rotate_neox<N>(x, y, cv, sv);
      *px = P::pack(x);
      *py = P::pack(y);
    } else {
      float x[N], cv[N / 2], sv[N / 2];
      dec::load_floats<CS, N / 2>(cosr + c * (N / 2), cv);
      dec::load_floats<CS, N / 2>(sinr + c * (N / 2), sv);
      sc::chain_after_previous();
      uint4* p = reinterpret_cast<uint4*>(base + c * N);
      const uint4 w = *p;
      P::unpack(w, x);
      dec::rotate_gptj<N>(x, cv, sv);
      *p = P::pack(x);
    }
  } else {
    const int xi = NEOX ? c : 2 * c, yi = NEOX ? c + half : 2 * c + 1;
    const float cv = sc::to_float(cosr[c]), sv = sc::to_float(sinr[c]);
    sc::chain_after_previous();
    const float x = sc::to_float(base[xi]), y = sc::to_float(base[yi]);
    base[xi] = sc::from_float<T>(x * cv - y * sv);
    base[yi] = sc::from_float<T>(y * cv + x * sv);
  }
}

// ------------------------------------------------------------------------------------------------------------
// rotary_cache_kernel: rotary_embedding_kernel's VEC tasks (rot_dim = head size) on q and k, and in the same grid
// reshape_and_cache's writes: each K task also stores its rotated words at the token's cache slot, and a V task per
// (token, KV head, word group) copies the same words of v there (a decode step's one kernel between the QKV
// projection and attention instead of two).  Tasks per token: (q_heads + 2 k_heads) x per_head, V last.  Slots
// outside [0, num_slots) are not written (k is still rotated in place).  Strides in elements.
template <typename T, typename CS, bool NEOX>
__global__ void __launch_bounds__(256) rotary_cache_kernel(
    T* __restrict__ q, T* __restrict__ k, const T* __restrict__ v, T* __restrict__ k_cache, T* __restrict__ v_cache,
    const void* __restrict__ positions, int pos_is_64, const void* __restrict__ slot_mapping, int slot_is_64,
    const CS* __restrict__ cos_sin, long long cs_stride, int rot_dim, int max_pos, int q_heads, int k_heads,
    long long q_stride_tok, long long q_stride_head, long long k_stride_tok, long long k_stride_head,
    long long v_stride_tok, long long v_stride_head, long long c_stride_block, long long c_stride_tok,
    long long c_stride_head, int block_size, long long num_slots, int num_tokens) {
  constexpr int N = 16 / sizeof(T);
  using P = sc::Pack16<T>;
  const int half = rot_dim / 2;
  const int per_head = NEOX ? half / N : rot_dim / N;  // tasks per head: NEOX two words (x, y), GPT-J one
  const unsigned per_token = (unsigned)((q_heads + 2 * k_heads) * per_head);
  const unsigned g = blockIdx.x * 256u + threadIdx.x;  // host: num_tokens * per_token < 2**31
  const unsigned t = g / per_token;
  if ((int)t >= num_tokens) {
    sc::chain_after_previous();
    return;
  }
  const unsigned r = g - t * per_token;
  const int hh = (int)(r / (unsigned)per_head), c = (int)(r - (unsigned)hh * per_head);
  const bool is_q = hh < q_heads, is_v = hh >= q_heads + k_heads;
  const int kvh = is_q ? 0 : is_v ? hh - q_heads - k_heads : hh - q_heads;
  // position, cos/sin and slot before the chain's wait (inputs no kernel of the chain writes)
  long long slot = -1;
  if (!is_q) slot = dec::load_index(slot_mapping, slot_is_64, t);
  const bool cached = slot >= 0 && slot < num_slots;
  const long long blk = cached ? slot / block_size : 0;
  const long long c_row = blk * c_stride_block + (slot - blk * block_size) * c_stride_tok + kvh * c_stride_head;
  // word offsets (elements) inside the head: NEOX x and y, GPT-J one word
  const int ox = c * N, oy = NEOX ? half + c * N : 0;
  float cv[NEOX ? N : N / 2], sv[NEOX ? N : N / 2];
  if (!is_v) {
    const CS* cosr = dec::cos_sin_row(cos_sin, cs_stride, positions, pos_is_64, t, max_pos);
    if constexpr (NEOX) {
      dec::load_floats<CS, N>(cosr + c * N, cv);
      dec::load_floats<CS, N>(cosr + half + c * N, sv);
    } else {
      dec::load_floats<CS, N / 2>(cosr + c * (N / 2), cv);
      dec::load_floats<CS, N / 2>(cosr + half + c * (N / 2), sv);
    }
  }
  sc::chain_after_previous();
  if (is_v) {
    const T* src = v + (long long)t * v_stride_tok + (long long)kvh * v_stride_head;
    const uint4 wx = *reinterpret_cast<const uint4*>(src + ox);
    uint4 wy;
    if constexpr (NEOX) wy = *reinterpret_cast<const uint4*>(src + oy);
    if (cached) {
      *reinterpret_cast<uint4*>(v_cache + c_row + ox) = wx;
      if constexpr (NEOX) *reinterpret_cast<uint4*>(v_cache + c_row + oy) = wy;
    }
    return;
  }
  T* base = is_q ? q + (long long)t * q_stride_tok + (long long)hh * q_stride_head
                 : k + (long long)t * k_stride_tok + (long long)kvh * k_stride_head;
  uint4* px = reinterpret_cast<uint4*>(base + ox);
  uint4 out_x, out_y;
  if constexpr (NEOX) {
    uint4* py = reinterpret_cast<uint4*>(base + oy);
    float x[N], y[N];
    P::unpack(*px, x);
    P::unpack(*py, y);
    dec::rotate_neox<N>(x, y, cv, sv);
    out_x = P::pack(x);
    out_y = P::pack(y);
    *px = out_x;
    *py = out_y;
  } else {
    float x[N];
    P::unpack(*px, x);
    dec::rotate_gptj<N>(x, cv, sv);
    out_x = P::pack(x);
    *px = out_x;
  }
  if (!is_q && cached) {
    *reinterpret_cast<uint4*>(k_cache + c_row + ox) = out_x;
    if constexpr (NEOX) *reinterpret_cast<uint4*>(k_cache + c_row + oy) = out_y;
  }
}

// ------------------------------------------------------------------------------------------------------------
// Gated activations: out[r, i] = act(x[r, i]) * x[r, d + i], computed in float with one rounding.
// ACT 0: SiLU, 1: GELU (erf).  Grid: (rows, column blocks); VEC: one 16-byte word of each half per thread.
namespace dec {
template <int ACT> __device__ __forceinline__ float act(float x) {
  if constexpr (ACT == 0) {
    return x / (1.f + __expf(-x));
  } else {
    return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
  }
}
}  // namespace dec

template <typename T, int ACT, bool VEC>
__global__ void __launch_bounds__(256) gated_act_kernel(T* __restrict__ out, const T* __restrict__ x, int d,
                                                        long long x_stride, long long o_stride) {
  sc::chain_after_previous();
  const long long r = blockIdx.x;
  const T* xr = x + r * x_stride;
  T* orow = out + r * o_stride;
  if constexpr (VEC) {
    constexpr int N = 16 / sizeof(T);
    using P = sc::Pack16<T>;
    const int i = blockIdx.y * 256 + threadIdx.x;
    if (i >= d / N) return;
    float a[N], g[N];
    P::unpack(reinterpret_cast<const uint4*>(xr)[i], a);
    P::unpack(reinterpret_cast<const uint4*>(xr + d)[i], g);
#pragma unroll
    for (int e = 0; e < N; ++e) a[e] = dec::act<ACT>(a[e]) * g[e];
    reinterpret_cast<uint4*>(orow)[i] = P::pack(a);
  } else {
    const int i = blockIdx.y * 256 + threadIdx.x;
    if (i >= d) return;
    orow[i] = sc::from_float<T>(dec::act<ACT>(sc::to_float(xr[i])) * sc::to_float(xr[d + i]));
  }
}
