"""Shared benchmark machinery: CUDA-event timing, the measured copy roofline, the environment."""

from __future__ import annotations

import os
import platform
import time
from typing import NamedTuple

import numpy as np

__all__ = ["median_ms", "time_together", "Timing", "host_us", "spin", "copy_bandwidth_gbs",
           "with_setting",
           "l2_cache_bytes", "environment", "moe_splits", "roofline_pct", "timing_columns",
           "is_sticky_cuda_error"]

LEAD_CAP_MS = 50.0     # the longest spin lead (costs up to runs x 50 ms, only for calls > 17 ms)
LAUNCH_BOUND = 0.8     # a row is flagged launch-bound when its host time reaches this x the lead
last_lead_ms: float | None = None   # the spin lead of the latest median_ms call, and the host
last_host_us: float | None = None   # time (us) it was sized from


# A one-thread kernel that holds the stream for a given number of nanoseconds (%globaltimer),
# so that the host has queued the whole timed call before the GPU reaches the start event.
_SPIN_SOURCE = r"""
extern "C" __global__ void cugrouped_bench_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""
_spin_kernel = None


def spin(ns: int) -> None:
    """Hold the current stream for ``ns`` nanoseconds (one thread; the GPU stays otherwise free)."""
    global _spin_kernel
    import cupy

    if _spin_kernel is None:
        _spin_kernel = cupy.RawKernel(_SPIN_SOURCE, "cugrouped_bench_spin")
    _spin_kernel((1,), (1,), (np.uint64(ns),))


def cpu_loop_us(once, n: int = 200, repeats: int = 3) -> float:
    """CPU time of one ``once()`` in microseconds: the mean over ``n`` calls, the least of
    ``repeats`` such loops (what the code costs, without the hiccups a loop may meet), after one
    warm-up call. For host paths timed without a GPU, device calls faked: nothing waits, so the
    thread's CPU time is the host work, and unlike wall time it leaves out other processes and
    the VM's steal."""
    once()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(n):
            once()
        best = min(best, time.thread_time() - t0)
    return best / n * 1e6


# The device calls of the timing functions, apart so that a test can run them on a model GPU.
def _synchronize() -> None:
    import cupy

    cupy.cuda.Device().synchronize()


def _event_pair():
    import cupy

    return cupy.cuda.Event(), cupy.cuda.Event()


def _elapsed_ms(start, stop) -> float:
    import cupy

    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop)


def host_us(fn, runs: int = 20) -> float:
    """Median host (CPU) time of one call of ``fn`` in microseconds: what the call costs the
    Python thread that enqueues it, the GPU work itself not waited for (each call starts on an
    idle device, so the launch queue never fills up and blocks it)."""
    times = []
    for i in range(runs):
        _synchronize()
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    _synchronize()
    return float(np.median(times)) * 1e6


def _lead_ns(host: float) -> int:
    """The spin lead for a call whose host time is ``host`` us: 3x that, 0.2 ms to the cap."""
    return int(min(LEAD_CAP_MS * 1e6, max(200e3, 3e3 * host)))


def _timed_call(fn, i: int, lead_ns: int, events) -> float:
    """Device time of ``fn(i)`` in ms, the stream held ``lead_ns`` before it (:func:`median_ms`)."""
    start, stop = events
    spin(lead_ns)
    start.record()
    fn(i)
    stop.record()
    return _elapsed_ms(start, stop)


def median_ms(fn, runs: int, warmup: int = 3) -> float:
    """Median device time of ``fn(i)`` in milliseconds, between two CUDA events on the current
    stream, after ``warmup`` calls. Before each timed call a spin kernel holds the stream for
    longer than the call takes to enqueue, so the events measure the GPU work alone, not the
    host's launch overhead (reported apart by :func:`host_us`). ``fn`` must run on the current
    stream (CuPy's, which is torch's default stream too), or on streams joined back to it. The
    lead (3x the host time, 0.2 ms to :data:`LEAD_CAP_MS`) is kept in ``last_lead_ms`` for the
    row's :func:`timing_columns`."""
    global last_lead_ms, last_host_us
    for _ in range(warmup):
        fn(0)
    last_host_us = host_us(fn, 5)
    lead_ns = _lead_ns(last_host_us)
    last_lead_ms = lead_ns / 1e6
    events = _event_pair()
    return float(np.median([_timed_call(fn, i, lead_ns, events) for i in range(runs)]))


class Timing(NamedTuple):
    """One implementation's result of :func:`time_together`."""

    ms: float            # median device time of one call
    host_us: float       # median host time of one call (the spin lead was sized from it)
    lead_ms: float       # the spin lead before each timed call
    drift_pct: float     # median of the last third of its calls minus the first third's, % of ms

    def columns(self) -> dict:
        """The timing columns of the row: :func:`timing_columns` and ``drift_pct``."""
        return {**timing_columns(self.host_us, self.lead_ms), "drift_pct": self.drift_pct}


