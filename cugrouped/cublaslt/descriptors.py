"""Descriptor objects over cuBLASLt's opaque handles, hiding the attribute plumbing.

Each object owns one ``*Create``'d handle (never the ``*Init`` forms, whose opaque sizes changed
between releases) and destroys it when closed or garbage collected. Attributes are set and read by
short name (``desc.set("TRANSA", CUBLAS_OP_T)``); the table below gives each one's C type, so the
size passed to cuBLASLt is always the one the header documents. All of this works without a GPU,
except :class:`Handle`.

Caches (per thread, since the matmul descriptor's pointer attributes are rewritten per expert):
:func:`matmul_desc` per :class:`GemmConfig`, :func:`matrix_layout` per (type, rows, cols, ld) with
LRU eviction, :func:`preference` per (workspace, alignments).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import threading

from . import _enums as E
from ._lib import CublasLtError, check, lib

__all__ = ["MatmulDesc", "MatrixLayout", "GroupedMatrixLayout", "MatmulPreference", "Handle", "GemmConfig",
           "MATMUL_DESC_ATTRS", "MATRIX_LAYOUT_ATTRS", "PREFERENCE_ATTRS", "matmul_desc",
           "matrix_layout", "preference", "clear_caches", "LAYOUT_CACHE_SIZE", "expert_desc",
           "expert_descs"]

_u8p = ctypes.c_uint64  # a pointer-valued attribute (void*, 8 bytes on every supported platform)

# short name -> (enum value, C type), C types as documented in cublasLt.h
MATMUL_DESC_ATTRS = {
    "COMPUTE_TYPE": (E.CUBLASLT_MATMUL_DESC_COMPUTE_TYPE, ctypes.c_int32),
    "SCALE_TYPE": (E.CUBLASLT_MATMUL_DESC_SCALE_TYPE, ctypes.c_int32),
    "POINTER_MODE": (E.CUBLASLT_MATMUL_DESC_POINTER_MODE, ctypes.c_int32),
    "TRANSA": (E.CUBLASLT_MATMUL_DESC_TRANSA, ctypes.c_int32),
    "TRANSB": (E.CUBLASLT_MATMUL_DESC_TRANSB, ctypes.c_int32),
    "EPILOGUE": (E.CUBLASLT_MATMUL_DESC_EPILOGUE, ctypes.c_uint32),
    "BIAS_POINTER": (E.CUBLASLT_MATMUL_DESC_BIAS_POINTER, _u8p),
    "A_SCALE_POINTER": (E.CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, _u8p),
    "B_SCALE_POINTER": (E.CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, _u8p),
    "FAST_ACCUM": (E.CUBLASLT_MATMUL_DESC_FAST_ACCUM, ctypes.c_int8),
    "BIAS_DATA_TYPE": (E.CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, ctypes.c_int32),
    "SM_COUNT_TARGET": (E.CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, ctypes.c_int32),
    "A_SCALE_MODE": (E.CUBLASLT_MATMUL_DESC_A_SCALE_MODE, ctypes.c_int32),
    "B_SCALE_MODE": (E.CUBLASLT_MATMUL_DESC_B_SCALE_MODE, ctypes.c_int32),
}
MATRIX_LAYOUT_ATTRS = {
    "TYPE": (E.CUBLASLT_MATRIX_LAYOUT_TYPE, ctypes.c_uint32),
    "ORDER": (E.CUBLASLT_MATRIX_LAYOUT_ORDER, ctypes.c_int32),
    "ROWS": (E.CUBLASLT_MATRIX_LAYOUT_ROWS, ctypes.c_uint64),
    "COLS": (E.CUBLASLT_MATRIX_LAYOUT_COLS, ctypes.c_uint64),
    "LD": (E.CUBLASLT_MATRIX_LAYOUT_LD, ctypes.c_int64),
    "BATCH_COUNT": (E.CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, ctypes.c_int32),
    "BATCH_MODE": (E.CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, ctypes.c_uint32),
    "ROWS_ARRAY": (E.CUBLASLT_GROUPED_MATRIX_LAYOUT_ROWS_ARRAY, _u8p),
    "COLS_ARRAY": (E.CUBLASLT_GROUPED_MATRIX_LAYOUT_COLS_ARRAY, _u8p),
    "LD_ARRAY": (E.CUBLASLT_GROUPED_MATRIX_LAYOUT_LD_ARRAY, _u8p),
    "ROWS_COLS_ARRAY_INTEGER_WIDTH": (E.CUBLASLT_GROUPED_MATRIX_LAYOUT_ROWS_COLS_ARRAY_INTEGER_WIDTH,
                                      ctypes.c_int32),
    "LD_ARRAY_INTEGER_WIDTH": (E.CUBLASLT_GROUPED_MATRIX_LAYOUT_LD_ARRAY_INTEGER_WIDTH, ctypes.c_int32),
}
PREFERENCE_ATTRS = {
    "SEARCH_MODE": (E.CUBLASLT_MATMUL_PREF_SEARCH_MODE, ctypes.c_uint32),
    "MAX_WORKSPACE_BYTES": (E.CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64),
    "MIN_ALIGNMENT_A_BYTES": (E.CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, ctypes.c_uint32),
    "MIN_ALIGNMENT_B_BYTES": (E.CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, ctypes.c_uint32),
    "MIN_ALIGNMENT_C_BYTES": (E.CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, ctypes.c_uint32),
    "MIN_ALIGNMENT_D_BYTES": (E.CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, ctypes.c_uint32),
    # The header documents these three as uint32_t, but cuBLAS 13.10 refuses 4 bytes
    # (CUBLAS_STATUS_INVALID_VALUE) and takes 8, as TransformerEngine and PyTorch pass them
    # (int64_t); tests/test_cublaslt.py checks both sizes against the real library.
    "GROUPED_AVERAGE_REDUCTION_DIM": (E.CUBLASLT_MATMUL_PREF_GROUPED_AVERAGE_REDUCTION_DIM, ctypes.c_int64),
    "GROUPED_DESC_D_AVERAGE_ROWS": (E.CUBLASLT_MATMUL_PREF_GROUPED_DESC_D_AVERAGE_ROWS, ctypes.c_int64),
    "GROUPED_DESC_D_AVERAGE_COLS": (E.CUBLASLT_MATMUL_PREF_GROUPED_DESC_D_AVERAGE_COLS, ctypes.c_int64),
}


class _Descriptor:
    """One cuBLASLt object: ``_kind`` names its functions (``cublasLt{kind}SetAttribute`` ...)."""

    _kind = ""
    _attrs: dict = {}

    def __init__(self, create_args: tuple):
        self._lib = lib()
        self._destroy = getattr(self._lib, f"cublasLt{self._kind}Destroy")
        self._setter = getattr(self._lib, f"cublasLt{self._kind}SetAttribute")
        self._getter = getattr(self._lib, f"cublasLt{self._kind}GetAttribute")
        h = ctypes.c_void_p()
        check(getattr(self._lib, f"cublasLt{self._kind}Create")(ctypes.byref(h), *create_args),
              f"cublasLt{self._kind}Create", f"arguments {create_args}")
        self.handle = h

    @property
    def ptr(self) -> int:
        return self.handle.value or 0

    def set(self, name: str, value) -> None:
        attr, ctype = self._attrs[name]
        buf = ctype(value)
        status = self._setter(self.handle, attr, ctypes.byref(buf), ctypes.sizeof(buf))
        if status:  # the message is built only on failure: this runs per expert
            check(status, f"cublasLt{self._kind}SetAttribute",
                  f"{name} = {value!r} ({ctypes.sizeof(buf)} bytes)")

    def get(self, name: str):
        attr, ctype = self._attrs[name]
        buf, written = ctype(), ctypes.c_size_t()
        check(self._getter(self.handle, attr, ctypes.byref(buf), ctypes.sizeof(buf),
                           ctypes.byref(written)), f"cublasLt{self._kind}GetAttribute", name)
        if written.value != ctypes.sizeof(buf):
            raise CublasLtError(f"cublasLt{self._kind}GetAttribute", 0,
                                f"{name}: wrote {written.value} bytes, expected {ctypes.sizeof(buf)}")
        return buf.value

    def close(self) -> None:
        if getattr(self, "handle", None) is not None and self.handle.value:
            check(self._destroy(self.handle), f"cublasLt{self._kind}Destroy")
            self.handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class MatmulDesc(_Descriptor):
    """``cublasLtMatmulDesc_t`` with a compute type and a scale (alpha/beta) type.

    :meth:`set_pointers` is the per-call fast path for the A/B scale and bias pointers of a
    descriptor made by :func:`expert_desc`; ``ptrs`` holds the values last set (a call compares
    and skips when nothing changed).
    """

    _kind, _attrs = "MatmulDesc", MATMUL_DESC_ATTRS

    def __init__(self, compute_type: int = E.CUBLAS_COMPUTE_32F, scale_type: int = E.CUDA_R_32F):
        super().__init__((compute_type, scale_type))
        self.ptrs = [None, None, None]  # A scale, B scale, bias last set through set_pointers
        self._pointer_attrs: tuple = ()
        self._buf = _u8p()
        self._ref = ctypes.byref(self._buf)

    def set_pointers(self, a_scale: int, b_scale: int, bias: int) -> None:
        """Set the pointer attributes this descriptor's config uses (see :func:`expert_desc`)."""
        vals = (a_scale, b_scale, bias)
        for slot, attr in self._pointer_attrs:
            self._buf.value = vals[slot]
            status = self._setter(self.handle, attr, self._ref, 8)
            if status:
                check(status, "cublasLtMatmulDescSetAttribute",
                      f"pointer attribute {attr} = {vals[slot]:#x}")
        self.ptrs = list(vals)


