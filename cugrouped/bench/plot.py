"""Plots of benchmark rows: speed-ups and roofline fractions per op (GPU rows) and host time per
expert (host rows). Used by ``python -m cugrouped bench --out DIR`` (``DIR/bench.png``) and by
``notebooks/03_performance.ipynb``. Rows are plain dicts, as written to / read from ``bench.csv``.
matplotlib is imported lazily: ``write_png`` says so and returns None when it is missing.
"""

from __future__ import annotations

import csv
from collections import defaultdict

import numpy as np

__all__ = ["load_rows", "plot_op", "plot_host", "write_png", "GPU_OPS"]

GPU_OPS = ("cast", "gemm", "layer")


def load_rows(path):
    """A bench CSV as a list of dicts: numbers as floats, empty cells dropped."""
    rows = []
    with open(path, newline="") as f:
        for raw in csv.DictReader(f):
            row = {"source": str(path)}
            for key, value in raw.items():
                if value in ("", None):
                    continue
                try:
                    row[key] = float(value)
                except ValueError:
                    row[key] = value
            rows.append(row)
    return rows


def _ticks():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:g}")


ROOF = {"cast": ("pct_copy_bw", "% of copy bandwidth"),
        "gemm": ("pct_roofline", "% of roofline (measured peak for the operand type,\n"
                                 "measured copy bandwidth)"),
        "layer": ("pct_roofline", "% of roofline (measured peak for the operand type,\n"
                                  "measured copy bandwidth)")}
OLD_GEMM_ROOF = ("pct_peak", "% of dense peak")     # CSVs written before pct_roofline
CAST_EXCLUDED = "GEMM only, cast excluded"

SPEEDUP = ("speedup_of_cugrouped", "speedup_of_cugrouped_fp8")

REFERENCE = {"cast": "cugrouped (current)", "gemm": "cugrouped-fp8 (same output dtype)",
             "layer": "cugrouped-fp8-delayed-tensor"}


def impl_of(row):
    # cast rows of cugrouped differ by scaling (current / delayed), not by impl name
    return f"{row['impl']} ({row['scaling']})" if row["op"] == "cast" and "scaling" in row else row["impl"]


def barh_groups(ax, rows, value_key, xlabel, colors, log=False):
    """Horizontal grouped bars: one group per config, one bar per implementation (colours
    from ``colors``, one per implementation for the whole figure)."""
    from matplotlib.ticker import FuncFormatter

    data = [(r["config"], impl_of(r), r[value_key]) for r in rows if value_key in r]
    if not data:
        ax.text(0.5, 0.5, "no rows", ha="center", va="center", transform=ax.transAxes)
        return
    configs = list(dict.fromkeys(d[0] for d in data))
    impls = list(dict.fromkeys(d[1] for d in data))
    h = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        vals = {c: v for c, i, v in data if i == impl}
        ys = [ci + (j - (len(impls) - 1) / 2) * h for ci, c in enumerate(configs) if c in vals]
        ax.barh(ys, [vals[c] for c in configs if c in vals], height=h, color=colors[impl], label=impl)
    ax.set_yticks(range(len(configs)), configs, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel, fontsize=9)
    if log:
        ax.set_xscale("log")
        ax.axvline(1, color="k", lw=1)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}×" if str(v)[0] in "235" else ""))
    ax.grid(axis="x", alpha=0.3, which="both")


def speedup_key(rows):
    return next((k for k in SPEEDUP if any(k in r for r in rows)), SPEEDUP[0])


def legend_columns(labels, width_in: float) -> int:
    """Legend columns for ``labels`` at 8 pt across ``width_in`` inches, none clipped."""
    longest = max((len(s) for s in labels), default=1)
    return max(1, min(len(labels), int(width_in / (0.07 * longest + 0.5))))


