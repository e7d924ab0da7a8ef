"""multi_pad_cast_transpose(activation="swiglu"): fc1's gated unit and fc2's FP8 cast in one pass.

The kernel run on the CPU emulator gives the NumPy reference's bits over the split taxonomy x
dtypes x formats x scaling x input forms (fiber orders varied); the reference is the activation
(:mod:`cugrouped.reference.activation`, checked against float64 in tests/test_activation.py)
followed by the plain cast; widths whose second half is not 16-byte aligned, wider row strides,
the option combinations, argument checks, the torch front, and the GPU twin (marked ``gpu``)."""

from __future__ import annotations

import itertools
import zlib

import ml_dtypes
import numpy as np
import pytest

import cugrouped
from cugrouped import reference
from cugrouped.reference import activation as ract
from test_pad_cast_transpose import (DTYPES, ORDERS, SPLITS, assert_same_bits, device_inputs,
                                     make_inputs, scales_for)

SWIGLU = dict(activation="swiglu")


def gated_inputs(m_splits, k, dtype, seed, specials=False):
    """Per expert ``(m, 2k)`` rows ``[a | b]``: log-uniform magnitudes, random signs, and with
    ``specials`` the values where silu's arithmetic changes rule (NaN, infinities, denormals,
    -87 / -88 / 88 around the exp clamps, a large negative a whose silu is -0)."""
    xs = make_inputs(m_splits, 2 * k, "float32", seed)
    rng = np.random.default_rng(seed + 1)
    if specials:
        vals = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -3e-39, -87.0, -87.5, -88.0,
                         -88.5, 88.5, -100.0, 17.0, -17.0, 3e38], np.float32)
        for x in xs:
            flat = x.reshape(-1)
            if flat.size:
                idx = rng.choice(flat.size, size=min(flat.size, vals.size), replace=False)
                flat[idx] = vals[: idx.size]
    with np.errstate(over="ignore"):
        return [x.astype(DTYPES[dtype]) for x in xs]


def run_both(xs, m_splits, form, **kw):
    """``form``: "list", "tensor" (+ host splits) or "device" (counts the kernel reads)."""
    args = (xs, None) if form == "list" else (np.concatenate(xs, axis=0), list(m_splits))
    want = reference.multi_pad_cast_transpose(*args, **SWIGLU, **kw)
    if form == "device":
        got = cugrouped.multi_pad_cast_transpose(args[0], np.array(m_splits, np.int64),
                                                 splits_on_device=True, backend="emulate",
                                                 **SWIGLU, **kw)
    else:
        got = cugrouped.multi_pad_cast_transpose(*args, backend="emulate", **SWIGLU, **kw)
    return got, want


CASES = [
    (split, dtype, fmt, given, form, (1, 16, 32, 128)[i % 4], ORDERS[i % len(ORDERS)])
    for i, (split, dtype, fmt, given, form) in enumerate(itertools.product(
        SPLITS, DTYPES, ("e4m3", "e5m2"), (True, False), ("list", "tensor", "device")))
]


def case_data(split, dtype, fmt, given):
    m_splits, k = SPLITS[split]
    seed = zlib.crc32(repr(("swiglu", split, dtype, fmt, given)).encode())
    xs = gated_inputs(m_splits, k, dtype, seed, specials=split in ("skewed", "full_tiles"))
    return m_splits, k, xs, scales_for(m_splits, fmt, seed) if given else None


