"""multi_block_cast_transpose (TransformerEngine's Float8BlockScaling): the reference against a
direct per-block computation written here, the CUDA kernel on the CPU emulator bit for bit
against the reference over the split taxonomy x dtypes x formats x block shapes x input forms,
planning, launch counts, the argument block's layout, bad input, and the GPU twin (``gpu``)."""

from __future__ import annotations

import dataclasses
import itertools
import zlib

import ml_dtypes
import numpy as np
import pytest

import cugrouped
from cugrouped import reference
from cugrouped.ops import block_cast_transpose as bct
from test_pad_cast_transpose import (DTYPES, ORDERS, assert_gpu_nan_column_sums, make_inputs,
                                     nan_case, rows_far_apart)

pytest.register_assert_rewrite("_block_common")
from _block_common import (BLOCK_CAST, BLOCK_SPLITS, FP8, assert_same_bits,  # noqa: E402
                           check_bad_out_buffer_is_rejected, check_cuda_gather,
                           check_cuda_matches_reference, check_emulated_kernel, check_gather,
                           check_one_sided_copy, check_over_several_chunks,
                           check_torch_tensors_in_and_out, permuted)

run_both, case_data = BLOCK_CAST.run_both, BLOCK_CAST.case_data


def blocks_by_hand(x, m_pad, fmt, dims, eps=0.0, p2=True):
    """TransformerEngine's block quantization written out block by block, independent of
    cugrouped.reference: returns (row-wise bytes (m, k), their scale_inv as (m, k) per element,
    transposed bytes (k, m_pad), their scale_inv per element). For normal, finite inputs."""
    dt, fmax = FP8[fmt]
    m, k = x.shape
    xp = np.zeros((m_pad, k), np.float32)
    xp[:m] = x

    def scale_of(block):
        amax = np.float32(np.abs(block).max()) if block.size else np.float32(0)
        amax = max(amax, np.float32(eps))
        if amax == 0:
            return np.float32(1)
        s = np.float32(np.float32(fmax) / amax)
        if p2:
            s = np.float32(2.0 ** (np.frexp(s)[1] - 1))
        return s

    def cast(v, s):
        return np.clip(v * s, -fmax, fmax).astype(dt).view(np.uint8)

    q, s_el = np.zeros((m, k), np.uint8), np.zeros((m, k), np.float32)
    qt, st_el = np.zeros((m_pad, k), np.uint8), np.zeros((m_pad, k), np.float32)
    step_r = 1 if dims == 1 else 128
    for r in range(0, m, step_r):
        for c in range(0, k, 128):
            blk = x[r:r + step_r, c:c + 128]
            s = scale_of(blk)
            q[r:r + step_r, c:c + 128] = cast(blk, s)
            s_el[r:r + step_r, c:c + 128] = np.float32(1) / s
    step_c = 1 if dims == 1 else 128
    for c in range(0, k, step_c):
        for r in range(0, m_pad, 128):
            blk = xp[r:r + 128, c:c + step_c]
            s = scale_of(blk)
            qt[r:r + 128, c:c + step_c] = cast(blk, s)
            st_el[r:r + 128, c:c + step_c] = np.float32(1) / s
    return q, s_el, qt.T, st_el.T


