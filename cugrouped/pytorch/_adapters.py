"""torch <-> NumPy / CuPy with zero copies, and the stream the ops launch on.

* CPU tensors become NumPy views (``np.from_dlpack`` of the detached tensor: same memory, and
  the tensor's storage stays resizable, unlike after ``Tensor.numpy()``).
  bfloat16 and float8 tensors go through an integer view of the same bytes and come out with
  ml_dtypes' ``bfloat16`` / ``float8_e4m3fn`` / ``float8_e5m2`` dtypes, which the ops read directly.
* CUDA tensors become CuPy arrays through DLPack (same device pointer). CuPy has no bfloat16 or
  float8 dtypes: those travel as ``int16`` / ``uint8`` carriers and the caller passes the dtype
  tag (:func:`to_array` returns it) to the op.
* Every output is allocated by torch (its caching allocator on the GPU) and handed to the ops as
  ``out=`` buffers, so results come back as the torch tensors that were allocated: dtypes are
  torch's own, with no conversion or copy.
* :func:`launch_context` makes ``torch.cuda.current_stream()`` CuPy's current stream (and the
  tensor's device current) for the duration of an op, so kernels and cuBLASLt calls are ordered
  with the surrounding torch work and nothing synchronises.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import ml_dtypes
import numpy as np
import torch

__all__ = ["to_array", "dtype_name", "launch_context", "FP8_TORCH_DTYPES", "TORCH_DTYPES"]

FP8_TORCH_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}
_CARRIER = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
            torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
            torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2)}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the names the ops use)."""
    return str(dtype).removeprefix("torch.")


def to_array(t: torch.Tensor) -> tuple[Any, str | None]:
    """A NumPy (CPU) or CuPy (CUDA) view of ``t`` with no copy, and the dtype tag to pass to the
    ops when the array is an integer carrier (CuPy bfloat16/float8), else None."""
    t = t.detach()
    carrier = _CARRIER.get(t.dtype)
    if t.device.type == "cpu":
        # np.from_dlpack, not Tensor.numpy(): .numpy() marks the storage non-resizable for
        # good, which breaks FSDP2 (it frees unsharded parameters with storage.resize_(0))
        if carrier is None:
            return np.from_dlpack(t), None
        return np.from_dlpack(t.view(carrier[0])).view(carrier[1]), None
    if t.device.type != "cuda":
        raise ValueError(f"tensors on {t.device} are not supported (expected cuda or cpu)")
    import cupy

    if carrier is None:
        return cupy.from_dlpack(_SameStream(t)), None
    return cupy.from_dlpack(_SameStream(t.view(carrier[0]))), dtype_name(t.dtype)


class _SameStream:
    """A CUDA tensor exported for use on torch's current stream (where :func:`launch_context` runs
    every op): ``__dlpack__`` is asked for no cross-stream ordering (``stream=-1``).

    ``cupy.from_dlpack(tensor)`` passes CuPy's current stream instead, which outside
    :func:`launch_context` is the legacy default stream: whenever torch's current stream is another
    one (``torch.cuda.stream(s)``, a CUDA graph capture), torch then records an event on its stream
    and makes the legacy stream wait for it, for every tensor converted (work on the legacy stream,
    and an error during graph capture). CuPy still sets the tensor's device around the call.
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, *, stream=None, **kwargs):
        return self.tensor.__dlpack__(stream=-1, **kwargs)


@contextlib.contextmanager
def launch_context(device: torch.device):
    """On CUDA: CuPy's current device and stream are torch's current ones (no sync, no copy)."""
    if device.type != "cuda":
        yield
        return
    import cupy

    idx = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(idx):
        with cupy_stream(torch.cuda.current_stream(idx).cuda_stream, idx):
            yield


_STREAMS: dict = {}


def cupy_stream(handle: int, device: int):
    """CuPy's view of the CUDA stream ``handle`` on ``device``, made once per stream and kept (a
    stream object per op call costs a few us, and CuPy 14 warns on every ``ExternalStream``:
    deprecated for ``Stream.from_external``, which cannot yet be told the device; the warning is
    silenced here). A handle reused by a new stream maps to the same, still correct, object."""
    key = (handle, device)
    stream = _STREAMS.get(key)
    if stream is None:
        import cupy

        if len(_STREAMS) >= 256:
            _STREAMS.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = _STREAMS[key] = cupy.cuda.ExternalStream(handle, device)
    return stream


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """NumPy dtype of a CPU view (:func:`to_array`) of a tensor of ``dtype``."""
    carrier = _CARRIER.get(dtype)
    return np.dtype(carrier[1]) if carrier else torch.empty(0, dtype=dtype).numpy().dtype
