"""FP8 recipes (frozen dataclasses, data only) and ``fp8_autocast``, in TransformerEngine's style.

::

    from cugrouped.pytorch import fp8_autocast, DelayedScaling, Float8CurrentScaling, Format
    with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(amax_history_len=16)):
        y = layer(x, m_splits)

Formats: ``Format.HYBRID`` (E4M3 for inputs and weights, E5M2 for gradients; the default) or
``Format.E4M3`` (everything E4M3). E5M2 everywhere is not offered: cuBLASLt has no E5M2 x E5M2
GEMM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum

__all__ = ["Format", "DelayedScaling", "Float8CurrentScaling", "fp8_autocast", "get_fp8_recipe",
           "is_fp8_enabled", "Recipe"]


class Format(enum.Enum):
    """FP8 formats of the forward (inputs, weights) and backward (grad output) tensors."""

    E4M3 = "e4m3"
    HYBRID = "hybrid"

    @property
    def forward(self) -> str:
        return "e4m3"

    @property
    def backward(self) -> str:
        return "e5m2" if self is Format.HYBRID else "e4m3"


def _check_format(fmt) -> None:
    if not isinstance(fmt, Format):
        raise TypeError(f"fp8_format: expected a cugrouped.pytorch.Format (E4M3 or HYBRID), got "
                        f"{fmt!r}")


def _check_margin(margin) -> None:
    if not isinstance(margin, int) or isinstance(margin, bool) or not 0 <= margin <= 64:
        raise ValueError(f"margin: expected an int in [0, 64], got {margin!r}")


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Scales from a window of past amaxes, per expert and per tensor (input, weight, grad output),
    kept on the device and updated for all experts in one launch per step.

    ``scale = fp8_max / reduce(history) / 2^margin`` where ``reduce`` is ``"max"`` over the last
    ``amax_history_len`` steps (NaN entries skipped) or ``"most_recent"``. A reduced amax that is
    0 (an expert that saw no tokens in the window), inf or NaN keeps the previous scale, as in
    TransformerEngine; a fresh state starts from scale 1.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self):
        _check_margin(self.margin)
        _check_format(self.fp8_format)
        if not isinstance(self.amax_history_len, int) or not 1 <= self.amax_history_len <= 1 << 16:
            raise ValueError(f"amax_history_len: expected an int in [1, 65536], got "
                             f"{self.amax_history_len!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo: expected 'max' or 'most_recent' (a callable, as "
                             f"TransformerEngine allows, is not supported), got "
                             f"{self.amax_compute_algo!r}")

    def delayed(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling:
    """Scales from this step's amax of each expert's tensor: ``fp8_max / amax / 2^margin``
    (computed on the device by the cast kernel; two launches per cast, no state)."""

    fp8_format: Format = Format.HYBRID
    margin: int = 0

    def __post_init__(self):
        _check_format(self.fp8_format)
        _check_margin(self.margin)

    def delayed(self) -> bool:
        return False


Recipe = DelayedScaling | Float8CurrentScaling

# The active autocast state. A plain module global (as in TransformerEngine): torch.compile guards
# on it, a ContextVar it would not trace.
_STACK: list[tuple[bool, Recipe | None, object]] = []


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, fp8_recipe: Recipe | None = None, fp8_group=None):
    """Run cugrouped layers inside the block in FP8 with ``fp8_recipe`` (default
    ``DelayedScaling()``); ``enabled=False`` turns FP8 off inside an enclosing autocast.

    ``fp8_group`` (a ``torch.distributed`` process group, as in TransformerEngine): with delayed
    scaling, every step's amaxes are all-reduced (max) over it before the scales are updated, so
    the ranks holding replicas of the same experts (data parallel) keep identical scales. One
    collective of ``3 E`` floats per layer per step, on the current stream (no host sync with
    NCCL). With expert parallelism pass the group of the ranks that hold the *same* experts, not
    the expert-parallel group. Current scaling takes each cast's own amax (no reduction).
    Unlike TransformerEngine, ``fp8_group=None`` means no reduction even when torch.distributed
    is initialized (TE reduces over the world by default): over an expert-parallel world that
    would mix the amaxes of different experts, so the group is left to the caller."""
    if fp8_recipe is None:
        fp8_recipe = DelayedScaling()
    if not isinstance(fp8_recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError(f"fp8_recipe: expected DelayedScaling or Float8CurrentScaling, got "
                        f"{type(fp8_recipe).__name__}")
    _STACK.append((bool(enabled), fp8_recipe, fp8_group))
    try:
        yield
    finally:
        _STACK.pop()


def is_fp8_enabled() -> bool:
    return bool(_STACK) and _STACK[-1][0]


def get_fp8_recipe() -> Recipe | None:
    """The recipe of the innermost enabled ``fp8_autocast``, or None."""
    return _STACK[-1][1] if is_fp8_enabled() else None


def get_fp8_group():
    """The amax-reduction group of the innermost enabled ``fp8_autocast``, or None."""
    return _STACK[-1][2] if is_fp8_enabled() else None
