"""Grouped expert GEMMs through cuBLASLt: fprop, dgrad and wgrad for all experts (design.md §4, §5).

For experts ``i = 0..E-1``, in row-major terms:

* fprop  ``y_i = x_i · W_iᵀ (+ b_i)``  into the unpadded ``(Σ m_i, n)`` output;
* dgrad  ``dx_i = dy_i · W_i``         into ``(Σ m_i, k)``;
* wgrad  ``dW_i = dy_iᵀ · x_i``        into ``(E, n, k)`` or per-expert ``main_grad`` buffers
  (``accumulate=True``: ``C = D``, ``beta = 1``).

Operands are either :class:`~cugrouped.GroupedFP8` results of ``multi_pad_cast_transpose``
(FP8 path: every call is "TN", the operands are the row-wise or transposed copies of the layout
table, and each expert's ``scale_inv`` is passed as cuBLASLt's A/B scale pointer, on the device),
or lists of plain bfloat16 / float16 / float32 arrays (the same layer without FP8).

The module is in three parts: argument checks that turn the operands into :class:`Block`
descriptions (numbers only), planning (pure functions of those numbers, tested on the CPU), and the
launch: a loop of ``cublasLtMatmul`` over the non-empty experts, spread over a few side streams
forked from and joined back to the caller's stream. ``backend="reference"`` runs the NumPy twin in
:mod:`cugrouped.reference.grouped_gemm`; there is no ``"emulate"`` backend (cuBLASLt has no CPU
emulation).
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._array import ArrayView, as_view
from ..cublaslt import _enums as E
from ..cublaslt import descriptors as _D  # imports without loading libcublasLt
from ..grouped_fp8 import GroupedFP8
from . import _launch

__all__ = [
    "grouped_fprop", "grouped_dgrad", "grouped_wgrad",
    "Block", "ExpertGemm", "GemmPlan", "Problem", "pointer_alignment", "plan_expert",
    "plan_problem", "check_fprop", "check_dgrad", "check_wgrad", "outputs", "check_alignment",
    "gemm_config", "bias_dtype_for", "workspace_bytes_for", "build_descriptors",
    "FP8_MULTIPLE", "NUM_STREAMS", "OUT_DTYPES",
]

# cuBLASLt FP8 GEMMs need the reduction and output dims, leading dims and pointers in multiples of
# 16 (elements = bytes for FP8).
FP8_MULTIPLE = 16
# Side streams the per-expert loop is spread over (TransformerEngine uses 4).
NUM_STREAMS = 4
OUT_DTYPES = ("bfloat16", "float16", "float32")
PLAIN_DTYPES = ("bfloat16", "float16", "float32")
_FP8_DTYPE = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
# Output dtypes cuBLASLt offers for each plain input dtype (fp32 compute).
_PLAIN_OUT = {"bfloat16": ("bfloat16", "float32"), "float16": ("float16", "float32"),
              "float32": ("float32",)}


# ---------------------------------------------------------------------------------------------
# Planning: pure functions of pointers and sizes.

@dataclasses.dataclass(frozen=True)
class Block:
    """One expert's matrix as stored: row-major ``rows x cols`` with row stride ``ld`` (elements)
    at device address ``ptr``."""

    ptr: int
    rows: int
    cols: int
    ld: int
    dtype: str

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]


def pointer_alignment(ptr: int, cap: int = 256) -> int:
    """Largest power of two (at most ``cap``, cuBLASLt's default assumption) dividing ``ptr``."""
    ptr = int(ptr)
    return cap if ptr == 0 else min(ptr & -ptr, cap)


@dataclasses.dataclass(frozen=True)
class ExpertGemm:
    """One ``cublasLtMatmul`` in cuBLAS (column-major) terms: ``D (m x n) = op(A) · op(B) + beta·C``
    with reduction ``k``; layouts are ``(cudaDataType, rows, cols, ld)`` of the stored matrices;
    ``C = D``. Alignments are the real ones of the pointers, for the ``MIN_ALIGNMENT`` preferences."""

    expert: int
    transa: int
    transb: int
    m: int
    n: int
    k: int
    a_ptr: int
    a_layout: tuple[int, int, int, int]
    b_ptr: int
    b_layout: tuple[int, int, int, int]
    d_ptr: int
    d_layout: tuple[int, int, int, int]
    beta: float = 0.0
    a_scale_ptr: int = 0
    b_scale_ptr: int = 0
    bias_ptr: int = 0

    @property
    def alignments(self) -> tuple[int, int, int, int]:
        """(A, B, C, D) pointer alignments in bytes (C is D)."""
        d = pointer_alignment(self.d_ptr)
        return pointer_alignment(self.a_ptr), pointer_alignment(self.b_ptr), d, d


def plan_expert(expert: int, left: Block, left_t: bool, right: Block, right_t: bool, out: Block,
                reduction: int, *, beta: float = 0.0, a_scale_ptr: int = 0, b_scale_ptr: int = 0,
                bias_ptr: int = 0) -> ExpertGemm:
    """Map the row-major product ``Y (p x q) = L (p x r) · R (r x q)`` onto one cuBLASLt call.

    ``left`` stores ``L`` row-major (``left_t=False``: a ``(p, r)`` block) or ``Lᵀ``
    (``left_t=True``: ``(r, p)``); ``right`` stores ``R`` (``(r, q)``) or ``Rᵀ`` (``(q, r)``);
    ``out`` is ``Y`` (``(p, q)``). Column-major, ``Yᵀ = Rᵀ · Lᵀ``: cuBLAS's A is the right operand,
    B the left one, ``D`` is ``(q, p)``, and an operand stored transposed needs ``OP_N``.
    """
    p, q, r = out.rows, out.cols, reduction
    for name, b, want in (("left", left, (r, p) if left_t else (p, r)),
                          ("right", right, (q, r) if right_t else (r, q))):
        if (b.rows, b.cols) != want:
            raise ValueError(f"expert {expert}: {name} operand is {b.rows}x{b.cols}, expected "
                             f"{want[0]}x{want[1]}")
    ct = E.DTYPE_TO_CUDA
    # A = Rᵀ (q x r, col-major): stored R (r, q) row-major is Rᵀ col-major -> OP_N;
    # stored Rᵀ (q, r) row-major is R col-major (r x q) -> OP_T.
    transa = E.CUBLAS_OP_T if right_t else E.CUBLAS_OP_N
    a_layout = (ct[right.dtype], r, q, right.ld) if right_t else (ct[right.dtype], q, r, right.ld)
    # B = Lᵀ (r x p, col-major): stored L (p, r) -> OP_N; stored Lᵀ (r, p) -> OP_T.
    transb = E.CUBLAS_OP_T if left_t else E.CUBLAS_OP_N
    b_layout = (ct[left.dtype], p, r, left.ld) if left_t else (ct[left.dtype], r, p, left.ld)
    d_layout = (ct[out.dtype], q, p, out.ld)
    return ExpertGemm(expert, transa, transb, q, p, r, right.ptr, a_layout, left.ptr, b_layout,
                      out.ptr, d_layout, float(beta), int(a_scale_ptr), int(b_scale_ptr),
                      int(bias_ptr))


@dataclasses.dataclass(frozen=True)
class Problem:
    """A checked grouped GEMM, as numbers: per-expert blocks of both operands and the output.

    ``left``/``right`` follow :func:`plan_expert`; ``reduction`` is per expert; scales are the
    device addresses of each expert's ``scale_inv`` (FP8), ``bias`` of each bias vector; ``place``
    is (on_device, device ordinal, array kind) of the operands.
    """

    pass_name: str
    fp8: bool
    left: tuple[Block, ...]
    left_t: bool
    right: tuple[Block, ...]
    right_t: bool
    reduction: tuple[int, ...]
    left_scale: tuple[int, ...] | None = None
    right_scale: tuple[int, ...] | None = None
    bias: tuple[int, ...] | None = None
    bias_dtype: str | None = None
    fast_accum: bool = False
    accumulate: bool = False
    out_dtype: str = "bfloat16"
    place: tuple[bool, int, str] = (False, -1, "numpy")


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """The calls to make (non-empty experts only), the experts to zero, and the shared config."""

    config: Any  # cublaslt.GemmConfig
    calls: tuple[ExpertGemm, ...]
    zero: tuple[int, ...]
    skipped: tuple[int, ...]


def bias_dtype_for(out_dtype: str, fp8: bool) -> str:
    """cuBLASLt's bias type for the ``BIAS`` epilogue: the output type, except that FP8 GEMMs with
    a float32 output take a bfloat16 bias."""
    return "bfloat16" if fp8 and out_dtype == "float32" else out_dtype


def gemm_config(problem: Problem, transa: int, transb: int):
    """The :class:`~cugrouped.cublaslt.GemmConfig` (descriptor cache key) of a problem."""
    from ..cublaslt.descriptors import GemmConfig

    ct = E.DTYPE_TO_CUDA
    return GemmConfig(
        a_type=ct[problem.right[0].dtype], b_type=ct[problem.left[0].dtype],
        d_type=ct[problem.out_dtype], transa=transa, transb=transb,
        bias_type=ct[problem.bias_dtype] if problem.bias is not None else None,
        fast_accum=bool(problem.fast_accum) and problem.fp8, scaled=problem.fp8)


def plan_problem(problem: Problem, out: Sequence[Block]) -> GemmPlan:
    """Per-expert calls for ``problem`` writing ``out``; experts with nothing to compute are
    skipped (``m_i == 0`` in fprop/dgrad: an empty output; an empty reduction in wgrad: zeroed,
    or left untouched when accumulating)."""
    calls, zero, skipped = [], [], []
    beta = 1.0 if problem.accumulate else 0.0
    for i, (left, right, o, r) in enumerate(zip(problem.left, problem.right, out, problem.reduction)):
        if o.rows == 0 or o.cols == 0 or r == 0:
            skipped.append(i)
            if r == 0 and o.rows * o.cols > 0 and not problem.accumulate:
                zero.append(i)
            continue
        calls.append(plan_expert(
            i, left, problem.left_t, right, problem.right_t, o, r, beta=beta,
            a_scale_ptr=problem.right_scale[i] if problem.right_scale else 0,
            b_scale_ptr=problem.left_scale[i] if problem.left_scale else 0,
            bias_ptr=problem.bias[i] if problem.bias is not None else 0))
    transa = E.CUBLAS_OP_T if problem.right_t else E.CUBLAS_OP_N
    transb = E.CUBLAS_OP_T if problem.left_t else E.CUBLAS_OP_N
    return GemmPlan(gemm_config(problem, transa, transb), tuple(calls), tuple(zero), tuple(skipped))


def workspace_bytes_for(compute_capability: int) -> int:
    """cuBLASLt workspace per stream: 32 MiB on Hopper and newer (what its FP8 kernels want, as in
    TransformerEngine), 4 MiB before."""
    return (32 << 20) if compute_capability >= 90 else (4 << 20)


def build_descriptors(config, call: ExpertGemm, workspace_bytes: int):
    """Descriptors for one call, from the caches, with the per-call pointers set: returns
    ``(desc, a_layout, b_layout, d_layout, preference)``. Needs no GPU."""
    desc = _D.matmul_desc(config)
    if config.scaled:
        desc.set("A_SCALE_POINTER", call.a_scale_ptr)
        desc.set("B_SCALE_POINTER", call.b_scale_ptr)
    if config.bias_type is not None:
        desc.set("BIAS_POINTER", call.bias_ptr)
    la = _D.matrix_layout(*call.a_layout)
    lb = _D.matrix_layout(*call.b_layout)
    ld = _D.matrix_layout(*call.d_layout)
    pref = _D.preference(workspace_bytes, *call.alignments)
    return desc, la, lb, ld, pref


# ---------------------------------------------------------------------------------------------
# Argument checks: operands -> blocks.

@dataclasses.dataclass(frozen=True)
class _Operand:
    blocks: tuple[Block, ...]
    dtype: str
    scale_inv: tuple[int, ...] | None
    fmt: str | None
    on_device: bool
    device: int
    kind: str
    m_splits: tuple[int, ...]


def _where(views: Sequence[ArrayView], arg: str) -> tuple[bool, int, str]:
    first = views[0]
    for v in views[1:]:
        if (v.kind, v.device) != (first.kind, first.device):
            raise ValueError(f"{arg}: mixes a {first.kind} array on device {first.device} with a "
                             f"{v.kind} array on device {v.device}")
    if first.kind == "torch":
        raise TypeError(f"{arg}: torch tensors go through cugrouped.pytorch (not implemented yet); "
                        "pass NumPy or CuPy arrays")
    return first.on_device, first.device, first.kind


def _fp8_operand(g: GroupedFP8, copy: str, arg: str, need: str) -> _Operand:
    """Blocks of the row-wise ``(m_i, k)`` or transposed ``(k, m_pad_i)`` copies of ``g``."""
    if getattr(g, "splits_on_device", False):
        raise ValueError(f"{arg}: its token counts live on the device; the per-expert cuBLASLt loop "
                         "needs them on the host (cast with host m_splits, or rebuild the "
                         "GroupedFP8 with m_splits, m_pad_splits = g.host_splits(), a sync)")
    data = g.data if copy == "rowwise" else g.data_t
    if data is None:
        raise ValueError(f"{arg}: {need} needs the {copy} FP8 copy; cast with "
                         f"multi_pad_cast_transpose(..., {copy}=True)")
    if g.fp8_format not in _FP8_DTYPE:
        raise ValueError(f"{arg}: unknown fp8_format {g.fp8_format!r}")
    dv = as_view(data, arg=f"{arg}.data" if copy == "rowwise" else f"{arg}.data_t")
    sv = as_view(g.scale_inv, arg=f"{arg}.scale_inv")
    E_ = g.num_experts
    if sv.dtype != "float32" or sv.shape != (E_,) or (E_ > 1 and sv.strides != (1,)):
        raise ValueError(f"{arg}.scale_inv: expected a contiguous float32 array of shape ({E_},), "
                         f"got {sv.dtype} {sv.shape}")
    on_device, device, kind = _where([dv, sv], arg)
    k = g.k
    dtype = _FP8_DTYPE[g.fp8_format]
    blocks = []
    if copy == "rowwise":
        rows = sum(g.m_splits)
        if dv.shape != (rows, k) or (rows > 1 and dv.strides != (k, 1)):
            raise ValueError(f"{arg}.data: expected a contiguous ({rows}, {k}) array, got shape "
                             f"{dv.shape} strides {dv.strides}")
        for m, off in zip(g.m_splits, g.row_offsets()):
            blocks.append(Block(dv.ptr + int(off) * k, m, k, k, dtype))
    else:
        total = int(g.col_offsets()[-1])
        if dv.size != total or (total > 1 and dv.strides[-1] != 1):
            raise ValueError(f"{arg}.data_t: expected {total} contiguous bytes, got shape {dv.shape}")
        for mp, off in zip(g.m_pad_splits, g.col_offsets()):
            blocks.append(Block(dv.ptr + int(off), k, mp, mp, dtype))
    scales = tuple(sv.ptr + 4 * i for i in range(E_))
    return _Operand(tuple(blocks), dtype, scales, g.fp8_format, on_device, device, kind,
                    tuple(g.m_splits))


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
        views = [dataclasses.replace(v, ptr=v.ptr + i * v.strides[0] * v.itemsize,
                                     shape=v.shape[1:], strides=v.strides[1:])
                 for i in range(v.shape[0])]
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
        blocks.append(Block(v.ptr, rows, cols, max(ld, 1), dtype))
    return _Operand(tuple(blocks), dtype, None, None, on_device, device, kind,
                    tuple(b.rows for b in blocks))


def _operand(x: Any, arg: str, copy: str, need: str, expect_3d: bool = False) -> _Operand:
    if isinstance(x, GroupedFP8):
        return _fp8_operand(x, copy, arg, need)
    return _plain_operand(x, arg, expect_3d)


def _check_pair(a: _Operand, a_name: str, b: _Operand, b_name: str) -> None:
    if (a.fmt is None) != (b.fmt is None):
        fp8, plain = (a_name, b_name) if a.fmt else (b_name, a_name)
        raise TypeError(f"{fp8} is a GroupedFP8 but {plain} is not: both operands must be FP8 "
                        "(GroupedFP8) or both plain arrays")
    if a.fmt == "e5m2" and b.fmt == "e5m2":
        raise ValueError(f"{a_name}, {b_name}: E5M2 x E5M2 is not a cuBLASLt FP8 GEMM (supported "
                         "pairs: E4M3xE4M3, E4M3xE5M2, E5M2xE4M3); cast one of them as e4m3")
    if a.fmt is None and a.dtype != b.dtype:
        raise TypeError(f"{b_name}: dtype {b.dtype} differs from {a_name}'s {a.dtype}")
    if (a.on_device, a.device, a.kind) != (b.on_device, b.device, b.kind):
        raise ValueError(f"{a_name} and {b_name}: must be arrays of the same kind on the same "
                         f"device, got {a.kind}@{a.device} and {b.kind}@{b.device}")
    if len(a.blocks) != len(b.blocks):
        raise ValueError(f"{a_name} has {len(a.blocks)} experts but {b_name} has {len(b.blocks)}")


def _check_out_dtype(out_dtype: str, op: _Operand) -> None:
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype: got {out_dtype!r}, expected one of {OUT_DTYPES}")
    if op.fmt is None and out_dtype not in _PLAIN_OUT[op.dtype]:
        raise ValueError(f"out_dtype: {op.dtype} operands give {_PLAIN_OUT[op.dtype]} outputs in "
                         f"cuBLASLt, got {out_dtype!r}")


def _check_fp8_dim(value: int, name: str) -> None:
    if value % FP8_MULTIPLE:
        raise ValueError(f"{name}: FP8 GEMMs need a multiple of {FP8_MULTIPLE}, got {value}")


def _uniform(blocks: Sequence[Block], attr: str, arg: str, what: str) -> int:
    vals = {getattr(b, attr) for b in blocks}
    if len(vals) != 1:
        raise ValueError(f"{arg}: every expert must have the same {what}, got {sorted(vals)}")
    return vals.pop()


def _tagged_view(a, dtype: str, arg: str) -> ArrayView:
    """``as_view``, reading an integer carrier (CuPy's ``uint16`` for bfloat16) as ``dtype``."""
    carrier = getattr(getattr(a, "dtype", None), "kind", "") in ("u", "i")
    return as_view(a, dtype=dtype if carrier else None, arg=arg)


def _bias(bias: Any, n: int, num: int, dtype: str, where: _Operand) -> tuple[int, ...] | None:
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
        views = [dataclasses.replace(v, ptr=v.ptr + i * v.strides[0] * v.itemsize,
                                     shape=v.shape[1:], strides=v.strides[1:]) for i in range(num)]
    on_device, device, kind = _where(views, "bias")
    if (on_device, device, kind) != (where.on_device, where.device, where.kind):
        raise ValueError("bias: must live with the operands (same array kind and device)")
    for i, v in enumerate(views):
        if v.shape != (n,) or (n > 1 and v.strides != (1,)):
            raise ValueError(f"bias[{i}]: expected a contiguous ({n},) vector, got shape {v.shape} "
                             f"strides {v.strides}")
        if v.dtype != dtype:
            raise TypeError(f"bias[{i}]: cuBLASLt's bias epilogue needs {dtype} here (output "
                            f"{'FP8 GEMM ' if where.fmt else ''}type), got {v.dtype}")
    return tuple(v.ptr for v in views)


def check_fprop(x, w, bias=None, *, out_dtype="bfloat16", fast_accum=True) -> Problem:
    """Check fprop's operands; raise TypeError/ValueError naming the argument."""
    xo = _operand(x, "x", "rowwise", "fprop")
    wo = _operand(w, "w", "rowwise", "fprop", expect_3d=True)
    _check_pair(wo, "w", xo, "x")
    _check_out_dtype(out_dtype, xo)
    k = _uniform(xo.blocks, "cols", "x", "k (columns)") if xo.fmt is None else xo.blocks[0].cols
    n = _uniform(wo.blocks, "rows", "w", "n (rows)")
    wk = _uniform(wo.blocks, "cols", "w", "k (columns)")
    if wk != k:
        raise ValueError(f"w: has k={wk} columns but x has k={k}")
    if k < 1 or n < 1:
        raise ValueError(f"x, w: need k >= 1 and n >= 1, got k={k}, n={n}")
    if xo.fmt:
        _check_fp8_dim(k, "k (x.k, w.k)")
        _check_fp8_dim(n, "n (w's rows per expert)")
    bdt = bias_dtype_for(out_dtype, xo.fmt is not None)
    return Problem("fprop", xo.fmt is not None, xo.blocks, False, wo.blocks, True,
                   (k,) * len(xo.blocks), xo.scale_inv, wo.scale_inv,
                   _bias(bias, n, len(xo.blocks), bdt, xo), bdt if bias is not None else None,
                   bool(fast_accum), False, out_dtype, _place(xo))


def check_dgrad(dy, w, *, out_dtype="bfloat16", fast_accum=False) -> Problem:
    """Check dgrad's operands. FP8: ``dy`` row-wise ``(m_i, n)``, ``w`` transposed ``(k, n)``."""
    dyo = _operand(dy, "dy", "rowwise", "dgrad")
    wo = _operand(w, "w", "columnwise", "dgrad (the transposed weight)", expect_3d=True)
    _check_pair(wo, "w", dyo, "dy")
    _check_out_dtype(out_dtype, dyo)
    n = dyo.blocks[0].cols if dyo.fmt else _uniform(dyo.blocks, "cols", "dy", "n (columns)")
    if wo.fmt:
        # w's transposed blocks are (k, n_pad) with the true n = w.m_splits[i] columns
        w_n = set(wo.m_splits)
        if len(w_n) != 1:
            raise ValueError(f"w: every expert must have the same n (rows), got {sorted(w_n)}")
        wn = w_n.pop()
        k = wo.blocks[0].rows
        right = tuple(dataclasses.replace(b, cols=wn) for b in wo.blocks)
    else:
        wn = _uniform(wo.blocks, "rows", "w", "n (rows)")
        k = _uniform(wo.blocks, "cols", "w", "k (columns)")
        right = wo.blocks
    if wn != n:
        raise ValueError(f"w: has n={wn} rows per expert but dy has n={n} columns")
    if k < 1 or n < 1:
        raise ValueError(f"dy, w: need k >= 1 and n >= 1, got k={k}, n={n}")
    if dyo.fmt:
        _check_fp8_dim(n, "n (dy.k, w's rows per expert)")
        _check_fp8_dim(k, "k (w.k)")
    return Problem("dgrad", dyo.fmt is not None, dyo.blocks, False, right, bool(wo.fmt),
                   (n,) * len(dyo.blocks), dyo.scale_inv, wo.scale_inv, None, None,
                   bool(fast_accum), False, out_dtype, _place(dyo))


def check_wgrad(x, dy, *, out_dtype="float32", fast_accum=False, accumulate=False) -> Problem:
    """Check wgrad's operands. FP8: both transposed, ``x`` ``(k, m_pad_i)``, ``dy`` ``(n, m_pad_i)``."""
    xo = _operand(x, "x", "columnwise", "wgrad")
    dyo = _operand(dy, "dy", "columnwise", "wgrad")
    _check_pair(xo, "x", dyo, "dy")
    _check_out_dtype(out_dtype, xo)
    if xo.m_splits != dyo.m_splits:
        raise ValueError(f"x, dy: token counts per expert differ: {xo.m_splits} vs {dyo.m_splits}")
    if xo.fmt:
        k, n = xo.blocks[0].rows, dyo.blocks[0].rows
        pads = tuple(b.cols for b in xo.blocks)
        if pads != tuple(b.cols for b in dyo.blocks):
            raise ValueError(f"x, dy: padded token counts differ ({pads} vs "
                             f"{tuple(b.cols for b in dyo.blocks)}): cast both with the same align")
        for i, mp in enumerate(pads):
            if mp % FP8_MULTIPLE:
                raise ValueError(f"x, dy: FP8 wgrad reduces over the padded token count, which must "
                                 f"be a multiple of {FP8_MULTIPLE}; expert {i} has m_pad={mp} "
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
                   reduction, dyo.scale_inv, xo.scale_inv, None, None, bool(fast_accum),
                   bool(accumulate), out_dtype, _place(xo))


def _place(op: _Operand) -> tuple[bool, int, str]:
    return (op.on_device, op.device, op.kind)


# ---------------------------------------------------------------------------------------------
# Outputs.

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


def _row_blocks(v: ArrayView, m_splits: Sequence[int], dtype: str) -> tuple[Block, ...]:
    ld = v.strides[0] if v.shape[0] > 1 else v.shape[1]
    blocks, row = [], 0
    for m in m_splits:
        blocks.append(Block(v.ptr + row * ld * v.itemsize, m, v.shape[1], max(ld, 1), dtype))
        row += m
    return tuple(blocks)


def _wgrad_out(out, num: int, n: int, k: int, out_dtype: str, place, xp, accumulate):
    """``(E, n, k)`` array or a list of E ``(n, k)`` arrays (``main_grad``)."""
    if out is None:
        if accumulate:
            raise ValueError("out: accumulate=True adds into existing gradients; pass them as out "
                             "(an (E, n, k) array or a list of E (n, k) float32 main_grad arrays)")
        out = _empty(xp, (num, n, k), out_dtype)
    if isinstance(out, (list, tuple)):
        if len(out) != num:
            raise ValueError(f"out: expected {num} per-expert arrays, got {len(out)}")
        views = [_tagged_view(a, out_dtype, f"out[{i}]") for i, a in enumerate(out)]
        names = [f"out[{i}]" for i in range(num)]
    else:
        v = _tagged_view(out, out_dtype, "out")
        if v.shape != (num, n, k):
            raise ValueError(f"out: expected shape ({num}, {n}, {k}) or a list of {num} ({n}, {k}) "
                             f"arrays, got {v.shape}")
        views = [dataclasses.replace(v, ptr=v.ptr + i * v.strides[0] * v.itemsize, shape=(n, k),
                                     strides=v.strides[1:]) for i in range(num)]
        names = ["out"] * num
    blocks = []
    for v, name in zip(views, names):
        if v.dtype != out_dtype:
            raise TypeError(f"{name}: dtype {v.dtype} differs from out_dtype={out_dtype!r}")
        if v.shape != (n, k):
            raise ValueError(f"{name}: expected shape ({n}, {k}), got {v.shape}")
        if not v.is_row_major_rows():
            raise ValueError(f"{name}: expected rows with unit column stride, got {v.strides}")
        if (v.on_device, v.device, v.kind) != place:
            raise ValueError(f"{name}: must be a {place[2]} array on the operands' device "
                             f"({place[1]}), got {v.kind}@{v.device}")
        blocks.append(Block(v.ptr, n, k, v.strides[0] if n > 1 else k, out_dtype))
    return out, tuple(blocks)


def check_alignment(problem: Problem, out: Sequence[Block]) -> None:
    """FP8 operands and outputs must be 16-byte aligned; plain ones aligned to their element."""
    for i, (left, right, o) in enumerate(zip(problem.left, problem.right, out)):
        for name, b in (("left operand", left), ("right operand", right), ("out", o)):
            need = FP8_MULTIPLE if problem.fp8 else b.itemsize
            if b.rows and b.cols and pointer_alignment(b.ptr) < need:
                raise ValueError(f"{name} of expert {i}: address {b.ptr:#x} is not {need}-byte "
                                 f"aligned (cuBLASLt {'FP8 ' if problem.fp8 else ''}GEMMs need it)")
            if problem.fp8 and b.rows > 1 and (b.ld * b.itemsize) % FP8_MULTIPLE:
                raise ValueError(f"{name} of expert {i}: row stride {b.ld * b.itemsize} bytes is "
                                 f"not a multiple of {FP8_MULTIPLE} (FP8 GEMMs need it)")


# ---------------------------------------------------------------------------------------------
# The ops.

def _backend(backend: str | None, on_device: bool) -> str:
    if backend == "emulate":
        raise ValueError("backend='emulate' is not available for the grouped GEMMs: they run in "
                         "cuBLASLt, which has no CPU emulation; use backend='reference' (NumPy) "
                         "for host arrays or 'cuda' for device arrays")
    return _launch.resolve_backend(backend, on_device)


def grouped_fprop(x, w, bias=None, *, out=None, out_dtype: str = "bfloat16",
                  fast_accum: bool = True, backend: str | None = None):
    """``y_i = x_i · W_iᵀ (+ b_i)`` for every expert, into one unpadded ``(Σ m_i, n)`` array.

    Parameters
    ----------
    x : GroupedFP8 (row-wise copy used, ``k % 16 == 0``) or list of E ``(m_i, k)`` arrays.
    w : GroupedFP8 from ``multi_pad_cast_transpose(w_list, align=1)`` (row-wise ``(n, k)`` per
        expert, ``n % 16 == 0``), or list of E ``(n, k)`` arrays / one ``(E, n, k)`` array.
        FP8 pairs: E4M3xE4M3, E4M3xE5M2, E5M2xE4M3. Plain operands share one dtype.
    bias : None, ``(E, n)`` array or list of E ``(n,)`` vectors, contiguous, of the output dtype
        (bfloat16 for an FP8 GEMM with float32 output); added by cuBLASLt's ``BIAS`` epilogue.
    out : ``(Σ m_i, n)`` array (unit column stride), or None to allocate. CuPy bfloat16 is a
        ``uint16`` array tagged by ``out_dtype``.
    out_dtype : ``"bfloat16"``, ``"float16"`` or ``"float32"``.
    fast_accum : FP8 fast accumulation (cuBLASLt ``FAST_ACCUM``); ignored without FP8.
    backend : ``"cuda"`` (cuBLASLt, device arrays), ``"reference"`` (NumPy twin, host arrays) or
        None to pick by where the data lives.

    Experts with ``m_i == 0`` are skipped. Returns ``out``.
    """
    problem = check_fprop(x, w, bias, out_dtype=out_dtype, fast_accum=fast_accum)
    return _run("fprop", problem, out, backend, (x, w, bias),
                dict(out_dtype=out_dtype, fast_accum=fast_accum))


def grouped_dgrad(dy, w, *, out=None, out_dtype: str = "bfloat16", fast_accum: bool = False,
                  backend: str | None = None):
    """``dx_i = dy_i · W_i`` for every expert, into one unpadded ``(Σ m_i, k)`` array.

    ``dy``: GroupedFP8 (row-wise ``(m_i, n)``, ``n % 16 == 0``) or list of ``(m_i, n)`` arrays;
    ``w``: GroupedFP8 with the transposed copy (``(k, n)`` per expert, ``k % 16 == 0``) or list of
    ``(n, k)`` arrays / one ``(E, n, k)`` array. Other arguments as :func:`grouped_fprop`.
    """
    problem = check_dgrad(dy, w, out_dtype=out_dtype, fast_accum=fast_accum)
    return _run("dgrad", problem, out, backend, (dy, w),
                dict(out_dtype=out_dtype, fast_accum=fast_accum))


def grouped_wgrad(x, dy, *, out=None, accumulate: bool = False, out_dtype: str = "float32",
                  fast_accum: bool = False, backend: str | None = None):
    """``dW_i = dy_iᵀ · x_i`` for every expert.

    ``x``, ``dy``: GroupedFP8 with transposed copies (``(k, m_pad_i)``, ``(n, m_pad_i)``, cast with
    the same ``align``, a multiple of 16; the zero padding adds nothing), or lists of ``(m_i, k)``
    and ``(m_i, n)`` arrays. ``out``: ``(E, n, k)`` array or list of E ``(n, k)`` arrays;
    ``accumulate=True`` adds into it (``beta = 1``; fp32 ``main_grad``) and requires it. An expert
    with ``m_i == 0`` gets a zero gradient, or keeps its accumulated one untouched.
    """
    problem = check_wgrad(x, dy, out_dtype=out_dtype, fast_accum=fast_accum, accumulate=accumulate)
    return _run("wgrad", problem, out, backend, (x, dy),
                dict(out_dtype=out_dtype, fast_accum=fast_accum, accumulate=accumulate))


def _run(pass_name: str, problem: Problem, out, backend, args, kwargs):
    backend = _backend(backend, problem.place[0])
    if backend == "reference":
        from ..reference import grouped_gemm as ref

        return getattr(ref, f"grouped_{pass_name}")(*args, out=out, backend="reference", **kwargs)
    import cupy

    with cupy.cuda.Device(problem.place[1]):
        out, blocks = outputs(problem, out, cupy)
        check_alignment(problem, blocks)
        plan = plan_problem(problem, blocks)
        _launch_plan(plan, problem, blocks, problem.place[1])
    return out


def outputs(problem: Problem, out, xp) -> tuple[Any, tuple[Block, ...]]:
    """The output (``out`` checked, or allocated with ``xp``) and its per-expert blocks."""
    pass_name, place = problem.pass_name, problem.place
    num = len(problem.left)
    out_dtype = problem.out_dtype
    if pass_name == "wgrad":
        n = problem.left[0].rows if problem.fp8 else problem.left[0].cols
        k = problem.right[0].rows if problem.fp8 else problem.right[0].cols
        return _wgrad_out(out, num, n, k, out_dtype, place, xp, problem.accumulate)
    m_splits = tuple(b.rows for b in problem.left)
    cols = problem.right[0].rows if problem.right_t else problem.right[0].cols
    out, v = _out_rows(out, sum(m_splits), cols, out_dtype, place, xp)
    return out, _row_blocks(v, m_splits, out_dtype)


# ---------------------------------------------------------------------------------------------
# The launch (CUDA only).

class _DeviceState:
    """One cuBLASLt handle per device, side streams, a workspace per stream, heuristic results."""

    def __init__(self, device: int):
        import cupy

        from ..cublaslt import Handle

        self.device = device
        dev = cupy.cuda.Device(device)
        cc = int(dev.compute_capability)
        self.compute_capability = cc
        self.workspace_bytes = workspace_bytes_for(cc)
        self.handle = Handle()
        self.streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(NUM_STREAMS)]
        self.workspaces: dict[int, Any] = {}
        self.algos: dict[tuple, Any] = {}

    def workspace(self, stream_ptr: int):
        import cupy

        ws = self.workspaces.get(stream_ptr)
        if ws is None:
            ws = self.workspaces[stream_ptr] = cupy.empty(self.workspace_bytes, dtype=np.uint8)
        return ws


