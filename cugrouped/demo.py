"""``python -m cugrouped demo``: one MoE expert layer's FP8 work on synthetic data.

Routes tokens to experts with jagged counts (one expert gets none), casts the activations (padded,
transposed, amax, current scaling) and the expert weights (``align=1``) to FP8 with the fused
multi-tensor kernel, and runs the forward GEMM of every expert from the FP8 buffers. On a GPU the
kernel runs through CuPy; on a CPU the same CUDA source runs under the emulator and is checked bit
for bit against the NumPy reference. Prints what ran where and how long it took.
"""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np

from . import gpu_available, reference
from .ops import grouped_fprop, multi_pad_cast_transpose


def _splits(tokens: int, experts: int, rng) -> list[int]:
    w = rng.dirichlet(np.full(experts, 0.7))
    w[experts // 2] = 0.0                       # one expert receives no tokens
    m = np.floor(w / w.sum() * tokens).astype(int)
    m[0] += tokens - m.sum()
    return [int(v) for v in m]


def _fprop_error(y, xs, ws) -> float:
    """Max relative error of the grouped FP8 fprop against the float32 product of the bf16 inputs."""
    worst, row = 0.0, 0
    for x, w in zip(xs, ws):
        m = x.shape[0]
        if m:
            ref = x.astype(np.float32) @ w.astype(np.float32).T
            got = np.asarray(y[row:row + m], dtype=np.float32)
            worst = max(worst, float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30)))
        row += m
    return worst


def run_demo(num_experts: int = 8, k: int | None = None, n: int | None = None,
             tokens: int | None = None, device: str = "auto") -> int:
    use_gpu = gpu_available() if device == "auto" else device == "gpu"
    if device == "gpu" and not gpu_available():
        print("demo: --device gpu asked for, but no CUDA device is visible")
        return 1
    k = k or (2048 if use_gpu else 512)
    n = n or (1024 if use_gpu else 256)
    tokens = tokens or (16384 if use_gpu else 1024)
    rng = np.random.default_rng(0)
    m_splits = _splits(tokens, num_experts, rng)
    xs = [rng.standard_normal((m, k), dtype=np.float32).astype(ml_dtypes.bfloat16) for m in m_splits]
    ws = [(rng.standard_normal((n, k), dtype=np.float32) * k**-0.5).astype(ml_dtypes.bfloat16)
          for _ in m_splits]
    print(f"cugrouped demo: {num_experts} experts, {tokens} tokens routed as {m_splits}, "
          f"k={k}, n={n}, bf16 inputs, FP8 e4m3 with current scaling")
    rows = []
    if use_gpu:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
        x_dev = cupy.asarray(np.concatenate(xs).view(np.uint16))
        w_dev = [cupy.asarray(w.view(np.uint16)) for w in ws]
        t0 = time.perf_counter()
        multi_pad_cast_transpose(x_dev, m_splits, dtype="bfloat16")
        multi_pad_cast_transpose(w_dev, align=1, dtype="bfloat16")
        cupy.cuda.Stream.null.synchronize()
        rows.append((f"GPU {name}", "first call (NVRTC compile or disk cache)", time.perf_counter() - t0))
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(20):
            start.record()
            res_x = multi_pad_cast_transpose(x_dev, m_splits, dtype="bfloat16")
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
        gb = (tokens * k * 2 + tokens * k * 2) / 1e9
        rows.append((f"GPU {name}", f"pad+cast+transpose+amax, activations ({gb / np.median(times):.0f} GB/s)",
                     float(np.median(times))))
        res_w = multi_pad_cast_transpose(w_dev, align=1, dtype="bfloat16")
        t0 = time.perf_counter()
        y = grouped_fprop(res_x, res_w)
        cupy.cuda.Stream.null.synchronize()
        rows.append((f"GPU {name}", "grouped FP8 fprop through cuBLASLt (first call)", time.perf_counter() - t0))
        y = cupy.asnumpy(y).view(ml_dtypes.bfloat16) if y.dtype == np.uint16 else cupy.asnumpy(y)
        host = lambda r: type(r)(**{f: (cupy.asnumpy(v) if isinstance(v, cupy.ndarray) else v)  # noqa: E731
                                    for f, v in vars(r).items()})
        res_x = host(res_x)
        want = reference.multi_pad_cast_transpose(xs)
        same = np.array_equal(res_x.data.view(np.uint8), want.data.view(np.uint8)) and \
            np.array_equal(res_x.data_t, want.data_t)
        rows.append(("CPU NumPy", f"reference check of the GPU cast bits: {'identical' if same else 'DIFFERENT'}", None))
    else:
        t0 = time.perf_counter()
        want_x = reference.multi_pad_cast_transpose(xs)
        want_w = reference.multi_pad_cast_transpose(ws, align=1)
        rows.append(("CPU NumPy", "reference: activations + weights", time.perf_counter() - t0))
        t0 = time.perf_counter()
        res_x = multi_pad_cast_transpose(xs, backend="emulate")
        res_w = multi_pad_cast_transpose(ws, align=1, backend="emulate")
        rows.append(("CPU emulator", "the CUDA kernel (kernels_cu/pad_cast_transpose.cu), incl. g++ build "
                     "on first use", time.perf_counter() - t0))
        same = all(np.array_equal(np.asarray(getattr(a, f)).view(np.uint8), np.asarray(getattr(b, f)).view(np.uint8))
                   for a, b in ((res_x, want_x), (res_w, want_w)) for f in ("data", "data_t", "amax", "scale_inv"))
        rows.append(("CPU", f"emulated kernel vs reference: {'bit-identical' if same else 'DIFFERENT'}", None))
        t0 = time.perf_counter()
        y = grouped_fprop(res_x, res_w, backend="reference")
        rows.append(("CPU NumPy", "grouped FP8 fprop, reference twin of the cuBLASLt path "
                     "(dequantize, float64 matmul)", time.perf_counter() - t0))
    err = _fprop_error(y, xs, ws)
    rows.append(("", f"fprop max relative error vs the unquantized product: {err:.2%} "
                 "(E4M3 keeps 3 mantissa bits: a few %)", None))
    print(f"  {'where':<28} {'what':<90} time")
    for where, what, secs in rows:
        print(f"  {where:<28} {what:<90} {'' if secs is None else f'{secs * 1e3:9.2f} ms'}")
    ok = same and err < 0.1
    print("demo: OK" if ok else "demo: FAILED (see above)")
    return 0 if ok else 1
