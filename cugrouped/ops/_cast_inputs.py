"""What the cast ops read: their inputs checked and described once (:class:`GroupedInput`), and the
current-scaling options they share.

``multi_pad_cast_transpose``, ``multi_block_cast_transpose`` and ``multi_mxfp8_cast_transpose``
(and their torch front) take the same inputs: a list of per-expert ``(m_i, k)`` arrays, one
``(sum(m_splits), k)`` array with host or device counts, or a ``(tokens, k)`` array gathered by
``row_index``. :func:`normalize_inputs` checks them, raising TypeError/ValueError naming the
argument, and records every expert's row pointer and stride. Nothing is copied.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from .._array import FLOAT_INPUT_DTYPES, ArrayView, array_is_device, as_view
from ._launch import exclusive_cumsum

__all__ = ["GroupedInput", "normalize_inputs", "row_stride", "check_scale_options",
           "check_count_array", "rows_readable"]


@dataclasses.dataclass(frozen=True)
class GroupedInput:
    """Normalised input. Host splits: per-expert row pointers and row strides (``ptrs``, ``lds``).
    Device splits: ``m_splits`` is None, ``base`` is the whole array and ``m_dev`` the counts."""

    base: ArrayView
    m_splits: tuple[int, ...] | None
    k: int
    dtype: str
    on_device: bool
    kind: str
    device: int
    total_rows: int
    num_experts: int
    ptrs: np.ndarray | None = None      # uint64 (E,): first element of each expert
    lds: np.ndarray | None = None       # int64 (E,): row stride of each expert, in elements
    m_dev: ArrayView | None = None
    row_index: ArrayView | None = None  # gather: int64 (total_rows,) rows of ``base`` (tokens)
    src_rows: int = 0                   # gather: rows of ``base``


def rows_readable(shape: tuple, strides: tuple) -> bool:
    """Whether the cast kernels read a 2-D ``(m, k)`` layout (strides in elements) as it is: unit
    column stride and rows at least ``k`` apart (either free with one column or one row)."""
    m, k = shape
    return m == 0 or ((k <= 1 or strides[1] == 1) and (m <= 1 or strides[0] >= k))


def check_count_array(ndim: int, integer: bool, got: str) -> None:
    """The rule for an array of host counts, one for every array kind (the torch front checks
    a count tensor with it): 1-D, of an integer dtype (bool is not a count)."""
    if ndim != 1 or not integer:
        raise TypeError(f"m_splits: expected a 1-D sequence of non-negative ints, got {got}")


def _host_splits(m_splits: Any, rows: int) -> tuple[int, ...]:
    if array_is_device(m_splits):
        raise TypeError("m_splits: a device array was given with splits_on_device=False; pass a host "
                        "sequence of ints, or leave splits_on_device=None to let the kernel read it")
    if type(m_splits) in (list, tuple) and set(map(type, m_splits)) <= {int}:
        splits = tuple(m_splits)                      # the common case, without NumPy
    else:
        arr = np.asarray(m_splits)
        check_count_array(arr.ndim, arr.dtype.kind in "iu", repr(m_splits))
        splits = tuple(int(v) for v in arr)
    if splits and min(splits) < 0:
        raise ValueError(f"m_splits: expected non-negative counts, got {splits}")
    if sum(splits) != rows:
        raise ValueError(f"m_splits: counts sum to {sum(splits)} but inputs has {rows} rows")
    return splits


def _device_splits(m_splits: Any, view: ArrayView) -> ArrayView:
    mv = as_view(m_splits, arg="m_splits")
    if mv.dtype != "int64" or len(mv.shape) != 1 or (mv.shape[0] > 1 and mv.strides[0] != 1):
        raise TypeError(f"m_splits: a count array read by the kernel must be a contiguous 1-D int64 "
                        f"array, got {mv.dtype} of shape {mv.shape} (use .astype(int64))")
    if mv.shape[0] == 0:
        raise ValueError("m_splits: expected at least one expert")
    if (mv.on_device, mv.device) != (view.on_device, view.device):
        raise ValueError("m_splits: the count array must live where inputs lives")
    return mv


def row_stride(v: ArrayView) -> int:
    """The row stride of a 2-D row-major view, in elements (its width when it has one row)."""
    return v.strides[0] if v.shape[0] > 1 else v.shape[1]


def _check_row_index(row_index: Any, view: ArrayView) -> ArrayView:
    """The gather's row indices: a contiguous 1-D int64 array where ``inputs`` lives. Host
    indices are checked against the token rows here; device ones cannot be without a sync (the
    kernel reads an index outside ``[0, rows)`` as a zero row)."""
    iv = as_view(row_index, arg="row_index")
    if iv.dtype != "int64" or len(iv.shape) != 1 or (iv.shape[0] > 1 and iv.strides[0] != 1):
        raise TypeError(f"row_index: expected a contiguous 1-D int64 array, got {iv.dtype} of "
                        f"shape {iv.shape}")
    if (iv.on_device, iv.device) != (view.on_device, view.device):
        raise ValueError("row_index: must live where inputs lives")
    if not iv.on_device and iv.shape[0]:
        idx = np.asarray(row_index)
        if int(idx.max()) >= view.shape[0]:
            raise ValueError(f"row_index: indices must be below the {view.shape[0]} rows of "
                             f"inputs (negative ones select a zero row), got {int(idx.max())}")
    return iv


def normalize_inputs(inputs: Any, m_splits: Any = None, dtype: str | None = None,
                     splits_on_device: bool | None = None, row_index: Any = None) -> GroupedInput:
    """Check ``inputs`` / ``m_splits`` (/ ``row_index``) and describe them; raises
    TypeError/ValueError naming the argument. Nothing is copied."""
    if splits_on_device is None:
        splits_on_device = m_splits is not None and array_is_device(m_splits)
    if row_index is not None:
        return _normalize_gather(inputs, m_splits, dtype, splits_on_device, row_index)
    if isinstance(inputs, (list, tuple)):
        if splits_on_device:
            raise ValueError("m_splits: device-side counts go with a single inputs array, not a list")
        if len(inputs) == 0:
            raise ValueError("inputs: expected at least one expert, got an empty sequence")
        first = as_view(inputs[0], dtype=dtype, arg="inputs[0]")
        rows = _uniform_rows(inputs, first)
        if rows is None:            # something to refuse, or a mix: the general path says what
            return _normalize_list(inputs, m_splits, dtype)
        splits, ptrs, lds = rows
        _check_list_splits(m_splits, splits)
        return GroupedInput(first, splits, first.shape[1], first.dtype, first.on_device, first.kind,
                            first.device, sum(splits), len(splits),
                            np.array(ptrs, dtype=np.uint64), np.array(lds, dtype=np.int64))
    view = as_view(inputs, dtype=dtype, arg="inputs")
    if len(view.shape) != 2:
        raise ValueError(f"inputs: expected a 2-D (sum(m_splits), k) array or a list of 2-D "
                         f"arrays, got shape {view.shape}")
    if m_splits is None:
        raise ValueError("m_splits: required when inputs is a single array")
    _check_views([view], False)
    if splits_on_device:
        mv = _device_splits(m_splits, view)
        return GroupedInput(view, None, view.shape[1], view.dtype, view.on_device, view.kind,
                            view.device, view.shape[0], mv.shape[0], m_dev=mv)
    splits = _host_splits(m_splits, view.shape[0])
    if len(splits) == 0:
        raise ValueError("m_splits: expected at least one expert")
    ld = row_stride(view)
    ptrs, lds = _split_pointers(splits, view.ptr, ld, view.itemsize)
    return GroupedInput(view, splits, view.shape[1], view.dtype, view.on_device, view.kind,
                        view.device, view.shape[0], len(splits), ptrs, lds)


def _normalize_list(inputs, m_splits, dtype) -> GroupedInput:
    """A list of experts, every array viewed and checked (:func:`_check_views` raises naming the
    first one that is refused)."""
    views = [as_view(x, dtype=dtype, arg=f"inputs[{i}]") for i, x in enumerate(inputs)]
    _check_views(views, True)
    splits = tuple([v.shape[0] for v in views])
    _check_list_splits(m_splits, splits)
    first = views[0]
    return GroupedInput(first, splits, first.shape[1], first.dtype, first.on_device, first.kind,
                        first.device, sum(splits), len(splits),
                        np.array([v.ptr for v in views], dtype=np.uint64),
                        np.array([row_stride(v) for v in views], dtype=np.int64))


def _check_list_splits(m_splits, splits: tuple[int, ...]) -> None:
    if m_splits is not None and _host_splits(m_splits, sum(splits)) != splits:
        raise ValueError("m_splits: must be None (or equal the row counts) when inputs is "
                         f"a list; got {m_splits}")


def _uniform_rows(inputs, first: ArrayView):
    """``(splits, pointers, row strides)`` of a list of NumPy arrays or torch tensors that are all
    of ``inputs[0]``'s Python type, dtype object (and device), 2-D with its ``k`` columns, and
    laid out as the kernels read them; None when any is not, or ``inputs[0]`` itself would be
    refused (then :func:`_normalize_list` views and checks each one and says what is wrong).

    Per array this is what :func:`~cugrouped._array.as_view` and :func:`_check_views` would
    find, read straight from the array (no view object, no per-array name for an error that
    cannot happen): the list form costs per expert, and as_view's generality (any kind, dtype
    tags, NumPy's byte strides checked and divided) costs ~1 us of it. NumPy's pointer
    (``ctypes.data``, ~1 us) has no cheaper reader."""
    kind, shape, owner = first.kind, first.shape, first.owner
    if kind not in ("numpy", "torch") or len(shape) != 2 or shape[1] < 1 or \
            first.dtype not in FLOAT_INPUT_DTYPES or first.device != _own_device(owner, kind):
        return None
    k = shape[1]
    cls, dt = type(owner), owner.dtype
    splits, ptrs, lds = [], [], []
    if kind == "torch":
        dev = owner.device
        for x in inputs:
            if type(x) is not cls or x.dtype is not dt or x.device != dev or x.ndim != 2:
                return None
            (m, kx), (s0, s1) = x.shape, x.stride()
            if kx != k or not (s1 == 1 and s0 >= k or rows_readable((m, k), (s0, s1))):
                return None
            splits.append(m)
            ptrs.append(x.data_ptr())
            lds.append(s0 if m > 1 else k)
        return tuple(splits), ptrs, lds
    isz = dt.itemsize
    for x in inputs:
        if type(x) is not cls or x.dtype is not dt or x.ndim != 2:
            return None
        (m, kx), (b0, b1) = x.shape, x.strides
        if kx != k or b0 % isz or b1 % isz or \
                not (b1 == isz and b0 >= k * isz or
                     rows_readable((m, k), (b0 // isz, b1 // isz))):
            return None
        splits.append(m)
        ptrs.append(x.ctypes.data)
        lds.append(b0 // isz if m > 1 else k)
    return tuple(splits), ptrs, lds


def _own_device(x, kind: str) -> int:
    """The device ordinal an array's own attributes give (-1: host). The arrays after ``inputs[0]``
    are read directly, so ``inputs[0]``'s view must say the same; one that does not (a test's
    host array standing in for a device array) takes the general path."""
    if kind == "numpy":
        return -1
    d = x.device
    return -1 if d.type == "cpu" else d.index or 0


def _normalize_gather(inputs, m_splits, dtype, splits_on_device, row_index) -> GroupedInput:
    """Gather (fused MoE permute): ``inputs`` is the ``(tokens, k)`` matrix, and expert ``i``'s
    rows are ``inputs[row_index[o_i : o_i + m_i]]`` with ``o_i`` the sum of the counts before."""
    if isinstance(inputs, (list, tuple)):
        raise ValueError("row_index: gathers rows of a single (tokens, k) inputs array, not a list")
    view = as_view(inputs, dtype=dtype, arg="inputs")
    if len(view.shape) != 2:
        raise ValueError(f"inputs: expected a 2-D (tokens, k) array, got shape {view.shape}")
    if m_splits is None:
        raise ValueError("m_splits: required with row_index (the count of each expert's rows)")
    _check_views([view], False)
    iv = _check_row_index(row_index, view)
    rows = iv.shape[0]
    ld = row_stride(view)
    if splits_on_device:
        mv = _device_splits(m_splits, view)
        return GroupedInput(view, None, view.shape[1], view.dtype, view.on_device, view.kind,
                            view.device, rows, mv.shape[0], m_dev=mv, row_index=iv,
                            src_rows=view.shape[0])
    try:
        splits = _host_splits(m_splits, rows)
    except ValueError as err:
        raise ValueError(str(err).replace("but inputs has", "but row_index has")) from None
    if len(splits) == 0:
        raise ValueError("m_splits: expected at least one expert")
    E = len(splits)
    return GroupedInput(view, splits, view.shape[1], view.dtype, view.on_device, view.kind,
                        view.device, rows, E, np.full(E, view.ptr, dtype=np.uint64),
                        np.full(E, ld, dtype=np.int64), row_index=iv, src_rows=view.shape[0])


@functools.lru_cache(maxsize=64)   # same splits, same buffer: same pointers (arrays read-only)
def _split_pointers(splits: tuple[int, ...], ptr: int, ld: int, itemsize: int):
    """First-element pointers and row strides of the experts of one ``(sum(splits), k)`` array."""
    first_rows = exclusive_cumsum(splits)
    ptrs = np.uint64(ptr) + (first_rows * (ld * itemsize)).astype(np.uint64)
    lds = np.full(len(splits), ld, dtype=np.int64)
    ptrs.flags.writeable = lds.flags.writeable = False
    return ptrs, lds


def _check_views(views: list[ArrayView], is_list: bool) -> None:
    first = views[0]
    if len(first.shape) != 2:
        raise ValueError(f"inputs{'[0]' if is_list else ''}: expected a 2-D (m_i, k) array, got "
                         f"shape {first.shape}")
    k, dt, place = first.shape[1], first.dtype, (first.kind, first.device)
    if dt not in FLOAT_INPUT_DTYPES:
        hint = (" (CuPy callers pass bfloat16 as a uint16 view with dtype='bfloat16')"
                if first.kind == "cupy" else "")
        raise TypeError(f"inputs{'[0]' if is_list else ''}: expected dtype float32, float16 or "
                        f"bfloat16, got {dt}{hint}")
    for i, v in enumerate(views):
        shape = v.shape
        if len(shape) == 2 and shape[1] == k and v.dtype == dt and (v.kind, v.device) == place and \
                rows_readable(shape, v.strides):
            continue                                   # the common case: one test per view
        name = f"inputs[{i}]" if is_list else "inputs"
        if len(shape) != 2:
            raise ValueError(f"{name}: expected a 2-D (m_i, k) array, got shape {shape}")
        if v.dtype != dt:
            raise TypeError(f"{name}: dtype {v.dtype} differs from inputs[0]'s {dt}")
        if shape[1] != k:
            raise ValueError(f"{name}: has k={shape[1]} columns, inputs[0] has {k}")
        if (v.kind, v.device) != place:
            raise ValueError(f"{name}: is a {v.kind} array on device {v.device}, inputs[0] is a "
                             f"{first.kind} array on device {first.device}")
        raise ValueError(f"{name}: expected rows with unit column stride (row-major), got "
                         f"strides {v.strides} (in elements) for shape {shape}")
    if k < 1:
        raise ValueError(f"inputs: expected k >= 1 columns, got {k}")


_FLT_MIN = float(np.finfo(np.float32).tiny)


def check_scale_options(amax_epsilon, power_2_scale, scale) -> float:
    """TransformerEngine's current-scaling options; returns ``amax_epsilon`` as the float32 value
    the kernel compares with. They shape the scale computed from this call's amax, so they need
    ``scale=None``; the epsilon must be 0 or a positive normal float32 (a denormal one would be
    flushed to 0 by the GPU's comparison, not by the CPU's)."""
    if not isinstance(power_2_scale, (bool, np.bool_)):
        raise TypeError(f"power_2_scale: expected a bool, got {power_2_scale!r}")
    if isinstance(amax_epsilon, (bool, np.bool_)) or \
            not isinstance(amax_epsilon, (int, float, np.integer, np.floating)):
        raise TypeError(f"amax_epsilon: expected a float, got {amax_epsilon!r}")
    if type(amax_epsilon) is float and amax_epsilon == 0.0:
        eps = amax_epsilon          # the default: its float32 value is itself (-0.0 too)
    else:
        with np.errstate(over="ignore"):      # ~3 us, on every call
            eps = float(np.float32(amax_epsilon))
    if not (eps == 0.0 or _FLT_MIN <= eps < float("inf")):
        raise ValueError(f"amax_epsilon: expected 0 or a finite float32 >= {_FLT_MIN:.9g} (the "
                         f"smallest normal), got {amax_epsilon!r}")
    if scale is not None and (eps != 0.0 or power_2_scale):
        raise ValueError("amax_epsilon, power_2_scale: options of current scaling (scale=None); "
                         "a given scale is used as it is")
    return eps
