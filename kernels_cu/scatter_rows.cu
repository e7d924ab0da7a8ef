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
// (token, chunk of SR_THREADS columns); each thread keeps one float32 accumulator and adds the
// token's rows in order, exactly as a sequential loop does (the NumPy reference). Inputs float32,
// float16 or bfloat16, widened exactly; sums flushed as the GPU's -ftz=true does (fp8.cuh ftz).
#include "common.cuh"
#include "fp8.cuh"

#ifndef CG_SR_THREADS
#define CG_SR_THREADS 256
#endif

namespace cg {

constexpr int SR_THREADS = CG_SR_THREADS;

enum class SrIn : int { F32 = 0, F16 = 1, BF16 = 2 };

template <SrIn IN>
CG_DEVICE float sr_load(const void* p, i64 i) {
    if (IN == SrIn::F32) return static_cast<const float*>(p)[i];
    const u16 b = static_cast<const u16*>(p)[i];
    return IN == SrIn::BF16 ? bf16_to_float(b) : half_to_float(b);
}

template <SrIn IN>
__global__ void __launch_bounds__(SR_THREADS)
scatter_rows_kernel(const void* __restrict__ rows, const i64 ld, const i64* __restrict__ order,
                    const i64* __restrict__ seg, const i64 num_tokens, const i64 h,
                    const i64 chunks, float* __restrict__ out) {
    const i64 b = static_cast<i64>(blockIdx.x);
    const i64 t = b / chunks;
    const i64 c = (b % chunks) * SR_THREADS + threadIdx.x;
    if (t >= num_tokens || c >= h) return;
    float acc = 0.f;
    const i64 end = seg[t + 1];
    for (i64 j = seg[t]; j < end; ++j) acc = ftz(acc + ftz(sr_load<IN>(rows, order[j] * ld + c)));
    out[t * h + c] = acc;
}

}  // namespace cg
