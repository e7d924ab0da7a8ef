"""``update_scales``: delayed-scaling update of every FP8 tensor's amax history and scale, one launch.

Host side of ``kernels_cu/scale_update.cu``: argument checks, launch planning (a pure function),
and the launch on the CUDA device, on the CPU emulator, or the NumPy reference
(:func:`cugrouped.reference.update_scales`). Everything is updated in place; nothing is read back
to the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .. import _jit
from .._array import ArrayView, as_view
from ..grouped_fp8 import FP8_FORMATS
from . import _launch

__all__ = ["update_scales", "AMAX_COMPUTE_ALGOS", "KERNEL_SPEC", "kernel_name", "THREADS",
           "ScaleUpdatePlan", "plan_update", "split_formats", "MAX_HISTORY_LEN"]

THREADS = 128          # must match CG_SU_THREADS in kernels_cu/scale_update.cu
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
_ALGO = {"max": "MAX", "most_recent": "MOST_RECENT"}
# A window longer than this is almost certainly a mistake (TransformerEngine's default is 1024).
MAX_HISTORY_LEN = 1 << 16


def kernel_name(algo: str) -> str:
    return f"cg::scale_update_kernel<cg::AmaxAlgo::{_ALGO[algo]}>"


KERNEL_SPEC = _jit.register("scale_update", _jit.KernelSpec(
    source="scale_update.cu",
    name_expressions=tuple(kernel_name(a) for a in AMAX_COMPUTE_ALGOS),
))


@dataclasses.dataclass(frozen=True)
class ScaleUpdatePlan:
    """One launch: a block of ``THREADS`` threads per tensor."""

    kernel: str
    grid: int
    block: int
    num_tensors: int
    history_len: int
    num_e4m3: int
    margin: int


def split_formats(fp8_format: str | Sequence[str], num_tensors: int) -> int:
    """Number of leading E4M3 tensors: the kernel's format boundary.

    ``fp8_format`` is one format for all tensors, or one name per tensor with every ``"e4m3"``
    before every ``"e5m2"`` (order the state that way: inputs, weights, then grad outputs).
    """
    if isinstance(fp8_format, str):
        if fp8_format not in FP8_FORMATS:
            raise ValueError(f"fp8_format: got {fp8_format!r}, expected one of {FP8_FORMATS}")
        return num_tensors if fp8_format == "e4m3" else 0
    fmts = tuple(fp8_format)
    if len(fmts) != num_tensors:
        raise ValueError(f"fp8_format: expected one format or {num_tensors} (one per tensor), got "
                         f"{len(fmts)}")
    bad = [f for f in fmts if f not in FP8_FORMATS]
    if bad:
        raise ValueError(f"fp8_format: got {bad[0]!r}, expected one of {FP8_FORMATS}")
    n4 = fmts.count("e4m3")
    if any(f != "e4m3" for f in fmts[:n4]):
        raise ValueError("fp8_format: per-tensor formats must list every 'e4m3' tensor before every "
                         "'e5m2' tensor (one launch takes one boundary)")
    return n4


def plan_update(num_tensors: int, history_len: int, num_e4m3: int, algo: str,
                margin: int) -> ScaleUpdatePlan:
    """Pure planning: one block per tensor (a grid of zero tensors launches nothing)."""
    return ScaleUpdatePlan(kernel_name(algo), num_tensors, THREADS, num_tensors, history_len,
                           num_e4m3, margin)


def _check(amax_history, amax, scale, scale_inv, amax_compute_algo, margin, reset_amax=False
           ) -> tuple[ArrayView, ...]:
    if not isinstance(reset_amax, (bool, np.bool_)):
        raise TypeError(f"reset_amax: expected a bool, got {reset_amax!r}")
    if amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(f"amax_compute_algo: got {amax_compute_algo!r}, expected one of "
                         f"{AMAX_COMPUTE_ALGOS}")
    if not isinstance(margin, (int, np.integer)) or isinstance(margin, bool) or not 0 <= margin <= 64:
        raise ValueError(f"margin: expected an int in [0, 64], got {margin!r}")
    hv = as_view(amax_history, arg="amax_history")
    if hv.kind == "torch" and not hv.on_device:    # CUDA tensors: read through their pointers
        raise TypeError("amax_history: CPU torch tensors go through cugrouped.pytorch; pass NumPy "
                        "arrays")
    if hv.dtype != "float32" or len(hv.shape) != 2:
        raise ValueError(f"amax_history: expected a float32 array of shape (num_tensors, "
                         f"history_len), got {hv.dtype} {hv.shape}")
    T, L = hv.shape
    if not 1 <= L <= MAX_HISTORY_LEN:
        raise ValueError(f"amax_history: history_len must be in [1, {MAX_HISTORY_LEN}], got {L}")
    if T > 1 and hv.strides != (L, 1) or T <= 1 and L > 1 and hv.strides[1] != 1:
        raise ValueError(f"amax_history: must be C-contiguous, got strides {hv.strides}")
    views = [hv]
    for name, a in (("amax", amax), ("scale", scale), ("scale_inv", scale_inv)):
        v = as_view(a, arg=name)
        if v.dtype != "float32" or v.shape != (T,) or (T > 1 and v.strides != (1,)):
            raise ValueError(f"{name}: expected a contiguous float32 array of shape ({T},), got "
                             f"{v.dtype} {v.shape}")
        if (v.kind, v.device) != (hv.kind, hv.device):
            raise ValueError(f"{name}: is a {v.kind} array on device {v.device}, amax_history a "
                             f"{hv.kind} array on device {hv.device}")
        views.append(v)
    return tuple(views)


def update_scales(amax_history, amax, scale, scale_inv, *, fp8_format="e4m3",
                  amax_compute_algo: str = "max", margin: int = 0,
                  backend: str | None = None, reset_amax: bool = False) -> None:
    """Roll every tensor's amax history, insert its new amax, and recompute its scale, in place.

    Parameters
    ----------
    amax_history : float32 ``(T, L)``, C-contiguous; row ``t`` is tensor ``t``'s window, newest
        first. Updated in place: ``h[t] = [amax[t], h[t, 0], ..., h[t, L-2]]``, except where
        ``amax[t]`` is 0 (``+-0`` or a denormal: the tensor measured nothing this step, e.g. an
        expert without tokens): that row and its scale stay as they are, as in
        TransformerEngine's update, so idle steps do not push old amaxes out of the window.
    amax : float32 ``(T,)``: this step's amax of each tensor (what the cast wrote). With
        ``reset_amax`` it is zeroed once read (in the same launch): the buffer starts the next
        window empty, ready for casts that max-merge into it (``amax_accumulate``).
    scale, scale_inv : float32 ``(T,)``, updated: ``scale = compute_scale(reduced, margin)``
        (``fp8_max / amax / 2^margin``) when the reduced amax is positive, normal and finite;
        otherwise (an idle step, a window of zeros, inf, NaN) the previous ``scale`` is kept, as
        TransformerEngine does. ``scale_inv = 1 / scale`` either way.
    fp8_format : one format, or one per tensor with the E4M3 tensors first (see
        :func:`split_formats`).
    amax_compute_algo : ``"max"`` over the window's non-NaN entries (NaN entries are skipped,
        like ``fmaxf``) or ``"most_recent"`` (this step's amax).
    backend : ``"cuda"``, ``"emulate"``, ``"reference"`` or None (by where the arrays live).

    One launch for all T tensors, on the caller's stream (CuPy's current stream); no host sync.
    """
    views = _check(amax_history, amax, scale, scale_inv, amax_compute_algo, margin, reset_amax)
    T, L = views[0].shape
    n4 = split_formats(fp8_format, T)
    backend = _launch.resolve_backend(backend, views[0].on_device)
    if backend == "reference":
        from ..reference.scale_update import update_scales as ref

        return ref(amax_history, amax, scale, scale_inv, fp8_format=fp8_format,
                   amax_compute_algo=amax_compute_algo, margin=margin, reset_amax=reset_amax)
    plan = plan_update(T, L, n4, amax_compute_algo, int(margin))
    if plan.grid == 0:
        return None
    scalars = (np.int64(T), np.int64(L), np.int64(n4), np.int32(margin), np.int32(reset_amax))
    if backend == "cuda":
        import cupy

        current = cupy.cuda.runtime.getDevice()
        if views[0].device != current:   # the kernel runs on the current device
            raise ValueError(f"amax_history: is on device {views[0].device} but the current CUDA "
                             f"device is {current} (use `with cupy.cuda.Device({views[0].device})`)")
        _launch.note_launch(backend, plan.kernel, plan.grid, plan.block)
        kern = _jit.get_function(KERNEL_SPEC, plan.kernel)
        # data pointers from the views: any device array _check accepted (CuPy's launcher takes
        # only CuPy arrays as pointers); the views keep the arrays alive until the launch returns
        kern((plan.grid,), (plan.block,), tuple(np.uint64(v.ptr) for v in views) + scalars)
    else:
        _launch.note_launch(backend, plan.kernel, plan.grid, plan.block)
        args = (amax_history, amax, scale, scale_inv) + scalars
        _jit.get_emulated_function(KERNEL_SPEC, plan.kernel)(
            (plan.grid,), (plan.block,), args, order=_launch.current_emulation_order())
    return None
