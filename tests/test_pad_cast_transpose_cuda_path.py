"""The cast op's CUDA launch path, run on the CPU up to and including the kernel.

The arrays are host arrays that the op is made to see as device arrays on device 0, the kernel
"launch" takes the exact argument tuple the CUDA path builds (argument block by value, uint64
pointers, the per-stream workspaces) and runs the same CUDA source on the emulator with it. So
the argument order and C widths, the pointer derivation for every array kind (NumPy stands in
for CuPy, torch CPU tensors for CUDA ones), the workspaces, the chunk slicing and the device scope
are all exercised and bit-compared with the reference; only CuPy's launcher and the GPU are not.
"""

from __future__ import annotations

import contextlib
import types
import dataclasses

import numpy as np
import pytest

from cugrouped import _jit, reference
from cugrouped.grouped_fp8 import GroupedFP8
from cugrouped.ops import _cast_inputs, _launch
from cugrouped.ops import pad_cast_transpose as pct

from test_pad_cast_transpose import assert_same_bits, make_inputs, scales_for


@pytest.fixture
def fake_device(monkeypatch):
    """Host arrays seen as device-0 arrays; launches recorded and run on the emulator; the
    workspaces are host buffers kept per name (as they are per stream on a GPU)."""
    workspaces: dict = {}

    def workspace(name, ints):
        if name not in workspaces or workspaces[name].size < ints:
            workspaces[name] = np.zeros(ints, np.int32)
        return workspaces[name]

    monkeypatch.setattr(_launch, "device_workspace", workspace)
    scratch: dict = {}

    def device_scratch(name, nbytes):       # kept alive like the real one; garbage-filled
        if name not in scratch or scratch[name].size < nbytes:
            scratch[name] = np.full(nbytes, 0xFF, np.uint8)
        return scratch[name]

    monkeypatch.setattr(_launch, "device_scratch", device_scratch)
    scopes = []
    monkeypatch.setattr(_launch, "device_scope",
                        lambda backend, device: scopes.append((backend, device)) or contextlib.nullcontext())
    calls = []

    def get_function(spec, name):
        def launch(grid, block, args):
            calls.append((name, grid, block, args))
            _jit.get_emulated_function(spec, name)(grid, block, args, order="shuffle")
        return launch

    monkeypatch.setattr(pct._jit, "get_function", get_function)
    return calls, workspaces, scopes


def on_device(fn, *args, **kw):
    """Call ``fn`` with every array the op views seen as living on device 0."""
    real_view = pct.as_view
    with pytest.MonkeyPatch.context() as mp:
        for module in (pct, _cast_inputs):     # the op's checks and the inputs' normalisation
            mp.setattr(module, "as_view",
                       lambda x, **k: dataclasses.replace(real_view(x, **k), device=0))
        return fn(*args, **kw)


def _out_buffers(m_splits, k, align, column_sums, scale, device_splits=False, fmt="e4m3"):
    E, rows = len(m_splits), sum(m_splits)
    col = k * (rows + E * (align - 1)) if device_splits else k * sum(pct.padded_splits(m_splits, align))
    return GroupedFP8(data=np.full((rows, k), 0xAB, np.uint8), data_t=np.full(col, 0xCD, np.uint8),
                      m_splits=(), m_pad_splits=(), amax=np.full(E, np.nan, np.float32),
                      scale=scale if scale is not None else np.full(E, np.nan, np.float32),
                      scale_inv=np.full(E, np.nan, np.float32), fp8_format=fmt, k=k,
                      align=align,
                      column_sums=np.full((E, k), np.nan, np.float32) if column_sums else None)


def _fp8_view(res, fmt):
    import ml_dtypes

    return dataclasses.replace(res, data=res.data.view(
        ml_dtypes.float8_e4m3fn if fmt == "e4m3" else ml_dtypes.float8_e5m2))


