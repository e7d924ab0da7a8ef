"""The per-expert launch of the grouped GEMMs (CUDA only): per-device state, the
``cublasLtMatmul`` loop over side streams, and the dispatch between it and the grouped path.
Package-private: the names are re-exported by :mod:`cugrouped.ops.grouped_gemm`."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..cublaslt import _enums as E
from ..cublaslt._enums import CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0 as MX_MODE
from ..cublaslt import descriptors as _D  # imports without loading libcublasLt
from . import _launch
from ._gemm_grouped import GroupedRefused, _launch_grouped, forget_path, path_for
from ._gemm_memo import Checked, prepared_out
from ._gemm_plan import (SCALE_POINTER_ALIGN, ExpertGemm, Problem, VecPlan, as_blocks,
                         block_scaling_unsupported, shape_signature, workspace_bytes_for)
from ._host_threads import issuers_for

# Side streams the per-expert loop is spread over by default (TransformerEngine uses 4).
NUM_STREAMS = 4
# At most this many (each holds a cuBLASLt workspace, 32 MiB on Hopper).
MAX_SIDE_STREAMS = 32
_side_streams = NUM_STREAMS
# what set_side_streams and set_host_threads take
_COUNTS, _COUNTS_EXPECTED = range(1, MAX_SIDE_STREAMS + 1), f"an int in [1, {MAX_SIDE_STREAMS}]"


def side_streams() -> int:
    """How many side streams the per-expert loop spreads its ``cublasLtMatmul`` calls over."""
    return _side_streams


def set_side_streams(n: int) -> int:
    """Set :func:`side_streams` (1..``MAX_SIDE_STREAMS``) for the calls that follow in this
    process; returns the previous value. Small per-expert GEMMs fill few SMs each, so more of
    them at once can fill the GPU; every stream added costs a workspace and two event calls
    per GEMM call. Streams are made on first use (not during a CUDA graph capture: run a call
    with the new count once before capturing). A tuning knob: the results are the same bits."""
    global _side_streams
    old, _side_streams = _side_streams, _launch.setting(n, _COUNTS, _COUNTS_EXPECTED)
    return old


# Host threads issuing the loop's cuBLASLt calls (1: the caller's thread alone; see
# :mod:`._host_threads`), each with at least this many calls: handing a batch to a worker and
# waiting for it costs tens of us (measured on a 2-vCPU CI machine), which a few calls' worth of
# cuBLAS host work (~8 us each on an H200) does not repay.
_host_threads = 1
MIN_CALLS_PER_THREAD = 8


def host_threads() -> int:
    """How many host threads issue the per-expert loop's ``cublasLtMatmul`` calls."""
    return _host_threads


def set_host_threads(n: int) -> int:
    """Set :func:`host_threads` (1..``MAX_SIDE_STREAMS``) for the calls that follow in this
    process; returns the previous value. With ``n > 1`` the calls of each side stream are issued
    by one of up to ``min(n, side_streams(), calls // MIN_CALLS_PER_THREAD)`` threads (the
    caller's among them; a number that divides the side streams, each thread issuing whole
    streams): cuBLAS's own host work per call (~8 us on an H200) runs beside the other
    threads' (ctypes releases the GIL in the call), so the loop's host time per expert can fall
    towards its Python part. Not during a CUDA graph capture (the caller's thread issues
    everything then). A tuning knob: the same calls on the same streams in the same order per
    stream, the same bits."""
    global _host_threads
    old, _host_threads = _host_threads, _launch.setting(n, _COUNTS, _COUNTS_EXPECTED)
    return old


