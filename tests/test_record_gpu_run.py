"""scripts/record_gpu_run.py: a GPU check's folder into benchmarks/results/ and README's Status.
The JUnit XMLs are written by a real pytest run (pass, fail, error, skip), the CSV by the bench's
own writer with rows the targets read, the log in gpu_check.sh's format."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("record_gpu_run", ROOT / "scripts" / "record_gpu_run.py")
rec = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rec)

LOG = """gpu_check: python 3.12.3; numpy 2.5.2; torch 2.11.0
== gpu_check 2027-01-15T10:00:00Z at abc1234
NVIDIA H200, 580.159.03, 143771 MiB, 1980 MHz, 3201 MHz
== kernel warm-up (limit 120 s)
compiled 120 in 40.0 s
== kernel warm-up: rc=0 in 41 s
== GPU tests (limit 210 s)
== GPU tests: rc=1 in 150 s
== GPU tests, block scaling: STOPPED at its 60 s limit
== GPU tests, block scaling: rc=124 in 80 s
== benchmarks: rc=0 in 160 s
== done in 520 s: tests rc=1 block tests rc=124 bench rc=0 notebooks rc=0
"""

ENV = dict(date="2027-01-15", gpu="NVIDIA H200", driver=13000, cuda_runtime=13000,
           cublaslt=130100, torch="2.11.0+cu130", cupy="14.2.0")
ROWS = [dict(op="cast", config="E8-k7168", scaling="current", impl="cugrouped", pct_copy_bw=93.5),
        dict(op="cast", config="E64-k4096", scaling="current", impl="cugrouped", pct_copy_bw=81.25),
        dict(op="gemm", config="E8", pass_name="fprop", impl="cugrouped-fp8", host_us_per_expert=2.5)]


def _junit(tmp_path: Path, name: str, body: str) -> Path:
    """A JUnit XML written by pytest itself for a small test file."""
    src = tmp_path / f"t_{Path(name).stem}.py"
    src.write_text(body)
    xml = tmp_path / name
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(src),
                    f"--junitxml={xml}"], cwd=tmp_path, capture_output=True)
    return xml


@pytest.fixture
def run_dir(tmp_path):
    from cugrouped.bench import _write_csv

    out = tmp_path / "gc"
    out.mkdir()
    (out / "gpu_check.log").write_text(LOG)
    shutil.copy(_junit(tmp_path, "gpu_tests.xml", """
