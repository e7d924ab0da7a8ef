// cugrouped/emulate/cuda_emu.h -- run CUDA C kernels on the CPU (force-included by g++).
//
// cugrouped.emulate compiles a kernel source with `g++ -include cuda_emu.h`, then appends
// emu_runtime.cpp (the fiber scheduler and launcher) to the same translation unit. This header
// maps the CUDA built-ins our kernels use onto host code; everything else fails to compile.
//
// Execution model
//   * Each CUDA thread of a block is a cooperative fiber (64 KiB stack + guard page). Fibers switch
//     only at __syncthreads* and at warp collectives, so a run is deterministic; the order of the
//     fibers (forward / reverse / shuffled, or one warp at a time as far as it goes) is a launch
//     option, which exposes missing barriers.
//   * Blocks are spread over a few worker OS threads; one worker runs one block at a time, so
//     `__shared__` (a per-worker `static thread_local`) is exactly "static storage per block". It
//     starts as all-ones bytes in each launch (NaN floats), as on a GPU it starts as garbage: so
//     no other `thread_local` of this library may have an initializer (emu_runtime.cpp).
//   * __syncthreads completes when every thread of the block that has not returned has arrived.
//     Threads waiting at different __syncthreads, or a barrier against a warp collective, are a
//     deadlock: the launch fails with an error naming both source lines (never a hang).
//   * Warp collectives (__shfl*_sync, __ballot_sync, __any/__all_sync, __reduce_*_sync,
//     __syncwarp): every lane deposits its value; the last lane of the mask to arrive resolves the
//     warp (PTX shfl.sync semantics, width included). A mask that names an exited or absent lane,
//     a lane outside its own mask, or lanes of one mask at different collectives is an error.
//     Reading a lane outside the mask gives all-ones bits (NaN for floats): undefined on a GPU.
//   * Atomics are real atomics (GCC __atomic builtins): blocks on different workers race for real.
//   * Float32 denormals are flushed (MXCSR FTZ+DAZ on the workers) unless the module says
//     ftz=False: CuPy's RawModule always compiles with -ftz=true.
//
// Supported
//   keywords   __global__ __device__ __host__ __forceinline__ __noinline__ __launch_bounds__(...)
//              __restrict__ (native) __align__(n) __constant__ (a plain global) __shared__
//              CG_EXTERN_SHARED(type, name)  -- dynamic shared memory (`extern __shared__` does not
//              compile here; kernels_cu/common.cuh defines the CUDA spelling of the macro)
//   indices    threadIdx blockIdx blockDim gridDim warpSize, dim3 uint3
//   sync       __syncthreads __syncthreads_count/_and/_or __syncwarp __threadfence(_block/_system)
//   warp       __shfl_sync __shfl_up_sync __shfl_down_sync __shfl_xor_sync (arithmetic types of up
//              to 8 bytes, optional width), __ballot_sync __any_sync __all_sync __reduce_add_sync
//              __reduce_min_sync __reduce_max_sync __reduce_and_sync __reduce_or_sync __reduce_xor_sync
//   atomics    atomicAdd (int, unsigned, ull, float, double), atomicSub, atomicExch, atomicMin,
//              atomicMax (int, unsigned, long long, ull), atomicCAS (int, unsigned, ull),
//              atomicAnd/Or/Xor, atomicInc, atomicDec
//   vectors    char/uchar/short/ushort/int/uint/float 1..4, long/ulong/longlong/ulonglong/double 1..2
//              (CUDA alignments) and make_<type>
//   bits       __float_as_uint __uint_as_float __float_as_int __int_as_float __double_as_longlong
//              __longlong_as_double __popc(ll) __clz(ll) __ffs(ll) __brev(ll) __byte_perm __umulhi
//              __mulhi __umul64hi __mul64hi
//   math       <math.h> (fminf fmaxf fabsf ...), min/max/umin/umax/llmin/llmax/ullmin/ullmax,
//              rsqrtf __fdividef __saturatef __float2int_rn/rz/rd/ru __float2uint_rn/rz
//              __int2float_rn __uint2float_rn __ldg, printf, __trap()
// Not supported (a compile error, never a silent misbehaviour)
//   inline PTX (`asm` is poisoned: keep it behind #if defined(__CUDA_ARCH__)), non-_sync shuffles,
//   __activemask, __match_*_sync, cooperative groups, clock64/__nanosleep, named barriers,
//   texture/surface objects, half/bfloat16 types from cuda_fp16.h, dynamic parallelism.
//   Spin-waits on another thread of the same block never yield and hang: CUDA forbids them too.
//
// Adding a built-in: a plain function goes in the matching section below (keep CUDA's exact
// signature and semantics; document an approximation here). A warp collective is one more
// `emu::WarpOp` resolved in emu_runtime.cpp:resolve_warp(); a block-wide one uses emu::barrier().
// Then add it to the list above and to README.md, and test it in tests/test_emulate.py.
#pragma once
#ifndef CUGROUPED_EMULATE
#define CUGROUPED_EMULATE 1
#endif

