"""An expert-parallel mixture-of-experts feed-forward block: ``GroupedLinear`` as each rank's
local expert compute, ``torch.distributed`` all-to-alls to move the tokens.

::

    import os
    import torch, torch.distributed as dist
    from cugrouped.pytorch import fp8_autocast, DelayedScaling
    from cugrouped.pytorch.moe import MoEFeedForward

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))   # one GPU per rank (torchrun sets it)
    dist.init_process_group("nccl")               # experts sharded over the world (or group=...)
    moe = MoEFeedForward(hidden_size=1024, ffn_hidden_size=2048, num_experts=64, top_k=2,
                         params_dtype=torch.bfloat16, device="cuda")
    with fp8_autocast(fp8_recipe=DelayedScaling()):
        y = moe(x)                                 # x: (..., hidden_size) -> y: same shape

One forward, on every rank of the expert-parallel group (``W`` ranks, ``L = E / W`` local
experts; rank ``r`` owns global experts ``r·L .. r·L + L - 1``):

1. route: ``softmax(x · W_rᵀ (+ b_r))`` over the E experts, top-k, optionally renormalised;
2. permute: the ``T·k`` (token, slot) rows sorted stably by (local expert ``l``, destination rank
   ``r``) of their global expert ``e = r·L + l`` (:func:`plan_routing`, :func:`permute_tokens`);
3. exchange the token counts: one ``all_to_all_single`` of E int64 counts, then one host sync
   (``tolist()``: the collectives' split sizes and the grouped GEMMs need host counts);
4. dispatch (``all_to_all="per_expert"``, the default; ``"single"`` is below): for each local
   expert ``l`` one ``all_to_all_single`` whose input is the
   (contiguous) rows for slot ``l`` of every rank and whose output is a slice of one receive
   buffer. Expert ``l``'s rows from all source ranks therefore arrive contiguous, in source-rank
   order, and the per-expert list handed to ``GroupedLinear`` is ``recv.split(m_splits)``: views,
   no regrouping copy (with ``L = 1`` this is one collective);
5. experts: ``GroupedLinear`` (fc1) -> activation -> ``GroupedLinear`` (fc2) on the list;
6. combine: the reverse all-to-alls (fc2's per-expert outputs are their inputs);
7. unpermute: back to (token, slot) order by the inverse permutation, weighted by the router
   probabilities and summed over the k slots (a gather and a sum: deterministic, no atomics).

With ``all_to_all="single"`` steps 4 and 6 are one collective each (rows permuted by (rank,
local expert) in step 2), and the received rows are regrouped by expert with one copy (and the
outputs back by source rank), as Megatron-LM's dispatcher does: fewer collectives for more
copying, the same bits.

With ``W = 1`` (no process group, or a group of one) steps 3, 4 and 6 are plain splits.

Global token order on the expert side is the order of the single-process block run on the ranks'
tokens concatenated in rank order, so each expert sees exactly the same rows in the same order as
there: outputs and expert gradients equal the single-process block's bit for bit, FP8 included.

Gradients: both all-to-alls are autograd functions (the backward runs the reverse exchange). The
router is replicated: its gradient on each rank covers that rank's tokens only, and must be summed
(or averaged) over the data-parallel ranks like any replicated parameter (DDP or FSDP do this).
The experts' gradients are complete on their owner rank.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from .fp8_state import select_experts
from .grouped_linear import GroupedLinear, check_params_args
from .recipe import BLOCK_RECIPES, Float8BlockScaling, get_fp8_recipe

# Float8BlockScaling's padding of each expert's rows (kept for importers; each block recipe
# carries its own as ``token_padding``: 16 here, 32 for MXFP8BlockScaling).
BLOCK_SCALING_TOKEN_ALIGN = Float8BlockScaling.token_padding


def _token_align() -> int:
    """The multiple each expert's rows are padded to under the active FP8 recipe (1: none): the
    block recipes' GEMMs need token counts in multiples of 8 (Float8BlockScaling; rows padded to
    16 as TransformerEngine's Fp8Padding does) or 32 (MXFP8BlockScaling: a whole scale block)."""
    recipe = get_fp8_recipe()
    return recipe.token_padding if isinstance(recipe, BLOCK_RECIPES) else 1


