"""multi_pad_cast_transpose: the CUDA kernel run on the CPU emulator must give the NumPy reference's
bits, over the split taxonomy of design.md §6, input dtypes, FP8 formats, scaling modes, padding
alignments and input forms, with the emulator's fiber order varied. Plus planning (pure functions),
launch counts, argument checks, and the GPU twin of the matrix (marked ``gpu``)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib

import ml_dtypes
import numpy as np
import pytest

import cugrouped
from cugrouped import reference
from cugrouped.ops import _cast_inputs
from cugrouped.ops import pad_cast_transpose as pct

# The split taxonomy (design.md §6): name -> (m_splits, k)
SPLITS = {
    "uniform": ([48, 48, 48, 48], 64),
    "skewed": ([3, 130, 1, 70], 96),
    "empty_first": ([0, 33, 17], 64),
    "empty_middle": ([20, 0, 45], 48),
    "empty_last": ([29, 64, 0], 32),
    "single": ([77], 144),
    "not_mult16": ([17, 5, 31, 9], 40),
    "count_one": ([1, 1, 2], 64),
    "k_smallest": ([19, 40], 16),
    "full_tiles": ([0, 200, 64, 130, 77], 384),   # whole 64 x 128 tiles, half last runs
}
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
ORDERS = ("forward", "reverse", "shuffle", 7, "warps", "warps-reverse")


def make_inputs(m_splits, k, dtype, seed, specials=False):
    rng = np.random.default_rng(seed)
    xs = []
    for m in m_splits:
        # log-uniform magnitudes over a wide range, random signs: exercises every FP8 binade,
        # saturation (after scaling) and underflow
        x = (rng.choice([-1.0, 1.0], size=(m, k)) * np.exp2(rng.uniform(-12, 6, size=(m, k))))
        x = x.astype(np.float32)
        if specials and x.size:
            flat = x.reshape(-1)
            nan_neg = np.array([0xFFC00001], np.uint32).view(np.float32)[0]    # -NaN with payload
            vals = [np.nan, nan_neg, np.inf, -np.inf, 0.0, -0.0, 1e-40, -3e-39, 65504.0, 3e38]
            idx = rng.choice(flat.size, size=min(flat.size, len(vals)), replace=False)
            flat[idx] = np.array(vals[: len(idx)], dtype=np.float32)
        with np.errstate(over="ignore"):     # 3e38 -> inf in float16 is part of the test
            xs.append(x.astype(DTYPES[dtype]))
    return xs


def as_bits(a):
    if a is None:
        return None
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def assert_buffers_equal(got, want, names, worst_case=(), label=""):
    """The buffers ``names`` of two cast results equal bit for bit (absent in both or neither);
    with device splits those in ``worst_case`` are sized for the worst case and compared on the
    prefix the experts fill; and the same host view of the splits."""
    for name in names:
        g, w = as_bits(getattr(got, name)), as_bits(getattr(want, name))
        if w is None:
            assert g is None, f"{label} {name}"
            continue
        if got.splits_on_device and name in worst_case:
            assert g.shape[0] >= w.shape[0], f"{label} {name} too small"
            g = g[: w.shape[0]]
        assert g.shape == w.shape, f"{label} {name}: shape {g.shape} != {w.shape}"
        bad = np.flatnonzero(g.reshape(-1) != w.reshape(-1))
        assert bad.size == 0, (f"{label} {name}: {bad.size} of {w.size} differ, first at {bad[0]}: "
                               f"{g.reshape(-1)[bad[0]]:#x} != {w.reshape(-1)[bad[0]]:#x}")
    assert got.host_splits() == (want.m_splits, want.m_pad_splits), label


def assert_same_bits(got, want, label=""):
    assert_buffers_equal(got, want, ("data", "data_t", "amax", "scale", "scale_inv", "column_sums"),
                         ("data_t",), label)


def run_both(xs, m_splits, form, **kw):
    """form: "list" of arrays, "tensor" + host splits, or "device": tensor + an int64 count array
    that the kernel reads itself (as it reads device memory on a GPU)."""
    if form == "list":
        args = (xs, None)
    else:
        args = (np.concatenate(xs, axis=0), list(m_splits))
    want = reference.multi_pad_cast_transpose(*args, **kw)
    if form == "device":
        got = cugrouped.multi_pad_cast_transpose(args[0], np.array(m_splits, np.int64),
                                                 splits_on_device=True, backend="emulate", **kw)
        assert got.m_pad_splits is None
    else:
        got = cugrouped.multi_pad_cast_transpose(*args, backend="emulate", **kw)
    return got, want


def device_inputs(xs, m_splits, form, dtype):
    """``xs`` on the GPU as ``form`` takes them: ``(inputs, splits, dtype tag)`` for "list" (the
    arrays), "tensor" (one array and host splits) or "device" (one array and int64 counts in
    device memory, read by the kernel); bfloat16 as its uint16 bits with the tag."""
    import cupy

    carrier = {"bfloat16": np.uint16}.get(dtype)
    dxs = [cupy.asarray(x.view(carrier) if carrier else x) for x in xs]
    splits = None
    if form == "tensor":
        dxs, splits = cupy.concatenate(dxs, axis=0), list(m_splits)
    elif form == "device":
        dxs, splits = cupy.concatenate(dxs, axis=0), cupy.asarray(np.array(m_splits, np.int64))
    return dxs, splits, dtype if carrier else None


def scales_for(m_splits, fmt, seed):
    rng = np.random.default_rng(seed)
    # includes a scale that saturates much of the data, and a tiny one
    return (np.exp2(rng.uniform(-8, 12, size=len(m_splits)))).astype(np.float32)


# The full product: split case x dtype x format x scaling x align x input form; the fiber order
# rotates through forward, reverse, shuffled and a seeded shuffle.
CASES = [
    (split, dtype, fmt, given, align, form, ORDERS[i % len(ORDERS)])
    for i, (split, dtype, fmt, given, align, form) in enumerate(itertools.product(
        SPLITS, DTYPES, ("e4m3", "e5m2"), (True, False), (1, 16, 32, 128),
        ("list", "tensor", "device")))
]


def case_data(split, dtype, fmt, given):
    """Inputs and scales of one matrix case, the same on every backend and run."""
    m_splits, k = SPLITS[split]
    seed = zlib.crc32(repr((split, dtype, fmt, given)).encode())
    xs = make_inputs(m_splits, k, dtype, seed, specials=(split == "skewed"))
    return m_splits, xs, scales_for(m_splits, fmt, seed) if given else None


@pytest.mark.parametrize("split,dtype,fmt,given,align,form,order", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_emulated_kernel_matches_reference(split, dtype, fmt, given, align, form, order):
    m_splits, xs, scale = case_data(split, dtype, fmt, given)
    kw = dict(fp8_format=fmt, align=align, scale=scale, column_sums=True)
    with cugrouped.emulation_order(order):
        got, want = run_both(xs, m_splits, form, **kw)
    assert_same_bits(got, want, f"{split}/{dtype}/{fmt}/given={given}/align={align}/{form}")
    # padding columns of the transposed copy are zero bytes written by the kernel
    for i, m in enumerate(m_splits):
        assert not np.asarray(got.columnwise(i))[:, m:].any()


@pytest.mark.parametrize("align", [1, 16, 32, 128])
@pytest.mark.parametrize("form", ["list", "tensor", "device"])
def test_every_align_and_form_on_the_skewed_case(align, form):
    m_splits, k = SPLITS["skewed"]
    xs = make_inputs(m_splits, k, "bfloat16", 11, specials=True)
    for given in (True, False):
        got, want = run_both(xs, m_splits, form, fp8_format="e4m3", align=align,
                             scale=scales_for(m_splits, "e4m3", 3) if given else None)
        assert_same_bits(got, want, f"align={align}/{form}/given={given}")


def test_more_experts_than_one_launch_holds():
    m_splits = [(i * 7) % 23 for i in range(pct.MAX_EXPERTS_PER_LAUNCH + 6)]  # includes zeros
    k = 32
    xs = make_inputs(m_splits, k, "float16", 5)
    plans = pct.plan_launches(m_splits, k, 16)
    assert [p.count for p in plans] == [pct.MAX_EXPERTS_PER_LAUNCH, 6]
    for given in (True, False):
        with cugrouped.record_launches() as log:
            got, want = run_both(xs, m_splits, "tensor", fp8_format="e5m2", align=16,
                                 scale=scales_for(m_splits, "e5m2", 1) if given else None)
        assert_same_bits(got, want, f"chunked given={given}")
        assert len(log) == len(plans) * (1 if given else 2)


@pytest.mark.parametrize("given,order", [(True, "forward"), (False, "warps")])
def test_device_splits_over_several_chunks(given, order):
    """Each chunk's blocks scan the counts of every expert before it, more than a warp's worth:
    the "warps" order (one warp runs ahead) shows a scan whose shared totals are reused too early."""
    m_splits = [(i * 5) % 19 for i in range(2 * pct.MAX_EXPERTS_PER_LAUNCH + 3)]
    xs = make_inputs(m_splits, 40, "bfloat16", 6)
    with cugrouped.record_launches() as log, cugrouped.emulation_order(order):
        got, want = run_both(xs, m_splits, "device", align=32, column_sums=True,
                             scale=scales_for(m_splits, "e4m3", 2) if given else None)
    assert_same_bits(got, want, "device splits, 3 chunks")
    assert len(log) == 3 * (1 if given else 2)


def test_device_splits_with_more_experts_than_one_scan_pass():
    """Experts past the first 256 make each block scan the counts in several passes (carries)."""
    m_splits = [(i * 11) % 7 for i in range(300)]
    xs = make_inputs(m_splits, 16, "float32", 8)
    with cugrouped.emulation_order("warps"):
        got, want = run_both(xs, m_splits, "device", align=16)
    assert_same_bits(got, want, "300 experts, device splits")


def test_device_splits_are_clamped_to_the_rows_there_are():
    xs = make_inputs([10, 6], 32, "float32", 1)
    x = np.concatenate(xs)
    got = cugrouped.multi_pad_cast_transpose(x, np.array([10, 50, 3], np.int64), splits_on_device=True,
                                             backend="emulate")
    assert got.host_splits()[0] == (10, 6, 0)
    want = reference.multi_pad_cast_transpose(x, [10, 6, 0])
    assert np.array_equal(got.data.view(np.uint8), want.data.view(np.uint8))
    assert np.array_equal(got.data_t[: want.data_t.size], want.data_t)


@pytest.mark.parametrize("given", [True, False])
def test_negative_device_counts_count_as_zero(given):
    """Device counts are not checked on the host (that would need a sync): a negative count is
    an expert without rows, as host_splits() reads them back (clip at 0), not a step back into
    the rows of the experts before it."""
    xs = make_inputs([10, 6, 17], 32, "float32", 2)
    x = np.concatenate(xs)
    counts = np.array([10, -4, 6, -1, 17], np.int64)
    scale = np.array([1.0, 4.0, 0.5, 2.0, 8.0], np.float32) if given else None
    got = cugrouped.multi_pad_cast_transpose(x, counts, splits_on_device=True, scale=scale,
                                             column_sums=True, backend="emulate")
    assert got.host_splits()[0] == (10, 0, 6, 0, 17)
    want = reference.multi_pad_cast_transpose(x, [10, 0, 6, 0, 17], scale=scale,
                                              column_sums=True)
    assert_same_bits(got, want, f"given={given}")


def test_planning_for_device_splits_bounds_every_split():
    rng = np.random.default_rng(0)
    for _ in range(200):
        E, align, k = int(rng.integers(1, 150)), int(rng.choice([1, 16, 128])), int(rng.integers(1, 600))
        m = rng.multinomial(int(rng.integers(0, 5000)), np.ones(E) / E)
        exact = pct.plan_launches(m, k, align)
        bound = pct.plan_launches_device(E, int(m.sum()), k, align)
        assert [(p.first, p.count) for p in exact] == [(p.first, p.count) for p in bound]
        assert all(b.grid >= e.grid for b, e in zip(bound, exact))


def test_launch_counts():
    xs = make_inputs([5, 0, 9], 32, "float32", 2)
    with cugrouped.record_launches() as log:
        cugrouped.multi_pad_cast_transpose(xs, scale=np.ones(3, np.float32), backend="emulate")
    assert [launch.kernel.split("PctMode::")[1] for launch in log] == ["CAST_AMAX>"]
    with cugrouped.record_launches() as log:
        cugrouped.multi_pad_cast_transpose(xs, backend="emulate")
    assert [launch.kernel.split("PctMode::")[1] for launch in log] == ["AMAX_ONLY>", "CAST>"]
    assert all(launch.grid == sum(pct.tile_counts([5, 0, 9], 32, 16)) for launch in log)
    # column sums select the COLSUM instantiation of the amax-computing pass only
    for scale, want in ((None, ["AMAX_ONLY, true>", "CAST>"]), (np.ones(3, np.float32), ["CAST_AMAX, true>"])):
        with cugrouped.record_launches() as log:
            cugrouped.multi_pad_cast_transpose(xs, scale=scale, column_sums=True, backend="emulate")
        assert [launch.kernel.split("PctMode::")[1] for launch in log] == want
    with pytest.raises(ValueError, match="column sums"):
        pct.kernel_name("float32", "e4m3", "CAST", column_sums=True)


def test_column_sums_are_close_to_exact_sums():
    """Bit-exact against the reference's fixed order above; here also against float64: float32
    summation of m terms errs by at most about m * 2^-24 * sum |x| (the kernel's tree is shallower)."""
    m_splits, k = [200, 0, 3, 129], 272
    xs = make_inputs(m_splits, k, "float32", 21)
    res = cugrouped.multi_pad_cast_transpose(xs, backend="emulate", column_sums=True)
    for i, x in enumerate(xs):
        exact = x.astype(np.float64).sum(axis=0)
        bound = max(m_splits[i], 1) * 2.0**-24 * np.abs(x.astype(np.float64)).sum(axis=0)
        assert np.all(np.abs(res.column_sums[i] - exact) <= bound + 1e-30)
    assert not res.column_sums[1].any()


def test_rowwise_only_and_columnwise_only():
    m_splits, k = [13, 0, 40], 48
    xs = make_inputs(m_splits, k, "bfloat16", 9)
    for rw, cw in ((True, False), (False, True)):
        got, want = run_both(xs, m_splits, "list", rowwise=rw, columnwise=cw)
        assert (got.data is None) == (not rw) and (got.data_t is None) == (not cw)
        assert_same_bits(got, want)


def test_out_buffers_written_in_place():
    m_splits, k = [10, 22], 32
    xs = make_inputs(m_splits, k, "float32", 4)
    first = cugrouped.multi_pad_cast_transpose(xs, backend="emulate")
    before = {n: np.asarray(getattr(first, n)).ctypes.data for n in ("data", "data_t", "amax", "scale_inv")}
    xs2 = make_inputs(m_splits, k, "float32", 5)
    again = cugrouped.multi_pad_cast_transpose(xs2, backend="emulate", out=first)
    for n, ptr in before.items():
        assert np.asarray(getattr(again, n)).ctypes.data == ptr, n
    assert_same_bits(again, reference.multi_pad_cast_transpose(xs2))


@pytest.mark.parametrize("backend", ["reference", "emulate"])
def test_out_lends_buffers_and_the_result_describes_the_call(backend):
    """The returned object describes this call (splits, format, the FP8 dtype of its format) over
    out's buffers, whatever out's own fields say or its data buffer is typed as (here uint8
    bytes); out's own fields are left as they were."""
    k = 32
    first = cugrouped.multi_pad_cast_transpose(make_inputs([16, 0, 32], k, "float32", 1),
                                               fp8_format="e5m2", backend=backend)
    out = dataclasses.replace(first, data=first.data.view(np.uint8))    # bytes, as CuPy's
    splits = [32, 16, 0]                                  # same buffer sizes, other experts
    xs = make_inputs(splits, k, "float32", 2)
    res = cugrouped.multi_pad_cast_transpose(xs, fp8_format="e5m2", out=out, backend=backend)
    assert res.data.dtype == ml_dtypes.float8_e5m2 and res.fp8_format == "e5m2"
    assert np.shares_memory(res.data, out.data) and np.shares_memory(res.data_t, out.data_t)
    assert res.m_splits == tuple(splits) and out.m_splits == (16, 0, 32)
    assert_same_bits(res, reference.multi_pad_cast_transpose(xs, fp8_format="e5m2"))


@pytest.mark.parametrize("backend", ["reference", "emulate"])
def test_out_of_another_fp8_format_is_refused_before_anything_is_written(backend):
    xs = make_inputs([16, 0, 32], 32, "float32", 3)
    out = cugrouped.multi_pad_cast_transpose(xs, backend=backend)              # e4m3
    before = {n: np.asarray(getattr(out, n)).view(np.uint8).copy() for n in ("data", "data_t")}
    with pytest.raises(ValueError, match=r"^out: expected a result of this call's fp8_format "
                       r"'e5m2' to reuse, got one of fp8_format 'e4m3'$"):
        cugrouped.multi_pad_cast_transpose([x * 2 for x in xs], fp8_format="e5m2", out=out,
                                           backend=backend)
    for n, b in before.items():
        assert np.array_equal(np.asarray(getattr(out, n)).view(np.uint8), b), n
    with pytest.raises(ValueError, match=r"^out: expected a result of this call's fp8_format"):
        reference.multi_pad_cast_transpose(xs, fp8_format="e5m2", out=out)


class _DeviceOnly:
    """A CUDA array as the repr sees it: metadata only; reading its data fails the test."""
    __module__ = "cupy._core.core"

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.device = type("Device", (), {"id": 1})()

    def __getattr__(self, name):
        raise AssertionError(f"repr read {name} of a device array")

    def __array__(self, *a, **k):
        raise AssertionError("repr copied a device array to the host")


def test_repr_is_short_and_reads_no_data():
    """Class, format, k, splits (the first 8 of many), align, and each buffer's kind, dtype,
    shape and device, instead of the arrays' contents (kB of them, or a device copy and sync)."""
    splits = [3] * 40
    res = cugrouped.multi_pad_cast_transpose(make_inputs(splits, 256, "float32", 1),
                                             column_sums=True, backend="reference")
    text = repr(res)
    assert text == ("GroupedFP8(fp8_format='e4m3', k=256, m_splits=(3, 3, 3, 3, 3, 3, 3, 3, "
                    "...: 40 experts), align=16, data=numpy float8_e4m3fn (120, 256), "
                    "data_t=numpy uint8 (163840,), amax=numpy float32 (40,), scale=numpy "
                    "float32 (40,), scale_inv=numpy float32 (40,), column_sums=numpy float32 "
                    "(40, 256))")
    dev = cugrouped.GroupedFP8(data=None, data_t=_DeviceOnly((48 * 16,), np.uint8),
                               m_splits=(16, 0, 32), m_pad_splits=(16, 0, 32),
                               amax=_DeviceOnly((3,), np.float32),
                               scale=_DeviceOnly((3,), np.float32),
                               scale_inv=_DeviceOnly((3,), np.float32),
                               fp8_format="e5m2", k=16, align=16)
    assert repr(dev) == ("GroupedFP8(fp8_format='e5m2', k=16, m_splits=(16, 0, 32), align=16, "
                         "data=None, data_t=cupy uint8 (768,) cuda:1, amax=cupy float32 (3,) "
                         "cuda:1, scale=cupy float32 (3,) cuda:1, scale_inv=cupy float32 (3,) "
                         "cuda:1, column_sums=None)")
    torch = pytest.importorskip("torch")           # meta tensors: any data read would raise
    meta = dataclasses.replace(dev, data=torch.empty((48, 16), dtype=torch.float8_e5m2,
                                                     device="meta"),
                               m_splits=torch.empty(3, dtype=torch.int64, device="meta"))
    assert "m_splits=torch int64 (3,) meta, align=16, data=torch float8_e5m2 (48, 16) meta, " \
        "data_t=cupy uint8 (768,) cuda:1" in repr(meta)


def test_weights_align_one_give_w_and_w_transposed():
    w = make_inputs([24, 24], 32, "bfloat16", 8)
    res = cugrouped.multi_pad_cast_transpose(w, align=1, backend="emulate")
    assert res.m_pad_splits == (24, 24)
    for i in range(2):
        assert np.array_equal(np.asarray(res.columnwise(i)).T, np.asarray(res.rowwise(i)).view(np.uint8))


def test_dequantize_round_trip_is_within_fp8_precision():
    xs = [np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32)]
    res = cugrouped.multi_pad_cast_transpose(xs, backend="emulate")
    back = res.dequantize()[0]
    # e4m3 has 3 mantissa bits: relative error of a rounded value is at most 2^-4
    big = np.abs(xs[0]) > 2.0**-6 * float(res.amax[0])
    assert np.all(np.abs(back - xs[0])[big] <= 2.0**-4 * np.abs(xs[0])[big])


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_tiles_without_column_sums_and_tiles_that_may_not_take_the_fast_path(dtype):
    """The full-tile path (tile inside m and k, every row 16-byte aligned: all loads issued before
    any use) in the kernels without column sums (the matrix above asks for them everywhere); and
    tiles inside m and k that must take the per-segment path: a row stride that is not a multiple
    of 16 bytes, and a base pointer one element off 16-byte alignment."""
    m_splits, k = SPLITS["full_tiles"]
    xs = make_inputs(m_splits, k, dtype, 13)
    for given in (True, False):
        scale = scales_for(m_splits, "e5m2", 5) if given else None
        for form in ("list", "device"):
            got, want = run_both(xs, m_splits, form, fp8_format="e5m2", scale=scale)
            assert_same_bits(got, want, f"full tiles/{dtype}/given={given}/{form}")
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    wide = make_inputs([130], k + 16 // itemsize + 2, dtype, 14)[0]
    views = {"row stride % 16 B != 0": wide[:, :k],           # ld = k + 16 / itemsize + 2
             "base 1 element off": wide[:, 1: k + 1]}
    wide2 = make_inputs([130], k + 16 // itemsize, dtype, 15)[0]       # ld * itemsize % 16 == 0
    views["base 1 element off, aligned stride"] = wide2[:, 1: k + 1]
    for label, view in views.items():
        for scale in (None, np.array([3.0], np.float32)):
            got = cugrouped.multi_pad_cast_transpose([view], scale=scale, column_sums=True,
                                                     backend="emulate")
            want = reference.multi_pad_cast_transpose([np.ascontiguousarray(view)], scale=scale,
                                                      column_sums=True)
            assert_same_bits(got, want, f"{label}/{dtype}/scale={scale}")


def test_row_stride_larger_than_k():
    base = make_inputs([30], 80, "float32", 3)[0]
    view = base[:, :48]          # rows 80 elements apart, 48 used
    got = cugrouped.multi_pad_cast_transpose([view, base[:7, 16:64]], backend="emulate")
    want = reference.multi_pad_cast_transpose([np.ascontiguousarray(view),
                                               np.ascontiguousarray(base[:7, 16:64])])
    assert_same_bits(got, want)


def test_row_stride_of_a_two_row_input():
    """Only a single row has no row stride of its own (its width stands in): two rows of a wider
    array are read ``ld`` apart."""
    base = make_inputs([6], 80, "float32", 5)[0]
    xs = [base[:2, :48], base[2:3, 8:56], base[3:5, 16:64]]
    got = cugrouped.multi_pad_cast_transpose(xs, backend="emulate")
    assert_same_bits(got, reference.multi_pad_cast_transpose([np.ascontiguousarray(x)
                                                              for x in xs]))


def test_row_stride_larger_than_k_with_device_splits():
    """With device counts the blocks get one base pointer and its row stride (not ``k``)."""
    base = make_inputs([30], 80, "float32", 3)[0]
    view = base[:, :48]          # rows 80 elements apart, 48 used
    got = cugrouped.multi_pad_cast_transpose(view, np.array([12, 0, 18], np.int64),
                                             splits_on_device=True, backend="emulate")
    want = reference.multi_pad_cast_transpose(np.ascontiguousarray(view), [12, 0, 18])
    assert_same_bits(got, want)


# ------------------------------------------------------------------------------------------------
# Planning is pure and runs without any array.

def test_planning_pure_functions():
    assert pct.padded_splits([0, 1, 16, 17], 16) == (0, 16, 16, 32)
    assert pct.padded_splits([5, 7], 1) == (5, 7)
    # at least one tile row, 64-row x 128-column tiles over the padded rows
    assert pct.tile_counts([0, 64, 65], 129, 16) == (2, 2, 4)   # tiles_k = 2
    plans = pct.plan_launches([1] * 130, 16, 16, max_experts=64)
    assert [(p.first, p.count) for p in plans] == [(0, 64), (64, 64), (128, 2)]
    assert plans[0].tile_start[:3] == (0, 1, 2) and plans[2].grid == 2


def test_tile_counts_and_chunks_follow_the_documented_rule():
    """Tiles per expert = max(1, ceil(m_pad / 64)) * ceil(k / 128), k on both sides of whole
    tiles; each chunk's tile offsets are the prefix sums of its own experts' tiles, its grid
    their sum."""
    rng = np.random.default_rng(1)
    m = [int(v) for v in rng.integers(0, 300, 150)] + [0, 64, 65, 128]
    for k in (1, 127, 128, 129, 256, 384, 1000):
        for align in (1, 16, 128):
            want = [max(1, math.ceil(math.ceil(v / align) * align / 64)) * math.ceil(k / 128)
                    for v in m]
            assert pct.tile_counts(m, k, align) == tuple(want), (k, align)
            plans = pct.plan_launches(m, k, align, max_experts=64)
            assert [(p.first, p.count) for p in plans] == [(0, 64), (64, 64), (128, 26)]
            for p in plans:
                own = want[p.first:p.first + p.count]
                assert p.tile_start == tuple(itertools.accumulate(own, initial=0))
                assert p.grid == sum(own)


def _layout_asserts(offsets: bool) -> str:
    dt = pct.group_dtype()
    lines = [f"static_assert(sizeof(cg::PctGroup) == {dt.itemsize}, \"sizeof\");",
             "static_assert(alignof(cg::PctGroup) == 8, \"alignof\");"]
    for name in dt.names if offsets else ():
        field = {"in": "in"}.get(name, name)
        lines.append(f"static_assert(__builtin_offsetof(cg::PctGroup, {field}) == {dt.fields[name][1]}, "
                     f"\"{name}\");")
    return "\n".join(lines)


def test_group_struct_layout_matches_on_host_and_device():
    """The NumPy twin of cg::PctGroup has the C++ layout: every offset under g++ (x86-64), size and
    alignment under NVRTC (nvptx64, whose NVRTC has no offsetof; the data layout of pointers,
    int64 and int32 is the same on both)."""
    from cupy.cuda.compiler import _NVRTCProgram

    from cugrouped import _compile_check, emulate

    dt = pct.group_dtype()
    # the 4 KB kernel parameter limit: the block, k, 4 x 4-byte scalars, 7 pointers, 1 flag
    assert dt.itemsize + 8 + 4 * 4 + 7 * 8 + 4 < 4096
    probe = '#include "pad_cast_transpose.cu"\n{}\n__global__ void layout_probe() {{}}\n'
    spec = pct.KERNEL_SPEC
    opts = tuple(o for o in _compile_check.offline_options(spec, "90", verbose_ptxas=False))
    _NVRTCProgram(probe.format(_layout_asserts(False)), "layout.cu", name_expressions=["layout_probe"],
                  method="cubin").compile(opts)
    emulate.EmuModule(code=probe.format(_layout_asserts(True)), name_expressions=("layout_probe",))
    kern = emulate.EmuModule(path=spec.source, name_expressions=spec.name_expressions).get_function(
        spec.name_expressions[0])
    assert kern.param_sizes[0] == dt.itemsize


# ------------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, nothing written.

@pytest.mark.parametrize("call,exc,match", [
    (lambda x: cugrouped.multi_pad_cast_transpose(x, fp8_format="e3m4"), ValueError, "fp8_format"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, align=0), ValueError, "align"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, margin=-1), ValueError, "margin"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, backend="gpu"), ValueError, "backend"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, backend="cuda"), ValueError, "backend"),
    (lambda x: cugrouped.multi_pad_cast_transpose([], backend="emulate"), ValueError, "inputs"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x[0]), ValueError, "m_splits"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x[0], [3, 3]), ValueError, "m_splits"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x[0], [-1, 11]), ValueError, "m_splits"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x[0], [2.5, 7.5]), TypeError, "m_splits"),
    (lambda x: cugrouped.multi_pad_cast_transpose([x[0], x[1][:, :8]]), ValueError, r"inputs\[1\].*k="),
    (lambda x: cugrouped.multi_pad_cast_transpose([x[0], x[1].astype(np.float16)]), TypeError, r"inputs\[1\]"),
    (lambda x: cugrouped.multi_pad_cast_transpose([x[0].astype(np.int32)]), TypeError, "inputs"),
    (lambda x: cugrouped.multi_pad_cast_transpose([x[0].astype(np.uint16)], dtype="bf16"), TypeError,
     r"inputs\[0\]: dtype='bf16' is not a dtype tag; expected one of \['bfloat16', 'float16'"),
    (lambda x: cugrouped.multi_pad_cast_transpose([x[0].T]), ValueError, "row-major"),
    (lambda x: cugrouped.multi_pad_cast_transpose([x[0].reshape(-1)]), ValueError, "2-D"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, scale=np.ones(3, np.float32)), ValueError, "scale"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, scale=np.ones(2, np.float64)), ValueError, "scale"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, scale=np.ones(4, np.float32)[::2]), ValueError,
     "scale: expected a contiguous"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, rowwise=False, columnwise=False), ValueError, "rowwise"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, out={"data": 1}), TypeError, "out"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x[0], np.array([4, 6], np.int32), splits_on_device=True,
                                                  backend="emulate"), TypeError, "int64"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, np.array([4, 6]), splits_on_device=True),
     ValueError, "single inputs array"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x[0], np.array([4, 0, 6, 0], np.int64)[::2],
                                                  splits_on_device=True, backend="emulate"),
     TypeError, "m_splits: a count array read by the kernel must be a contiguous"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x[0], np.zeros(0, np.int64),
                                                  splits_on_device=True, backend="emulate"),
     ValueError, "m_splits: expected at least one expert"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, [0, 10]), ValueError,
     r"m_splits: must be None \(or equal the row counts\) when inputs is a list"),
    (lambda x: cugrouped.multi_pad_cast_transpose([np.ones((3, 0), np.float32)]), ValueError,
     "inputs: expected k >= 1 columns, got 0"),
    (lambda x: cugrouped.multi_pad_cast_transpose(
        [np.lib.stride_tricks.as_strided(x[0], shape=(5, 16), strides=(32, 4))]), ValueError,
     r"inputs\[0\]: expected rows with unit column stride"),     # rows 8 apart overlap
    (lambda x: cugrouped.multi_pad_cast_transpose(x, amax_accumulate=True, out=cugrouped.multi_pad_cast_transpose(
        x, backend="emulate")), ValueError, r"amax_accumulate: needs a given scale"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, scale=np.ones(2, np.float32), amax_accumulate=True),
     ValueError, r"amax_accumulate: needs out="),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, scale=np.ones(2, np.float32), amax_accumulate=1),
     TypeError, "amax_accumulate"),
    (lambda x: reference.multi_pad_cast_transpose(x, amax_accumulate=True), ValueError, "amax_accumulate"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, amax_epsilon=-1e-3), ValueError, "amax_epsilon"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, amax_epsilon=1e-40), ValueError, "amax_epsilon"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, amax_epsilon=1e39), ValueError, "amax_epsilon"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, amax_epsilon=float("nan")), ValueError, "amax_epsilon"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, amax_epsilon="1e-3"), TypeError, "amax_epsilon"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, power_2_scale=1), TypeError, "power_2_scale"),
    (lambda x: cugrouped.multi_pad_cast_transpose(x, scale=np.ones(2, np.float32), power_2_scale=True),
     ValueError, r"current scaling \(scale=None\)"),
    (lambda x: reference.multi_pad_cast_transpose(x, scale=np.ones(2, np.float32), amax_epsilon=1.0),
     ValueError, "amax_epsilon"),
    (lambda x: reference.multi_pad_cast_transpose(x, scale=np.ones(2, np.float32), amax_accumulate=True),
     ValueError, "amax_accumulate"),
])
def test_bad_input_is_rejected_clearly(call, exc, match):
    xs = [np.ones((10, 16), np.float32), np.ones((0, 16), np.float32)]
    with pytest.raises(exc, match=match):
        call(xs)


