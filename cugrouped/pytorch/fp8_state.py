"""Delayed-scaling state of one grouped layer: per expert amax histories and scales of its input,
weight and grad output, on the layer's device.

Tensor ``t`` of the state, for E experts: ``t = e`` input of expert e, ``E + e`` its weight,
``2E + e`` its grad output; so with HYBRID the first 2E are E4M3 and the last E are E5M2, which is
the single format boundary the update kernel takes (one launch for all 3E tensors).

``amax`` holds the pending amaxes: forward casts (input, weight) max-merge into their slices,
so forwards that run ahead of their backwards (pipeline schedules) all count; the grad-output
cast writes its slice. The update (once per step, in the layer's backward) rolls them into
``amax_history`` (a tensor whose pending amax is 0, e.g. an expert without tokens, keeps its
history and scale, as in TransformerEngine), recomputes ``scale`` / ``scale_inv`` and zeroes
``amax``. A cast in step t therefore uses the scale derived from the amaxes of steps < t
(TransformerEngine's delayed scaling).
"""

from __future__ import annotations

import torch

from .recipe import DelayedScaling

__all__ = ["DelayedScalingState", "INPUT", "WEIGHT", "GRAD_OUTPUT", "select_experts",
           "expert_rows", "merge_expert_rows"]

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
_NAMES = ("amax_history", "amax", "scale", "scale_inv")


class DelayedScalingState:
    """Device buffers: ``amax_history (3E, L)`` (newest first), ``amax``, ``scale``,
    ``scale_inv`` ``(3E,)``, all float32. Fresh state: zero history, scale 1."""

    def __init__(self, num_experts: int, recipe: DelayedScaling, device, tensors=None):
        self.num_experts = num_experts
        self.recipe = recipe
        T, L = 3 * num_experts, recipe.amax_history_len
        if tensors is None:
            tensors = {"amax_history": torch.zeros((T, L), dtype=torch.float32, device=device),
                       "amax": torch.zeros(T, dtype=torch.float32, device=device),
                       "scale": torch.ones(T, dtype=torch.float32, device=device),
                       "scale_inv": torch.ones(T, dtype=torch.float32, device=device)}
        self.tensors = tensors

    def __repr__(self) -> str:
        """Experts, format, margin, history length and device: tensor metadata only (no device
        read, no sync)."""
        r, hist = self.recipe, self.tensors["amax_history"]
        return (f"DelayedScalingState(experts={self.num_experts}, fp8_format={r.fp8_format.name}, "
                f"margin={r.margin}, amax_history_len={hist.shape[1]}, device={hist.device})")

    def compatible(self, recipe: DelayedScaling, num_experts: int) -> bool:
        """Whether this state's scales mean the same thing under ``recipe``: same experts, FP8
        format and margin (the history length and the amax algorithm may differ)."""
        r = self.recipe
        return (num_experts == self.num_experts and recipe.fp8_format == r.fp8_format
                and recipe.margin == r.margin)

    def matches(self, recipe: DelayedScaling, num_experts: int) -> bool:
        """Usable as it is for ``recipe``: :meth:`compatible` and the same history length."""
        return (self.compatible(recipe, num_experts)
                and recipe.amax_history_len == self.tensors["amax_history"].shape[1])

    def with_history_len(self, recipe: DelayedScaling) -> DelayedScalingState:
        """This state for ``recipe`` (:meth:`compatible` with it), its amax history cut to the
        newest ``recipe.amax_history_len`` entries or zero-padded on the old end (what
        TransformerEngine's ``adjust_amax_history_length`` is for; its own history keeps the
        pending row and the oldest ones instead); ``amax``, ``scale`` and ``scale_inv`` are kept
        (the same tensors)."""
        if not self.compatible(recipe, self.num_experts):
            raise ValueError(f"recipe: format/margin differ from the state's {self.recipe}")
        hist = self.tensors["amax_history"]
        L, old = recipe.amax_history_len, hist.shape[1]
        if L <= old:
            new = hist[:, :L].clone()
        else:
            new = torch.nn.functional.pad(hist, (0, L - old))
        return DelayedScalingState(self.num_experts, recipe, hist.device,
                                   {**self.tensors, "amax_history": new.contiguous()})

    def offset(self, which: int) -> int:
        return which * self.num_experts

    def num_e4m3(self) -> int:
        """Tensors before the E5M2 boundary: all of them unless the recipe is HYBRID."""
        return 3 * self.num_experts if self.recipe.fp8_format.backward == "e4m3" else 2 * self.num_experts

    def to_dict(self) -> dict:
        r = self.recipe
        return {"recipe": {"margin": r.margin, "fp8_format": r.fp8_format.value,
                           "amax_history_len": r.amax_history_len,
                           "amax_compute_algo": r.amax_compute_algo},
                "num_experts": self.num_experts,
                **{k: self.tensors[k] for k in _NAMES}}

    @classmethod
    def from_dict(cls, state: dict, device) -> DelayedScalingState:
        from .recipe import Format

        missing = [k for k in ("recipe", "num_experts", *_NAMES) if k not in state]
        if missing:
            raise ValueError(f"state_dict: FP8 extra state lacks {missing}")
        r = state["recipe"]
        recipe = DelayedScaling(margin=r["margin"], fp8_format=Format(r["fp8_format"]),
                                amax_history_len=r["amax_history_len"],
                                amax_compute_algo=r["amax_compute_algo"])
        E = int(state["num_experts"])
        want = {"amax_history": (3 * E, recipe.amax_history_len), "amax": (3 * E,),
                "scale": (3 * E,), "scale_inv": (3 * E,)}
        tensors = {}
        for k, shape in want.items():
            t = state[k]
            if tuple(t.shape) != shape:
                raise ValueError(f"state_dict: FP8 extra state {k} has shape {tuple(t.shape)}, "
                                 f"expected {shape}")
            tensors[k] = t.detach().to(device=device, dtype=torch.float32, copy=True).contiguous()
        return cls(E, recipe, device, tensors)


