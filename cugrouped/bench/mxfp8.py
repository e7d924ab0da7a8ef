"""Benchmarks of MXFP8 (TransformerEngine's MXFP8BlockScaling).

* ``mx-cast``: ``multi_mxfp8_cast_transpose`` (both copies, as an activation or a gradient is
  cast for training) against torch eager doing the same work per expert (split, per-32-element
  amax, E8M0 byte, cast, zero-pad and transpose with the transposed copy's own blocks, and the
  scales swizzled into cuBLASLt's tiled layout, as TransformerEngine's separate swizzle pass
  does) and ``torch.compile`` of it. The eager peer gives the op's bits (tested on the CPU,
  ``tests/test_bench_mxfp8.py``). The cast runs on any GPU.
* ``mx-gemm``: the grouped GEMMs on MXFP8 operands against the same GEMMs on per-tensor FP8
  operands; sm_100+ only (elsewhere the rows say why they were skipped).

Token counts are rounded down to multiples of 32 per expert (MXFP8 GEMMs need whole scale blocks;
TransformerEngine pads to 32).
"""

from __future__ import annotations

import numpy as np

from ..ops import mxfp8_cast_transpose as mxc
from ..ops import block_cast_transpose as bct
from ..ops import pad_cast_transpose as pct
from ..grouped_block_fp8 import MX_DIMS
from .cast import CAST_CONFIGS, QUICK_CAST
from .common import copy_bandwidth_gbs, host_us, median_ms

__all__ = ["torch_mx_peer", "mx_splits", "bench_mx_cast", "bench_mx_gemm"]

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def mx_splits(m_splits) -> list[int]:
    """Each expert's tokens rounded down to a multiple of 32."""
    return [m - m % 32 for m in m_splits]


