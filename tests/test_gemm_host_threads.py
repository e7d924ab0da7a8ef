"""The per-expert loop's cuBLASLt calls issued from several host threads (set_host_threads): the
same calls on the same streams in the same order per stream as from the caller's thread alone,
really issued by the workers (each bound to the device once), failures and exceptions brought
back to the caller with every side stream joined, and everything on the caller's thread during
a CUDA graph capture. The device calls are the host benchmark's fakes; what threading saves in
host time is for a GPU run to measure (bench gemm's ``cugrouped-fp8-t4`` rows)."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

import cugrouped
from cugrouped.bench.gemm import host_loop_state
from cugrouped.ops import _host_threads
from cugrouped.ops import grouped_gemm as gg
from test_grouped_gemm import make_fp8


@pytest.fixture
def threads():
    """``set(n)`` for the test, the count put back after it."""
    old = gg.host_threads()
    yield gg.set_host_threads
    gg.set_host_threads(old)


def _value(arg):
    obj = getattr(arg, "_obj", None)
    if obj is not None:
        return bytes(obj)
    return getattr(arg, "value", arg)


def _state_recording(bound=None):
    """The host-loop fake state, recording each matmul's arguments (as values), its stream and
    the thread that issued it; the fork and join events' records in order."""
    st = host_loop_state()
    calls, events = [], []
    lock = threading.Lock()

    def matmul(handle, *args):
        with lock:
            calls.append((threading.get_ident(), tuple(_value(a) for a in args)))
        return 0

    class Event:
        def __init__(self, name):
            self.name = name

        def record(self, stream=None):
            events.append((self.name, getattr(stream, "ptr", None)))

    st.matmul = matmul
    st.fork_event = Event("fork")
    st.done_events = [Event(f"done{i}") for i in range(len(st.streams))]
    st.bind_thread = (lambda: bound.append(threading.get_ident())) if bound is not None else None
    return st, calls, events


def _fprop_plan(m_splits, k=32, n=16):
    X, W, _ = make_fp8(m_splits, k, n, seed=5)
    p = gg.check_fprop(X, W)
    _, blocks = gg.outputs(p, None, np)
    return p, blocks, gg.plan_arrays(p, blocks)


def _by_stream(calls):
    """The calls grouped by their stream (the last argument), in issue order."""
    out: dict = {}
    for _, args in calls:
        out.setdefault(args[-1], []).append(args)
    return out


@pytest.mark.parametrize("n", [2, 4, 8])        # 8: a pool of 8, of which the 4 streams use 4
def test_threads_make_the_same_calls_per_stream_as_one(threads, n):
    m_splits = [5, 0, 19, 3, 40, 1, 7, 0, 9, 12, 33] * 6     # 54 calls: 6 per thread and more
    p, blocks, vp = _fprop_plan(m_splits)
    bound = []
    st2, calls, events = _state_recording(bound)    # one state: the same cached layouts
    gg._launch_plan(vp, p, blocks, st2)
    serial, serial_events = list(calls), list(events)
    calls.clear()
    events.clear()
    threaded, threaded_events = calls, events
    threads(n)
    with cugrouped.record_launches() as log:
        gg._launch_plan(vp, p, blocks, st2)
    live = sum(1 for m in m_splits if m)
    assert len(threaded) == len(serial) == live
    assert _by_stream(threaded) == _by_stream(serial)
    assert threaded_events == serial_events                      # one fork, every stream joined
    issuers = _host_threads.issuers_for(n, gg.side_streams(), live, gg.MIN_CALLS_PER_THREAD)
    assert issuers > 1
    assert len({tid for tid, _ in threaded}) == issuers          # the workers issued theirs
    assert threading.get_ident() in {tid for tid, _ in threaded}  # and the caller its own
    assert st2._issuers.count == n                               # one pool, of n issuers
    assert len(bound) == n - 1 and threading.get_ident() not in bound
    assert [e.kernel for e in log].count("cublasLtMatmul") == live
    st2._issuers.close()


def test_a_failed_call_names_its_expert_and_every_stream_is_joined(threads):
    from cugrouped.cublaslt import CublasLtError

    m_splits = [5, 3, 19, 3, 40, 1, 7, 2] * 4
    p, blocks, vp = _fprop_plan(m_splits)
    st, calls, events = _state_recording()
    real = st.matmul

    def matmul(handle, desc, alpha, a, *rest):      # expert 2 (its A pointer) is refused
        real(handle, desc, alpha, a, *rest)
        return 15 if a == vp.calls()[2].a_ptr else 0

    st.matmul = matmul
    threads(4)
    with pytest.raises(CublasLtError, match="cublasLtMatmul.*expert 2"):
        gg._launch_plan(vp, p, blocks, st)
    assert [name for name, _ in events] == ["fork"] + [f"done{i}" for i in range(4)]
    # the other streams' experts were all issued; expert 2's stream (2, 6, 10, ...) stopped there
    assert len(calls) == 32 - 7


def test_an_exception_in_a_worker_reaches_the_caller_after_the_others(threads):
    p, blocks, vp = _fprop_plan([5, 3, 19, 3, 40, 1] * 4)
    st, calls, events = _state_recording()
    caller = threading.get_ident()
    real = st.matmul

    def matmul(*args):
        if threading.get_ident() != caller:
            raise ctypes.ArgumentError("argument 4: wrong type")
        return real(*args)

    st.matmul = matmul
    threads(2)
    with pytest.raises(ctypes.ArgumentError, match="wrong type"):
        gg._launch_plan(vp, p, blocks, st)
    assert [name for name, _ in events] == ["fork"] + [f"done{i}" for i in range(4)]
    assert {tid for tid, _ in calls} == {caller}


