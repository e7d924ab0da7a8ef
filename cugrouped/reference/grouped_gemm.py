"""NumPy reference twins of the grouped GEMMs (:func:`cugrouped.grouped_fprop`, ``grouped_dgrad``,
``grouped_wgrad``), with the same signatures, for host arrays.

Written from the contract (design.md §4), not from the cuBLASLt path: each operand is dequantized
exactly (FP8 value times its expert's ``scale_inv``, in float64, where the product is exact), the
product is computed in float64, then the bias is added and the result rounded once to the output
dtype (round to nearest even; ml_dtypes and NumPy round float64 directly). With
``accumulate=True`` the existing gradient is added in float64 before that single rounding.
Only the unpadded part of a transposed FP8 copy is read: the padding is defined to be zero.
The argument checks are the op's own (:mod:`cugrouped.ops.grouped_gemm`).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..grouped_block_fp8 import GroupedBlockFP8
from ..grouped_fp8 import GroupedFP8
from . import fp8 as rfp8

__all__ = ["grouped_fprop", "grouped_dgrad", "grouped_wgrad", "expert_matrices"]

_NP_DTYPE = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
             "float32": np.dtype(np.float32)}


def expert_matrices(op, copy: str) -> list[np.ndarray]:
    """Per-expert float64 matrices of an operand, in the math's orientation.

    A :class:`GroupedFP8` (or :class:`GroupedBlockFP8`, each block by its own ``scale_inv``)
    gives ``fp8 * scale_inv`` from its row-wise copy (``copy="rowwise"``,
    ``(m_i, k)``) or from the unpadded part of its transposed copy (``"columnwise"``, returned
    transposed back to ``(m_i, k)``); a list of arrays (or a 3-D array) gives each array as float64.
    """
    if isinstance(op, GroupedBlockFP8):
        return [_block_matrix(op, i, m, copy) for i, m in enumerate(op.m_splits)]
    if isinstance(op, GroupedFP8):
        out = []
        for i, m in enumerate(op.m_splits):
            q = op.rowwise(i) if copy == "rowwise" else op.columnwise(i)[:, :m].T
            vals = rfp8.fp8_to_float(np.asarray(q).view(np.uint8), op.fp8_format).astype(np.float64)
            out.append(vals * np.float64(np.asarray(op.scale_inv)[i]))
        return out
    return [rfp8.to_float32(np.asarray(a)).astype(np.float64) for a in op]


def _block_matrix(op: GroupedBlockFP8, i: int, m: int, copy: str) -> np.ndarray:
    """Expert ``i`` of a block-scaled operand: every FP8 value times its block's ``scale_inv``,
    in float64 (exact), ``(m_i, k)``."""
    if copy == "rowwise":
        q, s = np.asarray(op.rowwise(i)), np.asarray(op.rowwise_scale_inv(i))
        rows, cols = m, op.k
    else:   # the stored (k, m_pad) copy, its unpadded columns
        q, s = op.columnwise(i)[:, :m], np.asarray(op.columnwise_scale_inv(i))
        rows, cols = op.k, m
    rr, cc = np.arange(rows)[:, None], np.arange(cols)[None, :]
    sc = op._element_scales(s, rr, cc)      # each element's block scale (MXFP8: 2^(e - 127))
    vals = rfp8.fp8_to_float(np.asarray(q).view(np.uint8), op.fp8_format).astype(np.float64)
    x = vals * sc.astype(np.float64)
    return x if copy == "rowwise" else x.T


def _round(y: np.ndarray, out_dtype: str) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(y, dtype=np.float64).astype(_NP_DTYPE[out_dtype])


def _write_rows(ys, out, out_dtype):
    rows = sum(y.shape[0] for y in ys)
    cols = ys[0].shape[1]
    res = _round(np.concatenate(ys, axis=0) if rows else np.zeros((0, cols)), out_dtype)
    if out is None:
        return res
    out_arr = np.asarray(out)
    out_arr[...] = res.view(out_arr.dtype) if out_arr.dtype.kind in "ui" else res
    return out


def _check_host(problem, backend):
    if backend not in (None, "reference"):
        raise ValueError(f"backend: the reference twin only runs backend='reference', got {backend!r}")
    if problem.place[0]:
        raise ValueError("the reference needs host (NumPy) arrays; got device arrays")
    if problem.place[2] == "torch":
        raise TypeError("the reference needs NumPy arrays; CPU torch tensors go through "
                        "cugrouped.pytorch (or pass tensor.numpy())")


def grouped_fprop(x, w, bias=None, *, m_splits=None, out=None, out_dtype=None, fast_accum=True,
                  backend=None):
    """Same signature and result as :func:`cugrouped.grouped_fprop`, NumPy arrays only."""
    from ..ops.grouped_gemm import check_fprop, outputs, split_rows

    x = split_rows(x, m_splits, "x")

    problem = check_fprop(x, w, bias, out_dtype=out_dtype, fast_accum=fast_accum)
    _check_host(problem, backend)
    outputs(problem, out, np)  # the op's output checks
    xs, ws = expert_matrices(x, "rowwise"), expert_matrices(w, "rowwise")
    ys = [xi @ wi.T for xi, wi in zip(xs, ws)]
    if bias is not None:
        bs = [np.asarray(b) for b in bias]
        bs = [rfp8.to_float32(b, dtype=problem.bias_dtype if b.dtype.kind in "ui" else None)
              .astype(np.float64) for b in bs]
        ys = [y + b[None, :] for y, b in zip(ys, bs)]
    return _write_rows(ys, out, problem.out_dtype)


def grouped_dgrad(dy, w, *, m_splits=None, out=None, out_dtype=None, fast_accum=False,
                  backend=None):
    """Same signature and result as :func:`cugrouped.grouped_dgrad`, NumPy arrays only."""
    from ..ops.grouped_gemm import check_dgrad, outputs, split_rows

    dy = split_rows(dy, m_splits, "dy")

    problem = check_dgrad(dy, w, out_dtype=out_dtype, fast_accum=fast_accum)
    _check_host(problem, backend)
    outputs(problem, out, np)
    dys = expert_matrices(dy, "rowwise")
    ws = expert_matrices(w, "columnwise")  # (n, k) per expert either way
    return _write_rows([d @ wi for d, wi in zip(dys, ws)], out, problem.out_dtype)


def grouped_wgrad(x, dy, *, m_splits=None, out=None, accumulate=False, out_dtype=None,
                  fast_accum=False, backend=None):
    """Same signature and result as :func:`cugrouped.grouped_wgrad`, NumPy arrays only."""
    from ..ops.grouped_gemm import check_wgrad, outputs, split_rows

    x, dy = split_rows(x, m_splits, "x"), split_rows(dy, m_splits, "dy")

    problem = check_wgrad(x, dy, out_dtype=out_dtype, fast_accum=fast_accum, accumulate=accumulate)
    _check_host(problem, backend)
    given = out
    out, _ = outputs(problem, out, np)
    xs, dys = expert_matrices(x, "columnwise"), expert_matrices(dy, "columnwise")
    out_dtype = problem.out_dtype
    targets = list(out) if isinstance(out, (list, tuple)) else [out[i] for i in range(len(xs))]
    for t, xi, di in zip(targets, xs, dys):
        t_arr = np.asarray(t)
        as_out = t_arr.view(_NP_DTYPE[out_dtype]) if t_arr.dtype.kind in "ui" else t_arr
        if accumulate and xi.shape[0] == 0:
            continue  # an accumulated gradient is left untouched by an expert with no tokens
        g = di.T @ xi  # (n, k); zero for an empty expert
        if accumulate:
            g = g + rfp8.to_float32(as_out).astype(np.float64)
        as_out[...] = _round(g, out_dtype)
    return out if given is None else given
