"""The block-scaling benchmark's pieces that run without a GPU: the torch eager peer computes the
op's bits (so the benchmark compares equal work), and the token rounding of the GEMM rows."""

from __future__ import annotations

import numpy as np
import pytest

from cugrouped import reference
from cugrouped.bench.block import block_splits, torch_block_peer

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_torch_eager_peer_gives_the_ops_bits(fmt):
    m_splits, k = [48, 0, 160, 16], 256
    g = torch.Generator().manual_seed(3)
    x = (torch.randn((sum(m_splits), k), generator=g)
         * torch.exp2(torch.randint(-12, 12, (sum(m_splits), 1), generator=g).float())).to(torch.bfloat16)
    x[5, :] = 0                                           # an all-zero row block: scale 1
    got = torch_block_peer(m_splits, fmt)(x)
    want = reference.multi_block_cast_transpose(x.view(torch.int16).numpy().view(np.uint16),
                                                m_splits, dtype="bfloat16", fp8_format=fmt)
    for i, (q, s, qt, st) in enumerate(got):
        assert np.array_equal(q.view(torch.uint8).numpy(), np.asarray(want.rowwise(i)).view(np.uint8))
        assert np.array_equal(s.numpy(), want.rowwise_scale_inv(i))
        assert np.array_equal(qt.view(torch.uint8).numpy(), want.columnwise(i))
        assert np.array_equal(st.numpy(), want.columnwise_scale_inv(i))


def test_block_splits_round_down_to_16():
    assert block_splits([0, 15, 16, 130, 1000]) == [0, 0, 16, 128, 992]
