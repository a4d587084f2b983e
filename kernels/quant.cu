// Weight-only quantized linear layers: y = x @ dequant(W) for INT4 AWQ / GPTQ checkpoints as stored, and INT8.
//
// Main kernel (quant_mma_kernel): small-M, memory-bound on the weights.  The tensor cores compute the
// transposed product y^T = W^T x^T with mma.m16n8k16: the dequantized weights are the A operand (16 output
// channels x 16 k), the activations the B operand (16 k x 8 rows of x), so M = 1 wastes 7/8 of an mma that is
// cheap anyway, and M = 64 uses 8 of them per weight fragment.  The contraction over k does not care in which
// order k is summed, so each thread's k slots in the mma fragments are mapped to whatever k its packed words
// hold, and the activations are read in the same order: no repacking of AWQ or GPTQ checkpoints is needed.
//
// CTA: 256 threads = 8 warps side by side along N, 64 output channels each (512 per CTA); every warp walks the
// whole k-tile.  Weight tiles (16 KB), activation tiles, scales and zeros stream through a 4-stage cp.async
// pipeline in shared memory (swizzled or padded so that the fragment reads are bank-conflict free).  Dequant
// happens in registers: 4-bit values become fp16/bf16 by OR-ing them into the mantissa of a magic number
// (1024 for fp16, 128 for bf16), then one fma removes magic + zero point exactly and one multiplies by the scale.
// Split-K over the grid fills the GPU at M = 1; the last CTA of an output tile (counted with an atomic ticket)
// sums the fp32 partials, so the whole op is one launch.
//
// Thread (warp wn, lane = 4 g + c) owns output channels n = 64 wn + 8 g + o, o = 2 t + h (mma tile t = 0..3,
// row g + 8 h of that tile) for every format, so scales/zeros of one thread are 8 consecutive channels and
// its outputs are 16-byte stores.
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/tma.cuh"
#include "common/int4.cuh"

namespace quant {

using sc::and_or;
using sc::Bits;
using sc::fma2;
using sc::is_half;
using sc::int8_pair;

enum : int { AWQ = 0, GPTQ = 1, INT8 = 2 };
constexpr int kThreads = 256;
constexpr int kWarps = 8;
constexpr int kBN = 64 * kWarps;  // output channels per CTA
constexpr int kStages = 4;
constexpr int kWBytes = 16384;     // weight bytes per stage

template <int FMT> struct Layout {
  static constexpr int BK = FMT == INT8 ? 32 : 64;  // k per stage
  // Padding (in elements) of a staged activation row so that the fragment loads of 8 rows hit distinct banks.
  static constexpr int X_STRIDE = BK + (FMT == AWQ ? 16 : (FMT == GPTQ ? 32 : 64));
  static constexpr int SCALE_ROWS = FMT == INT8 ? 0 : 2;  // a 64-deep k-tile spans at most 2 groups (group >= 32)
  static constexpr int S_BYTES = SCALE_ROWS * kBN * 2;
  static constexpr int Z_BYTES = SCALE_ROWS * (kBN / 8) * 4;
};

template <int FMT, int MT> struct Smem {
  using L = Layout<FMT>;
  static constexpr int X_BYTES = MT * 8 * L::X_STRIDE * 2;
  static constexpr int STAGE = kWBytes + X_BYTES + L::S_BYTES + L::Z_BYTES;
  static constexpr int TOTAL = STAGE * kStages;
};

// Per-channel dequant constants of one group, as 2x16-bit words with both halves equal.
struct GroupConst {
  unsigned scale[8];
  float sf[8];      // the scales in fp32, for kernels that apply them to per-group fp32 sums
  unsigned zlo[8];  // -(magic + z): removes magic and zero point from (magic + q)
  unsigned zhi[8];  // fp16 only: -(64 + z), for nibbles read as (1024 + 16 q) and scaled by 1/16
};

// Pair P (0..3) of a packed word: the 4-bit values at bits [4P, 4P+4) and [16+4P, 16+4P+4) become (q - z) in
// the low and high half, exactly, then are scaled (one rounding, as (q - z) * s rounded to T).
// SCALED false: (q - z) only, exact small integers; the scale is applied to the fp32 sums of the group.
template <typename T, int P, bool SCALED = true>
__device__ __forceinline__ unsigned dequant_pair(unsigned v, unsigned scale, unsigned zlo, unsigned zhi) {
  unsigned r;
  if constexpr (is_half<T>::value) {
    const unsigned s = (P >= 2) ? (v >> 8) : v;
    if constexpr (P % 2 == 0) {
      r = fma2<T>(and_or(s, 0x000f000fu, 0x64006400u), Bits<T>::ONE, zlo);
    } else {
      r = fma2<T>(and_or(s, 0x00f000f0u, 0x64006400u), Bits<T>::SIXTEENTH, zhi);
    }
  } else {
    r = fma2<T>(and_or(v >> (4 * P), 0x000f000fu, 0x43004300u), Bits<T>::ONE, zlo);
  }
  if constexpr (!SCALED) return r;
  return fma2<T>(r, scale, Bits<T>::NEG_ZERO);
}

template <typename T, int FMT>
__device__ __forceinline__ void load_group(GroupConst& gc, const unsigned char* stage_s, const unsigned char* stage_z,
                                           int row, int wn, int g) {
  const uint4 sv = *reinterpret_cast<const uint4*>(stage_s + (row * kBN + 64 * wn + 8 * g) * 2);
  const unsigned zw = reinterpret_cast<const unsigned*>(stage_z)[row * (kBN / 8) + 8 * wn + g];
#pragma unroll
  for (int o = 0; o < 8; ++o) {
    const unsigned sw = sc::word(sv, o / 2);
    gc.scale[o] = __byte_perm(sw, 0u, (o & 1) ? 0x3232u : 0x1010u);
    gc.sf[o] = (o & 1) ? sc::unpack2<T>(sw).y : sc::unpack2<T>(sw).x;
    // AWQ packs channel offsets [0, 2, 4, 6, 1, 3, 5, 7] at nibbles 0..7; GPTQ in plain order, zero - 1.
    const int nib = FMT == AWQ ? ((o & 1) ? 4 + o / 2 : o / 2) : o;
    const unsigned z = ((zw >> (4 * nib)) & 15u) + (FMT == GPTQ ? 1u : 0u);
    if constexpr (is_half<T>::value) {
      gc.zlo[o] = (0xe400u | z) * 0x10001u;         // -(1024 + z)
      gc.zhi[o] = (0xd400u | (z << 4)) * 0x10001u;  // -(64 + z)
    } else {
      gc.zlo[o] = (0xc300u | z) * 0x10001u;  // -(128 + z)
      gc.zhi[o] = 0u;
    }
  }
}

// The lane's constants from a fragment-major group record (sv: the scales of its channels, zv: their zero bytes,
// GPTQ's +1 applied), o = 2 t + h for row g + 8 h of mma tile t: scales in both halves, and the zero terms
// (odd o: the nibbles fp16 reads as (1024 + 16 q) / 16).
template <typename T>
__device__ __forceinline__ void int4_group_consts(uint4 sv, uint2 zv, unsigned (&scl)[8], unsigned (&zc)[8]) {
#pragma unroll
  for (int o = 0; o < 8; ++o) {
    scl[o] = __byte_perm(sc::word(sv, o / 2), 0u, (o & 1) ? 0x3232u : 0x1010u);
    zc[o] = sc::int4_zero_term<T>(((o < 4 ? zv.x : zv.y) >> (8 * (o & 3))) & 0xffu, o & 1);
  }
}

__device__ __forceinline__ unsigned lds32(const void* p) { return *reinterpret_cast<const unsigned*>(p); }
__device__ __forceinline__ uint2 lds64(const void* p) { return *reinterpret_cast<const uint2*>(p); }
__device__ __forceinline__ uint4 lds128(const void* p) { return *reinterpret_cast<const uint4*>(p); }

// y[m, n] = sum_k x[m, k] * W[k, n] for rows [m0, m0 + 8 MT) of x and one split of the k-tiles.
//   AWQ:  qw int32 (K, N/8) packed along N;   qz int32 (K/G, N/8);      scales T (K/G, N)
//   GPTQ: qw int32 (K/8, N) packed along K;   qz int32 (ceil(K/G), N/8); scales T (ceil(K/G), N)
//   INT8: qw int8 (N, K);                     scales T (N) per channel (applied in the epilogue)
// Requires N % 64 == 0, K % 8 == 0 (INT8: K % 16 == 0), group == 32 or group % 64 == 0, 16-byte aligned rows.
// tiles_per_group = group / 64, or 0 for group 32 (two groups per k-tile).  packed != 0: qw is the tile-major
// copy made by pack_tiles_kernel (each stage one contiguous 16 KB block, already in shared-memory order).
template <typename T, int FMT, int MT>
__global__ void __launch_bounds__(kThreads, MT <= 2 ? 2 : 1) quant_mma_kernel(
    T* __restrict__ y, float* __restrict__ partial, int* __restrict__ tickets, const T* __restrict__ x,
    const void* __restrict__ qw, const int* __restrict__ qz, const T* __restrict__ scales, const T* __restrict__ bias,
    int M, int N, int K, int tiles_per_group, int num_groups, long long ldx, long long ldq, long long ldz,
    long long lds, int n_tiles, int m_chunks, int tiles_per_split, int packed) {
  using L = Layout<FMT>;
  using S = Smem<FMT, MT>;
  constexpr int BK = L::BK;
  extern __shared__ __align__(16) unsigned char smem[];

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int wn = warp;

  int bid = blockIdx.x;
  const int mc = bid % m_chunks;
  bid /= m_chunks;
  const int nt = bid % n_tiles;
  const int split = bid / n_tiles;
  const int splits = gridDim.x / (m_chunks * n_tiles);
  const int m0 = mc * MT * 8, n0 = nt * kBN;
  const int k_tiles = (K + BK - 1) / BK;
  const int kt_begin = split * tiles_per_split;
  const int kt_end = min(k_tiles, kt_begin + tiles_per_split);
  const int nk = kt_end - kt_begin;

  auto stage_w = [&](int s) { return smem + s * S::STAGE; };
  auto stage_x = [&](int s) { return reinterpret_cast<T*>(smem + s * S::STAGE + kWBytes); };
  auto stage_s = [&](int s) { return smem + s * S::STAGE + kWBytes + S::X_BYTES; };
  auto stage_z = [&](int s) { return smem + s * S::STAGE + kWBytes + S::X_BYTES + L::S_BYTES; };

  // Group bookkeeping without divisions in the loop: group 32 means two groups per k-tile (scale rows 0 and 1
  // of every stage); otherwise a new group starts every tiles_per_group k-tiles.
  const bool g32 = tiles_per_group == 0;
  const int first_mod = g32 ? 0 : kt_begin % tiles_per_group;
  int ld_mod = first_mod;
  int ld_grp = g32 ? 2 * kt_begin : kt_begin / tiles_per_group;

  // Per-thread load addresses, computed once; a k-tile advances them by a constant.
  const int* wq32 = static_cast<const int*>(qw);
  const signed char* wq8 = static_cast<const signed char*>(qw);
  const unsigned char* wpk = static_cast<const unsigned char*>(qw) + ((long long)nt * k_tiles * 1024 + tid) * 16;
  int w_dst0 = 0, w_q = 0;
  bool w_ok_n = true;
  const unsigned char* w_src = nullptr;  // stored layout: address of chunk 0 at k-tile 0
  long long w_step_i = 0, w_step_kt = 0;
  int w_row0 = 0;
  if constexpr (FMT == AWQ) {
    // 64 rows (k) x 64 words (512 channels): 16 chunks per row.  Chunk q of row k is stored at q ^ 2((k>>2)&3).
    const int row = tid >> 4, q = tid & 15;
    w_row0 = row;
    w_ok_n = n0 + 32 * q < N;
    w_dst0 = row * 256 + 16 * (q ^ (((row >> 2) & 3) << 1));  // chunk i: + 4096 i
    w_src = reinterpret_cast<const unsigned char*>(wq32 + (long long)row * ldq + n0 / 8 + 4 * q);
    w_step_i = 16 * ldq * 4;
    w_step_kt = (long long)BK * ldq * 4;
  } else if constexpr (FMT == GPTQ) {
    // 8 rows (8 k each) x 512 words: 128 chunks per row.  Chunk q of row r is stored at q ^ sw(r & 3).
    const int row = tid >> 7, q = tid & 127;
    w_row0 = row;
    w_ok_n = n0 + 4 * q < N;
    w_q = q;
    w_src = reinterpret_cast<const unsigned char*>(wq32 + (long long)row * ldq + n0 + 4 * q);
    w_step_i = 2 * ldq * 4;
    w_step_kt = 8 * ldq * 4;
  } else {
    // 512 rows (channels) x 32 bytes: unit u = 2 n + q stored at u ^ 2((n>>3)&3).
    const int n = tid >> 1, q = tid & 1;
    w_row0 = q;
    w_dst0 = 16 * ((2 * n + q) ^ (((n >> 3) & 3) << 1));  // chunk i: + 4096 i
    w_src = reinterpret_cast<const unsigned char*>(wq8 + (long long)(n0 + n) * ldq + 16 * q);
    w_step_i = 128 * ldq;
    w_step_kt = BK;
  }
  // Activations: 8 MT rows x BK elements, CPR 16-byte chunks per row (rows past M and k past K read as zeros).
  constexpr int CPR = BK / 8;
  constexpr int X_CHUNKS = MT * 8 * CPR;
  constexpr int XI = (X_CHUNKS + kThreads - 1) / kThreads;
  // Chunk i of this thread: row tid / CPR + i * (kThreads / CPR), the same column q for every i.
  const int x_row0 = tid / CPR, x_q = tid % CPR;
  const T* x_src = x + (long long)(m0 + x_row0) * ldx + 8 * x_q;
  const bool x_active = X_CHUNKS % kThreads == 0 || tid < X_CHUNKS;

  auto load_stage = [&](int s, int kt) {
    const int k0 = kt * BK;
    unsigned char* ws = stage_w(s);
    if (packed) {
      const unsigned char* src = wpk + (long long)kt * 16384;
#pragma unroll
      for (int i = 0; i < 4; ++i) sc::cp_async16(ws + 16 * (tid + i * kThreads), src + i * 4096);
    } else {
      const unsigned char* src = w_src + kt * w_step_kt;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        bool ok = w_ok_n;
        if constexpr (FMT == AWQ) ok = ok && k0 + w_row0 + 16 * i < K;
        if constexpr (FMT == GPTQ) ok = ok && 8 * (kt * 8 + w_row0 + 2 * i) < K;
        if constexpr (FMT == INT8) ok = n0 + (tid >> 1) + 128 * i < N && k0 + 16 * w_row0 < K;
        int dst = w_dst0 + 4096 * i;
        if constexpr (FMT == GPTQ) {
          const int r = w_row0 + 2 * i;
          dst = r * 2048 + 16 * (w_q ^ ((r & 1) | ((r & 2) << 1)));
        }
        sc::cp_async16(ws + dst, ok ? src + i * w_step_i : static_cast<const unsigned char*>(qw), ok);
      }
    }
    {
      unsigned char* xs = reinterpret_cast<unsigned char*>(stage_x(s));
#pragma unroll
      for (int i = 0; i < XI; ++i) {
        if (i < XI - 1 || x_active) {
          const int row = x_row0 + i * (kThreads / CPR);
          const bool ok = m0 + row < M && k0 + 8 * x_q < K;
          sc::cp_async16(xs + (row * L::X_STRIDE + 8 * x_q) * (int)sizeof(T),
                         ok ? x_src + (long long)i * (kThreads / CPR) * ldx + k0 : x, ok);
        }
      }
    }
    if constexpr (FMT != INT8) {
      const bool first = kt == kt_begin;
      if (g32 || first || ld_mod == 0) {
        // rows x (64 scale chunks + 16 zero chunks)
        if (tid < (g32 ? 2 : 1) * 80) {
          const int row = tid / 80, q = tid % 80;
          const int grp = ld_grp + row;
          if (q < 64) {
            const bool ok = grp < num_groups && n0 + 8 * q < N;
            const T* gp = ok ? scales + (long long)grp * lds + n0 + 8 * q : scales;
            sc::cp_async16(stage_s(s) + row * kBN * 2 + 16 * q, gp, ok);
          } else {
            const int qq = q - 64;
            const bool ok = grp < num_groups && n0 + 32 * qq < N;
            const int* gp = ok ? qz + (long long)grp * ldz + n0 / 8 + 4 * qq : qz;
            sc::cp_async16(stage_z(s) + row * (kBN / 8) * 4 + 16 * qq, gp, ok);
          }
        }
      }
      if (g32) {
        ld_grp += 2;
      } else if (++ld_mod == tiles_per_group) {
        ld_mod = 0;
        ++ld_grp;
      }
    }
  };

