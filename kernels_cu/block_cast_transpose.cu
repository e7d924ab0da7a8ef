// cugrouped/kernels_cu/block_cast_transpose.cu
//
// Multi-tensor pad + block-scaled FP8 cast + transpose for all experts of an MoE layer in one
// launch: TransformerEngine's Float8BlockScaling (DeepSeek-V3's recipe), where every block of 128
// elements (1-D: activations and gradients) or 128 x 128 elements (2-D: weights) has a scale of
// its own, taken from that block's amax in the same pass. No amax pass, no second launch.
//
// MXFP8 (DIMS == BCT_MX; TransformerEngine's MXFP8BlockScaling, the OCP microscaling format the
// sm_100 tensor cores read): blocks of 32 elements of a row (out_row) and of 32 rows of a column
// (out_col: 32 tokens of one feature, along out_col's rows), each with an E8M0 scale byte
// (fp8.cuh: mx_scale_byte), stored directly in the tiled layout cuBLASLt's VEC32_UE8M0 mode reads
// (the "swizzled" one; cugrouped.grouped_block_fp8): for an operand (R, C) row-major, the scale
// of block cb of row r at byte ((r / 128) * ceil(C / 128) + cb / 4) * 512 + (r % 32) * 16 +
// ((r / 32) % 4) * 4 + cb % 4. A 128 x 128 tile of data is exactly one 512-byte scale tile of each
// copy, so every block writes its two scale tiles whole, padding included (blocks of zeros: 0x00).
//
// For every expert e of a chunk (at most CG_BCT_MAX_EXPERTS per launch), input X_e of shape
// (m_e, k) with row stride ld_e elements, element type IN (float32, float16 or bfloat16), and
// m_pad_e = roundup(m_e, align) (align divides 128, so ceil(m_pad_e / 128) = ceil(m_e / 128)):
//   out_row[e]   (m_e, k)      FP8 bytes q = fp8(ftz(ftz(x) * s)), s the scale of x's row block
//   out_col[e]   (k, m_pad_e)  FP8 bytes of X_e's transpose, its own blocks (1-D: 128 rows of one
//                              column, so the bytes differ from out_row's; 2-D: the same blocks,
//                              so they are out_row's bytes transposed); columns m_e.. are zero
//   sinv_row[e]  (1-D, 2-D) float32 scale_inv = 1 / s of the row-wise blocks, TE's GEMM-ready
//                (compact, not swizzled) layouts, which cuBLASLt's VEC128_32F / BLK128x128_32F
//                scale modes read:
//                  1-D: (ceil(k/128), roundup(m_e, 4))   element [kb, r]   (block kb of row r)
//                  2-D: (ceil(m_e/128), roundup(ceil(k/128), 4))  element [mb, kb]
//   sinv_col[e]  the same for out_col, whose rows are X_e's columns:
//                  1-D: (ceil(m_pad_e/128), roundup(k, 4))  element [mb, c]
//                  2-D: (ceil(k/128), roundup(ceil(m_pad_e/128), 4))  element [kb, mb]
// Every scale_inv entry is written, the layouts' padding too: padding rows / columns / blocks are
// blocks of zeros (scale from an amax of 0: 1, or fp8_max / amax_epsilon), so the whole buffer is
// defined and reproducible. s = compute_scale(block amax, margin 0, amax_epsilon, power_2_scale)
// (fp8.cuh; TransformerEngine's QParams, power-of-two scales by default in its recipe).
//
// With COLSUM (template parameter, without GATHER) it also writes colsum[e] (k,): float32 column
// sums of the unscaled input (dbias when the input is a gradient), in a fixed order the NumPy
// reference reproduces: per thread its 4 rows (r, r+32, r+64, r+96) in turn; the 4 row groups
// of a warp by xor-shuffles over lane bits 3 then 4, (g0 + g1) + (g2 + g3); the 8 warps in turn;
// the expert's tile rows in turn, by the last block of each (expert, tile column) from one
// partial row per tile (the per-stream counters return to zero). Rows past m add +0; an empty
// expert's row is zeroed by block 0.
//
// With GATHER (template parameter; the fused MoE permute, as in pad_cast_transpose.cu) expert e's
// rows are rows of one token matrix picked by an index array: row r of expert e is token
// row_index[first_e + r], first_e the rows of the experts before it; an index outside the
// matrix reads as a zero row. The permuted high-precision copy is never written.
//
// With ACT (template parameter; 1-D blocks and MXFP8, without GATHER and COLSUM) X_e has 2k
// columns [a | b] and the kernel casts activate(a, b) (activation.cuh): each segment's two
// halves are loaded and activated as the tile is read, and the tile is float32 from then on (the
// block scales are the activation's).
//
// The grid is a flat list of 128 x 128 tiles (one 2-D block; 128 row blocks and 128 column blocks
// of 1-D); expert e owns tiles [tile_start[e], tile_start[e+1]), row-major over (tile row, tile
// column). An empty expert owns none: it has no bytes and no scales.
#include "common.cuh"
#include "fp8.cuh"
#include "block_scan.cuh"
#include "segment.cuh"
#include "activation.cuh"

