"""``python -m cugrouped bench [cast|gemm|layer|all]``: cugrouped against what users would pick instead.

Timing: CUDA events around each call, median of many runs after warm-up, inputs rotated over
several copies so that the working set exceeds the L2 cache. Peers run in the same process on the
same data. Without a GPU the command times what can run on the CPU (host-side launch planning per
call) and says what it skipped. One module per op: ``cast``, ``gemm``, ``layer``, ``block``
(block scaling: its cast and its GEMMs) and ``mxfp8`` (MXFP8: its cast and its GEMMs).
"""

from __future__ import annotations

import csv
import itertools
import time
import traceback
from pathlib import Path

from ..ops import _cast_inputs
from ..ops import pad_cast_transpose as pct
from .common import cpu_loop_us, environment, is_sticky_cuda_error

__all__ = ["run_bench"]


def bench_planning(rows: list[dict], patterns: int = 300) -> None:
    """Host cost per call that needs no GPU: checking the inputs and ``scale``, allocating the
    outputs (NumPy here, CuPy's pool or torch's allocator on a GPU), planning the launches and
    packing the by-value argument blocks of the cast op, for a list of E arrays and for one array
    plus its splits; everything but the launch itself. NumPy arrays, and torch CPU tensors, whose
    views are read the way CUDA tensors' are. Two rows per form: ``splits="same"``, the same
    arrays every call (the plans and argument blocks are remembered), and ``splits="new"``,
    ``patterns`` different token counts in turn (more than the memos keep), as in MoE training,
    where the router changes the counts every step."""
    import numpy as np

    try:
        import torch
    except ImportError:
        torch = None
    k = 128
    for experts in (8, 64, 256):
        # pattern j: expert i gets 1000 + 17 i + (7 j + 13 i) % 97 rows, views of one buffer
        counts = [[1000 + 17 * i + (7 * j + 13 * i) % 97 for i in range(experts)]
                  for j in range(patterns)]
        buf = np.empty((max(map(sum, counts)), k), np.float32)
        scale = np.ones(experts, np.float32)
        wrap = {"numpy": lambda a: a}
        if torch is not None:
            wrap["torch"] = torch.from_numpy
        for kind, to_kind in wrap.items():
            x = to_kind(buf)
            starts = [list(itertools.accumulate(m, initial=0)) for m in counts]
            calls = {"list": [([x[a:b] for a, b in zip(s, s[1:])], None) for s in starts],
                     "tensor": [(x[:s[-1]], m) for s, m in zip(starts, counts)]}
            for form, args_per_pattern in calls.items():
                for splits, pool in (("same", args_per_pattern[:1]), ("new", args_per_pattern)):
                    turn = itertools.count()

                    def once(pool=pool, turn=turn):
                        args = pool[next(turn) % len(pool)]
                        g = _cast_inputs.normalize_inputs(*args)
                        pct.check_scale_and_out(g, 16, True, True, False, scale, None)
                        res = pct._outputs(g, np, "e4m3", 16, True, True, False, scale, None)
                        plans = pct.plan_launches(g.m_splits, g.k, 16)
                        pct._packed_groups(g, res, plans, 16)

                    us = cpu_loop_us(once, n=patterns if splits == "new" else 200)
                    rows.append(dict(op="cast-host", config=f"E{experts}-{kind}-{form}",
                                     splits=splits, impl="cugrouped", host_us=us,
                                     host_us_per_expert=us / experts))
                    print(f"cast op host path, {experts:>3} experts, {kind:<5} {form:<6}, "
                          f"{splits} splits: {us:8.1f} us per call "
                          f"({us / experts:.2f} us per expert)")


def bench_launch_argument(rows: list[dict], reps: int = 2000) -> None:
    """What handing the cast kernel's argument block to CuPy costs per launch, on the CPU: as the
    0-d record itself (CuPy reads its address through ``__array_interface__``, which describes
    every field of the struct first) and as :func:`~cugrouped.ops._launch.by_value` passes it
    (a ``CPointer`` at its bytes). Both are CuPy's real conversions; the launch is not timed."""
    import numpy as np
    from cupy.cuda.function import CNumpyArray

    from ..ops import _launch

    arg = np.zeros((), dtype=pct.group_dtype())
    for form, convert in (("record", CNumpyArray), ("by_value", _launch.by_value)):
        us = cpu_loop_us(lambda convert=convert: convert(arg), n=reps)
        rows.append(dict(op="launch-arg-host", config=form, impl="cugrouped", host_us=us))
        print(f"cast kernel argument block ({arg.dtype.itemsize} bytes) to CuPy as {form:<8}: "
              f"{us:6.2f} us per launch")


