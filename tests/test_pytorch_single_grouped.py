"""``GroupedLinear(single_grouped_weight=True, single_grouped_bias=True)`` (TransformerEngine
2.14's options): all experts' weights in one ``(E, n, k)`` parameter and the biases in one
``(E, n)``. It must equal the per-expert layout bit for bit (outputs and every gradient, each
recipe, list and tensor inputs), carry Megatron's attributes on the one parameter (main_grad,
grad_added_to_main_grad, Megatron-FSDP's lazy main_grad, deferred wgrad), and load checkpoints
of either layout."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from cugrouped.pytorch import GroupedLinear, MXFP8BlockScaling
from test_pytorch_grouped_linear import RECIPES, _autocast, assert_bits_equal, make_layer
from test_pytorch_grouped_linear import run as run_layer

SP = [6, 0, 11]


def run(layer, *args, **kw):
    """test_pytorch_grouped_linear's run (its per-expert grads are None for the views of a single
    grouped parameter: the tests read ``layer.weight.grad``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf")
        return run_layer(layer, *args, **kw)


def single_twin(layer: GroupedLinear, **kw) -> GroupedLinear:
    """The same layer with single grouped parameters holding the same values."""
    E, k, n = layer.num_gemms, layer.in_features, layer.out_features
    twin = GroupedLinear(E, k, n, bias=layer.use_bias, params_dtype=layer.params_dtype,
                         device="cpu", single_grouped_weight=True,
                         single_grouped_bias=True, **kw)
    with torch.no_grad():
        twin.weight.copy_(torch.stack(layer.weights()))
        if layer.use_bias:
            twin.bias.copy_(torch.stack(layer.biases()))
    return twin


def test_parameters_and_views():
    layer = single_twin(make_layer(3))
    names = dict(layer.named_parameters())
    assert list(names) == ["weight", "bias"]
    assert names["weight"].shape == (3, 48, 32) and names["bias"].shape == (3, 48)
    ws = layer.weights()
    assert len(ws) == 3 and all(w._base is layer.weight for w in ws)
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0   # as TE
    assert "single_grouped_weight=True, single_grouped_bias=True" in repr(layer)
    assert not hasattr(layer, "weight0")
    only_w = GroupedLinear(3, 32, 48, device="cpu", single_grouped_weight=True)
    assert [n for n, _ in only_w.named_parameters()] == ["weight", "bias0", "bias1", "bias2"]
    with pytest.raises(TypeError, match="single_grouped_weight: expected a bool"):
        GroupedLinear(3, 32, 48, device="cpu", single_grouped_weight=1)


@pytest.mark.parametrize("list_mode", [False, True])
@pytest.mark.parametrize("recipe", ["none", "delayed", "current"])
def test_equals_the_per_expert_layout(recipe, list_mode):
    per = make_layer(3)
    one = single_twin(per)
    x, dy = torch.randn(17, 32), torch.randn(17, 48)
    for _ in range(2):                      # the second step runs with an updated delayed state
        y0, dx0, dw0, db0 = run(per, x, SP, RECIPES[recipe], list_mode, dy)
        y1, dx1, _, _ = run(one, x, SP, RECIPES[recipe], list_mode, dy)
        assert_bits_equal(y1, y0, "y")
        assert_bits_equal(dx1, dx0, "dx")
        assert_bits_equal(one.weight.grad, torch.stack(dw0), "dw")
        assert_bits_equal(one.bias.grad, torch.stack(db0), "db")


def test_equals_the_per_expert_layout_mxfp8():
    per = make_layer(2, k=64, n=64)
    one = single_twin(per)
    x, dy = torch.randn(96, 64), torch.randn(96, 64)
    rec = MXFP8BlockScaling()
    y0, dx0, dw0, _ = run(per, x, [64, 32], rec, False, dy)
    y1, dx1, _, _ = run(one, x, [64, 32], rec, False, dy)
    assert_bits_equal(y1, y0)
    assert_bits_equal(dx1, dx0)
    assert_bits_equal(one.weight.grad, torch.stack(dw0))


def test_equals_the_per_expert_layout_block_scaling():
    from cugrouped.pytorch import Float8BlockScaling

    per = make_layer(2, k=128, n=128)
    one = single_twin(per)
    x, dy = torch.randn(48, 128), torch.randn(48, 128)
    y0, dx0, dw0, _ = run(per, x, [16, 32], Float8BlockScaling(), False, dy)
    y1, dx1, _, _ = run(one, x, [16, 32], Float8BlockScaling(), False, dy)
    assert_bits_equal(y1, y0)
    assert_bits_equal(dx1, dx0)
    assert_bits_equal(one.weight.grad, torch.stack(dw0))


