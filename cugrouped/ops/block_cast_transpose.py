"""``multi_block_cast_transpose``: pad + block-scaled FP8 cast + transpose of all experts in one launch.

Host side of ``kernels_cu/block_cast_transpose.cu`` (TransformerEngine's ``Float8BlockScaling``):
argument checks, launch planning (pure functions, tested on the CPU), output allocation and the
launch on the CUDA device, on the CPU emulator, or the NumPy reference
(:func:`cugrouped.reference.multi_block_cast_transpose`). The input side (lists, one array plus
host or device counts, array kinds, dtypes) is :func:`._cast_inputs.normalize_inputs`, which all
the casts share.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from .. import _jit
from .._array import DeviceLikeHost, array_kind, as_bytes, as_view, data_ptr, is_contiguous
from ..grouped_block_fp8 import (BLOCK, MX_DIMS, GroupedBlockFP8, block_scale_sizes, result_type,
                                 scale_dtype)
from ..grouped_fp8 import FP8_FORMATS
from . import _cast_inputs, _launch
from ._cast_inputs import GroupedInput, row_stride
from ._launch import ChunkLaunch
from .pad_cast_transpose import (check_activation, check_out_format, check_out_kind,
                                 normalized_input, padded_splits)

__all__ = ["multi_block_cast_transpose", "block_cast_arrays", "kernel_name", "KERNEL_SPEC",
           "GATHER_KERNEL_SPEC", "ACT_KERNEL_SPEC",
           "group_dtype", "block_tile_counts", "plan_block_launches",
           "plan_block_launches_device", "block_output_sizes", "check_block_options", "check_out",
           "check_public_dims",
           "MAX_EXPERTS_PER_LAUNCH", "THREADS", "ALIGNS"]

# Must match kernels_cu/block_cast_transpose.cu.
MAX_EXPERTS_PER_LAUNCH = 64
THREADS = 256
# align must divide the block length, so that an expert's padded rows end in its last row block.
ALIGNS = (1, 2, 4, 8, 16, 32, 64, 128)

_IN = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_FMT = {"e4m3": "E4M3", "e5m2": "E5M2"}


def check_block_activation(activation, block_scaling_dim, column_sums=False,
                           gather=False) -> None:
    """:func:`.pad_cast_transpose.check_activation`, and the activation casts an activation:
    1 x 128 blocks or MXFP8, not a weight's 128 x 128."""
    check_activation(activation, column_sums, gather)
    if activation is not None and block_scaling_dim == 2:
        raise ValueError("activation: casts fc2's input, an activation: block_scaling_dim=1 (or "
                         "MXFP8), not 2 (128 x 128 blocks are for weights)")


@functools.lru_cache(maxsize=256)   # per launch; a name is formatted once
def kernel_name(in_dtype: str, fp8_format: str, block_scaling_dim: int, gather: bool = False,
                column_sums: bool = False, activation: str | None = None) -> str:
    """The instantiation for one launch (``block_scaling_dim`` 1, 2 or ``MX_DIMS``: MXFP8); the
    gather (``row_index``), the column sums and the activation are template parameters
    (``GATHER``, ``COLSUM``, ``ACT``; default false, false, none); the gather and activation
    variants live in modules of their own, compiled only when used, and have no column sums."""
    if gather and column_sums:
        raise ValueError("column_sums: not with row_index (gradients are not gathered)")
    check_block_activation(activation, block_scaling_dim, column_sums, gather)
    tail = ", true" if gather else ", false, true" if column_sums else ""
    if activation is not None:
        tail = f", false, false, cg::Act::{activation.upper()}"
    return (f"cg::block_cast_transpose_kernel<cg::InDtype::{_IN[in_dtype]}, "
            f"cg::Fp8Format::{_FMT[fp8_format]}, {int(block_scaling_dim)}{tail}>")


def _instantiations(gather: bool) -> tuple[str, ...]:
    # 3 dtypes x 2 formats x 3 block kinds (x column sums or not, without the gather)
    return tuple(kernel_name(d, f, n, gather, cs) for d in _IN for f in _FMT for n in (1, 2, MX_DIMS)
                 for cs in ((False,) if gather else (False, True)))


KERNEL_SPEC = _jit.register("block_cast_transpose", _jit.KernelSpec(
    source="block_cast_transpose.cu", name_expressions=_instantiations(False)))
GATHER_KERNEL_SPEC = _jit.register("block_cast_transpose_gather", _jit.KernelSpec(
    source="block_cast_transpose.cu", name_expressions=_instantiations(True)))