  float acc[MT][4][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int t = 0; t < 4; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][t][j] = 0.f;

  GroupConst gc;
  int cmp_mod = first_mod;
  // M <= 8: keep (q - z) * x sums of the current group in fp32 and scale them once per group (saves one
  // multiply per weight pair); wider tiles have no registers for a second accumulator set.
  constexpr bool FS = FMT != INT8 && MT == 1;
  float accg[FS ? MT : 1][4][4];
#pragma unroll
  for (int i = 0; i < (FS ? MT : 1); ++i)
#pragma unroll
    for (int t = 0; t < 4; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) accg[i][t][j] = 0.f;
  bool have_group = false;
  auto flush_group = [&]() {
    if constexpr (FS) {
      if (have_group) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int t = 0; t < 4; ++t)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              acc[mt][t][j] = fmaf(gc.sf[2 * t + (j >> 1)], accg[mt][t][j], acc[mt][t][j]);
              accg[mt][t][j] = 0.f;
            }
      }
    }
    have_group = true;
  };
  // Warps whose 64 channels lie past N skip the math (their loads are predicated off anyway).
  const bool warp_active = n0 + 64 * wn < N;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) load_stage(s, kt_begin + s);
    sc::cp_async_commit();
  }

  for (int i = 0; i < nk; ++i) {
    sc::cp_async_wait<kStages - 2>();
    __syncthreads();
    {
      const int nxt = i + kStages - 1;
      if (nxt < nk) load_stage(nxt % kStages, kt_begin + nxt);
      sc::cp_async_commit();
    }
    const bool new_group = g32 || i == 0 || cmp_mod == 0;
    if (!g32 && ++cmp_mod == tiles_per_group) cmp_mod = 0;
    if (!warp_active) continue;
    const int s = i % kStages;
    const unsigned char* ws = stage_w(s);
    const T* xs = stage_x(s);

    if constexpr (FMT == AWQ) {
#pragma unroll
      for (int step = 0; step < 4; ++step) {
        if ((step == 0 && new_group) || (step == 2 && g32)) {
          flush_group();
          load_group<T, AWQ>(gc, stage_s(s), stage_z(s), step / 2, wn, g);
        }
        unsigned w[4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const int row = 16 * step + 4 * c + kk;
          w[kk] = lds32(ws + row * 256 + 16 * ((2 * wn + (g >> 2)) ^ (2 * c)) + 4 * (g & 3));
        }
        // Words of k rows 4c..4c+3, 8 channels each.  Byte-permute so that each 32-bit word holds one
        // channel's nibbles for two consecutive k (low half: first k), as an A-fragment register wants.
        const unsigned lo01 = __byte_perm(w[0], w[1], 0x5410), hi01 = __byte_perm(w[0], w[1], 0x7632);
        const unsigned lo23 = __byte_perm(w[2], w[3], 0x5410), hi23 = __byte_perm(w[2], w[3], 0x7632);
        unsigned a[4][4];
#define SC_AWQ_TILE(t)                                                                          \
  a[t][0] = dequant_pair<T, t, !FS>(lo01, gc.scale[2 * t], gc.zlo[2 * t], gc.zhi[2 * t]);             \
  a[t][1] = dequant_pair<T, t, !FS>(hi01, gc.scale[2 * t + 1], gc.zlo[2 * t + 1], gc.zhi[2 * t + 1]); \
  a[t][2] = dequant_pair<T, t, !FS>(lo23, gc.scale[2 * t], gc.zlo[2 * t], gc.zhi[2 * t]);             \
  a[t][3] = dequant_pair<T, t, !FS>(hi23, gc.scale[2 * t + 1], gc.zlo[2 * t + 1], gc.zhi[2 * t + 1]);
        SC_AWQ_TILE(0)
        SC_AWQ_TILE(1)
        SC_AWQ_TILE(2)
        SC_AWQ_TILE(3)
#undef SC_AWQ_TILE
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint2 xv = lds64(xs + (mt * 8 + g) * L::X_STRIDE + 16 * step + 4 * c);
          const unsigned b[2] = {xv.x, xv.y};
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            if constexpr (FS) sc::mma_16816<T>(accg[mt][t], a[t], b);
            else sc::mma_16816<T>(acc[mt][t], a[t], b);
          }
        }
      }
    } else if constexpr (FMT == GPTQ) {
#pragma unroll
      for (int pp = 0; pp < 2; ++pp) {
        if ((pp == 0 && new_group) || (pp == 1 && g32)) {
          flush_group();
          load_group<T, GPTQ>(gc, stage_s(s), stage_z(s), pp, wn, g);
        }
        // Row r = 4 pp + c holds k = 8 r .. 8 r + 7 of 512 channels; this thread's 8 channels are 2 chunks.
        const int row = 4 * pp + c;
        const int swz = (c & 1) | ((c & 2) << 1);
        const int q = 16 * wn + 2 * g;
        const uint4 w0 = lds128(ws + row * 2048 + 16 * (q ^ swz));
        const uint4 w1 = lds128(ws + row * 2048 + 16 * ((q + 1) ^ swz));
        const unsigned w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
        unsigned xw[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint4 xv = lds128(xs + (mt * 8 + g) * L::X_STRIDE + 32 * pp + 8 * c);
          xw[mt][0] = xv.x; xw[mt][1] = xv.y; xw[mt][2] = xv.z; xw[mt][3] = xv.w;
        }
        // mma step s uses nibble pairs (2s, 2s+4) and (2s+1, 2s+5) of each word, i.e. k offsets
        // {2s, 2s+4} and {2s+1, 2s+5}; the activations are permuted to match.
#define SC_GPTQ_STEP(st)                                                                                        \
  {                                                                                                            \
    unsigned a[4][4];                                                                                          \
    _Pragma("unroll") for (int t = 0; t < 4; ++t) {                                                            \
      a[t][0] = dequant_pair<T, 2 * st, !FS>(w[2 * t], gc.scale[2 * t], gc.zlo[2 * t], gc.zhi[2 * t]);           \
      a[t][1] = dequant_pair<T, 2 * st, !FS>(w[2 * t + 1], gc.scale[2 * t + 1], gc.zlo[2 * t + 1],             \
                                             gc.zhi[2 * t + 1]);                                               \
      a[t][2] = dequant_pair<T, 2 * st + 1, !FS>(w[2 * t], gc.scale[2 * t], gc.zlo[2 * t], gc.zhi[2 * t]);       \
      a[t][3] = dequant_pair<T, 2 * st + 1, !FS>(w[2 * t + 1], gc.scale[2 * t + 1], gc.zlo[2 * t + 1],         \
                                                 gc.zhi[2 * t + 1]);                                           \
    }                                                                                                          \
    _Pragma("unroll") for (int mt = 0; mt < MT; ++mt) {                                                        \
      const unsigned b[2] = {__byte_perm(xw[mt][st], xw[mt][st + 2], 0x5410),                                  \
                             __byte_perm(xw[mt][st], xw[mt][st + 2], 0x7632)};                                 \
      _Pragma("unroll") for (int t = 0; t < 4; ++t) {                                    \
        if constexpr (FS) sc::mma_16816<T>(accg[mt][t], a[t], b);                                             \
        else sc::mma_16816<T>(acc[mt][t], a[t], b);                                                          \
      }                                                                                                      \
    }                                                                                                          \
  }
        SC_GPTQ_STEP(0)
        SC_GPTQ_STEP(1)
#undef SC_GPTQ_STEP
      }
    } else {
      // INT8: channel rows n = 64 wn + 8 g + o, bytes 8c .. 8c+7 of the 32-deep k-tile.
      uint2 w[8];
#pragma unroll
      for (int o = 0; o < 8; ++o) {
        const int n = 64 * wn + 8 * g + o;
        const int u = (2 * n + (c >> 1)) ^ (((n >> 3) & 3) << 1);
        w[o] = lds64(ws + 16 * u + 8 * (c & 1));
      }
      unsigned xw[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint4 xv = lds128(xs + (mt * 8 + g) * L::X_STRIDE + 8 * c);
        xw[mt][0] = xv.x; xw[mt][1] = xv.y; xw[mt][2] = xv.z; xw[mt][3] = xv.w;
      }
#pragma unroll
      for (int st = 0; st < 2; ++st) {
        unsigned a[4][4];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const unsigned u0 = st ? w[2 * t].y : w[2 * t].x;
          const unsigned u1 = st ? w[2 * t + 1].y : w[2 * t + 1].x;
          a[t][0] = int8_pair<T, 0x4140u>(u0);
          a[t][1] = int8_pair<T, 0x4140u>(u1);
          a[t][2] = int8_pair<T, 0x4342u>(u0);
          a[t][3] = int8_pair<T, 0x4342u>(u1);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const unsigned b[2] = {xw[mt][2 * st], xw[mt][2 * st + 1]};
#pragma unroll
          for (int t = 0; t < 4; ++t) sc::mma_16816<T>(acc[mt][t], a[t], b);
        }
      }
    }
  }
  sc::cp_async_wait<0>();
  flush_group();

  // Epilogue.  acc[mt][t][2h + e] is (channel n0 + 64 wn + 8 g + 2t + h, row m0 + 8 mt + 2c + e).
  const int nb = n0 + 64 * wn + 8 * g;
  const bool n_ok = warp_active;  // N % 64 == 0: a warp's channels are all in range or all out
  auto finish = [&](const float* v, int n, float* out8) {
#pragma unroll
    for (int o = 0; o < 8; ++o) {
      float f = v[o];
      if constexpr (FMT == INT8) f *= sc::to_float(scales[n + o]);
      if (bias != nullptr) f += sc::to_float(bias[n + o]);
      out8[o] = f;
    }
  };
  const int splits_total = splits;
  if (splits_total == 1) {
    if (!n_ok) return;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = m0 + mt * 8 + 2 * c + e;
        if (m < M) {
          float v[8], f[8];
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            v[2 * t] = acc[mt][t][e];
            v[2 * t + 1] = acc[mt][t][2 + e];
          }
          finish(v, nb, f);
          *reinterpret_cast<uint4*>(y + (long long)m * N + nb) = sc::Pack16<T>::pack(f);
        }
      }
    return;
  }

  // Split-K: publish this split's fp32 partial, then the last CTA of the tile sums all of them.
  if (n_ok) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = m0 + mt * 8 + 2 * c + e;
        if (m < M) {
          float4* p = reinterpret_cast<float4*>(partial + ((long long)split * M + m) * N + nb);
          __stcg(p, make_float4(acc[mt][0][e], acc[mt][0][2 + e], acc[mt][1][e], acc[mt][1][2 + e]));
          __stcg(p + 1, make_float4(acc[mt][2][e], acc[mt][2][2 + e], acc[mt][3][e], acc[mt][3][2 + e]));
        }
      }
  }
  __threadfence();
  __syncthreads();
  __shared__ int is_last;
  const int ticket_id = mc + m_chunks * nt;
  if (tid == 0) {
    const int prev = atomicAdd(tickets + ticket_id, 1);
    is_last = prev == splits_total - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // Sum the splits: `lanes` adjacent threads share one 8-channel chunk, each summing every lanes-th split with
  // 4 independent loads in flight, then combine through shuffles (M = 1 has only 64 chunks per tile).
  const int rows = min(MT * 8, M - m0);
  const int chunks_per_row = min(kBN, N - n0) / 8;
  const int items = rows * chunks_per_row;
  int lanes = 1;
  while (lanes < 32 && 2 * lanes * items <= kThreads && 2 * lanes <= splits_total) lanes *= 2;
  for (int base = 0; base < items * lanes; base += kThreads) {
    const int id = base + tid;
    const int item = id / lanes, sub = id % lanes;
    const bool valid = item < items;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    const int m = m0 + (valid ? item / chunks_per_row : 0);
    const int n = n0 + 8 * (valid ? item % chunks_per_row : 0);
    if (valid) {
      for (int sp0 = sub; sp0 < splits_total; sp0 += 4 * lanes) {
        float4 a[4], b[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int sp = sp0 + u * lanes;
          if (sp < splits_total) {
            const float4* p = reinterpret_cast<const float4*>(partial + ((long long)sp * M + m) * N + n);
            a[u] = __ldcg(p);
            b[u] = __ldcg(p + 1);
          } else {
            a[u] = make_float4(0.f, 0.f, 0.f, 0.f);
            b[u] = a[u];
          }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          v[0] += a[u].x; v[1] += a[u].y; v[2] += a[u].z; v[3] += a[u].w;
          v[4] += b[u].x; v[5] += b[u].y; v[6] += b[u].z; v[7] += b[u].w;
        }
      }
    }
    for (int off = 1; off < lanes; off <<= 1)
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] += __shfl_xor_sync(0xffffffffu, v[j], off);
    if (valid && sub == 0) {
      float f[8];
      finish(v, n, f);
      *reinterpret_cast<uint4*>(y + (long long)m * N + n) = sc::Pack16<T>::pack(f);
    }
  }
  if (tid == 0) tickets[ticket_id] = 0;  // ready for the next launch on this stream
}

