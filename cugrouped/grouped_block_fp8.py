"""``GroupedBlockFP8``: the block-scaled FP8 buffers of all experts, as written by
``multi_block_cast_transpose``, and the pure layout functions of their scales.

Block scaling (TransformerEngine's ``Float8BlockScaling``, DeepSeek-V3's recipe) gives every block
of 128 elements of a row (1-D blocks: activations, gradients) or every 128 x 128 block (2-D:
weights) a float32 scale of its own. The scales are stored as ``scale_inv`` in
TransformerEngine's GEMM-ready compact layouts, the ones cuBLASLt's ``VEC128_32F`` and
``BLK128x128_32F`` scale modes read; for an operand stored as ``(R, C)`` row-major (``data``:
``(m, k)``; ``data_t``: ``(k, m_pad)``):

* 1-D: ``(ceil(C / 128), roundup(R, 4))``, element ``[cb, r]`` for block ``cb`` of row ``r``;
* 2-D: ``(ceil(R / 128), roundup(ceil(C / 128), 4))``, element ``[rb, cb]``.

Every entry is written, the rounding-up padding too (as blocks of zeros would be scaled).

MXFP8 (TransformerEngine's ``MXFP8BlockScaling``, the OCP microscaling format of sm_100 tensor
cores; :class:`GroupedMXFP8`) gives every block of 32 elements of a row of either copy an E8M0
scale byte ``e`` (the power of two ``2^(e - 127)``), stored in the tiled ("swizzled") layout
cuBLASLt's ``VEC32_UE8M0`` mode reads. For an operand ``(R, C)`` row-major, its compact scale
matrix is ``(roundup(R, 128), roundup(ceil(C / 32), 4))`` (row ``r``, block ``cb``: padding entries
are ``0x00``, the scale of a block of zeros), cut into 128 x 4 tiles of 512 bytes, row-major over
the tiles, each tile stored as ``(r % 32) * 16 + ((r % 128) // 32) * 4 + cb % 4``
(:func:`mx_swizzle`, :func:`mx_unswizzle`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from .grouped_fp8 import FP8_FORMATS, GroupedSplits, decode_table, int_tuple

__all__ = ["GroupedBlockFP8", "GroupedMXFP8", "BLOCK", "MX_BLOCK", "MX_DIMS", "block_scale_shapes",
           "block_scale_sizes", "scale_dtype", "result_type", "mx_swizzle", "mx_unswizzle",
           "FP8_FORMATS"]

BLOCK = 128   # the scaling block length (TransformerEngine's kBlockLen; cuBLASLt's VEC128 / BLK128x128)
MX_BLOCK = 32  # MXFP8's block length (cuBLASLt's VEC32_UE8M0)
# The block_scaling_dim of MXFP8 inside cugrouped: 1 x 32 blocks of both copies, E8M0 scales in the
# swizzled layout (the kernels' DIMS == BCT_MX). Public ops take 1 or 2; MXFP8 has its own op.
MX_DIMS = 3


def _shapes(m, m_pad, k, dims):
    """The layouts' two shapes in plain integer arithmetic, so that Python ints, torch.compile's
    symbolic sizes and NumPy arrays of counts (all experts at once) go through the one formula."""
    cd = lambda v: (v + BLOCK - 1) // BLOCK  # noqa: E731
    r4 = lambda v: (v + 3) // 4 * 4           # noqa: E731
    if dims == MX_DIMS:   # compact (unswizzled) shapes of the E8M0 bytes: 512 per 128 x 128 tile
        r128 = lambda v: cd(v) * BLOCK        # noqa: E731
        c32 = lambda v: (v + MX_BLOCK - 1) // MX_BLOCK  # noqa: E731
        return (r128(m), r4(c32(k))), (r128(k), r4(c32(m_pad)))
    if dims == 1:
        return (cd(k), r4(m)), (cd(m_pad), r4(k))
    return (cd(m), r4(cd(k))), (cd(k), r4(cd(m_pad)))


def scale_dtype(dims) -> np.dtype:
    """The scales' element type of a block kind: MXFP8's E8M0 bytes (uint8) or float32
    ``scale_inv``."""
    return np.dtype(np.uint8 if dims == MX_DIMS else np.float32)


def result_type(dims) -> type:
    """The result class of a block kind: :class:`GroupedMXFP8` or :class:`GroupedBlockFP8`."""
    return GroupedMXFP8 if dims == MX_DIMS else GroupedBlockFP8


def _check_dims(dims) -> None:
    if dims not in (1, 2, MX_DIMS):
        raise ValueError(f"block_scaling_dim: expected 1 or 2 (or MX_DIMS, {MX_DIMS}: MXFP8), "
                         f"got {dims!r}")


def mx_swizzle(compact):
    """A compact ``(R, C)`` E8M0 scale matrix (``R % 128 == 0``, ``C % 4 == 0``) in the tiled
    layout cuBLASLt reads, flat: ``(R/128, 4, 32, C/4, 4)`` -> ``(R/128, C/4, 32, 4, 4)``.
    NumPy, CuPy or torch arrays."""
    R, C = compact.shape
    t = compact.reshape(R // BLOCK, 4, 32, C // 4, 4)
    t = t.permute(0, 3, 2, 1, 4) if hasattr(t, "permute") else t.transpose(0, 3, 2, 1, 4)
    return t.reshape(-1)


def mx_unswizzle(flat, rows: int, cols: int):
    """The inverse of :func:`mx_swizzle`: the compact ``(rows, cols)`` matrix (a copy)."""
    t = flat.reshape(rows // BLOCK, cols // 4, 32, 4, 4)
    t = t.permute(0, 3, 2, 1, 4) if hasattr(t, "permute") else t.transpose(0, 3, 2, 1, 4)
    return t.reshape(rows, cols)


def block_scale_shapes(m: int, m_pad: int, k: int, dims: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of one expert's row-wise and column-wise ``scale_inv`` blocks (see the module doc):
    the row-wise copy is ``(m, k)``, the column-wise one ``(k, m_pad)``."""
    _check_dims(dims)
    return _shapes(m, m_pad, k, dims)


