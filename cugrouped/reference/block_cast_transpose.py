"""NumPy reference of ``multi_block_cast_transpose``: the bits ``kernels_cu/block_cast_transpose.cu``
must reproduce.

Per expert ``x`` (``(m, k)``, float32 after FTZ) and ``m_pad = roundup(m, align)``:

* a block's amax is ``max |x|`` over its elements (NaN ignored); elements outside ``x`` (rows
  ``m..``, columns ``k..``) are zeros. Its scale is ``compute_scale(amax, fmt, 0, amax_epsilon,
  power_2_scale)`` and its bytes ``quantize(x, scale)`` (:mod:`.fp8`);
* 1-D: the row-wise blocks are 128 columns of one row; the column-wise blocks (of ``data_t``) 128
  rows of one column, rows counted in the padded expert, so they restart at every expert;
* 2-D: 128 x 128 blocks, the same for both copies;
* ``scale_inv = scale_inverse(scale)`` laid out as :mod:`cugrouped.grouped_block_fp8` says, the
  layouts' padding entries included (padding rows / columns / blocks are zeros);
* MXFP8 (``MX_DIMS``): blocks of 32 elements along the rows of ``data`` and of ``data_t``
  (``(k, m_pad)``, zero columns ``m..``), the E8M0 byte ``mx_scale_byte(amax)`` and the bytes
  ``quantize(x, mx_element_scale(byte))``; the compact byte matrices padded with 0x00 and
  swizzled (:func:`cugrouped.grouped_block_fp8.mx_swizzle`).
"""

from __future__ import annotations

import numpy as np

from ..grouped_block_fp8 import (BLOCK, MX_BLOCK, MX_DIMS, GroupedBlockFP8, GroupedMXFP8,
                                 block_scale_shapes, mx_swizzle, result_type, scale_dtype)
from . import activation as ract
from . import fp8 as rfp8
from .pad_cast_transpose import _expert_arrays, copy_into, gather_rows

__all__ = ["multi_block_cast_transpose", "multi_mxfp8_cast_transpose", "block_amax",
           "block_column_sums"]


