"""GroupedLinear(input_activation="swiglu") and MoEFeedForward's fused activation, on the CPU.

With per-tensor FP8 the layer's cast applies ``silu(a) * b`` to fc1's output; it must give the
bits of the plain layer fed the reference activation (cugrouped.reference.activation): the same
output, weight gradients and delayed-scaling state, and an input gradient that is the dgrad
through ``swiglu_backward``. Every other configuration computes the activation in torch and must
equal the plain layer on ``F.silu(a) * b``, gradients included."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cugrouped  # noqa: E402
from cugrouped.pytorch import GroupedLinear, MoEFeedForward, fp8_autocast  # noqa: E402
from cugrouped.pytorch._grouped_linear_fn import swiglu, swiglu_backward  # noqa: E402
from cugrouped.pytorch.recipe import (DelayedScaling, Float8BlockScaling,  # noqa: E402
                                      Float8CurrentScaling, MXFP8BlockScaling)
from cugrouped.reference import activation as ract  # noqa: E402

E, K, N = 3, 32, 48
SPLITS = [20, 0, 37]
PER_TENSOR = {"delayed": DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling()}


def pair(dtype=torch.float32):
    torch.manual_seed(0)
    fused = GroupedLinear(E, K, N, bias=True, params_dtype=dtype, device="cpu",
                          input_activation="swiglu")
    plain = GroupedLinear(E, K, N, bias=True, params_dtype=dtype, device="cpu")
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def ref_act(x: torch.Tensor) -> torch.Tensor:
    """The reference activation of float32 rows, as a float32 tensor."""
    a = x.detach().numpy()
    return torch.from_numpy(ract.swiglu(a[:, :K], a[:, K:]))


def grads(layer):
    return [p.grad.clone() for p in layer.parameters()]


def zero(*tensors_or_layers):
    for t in tensors_or_layers:
        for p in (t.parameters() if isinstance(t, torch.nn.Module) else [t]):
            p.grad = None


@pytest.mark.parametrize("form", ["tensor", "list"])
@pytest.mark.parametrize("recipe", list(PER_TENSOR))
def test_fused_activation_gives_the_plain_layers_bits_on_the_reference_activation(recipe, form):
    check_fused_against_plain(recipe, form, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["tensor", "list"])
@pytest.mark.parametrize("recipe", list(PER_TENSOR))
def test_gpu_fused_activation_gives_the_plain_layers_bits(recipe, form):
    """On CUDA: the kernel's activation has the reference's bits (the plain layer is fed those),
    so the FP8 operands, and with them the GEMMs' outputs, are the same."""
    check_fused_against_plain(recipe, form, "cuda")


