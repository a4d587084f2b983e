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
#include "common/types.cuh"
#include "common/tma.cuh"
#include "common/quant.cuh"
#include "common/quant_stream.cuh"

namespace quant {

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
  sc::chain_after_previous();
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

}  // namespace quant
