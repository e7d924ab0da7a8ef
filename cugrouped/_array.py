"""Array interop: one small view type over NumPy, CuPy, torch and any DLPack / CUDA-array-interface
producer, without importing torch.

CuPy has no bfloat16 or float8 dtypes: such data travels as a 16-bit or 8-bit integer view plus a
dtype tag (``as_view(x, dtype="bfloat16")``). NumPy arrays may carry ml_dtypes' ``bfloat16`` /
``float8_*`` dtypes directly; torch tensors carry their own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["ArrayView", "as_view", "array_kind", "array_is_device", "data_ptr", "is_contiguous",
           "as_bytes", "DeviceLikeHost", "DTYPE_ITEMSIZE", "FLOAT_INPUT_DTYPES"]

# Names we use for dtypes, and their size in bytes.
DTYPE_ITEMSIZE = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "int32": 4, "int64": 8, "float64": 8,
}
FLOAT_INPUT_DTYPES = ("float32", "float16", "bfloat16")
# Integer carriers a caller may tag with a wider meaning (CuPy has no bf16/fp8 dtypes).
_CARRIERS = {"uint16": ("bfloat16", "float16"), "int16": ("bfloat16", "float16"),
             "uint8": ("float8_e4m3fn", "float8_e5m2"), "int8": ("float8_e4m3fn", "float8_e5m2")}


_KINDS: dict = {}   # type -> kind


def array_kind(x: Any) -> str:
    """``"numpy"``, ``"cupy"``, ``"torch"`` or ``"other"`` (by module name; imports nothing)."""
    t = type(x)
    kind = _KINDS.get(t)
    if kind is None:   # by the class or a base class (a user's torch.Tensor subclass is torch)
        mods = [c.__module__.split(".")[0] for c in t.__mro__]
        kind = _KINDS[t] = ("numpy" if issubclass(t, np.ndarray) else
                            next((m for m in mods if m in ("cupy", "torch")), "other"))
    return kind


def _dtype_name(dt: Any) -> str:
    name = str(dt)
    return name[len("torch."):] if name.startswith("torch.") else name


@dataclasses.dataclass(slots=True)
class ArrayView:
    """What a kernel needs to know about an array: where it is and how it is laid out.

    ``strides`` are in elements. ``device`` is ``-1`` for host memory, else the CUDA device ordinal.
    ``owner`` keeps the original object alive (and is what results are built from).
    Treat it as immutable (``dataclasses.replace`` for a changed copy). Not frozen: a frozen
    dataclass costs ~2 us more per construction, and the ops build one per expert per call.
    """

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    device: int
    kind: str
    owner: Any

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def on_device(self) -> bool:
        return self.device >= 0

    def is_row_major_rows(self) -> bool:
        """2-D with unit column stride (rows may be further apart than their length)."""
        return len(self.shape) == 2 and (self.shape[1] <= 1 or self.strides[1] == 1) and \
            (self.shape[0] <= 1 or self.strides[0] >= self.shape[1])


_NP_NAMES: dict = {}
_TORCH_NAMES: dict = {}     # torch.dtype -> our name
_TORCH_DEVICES: dict = {}   # torch.device -> ordinal (-1: CPU)


def _np_name(dt: np.dtype) -> str:
    """``dt.name``, memoised (NumPy computes it from scratch on every access)."""
    name = _NP_NAMES.get(dt)
    if name is None:
        name = _NP_NAMES[dt] = dt.name
    return name


def _retag(name: str, dtype: str | None, arg: str) -> str:
    if dtype is None or dtype == name:
        return name
    if dtype in _CARRIERS.get(name, ()):
        return dtype
    carriers = [c for c, v in _CARRIERS.items() if dtype in v]
    if not carriers:
        tags = sorted({t for v in _CARRIERS.values() for t in v})
        raise TypeError(f"{arg}: dtype={dtype!r} is not a dtype tag; expected one of {tags} (for "
                        f"integer views of those types) or None")
    raise TypeError(f"{arg}: got an array of dtype {name}, which cannot be read as dtype={dtype!r} "
                    f"(expected {dtype} data, or a same-size integer view of it: {carriers})")


def as_view(x: Any, *, dtype: str | None = None, arg: str = "array") -> ArrayView:
    """Describe ``x`` (NumPy, CuPy, torch, or anything with DLPack / CUDA array interface).

    ``dtype`` re-tags an integer carrier, e.g. a CuPy ``uint16`` array holding bfloat16 bits.
    """
    kind = array_kind(x)
    if kind == "numpy":
        name = _np_name(x.dtype)
        if dtype is not None:
            name = _retag(name, dtype, arg)
        if name not in DTYPE_ITEMSIZE:
            raise TypeError(f"{arg}: unsupported dtype {x.dtype}")
        isz, st = x.itemsize, x.strides
        if len(st) == 2:        # the common case, without a generator (on every array of a call)
            if st[0] % isz or st[1] % isz:
                raise ValueError(f"{arg}: strides {st} are not a multiple of the item size")
            strides = (st[0] // isz, st[1] // isz)
        elif any(b % isz for b in st):
            raise ValueError(f"{arg}: strides {st} are not a multiple of the item size")
        else:
            strides = tuple(b // isz for b in st)
        return ArrayView(x.ctypes.data, x.shape, strides, name, -1, kind, x)
    if kind == "torch":
        name = _TORCH_NAMES.get(x.dtype)
        if name is None:
            name = _TORCH_NAMES[x.dtype] = _dtype_name(x.dtype)
        if dtype is not None:
            name = _retag(name, dtype, arg)
        if name not in DTYPE_ITEMSIZE:
            raise TypeError(f"{arg}: unsupported dtype {x.dtype}")
        d = x.device
        dev = _TORCH_DEVICES.get(d)
        if dev is None:
            if d.type not in ("cuda", "cpu"):
                raise ValueError(f"{arg}: tensors on {d} are not supported (expected cuda or cpu)")
            dev = _TORCH_DEVICES[d] = -1 if d.type == "cpu" else (d.index or 0)
        return ArrayView(x.data_ptr(), tuple(x.shape), x.stride(), name, dev, kind, x)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None and hasattr(x, "__dlpack__") and kind != "cupy":
        import cupy  # a device array from another framework: let CuPy read the DLPack capsule

        return as_view(cupy.from_dlpack(x), dtype=dtype, arg=arg)
    if cai is None:
        raise TypeError(f"{arg}: expected a NumPy, CuPy or torch array (or an object with "
                        f"__cuda_array_interface__ / __dlpack__), got {type(x).__name__}")
    np_dtype = np.dtype(cai["typestr"])
    name = _retag(np_dtype.name, dtype, arg)
    if name not in DTYPE_ITEMSIZE:
        raise TypeError(f"{arg}: unsupported dtype {np_dtype}")
    shape = tuple(cai["shape"])
    if cai.get("strides") is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
    else:
        strides = tuple(s // np_dtype.itemsize for s in cai["strides"])
    if kind == "cupy":
        device = x.device.id
    else:   # another framework's array: its pointer says where it lives (an empty one has none)
        import cupy

        ptr = cai["data"][0]
        device = (cupy.cuda.runtime.pointerGetAttributes(ptr).device if ptr
                  else cupy.cuda.runtime.getDevice())
    return ArrayView(int(cai["data"][0]), shape, strides, name, device, kind, x)


def array_is_device(x: Any) -> bool:
    """True for a CuPy array, a CUDA torch tensor, or anything with ``__cuda_array_interface__``
    (without importing torch)."""
    return hasattr(x, "__cuda_array_interface__") or (
        type(x).__module__.startswith("torch")
        and getattr(getattr(x, "device", None), "type", "") == "cuda")


def data_ptr(a: Any) -> int:
    """The data pointer of a NumPy / CuPy / torch array (or anything :func:`as_view` reads); 0 for
    None."""
    if a is None:
        return 0
    kind = array_kind(a)
    if kind == "numpy":
        return a.ctypes.data
    if kind == "cupy":
        return a.data.ptr
    if kind == "torch":
        return a.data_ptr()
    return as_view(a).ptr


def is_contiguous(v: ArrayView) -> bool:
    """C-contiguous, ignoring the strides of size-1 dimensions; an empty view is contiguous
    (torch reports 0 strides for those)."""
    if 0 in v.shape:
        return True
    expect, acc = [], 1
    for n in reversed(v.shape):
        expect.append(acc)
        acc *= n
    return all(s == e for s, e, n in zip(v.strides, reversed(expect), v.shape) if n > 1)


def as_bytes(a: Any) -> Any:
    """NumPy / CuPy buffers (FP8 ones included) as their bytes; torch callers pass uint8 tensors
    already."""
    if array_kind(a) in ("numpy", "cupy") and a.dtype != np.uint8:
        return a.view(np.uint8)
    return a


class DeviceLikeHost:
    """``empty`` as the emulate backend's ``xp``: NumPy arrays whose data starts on a 256-byte
    boundary, as ``cudaMalloc``'s (and CuPy's, torch's) do, so that an emulated kernel takes the
    GPU's alignment-dependent paths and its traced sectors (cugrouped.emulate.access) are the
    GPU's; NumPy itself aligns to 16 bytes only."""

    ALIGN = 256

    @staticmethod
    def empty(shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = np.empty(nbytes + DeviceLikeHost.ALIGN, np.uint8)
        off = -raw.ctypes.data % DeviceLikeHost.ALIGN
        return raw[off:off + nbytes].view(dtype).reshape(shape)

