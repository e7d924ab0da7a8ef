"""Host threads that issue the per-expert ``cublasLtMatmul`` calls of whole side streams.

On the H200 a ``cublasLtMatmul`` call costs ~8 us of cuBLAS's own host work (its algorithm
set-up and the launch), against ~1-2 us of the loop's Python around it, so with many small
experts the loop waits on cuBLAS. ctypes releases the GIL for the length of a foreign call, and
cuBLASLt may be called from several host threads at once, with one handle: worker threads, each
issuing the calls of its side streams in the loop's order, while the Python parts of the calls
take turns. The results are the same bits (each expert's GEMM is its own, on the same stream, in
the same order per stream); what may change is only host time.

Package-private; enabled by :func:`cugrouped.ops.grouped_gemm.set_host_threads`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence


class HostThreads:
    """``count - 1`` daemon worker threads (the caller's own thread is the first issuer), each
    bound once to the device by ``bind`` (e.g. ``cudaSetDevice``) when it starts; a bind that
    fails is that worker's answer to every batch it is given."""

    def __init__(self, count: int, bind: Callable[[], None] | None = None):
        self.count = count
        self.closed = False
        self._jobs = [queue.SimpleQueue() for _ in range(count - 1)]
        self._threads = [threading.Thread(target=_work, args=(q, bind), daemon=True,
                                          name=f"cugrouped-cublasLt-{i + 1}")
                         for i, q in enumerate(self._jobs)]
        for t in self._threads:
            t.start()

    def run(self, fn: Callable[..., int], batches: Sequence[list]) -> tuple[int, int] | None:
        """``fn(*args)`` for every ``(expert, args)`` of every batch, batch ``i`` in order on
        issuer ``i`` (at most :attr:`count` batches; the caller's thread issues the first);
        returns when every issuer is done, whatever happens meanwhile (the caller joins the side
        streams next: no call may be issued after that): the ``(expert, status)`` of the first
        nonzero status in expert order (each batch stops at its first), or None. An exception
        in any issuer (or an interrupt of the wait) is raised then."""
        if self.closed:
            raise RuntimeError("these host threads are closed")
        if len(batches) > self.count:
            raise ValueError(f"batches: at most {self.count} (one per issuer), got {len(batches)}")
        done: queue.SimpleQueue = queue.SimpleQueue()     # this run's results only
        sent = 0
        for q, calls in zip(self._jobs, batches[1:]):
            if calls:
                q.put((fn, calls, done))
                sent += 1
        results: list = []
        error = None
        try:
            results.append(_issue(fn, batches[0]) if batches else None)
        except BaseException as exc:  # noqa: BLE001 (raised once the others are done)
            error = exc
        while sent:
            try:
                r = done.get()
            except BaseException as exc:  # noqa: BLE001 (an interrupt: wait for them first)
                error = error or exc
                continue
            sent -= 1
            if isinstance(r, BaseException):
                error = error or r
            else:
                results.append(r)
        if error is not None:
            raise error
        failures = [r for r in results if r is not None]
        return min(failures) if failures else None

    def close(self) -> None:
        """Stop the workers (they finish the batch at hand); :meth:`run` refuses afterwards."""
        self.closed = True
        for q in self._jobs:
            q.put(None)
        for t in self._threads:
            t.join()


def _work(jobs: queue.SimpleQueue, bind) -> None:
    bind_error = None
    if bind is not None:
        try:
            bind()
        except BaseException as exc:  # noqa: BLE001 (every batch is answered with it)
            bind_error = exc
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, calls, done = job
        if bind_error is not None:
            done.put(bind_error)
            continue
        try:
            done.put(_issue(fn, calls))
        except BaseException as exc:  # noqa: BLE001 (handed to the caller's thread)
            done.put(exc)


def _issue(fn, calls) -> tuple[int, int] | None:
    for expert, args in calls:
        status = fn(*args)
        if status:
            return (expert, status)
    return None


def issuers_for(wanted: int, streams: int, calls: int, min_calls: int) -> int:
    """How many threads issue ``calls`` spread over ``streams`` side streams when ``wanted``
    may: at most ``calls // min_calls`` (each thread's share repays its hand-off), and a
    divisor of ``streams`` (each thread issues whole streams: the same number of them)."""
    n = min(wanted, streams, calls // min_calls)
    while n > 1 and streams % n:
        n -= 1
    return max(n, 1)