# ---------------------------------------------------------------------------------------------
# The launch (CUDA only).
#
# Host cost per expert is what limits small-expert MoE layers, so the loop does as little as it
# can: the plan is vectorized (NumPy, in :mod:`._gemm_plan`); each distinct per-expert shape (its
# layouts, pointer alignments and bias alignment) maps to a cached template holding its three
# layouts and its heuristic result; every expert slot owns a matmul descriptor whose scale/bias
# pointers are set only when they change; events, workspaces and the ctypes scalars are made once
# per device. What is left per expert is a list lookup, a dict lookup and the ``cublasLtMatmul``
# call.
# ``_DeviceState`` takes the device calls as arguments, so the CPU benchmark
# (:func:`cugrouped.bench.gemm.bench_host_loop`) runs this very loop with fakes for them.

HEURISTIC_CACHE_SIZE = 1 << 14


class _DeviceState:
    """Per device: the cuBLASLt handle, side streams with a workspace each, reusable events, the
    shape templates, and the device calls (``heuristic``, ``matmul``, ``memset``, ``memcpy2d``,
    ``scale_scratch``, stream/event functions), injectable so that the host loop can be timed
    without a GPU."""

    def __init__(self, device: int, compute_capability: int, handle, streams, workspace_ptrs,
                 current_stream, make_event, heuristic, matmul, memset, memcpy2d, scale_scratch,
                 make_side_stream=None, bind_thread=None, is_capturing=None):
        self.device = device
        self.compute_capability = int(compute_capability)
        self.workspace_bytes = workspace_bytes_for(self.compute_capability)
        self.handle = handle                      # ctypes.c_void_p (or an object ctypes accepts)
        self.streams = list(streams)              # objects with .ptr and .wait_event(event)
        self.stream_ptrs = [s.ptr for s in self.streams]
        self.ws_ptrs = list(workspace_ptrs)       # one workspace per side stream
        self.current_stream = current_stream
        self.fork_event = make_event()
        self.done_events = [make_event() for _ in self.streams]
        self.make_event = make_event
        self.caller_ws: dict[int, int] = {}
        self.heuristic = heuristic
        self.matmul = matmul
        self.memset = memset
        # (dst, dpitch, src, spitch, width, height, stream): a device-to-device cudaMemcpy2DAsync
        self.memcpy2d = memcpy2d
        # nbytes -> a 16-byte aligned device buffer of the current stream, kept for reuse
        self.scale_scratch = scale_scratch
        # () -> (stream, workspace pointer): one more side stream (ensure_streams), or None
        self.make_side_stream = make_side_stream
        self.templates: dict[Any, dict] = {}
        self.alpha = ctypes.c_float(1.0)
        self.betas = {0.0: ctypes.c_float(0.0), 1.0: ctypes.c_float(1.0)}
        self.grouped = None                       # grouped-GEMM state, made on first use
        # () -> None, run once by each host thread that issues calls (cudaSetDevice)
        self.bind_thread = bind_thread
        # stream pointer -> whether it is being captured into a CUDA graph
        self.is_capturing = is_capturing or (lambda stream: False)
        self._issuers = None                      # HostThreads, made on first use
        self.cublas_version = 0                   # 0: the grouped GEMM is never chosen
        self.has_grouped_symbol = False

    @classmethod
    def for_device(cls, device: int) -> "_DeviceState":
        import cupy

        from ..cublaslt import Handle, lib

        _launch.refuse_capture(cupy.cuda.get_current_stream().ptr, "grouped GEMM device state")
        cc = int(cupy.cuda.Device(device).compute_capability)
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(NUM_STREAMS)]
        nbytes = workspace_bytes_for(cc)
        keep = [cupy.empty(nbytes, dtype=np.uint8) for _ in streams]
        handle = Handle()

        def side_stream():
            _launch.refuse_capture(cupy.cuda.get_current_stream().ptr, "grouped GEMM side stream")
            ws = cupy.empty(nbytes, dtype=np.uint8)
            st._keep = st._keep + (ws,)
            return cupy.cuda.Stream(non_blocking=True), ws.data.ptr

        st = cls(device, cc, handle.handle, streams, [w.data.ptr for w in keep],
                 cupy.cuda.get_current_stream, lambda: cupy.cuda.Event(disable_timing=True),
                 _real_heuristic(handle), lib().cublasLtMatmul,
                 lambda ptr, nb, stream: cupy.cuda.runtime.memsetAsync(ptr, 0, nb, stream),
                 _memcpy2d, lambda nb: _launch.device_scratch("gemm scales", nb).data.ptr,
                 side_stream, lambda: cupy.cuda.runtime.setDevice(device),
                 lambda stream: bool(cupy.cuda.runtime.streamIsCapturing(stream)))
        st._keep = (handle, keep)  # owners of the handle and workspaces
        from ..cublaslt import has_grouped_gemm, version

        st.cublas_version, st.has_grouped_symbol = version(), has_grouped_gemm()
        return st

    def ensure_streams(self, n: int) -> None:
        """At least ``n`` side streams, each with a workspace and a join event."""
        while len(self.streams) < n:
            if self.make_side_stream is None:
                raise RuntimeError(f"device {self.device}: {n} side streams asked for, "
                                   f"{len(self.streams)} made and no way to make more")
            stream, ws = self.make_side_stream()
            event = self.make_event()
            # appended together once all exist: the lists stay in step if a maker raises
            self.streams.append(stream)
            self.stream_ptrs.append(stream.ptr)
            self.ws_ptrs.append(ws)
            self.done_events.append(event)

    def issuers(self, n: int):
        """:class:`~._host_threads.HostThreads` of ``n`` issuers (made again for another ``n``:
        a call may use fewer of them)."""
        if self._issuers is None or self._issuers.count != n:
            from ._host_threads import HostThreads

            old, self._issuers = self._issuers, None
            if old is not None:
                old.close()
            self._issuers = HostThreads(n, self.bind_thread)
        return self._issuers

    def caller_workspace(self, stream_ptr: int) -> int:
        """A workspace for a call made on the caller's own stream (a single expert)."""
        ws = self.caller_ws.get(stream_ptr)
        if ws is None:
            import cupy

            _launch.refuse_capture(stream_ptr, "grouped GEMM workspace")
            buf = cupy.empty(self.workspace_bytes, dtype=np.uint8)
            self._keep = self._keep + (buf,)
            ws = self.caller_ws[stream_ptr] = buf.data.ptr
        return ws