@pytest.mark.parametrize("op", ["multi_pad_cast_transpose", "multi_block_cast_transpose",
                                "multi_mxfp8_cast_transpose"])
@pytest.mark.parametrize("flag", ["rowwise", "columnwise", "column_sums"])
def test_cast_flags_must_be_bools(op, flag):
    """Not anything with a truth value: rowwise="no" used to mean True. NumPy bools are bools;
    the torch front checks the same before sizing its outputs."""
    x = np.ones((32, 32), np.float32)
    for bad in ("no", 1, None):
        with pytest.raises(TypeError, match=rf"^{flag}: expected a bool, got {bad!r}$"):
            getattr(cugrouped, op)(x, [32], **{flag: bad})
    assert getattr(cugrouped, op)(x, [32], **{flag: np.bool_(True)}).k == 32
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=rf"^{flag}: expected a bool, got 'no'$"):
        getattr(cugrouped, op)(torch.from_numpy(x), [32], **{flag: "no"})


def test_bad_out_buffer_is_rejected_before_anything_is_written():
    xs = [np.ones((10, 16), np.float32)]
    out = cugrouped.multi_pad_cast_transpose(xs, backend="emulate")
    out.data_t = np.zeros(3, np.uint8)
    data_before = np.asarray(out.data).view(np.uint8).copy()
    xs2 = [np.full((10, 16), 2.0, np.float32)]
    with pytest.raises(ValueError, match="out.data_t"):
        cugrouped.multi_pad_cast_transpose(xs2, backend="emulate", out=out)
    assert np.array_equal(np.asarray(out.data).view(np.uint8), data_before)


