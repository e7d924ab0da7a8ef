"""The block-scaling benchmark's pieces that run without a GPU: the torch eager peer computes the
op's bits (so the benchmark compares equal work), and the token rounding of the GEMM rows."""

from __future__ import annotations

import numpy as np
import pytest

from cugrouped.bench.block import block_splits, torch_block_peer

torch = pytest.importorskip("torch")
pytest.register_assert_rewrite("_block_common")
from _block_common import BLOCK_CAST, bench_peer_case  # noqa: E402


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_torch_eager_peer_gives_the_ops_bits(fmt):
    m_splits, x, want = bench_peer_case(BLOCK_CAST, fmt, seed=3)   # row 5's zero blocks: scale 1
    got = torch_block_peer(m_splits, fmt)(x)
    for i, (q, s, qt, st) in enumerate(got):
        assert np.array_equal(q.view(torch.uint8).numpy(), np.asarray(want.rowwise(i)).view(np.uint8))
        assert np.array_equal(s.numpy(), want.rowwise_scale_inv(i))
        assert np.array_equal(qt.view(torch.uint8).numpy(), want.columnwise(i))
        assert np.array_equal(st.numpy(), want.columnwise_scale_inv(i))


def test_block_splits_round_down_to_16():
    assert block_splits([0, 15, 16, 130, 1000]) == [0, 0, 16, 128, 992]