#ifndef CG_BCT_MAX_EXPERTS
#define CG_BCT_MAX_EXPERTS 64
#endif

namespace cg {

constexpr int BCT_BLOCK = 128;      // scaling block length (TransformerEngine's kBlockLen)
constexpr int BCT_THREADS = 256;
constexpr int BCT_SEGS_PER_ROW = BCT_BLOCK / kSeg;                                // 8
constexpr int BCT_ROWS_PER_ITER = BCT_THREADS / BCT_SEGS_PER_ROW;                 // 32
constexpr int BCT_ITERS = BCT_BLOCK / BCT_ROWS_PER_ITER;                          // 4
constexpr int BCT_MX = 3;           // DIMS of MXFP8: 1 x 32 blocks, E8M0 scales
constexpr int MX_BLOCK = 32;        // its block length (= BCT_ROWS_PER_ITER: one iteration's rows)
static_assert(BCT_BLOCK == kTileCols, "seg_col, tile_col: 128-column tiles");

constexpr int MX_TILE_BYTES = 512;  // one 128 x 4 scale tile: the scales of a 128 x 128 data tile

// Kernel argument block, passed by value like PctGroup (the NumPy twin is
// cugrouped.ops.block_cast_transpose.group_dtype). sizeof = 7*8*64 + 4*65 + 4 + 4 + (4 pad)
// + 5*8 = 3896 bytes (< 4 KB with the scalars: no room for a per-expert gather offset, so the
// blocks add the counts before their expert to row_first0). Device splits (m_dev != null): the
// host fills the [0] entries with the bases of the whole buffers and the blocks derive the rest.
struct BctGroup {
    const void* in[CG_BCT_MAX_EXPERTS];
    u8* out_row[CG_BCT_MAX_EXPERTS];
    u8* out_col[CG_BCT_MAX_EXPERTS];
    void* sinv_row[CG_BCT_MAX_EXPERTS];      // float32 scale_inv, or (MXFP8) E8M0 bytes
    void* sinv_col[CG_BCT_MAX_EXPERTS];
    i64 m[CG_BCT_MAX_EXPERTS];
    i64 ld[CG_BCT_MAX_EXPERTS];
    i32 tile_start[CG_BCT_MAX_EXPERTS + 1];
    i32 num_experts;
    i32 first_expert;        // device splits: index of this chunk's first expert in m_dev
    const i64* m_dev;        // device splits: counts of all experts, or null
    i64 total_rows;          // device splits: rows of the input; counts are clamped to it
    // Gather (fused MoE permute), or null: every in[e] is the token matrix (device splits:
    // in[0]), src_rows its rows, and expert e's indices start at row_index + row_first0 + the
    // counts of the chunk's experts before e (device splits: at row_index + its row offset).
    const i64* row_index;
    i64 src_rows;
    i64 row_first0;
};

struct BctExpert {
    const void* in;
    u8* out_row;
    u8* out_col;
    void* sinv_row;
    void* sinv_col;
    i64 m, ld;
    i32 tile_begin;
    const i64* idx;          // gather: this expert's row indices (null: rows in place)
    i64 src_rows;
};

CG_HOST_DEVICE i64 ceil_div(i64 a, i64 b) { return (a + b - 1) / b; }
CG_HOST_DEVICE i64 round_up4(i64 v) { return (v + 3) / 4 * 4; }

// Tiles and scale_inv entries of one expert (the host's twin: block_sizes in
// cugrouped/ops/block_cast_transpose.py).
struct BctSizes { i64 tiles, sinv_row, sinv_col; };
template <int DIMS>
CG_HOST_DEVICE BctSizes bct_sizes(i64 m, i64 k) {
    const i64 bk = ceil_div(k, BCT_BLOCK), bm = ceil_div(m, BCT_BLOCK);
    if (DIMS == BCT_MX) return BctSizes{bm * bk, MX_TILE_BYTES * bm * bk, MX_TILE_BYTES * bm * bk};
    if (DIMS == 1) return BctSizes{bm * bk, bk * round_up4(m), bm * round_up4(k)};
    return BctSizes{bm * bk, bm * round_up4(bk), bk * round_up4(bm)};
}

// Device splits: the chunk's per-expert rows and the offsets of its experts in every output
// (rows, transposed bytes, both scale buffers: over all experts before it) and in the grid (over
// the chunk), by block scans over the counts, PCT-style (pad_cast_transpose.cu).
struct BctPlan {
    i64 m[CG_BCT_MAX_EXPERTS], row[CG_BCT_MAX_EXPERTS], col[CG_BCT_MAX_EXPERTS];
    i64 srow[CG_BCT_MAX_EXPERTS], scol[CG_BCT_MAX_EXPERTS];
    i32 tile_start[CG_BCT_MAX_EXPERTS + 1];
    i64 warp_totals[BCT_THREADS / 32];
};

template <int DIMS>
CG_DEVICE void bct_plan_from_device_counts(const BctGroup& g, i64 k, i64 align, BctPlan& p) {
    const int last = g.first_expert + g.num_experts;
    i64 row_carry = 0, col_carry = 0, srow_carry = 0, scol_carry = 0, tile_carry = 0;
    for (int base = 0; base < last; base += BCT_THREADS) {
        const int i = base + threadIdx.x;
        const int j = i - g.first_expert;                 // index within the chunk
        const bool mine = j >= 0 && j < g.num_experts;
        i64 raw = i < last ? g.m_dev[i] : 0;
        raw = raw > 0 ? raw : 0;
        i64 total;
        const i64 incl = block_inclusive_scan<BCT_THREADS>(raw, p.warp_totals, total);
        const i64 hi = row_carry + incl < g.total_rows ? row_carry + incl : g.total_rows;
        const i64 lo = row_carry + incl - raw < g.total_rows ? row_carry + incl - raw : g.total_rows;
        const i64 m = hi - lo;                            // this expert's rows after clamping
        const BctSizes sz = bct_sizes<DIMS>(i < last ? m : 0, k);
        const i64 padded = i < last ? round_up(m, align) : 0;
        i64 col_total, srow_total, scol_total, tile_total;
        const i64 col_incl = block_inclusive_scan<BCT_THREADS>(padded, p.warp_totals, col_total);
        const i64 srow_incl = block_inclusive_scan<BCT_THREADS>(sz.sinv_row, p.warp_totals, srow_total);
        const i64 scol_incl = block_inclusive_scan<BCT_THREADS>(sz.sinv_col, p.warp_totals, scol_total);
        const i64 tiles = mine ? sz.tiles : 0;
        const i64 tile_incl = block_inclusive_scan<BCT_THREADS>(tiles, p.warp_totals, tile_total);
        if (mine) {
            p.m[j] = m;
            p.row[j] = lo;
            p.col[j] = (col_carry + col_incl - padded) * k;
            p.srow[j] = srow_carry + srow_incl - sz.sinv_row;
            p.scol[j] = scol_carry + scol_incl - sz.sinv_col;
            p.tile_start[j] = static_cast<i32>(tile_carry + tile_incl - tiles);
            if (j == g.num_experts - 1) p.tile_start[g.num_experts] = static_cast<i32>(tile_carry + tile_incl);
        }
        row_carry += total;
        col_carry += col_total;
        srow_carry += srow_total;
        scol_carry += scol_total;
        tile_carry += tile_total;
    }
    __syncthreads();
}

// Blocks of BCT_THREADS that must fit on one SM. The tile stays in registers until the column
// scales are known: 4 segments, 64 registers of float32 or 32 of 16-bit input (widened again in
// each phase, opaque_words: left to itself the compiler kept 64 widened floats live and the
// 16-bit variants spilled up to 1.6 KB on sm_100, NVRTC 13.0). So up to 128 registers (2 blocks),
// except 2-D blocks of 16-bit input: 80 (3 blocks). (1-D also keeps 16 column maxima live; at 80
// its 16-bit variants spilled 32 to 156 bytes on sm_80..sm_90.)
constexpr int bct_min_blocks(InDtype in, int dims) { return in != InDtype::F32 && dims == 2 ? 3 : 2; }
// With ACT the tile held in registers is the activation's float32 values, whatever the input.
constexpr InDtype bct_tile_dtype(InDtype in, Act act) {
    return act != Act::NONE ? InDtype::F32 : in;
}

// MXFP8: cast the tile (in registers, raw) one 32-row band at a time: iteration `it`'s rows are
// one column block, so each band is finished before the next is widened (keeping the whole tile
// widened across the phases spilled the fp16 variants, as in the 1-D kernel). Row-wise: a block is
// the 32 columns of this lane and its xor-1 neighbour. Column-wise: the warp's 4 rows (xor 8, 16),
// then the 8 warps through shared memory; the bytes go to `tile` for the transposed write.
// row_tile / col_tile: the tile's 512-byte scale tiles of the two copies, staged in shared memory
// (`stage`) and written at the end by one warp each, 16 bytes per lane: written where they are
// made, a warp's scale bytes were 16 bytes apart (the tiled layout), 16 to 32 sectors per request
// for 32 bytes (cugrouped.emulate.access).
template <InDtype IN, Fp8Format FMT>
CG_DEVICE void mx_cast_tile(const uint4 (&raw)[BCT_ITERS][InTraits<IN>::words], u8* out_row,
                            i64 m, i64 k, i64 row0, i64 gcol, i64 ncol, int c, int r_first,
                            u8* row_tile, u8* col_tile, u8 (&tile)[BCT_BLOCK][BCT_BLOCK],
                            float (&col_part)[BCT_THREADS / 32][BCT_BLOCK],
                            float (&col_scale)[BCT_BLOCK], u8 (&stage)[2][MX_TILE_BYTES]) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int it = 0; it < BCT_ITERS; ++it) {
        float v[kSeg];
        InTraits<IN>::unpack(raw[it], v);
        float a = 0.f;
#pragma unroll
        for (int j = 0; j < kSeg; ++j) {
            v[j] = ftz(v[j]);
            a = fmaxf(a, fabsf(v[j]));
        }
        float s[kSeg];
        if (out_row != nullptr) {
            a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
            const u8 e = mx_scale_byte<FMT>(a);
#pragma unroll
            for (int j = 0; j < kSeg; ++j) s[j] = mx_element_scale(e);
            const uint4 q = cast16<FMT>(v, s);
            const i64 grow = row0 + r_first + BCT_ROWS_PER_ITER * it;
            if (grow < m && ncol > 0) store16(out_row + grow * k + gcol, ncol, q);
            if (threadIdx.x % 2 == 0)   // row r_first + 32 it, block c / 32 (rows past m: 0x00)
                stage[0][r_first * 16 + it * 4 + c / MX_BLOCK] = e;   // the tiled layout
        }
        if (col_tile != nullptr) {
#pragma unroll
            for (int j = 0; j < kSeg; ++j) {
                float b = fabsf(v[j]);
                b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, 8));
                b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, 16));
                if (lane < BCT_SEGS_PER_ROW) col_part[warp][seg_col(c + j)] = b;
            }
            __syncthreads();
            if (threadIdx.x < BCT_BLOCK) {   // column cc's block `it`: row cc of the scale tile
                const int cc = threadIdx.x;
                float b = col_part[0][seg_col(cc)];
#pragma unroll
                for (int w = 1; w < BCT_THREADS / 32; ++w) b = fmaxf(b, col_part[w][seg_col(cc)]);
                const u8 e = mx_scale_byte<FMT>(b);
                col_scale[seg_col(cc)] = mx_element_scale(e);
                stage[1][it * BCT_BLOCK + cc] = e;   // by column: conflict-free; tiled below
            }
            __syncthreads();
