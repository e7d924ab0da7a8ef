"""FP8 recipes (frozen dataclasses, data only) and ``fp8_autocast``, in TransformerEngine's style.

::

    from cugrouped.pytorch import fp8_autocast, DelayedScaling, Float8CurrentScaling, Format
    with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(amax_history_len=16)):
        y = layer(x, m_splits)

Recipes: ``DelayedScaling`` (scales from an amax history, per expert), ``Float8CurrentScaling``
(each cast's own amax), ``Float8BlockScaling`` (a scale per 1 x 128 / 128 x 128 block; Hopper
GEMMs) and ``MXFP8BlockScaling`` (an E8M0 scale per 32 elements; Blackwell GEMMs).

Formats: ``Format.HYBRID`` (E4M3 for inputs and weights, E5M2 for gradients; the default) or
``Format.E4M3`` (everything E4M3). E5M2 everywhere is not offered: cuBLASLt has no E5M2 x E5M2
GEMM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum

__all__ = ["Format", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
           "MXFP8BlockScaling", "BLOCK_RECIPES", "QParams",
           "MMParams",
           "fp8_autocast", "autocast", "get_fp8_recipe", "is_fp8_enabled", "Recipe"]


class Format(enum.Enum):
    """FP8 formats of the forward (inputs, weights) and backward (grad output) tensors. ``E5M2``
    exists as in TransformerEngine, and as there the recipes refuse it (pure E5M2 training)."""

    E4M3 = "e4m3"
    HYBRID = "hybrid"
    E5M2 = "e5m2"

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
    if fmt is Format.E5M2:
        raise ValueError("fp8_format: pure E5M2 training is not supported (as in "
                         "TransformerEngine); use Format.HYBRID (E5M2 gradients) or Format.E4M3")


def _check_margin(margin) -> None:
    if not isinstance(margin, int) or isinstance(margin, bool) or not 0 <= margin <= 64:
        raise ValueError(f"margin: expected an int in [0, 64], got {margin!r}")


BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


def _check_te_options(recipe) -> None:
    """TransformerEngine's recipe fields: ``fp8_dpa``, ``fp8_mha`` configure attention (no
    effect here); ``override_linear_precision`` may only move the wgrad GEMM to high precision
    (as in TransformerEngine); ``backward_override`` (current scaling only)."""
    for name in ("fp8_dpa", "fp8_mha"):
        if not isinstance(getattr(recipe, name), bool):
            raise TypeError(f"{name}: expected a bool, got {getattr(recipe, name)!r}")
    olp = recipe.override_linear_precision
    if not isinstance(olp, tuple) or len(olp) != 3 or not all(isinstance(v, bool) for v in olp):
        raise TypeError(f"override_linear_precision: expected a tuple of 3 bools (fprop, dgrad, "
                        f"wgrad), got {olp!r}")
    if olp[0] or olp[1]:
        raise ValueError(f"override_linear_precision: only the wgrad GEMM can run in high "
                         f"precision (as in TransformerEngine); got {olp!r}")
    if recipe.backward_override not in BACKWARD_OVERRIDES:
        raise ValueError(f"backward_override: expected one of {BACKWARD_OVERRIDES}, got "
                         f"{recipe.backward_override!r}")


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Scales from a window of past amaxes, per expert and per tensor (input, weight, grad output),
    kept on the device and updated for all experts in one launch per step.

    ``scale = fp8_max / reduce(history) / 2^margin`` where ``reduce`` is ``"max"`` over the last
    ``amax_history_len`` steps (NaN entries skipped) or ``"most_recent"``. As in
    TransformerEngine, a step whose amax is 0 (an expert that received no tokens, a weight reused
    with ``is_first_microbatch=False``) leaves that tensor's history and scale as they are, and a
    reduced amax that is inf or NaN keeps the previous scale; a fresh state starts from scale 1.

    When the scales move: a layer's backward updates all three tensors' scales, for all experts,
    in one launch; a forward only records its amaxes (max-merged until that backward). This
    differs from TransformerEngine, which also updates the forward tensors' scales when the
    outermost ``fp8_autocast`` exits: here forwards with no backward (an evaluation loop, a
    warm-up) keep the scales they found. To set the forward scales without training, run the
    forwards under ``fp8_autocast(enabled=False, fp8_recipe=recipe, calibrating=True)``.

    ``reduce_amax``: all-reduce (max) each step's amaxes over ``fp8_autocast``'s ``fp8_group``
    when one is given (False: never). ``override_linear_precision=(False, False, True)``: the
    wgrad GEMM in the activation dtype, from the saved input (not its FP8 copy) and the
    unquantized grad output (fprop and dgrad stay FP8). Also accepted for TransformerEngine
    compatibility: ``fp8_dpa``, ``fp8_mha`` (attention options, no effect here),
    ``scaling_factor_compute_algo`` and ``backward_override`` (only None).
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    scaling_factor_compute_algo: None = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)
    backward_override: None = None

    def __post_init__(self):
        _check_margin(self.margin)
        _check_format(self.fp8_format)
        _check_te_options(self)
        if self.backward_override is not None:
            raise ValueError(f"backward_override: delayed scaling supports only None (as in "
                             f"TransformerEngine); use Float8CurrentScaling for "
                             f"{self.backward_override!r}")
        if self.scaling_factor_compute_algo is not None:
            raise ValueError("scaling_factor_compute_algo: a custom scale function is not "
                             "supported (the scale update runs in a CUDA kernel); leave it None")
        if not isinstance(self.reduce_amax, bool):
            raise TypeError(f"reduce_amax: expected a bool, got {self.reduce_amax!r}")
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
class QParams:
    """How current scaling derives one tensor's scale from its amax (TransformerEngine's
    ``QParams``): ``amax_epsilon`` (0, or a normal float32) is a floor under the amax, so an
    all-zero expert gets ``fp8_max / amax_epsilon`` rather than 1; ``power_2_scale`` rounds the
    scale down to a power of two, so that ``scale_inv`` is exact and scaling loses no mantissa
    bits. Both are applied on the device by the cast kernel. TransformerEngine's FP4 fields
    (``random_hadamard_transform``, ``stochastic_rounding``, ``fp4_2d_quantization``) are
    accepted as False only."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False
    # filled in by Float8CurrentScaling from use_power_2_scales (not given by the caller), so that
    # dataclasses.replace(recipe, use_power_2_scales=...) derives it again
    _derived: bool = dataclasses.field(default=False, compare=False, repr=False)

    def __post_init__(self):
        from ..ops._cast_inputs import check_scale_options

        check_scale_options(self.amax_epsilon, self.power_2_scale, None)
        for name in ("random_hadamard_transform", "stochastic_rounding", "fp4_2d_quantization"):
            if getattr(self, name) is not False:
                raise ValueError(f"{name}: an FP4 option of TransformerEngine; FP8 per-tensor "
                                 f"scaling supports only False, got {getattr(self, name)!r}")

    def options(self) -> tuple[float, bool]:
        """``(amax_epsilon, power_2_scale)`` as the cast op takes them."""
        return float(self.amax_epsilon), bool(self.power_2_scale)


