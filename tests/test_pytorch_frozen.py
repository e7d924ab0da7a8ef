"""``FrozenGroupedLinear`` (cugrouped/pytorch/frozen.py): frozen experts on a checkpoint's FP8
weights with 128 x 128 block scales. On the CPU, bit for bit against the public ops composed by
hand (each expert's rows padded with zero rows to a multiple of 8, cast per 1 x 128 block, the
block-scaled fprop / dgrad on the reference, the pad rows dropped), list and tensor forms alike,
against the float64 product within FP8's error, state_dict, errors; on a GPU (the GPU check),
cuBLASLt against the CPU run."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cugrouped  # noqa: E402
from cugrouped.pytorch import FrozenGroupedLinear  # noqa: E402
from test_block_scaled_weights import checkpoint  # noqa: E402

E, N, K = 3, 144, 272


def layer_and_weights(seed=0, bias=True, **kw):
    q, s = checkpoint(E, N, K, seed=seed)
    tq = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
    b = torch.from_numpy(np.random.default_rng(seed).standard_normal((E, N)).astype(np.float32))
    layer = FrozenGroupedLinear(tq, torch.from_numpy(s), b if bias else None, **kw)
    return layer, cugrouped.block_scaled_weights(tq, torch.from_numpy(s)), b if bias else None


def by_hand(x, dy, splits, W, bias, power_2_scale=False, grad_fmt="e4m3"):
    """The layer's math from the public ops: rows padded per expert to a multiple of 8 (zero
    rows), cast per 1 x 128 block, fprop (+ bias) and dgrad on the reference, pad rows dropped."""
    def pad(t):
        parts, padded = [], []
        for part in torch.split(t, splits):
            extra = -part.shape[0] % 8
            parts.append(torch.cat([part, part.new_zeros(extra, part.shape[1])]))
            padded.append(part.shape[0] + extra)
        return torch.cat(parts), padded

    def unpad(t, padded):
        return torch.cat([p[:m] for p, m in zip(torch.split(t, padded), splits)])

    xp, padded = pad(x)
    x8 = cugrouped.multi_block_cast_transpose(xp, padded, power_2_scale=power_2_scale,
                                              columnwise=False)
    y = cugrouped.grouped_fprop(x8, W, out_dtype=str(x.dtype).removeprefix("torch."))
    if bias is not None:
        y = y + torch.repeat_interleave(bias.to(y.dtype), torch.tensor(padded), dim=0)
    dyp, _ = pad(dy)
    d8 = cugrouped.multi_block_cast_transpose(dyp, padded, fp8_format=grad_fmt,
                                              power_2_scale=power_2_scale, columnwise=False)
    dx = cugrouped.grouped_dgrad(d8, W, out_dtype=str(x.dtype).removeprefix("torch."))
    return unpad(y, padded), unpad(dx, padded)


@pytest.mark.parametrize("splits", [[8, 0, 24], [5, 0, 20], [0, 13, 1], [7, 9, 16]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("options", [{}, {"power_2_scale": True, "grad_fp8_format": "e5m2"}])
def test_equals_the_ops_composed_by_hand(splits, dtype, options):
    layer, W, b = layer_and_weights(seed=sum(splits), **options)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(splits), K, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(sum(splits), N, generator=g).to(dtype)
    y = layer(x, splits)
    y.backward(dy)
    want_y, want_dx = by_hand(x.detach(), dy, splits, W, b, options.get("power_2_scale", False),
                              options.get("grad_fp8_format", "e4m3"))
    assert y.dtype == dtype and torch.equal(y, want_y)
    assert x.grad.dtype == dtype and torch.equal(x.grad, want_dx)
    # the list form: the same values and gradients
    xs = [t.detach().clone().requires_grad_() for t in torch.split(x.detach(), splits)]
    ys = layer(xs)
    torch.autograd.backward(ys, list(torch.split(dy, splits)))
    assert [tuple(t.shape) for t in ys] == [(m, N) for m in splits]
    assert torch.equal(torch.cat(ys), y) and torch.equal(torch.cat([t.grad for t in xs]), x.grad)


def test_close_to_the_float64_product_and_frozen():
    """Within FP8's error of the dequantized weights' float64 product (SQNR > 25 dB: the
    input's E4M3 rounding, 2^-4 relative at most per element); no parameters, no gradient
    for the buffers."""
    layer, W, b = layer_and_weights(seed=3)
    x = torch.randn(40, K, dtype=torch.float64)
    y = layer(x.float(), [16, 8, 16]).double()
    want = torch.cat([xe @ w.double().T + be for xe, w, be in zip(
        torch.split(x, [16, 8, 16]), W.dequantize(), b.double())])
    sqnr = 10 * torch.log10(want.pow(2).sum() / (y - want).pow(2).sum())
    assert sqnr > 25, float(sqnr)
    assert list(layer.parameters()) == []
    assert all(not t.requires_grad for t in layer.buffers())


def test_torch_compile_fullgraph_matches_eager():
    layer, _, _ = layer_and_weights(seed=9)
    x = torch.randn(25, K, requires_grad=True)
    y = layer(x, [5, 0, 20])
    y.backward(torch.ones_like(y))
    xc = x.detach().clone().requires_grad_()
    yc = torch.compile(lambda t: layer(t, [5, 0, 20]), fullgraph=True)(xc)
    yc.backward(torch.ones_like(yc))
    assert torch.equal(yc, y) and torch.equal(xc.grad, x.grad)


@pytest.mark.parametrize("splits", [(5, 0, 20), (8, 16), (0, 0, 3), (7,), (1, 8, 0, 9, 24)])
def test_the_padding_made_on_the_device_is_the_hosts(splits):
    """Under torch.compile the pad indices are made where the tokens are, from the counts alone
    (a host copy there would be pageable: torch syncs after it); the same plan as the host's."""
    from cugrouped.pytorch.frozen import _device_padding, _host_padding

    want, got = _host_padding.__wrapped__(splits, False), _device_padding(splits, torch.device("cpu"))
    if want is None:
        assert got is None
        return
    assert got[0] == want[0]
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_a_dtype_cast_of_the_model_keeps_the_scales_float32():
    """``model.bfloat16()`` (common before FP8 training or inference) casts the bias, not the
    block scales the GEMMs read as float32: the same outputs for bfloat16 inputs."""
    layer, _, _ = layer_and_weights(seed=10)
    x = torch.randn(16, K).bfloat16()
    layer.bias.data = layer.bias.bfloat16().float()    # the rounding the cast will do
    want = layer(x, [8, 0, 8])
    layer.bfloat16()
    assert layer.weight_scale_inv.dtype == layer.weight_scale_inv_t.dtype == torch.float32
    assert layer.bias.dtype == torch.bfloat16 and layer.weight_data.dtype == torch.uint8
    assert torch.equal(layer(x, [8, 0, 8]), want)


def test_state_dict_round_trip():
    a, _, _ = layer_and_weights(seed=4)
    b, _, _ = layer_and_weights(seed=5)
    x = torch.randn(16, K)
    assert not torch.equal(a(x, [8, 0, 8]), b(x, [8, 0, 8]))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(x, [8, 0, 8]), b(x, [8, 0, 8]))


