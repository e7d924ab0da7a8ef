"""NumPy reference twin of :func:`cugrouped.multi_pad_cast_transpose`: defines the output bits.

Written from the contract (design.md §3, §4), not from the kernel: per expert, ``x`` in float32,
denormals flushed (the GPU compiles with ``-ftz=true``), ``amax = max |x|`` (NaN ignored),
``q = fp8(ftz(x * scale))`` with round-to-nearest-even and saturation, the transposed copy padded
with zero bytes to ``m_pad = ceil(m / align) * align`` columns.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..grouped_fp8 import GroupedFP8
from . import activation as ract
from . import fp8 as rfp8

__all__ = ["multi_pad_cast_transpose", "column_sums_in_kernel_order", "merge_amax"]

TILE_M = 64   # the kernel's tile height: its column sums are ordered by tiles of 64 rows


def column_sums_in_kernel_order(x: np.ndarray, m_pad: int) -> np.ndarray:
    """Column sums of ``x`` (float32 ``(m, k)``, denormals already flushed) in the kernel's order.

    Float addition is not associative, so the bits depend on the order; the kernel fixes it:
    per 64-row tile (rows m .. m_pad are zeros), rows r and r + 32 first, then the four row groups
    of a warp pairwise ``(g0 + g1) + (g2 + g3)`` (r = 4 * warp + g), then the 8 warps in order,
    then the tiles in order. Every partial sum is flushed to zero if denormal, as on the GPU.
    """
    m, k = x.shape
    tiles = max(1, -(-m_pad // TILE_M))
    xp = np.zeros((tiles * TILE_M, k), dtype=np.float32)
    xp[:m] = x
    t = xp.reshape(tiles, TILE_M, k)
    with np.errstate(invalid="ignore", over="ignore"):   # inf - inf is NaN here as on the GPU
        p = rfp8.ftz(t[:, :32] + t[:, 32:]).reshape(tiles, 8, 4, k)
        w = rfp8.ftz(rfp8.ftz(p[:, :, 0] + p[:, :, 1]) + rfp8.ftz(p[:, :, 2] + p[:, :, 3]))
        s = w[:, 0]
        for i in range(1, 8):
            s = rfp8.ftz(s + w[:, i])
        acc = s[0]
        for i in range(1, tiles):
            acc = rfp8.ftz(acc + s[i])
    return acc.astype(np.float32)

def merge_amax(old, new) -> np.ndarray:
    """``amax_accumulate``'s merge, float32 bits: ``ftz(old) > new ? old : new``. That is
    ``np.fmax(old, new)`` for every ``old`` but NaN (replaced by ``new``, as ``fmaxf`` drops NaN;
    ``new`` is never NaN), denormals (0 under the GPU's FTZ) and -0 (ties go to ``new``)."""
    old = np.asarray(old, dtype=np.float32)
    new = np.asarray(new, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        return np.where(rfp8.ftz(old) > new, old, new).astype(np.float32)


_CARRIED = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _expert_arrays(inputs, m_splits, dtype) -> list[np.ndarray]:
    def retag(a):
        a = np.asarray(a)
        if dtype is not None and a.dtype.name != dtype:
            a = a.view(_CARRIED[dtype])
        return a

    if isinstance(inputs, (list, tuple)):
        return [retag(a) for a in inputs]
    x = retag(inputs)
    bounds = np.cumsum([0] + [int(m) for m in m_splits])
    return [x[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]


def gather_rows(tokens, row_index, dtype, k: int) -> np.ndarray:
    """The permute the fused gathers perform: float32 rows ``tokens[row_index]``, a negative
    index a zero row (so is every row when there are no tokens)."""
    t = rfp8.to_float32(tokens, dtype)
    idx = np.asarray(row_index)
    if t.shape[0] == 0:
        t = np.zeros((1, k), np.float32)
    return np.where((idx >= 0)[:, None], t[np.maximum(idx, 0)], np.float32(0)).astype(np.float32)


def multi_pad_cast_transpose(inputs, m_splits=None, *, fp8_format="e4m3", scale=None, margin=0,
                             align=16, rowwise=True, columnwise=True, column_sums=False, out=None,
                             dtype=None, backend=None, amax_accumulate=False, amax_epsilon=0.0,
                             power_2_scale=False, row_index=None, activation=None) -> GroupedFP8:
    """Same signature and result as :func:`cugrouped.multi_pad_cast_transpose`, NumPy arrays only
    (``activation``: :func:`cugrouped.reference.activation.apply` on each expert's rows)."""
    from ..ops._cast_inputs import check_scale_options  # the op's checks
    from ..ops.pad_cast_transpose import (check_activation, check_amax_accumulate,
                                          check_out_format, normalized_input, padded_splits)

    if backend not in (None, "reference"):
        raise ValueError(f"backend: the reference twin only runs backend='reference', got {backend!r}")
    check_amax_accumulate(amax_accumulate, scale, out)
    if out is not None:
        check_out_format(out, fp8_format)
    eps = check_scale_options(amax_epsilon, power_2_scale, scale)
    check_activation(activation, column_sums, row_index is not None)
    g = normalized_input(inputs, m_splits, dtype, row_index=row_index, activation=activation)
    if g.on_device:
        raise ValueError("inputs: the reference needs host (NumPy) arrays")
    if row_index is not None:
        inputs, m_splits, dtype = gather_rows(inputs, row_index, dtype, g.k), g.m_splits, None
    xs = [ract.apply(rfp8.ftz(rfp8.to_float32(a)), activation)
          for a in _expert_arrays(inputs, m_splits, dtype)]
    E, k = len(xs), g.k
    m_pad = padded_splits(g.m_splits, align)
    amax = np.array([rfp8.amax_of(x) for x in xs], dtype=np.float32)
    if amax_accumulate:
        amax = merge_amax(np.asarray(out.amax), amax)
    if scale is None:
        sc = rfp8.compute_scale(amax, fp8_format, margin, eps, power_2_scale).astype(np.float32)
    else:
        sc = np.asarray(scale, dtype=np.float32).reshape(E)
    scale_inv = rfp8.scale_inverse(sc)
    qs = [rfp8.quantize(x, sc[i], fp8_format).reshape(x.shape) for i, x in enumerate(xs)]
    data = np.concatenate(qs, axis=0) if rowwise else None
    if data is not None and data.shape != (sum(g.m_splits), k):
        data = data.reshape(sum(g.m_splits), k)
    data_t = None
    if columnwise:
        blocks = []
        for q, mp in zip(qs, m_pad):
            t = np.zeros((k, mp), dtype=np.uint8)
            t[:, : q.shape[0]] = q.T
            blocks.append(t.reshape(-1))
        data_t = np.concatenate(blocks) if blocks else np.zeros(0, np.uint8)
    fp8_dtype = rfp8.fp8_dtype(fp8_format)
    res = GroupedFP8(
        data=data.view(fp8_dtype) if data is not None else None, data_t=data_t,
        m_splits=g.m_splits, m_pad_splits=m_pad, amax=amax,
        scale=sc if scale is None else scale, scale_inv=scale_inv, fp8_format=fp8_format, k=k,
        align=align,
        column_sums=np.stack([column_sums_in_kernel_order(x, mp) for x, mp in zip(xs, m_pad)])
        if column_sums else None)
    if out is not None:
        names = ("data", "data_t", "amax", "scale_inv") + (("scale",) if scale is None else ()) + \
            (("column_sums",) if column_sums else ())
        copy_into(res, out, names)
    return res


def copy_into(res, out, names) -> None:
    """Write ``res``'s buffers ``names`` into ``out``'s (FP8 as bytes) and make ``res`` hold
    ``out``'s, viewed with ``res``'s dtypes (the call's FP8 format, whatever ``out``'s buffer
    was typed as): what ``out=`` means for the reference twins."""
    for name in names:
        src = getattr(res, name)
        if src is not None:
            dst = getattr(out, name)
            one_byte = src.dtype.itemsize == 1
            np.copyto(dst.view(np.uint8) if one_byte else dst,
                      src.view(np.uint8) if one_byte else src)
            setattr(res, name, dst.view(src.dtype) if one_byte else dst)
