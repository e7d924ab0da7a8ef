"""The benchmark timing machinery: the spin kernel that keeps host overhead out of device times,
the host-time probe, the environment recorded with every CSV, and the cast bench's peers."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest

from cugrouped.bench import common

pytest.register_assert_rewrite("_model_gpu")
from _model_gpu import ModelGPU  # noqa: E402


@pytest.mark.parametrize("arch", ["80", "89", "90", "100"])
def test_spin_kernel_compiles_with_nvrtc(arch):
    """The spin kernel (inline PTX reading %globaltimer) compiles for every target, no GPU needed."""
    from cupy.cuda.compiler import _NVRTCProgram

    prog = _NVRTCProgram(common._SPIN_SOURCE, "spin.cu", method="cubin")
    image, _ = prog.compile((f"-arch=sm_{arch}",), io.StringIO())
    assert len(image) > 0


def test_environment_names_the_libraries():
    env = common.environment()
    for key in ("gpu", "cupy", "numpy", "cublaslt", "python", "date"):
        assert key in env, key
    assert env["cublaslt"] == "none" or int(env["cublaslt"]) >= 120000


def test_cast_peer_eager_matches_the_reference_bits():
    """The torch eager peer does the same work as the op (so the speed-up compares like with
    like): on CPU its FP8 rows, padded transposed copy and amax equal the reference's."""
    torch = pytest.importorskip("torch")
    from cugrouped.bench.cast import CastConfig, _torch_peers
    from cugrouped.reference import multi_pad_cast_transpose

    cfg = CastConfig("t", 4, 64, 100, True)
    m = cfg.m_splits()
    x = torch.randn((sum(m), cfg.k), dtype=torch.float32)
    eager, _ = _torch_peers(cfg, x, m, compile_peer=False)
    outs = eager(x)
    ref = multi_pad_cast_transpose(x.numpy(), m)
    for i, (q, padded_t, amax, scale_inv) in enumerate(outs):
        assert np.array_equal(q.view(torch.uint8).numpy(), ref.rowwise(i).view(np.uint8)), i
        assert np.array_equal(padded_t.numpy(), ref.columnwise(i).view(np.uint8)), i
        assert float(amax) == float(ref.amax[i]), i


def test_permute_benchmark_compares_like_with_like():
    """The permute benchmark's router gives each token top_k distinct experts, rows grouped by
    expert; the fused cast (row_index) and the index_select + cast peer give the same bits."""
    torch = pytest.importorskip("torch")
    import cugrouped
    from cugrouped.bench.cast import routing

    T, E, top_k, k = 50, 6, 2, 32
    idx, m = routing(T, E, top_k, seed=3, device="cpu")
    assert idx.dtype == torch.int64 and sum(m) == T * top_k and len(m) == E
    assert torch.equal(torch.bincount(idx, minlength=T), torch.full((T,), top_k))
    x = torch.randn((T, k), dtype=torch.bfloat16)
    fused = cugrouped.multi_pad_cast_transpose(x, m, row_index=idx)
    peer = cugrouped.multi_pad_cast_transpose(x.index_select(0, idx), m)
    assert torch.equal(fused.data.view(torch.uint8), peer.data.view(torch.uint8))
    assert torch.equal(fused.data_t, peer.data_t) and torch.equal(fused.scale, peer.scale)


@pytest.mark.gpu
def test_median_ms_measures_device_time_not_host_time():
    """A call that spends 5 ms on the host before launching 0.2 ms of GPU work measures ~0.2 ms
    of device time and ~5 ms of host time. The upper bound is 4 ms, below the host time (what
    must be left out), not ~0.2 ms: gpu_check runs the tests in 8 processes sharing the GPU, and
    another process's time slices between the events add to the elapsed time (the median of 9
    runs needs that in 5 of them to fail)."""
    def fn(i):
        time.sleep(0.005)
        common.spin(200_000)

    ms = common.median_ms(fn, 9)
    assert 0.15 < ms < 4.0, ms
    assert common.host_us(fn, 3) > 4000


