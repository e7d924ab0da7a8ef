"""GroupedLinear with MXFP8BlockScaling (TransformerEngine's MXFP8 recipe) on the CPU: the layer
equals a per-expert loop of the same quantize -> GEMM steps written with cugrouped.reference (bit
for bit, forward and every gradient), list and tensor inputs agree, the emulated cast kernels give
the reference's bits, torch.compile matches eager, the fused permute, checkpointing,
MoEFeedForward pads experts to 32, the recipe's rules, and the GPU twin (``gpu``, sm_100+). (The
weight cache and fused wgrad: tests/test_pytorch_block_scaling.py, over both block recipes.)"""

from __future__ import annotations

import pytest
import torch

from cugrouped.ops import record_launches
from cugrouped.pytorch import Format, MXFP8BlockScaling, cpu_cast_backend, fp8_autocast
from test_pytorch_block_scaling import (_moe_run, check_compiled_matches_eager,
                                        check_emulated_casts_give_the_reference_bits,
                                        check_gpu_layer_matches_cpu,
                                        check_layer_equals_the_reference_loop,
                                        check_list_and_tensor_inputs_identical)
from test_pytorch_grouped_linear import assert_bits_equal, make_layer

pytest.register_assert_rewrite("_block_common")
from _block_common import skip_unless_block_gemms  # noqa: E402

K, N = 256, 160          # two 128-tiles of k; n = 160: a partial tile, 5 scale blocks
SPLITS = {"uneven": [32, 64, 160], "empty_first": [0, 96, 32], "empty_middle": [32, 0, 128],
          "single": [288]}
RECIPE = MXFP8BlockScaling()


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID])
def test_layer_equals_the_reference_loop_bit_for_bit(split, fmt):
    # (the block test's loop_reference: MXFP8 casts for this recipe)
    check_layer_equals_the_reference_loop(MXFP8BlockScaling(fp8_format=fmt), SPLITS[split],
                                          len(split), K, N)


def test_list_and_tensor_inputs_identical():
    check_list_and_tensor_inputs_identical(RECIPE, SPLITS["empty_middle"], K, N)


def test_bfloat16_layer_and_the_emulated_kernels():
    _, mx = check_emulated_casts_give_the_reference_bits(RECIPE, [32, 0, 64], K, N)
    assert len(mx) == 3 and all(", 3" in k for k in mx)      # x, w, dy: one MXFP8 launch each


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
    check_compiled_matches_eager(RECIPE, ([32, 0, 64], [64, 32, 32], [96, 32, 0]), K, N)


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
    skip_unless_block_gemms(mx=True)
    check_gpu_layer_matches_cpu(RECIPE, [32, 0, 160], K, N)
