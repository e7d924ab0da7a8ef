// cugrouped/kernels_cu/fp8.cuh -- FP8 / bf16 / fp16 conversions and scale arithmetic.
//
// Self-contained (design.md §2, §3, §7): no CUDA header, no system header. Every function here
// has a portable bit-manipulation path that the CPU emulator and the host test harness
// (tests/fp8_sweep.cpp) run; inline PTX is used only behind
// `#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890`, and the portable path gives the same bits
// for every float32 input (tested over all 2^32 patterns, `pytest -m exhaustive`).
//
// The NumPy twin is cugrouped/reference/fp8.py; keep the two in step.
//
// Quantization rule (PTX `cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`):
//   * round to nearest, ties to even, FP8 subnormals included, underflow to a zero of the sign
//     of the input;
//   * |x| above the largest finite value (including +-inf) saturates to +-max (448 / 57344);
//   * NaN (any sign, any payload) -> 0x7F, for both formats.
//
// NaN byte -- where it comes from: CUDA 13.0's cuda_fp8.hpp, `__nv_cvt_float_to_fp8`, whose
// sm_89+ branch *is* `cvt.rn.satfinite.e{4m3,5m2}x2.f32` and whose software branch (NVIDIA's
// model of that instruction) first replaces any float NaN by the canonical 0x7FFFFFFF ("Canonical
// NaN") and then converts through `__nv_cvt_double_to_fp8`: E4M3 NaN -> `res = 0x7FU`, E5M2 NaN
// -> `0x7EU | mantissa` where the mantissa of 0x7FFFFFFF gives 0b11, i.e. 0x7F; the sign of a
// NaN is dropped. So both formats encode NaN as 0x7F (E4M3: 0.1111.111; E5M2: 0.11111.11, a quiet
// NaN). The PTX ISA itself only says the result is NaN; the GPU test compares the exact byte
// (scripts/gpu_check.sh) so a hardware deviation would show up there.
//
// FTZ: CuPy's RawModule always compiles with -ftz=true, so on the GPU float32 denormal inputs
// and results of float arithmetic are flushed to (sign-preserving) zero. NaN: a float32 NaN that
// arithmetic produces on an NVIDIA GPU is always the one canonical NaN 0x7FFFFFFF (no sign, no
// payload), where x86 keeps an operand's payload (and makes inf - inf 0xFFC00000). `ftz()` below
// is the identity on the device (the hardware does both) and an explicit flush and NaN
// canonicalisation elsewhere, so code that applies it at the same places computes the same bits
// on the GPU, in the emulator and in NumPy. Applied to an operand it changes nothing the GPU
// would compute from it: a flushed denormal is what the GPU's arithmetic reads, and any NaN
// operand gives the canonical NaN (FP8 conversion gives byte 0x7F for every NaN).
#pragma once

#include "common.cuh"

