"""Megatron-core's grouped experts (TEGroupedMLP) on cugrouped's layers
(cugrouped/pytorch/megatron.py), on the CPU against Megatron's own per-expert SequentialMLP: the
same outputs and gradients (float64), the same distributed-checkpoint shards (a checkpoint
saved by one loads into the other), and the FP8 delayed-scaling state through a checkpoint.
Megatron's MoELayer itself needs CUDA (its router and dispatcher), so only its construction from
the spec is run here."""

from __future__ import annotations

import socket
import warnings

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install megatron-core; "
                                            "the test extra installs it)")

with warnings.catch_warnings():         # Megatron warns that TransformerEngine and Apex are absent
    warnings.simplefilter("ignore")
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject, apply_factories
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

from cugrouped.pytorch import DelayedScaling, Float8CurrentScaling, GroupedLinear, fp8_autocast
from cugrouped.pytorch.fp8_state import merge_expert_rows
from cugrouped.pytorch.megatron import (ColumnParallelGroupedLinear, CugroupedSpecProvider,
                                        RowParallelGroupedLinear)

E, HIDDEN, FFN = 4, 64, 96
SPLITS = torch.tensor([9, 0, 14, 5])


@pytest.fixture(scope="module", autouse=True)
def megatron_single_process():
    """torch.distributed (gloo, one process) and Megatron's parallel state, for this module."""
    import torch.distributed as dist

    owner = not dist.is_initialized()
    if owner:
        with socket.socket() as s:          # a free port (pytest-xdist workers run side by side)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    yield
    ps.destroy_model_parallel()
    if owner:
        dist.destroy_process_group()


def config(dtype=torch.float64, bias=False, glu=True, **kw):
    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=E,
        moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN, use_cpu_initialization=True,
        add_bias_linear=bias, bias_dropout_fusion=False, gated_linear_unit=glu,
        activation_func=torch.nn.functional.silu, params_dtype=dtype, moe_router_topk=2,
        moe_grouped_gemm=True, moe_token_dispatcher_type="allgather", **kw)


def pair(cfg, seed=0, generator=None):
    """Megatron's SequentialMLP and TEGroupedMLP on cugrouped's layers, the same weights (drawn
    from ``generator`` when given)."""
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(seed)
    seq = SequentialMLP(E, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                              linear_fc2=RowParallelLinear), pg_collection=pgc)
    grp = TEGroupedMLP(E, cfg, MLPSubmodules(linear_fc1=ColumnParallelGroupedLinear,
                                             linear_fc2=RowParallelGroupedLinear),
                       pg_collection=pgc)
    with torch.no_grad():
        for i, expert in enumerate(seq.local_experts):
            for fc in ("linear_fc1", "linear_fc2"):
                src, dst = getattr(expert, fc), getattr(grp, fc)
                src.weight.normal_(0, 0.05, generator=generator)
                dst.weights()[i].copy_(src.weight)
                if src.bias is not None:
                    src.bias.normal_(generator=generator)
                    dst.biases()[i].copy_(src.bias)
    return seq, grp


def run(mlp, x, probs):
    x = x.detach().clone().requires_grad_()
    out, bias = mlp(x, SPLITS, probs)
    assert bias is None
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return out, x.grad


def reference(seq, x, probs, glu):
    """The experts' math written out (float64 autograd over SequentialMLP's parameters): per
    expert h = act(x W1^T + b1) * p, y = h W2^T + b2 * p, with act = silu, or silu(a) * b over
    the two halves of fc1's output with a gated linear unit."""
    x = x.detach().clone().requires_grad_()
    ys, row = [], 0
    for expert, m in zip(seq.local_experts, SPLITS.tolist()):
        xe, pe = x[row:row + m], probs[row:row + m, None]
        fc1, fc2 = expert.linear_fc1, expert.linear_fc2
        h = xe @ fc1.weight.t() + (fc1.bias if fc1.bias is not None else 0)
        if glu:
            a, b = torch.chunk(h, 2, dim=-1)
            h = torch.nn.functional.silu(a) * b
        else:
            h = torch.nn.functional.silu(h)
        y = (h * pe) @ fc2.weight.t() + (fc2.bias * pe if fc2.bias is not None else 0)
        ys.append(y)
        row += m
    out = torch.cat(ys)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return out, x.grad


