"""``GroupedLinear``: E expert linear layers ``y_i = x_i · W_iᵀ + b_i`` over a list of per-expert
tensors (or one tensor and its split sizes), in FP8 under :func:`fp8_autocast`.

FP8 path, per step (all experts at once in every launch):

* forward: one cast of the input (row-wise for fprop; the transposed, zero-padded copy only when
  the weights need a gradient), the weights' cast (cached across micro-batches with
  ``is_first_microbatch``), one grouped fprop GEMM writing the unpadded output. Saved for
  backward: the transposed FP8 input and its ``scale_inv`` (not the high-precision input), and
  the transposed FP8 weights.
* backward: one cast of the grad output (row-wise if dgrad is needed, transposed + padded if wgrad
  is, column sums if dbias is; E5M2 under HYBRID), the delayed-scaling update of every tensor of
  every expert (one launch), the grouped dgrad and wgrad GEMMs, each skipped when
  ``ctx.needs_input_grad`` says so. ``fuse_wgrad_accumulation`` accumulates into
  ``weight.main_grad`` (fp32) inside the wgrad GEMM. ``delay_wgrad_compute`` queues the wgrad
  GEMM for ``backward_dw()``; ``save_original_input`` moves the input's transposed cast from
  forward to there.

Without FP8 the same autograd function runs plain torch matmuls (any float dtype, float64 too).
CPU tensors run the cast kernels on the CPU emulator (bit-exact; :func:`set_cpu_cast_backend`
switches to their NumPy twins, same bits, faster) and the GEMMs' NumPy reference.

Host syncs: none, given ``m_splits`` as a host list. A CUDA ``m_splits`` tensor is read back with
``tolist()`` (one sync per call): the per-expert GEMM loop needs host counts.
"""

from __future__ import annotations

import contextlib
import io
import numbers
from collections.abc import Sequence

import numpy as np
import torch

from ..ops._cast_inputs import rows_readable
from . import _custom_ops as cops
from ._grouped_linear_fn import (_check_main_grad, _Config, _GroupedLinearFn, _split, _WgradStore,
                                 main_grad_dtype, num_e4m3, swiglu, update_scales)
from ._gather import check_row_index, gather_rows
from .checkpoint import delayed_scale_for, recomputing
from .fp8_state import INPUT, WEIGHT, DelayedScalingState
from .recipe import (BLOCK_RECIPES, DelayedScaling, Float8CurrentScaling, get_calibration_recipe,
                     get_fp8_group, get_fp8_recipe)

__all__ = ["GroupedLinear", "set_cpu_cast_backend", "cpu_cast_backend"]

FP8_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CPU_CAST_BACKEND = ["emulate"]


def set_cpu_cast_backend(name: str) -> None:
    """How CPU tensors run the cast and scale-update kernels: ``"emulate"`` (default: the CUDA
    sources on the CPU emulator) or ``"reference"`` (their NumPy twins; same bits, faster)."""
    if name not in ("emulate", "reference"):
        raise ValueError(f"name: expected 'emulate' or 'reference', got {name!r}")
    _CPU_CAST_BACKEND[0] = name


def _qparams(recipe, name: str) -> tuple[float, bool]:
    """Current scaling's ``(amax_epsilon, power_2_scale)`` for one tensor role; delayed scaling
    (whose scales come from the history) has none."""
    q = getattr(recipe, name, None)
    return q.options() if q is not None else (0.0, False)


def _fast_accum(recipe) -> tuple[bool, bool, bool]:
    """FP8 fast accumulation of (fprop, dgrad, wgrad): TransformerEngine's defaults (fprop only),
    or a current-scaling recipe's ``fp8_gemm_*`` MMParams (``use_split_accumulator=False``)."""
    mm = [getattr(recipe, f"fp8_gemm_{p}", None) for p in ("fprop", "dgrad", "wgrad")]
    if mm[0] is None:
        return True, False, False
    return tuple(not m.use_split_accumulator for m in mm)


@contextlib.contextmanager
def cpu_cast_backend(name: str):
    """Context-manager form of :func:`set_cpu_cast_backend`."""
    old = _CPU_CAST_BACKEND[0]
    set_cpu_cast_backend(name)
    try:
        yield
    finally:
        _CPU_CAST_BACKEND[0] = old


def apply_keeping_float32(module, apply, fn, recurse, names) -> None:
    """``module._apply`` (``apply``: the base class's) with the float32 buffers ``names``
    (FP8 scales and state, which the kernels read as float32) moved by ``fn`` to its device but
    never cast to another dtype (``.bfloat16()``)."""
    kept = {n: module._buffers.pop(n) for n in names}
    try:
        apply(fn, recurse)
    finally:
        for n, t in kept.items():
            if t is not None:
                moved = fn(t)
                t = moved if moved.dtype == torch.float32 else t.to(device=moved.device)
            module._buffers[n] = t


