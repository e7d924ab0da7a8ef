"""GroupedLinear with Float8BlockScaling (TransformerEngine's block-scaled FP8 recipe) on the CPU:
the layer equals a per-expert loop of the same quantize -> GEMM steps written with
cugrouped.reference (bit for bit, forward and every gradient), list and tensor inputs agree,
weights are cached with is_first_microbatch, main_grad accumulates, torch.compile matches eager,
the recipe checks TransformerEngine's rules, and the GPU twin (``gpu``)."""

from __future__ import annotations

import copy

import ml_dtypes
import numpy as np
import pytest
import torch

from cugrouped import reference
from cugrouped.ops import record_launches
from cugrouped.pytorch import (Float8BlockScaling, Format, MMParams, MXFP8BlockScaling, QParams,
                               cpu_cast_backend, fp8_autocast)
from test_pytorch_grouped_linear import assert_bits_equal, make_layer, run, run_compiled

pytest.register_assert_rewrite("_block_common")
from _block_common import skip_unless_block_gemms  # noqa: E402

K, N = 256, 144          # two 128-blocks of k (the second whole), n not a multiple of 128
SPLITS = {"uneven": [16, 8, 136], "empty_first": [0, 40, 24], "empty_middle": [24, 0, 128],
          "single": [264]}
RECIPE = Float8BlockScaling()


def _bits(t):
    """float32 values of a torch tensor as NumPy (bfloat16 through its bits)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def block_varied(layer):
    """Weights whose 128 x 128 blocks have different magnitudes (so every block has its own
    scale, and a block's scale read from the wrong place shows)."""
    with torch.no_grad():
        for e, w in enumerate(layer.weights()):
            for rb in range(0, w.shape[0], 128):
                for cb in range(0, w.shape[1], 128):
                    w[rb:rb + 128, cb:cb + 128] *= 2.0 ** ((3 * rb // 128 + cb // 128 + e) % 5 - 2)
    return layer


def loop_reference(layer, x, dy, splits, recipe=RECIPE):
    """The layer's forward and gradients as a per-expert loop of the reference ops: block-cast
    the input (1-D), the weights (2-D) and the grad output (1-D), then the three GEMMs; bias
    added in float32 and rounded once; dbias the grad output's column sums in the block cast's
    order (the reference's, itself checked against exact sums in test_block_cast_transpose)."""
    fwd, bwd = recipe.fp8_format.forward, recipe.fp8_format.backward
    dims = recipe.block_dims               # (MXFP8BlockScaling: MXFP8 everywhere, tokens padded to 32)
    align = recipe.token_padding
    ws = [_bits(w.detach()) for w in layer.weights()]
    xq = reference.multi_block_cast_transpose(_bits(x), splits, fp8_format=fwd, align=align,
                                              block_scaling_dim=dims[0])
    wq = reference.multi_block_cast_transpose(ws, align=1, fp8_format=fwd,
                                              block_scaling_dim=dims[1])
    dyq = reference.multi_block_cast_transpose(_bits(dy), splits, fp8_format=bwd, align=align,
                                               block_scaling_dim=dims[2], column_sums=True)
    y = reference.grouped_fprop(xq, wq, out_dtype="float32").astype(np.float64)
    off = np.concatenate([[0], np.cumsum(splits)])
    for i, b in enumerate(layer.biases()):
        y[off[i]:off[i + 1]] += _bits(b.detach()).astype(np.float64)
    dx = reference.grouped_dgrad(dyq, wq, out_dtype="float32")
    dw = reference.grouped_wgrad(xq, dyq)
    return y, dx, dw, dyq.column_sums


# The checks both block recipes run (test_pytorch_mxfp8.py calls them with MXFP8BlockScaling, its
# own token counts and k, n).

def check_layer_equals_the_reference_loop(recipe, sp, seed, k, n):
    """Forward and every gradient of a layer with varied block magnitudes equal
    loop_reference's bit for bit."""
    E = len(sp)
    layer = block_varied(make_layer(E, k, n))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sp), k, generator=g) * torch.exp2(torch.randint(-4, 4, (sum(sp), 1), generator=g))
    dy = torch.randn(sum(sp), n, generator=g) * 1e-2
    y, dx, dws, dbs = run(layer, x, sp, recipe, False, dy)
    ry, rdx, rdw, rdb = loop_reference(layer, x, dy, sp, recipe)
    assert np.array_equal(y.detach().numpy(), ry.astype(np.float32))
    assert np.array_equal(dx.numpy(), rdx)
    for i in range(E):
        assert np.array_equal(dws[i].numpy(), rdw[i]), i
        assert np.array_equal(dbs[i].numpy(), rdb[i]), i


def check_list_and_tensor_inputs_identical(recipe, sp, k, n):
    base = make_layer(len(sp), k, n)
    x, dy = torch.randn(sum(sp), k), torch.randn(sum(sp), n)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    assert_bits_equal(run(a, x, sp, recipe, True, dy, steps=2), run(b, x, sp, recipe, False, dy, steps=2))


def check_emulated_casts_give_the_reference_bits(recipe, sp, k, n):
    """A bfloat16 layer with its casts on the CUDA kernel's CPU emulator gives the reference
    twin's bits; returns the emulated run's outputs and the cast kernels it launched."""
    base = make_layer(len(sp), k, n, dtype=torch.bfloat16)
    x = torch.randn(sum(sp), k).to(torch.bfloat16)
    dy = torch.randn(sum(sp), n).to(torch.bfloat16)
    with cpu_cast_backend("emulate"):
        with record_launches() as log:
            emu = run(copy.deepcopy(base), x, sp, recipe, False, dy)
    with cpu_cast_backend("reference"):
        ref = run(copy.deepcopy(base), x, sp, recipe, False, dy)
    assert_bits_equal(emu, ref)
    return emu, [r.kernel for r in log if "block_cast_transpose" in r.kernel]


def check_compiled_matches_eager(recipe, splits, k, n):
    """torch.compile(fullgraph=True) gives eager's bits over changing token counts."""
    torch._dynamo.reset()
    eager = make_layer(len(splits[0]), k, n)
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, fullgraph=True)
    for sp in splits:
        x = torch.randn(sum(sp), k)
        assert_bits_equal(run_compiled(compiled, compiled_layer, x, sp, recipe),
                          run(eager, x, sp, recipe, False))


