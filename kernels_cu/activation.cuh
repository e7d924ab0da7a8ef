// cugrouped/kernels_cu/activation.cuh -- the activations a cast kernel can apply to its input
// before casting (the gated unit between an MoE layer's fc1 and fc2), with the same bits on the
// GPU, on the CPU emulator and in the NumPy twin (cugrouped/reference/activation.py).
//
//   silu(a)      = a / (1 + exp(-a))
//   swiglu(a, b) = silu(a) * b          (Megatron's gated linear unit over fc1's halves [a | b])
//
// exp is computed here, not by expf: CUDA's expf ends in the hardware's ex2.approx, which no CPU
// reproduces. Every step is one IEEE-rounded multiplication, addition or division (no FMA: the
// __f*_rn intrinsics are never contracted, and the host path is built without contraction), and
// with -ftz=true the GPU flushes each result as ftz() does on the host:
//   x = clamp(-a, -87, 88); n = rint(x log2 e) (by adding and subtracting 1.5 * 2^23);
//   r = (x - n C1) - n C2  (Cody-Waite: C1 = 355/512 exactly, so n C1 is exact);
//   exp(r) ~ 1 + r + r^2 (c2 + c3 r + c4 r^2 + c5 r^3 + c6 r^4)  (Horner), times 2^n (exact);
//   x > 88: inf, x < -87: 0.
// Within 1 ulp for exp (x in [-87, 88]) and 2.5 ulps for silu for every a >= -88: 0.99 and 2.44
// at worst over every float32 (measured against float64 on 2026-12-04; sampled in
// tests/test_activation.py). Below -88 silu is -0, where the exact value is a float32 of
// magnitude below 5.4e-37 (normal down to a = -91.6; flushed below).
#pragma once
#include "common.cuh"
#include "fp8.cuh"

namespace cg {

enum class Act : int { NONE = 0, SWIGLU = 1 };

// One IEEE-rounded operation, flushed like the GPU's -ftz=true.
CG_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return ftz(a * b);
#endif
}
CG_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return ftz(a + b);
#endif
}
CG_HOST_DEVICE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return ftz(a / b);
#endif
}

// exp(x), float32, as the header describes.
CG_HOST_DEVICE float exp_portable(float x) {
    constexpr u32 kLog2e = 0x3FB8AA3Bu;     // 1.44269502f
    constexpr u32 kC1 = 0x3F318000u;        // 0.693359375 = 355 / 512
    constexpr u32 kC2 = 0xB95E8083u;        // -2.12194442e-4
    constexpr float kRound = 12582912.f;    // 1.5 * 2^23
    const bool nan = x != x;
    float xc = nan ? -87.f : x;
    xc = xc < -87.f ? -87.f : xc > 88.f ? 88.f : xc;
    const float t = add_rn(mul_rn(xc, bits_f32(kLog2e)), kRound);
    const float n_f = add_rn(t, -kRound);
    const int n = static_cast<int>(f32_bits(t) - 0x4B400000u);
    const float r = add_rn(add_rn(xc, -mul_rn(n_f, bits_f32(kC1))), -mul_rn(n_f, bits_f32(kC2)));
    float q = bits_f32(0x3AB43E11u);
    q = add_rn(mul_rn(q, r), bits_f32(0x3C091DC7u));
    q = add_rn(mul_rn(q, r), bits_f32(0x3D2AADACu));
    q = add_rn(mul_rn(q, r), bits_f32(0x3E2AAA47u));
    q = add_rn(mul_rn(q, r), bits_f32(0x3EFFFFFCu));
    const float p = add_rn(add_rn(mul_rn(mul_rn(r, r), q), r), 1.f);
    const float e = mul_rn(p, bits_f32(static_cast<u32>(n + 127) << 23));
    return x > 88.f ? bits_f32(0x7F800000u) : x < -87.f ? 0.f : e;
}

CG_HOST_DEVICE float silu(float a) {
    a = ftz(a);
    return div_rn(a, add_rn(exp_portable(-a), 1.f));
}

// The activation of one output element from its input halves (a: column c, b: column c + k).
template <Act ACT>
CG_HOST_DEVICE float activate(float a, float b) {
    if (ACT == Act::SWIGLU) return mul_rn(silu(a), ftz(b));
    return a;
}

}  // namespace cg
