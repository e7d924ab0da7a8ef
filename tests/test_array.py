"""The array interop helpers (:mod:`cugrouped._array`) on the CPU, the device-array paths included:
objects that carry ``__cuda_array_interface__`` stand in for CuPy arrays (their pointers are never
read here)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cugrouped._array import array_is_device, as_bytes, as_view, data_ptr, is_contiguous


def _device_array(typestr, shape, strides=None, ptr=0x7000_0000, device=0, module="cupy"):
    """An object that describes device memory as CuPy arrays do (its class lives in ``module``)."""
    cls = type("ndarray", (), {"__module__": module})
    x = cls()
    x.__cuda_array_interface__ = {"typestr": typestr, "shape": shape, "strides": strides,
                                  "data": (ptr, False), "version": 3}
    x.device = type("Device", (), {"id": device})()
    return x


def test_device_array_view_reads_the_interface():
    x = _device_array("<u2", (6, 5), device=3)
    v = as_view(x, dtype="bfloat16", arg="inputs")
    assert (v.ptr, v.shape, v.strides, v.dtype, v.device, v.kind) == (
        0x7000_0000, (6, 5), (5, 1), "bfloat16", 3, "cupy")
    assert v.on_device and v.itemsize == 2
    strided = as_view(_device_array("<f4", (4, 3), strides=(64, 4)))
    assert strided.strides == (16, 1) and strided.dtype == "float32"


@pytest.mark.parametrize("typestr", ["<u4", "|b1", "<c8"])
def test_device_array_of_an_unsupported_dtype_is_refused_by_name(typestr):
    with pytest.raises(TypeError, match=r"out\.amax: unsupported dtype"):
        as_view(_device_array(typestr, (4,)), arg="out.amax")


def test_foreign_device_arrays_are_placed_by_their_pointer(monkeypatch):
    """An array from another framework (not CuPy) lives where the driver says its pointer is; an
    empty one has no pointer and is taken to be on the current device."""
    cupy = pytest.importorskip("cupy")
    asked = []

    class Attrs:
        device = 5

    monkeypatch.setattr(cupy.cuda.runtime, "pointerGetAttributes",
                        lambda ptr: asked.append(ptr) or Attrs())
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 2)
    v = as_view(_device_array("<f4", (3, 4), ptr=0x5000, module="somelib"))
    assert (v.device, v.kind, asked) == (5, "other", [0x5000])
    empty = as_view(_device_array("<f4", (0, 4), ptr=0, module="somelib"))
    assert (empty.device, empty.ptr, asked) == (2, 0, [0x5000])


def test_array_is_device():
    assert array_is_device(_device_array("<f4", (2, 2)))
    assert not array_is_device(np.zeros(3))
    assert not array_is_device([1, 2])
    torch = pytest.importorskip("torch")
    assert not array_is_device(torch.zeros(3))
    assert not array_is_device(torch.zeros(3, device="meta"))


def test_data_ptr_of_every_kind():
    a = np.arange(12, dtype=np.float32)
    assert data_ptr(a) == a.ctypes.data and data_ptr(a[3:]) == a.ctypes.data + 12
    assert data_ptr(None) == 0
    torch = pytest.importorskip("torch")
    t = torch.arange(8)
    assert data_ptr(t[2:]) == t.data_ptr() + 16


def test_is_contiguous():
    a = np.zeros((4, 6), np.float32)
    assert is_contiguous(as_view(a))
    assert not is_contiguous(as_view(a[:, :3]))        # rows 6 apart, 3 wide
    assert not is_contiguous(as_view(a.T))
    assert is_contiguous(as_view(a[1:2, :]))           # one row: its row stride does not matter
    assert not is_contiguous(as_view(a[:, 0]))         # a column: 6 apart
    assert is_contiguous(as_view(a[:0]))               # empty: contiguous whatever its strides
    assert not is_contiguous(as_view(a[::2]))


def test_as_bytes_views_numpy_fp8_as_uint8_and_leaves_uint8_alone():
    q = np.array([1.0, -2.0, 448.0], dtype=ml_dtypes.float8_e4m3fn)
    b = as_bytes(q)
    assert b.dtype == np.uint8 and b.ctypes.data == q.ctypes.data
    assert b.tolist() == q.view(np.uint8).tolist()
    u = np.zeros(4, np.uint8)
    assert as_bytes(u) is u


@pytest.mark.parametrize("shape,strides", [((3, 4), (10, 4)), ((3, 4), (16, 2)), ((5,), (6,)),
                                           ((2, 2, 2), (16, 8, 2))])
def test_numpy_strides_must_be_whole_items(shape, strides):
    """A NumPy view whose byte strides are not whole items cannot be described in elements (what
    the kernels take): refused, naming the argument, for 2-D arrays and any other rank."""
    buf = np.zeros(64, np.float32)
    x = np.lib.stride_tricks.as_strided(buf, shape=shape, strides=strides)
    with pytest.raises(ValueError, match=r"^inputs\[2\]: strides .* are not a multiple of the "
                                         r"item size$"):
        as_view(x, arg="inputs[2]")
    good = np.lib.stride_tricks.as_strided(buf, shape=shape, strides=tuple(4 * (s // 4 or 1)
                                                                           for s in strides))
    assert as_view(good).strides == tuple(s // 4 for s in good.strides)


@pytest.mark.parametrize("shape, dtype", [((3, 5), np.float32), (7, np.uint8), ((0, 4), np.int64)])
def test_device_like_host_empty_is_256_byte_aligned(shape, dtype):
    from cugrouped._array import DeviceLikeHost

    for _ in range(4):
        a = DeviceLikeHost.empty(shape, dtype)
        assert a.shape == ((shape,) if isinstance(shape, int) else shape)
        assert a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
        assert a.ctypes.data % 256 == 0 or a.size == 0