def _memcpy2d(dst, dpitch, src, spitch, width, height, stream):
    import cupy

    cupy.cuda.runtime.memcpy2DAsync(dst, dpitch, src, spitch, width, height,
                                    cupy.cuda.runtime.memcpyDeviceToDevice, stream)


def _real_heuristic(handle):
    from ..cublaslt import CublasLtError, HeuristicResult, lib

    get = lib().cublasLtMatmulAlgoGetHeuristic

    def heuristic(desc, la, lb, ld, pref, what: str):
        res, count = HeuristicResult(), ctypes.c_int(0)
        status = get(handle.handle, desc.handle, la.handle, lb.handle, ld.handle, ld.handle,
                     pref.handle, 1, ctypes.byref(res), ctypes.byref(count))
        if status != 0 or count.value == 0:
            raise CublasLtError("cublasLtMatmulAlgoGetHeuristic",
                                status or E.CUBLAS_STATUS_NOT_SUPPORTED, f"no algorithm for {what}")
        return res

    return heuristic


_states: dict[int, _DeviceState] = {}


def _state(device: int) -> _DeviceState:
    st = _states.get(device)
    if st is None:
        st = _states[device] = _DeviceState.for_device(device)
    return st


class _Template:
    """What every expert with one shape signature shares: three layouts and the algorithm."""

    __slots__ = ("layouts", "pref", "result", "la", "lb", "ld", "algo")

    def __init__(self, layouts, pref, result):
        self.layouts, self.pref, self.result = layouts, pref, result  # owners
        self.la, self.lb, self.ld = (lay.handle for lay in layouts)
        self.algo = ctypes.byref(result.algo)


