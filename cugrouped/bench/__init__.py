"""``python -m cugrouped bench [cast|gemm|layer|all]``: cugrouped against what users would pick instead.

Timing: CUDA events around each call, median of many runs after warm-up, inputs rotated over
several copies so that the working set exceeds the L2 cache. Peers run in the same process on the
same data. Without a GPU the command times what can run on the CPU (host-side launch planning per
call) and says what it skipped. One module per op: ``cast``, ``gemm``, ``layer``.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

from ..ops import pad_cast_transpose as pct
from .common import environment

__all__ = ["run_bench"]


def bench_planning(rows: list[dict]) -> None:
    """Host cost per call that does not need a GPU: argument planning for E experts."""
    for experts in (8, 64, 256):
        m = [1000 + 17 * i for i in range(experts)]
        t0 = time.perf_counter()
        n = 200
        for _ in range(n):
            pct.plan_launches(m, 7168, 16)
        us = (time.perf_counter() - t0) / n * 1e6
        rows.append(dict(op="plan", config=f"E{experts}", impl="cugrouped", host_us=us,
                         host_us_per_expert=us / experts))
        print(f"launch planning, {experts:>3} experts: {us:8.1f} us per call ({us / experts:.2f} us per expert)")


def run_bench(what: str = "all", out_dir: str | None = None, quick: bool = False) -> int:
    from .. import gpu_available

    rows: list[dict] = []
    bench_planning(rows)
    if not gpu_available():
        print(f"bench {what}: no GPU here; skipped the device timings (cast vs torch eager/compile, "
              "gemm, layer). Run scripts/gpu_check.sh on a GPU machine.")
    else:
        if what in ("cast", "all"):
            from .cast import bench_cast

            bench_cast(quick, rows)
        if what in ("gemm", "all"):
            try:
                from .gemm import bench_gemm
            except ImportError:
                print("bench gemm: not written yet; skipped")
            else:
                bench_gemm(quick, rows)
        if what in ("layer", "all"):
            print("bench layer: the PyTorch layer is not built yet; skipped")
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        env = environment()
        keys = sorted({k for r in rows for k in r} | set(env))
        with open(out / "bench.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            for r in rows:
                w.writerow({**env, **r})
        print(f"wrote {out / 'bench.csv'}")
    return 0