def check_gpu_layer_matches_cpu(recipe, sp, k, n):
    """The same bfloat16 layer on CUDA against the CPU layer: the casts are bit-exact, so only
    the GEMMs' float32 accumulation order differs."""
    cpu = make_layer(len(sp), k, n, dtype=torch.bfloat16)
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(sum(sp), k).to(torch.bfloat16)
    dy = (torch.randn(sum(sp), n) * 1e-2).to(torch.bfloat16)
    want = run(cpu, x, sp, recipe, False, dy)
    got = run(gpu, x.cuda(), sp, recipe, False, dy.cuda())
    for name, g, w in zip(("y", "dx"), got[:2], want[:2]):
        g, w = g.float().cpu(), w.float()
        assert torch.allclose(g, w, rtol=2**-7, atol=2**-11 * w.abs().max().item()), name
    for i in range(len(sp)):
        g, w = got[2][i].float().cpu(), want[2][i].float()
        assert torch.allclose(g, w, rtol=2**-7, atol=2**-11 * max(w.abs().max().item(), 1e-30)), i


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID])
def test_layer_equals_the_reference_loop_bit_for_bit(split, fmt):
    check_layer_equals_the_reference_loop(Float8BlockScaling(fp8_format=fmt), SPLITS[split],
                                          len(split), K, N)


@pytest.mark.parametrize("split", SPLITS)
def test_list_and_tensor_inputs_identical(split):
    check_list_and_tensor_inputs_identical(RECIPE, SPLITS[split], K, N)


def test_bfloat16_layer_and_the_emulated_kernels():
    """bfloat16 activations and weights; the casts on the CUDA kernel's CPU emulator give the
    reference twin's bits (the layer's two CPU cast backends)."""
    emu, casts = check_emulated_casts_give_the_reference_bits(RECIPE, [24, 0, 40], K, N)
    assert len(casts) == 3                                  # x, w, dy: one launch each
    assert emu[0].dtype == torch.bfloat16 and emu[2][0].dtype == torch.bfloat16


