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
    recomputation, and a graph kept with ``retain_graph`` is recomputed again). The
    recomputation (``autocast_state`` given) re-enters that ``fp8_autocast`` state (``()``: FP8
    off) and, given a tracker, runs with the tracker's RNG states of the forward (put back
    after it)."""

    def __init__(self, name: str, record: dict, autocast_state=None, tracker=None,
                 rng_states=None):
        self.name, self.record, self.autocast_state = name, record, autocast_state
        self.tracker, self.rng_states = tracker, rng_states
        self._restore: list = []

    def __enter__(self):
        restore = contextlib.nullcontext()
        if self.autocast_state is not None:
            enabled, rec, group, calibrating = self.autocast_state or (False, None, None, False)
            restore = _recipe.fp8_autocast(enabled, rec, group, calibrating=calibrating)
        outer_rng = None
        if self.tracker is not None:
            outer_rng = _copy_states(self.tracker.get_states())
            self.tracker.set_states(_copy_states(self.rng_states))
        restore.__enter__()
        self._restore.append((restore, outer_rng))
        _PHASE.append((self.name, self.record, {}))
        return self

    def __exit__(self, *exc):
        _PHASE.pop()
        restore, outer_rng = self._restore.pop()
        if self.tracker is not None:
            self.tracker.set_states(outer_rng)
        return restore.__exit__(*exc)


class _Both:
    """Enter ``outer`` then ``inner`` (re-enterable when both are)."""

    def __init__(self, outer, inner):
        self.outer, self.inner = outer, inner
        self._stacks: list = []

    def __enter__(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.outer)
            stack.enter_context(self.inner)
            self._stacks.append(stack.pop_all())
        return self

    def __exit__(self, *exc):
        return self._stacks.pop().__exit__(*exc)


def _copy_states(states: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in states.items()}


def recomputing() -> bool:
    """Whether this runs inside a checkpoint's recomputation."""
    return len(_PHASE) > 0 and _PHASE[-1][0] == "recompute"


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

    TransformerEngine's keyword arguments:

    * ``use_reentrant`` must be False (the reentrant variant cannot restore the FP8 state;
      TransformerEngine defaults to True, the gradients are the same);
    * ``get_rng_state_tracker``: None, or a callable returning an RNG states tracker
      (Megatron-LM's ``get_cuda_rng_tracker``: ``get_states()`` / ``set_states(states)``): the
      recomputation runs from the tracker's states of the forward (so dropout inside its
      ``fork()`` draws the same masks), and the tracker is put back afterwards. torch's own
      CPU/CUDA RNG states are restored by torch's checkpoint, as usual;
    * ``distribute_saved_activations``, ``tp_group``: no effect without reentrant
      checkpointing, as in TransformerEngine.

    torch's own options (``preserve_rng_state``, ``determinism_check``, ``debug``) go to
    torch's checkpoint; a ``context_fn`` of the caller's is entered too (outside ours). Other
    keyword arguments go to ``function``. Not under ``torch.compile`` (torch's compiled
    checkpoint takes no ``context_fn``).
    """
    if use_reentrant:
        raise ValueError("use_reentrant: only the non-reentrant checkpoint can recompute under "
                         "the forward's FP8 state; pass use_reentrant=False")
    if not isinstance(distribute_saved_activations, bool):
        raise TypeError(f"distribute_saved_activations: expected a bool, got "
                        f"{distribute_saved_activations!r}")
    if not callable(function):
        raise TypeError(f"function: expected a callable, got {type(function).__name__}")
    if torch.compiler.is_compiling():
        raise RuntimeError("checkpoint: not under torch.compile (the recomputation's FP8 state "
                           "needs a context_fn, which compiled checkpoints do not take); "
                           "compile inside the checkpointed function, or checkpoint outside "
                           "the compiled region")
    user_contexts = kwargs.pop("context_fn", None)
    if user_contexts is not None and not callable(user_contexts):
        raise TypeError(f"context_fn: expected a callable returning two context managers, got "
                        f"{type(user_contexts).__name__}")
    tracker = rng_states = None
    if get_rng_state_tracker is not None:
        if not callable(get_rng_state_tracker):
            raise TypeError(f"get_rng_state_tracker: expected None or a callable returning an "
                            f"RNG states tracker, got {type(get_rng_state_tracker).__name__}")
        tracker = get_rng_state_tracker()
        if not all(callable(getattr(tracker, f, None)) for f in ("get_states", "set_states")):
            raise TypeError(f"get_rng_state_tracker: its tracker ({type(tracker).__name__}) needs "
                            f"get_states() and set_states(states)")
        rng_states = _copy_states(tracker.get_states())
    state = _recipe._STACK[-1] if _recipe._STACK else ()
    record: dict = {}

    def contexts():
        ours = (_Phase("forward", record), _Phase("recompute", record, state, tracker, rng_states))
        if user_contexts is None:
            return ours
        theirs = user_contexts()
        return _Both(theirs[0], ours[0]), _Both(theirs[1], ours[1])

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             context_fn=contexts, **kwargs)
