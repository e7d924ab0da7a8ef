"""Memory access tracing of emulated kernels (cugrouped.emulate.access): the sectors and bank
wavefronts of hand-counted access patterns, the vectorized analysis against a plain-Python
twin, what is and is not recorded, and the properties the cast kernels must keep (shared memory
free of bank conflicts, full-sector row-wise stores, every input byte read from DRAM once).
"""

from __future__ import annotations

import collections
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import cugrouped as cg
from cugrouped._array import DeviceLikeHost
from cugrouped.emulate import EmuModule
from cugrouped.emulate.access import RECORD, LaunchTrace, trace_accesses

KDIR = Path(__file__).resolve().parent / "emulate_kernels"
SOURCE = KDIR / "access_patterns.cu"
BLOCKS, THREADS = 2, 64
N = BLOCKS * THREADS
REQUESTS = BLOCKS * THREADS // 32


def line_of(marker: str) -> str:
    for i, text in enumerate(SOURCE.read_text().splitlines(), 1):
        if f"// {marker}" in text:
            return f"access_patterns.cu:{i}"
    raise AssertionError(marker)


def aligned(n: int, dtype, fill=0) -> np.ndarray:
    """A 1-D array placed like a device allocation (sector counts depend on it)."""
    a = DeviceLikeHost.empty(n, dtype)
    a[:] = fill
    return a


@pytest.fixture(scope="module")
def patterns():
    # one worker, as traced launches run: the pattern kernels race on purpose (a shared array
    # written twice, the second put() of block 1 landing in block 0's rows of y), so with two
    # OS threads the plain run's bits could depend on which block finished last
    return EmuModule(path="access_patterns.cu", include_dirs=(KDIR,), workers=1,
                     name_expressions=("global_patterns", "shared_patterns"))


def by_line(trace):
    out = collections.defaultdict(list)
    for s in trace.sites():
        out[s.location.rsplit("/", 1)[-1]].append(s)
    return out


def run_global(mod):
    x = aligned(N, np.float32)
    x[:] = np.arange(N)
    y, z = aligned(8 * N, np.float32), aligned(3 * N + 48, np.float32)
    bcast, counter = aligned(1, np.float32, 0.5), aligned(1, np.uint32)
    mod.get_function("global_patterns")((BLOCKS,), (THREADS,),
                                        (x, y, z, bcast, np.int32(N), counter))
    return y, z, counter


def run_shared(mod):
    x = aligned(N, np.float32)
    x[:] = np.arange(N) * 0.25
    y = aligned(N, np.float32)
    mod.get_function("shared_patterns")((BLOCKS,), (THREADS,), (x, y), shared_mem=4 * THREADS)
    return y


def test_global_sectors_by_hand(patterns):
    with trace_accesses() as tr:
        run_global(patterns)
    assert [t.kernel for t in tr.launches] == ["global_patterns"]
    sites = by_line(tr)
    # (space, kind, bytes per lane, requests, distinct bytes, sectors, fewest sectors)
    expect = {
        "@coalesced": ("global", "load", 4, REQUESTS, 4 * N, 4 * REQUESTS, 4 * REQUESTS),
        "@broadcast": ("global", "load", 4, REQUESTS, 4 * REQUESTS, REQUESTS, REQUESTS),
        "@strided": ("global", "store", 4, REQUESTS, 4 * N, 32 * REQUESTS, 4 * REQUESTS),
        "@misaligned": ("global", "store", 4, REQUESTS, 4 * N, 5 * REQUESTS, 4 * REQUESTS),
        "@vec16": ("global", "load", 16, REQUESTS, 4 * N, 4 * REQUESTS, 4 * REQUESTS),
        "@withlocal": ("global", "store", 4, REQUESTS, 4 * N, 4 * REQUESTS, 4 * REQUESTS),
        "@atomic": ("global", "atomic", 4, REQUESTS, 4 * REQUESTS, REQUESTS, REQUESTS),
    }
    for marker, want in expect.items():
        (s,) = sites[line_of(marker)]
        assert (s.space, s.kind, s.size, s.requests, s.bytes, s.units, s.ideal) == want, marker
    assert sites[line_of("@strided")][0].efficiency == 0.125
    assert sites[line_of("@coalesced")][0].efficiency == 1.0
    # the loop filling local[] (a fiber's stack) is not memory traffic; threadIdx reads neither
    assert not any("local[j]" in SOURCE.read_text().splitlines()[int(k.split(":")[1]) - 1]
                   for k in sites)
    reads = tr.launches[0].global_sectors()
    # x (512 B: 16 sectors), bcast (1), the atomic's counter (1)
    assert reads["read"] == 4 * N // 32 + 1 + 1


