"""multi_mxfp8_cast_transpose (TransformerEngine's MXFP8BlockScaling): the reference against a
per-block computation and the cuBLASLt scale layout written out here, the CUDA kernel on the CPU
emulator bit for bit against the reference (split taxonomy x dtypes x formats x input forms,
column sums, the gather, chunks), E8M0 edge cases, bad input, and the GPU twin (``gpu``)."""

from __future__ import annotations

import itertools
import math
import zlib

import numpy as np
import pytest

import cugrouped
from cugrouped import reference
from cugrouped.grouped_block_fp8 import MX_DIMS, mx_swizzle, mx_unswizzle
from cugrouped.reference import fp8 as rfp8
from test_pad_cast_transpose import DTYPES, ORDERS

pytest.register_assert_rewrite("_block_common")
from _block_common import (BLOCK_SPLITS, FP8, MXFP8_CAST, assert_same_bits,  # noqa: E402
                           check_bad_out_buffer_is_rejected, check_cuda_gather,
                           check_cuda_matches_reference, check_emulated_kernel, check_gather,
                           check_one_sided_copy, check_over_several_chunks,
                           check_torch_tensors_in_and_out)

case_data = MXFP8_CAST.case_data


def te_scale_index(r: int, c: int, cols_padded: int) -> int:
    """TransformerEngine's gemm_swizzled_scale_idx / cuBLAS's 1D block scaling factors layout:
    128 x 4 tiles of 512 bytes, row-major over the tiles, (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
    inside one."""
    return ((r // 128) * (cols_padded // 4) + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4


def mx_by_hand(z, fmt):
    """MXFP8 of z (R, C) written out block by block in float64 arithmetic, independent of
    cugrouped: per 32 elements of a row the smallest power of two 2^p with amax / 2^p <= fp8_max,
    the byte p + 127 at te_scale_index, the elements x / 2^p rounded to FP8 (ml_dtypes after
    clamping). For finite inputs away from the exact power-of-two boundaries."""
    dt, fmax = FP8[fmt]
    R, C = z.shape
    nb = -(-C // 32)
    cols = -(-nb // 4) * 4
    scales = np.zeros(-(-R // 128) * 128 * cols, np.uint8)
    q = np.zeros((R, C), np.uint8)
    for r in range(R):
        for b in range(nb):
            blk = z[r, 32 * b: 32 * b + 32].astype(np.float64)
            amax = float(np.max(np.abs(blk)))
            p = -127 if amax == 0 else max(-127, math.ceil(math.log2(amax / fmax)))
            scales[te_scale_index(r, b, cols)] = p + 127
            y = np.clip(blk / 2.0**p, -fmax, fmax).astype(np.float32)
            q[r, 32 * b: 32 * b + 32] = y.astype(dt).view(np.uint8)
    return q, scales


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_reference_is_the_mx_quantization_written_out(fmt):
    rng = np.random.default_rng(zlib.crc32(fmt.encode()))
    m_splits, k = [37, 0, 150], 72
    x = (rng.standard_normal((sum(m_splits), k)) *
         np.exp2(rng.integers(-20, 20, (sum(m_splits), 1)))).astype(np.float32)
    got = reference.multi_mxfp8_cast_transpose(x, m_splits, fp8_format=fmt, align=32)
    assert got.scale_inv.dtype == np.uint8 and isinstance(got, cugrouped.GroupedMXFP8)
    for i, (o, m) in enumerate(zip((0, 37, 37), m_splits)):
        q, s = mx_by_hand(x[o:o + m], fmt)
        assert np.array_equal(np.asarray(got.rowwise(i)).view(np.uint8), q)
        lo = sum(-(-mm // 128) * -(-k // 128) * 512 for mm in m_splits[:i])
        assert np.array_equal(got.scale_inv[lo: lo + s.size], s)
        m_pad = -(-m // 32) * 32
        xt = np.zeros((k, m_pad), np.float32)
        xt[:, :m] = x[o:o + m].T
        qt, st = mx_by_hand(xt, fmt)
        assert np.array_equal(np.asarray(got.columnwise(i)), qt)
        assert np.array_equal(got.scale_inv_t[lo: lo + st.size], st)


def test_swizzle_round_trips_and_matches_the_layout_formula():
    rng = np.random.default_rng(1)
    compact = rng.integers(0, 255, (256, 8)).astype(np.uint8)
    flat = mx_swizzle(compact)
    for r, c in itertools.product(range(256), range(8)):
        assert flat[te_scale_index(r, c, 8)] == compact[r, c]
    assert np.array_equal(mx_unswizzle(flat, 256, 8), compact)
    torch = pytest.importorskip("torch")
    assert np.array_equal(mx_swizzle(torch.from_numpy(compact)).numpy(), flat)


def test_scale_bytes_at_the_e8m0_edges():
    """One non-zero element per 32-block, its magnitude at the edges of the E8M0 rounding: exact
    powers of two times fp8_max, one ulp either side, the range where amax / fp8_max is a float32
    denormal (FTZ would flush it), the smallest normal, the largest float, inf. The kernel's bytes
    are the reference's, and every finite block's byte is the smallest that does not saturate
    its maximum (up to the rounding of amax * (1 / fp8_max))."""
    for fmt, (dt, fmax) in FP8.items():
        vals = []
        for p in (-140, -130, -127, -126.5, -126, -125, -100, -64, -63.5, -1, 0, 1, 50, 118):
            base = np.float32(fmax * 2.0**p) if fmax * 2.0**p < 3.4e38 else np.float32(3.4e38)
            vals += [base, np.nextafter(base, np.float32(0)), np.nextafter(base, np.float32(np.inf))]
        vals += [np.float32(3.4028235e38), np.float32(2.0**-126), np.float32(np.inf), np.float32(0)]
        x = np.zeros((len(vals), 64), np.float32)
        x[:, 5] = vals
        x[:, 40] = -np.float32(1.5)                       # the second block: a plain value
        got = cugrouped.multi_mxfp8_cast_transpose(x, [len(vals)], fp8_format=fmt, backend="emulate")
        want = reference.multi_mxfp8_cast_transpose(x, [len(vals)], fp8_format=fmt)
        assert_same_bits(got, want, fmt)
        e = got.rowwise_scale_inv(0)[: len(vals), 0].astype(int)
        a = rfp8.ftz(np.array(vals, np.float32)).astype(np.float64)   # the kernel's amax
        slack = 1 + 2.0**-22                              # the product's float32 rounding
        for ai, ei, xi in zip(a, e, vals):
            if np.isinf(ai):
                assert ei == 254
            elif ai == 0:
                assert ei == 0
            else:
                assert ai * 2.0 ** (127 - ei) <= fmax * slack, (fmt, xi, ei)          # fits
                assert ei == 0 or ai * 2.0 ** (128 - ei) > fmax / slack, (fmt, xi, ei)  # smallest
        assert np.all(got.rowwise_scale_inv(0)[: len(vals), 1] == rfp8.mx_scale_byte(np.float32(1.5), fmt))
        # and the bytes: no finite block saturates beyond its own rounding (decoded in float64:
        # FLT_MAX's block rounds up to 2^128, past float32)
        q = np.asarray(got.rowwise(0))[:, 5].view(np.uint8).view(dt).astype(np.float64)
        d = q * 2.0 ** (e - 127.0)
        fin = np.isfinite(a) & (a > 0)
        assert np.all(np.abs(d[fin] - a[fin]) <= 2.0**-3 * a[fin]), fmt


# ------------------------------------------------------------------------------------------------
# The CUDA kernel on the CPU emulator, bit for bit.

ALIGNS = (32, 1, 16, 128)
# split case x dtype x input form; the format, align and fiber order rotate
CASES = [
    (split, dtype, ("e4m3", "e5m2")[i % 2], ALIGNS[(i // 3) % 4], form, ORDERS[i % len(ORDERS)])
    for i, (split, dtype, form) in enumerate(itertools.product(
        BLOCK_SPLITS, DTYPES, ("list", "tensor", "device")))
]


@pytest.mark.parametrize("split,dtype,fmt,align,form,order", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_emulated_kernel_matches_reference(split, dtype, fmt, align, form, order):
    check_emulated_kernel(MXFP8_CAST, split, dtype, form, order,
                          f"{split}/{dtype}/{fmt}/align={align}/{form}",
                          fp8_format=fmt, align=align, column_sums=form != "list")


@pytest.mark.parametrize("which", ["rowwise", "columnwise"])
def test_one_sided_copies(which):
    m_splits, xs = case_data("edges", "bfloat16")
    check_one_sided_copy(MXFP8_CAST, xs, m_splits, which, which)


def test_more_experts_than_one_launch_and_device_counts_over_several_chunks():
    check_over_several_chunks(MXFP8_CAST, (5, 6), 72, kernel_has=", 3, false, true>",
                              column_sums=True)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("form", ["host", "device"])
def test_gather_equals_permute_then_cast(dtype, form):
    check_gather(MXFP8_CAST, ("mx", dtype, form), dtype, form, f"gather {dtype} {form}")


def test_out_buffers_are_written_in_place_and_dequantize():
    m_splits, xs = case_data("skewed", "float32")
    x = np.concatenate(xs)
    out = cugrouped.multi_mxfp8_cast_transpose(np.zeros_like(x), m_splits, backend="emulate")
    res = cugrouped.multi_mxfp8_cast_transpose(x, m_splits, out=out, backend="emulate")
    assert res.scale_inv is out.scale_inv and res.data_t is out.data_t
    assert_same_bits(res, reference.multi_mxfp8_cast_transpose(x, m_splits), "out=")
    finite = np.isfinite(x).all(axis=1)
    for i, (d, dt) in enumerate(zip(res.dequantize(), res.dequantize(columnwise=True))):
        o = sum(m_splits[:i])
        xi, ok = x[o:o + m_splits[i]], finite[o:o + m_splits[i]]
        amax = np.abs(xi[ok]).max() if ok.any() else 0
        # e4m3 keeps 3 mantissa bits: within 2^-4 of each block's power-of-two range
        assert np.all(np.abs(d[ok] - xi[ok]) <= 2.0**-3 * np.maximum(np.abs(xi[ok]), 2.0**-9 * amax))
        assert np.all(np.abs(dt[ok] - xi[ok]) <= 2.0**-3 * np.maximum(np.abs(xi[ok]), 2.0**-9 * amax))


def test_torch_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    results = check_torch_tensors_in_and_out(MXFP8_CAST, torch.uint8)
    assert all(isinstance(got, cugrouped.GroupedMXFP8) for got in results)


def test_launch_count_and_sizes():
    with cugrouped.record_launches() as launches:
        r = cugrouped.multi_mxfp8_cast_transpose(np.ones((300, 200), np.float32), [0, 130, 170],
                                                 backend="emulate")
    assert len(launches) == 1 and launches[0].grid == 2 * 2 + 2 * 2
    assert r.scale_inv.shape == r.scale_inv_t.shape == (8 * 512,)
    assert r.data_t.shape == (200 * (160 + 192),) and r.m_pad_splits == (0, 160, 192)
    assert r.rowwise_scale_inv(1).shape == (256, 8) and r.columnwise_scale_inv(2).shape == (256, 8)


X = np.ones((10, 32), np.float32)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: cugrouped.multi_mxfp8_cast_transpose(X, [10], align=48), ValueError, "align"),
    (lambda: cugrouped.multi_mxfp8_cast_transpose(X, [10], fp8_format="e3m4"), ValueError,
     "fp8_format"),
    (lambda: cugrouped.multi_mxfp8_cast_transpose(X, [11]), ValueError, "m_splits"),
    (lambda: cugrouped.multi_block_cast_transpose(X, [10], block_scaling_dim=MX_DIMS), ValueError,
     "multi_mxfp8_cast_transpose"),
    (lambda: cugrouped.multi_mxfp8_cast_transpose(X, [10], row_index=np.arange(10), column_sums=True),
     ValueError, "column_sums"),
])
def test_bad_input_is_rejected_clearly(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("backend", ["emulate", "reference"])
def test_bad_out_buffer_is_rejected_before_anything_is_written(backend):
    check_bad_out_buffer_is_rejected(MXFP8_CAST, X, backend, "scale_inv",
                                     lambda s: np.zeros(s.size, np.float32))  # float32, not E8M0


# ------------------------------------------------------------------------------------------------
# The same matrix on a GPU (skipped here; run by scripts/gpu_check.sh).

GPU_CASES = [c for c in CASES if c[4] != "tensor"]


@pytest.mark.gpu
@pytest.mark.parametrize("split,dtype,fmt,align,form,order", GPU_CASES,
                         ids=["-".join(map(str, c)) for c in GPU_CASES])
def test_cuda_matches_reference(split, dtype, fmt, align, form, order):
    check_cuda_matches_reference(MXFP8_CAST, split, dtype, form, f"cuda {split}/{dtype}/{fmt}/{form}",
                                 fp8_format=fmt, align=align, column_sums=form == "device")


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["host", "device"])
def test_cuda_gather_matches_reference(form):
    check_cuda_gather(MXFP8_CAST, (33, 34), "float16", form, f"cuda gather {form}")
