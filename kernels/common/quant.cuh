// Device code shared by the weight-only quantized linear kernels (kernels/quant_*.cu, namespace quant): the
// checkpoint formats, the fragment-major layout's weight kinds and chunk size, the lane's INT4 group constants
// of that layout, and plain shared-memory loads.
#pragma once

#include "types.cuh"
#include "mma.cuh"
#include "int4.cuh"

namespace quant {

using sc::and_or;
using sc::Bits;
using sc::fma2;
using sc::is_half;
using sc::int8_pair;

enum : int { AWQ = 0, GPTQ = 1, INT8 = 2 };

// The fragment-major layout (made by the gemv_pack_* kernels of kernels/quant_pack.cu; read by gemv_kernel,
// gemv_stream_kernel, gemv_bulk_kernel and quant_marlin_kernel).
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
enum : int { KIND_INT4 = 0, KIND_INT8 = 1 };
constexpr int kStreamChunkSteps = 4;  // 32-k steps per chunk

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

}  // namespace quant
