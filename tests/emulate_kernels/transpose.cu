// Tiled shared-memory transpose: out (cols, rows) = in (rows, cols)^T, 32x32 tiles, padded tile
// to avoid bank conflicts. Any block of shape (32, R) with R dividing 32 works; blockDim.y rows of
// the tile are handled per iteration. Valid CUDA (compiles with NVRTC) and emulated code.
#include "common.cuh"

#define TILE 32

__global__ void transpose_tiled(const float* __restrict__ in, float* __restrict__ out, int rows, int cols) {
    __shared__ float tile[TILE][TILE + 1];
    int x = blockIdx.x * TILE + threadIdx.x;
    int y = blockIdx.y * TILE + threadIdx.y;
    for (int j = 0; j < TILE; j += blockDim.y)
        if (x < cols && y + j < rows) tile[threadIdx.y + j][threadIdx.x] = in[(long long)(y + j) * cols + x];
    __syncthreads();
    x = blockIdx.y * TILE + threadIdx.x;
    y = blockIdx.x * TILE + threadIdx.y;
    for (int j = 0; j < TILE; j += blockDim.y)
        if (x < rows && y + j < cols) out[(long long)(y + j) * rows + x] = tile[threadIdx.x][threadIdx.y + j];
}

// Same, templated on the element type and with the tile in dynamic shared memory.
template <class T, int BLOCK_ROWS>
__global__ void __launch_bounds__(TILE * BLOCK_ROWS)
transpose_dyn(const T* __restrict__ in, T* __restrict__ out, int rows, int cols) {
    CG_EXTERN_SHARED(T, smem);   // TILE * (TILE + 1) elements
    int x = blockIdx.x * TILE + threadIdx.x;
    int y = blockIdx.y * TILE + threadIdx.y;
#pragma unroll
    for (int j = 0; j < TILE; j += BLOCK_ROWS)
        if (x < cols && y + j < rows) smem[(threadIdx.y + j) * (TILE + 1) + threadIdx.x] = in[(long long)(y + j) * cols + x];
    __syncthreads();
    x = blockIdx.y * TILE + threadIdx.x;
    y = blockIdx.x * TILE + threadIdx.y;
#pragma unroll
    for (int j = 0; j < TILE; j += BLOCK_ROWS)
        if (x < rows && y + j < cols) out[(long long)(y + j) * rows + x] = smem[threadIdx.x * (TILE + 1) + threadIdx.y + j];
}
