// cugrouped/kernels_cu/block_scan.cuh -- a block-wide int64 prefix sum (one value per thread).
#pragma once
#include "common.cuh"

namespace cg {

// Inclusive prefix sum over a block of THREADS threads (a multiple of 32) of one value per thread:
// warp shuffles, then the warp totals through `warp_totals` (THREADS / 32 entries of shared
// memory). `total` gets the sum over the block. Every thread of the block must call it (it holds
// two __syncthreads), and it may be called again at once with the same `warp_totals`.
template <int THREADS>
CG_DEVICE i64 block_inclusive_scan(i64 v, i64* warp_totals, i64& total) {
    static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps, one block");
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const i64 up = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v += up;
    }
    if (lane == 31) warp_totals[warp] = v;
    __syncthreads();
    i64 before = 0;
    total = 0;
    for (int w = 0; w < THREADS / 32; ++w) {
        if (w < warp) before += warp_totals[w];
        total += warp_totals[w];
    }
    __syncthreads();
    return before + v;
}

}  // namespace cg
