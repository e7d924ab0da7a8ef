"""``multi_pad_cast_transpose``: pad + FP8 cast + transpose (+ amax) of all experts in one launch.

Host side of ``kernels_cu/pad_cast_transpose.cu``: argument checks, launch planning (pure
functions, tested on the CPU), output allocation and the launch on the CUDA device, on the CPU
emulator, or the NumPy reference (:func:`cugrouped.reference.multi_pad_cast_transpose`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from .. import _jit
from .._array import DeviceLikeHost, array_kind, as_bytes, as_view, data_ptr, is_contiguous
from ..grouped_fp8 import FP8_FORMATS, GroupedFP8
from ..reference.activation import ACTIVATIONS
from . import _cast_inputs, _launch
from ._cast_inputs import GroupedInput, row_stride
from ._launch import ChunkLaunch

__all__ = ["multi_pad_cast_transpose", "check_scale_and_out",
           "padded_splits", "plan_launches_device", "output_sizes",
           "tile_counts", "plan_launches", "ChunkLaunch", "MAX_EXPERTS_PER_LAUNCH", "TILE_M",
           "TILE_K", "THREADS", "group_dtype", "KERNEL_SPEC", "GATHER_KERNEL_SPEC", "kernel_name",
           "GEMM_K_MULTIPLE",
           "cast_arrays", "cuda_arguments", "check_options", "check_amax_accumulate",
           "check_out_format", "check_out_kind", "ACTIVATIONS", "check_activation",
           "normalized_input", "ACT_KERNEL_SPEC", "TPB_KERNEL_SPEC", "TPB_DTYPES",
           "TILES_PER_BLOCK", "has_tiles_per_block", "tiles_per_block", "set_tiles_per_block",
           "blocks_for", "half_tiles", "set_half_tiles", "has_half_tiles", "HALF_KERNEL_SPEC"]

# Must match kernels_cu/pad_cast_transpose.cu.
MAX_EXPERTS_PER_LAUNCH = 64
TILE_M, TILE_K, THREADS = 64, 128, 256
# cuBLASLt FP8 GEMMs need the reduction dimension (k for fprop, n for dgrad) to be a multiple of 16.
GEMM_K_MULTIPLE = 16

_IN = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_FMT = {"e4m3": "E4M3", "e5m2": "E5M2"}
_MODES = ("AMAX_ONLY", "CAST", "CAST_AMAX")
# Column sums are taken in the pass that computes amax: only these modes have a column-sum variant.
_COLSUM_MODES = ("AMAX_ONLY", "CAST_AMAX")
# What the kernel can apply to its input before the cast (ACTIVATIONS; None: nothing), by the
# name of its template argument (kernels_cu/activation.cuh).
_ACT = {"swiglu": "SWIGLU"}


def check_activation(activation, column_sums: bool = False, gather: bool = False) -> None:
    """``activation``: one of :data:`ACTIVATIONS`; not with column sums (a gradient's dbias) or
    ``row_index`` (the permute before fc1), which the activation between fc1 and fc2 never needs."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if activation is not None and (column_sums or gather):
        raise ValueError(f"activation: {activation!r} does not go with "
                         f"{'column_sums' if column_sums else 'row_index'} (the activation "
                         "between fc1 and fc2 needs neither)")


@functools.lru_cache(maxsize=256)   # per launch; a name is formatted once
def kernel_name(in_dtype: str, fp8_format: str, mode: str, column_sums: bool = False,
                gather: bool = False, activation: str | None = None, tpb: int = 1,
                half: bool = False) -> str:
    """The instantiation for one launch. Column sums, the gather (``row_index``), the
    activation, the tiles per block and half tiles are template parameters (``COLSUM``,
    ``GATHER``, ``ACT``, ``TPB``, ``HALF``; default false, false, none, 1, false), so the common
    kernels carry no registers for them; the names of those keep the three-argument spelling.
    ``tpb`` 2 exists for 16-bit input without the other three (:data:`TPB_KERNEL_SPEC`), ``half``
    without any of the others (:data:`HALF_KERNEL_SPEC`)."""
    if column_sums and mode not in _COLSUM_MODES:
        raise ValueError(f"mode: column sums are computed in {_COLSUM_MODES}, got {mode!r}")
    check_activation(activation, column_sums, gather)
    tail = ", true, true" if column_sums and gather else ", false, true" if gather else \
        ", true" if column_sums else ""
    if activation is not None:
        tail = f", false, false, cg::Act::{_ACT[activation]}"
    if tpb != 1:
        if not has_tiles_per_block(in_dtype, column_sums, gather, activation, tpb):
            raise ValueError(f"tpb: {tpb} tiles per block exist for {TPB_DTYPES} input without "
                             "column sums, gather or activation (and only 1 or 2)")
        tail = f", false, false, cg::Act::NONE, {tpb}"
    if half:
        if tpb != 1 or not has_half_tiles(column_sums, gather, activation):
            raise ValueError("half: half tiles exist without column sums, gather, activation or "
                             "two tiles per block")
        tail = ", false, false, cg::Act::NONE, 1, true"
    return (f"cg::pad_cast_transpose_kernel<cg::InDtype::{_IN[in_dtype]}, "
            f"cg::Fp8Format::{_FMT[fp8_format]}, cg::PctMode::{mode}{tail}>")


def _instantiations(gather: bool) -> tuple[str, ...]:
    # 3 dtypes x 2 formats x (3 modes + 2 column-sum variants) = 30 per spec
    return tuple(kernel_name(d, f, m, cs, gather) for d in _IN for f in _FMT for m in _MODES
                 for cs in (False, True) if not cs or m in _COLSUM_MODES)


# Two consecutive tiles per block (the kernel's TPB): its own module, compiled when first used
# (set_tiles_per_block(2)); 16-bit input without column sums, gather or activation:
# 2 dtypes x 2 formats x 3 modes.
TPB_DTYPES = ("float16", "bfloat16")
TILES_PER_BLOCK = (1, 2)


def has_tiles_per_block(in_dtype: str, column_sums: bool, gather: bool, activation, tpb: int
                        ) -> bool:
    """Whether the kernel has a ``tpb`` tiles-per-block instantiation for these options."""
    return tpb == 1 or (tpb in TILES_PER_BLOCK and in_dtype in TPB_DTYPES and not column_sums
                        and not gather and activation is None)


KERNEL_SPEC = _jit.register("pad_cast_transpose", _jit.KernelSpec(
    source="pad_cast_transpose.cu", name_expressions=_instantiations(False)))
# The gather (fused permute) in a module of its own: compiled (NVRTC, or g++ for the emulator)
# only when a caller passes row_index.
GATHER_KERNEL_SPEC = _jit.register("pad_cast_transpose_gather", _jit.KernelSpec(
    source="pad_cast_transpose.cu", name_expressions=_instantiations(True)))
# The activation (fc1's gated unit before fc2's cast), likewise compiled when first used:
# 3 dtypes x 2 formats x 3 modes.
ACT_KERNEL_SPEC = _jit.register("pad_cast_transpose_swiglu", _jit.KernelSpec(
    source="pad_cast_transpose.cu",
    name_expressions=tuple(kernel_name(d, f, m, activation="swiglu") for d in _IN for f in _FMT
                           for m in _MODES)))


TPB_KERNEL_SPEC = _jit.register("pad_cast_transpose_tpb2", _jit.KernelSpec(
    source="pad_cast_transpose.cu",
    name_expressions=tuple(kernel_name(d, f, m, tpb=2) for d in TPB_DTYPES for f in _FMT
                           for m in _MODES)))

def has_half_tiles(column_sums: bool, gather: bool, activation) -> bool:
    """Whether the kernel has a half-tile instantiation for these options: not with column sums
    (their summation order is by 64-row tiles), the gather or the activation."""
    return not column_sums and not gather and activation is None


# Half tiles (the kernel's HALF): its own module too, so the other modules' code is unchanged
# (compiled when first used, by set_half_tiles(True), or by warmup and compile-check); without
# column sums, gather or activation: 3 dtypes x 2 formats x 3 modes.
HALF_KERNEL_SPEC = _jit.register("pad_cast_transpose_half", _jit.KernelSpec(
    source="pad_cast_transpose.cu",
    name_expressions=tuple(kernel_name(d, f, m, half=True) for d in _IN for f in _FMT
                           for m in _MODES)))


_tiles_per_block = 1


def tiles_per_block() -> int:
    """How many consecutive tiles each block of the per-tensor cast takes, where the kernel has
    that instantiation (:func:`has_tiles_per_block`; 1 elsewhere)."""
    return _tiles_per_block


def set_tiles_per_block(n: int) -> int:
    """Set :func:`tiles_per_block` (one of :data:`TILES_PER_BLOCK`) for the casts that follow in
    this process; returns the previous value. A block's fixed costs (the amax reduction, the
    atomics and fences of the last-block pattern, its start and end) are then paid once per
    expert per ``n`` tiles. A tuning knob for benchmarks: every value gives the same bits; 1
    until a GPU measurement says otherwise (``python -m cugrouped bench cast``: the
    ``cugrouped-tpb2`` rows)."""
    global _tiles_per_block
    old = _tiles_per_block
    _tiles_per_block = _launch.setting(n, TILES_PER_BLOCK, f"one of {TILES_PER_BLOCK}")
    return old


_half_tiles = False


def half_tiles() -> bool:
    """Whether the per-tensor cast puts an expert's last tile row of at most 32 rows in half
    tiles (32 rows x 256 columns, ``ceil(tiles_k / 2)`` of them) instead of ``tiles_k`` 64-row
    tiles at most half full, where the kernel has that instantiation (:func:`has_half_tiles`;
    one tile per block then, whatever :func:`tiles_per_block` says)."""
    return _half_tiles


def set_half_tiles(on: bool) -> bool:
    """Set :func:`half_tiles` for the casts that follow in this process; returns the previous
    value. A block's time hardly depends on how many of its tile's rows are real, so the
    jagged counts of many small experts (a fifth of the 64-row tiles' rows unused at E=64,
    ``tile_fill_pct`` in ``bench cast``) cost blocks that half tiles save: the tile rows go from
    ``ceil(m_pad / 64)`` per expert to within 32 rows of ``m_pad / 64``. A tuning knob for
    benchmarks: either value gives the same bits; off until a GPU measurement says otherwise
    (``python -m cugrouped bench cast``: the ``cugrouped-half`` rows)."""
    global _half_tiles
    _launch.check_bool(on, "on")
    old, _half_tiles = _half_tiles, bool(on)
    return old


def blocks_for(tiles: int, tpb: int) -> int:
    """The grid of a launch over ``tiles`` tiles, ``tpb`` consecutive ones per block."""
    return -(-tiles // tpb)


@functools.lru_cache(maxsize=None)
def group_dtype(max_experts: int = MAX_EXPERTS_PER_LAUNCH) -> np.dtype:
    """NumPy twin of ``struct cg::PctGroup`` (passed to the kernel by value)."""
    e = max_experts
    return np.dtype([("in", "<u8", e), ("out_row", "<u8", e), ("out_col", "<u8", e),
                     ("m", "<i8", e), ("ld", "<i8", e), ("tile_start", "<i4", e + 1),
                     ("num_experts", "<i4"), ("first_expert", "<i4"), ("m_dev", "<u8"),
                     ("total_rows", "<i8"), ("row_index", "<u8"), ("src_rows", "<i8"),
                     ("row_first", "<i8", e)], align=True)


# ---------------------------------------------------------------------------------------------
# Planning: pure functions of sizes, no arrays.

def padded_array(m: np.ndarray, align: int) -> np.ndarray:
    return (m + (align - 1)) // align * align


def padded_splits(m_splits: Sequence[int], align: int) -> tuple[int, ...]:
    """``m_pad_i = ceil(m_i / align) * align``."""
    return _padded(tuple(m_splits), align)


@functools.lru_cache(maxsize=256)   # a training step repeats its splits per layer and pass
def _padded(m_splits: tuple[int, ...], align: int) -> tuple[int, ...]:
    return tuple([-(-m // align) * align for m in _launch.int_tuple(m_splits)])


def tile_counts(m_splits: Sequence[int], k: int, align: int, half: bool = False
                ) -> tuple[int, ...]:
    """Tiles (64 x 128) per expert: at least one tile row, so that an empty expert still writes
    its amax, scale_inv and (zero) column sums. With ``half`` (:func:`set_half_tiles`) a last
    tile row of at most 32 rows (an empty expert's included) is ``ceil(tiles_k / 2)`` half
    tiles of 32 x 256 instead (the kernel's ``tile_rows``)."""
    tiles_k = -(-k // TILE_K)
    padded = padded_splits(m_splits, align)
    if not half:
        rows = [-(-mp // TILE_M) for mp in padded]
        return tuple([(r if r > 1 else 1) * tiles_k for r in rows])     # max(1, r), inlined
    halves, counts = -(-tiles_k // 2), []
    for mp in padded:
        full, last = divmod(mp, TILE_M)     # whole tile rows, rows of the last one
        counts.append(full * tiles_k + (halves if 0 < last <= TILE_M // 2 or mp == 0 else
                                        tiles_k if last else 0))
    return tuple(counts)


def plan_launches(m_splits: Sequence[int], k: int, align: int,
                  max_experts: int = MAX_EXPERTS_PER_LAUNCH, half: bool = False
                  ) -> list[ChunkLaunch]:
    """Split the experts into chunks that fit one argument block, with each chunk's tile offsets
    (``half``: with half tiles, :func:`tile_counts`)."""
    return list(_plan_cached(_launch.int_tuple(m_splits), k, align, max_experts, bool(half)))


@functools.lru_cache(maxsize=256)   # a training step repeats its splits per layer and pass
def _plan_cached(m_splits: tuple[int, ...], k: int, align: int, max_experts: int,
                 half: bool = False) -> tuple:
    return _launch.chunks_of_tiles(tile_counts(m_splits, k, align, half), max_experts)


def plan_launches_device(num_experts: int, total_rows: int, k: int, align: int,
                         max_experts: int = MAX_EXPERTS_PER_LAUNCH) -> list[ChunkLaunch]:
    """Chunks for counts that stay on the device: each grid covers the worst case of its chunk,
    ``tiles_k * (ceil((rows + count * (align - 1)) / 64) + count)`` (every expert rounds up to
    ``align`` and to a tile row; half tiles only make fewer)."""
    tiles_k = -(-k // TILE_K)
    return _launch.device_chunks(
        num_experts, max_experts,
        lambda count: tiles_k * (-(-(total_rows + count * (align - 1)) // TILE_M) + count))


def output_sizes(g: "GroupedInput", align: int) -> tuple[int, int]:
    """(rows of ``data``, bytes of ``data_t``); with device splits ``data_t`` is the worst case."""
    if g.m_dev is not None:
        return g.total_rows, g.k * (g.total_rows + g.num_experts * (align - 1))
    return g.total_rows, g.k * sum(padded_splits(g.m_splits, align))


# ---------------------------------------------------------------------------------------------
# Argument checks (the inputs' own: :mod:`._cast_inputs`).

def check_options(fp8_format: str, margin: int, align: int, rowwise: bool = True,
                  columnwise: bool = True, column_sums: bool = False) -> None:
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"fp8_format: got {fp8_format!r}, expected one of {FP8_FORMATS}")
    if not isinstance(align, (int, np.integer)) or isinstance(align, bool) or align < 1:
        raise ValueError(f"align: expected a positive int, got {align!r}")
    if not isinstance(margin, (int, np.integer)) or isinstance(margin, bool) or not 0 <= margin <= 64:
        raise ValueError(f"margin: expected an int in [0, 64], got {margin!r}")
    for name, flag in (("rowwise", rowwise), ("columnwise", columnwise),
                       ("column_sums", column_sums)):
        _launch.check_bool(flag, name)
    if not (rowwise or columnwise):
        raise ValueError("rowwise, columnwise: at least one must be True")


def normalized_input(inputs, m_splits, dtype=None, splits_on_device=None, row_index=None,
                     activation=None) -> GroupedInput:
    """:func:`._cast_inputs.normalize_inputs`, with ``k`` the width of the output: half the
    input's for ``"swiglu"`` (its halves ``[a | b]``; an odd width is refused)."""
    g = _cast_inputs.normalize_inputs(inputs, m_splits, dtype, splits_on_device, row_index)
    if activation is None:
        return g
    if g.k % 2:
        raise ValueError(f"inputs: activation {activation!r} needs an even number of columns "
                         f"(the halves [a | b]), got {g.k}")
    return dataclasses.replace(g, k=g.k // 2)


def check_amax_accumulate(amax_accumulate, scale, out) -> None:
    """``amax_accumulate`` merges into ``out.amax``: delayed scaling only (a given ``scale``; the
    scale of current scaling comes from this call's amax alone), with an ``out`` to merge into."""
    if not isinstance(amax_accumulate, (bool, np.bool_)):
        raise TypeError(f"amax_accumulate: expected a bool, got {amax_accumulate!r}")
    if not amax_accumulate:
        return
    if scale is None:
        raise ValueError("amax_accumulate: needs a given scale (delayed scaling); current scaling "
                         "(scale=None) computes its scale from this call's amax alone")
    if out is None or getattr(out, "amax", None) is None:
        raise ValueError("amax_accumulate: needs out= with an amax buffer to merge into, got "
                         f"{'no out' if out is None else 'out.amax=None'}")


def check_out_kind(out, cls) -> None:
    """``out``: None or a result of the op's own class (``cls``)."""
    if out is not None and not isinstance(out, cls):
        raise TypeError(f"out: expected a {cls.__name__} (e.g. the result of an earlier call), "
                        f"got {type(out).__name__}")


def check_out_format(out, fp8_format: str) -> None:
    """``out`` lends its buffers to a call of its own FP8 format: one of the other format is a
    mix-up (its data would be read as the wrong format), refused before anything is written."""
    if getattr(out, "fp8_format", fp8_format) != fp8_format:
        raise ValueError(f"out: expected a result of this call's fp8_format {fp8_format!r} to "
                         f"reuse, got one of fp8_format {out.fp8_format!r}")


# ---------------------------------------------------------------------------------------------
# The op.

def multi_pad_cast_transpose(inputs, m_splits=None, *, fp8_format: str = "e4m3", scale=None,
                             margin: int = 0, align: int = 16, rowwise: bool = True,
                             columnwise: bool = True, column_sums: bool = False, out=None,
                             dtype: str | None = None, splits_on_device: bool | None = None,
                             backend: str | None = None,
                             amax_accumulate: bool = False, amax_epsilon: float = 0.0,
                             power_2_scale: bool = False, row_index=None,
                             activation: str | None = None) -> GroupedFP8:
    """Pad, cast to FP8 and transpose every expert's rows in one pass; return a :class:`GroupedFP8`.

    Parameters
    ----------
    inputs : list/tuple of 2-D arrays ``(m_i, k)``, or one 2-D array ``(sum(m_splits), k)``
        float32, float16 or bfloat16, one common ``k`` and dtype, rows contiguous (unit column
        stride; the row stride may be larger). ``m_i == 0`` is allowed anywhere. Never copied.
        NumPy and CuPy arrays give NumPy and CuPy results; torch tensors (CPU or CUDA) give torch
        tensors allocated by torch, computed on ``torch.cuda.current_stream()``.
    m_splits : required with a single array: a host sequence of ints, or a contiguous int64
        device array. Device counts are read by the kernel itself (no host sync); the result's
        ``data_t`` is then sized for the worst case and ``m_pad_splits`` is None. The counts must
        sum to the rows of ``inputs``: that cannot be checked without a sync, so the kernel clamps
        them to the rows there are.
    splits_on_device : None (decide by where ``m_splits`` lives) or True to make the kernel read a
        count array even on the emulator (where "device" memory is host memory; for tests).
    row_index : None, or a contiguous 1-D int64 array (where ``inputs`` lives) that makes this a
        fused MoE permute: ``inputs`` is then the ``(tokens, k)`` matrix and the experts' rows
        are ``inputs[row_index]`` in order, ``m_splits`` of them each (a token routed to several
        experts appears several times; ``sum(m_splits) == len(row_index)``). The permuted
        high-precision copy is never written. A negative index gives a zero row (e.g. capacity
        padding); indices ``>= tokens`` are refused for host arrays and read as zero rows on the
        device (checking them there would need a sync).
    fp8_format : ``"e4m3"`` (max 448) or ``"e5m2"`` (max 57344).
    scale : float32 array ``(E,)`` on the data's device, or None
        Given (delayed scaling): ``q = fp8(x * scale[i])``, amax fused in the same pass, one launch.
        None (current scaling): ``scale = fp8_max / amax / 2^margin`` computed on the device
        (amax 0 or non-finite: 1); two launches. Never a host sync.
    margin : int in [0, 64]; current scaling divides the scale by ``2^margin`` (headroom).
    amax_epsilon, power_2_scale : current scaling only (TransformerEngine's ``QParams``): an amax
        below ``amax_epsilon`` (0, or a normal float32) is raised to it before the scale is
        computed (an all-zero expert then gets ``fp8_max / amax_epsilon``, not 1);
        ``power_2_scale`` rounds the scale down to a power of two (exact ``scale_inv``). Both are
        applied on the device by the amax pass (``cg::compute_scale``).
    align : pad each expert's transposed copy to ``m_pad_i = ceil(m_i / align) * align`` columns
        (16 for activations and gradients, 1 for weights).
    rowwise, columnwise : which copies to write.
    column_sums : also return ``column_sums``, float32 ``(E, k)``: each expert's column sums of
        the unscaled input (dbias when the input is an output gradient), computed in the pass
        that reads the input for the amax (no extra pass).
    out : GroupedFP8 of preallocated buffers (e.g. from a previous call of the same
        ``fp8_format``) written in place. ``out`` only lends its buffers: its own fields
        (``m_splits``, ``scale``, ...) are not updated; the returned object describes this call
        (its arrays are ``out``'s buffers), so read the result, not ``out``.
    amax_accumulate : with a given ``scale`` and ``out``: max-merge each expert's amax into
        ``out.amax`` (``amax = ftz(old) > new ? old : new``, i.e. ``fmaxf(old, new)``: a NaN already
        in the buffer is replaced by the new amax, which is never NaN; a denormal or -0 old value
        counts as 0, as on the GPU with ``-ftz=true``) instead of overwriting it, in the same single
        launch. An expert without tokens contributes 0, so it leaves a non-negative ``old`` as it
        is. For a pending amax that several forwards merge into before one scale update.
    activation : None, or ``"swiglu"``: cast ``silu(a) * b`` of each row's halves ``[a | b]``
        (fc1's output, ``2k`` columns, becomes fc2's FP8 input of ``k`` columns) in the same pass;
        the activation's high-precision output is never written, ``amax`` is the activation's.
        Its float32 arithmetic is the same on every backend
        (:mod:`cugrouped.reference.activation`), within 2.5 ulps of the exact silu for ``a >= -88`` (-0 below). Not with
        ``column_sums`` or ``row_index``.
    dtype : re-tag integer carriers (a CuPy ``uint16`` array holding bfloat16 bits: ``"bfloat16"``).
    backend : ``"cuda"``, ``"emulate"`` (the same CUDA source on the CPU), ``"reference"`` (NumPy),
        or None for ``"cuda"`` with device arrays and ``"reference"`` with host arrays.

    The FP8 GEMMs need ``k % 16 == 0``; this op is right for any ``k >= 1``.
    """
    first = inputs[0] if isinstance(inputs, (list, tuple)) and inputs else inputs
    if array_kind(first) == "torch":   # torch in, torch out (outputs from torch's allocator)
        from ..pytorch.functional import multi_pad_cast_transpose as torch_op

        return torch_op(inputs, m_splits, fp8_format=fp8_format, scale=scale, margin=margin,
                        align=align, rowwise=rowwise, columnwise=columnwise,
                        column_sums=column_sums, out=out, dtype=dtype,
                        splits_on_device=splits_on_device, backend=backend,
                        amax_accumulate=amax_accumulate, amax_epsilon=amax_epsilon,
                        power_2_scale=power_2_scale, row_index=row_index, activation=activation)
    return cast_arrays(inputs, m_splits, fp8_format=fp8_format, scale=scale, margin=margin,
                       align=align, rowwise=rowwise, columnwise=columnwise,
                       column_sums=column_sums, out=out, dtype=dtype,
                       splits_on_device=splits_on_device, backend=backend,
                       amax_accumulate=amax_accumulate, amax_epsilon=amax_epsilon,
                       power_2_scale=power_2_scale, row_index=row_index, activation=activation)


def cast_arrays(inputs, m_splits=None, *, fp8_format="e4m3", scale=None, margin=0, align=16,
                rowwise=True, columnwise=True, column_sums=False, out=None, dtype=None,
                splits_on_device=None, backend=None,
                normalized: GroupedInput | None = None, amax_accumulate=False,
                amax_epsilon=0.0, power_2_scale=False, row_index=None,
                activation=None) -> GroupedFP8:
    """The op on arrays of any kind, without the torch dispatch: NumPy / CuPy in, NumPy / CuPy
    out; CUDA torch tensors are read through their pointers, which is how the torch front
    (:mod:`cugrouped.pytorch.functional`) calls it, with every output given as torch ``out=``
    buffers (uint8 ``data`` / ``data_t``). A caller that has already checked the options and
    run :func:`normalized_input` on exactly these ``inputs`` / ``m_splits`` / ``activation``
    passes its result as ``normalized`` (the torch front does, to size its outputs): the O(E)
    checks run once."""
    if normalized is None:
        check_options(fp8_format, margin, align, rowwise, columnwise, column_sums)
        check_activation(activation, column_sums, row_index is not None)
        normalized = normalized_input(inputs, m_splits, dtype, splits_on_device, row_index,
                                      activation)
    g = normalized
    eps = _cast_inputs.check_scale_options(amax_epsilon, power_2_scale, scale)
    check_scale_and_out(g, align, rowwise, columnwise, column_sums, scale, out, amax_accumulate,
                        fp8_format)
    backend = _launch.resolve_backend(backend, g.on_device)
    if backend == "reference":
        from ..reference.pad_cast_transpose import multi_pad_cast_transpose as ref

        if g.m_dev is not None:
            raise ValueError("splits_on_device: the reference backend takes host counts")
        return ref(inputs, m_splits, fp8_format=fp8_format, scale=scale, margin=margin,
                   align=align, rowwise=rowwise, columnwise=columnwise, column_sums=column_sums,
                   out=out, dtype=dtype, amax_accumulate=amax_accumulate,
                   amax_epsilon=amax_epsilon, power_2_scale=power_2_scale, row_index=row_index,
                   activation=activation)
    xp = DeviceLikeHost if backend == "emulate" else __import__("cupy")
    # New outputs are allocated inside the scope too: CuPy allocates on the current device, and
    # the kernels (on the inputs' device) must not be handed another device's memory.
    with _launch.device_scope(backend, g.device):
        res = _outputs(g, xp, fp8_format, align, rowwise, columnwise, column_sums, scale, out)
        res.total_rows = g.total_rows
        if g.m_dev is not None:
            res.m_splits, res.m_pad_splits = g.m_dev.owner, None
        launch_cast(backend, g, res, fp8_format, align, scale is not None,
                    (margin, eps, bool(power_2_scale)), column_sums, bool(amax_accumulate),
                    activation)
    if backend == "emulate" and res.data is not None:
        import ml_dtypes

        res.data = res.data.view(ml_dtypes.float8_e4m3fn if fp8_format == "e4m3"
                                 else ml_dtypes.float8_e5m2)
    return res


def launch_cast(backend: str, g: GroupedInput, res: GroupedFP8, fp8_format: str, align: int,
                given_scale: bool, rule: tuple, column_sums: bool, amax_accumulate: bool = False,
                activation: str | None = None) -> None:
    """Launch the cast of the normalized inputs ``g`` into the buffers of ``res`` (its
    ``scale`` read when ``given_scale``, else written), every check done: the tail of
    :func:`cast_arrays`, and what the torch layer's own cast op calls with buffers it allocated
    itself (``cugrouped.pytorch._custom_ops.fp8_quantize``). ``rule``: ``(margin, amax_epsilon
    as its float32 value, power_2_scale)``. On the device: under the caller's device scope."""
    # (both passes of current scaling on one tile list)
    half = _half_tiles and has_half_tiles(column_sums, g.row_index is not None, activation)
    if g.m_dev is not None:
        plans = plan_launches_device(g.num_experts, g.total_rows, g.k, align)
    else:
        plans = plan_launches(g.m_splits, g.k, align, half=half)
    _launch_all(backend, g, res, plans, align, "CAST_AMAX" if given_scale else "AMAX_ONLY",
                fp8_format, rule, column_sums, amax_accumulate, activation, half)


def _launch_all(backend, g: GroupedInput, res: GroupedFP8, plans, align, mode, fp8_format,
                rule: tuple, column_sums, amax_accumulate=False, activation=None,
                half: bool = False) -> None:
    """``rule``: ``(margin, amax_epsilon, power_2_scale)``, how the amax pass computes scales;
    ``half``: the plans have half tiles (:func:`set_half_tiles`)."""
    gather = g.row_index is not None
    for chunk, arg in zip(plans, _packed_groups(g, res, plans, align, half)):
        if len(plans) == 1:    # the usual case: no per-call slicing of device arrays (~us each)
            ptrs, colsum = (res.scale, res.amax, res.scale_inv), res.column_sums
        else:
            sl = slice(chunk.first, chunk.first + chunk.count)
            ptrs = (res.scale[sl], res.amax[sl], res.scale_inv[sl])
            colsum = res.column_sums[sl] if column_sums else None
        passes = (mode,) if mode == "CAST_AMAX" else ("AMAX_ONLY", "CAST")
        for p in passes:
            # column sums are taken in the pass that computes amax (it reads the input anyway)
            cs = colsum if p != "CAST" else None
            tpb = _tiles_per_block if not half and has_tiles_per_block(
                g.dtype, cs is not None, gather, activation, _tiles_per_block) else 1
            name = kernel_name(g.dtype, fp8_format, p, cs is not None, gather, activation, tpb,
                               half)
            spec = (ACT_KERNEL_SPEC if activation else GATHER_KERNEL_SPEC if gather
                    else HALF_KERNEL_SPEC if half else TPB_KERNEL_SPEC if tpb != 1
                    else KERNEL_SPEC)
            _run(backend, spec, name, chunk, arg, g.k, align, rule, ptrs, cs, amax_accumulate,
                 tpb)


def check_scale_and_out(g: GroupedInput, align, rowwise, columnwise, column_sums, scale, out,
                        amax_accumulate=False, fp8_format=None) -> None:
    """Validate ``scale`` and ``out`` (of ``fp8_format`` when given) against the inputs before
    anything is launched or written."""
    check_amax_accumulate(amax_accumulate, scale, out)
    E, k = g.num_experts, g.k
    rows, col_bytes = output_sizes(g, align)
    if scale is not None:
        sv = as_view(scale, arg="scale")
        if sv.dtype != "float32" or sv.shape != (E,) or not is_contiguous(sv):
            raise ValueError(f"scale: expected a contiguous float32 array of shape ({E},), got "
                             f"{sv.dtype} {sv.shape}")
        if sv.on_device != g.on_device or (g.on_device and sv.device != g.device):
            raise ValueError("scale: must live on the same device as inputs")
    if out is None:
        return
    check_out_kind(out, GroupedFP8)
    if fp8_format is not None:
        check_out_format(out, fp8_format)
    want = {"data": ((rows, k), 1) if rowwise else None,
            "data_t": ((col_bytes,), 1) if columnwise else None,
            "amax": ((E,), 4), "scale_inv": ((E,), 4),
            "scale": ((E,), 4) if scale is None else None,
            "column_sums": ((E, k), 4) if column_sums else None}
    for name, spec in want.items():
        if spec is None:
            continue
        buf = getattr(out, name)
        if buf is None:
            raise ValueError(f"out.{name}: expected a buffer of shape {spec[0]}, got None")
        v = as_view(buf, arg=f"out.{name}")
        if v.shape != spec[0] or v.itemsize != spec[1] or (v.on_device, v.device) != (g.on_device, g.device):
            raise ValueError(f"out.{name}: expected shape {spec[0]} with {spec[1]}-byte items "
                             f"on the inputs' device, got shape {v.shape} dtype {v.dtype}")
        if not is_contiguous(v):
            raise ValueError(f"out.{name}: must be contiguous, got strides {v.strides}")


def _outputs(g: GroupedInput, xp, fp8_format, align, rowwise, columnwise, column_sums, scale,
             out) -> GroupedFP8:
    """Allocate the result (or adopt the checked ``out`` buffers)."""
    E, k = g.num_experts, g.k
    rows, col_bytes = output_sizes(g, align)
    m_pad = padded_splits(g.m_splits, align) if g.m_splits is not None else None
    if out is not None:
        res = dataclasses.replace(out, m_splits=g.m_splits, m_pad_splits=m_pad, fp8_format=fp8_format,
                                  k=k, align=align)
        res.data = as_bytes(out.data) if rowwise else None
        res.data_t = as_bytes(out.data_t) if columnwise else None
        if scale is not None:
            res.scale = scale
        if not column_sums:
            res.column_sums = None
        return res
    return GroupedFP8(
        data=xp.empty((rows, k), dtype=np.uint8) if rowwise else None,
        data_t=xp.empty((col_bytes,), dtype=np.uint8) if columnwise else None,
        m_splits=g.m_splits, m_pad_splits=m_pad,
        amax=xp.empty((E,), dtype=np.float32),
        scale=scale if scale is not None else xp.empty((E,), dtype=np.float32),
        scale_inv=xp.empty((E,), dtype=np.float32),
        fp8_format=fp8_format, k=k, align=align,
        column_sums=xp.empty((E, k), dtype=np.float32) if column_sums else None)


_PACKED = _launch.ArgMemo(64)


def _packed_groups(g: GroupedInput, res: GroupedFP8, plans: list[ChunkLaunch], align: int,
                   half: bool = False) -> list:
    """:func:`_pack_groups`, remembered per argument values (:class:`._launch.ArgMemo`); the key
    holds every value written into them (splits, k, align, every pointer and row stride) and
    whether the plans' tile offsets are of half tiles."""
    gather = (g.row_index.ptr, g.src_rows) if g.row_index is not None else None
    out = (data_ptr(res.data), data_ptr(res.data_t))
    if g.m_dev is not None:
        key = ("dev", g.num_experts, g.k, align, g.base.ptr, row_stride(g.base), g.m_dev.ptr,
               g.total_rows, *out, gather, half)
    else:
        key = (g.m_splits, g.k, align, g.ptrs.tobytes(), g.lds.tobytes(), *out, gather, half)
    return _PACKED.get(key, lambda: _pack_groups(g, out, plans, align))


def _pack_groups(g: GroupedInput, out: tuple[int, int], plans: list[ChunkLaunch],
                 align: int) -> list:
    """The by-value argument block of every chunk (pointers, sizes, tile offsets), vectorised;
    ``out``: the pointers of ``data`` and ``data_t`` (0: not written)."""
    dt = group_dtype()
    row_ptr, col_ptr = out
    args = []
    if g.m_dev is not None:    # the blocks derive the per-expert fields from the device counts
        for chunk in plans:
            arg = np.zeros((), dtype=dt)
            arg["num_experts"] = chunk.count
            arg["in"][0], arg["out_row"][0], arg["out_col"][0] = g.base.ptr, row_ptr, col_ptr
            arg["ld"][0] = row_stride(g.base)
            arg["first_expert"], arg["m_dev"], arg["total_rows"] = chunk.first, g.m_dev.ptr, g.total_rows
            if g.row_index is not None:
                arg["row_index"], arg["src_rows"] = g.row_index.ptr, g.src_rows
            args.append(arg)
        return args
    m = np.asarray(g.m_splits, dtype=np.int64)
    out_row = _launch.pointer_offsets(row_ptr, m * g.k, 1, g.ptrs)
    out_col = _launch.pointer_offsets(col_ptr, padded_array(m, align) * g.k, 1, g.ptrs)
    fields = {"in": g.ptrs, "ld": g.lds, "m": m, "out_row": out_row, "out_col": out_col}
    if g.row_index is None:
        return _launch.pack_chunks(dt, plans, fields)
    row_first = _launch.exclusive_cumsum(m)
    return _launch.pack_chunks(dt, plans, {**fields, "row_first": row_first},
                               lambda chunk: {"row_index": g.row_index.ptr, "src_rows": g.src_rows})


def _nullable(*arrays):
    """Pointer arguments that may be absent: a null pointer travels as an 8-byte zero by value."""
    return tuple(np.uint64(0) if a is None else a for a in arrays)


def _scalars(k: int, align: int, rule: tuple) -> tuple:
    """``i64 k, i32 align, i32 margin, float amax_epsilon, i32 power_2_scale``; ``rule`` is
    ``(margin, amax_epsilon, power_2_scale)``."""
    margin, eps, p2 = rule
    return (np.int64(k), np.int32(align), np.int32(margin), np.float32(eps), np.int32(p2))


def cuda_arguments(chunk: ChunkLaunch, arg, k: int, align: int, rule, ptrs,
                   colsum, amax_accumulate: bool = False) -> tuple:
    """The argument tuple of one CUDA launch, in the order and C widths of the kernel's signature
    ``(PctGroup g, i64 k, i32 align, i32 margin, float amax_epsilon, i32 power_2_scale,
    float* scale, float* amax, float* scale_inv,
    int* workspace, float* colsum, float* colsum_partial, int* colsum_count,
    i32 amax_accumulate)``: the argument block by value (:func:`._launch.by_value`), every
    pointer as a ``uint64`` (so any device array kind works, torch tensors included, with no
    DLPack round trip), null where a buffer is not used. The
    workspaces are kept per (device, stream) (:mod:`._launch`), never allocated per call."""
    tiles_k = -(-k // TILE_K)
    ws = _launch.device_workspace("pad_cast_transpose", 2 * MAX_EXPERTS_PER_LAUNCH)
    if colsum is not None:
        count = _launch.device_workspace("pad_cast_transpose.colsum", MAX_EXPERTS_PER_LAUNCH * tiles_k)
        partial = _launch.device_scratch("pad_cast_transpose.partial", 4 * chunk.grid * TILE_K)
    else:
        count = partial = None
    pointers = tuple(ptrs) + (ws, colsum, partial, count)
    return (_launch.by_value(arg),) + _scalars(k, align, rule) + tuple(
        np.uint64(data_ptr(a)) for a in pointers) + (np.int32(amax_accumulate),)


def _run(backend, spec, name, chunk: ChunkLaunch, arg, k, align, rule, ptrs, colsum,
         amax_accumulate=False, tpb: int = 1) -> None:
    grid = blocks_for(chunk.grid, tpb)           # chunk.grid counts tiles
    _launch.note_launch(backend, name, grid, THREADS)
    if backend == "cuda":
        kern = _jit.get_function(spec, name)
        kern((grid,), (THREADS,), cuda_arguments(chunk, arg, k, align, rule, ptrs, colsum,
                                                 amax_accumulate))
    else:   # host buffers, made per launch and checked after it
        scale, amax, scale_inv = ptrs
        scalars = _scalars(k, align, rule)
        tiles_k = -(-k // TILE_K)
        ws = np.zeros(2 * MAX_EXPERTS_PER_LAUNCH, dtype=np.int32)
        count = np.zeros(chunk.count * tiles_k, dtype=np.int32) if colsum is not None else None
        partial = (DeviceLikeHost.empty(chunk.grid * TILE_K, np.float32) if colsum is not None
                   else None)
        kern = _jit.get_emulated_function(spec, name)
        kern((grid,), (THREADS,), (arg,) + scalars + (scale, amax, scale_inv, ws)
             + _nullable(colsum, partial, count) + (np.int32(amax_accumulate),),
             order=_launch.current_emulation_order())
        if ws.any() or (count is not None and count.any()):
            raise RuntimeError("pad_cast_transpose kernel left its workspace non-zero (kernel bug)")