@pytest.mark.parametrize("name,bad,given", [
    ("data", lambda b: np.zeros(b.shape, np.float16), True),            # 2-byte items
    ("amax", lambda b: b.astype(np.float64), False),                    # 8-byte items
    ("amax", lambda b: np.zeros(2 * b.size, np.float32)[::2], False),   # not contiguous
    ("scale_inv", lambda b: np.zeros(2 * b.size, np.float32)[::2], True),
    ("scale", lambda b: None, False),           # current scaling writes out.scale
    ("scale", lambda b: b[:-1], False),
])
def test_every_out_buffer_is_checked_before_anything_is_written(name, bad, given):
    """Each buffer ``out`` lends must have the shape, item size and layout the kernels write:
    a wrong one is refused naming it, before any buffer is touched."""
    xs = make_inputs([10, 0, 22], 32, "float32", 6)
    scale = np.ones(3, np.float32) if given else None
    out = cugrouped.multi_pad_cast_transpose(xs, scale=scale, backend="emulate")
    out = dataclasses.replace(out, **{name: bad(np.asarray(getattr(out, name)))})
    before = {n: np.asarray(getattr(out, n)).view(np.uint8).copy() for n in ("data", "data_t")
              if n != name}
    with pytest.raises(ValueError, match=rf"^out\.{name}: "):
        cugrouped.multi_pad_cast_transpose([x * 2 for x in xs], scale=scale, out=out,
                                           backend="emulate")
    for n, b in before.items():
        assert np.array_equal(np.asarray(getattr(out, n)).view(np.uint8), b), n


