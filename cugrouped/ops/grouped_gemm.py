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
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._array import ArrayView, as_view
from ..cublaslt import _enums as E
from ..cublaslt import descriptors as _D  # imports without loading libcublasLt
from ..grouped_fp8 import GroupedFP8
from . import _launch
from . import grouped_gemm_setup as _setup  # registers the setup kernel (compile-check, warmup)

__all__ = [
    "grouped_fprop", "grouped_dgrad", "grouped_wgrad",
    "Block", "ExpertGemm", "GemmPlan", "Problem", "pointer_alignment", "plan_expert",
    "plan_problem", "check_fprop", "check_dgrad", "check_wgrad", "outputs", "check_alignment",
    "gemm_config", "bias_dtype_for", "workspace_bytes_for", "build_descriptors",
    "FP8_MULTIPLE", "NUM_STREAMS", "OUT_DTYPES", "Blocks", "as_blocks", "pointer_alignments",
    "VecPlan", "plan_arrays", "grouped_gemm_unsupported", "choose_path", "grouped_workspace_layout",
    "grouped_descriptors", "GROUPED_MAX_GROUPS",
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


class Blocks(Sequence):
    """The per-expert blocks of one operand (or output) as int64 arrays: what the hot path plans
    with, vectorized over experts. Indexing gives a :class:`Block`; a tuple of blocks converts with
    :func:`as_blocks`."""

    __slots__ = ("ptr", "rows", "cols", "ld", "dtype")

    def __init__(self, ptr, rows, cols, ld, dtype: str):
        self.ptr = np.asarray(ptr, dtype=np.int64).reshape(-1)
        n = self.ptr.shape[0]
        self.rows, self.cols, self.ld = (v if type(v) is np.ndarray and v.dtype == np.int64
                                         else np.full(n, v, np.int64) if isinstance(v, (int, np.integer))
                                         else np.asarray(v, dtype=np.int64).reshape(-1)
                                         for v in (rows, cols, ld))
        self.dtype = dtype

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    def __len__(self) -> int:
        return self.ptr.shape[0]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self)[i]
        return Block(int(self.ptr[i]), int(self.rows[i]), int(self.cols[i]), int(self.ld[i]),
                     self.dtype)

    def __iter__(self):
        for p, r, c, l in zip(self.ptr.tolist(), self.rows.tolist(), self.cols.tolist(),
                              self.ld.tolist()):
            yield Block(p, r, c, l, self.dtype)

    def __eq__(self, other):
        return tuple(self) == tuple(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"Blocks({list(self)!r})"

    def replace(self, **kw) -> "Blocks":
        f = {k: getattr(self, k) for k in self.__slots__}
        f.update(kw)
        return Blocks(**f)


def as_blocks(blocks) -> Blocks:
    """``blocks`` as a :class:`Blocks` (a sequence of :class:`Block` of one dtype is converted)."""
    if isinstance(blocks, Blocks):
        return blocks
    blocks = tuple(blocks)
    if not blocks:
        return Blocks(np.zeros(0, np.int64), 0, 0, 1, "float32")
    cols = np.array([(b.ptr, b.rows, b.cols, b.ld) for b in blocks], dtype=np.int64)
    return Blocks(cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3], blocks[0].dtype)


def pointer_alignment(ptr: int, cap: int = 256) -> int:
    """Largest power of two (at most ``cap``, cuBLASLt's default assumption) dividing ``ptr``."""
    ptr = int(ptr)
    return cap if ptr == 0 else min(ptr & -ptr, cap)


def pointer_alignments(ptrs, cap: int = 256) -> np.ndarray:
    """:func:`pointer_alignment` of every pointer of an int64 array."""
    p = np.asarray(ptrs, dtype=np.int64)
    return np.where(p == 0, cap, np.minimum(p & -p, cap))


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


@dataclasses.dataclass(frozen=True, eq=False)
class VecPlan:
    """:func:`plan_problem` vectorized over the non-empty experts: what the launch iterates over.

    ``keys`` is ``(calls, 17)`` int64: A layout, B layout, D layout (each ``(cudaDataType, rows,
    cols, ld)``), the A, B, C, D pointer alignments and the bias pointer's (0 without bias); a
    row is the shape signature that selects the cached layouts and algorithm. ``ptrs`` is
    ``(calls, 7)``: expert, A, B, D, A scale, B scale and bias pointers. ``mnk`` is ``(calls, 3)``.
    """

    config: Any
    keys: np.ndarray
    ptrs: np.ndarray
    mnk: np.ndarray
    beta: float
    zero: tuple[int, ...]
    skipped: tuple[int, ...]

    @property
    def experts(self) -> np.ndarray:
        return self.ptrs[:, 0]

    @functools.cached_property
    def launch_rows(self) -> list[tuple]:
        """Per call, as Python ints: ``(expert, A, B, D, A scale, B scale, bias, key)`` with
        ``key`` the shape signature tuple (what the launch loop reads; made once per plan)."""
        return [(*p, tuple(k)) for p, k in zip(self.ptrs.tolist(), self.keys.tolist())]

    def calls(self) -> tuple[ExpertGemm, ...]:
        t = self.config.transa, self.config.transb
        return tuple(ExpertGemm(e, *t, m, n, k, a, tuple(key[0:4]), b, tuple(key[4:8]), d,
                                tuple(key[8:12]), self.beta, sa, sb, bias)
                     for key, (e, a, b, d, sa, sb, bias), (m, n, k)
                     in zip(self.keys.tolist(), self.ptrs.tolist(), self.mnk.tolist()))


