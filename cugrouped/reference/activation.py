"""NumPy reference of the activations the cast kernels apply before casting: defines the bits.

``silu(a) = a / (1 + exp(-a))`` and ``swiglu(a, b) = silu(a) * b`` (Megatron's gated linear
unit over fc1's two halves ``[a | b]``), in float32 with the GPU's ``-ftz=true``. The kernels
(``kernels_cu/activation.cuh``) compute ``exp`` the same way, from IEEE-rounded multiplications,
additions and a division only (no FMA, no hardware ``ex2.approx``), so the GPU, the CPU emulator
and this twin give the same bits:

* ``x = -a`` clamped to ``[-87, 88]``; ``n = rint(x * log2(e))`` (ties to even, by adding and
  subtracting ``1.5 * 2^23``); ``r = (x - n * C1) - n * C2`` (Cody and Waite's split of ln 2:
  ``C1 = 355/512`` exactly, so ``n * C1`` is exact, ``C2`` the float32 rest);
* ``exp(r) ~ 1 + r + r^2 * q(r)``, ``q`` of degree 4 (a least-squares fit on
  ``|r| <= ln(2)/2``, rounded to float32), Horner's rule;
* times ``2^n`` (exact: the result stays normal in the clamped range);
* ``x > 88`` gives ``exp = inf`` (``silu = -0`` for finite ``a < -88``; ``-inf`` gives NaN as in
  torch), ``x < -87`` gives ``exp = 0`` (``silu(a) = a``, as ``1 + exp(-a)`` rounds to 1 there).

Each operation is flushed like the GPU's (denormal results to a zero of their sign). The result
is within 2.5 float32 ulps of the exact silu for every ``a >= -88`` (2.44 at worst; ``exp``
within 1 ulp); below -88 it is -0, where the exact value is below 5.4e-37 in magnitude. Not
bit-equal to torch's ``F.silu`` (whose ``expf`` differs between CPU and GPU anyway).
tests/test_activation.py measures it.
"""

from __future__ import annotations

import numpy as np

from . import fp8 as rfp8

__all__ = ["ACTIVATIONS", "silu", "swiglu", "apply", "EXP_COEFFS"]

#: What the cast kernels can apply to their input: None (the input as it is) or a gated unit.
ACTIVATIONS = (None, "swiglu")

_F = np.float32
_LOG2E = _F(1.44269504088896341)
_C1 = _F(355.0 / 512.0)                            # 0.693359375: 9 significant bits
_C2 = _F(np.log(2.0) - 355.0 / 512.0)              # -2.1219444e-04
_ROUND = _F(12582912.0)                            # 1.5 * 2^23: x + it - it rounds to an integer
#: exp(r) ~ 1 + r + r^2 (c2 + c3 r + c4 r^2 + c5 r^3 + c6 r^4), as float32 bit patterns.
EXP_COEFFS = (0x3EFFFFFC, 0x3E2AAA47, 0x3D2AADAC, 0x3C091DC7, 0x3AB43E11)
_C = [np.array(c, np.uint32).view(np.float32) for c in EXP_COEFFS]
_LO, _HI = _F(-87.0), _F(88.0)


def _exp(x: np.ndarray) -> np.ndarray:
    """``exp(x)`` as the kernels compute it (float32 in, float32 out)."""
    f = rfp8.ftz
    xc = np.minimum(np.maximum(np.where(np.isnan(x), _LO, x), _LO), _HI)
    t = f(f(xc * _LOG2E) + _ROUND)
    n_f = f(t - _ROUND)
    n = (t.view(np.uint32).astype(np.int64) - 0x4B400000).astype(np.int32)
    r = f(f(xc - f(n_f * _C1)) - f(n_f * _C2))
    q = _C[4]
    for c in (_C[3], _C[2], _C[1], _C[0]):
        q = f(f(q * r) + c)
    p = f(f(f(f(r * r) * q) + r) + _F(1.0))
    two_n = ((n + 127).astype(np.uint32) << np.uint32(23)).view(np.float32)
    e = f(p * two_n)
    e = np.where(x > _HI, _F(np.inf), e)
    return np.where(x < _LO, _F(0.0), e).astype(np.float32)


def silu(a) -> np.ndarray:
    """``a / (1 + exp(-a))``, float32 (``a`` is flushed first, as the kernels load it)."""
    a = rfp8.ftz(np.asarray(a, dtype=np.float32))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        d = rfp8.ftz(_exp(-a) + _F(1.0))
        return rfp8.ftz(a / d)


def swiglu(a, b) -> np.ndarray:
    """``silu(a) * b``, float32, one rounding per operation."""
    b = rfp8.ftz(np.asarray(b, dtype=np.float32))
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        return rfp8.ftz(silu(a) * b)


def apply(x: np.ndarray, activation: str | None) -> np.ndarray:
    """The activation over float32 rows ``x``: ``(m, 2k) -> (m, k)`` for ``"swiglu"`` (halves
    ``[a | b]``), ``x`` itself for None."""
    if activation is None:
        return x
    if activation == "swiglu":
        k = x.shape[1] // 2
        return swiglu(x[:, :k], x[:, k:])
    raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