def _zero_padded(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
    z = np.zeros((rows, cols), np.float32)
    z[: x.shape[0], : x.shape[1]] = x
    return z


def block_amax(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """``(rows, cols)``-block maxima of ``|x|`` (NaN ignored; outside ``x`` counts as zero), shape
    ``(ceil(m / rows), ceil(k / cols))``."""
    m, k = x.shape
    gr, gc = -(-m // rows), -(-k // cols)
    z = np.abs(_zero_padded(x, gr * rows, gc * cols)).reshape(gr, rows, gc, cols)
    return np.fmax.reduce(np.fmax.reduce(z, axis=3, initial=np.float32(0)), axis=1,
                          initial=np.float32(0)).astype(np.float32)


def block_column_sums(x: np.ndarray) -> np.ndarray:
    """float32 column sums of ``x`` (float32, FTZ applied) in the block kernel's order: rows
    padded with +0 to whole 128-row tiles; in a tile, thread rows ``r + 32 i`` (i = 0..3) in turn
    for ``r = 4 w + g`` (warp w, row group g), then ``(g0 + g1) + (g2 + g3)``, then the 8 warps in
    turn; then the tiles in turn. Every addition rounded to float32 and flushed."""
    m, k = x.shape
    if m == 0:
        return np.zeros(k, np.float32)
    tiles = -(-m // BLOCK)
    z = np.zeros((tiles * BLOCK, k), np.float32)
    z[:m] = x
    t = z.reshape(tiles, 4, 8, 4, k)          # (tile, i, warp, group, k): row = 32 i + 4 w + g
    f = rfp8.ftz
    with np.errstate(invalid="ignore", over="ignore"):     # inf + -inf is NaN, as on the GPU
        return _tile_sums(t, f, tiles)


def _tile_sums(t, f, tiles):
    s = t[:, 0]
    for i in range(1, 4):
        s = f(s + t[:, i])                       # (tile, warp, group, k)
    g = f(f(s[:, :, 0] + s[:, :, 1]) + f(s[:, :, 2] + s[:, :, 3]))   # (tile, warp, k)
    acc = g[:, 0]
    for w in range(1, 8):
        acc = f(acc + g[:, w])                   # (tile, k)
    total = acc[0]
    for r in range(1, tiles):
        total = f(total + acc[r])
    return total.astype(np.float32)


def _expand(s: np.ndarray, rows: int, cols: int, shape) -> np.ndarray:
    """Per-block values broadcast to every element of a ``shape`` array."""
    return np.repeat(np.repeat(s, rows, axis=0), cols, axis=1)[: shape[0], : shape[1]]


def _scale(amax, fmt, eps, p2) -> np.ndarray:
    return rfp8.compute_scale(amax, fmt, 0, eps, p2).astype(np.float32)


def _mx_quantize(z: np.ndarray, fmt):
    """MXFP8 of ``z`` ``(R, C)``: its bytes and its swizzled E8M0 scales (flat)."""
    R, C = z.shape
    e = rfp8.mx_scale_byte(block_amax(z, 1, MX_BLOCK), fmt)              # (R, ceil(C / 32))
    q = rfp8.quantize(z, _expand(rfp8.mx_element_scale(e), 1, MX_BLOCK, z.shape), fmt)
    compact = np.zeros((-(-R // BLOCK) * BLOCK, -(-e.shape[1] // 4) * 4), np.uint8)
    compact[:R, : e.shape[1]] = e
    return q.reshape(R, C), mx_swizzle(compact)


def _expert(x, m_pad, fmt, dims, eps, p2):
    """(row-wise bytes, row-wise scale_inv 2-D, transposed bytes (k, m_pad), its scale_inv 2-D);
    MXFP8: the scales flat (swizzled)."""
    m, k = x.shape
    if dims == MX_DIMS:
        q, sinv = _mx_quantize(x, fmt)
        qt, sinv_t = _mx_quantize(np.ascontiguousarray(_zero_padded(x, m_pad, k).T), fmt)
        return q, sinv, qt, sinv_t
    (r0, r1), (c0, c1) = block_scale_shapes(m, m_pad, k, dims)
    pad_inv = rfp8.scale_inverse(_scale(np.float32(0), fmt, eps, p2))   # a block of zeros
    if dims == 1:
        s_row = _scale(block_amax(x, 1, BLOCK), fmt, eps, p2)            # (m, ceil(k/128))
        q = rfp8.quantize(x, _expand(s_row, 1, BLOCK, x.shape), fmt).reshape(m, k)
        sinv = np.full((r1, r0), pad_inv, np.float32)                  # (roundup(m, 4), bk)
        sinv[:m] = rfp8.scale_inverse(s_row)
        xp = _zero_padded(x, m_pad, k)
        s_col = _scale(block_amax(xp, BLOCK, 1), fmt, eps, p2)           # (ceil(m_pad/128), k)
        qt = rfp8.quantize(xp, _expand(s_col, BLOCK, 1, xp.shape), fmt).reshape(m_pad, k).T
        sinv_t = np.full((c0, c1), pad_inv, np.float32)
        sinv_t[:, :k] = rfp8.scale_inverse(s_col)
        return q, sinv.T.copy(), np.ascontiguousarray(qt), sinv_t
    s = _scale(block_amax(x, BLOCK, BLOCK), fmt, eps, p2)                # (bm, bk)
    q = rfp8.quantize(x, _expand(s, BLOCK, BLOCK, x.shape), fmt).reshape(m, k)
    sinv = np.full((r0, r1), pad_inv, np.float32)
    sinv[:, : s.shape[1]] = rfp8.scale_inverse(s)
    qt = np.zeros((k, m_pad), np.uint8)
    qt[:, :m] = q.T
    sinv_t = np.full((c0, c1), pad_inv, np.float32)
    sinv_t[:, : s.shape[0]] = rfp8.scale_inverse(s).T
    return q, sinv, qt, sinv_t


def multi_block_cast_transpose(inputs, m_splits=None, *, fp8_format="e4m3", block_scaling_dim=1,
                               align=16, rowwise=True, columnwise=True, amax_epsilon=0.0,
                               power_2_scale=True, out=None, dtype=None,
                               backend=None, row_index=None, column_sums=False,
                               activation=None) -> GroupedBlockFP8:
    """Same signature and result as :func:`cugrouped.multi_block_cast_transpose`, NumPy only
    (``block_scaling_dim=MX_DIMS``: :func:`multi_mxfp8_cast_transpose`'s MXFP8, which has no
    ``amax_epsilon`` or ``power_2_scale``)."""
    from ..ops._cast_inputs import check_scale_options
    from ..ops.block_cast_transpose import check_block_activation, check_block_options
    from ..ops.pad_cast_transpose import normalized_input, padded_splits

    if backend not in (None, "reference"):
        raise ValueError(f"backend: the reference twin only runs backend='reference', got {backend!r}")
    check_block_options(fp8_format, block_scaling_dim, align, rowwise, columnwise, column_sums)
    eps = check_scale_options(amax_epsilon, power_2_scale, None)
    check_block_activation(activation, block_scaling_dim, column_sums, row_index is not None)
    g = normalized_input(inputs, m_splits, dtype, row_index=row_index, activation=activation)
    if g.on_device:
        raise ValueError("inputs: the reference needs host (NumPy) arrays")
    if row_index is not None:      # the permute: rows gathered, a negative index a zero row
        inputs, m_splits, dtype = gather_rows(inputs, row_index, dtype, g.k), g.m_splits, None
    xs = [ract.apply(rfp8.ftz(rfp8.to_float32(a)), activation)
          for a in _expert_arrays(inputs, m_splits, dtype)]
    m_pad = padded_splits(g.m_splits, align)
    parts = [_expert(x, mp, fp8_format, block_scaling_dim, eps, power_2_scale)
             for x, mp in zip(xs, m_pad)]

    def cat(j, dtype):
        return np.concatenate([p[j].reshape(-1) for p in parts]) if parts else np.zeros(0, dtype)

    sdt = scale_dtype(block_scaling_dim)
    res = result_type(block_scaling_dim)(
        data=cat(0, np.uint8).reshape(g.total_rows, g.k).view(rfp8.fp8_dtype(fp8_format))
        if rowwise else None,
        data_t=cat(2, np.uint8) if columnwise else None,
        scale_inv=cat(1, sdt) if rowwise else None,
        scale_inv_t=cat(3, sdt) if columnwise else None,
        m_splits=g.m_splits, m_pad_splits=m_pad, fp8_format=fp8_format, k=g.k, align=align,
        block_scaling_dim=block_scaling_dim,
        column_sums=np.stack([block_column_sums(x) for x in xs]) if column_sums else None,
        total_rows=g.total_rows)
    if out is not None:
        from ..ops.block_cast_transpose import check_out

        check_out(g, align, block_scaling_dim, rowwise, columnwise, out, column_sums, fp8_format)
        copy_into(res, out, ("data", "data_t", "scale_inv", "scale_inv_t") +
                  (("column_sums",) if column_sums else ()))
    return res


def multi_mxfp8_cast_transpose(inputs, m_splits=None, *, fp8_format="e4m3", align=32, rowwise=True,
                               columnwise=True, out=None, dtype=None, backend=None,
                               row_index=None, column_sums=False, activation=None) -> GroupedMXFP8:
    """Same signature and result as :func:`cugrouped.multi_mxfp8_cast_transpose`, NumPy only."""
    return multi_block_cast_transpose(
        inputs, m_splits, fp8_format=fp8_format, block_scaling_dim=MX_DIMS, align=align,
        rowwise=rowwise, columnwise=columnwise, out=out, dtype=dtype, backend=backend,
        row_index=row_index, column_sums=column_sums, activation=activation)
