"""``GroupedFP8``: the FP8 buffers of all experts, as written by ``multi_pad_cast_transpose``."""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["GroupedFP8", "FP8_FORMATS"]

FP8_FORMATS = ("e4m3", "e5m2")
_FP8_DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def int_tuple(values) -> tuple[int, ...]:
    """``tuple(int(v) for v in values)``; a tuple of ints already (the ops' own splits, made by
    :func:`cugrouped.ops._cast_inputs.normalize_inputs`) comes back as it is, not converted item
    by item (~40 ns an item, on every call with new splits)."""
    if type(values) is tuple and set(map(type, values)) <= {int}:
        return values
    return tuple(int(v) for v in values)


class GroupedSplits:
    """What both grouped results share: the experts' token counts (host tuples, or the device
    array the op was given) and their host view, and a short repr."""

    _BUFFERS: tuple[str, ...] = ()        # the array fields, for the repr
    _HEADER: tuple[str, ...] = ("fp8_format", "k")

    def __repr__(self) -> str:
        """Class, format, sizes, splits (the first 8 of many) and, per buffer, its kind, dtype,
        shape and device; read from the arrays' metadata only (no copy, no sync)."""
        head = [f"{f}={getattr(self, f)!r}" for f in self._HEADER]
        m = self.m_splits
        if isinstance(m, tuple):
            splits = repr(m) if len(m) <= 8 else \
                f"({', '.join(map(str, m[:8]))}, ...: {len(m)} experts)"
        else:
            splits = describe_array(m)
        bufs = [f"{f}={describe_array(getattr(self, f))}" for f in self._BUFFERS]
        return (f"{type(self).__name__}({', '.join(head)}, m_splits={splits}, "
                f"align={self.align!r}, {', '.join(bufs)})")

    @property
    def num_experts(self) -> int:
        return len(self.m_splits)

    @property
    def splits_on_device(self) -> bool:
        return not isinstance(self.m_splits, tuple)

    def host_splits(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(m_splits, m_pad_splits)`` as host tuples; reads device counts back (a sync), clamped
        to the input's rows exactly as the kernel clamps them."""
        if not self.splits_on_device:
            return self.m_splits, self.m_pad_splits
        return host_counts(self.m_splits, self.data, self.align, self.total_rows)


def describe_array(a: Any) -> str:
    """``"numpy float8_e4m3fn (48, 64)"``, ``"torch float32 (3,) cuda:0"``: an array's kind,
    dtype, shape and device, from its metadata (the data is never read)."""
    if a is None:
        return "None"
    mod = type(a).__module__.split(".")[0]
    dtype = str(getattr(a, "dtype", "?")).removeprefix("torch.")
    shape = tuple(getattr(a, "shape", ()))
    if mod == "numpy":
        where = ""
    elif mod == "cupy":
        where = f" cuda:{a.device.id}"
    elif mod == "torch":
        where = f" {a.device}"
    else:
        return type(a).__name__
    return f"{mod} {dtype} {shape}{where}"


@dataclasses.dataclass(repr=False)
class GroupedFP8(GroupedSplits):
    """FP8 copies of E experts' activations (or weights, or gradients) and their scales.

    Attributes
    ----------
    data : array ``(sum(m_splits), k)`` or None
        Row-wise FP8, experts back to back (no padding). NumPy: ml_dtypes float8 dtype;
        CuPy: ``uint8`` bytes; torch: ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``.
    data_t : array ``(sum(k * m_pad_splits),)`` or None
        Transposed FP8, experts back to back; expert ``i`` is a ``(k, m_pad_splits[i])`` block
        (see :meth:`columnwise`) whose columns ``m_splits[i]:`` are zero.
    m_splits, m_pad_splits : tuple of int
        Rows per expert, and the same rounded up to ``align``. When the op was given the counts
        as a device array (no host sync), ``m_splits`` is that array and ``m_pad_splits`` is None;
        ``data_t`` is then sized for the worst case ``k * (sum(m) + E * (align - 1))`` and the
        per-expert views below read the counts back to the host (a sync: for inspection only).
    amax, scale, scale_inv : float32 arrays ``(E,)``, on the data's device
        ``amax`` of the unscaled input, the scale used (``q = fp8(x * scale)``) and its inverse
        (what the GEMMs dequantize with; they also take a ``scale_inv`` that is a strided
        ``(E,)`` view, and read one whose elements are 16-byte aligned where it is).
    fp8_format : ``"e4m3"`` or ``"e5m2"``;  k : int;  align : int
    column_sums : float32 array ``(E, k)`` or None
        With ``column_sums=True``: each expert's column sums of the unscaled input (dbias).
    total_rows : int or None
        The rows the op was given (with device counts, what the kernel clamped them to).
    """

    data: Any
    data_t: Any
    m_splits: tuple[int, ...]
    m_pad_splits: tuple[int, ...]
    amax: Any
    scale: Any
    scale_inv: Any
    fp8_format: str
    k: int
    align: int
    column_sums: Any = None
    total_rows: int | None = None

    _BUFFERS = ("data", "data_t", "amax", "scale", "scale_inv", "column_sums")

    def row_offsets(self) -> np.ndarray:
        """First row of each expert in :attr:`data` (length E + 1)."""
        return np.concatenate([[0], np.cumsum(self.host_splits()[0], dtype=np.int64)])

    def col_offsets(self) -> np.ndarray:
        """First byte of each expert's transposed block in :attr:`data_t` (length E + 1)."""
        return np.concatenate([[0], np.cumsum(np.asarray(self.host_splits()[1], np.int64) * self.k)])

    def _check_expert(self, i: int) -> None:
        if not 0 <= i < self.num_experts:
            raise IndexError(f"expert index {i} out of range for {self.num_experts} experts")

    def rowwise(self, i: int):
        """Expert ``i``'s row-wise FP8 block, a ``(m_i, k)`` view of :attr:`data`."""
        self._check_expert(i)
        if self.data is None:
            raise ValueError("this GroupedFP8 was made with rowwise=False")
        off = self.row_offsets()
        return self.data[int(off[i]):int(off[i + 1])]

    def columnwise(self, i: int):
        """Expert ``i``'s transposed FP8 block, a ``(k, m_pad_i)`` view of :attr:`data_t`."""
        self._check_expert(i)
        if self.data_t is None:
            raise ValueError("this GroupedFP8 was made with columnwise=False")
        off = self.col_offsets()
        return self.data_t[int(off[i]):int(off[i + 1])].reshape(self.k, self.host_splits()[1][i])

    def dequantize(self) -> list:
        """Per-expert float32 ``(m_i, k)`` arrays ``fp8 * scale_inv`` (from the row-wise copy if
        present, else from the transposed one), of the data's kind and device. For inspection and
        tests: FP8 bytes are decoded through a 256-entry table, exactly."""
        src = self.data if self.data is not None else self.data_t
        kind = type(src).__module__.split(".")[0]
        if kind == "torch":
            import torch

            table = torch.from_numpy(decode_table(self.fp8_format)).to(src.device)
            as_bytes = lambda q: q.view(torch.uint8).long()  # noqa: E731  (torch indexes with int64)
        else:
            xp = np if kind == "numpy" else __import__("cupy")
            table = xp.asarray(decode_table(self.fp8_format))
            as_bytes = lambda q: q.view(xp.uint8)  # noqa: E731
        out = []
        for i, m in enumerate(self.host_splits()[0]):
            q = self.rowwise(i) if self.data is not None else self.columnwise(i)[:, :m].T
            out.append(table[as_bytes(q)] * self.scale_inv[i])
        return out


def host_counts(counts, data, align: int, total_rows: int | None = None
                ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Device counts read back to the host (a sync), clamped to the input's rows (``total_rows``,
    else the rows of ``data``) exactly as the kernels clamp them, and rounded up to ``align``."""
    raw = counts
    if hasattr(raw, "get"):            # CuPy
        raw = raw.get()
    elif hasattr(raw, "cpu"):          # torch
        raw = raw.cpu().numpy()
    raw = np.asarray(raw, dtype=np.int64).reshape(-1)
    rows = total_rows if total_rows is not None else \
        data.shape[0] if data is not None else int(raw.clip(0).sum())
    ends = np.minimum(np.cumsum(raw.clip(0)), rows)
    m = np.diff(np.concatenate([[0], ends]))
    return tuple(int(v) for v in m), tuple(int(-(-v // align) * align) for v in m)


def decode_table(fp8_format: str) -> np.ndarray:
    """float32 value of each of the 256 FP8 bytes of a format (NaN bytes give NaN)."""
    return np.arange(256, dtype=np.uint8).view(_FP8_DTYPES[fp8_format]).astype(np.float32)