// Dense dequantization W[k, n] = (q - z) * s, rounded once to T (bit-exact with the NumPy references).
// Thread (x, y) takes 8 consecutive channels (one packed word) of DEQUANT_ROWS consecutive k rows, rows striding
// by gridDim.y: 32-bit indices from the 2-D grid (one thread per word with a 64-bit index division ran at about
// half the copy rate on the H200: 20 us for 4096^2), several independent loads and 16-byte stores per thread.
// g_idx (GPTQ, may be null) gives each k's group.
constexpr int DEQUANT_ROWS = 4;

template <typename T, int FMT>
__global__ void __launch_bounds__(256) dequant_int4_kernel(T* __restrict__ out, const int* __restrict__ qw,
                                                           const int* __restrict__ qz, const T* __restrict__ scales,
                                                           const int* __restrict__ g_idx, int K, int N, int group,
                                                           long long ldq, long long ldz, long long lds) {
  const int jn = N / 8;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= jn) return;
  for (int k0 = blockIdx.y * DEQUANT_ROWS; k0 < K; k0 += gridDim.y * DEQUANT_ROWS) {
#pragma unroll
    for (int r = 0; r < DEQUANT_ROWS; ++r) {
      const int k = k0 + r;
      if (k >= K) break;
      const int grp = g_idx != nullptr ? g_idx[k] : k / group;
      const unsigned zw = (unsigned)qz[grp * ldz + j];
      float sv[8];
      sc::Pack16<T>::unpack(*reinterpret_cast<const uint4*>(scales + grp * lds + 8 * j), sv);
      unsigned qv[8];
      if constexpr (FMT == AWQ) {
        const unsigned w = (unsigned)qw[k * ldq + j];
#pragma unroll
        for (int o = 0; o < 8; ++o) qv[o] = w >> (4 * ((o & 1) ? 4 + o / 2 : o / 2));
      } else {
        const uint4* p = reinterpret_cast<const uint4*>(qw + (k / 8) * ldq + 8 * j);
        const uint4 a = p[0], b = p[1];
        const unsigned sh = 4 * (k % 8);
        qv[0] = a.x >> sh; qv[1] = a.y >> sh; qv[2] = a.z >> sh; qv[3] = a.w >> sh;
        qv[4] = b.x >> sh; qv[5] = b.y >> sh; qv[6] = b.z >> sh; qv[7] = b.w >> sh;
      }
      float f[8];
#pragma unroll
      for (int o = 0; o < 8; ++o) {
        const unsigned z = FMT == AWQ ? (zw >> (4 * ((o & 1) ? 4 + o / 2 : o / 2))) & 15u
                                      : ((zw >> (4 * o)) & 15u) + 1u;
        f[o] = ((float)(qv[o] & 15u) - (float)z) * sv[o];
      }
      *reinterpret_cast<uint4*>(out + (long long)k * N + 8 * j) = sc::Pack16<T>::pack(f);
    }
  }
}

// Dense INT8 dequantization W[n, k] = q * s[n], rounded once to T (the product is exact in float32).  One thread
// per (n, 16 consecutive k): one 16-byte load, two 16-byte stores.  (torch's int8 -> bfloat16 conversion ran at
// ~0.6 TB/s on the H200: 171 us for 8192 x 8192, three times this kernel's work at copy speed.)
template <typename T>
__global__ void __launch_bounds__(256) dequant_int8_kernel(T* __restrict__ out, const signed char* __restrict__ w,
                                                           const T* __restrict__ scales, int N, int K,
                                                           long long ldw) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int jk = K / 16;
  if (idx >= (long long)N * jk) return;
  const int n = (int)(idx / jk), j = (int)(idx % jk);
  const uint4 q = __ldcs(reinterpret_cast<const uint4*>(w + (long long)n * ldw + 16 * j));
  const float s = sc::to_float<T>(scales[n]);
  float f[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) f[i] = (float)(signed char)(sc::word(q, i / 4) >> (8 * (i % 4))) * s;
  uint4* o = reinterpret_cast<uint4*>(out + (long long)n * K + 16 * j);
  o[0] = sc::Pack16<T>::pack(f);
  o[1] = sc::Pack16<T>::pack(f + 8);
}

// out[m, k] = x[m, perm[k]]: activations in the k order of an act-order GPTQ weight repacked by g_idx.
template <typename T>
__global__ void __launch_bounds__(256) gather_columns_kernel(T* __restrict__ out, const T* __restrict__ x,
                                                             const int* __restrict__ perm, int M, int K,
                                                             long long ldx) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)M * K) return;
  const int m = (int)(idx / K), k = (int)(idx % K);
  out[idx] = x[(long long)m * ldx + perm[k]];
}

// GPTQ qweight rows permuted along k: out nibble k = in nibble perm[k] (both packed 8 per int32 along k).
__global__ void __launch_bounds__(256) gptq_permute_k_kernel(int* __restrict__ out, const int* __restrict__ qw,
                                                             const int* __restrict__ perm, int K, int N,
                                                             long long ldq) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)(K / 8) * N) return;
  const int r = (int)(idx / N), n = (int)(idx % N);
  unsigned word = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int src = perm[8 * r + i];
    const unsigned q = ((unsigned)qw[(long long)(src / 8) * ldq + n] >> (4 * (src % 8))) & 15u;
    word |= q << (4 * i);
  }
  out[idx] = (int)word;
}

// Tile-major copy of a weight for quant_mma_kernel: tile (nt, kt) becomes 16 KB at ((nt * k_tiles + kt) * 1024)
// 16-byte chunks, each chunk placed where the kernel's stored-layout loader would put it in shared memory, so
// a stage is one contiguous, linear copy.  Out-of-range rows/channels become zeros.
template <int FMT>
__global__ void __launch_bounds__(256) pack_tiles_kernel(uint4* __restrict__ out, const void* __restrict__ qw, int K,
                                                         int N, long long ldq, int k_tiles, long long total) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const long long tile = idx >> 10;
  const int id = (int)(idx & 1023);
  const int nt = (int)(tile / k_tiles), kt = (int)(tile % k_tiles);
  const unsigned char* src = nullptr;
  if constexpr (FMT == AWQ) {
    const int row = id >> 4, q = (id & 15) ^ (((row >> 2) & 3) << 1);
    if (kt * 64 + row < K && nt * kBN + 32 * q < N)
      src = reinterpret_cast<const unsigned char*>(static_cast<const int*>(qw) + (long long)(kt * 64 + row) * ldq +
                                                   nt * (kBN / 8) + 4 * q);
  } else if constexpr (FMT == GPTQ) {
    const int row = id >> 7, q = (id & 127) ^ ((row & 1) | ((row & 2) << 1));
    if (8 * (kt * 8 + row) < K && nt * kBN + 4 * q < N)
      src = reinterpret_cast<const unsigned char*>(static_cast<const int*>(qw) + (long long)(kt * 8 + row) * ldq +
                                                   nt * kBN + 4 * q);
  } else {
    const int u = id ^ (((id >> 4) & 3) << 1);
    const int n = u >> 1, q = u & 1;
    if (nt * kBN + n < N && kt * 32 + 16 * q < K)
      src = static_cast<const unsigned char*>(qw) + (long long)(nt * kBN + n) * ldq + kt * 32 + 16 * q;
  }
  out[idx] = src != nullptr ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
}