def check_fused_against_plain(recipe, form, device):
    fused, plain = (layer.to(device) for layer in pair())
    rec = PER_TENSOR[recipe]
    x = torch.randn(sum(SPLITS), 2 * K) * 3
    x[3, 1], x[5, K + 2] = -100.0, 1e-40         # silu's -0 rule and a flushed denormal
    dy = torch.randn(sum(SPLITS), N).to(device)
    for step in range(3):        # delayed scaling: the scales of step 2 come from steps 0 and 1
        xf = x.clone().to(device).requires_grad_()
        act = ref_act(x).to(device).requires_grad_()
        if form == "list":
            xs, acts = list(xf.split(SPLITS)), list(act.split(SPLITS))
            with fp8_autocast(True, rec), cugrouped.record_launches() as launches:
                y1 = torch.cat(fused(xs))
            with fp8_autocast(True, rec):
                y2 = torch.cat(plain(acts))
        else:
            with fp8_autocast(True, rec), cugrouped.record_launches() as launches:
                y1 = fused(xf, SPLITS)
            with fp8_autocast(True, rec):
                y2 = plain(act, SPLITS)
        assert any("Act::SWIGLU" in ln.kernel for ln in launches), "the fused cast did not run"
        assert torch.equal(y1, y2), f"step {step}"
        y1.backward(dy)
        y2.backward(dy)
        assert all(torch.equal(a, b) for a, b in zip(grads(fused), grads(plain))), f"step {step}"
        assert torch.equal(xf.grad, swiglu_backward(xf.detach(), act.grad)), f"step {step}"
        zero(fused, plain)
    if recipe == "delayed":
        for name in ("fp8_amax_history", "fp8_scale", "fp8_scale_inv"):
            assert torch.equal(getattr(fused, name), getattr(plain, name)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_input_gradient_is_autograds_through_torchs_swiglu(dtype):
    """swiglu_backward gives the bits of autograd through F.silu(a) * b (the unfused layer's
    backward) and, in float64, the derivative."""
    x = (torch.randn(50, 2 * K) * 4).to(dtype)
    g = torch.randn(50, K).to(dtype)
    xr = x.clone().requires_grad_()
    swiglu(xr).backward(g)
    assert torch.equal(swiglu_backward(x, g), xr.grad)
    x64, g64 = x.double(), g.double()
    a, b = x64.chunk(2, dim=-1)
    s = torch.sigmoid(a)
    exact = torch.cat([g64 * b * s * (1 + a * (1 - s)), g64 * a * s], dim=-1)
    assert torch.allclose(swiglu_backward(x64, g64), exact, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("recipe", ["block", "mxfp8"])
def test_block_recipes_fuse_the_activation_too(recipe):
    """Float8BlockScaling and MXFP8BlockScaling: the block casts apply the activation (their
    1 x 128 / 1 x 32 scales are the activation's): the plain layer's bits on the reference
    activation, gradients included."""
    rec = Float8BlockScaling() if recipe == "block" else MXFP8BlockScaling()
    torch.manual_seed(1)
    k = 64                                             # MXFP8: whole 32-element blocks
    fused = GroupedLinear(E, k, 64, bias=False, params_dtype=torch.float32, device="cpu",
                          input_activation="swiglu")
    plain = GroupedLinear(E, k, 64, bias=False, params_dtype=torch.float32, device="cpu")
    plain.load_state_dict(fused.state_dict())
    splits = [32, 0, 64]
    x = torch.randn(sum(splits), 2 * k) * 3
    a = x.numpy()
    act = torch.from_numpy(ract.swiglu(a[:, :k], a[:, k:])).requires_grad_()
    xf = x.clone().requires_grad_()
    dy = torch.randn(sum(splits), 64)
    with fp8_autocast(True, rec), cugrouped.record_launches() as launches:
        y1 = fused(xf, splits)
    with fp8_autocast(True, rec):
        y2 = plain(act, splits)
    assert any("Act::SWIGLU" in ln.kernel for ln in launches)
    assert torch.equal(y1, y2)
    y1.backward(dy)
    y2.backward(dy)
    assert all(torch.equal(p, q) for p, q in zip(grads(fused), grads(plain)))
    assert torch.equal(xf.grad, swiglu_backward(x, act.grad))


FALLBACKS = {
    "no fp8": None,
    "2-D input blocks": Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),
    "hp_wgrad": DelayedScaling(override_linear_precision=(False, False, True)),
    "high_precision": Float8CurrentScaling(backward_override="high_precision"),
}


@pytest.mark.parametrize("name", list(FALLBACKS) + ["save_original_input"])
def test_other_configurations_compute_the_activation_in_torch(name):
    fused, plain = pair()
    rec = FALLBACKS.get(name, Float8CurrentScaling())
    if name == "save_original_input":
        fused.save_original_input = plain.save_original_input = True
    splits = [16, 0, 32] if "blocks" in name else SPLITS     # (block GEMMs: multiples of 8)
    x = (torch.randn(sum(splits), 2 * K) * 3).requires_grad_()
    xp = x.detach().clone().requires_grad_()
    dy = torch.randn(sum(splits), N)
    with fp8_autocast(rec is not None, rec), cugrouped.record_launches() as launches:
        y1 = fused(x, splits)
        y2 = plain(swiglu(xp), splits)
    assert not any("Act::SWIGLU" in ln.kernel for ln in launches)
    assert torch.equal(y1, y2)
    y1.backward(dy)
    y2.backward(dy)
    assert torch.equal(x.grad, xp.grad)
    assert all(torch.equal(a, b) for a, b in zip(grads(fused), grads(plain)))


def test_bfloat16_layer_is_close_to_torchs_activation():
    """In bfloat16 the fused activation is computed in float32 (torch's rounds silu(a) and the
    product to bfloat16): the outputs agree to FP8 precision, not bit for bit."""
    fused, plain = pair(torch.bfloat16)
    x = torch.randn(sum(SPLITS), 2 * K, dtype=torch.bfloat16)
    with fp8_autocast(True, Float8CurrentScaling()):
        y1, y2 = fused(x, SPLITS), plain(swiglu(x), SPLITS)
    err = (y1.float() - y2.float()).abs().max() / y2.float().abs().max()
    assert err < 0.1, err


def test_more_dims_and_the_repr():
    fused, plain = pair()
    x = torch.randn(2, 19, 2 * K)
    with fp8_autocast(True, Float8CurrentScaling()):
        y = fused(x, [10, 9, 19])
        want = plain(ref_act(x.reshape(-1, 2 * K)), [10, 9, 19])
    assert y.shape == (2, 19, N) and torch.equal(y.reshape(-1, N), want)
    assert "input_activation='swiglu'" in repr(fused)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="input_activation: expected None or 'swiglu'"):
        GroupedLinear(E, K, N, device="cpu", input_activation="gelu")
    fused, _ = pair()
    with pytest.raises(ValueError, match=r"inp: .*2 \* in_features=64\) for input_activation"):
        fused(torch.randn(57, K), SPLITS)
    with pytest.raises(TypeError, match=r"inp\[0\]: expected a torch.Tensor"):
        fused([np.zeros((2, 2 * K))] * 3)
    with pytest.raises(ValueError, match=r"inp\[1\].*2 \* in_features=64"):
        fused([torch.randn(m, 2 * K) for m in SPLITS[:1]] + [torch.randn(0, K),
                                                          torch.randn(37, 2 * K)])
    with pytest.raises(ValueError, match="row_index: not with input_activation"):
        fused(torch.randn(8, 2 * K), [2, 3, 3], row_index=torch.arange(8))