_QPARAMS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")


@dataclasses.dataclass(frozen=True)
class MMParams:
    """An FP8 GEMM's accumulation (TransformerEngine's ``MMParams``): ``use_split_accumulator``
    True promotes partial sums to full float32 precision (cuBLASLt without ``FAST_ACCUM``);
    False is Hopper's fast accumulation (faster, a few more bits of error on long reductions)."""

    use_split_accumulator: bool = True

    def __post_init__(self):
        if not isinstance(self.use_split_accumulator, bool):
            raise TypeError(f"use_split_accumulator: expected a bool, got "
                            f"{self.use_split_accumulator!r}")


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling:
    """Scales from this step's amax of each expert's tensor: ``fp8_max / amax / 2^margin``
    (computed on the device by the cast kernel; two launches per cast, no state).

    ``backward_override`` (TransformerEngine's): None (FP8 dgrad and wgrad), ``"high_precision"``
    (backward in the activation dtype from the original input and weights, which forward keeps
    instead of FP8 copies), or ``"dequantized"`` (backward in the activation dtype from the
    forward's FP8 input and weights, dequantized: the gradients of the function forward
    computed). ``override_linear_precision=(False, False, True)``: only the wgrad GEMM in high
    precision. ``fp8_dpa``, ``fp8_mha``: attention options, accepted with no effect here.

    ``fp8_quant_fwd_inp``, ``fp8_quant_fwd_weight``, ``fp8_quant_bwd_grad``: :class:`QParams`
    (``amax_epsilon``, ``power_2_scale``) of the input, weight and grad-output casts, as in
    TransformerEngine; each left None is ``QParams(power_2_scale=use_power_2_scales)``.
    ``fp8_gemm_fprop``, ``fp8_gemm_dgrad``, ``fp8_gemm_wgrad``: :class:`MMParams` of the three
    FP8 GEMMs (TransformerEngine's defaults: fast accumulation in fprop only; delayed scaling
    always uses those)."""

    fp8_format: Format = Format.HYBRID
    margin: int = 0
    fp8_dpa: bool = False
    fp8_mha: bool = False
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)
    backward_override: str | None = None
    use_power_2_scales: bool = False
    fp8_quant_fwd_inp: QParams | None = None
    fp8_quant_fwd_weight: QParams | None = None
    fp8_quant_bwd_grad: QParams | None = None
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)

    def __post_init__(self):
        _check_format(self.fp8_format)
        _check_margin(self.margin)
        _check_te_options(self)
        if not isinstance(self.use_power_2_scales, bool):
            raise TypeError(f"use_power_2_scales: expected a bool, got {self.use_power_2_scales!r}")
        for name in _QPARAMS:
            q = getattr(self, name)
            if q is None or (isinstance(q, QParams) and q._derived):
                object.__setattr__(self, name, QParams(power_2_scale=self.use_power_2_scales,
                                                       _derived=True))
            elif not isinstance(q, QParams):
                raise TypeError(f"{name}: expected a cugrouped.pytorch.QParams or None, got "
                                f"{type(q).__name__}")
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            if not isinstance(getattr(self, name), MMParams):
                raise TypeError(f"{name}: expected a cugrouped.pytorch.MMParams, got "
                                f"{type(getattr(self, name)).__name__}")

    def delayed(self) -> bool:
        return False