#pragma unroll
            for (int j = 0; j < kSeg; ++j) s[j] = col_scale[seg_col(c + j)];
            const int r = r_first + BCT_ROWS_PER_ITER * it;
            *reinterpret_cast<uint4*>(&tile[r][tile_col(r, c)]) = cast16<FMT>(v, s);
        }
    }
    // The scale tiles: lane L writes bytes 16 L .. 16 L + 15, the tiled layout's row L (scales of
    // rows, resp. columns, L, L + 32, L + 64, L + 96 of the data tile, 4 blocks each).
    __syncthreads();
    u8* dst = warp == 0 ? row_tile : warp == 1 ? col_tile : nullptr;
    if (dst != nullptr) {
        uint4 q;
        if (warp == 0) {
            q = reinterpret_cast<const uint4*>(stage[0])[lane];
        } else {
            u32 words[4];
#pragma unroll
            for (int w = 0; w < 4; ++w) {   // byte 4 w + it: column 32 w + L, block `it`
                const u8* col = stage[1] + 32 * w + lane;
                words[w] = u32(col[0]) | (u32(col[BCT_BLOCK]) << 8) | (u32(col[2 * BCT_BLOCK]) << 16) |
                           (u32(col[3 * BCT_BLOCK]) << 24);
            }
            q = make_uint4(words[0], words[1], words[2], words[3]);
        }
        store16(dst + 16 * lane, 16, q);   // (bytes if an out= buffer is not 16-byte aligned)
    }
}