def test_no_input_gradient_asked_for():
    layer, _, _ = layer_and_weights(seed=6, bias=False)
    with torch.no_grad():
        y = layer(torch.randn(9, K), [1, 0, 8])
    assert y.shape == (9, N) and not y.requires_grad


def test_errors_name_the_argument():
    layer, _, _ = layer_and_weights(seed=7)
    x = torch.randn(16, K)
    q, s = checkpoint(E, N, K, seed=7)
    cases = [
        (lambda: layer(x), ValueError, r"m_splits: required with a single input tensor"),
        (lambda: layer(x, [8, 8]), ValueError, r"m_splits: expected 3 counts, got 2"),
        (lambda: layer(x, [8, 9, -1]), ValueError, r"m_splits: counts must be non-negative"),
        (lambda: layer(x, [8.0, 0, 8]), TypeError, r"m_splits: expected ints, got 8.0"),
        (lambda: layer(x, [8, 0, 9]), ValueError, r"m_splits: sum 17 != inp rows 16"),
        (lambda: layer(torch.randn(16, K + 1), [8, 0, 8]), ValueError,
         r"inp: expected a 2-D tensor \(rows, 272\)"),
        (lambda: layer([x[:8], x[8:]]), ValueError, r"inp: expected 3 tensors"),
        (lambda: layer([x[:8], x[8:], x[:0].double()]), TypeError,
         r"inp\[2\]: expected float32, bfloat16 or float16 like inp\[0\]"),
        (lambda: layer(x.to(torch.int32), [8, 0, 8]), TypeError, r"inp: expected float32"),
        (lambda: layer([x[:8], x[8:], x[:0]], [8, 8, 0]), ValueError,
         r"m_splits: not with a list input"),
        (lambda: layer(x.to("meta"), [8, 0, 8]), ValueError, r"inp: on meta, the weights on cpu"),
        (lambda: FrozenGroupedLinear(q, s), TypeError, r"weight: expected torch tensors"),
        (lambda: FrozenGroupedLinear(torch.from_numpy(q.view(np.uint8)), torch.from_numpy(s)),
         ValueError, r"data: uint8 bytes need fp8_format="),
        (lambda: FrozenGroupedLinear(torch.from_numpy(q.view(np.uint8)), torch.from_numpy(s),
                                     torch.zeros(E, N + 1), fp8_format="e4m3"),
         ValueError, r"bias: expected \(3, 144\) on cpu"),
        (lambda: FrozenGroupedLinear(torch.from_numpy(q.view(np.uint8)), torch.from_numpy(s),
                                     fp8_format="e4m3", grad_fp8_format="fp8"),
         ValueError, r"grad_fp8_format: expected 'e4m3' or 'e5m2'"),
        (lambda: FrozenGroupedLinear(torch.from_numpy(q.view(np.uint8)), torch.from_numpy(s),
                                     fp8_format="e5m2", grad_fp8_format="e5m2"),
         ValueError, r"grad_fp8_format: 'e5m2' with E5M2 weights would be an E5M2 x E5M2"),
        (lambda: FrozenGroupedLinear(torch.from_numpy(q.view(np.uint8))[:, :, :200],
                                     torch.from_numpy(s)[:, :, :2], fp8_format="e4m3"),
         ValueError, r"weight: FP8 GEMMs need both feature sizes in multiples of 16, got "
                     r"\(144, 200\)"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()


@pytest.mark.gpu
def test_gpu_layer_against_the_cpu_run():
    """On the GPU: the casts are the CPU run's bits (same kernels), so the outputs and input
    gradients differ from the CPU's (reference GEMMs) only by cuBLASLt's float32 accumulation
    with the block scales applied per 128-element step (test_grouped_gemm_block.py's bound:
    2^-11 of sum |a b|, plus output roundings): checked as 2^-7 of the largest value."""
    from _block_common import skip_unless_block_gemms

    skip_unless_block_gemms()
    layer, _, _ = layer_and_weights(seed=8)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(45, K, generator=g).to(torch.bfloat16)
    dy = torch.randn(45, N, generator=g).to(torch.bfloat16)
    outs = []
    for dev in ("cpu", "cuda"):
        xi = x.to(dev, copy=True).requires_grad_()     # a leaf: x.to("cpu") is x itself
        y = layer.to(dev)(xi, [5, 0, 40])
        y.backward(dy.to(dev))
        outs.append((y.float().cpu(), xi.grad.float().cpu()))
    for a, b in zip(*outs):
        assert (a - b).abs().max() <= 2**-7 * a.abs().max()


def test_row_index_folds_the_permute_in():
    """``row_index`` (tokens gathered by the cast, -1 a zero row): the outputs of the layer on
    the gathered rows, bit for bit, and the tokens' gradient their rows' gradients summed back
    (float32: the same order as autograd's index_add)."""
    layer, _, _ = layer_and_weights(seed=11)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randn(12, K, generator=g)
    splits = [5, 0, 14]
    idx = torch.randint(-1, 12, (sum(splits),), generator=g)
    dy = torch.randn(sum(splits), N, generator=g)
    t1 = tokens.clone().requires_grad_()
    y = layer(t1, splits, row_index=idx)
    y.backward(dy)
    t2 = tokens.clone().requires_grad_()
    rows = torch.where((idx >= 0)[:, None], t2[idx.clamp(min=0)], torch.zeros(()))
    want = layer(rows, splits)
    want.backward(dy)
    assert torch.equal(y, want) and torch.equal(t1.grad, t2.grad)
    with pytest.raises(ValueError, match=r"row_index: has 18 entries but m_splits counts 19"):
        layer(tokens, splits, row_index=idx[:-1])
    with pytest.raises(ValueError, match=r"row_index: gathers from one tensor of tokens"):
        layer([tokens[:5], tokens[:0], tokens], row_index=idx)


def test_frozen_experts_in_cugrouped_moe_block():
    """Frozen FP8 experts dropped into MoEFeedForward (fc1 = [gate; up] of a checkpoint, fc2 =
    down): the block runs forward and backward, the fused permute and the explicit one give the
    same bits, and only the router gets a gradient."""
    from cugrouped.pytorch import MoEFeedForward

    H, F = 256, 128
    ys = []
    for fuse in (False, True):
        torch.manual_seed(0)
        moe = MoEFeedForward(H, F, E, top_k=2, device="cpu", fuse_permute=fuse)
        q1, s1 = checkpoint(E, 2 * F, H, seed=12)
        q2, s2 = checkpoint(E, H, F, seed=13)
        as_t = lambda q: torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)  # noqa
        moe.fc1 = FrozenGroupedLinear(as_t(q1), torch.from_numpy(s1))
        moe.fc2 = FrozenGroupedLinear(as_t(q2), torch.from_numpy(s2))
        x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(4)).requires_grad_()
        y = moe(x)
        y.backward(torch.ones_like(y))
        moe.backward_dw()
        assert [n for n, p in moe.named_parameters() if p.grad is not None] == ["router.weight"]
        ys.append((y.detach(), x.grad))
    assert torch.equal(ys[0][0], ys[1][0]) and torch.equal(ys[0][1], ys[1][1])