@pytest.mark.parametrize("form", ["list", "tensor", "device"])
@pytest.mark.parametrize("given", [True, False, "options"])
@pytest.mark.parametrize("experts", [5, 70])          # one chunk; two chunks (sliced per chunk)
def test_cuda_path_arguments_run_the_kernel_to_the_reference_bits(fake_device, form, given, experts):
    """``given="options"``: current scaling with amax_epsilon and power_2_scale (which reach the
    kernel as its 5th and 6th arguments)."""
    calls, workspaces, scopes = fake_device
    opts = dict(amax_epsilon=0.75, power_2_scale=True) if given == "options" else {}
    given = given is True
    rng = np.random.default_rng(experts)
    m_splits = [int(v) for v in rng.integers(0, 40, experts)]
    m_splits[experts // 2] = 0
    k, align, fmt = 48, 16, "e5m2" if given else "e4m3"
    xs = make_inputs(m_splits, k, "bfloat16", seed=experts)
    scale = scales_for(m_splits, fmt, 3) if given else None
    x = np.concatenate(xs)
    args = {"list": (xs, None), "tensor": (x, m_splits),
            "device": (x, np.array(m_splits, np.int64))}[form]
    out = _out_buffers(m_splits, k, align, True, scale, device_splits=form == "device", fmt=fmt)
    got = on_device(pct.cast_arrays, *args, fp8_format=fmt, scale=scale, align=align,
                    column_sums=True, out=out, splits_on_device=form == "device" or None, **opts)
    want = reference.multi_pad_cast_transpose(xs, fp8_format=fmt, scale=scale, align=align,
                                              column_sums=True, **opts)
    assert_same_bits(_fp8_view(got, fmt), want, form)
    chunks = -(-experts // pct.MAX_EXPERTS_PER_LAUNCH)
    assert len(calls) == chunks * (1 if given else 2)
    assert scopes == [("cuda", 0)]
    for name, grid, block, a in calls:
        assert block == (pct.THREADS,)
        # (PctGroup g, i64 k, i32 align, i32 margin, float amax_epsilon, i32 power_2_scale,
        #  7 pointers, i32 amax_accumulate)
        # the argument block by value: a CuPy CPointer at the record's bytes (_launch.by_value)
        from cupy.cuda.function import CPointer

        assert isinstance(a[0], CPointer) and a[0].ptr == a[0].arg.ctypes.data
        assert a[0].arg.dtype == pct.group_dtype() and a[0].arg.shape == ()
        assert [type(v) for v in a[1:]] == [np.int64, np.int32, np.int32, np.float32, np.int32] \
            + [np.uint64] * 7 + [np.int32]
        assert int(a[13]) == 0
        assert (int(a[1]), int(a[2]), int(a[3])) == (k, align, 0)
        assert (float(a[4]), int(a[5])) == ((0.75, 1) if opts else (0.0, 0))
        assert int(a[9]) == workspaces["pad_cast_transpose"].ctypes.data
        if "CAST>" in name:      # the second pass of current scaling takes no column sums
            assert int(a[10]) == int(a[11]) == int(a[12]) == 0
        else:
            assert int(a[10]) != 0 and int(a[12]) == workspaces["pad_cast_transpose.colsum"].ctypes.data
    for name, ws in workspaces.items():
        assert not ws.any(), f"{name} left non-zero"


def test_cuda_path_reads_torch_tensors_through_their_pointers(fake_device):
    """What the torch front hands the op for CUDA tensors (tensors in, uint8 tensors as ``out``),
    with torch CPU tensors standing in: pointers via ``data_ptr``, no conversion."""
    torch = pytest.importorskip("torch")
    calls, _, _ = fake_device
    m_splits, k = [7, 0, 20], 32
    xs = make_inputs(m_splits, k, "bfloat16", seed=1)
    ts = [torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in xs]
    scale = scales_for(m_splits, "e4m3", 1)
    out_np = _out_buffers(m_splits, k, 16, False, scale)
    out = dataclasses.replace(out_np, **{f: torch.from_numpy(getattr(out_np, f))
                                         for f in ("data", "data_t", "amax", "scale", "scale_inv")})
    res = on_device(pct.cast_arrays, ts, scale=out.scale, out=out)
    assert res.data is out.data and res.data_t is out.data_t
    want = reference.multi_pad_cast_transpose(xs, scale=scale)
    assert_same_bits(_fp8_view(dataclasses.replace(out_np, m_splits=res.m_splits,
                                                   m_pad_splits=res.m_pad_splits), "e4m3"), want)
    [(_, _, _, a)] = calls
    assert int(a[6]) == out.scale.data_ptr() and int(a[0].arg["in"][0]) == ts[0].data_ptr()


def test_cuda_path_allocates_new_outputs_on_the_inputs_device(fake_device, monkeypatch):
    """CuPy allocates on the current device: the outputs the op makes must come from inside the
    inputs' device scope (inputs on device 1 while device 0 is current would otherwise get
    device-0 outputs, written by kernels on device 1)."""
    calls, _, _ = fake_device
    inside, seen = [], []

    @contextlib.contextmanager
    def scope(backend, device):
        inside.append(device)
        try:
            yield
        finally:
            inside.pop()

    monkeypatch.setattr(_launch, "device_scope", scope)
    real_outputs = pct._outputs
    monkeypatch.setattr(pct, "_outputs", lambda g, xp, *a: seen.append(list(inside)) or
                        real_outputs(g, np, *a))   # NumPy stands in for CuPy's allocator
    m_splits, k = [5, 0, 19], 32
    xs = make_inputs(m_splits, k, "bfloat16", seed=3)
    got = on_device(pct.cast_arrays, xs, column_sums=True)
    assert seen == [[0]] and len(calls) == 2
    want = reference.multi_pad_cast_transpose(xs, column_sums=True)
    assert_same_bits(_fp8_view(got, "e4m3"), want)


def test_outgrown_workspaces_are_retired_not_freed(monkeypatch):
    """A per-stream workspace or scratch outgrown by a larger call is replaced (zeroed / larger)
    but the old buffer stays alive: a CUDA graph captured before still uses its pointer, and
    CuPy's pool would hand freed memory to the next allocation on that stream."""
    import gc
    import weakref

    cupy = pytest.importorskip("cupy")

    class Device:
        id = 0

    class Stream:
        ptr = 0x5A00

    monkeypatch.setattr(cupy.cuda, "Device", lambda: Device())
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: Stream())
    monkeypatch.setattr(cupy, "zeros", np.zeros)
    monkeypatch.setattr(cupy, "empty", np.empty)
    monkeypatch.setattr(cupy.cuda.runtime, "streamIsCapturing", lambda ptr: False, raising=False)
    for table in ("_workspaces", "_scratch", "_retired"):
        monkeypatch.setattr(_launch, table, {} if table != "_retired" else [], raising=False)
    ws = _launch.device_workspace("count", 10)
    assert _launch.device_workspace("count", 7) is ws      # large enough: the same buffer
    old_ws = weakref.ref(ws)
    sc = _launch.device_scratch("partial", 100)
    old_sc = weakref.ref(sc)
    ws.fill(1)                  # as a graph's launches might have left it mid-replay
    del ws, sc
    new_ws = _launch.device_workspace("count", 11)
    new_sc = _launch.device_scratch("partial", (1 << 16) + 1)
    gc.collect()
    assert old_ws() is not None and old_sc() is not None, "outgrown buffer freed"
    assert new_ws.size >= 20 and not new_ws.any() and new_sc.size >= 1 << 17
    assert _launch.device_workspace("count", 11) is new_ws


def test_workspace_allocation_inside_a_graph_capture_is_refused_clearly(monkeypatch):
    """A stream's first workspace (or a larger one) needs a cudaMalloc, which invalidates a CUDA
    graph capture with a bare CUDA error: refused before any allocation, saying what to do; a
    buffer already made on that stream is used during capture as usual."""
    cupy = pytest.importorskip("cupy")

    class Device:
        id = 0

    class Stream:
        ptr = 0x5B00

    capturing = []
    monkeypatch.setattr(cupy.cuda, "Device", lambda: Device())
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: Stream())
    monkeypatch.setattr(cupy.cuda.runtime, "streamIsCapturing",
                        lambda ptr: bool(capturing) and ptr == Stream.ptr, raising=False)
    monkeypatch.setattr(cupy, "zeros", np.zeros)
    monkeypatch.setattr(cupy, "empty", np.empty)
    for table in ("_workspaces", "_scratch", "_retired"):
        monkeypatch.setattr(_launch, table, {} if table != "_retired" else [], raising=False)
    ws, sc = _launch.device_workspace("count", 64), _launch.device_scratch("partial", 100)
    capturing.append(True)
    assert _launch.device_workspace("count", 64) is ws and _launch.device_scratch("partial", 100) is sc
    monkeypatch.setattr(cupy, "zeros", lambda *a, **k: pytest.fail("allocated during capture"))
    monkeypatch.setattr(cupy, "empty", lambda *a, **k: pytest.fail("allocated during capture"))
    with pytest.raises(RuntimeError, match="torch.cuda.graph"):
        _launch.device_workspace("count", 65)
    with pytest.raises(RuntimeError, match="capture"):
        _launch.device_scratch("partial", 1 << 20)
    assert _launch.device_workspace("count", 64) is ws


