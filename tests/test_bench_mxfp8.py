"""The MXFP8 benchmark's pieces that run without a GPU: the torch eager peer computes the op's
bits (so the benchmark compares equal work, the swizzle of the scales included)."""

from __future__ import annotations

import numpy as np
import pytest

from cugrouped.bench.mxfp8 import torch_mx_peer

torch = pytest.importorskip("torch")
pytest.register_assert_rewrite("_block_common")
from _block_common import MXFP8_CAST, bench_peer_case  # noqa: E402


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_torch_eager_peer_gives_the_ops_bits(fmt):
    m_splits, x, want = bench_peer_case(MXFP8_CAST, fmt, seed=4)   # row 5's zero blocks: byte 0x00
    got = torch_mx_peer(m_splits, fmt)(x)
    o = np.concatenate([[0], np.cumsum([s.numel() for _, s, _, _ in got])])
    ot = np.concatenate([[0], np.cumsum([s.numel() for _, _, _, s in got])])
    for i, (q, s, qt, st) in enumerate(got):
        assert np.array_equal(q.view(torch.uint8).numpy(), np.asarray(want.rowwise(i)).view(np.uint8))
        assert np.array_equal(s.numpy(), want.scale_inv[o[i]:o[i + 1]])
        assert np.array_equal(qt.view(torch.uint8).numpy(), want.columnwise(i))
        assert np.array_equal(st.numpy(), want.scale_inv_t[ot[i]:ot[i + 1]])
    assert o[-1] == want.scale_inv.size and ot[-1] == want.scale_inv_t.size