def test_roofline_pct_takes_the_binding_limit():
    # 1 TFLOP at 1000 TFLOP/s: 1 ms; 1 GB at 2000 GB/s: 0.5 ms -> compute binds: roof 1 ms
    assert common.roofline_pct(2.0, 1e12, 1e9, 1000.0, 2000.0) == pytest.approx(50.0)
    # 4 GB at 2000 GB/s: 2 ms -> memory binds
    assert common.roofline_pct(4.0, 1e12, 4e9, 1000.0, 2000.0) == pytest.approx(50.0)
    assert common.roofline_pct(2.0, 1e12, 4e9, 1000.0, 2000.0) == pytest.approx(100.0)


def test_timing_columns_flag_launch_bound_rows(monkeypatch):
    assert common.timing_columns(1500.0, lead_ms=2.0) == {"lead_ms": 2.0, "launch_bound": False}
    assert common.timing_columns(1600.0, lead_ms=2.0)["launch_bound"] is True    # 0.8 x 2 ms
    assert common.timing_columns(None, lead_ms=2.0)["launch_bound"] is False
    monkeypatch.setattr(common, "last_lead_ms", None)
    assert common.timing_columns(100.0) == {}                     # no median_ms call yet
    # by default: the latest median_ms call's lead and the host time it was sized from
    monkeypatch.setattr(common, "last_lead_ms", common.LEAD_CAP_MS)
    monkeypatch.setattr(common, "last_host_us", 45e3)              # 45 ms: the lead was capped
    assert common.timing_columns() == {"lead_ms": common.LEAD_CAP_MS, "launch_bound": True}
    assert common.timing_columns(1e3)["launch_bound"] is False     # the row's own host time


@pytest.mark.parametrize("msg, sticky", [
    ("CUDA error: device-side assert triggered\nCUDA kernel errors might be ...", True),
    ("cudaErrorIllegalAddress: an illegal memory access was encountered", True),
    ("CUDA error: unspecified launch failure", True),
    ("cudaErrorLaunchFailure: unspecified launch failure", True),
    ("CUDA error: out of memory", False),
    ("Expected mat_b tensor to be column major in the last two dimensions", False),
])
def test_sticky_cuda_errors_are_recognised(msg, sticky):
    assert common.is_sticky_cuda_error(RuntimeError(msg)) is sticky
    try:                                    # also when wrapped by another exception
        try:
            raise RuntimeError(msg)
        except RuntimeError as inner:
            raise ValueError("peer failed") from inner
    except ValueError as outer:
        assert common.is_sticky_cuda_error(outer) is sticky


def test_sections_stop_after_a_sticky_cuda_error(capsys):
    from cugrouped.bench import Sections

    ran, saved, failed = [], [], []
    section = Sections(failed, lambda: saved.append(len(ran)))

    def boom(msg):
        ran.append(msg)
        raise RuntimeError(msg)

    section("a", boom, "CUDA error: out of memory")           # not sticky: the next one runs
    section("b", ran.append, "b")
    section("c", boom, "CUDA error: device-side assert triggered")
    section("d", ran.append, "d")                             # skipped, says why
    out = capsys.readouterr().out
    assert ran == ["CUDA error: out of memory", "b", "CUDA error: device-side assert triggered"]
    assert failed == ["a", "c", "d (skipped)"] and saved == [1, 2, 3]
    assert "bench d: skipped: an earlier section hit a sticky CUDA error (c: RuntimeError: CUDA " \
        "error: device-side assert triggered)" in out


