"""The README's Python examples, run as they are (in order, in one namespace, as a reader would
paste them), and checked for what their comments promise."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_the_examples():
    blocks = python_blocks()
    assert len(blocks) >= 3
    assert any("multi_pad_cast_transpose" in b for b in blocks)
    assert any("grouped_fprop" in b for b in blocks)
    assert any("GroupedLinear" in b for b in blocks)


def test_readme_examples_run():
    pytest.importorskip("torch")
    ns: dict = {"__name__": "readme"}
    seen = []
    for i, block in enumerate(python_blocks()):
        exec(compile(block, f"README.md python block {i}", "exec"), ns)
        seen.append(dict(ns))
    ops, gemms, block, mx, layer = seen[0], seen[1], seen[2], seen[3], seen[4]
    # the cast op: the middle expert is empty, its transposed block (k, 0)
    res, k, n = ops["res"], ops["k"], ops["n"]
    assert res.data.shape == (589, k) and res.columnwise(1).shape == (k, 0)
    assert res.columnwise(2).shape == (k, 80)                  # 77 rows padded to 80
    # the GEMMs: shapes as the comments say, main_grad accumulated
    assert gemms["y"].shape == (589, n) and gemms["dx"].shape == (589, k)
    assert gemms["dw"].shape == (3, n, k) and np.array_equal(gemms["main_grads"], gemms["dw"])
    # block scaling: the layouts as the comments say, and the fprop close to the float product
    xb, wb = block["xb"], block["wb"]
    assert xb.rowwise_scale_inv(0).shape == (2, 512) and xb.columnwise_scale_inv(0).shape == (4, 256)
    assert wb.rowwise_scale_inv(0).shape == (1, 4)      # (ceil(n/128), roundup(ceil(k/128), 4))
    exact = np.concatenate([a @ b.T for a, b in zip(xb.dequantize(), wb.dequantize())])
    assert block["yb"].shape == (592, n)
    assert np.allclose(block["yb"].astype(np.float32), exact, rtol=2**-7, atol=1e-2)
    # MXFP8: E8M0 bytes, 512 per 128 x 128 tile (4 x 2 + 1 x 2 tiles), the compact view's shape
    xm, wm = mx["xm"], mx["wm"]
    assert xm.scale_inv.dtype == np.uint8 and xm.scale_inv.size == 10 * 512
    assert xm.rowwise_scale_inv(0).shape == (512, 8)
    exact = np.concatenate([a @ b.T for a, b in zip(xm.dequantize(), wm.dequantize())])
    assert mx["ym"].shape == (608, n)
    assert np.allclose(mx["ym"].astype(np.float32), exact, rtol=2**-7, atol=1e-2)
    # the layer: list in, list out; gradients reached the parameters
    assert [tuple(t.shape) for t in layer["ys"]] == [(96, 128), (0, 128), (33, 128), (7, 128)]
    assert layer["x"].grad is not None and layer["layer"].weight0.grad is not None