def torch_mx_peer(m_splits, fmt: str = "e4m3", align: int = 32):
    """What a torch user writes for MXFP8 of every expert, both copies: ``fn(x) -> [(q (m, k),
    scales (flat, swizzled), q_t (k, m_pad), scales_t (flat, swizzled))]`` per expert (k a
    multiple of 128 here). Finite inputs: the peer does not reproduce the GPU's flush of the
    multiplier of a block holding an inf."""
    import torch

    f8 = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    fmax = FP8_MAX[fmt]
    rcp = torch.tensor(1.0 / fmax, dtype=torch.float32)
    m_pad = pct.padded_splits(m_splits, align)

    def quantize(z):      # (R, C) float32, C % 128 == 0 -> bytes, swizzled E8M0 scales
        R, C = z.shape
        r = z.view(R, C // 32, 32)
        v = r.abs().amax(-1) * rcp.to(z.device)
        mant, ex = torch.frexp(v)                                  # v = mant * 2^ex
        e = torch.where(mant == 0.5, ex - 1, ex) + 127             # the power of two rounded up
        e = torch.where(v == 0, torch.zeros_like(e), e.clamp(0, 254))
        s = torch.ldexp(torch.ones_like(v), 127 - e)
        q = (r * s.unsqueeze(-1)).clamp(-fmax, fmax).to(f8).view(R, C)
        Rp = -(-R // 128) * 128
        compact = torch.cat([e.to(torch.uint8), e.new_zeros((Rp - R, C // 32), dtype=torch.uint8)])
        sw = compact.view(Rp // 128, 4, 32, C // 128, 4).permute(0, 3, 2, 1, 4).reshape(-1)
        return q, sw

    def fn(x):
        out = []
        k = x.shape[1]
        for xi, mp in zip(torch.split(x, m_splits), m_pad):
            xf = xi.float()
            q, s = quantize(xf)
            mq = -(-mp // 128) * 128                                 # whole scale tiles
            xt = torch.cat([xf, xf.new_zeros((mq - xf.shape[0], k))]).t().contiguous()
            qt, st = quantize(xt)
            out.append((q, s, qt[:, :mp].contiguous(), st))
        return out

    return fn


def bench_mx_cast(quick: bool, rows: list[dict]) -> None:
    try:
        import torch
    except ImportError:
        print("torch not installed: the mx-cast benchmark needs bfloat16 torch inputs; skipped")
        return
    configs = QUICK_CAST if quick else CAST_CONFIGS
    bw = copy_bandwidth_gbs()
    for cfg in configs:
        m_splits = cfg.m_splits()
        T = sum(m_splits)
        copies = max(2, int(np.ceil(256e6 / (T * cfg.k * 2))))          # > L2 in rotation
        xt = [torch.randn((T, cfg.k), device="cuda", dtype=torch.bfloat16) for _ in range(copies)]

        def ours(i):
            return mxc.multi_mxfp8_cast_transpose(xt[i % copies], m_splits)

        ms = median_ms(ours, 30)
        hus = host_us(ours)
        sz = bct.block_output_sizes(m_splits, cfg.k, 32, MX_DIMS)
        traffic = T * cfg.k * 2 + sz.rows * cfg.k + sz.data_t + sz.scale_inv + sz.scale_inv_t
        gbs = traffic / ms / 1e6
        row = dict(op="mx-cast", config=cfg.name, scaling="mxfp8", impl="cugrouped", ms=ms,
                   gbs=gbs, pct_copy_bw=100 * gbs / bw, host_us=hus,
                   host_us_per_expert=hus / cfg.experts)
        rows.append(row)
        print(f"{cfg.name:<22} mxfp8    cugrouped      {ms:8.3f} ms {gbs:7.0f} GB/s "
              f"{row['pct_copy_bw']:5.1f}% of copy, host {hus:6.1f} us/call")
        eager = torch_mx_peer(m_splits)
        peers = {"torch-eager": eager}
        if not quick:
            peers["torch-compile"] = torch.compile(eager, dynamic=False)
        else:
            print(f"{cfg.name:<22} mxfp8    torch-compile  skipped in --quick (its compile time "
                  f"is the GPU check's); run without --quick for it")
        for impl, fn in peers.items():
            pms = median_ms(lambda i, fn=fn: fn(xt[i % copies]), 30)
            rows.append(dict(op="mx-cast", config=cfg.name, scaling="mxfp8", impl=impl,
                             ms=pms, speedup_of_cugrouped=pms / ms))
            print(f"{cfg.name:<22} mxfp8    {impl:<14} {pms:8.3f} ms   cugrouped is "
                  f"{pms / ms:5.2f}x faster")


def bench_mx_gemm(quick: bool, rows: list[dict]) -> None:
    """The three grouped GEMMs on MXFP8 operands against per-tensor FP8 ones, same data."""
    import cupy

    from .. import grouped_dgrad, grouped_fprop, grouped_wgrad
    from .. import multi_pad_cast_transpose as tensor_cast
    from ..cublaslt import version
    from ..ops.grouped_gemm import block_scaling_unsupported
    from .gemm import GEMM_CONFIGS, QUICK_GEMM

    reason = block_scaling_unsupported(version(), int(cupy.cuda.Device().compute_capability),
                                       mx=True)
    if reason:
        print(f"mx-gemm skipped: {reason}")
        return
    mx_cast = mxc.multi_mxfp8_cast_transpose
    configs = QUICK_GEMM if quick else GEMM_CONFIGS
    runs = 10 if quick else 30
    for cfg in configs:
        m_splits = mx_splits(cfg.m_splits())
        T, E_ = sum(m_splits), cfg.experts
        rng = cupy.random.default_rng(1)
        x = rng.standard_normal((T, cfg.k), dtype=np.float32).astype(cupy.float16).view(cupy.uint16)
        dy = (rng.standard_normal((T, cfg.n), dtype=np.float32) * 1e-3).astype(cupy.float16) \
            .view(cupy.uint16)
        w = [(rng.standard_normal((cfg.n, cfg.k), dtype=np.float32) * 0.02) for _ in range(E_)]
        ops = {
            "cugrouped-fp8-mx": (mx_cast(x, m_splits, dtype="float16"),
                                 mx_cast(dy, m_splits, dtype="float16"), mx_cast(w, align=1)),
            "cugrouped-fp8": (tensor_cast(x, m_splits, dtype="float16", align=32),
                              tensor_cast(dy, m_splits, dtype="float16", align=32),
                              tensor_cast(w, align=1)),
        }
        y = cupy.empty((T, cfg.n), cupy.uint16)
        dx = cupy.empty((T, cfg.k), cupy.uint16)
        dw = cupy.empty((E_, cfg.n, cfg.k), cupy.float32)
        flops = 2 * T * cfg.k * cfg.n
        for pass_name in ("fprop", "dgrad", "wgrad"):
            for impl, (X, DY, W) in ops.items():
                fn = {"fprop": lambda i: grouped_fprop(X, W, out=y, fast_accum=False),
                      "dgrad": lambda i: grouped_dgrad(DY, W, out=dx),
                      "wgrad": lambda i: grouped_wgrad(X, DY, out=dw)}[pass_name]
                try:
                    ms = median_ms(fn, runs)
                except Exception as exc:
                    print(f"{cfg.name:<24} {pass_name:<5} {impl:<18} skipped: "
                          f"{type(exc).__name__}: {str(exc)[:120]}")
                    continue
                rows.append(dict(op="mx-gemm", config=cfg.name, pass_name=pass_name, impl=impl,
                                 ms=ms, tflops=flops / ms / 1e9))
                print(f"{cfg.name:<24} {pass_name:<5} {impl:<18} {ms:8.3f} ms "
                      f"{flops / ms / 1e9:7.1f} TFLOP/s")
