"""Activation checkpointing for code with cugrouped FP8 layers (TransformerEngine's
``te.distributed.checkpoint``).

``torch.utils.checkpoint.checkpoint`` alone does not work with them: the recomputation runs in
backward, outside the ``fp8_autocast`` block, so the layers recompute without FP8 and torch
refuses the different saved tensors. :func:`checkpoint` recomputes under the FP8 state of the
original forward and, for delayed scaling, with the original forward's scales: each
``GroupedLinear`` forward inside it keeps a copy of its scales (one small device copy), which
its recomputation uses. The recomputation leaves the delayed-scaling state alone (no amax is
merged twice). So the recomputed FP8 tensors are the forward's bits even when a backward of
another micro-batch has updated the scales in between (pipeline schedules), and the gradients
equal those of the same code run without checkpointing, bit for bit.
"""

from __future__ import annotations

import contextlib

import torch

from . import recipe as _recipe

__all__ = ["checkpoint"]

# The innermost checkpoint phase: ("forward" | "recompute", {module: [scale copies]},
# {module: copies used so far in this recomputation}), or empty.
_PHASE: list[tuple[str, dict, dict]] = []


class _Phase:
    """A checkpoint phase (re-enterable: torch enters the recomputation context once per
    recomputation, and a graph kept with ``retain_graph`` is recomputed again). Given
    ``autocast_state`` (recomputation), re-enter that ``fp8_autocast`` state (``()``: FP8 off)."""

    def __init__(self, name: str, record: dict, autocast_state=None):
        self.name, self.record, self.autocast_state = name, record, autocast_state
        self._restore: list = []

    def __enter__(self):
        restore = contextlib.nullcontext()
        if self.autocast_state is not None:
            enabled, rec, group = self.autocast_state or (False, None, None)
            restore = _recipe.fp8_autocast(enabled, rec, group)
        restore.__enter__()
        self._restore.append(restore)
        _PHASE.append((self.name, self.record, {}))
        return self

    def __exit__(self, *exc):
        _PHASE.pop()
        return self._restore.pop().__exit__(*exc)


def delayed_scale_for(module, scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The delayed-scaling ``scale`` a layer's FP8 forward should use, and whether this is a
    recomputation (then the layer must leave its scaling state alone)."""
    if not _PHASE:
        return scale, False
    name, record, used = _PHASE[-1]
    if name == "forward":
        record.setdefault(module, []).append(scale.clone())
        return scale, False
    copies, i = record.get(module, ()), used.get(module, 0)
    if i >= len(copies):
        raise RuntimeError("checkpoint: the recomputation called a cugrouped layer with delayed "
                           "scaling that the forward did not (the checkpointed function must "
                           "run the same layers in the same order both times)")
    used[module] = i + 1
    return copies[i], True


def checkpoint(function, *args, use_reentrant: bool = False,
               distribute_saved_activations: bool = False, get_rng_state_tracker=None,
               tp_group=None, **kwargs):
    """``function(*args, **kwargs)`` with its activations recomputed in backward instead of
    saved (``torch.utils.checkpoint.checkpoint``, non-reentrant), under the FP8 autocast state
    of this call and with each cugrouped layer's forward scales (see the module docstring).

    ``use_reentrant`` must be False (the reentrant variant cannot restore the FP8 state).
    TransformerEngine's ``distribute_saved_activations`` (must be False), ``get_rng_state_tracker``
    and ``tp_group`` (must be None: tensor parallelism is not supported) are accepted for
    compatibility; torch's own CPU/CUDA RNG state is restored for the recomputation as usual.
    Other keyword arguments go to ``function``.
    """
    if use_reentrant:
        raise ValueError("use_reentrant: only the non-reentrant checkpoint can recompute under "
                         "the forward's FP8 state; pass use_reentrant=False")
    if distribute_saved_activations:
        raise ValueError("distribute_saved_activations: needs tensor parallelism, which is not "
                         "supported; leave it False")
    for name, v in (("get_rng_state_tracker", get_rng_state_tracker), ("tp_group", tp_group)):
        if v is not None:
            raise ValueError(f"{name}: tensor-parallel RNG tracking is not supported; pass None")
    if not callable(function):
        raise TypeError(f"function: expected a callable, got {type(function).__name__}")
    state = _recipe._STACK[-1] if _recipe._STACK else ()
    record: dict = {}

    def contexts():
        return _Phase("forward", record), _Phase("recompute", record, state)

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             context_fn=contexts, **kwargs)