class GroupedLinear(torch.nn.Module):
    """E independent linear layers applied to E groups of rows (TransformerEngine-compatible).

    Parameters
    ----------
    Every argument after ``out_features`` is keyword-only: TransformerEngine takes them by the
    same names but in another positional order (``sequence_parallel`` fourth), so a positional
    call ported from it fails here instead of meaning something else.

    num_gemms : int  number of experts E.
    in_features, out_features : int  k and n (multiples of 16 for FP8; of 32 for MXFP8).
    bias : bool  per-expert biases ``bias{i}`` (or one ``bias``: ``single_grouped_bias``).
    params_dtype : torch dtype of ``weight{i}`` ``(n, k)`` and ``bias{i}`` ``(n,)`` (or of the
        single grouped ``weight`` ``(E, n, k)`` and ``bias`` ``(E, n)``)
        (default ``torch.get_default_dtype()``).
    device : ``"cuda"`` (default, as in TransformerEngine), ``"cpu"``, ``"meta"`` or None
        (torch's default device, ``torch.set_default_device``). On
        ``"meta"`` nothing is initialised; materialise with ``to_empty(device=...)`` and then call
        :meth:`reset_parameters`.
    fuse_wgrad_accumulation : accumulate weight gradients into ``weight{i}.main_grad`` (fp32,
        or bf16 / fp16 as Megatron keeps it with ``grad_reduce_in_fp32=False``: one dtype for
        all experts; the GEMM accumulates in fp32 and rounds the sum once; allocated by the
        caller, e.g. Megatron's DDP) instead of producing ``weight{i}.grad`` (with
        ``single_grouped_weight``: into the one ``weight.main_grad``, ``(E, n, k)``).
        As in TransformerEngine: the GEMM overwrites ``main_grad`` instead when
        ``is_first_microbatch=True`` or the weight has ``overwrite_main_grad = True``; a weight
        that has a ``grad_added_to_main_grad`` attribute gets it set to True and a dummy
        ``grad`` (so grad-accumulation hooks fire), any other weight ``grad = None``. A
        Megatron-FSDP parameter (``__fsdp_param__``) is asked for it in backward, through
        ``get_main_grad()``.
    init_method : callable(weight) initialising each weight (default: normal, std 0.023, as
        TransformerEngine); biases start at zero.

    Keyword-only, for TransformerEngine / Megatron-LM compatibility (expert layers with expert
    tensor parallelism 1):

    return_bias : bool  if True the bias is not added: forward returns ``(out, biases)``, where
        ``biases`` is the list of the E biases in the activation dtype (E empty tensors when
        ``bias=False``), as TransformerEngine does, so the caller can fuse the addition.
    get_rng_state_tracker : None, or a callable returning a tracker whose ``fork(name)`` context
        the weight initialisation runs in (Megatron's ``get_cuda_rng_tracker``).
    rng_tracker_name : str or None  the name passed to ``fork`` (None: the tracker's default).
    sequence_parallel, tp_group, tp_size, parallel_mode : tensor parallelism. Only a tensor-parallel
        size of 1 is supported (``tp_group`` None or of size 1, ``tp_size=1``), where they are
        no-ops: ``parallel_mode`` may be None, ``"column"`` or ``"row"`` (it only sets the
        TransformerEngine ``tensor_model_parallel`` / ``partition_dim`` attributes of the
        weights), and ``sequence_parallel`` is ignored (``self.sequence_parallel`` is False, as
        in TransformerEngine when the size is 1). A size above 1 raises ``ValueError``.
    ub_overlap_rs, ub_overlap_ag, ub_name : userbuffer overlap; must be off (TransformerEngine's
        GroupedLinear does not support it either).
    delay_wgrad_compute : bool  backward computes dgrad (and dbias) only and queues the weight
        gradients; each :meth:`backward_dw` call computes the oldest queued ones (so they can
        overlap communication, as Megatron's MoE schedules do). Not under ``torch.compile``.
    single_grouped_weight, single_grouped_bias : bool  keep all experts' weights as one
        parameter ``weight`` of shape ``(E, out_features, in_features)`` (and the biases as one
        ``bias``, ``(E, out_features)``) instead of ``weight{i}`` / ``bias{i}``, as
        TransformerEngine 2.14's options of those names (there a ``GroupedTensor``; here a plain
        tensor). One optimizer tensor, one ``main_grad`` ``(E, n, k)`` (whose experts are evenly
        placed, so the wgrad GEMM can be one grouped call), and the Megatron attributes
        (``main_grad``, ``grad_added_to_main_grad``, ``overwrite_main_grad``, ...) on that one
        parameter. ``weights()`` / ``biases()`` return its per-expert views. Checkpoints load
        across the two layouts (``weight{i}`` into ``weight`` and back).
    save_original_input : bool  FP8 with ``Float8CurrentScaling``: save the input itself for
        backward instead of its transposed FP8 copy, and cast that copy in backward (the same
        bits). Saves memory when the input is kept alive anyway (e.g. by the activation
        before it). Refused with ``DelayedScaling``, as in TransformerEngine; no effect
        without FP8.
    name : str or None  TransformerEngine's label for its debug tools; kept as ``self.name``.
    input_activation : None or ``"swiglu"``  (cugrouped's own) the layer's input is fc1's output
        ``[a | b]``, ``2 * in_features`` wide, and the layer applies ``silu(a) * b`` to it: fc2
        of a gated MLP taking fc1's output as it is. With FP8 (every recipe; block scaling with
        1 x 128 input blocks) and the default backward, the cast kernel computes the
        activation in float32 as it casts
        (``activation="swiglu"`` of the per-tensor, block and MXFP8 casts), so its
        high-precision output is never written, and backward returns the input's gradient from
        the dgrad (``swiglu_backward``: autograd's ops); otherwise (no FP8, backward overrides,
        ``save_original_input`` with current scaling, 128 x 128 input blocks) torch computes
        ``F.silu(a) * b`` first, in the input's dtype.
        Under ``torch.autocast`` the fused path reads the input after the layer's cast to the
        autocast dtype, as any input (fc1's output already is in it). Not with ``row_index``.
    """

    def __init__(self, num_gemms: int, in_features: int, out_features: int, *, bias: bool = True,
                 params_dtype: torch.dtype | None = None, device="cuda",
                 fuse_wgrad_accumulation: bool = False, init_method=None,
                 sequence_parallel: bool = False, tp_group=None, tp_size: int = 1,
                 parallel_mode: str | None = None, return_bias: bool = False,
                 get_rng_state_tracker=None, rng_tracker_name: str | None = None,
                 ub_overlap_rs: bool = False, ub_overlap_ag: bool = False,
                 ub_name: str | None = None, delay_wgrad_compute: bool = False,
                 save_original_input: bool = False, single_grouped_weight: bool = False,
                 single_grouped_bias: bool = False, name: str | None = None,
                 input_activation: str | None = None):
        super().__init__()
        if input_activation not in (None, "swiglu"):
            raise ValueError(f"input_activation: expected None or 'swiglu', got "
                             f"{input_activation!r}")
        self.input_activation = input_activation
        for arg, v in (("single_grouped_weight", single_grouped_weight),
                        ("single_grouped_bias", single_grouped_bias)):
            if not isinstance(v, bool):
                raise TypeError(f"{arg}: expected a bool, got {v!r}")
        for arg, v in (("num_gemms", num_gemms), ("in_features", in_features),
                        ("out_features", out_features)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{arg}: expected a positive int, got {v!r}")
        self.tp_size = self._tensor_parallel_size(tp_group, tp_size)
        if parallel_mode not in (None, "column", "row"):
            raise ValueError(f"parallel_mode: expected None, 'column' or 'row', got "
                             f"{parallel_mode!r}")
        if ub_overlap_rs or ub_overlap_ag:
            raise ValueError("ub_overlap_rs, ub_overlap_ag: userbuffer overlap is not supported "
                             "(nor by TransformerEngine's GroupedLinear); leave them False")
        if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
            raise TypeError(f"get_rng_state_tracker: expected None or a callable returning an "
                            f"RNG tracker, got {type(get_rng_state_tracker).__name__}")
        if rng_tracker_name is not None and not isinstance(rng_tracker_name, str):
            raise TypeError(f"rng_tracker_name: expected None or a str, got {rng_tracker_name!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name: expected None or a str, got {name!r}")
        self.name = name                    # TransformerEngine's label for its debug tools
        self.tp_group, self.parallel_mode = tp_group, parallel_mode
        self.sequence_parallel = False      # TransformerEngine: sequence_parallel and tp_size > 1
        self.ub_name = ub_name
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias = bool(bias)
        self.return_bias = bool(return_bias)
        self.apply_bias = self.use_bias and not self.return_bias
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        self.save_original_input = bool(save_original_input)
        self.wgrad_store = _WgradStore() if self.delay_wgrad_compute else None
        self.wgrad_accumulation_and_reduce_hooks = []
        device = check_params_args(params_dtype, device)
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.init_method = init_method
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        self.single_grouped_weight = single_grouped_weight
        self.single_grouped_bias = single_grouped_bias and self.use_bias
        if self.single_grouped_weight:
            self.weight = torch.nn.Parameter(torch.empty(
                num_gemms, out_features, in_features, dtype=self.params_dtype, device=device))
        if self.single_grouped_bias:
            self.bias = torch.nn.Parameter(torch.empty(
                num_gemms, out_features, dtype=self.params_dtype, device=device))
        for i in range(num_gemms):
            if not self.single_grouped_weight:
                self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.empty(
                    out_features, in_features, dtype=self.params_dtype, device=device)))
            if self.use_bias and not self.single_grouped_bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(
                    torch.empty(out_features, dtype=self.params_dtype, device=device)))
        # a plain function with the module passed in (held weakly): a bound method would make
        # the layer refer to itself and wait for the cycle collector to be freed
        self._register_load_state_dict_pre_hook(_load_either_layout, with_module=True)
        for name in ("amax_history", "amax", "scale", "scale_inv"):
            self.register_buffer(f"fp8_{name}", None, persistent=False)
        self._fp8_recipe: DelayedScaling | None = None
        self._fp8_weight_cache: tuple | None = None
        self._grad_acc_cache: tuple | None = None
        self.reset_parameters(defer_init=self._weight_params()[0].is_meta)
        self._mark_parameters()

    @staticmethod
    def _tensor_parallel_size(tp_group, tp_size) -> int:
        """The tensor-parallel size (``tp_group``'s size when given, as in TransformerEngine);
        anything but 1 raises."""
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
            raise ValueError(f"tp_size: expected a positive int, got {tp_size!r}")
        if tp_group is not None:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_initialized():
                raise ValueError("tp_group: given, but torch.distributed is not initialized")
            size = dist.get_world_size(tp_group)
            if size != 1:
                raise ValueError(f"tp_group: tensor parallelism is not supported (the group has "
                                 f"{size} ranks); pass None or a group of size 1")
            return 1
        if tp_size != 1:
            raise ValueError(f"tp_size: tensor parallelism is not supported, got tp_size="
                             f"{tp_size}; leave it at 1")
        return 1

    def reset_parameters(self, defer_init: bool = False) -> None:
        """(Re-)initialise the weights with ``init_method`` (inside the RNG tracker's ``fork`` when
        ``get_rng_state_tracker`` was given) and zero the biases; drops a cached FP8 copy of the
        weights. ``defer_init=True`` does nothing (TransformerEngine's flag, used for ``"meta"``
        construction). The FP8 delayed-scaling state is kept.

        Meta-device flow::

            layer = GroupedLinear(E, k, n, device="meta")
            layer.to_empty(device="cuda")
            layer.reset_parameters()
        """
        if defer_init:
            return
        init = self.init_method or (lambda w: torch.nn.init.normal_(w, mean=0.0, std=0.023))
        fork = contextlib.nullcontext()
        if self.get_rng_state_tracker is not None:
            tracker = self.get_rng_state_tracker()
            fork = tracker.fork(self.rng_tracker_name) if self.rng_tracker_name else tracker.fork()
        with torch.no_grad():
            with fork:
                for w in self.weights():
                    init(w)
            for b in self.biases():
                b.zero_()
        self._mark_parameters()
        self._fp8_weight_cache = None

    def _mark_parameters(self) -> None:
        """The attributes TransformerEngine sets on the parameters (again after ``to_empty``,
        which makes new ones): tensor-parallel ones (size 1 here), and with
        ``delay_wgrad_compute`` ``skip_backward_post_hook`` (Megatron's DDP then skips its
        grad-ready hook for them and registers it with
        :meth:`register_wgrad_accumulation_and_reduce_hooks`, which backward_dw() runs)."""
        for w in self._weight_params():
            w.tensor_model_parallel = True
            w.partition_dim = 1 if self.parallel_mode == "row" else 0   # TE's, in both layouts
            w.partition_stride = 1
        if self.delay_wgrad_compute:
            for p in (*self._weight_params(), *self._bias_params()):
                p.skip_backward_post_hook = True

    # -- parameters ---------------------------------------------------------------------------
    def weights(self) -> list[torch.Tensor]:
        """``[weight0, ..., weight{E-1}]``, each ``(out_features, in_features)`` (with
        ``single_grouped_weight``: the views ``weight[i]``)."""
        if self.single_grouped_weight:
            return list(self.weight.unbind(0))
        return self._per_expert("weight")

    def biases(self) -> list[torch.Tensor]:
        """``[bias0, ...]`` (``(out_features,)`` each; with ``single_grouped_bias`` the views
        ``bias[i]``), or ``[]`` without biases."""
        if not self.use_bias:
            return []
        if self.single_grouped_bias:
            return list(self.bias.unbind(0))
        return self._per_expert("bias")

    def _per_expert(self, kind: str) -> list:
        """The parameters ``{kind}0 ..``, read from ``_parameters`` by names made once (the
        layer calls this a few times a step: ``getattr`` and an f-string per expert cost ~78 us
        at E=64); through ``getattr`` when one is held elsewhere (a wrapper replaced it)."""
        names = self.__dict__.get(f"_{kind}_names")
        if names is None:
            names = tuple(f"{kind}{i}" for i in range(self.num_gemms))
            self.__dict__[f"_{kind}_names"] = names
        params = self._parameters
        try:
            return [params[n] for n in names]
        except KeyError:
            return [getattr(self, n) for n in names]

    def _weight_params(self) -> list[torch.nn.Parameter]:
        """The weight parameters: ``[weight]`` or ``[weight0, ...]``."""
        return [self.weight] if self.single_grouped_weight else self.weights()

    def _bias_params(self) -> list[torch.nn.Parameter]:
        return [self.bias] if self.single_grouped_bias else self.biases()

    def _weight_owners(self) -> list[torch.nn.Parameter]:
        """Per expert, the parameter whose attributes (``main_grad`` flags, AccumulateGrad node)
        stand for its weight."""
        return [self.weight] * self.num_gemms if self.single_grouped_weight else self.weights()


    def extra_repr(self) -> str:
        single = "".join(f", {n}=True" for n in ("single_grouped_weight", "single_grouped_bias")
                         if getattr(self, n))
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}{single}" +
                (f", input_activation={self.input_activation!r}" if self.input_activation
                 else ""))

    # -- delayed-scaling state (saved in state_dict as extra state) ---------------------------
    def fp8_state(self) -> DelayedScalingState | None:
        """The delayed-scaling state (None until a DelayedScaling forward created it)."""
        if self.fp8_amax_history is None:
            return None
        return DelayedScalingState(self.num_gemms, self._fp8_recipe, self.fp8_scale.device,
                                   {n: getattr(self, f"fp8_{n}") for n in
                                    ("amax_history", "amax", "scale", "scale_inv")})

    def init_fp8_state(self, recipe: DelayedScaling) -> DelayedScalingState:
        """Create (or keep, if compatible) the delayed-scaling buffers for ``recipe``. Forward does
        this on first use in eager mode; call it before ``torch.compile`` of a training step
        (which refuses to make the state inside the graph, see ``_delayed_state``).

        A state for another ``amax_history_len`` (same format and margin) is kept: its history
        is cut to the newest entries or zero-padded, and amax, scale and scale_inv stay (the
        case TransformerEngine's ``adjust_amax_history_length`` serves, which in its own history
        layout keeps the pending row and the oldest entries). Another FP8 format or margin (or
        number of experts) starts a fresh state: the scales were derived for the old one."""
        st = self.fp8_state()
        if st is not None and st.matches(recipe, self.num_gemms):
            self._fp8_recipe = recipe
            return self.fp8_state()
        with contextlib.nullcontext() if torch.compiler.is_compiling() else \
                torch.inference_mode(False):      # not inference tensors: training updates them
            if st is not None and st.compatible(recipe, self.num_gemms):
                st = st.with_history_len(recipe)
            else:
                st = DelayedScalingState(self.num_gemms, recipe, self._weight_params()[0].device)
        self._set_state(st)
        return st

    def _apply(self, fn, recurse=True):
        """``module.to(...)``, ``.cuda()``, ``.bfloat16()``...: the FP8 state follows the device
        but stays float32 (the scale update and the casts read float32); a cached FP8 copy of
        the weights is dropped."""
        apply_keeping_float32(self, super()._apply, fn, recurse,
                              [f"fp8_{n}" for n in ("amax_history", "amax", "scale", "scale_inv")])
        self._fp8_weight_cache = self._grad_acc_cache = None
        return self

    def _set_state(self, st: DelayedScalingState | None) -> None:
        for name in ("amax_history", "amax", "scale", "scale_inv"):
            setattr(self, f"fp8_{name}", None if st is None else st.tensors[name])
        self._fp8_recipe = None if st is None else st.recipe
        self._fp8_weight_cache = None

    def get_extra_state(self):
        """The delayed-scaling state as a dict of tensors (None without one). Its structure
        depends on whether a state exists: before ``torch.distributed.checkpoint.load`` into a
        fresh layer, create it with :meth:`init_fp8_state` (DCP loads into the keys the target
        has)."""
        st = self.fp8_state()
        return None if st is None else st.to_dict()

    def set_extra_state(self, state) -> None:
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            # None, or TransformerEngine's "no FP8 state" (an empty uint8 tensor): a checkpoint
            # of a TE GroupedLinear trained without FP8 loads as it is (same parameter names)
            self._set_state(None)
            return
        if isinstance(state, (torch.Tensor, io.BytesIO)):
            # TransformerEngine's serialized extra state (a pickle in a uint8 tensor; older
            # versions torch.save into BytesIO). Not unpickled here: te_checkpoint converts it
            # (its layout depends on the TE version). Only delayed scaling stores scales and
            # histories in it; the other recipes' payload carries no state, so it loads as
            # "no FP8 state".
            raw = state.getvalue() if isinstance(state, io.BytesIO) else \
                state.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
            if b"amax_history_fwd" not in raw:
                self._set_state(None)
                return
            raise ValueError("state_dict: this FP8 extra state is TransformerEngine's delayed-"
                             "scaling state, in its serialized format; convert the checkpoint "
                             "first: layer.load_state_dict(cugrouped.pytorch.from_te_state_dict("
                             "state_dict, te_version=<the TE version that wrote it>)) keeps the "
                             "scales and amax histories (or, to start delayed scaling afresh, "
                             "replace each '_extra_state' entry with torch.empty(0, "
                             "dtype=torch.uint8), TransformerEngine's 'no FP8 state')")
        if not isinstance(state, dict):
            raise TypeError(f"state_dict: expected the FP8 extra state as a dict, got "
                            f"{type(state).__name__}")
        if int(state.get("num_experts", -1)) != self.num_gemms:
            raise ValueError(f"state_dict: FP8 extra state is for {state.get('num_experts')} "
                             f"experts, this layer has {self.num_gemms}")
        self._set_state(DelayedScalingState.from_dict(state, self._weight_params()[0].device))

    # -- forward ------------------------------------------------------------------------------
    def _check_input(self, inp, m_splits, rows=None, k=None):
        """(splits, first tensor); ``rows``: the rows ``m_splits`` must count when they are not
        ``inp``'s (a gather); ``k``: the width of ``inp`` (default ``in_features``)."""
        E, k = self.num_gemms, k or self.in_features
        kname = f"in_features={k}" if k == self.in_features else \
            f"2 * in_features={k} for input_activation {self.input_activation!r}"
        w0 = self._weight_params()[0]
        if isinstance(inp, (list, tuple)):
            if len(inp) != E:
                raise ValueError(f"inp: expected a list of {E} tensors (one per expert), got {len(inp)}")
            for i, x in enumerate(inp):
                if not isinstance(x, torch.Tensor):
                    raise TypeError(f"inp[{i}]: expected a torch.Tensor, got {type(x).__name__}")
                if x.dim() != 2 or x.shape[1] != k:
                    raise ValueError(f"inp[{i}]: expected shape (m_{i}, {kname}), got "
                                     f"{tuple(x.shape)}")
                if x.dtype != inp[0].dtype:
                    raise TypeError(f"inp[{i}]: dtype {x.dtype} differs from inp[0]'s {inp[0].dtype}")
                if x.device != inp[0].device:
                    raise ValueError(f"inp[{i}]: on {x.device}, inp[0] is on {inp[0].device}")
            splits = tuple(int(x.shape[0]) for x in inp)
            if m_splits is not None and tuple(self._host_splits(m_splits)) != splits:
                raise ValueError(f"m_splits: must be None (or the row counts {splits}) when inp "
                                 f"is a list")
            first = inp[0]
        else:
            if not isinstance(inp, torch.Tensor):
                raise TypeError(f"inp: expected a tensor or a list of tensors, got "
                                f"{type(inp).__name__}")
            if inp.dim() < 2 or inp.shape[-1] != k:
                raise ValueError(f"inp: expected shape (sum(m_splits), {kname}) or "
                                 f"(..., {kname}) with sum(m_splits) rows in all, got "
                                 f"{tuple(inp.shape)}")
            rows = inp.numel() // k if rows is None else rows
            if m_splits is None:
                raise ValueError("m_splits: required when inp is a single tensor")
            splits = tuple(self._host_splits(m_splits))
            if len(splits) != E:
                raise ValueError(f"m_splits: expected {E} counts (num_gemms), got {len(splits)}")
            if sum(splits) != rows:
                raise ValueError(f"m_splits: counts sum to {sum(splits)} but inp has "
                                 f"{rows} rows")
            first = inp
        if first.device != w0.device:
            raise ValueError(f"inp: on {first.device} but the weights are on {w0.device}")
        if self._autocast_dtype(first.device) is None:
            if first.dtype != w0.dtype:
                raise TypeError(f"inp: dtype {first.dtype} differs from the weights' {w0.dtype} "
                                f"(params_dtype; under torch.autocast the input is cast instead)")
        elif not first.dtype.is_floating_point:
            raise TypeError(f"inp: expected a floating-point dtype under torch.autocast, got "
                            f"{first.dtype}")
        return splits, first

    @staticmethod
    def _autocast_dtype(device: torch.device) -> torch.dtype | None:
        """The ``torch.autocast`` dtype for ``device``'s type when it is enabled, else None
        (TransformerEngine's ``set_activation_dtype``: autocast decides the activation dtype)."""
        if device.type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device.type):
            return None
        return torch.get_autocast_dtype(device.type)

    @staticmethod
    def _host_splits(m_splits) -> list[int]:
        """``m_splits`` as a list of Python ints: from a sequence of integers (``int``, NumPy
        integers, any ``numbers.Integral`` but ``bool``), a 1-D integer NumPy array, or a 1-D
        integer tensor (on CUDA: a host sync)."""
        if isinstance(m_splits, torch.Tensor):
            if m_splits.dtype.is_floating_point or m_splits.dtype.is_complex or m_splits.dim() != 1:
                raise TypeError(f"m_splits: expected a 1-D integer tensor or a list of ints, got "
                                f"{m_splits.dtype} of shape {tuple(m_splits.shape)}")
            splits = m_splits.tolist()   # on CUDA: a host sync (the GEMM loop needs host counts)
        elif isinstance(m_splits, np.ndarray):
            if m_splits.dtype.kind not in "iu" or m_splits.ndim != 1:
                raise TypeError(f"m_splits: expected a 1-D integer array or a list of ints, got "
                                f"{m_splits.dtype} of shape {m_splits.shape}")
            splits = m_splits.tolist()
        elif isinstance(m_splits, Sequence):
            splits = list(m_splits)
        else:
            raise TypeError(f"m_splits: expected a list of ints or an integer tensor, got "
                            f"{type(m_splits).__name__}")
        for i, v in enumerate(splits):
            if type(v) is not int:
                if not isinstance(v, numbers.Integral) or isinstance(v, (bool, np.bool_)):
                    raise TypeError(f"m_splits: expected ints, got {v!r}")
                splits[i] = v = int(v)
            if v < 0:
                raise ValueError(f"m_splits: counts must be non-negative, got {splits}")
        return splits

    def _fp8_weights(self, recipe, is_first_microbatch, scale, amax, cast_backend, need_t,
                     recompute=False):
        """(w_data, w_t, w_scale_inv) (block scaling: and the transposed copy's block scales):
        cast now, or reused with ``is_first_microbatch=False``
        (a checkpoint's recomputation reads the cache but does not write it)."""
        # a copy cast under torch.inference_mode is an inference tensor, which autograd may not
        # save: it is used only under inference_mode again
        key = (recipe, cast_backend,
               not torch.compiler.is_compiling() and torch.is_inference_mode_enabled())
        cache = self._fp8_weight_cache
        if is_first_microbatch is False and cache is not None and cache[0] == key:
            return cache[1]
        ws = [w.detach() for w in self.weights()]
        if isinstance(recipe, BLOCK_RECIPES):   # (data, data_t, block scales of each)
            out = cops.eager.fp8_block_quantize(
                ws, recipe.fp8_format.forward, recipe.block_dims[1], 1, True,
                need_t or is_first_microbatch is not None, cast_backend,
                *_qparams(recipe, "fp8_quant_fwd_weight"))[:4]
            if not recompute:
                self._fp8_weight_cache = (key, out) if is_first_microbatch is not None else None
            return out
        w_data, w_t, w_si, _ = cops.eager.fp8_quantize(
            ws, recipe.fp8_format.forward, recipe.margin, 1, True,
            need_t or is_first_microbatch is not None, False, scale,
            amax if torch.is_grad_enabled() else None, WEIGHT * self.num_gemms, cast_backend, True,
            *_qparams(recipe, "fp8_quant_fwd_weight"))
        out = (w_data, w_t, w_si)
        if not recompute:
            self._fp8_weight_cache = (key, out) if is_first_microbatch is not None else None
        return out

    def forward(self, inp, m_splits=None, is_first_microbatch: bool | None = None,
                row_index: torch.Tensor | None = None):
        """``inp``: list of E ``(m_i, in_features)`` tensors -> list of E ``(m_i, out_features)``
        outputs (views of one buffer); or one ``(Σ m_i, in_features)`` tensor with ``m_splits``
        (list of ints, or an integer tensor) -> one ``(Σ m_i, out_features)`` tensor. A single
        tensor may have more dims, ``(..., in_features)``: it is flattened to
        ``(-1, in_features)`` (a view when its strides allow; ``m_splits`` counts those rows) and
        the output is ``(..., out_features)``, as in TransformerEngine. List inputs stay 2-D
        (TransformerEngine has no list input).

        ``is_first_microbatch``: None (no weight caching), True (cast the FP8 weights and cache
        them), False (reuse the cached FP8 weights: the weights have not changed since).

        With ``return_bias=True`` the biases are not added and the result is ``(out, biases)``
        (the list of E biases in the activation dtype; E empty tensors without ``bias``).

        Under ``torch.autocast`` enabled for the input's device type the activation dtype is the
        autocast dtype (as in TransformerEngine): inputs (and biases) are cast to it, and so are
        the weights without FP8; with FP8 the weights are quantized from their own dtype. The
        output is in the activation dtype, grads come back in each parameter's own dtype.
        Outside autocast the input dtype must equal ``params_dtype``.

        ``row_index`` (the MoE permute folded in): ``inp`` is the ``(tokens, in_features)``
        matrix and the experts' rows are ``inp[row_index]`` (int64, ``sum(m_splits)`` entries,
        expert by expert; a negative index is a zero row); the output is ``(sum(m_splits),
        out_features)`` in that order and ``inp``'s gradient is summed back onto the tokens
        (:func:`cugrouped.pytorch._gather.scatter_rows`: float32 sums in row order, the same
        bits on every run, no atomics on CUDA). With FP8 and the default backward the cast
        kernel gathers the rows itself, so the permuted high-precision copy is never made;
        otherwise (no FP8, backward overrides, ``save_original_input``) the rows are gathered
        first, with the same results (under ``torch.autocast`` the fused path sums the tokens'
        gradient in float32 and rounds it once to the autocast dtype before it reaches the
        tokens' own dtype; the other path sums in the tokens' dtype).
        """
        if self.delay_wgrad_compute and torch.compiler.is_compiling():
            raise RuntimeError("delay_wgrad_compute: not under torch.compile (backward queues "
                               "the weight gradient for backward_dw(), a side effect a compiled "
                               "graph cannot hold); compile without it")
        gather = False
        recipe = get_fp8_recipe()
        if self.input_activation is not None:
            if row_index is not None:
                raise ValueError("row_index: not with input_activation (the permute goes before "
                                 "fc1, the activation after it)")
            inp, activation = self._activation_input(inp, m_splits, recipe)
        else:
            activation = None
        if row_index is not None:
            m_splits = self._host_splits(m_splits) if m_splits is not None else None  # one sync
            inp, gather = self._gather_input(inp, m_splits, row_index)
        E, k, n = self.num_gemms, self.in_features, self.out_features
        width = 2 * k if activation is not None else k       # of the input
        splits, first = self._check_input(inp, m_splits,
                                          rows=row_index.shape[0] if gather else None, k=width)
        list_mode = isinstance(inp, (list, tuple))
        out_shape = None
        if not list_mode and inp.dim() != 2:    # (..., k) -> (rows, k), as TransformerEngine
            out_shape = (*inp.shape[:-1], n)
            inp = first = inp.reshape(-1, width)
        ws, all_bs = self.weights(), self.biases()
        b_whole = self.bias if self.single_grouped_bias else None
        xs = tuple(inp) if list_mode else (inp,)
        fuse, lazy, main_grads = self._main_grads(ws)
        act_dtype = self._autocast_dtype(first.device)
        if act_dtype is not None:
            # torch.autocast: compute in its dtype, as TransformerEngine. Inputs and biases are
            # cast here (differentiable casts: grads reach them in their own dtype). The weights
            # go in as the parameters themselves: without FP8 the autograd function casts them
            # to the input dtype and returns their grads in their own dtype (so main_grad
            # flags, overwrite_main_grad and dummy grads apply to the parameters); with FP8 the
            # cast kernel reads them in their own dtype. Cost without FP8: one cast copy of every
            # weight per forward (TE casts the same way).
            xs = tuple(x.to(act_dtype) for x in xs)
            first = xs[0]
            if self.single_grouped_bias:
                b_whole = self.bias.to(act_dtype)
                all_bs = list(b_whole.unbind(0))
            else:
                all_bs = [b.to(act_dtype) for b in all_bs]
        bs = all_bs if self.apply_bias else []
        # what the autograd function takes: a single grouped weight (bias) as the one tensor
        # (its gradient then comes back as one, with no per-expert grads stacked again)
        w_in = (self.weight,) if self.single_grouped_weight else tuple(ws)
        b_in = () if not bs else (b_whole,) if self.single_grouped_bias else tuple(bs)
        # TransformerEngine: the first micro-batch's wgrad, and a weight marked
        # overwrite_main_grad (Megatron-FSDP), overwrite main_grad instead of adding to it
        accumulate = is_first_microbatch is not True and \
            not getattr(self._weight_owners()[0], "overwrite_main_grad", False)
        if recipe is None:
            calibration = get_calibration_recipe()
            if calibration is not None and not recomputing():
                self._calibrate(calibration, tuple(_row_major(x) for x in xs), splits,
                                list_mode)
            cfg = _Config(list_mode, E, k, n, len(bs) > 0, False,
                          fuse_wgrad=fuse, accumulate_main_grad=accumulate,
                          wgrad_store=self._wgrad_queue(),
                          grad_accs=self._grad_accumulators(), lazy_main_grad=lazy,
                          stacked=self._stacked())
            y = _GroupedLinearFn.apply(cfg, splits, *xs, *w_in, *b_in, *main_grads)
        else:
            # the cast kernel reads rows with a unit column stride: other layouts (a transposed
            # view) are copied once, as torch's own matmuls do without FP8
            xs = tuple(_row_major(x) for x in xs)
            y = self._forward_fp8(recipe, splits, xs, ws, bs, (w_in, b_in),
                                  (fuse, lazy, main_grads),
                                  list_mode, is_first_microbatch, first, accumulate,
                                  row_index if gather else None, activation)
        if list_mode:
            out = list(torch.split(y, list(splits)))
        else:
            out = y if out_shape is None else y.view(out_shape)
        if not self.return_bias:
            return out
        if not all_bs:
            all_bs = [torch.empty(0, dtype=first.dtype, device=first.device) for _ in range(E)]
        return out, list(all_bs)

    # -- delayed weight gradients (TransformerEngine's delay_wgrad_compute) --------------------
    def need_backward_dw(self) -> bool:
        """Whether backward leaves the weight gradients to :meth:`backward_dw`."""
        return self.delay_wgrad_compute

    def __getstate__(self):
        # copy.deepcopy / pickle: autograd nodes cannot be copied; the cache is rebuilt on use
        state = super().__getstate__()
        return {**state, "_grad_acc_cache": None}

    def _stacked(self) -> tuple[bool, bool]:
        """The autograd function's ``stacked`` option: weights, biases as one tensor each."""
        return self.single_grouped_weight, self.single_grouped_bias

    def _grad_accumulators(self) -> tuple:
        """The weights' AccumulateGrad nodes (None for a frozen one; cached per parameter set),
        with which backward skips a fused or deferred wgrad that autograd was not asked for; ()
        when neither is on, under torch.compile, or for weights that are not leaves."""
        if not (self.fuse_wgrad_accumulation or self.delay_wgrad_compute) or \
                not torch.is_grad_enabled() or torch.compiler.is_compiling() or \
                not hasattr(torch._C, "_will_engine_execute_node"):
            return ()
        ws = self._weight_owners()
        # torch makes a parameter a new accumulator when its data changes dtype or device
        key = tuple((w, w.requires_grad, w.dtype, w.device) for w in ws)
        cache = self._grad_acc_cache
        if cache is None or len(cache[0]) != len(key) or any(
                a[0] is not b[0] or a[1:] != b[1:] for a, b in zip(cache[0], key)):
            if any(w.grad_fn is not None for w in ws):
                return ()
            accs = tuple(w.expand_as(w).grad_fn.next_functions[0][0] if w.requires_grad else None
                         for w in ws)
            self._grad_acc_cache = cache = (key, accs)
        return cache[1]

    def _wgrad_queue(self):
        """The queue backward puts deferred wgrads in, or None (made here when
        ``delay_wgrad_compute`` was switched on after construction)."""
        if not self.delay_wgrad_compute:
            return None
        if self.wgrad_store is None:
            self.wgrad_store = _WgradStore()
        return self.wgrad_store

    def backward_dw(self) -> None:
        """Compute the weight gradients that the oldest not yet completed backward deferred
        (``delay_wgrad_compute=True``; a no-op otherwise or when none is pending), e.g. while
        an expert-parallel all-to-all of the next layer is in flight.

        With ``fuse_wgrad_accumulation`` the grouped wgrad GEMM accumulates into (or, for a first
        micro-batch, overwrites) ``weight{i}.main_grad`` as backward would have; otherwise the
        result is added to ``weight{i}.grad`` (set when None), as autograd would have done
        (TransformerEngine assigns it instead). Bias gradients are not deferred: backward
        produces them. Then the hooks given to
        :meth:`register_wgrad_accumulation_and_reduce_hooks` run, in order."""
        if not self.delay_wgrad_compute or not self.wgrad_store:
            return
        with torch.no_grad():      # grads are plain tensors, as autograd's
            fn, wanted = self.wgrad_store.pop()
            dws = fn()
            if dws is not None and self.single_grouped_weight:
                if any(wanted):            # one parameter: all its experts or none
                    dw = dws               # one (E, n, k) tensor
                    if self.weight.grad is None:
                        self.weight.grad = dw
                    else:
                        self.weight.grad += dw
            elif dws is not None:
                for w, dw, want in zip(self.weights(), dws, wanted):
                    if not want:       # frozen, or not asked for by that backward
                        continue
                    if w.grad is None:
                        w.grad = dw
                    else:
                        w.grad += dw
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        """Run ``hook()`` at the end of every :meth:`backward_dw` (Megatron's DDP registers its
        grad-ready hooks here for parameters marked ``skip_backward_post_hook``, which
        ``delay_wgrad_compute=True`` sets on every weight and bias)."""
        if not callable(hook):
            raise TypeError(f"hook: expected a callable, got {type(hook).__name__}")
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def _delayed_state(self, recipe: DelayedScaling) -> None:
        """Make (or adopt) the delayed-scaling state for ``recipe``."""
        st = self.fp8_state()
        if st is None or not st.matches(recipe, self.num_gemms):
            if torch.compiler.is_compiling() and torch.is_grad_enabled():
                # made inside the graph, the buffers would be forward intermediates that the
                # backward's scale update mutates: AOTAutograd cannot express that (it fails
                # with "Node ... was invalid, but is output")
                raise RuntimeError(
                    "GroupedLinear under torch.compile with DelayedScaling: the layer has no "
                    "delayed-scaling state for this recipe; call layer.init_fp8_state(recipe) "
                    "(or run one eager step under the recipe) before compiling a training step")
            self.init_fp8_state(recipe)
        else:
            self._fp8_recipe = recipe

    def _calibrate(self, recipe: DelayedScaling, xs, splits, list_mode) -> None:
        """``fp8_autocast(enabled=False, calibrating=True)``: the amaxes of the input and the
        weights max-merged into the pending amax and the scale update of those 2E tensors, as an
        FP8 forward without backward does (the casts' FP8 bytes are discarded)."""
        if xs[0].dtype not in FP8_DTYPES:
            raise TypeError(f"inp: FP8 calibration needs float32, bfloat16 or float16 inputs, "
                            f"got {xs[0].dtype}")
        E = self.num_gemms
        self._delayed_state(recipe)
        fmt, backend = recipe.fp8_format.forward, _CPU_CAST_BACKEND[0]
        x_list = [x.detach() for x in xs] if list_mode else _split(xs[0].detach(), splits)
        with torch.no_grad():
            for tensors, offset in ((x_list, INPUT * E),
                                    ([w.detach() for w in self.weights()], WEIGHT * E)):
                cops.eager.fp8_quantize(tensors, fmt, recipe.margin, 1, True, False, False,
                                        self.fp8_scale, self.fp8_amax, offset, backend, True)
            update_scales((self.fp8_amax_history, self.fp8_amax, self.fp8_scale,
                           self.fp8_scale_inv), 2 * E,
                          self._amax_groups(recipe), num_e4m3(recipe, E),
                          recipe.amax_compute_algo, recipe.margin, backend)
        self._fp8_weight_cache = None

    def _amax_groups(self, recipe) -> tuple:
        """The process groups a delayed-scaling update all-reduces (max) the amaxes over:
        ``fp8_autocast``'s ``fp8_group`` (with the recipe's ``reduce_amax``)."""
        group = get_fp8_group()
        return (group,) if recipe.reduce_amax and group is not None else ()

    def _main_grads(self, ws) -> tuple[bool, bool, tuple]:
        """(fused wgrad, main_grad looked up in backward, the main_grads known now).

        Megatron-FSDP's parameters (``__fsdp_param__``) allocate ``main_grad`` lazily before
        backward: as TransformerEngine, backward asks ``weight.get_main_grad()`` for it (eager
        mode only: torch.compile must see the tensors a backward mutates, as inputs)."""
        if not (self.fuse_wgrad_accumulation and torch.is_grad_enabled()
                and any(w.requires_grad for w in ws)):
            return False, False, ()
        owners = self._weight_params()
        if hasattr(owners[0], "__fsdp_param__"):
            if torch.compiler.is_compiling():
                raise RuntimeError("fuse_wgrad_accumulation: Megatron-FSDP's lazily allocated "
                                   "main_grad is not supported under torch.compile")
            return True, True, ()
        if self.single_grouped_weight:   # one (E, n, k) main_grad: its experts' views
            w = self.weight
            g = _check_main_grad(None, w, getattr(w, "main_grad", None)) if w.requires_grad \
                else None
            main_grads = tuple(g.unbind(0)) if g is not None else (None,) * self.num_gemms
            main_grad_dtype(main_grads)
            return True, False, main_grads
        # a frozen expert needs none (Megatron gives main_grad to trainable parameters only)
        main_grads = tuple(_check_main_grad(i, w, getattr(w, "main_grad", None))
                           if w.requires_grad else None for i, w in enumerate(ws))
        main_grad_dtype(main_grads)          # one dtype for all: one grouped GEMM writes them
        return True, False, main_grads

    def _gather_input(self, inp, m_splits, row_index):
        """(input, fused): the tokens as they are when the FP8 cast will gather the rows itself
        (the default FP8 backward, which reads only the cast's transposed copy), else the
        gathered rows (an autograd gather)."""
        if isinstance(inp, (list, tuple)) or not isinstance(inp, torch.Tensor) or inp.dim() != 2:
            raise ValueError("row_index: gathers rows of one 2-D (tokens, in_features) tensor inp")
        if m_splits is None:
            raise ValueError("m_splits: required with row_index (the rows of each expert)")
        check_row_index(row_index, inp, sum(m_splits))      # m_splits: host ints by now
        recipe = get_fp8_recipe()
        fused = recipe is not None and not self.save_original_input and \
            getattr(recipe, "backward_override", None) is None and \
            not recipe.override_linear_precision[2]
        return (inp, True) if fused else (gather_rows(inp, row_index), False)

    def _activation_input(self, inp, m_splits, recipe):
        """(input, activation for the cast): fc1's output as it is when the FP8 cast can apply
        ``input_activation`` (any FP8 recipe with the default backward), else the activation
        computed here in torch (and None)."""
        k2 = 2 * self.in_features
        # the width, named as such (the rest of the checks, counts included, come after: one
        # host read of device counts per call)
        for i, x in enumerate(inp if isinstance(inp, (list, tuple)) else [inp]):
            name = f"inp[{i}]" if isinstance(inp, (list, tuple)) else "inp"
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
            if x.dim() < 2 or x.shape[-1] != k2:
                raise ValueError(f"{name}: expected shape (..., 2 * in_features={k2}) for "
                                 f"input_activation {self.input_activation!r}, got "
                                 f"{tuple(x.shape)}")
        # (an input cast in 128 x 128 blocks, Float8BlockScaling(x_block_scaling_dim=2), has no
        # activation variant: the activation's kernels cast 1 x 128 and 1 x 32 blocks)
        if recipe is not None and not self.save_original_input and \
                getattr(recipe, "backward_override", None) is None and \
                not recipe.override_linear_precision[2] and \
                not (isinstance(recipe, BLOCK_RECIPES) and recipe.block_dims[0] == 2):
            return inp, self.input_activation
        if isinstance(inp, (list, tuple)):
            return [swiglu(x) for x in inp], None
        return swiglu(inp), None

    def _forward_fp8(self, recipe, splits, xs, ws, bs, inputs, fused, list_mode,
                     is_first_microbatch, first, accumulate_main_grad, row_index=None,
                     activation=None):
        E, k, n = self.num_gemms, self.in_features, self.out_features
        fuse, lazy, main_grads = fused
        fm = getattr(recipe, "feature_multiple", 16)    # MXFP8: whole 32-element scale blocks
        if k % fm:
            raise ValueError(f"in_features: {type(recipe).__name__}'s FP8 GEMMs need a multiple of "
                             f"{fm}, got {k}")
        if n % fm:
            raise ValueError(f"out_features: {type(recipe).__name__}'s FP8 GEMMs need a multiple "
                             f"of {fm}, got {n}")
        if first.dtype not in FP8_DTYPES:
            raise TypeError(f"inp: FP8 needs float32, bfloat16 or float16 inputs, got {first.dtype}")
        cast_backend = _CPU_CAST_BACKEND[0]
        delayed = isinstance(recipe, DelayedScaling)
        block = isinstance(recipe, BLOCK_RECIPES)
        if block:
            name, mult = type(recipe).__name__, recipe.token_multiple
            bad = [(i, m) for i, m in enumerate(splits) if m % mult]
            if bad:
                raise ValueError(f"m_splits: {name}'s GEMMs need every expert's token count to be "
                                 f"a multiple of {mult} (TransformerEngine's MoE pads to "
                                 f"{recipe.token_padding} with Fp8Padding); expert {bad[0][0]} has "
                                 f"{bad[0][1]}")
            if self.save_original_input:
                raise ValueError(f"save_original_input: not supported with {name} here (the "
                                 "forward keeps the transposed FP8 copy)")
        state = ()
        scale = amax = None
        if delayed and self.save_original_input and torch.is_grad_enabled() and \
                any(w.requires_grad for w in ws):
            raise ValueError("save_original_input: not with DelayedScaling (the scale may change "
                             "between forward and backward, so a second cast would not "
                             "reproduce the forward's); use Float8CurrentScaling or leave it "
                             "False, as in TransformerEngine")
        if delayed:
            self._delayed_state(recipe)
            # inside checkpoint(): the forward keeps a copy of its scales, the recomputation
            # casts with that copy and leaves the state alone
            scale, recompute = delayed_scale_for(self, self.fp8_scale)
            amax = None if recompute else self.fp8_amax
            state = (self.fp8_amax_history, self.fp8_amax, scale, self.fp8_scale_inv)
            n_e4m3 = num_e4m3(recipe, E)
        else:
            assert isinstance(recipe, (Float8CurrentScaling,) + BLOCK_RECIPES)
            n_e4m3, recompute = 0, False
        need_dgrad = torch.is_grad_enabled() and any(x.requires_grad for x in xs)
        # TransformerEngine's backward overrides: the wgrad GEMM (override_linear_precision), or
        # the whole backward (current scaling's backward_override), in the activation dtype
        mode = getattr(recipe, "backward_override", None) or (
            "hp_wgrad" if recipe.override_linear_precision[2] else "fp8")
        wq = self._fp8_weights(recipe, is_first_microbatch, scale, amax, cast_backend,
                               need_dgrad and mode in ("fp8", "hp_wgrad"), recompute)
        fuse_bias = len(bs) > 0 and bs[0].dtype == cops.fused_bias_dtype(first.dtype)
        cfg = _Config(list_mode, E, k, n, len(bs) > 0, True, recipe.fp8_format.forward,
                      recipe.fp8_format.backward, recipe.margin, delayed,
                      recipe.amax_compute_algo if delayed else "max", n_e4m3, fuse_bias,
                      fuse, accumulate_main_grad, cast_backend,
                      self._amax_groups(recipe) if delayed else (),
                      torch.is_grad_enabled() and not recompute, self._wgrad_queue(), mode,
                      self.save_original_input, self._grad_accumulators(), lazy,
                      _qparams(recipe, "fp8_quant_fwd_inp"), _qparams(recipe, "fp8_quant_bwd_grad"),
                      row_index is not None, _fast_accum(recipe),
                      recipe.block_dims if block else (), self._stacked(), activation)
        w_in, b_in = inputs
        return _GroupedLinearFn.apply(cfg, splits, *xs, *w_in, *b_in, *wq, *state, *main_grads,
                                      *((row_index,) if row_index is not None else ()))