def _template(st: _DeviceState, config, key: tuple, desc) -> _Template:
    """Build the template of one shape signature ``key`` = A layout (4), B layout (4), D layout
    (4), alignments (4), bias alignment: the same descriptors :func:`build_descriptors` makes."""
    layouts = tuple(_D.MatrixLayout(*key[i:i + 4]) for i in (0, 4, 8))
    pref = _D.preference(st.workspace_bytes, *key[12:16])
    what = f"{config} with A{key[0:4]} B{key[4:8]} D{key[8:12]} alignments {key[12:16]}"
    return _Template(layouts, pref, st.heuristic(desc, *layouts, pref, what))


def build_descriptors(config, call: ExpertGemm, workspace_bytes: int):
    """Descriptors for one call with its pointers set, as the launch makes them: the expert slot's
    matmul descriptor (:func:`~cugrouped.cublaslt.descriptors.expert_desc`), the layouts and the
    preference. Returns ``(desc, a_layout, b_layout, d_layout, preference)``. Needs no GPU."""
    desc = _D.expert_desc(config, call.expert)
    desc.set_pointers(call.a_scale_ptr, call.b_scale_ptr, call.bias_ptr)
    la = _D.matrix_layout(*call.a_layout)
    lb = _D.matrix_layout(*call.b_layout)
    ld = _D.matrix_layout(*call.d_layout)
    pref = _D.preference(workspace_bytes, *call.alignments)
    return desc, la, lb, ld, pref


def _zero_outputs(st: _DeviceState, vp: VecPlan, out, caller_ptr: int) -> None:
    if not vp.zero:
        return
    o = as_blocks(out)
    for i in vp.zero:  # empty reduction, not accumulating: dW_i = 0
        rows, cols, ld, ptr, isz = int(o.rows[i]), int(o.cols[i]), int(o.ld[i]), int(o.ptr[i]), o.itemsize
        if ld == cols:
            st.memset(ptr, ((rows - 1) * ld + cols) * isz, caller_ptr)
        else:
            for r in range(rows):
                st.memset(ptr + r * ld * isz, cols * isz, caller_ptr)


