"""The autograd function behind :class:`~cugrouped.pytorch.GroupedLinear` (one forward and one
backward for all experts; see grouped_linear.py's docstring for the launches), its hashable
configuration, and the queue of deferred weight gradients."""

from __future__ import annotations

import collections
import dataclasses
import functools

import torch

from . import _custom_ops as cops
from ._gather import scatter_rows
from .fp8_state import GRAD_OUTPUT, INPUT

FP8_ALIGN = 16          # token padding of the transposed copies (the wgrad GEMM reduces over it;
                        # the block recipes': cops.token_align)


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything the autograd function needs that is not a tensor (hashable, for torch.compile)."""

    list_mode: bool
    num_experts: int
    k: int
    n: int
    has_bias: bool
    fp8: bool
    fmt_fwd: str = "e4m3"
    fmt_bwd: str = "e5m2"
    margin: int = 0
    delayed: bool = False
    amax_compute_algo: str = "max"
    num_e4m3: int = 0
    fuse_bias: bool = False
    fuse_wgrad: bool = False
    accumulate_main_grad: bool = True   # False: overwrite main_grad (first micro-batch, FSDP)
    cast_backend: str = "emulate"
    amax_group: tuple = ()          # groups the amaxes are all-reduced (max) over, in turn
                                    # (fp8_autocast's fp8_group; a layer may add its own)
    grad_enabled: bool = True       # False (no_grad): the delayed-scaling state is left alone
    wgrad_store: object = None      # a _WgradStore: backward queues wgrad for backward_dw()
    bwd_mode: str = "fp8"           # or "hp_wgrad", "high_precision", "dequantized" (recipes)
    save_original_input: bool = False   # FP8: save the input itself, re-cast it in backward
    grad_accs: tuple = ()           # the weights' AccumulateGrad nodes (fused / deferred wgrad)
    lazy_main_grad: bool = False    # fused wgrad: main_grad from weight.get_main_grad() in backward
    q_inp: tuple = (0.0, False)     # current scaling: (amax_epsilon, power_2_scale) of the input
    q_grad: tuple = (0.0, False)    # ... and of the grad output (recipe QParams)
    gather: bool = False            # fused permute: xs = (tokens,), a row_index after main_grads
    fast_accum: tuple = (True, False, False)   # FP8 fast accumulation of fprop, dgrad, wgrad
    block: tuple = ()               # Float8BlockScaling: (input, weight, grad) block dims, else ()
    # single_grouped_weight / _bias: the weights (biases) come in as one (E, ...) tensor, whose
    # gradient goes out as one tensor (no per-expert grads stacked again) and whose attributes
    # (main_grad flags, lazy main_grad) stand for every expert
    stacked: tuple = (False, False)
    # "swiglu": the inputs are fc1's outputs [a | b] (2k columns) and the FP8 cast applies
    # silu(a) * b (FP8 with the default backward only; GroupedLinear applies it in torch
    # otherwise); backward keeps the inputs and returns their gradient (swiglu_backward)
    activation: str | None = None

    def counts(self) -> tuple[int, int, int]:
        """How many input tensors carry the inputs, the weights and the biases."""
        E = self.num_experts
        return (E if self.list_mode else 1, 1 if self.stacked[0] else E,
                0 if not self.has_bias else 1 if self.stacked[1] else E)

    def unpack(self, flat):
        """(inputs, weights, biases, FP8 weights, delayed state, main_grads); weights and biases
        per expert (the views of a stacked one)."""
        E, (nx, nw, nb) = self.num_experts, self.counts()
        xs, flat = flat[:nx], flat[nx:]
        ws, flat = flat[:nw], flat[nw:]
        bs, flat = flat[:nb], flat[nb:]
        ws = tuple(ws[0].unbind(0)) if self.stacked[0] else ws
        bs = tuple(bs[0].unbind(0)) if bs and self.stacked[1] else bs
        nwq = 0 if not self.fp8 else 4 if self.block else 3   # (data, data_t, scale_inv[, _t])
        wq, flat = flat[:nwq], flat[nwq:]
        state, flat = (flat[:4], flat[4:]) if self.delayed else ((), flat)
        main_grads = flat[:E] if self.fuse_wgrad else ()
        return xs, ws, bs, wq, state, main_grads

    def expert_rows(self, xs, m_splits) -> list:
        """The per-expert inputs: the list as given, or the one tensor split by ``m_splits``."""
        return list(xs) if self.list_mode else _split(xs[0], m_splits)


def num_e4m3(recipe, num_experts: int) -> int:
    """How many of the 3 E scaling slots (inputs, weights, grad outputs) are E4M3."""
    return (3 if recipe.fp8_format.backward == "e4m3" else 2) * num_experts


def update_scales(state, count: int, groups: tuple, num_e4m3: int, amax_compute_algo: str,
                  margin: int, cast_backend: str) -> None:
    """The delayed-scaling update of the first ``count`` tensors of ``state`` (history, amax,
    scale, scale_inv): their amaxes all-reduced (max) over each of ``groups`` in turn (over a
    grid of groups, the max over all their ranks), then one launch for all of them."""
    history, amax, scale, scale_inv = state
    for group in groups:
        import torch.distributed as dist

        dist.all_reduce(amax[:count], op=dist.ReduceOp.MAX, group=group)
    cops.eager.scale_update(history, amax, scale, scale_inv, num_e4m3, amax_compute_algo, margin,
                            count, cast_backend)


def _split(t: torch.Tensor, m_splits) -> list[torch.Tensor]:
    return list(torch.split(t, list(m_splits)))


class _WgradStore:
    """The weight-gradient computations that backward deferred (``delay_wgrad_compute``), oldest
    first. Compared and hashed by identity (it sits in the hashable :class:`_Config`)."""

    __slots__ = ("_pending",)

    def __init__(self):
        self._pending = collections.deque()

    def put(self, fn) -> None:
        self._pending.append(fn)

    def pop(self):
        return self._pending.popleft()

    def __len__(self) -> int:
        return len(self._pending)


class _GroupedLinearFn(torch.autograd.Function):
    """apply(cfg, m_splits, *xs, *weights, *biases, *fp8 weights, *delayed state, *main_grads
    [, row_index]); weights and biases are E tensors each, or one ``(E, ...)`` tensor each with
    ``cfg.stacked`` (:meth:`_Config.counts`)."""

    @staticmethod
    def forward(ctx, cfg: _Config, m_splits: tuple, *flat):
        xs, ws, bs, wq, state, main_grads = cfg.unpack(flat)
        E = cfg.num_experts
        # the fused permute (FP8, the default backward only): the cast gathers the rows itself
        row_index = flat[-1] if cfg.gather else None
        # one tensor and its counts where the cast takes them so (the per-tensor FP8 cast: no
        # per-expert views made and read back), else the experts' rows as a list
        whole = cfg.fp8 and not cfg.block and (cfg.gather or not cfg.list_mode)
        x_list = [xs[0]] if cfg.gather or whole else cfg.expert_rows(xs, m_splits)
        nx, nw, _ = cfg.counts()
        need_dgrad = any(ctx.needs_input_grad[2:2 + nx])
        need_wgrad = any(ctx.needs_input_grad[2 + nx:2 + nx + nw])
        ctx.cfg, ctx.m_splits = cfg, m_splits
        ctx.x_dtype, ctx.w_dtype = xs[0].dtype, ws[0].dtype
        ctx.b_dtype = bs[0].dtype if bs else None
        ctx.main_grads = main_grads
        # the weight parameters themselves (one when stacked): their Megatron attributes
        ctx.ws = flat[nx:nx + nw] if cfg.fuse_wgrad else ()
        if not cfg.fp8:
            # weights in another dtype than the input (torch.autocast): computed in the input's
            # dtype, their grads returned in their own
            wc = [w if w.dtype == xs[0].dtype else w.to(xs[0].dtype) for w in ws]
            ys = [torch.addmm(b, x, w.t()) if bs else x @ w.t()
                  for x, w, b in zip(x_list, wc, bs if bs else [None] * E)]
            y = torch.cat(ys) if E > 1 else ys[0]
            ctx.nx_saved = len(xs) if need_wgrad else 0
            ctx.save_for_backward(*(xs if need_wgrad else ()), *wc)
            return y
        _, amax, scale, _ = state if state else (None,) * 4
        mode = cfg.bwd_mode
        # what backward gets of the input: "orig" (the input itself: save_original_input, or a
        # wgrad in high precision), "rows" (the row-wise FP8 copy fprop used: "dequantized"), or
        # "t" (the transposed FP8 copy wgrad reads: the default)
        x_kind = "rows" if mode == "dequantized" else "orig" if (
            cfg.save_original_input or mode in ("hp_wgrad", "high_precision")) else "t"
        # delayed scaling: this forward's input amaxes are max-merged into the pending amax that
        # the next scale update rolls in (forwards may run ahead of their backwards)
        if cfg.block:   # block scales: each copy has its own (x_si_t, w_si_t: the transposed's)
            x_data, x_t, x_si, x_si_t, _ = cops.eager.fp8_block_quantize(
                x_list, cfg.fmt_fwd, cfg.block[0], cops.token_align(cfg.block[0]), True, need_wgrad,
                cfg.cast_backend,
                *cfg.q_inp, row_index, list(m_splits) if cfg.gather else None, False,
                cfg.activation)
            w_data, w_t, w_si, w_si_t = wq
        else:
            x_data, x_t, x_si, _ = cops.eager.fp8_quantize(
                x_list, cfg.fmt_fwd, cfg.margin, FP8_ALIGN, True, need_wgrad and x_kind == "t",
                False, scale, amax if cfg.grad_enabled else None, INPUT * E, cfg.cast_backend,
                True, *cfg.q_inp, row_index, list(m_splits) if whole else None,
                cfg.activation)
            w_data, w_t, w_si = wq
            x_si_t, w_si_t = x_si, w_si
        y = cops.eager.fp8_fprop(x_data, x_si, cfg.fmt_fwd, w_data, w_si, cfg.fmt_fwd,
                                 list(bs) if cfg.fuse_bias else [], list(m_splits), xs[0].dtype,
                                 cfg.fast_accum[0], *cfg.block[:2])
        if bs and not cfg.fuse_bias:
            for part, b in zip(_split(y, m_splits), bs):
                part.add_(b)
        if cfg.delayed and cfg.grad_enabled and not (
                need_dgrad or need_wgrad or (bs and ctx.needs_input_grad[2 + nx + nw])):
            # no backward will run: fold this step's input and weight amaxes in now (under
            # no_grad nothing is: evaluation leaves the scales alone, as in TransformerEngine)
            update_scales(state, 2 * E, cfg.amax_group, cfg.num_e4m3, cfg.amax_compute_algo,
                          cfg.margin, cfg.cast_backend)
        if not need_wgrad:
            x_kind, x_saved = "t", (x_t, x_si_t)               # empty: nothing kept
        else:
            x_saved = {"orig": xs, "rows": (x_data, x_si), "t": (x_t, x_si_t)}[x_kind]
        # the weights: "t" (transposed FP8, for the FP8 dgrad), "rows" (dequantized), "orig"
        w_saved = (w_t, w_si_t) if mode in ("fp8", "hp_wgrad") else () if not need_dgrad else \
            ws if mode == "high_precision" else (w_data, w_si)
        ctx.state, ctx.x_kind, ctx.nx_saved = state, x_kind, len(x_saved)
        ctx.num_tokens = xs[0].shape[0]
        # the activation's inputs, for its gradient (last: never with the gather)
        pre = xs if cfg.activation is not None and need_dgrad else ()
        ctx.n_pre = len(pre)
        ctx.save_for_backward(*x_saved, *w_saved, *((row_index,) if cfg.gather else ()), *pre)
        return y

    @staticmethod
    def backward(ctx, dy):
        cfg, m_splits = ctx.cfg, ctx.m_splits
        E, k, n = cfg.num_experts, cfg.k, cfg.n
        nx, nw, nb = cfg.counts()
        need_dgrad = any(ctx.needs_input_grad[2:2 + nx])
        # the experts whose weight gradient this backward produces: those that need one and,
        # with side effects (main_grad written, a wgrad queued), whose AccumulateGrad the engine
        # runs (torch.autograd.grad(y, x) or backward(inputs=...) may leave some or all out)
        wanted = list(ctx.needs_input_grad[2 + nx:2 + nx + nw]) * (E // nw)
        if cfg.grad_accs:
            wanted = [w and (a is None or _engine_will_execute(a))
                      for w, a in zip(wanted, cfg.grad_accs)]
        need_wgrad = any(wanted)
        need_dbias = cfg.has_bias and any(ctx.needs_input_grad[2 + nx + nw:2 + nx + nw + nb])
        dy = dy.contiguous()
        # the per-tensor FP8 cast takes dy whole with its counts (as the forward's input): the
        # experts' views are made only for what reads them (a high-precision or block path)
        dy_list = [] if cfg.fp8 and not cfg.block and cfg.bwd_mode == "fp8" else \
            _split(dy, m_splits)
        dx = dws = dbs = wgrad_fn = None
        main_grads, acc, w_dtype = list(ctx.main_grads), cfg.accumulate_main_grad, ctx.w_dtype
        if cfg.fuse_wgrad and need_wgrad:
            # Megatron-FSDP allocates main_grad before backward (lazy); an expert without a
            # wgrad here (frozen, or left out by autograd) gets a scratch output instead
            if cfg.lazy_main_grad and cfg.stacked[0]:     # one (E, n, k) main_grad
                whole = _check_main_grad(None, ctx.ws[0], ctx.ws[0].get_main_grad())
                main_grads = [g if want else None for g, want in zip(whole.unbind(0), wanted)]
            elif cfg.lazy_main_grad:
                main_grads = [_check_main_grad(i, w, w.get_main_grad()) if wanted[i] else None
                              for i, w in enumerate(ctx.ws)]
            else:
                main_grads = [g if want else None for g, want in zip(main_grads, wanted)]
            g_dtype = main_grad_dtype(main_grads)
            main_grads = [g if g is not None else torch.empty((n, k), dtype=g_dtype,
                                                              device=dy.device)
                          for g in main_grads]
        x_dtype = ctx.x_dtype

        def hp_wgrad(x_list):
            """wgrad from high-precision operands (no FP8, or a backward override)."""
            if cfg.fuse_wgrad:
                cops.eager.wgrad_main_grad(x_list, dy_list, main_grads, acc)
                return None
            return [(d.t() @ x).to(w_dtype) for d, x in zip(dy_list, x_list)]

        saved = ctx.saved_tensors
        if cfg.activation is not None and ctx.n_pre:
            saved, pre = saved[:-ctx.n_pre], saved[-ctx.n_pre:]
        if cfg.gather:
            saved, row_index = saved[:-1], saved[-1]
        if not cfg.fp8 or cfg.bwd_mode in ("high_precision", "dequantized"):
            # everything in the activation dtype: the plain path, or current scaling's backward
            # overrides (the original operands, or the forward's FP8 operands dequantized)
            xs, ws = saved[:ctx.nx_saved], saved[ctx.nx_saved:]
            # (without dgrad the overrides' forward kept no weights)
            if cfg.fp8 and cfg.bwd_mode == "high_precision":
                ws = [w.to(x_dtype) for w in ws]
            elif cfg.fp8 and need_dgrad:                   # "dequantized"
                ws = _dequantize(ws[0], ws[1], cfg.fmt_fwd, [n] * E, x_dtype)
            if need_dgrad:
                parts = [d @ w for d, w in zip(dy_list, ws)]
                dx = torch.cat(parts) if E > 1 else parts[0]
            if need_wgrad:
                if cfg.fp8 and cfg.bwd_mode == "dequantized":
                    x_list = _dequantize(xs[0], xs[1], cfg.fmt_fwd, m_splits, x_dtype)
                else:
                    x_list = cfg.expert_rows(xs, m_splits)
                wgrad_fn = functools.partial(hp_wgrad, x_list)
            if need_dbias:
                dbs = [d.sum(0) for d in dy_list]
        else:
            xs, (w_t, w_si) = saved[:ctx.nx_saved], saved[ctx.nx_saved:]
            x_kind = ctx.x_kind
            fp8_wgrad = need_wgrad and cfg.bwd_mode == "fp8"
            _, amax, scale, _ = ctx.state if ctx.state else (None,) * 4
            if cfg.block:
                dy_data, dy_t, dy_si, dy_si_t, colsum = cops.eager.fp8_block_quantize(
                    dy_list, cfg.fmt_bwd, cfg.block[2], cops.token_align(cfg.block[2]),
                    need_dgrad or not fp8_wgrad,
                    fp8_wgrad, cfg.cast_backend, *cfg.q_grad, None, None, need_dbias)
            else:
                dy_data, dy_t, dy_si, colsum = cops.eager.fp8_quantize(
                    [dy], cfg.fmt_bwd, cfg.margin, FP8_ALIGN, need_dgrad or not fp8_wgrad,
                    fp8_wgrad, need_dbias, scale, amax, GRAD_OUTPUT * E, cfg.cast_backend, False,
                    *cfg.q_grad, None, list(m_splits))
                dy_si_t = dy_si
            if cfg.delayed:   # one launch: every tensor of every expert
                update_scales(ctx.state, 3 * E, cfg.amax_group, cfg.num_e4m3,
                              cfg.amax_compute_algo, cfg.margin, cfg.cast_backend)
            if need_dgrad:
                dx = cops.eager.fp8_dgrad(dy_data, dy_si, cfg.fmt_bwd, w_t, w_si, cfg.fmt_fwd,
                                          k, list(m_splits), x_dtype, cfg.fast_accum[1],
                                          *(cfg.block[2:3] + cfg.block[1:2]))
            if need_wgrad and not fp8_wgrad:        # override_linear_precision: wgrad in high
                wgrad_fn = functools.partial(hp_wgrad, cfg.expert_rows(xs, m_splits))  # precision
            elif need_wgrad:
                def _wgrad():
                    if x_kind == "orig":
                        # save_original_input (current scaling only): the same amax, scale and
                        # bits as the forward's cast would have given
                        _, xt, xsi, _ = cops.eager.fp8_quantize(
                            cfg.expert_rows(xs, m_splits), cfg.fmt_fwd, cfg.margin, FP8_ALIGN,
                            False, True, False, None, None, 0, cfg.cast_backend, False,
                            *cfg.q_inp)
                    else:
                        xt, xsi = xs
                    blocks = cfg.block[0:1] + cfg.block[2:3]      # (input, grad) or ()
                    if cfg.fuse_wgrad:
                        cops.eager.fp8_wgrad_main_grad(xt, xsi, cfg.fmt_fwd, dy_t, dy_si_t,
                                                       cfg.fmt_bwd, k, n, list(m_splits),
                                                       main_grads, acc, cfg.fast_accum[2],
                                                       *blocks)
                        return None
                    return cops.eager.fp8_wgrad(xt, xsi, cfg.fmt_fwd, dy_t, dy_si_t, cfg.fmt_bwd,
                                                k, n, list(m_splits), w_dtype, cfg.fast_accum[2],
                                                *blocks)                  # (E, n, k)
                wgrad_fn = _wgrad
            if need_dbias:
                dbs = colsum.to(ctx.b_dtype)                              # (E, n)
        if dbs is not None:            # a stacked bias gets one (E, n) gradient
            dbs = [_stacked(dbs)] if cfg.stacked[1] else list(dbs)
        if wgrad_fn is not None:
            # the weights' gradient: one (E, n, k) tensor when stacked, else one per expert
            wgrad_fn = functools.partial(_weight_grads, wgrad_fn, cfg.stacked[0])
            if cfg.wgrad_store is not None:
                cfg.wgrad_store.put((wgrad_fn, wanted))   # GroupedLinear.backward_dw() runs it
            else:
                dws = wgrad_fn()
                if dws is not None and cfg.stacked[0]:
                    dws = [dws if wanted[0] else None]
                elif dws is not None:
                    dws = [g if want else None for g, want in zip(dws, wanted)]
        if cfg.fuse_wgrad and need_wgrad:
            # TransformerEngine's contract with Megatron: a weight that carries the
            # grad_added_to_main_grad attribute gets it set and an (uninitialised) dummy gradient,
            # so that its grad-accumulation hook fires; any other weight gets None. A fresh
            # tensor per weight: AccumulateGrad steals it (a shared one would be copied).
            dws = [None] * nw          # one parameter per weight input (all experts' if stacked)
            for i, w in enumerate(ctx.ws):
                if wanted[i] and hasattr(w, "grad_added_to_main_grad"):
                    w.grad_added_to_main_grad = True
                    # zeros where Megatron adds the dummy into main_grad anyway
                    dws[i] = (torch.zeros_like if getattr(w, "zero_out_wgrad", False)
                              else torch.empty_like)(w)
        dxs = [None] * nx
        if dx is not None and cfg.gather:      # back to the tokens: the permute's adjoint
            dxs = [scatter_rows(dx, row_index, ctx.num_tokens)]
        elif dx is not None and cfg.activation is not None:     # through the activation
            parts = _split(dx, m_splits) if cfg.list_mode else [dx]
            dxs = [swiglu_backward(x, d) for x, d in zip(pre, parts)]
        elif dx is not None:
            dxs = _split(dx, m_splits) if cfg.list_mode else [dx]
        grads = [None, None, *dxs, *(dws if dws is not None else [None] * nw)]
        if cfg.has_bias:
            grads += dbs if dbs is not None else [None] * nb
        grads += [None] * (len(ctx.needs_input_grad) - len(grads))
        return tuple(grads)


MAIN_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` over the halves ``[a | b]`` of the last dim, in torch (Megatron's gated
    linear unit): what :class:`GroupedLinear` computes when its cast cannot apply the activation."""
    a, b = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(a) * b