def test_e5m2_weights_and_inference_only():
    """E5M2 weights: the input is cast to E4M3 (E4M3 x E5M2 is a cuBLASLt GEMM); by hand the
    same bits. ``input_grad=False`` keeps no transposed copy and refuses inputs that require a
    gradient; ``once_differentiable`` refuses a double backward."""
    q, s = checkpoint(E, N, K, fmt="e5m2", seed=14)
    tq = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e5m2)
    layer = FrozenGroupedLinear(tq, torch.from_numpy(s))
    W = cugrouped.block_scaled_weights(tq, torch.from_numpy(s))
    x = torch.randn(21, K).requires_grad_()
    dy = torch.randn(21, N)
    y = layer(x, [5, 8, 8])
    y.backward(dy)
    want_y, want_dx = by_hand(x.detach(), dy, [5, 8, 8], W, None)
    assert torch.equal(y, want_y) and torch.equal(x.grad, want_dx)
    lean = FrozenGroupedLinear(tq, torch.from_numpy(s), input_grad=False)
    assert lean.weight_data_t is None and lean.weight_scale_inv_t is None
    assert torch.equal(lean(x.detach(), [5, 8, 8]), y) and lean.bfloat16() is lean
    with pytest.raises(ValueError, match=r"inp: requires a gradient, but the layer was built "
                                         r"with input_grad=False"):
        lean(x, [5, 8, 8])
    with torch.no_grad():
        assert torch.equal(lean(x, [5, 8, 8]), y)
    xx = x.detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(layer(xx, [5, 8, 8]).pow(2).sum(), xx, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):   # its dy depends on x
        g.sum().backward()
