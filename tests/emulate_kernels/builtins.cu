// Small checks of individual built-ins; one block, results per thread in `out` (16 ints each).
#include "common.cuh"

static_assert(sizeof(float4) == 16 && alignof(float4) == 16, "float4");
static_assert(sizeof(uint2) == 8 && alignof(uint2) == 8, "uint2");
static_assert(sizeof(ushort4) == 8 && alignof(ushort4) == 8, "ushort4");
static_assert(sizeof(uchar4) == 4 && alignof(uchar4) == 4, "uchar4");
static_assert(sizeof(longlong2) == 16 && alignof(longlong2) == 16, "longlong2");
static_assert(sizeof(float3) == 12 && alignof(float3) == 4, "float3");

__global__ void builtins(int* out, unsigned* counters, float* fsum) {
    const int t = threadIdx.x;
    const unsigned full = 0xffffffffu;
    int* o = out + 16 * t;
    o[0] = __syncthreads_count(t % 3 == 0);
    o[1] = __syncthreads_and(t < 1000);
    o[2] = __syncthreads_or(t == 5);
    o[3] = __shfl_sync(full, t * 10, t + 3, 8);          // idx within segments of 8
    o[4] = __shfl_down_sync(full, t * 10, 3, 16);         // clamped at the end of each 16-lane segment
    o[5] = __shfl_xor_sync(full, t * 10, 5);
    o[6] = __shfl_up_sync(full, t * 10, 2, 8);
    o[7] = __reduce_min_sync(full, 7 - (t & 31));
    o[8] = __reduce_max_sync(full, (unsigned)(t & 31) * 3u);
    o[9] = (int)(__shfl_sync(full, (double)t * 0.5 + 1e6, 31 - (t & 31)) - 1e6);   // 64-bit payload
    o[10] = __popc(t) + 100 * __ffs(t) + 10000 * __clz(t);
    o[11] = (int)__byte_perm(0x33221100u + t, 0x77665544u, 0x7531u);
    o[12] = (int)atomicInc(counters + 0, 40u);
    o[13] = atomicCAS((int*)counters + 1, t, t + 1) == t;   // only the thread that sees its own id wins
    atomicAdd(fsum, 0.5f);
    o[14] = max(t, 7) + 100 * min(t, 7) + 10000 * (int)max(2.5f, (float)t);
    const float4 v = make_float4(1.f, 2.f, 3.f, (float)t);
    const uint2 u = make_uint2(__float_as_uint(v.w), 1u);
    o[15] = (int)(__uint_as_float(u.x) + v.x + v.y + v.z) + (int)__brev((unsigned)u.y);
}
