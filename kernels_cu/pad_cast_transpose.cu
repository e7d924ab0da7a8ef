// cugrouped/kernels_cu/pad_cast_transpose.cu
//
// Multi-tensor pad + FP8 cast + transpose (+ amax) for all experts of an MoE layer in one launch.
//
// For every expert e of a chunk (at most CG_PCT_MAX_EXPERTS per launch), with input X_e of shape
// (m_e, k), row stride ld_e elements, element type IN (float32, float16 or bfloat16):
//   out_row[e]  (m_e, k)      row-major FP8 bytes of  q = fp8(ftz(ftz(x) * scale[e]))
//   out_col[e]  (k, m_pad_e)  the same bytes transposed; columns m_e .. m_pad_e-1 are zero,
//                             written here (m_pad_e = roundup(m_e, align)); no memset anywhere
//   amax[e]     max |ftz(x)| over the unpadded input (NaN ignored, as fmaxf does)
//   colsum[e]   (k,) float32 column sums of the unscaled input (dbias of a gradient), optional
//               (template parameter COLSUM, in the modes that compute amax), in a fixed summation
//               order (see "Column sums" below), so every run gives the same bits and the NumPy
//               reference can reproduce them
// With GATHER (template parameter; the fused MoE permute) X_e's rows are rows of one token matrix
// picked by an index array (PctGroup::row_index), so the permuted high-precision copy a framework
// would write first is never made; an index outside the matrix reads as a zero row.
// The grid is a flat list of 64 x 128 tiles; expert e owns tiles [tile_start[e], tile_start[e+1]),
// row-major over (tile row, tile column), at least one tile row, so that an empty expert still
// writes its amax, scale_inv and (zero) column sums. With half tiles (template parameter HALF) an
// expert's last tile row of at most 32 rows (m_pad % 64 in 1..32, or an empty expert) is a row of
// ceil(tiles_k / 2) tiles of 32 rows x 256 columns instead of tiles_k mostly empty 64-row ones
// (tile_rows). Same bits either way.
//
// Modes (template parameter MODE):
//   PCT_AMAX_ONLY  first pass of current scaling: amax, then scale = compute_scale(amax, margin,
//                  amax_epsilon, power_2_scale) (fp8.cuh) and scale_inv, written by the last
//                  tile of each expert; nothing else is written;
//   PCT_CAST       second pass of current scaling: cast with the scale the first pass wrote;
//   PCT_CAST_AMAX  delayed scaling (caller's scales): cast and amax fused, scale_inv written;
//                  with amax_accumulate != 0 the amax is max-merged into amax[e] instead of
//                  overwriting it (amax[e] = ftz(old) > a ? old : a: fmaxf(old, a) for every
//                  old value that is not NaN, denormal or -0; those give a), so a layer keeps a
//                  pending amax across forwards without a second launch.
//
// Cross-block reductions use a per-stream workspace (two ints per expert slot) that is zero when a
// launch starts and that the last block of each expert returns to zero ("last block" pattern of the
// CUDA threadFenceReduction sample): no memset, no second launch, deterministic results.
#include "common.cuh"
#include "fp8.cuh"
#include "block_scan.cuh"
#include "segment.cuh"
#include "activation.cuh"

#ifndef CG_PCT_MAX_EXPERTS
#define CG_PCT_MAX_EXPERTS 64
#endif