def test_during_a_graph_capture_the_caller_issues_everything(threads):
    p, blocks, vp = _fprop_plan([5, 3, 19, 3, 40, 1] * 8)
    st, calls, _ = _state_recording()
    st.is_capturing = lambda stream: True
    threads(4)
    gg._launch_plan(vp, p, blocks, st)
    assert len(calls) == 48 and {tid for tid, _ in calls} == {threading.get_ident()}
    assert st._issuers is None                                   # no thread was started


def test_few_calls_or_one_stream_stay_on_the_caller(threads):
    """One expert, one side stream, or fewer than MIN_CALLS_PER_THREAD calls for a second
    thread: the caller's thread issues them (a worker's hand-off costs more than it saves)."""
    st, calls, _ = _state_recording()
    threads(4)
    few = [3] * (2 * gg.MIN_CALLS_PER_THREAD - 1)
    for m_splits, streams in (([7], 4), ([5, 3, 9] * 8, 1), (few, 4)):
        p, blocks, vp = _fprop_plan(m_splits)
        old = gg.set_side_streams(streams)
        try:
            gg._launch_plan(vp, p, blocks, st)
        finally:
            gg.set_side_streams(old)
    assert len(calls) == 1 + 24 + len(few) and {tid for tid, _ in calls} == {threading.get_ident()}
    assert st._issuers is None
    calls.clear()
    p, blocks, vp = _fprop_plan(few + [3])            # enough for two: two issue them
    gg._launch_plan(vp, p, blocks, st)
    assert len({tid for tid, _ in calls}) == 2
    st._issuers.close()


def test_one_pool_serves_calls_that_use_fewer_of_its_threads(threads):
    """The pool has set_host_threads' count whatever a call uses of it: calls with more or
    fewer experts (more or fewer threads' worth) do not make it again."""
    st, calls, _ = _state_recording()
    threads(4)
    plans = [_fprop_plan([3] * e) for e in (16, 32, 16, 40)]
    used, pools = [], set()
    for p, blocks, vp in plans:
        calls.clear()
        gg._launch_plan(vp, p, blocks, st)
        used.append(len({tid for tid, _ in calls}))
        pools.add(id(st._issuers))
    assert used == [2, 4, 2, 4] and len(pools) == 1 and st._issuers.count == 4
    st._issuers.close()


@pytest.mark.parametrize("wanted,streams,calls,want", [
    (4, 4, 64, 4), (4, 4, 31, 2), (4, 4, 15, 1), (8, 4, 64, 4), (4, 3, 64, 3), (2, 3, 64, 1),
    (4, 16, 64, 4), (8, 16, 48, 4), (4, 6, 64, 3), (1, 4, 64, 1), (4, 1, 64, 1)])
def test_issuers_divide_the_streams_and_have_calls_enough(wanted, streams, calls, want):
    assert _host_threads.issuers_for(wanted, streams, calls, 8) == want


def test_a_worker_whose_bind_failed_answers_every_batch_with_it():
    def bind():
        raise RuntimeError("cudaSetDevice: no device")

    pool = _host_threads.HostThreads(2, bind)
    try:
        for _ in range(2):                       # every time, and never a hang
            with pytest.raises(RuntimeError, match="cudaSetDevice: no device"):
                pool.run(lambda: 0, [[(0, ())], [(1, ())]])
        assert pool.run(lambda: 0, [[(0, ())], []]) is None   # the caller's alone: fine
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(lambda: 0, [[(0, ())]])


def test_the_callers_own_failure_waits_for_the_workers_first():
    """An exception in the caller's batch is raised only once every worker has issued its
    batch (the side streams are joined right after: nothing may be issued later)."""
    worker_done = threading.Event()
    caller = threading.get_ident()

    def fn(x):
        if threading.get_ident() == caller:
            raise KeyboardInterrupt
        threading.Event().wait(0.05)             # a slow worker
        worker_done.set()
        return 0

    pool = _host_threads.HostThreads(2)
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.run(fn, [[(0, (0,))], [(1, (1,))]])
        assert worker_done.is_set()
        worker_done.clear()
        assert pool.run(fn, [[], [(1, (1,))]]) is None and worker_done.is_set()
    finally:
        pool.close()


@pytest.mark.parametrize("bad", [0, 33, 2.0, True, "4"])
def test_set_host_threads_refuses_what_is_not_a_count(threads, bad):
    with pytest.raises(ValueError, match=r"n: expected an int in \[1, 32\]"):
        threads(bad)
    assert gg.host_threads() == 1


def test_the_issuers_are_made_again_for_another_count_and_stop_on_close():
    st = host_loop_state()
    a = st.issuers(3)
    assert st.issuers(3) is a and all(t.is_alive() for t in a._threads)
    b = st.issuers(2)
    assert b is not a and b.count == 2 and not any(t.is_alive() for t in a._threads)
    assert a.closed and not b.closed
    b.close()
    assert not any(t.is_alive() for t in b._threads)


def test_host_threads_run_refuses_more_batches_than_issuers():
    pool = _host_threads.HostThreads(2)
    try:
        with pytest.raises(ValueError, match="batches: at most 2"):
            pool.run(lambda: 0, [[], [], []])
        assert pool.run(lambda *a: 0, [[(0, ())], [(1, ())]]) is None
        assert pool.run(lambda x: x, [[(0, (0,)), (2, (9,))], [(1, (7,)), (3, (8,))]]) == (1, 7)
    finally:
        pool.close()
