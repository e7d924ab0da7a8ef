// Records the order in which the emulator runs a block's warps: every thread appends its warp's
// number at an atomic slot before a barrier, after it, and (plus 100) after a warp shuffle.
#include "common.cuh"

__global__ void warp_schedule_log(int* log, int* next) {
    const int warp = threadIdx.x / 32;
    log[atomicAdd(next, 1)] = warp;
    __syncthreads();
    log[atomicAdd(next, 1)] = warp;
    const int other = __shfl_xor_sync(0xffffffffu, warp, 1);
    log[atomicAdd(next, 1)] = 100 + other;
}
