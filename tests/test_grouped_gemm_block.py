"""Grouped GEMMs on block-scaled FP8 operands (GroupedBlockFP8, TransformerEngine's
Float8BlockScaling): the reference against an independent float64 dequantization, the checks that
cuBLASLt's block-scaled GEMMs need, the descriptors (scale modes VEC128_32F / BLK128x128_32F)
accepted by the real libcublasLt, the launch loop's per-expert scale pointers with only the
device calls faked, and (marked ``gpu``) the cuBLASLt path against the reference."""

from __future__ import annotations

import numpy as np
import pytest

import cugrouped
from cugrouped.cublaslt import _enums as E
from cugrouped.ops import grouped_gemm as gg
from cugrouped.ops.grouped_gemm import grouped_fprop, grouped_wgrad
from test_grouped_gemm import OUT_DTYPES, _abs_sum, _assert_close

pytest.register_assert_rewrite("_block_common")
from _block_common import (BLOCK_ACC_EPS, FP8,  # noqa: E402
                           check_copies_differ_and_wgrad_reads_the_transposed,
                           check_descriptors_accept, check_gpu_passes_vs_reference,
                           check_host_loop_sets_every_experts_scales, check_memo_keys_by_buffers,
                           check_reference_bias_and_accumulate, check_reference_passes,
                           host_operand, random_gemm_inputs, skip_unless_block_gemms)

VEC, BLK = E.CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, E.CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
# name -> (m_splits, k, n): token counts multiples of 8 (or 0), blocks of 128 whole and partial
SPLITS = {
    "uniform": ([128, 128, 128], 256, 128),
    "jagged": ([8, 0, 136, 264], 272, 144),
    "empty_first": ([0, 40, 16], 128, 48),
    "empty_last": ([24, 256, 0], 160, 32),
    "single": ([200], 384, 16),
}


def make_block(m_splits, k, n, seed, xp=np, x_dims=1, w_dims=2, g_fmt="e4m3"):
    """x (m_i, k), w (n, k), dy (m_i, n), block-scaled as TransformerEngine's recipe does."""
    xs, ws, dys = random_gemm_inputs(m_splits, k, n, seed, xp)
    X = cugrouped.multi_block_cast_transpose(xs, block_scaling_dim=x_dims)
    W = cugrouped.multi_block_cast_transpose(ws, block_scaling_dim=w_dims, align=1)
    DY = cugrouped.multi_block_cast_transpose(dys, block_scaling_dim=1, fp8_format=g_fmt)
    return X, W, DY


