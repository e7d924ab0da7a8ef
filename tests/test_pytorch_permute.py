"""GroupedLinear(..., row_index=): the MoE permute folded into the layer (and, with FP8 and the
default backward, into the cast kernel). Compared with the same layer on the explicitly permuted
input, whose numerics the other tests pin to independent references."""

from __future__ import annotations

import copy

import pytest
import torch

from cugrouped.pytorch import (DelayedScaling, Float8CurrentScaling, GroupedLinear, fp8_autocast)
from cugrouped.pytorch import _gather

from test_pytorch_grouped_linear import assert_bits_equal, make_layer

T, K, N = 23, 32, 48
SPLITS = [9, 0, 21]
RECIPES = {"none": None, "current": Float8CurrentScaling(),
           "delayed": DelayedScaling(amax_history_len=4),
           "high_precision": Float8CurrentScaling(backward_override="high_precision"),
           "hp_wgrad": DelayedScaling(override_linear_precision=(False, False, True))}


def _routing(seed=0, dropped=(4, 17)):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, T, (sum(SPLITS),), generator=g)
    idx[list(dropped)] = -1                  # capacity padding: zero rows
    return idx


def _step(layer, tokens, idx, dy, recipe, fused, **kw):
    """One forward + backward; ``fused``: row_index, else the permute done first by hand."""
    x = tokens.detach().clone().requires_grad_()
    for p in layer.parameters():
        p.grad = None
    with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        if fused:
            y = layer(x, SPLITS, row_index=idx, **kw)
        else:
            valid = (idx >= 0).unsqueeze(1)
            rows = torch.where(valid, x.index_select(0, idx.clamp(min=0)), 0.0)
            y = layer(rows, SPLITS, **kw)
    y.backward(dy)
    return y.detach(), x.grad, [w.grad for w in layer.weights()], [b.grad for b in layer.biases()]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_row_index_equals_the_permuted_input(recipe):
    """Output, weight and bias gradients bit for bit; the tokens' gradient too (float32: the
    explicit permute's backward and the layer's scatter both add in index order on the CPU), over
    two steps (delayed scaling's state moves)."""
    rec = RECIPES[recipe]
    idx = _routing()
    torch.manual_seed(1)
    plain, fused = make_layer(3), make_layer(3)
    for step in range(2):
        tokens = torch.randn(T, K)
        dy = torch.randn(sum(SPLITS), N)
        a = _step(plain, tokens, idx, dy, rec, False)
        b = _step(fused, tokens, idx, dy, rec, True)
        assert_bits_equal(b, a, f"{recipe} step {step}")
    # dropped rows (negative index): a zero input row, so the output is the bias alone
    for j in (4, 17):
        e = 0 if j < SPLITS[0] else 2
        assert torch.equal(b[0][j], fused.biases()[e].detach()), j


def test_fp8_default_backward_never_makes_the_permuted_copy(monkeypatch):
    """With FP8 and the default backward the cast kernel gathers: the autograd gather is not
    called and forward saves no high-precision (Σm, k) tensor; the overrides gather first."""
    def boom(*a):
        raise AssertionError("gather_rows called")
    from cugrouped.pytorch import grouped_linear as gl

    monkeypatch.setattr(gl, "gather_rows", boom)
    idx = _routing()
    layer = make_layer(3)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _step(layer, torch.randn(T, K), idx, torch.randn(sum(SPLITS), N), RECIPES["current"], True)
    assert not any(t.dtype == torch.float32 and t.shape == (sum(SPLITS), K) for t in saved)
    with pytest.raises(AssertionError, match="gather_rows called"):
        _step(layer, torch.randn(T, K), idx, torch.randn(sum(SPLITS), N), RECIPES["none"], True)


def test_bf16_tokens_gradient_summed_in_float32():
    """bfloat16: the tokens' gradient is the float32 sum of its rows' gradients rounded once
    (a token routed to several experts)."""
    idx = torch.tensor([0, 1, 2, 0, 1, 3, 0, 2, 4, 5, 0, 1] + [6] * 18)
    layer = make_layer(3, dtype=torch.bfloat16)
    tokens = torch.randn(T, K).bfloat16()
    dy = torch.randn(sum(SPLITS), N).bfloat16()
    _, gx, _, _ = _step(layer, tokens, idx, dy, RECIPES["current"], True)
    ref = make_layer(3, dtype=torch.bfloat16)
    rows = tokens.index_select(0, idx).requires_grad_()
    with fp8_autocast(fp8_recipe=RECIPES["current"]):
        ref(rows, SPLITS).backward(dy)
    want = torch.zeros(T, K).index_add_(0, idx, rows.grad.float()).bfloat16()
    assert torch.equal(gx, want)


