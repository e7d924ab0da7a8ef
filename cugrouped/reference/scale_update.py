"""NumPy reference twin of :func:`cugrouped.ops.scale_update.update_scales`: defines the bits.

Written from the contract (design.md §3 and the header of ``kernels_cu/scale_update.cu``): a
tensor whose new amax is 0 (``+-0`` or a denormal: it measured nothing this step) keeps its
history and scale, as in TransformerEngine; otherwise the
history is rolled by one with the new amax in front (values moved bit for bit), reduced by
``max`` over the window's non-NaN entries (-inf when there are none) or ``most_recent``; then
``scale = compute_scale(reduced, margin)`` where the reduced amax is usable (positive, normal,
finite: ``amax_usable``), otherwise the previous ``scale`` is kept (TransformerEngine's rule);
finally ``scale_inv = scale_inverse(scale)``; with ``reset_amax`` the amax is zeroed once read.
"""

from __future__ import annotations

import numpy as np

from . import fp8 as rfp8

__all__ = ["update_scales", "reduce_history"]


def reduce_history(history: np.ndarray, amax_compute_algo: str) -> np.ndarray:
    """Per-row reduction of an (already rolled) ``(T, L)`` history."""
    h = np.asarray(history, dtype=np.float32)
    if amax_compute_algo == "most_recent":
        return h[:, 0].copy()
    return np.where(np.isnan(h), np.float32(-np.inf), h).max(axis=1).astype(np.float32)


def update_scales(amax_history, amax, scale, scale_inv, *, fp8_format="e4m3",
                  amax_compute_algo="max", margin=0, backend=None, reset_amax=False) -> None:
    """Same signature and effect as the op, NumPy arrays only (updated in place)."""
    from ..ops.scale_update import _check, split_formats

    if backend not in (None, "reference"):
        raise ValueError(f"backend: the reference twin only runs backend='reference', got {backend!r}")
    views = _check(amax_history, amax, scale, scale_inv, amax_compute_algo, margin, reset_amax)
    if views[0].on_device:
        raise ValueError("amax_history: the reference needs host (NumPy) arrays")
    T, L = views[0].shape
    n4 = split_formats(fp8_format, T)
    h = np.asarray(amax_history)
    bits = h.view(np.uint32)
    new = np.asarray(amax, dtype=np.float32).view(np.uint32).copy()
    idle = (new & np.uint32(0x7F800000)) == 0           # +-0 or denormal: nothing measured
    rolled = np.concatenate([new[:, None], bits[:, :-1]], axis=1)
    bits[~idle] = rolled[~idle]
    reduced = reduce_history(h, amax_compute_algo)
    if amax_compute_algo == "most_recent":
        reduced = new.view(np.float32).copy()
    s = np.empty(T, dtype=np.float32)
    s[:n4] = rfp8.compute_scale(reduced[:n4], "e4m3", margin)
    s[n4:] = rfp8.compute_scale(reduced[n4:], "e5m2", margin)
    s = np.where(rfp8.amax_usable(reduced) & ~idle, s, np.asarray(scale, dtype=np.float32))
    np.asarray(scale)[...] = s
    np.asarray(scale_inv)[...] = rfp8.scale_inverse(s)
    if reset_amax:
        np.asarray(amax)[...] = 0.0     # +0: rolled in, consumed
    return None