# The two block recipes (MXFP8's features and token counts in multiples of 32).
BOTH = [(RECIPE, N, [16, 32]), (MXFP8BlockScaling(), 160, [32, 32])]
BOTH_IDS = ["block", "mxfp8"]


@pytest.mark.parametrize("recipe,n,sp", BOTH, ids=BOTH_IDS)
def test_is_first_microbatch_caches_the_block_scaled_weights(recipe, n, sp):
    layer = make_layer(2, K, n)
    x = torch.randn(sum(sp), K)
    casts = lambda log: sum(1 for r in log if "block_cast" in r.kernel)  # noqa: E731
    with fp8_autocast(fp8_recipe=recipe), torch.no_grad(), cpu_cast_backend("emulate"):
        with record_launches() as log1:
            y1 = layer(x, sp, is_first_microbatch=True)
        for w in layer.weights():
            w.mul_(2)
        with record_launches() as log2:
            y2 = layer(x, sp, is_first_microbatch=False)
        with record_launches() as log3:
            y3 = layer(x, sp, is_first_microbatch=None)
    assert casts(log1) == 2 and casts(log2) == 1 and casts(log3) == 2
    assert torch.equal(y1, y2) and not torch.equal(y1, y3)


@pytest.mark.parametrize("recipe,n,sp", BOTH, ids=BOTH_IDS)
def test_fused_wgrad_accumulates_into_main_grad(recipe, n, sp):
    sp = sp[:1] + [0] + sp[1:]
    plain = make_layer(3, K, n)
    fused = make_layer(3, K, n, fuse_wgrad_accumulation=True)
    fused.load_state_dict(plain.state_dict())
    for w in fused.weights():
        w.main_grad = torch.zeros_like(w)
    x, dy = torch.randn(sum(sp), K), torch.randn(sum(sp), n)
    grads = [run(plain, x, sp, recipe, False, dy)[2] for _ in range(2)]
    for _ in range(2):
        run(fused, x, sp, recipe, False, dy)
    for i, w in enumerate(fused.weights()):
        assert torch.equal(w.main_grad, grads[0][i] + grads[1][i]), i


def test_torch_compile_fullgraph_matches_eager():
    """Token counts that change every step (as a router's do): after the second set torch.compile
    makes them symbolic, which the custom ops' fake shapes must accept."""
    check_compiled_matches_eager(RECIPE, ([16, 0, 24], [32, 8, 16], [48, 16, 8], [8, 8, 8]), K, N)


@pytest.mark.parametrize("compiled", [False, True])
def test_row_index_is_gathered_by_the_block_cast(compiled):
    """The permute folded into the block cast (its GATHER kernel, on the emulator here): the
    output and every gradient equal the permuted input's, the tokens' gradient summed back."""
    torch._dynamo.reset()
    base = make_layer(2, K, N)
    tokens = torch.randn(30, K)
    idx = torch.tensor([3, 7, 7, 1] * 4 + [0, 29] * 8, dtype=torch.int64)
    dy = torch.randn(32, N)
    fused, plain = copy.deepcopy(base), copy.deepcopy(base)
    fn = torch.compile(fused, fullgraph=True) if compiled else fused
    t1 = tokens.clone().requires_grad_()
    with fp8_autocast(fp8_recipe=RECIPE), cpu_cast_backend("emulate"), record_launches() as log:
        a = fn(t1, [16, 16], row_index=idx)
    a.backward(dy)
    assert any(r.kernel.endswith("1, true>") for r in log)           # the gather variant ran
    t2 = tokens.clone().requires_grad_()
    with fp8_autocast(fp8_recipe=RECIPE), cpu_cast_backend("emulate"):
        b = plain(t2[idx], [16, 16])
    b.backward(dy)
    assert torch.equal(a, b)
    assert torch.allclose(t1.grad, t2.grad, rtol=1e-6, atol=1e-7)     # summation orders differ
    for wa, wb in zip(fused.weights(), plain.weights()):
        assert torch.equal(wa.grad, wb.grad)