namespace cg {

enum class Fp8Format { E4M3 = 0, E5M2 = 1 };

template <Fp8Format F> struct Fp8Traits;

template <> struct Fp8Traits<Fp8Format::E4M3> {
    static constexpr float max = 448.f;        // 0.1111.110 = 1.75 * 2^8
    static constexpr u32 max_bits = 0x43E00000u; // float32 bits of 448
    static constexpr int exp_bits = 4;
    static constexpr int man_bits = 3;
    static constexpr int bias = 7;
    static constexpr u8 max_byte = 0x7E;
};

template <> struct Fp8Traits<Fp8Format::E5M2> {
    static constexpr float max = 57344.f;       // 0.11110.11 = 1.75 * 2^15
    static constexpr u32 max_bits = 0x47600000u; // float32 bits of 57344
    static constexpr int exp_bits = 5;
    static constexpr int man_bits = 2;
    static constexpr int bias = 15;
    static constexpr u8 max_byte = 0x7B;
};

// The byte that `cvt.rn.satfinite` produces for a NaN input, both formats (see the header).
static constexpr u8 kFp8NaN = 0x7F;
// FLT_MAX, 0x1.fffffep+127 (no <cfloat> under NVRTC).
static constexpr u32 kFltMaxBits = 0x7F7FFFFFu;

// ---------------------------------------------------------------------------------------------
// A float32 as the GPU's arithmetic leaves it: denormals flushed (-ftz=true), NaN canonical.
// ---------------------------------------------------------------------------------------------
static constexpr u32 kCanonicalNaNBits = 0x7FFFFFFFu;

CG_HOST_DEVICE float ftz(float x) {
#if defined(__CUDA_ARCH__)
    return x;  // the hardware flushes denormal operands and results and makes NaN canonical
#else
    const u32 u = f32_bits(x);
    if ((u & 0x7F800000u) == 0u) return bits_f32(u & 0x80000000u);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? bits_f32(kCanonicalNaNBits) : x;
#endif
}

// ---------------------------------------------------------------------------------------------
// float32 -> FP8, round-to-nearest-even, satfinite. Portable path (bit manipulation only; no
// float arithmetic, so FTZ mode and compiler flags cannot change it).
// ---------------------------------------------------------------------------------------------
template <Fp8Format F>
CG_HOST_DEVICE u8 float_to_fp8_portable(float x) {
    typedef Fp8Traits<F> T;
    const int M = T::man_bits;
    const int B = T::bias;
    const u32 u = f32_bits(x);
    const u32 sign = (u >> 24) & 0x80u;
    u32 a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return kFp8NaN;           // NaN: canonical byte, sign dropped
    if (a >= T::max_bits) return (u8)(sign | T::max_byte);  // >= max (incl. inf): saturate
    const int e = (int)(a >> 23) - 127;              // unbiased float32 exponent
    // Below half the smallest FP8 subnormal, 2^(1-B-M-1) (ties to even go to 0 as well): +-0.
    // Float32 denormals (e == -127) land here too.
    if (e < 1 - B - M - 1) return (u8)sign;
    const u32 sig = (a & 0x007FFFFFu) | 0x00800000u;  // 24-bit significand with implicit bit
    // Number of low significand bits that the FP8 value cannot hold: 23 - M for FP8 normals,
    // more for FP8 subnormals (exponent below 1 - B). At most 24 by the test above.
    const int sub = (1 - B) - e;                      // > 0: FP8 subnormal
    const int drop = (23 - M) + (sub > 0 ? sub : 0);
    u32 kept = sig >> drop;
    const u32 rem = sig & ((1u << drop) - 1u);
    const u32 half = 1u << (drop - 1);
    if (rem > half || (rem == half && (kept & 1u))) kept += 1u;
    // FP8 normal: kept = 2^M + mantissa, the carry of a round-up moves into the exponent field.
    // FP8 subnormal: kept is the value in units of the smallest subnormal; 2^M is the smallest
    // normal's encoding. Values were clamped below max, so rounding never passes max.
    const int ebase = e + B - 1;
    const u32 mag = (ebase > 0 ? ((u32)ebase << M) : 0u) + kept;
    return (u8)(sign | mag);
}

// Two values at once, `lo` in the low byte (little-endian memory order: lo, hi).
template <Fp8Format F>
CG_HOST_DEVICE u16 float2_to_fp8x2_portable(float lo, float hi) {
    return (u16)((u32)float_to_fp8_portable<F>(lo) | ((u32)float_to_fp8_portable<F>(hi) << 8));
}

// The conversions kernels call: PTX on sm_89+, the portable path elsewhere; same bits.
template <Fp8Format F>
CG_HOST_DEVICE u16 float2_to_fp8x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    u16 r;
    // PTX packs the FIRST source operand into the UPPER byte: pass (hi, lo).
    if (F == Fp8Format::E4M3) {
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    }
    return r;
#else
    return float2_to_fp8x2_portable<F>(lo, hi);
#endif
}

template <Fp8Format F>
CG_HOST_DEVICE u8 float_to_fp8(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    return (u8)(float2_to_fp8x2<F>(x, 0.f) & 0xFFu);
#else
    return float_to_fp8_portable<F>(x);
#endif
}

// ---------------------------------------------------------------------------------------------
// Narrow formats -> float32, exact. Bit manipulation plus, for subnormals, an exact product of a
// small integer and a normal power of two (never a float32 denormal, so FTZ cannot touch it).
// ---------------------------------------------------------------------------------------------

// fp16 -> float32. Infinities keep their sign; NaN keeps sign and payload (payload << 13), as
// IEEE widening and NumPy's float16 -> float32 do.
CG_HOST_DEVICE float half_to_float(u16 h) {
    const u32 sign = ((u32)h & 0x8000u) << 16;
    const u32 e = ((u32)h >> 10) & 0x1Fu;
    const u32 m = (u32)h & 0x3FFu;
    if (e == 0x1Fu) return bits_f32(sign | 0x7F800000u | (m << 13));
    if (e != 0u) return bits_f32(sign | ((e + 112u) << 23) | (m << 13));  // 112 = 127 - 15
    // zero or subnormal: m * 2^-24 (exact: m < 2^10, the product >= 2^-24 is a float32 normal)
    const float mag = (float)(int)m * bits_f32(0x33800000u);  // 2^-24
    return bits_f32(sign | f32_bits(mag));
}