def _padded_rows(m_splits: Sequence[int], counts: torch.Tensor, align: int
                 ) -> tuple[list[int], torch.Tensor]:
    """The host counts padded to ``align``, and the padded row of each real row (in order: the
    real rows of expert ``e`` start at its padded offset), computed where ``counts`` (the same
    counts, on the device) live: no sync, no host-to-device copy of per-row data."""
    padded = [-(-m // align) * align for m in m_splits]
    rows = sum(m_splits)
    pad = (-counts) % align
    shift = torch.cumsum(pad, 0) - pad
    dest = torch.arange(rows, dtype=torch.int64, device=counts.device) + torch.repeat_interleave(
        shift, counts, output_size=rows)
    return padded, dest


def _regroup_index(recv: torch.Tensor, ranks: int, local: int, rows: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_index, where)`` of the single all-to-all's regroup: ``recv[s·L + l]`` (on the
    device) rows came from rank ``s`` for local expert ``l``, received by source rank; grouped
    by expert, row ``g`` is received row ``row_index[g]``, and received row ``r`` is grouped row
    ``where[r]``. Computed where ``recv`` lives from it and host ints alone (``rows``: its sum):
    no host-to-device copy, so no stream sync (a pageable copy in torch waits for the stream)."""
    counts = recv.view(ranks, local)
    recv_start = (torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)).view(ranks, local)
    grp_sizes = counts.t().reshape(-1)                        # [l·W + s]
    # chunk (s, l) starts at recv_start[s, l] received and at grp_start[l, s] grouped; each
    # grouped row is its received row shifted by the difference
    shift = recv_start.t().reshape(-1) - (torch.cumsum(grp_sizes, 0) - grp_sizes)
    row_index = torch.arange(rows, dtype=torch.int64, device=recv.device) + \
        torch.repeat_interleave(shift, grp_sizes, output_size=rows)
    where = torch.empty_like(row_index).index_copy_(
        0, row_index, torch.arange(rows, dtype=torch.int64, device=recv.device))
    return row_index, where

__all__ = ["MoEFeedForward", "TopKRouter", "RoutingPlan", "plan_routing", "permute_tokens",
           "unpermute_tokens", "all_to_all_chunks", "shard_state_dict", "ACTIVATIONS"]

ACTIVATIONS = ("swiglu", "geglu", "silu", "gelu", "relu")
_GATED = {"swiglu": F.silu, "geglu": F.gelu}
_PLAIN = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


# ---------------------------------------------------------------------------------------------
# Routing and token permutation (pure functions of tensors; one process)

class TopKRouter(torch.nn.Module):
    """Softmax gate over ``num_experts``, top-k (replicated on every expert-parallel rank).

    ``forward(x (T, hidden))`` -> ``(probs (T, k), expert_ids (T, k) int64)``. Scores are computed
    in float32 or wider (``softmax(logits)`` over all experts, then top-k, Mixtral / Qwen style);
    ``normalize_topk=True`` rescales each token's k probabilities to sum to 1.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, normalize_topk: bool = True,
                 bias: bool = False, params_dtype: torch.dtype | None = None, device="cuda"):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k: expected 1 <= top_k <= num_experts={num_experts}, got {top_k}")
        self.num_experts, self.top_k, self.normalize_topk = num_experts, top_k, normalize_topk
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = torch.nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype,
                                                     device=device))
        self.bias = torch.nn.Parameter(torch.zeros(num_experts, dtype=dtype, device=device)) \
            if bias else None
        torch.nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)
        scores = logits.softmax(-1, dtype=torch.promote_types(logits.dtype, torch.float32))
        probs, expert_ids = torch.topk(scores, self.top_k, dim=-1)
        if self.normalize_topk and self.top_k > 1:
            probs = probs / probs.sum(-1, keepdim=True)
        return probs, expert_ids

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"normalize_topk={self.normalize_topk}, bias={self.bias is not None}")