_states: dict[int, _DeviceState] = {}
HEURISTIC_CACHE_SIZE = 1 << 16


def _state(device: int) -> _DeviceState:
    st = _states.get(device)
    if st is None:
        st = _states[device] = _DeviceState(device)
    return st


def _algo(st: _DeviceState, config, call: ExpertGemm, descs):
    from ..cublaslt import CublasLtError, HeuristicResult, lib

    key = (config, call.a_layout, call.b_layout, call.d_layout, call.alignments,
           pointer_alignment(call.bias_ptr) if config.bias_type is not None else 0)
    res = st.algos.get(key)
    if res is None:
        desc, la, lb, ld, pref = descs
        res, count = HeuristicResult(), ctypes.c_int(0)
        status = lib().cublasLtMatmulAlgoGetHeuristic(
            st.handle.handle, desc.handle, la.handle, lb.handle, ld.handle, ld.handle, pref.handle,
            1, ctypes.byref(res), ctypes.byref(count))
        if status != 0 or count.value == 0:
            raise CublasLtError("cublasLtMatmulAlgoGetHeuristic", status or E.CUBLAS_STATUS_NOT_SUPPORTED,
                                f"no algorithm for {config} with A{call.a_layout} B{call.b_layout} "
                                f"D{call.d_layout} alignments {call.alignments}")
        if len(st.algos) >= HEURISTIC_CACHE_SIZE:
            st.algos.clear()
        st.algos[key] = res
    return res


