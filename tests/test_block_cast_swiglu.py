"""The block-scaled casts with the fused SwiGLU (``activation="swiglu"``): Float8BlockScaling's
1 x 128 blocks and MXFP8's 1 x 32 blocks of ``silu(a) * b`` from fc1's halves ``[a | b]``.

The kernel on the CPU emulator gives the reference's bits over the block taxonomy x dtypes x
both kinds x input forms (fiber orders varied); the reference is the activation
(cugrouped.reference.activation) followed by the plain block cast; errors; the torch front; the
GPU twin (marked ``gpu``; in scripts/gpu_check.sh's block stage)."""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest

import cugrouped
from cugrouped.reference import activation as ract
from _block_common import BLOCK_CAST, BLOCK_SPLITS, MXFP8_CAST, assert_same_bits
from test_pad_cast_transpose import ORDERS
from test_pad_cast_transpose_swiglu import gated_inputs

KINDS = {"block": BLOCK_CAST, "mx": MXFP8_CAST}
SWIGLU = dict(activation="swiglu")

CASES = [
    (split, dtype, kind, form, ("e4m3", "e5m2")[i % 2], ORDERS[i % len(ORDERS)])
    for i, (split, dtype, kind, form) in enumerate(itertools.product(
        BLOCK_SPLITS, ("float32", "float16", "bfloat16"), KINDS, ("list", "tensor", "device")))
]


def case_data(split, dtype, kind):
    m_splits, k = BLOCK_SPLITS[split]
    seed = zlib.crc32(repr(("block-swiglu", split, dtype, kind)).encode())
    return m_splits, gated_inputs(m_splits, k, dtype, seed, specials=split in ("skewed", "edges"))


@pytest.mark.parametrize("split,dtype,kind,form,fmt,order", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_emulated_swiglu_block_cast_matches_reference(split, dtype, kind, form, fmt, order):
    cast = KINDS[kind]
    m_splits, xs = case_data(split, dtype, kind)
    with cugrouped.emulation_order(order):
        got, want = cast.run_both(xs, m_splits, form, fp8_format=fmt, **SWIGLU)
    assert_same_bits(got, want, f"{split}/{dtype}/{kind}/{form}")
    assert got.k == BLOCK_SPLITS[split][1]
    for i, m in enumerate(m_splits):
        assert not np.asarray(got.columnwise(i))[:, m:].any()


@pytest.mark.parametrize("kind", list(KINDS))
def test_reference_is_the_activation_then_the_plain_block_cast(kind):
    cast = KINDS[kind]
    m_splits, k = [130, 0, 37], 136
    xs = gated_inputs(m_splits, k, "bfloat16", 8, specials=True)
    fused = cast.reference(xs, **SWIGLU)
    acts = [ract.swiglu(x[:, :k].astype(np.float32), x[:, k:].astype(np.float32)) for x in xs]
    assert_same_bits(fused, cast.reference(acts), kind)


@pytest.mark.parametrize("k", [1, 36, 129])
def test_unaligned_second_half_and_one_sided_copies(k):
    m_splits = [130, 3]
    xs = gated_inputs(m_splits, k, "bfloat16", k, specials=True)
    for cast in KINDS.values():
        for rowwise, columnwise in ((True, True), (True, False), (False, True)):
            got, want = cast.run_both(xs, m_splits, "tensor", rowwise=rowwise,
                                      columnwise=columnwise, **SWIGLU)
            assert_same_bits(got, want, f"{cast.op} k={k} {rowwise}/{columnwise}")


@pytest.mark.parametrize("backend", ["emulate", "reference"])
def test_bad_activation_arguments_are_refused(backend):
    xs = gated_inputs([4, 6], 32, "bfloat16", 0)
    with pytest.raises(ValueError, match="128 x 128 blocks are for weights"):
        cugrouped.multi_block_cast_transpose(xs, block_scaling_dim=2, backend=backend, **SWIGLU)
    with pytest.raises(ValueError, match="column_sums"):
        cugrouped.multi_mxfp8_cast_transpose(xs, column_sums=True, backend=backend, **SWIGLU)
    with pytest.raises(ValueError, match="even number of columns"):
        cugrouped.multi_block_cast_transpose([x[:, 1:] for x in xs], backend=backend, **SWIGLU)
    with pytest.raises(ValueError, match="activation: expected one of"):
        cugrouped.multi_mxfp8_cast_transpose(xs, backend=backend, activation="relu")


def test_torch_front_gives_the_same_bits():
    torch = pytest.importorskip("torch")
    m_splits, k = [130, 0, 21], 64
    xs = gated_inputs(m_splits, k, "bfloat16", 9, specials=True)
    ts = torch.cat([torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in xs])
    for cast in KINDS.values():
        want = cast.reference(xs, **SWIGLU)
        got = cast.cast(ts, m_splits, backend="emulate", **SWIGLU)
        assert tuple(got.data.shape) == (sum(m_splits), k)
        for name in ("data", "data_t", "scale_inv", "scale_inv_t"):
            g = getattr(got, name).contiguous().view(torch.uint8).numpy()
            assert np.array_equal(g, np.asarray(getattr(want, name)).view(np.uint8)), name


# ------------------------------------------------------------------------------------------------
# On a GPU (skipped here; scripts/gpu_check.sh's block stage runs it).

GPU_CASES = [c for c in CASES if c[3] != "tensor"]


@pytest.mark.gpu
@pytest.mark.parametrize("split,dtype,kind,form,fmt,order", GPU_CASES,
                         ids=["-".join(map(str, c)) for c in GPU_CASES])
def test_cuda_swiglu_block_cast_matches_reference(split, dtype, kind, form, fmt, order):
    import cupy

    cast = KINDS[kind]
    m_splits, xs = case_data(split, dtype, kind)
    carrier = {"bfloat16": np.uint16}.get(dtype)
    dxs = [cupy.asarray(x.view(carrier) if carrier else x) for x in xs]
    splits = None
    if form == "device":
        dxs, splits = cupy.concatenate(dxs, axis=0), cupy.asarray(np.array(m_splits, np.int64))
    want = cast.reference(xs, fp8_format=fmt, **SWIGLU)
    got = cast.cast(dxs, splits, dtype=dtype if carrier else None, fp8_format=fmt, **SWIGLU)
    assert_same_bits(cast.to_host(got), want, f"cuda {split}/{dtype}/{kind}/{form}")