def _launch_loop(st: _DeviceState, vp: VecPlan, fp8: bool) -> None:
    """The per-expert ``cublasLtMatmul`` loop over the side streams (forked from and joined back to
    the caller's stream)."""
    ncalls = vp.experts.shape[0]
    if ncalls == 0:
        return
    if fp8 and st.compute_capability < 89:
        raise RuntimeError(f"FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper); device "
                           f"{st.device} is sm_{st.compute_capability}")
    if vp.config.a_scale_mode or vp.config.b_scale_mode:
        reason = block_scaling_unsupported(st.cublas_version, st.compute_capability,
                                           mx=vp.config.a_scale_mode == MX_MODE)
        if reason:
            raise RuntimeError(f"device {st.device}: {reason}")
    caller = st.current_stream()
    config = vp.config
    templates = st.templates.get(config)
    if templates is None or len(templates) > HEURISTIC_CACHE_SIZE:
        templates = st.templates[config] = {}
    recorders = _launch._recorders.get()
    if not vp.misaligned_scales:
        rows = vp.launch_rows
    else:
        # per-tensor scales cuBLASLt would refuse, copied to 16-byte slots on the caller's stream
        # before the fork (the side streams see them; the join orders the next call's copies
        # after this call's GEMMs, so one scratch per stream is enough)
        copies, rows = vp.realigned(st.scale_scratch(vp.scale_scratch_bytes))
        for c in copies:
            for log in recorders:
                log.append(_launch.Launch("cuda", "cudaMemcpy2DAsync[scales]", 1, 1))
            st.memcpy2d(c.dst, SCALE_POINTER_ALIGN, c.src, c.spitch, 4, c.height, caller.ptr)
    descs = _D.expert_descs(config, rows[-1][0] + 1)
    matmul, handle, alpha = st.matmul, st.handle, ctypes.byref(st.alpha)
    beta = ctypes.byref(st.betas[vp.beta])
    wsb = st.workspace_bytes
    if ncalls > 1:
        # Fork exactly the side streams the loop uses, as the join below joins exactly those,
        # and nothing that can raise between the fork and the try: a side stream forked but
        # never joined fails a CUDA graph capture (cudaErrorStreamCaptureUnjoined at its end).
        used = min(_side_streams, ncalls)
        if used > len(st.streams):
            # all of them, not just the ones this call uses: a warm-up call with fewer experts
            # must leave a later captured call nothing to make
            st.ensure_streams(_side_streams)
        streams, ws = st.stream_ptrs[:used], st.ws_ptrs[:used]
        st.fork_event.record(caller)
        for s in st.streams[:used]:
            s.wait_event(st.fork_event)
    else:
        streams, ws = [caller.ptr], [st.caller_workspace(caller.ptr)]
    nstreams = len(streams)
    threads = issuers_for(_host_threads, nstreams, ncalls, MIN_CALLS_PER_THREAD)
    # set_host_threads: the calls gathered per issuing thread (stream s's by thread s % threads,
    # in the loop's order), everything else done here first; None: issued here and now
    batches = ([[] for _ in range(threads)] if threads > 1 and not st.is_capturing(caller.ptr)
               else None)
    try:
        for j, (e, a, b, d, sa, sb, bias, key) in enumerate(rows):
            desc = descs[e]
            ptrs = desc.ptrs
            if ptrs[0] != sa or ptrs[1] != sb or ptrs[2] != bias:
                desc.set_pointers(sa, sb, bias)
            t = templates.get(key)
            if t is None:
                t = templates[key] = _template(st, config, shape_signature(key), desc)
            for log in recorders:
                log.append(_launch.Launch("cuda", "cublasLtMatmul", 1, 1))
            s = j % nstreams
            if batches is not None:
                batches[s % threads].append(
                    (e, (handle, desc.handle, alpha, a, t.la, b, t.lb, beta, d, t.ld, d, t.ld,
                         t.algo, ws[s], wsb, streams[s])))
                continue
            status = matmul(handle, desc.handle, alpha, a, t.la, b, t.lb, beta, d, t.ld, d, t.ld,
                            t.algo, ws[s], wsb, streams[s])
            if status:
                from ..cublaslt import check

                check(status, "cublasLtMatmul", f"expert {e}")
        if batches is not None:
            failure = st.issuers(_host_threads).run(matmul, batches)
            if failure is not None:
                from ..cublaslt import check

                check(failure[1], "cublasLtMatmul", f"expert {failure[0]}")
    finally:
        # Join even when an expert fails (no algorithm, a refused call): the experts already
        # launched on the side streams must be ordered before the caller's next work, or the
        # buffers they read and write could be freed and reused under them.
        if ncalls > 1:
            for idx in range(nstreams):
                ev = st.done_events[idx]
                ev.record(st.streams[idx])
                caller.wait_event(ev)


def _launch_plan(vp: VecPlan, problem: Problem, out, st: _DeviceState, path: str | None = None) -> None:
    if vp.zero:
        _zero_outputs(st, vp, out, st.current_stream().ptr)
    chosen, _, spec = path_for(problem, vp, out, st, path)
    if chosen == "grouped":
        try:
            _launch_grouped(st, vp, problem, spec)
            return
        except GroupedRefused as exc:   # cuBLAS turned it down: the loop computes it
            if path == "grouped":
                raise RuntimeError(f"path='grouped' cannot run: {exc}") from None
            forget_path(vp, st, path, f"cuBLAS refused the grouped call: {exc}")
    _launch_loop(st, vp, problem.fp8)


def launch_checked(call: "Checked", out, xp, st: "_DeviceState", path: str | None = None):
    """The CUDA path after the operand checks: output (checked or new), plan, launch; returns
    the output. ``xp`` allocates a new output; ``st`` holds the device calls (the CPU benchmark
    passes NumPy and fakes)."""
    out, blocks, vp = prepared_out(call, out, xp)
    _launch_plan(vp, call.problem, blocks, st, path)
    return out