@pytest.mark.parametrize("backend", ["reference", "emulate"])
def test_out_with_another_given_scale_casts_with_the_given_scale(backend):
    """``out`` lends buffers only: a given ``scale`` is this call's (delayed scaling changes it
    every step), not the one ``out`` holds from an earlier call."""
    m_splits, k = [10, 0, 22], 32
    xs = make_inputs(m_splits, k, "float32", 4)
    first = cugrouped.multi_pad_cast_transpose(xs, scale=np.full(3, 2.0, np.float32),
                                               backend=backend)
    scale = scales_for(m_splits, "e4m3", 9)
    again = cugrouped.multi_pad_cast_transpose(xs, scale=scale, out=first, backend=backend)
    assert np.array_equal(again.scale, scale)
    assert_same_bits(again, reference.multi_pad_cast_transpose(xs, scale=scale))


def test_margin_range_includes_64():
    """``margin`` is documented as an int in [0, 64]: both ends are accepted, 65 is refused."""
    xs = make_inputs([10, 0, 22], 32, "float32", 7)
    for margin in (0, 64):
        got = cugrouped.multi_pad_cast_transpose(xs, margin=margin, backend="emulate")
        assert_same_bits(got, reference.multi_pad_cast_transpose(xs, margin=margin), str(margin))
    with pytest.raises(ValueError, match=r"^margin: expected an int in \[0, 64\], got 65$"):
        cugrouped.multi_pad_cast_transpose(xs, margin=65, backend="emulate")


# ------------------------------------------------------------------------------------------------
# amax_accumulate: the cast max-merges each expert's amax into out.amax (a pending amax that
# several forwards fill before one scale update), in the same single launch.

# old amaxes already in the buffer: ordinary, 0, NaN (replaced), denormal and -0 (count as 0),
# inf and a huge value (kept), a negative value (replaced)
OLD_AMAX = np.array([2.5, 0.0, np.nan, 1e-40, -0.0, np.inf, 3e38, -7.0, 1e-3, 1e4],
                    dtype=np.float32)
ACC_SPLITS = ("empty_first", "empty_middle", "empty_last", "skewed", "single", "count_one",
              "full_tiles")


def _old_amax(E, seed):
    old = np.roll(np.resize(OLD_AMAX, E), seed).astype(np.float32)
    if not (old > 1e3).any():
        old[seed % E] = 3e38          # at least one expert keeps its old amax
    return old


def _accumulate(backend, xs, m_splits, form, scale, old, **kw):
    """A first cast (plain) gives the out buffers; out.amax is set to ``old``; then a second cast
    with amax_accumulate merges into it."""
    args = (xs, None) if form == "list" else (np.concatenate(xs, axis=0), list(m_splits))
    dev = dict(splits_on_device=True) if form == "device" else {}
    if form == "device":
        args = (args[0], np.array(m_splits, np.int64))
    out = cugrouped.multi_pad_cast_transpose(*args, scale=scale, backend=backend, **dev, **kw)
    out.amax[...] = old
    res = cugrouped.multi_pad_cast_transpose(*args, scale=scale, out=out, backend=backend,
                                             amax_accumulate=True, **dev, **kw)
    assert res.amax is out.amax
    return res