// ============================================================================================================
// Small-M streaming kernel (gemv_kernel, M <= 16) on the fragment-major layout made by the gemv_pack_* kernels.
//
// Layout (prepacked once): the weight is cut into blocks of BN output channels (64 for INT4, 32 for INT8) and
// steps of 32 k.  Step (b, s) is 1024 contiguous bytes, two halves of 512 (16 k each): 16 bytes per lane of a
// warp, exactly the A fragments of the lane's mma.m16n8k16 tiles (INT4: 4 tiles, one 32-bit word each; INT8:
// 2 tiles, two words each).  The contraction does not care which k an mma slot holds, so the slots 2c, 2c+1,
// 2c+8, 2c+9 of lane 4g+c hold k = 4c .. 4c+3 of the 16: the lane's activations are 8 contiguous bytes.  An
// INT4 word holds, at nibbles (0,4) (1,5) (2,6) (3,7), the k pairs (4c, 4c+1) and (4c+2, 4c+3) of channels g
// (nibbles 0, 2, 4, 6) and g + 8 (nibbles 1, 3, 5, 7), so the magic-number conversions produce a0..a3 directly.
// INT4 group records: per (block, group) 192 bytes, 8 x 16 bytes of scales (lane group g: channels
// 16 t + g + 8 h at o = 2 t + h), then 8 x 8 bytes of zero points (one byte per channel, GPTQ's +1 included).
//
// Schedule: a persistent grid of P CTAs (2 per SM) splits the NB x KS steps evenly (stream-K): CTA c owns steps
// [c U / P, (c + 1) U / P) of the block-major order, i.e. one to a few block segments, and each of its 8 warps
// takes a contiguous eighth of every segment.  A warp streams its steps through its own ring of D cp.async
// stages (D x 1 KB of weights in flight per warp, 16 warps per SM); the ring runs on across segment ends, so the
// next segment's loads are in flight while the CTA reduces the previous one through shared memory.  A block
// that one CTA covers entirely is written directly; otherwise its CTAs add fp32 partials into a zeroed
// workspace, and the one that completes the block's step count (an atomic ticket) writes y and re-zeroes both.
enum : int { KIND_INT4 = 0, KIND_INT8 = 1 };
constexpr int kGemvWarps = 8;

template <int KIND, int MT> struct Gemv {
  static constexpr int NT = KIND == KIND_INT4 ? 4 : 2;  // mma tiles (16 channels) per block
  static constexpr int BN = 16 * NT;
  static constexpr int D = KIND == KIND_INT4 ? (MT == 1 ? 7 : 5) : (MT == 1 ? 8 : 6);  // ring stages
  static constexpr int W_SLOT = 1024;
  static constexpr int X_SLOT = 512 * MT;
  static constexpr int G_SLOT = KIND == KIND_INT4 ? 192 : 0;
  static constexpr int WARP_BYTES = D * (W_SLOT + X_SLOT + G_SLOT);
  static constexpr int RED_STRIDE = BN + 4;  // padded rows: the fragment-order writes hit distinct banks
  static constexpr int RED_BYTES = kGemvWarps * 8 * RED_STRIDE * 4;
  static constexpr int SMEM = kGemvWarps * WARP_BYTES + RED_BYTES;
};

// cp.async with 32-bit shared addresses (computed once per slot, not converted per copy).
__device__ __forceinline__ void cp16_s(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp8_s(unsigned dst, const void* src, unsigned src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ uint4 lds128_s(unsigned a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ uint2 lds64_s(unsigned a) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(a));
  return v;
}

// Two CTAs per SM need 2 x ~110 KB of shared memory: Hopper has it, sm_80-class parts (164 KB) run one.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define SC_GEMV_MIN_CTAS 1
#else
#define SC_GEMV_MIN_CTAS 2
#endif

template <typename T, int KIND, int MT>
__global__ void __launch_bounds__(kGemvWarps * 32, SC_GEMV_MIN_CTAS) gemv_kernel(
    T* __restrict__ y, float* __restrict__ ws, int* __restrict__ tickets, const T* __restrict__ x,
    const uint4* __restrict__ wpk, const unsigned char* __restrict__ grec, const T* __restrict__ scales,
    const T* __restrict__ bias, int M, int N, int KS, int NB, int SPG, int NG, long long ldx) {
  using C = Gemv<KIND, MT>;
  constexpr int D = C::D, NT = C::NT, BN = C::BN;
  constexpr bool INT4 = KIND == KIND_INT4;
  // M <= 8 INT4: feed (magic + q) to the mma as is and remove magic + zero point once per group, through
  // sum_k x (one extra mma per 16 k with an all-ones A): no per-weight subtraction.  M <= 16 keeps per-weight
  // (q - z) (no registers for the extra accumulators).
  constexpr bool XSUM = INT4 && MT == 1;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_last;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const unsigned ring_w = sc::smem_addr(smem) + warp * C::WARP_BYTES;
  const unsigned ring_x = ring_w + D * C::W_SLOT;
  const unsigned ring_g = ring_x + D * C::X_SLOT;
  float* red = reinterpret_cast<float*>(smem + kGemvWarps * C::WARP_BYTES);

  const long long U = (long long)NB * KS;
  const long long u0 = U * blockIdx.x / gridDim.x, u1 = U * (blockIdx.x + 1) / gridDim.x;
  if (u0 >= u1) return;
  const int b_first = (int)(u0 / KS), b_last = (int)((u1 - 1) / KS);
  // This CTA's segment of block b is [s0, s1); this warp's piece of it [lo, hi).
  auto segment = [&](int b, int& s0, int& s1) {
    const long long base = (long long)b * KS;
    s0 = (int)(max(u0, base) - base);
    s1 = (int)(min(u1, base + KS) - base);
  };
  auto piece = [&](int b, int& lo, int& hi) {
    int s0, s1;
    segment(b, s0, s1);
    lo = s0 + (warp * (s1 - s0)) / kGemvWarps;
    hi = s0 + ((warp + 1) * (s1 - s0)) / kGemvWarps;
  };

  // Loader: running source pointers of the next step to copy, steps left in the current piece, position in
  // the current group.  Everything per step is an add; a new piece (rare) recomputes them.
  const unsigned char* lw = nullptr;
  const unsigned char* lx = nullptr;
  const unsigned char* lg = nullptr;
  int lb = b_first - 1, lrem = 0, lgpos = 0, lslot = 0;
  bool lfirst = false;
  // Rows of x past M read as zeros (src-size 0) from a valid address (row 0).
  const long long x_row_bytes = ldx * (long long)sizeof(T);
  const unsigned char* x_lane = reinterpret_cast<const unsigned char*>(x) + 8 * c;
  unsigned x_bytes[MT];
  long long x_off[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const bool ok = 8 * mt + g < M;
    x_bytes[mt] = ok ? 8u : 0u;
    x_off[mt] = ok ? (8 * mt + g) * x_row_bytes : 0;
  }
  auto next_piece = [&]() {
    while (lrem == 0 && lb < b_last) {
      ++lb;
      int lo, hi;
      piece(lb, lo, hi);
      lrem = hi - lo;
      const int grp = lo / SPG;
      lgpos = lo - grp * SPG;
      lfirst = true;
      lw = reinterpret_cast<const unsigned char*>(wpk + ((long long)lb * KS + lo) * 64 + lane);
      lx = x_lane + 64LL * lo;
      lg = grec + ((long long)lb * NG + grp) * 192 + lane * 16;
    }
  };
  next_piece();
  auto issue = [&]() {
    if (lrem > 0) {
      const unsigned dw = ring_w + lslot * C::W_SLOT + lane * 16;
      cp16_s(dw, lw);
      cp16_s(dw + 512, lw + 512);
      const unsigned dx = ring_x + lslot * C::X_SLOT + lane * 8;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) cp8_s(dx + (h * MT + mt) * 256, lx + x_off[mt] + 32 * h, x_bytes[mt]);
      if constexpr (INT4) {
        if ((lfirst || lgpos == 0) && lane < 12) cp16_s(ring_g + lslot * C::G_SLOT + lane * 16, lg);
        if (++lgpos == SPG) {
          lgpos = 0;
          lg += 192;
        }
      }
      lfirst = false;
      lw += 1024;
      lx += 64;
      if (--lrem == 0) next_piece();
    }
    sc::cp_async_commit();
    if (++lslot == D) lslot = 0;
  };
#pragma unroll 1
  for (int i = 0; i < D - 1; ++i) issue();

  float acc[MT][NT][4];
  float accg[INT4 ? MT : 1][NT][4];
  float xs[XSUM ? MT : 1][2];
  float sf[8], zf[8];
  unsigned zc[8];
#pragma unroll
  for (int o = 0; o < 8; ++o) {
    sf[o] = 0.f;
    zf[o] = 0.f;
    zc[o] = 0u;
  }
#pragma unroll
  for (int mt = 0; mt < (INT4 ? MT : 1); ++mt)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) accg[mt][t][j] = 0.f;
#pragma unroll
  for (int mt = 0; mt < (XSUM ? MT : 1); ++mt) xs[mt][0] = xs[mt][1] = 0.f;
  auto flush = [&]() {
    if constexpr (INT4) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float v = accg[mt][t][j];
            if constexpr (XSUM) v = fmaf(-zf[2 * t + (j >> 1)], xs[mt][j & 1], v);
            acc[mt][t][j] = fmaf(sf[2 * t + (j >> 1)], v, acc[mt][t][j]);
            accg[mt][t][j] = 0.f;
          }
      if constexpr (XSUM) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) xs[mt][0] = xs[mt][1] = 0.f;
      }
    }
  };
  auto store_y = [&](int row, int n, float v) {
    if constexpr (!INT4) v *= sc::to_float(scales[n]);
    if (bias != nullptr) v += sc::to_float(bias[n]);
    y[(long long)row * N + n] = sc::from_float<T>(v);
  };
  constexpr unsigned MAGIC = sc::int4_magic<T>;
  // fp16 high nibbles come out as 1024 + 16 q: (.) / 16 + 960 = 1024 + q; no-XSUM: (.) / 16 - (64 + z).
  const unsigned mask_lo = 0x000f000fu, mask_hi = 0x00f000f0u, magic = MAGIC;
  const unsigned ones[4] = {Bits<T>::ONE, Bits<T>::ONE, Bits<T>::ONE, Bits<T>::ONE};

  int cslot = 0;
  for (int b = b_first; b <= b_last; ++b) {
    int lo, hi;
    piece(b, lo, hi);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[mt][t][j] = 0.f;
    int gleft = 0;
    for (int s = lo; s < hi; ++s) {
      __syncwarp();  // every lane is done reading the slot the next issue overwrites
      issue();
      sc::cp_async_wait<D - 1>();
      __syncwarp();  // the group record was copied by lanes 0..11: make it visible to all
      if constexpr (INT4) {
        if (s == lo || gleft == 0) {
          flush();
          gleft = s == lo ? SPG - lo % SPG : SPG;
          const unsigned gr = ring_g + cslot * C::G_SLOT;
          const uint4 sv = lds128_s(gr + 16 * g);
          const uint2 zv = lds64_s(gr + 128 + 8 * g);
#pragma unroll
          for (int o = 0; o < 8; ++o) {
            const float2 f = sc::unpack2<T>(sc::word(sv, o / 2));
            sf[o] = (o & 1) ? f.y : f.x;
            const unsigned z = ((o < 4 ? zv.x : zv.y) >> (8 * (o & 3))) & 0xffu;
            if constexpr (XSUM) {
              zf[o] = (float)z + (is_half<T>::value ? 1024.f : 128.f);
            } else {
              zc[o] = sc::int4_zero_term<T>(z, o & 1);  // channel g + 8 (odd o) is read as (1024 + 16 q) / 16
            }
          }
        }
        --gleft;
      }
      const unsigned wbase = ring_w + cslot * C::W_SLOT + lane * 16;
      const unsigned xbase = ring_x + cslot * C::X_SLOT + lane * 8;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 wv = lds128_s(wbase + h * 512);
        unsigned bx[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint2 xv = lds64_s(xbase + (h * MT + mt) * 256);
          bx[mt][0] = xv.x;
          bx[mt][1] = xv.y;
        }
        if constexpr (INT4) {
          if constexpr (XSUM) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              float d[4] = {xs[mt][0], xs[mt][1], 0.f, 0.f};
              sc::mma_16816<T>(d, ones, bx[mt]);
              xs[mt][0] = d[0];
              xs[mt][1] = d[1];
            }
          }
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const unsigned wd = sc::word(wv, t);
            unsigned a[4];
            if constexpr (is_half<T>::value) {
              const unsigned w8 = wd >> 8;
              const unsigned p0 = and_or(wd, mask_lo, magic), p1 = and_or(wd, mask_hi, magic);
              const unsigned p2 = and_or(w8, mask_lo, magic), p3 = and_or(w8, mask_hi, magic);
              if constexpr (XSUM) {
                a[0] = p0;
                a[1] = fma2<T>(p1, Bits<T>::SIXTEENTH, 0x63806380u);  // + 960
                a[2] = p2;
                a[3] = fma2<T>(p3, Bits<T>::SIXTEENTH, 0x63806380u);
              } else {
                a[0] = fma2<T>(p0, Bits<T>::ONE, zc[2 * t]);
                a[1] = fma2<T>(p1, Bits<T>::SIXTEENTH, zc[2 * t + 1]);
                a[2] = fma2<T>(p2, Bits<T>::ONE, zc[2 * t]);
                a[3] = fma2<T>(p3, Bits<T>::SIXTEENTH, zc[2 * t + 1]);
              }
            } else {
              const unsigned p0 = and_or(wd, mask_lo, magic), p1 = and_or(wd >> 4, mask_lo, magic);
              const unsigned p2 = and_or(wd >> 8, mask_lo, magic), p3 = and_or(wd >> 12, mask_lo, magic);
              if constexpr (XSUM) {
                a[0] = p0;
                a[1] = p1;
                a[2] = p2;
                a[3] = p3;
              } else {
                a[0] = fma2<T>(p0, Bits<T>::ONE, zc[2 * t]);
                a[1] = fma2<T>(p1, Bits<T>::ONE, zc[2 * t + 1]);
                a[2] = fma2<T>(p2, Bits<T>::ONE, zc[2 * t]);
                a[3] = fma2<T>(p3, Bits<T>::ONE, zc[2 * t + 1]);
              }
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) sc::mma_16816<T>(accg[mt][t], a, bx[mt]);
          }
        } else {
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const unsigned u0w = sc::word(wv, 2 * t), u1w = sc::word(wv, 2 * t + 1);
            const unsigned a[4] = {int8_pair<T, 0x4140u>(u0w), int8_pair<T, 0x4342u>(u0w),
                                   int8_pair<T, 0x4140u>(u1w), int8_pair<T, 0x4342u>(u1w)};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) sc::mma_16816<T>(acc[mt][t], a, bx[mt]);
          }
        }
      }
      if (++cslot == D) cslot = 0;
    }
    flush();

    // Reduce the 8 warps' partials of this segment (8 rows of x at a time), then store or accumulate.
    int s0, s1;
    segment(b, s0, s1);
    const bool full = s0 == 0 && s1 == KS;
    const int n0 = b * BN;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (8 * mt < M) {
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int j = 0; j < 4; ++j)
            red[(warp * 8 + 2 * c + (j & 1)) * C::RED_STRIDE + 16 * t + g + 8 * (j >> 1)] = acc[mt][t][j];
        __syncthreads();
        for (int item = threadIdx.x; item < 8 * BN; item += kGemvWarps * 32) {
          const int r = item / BN, ch = item % BN, row = 8 * mt + r;
          if (row < M) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < kGemvWarps; ++w) v += red[(w * 8 + r) * C::RED_STRIDE + ch];
            if (full) store_y(row, n0 + ch, v);
            else atomicAdd(ws + (long long)row * N + n0 + ch, v);
          }
        }
        __syncthreads();
      }
    }
    if (!full) {
      __threadfence();  // this thread's partial sums are visible before the ticket counts them
      __syncthreads();
      if (tid == 0) {
        const int prev = atomicAdd(tickets + b, s1 - s0);
        s_last = prev + (s1 - s0) == KS;
      }
      __syncthreads();
      if (s_last) {
        __threadfence();
        for (int item = threadIdx.x; item < M * BN; item += kGemvWarps * 32) {
          const int row = item / BN, ch = item % BN;
          float* p = ws + (long long)row * N + n0 + ch;
          const float v = __ldcg(p);
          __stcg(p, 0.f);  // the workspace stays zero between launches
          store_y(row, n0 + ch, v);
        }
        if (tid == 0) tickets[b] = 0;
      }
    }
  }
  sc::cp_async_wait<0>();
}

