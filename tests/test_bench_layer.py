"""The layer benchmark's pure parts on the CPU: it imports without torch, its configs, FLOP and
byte counting, the torch baseline against GroupedLinear's non-FP8 path in float64, and every timed
step run once on CPU tensors. The timing itself runs in the GPU check
(``python -m cugrouped bench layer``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cugrouped.bench import layer as bl
from cugrouped.bench.gemm import GemmBench

torch = pytest.importorskip("torch")

from cugrouped.pytorch import GroupedLinear, cpu_cast_backend  # noqa: E402


def test_imports_without_torch_or_a_gpu():
    code = ("import sys; sys.modules['torch'] = None; import cugrouped.bench.layer as L; "
            "assert callable(L.bench_layer); print(L.layer_flops(L.QUICK_LAYER[0]) > 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr


def test_configs():
    assert len(bl.QUICK_LAYER) == 2 and set(bl.QUICK_LAYER) <= set(bl.LAYER_CONFIGS)
    shapes = {(c.experts, c.k, c.n) for c in bl.LAYER_CONFIGS}
    assert {(8, 7168, 2048), (16, 4096, 2048), (16, 1024, 4096), (8, 4096, 14336),
            (8, 14336, 4096)} <= shapes
    assert any(c.experts == 64 for c in bl.LAYER_CONFIGS)
    for c in bl.LAYER_CONFIGS:
        m = c.m_splits()
        assert c.k % 16 == 0 and c.n % 16 == 0 and sum(m) == c.tokens
        if c.jagged:
            assert 0 in m
    assert any(c.jagged for c in bl.QUICK_LAYER)


def test_flops():
    cfg = GemmBench("t", 3, 32, 48, 100, False)
    assert bl.layer_flops(cfg) == 3 * 2 * 100 * 32 * 48


def test_bytes_by_hand():
    # m = [33, 0, 67]: T = 100, padded T' = 48 + 0 + 80 = 128; k = 32, n = 48, W = 3*48*32
    class Cfg(GemmBench):
        def m_splits(self):
            return [33, 0, 67]

    cfg = Cfg("t", 3, 32, 48, 100, False)
    T, Tp, k, n, W = 100, 128, 32, 48, 3 * 48 * 32
    assert bl.layer_bytes(cfg, "bf16") == 6 * T * k + 6 * T * n + 6 * W
    delayed = (2 * T * k + T * k + Tp * k        # cast x: read bf16, write rows + padded columns
               + 2 * T * n + T * n + Tp * n      # cast dy
               + 2 * W + 2 * W                   # cast W: read bf16, write W8 and W8^T
               + T * k + W + 2 * T * n           # fprop
               + T * n + W + 2 * T * k           # dgrad
               + Tp * k + Tp * n + 2 * W)        # wgrad
    assert bl.layer_bytes(cfg, "fp8-delayed") == delayed
    assert bl.layer_bytes(cfg, "fp8-current") == delayed + 2 * T * k + 2 * T * n + 2 * W
    # the amax pass's second read counted only for the tensors larger than L2: here x (6400
    # bytes), dy (9600) and W (9216) fit in 9600 bytes; in 9000 bytes dy and W do not
    assert bl.layer_bytes(cfg, "fp8-current", l2_bytes=9600) == delayed
    assert bl.layer_bytes(cfg, "fp8-current", l2_bytes=9000) == delayed + 2 * T * n + 2 * W
    assert bl.layer_bytes(cfg, "fp8-delayed", l2_bytes=9000) == delayed
    with pytest.raises(ValueError, match="precision: got 'fp16'"):
        bl.layer_bytes(cfg, "fp16")


@pytest.mark.parametrize("splits", [[5, 17, 40], [0, 9, 23], [12, 0, 7], [30, 1, 0], [16, 32, 48]])
@pytest.mark.parametrize("align", [16, 1])
def test_torch_baseline_equals_grouped_linear_float64(splits, align):
    """The baseline is the same layer: outputs, dx, dW and db equal GroupedLinear's non-FP8 path
    (float64, same weights and biases) to the last few bits (padding changes BLAS blocking)."""
    torch.manual_seed(0)
    layer = GroupedLinear(3, 32, 48, bias=True, params_dtype=torch.float64, device="cpu")
    with torch.no_grad():
        for b in layer.biases():
            b.normal_()
    x = torch.randn(sum(splits), 32, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(sum(splits), 48, dtype=torch.float64)
    params = [*layer.weights(), *layer.biases()]
    y_ref = layer(x, splits)
    g_ref = torch.autograd.grad(y_ref, [x, *params], dy)
    y = bl.torch_baseline(x, splits, layer.weights(), layer.biases(), align=align)
    g = torch.autograd.grad(y, [x, *params], dy)
    tol = dict(rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(y, y_ref, **tol)
    for i, (a, b) in enumerate(zip(g, g_ref)):
        torch.testing.assert_close(a, b, **tol, msg=f"grad {i}")
    for e, m in enumerate(splits):   # an empty expert: zero weight and bias gradients
        if m == 0:
            assert not g[1 + e].any() and not g[1 + 3 + e].any()


def test_torch_baseline_pads_and_unpads(monkeypatch):
    """With align=16 the per-expert F.linear sees 16-row multiples (what FP8 frameworks pad to)."""
    seen = []
    w = [torch.randn(8, 16) for _ in range(3)]
    orig = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, *a: seen.append(x.shape[0]) or orig(x, *a))
    y = bl.torch_baseline(torch.randn(21, 16), [5, 0, 16], w)
    assert seen == [16, 0, 16] and y.shape == (21, 8)
    with pytest.raises(ValueError, match="m_splits, weights, biases: expected one per expert"):
        bl.torch_baseline(torch.randn(21, 16), [5, 16], w)


def test_every_timed_step_runs_on_cpu_tensors():
    """The callables the GPU bench times, run once each on CPU tensors (FP8 casts on the NumPy
    twins): right gradient shapes, list and tensor forms agree, FP8 within 10% of the 16-bit layer,
    the torch baselines equal the 16-bit layer."""
    cfg = GemmBench("tiny", 4, 32, 48, 70, True)
    with cpu_cast_backend("reference"):
        layer, impls = bl.layer_steps(cfg, "cpu", torch.float32, copies=2)
        names = [i[0] for i in impls]
        assert names[0] == bl.REFERENCE_IMPL and len(set(names)) == len(names) == 13
        assert "torch-grouped_mm-bf16" in names
        out, permuted, gated = {}, {}, {}
        for name, precision, form, step in impls:
            assert precision in bl.PRECISIONS and form in ("tensor", "list", "permute", "swiglu")
            step(1)
            y, grads = step(1)
            y = torch.cat(y) if form == "list" else y
            dx = torch.cat(grads[:cfg.experts]) if form == "list" else grads[0]
            dw = grads[-1] if grads[-1].dim() == 3 else grads[-cfg.experts:]   # _grouped_mm: (E, n, k)
            rows = cfg.tokens // 2 if form == "permute" else cfg.tokens
            width = 2 * cfg.k if form == "swiglu" else cfg.k      # fc1's [a | b] output
            assert y.shape == (cfg.tokens, cfg.n) and dx.shape == (rows, width)
            assert all(g.shape == (cfg.n, cfg.k) for g in dw)
            {"permute": permuted, "swiglu": gated}.get(form, out)[name] = (y.detach(), dx, dw)
    # the fused permute and index_select + the layer: the same step, bit for bit (float32)
    a, b = permuted["cugrouped-fp8-delayed-permute"], permuted["index_select+cugrouped-fp8-delayed"]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(u, v) for u, v in zip(a[2], b[2]))
    ref = out["cugrouped-bf16-tensor"]
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    # the activation in the cast and in torch first: the same step to FP8 precision
    a, b = gated["cugrouped-fp8-delayed-swiglu"], gated["torch-swiglu+cugrouped-fp8-delayed"]
    close = lambda u, v: float((u - v).norm()) <= 0.02 * float(v.norm())  # noqa: E731
    assert close(a[0], b[0]) and close(a[1], b[1])
    assert all(close(u, v) for u, v in zip(a[2], b[2]))     # (an empty expert's: zeros)
    for name, (y, dx, dw) in out.items():
        if "fp8" in name:
            assert rel(y, ref[0]) < 0.1 and rel(dx, ref[1]) < 0.1, name
        else:
            torch.testing.assert_close(y, ref[0], rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(dx, ref[1], rtol=1e-5, atol=1e-6, msg=name)
    for p in ("fp8-delayed", "fp8-current", "bf16"):
        a, b = out[f"cugrouped-{p}-tensor"], out[f"cugrouped-{p}-list"]
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert all(torch.equal(u, v) for u, v in zip(a[2], b[2]))


def test_bench_layer_without_a_gpu_skips(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the GPU check runs the real benchmark")
    rows = []
    bl.bench_layer(True, rows)
    assert rows == [] and "skipped" in capsys.readouterr().out


def test_bench_layer_rows_on_a_model_gpu(monkeypatch):
    """The layer section on a model GPU (tests/_model_gpu.py; torch's CUDA and the layer's steps
    replaced): every implementation timed in one interleaved run, its row's times, speed-ups
    (over the FP8 delayed tensor row; the explicit permute over the fused one; the eager step
    over its CUDA graph replay), the FP8 rows' error against the bf16 layer, and an
    implementation failing its first step left out."""
    import _model_gpu

    from cugrouped.bench import common, gemm

    gpu = _model_gpu.ModelGPU(monkeypatch)
    cost = {"cugrouped-fp8-delayed-tensor": 2.0, "cugrouped-bf16-tensor": 3.0,
            "torch-linear-loop-bf16": 5.0, "cugrouped-fp8-delayed-permute": 2.2,
            "index_select+cugrouped-fp8-delayed": 2.75, "cugrouped-fp8-delayed-swiglu": 2.4,
            "torch-swiglu+cugrouped-fp8-delayed": 3.6, "cugrouped-fp8-current-tensor": 2.4,
            "cugrouped-fp8-current-graphed": 1.6}
    y_ref = torch.ones(4)

    def step(impl, y):
        work = gpu.work(impl, cost[impl])

        def fn(i):
            work(i)
            return y, ()
        return fn

    def fails(i):
        raise RuntimeError("no FP8 on this GPU")

    def layer_steps(cfg, device, dtype, copies):
        impls = [(impl, "bf16" if "bf16" in impl else "fp8-delayed",
                  "permute" if "permute" in impl or "index_select" in impl else
                  "swiglu" if "swiglu" in impl else "graph" if "graphed" in impl else "tensor",
                  step(impl, y_ref if "bf16" in impl else y_ref * 1.01)) for impl in cost]
        impls.insert(1, ("cugrouped-fp8-current-list", "fp8-current", "list", fails))
        return None, impls

    cfg = bl.LAYER_CONFIGS[0]
    monkeypatch.setattr(bl, "QUICK_LAYER", (cfg,))
    monkeypatch.setattr(bl, "layer_steps", layer_steps)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "model GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(gemm, "dense_peaks_tflops", lambda: {"bf16": 900.0, "fp8": 1800.0})
    monkeypatch.setattr(common, "copy_bandwidth_gbs", lambda: 4000.0)
    monkeypatch.setattr(common, "l2_cache_bytes", lambda: 50 << 20)
    rows: list[dict] = []
    bl.bench_layer(True, rows)
    got = {r["impl"]: r for r in rows}
    assert list(got) == list(cost)
    for impl, r in got.items():
        assert r["ms"] == pytest.approx(cost[impl], abs=1e-9), impl
        assert r["tflops"] == pytest.approx(bl.layer_flops(cfg) / r["ms"] / 1e9)
        assert r["host_us_per_expert"] == pytest.approx(r["host_us"] / cfg.experts)
        assert "drift_pct" in r and r["lead_ms"] == 0.2
    assert got["cugrouped-bf16-tensor"]["speedup_of_cugrouped_fp8"] == pytest.approx(1.5)
    assert got["torch-linear-loop-bf16"]["speedup_of_cugrouped_fp8"] == pytest.approx(2.5)
    assert got["index_select+cugrouped-fp8-delayed"]["speedup_of_fused_permute"] == \
        pytest.approx(1.25)
    assert got["torch-swiglu+cugrouped-fp8-delayed"]["speedup_of_fused_swiglu"] == \
        pytest.approx(1.5)
    assert "pct_roofline" not in got["cugrouped-fp8-delayed-swiglu"]
    assert "pct_roofline" in got["cugrouped-fp8-delayed-tensor"]
    assert got["cugrouped-fp8-delayed-tensor"]["rel_err_vs_bf16"] == pytest.approx(0.01)
    assert "rel_err_vs_bf16" not in got["cugrouped-fp8-delayed-permute"]
    # the graph replay against the eager step it captured (not against the delayed row)
    assert got["cugrouped-fp8-current-graphed"]["speedup_of_graph"] == pytest.approx(1.5)
    assert "speedup_of_cugrouped_fp8" not in got["cugrouped-fp8-current-graphed"]
    assert got["cugrouped-fp8-current-graphed"]["rel_err_vs_bf16"] == pytest.approx(0.01)
