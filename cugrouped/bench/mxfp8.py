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

from ..grouped_block_fp8 import MX_DIMS
from ..ops import block_cast_transpose as bct
from ..ops import mxfp8_cast_transpose as mxc
from ..ops import pad_cast_transpose as pct
from .block import bench_cast_vs_torch, bench_scaled_gemm

__all__ = ["torch_mx_peer", "bench_mx_cast", "bench_mx_gemm"]

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def torch_mx_peer(m_splits, fmt: str = "e4m3", align: int = 32):
    """What a torch user writes for MXFP8 of every expert, both copies: ``fn(x) -> [(q (m, k),
    scales (flat, swizzled), q_t (k, m_pad), scales_t (flat, swizzled))]`` per expert (k a
    multiple of 128 here). Finite inputs: the peer does not reproduce the GPU's flush of the
    multiplier of a block holding an inf."""
    import torch

    f8 = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    fmax = FP8_MAX[fmt]
    rcp = float(np.float32(1.0 / fmax))      # a float32 value: the product is rounded as ours
    m_pad = pct.padded_splits(m_splits, align)

    def quantize(z):      # (R, C) float32, C % 128 == 0 -> bytes, swizzled E8M0 scales
        R, C = z.shape
        r = z.view(R, C // 32, 32)
        v = r.abs().amax(-1) * rcp
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
    bench_cast_vs_torch(quick, rows, op="mx-cast", scaling="mxfp8",
                        cast=lambda x, m: mxc.multi_mxfp8_cast_transpose(x, m), peer=torch_mx_peer,
                        sizes=lambda m, k: bct.block_output_sizes(m, k, 32, MX_DIMS), scale_bytes=1)


def bench_mx_gemm(quick: bool, rows: list[dict]) -> None:
    """The three grouped GEMMs on MXFP8 operands against per-tensor FP8 ones, same data; sm_100+
    (elsewhere one line says why it was skipped)."""
    import cupy

    from ..cublaslt import version
    from ..ops.grouped_gemm import block_scaling_unsupported

    reason = block_scaling_unsupported(version(), int(cupy.cuda.Device().compute_capability),
                                       mx=True)
    if reason:
        print(f"mx-gemm skipped: {reason}")
        return
    bench_scaled_gemm(quick, rows, op="mx-gemm", impl="cugrouped-fp8-mx", multiple=32,
                      cast=lambda a, m, **kw: mxc.multi_mxfp8_cast_transpose(a, m, **kw),
                      weight_cast=lambda w: mxc.multi_mxfp8_cast_transpose(w, align=1))