def test_torch_compile_with_row_index_matches_eager():
    idx = _routing()
    layer = make_layer(3)
    compiled = torch.compile(lambda x: layer(x, SPLITS, row_index=idx), fullgraph=True)
    tokens = torch.randn(T, K)
    with fp8_autocast(fp8_recipe=RECIPES["current"]):
        x1 = tokens.clone().requires_grad_()
        y1 = compiled(x1)
        y1.sum().backward()
        x2 = tokens.clone().requires_grad_()
        y2 = layer(x2, SPLITS, row_index=idx)
        y2.sum().backward()
    assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad)


def test_row_index_bad_input():
    layer = make_layer(3)
    x = torch.randn(T, K)
    with pytest.raises(ValueError, match="row_index: gathers rows of one 2-D"):
        layer([x[:9], x[:0], x[:14]], row_index=torch.zeros(23, dtype=torch.int64))
    with pytest.raises(TypeError, match="row_index: expected a contiguous 1-D int64"):
        layer(x, SPLITS, row_index=torch.zeros(30, dtype=torch.int32))
    with pytest.raises(ValueError, match="row_index: has 29 entries but m_splits counts 30"):
        layer(x, SPLITS, row_index=torch.zeros(29, dtype=torch.int64))
    with pytest.raises(ValueError, match="row_index: indices must be below the 23 rows"):
        layer(x, SPLITS, row_index=torch.full((30,), 23, dtype=torch.int64))
    with pytest.raises(ValueError, match="m_splits: required with row_index"):
        layer(x, row_index=torch.zeros(30, dtype=torch.int64))


def test_gather_and_scatter_are_adjoint_and_sync_free_shapes():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([3, -1, 0, 3, 6, 9, 2])       # 9 >= 7: a zero row, as on the device
    assert torch.autograd.gradcheck(lambda t: _gather.gather_rows(t, idx), (tokens,))
    rows = torch.randn(7, 5, dtype=torch.float64, generator=g)
    out = _gather.scatter_rows(rows, idx, 7)
    assert torch.equal(out[3], rows[0] + rows[3]) and torch.equal(out[1], torch.zeros(5,
                                                                  dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_gpu_row_index_equals_the_permuted_input(recipe):
    """On CUDA: the fused gather's output and weight gradients equal the explicit permute's bit
    for bit; the tokens' gradient within float32 summation order (atomics)."""
    torch.use_deterministic_algorithms(False)
    idx = _routing().cuda()
    base = make_layer(3, dtype=torch.bfloat16)
    plain, fused = copy.deepcopy(base).cuda(), copy.deepcopy(base).cuda()
    tokens = torch.randn(T, K, device="cuda").bfloat16()
    dy = torch.randn(sum(SPLITS), N, device="cuda").bfloat16()
    a = _step(plain, tokens, idx, dy, RECIPES[recipe], False)
    b = _step(fused, tokens, idx, dy, RECIPES[recipe], True)
    assert_bits_equal(b[0], a[0], "y")
    assert_bits_equal(b[2], a[2], "dW")
    torch.testing.assert_close(b[1].float(), a[1].float(), rtol=2e-2, atol=2e-2)


def test_moe_style_module_use():
    """GroupedLinear is usable as fc1 of an MoE block fed by a router's order."""
    layer = GroupedLinear(3, K, N, device="cpu")
    idx = _routing(dropped=())
    with fp8_autocast(fp8_recipe=RECIPES["delayed"]):
        y = layer(torch.randn(T, K), SPLITS, row_index=idx)
    assert y.shape == (sum(SPLITS), N)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_gpu_moe_fuse_permute_equals_the_default_block(recipe):
    """MoEFeedForward(fuse_permute=True) on CUDA, top-2: the same output and gradients, bit for
    bit (two addends per token: the order of the atomic sums cannot matter)."""
    from cugrouped.pytorch import MoEFeedForward

    torch.manual_seed(0)
    plain = MoEFeedForward(64, 128, 8, 2, params_dtype=torch.bfloat16, device="cuda")
    fused = copy.deepcopy(plain)
    fused.fuse_permute = True
    x = torch.randn(300, 64, device="cuda").bfloat16()
    outs = []
    for block in (plain, fused):
        xi = x.clone().requires_grad_()
        with fp8_autocast(fp8_recipe=RECIPES[recipe]):
            y = block(xi)
        y.float().square().mean().backward()
        outs.append((y.detach(), xi.grad, [p.grad for p in block.parameters()]))
    assert_bits_equal(outs[1][0], outs[0][0], "y")
    assert_bits_equal(outs[1][1], outs[0][1], "dx")
    assert_bits_equal(outs[1][2], outs[0][2], "params")
