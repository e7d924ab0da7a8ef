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

// A block scan (block_scan.cuh's) whose warp totals are reused by the next scan without the
// barrier that protects them: warp 0 can run through the next scan's shuffles and overwrite its
// total while later warps still read the old one (a write-after-read race). Every order that
// advances each thread one step at a time hides it (all warps read before warp 0 is through its
// five shuffle rounds); an order in which a warp runs ahead shows it.
__device__ long long scan_missing_sync(long long v, long long* totals) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int d = 1; d < 32; d <<= 1) {
        const long long up = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v += up;
    }
    if (lane == 31) totals[warp] = v;
    __syncthreads();
    long long before = 0;
    for (int w = 0; w < warp; ++w) before += totals[w];
    return before + v;   // BUG_SCAN_WAR: no __syncthreads before `totals` is written again
}

__global__ void scan_twice_missing_sync(long long* out) {
    __shared__ long long totals[32];
    const long long a = scan_missing_sync(1, totals);
    const long long b = scan_missing_sync(1000 + threadIdx.x, totals);
    out[threadIdx.x] = a;
    out[blockDim.x + threadIdx.x] = b;
}

// Shared memory read before it is written: the partial sums of the first half of the block are
// stored, then thread 0 adds up all 32 slots. On a GPU the other 16 hold whatever was there; a
// zero-filled emulator would hide it (the sum of the 16 written ones).
__global__ void sum_unwritten_shared(const float* x, float* out) {
    __shared__ float part[32];
    if (threadIdx.x < 16) part[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.f;
        for (int i = 0; i < 32; ++i) s += part[i];   // BUG_UNWRITTEN_SHARED: 16 never written
        out[blockIdx.x] = s;
    }
}
