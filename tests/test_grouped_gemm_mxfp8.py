"""Grouped GEMMs on MXFP8 operands (GroupedMXFP8, TransformerEngine's MXFP8BlockScaling): the
reference against an independent float64 dequantization that reads the scales straight from
cuBLAS's tiled layout, the checks MXFP8 GEMMs need, the descriptors (scale mode VEC32_UE8M0)
accepted by the real libcublasLt, the launch loop's per-expert scale pointers with only the device
calls faked, and (marked ``gpu``; sm_100+ only) the cuBLASLt path against the reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cugrouped
from cugrouped.cublaslt import _enums as E
from cugrouped.ops import grouped_gemm as gg
from test_grouped_gemm import OUT_DTYPES
from test_mxfp8_cast_transpose import te_scale_index

pytest.register_assert_rewrite("_block_common")
from _block_common import (FP8, check_copies_differ_and_wgrad_reads_the_transposed,  # noqa: E402
                           check_descriptors_accept, check_gpu_passes_vs_reference,
                           check_host_loop_sets_every_experts_scales, check_memo_keys_by_buffers,
                           check_reference_bias_and_accumulate, check_reference_passes,
                           random_gemm_inputs, skip_unless_block_gemms)

MX = E.CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0
# name -> (m_splits, k, n): token counts multiples of 32 (or 0), tiles of 128 whole and partial
SPLITS = {
    "uniform": ([128, 128, 128], 256, 128),
    "jagged": ([32, 0, 160, 288], 288, 160),
    "empty_first": ([0, 64, 32], 128, 64),
    "empty_last": ([96, 256, 0], 160, 32),
    "single": ([224], 384, 96),
}


def make_mx(m_splits, k, n, seed, xp=np, g_fmt="e4m3"):
    """x (m_i, k), w (n, k), dy (m_i, n), cast to MXFP8 as TransformerEngine's recipe does
    (E4M3 forward; the gradient E4M3 or E5M2)."""
    xs, ws, dys = random_gemm_inputs(m_splits, k, n, seed, xp)
    X = cugrouped.multi_mxfp8_cast_transpose(xs)
    W = cugrouped.multi_mxfp8_cast_transpose(ws, align=1)
    DY = cugrouped.multi_mxfp8_cast_transpose(dys, fp8_format=g_fmt)
    return X, W, DY


def independent(op, copy):
    """float64 per-expert (m_i, k) matrices: ml_dtypes' FP8 decode times 2^(e - 127), e read
    from the expert's flat swizzled bytes at cuBLAS's index (te_scale_index), not through
    cugrouped's unswizzle."""
    dt = FP8[op.fp8_format][0]
    buf = np.asarray(op.scale_inv if copy == "rowwise" else op.scale_inv_t)
    out, off = [], 0
    for i, m in enumerate(op.m_splits):
        if copy == "rowwise":
            q = np.asarray(op.rowwise(i)).view(np.uint8)
        else:
            q = np.asarray(op.columnwise(i))
        rows, cols = q.shape
        cols_padded = -(-cols // 128) * 4
        vals = q.view(dt).astype(np.float64)
        for r in range(rows):
            for b in range(-(-cols // 32)):
                vals[r, 32 * b: 32 * b + 32] *= 2.0 ** (int(buf[off + te_scale_index(r, b, cols_padded)]) - 127)
        off += -(-rows // 128) * cols_padded * 128
        out.append(vals if copy == "rowwise" else vals[:, :m].T)
    return out


# ---------------------------------------------------------------------------------------------
# The reference, on the CPU.

@pytest.mark.parametrize("split", SPLITS)
def test_reference_passes_against_independent_dequantization(split):
    m_splits, k, n = SPLITS[split]
    X, W, DY = make_mx(m_splits, k, n, seed=len(split))
    check_reference_passes(X, W, DY, independent)


def test_the_copies_differ_and_wgrad_reads_the_transposed_ones():
    X, W, DY = make_mx([160, 64], 256, 64, seed=3)
    check_copies_differ_and_wgrad_reads_the_transposed(X, DY, independent)


def test_reference_bias_and_accumulate():
    X, W, DY = make_mx([32, 0, 64], 128, 32, seed=4)
    check_reference_bias_and_accumulate(X, W, DY, independent)


# ---------------------------------------------------------------------------------------------
# Checks and planning.

def test_problem_carries_the_scale_modes_and_byte_scale_pointers():
    X, W, DY = make_mx([32, 0, 160], 256, 64, seed=5)
    for p in (gg.check_fprop(X, W, fast_accum=True), gg.check_dgrad(DY, W), gg.check_wgrad(X, DY)):
        assert (p.left_scale_mode, p.right_scale_mode, p.fast_accum) == (MX, MX, False)
    p = gg.check_fprop(X, W)
    base = np.asarray(X.scale_inv).ctypes.data
    assert list(p.left_scale) == [base, base + 2 * 512, base + 2 * 512]   # 2 tiles, 0, 4 tiles
    wbase = np.asarray(W.scale_inv).ctypes.data
    assert list(p.right_scale) == [wbase + 2 * 512 * i for i in range(3)]
    _, blocks = gg.outputs(p, None, np)
    attrs = gg.plan_arrays(p, blocks).config.attributes()
    assert (attrs["A_SCALE_MODE"], attrs["B_SCALE_MODE"], attrs["FAST_ACCUM"]) == (MX, MX, 0)


def test_bad_mx_operands_are_refused_clearly():
    ones = lambda m, k: [np.ones((m, k), np.float32)]  # noqa: E731
    W = cugrouped.multi_mxfp8_cast_transpose(ones(64, 128), align=1)
    with pytest.raises(ValueError, match=r"multiples of 32 .* expert 0 is \(16, 128\)\. Pad each "
                       r"expert's tokens to a multiple of 32 before the cast .*align pads only "
                       r"the transposed copy"):
        gg.check_fprop(cugrouped.multi_mxfp8_cast_transpose(ones(16, 128), align=16), W)
    with pytest.raises(ValueError, match=r"w: MXFP8 GEMMs need .* \(48, 128\)"):
        gg.check_fprop(cugrouped.multi_mxfp8_cast_transpose(ones(32, 128)),
                       cugrouped.multi_mxfp8_cast_transpose(ones(48, 128), align=1))
    with pytest.raises(TypeError, match="w is MXFP8 .* but x is not"):
        gg.check_fprop(cugrouped.multi_block_cast_transpose(ones(32, 128)), W)
    with pytest.raises(TypeError, match="w is block-scaled"):
        gg.check_fprop(cugrouped.multi_pad_cast_transpose(ones(32, 128)), W)
    X = cugrouped.multi_mxfp8_cast_transpose(ones(32, 128))
    with pytest.raises(ValueError, match=r"x\.scale_inv: expected a contiguous uint8 vector"):
        gg.check_fprop(dataclasses.replace(X, scale_inv=np.zeros(512, np.float32)), W)
    with pytest.raises(ValueError, match="cast with multi_mxfp8_cast_transpose"):
        gg.check_wgrad(cugrouped.multi_mxfp8_cast_transpose(ones(32, 128), columnwise=False), X)


def test_misaligned_scale_buffers_are_refused():
    """Each expert's scale pointer must be 16-byte aligned (experts start at multiples of 512
    bytes, so the buffer's own address decides): an offset view is refused naming the operand."""
    X, W, _ = make_mx([32, 64], 128, 32, seed=14)
    raw = np.zeros(X.scale_inv.size + 16, np.uint8)
    shifted = raw[1:1 + X.scale_inv.size]
    shifted[:] = X.scale_inv
    p = gg.check_fprop(dataclasses.replace(X, scale_inv=shifted), W)   # (the checks the CUDA
    _, blocks = gg.outputs(p, None, np)                                # path runs before a call)
    with pytest.raises(ValueError, match="left operand's block scales of expert 0: .* not "
                                         "16-byte aligned"):
        gg.check_alignment(p, blocks)
    aligned = raw[16:16 + X.scale_inv.size]
    aligned[:] = X.scale_inv
    p = gg.check_fprop(dataclasses.replace(X, scale_inv=aligned), W)
    gg.check_alignment(p, gg.outputs(p, None, np)[1])


def test_capability_rules():
    assert gg.block_scaling_unsupported(120800, 100, mx=True) is None
    assert gg.block_scaling_unsupported(130000, 120, mx=True) is None
    assert "10.0" in gg.block_scaling_unsupported(130000, 90, mx=True)
    assert "12.8" in gg.block_scaling_unsupported(120700, 100, mx=True)
    assert "multi_mxfp8_cast_transpose" in gg.block_scaling_unsupported(130000, 100)


@pytest.mark.parametrize("pass_name", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_descriptors_accept_the_mx_scale_mode(pass_name, out_dtype):
    """Every attribute the op sets for an MXFP8 pass, the VEC32_UE8M0 scale modes included, is
    accepted by the real libcublasLt with its size and value (descriptors need no GPU)."""
    X, W, DY = make_mx([32, 0, 160], 256, 64, seed=10)
    check_descriptors_accept(X, W, DY, pass_name, out_dtype, 100, (MX, MX))


def test_host_loop_sets_every_experts_scales_and_refuses_hopper():
    X, W, _ = make_mx([32, 0, 160, 64], 128, 32, seed=11)
    check_host_loop_sets_every_experts_scales(X, W, 100, calls=3, refuse={"compute_capability": 90},
                                              match="MXFP8 GEMMs need compute capability 10.0")


def test_memo_keys_mx_operands_by_their_buffers():
    """The per-call memo serves MXFP8 operands (the layer builds new GroupedMXFP8 views every
    call): a repeat is a hit, other scale buffers a miss, and never a block-scaled operand's key."""
    X, W, _ = make_mx([32, 64], 128, 32, seed=12)
    check_memo_keys_by_buffers(X, W, dataclasses.replace(X))
    from cugrouped.ops import _gemm_memo

    assert _gemm_memo._operand_key(X, "rowwise")[0] is cugrouped.GroupedMXFP8


def test_block_results_and_mx_results_keep_their_kinds():
    """A GroupedBlockFP8 cannot claim MXFP8's block kind (its views would read swizzled bytes as
    a compact layout), nor a GroupedMXFP8 another."""
    X, _, _ = make_mx([32], 128, 32, seed=13)
    fields = {f.name: getattr(X, f.name) for f in dataclasses.fields(X)}
    with pytest.raises(ValueError, match="GroupedMXFP8"):
        cugrouped.GroupedBlockFP8(**fields)
    with pytest.raises(ValueError, match="block_scaling_dim"):
        dataclasses.replace(X, block_scaling_dim=1)


# ---------------------------------------------------------------------------------------------
# On a GPU (skipped here and on Hopper; run by scripts/gpu_check.sh on sm_100+). Tolerance as for
# the 128-blocks: the reference is exact up to its output rounding; cuBLASLt accumulates in
# float32 with the block scales applied per 32-element step, an error below 2^-11 of sum |a b|.

@pytest.mark.gpu
@pytest.mark.parametrize("split", SPLITS)
def test_gpu_mx_passes_vs_reference(split):
    import cupy

    skip_unless_block_gemms(mx=True)
    m_splits, k, n = SPLITS[split]
    X, W, DY = make_mx(m_splits, k, n, seed=len(split), xp=cupy, g_fmt="e5m2")
    check_gpu_passes_vs_reference(X, W, DY, independent)
