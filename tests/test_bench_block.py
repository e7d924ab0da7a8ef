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


@pytest.mark.parametrize("quick", [True, False])
def test_cast_vs_torch_rows_on_a_model_gpu(monkeypatch, quick):
    """The block casts' section on a model GPU (tests/_model_gpu.py; torch's CUDA inputs
    replaced): the cast, its torch eager peer and (without --quick) torch.compile of it timed
    together, GB/s from the byte model and the speed-ups from those times."""
    import _model_gpu

    from cugrouped.bench import block as bb

    gpu = _model_gpu.ModelGPU(monkeypatch)
    cfg = bb.CAST_CONFIGS[0]
    monkeypatch.setattr(bb, "QUICK_CAST", (cfg,))
    monkeypatch.setattr(bb, "CAST_CONFIGS", (cfg,))
    monkeypatch.setattr(bb, "copy_bandwidth_gbs", lambda: 4000.0)
    monkeypatch.setattr(torch, "randn", lambda *a, **k: "x")
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic: lambda x: gpu.work("c", 2.0)(0))
    cast = gpu.work("ours", 1.0)
    eager = gpu.work("eager", 4.0)
    rows: list[dict] = []
    bb.bench_cast_vs_torch(quick, rows, op="block-cast", scaling="block1d",
                           cast=lambda x, m: cast(0), peer=lambda m: lambda x: eager(0),
                           sizes=lambda m, k: bb.bct.block_output_sizes(m, k, 16, 1),
                           scale_bytes=4)
    assert [r["impl"] for r in rows] == ["cugrouped", "torch-eager"] + \
        ([] if quick else ["torch-compile"])
    assert [r["ms"] for r in rows] == pytest.approx([1.0, 4.0, 2.0][:len(rows)], abs=1e-9)
    m = cfg.m_splits()
    sz = bb.bct.block_output_sizes(m, cfg.k, 16, 1)
    traffic = sum(m) * cfg.k * 2 + sz.rows * cfg.k + sz.data_t + 4 * (sz.scale_inv +
                                                                      sz.scale_inv_t)
    assert rows[0]["gbs"] == pytest.approx(traffic / 1.0 / 1e6)
    assert [r.get("speedup_of_cugrouped") for r in rows[1:]] == \
        pytest.approx([4.0, 2.0][:len(rows) - 1])
    assert all("drift_pct" in r for r in rows)
