"""``FrozenGroupedLinear``: experts whose weights stay as a checkpoint quantized them, in FP8 with a
float32 scale per 128 x 128 block (DeepSeek-V3's ``weight`` + ``weight_scale_inv``), frozen. For
inference, and for training around frozen experts (adapters such as LoRA beside them, layers
before them): the input's gradient flows, the weights get none, and no high-precision copy of
the weights exists.

One step, all experts at once: forward casts the input per 1 x 128 block (a float32 scale from
each block's amax, as DeepSeek-V3 quantizes activations; ``power_2_scale=True`` for
TransformerEngine's power-of-two scales) and runs the block-scaled fprop; backward casts the
output gradient the same way and runs dgrad on the weights' transposed copy. The block-scaled
GEMMs take token counts in multiples of 8: the layer pads each expert's rows itself, in the
cast (pad rows are index -1 of its gather: zero rows it writes, no padded copy of a tensor
input; a list input is concatenated once), and drops them from the output and the input gradient (one ``index_select`` each) when a count
needs it. Hopper (sm_90) with cuBLAS 12.9+ on the GPU; CPU tensors run the casts on the
emulator and the GEMMs on the reference, bit for bit what the GPU's casts give.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from ..ops.block_scaled_weights import block_scaled_weights
from . import _custom_ops as cops
from ._gather import check_row_index, scatter_rows
from .grouped_linear import _CPU_CAST_BACKEND, GroupedLinear, apply_keeping_float32

__all__ = ["FrozenGroupedLinear"]

ROW_MULTIPLE = 8        # the block-scaled GEMMs' token multiple (a 1-D left operand)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FrozenGroupedLinear(torch.nn.Module):
    """E frozen experts ``y_i = x_i W_iᵀ (+ b_i)`` on FP8 weights quantized in 128 x 128 blocks.

    ``weight``, ``weight_scale_inv``: the experts' FP8 weights ``(n, k)`` and their float32 block
    scales ``(ceil(n/128), ceil(k/128))`` as a checkpoint holds them, a list per expert or one
    stacked tensor each (:func:`cugrouped.block_scaled_weights`; uint8 bytes need
    ``fp8_format``). ``bias``: optional ``(E, n)`` (or a list), frozen, added in the output's
    dtype. ``power_2_scale``: the input's and gradient's block scales rounded to powers of two
    (TransformerEngine's recipe) instead of DeepSeek-V3's exact ``amax / 448``.
    ``grad_fp8_format``: the output gradient's format (DeepSeek-V3 trains with E4M3 throughout;
    ``"e5m2"`` is TransformerEngine's HYBRID; not with E5M2 weights: cuBLASLt has no E5M2 x
    E5M2 GEMM). The input is cast to E4M3. ``input_grad=False`` (inference) keeps no transposed
    copy of the weights (half the memory); the input may then not require a gradient.

    ``forward(inp, m_splits=None, row_index=None)`` as :class:`GroupedLinear`'s: a list of
    ``(m_i, k)`` tensors
    gives a list of ``(m_i, n)`` outputs, one ``(sum m_i, k)`` tensor with ``m_splits`` (host
    ints; an integer tensor is read back, a sync) one ``(sum m_i, n)`` tensor; in the input's
    dtype (float32, bfloat16 or float16). The FP8 buffers are the module's buffers (``.to()``,
    ``state_dict``)."""

    def __init__(self, weight, weight_scale_inv, bias=None, *, fp8_format: str | None = None,
                 power_2_scale: bool = False, grad_fp8_format: str = "e4m3",
                 input_grad: bool = True):
        super().__init__()
        for name, v in (("power_2_scale", power_2_scale), ("input_grad", input_grad)):
            if not isinstance(v, bool):
                raise TypeError(f"{name}: expected a bool, got {v!r}")
        if grad_fp8_format not in ("e4m3", "e5m2"):
            raise ValueError(f"grad_fp8_format: expected 'e4m3' or 'e5m2', got "
                             f"{grad_fp8_format!r}")
        w = block_scaled_weights(weight, weight_scale_inv, fp8_format=fp8_format,
                                 columnwise=input_grad)
        if not isinstance(w.data, torch.Tensor):
            raise TypeError("weight: expected torch tensors (for NumPy or CuPy arrays use "
                            "cugrouped.block_scaled_weights and the ops)")
        E, n, k = w.num_experts, w.m_splits[0], w.k
        if k % 16 or n % 16:
            raise ValueError(f"weight: FP8 GEMMs need both feature sizes in multiples of 16, "
                             f"got ({n}, {k})")
        if input_grad and w.fp8_format == grad_fp8_format == "e5m2":
            raise ValueError("grad_fp8_format: 'e5m2' with E5M2 weights would be an E5M2 x E5M2 "
                             "dgrad, which cuBLASLt has not; use 'e4m3'")
        self.input_grad = input_grad
        self.num_gemms, self.in_features, self.out_features = E, k, n
        self.fp8_format, self.grad_fp8_format = w.fp8_format, grad_fp8_format
        self.power_2_scale = power_2_scale
        self.input_fp8_format = "e4m3"    # E4M3 x E5M2 is a cuBLASLt GEMM, E5M2 x E5M2 is not
        self.register_buffer("weight_data", w.data.view(torch.uint8))
        self.register_buffer("weight_data_t", w.data_t)
        self.register_buffer("weight_scale_inv", w.scale_inv)
        self.register_buffer("weight_scale_inv_t", w.scale_inv_t)
        if bias is not None:
            b = torch.stack([t.detach() for t in bias]) if isinstance(bias, (list, tuple)) \
                else bias.detach()
            if tuple(b.shape) != (E, n) or b.device != w.data.device:
                raise ValueError(f"bias: expected ({E}, {n}) on {w.data.device} (one per "
                                 f"expert), got {tuple(b.shape)} on {b.device}")
            if b.dtype not in _DTYPES:
                raise TypeError(f"bias: expected float32, bfloat16 or float16, got {b.dtype}")
            self.register_buffer("bias", b.contiguous())
        else:
            self.bias = None

    def _apply(self, fn, recurse=True):
        """``module.to(...)``, ``.cuda()``, ``.bfloat16()``...: the block scales follow the
        device but stay float32 (the GEMMs read float32); the bias follows dtypes too."""
        apply_keeping_float32(self, super()._apply, fn, recurse,
                              ("weight_scale_inv", "weight_scale_inv_t"))
        return self

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, fp8_format={self.fp8_format!r}, "
                f"bias={self.bias is not None}")

    def forward(self, inp, m_splits=None, row_index=None):
        """``row_index`` (with one ``inp`` tensor of tokens and ``m_splits``): the MoE permute
        folded into the cast, as :class:`GroupedLinear`'s (expert rows ``inp[row_index]``, -1 a
        zero row; the input gradient summed back onto the tokens)."""
        list_mode = isinstance(inp, (list, tuple))
        if row_index is not None and list_mode:
            raise ValueError("row_index: gathers from one tensor of tokens, not from a list")
        xs, splits = self._inputs(inp, m_splits, list_mode, row_index is not None)
        if row_index is not None:
            check_row_index(row_index, xs[0], sum(splits))
        if not self.input_grad and torch.is_grad_enabled() and any(x.requires_grad for x in xs):
            raise ValueError("inp: requires a gradient, but the layer was built with "
                             "input_grad=False (no transposed weights kept)")
        plan = _padding(splits, xs[0].device)
        if plan is not None and list_mode and len(xs) > 1:
            xs = [torch.cat(xs)]               # one tokens tensor for the cast's gather
        y = _FrozenFn.apply(self, splits, plan, list_mode and plan is None, row_index, *xs)
        return list(torch.split(y, list(splits))) if list_mode else y

    def backward_dw(self) -> None:
        """Nothing to do (no weight gradient): for callers that run every expert layer's
        deferred weight gradients (``MoEFeedForward.backward_dw``)."""

    def need_backward_dw(self) -> bool:
        """False: no weight gradient is ever deferred (as ``GroupedLinear``'s)."""
        return False

    def _inputs(self, inp, m_splits, list_mode, gather=False):
        """The input tensors (a list, or the one tensor) and the host counts, checked; with
        ``gather`` the one tensor holds the tokens (its rows are not the counts' sum)."""
        E, k = self.num_gemms, self.in_features
        if list_mode:
            if m_splits is not None:
                raise ValueError("m_splits: not with a list input (its tensors give the counts)")
            if len(inp) != E:
                raise ValueError(f"inp: expected {E} tensors (one per expert), got {len(inp)}")
            xs = list(inp)
            splits = tuple(int(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() == 2
                           else -1 for t in xs)
        else:
            if m_splits is None:
                raise ValueError("m_splits: required with a single input tensor")
            xs = [inp]
            splits = tuple(GroupedLinear._host_splits(m_splits))   # a tensor: read back
            if len(splits) != E:
                raise ValueError(f"m_splits: expected {E} counts, got {len(splits)}")
        for i, x in enumerate(xs):
            name = f"inp[{i}]" if list_mode else "inp"
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != k:
                raise ValueError(f"{name}: expected a 2-D tensor (rows, {k}), got "
                                 f"{getattr(x, 'shape', type(x).__name__)}")
            if x.dtype not in _DTYPES or x.dtype != xs[0].dtype:
                raise TypeError(f"{name}: expected float32, bfloat16 or float16 like inp"
                                f"{'[0]' if list_mode else ''}, got {x.dtype}")
            if x.device != self.weight_data.device:
                raise ValueError(f"{name}: on {x.device}, the weights on "
                                 f"{self.weight_data.device}")
        if not list_mode and not gather and sum(splits) != xs[0].shape[0]:
            raise ValueError(f"m_splits: sum {sum(splits)} != inp rows {xs[0].shape[0]}")
        return [x.contiguous() for x in xs], splits


@functools.lru_cache(maxsize=16)
def _host_padding(splits: tuple, pinned: bool):
    """``None`` when every count is a multiple of 8; else ``(padded counts, gather index of the
    padded rows (-1: a pad row), each real row's padded position)``, the two indices as host
    tensors (pinned for a copy to a GPU), made once per counts (a small cache: routed counts
    change every step, but a block's two layers share theirs)."""
    if all(m % ROW_MULTIPLE == 0 for m in splits):
        return None
    padded = tuple(-(-m // ROW_MULTIPLE) * ROW_MULTIPLE for m in splits)
    idx = np.full(sum(padded), -1, np.int64)
    keep = np.empty(sum(splits), np.int64)
    src = dst = 0
    for m, mp in zip(splits, padded):
        idx[dst:dst + m] = np.arange(src, src + m)
        keep[src:src + m] = np.arange(dst, dst + m)
        src, dst = src + m, dst + mp
    idx, keep = torch.from_numpy(idx), torch.from_numpy(keep)
    return (padded, idx.pin_memory(), keep.pin_memory()) if pinned else (padded, idx, keep)


def _device_padding(splits: tuple, device: torch.device):
    """:func:`_host_padding`'s plan made on ``device`` from the host ints alone (ranges, one
    fill, one scatter: no host data is copied, so no pageable copy and its stream sync)."""
    if all(m % ROW_MULTIPLE == 0 for m in splits):
        return None
    padded = tuple(-(-m // ROW_MULTIPLE) * ROW_MULTIPLE for m in splits)
    starts = np.cumsum((0,) + padded[:-1]).tolist()
    keep = torch.cat([torch.arange(d, d + m, dtype=torch.int64, device=device)
                      for m, d in zip(splits, starts)])
    idx = torch.full((sum(padded),), -1, dtype=torch.int64, device=device).index_copy_(
        0, keep, torch.arange(sum(splits), dtype=torch.int64, device=device))
    return padded, idx, keep


def _padding(splits: tuple, device: torch.device):
    """:func:`_host_padding`'s plan with its indices on ``device``: on a GPU copied on the
    current stream from pinned memory (no sync; in order with the work that reads them). Under
    torch.compile the indices are made in the graph on ``device`` (:func:`_device_padding`:
    a copy from the host there would be pageable, and torch syncs after one)."""
    if torch.compiler.is_compiling():
        return _device_padding(splits, device)
    plan = _host_padding(splits, device.type == "cuda")
    if plan is None or device.type != "cuda":
        return plan
    return (plan[0], *(t.to(device, non_blocking=True) for t in plan[1:]))


class _FrozenFn(torch.autograd.Function):
    """apply(layer, splits, plan, list_cast, row_index, *xs) -> y (sum m_i, n); ``plan``:
    :func:`_padding`; ``list_cast``: ``xs`` are the experts' tensors, else one tensor of all
    rows (the tokens, with ``row_index``)."""

    @staticmethod
    def forward(ctx, layer, splits, plan, list_cast, row_index, *xs):
        padded, pad_idx, keep = (splits, None, None) if plan is None else plan
        gather = pad_idx if row_index is None else row_index if plan is None else \
            torch.full((sum(padded),), -1, dtype=torch.int64,
                       device=row_index.device).index_copy_(0, keep, row_index)
        experts = xs if list_cast else [xs[0]] if gather is not None else \
            list(torch.split(xs[0], list(splits)))
        data, _, si, _, _ = cops.eager.fp8_block_quantize(
            experts, layer.input_fp8_format, 1, 16, True, False, _CPU_CAST_BACKEND[0], 0.0,
            layer.power_2_scale, gather, list(padded) if gather is not None else None)
        y = cops.eager.fp8_fprop(data, si, layer.input_fp8_format, layer.weight_data,
                                 layer.weight_scale_inv, layer.fp8_format, [], list(padded),
                                 xs[0].dtype, False, 1, 2)
        if layer.bias is not None:        # frozen: added to the padded rows too, then dropped
            for part, b in zip(torch.split(y, list(padded)), layer.bias):
                part.add_(b.to(y.dtype))
        ctx.layer, ctx.splits, ctx.plan, ctx.list_cast = layer, splits, plan, list_cast
        ctx.x_dtype, ctx.num_tokens = xs[0].dtype, xs[0].shape[0]
        ctx.save_for_backward(*(() if row_index is None else (row_index,)))
        return y if keep is None else y.index_select(0, keep)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        layer, splits = ctx.layer, ctx.splits
        padded, pad_idx, keep = (splits, None, None) if ctx.plan is None else ctx.plan
        nx = len(ctx.needs_input_grad) - 5
        if not any(ctx.needs_input_grad[5:]):
            return (None,) * (5 + nx)
        dy = dy.contiguous()
        dys = [dy] if pad_idx is not None else list(torch.split(dy, list(splits)))
        data, _, si, _, _ = cops.eager.fp8_block_quantize(
            dys, layer.grad_fp8_format, 1, 16, True, False, _CPU_CAST_BACKEND[0], 0.0,
            layer.power_2_scale, pad_idx, list(padded) if pad_idx is not None else None)
        dx = cops.eager.fp8_dgrad(data, si, layer.grad_fp8_format, layer.weight_data_t,
                                  layer.weight_scale_inv_t, layer.fp8_format,
                                  layer.in_features, list(padded), ctx.x_dtype, False, 1, 2)
        if keep is not None:
            dx = dx.index_select(0, keep)
        if ctx.saved_tensors:             # the permute's adjoint: rows summed onto the tokens
            dx = scatter_rows(dx, ctx.saved_tensors[0], ctx.num_tokens)
        grads = torch.split(dx, list(splits)) if ctx.list_cast else (dx,)
        return (None,) * 5 + tuple(grads)
