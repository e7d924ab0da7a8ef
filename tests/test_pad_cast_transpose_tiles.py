"""The per-tensor cast kernel with two consecutive tiles per block (``set_tiles_per_block(2)``).

A block then takes two tiles, from one expert or two, and flushes an expert's amax once with
the number of its tiles it did (the last-block counter adds that many). It must give the
reference's bits on every pass (given scales; current scaling's amax pass, which walks the tiles
backwards, and its cast), with host or device splits, over several chunks, and leave the
workspaces zero (``_run`` raises otherwise). Variants without a two-tile instantiation (float32
input, column sums, the gather, the activation) keep one tile per block.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import cugrouped
from cugrouped import reference
from cugrouped.ops import pad_cast_transpose as pct

from test_pad_cast_transpose import (SPLITS, assert_same_bits, device_inputs, make_inputs,
                                     run_both, scales_for)


@contextlib.contextmanager
def two_per_block():
    old = pct.set_tiles_per_block(2)
    try:
        yield
    finally:
        pct.set_tiles_per_block(old)


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("given", [True, False])
@pytest.mark.parametrize("form,dtype,order", [("tensor", "bfloat16", "shuffle"),
                                              ("list", "float16", "warps"),
                                              ("device", "bfloat16", "reverse")])
def test_two_tiles_per_block_give_the_reference_bits(split, given, form, dtype, order):
    m_splits, k = SPLITS[split]
    xs = make_inputs(m_splits, k, dtype, seed=len(split), specials=split == "skewed")
    fmt = "e5m2" if form == "list" else "e4m3"
    scale = scales_for(m_splits, fmt, 2) if given else None
    with two_per_block(), cugrouped.emulation_order(order), cugrouped.record_launches() as log:
        got, want = run_both(xs, m_splits, form, scale=scale, fp8_format=fmt, align=16)
    assert_same_bits(got, want, f"{split} given={given} {form}")
    assert log and all(launch.kernel.endswith(", 2>") for launch in log)


def test_the_grid_halves_and_the_other_variants_keep_one_tile():
    m_splits, k = [0, 200, 64, 130, 77], 384            # 3 tile columns, 39 tiles
    tiles = pct.plan_launches(m_splits, k, 16)[0].grid
    assert tiles % 2 == 1
    xs = make_inputs(m_splits, k, "bfloat16", seed=1)
    with two_per_block(), cugrouped.record_launches() as log:
        got, want = run_both(xs, m_splits, "list", align=16)
    assert_same_bits(got, want, "two per block")
    assert [launch.grid for launch in log] == [(tiles + 1) // 2] * 2
    # column sums: the amax pass that takes them keeps one tile per block, the cast takes two
    with two_per_block(), cugrouped.record_launches() as log:
        got, want = run_both(xs, m_splits, "list", align=16, column_sums=True)
    assert_same_bits(got, want, "column sums")
    assert [launch.grid for launch in log] == [tiles, (tiles + 1) // 2]
    assert [launch.kernel.endswith(", 2>") for launch in log] == [False, True]
    x32 = make_inputs(m_splits, k, "float32", seed=1)
    with two_per_block(), cugrouped.record_launches() as log:
        got, want = run_both(x32, m_splits, "list", align=16)
    assert_same_bits(got, want, "float32")
    assert [launch.grid for launch in log] == [tiles] * 2


def test_two_tiles_per_block_over_chunks_and_an_accumulated_amax():
    m_splits = [(i * 7) % 23 for i in range(pct.MAX_EXPERTS_PER_LAUNCH + 5)]
    xs = make_inputs(m_splits, 40, "float16", seed=3)
    with two_per_block():
        for form in ("tensor", "device"):
            got, want = run_both(xs, m_splits, form, align=32,
                                 scale=scales_for(m_splits, "e5m2", 3), fp8_format="e5m2")
            assert_same_bits(got, want, f"two chunks, {form}")
        assert_amax_options_as_the_reference()


def assert_amax_options_as_the_reference():
    """A delayed-scaling cast max-merging into pending amaxes (NaN, 0, large and small ones),
    and current scaling with amax_epsilon and power_2_scale, give the reference's bits under
    whatever tuning knob is set."""
    am = [33, 70, 0, 130]
    xa = make_inputs(am, 256, "bfloat16", seed=6)
    sc = scales_for(am, "e4m3", 6)
    pending = np.array([1e-3, 1e9, np.nan, 0.0], np.float32)
    outs = []
    for backend in ("emulate", "reference"):
        out = cugrouped.multi_pad_cast_transpose(xa, scale=sc, backend=backend)
        out.amax[:] = pending
        outs.append(cugrouped.multi_pad_cast_transpose(xa, scale=sc, out=out, backend=backend,
                                                       amax_accumulate=True))
    assert_same_bits(*outs, "amax accumulated")
    got = cugrouped.multi_pad_cast_transpose(xa, backend="emulate", amax_epsilon=0.5,
                                             power_2_scale=True)
    want = reference.multi_pad_cast_transpose(xa, amax_epsilon=0.5, power_2_scale=True)
    assert_same_bits(got, want, "current scaling's options")


@pytest.mark.parametrize("order", ["warps-reverse", "warps", "shuffle"])
@pytest.mark.parametrize("given", [True, False])
def test_a_block_flushing_two_experts_keeps_their_amaxes_apart(order, given):
    """Experts of very different magnitudes, each ending inside a block: a block flushes one
    expert's amax after its first tile and the next's after its second, through the same shared
    slots. Without the barrier between its tiles, warps that run ahead ("warps-reverse") write
    the second expert's maxima over the first's before they are read."""
    # k = 128: 2, 1, 2, 1, 1 tiles; every expert has rows in every warp's share of its tile
    # (32 rows or more), so a slot overwritten too early changes what is read
    m_splits = [100, 40, 70, 50, 60]
    xs = make_inputs(m_splits, 128, "bfloat16", seed=11)
    bf16 = xs[0].dtype
    xs = [(x.astype(np.float32) * np.float32(4.0 ** (-3 * i))).astype(bf16)
          for i, x in enumerate(xs)]
    scale = scales_for(m_splits, "e4m3", 11) if given else None
    for form in ("tensor", "device"):
        with two_per_block(), cugrouped.emulation_order(order), \
                cugrouped.record_launches() as log:
            got, want = run_both(xs, m_splits, form, scale=scale, align=16)
        assert_same_bits(got, want, f"{order} {form}")
        assert all(launch.kernel.endswith(", 2>") for launch in log)
        assert len(set(np.asarray(got.amax).tolist())) == len(m_splits)


def test_current_scaling_over_chunks_two_tiles_per_block():
    """Several launches (chunks of 64 experts), each pass of current scaling over its own tile
    list: the amax pass backwards, then the cast."""
    m_splits = [(i * 11) % 29 for i in range(pct.MAX_EXPERTS_PER_LAUNCH + 9)]
    xs = make_inputs(m_splits, 136, "bfloat16", seed=12)
    for form in ("list", "device"):
        with two_per_block(), cugrouped.record_launches() as log:
            got, want = run_both(xs, m_splits, form, align=16)
        assert_same_bits(got, want, f"two chunks, current scaling, {form}")
        assert len(log) == 4 and all(launch.kernel.endswith(", 2>") for launch in log)


@pytest.mark.parametrize("n", [0, 3, 4, 2.0, True, "2", None])
def test_set_tiles_per_block_takes_the_instantiated_counts(n):
    with pytest.raises(ValueError, match=r"n: expected one of \(1, 2\)"):
        pct.set_tiles_per_block(n)
    assert pct.tiles_per_block() == 1


def test_two_tile_names_exist_only_where_instantiated():
    assert pct.kernel_name("bfloat16", "e4m3", "CAST", tpb=2) in pct.TPB_KERNEL_SPEC.name_expressions
    for kw in (dict(in_dtype="float32"), dict(column_sums=True), dict(gather=True),
               dict(activation="swiglu")):
        args = dict(in_dtype="bfloat16", fp8_format="e4m3", mode="CAST_AMAX", **{})
        args.update(kw)
        with pytest.raises(ValueError, match="tpb: 2 tiles per block exist for"):
            pct.kernel_name(tpb=2, **args)


# ------------------------------------------------------------------------------------------------
# On a GPU (skipped here; run by scripts/gpu_check.sh): the same bits from the CUDA kernel, on
# the split taxonomy and on a case of many tiles (real block scheduling and counter contention).

def cuda_vs_reference(xs, m_splits, form, dtype, variant=two_per_block, suffix=", 2>", **kw):
    """The CUDA kernel under ``variant()`` (a tuning knob's context) against the reference, its
    launches all of the instantiation whose name ends with ``suffix``."""
    import cupy

    dxs, splits, tag = device_inputs(xs, m_splits, form, dtype)
    want = reference.multi_pad_cast_transpose(xs, **kw)
    dkw = {k: cupy.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    with variant(), cugrouped.record_launches() as log:
        got = cugrouped.multi_pad_cast_transpose(dxs, splits, dtype=tag, **dkw)
    assert log and all(launch.kernel.endswith(suffix) for launch in log)
    host = cugrouped.GroupedFP8(**{f: (cupy.asnumpy(v) if isinstance(v, cupy.ndarray) else v)
                                   for f, v in vars(got).items()})
    assert_same_bits(host, want, f"cuda {variant.__name__}, {form}")


@pytest.mark.gpu
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("given", [True, False])
@pytest.mark.parametrize("form,dtype", [("list", "float16"), ("tensor", "bfloat16"),
                                        ("device", "bfloat16")])
def test_gpu_two_tiles_per_block_match_the_reference(split, given, form, dtype):
    m_splits, k = SPLITS[split]
    xs = make_inputs(m_splits, k, dtype, seed=len(split), specials=split == "skewed")
    scale = scales_for(m_splits, "e4m3", 2) if given else None
    cuda_vs_reference(xs, m_splits, form, dtype, scale=scale, align=16)


@pytest.mark.gpu
@pytest.mark.parametrize("given", [True, False])
def test_gpu_two_tiles_per_block_on_many_tiles(given):
    m_splits = [1500, 0, 37, 2200, 511, 64, 900, 1]           # 5213 rows, 56 tile columns
    xs = make_inputs(m_splits, 7168, "bfloat16", seed=9)
    scale = scales_for(m_splits, "e4m3", 9) if given else None
    cuda_vs_reference(xs, m_splits, "tensor", "bfloat16", scale=scale, align=16)