def _power_2_default() -> bool:
    """TransformerEngine's default for block scaling: power-of-two scales, unless the
    environment sets ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``."""
    import os

    return os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") != "1"


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling:
    """Block scaling (TransformerEngine's ``Float8BlockScaling``, DeepSeek-V3's recipe): every
    block of 128 elements of a row of the input and of the grad output (``*_block_scaling_dim=1``)
    and every 128 x 128 block of the weights (``w_block_scaling_dim=2``) gets the scale of its own
    amax, computed by the cast kernel in the pass that casts it (one launch per cast, no state);
    the GEMMs read the block scales (cuBLASLt's ``VEC128_32F`` / ``BLK128x128_32F``, on Hopper
    only) and always accumulate in split (full float32) mode.

    ``fp8_quant_fwd_inp``, ``fp8_quant_fwd_weight``, ``fp8_quant_bwd_grad``: :class:`QParams`,
    by default power-of-two scales (TransformerEngine's, and ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``
    turns that off as there). ``fp8_gemm_*``: :class:`MMParams` with ``use_split_accumulator=True``
    (required, as in TransformerEngine). The layer's GEMMs need every expert's token count to be
    a multiple of 8 (TransformerEngine's MoE pads to 16). Supported: the default FP8 backward
    (``backward_override=None``, ``override_linear_precision`` all False); ``fp8_dpa``,
    ``fp8_mha``: attention options, accepted as False only."""

    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams | None = None
    fp8_quant_fwd_weight: QParams | None = None
    fp8_quant_bwd_grad: QParams | None = None
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)

    margin = 0   # no margin in block scaling (a class constant, read by the layer)
    token_multiple = 8    # what the GEMMs need of every expert's token count
    token_padding = 16    # what MoEFeedForward pads each expert's rows to (TE's Fp8Padding)

    def __post_init__(self):
        _check_format(self.fp8_format)
        _check_te_options(self)
        if self.backward_override is not None or any(self.override_linear_precision):
            raise ValueError("backward_override, override_linear_precision: Float8BlockScaling "
                             "supports the default FP8 backward only here")
        if self.fp8_dpa or self.fp8_mha:
            raise ValueError("fp8_dpa, fp8_mha: FP8 attention is not supported with "
                             "Float8BlockScaling (as in TransformerEngine)")
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            v = getattr(self, name)
            if v not in (1, 2) or isinstance(v, bool):
                raise ValueError(f"{name}: expected 1 or 2, got {v!r}")
        for a, b in (("x", "w"), ("x", "grad"), ("w", "grad")):
            if getattr(self, f"{a}_block_scaling_dim") == getattr(self, f"{b}_block_scaling_dim") == 2:
                raise ValueError(f"{a}_block_scaling_dim, {b}_block_scaling_dim: their GEMM "
                                 "would be 2-D by 2-D, which cuBLASLt does not offer")
        p2 = _power_2_default()
        for name in _QPARAMS:
            q = getattr(self, name)
            if q is None:
                object.__setattr__(self, name, QParams(power_2_scale=p2))
            elif not isinstance(q, QParams):
                raise TypeError(f"{name}: expected a cugrouped.pytorch.QParams or None, got "
                                f"{type(q).__name__}")
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            mm = getattr(self, name)
            if not isinstance(mm, MMParams):
                raise TypeError(f"{name}: expected a cugrouped.pytorch.MMParams, got "
                                f"{type(mm).__name__}")
            if not mm.use_split_accumulator:
                raise ValueError(f"{name}: block-scaled GEMMs need use_split_accumulator=True "
                                 "(as in TransformerEngine)")

    def delayed(self) -> bool:
        return False

    @property
    def block_dims(self) -> tuple[int, int, int]:
        """(input, weight, grad output) block dimensions."""
        return (self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim)


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling:
    """MXFP8 (TransformerEngine's ``MXFP8BlockScaling``, the OCP microscaling format of Blackwell's
    tensor cores): every 32 consecutive elements along a row of the input, the weights and the
    grad output (and along the tokens, in the transposed copies the wgrad GEMM reads) get an
    E8M0 scale, the power of two from their own amax, computed by the cast kernel in the pass
    that casts them (no state, no amax pass). The GEMMs read the scales in cuBLASLt's
    ``VEC32_UE8M0`` mode, which needs sm_100 or newer and cuBLAS 12.8+ (on Hopper use
    :class:`Float8BlockScaling`); the casts run anywhere, and on the CPU reference path.

    ``fp8_format``: ``Format.E4M3`` (TransformerEngine's default: E4M3 everywhere) or
    ``Format.HYBRID`` (E5M2 grad output). ``margin``: 0 only (the scales are powers of two from
    each block's amax). ``fp8_dpa``, ``fp8_mha``: attention options, accepted as False only.
    The layer's GEMMs need every expert's token count and both feature sizes to be multiples of
    32 (TransformerEngine's MoE pads tokens to 32 for this recipe; ``MoEFeedForward`` does)."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False

    # read by the layer, as Float8BlockScaling's fields are
    backward_override = None
    override_linear_precision = (False, False, False)
    fp8_gemm_fprop = fp8_gemm_dgrad = fp8_gemm_wgrad = MMParams(use_split_accumulator=True)
    token_multiple = 32
    token_padding = 32
    feature_multiple = 32   # in_features, out_features: whole scale blocks

    def __post_init__(self):
        _check_format(self.fp8_format)
        if self.margin != 0 or not isinstance(self.margin, int) or isinstance(self.margin, bool):
            raise ValueError(f"margin: MXFP8's scales are powers of two from each block's amax; "
                             f"expected 0, got {self.margin!r}")
        for name in ("fp8_dpa", "fp8_mha"):
            if getattr(self, name) is not False:
                raise ValueError(f"{name}: FP8 attention is not part of cugrouped; expected "
                                 f"False, got {getattr(self, name)!r}")

    def delayed(self) -> bool:
        return False

    @property
    def block_dims(self) -> tuple[int, int, int]:
        """(input, weight, grad output) block kinds: MXFP8's everywhere."""
        from ..grouped_block_fp8 import MX_DIMS

        return (MX_DIMS,) * 3