class MatrixLayout(_Descriptor):
    """``cublasLtMatrixLayout_t``: column-major ``rows x cols`` of a cudaDataType, leading dim ``ld``."""

    _kind, _attrs = "MatrixLayout", MATRIX_LAYOUT_ATTRS

    def __init__(self, data_type: int, rows: int, cols: int, ld: int):
        super().__init__((data_type, rows, cols, ld))
        self.shape = (data_type, rows, cols, ld)


class GroupedMatrixLayout(MatrixLayout):
    """A grouped layout (``cublasLtGroupedMatrixLayoutCreate``, cuBLAS 13.2+): ``count``
    column-major matrices whose rows, columns and leading dimensions are read by the GEMM from the
    device arrays at ``rows_ptr``, ``cols_ptr``, ``ld_ptr`` (int32 each, the default integer
    width, set explicitly). Creating it only records the addresses: no GPU needed."""

    def __init__(self, data_type: int, count: int, rows_ptr: int, cols_ptr: int, ld_ptr: int):
        self._lib = lib()
        create = getattr(self._lib, "cublasLtGroupedMatrixLayoutCreate", None)
        if create is None:
            raise CublasLtError("cublasLtGroupedMatrixLayoutCreate", E.CUBLAS_STATUS_NOT_SUPPORTED,
                                "this libcublasLt has no grouped GEMM (needs cuBLAS 13.2+)")
        self._destroy = self._lib.cublasLtMatrixLayoutDestroy
        self._setter = self._lib.cublasLtMatrixLayoutSetAttribute
        self._getter = self._lib.cublasLtMatrixLayoutGetAttribute
        h = ctypes.c_void_p()
        check(create(ctypes.byref(h), data_type, count, rows_ptr, cols_ptr, ld_ptr),
              "cublasLtGroupedMatrixLayoutCreate",
              f"type {data_type}, {count} groups, arrays {rows_ptr:#x} {cols_ptr:#x} {ld_ptr:#x}")
        self.handle = h
        self.shape = (data_type, count, rows_ptr, cols_ptr, ld_ptr)
        self.set("ROWS_COLS_ARRAY_INTEGER_WIDTH", E.CUBLASLT_INTEGER_WIDTH_32)
        self.set("LD_ARRAY_INTEGER_WIDTH", E.CUBLASLT_INTEGER_WIDTH_32)