@pytest.mark.parametrize("bias,glu", [(False, True), (True, True), (True, False)])
def test_grouped_experts_equal_megatrons_sequential_experts(bias, glu):
    """Outputs, input gradients and every expert's weight (and bias) gradients, float64, with an
    expert that gets no tokens; the probabilities weight the activations as Megatron's do.
    Against SequentialMLP itself without biases (its bias path needs CUDA: on the CPU it
    modifies a view in place), and against the math written out in every case."""
    seq, grp = pair(config(bias=bias, glu=glu))
    torch.manual_seed(1)
    x = torch.randn(int(SPLITS.sum()), HIDDEN, dtype=torch.float64)
    probs = torch.rand(x.shape[0], dtype=torch.float64)
    ys, gs = run(seq, x, probs) if not bias else reference(seq, x, probs, glu)
    yg, gg = run(grp, x, probs)
    torch.testing.assert_close(yg, ys, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gg, gs, rtol=1e-12, atol=1e-12)
    for i, expert in enumerate(seq.local_experts):
        for fc in ("linear_fc1", "linear_fc2"):
            src, dst = getattr(expert, fc), getattr(grp, fc)
            want = src.weight.grad if src.weight.grad is not None else torch.zeros_like(src.weight)
            got = dst.weights()[i].grad
            torch.testing.assert_close(got if got is not None else torch.zeros_like(want), want,
                                       rtol=1e-12, atol=1e-12, msg=f"{fc} weight {i}")
            if bias:
                torch.testing.assert_close(dst.biases()[i].grad, src.bias.grad, rtol=1e-12,
                                           atol=1e-12, msg=f"{fc} bias {i}")
    if not bias:
        yr, gr = reference(seq, x, probs, glu)
        torch.testing.assert_close(yr, ys, rtol=1e-12, atol=1e-12)
    assert grp.linear_fc1.is_first_microbatch is False      # as Megatron's TEGroupedLinear


def shards(mlp):
    """Every shard of a module's distributed-checkpoint state: key -> (global offset, global
    shape, fragmentation, replica id) of each tensor, and the extra states' object keys."""
    sd = mlp.sharded_state_dict(prefix="decoder.layers.0.mlp.experts.")
    apply_factories(sd)
    out, todo = set(), list(sd.values())
    while todo:
        sh = todo.pop()
        if isinstance(sh, (list, tuple)):           # a gated fc1's two halves
            todo.extend(sh)
        elif isinstance(sh, ShardedObject):
            out.add((sh.key, "object", sh.global_offset, sh.global_shape, sh.replica_id))
        else:
            out.add((sh.key, sh.global_offset, sh.global_shape, sh.axis_fragmentations,
                     sh.replica_id))
    return out


@pytest.mark.parametrize("bias", [False, True])
def test_checkpoint_shards_are_sequential_mlps(bias):
    """The same keys, offsets and shapes as SequentialMLP's (so checkpoints move between the two,
    as between Megatron's SequentialMLP and TE-based TEGroupedMLP)."""
    seq, grp = pair(config(bias=bias))
    assert shards(grp) == shards(seq)