def check_params_args(params_dtype, device) -> torch.device:
    """``device`` as a ``torch.device``, after checking the two constructor arguments every
    layer here shares."""
    if params_dtype is not None and not isinstance(params_dtype, torch.dtype):
        raise TypeError(f"params_dtype: expected a torch.dtype (e.g. torch.bfloat16) or None, "
                        f"got {params_dtype!r}")
    device = torch.get_default_device() if device is None else torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' (the default, as in TransformerEngine) but torch sees no "
                         "CUDA device; pass device='cpu' to run the layer on the CPU")
    return device


def _row_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` (2-D) itself when the cast kernels can read it, else a contiguous copy (a
    differentiable one)."""
    return x if rows_readable(tuple(x.shape), x.stride()) else x.contiguous()


def _load_either_layout(module: "GroupedLinear", state_dict, prefix, *args) -> None:
    """``load_state_dict`` pre-hook: ``weight{i}`` entries load into a single grouped ``weight``
    (stacked) and a single ``weight`` into ``weight{i}`` (its rows), biases alike, as
    TransformerEngine's layer does; where a checkpoint holds both, the other layout's entries are
    dropped. (``torch.distributed.checkpoint`` reads by the target's own keys and is not
    converted.)"""
    E = module.num_gemms
    for name, single in (("weight", module.single_grouped_weight),
                         ("bias", module.single_grouped_bias)):
        per = [f"{prefix}{name}{i}" for i in range(E)]
        whole_key = prefix + name
        if single:
            if all(k in state_dict for k in per) and whole_key not in state_dict:
                state_dict[whole_key] = torch.stack([state_dict.pop(k) for k in per])
            elif whole_key in state_dict:
                for k in per:
                    state_dict.pop(k, None)
        elif whole_key in state_dict:
            whole = state_dict[whole_key]
            if any(k in state_dict for k in per):
                if all(k in state_dict for k in per):
                    del state_dict[whole_key]
            elif isinstance(whole, torch.Tensor) and whole.dim() >= 1 and whole.shape[0] == E:
                del state_dict[whole_key]
                for k, part in zip(per, whole.unbind(0)):
                    state_dict[k] = part
