"""The torch layer's cast op on CUDA launches straight from its inputs' normalization
(``pad_cast_transpose.launch_cast``), skipping the public op's checks of the outputs it made
itself: its launches must be the public op's, argument for argument (every pointer, size, scale
rule and flag of every chunk and pass), for every variant the op takes; and state slices that
are not what it expects go through the public op (which says what is wrong)."""

from __future__ import annotations

import pathlib
import sys
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))

import layer_host  # noqa: E402

from cugrouped.pytorch import _custom_ops as cops  # noqa: E402


class _Replay:
    """torch for the custom op, whose ``empty`` hands out the same buffers, in the same order, on
    every run after the first (so that two runs' launches can be compared pointer for pointer)."""

    def __init__(self):
        self.made, self.next = [], None

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, shape, *, dtype, device=None):
        if self.next is None:
            t = layer_host.aligned_empty(shape, dtype)
            self.made.append(t)
            return t
        t = self.made[self.next]
        self.next += 1
        assert tuple(t.shape) == tuple(shape if not isinstance(shape, int) else (shape,))
        return t


def _normal(arg):
    inner = getattr(arg, "arg", None)          # by_value(): the struct's bytes
    if isinstance(inner, np.ndarray):
        return ("struct", inner.tobytes())
    if isinstance(arg, np.generic):
        return (type(arg).__name__, arg.item())
    return arg


def _launches(run):
    """The launches (kernel, grid, block, arguments) of ``run()`` in the layer_host harness,
    with the direct route and then through the public op, over the same buffers."""
    replay = _Replay()
    out = []
    with layer_host.cuda_path_on_cpu() as launches, mock.patch.object(cops, "torch", replay):
        for direct in (True, False):
            launches.clear()
            with mock.patch.object(cops, "DIRECT_CASTS", direct):
                run()
            out.append([(name, grid, block, tuple(_normal(a) for a in args))
                        for name, grid, block, args in launches])
            replay.next = 0
    return out


def _inputs(m_splits, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = layer_host.aligned_empty((sum(m_splits), k), torch.bfloat16)
    x.copy_(torch.randn(sum(m_splits), k, generator=g))
    return x


VARIANTS = {
    "current": {},
    "delayed": {"scale": True},
    "delayed_accumulate": {"scale": True, "accumulate_amax": True},
    "rowwise_only": {"columnwise": False},
    "columnwise_only": {"rowwise": False},
    "column_sums": {"column_sums": True},
    "eps_pow2": {"amax_epsilon": 2.0 ** -10, "power_2_scale": True},
    "e5m2_margin": {"fp8_format": "e5m2", "margin": 3},
    "weights_align1": {"align": 1, "list": True},
    "list": {"list": True},
    "gather": {"gather": True},
    "swiglu": {"activation": "swiglu"},
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m_splits", [[37, 0, 64, 5], [1], [3] * 70], ids=["jagged", "one", "70"])
def test_the_direct_cast_launches_what_the_public_op_launches(variant, m_splits):
    kw = dict(VARIANTS[variant])
    E, k = len(m_splits), 32
    x = _inputs(m_splits, 2 * k if kw.get("activation") else k)
    state = layer_host.aligned_empty(3 * E, torch.float32).fill_(0.5)
    amax = layer_host.aligned_empty(3 * E, torch.float32).zero_()
    offset = E
    given = kw.pop("scale", False)
    as_list, gather = kw.pop("list", False), kw.pop("gather", False)
    if as_list:
        xs, splits, row_index = list(torch.split(x, m_splits)), None, None
    elif gather:
        rows = sum(m_splits)
        row_index = torch.randperm(rows, generator=torch.Generator().manual_seed(1))
        xs, splits = [x], list(m_splits)
    else:
        xs, splits, row_index = [x], list(m_splits), None
    args = dict(fp8_format="e4m3", margin=0, align=16, rowwise=True, columnwise=True,
                column_sums=False)
    args.update({a: kw.pop(a) for a in list(args) if a in kw})

    def run():                                  # the op's Python body, as the layer calls it
        cops._OPS["fp8_quantize"][1](
            xs, args["fp8_format"], args["margin"], args["align"], args["rowwise"],
            args["columnwise"], args["column_sums"], state if given else None, amax, offset,
            "emulate", row_index=row_index, m_splits=splits, **kw)

    direct, public = _launches(run)
    passes = 1 if given else 2
    chunks = -(-E // 64)
    assert len(direct) == passes * chunks
    assert all("pad_cast_transpose_kernel" in name for name, *_ in direct)
    assert direct == public


@pytest.mark.parametrize("bad", ["short", "strided", "float64", "meta"])
def test_state_slices_it_does_not_expect_go_through_the_public_checks(bad):
    E = 4
    x = _inputs([8] * E, 32)
    whole = layer_host.aligned_empty(8 * E, torch.float32).fill_(1.0)
    scale = {"short": whole[:E + 1], "strided": whole[::2][:2 * E],
             "float64": whole.double(), "meta": whole.to("meta")}[bad]
    match = ("scale: tensors on meta are not supported" if bad == "meta" else
             "scale: expected a contiguous float32 array")
    with layer_host.cuda_path_on_cpu():
        with pytest.raises(ValueError, match=match):
            cops._OPS["fp8_quantize"][1]([x], "e4m3", 0, 16, True, True, False, scale, None,
                                         E if bad == "short" else 0, "emulate",
                                         m_splits=[8] * E)
