"""The command line: demo, info, bench and compile-check run for real on this GPU-less machine."""

from __future__ import annotations

import pytest

from cugrouped.__main__ import main


def test_demo_on_cpu_checks_bits_and_prints_where_it_ran(capsys):
    assert main(["demo", "--device", "cpu", "--experts", "5", "--k", "64", "--n", "32",
                 "--tokens", "200"]) == 0
    out = capsys.readouterr().out
    assert "CPU emulator" in out and "bit-identical" in out and "demo: OK" in out
    assert " ms" in out


def test_demo_refuses_gpu_without_one(capsys):
    import cugrouped

    if cugrouped.gpu_available():
        return
    assert main(["demo", "--device", "gpu"]) == 1
    assert "no CUDA device" in capsys.readouterr().out


def test_info_lists_kernels(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "kernel pad_cast_transpose: pad_cast_transpose.cu, 30 instantiations" in out
    from cugrouped.cublaslt import _lib
    v = _lib.version()
    assert f"cuBLASLt {v // 10000}.{v // 100 % 100}.{v % 100} (" in out
    grouped = "exported (one call" if _lib.has_grouped_gemm() else "not in this library"
    assert f"cuBLASLt grouped GEMM: {grouped}" in out
    import torch
    from cupy.cuda import nvrtc
    assert f"NVRTC {'.'.join(map(str, nvrtc.getVersion()))};" in out
    assert f"torch {torch.__version__} (CUDA {torch.version.cuda})" in out


def test_compile_check_arch_list_and_without_cupy(capsys, monkeypatch):
    from cugrouped.__main__ import _arch_list
    assert _arch_list("sm_90, 100a,89") == ("90", "100a", "89")
    import sys
    monkeypatch.setitem(sys.modules, "cupy", None)           # import cupy -> ImportError
    assert main(["compile-check", "--arch", "90"]) == 2
    out = capsys.readouterr().out
    assert out.count("needs CuPy and NVRTC") == 1 and "pip install '.[cuda13]'" in out


def test_bench_without_gpu_says_what_it_skipped(tmp_path, capsys):
    assert main(["bench", "cast", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "cast op host path" in out
    import cugrouped

    if not cugrouped.gpu_available():
        assert "skipped" in out
    header = (tmp_path / "bench.csv").read_text().splitlines()[0]
    assert "gpu" in header and "host_us_per_expert" in header


@pytest.mark.skipif(__import__("cugrouped").gpu_available(), reason="the GPU-less behaviour")
def test_bench_layer_without_gpu_writes_nothing_and_says_so(tmp_path, capsys):
    assert main(["bench", "layer", "--quick", "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "skipped the device timings (layer forward+backward vs bf16 and torch, block vs " \
        "current scaling)" in out
    assert "nothing measured, so no CSV or plot written" in out and "wrote" not in out
    assert not list((tmp_path / "b").iterdir())


def test_bench_stopped_by_a_time_limit_keeps_what_it_measured(tmp_path, capsys, monkeypatch):
    """The GPU check stops a stage at its limit with SIGINT: the bench then writes the CSV (and
    plots) of the sections it finished, runs no further section and returns 130."""
    from cugrouped.bench import block

    ran = []

    def interrupted(rows):
        ran.append("block")
        raise KeyboardInterrupt

    monkeypatch.setattr(block, "bench_block_planning", interrupted)
    assert main(["bench", "all", "--out", str(tmp_path)]) == 130
    out = capsys.readouterr().out
    assert "bench block-cast-host: interrupted" in out and "bench cast-host:" in out
    assert "gemm-host" not in out and ran == ["block"]
    assert "these sections failed: block-cast-host (interrupted)" in out
    import csv

    with open(tmp_path / "bench.csv") as f:
        ops = [r["op"] for r in csv.DictReader(f)]
    # the finished sections' rows, all of them
    assert ops and set(ops) == {"cast-host", "launch-arg-host"}
    assert ops.count("cast-host") == out.count("cast op host path")
    assert ops.count("launch-arg-host") == out.count("cast kernel argument block") == 2


def test_compile_check_one_kernel_one_arch(capsys):
    assert main(["compile-check", "--kernel", "pad_cast_transpose", "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert "30 kernel compiles over 1 architectures, 0 problem(s)" in out


def test_compile_check_sass_summary(capsys):
    """``--sass``: one disassembly line per kernel under its resource line."""
    from cugrouped import _sass

    if _sass.find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    assert main(["compile-check", "--kernel", "scale_update", "--arch", "89", "--sass"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("sm_89")]
    assert len(rows) == 2
    for i in rows:
        assert lines[i + 1].split() == ["SASS:", "LDG.128", "x0,", "STG.128", "x0,", "F2FP", "x0,",
                                        "local", "memory", "x0"]


@pytest.mark.parametrize("argv, message", [
    (["demo", "--experts", "0"], "--experts: expected a positive integer, got '0'"),
    (["demo", "--experts", "abc"], "--experts: expected a positive integer, got 'abc'"),
    (["compile-check", "--arch", "abc"], "--arch: expected comma-separated architectures sm_80"),
    (["compile-check", "--arch", "90,75"], "sm_80 or newer (e.g. 90,100), got '75'"),
    (["compile-check", "--arch", ","], "--arch: expected at least one architecture"),
    (["demo", "--k", "100"], "--k: FP8 GEMMs need a multiple of 16, got 100"),
    (["compile-check", "--kernel", "nosuch"], "--kernel: unknown ['nosuch']; registered kernels:"),
])
def test_bad_command_lines_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_access_reports_sectors_and_bank_conflicts(capsys):
    assert main(["access", "block", "--k", "128", "--splits", "64,0,40"]) == 0
    out = capsys.readouterr().out
    assert "== block 1 x 128" in out and "== block 128 x 128" in out and "mxfp8" not in out
    # every input sector read once (104 rows of 128 bf16 = 832 sectors); no bank conflict
    assert out.count("read 832 sectors over 1 launch(es) (the inputs are 832)") == 2, out
    assert out.count(", 0 from bank conflicts") == 2, out


@pytest.mark.parametrize("bad", ["", "3,-1", "a,b"])
def test_access_refuses_bad_splits(bad, capsys):
    with pytest.raises(SystemExit):
        main(["access", "--splits", bad])
    assert "--splits" in capsys.readouterr().err
