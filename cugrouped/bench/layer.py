"""Benchmark of the PyTorch layer: ``GroupedLinear`` forward + backward, FP8 against 16-bit and
against what users write today.

Per config, in one process, on the same bf16 weights and the same rotated bf16 inputs, one
training step each (forward, then ``torch.autograd.grad`` for the input and every weight: dgrad
and wgrad both run, nothing accumulates into ``.grad``):

* ``cugrouped-fp8-delayed-{tensor,list}``: ``fp8_autocast(DelayedScaling(HYBRID))``, the
  reference row every speed-up is measured against (tensor input);
* ``cugrouped-fp8-current-{tensor,list}``: ``Float8CurrentScaling(HYBRID)``;
* ``cugrouped-bf16-{tensor,list}``: the same layer with no ``fp8_autocast`` (torch matmuls);
* ``torch-pad-linear-loop-bf16``: what users do today (TransformerEngine's ``Fp8Padding`` +
  per-expert linear + ``Fp8Unpadding``, minus the FP8): split, pad every expert to 16 rows with
  ``zeros`` + ``cat``, per-expert ``F.linear``, unpad with ``cat``; see :func:`torch_baseline`;
* ``torch-linear-loop-bf16``: the same without the padding (split, ``F.linear``, ``cat``);
* ``torch-grouped_mm-bf16``: ``torch._grouped_mm`` forward and its autograd backward, on one
  ``(E, n, k)`` bf16 weight stacked at setup and device int32 row offsets built at setup.

``tensor`` is one ``(sum m_i, k)`` input with ``m_splits`` (a host list); ``list`` is E per-expert
tensors in, E views of one buffer out. Two more rows time the MoE permute in front of the layer
(``permute`` input: a ``(sum m_i / 2, k)`` token matrix and a ``row_index`` as a top-2 router
makes it): ``cugrouped-fp8-delayed-permute`` passes ``row_index`` to the layer (the cast kernel
gathers; the tokens' gradient is summed back in backward), ``index_select+cugrouped-fp8-delayed``
permutes first (``index_select``, whose backward is the same sum) -- their outputs are equal.
Two more time the gated activation in front of the layer as fc2 of a SwiGLU MLP (``swiglu``
input: fc1's ``(sum m_i, 2k)`` output): ``cugrouped-fp8-delayed-swiglu`` is
``GroupedLinear(input_activation="swiglu")`` (the cast applies the activation; backward returns
the gradient of fc1's output), ``torch-swiglu+cugrouped-fp8-delayed`` computes ``F.silu(a) * b``
first (their outputs agree to FP8 precision; no roofline column: the byte model is the plain
layer's).
Rows report ms (CUDA events, median after warm-up, the implementations of a config timed in
turn: :func:`.common.time_together`), TFLOP/s, % of the measured dense peak (FP8 peak for FP8
rows, bf16 for the rest), % of the roofline ``max(flops / peak, bytes / copy bandwidth)`` with
the byte model of :func:`layer_bytes` (the L2 size read from the device), host us per call and
per expert (one call on an idle GPU, so launches never block), the spin lead, a
``launch_bound`` flag and the drift over the run (:meth:`.common.Timing.columns`), the speed-up
of ``cugrouped-fp8-delayed-tensor`` over the row, and for FP8 rows the relative error of the
output against the bf16 layer's. Importing this module needs neither torch nor a GPU; only
:func:`bench_layer` needs both. The configs are the GEMM benchmark's shapes (compare the layer
with its three GEMMs).
"""

from __future__ import annotations

import contextlib

import numpy as np

from .common import is_sticky_cuda_error, roofline_pct, time_together
from .gemm import GEMM_CONFIGS, QUICK_GEMM, GemmBench

__all__ = ["LAYER_CONFIGS", "QUICK_LAYER", "PRECISIONS", "layer_flops", "layer_bytes",
           "torch_baseline", "layer_steps", "bench_layer"]

LAYER_CONFIGS: tuple[GemmBench, ...] = GEMM_CONFIGS
QUICK_LAYER: tuple[GemmBench, ...] = QUICK_GEMM
PRECISIONS = ("bf16", "fp8-delayed", "fp8-current")
ALIGN = 16  # token padding of the FP8 wgrad operands (and of the torch baseline)
REFERENCE_IMPL = "cugrouped-fp8-delayed-tensor"
# the current-scaling tensor step captured in a CUDA graph, and the eager row it is compared with
GRAPHED_IMPL, GRAPHED_EAGER = "cugrouped-fp8-current-graphed", "cugrouped-fp8-current-tensor"