def test_a_sticky_error_still_writes_what_was_measured(tmp_path, monkeypatch, capsys):
    """The bench after a device assert: the later sections skipped, the CSV, plots and targets
    table of the rows measured before it written, return code 1."""
    import csv

    import cugrouped
    from cugrouped import bench

    def sections(what, quick, rows, section, on_gpu):
        section("cast", lambda: rows.append(dict(op="cast", config="E8", scaling="current",
                                                 impl="cugrouped", ms=0.2, pct_copy_bw=91.0)))
        section("gemm", lambda: (_ for _ in ()).throw(
            RuntimeError("CUDA error: device-side assert triggered")))
        section("layer", lambda: rows.append(dict(op="layer", config="E8", impl="x", ms=1.0)))

    monkeypatch.setattr(bench, "_run_sections", sections)
    monkeypatch.setattr(cugrouped, "gpu_available", lambda: True)
    assert bench.run_bench("all", str(tmp_path)) == 1
    out = capsys.readouterr().out
    with open(tmp_path / "bench.csv") as f:
        assert [r["op"] for r in csv.DictReader(f)] == ["cast"]
    assert "bench layer: skipped: an earlier section hit a sticky CUDA error" in out
    assert "cast: % of copy bandwidth" in out and "these sections failed: gemm, layer (skipped)" in out


def test_cast_bytes_count_the_amax_re_read_only_past_l2():
    from cugrouped.bench.cast import cast_bytes

    T, k, Tp = 1000, 64, 1024                       # input 128 000 bytes
    writes = T * k + Tp * k
    assert cast_bytes(T, k, Tp, current=False, l2_bytes=0) == 2 * T * k + writes
    assert cast_bytes(T, k, Tp, current=True, l2_bytes=0) == 4 * T * k + writes
    assert cast_bytes(T, k, Tp, current=True, l2_bytes=128_000) == 2 * T * k + writes  # fits
    assert cast_bytes(T, k, Tp, current=True, l2_bytes=127_999) == 4 * T * k + writes


def test_tile_fill_counts_the_padded_rows_in_whole_tiles():
    from cugrouped.bench.cast import CAST_CONFIGS, tile_fill_pct

    # 100 tokens: padded to 112, two 64-row tiles; 64: one; 0: none; 1: padded to 16, one tile
    assert tile_fill_pct([100, 64, 0, 1]) == pytest.approx(100 * 165 / (4 * 64))
    assert tile_fill_pct([128, 64]) == 100.0 and tile_fill_pct([0, 0]) == 100.0
    fine = next(c for c in CAST_CONFIGS if c.name == "fine-E64-jagged")
    assert 70 < tile_fill_pct(fine.m_splits()) < 85          # jagged E=64: a fifth unused
    # half tiles: a last row of at most 32 rows counts 32 (100: 64 + 48 rows, still a full row;
    # 1: 16 padded rows in a half row)
    assert tile_fill_pct([100, 64, 0, 1], half=True) == pytest.approx(100 * 165 / (3 * 64 + 32))
    assert tile_fill_pct([20, 33], align=1, half=True) == pytest.approx(100 * 53 / (32 + 64))
    assert 88 < tile_fill_pct(fine.m_splits(), half=True) < 95


def test_permute_cast_bytes_read_the_tokens_once_when_they_fit_in_l2():
    from cugrouped.bench.cast import permute_cast_bytes

    tokens, routed, k, padded = 500, 1000, 64, 1024     # top-2: 1000 routed rows; 64 000 bytes
    writes = routed * k + padded * k
    assert permute_cast_bytes(tokens, routed, k, padded, l2_bytes=64_000) == 2 * tokens * k + writes
    # larger than L2: every routed row read by the amax pass and again by the cast pass
    assert permute_cast_bytes(tokens, routed, k, padded, l2_bytes=63_999) == \
        2 * 2 * routed * k + writes


def test_time_together_is_fair_on_a_gpu_whose_clock_sags(monkeypatch):
    """Two identical implementations on a GPU that slows down as it runs: timed one after the
    other (median_ms) the second looks ~15 % slower; interleaved (time_together), equal within
    0.5 %, and both show the sag as drift."""
    gpu = ModelGPU(monkeypatch, sag=0.005)
    first, second = (common.median_ms(gpu.work(n, 1.0), 30) for n in "ab")
    assert second / first > 1.1
    gpu.t = 0.0
    got = common.time_together({"a": gpu.work("a", 1.0), "b": gpu.work("b", 1.0)}, 30)
    assert got["b"].ms / got["a"].ms == pytest.approx(1.0, abs=0.005)
    assert got["a"].drift_pct > 5 and got["b"].drift_pct > 5


