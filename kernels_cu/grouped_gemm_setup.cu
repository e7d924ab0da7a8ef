// cugrouped/kernels_cu/grouped_gemm_setup.cu
//
// Setup of cuBLASLt's grouped GEMM (design.md §5): fill, on the device and in one launch, the
// per-group arrays the grouped matmul reads -- A, B, C, D pointer arrays, the A/B scale pointer
// arrays, the int32 rows / cols / ld arrays of A, B and D (C shares D's), and the alpha and beta
// scalars -- from the experts' token counts. The counts come either by value in the argument block
// (host counts) or from a device array (m_dev: the counts the FP8 cast read in its device-splits
// mode), so the GEMM needs no host sync and the launch sequence is CUDA-graph friendly.
//
// Every per-group value is an affine function of the expert index e and of the expert's "tokens"
// t_e (its row count m_e, or m_e rounded up to token_align for the padded transposed copies that
// wgrad reduces over) and of their exclusive prefix P_e = t_0 + ... + t_{e-1}:
//   pointer of matrix X (A, B, D) = base_X + group_stride_X * e + token_stride_X * P_e   (bytes)
//   rows / cols / ld of X        = the constant in the argument block, or t_e where it is -1
//                                  (ld is at least 1)
//   A / B scale pointer          = scale base + group_stride * e + token_stride * Q_e   (bytes),
//                                  or 0 without scales; Q_e is the exclusive prefix of
//                                  q(t_e) = roundup(ceil(t_e / div), mult), the expert's rows of
//                                  its scale layout that grow with its tokens (block scales:
//                                  roundup(t, 4), ceil(t / 128), roundup(ceil(t / 32), 4), ...);
//                                  a per-tensor scale_inv is (group_stride 4, token_stride 0), a
//                                  weight's block scales (their bytes, 0)
// Device counts are clamped exactly as the cast kernel clamps them: negative counts are 0 and the
// prefix never passes total_rows (m_e = min(S_e, total) - min(S_{e-1}, total), S the inclusive
// sum), so both kernels see the same experts.
//
// Expert e is written to group slot[e], or dropped when slot[e] < 0 (the host drops experts with
// nothing to compute when it knows the counts; with device counts slot[e] = e). Byte offsets of
// the arrays inside the workspace come from the host (grouped_workspace_layout); pointer arrays
// are 16-byte aligned there.
//
// One block of GGS_THREADS threads; thread e handles expert e (num_experts <= GGS_THREADS); the
// prefix is a block scan (warp shuffles + one shared array), the same in every thread order.
#include "common.cuh"
#include "block_scan.cuh"

#ifndef CG_GGS_MAX_GROUPS
#define CG_GGS_MAX_GROUPS 256
#endif