namespace cg {

enum class PctMode : int { AMAX_ONLY = 0, CAST = 1, CAST_AMAX = 2 };

constexpr int PCT_TILE_M = 64;     // rows (tokens) per tile
constexpr int PCT_TILE_K = 128;    // columns (features) per tile
constexpr int PCT_SEG = kSeg;      // elements per thread-segment: one 16-byte FP8 store
constexpr int PCT_THREADS = 256;
constexpr int PCT_SEGS_PER_ROW = PCT_TILE_K / PCT_SEG;                             // 8
constexpr int PCT_SEG_ITERS = PCT_TILE_M * PCT_SEGS_PER_ROW / PCT_THREADS;         // 2
static_assert(PCT_TILE_K == kTileCols, "seg_col, tile_col: 128-column tiles");
static_assert(PCT_THREADS / PCT_SEGS_PER_ROW == PCT_TILE_M / 2,
              "iteration it of a thread: tile row threadIdx.x / 8 + 32 it (half tiles' halves)");

// Kernel argument block: passed by value (CuPy RawKernel takes a NumPy structured scalar with the
// same layout; the emulator passes the same bytes). Fixed arrays of pointers and int64 have the same
// layout on x86-64 and nvptx64. sizeof = 6*8*64 + 4*65 + 4 + 4 + (4 pad) + 4*8 = 3376 bytes (< 4 KB).
//
// Host splits: the host fills every per-expert field. Device splits (m_dev != null): the counts
// live in device memory and the host knows only the total; it fills in[0], ld[0], out_row[0] and
// out_col[0] with the bases of the whole buffers, and each block derives the per-expert fields
// (block_plan_from_device_counts) -- no host sync, no extra launch.
struct PctGroup {
    const void* in[CG_PCT_MAX_EXPERTS];
    u8* out_row[CG_PCT_MAX_EXPERTS];
    u8* out_col[CG_PCT_MAX_EXPERTS];
    i64 m[CG_PCT_MAX_EXPERTS];
    i64 ld[CG_PCT_MAX_EXPERTS];
    i32 tile_start[CG_PCT_MAX_EXPERTS + 1];
    i32 num_experts;
    i32 first_expert;        // device splits: index of this chunk's first expert in m_dev
    const i64* m_dev;        // device splits: counts of all experts, or null
    i64 total_rows;          // device splits: rows of the input; counts are clamped to it
    // Gather (fused MoE permute), or null: row r of expert e is row row_index[row_first[e] + r]
    // of the token matrix at in[e] (every in[e] is that matrix's base; device splits: in[0], and
    // row_first comes from the counts); an index outside [0, src_rows) reads as a zero row.
    const i64* row_index;
    i64 src_rows;
    i64 row_first[CG_PCT_MAX_EXPERTS];
};

// One expert of the chunk as a block sees it.
struct PctExpert {
    const void* in;
    u8* out_row;
    u8* out_col;
    i64 m, ld;
    i32 tile_begin, tile_end;
    const i64* idx;          // gather: this expert's row indices (null: rows in place)
    i64 src_rows;
};

// An expert's tile rows: `full` rows of 64 x 128 tiles, then (half) one row of half tiles, 32 rows
// x 256 columns each: a half tile holds rows 0..31 of two neighbouring 128-column tiles, the
// second one's in its tile rows 32..63. Without half tiles at least one full row, so that an empty
// expert still writes its amax, scale_inv and (zero) column sums; with them an empty expert has a
// row of half tiles instead.
struct PctRows {
    i64 full;
    bool half;
};
CG_DEVICE PctRows tile_rows(i64 m_pad, bool half_tiles) {
    const i64 rows = (m_pad + PCT_TILE_M - 1) / PCT_TILE_M;
    if (!half_tiles) return PctRows{rows > 0 ? rows : 1, false};
    if (rows == 0) return PctRows{0, true};
    const i64 last = m_pad - (rows - 1) * PCT_TILE_M;   // rows of the last tile row, 1..64
    return last <= PCT_TILE_M / 2 ? PctRows{rows - 1, true} : PctRows{rows, false};
}

CG_DEVICE i64 tiles_of(i64 m_pad, i64 tiles_k, bool half_tiles) {
    const PctRows r = tile_rows(m_pad, half_tiles);
    return r.full * tiles_k + (r.half ? (tiles_k + 1) / 2 : 0);
}

// Device splits: read the counts of experts [0, first + num) in passes of PCT_THREADS, clamp them so
// that they never run past total_rows (clamped prefix = min(prefix, total_rows)), and fill the
// chunk's per-expert rows, row offsets, padded-column offsets and tile offsets in shared memory:
// three block scans per pass (rows, padded columns, tiles of the chunk's experts), no serial loop.
CG_DEVICE void block_plan_from_device_counts(const PctGroup& g, i64 k, i64 align, bool half_tiles,
                                             i64* sh_m, i64* sh_row, i64* sh_col,
                                             i32* sh_tile_start, i64* warp_totals) {
    const int last = g.first_expert + g.num_experts;
    const i64 tiles_k = (k + PCT_TILE_K - 1) / PCT_TILE_K;
    i64 row_carry = 0, col_carry = 0, tile_carry = 0;
    for (int base = 0; base < last; base += PCT_THREADS) {
        const int i = base + threadIdx.x;
        const int j = i - g.first_expert;                 // index within the chunk
        const bool mine = j >= 0 && j < g.num_experts;
        i64 raw = i < last ? g.m_dev[i] : 0;
        raw = raw > 0 ? raw : 0;
        i64 total;
        const i64 incl = block_inclusive_scan<PCT_THREADS>(raw, warp_totals, total);
        const i64 hi = row_carry + incl < g.total_rows ? row_carry + incl : g.total_rows;
        const i64 lo = row_carry + incl - raw < g.total_rows ? row_carry + incl - raw : g.total_rows;
        const i64 m = hi - lo;                            // this expert's rows after clamping
        const i64 padded = i < last ? round_up(m, align) : 0;
        i64 col_total;
        const i64 col_incl = block_inclusive_scan<PCT_THREADS>(padded, warp_totals, col_total);
        const i64 tiles = mine ? tiles_of(padded, tiles_k, half_tiles) : 0;
        i64 tile_total;
        const i64 tile_incl = block_inclusive_scan<PCT_THREADS>(tiles, warp_totals, tile_total);
        if (mine) {
            sh_m[j] = m;
            sh_row[j] = lo;
            sh_col[j] = (col_carry + col_incl - padded) * k;
            sh_tile_start[j] = static_cast<i32>(tile_carry + tile_incl - tiles);
            if (j == g.num_experts - 1) sh_tile_start[g.num_experts] = static_cast<i32>(tile_carry + tile_incl);
        }
        row_carry += total;
        col_carry += col_total;
        tile_carry += tile_total;
    }
    __syncthreads();
}

// Blocks of PCT_THREADS that must fit on one SM (__launch_bounds__), i.e. a register cap of
// 65536 / (256 * n), rounded down to a multiple of 8:
//   4 (<= 64 registers) by default: 4 x 256 threads, the occupancy the bandwidth target assumes;
//   6 (<= 40) for the amax-only pass without column sums, which converts and stores nothing: it
//     fits in 36-40 registers on sm_80..sm_100 without spilling, so more of its loads are in flight;
//     5 (<= 48) for float32 input, which spilled 16 bytes at 40 on sm_90 once the kernel's body
//     became a loop over its tiles (TPB);
//   the gather (GATHER: a row index and a range check per segment) one step lower: 5 (<= 48)
//     for the amax-only pass without column sums, 3 (<= 80) for float32 with column sums (2,
//     <= 128, for its CAST_AMAX, which spilled 24 bytes at 80 on sm_89) and for float32 CAST
//     (44 bytes at 64 on sm_89 once an empty expert's full-tile loads read kNoRow's index), else
//     4 (at 40, resp. 64, the float32 variants spilled 8 bytes on sm_80..sm_90; NVRTC 13.0);
//   3 (<= 80) for float32 CAST_AMAX with column sums on sm_80 and sm_100 only: with a full
//     tile's 8 loads in flight it spills at 64 there (4 and 8 bytes); sm_89 and sm_90 fit in 64.
// Stated, not left to ptxas: without a minimum, ptxas picks a register target by itself and chose
// 48 registers plus a 4-byte spill for float16 CAST_AMAX on sm_90 (compile-check, NVRTC 13.0).
// Two tiles per block (TPB = 2, 16-bit input without column sums, gather or activation: the
// instantiations that have it): 5 (<= 48) for the amax-only pass, which spilled 20 bytes at 40
// on sm_90, else 4 (NVRTC 13.0).
// The gated activation (ACT) holds both halves' words of a full tile: 3 blocks (<= 80
// registers) for 16-bit input, 2 (<= 128) for float32, which spilled 4 bytes at 80 on sm_89 and
// sm_90 (NVRTC 13.0).
constexpr int pct_act_min_blocks(InDtype in) { return in == InDtype::F32 ? 2 : 3; }
// Half tiles (HALF: a tile's geometry and two more strides live across its loads): the plain
// kernel's 4 (<= 64) for the casts, but 3 (<= 80) for float32 CAST (44 bytes spilled at 64 on
// sm_90; NVRTC 13.0); one step below the plain kernel's for the amax-only pass, 5 (<= 48) for
// 16-bit input, 4 (<= 64) for float32.
constexpr int pct_half_min_blocks(InDtype in, PctMode mode) {
    return mode == PctMode::AMAX_ONLY ? (in == InDtype::F32 ? 4 : 5)
         : in == InDtype::F32 && mode == PctMode::CAST ? 3 : 4;
}

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 890 || __CUDA_ARCH__ >= 1000)
constexpr bool kPctF32ColsumNeedsMore = true;
#else
constexpr bool kPctF32ColsumNeedsMore = false;
#endif
constexpr int pct_min_blocks(InDtype in, PctMode mode, bool colsum, bool gather = false,
                             Act act = Act::NONE, int tpb = 1, bool half = false) {
    return half ? pct_half_min_blocks(in, mode)
         : act != Act::NONE ? pct_act_min_blocks(in)
         : tpb > 1 ? (mode == PctMode::AMAX_ONLY ? 5 : 4)   // (16-bit input, no column sums)
         : gather ? (mode == PctMode::AMAX_ONLY && !colsum ? 5
                     : in == InDtype::F32 && colsum ? (mode == PctMode::CAST_AMAX ? 2 : 3)
                     : in == InDtype::F32 && mode == PctMode::CAST ? 3 : 4)
         : mode == PctMode::AMAX_ONLY && !colsum ? (in == InDtype::F32 ? 5 : 6)
         : kPctF32ColsumNeedsMore && in == InDtype::F32 && mode == PctMode::CAST_AMAX && colsum ? 3
         : 4;
}

