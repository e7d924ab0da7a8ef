"""The cugrouped ops as ``torch.library`` custom ops, with fake implementations.

torch.compile cannot trace into NumPy / CuPy / cuBLASLt calls; as custom ops with fake (shape
only) implementations they are opaque nodes of the graph, so ``torch.compile(layer,
fullgraph=True)`` traces the whole layer, forward and backward. Every output is allocated here by
torch and handed to the op as an ``out=`` buffer.

Backends: CUDA tensors run ``"cuda"`` (kernels via NVRTC, GEMMs via cuBLASLt) on
``torch.cuda.current_stream()``. CPU tensors run the casts and the scale update with
``cast_backend`` (``"emulate"``: the CUDA kernels on the CPU emulator, bit-exact; or
``"reference"``: their NumPy twins, same bits, faster) and the GEMMs with ``"reference"``.
CUDA tensors reach the cast and GEMM ops as they are (read through their pointers); CPU tensors
as zero-copy NumPy views.

Token counts ``m_splits`` are host ints: the per-expert GEMM loop needs them on the host.
"""

from __future__ import annotations

import types
from typing import List, Optional  # noqa: UP035  (torch.library's schema inference reads them)

import torch

from .. import ops as _ops
from ..grouped_block_fp8 import MX_DIMS, block_scale_entries, result_type, scale_dtype
from ..grouped_fp8 import GroupedFP8
from ..ops import _cast_inputs, _gemm_direct
from ..ops import pad_cast_transpose as _pct
from ..ops._gemm_checks import FP8_MULTIPLE, FP8_PAIRS
from ..ops.grouped_gemm import bias_dtype_for
from ..ops.scale_update import update_scales
from ..ops.scatter_rows import scatter_rows as _scatter_rows
from . import functional as _functional
from ._adapters import dtype_name, launch_context, to_array

__all__ = ["eager", "fp8_quantize", "fp8_block_quantize", "fp8_fprop", "fp8_dgrad", "fp8_wgrad", "fp8_wgrad_main_grad",
           "wgrad_main_grad", "scatter_rows_sum",
           "scale_update",
           "padded", "fused_bias_dtype", "token_align"]


_OPS: dict[str, tuple] = {}     # name -> (custom op, its Python body)


def _custom_op(name: str, mutates_args):
    """``torch.library.custom_op("cugrouped::<name>")``, remembering the undecorated body for
    :data:`eager`."""
    def deco(fn):
        op = torch.library.custom_op(f"cugrouped::{name}", mutates_args=mutates_args)(fn)
        _OPS[name] = (op, fn)
        return op
    return deco


def _tracing() -> bool:
    """True while torch.compile traces, or under any dispatch mode (fake tensors, make_fx,
    FlopCounterMode...): then the ops must be the opaque custom ops."""
    return torch.compiler.is_compiling() or _dispatch_stack_len() > 0


_dispatch_stack_len = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)


def _choose(name: str):
    op, fn = _OPS[name]

    def call(*args, **kwargs):
        return (op if _tracing() else fn)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = fn.__doc__
    return call