@pytest.mark.parametrize("split", ACC_SPLITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_amax_accumulate_emulated_matches_reference(split, dtype):
    m_splits, xs, scale = case_data(split, dtype, "e4m3", True)
    form = ("list", "tensor", "device")[zlib.crc32(split.encode()) % 3]
    order = ORDERS[zlib.crc32((split + dtype).encode()) % len(ORDERS)]
    old = _old_amax(len(m_splits), len(split))
    want = _accumulate("reference", xs, m_splits, "list", scale, old, column_sums=True)
    with cugrouped.emulation_order(order):
        got = _accumulate("emulate", xs, m_splits, form, scale, old, column_sums=True)
    assert_same_bits(got, want, f"{split}/{dtype}/{form}/{order}")
    fresh = np.array([reference.amax_of(x) for x in xs], np.float32)
    np.testing.assert_array_equal(want.amax, reference.merge_amax(old, fresh))
    for i, m in enumerate(m_splits):   # an expert without tokens contributes 0: old >= 0 is kept
        if m == 0 and old[i] >= 0 and np.isfinite(old[i]) and reference.ftz(old[i]) == old[i]:
            assert as_bits(got.amax[i]) == as_bits(old[i]), i


def test_merge_amax_is_fmax_with_ftz_and_nan_dropped():
    old = np.float32([2.0, 1.0, np.nan, 1e-40, -0.0, np.inf, -1.0, 0.0])
    new = np.float32([1.0, 3.0, 0.5, 0.0, 0.0, 5.0, 0.0, 0.0])
    got = reference.merge_amax(old, new)
    np.testing.assert_array_equal(as_bits(got), as_bits(np.float32([2.0, 3.0, 0.5, 0.0, 0.0, np.inf,
                                                                     0.0, 0.0])))
    normal = np.isfinite(old) & (np.abs(old) >= np.finfo(np.float32).tiny)
    np.testing.assert_array_equal(got[normal], np.fmax(old, new)[normal])


def test_amax_accumulate_over_two_casts_and_more_experts_than_one_launch():
    """Two forwards merge into one pending amax; 70 experts take two launches (sliced amax)."""
    m_splits = [int(v) for v in np.random.default_rng(3).integers(0, 9, 70)]
    m_splits[0] = m_splits[69] = 0
    xs1 = make_inputs(m_splits, 32, "bfloat16", 1)
    xs2 = make_inputs(m_splits, 32, "bfloat16", 2)
    scale = scales_for(m_splits, "e4m3", 1)
    outs = {}
    for backend in ("reference", "emulate"):
        out = cugrouped.multi_pad_cast_transpose(xs1, scale=scale, backend=backend)
        out.amax[...] = 0.0              # what the scale update leaves (reset_amax)
        for xs in (xs1, xs2):
            with cugrouped.record_launches() as log:
                cugrouped.multi_pad_cast_transpose(xs, scale=scale, out=out, backend=backend,
                                                   amax_accumulate=True)
            if backend == "emulate":
                assert [launch.kernel.split("PctMode::")[1] for launch in log] == ["CAST_AMAX>"] * 2
        outs[backend] = out.amax.copy()
    a1 = np.array([reference.amax_of(x) for x in xs1], np.float32)
    a2 = np.array([reference.amax_of(x) for x in xs2], np.float32)
    np.testing.assert_array_equal(as_bits(outs["emulate"]), as_bits(outs["reference"]))
    np.testing.assert_array_equal(outs["emulate"], np.maximum(a1, a2))


@pytest.mark.parametrize("form", ["list", "device"])
def test_amax_accumulate_into_zero_like_old_values_gives_the_new_amax(form):
    """An old amax that counts as 0 (-0, a denormal of either sign) met by a new amax of 0 (an
    expert without rows, or all zeros): the merge keeps the old value only when it is larger
    after FTZ, so the result is the new +0 (the reference's bits), not the -0 or denormal that
    was there. The matrix above never puts such an old value on an empty or all-zero expert."""
    den = np.float32(1e-40)
    old = np.array([-0.0, den, -den, -0.0, den, np.nan, -0.0], np.float32)
    m_splits = [0, 0, 0, 9, 4, 0, 6]
    xs = make_inputs(m_splits, 32, "float32", 3)
    xs[3][...] = 0.0
    xs[4][...] = -0.0
    scale = scales_for(m_splits, "e4m3", 4)
    want = _accumulate("reference", xs, m_splits, "list", scale, old)
    got = _accumulate("emulate", xs, m_splits, form, scale, old)
    assert_same_bits(got, want, form)
    assert as_bits(got.amax)[:6].tolist() == [0] * 6 and got.amax[6] > 0


def test_amax_accumulate_is_still_one_launch():
    """Delayed scaling with a pending amax: one CAST_AMAX launch, nothing else (the torch layer
    used to add a torch.maximum launch per cast)."""
    xs = make_inputs([5, 0, 9], 32, "float32", 2)
    scale = np.ones(3, np.float32)
    out = cugrouped.multi_pad_cast_transpose(xs, scale=scale, column_sums=True, backend="emulate")
    for cs in (False, True):
        with cugrouped.record_launches() as log:
            cugrouped.multi_pad_cast_transpose(xs, scale=scale, out=out, column_sums=cs,
                                               amax_accumulate=True, backend="emulate")
        assert [launch.kernel.split("PctMode::")[1] for launch in log] == (
            ["CAST_AMAX, true>"] if cs else ["CAST_AMAX>"])


@pytest.mark.gpu
@pytest.mark.parametrize("split", ACC_SPLITS)
@pytest.mark.parametrize("form", ["list", "device"])
def test_cuda_amax_accumulate_matches_reference(split, form):
    import cupy

    m_splits, xs, scale = case_data(split, "bfloat16", "e4m3", True)
    old = _old_amax(len(m_splits), len(split))
    want = _accumulate("reference", xs, m_splits, "list", scale, old)
    dxs = [cupy.asarray(x.view(np.uint16)) for x in xs]
    splits = None
    if form == "device":
        dxs, splits = cupy.concatenate(dxs, axis=0), cupy.asarray(np.array(m_splits, np.int64))
    out = cugrouped.multi_pad_cast_transpose(dxs, splits, dtype="bfloat16",
                                             scale=cupy.asarray(scale))
    out.amax[...] = cupy.asarray(old)
    got = cugrouped.multi_pad_cast_transpose(dxs, splits, dtype="bfloat16", scale=out.scale,
                                             out=out, amax_accumulate=True)
    host = cugrouped.GroupedFP8(**{f: (cupy.asnumpy(v) if isinstance(v, cupy.ndarray) else v)
                                   for f, v in vars(got).items()})
    assert_same_bits(host, want, f"cuda accumulate {split}/{form}")


# ------------------------------------------------------------------------------------------------
# Fused MoE permute: row_index gathers the experts' rows from the token matrix.

def _routing(tokens, m_splits, seed, dropped=3):
    """Row indices as a top-k router gives them (tokens repeated across experts), with a few
    negative entries (zero rows: capacity padding)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, tokens, sum(m_splits)).astype(np.int64)
    idx[rng.choice(idx.size, min(dropped, idx.size), replace=False)] = -1
    return idx


def _permuted(tokens, idx):
    """The permute a framework runs first (a gather copy), for comparison."""
    t = np.asarray(tokens)
    rows = np.where((idx >= 0)[:, None], t[np.maximum(idx, 0)].astype(np.float32), np.float32(0))
    return rows.astype(t.dtype)


GATHER_CASES = [(m, d, f, given, form)
                for m in ([7, 0, 70, 13], [0, 0], [129, 64, 1])
                for d in DTYPES for f in ("e4m3", "e5m2") for given in (True, False)
                for form in ("host", "device")]


@pytest.mark.parametrize("m_splits,dtype,fmt,given,form", GATHER_CASES,
                         ids=["-".join(map(str, c)) for c in GATHER_CASES])
def test_gather_equals_permute_then_cast(m_splits, dtype, fmt, given, form):
    """``row_index``: the emulated kernel gathers each expert's rows from the token matrix and
    gives the reference's bits, which are the bits of casting the permuted copy."""
    T, k = 40, 144
    tokens = make_inputs([T], k, dtype, seed=len(m_splits))[0]
    idx = _routing(T, m_splits, seed=sum(m_splits))
    scale = scales_for(m_splits, fmt, 2) if given else None
    kw = dict(fp8_format=fmt, scale=scale, column_sums=True)
    want = reference.multi_pad_cast_transpose(_permuted(tokens, idx), m_splits, **kw)
    assert_same_bits(reference.multi_pad_cast_transpose(tokens, m_splits, row_index=idx, **kw),
                     want, "reference")
    splits = np.array(m_splits, np.int64) if form == "device" else m_splits
    got = cugrouped.multi_pad_cast_transpose(tokens, splits, row_index=idx, backend="emulate",
                                             splits_on_device=form == "device" or None, **kw)
    assert_same_bits(got, want, form)


def test_gather_over_several_launches_and_strided_tokens():
    """More experts than one launch holds (two argument blocks, each with its row offsets), and a
    token matrix whose row stride is larger than k."""
    m_splits = [3, 0, 17] * 30
    T, k = 33, 48
    wide = make_inputs([T], 80, "bfloat16", seed=4)[0]
    tokens = wide[:, 16:16 + k]
    idx = _routing(T, m_splits, seed=5)
    want = reference.multi_pad_cast_transpose(_permuted(tokens, idx), m_splits)
    got = cugrouped.multi_pad_cast_transpose(tokens, m_splits, row_index=idx, backend="emulate")
    assert_same_bits(got, want, "chunks")


@pytest.mark.parametrize("backend", ["emulate", "reference"])
def test_gather_from_no_tokens_gives_zero_rows(backend):
    """A token matrix without rows (a rank that received nothing) and only padding indices."""
    tokens = np.zeros((0, 48), np.float32)
    got = cugrouped.multi_pad_cast_transpose(tokens, [2, 3], row_index=np.full(5, -1, np.int64),
                                             backend=backend, column_sums=True)
    want = reference.multi_pad_cast_transpose(np.zeros((5, 48), np.float32), [2, 3],
                                              column_sums=True)
    assert_same_bits(got, want, backend)


@pytest.mark.parametrize("form", ["host", "device"])
def test_gather_index_past_the_tokens_reads_a_zero_row(monkeypatch, form):
    """Device indices cannot be checked on the host (that would need a sync): the kernel reads an
    index >= the token rows as a zero row, as it reads a negative one. The emulator's host
    indices are refused first, so the host check is lifted here to reach the kernel's rule; the
    tokens are the front of a larger matrix, so reading row T (one past the last) would show."""
    monkeypatch.setattr(_cast_inputs, "_check_row_index",
                        lambda row_index, view: _cast_inputs.as_view(row_index, arg="row_index"))
    T, k, m_splits = 40, 144, [7, 0, 70, 13]
    rows = make_inputs([T + 1], k, "bfloat16", seed=12)[0]
    tokens = rows[:T]
    idx = _routing(T, m_splits, seed=13)
    idx[[0, 9, 40, 89]] = [T, T + 1, 2**40, T]
    valid = (idx >= 0) & (idx < T)
    permuted = np.where(valid[:, None], tokens[np.where(valid, idx, 0)].astype(np.float32), 0)
    want = reference.multi_pad_cast_transpose(permuted.astype(tokens.dtype), m_splits,
                                              column_sums=True)
    splits = np.array(m_splits, np.int64) if form == "device" else m_splits
    got = cugrouped.multi_pad_cast_transpose(tokens, splits, row_index=idx, backend="emulate",
                                             splits_on_device=form == "device" or None,
                                             column_sums=True)
    assert_same_bits(got, want, form)


@pytest.mark.parametrize("call,exc,match", [
    (lambda t, i: cugrouped.multi_pad_cast_transpose([t], [5], row_index=i), ValueError,
     "row_index: gathers rows of a single"),
    (lambda t, i: cugrouped.multi_pad_cast_transpose(t, None, row_index=i), ValueError, "m_splits"),
    (lambda t, i: cugrouped.multi_pad_cast_transpose(t, [2, 2], row_index=i), ValueError,
     "m_splits: counts sum to 4 but row_index has 5"),
    (lambda t, i: cugrouped.multi_pad_cast_transpose(t, [5], row_index=i.astype(np.int32)),
     TypeError, "row_index: expected a contiguous 1-D int64"),
    (lambda t, i: cugrouped.multi_pad_cast_transpose(t, [5], row_index=i + 8), ValueError,
     "row_index: indices must be below the 10 rows"),
    (lambda t, i: cugrouped.multi_pad_cast_transpose(t, [5], row_index=i + 6), ValueError,
     "row_index: indices must be below the 10 rows .* got 10$"),
    (lambda t, i: cugrouped.multi_pad_cast_transpose(t, [5], row_index=i[::-1]), TypeError,
     "row_index: expected a contiguous"),
])
def test_gather_bad_input(call, exc, match):
    tokens, idx = np.ones((10, 16), np.float32), np.arange(5, dtype=np.int64)
    with pytest.raises(exc, match=match):
        call(tokens, idx)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["host", "device"])