@pytest.mark.parametrize("form", ["host", "device"])
def test_cuda_path_gather_reads_out_of_range_indices_as_zero_rows(fake_device, form):
    """Device row indices cannot be checked without a sync: the kernel reads an index outside
    ``[0, tokens)`` as a zero row (like a negative one), never memory past the token matrix."""
    calls, _, _ = fake_device
    m_splits, T, k = [5, 0, 21], 12, 32
    tokens = make_inputs([T], k, "bfloat16", seed=2)[0]
    idx = np.random.default_rng(3).integers(0, T, sum(m_splits)).astype(np.int64)
    idx[[1, 7, 20]] = [T, T + 1000, -5]
    splits = np.array(m_splits, np.int64) if form == "device" else m_splits
    out = _out_buffers(m_splits, k, 16, True, None, device_splits=form == "device")
    got = on_device(pct.cast_arrays, tokens, splits, row_index=idx, out=out, column_sums=True,
                    splits_on_device=form == "device" or None)
    safe = np.where(idx >= T, -1, idx)
    want = reference.multi_pad_cast_transpose(tokens, m_splits, row_index=safe, column_sums=True)
    assert_same_bits(_fp8_view(got, "e4m3"), want, form)
    block = calls[0][3][0].arg
    assert int(block["row_index"]) == idx.ctypes.data and int(block["src_rows"]) == T


