"""NumPy twin of :func:`cugrouped.ops.scatter_rows.scatter_rows`, and the grouping it takes."""

from __future__ import annotations

import numpy as np

from . import fp8 as rfp8

__all__ = ["scatter_plan", "scatter_rows"]


def scatter_plan(row_index, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, seg) for :func:`scatter_rows`: the row numbers sorted stably by token (indices
    outside ``[0, num_tokens)`` last), and where each token's rows start (``num_tokens + 1``)."""
    idx = np.asarray(row_index, dtype=np.int64)
    key = np.where((idx >= 0) & (idx < num_tokens), idx, num_tokens)
    order = np.argsort(key, kind="stable").astype(np.int64)
    seg = np.searchsorted(key[order], np.arange(num_tokens + 1), side="left").astype(np.int64)
    return order, seg


def scatter_rows(rows, order, seg, num_tokens: int, out=None, *, dtype=None) -> np.ndarray:
    """Each token's rows added in ``order``, one float32 accumulator, FTZ like the GPU."""
    x = rfp8.ftz(rfp8.to_float32(rows, dtype))
    order, seg = np.asarray(order, np.int64), np.asarray(seg, np.int64)
    counts = seg[1:] - seg[:-1]
    acc = np.zeros((num_tokens, x.shape[1]), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):   # inf - inf is NaN here as on the GPU
        for r in range(int(counts.max()) if num_tokens else 0):   # the r-th row of every token
            tok = np.nonzero(counts > r)[0]
            acc[tok] = rfp8.ftz(acc[tok] + x[order[seg[tok] + r]])
    if out is None:
        return acc
    np.copyto(np.asarray(out), acc)
    return out
