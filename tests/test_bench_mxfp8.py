"""The MXFP8 benchmark's pieces that run without a GPU: the torch eager peer computes the op's
bits (so the benchmark compares equal work, the swizzle of the scales included)."""

from __future__ import annotations

import numpy as np
import pytest

from cugrouped import reference
from cugrouped.bench.mxfp8 import torch_mx_peer

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_torch_eager_peer_gives_the_ops_bits(fmt):
    m_splits, k = [48, 0, 160, 16], 256
    g = torch.Generator().manual_seed(4)
    x = (torch.randn((sum(m_splits), k), generator=g)
         * torch.exp2(torch.randint(-12, 12, (sum(m_splits), 1), generator=g).float())).to(torch.bfloat16)
    x[5, :] = 0                                           # all-zero blocks: byte 0x00
    got = torch_mx_peer(m_splits, fmt)(x)
    want = reference.multi_mxfp8_cast_transpose(x.view(torch.int16).numpy().view(np.uint16),
                                                m_splits, dtype="bfloat16", fp8_format=fmt)
    o = np.concatenate([[0], np.cumsum([s.numel() for _, s, _, _ in got])])
    ot = np.concatenate([[0], np.cumsum([s.numel() for _, _, _, s in got])])
    for i, (q, s, qt, st) in enumerate(got):
        assert np.array_equal(q.view(torch.uint8).numpy(), np.asarray(want.rowwise(i)).view(np.uint8))
        assert np.array_equal(s.numpy(), want.scale_inv[o[i]:o[i + 1]])
        assert np.array_equal(qt.view(torch.uint8).numpy(), want.columnwise(i))
        assert np.array_equal(st.numpy(), want.scale_inv_t[ot[i]:ot[i + 1]])
    assert o[-1] == want.scale_inv.size and ot[-1] == want.scale_inv_t.size
