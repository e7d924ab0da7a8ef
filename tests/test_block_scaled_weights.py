"""``block_scaled_weights``: expert weights quantized in 128 x 128 blocks elsewhere (DeepSeek-V3's
checkpoints: ``weight`` E4M3 + ``weight_scale_inv``) as a GroupedBlockFP8. Against the block cast
(weights it quantized, handed back in a checkpoint's form, come back bit for bit), against
DeepSeek-V3's dequantization written out here (``W[r, c] = q[r, c] * s[r // 128, c // 128]``),
through the block-scaled GEMMs (reference on the CPU; cuBLASLt in the GPU check), and its errors."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cugrouped
from test_grouped_gemm_block import independent, make_block

pytest.register_assert_rewrite("_block_common")
from _block_common import (check_gpu_passes_vs_reference, check_reference_passes,  # noqa: E402
                           skip_unless_block_gemms)

FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def checkpoint(E, n, k, fmt="e4m3", seed=0):
    """E experts' (n, k) weights as a checkpoint holds them: every finite FP8 byte at random, a
    positive float32 scale per 128 x 128 block (not a power of two, as DeepSeek-V3's amax / 448)."""
    rng = np.random.default_rng(seed)
    finite = np.array([b for b in range(256) if np.isfinite(np.uint8(b).view(FP8[fmt]))],
                      np.uint8)
    q = rng.choice(finite, size=(E, n, k)).view(FP8[fmt])
    s = rng.uniform(1e-4, 1e-2, size=(E, -(-n // 128), -(-k // 128))).astype(np.float32)
    return q, s


def deepseek_dequant(q, s, dtype=np.float32):
    """DeepSeek-V3's ``weight_dequant``: each element times its 128 x 128 block's scale, in
    float32 as its kernel computes it (float64: exact)."""
    n, k = q.shape
    rr, cc = np.arange(n)[:, None] // 128, np.arange(k)[None, :] // 128
    return q.astype(dtype) * s[rr, cc].astype(dtype)


@pytest.mark.parametrize("n,k", [(256, 384), (200, 300), (16, 128), (130, 1000)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("form", ["list", "stacked"])
def test_the_block_casts_weights_come_back_bit_for_bit(n, k, fmt, form):
    """Weights the block cast quantized (float32 scales), given back as a checkpoint holds them
    (each expert's bytes and its unpadded block scales): the same buffers, padding included."""
    rng = np.random.default_rng(n + k)
    w = [rng.standard_normal((n, k)).astype(np.float32) * (i + 1) for i in range(3)]
    want = cugrouped.multi_block_cast_transpose(w, block_scaling_dim=2, align=1, fp8_format=fmt,
                                                power_2_scale=False, backend="reference")
    cb = -(-k // 128)
    data = [want.rowwise(i) for i in range(3)]
    scales = [want.rowwise_scale_inv(i)[:, :cb] for i in range(3)]
    if form == "stacked":
        data, scales = np.stack(data), np.stack(scales)
    got = cugrouped.block_scaled_weights(data, scales)
    for name in ("data", "data_t", "scale_inv", "scale_inv_t"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), name
    assert (got.m_splits, got.m_pad_splits, got.k, got.align, got.block_scaling_dim,
            got.fp8_format, got.total_rows) == ((n,) * 3, (n,) * 3, k, 1, 2, fmt, 3 * n)


def test_dequantized_as_deepseek_v3_defines_it():
    """Both copies dequantize to DeepSeek-V3's weight_dequant of the checkpoint, exactly; the
    layouts' padding entries are 1.0."""
    q, s = checkpoint(3, 200, 300, seed=1)
    got = cugrouped.block_scaled_weights(list(q), list(s))
    for i in range(3):
        want = deepseek_dequant(q[i], s[i])
        assert np.array_equal(got.dequantize()[i], want)
        assert np.array_equal(got.dequantize(columnwise=True)[i], want)
        assert np.array_equal(np.asarray(got.columnwise(i)), q[i].view(np.uint8).T)
        assert np.all(got.rowwise_scale_inv(i)[:, 3:] == 1)
        assert np.all(got.columnwise_scale_inv(i)[:, 2:] == 1)


@pytest.mark.parametrize("columnwise", [True, False])
def test_the_gemms_take_it(columnwise):
    """fprop (x in 1 x 128 blocks, the checkpoint's W) and dgrad (W's transposed copy) on the
    reference, each its exact float64 product of the dequantized operands correctly rounded; the
    row-wise copy alone serves fprop."""
    m_splits, k, n = [8, 0, 136, 264], 272, 144
    X, _, DY = make_block(m_splits, k, n, seed=3)
    q, s = checkpoint(len(m_splits), n, k, seed=4)
    W = cugrouped.block_scaled_weights(q, s, columnwise=columnwise)
    if columnwise:
        check_reference_passes(X, W, DY, independent)
    else:
        assert W.data_t is None and W.scale_inv_t is None
        y = cugrouped.grouped_fprop(X, W, out_dtype="float32")
        xs = independent(X, "rowwise")
        want = np.concatenate([a @ deepseek_dequant(q[i], s[i], np.float64).T
                               for i, a in enumerate(xs)])
        assert np.array_equal(y, want.astype(np.float32))
        with pytest.raises(ValueError, match="columnwise"):
            cugrouped.grouped_dgrad(DY, W)


def test_torch_tensors_in_torch_tensors_out():
    """torch float8 weights and float32 scales (as safetensors loads them): torch buffers of the
    casts' dtypes, the same bits as the NumPy form; scales that are parameters are read as
    values."""
    torch = pytest.importorskip("torch")
    q, s = checkpoint(2, 256, 384, seed=5)
    tq = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
    ts = torch.nn.Parameter(torch.from_numpy(s))
    got = cugrouped.block_scaled_weights(tq, ts)
    want = cugrouped.block_scaled_weights(q, s)
    assert got.data.dtype == torch.float8_e4m3fn and got.data_t.dtype == torch.uint8
    for name in ("data", "data_t", "scale_inv", "scale_inv_t"):
        a = getattr(got, name)
        assert not a.requires_grad, name
        assert np.array_equal(a.view(torch.uint8).numpy() if a.dtype != torch.float32
                              else a.numpy(), getattr(want, name).view(
                                  np.uint8 if a.dtype != torch.float32 else np.float32)), name


def test_torch_inference_with_a_checkpoints_experts():
    """The ops on torch tensors, forward only: activations cast per 1 x 128 block (float32
    scales, as DeepSeek-V3's act_quant), the checkpoint's weights, the fprop; the NumPy run's
    values bit for bit."""
    torch = pytest.importorskip("torch")
    q, s = checkpoint(3, 144, 272, seed=11)
    x = np.random.default_rng(12).standard_normal((8 + 0 + 40, 272)).astype(np.float32)
    ys = []
    for lib in ("numpy", "torch"):
        if lib == "torch":
            conv = torch.from_numpy
            qq = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
        else:
            conv, qq = (lambda a: a), q
        x8 = cugrouped.multi_block_cast_transpose(conv(x), [8, 0, 40], power_2_scale=False,
                                                  columnwise=False)
        ys.append(cugrouped.grouped_fprop(x8, cugrouped.block_scaled_weights(qq, conv(s)),
                                          out_dtype="float32"))
    assert isinstance(ys[1], torch.Tensor) and np.array_equal(ys[1].numpy(), ys[0])


def test_uint8_bytes_need_their_format():
    q, s = checkpoint(2, 128, 128, fmt="e5m2", seed=6)
    got = cugrouped.block_scaled_weights(q.view(np.uint8), s, fp8_format="e5m2")
    assert got.fp8_format == "e5m2" and got.data.dtype == ml_dtypes.float8_e5m2
    assert np.array_equal(got.dequantize()[1], deepseek_dequant(q[1], s[1]))


def test_errors_name_the_argument():
    q, s = checkpoint(2, 200, 300, seed=7)
    f = cugrouped.block_scaled_weights
    cases = [
        (lambda: f([], []), ValueError, r"data: expected at least one expert"),
        (lambda: f(q[0], s[0]), TypeError, r"data: expected a list of 2-D arrays or one 3-D"),
        (lambda: f(list(q), list(s[:1])), ValueError, r"scale_inv: expected one per expert \(2\)"),
        (lambda: f(list(q), [s[0], s[1][:, :2]]), ValueError,
         r"scale_inv\[1\]: expected shape \(2, 3\) \(ceil\(200/128\), ceil\(300/128\)\)"),
        (lambda: f([q[0], q[1][:100]], list(s)), ValueError,
         r"data\[1\]: expected shape \(200, 300\) like data\[0\]"),
        (lambda: f(q.astype(np.float32), s), TypeError, r"data: expected FP8 data"),
        (lambda: f(q.view(np.uint8), s), ValueError, r"data: uint8 bytes need fp8_format="),
        (lambda: f(q, s, fp8_format="e5m2"), ValueError,
         r"fp8_format: 'e5m2' contradicts data's dtype float8_e4m3fn"),
        (lambda: f(q, s, fp8_format="fp8"), ValueError, r"fp8_format: expected 'e4m3', 'e5m2'"),
        (lambda: f(q, s.astype(np.float16)), TypeError, r"scale_inv\[0\]: expected float32"),
        (lambda: f([q[0], q[1].view(np.uint8)], list(s)), TypeError,
         r"data\[1\]: expected dtype float8_e4m3fn like data\[0\]"),
        (lambda: f(list(q), [s[0], [[1.0]]]), TypeError, r"scale_inv\[1\]: expected a 2-D"),
        (lambda: f(q, s, columnwise=1), TypeError, r"columnwise: expected a bool"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()


def test_mixed_kinds_are_refused():
    torch = pytest.importorskip("torch")
    q, s = checkpoint(2, 128, 128, seed=8)
    tq = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"scale_inv\[0\]: expected a torch array on cpu like "
                                        r"data\[0\], got ndarray"):
        cugrouped.block_scaled_weights(tq, s)


# On a GPU (run by scripts/gpu_check.sh): CuPy's bytes and torch's CUDA tensors give the same
# buffers as the NumPy form; cuBLASLt's block-scaled GEMMs on them against the reference, within
# the tolerance of test_grouped_gemm_block.py's GPU tests.

@pytest.mark.gpu
def test_gpu_cupy_and_torch_forms_and_the_gemms():
    import cupy

    q, s = checkpoint(4, 144, 272, seed=9)
    want = cugrouped.block_scaled_weights(q, s)
    W = cugrouped.block_scaled_weights(cupy.asarray(q.view(np.uint8)), cupy.asarray(s),
                                       fp8_format="e4m3")
    for name in ("data", "data_t", "scale_inv", "scale_inv_t"):
        assert cupy.asnumpy(getattr(W, name)).tobytes() == getattr(want, name).tobytes(), name
    torch = pytest.importorskip("torch")
    tq = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn).cuda()
    tw = cugrouped.block_scaled_weights(tq, torch.from_numpy(s).cuda())
    assert tw.data.device.type == "cuda" and tw.data.dtype == torch.float8_e4m3fn
    for name in ("data", "data_t", "scale_inv", "scale_inv_t"):
        a = getattr(tw, name).cpu()
        a = a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a
        assert a.numpy().tobytes() == getattr(want, name).tobytes(), name
    skip_unless_block_gemms()
    X, _, DY = make_block([8, 0, 136, 264], 272, 144, seed=10, xp=cupy)
    check_gpu_passes_vs_reference(X, W, DY, independent)
