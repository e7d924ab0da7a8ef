// cugrouped/kernels_cu/common.cuh -- basics shared by every kernel source.
//
// The sources in kernels_cu/ are compiled three ways and must be self-contained for all three:
//   * NVRTC (cupy.RawModule, and `python -m cugrouped compile-check`): NVRTC 13 ships no headers,
//     not even <cstdint>, so nothing here includes a system or CUDA header;
//   * the CPU emulator (cugrouped/emulate): g++ with cuda_emu.h force-included, which defines the
//     CUDA keywords and built-ins and CUGROUPED_EMULATE;
//   * plain host C++ (small numeric test harnesses): the keywords below collapse to nothing.
// Inline PTX is only ever used behind `#if defined(__CUDA_ARCH__)`, with a portable path of
// identical bits that the emulator and host harnesses run.
#pragma once

#if !defined(__CUDACC__) && !defined(CUGROUPED_EMULATE)
// Plain host C++: make device code compile as ordinary inline functions.
#ifndef __device__
#define __device__
#endif
#ifndef __host__
#define __host__
#endif
#ifndef __forceinline__
#define __forceinline__ inline __attribute__((always_inline))
#endif
#endif

#define CG_DEVICE __device__ __forceinline__
#define CG_HOST_DEVICE __host__ __device__ __forceinline__

namespace cg {

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;

// Bit casts that every compiler involved accepts (memcpy would need <cstring> under NVRTC).
CG_HOST_DEVICE u32 f32_bits(float x) {
    union { float f; u32 u; } v;
    v.f = x;
    return v.u;
}
CG_HOST_DEVICE float bits_f32(u32 u) {
    union { float f; u32 u; } v;
    v.u = u;
    return v.f;
}

}  // namespace cg
