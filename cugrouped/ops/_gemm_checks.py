"""Argument checks of the grouped GEMMs: operands (GroupedFP8, GroupedBlockFP8 or plain arrays) to a
:class:`~cugrouped.ops._gemm_plan.Problem`, and the outputs (checked or new) to per-expert blocks.
Every failure is a TypeError/ValueError naming the argument. Package-private: the public names are
re-exported by :mod:`cugrouped.ops.grouped_gemm`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._array import ArrayView, array_is_device, as_view
from ..cublaslt import _enums as E
from ..grouped_block_fp8 import MX_BLOCK, MX_DIMS, GroupedBlockFP8, block_scale_sizes, scale_dtype
from ..grouped_fp8 import GroupedFP8
from ._gemm_plan import (Block, Blocks, Problem, as_blocks, bias_dtype_for, first,
                         pointer_alignments, scale_pointers)
from ._launch import check_bool

# cuBLASLt FP8 GEMMs need the reduction and output dims, leading dims and pointers in multiples of
# 16 (elements = bytes for FP8).
FP8_MULTIPLE = 16
OUT_DTYPES = ("bfloat16", "float16", "float32")
PLAIN_DTYPES = ("bfloat16", "float16", "float32")
_FP8_DTYPE = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
# The FP8 format pairs cuBLASLt multiplies (no E5M2 x E5M2).
FP8_PAIRS = frozenset({("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3")})
# cuBLASLt's scale mode of a GroupedBlockFP8 by block_scaling_dim.
_BLOCK_MODE = {1: E.CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
               2: E.CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
               MX_DIMS: E.CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0}
MX_MODE = E.CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0
# Block-scaled GEMMs: the token count of a 1-D-scaled left operand (cuBLAS's B, whose outer
# dimension it is) must be a multiple of 8 (TransformerEngine asserts the same; "observed").
BLOCK_TOKEN_MULTIPLE = 8
# Output dtypes cuBLASLt offers for each plain input dtype (fp32 compute).
_PLAIN_OUT = {"bfloat16": ("bfloat16", "float32"), "float16": ("float16", "float32"),
              "float32": ("float32",)}


# ---------------------------------------------------------------------------------------------
# Argument checks: operands -> blocks.

# Not frozen (treat as immutable): a frozen dataclass's __init__ costs ~1 us more, twice a call.
@dataclasses.dataclass(slots=True)
class _Operand:
    blocks: tuple[Block, ...]
    dtype: str
    scale_inv: tuple[int, ...] | None
    fmt: str | None
    on_device: bool
    device: int
    kind: str
    m_splits: tuple[int, ...]
    scale_mode: int = E.CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F


def _stacked(v: ArrayView) -> list[ArrayView]:
    """The per-expert views of one stacked ``(E, ...)`` array (its leading index taken off)."""
    return [dataclasses.replace(v, ptr=v.ptr + i * v.strides[0] * v.itemsize,
                                shape=v.shape[1:], strides=v.strides[1:])
            for i in range(v.shape[0])]


def _where(views: Sequence[ArrayView], arg: str) -> tuple[bool, int, str]:
    """``(on_device, device, kind)`` shared by ``views``. Any array kind :func:`as_view` reads is
    accepted (CUDA torch tensors included: only pointers, shapes, strides and dtypes are read, and
    torch is never imported); where the kind matters (which backend can run, what a new output is
    made of) the op decides (``grouped_gemm._run``, :func:`new_output`)."""
    first = views[0]
    for v in views[1:]:
        if (v.kind, v.device) != (first.kind, first.device):
            raise ValueError(f"{arg}: mixes a {first.kind} array on device {first.device} with a "
                             f"{v.kind} array on device {v.device}")
    return first.on_device, first.device, first.kind


def _block_scales(g: GroupedBlockFP8, copy: str, arg: str) -> tuple[ArrayView, np.ndarray]:
    """The scale buffer of one copy of a GroupedBlockFP8 and each expert's first scale's offset
    (in entries: float32, or MXFP8's E8M0 bytes; every expert's block starts 16-byte aligned: its
    layouts round to 4 floats, or to 512-byte tiles)."""
    name = "scale_inv" if copy == "rowwise" else "scale_inv_t"
    sizes = block_scale_sizes(g.m_splits, g.m_pad_splits, g.k, g.block_scaling_dim)[
        0 if copy == "rowwise" else 1]
    sv = as_view(getattr(g, name), arg=f"{arg}.{name}")
    total = int(sizes.sum())
    want = scale_dtype(g.block_scaling_dim).name
    if sv.dtype != want or len(sv.shape) != 1 or sv.shape[0] < total or (
            sv.shape[0] > 1 and sv.strides != (1,)):
        raise ValueError(f"{arg}.{name}: expected a contiguous {want} vector of at least {total} "
                         f"block scales, got {sv.dtype} {sv.shape}")
    return sv, np.cumsum(sizes) - sizes


def _fp8_operand(g, copy: str, arg: str, need: str) -> _Operand:
    """Blocks of the row-wise ``(m_i, k)`` or transposed ``(k, m_pad_i)`` copies of ``g`` (a
    GroupedFP8, or a GroupedBlockFP8 whose scale pointers are each expert's first block scale)."""
    what = type(g).__name__
    if getattr(g, "splits_on_device", False):
        raise ValueError(f"{arg}: its token counts live on the device; the per-expert cuBLASLt loop "
                         f"needs them on the host: cast with host m_splits (the {what}'s buffers "
                         "are sized for the worst case of device counts)")
    data = g.data if copy == "rowwise" else g.data_t
    if data is None:
        cast = ("multi_mxfp8_cast_transpose" if g.block_scaling_dim == MX_DIMS else
                "multi_block_cast_transpose") if isinstance(g, GroupedBlockFP8) else \
            "multi_pad_cast_transpose"
        raise ValueError(f"{arg}: {need} needs the {copy} FP8 copy; cast with "
                         f"{cast}(..., {copy}=True)")
    if g.fp8_format not in _FP8_DTYPE:
        raise ValueError(f"{arg}: unknown fp8_format {g.fp8_format!r}")
    dv = as_view(data, arg=f"{arg}.data" if copy == "rowwise" else f"{arg}.data_t")
    E_ = g.num_experts
    if isinstance(g, GroupedBlockFP8):
        sv, first = _block_scales(g, copy, arg)
        scales = sv.ptr + sv.itemsize * first
        scale_mode = _BLOCK_MODE[g.block_scaling_dim]
    else:
        sv = as_view(g.scale_inv, arg=f"{arg}.scale_inv")
        step = sv.strides[0] if E_ > 1 and len(sv.shape) == 1 else 1
        if sv.dtype != "float32" or sv.shape != (E_,) or step < 1:
            raise ValueError(f"{arg}.scale_inv: expected a float32 array of shape ({E_},) "
                             f"(contiguous, or at a positive element stride), got {sv.dtype} "
                             f"{sv.shape} strides {sv.strides}")
        # one float32 per expert (at a stride of 4 each in its own 16-byte slot, as cuBLASLt
        # wants them)
        scales = scale_pointers(sv.ptr, step, E_)
        scale_mode = E.CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F
    on_device, device, kind = _where([dv, sv], arg)
    k = g.k
    dtype = _FP8_DTYPE[g.fp8_format]
    if copy == "rowwise":
        m = np.array(g.m_splits, dtype=np.int64)
        ends = m.cumsum()
        rows = int(ends[-1]) if E_ else 0
        if dv.shape != (rows, k) or (rows > 1 and dv.strides != (k, 1)):
            raise ValueError(f"{arg}.data: expected a contiguous ({rows}, {k}) array, got shape "
                             f"{dv.shape} strides {dv.strides}")
        blocks = Blocks(dv.ptr + (ends - m) * k, m, k, k, dtype)
    else:
        mp = np.array(g.m_pad_splits, dtype=np.int64)
        ends = mp.cumsum() * k
        total = int(ends[-1]) if E_ else 0
        if dv.size != total or (total > 1 and dv.strides[-1] != 1):
            raise ValueError(f"{arg}.data_t: expected {total} contiguous bytes, got shape {dv.shape}")
        blocks = Blocks(dv.ptr + ends - mp * k, k, mp, mp, dtype)
    return _Operand(blocks, dtype, scales, g.fp8_format, on_device, device, kind,
                    tuple(g.m_splits), scale_mode)


def _plain_operand(x: Any, arg: str, expect_3d: bool = False) -> _Operand:
    """A list/tuple of 2-D arrays (or, for weights, one 3-D ``(E, rows, cols)`` array)."""
    if isinstance(x, (list, tuple)):
        if len(x) == 0:
            raise ValueError(f"{arg}: expected at least one expert, got an empty sequence")
        views = [as_view(a, arg=f"{arg}[{i}]") for i, a in enumerate(x)]
        names = [f"{arg}[{i}]" for i in range(len(x))]
    else:
        v = as_view(x, arg=arg)
        if not (expect_3d and len(v.shape) == 3):
            raise TypeError(f"{arg}: expected a GroupedFP8 or a list of 2-D arrays"
                            + (" or one 3-D (E, rows, cols) array" if expect_3d else "")
                            + f", got {type(x).__name__} of shape {v.shape}")
        views = _stacked(v)
        names = [arg] * len(views)
        if not views:
            raise ValueError(f"{arg}: expected at least one expert, got shape {v.shape}")
    on_device, device, kind = _where(views, arg)
    dtype = views[0].dtype
    blocks = []
    for v, name in zip(views, names):
        if len(v.shape) != 2:
            raise ValueError(f"{name}: expected a 2-D array, got shape {v.shape}")
        if v.dtype not in PLAIN_DTYPES:
            raise TypeError(f"{name}: expected dtype bfloat16, float16 or float32, got {v.dtype} "
                            "(CuPy callers pass bfloat16 as a GroupedFP8 or as NumPy/ml_dtypes)")
        if v.dtype != dtype:
            raise TypeError(f"{name}: dtype {v.dtype} differs from the first expert's {dtype}")
        rows, cols = v.shape
        if rows > 0 and cols > 0 and not v.is_row_major_rows():
            raise ValueError(f"{name}: expected rows with unit column stride (row-major), got "
                             f"strides {v.strides} (elements) for shape {v.shape}")
        ld = v.strides[0] if rows > 1 else cols
        blocks.append((v.ptr, rows, cols, max(ld, 1)))
    b = np.array(blocks, dtype=np.int64).reshape(-1, 4)
    return _Operand(Blocks(b[:, 0], b[:, 1], b[:, 2], b[:, 3], dtype), dtype, None, None,
                    on_device, device, kind, tuple(b[:, 1].tolist()))


def _operand(x: Any, arg: str, copy: str, need: str, expect_3d: bool = False) -> _Operand:
    if isinstance(x, (GroupedFP8, GroupedBlockFP8)):
        return _fp8_operand(x, copy, arg, need)
    return _plain_operand(x, arg, expect_3d)


def _check_pair(a: _Operand, a_name: str, b: _Operand, b_name: str) -> None:
    if (a.fmt is None) != (b.fmt is None):
        fp8, plain = (a_name, b_name) if a.fmt else (b_name, a_name)
        raise TypeError(f"{fp8} is a GroupedFP8 but {plain} is not: both operands must be FP8 "
                        "(GroupedFP8 or GroupedBlockFP8) or both plain arrays")
    if a.fmt and (a.scale_mode == 0) != (b.scale_mode == 0):
        block, tensor = (a_name, b_name) if a.scale_mode else (b_name, a_name)
        raise TypeError(f"{block} is block-scaled (GroupedBlockFP8) but {tensor} has one scale per "
                        "expert (GroupedFP8): cast both operands with the same kind of scaling")
    if a.fmt and (a.scale_mode == MX_MODE) != (b.scale_mode == MX_MODE):
        mx, other = (a_name, b_name) if a.scale_mode == MX_MODE else (b_name, a_name)
        raise TypeError(f"{mx} is MXFP8 (GroupedMXFP8) but {other} is not: cast both with "
                        "multi_mxfp8_cast_transpose")
    if a.scale_mode == MX_MODE:
        _check_mx_dims(a, a_name)
        _check_mx_dims(b, b_name)
    if a.scale_mode == b.scale_mode == E.CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F:
        raise ValueError(f"{a_name}, {b_name}: cuBLASLt has no 128x128-by-128x128 block-scaled "
                         "GEMM; cast one of them with block_scaling_dim=1")
    if a.fmt and (a.fmt, b.fmt) not in FP8_PAIRS:
        raise ValueError(f"{a_name}, {b_name}: E5M2 x E5M2 is not a cuBLASLt FP8 GEMM (supported "
                         "pairs: E4M3xE4M3, E4M3xE5M2, E5M2xE4M3); cast one of them as e4m3")
    if a.fmt is None and a.dtype != b.dtype:
        raise TypeError(f"{b_name}: dtype {b.dtype} differs from {a_name}'s {a.dtype}")
    if (a.on_device, a.device, a.kind) != (b.on_device, b.device, b.kind):
        def where(o):
            return f"{o.kind} on {f'cuda:{o.device}' if o.on_device else 'the host'}"

        raise ValueError(f"{a_name} and {b_name}: must be arrays of the same kind on the same "
                         f"device, got {where(a)} and {where(b)}")
    if len(a.blocks) != len(b.blocks):
        raise ValueError(f"{a_name} has {len(a.blocks)} experts but {b_name} has {len(b.blocks)}")


def _dtype_name(dtype: Any) -> Any:
    """A dtype given as an object by its name: NumPy dtypes and scalar types, ml_dtypes'
    ``bfloat16``, torch dtypes (read by name: torch is not imported). Strings, and what is
    none of these, are returned as they are (for the caller's check)."""
    if isinstance(dtype, str):
        return dtype
    if type(dtype).__module__.split(".")[0] == "torch":     # torch.bfloat16 -> "bfloat16"
        return str(dtype).removeprefix("torch.")
    try:
        return np.dtype(dtype).name
    except (TypeError, ValueError):
        return dtype


def _check_out_dtype(out_dtype: Any, op: _Operand, wgrad: bool = False) -> str:
    """The output dtype's name: ``out_dtype`` (a name, or a NumPy / ml_dtypes / torch dtype)
    checked, or its default when None (float32 for wgrad; otherwise bfloat16 for FP8 operands
    and the operands' own dtype for plain ones)."""
    if out_dtype is None:
        return "float32" if wgrad else "bfloat16" if op.fmt is not None else op.dtype
    given, out_dtype = out_dtype, _dtype_name(out_dtype)
    if not isinstance(out_dtype, str) or out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype: got {given!r}, expected one of {OUT_DTYPES} (a name, or "
                         "its NumPy, ml_dtypes or torch dtype)")
    if op.fmt is None and out_dtype not in _PLAIN_OUT[op.dtype]:
        raise ValueError(f"out_dtype: {op.dtype} operands give {_PLAIN_OUT[op.dtype]} outputs in "
                         f"cuBLASLt, got {out_dtype!r} (pass out_dtype={op.dtype!r}, or None)")
    return out_dtype


def _check_fp8_dim(value: int, name: str) -> None:
    if value % FP8_MULTIPLE:
        raise ValueError(f"{name}: FP8 GEMMs need a multiple of {FP8_MULTIPLE}, got {value}")


def _uniform(blocks: Blocks, attr: str, arg: str, what: str, swapped_with: tuple = ()) -> int:
    """The one value of ``attr`` over the experts (``swapped_with``: see :func:`_swap_hint`)."""
    vals = getattr(blocks, attr)
    lo, hi = int(vals.min()), int(vals.max())
    if lo != hi:
        raise ValueError(f"{arg}: every expert must have the same {what}, got "
                         f"{np.unique(vals).tolist()}{_swap_hint(arg, *swapped_with)}")
    return lo


def _swap_hint(arg: str, other: _Operand | None = None, other_name: str = "") -> str:
    """For an error on the weight ``arg`` whose experts' rows differ (as token counts do): a hint
    that ``other`` came in its place when the rows of ``other``'s experts are all the same (as a
    weight's are); else nothing (the experts' own counts may just differ)."""
    if other is None or len(set(other.m_splits)) != 1:
        return ""
    return (f" ({other_name} has the same rows in every expert, as weights do: did you pass "
            f"{other_name} and {arg} in the wrong order?)")


def _tagged_view(a, dtype: str, arg: str) -> ArrayView:
    """``as_view``, reading an integer carrier (CuPy's ``uint16`` for bfloat16) as ``dtype``."""
    carrier = getattr(getattr(a, "dtype", None), "kind", "") in ("u", "i")
    return as_view(a, dtype=dtype if carrier else None, arg=arg)


def _bias(bias: Any, n: int, num: int, dtype: str, where: _Operand,
          out_dtype: str) -> tuple[int, ...] | None:
    if bias is None:
        return None
    if isinstance(bias, (list, tuple)):
        views = [_tagged_view(b, dtype, f"bias[{i}]") for i, b in enumerate(bias)]
        if len(views) != num:
            raise ValueError(f"bias: expected {num} per-expert vectors, got {len(views)}")
    else:
        v = _tagged_view(bias, dtype, "bias")
        if len(v.shape) != 2 or v.shape[0] != num:
            raise ValueError(f"bias: expected an ({num}, {n}) array or a list of {num} ({n},) "
                             f"vectors, got shape {v.shape}")
        views = _stacked(v)
    on_device, device, kind = _where(views, "bias")
    if (on_device, device, kind) != (where.on_device, where.device, where.kind):
        raise ValueError("bias: must live with the operands (same array kind and device)")
    for i, v in enumerate(views):
        if v.shape != (n,) or (n > 1 and v.strides != (1,)):
            raise ValueError(f"bias[{i}]: expected a contiguous ({n},) vector, got shape {v.shape} "
                             f"strides {v.strides}")
        if v.dtype != dtype:      # the rule of bias_dtype_for
            rule = ("with FP8 operands and a float32 output, cuBLASLt's bias epilogue takes a "
                    "bfloat16 bias" if dtype != out_dtype else
                    "cuBLASLt's bias epilogue takes a bias of the output dtype")
            raise TypeError(f"bias[{i}]: expected {dtype}, got {v.dtype} ({rule})")
    return tuple(v.ptr for v in views)


def split_rows(a: Any, m_splits: Any, arg: str) -> Any:
    """One 2-D array ``(sum(m_splits), cols)`` and its host split sizes -> the list of per-expert
    row views the ops take (views: nothing is copied); ``a`` itself when ``m_splits`` is None."""
    if m_splits is None:
        return a
    if isinstance(a, (GroupedFP8, GroupedBlockFP8, list, tuple)):
        raise ValueError(f"m_splits: goes with one 2-D {arg} array; a list or GroupedFP8 {arg} "
                         f"carries its own split sizes")
    shape = getattr(a, "shape", None)
    if shape is None or len(shape) != 2:
        got = type(a).__name__ + ("" if shape is None else f" of shape {tuple(shape)}")
        raise TypeError(f"{arg}: with m_splits, expected one 2-D (sum(m_splits), cols) array, "
                        f"got {got}")
    if array_is_device(m_splits):
        raise TypeError("m_splits: the GEMMs need host split sizes (a list of ints or a host "
                        "array); reading device counts would be a host sync")
    values = m_splits.tolist() if hasattr(m_splits, "tolist") else m_splits
    if not isinstance(values, Sequence) or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        raise TypeError(f"m_splits: expected a 1-D sequence of non-negative ints, got {m_splits!r}")
    counts = [int(v) for v in values]
    if any(c < 0 for c in counts) or sum(counts) != shape[0]:
        raise ValueError(f"m_splits: expected non-negative counts summing to {arg}'s {shape[0]} "
                         f"rows, got {counts}")
    starts = np.concatenate(([0], np.cumsum(counts))).tolist()
    return [a[lo:hi] for lo, hi in zip(starts[:-1], starts[1:])]


def check_fprop(x, w, bias=None, *, out_dtype=None, fast_accum=True) -> Problem:
    """Check fprop's operands; raise TypeError/ValueError naming the argument."""
    check_bool(fast_accum, "fast_accum")
    xo = _operand(x, "x", "rowwise", "fprop")
    wo = _operand(w, "w", "rowwise", "fprop", expect_3d=True)
    _check_pair(wo, "w", xo, "x")
    out_dtype = _check_out_dtype(out_dtype, xo)
    k = (_uniform(xo.blocks, "cols", "x", "k (columns)") if xo.fmt is None
         else first(xo.blocks, "cols"))
    n = _uniform(wo.blocks, "rows", "w", "n (rows)", (xo, "x"))
    wk = _uniform(wo.blocks, "cols", "w", "k (columns)")
    if wk != k:
        raise ValueError(f"w: has k={wk} columns but x has k={k}")
    if k < 1 or n < 1:
        raise ValueError(f"x, w: need k >= 1 and n >= 1, got k={k}, n={n}")
    if xo.fmt:
        _check_fp8_dim(k, "k (x.k, w.k)")
        _check_fp8_dim(n, "n (w's rows per expert)")
    bdt = bias_dtype_for(out_dtype, xo.fmt is not None)
    _check_block_tokens(xo, "x")
    return Problem("fprop", xo.fmt is not None, xo.blocks, False, wo.blocks, True,
                   (k,) * len(xo.blocks), xo.scale_inv, wo.scale_inv,
                   _bias(bias, n, len(xo.blocks), bdt, xo, out_dtype),
                   bdt if bias is not None else None,
                   _fast_accum(fast_accum, xo), False, out_dtype, _place(xo),
                   xo.scale_mode, wo.scale_mode)


def check_dgrad(dy, w, *, out_dtype=None, fast_accum=False) -> Problem:
    """Check dgrad's operands. FP8: ``dy`` row-wise ``(m_i, n)``, ``w`` transposed ``(k, n)``."""
    check_bool(fast_accum, "fast_accum")
    dyo = _operand(dy, "dy", "rowwise", "dgrad")
    wo = _operand(w, "w", "columnwise", "dgrad (the transposed weight)", expect_3d=True)
    _check_pair(wo, "w", dyo, "dy")
    out_dtype = _check_out_dtype(out_dtype, dyo)
    n = first(dyo.blocks, "cols") if dyo.fmt else _uniform(dyo.blocks, "cols", "dy", "n (columns)")
    if wo.fmt:
        # w's transposed blocks are (k, n_pad) with the true n = w.m_splits[i] columns
        w_n = set(wo.m_splits)
        if len(w_n) != 1:
            raise ValueError(f"w: every expert must have the same n (rows), got {sorted(w_n)}"
                             f"{_swap_hint('w', dyo, 'dy')}")
        wn = w_n.pop()
        k = first(wo.blocks, "rows")
        right = wo.blocks.replace(cols=wn)
    else:
        wn = _uniform(wo.blocks, "rows", "w", "n (rows)", (dyo, "dy"))
        k = _uniform(wo.blocks, "cols", "w", "k (columns)")
        right = wo.blocks
    if wn != n:
        raise ValueError(f"w: has n={wn} rows per expert but dy has n={n} columns")
    if k < 1 or n < 1:
        raise ValueError(f"dy, w: need k >= 1 and n >= 1, got k={k}, n={n}")
    if dyo.fmt:
        _check_fp8_dim(n, "n (dy.k, w's rows per expert)")
        _check_fp8_dim(k, "k (w.k)")
    _check_block_tokens(dyo, "dy")
    return Problem("dgrad", dyo.fmt is not None, dyo.blocks, False, right, bool(wo.fmt),
                   (n,) * len(dyo.blocks), dyo.scale_inv, wo.scale_inv, None, None,
                   _fast_accum(fast_accum, dyo), False, out_dtype, _place(dyo),
                   dyo.scale_mode, wo.scale_mode)


def check_wgrad(x, dy, *, out_dtype=None, fast_accum=False, accumulate=False) -> Problem:
    """Check wgrad's operands. FP8: both transposed, ``x`` ``(k, m_pad_i)``, ``dy`` ``(n, m_pad_i)``."""
    check_bool(fast_accum, "fast_accum")
    check_bool(accumulate, "accumulate")
    xo = _operand(x, "x", "columnwise", "wgrad")
    dyo = _operand(dy, "dy", "columnwise", "wgrad")
    _check_pair(xo, "x", dyo, "dy")
    out_dtype = _check_out_dtype(out_dtype, xo, wgrad=True)
    if xo.m_splits != dyo.m_splits:
        raise ValueError(f"x, dy: token counts per expert differ: {xo.m_splits} vs {dyo.m_splits}")
    if xo.fmt:
        k, n = first(xo.blocks, "rows"), first(dyo.blocks, "rows")
        pads = tuple(xo.blocks.cols.tolist())
        if pads != tuple(dyo.blocks.cols.tolist()):
            raise ValueError(f"x, dy: padded token counts differ ({pads} vs "
                             f"{tuple(dyo.blocks.cols.tolist())}): cast both with the same align")
        unaligned = np.flatnonzero(xo.blocks.cols % FP8_MULTIPLE)   # the pads, as an array
        if unaligned.size:
            i = int(unaligned[0])
            raise ValueError(f"x, dy: FP8 wgrad reduces over the padded token count, which must "
                             f"be a multiple of {FP8_MULTIPLE}; expert {i} has m_pad={pads[i]} "
                             f"(cast with align=16)")
        _check_fp8_dim(k, "k (x.k)")
        _check_fp8_dim(n, "n (dy.k)")
        reduction = pads
    else:
        k = _uniform(xo.blocks, "cols", "x", "k (columns)")
        n = _uniform(dyo.blocks, "cols", "dy", "n (columns)")
        reduction = xo.m_splits
    if k < 1 or n < 1:
        raise ValueError(f"x, dy: need k >= 1 and n >= 1, got k={k}, n={n}")
    # wgrad: Y = dW (n x k) = dyᵀ · x. FP8: dyᵀ stored as L (n, m_pad); xᵀ stored as Rᵀ (k, m_pad).
    # Plain: dy (m, n) is Lᵀ; x (m, k) is R.
    return Problem("wgrad", xo.fmt is not None, dyo.blocks, not xo.fmt, xo.blocks, bool(xo.fmt),
                   reduction, dyo.scale_inv, xo.scale_inv, None, None, _fast_accum(fast_accum, xo),
                   bool(accumulate), out_dtype, _place(xo), dyo.scale_mode, xo.scale_mode)


def _fast_accum(fast_accum, op: _Operand) -> bool:
    """FP8 fast accumulation as asked, except with block scales: their GEMMs accumulate in split
    (full-precision) mode, as TransformerEngine's Float8BlockScaling requires; ignored there."""
    return bool(fast_accum) and not op.scale_mode


def _check_block_tokens(op: _Operand, arg: str) -> None:
    """A 1-D block-scaled row-wise left operand needs token counts in multiples of
    :data:`BLOCK_TOKEN_MULTIPLE` (empty experts are skipped)."""
    if op.scale_mode != E.CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F:
        return
    bad = [(i, m) for i, m in enumerate(op.m_splits) if m % BLOCK_TOKEN_MULTIPLE]
    if bad:
        i, m = bad[0]
        raise ValueError(f"{arg}: block-scaled FP8 GEMMs need every expert's token count to be a "
                         f"multiple of {BLOCK_TOKEN_MULTIPLE} (cuBLASLt); expert {i} has {m}. Pad "
                         "the tokens (TransformerEngine's Fp8Padding pads to 16)")


def _check_mx_dims(op: _Operand, arg: str) -> None:
    """MXFP8 GEMMs: every expert's rows and columns (as the copy is stored: tokens or features,
    and the padded tokens of a transposed copy) in multiples of :data:`MX_BLOCK`, as
    TransformerEngine requires of MXFP8 tensors (its MoE pads tokens to 32 for this recipe)."""
    for i, b in enumerate(op.blocks):
        if b.rows % MX_BLOCK or b.cols % MX_BLOCK:
            raise ValueError(f"{arg}: MXFP8 GEMMs need every expert's dimensions to be multiples "
                             f"of {MX_BLOCK} (a whole E8M0 scale block); expert {i} is "
                             f"({b.rows}, {b.cols}). Pad each expert's tokens to a multiple "
                             "of 32 before the cast (as TransformerEngine's Fp8Padding does; "
                             "align pads only the transposed copy) and use features in "
                             "multiples of 32")


def _place(op: _Operand) -> tuple[bool, int, str]:
    return (op.on_device, op.device, op.kind)


# ---------------------------------------------------------------------------------------------
# Outputs.

_ACCUMULATE_NEEDS_OUT = ("out: accumulate=True adds into existing gradients; pass them as out "
                         "(an (E, n, k) array or a list of E (n, k) float32 main_grad arrays)")


def _empty(xp, shape, out_dtype: str):
    """A new output; bfloat16 is ml_dtypes' on the host and a ``uint16`` carrier in CuPy."""
    if xp is np:
        import ml_dtypes

        dt = ml_dtypes.bfloat16 if out_dtype == "bfloat16" else np.dtype(out_dtype)
    else:
        dt = np.uint16 if out_dtype == "bfloat16" else np.dtype(out_dtype)
    return xp.empty(shape, dtype=dt)


def _out_rows(out, rows: int, cols: int, out_dtype: str, place, xp) -> tuple[Any, ArrayView]:
    """The ``(Σ m_i, cols)`` output: ``out`` checked, or a new array."""
    if out is None:
        out = _empty(xp, (rows, cols), out_dtype)
    v = _tagged_view(out, out_dtype, "out")
    if v.dtype != out_dtype:
        raise TypeError(f"out: dtype {v.dtype} differs from out_dtype={out_dtype!r}")
    if v.shape != (rows, cols):
        raise ValueError(f"out: expected shape ({rows}, {cols}), got {v.shape}")
    if rows > 0 and cols > 0 and not v.is_row_major_rows():
        raise ValueError(f"out: expected rows with unit column stride, got strides {v.strides}")
    if (v.on_device, v.device, v.kind) != place:
        raise ValueError(f"out: must be a {place[2]} array on the operands' device "
                         f"({place[1]}), got {v.kind}@{v.device}")
    return out, v


def _row_blocks(v: ArrayView, m_splits, dtype: str) -> Blocks:
    ld = v.strides[0] if v.shape[0] > 1 else v.shape[1]
    m = np.asarray(m_splits, dtype=np.int64)
    return Blocks(v.ptr + (m.cumsum() - m) * (ld * v.itemsize), m, v.shape[1], max(ld, 1), dtype)


def _wgrad_out(out, num: int, n: int, k: int, out_dtype: str, place, xp, accumulate):
    """``(E, n, k)`` array or a list of E ``(n, k)`` arrays (``main_grad``)."""
    if out is None:
        if accumulate:
            raise ValueError(_ACCUMULATE_NEEDS_OUT)
        out = _empty(xp, (num, n, k), out_dtype)
    if isinstance(out, (list, tuple)):
        if len(out) != num:
            raise ValueError(f"out: expected {num} per-expert arrays, got {len(out)}")
        views = [_tagged_view(a, out_dtype, f"out[{i}]") for i, a in enumerate(out)]
        for i, v in enumerate(views):
            _check_grad_view(v, f"out[{i}]", n, k, out_dtype, place)
        ld = [v.strides[0] if n > 1 else k for v in views]
        return out, Blocks([v.ptr for v in views], n, k, ld, out_dtype)
    v = _tagged_view(out, out_dtype, "out")
    if v.shape != (num, n, k):
        raise ValueError(f"out: expected shape ({num}, {n}, {k}) or a list of {num} ({n}, {k}) "
                         f"arrays, got {v.shape}")
    # Every expert's (n, k) view of the stacked array has its dtype, place and trailing strides:
    # checking the first one checks them all (one view, not E), and the experts' pointers step by
    # the leading stride.
    if num:
        _check_grad_view(dataclasses.replace(v, shape=v.shape[1:], strides=v.strides[1:]), "out",
                         n, k, out_dtype, place)
    step = v.strides[0] * v.itemsize
    ptrs = v.ptr + step * np.arange(num, dtype=np.int64)
    return out, Blocks(ptrs, n, k, v.strides[1] if n > 1 else k, out_dtype)


def _check_grad_view(v: ArrayView, name: str, n: int, k: int, out_dtype: str, place) -> None:
    """One expert's ``(n, k)`` gradient output."""
    if v.dtype != out_dtype:
        raise TypeError(f"{name}: dtype {v.dtype} differs from out_dtype={out_dtype!r}")
    if v.shape != (n, k):
        raise ValueError(f"{name}: expected shape ({n}, {k}), got {v.shape}")
    if not v.is_row_major_rows():
        raise ValueError(f"{name}: expected rows with unit column stride, got {v.strides}")
    if (v.on_device, v.device, v.kind) != place:
        raise ValueError(f"{name}: must be a {place[2]} array on the operands' device "
                         f"({place[1]}), got {v.kind}@{v.device}")


def check_alignment(problem: Problem, out) -> None:
    """FP8 operands and outputs must be 16-byte aligned; plain ones aligned to their element."""
    operands = (as_blocks(problem.left), as_blocks(problem.right), as_blocks(out))
    if _surely_aligned(problem, operands):
        return
    error = _alignment_error(problem, operands)
    if error is not None:
        raise ValueError(error)


def _surely_aligned(problem: Problem, operands: tuple[Blocks, Blocks, Blocks]) -> bool:
    """A cheap screen for :func:`_alignment_error`: True only when it would find nothing.

    Every alignment asked for is a power of two, and a power of two divides every value of an
    array iff it divides their bitwise OR (and ``(OR of ld) * itemsize`` is the OR of the row
    strides in bytes: the item sizes are powers of two too), so one OR-reduction per array
    replaces the per-expert scan: about 2 us instead of 30 for a well-aligned call. It ignores
    that empty experts and one-row strides are exempt: a False only means "scan to be sure"."""
    fp8 = problem.fp8
    for b in operands:
        need = FP8_MULTIPLE if fp8 else b.itemsize
        if int(np.bitwise_or.reduce(b.ptr)) % need:
            return False
        if fp8 and int(np.bitwise_or.reduce(b.ld)) * b.itemsize % FP8_MULTIPLE:
            return False
    if problem.block_scaled:
        for ptrs in (problem.left_scale, problem.right_scale):
            if int(np.bitwise_or.reduce(np.asarray(ptrs, dtype=np.int64))) % FP8_MULTIPLE:
                return False
    return True


def _alignment_error(problem: Problem, operands: tuple[Blocks, Blocks, Blocks]) -> str | None:
    """The message of the first misaligned pointer or FP8 row stride, in the order the
    per-expert scan would meet them, or None."""
    bad = []  # (expert, order, message) of the first failure of each operand
    for order, (name, b) in enumerate(zip(("left operand", "right operand", "out"), operands)):
        need = FP8_MULTIPLE if problem.fp8 else b.itemsize
        nonempty = (b.rows > 0) & (b.cols > 0)
        mis = np.nonzero(nonempty & (pointer_alignments(b.ptr) < need))[0]
        if mis.size:
            i = int(mis[0])
            bad.append((i, 2 * order, f"{name} of expert {i}: address {int(b.ptr[i]):#x} is not "
                        f"{need}-byte aligned (cuBLASLt {'FP8 ' if problem.fp8 else ''}GEMMs need it)"))
        if problem.fp8:
            st = np.nonzero((b.rows > 1) & ((b.ld * b.itemsize) % FP8_MULTIPLE != 0))[0]
            if st.size:
                i = int(st[0])
                bad.append((i, 2 * order + 1, f"{name} of expert {i}: row stride "
                            f"{int(b.ld[i]) * b.itemsize} bytes is not a multiple of "
                            f"{FP8_MULTIPLE} (FP8 GEMMs need it)"))
    if problem.block_scaled:   # each expert's first block scale (cuBLASLt reads them 16-aligned)
        for order, (name, ptrs) in enumerate((("left operand's block scales", problem.left_scale),
                                              ("right operand's block scales", problem.right_scale)),
                                             start=6):
            p = np.asarray(ptrs, dtype=np.int64)
            mis = np.nonzero(p % FP8_MULTIPLE)[0]
            if mis.size:
                i = int(mis[0])
                bad.append((i, order, f"{name} of expert {i}: address {int(p[i]):#x} is not "
                            f"{FP8_MULTIPLE}-byte aligned (cuBLASLt's block-scaled GEMMs need it)"))
    # the error the per-expert scan in expert order would meet first
    return min(bad)[2] if bad else None


def outputs(problem: Problem, out, xp) -> tuple[Any, tuple[Block, ...]]:
    """The output (``out`` checked, or allocated with ``xp``) and its per-expert blocks."""
    place, out_dtype = problem.place, problem.out_dtype
    if out is None:
        out = new_output(problem, xp)
    if problem.pass_name == "wgrad":
        num, n, k = _out_shape(problem)
        return _wgrad_out(out, num, n, k, out_dtype, place, xp, problem.accumulate)
    m_splits = as_blocks(problem.left).rows
    rows, cols = _out_shape(problem)
    out, v = _out_rows(out, rows, cols, out_dtype, place, xp)
    return out, _row_blocks(v, m_splits, out_dtype)


def _out_shape(problem: Problem) -> tuple[int, ...]:
    """``(Σ m_i, cols)`` for fprop/dgrad, ``(E, n, k)`` for wgrad."""
    if problem.pass_name == "wgrad":
        n = first(problem.left, "rows" if problem.fp8 else "cols")
        k = first(problem.right, "rows" if problem.right_t else "cols")
        return (len(problem.left), n, k)
    cols = first(problem.right, "rows" if problem.right_t else "cols")
    return (int(as_blocks(problem.left).rows.sum()), cols)


_TORCH_NEEDS_OUT = ("out: torch operands need an out= buffer (a torch tensor on their device): the "
                    "ops read torch tensors through their pointers and never allocate one (the "
                    "custom ops of cugrouped.pytorch allocate every output with torch)")


def new_output(problem: Problem, xp):
    """A new output array for ``problem`` (wgrad with ``accumulate=True`` needs the caller's; so
    do torch operands: a torch output can only come from torch, which the ops do not import)."""
    if problem.pass_name == "wgrad" and problem.accumulate:
        raise ValueError(_ACCUMULATE_NEEDS_OUT)
    if problem.place[2] == "torch":
        raise ValueError(_TORCH_NEEDS_OUT)
    return _empty(xp, _out_shape(problem), problem.out_dtype)