// Fragment-major INT4 copy for gemv_kernel: one 32-bit word per thread.  Word (b, s, h, lane, t) holds the 8
// nibbles of channels n = 64 b + 16 t + g (+ 8) at k = 32 s + 16 h + 4 c + (0..3), in the order described above.
template <int FMT>
__global__ void __launch_bounds__(256) gemv_pack_int4_kernel(unsigned* __restrict__ out, const int* __restrict__ qw,
                                                             int KS, long long ldq, long long total) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int t = (int)(idx & 3), lane = (int)((idx >> 2) & 31), h = (int)((idx >> 7) & 1);
  const long long rest = idx >> 8;
  const int s = (int)(rest % KS), b = (int)(rest / KS);
  const int g = lane >> 2, c = lane & 3;
  const int n_base = 64 * b + 16 * t + g, k_base = 32 * s + 16 * h + 4 * c;
  unsigned word = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int k = k_base + ((i >> 2) & 1) + ((i & 2) ? 2 : 0);
    const int n = n_base + 8 * (i & 1);
    unsigned q;
    if constexpr (FMT == AWQ) {
      const int o = n & 7;
      const int pos = (o & 1) ? 4 + (o >> 1) : (o >> 1);
      q = ((unsigned)qw[(long long)k * ldq + (n >> 3)] >> (4 * pos)) & 15u;
    } else {
      q = ((unsigned)qw[(long long)(k >> 3) * ldq + n] >> (4 * (k & 7))) & 15u;
    }
    word |= q << (4 * i);
  }
  out[idx] = word;
}

// INT4 group records for gemv_kernel: one thread per (block, group, lane group g): 8 scales (raw 16-bit) and
// 8 zero-point bytes of channels 64 b + 16 t + g + 8 h, o = 2 t + h.
template <int FMT>
__global__ void __launch_bounds__(256) gemv_pack_groups_kernel(unsigned char* __restrict__ out,
                                                               const int* __restrict__ qz,
                                                               const unsigned short* __restrict__ scales, int NG,
                                                               long long ldz, long long lds, long long total) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int g = (int)(idx & 7);
  const long long rest = idx >> 3;
  const int grp = (int)(rest % NG), b = (int)(rest / NG);
  unsigned short sv[8];
  unsigned zb[2] = {0u, 0u};
#pragma unroll
  for (int o = 0; o < 8; ++o) {
    const int n = 64 * b + 16 * (o >> 1) + g + 8 * (o & 1);
    sv[o] = scales[(long long)grp * lds + n];
    const unsigned zw = (unsigned)qz[(long long)grp * ldz + (n >> 3)];
    unsigned z;
    if constexpr (FMT == AWQ) {
      const int on = n & 7;
      z = (zw >> (4 * ((on & 1) ? 4 + (on >> 1) : (on >> 1)))) & 15u;
    } else {
      z = ((zw >> (4 * (n & 7))) & 15u) + 1u;
    }
    zb[o >> 2] |= z << (8 * (o & 3));
  }
  unsigned char* rec = out + ((long long)b * NG + grp) * 192;
  uint4 s4;
  s4.x = sv[0] | ((unsigned)sv[1] << 16);
  s4.y = sv[2] | ((unsigned)sv[3] << 16);
  s4.z = sv[4] | ((unsigned)sv[5] << 16);
  s4.w = sv[6] | ((unsigned)sv[7] << 16);
  *reinterpret_cast<uint4*>(rec + 16 * g) = s4;
  *reinterpret_cast<uint2*>(rec + 128 + 8 * g) = make_uint2(zb[0], zb[1]);
}

// Fragment-major INT8 copy for gemv_kernel: word (b, s, h, lane, j) with t = j / 2, p = j % 2 holds the bytes
// [W(g, k), W(g, k + 1), W(g + 8, k), W(g + 8, k + 1)] of channels 32 b + 16 t + g, k = 32 s + 16 h + 4 c + 2 p.
__global__ void __launch_bounds__(256) gemv_pack_int8_kernel(unsigned* __restrict__ out,
                                                             const unsigned char* __restrict__ w, int KS,
                                                             long long ldw, long long total) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int j = (int)(idx & 3), lane = (int)((idx >> 2) & 31), h = (int)((idx >> 7) & 1);
  const long long rest = idx >> 8;
  const int s = (int)(rest % KS), b = (int)(rest / KS);
  const int g = lane >> 2, c = lane & 3;
  const int n = 32 * b + 16 * (j >> 1) + g, k = 32 * s + 16 * h + 4 * c + 2 * (j & 1);
  const unsigned char* r0 = w + (long long)n * ldw + k;
  const unsigned char* r1 = r0 + 8 * ldw;
  out[idx] = (unsigned)r0[0] | ((unsigned)r0[1] << 8) | ((unsigned)r1[0] << 16) | ((unsigned)r1[1] << 24);
}

// ============================================================================================================
// Small-M register-streaming kernel (gemv_stream_kernel, M <= 16) on the same fragment-major layout.
//
// Why a second small-M kernel: at M <= 16 the op is a read of the packed weights (N K / 2 bytes) and nothing
// else, so the time is launch + bytes / HBM rate + the latency of the last loads + the reduction.  The
// cp.async ring of gemv_kernel pays shared-memory round trips, ring bookkeeping and a stream-K schedule whose
// partial blocks go through fp32 atomics; this kernel keeps the bytes in registers:
// * each warp streams a contiguous run of its block's steps in chunks of 4 steps (128 k, 4 KB): eight 16-byte
//   loads per lane straight into the mma A fragments, plus the lane's x words and the chunk's group record
//   (a chunk never straddles a group: G % 128 == 0), all issued before any of them is used; at M <= 8 each piece's
//   registers are reloaded with the next chunk's piece as soon as the math has read them (register pipeline);
// * the next chunk(s) are prefetched into L2 (one 128-byte line per lane), so a warp's effective bytes in flight
//   are 4 KB in registers plus 4 KB per prefetch distance, without registers;
// * a CTA is one 64-channel block (32 for INT8) and W warps that split its K, so the reduction is one pass
//   through shared memory and y is written directly; only when blocks x W cannot fill the GPU does K split
//   over `splits` CTAs per block (fp32 partials in a zeroed workspace, last CTA by ticket writes y).
// Single wave: the grid is sized so that every warp is resident at once (16 warps per SM at <= 128 registers)
// and all warps have equal work, so there is no tail wave.
constexpr int kStreamChunkSteps = 4;  // 32-k steps per chunk
// Warps per CTA (and resident per SM): 16 at <= 128 registers; INT4 at M <= 16 holds twice the x words and
// the per-weight scale/zero pairs, which need up to 168 registers (12 warps).
template <int KIND, int MT> struct StreamWarps {
  static constexpr int MAX = (KIND == KIND_INT4 && MT == 2) ? 12 : 16;
};