class MatmulPreference(_Descriptor):
    """``cublasLtMatmulPreference_t``: workspace limit and minimum pointer alignments."""

    _kind, _attrs = "MatmulPreference", PREFERENCE_ATTRS

    def __init__(self):
        super().__init__(())


class Handle:
    """``cublasLtHandle_t`` for the current CUDA device (needs a driver and a device)."""

    def __init__(self):
        self._lib = lib()
        h = ctypes.c_void_p()
        check(self._lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate",
              "needs a CUDA driver and a visible GPU")
        self.handle = h

    @property
    def ptr(self) -> int:
        return self.handle.value or 0

    def close(self) -> None:
        if getattr(self, "handle", None) is not None and self.handle.value:
            check(self._lib.cublasLtDestroy(self.handle), "cublasLtDestroy")
            self.handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------
# Caches.

@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """What a matmul descriptor depends on (no shapes, no pointers): the cache key.

    Types are cudaDataType_t values; ``bias_type`` is None without the bias epilogue;
    ``scaled`` means A/B scale pointers are used (FP8); ``a_scale_mode`` / ``b_scale_mode`` are
    ``cublasLtMatmulMatrixScale_t`` values, 0 (one float32 scale per matrix) or the block modes
    ``VEC128_32F`` / ``BLK128x128_32F`` (TransformerEngine's Float8BlockScaling) and
    ``VEC32_UE8M0`` (MXFP8).
    """

    a_type: int
    b_type: int
    d_type: int
    transa: int
    transb: int
    bias_type: int | None = None
    fast_accum: bool = False
    scaled: bool = False
    grouped: bool = False
    a_scale_mode: int = E.CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F
    b_scale_mode: int = E.CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F

    def attributes(self) -> dict[str, int]:
        """Every attribute :func:`matmul_desc` sets besides the per-call pointers. A grouped GEMM
        (TransformerEngine's Hopper settings) reads alpha and beta from the device (one scalar
        each for all groups) and, with FP8, each group's scales from device arrays of pointers:
        one float32 per group (``PER_BATCH_SCALAR_32F``) or its block scales (the block modes,
        as in the per-expert calls)."""
        attrs = {"TRANSA": self.transa, "TRANSB": self.transb,
                 "POINTER_MODE": E.CUBLASLT_POINTER_MODE_DEVICE if self.grouped
                 else E.CUBLASLT_POINTER_MODE_HOST,
                 "EPILOGUE": E.CUBLASLT_EPILOGUE_DEFAULT if self.bias_type is None
                 else E.CUBLASLT_EPILOGUE_BIAS}
        if self.bias_type is not None:
            attrs["BIAS_DATA_TYPE"] = self.bias_type
        if self.scaled:
            attrs["FAST_ACCUM"] = int(self.fast_accum)
            if self.grouped and not (self.a_scale_mode or self.b_scale_mode):
                attrs["A_SCALE_MODE"] = E.CUBLASLT_MATMUL_MATRIX_SCALE_PER_BATCH_SCALAR_32F
                attrs["B_SCALE_MODE"] = E.CUBLASLT_MATMUL_MATRIX_SCALE_PER_BATCH_SCALAR_32F
            elif self.a_scale_mode or self.b_scale_mode:   # block scales (never set otherwise:
                attrs["A_SCALE_MODE"] = self.a_scale_mode   # cuBLAS before 12.8 has no such
                attrs["B_SCALE_MODE"] = self.b_scale_mode   # attribute)
        return attrs