def plan_arrays(problem: Problem, out) -> VecPlan:
    """The per-expert cuBLASLt calls of ``problem`` writing ``out``, vectorized over experts with
    exactly :func:`plan_expert`'s mapping (a test checks that the two agree): cuBLAS's A is the
    right operand, B the left one, ``D = Yᵀ`` is ``(q, p)``. Experts with nothing to compute are
    skipped (``m_i == 0`` in fprop/dgrad: an empty output; an empty reduction in wgrad: zeroed, or
    left untouched when accumulating)."""
    L, R, O = as_blocks(problem.left), as_blocks(problem.right), as_blocks(out)
    r = np.asarray(problem.reduction, dtype=np.int64)
    p, q = O.rows, O.cols
    lt, rt = problem.left_t, problem.right_t
    lr, lc = (r, p) if lt else (p, r)
    rr, rc = (q, r) if rt else (r, q)
    empty = (p == 0) | (q == 0) | (r == 0)
    bad = ~empty & ((L.rows != lr) | (L.cols != lc) | (R.rows != rr) | (R.cols != rc))
    if bad.any():
        i = int(np.nonzero(bad)[0][0])
        name, blk, want = (("left", L, (lr, lc)) if (L.rows[i], L.cols[i]) != (lr[i], lc[i])
                           else ("right", R, (rr, rc)))
        raise ValueError(f"expert {i}: {name} operand is {int(blk.rows[i])}x{int(blk.cols[i])}, "
                         f"expected {int(want[0][i])}x{int(want[1][i])}")
    num = r.shape[0]
    ct = E.DTYPE_TO_CUDA
    K = np.empty((num, 17), np.int64)
    K[:, 0], K[:, 3] = ct[R.dtype], R.ld
    K[:, 1], K[:, 2] = (r, q) if rt else (q, r)
    K[:, 4], K[:, 7] = ct[L.dtype], L.ld
    K[:, 5], K[:, 6] = (p, r) if lt else (r, p)
    K[:, 8], K[:, 9], K[:, 10], K[:, 11] = ct[O.dtype], q, p, O.ld
    P = np.zeros((num, 7), np.int64)
    P[:, 0], P[:, 1], P[:, 2], P[:, 3] = np.arange(num), R.ptr, L.ptr, O.ptr
    if problem.right_scale is not None:
        P[:, 4] = problem.right_scale
    if problem.left_scale is not None:
        P[:, 5] = problem.left_scale
    if problem.bias is not None:
        P[:, 6] = problem.bias
    al = pointer_alignments(P[:, 1:7])
    K[:, 12], K[:, 13], K[:, 14], K[:, 15] = al[:, 0], al[:, 1], al[:, 2], al[:, 2]
    K[:, 16] = al[:, 5] if problem.bias is not None else 0
    mnk = np.stack([q, p, r], axis=1)
    skipped = np.nonzero(empty)[0]
    if skipped.shape[0]:
        keep = ~empty
        K, P, mnk = K[keep], P[keep], mnk[keep]
        zero = () if problem.accumulate else tuple(
            np.nonzero((r == 0) & (p * q > 0))[0].tolist())
    else:
        zero = ()
    transa = E.CUBLAS_OP_T if rt else E.CUBLAS_OP_N
    transb = E.CUBLAS_OP_T if lt else E.CUBLAS_OP_N
    return VecPlan(gemm_config(problem, transa, transb), K, P, mnk,
                   1.0 if problem.accumulate else 0.0, zero, tuple(skipped.tolist()))


def plan_problem(problem: Problem, out: Sequence[Block]) -> GemmPlan:
    """Per-expert calls for ``problem`` writing ``out`` (:func:`plan_arrays` as one
    :class:`ExpertGemm` per non-empty expert)."""
    vp = plan_arrays(problem, out)
    return GemmPlan(vp.config, vp.calls(), vp.zero, vp.skipped)


