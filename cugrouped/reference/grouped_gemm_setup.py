"""NumPy twin of :func:`cugrouped.ops.grouped_gemm_setup.grouped_gemm_setup`: defines the bytes the
setup kernel writes into the grouped GEMM's device workspace.

Written from the contract in the header of ``kernels_cu/grouped_gemm_setup.cu``: tokens are the
(clamped) counts rounded up to ``token_align``; each matrix's pointer is ``base + group_stride * e
+ token_stride * P_e``; rows/cols/ld are constants or the tokens (ld at least 1); scale pointers
``base + group_stride * e + token_stride * Q_e`` with ``Q_e`` the exclusive prefix of
``roundup(ceil(t_e / div), mult)`` (null without a base); expert ``e`` goes to group ``slots[e]`` (dropped when negative); alpha and beta are
the two float32 scalars.
"""

from __future__ import annotations

import numpy as np

__all__ = ["grouped_gemm_setup", "setup_arrays", "clamp_counts"]


def clamp_counts(m_dev, total_rows: int) -> np.ndarray:
    """Device counts as the kernels read them: negatives are 0 and the running sum stops at
    ``total_rows`` (the rule of the cast kernel and of ``GroupedFP8.host_splits``)."""
    raw = np.maximum(np.asarray(m_dev, dtype=np.int64), 0)
    ends = np.minimum(np.cumsum(raw), total_rows)
    return np.diff(np.concatenate([[0], ends]))


def setup_arrays(spec, m) -> dict[str, np.ndarray]:
    """Per-group arrays (by :data:`~cugrouped.ops.grouped_gemm_setup.ARRAY_NAMES` name, in group
    order) for counts ``m``; ``alpha`` and ``beta`` as float32 scalars."""
    from ..ops.grouped_gemm_setup import TOKENS

    m = np.asarray(m, dtype=np.int64)
    a = spec.token_align
    tokens = (m + a - 1) // a * a
    prefix = np.concatenate([[0], np.cumsum(tokens)[:-1]]).astype(np.int64)
    e = np.arange(spec.num_experts, dtype=np.int64)
    keep = np.arange(spec.num_experts) if spec.slots is None else np.asarray(spec.slots)
    order = np.argsort(np.where(keep >= 0, keep, np.iinfo(np.int64).max), kind="stable")
    order = order[: int((keep >= 0).sum())]
    out = {}
    for name, mx in (("a", spec.a), ("b", spec.b), ("d", spec.d)):
        ptr = (np.uint64(mx.base) + (mx.group_stride * e + mx.token_stride * prefix).astype(np.uint64))
        out[name] = ptr[order]
        for dim in ("rows", "cols", "ld"):
            c = getattr(mx, dim)
            v = tokens if c == TOKENS else np.full_like(tokens, c)
            if dim == "ld":
                v = np.maximum(v, 1)
            out[f"{name}_{dim}"] = v[order].astype(np.int32)
    out["c"] = out["d"].copy()
    for name, sc in (("a_scale", spec.scales[0]), ("b_scale", spec.scales[1])):
        q = (tokens + sc.div - 1) // sc.div
        q = (q + sc.mult - 1) // sc.mult * sc.mult
        q_prefix = np.concatenate([[0], np.cumsum(q)[:-1]]).astype(np.int64)
        ptr = np.uint64(sc.base) + (sc.group_stride * e + sc.token_stride * q_prefix).astype(np.uint64)
        out[name] = (ptr if sc.base else np.zeros_like(e, np.uint64))[order]
    out["alpha"], out["beta"] = np.float32(spec.alpha), np.float32(spec.beta)
    return out


def grouped_gemm_setup(spec, workspace, *, m_host=None, m_dev=None, total_rows: int = 0) -> None:
    """Write the arrays into ``workspace`` (uint8, host memory) at the offsets of
    ``grouped_workspace_layout(spec.groups)``; bytes outside them are left untouched."""
    from ..ops.grouped_gemm import grouped_workspace_layout

    if (m_host is None) == (m_dev is None):
        raise ValueError("give exactly one of m_host (host counts) and m_dev (device counts)")
    m = np.asarray(m_host, dtype=np.int64) if m_host is not None else clamp_counts(m_dev, total_rows)
    offsets, _ = grouped_workspace_layout(spec.groups)
    ws = np.asarray(workspace)
    for name, values in setup_arrays(spec, m).items():
        raw = np.asarray(values).tobytes()
        ws[offsets[name]:offsets[name] + len(raw)] = np.frombuffer(raw, np.uint8)
