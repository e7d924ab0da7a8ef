"""GroupedLinear under TransformerEngine's backward-precision options: ``override_linear_precision
=(False, False, True)`` (wgrad in the activation dtype) and current scaling's ``backward_override``
(``"high_precision"``: backward from the original operands; ``"dequantized"``: from the forward's
FP8 operands, dequantized). CPU path; references in float64, the FP8 operands from the NumPy
reference quantizer.

Tolerances: float32 activations, k <= 48 and at most 40 rows per expert: a float32 GEMM's
relative error is below ~1e-6 there, so ``rtol = atol = 1e-5`` passes it and fails an FP8 GEMM
(E4M3 / E5M2 operands, relative errors of a few percent), which each test also checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cugrouped import reference
from cugrouped.pytorch import DelayedScaling, Float8CurrentScaling, GroupedLinear, fp8_autocast

SPLITS = [9, 0, 23]
K, N = 32, 48
MODES = {"hp_wgrad": dict(override_linear_precision=(False, False, True)),
         "high_precision": dict(backward_override="high_precision"),
         "dequantized": dict(backward_override="dequantized")}


def make_layer(**kw):
    torch.manual_seed(0)
    layer = GroupedLinear(len(SPLITS), K, N, bias=True, device="cpu", **kw)
    with torch.no_grad():
        for b in layer.biases():
            b.normal_()
    return layer


def step(layer, x, dy, recipe, list_mode=False, saved=None):
    inp = [t.clone().requires_grad_() for t in x.split(SPLITS)] if list_mode \
        else x.clone().requires_grad_()
    hooks = torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t) or t if saved is not None else t, lambda t: t)
    with hooks, fp8_autocast(fp8_recipe=recipe):
        y = layer(inp, None if list_mode else SPLITS)
    y = torch.cat(y) if list_mode else y
    y.backward(dy)
    dx = torch.cat([t.grad for t in inp]) if list_mode else inp.grad
    return y.detach(), dx, [w.grad for w in layer.weights()], [b.grad for b in layer.biases()]


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(SPLITS), K, generator=g), torch.randn(sum(SPLITS), N, generator=g)


def close(a, b):
    return torch.allclose(a.double(), b, rtol=1e-5, atol=1e-5)


def dequantized(t: torch.Tensor, align: int) -> torch.Tensor:
    """The NumPy reference quantizer's E4M3 copy of ``t`` (current scaling), dequantized."""
    q = reference.multi_pad_cast_transpose([t.detach().numpy()], fp8_format="e4m3", align=align)
    return torch.from_numpy(np.asarray(q.dequantize()[0], dtype=np.float64))


