"""The GEMM benchmark's pure parts on the CPU: the frozen configs, FLOP counting, that the module
imports without torch or a GPU, and the host-loop benchmark (real descriptors, device calls
faked). The GPU part runs in the GPU check (``python -m cugrouped bench gemm``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cugrouped.bench import gemm as bg


def test_imports_without_torch_or_a_gpu():
    code = ("import sys; sys.modules['torch'] = None; import cugrouped.bench.gemm as g; "
            "assert callable(g.bench_gemm); print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.parametrize("cfg", bg.GEMM_CONFIGS, ids=lambda c: c.name)
def test_configs(cfg):
    m = cfg.m_splits()
    assert len(m) == cfg.experts and sum(m) == cfg.tokens and min(m) >= 0
    assert cfg.k % 16 == 0 and cfg.n % 16 == 0  # FP8 GEMMs need it
    if cfg.jagged:
        assert m[cfg.experts // 3] == 0, "the jagged set always has an empty expert"
        assert len(set(m)) > 2
    else:
        assert max(m) - min(m) <= cfg.tokens % cfg.experts
    assert cfg.m_splits() == m  # deterministic
    hash(cfg)  # frozen


def test_config_set_covers_the_issue_shapes():
    names = {c.name for c in bg.GEMM_CONFIGS}
    assert len(names) == len(bg.GEMM_CONFIGS)
    shapes = {(c.experts, c.k, c.n) for c in bg.GEMM_CONFIGS}
    assert {(8, 7168, 2048), (16, 4096, 2048), (16, 1024, 4096), (8, 4096, 14336),
            (8, 14336, 4096)} <= shapes
    dsv3 = [c for c in bg.GEMM_CONFIGS if (c.experts, c.k, c.n) == (8, 7168, 2048)]
    assert {c.tokens for c in dsv3} == {16384, 65536} and {c.jagged for c in dsv3} == {True, False}
    assert any(c.experts == 64 and c.tokens // c.experts <= 256 for c in bg.GEMM_CONFIGS)
    assert len(bg.QUICK_GEMM) == 2 and set(bg.QUICK_GEMM) <= set(bg.GEMM_CONFIGS)


def test_flops():
    cfg = bg.GemmBench("t", 3, 32, 48, 100, False)
    for p in bg.PASSES:
        assert bg.gemm_flops(cfg, p) == 2 * 100 * 32 * 48
    with pytest.raises(ValueError, match="pass_name: got 'bwd'"):
        bg.gemm_flops(cfg, "bwd")


def test_host_loop_bench_runs_on_the_cpu():
    pytest.importorskip("torch")
    rows = []
    bg.bench_host_loop(rows, experts=(4,), reps=3)
    row, trow = rows
    assert row["op"] == "gemm-host" and row["config"] == "E4" and row["host_us_per_expert"] > 0
    # torch tensors over the same buffers, read as CUDA tensors are; and as the torch layer calls
    assert trow["op"] == "gemm-host-torch" and trow["config"] == "E4"
    assert trow["host_us_per_expert"] > 0 and trow["layer_us"] > 0 and trow["cold_us"] > 0


def test_host_loop_bench_without_torch():
    code = ("import sys; sys.modules['torch'] = None; import cugrouped.bench.gemm as g; rows = []; "
            "g.bench_host_loop(rows, experts=(4,), reps=2); print([r['op'] for r in rows])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip().endswith("['gemm-host']"), res.stderr


def test_gemm_bytes_by_hand():
    class Cfg(bg.GemmBench):                        # m = [33, 0, 67]: T = 100, T' = 48 + 80
        def m_splits(self):
            return [33, 0, 67]

    cfg = Cfg("t", 3, 32, 48, 100, False)
    T, Tp, k, n, W = 100, 128, 32, 48, 3 * 48 * 32
    assert bg.gemm_bytes(cfg, "fprop", fp8=True) == T * k + W + 2 * T * n
    assert bg.gemm_bytes(cfg, "dgrad", fp8=False) == 2 * T * n + 2 * W + 2 * T * k
    assert bg.gemm_bytes(cfg, "wgrad", fp8=True, out_bytes=4) == Tp * k + Tp * n + 4 * W
    assert bg.gemm_bytes(cfg, "wgrad", fp8=False) == 2 * T * k + 2 * T * n + 2 * W
    with pytest.raises(ValueError, match="pass_name: got 'bwd'"):
        bg.gemm_bytes(cfg, "bwd", fp8=True)


def test_2d2d_wgrad_groups_drop_empty_experts_and_pad():
    live, ends = bg.wgrad_2d2d_groups([33, 0, 67, 16, 0])
    assert live == [0, 2, 3] and ends == [48, 128, 144]
    assert bg.check_2d2d_offs(ends, 144) is None
    assert bg.wgrad_2d2d_groups([0, 0]) == ([], [])


def test_2d2d_wgrad_scales_are_group_major():
    """torch's 2-D x 2-D kernel reads group g's scales at ``scale_a + g * n`` and ``scale_b + g *
    k``: each non-empty expert's per-tensor scale, repeated over dy's n rows and x's k columns."""
    torch = pytest.importorskip("torch")
    sdy, sx = torch.tensor([1., 2., 3., 4.]), torch.tensor([10., 20., 30., 40.])
    sa, sb = bg.wgrad_2d2d_scales(sdy, sx, torch.tensor([0, 2, 3]), n=3, k=2)
    assert sa.tolist() == [1.] * 3 + [3.] * 3 + [4.] * 3 and sa.is_contiguous()
    assert sb.tolist() == [10.] * 2 + [30.] * 2 + [40.] * 2 and sb.is_contiguous()


