"""The SwiGLU cast benchmark on a model GPU (tests/_model_gpu.py): the fused op and the two
unfused peers timed together, the fused row's bandwidth from the byte model, the peers'
speed-ups over it; and that the peers compute what the fused op computes (same shapes, the
activation first), on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from _model_gpu import ModelGPU
from cugrouped.bench import swiglu as bs

torch = pytest.importorskip("torch")


def test_rows_on_a_model_gpu(monkeypatch, capsys):
    gpu = ModelGPU(monkeypatch)
    cfg = bs.SWIGLU_CONFIGS[0]
    calls = []

    class Ops:
        padded_splits = staticmethod(bs.pct.padded_splits)

        @staticmethod
        def multi_pad_cast_transpose(h, m_splits, activation=None):
            assert m_splits == cfg.m_splits()
            calls.append((h, activation))
            gpu.work("ours", 1.0 if activation else 0.7)(0)

    monkeypatch.setattr(bs, "QUICK_SWIGLU", (cfg,))
    monkeypatch.setattr(bs, "pct", Ops)
    monkeypatch.setattr(bs, "_inputs", lambda cfg, copies, torch: ["h0", "h1"])
    monkeypatch.setattr(bs, "_activation", lambda torch: lambda h: gpu.work("act", 0.9)(0) or
                        f"act({h})")
    monkeypatch.setattr(bs, "_torch_peers", lambda cfg, x, m, compile_peer: (
        lambda a: gpu.work("eager", 3.0)(0), None))
    monkeypatch.setattr(bs, "copy_bandwidth_gbs", lambda: 4000.0)
    monkeypatch.setattr(bs, "l2_cache_bytes", lambda: 50 << 20)
    rows: list[dict] = []
    bs.bench_swiglu_cast(True, rows)
    assert [r["impl"] for r in rows] == ["cugrouped-fused", "torch-swiglu+cugrouped",
                                         "torch-swiglu+torch-eager"]
    assert [r["ms"] for r in rows] == pytest.approx([1.0, 1.6, 3.9], abs=1e-9)
    fused = rows[0]
    nbytes = bs.swiglu_cast_bytes(cfg.tokens, cfg.k,
                                  sum(bs.pct.padded_splits(cfg.m_splits(), 16)), 50 << 20)
    assert fused["gbs"] == pytest.approx(nbytes / 1.0 / 1e6)
    assert [r.get("speedup_of_cugrouped") for r in rows[1:]] == pytest.approx([1.6, 3.9])
    assert {a for _, a in calls} == {"swiglu", None}
    assert all(h.startswith("act(") for h, a in calls if a is None)   # the peer casts act(h)
    assert "fused is  1.60x faster" in capsys.readouterr().out


def test_byte_model_counts_the_second_read_only_past_l2():
    small = bs.swiglu_cast_bytes(1024, 512, 1024, l2_bytes=50 << 20)
    assert small == 1024 * 1024 * 2 + 2 * 1024 * 512
    big = bs.swiglu_cast_bytes(65536, 2048, 65536, l2_bytes=50 << 20)
    assert big == 2 * (65536 * 4096 * 2) + 2 * 65536 * 2048


def test_the_peers_activation_is_the_layers():
    from cugrouped.pytorch._grouped_linear_fn import swiglu

    h = torch.randn(8, 64)
    assert torch.equal(bs._activation(torch)(h), swiglu(h))
    assert bs.QUICK_SWIGLU[0].m_splits() == bs.SWIGLU_CONFIGS[0].m_splits()
    assert all(np.sum(c.m_splits()) == c.tokens for c in bs.SWIGLU_CONFIGS)
    assert any(0 in c.m_splits() for c in bs.SWIGLU_CONFIGS if c.jagged)   # an empty expert
