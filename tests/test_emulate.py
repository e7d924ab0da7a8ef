"""The CPU emulator (cugrouped.emulate): correctness in every fiber order, the two classic kernel
bugs (a missing and a divergent __syncthreads), AddressSanitizer, speed, the build cache and the
argument checks. Test kernels live in tests/emulate_kernels/ (valid CUDA, also NVRTC-compilable).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import cugrouped
from cugrouped import emulate
from cugrouped.emulate import (DEFAULT_ORDERS, EmulationCompileError, EmulationError, EmuModule,
                               OrderDependenceError, run_all_orders)

KDIR = Path(__file__).resolve().parent / "emulate_kernels"
ORDERS = DEFAULT_ORDERS   # forward, reverse, shuffle, seeds 1 and 2


def line_of(marker: str, name: str = "planted_bugs.cu") -> int:
    for i, text in enumerate((KDIR / name).read_text().splitlines(), 1):
        if marker in text:
            return i
    raise AssertionError(marker)


@pytest.fixture(scope="module")
def transpose_mod():
    return EmuModule(path="transpose.cu", include_dirs=(KDIR,),
                     name_expressions=("transpose_tiled", "transpose_dyn<float, 8>", "transpose_dyn<double, 32>"))


@pytest.fixture(scope="module")
def reduce_mod():
    return EmuModule(path="reduce.cu", include_dirs=(KDIR,), name_expressions=("block_reduce", "warp_scan_vote"))


@pytest.fixture(scope="module")
def bugs_mod():
    names = ("transpose_missing_sync", "divergent_barrier", "shuffle_after_exit", "barrier_vs_shuffle",
             "early_exit_ok", "traps", "oob_write", "scan_twice_missing_sync",
             "sum_unwritten_shared")
    return EmuModule(path="planted_bugs.cu", include_dirs=(KDIR,), name_expressions=names)


# ---- correctness in every order ----------------------------------------------------------------


@pytest.mark.parametrize("block", [(32, 1), (32, 4), (32, 8), (32, 32)])
def test_transpose_every_order(transpose_mod, block):
    rng = np.random.default_rng(1)
    rows, cols = 100, 70   # not multiples of the tile
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    y = np.full((cols, rows), np.nan, np.float32)
    kern = transpose_mod.get_function("transpose_tiled")
    grid = ((cols + 31) // 32, (rows + 31) // 32)
    for order in ORDERS:
        y[...] = np.nan
        kern(grid, block, (x, y, np.int32(rows), np.int32(cols)), order=order)
        assert np.array_equal(y.view(np.uint32), np.ascontiguousarray(x.T).view(np.uint32)), order


@pytest.mark.parametrize("expr,dtype,rows_per_block", [("transpose_dyn<float, 8>", np.float32, 8),
                                                      ("transpose_dyn<double, 32>", np.float64, 32)])
def test_transpose_dynamic_smem_template(transpose_mod, expr, dtype, rows_per_block):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((65, 33)).astype(dtype)
    y = np.zeros((33, 65), dtype)
    kern = transpose_mod.get_function(expr)
    report = run_all_orders(kern, (2, 3), (32, rows_per_block), (x, y, np.int32(65), np.int32(33)),
                            shared_mem=32 * 33 * x.itemsize)
    report.raise_if_mismatch()
    assert np.array_equal(y, x.T)


def reduce_reference(xi, xf, nblocks, nthreads):
    stride = nblocks * nthreads
    k = -(-xi.size // stride)
    pi = np.zeros(k * stride, np.int32)
    pi[: xi.size] = xi
    pf = np.zeros(k * stride, np.float32)
    pf[: xf.size] = xf
    pm = np.full(k * stride, -np.inf, np.float32)
    pm[: xf.size] = xf
    si = pi.reshape(k, stride).sum(axis=0, dtype=np.int32)
    sf = np.zeros(stride, np.float32)
    for row in pf.reshape(k, stride):   # sequential per thread, in float32
        sf = sf + row
    m = pm.reshape(k, stride).max(axis=0)

    def butterfly(v):   # xor butterfly over the last axis (32 lanes): every lane ends with the sum
        for o in (16, 8, 4, 2, 1):
            v = v + v[..., np.arange(32) ^ o]
        return v

    nwarps = nthreads // 32
    wi = butterfly(si.reshape(nblocks, nwarps, 32))[..., 0]
    wf = butterfly(sf.reshape(nblocks, nwarps, 32))[..., 0]
    wm = m.reshape(nblocks, nwarps, 32).max(axis=2)
    li = np.zeros((nblocks, 32), np.int32)
    li[:, :nwarps] = wi
    lf = np.zeros((nblocks, 32), np.float32)
    lf[:, :nwarps] = wf
    return butterfly(li)[:, 0], butterfly(lf)[:, 0], wm.max(axis=1)


@pytest.mark.parametrize("grid", [(5,), (3, 2)])
@pytest.mark.parametrize("block", [(32,), (128,), (256,), (1024,), (16, 16), (32, 4, 2), (8, 8, 4)])
def test_block_reduce_every_order(reduce_mod, grid, block):
    rng = np.random.default_rng(3)
    n = 50_001
    xi = rng.integers(-1000, 1000, n, dtype=np.int32)
    xf = rng.standard_normal(n, dtype=np.float32)
    nblocks, nthreads = int(np.prod(grid)), int(np.prod(block))
    ref_i, ref_f, ref_m = reduce_reference(xi, xf, nblocks, nthreads)
    kern = reduce_mod.get_function("block_reduce")
    for order in ORDERS:
        bi = np.zeros(nblocks, np.int32)
        bf = np.zeros(nblocks, np.float32)
        bm = np.zeros(nblocks, np.float32)
        total = np.zeros(1, np.uint64)
        gmax = np.full(1, np.iinfo(np.int32).min, np.int32)
        kern(grid, block, (xi, xf, np.int32(n), bi, bf, bm, total, gmax), order=order)
        assert np.array_equal(bi, ref_i), order
        assert np.array_equal(bf.view(np.uint32), ref_f.view(np.uint32)), order
        assert np.array_equal(bm, ref_m), order
        assert int(total[0].astype(np.int64)) == int(xi.sum(dtype=np.int64))
        b = int(gmax[0])
        assert np.int32(b if b >= 0 else b ^ 0x7FFFFFFF).view(np.float32) == xf.max()


@pytest.mark.parametrize("width", [32, 16, 8, 4, 2, 1])
@pytest.mark.parametrize("block", [(64,), (32, 4)])
def test_warp_scan_and_votes(reduce_mod, width, block):
    rng = np.random.default_rng(4)
    grid = (3,)
    n = int(np.prod(grid)) * int(np.prod(block))
    x = rng.integers(-10, 10, n, dtype=np.int32)
    scan = np.zeros(n, np.int32)
    ballots = np.zeros(n // 32, np.uint32)
    votes = np.zeros(3 * (n // 32), np.int32)
    kern = reduce_mod.get_function("warp_scan_vote")
    report = run_all_orders(kern, grid, block, (x, scan, ballots, votes, np.int32(width)))
    report.raise_if_mismatch()
    assert np.array_equal(scan, np.cumsum(x.reshape(-1, width), axis=1, dtype=np.int32).reshape(-1))
    bits = (x.reshape(-1, 32) > 0).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    assert np.array_equal(ballots, bits.sum(axis=1).astype(np.uint32))
    v = votes.reshape(-1, 3)
    assert np.array_equal(v[:, 0], (x.reshape(-1, 32) > 5).any(axis=1))
    assert np.array_equal(v[:, 1], (x.reshape(-1, 32) > -100).all(axis=1))
    assert np.array_equal(v[:, 2], x.reshape(-1, 32).sum(axis=1, dtype=np.int32))


# ---- planted bugs ----------------------------------------------------------------------------------


def test_missing_syncthreads_caught_by_order_variation(bugs_mod):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 64), dtype=np.float32)
    y = np.zeros((64, 64), np.float32)
    report = run_all_orders(bugs_mod.get_function("transpose_missing_sync"), (2, 2), (32, 8),
                            (x, y, np.int32(64), np.int32(64)))
    assert not report.ok
    assert any("argument 1" in m for m in report.mismatches)
    with pytest.raises(OrderDependenceError, match="fiber order"):
        report.raise_if_mismatch()


def test_race_through_warp_collectives_caught_by_a_warp_running_ahead(bugs_mod):
    """block_scan.cuh without its second barrier, called twice: warp 0 overwrites its total while
    the other warps still read the first scan's. The one-step-per-pass orders hide it (every warp
    reads before warp 0 is through five shuffle rounds, whatever the order or seed); "warps", in
    which warp 0 runs as far as it can first, shows it."""
    kern, block = bugs_mod.get_function("scan_twice_missing_sync"), 128
    out = np.zeros(2 * block, np.int64)
    step_orders = ("forward", "reverse", "shuffle", 1, 2, 3)
    hidden = run_all_orders(kern, 1, block, (out,), orders=step_orders)
    assert hidden.ok
    assert np.array_equal(out[:block], np.arange(1, block + 1))        # the first scan, right
    report = run_all_orders(kern, 1, block, (out,))                    # DEFAULT_ORDERS
    assert report.mismatches == [f"order 'warps': argument 0: {block - 32} of {2 * block} "
                                 "elements differ from order 'forward'"]
    kern(1, block, (out,), order="warps")
    scan2 = np.cumsum(1000 + np.arange(block))
    assert np.array_equal(out[:32], np.arange(1, 33))                  # warp 0 read in time
    assert not np.array_equal(out[32:block], np.arange(33, block + 1))  # later warps read its 2nd
    assert np.array_equal(out[block:], scan2)                          # the second scan is right


@pytest.mark.parametrize("order", ["warps", "warps-reverse"])
def test_warp_orders_run_one_warp_as_far_as_it_goes(order):
    """The "warps" orders as documented: each warp runs until it waits at a block barrier (or
    ends), warp after warp, through its warp collectives; after the barrier is released, again
    from the first warp (the last one for "warps-reverse")."""
    mod = EmuModule(path="schedule.cu", include_dirs=(KDIR,),
                    name_expressions=("warp_schedule_log",))
    log, nxt = np.full(3 * 128, -1, np.int32), np.zeros(1, np.int32)
    mod.get_function("warp_schedule_log")(1, 128, (log, nxt), order=order, workers=1)
    warps = [0, 1, 2, 3] if order == "warps" else [3, 2, 1, 0]
    before = [w for w in warps for _ in range(32)]
    after = [v for w in warps for v in [w] * 32 + [100 + w] * 32]   # shuffles stay in a warp
    assert log.tolist() == before + after


def test_shared_memory_read_before_written_is_not_zero(bugs_mod):
    """Static __shared__ arrays start as all-ones bytes in every launch (NaN floats, -1 ints), as
    dynamic shared memory does: a kernel that reads slots it never wrote gets NaN, not the zeros
    a fresh thread's storage would hold (which would make this sum look right)."""
    x = np.arange(1, 33, dtype=np.float32)
    out = np.zeros(3, np.float32)
    bugs_mod.get_function("sum_unwritten_shared")(3, 32, (x, out), workers=2)
    assert np.isnan(out).all()


