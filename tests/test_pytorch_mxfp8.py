"""GroupedLinear with MXFP8BlockScaling (TransformerEngine's MXFP8 recipe) on the CPU: the layer
equals a per-expert loop of the same quantize -> GEMM steps written with cugrouped.reference (bit
for bit, forward and every gradient), list and tensor inputs agree, the emulated cast kernels give
the reference's bits, torch.compile matches eager, the fused permute, checkpointing,
MoEFeedForward pads experts to 32, the recipe's rules, and the GPU twin (``gpu``, sm_100+). (The
weight cache and fused wgrad: tests/test_pytorch_block_scaling.py, over both block recipes.)"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from cugrouped.ops import record_launches
from cugrouped.pytorch import Format, MXFP8BlockScaling, cpu_cast_backend, fp8_autocast
from test_pytorch_block_scaling import _moe_run, block_varied, loop_reference
from test_pytorch_grouped_linear import assert_bits_equal, make_layer, run, run_compiled

K, N = 256, 160          # two 128-tiles of k; n = 160: a partial tile, 5 scale blocks
SPLITS = {"uneven": [32, 64, 160], "empty_first": [0, 96, 32], "empty_middle": [32, 0, 128],
          "single": [288]}
RECIPE = MXFP8BlockScaling()


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID])
def test_layer_equals_the_reference_loop_bit_for_bit(split, fmt):
    sp = SPLITS[split]
    E = len(sp)
    layer = block_varied(make_layer(E, K, N))
    recipe = MXFP8BlockScaling(fp8_format=fmt)
    g = torch.Generator().manual_seed(len(split))
    x = torch.randn(sum(sp), K, generator=g) * torch.exp2(torch.randint(-4, 4, (sum(sp), 1), generator=g))
    dy = torch.randn(sum(sp), N, generator=g) * 1e-2
    y, dx, dws, dbs = run(layer, x, sp, recipe, False, dy)
    ry, rdx, rdw, rdb = loop_reference(layer, x, dy, sp, recipe)   # (the block test's loop: MXFP8
                                                                   # casts for this recipe)
    assert np.array_equal(y.detach().numpy(), ry.astype(np.float32))
    assert np.array_equal(dx.numpy(), rdx)
    for i in range(E):
        assert np.array_equal(dws[i].numpy(), rdw[i]), i
        assert np.array_equal(dbs[i].numpy(), rdb[i]), i


def test_list_and_tensor_inputs_identical():
    sp = SPLITS["empty_middle"]
    base = make_layer(len(sp), K, N)
    x, dy = torch.randn(sum(sp), K), torch.randn(sum(sp), N)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    assert_bits_equal(run(a, x, sp, RECIPE, True, dy, steps=2), run(b, x, sp, RECIPE, False, dy, steps=2))


def test_bfloat16_layer_and_the_emulated_kernels():
    sp = [32, 0, 64]
    base = make_layer(3, K, N, dtype=torch.bfloat16)
    x = torch.randn(96, K).to(torch.bfloat16)
    dy = torch.randn(96, N).to(torch.bfloat16)
    with cpu_cast_backend("emulate"):
        with record_launches() as log:
            emu = run(copy.deepcopy(base), x, sp, RECIPE, False, dy)
    mx = [r.kernel for r in log if "block_cast_transpose" in r.kernel]
    assert len(mx) == 3 and all(", 3" in k for k in mx)      # x, w, dy: one MXFP8 launch each
    with cpu_cast_backend("reference"):
        ref = run(copy.deepcopy(base), x, sp, RECIPE, False, dy)
    assert_bits_equal(emu, ref)


def test_checkpoint_recomputes_the_same_bits():
    from cugrouped.pytorch import checkpoint

    sp = [32, 64]
    layer = make_layer(2, K, N)
    x = torch.randn(96, K)
    outs = []
    for ckpt in (False, True):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with fp8_autocast(fp8_recipe=RECIPE):
            y = checkpoint(layer, xi, sp) if ckpt else layer(xi, sp)
        y.square().sum().backward()
        outs.append((y.detach(), xi.grad, [w.grad for w in layer.weights()]))
    assert_bits_equal(outs[0], outs[1])


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    eager = make_layer(3, K, N)
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, fullgraph=True)
    for sp in ([32, 0, 64], [64, 32, 32], [96, 32, 0]):
        x = torch.randn(sum(sp), K)
        assert_bits_equal(run_compiled(compiled, compiled_layer, x, sp, RECIPE),
                          run(eager, x, sp, RECIPE, False))


def test_row_index_is_gathered_by_the_mx_cast():
    """``row_index`` (the fused permute): the MXFP8 gather instantiation reads the tokens, and the
    output equals the layer on the permuted copy."""
    layer = make_layer(2, K, N)
    tokens = torch.randn(40, K)
    idx = torch.randint(-1, 40, (96,))
    sp = [64, 32]
    x = torch.cat([tokens, torch.zeros(1, K)])[torch.where(idx >= 0, idx, 40)]
    with fp8_autocast(fp8_recipe=RECIPE), cpu_cast_backend("emulate"):
        with record_launches() as log:
            got = layer(tokens, sp, row_index=idx)
        want = layer(x, sp)
    assert any(r.kernel.endswith(", 3, true>") for r in log)
    assert torch.equal(got, want)


def test_token_counts_and_options_are_checked_clearly():
    layer = make_layer(2, K, N)
    with fp8_autocast(fp8_recipe=RECIPE):
        with pytest.raises(ValueError, match="^m_splits: MXFP8BlockScaling's .* multiple of 32 .* "
                                             "pads to 32 .* expert 1 has 16"):
            layer(torch.randn(48, K), [32, 16])
    odd = make_layer(1, K, 48)                       # 48 output features: not whole blocks
    with fp8_autocast(fp8_recipe=RECIPE), pytest.raises(
            ValueError, match="^out_features: MXFP8BlockScaling's FP8 GEMMs need a multiple of 32, got 48"):
        odd(torch.randn(32, K), [32])
    with pytest.raises(ValueError, match="margin"):
        MXFP8BlockScaling(margin=1)
    with pytest.raises(ValueError, match="fp8_mha"):
        MXFP8BlockScaling(fp8_mha=True)
    with pytest.raises(TypeError, match="fp8_format"):
        MXFP8BlockScaling(fp8_format="e4m3")
    r = MXFP8BlockScaling()
    assert r.fp8_format is Format.E4M3 and r.margin == 0 and not r.delayed()


def test_moe_pads_experts_to_32():
    from cugrouped.pytorch import MoEFeedForward, moe

    with fp8_autocast(fp8_recipe=RECIPE):
        assert moe._token_align() == 32
    torch.manual_seed(3)
    block = MoEFeedForward(128, 128, 4, top_k=2, device="cpu", bias=True)
    x = torch.randn(37, 128)
    _, ids = block.router(x)
    assert any(c % 32 for c in torch.bincount(ids.reshape(-1), minlength=4).tolist())
    assert_bits_equal(_moe_run(block, x, RECIPE, True), _moe_run(block, x, RECIPE, False))


@pytest.mark.gpu
def test_gpu_mx_layer_matches_cpu():
    """The same layer on CUDA (cast kernels, cuBLASLt VEC32_UE8M0 GEMMs) against the CPU layer;
    sm_100+ with cuBLAS 12.8+ only (the GEMMs), else it skips with the library's reason."""
    import cupy

    from cugrouped.cublaslt import version
    from cugrouped.ops import grouped_gemm as gg

    reason = gg.block_scaling_unsupported(version(), int(cupy.cuda.Device().compute_capability),
                                          mx=True)
    if reason:
        pytest.skip(reason)
    sp = [32, 0, 160]
    cpu = make_layer(3, K, N, dtype=torch.bfloat16)
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(192, K).to(torch.bfloat16)
    dy = (torch.randn(192, N) * 1e-2).to(torch.bfloat16)
    want = run(cpu, x, sp, RECIPE, False, dy)
    got = run(gpu, x.cuda(), sp, RECIPE, False, dy.cuda())
    for name, g, w in zip(("y", "dx"), got[:2], want[:2]):
        g, w = g.float().cpu(), w.float()
        assert torch.allclose(g, w, rtol=2**-7, atol=2**-11 * w.abs().max().item()), name
    for i in range(3):
        g, w = got[2][i].float().cpu(), want[2][i].float()
        assert torch.allclose(g, w, rtol=2**-7, atol=2**-11 * max(w.abs().max().item(), 1e-30)), i
