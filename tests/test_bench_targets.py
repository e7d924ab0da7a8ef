"""The performance targets read from benchmark rows: worst case per target, met or missed."""

from __future__ import annotations

from cugrouped.bench.targets import TARGETS, check_targets, format_targets

ROWS = [
    dict(op="cast", config="E8", scaling="current", impl="cugrouped", pct_copy_bw=93.0),
    dict(op="cast", config="E64", scaling="delayed", impl="cugrouped", pct_copy_bw=88.5),
    dict(op="cast", config="E8", scaling="current", impl="torch-eager", speedup_of_cugrouped=4.2),
    dict(op="cast", config="E64", scaling="current", impl="torch-eager", speedup_of_cugrouped=6.0),
    dict(op="gemm", config="E8", pass_name="fprop", impl="cugrouped-fp8", host_us_per_expert=2.5),
    dict(op="gemm", config="E64", pass_name="wgrad", impl="cugrouped-fp8", host_us_per_expert="nan"),
    dict(op="gemm", config="E8", pass_name="dgrad", impl="torch-scaled_grouped_mm",
         speedup_of_cugrouped_fp8=1.3),
]


def test_worst_case_per_target():
    res = {r.target.name: r for r in check_targets(ROWS)}
    bw = res["cast: % of copy bandwidth"]
    assert (bw.worst, bw.where, bw.rows, bw.met) == (88.5, "E64 delayed", 2, False)
    eager = res["cast: speed-up over torch eager"]
    assert (eager.worst, eager.met) == (4.2, True)
    host = res["gemm fp8: host time per expert"]     # lower is better; NaN ignored
    assert (host.worst, host.rows, host.met) == (2.5, 1, True)
    assert res["gemm fp8: speed-up over torch._scaled_grouped_mm"].where == "E8 dgrad"
    comp = res["cast: speed-up over torch.compile"]
    assert comp.worst is None and comp.met is None


def test_table_names_every_target():
    text = format_targets(check_targets(ROWS))
    assert text.count("\n") == len(TARGETS)
    assert "MISSED" in text and "not measured" in text and "met" in text


def test_quick_tables_say_what_the_compile_target_rests_on():
    quick = format_targets(check_targets(ROWS), quick=True)
    assert quick.splitlines()[-1] == ("note: under --quick the torch.compile cast target rests on "
                                      "the configs with E <= 16 only, compiled with static shapes "
                                      "(its best case)")
    assert "--quick" not in format_targets(check_targets(ROWS))


def test_the_gemm_target_reads_wgrad_rows_too():
    rows = ROWS + [dict(op="gemm", config="E64", pass_name="wgrad", impl="torch-scaled_grouped_mm",
                        speedup_of_cugrouped_fp8=1.05, speedup_reference="cugrouped-fp8-bf16dW")]
    res = {r.target.name: r for r in check_targets(rows)}
    gemm = res["gemm fp8: speed-up over torch._scaled_grouped_mm"]
    assert (gemm.worst, gemm.where, gemm.met) == (1.05, "E64 wgrad", False)