@dataclasses.dataclass(frozen=True)
class RoutingPlan:
    """Where each (token, slot) row goes. ``T·k`` rows, slot ``s = token·k + j``.

    ``sort_idx[i]``: the slot held by row ``i`` of the permuted buffer; ``inverse[s]``: the row of
    the permuted buffer holding slot ``s``; ``tokens_per_expert``: ``(E,)`` int64 counts in global
    expert order. Rows are sorted stably by ``(e % L, e // L)`` (local expert, owner rank) for
    ``L = E / ep_size`` local experts (``order="expert_major"``), or by ``e`` itself (owner
    rank, local expert: ``order="rank_major"``, one all-to-all's send order); with
    ``ep_size = 1`` both are simply by expert.
    """

    sort_idx: torch.Tensor
    inverse: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_tokens: int
    top_k: int
    ep_size: int

    def send_counts(self, counts: Sequence[int]) -> list[list[int]]:
        """Host counts ``(E,)`` in global order -> ``[l][r]``: rows for local expert slot ``l`` of
        rank ``r`` (the permuted buffer's block order)."""
        W = self.ep_size
        L = len(counts) // W
        return [[counts[r * L + l] for r in range(W)] for l in range(L)]


def plan_routing(expert_ids: torch.Tensor, num_experts: int, ep_size: int = 1,
                 order: str = "expert_major") -> RoutingPlan:
    """The permutation of the ``(T, k)`` routed slots into per-(local expert, rank) blocks
    (``order="expert_major"``) or per-(rank, local expert) blocks (``"rank_major"``)."""
    if order not in ("expert_major", "rank_major"):
        raise ValueError(f"order: expected 'expert_major' or 'rank_major', got {order!r}")
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids: expected (tokens, top_k), got shape {tuple(expert_ids.shape)}")
    if num_experts % ep_size:
        raise ValueError(f"num_experts: expected a multiple of ep_size={ep_size}, got {num_experts}")
    T, k = expert_ids.shape
    L = num_experts // ep_size
    flat = expert_ids.reshape(-1)
    rank_major = order == "rank_major" or ep_size == 1
    key = flat if rank_major else (flat % L) * ep_size + flat // L
    sort_idx = torch.argsort(key, stable=True)
    inverse = torch.empty_like(sort_idx)
    inverse[sort_idx] = torch.arange(sort_idx.numel(), device=sort_idx.device)
    # Counts from the sorted keys (run boundaries by searchsorted), not torch.bincount: on CUDA
    # bincount reads the input's min and max back to the host (two syncs per forward).
    # Key l·W + r holds expert e = r·L + l (expert-major), key e does (rank-major).
    bounds = torch.searchsorted(key[sort_idx], torch.arange(num_experts + 1, device=key.device))
    counts = bounds[1:] - bounds[:-1]
    tokens_per_expert = counts if rank_major else counts.view(L, ep_size).t().reshape(-1)
    return RoutingPlan(sort_idx, inverse, tokens_per_expert, T, k, ep_size)