@pytest.mark.parametrize("stray", ["scale", "data", "data_t", "amax", "scale_inv", "m_splits"])
def test_a_buffer_on_another_device_is_refused_before_any_launch(fake_device, stray):
    """Every array must live on the inputs' device (a kernel on device 0 handed device-1 memory
    faults or writes another GPU's memory): one on device 1 is refused, naming it."""
    calls, _, _ = fake_device
    m_splits, k = [7, 0, 20], 32
    xs = make_inputs(m_splits, k, "float32", seed=4)
    counts = np.array(m_splits, np.int64)
    scale = scales_for(m_splits, "e4m3", 4)
    out = _out_buffers(m_splits, k, 16, False, scale, device_splits=True)
    obj = {"scale": scale, "m_splits": counts}.get(stray)
    obj = getattr(out, stray) if obj is None else obj
    real_view = pct.as_view
    with pytest.MonkeyPatch.context() as mp:
        for module in (pct, _cast_inputs):
            mp.setattr(module, "as_view", lambda x, **kw: dataclasses.replace(
                real_view(x, **kw), device=1 if x is obj else 0))
        name = stray if stray in ("scale", "m_splits") else f"out.{stray}"
        with pytest.raises(ValueError, match=rf"^{name}: .*(same device|inputs' device|where "
                           r"inputs lives)"):
            pct.cast_arrays(np.concatenate(xs), counts, scale=scale, out=out,
                            splits_on_device=True)
    assert not calls