def block_scale_entries(m, m_pad, k, dims: int) -> tuple:
    """Entries of one expert's row-wise and column-wise ``scale_inv`` blocks (no caches, no
    NumPy: torch.compile's symbolic sizes pass through)."""
    (a, b), (c, d) = _shapes(m, m_pad, k, dims)
    return a * b, c * d


def block_scale_sizes(m_splits, m_pad_splits, k: int, dims: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-expert entries of the row-wise and column-wise ``scale_inv`` buffers (read-only int64
    arrays; :func:`block_scale_shapes` vectorised over the experts, remembered per splits)."""
    return _scale_sizes(int_tuple(m_splits), int_tuple(m_pad_splits), int(k), int(dims))


@functools.lru_cache(maxsize=256)   # a training step repeats its splits per layer and pass
def _scale_sizes(m_splits: tuple, m_pad_splits: tuple, k: int, dims: int):
    _check_dims(dims)
    row, col = block_scale_entries(np.asarray(m_splits, dtype=np.int64),
                                   np.asarray(m_pad_splits, dtype=np.int64), k, dims)
    row = np.broadcast_to(row, (len(m_splits),)).astype(np.int64)
    col = np.broadcast_to(col, (len(m_splits),)).astype(np.int64)
    row.flags.writeable = col.flags.writeable = False
    return row, col


@dataclasses.dataclass(repr=False)
class GroupedBlockFP8(GroupedSplits):
    """Block-scaled FP8 copies of E experts' rows, with their per-block ``scale_inv``.

    Attributes
    ----------
    data : array ``(sum(m_splits), k)`` or None
        Row-wise FP8, experts back to back (NumPy: an ml_dtypes float8 dtype; CuPy: ``uint8``;
        torch: ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``).
    data_t : array ``(sum(k * m_pad_splits),)`` or None
        Transposed FP8, expert ``i`` a ``(k, m_pad_splits[i])`` block whose columns ``m_i:`` are
        zero. With 1-D blocks it is quantized along its own rows (128 tokens of one feature), so
        its bytes are not ``data``'s transposed; with 2-D blocks they are.
    scale_inv, scale_inv_t : float32 arrays, experts back to back
        The scales of ``data`` and ``data_t``; expert ``i``'s blocks are
        :meth:`rowwise_scale_inv` / :meth:`columnwise_scale_inv`.
    m_splits, m_pad_splits : tuple of int (or the device count array and None: the buffers are
        then sized for the worst case and the per-expert views read the counts back, a sync).
    fp8_format : ``"e4m3"`` or ``"e5m2"``;  k : int;  align : int
    block_scaling_dim : 1 or 2
    column_sums : float32 ``(E, k)`` or None -- with ``column_sums=True``: each expert's column
        sums of the unscaled input (dbias, when the input is a gradient)
    total_rows : int or None -- the rows the op was given (device counts are clamped to them)
    """

    data: Any
    data_t: Any
    scale_inv: Any
    scale_inv_t: Any
    m_splits: Any
    m_pad_splits: Any
    fp8_format: str
    k: int
    align: int
    block_scaling_dim: int
    column_sums: Any = None
    total_rows: int | None = None

    _BUFFERS = ("data", "data_t", "scale_inv", "scale_inv_t", "column_sums")
    _HEADER = ("fp8_format", "k", "block_scaling_dim")

    def __post_init__(self):
        if self.block_scaling_dim == MX_DIMS and not isinstance(self, GroupedMXFP8):
            raise ValueError("block_scaling_dim: MXFP8's block kind belongs to GroupedMXFP8 "
                             "(E8M0 bytes in the swizzled layout), not GroupedBlockFP8")

    def _offsets(self):
        m, mp = self.host_splits()
        srow, scol = block_scale_sizes(m, mp, self.k, self.block_scaling_dim)
        z = np.zeros(1, np.int64)
        return (np.concatenate([z, np.cumsum(m, dtype=np.int64)]),
                np.concatenate([z, np.cumsum(np.asarray(mp, np.int64) * self.k)]),
                np.concatenate([z, np.cumsum(srow)]), np.concatenate([z, np.cumsum(scol)]))

    def _expert(self, i: int, buf, name: str):
        if not 0 <= i < self.num_experts:
            raise IndexError(f"expert index {i} out of range for {self.num_experts} experts")
        if buf is None:
            raise ValueError(f"this GroupedBlockFP8 was made with {name}=False")

    def rowwise(self, i: int):
        """Expert ``i``'s row-wise FP8 block, a ``(m_i, k)`` view of :attr:`data`."""
        self._expert(i, self.data, "rowwise")
        rows = self._offsets()[0]
        return self.data[int(rows[i]):int(rows[i + 1])]

    def columnwise(self, i: int):
        """Expert ``i``'s transposed FP8 block, a ``(k, m_pad_i)`` view of :attr:`data_t`."""
        self._expert(i, self.data_t, "columnwise")
        cols = self._offsets()[1]
        return self.data_t[int(cols[i]):int(cols[i + 1])].reshape(self.k, self.host_splits()[1][i])

    def _scales(self, i: int, col: bool):
        """Expert ``i``'s scale entries (flat) and their 2-D shape."""
        self._expert(i, self.data_t if col else self.data, "columnwise" if col else "rowwise")
        off = self._offsets()[3 if col else 2]
        m, mp = self.host_splits()
        shape = block_scale_shapes(m[i], mp[i], self.k, self.block_scaling_dim)[int(col)]
        return (self.scale_inv_t if col else self.scale_inv)[int(off[i]):int(off[i + 1])], shape

    def rowwise_scale_inv(self, i: int):
        """Expert ``i``'s row-wise scales, a 2-D view of :attr:`scale_inv` (module doc layout)."""
        flat, shape = self._scales(i, False)
        return flat.reshape(shape)

    def columnwise_scale_inv(self, i: int):
        """Expert ``i``'s column-wise scales, a 2-D view of :attr:`scale_inv_t`."""
        flat, shape = self._scales(i, True)
        return flat.reshape(shape)

    def dequantize(self, columnwise: bool = False) -> list:
        """Per-expert float32 ``(m_i, k)`` arrays, every byte times its block's ``scale_inv``,
        from the row-wise copy (or, with ``columnwise=True`` or no row-wise copy, from the
        transposed one), of the data's kind and device. For inspection and tests."""
        use_t = columnwise or self.data is None
        src = self.data_t if use_t else self.data
        kind = type(src).__module__.split(".")[0]
        if kind == "torch":
            import torch

            table = torch.from_numpy(decode_table(self.fp8_format)).to(src.device)
            arange = lambda n: torch.arange(n, device=src.device)  # noqa: E731
            as_bytes = lambda q: q.view(torch.uint8).long()  # noqa: E731
        else:
            xp = np if kind == "numpy" else __import__("cupy")
            table = xp.asarray(decode_table(self.fp8_format))
            arange = xp.arange
            as_bytes = lambda q: q.view(xp.uint8)  # noqa: E731
        out = []
        for i, m in enumerate(self.host_splits()[0]):
            if use_t:   # (k, m_pad): rows are features, columns tokens
                q, s = self.columnwise(i)[:, :m], self.columnwise_scale_inv(i)
                rr, cc = arange(self.k)[:, None], arange(m)[None, :]
            else:
                q, s = self.rowwise(i), self.rowwise_scale_inv(i)
                rr, cc = arange(m)[:, None], arange(self.k)[None, :]
            sc = self._element_scales(s, rr, cc)
            x = table[as_bytes(q)] * sc
            out.append(x.T if use_t else x)
        return out

    def _element_scales(self, s, rr, cc):
        """The dequantization factor of every element (rows rr, columns cc) from 2-D scales."""
        return s[cc // BLOCK, rr] if self.block_scaling_dim == 1 else s[rr // BLOCK, cc // BLOCK]


@dataclasses.dataclass(repr=False)
class GroupedMXFP8(GroupedBlockFP8):
    """MXFP8 copies of E experts' rows (TransformerEngine's ``MXFP8BlockScaling``): every block of
    32 elements along a row of ``data`` or of ``data_t`` has an E8M0 scale byte ``e``, the value
    ``2^(e - 127)`` that dequantizes it; written by :func:`cugrouped.multi_mxfp8_cast_transpose`.

    The fields are :class:`GroupedBlockFP8`'s (``block_scaling_dim`` is :data:`MX_DIMS`), except:

    scale_inv, scale_inv_t : ``uint8`` arrays, experts back to back
        E8M0 bytes in cuBLASLt's tiled layout (module doc), expert ``i``'s block starting at a
        multiple of 512 bytes; :meth:`rowwise_scale_inv` / :meth:`columnwise_scale_inv` give its
        compact ``(roundup(rows, 128), roundup(ceil(cols / 32), 4))`` matrix (a copy).
    data_t : with its own blocks (32 tokens of one feature), so its bytes are not ``data``'s
        transposed. ``align`` (32 for the GEMMs) pads each expert's tokens.
    """

    block_scaling_dim: int = MX_DIMS

    def __post_init__(self):
        if self.block_scaling_dim != MX_DIMS:
            raise ValueError(f"block_scaling_dim: a GroupedMXFP8's is MX_DIMS ({MX_DIMS}), got "
                             f"{self.block_scaling_dim!r}")

    def rowwise_scale_inv(self, i: int):
        """Expert ``i``'s row-wise E8M0 bytes, compact ``(roundup(m_i, 128), roundup(ceil(k / 32),
        4))`` (unswizzled; a copy)."""
        flat, shape = self._scales(i, False)
        return mx_unswizzle(flat, *shape)

    def columnwise_scale_inv(self, i: int):
        """Expert ``i``'s E8M0 bytes of ``data_t``'s rows, compact ``(roundup(k, 128),
        roundup(ceil(m_pad_i / 32), 4))`` (unswizzled; a copy)."""
        flat, shape = self._scales(i, True)
        return mx_unswizzle(flat, *shape)

    def _element_scales(self, s, rr, cc):
        """2^(e - 127) of the block of (row rr, column cc), in float32 (e = 0 is the denormal
        2^-127: the scale of a block of zeros, or of values below fp8_max * 2^-127)."""
        e = s[rr, cc // MX_BLOCK]
        if hasattr(e, "to"):        # torch
            import torch

            return torch.exp2(e.to(torch.float32) - 127)      # exact: integer exponents
        xp = np if isinstance(e, np.ndarray) else __import__("cupy")
        return xp.ldexp(xp.ones(e.shape, xp.float32), e.astype(xp.int32) - 127)