@pytest.fixture
def cpu_checkpointing(monkeypatch):
    """Megatron's checkpoint writer waits for its device copies (torch.cuda.synchronize) and
    exchanges its status in a tensor on torch.cuda.current_device(), which a CPU-only torch
    refuses: here there is nothing to wait for, and the status tensor lives on the CPU (gloo)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


@pytest.mark.usefixtures("cpu_checkpointing")
def test_a_sequential_mlp_checkpoint_loads_into_the_grouped_experts(tmp_path):
    """Saved by Megatron's SequentialMLP with dist_checkpointing, loaded into the grouped experts:
    the same weights."""
    seq, _ = pair(config(bias=True), seed=3)
    _, grp = pair(config(bias=True), seed=4)
    (tmp_path / "a").mkdir()
    dist_checkpointing.save(seq.sharded_state_dict(prefix="experts."), str(tmp_path / "a"))
    grp.load_state_dict(_strip(dist_checkpointing.load(grp.sharded_state_dict(prefix="experts."),
                                                       str(tmp_path / "a")), "experts."))
    for i, expert in enumerate(seq.local_experts):
        assert torch.equal(grp.linear_fc1.weights()[i], expert.linear_fc1.weight)
        assert torch.equal(grp.linear_fc2.biases()[i], expert.linear_fc2.bias)


def _strip(sd, prefix):
    return {k[len(prefix):]: v for k, v in sd.items()}


@pytest.mark.usefixtures("cpu_checkpointing")
def test_fp8_state_goes_through_a_distributed_checkpoint(tmp_path):
    """Under cugrouped's fp8_autocast (Megatron's config.fp8 unset) the experts train in FP8; the
    delayed-scaling state is saved per expert and merged back when loaded."""
    cfg = config(dtype=torch.float32)
    recipe = DelayedScaling(amax_history_len=4)
    _, grp = pair(cfg)
    x = torch.randn(int(SPLITS.sum()), HIDDEN)
    with fp8_autocast(fp8_recipe=recipe):
        run(grp, x, torch.rand(x.shape[0]))
    st = grp.linear_fc1.fp8_state().tensors
    assert st["scale"].ne(1).any()
    (tmp_path / "b").mkdir()
    dist_checkpointing.save(grp.sharded_state_dict(prefix="experts."), str(tmp_path / "b"))
    _, fresh = pair(cfg, seed=9)
    fresh.linear_fc1.init_fp8_state(recipe)
    fresh.linear_fc2.init_fp8_state(recipe)
    fresh.load_state_dict(_strip(dist_checkpointing.load(
        fresh.sharded_state_dict(prefix="experts."), str(tmp_path / "b")), "experts."))
    for fc in ("linear_fc1", "linear_fc2"):
        a, b = getattr(grp, fc).fp8_state().tensors, getattr(fresh, fc).fp8_state().tensors
        assert all(torch.equal(a[k], b[k]) for k in a), fc
        assert torch.equal(getattr(grp, fc).weights()[2], getattr(fresh, fc).weights()[2])


def test_fp8_weights_follow_the_optimizer_step():
    """Megatron resets is_first_microbatch only with its own config.fp8: under cugrouped's
    fp8_autocast the weights are cast at every forward, so an optimizer step is seen at once;
    with cache_fp8_weights they are reused until is_first_microbatch is set again."""
    _, grp = pair(config(dtype=torch.float32))
    fc1, splits = grp.linear_fc1, SPLITS.tolist()
    x = torch.randn(int(SPLITS.sum()), HIDDEN)
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        y1, _ = fc1(x, splits)
        with torch.no_grad():
            for w in fc1.weights():
                w.mul_(-3)              # an optimizer step, in place
        y2, _ = fc1(x, splits)
        fresh = GroupedLinear.forward(fc1, x, splits, is_first_microbatch=None)
        assert torch.equal(y2, fresh) and not torch.equal(y2, y1)
        fc1.cache_fp8_weights, fc1.is_first_microbatch = True, True
        y3, _ = fc1(x, splits)                      # cast and cached
        with torch.no_grad():
            for w in fc1.weights():
                w.mul_(2)
        assert torch.equal(fc1(x, splits)[0], y3)  # the cached copy, until the flag is set
        fc1.is_first_microbatch = True
        assert not torch.equal(fc1(x, splits)[0], y3)


def test_expert_states_from_transformer_engine_are_named():
    """A distributed checkpoint of TE's TEGroupedLinear holds one TE payload per expert: those
    without delayed-scaling state load as no state, delayed scaling's are refused with advice."""
    import pickle

    def te(obj):
        return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)

    stateless = te({"recipe": "Float8CurrentScaling()", "extra_fp8_variables": {}})
    assert merge_expert_rows([stateless, torch.empty(0, dtype=torch.uint8), None]) is None
    with pytest.raises(ValueError, match=r"expert 1 is TransformerEngine's delayed-scaling state; "
                                         r"convert each expert's with cugrouped\.pytorch\."
                                         r"from_te_extra_state"):
        merge_expert_rows([stateless, te({"amax_history_fwd": None})])


def test_meta_device_initialisation():
    layer = ColumnParallelGroupedLinear(E, HIDDEN, FFN, config=config(
        init_model_with_meta_device=True), init_method=None, bias=True, skip_bias_add=False,
        is_expert=True)
    assert all(p.is_meta for p in layer.parameters())


