"""scatter_rows: the deterministic sum of rows onto tokens (the MoE permute's adjoint). The same
CUDA source on the emulator against the NumPy reference, bit for bit; the reference against
torch's CPU index_add_ (which adds in the same order); the CUDA launch on a GPU."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cugrouped
from cugrouped import reference
from cugrouped.ops import scatter_rows as sr

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _case(tokens, rows, h, dtype, seed, top=8):
    rng = np.random.default_rng(seed)
    idx = rng.integers(-2, tokens + 2, rows).astype(np.int64)    # outside [0, tokens): skipped
    idx[: min(rows, top)] = 0                                    # one token with `top` rows
    x = (rng.standard_normal((rows, h)) * np.exp2(rng.integers(-8, 8, (rows, 1)))).astype(DTYPES[dtype])
    return idx, x


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("tokens,rows,h", [(7, 40, 300), (50, 13, 16), (3, 0, 8), (0, 5, 4),
                                           (20, 64, 256)])
def test_emulated_kernel_matches_reference(dtype, tokens, rows, h):
    idx, x = _case(tokens, rows, h, dtype, seed=tokens + rows)
    order, seg = reference.scatter_plan(idx, tokens)
    want = reference.scatter_rows(x, order, seg, tokens)
    out = np.full((tokens, h), np.nan, np.float32)
    got = sr.scatter_rows(x, order, seg, tokens, out, backend="emulate")
    assert got is out and np.array_equal(out.view(np.uint32), want.view(np.uint32))
    # what it computes: the sums, each addition rounded to float32 (n additions: an error of at
    # most n * 2^-24 of the sum of magnitudes)
    exact, mag = np.zeros((tokens, h)), np.zeros((tokens, h))
    for j, t in enumerate(idx):
        if 0 <= t < tokens:
            exact[t] += x[j].astype(np.float64)
            mag[t] += np.abs(x[j].astype(np.float64))
    n = np.diff(seg)[:, None]
    assert (np.abs(want - exact) <= n * 2.0 ** -24 * mag).all()


def test_reference_adds_in_the_order_torch_index_add_does_on_the_cpu():
    torch = pytest.importorskip("torch")
    idx, x = _case(9, 70, 33, "float32", seed=3)
    valid = (idx >= 0) & (idx < 9)
    order, seg = reference.scatter_plan(idx, 9)
    want = torch.zeros(9, 33).index_add_(0, torch.from_numpy(idx[valid]),
                                         torch.from_numpy(x[valid]))
    assert np.array_equal(reference.scatter_rows(x, order, seg, 9), want.numpy())


def test_plan_groups_rows_by_token_stably():
    order, seg = reference.scatter_plan(np.array([2, 0, 2, -1, 0, 5, 2]), 3)
    assert order.tolist()[:5] == [1, 4, 0, 2, 6] and seg.tolist() == [0, 2, 2, 5]
    # 4 columns per thread: 1024 per block
    assert sr.plan_grid(10, 300) == (1, 10) and sr.plan_grid(10, 0) == (1, 0)
    assert sr.plan_grid(10, 1025) == (2, 20)


def test_bad_input():
    x, order, seg = np.zeros((4, 8), np.float32), np.arange(4), np.array([0, 2, 4])
    out = np.zeros((2, 8), np.float32)
    with pytest.raises(TypeError, match="rows: expected a 2-D float32"):
        sr.scatter_rows(x.astype(np.float64), order, seg, 2, out)
    with pytest.raises(TypeError, match=r"order: expected a contiguous int64 array of shape \(4,\)"):
        sr.scatter_rows(x, order[:3], seg, 2, out)
    with pytest.raises(TypeError, match=r"seg: expected a contiguous int64 array of shape \(3,\)"):
        sr.scatter_rows(x, order, seg.astype(np.int32), 2, out)
    with pytest.raises(TypeError, match=r"out: expected a contiguous float32 array of shape"):
        sr.scatter_rows(x, order, seg, 2, np.zeros((2, 8), np.float64))


def _nan_case():
    """Token 0 sums a -NaN with a payload, token 1 +inf and -inf, token 2 a lone +NaN row, token 3
    +inf alone: sums that are NaN must carry the GPU's one NaN, 0x7FFFFFFF."""
    x = np.ones((6, 4), np.float32)
    x[0, 0] = np.array([0xFFC00001], np.uint32).view(np.float32)[0]
    x[2, 1], x[3, 1] = np.inf, -np.inf
    x[4, 2] = np.nan
    x[5, 3] = np.inf
    idx = np.array([0, 0, 1, 1, 2, 3], np.int64)
    want = np.ones((4, 4), np.float32) * np.array([[2], [2], [1], [1]], np.float32)
    want[0, 0] = want[1, 1] = want[2, 2] = np.array([0x7FFFFFFF], np.uint32).view(np.float32)[0]
    want[3, 3] = np.inf
    return x, idx, want


