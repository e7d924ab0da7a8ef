"""The Python examples of the README and of the user's pages in docs/, run as they are (each
document's blocks in order, in one namespace, as a reader would paste them), and checked for what
their comments promise."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
# each document, and a name for each of its Python blocks in order (what it shows)
DOCUMENTS = {"README.md": ("ops", "gemms", "cupy", "layer"),
             "docs/ops.md": ("ops_preamble", "delayed", "block", "checkpoint", "mx"),
             "docs/pytorch.md": ("megatron", "graphs", "permute", "swiglu"),
             "cugrouped/emulate/README.md": ("emulator", "access")}


def python_blocks(doc: str = "README.md") -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / doc).read_text(), flags=re.S | re.M)


def gpu_only(block: str) -> bool:
    """The CuPy block needs a GPU (CuPy allocates device memory); the others run on a CPU."""
    return "import cupy" in block


def needs_megatron(block: str) -> bool:
    """The Megatron-core block runs where megatron-core is installed (scripts/test.sh installs
    it; the GPU image has none)."""
    return "cugrouped.pytorch.megatron" in block


def test_documents_have_the_examples():
    for doc, names in DOCUMENTS.items():
        assert len(python_blocks(doc)) == len(names), doc
    readme = python_blocks()
    assert "multi_pad_cast_transpose" in readme[0] and "grouped_fprop" in readme[1]
    assert "GroupedLinear" in readme[3]
    assert [gpu_only(b) for b in readme] == [False, False, True, False]   # the CuPy example
    assert "update_scales" in python_blocks("docs/ops.md")[1]
    assert "multi_block_cast_transpose" in python_blocks("docs/ops.md")[2]
    assert "block_scaled_weights" in python_blocks("docs/ops.md")[3]
    assert "CugroupedSpecProvider" in python_blocks("docs/pytorch.md")[0]
    assert "CUDAGraph" in python_blocks("docs/pytorch.md")[1]
    assert "row_index" in python_blocks("docs/pytorch.md")[2]
    assert "input_activation" in python_blocks("docs/pytorch.md")[3]


def run_blocks(gpu: bool) -> dict:
    """Execute every document's blocks in order, one namespace per document (the CuPy block only
    with ``gpu``; the emulator's page only without: it is about the CPU, and needs g++); returns
    each block's namespace after it ran, keyed by its name."""
    seen = {}
    for doc, names in DOCUMENTS.items():
        if gpu and doc.startswith("cugrouped/emulate/"):
            continue
        ns: dict = {"__name__": "readme"}
        for name, block in zip(names, python_blocks(doc)):
            if gpu_only(block) and not gpu:
                continue
            if needs_megatron(block) and gpu and not _have("megatron.core"):
                continue        # the GPU image has no megatron-core (CI runs the block)
            exec(compile(block, f"{doc} python block {name!r}", "exec"), ns)
            seen[name] = dict(ns)
    return seen


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module.split(".")[0]) is not None


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
    seen = run_blocks(gpu=False)
    assert "emulator" in seen and "megatron" in seen
    check_examples(seen)


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
    import torch
    gr = seen["graphs"]                  # the replay computed the new input's step
    assert torch.isfinite(gr["dx"]).all() and gr["y"].shape == (192, 128)
    assert all(p.shape == q.shape for p, q in zip(gr["dparams"], gr["layer"].parameters()))