// COLSUM: zero the column sums of the chunk's empty experts (block 0; they own no tiles).
CG_DEVICE void bct_zero_empty_colsums(const i64* m, int num_experts, i64 k, float* colsum) {
    for (int j = 0; j < num_experts; ++j)
        if (m[j] == 0)
            for (i64 c = threadIdx.x; c < k; c += BCT_THREADS) colsum[j * k + c] = 0.f;
}

template <InDtype IN, Fp8Format FMT, int DIMS, bool GATHER = false, bool COLSUM = false,
          Act ACT = Act::NONE>
__global__ void __launch_bounds__(BCT_THREADS, bct_min_blocks(bct_tile_dtype(IN, ACT), DIMS))
block_cast_transpose_kernel(const BctGroup g, const i64 k, const i32 align,
                            const float amax_epsilon, const i32 power_2_scale,
                            float* __restrict__ colsum,          // (experts, k) (COLSUM) or null
                            float* __restrict__ colsum_partial,  // one 128-float row per tile
                            int* __restrict__ colsum_count)      // experts * tiles_k, zero on entry
{
    static_assert(!(COLSUM && GATHER), "column sums are for gradients, which are not gathered");
    static_assert(DIMS == 1 || DIMS == 2 || DIMS == BCT_MX,
                  "1-D (1 x 128), 2-D (128 x 128) or MXFP8 (1 x 32, E8M0) blocks");
    constexpr bool MX = DIMS == BCT_MX;
    constexpr int SINV_BYTES = MX ? 1 : 4;                        // an E8M0 byte or a float32
    constexpr bool kGated = ACT != Act::NONE;
    static_assert(!kGated || (!GATHER && !COLSUM && DIMS != 2),
                  "the activation: 1-D blocks or MXFP8, no gather, no column sums");
    constexpr InDtype TILE = bct_tile_dtype(IN, ACT);
    using InT = InTraits<IN>;                                     // the input's elements
    using Traits = InTraits<TILE>;                                // the tile's, in registers
    __shared__ __align__(16) u8 tile[BCT_BLOCK][BCT_BLOCK];      // the column-wise bytes (tile_col)
    __shared__ float col_part[BCT_THREADS / 32][BCT_BLOCK];       // 1-D: per-warp column maxima
    __shared__ __align__(16) u8 mx_stage[2][MX_TILE_BYTES];      // MXFP8: the two scale tiles
    __shared__ float col_scale[BCT_BLOCK];                        // 1-D: the column blocks' scales
                                                                  // (both indexed by seg_col)
    __shared__ float warp_amax[BCT_THREADS / 32];                 // 2-D: per-warp block maxima
    __shared__ BctPlan plan;
    __shared__ int last_block;

    const int t = blockIdx.x;
    BctExpert x;
    int e;
    if (g.m_dev == nullptr) {
        if (COLSUM && blockIdx.x == 0) bct_zero_empty_colsums(g.m, g.num_experts, k, colsum);
        e = expert_of_tile(g.tile_start, g.num_experts, t);
        const i64* idx = nullptr;
        if (GATHER) {
            i64 first = g.row_first0;
            for (int j = 0; j < e; ++j) first += g.m[j];   // e < 64, the same in every thread
            idx = g.row_index + first;
        }
        x = BctExpert{g.in[e], g.out_row[e], g.out_col[e], g.sinv_row[e], g.sinv_col[e], g.m[e],
                      g.ld[e], g.tile_start[e], idx, g.src_rows};
    } else {
        bct_plan_from_device_counts<DIMS>(g, k, align, plan);
        if (COLSUM && blockIdx.x == 0) bct_zero_empty_colsums(plan.m, g.num_experts, k, colsum);
        if (t >= plan.tile_start[g.num_experts]) return;   // the grid is an upper bound; whole block
        e = expert_of_tile(plan.tile_start, g.num_experts, t);
        x = BctExpert{static_cast<const char*>(g.in[0]) +
                          (GATHER ? 0 : plan.row[e] * g.ld[0] * InT::bytes),
                      g.out_row[0] ? g.out_row[0] + plan.row[e] * k : nullptr,
                      g.out_col[0] ? g.out_col[0] + plan.col[e] : nullptr,
                      g.sinv_row[0] ? static_cast<char*>(g.sinv_row[0]) + plan.srow[e] * SINV_BYTES
                                    : nullptr,
                      g.sinv_col[0] ? static_cast<char*>(g.sinv_col[0]) + plan.scol[e] * SINV_BYTES
                                    : nullptr,
                      plan.m[e], g.ld[0], plan.tile_start[e],
                      GATHER ? g.row_index + plan.row[e] : nullptr, g.src_rows};
    }
    const i64 m = x.m;
    const i64 m_pad = round_up(m, align);
    const i64 tiles_k = ceil_div(k, BCT_BLOCK);
    const i64 local = t - x.tile_begin;
    const i64 tr = local / tiles_k, tc = local % tiles_k;
    const i64 row0 = tr * BCT_BLOCK, col0 = tc * BCT_BLOCK;
    const bool rowwise = x.out_row != nullptr;
    const bool columnwise = x.out_col != nullptr;
    const bool p2 = power_2_scale != 0;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int c = (threadIdx.x % BCT_SEGS_PER_ROW) * kSeg;        // this thread's columns c .. c+15
    const int r_first = threadIdx.x / BCT_SEGS_PER_ROW;           // its rows r_first + 32 * it
    const i64 gcol = col0 + c;
    const i64 ncol = gcol < k ? (k - gcol < kSeg ? k - gcol : kSeg) : 0;   // valid columns

    // Load the tile's segments (rows past m and columns past k read as zero). A full tile (inside
    // k, rows 16-byte aligned: block-uniform) issues all its loads before anything else; its rows
    // past m (an expert's last tile: most tiles of a small expert) read row m - 1 again (a tile
    // exists only for m >= 1; L1/L2 serve it), so that no load waits on a branch, and are zeroed.
    uint4 raw[BCT_ITERS][Traits::words];
    const bool full_tile = col0 + BCT_BLOCK <= k && aligned16(x.in) &&
                           (x.ld * InT::bytes) % 16 == 0;
    if constexpr (kGated) {
        // Both halves of one iteration's segment, then their activation as float32 words
        // (loading the whole tile's halves first would hold twice the tile in registers).
#pragma unroll
        for (int it = 0; it < BCT_ITERS; ++it) {
            const i64 grow = row0 + r_first + BCT_ROWS_PER_ITER * it;
            const bool in_rows = grow < m;       // (rows past m read nothing)
            uint4 wa[InT::words], wb[InT::words];
            load_segment<IN>(in_rows ? segment_src<InT::bytes, false>(x, grow, gcol) : x.in,
                             in_rows ? ncol : 0, wa);
            load_segment<IN>(in_rows ? segment_src<InT::bytes, false>(x, grow, gcol + k) : x.in,
                             in_rows ? ncol : 0, wb);
            float va[kSeg], vb[kSeg];
            InT::unpack(wa, va);
            InT::unpack(wb, vb);
            u32 bits[kSeg];
#pragma unroll
            for (int j = 0; j < kSeg; ++j) bits[j] = f32_bits(activate<ACT>(va[j], vb[j]));
#pragma unroll
            for (int w = 0; w < Traits::words; ++w)
                raw[it][w] = make_uint4(bits[4 * w], bits[4 * w + 1], bits[4 * w + 2],
                                        bits[4 * w + 3]);
        }
    } else if (full_tile) {   // one basic block of 16-byte loads (tests/test_sass.py)
#pragma unroll
        for (int it = 0; it < BCT_ITERS; ++it) {
            const i64 grow = row0 + r_first + BCT_ROWS_PER_ITER * it;
            InT::load_raw(segment_src<InT::bytes, GATHER>(x, grow < m ? grow : m - 1, gcol),
                          raw[it]);
        }
#pragma unroll
        for (int it = 0; it < BCT_ITERS; ++it) {
            if (row0 + r_first + BCT_ROWS_PER_ITER * it >= m) {
#pragma unroll
                for (int w = 0; w < Traits::words; ++w) raw[it][w] = make_uint4(0u, 0u, 0u, 0u);
            }
        }
    } else {
#pragma unroll
        for (int it = 0; it < BCT_ITERS; ++it) {
            const i64 grow = row0 + r_first + BCT_ROWS_PER_ITER * it;
            // (rows past m read nothing: not even their index)
            const void* src = grow < m ? segment_src<InT::bytes, GATHER>(x, grow, gcol)
                                       : x.in;
            load_segment<IN>(src, grow < m ? ncol : 0, raw[it]);
        }
    }

    if (MX) {
        mx_cast_tile<TILE, FMT>(raw, x.out_row, m, k, row0, gcol, ncol, c, r_first,
                              rowwise ? static_cast<u8*>(x.sinv_row) + local * MX_TILE_BYTES : nullptr,
                              columnwise ? static_cast<u8*>(x.sinv_col) +
                                               (tc * ceil_div(m, BCT_BLOCK) + tr) * MX_TILE_BYTES
                                         : nullptr,
                              tile, col_part, col_scale, mx_stage);
    } else {
        // Amax: 1-D, of each row's segment of 8 lanes (xor-shuffles 1, 2, 4) and of each column over
        // the 128 rows; 2-D, of the whole tile. NaN is ignored (fmaxf), as in every cugrouped amax.
        float cmax[kSeg];
#pragma unroll
        for (int j = 0; j < kSeg; ++j) cmax[j] = 0.f;
        float tile_amax = 0.f;
        float s_row[BCT_ITERS];
#pragma unroll
        for (int it = 0; it < BCT_ITERS; ++it) {
            float v[kSeg];
            Traits::unpack(raw[it], v);
            float a = 0.f;
#pragma unroll
            for (int j = 0; j < kSeg; ++j) {
                const float av = fabsf(ftz(v[j]));
                a = fmaxf(a, av);
                if (DIMS == 1) cmax[j] = fmaxf(cmax[j], av);
            }
            if (DIMS == 1) {
#pragma unroll
                for (int off = 1; off < BCT_SEGS_PER_ROW; off <<= 1)
                    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, off));
                s_row[it] = compute_scale<FMT>(a, 0, amax_epsilon, p2);
            } else {
                tile_amax = fmaxf(tile_amax, a);
            }
        }
        if (DIMS == 2) {
            tile_amax = warp_max(tile_amax);
            if (lane == 0) warp_amax[warp] = tile_amax;
            __syncthreads();
            float a = warp_amax[0];
#pragma unroll
            for (int w = 1; w < BCT_THREADS / 32; ++w) a = fmaxf(a, warp_amax[w]);
            const float s = compute_scale<FMT>(a, 0, amax_epsilon, p2);
#pragma unroll
            for (int it = 0; it < BCT_ITERS; ++it) s_row[it] = s;
        }

        // Row-wise bytes and their scale_inv (1-D: one per row and tile column, written by the first
        // lane of the row, padding rows m .. roundup(m, 4) included; 2-D: one per tile).
        if (rowwise) {
#pragma unroll
            for (int it = 0; it < BCT_ITERS; ++it) {
                opaque_words(raw[it]);   // widen again below rather than keep 64 floats live
                const i64 grow = row0 + r_first + BCT_ROWS_PER_ITER * it;
                float v[kSeg], s[kSeg];
                Traits::unpack(raw[it], v);
#pragma unroll
                for (int j = 0; j < kSeg; ++j) { v[j] = ftz(v[j]); s[j] = s_row[it]; }
                const uint4 q = cast16<FMT>(v, s);
                if (grow < m && ncol > 0) store16(x.out_row + grow * k + gcol, ncol, q);
                if (DIMS == 1 && threadIdx.x % BCT_SEGS_PER_ROW == 0 && grow < round_up4(m))
                    static_cast<float*>(x.sinv_row)[tc * round_up4(m) + grow] = scale_inverse(s_row[it]);
            }
            if (DIMS == 2 && threadIdx.x < 4) {
                // this tile's entry; the last tile column also writes the row's padding entries
                const i64 ld = round_up4(tiles_k);
                const i64 col = tc + threadIdx.x;
                if (threadIdx.x == 0 || (tc == tiles_k - 1 && col < ld))
                    static_cast<float*>(x.sinv_row)[tr * ld + col] = scale_inverse(
                        threadIdx.x == 0 ? s_row[0] : compute_scale<FMT>(0.f, 0, amax_epsilon, p2));
            }
        }

        if (columnwise) {   // block-uniform
            // Column-wise scales: 1-D from the column maxima (lanes sharing columns: xor 8, 16; then the
            // 8 warps through shared memory); 2-D the tile's.
            float s_col[kSeg];
            if (DIMS == 1) {
#pragma unroll
                for (int j = 0; j < kSeg; ++j) {
                    cmax[j] = fmaxf(cmax[j], __shfl_xor_sync(0xffffffffu, cmax[j], 8));
                    cmax[j] = fmaxf(cmax[j], __shfl_xor_sync(0xffffffffu, cmax[j], 16));
                }
                if (lane < BCT_SEGS_PER_ROW) {
#pragma unroll
                    for (int j = 0; j < kSeg; ++j) col_part[warp][seg_col(lane * kSeg + j)] = cmax[j];
                }
                __syncthreads();
                if (threadIdx.x < BCT_BLOCK) {
                    float a = col_part[0][seg_col(threadIdx.x)];
#pragma unroll
                    for (int w = 1; w < BCT_THREADS / 32; ++w) a = fmaxf(a, col_part[w][seg_col(threadIdx.x)]);
                    const float s = compute_scale<FMT>(a, 0, amax_epsilon, p2);
                    col_scale[seg_col(threadIdx.x)] = s;
                    const i64 cc = col0 + threadIdx.x;     // padding columns k .. roundup(k, 4) included
                    if (cc < round_up4(k))
                        static_cast<float*>(x.sinv_col)[tr * round_up4(k) + cc] = scale_inverse(s);
                }
                __syncthreads();
#pragma unroll
                for (int j = 0; j < kSeg; ++j) s_col[j] = col_scale[seg_col(c + j)];
            } else {
#pragma unroll
                for (int j = 0; j < kSeg; ++j) s_col[j] = s_row[0];
                if (threadIdx.x < 4) {
                    const i64 tiles_m = ceil_div(m_pad, BCT_BLOCK);
                    const i64 ld = round_up4(tiles_m);
                    const i64 row = tr + threadIdx.x;
                    if (threadIdx.x == 0 || (tr == tiles_m - 1 && row < ld))
                        static_cast<float*>(x.sinv_col)[tc * ld + row] = scale_inverse(
                            threadIdx.x == 0 ? s_row[0] : compute_scale<FMT>(0.f, 0, amax_epsilon, p2));
                }
            }
#pragma unroll
            for (int it = 0; it < BCT_ITERS; ++it) {
                opaque_words(raw[it]);
                float v[kSeg];
                Traits::unpack(raw[it], v);
#pragma unroll
                for (int j = 0; j < kSeg; ++j) v[j] = ftz(v[j]);
                const int r = r_first + BCT_ROWS_PER_ITER * it;
                *reinterpret_cast<uint4*>(&tile[r][tile_col(r, c)]) = cast16<FMT>(v, s_col);
            }
        }
    }

    if (columnwise) {
        // Transposed bytes: two lanes per 32-row run of a column (store_transposed_tile); rows
        // m .. m_pad are the zero padding (they read as zero and cast to zero).
        __syncthreads();
        store_transposed_tile<BCT_BLOCK, BCT_THREADS>(tile, x.out_col, k, m_pad, row0, col0);
    }

    // Column sums (COLSUM), in the order the header states.
    if (COLSUM) {
        float csum[kSeg];
#pragma unroll
        for (int it = 0; it < BCT_ITERS; ++it) {
            opaque_words(raw[it]);
            float v[kSeg];
            Traits::unpack(raw[it], v);
#pragma unroll
            for (int j = 0; j < kSeg; ++j) csum[j] = it == 0 ? ftz(v[j]) : ftz(csum[j] + ftz(v[j]));
        }
#pragma unroll
        for (int j = 0; j < kSeg; ++j) {
            csum[j] = ftz(csum[j] + __shfl_xor_sync(0xffffffffu, csum[j], 8));
            csum[j] = ftz(csum[j] + __shfl_xor_sync(0xffffffffu, csum[j], 16));
        }
        __syncthreads();                                  // col_part is free again
        if (lane < BCT_SEGS_PER_ROW) {
#pragma unroll
            for (int j = 0; j < kSeg; ++j) col_part[warp][seg_col(lane * kSeg + j)] = csum[j];
        }
        __syncthreads();
        const int c = threadIdx.x;
        if (c < BCT_BLOCK) {
            float acc = col_part[0][seg_col(c)];
            for (int w = 1; w < BCT_THREADS / 32; ++w) acc = ftz(acc + col_part[w][seg_col(c)]);
            colsum_partial[static_cast<i64>(t) * BCT_BLOCK + c] = acc;
            __threadfence();
        }
        __syncthreads();
        const i64 tiles_m = ceil_div(m, BCT_BLOCK);
        int* counter = colsum_count + static_cast<i64>(e) * tiles_k + tc;
        if (threadIdx.x == 0) last_block = atomicAdd(counter, 1) == tiles_m - 1;
        __syncthreads();
        if (last_block) {
            __threadfence();
            if (c < BCT_BLOCK && col0 + c < k) {
                const volatile float* part = colsum_partial;
                const i64 first = static_cast<i64>(x.tile_begin) + tc;
                float acc = part[first * BCT_BLOCK + c];
                for (i64 r = 1; r < tiles_m; ++r)
                    acc = ftz(acc + part[(first + r * tiles_k) * BCT_BLOCK + c]);
                colsum[static_cast<i64>(e) * k + col0 + c] = acc;
            }
            if (threadIdx.x == 0) atomicExch(counter, 0);
        }
    }
}

}  // namespace cg
