// Register-level dequantization shared by the weight-only quantized kernels (kernels/quant.cu, quant_sm90.cu):
// 4-bit values (int4_fragment) and signed bytes (int8_pair).
//
// 4-bit values become fp16 / bf16 by OR-ing them into the mantissa of a magic number (1024 for fp16, 128 for
// bf16); one fma then removes magic + zero point exactly and one multiplies by the scale, so (q - z) s is rounded
// once to T, as the NumPy references do.  fp16 also reads the second nibble of a byte in place, as
// (1024 + 16 q) scaled by 1/16, which saves a shift.
#pragma once
#include "types.cuh"

namespace sc {

template <typename T> struct is_half { static constexpr bool value = false; };
template <> struct is_half<__half> { static constexpr bool value = true; };

__device__ __forceinline__ unsigned fma2(unsigned a, unsigned b, unsigned c, __half*) {
  unsigned d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ unsigned fma2(unsigned a, unsigned b, unsigned c, __nv_bfloat16*) {
  unsigned d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
template <typename T> __device__ __forceinline__ unsigned fma2(unsigned a, unsigned b, unsigned c) {
  return fma2(a, b, c, static_cast<T*>(nullptr));
}

// Packed-pair constants of T.
template <typename T> struct Bits;
template <> struct Bits<__half> {
  static constexpr unsigned ONE = 0x3c003c00u;
  static constexpr unsigned NEG_ZERO = 0x80008000u;
  static constexpr unsigned SIXTEENTH = 0x2c002c00u;
};
template <> struct Bits<__nv_bfloat16> {
  static constexpr unsigned ONE = 0x3f803f80u;
  static constexpr unsigned NEG_ZERO = 0x80008000u;
};

// (a & b) | c in one instruction; with the constants in registers (an immediate operand would split it in two).
__device__ __forceinline__ unsigned and_or(unsigned a, unsigned b, unsigned c) {
  unsigned d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// The magic number in both halves: 1024 (fp16) or 128 (bf16), whose low mantissa bits take a nibble.
template <typename T> constexpr unsigned int4_magic = is_half<T>::value ? 0x64006400u : 0x43004300u;

// The term that removes magic + zero point z, in both halves: -(1024 + z) for fp16 nibbles read at bits 0-3,
// -(64 + z) for those read at bits 4-7 (HI: (1024 + 16 q) / 16), -(128 + z) for bf16.
template <typename T> __device__ __forceinline__ unsigned int4_zero_term(unsigned z, bool hi) {
  if constexpr (is_half<T>::value) {
    return (hi ? (0xd400u + (z << 4)) : (0xe400u | z)) * 0x10001u;
  } else {
    return (0xc300u | z) * 0x10001u;
  }
}

// The m16n8k16 A fragment (the wgmma RS A fragment too) of one packed word wd: register r holds nibbles (r, r + 4)
// in its (low, high) half; registers 0 and 2 are row g (scale s0, zero term z0), 1 and 3 row g + 8 (s1, z1).
// magic: int4_magic<T>, passed in so that a caller can keep it in a register.
template <typename T>
__device__ __forceinline__ void int4_fragment(unsigned (&a)[4], unsigned wd, unsigned s0, unsigned s1, unsigned z0,
                                              unsigned z1, unsigned magic) {
  const unsigned mask_lo = 0x000f000fu;
  if constexpr (is_half<T>::value) {
    const unsigned mask_hi = 0x00f000f0u, w8 = wd >> 8;
    a[0] = fma2<T>(and_or(wd, mask_lo, magic), Bits<T>::ONE, z0);
    a[1] = fma2<T>(and_or(wd, mask_hi, magic), Bits<T>::SIXTEENTH, z1);
    a[2] = fma2<T>(and_or(w8, mask_lo, magic), Bits<T>::ONE, z0);
    a[3] = fma2<T>(and_or(w8, mask_hi, magic), Bits<T>::SIXTEENTH, z1);
  } else {
    a[0] = fma2<T>(and_or(wd, mask_lo, magic), Bits<T>::ONE, z0);
    a[1] = fma2<T>(and_or(wd >> 4, mask_lo, magic), Bits<T>::ONE, z1);
    a[2] = fma2<T>(and_or(wd >> 8, mask_lo, magic), Bits<T>::ONE, z0);
    a[3] = fma2<T>(and_or(wd >> 12, mask_lo, magic), Bits<T>::ONE, z1);
  }
  a[0] = fma2<T>(a[0], s0, Bits<T>::NEG_ZERO);
  a[1] = fma2<T>(a[1], s1, Bits<T>::NEG_ZERO);
  a[2] = fma2<T>(a[2], s0, Bits<T>::NEG_ZERO);
  a[3] = fma2<T>(a[3], s1, Bits<T>::NEG_ZERO);
}

// Two signed bytes (selected by SEL from u) to an exact pair of T.
template <typename T, unsigned SEL> __device__ __forceinline__ unsigned int8_pair(unsigned u) {
  if constexpr (is_half<T>::value) {
    // 1024 + (b + 128) in fp16, minus 1152.
    const unsigned p = __byte_perm(u ^ 0x80808080u, 0x64646464u, SEL);
    return fma2<T>(p, Bits<T>::ONE, 0xe480e480u);
  } else {
    // bf16 holds 128 + (7 low bits) exactly; the sign bit lands on the exponent's lowest bit: 128 or 256.
    const unsigned p = __byte_perm(u, 0x43434343u, SEL);
    return fma2<T>(p & 0xff7fff7fu, Bits<T>::ONE, (p & 0xff80ff80u) ^ 0x80008000u);
  }
}

}  // namespace sc