// bf16 -> float32: the upper half of the float32 pattern (NaN payloads kept).
CG_HOST_DEVICE float bf16_to_float(u16 b) {
    return bits_f32((u32)b << 16);
}

// FP8 -> float32, exact. NaN bytes (E4M3 S.1111.111, E5M2 S.11111.xx with xx != 0) give the
// canonical float NaN 0x7FFFFFFF (sign and payload dropped, as NVIDIA's cuda_fp8.hpp does when
// widening FP8 NaN); E5M2 infinities give +-inf.
template <Fp8Format F>
CG_HOST_DEVICE float fp8_to_float(u8 v) {
    typedef Fp8Traits<F> T;
    const int M = T::man_bits;
    const u32 sign = ((u32)v & 0x80u) << 24;
    const u32 e = ((u32)v >> M) & ((1u << T::exp_bits) - 1u);
    const u32 m = (u32)v & ((1u << M) - 1u);
    if (F == Fp8Format::E4M3) {
        if (e == 0xFu && m == 0x7u) return bits_f32(0x7FFFFFFFu);
    } else {
        if (e == 0x1Fu) return m ? bits_f32(0x7FFFFFFFu) : bits_f32(sign | 0x7F800000u);
    }
    if (e != 0u) return bits_f32(sign | ((e + (u32)(127 - T::bias)) << 23) | (m << (23 - M)));
    // zero or subnormal: m * 2^(1 - bias - M), exact and a float32 normal
    const u32 min_sub_exp = (u32)(127 + 1 - T::bias - M);  // E4M3: 2^-9, E5M2: 2^-16
    const float mag = (float)(int)m * bits_f32(min_sub_exp << 23);
    return bits_f32(sign | f32_bits(mag));
}

// ---------------------------------------------------------------------------------------------
// Scales (current scaling, design.md §3): scale = fp8_max / amax / 2^margin.
// ---------------------------------------------------------------------------------------------

// An amax a scale can be derived from: positive, normal and finite (decided on bits, so the
// GPU's FTZ comparisons cannot disagree with the CPU).
CG_HOST_DEVICE bool amax_usable(float amax) {
    const u32 u = f32_bits(amax);
    const u32 ex = u & 0x7F800000u;
    return !(u & 0x80000000u) && ex != 0u && ex != 0x7F800000u;
}

// compute_scale (current scaling; the delayed update keeps the old scale instead of 1):
// * amax == +-0, a float32 denormal (0 on the GPU under FTZ), inf, NaN or negative -> 1.
// * otherwise q = fp8_max / amax in float32 (IEEE division, correctly rounded; q is never a
//   denormal since amax <= FLT_MAX); q = inf (amax below fp8_max / FLT_MAX) -> FLT_MAX.
// * then q / 2^margin, done on the exponent field (exact): a result that would exceed FLT_MAX
//   (negative margin) -> FLT_MAX, one that would fall below FLT_MIN -> +0 (what FTZ does; decided
//   from the exact value, so there is no tininess-before/after-rounding ambiguity).
// Every decision is taken on bits, so the GPU (FTZ comparisons) and the CPU agree by construction;
// the only float operation is the division.

template <Fp8Format F>
CG_HOST_DEVICE float compute_scale_no_options(float amax, int margin) {
    if (!amax_usable(amax)) return 1.f;
    const u32 q = f32_bits(Fp8Traits<F>::max / amax);  // positive normal or +inf
    if (q >= 0x7F800000u) return bits_f32(kFltMaxBits);
    margin = margin < -512 ? -512 : (margin > 512 ? 512 : margin);
    const int e = (int)(q >> 23) - margin;               // new biased exponent
    if (e >= 255) return bits_f32(kFltMaxBits);
    if (e <= 0) return 0.f;
    return bits_f32((q & 0x007FFFFFu) | ((u32)e << 23));
}

// Two options of TransformerEngine's current scaling (its QParams), both off by default:
// * amax_epsilon (0 or a positive normal float32, checked by the host): an amax below it (after
//   FTZ: zero, denormal and negative included; NaN and inf are not below anything) is raised to
//   it first, so an all-zero tensor gets fp8_max / amax_epsilon rather than 1. The comparison
//   involves no denormal operand, so FTZ cannot change it.
// * power_2: the final scale rounded down to a power of two by clearing its mantissa (exact;
//   1 and 0 stay, FLT_MAX becomes 2^127), so that scaling and unscaling lose no bits.
template <Fp8Format F>
CG_HOST_DEVICE float compute_scale(float amax, int margin, float amax_epsilon = 0.f,
                                   bool power_2 = false) {
    if (amax_epsilon > 0.f && ftz(amax) < amax_epsilon) amax = amax_epsilon;
    const float s = compute_scale_no_options<F>(amax, margin);
    return power_2 ? bits_f32(f32_bits(s) & 0xFF800000u) : s;
}

