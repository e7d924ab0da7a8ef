"""The per-tensor FP8 grouped GEMMs of the torch layer, planned straight from its own buffers.

The public ops (:mod:`.grouped_gemm`) check every argument (``check_fprop`` / ``check_dgrad`` /
``check_wgrad``, ``outputs``, ``check_alignment``) and memoise the result on the arguments'
addresses and counts. In MoE training both are new at every step, so every call of the layer
took the whole path, about half of a GEMM call's host time (``scripts/layer_host.py``). The
layer's custom ops (:mod:`cugrouped.pytorch._custom_ops`) know what those checks establish: their
casts made every operand (row-wise ``(Σm, k)``, or transposed and padded to 16 tokens, one
float32 ``scale_inv`` per expert), torch allocated every output, all on one device, and the layer
checked ``k`` and ``n`` (multiples of 16); they confirm that in O(1) tensor reads per call and
send anything else the public way, whose checks say what is wrong. So they describe the call
here, from pointers and counts, as the :class:`~._gemm_plan.Problem` and output
:class:`~._gemm_plan.Blocks` the checks would have produced, and launch it through the same plan
and loop (:func:`run`, the plan memoised on those numbers).

The builders are pure functions of ints (tested on the CPU: each equals the checks' result over
the split taxonomy, and a layer step's launches are the same either way). Their blocks carry what
they know of their own layout (``Blocks.affine``, ``Blocks.consts``), which the grouped GEMM's
setup would otherwise find out with array operations per call (tested to give the same
per-group arrays); :func:`run` launches
on the device. Package-private.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..cublaslt import _enums as E
from ._gemm_checks import _FP8_DTYPE as _FP8
from ._gemm_plan import _ITEMSIZE, Blocks, Problem, bias_dtype_for, plan_arrays
from ._gemm_plan import scale_pointers as _scales

_SCALAR = E.CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F
Scales = tuple[int, int]       # a float32 (E,) scale_inv array: (address, element stride)


def _counts(m_splits: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The counts as int64 and each expert's first row (their exclusive prefix sum)."""
    m = np.array(m_splits, dtype=np.int64)
    return m, m.cumsum() - m


def _place(device: int) -> tuple[bool, int, str]:
    return (True, device, "torch")


def fprop(x: int, x_scale_inv: Scales, x_format: str, w: int, w_scale_inv: Scales,
          w_format: str, m_splits: Sequence[int], k: int, n: int, out: int, out_dtype: str,
          bias: tuple[int, ...] | None, fast_accum: bool, device: int) -> tuple[Problem, Blocks]:
    """``y_i = x_i · W_iᵀ (+ b_i)``: ``x`` the row-wise ``(Σm, k)`` FP8 bytes, ``w`` the row-wise
    ``(E·n, k)`` ones, ``out`` a contiguous ``(Σm, n)`` array of ``out_dtype``, ``bias`` one
    contiguous ``(n,)`` vector per expert (of :func:`bias_dtype_for`) or None; addresses. Each
    ``*_scale_inv`` is the ``(address, element stride)`` of a float32 ``(E,)`` array."""
    m, first_row = _counts(m_splits)
    num = m.shape[0]
    left = Blocks(x + first_row * k, m, k, k, _FP8[x_format], affine=(0, k))
    right = Blocks(w + (n * k) * np.arange(num, dtype=np.int64), n, k, k, _FP8[w_format],
                   affine=(n * k, 0))
    bdt = bias_dtype_for(out_dtype, True) if bias is not None else None
    problem = Problem("fprop", True, left, False, right, True, (k,) * num,
                      _scales(*x_scale_inv, num), _scales(*w_scale_inv, num), bias, bdt,
                      bool(fast_accum), False, out_dtype, _place(device), _SCALAR, _SCALAR)
    row = n * _ITEMSIZE[out_dtype]
    return problem, Blocks(out + first_row * row, m, n, n, out_dtype, affine=(0, row))


