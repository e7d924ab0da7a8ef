"""multi_pad_cast_transpose called with torch tensors: torch tensors back, from torch's allocator,
with the reference's bits (CPU here; CUDA in the GPU check)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cugrouped  # noqa: E402
from cugrouped import reference  # noqa: E402

SPLITS = [7, 0, 33, 16]
K = 48


def _inputs(dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(sum(SPLITS), K, generator=g) * 4).to(dtype)
    return x.to(device)


def _np(x):
    return x.view(torch.int16).numpy().view(__import__("ml_dtypes").bfloat16) \
        if x.dtype == torch.bfloat16 else x.numpy()


def _same(got, want):
    assert got.data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    assert np.array_equal(got.data.cpu().view(torch.uint8).numpy(), want.data.view(np.uint8))
    assert np.array_equal(got.data_t.cpu().numpy(), want.data_t)
    for f in ("amax", "scale", "scale_inv"):
        assert isinstance(getattr(got, f), torch.Tensor)
        assert np.array_equal(getattr(got, f).cpu().numpy().view(np.uint32),
                              np.asarray(getattr(want, f), np.float32).view(np.uint32)), f


@pytest.mark.parametrize("backend", [None, "emulate", "reference"])
@pytest.mark.parametrize("form", ["list", "tensor", "tensor-splits-as-tensor"])
def test_torch_cpu_tensors_in_torch_tensors_out(backend, form):
    x = _inputs()
    want = reference.multi_pad_cast_transpose(_np(x), SPLITS, fp8_format="e5m2", column_sums=True)
    if form == "list":
        args = (list(torch.split(x, SPLITS)), None)
    elif form == "tensor":
        args = (x, SPLITS)
    else:
        args = (x, torch.tensor(SPLITS))
    got = cugrouped.multi_pad_cast_transpose(*args, fp8_format="e5m2", column_sums=True,
                                             backend=backend)
    _same(got, want)
    assert got.data.dtype == torch.float8_e5m2 and got.m_splits == tuple(SPLITS)
    assert torch.equal(got.column_sums, torch.from_numpy(want.column_sums))
    # the same bytes, viewed per expert
    assert torch.equal(got.columnwise(2).view(torch.uint8), torch.from_numpy(want.columnwise(2)))


@pytest.mark.parametrize("backend", ["emulate", "reference"])
def test_torch_front_passes_the_scale_options(backend):
    x = _inputs()
    x[7:40] = 0                                       # expert 2 all zero: amax_epsilon decides
    kw = dict(amax_epsilon=0.25, power_2_scale=True)
    want = reference.multi_pad_cast_transpose(_np(x), SPLITS, **kw)
    got = cugrouped.multi_pad_cast_transpose(x, SPLITS, backend=backend, **kw)
    _same(got, want)
    assert got.scale[2].item() == 1024.0              # 448 / 0.25 = 1792, rounded down to 2^10
    with pytest.raises(ValueError, match="amax_epsilon"):
        cugrouped.multi_pad_cast_transpose(x, SPLITS, amax_epsilon=-1.0)


def test_torch_front_checks_the_inputs_once(monkeypatch):
    """The front sizes its torch outputs from normalize_inputs and hands the result on, so the
    O(E) per-tensor checks are not repeated inside the op (host time per expert)."""
    from cugrouped.ops import _cast_inputs

    calls = []
    real = _cast_inputs.normalize_inputs
    monkeypatch.setattr(_cast_inputs, "normalize_inputs",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    x = _inputs()
    got = cugrouped.multi_pad_cast_transpose(list(torch.split(x, SPLITS)), backend="emulate")
    assert len(calls) == 1
    _same(got, reference.multi_pad_cast_transpose(list(np.split(_np(x), np.cumsum(SPLITS)[:-1]))))


def test_given_scale_and_out_buffers_are_torch_tensors_written_in_place():
    x = _inputs(torch.float32)
    scale = torch.tensor([1.0, 2.0, 0.5, 64.0])
    first = cugrouped.multi_pad_cast_transpose(x, SPLITS, scale=scale, backend="emulate")
    assert first.scale is scale
    ptrs = {f: getattr(first, f).data_ptr() for f in ("data", "data_t", "amax", "scale_inv")}
    x2 = x * 3
    again = cugrouped.multi_pad_cast_transpose(x2, SPLITS, scale=scale, out=first, backend="emulate")
    for f, p in ptrs.items():
        assert getattr(again, f).data_ptr() == p, f
    _same(again, reference.multi_pad_cast_transpose(x2.numpy(), SPLITS, scale=scale.numpy()))


@pytest.mark.parametrize("backend", ["emulate", "reference"])
@pytest.mark.parametrize("op", ["multi_pad_cast_transpose", "multi_block_cast_transpose"])
def test_torch_out_of_another_fp8_format_is_refused_unwritten(backend, op):
    x = _inputs(torch.float32)
    out = getattr(cugrouped, op)(x, SPLITS, fp8_format="e5m2", backend=backend)
    before = out.data.view(torch.uint8).clone()
    with pytest.raises(ValueError, match=r"^out: expected a result of this call's fp8_format "
                       r"'e4m3' to reuse, got one of fp8_format 'e5m2'$"):
        getattr(cugrouped, op)(x * 2, SPLITS, out=out, backend=backend)
    assert torch.equal(out.data.view(torch.uint8), before)
    again = getattr(cugrouped, op)(x * 2, SPLITS, fp8_format="e5m2", out=out, backend=backend)
    assert again.data.dtype == torch.float8_e5m2
    assert again.data.data_ptr() == out.data.data_ptr()


@pytest.mark.parametrize("backend", ["emulate", "reference"])
def test_amax_accumulate_merges_into_the_torch_out_amax(backend):
    x = _inputs(torch.float32)
    scale = torch.tensor([1.0, 2.0, 0.5, 64.0])
    out = cugrouped.multi_pad_cast_transpose(x, SPLITS, scale=scale, backend=backend)
    fresh = out.amax.clone()
    old = torch.tensor([1e30, 5.0, 0.0, float("nan")])
    out.amax.copy_(old)
    got = cugrouped.multi_pad_cast_transpose(x, SPLITS, scale=scale, out=out, backend=backend,
                                             amax_accumulate=True)
    assert got.amax is out.amax
    want = reference.merge_amax(old.numpy(), fresh.numpy())
    assert np.array_equal(got.amax.numpy().view(np.uint32), want.view(np.uint32))
    # expert 1 has no rows: it contributes 0 and keeps its 5; a NaN already there is replaced
    assert got.amax[0] == 1e30 and got.amax[1] == 5.0 and got.amax[3] == fresh[3]


def test_bad_torch_input_is_rejected_before_anything_runs():
    x = _inputs()
    with pytest.raises(ValueError, match="amax_accumulate: needs out="):
        cugrouped.multi_pad_cast_transpose(x, SPLITS, scale=torch.ones(4), amax_accumulate=True)
    with pytest.raises(ValueError, match="amax_accumulate: needs a given scale"):
        cugrouped.multi_pad_cast_transpose(x, SPLITS, amax_accumulate=True,
                                           out=cugrouped.multi_pad_cast_transpose(x, SPLITS))
    x = _inputs()
    with pytest.raises(ValueError, match="m_splits"):
        cugrouped.multi_pad_cast_transpose(x, [1, 2])
    with pytest.raises(TypeError, match=r"inputs\[1\]: expected a torch.Tensor like inputs\[0\], "
                       r"got ndarray"):
        cugrouped.multi_pad_cast_transpose([x, np.zeros((2, K), np.float32)])
    with pytest.raises(TypeError, match=r"got float64$"):    # no CuPy-only hint for torch
        cugrouped.multi_pad_cast_transpose(x.double(), SPLITS)
    with pytest.raises(TypeError, match=r"inputs\[1\]"):
        cugrouped.multi_pad_cast_transpose([x, x.float()])


@pytest.mark.parametrize("op, cls", [("multi_pad_cast_transpose", "GroupedFP8"),
                                     ("multi_block_cast_transpose", "GroupedBlockFP8"),
                                     ("multi_mxfp8_cast_transpose", "GroupedMXFP8")])
def test_an_out_that_is_not_a_result_is_a_type_error_naming_out(op, cls):
    """As on the NumPy path (not an AttributeError from reading its fields)."""
    x = torch.randn(32, 32)
    for xs in (x, x.numpy()):
        with pytest.raises(TypeError, match=rf"^out: expected a {cls} \(e.g. the result of an "
                           r"earlier call\), got dict$"):
            getattr(cugrouped, op)(xs, [32], out={"data": None})


@pytest.mark.parametrize("scale", [np.ones(4, np.float32), [1.0] * 4, 2.0])
def test_a_scale_that_is_not_a_tensor_is_a_type_error_naming_scale(scale):
    x = _inputs()
    with pytest.raises(TypeError, match=r"^scale: expected a contiguous float32 torch tensor of "
                       rf"shape \(4,\) on the inputs' device, got {type(scale).__name__}$"):
        cugrouped.multi_pad_cast_transpose(x, SPLITS, scale=scale)
    with pytest.raises(ValueError, match=r"^scale: expected a contiguous float32 array of shape "
                       r"\(4,\), got float64"):             # a tensor: the op's own checks
        cugrouped.multi_pad_cast_transpose(x, SPLITS, scale=torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("op", ["multi_pad_cast_transpose", "multi_block_cast_transpose"])
@pytest.mark.parametrize("splits, got", [
    (torch.tensor([7.9, 0.9, 33.0, 16.2]), "a torch.float32 tensor of shape (4,)"),   # not truncated
    (torch.tensor([[7, 0, 33, 16]]), "a torch.int64 tensor of shape (1, 4)"),
    (torch.tensor(sum(SPLITS)), "a torch.int64 tensor of shape ()"),
    (torch.tensor(SPLITS) > 0, "a torch.bool tensor of shape (4,)"),
])
def test_host_count_tensor_must_be_1d_integers_as_in_the_numpy_path(op, splits, got):
    """A CPU count tensor follows the NumPy path's rule and message (1-D, integer, not bool):
    a float tensor used to be truncated to ints silently."""
    x = _inputs()
    with pytest.raises(TypeError, match=r"^m_splits: expected a 1-D sequence of non-negative "
                       rf"ints, got {re.escape(got)}$"):
        getattr(cugrouped, op)(x[:2] if splits.dtype == torch.bool else x, splits)
    with pytest.raises(TypeError, match=r"m_splits: expected a 1-D sequence of non-negative ints"):
        getattr(cugrouped, op)(_np(x[:2] if splits.dtype == torch.bool else x), splits.numpy())
    for dt in (torch.int32, torch.int64, torch.uint8):            # integer tensors are counts
        res = getattr(cugrouped, op)(x, torch.tensor(SPLITS, dtype=dt))
        assert res.m_splits == tuple(SPLITS)
    with pytest.raises(ValueError, match=r"m_splits: expected non-negative counts"):
        getattr(cugrouped, op)(x, torch.tensor([14, -7, 33, 16]))


@pytest.mark.gpu
@pytest.mark.parametrize("splits_kind", ["list", "device-tensor"])
def test_torch_cuda_on_current_stream_without_sync(splits_kind):
    x = _inputs().cuda()
    want = reference.multi_pad_cast_transpose(_np(x.cpu()), SPLITS, column_sums=True)
    splits = SPLITS if splits_kind == "list" else torch.tensor(SPLITS, device="cuda")
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(stream):
            got = cugrouped.multi_pad_cast_transpose(x, splits, column_sums=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream.synchronize()
    assert got.data.is_cuda and got.data.dtype == torch.float8_e4m3fn
    if splits_kind == "device-tensor":
        assert got.m_splits is splits and got.m_pad_splits is None
        got.data_t = got.data_t[: want.data_t.size]
    _same(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["multi_pad_cast_transpose", "multi_block_cast_transpose"])
def test_torch_cuda_counts_with_splits_on_device_false_are_refused(op):
    """A CUDA count tensor with ``splits_on_device=False`` would have to be read back (a hidden
    host sync): refused, as the array ops refuse a device count array then."""
    x = _inputs().cuda()
    with pytest.raises(TypeError, match="m_splits: a CUDA tensor was given with splits_on_device"):
        getattr(cugrouped, op)(x, torch.tensor(SPLITS, device="cuda"), splits_on_device=False)


@pytest.mark.gpu
def test_torch_cuda_gather_without_sync():
    """The fused permute from CUDA tensors (tokens, row_index): no host sync, reference bits."""
    tokens = _inputs().cuda()
    idx = torch.randint(0, tokens.shape[0], (sum(SPLITS),), dtype=torch.int64, device="cuda")
    idx[3] = -1
    want = reference.multi_pad_cast_transpose(_np(tokens.cpu()), SPLITS,
                                              row_index=idx.cpu().numpy(), column_sums=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = cugrouped.multi_pad_cast_transpose(tokens, SPLITS, row_index=idx, column_sums=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _same(got, want)


def test_dequantize_torch_result_matches_numpy_result():
    x = _inputs(torch.float32)
    got = cugrouped.multi_pad_cast_transpose(x, SPLITS)
    want = reference.multi_pad_cast_transpose(x.numpy(), SPLITS)
    for a, b in zip(got.dequantize(), want.dequantize()):
        assert isinstance(a, torch.Tensor) and np.array_equal(a.numpy(), b)
    cw = cugrouped.multi_pad_cast_transpose(x, SPLITS, rowwise=False)
    for a, b in zip(cw.dequantize(), want.dequantize()):
        assert np.array_equal(a.numpy(), b)


@pytest.mark.gpu
@pytest.mark.parametrize("splits_kind", ["list", "device-tensor"])
def test_torch_cuda_graph_capture_and_replay(splits_kind):
    """The op inside a captured CUDA graph (``out=`` buffers, workspaces made by a warm-up call on
    the capture stream): each replay on new data gives the reference's bits. With the counts in a
    device tensor the graph follows new splits too, with no host sync and no recapture."""
    g = torch.Generator().manual_seed(1)
    x = torch.empty(sum(SPLITS), K, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor([2.0, 1.0, 0.5, 8.0], device="cuda")
    splits = SPLITS if splits_kind == "list" else torch.tensor(SPLITS, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):      # warm-up: per-stream workspaces exist before capture
        out = cugrouped.multi_pad_cast_transpose(x, splits, scale=scale, column_sums=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        cugrouped.multi_pad_cast_transpose(x, splits, scale=scale, column_sums=True, out=out)
    plans = [SPLITS, [33, 16, 0, 7], [0, 0, 56, 0]] if splits_kind != "list" else [SPLITS] * 3
    for m in plans:
        x.copy_((torch.randn(sum(SPLITS), K, generator=g) * 4).to(torch.bfloat16))
        if splits_kind != "list":
            splits.copy_(torch.tensor(m))
        graph.replay()
        torch.cuda.synchronize()
        want = reference.multi_pad_cast_transpose(_np(x.cpu()), m, scale=scale.cpu().numpy(),
                                                  column_sums=True)
        got = dataclasses.replace(out, data_t=out.data_t[: want.data_t.size], scale=scale)
        _same(got, want)
        assert np.array_equal(out.column_sums.cpu().numpy().view(np.uint32),
                              want.column_sums.view(np.uint32))