def test_shared_wavefronts_by_hand(patterns):
    with trace_accesses() as tr:
        run_shared(patterns)
    sites = by_line(tr)
    # (kind, bytes per lane, wavefronts, fewest wavefronts) over all requests
    expect = {
        "@padded": ("store", 4, REQUESTS, REQUESTS),
        "@square": ("store", 4, 32 * REQUESTS, REQUESTS),
        "@row": ("store", 4, REQUESTS, REQUESTS),
        "@float2": ("store", 8, 2 * REQUESTS, 2 * REQUESTS),
        "@float4": ("store", 16, 4 * REQUESTS, 4 * REQUESTS),
        "@float4stride": ("store", 16, 8 * REQUESTS, 4 * REQUESTS),
        "@bytes": ("store", 1, REQUESTS, REQUESTS),
        "@bcastsmem": ("load", 4, REQUESTS, REQUESTS),
        "@twoway": ("load", 4, 16 * REQUESTS, REQUESTS),
        "@dynamic": ("store", 4, REQUESTS, REQUESTS),
    }
    for marker, want in expect.items():
        (s,) = [s for s in sites[line_of(marker)] if s.space == "shared"]
        assert (s.kind, s.size, s.units, s.ideal) == want, marker
        assert s.requests == REQUESTS, marker
    assert sites[line_of("@square")][0].efficiency == 1 / 32
    # a helper's store, from two call lines: two sites, each naming its caller
    calls = sorted(s.via.rsplit("/", 1)[-1] for s in sites[line_of("@helper")])
    assert calls == [line_of("@call1"), line_of("@call2")]
    assert all(s.via == "" for k, v in sites.items() if k != line_of("@helper") for s in v)


def test_tracing_changes_no_bits(patterns):
    plain = run_global(patterns), run_shared(patterns)
    with trace_accesses():
        traced = run_global(patterns), run_shared(patterns)
    for a, b in zip([*plain[0], plain[1]], [*traced[0], traced[1]]):
        np.testing.assert_array_equal(a, b)
    assert set(patterns._traced) == {"global_patterns", "shared_patterns"}   # one build per kernel


def test_nothing_recorded_or_built_outside_the_block():
    mod = EmuModule(path="access_patterns.cu", include_dirs=(KDIR,),
                    name_expressions=("global_patterns",))
    run_global(mod)
    assert mod._traced == {}
    with trace_accesses() as tr:
        pass
    assert tr.launches == [] and tr.report() == ""


def test_needs_addr2line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))     # an empty folder: no binutils
    with pytest.raises(RuntimeError, match="addr2line"):
        with trace_accesses():
            pass


def test_threads_trace_one_launch_at_a_time(patterns):
    """Two threads tracing the same library: each gets its own launch's records, whole."""
    import threading

    results = {}

    def work(i):
        with trace_accesses() as tr:
            run_global(patterns)
        results[i] = tr

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sites = [{(s.location, s.kind): (s.requests, s.units) for s in results[i].sites()}
             for i in range(2)]
    assert sites[0] == sites[1] and len(sites[0]) == 8   # the 8 access lines of the kernel


def test_capacity(patterns):
    with pytest.raises(ValueError, match="capacity"):
        with trace_accesses(capacity=0):
            pass
    with pytest.raises(RuntimeError, match="capacity=10"):
        with trace_accesses(capacity=10):
            run_global(patterns)


# ---- the vectorized analysis against a plain-Python twin ---------------------------------------