@pytest.mark.parametrize("list_mode", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
def test_backward_modes_against_float64(mode, list_mode):
    x, dy = data()
    fp8 = step(make_layer(), x, dy, Float8CurrentScaling(), list_mode)
    y, dx, dw, db = step(make_layer(), x, dy, Float8CurrentScaling(**MODES[mode]), list_mode)
    assert torch.equal(y, fp8[0])                        # fprop is FP8 in every mode
    rows = np.cumsum([0] + SPLITS)
    layer = make_layer()
    for i, m in enumerate(SPLITS):
        xi, di = x[rows[i]:rows[i + 1]].double(), dy[rows[i]:rows[i + 1]].double()
        wi = layer.weights()[i].detach().double()
        if mode == "dequantized":
            xi, wi = dequantized(x[rows[i]:rows[i + 1]], 16), dequantized(layer.weights()[i], 1)
        assert close(dw[i], di.T @ xi), i
        assert close(db[i], di.sum(0)), i
        if mode == "hp_wgrad":                             # dgrad stays FP8
            assert torch.equal(dx[rows[i]:rows[i + 1]], fp8[1][rows[i]:rows[i + 1]]), i
        else:
            assert close(dx[rows[i]:rows[i + 1]], di @ wi), i
        if m:                                              # and the FP8 wgrad would not pass
            assert not close(fp8[2][i], di.T @ xi), i
    if mode == "dequantized":   # and the dequantized operands differ from the original ones
        assert not close(dw[0], dy[:9].double().T @ x[:9].double())


def test_high_precision_wgrad_with_delayed_scaling_keeps_the_fp8_state():
    """override_linear_precision with delayed scaling: the grad output is still cast (for the FP8
    dgrad), so every amax and scale evolves exactly as with an FP8 wgrad."""
    rec = DelayedScaling(amax_history_len=4)
    hp = DelayedScaling(amax_history_len=4, override_linear_precision=(False, False, True))
    a, b = make_layer(), make_layer()
    for seed in (1, 2, 3):
        x, dy = data(seed)
        ra, rb = step(a, x, dy, rec), step(b, x, dy, hp)
        assert torch.equal(ra[0], rb[0]) and torch.equal(ra[1], rb[1])
        for i in (0, 2):
            rows = slice(0, 9) if i == 0 else slice(9, 32)
            assert close(rb[2][i], dy[rows].double().T @ x[rows].double())
        for w in (*a.weights(), *b.weights()):
            w.grad = None
    for name in ("fp8_amax_history", "fp8_amax", "fp8_scale", "fp8_scale_inv"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("mode, uint8_bytes", [
    ("hp_wgrad", N * K * 3),                              # W^T only (the input is kept as is)
    ("high_precision", 0),                                # nothing in FP8
    ("dequantized", sum(SPLITS) * K + N * K * 3),         # the rows fprop read, x and W
])
def test_what_forward_keeps_for_backward(mode, uint8_bytes):
    saved = []
    x, dy = data()
    step(make_layer(), x, dy, Float8CurrentScaling(**MODES[mode]), saved=saved)
    assert sum(t.numel() for t in saved if t.dtype == torch.uint8) == uint8_bytes
    assert any(t.dtype == torch.float32 and t.shape == x.shape for t in saved) == (
        mode != "dequantized")


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
def test_backward_modes_into_main_grad(mode, delay):
    """fuse_wgrad_accumulation: the high-precision wgrad goes into the fp32 main_grad (added
    over two backwards), also when deferred to backward_dw()."""
    rec = Float8CurrentScaling(**MODES[mode])
    plain = make_layer()
    fused = make_layer(fuse_wgrad_accumulation=True, delay_wgrad_compute=delay)
    for w in fused.weights():
        w.main_grad = torch.zeros_like(w)
    want = [torch.zeros_like(w) for w in plain.weights()]
    for seed in (1, 2):
        x, dy = data(seed)
        for i, g in enumerate(step(plain, x, dy, rec)[2]):
            want[i] += g
        step(fused, x, dy, rec)
        fused.backward_dw()
        for w in plain.weights():
            w.grad = None
    for w, g in zip(fused.weights(), want):
        torch.testing.assert_close(w.main_grad, g, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_backward_modes_close_to_cpu(mode):
    """On CUDA (bf16): the same modes, against the CPU run of the same layer (FP8 bytes equal;
    the GEMMs differ by bf16 rounding and summation order: SQNR above 40 dB)."""
    rec = Float8CurrentScaling(**MODES[mode])
    x, dy = data()
    cpu = step(make_layer().bfloat16(), x.bfloat16(), dy.bfloat16(), rec)
    gpu = step(make_layer().cuda().bfloat16(), x.cuda().bfloat16(), dy.cuda().bfloat16(), rec)
    for a, b in zip(cpu[1:3], gpu[1:3]):
        for u, v in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
            u, v = u.double(), v.cpu().double()
            assert (u - v).norm() <= 0.01 * u.norm() + 1e-6


def test_no_dgrad_keeps_no_weights_and_eval_allows_save_original_input():
    """Without an input gradient the overrides keep no weights for backward; and
    save_original_input with delayed scaling is refused only where a backward will need the
    input (as in TransformerEngine): not under no_grad, not with frozen weights."""
    x, dy = data()
    for mode in ("high_precision", "dequantized"):
        saved = []
        layer = make_layer()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with fp8_autocast(fp8_recipe=Float8CurrentScaling(**MODES[mode])):
                y = layer(x, SPLITS)           # x does not require grad: no dgrad
        y.backward(dy)
        assert not any(t.shape == (N, K) or t.numel() == 3 * N * K for t in saved), mode
    layer = make_layer(save_original_input=True)
    with torch.no_grad(), fp8_autocast(fp8_recipe=DelayedScaling()):
        layer(x, SPLITS)
    for w in layer.weights():
        w.requires_grad_(False)
    with fp8_autocast(fp8_recipe=DelayedScaling()):
        layer(x.requires_grad_(), SPLITS).sum().backward()