def test_token_counts_and_options_are_checked_clearly():
    layer = make_layer(2, K, N)
    with fp8_autocast(fp8_recipe=RECIPE):
        with pytest.raises(ValueError, match="^m_splits: .*multiple of 8 .* expert 1 has 12"):
            layer(torch.randn(28, K), [16, 12])
    saver = make_layer(2, K, N, save_original_input=True)
    with fp8_autocast(fp8_recipe=RECIPE), pytest.raises(ValueError, match="save_original_input"):
        saver(torch.randn(32, K, requires_grad=True), [16, 16])
    with pytest.raises(ValueError, match="2-D by 2-D"):
        Float8BlockScaling(x_block_scaling_dim=2)
    with pytest.raises(ValueError, match="2-D by 2-D"):
        Float8BlockScaling(w_block_scaling_dim=1, grad_block_scaling_dim=2, x_block_scaling_dim=2)
    with pytest.raises(ValueError, match="use_split_accumulator=True"):
        Float8BlockScaling(fp8_gemm_fprop=MMParams(use_split_accumulator=False))
    with pytest.raises(ValueError, match="backward_override"):
        Float8BlockScaling(backward_override="high_precision")
    with pytest.raises(ValueError, match="x_block_scaling_dim"):
        Float8BlockScaling(x_block_scaling_dim=3)
    with pytest.raises(TypeError, match="fp8_quant_fwd_inp"):
        Float8BlockScaling(fp8_quant_fwd_inp=(0.0, True))