def python_sites(rec: np.ndarray):
    """Per (pc, space, kind): [requests, distinct bytes, sectors or wavefronts, ideal], by loops."""
    seen = collections.Counter()
    reqs = collections.defaultdict(list)
    for r in rec:
        key = (int(r["block"]), int(r["thread"]), int(r["pc"]))
        n = seen[key]
        seen[key] += 1
        reqs[(int(r["pc"]), int(r["space"]), int(r["kind"]),
              int(r["block"]), int(r["thread"]) // 32, n)].append(r)
    out = collections.defaultdict(lambda: [0, 0, 0, 0])
    for (pc, space, kind, *_), lanes in reqs.items():
        acc = out[(pc, space, kind)]
        touched = {int(r["addr"]) + b for r in lanes for b in range(int(r["size"]))}
        acc[0] += 1
        acc[1] += len(touched)
        if space == 0:
            acc[2] += len({b // 32 for b in touched})
            acc[3] += -(-len(touched) // 32)
        else:
            phases = collections.defaultdict(lambda: collections.defaultdict(set))
            for r in lanes:
                per = 128 // max(int(r["size"]), 4)
                for b in range(int(r["size"])):
                    word = (int(r["addr"]) + b) // 4
                    phases[(int(r["thread"]) % 32) // per][word % 32].add(word)
            acc[2] += sum(max(len(w) for w in banks.values()) for banks in phases.values())
            acc[3] += len(phases)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_analysis_matches_python_twin(seed):
    rng = np.random.default_rng(seed)
    n = 3000
    rec = np.zeros(n, RECORD)
    rec["pc"] = rng.choice([0x100, 0x200, 0x300], n)
    rec["block"] = rng.integers(0, 3, n)
    rec["thread"] = rng.integers(0, 96, n)
    rec["size"] = rng.choice([1, 2, 4, 8, 16], n)
    rec["addr"] = 0x10000 + rng.integers(0, 4096, n) // rec["size"] * rec["size"]
    rec["kind"] = rng.integers(0, 3, n)
    rec["space"] = rng.integers(0, 2, n)
    # a site is one instruction: one space, kind and size per pc
    for pc, (space, kind, size) in zip((0x100, 0x200, 0x300), ((0, 0, 16), (1, 1, 8), (1, 0, 1))):
        m = rec["pc"] == pc
        rec["space"][m], rec["kind"][m], rec["size"][m] = space, kind, size
        rec["addr"][m] = rec["addr"][m] // size * size
    locs = np.array([f"/k/x.cu:{pc}" for pc in rec["pc"]], dtype=object)
    got = {(int(s.location.split(":")[1]), ("global", "shared").index(s.space),
            ("load", "store", "atomic").index(s.kind)): [s.requests, s.bytes, s.units, s.ideal]
           for s in LaunchTrace("k", (3, 1, 1), (96, 1, 1), rec, locs).sites()}
    assert got == dict(python_sites(rec))


# ---- the cast kernels --------------------------------------------------------------------------

def cast_inputs(dtype=ml_dtypes.bfloat16, k=256, splits=(128, 0, 161, 64)):
    """Inputs placed like device allocations (the outputs of the emulate backend are)."""
    rng = np.random.default_rng(7)
    xs = []
    for m in splits:
        x = DeviceLikeHost.empty((m, k), dtype)
        x[...] = rng.standard_normal((m, k)).astype(dtype)
        xs.append(x)
    return xs


CASTS = {
    "per-tensor": lambda xs: cg.multi_pad_cast_transpose(
        xs, scale=np.full(len(xs), 2.0, np.float32), backend="emulate"),
    "per-tensor, current scaling, column sums": lambda xs: cg.multi_pad_cast_transpose(
        xs, column_sums=True, backend="emulate"),
    "block 1x128": lambda xs: cg.multi_block_cast_transpose(xs, backend="emulate"),
    "block 1x128, column sums": lambda xs: cg.multi_block_cast_transpose(
        xs, column_sums=True, backend="emulate"),
    "block 128x128": lambda xs: cg.multi_block_cast_transpose(xs, block_scaling_dim=2,
                                                               backend="emulate"),
    "mxfp8": lambda xs: cg.multi_mxfp8_cast_transpose(xs, backend="emulate"),
    # the fused SwiGLU: the 256 columns are [a | b], the outputs 128 wide
    "per-tensor swiglu": lambda xs: cg.multi_pad_cast_transpose(
        xs, scale=np.full(len(xs), 2.0, np.float32), backend="emulate", activation="swiglu"),
    "block 1x128 swiglu": lambda xs: cg.multi_block_cast_transpose(xs, backend="emulate",
                                                                   activation="swiglu"),
    "mxfp8 swiglu": lambda xs: cg.multi_mxfp8_cast_transpose(xs, backend="emulate",
                                                             activation="swiglu"),
}


@pytest.mark.parametrize("kind", list(CASTS))
def test_cast_kernels_access_properties(kind):
    xs = cast_inputs(np.float32 if "column sums" in kind else ml_dtypes.bfloat16)
    with trace_accesses() as tr:
        res = CASTS[kind](xs)
    sites = tr.sites()
    report = tr.report()
    # shared memory: no bank conflict anywhere (tile transposes, column maxima, scales and sums)
    conflicted = [s for s in sites if s.space == "shared" and s.units != s.ideal]
    assert not conflicted, report
    # the row-wise FP8 bytes: 16-byte stores, whole sectors
    row_stores = [s for s in sites if s.space == "global" and s.kind == "store" and s.size == 16
                  and s.bytes == res.data.nbytes]
    assert len(row_stores) == 1 and row_stores[0].efficiency == 1.0, report
    # the transposed bytes: two lanes per 32-byte run, so a warp's 16-byte stores fill whole
    # sectors (one lane per run half-filled 32 sectors: 50%); what is left is the layout's: a
    # column of an expert with m_pad % 32 == 16 (161 rows) starts mid-sector
    col_stores = [s for s in sites if s.space == "global" and s.kind == "store" and s.size == 16
                  and s.bytes == res.data_t.nbytes]
    assert len(col_stores) == 1 and col_stores[0].efficiency > 0.75, report
    if kind.startswith("mxfp8"):   # the E8M0 scale tiles too: staged, then 16 bytes per lane
        others = [s for s in sites if s.space == "global" and s.kind == "store"
                  and s is not col_stores[0]]
        assert others and all(s.size == 16 and s.efficiency == 1.0 for s in others), report
    # DRAM: every input byte read once per pass (current scaling: an amax pass, then the cast),
    # nothing but the outputs, scales and column sums written
    passes = len(tr.launches)
    assert passes == (2 if "current scaling" in kind else 1)
    read = sum(t.global_sectors()["read"] for t in tr.launches)
    written = sum(t.global_sectors()["written"] for t in tr.launches)
    in_sectors = sum(x.nbytes for x in xs) // 32
    assert passes * in_sectors <= read <= passes * in_sectors * 1.03 + 8, report
    out_sectors = (res.data.nbytes + res.data_t.nbytes) // 32
    arrays = [a for a in vars(res).values() if isinstance(a, np.ndarray)]
    scratch = 16 * sum(t.grid[0] for t in tr.launches) if "column sums" in kind else 0
    # + one 128-float row per tile (column sums), + the last-block counters' sectors
    most = sum(-(-a.nbytes // 32) for a in arrays) + scratch + 4
    assert out_sectors <= written <= most, report


@pytest.mark.parametrize("kind", ["per-tensor", "block 1x128", "mxfp8"])
def test_an_experts_last_tile_loads_as_a_full_one(kind):
    """Tiles that end past an expert's last row (most tiles of a small expert) but inside k take
    the full tile's loads, all issued before any is used (tests/test_sass.py), not the segment by
    segment path: the input is read through one 16-byte load site, and only once from DRAM (the
    rows past m read row m - 1 again, which the caches serve)."""
    xs = cast_inputs(splits=(5, 130, 0, 33, 1))    # full tiles, and last tiles of 2 to 33 rows
    with trace_accesses() as tr:
        CASTS[kind](xs)
    loads = [s for s in tr.sites() if s.space == "global" and s.kind == "load" and s.size == 16]
    assert len(loads) == 1, tr.report()
    read = sum(t.global_sectors()["read"] for t in tr.launches)
    in_sectors = sum(x.nbytes for x in xs) // 32
    assert in_sectors <= read <= in_sectors * 1.03 + 8, tr.report()


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_scatter_rows_reads_and_writes_whole_sectors(dtype):
    from cugrouped import reference
    from cugrouped.ops.scatter_rows import scatter_rows

    rng = np.random.default_rng(3)
    tokens, h = 16, 512
    idx = rng.integers(0, tokens, 48).astype(np.int64)
    order, seg = reference.scatter_plan(idx, tokens)
    rows = DeviceLikeHost.empty((48, h), dtype)
    rows[...] = rng.standard_normal((48, h)).astype(dtype)
    out = DeviceLikeHost.empty((tokens, h), np.float32)
    with trace_accesses() as tr:
        scatter_rows(rows, order, seg, tokens, out, backend="emulate")
    report = tr.report()
    # a thread's 4 columns: one load (16 bytes of float32, 8 of bfloat16), one 16-byte store
    word = 16 if dtype == np.float32 else 8
    words = {s.kind: s for s in tr.sites() if (s.kind, s.size) in (("load", word), ("store", 16))}
    assert set(words) == {"load", "store"}, report
    assert words["load"].bytes == rows.nbytes and words["store"].bytes == out.nbytes, report
    assert words["load"].efficiency == words["store"].efficiency == 1.0, report
    assert tr.launches[0].global_sectors()["written"] == out.nbytes // 32
