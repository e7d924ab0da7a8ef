"""Benchmark of the grouped GEMMs (fprop, dgrad, wgrad) against the peers a user would pick instead.

Per config and pass, in one process on the same data: cugrouped FP8 (``GroupedFP8`` operands from
``multi_pad_cast_transpose``; wgrad with a float32 dW and, ``cugrouped-fp8-bf16dW``, a bfloat16
one) and 16-bit (float16 lists: CuPy has no bfloat16 arrays; float16 outputs, dW included), a
per-expert ``torch._scaled_mm`` loop, ``torch._scaled_grouped_mm`` (row-wise scales filled from
our per-tensor scales; for dgrad and wgrad an E4M3 copy of dy, as its Hopper kernel takes no
E5M2; wgrad as its 2-D x 2-D form over the non-empty experts), bf16 ``torch._grouped_mm`` and a
bf16 per-expert ``F.linear`` loop. Each row reports ms, TFLOP/s, % of the roofline
``max(flops / peak, bytes / copy bandwidth)`` (the dense peak measured in the same run for the
operand type, FP8 or bf16; the bytes of :func:`gemm_bytes`; the measured copy bandwidth), % of
that dense peak, the output dtype, cugrouped's host us per expert (the Python call, no sync), the
spin lead and a launch-bound flag, and the speed-up of cugrouped FP8 over the peer, against our
row with the same output width; over a 16-bit row that is the GEMMs alone, our cast excluded
(``speedup_note``). Without torch only cugrouped runs. Importing this module needs neither torch
nor a GPU; :func:`bench_host_loop` runs on the CPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .common import (LAUNCH_BOUND, cpu_loop_us, median_ms, moe_splits, roofline_pct,
                     time_together, with_setting)

__all__ = ["GemmBench", "GEMM_CONFIGS", "QUICK_GEMM", "PASSES", "gemm_flops", "gemm_bytes",
           "wgrad_2d2d_groups", "wgrad_2d2d_scales", "check_2d2d_offs", "bench_gemm", "bench_host_loop",
           "host_loop_state"]

PASSES = ("fprop", "dgrad", "wgrad")


@dataclasses.dataclass(frozen=True)
class GemmBench:
    """One experiment: E experts, layer ``k -> n`` (w is ``(n, k)`` per expert), total tokens,
    equal or jagged split (jagged: Dirichlet(0.5) shares, one expert always empty)."""

    name: str
    experts: int
    k: int
    n: int
    tokens: int
    jagged: bool

    def m_splits(self) -> list[int]:
        return moe_splits(self.experts, self.tokens, self.jagged, self.experts * 7919 + self.k + self.n)


def gemm_flops(cfg: GemmBench, pass_name: str) -> int:
    """Useful FLOPs of one pass: ``2 * sum(m_i) * k * n`` for each of fprop, dgrad and wgrad (the
    wgrad padding to 16 tokens is not counted)."""
    if pass_name not in PASSES:
        raise ValueError(f"pass_name: got {pass_name!r}, expected one of {PASSES}")
    return 2 * sum(cfg.m_splits()) * cfg.k * cfg.n


def gemm_bytes(cfg: GemmBench, pass_name: str, fp8: bool, out_bytes: int = 2) -> int:
    """Bytes one pass must move through HBM at least (T = sum m_i, T' = sum of the 16-padded m_i,
    W = E*n*k; operands 1 byte each in FP8, 2 in 16 bits; ``out_bytes`` per output element):
    fprop reads x, W, writes y (T n); dgrad reads dy, W, writes dx (T k); wgrad reads x and dy
    (FP8: their padded transposed copies, T' rows) and writes dW (W)."""
    if pass_name not in PASSES:
        raise ValueError(f"pass_name: got {pass_name!r}, expected one of {PASSES}")
    m = cfg.m_splits()
    T, k, n, W = sum(m), cfg.k, cfg.n, cfg.experts * cfg.n * cfg.k
    a = 1 if fp8 else 2
    if pass_name == "fprop":
        return a * (T * k + W) + out_bytes * T * n
    if pass_name == "dgrad":
        return a * (T * n + W) + out_bytes * T * k
    rows = sum(-(-v // 16) * 16 for v in m) if fp8 else T
    return a * rows * (k + n) + out_bytes * W


def wgrad_2d2d_groups(m_splits, align: int = 16) -> tuple[list[int], list[int]]:
    """The groups of ``torch._scaled_grouped_mm``'s wgrad (2-D x 2-D, the groups along the
    reduction): the experts it runs (the non-empty ones: its FP8 kernel asserts every group's
    size > 0 on the device) and the end offsets of their rows padded to ``align``."""
    live = [e for e, m in enumerate(m_splits) if m]
    return live, [int(v) for v in np.cumsum([-(-m_splits[e] // align) * align for e in live])]


def wgrad_2d2d_scales(scale_dy, scale_x, live, n: int, k: int):
    """The float32 scales of that wgrad from per-expert scales (torch tensors): ``scale_a``
    ``(E' n,)`` and ``scale_b`` ``(E' k,)``, group-major (the kernel reads group g's at
    ``scale_a + g * n`` and ``scale_b + g * k``), for the experts ``live`` (an index tensor)."""
    return (scale_dy[live].repeat_interleave(n).contiguous(),
            scale_x[live].repeat_interleave(k).contiguous())


def check_2d2d_offs(offs, rows: int, align: int = 16) -> str | None:
    """Why ``offs`` must not go to ``torch._scaled_grouped_mm``'s FP8 2-D x 2-D kernel, or None
    when it may: that kernel device-asserts every group's size (``offs[g] - offs[g-1]``) > 0 and
    a multiple of 16 and the last offset within the ``rows`` of the operands, and a device assert
    poisons the CUDA context for the rest of the run, so these are checked on the host first."""
    if not len(offs):
        return "no non-empty group"
    prev = 0
    for g, end in enumerate(offs):
        if end - prev <= 0:
            return f"group {g} has {end - prev} rows (must be > 0)"
        if (end - prev) % align:
            return f"group {g} has {end - prev} rows, not a multiple of {align}"
        prev = end
    if prev != rows:
        return f"the offsets end at {prev}, the operands have {rows} rows"
    if rows >= 2 ** 31:
        return f"{rows} rows overflow the int32 offsets"
    return None


GEMM_CONFIGS = (
    GemmBench("dsv3-E8-equal-16k", 8, 7168, 2048, 16384, False),
    GemmBench("dsv3-E8-jagged-16k", 8, 7168, 2048, 16384, True),
    GemmBench("dsv3-E8-equal-64k", 8, 7168, 2048, 65536, False),
    GemmBench("dsv3-E8-jagged-64k", 8, 7168, 2048, 65536, True),
    GemmBench("qwen-E16-4096to2048", 16, 4096, 2048, 16 * 2560, False),
    GemmBench("qwen-E16-1024to4096", 16, 1024, 4096, 16 * 2560, True),
    GemmBench("mixtral-E8-4096to14336", 8, 4096, 14336, 16384, True),
    GemmBench("mixtral-E8-14336to4096", 8, 14336, 4096, 16384, True),
    GemmBench("fine-E64-2048to1408", 64, 2048, 1408, 8192, True),
)
QUICK_GEMM = (GEMM_CONFIGS[1], GEMM_CONFIGS[8])


def dense_peaks_tflops(size: int = 8192) -> dict[str, float]:
    """Measured dense matmul TFLOP/s on one big square GEMM: ``bf16`` (torch.mm) and ``fp8``
    (torch._scaled_mm, E4M3, fast accumulation), the roofline the rows are compared with."""
    import torch

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    flops = 2 * size ** 3
    peaks = {"bf16": flops / median_ms(lambda i: torch.mm(a, b), 20) / 1e9}
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device="cuda")
        peaks["fp8"] = flops / median_ms(lambda i: torch._scaled_mm(
            a8, b8, one, one, out_dtype=torch.bfloat16, use_fast_accum=True), 20) / 1e9
    except (RuntimeError, AttributeError) as exc:
        print(f"fp8 peak not measured ({type(exc).__name__}: {exc}); using the bf16 peak x 2")
        peaks["fp8"] = 2 * peaks["bf16"]
    return peaks


def _cugrouped_calls(cfg: GemmBench, m_splits, copies: int):
    """cugrouped's FP8 and float16 calls per pass, over ``copies`` rotated operand sets. FP8
    wgrad twice: ``wgrad`` writes a float32 dW (its default), ``wgrad-bf16`` a bfloat16 one (as
    the bf16-output peers do); float16 wgrad writes a float16 dW (as the 16-bit peers do)."""
    import cupy

    from .. import grouped_dgrad, grouped_fprop, grouped_wgrad, multi_pad_cast_transpose

    rng = cupy.random.default_rng(0)
    sets = []
    for _ in range(copies):
        x = rng.standard_normal((sum(m_splits), cfg.k), dtype=np.float32).astype(cupy.float16)
        dy = (rng.standard_normal((sum(m_splits), cfg.n), dtype=np.float32) * 1e-3).astype(cupy.float16)
        w = (rng.standard_normal((cfg.experts, cfg.n, cfg.k), dtype=np.float32) * 0.02).astype(cupy.float16)
        X = multi_pad_cast_transpose(x, m_splits, dtype="float16")
        DY = multi_pad_cast_transpose(dy, m_splits, dtype="float16", fp8_format="e5m2")
        W = multi_pad_cast_transpose(list(w), fp8_format="e4m3", align=1)
        off = np.concatenate([[0], np.cumsum(m_splits)])
        xs = [x[off[i]:off[i + 1]] for i in range(cfg.experts)]
        dys = [dy[off[i]:off[i + 1]] for i in range(cfg.experts)]
        sets.append(dict(X=X, DY=DY, W=W, x=x, dy=dy, w=w, xs=xs, dys=dys))
    y = cupy.empty((sum(m_splits), cfg.n), cupy.uint16)
    dx = cupy.empty((sum(m_splits), cfg.k), cupy.uint16)
    dw = cupy.empty((cfg.experts, cfg.n, cfg.k), cupy.float32)
    y16 = cupy.empty((sum(m_splits), cfg.n), cupy.float16)
    dx16 = cupy.empty((sum(m_splits), cfg.k), cupy.float16)
    dw_bf = cupy.empty((cfg.experts, cfg.n, cfg.k), cupy.uint16)        # bfloat16 bits
    dw16 = cupy.empty((cfg.experts, cfg.n, cfg.k), cupy.float16)
    c = lambda i: sets[i % copies]  # noqa: E731
    fp8 = {"fprop": lambda i: grouped_fprop(c(i)["X"], c(i)["W"], out=y),
           "dgrad": lambda i: grouped_dgrad(c(i)["DY"], c(i)["W"], out=dx),
           "wgrad": lambda i: grouped_wgrad(c(i)["X"], c(i)["DY"], out=dw),
           "wgrad-bf16": lambda i: grouped_wgrad(c(i)["X"], c(i)["DY"], out=dw_bf,
                                                 out_dtype="bfloat16")}
    f16 = {"fprop": lambda i: grouped_fprop(c(i)["xs"], c(i)["w"], out=y16, out_dtype="float16"),
           "dgrad": lambda i: grouped_dgrad(c(i)["dys"], c(i)["w"], out=dx16, out_dtype="float16"),
           "wgrad": lambda i: grouped_wgrad(c(i)["xs"], c(i)["dys"], out=dw16, out_dtype="float16")}
    return sets, fp8, f16


def _torch_peers(cfg: GemmBench, m_splits, sets, device: str = "cuda"):
    """Peer calls per pass: name -> {pass: fn(i)}; a peer that cannot run a pass is left out and
    its reason printed. FP8 peers use our FP8 bytes and scales; their token blocks are padded to
    16 (torch's FP8 GEMMs need it), bf16 peers use unpadded bf16 copies. Every operand, copy and
    scale vector is made here, before the timing. ``device="meta"`` (with meta tensors in
    ``sets``) runs the shape and layout checks alone: the CPU tests do."""
    import torch
    import torch.nn.functional as F

    E_, k, n = cfg.experts, cfg.k, cfg.n
    m_pad = [-(-m // 16) * 16 for m in m_splits]
    copies = len(sets)
    T = []
    for s in sets:
        t = {}
        f8 = lambda a, dt: torch.from_dlpack(a).view(dt)  # noqa: E731
        e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
        X, DY, W = s["X"], s["DY"], s["W"]
        # row-wise FP8 with each expert padded to 16 rows (zero rows), transposed copies as cast
        xr = torch.zeros((sum(m_pad), k), dtype=torch.uint8, device=device)
        dyr = torch.zeros((sum(m_pad), n), dtype=torch.uint8, device=device)
        xsrc, dysrc = torch.from_dlpack(X.data), torch.from_dlpack(DY.data)
        o, op = 0, 0
        for m, mp in zip(m_splits, m_pad):
            xr[op:op + m] = xsrc[o:o + m]
            dyr[op:op + m] = dysrc[o:o + m]
            o, op = o + m, op + mp
        t["x8"], t["dy8"] = xr.view(e4), dyr.view(e5)
        t["w8"] = f8(W.data, e4).view(E_, n, k)
        t["wT8"] = f8(W.data_t, e4).view(E_, k, n)
        t["xT8"], t["dyT8"] = f8(X.data_t, e4), f8(DY.data_t, e5)
        t["sx"], t["sdy"], t["sw"] = (torch.from_dlpack(g.scale_inv) for g in (X, DY, W))
        # the loop's scales: one tensor per expert, as a user's per-expert FP8 tensors hold them
        # (cuBLASLt refuses a scale pointer that is not 16-byte aligned, as element e of one
        # (E,) array is: cugrouped copies such scales to aligned slots itself)
        t["sx1"], t["sdy1"], t["sw1"] = ([v[e].clone() for e in range(E_)]
                                         for v in (t["sx"], t["sdy"], t["sw"]))
        t["x16"] = torch.from_dlpack(s["x"]).to(torch.bfloat16)
        t["dy16"] = torch.from_dlpack(s["dy"]).to(torch.bfloat16)
        t["w16"] = torch.from_dlpack(s["w"]).to(torch.bfloat16)
        T.append(t)
    po = np.concatenate([[0], np.cumsum(m_pad)])
    uo = np.concatenate([[0], np.cumsum(m_splits)])
    co = po  # column offsets (in tokens) of each expert's transposed block
    bf = torch.bfloat16
    live = [e for e in range(E_) if m_splits[e]]  # a loop skips empty experts, as a user's would
    peers: dict[str, dict] = {"torch-scaled_mm-loop": {}, "torch-scaled_grouped_mm": {},
                              "torch-grouped_mm-bf16": {}, "torch-linear-loop-bf16": {}}
    t_ = lambda i: T[i % copies]  # noqa: E731

    def sm_fprop(i):
        t = t_(i)
        return [torch._scaled_mm(t["x8"][po[e]:po[e + 1]], t["w8"][e].t(), t["sx1"][e], t["sw1"][e],
                                 out_dtype=bf, use_fast_accum=True) for e in live]

    def sm_dgrad(i):
        t = t_(i)
        return [torch._scaled_mm(t["dy8"][po[e]:po[e + 1]], t["wT8"][e].t(), t["sdy1"][e],
                                 t["sw1"][e], out_dtype=bf) for e in live]

    def sm_wgrad(i):
        t = t_(i)
        out = []
        for e in live:
            mp = m_pad[e]
            dyT = t["dyT8"][n * co[e]:n * co[e + 1]].view(n, mp)
            xT = t["xT8"][k * co[e]:k * co[e + 1]].view(k, mp)
            out.append(torch._scaled_mm(dyT, xT.t(), t["sdy1"][e], t["sx1"][e],
                                        out_dtype=torch.float32))
        return out

    peers["torch-scaled_mm-loop"] = {"fprop": sm_fprop, "dgrad": sm_dgrad, "wgrad": sm_wgrad}
    offs_pad = torch.tensor(np.cumsum(m_pad), dtype=torch.int32, device=device)
    offs = torch.tensor(np.cumsum(m_splits), dtype=torch.int32, device=device)
    if hasattr(torch, "_scaled_grouped_mm"):
        # Its Hopper kernel takes E4M3 operands only, with a float32 scale per row of A and per
        # column of B: dy gets an E4M3 copy of its own here (scaled per expert from its amax),
        # and every scale vector is built before the timing, so only the GEMM is timed.
        rows = torch.tensor(np.repeat(np.arange(E_), m_pad), device=device)
        # wgrad, 2-D x 2-D: dyᵀ (n, Σm') row-major times x (Σm', k) column-major, one group per
        # non-empty expert (offsets at the 16-padded row ends; the padding rows are zeros), a
        # float32 scale per (group, row of dyᵀ) and per (group, column of x): (E' n,), (E' k,)
        live_w, ends_w = wgrad_2d2d_groups(m_splits)
        why_not = check_2d2d_offs(ends_w, sum(m_pad))
        offs_w = torch.tensor(ends_w, dtype=torch.int32, device=device)
        live_t = torch.tensor(live_w, dtype=torch.int64, device=device)
        for t in T:
            dy_e4 = torch.zeros((sum(m_pad), n), dtype=torch.float32, device=device)
            sdy_e4 = torch.ones(E_, dtype=torch.float32, device=device)
            for e in live:
                part = t["dy16"][uo[e]:uo[e + 1]].float()
                amax = part.abs().max()
                scale = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
                dy_e4[po[e]:po[e] + m_splits[e]] = part * scale
                sdy_e4[e] = 1.0 / scale
            t["dy8_e4"] = dy_e4.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            t["sg_fprop"] = (t["sx"][rows].contiguous(),
                             t["sw"][:, None].expand(E_, n).contiguous())
            t["sg_dgrad"] = (sdy_e4[rows].contiguous(), t["sw"][:, None].expand(E_, k).contiguous())
            if why_not is None:
                t["dyT8_e4"] = t["dy8_e4"].t().contiguous()             # (n, Σm') row-major
                t["x8_cm"] = t["x8"].t().contiguous().t()               # (Σm', k) column-major
                t["sg_wgrad"] = wgrad_2d2d_scales(sdy_e4, t["sx"], live_t, n, k)

        def sg_fprop(i):
            t = t_(i)
            sa, sb = t["sg_fprop"]
            return torch._scaled_grouped_mm(t["x8"], t["w8"].transpose(-2, -1), sa, sb, offs=offs_pad,
                                            out_dtype=bf, use_fast_accum=True)

        def sg_dgrad(i):
            t = t_(i)
            sa, sb = t["sg_dgrad"]
            return torch._scaled_grouped_mm(t["dy8_e4"], t["wT8"].transpose(-2, -1), sa, sb,
                                            offs=offs_pad, out_dtype=bf)

        def sg_wgrad(i):             # (E', n, k) bfloat16: the non-empty experts' dW
            t = t_(i)
            sa, sb = t["sg_wgrad"]
            return torch._scaled_grouped_mm(t["dyT8_e4"], t["x8_cm"], sa, sb, offs=offs_w,
                                            out_dtype=bf)

        peers["torch-scaled_grouped_mm"] = {"fprop": sg_fprop, "dgrad": sg_dgrad}
        if why_not is None:
            peers["torch-scaled_grouped_mm"]["wgrad"] = sg_wgrad
        else:
            print(f"{cfg.name}: torch._scaled_grouped_mm wgrad not run: {why_not}")
    else:
        print("torch._scaled_grouped_mm not in this torch: skipped")
    if hasattr(torch, "_grouped_mm"):
        peers["torch-grouped_mm-bf16"] = {
            "fprop": lambda i: torch._grouped_mm(t_(i)["x16"], t_(i)["w16"].transpose(-2, -1), offs=offs),
            "dgrad": lambda i: torch._grouped_mm(t_(i)["dy16"], t_(i)["w16"], offs=offs),
            "wgrad": lambda i: torch._grouped_mm(t_(i)["dy16"].t(), t_(i)["x16"], offs=offs)}
    else:
        print("torch._grouped_mm not in this torch: skipped")

    def lin(pass_name):
        def run(i):
            t = t_(i)
            out = []
            for e in live:
                x, dy, w = t["x16"][uo[e]:uo[e + 1]], t["dy16"][uo[e]:uo[e + 1]], t["w16"][e]
                out.append(F.linear(x, w) if pass_name == "fprop" else dy @ w
                           if pass_name == "dgrad" else dy.t() @ x)
            return out
        return run

    peers["torch-linear-loop-bf16"] = {p: lin(p) for p in PASSES}
    return peers


CAST_EXCLUDED = "GEMM only, cast excluded"   # FP8 GEMM vs a 16-bit one: our cast not timed
_WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2}


# The loop over more side streams than its default 4 (set_side_streams): a row of its own, so
# that a run shows what small per-expert GEMMs gain from more of them at once.
WIDE_STREAMS = 16


# The loop's calls issued by this many host threads (set_host_threads): a row of its own, so that
# a run shows what issuing cuBLAS's calls from several threads saves in host time.
HOST_THREADS = 4
# The rows of the default loop under another setting: never the peers' reference.
VARIANTS = (f"cugrouped-fp8-s{WIDE_STREAMS}", f"cugrouped-fp8-t{HOST_THREADS}")


def _impls(pass_name: str, fp8: dict, f16: dict, peers: dict) -> list[tuple]:
    """``(impl, fn, is_fp8, is_ours, out_dtype)`` per row of one pass, cugrouped's first (its FP8
    loop also over :data:`WIDE_STREAMS` side streams, ``cugrouped-fp8-s16``, and issued by
    :data:`HOST_THREADS` host threads, ``cugrouped-fp8-t4``). wgrad's
    output dtypes differ: cugrouped FP8 writes float32 (``cugrouped-fp8``) and bfloat16
    (``cugrouped-fp8-bf16dW``), the per-expert ``_scaled_mm`` loop float32, the rest 16 bits."""
    from ..ops import grouped_gemm as gg

    wg = pass_name == "wgrad"
    odt = "float32" if wg else "bfloat16"
    ours = fp8[pass_name]
    impls = [("cugrouped-fp8", ours, True, True, odt),
             (VARIANTS[0], with_setting(ours, gg.set_side_streams, WIDE_STREAMS), True, True, odt),
             (VARIANTS[1], with_setting(ours, gg.set_host_threads, HOST_THREADS), True, True, odt)]
    if wg:
        impls.append(("cugrouped-fp8-bf16dW", fp8["wgrad-bf16"], True, True, "bfloat16"))
    impls.append(("cugrouped-fp16", f16[pass_name], False, True, "float16"))
    impls += [(name, fns[pass_name], "scaled" in name, False,
               "float32" if wg and name == "torch-scaled_mm-loop" else "bfloat16")
              for name, fns in peers.items() if pass_name in fns]
    return impls


def path_taken(fn) -> str:
    """Which path one call of ``fn`` took: ``"grouped"`` (cuBLASLt's grouped GEMM) or ``"loop"``
    (read from the launch records; cugrouped chooses at run time, see ``grouped_gemm``)."""
    from .. import record_launches

    with record_launches() as log:
        fn(0)
    return "grouped" if any(e.kernel == "cublasLtMatmul[grouped]" for e in log) else "loop"


def speedup_columns(impl: str, is_fp8: bool, out_dtype: str, ms: float, refs: dict) -> dict:
    """The speed-up columns of one row of a pass, its rows taken in :func:`_impls` order:
    a cugrouped FP8 row becomes the reference for its output width in ``refs``; any other row
    gets the speed-up of that reference over it (``speedup_reference`` names it) and, for a
    16-bit row, ``speedup_note`` (the FP8 side's cast is not in the GEMM time)."""
    if impl.startswith("cugrouped-fp8"):
        if impl not in VARIANTS:                        # the default loop is the reference
            refs.setdefault(_WIDTH[out_dtype], (impl, ms))
        return {}
    if _WIDTH[out_dtype] not in refs:
        return {}
    ref, ref_ms = refs[_WIDTH[out_dtype]]
    cols = dict(speedup_of_cugrouped_fp8=ms / ref_ms, speedup_reference=ref)
    if not is_fp8:
        cols["speedup_note"] = CAST_EXCLUDED
    return cols


def bench_gemm(quick: bool, rows: list[dict]) -> None:
    """Time every config and pass; append one dict per (config, pass, impl) to ``rows``. The
    speed-up of cugrouped FP8 over a row is over the cugrouped FP8 row with the same output width
    (``speedup_reference``: for wgrad, float32 or bfloat16 dW); over a 16-bit row it compares the
    GEMMs alone, our cast excluded (``speedup_note``)."""
    from .common import copy_bandwidth_gbs

    configs = QUICK_GEMM if quick else GEMM_CONFIGS
    runs, host_runs = (10, 10) if quick else (30, 20)
    try:
        import torch  # noqa: F401
        peaks = dense_peaks_tflops()
        bw = copy_bandwidth_gbs()
        print(f"dense peaks: bf16 {peaks['bf16']:.0f} TFLOP/s, fp8 {peaks['fp8']:.0f} TFLOP/s; "
              f"copy {bw:.0f} GB/s")
    except ImportError:
        torch = None
        peaks = None
        print("torch not installed: peers and dense peaks skipped")
    for cfg in configs:
        m_splits = cfg.m_splits()
        per_set = sum(m_splits) * (cfg.k + cfg.n) * 5 + cfg.experts * cfg.n * cfg.k * 3
        copies = max(2, int(np.ceil(256e6 / per_set)))
        sets, fp8, f16 = _cugrouped_calls(cfg, m_splits, copies)
        peers = _torch_peers(cfg, m_splits, sets) if torch is not None else {}
        for pass_name in PASSES:
            flops = gemm_flops(cfg, pass_name)
            refs: dict[int, tuple[str, float]] = {}     # output width -> cugrouped FP8 row
            impls = _impls(pass_name, fp8, f16, peers)

            def skipped(impl, exc, cfg=cfg, pass_name=pass_name):  # a peer refusing the shapes
                print(f"{cfg.name:<24} {pass_name:<5} {impl:<24} skipped: {type(exc).__name__}: "
                      f"{str(exc)[:120]}")

            timed = time_together({impl: fn for impl, fn, *_ in impls}, runs,
                                  host_runs=host_runs, skipped=skipped)
            for impl, fn, is_fp8, is_ours, out_dtype in impls:
                if impl not in timed:
                    continue
                t = timed[impl]
                ms = t.ms
                tflops = flops / ms / 1e9
                row = dict(op="gemm", config=cfg.name, pass_name=pass_name, impl=impl, ms=ms,
                           tflops=tflops, experts=cfg.experts, tokens=sum(m_splits),
                           out_dtype=out_dtype, **t.columns())
                if peaks:
                    peak = peaks["fp8" if is_fp8 else "bf16"]
                    row["pct_peak"] = 100 * tflops / peak
                    row["pct_roofline"] = roofline_pct(
                        ms, flops, gemm_bytes(cfg, pass_name, is_fp8, _WIDTH[out_dtype]), peak, bw)
                if is_ours:
                    row.update(host_us_per_expert=t.host_us / cfg.experts, gemm_path=path_taken(fn))
                row.update(speedup_columns(impl, is_fp8, out_dtype, ms, refs))
                rows.append(row)
                extra = (f" host {row['host_us_per_expert']:5.1f} us/expert ({row['gemm_path']})"
                         if is_ours else "")
                if "speedup_of_cugrouped_fp8" in row:
                    extra += (f" {row['speedup_reference']} {row['speedup_of_cugrouped_fp8']:5.2f}x "
                              f"faster" + (f" ({CAST_EXCLUDED})" if "speedup_note" in row else ""))
                if row.get("launch_bound"):
                    extra += f" [launch-bound? host time >= {LAUNCH_BOUND:g} x lead {row['lead_ms']:.1f} ms]"
                pct = f"{row['pct_roofline']:5.1f}% of roofline" if "pct_roofline" in row else ""
                print(f"{cfg.name:<24} {pass_name:<5} {impl:<24} {ms:8.3f} ms {tflops:7.1f} TFLOP/s "
                      f"{pct} out {out_dtype:<8}{extra}")


# ---------------------------------------------------------------------------------------------
# Host cost per expert, on the CPU.

class _FakeStream:
    def __init__(self, ptr: int):
        self.ptr = ptr

    def wait_event(self, event) -> None:
        pass


class _FakeEvent:
    def record(self, stream=None) -> None:
        pass


def host_loop_state(compute_capability: int = 90):
    """A ``_DeviceState`` whose device calls are fakes: the heuristic returns an empty result,
    streams/events do nothing, and ``cublasLtMatmul`` is the real function called through the
    same ctypes prototype with every argument the loop passes, but a NULL handle, on which it
    returns at once (the call's argument packing, about 1.5-2 us here, is counted; cuBLAS's own
    host work and the launch are not). Everything else is the real loop: the vectorized plan,
    descriptor and layout caches (real libcublasLt objects), pointer updates."""
    import ctypes

    from ..cublaslt import HeuristicResult, lib
    from ..ops import grouped_gemm as gg

    real_matmul = lib().cublasLtMatmul

    def matmul(handle, *args):
        real_matmul(None, *args)      # CUBLAS_STATUS_NOT_INITIALIZED, having packed every argument
        return 0

    st = gg._DeviceState(
        0, compute_capability, ctypes.c_void_p(0), [_FakeStream(0x1000 + i) for i in range(gg.NUM_STREAMS)],
        [0x7F0000000000 + (i << 26) for i in range(gg.NUM_STREAMS)], lambda: _FakeStream(0),
        _FakeEvent, lambda *a: HeuristicResult(), matmul, lambda ptr, nbytes, stream: None,
        lambda *args: None, lambda nbytes: 0x7D0000000000,
        lambda: (_FakeStream(0x1000 + len(st.streams)), 0x7F0000000000 + (len(st.streams) << 26)))
    st.caller_ws[0] = 0x7E0000000000     # a single expert's call runs on the (fake) caller's stream
    return st


def bench_host_loop(rows: list[dict], experts=(8, 64, 256), reps: int = 200) -> None:
    """Host time of ``grouped_fprop``'s CUDA path on the CPU, per call and per expert: the operand
    checks (memoised), the output checks and plan (memoised per output buffer) and the launch loop,
    with only the device calls faked (see :func:`host_loop_state`). FP8 operands (host buffers
    standing in for device ones), k=n=256, jagged token counts. ``hot``: the same buffers every
    call, as in training once warm (the memo hits); ``cold``: the memo cleared before every call,
    so every check and plan runs (descriptor and heuristic caches stay warm).

    With torch installed, rows ``op="gemm-host-torch"`` time the same calls on torch CPU tensors
    over the same buffers, read the way CUDA tensors are (pointers through ``as_view``, memo keyed
    on the tensors): ``hot``/``cold`` as above, and ``layer``: what the torch layer's custom op
    does per call on CUDA tensors with new token counts, the call described from the tensors'
    pointers and the counts (:mod:`cugrouped.ops._gemm_direct`: no checks), planned (its memo
    cleared) and launched."""
    import ml_dtypes

    from ..ops import _gemm_direct
    from ..ops import grouped_gemm as gg
    from ..ops.pad_cast_transpose import multi_pad_cast_transpose

    try:
        import torch
    except ImportError:
        torch = None
    st = host_loop_state()
    k = n = 256
    kw = dict(out_dtype="bfloat16", fast_accum=True)

    def timed(step, n_reps):
        for _ in range(4):
            step()
        return cpu_loop_us(step, n_reps)     # CPU time: device calls are faked, nothing waits

    for num in experts:
        rng = np.random.default_rng(num)
        m_splits = [int(v) for v in rng.integers(64, 192, num)]
        m_splits[num // 3] = 0
        X = multi_pad_cast_transpose([np.ones((m, k), np.float32) for m in m_splits])
        W = multi_pad_cast_transpose([np.ones((n, k), np.float32) for _ in m_splits], align=1)
        out = np.empty((sum(m_splits), n), ml_dtypes.bfloat16)
        forms = [("numpy", X, W, out)]
        if torch is not None:
            t8 = lambda a: torch.from_numpy(np.asarray(a).view(np.uint8))  # noqa: E731
            Xt, Wt = (dataclasses.replace(g, data=t8(g.data), data_t=t8(g.data_t),
                                          scale_inv=torch.from_numpy(g.scale_inv)) for g in (X, W))
            forms.append(("torch", Xt, Wt, torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)))
        for kind, x_, w_, o_ in forms:
            def hot(x_=x_, w_=w_, o_=o_):
                gg.launch_checked(gg.checked("fprop", (x_, w_, None), kw), o_, np, st)

            def cold():
                gg.clear_memo()
                hot()

            row = dict(op="gemm-host" if kind == "numpy" else "gemm-host-torch", config=f"E{num}",
                       impl="cugrouped", hot_us=timed(hot, reps), cold_us=timed(cold, max(1, reps // 4)))
            if kind == "torch":
                def layer(x_=x_, w_=w_, o_=o_):   # as cugrouped.pytorch._custom_ops._fprop_into
                    _gemm_direct.clear_memo()
                    _gemm_direct.run(
                        "fprop", x_.data.data_ptr(),
                        (x_.scale_inv.data_ptr(), x_.scale_inv.stride(0)), "e4m3",
                        w_.data.data_ptr(), (w_.scale_inv.data_ptr(), w_.scale_inv.stride(0)),
                        "e4m3", tuple(m_splits), k, n, o_.data_ptr(), "bfloat16", None, True, 0,
                        state=st)

                row["layer_us"] = timed(layer, reps)
            gg.clear_memo()
            row["host_us"] = row["hot_us"]
            row["host_us_per_expert"] = row["hot_us"] / num
            rows.append(row)
            extra = (f", {row['layer_us']:8.1f} us as the torch layer calls it"
                     if "layer_us" in row else "")
            print(f"grouped_fprop host path, {num:>3} experts, {kind:<5}: {row['hot_us']:8.1f} us "
                  f"per call ({row['hot_us'] / num:.2f} us per expert; same buffers), "
                  f"{row['cold_us']:8.1f} us with every check and plan redone{extra}; device calls faked")