def per_element(sinv2d, rows, cols, dims):
    """A block scale layout (cugrouped.grouped_block_fp8) spread to every element of (rows, cols)."""
    rr, cc = np.arange(rows)[:, None], np.arange(cols)[None, :]
    return sinv2d[cc // 128, rr] if dims == 1 else sinv2d[rr // 128, cc // 128]


@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("p2,eps", [(True, 0.0), (False, 0.0), (True, 1e-3)])
def test_reference_is_the_block_quantization_written_out(dims, fmt, p2, eps):
    rng = np.random.default_rng(zlib.crc32(repr((dims, fmt, p2, eps)).encode()))
    m_splits, k, align = [130, 0, 7, 260], 200, 16
    xs = [(rng.standard_normal((m, k)) * np.exp2(rng.uniform(-10, 10, (m, 1)))).astype(np.float32)
          for m in m_splits]
    xs[2][:] = 0                                       # an all-zero expert: scale 1 or from eps
    res = reference.multi_block_cast_transpose(xs, block_scaling_dim=dims, fp8_format=fmt,
                                               align=align, power_2_scale=p2, amax_epsilon=eps)
    for i, (x, mp) in enumerate(zip(xs, res.m_pad_splits)):
        q, s_el, qt, st_el = blocks_by_hand(x, mp, fmt, dims, eps, p2)
        m = x.shape[0]
        assert np.array_equal(np.asarray(res.rowwise(i)).view(np.uint8), q), i
        assert np.array_equal(res.columnwise(i), qt), i
        if m:
            assert np.array_equal(per_element(res.rowwise_scale_inv(i), m, k, dims), s_el), i
            assert np.array_equal(per_element(res.columnwise_scale_inv(i), k, mp, dims), st_el), i
        if p2:   # power-of-two scales: every scale_inv is an exact power of two
            for s in (res.rowwise_scale_inv(i), res.columnwise_scale_inv(i)):
                assert np.all(np.frexp(s)[0] == 0.5), i


def test_scale_layouts_are_transformer_engines():
    """Shapes from TransformerEngine's Float8BlockQuantizer::get_scale_shape (written out here):
    1-D row-wise (ceil(k/128), roundup(m, 4)), column-wise (ceil(m/128), roundup(k, 4)); 2-D
    row-wise (ceil(m/128), roundup(ceil(k/128), 4)), column-wise (ceil(k/128),
    roundup(ceil(m/128), 4)) -- with m the padded rows for the column-wise copy."""
    def r4(v):
        return (v + 3) // 4 * 4

    def cd(a):
        return -(-a // 128)

    x = np.ones((301, 259), np.float32)
    for dims in (1, 2):
        res = reference.multi_block_cast_transpose([x], block_scaling_dim=dims, align=16)
        mp = res.m_pad_splits[0]
        want = ((cd(259), r4(301)), (cd(mp), r4(259))) if dims == 1 else \
            ((cd(301), r4(cd(259))), (cd(259), r4(cd(mp))))
        assert (res.rowwise_scale_inv(0).shape, res.columnwise_scale_inv(0).shape) == want
        # the layouts' padding holds the scale_inv of a block of zeros (1: power-of-two, eps 0)
        assert res.scale_inv.size == np.prod(want[0]) and np.all(np.isfinite(res.scale_inv))
        pads = res.rowwise_scale_inv(0)[:, 301:] if dims == 1 else res.rowwise_scale_inv(0)[:, 3:]
        assert pads.size and np.all(pads == 1)


def test_dequantized_error_is_within_half_an_fp8_step_of_each_block():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((300, 384)) * np.exp2(rng.uniform(-20, 20, (300, 1)))).astype(np.float32)
    for dims in (1, 2):
        res = reference.multi_block_cast_transpose(x, [300], block_scaling_dim=dims)
        for deq, s in ((res.dequantize()[0], per_element(res.rowwise_scale_inv(0), 300, 384, dims)),
                       (res.dequantize(columnwise=True)[0],
                        per_element(res.columnwise_scale_inv(0), 384, 304, dims).T[:300])):
            # E4M3 spacing is at most 2^-3 relative and 2^-9 absolute (subnormals), in scaled units
            bound = np.maximum(np.abs(x) * 2.0**-4, 2.0**-10 * s)
            assert np.all(np.abs(deq - x) <= bound), dims


# ------------------------------------------------------------------------------------------------
# The CUDA kernel on the CPU emulator, bit for bit.

ALIGNS = (1, 16, 128)
# split case x dtype x format x block shape x input form; align and fiber order rotate (align per
# group of the 3 forms, so that every form meets every align)
CASES = [
    (split, dtype, fmt, dims, ALIGNS[(i // 3) % 3], form, ORDERS[i % len(ORDERS)])
    for i, (split, dtype, fmt, dims, form) in enumerate(itertools.product(
        BLOCK_SPLITS, DTYPES, ("e4m3", "e5m2"), (1, 2), ("list", "tensor", "device")))
]


@pytest.mark.parametrize("split,dtype,fmt,dims,align,form,order", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_emulated_kernel_matches_reference(split, dtype, fmt, dims, align, form, order):
    check_emulated_kernel(BLOCK_CAST, split, dtype, form, order,
                          f"{split}/{dtype}/{fmt}/{dims}D/align={align}/{form}",
                          fp8_format=fmt, block_scaling_dim=dims, align=align)


@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("eps,p2", [(0.0, False), (2.0**-20, True), (0.5, False)])
@pytest.mark.parametrize("which", ["rowwise", "columnwise"])
def test_options_and_one_sided_copies(dims, eps, p2, which):
    m_splits, xs = case_data("edges", "bfloat16")
    xs[1] = np.zeros_like(xs[1])            # all-zero blocks: the epsilon decides their scale
    check_one_sided_copy(BLOCK_CAST, xs, m_splits, which, f"{dims}D eps={eps} p2={p2} {which}",
                         block_scaling_dim=dims, amax_epsilon=eps, power_2_scale=p2)


@pytest.mark.parametrize("p2", [True, False])
def test_two_d_amax_in_the_last_warps_rows(p2):
    """The 2-D tile amax is reduced over the 8 warps; here every tile's largest values lie in
    rows 28..31 modulo 32 (the last warp's), 2^10 times the others, so a reduction that
    missed a warp would give another scale. (Random data puts the maximum there 1 tile in 8.)"""
    x = np.concatenate(make_inputs([256, 200], 160, "float32", 41))
    rows = np.arange(len(x)) % 32 >= 28
    x[rows] *= np.float32(1024)
    got, want = run_both([x[:256], x[256:]], [256, 200], "tensor", block_scaling_dim=2,
                         power_2_scale=p2)
    assert_same_bits(got, want, f"p2={p2}")


def test_more_experts_than_one_launch_and_device_counts_over_several_chunks():
    # ceil(150 / 64) chunks, one launch each
    check_over_several_chunks(BLOCK_CAST, (3, 4), 136, block_scaling_dim=1)


def test_device_counts_over_more_experts_than_one_scan_pass():
    """300 experts: the blocks of the last chunk scan the counts in two passes of 256 and carry
    every offset (rows, transposed bytes, both scale buffers) from the first pass."""
    rng = np.random.default_rng(12)
    m_splits = [int(v) for v in rng.integers(0, 20, size=300)]
    xs = make_inputs(m_splits, 24, "bfloat16", seed=13)
    for dims, order in ((1, "forward"), (2, "warps")):
        with cugrouped.emulation_order(order):
            got, want = run_both(xs, m_splits, "device", block_scaling_dim=dims)
        assert_same_bits(got, want, f"{dims}D")


# Column sums (dbias of a gradient) in the same pass, in the kernel's fixed order.
COLSUM_CASES = [(split, dtype, form, (1, 2)[i % 2])
                for i, (split, dtype, form) in enumerate(itertools.product(
                    BLOCK_SPLITS, DTYPES, ("list", "tensor", "device")))]


@pytest.mark.parametrize("split,dtype,form,dims", COLSUM_CASES,
                         ids=["-".join(map(str, c)) for c in COLSUM_CASES])
def test_column_sums_emulated_match_reference(split, dtype, form, dims):
    m_splits, xs = case_data(split, dtype)
    got, want = run_both(xs, m_splits, form, block_scaling_dim=dims, column_sums=True)
    assert_same_bits(got, want, f"column sums {split}/{dtype}/{form}/{dims}D")


def test_reference_column_sums_are_the_sums():
    """The kernel-order float32 sums are within float32 summation error of the exact sums."""
    rng = np.random.default_rng(17)
    m_splits, k = [0, 1, 130, 400], 136
    xs = [(rng.standard_normal((m, k)) * np.exp2(rng.uniform(-8, 8, (m, 1)))).astype(np.float32)
          for m in m_splits]
    res = reference.multi_block_cast_transpose(xs, column_sums=True)
    for i, x in enumerate(xs):
        exact = x.astype(np.float64).sum(0)
        bound = max(x.shape[0], 1) * 2.0**-24 * np.abs(x.astype(np.float64)).sum(0)
        assert np.all(np.abs(res.column_sums[i] - exact) <= bound), i
    assert not res.column_sums[0].any()


def test_column_sums_over_chunks_with_an_all_empty_chunk():
    """70 experts: the second launch's chunk holds only empty experts (no tiles, no launch), so
    the op writes their zero sums itself; the first chunk's empty experts are zeroed by block 0.
    The per-stream counters are back at zero after each launch (the op checks)."""
    m_splits = [int(v) for v in np.random.default_rng(5).integers(0, 40, size=64)] + [0] * 6
    m_splits[3] = 0
    xs = make_inputs(m_splits, 64, "float32", seed=6)
    with cugrouped.record_launches() as launches:
        got, want = run_both(xs, m_splits, "tensor", column_sums=True)
    assert len(launches) == 1
    assert_same_bits(got, want, "chunks")
    got, want = run_both(xs, m_splits, "device", column_sums=True)
    assert_same_bits(got, want, "device chunks")


def test_column_sums_options_are_checked():
    x = np.ones((16, 32), np.float32)
    with pytest.raises(TypeError, match="column_sums: expected a bool"):
        cugrouped.multi_block_cast_transpose(x, [16], column_sums=1)
    with pytest.raises(ValueError, match="column_sums: not with row_index"):
        cugrouped.multi_block_cast_transpose(x, [16], column_sums=True,
                                             row_index=np.arange(16, dtype=np.int64))


def test_every_form_meets_every_align():
    seen = {(c[5], c[4]) for c in CASES}
    assert seen == {(f, a) for f in ("list", "tensor", "device") for a in ALIGNS}


@pytest.mark.parametrize("op", ["block", "tensor"])
def test_columnwise_only_views_clamp_device_counts_to_the_rows(op):
    """Without a row-wise copy the per-expert views still clamp device counts to the input's
    rows, as the kernel does (the result records them)."""
    x = make_inputs([110], 40, "float32", seed=7)[0]
    cast = cugrouped.multi_block_cast_transpose if op == "block" else cugrouped.multi_pad_cast_transpose
    got = cast(x, np.array([50, 90, 7], np.int64), splits_on_device=True, backend="emulate",
               rowwise=False)
    assert got.host_splits() == ((50, 60, 0), (64, 64, 0)) and got.total_rows == 110
    assert [got.columnwise(i).shape for i in range(3)] == [(40, 64), (40, 64), (40, 0)]


def test_device_counts_are_clamped_to_the_rows_there_are():
    xs = make_inputs([50, 60], 40, "float32", seed=6)
    x = np.concatenate(xs)
    got = cugrouped.multi_block_cast_transpose(x, np.array([50, 90, 7], np.int64),
                                               splits_on_device=True, backend="emulate")
    want = reference.multi_block_cast_transpose(x, [50, 60, 0])
    assert_same_bits(got, want, "clamped")


@pytest.mark.parametrize("dims", [1, 2])
def test_negative_device_counts_count_as_zero(dims):
    """As for multi_pad_cast_transpose: a negative device count is an expert without rows (no
    tiles, no scales), not a step back into the rows of the experts before it."""
    xs = make_inputs([10, 6, 17], 32, "float32", 2)
    x = np.concatenate(xs)
    counts = np.array([10, -4, 6, -1, 17], np.int64)
    got = cugrouped.multi_block_cast_transpose(x, counts, splits_on_device=True,
                                               block_scaling_dim=dims, column_sums=True,
                                               backend="emulate")
    assert got.host_splits()[0] == (10, 0, 6, 0, 17)
    want = reference.multi_block_cast_transpose(x, [10, 0, 6, 0, 17], block_scaling_dim=dims,
                                                column_sums=True)
    assert_same_bits(got, want, f"{dims}D")


def test_launch_counts_and_no_launch_without_rows():
    xs = make_inputs([0, 33, 0], 64, "bfloat16", seed=1)
    with cugrouped.record_launches() as launches:
        cugrouped.multi_block_cast_transpose(xs, backend="emulate")
    assert [(x.kernel.split("<")[0], x.grid) for x in launches] == \
        [("cg::block_cast_transpose_kernel", 1)]
    with cugrouped.record_launches() as launches:
        res = cugrouped.multi_block_cast_transpose([xs[0], xs[2]], backend="emulate")
    assert launches == [] and res.data.shape == (0, 64) and res.scale_inv.size == 0


def test_out_buffers_are_written_in_place():
    m_splits, xs = case_data("edges", "float32")
    first = cugrouped.multi_block_cast_transpose(xs, backend="emulate", block_scaling_dim=2)
    bufs = {n: getattr(first, n) for n in ("data", "data_t", "scale_inv", "scale_inv_t")}
    for b in bufs.values():
        b.view(np.uint8)[:] = 0xAB
    res = cugrouped.multi_block_cast_transpose(xs, backend="emulate", block_scaling_dim=2, out=first)
    for n, b in bufs.items():
        assert np.shares_memory(np.asarray(getattr(res, n)), b), n
    assert_same_bits(res, reference.multi_block_cast_transpose(xs, block_scaling_dim=2), "out=")


@pytest.mark.parametrize("backend", ["reference", "emulate"])
def test_out_lends_buffers_and_the_result_describes_the_call(backend):
    """As for multi_pad_cast_transpose: the result has the call's splits and FP8 dtype over
    out's buffers (data typed as uint8 bytes here); out of another format is refused, unwritten."""
    k = 64
    first = cugrouped.multi_block_cast_transpose(make_inputs([16, 0, 32], k, "float32", 1),
                                                 fp8_format="e5m2", backend=backend)
    out = dataclasses.replace(first, data=first.data.view(np.uint8))
    splits = [32, 16, 0]
    xs = make_inputs(splits, k, "float32", 2)
    res = cugrouped.multi_block_cast_transpose(xs, fp8_format="e5m2", out=out, backend=backend)
    assert res.data.dtype == ml_dtypes.float8_e5m2 and res.fp8_format == "e5m2"
    assert np.shares_memory(res.data, out.data) and res.m_splits == tuple(splits)
    assert out.m_splits == (16, 0, 32)
    assert_same_bits(res, reference.multi_block_cast_transpose(xs, fp8_format="e5m2"))
    before = np.asarray(out.data).view(np.uint8).copy()
    with pytest.raises(ValueError, match=r"^out: expected a result of this call's fp8_format "
                       r"'e4m3' to reuse, got one of fp8_format 'e5m2'$"):
        cugrouped.multi_block_cast_transpose([x * 2 for x in xs], out=out, backend=backend)
    assert np.array_equal(np.asarray(out.data).view(np.uint8), before)


def test_repr_is_short_and_names_the_block_kind():
    res = cugrouped.multi_block_cast_transpose(make_inputs([300], 260, "bfloat16", seed=9), align=1,
                                               block_scaling_dim=2, backend="reference")
    assert repr(res) == ("GroupedBlockFP8(fp8_format='e4m3', k=260, block_scaling_dim=2, "
                         "m_splits=(300,), align=1, data=numpy float8_e4m3fn (300, 260), "
                         "data_t=numpy uint8 (78000,), scale_inv=numpy float32 (12,), "
                         "scale_inv_t=numpy float32 (12,), column_sums=None)")
    mx = cugrouped.multi_mxfp8_cast_transpose(make_inputs([32], 64, "float32", seed=1),
                                              backend="reference")
    assert repr(mx).startswith("GroupedMXFP8(fp8_format='e4m3', k=64, block_scaling_dim=3, ")
    assert "scale_inv=numpy uint8 (512,)" in repr(mx) and len(repr(mx)) < 300


@pytest.mark.parametrize("dims", [1, 2])
def test_tail_tile_of_more_than_112_columns_reads_no_column_past_k(dims):
    """k = 248: the last tile column has 120 columns, so its last segment of 16 is partial and
    the tile must take the bounded loads; a whole-segment load would add the next row's first
    8 values (64 times larger every other row here) to the amax of the even rows' 1-D blocks
    (2-D: the same loads, though here the odd rows set the tile's amax anyway). No other case
    has a tail of 113 to 127 columns."""
    m_splits, k = [130, 256], 248
    x = np.concatenate(make_inputs(m_splits, k, "float32", 23))
    x *= np.where(np.arange(len(x)) % 2, 64, 1).astype(np.float32)[:, None]
    got = cugrouped.multi_block_cast_transpose(x, m_splits, block_scaling_dim=dims,
                                               column_sums=True, backend="emulate")
    want = reference.multi_block_cast_transpose(x, m_splits, block_scaling_dim=dims,
                                                column_sums=True)
    assert_same_bits(got, want, f"{dims}D")


@pytest.mark.parametrize("form", ["tensor", "device"])
def test_row_offsets_past_2_31_elements(form):
    """As for multi_pad_cast_transpose: rows 2^26 elements apart (a strided view of a 4 GiB
    bfloat16 buffer, of which only the pages of the rows read are touched), so that from row 32
    on a row's element offset exceeds 2^31: an offset computed in 32 bits (the device splits'
    per-expert input offset, or a row's offset inside an expert) reads elsewhere or faults."""
    view, small, m_splits, splits = rows_far_apart(form)
    got = cugrouped.multi_block_cast_transpose(view, splits, splits_on_device=form == "device",
                                               column_sums=True, backend="emulate")
    want = reference.multi_block_cast_transpose(small, m_splits, column_sums=True)
    assert_same_bits(got, want, form)


def test_two_d_blocks_give_w_and_w_transposed_with_the_same_scales():
    w = make_inputs([300], 260, "bfloat16", seed=9)[0]
    res = cugrouped.multi_block_cast_transpose([w], align=1, block_scaling_dim=2, backend="emulate")
    assert np.array_equal(np.asarray(res.rowwise(0)).view(np.uint8).T, res.columnwise(0))
    s, st = res.rowwise_scale_inv(0), res.columnwise_scale_inv(0)
    assert np.array_equal(s[:, :3], st[:, :3].T)


def test_torch_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    check_torch_tensors_in_and_out(BLOCK_CAST, torch.float32)


# ------------------------------------------------------------------------------------------------
# The fused MoE permute (row_index): the kernel gathers the rows itself.

@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("form", ["host", "device"])
def test_gather_equals_permute_then_cast(dims, dtype, form):
    tokens, m_splits, idx, want = check_gather(BLOCK_CAST, (dims, dtype, form), dtype, form,
                                               f"gather {dims}D {dtype} {form}",
                                               block_scaling_dim=dims)
    ref = reference.multi_block_cast_transpose(tokens, m_splits, row_index=idx, block_scaling_dim=dims)
    assert_same_bits(ref, want, "the reference's own gather")


def test_gather_over_several_launches_and_strided_tokens():
    """More experts than one argument block holds: the second chunk's indices start at its
    row_first0 plus its own experts' counts; tokens with a row stride larger than k."""
    rng = np.random.default_rng(21)
    m_splits = [int(v) for v in rng.integers(0, 30, size=90)]
    wide = make_inputs([50], 160, "float16", seed=22)[0]
    tokens = wide[:, :136]                                   # row stride 160 elements
    idx = rng.integers(-1, 50, sum(m_splits)).astype(np.int64)
    with cugrouped.record_launches() as launches:
        got = cugrouped.multi_block_cast_transpose(tokens, m_splits, row_index=idx, backend="emulate")
    assert len(launches) == 2 and all(x.kernel.endswith("1, true>") for x in launches)
    want = reference.multi_block_cast_transpose(permuted(np.ascontiguousarray(tokens), idx), m_splits)
    assert_same_bits(got, want, "chunks")


@pytest.mark.parametrize("call,exc,match", [
    (lambda t, i: cugrouped.multi_block_cast_transpose([t], None, row_index=i), ValueError,
     "row_index: gathers rows of a single"),
    (lambda t, i: cugrouped.multi_block_cast_transpose(t, [len(i)], row_index=i.astype(np.int32)),
     TypeError, "row_index: expected a contiguous 1-D int64"),
    (lambda t, i: cugrouped.multi_block_cast_transpose(t, [len(i)], row_index=i + 100), ValueError,
     "row_index: indices must be below"),
    (lambda t, i: cugrouped.multi_block_cast_transpose(t, [len(i) + 1], row_index=i), ValueError,
     "but row_index has"),
])
def test_gather_bad_input(call, exc, match):
    t = np.ones((20, 32), np.float32)
    with pytest.raises(exc, match=match):
        call(t, np.arange(16, dtype=np.int64))


# ------------------------------------------------------------------------------------------------
# Planning, pure functions.

def test_planning_pure_functions():
    assert bct.block_tile_counts([0, 1, 128, 129], 129) == (0, 2, 2, 4)
    plans = bct.plan_block_launches([5] * 70, 64)
    assert [(p.first, p.count, p.grid) for p in plans] == [(0, 64, 64), (64, 6, 6)]
    assert bct.plan_block_launches([0, 0], 64)[0].grid == 0
    sz = bct.block_output_sizes([5, 0, 130], 260, 16, 1)
    assert (sz.rows, sz.data_t, sz.scale_inv, sz.scale_inv_t) == (135, 260 * (16 + 144),
                                                                  3 * (8 + 132), 260 * (1 + 2))


def test_device_worst_case_bounds_every_split():
    rng = np.random.default_rng(8)
    for _ in range(300):
        E = int(rng.integers(1, 20))
        m = [int(v) for v in rng.integers(0, 400, size=E)]
        k, align, dims = int(rng.integers(1, 600)), int(rng.choice(bct.ALIGNS)), int(rng.integers(1, 3))
        exact = bct.block_output_sizes(m, k, align, dims)
        worst = bct.block_output_sizes(None, k, align, dims, E, sum(m))
        assert all(getattr(worst, f) >= getattr(exact, f) for f in ("rows", "data_t", "scale_inv",
                                                                    "scale_inv_t")), (m, k, align)
        grid = bct.plan_block_launches_device(E, sum(m), k)[0].grid
        assert grid >= sum(bct.block_tile_counts(m, k))


def test_group_struct_layout_matches_on_host_and_device():
    """The NumPy twin of cg::BctGroup has the C++ layout: every offset under g++, size and
    alignment under NVRTC (see the PctGroup test)."""
    from cupy.cuda.compiler import _NVRTCProgram

    from cugrouped import _compile_check, emulate

    dt = bct.group_dtype()
    assert dt.itemsize + 8 + 4 + 4 + 4 < 4096              # the 4 KB kernel parameter limit
    lines = [f'static_assert(sizeof(cg::BctGroup) == {dt.itemsize}, "sizeof");',
             'static_assert(alignof(cg::BctGroup) == 8, "alignof");']
    offsets = [f'static_assert(__builtin_offsetof(cg::BctGroup, {n}) == {dt.fields[n][1]}, "{n}");'
               for n in dt.names]
    probe = '#include "block_cast_transpose.cu"\n{}\n__global__ void layout_probe() {{}}\n'
    spec = bct.KERNEL_SPEC
    opts = _compile_check.offline_options(spec, "90", verbose_ptxas=False)
    _NVRTCProgram(probe.format("\n".join(lines)), "layout.cu", name_expressions=["layout_probe"],
                  method="cubin").compile(opts)
    emulate.EmuModule(code=probe.format("\n".join(lines + offsets)), name_expressions=("layout_probe",))


# ------------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, nothing written.

X = np.ones((10, 32), np.float32)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: cugrouped.multi_block_cast_transpose(X, [10], block_scaling_dim=3), ValueError,
     "block_scaling_dim"),
    (lambda: cugrouped.multi_block_cast_transpose(X, [10], block_scaling_dim=True), ValueError,
     "block_scaling_dim"),
    (lambda: cugrouped.multi_block_cast_transpose(X, [10], align=48), ValueError, "align"),
    (lambda: cugrouped.multi_block_cast_transpose(X, [10], fp8_format="e3m4"), ValueError,
     "fp8_format"),
    (lambda: cugrouped.multi_block_cast_transpose(X, [10], rowwise=False, columnwise=False),
     ValueError, "rowwise, columnwise"),
    (lambda: cugrouped.multi_block_cast_transpose(X, [10], amax_epsilon=-1.0), ValueError,
     "amax_epsilon"),
    (lambda: cugrouped.multi_block_cast_transpose(X, [10], power_2_scale=1), TypeError,
     "power_2_scale"),
    (lambda: cugrouped.multi_block_cast_transpose(X, [4, 5]), ValueError, "m_splits"),
    (lambda: cugrouped.multi_block_cast_transpose(X.astype(np.float64), [10]), TypeError, "inputs"),
    (lambda: cugrouped.multi_block_cast_transpose(X, [10], out=object()), TypeError, "out"),
    (lambda: cugrouped.multi_block_cast_transpose(X, [10], backend="gpu"), ValueError, "backend"),
])
def test_bad_input_is_rejected_clearly(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("backend", ["emulate", "reference"])
def test_bad_out_buffer_is_rejected_before_anything_is_written(backend):
    check_bad_out_buffer_is_rejected(BLOCK_CAST, X, backend, "scale_inv_t",
                                     lambda s: np.zeros(s.size + 1, np.float32))


# ------------------------------------------------------------------------------------------------
# The same matrix on a GPU (skipped here; run by scripts/gpu_check.sh).

GPU_CASES = [c for c in CASES if c[5] != "tensor"]


@pytest.mark.gpu
@pytest.mark.parametrize("split,dtype,fmt,dims,align,form,order", GPU_CASES,
                         ids=["-".join(map(str, c)) for c in GPU_CASES])
def test_cuda_matches_reference(split, dtype, fmt, dims, align, form, order):
    check_cuda_matches_reference(BLOCK_CAST, split, dtype, form,
                                 f"cuda {split}/{dtype}/{fmt}/{dims}D/{form}",
                                 fp8_format=fmt, block_scaling_dim=dims, align=align,
                                 column_sums=form == "device")


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["host", "device"])
@pytest.mark.parametrize("dims", [1, 2])
def test_cuda_gather_matches_reference(form, dims):
    check_cuda_gather(BLOCK_CAST, (31, 32), "float32", form, f"cuda gather {form} {dims}D",
                      block_scaling_dim=dims)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["host", "device"])
@pytest.mark.parametrize("dims", [1, 2])
def test_cuda_gather_from_misaligned_tokens(form, dims):
    """bfloat16 tokens whose base is 2 bytes off 16 and whose row stride (132 elements, 264
    bytes) is not a multiple of 16 bytes: the kernel must take its per-segment path (16-byte
    loads there would fault or read the wrong bytes on a GPU; the emulator cannot tell)."""
    import cupy

    rng = np.random.default_rng(41)
    T, k = 50, 132
    host = make_inputs([T], k, "bfloat16", seed=42)[0]
    buf = cupy.zeros(T * k + 1, dtype=cupy.uint16)
    buf[1:] = cupy.asarray(host.view(np.uint16).reshape(-1))
    tokens = buf[1:].reshape(T, k)                     # base 2 bytes past the allocation's
    assert tokens.data.ptr % 16 != 0
    m_splits = [136, 0, 24]
    idx = rng.integers(-2, T, sum(m_splits)).astype(np.int64)
    splits = m_splits if form == "host" else cupy.asarray(np.array(m_splits, np.int64))
    got = cugrouped.multi_block_cast_transpose(tokens, splits, dtype="bfloat16",
                                               row_index=cupy.asarray(idx), block_scaling_dim=dims)
    want = reference.multi_block_cast_transpose(permuted(host, idx), m_splits, block_scaling_dim=dims)
    assert_same_bits(BLOCK_CAST.to_host(got), want, f"misaligned gather {form} {dims}D")


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [1, 2])
def test_cuda_large_case_over_2_31_elements(dims):
    """An expert of more than 2^31 elements and one that starts past 2^31 elements: the kernel's
    offsets pass 2^31. Checked block row by block row against the reference (a 128-row block's
    bytes and scales depend on nothing but its rows), at the start, across the 2^31 edge and at
    the tail with the padding."""
    import cupy

    k = 8192
    edge = 2**31 // k // 128 * 128               # a block row near row * k = 2^31
    big = edge + 128 + 69
    m_splits = [77, big, 0, 200]
    off = np.concatenate([[0], np.cumsum(m_splits)])
    rows = int(off[-1])
    need = rows * k * (4 + 2 + 2) + (1 << 30)
    free = cupy.cuda.runtime.memGetInfo()[0]
    if need > 0.9 * free:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of GPU memory, {free / 2**30:.0f} GiB free")
    pool = cupy.get_default_memory_pool()
    got = x = None
    try:
        x = cupy.random.standard_normal((rows, k), dtype=cupy.float32).astype(cupy.float16)
        got = cugrouped.multi_block_cast_transpose(x.view(cupy.uint16), m_splits, dtype="float16",
                                                   block_scaling_dim=dims)
        for e, r0, n in [(0, 0, 77), (3, 0, 200), (1, 0, 128), (1, edge, 128), (1, edge + 128, 69)]:
            host = cupy.asnumpy(x[off[e] + r0: off[e] + r0 + n]).view(np.float16)
            want = reference.multi_block_cast_transpose([host], block_scaling_dim=dims)
            label = f"{dims}D expert {e} rows {r0}..{r0 + n}"
            assert np.array_equal(cupy.asnumpy(got.rowwise(e)[r0:r0 + n]).view(np.uint8),
                                  want.data.view(np.uint8)), label
            w = want.m_pad_splits[0]
            assert np.array_equal(cupy.asnumpy(got.columnwise(e)[:, r0:r0 + w]),
                                  want.columnwise(0)), label + " transposed"
            srow, scol = cupy.asnumpy(got.rowwise_scale_inv(e)), cupy.asnumpy(got.columnwise_scale_inv(e))
            b = r0 // 128
            if dims == 1:
                assert np.array_equal(srow[:, r0:r0 + n], want.rowwise_scale_inv(0)[:, :n]), label
                assert np.array_equal(scol[b], want.columnwise_scale_inv(0)[0]), label
            else:
                assert np.array_equal(srow[b], want.rowwise_scale_inv(0)[0]), label
                assert np.array_equal(scol[:, b], want.columnwise_scale_inv(0)[:, 0]), label
    finally:
        x = got = None
        pool.free_all_blocks()