def test_the_spec_provider_builds_an_moe_layer_on_cugrouped():
    spec = get_moe_module_spec_for_backend(CugroupedSpecProvider(), num_experts=E,
                                           moe_grouped_gemm=True)
    moe = build_module(spec, config=config(), layer_number=1,
                       pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    assert isinstance(moe.experts, TEGroupedMLP)
    assert type(moe.experts.linear_fc1) is ColumnParallelGroupedLinear
    assert type(moe.experts.linear_fc2) is RowParallelGroupedLinear
    assert moe.experts.linear_fc2.te_return_bias is False
    # without grouped GEMMs the provider is Megatron's local one
    spec = get_moe_module_spec_for_backend(CugroupedSpecProvider(), num_experts=E)
    assert spec.submodules.experts.module is SequentialMLP


def test_expert_parallel_weights_are_not_all_reduced():
    """Megatron's gradient reduction reads ``param.allreduce``: False for expert weights under
    expert parallelism (each rank owns its experts), True otherwise (as TEGroupedLinear sets)."""
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    for ep, want in ((1, True), (2, False)):
        layer = RowParallelGroupedLinear(E, FFN, HIDDEN, config=config(
            expert_model_parallel_size=ep), init_method=None, bias=True, skip_bias_add=True,
            is_expert=True, pg_collection=pgc)
        assert [p.allreduce for p in layer.parameters()] == [want] * 2 * E
        assert layer.te_return_bias


def moe_pair(cfg):
    """Megatron's MoELayer twice: local experts (SequentialMLP) and cugrouped's (TEGroupedMLP
    over this module's layers), the same router and expert weights, on the GPU."""
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    seq_spec = get_moe_module_spec_for_backend(CugroupedSpecProvider(), num_experts=E)
    grp_spec = get_moe_module_spec_for_backend(CugroupedSpecProvider(), num_experts=E,
                                               moe_grouped_gemm=True)
    torch.manual_seed(0)
    seq = build_module(seq_spec, config=cfg, layer_number=1, pg_collection=pgc)
    grp = build_module(grp_spec, config=cfg, layer_number=1, pg_collection=pgc)
    with torch.no_grad():
        grp.router.weight.copy_(seq.router.weight)
        for i, expert in enumerate(seq.experts.local_experts):
            for fc in ("linear_fc1", "linear_fc2"):
                getattr(grp.experts, fc).weights()[i].copy_(getattr(expert, fc).weight)
    return seq.cuda(), grp.cuda()


@pytest.mark.gpu
def test_gpu_moe_layer_on_cugrouped_equals_megatrons_local_experts(monkeypatch):
    """Megatron's whole MoELayer (router, top-2, allgather dispatcher) on the GPU, float32:
    cugrouped's grouped experts (cuBLASLt, fp32 accumulation) against Megatron's per-expert
    torch matmuls (TF32 off), outputs and input gradients within fp32 reordering; and the same
    layer under cugrouped's fp8_autocast (current scaling) within FP8's error (SQNR > 20 dB)."""
    from megatron.core.transformer.moe import moe_utils

    # Megatron-core 0.16's router gating reads moe_utils.te_general_gemm, a name that module
    # binds only when TransformerEngine imports (NameError on CUDA without it; seen on an H200,
    # 2026-12-04): None is what its own check expects when TE is absent
    if not hasattr(moe_utils, "te_general_gemm"):
        monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)
    cfg = config(dtype=torch.float32, moe_router_load_balancing_type="none")
    seq, grp = moe_pair(cfg)
    torch.manual_seed(1)
    x = torch.randn(24, 2, HIDDEN, device="cuda")
    dy = torch.randn(24, 2, HIDDEN, device="cuda")

    def step(moe, fp8=False):
        xi = x.clone().requires_grad_()
        with fp8_autocast(enabled=fp8, fp8_recipe=Float8CurrentScaling()):
            out, _ = moe(xi)
        out.backward(dy)
        return out.detach(), xi.grad

    (ys, gs), (yg, gg) = step(seq), step(grp)
    torch.testing.assert_close(yg, ys, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gg, gs, rtol=1e-4, atol=1e-5)
    y8, _ = step(grp, fp8=True)
    sqnr = 10 * torch.log10(ys.pow(2).sum() / (y8 - ys).pow(2).sum())
    assert sqnr > 20, float(sqnr)


def test_errors_name_the_argument():
    cfg = config()
    with pytest.raises(ValueError, match="is_expert: cugrouped's grouped linear layers serve "
                                         "expert layers only"):
        ColumnParallelGroupedLinear(E, HIDDEN, FFN, config=cfg, init_method=None, bias=False,
                                    skip_bias_add=False, is_expert=False)
