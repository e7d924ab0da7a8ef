// cugrouped/kernels_cu/scale_update.cu
//
// Delayed scaling (design.md §3): update the amax histories and the scales of every FP8 tensor of
// every expert in one launch, on the device, with no host sync.
//
// T tensors (for a GroupedLinear of E experts: E inputs, E weights, E grad outputs), one block per
// tensor. Tensor t owns
//   history[t * L .. t * L + L)   float32, most recent first (history[t*L + 0] is the newest amax)
//   amax[t]                       the amax the cast kernel measured this step (zeroed after
//                                 it is read when reset_amax != 0: rolled in, consumed)
//   scale[t], scale_inv[t]        float32, written here
// and the block, unless the new amax is 0 (a step that measured nothing: an expert that received
// no tokens, a weight that was not cast again; -0 and denormals count as 0, as the GPU's FTZ
// comparisons see them), in which case the history and the scale stay as they are (only
// scale_inv is rewritten, from the kept scale), as in TransformerEngine's update, where such a
// step neither rolls the history nor moves the scale:
//   1. rolls the history by one and inserts the new amax at the front:
//        h'[0] = amax[t],  h'[j] = h[j - 1]  (j = 1 .. L-1; the oldest value drops out);
//      values are moved bit for bit (no arithmetic touches them, so FTZ cannot change them);
//   2. reduces:  MOST_RECENT -> amax[t];  MAX -> the maximum of the non-NaN entries of h'[0 .. L)
//      (NaN entries are skipped, as fmaxf does in TransformerEngine's update; an all-NaN window
//      reduces to -inf);
//   3. scale = compute_scale<F>(reduced, margin) when the reduced amax is usable (a positive,
//      normal, finite float32: amax_usable in fp8.cuh); otherwise the tensor KEEPS its previous
//      scale (a window of zeros, inf, NaN), as TransformerEngine's delayed scaling does:
//      resetting to 1 would underflow E5M2 gradients the next time the expert is used. scale_inv = scale_inverse(scale) either way (fp8.cuh: the
//      bits the reference reproduces).
// With reset_amax != 0, thread 0 writes amax[t] = 0 at the end, once every thread has read it (all
// threads read it into `newest` before the first barrier of the roll, which runs at least once
// as L >= 1, and nothing reads amax[t] afterwards; an idle tensor has no barrier, but its amax
// is a zero or a denormal, so a thread that reads the 0 written over it takes the same branch): forwards then max-merge their amaxes into a
// zero buffer until the next update, with no separate zeroing launch.
//
// Tensors [0, num_e4m3) use E4M3's maximum, the rest E5M2's (HYBRID: inputs and weights E4M3,
// grad outputs E5M2), so one launch serves every tensor of the layer.
//
// The roll is done in place, in chunks of THREADS entries from the oldest end to the newest: every
// thread reads its source h[i - 1], the block synchronises, then writes h[i]. A chunk writes only
// its own entries, which no later (lower) chunk reads, and it reads the last entry of the chunk
// below before that chunk is written (the barrier orders them), so no entry is lost.
//
// The result is order independent: the maximum of floats is exact, and the only order-dependent
// bits (a -0 / +0 tie, or a denormal against 0 under the GPU's FTZ comparisons) are unusable
// amaxes, which both keep the previous scale. The reduced amax itself is never stored.
#include "common.cuh"
#include "fp8.cuh"

#ifndef CG_SU_THREADS
#define CG_SU_THREADS 128
#endif

namespace cg {

constexpr int SU_THREADS = CG_SU_THREADS;

enum class AmaxAlgo : int { MAX = 0, MOST_RECENT = 1 };

template <AmaxAlgo ALGO>
__global__ void __launch_bounds__(SU_THREADS)
scale_update_kernel(float* __restrict__ history, float* __restrict__ amax,
                    float* __restrict__ scale, float* __restrict__ scale_inv, i64 num_tensors,
                    i64 history_len, i64 num_e4m3, int margin, int reset_amax) {
    const i64 t = (i64)blockIdx.x;
    if (t >= num_tensors) return;  // uniform per block: no thread is left at a barrier
    const int tid = (int)threadIdx.x;
    const i64 L = history_len;
    float* h = history + t * L;
    const float newest = amax[t];
    // one value per block, so every thread takes the same branch around the barriers below
    const bool idle = (f32_bits(newest) & 0x7F800000u) == 0u;   // +-0 or denormal

    float best = bits_f32(0xFF800000u);       // -inf: "no entry yet"; NaN entries never win
    const i64 chunks = idle ? 0 : (L + SU_THREADS - 1) / SU_THREADS;
    for (i64 c = chunks - 1; c >= 0; --c) {
        const i64 i = c * SU_THREADS + tid;
        float v = 0.f;
        if (i < L) v = (i == 0) ? newest : h[i - 1];
        __syncthreads();  // every source of this chunk is read before any entry of it is written
        if (i < L) {
            h[i] = v;
            if (ALGO == AmaxAlgo::MAX && v > best) best = v;
        }
    }

    float reduced = newest;                   // idle: 0 or a denormal, never usable
    if (ALGO == AmaxAlgo::MAX && !idle) {
        __shared__ float s_best[SU_THREADS];
        s_best[tid] = best;
        __syncthreads();
        for (int stride = SU_THREADS / 2; stride > 0; stride >>= 1) {
            if (tid < stride && s_best[tid + stride] > s_best[tid]) s_best[tid] = s_best[tid + stride];
            __syncthreads();
        }
        reduced = s_best[0];
    }
    if (tid == 0) {
        float s = scale[t];  // kept when the reduced amax is unusable
        if (amax_usable(reduced)) {
            s = t < num_e4m3 ? compute_scale<Fp8Format::E4M3>(reduced, margin)
                             : compute_scale<Fp8Format::E5M2>(reduced, margin);
        }
        scale[t] = s;
        scale_inv[t] = scale_inverse(s);
        // every thread read amax[t] before the roll's first barrier, which it has passed
        if (reset_amax) amax[t] = 0.f;
    }
}

}  // namespace cg