def test_time_together_takes_the_implementations_in_turn(monkeypatch):
    """Warm-up and host timing per implementation first, then one timed call of each per turn,
    the order rotated, the calls numbered as they run (inputs rotated by that number: no call
    reads the copy the call before it read, whoever made it); a steady GPU's times exact, no
    drift, the lead at its floor for host times far below it."""
    gpu = ModelGPU(monkeypatch)
    got = common.time_together({"a": gpu.work("a", 1.0), "b": gpu.work("b", 2.0),
                                "c": gpu.work("c", 0.5)}, 4, warmup=2, host_runs=3)
    assert gpu.calls[:10] == [("a", 0)] * 2 + [("a", i) for i in range(3)] + \
        [("b", 0)] * 2 + [("b", i) for i in range(3)]
    assert gpu.calls[10:] == [("c", 0), ("c", 0), ("c", 0), ("c", 1), ("c", 2),
                              ("a", 0), ("b", 1), ("c", 2), ("b", 3), ("c", 4), ("a", 5),
                              ("c", 6), ("a", 7), ("b", 8), ("a", 9), ("b", 10), ("c", 11)]
    assert list(got) == ["a", "b", "c"]
    assert [t.ms for t in got.values()] == pytest.approx([1.0, 2.0, 0.5], abs=1e-12)
    assert all(abs(t.drift_pct) < 1e-9 and t.lead_ms == 0.2 for t in got.values())
    assert got["a"].columns() == {"lead_ms": 0.2, "launch_bound": False,
                                  "drift_pct": got["a"].drift_pct}


def test_time_together_leaves_out_what_fails_in_warm_up(monkeypatch):
    """A peer that refuses the shapes is reported and left out, the others timed; a sticky CUDA
    error, or any error without a ``skipped`` callback, is raised."""
    gpu = ModelGPU(monkeypatch)

    def refuses(i):
        raise RuntimeError("Expected mat_b tensor to be column major")

    def poisons(i):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    seen = []
    got = common.time_together({"a": gpu.work("a", 1.0), "peer": refuses}, 3,
                               skipped=lambda name, exc: seen.append((name, str(exc))))
    assert list(got) == ["a"] and seen == [("peer", "Expected mat_b tensor to be column major")]
    # failing in a timed call (after its warm-up passed): left out from then on, the others
    # timed to the end
    later = gpu.work("later", 2.0)

    def fails_at_call_8(i):        # turn 2's third call
        if i == 8:
            raise RuntimeError("out of memory")
        return later(i)

    seen.clear()
    got = common.time_together({"a": gpu.work("a", 1.0), "later": fails_at_call_8,
                                "c": gpu.work("c", 0.5)}, 4, host_runs=3,
                               skipped=lambda n, e: seen.append(n))
    assert list(got) == ["a", "c"] and seen == ["later"]
    assert [i for name, i in gpu.calls if name == "c"][-4:] == [2, 4, 6, 10]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        common.time_together({"a": gpu.work("a", 1.0), "bad": poisons}, 3,
                             skipped=lambda *a: None)
    with pytest.raises(RuntimeError, match="column major"):
        common.time_together({"peer": refuses}, 3)