_NAN_CASTS = {"1x128": lambda xs, **kw: cugrouped.multi_block_cast_transpose(xs, **kw),
              "128x128": lambda xs, **kw: cugrouped.multi_block_cast_transpose(
                  xs, block_scaling_dim=2, **kw),
              "mxfp8": lambda xs, **kw: cugrouped.multi_mxfp8_cast_transpose(xs, **kw)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["reference", "emulate"])
@pytest.mark.parametrize("kind", list(_NAN_CASTS))
def test_nan_column_sums_have_the_gpus_bits(kind, backend, dtype):
    """The block and MXFP8 casts' column sums that are NaN carry the GPU's 0x7FFFFFFF on every
    backend (the reference's and the emulated kernel's ftz() canonicalise NaN, as the GPU's
    float32 arithmetic does)."""
    xs = nan_case(dtype)
    got = _NAN_CASTS[kind](xs, column_sums=True, backend=backend)
    assert_gpu_nan_column_sums(got.column_sums, xs)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(_NAN_CASTS))
def test_cuda_nan_column_sums_have_the_references_bits(kind):
    import cupy

    xs = nan_case("float32")
    got = _NAN_CASTS[kind]([cupy.asarray(x) for x in xs], column_sums=True)
    sums = cupy.asnumpy(got.column_sums)
    assert_gpu_nan_column_sums(sums, xs)
    want = _NAN_CASTS[kind](xs, column_sums=True, backend="reference").column_sums
    np.testing.assert_array_equal(sums.view(np.uint32), want.view(np.uint32))