def make_block(fuse_activation: bool, seed: int = 0):
    torch.manual_seed(seed)
    return MoEFeedForward(32, 32, num_experts=4, top_k=2, params_dtype=torch.float32,
                          device="cpu", fuse_activation=fuse_activation)


def test_moe_block_fuses_swiglu_into_fc2s_cast_by_default():
    fused, plain = make_block(True), make_block(False)
    assert fused.fc2.input_activation == "swiglu" and plain.fc2.input_activation is None
    plain.load_state_dict(fused.state_dict())          # the same parameters and state
    x = torch.randn(40, 32)
    with fp8_autocast(True, DelayedScaling()), cugrouped.record_launches() as launches:
        y1 = fused(x)
    assert any("Act::SWIGLU" in ln.kernel for ln in launches)
    with fp8_autocast(True, DelayedScaling()):
        y2 = plain(x)
    # torch's silu and the kernel's differ by float32 ulps, which may move an FP8 rounding
    err = (y1 - y2).abs().max() / y2.abs().max()
    assert err < 0.05, err
    without_fp8 = copy.deepcopy(fused)
    assert torch.equal(without_fp8(x), plain(x))        # no FP8: torch computes it, same bits
    with pytest.raises(TypeError, match="fuse_activation"):
        MoEFeedForward(32, 32, 4, device="cpu", fuse_activation=1)


def test_moe_block_with_a_replaced_fc2_applies_the_activation_itself():
    block = make_block(True)
    twin = make_block(False)
    twin.load_state_dict(block.state_dict())
    block.fc2 = twin.fc2                       # no input_activation: the block applies it
    x = torch.randn(24, 32)
    assert torch.equal(block(x), twin(x))
    assert np.isfinite(block(x).detach().numpy()).all()


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    eager, _ = pair()
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, fullgraph=True)
    x = torch.randn(sum(SPLITS), 2 * K)
    dy = torch.randn(sum(SPLITS), N)
    outs = []
    for layer in (eager, compiled):
        xi = x.clone().requires_grad_()
        with fp8_autocast(True, Float8CurrentScaling()):
            y = layer(xi, SPLITS)
        y.backward(dy)
        outs.append((y.detach(), xi.grad))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(grads(eager), grads(compiled_layer)))
    # the input gradient's elementwise torch ops are Inductor's to fuse (float32 opmath, FMA)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-6, atol=1e-7)
