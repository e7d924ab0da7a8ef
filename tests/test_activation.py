"""The activation arithmetic of the cast kernels (kernels_cu/activation.cuh) against its NumPy
twin (cugrouped.reference.activation), bit for bit, and both against float64.

* The C++ harness tests/activation_sweep.cpp is compiled with g++ in plain host mode (the code
  the emulator runs) and loaded with ctypes; a stride through all 2^32 float32 patterns, the
  values around each rule's edges and random (a, b) pairs must give the twin's bits.
* Accuracy: ``exp`` within 1 ulp of float64's over its whole finite range, ``silu`` within
  2.5 ulps for a >= -88 (2.44 at worst over every float32, measured once in C++ against
  float64), -0 below, where the exact value is under 5.4e-37; the rules at the edges as documented.
* On a GPU the same operations are IEEE ``mul/add/div.rn.ftz.f32``: the PTX of the activation
  kernels has no contraction into FMA and no hardware approximation (NVRTC, no GPU needed).
* ``pytest -m exhaustive tests/test_activation.py``: all 2^32 patterns.
"""

from __future__ import annotations

import ctypes
import pathlib

import numpy as np
import pytest

from _host_harness import build_harness
from cugrouped.reference import activation as ract

ROOT = pathlib.Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "activation_sweep.cpp"
u32p = ctypes.POINTER(ctypes.c_uint32)


class Harness:
    def __init__(self, path: pathlib.Path):
        self.lib = ctypes.CDLL(str(path))
        for name in ("exp_bits", "silu_bits"):
            getattr(self.lib, name).argtypes = [u32p, ctypes.c_uint64, u32p]
        self.lib.swiglu_bits.argtypes = [u32p, u32p, ctypes.c_uint64, u32p]

    def __call__(self, name: str, *bits: np.ndarray) -> np.ndarray:
        bits = [np.ascontiguousarray(b, dtype=np.uint32) for b in bits]
        out = np.empty(bits[0].size, np.uint32)
        ptrs = [b.ctypes.data_as(u32p) for b in bits]
        getattr(self.lib, name)(*ptrs, bits[0].size, out.ctypes.data_as(u32p))
        return out


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Harness:
    return Harness(build_harness(tmp_path_factory, HARNESS))


def _bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def _f32(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def _ref(name: str, *bits: np.ndarray) -> np.ndarray:
    fn = {"exp_bits": ract._exp, "silu_bits": ract.silu, "swiglu_bits": ract.swiglu}[name]
    with np.errstate(all="ignore"):
        return np.asarray(fn(*[_f32(b) for b in bits]), dtype=np.float32).view(np.uint32)


EDGES = _bits([0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39, 1.1754944e-38, np.inf, -np.inf, np.nan,
               -87.0, -87.00001, -86.99999, 87.0, 88.0, 88.00001, 87.99999, -88.0, -88.00001,
               88.72283, 88.72284, 89.0, -103.0, -104.0, 17.328680, 17.32868, 16.0, -16.0,
               0.34657359, -0.34657359, 0.5, -0.5, 1.0, -1.0, 3e38, -3e38, 1e-8, -1e-8])


def _sweep(stride: int, start: int = 0) -> np.ndarray:
    """Every ``stride``-th float32 bit pattern (a prime stride visits every exponent and sign
    with varied mantissas), plus the edge values and their neighbours."""
    s = np.arange(start, 2 ** 32, stride, dtype=np.uint64).astype(np.uint32)
    near = (EDGES.astype(np.int64)[:, None] + np.arange(-3, 4)).reshape(-1) % 2 ** 32
    return np.concatenate([s, near.astype(np.uint32)])


@pytest.mark.parametrize("name", ["exp_bits", "silu_bits"])
def test_kernel_arithmetic_matches_the_twin_over_a_sweep(harness, name):
    bits = _sweep(251)                            # ~17M patterns
    for chunk in np.array_split(bits, 8):
        got, want = harness(name, chunk), _ref(name, chunk)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (f"{bad.size} differ, first x={_f32(chunk[bad[:1]])}: "
                               f"{got[bad[0]]:#010x} != {want[bad[0]]:#010x}")


def test_swiglu_pairs_match_the_twin(harness):
    rng = np.random.default_rng(7)
    n = 2_000_000
    a = (rng.standard_normal(n) * np.exp2(rng.uniform(-10, 7, n))).astype(np.float32)
    b = (rng.standard_normal(n) * np.exp2(rng.uniform(-20, 20, n))).astype(np.float32)
    edges = _f32(EDGES)
    a = np.concatenate([a, np.repeat(edges, edges.size)])
    b = np.concatenate([b, np.tile(edges, edges.size)])
    got, want = harness("swiglu_bits", _bits(a), _bits(b)), _ref("swiglu_bits", _bits(a), _bits(b))
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} differ, first a={a[bad[0]]} b={b[bad[0]]}"