# fc1's gated unit before fc2's cast (activations: 1-D blocks and MXFP8): 3 dtypes x 2 formats x 2
ACT_KERNEL_SPEC = _jit.register("block_cast_transpose_swiglu", _jit.KernelSpec(
    source="block_cast_transpose.cu",
    name_expressions=tuple(kernel_name(d, f, n, activation="swiglu") for d in _IN for f in _FMT
                           for n in (1, MX_DIMS))))


@functools.lru_cache(maxsize=None)
def group_dtype(max_experts: int = MAX_EXPERTS_PER_LAUNCH) -> np.dtype:
    """NumPy twin of ``struct cg::BctGroup`` (passed to the kernel by value)."""
    e = max_experts
    return np.dtype([("in", "<u8", e), ("out_row", "<u8", e), ("out_col", "<u8", e),
                     ("sinv_row", "<u8", e), ("sinv_col", "<u8", e),
                     ("m", "<i8", e), ("ld", "<i8", e), ("tile_start", "<i4", e + 1),
                     ("num_experts", "<i4"), ("first_expert", "<i4"), ("m_dev", "<u8"),
                     ("total_rows", "<i8"), ("row_index", "<u8"), ("src_rows", "<i8"),
                     ("row_first0", "<i8")], align=True)


# ---------------------------------------------------------------------------------------------
# Planning: pure functions of sizes, no arrays.