@pytest.mark.parametrize("backend", ["reference", "emulate"])
def test_nan_sums_have_the_gpus_bits(backend):
    x, idx, want = _nan_case()
    order, seg = reference.scatter_plan(idx, 4)
    out = np.zeros((4, 4), np.float32)
    if backend == "reference":
        out = reference.scatter_rows(x, order, seg, 4)
    else:
        sr.scatter_rows(x, order, seg, 4, out, backend="emulate")
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_matches_reference(dtype):
    import cupy

    idx, x = _case(100, 900, 520, dtype, seed=1)
    order, seg = reference.scatter_plan(idx, 100)
    want = reference.scatter_rows(x, order, seg, 100)
    xd = cupy.asarray(x.view(np.uint16) if dtype == "bfloat16" else x)
    out = cupy.empty((100, 520), cupy.float32)
    sr.scatter_rows(xd, cupy.asarray(order), cupy.asarray(seg), 100, out,
                    dtype="bfloat16" if dtype == "bfloat16" else None)
    assert np.array_equal(cupy.asnumpy(out).view(np.uint32), want.view(np.uint32))


def test_torch_op_on_cpu_tensors_and_under_fake_tensors():
    """The torch custom op (what the layer's CUDA backward calls) on CPU tensors gives the
    reference's bits; its fake implementation gives the shape and dtype (torch.compile)."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cugrouped.pytorch import _custom_ops as cops

    idx, x = _case(11, 60, 40, "bfloat16", seed=4)
    order, seg = reference.scatter_plan(idx, 11)
    xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    got = cops.eager.scatter_rows_sum(xt, torch.from_numpy(order), torch.from_numpy(seg), 11)
    want = reference.scatter_rows(x, order, seg, 11)
    assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want)
    with FakeTensorMode():
        fake = torch.ops.cugrouped.scatter_rows_sum(torch.empty(60, 40, dtype=torch.bfloat16),
                                                    torch.empty(60, dtype=torch.int64),
                                                    torch.empty(12, dtype=torch.int64), 11)
    assert fake.shape == (11, 40) and fake.dtype == torch.float32


def test_layer_cuda_path_logic_on_cpu_tensors():
    """What the layer's backward runs on CUDA (the device grouping, then the custom op), run on
    CPU tensors: the grouping equals the reference plan, and the sums equal the CPU path's
    index_add_ bit for bit (float32, no denormals: the same order of additions)."""
    torch = pytest.importorskip("torch")
    from cugrouped.pytorch import _custom_ops as cops
    from cugrouped.pytorch import _gather

    idx, x = _case(13, 90, 24, "float32", seed=6)
    order, seg = _gather.token_order(torch.from_numpy(idx), 13)
    ro, rs = reference.scatter_plan(idx, 13)
    assert np.array_equal(order.numpy(), ro) and np.array_equal(seg.numpy(), rs)
    xt = torch.from_numpy(x)
    via_op = cops.eager.scatter_rows_sum(xt, order, seg, 13)
    assert torch.equal(via_op, _gather.scatter_rows(xt, torch.from_numpy(idx), 13))


@pytest.mark.gpu
def test_cuda_nan_sums_have_the_references_bits():
    import cupy

    x, idx, want = _nan_case()
    order, seg = reference.scatter_plan(idx, 4)
    out = cupy.full((4, 4), 7.0, cupy.float32)
    sr.scatter_rows(cupy.asarray(x), cupy.asarray(order), cupy.asarray(seg), 4, out)
    np.testing.assert_array_equal(cupy.asnumpy(out).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("order", ["forward", "reverse", "shuffle", 7, "warps", "warps-reverse"])
def test_emulated_writes_only_its_own_cells_in_every_order(order):
    """h = 300 leaves the second column chunk of every token partial: its threads past h must
    not write, since their cell would be the next token's column 0 (a race that the block order
    decides) or, for the last token, past the output. The output is the front of a larger
    buffer of sentinels, so a write past it shows, and the blocks run in every order."""
    tokens, rows, h = 7, 40, 300
    idx, x = _case(tokens, rows, h, "float32", seed=47)
    plan, seg = reference.scatter_plan(idx, tokens)
    want = reference.scatter_rows(x, plan, seg, tokens)
    guard = np.full(tokens * h + 64, -1.0, np.float32)
    out = guard[: tokens * h].reshape(tokens, h)
    with cugrouped.emulation_order(order):
        sr.scatter_rows(x, plan, seg, tokens, out, backend="emulate")
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    assert (guard[tokens * h:] == -1.0).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("first_col, h", [(0, 261), (0, 8), (1, 200), (8, 3), (2, 100)])
def test_emulated_kernel_on_row_views(dtype, first_col, h):
    """Rows of a wider array: aligned rows with a ragged end (each thread's one load of 4 values,
    then value by value for the last columns), and unaligned rows (value by value)."""
    idx, wide = _case(11, 30, 272, dtype, seed=h)
    x = wide[:, first_col:first_col + h]
    order, seg = reference.scatter_plan(idx, 11)
    want = reference.scatter_rows(np.ascontiguousarray(x), order, seg, 11)
    out = np.full((11, h), np.nan, np.float32)
    sr.scatter_rows(x, order, seg, 11, out, backend="emulate")
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
