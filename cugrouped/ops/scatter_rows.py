"""``scatter_rows``: rows summed onto tokens by index, the same bits on every run (no atomics).

The adjoint of the MoE permute: the gradient of ``tokens[row_index]`` is, for every token, the
sum of the gradients of the rows gathered from it. Host side of ``kernels_cu/scatter_rows.cu``:
the caller passes the grouping as ``order`` (the row numbers sorted stably by their token) and
``seg`` (where each token's rows start in ``order``; :func:`cugrouped.reference.scatter_plan`
computes both, and the torch layer does it on the device with ``argsort`` + ``searchsorted``,
no host sync). One launch; float32 output.
"""

from __future__ import annotations

import numpy as np

from .. import _jit
from .._array import as_view
from . import _launch

__all__ = ["scatter_rows", "KERNEL_SPEC", "kernel_name", "THREADS", "plan_grid"]

THREADS = 256          # must match CG_SR_THREADS in kernels_cu/scatter_rows.cu
_IN = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def kernel_name(dtype: str) -> str:
    return f"cg::scatter_rows_kernel<cg::InDtype::{_IN[dtype]}>"


KERNEL_SPEC = _jit.register("scatter_rows", _jit.KernelSpec(
    source="scatter_rows.cu", name_expressions=tuple(kernel_name(d) for d in _IN)))


def plan_grid(num_tokens: int, h: int) -> tuple[int, int]:
    """(column chunks per token, blocks): one block per (token, chunk of 4 x THREADS columns);
    each thread sums 4 columns."""
    chunks = max(1, -(-h // (4 * THREADS)))
    grid = num_tokens * chunks if h else 0
    if grid >= 2**31:
        raise ValueError(f"num_tokens, h: too many blocks ({grid}) for one launch")
    return chunks, grid


def _check(rows, order, seg, num_tokens, out, dtype):
    rv = as_view(rows, dtype=dtype, arg="rows")
    if len(rv.shape) != 2 or rv.dtype not in _IN:
        raise TypeError(f"rows: expected a 2-D float32, float16 or bfloat16 array, got "
                        f"{rv.dtype} of shape {rv.shape}")
    R, h = rv.shape
    if R > 1 and h > 1 and rv.strides[1] != 1:
        raise ValueError(f"rows: expected rows with unit column stride, got strides {rv.strides}")
    if not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
        raise ValueError(f"num_tokens: expected a non-negative int, got {num_tokens!r}")
    views = [rv]
    for name, a, n in (("order", order, R), ("seg", seg, num_tokens + 1)):
        v = as_view(a, arg=name)
        if v.dtype != "int64" or v.shape != (n,) or (n > 1 and v.strides[0] != 1):
            raise TypeError(f"{name}: expected a contiguous int64 array of shape ({n},), got "
                            f"{v.dtype} of shape {v.shape}")
        views.append(v)
    ov = as_view(out, arg="out")
    if ov.dtype != "float32" or ov.shape != (num_tokens, h) or \
            (num_tokens > 1 and h > 0 and ov.strides != (h, 1)):
        raise TypeError(f"out: expected a contiguous float32 array of shape ({num_tokens}, {h}), "
                        f"got {ov.dtype} of shape {ov.shape}")
    views.append(ov)
    for v, name in zip(views[1:], ("order", "seg", "out")):
        if (v.on_device, v.device) != (rv.on_device, rv.device):
            raise ValueError(f"{name}: must live where rows lives")
    return views


def scatter_rows(rows, order, seg, num_tokens: int, out, *, dtype: str | None = None,
                 backend: str | None = None):
    """``out[t] = Σ_{j in seg[t]..seg[t+1]} rows[order[j]]`` in float32, rows added in ``order``.

    ``rows``: ``(R, h)`` float32 / float16 / bfloat16 (a CuPy ``uint16`` carrier with
    ``dtype="bfloat16"``); ``order``: int64 ``(R,)``; ``seg``: int64 ``(num_tokens + 1,)``
    non-decreasing; ``out``: float32 ``(num_tokens, h)``, written (every element). The same bits
    on every run and backend (float32 sums flushed like the GPU's FTZ)."""
    rv, order_v, seg_v, out_v = _check(rows, order, seg, num_tokens, out, dtype)
    backend = _launch.resolve_backend(backend, rv.on_device)
    if backend == "reference":
        from ..reference.scatter_rows import scatter_rows as ref

        return ref(rows, order, seg, num_tokens, out, dtype=dtype)
    h = rv.shape[1]
    chunks, grid = plan_grid(num_tokens, h)
    name = kernel_name(rv.dtype)
    _launch.note_launch(backend, name, grid, THREADS)
    if grid == 0:
        return out
    ld = rv.strides[0] if rv.shape[0] > 1 else h
    scalars = (np.int64(num_tokens), np.int64(h), np.int64(chunks))
    if backend == "cuda":
        with _launch.device_scope(backend, rv.device):   # the arrays' device, not the current one
            kern = _jit.get_function(KERNEL_SPEC, name)
            kern((grid,), (THREADS,), (np.uint64(rv.ptr), np.int64(ld), np.uint64(order_v.ptr),
                                       np.uint64(seg_v.ptr)) + scalars + (np.uint64(out_v.ptr),))
    else:
        _jit.get_emulated_function(KERNEL_SPEC, name)(
            (grid,), (THREADS,), (rows, np.int64(ld), order, seg) + scalars + (out,),
            order=_launch.current_emulation_order())
    return out
