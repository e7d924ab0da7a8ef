// cugrouped/kernels_cu/segment.cuh -- what the cast kernels share: the input element types, how a
// thread loads one segment of kSeg consecutive elements of a row (16-byte words, unconverted, then
// widened to float), and small helpers of the multi-expert tile grids.
#pragma once
#include "common.cuh"
#include "fp8.cuh"

namespace cg {

enum class InDtype : int { F32 = 0, F16 = 1, BF16 = 2 };

constexpr int kSeg = 16;   // elements per thread-segment: one 16-byte FP8 store

// Where column c (0..127) of a 128-column tile lives in a per-column float array in shared memory
// (column maxima, scales, column sums): each kSeg-column segment rotated by 2 * (c / 32) within
// itself. Two access patterns meet there: the 8 lanes that own segments (column kSeg s + j,
// s = 0..7, for each j) and 32 consecutive columns (a warp of per-column threads). Unrotated, the
// first puts lanes s, s + 2, s + 4, s + 6 in one bank (a 4-way conflict); rotated, both are
// conflict-free (cugrouped.emulate.access counts it; tests/test_emulate_access.py asserts it).
CG_DEVICE constexpr int seg_col(int c) { return (c & ~15) | ((c + ((c >> 5) << 1)) & 15); }

template <InDtype IN> struct InTraits;
// Per input type: `words` 16-byte words hold one segment of kSeg elements; load_raw reads them
// (from a 16-byte aligned address) without converting, unpack widens them to float (unpack_word:
// one word's 16 / bytes values).
template <> struct InTraits<InDtype::F32> {
    static constexpr int bytes = 4;
    static constexpr int words = kSeg * bytes / 16;   // 4
    CG_DEVICE static float load(const void* p, i64 i) { return static_cast<const float*>(p)[i]; }
    CG_DEVICE static void load_raw(const void* p, uint4 (&w)[words]) {
        const uint4* q = static_cast<const uint4*>(p);
#pragma unroll
        for (int j = 0; j < words; ++j) w[j] = q[j];
    }
    CG_DEVICE static void unpack_word(const uint4& w, float* v) {   // 4 values
        v[0] = bits_f32(w.x); v[1] = bits_f32(w.y); v[2] = bits_f32(w.z); v[3] = bits_f32(w.w);
    }
    CG_DEVICE static void unpack(const uint4 (&w)[words], float (&v)[kSeg]) {
#pragma unroll
        for (int j = 0; j < words; ++j) unpack_word(w[j], v + 4 * j);
    }
};
template <InDtype IN> struct Half16Traits {
    static constexpr int bytes = 2;
    static constexpr int words = kSeg * bytes / 16;   // 2
    CG_DEVICE static float cvt(u32 bits) {
        return IN == InDtype::BF16 ? bf16_to_float(static_cast<u16>(bits))
                                   : half_to_float(static_cast<u16>(bits));
    }
    CG_DEVICE static float load(const void* p, i64 i) { return cvt(static_cast<const u16*>(p)[i]); }
    CG_DEVICE static void load_raw(const void* p, uint4 (&w)[words]) {
        const uint4* q = static_cast<const uint4*>(p);
#pragma unroll
        for (int j = 0; j < words; ++j) w[j] = q[j];
    }
    CG_DEVICE static void unpack_word(const uint4& w, float* v) {   // 8 values
        const u32 h[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = cvt(h[i] & 0xffffu);
            v[2 * i + 1] = cvt(h[i] >> 16);
        }
    }
    CG_DEVICE static void unpack(const uint4 (&w)[words], float (&v)[kSeg]) {
#pragma unroll
        for (int j = 0; j < words; ++j) unpack_word(w[j], v + 8 * j);
    }
};
template <> struct InTraits<InDtype::F16> : Half16Traits<InDtype::F16> {};
template <> struct InTraits<InDtype::BF16> : Half16Traits<InDtype::BF16> {};

// A barrier for values derived from `w`: an empty asm that the compiler must assume rewrites every
// word, so a segment widened to float before it is widened again after it instead of being kept
// live as floats (a kernel that keeps a whole tile in registers across phases then holds the raw
// words, half the registers for 16-bit input). No instruction is emitted, the bits are untouched;
// the emulator and host builds skip it.
template <int N>
CG_DEVICE void opaque_words(uint4 (&w)[N]) {
#if defined(__CUDA_ARCH__)
#pragma unroll
    for (int j = 0; j < N; ++j)
        asm volatile("" : "+r"(w[j].x), "+r"(w[j].y), "+r"(w[j].z), "+r"(w[j].w));
#else
    (void)w;
#endif
}

CG_DEVICE bool aligned16(const void* p) { return (reinterpret_cast<u64>(p) & 15u) == 0; }

// One segment of a row in its raw 16-byte words, whatever the bounds: `n` valid elements (the
// rest read as zero bits), with one vector load when the segment is whole and aligned.
template <InDtype IN>
CG_DEVICE void load_segment(const void* src, i64 n, uint4 (&w)[InTraits<IN>::words]) {
    using Traits = InTraits<IN>;
    if (n >= kSeg && aligned16(src)) {
        Traits::load_raw(src, w);
        return;
    }
    u32 u[4 * Traits::words];
#pragma unroll
    for (int i = 0; i < 4 * Traits::words; ++i) u[i] = 0u;
#pragma unroll
    for (int i = 0; i < kSeg; ++i) {
        if (i < n) {
            if (Traits::bytes == 4) {
                u[i] = static_cast<const u32*>(src)[i];
            } else {
                u[i / 2] |= static_cast<u32>(static_cast<const u16*>(src)[i]) << (16 * (i % 2));
            }
        }
    }
#pragma unroll
    for (int j = 0; j < Traits::words; ++j) w[j] = make_uint4(u[4 * j], u[4 * j + 1], u[4 * j + 2], u[4 * j + 3]);
}

// 16 floats scaled and converted to FP8, packed as one 16-byte word (byte j = element j).
template <Fp8Format FMT>
CG_DEVICE uint4 cast16(const float (&v)[kSeg], const float (&s)[kSeg]) {
    u32 packed[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const u32 lo = float2_to_fp8x2<FMT>(ftz(v[4 * w] * s[4 * w]), ftz(v[4 * w + 1] * s[4 * w + 1]));
        const u32 hi = float2_to_fp8x2<FMT>(ftz(v[4 * w + 2] * s[4 * w + 2]), ftz(v[4 * w + 3] * s[4 * w + 3]));
        packed[w] = lo | (hi << 16);
    }
    return make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

CG_DEVICE void store16(u8* dst, i64 n, uint4 q) {
    if (n >= kSeg && aligned16(dst)) {
        *reinterpret_cast<uint4*>(dst) = q;
        return;
    }
    const u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < kSeg; ++j)   // unrolled: words[] stays in registers
        if (j < n) dst[j] = static_cast<u8>(words[j / 4] >> (8 * (j % 4)));
}

// What a gathered zero row reads: one segment (kSeg float32) of zeros.
__device__ __align__(16) const u8 kZeroSegment[kSeg * 4] = {};
// The row index of an empty expert's gather: one index outside every token matrix (a zero row).
__device__ const i64 kNoRow[1] = {-1};

// Where the segment at (row `grow`, column `gcol`) of expert `x`'s input starts (X: the kernel's
// per-expert view, with in, ld, idx, src_rows). GATHER (a separate instantiation, so that the
// kernels without it keep their registers and their full-tile loads in one basic block,
// tests/test_sass.py): row x.idx[grow] of the token matrix, or kZeroSegment for an index outside
// [0, src_rows) -- a select, no branch.
template <int BYTES, bool GATHER, class X>
CG_DEVICE const void* segment_src(const X& x, i64 grow, i64 gcol) {
    if (!GATHER) return static_cast<const char*>(x.in) + (grow * x.ld + gcol) * BYTES;
    const i64 r = x.idx[grow];
    const bool in_range = static_cast<u64>(r) < static_cast<u64>(x.src_rows);   // r < 0 too
    return in_range ? static_cast<const void*>(static_cast<const char*>(x.in) +
                                               (r * x.ld + gcol) * BYTES)
                    : static_cast<const void*>(kZeroSegment);
}

// Which expert of the chunk owns flat tile t (tile_start is non-decreasing, E <= 64: a short
// binary search, the same in every thread, so no divergence).
CG_DEVICE int expert_of_tile(const i32* tile_start, int num_experts, int t) {
    int lo = 0, hi = num_experts - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (tile_start[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

CG_DEVICE i64 round_up(i64 m, i64 align) { return (m + align - 1) / align * align; }

// ---- the transposed copy of a 128-column FP8 tile ------------------------------------------------
// Where byte (r, c) of the tile lives in its row: 16-byte chunk c / 16, exchanged with its
// neighbour (chunk ^ 1) in rows 16..31, 48..63, ... Rows keep whole 16-byte chunks (the row-wise
// pass stores them with 16-byte stores, a quarter-warp per row: conflict-free either way); the
// exchange puts the two lanes of store_transposed_tile that read rows 16 apart into different
// banks (unexchanged, 128-byte rows put them in the same ones: a 2-way conflict).
constexpr int kTileCols = 8 * kSeg;   // 128
CG_DEVICE constexpr int tile_col(int r, int c) { return (((c >> 4) ^ ((r >> 4) & 1)) << 4) | (c & 15); }

// Write the tile's columns to the (k, m_pad) transposed output (column c, rows r at
// out_col[(col0 + c) * m_pad + row0 + r]; the tile's rows past the expert's m read as zeros: the
// padding), in runs of 32 rows of one column: one 32-byte sector each when aligned. Two
// neighbouring lanes write a run, 16 rows each, in the same 16-byte store instruction, so that a
// warp's store fills 16 whole sectors (one lane per run would half-fill 32 sectors per
// instruction, and finish each with a second one). A run cut short by m_pad (16 rows when
// m_pad % 32 == 16) is one lane's store; any other length, or an unaligned run, bytes.
// `half` (a half tile of pad_cast_transpose.cu, ROWS 64): the tile's rows 32..63 are rows 0..31 of
// the next 128 columns, so its runs rr = 32 go to columns col0 + 128 + cc, rows row0 ...
template <int ROWS, int THREADS>
CG_DEVICE void store_transposed_tile(const u8 (&tile)[ROWS][kTileCols], u8* out_col, i64 k,
                                     i64 m_pad, i64 row0, i64 col0, bool half = false) {
    constexpr int kRun = 32;
    constexpr int kHalves = 2 * kTileCols * (ROWS / kRun) / THREADS;   // half-runs per thread
    static_assert(kHalves * THREADS == 2 * kTileCols * (ROWS / kRun), "whole half-runs per thread");
#pragma unroll
    for (int i = 0; i < kHalves; ++i) {
        const int half_run = threadIdx.x + i * THREADS;
        const int run = half_run >> 1, lo = 16 * (half_run & 1);
        const int cc = run % kTileCols;
        const int rr = (run / kTileCols) * kRun;
        const int part = half ? rr / kRun : 0;   // (half: ROWS == 2 * kRun)
        const i64 ocol = col0 + part * kTileCols + cc;
        const i64 orow = row0 + rr - part * kRun;
        if (ocol >= k || orow >= m_pad) continue;
        u8* dst = out_col + ocol * m_pad + orow;
        const i64 n = m_pad - orow < kRun ? m_pad - orow : kRun;
        if ((n == kRun || n == kRun / 2) && aligned16(dst)) {
            if (lo < n) {
                const int c = tile_col(rr + lo, cc);     // the same for the 16 rows
                u32 words[4];
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    const int r = rr + lo + 4 * w;
                    words[w] = u32(tile[r][c]) | (u32(tile[r + 1][c]) << 8) |
                               (u32(tile[r + 2][c]) << 16) | (u32(tile[r + 3][c]) << 24);
                }
                *reinterpret_cast<uint4*>(dst + lo) = make_uint4(words[0], words[1], words[2], words[3]);
            }
        } else {
            for (int j = lo; j < lo + 16 && j < n; ++j) dst[j] = tile[rr + j][tile_col(rr + j, cc)];
        }
    }
}

CG_DEVICE float warp_max(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

}  // namespace cg