# -- a saved state (``DelayedScalingState.to_dict``) cut into experts and put back together -----
def select_experts(state: dict, first: int, count: int) -> dict:
    """The part of ``state`` that belongs to experts ``first .. first + count - 1``, renumbered
    from 0 (each tensor's input, weight and grad-output rows of those experts)."""
    E = int(state["num_experts"])
    rows = [w * E + first + i for w in range(3) for i in range(count)]
    idx = torch.tensor(rows)
    return {**state, "num_experts": count,
            **{k: state[k].index_select(0, idx.to(state[k].device)) for k in _NAMES}}


def expert_rows(state: dict | None, num_experts: int, device=None) -> list:
    """``state`` as one state per expert (None for each without one), its tensors on ``device``
    (default: where they are)."""
    if state is None:
        return [None] * num_experts
    if device is not None:
        state = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    return [select_experts(state, e, 1) for e in range(num_experts)]


def merge_expert_rows(states: list):
    """The inverse of :func:`expert_rows`: per-expert states (dicts of one expert each; None or
    TransformerEngine's empty uint8 tensor for "no state") as one, or None when none has one."""
    states = [None if _no_te_state(s) else s for s in states]
    if all(s is None for s in states):
        return None
    te = [i for i, s in enumerate(states) if isinstance(s, torch.Tensor)]
    if te:
        raise ValueError(f"state_dict: FP8 extra state of expert {te[0]} is TransformerEngine's "
                         f"delayed-scaling state; convert each expert's with "
                         f"cugrouped.pytorch.from_te_extra_state(..., te_version=...), or replace "
                         f"them with torch.empty(0, dtype=torch.uint8) to start afresh")
    bad = [i for i, s in enumerate(states)
           if not isinstance(s, dict) or int(s.get("num_experts", -1)) != 1]
    if bad:
        raise ValueError(f"state_dict: FP8 extra state of expert {bad[0]} is "
                         f"{type(states[bad[0]]).__name__}, expected cugrouped's state of one "
                         f"expert like the others'")
    if any(s["recipe"] != states[0]["recipe"] for s in states):
        raise ValueError("state_dict: the experts' FP8 extra states have different recipes")
    return {**states[0], "num_experts": len(states),
            **{k: torch.cat([s[k][w:w + 1] for w in range(3) for s in states]) for k in _NAMES}}


def _no_te_state(s) -> bool:
    """None, TransformerEngine's "no FP8 state" (an empty uint8 tensor), or its serialized state
    of a recipe that keeps none (no delayed-scaling tensors in the pickle)."""
    if not isinstance(s, torch.Tensor):
        return s is None
    return s.numel() == 0 or b"amax_history_fwd" not in s.detach().cpu().numpy().tobytes()