def padded(m: int, align: int) -> int:
    return -(-m // align) * align


def fused_bias_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The bias dtype cuBLASLt's FP8 bias epilogue takes for an ``out_dtype`` output."""
    return getattr(torch, bias_dtype_for(dtype_name(out_dtype), True))


def _backend(t: torch.Tensor, cpu_backend: str) -> str:
    return "cuda" if t.device.type == "cuda" else cpu_backend


def _arr(t):
    return to_array(t)[0]


def _same(t):
    return t


def _gemm_backend(t: torch.Tensor) -> str:
    return "cuda" if t.is_cuda else "reference"


def _gemm_view(backend: str):
    """How a tensor reaches the GEMM ops: CUDA tensors as they are (the ops read their pointers,
    shapes, strides and dtypes: no DLPack round trip per tensor, and the ops' per-call memo keys
    them), CPU tensors as zero-copy NumPy views (the reference backend computes on NumPy)."""
    return _same if backend == "cuda" else _arr


# The per-tensor FP8 cast on CUDA launches straight from its inputs' normalization
# (pad_cast_transpose.launch_cast): this op allocated every output itself, so the public op's
# output checks would only confirm them. False: through the public op (tests compare the two).
DIRECT_CASTS = True


def _vector(t: torch.Tensor | None, num: int, device: torch.device) -> bool:
    """None, or a contiguous float32 ``(num,)`` tensor on ``device`` (a state slice the direct
    cast may write)."""
    return t is None or (t.dtype == torch.float32 and t.shape == (num,) and t.is_contiguous()
                         and t.device == device)


# The per-tensor FP8 GEMMs on CUDA take the direct route (cugrouped.ops._gemm_direct): these ops
# made or allocated every operand and output themselves, so the public ops' argument checks
# (about half of a call's host time, new at every MoE step) would only confirm them. False:
# through the public ops, checks included (tests compare the two).
DIRECT_GEMMS = True


# What the direct GEMM route relies on, confirmed per call in O(1) tensor reads (and one pass
# over the counts): these ops are reachable as torch.ops.cugrouped.* too, and a caller other
# than the layer gets the public checks' error for anything else (the checked route raises it).
_GEMM_OUT = (torch.bfloat16, torch.float16, torch.float32)


def _fp8_bytes(t, device, shape=None, numel=None) -> bool:
    return (t.device == device and t.element_size() == 1 and t.is_contiguous()
            and (shape is None or t.shape == shape) and (numel is None or t.numel() == numel))


def _scales_ok(t, device, num: int) -> bool:
    return t.device == device and t.dtype == torch.float32 and t.shape == (num,) and (
        num <= 1 or t.stride(0) >= 1)


def _counts_ok(m_splits, k: int, n: int) -> bool:
    return len(m_splits) > 0 and min(m_splits) >= 0 and k > 0 and n > 0 and \
        not k % FP8_MULTIPLE and not n % FP8_MULTIPLE


def _direct_fprop_ok(y, x, x_si, x_format, w, w_si, w_format, bias, m_splits) -> bool:
    E, dev = len(m_splits), x.device
    if x.dim() != 2 or w.dim() != 2 or not E or w.shape[0] % E:
        return False
    k, n = x.shape[1], w.shape[0] // E
    rows = sum(m_splits)
    return (_counts_ok(m_splits, k, n) and (x_format, w_format) in FP8_PAIRS
            and _fp8_bytes(x, dev, (rows, k)) and _fp8_bytes(w, dev, (E * n, k))
            and _scales_ok(x_si, dev, E) and _scales_ok(w_si, dev, E)
            and y.dtype in _GEMM_OUT and y.device == dev and y.shape == (rows, n)
            and y.is_contiguous()
            and (not bias or (len(bias) == E and all(
                b.dtype == fused_bias_dtype(y.dtype) and b.device == dev and b.shape == (n,)
                and b.is_contiguous() for b in bias))))


def _direct_dgrad_ok(dx, dy, dy_si, dy_format, w_t, w_si, w_format, k, m_splits) -> bool:
    E, dev = len(m_splits), dy.device
    if dy.dim() != 2:
        return False
    n, rows = dy.shape[1], sum(m_splits)
    return (_counts_ok(m_splits, k, n) and (dy_format, w_format) in FP8_PAIRS
            and _fp8_bytes(dy, dev, (rows, n)) and _fp8_bytes(w_t, dev, numel=E * k * n)
            and _scales_ok(dy_si, dev, E) and _scales_ok(w_si, dev, E)
            and dx.dtype in _GEMM_OUT and dx.device == dev and dx.shape == (rows, k)
            and dx.is_contiguous())


def _direct_wgrad_ok(x_t, x_si, x_format, dy_t, dy_si, dy_format, k, n, m_splits, out,
                     out_dtype) -> bool:
    E, dev = len(m_splits), x_t.device
    if not _counts_ok(m_splits, k, n) or (x_format, dy_format) not in FP8_PAIRS:
        return False
    cols = sum(padded(m, token_align(0)) for m in m_splits)
    want = getattr(torch, out_dtype, None)
    outs = list(out) if isinstance(out, (list, tuple)) else None
    return (_fp8_bytes(x_t, dev, numel=k * cols) and _fp8_bytes(dy_t, dev, numel=n * cols)
            and _scales_ok(x_si, dev, E) and _scales_ok(dy_si, dev, E) and want in _GEMM_OUT
            and (all(g.dtype == want and g.device == dev and g.shape == (n, k)
                     and g.is_contiguous() for g in outs) and len(outs) == E
                 if outs is not None else
                 out.dtype == want and out.device == dev and out.shape == (E, n, k)
                 and out.is_contiguous()))


def _index(device: torch.device) -> int:
    return device.index or 0


def _scales(scale_inv: torch.Tensor) -> tuple[int, int]:
    """A float32 ``(E,)`` scale_inv tensor as :mod:`~cugrouped.ops._gemm_direct` takes it."""
    return scale_inv.data_ptr(), scale_inv.stride(0)


def _direct(device: torch.device, pass_name: str, *args) -> None:
    """The :mod:`~cugrouped.ops._gemm_direct` GEMM ``pass_name`` of ``args`` (its builder's
    arguments but the device) on ``device``'s current torch stream."""
    with launch_context(device):
        _gemm_direct.run(pass_name, *args, _index(device))


def token_align(block: int = 0) -> int:
    """The token padding of the transposed copies (the wgrad GEMM reduces over it): 16, or 32
    for MXFP8 (a whole E8M0 scale block, as TransformerEngine pads MoE tokens for it)."""
    return 32 if block == MX_DIMS else 16


def _grouped(data, data_t, scale_inv, m_splits, k, fmt, align, conv, block: int = 0):
    """A GroupedFP8 over torch buffers (for the GEMMs: only the fields they read); with
    ``block`` (1, 2, or MX_DIMS: MXFP8) a GroupedBlockFP8 (GroupedMXFP8) whose ``scale_inv`` is
    the block scales of the one copy given (row-wise ``data`` or transposed ``data_t``);
    ``align``: the tokens' (:func:`token_align`) or a weight's 1."""
    if block:
        m_pad = tuple(padded(m, align) for m in m_splits)
        rowwise = data is not None
        return result_type(block)(data=conv(data) if rowwise else None,
                               data_t=None if rowwise else conv(data_t),
                               scale_inv=conv(scale_inv) if rowwise else None,
                               scale_inv_t=None if rowwise else conv(scale_inv),
                               m_splits=tuple(m_splits), m_pad_splits=m_pad, fp8_format=fmt, k=k,
                               align=align, block_scaling_dim=block)
    return GroupedFP8(data=None if data is None else conv(data),
                      data_t=None if data_t is None else conv(data_t),
                      m_splits=tuple(m_splits), m_pad_splits=tuple(padded(m, align) for m in m_splits),
                      amax=None, scale=None, scale_inv=conv(scale_inv), fp8_format=fmt, k=k,
                      align=align)


# ---------------------------------------------------------------------------------------------
# Cast: pad + FP8 cast + transpose (+ amax, + column sums) of all experts, one op.

def _quantize_shapes(xs, align, rowwise, columnwise, column_sums, m_splits=None,
                     activation=None):
    """Output shapes; ``m_splits`` (one tensor split, or a gather) gives the experts' rows
    instead of ``xs``; a gated ``activation`` halves the width."""
    k = xs[0].shape[1] // 2 if activation is not None else xs[0].shape[1]
    counts = list(m_splits) if m_splits is not None else [x.shape[0] for x in xs]
    rows = sum(counts)
    col_bytes = k * sum(padded(m, align) for m in counts)
    E = len(counts)
    return ((rows if rowwise else 0, k), (col_bytes if columnwise else 0,), (E,),
            (E if column_sums else 0, k))


@_custom_op("fp8_quantize", mutates_args=("amax_out",))
def fp8_quantize(xs: List[torch.Tensor], fp8_format: str, margin: int, align: int, rowwise: bool,
                 columnwise: bool, column_sums: bool, scale: Optional[torch.Tensor],
                 amax_out: Optional[torch.Tensor], offset: int, cast_backend: str,
                 accumulate_amax: bool = False, amax_epsilon: float = 0.0,
                 power_2_scale: bool = False, row_index: Optional[torch.Tensor] = None,
                 m_splits: Optional[List[int]] = None, activation: Optional[str] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``multi_pad_cast_transpose`` of the experts ``xs`` (2-D, one dtype, one k).

    ``scale`` (float32, ``offset + E`` or more entries) given: delayed scaling with
    ``scale[offset:offset+E]``; None: current scaling. ``amax_out`` given: the experts' amaxes are
    written to ``amax_out[offset:offset+E]``, or with ``accumulate_amax`` max-merged into it (the
    pending amax of forwards that run before their backwards, as in pipeline schedules; the scale
    update zeroes it) by the cast kernel itself (``amax_accumulate``, no extra launch; delayed
    scaling only). ``amax_epsilon``, ``power_2_scale``: current scaling's options (QParams).
    ``m_splits`` given: ``xs`` is one ``(Σm, k)`` tensor, ``[x]``, whose experts' rows are
    ``m_splits`` each (no per-expert views made or read); with ``row_index`` (the fused
    permute) ``xs`` is ``[tokens]`` and the experts' rows are ``tokens[row_index]``, ``m_splits``
    each. ``activation`` (``"swiglu"``): cast the activation of each row's halves ``[a | b]``
    (``xs`` have twice the output's columns).
    Returns ``(data (Σm, k) uint8 or (0, k), data_t (bytes,) uint8 or (0,),
    scale_inv (E,), column_sums (E, k) or (0, k))``.
    """
    single = m_splits is not None
    E = len(m_splits) if single else len(xs)
    dev = xs[0].device
    s_data, s_t, s_e, s_cs = _quantize_shapes(xs, align, rowwise, columnwise, column_sums,
                                              m_splits, activation)
    data = torch.empty(s_data, dtype=torch.uint8, device=dev)
    data_t = torch.empty(s_t, dtype=torch.uint8, device=dev)
    scale_inv = torch.empty(s_e, dtype=torch.float32, device=dev)
    colsum = torch.empty(s_cs, dtype=torch.float32, device=dev)
    sc = scale[offset:offset + E] if scale is not None else None
    merge = accumulate_amax and amax_out is not None
    if merge and sc is None:
        raise ValueError("accumulate_amax: merging into a pending amax needs a given scale "
                         "(delayed scaling)")
    amax = amax_out[offset:offset + E] if amax_out is not None else \
        torch.empty(s_e, dtype=torch.float32, device=dev)
    scale_buf = sc if sc is not None else torch.empty(s_e, dtype=torch.float32, device=dev)
    out = GroupedFP8(data=data if rowwise else None, data_t=data_t if columnwise else None,
                     m_splits=(), m_pad_splits=(), amax=amax, scale=scale_buf, scale_inv=scale_inv,
                     fp8_format=fp8_format, k=s_data[1], align=align,
                     column_sums=colsum if column_sums else None)
    backend = _backend(xs[0], cast_backend)
    if backend == "cuda" and DIRECT_CASTS and _vector(sc, E, dev) and _vector(amax, E, dev):
        # every output made here, the state slices checked above: the inputs normalized (and
        # checked) and the options checked, then straight to the launches
        _pct.check_options(fp8_format, margin, align, rowwise, columnwise, column_sums)
        eps = _cast_inputs.check_scale_options(amax_epsilon, power_2_scale, sc)
        g = _pct.normalized_input(xs[0] if single else list(xs),
                                  list(m_splits) if single else None, None, None, row_index,
                                  activation)
        with launch_context(dev):
            _pct.launch_cast("cuda", g, out, fp8_format, align, sc is not None,
                             (margin, eps, bool(power_2_scale)), column_sums, merge, activation)
        return data, data_t, scale_inv, colsum
    # the torch front of the op: zero-copy views of these buffers, torch's current stream
    _functional.multi_pad_cast_transpose(
        xs[0] if single else list(xs), list(m_splits) if single else None, fp8_format=fp8_format,
        scale=sc, margin=margin, align=align, rowwise=rowwise,
        columnwise=columnwise, column_sums=column_sums, out=out,
        backend=backend, amax_accumulate=merge, amax_epsilon=amax_epsilon,
        power_2_scale=power_2_scale, row_index=row_index, activation=activation)
    return data, data_t, scale_inv, colsum


@fp8_quantize.register_fake
def _(xs, fp8_format, margin, align, rowwise, columnwise, column_sums, scale, amax_out, offset,
      cast_backend, accumulate_amax=False, amax_epsilon=0.0, power_2_scale=False, row_index=None,
      m_splits=None, activation=None):
    s_data, s_t, s_e, s_cs = _quantize_shapes(xs, align, rowwise, columnwise, column_sums,
                                              m_splits, activation)
    dev = xs[0].device
    return (xs[0].new_empty(s_data, dtype=torch.uint8), xs[0].new_empty(s_t, dtype=torch.uint8),
            torch.empty(s_e, dtype=torch.float32, device=dev),
            torch.empty(s_cs, dtype=torch.float32, device=dev))


def _scale_dtype(block_dims: int) -> torch.dtype:
    """The block scales' torch dtype (MXFP8's E8M0 bytes: uint8; else float32)."""
    return getattr(torch, scale_dtype(block_dims).name)


def _block_shapes(xs, block_dims, align, rowwise, columnwise, m_splits=None, column_sums=False,
                  activation=None):
    """Output shapes of fp8_block_quantize, in plain integer arithmetic: under torch.compile the
    token counts are symbolic once they vary (no caches, no NumPy here). ``m_splits`` (a
    gather) gives the experts' rows instead of ``xs``; a gated ``activation`` halves the width."""
    k = xs[0].shape[1] // 2 if activation is not None else xs[0].shape[1]
    rows = data_t = sinv = sinv_t = 0
    for m in (m_splits if m_splits is not None else [x.shape[0] for x in xs]):
        mp = padded(m, align)
        a, b = block_scale_entries(m, mp, k, block_dims)
        rows, data_t, sinv, sinv_t = rows + m, data_t + k * mp, sinv + a, sinv_t + b
    E = len(m_splits) if m_splits is not None else len(xs)
    return ((rows if rowwise else 0, k), (data_t if columnwise else 0,),
            (sinv if rowwise else 0,), (sinv_t if columnwise else 0,), (E if column_sums else 0, k))


@_custom_op("fp8_block_quantize", mutates_args=())
def fp8_block_quantize(xs: List[torch.Tensor], fp8_format: str, block_dims: int, align: int,
                       rowwise: bool, columnwise: bool, cast_backend: str,
                       amax_epsilon: float = 0.0, power_2_scale: bool = True,
                       row_index: Optional[torch.Tensor] = None,
                       m_splits: Optional[List[int]] = None, column_sums: bool = False,
                       activation: Optional[str] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                  torch.Tensor]:
    """``multi_block_cast_transpose`` of the experts ``xs`` (Float8BlockScaling; ``block_dims``
    ``MX_DIMS``: ``multi_mxfp8_cast_transpose``): returns ``(data (Σm, k) uint8 or (0, k),
    data_t (bytes,) uint8 or (0,), scale_inv, scale_inv_t, column_sums (E, k) float32 or (0,
    k))``, the block scales flat in TransformerEngine's layouts (float32; MXFP8: E8M0 bytes,
    uint8) and empty for a copy not asked for. ``row_index`` with ``m_splits`` (the fused
    permute): ``xs`` is ``[tokens]``. ``activation`` (``"swiglu"``): cast the activation of
    each row's halves ``[a | b]``."""
    gather = row_index is not None
    dev = xs[0].device
    s_data, s_t, s_si, s_sit, s_cs = _block_shapes(xs, block_dims, align, rowwise, columnwise,
                                                   m_splits if gather else None, column_sums,
                                                   activation)
    u8, f32 = dict(dtype=torch.uint8, device=dev), dict(dtype=torch.float32, device=dev)
    sdt = dict(dtype=_scale_dtype(block_dims), device=dev)
    data, data_t = torch.empty(s_data, **u8), torch.empty(s_t, **u8)
    sinv, sinv_t = torch.empty(s_si, **sdt), torch.empty(s_sit, **sdt)
    colsum = torch.empty(s_cs, **f32)
    out = result_type(block_dims)(
                          data=data if rowwise else None, data_t=data_t if columnwise else None,
                          scale_inv=sinv if rowwise else None,
                          scale_inv_t=sinv_t if columnwise else None, m_splits=(),
                          m_pad_splits=(), fp8_format=fp8_format, k=s_data[1], align=align,
                          block_scaling_dim=block_dims,
                          column_sums=colsum if column_sums else None)
    _functional._block_cast(
        xs[0] if gather else list(xs), list(m_splits) if gather else None,
        fp8_format=fp8_format, block_scaling_dim=block_dims, align=align,
        rowwise=rowwise, columnwise=columnwise, amax_epsilon=amax_epsilon,
        power_2_scale=power_2_scale, out=out, backend=_backend(xs[0], cast_backend),
        row_index=row_index, column_sums=column_sums, activation=activation)
    return data, data_t, sinv, sinv_t, colsum


@fp8_block_quantize.register_fake
def _(xs, fp8_format, block_dims, align, rowwise, columnwise, cast_backend, amax_epsilon=0.0,
      power_2_scale=True, row_index=None, m_splits=None, column_sums=False, activation=None):
    s_data, s_t, s_si, s_sit, s_cs = _block_shapes(xs, block_dims, align, rowwise, columnwise,
                                                   m_splits if row_index is not None else None,
                                                   column_sums, activation)
    dev = xs[0].device
    sdt = _scale_dtype(block_dims)
    return (xs[0].new_empty(s_data, dtype=torch.uint8), xs[0].new_empty(s_t, dtype=torch.uint8),
            torch.empty(s_si, dtype=sdt, device=dev), torch.empty(s_sit, dtype=sdt, device=dev),
            torch.empty(s_cs, dtype=torch.float32, device=dev))


# ---------------------------------------------------------------------------------------------
# GEMMs. ``*_block``: 0 for one scale per expert (GroupedFP8), 1 or 2 for block scales
# (Float8BlockScaling; the ``*_scale_inv`` are then the copy's flat block scales).

@_custom_op("fp8_fprop", mutates_args=())
def fp8_fprop(x_data: torch.Tensor, x_scale_inv: torch.Tensor, x_format: str,
              w_data: torch.Tensor, w_scale_inv: torch.Tensor, w_format: str,
              bias: List[torch.Tensor], m_splits: List[int], out_dtype: torch.dtype,
              fast_accum: bool = True, x_block: int = 0, w_block: int = 0) -> torch.Tensor:
    """``y_i = x_i · W_iᵀ (+ b_i)``: x row-wise ``(Σm, k)``, W row-wise ``(E·n, k)``; bias (one per
    expert, of :func:`fused_bias_dtype`) or an empty list. Returns ``(Σm, n)``. ``fast_accum``:
    cuBLASLt's FP8 fast accumulation (TransformerEngine's ``use_split_accumulator=False``)."""
    n = w_data.shape[0] // len(m_splits)
    y = torch.empty((x_data.shape[0], n), dtype=out_dtype, device=x_data.device)
    _fprop_into(y, x_data, x_scale_inv, x_format, w_data, w_scale_inv, w_format, bias, m_splits,
                _gemm_backend(x_data), fast_accum, x_block, w_block)
    return y


def _fprop_into(y, x_data, x_scale_inv, x_format, w_data, w_scale_inv, w_format, bias, m_splits,
                backend, fast_accum=True, x_block=0, w_block=0):
    E, k = len(m_splits), x_data.shape[1]
    n = w_data.shape[0] // E
    if backend == "cuda" and not (x_block or w_block) and DIRECT_GEMMS and _direct_fprop_ok(
            y, x_data, x_scale_inv, x_format, w_data, w_scale_inv, w_format, bias, m_splits):
        _direct(x_data.device, "fprop", x_data.data_ptr(), _scales(x_scale_inv), x_format,
                w_data.data_ptr(), _scales(w_scale_inv), w_format, tuple(m_splits), k, n,
                y.data_ptr(), dtype_name(y.dtype),
                tuple(b.data_ptr() for b in bias) if bias else None, bool(fast_accum))
        return
    conv = _gemm_view(backend)
    xg = _grouped(x_data, None, x_scale_inv, m_splits, k, x_format, token_align(x_block), conv,
                  x_block)
    wg = _grouped(w_data, None, w_scale_inv, [n] * E, k, w_format, 1, conv, w_block)
    with launch_context(x_data.device):
        _ops.grouped_fprop(xg, wg, [conv(b) for b in bias] if bias else None, out=conv(y),
                           out_dtype=dtype_name(y.dtype), fast_accum=fast_accum, backend=backend)


@fp8_fprop.register_fake
def _(x_data, x_scale_inv, x_format, w_data, w_scale_inv, w_format, bias, m_splits, out_dtype,
      fast_accum=True, x_block=0, w_block=0):
    return x_data.new_empty((x_data.shape[0], w_data.shape[0] // len(m_splits)), dtype=out_dtype)


@_custom_op("fp8_dgrad", mutates_args=())
def fp8_dgrad(dy_data: torch.Tensor, dy_scale_inv: torch.Tensor, dy_format: str,
              w_t: torch.Tensor, w_scale_inv: torch.Tensor, w_format: str, k: int,
              m_splits: List[int], out_dtype: torch.dtype, fast_accum: bool = False,
              dy_block: int = 0, w_block: int = 0) -> torch.Tensor:
    """``dx_i = dy_i · W_i``: dy row-wise ``(Σm, n)``, W transposed (``(k, n)`` per expert, packed).
    Returns ``(Σm, k)``."""
    dx = torch.empty((dy_data.shape[0], k), dtype=out_dtype, device=dy_data.device)
    _dgrad_into(dx, dy_data, dy_scale_inv, dy_format, w_t, w_scale_inv, w_format, k, m_splits,
                _gemm_backend(dy_data), fast_accum, dy_block, w_block)
    return dx


def _dgrad_into(dx, dy_data, dy_scale_inv, dy_format, w_t, w_scale_inv, w_format, k, m_splits,
                backend, fast_accum=False, dy_block=0, w_block=0):
    E, n = len(m_splits), dy_data.shape[1]
    if backend == "cuda" and not (dy_block or w_block) and DIRECT_GEMMS and _direct_dgrad_ok(
            dx, dy_data, dy_scale_inv, dy_format, w_t, w_scale_inv, w_format, k, m_splits):
        _direct(dy_data.device, "dgrad", dy_data.data_ptr(), _scales(dy_scale_inv), dy_format,
                w_t.data_ptr(), _scales(w_scale_inv), w_format, tuple(m_splits), k, n,
                dx.data_ptr(), dtype_name(dx.dtype), bool(fast_accum))
        return
    conv = _gemm_view(backend)
    dyg = _grouped(dy_data, None, dy_scale_inv, m_splits, n, dy_format, token_align(dy_block),
                   conv, dy_block)
    wg = _grouped(None, w_t, w_scale_inv, [n] * E, k, w_format, 1, conv, w_block)
    with launch_context(dy_data.device):
        _ops.grouped_dgrad(dyg, wg, out=conv(dx), out_dtype=dtype_name(dx.dtype),
                           fast_accum=fast_accum, backend=backend)


@fp8_dgrad.register_fake
def _(dy_data, dy_scale_inv, dy_format, w_t, w_scale_inv, w_format, k, m_splits, out_dtype,
      fast_accum=False, dy_block=0, w_block=0):
    return dy_data.new_empty((dy_data.shape[0], k), dtype=out_dtype)


def _wgrad(x_t, x_scale_inv, x_format, dy_t, dy_scale_inv, dy_format, k, n, m_splits, out,
           accumulate, out_dtype, backend, fast_accum=False, x_block=0, dy_block=0):
    """``out``: an ``(E, n, k)`` tensor or a list of E ``(n, k)`` ``main_grad`` tensors."""
    if backend == "cuda" and not (x_block or dy_block) and DIRECT_GEMMS and _direct_wgrad_ok(
            x_t, x_scale_inv, x_format, dy_t, dy_scale_inv, dy_format, k, n, m_splits, out,
            out_dtype):
        ptrs = tuple(g.data_ptr() for g in out) if isinstance(out, (list, tuple)) else \
            out.data_ptr()
        _direct(x_t.device, "wgrad", x_t.data_ptr(), _scales(x_scale_inv), x_format,
                dy_t.data_ptr(), _scales(dy_scale_inv), dy_format, tuple(m_splits), k, n,
                token_align(0), ptrs, out_dtype, bool(accumulate), bool(fast_accum))
        return
    conv = _gemm_view(backend)
    xg = _grouped(None, x_t, x_scale_inv, m_splits, k, x_format, token_align(x_block), conv,
                  x_block)
    dyg = _grouped(None, dy_t, dy_scale_inv, m_splits, n, dy_format, token_align(dy_block),
                   conv, dy_block)
    out = [conv(g) for g in out] if isinstance(out, (list, tuple)) else conv(out)
    with launch_context(x_t.device):
        _ops.grouped_wgrad(xg, dyg, out=out, accumulate=accumulate, out_dtype=out_dtype,
                           fast_accum=fast_accum, backend=backend)


@_custom_op("fp8_wgrad", mutates_args=())
def fp8_wgrad(x_t: torch.Tensor, x_scale_inv: torch.Tensor, x_format: str, dy_t: torch.Tensor,
              dy_scale_inv: torch.Tensor, dy_format: str, k: int, n: int, m_splits: List[int],
              out_dtype: torch.dtype, fast_accum: bool = False, x_block: int = 0,
              dy_block: int = 0) -> torch.Tensor:
    """``dW_i = dy_iᵀ · x_i`` from the transposed, padded copies (``(k, m_pad)``, ``(n, m_pad)``);
    returns ``(E, n, k)`` of ``out_dtype`` (an expert with no tokens gets zeros)."""
    dw = torch.empty((len(m_splits), n, k), dtype=out_dtype, device=x_t.device)
    _wgrad(x_t, x_scale_inv, x_format, dy_t, dy_scale_inv, dy_format, k, n, m_splits, dw,
           False, dtype_name(out_dtype), _gemm_backend(x_t), fast_accum, x_block, dy_block)
    return dw


@fp8_wgrad.register_fake
def _(x_t, x_scale_inv, x_format, dy_t, dy_scale_inv, dy_format, k, n, m_splits, out_dtype,
      fast_accum=False, x_block=0, dy_block=0):
    return x_t.new_empty((len(m_splits), n, k), dtype=out_dtype)


# A separate op (not an optional mutated list on fp8_wgrad): inductor mishandles a custom op that
# both returns a tensor and mutates an empty Tensor[] argument.
@_custom_op("fp8_wgrad_main_grad", mutates_args=("main_grads",))
def fp8_wgrad_main_grad(x_t: torch.Tensor, x_scale_inv: torch.Tensor, x_format: str,
                        dy_t: torch.Tensor, dy_scale_inv: torch.Tensor, dy_format: str, k: int,
                        n: int, m_splits: List[int], main_grads: List[torch.Tensor],
                        accumulate: bool, fast_accum: bool = False, x_block: int = 0,
                        dy_block: int = 0) -> None:
    """``main_grads[i] (+)= dy_iᵀ · x_i``, accumulated in fp32 and rounded once to the
    ``main_grad`` dtype (float32, bfloat16 or float16, one for all experts): ``accumulate`` adds
    (``beta = 1`` in the GEMM; experts with no tokens leave theirs untouched), otherwise
    overwrites (no tokens: zeros)."""
    _wgrad(x_t, x_scale_inv, x_format, dy_t, dy_scale_inv, dy_format, k, n, m_splits,
           list(main_grads), accumulate, dtype_name(main_grads[0].dtype), _gemm_backend(x_t),
           fast_accum, x_block, dy_block)


@fp8_wgrad_main_grad.register_fake
def _(x_t, x_scale_inv, x_format, dy_t, dy_scale_inv, dy_format, k, n, m_splits, main_grads,
      accumulate, fast_accum=False, x_block=0, dy_block=0):
    return None


@_custom_op("wgrad_main_grad", mutates_args=("main_grads",))
def wgrad_main_grad(xs: List[torch.Tensor], dys: List[torch.Tensor],
                    main_grads: List[torch.Tensor], accumulate: bool) -> None:
    """Without FP8: ``main_grads[i] (+)= dys[i]ᵀ · xs[i]`` with the ``main_grad`` as the
    GEMM's output (cuBLASLt on CUDA, the NumPy twin on CPU), so bf16 / fp16 operands are never
    rounded to their own dtype before the accumulation. Operands the grouped GEMM does not take
    (float64; CPU float64 is how the layer is gradchecked) go through torch's matmul in their
    own precision; views with a non-unit column stride are made contiguous first. A 16-bit
    ``main_grad`` of the operands' dtype is the GEMM's output (fp32 accumulation, one rounding);
    any other pairing cuBLASLt has no output type for (float32 operands and a 16-bit
    ``main_grad``) gets the product in at least float32, added into it by torch (one rounding
    of the sum)."""
    g_dtype, x_dtype = main_grads[0].dtype, xs[0].dtype
    if x_dtype not in (torch.bfloat16, torch.float16, torch.float32) or \
            g_dtype not in (torch.float32, x_dtype):
        acc = torch.promote_types(x_dtype, torch.float32)
        for g, d, x in zip(main_grads, dys, xs):
            prod = d.t().to(acc) @ x.to(acc)
            if accumulate:
                g.add_(prod)
            else:
                g.copy_(prod)
        return
    xs = [x if x.shape[0] == 0 or x.stride(-1) == 1 else x.contiguous() for x in xs]
    dys = [d if d.shape[0] == 0 or d.stride(-1) == 1 else d.contiguous() for d in dys]
    with launch_context(xs[0].device):
        _ops.grouped_wgrad(list(xs), list(dys), out=list(main_grads), accumulate=accumulate,
                           out_dtype=dtype_name(g_dtype))


@wgrad_main_grad.register_fake
def _(xs, dys, main_grads, accumulate):
    return None


# ---------------------------------------------------------------------------------------------
# Delayed scaling: one launch for every tensor of every expert.

@_custom_op("scale_update", mutates_args=("amax_history", "amax", "scale", "scale_inv"))
def scale_update(amax_history: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor,
                 scale_inv: torch.Tensor, num_e4m3: int, amax_compute_algo: str, margin: int,
                 count: int, cast_backend: str) -> None:
    """``update_scales`` on the first ``count`` tensors of the state (E4M3 for the first
    ``num_e4m3`` of them, E5M2 for the rest), with ``amax[:count]`` zeroed once rolled in (by the
    same launch: ``reset_amax``)."""
    fmts = ["e4m3"] * min(num_e4m3, count) + ["e5m2"] * max(0, count - num_e4m3)
    conv = _same if amax_history.is_cuda else _arr     # CUDA tensors: read through pointers
    with launch_context(amax_history.device):
        update_scales(conv(amax_history[:count]), conv(amax[:count]), conv(scale[:count]),
                      conv(scale_inv[:count]), fp8_format=fmts,
                      amax_compute_algo=amax_compute_algo, margin=margin,
                      backend=_backend(amax_history, cast_backend),
                      reset_amax=True)   # consumed: forwards max-merge into it until the next update


@scale_update.register_fake
def _(amax_history, amax, scale, scale_inv, num_e4m3, amax_compute_algo, margin, count,
      cast_backend):
    return None


# ---------------------------------------------------------------------------------------------
# The permute's adjoint: rows summed onto tokens, deterministically.

@_custom_op("scatter_rows_sum", mutates_args=())
def scatter_rows_sum(rows: torch.Tensor, order: torch.Tensor, seg: torch.Tensor,
                     num_tokens: int) -> torch.Tensor:
    """``out[t] = Σ rows[order[seg[t]:seg[t+1]]]`` in float32, added in ``order`` (no atomics:
    the same bits on every run). ``rows`` row-major float32 / float16 / bfloat16."""
    out = torch.empty((num_tokens, rows.shape[1]), dtype=torch.float32, device=rows.device)
    conv = _same if rows.is_cuda else _arr
    with launch_context(rows.device):
        _scatter_rows(conv(rows), conv(order), conv(seg), num_tokens, conv(out),
                      backend=_backend(rows, "reference"))
    return out


@scatter_rows_sum.register_fake
def _(rows, order, seg, num_tokens):
    return rows.new_empty((num_tokens, rows.shape[1]), dtype=torch.float32)


# The ops as the layer calls them: in eager mode the Python bodies directly (a call through
# torch's dispatcher costs ~15-40 us of host time, several times per step), the registered custom
# ops whenever torch.compile traces or a dispatch mode is active (same results: the custom op
# runs the same body).
eager = types.SimpleNamespace(**{name: _choose(name) for name in _OPS})