class _Permute(torch.autograd.Function):
    """``x[sort_idx // k]``, with a deterministic backward (gather + sum over the k slots instead
    of the scatter-add ``index_select`` would use)."""

    @staticmethod
    def forward(ctx, x, sort_idx, inverse, k):
        ctx.save_for_backward(inverse)
        ctx.k, ctx.num_tokens = k, x.shape[0]
        return x.index_select(0, sort_idx // k)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        g = grad.index_select(0, inverse)
        return g.view(ctx.num_tokens, ctx.k, *grad.shape[1:]).sum(1), None, None, None


def permute_tokens(x: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """``(T, hidden)`` -> ``(T·k, hidden)``: each token copied once per routed slot, in the
    plan's (local expert, rank) block order."""
    if x.shape[0] != plan.num_tokens:
        raise ValueError(f"x: expected {plan.num_tokens} rows (the plan's tokens), got {x.shape[0]}")
    return _Permute.apply(x, plan.sort_idx, plan.inverse, plan.top_k)


def unpermute_tokens(y: torch.Tensor, plan: RoutingPlan, probs: torch.Tensor,
                     inverse: torch.Tensor | None = None) -> torch.Tensor:
    """``(T·k, hidden)`` in the plan's order -> ``(T, hidden)``: ``Σ_j probs[t, j] · y[slot t·k+j]``
    (products in the wider of the two dtypes, result in ``y``'s dtype). ``inverse`` (the row of
    ``y`` holding each slot) replaces ``plan.inverse`` when ``y`` has extra rows (padding)."""
    T, k = plan.num_tokens, plan.top_k
    if (y.shape[0] != T * k and inverse is None) or tuple(probs.shape) != (T, k):
        raise ValueError(f"y, probs: expected ({T * k}, hidden) and ({T}, {k}), got "
                         f"{tuple(y.shape)} and {tuple(probs.shape)}")
    slots = y.index_select(0, plan.inverse if inverse is None else inverse).view(
        T, k, *y.shape[1:])
    return (slots * probs.unsqueeze(-1)).sum(1).to(y.dtype)


# ---------------------------------------------------------------------------------------------
# All-to-all with autograd

def _all_to_all_chunks(chunks, in_splits, out_splits, group) -> torch.Tensor:
    import torch.distributed as dist

    totals = [sum(s) for s in out_splits]
    first = chunks[0]
    out = first.new_empty((sum(totals), *first.shape[1:]))
    for x, o, si, so in zip(chunks, out.split(totals), in_splits, out_splits):
        dist.all_to_all_single(o, x.contiguous(), output_split_sizes=list(so),
                               input_split_sizes=list(si), group=group)
    return out


class _AllToAllChunks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, in_splits, out_splits, *chunks):
        ctx.group, ctx.in_splits, ctx.out_splits = group, in_splits, out_splits
        return _all_to_all_chunks(chunks, in_splits, out_splits, group)

    @staticmethod
    @torch.autograd.function.once_differentiable     # the reverse exchange records no graph
    def backward(ctx, grad):
        totals = [sum(s) for s in ctx.out_splits]
        g = _all_to_all_chunks(grad.contiguous().split(totals), ctx.out_splits, ctx.in_splits,
                               ctx.group)
        return (None, None, None, *g.split([sum(s) for s in ctx.in_splits]))


def all_to_all_chunks(chunks: Sequence[torch.Tensor], in_splits: Sequence[Sequence[int]],
                      out_splits: Sequence[Sequence[int]], group=None) -> torch.Tensor:
    """One ``all_to_all_single`` per chunk, differentiable; the outputs are laid end to end.

    ``chunks[c]`` has ``sum(in_splits[c])`` rows, ``in_splits[c][r]`` of them for rank ``r``; the
    result holds, for each ``c`` in turn, ``out_splits[c][r]`` rows from each rank ``r``. The
    backward runs the reverse exchange (splits swapped). Every rank of ``group`` must call it with
    the same number of chunks (collectives are issued in chunk order).

    (``torch.distributed.nn.functional.all_to_all_single`` does the one-chunk case, but torch 2.13
    deprecates it with a FutureWarning in favour of ``_functional_collectives``, a private module.)
    """
    if not chunks or len(in_splits) != len(chunks) or len(out_splits) != len(chunks):
        raise ValueError(f"in_splits, out_splits: expected one list per chunk ({len(chunks)}), got "
                         f"{len(in_splits)} and {len(out_splits)}")
    return _AllToAllChunks.apply(group, tuple(map(tuple, in_splits)),
                                 tuple(map(tuple, out_splits)), *chunks)


# ---------------------------------------------------------------------------------------------
# The block

def _group_rank_size(group) -> tuple[int, int]:
    import torch.distributed as dist

    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


_EXPERT_KEY = re.compile(r"^(?P<pre>.*?(?:fc1|fc2)\.(?:weight|bias))(?P<i>\d+)$")


def shard_state_dict(global_state: Mapping[str, torch.Tensor], num_experts: int, ep_rank: int,
                     ep_size: int, prefix: str = "") -> dict:
    """The state dict of rank ``ep_rank``'s shard from a block with all ``num_experts`` experts.

    ``fc1.weight{e}`` (and ``bias``, ``fc2``) for ``e`` in ``ep_rank·L .. ep_rank·L + L - 1``
    become ``fc1.weight{e - ep_rank·L}``; other experts are dropped; the router is kept as is.
    FP8 delayed-scaling extra state (per expert rows ``which·E + e``) is sliced the same way.
    Keys are taken under ``prefix`` (e.g. ``"layers.3.moe."``) and returned without it.
    """
    if num_experts % ep_size or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank, ep_size: expected 0 <= ep_rank < ep_size dividing num_experts="
                         f"{num_experts}, got {ep_rank}, {ep_size}")
    L = num_experts // ep_size
    lo = ep_rank * L
    out = {}
    for key, value in global_state.items():
        if not key.startswith(prefix):
            continue
        key = key[len(prefix):]
        m = _EXPERT_KEY.match(key)
        if m:
            e = int(m["i"])
            if lo <= e < lo + L:
                out[f"{m['pre']}{e - lo}"] = value
        elif key.endswith("._extra_state") and value is not None:
            out[key] = _shard_fp8_state(value, num_experts, lo, L)
        else:
            out[key] = value
    return out