def plot_op(rows, op, note):
    """Speed-ups (top row, log scale) and roofline fractions (bottom row) of one op's rows; GEMM
    passes side by side. Returns the figure."""
    import matplotlib.pyplot as plt

    op_rows = [r for r in rows if r["op"] == op]
    # an FP8 GEMM's speed-up over a 16-bit one leaves our cast out: its impls say so
    noted = {r["impl"] for r in op_rows if r.get("speedup_note") == CAST_EXCLUDED}
    op_rows = [{**r, "impl": f"{r['impl']} ({CAST_EXCLUDED})"} if r.get("impl") in noted else r
               for r in op_rows]
    roof_key, roof_label = ROOF[op]
    if op == "gemm" and not any(roof_key in r for r in op_rows):
        roof_key, roof_label = OLD_GEMM_ROOF
    parts = ([(p, [r for r in op_rows if r.get("pass_name") == p]) for p in ("fprop", "dgrad", "wgrad")]
             if op == "gemm" else [(None, op_rows)])
    n_cfg = len({r["config"] for r in op_rows})
    impls = list(dict.fromkeys(impl_of(r) for r in op_rows))
    n_impl = len(impls)
    colors = dict(zip(impls, plt.cm.tab10(np.arange(n_impl) % 10)))
    width = 5.2 * len(parts) + 2
    fig, axes = plt.subplots(2, len(parts), figsize=(width, 2 * (1.2 + 0.22 * n_cfg * n_impl ** 0.5)),
                             squeeze=False)
    for col, (pass_name, part) in enumerate(parts):
        sk = speedup_key(part)
        barh_groups(axes[0, col], part, sk, f"speed-up of {REFERENCE[op]}\n(row's time / its time; >1: faster)",
                    colors, log=True)
        barh_groups(axes[1, col], part, roof_key, roof_label, colors)
        if pass_name:
            axes[0, col].set_title(pass_name)
    handles = {}
    for ax in axes.flat:
        for hnd, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, hnd)
    # as many legend columns as the longest name lets fit across the figure (8 pt: ~0.07 in a
    # character, plus the colour patch)
    ncol = legend_columns(list(handles), width)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=ncol,
               frameon=False, fontsize=8, bbox_to_anchor=(0.5, 0))
    fig.suptitle(f"{op}: speed-ups (top) and roofline fractions (bottom) — {note}", fontsize=11)
    legend_in = 0.2 * -(-len(handles) // ncol) + 0.1
    fig.tight_layout(rect=(0, legend_in / fig.get_figheight(), 1, 0.97))
    return fig


def experts_of(row):
    if "experts" in row:
        return int(row["experts"])
    return int(str(row["config"]).split("-")[0].lstrip("E"))   # host rows: "E64-torch-list", "E64"


def plot_host(rows):
    """Host (CPU) time per expert per call against the number of experts; None without host rows."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    series = defaultdict(list)
    # cast rows timed with new token counts every call, when the CSV has them (what training
    # pays; the "same splits" rows time the memos' hits)
    new_splits = any(r.get("splits") == "new" for r in rows if r["op"] == "cast-host")
    for r in rows:
        if r["op"] == "cast-host" and new_splits and r.get("splits") != "new":
            continue
        if r["op"] == "cast-host":
            # "E8-torch-list" (array kind, input form); older CSVs: "E8-list"
            parts = str(r["config"]).split("-")[1:]
            label = (f"cast op, {' '.join(parts[:-1]) + ' ' if len(parts) > 1 else ''}{parts[-1]} "
                     f"input{', new splits' if new_splits else ''}")
            series[label].append((experts_of(r), r["host_us_per_expert"]))
        elif r["op"] in ("gemm-host", "gemm-host-torch"):
            kind = "torch" if r["op"] == "gemm-host-torch" else "numpy"
            if new_splits and r.get("cold_us") not in (None, ""):   # like for like: new counts
                series[f"grouped_fprop, {kind} input, new splits (device calls faked)"].append(
                    (experts_of(r), float(r["cold_us"]) / experts_of(r)))
            else:
                series[f"grouped_fprop launch loop, {kind} input (device calls faked)"].append(
                    (experts_of(r), r["host_us_per_expert"]))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for (label, pts), marker in zip(sorted(series.items()), "osD^vP*"):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(_ticks())
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
    experts_seen = sorted({p[0] for pts in series.values() for p in pts})
    ax.set_xticks(experts_seen, [str(e) for e in experts_seen])
    ax.set_xlabel("experts per call")
    ax.set_ylabel("host time per expert (µs, log scale)")
    gpus = sorted({str(r.get("gpu", "?")) for r in rows if str(r["op"]).endswith("-host")})
    where = "this machine, no GPU" if gpus == ["none"] else f"GPU: {', '.join(gpus)}"
    ax.set_title(f"Host (CPU) time per expert per call ({where})", fontsize=11)
    ax.legend(frameon=False)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.series = dict(series)
    return fig


def write_png(rows, path):
    """One PNG per kind of row next to ``path`` (``bench.png`` for the GPU ops, ``bench-host.png``
    for host costs); returns the paths written ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return []
    from pathlib import Path

    path = Path(path)
    written = []
    gpus = sorted({str(r.get("gpu", "?")) for r in rows if r["op"] in GPU_OPS})
    for op in GPU_OPS:
        if any(r["op"] == op for r in rows):
            fig = plot_op(rows, op, f"measured on {', '.join(gpus)}")
            out = path.with_name(f"{path.stem}-{op}{path.suffix}")
            fig.savefig(out, dpi=110)
            plt.close(fig)
            written.append(out)
    fig = plot_host(rows)
    if fig is not None:
        out = path.with_name(f"{path.stem}-host{path.suffix}")
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)
    return written