@pytest.mark.parametrize("given", [True, False])
def test_cuda_gather_matches_reference(form, given):
    import cupy

    m_splits, T, k = [7, 0, 70, 13, 200], 150, 256
    tokens = make_inputs([T], k, "bfloat16", seed=9)[0]
    idx = _routing(T, m_splits, seed=10)
    scale = scales_for(m_splits, "e4m3", 2) if given else None
    want = reference.multi_pad_cast_transpose(tokens, m_splits, row_index=idx, scale=scale,
                                              column_sums=True)
    splits = cupy.asarray(np.array(m_splits, np.int64)) if form == "device" else m_splits
    got = cugrouped.multi_pad_cast_transpose(
        cupy.asarray(tokens.view(np.uint16)), splits, dtype="bfloat16", row_index=cupy.asarray(idx),
        scale=cupy.asarray(scale) if given else None, column_sums=True)
    host = cugrouped.GroupedFP8(**{f: (cupy.asnumpy(v) if isinstance(v, cupy.ndarray) else v)
                                   for f, v in vars(got).items()})
    assert_same_bits(host, want, f"cuda gather {form}")


# ------------------------------------------------------------------------------------------------
# Current scaling's options (TransformerEngine's QParams): amax_epsilon, power_2_scale.

SCALE_OPTIONS = [(0.0, True), (1e-3, False), (0.5, True), (3e3, False)]


@pytest.mark.parametrize("eps,power_2", SCALE_OPTIONS)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_scale_options_emulated_match_reference(eps, power_2, fmt):
    """The amax pass computes the scale with the options on the device: the emulated kernel and
    the reference agree bit for bit (an empty expert, an all-zero one and one of tiny values
    included: those are where amax_epsilon matters)."""
    m_splits = [37, 0, 16, 70, 5]
    xs = make_inputs(m_splits, 48, "bfloat16", seed=11)
    xs[2] = np.zeros_like(xs[2])
    xs[4] = (xs[4].astype(np.float32) * np.float32(2.0 ** -20)).astype(xs[4].dtype)
    kw = dict(fp8_format=fmt, amax_epsilon=eps, power_2_scale=power_2, column_sums=True)
    want = reference.multi_pad_cast_transpose(xs, **kw)
    got = cugrouped.multi_pad_cast_transpose(xs, backend="emulate", **kw)
    assert_same_bits(got, want, f"{eps}/{power_2}")
    plain = reference.multi_pad_cast_transpose(xs, fp8_format=fmt)
    fmax = np.float32(reference.fp8.FP8_MAX[fmt])
    for e in range(len(m_splits)):
        s = want.scale[e]
        if power_2:
            assert s == np.exp2(np.floor(np.log2(s))), (e, s)
        below = plain.amax[e] < np.float32(eps)
        if eps and below:     # empty, all-zero and tiny experts: fp8_max / epsilon
            assert s == reference.fp8.compute_scale(np.float32(eps), fmt, 0, 0.0, power_2), e
            assert s == (np.exp2(np.floor(np.log2(fmax / np.float32(eps)))) if power_2
                         else np.float32(fmax / np.float32(eps)))
        elif not power_2:     # otherwise the options change nothing
            assert s == plain.scale[e], e
    # power_2_scale: scale_inv is the exact reciprocal, so x * scale * scale_inv == x exactly
    if power_2:
        assert (want.scale * want.scale_inv == 1).all()


@pytest.mark.gpu
@pytest.mark.parametrize("eps,power_2", SCALE_OPTIONS)
def test_cuda_scale_options_match_reference(eps, power_2):
    import cupy

    m_splits = [37, 0, 16, 70, 5]
    xs = make_inputs(m_splits, 48, "float32", seed=11)
    xs[2] = np.zeros_like(xs[2])
    kw = dict(amax_epsilon=eps, power_2_scale=power_2, column_sums=True)
    want = reference.multi_pad_cast_transpose(xs, **kw)
    got = cugrouped.multi_pad_cast_transpose([cupy.asarray(x) for x in xs], **kw)
    host = cugrouped.GroupedFP8(**{f: (cupy.asnumpy(v) if isinstance(v, cupy.ndarray) else v)
                                   for f, v in vars(got).items()})
    assert_same_bits(host, want, f"cuda options {eps}/{power_2}")


# ------------------------------------------------------------------------------------------------
# The same matrix on a GPU (skipped here; run by scripts/gpu_check.sh).

