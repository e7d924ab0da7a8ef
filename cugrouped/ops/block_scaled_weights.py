"""``block_scaled_weights``: expert weights already quantized in 128 x 128 blocks (as DeepSeek-V3's
FP8 checkpoints store them: ``weight`` in E4M3 and ``weight_scale_inv``, one float32 per block)
as the :class:`~cugrouped.GroupedBlockFP8` the block-scaled grouped GEMMs take, without
dequantizing and quantizing them again.

A checkpoint's block scales and cugrouped's 2-D block layout differ only in padding: the GEMM-ready
layout rounds each expert's block columns up to a multiple of 4 (entries of 1.0 there, as the cast
writes for blocks of zeros), and the transposed copy (dgrad's operand) holds the same blocks
transposed. So the result is the checkpoint's bytes and scales, moved: the same bits a
dequantize-requantize round trip can only approximate. Pure data movement in the array library
of the inputs (torch, CuPy or NumPy; no kernel of cugrouped's), meant for load time.
"""

from __future__ import annotations

import numpy as np

from .._array import array_kind
from ..grouped_block_fp8 import BLOCK, GroupedBlockFP8
from ..grouped_fp8 import FP8_FORMATS

__all__ = ["block_scaled_weights"]

_FP8_DTYPE_FORMATS = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}   # torch's and ml_dtypes'


def _as_list(arg, name: str):
    """The experts of ``arg``: a list/tuple of 2-D arrays, or the first axis of one 3-D array."""
    if isinstance(arg, (list, tuple)):
        if not arg:
            raise ValueError(f"{name}: expected at least one expert, got an empty "
                             f"{type(arg).__name__}")
        for i, a in enumerate(arg):
            if array_kind(a) == "other" or len(a.shape) != 2:
                raise TypeError(f"{name}[{i}]: expected a 2-D torch tensor, CuPy or NumPy "
                                f"array, got {_describe(a)}")
        return list(arg)
    if array_kind(arg) == "other" or len(arg.shape) != 3:
        raise TypeError(f"{name}: expected a list of 2-D arrays or one 3-D array (experts, "
                        f"rows, columns), got {_describe(arg)}")
    if arg.shape[0] == 0:
        raise ValueError(f"{name}: expected at least one expert, got shape {tuple(arg.shape)}")
    return [arg[i] for i in range(arg.shape[0])]


def _describe(a) -> str:
    shape = getattr(a, "shape", None)
    return f"{type(a).__name__} of shape {tuple(shape)}" if shape is not None \
        else type(a).__name__


def _format_of(a, fp8_format: str | None, name: str) -> str:
    """The FP8 format of ``a``'s dtype (float8 types), or ``fp8_format`` for uint8 bytes."""
    dt = str(a.dtype).removeprefix("torch.")
    fmt = _FP8_DTYPE_FORMATS.get(dt)
    if fmt is None and dt != "uint8":
        raise TypeError(f"{name}: expected FP8 data (float8_e4m3fn / float8_e5m2, or uint8 "
                        f"bytes with fp8_format=), got dtype {dt}")
    if fmt is None:
        if fp8_format is None:
            raise ValueError(f"{name}: uint8 bytes need fp8_format='e4m3' or 'e5m2'")
        return fp8_format
    if fp8_format is not None and fp8_format != fmt:
        raise ValueError(f"fp8_format: {fp8_format!r} contradicts {name}'s dtype {dt}")
    return fmt


