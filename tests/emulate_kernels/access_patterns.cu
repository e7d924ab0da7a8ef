// Memory access patterns whose sectors and bank wavefronts are known by hand, for
// tests/test_emulate_access.py (cugrouped.emulate.access). Each access is on its own line, found
// by the marker in its comment. Launch with blocks of 64 threads (two warps), n = 64 * blocks;
// y holds 8 n floats, z 3 n + 48.

struct alignas(16) Vec16 { float a, b, c, d; };

__global__ void global_patterns(const float* x, float* y, float* z, const float* bcast, int n,
                                unsigned* counter) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = x[i];                                       // @coalesced: 4 sectors per request
    v += bcast[0];                                        // @broadcast: 1 sector
    y[i * 8] = v;                                         // @strided: 32 sectors, ideal 4
    z[i + 1] = v;                                         // @misaligned: 5 sectors, ideal 4
    const Vec16 q = reinterpret_cast<const Vec16*>(x)[i / 4];   // @vec16: lanes 4 apart share one
    z[n + i] = q.a + q.b + q.c + q.d;
    float local[8];                                       // a fiber's stack: not recorded
    for (int j = 0; j < 8; ++j) local[j] = v * j;
    z[2 * n + 16 + i] = local[threadIdx.x % 8] + (float)threadIdx.x;   // @withlocal: 4 sectors
    atomicAdd(counter, 1u);                               // @atomic: 1 sector per request
}

__device__ __forceinline__ void put(float* p, float v) { *p = v; }   // @helper

__global__ void shared_patterns(const float* x, float* y) {
    __shared__ float padded[32][33];
    __shared__ float square[32][32];
    __shared__ __align__(16) float wide[512];
    __shared__ unsigned char bytes[64];
    const int t = threadIdx.x, lane = t % 32;
    const float v = x[blockIdx.x * blockDim.x + t];
    padded[lane][t / 32] = v;                             // @padded: conflict-free column
    square[lane][t / 32] = v;                             // @square: 32-way conflict
    square[t / 32][lane] = v;                             // @row: conflict-free row
    reinterpret_cast<float2*>(wide)[t] = make_float2(v, v);          // @float2: 2 phases
    reinterpret_cast<float4*>(wide)[t] = make_float4(v, v, v, v);    // @float4: 4 phases
    reinterpret_cast<float4*>(wide)[2 * lane] = make_float4(v, v, v, v);   // @float4stride: 2-way
    bytes[t] = (unsigned char)t;                          // @bytes: 4 lanes per word, 1 wavefront
    __syncthreads();
    float acc = padded[0][t / 32];                        // @bcastsmem: one word, 1 wavefront
    acc += square[(lane * 2) % 32][0];                    // @twoway: 16 words in bank 0
    put(y + blockIdx.x * blockDim.x + t, acc);            // @call1: a helper's two callers,
    put(y + (blockIdx.x * blockDim.x + t) / 2, acc);      // @call2: two sites
    CG_EXTERN_SHARED(float, dyn);
    dyn[t] = acc;                                         // @dynamic: dynamic shared memory
    __syncthreads();
    y[blockIdx.x * blockDim.x + t] = dyn[t ^ 1] + wide[t] + bytes[lane];
}
