"""Planning for the grouped GEMMs: per-expert :class:`Block` descriptions, the checked
:class:`Problem`, and the cuBLASLt calls that compute it, as pure functions of pointers and sizes
(no GPU, no library load; tested on the CPU). Package-private: the public names are re-exported by
:mod:`cugrouped.ops.grouped_gemm`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..cublaslt import _enums as E

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}

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


def _int64_column(v, n: int) -> np.ndarray:
    """One field of :class:`Blocks`: an int64 array as it is, a scalar for every expert (``empty``
    and ``fill``: half the time of ``np.full``), or anything else converted."""
    if type(v) is np.ndarray and v.dtype == np.int64:
        return v
    if isinstance(v, (int, np.integer)):
        a = np.empty(n, np.int64)
        a.fill(v)
        return a
    return np.asarray(v, dtype=np.int64).reshape(-1)


class Blocks(Sequence):
    """The per-expert blocks of one operand (or output) as int64 arrays: what the hot path plans
    with, vectorized over experts. Indexing gives a :class:`Block`; a tuple of blocks converts with
    :func:`as_blocks`."""

    __slots__ = ("ptr", "rows", "cols", "ld", "dtype", "affine", "consts")
    _FIELDS = ("ptr", "rows", "cols", "ld", "dtype")

    def __init__(self, ptr, rows, cols, ld, dtype: str, affine: tuple[int, int] | None = None):
        self.ptr = np.asarray(ptr, dtype=np.int64).reshape(-1)
        n = self.ptr.shape[0]
        self.rows, self.cols, self.ld = (_int64_column(v, n) for v in (rows, cols, ld))
        self.dtype = dtype
        # What the grouped path would otherwise find out with array operations, known to the
        # maker: ``affine`` = (group stride, token stride) in bytes with ``ptr[e] == ptr[0] +
        # gs * e + ts * P_e`` (P_e the exclusive prefix of the grouped call's tokens, see
        # ``_gemm_grouped.grouped_tokens``), or None; ``consts``: each of rows, cols, ld given
        # as one int for every expert, else None. Hints only: not compared, dropped by replace.
        self.affine = affine
        self.consts = tuple(int(v) if isinstance(v, (int, np.integer)) else None
                            for v in (rows, cols, ld))

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
        f = {k: getattr(self, k) for k in self._FIELDS}
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


def scale_pointers(ptr: int, stride: int, num: int) -> np.ndarray:
    """Each expert's per-tensor scale address in a float32 ``(num,)`` array at ``ptr`` with an
    element stride of ``stride``."""
    return np.arange(ptr, ptr + 4 * stride * num, 4 * stride, dtype=np.int64)


def pointer_alignment(ptr: int, cap: int = 256) -> int:
    """Largest power of two (at most ``cap``, cuBLASLt's default assumption) dividing ``ptr``."""
    ptr = int(ptr)
    return cap if ptr == 0 else min(ptr & -ptr, cap)


def pointer_alignments(ptrs, cap: int = 256) -> np.ndarray:
    """:func:`pointer_alignment` of every pointer of an int64 array (``cap`` a power of two)."""
    p = np.array(ptrs, dtype=np.int64)          # a copy: the in-place rule writes over it
    _pointer_alignments_in_place(p, cap)
    return p


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
    device addresses of each expert's ``scale_inv`` (FP8; with block scaling the first of the
    expert's block scales), ``bias`` of each bias vector; ``place`` is (on_device, device ordinal,
    array kind) of the operands; the scale modes are cuBLASLt's for each operand.
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
    left_scale_mode: int = E.CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F
    right_scale_mode: int = E.CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F

    @property
    def block_scaled(self) -> bool:
        """FP8 operands with a scale per 1 x 128 / 128 x 128 block (GroupedBlockFP8) or per 32
        elements (GroupedMXFP8)."""
        return bool(self.left_scale_mode or self.right_scale_mode)


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
    ct = E.DTYPE_TO_CUDA
    return _gemm_config(
        a_type=ct[_first_dtype(problem.right)], b_type=ct[_first_dtype(problem.left)],
        d_type=ct[problem.out_dtype], transa=transa, transb=transb,
        bias_type=ct[problem.bias_dtype] if problem.bias is not None else None,
        fast_accum=bool(problem.fast_accum) and problem.fp8, scaled=problem.fp8,
        a_scale_mode=problem.right_scale_mode, b_scale_mode=problem.left_scale_mode)


def _first_dtype(blocks) -> str:
    """The dtype of the first expert's block (``Blocks`` hold it once: no Block is made)."""
    return blocks.dtype if type(blocks) is Blocks and len(blocks) else blocks[0].dtype


