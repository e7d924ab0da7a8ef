// Multi-tensor scale + amax over up to 8 float32 tensors in one launch, the argument struct passed
// by value (as our real kernels take their per-expert pointers). blockIdx.y = tensor, each block
// handles 1024 elements as float4 (n must be a multiple of 4) and folds its amax into amax_bits.
#include "common.cuh"

struct MultiScaleArgs {
    const float* in[8];
    float* out[8];
    long long n[8];
    float scale[8];
    int count;
};

__device__ __forceinline__ float warp_absmax(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__global__ void __launch_bounds__(256) multi_scale_amax(const MultiScaleArgs a, unsigned* __restrict__ amax_bits) {
    __shared__ float warp_max[8];
    const int t = blockIdx.y;
    if (t >= a.count) return;
    const long long n4 = a.n[t] / 4;
    const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
    float m = 0.f;
    if (i < n4) {
        const float4 v = reinterpret_cast<const float4*>(a.in[t])[i];
        const float s = a.scale[t];
        reinterpret_cast<float4*>(a.out[t])[i] = make_float4(v.x * s, v.y * s, v.z * s, v.w * s);
        m = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
    }
    m = warp_absmax(m);
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < 8; ++w) m = fmaxf(m, warp_max[w]);
        atomicMax(amax_bits + t, __float_as_uint(m));   // non-negative floats order like their bits
    }
}