def swiglu_backward(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`swiglu` at ``x`` (``(m, 2k)``) for the output gradient ``g``
    (``(m, k)``): ``[silu'(a) * (g * b) | g * silu(a)]``, computed as torch's autograd computes
    it for ``F.silu(a) * b`` (the same ops, in ``x``'s dtype: the same bits, and the same
    memory traffic as the unfused layer's backward)."""
    a, b = x.chunk(2, dim=-1)
    ga = torch.ops.aten.silu_backward(g * b, a)
    return torch.cat([ga, g * torch.nn.functional.silu(a)], dim=-1)


def _stacked(g) -> torch.Tensor:
    """Per-expert gradients as one tensor: as they are when already one, else stacked."""
    return g if isinstance(g, torch.Tensor) else torch.stack(list(g))


def _weight_grads(wgrad_fn, stacked: bool):
    """``wgrad_fn()``'s weight gradients (None: written into main_grad) as the weights came in:
    one ``(E, n, k)`` tensor when stacked (the FP8 GEMM's own output, not copied), else a list."""
    g = wgrad_fn()
    if g is None:
        return None
    return _stacked(g) if stacked else list(g)


def _check_main_grad(i: int | None, w: torch.Tensor, g) -> torch.Tensor:
    """Megatron's ``main_grad``: float32, or 16-bit (``grad_reduce_in_fp32=False`` keeps it in
    the parameters' dtype); the GEMM accumulates into it in float32 and rounds once. ``i`` None:
    the single grouped ``weight``."""
    if not isinstance(g, torch.Tensor) or g.dtype not in MAIN_GRAD_DTYPES or g.shape != w.shape \
            or g.device != w.device:
        name = "weight" if i is None else f"weight{i}"
        raise ValueError(f"{name}.main_grad: fuse_wgrad_accumulation=True needs a float32, "
                         f"bfloat16 or float16 tensor of shape {tuple(w.shape)} on {w.device} "
                         f"(got {None if g is None else (g.dtype, tuple(g.shape))})")
    return g


def main_grad_dtype(main_grads) -> torch.dtype:
    """The one dtype of the experts' ``main_grad`` tensors (None entries skipped; float32 if
    there are none): one grouped GEMM writes them all."""
    dtypes = {g.dtype for g in main_grads if g is not None}
    if len(dtypes) > 1:
        raise ValueError(f"main_grad: every expert's main_grad must have the same dtype, got "
                         f"{sorted(str(d) for d in dtypes)}")
    return dtypes.pop() if dtypes else torch.float32


def _engine_will_execute(node) -> bool:
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        # torch.autograd.grad() asked for this leaf itself ("not supported" for leaves it
        # captures): it does want the gradient
        return True


def _dequantize(data: torch.Tensor, scale_inv: torch.Tensor, fmt: str, rows, dtype) -> list:
    """Row-wise FP8 bytes ``(Σ rows, k)`` with one ``scale_inv`` per block of rows -> the blocks
    in ``dtype`` (float32 products, rounded once, as TransformerEngine's dequantize)."""
    f8 = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    return [(part.view(f8).float() * si).to(dtype)
            for part, si in zip(_split(data, rows), scale_inv.unbind(0))]
