"""Profile what the GPU check only times, in one device call (about 4-5 minutes on an H200):

    python3 scripts/gpu_profile.py OUT_DIR

1. ``ncu`` on the per-tensor cast (bf16 in, both copies, the dsv3-E8-jagged and fine-E64-jagged
   bench shapes; delayed scaling's one launch and current scaling's two): speed of light, memory
   workload, occupancy, warp states, launch statistics -> ``ncu_cast.txt``. ``--clock-control
   none``: the card's clocks are left as they are. Then the cast bench over every config
   (cugrouped alone, no torch peers) -> ``cast_all.txt``.
2. The grouped GEMM loop's host time on this machine's CPU, split: the same operands again (the
   memo hits) or the memo cleared before each call (checks and plan redone, as new token counts
   make them), over 1, 4, 8 or 16 side streams (with the GPU time of each: small per-expert GEMMs
   fill few SMs each), issued by 1, 2, 4 or 8 host threads (``set_host_threads``: cuBLAS's host
   work side by side), against a per-expert ``torch._scaled_mm`` loop (cuBLASLt
   called by torch), the CUDA API calls of a call (CUPTI, as in 3.) and a cProfile of the hot
   path -> ``host_gemm.txt``.
3. The PyTorch layer's host time per training step, the CUDA API calls of a step (torch's
   profiler, CUPTI: every runtime and driver call of the process, CuPy's and cuBLASLt's too),
   the torch calls that synchronize (sync debug mode) and a cProfile -> ``host_layer.txt``, and
   the timeline of 5 steps of the first config -> ``layer_trace.json.gz`` (Chrome trace); then
   scripts/layer_host.py, the same step's host code with every CUDA call stopped (appended).
4. ``compute-sanitizer`` memcheck and racecheck over one small launch of every kernel family
   (casts per-tensor / gathered / SwiGLU / block / MXFP8, column sums, scale update, the GEMM
   loop) -> ``sanitizer.txt``.

Each step has a time limit and reports how it ended; the summary goes to stdout. Nothing here
asserts: the GPU tests do that (scripts/gpu_check.sh); this is for the performance work.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
PY = sys.executable

CAST_SHAPES = ("dsv3-E8-jagged", "fine-E64-jagged")     # the quick bench's cast configs


def _xp():
    """CuPy, or NumPy for a dry run of the cases on the CPU (CUGROUPED_PROBE_DRY=1)."""
    if os.environ.get("CUGROUPED_PROBE_DRY") == "1":
        import numpy as np

        return np
    import cupy

    return cupy


def _sync(xp) -> None:
    if xp.__name__ == "cupy":
        xp.cuda.Device().synchronize()


def case_cast() -> None:
    """The launches ncu profiles (all of them: the first of each is a cold one): per shape and
    variant (one tile per block, two, then half tiles), 3 of delayed scaling (given scales: one
    CAST_AMAX launch each), then 3 of current scaling (an AMAX pass and a CAST launch each):
    54 launches."""
    import numpy as np

    import cugrouped
    from cugrouped.bench.cast import CAST_CONFIGS

    xp = _xp()
    for cfg in (c for c in CAST_CONFIGS if c.name in CAST_SHAPES):
        m = cfg.m_splits()
        if xp is np:
            m = [min(mi, 64) for mi in m]                          # a dry run stays small
        x32 = np.random.default_rng(0).standard_normal((sum(m), cfg.k), dtype=np.float32)
        x = xp.asarray((x32.view(np.uint32) >> 16).astype(np.uint16))          # bfloat16 bits
        del x32
        scale = xp.ones(cfg.experts, np.float32)
        from cugrouped.ops import pad_cast_transpose as pct

        # one tile per block (the default), two, then half tiles
        for tpb, half in ((1, False), (2, False), (1, True)):
            pct.set_tiles_per_block(tpb)
            pct.set_half_tiles(half)
            for _ in range(3):
                cugrouped.multi_pad_cast_transpose(x, m, dtype="bfloat16", scale=scale)
            for _ in range(3):
                cugrouped.multi_pad_cast_transpose(x, m, dtype="bfloat16")
        pct.set_tiles_per_block(1)
        pct.set_half_tiles(False)
        _sync(xp)
        print(f"cast case {cfg.name}: {len(m)} experts, k={cfg.k}, {sum(m)} tokens", flush=True)


def case_sanitize() -> None:
    """One small launch of every kernel family, results synchronized (the sanitizer reports)."""
    import numpy as np

    import cugrouped

    cupy = _xp()
    rng = np.random.default_rng(0)
    m = [37, 0, 64, 5]
    xs = [cupy.asarray(rng.standard_normal((mi, 160)).astype(np.float32)) for mi in m]
    x = cupy.concatenate(xs)
    g = cugrouped.multi_pad_cast_transpose(xs, column_sums=True)
    cugrouped.multi_pad_cast_transpose(x, m, scale=cupy.ones(4, np.float32))
    cugrouped.multi_pad_cast_transpose(x[:, :80], m, activation="swiglu")
    tok = cupy.asarray(rng.standard_normal((50, 160)).astype(np.float32))
    idx = cupy.asarray((np.arange(sum(m)) % 51 - 1).astype(np.int64))
    cugrouped.multi_pad_cast_transpose(tok, m, row_index=idx)
    for dims in (1, 2):
        cugrouped.multi_block_cast_transpose(xs, block_scaling_dim=dims, column_sums=True)
    cugrouped.multi_mxfp8_cast_transpose(xs)
    hist = cupy.zeros((4, 4), np.float32)
    s, si = cupy.ones(4, np.float32), cupy.ones(4, np.float32)
    cugrouped.update_scales(hist, g.amax, s, si)
    w = cugrouped.multi_pad_cast_transpose(
        [cupy.asarray(rng.standard_normal((32, 160)).astype(np.float32)) for _ in m], align=1)
    dy = cugrouped.multi_pad_cast_transpose(
        [cupy.asarray(rng.standard_normal((mi, 32)).astype(np.float32)) for mi in m],
        fp8_format="e5m2")
    cugrouped.grouped_fprop(g, w)
    cugrouped.grouped_dgrad(dy, w)
    cugrouped.grouped_wgrad(g, dy)
    _sync(cupy)
    print("sanitize case: every kernel family launched once", flush=True)


def _guarded(lines: list[str], what: str, fn) -> None:
    """``fn()``'s line(s) appended to ``lines``, or the exception it raised: one diagnostic that
    fails must not cost the others their numbers."""
    try:
        got = fn()
        lines.extend(got if isinstance(got, list) else [got])
    except Exception as exc:  # noqa: BLE001 (a profile reports every outcome)
        lines.append(f"{what}: FAILED {type(exc).__name__}: {exc}")
    print(lines[-1].splitlines()[0] if lines else "", flush=True)


def host_gemm(out: pathlib.Path) -> None:
    """The loop's host and GPU times (every timing first, the profilers after them: a CUPTI
    session must not slow what is timed after it); the file is written whatever fails."""
    import cProfile
    import io
    import pstats

    import cupy
    import numpy as np

    from cugrouped import grouped_fprop
    from cugrouped.bench.common import median_ms, moe_splits
    from cugrouped.ops import _gemm_memo
    from cugrouped.ops import grouped_gemm as gg
    from test_grouped_gemm import make_fp8

    lines: list[str] = []
    kept = []

    def sweep(experts, sets, y):
        got = []
        try:
            for side in (1, 4, 8, 16):
                gg.set_side_streams(side)
                for rotate in (False, True):
                    for i in range(5):
                        grouped_fprop(*sets[i % 2 if rotate else 0], out=y)
                    cupy.cuda.Device().synchronize()
                    times = []
                    for i in range(50):
                        cupy.cuda.Device().synchronize()
                        if rotate:            # every check and plan redone, as with new counts
                            _gemm_memo.clear_memo()
                        t0 = time.perf_counter()
                        grouped_fprop(*sets[i % 2 if rotate else 0], out=y)
                        times.append(time.perf_counter() - t0)
                    us = float(np.median(times)) * 1e6
                    # the GPU time (the stream held by a spin kernel until every call is queued)
                    dev = (f", GPU {median_ms(lambda i: grouped_fprop(*sets[0], out=y), 30):.3f}"
                           " ms" if not rotate else "")
                    got.append(f"grouped_fprop E={experts:3d} {side:2d} side stream(s) (at most "
                               f"{min(side, experts)} used), "
                               f"{'memo cleared    ' if rotate else 'same operands   '}: "
                               f"{us:7.1f} us per call, {us / experts:5.2f} us per expert{dev}")
        finally:
            gg.set_side_streams(gg.NUM_STREAMS)
            lines.extend(got)
        return []

    def thread_sweep(experts, sets, y):
        """The same operands, the loop's calls issued by up to 1, 2, 4 and 8 host threads
        (set_host_threads; a call uses a divisor of its side streams, with at least
        MIN_CALLS_PER_THREAD calls each: at E=8, one) over 4 and 8 side streams: host time per
        call and GPU time."""
        got = []
        old = (gg.side_streams(), gg.host_threads())
        try:
            for side in (4, 8):
                gg.set_side_streams(side)
                for threads in (1, 2, 4, 8):
                    if threads > side:
                        continue
                    gg.set_host_threads(threads)
                    for _ in range(5):
                        grouped_fprop(*sets[0], out=y)
                    cupy.cuda.Device().synchronize()
                    times = []
                    for _ in range(50):
                        cupy.cuda.Device().synchronize()
                        t0 = time.perf_counter()
                        grouped_fprop(*sets[0], out=y)
                        times.append(time.perf_counter() - t0)
                    us = float(np.median(times)) * 1e6
                    dev = median_ms(lambda i: grouped_fprop(*sets[0], out=y), 30)
                    got.append(f"grouped_fprop E={experts:3d} {side:2d} side streams, up to "
                               f"{threads} host thread(s): {us:7.1f} us per call, "
                               f"{us / experts:5.2f} us per expert, GPU {dev:.3f} ms")
        finally:
            gg.set_side_streams(old[0])
            gg.set_host_threads(old[1])
            lines.extend(got)
        return []

    try:
        for experts, k, n in ((8, 7168, 2048), (64, 2048, 1408)):
            m = moe_splits(experts, 256 * experts, True, 1)
            sets = [make_fp8(m, k, n, seed=s, xp=cupy)[:2] for s in range(2)]
            y = cupy.empty((sum(m), n), cupy.uint16)
            _guarded(lines, f"side-stream sweep E={experts}", lambda: sweep(experts, sets, y))
            _guarded(lines, f"host-thread sweep E={experts}",
                     lambda: thread_sweep(experts, sets, y))
            _guarded(lines, f"new counts E={experts}",
                     lambda: _new_counts_every_call(experts, k, n, sets[0][1], moe_splits))
            _guarded(lines, f"torch._scaled_mm loop E={experts}",
                     lambda: _scaled_mm_loop_host(m, k, n))
            kept.append((experts, sets, y))
        for experts, sets, y in kept:
            _guarded(lines, f"API trace E={experts}", lambda: _api_trace(
                f"grouped_fprop E={experts}", lambda i: grouped_fprop(*sets[0], out=y),
                sync_debug=False))
            prof = cProfile.Profile()
            prof.enable()
            for i in range(100):
                grouped_fprop(*sets[0], out=y)
            prof.disable()
            cupy.cuda.Device().synchronize()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
            lines.append(f"cProfile, E={experts}, same operands, 100 calls:\n{buf.getvalue()}")
    finally:
        (out / "host_gemm.txt").write_text("\n".join(lines))
        print("\n".join(ln for ln in lines if ln.startswith(("grouped_fprop", "torch._scaled_mm"))))


def _new_counts_every_call(experts: int, k: int, n: int, W, moe_splits) -> str:
    """grouped_fprop's host time when every call brings new token counts, as a router does each
    step: the memo misses, and each expert whose count is new to the process needs its layouts
    and a cublasLtMatmulAlgoGetHeuristic call (how many: the templates the calls added). ``W``:
    the experts' weights, cast."""
    import cupy
    import numpy as np

    import cugrouped
    from cugrouped import grouped_fprop
    from cugrouped.ops import grouped_gemm as gg

    tokens = 256 * experts
    x = (cupy.random.standard_normal((tokens, k), dtype=np.float32) * 0.1).astype(cupy.float16)
    calls = []
    for i in range(20):
        m = moe_splits(experts, tokens, True, 1000 + i)
        X = cugrouped.multi_pad_cast_transpose(x.view(cupy.uint16), m, dtype="float16",
                                               columnwise=False)
        calls.append((X, W, cupy.empty((tokens, n), cupy.uint16)))
    st = gg._state(cupy.cuda.Device().id)
    before = sum(len(t) for t in st.templates.values())
    times = []
    for X, W, y in calls:
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        grouped_fprop(X, W, out=y)
        times.append(time.perf_counter() - t0)
    cupy.cuda.Device().synchronize()
    added = sum(len(t) for t in st.templates.values()) - before
    us = float(np.median(times)) * 1e6
    return (f"grouped_fprop E={experts:3d} new counts every call: {us:7.1f} us per call "
            f"(median of 20), {us / experts:5.2f} us per expert; {added} shapes new to the "
            f"template cache (a heuristic call each), {added / 20:.1f} per call")


