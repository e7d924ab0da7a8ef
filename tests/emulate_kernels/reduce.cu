// Warp-shuffle block reductions over a grid-stride loop, any block shape whose thread count is a
// multiple of 32 (1-D, 2-D or 3-D). Per block: the int32 sum (wrapping), the float32 sum in a fixed
// tree (per-thread sequential sum, xor butterfly in the warp, then butterfly over the warp sums)
// and the float32 max; grid totals by atomics. The NumPy reference replays the same tree.
#include "common.cuh"

#define FULL 0xffffffffu

__device__ __forceinline__ int warp_sum_i(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}
__device__ __forceinline__ float warp_sum_f(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}
__device__ __forceinline__ float warp_max_f(float v) {   // result in lane 0, then broadcast
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(FULL, v, o));
    return __shfl_sync(FULL, v, 0);
}

__global__ void block_reduce(const int* __restrict__ xi, const float* __restrict__ xf, int n,
                             int* __restrict__ block_isum, float* __restrict__ block_fsum,
                             float* __restrict__ block_fmax, unsigned long long* __restrict__ total,
                             int* __restrict__ gmax_bits) {
    __shared__ int s_i[32];
    __shared__ float s_f[32], s_m[32];
    const int nthreads = blockDim.x * blockDim.y * blockDim.z;
    const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int bid = blockIdx.x + gridDim.x * blockIdx.y;
    const int stride = gridDim.x * gridDim.y * nthreads;
    int si = 0;
    float sf = 0.f, m = __int_as_float(0xff800000);   // -inf
    for (int i = bid * nthreads + tid; i < n; i += stride) {
        si += xi[i];
        sf += xf[i];
        m = fmaxf(m, xf[i]);
    }
    si = warp_sum_i(si);
    sf = warp_sum_f(sf);
    m = warp_max_f(m);
    const int lane = tid & 31, warp = tid >> 5, nwarps = nthreads >> 5;
    if (lane == 0) { s_i[warp] = si; s_f[warp] = sf; s_m[warp] = m; }
    __syncthreads();
    if (warp == 0) {
        si = lane < nwarps ? s_i[lane] : 0;
        sf = lane < nwarps ? s_f[lane] : 0.f;
        m = lane < nwarps ? s_m[lane] : __int_as_float(0xff800000);
        si = warp_sum_i(si);
        sf = warp_sum_f(sf);
        m = warp_max_f(m);
        if (lane == 0) {
            block_isum[bid] = si;
            block_fsum[bid] = sf;
            block_fmax[bid] = m;
            atomicAdd(total, (unsigned long long)(long long)si);
            // order-preserving int image of a float, for atomicMax
            const int b = __float_as_int(m);
            atomicMax(gmax_bits, b >= 0 ? b : b ^ 0x7fffffff);
        }
    }
}

// Segmented inclusive scan (segments of `width` lanes) with __shfl_up_sync, plus ballot/any/all
// per warp: exercises the width argument and the vote functions.
__global__ void warp_scan_vote(const int* __restrict__ x, int* __restrict__ scan, unsigned* __restrict__ ballots,
                               int* __restrict__ votes, int width) {
    const int nthreads = blockDim.x * blockDim.y * blockDim.z;
    const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int gid = (blockIdx.x + gridDim.x * blockIdx.y) * nthreads + tid;
    int v = x[gid];
    const int seg_lane = (tid & 31) % width;
    for (int d = 1; d < width; d <<= 1) {
        const int u = __shfl_up_sync(FULL, v, d, width);
        if (seg_lane >= d) v += u;
    }
    scan[gid] = v;
    const unsigned b = __ballot_sync(FULL, x[gid] > 0);
    const int any = __any_sync(FULL, x[gid] > 5);
    const int all = __all_sync(FULL, x[gid] > -100);
    const unsigned red = __reduce_add_sync(FULL, (unsigned)x[gid]);
    __syncwarp();
    if ((tid & 31) == 0) {
        ballots[gid >> 5] = b;
        votes[3 * (gid >> 5)] = any;
        votes[3 * (gid >> 5) + 1] = all;
        votes[3 * (gid >> 5) + 2] = (int)red;
    }
}
