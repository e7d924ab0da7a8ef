"""The framework-neutral ops called with torch tensors: same signature, torch tensors back.

``cugrouped.multi_pad_cast_transpose(torch_tensors, ...)`` lands here. Every output is allocated by
torch (its caching allocator on the GPU) and handed to the op as an ``out=`` buffer through a
zero-copy view (:mod:`._adapters`); the kernels run on ``torch.cuda.current_stream()``. CPU tensors
run the reference backend by default (or ``backend="emulate"``); a CUDA ``m_splits`` tensor is read
by the kernel itself (no host sync), a CPU one becomes a host list.
"""

from __future__ import annotations

import dataclasses

import torch

from ..grouped_block_fp8 import MX_DIMS, GroupedBlockFP8, GroupedMXFP8, result_type, scale_dtype
from ..grouped_fp8 import GroupedFP8, GroupedSplits
from ..ops import _cast_inputs
from ..ops import block_cast_transpose as _bct
from ..ops import pad_cast_transpose as _pct
from ._adapters import FP8_TORCH_DTYPES, TORCH_DTYPES, launch_context, to_array

__all__ = ["multi_pad_cast_transpose", "multi_block_cast_transpose", "multi_mxfp8_cast_transpose",
           "grouped_gemm"]

def _arr(t):
    """Zero-copy NumPy view of a CPU tensor (1-byte tensors as uint8 bytes), or None."""
    if t is None:
        return None
    return to_array(_bytes(t))[0]


def multi_pad_cast_transpose(inputs, m_splits=None, *, fp8_format="e4m3", scale=None, margin=0,
                             align=16, rowwise=True, columnwise=True, column_sums=False, out=None,
                             dtype=None, splits_on_device=None, backend=None,
                             amax_accumulate=False, amax_epsilon=0.0,
                             power_2_scale=False, row_index=None, activation=None) -> GroupedFP8:
    """:func:`cugrouped.multi_pad_cast_transpose` for torch tensors; returns torch tensors
    (``data`` as ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, ``data_t`` as ``uint8`` bytes).

    CUDA tensors go to the op as they are (it reads their pointers: no DLPack round trip per
    tensor); CPU tensors as zero-copy NumPy views, for the reference or emulated backends."""
    _pct.check_options(fp8_format, margin, align, rowwise, columnwise,   # before any sizing
                       column_sums)
    _pct.check_out_kind(out, GroupedFP8)
    _pct.check_amax_accumulate(amax_accumulate, scale, out)   # it merges into out.amax
    _cast_inputs.check_scale_options(amax_epsilon, power_2_scale, scale)
    _pct.check_activation(activation, column_sums, row_index is not None)
    dev, xs, tag, conv, splits = _torch_inputs(inputs, m_splits, dtype, splits_on_device)
    if isinstance(row_index, torch.Tensor) and dev.type != "cuda":
        row_index = to_array(row_index)[0]          # a zero-copy view, as the inputs
    # Checks and sizes first: bad input raises before anything is allocated or launched.
    g = _pct.normalized_input(xs, splits, tag, splits_on_device, row_index, activation)
    rows, col_bytes = _pct.output_sizes(g, align)
    E, k = g.num_experts, g.k
    # a given scale's kind is checked here; its dtype, shape and device by the op
    if scale is not None and not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale: expected a contiguous float32 torch tensor of shape ({E},) on "
                        f"the inputs' device, got {type(scale).__name__}")
    if out is None:
        f32 = dict(dtype=torch.float32, device=dev)
        out = GroupedFP8(
            data=torch.empty((rows, k), dtype=torch.uint8, device=dev) if rowwise else None,
            data_t=torch.empty((col_bytes,), dtype=torch.uint8, device=dev) if columnwise else None,
            m_splits=(), m_pad_splits=(), amax=torch.empty(E, **f32),
            scale=torch.empty(E, **f32) if scale is None else scale,
            scale_inv=torch.empty(E, **f32), fp8_format=fp8_format, k=k, align=align,
            column_sums=torch.empty((E, k), **f32) if column_sums else None)
    views = dataclasses.replace(out, **{f: conv(getattr(out, f)) for f in GroupedFP8._BUFFERS})
    with launch_context(dev):
        res = _pct.cast_arrays(
            xs, splits, fp8_format=fp8_format, scale=conv(scale), margin=margin, align=align,
            rowwise=rowwise, columnwise=columnwise, column_sums=column_sums, out=views, dtype=tag,
            splits_on_device=splits_on_device, backend=backend, normalized=g,
            amax_accumulate=amax_accumulate, amax_epsilon=amax_epsilon,
            power_2_scale=power_2_scale, row_index=row_index, activation=activation)
    return dataclasses.replace(
        res,
        data=out.data.view(torch.uint8).view(FP8_TORCH_DTYPES[fp8_format]) if rowwise else None,
        data_t=out.data_t.view(torch.uint8) if columnwise else None,
        m_splits=res.m_splits if res.m_pad_splits is not None else m_splits,
        amax=out.amax, scale=scale if scale is not None else out.scale, scale_inv=out.scale_inv,
        column_sums=out.column_sums if column_sums else None)


