"""Four facts about cuBLASLt's FP8 GEMMs on this GPU, measured (run by scripts/gpu_check.sh after
its stages; seconds):

1. Which per-tensor scale pointer alignments ``cublasLtMatmul`` accepts: a one-expert fprop whose
   A and B scales sit at byte offsets 0, 4, 8, 12, 16, 32 and 64 of a fresh buffer, launched
   with cugrouped's realignment switched off (cugrouped copies scales that are not 16-byte
   aligned, see ``SCALE_POINTER_ALIGN``: this shows whether 16 is the rule).
2. The accumulation error, as max |ours - reference| / sum |a b| over the outputs, of fprop
   (fast accumulation or not), dgrad and wgrad, per-tensor and block-scaled (1x128 by 128x128),
   at k = 128, 1024 and 4096: what the tests' bounds (ACC_EPS, FAST_ACC_EPS, BLOCK_ACC_EPS)
   must cover.

3. Whether cuBLASLt's heuristic picks the fastest algorithm for one expert's FP8 fprop at the
   benchmark's shapes (fine-grained E=64: m=128, k=2048, n=1408, where the per-expert loop runs
   at 0.52x ``torch._scaled_grouped_mm``; DeepSeek-V3's: m=2048, k=7168, n=2048): its first 16
   candidates timed one by one on the caller's stream (CUDA events, 50 calls each, the median
   of 5), with the rank of the fastest and how much faster it is than the heuristic's first.

4. cuBLASLt's grouped GEMM against the per-expert loop, where this cuBLAS has it (13.5+ for FP8
   on Hopper: the image's 13.1 does not; scripts/cublas_parts.py carries a newer one): every pass
   at the benchmark's fine-E64 and DeepSeek-V3 shapes, jagged token counts rounded up to 16 (the
   grouped path's rule, ``GROUPED_DIM_BYTES``) and as they are (the rule lifted for the probe:
   does cuBLAS take, and compute right, any m?): whether cuBLAS accepts it, the largest
   difference from the loop relative to the loop's largest output, and both paths' device time
   and host time per expert, timed together.

Prints one line per measurement; a failure prints its error and the rest goes on.
``python scripts/gpu_probe_gemm.py [NAME ...]`` runs the probes named (functions of this file:
scale_alignment, accumulation_error, algorithm_choice, grouped_gemm), by default all.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def _xp():
    """CuPy, or NumPy for a dry run on the CPU (CUGROUPED_PROBE_DRY=1: every path, host GEMMs)."""
    if os.environ.get("CUGROUPED_PROBE_DRY") == "1":
        np.asnumpy = np.asarray
        return np
    import cupy

    return cupy


def scale_alignment() -> None:
    cupy = _xp()

    import cugrouped
    from cugrouped.ops import _gemm_plan
    from test_grouped_gemm import make_fp8

    X, W, _ = make_fp8([64], 128, 64, seed=1, xp=cupy)
    want = cugrouped.grouped_fprop(X, W)
    real = _gemm_plan.VecPlan.misaligned_scales
    _gemm_plan.VecPlan.misaligned_scales = property(lambda self: False)
    try:
        for off in (0, 4, 8, 12, 16, 32, 64):
            buf = cupy.zeros(64, cupy.float32)
            k = off // 4
            sx, sw = buf[k:k + 1], buf[k + 32:k + 33]
            sx[...] = X.scale_inv
            sw[...] = W.scale_inv
            x2 = dataclasses.replace(X, scale_inv=sx)
            w2 = dataclasses.replace(W, scale_inv=sw)
            try:
                got = cugrouped.grouped_fprop(x2, w2)
                same = bool((got == want).all())
                print(f"probe scale pointer offset {off:2d} bytes: ok (same bits as offset 0: {same})")
            except Exception as exc:  # noqa: BLE001 (a probe reports every outcome)
                print(f"probe scale pointer offset {off:2d} bytes: {type(exc).__name__}: {exc}")
    finally:
        _gemm_plan.VecPlan.misaligned_scales = real


def accumulation_error() -> None:
    cupy = _xp()

    from cugrouped import grouped_dgrad, grouped_fprop, grouped_wgrad
    from test_grouped_gemm import _abs_sum, _host, _to_np, independent, make_fp8

    import _block_common as bc
    from test_grouped_gemm_block import independent as block_independent
    from test_grouped_gemm_block import make_block

    def ratio(got, ref, abs_sum):
        err = np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
        return float(np.max(err / np.maximum(abs_sum, 1e-300)))

    m_splits, n = [256, 128], 256
    for k in (128, 1024, 4096):
        t = time.time()
        X, W, DY = make_fp8(m_splits, k, n, seed=k, xp=cupy)
        hX, hW, hDY = _host(X), _host(W), _host(DY)
        xs, ws, dys = (independent(h, "rowwise") for h in (hX, hW, hDY))
        fp = _abs_sum(xs, ws, "fprop")
        res = {}
        for fast in (True, False):
            y = _to_np(grouped_fprop(X, W, out_dtype="float32", fast_accum=fast), "float32")
            res[f"fprop fast={fast}"] = ratio(y, grouped_fprop(hX, hW, out_dtype="float32"), fp)
        dx = _to_np(grouped_dgrad(DY, W, out_dtype="float32"), "float32")
        res["dgrad"] = ratio(dx, grouped_dgrad(hDY, hW, out_dtype="float32"),
                             _abs_sum(dys, independent(hW, "columnwise"), "dgrad"))
        dw = cupy.asnumpy(grouped_wgrad(X, DY))
        res["wgrad"] = ratio(dw, grouped_wgrad(hX, hDY), _abs_sum(
            independent(hDY, "columnwise"), independent(hX, "columnwise"), "wgrad"))
        print(f"probe per-tensor k={k:4d}: " + ", ".join(f"{a} {b * 2**11:.3f}" for a, b in res.items())
              + f"  (x 2^-11 of sum|ab|; {time.time() - t:.1f} s)")
        t = time.time()
        try:
            X, W, DY = make_block(m_splits, k, n, seed=k, xp=cupy)
            hX, hW, hDY = (bc.host_operand(g) for g in (X, W, DY))
            xs, ws = block_independent(hX, "rowwise"), block_independent(hW, "rowwise")
            dys = block_independent(hDY, "rowwise")
            res = {"fprop": ratio(_to_np(grouped_fprop(X, W, out_dtype="float32"), "float32"),
                                  grouped_fprop(hX, hW, out_dtype="float32"),
                                  _abs_sum(xs, ws, "fprop")),
                   "dgrad": ratio(_to_np(grouped_dgrad(DY, W, out_dtype="float32"), "float32"),
                                  grouped_dgrad(hDY, hW, out_dtype="float32"),
                                  _abs_sum(dys, block_independent(hW, "columnwise"), "dgrad")),
                   "wgrad": ratio(cupy.asnumpy(grouped_wgrad(X, DY)), grouped_wgrad(hX, hDY),
                                  _abs_sum(block_independent(hDY, "columnwise"),
                                           block_independent(hX, "columnwise"), "wgrad"))}
            print(f"probe block     k={k:4d}: "
                  + ", ".join(f"{a} {b * 2**11:.3f}" for a, b in res.items())
                  + f"  (x 2^-11 of sum|ab|; {time.time() - t:.1f} s)")
        except Exception as exc:  # noqa: BLE001
            print(f"probe block     k={k:4d}: {type(exc).__name__}: {exc}")


ALGO_CANDIDATES = 16
ALGO_SHAPES = (("fine-E64 expert", 128, 2048, 1408), ("dsv3 expert", 2048, 7168, 2048))


def algorithm_choice() -> None:
    import ctypes

    cupy = _xp()
    dry = cupy is np
    from cugrouped.cublaslt import HeuristicResult, lib
    from cugrouped.ops import grouped_gemm as gg
    from test_grouped_gemm import make_fp8

    for name, m, k, n in ALGO_SHAPES:
        if dry:
            m, k, n = 16, 32, 16                  # the same path on small host arrays
        X, W, _ = make_fp8([m], k, n, seed=3, xp=cupy)
        p = gg.check_fprop(X, W)
        out, blocks = gg.outputs(p, None, cupy)
        vp = gg.plan_arrays(p, blocks)
        call = vp.calls()[0]
        st = None if dry else gg._state(cupy.cuda.Device().id)
        wsb = gg.workspace_bytes_for(90) if dry else st.workspace_bytes
        desc, la, lb, ld, pref = gg.build_descriptors(vp.config, call, wsb)
        results = (HeuristicResult * ALGO_CANDIDATES)()
        count = ctypes.c_int(0)
        if dry:
            count.value = 3
        else:
            status = lib().cublasLtMatmulAlgoGetHeuristic(
                st.handle, desc.handle, la.handle, lb.handle, ld.handle, ld.handle, pref.handle,
                ALGO_CANDIDATES, results, ctypes.byref(count))
            if status:
                print(f"probe algorithms {name}: cublasLtMatmulAlgoGetHeuristic status {status}")
                continue
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

        def run(r, reps):
            """``reps`` calls with candidate ``r``; cuBLAS's status of the first that fails."""
            if dry:
                return 0
            stream = cupy.cuda.get_current_stream().ptr
            ws = st.caller_workspace(stream)
            for _ in range(reps):
                status = st.matmul(st.handle, desc.handle, ctypes.byref(alpha), call.a_ptr,
                                   la.handle, call.b_ptr, lb.handle, ctypes.byref(beta),
                                   call.d_ptr, ld.handle, call.d_ptr, ld.handle,
                                   ctypes.byref(r.algo), ws, wsb, stream)
                if status:
                    return status
            return 0

        times = []
        for i in range(count.value):
            r = results[i]
            if r.workspaceSize > wsb or run(r, 3):
                times.append(None)
                continue
            if dry:
                times.append(1.0 + i)
                continue
            reps = []
            for _ in range(5):
                t0, t1 = cupy.cuda.Event(), cupy.cuda.Event()
                t0.record()
                run(r, 50)
                t1.record()
                t1.synchronize()
                reps.append(cupy.cuda.get_elapsed_time(t0, t1) * 1e3 / 50)
            times.append(float(np.median(reps)))
        ok = [(t, i) for i, t in enumerate(times) if t is not None]
        if not ok:
            print(f"probe algorithms {name}: none of {count.value} candidates ran")
            continue
        best_t, best = min(ok)
        first = times[0]
        flops = 2.0 * m * k * n
        listing = " ".join("-" if t is None else f"{t:.1f}" for t in times)
        print(f"probe algorithms {name} (m={m} k={k} n={n}): {count.value} candidates, us each: "
              f"{listing}; fastest #{best} {best_t:.2f} us ({flops / best_t / 1e6:.0f} TFLOP/s)"
              + (f", {first / best_t:.2f}x the heuristic's first" if first else
                 ", the heuristic's first refused"))