# The recipes whose scales are per block, computed by the cast kernels (no state).
BLOCK_RECIPES = (Float8BlockScaling, MXFP8BlockScaling)

Recipe = DelayedScaling | Float8CurrentScaling | Float8BlockScaling | MXFP8BlockScaling

# The active autocast state. A plain module global (as in TransformerEngine): torch.compile guards
# on it, a ContextVar it would not trace.
_STACK: list[tuple[bool, Recipe | None, object, bool]] = []   # enabled, recipe, group, calibrating


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, fp8_recipe: Recipe | None = None, fp8_group=None, *,
                 calibrating: bool = False):
    """Run cugrouped layers inside the block in FP8 with ``fp8_recipe`` (default
    ``DelayedScaling()``); ``enabled=False`` turns FP8 off inside an enclosing autocast.
    (TransformerEngine's newer name and argument names: :func:`autocast`.)

    ``fp8_group`` (a ``torch.distributed`` process group, as in TransformerEngine): with delayed
    scaling (and its ``reduce_amax`` left True), every step's amaxes are all-reduced (max) over
    it before the scales are updated, so
    the ranks holding replicas of the same experts (data parallel) keep identical scales. One
    collective of ``3 E`` floats per layer per step, on the current stream (no host sync with
    NCCL). With expert parallelism pass the group of the ranks that hold the *same* experts, not
    the expert-parallel group. Current scaling takes each cast's own amax (no reduction).
    Unlike TransformerEngine, ``fp8_group=None`` means no reduction even when torch.distributed
    is initialized (TE reduces over the world by default): over an expert-parallel world that
    would mix the amaxes of different experts, so the group is left to the caller.

    ``calibrating=True`` with ``enabled=False`` and delayed scaling (TransformerEngine's
    calibration): the layers compute in high precision but record their inputs' and weights'
    amaxes and update those scales, as an FP8 forward would, so that a model trained in high
    precision can be saved with FP8 scales ready for inference. (Nothing to record for current
    scaling; with ``enabled=True`` FP8 runs as usual.)"""
    if not isinstance(calibrating, bool):
        raise TypeError(f"calibrating: expected a bool, got {calibrating!r}")
    if fp8_recipe is None:
        fp8_recipe = DelayedScaling()
    if not isinstance(fp8_recipe, (DelayedScaling, Float8CurrentScaling) + BLOCK_RECIPES):
        raise TypeError(f"fp8_recipe: expected DelayedScaling, Float8CurrentScaling, "
                        f"Float8BlockScaling or MXFP8BlockScaling, got {type(fp8_recipe).__name__}")
    _STACK.append((bool(enabled), fp8_recipe, fp8_group, calibrating))
    try:
        yield
    finally:
        _STACK.pop()