def first(blocks, field: str) -> int:
    """``blocks[0].<field>`` (``rows``, ``cols``, ``ld`` or ``ptr``) without making the Block:
    :class:`Blocks` hold each field as an array (an empty one raises IndexError all the same)."""
    if type(blocks) is Blocks:
        return int(getattr(blocks, field)[0])
    return getattr(blocks[0], field)


# One GemmConfig per combination of types and options, made once (a frozen dataclass: equal
# either way, and a few us less per call); typed, so that 1 and True stay apart as they would.
@functools.lru_cache(maxsize=None, typed=True)
def _gemm_config(**fields):
    from ..cublaslt.descriptors import GemmConfig

    return GemmConfig(**fields)


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
    # per scale column (4: A, 5: B), every expert's scale pointers as ``(first, step, experts)``
    # when they step evenly through one array (a GroupedFP8's (E,) scale_inv, empty experts
    # included), else None: what :meth:`_scale_plan` copies in one piece
    scale_spans: tuple = (None, None)

    @property
    def experts(self) -> np.ndarray:
        return self.ptrs[:, 0]

    @functools.cached_property
    def misaligned_scales(self) -> bool:
        """Per-tensor FP8 calls with an A or B scale pointer that cuBLASLt refuses (see
        :data:`SCALE_POINTER_ALIGN`): the launch copies those scales first (:meth:`realigned`)."""
        if self.config.a_scale_mode or self.config.b_scale_mode:
            return False             # block scales: each expert's checked 16-byte aligned
        return bool((self.ptrs[:, 4:6] % SCALE_POINTER_ALIGN).any())

    @functools.cached_property
    def _realigned(self) -> dict:
        return {}

    @functools.cached_property
    def _scale_plan(self) -> tuple[tuple, int]:
        """Per scale column with a misaligned pointer (4: A, 5: B): the column, its copies and its
        new pointers as offsets into the scratch (A's slots first); and the slots' total bytes.

        A column whose experts' scales step evenly through one array (:attr:`scale_spans`) is
        copied whole, every expert's scale to slot ``expert`` (one strided copy, no analysis):
        each expert's new pointer is then the same at every step whatever the token counts, so
        the launch re-sets no descriptor (~1.5 us each) once the slots are in place."""
        plan, base = [], 0
        for col, span in zip((4, 5), self.scale_spans):
            if not (self.ptrs[:, col] % SCALE_POINTER_ALIGN).any():
                continue
            if span is not None:
                first, step, count = span
                copies = (ScaleCopy(base, first, step, count),)
                new = base + SCALE_POINTER_ALIGN * self.ptrs[:, 0]
            else:
                copies, new = scale_copies(self.ptrs[:, col], base)
            plan.append((col, copies, new))
            base += SCALE_POINTER_ALIGN * sum(c.height for c in copies)
        return tuple(plan), base

    @property
    def scale_scratch_bytes(self) -> int:
        """The scratch :meth:`realigned` needs: a 16-byte slot per scale it copies."""
        return self._scale_plan[1]

    def realigned(self, dst: int) -> tuple[tuple["ScaleCopy", ...], list[tuple]]:
        """The copies that move the misaligned scale operands (A's, then B's) into a scratch
        buffer at ``dst`` (:attr:`scale_scratch_bytes`, 16-byte aligned), and the
        :attr:`launch_rows` that read them there. Kept for the last ``dst`` (one scratch per
        stream: a hit in training's steady state)."""
        hit = self._realigned.get(dst)
        if hit is None:
            ptrs, copies = self.ptrs.copy(), ()
            for col, rel, new in self._scale_plan[0]:
                ptrs[:, col] = new + dst
                copies += tuple(ScaleCopy(c.dst + dst, c.src, c.spitch, c.height) for c in rel)
            self._realigned.clear()
            hit = self._realigned[dst] = (copies, _launch_rows(self.keys, ptrs))
        return hit

    @functools.cached_property
    def launch_rows(self) -> list[tuple]:
        """Per call: ``(expert, A, B, D, A scale, B scale, bias, key)``, the first seven as Python
        ints, ``key`` the shape signature (the call's row of ``keys``) as its bytes (what the
        launch loop reads; made once per plan). Bytes, not a tuple of 17 ints: half the time to
        make, and a bytes object keeps its hash where a tuple is hashed again on every lookup of
        its template (:func:`shape_signature` gives the tuple back)."""
        return _launch_rows(self.keys, self.ptrs)

    def calls(self) -> tuple[ExpertGemm, ...]:
        t = self.config.transa, self.config.transb
        return tuple(ExpertGemm(e, *t, m, n, k, a, tuple(key[0:4]), b, tuple(key[4:8]), d,
                                tuple(key[8:12]), self.beta, sa, sb, bias)
                     for key, (e, a, b, d, sa, sb, bias), (m, n, k)
                     in zip(self.keys.tolist(), self.ptrs.tolist(), self.mnk.tolist()))


