"""Two facts about cuBLASLt's FP8 GEMMs on this GPU, measured (run by scripts/gpu_check.sh after
its stages; seconds):

1. Which per-tensor scale pointer alignments ``cublasLtMatmul`` accepts: a one-expert fprop whose
   A and B scales sit at byte offsets 0, 4, 8, 12, 16, 32 and 64 of a fresh buffer, launched
   with cugrouped's realignment switched off (cugrouped copies scales that are not 16-byte
   aligned, see ``SCALE_POINTER_ALIGN``: this shows whether 16 is the rule).
2. The accumulation error, as max |ours - reference| / sum |a b| over the outputs, of fprop
   (fast accumulation or not), dgrad and wgrad, per-tensor and block-scaled (1x128 by 128x128),
   at k = 128, 1024 and 4096: what the tests' bounds (ACC_EPS, FAST_ACC_EPS, BLOCK_ACC_EPS)
   must cover.

Prints one line per measurement; a failure prints its error and the rest goes on.
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


def main() -> int:
    import cugrouped

    if not cugrouped.gpu_available() and os.environ.get("CUGROUPED_PROBE_DRY") != "1":
        print("probe: no GPU")
        return 2
    for probe in (scale_alignment, accumulation_error):
        try:
            probe()
        except Exception as exc:  # noqa: BLE001
            print(f"probe {probe.__name__}: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
