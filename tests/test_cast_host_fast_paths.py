"""The cast ops' host fast paths against the general ones they stand in for.

The host side of a cast call takes shortcuts for the common case (a list of arrays of one kind,
dtype and layout read without a view object per array). Each one must give exactly what the
general path gives, and leave everything it cannot vouch for to the general path, which raises
the errors the other tests pin. Here both run on many random inputs and are compared field by
field, exceptions by type and message.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cugrouped.ops import _cast_inputs

torch = pytest.importorskip("torch")

_NP_DTYPES = (np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.uint16)
_TORCH_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32)


def _numpy_array(rng, rows, k, dtype):
    """A ``(rows, k)`` array of a random layout: contiguous, rows further apart, a column
    stride, reversed rows, transposed, or strides off the item size."""
    layout = rng.integers(0, 8) if rng.random() < 0.1 else rng.integers(0, 2)
    if layout == 1:
        return np.zeros((rows, k + 3), dtype)[:, :k]
    if layout == 2:
        return np.zeros((rows, 2 * k), dtype)[:, ::2]
    if layout == 3:
        return np.zeros((rows, k), dtype)[::-1]
    if layout == 4:
        return np.zeros((k, rows), dtype).T
    if layout == 5:      # byte strides that are no multiple of the item size
        isz = np.dtype(dtype).itemsize
        if isz > 1 and rows > 1:
            raw = np.zeros((rows * (k * isz + 1) // isz + 1) * isz, np.uint8)
            return np.lib.stride_tricks.as_strided(raw.view(dtype), shape=(rows, k),
                                                   strides=(k * isz + 1, isz))
    return np.zeros((rows, k), dtype)


def _random_list(rng, kind):
    """Mostly uniform lists (the fast path's case) with now and then one odd array: another
    dtype, kind, k or rank, a layout the kernels cannot read, a NumPy subclass."""
    E = int(rng.choice([1, 2, 5, 65]))
    k = int(rng.choice([1, 2, 16, 48]))
    dtypes = _NP_DTYPES if kind == "numpy" else _TORCH_DTYPES
    dt = dtypes[0] if rng.random() < 0.6 else dtypes[int(rng.integers(len(dtypes)))]
    odd = int(rng.integers(E)) if rng.random() < 0.5 else -1
    xs = []
    for i in range(E):
        rows = int(rng.choice([0, 1, 2, 7]))
        a = _numpy_array(rng, rows, k, dt if kind == "numpy" else np.float32) \
            if i != odd or rng.random() < 0.5 else _numpy_array(rng, rows, k, np.float32)
        if i == odd:
            change = rng.integers(0, 7)
            if change == 0:
                a = _numpy_array(rng, rows, k + 1, np.float32)
            elif change == 1:
                a = np.zeros((rows, k, 1), np.float32) if rng.random() < 0.5 else \
                    np.zeros(k, np.float32)
            elif change == 2 and kind == "numpy":
                a = np.asmatrix(np.zeros((rows, k), dt))
            elif change == 3:
                a = np.zeros((rows, k), np.float16)
        if kind == "torch":
            t = torch.from_numpy(np.ascontiguousarray(a)) if a.strides and min(a.strides) >= 0 \
                and all(s % a.itemsize == 0 for s in a.strides) else torch.zeros(a.shape)
            t = t.to(dt) if t.dtype.is_floating_point and dt.is_floating_point and i != odd else t
            if rng.random() < 0.2 and t.dim() == 2:          # a column stride, rows apart
                t = torch.zeros((t.shape[0], 2 * t.shape[1]), dtype=t.dtype)[:, ::2]
            if i == odd and rng.random() < 0.3 and t.dim() == 2:   # rows that overlap
                t = torch.zeros(rows * k + k, dtype=t.dtype).as_strided((rows, k), (k // 2, 1))
            if i == odd and rng.random() < 0.2:               # another device
                t = torch.zeros(t.shape, dtype=t.dtype, device="meta")
            xs.append(t if i != odd or rng.random() < 0.7 else np.zeros((rows, k), np.float32))
        else:
            xs.append(a)
    return xs


def _outcome(fn):
    try:
        return fn()
    except (TypeError, ValueError) as err:
        return (type(err), str(err))


def _same(got, want):
    if isinstance(want, tuple):          # an error: same type, same message
        assert got == want
        return
    assert isinstance(got, _cast_inputs.GroupedInput)
    for f in ("m_splits", "k", "dtype", "on_device", "kind", "device", "total_rows",
              "num_experts", "src_rows"):
        assert getattr(got, f) == getattr(want, f), f
    assert all(type(v) is int for v in got.m_splits)
    assert got.base.owner is want.base.owner
    assert (got.base.ptr, got.base.shape, got.base.strides, got.base.dtype) == \
        (want.base.ptr, want.base.shape, want.base.strides, want.base.dtype)
    for f in ("ptrs", "lds"):
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and np.array_equal(a, b), f


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")     # np.asmatrix
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_list_fast_path_gives_the_general_paths_result_or_error(kind):
    rng = np.random.default_rng(11)
    fast_taken = 0
    for trial in range(600):
        xs = _random_list(rng, kind)
        tag = "bfloat16" if kind == "numpy" and rng.random() < 0.2 else None
        m_splits = None
        if rng.random() < 0.2:
            m_splits = [getattr(x, "shape", (0,))[0] for x in xs]
            if rng.random() < 0.5:
                m_splits[0] += 1
        got = _outcome(lambda: _cast_inputs.normalize_inputs(xs, m_splits, tag))
        want = _outcome(lambda: _cast_inputs._normalize_list(xs, m_splits, tag))
        _same(got, want)
        first = _outcome(lambda: _cast_inputs.as_view(xs[0], dtype=tag, arg="inputs[0]"))
        if not isinstance(first, tuple) and _cast_inputs._uniform_rows(xs, first) is not None:
            fast_taken += 1
    assert fast_taken > 150       # the fast path is exercised, not only its refusals


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_list_fast_path_reads_uniform_lists(kind):
    """The common case takes the fast path: experts of one kind and dtype, empty ones included,
    rows further apart than k."""
    base = np.zeros((40, 24), np.float32)
    xs = [base[0:0, :16], base[0:7, :16], base[7:8, :16], base[8:40, :16]]
    if kind == "torch":
        xs = [torch.from_numpy(base)[0:0, :16], torch.from_numpy(base)[0:7, :16],
              torch.from_numpy(base)[7:8, :16], torch.from_numpy(base)[8:40, :16]]
    first = _cast_inputs.as_view(xs[0], arg="inputs[0]")
    assert _cast_inputs._uniform_rows(xs, first) is not None
    _same(_cast_inputs.normalize_inputs(xs), _cast_inputs._normalize_list(xs, None, None))


# ---------------------------------------------------------------------------------------------
# Launch planning and argument packing against their earlier code, kept here verbatim (as of
# 89f95d0, before the host path was made cheaper): the same plans (values and int types) and
# the same argument bytes on random split patterns.

from cugrouped.grouped_block_fp8 import block_scale_sizes  # noqa: E402
from cugrouped.ops import _launch  # noqa: E402
from cugrouped.ops import block_cast_transpose as bct  # noqa: E402
from cugrouped.ops import pad_cast_transpose as pct  # noqa: E402


def _old_padded(m_splits, align):
    return tuple(-(-int(m) // align) * align for m in m_splits)


def _old_tile_counts(m_splits, k, align):
    tiles_k = -(-k // pct.TILE_K)
    return tuple(max(1, -(-mp // pct.TILE_M)) * tiles_k for mp in _old_padded(m_splits, align))


def _old_chunks_of_tiles(tiles, max_experts):
    plans = []
    for first in range(0, len(tiles), max_experts):
        chunk = tiles[first:first + max_experts]
        start = tuple(int(v) for v in np.concatenate([[0], np.cumsum(chunk, dtype=np.int64)]))
        if start[-1] >= 2**31:
            raise ValueError(f"too many tiles ({start[-1]}) for one launch")
        plans.append(_launch.ChunkLaunch(first, len(chunk), start, start[-1]))
    return tuple(plans)


def _old_plan(m_splits, k, align, max_experts):
    m = tuple(int(v) for v in m_splits)
    return list(_old_chunks_of_tiles(_old_tile_counts(m, k, align), max_experts))


def _old_block_plan(m_splits, k, max_experts):
    tiles_k = -(-k // 128)
    tiles = tuple(-(-int(m) // 128) * tiles_k for m in m_splits)
    return list(_old_chunks_of_tiles(tiles, max_experts))


def _old_pointer_offsets(base, sizes, itemsize, like):
    if not base:
        return np.zeros_like(like)
    first = np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64)])
    return np.uint64(base) + (first * itemsize).astype(np.uint64)


def _old_split_pointers(splits, ptr, ld, itemsize):
    first_rows = np.concatenate([[0], np.cumsum(splits[:-1], dtype=np.int64)])
    ptrs = np.uint64(ptr) + (first_rows * (ld * itemsize)).astype(np.uint64)
    return ptrs, np.full(len(splits), ld, dtype=np.int64)


def _old_pack_groups(g, row_ptr, col_ptr, plans, align):
    m = np.asarray(g.m_splits, dtype=np.int64)
    out_row = _old_pointer_offsets(row_ptr, m * g.k, 1, g.ptrs)
    out_col = _old_pointer_offsets(col_ptr, (m + (align - 1)) // align * align * g.k, 1, g.ptrs)
    fields = {"in": g.ptrs, "ld": g.lds, "m": m, "out_row": out_row, "out_col": out_col}
    if g.row_index is None:
        return _launch.pack_chunks(pct.group_dtype(), plans, fields)
    row_first = np.concatenate([[0], np.cumsum(m[:-1])])
    return _launch.pack_chunks(pct.group_dtype(), plans, {**fields, "row_first": row_first},
                               lambda chunk: {"row_index": g.row_index.ptr,
                                              "src_rows": g.src_rows})


def _old_block_pack(g, bufs, plans, align, dims):
    data, data_t, sinv, sinv_t = bufs
    m = np.asarray(g.m_splits, dtype=np.int64)
    mp = np.asarray(_old_padded(g.m_splits, align), dtype=np.int64)
    srow, scol = block_scale_sizes(g.m_splits, mp, g.k, dims)
    si = 1 if dims == 3 else 4
    fields = {"in": g.ptrs, "ld": g.lds, "m": m,
              "out_row": _old_pointer_offsets(data, m * g.k, 1, g.ptrs),
              "out_col": _old_pointer_offsets(data_t, mp * g.k, 1, g.ptrs),
              "sinv_row": _old_pointer_offsets(sinv, srow, si, g.ptrs),
              "sinv_col": _old_pointer_offsets(sinv_t, scol, si, g.ptrs)}

    def gather(chunk):
        if g.row_index is None:
            return {}
        return {"row_index": g.row_index.ptr, "src_rows": g.src_rows,
                "row_first0": int(m[: chunk.first].sum())}

    return _launch.pack_chunks(bct.group_dtype(), plans, fields, gather)


def _random_splits(rng):
    E = int(rng.choice([1, 2, 3, 8, 63, 64, 65, 128, 129, 200, 256]))
    shape = rng.integers(0, 7)
    if shape == 0:
        m = rng.integers(0, 3000, E)
    elif shape == 1:                          # many empty experts, first and last among them
        m = rng.integers(0, 200, E) * (rng.random(E) < 0.3)
        m[0] = m[-1] = 0
    elif shape == 2:
        m = np.zeros(E, np.int64)
    elif shape == 3:                          # offsets past 2^31 bytes
        m = rng.integers(2**20, 2**22, E)
    elif shape == 4:                          # with k = 4096, grids past 2^31 blocks
        m = rng.integers(2**24, 2**27, E)
    else:
        m = rng.integers(0, 130, E)
    return [int(v) for v in m]


class _Handle:
    def __init__(self, ptr):
        self.ptr = ptr


def _same_plans(got, want):
    assert got == want
    for c in got:
        assert all(type(v) is int for v in c.tile_start) and type(c.grid) is int
        assert type(c.first) is int and type(c.count) is int


def _same_args(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert type(a) is np.ndarray and a.shape == () and a.dtype == b.dtype
        assert a.tobytes() == b.tobytes()


def test_plans_and_argument_blocks_are_the_earlier_codes():
    rng = np.random.default_rng(7)
    for trial in range(300):
        m = _random_splits(rng)
        E = len(m)
        k = int(rng.choice([1, 100, 128, 129, 4096]))
        align = int(rng.choice([1, 16, 32, 128]))
        max_experts = int(rng.choice([64, 64, 3]))
        form = rng.integers(0, 3)           # tensor, list (any pointers), gather
        base = int(rng.choice([0x7F00_0000_0000, 2**63 - 2**40, 2**64 - 2**44]))
        if form == 1:
            ptrs = np.array(rng.integers(0, 2**62, E), dtype=np.uint64) + np.uint64(base)
            lds = np.array(rng.integers(k, 2 * k + 1, E), dtype=np.int64)
        else:
            ptrs, lds = _cast_inputs._split_pointers(tuple(m), base, k + 3, 2)
            old_ptrs, old_lds = _old_split_pointers(tuple(m), base, k + 3, 2)
            assert ptrs.tobytes() == old_ptrs.tobytes() and lds.tobytes() == old_lds.tobytes()
        g = _cast_inputs.GroupedInput(
            None, tuple(m), k, "bfloat16", True, "torch", 0, sum(m), E, ptrs, lds,
            row_index=_Handle(base + 4096) if form == 2 else None,
            src_rows=int(rng.integers(1, 10**6)) if form == 2 else 0)

        assert pct.padded_splits(m, align) == _old_padded(m, align)
        assert pct.tile_counts(m, k, align) == _old_tile_counts(m, k, align)
        try:
            plans = pct.plan_launches(m, k, align, max_experts)
        except ValueError as err:
            with pytest.raises(ValueError, match=str(err).replace("(", r"\(").replace(")", r"\)")):
                _old_plan(m, k, align, max_experts)
            continue
        _same_plans(plans, _old_plan(m, k, align, max_experts))
        out = (int(rng.choice([0, base + 2**33])), int(rng.choice([0, 2**64 - 2**43])))
        _same_args(pct._pack_groups(g, out, plans, align),
                   _old_pack_groups(g, *out, plans, align))

        if form == 2 and trial % 2:
            continue
        for dims in (1, 2, 3):
            balign = int(rng.choice([1, 16, 32, 128]))
            bplans = bct.plan_block_launches(m, k, max_experts)
            _same_plans(bplans, _old_block_plan(m, k, max_experts))
            bufs = tuple(int(rng.choice([0, base + 2**34 * (i + 1)])) for i in range(4))
            _same_args(bct._pack_groups(g, bufs, bplans, balign, dims),
                       _old_block_pack(g, bufs, bplans, balign, dims))


@pytest.mark.parametrize("m", [[3, 5], (3, 5), np.array([3, 5]), (np.int64(3), 5), [True, 5.9],
                               [-64, -1, 0, 65]])
@pytest.mark.parametrize("align", [16, np.int64(16), 1])
def test_planning_takes_any_int_likes_as_before(m, align):
    """Splits that are not a tuple of ints (the public functions take any sequence) are
    converted as before; a NumPy ``align`` gives the same types as before."""
    for f in (pct._padded, pct._plan_cached, bct._plan_cached):
        f.cache_clear()
    got = pct.padded_splits(m, align)
    want = _old_padded(m, align)
    assert got == want and [type(v) for v in got] == [type(v) for v in want]
    got = pct.tile_counts(m, 130, align)
    want = _old_tile_counts(m, 130, align)
    assert got == want and [type(v) for v in got] == [type(v) for v in want]
    if min(int(v) for v in m) >= 0:
        _same_plans(pct.plan_launches(m, 130, align, 1), _old_plan(m, 130, align, 1))
        _same_plans(bct.plan_block_launches(m, 130, 1), _old_block_plan(m, 130, 1))