def test_recipe_defaults_are_transformer_engines(monkeypatch):
    r = Float8BlockScaling()
    assert r.fp8_format is Format.E4M3 and r.block_dims == (1, 2, 1)
    assert all(getattr(r, q) == QParams(power_2_scale=True) for q in
               ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"))
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    assert Float8BlockScaling().fp8_quant_fwd_inp == QParams(power_2_scale=False)


def test_float32_scales_reach_the_cast():
    """QParams(power_2_scale=False): the layer's input scales are fp8_max / amax, not powers of
    two (so the forward differs from the default recipe's)."""
    layer = make_layer(1, K, N, bias=False)
    x = torch.randn(16, K) * 3
    p2 = run(copy.deepcopy(layer), x, [16], RECIPE, False)[0]
    f32 = Float8BlockScaling(fp8_quant_fwd_inp=QParams(power_2_scale=False),
                             fp8_quant_fwd_weight=QParams(power_2_scale=False))
    got = run(copy.deepcopy(layer), x, [16], f32, False)[0]
    assert not torch.equal(got, p2)
    xq = reference.multi_block_cast_transpose(x.numpy(), [16], power_2_scale=False)
    wq = reference.multi_block_cast_transpose([layer.weight0.detach().numpy()], align=1,
                                              block_scaling_dim=2, power_2_scale=False)
    assert np.array_equal(got.detach().numpy(), reference.grouped_fprop(xq, wq, out_dtype="float32"))


# ------------------------------------------------------------------------------------------------
# MoEFeedForward pads each expert to 16 rows under Float8BlockScaling (router counts are arbitrary).

def _moe_run(block, x, recipe, fuse):
    m = copy.deepcopy(block)
    m.fuse_permute = fuse
    xi = x.clone().requires_grad_()
    with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        y = m(xi)
    y.square().sum().backward()
    return y.detach(), xi.grad, [w.grad for w in (*m.fc1.weights(), *m.fc2.weights())]


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_pads_experts_for_block_scaling(top_k):
    """Router counts that are not multiples of 8 run: the fused permute (pad rows gathered as
    index -1, zero rows) and the default block (zero-padded expert tensors) give the same bits,
    forward and backward, and the error against high precision is per-tensor FP8's."""
    from cugrouped.pytorch import Float8CurrentScaling, MoEFeedForward

    torch.manual_seed(top_k)
    block = MoEFeedForward(128, 128, 4, top_k=top_k, device="cpu", bias=True)
    x = torch.randn(37, 128)
    probs, ids = block.router(x)
    counts = torch.bincount(ids.reshape(-1), minlength=4).tolist()
    assert any(c % 8 for c in counts)                      # the padding is exercised
    fused, plain = _moe_run(block, x, RECIPE, True), _moe_run(block, x, RECIPE, False)
    assert_bits_equal(fused, plain)
    high = _moe_run(block, x, None, False)[0]
    tensor = _moe_run(block, x, Float8CurrentScaling(), False)[0]
    err = lambda y: ((y - high).norm() / high.norm()).item()  # noqa: E731
    assert err(fused[0]) <= 1.25 * err(tensor) + 1e-3


def test_moe_pads_only_under_block_scaling():
    from cugrouped.pytorch import moe

    with fp8_autocast(fp8_recipe=RECIPE):
        assert moe._token_align() == 16
    assert moe._token_align() == 1
    padded, dest = moe._padded_rows([5, 0, 16, 17], torch.tensor([5, 0, 16, 17]), 16)
    assert padded == [16, 0, 16, 32]
    assert dest.tolist() == [*range(5), *range(16, 32), *range(32, 49)]


@pytest.mark.gpu
def test_gpu_block_scaling_layer_matches_cpu():
    """The same layer on CUDA (cast kernels, cuBLASLt block-scaled GEMMs) against the CPU layer:
    the casts are bit-exact, so only the GEMMs' float32 accumulation order differs (bounded as in
    tests/test_grouped_gemm_block.py)."""
    skip_unless_block_gemms()
    check_gpu_layer_matches_cpu(RECIPE, [16, 0, 136], K, N)


@pytest.mark.gpu
def test_gpu_block_scaling_fused_permute_with_pad_rows_matches_cpu():
    """The permute gathered by the CUDA block cast, with -1 (zero) rows as MoEFeedForward's
    padding makes them, and the tokens' gradient summed back by the scatter_rows kernel: equal
    to the CPU layer within the GEMMs' accumulation bound."""
    skip_unless_block_gemms()
    cpu = make_layer(2, K, N, dtype=torch.bfloat16)
    gpu = copy.deepcopy(cpu).cuda()
    tokens = torch.randn(40, K).to(torch.bfloat16)
    idx = torch.tensor([3, 7, 7, 1, -1, -1, -1, -1] * 2 + [0, 39] * 8 + [-1] * 16, dtype=torch.int64)
    dy = (torch.randn(48, N) * 1e-2).to(torch.bfloat16)
    out = {}
    for name, layer, dev in (("cpu", cpu, "cpu"), ("gpu", gpu, "cuda")):
        t = tokens.to(dev, copy=True).requires_grad_()  # a leaf: tokens.to("cpu") is tokens
        with fp8_autocast(fp8_recipe=RECIPE):
            y = layer(t, [16, 32], row_index=idx.to(dev))
        y.backward(dy.to(dev))
        out[name] = (y.detach().float().cpu(), t.grad.float().cpu(),
                     [w.grad.float().cpu() for w in layer.weights()])
    (y0, g0, w0), (y1, g1, w1) = out["cpu"], out["gpu"]
    for a, b in ((y1, y0), *zip(w1, w0)):
        assert torch.allclose(a, b, rtol=2**-7, atol=2**-11 * max(b.abs().max().item(), 1e-30))
    # A token's gradient sums up to 8 rows of dx, each a bf16 GEMM output that may differ by an
    # ulp between cuBLAS and the CPU; the sum can cancel to near zero, so its bound scales with
    # the sum of the rows' magnitudes (the rows' gradients from the explicit permute on the CPU).
    valid = idx >= 0
    xp = torch.where(valid[:, None], tokens[idx.clamp(min=0)], 0).requires_grad_()
    with fp8_autocast(fp8_recipe=RECIPE):
        copy.deepcopy(cpu)(xp, [16, 32]).backward(dy)
    mag = torch.zeros(40, K).index_add_(0, idx[valid], xp.grad.float().abs()[valid])
    assert ((g1 - g0).abs() <= 2**-7 * mag + 2**-11 * g0.abs().max()).all()