// Every system header the emulator needs, before the keywords are defined and `asm` is poisoned.
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <setjmp.h>
#include <ucontext.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// ---- keywords ----------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
// Built-ins that touch memory (atomics, __ldg) are always inlined: a traced access
// (cugrouped.emulate.access) is then found at its kernel line.
#define EMU_ALWAYS_INLINE inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static thread_local
// Dynamic shared memory (function scope only): a pointer to the launch's shared_mem bytes.
#define CG_EXTERN_SHARED(type, name) type* const name = reinterpret_cast<type*>(::emu::t_dyn_smem)

// ---- vector types --------------------------------------------------------------------------------
#define EMU_VEC1(T, N, A) struct __attribute__((aligned(A))) N##1 { T x; };                          \
    inline N##1 make_##N##1(T x) { return N##1{x}; }
#define EMU_VEC2(T, N, A) struct __attribute__((aligned(A))) N##2 { T x, y; };                       \
    inline N##2 make_##N##2(T x, T y) { return N##2{x, y}; }
#define EMU_VEC3(T, N) struct N##3 { T x, y, z; };                                                    \
    inline N##3 make_##N##3(T x, T y, T z) { return N##3{x, y, z}; }
#define EMU_VEC4(T, N, A) struct __attribute__((aligned(A))) N##4 { T x, y, z, w; };                 \
    inline N##4 make_##N##4(T x, T y, T z, T w) { return N##4{x, y, z, w}; }
EMU_VEC1(signed char, char, 1) EMU_VEC2(signed char, char, 2) EMU_VEC3(signed char, char) EMU_VEC4(signed char, char, 4)
EMU_VEC1(unsigned char, uchar, 1) EMU_VEC2(unsigned char, uchar, 2) EMU_VEC3(unsigned char, uchar) EMU_VEC4(unsigned char, uchar, 4)
EMU_VEC1(short, short, 2) EMU_VEC2(short, short, 4) EMU_VEC3(short, short) EMU_VEC4(short, short, 8)
EMU_VEC1(unsigned short, ushort, 2) EMU_VEC2(unsigned short, ushort, 4) EMU_VEC3(unsigned short, ushort) EMU_VEC4(unsigned short, ushort, 8)
EMU_VEC1(int, int, 4) EMU_VEC2(int, int, 8) EMU_VEC3(int, int) EMU_VEC4(int, int, 16)
EMU_VEC1(unsigned int, uint, 4) EMU_VEC2(unsigned int, uint, 8) EMU_VEC3(unsigned int, uint) EMU_VEC4(unsigned int, uint, 16)
EMU_VEC1(float, float, 4) EMU_VEC2(float, float, 8) EMU_VEC3(float, float) EMU_VEC4(float, float, 16)
EMU_VEC1(long, long, 8) EMU_VEC2(long, long, 16) EMU_VEC1(unsigned long, ulong, 8) EMU_VEC2(unsigned long, ulong, 16)
EMU_VEC1(long long, longlong, 8) EMU_VEC2(long long, longlong, 16)
EMU_VEC1(unsigned long long, ulonglong, 8) EMU_VEC2(unsigned long long, ulonglong, 16)
EMU_VEC1(double, double, 8) EMU_VEC2(double, double, 16)
#undef EMU_VEC1
#undef EMU_VEC2
#undef EMU_VEC3
#undef EMU_VEC4

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