namespace cg {

constexpr int GGS_THREADS = CG_GGS_MAX_GROUPS;
static_assert(GGS_THREADS % 32 == 0 && GGS_THREADS <= 1024, "one block, whole warps");

// One operand (A, B or D) of the grouped call.
struct GgsMatrix {
    u64 base;            // device address of expert 0's first element
    i64 group_stride;    // bytes added per expert index
    i64 token_stride;    // bytes added per token of the exclusive prefix
    i32 rows, cols, ld;  // constant, or -1: the expert's tokens
    i32 pad_;
};

// One scale operand (A or B): see the header; base 0 writes null pointers.
struct GgsScale {
    u64 base;
    i64 group_stride;    // bytes added per expert index
    i64 token_stride;    // bytes added per unit of the exclusive prefix of q(tokens)
    i32 div, mult;       // q(t) = roundup(ceil(t / div), mult), both >= 1
};

// Offsets (bytes from the workspace base) of the arrays; the order of GG_* below.
enum GgsArray : int {
    GG_A = 0, GG_B, GG_C, GG_D, GG_A_SCALE, GG_B_SCALE,
    GG_A_ROWS, GG_A_COLS, GG_A_LD, GG_B_ROWS, GG_B_COLS, GG_B_LD, GG_D_ROWS, GG_D_COLS, GG_D_LD,
    GG_ALPHA, GG_BETA, GG_NUM_ARRAYS
};

// Kernel argument block, passed by value (a NumPy structured scalar of the same layout on the
// host side). sizeof = 3*40 + 2*32 + 8 + 8 + 8 + 17*4 + 4*4 + 4*256 + 2*256 = 1828, padded to 1832
// bytes (< 4 KB).
struct GgsArgs {
    GgsMatrix mat[3];                       // A, B, D
    GgsScale scale[2];                      // A scale, B scale
    const i64* m_dev;                       // device counts, or null: m_host
    i64 total_rows;                         // device counts are clamped to it
    u8* workspace;                          // the arrays' base
    i32 offset[GG_NUM_ARRAYS];              // byte offsets from workspace
    i32 num_experts;
    i32 token_align;                        // tokens = roundup(m, token_align)
    float alpha, beta;
    i32 m_host[CG_GGS_MAX_GROUPS];
    short slot[CG_GGS_MAX_GROUPS];
};

// Exclusive prefix sum over the block (see block_scan.cuh).
CG_DEVICE i64 ggs_block_exclusive_scan(i64 v, i64* warp_totals) {
    i64 total;
    return block_inclusive_scan<GGS_THREADS>(v, warp_totals, total) - v;
}

CG_DEVICE i32 ggs_dim(i32 c, i64 tokens) { return c >= 0 ? c : static_cast<i32>(tokens); }

__global__ void __launch_bounds__(GGS_THREADS)
grouped_gemm_setup_kernel(const GgsArgs args) {
    __shared__ i64 warp_totals[GGS_THREADS / 32];
    const int e = threadIdx.x;
    const bool mine = e < args.num_experts;
    i64 m = 0;
    if (args.m_dev == nullptr) {
        m = mine ? args.m_host[e] : 0;
    } else {
        i64 raw = mine ? args.m_dev[e] : 0;
        raw = raw > 0 ? raw : 0;
        const i64 before = ggs_block_exclusive_scan(raw, warp_totals);
        const i64 hi = before + raw < args.total_rows ? before + raw : args.total_rows;
        const i64 lo = before < args.total_rows ? before : args.total_rows;
        m = hi - lo;
    }
    const i64 align = args.token_align;
    const i64 tokens = (m + align - 1) / align * align;
    const i64 prefix = ggs_block_exclusive_scan(tokens, warp_totals);
    u64 scale_ptr[2];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const GgsScale& sc = args.scale[s];
        i64 q_prefix = 0;
        if (sc.token_stride != 0) {          // the same in every thread: all of them scan
            const i64 q = (tokens + sc.div - 1) / sc.div;
            q_prefix = ggs_block_exclusive_scan((q + sc.mult - 1) / sc.mult * sc.mult, warp_totals);
        }
        scale_ptr[s] = sc.base ? sc.base + static_cast<u64>(sc.group_stride * e + sc.token_stride * q_prefix)
                               : 0u;
    }
    if (e == 0) {
        reinterpret_cast<float*>(args.workspace + args.offset[GG_ALPHA])[0] = args.alpha;
        reinterpret_cast<float*>(args.workspace + args.offset[GG_BETA])[0] = args.beta;
    }
    if (!mine) return;
    const int g = args.slot[e];
    if (g < 0) return;
    u64 ptr[3];
    i32 dims[3][3];
#pragma unroll
    for (int x = 0; x < 3; ++x) {
        const GgsMatrix& mx = args.mat[x];
        ptr[x] = mx.base + static_cast<u64>(mx.group_stride * e + mx.token_stride * prefix);
        dims[x][0] = ggs_dim(mx.rows, tokens);
        dims[x][1] = ggs_dim(mx.cols, tokens);
        const i32 ld = ggs_dim(mx.ld, tokens);
        dims[x][2] = ld > 1 ? ld : 1;
    }
    u8* ws = args.workspace;
    reinterpret_cast<u64*>(ws + args.offset[GG_A])[g] = ptr[0];
    reinterpret_cast<u64*>(ws + args.offset[GG_B])[g] = ptr[1];
    reinterpret_cast<u64*>(ws + args.offset[GG_C])[g] = ptr[2];
    reinterpret_cast<u64*>(ws + args.offset[GG_D])[g] = ptr[2];
    reinterpret_cast<u64*>(ws + args.offset[GG_A_SCALE])[g] = scale_ptr[0];
    reinterpret_cast<u64*>(ws + args.offset[GG_B_SCALE])[g] = scale_ptr[1];
#pragma unroll
    for (int x = 0; x < 3; ++x) {
#pragma unroll
        for (int d = 0; d < 3; ++d) {
            reinterpret_cast<i32*>(ws + args.offset[GG_A_ROWS + 3 * x + d])[g] = dims[x][d];
        }
    }
}

}  // namespace cg
