"""Benchmarks of block scaling (TransformerEngine's Float8BlockScaling).

* ``block-cast``: ``multi_block_cast_transpose`` (1-D blocks, both copies, as an activation or a
  gradient is cast for training) against torch eager doing the same work per expert (split,
  per-block amax, power-of-two scale, cast, zero-pad and transpose with the transposed copy's
  own blocks) and ``torch.compile`` of it. The eager peer gives the op's bits (tested on the CPU,
  ``tests/test_bench_block.py``).
* ``block-layer``: ``GroupedLinear`` forward + backward under ``Float8BlockScaling`` against
  ``Float8CurrentScaling``, same layer and inputs.
* ``block-gemm``: the grouped GEMMs on block-scaled operands against the same GEMMs on
  per-tensor FP8 operands, in the same run: what block scaling costs in cuBLASLt. (torch's own
  block-scaled ``scaled_mm`` is not run: its API differs between torch versions.)

Token counts are rounded down to multiples of 16 per expert (block-scaled GEMMs need multiples
of 8; TransformerEngine pads to 16).
"""

from __future__ import annotations

import numpy as np

from ..ops import _cast_inputs
from ..ops import block_cast_transpose as bct
from ..ops import pad_cast_transpose as pct
from .cast import CAST_CONFIGS, QUICK_CAST
from .common import copy_bandwidth_gbs, cpu_loop_us, time_together

__all__ = ["torch_block_peer", "block_splits", "bench_block_cast", "bench_cast_vs_torch",
           "bench_block_gemm", "bench_scaled_gemm", "bench_block_planning", "bench_block_layer"]

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def block_splits(m_splits) -> list[int]:
    """Each expert's tokens rounded down to a multiple of 16."""
    return [m - m % 16 for m in m_splits]


