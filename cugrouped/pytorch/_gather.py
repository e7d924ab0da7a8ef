"""Row gathers by index (the MoE permute) with autograd, for ``GroupedLinear(..., row_index=)``.

``row_index[j]`` names the token whose row is row ``j`` of the expert-ordered input; an index
outside ``[0, tokens)`` (e.g. -1 for capacity padding) is a zero row, as in the cast kernel's
fused gather. No host sync: masks and clamps instead of boolean indexing.
"""

from __future__ import annotations

import torch

from . import _custom_ops as cops

__all__ = ["gather_rows", "scatter_rows", "check_row_index", "token_order"]


def _valid(row_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    return (row_index >= 0) & (row_index < num_tokens)


def scatter_rows(rows: torch.Tensor, row_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The gather's adjoint: ``out[t] = Σ_{j: row_index[j] = t} rows[j]``, summed in float32 (at
    least) in increasing ``j`` and rounded once to ``rows``' dtype; zero rows contribute nothing.
    The same bits on every run: on CUDA the rows are grouped by token on the device (a stable
    ``argsort`` and ``searchsorted``, no host sync) and summed by cugrouped's ``scatter_rows``
    kernel (no atomics); on the CPU ``index_add_`` adds in that same order."""
    if rows.is_cuda and rows.dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = cops.eager.scatter_rows_sum(rows.contiguous(), *token_order(row_index, num_tokens),
                                          num_tokens)
        return out.to(rows.dtype)
    acc = torch.promote_types(rows.dtype, torch.float32)
    out = torch.zeros((num_tokens, *rows.shape[1:]), dtype=acc, device=rows.device)
    if rows.shape[0] and num_tokens:
        valid = _valid(row_index, num_tokens)
        src = torch.where(valid.unsqueeze(-1), rows.to(acc), torch.zeros((), dtype=acc,
                                                                         device=rows.device))
        out.index_add_(0, row_index.clamp(0, num_tokens - 1), src)
    return out.to(rows.dtype)


def token_order(row_index: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, seg) on the index's device, no host sync: the row numbers sorted stably by token
    (indices outside the tokens last) and where each token's rows start in them."""
    key = torch.where(_valid(row_index, num_tokens), row_index,
                      torch.full_like(row_index, num_tokens))
    order = torch.argsort(key, stable=True)
    seg = torch.searchsorted(key[order], torch.arange(num_tokens + 1, device=row_index.device))
    return order, seg


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, row_index):
        ctx.save_for_backward(row_index)
        ctx.num_tokens = T = tokens.shape[0]
        if T == 0:
            return tokens.new_zeros((row_index.shape[0], *tokens.shape[1:]))
        picked = tokens.index_select(0, row_index.clamp(0, T - 1))
        return torch.where(_valid(row_index, T).unsqueeze(-1), picked,
                           torch.zeros((), dtype=tokens.dtype, device=tokens.device))

    @staticmethod
    def backward(ctx, grad):
        (row_index,) = ctx.saved_tensors
        return scatter_rows(grad, row_index, ctx.num_tokens), None


def gather_rows(tokens: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
    """``tokens[row_index]`` with zero rows for indices outside ``[0, tokens)``; its gradient is
    :func:`scatter_rows`."""
    return _GatherRows.apply(tokens, row_index)


def check_row_index(row_index, tokens: torch.Tensor, rows: int) -> None:
    """A contiguous 1-D int64 tensor of ``rows`` indices on the tokens' device; CPU indices past
    the tokens are refused (on CUDA that check would sync, and under torch.compile it would be
    a data-dependent guard: there they read as zero rows)."""
    if not isinstance(row_index, torch.Tensor):
        raise TypeError(f"row_index: expected a torch.Tensor, got {type(row_index).__name__}")
    if row_index.dtype != torch.int64 or row_index.dim() != 1 or not row_index.is_contiguous():
        raise TypeError(f"row_index: expected a contiguous 1-D int64 tensor, got "
                        f"{row_index.dtype} of shape {tuple(row_index.shape)}")
    if row_index.device != tokens.device:
        raise ValueError(f"row_index: on {row_index.device}, inp is on {tokens.device}")
    if row_index.shape[0] != rows:
        raise ValueError(f"row_index: has {row_index.shape[0]} entries but m_splits counts "
                         f"{rows} rows")
    if row_index.device.type == "cpu" and rows and not torch.compiler.is_compiling() and \
            int(row_index.max()) >= tokens.shape[0]:
        raise ValueError(f"row_index: indices must be below the {tokens.shape[0]} rows of inp "
                         f"(negative ones select a zero row), got {int(row_index.max())}")