def _torch_inputs(inputs, m_splits, dtype, splits_on_device):
    """What the array ops take for torch ``inputs``: ``(device, inputs, dtype tag, converter of
    buffers, m_splits)``. CUDA tensors go as they are (the ops read their pointers: no DLPack
    round trip per tensor); CPU tensors as zero-copy NumPy views. A CUDA ``m_splits`` tensor is
    read by the kernel (no host sync; refused with ``splits_on_device=False``, which would read
    it back); a CPU one becomes a host list."""
    tensors = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    if not tensors:
        raise ValueError("inputs: expected at least one expert, got an empty sequence")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"inputs[{i}]: expected a torch.Tensor like inputs[0], got "
                            f"{type(t).__name__} (one array kind per call)")
    dev = tensors[0].device
    if dev.type == "cuda":
        xs, tag, conv = inputs, dtype, _bytes       # tensors as they are (FP8 as bytes)
    else:
        arrays = [to_array(t) for t in tensors]
        tag = dtype or arrays[0][1]
        xs = [a for a, _ in arrays] if isinstance(inputs, (list, tuple)) else arrays[0][0]
        conv = _arr
    splits = m_splits
    if isinstance(m_splits, torch.Tensor):
        if m_splits.device.type == "cuda":
            if splits_on_device is False:      # reading it here would be a hidden host sync
                raise TypeError("m_splits: a CUDA tensor was given with splits_on_device=False; "
                                "pass a host sequence of ints (or a CPU tensor), or leave "
                                "splits_on_device=None to let the kernel read it")
            splits = m_splits                               # read by the kernel: no host sync
        else:                                               # a CPU tensor: no device sync
            dt = m_splits.dtype
            _cast_inputs.check_count_array(
                m_splits.dim(), not (dt.is_floating_point or dt.is_complex or dt == torch.bool),
                f"a {dt} tensor of shape {tuple(m_splits.shape)}")
            splits = [int(v) for v in m_splits.tolist()]
    return dev, xs, tag, conv, splits


def multi_block_cast_transpose(inputs, m_splits=None, *, fp8_format="e4m3", block_scaling_dim=1,
                               align=16, rowwise=True, columnwise=True, amax_epsilon=0.0,
                               power_2_scale=True, out=None, dtype=None, splits_on_device=None,
                               backend=None, row_index=None, column_sums=False,
                               activation=None) -> GroupedBlockFP8:
    """:func:`cugrouped.multi_block_cast_transpose` for torch tensors; returns torch tensors
    (``data`` as ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, ``data_t`` as ``uint8`` bytes,
    the scales float32), all allocated by torch, computed on its current stream."""
    _bct.check_public_dims(block_scaling_dim)
    return _block_cast(inputs, m_splits, fp8_format=fp8_format, block_scaling_dim=block_scaling_dim,
                       align=align, rowwise=rowwise, columnwise=columnwise,
                       amax_epsilon=amax_epsilon, power_2_scale=power_2_scale, out=out,
                       dtype=dtype, splits_on_device=splits_on_device, backend=backend,
                       row_index=row_index, column_sums=column_sums, activation=activation)


def multi_mxfp8_cast_transpose(inputs, m_splits=None, *, fp8_format="e4m3", align=32,
                               rowwise=True, columnwise=True, out=None, dtype=None,
                               splits_on_device=None, backend=None, row_index=None,
                               column_sums=False, activation=None) -> GroupedMXFP8:
    """:func:`cugrouped.multi_mxfp8_cast_transpose` for torch tensors: as
    :func:`multi_block_cast_transpose`, the E8M0 scales as ``uint8`` tensors."""
    return _block_cast(inputs, m_splits, fp8_format=fp8_format, block_scaling_dim=MX_DIMS,
                       align=align, rowwise=rowwise, columnwise=columnwise, out=out, dtype=dtype,
                       splits_on_device=splits_on_device, backend=backend, row_index=row_index,
                       column_sums=column_sums, activation=activation)


