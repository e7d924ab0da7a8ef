"""Per-call memo of the grouped GEMMs: checked operands, checked outputs and launch plans, keyed
on the arguments' layouts and addresses. Package-private."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..grouped_block_fp8 import GroupedBlockFP8, GroupedMXFP8
from ..grouped_fp8 import GroupedFP8
from ._gemm_checks import check_alignment, check_dgrad, check_fprop, check_wgrad, new_output, outputs
from ._gemm_plan import Blocks, Problem, VecPlan, plan_arrays

# ---------------------------------------------------------------------------------------------
# Per-call memo: a training step calls the same pass on the same buffers (same pointers, shapes,
# splits) over and over, and the argument checks, output checks and plan are pure functions of
# exactly those numbers. The memo keys on everything the checks read, so a hit is what a fresh
# check would have produced; anything it cannot key (device-side splits, unknown array types,
# torch tensor subclasses, unhashable fields) takes the full path, and a failed check is never
# stored, so bad input raises exactly as before. Keys and stored entries hold numbers only (no
# arrays are kept alive: a memo holding a training step's activations would hold GPU memory): a
# freed buffer whose address comes back with the same layout maps to the same, still correct, plan.

MEMO_SIZE = 256          # checked operand sets kept (FIFO)
MEMO_OUTPUTS = 8         # output buffers kept per operand set (pointers of fresh outputs vary)


class _NoKey(Exception):
    """An argument the memo cannot key: take the full path."""


def _np_key(a) -> tuple:
    return (np.ndarray, a.ctypes.data, a.shape, a.strides, a.dtype)


def _cupy_key(a) -> tuple:
    d = a.data
    return (type(a), d.ptr, d.device_id, a.shape, a.strides, a.dtype)


def _torch_key(a) -> tuple:
    # as_view reads data_ptr(), shape, stride(), dtype and device (its index): all of them here.
    # torch.Size is a tuple, torch.dtype and torch.device are hashable values (no storage kept).
    return (type(a), a.data_ptr(), a.shape, a.stride(), a.dtype, a.device)


def _no_key(a):
    raise _NoKey


_ARRAY_KEYS: dict = {np.ndarray: _np_key}
# torch's own tensor types (found by module and name: torch is never imported here); subclasses
# such as wrapper tensors may compute what they report, so they take the full path.
_TORCH_TYPES = (("torch", "Tensor"), ("torch.nn.parameter", "Parameter"))


def _key_function(t):
    if t.__module__ == "cupy" and t.__name__ == "ndarray":
        return _cupy_key
    if (t.__module__, t.__name__) in _TORCH_TYPES:
        return _torch_key
    return _no_key


def _array_key(a) -> tuple:
    """Layout, dtype, address and device of one array: every field ``as_view`` reads."""
    t = type(a)
    f = _ARRAY_KEYS.get(t)
    if f is None:
        f = _ARRAY_KEYS[t] = _key_function(t)
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
    if type(x) in (GroupedBlockFP8, GroupedMXFP8):
        m = x.m_splits
        if type(m) is not tuple:
            raise _NoKey
        data, scales = (x.data, x.scale_inv) if copy == "rowwise" else (x.data_t, x.scale_inv_t)
        return (type(x), x.fp8_format, x.k, m, x.m_pad_splits, x.block_scaling_dim,
                None if data is None else _array_key(data),
                None if scales is None else _array_key(scales))
    if isinstance(x, (GroupedFP8, GroupedBlockFP8)):   # a subclass may compute its fields
        raise _NoKey
    return _seq_key(x)


_COPIES = {"fprop": ("rowwise", "rowwise", None), "dgrad": ("rowwise", "columnwise"),
           "wgrad": ("columnwise", "columnwise")}
_CHECKS = {"fprop": check_fprop, "dgrad": check_dgrad, "wgrad": check_wgrad}


@dataclasses.dataclass(eq=False)
class Checked:
    """A checked call: its :class:`Problem`, the arguments as given (the reference backend
    re-reads them; the memo's own entry holds none), and the output plans made so far, per
    output buffer."""

    problem: Problem
    args: tuple
    kwargs: dict
    outs: dict = dataclasses.field(default_factory=dict)


_memo: dict = {}


def _call_key(pass_name: str, args: tuple, kwargs: dict):
    copies = _COPIES[pass_name]
    try:
        # the options with their types: fast_accum=1 must not hit True's entry (and skip the
        # checks, which refuse it)
        key = (pass_name, tuple((type(v), v) for v in kwargs.values())) + tuple(
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
        _memo[key] = Checked(c.problem, (), {}, c.outs)   # without the arrays (a hit gets its own)
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
    """Forget every memoised check and plan, the torch layer's direct ones too (tests; nothing
    else needs it)."""
    from . import _gemm_direct

    _memo.clear()
    _gemm_direct.clear_memo()
