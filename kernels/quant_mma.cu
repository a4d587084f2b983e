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
#include "common/quant.cuh"

namespace quant {

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

}  // namespace quant