def test_divergent_syncthreads_reported_with_both_lines(bugs_mod):
    out = np.zeros(1024, np.float32)
    for order in ("forward", "reverse", "shuffle", "warps", "warps-reverse"):
        t0 = time.perf_counter()
        with pytest.raises(EmulationError) as info:
            bugs_mod.get_function("divergent_barrier")(2, 256, (out,), order=order)
        elapsed = time.perf_counter() - t0
        msg = str(info.value)
        print(f"\ndivergent __syncthreads reported in {elapsed * 1e3:.1f} ms: {msg}")
        assert elapsed < 1.0
        assert f"planted_bugs.cu:{line_of('BUG_DIVERGENT_A')}" in msg
        assert f"planted_bugs.cu:{line_of('BUG_DIVERGENT_B')}" in msg


def test_warp_collective_errors(bugs_mod):
    out = np.zeros(1024, np.float32)
    with pytest.raises(EmulationError, match=f"planted_bugs.cu:{line_of('BUG_SHFL_EXIT')}.*returned"):
        bugs_mod.get_function("shuffle_after_exit")(1, 64, (out,))
    with pytest.raises(EmulationError, match="returned"):
        bugs_mod.get_function("shuffle_after_exit")(1, 64, (out,), order="reverse")
    with pytest.raises(EmulationError, match="returned"):
        bugs_mod.get_function("shuffle_after_exit")(1, 64, (out,), order="warps-reverse")
    for order in ("forward", "warps"):
        with pytest.raises(EmulationError) as info:
            bugs_mod.get_function("barrier_vs_shuffle")(1, 32, (out,), order=order)
        assert f":{line_of('BUG_BAR_VS_SHFL_A')}" in str(info.value)
        assert f":{line_of('BUG_BAR_VS_SHFL_B')}" in str(info.value)
    with pytest.raises(EmulationError, match=f"__trap\\(\\) called at .*planted_bugs.cu:{line_of('BUG_TRAP')}"):
        bugs_mod.get_function("traps")(1, 32, (np.zeros(32, np.int32),))