def _block_cast(inputs, m_splits=None, *, fp8_format, block_scaling_dim, align, rowwise=True,
                columnwise=True, amax_epsilon=0.0, power_2_scale=True, out=None, dtype=None,
                splits_on_device=None, backend=None, row_index=None, column_sums=False,
                activation=None):
    """Both block-scaled casts on torch tensors (``block_scaling_dim`` 1, 2 or ``MX_DIMS``)."""
    _bct.check_block_options(fp8_format, block_scaling_dim, align, rowwise, columnwise,
                             column_sums)
    _cast_inputs.check_scale_options(amax_epsilon, power_2_scale, None)
    _pct.check_out_kind(out, result_type(block_scaling_dim))
    _bct.check_block_activation(activation, block_scaling_dim, column_sums, row_index is not None)
    dev, xs, tag, conv, splits = _torch_inputs(inputs, m_splits, dtype, splits_on_device)
    if isinstance(row_index, torch.Tensor) and dev.type != "cuda":
        row_index = to_array(row_index)[0]          # a zero-copy view, as the inputs
    g = _pct.normalized_input(xs, splits, tag, splits_on_device, row_index, activation)
    if out is None:
        sz = _bct.block_output_sizes(g.m_splits, g.k, align, block_scaling_dim, g.num_experts,
                                     g.total_rows)
        u8, f32 = dict(dtype=torch.uint8, device=dev), dict(dtype=torch.float32, device=dev)
        sdt = dict(dtype=getattr(torch, scale_dtype(block_scaling_dim).name), device=dev)
        out = result_type(block_scaling_dim)(
            data=torch.empty((sz.rows, g.k), **u8) if rowwise else None,
            data_t=torch.empty((sz.data_t,), **u8) if columnwise else None,
            scale_inv=torch.empty((sz.scale_inv,), **sdt) if rowwise else None,
            scale_inv_t=torch.empty((sz.scale_inv_t,), **sdt) if columnwise else None,
            m_splits=(), m_pad_splits=(), fp8_format=fp8_format, k=g.k, align=align,
            block_scaling_dim=block_scaling_dim,
            column_sums=torch.empty((g.num_experts, g.k), **f32) if column_sums else None)
    views = dataclasses.replace(out, **{f: conv(getattr(out, f)) for f in out._BUFFERS})
    with launch_context(dev):
        res = _bct.block_cast_arrays(
            xs, splits, fp8_format=fp8_format, block_scaling_dim=block_scaling_dim, align=align,
            rowwise=rowwise, columnwise=columnwise, amax_epsilon=amax_epsilon,
            power_2_scale=power_2_scale, out=views, dtype=tag, splits_on_device=splits_on_device,
            backend=backend, normalized=g, row_index=row_index, column_sums=column_sums,
            activation=activation)
    return dataclasses.replace(
        res,
        data=out.data.view(torch.uint8).view(FP8_TORCH_DTYPES[fp8_format]) if rowwise else None,
        data_t=out.data_t.view(torch.uint8) if columnwise else None,
        scale_inv=out.scale_inv if rowwise else None,
        scale_inv_t=out.scale_inv_t if columnwise else None,
        column_sums=out.column_sums if column_sums else None,
        m_splits=res.m_splits if res.m_pad_splits is not None else m_splits)


def _bytes(t):
    """1-byte tensors (FP8 data) as their uint8 bytes; anything else as it is."""
    if isinstance(t, torch.Tensor) and t.element_size() == 1 and t.dtype != torch.uint8:
        return t.view(torch.uint8)
    return t


# ---------------------------------------------------------------------------------------------
# The grouped GEMMs on torch tensors.

def grouped_gemm(call, out, backend, path, run):
    """``cugrouped.grouped_fprop/dgrad/wgrad`` with torch operands (called by the ops once the
    arguments are checked): torch tensors back. CUDA: the output, when not given, comes from
    torch's allocator and the GEMMs run on ``torch.cuda.current_stream()``; the operands are
    read through their pointers (``run`` is the ops' array path). CPU: the NumPy twin on
    zero-copy views of the tensors."""
    problem = call.problem
    on_device, device, _ = problem.place
    if not on_device:
        from .. import ops

        op = getattr(ops, f"grouped_{problem.pass_name}")
        args = [_host_view(a) for a in call.args]
        kwargs = {k: _host_view(v) for k, v in call.kwargs.items()}
        res = op(*args, out=_host_view(out), backend=backend, path=path, **kwargs)
        return out if out is not None else _from_host(res)
    if out is None:
        out = _new_gemm_output(problem, _gemm_device(problem))
    with launch_context(_gemm_device(problem)):
        run(call, out, backend, path)
    return out


def _gemm_device(problem) -> torch.device:
    return torch.device("cuda", problem.place[1])


def _new_gemm_output(problem, device) -> torch.Tensor:
    from ..ops._gemm_checks import _ACCUMULATE_NEEDS_OUT, _out_shape

    if problem.pass_name == "wgrad" and problem.accumulate:
        raise ValueError(_ACCUMULATE_NEEDS_OUT)
    return torch.empty(_out_shape(problem), dtype=TORCH_DTYPES[problem.out_dtype], device=device)


def _host_view(a):
    """Torch CPU tensors (alone, in lists, in a cast's result) as zero-copy NumPy views."""
    if isinstance(a, torch.Tensor):
        return _arr(a)
    if isinstance(a, GroupedSplits):        # every cast's result: its array fields
        return dataclasses.replace(a, **{f: _host_view(getattr(a, f)) for f in a._BUFFERS})
    if isinstance(a, (list, tuple)):
        return type(a)(_host_view(v) for v in a)
    return a


def _from_host(a) -> torch.Tensor:
    """A NumPy result as a torch tensor over the same memory (bfloat16 restored)."""
    import ml_dtypes
    import numpy as np

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
