"""The cast ops' host fast paths against the general ones they stand in for.

The host side of a cast call takes shortcuts for the common case (a list of arrays of one kind,
dtype and layout read without a view object per array). Each one must give exactly what the
general path gives, and leave everything it cannot vouch for to the general path, which raises
the errors the other tests pin. Here both run on many random inputs and are compared field by
field, exceptions by type and message.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cugrouped.ops import _cast_inputs

torch = pytest.importorskip("torch")

_NP_DTYPES = (np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.uint16)
_TORCH_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32)


def _numpy_array(rng, rows, k, dtype):
    """A ``(rows, k)`` array of a random layout: contiguous, rows further apart, a column
    stride, reversed rows, transposed, or strides off the item size."""
    layout = rng.integers(0, 8) if rng.random() < 0.1 else rng.integers(0, 2)
    if layout == 1:
        return np.zeros((rows, k + 3), dtype)[:, :k]
    if layout == 2:
        return np.zeros((rows, 2 * k), dtype)[:, ::2]
    if layout == 3:
        return np.zeros((rows, k), dtype)[::-1]
    if layout == 4:
        return np.zeros((k, rows), dtype).T
    if layout == 5:      # byte strides that are no multiple of the item size
        isz = np.dtype(dtype).itemsize
        if isz > 1 and rows > 1:
            raw = np.zeros((rows * (k * isz + 1) // isz + 1) * isz, np.uint8)
            return np.lib.stride_tricks.as_strided(raw.view(dtype), shape=(rows, k),
                                                   strides=(k * isz + 1, isz))
    return np.zeros((rows, k), dtype)


def _random_list(rng, kind):
    """Mostly uniform lists (the fast path's case) with now and then one odd array: another
    dtype, kind, k or rank, a layout the kernels cannot read, a NumPy subclass."""
    E = int(rng.choice([1, 2, 5, 65]))
    k = int(rng.choice([1, 2, 16, 48]))
    dtypes = _NP_DTYPES if kind == "numpy" else _TORCH_DTYPES
    dt = dtypes[0] if rng.random() < 0.6 else dtypes[int(rng.integers(len(dtypes)))]
    odd = int(rng.integers(E)) if rng.random() < 0.5 else -1
    xs = []
    for i in range(E):
        rows = int(rng.choice([0, 1, 2, 7]))
        a = _numpy_array(rng, rows, k, dt if kind == "numpy" else np.float32) \
            if i != odd or rng.random() < 0.5 else _numpy_array(rng, rows, k, np.float32)
        if i == odd:
            change = rng.integers(0, 7)
            if change == 0:
                a = _numpy_array(rng, rows, k + 1, np.float32)
            elif change == 1:
                a = np.zeros((rows, k, 1), np.float32) if rng.random() < 0.5 else \
                    np.zeros(k, np.float32)
            elif change == 2 and kind == "numpy":
                a = np.asmatrix(np.zeros((rows, k), dt))
            elif change == 3:
                a = np.zeros((rows, k), np.float16)
        if kind == "torch":
            t = torch.from_numpy(np.ascontiguousarray(a)) if a.strides and min(a.strides) >= 0 \
                and all(s % a.itemsize == 0 for s in a.strides) else torch.zeros(a.shape)
            t = t.to(dt) if t.dtype.is_floating_point and dt.is_floating_point and i != odd else t
            if rng.random() < 0.2 and t.dim() == 2:          # a column stride, rows apart
                t = torch.zeros((t.shape[0], 2 * t.shape[1]), dtype=t.dtype)[:, ::2]
            if i == odd and rng.random() < 0.2:               # another device
                t = torch.zeros(t.shape, dtype=t.dtype, device="meta")
            xs.append(t if i != odd or rng.random() < 0.7 else np.zeros((rows, k), np.float32))
        else:
            xs.append(a)
    return xs


def _outcome(fn):
    try:
        return fn()
    except (TypeError, ValueError) as err:
        return (type(err), str(err))


def _same(got, want):
    if isinstance(want, tuple):          # an error: same type, same message
        assert got == want
        return
    assert isinstance(got, _cast_inputs.GroupedInput)
    for f in ("m_splits", "k", "dtype", "on_device", "kind", "device", "total_rows",
              "num_experts", "src_rows"):
        assert getattr(got, f) == getattr(want, f), f
    assert all(type(v) is int for v in got.m_splits)
    assert got.base.owner is want.base.owner
    assert (got.base.ptr, got.base.shape, got.base.strides, got.base.dtype) == \
        (want.base.ptr, want.base.shape, want.base.strides, want.base.dtype)
    for f in ("ptrs", "lds"):
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and np.array_equal(a, b), f


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")     # np.asmatrix
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_list_fast_path_gives_the_general_paths_result_or_error(kind):
    rng = np.random.default_rng(11)
    fast_taken = 0
    for trial in range(600):
        xs = _random_list(rng, kind)
        tag = "bfloat16" if kind == "numpy" and rng.random() < 0.2 else None
        m_splits = None
        if rng.random() < 0.2:
            m_splits = [getattr(x, "shape", (0,))[0] for x in xs]
            if rng.random() < 0.5:
                m_splits[0] += 1
        got = _outcome(lambda: _cast_inputs.normalize_inputs(xs, m_splits, tag))
        want = _outcome(lambda: _cast_inputs._normalize_list(xs, m_splits, tag))
        _same(got, want)
        first = _outcome(lambda: _cast_inputs.as_view(xs[0], dtype=tag, arg="inputs[0]"))
        if not isinstance(first, tuple) and _cast_inputs._uniform_rows(xs, first) is not None:
            fast_taken += 1
    assert fast_taken > 150       # the fast path is exercised, not only its refusals


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_list_fast_path_reads_uniform_lists(kind):
    """The common case takes the fast path: experts of one kind and dtype, empty ones included,
    rows further apart than k."""
    base = np.zeros((40, 24), np.float32)
    xs = [base[0:0, :16], base[0:7, :16], base[7:8, :16], base[8:40, :16]]
    if kind == "torch":
        xs = [torch.from_numpy(base)[0:0, :16], torch.from_numpy(base)[0:7, :16],
              torch.from_numpy(base)[7:8, :16], torch.from_numpy(base)[8:40, :16]]
    first = _cast_inputs.as_view(xs[0], arg="inputs[0]")
    assert _cast_inputs._uniform_rows(xs, first) is not None
    _same(_cast_inputs.normalize_inputs(xs), _cast_inputs._normalize_list(xs, None, None))
