"""NumPy reference for the FP8 numerics of ``kernels_cu/fp8.cuh`` (design.md §3, §7).

This module defines the exact output bits; the CUDA path (``cvt.rn.satfinite`` on sm_89+), the
portable C++ path (below sm_89 and in the CPU emulator) and this code must agree bit for bit.
All arithmetic is float32 (never float64, so nothing is rounded twice), and float32 denormals are
flushed to a zero of the same sign wherever the GPU flushes them: CuPy's RawModule always compiles
with ``-ftz=true``.

Rules
-----
* ``cast_to_fp8``: round to nearest, ties to even; ``|x| > max`` (and +-inf) saturate to +-max
  (448 for E4M3, 57344 for E5M2); NaN -> byte ``0x7F`` for both formats, whatever its sign or
  payload (the byte NVIDIA's ``__nv_cvt_float_to_fp8`` produces, see ``FP8_NAN_BYTE``).
* ``quantize(x, scale)`` = ``cast_to_fp8(ftz(ftz(x) * ftz(scale)))``.
* ``amax_of(x)`` = max ``|ftz(x)|``; NaN elements are ignored (as ``fmaxf`` does on the GPU), so an
  all-NaN or empty input has amax 0. An amax over denormal-only data is 0.
* ``compute_scale(amax, fmt, margin)`` = ``fp8_max / amax / 2**margin``: amax that is 0, denormal,
  negative, inf or NaN -> 1; an infinite quotient -> FLT_MAX; the division by ``2**margin`` is exact
  (exponent arithmetic), overflow -> FLT_MAX, a result below FLT_MIN -> 0. ``margin`` is clamped to
  [-512, 512]. Two options (TransformerEngine's QParams, off by default): ``amax_epsilon`` raises
  an amax below it (after FTZ; not NaN or inf) to it first; ``power_2_scale`` rounds the final
  scale down to a power of two (mantissa cleared).
* ``amax_usable(amax)``: positive, normal and finite (what ``compute_scale`` derives a scale from;
  delayed scaling keeps the previous scale for any other amax).
* ``scale_inverse(s)`` = ``ftz(1 / ftz(s))``.
* ``ftz`` also makes every NaN the GPU's canonical ``0x7FFFFFFF``, so float32 results that are NaN
  (column sums over a NaN or over +inf and -inf, a NaN scale's inverse) have the GPU's bits.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = [
    "FP8_MAX", "FP8_FORMAT_ID", "FP8_NAN_BYTE", "FLT_MAX", "fp8_dtype", "normalize_format",
    "ftz", "to_float32", "cast_to_fp8", "fp8_to_float", "quantize", "dequantize",
    "compute_scale", "scale_inverse", "amax_of", "amax_usable", "mx_scale_byte",
    "mx_element_scale",
]

FP8_MAX: dict[str, float] = {"e4m3": 448.0, "e5m2": 57344.0}
# Value of ``cg::Fp8Format`` in kernels_cu/fp8.cuh.
FP8_FORMAT_ID: dict[str, int] = {"e4m3": 0, "e5m2": 1}
# The byte ``cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`` gives for a NaN input (both formats): CUDA 13.0
# cuda_fp8.hpp, ``__nv_cvt_float_to_fp8``, canonicalises any float NaN to 0x7FFFFFFF and encodes it
# as 0x7F (E4M3 0.1111.111, E5M2 0.11111.11). See the comment at the top of fp8.cuh.
FP8_NAN_BYTE: int = 0x7F
FLT_MAX = np.uint32(0x7F7FFFFF).view(np.float32)

_F32_ONE_BITS = np.uint32(0x3F800000)
_CANONICAL_NAN_BITS = np.uint32(0x7FFFFFFF)

_ALIASES = {
    "e4m3": "e4m3", "e4m3fn": "e4m3", "float8_e4m3fn": "e4m3",
    "e5m2": "e5m2", "float8_e5m2": "e5m2",
}


def normalize_format(fmt) -> str:
    """``"e4m3"`` or ``"e5m2"`` from a name, an ml_dtypes dtype or the C++ enum value (0/1)."""
    if isinstance(fmt, (int, np.integer)) and not isinstance(fmt, bool):
        for name, ident in FP8_FORMAT_ID.items():
            if ident == int(fmt):
                return name
    elif isinstance(fmt, str):
        key = fmt.lower()
        if key in _ALIASES:
            return _ALIASES[key]
    else:
        try:
            dt = np.dtype(fmt)
        except TypeError:
            dt = None
        if dt == np.dtype(ml_dtypes.float8_e4m3fn):
            return "e4m3"
        if dt == np.dtype(ml_dtypes.float8_e5m2):
            return "e5m2"
    raise ValueError(f"unknown FP8 format {fmt!r}; expected 'e4m3' or 'e5m2'")


def fp8_dtype(fmt) -> np.dtype:
    """The ml_dtypes dtype of a format: float8_e4m3fn or float8_e5m2."""
    return np.dtype(ml_dtypes.float8_e4m3fn if normalize_format(fmt) == "e4m3" else ml_dtypes.float8_e5m2)


def _f32(x) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype != np.float32:
        raise TypeError(f"expected float32, got {a.dtype}")
    return a


def ftz(x) -> np.ndarray:
    """A float32 as the GPU's arithmetic leaves it: denormals flushed to a zero of the same sign
    (``-ftz=true``) and every NaN the canonical ``0x7FFFFFFF`` (an NVIDIA GPU's float32 NaN
    results carry no sign or payload; NumPy's keep an operand's, and its ``inf - inf`` is
    ``0xFFC00000``)."""
    a = _f32(x)
    u = a.view(np.uint32)
    out = np.where((u & np.uint32(0x7F800000)) == 0, u & np.uint32(0x80000000), u)
    out = np.where((u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000), _CANONICAL_NAN_BITS, out)
    return out.astype(np.uint32).view(np.float32)


def to_float32(x, dtype=None) -> np.ndarray:
    """float32 copy of a float32, float16 or bfloat16 (ml_dtypes) array, exactly.

    ``dtype`` reinterprets a 16-bit integer view: ``to_float32(u16, dtype="bfloat16")`` or
    ``"float16"`` (how bf16 travels through CuPy). Other dtypes (float64 included) are refused:
    the kernels take only these three.
    """
    a = np.asarray(x)
    if dtype is not None:
        want = np.dtype(ml_dtypes.bfloat16) if str(dtype) in ("bfloat16", "bf16") else np.dtype(dtype)
        if a.dtype != want:
            if a.dtype.itemsize != want.itemsize or a.dtype.kind not in "ui":
                raise TypeError(f"cannot view {a.dtype} as {want}")
            a = a.view(want)
    if a.dtype == np.float32:
        return a.copy()
    if a.dtype == np.float16:
        return a.astype(np.float32)  # exact; NaN sign and payload kept (as half_to_float does)
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        return (a.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    raise TypeError(f"unsupported input dtype {a.dtype}; expected float32, float16 or bfloat16")


def cast_to_fp8(x, fmt) -> np.ndarray:
    """float32 -> FP8 bytes (uint8): RNE, saturate to +-max, NaN -> ``FP8_NAN_BYTE``."""
    a = _f32(x)
    m = np.float32(FP8_MAX[normalize_format(fmt)])
    clamped = np.clip(a, -m, m)  # NaN passes through np.clip
    q = clamped.astype(fp8_dtype(fmt)).view(np.uint8)
    q = np.where(np.isnan(a), np.uint8(FP8_NAN_BYTE), q).astype(np.uint8)
    return q


def fp8_to_float(q, fmt) -> np.ndarray:
    """FP8 bytes (uint8) -> float32, exact; NaN bytes give the canonical NaN 0x7FFFFFFF."""
    b = np.asarray(q)
    if b.dtype != np.uint8:
        if b.dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
            b = b.view(np.uint8)
        else:
            raise TypeError(f"expected uint8 FP8 bytes, got {b.dtype}")
    f = b.view(fp8_dtype(fmt)).astype(np.float32)
    return np.where(np.isnan(f), _CANONICAL_NAN_BITS.view(np.float32), f).astype(np.float32)


def quantize(x, scale, fmt) -> np.ndarray:
    """``cast_to_fp8(ftz(ftz(x) * ftz(scale)))`` with a float32 multiply; ``scale`` broadcasts."""
    a = to_float32(x)
    s = ftz(np.asarray(scale, dtype=np.float32))
    with np.errstate(over="ignore", invalid="ignore"):   # overflow to inf saturates below
        return cast_to_fp8(ftz(np.multiply(ftz(a), s, dtype=np.float32)), fmt)


def dequantize(q, scale_inv, fmt) -> np.ndarray:
    """``ftz(fp8_to_float(q) * ftz(scale_inv))`` in float32 (for inspection)."""
    s = ftz(np.asarray(scale_inv, dtype=np.float32))
    return ftz(np.multiply(fp8_to_float(q, fmt), s, dtype=np.float32))


def amax_usable(amax) -> np.ndarray:
    """Elementwise: a positive, normal, finite float32 (decided on bits); mirrors
    ``cg::amax_usable``."""
    u = np.asarray(amax, dtype=np.float32).view(np.uint32)
    ex = u & np.uint32(0x7F800000)
    return ((u & np.uint32(0x80000000)) == 0) & (ex != 0) & (ex != np.uint32(0x7F800000))


def compute_scale(amax, fmt, margin=0, amax_epsilon=0.0, power_2_scale=False) -> np.ndarray:
    """Current scaling, elementwise over ``amax`` (one per expert); mirrors ``cg::compute_scale``.
    ``amax_epsilon``: 0 or a positive normal float32 (the ops check it)."""
    a = np.asarray(amax, dtype=np.float32) if not isinstance(amax, np.ndarray) else _f32(amax)
    eps = np.float32(amax_epsilon)
    if eps > 0:
        with np.errstate(invalid="ignore"):
            a = np.where(ftz(a) < eps, eps, a).astype(np.float32)   # NaN compares False
    s = _scale_from_amax(a, fmt, margin)
    if power_2_scale:
        s = (np.asarray(s).view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)
    return np.asarray(s)


def _scale_from_amax(a: np.ndarray, fmt, margin) -> np.ndarray:
    bad = ~amax_usable(a)
    fmax = np.float32(FP8_MAX[normalize_format(fmt)])
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        q = np.divide(fmax, np.where(bad, np.float32(1), a), dtype=np.float32)
    qb = np.asarray(q).view(np.uint32)
    mg = np.clip(np.asarray(margin, dtype=np.int64), -512, 512)
    e = (qb >> np.uint32(23)).astype(np.int64) - mg
    mant = (qb & np.uint32(0x007FFFFF)).astype(np.int64)
    res = np.where((qb >= np.uint32(0x7F800000)) | (e >= 255), np.int64(0x7F7FFFFF),
                   np.where(e <= 0, np.int64(0), mant | (np.clip(e, 0, 255) << 23)))
    res = np.where(bad, np.int64(_F32_ONE_BITS), res)
    return np.asarray(res.astype(np.uint32).view(np.float32))


def scale_inverse(scale) -> np.ndarray:
    """``ftz(1 / ftz(scale))`` in float32; mirrors ``cg::scale_inverse``."""
    s = ftz(np.asarray(scale, dtype=np.float32))
    with np.errstate(divide="ignore", over="ignore"):
        return ftz(np.divide(np.float32(1), s, dtype=np.float32))


def amax_of(x) -> np.float32:
    """max |ftz(x)| over the whole array, NaN ignored; 0 for an empty or all-NaN array."""
    a = to_float32(x).ravel()
    if a.size == 0:
        return np.float32(0)
    return np.float32(np.fmax.reduce(np.abs(ftz(a)), initial=np.float32(0)))


# ---------------------------------------------------------------------------------------------
# MXFP8: E8M0 block scales (mirrors fp8.cuh's mx_scale_byte / mx_element_scale, written from the
# numbers rather than the bits).

def mx_scale_byte(amax, fmt) -> np.ndarray:
    """E8M0 byte of blocks with maxima ``amax`` (float32, >= 0): ``v = amax * float32(1 /
    fp8_max)`` rounded to float32 as if the exponent range were unbounded (no denormal, no
    flush: a tiny product keeps its exponent), then the biased exponent of the smallest power of
    two >= v, ``ceil(log2(v)) + 127``, clamped to [0, 254]; 0 for v = 0, 254 for +inf, 255 for
    NaN."""
    rcp = np.float32(1.0 / FP8_MAX[normalize_format(fmt)])
    a = _f32(np.asarray(amax, np.float32))
    tiny = a < np.float32(2.0**-64)
    with np.errstate(over="ignore", invalid="ignore"):
        # 2^64 a is exact and the product normal, so it is the product's float32 rounding
        v = np.multiply(np.where(tiny, a * np.float32(2.0**64), a), rcp, dtype=np.float32)
    mant, ex = np.frexp(v.astype(np.float64))           # v = mant * 2^ex, mant in [0.5, 1)
    ceil_log2 = np.where(mant == 0.5, ex - 1, ex).astype(np.int64) - np.where(tiny, 64, 0)
    e = np.clip(ceil_log2 + 127, 0, 254)
    e = np.where(v == 0, 0, e)
    e = np.where(np.isinf(v), 254, e)
    e = np.where(np.isnan(v), 255, e)
    return e.astype(np.uint8)


def mx_element_scale(e) -> np.ndarray:
    """The multiplier of a block's elements, ``2^(127 - e)`` in float32 (254: 2^-127, flushed to
    0 as the GPU flushes a denormal operand; 255: NaN)."""
    e = np.asarray(e, dtype=np.int64)
    with np.errstate(invalid="ignore"):
        s = np.ldexp(np.float32(1), (127 - e).astype(np.int32)).astype(np.float32)
    return ftz(np.where(e == 255, np.float32(np.nan), s).astype(np.float32))
