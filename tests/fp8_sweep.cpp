// Host harness for kernels_cu/fp8.cuh, loaded with ctypes by tests/test_fp8_numerics.py.
//
// Built as plain host C++ (no __CUDACC__, no CUGROUPED_EMULATE), so it runs exactly the portable
// paths that the emulator and GPUs below sm_89 run:
//   g++ -O2 -std=c++17 -shared -fPIC -I kernels_cu tests/fp8_sweep.cpp -o libfp8_sweep.so
#include "fp8.cuh"

using namespace cg;

namespace {

template <Fp8Format F>
void convert_range_t(u32 start, u64 count, u8* out) {
    for (u64 i = 0; i < count; ++i) out[i] = float_to_fp8<F>(bits_f32((u32)(start + i)));
}

template <Fp8Format F>
void convert_bits_t(const u32* in, u64 n, u8* out) {
    for (u64 i = 0; i < n; ++i) out[i] = float_to_fp8<F>(bits_f32(in[i]));
}

template <Fp8Format F>
void convert_pairs_t(const u32* lo, const u32* hi, u64 n, u16* out) {
    for (u64 i = 0; i < n; ++i) out[i] = float2_to_fp8x2<F>(bits_f32(lo[i]), bits_f32(hi[i]));
}

}  // namespace

extern "C" {

// out[i] = float_to_fp8(bits (start + i)), i < count (wraps modulo 2^32).
void convert_range(u32 start, u64 count, int fmt, u8* out) {
    if (fmt == 0) convert_range_t<Fp8Format::E4M3>(start, count, out);
    else convert_range_t<Fp8Format::E5M2>(start, count, out);
}

// out[i] = float_to_fp8(bits in[i]).
void convert_bits(const u32* in, u64 n, int fmt, u8* out) {
    if (fmt == 0) convert_bits_t<Fp8Format::E4M3>(in, n, out);
    else convert_bits_t<Fp8Format::E5M2>(in, n, out);
}

// out[i] = float2_to_fp8x2(lo[i], hi[i]) (low byte from lo).
void convert_pairs(const u32* lo, const u32* hi, u64 n, int fmt, u16* out) {
    if (fmt == 0) convert_pairs_t<Fp8Format::E4M3>(lo, hi, n, out);
    else convert_pairs_t<Fp8Format::E5M2>(lo, hi, n, out);
}

// out[0..255] = float32 bits of fp8_to_float(byte).
void fp8_to_float_all(int fmt, u32* out) {
    for (u32 b = 0; b < 256; ++b)
        out[b] = f32_bits(fmt == 0 ? fp8_to_float<Fp8Format::E4M3>((u8)b)
                                   : fp8_to_float<Fp8Format::E5M2>((u8)b));
}

// out[0..65535] = float32 bits of bf16_to_float(h) / half_to_float(h).
void bf16_to_float_all(u32* out) {
    for (u32 h = 0; h < 65536; ++h) out[h] = f32_bits(bf16_to_float((u16)h));
}
void half_to_float_all(u32* out) {
    for (u32 h = 0; h < 65536; ++h) out[h] = f32_bits(half_to_float((u16)h));
}

void compute_scale_array(const float* amax, u64 n, int fmt, int margin, float* out) {
    for (u64 i = 0; i < n; ++i)
        out[i] = fmt == 0 ? compute_scale<Fp8Format::E4M3>(amax[i], margin)
                          : compute_scale<Fp8Format::E5M2>(amax[i], margin);
}

void compute_scale_options_array(const float* amax, u64 n, int fmt, int margin, float eps,
                                 int power_2, float* out) {
    for (u64 i = 0; i < n; ++i)
        out[i] = fmt == 0 ? compute_scale<Fp8Format::E4M3>(amax[i], margin, eps, power_2 != 0)
                          : compute_scale<Fp8Format::E5M2>(amax[i], margin, eps, power_2 != 0);
}

void scale_inverse_array(const float* s, u64 n, float* out) {
    for (u64 i = 0; i < n; ++i) out[i] = scale_inverse(s[i]);
}

void ftz_array(const float* x, u64 n, float* out) {
    for (u64 i = 0; i < n; ++i) out[i] = ftz(x[i]);
}

}  // extern "C"