def block_tile_counts(m_splits: Sequence[int], k: int) -> tuple[int, ...]:
    """128 x 128 tiles per expert; an empty expert has none (it has no bytes and no scales)."""
    tiles_k = -(-k // BLOCK)
    return tuple([-(-m // BLOCK) * tiles_k for m in _launch.int_tuple(m_splits)])


@dataclasses.dataclass(frozen=True)
class _Sizes:
    rows: int          # rows of data
    data_t: int        # bytes of data_t
    scale_inv: int     # entries of scale_inv
    scale_inv_t: int   # entries of scale_inv_t


def block_output_sizes(m_splits: Sequence[int] | None, k: int, align: int, dims: int,
                       num_experts: int = 0, total_rows: int = 0) -> _Sizes:
    """Buffer sizes; with device counts (``m_splits=None``) the worst case over every split of
    ``total_rows`` rows into ``num_experts`` experts."""
    if m_splits is not None:
        mp = padded_splits(m_splits, align)
        srow, scol = block_scale_sizes(m_splits, mp, k, dims)
        return _Sizes(sum(m_splits), k * sum(mp), int(srow.sum()), int(scol.sum()))
    E, bk = num_experts, -(-k // BLOCK)
    blocks_m = -(-total_rows // BLOCK) + E          # >= sum of ceil(m_i / 128)
    if dims == MX_DIMS:                             # 512 bytes per tile, both copies
        srow = scol = 512 * bk * blocks_m
    elif dims == 1:
        srow, scol = bk * (total_rows + 3 * E), -(-k // 4) * 4 * blocks_m
    else:
        srow, scol = -(-bk // 4) * 4 * blocks_m, bk * (blocks_m + 3 * E)
    return _Sizes(total_rows, k * (total_rows + E * (align - 1)), srow, scol)


def plan_block_launches(m_splits: Sequence[int], k: int,
                        max_experts: int = MAX_EXPERTS_PER_LAUNCH) -> list[ChunkLaunch]:
    """Chunks of at most ``max_experts`` experts with their tile offsets; a chunk without tiles
    (only empty experts) has ``grid == 0`` and is not launched."""
    return list(_plan_cached(_launch.int_tuple(m_splits), k, max_experts))


@functools.lru_cache(maxsize=256)   # a training step repeats its splits per layer and pass
def _plan_cached(m_splits: tuple[int, ...], k: int, max_experts: int) -> tuple:
    return _launch.chunks_of_tiles(block_tile_counts(m_splits, k), max_experts)


def plan_block_launches_device(num_experts: int, total_rows: int, k: int,
                               max_experts: int = MAX_EXPERTS_PER_LAUNCH) -> list[ChunkLaunch]:
    """Chunks for counts that stay on the device; each grid is the worst case of its chunk,
    ``tiles_k * (ceil(rows / 128) + count)``, and surplus blocks exit at once."""
    tiles_k = -(-k // BLOCK)
    return _launch.device_chunks(num_experts, max_experts,
                                 lambda count: tiles_k * (-(-total_rows // BLOCK) + count))


# ---------------------------------------------------------------------------------------------
# Argument checks.

def check_block_options(fp8_format, block_scaling_dim, align, rowwise=True, columnwise=True,
                        column_sums=False) -> None:
    """The options of both block-scaled casts (``block_scaling_dim`` ``MX_DIMS``: MXFP8's op)."""
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"fp8_format: got {fp8_format!r}, expected one of {FP8_FORMATS}")
    if block_scaling_dim == MX_DIMS and type(block_scaling_dim) is int:
        pass
    elif block_scaling_dim not in (1, 2) or isinstance(block_scaling_dim, bool):
        raise ValueError(f"block_scaling_dim: expected 1 (1 x 128 blocks: activations, gradients) "
                         f"or 2 (128 x 128 blocks: weights), got {block_scaling_dim!r}")
    if align not in ALIGNS or isinstance(align, bool):
        raise ValueError(f"align: block scaling pads each expert to a divisor of {BLOCK}, one of "
                         f"{ALIGNS}; got {align!r}")
    for name, flag in (("rowwise", rowwise), ("columnwise", columnwise),
                       ("column_sums", column_sums)):
        _launch.check_bool(flag, name)
    if not (rowwise or columnwise):
        raise ValueError("rowwise, columnwise: at least one must be True")


def check_public_dims(block_scaling_dim) -> None:
    """``multi_block_cast_transpose`` takes 1 or 2; MXFP8 is its own op."""
    if block_scaling_dim == MX_DIMS and not isinstance(block_scaling_dim, bool):
        raise ValueError(f"block_scaling_dim: expected 1 or 2, got {block_scaling_dim!r} (MXFP8's "
                         "1 x 32 blocks: cugrouped.multi_mxfp8_cast_transpose)")


def check_out(g: GroupedInput, align: int, dims: int, rowwise: bool, columnwise: bool, out,
              column_sums: bool = False, fp8_format: str | None = None) -> None:
    """``out`` buffers (of ``fp8_format`` when given) against the inputs, before anything is
    launched or written."""
    check_out_kind(out, result_type(dims))
    if fp8_format is not None:
        check_out_format(out, fp8_format)
    sz = block_output_sizes(g.m_splits, g.k, align, dims, g.num_experts, g.total_rows)
    si = scale_dtype(dims).itemsize                   # E8M0 bytes or float32
    want = {"data": ((sz.rows, g.k), 1) if rowwise else None,
            "data_t": ((sz.data_t,), 1) if columnwise else None,
            "scale_inv": ((sz.scale_inv,), si) if rowwise else None,
            "scale_inv_t": ((sz.scale_inv_t,), si) if columnwise else None,
            "column_sums": ((g.num_experts, g.k), 4) if column_sums else None}
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
        if spec[1] == 4 and v.dtype != "float32":
            raise ValueError(f"out.{name}: expected float32, got {v.dtype}")
        if name.startswith("scale") and si == 1 and v.dtype != "uint8":
            raise ValueError(f"out.{name}: expected uint8 (E8M0 bytes), got {v.dtype}")
        if not is_contiguous(v):
            raise ValueError(f"out.{name}: must be contiguous, got strides {v.strides}")


# ---------------------------------------------------------------------------------------------
# The op.

def multi_block_cast_transpose(inputs, m_splits=None, *, fp8_format: str = "e4m3",
                               block_scaling_dim: int = 1, align: int = 16, rowwise: bool = True,
                               columnwise: bool = True, amax_epsilon: float = 0.0,
                               power_2_scale: bool = True, out=None, dtype: str | None = None,
                               splits_on_device: bool | None = None,
                               backend: str | None = None, row_index=None,
                               column_sums: bool = False,
                               activation: str | None = None) -> GroupedBlockFP8:
    """Pad, cast to block-scaled FP8 and transpose every expert's rows in one pass; return a
    :class:`~cugrouped.GroupedBlockFP8`.

    TransformerEngine's ``Float8BlockScaling`` (DeepSeek-V3's FP8 recipe): every block of 128
    elements of a row (``block_scaling_dim=1``; activations and gradients) or of 128 x 128
    elements (``2``; weights) gets the scale ``fp8_max / amax`` of its own amax, computed in the
    same pass that casts it: one launch per 64 experts, no amax pass, no host sync. The
    transposed copy has blocks of its own (1-D: 128 tokens of one feature), as the wgrad GEMM
    needs; the scales are stored in TransformerEngine's GEMM-ready layouts
    (:mod:`cugrouped.grouped_block_fp8`), which cuBLASLt's block scale modes read.

    ``inputs``, ``m_splits``, ``splits_on_device``, ``dtype``, ``backend``, ``rowwise``,
    ``columnwise``, ``fp8_format``: as :func:`cugrouped.multi_pad_cast_transpose`.
    ``align``: each expert's transposed copy is padded to ``roundup(m_i, align)`` columns; a
    divisor of 128 (16 for activations and gradients as in TransformerEngine, 1 for weights).
    ``amax_epsilon``, ``power_2_scale``: TransformerEngine's ``QParams``; the recipe's default
    is power-of-two scales (exact ``scale_inv``), so ``power_2_scale=True`` here.
    ``out``: a :class:`GroupedBlockFP8` of preallocated buffers (e.g. an earlier result of the
    same ``fp8_format``), written in place; it only lends its buffers (its own fields are not
    updated): the returned object describes this call, so read the result, not ``out``.
    ``row_index``: the fused MoE permute, as in :func:`cugrouped.multi_pad_cast_transpose`
    (expert ``i``'s rows are ``inputs[row_index[o_i : o_i + m_i]]``; a negative index is a zero
    row); the permuted copy is never written.
    ``column_sums``: also return each expert's float32 column sums of the unscaled input
    (``(E, k)``; dbias of a gradient), in the same pass and a fixed order (not with ``row_index``).
    ``activation``: ``"swiglu"`` casts ``silu(a) * b`` of each row's halves ``[a | b]`` (``2k``
    input columns, ``k`` output columns), as :func:`cugrouped.multi_pad_cast_transpose` does;
    the block scales are the activation's. 1-D blocks only; not with ``row_index`` or
    ``column_sums``.
    """
    check_public_dims(block_scaling_dim)
    first = inputs[0] if isinstance(inputs, (list, tuple)) and inputs else inputs
    if array_kind(first) == "torch":   # torch in, torch out (outputs from torch's allocator)
        from ..pytorch.functional import multi_block_cast_transpose as torch_op

        return torch_op(inputs, m_splits, fp8_format=fp8_format,
                        block_scaling_dim=block_scaling_dim, align=align, rowwise=rowwise,
                        columnwise=columnwise, amax_epsilon=amax_epsilon,
                        power_2_scale=power_2_scale, out=out, dtype=dtype,
                        splits_on_device=splits_on_device, backend=backend, row_index=row_index,
                        column_sums=column_sums, activation=activation)
    return block_cast_arrays(inputs, m_splits, fp8_format=fp8_format,
                             block_scaling_dim=block_scaling_dim, align=align, rowwise=rowwise,
                             columnwise=columnwise, amax_epsilon=amax_epsilon,
                             power_2_scale=power_2_scale, out=out, dtype=dtype,
                             splits_on_device=splits_on_device, backend=backend,
                             row_index=row_index, column_sums=column_sums, activation=activation)


def block_cast_arrays(inputs, m_splits=None, *, fp8_format="e4m3", block_scaling_dim=1, align=16,
                      rowwise=True, columnwise=True, amax_epsilon=0.0, power_2_scale=True,
                      out=None, dtype=None, splits_on_device=None, backend=None,
                      normalized: GroupedInput | None = None, row_index=None,
                      column_sums=False, activation=None) -> GroupedBlockFP8:
    """The op on arrays of any kind without the torch dispatch (NumPy / CuPy in and out; CUDA
    torch tensors through their pointers, all outputs given as ``out=``: the torch front, which
    passes the :func:`.pad_cast_transpose.normalized_input` it sized them from)."""
    check_block_options(fp8_format, block_scaling_dim, align, rowwise, columnwise, column_sums)
    if column_sums and row_index is not None:
        raise ValueError("column_sums: not with row_index (gradients are not gathered)")
    check_block_activation(activation, block_scaling_dim, column_sums, row_index is not None)
    if normalized is None:
        normalized = normalized_input(inputs, m_splits, dtype, splits_on_device, row_index,
                                      activation)
    g = normalized
    eps = _cast_inputs.check_scale_options(amax_epsilon, power_2_scale, None)
    if out is not None:
        check_out(g, align, block_scaling_dim, rowwise, columnwise, out, column_sums, fp8_format)
    backend = _launch.resolve_backend(backend, g.on_device)
    if backend == "reference":
        from ..reference.block_cast_transpose import multi_block_cast_transpose as ref

        if g.m_dev is not None:
            raise ValueError("splits_on_device: the reference backend takes host counts")
        return ref(inputs, m_splits, fp8_format=fp8_format, block_scaling_dim=block_scaling_dim,
                   align=align, rowwise=rowwise, columnwise=columnwise, amax_epsilon=amax_epsilon,
                   power_2_scale=power_2_scale, out=out, dtype=dtype, row_index=row_index,
                   column_sums=column_sums, activation=activation)
    xp = DeviceLikeHost if backend == "emulate" else __import__("cupy")
    if g.m_dev is not None:
        plans = plan_block_launches_device(g.num_experts, g.total_rows, g.k)
    else:
        plans = plan_block_launches(g.m_splits, g.k)
    with _launch.device_scope(backend, g.device):
        res = _outputs(g, xp, fp8_format, block_scaling_dim, align, rowwise, columnwise, out,
                       column_sums)
        gather = g.row_index is not None
        name = kernel_name(g.dtype, fp8_format, block_scaling_dim, gather, bool(column_sums),
                           activation)
        spec = ACT_KERNEL_SPEC if activation else GATHER_KERNEL_SPEC if gather else KERNEL_SPEC
        for chunk, arg in zip(plans, _packed_groups(g, res, plans, align, block_scaling_dim)):
            cs = res.column_sums[chunk.first:chunk.first + chunk.count] if column_sums else None
            if chunk.grid:
                _run(backend, spec, name, chunk, arg, g.k, align, eps, bool(power_2_scale), cs)
            elif cs is not None:       # only empty experts: no tile to write their zero sums
                cs[...] = 0
    if backend == "emulate" and res.data is not None:
        import ml_dtypes

        res.data = res.data.view(ml_dtypes.float8_e4m3fn if fp8_format == "e4m3"
                                 else ml_dtypes.float8_e5m2)
    return res


def _outputs(g: GroupedInput, xp, fp8_format, dims, align, rowwise, columnwise, out,
             column_sums=False) -> GroupedBlockFP8:
    sz = block_output_sizes(g.m_splits, g.k, align, dims, g.num_experts, g.total_rows)
    m_pad = padded_splits(g.m_splits, align) if g.m_splits is not None else None
    splits = g.m_splits if g.m_dev is None else g.m_dev.owner
    cls, sdt = result_type(dims), scale_dtype(dims)
    if out is not None:
        return cls(
            data=as_bytes(out.data) if rowwise else None,
            data_t=as_bytes(out.data_t) if columnwise else None,
            scale_inv=out.scale_inv if rowwise else None,
            scale_inv_t=out.scale_inv_t if columnwise else None,
            m_splits=splits, m_pad_splits=m_pad, fp8_format=fp8_format, k=g.k, align=align,
            block_scaling_dim=dims, column_sums=out.column_sums if column_sums else None,
            total_rows=g.total_rows)
    return cls(
        data=xp.empty((sz.rows, g.k), dtype=np.uint8) if rowwise else None,
        data_t=xp.empty((sz.data_t,), dtype=np.uint8) if columnwise else None,
        scale_inv=xp.empty((sz.scale_inv,), dtype=sdt) if rowwise else None,
        scale_inv_t=xp.empty((sz.scale_inv_t,), dtype=sdt) if columnwise else None,
        m_splits=splits, m_pad_splits=m_pad, fp8_format=fp8_format, k=g.k, align=align,
        block_scaling_dim=dims,
        column_sums=xp.empty((g.num_experts, g.k), dtype=np.float32) if column_sums else None,
        total_rows=g.total_rows)


_PACKED = _launch.ArgMemo(64)


def _packed_groups(g: GroupedInput, res: GroupedBlockFP8, plans, align: int, dims: int) -> list:
    """:func:`_pack_groups`, remembered per argument values (every value written into them)."""
    bufs = tuple(data_ptr(b) for b in (res.data, res.data_t, res.scale_inv, res.scale_inv_t))
    gather = (g.row_index.ptr, g.src_rows) if g.row_index is not None else None
    if g.m_dev is not None:
        key = ("dev", g.num_experts, g.k, align, dims, g.base.ptr, row_stride(g.base),
               g.m_dev.ptr, g.total_rows, bufs, gather)
    else:
        key = (g.m_splits, g.k, align, dims, g.ptrs.tobytes(), g.lds.tobytes(), bufs, gather)
    return _PACKED.get(key, lambda: _pack_groups(g, bufs, plans, align, dims))


def _pack_groups(g: GroupedInput, bufs: tuple, plans, align: int, dims: int) -> list:
    """The by-value argument block of every chunk (pointers, sizes, tile offsets), vectorised."""
    dt = group_dtype()
    data, data_t, sinv, sinv_t = bufs
    args = []
    if g.m_dev is not None:    # the blocks derive the per-expert fields from the device counts
        for chunk in plans:
            arg = np.zeros((), dtype=dt)
            arg["num_experts"] = chunk.count
            arg["in"][0], arg["ld"][0] = g.base.ptr, row_stride(g.base)
            arg["out_row"][0], arg["out_col"][0] = data, data_t
            arg["sinv_row"][0], arg["sinv_col"][0] = sinv, sinv_t
            arg["first_expert"], arg["m_dev"], arg["total_rows"] = chunk.first, g.m_dev.ptr, g.total_rows
            if g.row_index is not None:
                arg["row_index"], arg["src_rows"] = g.row_index.ptr, g.src_rows
            args.append(arg)
        return args
    m = np.asarray(g.m_splits, dtype=np.int64)
    mp = np.asarray(padded_splits(g.m_splits, align), dtype=np.int64)
    srow, scol = block_scale_sizes(g.m_splits, mp, g.k, dims)
    out_row = _launch.pointer_offsets(data, m * g.k, 1, g.ptrs)
    out_col = _launch.pointer_offsets(data_t, mp * g.k, 1, g.ptrs)
    si = scale_dtype(dims).itemsize                   # E8M0 bytes or float32
    sinv_row = _launch.pointer_offsets(sinv, srow, si, g.ptrs)
    sinv_col = _launch.pointer_offsets(sinv_t, scol, si, g.ptrs)

    def gather(chunk) -> dict:   # the chunk's first index; the blocks add the counts
        if g.row_index is None:
            return {}
        return {"row_index": g.row_index.ptr, "src_rows": g.src_rows,
                "row_first0": int(m[: chunk.first].sum())}

    return _launch.pack_chunks(
        dt, plans, {"in": g.ptrs, "ld": g.lds, "m": m, "out_row": out_row, "out_col": out_col,
                    "sinv_row": sinv_row, "sinv_col": sinv_col}, gather)


def cuda_arguments(arg, k: int, align: int, eps: float, power_2_scale: bool,
                   colsum=None, grid: int = 0) -> tuple:
    """``(BctGroup g, i64 k, i32 align, float amax_epsilon, i32 power_2_scale, float* colsum,
    float* colsum_partial, int* colsum_count)``; the column sums' partial rows and counters
    are per-stream scratch and workspace (:mod:`._launch`), never allocated per call."""
    if colsum is not None:
        tiles_k = -(-k // BLOCK)
        count = _launch.device_workspace("block_cast_transpose.colsum",
                                         MAX_EXPERTS_PER_LAUNCH * tiles_k)
        partial = _launch.device_scratch("block_cast_transpose.partial", 4 * grid * BLOCK)
        ptrs = (colsum, partial, count)
    else:
        ptrs = (None, None, None)
    return (_launch.by_value(arg), np.int64(k), np.int32(align), np.float32(eps),
            np.int32(power_2_scale)) + tuple(np.uint64(data_ptr(a)) for a in ptrs)


def _run(backend, spec, name, chunk: ChunkLaunch, arg, k, align, eps, power_2_scale,
         colsum=None) -> None:
    _launch.note_launch(backend, name, chunk.grid, THREADS)
    if backend == "cuda":
        args = cuda_arguments(arg, k, align, eps, power_2_scale, colsum, chunk.grid)
        _jit.get_function(spec, name)((chunk.grid,), (THREADS,), args)
        return
    # host buffers, made per launch and checked after it
    tiles_k = -(-k // BLOCK)
    count = np.zeros(chunk.count * tiles_k, np.int32) if colsum is not None else None
    partial = DeviceLikeHost.empty(chunk.grid * BLOCK, np.float32) if colsum is not None else None
    args = (arg, np.int64(k), np.int32(align), np.float32(eps), np.int32(power_2_scale)) + tuple(
        np.uint64(0) if a is None else a for a in (colsum, partial, count))
    _jit.get_emulated_function(spec, name)(
        (chunk.grid,), (THREADS,), args, order=_launch.current_emulation_order())
    if count is not None and count.any():
        raise RuntimeError("block_cast_transpose kernel left its column-sum counters non-zero "
                           "(kernel bug)")