LAYOUT_CACHE_SIZE = 4096


class _Caches(threading.local):
    def __init__(self):
        self.descs: dict[GemmConfig, MatmulDesc] = {}
        self.expert_descs: dict[GemmConfig, list] = {}
        self.layouts: collections.OrderedDict = collections.OrderedDict()
        self.prefs: dict[tuple, MatmulPreference] = {}


_caches = _Caches()


def matmul_desc(config: GemmConfig) -> MatmulDesc:
    """The cached descriptor of ``config`` (fp32 compute and fp32 alpha/beta)."""
    desc = _caches.descs.get(config)
    if desc is None:
        desc = _caches.descs[config] = _new_desc(config)
    return desc


def _new_desc(config: GemmConfig) -> MatmulDesc:
    desc = MatmulDesc(E.CUBLAS_COMPUTE_32F, E.CUDA_R_32F)
    for name, value in config.attributes().items():
        desc.set(name, value)
    attrs = []
    if config.scaled:
        attrs += [(0, E.CUBLASLT_MATMUL_DESC_A_SCALE_POINTER), (1, E.CUBLASLT_MATMUL_DESC_B_SCALE_POINTER)]
    if config.bias_type is not None:
        attrs.append((2, E.CUBLASLT_MATMUL_DESC_BIAS_POINTER))
    desc._pointer_attrs = tuple(attrs)
    return desc