def check_examples(seen: dict) -> None:
    ops, gemms, block, mx, layer = (seen[k] for k in ("ops", "gemms", "block", "mx", "layer"))
    permute, delayed = seen["permute"], seen["delayed"]
    if "emulator" in seen:     # the emulator's example: one launch, then each order from the start
        emu = seen["emulator"]
        assert emu["report"].ok and np.array_equal(emu["x"], np.full(100, 2, np.float32))
    # delayed scaling: every expert with tokens gets 448 / its window's max; the empty one keeps 1
    hist, sc = delayed["history"], delayed["scale"]
    assert hist[1].max() == 0 and sc[1] == 1 and (hist[[0, 2], :3] > 0).all()
    assert np.array_equal(sc[[0, 2]], np.float32(448) / hist[[0, 2]].max(axis=1))
    assert np.array_equal(delayed["scale_inv"], np.float32(1) / sc)
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
    # a checkpoint's block-scaled weights: the cast's buffers bit for bit, and the fprop close
    # to the float product of DeepSeek-V3-style activations
    ck = seen["checkpoint"]
    for name in ("data", "data_t", "scale_inv", "scale_inv_t"):
        assert getattr(ck["w_ckpt"], name).tobytes() == getattr(wb, name).tobytes(), name
    exact = np.concatenate([a @ b.T for a, b in zip(ck["xd"].dequantize(), wb.dequantize())])
    assert ck["yd"].shape == (592, n) and ck["xd"].data_t is None
    assert np.allclose(ck["yd"].astype(np.float32), exact, rtol=2**-7, atol=1e-2)
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
    # Megatron-core's MoE layer spec: its grouped experts over cugrouped's layers
    if "megatron" in seen:
        from cugrouped.pytorch.megatron import (ColumnParallelGroupedLinear,
                                                RowParallelGroupedLinear)
        sub = seen["megatron"]["experts"].submodules
        assert (sub.linear_fc1, sub.linear_fc2) == (ColumnParallelGroupedLinear,
                                                    RowParallelGroupedLinear)
    # the permute folded in: the routed rows' outputs, the gradient summed back onto the tokens
    assert tuple(permute["y"].shape) == (136, 128)
    assert tuple(permute["tokens"].grad.shape) == (64, 256)
    # the activation folded into fc2: fc1's 2 x 512 columns in, the gradient back to x
    sw = seen["swiglu"]
    assert tuple(sw["y"].shape) == (136, 256) and tuple(sw["x"].grad.shape) == (136, 256)
    assert sw["fc2"].input_activation == "swiglu" and sw["fc2"].weight0.grad is not None


def _listed_signatures(doc: str) -> list[tuple[str, str]]:
    """(name, parameters) of each line of ``doc``'s "The calls" block (continuation lines
    indented by four spaces)."""
    text = (ROOT / doc).read_text()
    block = re.search(r"^## The calls\n\n```text\n(.*?)^```", text, flags=re.S | re.M).group(1)
    return re.findall(r"^([\w.]+)\((.*?)\)$", " ".join(block.split("\n    ")), flags=re.M)


def _bare_signature(obj) -> str:
    """``inspect``'s signature without annotations (and without ``self``)."""
    import inspect

    sig = inspect.signature(obj)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    if params and params[0].name == "self":
        params = params[1:]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def test_ops_page_lists_the_signatures_as_they_are():
    """docs/ops.md's "The calls" block: each public op's signature as ``inspect`` reads it (no
    annotations), so the page cannot drift from the code."""
    import cugrouped

    listed = _listed_signatures("docs/ops.md")
    assert [name for name, _ in listed] == [
        "multi_pad_cast_transpose", "multi_block_cast_transpose", "multi_mxfp8_cast_transpose",
        "block_scaled_weights", "grouped_fprop", "grouped_dgrad", "grouped_wgrad", "update_scales"]
    for name, params in listed:
        assert f"({params})" == _bare_signature(getattr(cugrouped, name)), name


def test_pytorch_page_lists_the_signatures_as_they_are():
    pytest.importorskip("torch")
    import cugrouped.pytorch as cpt

    listed = _listed_signatures("docs/pytorch.md")
    objects = {"GroupedLinear": cpt.GroupedLinear.__init__,
               "GroupedLinear.forward": cpt.GroupedLinear.forward,
               "fp8_autocast": cpt.fp8_autocast, "checkpoint": cpt.checkpoint,
               "MoEFeedForward": cpt.MoEFeedForward.__init__,
               "from_te_state_dict": cpt.from_te_state_dict,
               "from_te_extra_state": cpt.from_te_extra_state,
               "FrozenGroupedLinear": cpt.FrozenGroupedLinear.__init__,
               "FrozenGroupedLinear.forward": cpt.FrozenGroupedLinear.forward}
    assert [name for name, _ in listed] == list(objects)
    for name, params in listed:
        assert f"({params})" == _bare_signature(objects[name]), name