def _shard_fp8_state(state, num_experts: int, lo: int, L: int):
    if not isinstance(state, dict):     # no FP8 state (TransformerEngine's empty uint8 tensor)
        return state
    if int(state["num_experts"]) != num_experts:
        raise ValueError(f"state_dict: FP8 extra state is for {state['num_experts']} experts, "
                         f"expected {num_experts}")
    return select_experts(state, lo, L)


class MoEFeedForward(torch.nn.Module):
    """Top-k routed experts ``fc2(act(fc1(x)))``, sharded over an expert-parallel process group.

    Parameters
    ----------
    hidden_size, ffn_hidden_size : int  the experts map hidden -> ffn -> hidden (multiples of 16
        for FP8; fc1 has ``2·ffn_hidden_size`` outputs for the gated activations).
    num_experts : int  E, a multiple of the group's size W; rank ``r`` holds experts
        ``r·E/W .. (r+1)·E/W - 1`` as ``fc1`` / ``fc2`` (``GroupedLinear`` with E/W gemms).
    top_k : int  experts per token.
    activation : one of ``ACTIVATIONS``: ``"swiglu"`` (``silu(a) · b`` over fc1's two halves
        ``[a | b]``, Megatron's gated linear unit), ``"geglu"``, or ``"silu"``, ``"gelu"``, ``"relu"``.
    normalize_topk : rescale each token's top-k probabilities to sum to 1.
    bias : per-expert biases in fc1 and fc2.  router_bias : a bias on the router logits.
    group : the expert-parallel ``torch.distributed`` process group; None: the world if
        torch.distributed is initialized, else a single process.
    params_dtype, device : of all parameters (default ``torch.get_default_dtype()``, ``"cuda"``).
    all_to_all : how tokens move with ``W > 1`` ranks and ``L > 1`` local experts.
        ``"per_expert"``: one all-to-all per local expert, each received straight into its
        expert's rows (``L`` collectives per exchange, no copy). ``"single"``: one all-to-all
        for all experts, whose received rows (ordered by source rank) are regrouped by expert
        with one copy, and the reverse before the combine (as Megatron-LM's dispatcher). Many
        local experts with few tokens each favour ``"single"`` (each collective has a fixed
        latency); measure on your interconnect. Both give the same bits.
    delay_wgrad_compute : backward leaves the experts' weight gradients to :meth:`backward_dw`
        (``GroupedLinear``'s option, on fc1 and fc2), e.g. to run them while the next layer's
        all-to-all is in flight. The all-to-alls here are issued on the current stream, so to
        overlap them call :meth:`backward_dw` under another stream (``torch.cuda.stream``,
        with the waits and ``record_stream`` that stream semantics need). The router's
        gradients are not deferred.
    fuse_permute : without expert parallelism (one rank), fc1 reads the tokens through the
        routing order (``GroupedLinear(..., row_index=)``): with FP8 the cast kernel gathers the
        rows, so the permuted copy of the tokens is never made. Same outputs; the input gradient
        is summed back in float32 in a fixed order (deterministic, no atomics), the same bits as
        the default block for ``top_k <= 2`` and within float32 summation order above.
        With ``W > 1`` the tokens are exchanged before the experts (their permute is the
        all-to-all's send order); with ``all_to_all="single"`` fc1 then reads the received rows
        through the experts' order, so the regrouped copy (and the padded one, under the block
        recipes) is never made either: the same bits as without.
    fuse_activation : with ``activation="swiglu"``, fc2 takes fc1's output as it is and applies
        the activation in its FP8 cast (``GroupedLinear(input_activation="swiglu")``: float32
        arithmetic, its high-precision output never written; with FP8 and the default backward:
        see ``GroupedLinear``'s ``input_activation``). False: ``F.silu(a) * b`` in torch first.

    ``forward(x)``: ``x (..., hidden_size)`` -> same shape. One host sync per forward (the token
    counts, as in Megatron's and torchtitan's dispatchers), none in backward (a block
    recomputed under :func:`~cugrouped.pytorch.checkpoint` repeats its forward, sync included,
    in backward). FP8 follows the
    enclosing :func:`~cugrouped.pytorch.fp8_autocast` (the experts only; the router stays in
    high precision). Under ``Float8BlockScaling`` each expert's rows are padded with zero rows
    to a multiple of 16 (its GEMMs need multiples of 8), under ``MXFP8BlockScaling`` of 32 (a
    whole scale block), as TransformerEngine's ``Fp8Padding`` does, and the padding is dropped
    after fc2; with
    ``fuse_permute`` the pad rows are index -1 of the permute, zero rows the cast kernel
    writes itself (no padded copy). With ``bias=True`` fc2's pad rows hold ``act(b1)``, not
    zeros (as with TransformerEngine's padding): they carry no gradient, but enter the block
    maxima of fc2's transposed input copy.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int = 2,
                 *, activation: str = "swiglu", normalize_topk: bool = True, bias: bool = False,
                 router_bias: bool = False, group=None, params_dtype: torch.dtype | None = None,
                 device="cuda", delay_wgrad_compute: bool = False,
                 all_to_all: str = "per_expert", fuse_permute: bool = False,
                 fuse_activation: bool = True):
        super().__init__()
        device = check_params_args(params_dtype, device)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
        if all_to_all not in ("per_expert", "single"):
            raise ValueError(f"all_to_all: expected 'per_expert' or 'single', got {all_to_all!r}")
        self.all_to_all = all_to_all
        if not isinstance(fuse_permute, bool):
            raise TypeError(f"fuse_permute: expected a bool, got {fuse_permute!r}")
        self.fuse_permute = fuse_permute
        if not isinstance(fuse_activation, bool):
            raise TypeError(f"fuse_activation: expected a bool, got {fuse_activation!r}")
        rank, size = _group_rank_size(group)
        if num_experts % size:
            raise ValueError(f"num_experts: expected a multiple of the expert-parallel group size "
                             f"{size}, got {num_experts}")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k, self.activation = num_experts, top_k, activation
        self.group, self.ep_rank, self.ep_size = group, rank, size
        self.num_local_experts = num_experts // size
        self.router = TopKRouter(hidden_size, num_experts, top_k, normalize_topk, router_bias,
                                 params_dtype, device)
        fc1_out = ffn_hidden_size * (2 if activation in _GATED else 1)
        L = self.num_local_experts
        self.fc1 = GroupedLinear(L, hidden_size, fc1_out, bias=bias, params_dtype=params_dtype,
                                 device=device, delay_wgrad_compute=delay_wgrad_compute)
        self.fc2 = GroupedLinear(L, ffn_hidden_size, hidden_size, bias=bias,
                                 params_dtype=params_dtype, device=device,
                                 delay_wgrad_compute=delay_wgrad_compute,
                                 input_activation="swiglu" if fuse_activation and
                                 activation == "swiglu" else None)

    def backward_dw(self) -> None:
        """The experts' deferred weight gradients of the oldest pending backward (fc2's, then
        fc1's, as Megatron's grouped MLP); a no-op without ``delay_wgrad_compute``."""
        self.fc2.backward_dw()
        self.fc1.backward_dw()

    @property
    def local_expert_ids(self) -> range:
        """Global ids of this rank's experts (``fc1.weight{i}`` is expert ``local_expert_ids[i]``)."""
        return range(self.ep_rank * self.num_local_experts,
                     (self.ep_rank + 1) * self.num_local_experts)

    def load_global_state_dict(self, global_state: Mapping[str, torch.Tensor], prefix: str = "",
                               strict: bool = True):
        """Load this rank's shard of the state dict of a block holding all experts (built with
        the same arguments in one process): the router, and the weights of
        :attr:`local_expert_ids`. See :func:`shard_state_dict`."""
        return self.load_state_dict(shard_state_dict(global_state, self.num_experts, self.ep_rank,
                                                     self.ep_size, prefix), strict=strict)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"activation={self.activation!r}, ep_rank={self.ep_rank}, ep_size={self.ep_size}")

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation in _GATED:
            a, b = h.chunk(2, dim=-1)
            return _GATED[self.activation](a) * b
        return _PLAIN[self.activation](h)

    def _fc2(self, h, m_splits=None):
        """fc2 of the activation of fc1's output ``h`` (one tensor with ``m_splits``, or a
        list): the activation is fc2's cast's when fc2 takes it (``input_activation``; a
        replaced fc2 may not), else computed here first."""
        if getattr(self.fc2, "input_activation", None) != self.activation:
            h = [self._act(t) for t in h] if isinstance(h, list) else self._act(h)
        return self.fc2(h) if m_splits is None else self.fc2(h, m_splits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected shape (..., hidden_size={self.hidden_size}), got "
                             f"{tuple(x.shape)}")
        dtype = self.router.weight.dtype
        if x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"x: dtype {x.dtype} differs from the parameters' {dtype} "
                            f"(params_dtype; under torch.autocast the input is cast instead)")
        shape = x.shape
        x = x.reshape(-1, self.hidden_size)
        probs, expert_ids = self.router(x)
        W, L = self.ep_size, self.num_local_experts
        single = self.all_to_all == "single" and W > 1 and L > 1
        plan = plan_routing(expert_ids, self.num_experts, self.ep_size,
                            "rank_major" if single else "expert_major")
        if W == 1 and self.fuse_permute:
            if x.shape[0] != plan.num_tokens:
                raise ValueError(f"x: expected {plan.num_tokens} rows, got {x.shape[0]}")
            m_splits = plan.tokens_per_expert.tolist()           # host sync
            row_index = plan.sort_idx // self.top_k
            align = _token_align()
            inverse = None
            if align > 1:      # pad rows: index -1, a zero row gathered by the cast kernel
                m_splits, dest = _padded_rows(m_splits, plan.tokens_per_expert, align)
                row_index = torch.full((sum(m_splits),), -1, dtype=torch.int64,
                                       device=x.device).index_copy_(0, dest, row_index)
                inverse = dest[plan.inverse]         # the combine reads around the pad rows
            h = self.fc1(x, m_splits, row_index=row_index)
            y_sorted = self._fc2(h, m_splits)
            return unpermute_tokens(y_sorted, plan, probs, inverse).reshape(shape)
        x_sorted = permute_tokens(x, plan)
        if W == 1:
            m_splits = plan.tokens_per_expert.tolist()           # host sync
            y = self._experts(list(x_sorted.split(m_splits)))
            y_sorted = torch.cat(y) if L > 1 else y[0]
        else:
            import torch.distributed as dist

            counts = plan.tokens_per_expert
            recv = torch.empty_like(counts)   # recv[s·L + l]: rows rank s sends to my expert l
            dist.all_to_all_single(recv, counts, group=self.group)
            host = torch.cat([counts, recv]).tolist()             # host sync
            if single:
                y_sorted = self._single_exchange(x_sorted, host[:self.num_experts],
                                                 host[self.num_experts:], recv)
            else:
                send_splits = plan.send_counts(host[:self.num_experts])             # [l][r]
                recv_splits = [[host[self.num_experts + s * L + l] for s in range(W)]
                               for l in range(L)]
                chunks = x_sorted.split([sum(s) for s in send_splits])
                received = all_to_all_chunks(chunks, send_splits, recv_splits, self.group)
                m_splits = [sum(s) for s in recv_splits]
                y = self._experts(list(received.split(m_splits)))
                y_sorted = all_to_all_chunks(y, recv_splits, send_splits, self.group)
        out = unpermute_tokens(y_sorted, plan, probs)
        return out.reshape(shape)

    def _single_exchange(self, x_sorted, send, recv, recv_dev) -> torch.Tensor:
        """One all-to-all each way for all local experts (``all_to_all="single"``). ``send[e]``:
        my rows for global expert ``e`` (rank-major ``x_sorted``); ``recv[s·L + l]``: rank
        ``s``'s rows for my expert ``l`` (``recv_dev``: the same counts on the device). The received rows, by source rank, are regrouped by
        expert (one copy), each expert seeing its rows in source-rank order as with
        ``"per_expert"``; the outputs go back the same way."""
        W, L = self.ep_size, self.num_local_experts
        send_r = [sum(send[r * L:(r + 1) * L]) for r in range(W)]
        recv_s = [sum(recv[s * L:(s + 1) * L]) for s in range(W)]
        received = all_to_all_chunks([x_sorted], [send_r], [recv_s], self.group)
        m_splits = [sum(recv[s * L + l] for s in range(W)) for l in range(L)]
        if self.fuse_permute:
            return all_to_all_chunks([self._experts_regrouped(received, recv_dev, m_splits)],
                                     [recv_s], [send_r], self.group)
        by_source = received.split(recv)                        # [s·L + l]
        grouped = torch.cat([by_source[s * L + l] for l in range(L) for s in range(W)])
        y = self._experts(list(grouped.split(m_splits)))
        y_parts = [p for l in range(L) for p in y[l].split([recv[s * L + l] for s in range(W)])]
        back = torch.cat([y_parts[l * W + s] for s in range(W) for l in range(L)])
        return all_to_all_chunks([back], [recv_s], [send_r], self.group)

    def _experts_regrouped(self, received, recv_dev, m_splits) -> torch.Tensor:
        """``fuse_permute`` with ``all_to_all="single"``: fc1 reads the received rows (by source
        rank) through the experts' order (``row_index``), pad rows as index -1 where the recipe
        pads, so neither the regrouped nor a padded copy of the tokens is made; fc2's rows go back
        to the received order in one gather. Each received row is read once, so the tokens'
        gradient is a plain scatter: the same bits as the unfused exchange."""
        W, L = self.ep_size, self.num_local_experts
        dev = received.device
        row_index, where = _regroup_index(recv_dev, W, L, sum(m_splits))
        align = _token_align()
        if align > 1:      # pad rows: index -1, a zero row gathered by the cast kernel
            m_splits, dest = _padded_rows(m_splits, recv_dev.view(W, L).sum(0), align)
            row_index = torch.full((sum(m_splits),), -1, dtype=torch.int64,
                                   device=dev).index_copy_(0, dest, row_index)
            where = dest[where]
        h = self.fc1(received, m_splits, row_index=row_index)
        y = self._fc2(h, m_splits)
        return y.index_select(0, where)

    def _experts(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """fc1 -> activation -> fc2 on the list of this rank's per-expert rows (padded with zero
        rows where the FP8 recipe needs it, the padding dropped again)."""
        align = _token_align()
        counts = [t.shape[0] for t in xs]
        if align > 1:      # (an expert already at a multiple is not copied)
            xs = [F.pad(t, (0, 0, 0, -m % align)) if m % align else t for t, m in zip(xs, counts)]
        h = self.fc1(xs)
        ys = self._fc2(list(h))
        return [y[:m] for y, m in zip(ys, counts)] if align > 1 else ys
