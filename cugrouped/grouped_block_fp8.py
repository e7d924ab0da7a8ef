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
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from .grouped_fp8 import FP8_FORMATS, GroupedSplits, decode_table

__all__ = ["GroupedBlockFP8", "BLOCK", "block_scale_shapes", "block_scale_sizes", "FP8_FORMATS"]

BLOCK = 128   # the scaling block length (TransformerEngine's kBlockLen; cuBLASLt's VEC128 / BLK128x128)


def _shapes(m, m_pad, k, dims):
    """The layouts' two shapes in plain integer arithmetic, so that Python ints, torch.compile's
    symbolic sizes and NumPy arrays of counts (all experts at once) go through the one formula."""
    cd = lambda v: (v + BLOCK - 1) // BLOCK  # noqa: E731
    r4 = lambda v: (v + 3) // 4 * 4           # noqa: E731
    if dims == 1:
        return (cd(k), r4(m)), (cd(m_pad), r4(k))
    return (cd(m), r4(cd(k))), (cd(k), r4(cd(m_pad)))


def _check_dims(dims) -> None:
    if dims not in (1, 2):
        raise ValueError(f"block_scaling_dim: expected 1 or 2, got {dims!r}")


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
    return _scale_sizes(tuple(int(v) for v in m_splits), tuple(int(v) for v in m_pad_splits),
                        int(k), int(dims))


@functools.lru_cache(maxsize=256)   # a training step repeats its splits per layer and pass
def _scale_sizes(m_splits: tuple, m_pad_splits: tuple, k: int, dims: int):
    _check_dims(dims)
    row, col = block_scale_entries(np.asarray(m_splits, dtype=np.int64),
                                   np.asarray(m_pad_splits, dtype=np.int64), k, dims)
    row = np.broadcast_to(row, (len(m_splits),)).astype(np.int64)
    col = np.broadcast_to(col, (len(m_splits),)).astype(np.int64)
    row.flags.writeable = col.flags.writeable = False
    return row, col


@dataclasses.dataclass
class GroupedBlockFP8(GroupedSplits):
    """Block-scaled FP8 copies of E experts' rows, with their per-block ``scale_inv``.

    Attributes
    ----------
    data : array ``(sum(m_splits), k)`` or None
        Row-wise FP8, experts back to back (NumPy: an ml_dtypes float8 dtype; CuPy: ``uint8``).
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

    def rowwise_scale_inv(self, i: int):
        """Expert ``i``'s row-wise scales, a 2-D view of :attr:`scale_inv` (module doc layout)."""
        self._expert(i, self.data, "rowwise")
        off = self._offsets()[2]
        m, mp = self.host_splits()
        shape = block_scale_shapes(m[i], mp[i], self.k, self.block_scaling_dim)[0]
        return self.scale_inv[int(off[i]):int(off[i + 1])].reshape(shape)

    def columnwise_scale_inv(self, i: int):
        """Expert ``i``'s column-wise scales, a 2-D view of :attr:`scale_inv_t`."""
        self._expert(i, self.data_t, "columnwise")
        off = self._offsets()[3]
        m, mp = self.host_splits()
        shape = block_scale_shapes(m[i], mp[i], self.k, self.block_scaling_dim)[1]
        return self.scale_inv_t[int(off[i]):int(off[i + 1])].reshape(shape)

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
            sc = s[cc // BLOCK, rr] if self.block_scaling_dim == 1 else s[rr // BLOCK, cc // BLOCK]
            x = table[as_bytes(q)] * sc
            out.append(x.T if use_t else x)
        return out