def torch_block_peer(m_splits, fmt: str = "e4m3", align: int = 16):
    """What a torch user writes for 1-D block quantization of every expert, both copies:
    ``fn(x) -> [(q (m, k), scale_inv (ceil(k/128), m), q_t (k, m_pad), scale_inv_t
    (ceil(m_pad/128), k))]`` per expert; power-of-two scales, amax 0 -> scale 1 (k a multiple of
    128 and m_pad of 4 here, so the layouts' rounding to 4 adds nothing)."""
    import torch

    f8 = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    fmax = FP8_MAX[fmt]
    m_pad = pct.padded_splits(m_splits, align)

    def scale_of(amax):
        s = torch.where(amax > 0, fmax / amax, torch.ones_like(amax))
        _, e = torch.frexp(s)                                 # s = f * 2^e, f in [0.5, 1)
        return torch.ldexp(torch.ones_like(s), e - 1)         # a power of two, rounded down

    def fn(x):
        out = []
        k = x.shape[1]
        for xi, mp in zip(torch.split(x, m_splits), m_pad):
            m = xi.shape[0]
            xf = xi.float()
            r = xf.view(m, k // 128, 128)
            s = scale_of(r.abs().amax(-1, keepdim=True))
            q = (r * s).clamp(-fmax, fmax).to(f8).view(m, k)
            mb = -(-mp // 128)
            c = torch.cat([xf, xf.new_zeros((mb * 128 - m, k))]).view(mb, 128, k)
            st = scale_of(c.abs().amax(1, keepdim=True))
            qt = (c * st).clamp(-fmax, fmax).to(f8).view(mb * 128, k)[:mp].t().contiguous()
            out.append((q, (1 / s).view(m, k // 128).t().contiguous(), qt, (1 / st).view(mb, k)))
        return out

    return fn


def bench_block_cast(quick: bool, rows: list[dict]) -> None:
    bench_cast_vs_torch(quick, rows, op="block-cast", scaling="block1d",
                        cast=lambda x, m: bct.multi_block_cast_transpose(x, m),
                        peer=torch_block_peer, sizes=lambda m, k: bct.block_output_sizes(m, k, 16, 1),
                        scale_bytes=4)


def bench_cast_vs_torch(quick: bool, rows: list[dict], *, op: str, scaling: str, cast, peer,
                        sizes, scale_bytes: int) -> None:
    """One scaled cast (``cast(x, m_splits)``) against its torch eager peer (``peer(m_splits)``,
    the same work) and ``torch.compile`` of it, on bf16 inputs rotated past L2; GB/s from the
    bytes moved (``sizes(m_splits, k)``: the op's buffer sizes; ``scale_bytes`` per scale)."""
    try:
        import torch
    except ImportError:
        print(f"torch not installed: the {op} benchmark needs bfloat16 torch inputs; skipped")
        return
    configs = QUICK_CAST if quick else CAST_CONFIGS
    bw = copy_bandwidth_gbs()
    for cfg in configs:
        m_splits = cfg.m_splits()
        T = sum(m_splits)
        copies = max(2, int(np.ceil(256e6 / (T * cfg.k * 2))))          # > L2 in rotation
        xt = [torch.randn((T, cfg.k), device="cuda", dtype=torch.bfloat16) for _ in range(copies)]

        eager = peer(m_splits)
        fns = {"cugrouped": lambda i: cast(xt[i % copies], m_splits),
               "torch-eager": lambda i: eager(xt[i % copies])}
        if not quick:
            compiled = torch.compile(eager, dynamic=False)
            fns["torch-compile"] = lambda i: compiled(xt[i % copies])
        else:
            print(f"{cfg.name:<22} {scaling:<8} torch-compile  skipped in --quick (its compile "
                  f"time is the GPU check's); run without --quick for it")

        def skipped(impl, exc, cfg=cfg):    # torch.compile needs Triton and a C compiler
            if impl == "cugrouped":
                raise exc
            print(f"{cfg.name:<22} {scaling:<8} {impl:<14} skipped: {type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:160] if str(exc) else ''}")

        timed = time_together(fns, 30, skipped=skipped)
        t = timed["cugrouped"]
        ms, hus = t.ms, t.host_us
        sz = sizes(m_splits, cfg.k)
        traffic = (T * cfg.k * 2 + sz.rows * cfg.k + sz.data_t +
                   scale_bytes * (sz.scale_inv + sz.scale_inv_t))
        gbs = traffic / ms / 1e6
        row = dict(op=op, config=cfg.name, scaling=scaling, impl="cugrouped", ms=ms,
                   gbs=gbs, pct_copy_bw=100 * gbs / bw, host_us=hus,
                   host_us_per_expert=hus / cfg.experts, **t.columns())
        rows.append(row)
        print(f"{cfg.name:<22} {scaling:<8} cugrouped      {ms:8.3f} ms {gbs:7.0f} GB/s "
              f"{row['pct_copy_bw']:5.1f}% of copy, host {hus:6.1f} us/call")
        for impl, t in list(timed.items())[1:]:
            pms = t.ms
            rows.append(dict(op=op, config=cfg.name, scaling=scaling, impl=impl,
                             ms=pms, speedup_of_cugrouped=pms / ms, host_us=t.host_us,
                             **t.columns()))
            print(f"{cfg.name:<22} {scaling:<8} {impl:<14} {pms:8.3f} ms   cugrouped is "
                  f"{pms / ms:5.2f}x faster")


def bench_block_gemm(quick: bool, rows: list[dict]) -> None:
    from .. import multi_block_cast_transpose as block_cast

    bench_scaled_gemm(quick, rows, op="block-gemm", impl="cugrouped-fp8-block", multiple=16,
                      cast=lambda a, m, **kw: block_cast(a, m, **kw),
                      weight_cast=lambda w: block_cast(w, align=1, block_scaling_dim=2))


def bench_scaled_gemm(quick: bool, rows: list[dict], *, op: str, impl: str, multiple: int, cast,
                      weight_cast) -> None:
    """The three grouped GEMMs on one kind of scaled operands (``cast(a, m_splits, dtype=)`` for
    activations and gradients, ``weight_cast(w)``) against the same GEMMs on per-tensor FP8
    operands, same data (token counts rounded down to ``multiple`` per expert)."""
    import cupy

    from .. import grouped_dgrad, grouped_fprop, grouped_wgrad
    from .. import multi_pad_cast_transpose as tensor_cast
    from .gemm import GEMM_CONFIGS, QUICK_GEMM

    configs = QUICK_GEMM if quick else GEMM_CONFIGS
    runs = 10 if quick else 30
    for cfg in configs:
        m_splits = [m - m % multiple for m in cfg.m_splits()]
        T, E_ = sum(m_splits), cfg.experts
        rng = cupy.random.default_rng(1)
        x = rng.standard_normal((T, cfg.k), dtype=np.float32).astype(cupy.float16).view(cupy.uint16)
        dy = (rng.standard_normal((T, cfg.n), dtype=np.float32) * 1e-3).astype(cupy.float16) \
            .view(cupy.uint16)
        w = [(rng.standard_normal((cfg.n, cfg.k), dtype=np.float32) * 0.02) for _ in range(E_)]
        ops = {
            impl: (cast(x, m_splits, dtype="float16"), cast(dy, m_splits, dtype="float16"),
                   weight_cast(w)),
            "cugrouped-fp8": (tensor_cast(x, m_splits, dtype="float16", align=multiple),
                              tensor_cast(dy, m_splits, dtype="float16", align=multiple),
                              tensor_cast(w, align=1)),
        }
        y = cupy.empty((T, cfg.n), cupy.uint16)
        dx = cupy.empty((T, cfg.k), cupy.uint16)
        dw = cupy.empty((E_, cfg.n, cfg.k), cupy.float32)
        flops = 2 * T * cfg.k * cfg.n
        for pass_name in ("fprop", "dgrad", "wgrad"):
            times = {}
            fns = {name: {"fprop": lambda i, X=X, W=W: grouped_fprop(X, W, out=y,
                                                                    fast_accum=False),
                          "dgrad": lambda i, DY=DY, W=W: grouped_dgrad(DY, W, out=dx),
                          "wgrad": lambda i, X=X, DY=DY: grouped_wgrad(X, DY, out=dw)}[pass_name]
                   for name, (X, DY, W) in ops.items()}

            # e.g. a cuBLAS or GPU without these scale modes: reported, the other one timed
            def skipped(name, exc, cfg=cfg, pass_name=pass_name):
                print(f"{cfg.name:<24} {pass_name:<5} {name:<20} skipped: "
                      f"{type(exc).__name__}: {str(exc)[:120]}")

            for name, t in time_together(fns, runs, skipped=skipped).items():
                ms, hus = t.ms, t.host_us
                times[name] = ms
                row = dict(op=op, config=cfg.name, pass_name=pass_name, impl=name,
                           ms=ms, tflops=flops / ms / 1e9, host_us=hus,
                           host_us_per_expert=hus / E_, **t.columns())
                if name == "cugrouped-fp8" and impl in times:
                    row["scaled_over_tensor_time"] = times[impl] / ms
                rows.append(row)
                print(f"{cfg.name:<24} {pass_name:<5} {name:<20} {ms:8.3f} ms "
                      f"{row['tflops']:7.1f} TFLOP/s (split accumulation; host {hus:6.1f} us)")


def bench_block_planning(rows: list[dict]) -> None:
    """Host cost per call of the block-scaled cast without a GPU: input checks, output
    allocation (NumPy here), launch planning and the by-value argument blocks (remembered when
    splits and buffers repeat); everything but the launch."""
    for experts in (8, 64, 256):
        m = [1000 + 17 * i for i in range(experts)]
        x = np.empty((sum(m), 128), np.float32)

        def once():
            g = _cast_inputs.normalize_inputs(x, m)
            res = bct._outputs(g, np, "e4m3", 1, 16, True, True, None)
            plans = bct.plan_block_launches(g.m_splits, g.k)
            bct._packed_groups(g, res, plans, 16, 1)

        us = cpu_loop_us(once)
        rows.append(dict(op="block-cast-host", config=f"E{experts}-numpy-tensor", impl="cugrouped",
                         host_us=us, host_us_per_expert=us / experts))
        print(f"block cast host path, {experts:>3} experts, numpy tensor: {us:8.1f} us per call "
              f"({us / experts:.2f} us per expert)")


def bench_block_layer(quick: bool, rows: list[dict]) -> None:
    """``GroupedLinear`` forward + backward (input and weight gradients) under Float8BlockScaling
    against Float8CurrentScaling, on the same bf16 layer and inputs (token counts rounded down to
    16 per expert): what block scaling costs in a training step."""
    try:
        import torch
    except ImportError:
        print("torch not installed: the block-layer benchmark is skipped")
        return
    from ..pytorch import Float8BlockScaling, Float8CurrentScaling, GroupedLinear, fp8_autocast
    from .gemm import GEMM_CONFIGS, QUICK_GEMM

    configs = QUICK_GEMM if quick else GEMM_CONFIGS
    runs = 10 if quick else 30
    for cfg in configs:
        m_splits = block_splits(cfg.m_splits())
        T = sum(m_splits)
        layer = GroupedLinear(cfg.experts, cfg.k, cfg.n, bias=False, params_dtype=torch.bfloat16,
                              device="cuda")
        copies = max(2, int(np.ceil(256e6 / (T * (cfg.k + cfg.n) * 2))))
        xs = [torch.randn(T, cfg.k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for _ in range(copies)]
        dy = torch.randn(T, cfg.n, device="cuda", dtype=torch.bfloat16)
        times = {}

        def step(i, recipe):
            x = xs[i % copies]
            with fp8_autocast(fp8_recipe=recipe):
                y = layer(x, m_splits)
            return torch.autograd.grad(y, [x, *layer.weights()], dy)

        def skipped(impl, exc, cfg=cfg):     # e.g. a cuBLAS without block scale modes
            print(f"{cfg.name:<24} layer {impl:<22} skipped: {type(exc).__name__}: "
                  f"{str(exc)[:120]}")

        block, current = Float8BlockScaling(), Float8CurrentScaling()
        for impl, t in time_together({
                "cugrouped-fp8-block": lambda i: step(i, block),
                "cugrouped-fp8-current": lambda i: step(i, current)}, runs,
                skipped=skipped).items():
            ms = times[impl] = t.ms
            row = dict(op="block-layer", config=cfg.name, impl=impl, ms=ms,
                       tflops=3 * 2 * T * cfg.k * cfg.n / ms / 1e9, host_us=t.host_us,
                       **t.columns())
            if impl == "cugrouped-fp8-current" and "cugrouped-fp8-block" in times:
                row["block_over_current_time"] = times["cugrouped-fp8-block"] / ms
            rows.append(row)
            print(f"{cfg.name:<24} layer {impl:<22} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s "
                  f"(forward + backward)")