def test_usable_after_errors_and_early_exit_is_legal(bugs_mod, transpose_mod):
    out = np.zeros(1024, np.float32)
    for _ in range(3):
        with pytest.raises(EmulationError):
            bugs_mod.get_function("divergent_barrier")(4, 128, (out,))
    out = np.zeros(128, np.float32)
    report = run_all_orders(bugs_mod.get_function("early_exit_ok"), 1, 128, (out,))
    report.raise_if_mismatch()
    assert np.array_equal(out[:64], np.arange(63, -1, -1, dtype=np.float32))
    x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    y = np.zeros_like(x)
    transpose_mod.get_function("transpose_tiled")((2, 2), (32, 8), (x, y, np.int32(64), np.int32(64)))
    assert np.array_equal(y, x.T)


@pytest.mark.asan
def test_out_of_bounds_write_fails_under_asan(tmp_path):
    try:
        env = emulate.asan_env()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no g++ with libasan")
    if not Path(env["LD_PRELOAD"]).is_file():
        pytest.skip("libasan.so not found")
    root = str(Path(cugrouped.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    script = tmp_path / "oob.py"
    script.write_text(textwrap.dedent(f"""
        import numpy as np
        from cugrouped.emulate import EmuModule, EmulationError
        mod = EmuModule(path="planted_bugs.cu", include_dirs=({str(KDIR)!r},),
                        name_expressions=("oob_write", "divergent_barrier", "transpose_missing_sync"), sanitize=True)
        # fiber switching, barriers and an aborted launch must be clean under ASan
        x = np.ones((64, 64), np.float32); y = np.zeros_like(x)
        mod.get_function("transpose_missing_sync")((2, 2), (32, 8), (x, y, np.int32(64), np.int32(64)))
        try:
            mod.get_function("divergent_barrier")(1, 128, (np.zeros(1024, np.float32),))
        except EmulationError:
            pass
        print("CLEAN PART PASSED", flush=True)
        out = np.zeros(1000, np.float32)
        mod.get_function("oob_write")(4, 256, (out, np.int32(out.size)))
        print("OOB WRITE NOT DETECTED", flush=True)
    """))
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert "CLEAN PART PASSED" in res.stdout, res.stderr[-3000:]
    assert res.returncode != 0 and "OOB WRITE NOT DETECTED" not in res.stdout
    assert "AddressSanitizer: heap-buffer-overflow" in res.stderr, res.stderr[-3000:]
    assert f"planted_bugs.cu:{line_of('BUG_OOB')}" in res.stderr, res.stderr[-3000:]
    # nothing noisy from the fiber switches before the report
    assert "False positive" not in res.stderr and "stack-use-after" not in res.stderr


# ---- speed ---------------------------------------------------------------------------------------------

SCALE_DTYPE = np.dtype([("in", np.uint64, 8), ("out", np.uint64, 8), ("n", np.int64, 8),
                        ("scale", np.float32, 8), ("count", np.int32)], align=True)


def test_perf_8_tensors_300x512():
    mod = EmuModule(path="multi_scale.cu", include_dirs=(KDIR,), name_expressions=("multi_scale_amax",))
    kern = mod.get_function("multi_scale_amax")
    assert kern.param_sizes == (SCALE_DTYPE.itemsize, 8)
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((300, 512), dtype=np.float32) for _ in range(8)]
    ys = [np.zeros_like(x) for x in xs]
    scales = (np.arange(8, dtype=np.float32) + 1) * np.float32(0.75)
    rec = np.zeros((), SCALE_DTYPE)
    rec["in"] = [x.ctypes.data for x in xs]
    rec["out"] = [y.ctypes.data for y in ys]
    rec["n"] = [x.size for x in xs]
    rec["scale"] = scales
    rec["count"] = 8
    amax = np.zeros(8, np.uint32)
    grid = (300 * 512 // 1024, 8)   # 1200 blocks of 256 threads
    t0 = time.perf_counter()
    kern(grid, 256, (rec, amax))
    elapsed = time.perf_counter() - t0
    print(f"\nemulated 8 x (300x512) float32, {grid[0] * grid[1]} blocks x 256 threads: {elapsed:.3f} s "
          f"({mod.workers} workers)")
    assert elapsed < 5.0
    for x, y, s in zip(xs, ys, scales):
        assert np.array_equal(y, x * s)
    assert np.array_equal(amax.view(np.float32), np.array([np.abs(x).max() for x in xs], np.float32))
    # the same struct as a structured scalar (np.void) works too
    amax[:] = 0
    kern(grid, 256, (rec[()], amax), order="reverse")
    assert np.array_equal(amax.view(np.float32), np.array([np.abs(x).max() for x in xs], np.float32))


# ---- build cache -------------------------------------------------------------------------------------


def test_cache_reuse_and_rebuild_on_header_change(tmp_path, monkeypatch):
    monkeypatch.setenv("CUGROUPED_CACHE_DIR", str(tmp_path / "cache"))
    inc = tmp_path / "inc"
    inc.mkdir()
    header = inc / "factor.cuh"
    header.write_text("#define FACTOR 2\n")
    code = '#include "common.cuh"\n#include "factor.cuh"\n' \
           "__global__ void k(int* p) { p[threadIdx.x] = FACTOR * (int)threadIdx.x; }\n"

    def run(mod):
        p = np.zeros(32, np.int32)
        mod.get_function("k")(1, 32, (p,))
        return p

    builds = emulate.stats["builds"]
    m1 = EmuModule(code=code, include_dirs=(inc,), name_expressions=("k",))
    assert emulate.stats["builds"] == builds + 1
    assert np.array_equal(run(m1), 2 * np.arange(32))
    mtime = m1.library.stat().st_mtime_ns

    emulate._clear_memory_cache()
    hits = emulate.stats["disk_hits"]
    m2 = EmuModule(code=code, include_dirs=(inc,), name_expressions=("k",))
    assert emulate.stats["builds"] == builds + 1 and emulate.stats["disk_hits"] == hits + 1
    assert m2.library == m1.library and m2.library.stat().st_mtime_ns == mtime
    assert m1.library.parent == tmp_path / "cache" / "emulate"

    header.write_text("#define FACTOR 3\n")   # an included header changes: rebuilt
    m3 = EmuModule(code=code, include_dirs=(inc,), name_expressions=("k",))
    assert emulate.stats["builds"] == builds + 2 and m3.library != m1.library
    assert np.array_equal(run(m3), 3 * np.arange(32))
    assert np.array_equal(run(m1), 2 * np.arange(32))   # the old library is still loaded and intact

    src = inc / "kern.cu"   # a kernel file (path=) changes: rebuilt
    src.write_text(code)
    m4 = EmuModule(path="kern.cu", include_dirs=(inc,), name_expressions=("k",))
    src.write_text(code.replace("FACTOR *", "FACTOR + "))
    m5 = EmuModule(path="kern.cu", include_dirs=(inc,), name_expressions=("k",))
    assert m5.library != m4.library
    assert np.array_equal(run(m5), 3 + np.arange(32))
    # different defines are different libraries
    m6 = EmuModule(path="kern.cu", include_dirs=(inc,), name_expressions=("k",), options=("-DEXTRA=1",))
    assert m6.library != m5.library


# ---- arguments and unsupported built-ins ----------------------------------------------------------------


def test_argument_checks():
    code = textwrap.dedent("""
        struct Rec { long long a; int b; };
        __global__ void f(float* p, int n, Rec r, double d) {
            if (threadIdx.x == 0) p[0] = (float)(n + r.a + r.b + d);
        }
    """)
    mod = EmuModule(code=code, name_expressions=("f",))
    f = mod.get_function("f")
    assert f.param_sizes == (8, 4, 16, 8)
    rec_t = np.dtype([("a", np.int64), ("b", np.int32)], align=True)
    rec = np.zeros((), rec_t)
    rec["a"], rec["b"] = 10, 20
    p = np.zeros(1, np.float32)
    f(1, 32, (p, np.int32(1), rec, np.float64(0.5)))
    assert p[0] == np.float32(31.5)
    f(1, 32, (p, np.int32(2), rec[()], np.float64(0.5)))   # np.void record
    assert p[0] == np.float32(32.5)
    with pytest.raises(TypeError, match="argument 1.*Python int"):
        f(1, 32, (p, 1, rec, np.float64(0.5)))
    with pytest.raises(TypeError, match="argument 1 .*8 bytes.*4 bytes"):
        f(1, 32, (p, np.int64(1), rec, np.float64(0.5)))
    with pytest.raises(TypeError, match="argument 2 .*12 bytes.*16 bytes"):
        f(1, 32, (p, np.int32(1), np.zeros((), [("a", np.int64), ("b", np.int32)]), np.float64(0.5)))
    with pytest.raises(TypeError, match="argument 3 .*float32.*4 bytes"):
        f(1, 32, (p, np.int32(1), rec, np.float32(0.5)))
    with pytest.raises(TypeError, match="takes 4 arguments, got 3"):
        f(1, 32, (p, np.int32(1), rec))
    with pytest.raises(ValueError):
        f(1, 2048, (p, np.int32(1), rec, np.float64(0.5)))
    with pytest.raises(ValueError):
        f(1, 32, (p, np.int32(1), rec, np.float64(0.5)), order="sideways")
    with pytest.raises(KeyError):
        mod.get_function("g")


@pytest.mark.parametrize("order", ["random", "Forward", 1.5, True, None, "warp", "Warps"])
def test_emulation_order_refuses_an_unknown_order_on_entry(order):
    """Not at the first emulated launch inside the block, which may be far away (or never)."""
    entered = []
    with pytest.raises(ValueError, match=r"^order: got .*, expected 'forward', 'reverse', "
                       r"'shuffle', an int seed, 'warps' or 'warps-reverse'$"):
        with cugrouped.emulation_order(order):
            entered.append(order)
    assert entered == []
    for ok in (*DEFAULT_ORDERS, np.int64(7)):
        with cugrouped.emulation_order(ok):
            assert cugrouped.ops._launch.current_emulation_order() is ok


@pytest.mark.parametrize("body,what", [
    ('asm volatile("bar.sync 0;");', "poisoned"),
    ("unsigned m = __activemask(); p[0] = m;", "poisoned"),
    ("p[0] = __shfl(p[0], 0);", "poisoned"),
    ("extern __shared__ float s[]; p[0] = s[0];", "error"),
])
def test_unsupported_builtins_fail_to_compile(body, what):
    code = "__global__ void f(float* p) { %s }\n" % body
    with pytest.raises(EmulationCompileError, match=what):
        EmuModule(code=code, name_expressions=("f",))


def test_inline_ptx_behind_cuda_arch_takes_portable_path():
    code = textwrap.dedent("""
        __device__ __forceinline__ unsigned f(unsigned x) {
        #if defined(__CUDA_ARCH__)
            unsigned r; asm("brev.b32 %0, %1;" : "=r"(r) : "r"(x)); return r;
        #else
            return __brev(x);
        #endif
        }
        __global__ void k(unsigned* p) { p[threadIdx.x] = f(p[threadIdx.x]) + CUGROUPED_EMULATE; }
    """)
    p = np.arange(32, dtype=np.uint32)
    EmuModule(code=code, name_expressions=("k",)).get_function("k")(1, 32, (p,))
    expect = np.array([int(f"{i:032b}"[::-1], 2) + 1 for i in range(32)], np.uint32)
    assert np.array_equal(p, expect)


def test_builtins():
    mod = EmuModule(path="builtins.cu", include_dirs=(KDIR,), name_expressions=("builtins",))
    n = 64
    out = np.zeros((n, 16), np.int32)
    counters = np.zeros(2, np.uint32)
    fsum = np.zeros(1, np.float32)
    mod.get_function("builtins")(1, n, (out, counters, fsum), order="reverse")
    t = np.arange(n)
    lane = t & 31
    assert (out[:, 0] == np.count_nonzero(t % 3 == 0)).all()
    assert (out[:, 1] == 1).all() and (out[:, 2] == 1).all()
    assert np.array_equal(out[:, 3], ((t & ~7) | ((t + 3) & 7)) * 10)
    down = np.where((lane & 15) + 3 <= 15, t + 3, t)
    assert np.array_equal(out[:, 4], down * 10)
    assert np.array_equal(out[:, 5], (t ^ 5) * 10)
    assert np.array_equal(out[:, 6], np.where((lane & 7) >= 2, t - 2, t) * 10)
    assert (out[:, 7] == 7 - 31).all() and (out[:, 8] == 93).all()
    assert np.array_equal(out[:, 9], ((t & ~31) | (31 - lane)) // 2)
    popc = np.array([bin(i).count("1") for i in range(n)])
    ffs = np.array([(i & -i).bit_length() for i in range(n)])
    clz = np.array([32 - i.bit_length() for i in range(n)])
    assert np.array_equal(out[:, 10], popc + 100 * ffs + 10000 * clz)
    b = [(0x33221100 + i).to_bytes(4, "little") + (0x77665544).to_bytes(4, "little") for i in range(n)]
    assert np.array_equal(out[:, 11].view(np.uint32), [int.from_bytes(bytes(x[s] for s in (1, 3, 5, 7)), "little") for x in b])
    assert sorted(out[:, 12]) == sorted([i % 41 for i in range(n)]) and counters[0] == n % 41
    assert counters[1] == out[:, 13].sum() >= 1   # a chain of winners: thread k wins after k-1 did
    assert fsum[0] == n * 0.5
    assert np.array_equal(out[:, 14], np.maximum(t, 7) + 100 * np.minimum(t, 7) + 10000 * np.maximum(2, t))
    assert np.array_equal(out[:, 15], t + 6 - (1 << 31))


def test_printf_and_exports(transpose_mod, capfd):
    code = '__global__ void hello(int* p) { printf("hello from thread %d\\n", (int)threadIdx.x); p[0] = 1; }\n'
    mod = EmuModule(code=code, name_expressions=("hello",))
    mod.get_function("hello")(1, 4, (np.zeros(1, np.int32),), order="reverse")
    assert capfd.readouterr().out == "".join(f"hello from thread {i}\n" for i in (3, 2, 1, 0))
    # -fvisibility=hidden: only the entry points are exported, no process-wide unique symbols
    # (function-static __shared__ of templates would otherwise be shared between libraries).
    if shutil.which("readelf") is None:
        pytest.skip("readelf not available")
    syms = subprocess.run(["readelf", "-W", "--dyn-syms", str(transpose_mod.library)],
                          capture_output=True, text=True, check=True).stdout
    assert "UNIQUE" not in syms
    exported = {line.split()[-1] for line in syms.splitlines()
                if re.search(r"\bGLOBAL\s+DEFAULT\s+\d+\b", line)}
    assert exported and all(name.startswith("cg_emu_") for name in exported), exported


def test_missing_compiler_says_what_to_do_instead():
    """Without g++ the error names the compiler, its environment variable and the NumPy route."""
    code = ("import importlib\n_build = importlib.import_module('cugrouped.emulate._build')\n"
            "try:\n    _build.compiler_version()\nexcept _build.EmulationError as e:\n    print(e)\n")
    env = dict(os.environ, CUGROUPED_EMULATE_CXX="/nonexistent/g++")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout
    assert "'/nonexistent/g++'" in out and "CUGROUPED_EMULATE_CXX" in out
    assert "backend='reference'" in out and "set_cpu_cast_backend('reference')" in out