@pytest.mark.parametrize("split,dtype,fmt,given,form,align,order", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_emulated_swiglu_cast_matches_reference(split, dtype, fmt, given, form, align, order):
    m_splits, k, xs, scale = case_data(split, dtype, fmt, given)
    with cugrouped.emulation_order(order):
        got, want = run_both(xs, m_splits, form, fp8_format=fmt, align=align, scale=scale)
    assert_same_bits(got, want, f"{split}/{dtype}/{fmt}/given={given}/{form}")
    assert got.k == k and np.asarray(got.amax).shape == (len(m_splits),)
    for i, m in enumerate(m_splits):     # the transposed copy's padding is zero bytes
        assert not np.asarray(got.columnwise(i))[:, m:].any()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reference_is_the_activation_then_the_plain_cast(dtype):
    """The reference's fused result is the activation (float32) cast by the plain op: the
    activation is the only new arithmetic."""
    m_splits, k = [37, 0, 90], 48
    xs = gated_inputs(m_splits, k, dtype, 5, specials=True)
    scale = np.array([3.0, 1.0, 0.25], np.float32)
    fused = reference.multi_pad_cast_transpose(xs, scale=scale, **SWIGLU)
    acts = [ract.swiglu(x[:, :k].astype(np.float32), x[:, k:].astype(np.float32)) for x in xs]
    plain = reference.multi_pad_cast_transpose(acts, scale=scale)
    assert_same_bits(fused, plain, dtype)


# Output widths whose second half starts off a 16-byte boundary (the per-segment loads), a width
# of one, and a full-tile width; 16-bit and float32.
@pytest.mark.parametrize("k", [1, 3, 36, 129, 200, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_any_width_and_unaligned_second_half(k, dtype):
    m_splits = [70, 1, 0, 128]
    xs = gated_inputs(m_splits, k, dtype, k, specials=True)
    for given in (True, False):
        scale = scales_for(m_splits, "e4m3", k) if given else None
        got, want = run_both(xs, m_splits, "tensor", scale=scale)
        assert_same_bits(got, want, f"k={k}/given={given}")


def test_row_stride_larger_than_the_two_halves():
    """Rows of a wider buffer (a column slice): the second half is k columns after the first,
    whatever the row stride."""
    k, m_splits = 64, [65, 3]
    wide = gated_inputs([sum(m_splits)], k + 4, "bfloat16", 3)[0]     # 2k + 8 columns
    x = wide[:, : 2 * k]
    assert x.strides[0] == (2 * k + 8) * 2
    got, want = run_both([x[:65], x[65:]], m_splits, "list", scale=np.ones(2, np.float32))
    assert_same_bits(got, want, "strided")


def test_rowwise_only_columnwise_only_and_amax_accumulate():
    m_splits, k = [40, 0, 70], 96
    xs = gated_inputs(m_splits, k, "bfloat16", 11)
    scale = np.array([2.0, 1.0, 0.5], np.float32)
    for rowwise, columnwise in ((True, False), (False, True)):
        got, want = run_both(xs, m_splits, "list", scale=scale, rowwise=rowwise,
                             columnwise=columnwise)
        assert_same_bits(got, want, f"{rowwise}/{columnwise}")
        assert (got.data is None) != rowwise and (got.data_t is None) != columnwise
    first = cugrouped.multi_pad_cast_transpose(xs, scale=scale, backend="emulate", **SWIGLU)
    old = np.asarray(first.amax).copy()
    smaller = [(x.astype(np.float32) / 4).astype(ml_dtypes.bfloat16) for x in xs]
    again = cugrouped.multi_pad_cast_transpose(smaller, scale=scale, out=first,
                                               amax_accumulate=True, backend="emulate", **SWIGLU)
    assert np.array_equal(np.asarray(again.amax), old)          # the larger amax stays
    fresh = cugrouped.multi_pad_cast_transpose(smaller, scale=scale, backend="reference", **SWIGLU)
    assert (np.asarray(fresh.amax) < old)[old > 0].all() and old.any()
    assert np.array_equal(np.asarray(again.data).view(np.uint8),
                          np.asarray(fresh.data).view(np.uint8))


def test_current_scaling_options_apply_to_the_activation():
    m_splits, k = [33, 80], 64
    xs = gated_inputs(m_splits, k, "float16", 2)
    kw = dict(margin=2, amax_epsilon=1e-3, power_2_scale=True)
    got, want = run_both(xs, m_splits, "tensor", **kw)
    assert_same_bits(got, want, "options")
    assert np.all(np.log2(np.asarray(got.scale)) % 1 == 0)


@pytest.mark.parametrize("backend", ["emulate", "reference"])
@pytest.mark.parametrize("call,match", [
    (lambda x, b: cugrouped.multi_pad_cast_transpose(x, activation="gelu", backend=b),
     "activation: expected one of"),
    (lambda x, b: cugrouped.multi_pad_cast_transpose([a[:, :63] for a in x], activation="swiglu",
                                                     backend=b), "even number of columns"),
    (lambda x, b: cugrouped.multi_pad_cast_transpose(x, activation="swiglu", column_sums=True,
                                                     backend=b), "column_sums"),
    (lambda x, b: cugrouped.multi_pad_cast_transpose(x[0], [4], activation="swiglu",
                                                     row_index=np.arange(4), backend=b),
     "row_index"),
])
def test_bad_activation_arguments_are_refused(backend, call, match):
    xs = gated_inputs([4, 6], 32, "bfloat16", 0)
    with pytest.raises(ValueError, match=match):
        call(xs, backend)


def test_torch_front_gives_the_same_bits():
    torch = pytest.importorskip("torch")
    m_splits, k = [50, 0, 21], 72
    xs = gated_inputs(m_splits, k, "bfloat16", 9, specials=True)
    want = reference.multi_pad_cast_transpose(xs, **SWIGLU)
    ts = [torch.from_numpy(x.view(np.uint16).astype(np.int32)).to(torch.int16).view(torch.bfloat16)
          for x in xs]
    got = cugrouped.multi_pad_cast_transpose(torch.cat(ts), m_splits, backend="emulate", **SWIGLU)
    assert got.data.dtype == torch.float8_e4m3fn and tuple(got.data.shape) == (sum(m_splits), k)
    assert np.array_equal(got.data.view(torch.uint8).numpy(), np.asarray(want.data).view(np.uint8))
    assert np.array_equal(got.data_t.numpy(), np.asarray(want.data_t))
    assert np.array_equal(got.amax.numpy(), np.asarray(want.amax))
    with pytest.raises(ValueError, match="even number of columns"):
        cugrouped.multi_pad_cast_transpose(torch.cat(ts)[:, 1:], m_splits, **SWIGLU)


# ------------------------------------------------------------------------------------------------
# The same matrix on a GPU (skipped here; run by scripts/gpu_check.sh).

@pytest.mark.gpu
@pytest.mark.parametrize("split,dtype,fmt,given,form,align,order", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_cuda_swiglu_cast_matches_reference(split, dtype, fmt, given, form, align, order):
    import cupy

    m_splits, k, xs, scale = case_data(split, dtype, fmt, given)
    dxs, splits, tag = device_inputs(xs, m_splits, form, dtype)
    want = reference.multi_pad_cast_transpose(xs, fp8_format=fmt, align=align, scale=scale,
                                              **SWIGLU)
    got = cugrouped.multi_pad_cast_transpose(
        dxs, splits, fp8_format=fmt, align=align, dtype=tag,
        scale=cupy.asarray(scale) if given else None, **SWIGLU)
    host = cugrouped.GroupedFP8(**{f: (cupy.asnumpy(v) if isinstance(v, cupy.ndarray) else v)
                                   for f, v in vars(got).items()})
    assert_same_bits(host, want, f"cuda {split}/{dtype}/{fmt}")