def _launch_rows(keys: np.ndarray, ptrs: np.ndarray) -> list[tuple]:
    kb, n = keys.tobytes(), 8 * keys.shape[1]
    return [(*p, kb[i * n:i * n + n]) for i, p in enumerate(ptrs.tolist())]


# cuBLASLt refuses a per-tensor FP8 call whose A or B scale pointer is not 16-byte aligned:
# cublasLtMatmul returns CUBLAS_STATUS_NOT_SUPPORTED (the heuristic never sees the pointers, so it
# gives an algorithm first). Seen with cuBLASLt 13.1 on an H200 (2026-12-04) for every expert but
# the first of an ``(E,)`` float32 ``scale_inv`` array, and for ``torch._scaled_mm`` given such an
# element as its scale. The launch copies such scales to 16-byte slots first.
SCALE_POINTER_ALIGN = 16
# The widest span of scale pointers one strided copy covers (an (E,) float32 array of 16384).
SCALE_SPAN_MAX = 1 << 16


@dataclasses.dataclass(frozen=True)
class ScaleCopy:
    """One ``cudaMemcpy2DAsync`` of ``height`` float32 scales: from ``src + i * spitch`` to
    ``dst + i * SCALE_POINTER_ALIGN``."""

    dst: int
    src: int
    spitch: int
    height: int


