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
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/quant.cuh"

namespace quant {

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
