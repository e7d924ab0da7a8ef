"""Load ``libcublasLt`` and declare the few entry points cugrouped calls (ctypes).

The library is found by ``cuda.pathfinder`` (the ``nvidia-cublas`` / ``nvidia-cublas-cu12`` wheels,
conda, or a CUDA toolkit); without pathfinder, the sonames ``libcublasLt.so.13`` / ``.so.12`` are
tried through the dynamic loader. ``CUGROUPED_CUBLASLT`` (a ``libcublasLt.so*`` file, or a folder
holding one) names the library instead, e.g. a newer cuBLAS than the one torch pins, for its
grouped GEMM: that copy is loaded beside torch's (a different file is a separate copy to the
dynamic loader), and nothing else is tried. Loading needs neither a GPU nor a driver, and neither
do the descriptor functions; ``cublasLtCreate`` does (it returns
``CUBLAS_STATUS_NOT_INITIALIZED`` without a usable device).
"""

from __future__ import annotations

import ctypes
import functools
import os

from . import _enums

__all__ = ["lib", "library_path", "version", "has_grouped_gemm", "cudart_version", "check", "CublasLtError",
           "MatmulAlgo", "HeuristicResult"]

_SONAMES = ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so")
ENV_VAR = "CUGROUPED_CUBLASLT"   # the library to load instead of searching (a file or a folder)

_p = ctypes.c_void_p
_i32, _u64, _i64, _sz = ctypes.c_int32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
_st = ctypes.c_int32  # cublasStatus_t