def _ulps(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - exact) / ulp


def test_exp_is_within_one_ulp():
    x = _f32(_sweep(389))
    x = x[(x >= -87) & (x <= 88)]
    got = ract._exp(x)
    assert _ulps(got, np.exp(x.astype(np.float64))).max() <= 1.0


def test_silu_is_within_2_5_ulps_from_minus_88_up_and_minus_zero_below():
    a = _f32(_sweep(389))
    a = a[np.isfinite(a)]
    with np.errstate(over="ignore"):
        exact = a.astype(np.float64) / (1 + np.exp(-a.astype(np.float64)))
    got = ract.silu(a)
    fi = np.finfo(np.float32)
    normal = (np.abs(exact) >= fi.tiny) & (np.abs(exact) < fi.max) & (a >= -88)
    assert _ulps(got[normal], exact[normal]).max() <= 2.5
    tiny = np.abs(exact) < fi.tiny
    assert not got[tiny].any()          # a denormal result is flushed, as on the GPU
    below = a < -88                     # -0 where the exact value is under 5.4e-37
    assert not got[below].any() and np.signbit(got[below]).all()
    assert np.abs(exact[below]).max() < 5.4e-37


def test_silu_edge_rules():
    a = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40, -88.5, -1e30, 100.0, 20.0],
                 np.float32)
    got = ract.silu(a)
    assert got[0] == np.inf                            # inf / (1 + 0)
    assert np.isnan(got[1]) and np.isnan(got[2])       # -inf / inf, as torch's F.silu
    assert got.view(np.uint32)[1] == got.view(np.uint32)[2] == 0x7FFFFFFF   # canonical NaN
    assert got[3] == 0 and got[4] == 0 and got[5] == 0
    assert got[6] == 0 and np.signbit(got[6]) and np.signbit(got[7])     # below 2^-120: -0
    assert got[8] == 100.0 and got[9] == 20.0          # 1 + exp(-a) rounds to 1


def test_swiglu_is_silu_times_b_with_one_rounding():
    rng = np.random.default_rng(3)
    a = rng.standard_normal(10_000).astype(np.float32) * 4
    b = rng.standard_normal(10_000).astype(np.float32)
    assert np.array_equal(ract.swiglu(a, b), (ract.silu(a) * b).astype(np.float32))
    with pytest.raises(ValueError, match="activation"):
        ract.apply(np.zeros((2, 4), np.float32), "geglu")


@pytest.mark.exhaustive
def test_exhaustive_all_float32(harness):
    for start in range(0, 2 ** 32, 2 ** 26):
        chunk = np.arange(start, start + 2 ** 26, dtype=np.uint64).astype(np.uint32)
        for name in ("exp_bits", "silu_bits"):
            assert np.array_equal(harness(name, chunk), _ref(name, chunk)), (name, start)


@pytest.mark.parametrize("arch", ["80", "90", "100"])
def test_gpu_code_is_ieee_arithmetic_without_contraction(arch):
    """The PTX of the activation kernels: multiplications, additions and divisions rounded to
    nearest with FTZ (``-ftz=true``), no ``fma`` (a contraction would round once where the host
    rounds twice), no ``ex2.approx``/``div.approx``/``rcp.approx``."""
    from cugrouped import _compile_check
    from cugrouped.ops import pad_cast_transpose as pct

    try:
        ptx, _, _ = _compile_check.compile_offline(pct.ACT_KERNEL_SPEC, arch, method="ptx")
    except (OSError, ImportError, RuntimeError) as e:     # no libnvrtc on this machine
        pytest.skip(f"NVRTC not usable here: {e}")
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    for op in ("mul.rn.ftz.f32", "add.rn.ftz.f32", "div.rn.ftz.f32"):
        assert op in ptx, op
    for op in ("fma.rn.f32", "fma.rn.ftz.f32", "ex2.approx", "div.approx", "rcp.approx",
               "div.full"):
        assert op not in ptx, op