def block_scaled_weights(data, scale_inv, *, fp8_format: str | None = None,
                         columnwise: bool = True) -> GroupedBlockFP8:
    """The experts' weights, quantized in 128 x 128 blocks elsewhere, as a
    :class:`~cugrouped.GroupedBlockFP8` (``block_scaling_dim=2``, ``align=1``) for
    :func:`~cugrouped.grouped_fprop` and (with ``columnwise``) :func:`~cugrouped.grouped_dgrad`.

    ``data``: the experts' FP8 weights, a list of ``(n, k)`` arrays or one ``(E, n, k)`` array:
    torch ``float8_e4m3fn`` / ``float8_e5m2`` tensors, NumPy arrays of ml_dtypes' float8 types,
    or uint8 bytes (CuPy's only way) with ``fp8_format``. ``scale_inv``: float32, a list of
    ``(ceil(n / 128), ceil(k / 128))`` arrays or one ``(E, ...)`` array; element ``[r, c]``
    multiplies the bytes of block ``(r, c)`` when dequantizing (DeepSeek-V3's
    ``weight_scale_inv``). All of one kind and device; the values are not inspected (no sync).

    Returns the row-wise copy (the experts' bytes back to back, ``(E * n, k)``) and, with
    ``columnwise=True``, the transposed copy dgrad reads, each with its scales in the GEMM-ready
    layout (:mod:`cugrouped.grouped_block_fp8`); the result's arrays are new (copies, of the
    inputs' kind and device)."""
    if not isinstance(columnwise, bool):
        raise TypeError(f"columnwise: expected a bool, got {columnwise!r}")
    if fp8_format is not None and fp8_format not in FP8_FORMATS:
        raise ValueError(f"fp8_format: expected 'e4m3', 'e5m2' or None, got {fp8_format!r}")
    ws, ss = _as_list(data, "data"), _as_list(scale_inv, "scale_inv")
    if len(ss) != len(ws):
        raise ValueError(f"scale_inv: expected one per expert ({len(ws)}), got {len(ss)}")
    kind, n, k = array_kind(ws[0]), int(ws[0].shape[0]), int(ws[0].shape[1])
    fmt = _format_of(ws[0], fp8_format, "data[0]" if isinstance(data, (list, tuple)) else "data")
    rb, cb = -(-n // BLOCK), -(-k // BLOCK)
    device = getattr(ws[0], "device", None)
    for name, arrays, shape in (("data", ws, (n, k)), ("scale_inv", ss, (rb, cb))):
        for i, a in enumerate(arrays):
            if array_kind(a) != kind or getattr(a, "device", None) != device:
                raise TypeError(f"{name}[{i}]: expected a {kind} array on {device} like "
                                f"data[0], got {_describe(a)} on {getattr(a, 'device', None)}")
            if tuple(int(v) for v in a.shape) != shape:
                what = "like data[0]" if name == "data" else \
                    f"(ceil({n}/128), ceil({k}/128)) for ({n}, {k}) weights"
                raise ValueError(f"{name}[{i}]: expected shape {shape} {what}, got "
                                 f"{tuple(a.shape)}")
    for i, a in enumerate(ws[1:], 1):
        if str(a.dtype) != str(ws[0].dtype):
            raise TypeError(f"data[{i}]: expected dtype {ws[0].dtype} like data[0], got "
                            f"{a.dtype}")
    for i, s in enumerate(ss):
        if str(s.dtype).removeprefix("torch.") != "float32":
            raise TypeError(f"scale_inv[{i}]: expected float32, got {s.dtype}")
    if kind == "cupy":
        with device:                      # allocate where the inputs live
            return _build(ws, ss, fmt, columnwise, _Lib(kind))
    return _build(ws, ss, fmt, columnwise, _Lib(kind))


def _build(ws, ss, fmt: str, columnwise: bool, lib: "_Lib") -> GroupedBlockFP8:
    E, n, k = len(ws), int(ws[0].shape[0]), int(ws[0].shape[1])
    q = lib.stack([lib.as_bytes(w) for w in ws])                    # (E, n, k) uint8
    s = lib.stack(ss)                                               # (E, rb, cb) float32
    splits = (n,) * E
    return GroupedBlockFP8(
        data=lib.as_fp8(q.reshape(E * n, k), fmt),
        data_t=lib.contiguous(lib.swap(q)).reshape(-1) if columnwise else None,
        scale_inv=lib.pad4(s).reshape(-1),
        scale_inv_t=lib.pad4(lib.swap(s)).reshape(-1) if columnwise else None,
        m_splits=splits, m_pad_splits=splits, fp8_format=fmt, k=k, align=1,
        block_scaling_dim=2, total_rows=E * n)


class _Lib:
    """The few array operations the op needs, in torch, CuPy or NumPy."""

    def __init__(self, kind: str):
        self.kind = kind
        if kind == "torch":
            import torch

            self.xp = torch
        else:
            self.xp = np if kind == "numpy" else __import__("cupy")

    def as_bytes(self, a):
        return a.view(self.xp.uint8)

    def stack(self, arrays):
        if self.kind == "torch":          # values, not a graph (scales may be parameters)
            return self.xp.stack([a.detach() for a in arrays])
        return self.xp.stack(arrays)

    def swap(self, a):
        """The last two axes swapped (a view)."""
        return a.transpose(1, 2) if self.kind == "torch" else a.transpose(0, 2, 1)

    def contiguous(self, a):
        return a.contiguous() if self.kind == "torch" else self.xp.ascontiguousarray(a)

    def pad4(self, s):
        """``(E, R, C)`` scales with their columns rounded up to a multiple of 4, padded with
        1.0 (what the cast writes there), contiguous."""
        E, R, C = (int(v) for v in s.shape)
        C4 = -(-C // 4) * 4
        if self.kind == "torch":
            out = self.xp.ones((E, R, C4), dtype=self.xp.float32, device=s.device)
        else:
            out = self.xp.ones((E, R, C4), dtype=np.float32)
        out[:, :, :C] = s
        return out

    def as_fp8(self, q, fmt: str):
        """Row-wise bytes in the dtype the casts return for this kind: torch's and ml_dtypes'
        float8 types; CuPy keeps uint8."""
        if self.kind == "torch":
            from ..pytorch._adapters import FP8_TORCH_DTYPES

            return q.view(FP8_TORCH_DTYPES[fmt])
        if self.kind == "numpy":
            from ..reference.fp8 import fp8_dtype

            return q.view(fp8_dtype(fmt))
        return q