GROUPED_SHAPES = (("fine-E64", 64, 2048, 1408, 8192), ("dsv3-E8", 8, 7168, 2048, 16384))


def _as_f32(xp, a):
    """An output as float32: bfloat16 bits (uint16) widened, anything else cast."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _grouped_operands(xp, m_splits, k, n):
    """FP8 x, w and dy for ``m_splits`` experts, cast by cugrouped on ``xp``'s device."""
    import cugrouped

    rng = np.random.default_rng(7)
    x = xp.asarray(rng.standard_normal((sum(m_splits), k), dtype=np.float32).astype(np.float16))
    dy = xp.asarray((rng.standard_normal((sum(m_splits), n), dtype=np.float32) * 1e-3)
                    .astype(np.float16))
    w = xp.asarray((rng.standard_normal((len(m_splits), n, k), dtype=np.float32) * 0.02)
                   .astype(np.float16))
    X = cugrouped.multi_pad_cast_transpose(x, m_splits, dtype="float16")
    DY = cugrouped.multi_pad_cast_transpose(dy, m_splits, dtype="float16", fp8_format="e5m2")
    W = cugrouped.multi_pad_cast_transpose(list(w), align=1)
    return X, W, DY


def grouped_gemm() -> None:
    xp = _xp()
    dry = xp is np
    import cugrouped
    from cugrouped.bench.common import moe_splits, time_together
    from cugrouped.ops import _gemm_grouped, grouped_gemm as gg

    if not dry:
        st = gg._state(xp.cuda.Device().id)
        why = _gemm_grouped.grouped_gemm_unsupported(
            st.cublas_version, st.compute_capability, fp8=True, in_dtype="float8_e4m3fn",
            has_symbol=st.has_grouped_symbol)
        if why:
            print(f"probe grouped: not run: {why}")
            return
    rule = _gemm_grouped.GROUPED_DIM_BYTES
    for name, experts, k, n, tokens in GROUPED_SHAPES:
        if dry:
            experts, k, n, tokens = 4, 32, 16, 96     # the same path on small host arrays
        jagged = moe_splits(experts, tokens, True, seed=0)
        rounded = [-(-m // 16) * 16 for m in jagged]
        for label, splits, lifted in (("m rounded to 16", rounded, False), ("jagged m", jagged, True)):
            X, W, DY = _grouped_operands(xp, splits, k, n)
            calls = {"fprop": lambda path: cugrouped.grouped_fprop(X, W, path=path),
                     "dgrad": lambda path: cugrouped.grouped_dgrad(DY, W, path=path),
                     "wgrad": lambda path: cugrouped.grouped_wgrad(X, DY, path=path)}
            for pass_name, call in calls.items():
                head = f"probe grouped {name} {label} {pass_name}"
                _gemm_grouped.GROUPED_DIM_BYTES = 1 if lifted else rule
                gg.clear_memo()
                try:
                    loop = _as_f32(xp, call("loop"))
                    with cugrouped.record_launches() as log:
                        got = _as_f32(xp, call(None if dry else "grouped"))
                    if not dry and "cublasLtMatmul[grouped]" not in [e.kernel for e in log]:
                        print(f"{head}: the grouped call did not run")
                        continue
                    scale = float(xp.abs(loop).max()) or 1.0
                    diff = float(xp.abs(got - loop).max()) / scale
                    nan = bool(xp.isnan(got).any())
                    if dry:
                        print(f"{head}: ran (dry), max |grouped - loop| / max |loop| = {diff:.2e}")
                        continue
                    t = time_together({"loop": lambda i: call("loop"),
                                       "grouped": lambda i: call("grouped")}, 20, host_runs=20)
                    lp, gp = t["loop"], t["grouped"]
                    print(f"{head}: accepted; max |grouped - loop| / max |loop| = {diff:.2e}"
                          f"{' NaN!' if nan else ''}; loop {lp.ms * 1e3:.1f} us (host "
                          f"{lp.host_us / experts:.2f} us/expert), grouped {gp.ms * 1e3:.1f} us "
                          f"(host {gp.host_us / experts:.2f} us/expert): {lp.ms / gp.ms:.2f}x")
                except Exception as exc:  # noqa: BLE001 (cuBLAS refusing is a finding)
                    print(f"{head}: {type(exc).__name__}: {str(exc)[:200]}")
                finally:
                    _gemm_grouped.GROUPED_DIM_BYTES = rule
                    gg.clear_memo()


def main() -> int:
    import cugrouped

    if not cugrouped.gpu_available() and os.environ.get("CUGROUPED_PROBE_DRY") != "1":
        print("probe: no GPU")
        return 2
    probes = (scale_alignment, accumulation_error, algorithm_choice, grouped_gemm)
    names = sys.argv[1:] or [p.__name__ for p in probes]
    unknown = set(names) - {p.__name__ for p in probes}
    if unknown:
        print(f"probe: unknown {sorted(unknown)}; the probes are "
              + " ".join(p.__name__ for p in probes))
        return 2
    for probe in (p for p in probes if p.__name__ in names):
        try:
            probe()
        except Exception as exc:  # noqa: BLE001
            print(f"probe {probe.__name__}: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
