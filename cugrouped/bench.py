"""``python -m cugrouped bench [cast|gemm|layer|all]``: cugrouped against what users would pick instead.

Timing: CUDA events around each call, median of many runs after warm-up, inputs rotated over
several copies so that the working set exceeds the L2 cache. Peers run in the same process on the
same data. Without a GPU the command times what can run on the CPU (host-side launch planning per
call) and says what it skipped.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import platform
import time
from pathlib import Path

import numpy as np

from .ops import pad_cast_transpose as pct


@dataclasses.dataclass(frozen=True)
class CastConfig:
    """One cast experiment: E experts, hidden size k, total tokens, split pattern."""

    name: str
    experts: int
    k: int
    tokens: int
    jagged: bool

    def m_splits(self) -> list[int]:
        if not self.jagged:
            base = [self.tokens // self.experts] * self.experts
            base[-1] += self.tokens - sum(base)
            return base
        rng = np.random.default_rng(self.experts * 7919 + self.k)
        w = rng.dirichlet(np.full(self.experts, 0.5))
        w[self.experts // 3] = 0.0                       # always one empty expert
        m = np.floor(w / w.sum() * self.tokens).astype(int)
        m[0] += self.tokens - m.sum()
        return [int(v) for v in m]


CAST_CONFIGS = (
    CastConfig("dsv3-E8-jagged", 8, 7168, 16384, True),
    CastConfig("dsv3-E8-equal", 8, 7168, 65536, False),
    CastConfig("qwen-E16-equal", 16, 4096, 40960, False),
    CastConfig("fine-E64-jagged", 64, 4096, 8192, True),
    CastConfig("fine-E64-jagged-64k", 64, 7168, 65536, True),
    CastConfig("mixtral-E8-jagged", 8, 4096, 4096, True),
)
QUICK_CAST = CAST_CONFIGS[:1] + CAST_CONFIGS[3:4]


def _median_ms(fn, runs: int, warmup: int = 3) -> float:
    import cupy

    for _ in range(warmup):
        fn(0)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for i in range(runs):
        start.record()
        fn(i)
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth (read + write bytes per second), the roofline."""
    import cupy

    a = cupy.empty(nbytes, dtype=np.uint8)
    b = cupy.empty_like(a)
    ms = _median_ms(lambda i: b.__setitem__(slice(None), a), 20)
    return 2 * nbytes / ms / 1e6


def _torch_peers(cfg: CastConfig, x_torch, m_splits):
    """The peers: torch eager cat-pad + scale/clamp/cast + transpose + amax, and torch.compile of it."""
    import torch

    m_pad = pct.padded_splits(m_splits, 16)

    def eager(x):
        outs = []
        for xi, mp in zip(torch.split(x, m_splits), m_pad):
            amax = xi.abs().amax() if xi.numel() else torch.zeros((), device=x.device)
            scale = torch.where(amax > 0, 448.0 / amax.float(), torch.ones_like(amax, dtype=torch.float32))
            q = (xi.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            padded = torch.cat([q.view(torch.uint8), q.new_zeros((mp - q.shape[0], q.shape[1]), dtype=torch.uint8)])
            outs.append((q, padded.t().contiguous(), amax, 1 / scale))
        return outs

    return eager, torch.compile(eager, dynamic=False)


def bench_cast(quick: bool, rows: list[dict]) -> None:
    import cupy

    configs = QUICK_CAST if quick else CAST_CONFIGS
    bw = copy_bandwidth_gbs()
    print(f"device-to-device copy bandwidth: {bw:.0f} GB/s")
    try:
        import torch
    except ImportError:
        torch = None
        print("torch not installed: peers skipped")
    for cfg in configs:
        m_splits = cfg.m_splits()
        copies = max(2, int(np.ceil(256e6 / (cfg.tokens * cfg.k * 2))))   # > L2 in rotation
        xs = [cupy.random.standard_normal((cfg.tokens, cfg.k), dtype=np.float32).astype(cupy.float16)
              .view(cupy.uint16) for _ in range(copies)]
        for scaling in ("current", "delayed"):
            scale = None if scaling == "current" else cupy.ones(cfg.experts, np.float32)
            ms = _median_ms(lambda i: pct.multi_pad_cast_transpose(
                xs[i % copies], m_splits, dtype="float16", scale=scale), 30)
            reads = (2 if scaling == "current" else 1) * cfg.tokens * cfg.k * 2
            writes = cfg.tokens * cfg.k + sum(pct.padded_splits(m_splits, 16)) * cfg.k
            gbs = (reads + writes) / ms / 1e6
            row = dict(op="cast", config=cfg.name, scaling=scaling, impl="cugrouped", ms=ms, gbs=gbs,
                       pct_copy_bw=100 * gbs / bw)
            rows.append(row)
            print(f"{cfg.name:<22} {scaling:<8} cugrouped      {ms:8.3f} ms {gbs:7.0f} GB/s "
                  f"{row['pct_copy_bw']:5.1f}% of copy")
        if torch is None:
            continue
        xt = [torch.from_dlpack(x).view(torch.float16) for x in xs]
        for impl, fn in zip(("torch-eager", "torch-compile"), _torch_peers(cfg, xt[0], m_splits)):
            ms = _median_ms(lambda i: fn(xt[i % copies]), 30)
            ours = next(r["ms"] for r in rows if r["config"] == cfg.name and r["scaling"] == "current")
            rows.append(dict(op="cast", config=cfg.name, scaling="current", impl=impl, ms=ms,
                             speedup_of_cugrouped=ms / ours))
            print(f"{cfg.name:<22} current  {impl:<14} {ms:8.3f} ms   cugrouped is {ms / ours:5.2f}x faster")


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
    from . import gpu_available

    rows: list[dict] = []
    bench_planning(rows)
    if not gpu_available():
        print(f"bench {what}: no GPU here; skipped the device timings (cast vs torch eager/compile, "
              "gemm, layer). Run scripts/gpu_check.sh on a GPU machine.")
    else:
        if what in ("cast", "all"):
            bench_cast(quick, rows)
        if what in ("gemm", "layer", "all"):
            print(f"bench {what}: the grouped GEMM and the PyTorch layer are not built yet; skipped")
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        env = _environment()
        keys = sorted({k for r in rows for k in r} | set(env))
        with open(out / "bench.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            for r in rows:
                w.writerow({**env, **r})
        print(f"wrote {out / 'bench.csv'}")
    return 0


def _environment() -> dict:
    env = {"host": platform.node(), "date": time.strftime("%Y-%m-%d"), "numpy": np.__version__}
    try:
        import cupy

        env["cupy"] = cupy.__version__
        env["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        env["driver"] = cupy.cuda.runtime.driverGetVersion()
        env["gpu"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:
        env["gpu"] = "none"
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:
        pass
    env["python"] = platform.python_version()
    env["cwd"] = os.getcwd()
    return env
