"""FP8 numerics: kernels_cu/fp8.cuh (portable C++ path) against cugrouped.reference.fp8, bit for bit.

* The C++ harness tests/fp8_sweep.cpp is compiled once per session with g++ in plain host mode
  (the same portable code the CPU emulator and GPUs below sm_89 run) and loaded with ctypes.
* Default run: a stratified sweep (every float32 exponent, both signs, +-2 ulps around every
  rounding boundary and representable point of both formats, specials, 4M random patterns with a
  fixed seed), plus exact tests of every narrow -> float32 conversion and of the scale arithmetic,
  plus an NVRTC compile of fp8.cuh for sm_80/89/90/100 with no CUDA header on the include path.
* ``pytest -m exhaustive tests/test_fp8_numerics.py``: all 2^32 float32 patterns, both formats.
"""

from __future__ import annotations

import ctypes
import io
import pathlib
import re
import time

import ml_dtypes
import numpy as np
import pytest

from _host_harness import build_harness
from cugrouped.reference import fp8 as ref

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kernels_cu"
HARNESS = ROOT / "tests" / "fp8_sweep.cpp"
FORMATS = ("e4m3", "e5m2")
PARAMS = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}  # exponent bits, mantissa bits, bias

u8p = ctypes.POINTER(ctypes.c_uint8)
u16p = ctypes.POINTER(ctypes.c_uint16)
u32p = ctypes.POINTER(ctypes.c_uint32)
f32p = ctypes.POINTER(ctypes.c_float)


def _ptr(a: np.ndarray, t):
    assert a.flags.c_contiguous
    return a.ctypes.data_as(t)


# ------------------------------------------------------------------------------------------------
# The harness
# ------------------------------------------------------------------------------------------------