@pytest.mark.gpu
@pytest.mark.parametrize("split,dtype,fmt,given,align,form,order", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_cuda_matches_reference(split, dtype, fmt, given, align, form, order):
    import cupy

    m_splits, xs, scale = case_data(split, dtype, fmt, given)
    dxs, splits, tag = device_inputs(xs, m_splits, form, dtype)
    want = reference.multi_pad_cast_transpose(xs, fp8_format=fmt, align=align, scale=scale,
                                              column_sums=True)
    got = cugrouped.multi_pad_cast_transpose(
        dxs, splits, fp8_format=fmt, align=align, dtype=tag,
        scale=cupy.asarray(scale) if given else None, column_sums=True)
    host = cugrouped.GroupedFP8(**{f: (cupy.asnumpy(v) if isinstance(v, cupy.ndarray) else v)
                                   for f, v in vars(got).items()})
    assert_same_bits(host, want, f"cuda {split}/{dtype}/{fmt}")


@pytest.mark.gpu
def test_cuda_large_case_over_2_31_elements():
    """An expert of more than 2^31 elements (its in-kernel offsets, row-wise ``row * k + col`` and
    transposed ``col * m_pad + row``, pass 2^31) and experts that start past 2^31 elements, with
    host and with device splits (the kernel derives the offsets itself).

    The reference runs on 64-row blocks only (a block's row-wise bytes and its columns of the
    transposed copy depend on nothing but its rows and the expert's scale): the whole expert on
    the host took minutes of the GPU check. Amax and scale are checked per expert against CuPy's
    max and the reference's compute_scale."""
    import cupy

    k = 8192
    edge = 2**31 // k                      # expert 1's row where row * k reaches 2^31
    big = edge + 69                        # > 2^31 elements, not a multiple of 16 or 64
    m_splits = [77, big, 0, 3 * 64 + 1]
    off = np.concatenate([[0], np.cumsum(m_splits)])
    rows = int(off[-1])
    need = rows * k * (4 + 2 + 2 * 2) + (1 << 30)   # f32 draw, f16 input, two casts' outputs
    free = cupy.cuda.runtime.memGetInfo()[0]
    if need > 0.9 * free:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of GPU memory, {free / 2**30:.0f} GiB free")
    pool = cupy.get_default_memory_pool()
    try:
        x = cupy.random.standard_normal((rows, k), dtype=cupy.float32).astype(cupy.float16)
        got = cugrouped.multi_pad_cast_transpose(x.view(cupy.uint16), m_splits, dtype="float16")
        dev = cugrouped.multi_pad_cast_transpose(
            x.view(cupy.uint16), cupy.asarray(np.array(m_splits, np.int64)), dtype="float16")
        assert bool(cupy.array_equal(dev.data, got.data)), "device splits: data"
        assert bool(cupy.array_equal(dev.data_t[: got.data_t.size], got.data_t)), "device: data_t"
        for f in ("amax", "scale", "scale_inv"):
            assert bool(cupy.array_equal(getattr(dev, f).view(cupy.uint32),
                                         getattr(got, f).view(cupy.uint32))), f"device splits: {f}"
        del dev
        amax, scale, scale_inv = (cupy.asnumpy(getattr(got, f)) for f in ("amax", "scale", "scale_inv"))
        for e, m in enumerate(m_splits):
            want = np.float32(float(cupy.abs(x[off[e]:off[e + 1]]).max()) if m else 0.0)
            assert amax[e] == want, f"expert {e} amax {amax[e]} != {want}"
            assert as_bits(scale[e:e + 1]) == as_bits(reference.fp8.compute_scale(want, "e4m3")), e
            assert as_bits(scale_inv[e:e + 1]) == as_bits(reference.fp8.scale_inverse(scale[e])), e
        # (expert, first row, rows): whole small experts; the big one's first block, the block
        # across row * k = 2^31, and its tail with the padding columns of the transposed copy
        blocks = [(0, 0, 77), (3, 0, 193), (1, 0, 64), (1, edge - 32, 64), (1, edge, 69)]
        for e, r0, n in blocks:
            host = cupy.asnumpy(x[off[e] + r0: off[e] + r0 + n])
            want = reference.multi_pad_cast_transpose([host], scale=scale[e:e + 1])
            label = f"expert {e} rows {r0}..{r0 + n}"
            assert np.array_equal(cupy.asnumpy(got.rowwise(e)[r0:r0 + n]),
                                  want.data.view(np.uint8)), label + " row-wise"
            w = want.m_pad_splits[0]
            assert r0 + w <= got.m_pad_splits[e]
            assert np.array_equal(cupy.asnumpy(got.columnwise(e)[:, r0:r0 + w]),
                                  want.columnwise(0)), label + " transposed"
        assert got.columnwise(2).shape == (k, 0)
    finally:
        x = got = dev = None
        pool.free_all_blocks()


def _denormal_case(dtype, given):
    """Inputs where the GPU's -ftz=true decides bytes: expert 0 holds float32 denormals only;
    expert 1 denormals among normals so small that the scale makes an unflushed denormal a
    non-zero FP8 value; expert 2 ordinary data (with a denormal scale when the scale is given)."""
    rng = np.random.default_rng(5)
    k = 48
    tiny = np.float32(np.finfo(np.float32).tiny)         # smallest normal, 2^-126
    den = lambda m: (rng.uniform(-1, 1, (m, k)) * tiny * 0.9).astype(np.float32)
    mixed = den(33)
    normal = rng.random(mixed.shape) < 0.3
    mixed[normal] = (rng.uniform(1, 4, normal.sum()) * 1e-35).astype(np.float32)
    xs = [den(20), mixed, rng.standard_normal((17, k)).astype(np.float32)]
    xs = [x.astype(DTYPES[dtype]) for x in xs]
    scale = np.array([1.0, 2.0**124, 1e-40], np.float32) if given else None
    return xs, scale


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("given", [False, True])
def test_cuda_flushes_float32_denormals_like_the_reference(dtype, given):
    """-ftz=true (design.md §7): a float32 denormal input counts as zero in the amax, the column
    sums and the cast, and a denormal scale casts everything to zero; what the hardware flushes
    is exactly what the emulator and the reference flush explicitly (emulation cannot show it)."""
    import cupy

    xs, scale = _denormal_case(dtype, given)
    carrier = {"bfloat16": np.uint16}.get(dtype)
    dxs = [cupy.asarray(x.view(carrier) if carrier else x) for x in xs]
    for fmt in ("e4m3", "e5m2"):
        want = reference.multi_pad_cast_transpose(xs, fp8_format=fmt, scale=scale, column_sums=True)
        got = cugrouped.multi_pad_cast_transpose(
            dxs, fp8_format=fmt, dtype=dtype if carrier else None, column_sums=True,
            scale=None if scale is None else cupy.asarray(scale))
        host = cugrouped.GroupedFP8(**{f: (cupy.asnumpy(v) if isinstance(v, cupy.ndarray) else v)
                                       for f, v in vars(got).items()})
        assert_same_bits(host, want, f"denormals {dtype}/{fmt}/given={given}")
        assert want.amax[0] == 0 and (given or want.scale[0] == 1)


def nan_case(dtype):
    """Column sums that are NaN, as the GPU writes them (0x7FFFFFFF, whatever the operands): in
    every expert column 0 holds a -NaN with a payload, column 1 +inf and -inf, column 2 +inf
    only, column 3 a +NaN in the last row, column 131 (the second column tile of the block
    casts) -inf and +inf; expert 1 has a single row (its sums take no addition between rows)
    and expert 2 none."""
    k = 160
    rng = np.random.default_rng(9)
    xs = []
    for m in (70, 1, 0, 33):
        x = rng.standard_normal((m, k)).astype(np.float32)
        if m:
            x[m // 2, 0] = np.array([0xFFC00001], np.uint32).view(np.float32)[0]
            x[0, 1], x[-1, 1] = np.inf, -np.inf
            x[m // 3, 2] = np.inf
            x[-1, 3] = np.nan
            x[0, 131], x[-1, 131] = -np.inf, np.inf
        xs.append(x.astype(DTYPES[dtype]))
    return xs


def assert_gpu_nan_column_sums(sums, xs):
    """Every column sum that is NaN has the GPU's bits 0x7FFFFFFF (there are some in every
    non-empty expert); infinite and finite ones are as the float64 sums say."""
    for e, x in enumerate(xs):
        got = np.asarray(sums[e], np.float32)
        with np.errstate(invalid="ignore"):
            exact = np.asarray(x, np.float64).sum(axis=0)
        nan = np.isnan(exact)
        assert nan.any() == (x.shape[0] > 0), e
        assert (got[nan].view(np.uint32) == 0x7FFFFFFF).all(), (e, got[nan].view(np.uint32))
        assert np.array_equal(got[np.isinf(exact)], exact[np.isinf(exact)].astype(np.float32)), e
        assert np.isfinite(got[np.isfinite(exact)]).all(), e


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["reference", "emulate"])
def test_nan_column_sums_have_the_gpus_bits(dtype, backend):
    """An NVIDIA GPU's float32 NaN results are all 0x7FFFFFFF, where x86 keeps an operand's sign
    and payload and makes inf - inf 0xFFC00000: the reference and the emulator give the GPU's
    bits (their ftz() canonicalises NaN), so all three agree bit for bit."""
    xs = nan_case(dtype)
    for scale in (None, np.ones(len(xs), np.float32)):
        got = cugrouped.multi_pad_cast_transpose(xs, scale=scale, column_sums=True,
                                                 backend=backend)
        assert_gpu_nan_column_sums(got.column_sums, xs)
        assert not np.isnan(got.amax).any()           # NaN never reaches the amax (inf does)


@pytest.mark.parametrize("backend", ["reference", "emulate"])
def test_a_nan_scale_gives_the_gpus_nan_bits(backend):
    """A given scale that is NaN: its scale_inv is the GPU's canonical NaN (1 / NaN is
    arithmetic) and every element casts to byte 0x7F; the amax is the data's."""
    xs = make_inputs([20, 0, 9], 32, "float32", 4)
    scale = np.array([np.array([0xFFC00001], np.uint32).view(np.float32)[0], 2.0, np.nan],
                     np.float32)
    got = cugrouped.multi_pad_cast_transpose(xs, scale=scale, backend=backend)
    assert got.scale_inv.view(np.uint32)[[0, 2]].tolist() == [0x7FFFFFFF] * 2
    assert got.scale_inv[1] == 0.5
    assert (got.data.view(np.uint8) == 0x7F).all()          # experts 0 and 2: every byte NaN
    assert got.amax[0] == np.abs(xs[0]).max() and np.isfinite(got.amax).all()
    # the transposed copy's padding rows stay zero bytes (0 times a NaN or infinite scale would
    # be NaN: the GPU wrote 0x7F there until the first GPU run, 2026-12-04, showed it)
    assert_same_bits(got, reference.multi_pad_cast_transpose(xs, scale=scale), "NaN scale")
    inf = np.full(3, np.inf, np.float32)
    assert_same_bits(cugrouped.multi_pad_cast_transpose(xs, scale=inf, backend=backend),
                     reference.multi_pad_cast_transpose(xs, scale=inf), "infinite scale")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("variant", ["plain", "gather", "swiglu"])
def test_padding_is_zero_whatever_the_scale(variant, fmt):
    """The transposed copy's padding columns are 0x00 for a NaN, inf, negative or -0 given scale
    (fp8(0 * s) would be 0x7F / 0x80): the reference's bits, emulator and reference alike."""
    scale = np.array([np.nan, -2.0, np.inf, np.array([0xFFC00001], np.uint32).view(np.float32)[0],
                      -0.0], np.float32)
    m = [70, 9, 33, 1, 5]
    kw = dict(scale=scale, fp8_format=fmt)
    if variant == "gather":
        tok = make_inputs([40], 32, "float32", 6)[0]
        idx = np.arange(sum(m)) % 41 - 1          # some -1: zero rows (data), not padding
        args, kw = (tok, m), dict(kw, row_index=idx)
    else:
        xs = make_inputs(m, 64 if variant == "swiglu" else 32, "bfloat16", 5)
        args = (xs,)
        if variant == "swiglu":
            kw["activation"] = "swiglu"
    got = cugrouped.multi_pad_cast_transpose(*args, backend="emulate", **kw)
    want = reference.multi_pad_cast_transpose(*args, **kw)
    assert_same_bits(got, want, f"{variant}/{fmt}")
    for i, mi in enumerate(m):
        assert not np.asarray(got.columnwise(i)).view(np.uint8)[:, mi:].any(), i


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_nan_column_sums_have_the_references_bits(dtype):
    import cupy

    xs = nan_case(dtype)
    carrier = {"bfloat16": np.uint16}.get(dtype)
    dxs = [cupy.asarray(x.view(carrier) if carrier else x) for x in xs]
    got = cugrouped.multi_pad_cast_transpose(dxs, dtype=dtype if carrier else None,
                                             column_sums=True)
    host = cugrouped.GroupedFP8(**{f: (cupy.asnumpy(v) if isinstance(v, cupy.ndarray) else v)
                                   for f, v in vars(got).items()})
    assert_gpu_nan_column_sums(host.column_sums, xs)
    assert_same_bits(host, reference.multi_pad_cast_transpose(xs, column_sums=True), "NaN sums")
    # a NaN given scale: its inverse comes from the GPU's division (rcp's slow path)
    scale = np.array([np.nan, 1.0, 2.0, np.array([0xFFC00001], np.uint32).view(np.float32)[0]],
                     np.float32)
    got = cugrouped.multi_pad_cast_transpose(dxs, dtype=dtype if carrier else None,
                                             scale=cupy.asarray(scale))
    host = cugrouped.GroupedFP8(**{f: (cupy.asnumpy(v) if isinstance(v, cupy.ndarray) else v)
                                   for f, v in vars(got).items()})
    assert_same_bits(host, reference.multi_pad_cast_transpose(xs, scale=scale), "NaN scale")


def test_all_experts_empty_with_out_buffers():
    """Zero rows in total (an expert-parallel rank that receives no token): empty buffers are fine."""
    xs = [np.zeros((0, 32), np.float32), np.zeros((0, 32), np.float32)]
    first = cugrouped.multi_pad_cast_transpose(xs, backend="emulate", column_sums=True)
    again = cugrouped.multi_pad_cast_transpose(xs, backend="emulate", column_sums=True, out=first)
    assert again.data.shape == (0, 32) and again.data_t.shape == (0,)
    assert not again.amax.any() and not again.column_sums.any()
    assert np.array_equal(again.scale, np.ones(2, np.float32))


def test_argument_blocks_are_reused_only_for_identical_values():
    """The packed argument blocks are remembered per value; any changed pointer makes new ones."""
    xs = make_inputs([9, 0, 20], 32, "float32", 3)
    x = np.concatenate(xs)
    first = cugrouped.multi_pad_cast_transpose(x, [9, 0, 20], backend="emulate")
    g = _cast_inputs.normalize_inputs(x, [9, 0, 20])
    plans = pct.plan_launches(g.m_splits, g.k, 16)
    a = pct._packed_groups(g, first, plans, 16)
    assert pct._packed_groups(g, first, plans, 16) is a            # same values: same blocks
    other = cugrouped.multi_pad_cast_transpose(x, [9, 0, 20], backend="emulate")   # new outputs
    b = pct._packed_groups(g, other, plans, 16)
    assert b is not a and b[0]["out_row"][0] == np.asarray(other.data).ctypes.data
    x2 = x.copy()                                                   # new input pointer
    c = pct._packed_groups(_cast_inputs.normalize_inputs(x2, [9, 0, 20]), other, plans, 16)
    assert c is not b and c[0]["in"][0] == x2.ctypes.data
    # and results stay right when blocks are reused
    again = cugrouped.multi_pad_cast_transpose(x, [9, 0, 20], backend="emulate", out=first)
    assert_same_bits(again, reference.multi_pad_cast_transpose(x, [9, 0, 20]))


def test_argument_blocks_see_the_row_stride():
    """Inputs at the same addresses with the same splits but other row strides (an allocator
    hands the addresses out again), written to the same out buffers, get blocks of their own."""
    k, m_splits = 32, [9, 0, 20]
    bufs = [make_inputs([2 * m], k, "float32", 12 + i)[0].reshape(-1)
            for i, m in enumerate(m_splits)]
    wide = [b.reshape(m, 2 * k)[:, :k] for b, m in zip(bufs, m_splits)]   # rows 64 apart
    tight = [b[: m * k].reshape(m, k) for b, m in zip(bufs, m_splits)]    # rows 32 apart
    assert [x.ctypes.data for x in wide] == [x.ctypes.data for x in tight]
    out = cugrouped.multi_pad_cast_transpose(tight, backend="emulate")
    for xs in (wide, tight, wide):
        got = cugrouped.multi_pad_cast_transpose(xs, out=out, backend="emulate")
        assert_same_bits(got, reference.multi_pad_cast_transpose(
            [np.ascontiguousarray(x) for x in xs]))


def test_argument_blocks_see_the_align():
    """The same inputs and output addresses with another ``align`` (out buffers carved from one
    pool at one address) must not reuse blocks whose transposed offsets were padded otherwise."""
    k, m_splits = 32, [9, 0, 20]
    x = np.concatenate(make_inputs(m_splits, k, "float32", 13))
    pool, data = np.empty(k * 29 * 8, np.uint8), np.empty((29, k), np.uint8)
    template = cugrouped.multi_pad_cast_transpose(x, m_splits, backend="emulate")
    for align in (16, 32, 16):
        n = k * sum(pct.padded_splits(m_splits, align))
        out = dataclasses.replace(template, data=data, data_t=pool[:n])
        got = cugrouped.multi_pad_cast_transpose(x, m_splits, align=align, out=out,
                                                 backend="emulate")
        assert_same_bits(got, reference.multi_pad_cast_transpose(x, m_splits, align=align),
                         f"align={align}")


def test_device_split_blocks_see_the_rows_there_are():
    """Device counts are clamped to the rows of ``inputs``, a value packed into the blocks: the
    same addresses with fewer rows (a shorter view at the same address) get blocks of their own,
    and the counts are clamped to those rows."""
    k, E, align = 32, 3, 16
    counts = np.array([9, 0, 20], np.int64)
    x = np.concatenate(make_inputs([9, 0, 20], k, "float32", 14))
    data, pool = np.empty(29 * k, np.uint8), np.empty(k * (29 + E * (align - 1)), np.uint8)
    template = cugrouped.multi_pad_cast_transpose(x, counts, splits_on_device=True,
                                                  backend="emulate")
    for rows, splits in ((29, [9, 0, 20]), (20, [9, 0, 11]), (29, [9, 0, 20])):
        out = dataclasses.replace(template, data=data[: rows * k].reshape(rows, k),
                                  data_t=pool[: k * (rows + E * (align - 1))])
        got = cugrouped.multi_pad_cast_transpose(x[:rows], counts, splits_on_device=True,
                                                 out=out, backend="emulate")
        assert got.host_splits()[0] == tuple(splits)
        assert_same_bits(got, reference.multi_pad_cast_transpose(x[:rows], splits), str(rows))


def test_arg_memo_keeps_the_most_recently_used():
    from cugrouped.ops._launch import ArgMemo

    memo, made = ArgMemo(2), []

    def make(v):
        return lambda: made.append(v) or [v]

    a = memo.get("a", make("a"))
    memo.get("b", make("b"))
    assert memo.get("a", make("a2")) is a          # hit: not made again, now most recent
    memo.get("c", make("c"))                       # evicts "b", the least recently used
    assert memo.get("a", make("a3")) is a
    assert memo.get("b", make("b2")) == ["b2"]
    assert made == ["a", "b", "c", "b2"]


def test_chunks_of_tiles_and_device_chunks():
    from cugrouped.ops._launch import ChunkLaunch, chunks_of_tiles, device_chunks

    assert chunks_of_tiles((2, 0, 3, 1, 4), 2) == (
        ChunkLaunch(0, 2, (0, 2, 2), 2), ChunkLaunch(2, 2, (0, 3, 4), 4),
        ChunkLaunch(4, 1, (0, 4), 4))
    assert chunks_of_tiles((), 64) == ()
    with pytest.raises(ValueError, match="too many tiles"):
        chunks_of_tiles((2**30, 2**30), 64)
    assert device_chunks(5, 2, lambda n: 10 * n) == [
        ChunkLaunch(0, 2, (), 20), ChunkLaunch(2, 2, (), 20), ChunkLaunch(4, 1, (), 10)]
    with pytest.raises(ValueError, match="too many tiles"):
        device_chunks(1, 64, lambda n: 2**31)


@pytest.mark.parametrize("form", ["list", "tensor", "device"])
def test_tiles_one_row_short_of_full(form):
    """m = 63 and 127 with k a multiple of 128: the last tile row of each expert lies inside k and
    is 16-byte aligned but one row short of 64, so it must take the bounds-checked path; the
    full-tile path would read the row after the expert's last (the next expert's first, here with
    the largest values) into the amax, the column sums and, with align 16, the zero padding of
    the transposed copy. The matrix above has no m that is 63 modulo 64 with k >= 128."""
    m_splits, k = [63, 127, 1, 64], 256
    xs = make_inputs(m_splits, k, "bfloat16", 17)
    for x in xs[1:]:
        x[0] = 2.0 ** 10                         # larger than anything make_inputs gives
    for given in (True, False):
        scale = scales_for(m_splits, "e4m3", 4) if given else None
        got, want = run_both(xs, m_splits, form, align=16, scale=scale, column_sums=True)
        assert_same_bits(got, want, f"{form}/given={given}")


@pytest.mark.parametrize("align", [3, 8, 24])
@pytest.mark.parametrize("form", ["list", "tensor", "device"])
def test_align_not_a_multiple_of_16_writes_zero_padding(align, form):
    """An align that is not a multiple of 16 makes the last transposed run of an expert neither
    32 nor 16 bytes (or not 16-byte aligned): its padding bytes are written one by one. The out
    buffers are filled with 0xFF first, so a padding byte the kernel skips cannot pass as the
    zero that a fresh allocation happens to hold. (The matrix above uses align 1, 16, 32, 128.)"""
    m_splits, k = [5, 0, 70, 33, 1], 48
    xs = make_inputs(m_splits, k, "float16", 23)
    args = (xs, None) if form == "list" else (np.concatenate(xs), list(m_splits))
    dev = {}
    if form == "device":
        args, dev = (args[0], np.array(m_splits, np.int64)), dict(splits_on_device=True)
    want = reference.multi_pad_cast_transpose(xs, align=align, column_sums=True)
    out = cugrouped.multi_pad_cast_transpose(*args, align=align, column_sums=True,
                                             backend="emulate", **dev)
    for name in ("data", "data_t", "column_sums"):
        np.asarray(getattr(out, name)).view(np.uint8)[...] = 0xFF
    got = cugrouped.multi_pad_cast_transpose(*args, align=align, column_sums=True, out=out,
                                             backend="emulate", **dev)
    assert_same_bits(got, want, f"align={align}/{form}")
    for i, m in enumerate(m_splits):
        assert not np.asarray(got.columnwise(i))[:, m:].any(), i


@pytest.mark.parametrize("margin", [1, 5])
@pytest.mark.parametrize("form", ["list", "device"])
def test_margin_emulated_matches_reference(margin, form):
    """The amax pass of current scaling divides the scale by 2^margin on the device: the emulated
    kernel gives the reference's scales and bytes, and the scale of an expert with data is the
    margin-0 scale over 2^margin (an empty expert keeps 1). Every other emulated test casts with
    margin 0, where a kernel that ignored the argument would pass."""
    m_splits, k = [37, 0, 70, 5], 48
    xs = make_inputs(m_splits, k, "bfloat16", 29)
    for fmt in ("e4m3", "e5m2"):
        got, want = run_both(xs, m_splits, form, fp8_format=fmt, margin=margin,
                             column_sums=True)
        assert_same_bits(got, want, f"margin={margin}/{form}/{fmt}")
        plain = reference.multi_pad_cast_transpose(xs, fp8_format=fmt)
        for e, m in enumerate(m_splits):
            assert got.scale[e] == (plain.scale[e] / np.float32(2.0**margin) if m else 1), e


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("given", [True, False])
def test_a_nan_after_the_largest_value_does_not_hide_it_from_the_amax(dtype, given):
    """The amax ignores NaN as fmaxf does, also when the NaN comes after the largest value in
    the same thread's elements (same row segment, and rows r and r + 32 of a tile): a max that
    let NaN win a comparison would lose what came before it, and the warp's fmaxf would then drop
    the NaN, leaving a smaller, finite and wrong amax (and scale)."""
    m_splits, k = [40, 3, 64], 32
    xs = [np.random.default_rng(i).uniform(-1, 1, (m, k)).astype(np.float32)
          for i, m in enumerate(m_splits)]
    xs[0][5, 2], xs[0][5, 3] = 1000.0, np.nan        # one segment: the max, then a NaN
    xs[1][1, 16], xs[1][1, 31] = -500.0, -np.nan
    xs[2][3, 7], xs[2][35, 7] = 700.0, np.nan        # rows r and r + 32: one thread
    xs = [x.astype(DTYPES[dtype]) for x in xs]
    scale = np.array([1.0, 0.5, 2.0], np.float32) if given else None
    got, want = run_both(xs, m_splits, "list", scale=scale, column_sums=True)
    assert_same_bits(got, want, f"{dtype}/given={given}")
    assert got.amax.tolist() == [1000.0, 500.0, 700.0]


def rows_far_apart(form):
    """34 bfloat16 rows of 32 elements, 2^26 elements apart (a strided view of a 4 GiB buffer of
    which only the pages of those rows are touched), split [33, 1]: ``(view, the same rows
    contiguous, m_splits, the splits as the form passes them)``; skips without the address
    space."""
    ld, k, m_splits = 1 << 26, 32, [33, 1]
    try:
        base = np.zeros((sum(m_splits), ld), ml_dtypes.bfloat16)
    except MemoryError:
        pytest.skip("no 4 GiB of address space")
    small = make_inputs([sum(m_splits)], k, "bfloat16", 31)[0]
    view = base[:, 16:16 + k]
    view[...] = small
    return view, small, m_splits, np.array(m_splits, np.int64) if form == "device" else m_splits


@pytest.mark.parametrize("form", ["tensor", "device"])
def test_row_offsets_past_2_31_elements(form):
    """Rows 2^26 elements apart (a strided view of a 4 GiB bfloat16 buffer, of which only the
    pages of the rows read are ever touched): from row 32 on, a row's element offset exceeds
    2^31, so an offset computed in 32 bits (the device splits' per-expert input offset, or a
    row's offset inside an expert) reads elsewhere or faults. The GPU test of a case over 2^31
    elements needs a GPU; this one needs only address space."""
    view, small, m_splits, splits = rows_far_apart(form)
    got = cugrouped.multi_pad_cast_transpose(view, splits, splits_on_device=form == "device",
                                             column_sums=True, backend="emulate")
    want = reference.multi_pad_cast_transpose(small, m_splits, column_sums=True)
    assert_same_bits(got, want, form)