// ---- the emulator's per-thread state (set by the scheduler in emu_runtime.cpp) -----------------
namespace emu {
inline thread_local uint3 t_threadIdx;   // of the fiber that runs now
inline thread_local uint3 t_blockIdx;    // of the block this worker runs
inline thread_local dim3 t_blockDim;
inline thread_local dim3 t_gridDim;
inline thread_local void* t_dyn_smem;    // this worker's dynamic shared memory

enum WarpOp : int {
    SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR, BALLOT, ANY, ALL, SYNCWARP,
    RED_ADD, RED_MIN_S, RED_MAX_S, RED_MIN_U, RED_MAX_U, RED_AND, RED_OR, RED_XOR,
};
enum BarrierKind : int { BAR_SYNC, BAR_COUNT, BAR_AND, BAR_OR };

// Block-wide barrier over the threads that have not returned; returns, for BAR_COUNT, how many
// had a non-zero `pred`, for BAR_AND / BAR_OR whether all / any had.
int barrier(BarrierKind kind, int pred, const char* file, int line);
// Warp collective; `value` holds the lane's bits, the result comes back the same way.
unsigned long long warp_collective(WarpOp op, unsigned mask, unsigned long long value, int param,
                                   int width, const char* file, int line);
[[noreturn]] void trap(const char* what, const char* file, int line);

template <class T> inline unsigned long long to_bits(T v) {
    unsigned long long b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T> inline T from_bits(unsigned long long b) {
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}
template <class T> inline T shfl(WarpOp op, unsigned mask, T var, int param, int width, const char* file, int line) {
    static_assert(std::is_arithmetic<T>::value && sizeof(T) <= 8,
                  "__shfl*_sync: only arithmetic types of up to 8 bytes are emulated");
    return from_bits<T>(warp_collective(op, mask, to_bits(var), param, width, file, line));
}
}  // namespace emu

// Read-only views, like the CUDA built-in variables.
#define threadIdx (static_cast<const uint3&>(::emu::t_threadIdx))
#define blockIdx (static_cast<const uint3&>(::emu::t_blockIdx))
#define blockDim (static_cast<const dim3&>(::emu::t_blockDim))
#define gridDim (static_cast<const dim3&>(::emu::t_gridDim))
constexpr int warpSize = 32;

// ---- synchronisation -----------------------------------------------------------------------------
#define EMU_SITE const char* emu_file = __builtin_FILE(), int emu_line = __builtin_LINE()
inline void __syncthreads(EMU_SITE) { ::emu::barrier(::emu::BAR_SYNC, 0, emu_file, emu_line); }
inline int __syncthreads_count(int p, EMU_SITE) { return ::emu::barrier(::emu::BAR_COUNT, p != 0, emu_file, emu_line); }
inline int __syncthreads_and(int p, EMU_SITE) { return ::emu::barrier(::emu::BAR_AND, p != 0, emu_file, emu_line); }
inline int __syncthreads_or(int p, EMU_SITE) { return ::emu::barrier(::emu::BAR_OR, p != 0, emu_file, emu_line); }
inline void __syncwarp(unsigned mask = 0xffffffffu, EMU_SITE) {
    ::emu::warp_collective(::emu::SYNCWARP, mask, 0, 0, 32, emu_file, emu_line);
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
[[noreturn]] inline void __trap(EMU_SITE) { ::emu::trap("__trap()", emu_file, emu_line); }

// ---- warp collectives ----------------------------------------------------------------------------
template <class T> inline T __shfl_sync(unsigned mask, T var, int src, int width = 32, EMU_SITE) {
    return ::emu::shfl(::emu::SHFL_IDX, mask, var, src, width, emu_file, emu_line);
}
template <class T> inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32, EMU_SITE) {
    return ::emu::shfl(::emu::SHFL_UP, mask, var, (int)delta, width, emu_file, emu_line);
}
template <class T> inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32, EMU_SITE) {
    return ::emu::shfl(::emu::SHFL_DOWN, mask, var, (int)delta, width, emu_file, emu_line);
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32, EMU_SITE) {
    return ::emu::shfl(::emu::SHFL_XOR, mask, var, lane_mask, width, emu_file, emu_line);
}
inline unsigned __ballot_sync(unsigned mask, int pred, EMU_SITE) {
    return (unsigned)::emu::warp_collective(::emu::BALLOT, mask, pred != 0, 0, 32, emu_file, emu_line);
}
inline int __any_sync(unsigned mask, int pred, EMU_SITE) {
    return (int)::emu::warp_collective(::emu::ANY, mask, pred != 0, 0, 32, emu_file, emu_line);
}
inline int __all_sync(unsigned mask, int pred, EMU_SITE) {
    return (int)::emu::warp_collective(::emu::ALL, mask, pred != 0, 0, 32, emu_file, emu_line);
}
#define EMU_REDUCE(NAME, T, OP)                                                                        \
    inline T NAME(unsigned mask, T v, EMU_SITE) {                                                     \
        return (T)::emu::warp_collective(::emu::OP, mask, (unsigned)v, 0, 32, emu_file, emu_line);     \
    }
