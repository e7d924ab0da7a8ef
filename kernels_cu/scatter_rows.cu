// cugrouped/kernels_cu/scatter_rows.cu
//
// Deterministic scatter-sum of rows onto tokens: the adjoint of the MoE permute (the gradient of
// the gather tokens[row_index] that GroupedLinear(..., row_index=) folds into its cast), with no
// atomics, so every run gives the same bits whatever the number of rows per token (top-k):
//
//   out[t, c] = sum over j in [seg[t], seg[t+1]) of rows[order[j], c]      (float32, j ascending)
//
// `order` lists the row numbers grouped by token (a stable sort of the row indices, so within a
// token its rows come in increasing order) and seg[t] is where token t's rows start in it (rows
// with an index outside the tokens sort after all of them and are never read). One block per
// (token, chunk of 4 * SR_THREADS columns); each thread keeps 4 float32 accumulators and adds the
// token's rows in order, exactly as a sequential loop does (the NumPy reference), reading its 4
// columns of a row with one load (16 bytes of float32, 8 of 16-bit values; value by value when
// the rows are not aligned to it: the same sums) and storing the 4 sums with one 16-byte store:
// whole sectors per warp instruction both ways. Inputs float32,
// float16 or bfloat16, widened exactly; sums flushed as the GPU's -ftz=true does (fp8.cuh ftz).
#include "common.cuh"
#include "segment.cuh"

#ifndef CG_SR_THREADS
#define CG_SR_THREADS 256
#endif

namespace cg {

constexpr int SR_THREADS = CG_SR_THREADS;

// Four values of a row, as one load: 16 bytes of float32, 8 bytes of float16 / bfloat16.
template <InDtype IN> struct SrWord {
    using T = uint2;
    CG_DEVICE static void unpack(const uint2& w, float (&v)[4]) {
        v[0] = InTraits<IN>::cvt(w.x & 0xffffu); v[1] = InTraits<IN>::cvt(w.x >> 16);
        v[2] = InTraits<IN>::cvt(w.y & 0xffffu); v[3] = InTraits<IN>::cvt(w.y >> 16);
    }
};
template <> struct SrWord<InDtype::F32> {
    using T = uint4;
    CG_DEVICE static void unpack(const uint4& w, float (&v)[4]) {
        InTraits<InDtype::F32>::unpack_word(w, v);
    }
};

// One 16-byte store of four floats. NVVM for sm_80..sm_90 (NVRTC 13.0) split the plain float4 or
// uint4 store of this kernel into four 4-byte stores (sm_100 kept it): stated in PTX there, the
// portable path (emulator, other targets) the same bytes. Only for a kernel's final stores.
CG_DEVICE void store_float4(float* p, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d));
#else
    *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
#endif
}

template <InDtype IN>
__global__ void __launch_bounds__(SR_THREADS)
scatter_rows_kernel(const void* __restrict__ rows, const i64 ld, const i64* __restrict__ order,
                    const i64* __restrict__ seg, const i64 num_tokens, const i64 h,
                    const i64 chunks, float* __restrict__ out) {
    using Word = typename SrWord<IN>::T;
    constexpr int V = 4;                           // columns per thread: one word of a row
    constexpr int kBytes = InTraits<IN>::bytes;
    const i64 b = static_cast<i64>(blockIdx.x);
    const i64 t = b / chunks;
    const i64 c0 = ((b % chunks) * SR_THREADS + threadIdx.x) * V;
    if (t >= num_tokens || c0 >= h) return;
    const bool whole = c0 + V <= h && reinterpret_cast<u64>(rows) % sizeof(Word) == 0 &&
                       (ld * kBytes) % static_cast<i64>(sizeof(Word)) == 0;
    float acc[V] = {0.f, 0.f, 0.f, 0.f};
    const i64 end = seg[t + 1];
    for (i64 j = seg[t]; j < end; ++j) {
        const i64 at = order[j] * ld + c0;          // element index of the thread's first column
        float v[V];
        if (whole) {
            const Word w = __ldg(reinterpret_cast<const Word*>(rows) + at / V);   // one load
            SrWord<IN>::unpack(w, v);
        } else {
#pragma unroll
            for (int i = 0; i < V; ++i) v[i] = c0 + i < h ? InTraits<IN>::load(rows, at + i) : 0.f;
        }
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = ftz(acc[i] + ftz(v[i]));
    }
    float* dst = out + t * h + c0;
    if (c0 + V <= h && aligned16(dst)) {
        store_float4(dst, acc[0], acc[1], acc[2], acc[3]);
    } else {   // a ragged end, or unaligned
#pragma unroll
        for (int i = 0; i < V; ++i)
            if (c0 + i < h) dst[i] = acc[i];
    }
}

}  // namespace cg
