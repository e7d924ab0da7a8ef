// Kernels with planted bugs the emulator must catch. Line markers (BUG_*) are looked up by tests.
#include "common.cuh"

// 1. Missing __syncthreads between the shared-memory writes and the transposed reads.
__global__ void transpose_missing_sync(const float* in, float* out, int rows, int cols) {
    __shared__ float tile[32][33];
    int x = blockIdx.x * 32 + threadIdx.x;
    int y = blockIdx.y * 32 + threadIdx.y;
    for (int j = 0; j < 32; j += blockDim.y)
        if (x < cols && y + j < rows) tile[threadIdx.y + j][threadIdx.x] = in[(y + j) * cols + x];
    // BUG: __syncthreads() missing here
    x = blockIdx.y * 32 + threadIdx.x;
    y = blockIdx.x * 32 + threadIdx.y;
    for (int j = 0; j < 32; j += blockDim.y)
        if (x < rows && y + j < cols) out[(y + j) * rows + x] = tile[threadIdx.x][threadIdx.y + j];
}

// 2. A __syncthreads that only the first warp reaches; the others wait at the next one.
__global__ void divergent_barrier(float* out) {
    __shared__ float s[1024];
    s[threadIdx.x] = (float)threadIdx.x;
    if (threadIdx.x < 32) {
        __syncthreads();   // BUG_DIVERGENT_A
        s[threadIdx.x] += 1.f;
    }
    __syncthreads();   // BUG_DIVERGENT_B
    out[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}

// 3. Lanes 16..31 return early; the rest shuffle with a full mask.
__global__ void shuffle_after_exit(float* out) {
    if ((threadIdx.x & 31) >= 16) return;
    float v = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 1);   // BUG_SHFL_EXIT
    out[threadIdx.x] = v;
}

// 4. One warp at a barrier while another lane of its warp waits in a shuffle.
__global__ void barrier_vs_shuffle(float* out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x == 0) {
        __syncthreads();   // BUG_BAR_VS_SHFL_A
    } else {
        v = __shfl_down_sync(0xffffffffu, v, 1);   // BUG_BAR_VS_SHFL_B
    }
    out[threadIdx.x] = v;
}

// 5. Out-of-bounds global write: thread n-1 also writes out[n].
__global__ void oob_write(float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 1.f;
    if (i == n - 1) out[i + 1] = 2.f;   // BUG_OOB
}

// 6. Legal: warps that return before a later __syncthreads are not waited for.
__global__ void early_exit_ok(float* out) {
    __shared__ float s[64];
    if (threadIdx.x >= 64) return;
    s[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = s[63 - threadIdx.x];
}

// 7. __trap() is reported as an error.
__global__ void traps(int* p) {
    if (threadIdx.x == 3) __trap();   // BUG_TRAP
    p[threadIdx.x] = 1;
}