def _launch_plan(plan: GemmPlan, problem: Problem, out: Sequence[Block], device: int) -> None:
    import cupy

    from ..cublaslt import check, lib

    caller = cupy.cuda.get_current_stream()
    for i in plan.zero:  # empty reduction, not accumulating: dW_i = 0
        o = out[i]
        nbytes = ((o.rows - 1) * o.ld + o.cols) * o.itemsize
        if o.ld == o.cols:
            cupy.cuda.runtime.memsetAsync(o.ptr, 0, nbytes, caller.ptr)
        else:
            for r in range(o.rows):
                cupy.cuda.runtime.memsetAsync(o.ptr + r * o.ld * o.itemsize, 0,
                                              o.cols * o.itemsize, caller.ptr)
    if not plan.calls:
        return
    st = _state(device)
    if problem.fp8 and st.compute_capability < 89:
        raise RuntimeError(f"FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper); device "
                           f"{device} is sm_{st.compute_capability}")
    streams = st.streams if len(plan.calls) > 1 else [caller]
    if len(streams) > 1:
        fork = cupy.cuda.Event(disable_timing=True)
        fork.record(caller)
        for s in streams:
            s.wait_event(fork)
    matmul = lib().cublasLtMatmul
    alpha = ctypes.c_float(1.0)
    betas = {0.0: ctypes.c_float(0.0), 1.0: ctypes.c_float(1.0)}
    used = set()
    for j, call in enumerate(plan.calls):
        s = streams[j % len(streams)]
        used.add(j % len(streams))
        descs = build_descriptors(plan.config, call, st.workspace_bytes)
        res = _algo(st, plan.config, call, descs)
        desc, la, lb, ld, _ = descs
        ws = st.workspace(s.ptr)
        _launch.note_launch("cuda", "cublasLtMatmul", 1, 1)
        check(matmul(st.handle.handle, desc.handle, ctypes.byref(alpha), call.a_ptr, la.handle,
                     call.b_ptr, lb.handle, ctypes.byref(betas[call.beta]), call.d_ptr, ld.handle,
                     call.d_ptr, ld.handle, ctypes.byref(res.algo), ws.data.ptr,
                     st.workspace_bytes, s.ptr),
              "cublasLtMatmul", f"expert {call.expert}")
    if len(streams) > 1:
        for idx in sorted(used):
            done = cupy.cuda.Event(disable_timing=True)
            done.record(streams[idx])
            caller.wait_event(done)
