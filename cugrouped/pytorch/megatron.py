"""Megatron-core's MoE experts on cugrouped: its ``TEGroupedMLP`` with cugrouped's grouped linear
layers in place of TransformerEngine's, no TransformerEngine needed. ::

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from cugrouped.pytorch.megatron import CugroupedSpecProvider

    moe_spec = get_moe_module_spec_for_backend(CugroupedSpecProvider(), num_experts=8,
                                               moe_grouped_gemm=True)

gives an ``MoELayer`` whose experts are ``TEGroupedMLP`` over :class:`ColumnParallelGroupedLinear`
(fc1) and :class:`RowParallelGroupedLinear` (fc2); the rest of the layer (router, dispatcher,
shared experts, the layers around it) is Megatron's local implementation. The two classes take
Megatron's constructor arguments and behave as its ``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear`` do: ``forward(x, m_splits) -> (out, bias or None)``, Megatron's
``gradient_accumulation_fusion`` (wgrad into ``main_grad``), ``delay_wgrad_compute``
(``backward_dw``), ``init_model_with_meta_device``, ``allreduce`` flags for expert parallelism,
and a ``sharded_state_dict`` for distributed checkpointing whose keys and shards are those of
Megatron's ``SequentialMLP`` (as TE's are), with the FP8 delayed-scaling state split per expert
(host copies, as TE's).

FP8: leave Megatron's ``config.fp8`` unset (its FP8 path pads tokens per expert with
TransformerEngine, which cugrouped's cast makes unnecessary) and run the step under
``cugrouped.pytorch.fp8_autocast(fp8_recipe=...)``: the experts' GEMMs run in FP8, everything
else in the activation dtype. The FP8 weights are then cast at every forward: Megatron resets
``is_first_microbatch`` at each step only when ``config.fp8`` is set, so a cache across
micro-batches would outlive the optimizer step. To cache them, set ``cache_fp8_weights = True``
on these layers and ``is_first_microbatch = True`` at the start of every step (as Megatron's
``set_is_first_microbatch`` does). Pass ``fp8_group=pg_collection.expt_dp`` to keep the
scales of an expert's data-parallel replicas identical.

Parallelism is Megatron's token dispatcher's, as with TransformerEngine's layers: under expert
parallelism each rank holds its experts; under expert tensor parallelism (``pg_collection.
expt_tp`` of size ``tp``) each rank holds a shard of every local expert, fc1 its
``output_size / tp`` rows and fc2 its ``input_size / tp`` columns, and the layers communicate
nothing (fc2's partial outputs are summed by the dispatcher's reduce-scatter). Under delayed
scaling the shards' amaxes are all-reduced (max) over ``expt_tp`` at every scale update, so an
expert's shards share its scales and the FP8 state is the whole expert's. Checkpoints record
the shards along those axes, as Megatron's ``SequentialMLP`` does, so they load at another
parallel size.
"""

from __future__ import annotations


try:
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import (get_cuda_rng_tracker,
                                                      get_expert_parallel_rng_tracker_name)
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                                 make_sharded_tensors_for_checkpoint)
    from megatron.core.utils import get_pg_rank, get_pg_size
except ImportError as exc:      # pragma: no cover - exercised without megatron-core only
    raise ImportError("cugrouped.pytorch.megatron needs Megatron-core: pip install megatron-core"
                      ) from exc

from .fp8_state import expert_rows, merge_expert_rows
from .grouped_linear import GroupedLinear

__all__ = ["MegatronGroupedLinear", "ColumnParallelGroupedLinear", "RowParallelGroupedLinear",
           "CugroupedSpecProvider"]