// volatile: the compiler keeps every load of a chunk ahead of the math (left to itself it sinks some of them
// next to their first use, which puts a second memory round trip into every chunk).
__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ldg16_nc(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ldg8_nc(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// The math of one chunk (4 steps x 16 k x 2 halves) of gemv_stream_kernel / gemv_bulk_kernel: wf(u, h) gives the
// lane's 16 weight bytes of step u, half h; xf(u, h, mt) its 8 bytes of x (rows 8 mt + g); sv / zv the lane's
// scales / zero points of the chunk's group (INT4); dep a zero that every dequant constant depends on; after(u, h)
// runs once the piece (u, h) has been read (gemv_stream_kernel refills its registers with the next chunk there).
//
// INT4 (XSUM): the weights go to the mma as the raw magic-number words, (magic + q) (bf16: 128 + q; fp16: 1024 + q
// for channel g, 1024 + 16 q for channel g + 8), one lop3 per pair and no per-weight zero point or scale; the
// chunk (128 k, one group) is summed in fp32 per channel, and magic + zero point come off once per chunk through
// sum_k x (one mma per 16 k and 8 rows with an all-ones A): acc += s (sum_k (magic + q) x - (magic + z) sum_k x).
// The scale is applied once per channel and chunk, to an fp32 sum (no rounding of (q - z) s to T per weight).
// Used at M <= 8 only.  At M > 8 (two 8-row x tiles) it measured slower on the H200 than the per-weight
// (q - z) s path below (same run, bf16, with the register pipeline: 8192^2 23.2 vs 22.8 us, 28672x8192 67.4 vs
// 60.4 us): the extra sum_k x mmas and the second accumulator set (166 registers) cost more than the per-weight
// fma pairs, which are not what limits M = 16 (its x words are as many bytes as the weights: each 64-channel
// CTA reads all of x from L2).  -DSC_QUANT_XSUM_MT2 turns it on at M > 8 (for A/B measurements).
#ifdef SC_QUANT_XSUM_MT2
#define SC_QUANT_XSUM_MT 2
#else
#define SC_QUANT_XSUM_MT 1
#endif
template <typename T, int KIND, int MT, typename WF, typename XF, typename AF>
__device__ __forceinline__ void stream_chunk_math(float (&acc)[MT][KIND == KIND_INT4 ? 4 : 2][4], WF wf, XF xf,
                                                  uint4 sv, uint2 zv, unsigned dep, AF after) {
  constexpr bool INT4 = KIND == KIND_INT4;
  constexpr int NT = INT4 ? 4 : 2, U = kStreamChunkSteps;
  constexpr bool XSUM = INT4 && MT <= SC_QUANT_XSUM_MT;
  constexpr bool HALF = is_half<T>::value;
  constexpr unsigned MAGIC = sc::int4_magic<T>;
  const unsigned mask_lo = 0x000f000fu, mask_hi = 0x00f000f0u;
  const unsigned magic = MAGIC | dep;
  if constexpr (XSUM) {
    float accg[MT][NT][4], xs[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      xs[mt][0] = xs[mt][1] = 0.f;
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) accg[mt][t][j] = 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 wu = wf(u, h);
        unsigned bx[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint2 xw = xf(u, h, mt);
          bx[mt][0] = xw.x;
          bx[mt][1] = xw.y;
          const unsigned ones[4] = {Bits<T>::ONE | dep, Bits<T>::ONE, Bits<T>::ONE, Bits<T>::ONE};
          float d[4] = {xs[mt][0], xs[mt][1], 0.f, 0.f};
          sc::mma_16816<T>(d, ones, bx[mt]);
          xs[mt][0] = d[0];
          xs[mt][1] = d[1];
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const unsigned wd = sc::word(wu, t);
          unsigned a[4];
          if constexpr (HALF) {
            const unsigned w8 = wd >> 8;
            a[0] = and_or(wd, mask_lo, magic);
            a[1] = and_or(wd, mask_hi, magic);  // 1024 + 16 q: the flush divides channel g + 8 by 16
            a[2] = and_or(w8, mask_lo, magic);
            a[3] = and_or(w8, mask_hi, magic);
          } else {
            a[0] = and_or(wd, mask_lo, magic);
            a[1] = and_or(wd >> 4, mask_lo, magic);
            a[2] = and_or(wd >> 8, mask_lo, magic);
            a[3] = and_or(wd >> 12, mask_lo, magic);
          }
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) sc::mma_16816<T>(accg[mt][t], a, bx[mt]);
        }
        after(u, h);
      }
    // acc += s (sum (magic + q) x - (magic + z) sum x), per channel o = 2 t + hh of this lane; fp16 channel g + 8
    // (hh = 1) summed (1024 + 16 q) x: s / 16 and 1024 + 16 z (exact powers of two apart).
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int o = 2 * t + hh;
        const float2 sp = sc::unpack2<T>(sc::word(sv, o / 2));
        float s = (o & 1) ? sp.y : sp.x;
        const unsigned z = ((o < 4 ? zv.x : zv.y) >> (8 * (o & 3))) & 0xffu;
        float zf;
        if constexpr (HALF) {
          zf = hh ? fmaf(16.f, (float)z, 1024.f) : (float)z + 1024.f;
          if (hh) s *= 0.0625f;
        } else {
          zf = (float)z + 128.f;
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = 2 * hh + e;
            acc[mt][t][j] = fmaf(s, fmaf(-zf, xs[mt][e], accg[mt][t][j]), acc[mt][t][j]);
          }
      }
  } else if constexpr (INT4) {
    unsigned scl[8], zc[8];
    int4_group_consts<T>(sv, zv, scl, zc);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 wu = wf(u, h);
        uint2 xw[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) xw[mt] = xf(u, h, mt);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const unsigned wd = sc::word(wu, t);
          unsigned a[4];
          sc::int4_fragment<T>(a, wd, scl[2 * t], scl[2 * t + 1], zc[2 * t], zc[2 * t + 1], magic);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const unsigned bx[2] = {xw[mt].x, xw[mt].y};
            sc::mma_16816<T>(acc[mt][t], a, bx);
          }
        }
        after(u, h);
      }
  } else {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 wu = wf(u, h);
        uint2 xw[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) xw[mt] = xf(u, h, mt);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const unsigned u0w = sc::word(wu, 2 * t) ^ dep, u1w = sc::word(wu, 2 * t + 1) ^ dep;
          const unsigned a[4] = {int8_pair<T, 0x4140u>(u0w), int8_pair<T, 0x4342u>(u0w),
                                 int8_pair<T, 0x4140u>(u1w), int8_pair<T, 0x4342u>(u1w)};
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const unsigned bx[2] = {xw[mt].x, xw[mt].y};
            sc::mma_16816<T>(acc[mt][t], a, bx);
          }
        }
        after(u, h);
      }
  }
}

// The end of gemv_stream_kernel / gemv_bulk_kernel: sum the CTA's warps through shared memory (red: W * M rows of
// BN + 4 floats, rows < M only; warp w holds block cb NBC + w % NBC), then store y, or (split-K) add into the zeroed
// fp32 workspace, where the last of the block group's CTAs (ticket cb) writes y and leaves workspace and ticket
// zeroed.
template <typename T, int KIND, int MT, int NBC>
__device__ __forceinline__ void stream_epilogue(const float (&acc)[MT][KIND == KIND_INT4 ? 4 : 2][4], float* red,
                                                T* __restrict__ y, float* __restrict__ ws, int* __restrict__ tickets,
                                                const T* __restrict__ scales, const T* __restrict__ bias, int M, int N,
                                                int cb, int splits) {
  constexpr bool INT4 = KIND == KIND_INT4;
  constexpr int NT = INT4 ? 4 : 2, BN = 16 * NT, RS = BN + 4;
  __shared__ int s_last;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int W = blockDim.x >> 5;
  // Sum the W warps through shared memory: red[(warp M + row) RS + channel], rows < M only.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int row = 8 * mt + 2 * c + (j & 1);
        if (row < M) red[(warp * M + row) * RS + 16 * t + g + 8 * (j >> 1)] = acc[mt][t][j];
      }
  __syncthreads();
  const int n0 = cb * NBC * BN;
  auto store_y = [&](int row, int n, float v) {
    if constexpr (!INT4) v *= sc::to_float(scales[n]);
    if (bias != nullptr) v += sc::to_float(bias[n]);
    y[(long long)row * N + n] = sc::from_float<T>(v);
  };
  // Block j of the group: channels n0 + j BN + ch, summed over its warps j, j + NBC, ...
#pragma unroll
  for (int j = 0; j < NBC; ++j) {
    for (int item = tid; item < M * BN; item += blockDim.x) {
      const int row = item / BN, ch = item % BN, n = n0 + j * BN + ch;
      float v = 0.f;
      for (int w = j; w < W; w += NBC) v += red[(w * M + row) * RS + ch];
      if (splits == 1) store_y(row, n, v);
      else atomicAdd(ws + (long long)row * N + n, v);
    }
  }
  if (splits == 1) return;
  __threadfence();  // this thread's partial sums are visible before the ticket counts them
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(tickets + cb, 1) == splits - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
#pragma unroll
  for (int j = 0; j < NBC; ++j) {
    for (int item = tid; item < M * BN; item += blockDim.x) {
      const int row = item / BN, n = n0 + j * BN + item % BN;
      float* p = ws + (long long)row * N + n;
      const float v = __ldcg(p);
      __stcg(p, 0.f);  // the workspace stays zero between launches
      store_y(row, n, v);
    }
  }
  if (tid == 0) tickets[cb] = 0;
}

// Which chunks a warp streams, and in what order.  Warp gw of the wpb warps of a block (over its splits CTAs):
//   order 0: the contiguous run [gw KC / wpb, (gw + 1) KC / wpb), in order;
//   order 1: chunks gw, gw + wpb, gw + 2 wpb, ... (a CTA's warps sweep the block side by side);
//   order 2: order 0's run, started at a per-warp rotation (concurrent reads spread over addresses).
struct ChunkOrder {
  int base, n, stride, rot;
  __device__ __forceinline__ ChunkOrder(int order, int KC, int wpb, int gw, int b) {
    if (order == 1) {
      base = gw;
      stride = wpb;
      n = gw < KC ? (KC - gw + wpb - 1) / wpb : 0;
      rot = 0;
    } else {
      base = (int)((long long)gw * KC / wpb);
      n = (int)((long long)(gw + 1) * KC / wpb) - base;
      stride = 1;
      rot = (order == 2 && n > 0) ? (int)((7u * (unsigned)b + 3u * (unsigned)gw) % (unsigned)n) : 0;
    }
  }
  // i-th chunk, 0 <= i < n
  __device__ __forceinline__ int operator()(int i) const {
    int j = i + rot;
    if (j >= n) j -= n;
    return base + j * stride;
  }
};

// y[m, n] = sum_k x[m, k] W[k, n] for M <= 8 MT.  Grid: (NB / NBC) x splits CTAs of W = blockDim.x / 32 warps
// (W % NBC == 0); CTA group cb = blockIdx.x % (NB / NBC) owns blocks cb NBC .. cb NBC + NBC - 1, split =
// blockIdx.x / (NB / NBC); warp w takes block cb NBC + w % NBC as warp gw = split W / NBC + w / NBC of the block's
// W / NBC x splits warps, its chunks in the given order (ChunkOrder, the same for every block of the group).  So
// with NBC > 1 the group's NBC warps of one gw read the same x words at about the same time: one L2 read of x per
// SM instead of NBC (at M = 16, x is as many bytes as the INT4 weights).  NBC is a template parameter: as a
// runtime argument its arithmetic changed ptxas's schedule of the NBC = 1 kernels (4096^2 M = 16 5% slower, H200).
// Requires KS % 4 == 0 and (INT4) SPG % 4 == 0.  Dynamic shared memory: W * M * (BN + 4) floats.  `zero` must be
// 0 (see dep below).
template <typename T, int KIND, int MT, int NBC = 1>
__global__ void __launch_bounds__(StreamWarps<KIND, MT>::MAX * 32, 1) gemv_stream_kernel(
    T* __restrict__ y, float* __restrict__ ws, int* __restrict__ tickets, const T* __restrict__ x,
    const uint4* __restrict__ wpk, const unsigned char* __restrict__ grec, const T* __restrict__ scales,
    const T* __restrict__ bias, int M, int N, int KS, int SPG, int NG, int NB, int splits, int prefetch,
    int order, unsigned zero, long long ldx) {
  constexpr bool INT4 = KIND == KIND_INT4;
  constexpr int NT = INT4 ? 4 : 2, BN = 16 * NT, U = kStreamChunkSteps, RS = BN + 4;
  extern __shared__ __align__(16) float red[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  static_assert(NBC == 1 || MT == 2, "several blocks per CTA only at M > 8 (the register pipeline has no room)");
  const int W = blockDim.x >> 5, groups = NB / NBC, wk = W / NBC;
  const int cb = blockIdx.x % groups, split = blockIdx.x / groups;
  const int b = cb * NBC + warp % NBC;
  const int KC = KS / U, wpb = wk * splits, gw = split * wk + warp / NBC;
  const ChunkOrder chunk(order, KC, wpb, gw, cb);

  const uint4* wb = wpk + (long long)b * KS * 64;
  const unsigned char* gb = grec + (long long)b * NG * 192;
  // Rows of x past M read row M - 1 (a valid address); their output columns are never stored.
  const T* xr[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) xr[mt] = x + (long long)min(8 * mt + g, M - 1) * ldx + 4 * c;

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mt][t][j] = 0.f;

  auto prefetch_chunk = [&](int i) {
    if (i < chunk.n)
      prefetch_l2(reinterpret_cast<const unsigned char*>(wb + (long long)U * chunk(i) * 64) + 128 * lane);
  };
  for (int d = 1; d < prefetch; ++d) prefetch_chunk(d);
  auto load_w = [&](int cc, int u, int h) { return ldg_stream(wb + (long long)U * cc * 64 + lane + u * 64 + h * 32); };
  auto load_x = [&](int cc, int u, int h, int mt) { return ldg8_nc(xr[mt] + (U * cc + u) * 32 + 16 * h); };
  auto group_rec = [&](int cc) { return gb + (long long)((U * cc) / SPG) * 192; };

  // The register pipeline below at M <= 8 (H200, same run, bf16: INT8 8192^2 22.4 vs 24.3 us, 28672x8192 67.8 vs
  // 72.6 us; INT4 M = 4 16.0 vs 16.8 us); at M > 8 (166 registers) it was slower (INT8 M = 16 29.4 vs 28.2 us),
  // so there the chunk's loads come first, then its math.  -DSC_QUANT_PIPELINE_MT2 / -DSC_QUANT_STREAM_UNPIPELINED
  // force either schedule (for A/B measurements).
#if defined(SC_QUANT_STREAM_UNPIPELINED)
  constexpr bool PIPELINED = false;
#elif defined(SC_QUANT_PIPELINE_MT2)
  constexpr bool PIPELINED = true;
#else
  constexpr bool PIPELINED = MT == 1;
#endif
  if constexpr (!PIPELINED) {
  // All loads of a chunk, then its math.
#pragma unroll 1
  for (int i = 0; i < chunk.n; ++i) {
    const int cc = chunk(i);
    uint4 wv[U][2];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) wv[u][h] = load_w(cc, u, h);
    uint2 xv[U][2][MT];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) xv[u][h][mt] = load_x(cc, u, h, mt);
    uint4 sv = make_uint4(0u, 0u, 0u, 0u);
    uint2 zv = make_uint2(0u, 0u);
    if constexpr (INT4) {
      sv = ldg16_nc(group_rec(cc) + 16 * g);
      zv = ldg8_nc(group_rec(cc) + 128 + 8 * g);
    }
    if (prefetch > 0) prefetch_chunk(i + prefetch);
    // Every dequant constant depends on an XOR of all loaded words, masked by a zero the compiler cannot see:
    // all loads of the chunk stay ahead of its math.
    unsigned dep = sv.x ^ sv.y ^ sv.z ^ sv.w ^ zv.x ^ zv.y;
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        dep ^= wv[u][h].x ^ wv[u][h].y ^ wv[u][h].z ^ wv[u][h].w;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) dep ^= xv[u][h][mt].x ^ xv[u][h][mt].y;
      }
    dep &= zero;
    stream_chunk_math<T, KIND, MT>(
        acc, [&](int u, int h) { return wv[u][h]; }, [&](int u, int h, int mt) { return xv[u][h][mt]; }, sv, zv,
        dep, [](int, int) {});
  }
  } else {
  // Register pipeline: the chunk's 4 KB of weights and its x words sit in registers; as soon as the math has
  // read piece (u, h) of chunk i, that piece's registers are reloaded with piece (u, h) of chunk i + 1.  So a
  // warp keeps ~4 KB in flight during its math too (the unpipelined schedule had none in flight between its
  // last load's arrival and the next chunk's first load), with no more registers.
  uint4 wv[U][2];
  uint2 xv[U][2][MT];
  uint4 sv = make_uint4(0u, 0u, 0u, 0u);
  uint2 zv = make_uint2(0u, 0u);
  if (chunk.n > 0) {
    const int cc = chunk(0);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wv[u][h] = load_w(cc, u, h);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) xv[u][h][mt] = load_x(cc, u, h, mt);
      }
    if constexpr (INT4) {
      sv = ldg16_nc(group_rec(cc) + 16 * g);
      zv = ldg8_nc(group_rec(cc) + 128 + 8 * g);
    }
  }