class MatmulAlgo(ctypes.Structure):
    """``cublasLtMatmulAlgo_t``: 8 x uint64, opaque."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    """``cublasLtMatmulHeuristicResult_t`` (96 bytes)."""

    _fields_ = [("algo", MatmulAlgo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int32),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int32 * 4)]


# name -> (restype, argtypes); exactly the prototypes of cublasLt.h.
_PROTOTYPES = {
    "cublasLtGetVersion": (_sz, []),
    "cublasLtGetCudartVersion": (_sz, []),
    "cublasLtCreate": (_st, [ctypes.POINTER(_p)]),
    "cublasLtDestroy": (_st, [_p]),
    "cublasLtMatmulDescCreate": (_st, [ctypes.POINTER(_p), _i32, _i32]),
    "cublasLtMatmulDescDestroy": (_st, [_p]),
    "cublasLtMatmulDescSetAttribute": (_st, [_p, _i32, _p, _sz]),
    "cublasLtMatmulDescGetAttribute": (_st, [_p, _i32, _p, _sz, ctypes.POINTER(_sz)]),
    "cublasLtMatrixLayoutCreate": (_st, [ctypes.POINTER(_p), _i32, _u64, _u64, _i64]),
    "cublasLtMatrixLayoutDestroy": (_st, [_p]),
    "cublasLtMatrixLayoutSetAttribute": (_st, [_p, _i32, _p, _sz]),
    "cublasLtMatrixLayoutGetAttribute": (_st, [_p, _i32, _p, _sz, ctypes.POINTER(_sz)]),
    "cublasLtMatmulPreferenceCreate": (_st, [ctypes.POINTER(_p)]),
    "cublasLtMatmulPreferenceDestroy": (_st, [_p]),
    "cublasLtMatmulPreferenceSetAttribute": (_st, [_p, _i32, _p, _sz]),
    "cublasLtMatmulPreferenceGetAttribute": (_st, [_p, _i32, _p, _sz, ctypes.POINTER(_sz)]),
    "cublasLtMatmulAlgoGetHeuristic": (_st, [_p, _p, _p, _p, _p, _p, _p, ctypes.c_int,
                                             ctypes.POINTER(HeuristicResult),
                                             ctypes.POINTER(ctypes.c_int)]),
    # handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, ws, ws_size, stream
    "cublasLtMatmul": (_st, [_p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p,
                             ctypes.POINTER(MatmulAlgo), _p, _sz, _p]),
}
# Present only in newer libraries: declared when found (see has_grouped_gemm).
_OPTIONAL_PROTOTYPES = {
    # matLayout*, type, groupCount, rows_array, cols_array, ld_array (device pointers)
    "cublasLtGroupedMatrixLayoutCreate": (_st, [ctypes.POINTER(_p), _i32, ctypes.c_int, _p, _p, _p]),
}


class CublasLtError(RuntimeError):
    """A cuBLASLt call returned a status other than ``CUBLAS_STATUS_SUCCESS``."""

    def __init__(self, function: str, status: int, detail: str = ""):
        self.function, self.status = function, int(status)
        msg = f"cuBLASLt {function} failed with status {self.status} ({_enums.status_name(status)})"
        super().__init__(msg + (f": {detail}" if detail else ""))


def check(status: int, function: str, detail: str = "") -> None:
    if status != _enums.CUBLAS_STATUS_SUCCESS:
        raise CublasLtError(function, status, detail)


def _named_library(value: str) -> tuple[ctypes.CDLL, str]:
    """Load the library ``CUGROUPED_CUBLASLT`` names: a file, or a folder with one of the sonames
    (e.g. a cuBLAS wheel's ``nvidia/cu13/lib``). Raises ``OSError`` saying what is wrong."""
    where = os.path.abspath(os.path.expanduser(value))
    if os.path.isdir(where):
        found = [os.path.join(where, n) for n in _SONAMES if os.path.isfile(os.path.join(where, n))]
        if not found:
            raise OSError(f"{ENV_VAR}={value!r}: the folder holds none of {', '.join(_SONAMES)}")
        where = found[0]
    elif not os.path.isfile(where) or not os.path.basename(where).startswith("libcublasLt.so"):
        raise OSError(f"{ENV_VAR}={value!r}: expected a libcublasLt.so* file or the folder "
                      f"holding it (unset it to search as usual)")
    try:
        cdll = ctypes.CDLL(where)
    except OSError as exc:
        raise OSError(f"{ENV_VAR}={value!r}: cannot load {where}: {exc}") from None
    if not hasattr(cdll, "cublasLtMatmul"):
        raise OSError(f"{ENV_VAR}={value!r}: {where} is not libcublasLt (no cublasLtMatmul)")
    return cdll, where


def _load() -> tuple[ctypes.CDLL, str]:
    named = os.environ.get(ENV_VAR)
    if named:
        return _named_library(named)
    errors = []
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        loaded = load_nvidia_dynamic_lib("cublasLt")
        return ctypes.CDLL(loaded.abs_path), loaded.abs_path
    except Exception as exc:  # pathfinder missing, or it found nothing
        errors.append(f"cuda.pathfinder: {type(exc).__name__}: {exc}")
    for name in _SONAMES:
        try:
            return ctypes.CDLL(name), name
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    raise OSError("libcublasLt not found; install the cuBLAS wheel (pip install '.[cuda13]' in "
                  "the checkout, or nvidia-cublas / nvidia-cublas-cu12) or a CUDA toolkit. Tried:\n  "
                  + "\n  ".join(errors))


@functools.lru_cache(maxsize=None)
def _library() -> tuple[ctypes.CDLL, str]:
    cdll, path = _load()
    for name, (restype, argtypes) in _PROTOTYPES.items():
        fn = getattr(cdll, name)
        fn.restype, fn.argtypes = restype, argtypes
    for name, (restype, argtypes) in _OPTIONAL_PROTOTYPES.items():
        fn = getattr(cdll, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = restype, argtypes
    return cdll, path


def has_grouped_gemm() -> bool:
    """Whether the loaded library exports ``cublasLtGroupedMatrixLayoutCreate`` (cuBLAS 13.2+;
    13.1.2 has neither the function nor its enums in the header). Which GPUs and dtypes it serves
    depends on the version: see :func:`cugrouped.ops.grouped_gemm.grouped_gemm_unsupported`."""
    return hasattr(lib(), "cublasLtGroupedMatrixLayoutCreate")


def lib() -> ctypes.CDLL:
    """The loaded ``libcublasLt`` with prototypes declared (loaded on first use)."""
    return _library()[0]


def library_path() -> str:
    return _library()[1]


def version() -> int:
    """``cublasLtGetVersion()``: ``major * 10000 + minor * 100 + patch`` (13.10.0 -> 131000)."""
    return int(lib().cublasLtGetVersion())


def cudart_version() -> int:
    """The CUDA runtime version cuBLASLt was built against (13.0 -> 13000)."""
    return int(lib().cublasLtGetCudartVersion())
