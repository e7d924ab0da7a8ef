"""The performance targets the project set itself, checked against a benchmark run's rows.

Each target is a worst case over the configs it covers (the geometric mean would hide the shape
that misses): the table says the measured value, the target, and where the worst value came from.
Targets (on an H200): the cast at >= 90 % of the measured copy bandwidth, >= 3x torch eager and
>= 1.5x ``torch.compile``; the FP8 grouped GEMM >= 1.1x ``torch._scaled_grouped_mm`` (fprop,
dgrad and wgrad; wgrad against our bfloat16-dW row, as the peer writes bfloat16) and <= 3 us of
host time per expert. Under ``--quick`` the ``torch.compile`` peer compiles for the configs with
E <= 16 only (compile time), with static shapes: its best case. Pure functions of the rows:
tested on the CPU with made-up rows.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["Target", "TARGETS", "check_targets", "format_targets"]


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    op: str
    column: str
    goal: float
    higher_is_better: bool
    impl: str                      # the rows the column is read from
    unit: str = "x"


TARGETS = (
    Target("cast: % of copy bandwidth", "cast", "pct_copy_bw", 90.0, True, "cugrouped", "%"),
    Target("cast: speed-up over torch eager", "cast", "speedup_of_cugrouped", 3.0, True,
           "torch-eager"),
    Target("cast: speed-up over torch.compile", "cast", "speedup_of_cugrouped", 1.5, True,
           "torch-compile"),
    Target("gemm fp8: speed-up over torch._scaled_grouped_mm", "gemm",
           "speedup_of_cugrouped_fp8", 1.1, True, "torch-scaled_grouped_mm"),
    Target("gemm fp8: host time per expert", "gemm", "host_us_per_expert", 3.0, False,
           "cugrouped-fp8", "us"),
)


@dataclasses.dataclass(frozen=True)
class TargetResult:
    target: Target
    worst: float | None            # None: no row measured it
    where: str
    rows: int

    @property
    def met(self) -> bool | None:
        if self.worst is None:
            return None
        t = self.target
        return self.worst >= t.goal if t.higher_is_better else self.worst <= t.goal


def _number(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def check_targets(rows: list[dict], targets=TARGETS) -> list[TargetResult]:
    """The worst measured value of each target over the rows that carry it."""
    out = []
    for t in targets:
        vals = []
        for r in rows:
            if r.get("op") != t.op or r.get("impl") != t.impl:
                continue
            v = _number(r.get(t.column))
            if v is not None:
                where = " ".join(str(r[k]) for k in ("config", "scaling", "pass_name") if r.get(k))
                vals.append((v, where))
        if not vals:
            out.append(TargetResult(t, None, "not measured", 0))
            continue
        worst = min(vals) if t.higher_is_better else max(vals)
        out.append(TargetResult(t, worst[0], worst[1], len(vals)))
    return out


QUICK_NOTE = ("note: under --quick the torch.compile cast target rests on the configs with E <= 16 "
              "only, compiled with static shapes (its best case)")


def format_targets(results: list[TargetResult], quick: bool = False) -> str:
    """The targets table; with ``quick`` a last line says what the torch.compile target rests on."""
    lines = ["targets (worst case over the configs measured):"]
    for res in results:
        t = res.target
        goal = f"{'>=' if t.higher_is_better else '<='} {t.goal:g}{t.unit}"
        if res.worst is None:
            lines.append(f"  {t.name:<50} {goal:<10} not measured in this run")
            continue
        verdict = "met" if res.met else "MISSED"
        lines.append(f"  {t.name:<50} {goal:<10} worst {res.worst:8.2f}{t.unit:<2} {verdict:<7}"
                     f"({res.where}; {res.rows} rows)")
    if quick:
        lines.append(QUICK_NOTE)
    return "\n".join(lines)