class MegatronGroupedLinear(GroupedLinear):
    """cugrouped's :class:`GroupedLinear` with the constructor and forward of Megatron-core's
    ``TEGroupedLinear`` (expert layers only). Use :class:`ColumnParallelGroupedLinear` and
    :class:`RowParallelGroupedLinear`."""

    _PARALLEL_MODE: str | None = None      # the subclasses': "column" / "row"
    _TP_AXES: dict = {}                     # tensor-parallel axis of weight (and bias) shards

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config,
                 init_method, bias: bool, skip_bias_add: bool, is_expert: bool = False,
                 tp_comm_buffer_name: str | None = None, pg_collection=None,
                 parallel_mode: str | None = None):
        parallel_mode = parallel_mode or self._PARALLEL_MODE
        if not is_expert:
            raise ValueError("is_expert: cugrouped's grouped linear layers serve expert layers "
                             "only (as Megatron's TEGroupedLinear)")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        tp = get_pg_size(pg_collection.expt_tp)
        if tp > 1 and bias:     # fc2's would be added by every rank before the sum
            raise ValueError(f"bias: expert layers with biases need expert tensor-parallel "
                             f"size 1 (Megatron's rule), got expert tensor-parallel size {tp}")
        if tp > 1 and parallel_mode in ("column", "row"):
            # as TEGroupedLinear: this rank's shard (the dispatcher communicates)
            column = parallel_mode == "column"
            name, size = ("output_size", output_size) if column else ("input_size", input_size)
            if size % tp:
                raise ValueError(f"{name}: {size} is not divisible by the expert "
                                 f"tensor-parallel size {tp}")
            if column:
                output_size //= tp
            else:
                input_size //= tp
        self.config = config
        self._pg_collection = pg_collection
        self.te_return_bias = bool(skip_bias_add and bias)   # Megatron's name for return_bias
        self.is_first_microbatch = True
        self.disable_parameter_transpose_cache = config.disable_parameter_transpose_cache
        # Megatron resets is_first_microbatch each step only with config.fp8 / fp4 (module.py)
        self.cache_fp8_weights = bool(config.fp8 or config.fp4)
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.explicit_expert_comm = tp > 1 or self.expert_parallel
        if self.explicit_expert_comm:   # as TEGroupedLinear: the dispatcher communicates
            parallel_mode = None
        tracker = get_cuda_rng_tracker()
        device = "meta" if config.init_model_with_meta_device else \
            "cpu" if config.use_cpu_initialization else "cuda"
        super().__init__(
            num_gemms, input_size, output_size, bias=bias, params_dtype=config.params_dtype,
            device=device,
            fuse_wgrad_accumulation=config.gradient_accumulation_fusion,
            init_method=init_method if config.perform_initialization else (lambda w: None),
            parallel_mode=parallel_mode, return_bias=self.te_return_bias,
            get_rng_state_tracker=get_cuda_rng_tracker if tracker.is_initialized() else None,
            rng_tracker_name=get_expert_parallel_rng_tracker_name(), ub_name=tp_comm_buffer_name,
            delay_wgrad_compute=bool(config.delay_wgrad_compute))
        for p in self.parameters():     # expert weights are not all-reduced across EP ranks
            p.allreduce = not self.expert_parallel
        self._register_load_state_dict_pre_hook(_merge_expert_extra_states, with_module=True)

    def _amax_groups(self, recipe) -> tuple:
        """Under expert tensor parallelism the amaxes are all-reduced over ``expt_tp`` first: an
        expert's shards share its scales, the state is the whole expert's at any expert
        tensor-parallel size, and a checkpoint (which keeps tensor-parallel rank 0's state, as
        Megatron does) restores every shard exactly. Then over ``fp8_autocast``'s group."""
        groups = super()._amax_groups(recipe)
        tp_group = self._pg_collection.expt_tp
        if recipe.reduce_amax and get_pg_size(tp_group) > 1 and tp_group not in groups:
            groups = (tp_group, *groups)
        return groups

    def forward(self, x, m_splits):
        """``(out, biases)`` with ``skip_bias_add`` and a bias, else ``(out, None)``. The FP8
        weights are reused across micro-batches only with ``cache_fp8_weights`` (module doc)."""
        first = self.is_first_microbatch if self.cache_fp8_weights \
            and not self.disable_parameter_transpose_cache else None
        out = super().forward(x, m_splits, is_first_microbatch=first)
        self.is_first_microbatch = False
        return out if self.te_return_bias else (out, None)

    def backward_dw(self) -> None:
        if self.delay_wgrad_compute:
            super().backward_dw()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """Per expert: its weight (and bias) as a shard of the global experts along a new
        leading axis, and its part of the FP8 state; keys as Megatron's ``SequentialMLP``
        (``{prefix}weight`` with expert offsets), entries ``weight{i}``, ``_extra_state{i}``
        (``_extra_state`` for expert 0), as Megatron's ``TEGroupedLinear``."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton = metadata.get("singleton_local_shards", False)
        E, ep = self.num_gemms, self._pg_collection.ep
        n_global, first = get_pg_size(ep) * E, get_pg_rank(ep) * E
        ep_axis = len(sharded_offsets)
        extra = expert_rows(self.get_extra_state(), E, device="cpu")  # loads on any host
        weights, biases = self.weights(), self.biases() if self.use_bias else None
        out = {}
        for i in range(E):
            state = {f"{i}.weight": weights[i], f"{i}._extra_state": extra[i]}
            if biases is not None:
                state[f"{i}.bias"] = biases[i]
            if singleton:
                expert_prefix, offsets = f"{first + i}.{prefix}", sharded_offsets
            else:
                expert_prefix = prefix
                offsets = (*sharded_offsets, (ep_axis, first + i, n_global))
            sub = make_sharded_tensors_for_checkpoint(
                state, "", {f"{i}.{k}": v for k, v in self._TP_AXES.items()}, offsets,
                tp_group=self._pg_collection.expt_tp, dp_cp_group=metadata["dp_cp_group"])
            replace_prefix_for_sharding(sub, f"{i}.", expert_prefix)
            out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
            out[f"{prefix}_extra_state{i or ''}"] = sub[f"{i}._extra_state"]
            if biases is not None:
                out[f"{prefix}bias{i}"] = sub[f"{i}.bias"]
        edp = get_pg_rank(self._pg_collection.expt_dp)
        for sh in out.values():         # replicas along expert data parallelism
            if not getattr(sh, "is_data_parallel_fully_shard", False):
                sh.replica_id = (*sh.replica_id[:2], edp)
        return out


class ColumnParallelGroupedLinear(MegatronGroupedLinear):
    """fc1 of Megatron's grouped experts (``TEColumnParallelGroupedLinear``'s arguments)."""

    _PARALLEL_MODE, _TP_AXES = "column", {"weight": 0, "bias": 0}


class RowParallelGroupedLinear(MegatronGroupedLinear):
    """fc2 of Megatron's grouped experts (``TERowParallelGroupedLinear``'s arguments)."""

    _PARALLEL_MODE, _TP_AXES = "row", {"weight": 1}


def _merge_expert_extra_states(module, state_dict, prefix, *args) -> None:
    """Load hook: a distributed checkpoint gives one FP8 state per expert (``_extra_state``,
    ``_extra_state1``, ...); the layer keeps one for all."""
    keys = [f"{prefix}_extra_state{i or ''}" for i in range(module.num_gemms)]
    if module.num_gemms > 1 and keys[1] in state_dict:
        state_dict[keys[0]] = merge_expert_rows([state_dict.pop(k, None) for k in keys])


class CugroupedSpecProvider(LocalSpecProvider):
    """Megatron-core's local backend, with the grouped experts on cugrouped: pass it to
    ``get_moe_module_spec_for_backend(..., moe_grouped_gemm=True)``."""

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
        if not moe_use_grouped_gemm or moe_use_legacy_grouped_gemm:
            return super().grouped_mlp_modules(moe_use_grouped_gemm, moe_use_legacy_grouped_gemm)
        return TEGroupedMLP, MLPSubmodules(linear_fc1=ColumnParallelGroupedLinear,
                                           linear_fc2=RowParallelGroupedLinear)
