#!/usr/bin/env python3
"""Put a GPU check's results into the repository, after a device run.

    python scripts/record_gpu_run.py FILES_AT/gc

copies what ``scripts/gpu_check.sh OUT_DIR`` left in ``OUT_DIR`` (log, JUnit XMLs, CSV, plots) to
``benchmarks/results/<date>-<gpu>/`` and writes a summary into README's Status between the
``<!-- gpu-results:begin -->`` and ``<!-- gpu-results:end -->`` markers: when and where it ran
(GPU, driver, CUDA, cuBLASLt, torch, CuPy, the commit), each test stage's counts and failures,
how each stage ended, the main numbers as tables (cast, GEMMs, layer, against the peers; each
tuning knob's rows against the default's), and the targets table (``cugrouped.bench.targets``)
of the CSV's rows.
``--grouped`` records a run of ``scripts/gpu_grouped_check.sh`` (the check again with a carried
libcublasLt that has the grouped GEMM) instead: into ``grouped-cublas-<version>/`` beside the
run of that day, and between the ``<!-- gpu-grouped:begin -->`` / ``<!-- gpu-grouped:end -->``
markers, with its first stages' findings (the probes' lines, the any-m benchmark's rows) first.
Prints what it wrote; ``--dry-run`` only prints. Pure file work: no GPU, no network. A stage
that left no file is reported as such, not skipped silently (a bench that failed still has its
tests recorded, and the other way round).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from cugrouped.bench.plot import load_rows  # noqa: E402  (the CSV as the notebooks read it)
from cugrouped.bench.targets import check_targets, format_targets  # noqa: E402

BEGIN, END = "<!-- gpu-results:begin -->", "<!-- gpu-results:end -->"
GROUPED_BEGIN, GROUPED_END = "<!-- gpu-grouped:begin -->", "<!-- gpu-grouped:end -->"
FILES = ("gpu_check.log", "gpu_tests.xml", "gpu_tests_block.xml", "bench.csv", "bench-cast.png",
         "bench-gemm.png", "bench-layer.png", "bench-host.png")
TEST_STAGES = (("GPU tests", "gpu_tests.xml"), ("GPU tests, block scaling", "gpu_tests_block.xml"))


def junit_summary(path: Path) -> dict:
    """Counts of a JUnit XML (pytest's) and the ids of the tests that failed or errored."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed": []}
    for s in suites:
        for key in ("tests", "failures", "errors", "skipped"):
            out[key] += int(s.get(key, 0))
        for case in s.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                out["failed"].append(f"{case.get('classname', '')}::{case.get('name', '')}")
    out["passed"] = out["tests"] - out["failures"] - out["errors"] - out["skipped"]
    return out


def run_facts(rows: list[dict], log: str) -> dict:
    """Date, GPU and versions (the CSV's environment columns, else the log) and the commit."""
    first = rows[0] if rows else {}
    facts = {k: first.get(k, "") for k in ("date", "gpu", "driver", "cuda_runtime", "cublaslt",
                                           "torch", "cupy", "numpy", "python")}
    m = re.search(r"^== gpu_check (\d{4}-\d{2}-\d{2})T\S* at (\S+)", log, re.M)
    if m:
        facts["date"] = facts["date"] or m.group(1)
        facts["commit"] = m.group(2)
    if not facts["gpu"]:           # no CSV: nvidia-smi's line follows the header in the log
        m = re.search(r"^== gpu_check .*\n(NVIDIA [^,\n]+)", log, re.M)
        facts["gpu"] = m.group(1).strip() if m else ""
    return facts


def slug(gpu: str) -> str:
    """``'NVIDIA H200'`` -> ``'h200'``; ``'NVIDIA GeForce RTX 4090'`` -> ``'geforce-rtx-4090'``."""
    s = re.sub(r"^nvidia\s+", "", gpu.strip(), flags=re.I).lower()
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "gpu"


def stage_endings(log: str) -> list[str]:
    """The log's ``== <stage>: rc=N in S s`` / ``STOPPED`` / ``SKIPPED`` lines and its last line."""
    return [line[3:] for line in log.splitlines()
            if line.startswith("== ") and re.search(r": (rc=|STOPPED|SKIPPED)|^== done", line)]


def version_text(v) -> str:
    """cuBLASLt's ``major*10000 + minor*100 + patch`` and CUDA's ``major*1000 + minor*10`` (as
    ``load_rows`` reads them: floats) as dotted versions; anything else as it is."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) and not str(v).isdigit():
        return str(v)
    n = int(v)
    if n >= 100000:
        return f"{n // 10000}.{n // 100 % 100}.{n % 100}"
    return f"{n // 1000}.{n % 1000 // 10}"


def _x(v) -> str:
    return f"{v:.2f}x" if isinstance(v, (int, float)) and v == v else "-"


def _f(row: dict, key: str, fmt: str, scale: float = 1.0) -> str:
    """``row[key] * scale`` formatted, or "-" where the CSV has no number."""
    v = row.get(key)
    return format(v * scale, fmt) if isinstance(v, (int, float)) and v == v else "-"


def _peer_speedups(rows: list[dict], op: str, config: str, extra: dict) -> dict:
    """impl -> the row's ``speedup_of_cugrouped_fp8`` (peer time over cugrouped FP8's: above 1,
    cugrouped is faster) for the rows of ``op`` and ``config`` matching ``extra``."""
    return {r["impl"]: r.get("speedup_of_cugrouped_fp8") for r in rows
            if r.get("op") == op and r.get("config") == config
            and all(r.get(k) == v for k, v in extra.items())}


def benchmark_tables(rows: list[dict]) -> str:
    """The CSV's main numbers as three Markdown tables (the README's benchmark table): the
    per-tensor cast against torch, cugrouped's FP8 GEMMs against torch's, and the layer's
    training step; speed-ups above 1 mean cugrouped is faster. Empty without such rows."""
    out = []
    casts = [r for r in rows if r.get("op") == "cast" and r.get("impl") == "cugrouped"]
    if casts:
        out += ["Cast (bf16 in; row-wise and transposed FP8 out, amax; speed-up over torch doing "
                "the same, current scaling):", "",
                "| config | scaling | ms | GB/s | % of copy | vs torch eager | vs torch.compile |",
                "|---|---|---|---|---|---|---|"]
        for r in casts:
            peers = {p["impl"]: p.get("speedup_of_cugrouped") for p in rows
                     if p.get("op") == "cast" and p.get("config") == r["config"]
                     and p.get("impl") != "cugrouped"} if r.get("scaling") == "current" else {}
            out.append(f"| {r['config']} | {r.get('scaling', '')} | {_f(r, 'ms', '.3f')} | "
                       f"{_f(r, 'gbs', '.0f')} | {_f(r, 'pct_copy_bw', '.1f')} | "
                       f"{_x(peers.get('torch-eager'))} | {_x(peers.get('torch-compile'))} |")
        out.append("")
    gemms = [r for r in rows if r.get("op") == "gemm" and r.get("impl") == "cugrouped-fp8"]
    if gemms:
        grouped = any(r.get("gemm_path") == "grouped" for r in gemms)
        how = ("the per-expert cuBLASLt loop, or cuBLASLt's grouped GEMM where a pass says "
               "(grouped)" if grouped else "the per-expert cuBLASLt loop")
        out += [f"FP8 grouped GEMMs ({how}; each peer's speed-up measured against cugrouped's row "
                "of the same output width):", "",
                "| config | pass | ms | TFLOP/s | host µs/expert | vs `_scaled_mm` loop | "
                "vs `_scaled_grouped_mm` | vs bf16 `_grouped_mm` |", "|---|---|---|---|---|---|---|---|"]
        for r in gemms:
            sp = _peer_speedups(rows, "gemm", r["config"], {"pass_name": r.get("pass_name")})
            mark = " (grouped)" if r.get("gemm_path") == "grouped" else ""
            out.append(f"| {r['config']} | {r.get('pass_name', '')}{mark} | {_f(r, 'ms', '.3f')} | "
                       f"{_f(r, 'tflops', '.0f')} | {_f(r, 'host_us_per_expert', '.1f')} | "
                       f"{_x(sp.get('torch-scaled_mm-loop'))} | "
                       f"{_x(sp.get('torch-scaled_grouped_mm'))} | "
                       f"{_x(sp.get('torch-grouped_mm-bf16'))} |")
        out.append("")
    layers = [r for r in rows if r.get("op") == "layer"
              and r.get("impl") == "cugrouped-fp8-delayed-tensor"]
    if layers:
        out += ["Layer training step (forward and both gradients; GPU time, and the host's time for "
                "the same step with the GPU idle at its start):", "",
                "| config | FP8 ms | host ms | vs cugrouped bf16 | vs bf16 `_grouped_mm` (its host "
                "ms) | vs torch pad + linear loop |", "|---|---|---|---|---|---|"]
        for r in layers:
            sp = _peer_speedups(rows, "layer", r["config"], {})
            gm = next((p.get("host_us") for p in rows if p.get("op") == "layer"
                       and p.get("config") == r["config"]
                       and p.get("impl") == "torch-grouped_mm-bf16"), None)
            gm_host = f" ({gm / 1e3:.2f})" if isinstance(gm, float) else ""
            out.append(f"| {r['config']} | {_f(r, 'ms', '.3f')} | {_f(r, 'host_us', '.2f', 1e-3)} | "
                       f"{_x(sp.get('cugrouped-bf16-tensor'))} | "
                       f"{_x(sp.get('torch-grouped_mm-bf16'))}{gm_host} | "
                       f"{_x(sp.get('torch-pad-linear-loop-bf16'))} |")
        out.append("")
    tuning = tuning_table(rows)
    if tuning:
        out += [tuning, ""]
    return "\n".join(out).rstrip()


# (op, the default row's impl, a variant's impl, the field that tells rows of a config apart,
# the knob that sets the variant)
TUNING = (("cast", "cugrouped", "cugrouped-tpb2", "scaling", "set_tiles_per_block(2)"),
          ("cast", "cugrouped", "cugrouped-half", "scaling", "set_half_tiles(True)"),
          ("gemm", "cugrouped-fp8", "cugrouped-fp8-s16", "pass_name", "set_side_streams(16)"),
          ("gemm", "cugrouped-fp8", "cugrouped-fp8-t4", "pass_name", "set_host_threads(4)"))


def tuning_table(rows: list[dict]) -> str:
    """Each tuning knob's rows against the default's of the same run, config and pass (or
    scaling): device time, its ratio (above 1: the knob is faster) and the host time per expert
    where the CSV has it. Empty without variant rows."""
    out = []
    for op, base, variant, field, knob in TUNING:
        for r in rows:
            if r.get("op") != op or r.get("impl") != variant:
                continue
            d = next((b for b in rows if b.get("op") == op and b.get("impl") == base
                      and b.get("config") == r.get("config") and b.get(field) == r.get(field)
                      and b.get("out_dtype") == r.get("out_dtype")), None)
            if d is None:
                continue
            ratio = d["ms"] / r["ms"] if isinstance(d.get("ms"), float) and \
                isinstance(r.get("ms"), float) and r["ms"] > 0 else None
            host = (f"{_f(d, 'host_us_per_expert', '.1f')} -> {_f(r, 'host_us_per_expert', '.1f')}"
                    if "host_us_per_expert" in r else "-")
            out.append(f"| `{knob}` | {r.get('config', '')} | {r.get(field, '')} | "
                       f"{_f(d, 'ms', '.3f')} | {_f(r, 'ms', '.3f')} | {_x(ratio)} | {host} |")
    if not out:
        return ""
    return "\n".join(["Tuning knobs, each against the default in the same run (speed-up above 1: "
                      "the knob is faster):", "",
                      "| knob | config | pass / scaling | default ms | knob ms | speed-up | host "
                      "µs/expert, default -> knob |", "|---|---|---|---|---|---|---|", *out])


def summary(dest: str, facts: dict, tests: dict, endings: list[str], targets: str | None,
            tables: str = "") -> str:
    v = {k: version_text(facts.get(k) or "?") for k in ("driver", "cuda_runtime", "cublaslt")}
    lines = [BEGIN, "",
             f"Latest GPU run: **{facts.get('gpu') or 'GPU ?'}**, {facts.get('date') or 'date ?'}, "
             f"commit `{facts.get('commit', '?')}`; driver {v['driver']}, CUDA runtime "
             f"{v['cuda_runtime']}, cuBLASLt {v['cublaslt']}, torch {facts.get('torch') or '?'}, "
             f"CuPy {facts.get('cupy') or '?'}. Files: `{dest}/`.", ""]
    for stage, xml in TEST_STAGES:
        t = tests.get(xml)
        if t is None:
            lines.append(f"- {stage}: no `{xml}` (the stage did not run or was killed)")
            continue
        lines.append(f"- {stage}: {t['passed']} passed, {t['failures'] + t['errors']} failed, "
                     f"{t['skipped']} skipped")
        lines += [f"  - FAILED `{name}`" for name in t["failed"]]
    lines += [f"- stage `{e}`" for e in endings]
    lines.append("")
    if tables:
        lines += [tables, ""]
    if targets:
        lines += ["```", targets, "```"]
    else:
        lines.append("No `bench.csv`: no targets table.")
    lines += ["", END]
    return "\n".join(lines)


def first_stage_findings(log: str) -> list[str]:
    """What ``gpu_grouped_check.sh``'s first stages found (the part of its log before the
    GPU check's header): the library it loaded, the probes' lines, the any-m benchmark's rows
    (those with a time), and how each stage ended."""
    head = log.split("\n== gpu_check ", 1)[0]
    out, bench = [], False
    for line in head.splitlines():
        if line.startswith("== GEMM benchmark, any m"):
            bench = "rc=" not in line
        if line.startswith("cuBLASLt ") or line.startswith("probe ") or (
                line.startswith("== ") and re.search(r": (rc=|SKIPPED)", line)) or (
                bench and re.search(r" ms +[0-9.]+ TFLOP/s", line)):
            out.append(line)
    return out


def update_readme(text: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    """``text`` with the part between the markers (markers included) replaced by ``block``."""
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"README: expected the markers {begin} ... {end} (in Status)")
    return text[:i] + block + text[j + len(end):]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="the folder scripts/gpu_check.sh wrote (the device run's gc/)")
    ap.add_argument("--repo", default=str(ROOT), help="the checkout to record into")
    ap.add_argument("--dry-run", action="store_true", help="print, write nothing")
    ap.add_argument("--grouped", action="store_true",
                    help="a run of scripts/gpu_grouped_check.sh (the device run's gg/)")
    args = ap.parse_args(argv)
    src, repo = Path(args.out_dir), Path(args.repo)
    if not src.is_dir():
        print(f"record_gpu_run: out_dir: {src} is not a folder", file=sys.stderr)
        return 2
    present = [f for f in FILES if (src / f).is_file()]
    if not present:
        print(f"record_gpu_run: out_dir: none of {', '.join(FILES)} in {src}", file=sys.stderr)
        return 2
    log = (src / "gpu_check.log").read_text(errors="replace") if "gpu_check.log" in present else ""
    rows = load_rows(src / "bench.csv") if "bench.csv" in present else []
    facts = run_facts(rows, log)
    if not facts.get("date") or not facts.get("gpu"):
        print("record_gpu_run: cannot tell the run's date and GPU (no bench.csv rows, no log "
              "header)", file=sys.stderr)
        return 2
    if str(facts["gpu"]).lower() == "none":
        print("record_gpu_run: out_dir: this run saw no GPU (a dry run?): nothing to record",
              file=sys.stderr)
        return 2
    tests = {xml: junit_summary(src / xml) for _, xml in TEST_STAGES if xml in present}
    targets = format_targets(check_targets(rows), quick=True) if rows else None
    dest_rel = f"benchmarks/results/{facts['date']}-{slug(facts['gpu'])}"
    if args.grouped:
        dest_rel += f"/grouped-cublas-{version_text(facts.get('cublaslt') or '?')}"
    block = summary(dest_rel, facts, tests, stage_endings(log), targets, benchmark_tables(rows))
    markers = (BEGIN, END)
    if args.grouped:
        found = first_stage_findings(log)
        block = block.replace(BEGIN, GROUPED_BEGIN, 1).replace(END, GROUPED_END, 1).replace(
            "Latest GPU run:", "Latest run of the grouped GEMM (`scripts/gpu_grouped_check.sh`, "
            "the libcublasLt carried):", 1)
        first = ["Its first stages (GEMM GPU tests, probes, the benchmark with any m):", "",
                 "```", *(found or ["(nothing: the stages did not run)"]), "```", ""]
        at = block.index("\n- ") + 1
        block = block[:at] + "\n".join(first) + "\n" + block[at:]
        markers = (GROUPED_BEGIN, GROUPED_END)
    readme = repo / "README.md"
    new_text = update_readme(readme.read_text(), block, *markers)
    print(block)
    if args.dry_run:
        return 0
    dest = repo / dest_rel
    dest.mkdir(parents=True, exist_ok=True)
    for f in present:
        shutil.copyfile(src / f, dest / f)
    readme.write_text(new_text)
    print(f"record_gpu_run: copied {len(present)} files to {dest_rel}/ and updated README.md "
          f"(Status)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