def _write_csv(rows: list[dict], env: dict, out: Path) -> None:
    keys = sorted({k for r in rows for k in r} | set(env))
    with open(out / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({**env, **r})


def run_bench(what: str = "all", out_dir: str | None = None, quick: bool = False) -> int:
    """Run the benchmarks; with ``out_dir`` the CSV is rewritten after every section, so a run
    killed part-way keeps what it measured. A section that raises is reported and the others
    still run; the return code is then 1. After a sticky CUDA error (a device-side assert, an
    illegal address: the context is unusable for the rest of the process) the remaining sections
    are skipped with the reason printed. Interrupted (SIGINT: the GPU check's time limit), the
    bench runs no further section. Whatever happened, the CSV, plots and targets of what was
    measured are written; the return code is then 130 (interrupted) or 1."""
    from .. import gpu_available

    rows: list[dict] = []
    out = Path(out_dir) if out_dir else None
    env = environment() if out else {}
    if out:
        out.mkdir(parents=True, exist_ok=True)
    failed: list[str] = []
    section = Sections(failed, lambda: _write_csv(rows, env, out) if out else None)

    interrupted, on_gpu = False, gpu_available()
    try:
        _run_sections(what, quick, rows, section, on_gpu)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        _write_results(what, rows, env, out, targets=on_gpu, quick=quick)
    if failed:
        print(f"bench: these sections failed: {', '.join(failed)}")
    return 130 if interrupted else 1 if failed else 0


class Sections:
    """Runs one section at a time (``section(name, fn, *args)``): reports an exception and goes
    on; after a sticky CUDA error (:func:`~.common.is_sticky_cuda_error`) skips every later
    section with the reason; re-raises KeyboardInterrupt (the GPU check's time limit). ``save``
    runs after each section that ran (the CSV rewritten)."""

    def __init__(self, failed: list[str], save=lambda: None):
        self.failed, self.save = failed, save
        self.sticky: str | None = None

    def __call__(self, name, fn, *args):
        if self.sticky:
            print(f"bench {name}: skipped: an earlier section hit a sticky CUDA error ({self.sticky}); "
                  f"the CUDA context is unusable for the rest of this process")
            self.failed.append(f"{name} (skipped)")
            return
        t0 = time.perf_counter()
        try:
            fn(*args)
        except Exception as exc:                    # report, keep the other sections' numbers
            traceback.print_exc()
            self.failed.append(name)
            if is_sticky_cuda_error(exc):
                self.sticky = f"{name}: {type(exc).__name__}: {str(exc).strip()[:160]}"
        except KeyboardInterrupt:   # a time limit (the GPU check's SIGINT): keep what was measured
            print(f"bench {name}: interrupted after {time.perf_counter() - t0:.1f} s; the "
                  f"sections after it are not run")
            self.failed.append(f"{name} (interrupted)")
            raise
        print(f"bench {name}: {time.perf_counter() - t0:.1f} s")
        self.save()


def _write_results(what: str, rows: list[dict], env: dict, out: Path | None, targets: bool,
                   quick: bool = False) -> None:
    """The CSV, plots and (``targets``) the targets table of ``rows``; a step that fails is
    reported and costs none of the others (host-side work: no CUDA call)."""
    if out and not rows:
        print(f"bench {what}: nothing measured, so no CSV or plot written to {out}")
    elif out:
        try:
            _write_csv(rows, env, out)
            print(f"wrote {out / 'bench.csv'}")
        except Exception:
            traceback.print_exc()
        try:
            from .plot import write_png

            for png in write_png([{**env, **r} for r in rows], out / "bench.png"):
                print(f"wrote {png}")
        except Exception:
            traceback.print_exc()
    if targets:
        from .targets import check_targets, format_targets

        print(format_targets(check_targets(rows), quick))


def _run_sections(what: str, quick: bool, rows: list[dict], section, on_gpu: bool) -> None:
    """Every section of ``what`` in order: the host-side ones, then (with a GPU) the device
    timings, the numbers the issues' targets are judged on first."""
    if what in ("cast", "all"):
        section("cast-host", bench_planning, rows)
        section("launch-arg-host", bench_launch_argument, rows)
        from .block import bench_block_planning

        section("block-cast-host", bench_block_planning, rows)
    if what in ("gemm", "all"):
        from .gemm import bench_host_loop

        section("gemm-host", bench_host_loop, rows)
    if not on_gpu:
        skipped = {"cast": "cast vs torch eager/compile, fused permute vs index_select, fused "
                           "SwiGLU vs torch's activation first, block-scaled and MXFP8 casts vs "
                           "torch eager/compile",
                   "gemm": "gemm vs the torch peers, block-scaled and MXFP8 vs per-tensor FP8 "
                           "GEMMs",
                   "layer": "layer forward+backward vs bf16 and torch, block vs current scaling"}
        names = "; ".join(v for k, v in skipped.items() if what in (k, "all"))
        print(f"bench {what}: no GPU here; skipped the device timings ({names}). Run "
              "scripts/gpu_check.sh on a GPU machine.")
        return
    # The numbers the issues' targets are judged on first (cast vs torch eager, the GEMMs vs
    # torch's, the layer), then the torch.compile peer (its compile is the slowest step), the
    # fused permute, block scaling and MXFP8: under the GPU check's time limit a late section
    # is the one that gets cut.
    from .cast import bench_cast, bench_permute_cast

    if what in ("cast", "all"):
        section("cast", bench_cast, quick, rows, ("cugrouped", "torch-eager"))
    if what in ("gemm", "all"):
        from .gemm import bench_gemm

        section("gemm", bench_gemm, quick, rows)
    if what in ("layer", "all"):
        from .layer import bench_layer

        section("layer", bench_layer, quick, rows)
    from .block import bench_block_cast, bench_block_gemm, bench_block_layer
    from .mxfp8 import bench_mx_cast, bench_mx_gemm

    if what in ("cast", "all"):
        section("cast-compile", bench_cast, quick, rows, ("torch-compile",))
        section("permute-cast", bench_permute_cast, quick, rows)
        from .swiglu import bench_swiglu_cast

        section("swiglu-cast", bench_swiglu_cast, quick, rows)
        section("block-cast", bench_block_cast, quick, rows)
    if what in ("gemm", "all"):
        section("block-gemm", bench_block_gemm, quick, rows)
    if what in ("layer", "all"):
        section("block-layer", bench_block_layer, quick, rows)
    if what in ("cast", "all"):
        section("mx-cast", bench_mx_cast, quick, rows)
    if what in ("gemm", "all"):
        section("mx-gemm", bench_mx_gemm, quick, rows)