def test_bench_cast_rows_on_a_model_gpu(monkeypatch, capsys):
    """The cast section on a model GPU (its GPU calls replaced, tests/_model_gpu.py): cugrouped's
    two scalings and the torch peers timed together, bandwidth and speed-ups from those times;
    the GPU check's later torch.compile section compares with the cugrouped row before it; a
    peer failing is reported, cugrouped failing ends the section."""
    from cugrouped.bench import cast as bc

    gpu = ModelGPU(monkeypatch)
    cfg = bc.CAST_CONFIGS[0]

    class Ops:                                   # the op, its time by scaling and tiles/block
        padded_splits = staticmethod(bc.pct.padded_splits)
        TILE_M = bc.pct.TILE_M
        tpb, half = 1, False

        @staticmethod
        def set_tiles_per_block(n):
            old, Ops.tpb = Ops.tpb, n
            return old

        @staticmethod
        def set_half_tiles(on):
            old, Ops.half = Ops.half, on
            return old

        @staticmethod
        def multi_pad_cast_transpose(x, m_splits, dtype=None, scale=None):
            assert x in ("x0", "x1") and m_splits == cfg.m_splits()
            gpu.work("ours", (1.0 if scale is None else 0.8) - 0.1 * (Ops.tpb - 1)
                     - 0.05 * Ops.half)(0)

    compiled = {"fn": gpu.work("compile", 1.5)}
    monkeypatch.setattr(bc, "QUICK_CAST", (cfg,))
    monkeypatch.setattr(bc, "pct", Ops)
    monkeypatch.setattr(bc, "_cast_inputs", lambda cfg, copies, torch: (["x0", "x1"], None, 1))
    monkeypatch.setattr(bc, "_torch_peers", lambda cfg, x, m, compile_peer: (
        lambda x: gpu.work("eager", 3.0)(0), compiled["fn"] if compile_peer else None))
    monkeypatch.setattr(bc, "copy_bandwidth_gbs", lambda: 4000.0)
    monkeypatch.setattr(bc, "l2_cache_bytes", lambda: 50 << 20)
    rows: list[dict] = []
    bc.bench_cast(True, rows)
    got = {(r["impl"], r["scaling"]): r for r in rows}
    assert list(got) == [("cugrouped", "current"), ("cugrouped-tpb2", "current"),
                         ("cugrouped-half", "current"),
                         ("cugrouped", "delayed"), ("cugrouped-tpb2", "delayed"),
                         ("cugrouped-half", "delayed"),
                         ("torch-eager", "current"), ("torch-compile", "current")]
    assert [r["ms"] for r in rows] == pytest.approx([1.0, 0.9, 0.95, 0.8, 0.7, 0.75, 3.0, 1.5],
                                                    abs=1e-9)
    assert Ops.tpb == 1 and Ops.half is False    # set back after each variant's call
    assert got["cugrouped-tpb2", "delayed"]["pct_copy_bw"] == pytest.approx(
        got["cugrouped", "delayed"]["pct_copy_bw"] * 0.8 / 0.7)
    assert got["cugrouped-half", "current"]["tile_fill_pct"] == pytest.approx(
        bc.tile_fill_pct(cfg.m_splits(), half=True))
    ours = got["cugrouped", "current"]
    nbytes = bc.cast_bytes(cfg.tokens, cfg.k, sum(bc.pct.padded_splits(cfg.m_splits(), 16)),
                           True, 50 << 20)
    assert ours["gbs"] == pytest.approx(nbytes / 1.0 / 1e6)
    assert ours["pct_copy_bw"] == pytest.approx(100 * ours["gbs"] / 4000.0)
    assert ours["host_us_per_expert"] == pytest.approx(ours["host_us"] / cfg.experts)
    assert got["torch-eager", "current"]["speedup_of_cugrouped"] == pytest.approx(3.0)
    assert got["torch-compile", "current"]["speedup_of_cugrouped"] == pytest.approx(1.5)
    assert all("drift_pct" in r and r["lead_ms"] == 0.2 for r in rows)

    compiled["fn"] = gpu.work("compile", 2.0)    # the later section: the peer alone
    bc.bench_cast(True, rows, impls=("torch-compile",))
    assert rows[-1]["impl"] == "torch-compile" and rows[-1]["speedup_of_cugrouped"] == \
        pytest.approx(2.0)

    def fails(x):
        raise RuntimeError("backend='inductor' raised: no C compiler")

    compiled["fn"] = fails
    n = len(rows)
    bc.bench_cast(True, rows)
    assert [r["impl"] for r in rows[n:]] == \
        ["cugrouped", "cugrouped-tpb2", "cugrouped-half"] * 2 + ["torch-eager"]
    assert "torch-compile  skipped: RuntimeError: backend='inductor' raised" in \
        capsys.readouterr().out

    def broken(*a, **k):
        raise ValueError("ours is broken")

    monkeypatch.setattr(Ops, "multi_pad_cast_transpose", staticmethod(broken))
    with pytest.raises(ValueError, match="ours is broken"):
        bc.bench_cast(True, rows)