// scale_inv = 1 / scale, float32, with the FTZ of the GPU on operand and result.
CG_HOST_DEVICE float scale_inverse(float s) {
    return ftz(1.f / ftz(s));
}

// ---------------------------------------------------------------------------------------------
// MXFP8 (OCP microscaling; TransformerEngine's MXFP8BlockScaling): a block of 32 elements shares
// an E8M0 scale byte e (the power of two 2^(e - 127), no sign, no mantissa), the one the GEMM
// reads; the elements are multiplied by 2^(127 - e) before the FP8 conversion.
// ---------------------------------------------------------------------------------------------

// 1 / fp8_max as a float32 (TransformerEngine's max_norm_rcp): a product, not a division, so the
// bits below are the ones the GPU uses. 1/448 and 1/57344 (both ways of rounding agree).
template <Fp8Format F> struct MxTraits;
template <> struct MxTraits<Fp8Format::E4M3> { static constexpr u32 max_rcp_bits = 0x3B124925u; };
template <> struct MxTraits<Fp8Format::E5M2> { static constexpr u32 max_rcp_bits = 0x37924925u; };

// float32 -> E8M0 rounding the power of two up (PTX `cvt.rp.satfinite.ue8m0x2.f32`, sm_100+, and
// TransformerEngine's portable float_to_e8m0): the biased exponent, plus one if any mantissa bit
// is set; NaN -> 0xFF, +inf and values above 2^127 -> 0xFE; zero -> 0x00; a denormal -> 0x00 up
// to 2^-127, else 0x01 (not reached after FTZ). Bits only.
CG_HOST_DEVICE u8 float_to_e8m0(float v) {
    const u32 u = f32_bits(v) & 0x7FFFFFFFu;
    if (u > 0x7F800000u) return 0xFF;
    if (u == 0x7F800000u) return 0xFE;
    u32 e = u >> 23;
    const u32 man = u & 0x007FFFFFu;
    if (man > 0u && e != 0xFEu && !(e == 0u && man <= 0x00400000u)) ++e;
    return static_cast<u8>(e);
}

// The E8M0 scale byte of a block from its amax (>= 0, NaN already ignored): amax * (1/fp8_max)
// in float32, rounded up to a power of two, so that amax * 2^(127 - e) <= fp8_max (up to the
// rounding of the product), clamped to [0, 254]. An all-zero block gets 0x00 (2^-127); an inf
// gets 0xFE. A tiny amax (< 2^-64) is scaled by 2^64 first and the exponent taken back after:
// its product would otherwise be a denormal, which FTZ flushes to 0 -- byte 0x00 for an amax up
// to 2x too large for it, and elements saturating. (Without FTZ TransformerEngine's product
// keeps that exponent; with both, the bytes agree but at the product's rounding in that range.)
template <Fp8Format F>
CG_HOST_DEVICE u8 mx_scale_byte(float amax) {
    const bool tiny = f32_bits(amax) < 0x1F800000u;                    // amax < 2^-64
    const float a = tiny ? ftz(amax * bits_f32(0x5F800000u)) : amax;   // exact: times 2^64
    const int e = float_to_e8m0(ftz(a * bits_f32(MxTraits<F>::max_rcp_bits))) - (tiny ? 64 : 0);
    return static_cast<u8>(e < 0 ? 0 : e);
}

// The multiplier of the elements, 2^(127 - e) (0xFF -> NaN, 0xFE -> 2^-127), flushed as the GPU
// flushes a denormal operand: 0xFE (an inf in the block) multiplies by 0, so finite elements
// become 0 and the inf NaN. Byte 0x00 multiplies by 2^127, so a block of tiny non-zero values
// keeps its bytes (TransformerEngine's exp2f_rcp multiplies such a block by 1, i.e. to zeros).
CG_HOST_DEVICE float mx_element_scale(u8 e) {
    const u32 bits = e == 0xFFu ? 0x7FFFFFFFu : e == 0xFEu ? 0x00400000u : (254u - e) << 23;
    return ftz(bits_f32(bits));
}

}  // namespace cg
