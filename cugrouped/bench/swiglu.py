"""Benchmark of the fused SwiGLU + FP8 cast (fc2's input straight from fc1's output) against the
activation computed first by torch, then cast by cugrouped or by the torch eager peer."""

from __future__ import annotations

import numpy as np

from ..ops import pad_cast_transpose as pct
from .cast import CastConfig, _torch_peers, record_fused
from .common import copy_bandwidth_gbs, l2_cache_bytes, time_together


# fc2's input of E experts: ``tokens`` routed rows of fc1's ``2 k`` outputs (k: the experts'
# ffn size)
SWIGLU_CONFIGS = (
    CastConfig("dsv3-E8-jagged", 8, 2048, 16384, True),        # moe_intermediate_size 2048
    CastConfig("dsv3-E8-equal", 8, 2048, 65536, False),
    CastConfig("qwen3-E16-equal", 16, 768, 40960, False),      # Qwen3-30B-A3B's experts
    CastConfig("mixtral-E8-jagged", 8, 14336, 4096, True),
    CastConfig("fine-E64-jagged", 64, 2048, 8192, True),
)
QUICK_SWIGLU = SWIGLU_CONFIGS[:1] + SWIGLU_CONFIGS[3:4]


def swiglu_cast_bytes(tokens: int, ffn: int, padded_rows: int, l2_bytes: int) -> int:
    """HBM bytes of the fused cast (current scaling) of a ``(tokens, 2 ffn)`` 16-bit input: the
    input read (twice, amax pass and cast, when it is larger than the L2 cache), the FP8 rows and
    the padded transposed copy of the ``(tokens, ffn)`` activation written."""
    x = tokens * 2 * ffn * 2
    return x * (2 if x > l2_bytes else 1) + tokens * ffn + padded_rows * ffn


def _inputs(cfg: CastConfig, copies: int, torch) -> list:
    return [torch.randn((cfg.tokens, 2 * cfg.k), device="cuda", dtype=torch.bfloat16)
            for _ in range(copies)]


def _activation(torch):
    """What users compute before the cast: the layer's own torch fallback, ``F.silu(a) * b``."""
    from ..pytorch._grouped_linear_fn import swiglu

    return swiglu


def bench_swiglu_cast(quick: bool, rows: list[dict]) -> None:
    """Current scaling, bfloat16: ``multi_pad_cast_transpose(h, activation="swiglu")`` against
    ``F.silu(a) * b`` in torch followed by our cast, and by the torch eager cast peer."""
    try:
        import torch
    except ImportError:
        print("torch not installed: the SwiGLU cast benchmark is skipped")
        return
    configs = QUICK_SWIGLU if quick else SWIGLU_CONFIGS
    bw, l2 = copy_bandwidth_gbs(), l2_cache_bytes()
    act = _activation(torch)
    for cfg in configs:
        m_splits = cfg.m_splits()
        copies = max(2, int(np.ceil(256e6 / (cfg.tokens * 2 * cfg.k * 2))))   # > L2 in turn
        hs = _inputs(cfg, copies, torch)
        eager, _ = _torch_peers(cfg, None, m_splits, compile_peer=False)
        impls = {
            "cugrouped-fused": lambda i: pct.multi_pad_cast_transpose(
                hs[i % copies], m_splits, activation="swiglu"),
            "torch-swiglu+cugrouped": lambda i: pct.multi_pad_cast_transpose(
                act(hs[i % copies]), m_splits),
            "torch-swiglu+torch-eager": lambda i: eager(act(hs[i % copies])),
        }
        nbytes = swiglu_cast_bytes(cfg.tokens, cfg.k, sum(pct.padded_splits(m_splits, 16)), l2)
        record_fused(rows, time_together(impls, 30), "swiglu-cast", cfg.name, nbytes, bw,
                     "swiglu")
