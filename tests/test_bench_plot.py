"""The benchmark plots: rows written to a CSV, read back and drawn, for GPU rows and host rows."""

from __future__ import annotations

import csv

import pytest

pytest.importorskip("matplotlib")

from cugrouped.bench import plot  # noqa: E402


def _write(tmp_path, rows):
    keys = sorted({k for r in rows for k in r})
    path = tmp_path / "bench.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return path


def test_gpu_and_host_rows_become_pngs(tmp_path):
    # made-up numbers: this tests the plotting code, not a measurement
    rows = [dict(op="cast", config="E8", impl="cugrouped", scaling="current", ms=0.2, pct_copy_bw=85.0,
                 gpu="test"),
            dict(op="cast", config="E8", impl="torch-eager", scaling="current", ms=0.9,
                 speedup_of_cugrouped=4.5, gpu="test"),
            dict(op="gemm", config="E8", pass_name="fprop", impl="cugrouped-fp8", ms=1.0, pct_peak=60.0,
                 gpu="test"),
            dict(op="cast-host", config="E8-list", host_us_per_expert=9.0, gpu="none"),
            dict(op="cast-host", config="E64-list", host_us_per_expert=3.0, gpu="none")]
    back = plot.load_rows(_write(tmp_path, rows))
    assert back[1]["speedup_of_cugrouped"] == 4.5 and "speedup_of_cugrouped" not in back[0]
    written = plot.write_png(back, tmp_path / "bench.png")
    names = sorted(p.name for p in written)
    assert names == ["bench-cast.png", "bench-gemm.png", "bench-host.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_no_rows_of_a_kind_no_png(tmp_path):
    assert plot.write_png([dict(op="cast-host", config="E8-tensor", host_us_per_expert=2.0)],
                          tmp_path / "b.png") == [tmp_path / "b-host.png"]
    assert plot.plot_host([dict(op="cast", config="E8")]) is None


def test_host_plot_shows_the_new_splits_cast_rows_when_there_are_some():
    """The cast rows timed with new token counts every call are what training pays: when a CSV
    has them, the host plot draws those (labelled so) and leaves the memo-hit rows out; older
    CSVs without the column are drawn as they are."""
    import matplotlib

    matplotlib.use("Agg")
    rows = [dict(op="cast-host", config=f"E{e}-torch-list", splits=s, host_us_per_expert=v)
            for e in (8, 64) for s, v in (("same", 2.0), ("new", 5.0))]
    rows.append(dict(op="gemm-host", config="E8", host_us_per_expert=3.0, cold_us=80.0))
    fig = plot.plot_host(rows)
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in fig.axes[0].get_lines()}
    assert lines == {"cast op, torch list input, new splits": [5.0, 5.0],      # the GEMM's too:
                     "grouped_fprop, numpy input, new splits (device calls faked)": [10.0]}
    same = plot.plot_host([r for r in rows if r.get("splits") != "new"])
    assert {ln.get_label(): list(ln.get_ydata()) for ln in same.axes[0].get_lines()} == {
        "cast op, torch list input": [2.0, 2.0],
        "grouped_fprop launch loop, numpy input (device calls faked)": [3.0]}
    old = plot.plot_host([dict(op="cast-host", config="E8-torch-list", host_us_per_expert=2.0)])
    assert [ln.get_label() for ln in old.axes[0].get_lines()] == ["cast op, torch list input"]


def test_legend_columns_fit_the_longest_name():
    names = ["index_select+cugrouped-fp8-delayed"] * 11            # 34 characters at 8 pt
    assert plot.legend_columns(names, 7.2) == 2                    # ~2.9 in each: 2 fit in 7.2
    assert plot.legend_columns(names, 17.6) == 6
    assert plot.legend_columns(["a", "b"], 7.2) == 2 and plot.legend_columns(names[:1], 1.0) == 1


def test_gemm_plot_reads_pct_roofline_and_labels_cast_excluded_rows():
    import matplotlib

    matplotlib.use("Agg")
    rows = [dict(op="gemm", config="E8", pass_name="wgrad", impl="cugrouped-fp8", ms=1.0,
                 pct_roofline=60.0, pct_peak=30.0),
            dict(op="gemm", config="E8", pass_name="wgrad", impl="torch-grouped_mm-bf16", ms=2.0,
                 pct_roofline=40.0, speedup_of_cugrouped_fp8=2.0,
                 speedup_note="GEMM only, cast excluded")]
    fig = plot.plot_op(rows, "gemm", "test")
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["torch-grouped_mm-bf16 (GEMM only, cast excluded)", "cugrouped-fp8"]
    bottom = fig.axes[5]                                           # wgrad, roofline fractions
    assert bottom.get_xlabel().startswith("% of roofline (measured peak for the operand type")
    assert sorted(p.get_width() for p in bottom.patches) == [40.0, 60.0]