// COLSUM (compile time, so that the kernels without column sums carry no csum registers): also
// write colsum; only in the passes that compute amax (the host launches COLSUM = true only there).
template <InDtype IN, Fp8Format FMT, PctMode MODE, bool COLSUM = false, bool GATHER = false,
          Act ACT = Act::NONE, int TPB = 1, bool HALF = false>
__global__ void __launch_bounds__(PCT_THREADS, pct_min_blocks(IN, MODE, COLSUM, GATHER, ACT, TPB, HALF))
pad_cast_transpose_kernel(const PctGroup g, const i64 k, const i32 align, const i32 margin,
                          const float amax_epsilon,  // AMAX_ONLY: compute_scale's options
                          const i32 power_2_scale,
                          float* __restrict__ scale,       // read (CAST, CAST_AMAX) or written (AMAX_ONLY)
                          float* __restrict__ amax,        // written (AMAX_ONLY, CAST_AMAX)
                          float* __restrict__ scale_inv,   // written (AMAX_ONLY, CAST_AMAX)
                          int* __restrict__ workspace,     // 2 * CG_PCT_MAX_EXPERTS ints, zero on entry
                          float* __restrict__ colsum,      // (experts, k) column sums (COLSUM), or null
                          float* __restrict__ colsum_partial,  // one 128-float row per tile
                          int* __restrict__ colsum_count,  // experts * tiles_k ints, zero on entry
                          const i32 amax_accumulate)       // CAST_AMAX: merge into amax[e] (nonzero)
{
    using Traits = InTraits<IN>;
    constexpr bool kCast = MODE != PctMode::AMAX_ONLY;
    constexpr bool kAmax = MODE != PctMode::CAST;
    constexpr bool kGated = ACT != Act::NONE;
    static_assert(!COLSUM || kAmax, "column sums are taken in the pass that computes amax");
    static_assert(!kGated || (!COLSUM && !GATHER), "the activation has no column sums or gather");
    static_assert(TPB == 1 || (TPB == 2 && IN != InDtype::F32 && !COLSUM && !GATHER && !kGated),
                  "two tiles per block: 16-bit input without column sums, gather or activation "
                  "(the launch bounds of pct_min_blocks are set for those)");
    static_assert(!HALF || (!COLSUM && !GATHER && !kGated && TPB == 1),
                  "half tiles: one tile per block, without column sums (ordered by 64-row tiles), "
                  "gather or activation (the launch bounds of pct_min_blocks are set for those)");
    __shared__ __align__(16) u8 tile[PCT_TILE_M][PCT_TILE_K];   // columns placed by tile_col
    __shared__ float warp_amax[PCT_THREADS / 32];
    __shared__ float warp_colsum[PCT_THREADS / 32][PCT_TILE_K];   // indexed by seg_col
    __shared__ int last_block;
    __shared__ i64 sh_m[CG_PCT_MAX_EXPERTS], sh_row[CG_PCT_MAX_EXPERTS], sh_col[CG_PCT_MAX_EXPERTS];
    __shared__ i32 sh_tile_start[CG_PCT_MAX_EXPERTS + 1];
    __shared__ i64 warp_totals[PCT_THREADS / 32];

    // The tiles: a block takes TPB consecutive ones of the flat list (the host launches
    // ceil(tiles / TPB) blocks), so that a block's fixed costs -- the amax reduction and the
    // atomics and fences of the last-block pattern, the block's start and end -- are paid once
    // per expert per block, not per tile. No output depends on TPB: the amax is a maximum, the
    // column sums go per tile.
    // The amax pass of current scaling walks the tiles backwards, so that the tiles the cast
    // pass reads first are the ones it read last, still in L2. (No output depends on the order.)
    const bool host_splits = g.m_dev == nullptr;
    if (!host_splits)
        block_plan_from_device_counts(g, k, align, HALF, sh_m, sh_row, sh_col, sh_tile_start,
                                      warp_totals);
    // Carried from tile to tile: only the amax of the expert's tiles so far and their count
    // (the expert and its fields are found again for each tile, from the parameters or shared
    // memory, so that they take no registers across the loop).
    float local_amax = 0.f;
    int pending = 0;
#pragma unroll
    for (int step = 0; step < TPB; ++step) {
        // (block-uniform; with device splits the grid is an upper bound: surplus tiles exit)
        const i64 seq = static_cast<i64>(blockIdx.x) * TPB + step;
        int t;
        if (TPB == 1) {   // (the grid is the tile list, or with device splits covers it)
            t = MODE == PctMode::AMAX_ONLY ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
            if (!host_splits && t >= sh_tile_start[g.num_experts]) break;
        } else {
            const i64 total_tiles = host_splits ? g.tile_start[g.num_experts]
                                                : sh_tile_start[g.num_experts];
            if (seq >= total_tiles) break;
            t = static_cast<int>(MODE == PctMode::AMAX_ONLY ? total_tiles - 1 - seq : seq);
        }
        PctExpert x;
        int e;
        if (host_splits) {
            e = expert_of_tile(g.tile_start, g.num_experts, t);
            x = PctExpert{g.in[e], g.out_row[e], g.out_col[e], g.m[e], g.ld[e], g.tile_start[e],
                          g.tile_start[e + 1],
                          GATHER ? g.row_index + g.row_first[e] : nullptr, g.src_rows};
        } else {
            e = expert_of_tile(sh_tile_start, g.num_experts, t);
            const i64 in_bytes = IN == InDtype::F32 ? 4 : 2;
            x = PctExpert{static_cast<const char*>(g.in[0]) +
                              (GATHER ? 0 : sh_row[e] * g.ld[0] * in_bytes),
                          g.out_row[0] ? g.out_row[0] + sh_row[e] * k : nullptr,
                          g.out_col[0] ? g.out_col[0] + sh_col[e] : nullptr,
                          sh_m[e], g.ld[0], sh_tile_start[e], sh_tile_start[e + 1],
                          GATHER ? g.row_index + sh_row[e] : nullptr, g.src_rows};
        }
        const i64 m = x.m;
        if (GATHER && m == 0) x.idx = kNoRow;   // (the full-tile loads read its one index)
        const i64 m_pad = round_up(m, align);
        const i64 tiles_k = (k + PCT_TILE_K - 1) / PCT_TILE_K;
        const i64 local = t - x.tile_begin;
        const PctRows rows = tile_rows(m_pad, HALF);
        const i64 full_tiles = rows.full * tiles_k;
        const bool half = HALF && local >= full_tiles;
        const i64 row0 = (half ? rows.full : local / tiles_k) * PCT_TILE_M;
        const i64 col0 = half ? (local - full_tiles) * 2 * PCT_TILE_K : (local % tiles_k) * PCT_TILE_K;
        // A thread's segment of iteration `it` is in tile row r = threadIdx.x / 8 + 32 it, at
        // row0 + threadIdx.x / 8 + it * row_step, column col0 + c + it * col_step: the tile's rows
        // in a full tile, the two 128-column halves' rows 0..31 in a half one.
        const int row_step = half ? 0 : PCT_TILE_M / 2;
        const int col_step = half ? PCT_TILE_K : 0;
        const float s = kCast ? ftz(scale[e]) : 1.f;   // a denormal scale is 0 on the GPU (-ftz=true)
        const bool rowwise = x.out_row != nullptr;
        const bool columnwise = x.out_col != nullptr;

        // Phase 1: each thread reads 16 consecutive elements of one row per iteration, writes their 16
        // FP8 bytes to the row-wise output and to the shared tile. Rows m .. of the tile are the zero
        // padding.
        //
        // A full tile (inside k, every row 16-byte aligned: block-uniform) issues all of a thread's
        // 16-byte loads (PCT_SEG_ITERS segments) before it converts or stores anything, so that 32 B
        // (16-bit input) or 64 B (float32) per segment are in flight at once: the compiler cannot
        // move a later iteration's load above an earlier iteration's row-wise store (they may alias as
        // far as it knows). Its rows past m (an expert's last tile: most of a small expert's tiles)
        // unpack zero words, the +0 the other path gives them. Tiles that end inside k load segment
        // by segment with bounds checks. Both paths then run the same conversion code, so the bits
        // cannot differ.
        float csum[PCT_SEG];
        // (The gated activation's second half starts k columns to the right: aligned too.)
        const bool full_tile = col0 + (half ? 2 : 1) * PCT_TILE_K <= k && aligned16(x.in) &&
                               (x.ld * Traits::bytes) % 16 == 0 &&
                               (!kGated || (k * Traits::bytes) % 16 == 0);
        uint4 raw[PCT_SEG_ITERS][Traits::words];
        uint4 raw_b[kGated ? PCT_SEG_ITERS : 1][Traits::words];
        if (full_tile) {
    #pragma unroll
            for (int it = 0; it < PCT_SEG_ITERS; ++it) {
                const i64 grow = row0 + threadIdx.x / PCT_SEGS_PER_ROW + it * row_step;
                const i64 gcol = col0 + (threadIdx.x % PCT_SEGS_PER_ROW) * PCT_SEG + it * col_step;
                // a row past m reads row m - 1 again (the bytes come from L1/L2), so that no load
                // depends on a branch, and is zeroed below; an empty expert has no row to read (a
                // tensor of no rows may have a null pointer, the gather's index array no entry):
                // it reads kZeroSegment, through a select or (gather) kNoRow's index
                if constexpr (GATHER) {
                    const i64 lrow = grow < m ? grow : (m > 0 ? m - 1 : 0);
                    Traits::load_raw(segment_src<Traits::bytes, true>(x, lrow, gcol), raw[it]);
                } else {
                    const i64 lrow = grow < m ? grow : m - 1;
                    const bool rows = m > 0;
                    Traits::load_raw(rows ? segment_src<Traits::bytes, false>(x, lrow, gcol)
                                          : static_cast<const void*>(kZeroSegment), raw[it]);
                    if constexpr (kGated)
                        Traits::load_raw(rows ? segment_src<Traits::bytes, false>(x, lrow, gcol + k)
                                              : static_cast<const void*>(kZeroSegment), raw_b[it]);
                }
            }
    #pragma unroll
            for (int it = 0; it < PCT_SEG_ITERS; ++it) {
                if (row0 + threadIdx.x / PCT_SEGS_PER_ROW + it * row_step >= m) {
    #pragma unroll
                    for (int w = 0; w < Traits::words; ++w) {
                        raw[it][w] = make_uint4(0u, 0u, 0u, 0u);
                        if constexpr (kGated) raw_b[it][w] = make_uint4(0u, 0u, 0u, 0u);
                    }
                }
            }
        }
    #pragma unroll
        for (int it = 0; it < PCT_SEG_ITERS; ++it) {
            const int seg = threadIdx.x + it * PCT_THREADS;
            const int r = seg / PCT_SEGS_PER_ROW;
            const int c = (seg % PCT_SEGS_PER_ROW) * PCT_SEG;
            const i64 grow = row0 + threadIdx.x / PCT_SEGS_PER_ROW + it * row_step;
            const i64 gcol = col0 + c + it * col_step;
            float v[PCT_SEG];
            float vb[kGated ? PCT_SEG : 1];
            if (full_tile) {
                Traits::unpack(raw[it], v);
                if constexpr (kGated) Traits::unpack(raw_b[it], vb);
            } else if (grow < m && gcol < k) {
                // (a gathered zero row reads kZeroSegment: 64 bytes of zeros, 16-byte aligned)
                const void* src = segment_src<Traits::bytes, GATHER>(x, grow, gcol);
                if (gcol + PCT_SEG <= k && aligned16(src)) {
                    uint4 w[Traits::words];
                    Traits::load_raw(src, w);
                    Traits::unpack(w, v);
                } else {
    #pragma unroll
                    for (int j = 0; j < PCT_SEG; ++j)
                        v[j] = gcol + j < k ? Traits::load(src, j) : 0.f;
                }
                if constexpr (kGated) {   // (segment.cuh's per-segment load: n valid elements)
                    uint4 w[Traits::words];
                    load_segment<IN>(segment_src<Traits::bytes, false>(x, grow, gcol + k), k - gcol, w);
                    Traits::unpack(w, vb);
                }
            } else {
    #pragma unroll
                for (int j = 0; j < PCT_SEG; ++j) v[j] = 0.f;
                if constexpr (kGated) {
    #pragma unroll
                    for (int j = 0; j < PCT_SEG; ++j) vb[j] = 0.f;
                }
            }
            if constexpr (kGated) {   // the activation of a padding element (a = b = 0) is 0
    #pragma unroll
                for (int j = 0; j < PCT_SEG; ++j) v[j] = activate<ACT>(v[j], vb[j]);
            } else {
    #pragma unroll
                for (int j = 0; j < PCT_SEG; ++j) v[j] = ftz(v[j]);
            }
            if (kAmax) {
    #pragma unroll
                for (int j = 0; j < PCT_SEG; ++j) local_amax = fmaxf(local_amax, fabsf(v[j]));
            }
            if (COLSUM) {   // rows r and r + 32 of the tile: csum = v(row r) + v(row r + 32)
    #pragma unroll
                for (int j = 0; j < PCT_SEG; ++j) csum[j] = it == 0 ? v[j] : ftz(csum[j] + v[j]);
            }
            if (kCast) {
                // the padding rows (v = +0) are zero bytes whatever the scale: a NaN or infinite one
                // would make them NaN, a negative one -0 (0x80), so they are scaled by +0 instead
                const float sr = grow < m ? s : 0.f;
                u32 packed[4];
    #pragma unroll
                for (int w = 0; w < 4; ++w) {
                    const u32 lo = float2_to_fp8x2<FMT>(ftz(v[4 * w] * sr), ftz(v[4 * w + 1] * sr));
                    const u32 hi = float2_to_fp8x2<FMT>(ftz(v[4 * w + 2] * sr), ftz(v[4 * w + 3] * sr));
                    packed[w] = lo | (hi << 16);
                }
                const uint4 q = make_uint4(packed[0], packed[1], packed[2], packed[3]);
                *reinterpret_cast<uint4*>(&tile[r][tile_col(r, c)]) = q;
                if (rowwise && grow < m && gcol < k) store16(x.out_row + grow * k + gcol, k - gcol, q);
            }
        }

        // Phase 2: the transposed bytes, two lanes per 32-row run of a column
        // (store_transposed_tile).
        if (kCast) {
            __syncthreads();
            if (columnwise)
                store_transposed_tile<PCT_TILE_M, PCT_THREADS>(tile, x.out_col, k, m_pad, row0, col0,
                                                               half);
        }

        // Column sums, in a fixed order that the reference reproduces: per thread rows r + (r + 32);
        // across the 4 row groups of a warp by xor-shuffles over lane bits 3 then 4, i.e.
        // (g0 + g1) + (g2 + g3); across the 8 warps sequentially; across the tile rows of the expert
        // sequentially, by the last block of each (expert, tile column), from one partial row per tile.
        if (COLSUM) {
            const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    #pragma unroll
            for (int j = 0; j < PCT_SEG; ++j) {
                csum[j] = ftz(csum[j] + __shfl_xor_sync(0xffffffffu, csum[j], 8));
                csum[j] = ftz(csum[j] + __shfl_xor_sync(0xffffffffu, csum[j], 16));
            }
            if (lane < PCT_SEGS_PER_ROW) {
    #pragma unroll
                for (int j = 0; j < PCT_SEG; ++j) warp_colsum[warp][seg_col(lane * PCT_SEG + j)] = csum[j];
            }
            __syncthreads();
            const int c = threadIdx.x;
            if (c < PCT_TILE_K) {
                float acc = warp_colsum[0][seg_col(c)];
                for (int w = 1; w < PCT_THREADS / 32; ++w) acc = ftz(acc + warp_colsum[w][seg_col(c)]);
                colsum_partial[static_cast<i64>(t) * PCT_TILE_K + c] = acc;
                __threadfence();
            }
            __syncthreads();
            const i64 tile_col = local % tiles_k;
            int* counter = colsum_count + static_cast<i64>(e) * tiles_k + tile_col;
            const i64 tiles_m = (x.tile_end - x.tile_begin) / tiles_k;
            if (threadIdx.x == 0) last_block = atomicAdd(counter, 1) == tiles_m - 1;
            __syncthreads();
            if (last_block) {
                __threadfence();
                if (c < PCT_TILE_K && col0 + c < k) {
                    const volatile float* part = colsum_partial;
                    const i64 first = static_cast<i64>(x.tile_begin) + tile_col;
                    float acc = part[first * PCT_TILE_K + c];
                    for (i64 tr = 1; tr < tiles_m; ++tr)
                        acc = ftz(acc + part[(first + tr * tiles_k) * PCT_TILE_K + c]);
                    colsum[static_cast<i64>(e) * k + col0 + c] = acc;
                }
                if (threadIdx.x == 0) atomicExch(counter, 0);
            }
        }

        // Amax: block reduction, then the last block of the expert publishes it (and the scales),
        // once the block is done with the expert's tiles it was given.
        ++pending;
        // (the last tile of all is its expert's last too: the list ends with an expert's tiles)
        const bool expert_done = TPB == 1 || step + 1 == TPB ||
                                 (MODE == PctMode::AMAX_ONLY ? t == x.tile_begin : t + 1 == x.tile_end);
        if (kAmax && expert_done) {
            local_amax = warp_max(local_amax);
            if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = local_amax;
            __syncthreads();
            if (threadIdx.x == 0) {
                float block_amax = 0.f;
                for (int w = 0; w < PCT_THREADS / 32; ++w) block_amax = fmaxf(block_amax, warp_amax[w]);
                int* ws_amax = workspace;
                int* ws_count = workspace + CG_PCT_MAX_EXPERTS;
                // Non-negative floats order like their bit patterns as signed ints.
                atomicMax(ws_amax + e, __float_as_int(block_amax));
                __threadfence();
                const int tiles_e = x.tile_end - x.tile_begin;
                if (atomicAdd(ws_count + e, pending) + pending == tiles_e) {
                    __threadfence();
                    const float a = __int_as_float(atomicExch(ws_amax + e, 0));
                    atomicExch(ws_count + e, 0);
                    if (MODE == PctMode::CAST_AMAX && amax_accumulate) {
                        // Merge into the pending amax (delayed scaling: forwards that run ahead of
                        // their backwards): the larger of the two, with the old value flushed for
                        // the comparison (the GPU's FTZ) and the new one winning ties, so a NaN
                        // already in the buffer is replaced (as fmaxf drops NaN), a denormal or -0
                        // old value gives `a`, and every backend writes the same bits.
                        const float old = amax[e];
                        amax[e] = ftz(old) > a ? old : a;
                    } else {
                        amax[e] = a;
                    }
                    if (MODE == PctMode::AMAX_ONLY) {
                        const float sc = compute_scale<FMT>(a, margin, amax_epsilon, power_2_scale != 0);
                        scale[e] = sc;
                        scale_inv[e] = scale_inverse(sc);
                    } else {
                        scale_inv[e] = scale_inverse(s);
                    }
                }
            }
            local_amax = 0.f;
            pending = 0;
        }
        if (TPB > 1) __syncthreads();   // the shared buffers are the next tile's
    }
}

}  // namespace cg