#pragma unroll 1
  for (int i = 0; i < chunk.n; ++i) {
    const bool more = i + 1 < chunk.n;
    const int cn = more ? chunk(i + 1) : 0;
    if (prefetch > 0) prefetch_chunk(i + prefetch);
    stream_chunk_math<T, KIND, MT>(
        acc, [&](int u, int h) { return wv[u][h]; }, [&](int u, int h, int mt) { return xv[u][h][mt]; }, sv, zv,
        0u, [&](int u, int h) {
          if (more) {
            wv[u][h] = load_w(cn, u, h);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) xv[u][h][mt] = load_x(cn, u, h, mt);
          }
        });
    if (INT4 && more) {
      sv = ldg16_nc(group_rec(cn) + 16 * g);
      zv = ldg8_nc(group_rec(cn) + 128 + 8 * g);
    }
  }
  }

  stream_epilogue<T, KIND, MT, NBC>(acc, red, y, ws, tickets, scales, bias, M, N, cb, splits);
}


// ============================================================================================================
// gemv_bulk_kernel (sm_90+): the chunks of gemv_stream_kernel, moved by the bulk-copy engine instead of LDG.
//
// Why: on the H200 every load-instruction form of this stream (gemv_kernel's cp.async ring, gemv_stream_kernel's
// register chunks, any warp count or L2-prefetch distance; torch.sum alike) levels off near 3.3 TB/s, while
// cuBLAS, which loads through TMA, reads ~4.5 TB/s: the bytes a warp can keep in flight through LDG are
// capped per SM.  cp.async.bulk copies are tracked by the copy engine, not by the SM's load path, so a warp
// keeps (S - 1) chunks (12 KB at S = 4) in flight with one instruction each.
//
// Per warp: a ring of S stages in shared memory, each one chunk: the 4 KB of weights, the 192-byte group
// record (INT4) and M rows x 256 bytes of x (row pitch 288 bytes: 8-byte reads are conflict-free per half-warp).
// One mbarrier per stage (count 1: lane 0's arrive.expect_tx, completed by the bytes).  Lane 0 copies the
// weights, lane 1 the group record, lanes 2 .. M + 1 one row of x each.  Every lane waits on the stage's
// barrier and reads its fragments; a __syncwarp before each refill orders the lanes' reads of that stage
// before the copy that overwrites it.  Grid, work split, math and epilogue are gemv_stream_kernel's.
constexpr int kBulkXPitch = 288;
constexpr int kBulkMaxWarps = 16;

// Dynamic shared memory: align128(W S 8) bytes of mbarriers, then W rings of S stages of
// 4096 + (INT4 ? 192 : 0) + 288 M bytes (the epilogue's reduction rows reuse the rings).
template <typename T, int KIND, int MT>
__global__ void __launch_bounds__(kBulkMaxWarps * 32, 1) gemv_bulk_kernel(
    T* __restrict__ y, float* __restrict__ ws, int* __restrict__ tickets, const T* __restrict__ x,
    const uint4* __restrict__ wpk, const unsigned char* __restrict__ grec, const T* __restrict__ scales,
    const T* __restrict__ bias, int M, int N, int KS, int SPG, int NG, int NB, int splits, int stages, int order,
    long long ldx) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool INT4 = KIND == KIND_INT4;
  constexpr int NT = INT4 ? 4 : 2, U = kStreamChunkSteps;
  constexpr int G_OFF = 4096, X_OFF = 4096 + (INT4 ? 192 : 0);
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int W = blockDim.x >> 5;
  const int b = blockIdx.x % NB, split = blockIdx.x / NB;
  const int KC = KS / U, wpb = W * splits, gw = split * W + warp;
  const ChunkOrder chunk(order, KC, wpb, gw, b);
  const int stage_bytes = X_OFF + M * kBulkXPitch;
  const int ring_off = (W * stages * 8 + 127) & ~127;
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(smem) + warp * stages;
  unsigned char* ring = smem + ring_off + warp * stages * stage_bytes;
  const unsigned tx = X_OFF + M * 256;
  const unsigned char* wsrc = reinterpret_cast<const unsigned char*>(wpk + (long long)b * KS * 64);
  const unsigned char* gsrc = grec + (long long)b * NG * 192;
  const T* xsrc = x + (long long)min(max(lane - 2, 0), M - 1) * ldx;

  if (lane == 0) {
    for (int s = 0; s < stages; ++s) sc::mbar_init(bars + s, 1);
    sc::fence_mbar_init();
  }
  __syncwarp();
  auto issue = [&](int cc, int slot) {
    unsigned char* st = ring + slot * stage_bytes;
    if (lane == 0) sc::mbar_arrive_expect_tx(bars + slot, tx);
    __syncwarp();  // the expected bytes are registered before any copy can complete
    if (lane == 0) {
      sc::bulk_copy_g2s(st, wsrc + (long long)cc * 4096, 4096, bars + slot);
    } else if (INT4 && lane == 1) {
      sc::bulk_copy_g2s(st + G_OFF, gsrc + (long long)((U * cc) / SPG) * 192, 192, bars + slot);
    } else if (lane >= 2 && lane < 2 + M) {
      sc::bulk_copy_g2s(st + X_OFF + (lane - 2) * kBulkXPitch, xsrc + 128LL * cc, 256, bars + slot);
    }
  };

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mt][t][j] = 0.f;

  const int pre = min(stages - 1, chunk.n);
  for (int i = 0; i < pre; ++i) issue(chunk(i), i);
  int slot = 0, islot = pre % stages;
  unsigned phase = 0;
#pragma unroll 1
  for (int i = 0; i < chunk.n; ++i) {
    if (i + stages - 1 < chunk.n) {
      __syncwarp();  // every lane is done with the stage read last iteration, which this copy refills
      issue(chunk(i + stages - 1), islot);
      if (++islot == stages) islot = 0;
    }
    sc::mbar_wait(bars + slot, phase);
    const unsigned char* st = ring + slot * stage_bytes;
    uint4 sv = make_uint4(0u, 0u, 0u, 0u);
    uint2 zv = make_uint2(0u, 0u);
    if constexpr (INT4) {
      sv = *reinterpret_cast<const uint4*>(st + G_OFF + 16 * g);
      zv = *reinterpret_cast<const uint2*>(st + G_OFF + 128 + 8 * g);
    }
    const unsigned char* xrow[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) xrow[mt] = st + X_OFF + min(8 * mt + g, M - 1) * kBulkXPitch + 8 * c;
    stream_chunk_math<T, KIND, MT>(
        acc, [&](int u, int h) { return *reinterpret_cast<const uint4*>(st + u * 1024 + h * 512 + 16 * lane); },
        [&](int u, int h, int mt) { return *reinterpret_cast<const uint2*>(xrow[mt] + 64 * u + 32 * h); }, sv, zv,
        0u, [](int, int) {});
    if (++slot == stages) {
      slot = 0;
      phase ^= 1u;
    }
  }
  __syncthreads();  // the reduction rows below reuse the other warps' rings
  stream_epilogue<T, KIND, MT, 1>(acc, reinterpret_cast<float*>(smem + ring_off), y, ws, tickets, scales, bias, M,
                                  N, b, splits);
#endif
}



// ============================================================================================================
// Tensor-core kernel for 17 <= M <= 128 on the fragment-major layout (quant_marlin_kernel).
//
// Why: at M = 64 the op still reads little (N K / 2 bytes of weights, 34 MB for 8192^2, ~9 us at HBM rate) but does
// 2 M N K flops; the streaming kernels read x per warp from L2 (as many bytes as the weights at M = 16, 4x at 64),
// and quant_mma_kernel re-dequantizes per 8-row x tile.  Here a CTA owns 256 output channels (4 blocks of the
// fragment-major layout, one per warp column) and a contiguous run of 128-k chunks (split-K over CTAs), so:
// * x (the mma B operand, 8 MT rows) is staged in shared memory once per chunk and shared by the CTA's 8 warps
//   (x traffic from L2 = (N / 256) M K 2 bytes: the weights' size at M = 64);
// * each warp's weights of a 16-k half-step are one 16-byte shared load per lane, already the A fragments of its
//   4 mma tiles (the layout gemv_stream_kernel streams), dequantized in registers once (lop3 into the magic
//   number, one fma2 for magic + zero point, one for the scale: (q - z) s rounded once to T) and used for MT
//   mmas, one per 8 rows of x;
// * weights, group records and x go through a Marlin<MT>::STAGES-deep cp.async ring (one barrier per chunk);
// * the 8 warps are 4 channel blocks x 2 halves of each chunk (steps 0-1 and 2-3): all 64 rows per warp keep the
//   dequantization amortized over MT mmas, and the two halves are summed once through shared memory at the end.
// x rows are read as 8-byte words at k = 4c..4c+3 (the layout maps the lane's mma k slots there), so the staged
// rows use a 288-byte pitch (256 + 32: each half-warp's 8-byte reads cover 32 distinct banks).  Rows >= M are
// zero-filled.  K is split by a stream-K schedule (below) so that every SM gets an equal share even where the
// tiles do not divide into the SM count (28672 channels: 112 tiles on 132 SMs); partial tiles go through fp32
// slots summed in a fixed order by the tile's last CTA (summing in fragment order from registers needed more than
// 255 registers at mt = 8 on sm_80, so the sum reads the slots back in row-major items).
// One CTA per SM (up to 255 registers: the 8 MT x 4 accumulators, and the fragments of a chunk's 4 half-steps that
// the compiler hoists; at 128 registers, for two CTAs per SM, mt = 4 spilled).
// Requires K % 128 == 0, G % 128 == 0 (a chunk is inside one group), N % 64 == 0, x rows 16-byte aligned.
constexpr int kMarlinBlocks = 4;    // 64-channel blocks per CTA
constexpr int kMarlinWarps = 8;     // kMarlinBlocks x 2 halves of a chunk
constexpr int kMarlinXPitch = 288;  // bytes per staged row of x (128 k)

