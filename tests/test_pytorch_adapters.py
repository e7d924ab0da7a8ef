"""torch <-> NumPy/CuPy adapters: zero copies (same pointer), dtypes restored, the op launched on
torch's current stream; the custom ops' fake implementations agree with the real ones in shape."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from cugrouped.pytorch import _custom_ops as cops
from cugrouped.pytorch._adapters import FP8_TORCH_DTYPES, launch_context, numpy_dtype, to_array


@pytest.mark.parametrize("dtype, np_dtype", [
    (torch.float32, np.float32), (torch.float64, np.float64), (torch.float16, np.float16),
    (torch.bfloat16, ml_dtypes.bfloat16), (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
    (torch.float8_e5m2, ml_dtypes.float8_e5m2), (torch.uint8, np.uint8)])
def test_cpu_round_trip_is_zero_copy_and_keeps_dtype(dtype, np_dtype):
    t = torch.randn(6, 8).to(dtype)[1:5]          # a view with an offset
    a, tag = to_array(t)
    assert tag is None and a.dtype == np.dtype(np_dtype) and numpy_dtype(dtype) == a.dtype
    assert a.ctypes.data == t.data_ptr() and a.shape == tuple(t.shape)
    back = torch.from_numpy(a.view(np.uint8 if a.itemsize == 1 else
                                   {2: np.int16, 4: np.float32, 8: np.float64}[a.itemsize]))
    back = back.view(dtype)
    assert back.data_ptr() == t.data_ptr() and back.dtype == dtype
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_writes_through_the_view_reach_the_tensor():
    t = torch.zeros(4, dtype=torch.bfloat16)
    to_array(t)[0][2] = ml_dtypes.bfloat16(1.5)
    assert t[2].item() == 1.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_cpu_views_leave_the_storage_resizable(dtype):
    """FSDP2 frees unsharded parameters with storage.resize_(0): a view made for an op must not
    mark the storage non-resizable (Tensor.numpy() does, for good)."""
    t = torch.zeros(4, 8).to(dtype)
    to_array(t)
    assert t.untyped_storage().resizable()
    t.untyped_storage().resize_(0)


def test_launch_context_is_a_no_op_on_cpu():
    with launch_context(torch.device("cpu")):
        pass


def test_cupy_stream_objects_are_made_once_per_stream_without_warnings():
    """launch_context's CuPy view of torch's stream: one object per (handle, device), kept, with
    CuPy 14's ExternalStream deprecation warning silenced (it would fire on every op call)."""
    import warnings

    from cugrouped.pytorch._adapters import cupy_stream

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = cupy_stream(0x5000, 0)
        assert cupy_stream(0x5000, 0) is a and a.ptr == 0x5000
        b = cupy_stream(0x5000, 1)
        assert b is not a and b.ptr == 0x5000


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fake_impls_match_real_shapes(fmt):
    xs = [torch.randn(m, 32) for m in (3, 0, 17)]
    real = cops.fp8_quantize(xs, fmt, 0, 16, True, True, True, None, None, 0, "reference")
    with torch._subclasses.FakeTensorMode() as mode:
        fake_xs = [mode.from_tensor(x) for x in xs]
        fake = cops.fp8_quantize(fake_xs, fmt, 0, 16, True, True, True, None, None, 0, "reference")
    assert [tuple(r.shape) for r in real] == [tuple(f.shape) for f in fake]
    assert [r.dtype for r in real] == [f.dtype for f in fake]
    assert real[1].numel() == 32 * (16 + 0 + 32)
    assert FP8_TORCH_DTYPES[fmt] in (torch.float8_e4m3fn, torch.float8_e5m2)