import pytest
def test_ok(): pass
def test_bad(): assert 1 == 2
@pytest.fixture
def broken(): raise RuntimeError("setup")
def test_err(broken): pass
def test_skip(): pytest.skip("no sm_100")
"""), out / "gpu_tests.xml")
    _write_csv(ROWS, ENV, out)
    (out / "bench-cast.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README.md").write_text(f"# x\n\n## Status\n\nbefore\n{rec.BEGIN}\nold\n{rec.END}\nafter\n")
    return out, repo


def test_junit_summary_of_a_real_pytest_report(tmp_path):
    xml = _junit(tmp_path, "r.xml", "import pytest\ndef test_a(): pass\ndef test_b(): assert 0\n"
                                    "def test_c(): pytest.skip('x')\n")
    s = rec.junit_summary(xml)
    assert (s["tests"], s["passed"], s["failures"], s["errors"], s["skipped"]) == (3, 1, 1, 0, 1)
    assert s["failed"] == ["t_r::test_b"]


def test_records_files_and_readme(run_dir):
    out, repo = run_dir
    assert rec.main([str(out), "--repo", str(repo)]) == 0
    dest = repo / "benchmarks" / "results" / "2027-01-15-h200"
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        ["gpu_check.log", "gpu_tests.xml", "bench.csv", "bench-cast.png"])
    assert (dest / "gpu_check.log").read_text() == LOG
    text = (repo / "README.md").read_text()
    assert text.startswith("# x\n\n## Status\n\nbefore\n" + rec.BEGIN) and text.endswith(rec.END + "\nafter\n")
    assert "old" not in text and text.count(rec.BEGIN) == 1 and text.count(rec.END) == 1
    assert "**NVIDIA H200**, 2027-01-15, commit `abc1234`" in text
    assert "cuBLASLt 13.1.0" in text and "CUDA runtime 13.0" in text
    # the real report: 1 passed, test_bad failed and test_err errored, 1 skipped
    assert "- GPU tests: 1 passed, 2 failed, 1 skipped" in text
    assert "  - FAILED `t_gpu_tests::test_bad`" in text and "  - FAILED `t_gpu_tests::test_err`" in text
    assert "no `gpu_tests_block.xml`" in text
    assert "- stage `GPU tests, block scaling: STOPPED at its 60 s limit`" in text
    assert "- stage `done in 520 s: tests rc=1 block tests rc=124 bench rc=0 notebooks rc=0`" in text
    # the targets table from the CSV's rows: the worst cast row misses 90 %, the host time meets 3 us
    assert re.search(r"cast: % of copy bandwidth +>= 90% +worst +81\.25% +MISSED \(E64-k4096 current; 2 rows\)", text)
    assert re.search(r"host time per expert +<= 3us +worst +2\.50us met", text)
    assert "not measured in this run" in text        # the peers' rows are absent


def test_failed_ids_name_the_test(run_dir):
    out, _ = run_dir
    s = rec.junit_summary(out / "gpu_tests.xml")
    assert sorted(n.split("::")[1] for n in s["failed"]) == ["test_bad", "test_err"]


def test_dry_run_writes_nothing(run_dir, capsys):
    out, repo = run_dir
    before = (repo / "README.md").read_text()
    assert rec.main([str(out), "--repo", str(repo), "--dry-run"]) == 0
    assert (repo / "README.md").read_text() == before
    assert not (repo / "benchmarks").exists()
    assert "Latest GPU run" in capsys.readouterr().out


def test_no_csv_still_records_the_tests(run_dir):
    out, repo = run_dir
    (out / "bench.csv").unlink()
    assert rec.main([str(out), "--repo", str(repo)]) == 0
    text = (repo / "README.md").read_text()
    assert "No `bench.csv`: no targets table." in text
    assert "**NVIDIA H200**, 2027-01-15" in text        # date and GPU from the log


def test_refusals(run_dir, tmp_path, capsys):
    out, repo = run_dir
    assert rec.main([str(tmp_path / "missing"), "--repo", str(repo)]) == 2
    assert "is not a folder" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert rec.main([str(empty), "--repo", str(repo)]) == 2
    assert "none of gpu_check.log" in capsys.readouterr().err
    from cugrouped.bench import _write_csv

    _write_csv(ROWS, dict(ENV, gpu="none"), out)      # a dry run's CSV: refused
    assert rec.main([str(out), "--repo", str(repo)]) == 2
    assert "saw no GPU" in capsys.readouterr().err
    _write_csv(ROWS, ENV, out)
    (repo / "README.md").write_text("# no markers\n")
    with pytest.raises(ValueError, match="expected the markers"):
        rec.main([str(out), "--repo", str(repo)])
    assert not (repo / "benchmarks").exists()          # nothing copied before the README check


@pytest.mark.parametrize("gpu, want", [("NVIDIA H200", "h200"), ("NVIDIA GeForce RTX 4090",
                                                                  "geforce-rtx-4090"),
                                       ("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"), ("", "gpu")])
def test_slug(gpu, want):
    assert rec.slug(gpu) == want


def test_the_readme_has_the_markers_once():
    text = (ROOT / "README.md").read_text()
    for begin, end in ((rec.BEGIN, rec.END), (rec.GROUPED_BEGIN, rec.GROUPED_END)):
        assert text.count(begin) == 1 and text.count(end) == 1
        assert text.index(end) > text.index(begin) > text.index("## Status")


FIRST_STAGES = """== gpu_grouped_check 2027-01-15T09:55:00Z at abc1234: CUGROUPED_CUBLASLT=/tmp/c/libcublasLt.so.13
cuBLASLt 13.10.0 (/tmp/c/libcublasLt.so.13, named by CUGROUPED_CUBLASLT)
== GEMM GPU tests (limit 150 s)
81 passed in 20.1s
== GEMM GPU tests: rc=0 at 25 s
== GEMM probes (scale alignment, grouped) (limit 150 s)
probe scale pointer offset  4 bytes: ok (same bits as offset 0: True)
probe grouped fine-E64 jagged m fprop: accepted; max |grouped - loop| / max |loop| = 3.1e-03; loop 231.0 us (host 10.30 us/expert), grouped 95.0 us (host 0.40 us/expert): 2.43x
== GEMM probes (scale alignment, grouped): rc=0 at 70 s
== GEMM benchmark, any m (limit 120 s)
bench_grouped_any_m: GROUPED_DIM_BYTES 16 -> 1 (any m)
dense peaks: bf16 790 TFLOP/s, fp8 1450 TFLOP/s; copy 4270 GB/s
fine-E64-2048to1408      fprop cugrouped-fp8              0.095 ms   498.0 TFLOP/s  25.1% of roofline out bfloat16 host   0.4 us/expert (grouped)
fine-E64-2048to1408      fprop torch-scaled_grouped_mm    0.120 ms   395.0 TFLOP/s  20.0% of roofline out bfloat16 cugrouped-fp8  1.26x faster
== GEMM benchmark, any m: rc=0 at 120 s
"""


def test_a_grouped_run_is_recorded_beside_the_days_run(run_dir):
    """``--grouped``: gpu_grouped_check.sh's folder (its first stages open the log) goes to a
    grouped-cublas-<version>/ folder, and its own README block leads with what the first stages
    found; the plain run's block is left alone."""
    out, repo = run_dir
    (out / "gpu_check.log").write_text(FIRST_STAGES + LOG)
    text = (repo / "README.md").read_text()
    (repo / "README.md").write_text(text + f"{rec.GROUPED_BEGIN}\nnone yet\n{rec.GROUPED_END}\n")
    assert rec.main([str(out), "--repo", str(repo), "--grouped"]) == 0
    dest = repo / "benchmarks" / "results" / "2027-01-15-h200" / "grouped-cublas-13.1.0"
    assert (dest / "gpu_check.log").read_text() == FIRST_STAGES + LOG
    new = (repo / "README.md").read_text()
    assert new.startswith(text) and "none yet" not in new          # the plain block untouched
    block = new[new.index(rec.GROUPED_BEGIN):]
    assert "Latest run of the grouped GEMM" in block and "commit `abc1234`" in block
    found = block[block.index("```"):block.index("```", block.index("```") + 3)]
    assert "cuBLASLt 13.10.0" in found and "probe grouped fine-E64 jagged m fprop: accepted" in found
    assert "probe scale pointer offset  4 bytes: ok" in found
    assert "fprop torch-scaled_grouped_mm    0.120 ms" in found and "bench_grouped" not in found
    assert "== GEMM benchmark, any m: rc=0 at 120 s" in found and "dense peaks" not in found
    assert "GPU tests (limit" not in found                          # the GPU check's own lines
    assert block.index("```") < block.index("- GPU tests:")