def test_list_inputs_on_two_devices_are_refused(fake_device):
    """A list of inputs must live on one device: ``inputs[1]`` on device 1 is refused, naming it."""
    calls, _, _ = fake_device
    xs = make_inputs([7, 0, 20], 32, "float32", seed=5)
    real_view = pct.as_view
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_cast_inputs, "as_view", lambda x, **kw: dataclasses.replace(
            real_view(x, **kw), device=1 if x is xs[1] else 0))
        with pytest.raises(ValueError, match=r"^inputs\[1\]: is a numpy array on device 1, "
                           r"inputs\[0\] is a numpy array on device 0$"):
            pct.cast_arrays(xs)
    assert not calls


@pytest.mark.parametrize("given", [True, False])
def test_cuda_path_with_two_tiles_per_block(fake_device, given):
    """set_tiles_per_block(2): the launches name the two-tile instantiations and cover the tiles
    with half the blocks, the argument tuple is the same, and the bits are the reference's."""
    calls, workspaces, _ = fake_device
    m_splits, k = [37, 0, 130, 64, 5], 256                  # 2 tile columns
    xs = make_inputs(m_splits, k, "bfloat16", seed=4)
    scale = scales_for(m_splits, "e4m3", 4) if given else None
    out = _out_buffers(m_splits, k, 16, False, scale)
    old = pct.set_tiles_per_block(2)
    try:
        got = on_device(pct.cast_arrays, xs, scale=scale, out=out)
    finally:
        pct.set_tiles_per_block(old)
    assert_same_bits(_fp8_view(got, "e4m3"), reference.multi_pad_cast_transpose(xs, scale=scale))
    tiles = pct.plan_launches(m_splits, k, 16)[0].grid
    assert [(grid, name.endswith(", 2>")) for name, grid, _, _ in calls] == \
        [(((tiles + 1) // 2,), True)] * (1 if given else 2)
    for name, grid, block, a in calls:
        assert len(a) == 14 and a[0].arg.dtype == pct.group_dtype()
    assert not any(ws.any() for ws in workspaces.values())


def test_by_value_hands_cupy_the_records_address():
    """The argument block reaches ``cuLaunchKernel`` as the address of its bytes: the one CuPy's
    own conversion of the record would take (``CNumpyArray``, which first describes every field,
    ~10x slower), holding the record alive; anything but a 0-d record is refused."""
    import ctypes

    from cupy.cuda.function import CNumpyArray, CPointer

    arg = np.zeros((), dtype=pct.group_dtype())
    arg["num_experts"], arg["m"][:3] = 3, (5, 0, 7)
    bv = _launch.by_value(arg)
    assert isinstance(bv, CPointer) and bv.arg is arg
    assert bv.ptr == CNumpyArray(arg).ptr == arg.ctypes.data
    assert ctypes.string_at(bv.ptr, arg.dtype.itemsize) == arg.tobytes()
    for bad in (np.zeros(3, pct.group_dtype()), np.zeros((), np.int64), arg.tobytes()):
        with pytest.raises(TypeError, match="arg: expected a 0-d NumPy array of a structured"):
            _launch.by_value(bad)


def test_the_emulator_refuses_a_by_value_pointer_off_its_record():
    arg = np.zeros((), dtype=pct.group_dtype())
    kern = _jit.get_emulated_function(pct.KERNEL_SPEC, pct.kernel_name("float32", "e4m3", "CAST"))
    moved = types.SimpleNamespace(arg=arg, ptr=arg.ctypes.data + 8)
    args = (moved,) + (np.int64(16), np.int32(16), np.int32(0), np.float32(0), np.int32(0)) \
        + (np.uint64(0),) * 7 + (np.int32(0),)
    with pytest.raises(TypeError, match="argument 0 is a by-value pointer that does not point"):
        kern((1,), (pct.THREADS,), args)