@pytest.mark.parametrize("offs, rows, why", [
    ([16, 16, 48], 48, "group 1 has 0 rows (must be > 0)"),        # an empty expert kept
    ([16, 40, 64], 64, "group 1 has 24 rows, not a multiple of 16"),
    ([16, 8], 8, "group 1 has -8 rows"),
    ([33], 33, "group 0 has 33 rows, not a multiple of 16"),     # unpadded counts
    ([16, 32], 48, "the offsets end at 32, the operands have 48 rows"),
    ([], 0, "no non-empty group"),
])
def test_2d2d_offsets_that_would_device_assert_are_refused(offs, rows, why):
    assert why in bg.check_2d2d_offs(offs, rows)


def _meta_sets(cfg, m):
    """Meta-tensor stand-ins for ``_cugrouped_calls``' CuPy operands (same shapes and layouts)."""
    import types

    torch = pytest.importorskip("torch")
    mp = [-(-v // 16) * 16 for v in m]
    T, E, k, n = sum(m), cfg.experts, cfg.k, cfg.n
    u8 = dict(dtype=torch.uint8, device="meta")
    grouped = lambda rows, cols, pad: types.SimpleNamespace(  # noqa: E731
        data=torch.empty((rows, cols), **u8), data_t=torch.empty((cols * sum(pad),), **u8),
        scale_inv=torch.empty((E,), dtype=torch.float32, device="meta"))
    f16 = lambda *shape: torch.empty(shape, dtype=torch.float16, device="meta")  # noqa: E731
    return [dict(X=grouped(T, k, mp), DY=grouped(T, n, mp), W=grouped(E * n, k, [n] * E),
                 x=f16(T, k), dy=f16(T, n), w=f16(E, n, k))]


@pytest.mark.parametrize("cfg", bg.QUICK_GEMM + (bg.GemmBench("tiny", 6, 64, 32, 300, True),),
                         ids=lambda c: c.name)
def test_every_torch_peer_passes_torchs_checks_on_meta_tensors(cfg, monkeypatch, capsys):
    """The peers' calls on meta tensors: torch's shape, dtype, layout and scale-shape checks (its
    meta registrations) run as on the GPU, for every pass; the 2-D x 2-D ``_scaled_grouped_mm``
    wgrad gives the non-empty experts' dW in bfloat16."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch, "from_dlpack", lambda a: a)      # meta tensors stand in for CuPy's
    m = cfg.m_splits()
    assert 0 in m                                               # the jagged set: an empty expert
    peers = bg._torch_peers(cfg, m, _meta_sets(cfg, m), device="meta")
    assert "wgrad not run" not in capsys.readouterr().out
    live = [e for e in range(cfg.experts) if m[e]]
    T, Tp = sum(m), sum(-(-v // 16) * 16 for v in m)
    want = {"fprop": (T, cfg.n), "dgrad": (T, cfg.k)}
    assert set(peers) == {"torch-scaled_mm-loop", "torch-scaled_grouped_mm",
                          "torch-grouped_mm-bf16", "torch-linear-loop-bf16"}
    for name, fns in peers.items():
        assert set(fns) == set(bg.PASSES), name
        for p, fn in fns.items():
            out = fn(0)
            if isinstance(out, list):                            # per-expert loops
                assert len(out) == len(live), (name, p)
                out = torch.cat(out) if p != "wgrad" else torch.stack(out)
            rows = Tp if name.startswith("torch-scaled") and p != "wgrad" else T
            if p == "wgrad":
                n_out = len(live) if "scaled" in name or "loop" in name else cfg.experts
                assert tuple(out.shape) == (n_out, cfg.n, cfg.k), (name, p)
            else:
                assert tuple(out.shape) == (rows, want[p][1]), (name, p)
            assert out.dtype == (torch.float32 if name == "torch-scaled_mm-loop" and p == "wgrad"
                                 else torch.bfloat16), (name, p)


def test_wgrad_speedups_compare_like_output_dtypes():
    """wgrad: the float32-dW peer (_scaled_mm loop) against our float32-dW row, the bfloat16
    peers and our float16 row against our bfloat16-dW row; 16-bit rows say cast excluded."""
    name = lambda p: {"wgrad": p, "fprop": p, "dgrad": p}  # noqa: E731
    peers = {"torch-scaled_mm-loop": name("sm"), "torch-scaled_grouped_mm": name("sg"),
             "torch-grouped_mm-bf16": name("gm")}
    fp8 = {"fprop": "f8", "dgrad": "d8", "wgrad": "w8", "wgrad-bf16": "w8bf"}
    impls = bg._impls("wgrad", fp8, {p: "f16" for p in bg.PASSES}, peers)
    assert impls[1][0] == "cugrouped-fp8-s16" and impls[1][2:] == (True, True, "float32")
    assert impls[2][0] == "cugrouped-fp8-t4" and impls[2][2:] == (True, True, "float32")
    del impls[1:3]         # (their functions: test_the_wide_row_runs_on_16_side_streams, ...)
    assert [(i[0], i[1], i[2], i[4]) for i in impls] == [
        ("cugrouped-fp8", "w8", True, "float32"), ("cugrouped-fp8-bf16dW", "w8bf", True, "bfloat16"),
        ("cugrouped-fp16", "f16", False, "float16"), ("torch-scaled_mm-loop", "sm", True, "float32"),
        ("torch-scaled_grouped_mm", "sg", True, "bfloat16"),
        ("torch-grouped_mm-bf16", "gm", False, "bfloat16")]
    refs, ms = {}, {"cugrouped-fp8": 2.0, "cugrouped-fp8-bf16dW": 1.0}
    cols = {impl: bg.speedup_columns(impl, f8, dt, ms.get(impl, 3.0), refs)
            for impl, _, f8, _, dt in impls}
    assert cols["cugrouped-fp8"] == cols["cugrouped-fp8-bf16dW"] == {}
    assert cols["torch-scaled_mm-loop"] == dict(speedup_of_cugrouped_fp8=1.5,
                                                speedup_reference="cugrouped-fp8")
    assert cols["torch-scaled_grouped_mm"] == dict(speedup_of_cugrouped_fp8=3.0,
                                                   speedup_reference="cugrouped-fp8-bf16dW")
    for impl in ("cugrouped-fp16", "torch-grouped_mm-bf16"):
        assert cols[impl] == dict(speedup_of_cugrouped_fp8=3.0, speedup_reference="cugrouped-fp8-bf16dW",
                                  speedup_note="GEMM only, cast excluded"), impl
    # fprop: one reference, bf16 output everywhere
    fprop = bg._impls("fprop", fp8, {p: "f16" for p in bg.PASSES}, peers)
    assert [i[0] for i in fprop][:4] == ["cugrouped-fp8", "cugrouped-fp8-s16", "cugrouped-fp8-t4",
                                         "cugrouped-fp16"]
    assert {i[4] for i in fprop} == {"bfloat16", "float16"}


def test_the_wide_row_runs_on_16_side_streams():
    """The ``-s16`` row calls our FP8 function with 16 side streams set, and sets back the count
    the call found, also when it raises."""
    from cugrouped.ops import grouped_gemm as gg

    seen = []

    def fp8_fprop(i):
        seen.append((i, gg.side_streams()))
        if i == 2:
            raise RuntimeError("boom")

    fp8 = {"fprop": fp8_fprop, "dgrad": None, "wgrad": None, "wgrad-bf16": None}
    [wide] = [fn for impl, fn, *_ in bg._impls("fprop", fp8, {p: None for p in bg.PASSES}, {})
              if impl == "cugrouped-fp8-s16"]
    wide(1)
    with pytest.raises(RuntimeError, match="boom"):
        wide(2)
    assert seen == [(1, 16), (2, 16)] and gg.side_streams() == gg.NUM_STREAMS


def test_the_threaded_row_issues_from_4_host_threads():
    """The ``-t4`` row calls our FP8 function with 4 host threads set, and sets back the count
    the call found."""
    from cugrouped.ops import grouped_gemm as gg

    seen = []
    fp8 = {"fprop": lambda i: seen.append(gg.host_threads()), "dgrad": None, "wgrad": None,
           "wgrad-bf16": None}
    [threaded] = [fn for impl, fn, *_ in bg._impls("fprop", fp8, {p: None for p in bg.PASSES}, {})
                  if impl == "cugrouped-fp8-t4"]
    threaded(0)
    assert seen == [4] and gg.host_threads() == 1


def test_our_16_bit_wgrad_dw_dtypes_pass_the_ops_checks():
    """The dW dtypes the bench asks of grouped_wgrad on the GPU (bfloat16 bits in uint16 from FP8
    operands, float16 from float16 ones) pass its checks and plan, the device calls faked."""
    import numpy as np

    from cugrouped import multi_pad_cast_transpose
    from cugrouped.ops import grouped_gemm as gg

    m, k, n = [5, 0, 40], 32, 48
    x = np.random.default_rng(0).standard_normal((45, k)).astype(np.float16)
    dy = np.random.default_rng(1).standard_normal((45, n)).astype(np.float16)
    X = multi_pad_cast_transpose(x, m, dtype="float16")
    DY = multi_pad_cast_transpose(dy, m, dtype="float16", fp8_format="e5m2")
    kw = lambda dt: dict(out_dtype=dt, fast_accum=False, accumulate=False)  # noqa: E731
    st = bg.host_loop_state()
    gg.launch_checked(gg.checked("wgrad", (X, DY), kw("bfloat16")), np.empty((3, n, k), np.uint16),
                      np, st)
    xs, dys = [x[:5], x[5:5], x[5:]], [dy[:5], dy[5:5], dy[5:]]
    gg.launch_checked(gg.checked("wgrad", (xs, dys), kw("float16")), np.empty((3, n, k), np.float16),
                      np, st)
    gg.clear_memo()


def test_bench_gemm_rows_on_a_model_gpu(monkeypatch, capsys):
    """The GEMM section's rows from one interleaved timing per pass (its GPU calls replaced by
    work on a model GPU, tests/_model_gpu.py): every implementation's time, host time and
    drift, cugrouped's host time per expert, the speed-ups over the FP8 row of the same output
    width, and a peer that refuses a pass reported and left out."""
    import _model_gpu

    from cugrouped.bench import common

    gpu = _model_gpu.ModelGPU(monkeypatch)
    cost = {"cugrouped-fp8": 1.0, "cugrouped-fp8-bf16dW": 0.9, "cugrouped-fp16": 1.6,
            "torch-scaled_mm-loop": 2.0, "torch-scaled_grouped_mm": 1.25,
            "torch-grouped_mm-bf16": 1.8, "torch-linear-loop-bf16": 3.0}

    def refuses(i):
        raise RuntimeError("mat2 must be column major")

    def ours(cfg, m_splits, copies):
        fp8 = {p: gpu.work(f"fp8 {p}", cost["cugrouped-fp8"]) for p in bg.PASSES}
        fp8["wgrad-bf16"] = gpu.work("fp8 wgrad-bf16", cost["cugrouped-fp8-bf16dW"])
        return None, fp8, {p: gpu.work(f"fp16 {p}", cost["cugrouped-fp16"]) for p in bg.PASSES}

    def peers(cfg, m_splits, sets):
        out = {name: {p: gpu.work(name, cost[name]) for p in bg.PASSES}
               for name in list(cost)[3:]}
        out["torch-scaled_grouped_mm"]["wgrad"] = refuses
        return out

    cfg = bg.GEMM_CONFIGS[1]
    monkeypatch.setattr(bg, "QUICK_GEMM", (cfg,))
    monkeypatch.setattr(bg, "_cugrouped_calls", ours)
    monkeypatch.setattr(bg, "_torch_peers", peers)
    monkeypatch.setattr(bg, "dense_peaks_tflops", lambda: {"bf16": 900.0, "fp8": 1800.0})
    monkeypatch.setattr(common, "copy_bandwidth_gbs", lambda: 4000.0)
    rows: list[dict] = []
    bg.bench_gemm(True, rows)
    assert "wgrad torch-scaled_grouped_mm  skipped: RuntimeError: mat2 must be column major" in \
        capsys.readouterr().out
    got = {(r["pass_name"], r["impl"]): r for r in rows}
    # each pass: our FP8 loop on 4 and on 16 side streams and from 4 host threads, our fp16,
    # the peers (one refuses)
    assert len(rows) == 8 + 8 + 8 and ("wgrad", "torch-scaled_grouped_mm") not in got
    for (pass_name, impl), r in got.items():
        base = impl if impl not in bg.VARIANTS else "cugrouped-fp8"   # the same work
        assert r["ms"] == pytest.approx(cost[base], abs=1e-9), (pass_name, impl)
        assert r["tflops"] == pytest.approx(bg.gemm_flops(cfg, pass_name) / r["ms"] / 1e9)
        assert r["lead_ms"] == 0.2 and abs(r["drift_pct"]) < 1e-6
        assert ("host_us_per_expert" in r) == impl.startswith("cugrouped")
        assert r.get("gemm_path") == ("loop" if impl.startswith("cugrouped") else None)
    fp = got[("fprop", "torch-scaled_grouped_mm")]
    assert fp["speedup_of_cugrouped_fp8"] == pytest.approx(1.25)
    assert fp["speedup_reference"] == "cugrouped-fp8"
    # wgrad: the float32 dW peer against cugrouped's float32 dW, the 16-bit ones against bf16 dW
    assert got[("wgrad", "torch-scaled_mm-loop")]["speedup_of_cugrouped_fp8"] == \
        pytest.approx(2.0)
    assert got[("wgrad", "torch-grouped_mm-bf16")]["speedup_of_cugrouped_fp8"] == \
        pytest.approx(2.0)
    assert got[("wgrad", "torch-grouped_mm-bf16")]["speedup_note"] == bg.CAST_EXCLUDED


def test_the_wide_row_is_never_the_peers_reference():
    """With the default loop's row missing (skipped), the 16-stream row does not become the
    reference the peers' speed-ups (and the targets) are taken against."""
    refs: dict = {}
    assert bg.speedup_columns("cugrouped-fp8-s16", True, "bfloat16", 1.0, refs) == {}
    assert bg.speedup_columns("cugrouped-fp8-t4", True, "bfloat16", 1.0, refs) == {}
    assert refs == {}
    assert bg.speedup_columns("torch-scaled_grouped_mm", True, "bfloat16", 2.0, refs) == {}
    assert bg.speedup_columns("cugrouped-fp8", True, "bfloat16", 4.0, refs) == {}
    assert bg.speedup_columns("torch-scaled_grouped_mm", True, "bfloat16", 2.0, refs) == dict(
        speedup_of_cugrouped_fp8=0.5, speedup_reference="cugrouped-fp8")


def test_path_taken_reads_the_launch_records():
    """A cugrouped row's ``gemm_path`` is what its call launched: cuBLASLt's grouped call, or
    the loop's per-expert calls (or nothing launched at all: the loop's reading)."""
    from cugrouped.ops import _launch

    assert bg.path_taken(lambda i: _launch.note_launch("cuda", "cublasLtMatmul[grouped]", 1, 1)) \
        == "grouped"
    assert bg.path_taken(lambda i: [_launch.note_launch("cuda", "cublasLtMatmul", 1, 1)
                                    for _ in range(3)]) == "loop"
    assert bg.path_taken(lambda i: None) == "loop"