def test_benchmark_tables_of_the_recorded_h200_run():
    """The tables from the CSV checked in under benchmarks/results/ (the bench's own columns):
    each op's rows, the peers' speed-ups as the CSV has them, the layer's host time."""
    from cugrouped.bench.plot import load_rows

    rows = load_rows(ROOT / "benchmarks" / "results" / "2026-12-04-h200" / "bench.csv")
    text = rec.benchmark_tables(rows)
    assert "| dsv3-E8-jagged | current | 0.221 | 3192 | 74.8 | 10.66x | 1.63x |" in text
    assert "| fine-E64-2048to1408 | fprop | 0.231 | 205 | 10.3 | 1.74x | 0.52x | 0.77x |" in text
    assert "| dsv3-E8-jagged-16k | 1.500 | 2.92 | 1.43x | 1.40x (0.49) | 1.73x |" in text
    assert "(the per-expert cuBLASLt loop;" in text and "(grouped)" not in text
    assert rec.benchmark_tables([]) == ""
    # a pass that took cuBLASLt's grouped GEMM says so (the bench's gemm_path column)
    marked = [dict(r, gemm_path="grouped") if r.get("impl") == "cugrouped-fp8"
              and r.get("pass_name") == "wgrad" and r.get("config") == "fine-E64-2048to1408" else r
              for r in rows]
    text2 = rec.benchmark_tables(marked)
    assert "| fine-E64-2048to1408 | wgrad (grouped) | 0.381 |" in text2
    assert "or cuBLASLt's grouped GEMM where a pass says (grouped)" in text2
    assert "| fine-E64-2048to1408 | fprop | 0.231 |" in text2
    # in the README block, before the targets table
    block = rec.summary("d", dict(gpu="G", date="D"), {}, [], "targets", text)
    assert block.index("| config | pass |") < block.index("targets")


def test_tuning_knobs_against_the_default_of_the_same_config_and_pass():
    """Each variant row (two tiles per block, half tiles, 16 side streams, 4 host threads)
    against the default row of its config and pass (or scaling) and output width; no variant
    rows, no table."""
    def row(op, impl, config, ms, **kw):
        return dict(op=op, impl=impl, config=config, ms=ms, **kw)

    rows = [row("cast", "cugrouped", "E8", 0.20, scaling="current"),
            row("cast", "cugrouped", "E8", 0.15, scaling="delayed"),
            row("cast", "cugrouped-tpb2", "E8", 0.16, scaling="current"),
            row("cast", "cugrouped-half", "E8", 0.12, scaling="delayed"),
            row("gemm", "cugrouped-fp8", "E64", 0.40, pass_name="fprop", out_dtype="bfloat16",
                host_us_per_expert=10.0),
            row("gemm", "cugrouped-fp8", "E64", 0.50, pass_name="dgrad", out_dtype="bfloat16",
                host_us_per_expert=11.0),
            row("gemm", "cugrouped-fp8-t4", "E64", 0.25, pass_name="fprop", out_dtype="bfloat16",
                host_us_per_expert=3.5),
            row("gemm", "cugrouped-fp8-s16", "E64", 0.5, pass_name="dgrad", out_dtype="bfloat16",
                host_us_per_expert=12.0),
            row("gemm", "cugrouped-fp8-s16", "E8", 0.5, pass_name="dgrad", out_dtype="bfloat16")]
    lines = rec.tuning_table(rows).splitlines()
    assert lines[4:] == [
        "| `set_tiles_per_block(2)` | E8 | current | 0.200 | 0.160 | 1.25x | - |",
        "| `set_half_tiles(True)` | E8 | delayed | 0.150 | 0.120 | 1.25x | - |",
        "| `set_side_streams(16)` | E64 | dgrad | 0.500 | 0.500 | 1.00x | 11.0 -> 12.0 |",
        "| `set_host_threads(4)` | E64 | fprop | 0.400 | 0.250 | 1.60x | 10.0 -> 3.5 |"]
    assert rec.tuning_table([r for r in rows if r["impl"] in ("cugrouped", "cugrouped-fp8")]) == ""
    assert "Tuning knobs" in rec.benchmark_tables(rows)