def scale_copies(src: np.ndarray, dst: int) -> tuple[tuple[ScaleCopy, ...], np.ndarray]:
    """The copies that put the float at each of the pointers ``src`` (int64, one per call) into
    16-byte slots from ``dst``, and the calls' new pointers. Pointers into one array (the common
    case: an ``(E,)`` ``scale_inv``, empty experts skipped or not) take one strided copy of the
    span they cover, at their greatest common step; pointers all the same, one copy of one float;
    anything else, one copy per call: a span of more than :data:`SCALE_SPAN_MAX` bytes (a strided
    copy would read the bytes between the pointers, which may lie in no allocation, and a pitch
    over 2^31 - 1 is refused) or over twice the calls plus 16 slots."""
    src = np.asarray(src, dtype=np.int64)
    n = src.shape[0]
    if n == 0:
        return (), src.copy()
    lo = int(src.min())
    off = src - lo
    step = int(np.gcd.reduce(off))
    if step == 0:
        return (ScaleCopy(dst, lo, 4, 1),), np.full(n, dst, dtype=np.int64)
    height = int(off.max()) // step + 1
    if step >= 4 and height <= 2 * n + 16 and (height - 1) * step <= SCALE_SPAN_MAX:
        return (ScaleCopy(dst, lo, step, height),), dst + SCALE_POINTER_ALIGN * (off // step)
    new = dst + SCALE_POINTER_ALIGN * np.arange(n, dtype=np.int64)
    return tuple(ScaleCopy(d, s, 4, 1) for d, s in zip(new.tolist(), src.tolist())), new


def shape_signature(key: bytes) -> tuple[int, ...]:
    """A :attr:`VecPlan.launch_rows` key as the tuple of its 17 ints (a row of ``keys``)."""
    return tuple(np.frombuffer(key, dtype=np.int64).tolist())


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
    # One table holds keys, pointers and sizes side by side: dropping the empty experts is one
    # fancy-index, and VecPlan's arrays are views of it.
    T = np.empty((num, _PLAN_COLUMNS), np.int64)
    K, P = T[:, _KEYS], T[:, _PTRS]
    K[:, 0], K[:, 3] = ct[R.dtype], R.ld
    K[:, 1], K[:, 2] = (r, q) if rt else (q, r)
    K[:, 4], K[:, 7] = ct[L.dtype], L.ld
    K[:, 5], K[:, 6] = (p, r) if lt else (r, p)
    K[:, 8], K[:, 9], K[:, 10], K[:, 11] = ct[O.dtype], q, p, O.ld
    P[:, 0], P[:, 1], P[:, 2], P[:, 3] = np.arange(num), R.ptr, L.ptr, O.ptr
    for col, ptrs in ((4, problem.right_scale), (5, problem.left_scale), (6, problem.bias)):
        P[:, col] = 0 if ptrs is None else ptrs
    # the alignments of A, B, C (= D), D and the bias pointer (0 without a bias), in place
    K[:, 12:15] = P[:, 1:4]
    K[:, 15], K[:, 16] = O.ptr, P[:, 6]
    _pointer_alignments_in_place(K[:, 12:17] if problem.bias is not None else K[:, 12:16])
    M = T[:, _MNK]
    M[:, 0], M[:, 1], M[:, 2] = q, p, r
    skipped = np.flatnonzero(empty)
    if skipped.shape[0]:
        T = T[~empty]
        zero = () if problem.accumulate else tuple(
            np.flatnonzero((r == 0) & (p * q > 0)).tolist())
    else:
        zero = ()
    transa = E.CUBLAS_OP_T if rt else E.CUBLAS_OP_N
    transb = E.CUBLAS_OP_T if lt else E.CUBLAS_OP_N
    spans = (None, None) if not problem.fp8 or problem.block_scaled else (
        scale_span(problem.right_scale), scale_span(problem.left_scale))
    return VecPlan(gemm_config(problem, transa, transb), T[:, _KEYS], T[:, _PTRS], T[:, _MNK],
                   1.0 if problem.accumulate else 0.0, zero, tuple(skipped.tolist()), spans)


def scale_span(ptrs) -> tuple[int, int, int] | None:
    """``(first, step, count)`` of per-expert scale pointers that step evenly, by at least a
    float and at most :data:`SCALE_SPAN_MAX` bytes (one array's elements: one strided copy reads
    each of them and nothing between), else None."""
    p = ptrs.tolist() if isinstance(ptrs, np.ndarray) else list(ptrs)
    if len(p) == 1:
        return (p[0], 4, 1)
    step = p[1] - p[0]
    if not 4 <= step <= SCALE_SPAN_MAX or p != list(range(p[0], p[0] + step * len(p), step)):
        return None
    return (p[0], step, len(p))


# plan_arrays' table: the 17 key columns, the 7 pointer columns and m, n, k.
_KEYS, _PTRS, _MNK = slice(0, 17), slice(17, 24), slice(24, 27)
_PLAN_COLUMNS = 27


def _pointer_alignments_in_place(a: np.ndarray, cap: int = 256) -> None:
    """:func:`pointer_alignment` of every pointer in ``a``, written over them: with ``cap`` a
    power of two, the lowest set bit of ``ptr | cap`` is ``min(ptr & -ptr, cap)``, and ``cap``
    for a null pointer (two array operations)."""
    np.bitwise_or(a, cap, out=a)
    np.bitwise_and(a, -a, out=a)


def plan_problem(problem: Problem, out: Sequence[Block]) -> GemmPlan:
    """Per-expert calls for ``problem`` writing ``out`` (:func:`plan_arrays` as one
    :class:`ExpertGemm` per non-empty expert)."""
    vp = plan_arrays(problem, out)
    return GemmPlan(vp.config, vp.calls(), vp.zero, vp.skipped)


BLOCK_SCALING_MIN_VERSION = 120900   # cuBLAS 12.9: the VEC128_32F / BLK128x128_32F scale modes
MXFP8_MIN_VERSION = 120800           # cuBLAS 12.8: the VEC32_UE8M0 scale mode (MXFP8)


def block_scaling_unsupported(version: int, compute_capability: int, mx: bool = False) -> str | None:
    """Why cuBLASLt cannot run a block-scaled FP8 GEMM here, or None: Hopper (sm_90) and cuBLAS
    12.9 or newer. On Blackwell (sm_100+) cuBLASLt has no VEC128 / BLK128x128 scale modes;
    TransformerEngine converts to MXFP8 there (``multi_mxfp8_cast_transpose``). ``mx``: MXFP8
    operands (VEC32_UE8M0), which need sm_100 or newer and cuBLAS 12.8 or newer."""
    cc = int(compute_capability)
    if mx:
        if cc < 100:
            return (f"MXFP8 GEMMs need compute capability 10.0 or newer (Blackwell); this is "
                    f"sm_{cc} (on Hopper use Float8BlockScaling: multi_block_cast_transpose)")
        if int(version) < MXFP8_MIN_VERSION:
            return f"MXFP8 GEMMs need cuBLAS 12.8 or newer; libcublasLt reports {version}"
        return None
    if cc < 90:
        return (f"block-scaled FP8 GEMMs need compute capability 9.0 (Hopper); this is sm_{cc}")
    if cc >= 100:
        return (f"block-scaled FP8 GEMMs run on Hopper (sm_90) only: cuBLASLt has no 128-element "
                f"block scales on sm_{cc} (TransformerEngine emulates them with MXFP8 there: "
                f"cast with multi_mxfp8_cast_transpose), or use per-tensor FP8 scaling")
    if int(version) < BLOCK_SCALING_MIN_VERSION:
        return (f"block-scaled FP8 GEMMs need cuBLAS 12.9 or newer; libcublasLt reports "
                f"{version}")
    return None


def workspace_bytes_for(compute_capability: int) -> int:
    """cuBLASLt workspace per stream: 32 MiB on Hopper and newer (what its FP8 kernels want, as in
    TransformerEngine), 4 MiB before."""
    return (32 << 20) if compute_capability >= 90 else (4 << 20)