def _scaled_mm_loop_host(m, k: int, n: int) -> str:
    """The host time of the peer a user would write, a per-expert ``torch._scaled_mm`` loop on
    the same shapes (counts rounded up to 16, as it needs): what cuBLASLt's own call costs the
    host when torch makes it, to set against grouped_fprop's per expert."""
    import numpy as np
    import torch

    dev = torch.device("cuda")
    m16 = [max(16, -(-mi // 16) * 16) for mi in m]
    xs = [torch.randn(mi, k, device=dev).to(torch.float8_e4m3fn) for mi in m16]
    ws = [torch.randn(n, k, device=dev).to(torch.float8_e4m3fn) for _ in m16]
    one = torch.ones((), device=dev)

    def loop():
        return [torch._scaled_mm(x, w.t(), one, one, out_dtype=torch.bfloat16)
                for x, w in zip(xs, ws)]

    for _ in range(5):
        loop()
    times = []
    for _ in range(30):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loop()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    us = float(np.median(times)) * 1e6
    return (f"torch._scaled_mm loop E={len(m):3d} (one stream): {us:7.1f} us per call, "
            f"{us / len(m):5.2f} us per expert")


def host_layer(out: pathlib.Path) -> None:
    """The layer's host time per training step (forward, then input and weight gradients), the
    GPU idle at each start, for the quick bench's two configs; then (after every timing) the
    FP8 step's CUDA API calls and a cProfile of 10 steps each: on the first H200 run the FP8
    layer's step cost the host 2.9 ms (E=8) and 8.1 ms (E=64) against 1.5 and 1.1 ms on the GPU,
    far more than its ops' own host benches add up to. The file is written whatever fails."""
    import cProfile
    import io
    import pstats

    import numpy as np
    import torch

    from cugrouped.bench.gemm import QUICK_GEMM
    from cugrouped.bench.layer import layer_steps

    lines: list[str] = []

    def steps(cfg, names):
        _, impls = layer_steps(cfg, "cuda", torch.bfloat16, copies=2)
        return [(impl, step) for impl, _, _, step in impls if impl in names]

    try:
        for cfg in QUICK_GEMM:
            for impl, step in steps(cfg, ("cugrouped-fp8-delayed-tensor", "cugrouped-bf16-tensor",
                                          "torch-linear-loop-bf16")):
                for i in range(3):
                    step(i)
                times = []
                for i in range(10):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    step(i)
                    times.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
                lines.append(f"layer step {cfg.name} {impl}: host {np.median(times) * 1e3:.2f} ms")
                print(lines[-1], flush=True)
            torch.cuda.empty_cache()
        for cfg in QUICK_GEMM:
            [(_, step)] = steps(cfg, ("cugrouped-fp8-delayed-tensor",))
            for i in range(3):
                step(i)
            first = cfg is QUICK_GEMM[0]
            _guarded(lines, f"API trace {cfg.name}", lambda: _api_trace(
                cfg.name, step, out / "layer_trace.json.gz" if first else None))
            prof = cProfile.Profile()
            prof.enable()
            for i in range(10):
                step(i)
            prof.disable()
            torch.cuda.synchronize()
            for key in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(30)
                lines.append(f"cProfile {cfg.name}, 10 steps, by {key}:\n{buf.getvalue()}")
            torch.cuda.empty_cache()
    finally:
        (out / "host_layer.txt").write_text("\n".join(lines))


def _api_trace(name: str, step, trace: pathlib.Path | None = None,
               sync_debug: bool = True) -> list[str]:
    """What one layer step asks of CUDA, by call: torch's profiler with CUPTI records every CUDA
    runtime and driver API call of the process (CuPy's launches and cuBLASLt's included), so a
    call that waits for the GPU (a synchronize, a blocking copy or free) shows up with its time,
    and the counts show how many launches, event records and stream waits a step makes. Then
    one step under torch's sync debug mode (``sync_debug``), which warns on the torch calls
    that synchronize.
    ``trace``: also the timeline of the 5 steps there (Chrome trace JSON, gzipped; chrome://tracing
    or ui.perfetto.dev read it): where the host waits, and on what."""
    import warnings

    import torch
    from torch.profiler import ProfilerActivity, profile

    lines = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(5):
            step(i)
        torch.cuda.synchronize()
    if trace is not None:
        prof.export_chrome_trace(str(trace))          # (gzipped: the name ends in .gz)
    averages = prof.key_averages()
    for keys in (("self_cpu_time_total",), ("self_device_time_total", "self_cuda_time_total")):
        for key in keys:       # (torch renamed "cuda" columns "device")
            try:
                table = averages.table(sort_by=key, row_limit=40, max_name_column_width=70)
                break
            except Exception as exc:  # noqa: BLE001 (the next name, or the reason in the file)
                table = f"({type(exc).__name__}: {exc})"
        lines.append(f"torch.profiler (CUPTI) {name}, 5 steps, by {key}:\n{table}")
    if not sync_debug:
        return lines
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = [f"  {w.filename}:{w.lineno}: {str(w.message)[:160]}" for w in caught
             if "synchroniz" in str(w.message)]
    lines.append(f"sync debug mode {name}, 1 step: {len(syncs)} synchronizing torch call(s)"
                 + "".join(f"\n{s}" for s in syncs))
    print(lines[-1], flush=True)
    return lines


def _run(cmd, limit: int, log: pathlib.Path, env=None) -> str:
    t0 = time.time()
    with open(log, "ab") as f:
        f.write(f"\n$ {' '.join(cmd)}\n".encode())
        f.flush()
        # a session of its own, so that a stop ends the profiled program too (not the tool alone)
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            how = f"rc={proc.wait(timeout=limit)}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            how = f"STOPPED at its {limit} s limit"
    return f"{how} in {time.time() - t0:.0f} s"


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for base in ("/usr/local/cuda/bin", "/opt/nvidia/nsight-compute"):
        for path in sorted(pathlib.Path(base).glob(f"**/{name}")) if os.path.isdir(base) else ():
            if os.access(path, os.X_OK) and path.is_file():
                return str(path)
    return None


def main(out: pathlib.Path) -> int:
    """The steps in order of value, each cut to the time left of CUGROUPED_PROFILE_DEADLINE_S
    (default 300 s) and skipped with under 20 s left."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    deadline = float(os.environ.get("CUGROUPED_PROFILE_DEADLINE_S", "300"))
    me = [PY, str(pathlib.Path(__file__).resolve())]
    ncu, san = _tool("ncu"), _tool("compute-sanitizer")
    print(f"profile: ncu {ncu}; compute-sanitizer {san}", flush=True)

    def left() -> float:
        return deadline - (time.time() - t0)

    def step(name, cmd, limit, log):
        if left() < 20:
            print(f"profile: {name}: SKIPPED ({time.time() - t0:.0f} s spent)", flush=True)
            return
        print(f"profile: {name}: {_run(cmd, int(min(limit, left())), log)}", flush=True)

    def in_process(fn):
        if left() < 40:
            print(f"profile: {fn.__name__}: SKIPPED ({time.time() - t0:.0f} s spent)", flush=True)
            return
        try:
            fn(out)
        except Exception as exc:  # noqa: BLE001 (a profile reports every outcome)
            print(f"profile: {fn.__name__} {type(exc).__name__}: {exc}", flush=True)

    # every kernel compiled first, in parallel, into the disk cache the later processes read
    step("kernel warm-up", [PY, "-c", (
        "import sys; sys.path.insert(0, %r); import cugrouped, time; t = time.time(); "
        "print('compiled', cugrouped._jit.warmup(parallel=True), f'in {time.time() - t:.1f} s')"
        % str(ROOT))], 120, out / "sanitizer.txt")
    in_process(host_layer)
    # the same layer's host code with every CUDA call stopped (as on a CPU machine): what the
    # step costs the host before CUDA and cuBLAS add theirs; appended to host_layer.txt
    step("layer host path, CUDA calls stopped", [PY, str(ROOT / "scripts" / "layer_host.py")],
         60, out / "host_layer.txt")
    in_process(host_gemm)
    if ncu:
        cmd = [ncu, "--clock-control", "none", "--target-processes", "all",
               "-k", "regex:pad_cast_transpose", "--launch-count", "54"]
        for section in ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "WarpStateStats",
                        "LaunchStats", "SchedulerStats"):
            cmd += ["--section", section]
        step("ncu on the casts", cmd + me + ["cast-case"], 160, out / "ncu_cast.txt")
    step("cast bench, every config, cugrouped alone", [PY, "-c", (
        "import sys; sys.path.insert(0, %r); from cugrouped.bench.cast import bench_cast; "
        "bench_cast(False, [], impls=('cugrouped',))" % str(ROOT))], 60, out / "cast_all.txt")
    if san:
        for tool in ("memcheck", "racecheck"):
            step(tool, [san, "--tool", tool, "--error-exitcode", "9", "--print-limit", "20"]
                 + me + ["sanitize-case"], 90, out / "sanitizer.txt")
    if (out / "cast_all.txt").exists():
        print("== cast_all.txt")
        print((out / "cast_all.txt").read_text(errors="replace")[-3000:])
    for name in ("ncu_cast.txt", "sanitizer.txt"):
        path = out / name
        if path.exists():
            keep = ("Duration", "Memory Throughput", "DRAM Throughput", "Achieved Occupancy",
                    "ERROR SUMMARY", "RACECHECK SUMMARY", "pad_cast_transpose_kernel<")
            print(f"== {name} (selected lines)")
            for line in path.read_text(errors="replace").splitlines():
                if any(k in line for k in keep):
                    print(line.rstrip()[:120])
    print(f"profile: done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    arg = sys.argv[1] if len(sys.argv) > 1 else ""
    if arg == "cast-case":
        case_cast()
    elif arg == "sanitize-case":
        case_sanitize()
    elif arg:
        sys.exit(main(pathlib.Path(arg)))
    else:
        sys.exit("usage: scripts/gpu_profile.py OUT_DIR")
