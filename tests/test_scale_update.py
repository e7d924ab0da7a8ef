"""update_scales (delayed scaling): the CUDA kernel run on the CPU emulator must give the NumPy
reference's bits (history, scale, scale_inv) for special amaxes (0, denormal, inf, NaN, negative),
history lengths 1 .. 1024 (+ a length that is not a multiple of the block), both reductions, both
formats and a mixed HYBRID boundary, over several steps and fiber orders. Plus the NVRTC compile
for sm_80/89/90/100 without spills, argument checks, launch counts, and the GPU twin (``gpu``)."""

from __future__ import annotations

import numpy as np
import pytest

from cugrouped import reference
from cugrouped.ops import _launch
from cugrouped.ops import scale_update as su
from cugrouped.reference.scale_update import update_scales as ref_update

SPECIALS = np.array([0.0, -0.0, 1e-40, np.inf, -np.inf, np.nan, -3.0, 448.0, 57344.0, 3e38,
                     1e-30, 2.5], dtype=np.float32)


def _state(T, L, seed):
    rng = np.random.default_rng(seed)
    h = (np.exp2(rng.uniform(-20, 20, size=(T, L)))).astype(np.float32)
    h[rng.random((T, L)) < 0.05] = 0.0
    if L > 3:
        h[0, L - 1] = np.nan     # drops out of the window at the next roll
        h[1 % T, L // 2] = np.inf
    return h


def _amax(T, seed):
    rng = np.random.default_rng(seed)
    a = np.exp2(rng.uniform(-30, 30, size=T)).astype(np.float32)
    a[: min(T, SPECIALS.size)] = SPECIALS[: min(T, SPECIALS.size)]
    return a


def _bits(a):
    return np.asarray(a).view(np.uint32)


def _run(backend, h, amaxes, fmt, algo, margin, order="forward"):
    h = h.copy()
    T = h.shape[0]
    scale = np.full(T, 7.0, np.float32)
    scale_inv = np.full(T, 7.0, np.float32)
    outs = []
    with _launch.emulation_order(order):
        for a in amaxes:
            su.update_scales(h, a, scale, scale_inv, fp8_format=fmt, amax_compute_algo=algo,
                             margin=margin, backend=backend)
            outs.append((h.copy(), scale.copy(), scale_inv.copy()))
    return outs


@pytest.mark.parametrize("L", [1, 2, 127, 128, 300, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "hybrid"])
def test_emulated_matches_reference(L, algo, fmt):
    T = 14
    fmts = ["e4m3"] * 9 + ["e5m2"] * 5 if fmt == "hybrid" else fmt
    h = _state(T, L, seed=L)
    amaxes = [_amax(T, s) for s in range(3)]
    want = _run("reference", h, amaxes, fmts, algo, margin=1 if L == 127 else 0)
    got = _run("emulate", h, amaxes, fmts, algo, margin=1 if L == 127 else 0,
               order="reverse" if L % 2 else "shuffle")
    for step, (g, w) in enumerate(zip(got, want)):
        for name, gi, wi in zip(("history", "scale", "scale_inv"), g, w):
            assert np.array_equal(_bits(gi), _bits(wi)), f"step {step} {name}"


def _run_reset(backend, h, amaxes, fmt, algo, order):
    """Like _run with reset_amax=True: each step's amax buffer is zeroed by the update itself."""
    h = h.copy()
    T = h.shape[0]
    scale, scale_inv = np.full(T, 7.0, np.float32), np.full(T, 7.0, np.float32)
    outs = []
    with _launch.emulation_order(order):
        for a in amaxes:
            buf = a.copy()
            su.update_scales(h, buf, scale, scale_inv, fp8_format=fmt, amax_compute_algo=algo,
                             backend=backend, reset_amax=True)
            outs.append((h.copy(), scale.copy(), scale_inv.copy(), buf))
    return outs


@pytest.mark.parametrize("L", [1, 2, 128, 300])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_reset_amax_emulated_matches_reference(L, algo):
    """reset_amax zeroes the amax once read: same history and scales as without it (every thread
    read the amax before it was zeroed), the buffer +0 afterwards; fiber orders varied."""
    T = 14
    fmts = ["e4m3"] * 9 + ["e5m2"] * 5
    h = _state(T, L, seed=L + 1)
    amaxes = [_amax(T, s) for s in range(3)]
    plain = _run("reference", h, amaxes, fmts, algo, margin=0)
    want = _run_reset("reference", h, amaxes, fmts, algo, "forward")
    for order in ("forward", "reverse", "shuffle", L, "warps", "warps-reverse"):
        got = _run_reset("emulate", h, amaxes, fmts, algo, order)
        for step, (g, w, p) in enumerate(zip(got, want, plain)):
            for name, gi, wi, pi in zip(("history", "scale", "scale_inv"), g, w, p):
                assert np.array_equal(_bits(gi), _bits(wi)), f"{order} step {step} {name}"
                assert np.array_equal(_bits(wi), _bits(pi)), f"reference step {step} {name}"
            assert not _bits(g[3]).any() and not _bits(w[3]).any(), f"{order} step {step} amax"


def test_without_reset_amax_the_amax_is_left_alone():
    for backend in ("reference", "emulate"):
        a = _amax(6, 2)
        before = a.copy()
        su.update_scales(_state(6, 4, 0), a, np.ones(6, np.float32), np.ones(6, np.float32),
                         backend=backend)
        assert np.array_equal(_bits(a), _bits(before)), backend


def test_reference_semantics():
    h = np.array([[1.0, 2.0, 3.0], [5.0, np.nan, 0.0], [0.0, 0.0, 0.0]], np.float32)
    amax = np.array([0.5, 1.0, 0.0], np.float32)
    scale, scale_inv = np.full(3, 2.0, np.float32), np.zeros(3, np.float32)
    ref_update(h, amax, scale, scale_inv, fp8_format=["e4m3", "e4m3", "e5m2"])
    np.testing.assert_array_equal(h[0], [0.5, 1.0, 2.0])          # 3.0 rolled out
    assert np.isnan(h[1, 2]) and h[1, 0] == 1.0
    assert scale[0] == np.float32(448.0 / 2.0)                     # max of the new window
    assert scale[1] == np.float32(448.0 / 5.0)                     # the NaN entry is skipped
    assert scale[2] == 2.0 and scale_inv[2] == 0.5                 # amax 0: previous scale kept
    assert scale_inv[0] == np.float32(1 / 224.0)
    ref_update(h, np.array([8.0, 1.0, 4.0], np.float32), scale, scale_inv, fp8_format="e5m2",
               amax_compute_algo="most_recent", margin=2)
    np.testing.assert_array_equal(scale, np.float32([57344 / 8 / 4, 57344 / 4, 57344 / 4 / 4]))


@pytest.mark.parametrize("backend", ["reference", "emulate"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_unusable_amax_keeps_the_previous_scale(backend, algo):
    """TransformerEngine's rule: a reduced amax of 0 (an expert without tokens for a whole
    window), inf, NaN or negative leaves the scale as it was; resetting it to 1 would underflow
    E5M2 gradients the next time the expert is used. scale_inv is recomputed from the kept scale."""
    bad = np.array([0.0, -0.0, 1e-40, np.inf, np.nan, -3.0], np.float32)
    T = bad.size + 1
    h = np.zeros((T, 4), np.float32)
    if algo == "max":
        h[3, 1], h[4, 2] = np.inf, np.nan        # the window reduces to inf / to NaN-free 0
    scale = np.float32([2.0 ** -20, 3.0, 0.25, 1e30, 7.0, 5.0, 1.0])
    scale_inv = np.zeros(T, np.float32)
    amax = np.append(bad, np.float32(2.0))
    su.update_scales(h, amax, scale, scale_inv, fp8_format="e5m2", amax_compute_algo=algo,
                     backend=backend)
    want = np.float32([2.0 ** -20, 3.0, 0.25, 1e30, 7.0, 5.0, 57344.0 / 2.0])
    np.testing.assert_array_equal(_bits(scale), _bits(want))
    np.testing.assert_array_equal(_bits(scale_inv), _bits(reference.scale_inverse(want)))


@pytest.mark.parametrize("backend", ["reference", "emulate"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_a_step_that_measured_nothing_leaves_history_and_scale(backend, algo):
    """TransformerEngine's update: a new amax of 0 (an expert without tokens, a weight not cast
    again) neither rolls the history nor moves the scale, so old large amaxes are not pushed out
    of the window by idle steps (the scale would grow and the expert's next input saturate).
    -0 and denormals count as 0; a window of length 2 over amaxes 10, 1, 0, 0, 5."""
    steps = [10.0, 1.0, 0.0, -0.0, 1e-40, 5.0]
    h = np.zeros((1, 2), np.float32)
    scale, scale_inv = np.ones(1, np.float32), np.ones(1, np.float32)
    scales, hists = [], []
    for a in steps:
        su.update_scales(h, np.float32([a]), scale, scale_inv, amax_compute_algo=algo,
                         backend=backend)
        scales.append(float(scale[0]))
        hists.append(h[0].tolist())
    f = np.float32
    want = [448 / f(10), 448 / f(10), 448 / f(10), 448 / f(10), 448 / f(10), 448 / f(5)] \
        if algo == "max" else [448 / f(10), 448.0, 448.0, 448.0, 448.0, 448 / f(5)]
    assert scales == [float(np.float32(v)) for v in want]
    assert hists[2:5] == [[1.0, 10.0]] * 3 and hists[5] == [5.0, 1.0]
    assert scale_inv[0] == reference.scale_inverse(scale)[0]


def test_nan_entries_are_skipped_by_the_max():
    h = np.float32([[np.nan, 4.0, np.nan], [np.nan, np.nan, np.nan]])
    np.testing.assert_array_equal(reference.reduce_history(h, "max"), np.float32([4.0, -np.inf]))


def test_one_launch_for_all_tensors():
    T, L = 3 * 5, 16
    h = _state(T, L, 0)
    with _launch.record_launches() as log:
        su.update_scales(h, _amax(T, 1), np.zeros(T, np.float32), np.zeros(T, np.float32),
                         fp8_format=["e4m3"] * 10 + ["e5m2"] * 5, backend="emulate")
    assert [(x.grid, x.block) for x in log] == [(T, su.THREADS)]
    assert su.plan_update(0, 4, 0, "max", 0).grid == 0


@pytest.mark.parametrize("call, exc, match", [
    (lambda h, a, s, si: su.update_scales(h, a, s, si, amax_compute_algo="mean"), ValueError,
     "amax_compute_algo"),
    (lambda h, a, s, si: su.update_scales(h, a, s, si, margin=-1), ValueError, "margin"),
    (lambda h, a, s, si: su.update_scales(h, a, s, si, reset_amax=1), TypeError, "reset_amax"),
    (lambda h, a, s, si: ref_update(h, a, s, si, reset_amax="yes"), TypeError, "reset_amax"),
    (lambda h, a, s, si: su.update_scales(h.astype(np.float64), a, s, si), ValueError, "amax_history"),
    (lambda h, a, s, si: su.update_scales(h[:, :0], a, s, si), ValueError, "history_len"),
    (lambda h, a, s, si: su.update_scales(h.T, a[:4], s[:4], si[:4]), ValueError, "contiguous"),
    (lambda h, a, s, si: su.update_scales(h, a[:2], s, si), ValueError, "amax"),
    (lambda h, a, s, si: su.update_scales(h, a, s[::2], si), ValueError, "scale"),
    (lambda h, a, s, si: su.update_scales(h, a, s, si, fp8_format="e3m4"), ValueError, "fp8_format"),
    (lambda h, a, s, si: su.update_scales(h, a, s, si, fp8_format=["e5m2", "e4m3", "e4m3"]),
     ValueError, "before"),
    (lambda h, a, s, si: su.update_scales(h, a, s, si, fp8_format=["e4m3"]), ValueError, "one per"),
    (lambda h, a, s, si: su.update_scales(h, a, s, si, fp8_format=["e4m3", "e5m2", "e4m3"]),
     ValueError, "before"),
    (lambda h, a, s, si: su.update_scales(np.zeros((3, 6), np.float32)[:, :4], a, s, si),
     ValueError, "amax_history: must be C-contiguous"),
    (lambda h, a, s, si: su.update_scales(h, np.zeros(6, np.float32)[::2], s, si), ValueError,
     "amax: expected a contiguous"),
    (lambda h, a, s, si: su.update_scales(h, a, s, si, margin=65), ValueError, "margin"),
    (lambda h, a, s, si: su.update_scales(h, a, s, si, backend="cuda"), ValueError, "backend"),
])
def test_bad_arguments(call, exc, match):
    h = np.zeros((3, 4), np.float32)
    with pytest.raises(exc, match=match):
        call(h, np.zeros(3, np.float32), np.zeros(3, np.float32), np.zeros(3, np.float32))


def test_limits_are_inclusive():
    """``margin`` in [0, 64] and ``history_len`` up to MAX_HISTORY_LEN are accepted at the top
    end (and computed as the reference does), one past it refused."""
    h, a = np.ones((2, 4), np.float32), np.array([3.0, 0.5], np.float32)
    runs = []
    for backend in ("reference", "emulate"):
        s, si = np.ones(2, np.float32), np.ones(2, np.float32)
        su.update_scales(h.copy(), a.copy(), s, si, margin=64, backend=backend)
        runs.append(s)
    assert np.array_equal(runs[0], runs[1]) and not np.array_equal(runs[0], np.ones(2))
    L = su.MAX_HISTORY_LEN
    one = [np.ones(1, np.float32) for _ in range(3)]
    su.update_scales(np.zeros((1, L), np.float32), *one)
    with pytest.raises(ValueError, match="history_len"):
        su.update_scales(np.zeros((1, L + 1), np.float32), *one)


def test_reference_exported():
    assert callable(reference.fp8.compute_scale)   # the twin builds on the FP8 reference


def _fake_device_views(monkeypatch, device):
    """Make update_scales see NumPy arrays as CuPy arrays on ``device`` (CPU tests of the CUDA
    launch path up to the kernel call)."""
    from cugrouped._array import ArrayView

    def view(a, arg="array"):
        a = np.asarray(a)
        return ArrayView(a.ctypes.data, a.shape, tuple(b // a.itemsize for b in a.strides),
                         str(a.dtype), device, "cupy", a)

    monkeypatch.setattr(su, "as_view", view)


def test_cuda_launch_arguments_match_the_kernel_signature(monkeypatch):
    """(float* history, float* amax, float* scale, float* scale_inv, i64 T, i64 L,
    i64 num_e4m3, int margin, int reset_amax): data pointers by value, then the scalars with
    their C widths."""
    cupy = pytest.importorskip("cupy")
    calls = []
    monkeypatch.setattr(su._jit, "get_function",
                        lambda spec, name: lambda grid, block, args: calls.append((name, grid, block, args)))
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    _fake_device_views(monkeypatch, 0)
    h, a = _state(6, 5, 0), _amax(6, 1)
    s, si = np.zeros(6, np.float32), np.zeros(6, np.float32)
    su.update_scales(h, a, s, si, fp8_format=["e4m3"] * 4 + ["e5m2"] * 2, margin=3)
    [(name, grid, block, args)] = calls
    assert name == su.kernel_name("max") and grid == (6,) and block == (su.THREADS,)
    assert [type(v) for v in args] == [np.uint64] * 4 + [np.int64] * 3 + [np.int32] * 2
    assert [int(v) for v in args] == [h.ctypes.data, a.ctypes.data, s.ctypes.data, si.ctypes.data,
                                      6, 5, 4, 3, 0]
    su.update_scales(h, a, s, si, reset_amax=True)
    assert int(calls[-1][3][-1]) == 1


def test_cuda_torch_tensors_are_launched_through_their_pointers(monkeypatch):
    """CUDA torch tensors (the scale_update custom op passes them as they are): torch CPU tensors
    stand in, seen as device-0 tensors; the launch gets their data pointers. CPU torch tensors
    given directly are refused (they go through cugrouped.pytorch)."""
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    import dataclasses

    h, a = torch.from_numpy(_state(4, 3, 0)), torch.from_numpy(_amax(4, 1))
    s, si = torch.zeros(4), torch.zeros(4)
    with pytest.raises(TypeError, match="CPU torch tensors"):
        su.update_scales(h, a, s, si)
    calls = []
    monkeypatch.setattr(su._jit, "get_function",
                        lambda spec, name: lambda grid, block, args: calls.append(args))
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    real_view = su.as_view
    monkeypatch.setattr(su, "as_view", lambda x, **kw: dataclasses.replace(real_view(x, **kw), device=0))
    su.update_scales(h, a, s, si)
    [args] = calls
    assert [int(v) for v in args[:4]] == [t.data_ptr() for t in (h, a, s, si)]


def test_cuda_launch_refuses_arrays_on_another_device(monkeypatch):
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(su._jit, "get_function", lambda spec, name: pytest.fail("launched"))
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    _fake_device_views(monkeypatch, 1)
    h = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match="device 1 but the current CUDA device is 0"):
        su.update_scales(h, np.zeros(3, np.float32), np.zeros(3, np.float32),
                         np.zeros(3, np.float32))


@pytest.mark.parametrize("stray", [1, 2, 3])
def test_arrays_on_another_device_than_the_history_are_refused(monkeypatch, stray):
    """amax, scale and scale_inv must live with amax_history (one kernel reads them all)."""
    from cugrouped._array import ArrayView

    arrays = [np.zeros((3, 4), np.float32)] + [np.zeros(3, np.float32) for _ in range(3)]

    def view(a, arg="array"):
        a = np.asarray(a)
        return ArrayView(a.ctypes.data, a.shape, tuple(b // a.itemsize for b in a.strides),
                         str(a.dtype), 1 if a is arrays[stray] else 0, "cupy", a)

    monkeypatch.setattr(su, "as_view", view)
    monkeypatch.setattr(su._jit, "get_function", lambda spec, name: pytest.fail("launched"))
    name = ("amax", "scale", "scale_inv")[stray - 1]
    with pytest.raises(ValueError, match=rf"^{name}: is a cupy array on device 1, amax_history"):
        su.update_scales(*arrays)


@pytest.mark.gpu
@pytest.mark.parametrize("L", [1, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_gpu_matches_reference(L, algo):
    import cupy

    T = 3 * 8
    fmts = ["e4m3"] * 16 + ["e5m2"] * 8
    h = _state(T, L, 3)
    amaxes = [_amax(T, s) for s in range(3)]
    want = _run("reference", h, amaxes, fmts, algo, margin=0)
    hd = cupy.asarray(h)
    sd, sid = cupy.full(T, 7.0, np.float32), cupy.full(T, 7.0, np.float32)  # as _run starts
    for step, a in enumerate(amaxes):
        su.update_scales(hd, cupy.asarray(a), sd, sid, fp8_format=fmts, amax_compute_algo=algo)
        for name, gi, wi in zip(("history", "scale", "scale_inv"), (hd, sd, sid), want[step]):
            assert np.array_equal(_bits(cupy.asnumpy(gi)), _bits(wi)), f"step {step} {name}"


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_gpu_reset_amax_matches_reference(algo):
    import cupy

    T, L = 3 * 8, 300
    fmts = ["e4m3"] * 16 + ["e5m2"] * 8
    h = _state(T, L, 4)
    amaxes = [_amax(T, s) for s in range(3)]
    want = _run_reset("reference", h, amaxes, fmts, algo, "forward")
    hd = cupy.asarray(h)
    sd, sid = cupy.full(T, 7.0, np.float32), cupy.full(T, 7.0, np.float32)
    for step, a in enumerate(amaxes):
        ad = cupy.asarray(a)
        su.update_scales(hd, ad, sd, sid, fp8_format=fmts, amax_compute_algo=algo, reset_amax=True)
        for name, gi, wi in zip(("history", "scale", "scale_inv", "amax"), (hd, sd, sid, ad),
                                want[step]):
            assert np.array_equal(_bits(cupy.asnumpy(gi)), _bits(wi)), f"step {step} {name}"
