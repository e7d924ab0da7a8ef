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