def test_the_layer_is_freed_without_the_cycle_collector():
    """The state-dict hook holds the layer weakly: dropping the last reference frees it (and its
    weights) at once, as for any module."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        for single in (False, True):
            layer = GroupedLinear(2, 32, 48, device="cpu", single_grouped_weight=single)
            ref = weakref.ref(layer)
            del layer
            assert ref() is None, single
    finally:
        gc.enable()


def test_gradcheck_float64():
    """Input, the one weight and the one bias, against finite differences."""
    layer = single_twin(make_layer(2, k=4, n=3, dtype=torch.float64))
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_()
    torch.autograd.gradcheck(lambda x, w, b: torch.func.functional_call(
        layer, {"weight": w, "bias": b}, (x, [3, 2])), (x, w, b))


@pytest.mark.parametrize("recipe", ["none", "delayed", "current"])
def test_fused_wgrad_into_one_main_grad_over_two_backwards(recipe):
    per = make_layer(3, fuse_wgrad_accumulation=True)
    one = single_twin(per, fuse_wgrad_accumulation=True)
    for w in per.weights():
        w.main_grad = torch.full_like(w, 0.5)
    one.weight.main_grad = torch.full_like(one.weight, 0.5)
    x = torch.randn(17, 32)
    for first in (True, False, False):
        run(per, x, SP, RECIPES[recipe], False, is_first_microbatch=first)
        run(one, x, SP, RECIPES[recipe], False, is_first_microbatch=first)
    assert_bits_equal(one.weight.main_grad, torch.stack([w.main_grad for w in per.weights()]))
    assert one.weight.grad is None


def test_fused_wgrad_megatron_contract_on_the_one_parameter():
    """grad_added_to_main_grad is set on the parameter, which gets one dummy gradient (its
    grad-accumulation hook fires once); a wrong main_grad shape names the parameter."""
    one = single_twin(make_layer(3), fuse_wgrad_accumulation=True)
    one.weight.main_grad = torch.zeros_like(one.weight)
    one.weight.grad_added_to_main_grad = False
    seen = []
    one.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.shape))
    run(one, torch.randn(17, 32), SP, None, False)
    assert seen == [(3, 48, 32)] and one.weight.grad_added_to_main_grad
    assert one.weight.main_grad.abs().sum() > 0
    one.weight.main_grad = torch.zeros(3, 48, 31)
    with pytest.raises(ValueError, match=r"weight\.main_grad: .* shape \(3, 48, 32\)"):
        run(one, torch.randn(17, 32), SP, None, False)


@pytest.mark.parametrize("delay", [False, True])
def test_megatron_fsdp_lazy_main_grad(delay):
    plain = make_layer(3)
    one = single_twin(plain, fuse_wgrad_accumulation=True, delay_wgrad_compute=delay)
    asked = []
    one.weight.__fsdp_param__ = True

    def get_main_grad():
        asked.append(1)
        if not hasattr(one.weight, "main_grad"):
            one.weight.main_grad = torch.zeros_like(one.weight)
        return one.weight.main_grad
    one.weight.get_main_grad = get_main_grad
    x, dy = torch.randn(17, 32), torch.randn(17, 48)
    want = run(plain, x, SP, None, False, dy)[2]
    y = one(x, SP)
    assert asked == [] and not hasattr(one.weight, "main_grad")
    y.backward(dy)
    one.backward_dw()
    assert asked == [1]
    torch.testing.assert_close(one.weight.main_grad, torch.stack(want), rtol=1e-6, atol=1e-5)


def test_deferred_wgrad_lands_in_the_one_grad():
    per = make_layer(3)
    one = single_twin(per, delay_wgrad_compute=True)
    assert one.weight.skip_backward_post_hook and one.bias.skip_backward_post_hook
    x, dy = torch.randn(17, 32), torch.randn(17, 48)
    want = run(per, x, SP, RECIPES["current"], False, dy)[2]
    with _autocast(RECIPES["current"]):
        y = one(x, SP)
    y.backward(dy)
    assert one.weight.grad is None and one.bias.grad is not None
    one.backward_dw()
    assert_bits_equal(one.weight.grad, torch.stack(want))


def test_checkpoints_load_across_layouts(tmp_path):
    per = make_layer(3)
    one = single_twin(per)
    torch.save(per.state_dict(), tmp_path / "per.pt")
    torch.save(one.state_dict(), tmp_path / "one.pt")
    fresh_one = single_twin(make_layer(3, seed=5))
    res = fresh_one.load_state_dict(torch.load(tmp_path / "per.pt"), strict=True)
    assert not res.missing_keys and not res.unexpected_keys
    assert_bits_equal(fresh_one.weight.detach(), torch.stack(per.weights()).detach())
    assert_bits_equal(fresh_one.bias.detach(), torch.stack(per.biases()).detach())
    fresh_per = make_layer(3, seed=6)
    fresh_per.load_state_dict(torch.load(tmp_path / "one.pt"), strict=True)
    for a, b in zip(fresh_per.weights(), per.weights()):
        assert_bits_equal(a.detach(), b.detach())
    # a checkpoint with both layouts: the target's own entries load, the others are dropped
    both = {**torch.load(tmp_path / "per.pt"), "weight": 2 * one.weight.detach(),
            "bias": one.bias.detach()}
    res = fresh_one.load_state_dict(dict(both), strict=True)
    assert not res.unexpected_keys
    assert_bits_equal(fresh_one.weight.detach(), 2 * one.weight.detach())
    res = fresh_per.load_state_dict(dict(both), strict=True)
    assert_bits_equal(fresh_per.weights()[1].detach(), per.weights()[1].detach())
    # a missing expert is reported as the target's missing key
    partial = {k: v for k, v in torch.load(tmp_path / "per.pt").items() if k != "weight1"}
    with pytest.raises(RuntimeError, match="Missing key.*weight"):
        single_twin(make_layer(3)).load_state_dict(partial, strict=True)
    # the delayed-scaling state travels with either layout
    rec = RECIPES["delayed"]
    run(one, torch.randn(17, 32), SP, rec, False)
    again = copy.deepcopy(per)
    again.init_fp8_state(rec)
    again.load_state_dict(one.state_dict(), strict=True)
    assert_bits_equal(again.fp8_scale, one.fp8_scale)


@pytest.mark.parametrize("recipe", ["none", "delayed"])
def test_torch_compile_fullgraph_matches_eager(recipe):
    from test_pytorch_grouped_linear import run_compiled

    torch._dynamo.reset()
    rec = RECIPES[recipe]
    eager = single_twin(make_layer(3))
    if rec is not None:
        eager.init_fp8_state(rec)
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, fullgraph=True)
    x = torch.randn(17, 32)
    for _ in range(2):
        want = run(eager, x, SP, rec, False)
        want_dw = eager.weight.grad
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf")
            got = run_compiled(compiled, compiled_layer, x, SP, rec)
        assert_bits_equal(got[0], want[0])
        assert_bits_equal(got[1], want[1])
        assert_bits_equal(compiled_layer.weight.grad, want_dw)


@pytest.mark.parametrize("recipe", ["none", "delayed"])
def test_torch_compile_fused_wgrad_matches_eager(recipe):
    torch._dynamo.reset()
    rec = RECIPES[recipe]
    eager = single_twin(make_layer(3), fuse_wgrad_accumulation=True)
    if rec is not None:
        eager.init_fp8_state(rec)
    compiled_layer = copy.deepcopy(eager)
    for layer in (eager, compiled_layer):
        layer.weight.main_grad = torch.full_like(layer.weight, 3.0)
    compiled = torch.compile(compiled_layer, fullgraph=True)
    x = torch.randn(17, 32)
    for first in (True, False):
        run(eager, x, SP, rec, False, is_first_microbatch=first)
        run(compiled, x, SP, rec, False, is_first_microbatch=first)
    assert_bits_equal(compiled_layer.weight.main_grad, eager.weight.main_grad)


@pytest.mark.parametrize("fused", [False, True])
def test_the_weight_gradient_is_not_stacked_again(fused):
    """The one weight goes into the autograd function whole: its FP8 wgrad (one (E, n, k) GEMM
    output) or its one dummy gradient comes back as it is, with no per-expert grads stacked (an
    unbind of the parameter would cost a copy of the weight gradient per backward)."""
    one = single_twin(make_layer(3), fuse_wgrad_accumulation=fused)
    if fused:
        one.weight.main_grad = torch.zeros_like(one.weight)
        one.weight.grad_added_to_main_grad = False
    x = torch.randn(17, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run(one, x, SP, RECIPES["current"], False)
    names = [e.name for e in prof.events()]
    assert "aten::stack" not in names and "UnbindBackward0" not in names
    assert one.weight.grad.shape == (3, 48, 32) and one.bias.grad.shape == (3, 48)