EMU_REDUCE(__reduce_add_sync, unsigned, RED_ADD) EMU_REDUCE(__reduce_add_sync, int, RED_ADD)
EMU_REDUCE(__reduce_min_sync, unsigned, RED_MIN_U) EMU_REDUCE(__reduce_min_sync, int, RED_MIN_S)
EMU_REDUCE(__reduce_max_sync, unsigned, RED_MAX_U) EMU_REDUCE(__reduce_max_sync, int, RED_MAX_S)
EMU_REDUCE(__reduce_and_sync, unsigned, RED_AND) EMU_REDUCE(__reduce_or_sync, unsigned, RED_OR)
EMU_REDUCE(__reduce_xor_sync, unsigned, RED_XOR)
#undef EMU_REDUCE

// ---- atomics (relaxed, like CUDA's; real atomics across worker threads) --------------------------
#define EMU_ATOMIC_INT(T)                                                                               \
    EMU_ALWAYS_INLINE T atomicAdd(T* a, T v) { return __atomic_fetch_add(a, v, __ATOMIC_RELAXED); }              \
    EMU_ALWAYS_INLINE T atomicExch(T* a, T v) { return __atomic_exchange_n(a, v, __ATOMIC_RELAXED); }            \
    EMU_ALWAYS_INLINE T atomicCAS(T* a, T cmp, T v) {                                                              \
        __atomic_compare_exchange_n(a, &cmp, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);            \
        return cmp;                                                                                     \
    }                                                                                                   \
    EMU_ALWAYS_INLINE T atomicAnd(T* a, T v) { return __atomic_fetch_and(a, v, __ATOMIC_RELAXED); }              \
    EMU_ALWAYS_INLINE T atomicOr(T* a, T v) { return __atomic_fetch_or(a, v, __ATOMIC_RELAXED); }                \
    EMU_ALWAYS_INLINE T atomicXor(T* a, T v) { return __atomic_fetch_xor(a, v, __ATOMIC_RELAXED); }              \
    EMU_ALWAYS_INLINE T atomicMin(T* a, T v) {                                                                     \
        T old = __atomic_load_n(a, __ATOMIC_RELAXED);                                                   \
        while (v < old && !__atomic_compare_exchange_n(a, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {} \
        return old;                                                                                     \
    }                                                                                                   \
    EMU_ALWAYS_INLINE T atomicMax(T* a, T v) {                                                                     \
        T old = __atomic_load_n(a, __ATOMIC_RELAXED);                                                   \
        while (v > old && !__atomic_compare_exchange_n(a, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {} \
        return old;                                                                                     \
    }
EMU_ATOMIC_INT(int)
EMU_ATOMIC_INT(unsigned int)
EMU_ATOMIC_INT(unsigned long long)
#undef EMU_ATOMIC_INT
EMU_ALWAYS_INLINE long long atomicMin(long long* a, long long v) {
    long long old = __atomic_load_n(a, __ATOMIC_RELAXED);
    while (v < old && !__atomic_compare_exchange_n(a, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    return old;
}
EMU_ALWAYS_INLINE long long atomicMax(long long* a, long long v) {
    long long old = __atomic_load_n(a, __ATOMIC_RELAXED);
    while (v > old && !__atomic_compare_exchange_n(a, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    return old;
}
EMU_ALWAYS_INLINE int atomicSub(int* a, int v) { return __atomic_fetch_sub(a, v, __ATOMIC_RELAXED); }
EMU_ALWAYS_INLINE unsigned atomicSub(unsigned* a, unsigned v) { return __atomic_fetch_sub(a, v, __ATOMIC_RELAXED); }
EMU_ALWAYS_INLINE unsigned atomicInc(unsigned* a, unsigned limit) {   // ((old >= limit) ? 0 : old + 1)
    unsigned old = __atomic_load_n(a, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(a, &old, old >= limit ? 0u : old + 1u, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    return old;
}
EMU_ALWAYS_INLINE unsigned atomicDec(unsigned* a, unsigned limit) {   // ((old == 0 || old > limit) ? limit : old - 1)
    unsigned old = __atomic_load_n(a, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(a, &old, (old == 0u || old > limit) ? limit : old - 1u, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    return old;
}
template <class F, class U> EMU_ALWAYS_INLINE F emu_atomic_float(F* a, F v, F (*op)(F, F)) {
    U* p = reinterpret_cast<U*>(a);
    U old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(p, &old, ::emu::to_bits(op(::emu::from_bits<F>(old), v)), true,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    return ::emu::from_bits<F>(old);
}
EMU_ALWAYS_INLINE float atomicAdd(float* a, float v) {
    return emu_atomic_float<float, unsigned>(a, v, [](float x, float y) { return x + y; });
}
EMU_ALWAYS_INLINE double atomicAdd(double* a, double v) {
    return emu_atomic_float<double, unsigned long long>(a, v, [](double x, double y) { return x + y; });
}
EMU_ALWAYS_INLINE float atomicExch(float* a, float v) {
    return ::emu::from_bits<float>(__atomic_exchange_n(reinterpret_cast<unsigned*>(a), (unsigned)::emu::to_bits(v), __ATOMIC_RELAXED));
}

// ---- bit manipulation ----------------------------------------------------------------------------
inline unsigned __float_as_uint(float x) { return (unsigned)::emu::to_bits(x); }
inline int __float_as_int(float x) { return (int)(unsigned)::emu::to_bits(x); }
inline float __uint_as_float(unsigned x) { return ::emu::from_bits<float>(x); }
inline float __int_as_float(int x) { return ::emu::from_bits<float>((unsigned)x); }
inline long long __double_as_longlong(double x) { return (long long)::emu::to_bits(x); }
inline double __longlong_as_double(long long x) { return ::emu::from_bits<double>((unsigned long long)x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline unsigned long long __brevll(unsigned long long x) {
    return ((unsigned long long)__brev((unsigned)x) << 32) | __brev((unsigned)(x >> 32));
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    unsigned long long v = ((unsigned long long)y << 32) | x, r = 0;
    for (int i = 0; i < 4; ++i) r |= ((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
    return (unsigned)r;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline long long __mul64hi(long long a, long long b) { return (long long)(((__int128)a * b) >> 64); }

// ---- math ----------------------------------------------------------------------------------------
#define EMU_MINMAX(R, A, B)                                                                             \
    inline R min(A a, B b) { return (R)a < (R)b ? (R)a : (R)b; }                                        \
    inline R max(A a, B b) { return (R)a > (R)b ? (R)a : (R)b; }
EMU_MINMAX(int, int, int) EMU_MINMAX(unsigned, unsigned, unsigned)
EMU_MINMAX(unsigned, int, unsigned) EMU_MINMAX(unsigned, unsigned, int)
EMU_MINMAX(long, long, long) EMU_MINMAX(unsigned long, unsigned long, unsigned long)
EMU_MINMAX(long long, long long, long long) EMU_MINMAX(unsigned long long, unsigned long long, unsigned long long)
EMU_MINMAX(unsigned long long, long long, unsigned long long) EMU_MINMAX(unsigned long long, unsigned long long, long long)
#undef EMU_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long llmin(long long a, long long b) { return a < b ? a : b; }
inline long long llmax(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long ullmin(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long ullmax(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x >= 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }   // NaN -> 0
// float -> int conversions saturate and map NaN to 0, like cvt.rni/rzi/rmi/rpi.s32.f32.
inline int emu_f2i(float r) { return r != r ? 0 : r >= 2147483648.0f ? 2147483647 : r < -2147483648.0f ? (-2147483647 - 1) : (int)r; }
inline unsigned emu_f2u(float r) { return r != r || r <= 0.0f ? 0u : r >= 4294967296.0f ? 4294967295u : (unsigned)r; }
inline int __float2int_rn(float x) { return emu_f2i(nearbyintf(x)); }   // default mode: nearest-even
inline int __float2int_rz(float x) { return emu_f2i(truncf(x)); }
inline int __float2int_rd(float x) { return emu_f2i(floorf(x)); }
inline int __float2int_ru(float x) { return emu_f2i(ceilf(x)); }
inline unsigned __float2uint_rn(float x) { return emu_f2u(nearbyintf(x)); }
inline unsigned __float2uint_rz(float x) { return emu_f2u(truncf(x)); }
inline float __int2float_rn(int x) { return (float)x; }
inline float __uint2float_rn(unsigned x) { return (float)x; }
template <class T> EMU_ALWAYS_INLINE T __ldg(const T* p) { return *p; }

// ---- everything below is poisoned: inline PTX must stay behind #if defined(__CUDA_ARCH__) -------
#pragma GCC poison asm __asm__ __asm __activemask __shfl __shfl_up __shfl_down __shfl_xor __ballot
