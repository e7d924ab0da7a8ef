"""Shared benchmark machinery: CUDA-event timing, the measured copy roofline, the environment."""

from __future__ import annotations

import os
import platform
import time

import numpy as np

__all__ = ["median_ms", "copy_bandwidth_gbs", "environment", "moe_splits"]


def median_ms(fn, runs: int, warmup: int = 3) -> float:
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
    ms = median_ms(lambda i: b.__setitem__(slice(None), a), 20)
    return 2 * nbytes / ms / 1e6



def environment() -> dict:
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


def moe_splits(experts: int, tokens: int, jagged: bool, seed: int) -> list[int]:
    """Tokens per expert for a benchmark: equal shares, or jagged (Dirichlet(0.5) shares, seeded,
    with expert ``experts // 3`` always empty); always summing to ``tokens``."""
    if not jagged:
        base = [tokens // experts] * experts
        base[-1] += tokens - sum(base)
        return base
    rng = np.random.default_rng(seed)
    w = rng.dirichlet(np.full(experts, 0.5))
    w[experts // 3] = 0.0
    m = np.floor(w / w.sum() * tokens).astype(int)
    m[0] += tokens - m.sum()
    return [int(v) for v in m]
