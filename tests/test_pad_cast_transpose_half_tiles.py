"""The per-tensor cast kernel with half tiles (``set_half_tiles(True)``).

An expert's last tile row of at most 32 rows (``m_pad % 64`` in 1..32, or an empty expert) is
then a row of half tiles, 32 rows x 256 columns: a half tile holds rows 0..31 of two
neighbouring 128-column tiles, the second one's in its tile rows 32..63, so a block does a full
tile's bytes where it did half a tile's. The bits are the reference's whatever the tiling (the
amax is a maximum; column sums, ordered by 64-row tiles, never use half tiles), so the emulated
kernel must give them on every pass, with host or device splits (the blocks then derive the
tile lists themselves), over several chunks, and the grids must shrink by the documented rule.
Half tiles are an instantiation of their own (HALF): the variants without one (column sums,
the gather, the activation) keep 64-row tiles, and two tiles per block gives way to them.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import cugrouped
from cugrouped import reference
from cugrouped.emulate.access import trace_accesses
from cugrouped._array import DeviceLikeHost
from cugrouped.ops import pad_cast_transpose as pct

from test_emulate_access import cast_inputs
from test_pad_cast_transpose import (ORDERS, SPLITS, assert_same_bits, make_inputs, run_both,
                                     scales_for)
from test_pad_cast_transpose_tiles import assert_amax_options_as_the_reference, cuda_vs_reference

# Beside the split taxonomy: half tiles whose two columns are both inside k (k = 512: the
# full-tile loads), an odd number of tile columns (the last half tile's second column is past
# k), and a k that ends inside a tile; every last-row length 1..64 between them.
HALF_SPLITS = {
    "even_k": ([0, 20, 33, 64, 96, 100, 16, 130], 512),
    "odd_k": ([0, 200, 64, 130, 77, 1], 384),
    "ragged_k": ([5, 40, 70, 0, 31], 300),
    "long": ([300, 257, 129], 256),
}
ALL_SPLITS = {**SPLITS, **HALF_SPLITS}


@contextlib.contextmanager
def half_tiles(on: bool = True):
    old = pct.set_half_tiles(on)
    try:
        yield
    finally:
        pct.set_half_tiles(old)


def expected_tiles(m_splits, k, align):
    """Tiles per expert by the rule, spelt out: whole 64-row tile rows, and a last row of at
    most 32 rows (an empty expert's: none) as ceil(tiles_k / 2) half tiles."""
    tiles_k = -(-k // 128)
    out = []
    for m in m_splits:
        m_pad = -(-m // align) * align
        full, last = divmod(m_pad, 64)
        if last == 0 and m_pad > 0:
            out.append(full * tiles_k)
        elif 0 < last <= 32 or m_pad == 0:
            out.append(full * tiles_k + -(-tiles_k // 2))
        else:
            out.append((full + 1) * tiles_k)
    return tuple(out)


@pytest.mark.parametrize("align", [1, 16, 32, 128])
@pytest.mark.parametrize("split", sorted(ALL_SPLITS))
def test_tile_counts_follow_the_rule(split, align):
    m_splits, k = ALL_SPLITS[split]
    half = pct.tile_counts(m_splits, k, align, half=True)
    assert half == expected_tiles(m_splits, k, align)
    full = pct.tile_counts(m_splits, k, align)
    assert all(h <= f for h, f in zip(half, full))      # the device grid's bound still holds
    bound = pct.plan_launches_device(len(m_splits), sum(m_splits), k, align)[0].grid
    assert sum(half) <= bound


def test_tile_counts_by_hand():
    # k = 384: 3 tile columns, 2 half tiles; m_pad 0, 16, 32 (half), 48, 64 (full), 80 (1 + half)
    assert pct.tile_counts([0, 16, 32, 48, 64, 80], 384, 16, half=True) == (2, 2, 2, 3, 3, 5)
    assert pct.tile_counts([0, 16, 32, 48, 64, 80], 384, 16) == (3, 3, 3, 3, 3, 6)
    assert pct.tile_counts([0, 1], 100, 1, half=True) == (1, 1)     # one column: one half tile


@pytest.mark.parametrize("split", sorted(ALL_SPLITS))
@pytest.mark.parametrize("given", [True, False])
@pytest.mark.parametrize("form,dtype,fmt,align", [("tensor", "bfloat16", "e4m3", 16),
                                                  ("list", "float16", "e5m2", 1),
                                                  ("device", "float32", "e4m3", 32)])
def test_half_tiles_give_the_reference_bits(split, given, form, dtype, fmt, align):
    m_splits, k = ALL_SPLITS[split]
    xs = make_inputs(m_splits, k, dtype, seed=len(split), specials=split == "skewed")
    scale = scales_for(m_splits, fmt, 2) if given else None
    order = ORDERS[(len(split) + given) % len(ORDERS)]
    with half_tiles(), cugrouped.emulation_order(order), cugrouped.record_launches() as log:
        got, want = run_both(xs, m_splits, form, scale=scale, fp8_format=fmt, align=align)
    assert_same_bits(got, want, f"{split} given={given} {form}")
    assert len(log) == (1 if given else 2)
    assert all(launch.kernel.endswith(", 1, true>") for launch in log)
    if form != "device":    # (device splits: the grid is the bound, surplus blocks exit)
        assert {launch.grid for launch in log} == {sum(expected_tiles(m_splits, k, align))}


def test_half_tiles_take_precedence_over_two_tiles_per_block():
    m_splits, k = HALF_SPLITS["odd_k"]
    xs = make_inputs(m_splits, k, "bfloat16", seed=4)
    old = pct.set_tiles_per_block(2)
    try:
        with half_tiles(), cugrouped.record_launches() as log:
            got, want = run_both(xs, m_splits, "tensor", align=16)
    finally:
        pct.set_tiles_per_block(old)
    assert_same_bits(got, want, "two per block asked for")
    assert [launch.grid for launch in log] == [sum(expected_tiles(m_splits, k, 16))] * 2
    assert all(launch.kernel.endswith(", 1, true>") for launch in log)


def test_the_gather_and_the_activation_keep_64_row_tiles():
    from test_pad_cast_transpose import _permuted, _routing
    from test_pad_cast_transpose_swiglu import gated_inputs
    from test_pad_cast_transpose_swiglu import run_both as run_both_swiglu

    m_splits, T, k = [0, 20, 33, 70, 9], 60, 384
    tokens = make_inputs([T], k, "bfloat16", seed=5)[0]
    idx = _routing(T, m_splits, seed=5)
    want = reference.multi_pad_cast_transpose(_permuted(tokens, idx), m_splits)
    full = sum(pct.tile_counts(m_splits, k, 16))
    for splits in (m_splits, np.array(m_splits, np.int64)):
        with half_tiles(), cugrouped.record_launches() as log:
            got = cugrouped.multi_pad_cast_transpose(tokens, splits, row_index=idx,
                                                     backend="emulate")
        assert_same_bits(got, want, f"gather, {type(splits).__name__}")
        assert all(launch.kernel.endswith(", false, true>") for launch in log)   # the gather's
        if isinstance(splits, list):
            assert {launch.grid for launch in log} == {full}
    xs = gated_inputs(m_splits, 256, "bfloat16", seed=6, specials=True)
    for form in ("list", "device"):
        with half_tiles(), cugrouped.record_launches() as log:
            got, want = run_both_swiglu(xs, m_splits, form, scale=scales_for(m_splits, "e4m3", 6))
        assert_same_bits(got, want, f"swiglu, {form}")
        assert all("Act::SWIGLU>" in launch.kernel for launch in log)


def test_column_sums_keep_64_row_tiles():
    """Column sums are ordered by 64-row tiles: a cast that takes them has no half tiles in
    either pass (both passes of current scaling share one tile list)."""
    m_splits, k = HALF_SPLITS["even_k"]
    xs = make_inputs(m_splits, k, "float32", seed=7)
    for given in (True, False):
        scale = scales_for(m_splits, "e4m3", 7) if given else None
        with half_tiles(), cugrouped.record_launches() as log:
            got, want = run_both(xs, m_splits, "tensor", scale=scale, column_sums=True)
        assert_same_bits(got, want, f"column sums, given={given}")
        assert {launch.grid for launch in log} == {sum(pct.tile_counts(m_splits, k, 16))}


def test_half_tiles_over_chunks_and_the_amax_options():
    m_splits = [(i * 7) % 45 for i in range(pct.MAX_EXPERTS_PER_LAUNCH + 5)]
    xs = make_inputs(m_splits, 272, "float16", seed=8)
    with half_tiles():
        for form in ("tensor", "device"):
            for scale in (scales_for(m_splits, "e5m2", 3), None):
                got, want = run_both(xs, m_splits, form, align=32, scale=scale, fp8_format="e5m2")
                assert_same_bits(got, want, f"two chunks, {form}, given={scale is not None}")
        assert_amax_options_as_the_reference()


def test_the_setting_is_a_bool_and_changes_no_plan_in_the_cache():
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="on: expected a bool"):
            pct.set_half_tiles(bad)
    assert pct.half_tiles() is False
    m_splits, k = [20, 0, 90], 512
    before = pct.plan_launches(m_splits, k, 16)
    with half_tiles():
        assert pct.plan_launches(m_splits, k, 16) == before     # a plan asks for half tiles
        assert pct.plan_launches(m_splits, k, 16, half=True)[0].grid == 2 + 2 + 4 + 2
    assert pct.half_tiles() is False


def test_half_tile_names_exist_only_where_instantiated():
    assert pct.kernel_name("float32", "e5m2", "AMAX_ONLY", half=True) in \
        pct.HALF_KERNEL_SPEC.name_expressions
    assert len(pct.HALF_KERNEL_SPEC.name_expressions) == 18
    for kw in (dict(column_sums=True), dict(gather=True), dict(activation="swiglu"),
               dict(tpb=2)):
        with pytest.raises(ValueError, match="half: half tiles exist without"):
            pct.kernel_name("bfloat16", "e4m3", "CAST_AMAX", half=True, **kw)


# ---- memory accesses -----------------------------------------------------------------------

def test_half_tiles_keep_the_access_pattern():
    """Half tiles load like full ones (one 16-byte site, each input byte from DRAM once), store
    the row-wise bytes in whole sectors and the transposed ones in 32-row runs, with no
    shared-memory bank conflict; and there are fewer blocks."""
    m_splits, k = (20, 0, 161, 90, 33, 64), 512
    xs = cast_inputs(k=k, splits=m_splits)
    with half_tiles(), trace_accesses() as tr:
        res = cugrouped.multi_pad_cast_transpose(xs, scale=np.full(len(xs), 2.0, np.float32),
                                                 backend="emulate")
    sites, report = tr.sites(), tr.report()
    assert tr.launches[0].grid[0] == sum(expected_tiles(m_splits, k, 16)) \
        < sum(pct.tile_counts(m_splits, k, 16))
    assert not [s for s in sites if s.space == "shared" and s.units != s.ideal], report
    loads = [s for s in sites if s.space == "global" and s.kind == "load" and s.size == 16]
    assert len(loads) == 1, report
    read = tr.launches[0].global_sectors()["read"]
    in_sectors = sum(x.nbytes for x in xs) // 32
    assert in_sectors <= read <= in_sectors * 1.03 + 8, report
    row = [s for s in sites if s.space == "global" and s.kind == "store" and s.size == 16
           and s.bytes == res.data.nbytes]
    col = [s for s in sites if s.space == "global" and s.kind == "store" and s.size == 16
           and s.bytes == res.data_t.nbytes]
    assert len(row) == 1 and row[0].efficiency == 1.0, report
    assert len(col) == 1 and col[0].efficiency > 0.75, report


@pytest.mark.parametrize("half", [False, True])
def test_an_empty_expert_reads_no_row(half):
    """An empty expert's tiles (they write its amax and scale_inv) read nothing of its input:
    the full-tile path reads row m - 1 again for rows past m, which for m = 0 is the row before
    its pointer (on a GPU, a torch tensor of no rows has a null pointer); it reads the kernel's
    64 zero bytes (kZeroSegment) instead."""
    m_splits, k = (0, 70, 0), 256
    xs = cast_inputs(k=k, splits=m_splits)
    scale = DeviceLikeHost.empty((3,), np.float32)
    scale[...] = 2.0
    with half_tiles(half), trace_accesses() as tr:
        cugrouped.multi_pad_cast_transpose(xs, scale=scale, backend="emulate")
    r = tr.launches[0].records
    loads = r[(r["space"] == 0) & (r["kind"] == 0)]
    spans = [(x.ctypes.data, x.ctypes.data + x.nbytes) for x in xs if x.nbytes] + \
        [(scale.ctypes.data, scale.ctypes.data + scale.nbytes)]
    addr, end = loads["addr"].astype(np.int64), (loads["addr"] + loads["size"]).astype(np.int64)
    inside = np.zeros(len(loads), bool)
    for lo, hi in spans:
        inside |= (addr >= lo) & (end <= hi)
    outside = addr[~inside]
    assert outside.size, "the empty experts' tiles read kZeroSegment"
    assert end[~inside].max() - outside.min() <= 64, \
        f"{outside.size} loads outside the inputs, the scales and one 64-byte segment"


def _loads_just_before(tr, arrays, window=4096):
    """Loads of the traced launches in the ``window`` bytes before each array's first byte
    (and not inside one of ``arrays``): what reading row -1, or index -1, of an empty expert
    whose pointer is that array's would touch."""
    spans = [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays]
    n = 0
    for launch in tr.launches:
        r = launch.records
        r = r[(r["space"] == 0) & (r["kind"] == 0)]
        addr = r["addr"].astype(np.int64)
        inside = np.zeros(len(r), bool)
        for lo, hi in spans:
            inside |= (addr >= lo) & (addr < hi)
        for lo, _ in spans:
            n += int(((addr >= lo - window) & (addr < lo) & ~inside).sum())
    return n


@pytest.mark.parametrize("splits_on_device", [False, True])
def test_an_empty_experts_gather_reads_no_index_before_its_own(splits_on_device):
    """The gather's full-tile loads read the row index of row m - 1 for rows past m: for an
    empty expert first in the list that is ``row_index[-1]``; its index array is ``kNoRow``
    (one index that reads as a zero row) instead."""
    m_splits, T, k = [0, 20, 0], 30, 256
    tokens = cast_inputs(k=k, splits=(T,))[0]
    idx = DeviceLikeHost.empty((20,), np.int64)
    idx[...] = np.arange(20) % T
    splits = np.array(m_splits, np.int64) if splits_on_device else m_splits
    scale = DeviceLikeHost.empty((3,), np.float32)
    scale[...] = 2.0
    with trace_accesses() as tr:
        got = cugrouped.multi_pad_cast_transpose(tokens, splits, row_index=idx, scale=scale,
                                                 splits_on_device=splits_on_device or None,
                                                 backend="emulate")
    assert _loads_just_before(tr, [tokens, idx, scale]) == 0
    want = reference.multi_pad_cast_transpose(np.asarray(tokens)[np.asarray(idx)], m_splits,
                                              scale=np.asarray(scale))
    assert np.array_equal(np.asarray(got.amax), np.asarray(want.amax))


def test_an_empty_expert_of_the_activation_reads_no_row():
    """The gated activation's full-tile loads ([a | b], two per segment) select kZeroSegment for
    both halves of an empty expert."""
    xs = cast_inputs(k=512, splits=(0, 40, 0))                # [a | b], 256 columns out
    scale = DeviceLikeHost.empty((3,), np.float32)
    scale[...] = 2.0
    with trace_accesses() as tr:
        cugrouped.multi_pad_cast_transpose(xs, scale=scale, activation="swiglu",
                                           backend="emulate")
    assert _loads_just_before(tr, [x for x in xs if x.nbytes] + [scale]) == 0
    # (an empty array's own pointer: row -1 of it is the window before it)
    for x in xs:
        if not x.nbytes:
            assert _loads_just_before(tr, [x], window=512 * 2) == 0


# ---- on a GPU (skipped here; run by scripts/gpu_check.sh) --------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("split", sorted(ALL_SPLITS))
@pytest.mark.parametrize("given", [True, False])
@pytest.mark.parametrize("form,dtype", [("list", "float16"), ("tensor", "bfloat16"),
                                        ("device", "float32")])
def test_gpu_half_tiles_match_the_reference(split, given, form, dtype):
    m_splits, k = ALL_SPLITS[split]
    xs = make_inputs(m_splits, k, dtype, seed=len(split), specials=split == "skewed")
    scale = scales_for(m_splits, "e4m3", 2) if given else None
    cuda_vs_reference(xs, m_splits, form, dtype, half_tiles, ", 1, true>", scale=scale,
                      align=16)


@pytest.mark.gpu
@pytest.mark.parametrize("given", [True, False])
def test_gpu_half_tiles_on_many_tiles(given):
    m_splits = [1500, 0, 37, 2200, 511, 64, 900, 1, 20, 33]   # 56 tile columns, 6 half rows
    xs = make_inputs(m_splits, 7168, "bfloat16", seed=9)
    scale = scales_for(m_splits, "e4m3", 9) if given else None
    cuda_vs_reference(xs, m_splits, "tensor", "bfloat16", half_tiles, ", 1, true>",
                      scale=scale, align=16)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_the_torch_layer_trains_the_same_with_half_tiles(recipe):
    """GroupedLinear's casts (x and dy; no bias, so dy's cast has no column sums and takes half
    tiles too) under set_half_tiles(True): the same outputs and gradients, bit for bit, with the
    emulated kernels, and the half-tile kernels did run."""
    torch = pytest.importorskip("torch")
    from cugrouped.pytorch import (DelayedScaling, Float8CurrentScaling, GroupedLinear,
                                   cpu_cast_backend, fp8_autocast)

    def step(half):
        torch.manual_seed(0)
        layer = GroupedLinear(4, 256, 32, bias=False, device="cpu")
        x = torch.randn(70, 256, requires_grad=True)
        rec = Float8CurrentScaling() if recipe == "current" else DelayedScaling()
        with half_tiles(half), cpu_cast_backend("emulate"), fp8_autocast(fp8_recipe=rec), \
                cugrouped.record_launches() as log:
            y = layer(x, [20, 0, 33, 17])
            y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        kernels = [launch.kernel for launch in log]
        return [y.detach(), x.grad] + [w.grad for w in layer.weights()], kernels

    want, plain = step(False)
    got, kernels = step(True)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert any(n.endswith(", 1, true>") for n in kernels)
    assert not any(n.endswith(", 1, true>") for n in plain)
