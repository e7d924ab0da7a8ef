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


def gpu_only(block: str) -> bool:
    """The CuPy block needs a GPU (CuPy allocates device memory); the others run on a CPU."""
    return "import cupy" in block


def test_readme_has_the_examples():
    blocks = python_blocks()
    assert len(blocks) >= 3
    assert any("multi_pad_cast_transpose" in b for b in blocks)
    assert any("grouped_fprop" in b for b in blocks)
    assert any("GroupedLinear" in b for b in blocks)
    assert sum(gpu_only(b) for b in blocks) == 1       # the CuPy example


def run_blocks(gpu: bool) -> dict:
    """Execute the README's blocks in order in one namespace (the CuPy one only with ``gpu``);
    returns each block's namespace after it ran, keyed by a name for what it shows."""
    names = iter(("ops", "gemms", "cupy", "block", "mx", "layer") if gpu
                 else ("ops", "gemms", "block", "mx", "layer"))
    ns: dict = {"__name__": "readme"}
    seen = {}
    for i, block in enumerate(python_blocks()):
        if gpu_only(block) and not gpu:
            continue
        exec(compile(block, f"README.md python block {i}", "exec"), ns)
        seen[next(names)] = dict(ns)
    return seen


def test_readme_cupy_example_names_what_exists():
    """Without a GPU the CuPy block cannot run: it must at least compile, and every cugrouped
    function and result attribute it uses must exist (the GPU check runs it)."""
    (block,) = [b for b in python_blocks() if gpu_only(b)]
    compile(block, "README.md CuPy block", "exec")
    import cugrouped
    for name in re.findall(r"cugrouped\.(\w+)\(", block):
        assert callable(getattr(cugrouped, name)), name
    res = cugrouped.multi_pad_cast_transpose(np.ones((3, 16), np.float32), [3])
    for attr in re.findall(r"\bxg\.(\w+)", block):
        assert hasattr(res, attr), attr


def test_readme_examples_run():
    pytest.importorskip("torch")
    check_examples(run_blocks(gpu=False))


@pytest.mark.gpu
def test_gpu_readme_examples_run():
    """Every block, the CuPy one included: its cast has the NumPy run's bits, and its fprop
    (cuBLASLt, fast accumulation) is within two bf16 half-ulps plus Hopper's fast-accumulation
    error (2^-9 of sum |x w|, as tests/test_grouped_gemm.py's FAST_ACC_EPS) of the reference's."""
    pytest.importorskip("torch")
    seen = run_blocks(gpu=True)
    check_examples({k: v for k, v in seen.items() if k != "cupy"})
    g = seen["cupy"]
    import cugrouped
    y_ref = cugrouped.grouped_fprop(g["x"], g["w"]).astype(np.float64)     # NumPy: the reference
    xs = [a.astype(np.float64) for a in g["x"].dequantize()]
    ws = [a.astype(np.float64) for a in g["w"].dequantize()]
    abs_sum = np.concatenate([np.abs(a) @ np.abs(b).T for a, b in zip(xs, ws)])
    bound = 2 * 2.0**-8 * np.abs(y_ref) + 2.0**-9 * abs_sum + 1e-30
    assert np.all(np.abs(g["y_host"].astype(np.float64) - y_ref) <= bound)


def check_examples(seen: dict) -> None:
    ops, gemms, block, mx, layer = (seen[k] for k in ("ops", "gemms", "block", "mx", "layer"))
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
