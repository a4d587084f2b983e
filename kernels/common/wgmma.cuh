// Hopper warpgroup MMA (wgmma.mma_async, sm_90a): shared-memory matrix descriptors, the async-group fences,
// and m64nNk16 wrappers with fp32 accumulators for fp16/bf16 inputs.
//
// Accumulator layout of m64nNk16 for thread t of the warpgroup (warp w = t / 32, lane l): register r holds
// row 16 w + l / 4 (+ 8 when r % 4 >= 2), column 8 (r / 4) + 2 (l % 4) + (r % 2) -- per 8-column block the
// same as mma.sync m16n8's C fragment.
#pragma once
#include "mma.cuh"

namespace sc {

// stmatrix (sm_90): four 8 x 8 matrices of 16-bit values, transposed, into shared memory.  Lanes 8 q .. 8 q + 7 give
// the addresses (32-bit, smem_addr) of the 16-byte rows of stored matrix q; register q holds, as in an mma
// fragment, elements (lane / 4, 2 (lane % 4)) and (lane / 4, 2 (lane % 4) + 1) of matrix q before the transpose.
__device__ __forceinline__ void stmatrix_x4_trans(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Descriptor of a K-major tile whose rows are 128 bytes (64 fp16/bf16 elements) stored with the 128-byte
// swizzle (what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B): 8-row groups of 1024 bytes, so the stride
// byte offset is 1024; the leading byte offset is unused for swizzled K-major layouts.  The tile must start
// at a 1024-byte aligned address; advancing along K inside the 128-byte row is a plain address offset
// (32 bytes per k16 step) because the hardware applies the swizzle to absolute address bits.
__device__ __forceinline__ unsigned long long wgmma_desc_k128(const void* smem_ptr) {
  const unsigned long long addr = smem_addr(smem_ptr);
  unsigned long long desc = (addr & 0x3FFFFull) >> 4;  // start address, 16-byte units, bits 0-13
  desc |= 1ull << 16;                                 // leading byte offset (ignored here)
  desc |= (1024ull >> 4) << 32;                       // stride byte offset: one 8-row group
  desc |= 1ull << 62;                                 // layout: 128-byte swizzle
  return desc;
}

// `desc` moved `bytes` further into shared memory (a multiple of 16).  Only the low word changes: the start address
// field (bits 0-13) cannot carry while the result stays inside shared memory (< 256 KB), so the high word stays a
// loop-invariant constant and a step costs one 32-bit add instead of rebuilding the descriptor from an address
// (six uniform-datapath instructions before each wgmma in w4_wgmma_kernel's main loop).
__device__ __forceinline__ unsigned long long wgmma_desc_advance(unsigned long long desc, unsigned bytes) {
  const unsigned lo = static_cast<unsigned>(desc) + (bytes >> 4);
  return (static_cast<unsigned long long>(static_cast<unsigned>(desc >> 32)) << 32) | lo;
}

// Descriptor of an MN-major tile stored as column blocks of 64 MN-elements (128 bytes, 128-byte swizzle) x
// K rows: within a block, 8-row (8 k) groups are 1024 bytes apart (stride byte offset); consecutive 64-wide
// MN blocks are `block_bytes` apart (leading byte offset).  Advancing k16 is +16 rows = +2048 bytes.
__device__ __forceinline__ unsigned long long wgmma_desc_mn128(const void* smem_ptr, unsigned block_bytes) {
  const unsigned long long addr = smem_addr(smem_ptr);
  unsigned long long desc = (addr & 0x3FFFFull) >> 4;
  desc |= (unsigned long long)((block_bytes >> 4) & 0x3FFF) << 16;
  desc |= (1024ull >> 4) << 32;
  desc |= 1ull << 62;
  return desc;
}

// Order prior register writes of the accumulators before the wgmma that reads them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Wait until at most N committed wgmma groups of this warpgroup are pending.
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keep the compiler from moving accesses of an accumulator register across wgmma issue/wait points.
__device__ __forceinline__ void wgmma_fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// d (N/2 floats) = A(64x16, descriptor) * B(16xN, descriptor) + (scale_d ? d : 0).  TRANS_B = 1 reads B
// from an N-major (MN-major) tile.  A and B both come from shared memory.
template <int N, typename T, int TRANS_B = 0> struct Wgmma;

// (the shapes are instantiated below, after the register-list macros)

// ---- A from registers (RS): d (N/2 floats) = A(64x16, 4 registers per thread) * B(16xN, descriptor) + d.
// A's fragment per warp w is the m16n8k16 A fragment of rows 16w..16w+15, which is also the accumulator layout
// of two adjacent 8-column blocks of an m64nNk16 result packed to 16 bits: an S = Q K^T accumulator becomes
// the P operand of P V without leaving registers.  B is read N-major (TB = 1, transposed), as a V tile stored
// row by row (key-major) is, or K-major (TB = 0: rows n, 128-byte rows along k, wgmma_desc_k128), as a row-major
// (N, K) activation tile written by TMA is (the INT4 GEMM, kernels/quant_sm90.cu: A = dequantized weights).  The
// accumulator is always added to (zero it first).
template <int N, typename T, int TB> struct WgmmaRS;

#define SC_WGMMA_D176 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}"
#define SC_WGMMA_ACC176 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
#define SC_WGMMA_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define SC_WGMMA_ACC64 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define SC_WGMMA_D128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define SC_WGMMA_ACC128 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define SC_WGMMA_D192 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define SC_WGMMA_ACC192 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
#define SC_WGMMA_D256 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define SC_WGMMA_ACC256 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
#define SC_WGMMA_D16 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define SC_WGMMA_ACC16 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define SC_WGMMA_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define SC_WGMMA_ACC32 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define SC_WGMMA_D224 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111}"
#define SC_WGMMA_ACC224 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111])
#define SC_WGMMA_D80 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}"
#define SC_WGMMA_ACC80 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
#define SC_WGMMA_D96 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}"
#define SC_WGMMA_ACC96 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
#define SC_WGMMA_D160 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}"
#define SC_WGMMA_ACC160 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
#define SC_DEFINE_WGMMA_RS(N, T, TY, TB, A0, A1, A2, A3, B)                                                  \
  template <> struct WgmmaRS<N, T, TB> {                                                                      \
    static __device__ __forceinline__ void mma(float* d, const unsigned* a, unsigned long long desc_b) {      \
      asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"                                              \
                   " wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " SC_WGMMA_D##N             \
                   ", {%" #A0 ", %" #A1 ", %" #A2 ", %" #A3 "}, %" #B ", p, 1, 1, " #TB ";\n}\n"                  \
                   : SC_WGMMA_ACC##N                                                                          \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));                                \
    }                                                                                                         \
  };
SC_DEFINE_WGMMA_RS(64, __half, "f16", 1, 32, 33, 34, 35, 36)
SC_DEFINE_WGMMA_RS(64, __nv_bfloat16, "bf16", 1, 32, 33, 34, 35, 36)
SC_DEFINE_WGMMA_RS(128, __half, "f16", 1, 64, 65, 66, 67, 68)
SC_DEFINE_WGMMA_RS(128, __nv_bfloat16, "bf16", 1, 64, 65, 66, 67, 68)
SC_DEFINE_WGMMA_RS(192, __half, "f16", 1, 96, 97, 98, 99, 100)
SC_DEFINE_WGMMA_RS(192, __nv_bfloat16, "bf16", 1, 96, 97, 98, 99, 100)
SC_DEFINE_WGMMA_RS(256, __half, "f16", 1, 128, 129, 130, 131, 132)
SC_DEFINE_WGMMA_RS(256, __nv_bfloat16, "bf16", 1, 128, 129, 130, 131, 132)
SC_DEFINE_WGMMA_RS(32, __half, "f16", 0, 16, 17, 18, 19, 20)
SC_DEFINE_WGMMA_RS(32, __nv_bfloat16, "bf16", 0, 16, 17, 18, 19, 20)
SC_DEFINE_WGMMA_RS(64, __half, "f16", 0, 32, 33, 34, 35, 36)
SC_DEFINE_WGMMA_RS(64, __nv_bfloat16, "bf16", 0, 32, 33, 34, 35, 36)
SC_DEFINE_WGMMA_RS(128, __half, "f16", 0, 64, 65, 66, 67, 68)
SC_DEFINE_WGMMA_RS(128, __nv_bfloat16, "bf16", 0, 64, 65, 66, 67, 68)
SC_DEFINE_WGMMA_RS(96, __half, "f16", 0, 48, 49, 50, 51, 52)
SC_DEFINE_WGMMA_RS(96, __nv_bfloat16, "bf16", 0, 48, 49, 50, 51, 52)
SC_DEFINE_WGMMA_RS(160, __half, "f16", 0, 80, 81, 82, 83, 84)
SC_DEFINE_WGMMA_RS(160, __nv_bfloat16, "bf16", 0, 80, 81, 82, 83, 84)
SC_DEFINE_WGMMA_RS(192, __half, "f16", 0, 96, 97, 98, 99, 100)
SC_DEFINE_WGMMA_RS(192, __nv_bfloat16, "bf16", 0, 96, 97, 98, 99, 100)
SC_DEFINE_WGMMA_RS(256, __half, "f16", 0, 128, 129, 130, 131, 132)
SC_DEFINE_WGMMA_RS(256, __nv_bfloat16, "bf16", 0, 128, 129, 130, 131, 132)
#undef SC_DEFINE_WGMMA_RS


// The A-and-B-from-shared-memory shapes: N = 64, 128, 256 with B K-major (TB = 0) or N-major (TB = 1), and the
// key tiles of 80, 176 and 192 that attention uses.
#define SC_DEFINE_WGMMA_SS(N, T, TY, TB, DA, DB, SD)                                                          \
  template <> struct Wgmma<N, T, TB> {                                                                        \
    static __device__ __forceinline__ void mma(float* d, unsigned long long desc_a, unsigned long long desc_b, \
                                               int scale_d) {                                                 \
      asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %" #SD ", 0;\n"                                        \
                   " wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " SC_WGMMA_D##N             \
                   ", %" #DA ", %" #DB ", p, 1, 1, 0, " #TB ";\n}\n"                                              \
                   : SC_WGMMA_ACC##N                                                                          \
                   : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                                 \
    }                                                                                                         \
  };
SC_DEFINE_WGMMA_SS(64, __half, "f16", 0, 32, 33, 34)
SC_DEFINE_WGMMA_SS(64, __nv_bfloat16, "bf16", 0, 32, 33, 34)
SC_DEFINE_WGMMA_SS(64, __half, "f16", 1, 32, 33, 34)
SC_DEFINE_WGMMA_SS(64, __nv_bfloat16, "bf16", 1, 32, 33, 34)
SC_DEFINE_WGMMA_SS(128, __half, "f16", 0, 64, 65, 66)
SC_DEFINE_WGMMA_SS(128, __nv_bfloat16, "bf16", 0, 64, 65, 66)
SC_DEFINE_WGMMA_SS(128, __half, "f16", 1, 64, 65, 66)
SC_DEFINE_WGMMA_SS(128, __nv_bfloat16, "bf16", 1, 64, 65, 66)
SC_DEFINE_WGMMA_SS(256, __half, "f16", 0, 128, 129, 130)
SC_DEFINE_WGMMA_SS(256, __nv_bfloat16, "bf16", 0, 128, 129, 130)
SC_DEFINE_WGMMA_SS(256, __half, "f16", 1, 128, 129, 130)
SC_DEFINE_WGMMA_SS(256, __nv_bfloat16, "bf16", 1, 128, 129, 130)
SC_DEFINE_WGMMA_SS(176, __half, "f16", 0, 88, 89, 90)
SC_DEFINE_WGMMA_SS(176, __nv_bfloat16, "bf16", 0, 88, 89, 90)
SC_DEFINE_WGMMA_SS(192, __half, "f16", 0, 96, 97, 98)
SC_DEFINE_WGMMA_SS(192, __nv_bfloat16, "bf16", 0, 96, 97, 98)
SC_DEFINE_WGMMA_SS(80, __half, "f16", 0, 40, 41, 42)
SC_DEFINE_WGMMA_SS(80, __nv_bfloat16, "bf16", 0, 40, 41, 42)
// Narrow and 224-wide shapes of the GEMM (B K-major): m64n16/n32 for 64-row decode tiles split over two
// warpgroups, n224 for 128 x 224 tiles that fit N = 14336 / 28672 in whole waves.
SC_DEFINE_WGMMA_SS(16, __half, "f16", 0, 8, 9, 10)
SC_DEFINE_WGMMA_SS(16, __nv_bfloat16, "bf16", 0, 8, 9, 10)
SC_DEFINE_WGMMA_SS(32, __half, "f16", 0, 16, 17, 18)
SC_DEFINE_WGMMA_SS(32, __nv_bfloat16, "bf16", 0, 16, 17, 18)
SC_DEFINE_WGMMA_SS(224, __half, "f16", 0, 112, 113, 114)
SC_DEFINE_WGMMA_SS(224, __nv_bfloat16, "bf16", 0, 112, 113, 114)
#undef SC_DEFINE_WGMMA_SS

}  // namespace sc