def test_cuda_export_asks_torch_for_no_cross_stream_sync():
    """CUDA tensors are exported for torch's current stream (the ops run there): whatever stream
    CuPy offers, ``__dlpack__`` gets ``stream=-1``, so torch records no event and makes no other
    stream (the legacy default one) wait."""
    from cugrouped.pytorch._adapters import _SameStream

    seen = []

    class Tensor:
        def __dlpack__(self, stream=None, max_version=None, copy=None):
            seen.append((stream, max_version, copy))
            return "capsule"

        def __dlpack_device__(self):
            return (2, 3)

    w = _SameStream(Tensor())
    assert w.__dlpack_device__() == (2, 3)
    assert w.__dlpack__(stream=1, max_version=(1, 0), copy=None) == "capsule"
    assert w.__dlpack__(stream=0x1234) == "capsule"
    assert seen == [(-1, (1, 0), None), (-1, None, None)]
    t = torch.arange(4.0)      # torch accepts stream=-1 (CPU: the only value besides None)
    assert torch.from_dlpack(_SameStream(t).__dlpack__(stream=7)).data_ptr() == t.data_ptr()


@pytest.mark.gpu
def test_cuda_round_trip_same_pointer_and_stream(monkeypatch):
    import cupy

    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        t = torch.randn(5, 16, device="cuda").to(dtype)
        a, tag = to_array(t)
        assert a.data.ptr == t.data_ptr()
        assert tag == (None if dtype == torch.float32 else str(dtype).removeprefix("torch."))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), launch_context(torch.device("cuda")):
        assert cupy.cuda.get_current_stream().ptr == s.cuda_stream
    # on a side stream, outside launch_context: no event recorded for the legacy default stream
    events = []
    real_event = torch.cuda.Event
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: events.append(1) or real_event(*a, **k))
    t = torch.randn(5, 16, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        a, _ = to_array(t)
    assert a.data.ptr == t.data_ptr() and events == []


def test_array_views_read_torch_tensors_and_their_subclasses():
    """The ops read torch tensors (parameters and user subclasses too) through their pointers."""
    from cugrouped._array import array_kind, as_view

    class Tagged(torch.Tensor):        # a user subclass, defined outside torch
        pass

    base = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    for t in (base, torch.nn.Parameter(base.clone()), base.as_subclass(Tagged)):
        assert array_kind(t) == "torch", type(t)
        v = as_view(t[:, 1:])
        assert (v.ptr, v.shape, v.strides, v.dtype, v.device) == (
            t.data_ptr() + 2, (3, 3), (4, 1), "bfloat16", -1)


def test_eager_calls_skip_the_dispatcher_only_outside_tracing():
    """The layer calls the ops' Python bodies in eager mode (no dispatcher round trip) and the
    registered custom ops under a dispatch mode or torch.compile; both give the same bits."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cugrouped.pytorch import _custom_ops as cops

    assert not cops._tracing()
    with FakeTensorMode():
        assert cops._tracing()
    xs = [torch.randn(5, 16), torch.randn(0, 16), torch.randn(9, 16)]
    args = (xs, "e4m3", 0, 16, True, True, True, None, None, 0, "reference")
    for a, b in zip(cops.eager.fp8_quantize(*args), cops.fp8_quantize(*args)):
        assert torch.equal(a, b)
    assert set(vars(cops.eager)) == {"fp8_quantize", "fp8_block_quantize", "fp8_fprop",
                                     "fp8_dgrad", "fp8_wgrad",
                                     "fp8_wgrad_main_grad", "wgrad_main_grad", "scale_update",
                                     "scatter_rows_sum"}


def test_import_without_torch_says_how_to_get_it():
    import subprocess
    import sys
    code = ("import sys\nsys.modules['torch'] = None\ntry:\n    import cugrouped.pytorch\n"
            "except ImportError as e:\n    print(e)\nimport cugrouped\nprint(cugrouped.__version__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "cugrouped.pytorch needs PyTorch: pip install torch (or the torch extra, pip install " \
        "'.[cuda13,torch]'" in out
    assert out.strip().endswith(__import__("cugrouped").__version__)   # the ops import without it