def independent(op, copy):
    """float64 per-expert (m_i, k) matrices: ml_dtypes' FP8 decode times each element's block
    scale, the block found from the layout (rows / columns of 128 counted here, not by cugrouped)."""
    dt = FP8[op.fp8_format][0]
    out = []
    for i, m in enumerate(op.m_splits):
        if copy == "rowwise":
            q, s = np.asarray(op.rowwise(i)).view(np.uint8), np.asarray(op.rowwise_scale_inv(i))
        else:
            q, s = np.asarray(op.columnwise(i))[:, :m], np.asarray(op.columnwise_scale_inv(i))
        rows, cols = q.shape
        vals = q.view(dt).astype(np.float64)
        for r in range(rows):
            for c0 in range(0, cols, 128):
                sc = s[c0 // 128, r] if op.block_scaling_dim == 1 else s[r // 128, c0 // 128]
                vals[r, c0:c0 + 128] *= float(sc)
        out.append(vals if copy == "rowwise" else vals.T)
    return out


# ---------------------------------------------------------------------------------------------
# The reference, on the CPU.

@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("dims", [(1, 2), (2, 1), (1, 1)], ids=lambda d: f"x{d[0]}w{d[1]}")
def test_reference_passes_against_independent_dequantization(split, dims):
    m_splits, k, n = SPLITS[split]
    X, W, DY = make_block(m_splits, k, n, seed=len(split), x_dims=dims[0], w_dims=dims[1])
    # dgrad: dy (1-D) with w's transposed copy; wgrad: x (1-D or 2-D) with dy (1-D)
    check_reference_passes(X, W, DY, independent)


def test_the_copies_differ_and_each_pass_reads_its_own():
    """1-D blocks: the transposed copies are quantized along the tokens, so they differ from the
    row-wise ones; wgrad must read them (its result equals the transposed copies' product, not
    the row-wise ones')."""
    X, W, DY = make_block([136, 40], 256, 64, seed=3)
    check_copies_differ_and_wgrad_reads_the_transposed(X, DY, independent)


def test_reference_bias_and_accumulate():
    X, W, DY = make_block([16, 0, 48], 128, 32, seed=4)
    check_reference_bias_and_accumulate(X, W, DY, independent)


# ---------------------------------------------------------------------------------------------
# Checks and planning.

def test_problem_carries_the_scale_modes_and_no_fast_accumulation():
    X, W, DY = make_block([16, 32], 128, 48, seed=5)
    p = gg.check_fprop(X, W, fast_accum=True)
    assert (p.left_scale_mode, p.right_scale_mode, p.fast_accum, p.block_scaled) == (VEC, BLK, False, True)
    p = gg.check_dgrad(DY, W)
    assert (p.left_scale_mode, p.right_scale_mode) == (VEC, BLK)
    p = gg.check_wgrad(X, DY)
    assert (p.left_scale_mode, p.right_scale_mode) == (VEC, VEC)
    _, blocks = gg.outputs(p, None, np)
    cfg = gg.plan_arrays(p, blocks).config
    assert cfg.attributes()["A_SCALE_MODE"] == VEC and cfg.attributes()["FAST_ACCUM"] == 0
    # the per-tensor path sets no scale mode at all
    Xt = cugrouped.multi_pad_cast_transpose([np.ones((16, 128), np.float32)])
    Wt = cugrouped.multi_pad_cast_transpose([np.ones((48, 128), np.float32)], align=1)
    pt = gg.check_fprop(Xt, Wt)
    _, bt = gg.outputs(pt, None, np)
    assert "A_SCALE_MODE" not in gg.plan_arrays(pt, bt).config.attributes()


def test_scale_pointers_are_each_experts_first_block_scale():
    X, W, _ = make_block([16, 0, 136], 256, 32, seed=6)
    p = gg.check_fprop(X, W)
    base = np.asarray(X.scale_inv).ctypes.data
    sizes = [X.rowwise_scale_inv(i).size for i in range(3)]
    assert list(p.left_scale) == [base, base + 4 * sizes[0], base + 4 * (sizes[0] + sizes[1])]
    assert all(int(v) % 16 == 0 for v in np.asarray(p.left_scale) - base)   # 16-byte aligned
    wbase = np.asarray(W.scale_inv).ctypes.data
    assert list(p.right_scale) == [wbase + 4 * W.rowwise_scale_inv(0).size * i for i in range(3)]


def test_bad_block_operands_are_refused_clearly():
    w2 = cugrouped.multi_block_cast_transpose([np.ones((32, 128), np.float32)], block_scaling_dim=2,
                                              align=1)
    x12 = cugrouped.multi_block_cast_transpose([np.ones((12, 128), np.float32)])
    with pytest.raises(ValueError, match="multiple of 8 .* expert 0 has 12"):
        gg.check_fprop(x12, w2)
    xt = cugrouped.multi_pad_cast_transpose([np.ones((16, 128), np.float32)])
    with pytest.raises(TypeError, match="w is block-scaled .* same kind of scaling"):
        gg.check_fprop(xt, w2)
    x2 = cugrouped.multi_block_cast_transpose([np.ones((16, 128), np.float32)], block_scaling_dim=2)
    with pytest.raises(ValueError, match="128x128-by-128x128"):
        gg.check_fprop(x2, w2)
    with pytest.raises(ValueError, match="needs the columnwise FP8 copy; cast with "
                                         "multi_block_cast_transpose"):
        gg.check_wgrad(cugrouped.multi_block_cast_transpose([np.ones((16, 128), np.float32)],
                                                            columnwise=False),
                       cugrouped.multi_block_cast_transpose([np.ones((16, 32), np.float32)]))


def test_short_scale_buffer_is_refused():
    import dataclasses

    X, W, _ = make_block([16, 8], 128, 32, seed=8)
    short = dataclasses.replace(X, scale_inv=np.asarray(X.scale_inv)[:-1])
    with pytest.raises(ValueError, match=r"x\.scale_inv: expected a contiguous float32 vector"):
        gg.check_fprop(short, W)


def test_capability_rules_and_path():
    assert gg.block_scaling_unsupported(130000, 90) is None
    assert gg.block_scaling_unsupported(120900, 90) is None
    assert "Hopper (sm_90) only" in gg.block_scaling_unsupported(130000, 100)
    assert "Hopper (sm_90) only" in gg.block_scaling_unsupported(130000, 120)
    assert "9.0" in gg.block_scaling_unsupported(130000, 89)
    assert "12.9" in gg.block_scaling_unsupported(120800, 90)
    X, W, _ = make_block([16, 32, 8], 128, 32, seed=9)
    p = gg.check_fprop(X, W)
    _, blocks = gg.outputs(p, None, np)
    vp = gg.plan_arrays(p, blocks)
    # the grouped GEMM takes block scales from cuBLAS 13.6 (test_grouped_gemm_block_model.py)
    path, why = gg.choose_path(p, vp, version=130500, compute_capability=90, has_symbol=True,
                               discrete_out=False)
    assert path == "loop" and "block-scaled" in why and "13.6" in why
    with pytest.raises(RuntimeError, match="13.6"):
        gg.choose_path(p, vp, version=130500, compute_capability=90, has_symbol=True,
                       discrete_out=False, requested="grouped")


@pytest.mark.parametrize("pass_name", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_descriptors_accept_the_block_scale_modes(pass_name, out_dtype):
    """Every attribute the op sets for a block-scaled pass, scale modes included, is accepted by
    the real libcublasLt with its size and value (descriptors need no GPU)."""
    X, W, DY = make_block([16, 0, 136], 256, 48, seed=10)
    modes = {"fprop": (BLK, VEC), "dgrad": (BLK, VEC), "wgrad": (VEC, VEC)}[pass_name]
    check_descriptors_accept(X, W, DY, pass_name, out_dtype, 90, modes, FAST_ACCUM=0)


def test_host_loop_sets_every_experts_block_scales():
    """The launch loop with only the device calls faked: each expert's descriptor carries its own
    block-scale pointers, and a state without cuBLAS 12.9 refuses before calling anything."""
    X, W, _ = make_block([16, 0, 136, 8], 128, 32, seed=11)
    check_host_loop_sets_every_experts_scales(X, W, 90, calls=3, refuse={"cublas_version": 120800},
                                              match="12.9")


def test_memo_keys_block_operands_by_their_buffers():
    X, W, _ = make_block([16, 8], 128, 32, seed=12)
    first, other = check_memo_keys_by_buffers(X, W, X)
    assert not np.array_equal(other.problem.left_scale, first.problem.left_scale)


# ---------------------------------------------------------------------------------------------
# On a GPU (skipped here; run by scripts/gpu_check.sh). Tolerance: the reference is exact up to
# its one output rounding; cuBLASLt accumulates in float32 with the block scales applied per
# 128-element step (split accumulation), an error below 2^-11 of sum |a b| for these K
# (K * 2^-24 <= 2^-12.5 at K = 384), plus at most two output roundings.

@pytest.mark.gpu
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("g_fmt", ["e4m3", "e5m2"])
def test_gpu_block_passes_vs_reference(split, g_fmt):
    import cupy

    skip_unless_block_gemms()
    m_splits, k, n = SPLITS[split]
    X, W, DY = make_block(m_splits, k, n, seed=len(split), xp=cupy, g_fmt=g_fmt)
    check_gpu_passes_vs_reference(X, W, DY, independent)


@pytest.mark.gpu
def test_gpu_block_bias_and_accumulate_into_main_grad():
    import cupy

    skip_unless_block_gemms()
    X, W, DY = make_block([16, 0, 136], 256, 48, seed=13, xp=cupy)
    hX, hW, hDY = host_operand(X), host_operand(W), host_operand(DY)
    bias = cupy.asarray(np.random.default_rng(1).standard_normal((3, 48)).astype(np.float16))
    xs, ws = independent(hX, "rowwise"), independent(hW, "rowwise")
    y = grouped_fprop(X, W, bias, out_dtype="float16")
    want = grouped_fprop(hX, hW, cupy.asnumpy(bias), out_dtype="float16")
    _assert_close(cupy.asnumpy(y), want, _abs_sum(xs, ws, "fprop"), "float16", BLOCK_ACC_EPS)
    main = [cupy.full((48, 256), 0.25, cupy.float32) for _ in range(3)]
    grouped_wgrad(X, DY, out=main, accumulate=True)
    hmain = [np.full((48, 256), 0.25, np.float32) for _ in range(3)]
    grouped_wgrad(hX, hDY, out=hmain, accumulate=True)
    xts, dyts = independent(hX, "columnwise"), independent(hDY, "columnwise")
    sums = _abs_sum(dyts, xts, "wgrad")
    for i in range(3):
        _assert_close(cupy.asnumpy(main[i]), hmain[i], sums[i], "float32", BLOCK_ACC_EPS)


@pytest.mark.parametrize("kind", ["block", "mxfp8"])
def test_torch_cpu_operands_through_the_public_gemms(kind):
    """Block-scaled and MXFP8 casts of torch CPU tensors go to grouped_fprop / dgrad / wgrad as
    NumPy ones do (they recursed without end: the torch front's host views knew GroupedFP8
    only): torch results, the NumPy run's values bit for bit."""
    torch = pytest.importorskip("torch")
    m, k, n = [32, 0, 64], 256, 128
    rng = np.random.default_rng(5)
    x, dy = rng.standard_normal((96, k)), rng.standard_normal((96, n))
    ws = [rng.standard_normal((n, k)) * 0.05 for _ in m]
    if kind == "block":
        cast = lambda a, s=None, **kw: cugrouped.multi_block_cast_transpose(a, s, **kw)  # noqa
        wkw = dict(align=1, block_scaling_dim=2)
    else:
        cast = lambda a, s=None, **kw: cugrouped.multi_mxfp8_cast_transpose(a, s, **kw)  # noqa
        wkw = dict(align=1)
    for lib in ("numpy", "torch"):
        conv = (lambda a: a.astype(np.float32)) if lib == "numpy" else \
            (lambda a: torch.from_numpy(a.astype(np.float32)))
        X, DY = cast(conv(x), m), cast(conv(dy), m)
        W = cast([conv(w) for w in ws], **wkw)
        got = (grouped_fprop(X, W), cugrouped.grouped_dgrad(DY, W), grouped_wgrad(X, DY))
        if lib == "numpy":
            want = got
        else:
            for a, b in zip(got, want):
                assert isinstance(a, torch.Tensor)
                assert np.array_equal(a.float().numpy(), b.astype(np.float32))