template <int MT> struct Marlin {
  static constexpr int W_BYTES = kMarlinBlocks * 4096;
  static constexpr int G_BYTES = kMarlinBlocks * 192;
  static constexpr int X_BYTES = 8 * MT * kMarlinXPitch;
  static constexpr int STAGE = W_BYTES + G_BYTES + X_BYTES;
  // mt 4 (M <= 32) is bound by the weight stream: 6 stages (5 chunks, 80 KB of weights in flight per SM); mt 8 by
  // the mma rate: 4 (and the ring stays within sm_80's 163 KB).
  static constexpr int STAGES = MT <= 4 ? 6 : 4;
  static constexpr int SMEM = STAGES * STAGE;
  static constexpr int RED_BYTES = kMarlinBlocks * MT * 16 * 32 * 4;  // the second half's accumulators
  static_assert(RED_BYTES <= SMEM, "the reduction reuses the ring");
  static_assert(STAGE % 16 == 0, "stages stay 16-byte aligned");
};

// The first unit of CTA c's stream-K range: units [unit_begin(c), unit_begin(c + 1)) of U over P CTAs.
__device__ __forceinline__ int marlin_unit_begin(int c, int U, int P) { return (int)((long long)c * U / P); }
// The CTA whose range holds unit v.
__device__ __forceinline__ int marlin_cta_of(int v, int U, int P) {
  int c = (int)((long long)v * P / U);
  while (c + 1 < P && marlin_unit_begin(c + 1, U, P) <= v) ++c;
  while (c > 0 && marlin_unit_begin(c, U, P) > v) --c;
  return c;
}

// y (M, N) = x (M, K; row stride ldx) @ W for the fragment-major INT4 layer (wpk, grec: gemv_pack_*_kernel).
// Stream-K schedule: the work is U = n_tiles x m_chunks x KC units (256-channel tile, 8 MT-row chunk of x, 128-k
// chunk; k fastest, then m chunk, so CTAs that read the same weights run side by side), and CTA c of the P = grid
// CTAs takes units [c U / P, (c + 1) U / P).  Its range is one or more segments (one tile and m chunk each): a
// segment that covers all of K stores y directly; a partial one stores its fp32 partial in the CTA's slot (2 c for
// the range's first segment, 2 c + 1 for its last; ws: 2 P slots of 8 MT x 256 floats) and adds its chunk count to
// the tile's ticket; the CTA that completes K sums the slots of the tile's CTAs in CTA order (deterministic), adds
// the bias, writes y and re-zeroes the ticket.  With P = tiles x s and s dividing KC this is plain split-K.  The
// ring restarts at each segment (the drained ring holds the reduction of the two chunk halves).
// tickets: n_tiles x m_chunks zeroed int32 (left zeroed).
template <typename T, int MT>
__global__ void __launch_bounds__(kMarlinWarps * 32, 1) quant_marlin_kernel(
    T* __restrict__ y, float* __restrict__ ws, int* __restrict__ tickets, const T* __restrict__ x,
    const uint4* __restrict__ wpk, const unsigned char* __restrict__ grec, const T* __restrict__ bias, int M,
    int N, int KS, int SPG, int NG, int n_tiles, int m_chunks, long long ldx) {
  static_assert(MT % 2 == 0, "x is staged in pieces of two 8-row tiles per thread");
  using L = Marlin<MT>;
  constexpr int kSlot = 8 * MT * 256;  // floats per partial slot
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int s_last;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int wn = warp & (kMarlinBlocks - 1), wk = warp / kMarlinBlocks;
  const int KC = KS / kStreamChunkSteps;
  const int U = n_tiles * m_chunks * KC, P = gridDim.x, cta = blockIdx.x;
  const int u_begin = marlin_unit_begin(cta, U, P), u_end = marlin_unit_begin(cta + 1, U, P);
  constexpr unsigned MAGIC = sc::int4_magic<T>;
  unsigned magic = MAGIC;
  asm volatile("" : "+r"(magic));  // kept in a register: lop3 takes it as an operand (see and_or)

#pragma unroll 1
  for (int u = u_begin; u < u_end;) {
    const int tm = u / KC, c0 = u - tm * KC;
    const int nchunks = min(u_end, (tm + 1) * KC) - u;
    const int tile = tm / m_chunks, mc = tm - tile * m_chunks;
    const int blocks_here = min(kMarlinBlocks, N / 64 - tile * kMarlinBlocks);
    const bool active = wn < blocks_here;  // warp-uniform: the last tile may hold fewer blocks
    const int m0 = mc * 8 * MT;
    const int b0 = tile * kMarlinBlocks;

    auto load = [&](int slot, int ch) {
      unsigned char* st = smem + slot * L::STAGE;
#pragma unroll
      for (int i = 0; i < kMarlinBlocks * 256 / (kMarlinWarps * 32); ++i) {
        const int idx = i * kMarlinWarps * 32 + tid, j = idx >> 8, off = idx & 255;
        if (j < blocks_here)
          sc::cp_async16(st + j * 4096 + off * 16, wpk + ((long long)(b0 + j) * KS + kStreamChunkSteps * ch) * 64 + off);
      }
      if (tid < kMarlinBlocks * 12) {
        const int j = tid / 12, piece = tid % 12;
        const int grp = (kStreamChunkSteps * ch) / SPG;
        if (j < blocks_here)
          sc::cp_async16(st + L::W_BYTES + j * 192 + piece * 16,
                         grec + ((long long)(b0 + j) * NG + grp) * 192 + piece * 16);
      }
#pragma unroll
      for (int i = 0; i < MT / 2; ++i) {
        const int idx = i * kMarlinWarps * 32 + tid, r = idx >> 4, p = idx & 15;
        const int row = m0 + r;
        const bool ok = row < M;
        sc::cp_async16(st + L::W_BYTES + L::G_BYTES + r * kMarlinXPitch + p * 16,
                       x + (long long)(ok ? row : 0) * ldx + 128 * ch + 8 * p, ok);
      }
    };

    float acc[MT][4][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int t = 0; t < 4; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[mt][t][j] = 0.f;

#pragma unroll
    for (int s = 0; s < L::STAGES - 1; ++s) {
      if (s < nchunks) load(s, c0 + s);
      sc::cp_async_commit();
    }
#pragma unroll 1
    for (int i = 0; i < nchunks; ++i) {
      sc::cp_async_wait<L::STAGES - 2>();
      __syncthreads();
      {
        const int nx = i + L::STAGES - 1;
        if (nx < nchunks) load(nx % L::STAGES, c0 + nx);
        sc::cp_async_commit();
      }
      if (active) {
        const unsigned char* st = smem + (i % L::STAGES) * L::STAGE;
        const unsigned char* wb = st + wn * 4096 + wk * 2048 + lane * 16;
        const unsigned char* gb = st + L::W_BYTES + wn * 192;
        const unsigned char* xb = st + L::W_BYTES + L::G_BYTES + g * kMarlinXPitch + wk * 128 + c * 8;
        unsigned scl[8], zc[8];
        int4_group_consts<T>(lds128(gb + 16 * g), lds64(gb + 128 + 8 * g), scl, zc);
#pragma unroll
        for (int up = 0; up < 2; ++up)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint4 wu = lds128(wb + up * 1024 + h * 512);
            unsigned a[4][4];
#pragma unroll
            for (int t = 0; t < 4; ++t)
              sc::int4_fragment<T>(a[t], sc::word(wu, t), scl[2 * t], scl[2 * t + 1], zc[2 * t], zc[2 * t + 1], magic);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              const uint2 xw = lds64(xb + mt * 8 * kMarlinXPitch + up * 64 + h * 32);
              const unsigned bx[2] = {xw.x, xw.y};
#pragma unroll
              for (int t = 0; t < 4; ++t) sc::mma_16816<T>(acc[mt][t], a[t], bx);
            }
          }
      }
    }
    sc::cp_async_wait<0>();
    __syncthreads();
    // The second half of every chunk (wk = 1) into the first: one pass through the drained ring.
    float* red = reinterpret_cast<float*>(smem);
    if (active && wk == 1) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
          for (int j = 0; j < 4; ++j) red[((wn * MT * 16) + (mt * 4 + t) * 4 + j) * 32 + lane] = acc[mt][t][j];
    }
    __syncthreads();
    const bool owner = active && wk == 0;
    if (owner) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[mt][t][j] += red[((wn * MT * 16) + (mt * 4 + t) * 4 + j) * 32 + lane];
    }
    // acc[mt][t][j]: channel 64 wn + 16 t + g + 8 (j / 2) of the tile, row 8 mt + 2 c + (j % 2) of the m chunk.
    if (nchunks == KC) {
      if (owner) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int t = 0; t < 4; ++t)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const int row = m0 + 8 * mt + 2 * c + (j & 1), n = (b0 + wn) * 64 + 16 * t + g + 8 * (j >> 1);
              if (row < M) {
                float v = acc[mt][t][j];
                if (bias != nullptr) v += sc::to_float(bias[n]);
                y[(long long)row * N + n] = sc::from_float<T>(v);
              }
            }
      }
    } else {
      float* slot = ws + (long long)(2 * cta + (u == u_begin ? 0 : 1)) * kSlot;
      if (owner) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int t = 0; t < 4; ++t)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const int r = 8 * mt + 2 * c + (j & 1);
              if (m0 + r < M) __stcg(slot + r * 256 + wn * 64 + 16 * t + g + 8 * (j >> 1), acc[mt][t][j]);
            }
      }
      __threadfence();  // this thread's partials are visible before the ticket counts them
      __syncthreads();
      if (tid == 0) s_last = atomicAdd(tickets + tm, nchunks) + nchunks == KC;
      __syncthreads();
      if (s_last) {
        __threadfence();
        // The slots of the tile's CTAs in CTA order (own included), so the sum does not depend on which CTA came
        // last; row-major items of 4 channels (16-byte loads), 4 items x contributors loads in flight per thread.
        const int c_lo = marlin_cta_of(tm * KC, U, P), c_hi = marlin_cta_of((tm + 1) * KC - 1, U, P);
        const int rows_here = min(M - m0, 8 * MT), cols4 = blocks_here * 16, total = rows_here * cols4;
        constexpr int kThreadsM = kMarlinWarps * 32, kUnroll = 4;
        for (int base = tid; base < total; base += kThreadsM * kUnroll) {
          float4 v[kUnroll];
#pragma unroll
          for (int q = 0; q < kUnroll; ++q) v[q] = make_float4(0.f, 0.f, 0.f, 0.f);
          for (int cc = c_lo; cc <= c_hi; ++cc) {
            const int cb = marlin_unit_begin(cc, U, P);
            if (cb == marlin_unit_begin(cc + 1, U, P)) continue;  // an empty range (P > U) wrote nothing
            const float* src = ws + (long long)(2 * cc + (cb >= tm * KC ? 0 : 1)) * kSlot;
#pragma unroll
            for (int q = 0; q < kUnroll; ++q) {
              const int item = base + q * kThreadsM;
              if (item < total) {
                const float4 p = __ldcg(reinterpret_cast<const float4*>(src + (item / cols4) * 256 + 4 * (item % cols4)));
                v[q].x += p.x;
                v[q].y += p.y;
                v[q].z += p.z;
                v[q].w += p.w;
              }
            }
          }
#pragma unroll
          for (int q = 0; q < kUnroll; ++q) {
            const int item = base + q * kThreadsM;
            if (item < total) {
              const int row = m0 + item / cols4, n = b0 * 64 + 4 * (item % cols4);
              float f[4] = {v[q].x, v[q].y, v[q].z, v[q].w};
              if (bias != nullptr) {  // element loads: a bias view need not be 8-byte aligned
#pragma unroll
                for (int e = 0; e < 4; ++e) f[e] += sc::to_float(bias[n + e]);
              }
              *reinterpret_cast<uint2*>(y + (long long)row * N + n) = make_uint2(sc::pack2<T>(f[0], f[1]),
                                                                                 sc::pack2<T>(f[2], f[3]));
            }
          }
        }
        if (tid == 0) tickets[tm] = 0;
      }
    }
    __syncthreads();  // the next segment's ring overwrites the reduction area (and s_last)
    u += nchunks;
  }
}

}  // namespace quant