def dgrad(dy: int, dy_scale_inv: Scales, dy_format: str, w_t: int, w_scale_inv: Scales,
          w_format: str, m_splits: Sequence[int], k: int, n: int, out: int, out_dtype: str,
          fast_accum: bool, device: int) -> tuple[Problem, Blocks]:
    """``dx_i = dy_i · W_i``: ``dy`` the row-wise ``(Σm, n)`` FP8 bytes, ``w_t`` the weights'
    transposed copy (``(k, n)`` per expert, back to back), ``out`` a contiguous ``(Σm, k)``
    array of ``out_dtype``; addresses."""
    m, first_row = _counts(m_splits)
    num = m.shape[0]
    left = Blocks(dy + first_row * n, m, n, n, _FP8[dy_format], affine=(0, n))
    right = Blocks(w_t + (k * n) * np.arange(num, dtype=np.int64), k, n, n, _FP8[w_format],
                   affine=(k * n, 0))
    problem = Problem("dgrad", True, left, False, right, True, (n,) * num,
                      _scales(*dy_scale_inv, num), _scales(*w_scale_inv, num), None, None,
                      bool(fast_accum), False, out_dtype, _place(device), _SCALAR, _SCALAR)
    row = k * _ITEMSIZE[out_dtype]
    return problem, Blocks(out + first_row * row, m, k, k, out_dtype, affine=(0, row))


def wgrad(x_t: int, x_scale_inv: Scales, x_format: str, dy_t: int, dy_scale_inv: Scales,
          dy_format: str, m_splits: Sequence[int], k: int, n: int, align: int,
          out: int | Sequence[int], out_dtype: str, accumulate: bool, fast_accum: bool,
          device: int) -> tuple[Problem, Blocks]:
    """``dW_i (+)= dy_iᵀ · x_i``: ``x_t`` and ``dy_t`` the transposed copies (``(k, m_pad_i)``
    and ``(n, m_pad_i)`` per expert, back to back, ``m_pad_i`` the count rounded up to ``align``,
    a multiple of 16); ``out`` the address of a contiguous ``(E, n, k)`` array, or one address
    per expert of a contiguous ``(n, k)`` array (``main_grad``), of ``out_dtype``."""
    m = np.array(m_splits, dtype=np.int64)
    num = m.shape[0]
    pad = -(-m // align) * align
    start = pad.cumsum() - pad
    right = Blocks(x_t + start * k, k, pad, pad, _FP8[x_format], affine=(0, k))
    left = Blocks(dy_t + start * n, n, pad, pad, _FP8[dy_format], affine=(0, n))
    problem = Problem("wgrad", True, left, False, right, True, tuple(pad.tolist()),
                      _scales(*dy_scale_inv, num), _scales(*x_scale_inv, num), None, None,
                      bool(fast_accum), bool(accumulate), out_dtype, _place(device), _SCALAR,
                      _SCALAR)
    if isinstance(out, int):
        size = n * k * _ITEMSIZE[out_dtype]
        return problem, Blocks(out + size * np.arange(num, dtype=np.int64), n, k, k, out_dtype,
                               affine=(size, 0))
    return problem, Blocks(np.array(out, dtype=np.int64), n, k, k, out_dtype)


_BUILDERS = {"fprop": fprop, "dgrad": dgrad, "wgrad": wgrad}
MEMO_SIZE = 256
_memo: dict = {}


def run(pass_name: str, *args, state=None) -> None:
    """Plan and launch ``<pass_name>(*args)`` on the device's current stream, as the public ops
    do once their checks pass (the caller has made the device and the stream CuPy's current
    ones), the plan memoised on ``args`` (every value the builder
    reads, ints and strings: the key costs about what one array operation does). A training step
    that brings the same counts and the same buffers back (fixed token counts, and the caching
    allocator's addresses) plans nothing; new counts miss. ``args`` as the builder takes them,
    sequences as tuples; the device is the last. ``state``: the device state to launch with
    (default: the device's own; the CPU host benchmark passes its fake one)."""
    key = (pass_name,) + args
    hit = _memo.get(key)
    if hit is None:
        problem, out = _BUILDERS[pass_name](*args)
        hit = (plan_arrays(problem, out), problem, out)
        if len(_memo) >= MEMO_SIZE:
            del _memo[next(iter(_memo))]
        _memo[key] = hit
    _launch(*hit, args[-1], state)


def clear_memo() -> None:
    """Forget the memoised plans (tests)."""
    _memo.clear()


def _launch(vp, problem: Problem, out: Blocks, device: int, state=None) -> None:
    from . import grouped_gemm as gg     # (its device state, as the public ops read it)
    from ._gemm_launch import _launch_plan

    _launch_plan(vp, problem, out, gg._state(device) if state is None else state)