def workspace_bytes_for(compute_capability: int) -> int:
    """cuBLASLt workspace per stream: 32 MiB on Hopper and newer (what its FP8 kernels want, as in
    TransformerEngine), 4 MiB before."""
    return (32 << 20) if compute_capability >= 90 else (4 << 20)


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
    if copy == "rowwise":
        m = np.asarray(g.m_splits, dtype=np.int64)
        rows = int(m.sum())
        if dv.shape != (rows, k) or (rows > 1 and dv.strides != (k, 1)):
            raise ValueError(f"{arg}.data: expected a contiguous ({rows}, {k}) array, got shape "
                             f"{dv.shape} strides {dv.strides}")
        blocks = Blocks(dv.ptr + (np.cumsum(m) - m) * k, m, k, k, dtype)
    else:
        mp = np.asarray(g.m_pad_splits, dtype=np.int64)
        ends = np.cumsum(mp) * k
        total = int(ends[-1]) if E_ else 0
        if dv.size != total or (total > 1 and dv.strides[-1] != 1):
            raise ValueError(f"{arg}.data_t: expected {total} contiguous bytes, got shape {dv.shape}")
        blocks = Blocks(dv.ptr + ends - mp * k, k, mp, mp, dtype)
    scales = sv.ptr + 4 * np.arange(E_, dtype=np.int64)
    return _Operand(blocks, dtype, scales, g.fp8_format, on_device, device, kind,
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
        blocks.append((v.ptr, rows, cols, max(ld, 1)))
    b = np.array(blocks, dtype=np.int64).reshape(-1, 4)
    return _Operand(Blocks(b[:, 0], b[:, 1], b[:, 2], b[:, 3], dtype), dtype, None, None,
                    on_device, device, kind, tuple(b[:, 1].tolist()))


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


def _uniform(blocks: Blocks, attr: str, arg: str, what: str) -> int:
    vals = getattr(blocks, attr)
    lo, hi = int(vals.min()), int(vals.max())
    if lo != hi:
        raise ValueError(f"{arg}: every expert must have the same {what}, got "
                         f"{np.unique(vals).tolist()}")
    return lo


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
        right = wo.blocks.replace(cols=wn)
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
        pads = tuple(xo.blocks.cols.tolist())
        if pads != tuple(dyo.blocks.cols.tolist()):
            raise ValueError(f"x, dy: padded token counts differ ({pads} vs "
                             f"{tuple(dyo.blocks.cols.tolist())}): cast both with the same align")
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


def _row_blocks(v: ArrayView, m_splits, dtype: str) -> Blocks:
    ld = v.strides[0] if v.shape[0] > 1 else v.shape[1]
    m = np.asarray(m_splits, dtype=np.int64)
    return Blocks(v.ptr + (np.cumsum(m) - m) * ld * v.itemsize, m, v.shape[1], max(ld, 1), dtype)


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
    return out, as_blocks(blocks)


def check_alignment(problem: Problem, out) -> None:
    """FP8 operands and outputs must be 16-byte aligned; plain ones aligned to their element."""
    bad = []  # (expert, order, message) of the first failure of each operand
    for order, (name, b) in enumerate((("left operand", as_blocks(problem.left)),
                                       ("right operand", as_blocks(problem.right)),
                                       ("out", as_blocks(out)))):
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
    if bad:  # the error the per-expert scan in expert order would meet first
        raise ValueError(min(bad)[2])


# ---------------------------------------------------------------------------------------------
# The ops.

def _backend(backend: str | None, on_device: bool) -> str:
    if backend == "emulate":
        raise ValueError("backend='emulate' is not available for the grouped GEMMs: they run in "
                         "cuBLASLt, which has no CPU emulation; use backend='reference' (NumPy) "
                         "for host arrays or 'cuda' for device arrays")
    return _launch.resolve_backend(backend, on_device)


def grouped_fprop(x, w, bias=None, *, out=None, out_dtype: str = "bfloat16",
                  fast_accum: bool = True, backend: str | None = None, path: str | None = None):
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

    path : None (the grouped GEMM where cuBLASLt and the operands allow it, else the per-expert
        loop; see :func:`choose_path`), ``"loop"``, or ``"grouped"`` (raise if it cannot run).
        Launch records name the path that ran (``cublasLtMatmul`` / ``cublasLtMatmul[grouped]``).

    Experts with ``m_i == 0`` are skipped. Returns ``out``.
    """
    kw = dict(out_dtype=out_dtype, fast_accum=fast_accum)
    return _run(checked("fprop", (x, w, bias), kw), out, backend, path)


def grouped_dgrad(dy, w, *, out=None, out_dtype: str = "bfloat16", fast_accum: bool = False,
                  backend: str | None = None, path: str | None = None):
    """``dx_i = dy_i · W_i`` for every expert, into one unpadded ``(Σ m_i, k)`` array.

    ``dy``: GroupedFP8 (row-wise ``(m_i, n)``, ``n % 16 == 0``) or list of ``(m_i, n)`` arrays;
    ``w``: GroupedFP8 with the transposed copy (``(k, n)`` per expert, ``k % 16 == 0``) or list of
    ``(n, k)`` arrays / one ``(E, n, k)`` array. Other arguments as :func:`grouped_fprop`.
    """
    kw = dict(out_dtype=out_dtype, fast_accum=fast_accum)
    return _run(checked("dgrad", (dy, w), kw), out, backend, path)


def grouped_wgrad(x, dy, *, out=None, accumulate: bool = False, out_dtype: str = "float32",
                  fast_accum: bool = False, backend: str | None = None, path: str | None = None):
    """``dW_i = dy_iᵀ · x_i`` for every expert.

    ``x``, ``dy``: GroupedFP8 with transposed copies (``(k, m_pad_i)``, ``(n, m_pad_i)``, cast with
    the same ``align``, a multiple of 16; the zero padding adds nothing), or lists of ``(m_i, k)``
    and ``(m_i, n)`` arrays. ``out``: ``(E, n, k)`` array or list of E ``(n, k)`` arrays;
    ``accumulate=True`` adds into it (``beta = 1``; fp32 ``main_grad``) and requires it. An expert
    with ``m_i == 0`` gets a zero gradient, or keeps its accumulated one untouched.
    """
    kw = dict(out_dtype=out_dtype, fast_accum=fast_accum, accumulate=accumulate)
    return _run(checked("wgrad", (x, dy), kw), out, backend, path)


def _run(call: "Checked", out, backend, path=None):
    problem = call.problem
    if path not in (None, "loop", "grouped"):
        raise ValueError(f"path: got {path!r}, expected None, 'loop' or 'grouped'")
    backend = _backend(backend, problem.place[0])
    if backend == "reference":
        from ..reference import grouped_gemm as ref

        return getattr(ref, f"grouped_{problem.pass_name}")(*call.args, out=out,
                                                            backend="reference", **call.kwargs)
    import cupy

    with cupy.cuda.Device(problem.place[1]):
        return launch_checked(call, out, cupy, _state(problem.place[1]), path)


def launch_checked(call: "Checked", out, xp, st: "_DeviceState", path: str | None = None):
    """The CUDA path after the operand checks: output (checked or new), plan, launch; returns
    the output. ``xp`` allocates a new output; ``st`` holds the device calls (the CPU benchmark
    passes NumPy and fakes)."""
    out, blocks, vp = prepared_out(call, out, xp)
    _launch_plan(vp, call.problem, blocks, st, path)
    return out


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
        n = problem.left[0].rows if problem.fp8 else problem.left[0].cols
        k = problem.right[0].rows if problem.right_t else problem.right[0].cols
        return (len(problem.left), n, k)
    cols = problem.right[0].rows if problem.right_t else problem.right[0].cols
    return (int(as_blocks(problem.left).rows.sum()), cols)


def new_output(problem: Problem, xp):
    """A new output array for ``problem`` (wgrad with ``accumulate=True`` needs the caller's)."""
    if problem.pass_name == "wgrad" and problem.accumulate:
        raise ValueError("out: accumulate=True adds into existing gradients; pass them as out "
                         "(an (E, n, k) array or a list of E (n, k) float32 main_grad arrays)")
    return _empty(xp, _out_shape(problem), problem.out_dtype)


# ---------------------------------------------------------------------------------------------
# Per-call memo: a training step calls the same pass on the same buffers (same pointers, shapes,
# splits) over and over, and the argument checks, output checks and plan are pure functions of
# exactly those numbers. The memo keys on everything the checks read, so a hit is what a fresh
# check would have produced; anything it cannot key (torch tensors, device-side splits, unknown
# array types, unhashable fields) takes the full path, and a failed check is never stored, so bad
# input raises exactly as before. The keys hold numbers only (no arrays are kept alive): a freed
# buffer whose address comes back with the same layout maps to the same, still correct, plan.

MEMO_SIZE = 256          # checked operand sets kept (FIFO)
MEMO_OUTPUTS = 8         # output buffers kept per operand set (pointers of fresh outputs vary)


class _NoKey(Exception):
    """An argument the memo cannot key: take the full path."""


def _np_key(a) -> tuple:
    return (np.ndarray, a.ctypes.data, a.shape, a.strides, a.dtype)


def _cupy_key(a) -> tuple:
    d = a.data
    return (type(a), d.ptr, d.device_id, a.shape, a.strides, a.dtype)


def _no_key(a):
    raise _NoKey


_ARRAY_KEYS: dict = {np.ndarray: _np_key}


def _array_key(a) -> tuple:
    """Layout, dtype, address and device of one array: every field ``as_view`` reads."""
    t = type(a)
    f = _ARRAY_KEYS.get(t)
    if f is None:
        f = _ARRAY_KEYS[t] = (_cupy_key if t.__module__ == "cupy" and t.__name__ == "ndarray"
                              else _no_key)
    return f(a)


def _seq_key(x) -> tuple:
    if type(x) in (list, tuple):
        return (type(x),) + tuple(_array_key(a) for a in x)
    return _array_key(x)


def _operand_key(x, copy: str):
    if type(x) is GroupedFP8:
        m = x.m_splits
        if type(m) is not tuple:      # device splits (refused by the check) or a list
            raise _NoKey
        return (GroupedFP8, x.fp8_format, x.k, m, x.m_pad_splits,
                None if (a := (x.data if copy == "rowwise" else x.data_t)) is None
                else _array_key(a), _array_key(x.scale_inv))
    if isinstance(x, GroupedFP8):     # a subclass may compute its fields: not keyed
        raise _NoKey
    return _seq_key(x)


_COPIES = {"fprop": ("rowwise", "rowwise", None), "dgrad": ("rowwise", "columnwise"),
           "wgrad": ("columnwise", "columnwise")}
_CHECKS = {"fprop": check_fprop, "dgrad": check_dgrad, "wgrad": check_wgrad}


@dataclasses.dataclass(eq=False)
class Checked:
    """A checked call: its :class:`Problem`, the arguments as given (the reference backend
    re-reads them), and the output plans made so far, per output buffer."""

    problem: Problem
    args: tuple
    kwargs: dict
    outs: dict = dataclasses.field(default_factory=dict)


_memo: dict = {}


def _call_key(pass_name: str, args: tuple, kwargs: dict):
    copies = _COPIES[pass_name]
    try:
        key = (pass_name, tuple(kwargs.values())) + tuple(
            _operand_key(a, c) if c is not None else (None if a is None else _seq_key(a))
            for a, c in zip(args, copies))
        hash(key)
    except (_NoKey, TypeError):
        return None
    return key


def checked(pass_name: str, args: tuple, kwargs: dict) -> Checked:
    """``check_{pass_name}(*args, **kwargs)``, memoised on the arguments' layouts and addresses."""
    key = _call_key(pass_name, args, kwargs)
    hit = _memo.get(key) if key is not None else None
    if hit is not None:
        return Checked(hit.problem, args, kwargs, hit.outs)
    c = Checked(_CHECKS[pass_name](*args, **kwargs), args, kwargs)
    if key is not None:
        if len(_memo) >= MEMO_SIZE:
            del _memo[next(iter(_memo))]
        _memo[key] = c
    return c


def _out_key(out):
    try:
        if type(out) in (list, tuple):
            return (type(out),) + tuple(_array_key(a) for a in out)
        return _array_key(out)
    except _NoKey:
        return None


def prepared_out(call: Checked, out, xp) -> tuple[Any, Blocks, VecPlan]:
    """The output (``out``, or a new one), its checked blocks and the launch plan, memoised per
    output buffer (layout, address and device, as for the operands)."""
    problem = call.problem
    if out is None:
        out = new_output(problem, xp)
    key = _out_key(out)
    hit = call.outs.get(key) if key is not None else None
    if hit is not None:
        return out, hit[0], hit[1]
    out, blocks = outputs(problem, out, xp)
    check_alignment(problem, blocks)
    vp = plan_arrays(problem, blocks)
    if key is not None:
        if len(call.outs) >= MEMO_OUTPUTS:
            del call.outs[next(iter(call.outs))]
        call.outs[key] = (blocks, vp)
    return out, blocks, vp


def clear_memo() -> None:
    """Forget every memoised check and plan (tests; nothing else needs it)."""
    _memo.clear()


# ---------------------------------------------------------------------------------------------
# The launch (CUDA only).
#
# Host cost per expert is what limits small-expert MoE layers, so the loop does as little as it
# can: the plan is vectorized (NumPy, above); each distinct per-expert shape (its layouts, pointer
# alignments and bias alignment) maps to a cached template holding its three layouts and its
# heuristic result; every expert slot owns a matmul descriptor whose scale/bias pointers are set
# only when they change; events, workspaces and the ctypes scalars are made once per device. What
# is left per expert is a list lookup, a dict lookup and the ``cublasLtMatmul`` call.
# ``_DeviceState`` takes the device calls as arguments, so the CPU benchmark
# (:func:`cugrouped.bench.gemm.bench_host_loop`) runs this very loop with fakes for them.

HEURISTIC_CACHE_SIZE = 1 << 14


class _DeviceState:
    """Per device: the cuBLASLt handle, side streams with a workspace each, reusable events, the
    shape templates, and the device calls (``heuristic``, ``matmul``, ``memset``, stream/event
    functions), injectable so that the host loop can be timed without a GPU."""

    def __init__(self, device: int, compute_capability: int, handle, streams, workspace_ptrs,
                 current_stream, make_event, heuristic, matmul, memset):
        self.device = device
        self.compute_capability = int(compute_capability)
        self.workspace_bytes = workspace_bytes_for(self.compute_capability)
        self.handle = handle                      # ctypes.c_void_p (or an object ctypes accepts)
        self.streams = list(streams)              # objects with .ptr and .wait_event(event)
        self.stream_ptrs = [s.ptr for s in self.streams]
        self.ws_ptrs = list(workspace_ptrs)       # one workspace per side stream
        self.current_stream = current_stream
        self.fork_event = make_event()
        self.done_events = [make_event() for _ in self.streams]
        self.make_event = make_event
        self.caller_ws: dict[int, int] = {}
        self.heuristic = heuristic
        self.matmul = matmul
        self.memset = memset
        self.templates: dict[Any, dict] = {}
        self.alpha = ctypes.c_float(1.0)
        self.betas = {0.0: ctypes.c_float(0.0), 1.0: ctypes.c_float(1.0)}
        self.grouped = None                       # grouped-GEMM state, made on first use
        self.cublas_version = 0                   # 0: the grouped GEMM is never chosen
        self.has_grouped_symbol = False

    @classmethod
    def for_device(cls, device: int) -> "_DeviceState":
        import cupy

        from ..cublaslt import Handle, lib

        cc = int(cupy.cuda.Device(device).compute_capability)
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(NUM_STREAMS)]
        nbytes = workspace_bytes_for(cc)
        keep = [cupy.empty(nbytes, dtype=np.uint8) for _ in streams]
        handle = Handle()
        st = cls(device, cc, handle.handle, streams, [w.data.ptr for w in keep],
                 cupy.cuda.get_current_stream, lambda: cupy.cuda.Event(disable_timing=True),
                 _real_heuristic(handle), lib().cublasLtMatmul,
                 lambda ptr, nb, stream: cupy.cuda.runtime.memsetAsync(ptr, 0, nb, stream))
        st._keep = (handle, keep)  # owners of the handle and workspaces
        from ..cublaslt import has_grouped_gemm, version

        st.cublas_version, st.has_grouped_symbol = version(), has_grouped_gemm()
        return st

    def caller_workspace(self, stream_ptr: int) -> int:
        """A workspace for a call made on the caller's own stream (a single expert)."""
        ws = self.caller_ws.get(stream_ptr)
        if ws is None:
            import cupy

            buf = cupy.empty(self.workspace_bytes, dtype=np.uint8)
            self._keep = self._keep + (buf,)
            ws = self.caller_ws[stream_ptr] = buf.data.ptr
        return ws


def _real_heuristic(handle):
    from ..cublaslt import CublasLtError, HeuristicResult, lib

    get = lib().cublasLtMatmulAlgoGetHeuristic

    def heuristic(desc, la, lb, ld, pref, what: str):
        res, count = HeuristicResult(), ctypes.c_int(0)
        status = get(handle.handle, desc.handle, la.handle, lb.handle, ld.handle, ld.handle,
                     pref.handle, 1, ctypes.byref(res), ctypes.byref(count))
        if status != 0 or count.value == 0:
            raise CublasLtError("cublasLtMatmulAlgoGetHeuristic",
                                status or E.CUBLAS_STATUS_NOT_SUPPORTED, f"no algorithm for {what}")
        return res

    return heuristic


_states: dict[int, _DeviceState] = {}


def _state(device: int) -> _DeviceState:
    st = _states.get(device)
    if st is None:
        st = _states[device] = _DeviceState.for_device(device)
    return st


class _Template:
    """What every expert with one shape signature shares: three layouts and the algorithm."""

    __slots__ = ("layouts", "pref", "result", "la", "lb", "ld", "algo")

    def __init__(self, layouts, pref, result):
        self.layouts, self.pref, self.result = layouts, pref, result  # owners
        self.la, self.lb, self.ld = (lay.handle for lay in layouts)
        self.algo = ctypes.byref(result.algo)


def _template(st: _DeviceState, config, key: tuple, desc) -> _Template:
    """Build the template of one shape signature ``key`` = A layout (4), B layout (4), D layout
    (4), alignments (4), bias alignment: the same descriptors :func:`build_descriptors` makes."""
    layouts = tuple(_D.MatrixLayout(*key[i:i + 4]) for i in (0, 4, 8))
    pref = _D.preference(st.workspace_bytes, *key[12:16])
    what = f"{config} with A{key[0:4]} B{key[4:8]} D{key[8:12]} alignments {key[12:16]}"
    return _Template(layouts, pref, st.heuristic(desc, *layouts, pref, what))


def build_descriptors(config, call: ExpertGemm, workspace_bytes: int):
    """Descriptors for one call with its pointers set, as the launch makes them: the expert slot's
    matmul descriptor (:func:`~cugrouped.cublaslt.descriptors.expert_desc`), the layouts and the
    preference. Returns ``(desc, a_layout, b_layout, d_layout, preference)``. Needs no GPU."""
    desc = _D.expert_desc(config, call.expert)
    desc.set_pointers(call.a_scale_ptr, call.b_scale_ptr, call.bias_ptr)
    la = _D.matrix_layout(*call.a_layout)
    lb = _D.matrix_layout(*call.b_layout)
    ld = _D.matrix_layout(*call.d_layout)
    pref = _D.preference(workspace_bytes, *call.alignments)
    return desc, la, lb, ld, pref


def _zero_outputs(st: _DeviceState, vp: VecPlan, out, caller_ptr: int) -> None:
    if not vp.zero:
        return
    o = as_blocks(out)
    for i in vp.zero:  # empty reduction, not accumulating: dW_i = 0
        rows, cols, ld, ptr, isz = int(o.rows[i]), int(o.cols[i]), int(o.ld[i]), int(o.ptr[i]), o.itemsize
        if ld == cols:
            st.memset(ptr, ((rows - 1) * ld + cols) * isz, caller_ptr)
        else:
            for r in range(rows):
                st.memset(ptr + r * ld * isz, cols * isz, caller_ptr)


def _launch_loop(st: _DeviceState, vp: VecPlan, fp8: bool) -> None:
    """The per-expert ``cublasLtMatmul`` loop over the side streams (forked from and joined back to
    the caller's stream)."""
    ncalls = vp.experts.shape[0]
    if ncalls == 0:
        return
    if fp8 and st.compute_capability < 89:
        raise RuntimeError(f"FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper); device "
                           f"{st.device} is sm_{st.compute_capability}")
    caller = st.current_stream()
    config = vp.config
    if ncalls > 1:
        streams, ws = st.stream_ptrs, st.ws_ptrs
        st.fork_event.record(caller)
        for s in st.streams:
            s.wait_event(st.fork_event)
    else:
        streams, ws = [caller.ptr], [st.caller_workspace(caller.ptr)]
    nstreams = len(streams)
    templates = st.templates.get(config)
    if templates is None or len(templates) > HEURISTIC_CACHE_SIZE:
        templates = st.templates[config] = {}
    rows = vp.launch_rows
    descs = _D.expert_descs(config, rows[-1][0] + 1)
    recorders = _launch._recorders.get()
    matmul, handle, alpha = st.matmul, st.handle, ctypes.byref(st.alpha)
    beta = ctypes.byref(st.betas[vp.beta])
    wsb = st.workspace_bytes
    for j, (e, a, b, d, sa, sb, bias, key) in enumerate(rows):
        desc = descs[e]
        ptrs = desc.ptrs
        if ptrs[0] != sa or ptrs[1] != sb or ptrs[2] != bias:
            desc.set_pointers(sa, sb, bias)
        t = templates.get(key)
        if t is None:
            t = templates[key] = _template(st, config, key, desc)
        for log in recorders:
            log.append(_launch.Launch("cuda", "cublasLtMatmul", 1, 1))
        s = j % nstreams
        status = matmul(handle, desc.handle, alpha, a, t.la, b, t.lb, beta, d, t.ld, d, t.ld,
                        t.algo, ws[s], wsb, streams[s])
        if status:
            from ..cublaslt import check

            check(status, "cublasLtMatmul", f"expert {e}")
    if ncalls > 1:
        for idx in range(min(nstreams, ncalls)):
            ev = st.done_events[idx]
            ev.record(st.streams[idx])
            caller.wait_event(ev)


def _launch_plan(vp: VecPlan, problem: Problem, out, st: _DeviceState, path: str | None = None) -> None:
    if vp.zero:
        _zero_outputs(st, vp, out, st.current_stream().ptr)
    chosen, _, spec = path_for(problem, vp, out, st, path)
    if chosen == "grouped":
        _launch_grouped(st, vp, problem, spec)
    else:
        _launch_loop(st, vp, problem.fp8)


# ---------------------------------------------------------------------------------------------
# cuBLASLt's grouped GEMM (one call for all experts): capability rules and descriptors.
#
# What is built: the decision (pure, tested), the device-workspace layout the per-group arrays
# live in, and the descriptors over it (tested on the CPU against the real library). Not built
# yet: the setup kernel that fills those arrays on the device and the launch through them; until
# then the ops always run the per-expert loop, and ``choose_path`` is what the launch will call.

# cuBLAS versions (cublasLtGetVersion: major*10000 + minor*100 + patch), from TransformerEngine's
# cublaslt_grouped_gemm.cu and design.md §5.
GROUPED_MIN_VERSION_BLACKWELL = 130300     # sm_100..sm_110, BF16/FP16 and FP8
GROUPED_MIN_VERSION_HOPPER = 130400        # sm_90, BF16/FP16
GROUPED_MIN_VERSION_HOPPER_FP8 = 130500    # sm_90, FP8 per-tensor scaling (PER_BATCH_SCALAR_32F)
GROUPED_BAD_VERSIONS = (130700, 130801)    # [lo, hi): TE reports data corruption with per-group outputs
GROUPED_MAX_GROUPS = 256                   # what one setup launch's argument block will hold
_GROUPED_INPUTS = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


def grouped_gemm_unsupported(version: int, compute_capability: int, *, fp8: bool, in_dtype: str,
                             has_symbol: bool = True) -> str | None:
    """Why cuBLASLt's grouped GEMM cannot run this configuration, or None if it can."""
    if not has_symbol:
        return f"libcublasLt {version} has no cublasLtGroupedMatrixLayoutCreate (needs 13.1+)"
    if in_dtype not in _GROUPED_INPUTS:
        return f"grouped GEMM inputs must be FP8, bfloat16 or float16, got {in_dtype}"
    cc = int(compute_capability)
    if cc < 90 or cc > 110:
        return f"grouped GEMM runs on sm_90 (Hopper) and sm_100..sm_110 (Blackwell), not sm_{cc}"
    need = (GROUPED_MIN_VERSION_BLACKWELL if cc >= 100
            else GROUPED_MIN_VERSION_HOPPER_FP8 if fp8 else GROUPED_MIN_VERSION_HOPPER)
    if version < need:
        return (f"grouped {'FP8' if fp8 else in_dtype} GEMM on sm_{cc} needs cuBLAS "
                f"{need // 10000}.{need // 100 % 100}+, this is {version // 10000}.{version // 100 % 100}")
    return None


def choose_path(problem: Problem, vp: VecPlan, *, version: int, compute_capability: int,
                has_symbol: bool, discrete_out: bool, requested: str | None = None) -> tuple[str, str]:
    """``("grouped" | "loop", reason)`` for a planned problem.

    The loop is kept when the library or GPU lacks the grouped GEMM, for a bias epilogue (not
    offered by the grouped path), more than :data:`GROUPED_MAX_GROUPS` experts, the cuBLAS
    versions with the per-group-output corruption (``discrete_out``: wgrad into a list of
    ``main_grad`` buffers), and when a group's m, n or k is not a multiple of 16 bytes of its
    input type (NVIDIA's grouped samples state that requirement; to be relaxed once a GPU test
    shows more works), or fewer than two experts compute anything.
    ``requested="loop"`` forces the loop; ``"grouped"`` raises if the grouped GEMM cannot run.
    """
    if requested not in (None, "loop", "grouped"):
        raise ValueError(f"path: got {requested!r}, expected None, 'loop' or 'grouped'")
    if requested == "loop":
        return "loop", "requested"
    in_dtype = as_blocks(problem.left).dtype
    reason = grouped_gemm_unsupported(version, compute_capability, fp8=problem.fp8,
                                      in_dtype=in_dtype, has_symbol=has_symbol)
    if reason is None and problem.bias is not None:
        reason = "the grouped GEMM has no bias epilogue"
    if reason is None and len(problem.reduction) > GROUPED_MAX_GROUPS:
        reason = f"more than {GROUPED_MAX_GROUPS} experts"
    if reason is None and discrete_out and GROUPED_BAD_VERSIONS[0] <= version < GROUPED_BAD_VERSIONS[1]:
        reason = f"cuBLAS {version} corrupts per-group outputs (fixed in 13.8.1)"
    if reason is None:
        unit = 16 // _ITEMSIZE[in_dtype]
        if np.any(vp.mnk % unit):
            reason = f"a group's m, n or k is not a multiple of {unit} elements (16 bytes)"
    if reason is None and vp.mnk.shape[0] < 2:
        reason = "fewer than two experts to compute"
    if reason is None:
        return "grouped", "supported"
    if requested == "grouped":
        raise RuntimeError(f"path='grouped' cannot run: {reason}")
    return "loop", reason


# Device workspace of one grouped call: 6 pointer arrays (A, B, C, D, A scale, B scale; each
# 16-byte aligned, as cuBLAS requires for pointer arrays), 9 int32 arrays (rows, cols, ld of A,
# B and D; C shares D's) and the two float scalars alpha, beta (device pointer mode).
GROUPED_PTR_ARRAYS = ("a", "b", "c", "d", "a_scale", "b_scale")
GROUPED_INT_ARRAYS = ("a_rows", "a_cols", "a_ld", "b_rows", "b_cols", "b_ld", "d_rows", "d_cols",
                      "d_ld")


def grouped_workspace_layout(groups: int) -> tuple[dict[str, int], int]:
    """Byte offsets of every array of a grouped call's device workspace, and its total size."""
    off, pos = {}, 0
    for name in GROUPED_PTR_ARRAYS:
        pos = -(-pos // 16) * 16
        off[name], pos = pos, pos + 8 * groups
    for name in GROUPED_INT_ARRAYS:
        off[name], pos = pos, pos + 4 * groups
    pos = -(-pos // 16) * 16
    off["alpha"], off["beta"] = pos, pos + 4
    return off, pos + 16


def grouped_descriptors(config, groups: int, base: int, vp: VecPlan, workspace_bytes: int):
    """The descriptors of one grouped call whose workspace starts at device address ``base``:
    ``(desc, a_layout, b_layout, c_layout, d_layout, preference)``. ``config`` must be the plan's
    config with ``grouped=True``; the scale pointers point at the workspace's pointer arrays; the
    preference carries the average D rows, D columns and reduction (the heuristic's only view of
    the device-side shapes). Needs no GPU."""
    off, _ = grouped_workspace_layout(groups)
    desc = _D.MatmulDesc()
    for name, value in config.attributes().items():
        desc.set(name, value)
    if config.scaled:
        desc.set("A_SCALE_POINTER", base + off["a_scale"])
        desc.set("B_SCALE_POINTER", base + off["b_scale"])
    k0 = vp.keys[0]
    lay = {x: _D.GroupedMatrixLayout(int(k0[t]), groups, base + off[f"{x}_rows"],
                                     base + off[f"{x}_cols"], base + off[f"{x}_ld"])
           for x, t in (("a", 0), ("b", 4), ("d", 8))}
    c = _D.GroupedMatrixLayout(int(k0[8]), groups, base + off["d_rows"], base + off["d_cols"],
                               base + off["d_ld"])
    pref = _D.MatmulPreference()
    pref.set("MAX_WORKSPACE_BYTES", workspace_bytes)
    avg = np.maximum(vp.mnk.sum(axis=0) // max(groups, 1), 1)
    pref.set("GROUPED_DESC_D_AVERAGE_ROWS", int(avg[0]))
    pref.set("GROUPED_DESC_D_AVERAGE_COLS", int(avg[1]))
    pref.set("GROUPED_AVERAGE_REDUCTION_DIM", int(avg[2]))
    return desc, lay["a"], lay["b"], c, lay["d"], pref


# ---------------------------------------------------------------------------------------------
# The grouped launch: the setup kernel fills the workspace arrays, one cublasLtMatmul reads them.

def _affine(ptrs: np.ndarray, prefix: np.ndarray) -> tuple[int, int] | None:
    """``(group_stride, token_stride)`` with ``ptrs[e] == ptrs[0] + gs * e + ts * prefix[e]`` for
    every expert (one of the two is 0), or None."""
    E_ = ptrs.shape[0]
    e = np.arange(E_, dtype=np.int64)
    if E_ == 1:
        return 0, 0
    gs = int(ptrs[1] - ptrs[0])
    if np.array_equal(ptrs, ptrs[0] + gs * e):
        return gs, 0
    nz = np.nonzero(prefix)[0]
    if nz.size:
        i = int(nz[0])
        ts = int(ptrs[i] - ptrs[0]) // int(prefix[i])
        if np.array_equal(ptrs, ptrs[0] + ts * prefix):
            return 0, ts
    return None


def _dim(values: np.ndarray, tokens: np.ndarray) -> int | None:
    if np.all(values == values[0]):
        return int(values[0])
    if np.array_equal(values, tokens):
        return _setup.TOKENS
    return None


def grouped_setup_spec(problem: Problem, vp: VecPlan, out) -> "_setup.SetupSpec | None":
    """The setup kernel's description of ``problem`` writing ``out`` (host counts: the tokens are
    the per-expert token dimension of the plan -- rows of fprop/dgrad, the padded reduction of
    wgrad), or None when an operand's experts are not evenly placed (lists of separate weight or
    ``main_grad`` arrays) or a shape is neither constant nor the token count. Experts with nothing
    to compute are dropped (their outputs are zeroed by the caller, as for the loop)."""
    L, R, O = as_blocks(problem.left), as_blocks(problem.right), as_blocks(out)
    E_ = len(L)
    if not 1 <= E_ <= _setup.MAX_GROUPS:
        return None
    r = np.asarray(problem.reduction, dtype=np.int64)
    tokens = r if problem.pass_name == "wgrad" else O.rows
    prefix = np.concatenate([[0], np.cumsum(tokens)[:-1]]).astype(np.int64)
    rt, lt = problem.right_t, problem.left_t
    p, q = O.rows, O.cols
    dims = {"a": ((r, q) if rt else (q, r), R), "b": ((p, r) if lt else (r, p), L),
            "d": ((q, p), O)}
    mats = {}
    for name, ((rows, cols), blk) in dims.items():
        aff = _affine(blk.ptr, prefix)
        d = [_dim(np.asarray(v, dtype=np.int64), tokens) for v in (rows, cols, blk.ld)]
        if aff is None or None in d:
            return None
        gs, ts = aff
        mats[name] = _setup.MatrixSpec(int(blk.ptr[0]), gs, ts, *d)  # strides in bytes
    keep = np.ones(E_, bool)
    keep[list(vp.skipped)] = False
    slots = tuple(int(v) for v in np.where(keep, np.cumsum(keep) - 1, -1))
    scales = (int(problem.right_scale[0]) if problem.right_scale is not None else 0,
              int(problem.left_scale[0]) if problem.left_scale is not None else 0)
    for sc in (problem.right_scale, problem.left_scale):
        if sc is not None and not np.array_equal(np.asarray(sc), sc[0] + 4 * np.arange(E_)):
            return None
    return _setup.SetupSpec(mats["a"], mats["b"], mats["d"], E_, 1, scales, 1.0, vp.beta, slots)


def path_for(problem: Problem, vp: VecPlan, out, st: "_DeviceState", requested: str | None = None):
    """``(path, reason, setup spec or None)``, decided once per plan, device and request."""
    key = ("_path", st.device, st.compute_capability, st.cublas_version, requested)
    hit = vp.__dict__.get(key)
    if hit is not None:
        return hit
    discrete = problem.pass_name == "wgrad" and _affine(as_blocks(out).ptr, np.zeros(len(out), np.int64)) is None
    path, reason = choose_path(problem, vp, version=st.cublas_version,
                               compute_capability=st.compute_capability,
                               has_symbol=st.has_grouped_symbol, discrete_out=discrete,
                               requested=requested)
    spec = None
    if path == "grouped":
        spec = grouped_setup_spec(problem, vp, out)
        if spec is None:
            reason = "operands or outputs are not evenly placed per expert"
            if requested == "grouped":
                raise RuntimeError(f"path='grouped' cannot run: {reason}")
            path = "loop"
    hit = vp.__dict__[key] = (path, reason, spec)
    return hit


class _GroupedState:
    """Per device: one setup workspace per caller stream (sized for the most groups) and the
    grouped descriptors + algorithm per (config, groups, workspace, average dims)."""

    def __init__(self, alloc=None, setup_backend: str = "cuda"):
        self.workspaces: dict[int, Any] = {}
        self.calls: dict[tuple, tuple] = {}
        self.alloc = alloc            # nbytes -> 16-byte aligned uint8 array (default: CuPy)
        self.setup_backend = setup_backend  # "emulate" / "reference" run the CPU tests

    def workspace(self, stream_ptr: int):
        ws = self.workspaces.get(stream_ptr)
        if ws is None:
            _, nbytes = grouped_workspace_layout(_setup.MAX_GROUPS)
            if self.alloc is None:
                import cupy

                ws = cupy.empty(nbytes, dtype=np.uint8)
            else:
                ws = self.alloc(nbytes)
            self.workspaces[stream_ptr] = ws
        return ws


def _launch_grouped(st: "_DeviceState", vp: VecPlan, problem: Problem, spec) -> None:
    """Setup kernel (workspace arrays from the counts) and one grouped ``cublasLtMatmul``, both on
    the caller's stream, device pointer mode (alpha, beta and the per-group scales read from the
    workspace)."""
    if st.grouped is None:
        st.grouped = _GroupedState()
    g = st.grouped
    caller = st.current_stream()
    ws = g.workspace(caller.ptr)
    base = _setup._ptr(ws)
    groups = spec.groups
    tokens = [int(v) for v in (problem.reduction if problem.pass_name == "wgrad"
                               else as_blocks(problem.left).rows)]
    _setup.grouped_gemm_setup(spec, ws[:grouped_workspace_layout(groups)[1]], m_host=tokens,
                              backend=g.setup_backend)
    config = dataclasses.replace(vp.config, grouped=True)
    avg = tuple((vp.mnk.sum(axis=0) // max(groups, 1)).tolist())
    key = (config, groups, base, avg)
    hit = g.calls.get(key)
    if hit is None:
        descs = grouped_descriptors(config, groups, base, vp, st.workspace_bytes)
        desc, la, lb, lc, ld, pref = descs
        res = st.heuristic(desc, la, lb, ld, pref, f"grouped {config} x{groups} avg {avg}")
        hit = g.calls[key] = (descs, res)
    (desc, la, lb, lc, ld, _), res = hit
    off, _ = grouped_workspace_layout(groups)
    for log in _launch._recorders.get():
        log.append(_launch.Launch("cuda", "cublasLtMatmul[grouped]", 1, 1))
    status = st.matmul(st.handle, desc.handle, base + off["alpha"], base + off["a"], la.handle,
                       base + off["b"], lb.handle, base + off["beta"], base + off["c"], lc.handle,
                       base + off["d"], ld.handle, ctypes.byref(res.algo),
                       st.caller_workspace(caller.ptr), st.workspace_bytes, caller.ptr)
    if status:
        from ..cublaslt import check

        check(status, "cublasLtMatmul", f"grouped call of {groups} groups")