def _padded(m_splits, align: int = ALIGN) -> list[int]:
    return [-(-m // align) * align for m in m_splits]


def layer_flops(cfg: GemmBench) -> int:
    """Useful FLOPs of one training step of the layer: fprop, dgrad and wgrad, each
    ``2 * sum(m_i) * k * n`` (padding not counted)."""
    return 3 * 2 * sum(cfg.m_splits()) * cfg.k * cfg.n


def layer_bytes(cfg: GemmBench, precision: str, l2_bytes: int = 0) -> int:
    """Bytes one training step must move through HBM at least, per path (T = sum m_i, T' = sum of
    the 16-padded m_i, W = E*n*k weight elements; 16-bit = 2 bytes, FP8 = 1 byte):

    * ``bf16``: fprop reads x, W, writes y; dgrad reads dy, W, writes dx; wgrad reads x, dy,
      writes dW: ``6Tk + 6Tn + 6W``.
    * ``fp8-delayed``: the casts read x, dy, W in 16 bits once and write their FP8 row-wise copies
      (T k, T n, W) and transposed padded copies (T' k, T' n, W); fprop reads x8, W8, writes y;
      dgrad reads dy8, W8ᵀ, writes dx; wgrad reads x8ᵀ, dy8ᵀ, writes dW (16-bit).
    * ``fp8-current``: as delayed, plus one more 16-bit read of each of x, dy and W (the amax
      pass runs before the cast) that is larger than the L2 cache (``l2_bytes``; 0: count them
      all): a tensor that fits is read from L2 the second time.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision: got {precision!r}, expected one of {PRECISIONS}")
    T, Tp = sum(cfg.m_splits()), sum(_padded(cfg.m_splits()))
    k, n, W = cfg.k, cfg.n, cfg.experts * cfg.n * cfg.k
    if precision == "bf16":
        return (2 * T * k + 2 * W + 2 * T * n) + (2 * T * n + 2 * W + 2 * T * k) \
            + (2 * T * k + 2 * T * n + 2 * W)
    casts = (2 * T * k + T * k + Tp * k) + (2 * T * n + T * n + Tp * n) + (2 * W + 2 * W)
    if precision == "fp8-current":
        casts += sum(b for b in (2 * T * k, 2 * T * n, 2 * W) if b > l2_bytes)
    gemms = (T * k + W + 2 * T * n) + (T * n + W + 2 * T * k) + (Tp * k + Tp * n + 2 * W)
    return casts + gemms


def torch_baseline(x, m_splits, weights, biases=None, align: int = ALIGN):
    """The layer as users write it in plain torch today: split the ``(sum m_i, k)`` input, pad
    each expert's rows with zeros to a multiple of ``align`` and concatenate (TransformerEngine's
    ``Fp8Padding``), split again, one ``F.linear`` per expert, concatenate, drop the padding rows
    (``Fp8Unpadding``). ``align=1`` skips both padding steps. Returns ``(sum m_i, n)``; autograd
    gives dx, dW_i, db_i. Empty experts are not skipped (their weight gradient is zero)."""
    import torch
    import torch.nn.functional as F

    m_splits = [int(m) for m in m_splits]
    biases = list(biases) if biases else [None] * len(weights)
    if len(m_splits) != len(weights) or len(biases) != len(weights):
        raise ValueError(f"m_splits, weights, biases: expected one per expert, got "
                         f"{len(m_splits)}, {len(weights)}, {len(biases)}")
    if align > 1:
        m_pad = _padded(m_splits, align)
        parts = []
        for xi, m, mp in zip(torch.split(x, m_splits), m_splits, m_pad):
            parts.append(xi)
            if mp > m:
                parts.append(xi.new_zeros((mp - m, x.shape[1])))
        x = torch.cat(parts)
    else:
        m_pad = m_splits
    y = torch.cat([F.linear(xi, w, b) for xi, w, b in zip(torch.split(x, m_pad), weights, biases)])
    if align > 1:
        y = torch.cat([yi[:m] for yi, m in zip(torch.split(y, m_pad), m_splits)])
    return y


def layer_steps(cfg: GemmBench, device: str = "cuda", dtype=None, copies: int = 2, seed: int = 0):
    """The timed callables for one config: ``(layer, [(impl, precision, input_form, step)])``.

    ``step(i)`` runs one training step on input copy ``i % copies`` (forward, then
    ``torch.autograd.grad`` of every input and weight with a fixed random grad output) and returns
    ``(output, grads)``. All impls share the layer's weights. Runs on CPU tensors too (the FP8
    casts then run on the CPU; used by the tests)."""
    import torch

    from ..pytorch import DelayedScaling, Float8CurrentScaling, Format, GroupedLinear, fp8_autocast
    from ..pytorch._grouped_linear_fn import swiglu

    dtype = dtype or torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(seed)
    m_splits = cfg.m_splits()
    T = sum(m_splits)
    torch.manual_seed(seed)
    layer = GroupedLinear(cfg.experts, cfg.k, cfg.n, bias=False, params_dtype=dtype, device=device)
    params = layer.weights()
    # fc2 of a SwiGLU MLP on the same weights, taking fc1's [a | b] output as it is
    fc2 = GroupedLinear(cfg.experts, cfg.k, cfg.n, bias=False, params_dtype=dtype, device=device,
                        input_activation="swiglu")
    fc2.load_state_dict(layer.state_dict())
    sets = []
    for _ in range(copies):
        x = torch.randn(T, cfg.k, generator=gen, device=device).to(dtype)
        dy = (torch.randn(T, cfg.n, generator=gen, device=device) * 1e-2).to(dtype)
        x.requires_grad_()
        xl = [xi.detach().requires_grad_() for xi in torch.split(x.detach(), m_splits)]
        sets.append(dict(x=x, xl=xl, dy=dy, dyl=list(torch.split(dy, m_splits))))
    _no_fp8 = contextlib.nullcontext
    recipes = {"bf16": None, "fp8-delayed": DelayedScaling(fp8_format=Format.HYBRID),
               "fp8-current": Float8CurrentScaling(fp8_format=Format.HYBRID)}

    def cugrouped_step(recipe, form):
        def step(i):
            s = sets[i % copies]
            with fp8_autocast(fp8_recipe=recipe) if recipe is not None else _no_fp8():
                if form == "tensor":
                    y = layer(s["x"], m_splits)
                    grads = torch.autograd.grad(y, [s["x"], *params], s["dy"], allow_unused=True)
                else:
                    y = layer(s["xl"])
                    grads = torch.autograd.grad(y, [*s["xl"], *params], s["dyl"], allow_unused=True)
            return y, grads
        return step

    def baseline_step(align):
        def step(i):
            s = sets[i % copies]
            y = torch_baseline(s["x"], m_splits, params, align=align)
            return y, torch.autograd.grad(y, [s["x"], *params], s["dy"], allow_unused=True)
        return step

    def grouped_mm_step():
        # torch's grouped GEMM as a layer: one (E, n, k) weight, stacked here once (a model would
        # hold it so), and the int32 end offsets of the experts' rows on the device (no padding,
        # empty experts allowed); autograd's GroupedMmBackward0 gives dx and dW
        w = torch.stack([p.detach() for p in params]).requires_grad_()
        offs = torch.tensor(np.cumsum(m_splits), dtype=torch.int32, device=device)

        def step(i):
            s = sets[i % copies]
            y = torch._grouped_mm(s["x"], w.transpose(-2, -1), offs=offs)
            return y, torch.autograd.grad(y, [s["x"], w], s["dy"])
        return step

    # the permute: every token routed to two experts (rows of the same token in two experts)
    n_tok = max(1, T // 2)
    row_index = torch.randint(0, n_tok, (T,), generator=gen, device=device)
    for st in sets:
        st["tokens"] = torch.randn(n_tok, cfg.k, generator=gen, device=device).to(dtype)
        st["tokens"].requires_grad_()
        st["h"] = torch.randn(T, 2 * cfg.k, generator=gen, device=device).to(dtype)
        st["h"].requires_grad_()

    def swiglu_step(fused):
        weights = fc2.weights() if fused else params

        def step(i):
            s = sets[i % copies]
            with fp8_autocast(fp8_recipe=recipes["fp8-delayed"]):
                if fused:
                    y = fc2(s["h"], m_splits)
                else:
                    y = layer(swiglu(s["h"]), m_splits)
                grads = torch.autograd.grad(y, [s["h"], *weights], s["dy"], allow_unused=True)
            return y, grads
        return step

    def permute_step(fused):
        def step(i):
            s = sets[i % copies]
            with fp8_autocast(fp8_recipe=recipes["fp8-delayed"]):
                if fused:
                    y = layer(s["tokens"], m_splits, row_index=row_index)
                else:
                    y = layer(s["tokens"].index_select(0, row_index), m_splits)
                grads = torch.autograd.grad(y, [s["tokens"], *params], s["dy"], allow_unused=True)
            return y, grads
        return step

    def graphed_step(recipe):
        # The whole step (forward and both gradients) captured once into a CUDA graph, after two
        # eager steps on the capturing stream (workspaces, descriptors, algorithms: nothing is
        # allocated outside torch's graph pool during the capture); each call replays it on copy
        # 0's tensors. What the host then pays per step is one replay, whatever the expert count.
        state = {}

        def eager(s):
            with fp8_autocast(fp8_recipe=recipe):
                y = layer(s["x"], m_splits)
                return y, torch.autograd.grad(y, [s["x"], *params], s["dy"], allow_unused=True)

        def step(i):
            if "graph" not in state:
                cap = torch.cuda.Stream(device)
                cap.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(cap):
                    for _ in range(2):
                        eager(sets[0])
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=cap):
                        state["out"] = eager(sets[0])
                torch.cuda.current_stream().wait_stream(cap)
                state["graph"] = graph
            state["graph"].replay()
            return state["out"]
        return step

    impls = []
    for precision in ("fp8-delayed", "fp8-current", "bf16"):
        for form in ("tensor", "list"):
            impls.append((f"cugrouped-{precision}-{form}", precision, form,
                          cugrouped_step(recipes[precision], form)))
    impls.append(("torch-pad-linear-loop-bf16", "bf16", "tensor", baseline_step(ALIGN)))
    impls.append(("torch-linear-loop-bf16", "bf16", "tensor", baseline_step(1)))
    if hasattr(torch, "_grouped_mm"):
        impls.append(("torch-grouped_mm-bf16", "bf16", "tensor", grouped_mm_step()))
    impls.append(("cugrouped-fp8-delayed-permute", "fp8-delayed", "permute", permute_step(True)))
    impls.append(("index_select+cugrouped-fp8-delayed", "fp8-delayed", "permute",
                  permute_step(False)))
    impls.append(("cugrouped-fp8-delayed-swiglu", "fp8-delayed", "swiglu", swiglu_step(True)))
    impls.append(("torch-swiglu+cugrouped-fp8-delayed", "fp8-delayed", "swiglu",
                  swiglu_step(False)))
    if torch.device(device).type == "cuda":
        impls.append((GRAPHED_IMPL, "fp8-current", "graph", graphed_step(recipes["fp8-current"])))
    return layer, impls


def _rel_err(y, ref) -> float:
    import torch

    y = (torch.cat(y) if isinstance(y, (list, tuple)) else y).detach()
    ref = (torch.cat(ref) if isinstance(ref, (list, tuple)) else ref).detach()
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def bench_layer(quick: bool, rows: list[dict]) -> None:
    """Time every config and impl on the GPU; append one dict per (config, impl) to ``rows``."""
    try:
        import torch
    except ImportError:
        print("bench layer: torch not installed; skipped (the layer is cugrouped.pytorch)")
        return
    if not torch.cuda.is_available():
        print("bench layer: torch sees no GPU; skipped")
        return
    from .common import copy_bandwidth_gbs, l2_cache_bytes
    from .gemm import dense_peaks_tflops

    configs = QUICK_LAYER if quick else LAYER_CONFIGS
    runs, host_reps = (10, 5) if quick else (30, 20)
    peaks = dense_peaks_tflops()
    bw = copy_bandwidth_gbs()
    l2 = l2_cache_bytes()
    print(f"layer roofline: bf16 {peaks['bf16']:.0f} TFLOP/s, fp8 {peaks['fp8']:.0f} TFLOP/s, "
          f"copy {bw:.0f} GB/s, L2 {l2 / 1e6:.0f} MB ({torch.cuda.get_device_name()})")
    for cfg in configs:
        T = sum(cfg.m_splits())
        per_set = 2 * T * (cfg.k + cfg.n)            # x and dy in bf16
        copies = max(2, int(np.ceil(256e6 / per_set)))
        layer, impls = layer_steps(cfg, "cuda", torch.bfloat16, copies)
        flops = layer_flops(cfg)
        # Second step on copy 0 (delayed scaling starts from scale 1; its second step uses the
        # first step's amaxes): the FP8 outputs against the bf16 layer's, same input and weights.
        outputs = {}
        for impl, _, _, step in impls:
            try:
                step(0)
                outputs[impl] = step(0)[0]
            except Exception as exc:   # reported, not fatal: the other impls still run
                if is_sticky_cuda_error(exc):
                    raise              # the context is gone: the section stops here
                outputs[impl] = exc
        ref_y = outputs.get("cugrouped-bf16-tensor")
        for impl, _, _, _ in impls:
            if isinstance(outputs[impl], Exception):
                exc = outputs[impl]
                print(f"{cfg.name:<24} {impl:<30} skipped: {type(exc).__name__}: {str(exc)[:160]}")
        timed = time_together({impl: step for impl, _, _, step in impls
                               if not isinstance(outputs[impl], Exception)}, runs,
                              host_runs=host_reps)
        ours = None
        fused = {}                                  # form -> the fused row's ms
        for impl, precision, form, step in impls:
            if impl not in timed:
                continue
            t = timed[impl]
            ms, host = t.ms, t.host_us
            tflops = flops / ms / 1e9
            peak = peaks["fp8" if precision.startswith("fp8") else "bf16"]
            row = dict(op="layer", config=cfg.name, impl=impl, precision=precision, input=form,
                       ms=ms, tflops=tflops, pct_peak=100 * tflops / peak, host_us=host,
                       host_us_per_expert=host / cfg.experts, experts=cfg.experts, tokens=T,
                       k=cfg.k, n=cfg.n, **t.columns())
            if form != "swiglu":                    # (the byte model is the plain layer's)
                row["pct_roofline"] = roofline_pct(ms, flops, layer_bytes(cfg, precision, l2),
                                                   peak, bw)
            same_input = form not in ("permute", "swiglu")   # these rows read other tensors
            if precision.startswith("fp8") and same_input and isinstance(ref_y, torch.Tensor):
                row["rel_err_vs_bf16"] = _rel_err(outputs[impl], ref_y)
            if impl == REFERENCE_IMPL:
                ours = ms
            elif impl.startswith("cugrouped-") and form in ("permute", "swiglu"):
                fused[form] = ms                     # the fused one of its pair
            elif form in ("permute", "swiglu"):      # the explicit step against the fused one
                if form in fused:                    # (not against the plain layer's work)
                    row[f"speedup_of_fused_{form}"] = ms / fused[form]
            elif form == "graph":                    # the eager step against its replay
                if GRAPHED_EAGER in timed:
                    row["speedup_of_graph"] = timed[GRAPHED_EAGER].ms / ms
            elif ours is not None:
                row["speedup_of_cugrouped_fp8"] = ms / ours
            rows.append(row)
            extra = "".join(f" {label} {row[key]:5.2f}x faster" for key, label in (
                ("speedup_of_cugrouped_fp8", "cugrouped-fp8"),
                ("speedup_of_fused_permute", "fused permute"),
                ("speedup_of_fused_swiglu", "fused swiglu"),
                ("speedup_of_graph", "replay vs eager")) if key in row)
            err = f" err {row['rel_err_vs_bf16']:.3f}" if "rel_err_vs_bf16" in row else ""
            roof = f"{row['pct_roofline']:5.1f}% of roofline, " if "pct_roofline" in row else ""
            print(f"{cfg.name:<24} {impl:<34} {ms:8.3f} ms {tflops:7.1f} TFLOP/s "
                  f"{roof}host {row['host_us_per_expert']:6.1f} us/expert{err}{extra}")
        del layer, impls, outputs, ref_y
        torch.cuda.empty_cache()