def autocast(enabled: bool = True, calibrating: bool = False, recipe: Recipe | None = None,
             amax_reduction_group=None):
    """TransformerEngine's current name for :func:`fp8_autocast`, with its argument names:
    ``recipe`` is ``fp8_recipe``, ``amax_reduction_group`` is ``fp8_group``."""
    return fp8_autocast(enabled, recipe, amax_reduction_group, calibrating=calibrating)


def is_fp8_enabled() -> bool:
    """True inside an enabled ``fp8_autocast`` (the innermost one decides), as in
    TransformerEngine."""
    # len(), not bool(): torch 2.11's Dynamo cannot trace bool() of a list (the GPU image's torch)
    return len(_STACK) > 0 and _STACK[-1][0]


def get_fp8_recipe() -> Recipe | None:
    """The recipe of the innermost enabled ``fp8_autocast``, or None."""
    return _STACK[-1][1] if is_fp8_enabled() else None


def get_fp8_group():
    """The amax-reduction group of the innermost enabled (or calibrating) ``fp8_autocast``, or
    None."""
    return _STACK[-1][2] if is_fp8_enabled() or get_calibration_recipe() is not None else None


def get_calibration_recipe() -> DelayedScaling | None:
    """The delayed-scaling recipe of the innermost ``fp8_autocast`` when it calibrates (FP8 off,
    ``calibrating=True``), else None."""
    if not _STACK:
        return None
    enabled, recipe, _, calibrating = _STACK[-1]
    return recipe if calibrating and not enabled and isinstance(recipe, DelayedScaling) else None