def expert_descs(config: GemmConfig, count: int) -> list:
    """This thread's per-expert-slot descriptors of ``config`` (at least ``count`` of them): each
    keeps its own scale/bias pointers, so a step whose pointers did not move sets nothing."""
    lst = _caches.expert_descs.get(config)
    if lst is None:
        lst = _caches.expert_descs[config] = []
    while len(lst) < count:
        lst.append(_new_desc(config))
    return lst


def expert_desc(config: GemmConfig, expert: int) -> MatmulDesc:
    """The descriptor of expert slot ``expert`` (see :func:`expert_descs`)."""
    return expert_descs(config, expert + 1)[expert]


def matrix_layout(data_type: int, rows: int, cols: int, ld: int) -> MatrixLayout:
    """A cached column-major layout (LRU over the last :data:`LAYOUT_CACHE_SIZE` shapes)."""
    key = (data_type, rows, cols, ld)
    cache = _caches.layouts
    lay = cache.get(key)
    if lay is None:
        lay = cache[key] = MatrixLayout(data_type, rows, cols, ld)
        if len(cache) > LAYOUT_CACHE_SIZE:
            cache.popitem(last=False)[1].close()
    else:
        cache.move_to_end(key)
    return lay


def preference(workspace_bytes: int, align_a: int, align_b: int, align_c: int,
               align_d: int) -> MatmulPreference:
    """A cached preference with a workspace limit and the operands' real pointer alignments."""
    key = (workspace_bytes, align_a, align_b, align_c, align_d)
    pref = _caches.prefs.get(key)
    if pref is None:
        pref = MatmulPreference()
        pref.set("MAX_WORKSPACE_BYTES", workspace_bytes)
        for name, value in zip("ABCD", key[1:]):
            pref.set(f"MIN_ALIGNMENT_{name}_BYTES", value)
        _caches.prefs[key] = pref
    return pref


def clear_caches() -> None:
    """Destroy every cached descriptor of this thread."""
    slots = [d for lst in _caches.expert_descs.values() for d in lst]
    for d in (list(_caches.descs.values()) + slots + list(_caches.layouts.values())
              + list(_caches.prefs.values())):
        d.close()
    _caches.descs.clear()
    _caches.expert_descs.clear()
    _caches.layouts.clear()
    _caches.prefs.clear()