class Harness:
    def __init__(self, path: pathlib.Path):
        lib = ctypes.CDLL(str(path))
        lib.convert_range.argtypes = [ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int, u8p]
        lib.convert_bits.argtypes = [u32p, ctypes.c_uint64, ctypes.c_int, u8p]
        lib.convert_pairs.argtypes = [u32p, u32p, ctypes.c_uint64, ctypes.c_int, u16p]
        lib.fp8_to_float_all.argtypes = [ctypes.c_int, u32p]
        lib.bf16_to_float_all.argtypes = [u32p]
        lib.half_to_float_all.argtypes = [u32p]
        lib.compute_scale_array.argtypes = [f32p, ctypes.c_uint64, ctypes.c_int, ctypes.c_int, f32p]
        lib.compute_scale_options_array.argtypes = [f32p, ctypes.c_uint64, ctypes.c_int,
                                                    ctypes.c_int, ctypes.c_float, ctypes.c_int,
                                                    f32p]
        lib.scale_inverse_array.argtypes = [f32p, ctypes.c_uint64, f32p]
        lib.ftz_array.argtypes = [f32p, ctypes.c_uint64, f32p]
        for f in ("convert_range", "convert_bits", "convert_pairs", "fp8_to_float_all",
                  "bf16_to_float_all", "half_to_float_all", "compute_scale_array",
                  "compute_scale_options_array",
                  "scale_inverse_array", "ftz_array"):
            getattr(lib, f).restype = None
        self.lib = lib

    def convert_range(self, start: int, count: int, fmt: str, out: np.ndarray | None = None):
        out = np.empty(count, np.uint8) if out is None else out[:count]
        self.lib.convert_range(start, count, ref.FP8_FORMAT_ID[fmt], _ptr(out, u8p))
        return out

    def convert_bits(self, bits: np.ndarray, fmt: str) -> np.ndarray:
        bits = np.ascontiguousarray(bits, dtype=np.uint32)
        out = np.empty(bits.size, np.uint8)
        self.lib.convert_bits(_ptr(bits, u32p), bits.size, ref.FP8_FORMAT_ID[fmt], _ptr(out, u8p))
        return out

    def convert_pairs(self, lo: np.ndarray, hi: np.ndarray, fmt: str) -> np.ndarray:
        lo = np.ascontiguousarray(lo, dtype=np.uint32)
        hi = np.ascontiguousarray(hi, dtype=np.uint32)
        out = np.empty(lo.size, np.uint16)
        self.lib.convert_pairs(_ptr(lo, u32p), _ptr(hi, u32p), lo.size, ref.FP8_FORMAT_ID[fmt],
                               _ptr(out, u16p))
        return out

    def fp8_to_float_all(self, fmt: str) -> np.ndarray:
        out = np.empty(256, np.uint32)
        self.lib.fp8_to_float_all(ref.FP8_FORMAT_ID[fmt], _ptr(out, u32p))
        return out

    def all16(self, name: str) -> np.ndarray:
        out = np.empty(65536, np.uint32)
        getattr(self.lib, name)(_ptr(out, u32p))
        return out

    def compute_scale(self, amax: np.ndarray, fmt: str, margin: int, amax_epsilon=None,
                      power_2_scale=False) -> np.ndarray:
        """``cg::compute_scale``; with ``amax_epsilon`` given (even 0), its four-argument form."""
        amax = np.ascontiguousarray(amax, dtype=np.float32)
        out = np.empty_like(amax)
        if amax_epsilon is None and not power_2_scale:
            self.lib.compute_scale_array(_ptr(amax, f32p), amax.size, ref.FP8_FORMAT_ID[fmt],
                                         margin, _ptr(out, f32p))
        else:
            self.lib.compute_scale_options_array(_ptr(amax, f32p), amax.size,
                                                 ref.FP8_FORMAT_ID[fmt], margin,
                                                 float(amax_epsilon or 0.0), int(power_2_scale),
                                                 _ptr(out, f32p))
        return out

    def scale_inverse(self, s: np.ndarray) -> np.ndarray:
        s = np.ascontiguousarray(s, dtype=np.float32)
        out = np.empty_like(s)
        self.lib.scale_inverse_array(_ptr(s, f32p), s.size, _ptr(out, f32p))
        return out

    def ftz(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        self.lib.ftz_array(_ptr(x, f32p), x.size, _ptr(out, f32p))
        return out


@pytest.fixture(scope="session")
def harness(tmp_path_factory) -> Harness:
    return Harness(build_harness(tmp_path_factory, HARNESS))


# ------------------------------------------------------------------------------------------------
# Input sets
# ------------------------------------------------------------------------------------------------

def _f32_bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def _boundary_mantissas(exp_field: int) -> set[int]:
    """float32 mantissa fields at this exponent within 2 ulps of a rounding boundary (tie point) or
    of a representable value of either FP8 format, plus the ends of the mantissa range."""
    mants = {0, 1, 2, 3, 0x7FFFFF, 0x7FFFFE, 0x7FFFFD, 0x400000 - 1, 0x400000, 0x400000 + 1}
    e = exp_field - 127
    for _, man, bias in PARAMS.values():
        drops = {23 - man}  # the normal grid, also for exponents where FP8 is subnormal/out of range
        drops.add(23 - man + max(0, (1 - bias) - e))
        for d in drops:
            if d > 24:
                continue
            step = 1 << (d - 1)  # half an FP8 ulp: representable points and ties alternate
            for p in range(0, (1 << 23) + 1, step):
                for delta in range(-2, 3):
                    if 0 <= p + delta < (1 << 23):
                        mants.add(p + delta)
    return mants


def stratified_bits() -> np.ndarray:
    pos = []
    for ef in range(256):
        base = ef << 23
        pos.extend(base | m for m in _boundary_mantissas(ef))
    pos = np.array(sorted(set(pos)), dtype=np.uint32)
    specials = []
    for fmt in FORMATS:
        mx = np.float32(ref.FP8_MAX[fmt])
        _, man, bias = PARAMS[fmt]
        half_ulp_above = np.float32(mx + np.float32(2.0 ** (np.log2(mx) // 1 - man - 1)))  # 464 / 61440
        min_sub = np.float32(2.0 ** (1 - bias - man))
        min_norm = np.float32(2.0 ** (1 - bias))
        for v in (mx, half_ulp_above, min_sub, min_sub / 2, min_sub * 1.5, min_norm):
            v = np.float32(v)
            specials += [v, np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(0))]
    specials = _f32_bits(specials).tolist()
    specials += [0x00000000, 0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x7F800000,  # zero..inf
                 0x7F800001, 0x7F800002, 0x7FA00000, 0x7FBFFFFF, 0x7FC00000, 0x7FC00001,  # NaNs
                 0x7FE00000, 0x7FFFFFFF, 0x7F900000]
    specials = np.array(specials, dtype=np.uint32)
    allpos = np.concatenate([pos, specials])
    return np.concatenate([allpos, allpos | np.uint32(0x80000000)])


def random_bits(n: int, seed: int = 20240611) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)


def _ref_bytes(bits: np.ndarray, fmt: str) -> np.ndarray:
    return ref.cast_to_fp8(bits.view(np.float32), fmt)


def _is_fp8_nan(q: np.ndarray, fmt: str) -> np.ndarray:
    return np.isnan(q.view(ref.fp8_dtype(fmt)).astype(np.float32))


def _assert_same_bytes(bits: np.ndarray, got: np.ndarray, want: np.ndarray, fmt: str):
    x = bits.view(np.float32)
    nan_in = np.isnan(x)
    # NaN positions: NaN in <=> NaN out, on both sides.
    np.testing.assert_array_equal(_is_fp8_nan(got, fmt), nan_in, err_msg=f"{fmt}: C++ NaN mask")
    np.testing.assert_array_equal(_is_fp8_nan(want, fmt), nan_in, err_msg=f"{fmt}: ref NaN mask")
    # ... and the exact canonical byte, everywhere.
    bad = np.flatnonzero(got != want)
    if bad.size:
        rows = [f"  x=0x{bits[i]:08x} ({x[i]!r}) c++=0x{got[i]:02x} ref=0x{want[i]:02x}"
                for i in bad[:20]]
        pytest.fail(f"{fmt}: {bad.size} of {bits.size} bytes differ\n" + "\n".join(rows))


# ------------------------------------------------------------------------------------------------
# float32 -> FP8
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_stratified_sweep(harness, fmt):
    t0 = time.perf_counter()
    bits = np.concatenate([stratified_bits(), random_bits(4 << 20)])
    got = harness.convert_bits(bits, fmt)
    want = _ref_bytes(bits, fmt)
    _assert_same_bytes(bits, got, want, fmt)
    assert bits.size > 4_000_000
    print(f"{fmt}: {bits.size} patterns in {time.perf_counter() - t0:.2f} s")


@pytest.mark.parametrize("fmt", FORMATS)
def test_pair_path_byte_order(harness, fmt):
    bits = np.concatenate([stratified_bits(), random_bits(1 << 18, seed=7)])
    lo = bits
    hi = np.random.default_rng(3).permutation(bits)
    got = harness.convert_pairs(lo, hi, fmt)
    want = _ref_bytes(lo, fmt).astype(np.uint16) | (_ref_bytes(hi, fmt).astype(np.uint16) << 8)
    np.testing.assert_array_equal(got, want)
    # and in a concrete case: lo = 1.0 (0x38 in E4M3 / 0x3C in E5M2) in the low byte
    one = int(_ref_bytes(_f32_bits([1.0]), fmt)[0])
    two = int(_ref_bytes(_f32_bits([-2.0]), fmt)[0])
    assert harness.convert_pairs(_f32_bits([1.0]), _f32_bits([-2.0]), fmt)[0] == one | (two << 8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_known_values(harness, fmt):
    mx = ref.FP8_MAX[fmt]
    one = {"e4m3": 0x38, "e5m2": 0x3C}[fmt]
    top = {"e4m3": 0x7E, "e5m2": 0x7B}[fmt]
    half_ulp = 2.0 ** -(PARAMS[fmt][1] + 1)
    cases = [
        (0.0, 0x00), (-0.0, 0x80), (1.0, one), (mx, top), (-mx, top | 0x80),
        (np.inf, top), (-np.inf, top | 0x80), (1e30, top),
        (1.0 + half_ulp, one),          # tie -> even (1.0)
        (1.0 + 3 * half_ulp, one + 2),  # tie -> even (1 + 2 ulp)
        (-1e-45, 0x80),                 # float32 denormal underflows to -0
    ]
    bits = _f32_bits([c[0] for c in cases])
    got = harness.convert_bits(bits, fmt)
    np.testing.assert_array_equal(got, np.array([c[1] for c in cases], np.uint8))
    np.testing.assert_array_equal(_ref_bytes(bits, fmt), got)
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FA5A5A5], np.uint32)
    assert (harness.convert_bits(nans, fmt) == ref.FP8_NAN_BYTE).all()
    assert (_ref_bytes(nans, fmt) == ref.FP8_NAN_BYTE).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_roundtrip_every_byte(harness, fmt):
    """Every non-NaN FP8 value converts back to itself (E5M2 infinities saturate to max)."""
    f = harness.fp8_to_float_all(fmt)
    back = harness.convert_bits(f, fmt)
    b = np.arange(256, dtype=np.uint8)
    nan = _is_fp8_nan(b, fmt)
    assert (back[nan] == ref.FP8_NAN_BYTE).all()
    expect = b.copy()
    if fmt == "e5m2":
        expect[0x7C], expect[0xFC] = 0x7B, 0xFB
    np.testing.assert_array_equal(back[~nan], expect[~nan])


@pytest.mark.exhaustive
@pytest.mark.parametrize("fmt", FORMATS)
def test_exhaustive_all_float32(harness, fmt):
    chunk = 1 << 26
    buf = np.empty(chunk, np.uint8)
    t0 = time.perf_counter()
    for start in range(0, 1 << 32, chunk):
        bits = np.arange(start, start + chunk, dtype=np.uint64).astype(np.uint32)
        got = harness.convert_range(start, chunk, fmt, buf)
        want = _ref_bytes(bits, fmt)
        if not np.array_equal(got, want):
            _assert_same_bytes(bits, got, want, fmt)
        nan_in = np.isnan(bits.view(np.float32))
        np.testing.assert_array_equal(_is_fp8_nan(got, fmt), nan_in)
    print(f"{fmt}: all 2^32 float32 patterns agree ({time.perf_counter() - t0:.1f} s)")


# ------------------------------------------------------------------------------------------------
# narrow formats -> float32
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_to_float_all_bytes(harness, fmt):
    got = harness.fp8_to_float_all(fmt)
    b = np.arange(256, dtype=np.uint8)
    ml = b.view(ref.fp8_dtype(fmt)).astype(np.float32)
    nan = np.isnan(ml)
    assert nan.sum() == (2 if fmt == "e4m3" else 6)
    np.testing.assert_array_equal(got[~nan], ml.view(np.uint32)[~nan])
    assert (got[nan] == 0x7FFFFFFF).all()
    np.testing.assert_array_equal(ref.fp8_to_float(b, fmt).view(np.uint32), got)


def test_bf16_to_float_all(harness):
    got = harness.all16("bf16_to_float_all")
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    np.testing.assert_array_equal(got, h.astype(np.uint32) << 16)
    np.testing.assert_array_equal(ref.to_float32(h.view(ml_dtypes.bfloat16)).view(np.uint32), got)
    ml = h.view(ml_dtypes.bfloat16).astype(np.float32)
    nan = np.isnan(ml)
    np.testing.assert_array_equal(got[~nan], ml.view(np.uint32)[~nan])
    np.testing.assert_array_equal(np.isnan(got.view(np.float32)), nan)


def test_half_to_float_all(harness):
    got = harness.all16("half_to_float_all")
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    want = h.view(np.float16).astype(np.float32).view(np.uint32)
    np.testing.assert_array_equal(got, want)  # NaN sign and payload included
    np.testing.assert_array_equal(ref.to_float32(h.view(np.float16)).view(np.uint32), got)
    np.testing.assert_array_equal(ref.to_float32(h, dtype="float16").view(np.uint32), got)


# ------------------------------------------------------------------------------------------------
# ftz and scales
# ------------------------------------------------------------------------------------------------

def test_ftz(harness):
    bits = np.concatenate([stratified_bits(), random_bits(1 << 16, seed=11)])
    x = bits.view(np.float32)
    got = harness.ftz(x).view(np.uint32)
    np.testing.assert_array_equal(got, ref.ftz(x).view(np.uint32))
    den = (bits & 0x7F800000) == 0
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    np.testing.assert_array_equal(got[den], bits[den] & np.uint32(0x80000000))
    np.testing.assert_array_equal(got[nan], np.uint32(0x7FFFFFFF))    # the GPU's one NaN
    assert nan.sum() > 100 and (bits[nan] != 0x7FFFFFFF).any()
    np.testing.assert_array_equal(got[~den & ~nan], bits[~den & ~nan])


EDGE_AMAX = np.array(
    [0.0, -0.0, 1e-45, 1e-40, np.uint32(0x007FFFFF).view(np.float32),  # zeros and denormals
     1.1754944e-38, 1e-37, 1.3e-36, 1.4e-36, 1.6e-34, 1.7e-34,  # tiny normals (some give inf)
     np.inf, -np.inf, np.nan, -1.0,  # non-finite and negative
     1.0, 448.0, 57344.0, 3.0, 0.1, 1e-3, 1e6, 3.4028235e38, 2.0 ** 126, 2.0 ** 127],
    dtype=np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("margin", [0, 1, 3, -1, 7, 20, 130, -130, 600, -600])
def test_compute_scale_edges(harness, fmt, margin):
    amax = np.concatenate([EDGE_AMAX, np.abs(random_bits(4096, seed=margin & 0xFF).view(np.float32))])
    got = harness.compute_scale(amax, fmt, margin)
    want = ref.compute_scale(amax, fmt, margin)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    inv = harness.scale_inverse(got)
    np.testing.assert_array_equal(inv.view(np.uint32), ref.scale_inverse(got).view(np.uint32))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("margin", [0, 3, -1, 130])
@pytest.mark.parametrize("eps", [0.0, 1e-12, 1.1754944e-38, 0.5, 448.0, 3.4028235e38])
@pytest.mark.parametrize("power_2", [False, True])
def test_compute_scale_options_edges(harness, fmt, margin, eps, power_2):
    """TransformerEngine's amax_epsilon / power_2_scale: the kernel's function and the reference
    agree bit for bit on the edge amaxes (zeros, denormals, inf, NaN, huge) and random ones."""
    amax = np.concatenate([EDGE_AMAX, np.abs(random_bits(4096, seed=7).view(np.float32)),
                           np.array([eps, np.nextafter(np.float32(eps), np.float32(0))],
                                    np.float32)])
    got = harness.compute_scale(amax, fmt, margin, eps, power_2)
    want = ref.compute_scale(amax, fmt, margin, eps, power_2)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    if power_2:   # a power of two (or 0): the mantissa is empty
        assert not (got.view(np.uint32) & np.uint32(0x007FFFFF)).any()


@pytest.mark.parametrize("fmt", FORMATS)
def test_compute_scale_options_semantics(harness, fmt):
    mx = np.float32(ref.FP8_MAX[fmt])
    s = lambda a, eps=0.0, p2=False, m=0: harness.compute_scale(  # noqa: E731
        np.array([a], np.float32), fmt, m, eps, p2)[0]
    assert s(0.0, 1e-4) == np.float32(mx / np.float32(1e-4))   # zero amax: fp8_max / epsilon
    assert s(1e-40, 1e-4) == s(0.0, 1e-4) == s(-0.0, 1e-4) == s(1e-5, 1e-4)
    assert s(2.0, 1e-4) == mx / 2                               # above epsilon: unchanged
    assert s(np.nan, 1e-4) == 1.0 and s(np.inf, 1e-4) == 1.0    # NaN / inf: not below epsilon
    assert s(0.0) == 1.0                                        # no epsilon: 1, as before
    assert s(3.0, p2=True) == 128.0 if fmt == "e4m3" else s(3.0, p2=True) == 16384.0
    assert s(1.0, p2=True) == (256.0 if fmt == "e4m3" else 32768.0)   # 448 -> 256, 57344 -> 2^15
    assert s(0.0, p2=True) == 1.0 and s(1e-37, p2=True) == 2.0 ** 127  # FLT_MAX -> 2^127
    assert s(1.0, p2=True, m=2) == (64.0 if fmt == "e4m3" else 8192.0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_compute_scale_semantics(harness, fmt):
    mx = np.float32(ref.FP8_MAX[fmt])
    s = lambda a, m=0: harness.compute_scale(np.array([a], np.float32), fmt, m)[0]  # noqa: E731
    for a in (0.0, -0.0, 1e-40, np.inf, -np.inf, np.nan):
        assert s(a) == 1.0, a
    assert s(1.0) == mx and s(float(mx)) == 1.0
    assert s(1.0, 1) == mx / 2 and s(1.0, 3) == mx / 8 and s(2.0, 1) == mx / 4
    assert s(1e-37) == ref.FLT_MAX  # fp8_max / 1e-37 overflows (1e-38 would be a denormal: 1)
    assert s(1e-38) == 1.0
    assert s(1e-37, 3) == ref.FLT_MAX  # inf quotient -> FLT_MAX, whatever the margin
    assert s(3.0) == np.float32(mx / np.float32(3.0))
    assert s(3.4028235e38, 20) == 0.0  # below FLT_MIN: flushed
    assert harness.scale_inverse(np.array([2.0, 0.0, 1e-40, ref.FLT_MAX], np.float32)).tolist() == \
        [0.5, np.inf, np.inf, 0.0]


def test_reference_quantize_amax():
    x = np.array([1.0, -2.5, 1e-40, -1e-40, np.nan, 1000.0, -0.0], np.float32)
    assert ref.amax_of(x) == np.float32(1000.0)  # NaN ignored, denormals flushed
    assert ref.amax_of(np.array([1e-40, -1e-39], np.float32)) == 0.0
    assert ref.amax_of(np.array([np.nan], np.float32)) == 0.0
    assert ref.amax_of(np.zeros((0, 16), np.float32)) == 0.0
    assert ref.amax_of(np.array([-3, 2], np.float16)) == 3.0
    assert ref.amax_of(np.array([-3, 2], ml_dtypes.bfloat16)) == 3.0
    s = np.float32(0.25)
    q = ref.quantize(x, s, "e4m3")
    np.testing.assert_array_equal(q, ref.cast_to_fp8(ref.ftz(ref.ftz(x) * s), "e4m3"))
    assert q[5] == 0x78  # 1000 * 0.25 = 250 rounds to 256 = 2^8 in E4M3
    d = ref.dequantize(q, ref.scale_inverse(s), "e4m3")
    assert d[0] == 1.0 and d[1] == -2.5 and d[2] == 0.0 and np.isnan(d[4])
    # a denormal scale is 0 on the GPU: everything quantizes to zero
    assert (ref.quantize(np.array([1e30], np.float32), np.float32(1e-40), "e5m2") == 0).all()
    with pytest.raises(TypeError):
        ref.to_float32(np.zeros(3))  # float64 is refused


# ------------------------------------------------------------------------------------------------
# NVRTC: fp8.cuh compiles for real architectures with no CUDA header, PTX only on sm_89+
# ------------------------------------------------------------------------------------------------

_PROBE = r"""
#include "fp8.cuh"
template <cg::Fp8Format F>
__global__ void fp8_probe(const float* x, cg::u16* q, float* f, float* s, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    q[i] = cg::float2_to_fp8x2<F>(x[2 * i], x[2 * i + 1]);
    q[n + i] = cg::float_to_fp8<F>(x[i]) | (cg::float_to_fp8_portable<F>(x[n + i]) << 8);
    f[i] = cg::fp8_to_float<F>((cg::u8)i) + cg::half_to_float((cg::u16)i)
         + cg::bf16_to_float((cg::u16)i) + cg::ftz(x[i] * x[n + i]);
    const float sc = cg::compute_scale<F>(x[i], i & 3);
    s[i] = cg::scale_inverse(sc);
}
"""
_NAMES = ["fp8_probe<cg::Fp8Format::E4M3>", "fp8_probe<cg::Fp8Format::E5M2>"]


def _nvrtc_ptx(arch: str) -> str:
    compiler = pytest.importorskip("cupy.cuda.compiler")
    core = pytest.importorskip("cupy._core.core")
    opts = []
    for o in core.assemble_cupy_compiler_options(()):
        if o.startswith("-I"):
            d = pathlib.Path(o[2:])
            # drop any CUDA toolkit include folder: the source must need no CUDA header
            if re.fullmatch(r".*/cuda[^/]*/include/?", o) or (d / "cuda_runtime.h").exists() \
                    or (d / "cuda_fp16.h").exists() or (d / "cuda_fp8.h").exists():
                continue
        opts.append(o)
    assert not any("cuda-" in o and o.startswith("-I") for o in opts), opts
    opts += [f"-arch=compute_{arch}", "-ftz=true", "--device-as-default-execution-space",
             f"-I{KERNELS}"]
    try:
        prog = compiler._NVRTCProgram(_PROBE, "fp8_probe.cu", name_expressions=_NAMES, method="ptx")
    except (OSError, ImportError, RuntimeError) as e:  # no libnvrtc on this machine
        pytest.skip(f"NVRTC not usable here: {e}")
    log = io.StringIO()
    ptx, mapping = prog.compile(tuple(opts), log)  # CompileException (a failure) propagates
    assert set(mapping) == set(_NAMES)
    assert "warning" not in log.getvalue().lower(), log.getvalue()
    return ptx.decode() if isinstance(ptx, bytes) else ptx


@pytest.mark.parametrize("arch", ["80", "89", "90", "100"])
def test_nvrtc_compiles_without_cuda_headers(arch):
    ptx = _nvrtc_ptx(arch)
    has = {k: f"cvt.rn.satfinite.{k}.f32" in ptx for k in ("e4m3x2", "e5m2x2")}
    if arch == "80":
        assert not any(has.values()), "inline PTX leaked below sm_89"
        assert "cvt.rn.satfinite" not in ptx
    else:
        assert all(has.values()), has
    # IEEE division for the scale (no fast-math approximation), FTZ arithmetic as RawModule does
    assert "div.approx" not in ptx and "rcp.approx" not in ptx
    assert "div.rn.ftz.f32" in ptx or "rcp.rn.ftz.f32" in ptx
