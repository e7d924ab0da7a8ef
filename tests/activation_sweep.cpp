// Host harness for kernels_cu/activation.cuh, loaded with ctypes by tests/test_activation.py.
//
// Built as plain host C++ (no __CUDACC__, no CUGROUPED_EMULATE), so it runs the portable paths
// that the emulator runs (the GPU's __f*_rn intrinsics are the same IEEE operations):
//   g++ -O2 -std=c++17 -ffp-contract=off -shared -fPIC -I kernels_cu tests/activation_sweep.cpp
#include "activation.cuh"

using namespace cg;

extern "C" {

// out[i] = bits of exp_portable(bits in[i]).
void exp_bits(const u32* in, u64 n, u32* out) {
    for (u64 i = 0; i < n; ++i) out[i] = f32_bits(exp_portable(bits_f32(in[i])));
}

// out[i] = bits of silu(bits in[i]).
void silu_bits(const u32* in, u64 n, u32* out) {
    for (u64 i = 0; i < n; ++i) out[i] = f32_bits(silu(bits_f32(in[i])));
}

// out[i] = bits of activate<SWIGLU>(bits a[i], bits b[i]).
void swiglu_bits(const u32* a, const u32* b, u64 n, u32* out) {
    for (u64 i = 0; i < n; ++i)
        out[i] = f32_bits(activate<Act::SWIGLU>(bits_f32(a[i]), bits_f32(b[i])));
}

}  // extern "C"