def time_together(fns: dict, runs: int, *, warmup: int = 3, host_runs: int = 20,
                  skipped=None) -> dict:
    """Device times of the implementations of one computation (``{name: fn}``), measured in the
    same run, interleaved: ``runs`` timed calls each, taken in turn one call of every
    implementation at a time, the order rotated by one per turn (A B C, B C A, C A B, ...). A GPU
    whose clocks drift over the measurement (heat, power limits, another process) then weighs on
    every implementation alike, where timing one after the other would favour the first.

    Each implementation is first called ``warmup`` times, then its host time is taken
    (``host_runs`` calls, :func:`host_us`) to size its spin lead as :func:`median_ms` does. One that
    raises, then or in a timed call, is left out: ``skipped(name, exc)`` reports it (a sticky
    CUDA error, or any error without ``skipped``, is raised instead). Returns ``{name: Timing}``
    for those timed, in the order given.

    ``fn(i)`` may use ``i`` to rotate its inputs over copies larger than the L2 cache: the timed
    calls are numbered in the order they run (turn ``t``'s calls get ``t * n .. t * n + n - 1``
    for ``n`` implementations), so consecutive calls never read the same copy, whichever
    implementation makes them."""
    prepared = {}
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn(0)
            hus = host_us(fn, host_runs)
        except Exception as exc:
            if is_sticky_cuda_error(exc) or skipped is None:
                raise
            skipped(name, exc)
            continue
        prepared[name] = (fn, hus, _lead_ns(hus))
    names = list(prepared)
    samples: dict = {n: [] for n in names}
    events = _event_pair()
    call = 0
    for turn in range(runs):
        order = [names[(turn + j) % len(names)] for j in range(len(names))]
        for name in order:
            if name not in prepared:      # failed in an earlier turn
                continue
            fn, _, lead = prepared[name]
            try:
                samples[name].append(_timed_call(fn, call, lead, events))
            except Exception as exc:
                if is_sticky_cuda_error(exc) or skipped is None:
                    raise
                skipped(name, exc)
                del prepared[name]
            call += 1
    names = [n for n in names if n in prepared]
    out = {}
    for name in names:
        t, (_, hus, lead) = samples[name], prepared[name]
        ms = float(np.median(t))
        third = max(1, len(t) // 3)
        drift = (float(np.median(t[-third:])) - float(np.median(t[:third]))) / ms * 100
        out[name] = Timing(ms, hus, lead / 1e6, drift)
    return out


def timing_columns(host: float | None = None, lead_ms: float | None = None) -> dict:
    """The columns every timed row carries: ``lead_ms``, the spin lead its :func:`median_ms` ran
    with (the latest call's when not given), and ``launch_bound``, True when the row's host time
    ``host`` (us; by default the one the lead was sized from) reached :data:`LAUNCH_BOUND` of the
    lead: the host may then still have been enqueueing when the GPU reached the start event, so
    ``ms`` may include launch overhead (a lead at its cap, or a host time that varies)."""
    if lead_ms is None:
        lead_ms, host = last_lead_ms, last_host_us if host is None else host
    if lead_ms is None:
        return {}
    return {"lead_ms": lead_ms,
            "launch_bound": bool(host is not None and host >= LAUNCH_BOUND * lead_ms * 1e3)}


def roofline_pct(ms: float, flops: float, nbytes: float, peak_tflops: float, bw_gbs: float) -> float:
    """Percent of the roofline: ``100 * roof_ms / ms`` with ``roof_ms = max(flops / peak,
    bytes / copy bandwidth)``, the least time the FLOPs or the HBM traffic allow, whichever binds."""
    roof_ms = max(flops / peak_tflops / 1e9, nbytes / bw_gbs / 1e6)
    return 100 * roof_ms / ms


_STICKY = ("device-side assert", "cudaErrorAssert", "illegal memory access", "IllegalAddress",
           "ILLEGAL_ADDRESS", "unspecified launch failure", "cudaErrorLaunchFailure",
           "LAUNCH_FAILED", "illegal instruction", "misaligned address", "cudaErrorMisalignedAddress",
           "hardware stack error", "invalid program counter", "launch timed out",
           "uncorrectable ECC")


def is_sticky_cuda_error(exc: BaseException) -> bool:
    """True for the CUDA errors that poison the context for the rest of the process (a device
    assert, an illegal address, a launch failure: every later CUDA call fails too), judged from
    the message of ``exc`` or of the exceptions it was raised from (torch's and CuPy's texts)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(s in str(exc) for s in _STICKY):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def l2_cache_bytes() -> int:
    """The current device's L2 cache size in bytes (50 MB on an H200)."""
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["l2CacheSize"])


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
        from .. import cublaslt

        env["cublaslt"] = cublaslt.version()
    except Exception:          # no libcublasLt installed: the GEMM benchmarks will say so
        env["cublaslt"] = "none"
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
    except ImportError:
        pass
    env["python"] = platform.python_version()
    env["cwd"] = os.getcwd()
    return env


def with_setting(fn, setter, value):
    """``fn(i)`` run with a tuning knob set to ``value`` by ``setter`` (which returns the previous
    value, as ``set_tiles_per_block`` and ``set_side_streams`` do), put back after, also when
    ``fn`` raises: a bench row of a variant, timed beside the default's."""
    def call(i):
        old = setter(value)
        try:
            return fn(i)
        finally:
            setter(old)
    return call


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
