"""Run the CUDA kernels of ``kernels_cu/`` on the CPU, for tests and for debugging without a GPU.

The same ``.cu`` source is compiled by the system ``g++`` with ``cuda_emu.h`` force-included (CUDA
built-ins mapped to host code) into a shared library that is loaded with ctypes and launched over
NumPy buffers. The threads of a block run as cooperative fibers that switch at every barrier and
warp collective, so a launch is deterministic for a given fiber ``order``; running several orders
(fibers forward, reversed, shuffled, or one warp at a time running ahead of the others) and
comparing the bits exposes a missing ``__syncthreads``; a ``__syncthreads`` that only part of a
block reaches is reported as an :class:`EmulationError` naming both source lines. See README.md
in this folder for what is supported.

Usage, mirroring ``cupy.RawModule`` / ``cupy.RawKernel``::

    from cugrouped.emulate import EmuModule, EmulationError
    mod = EmuModule(path="pad_cast_transpose.cu", name_expressions=("my_kernel<float, 4>",))
    kern = mod.get_function("my_kernel<float, 4>")
    kern((grid_x, grid_y), (256,), (x, y, np.int32(n), params_record), shared_mem=0, order="reverse")

Arguments: a NumPy array is passed as its data pointer; a NumPy scalar (``np.int32(3)``) by value;
a NumPy structured scalar or 0-d structured array by value as its raw bytes (a struct parameter).
Plain Python numbers are refused (their width is ambiguous). Sizes are checked against the kernel's
parameter types. Environment: ``CUGROUPED_CACHE_DIR`` (libraries under ``<dir>/emulate``),
``CUGROUPED_EMULATE_WORKERS`` (worker threads, default 2), ``CUGROUPED_EMULATE_VERBOSE=1`` (print
the g++ command).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import _sources
from ._build import (EmulationCompileError, EmulationError, cache_dir, compiler_version, stats)
from ._build import build as _build

__all__ = ["EmuModule", "EmuKernel", "EmulationError", "EmulationCompileError", "OrderDependenceError",
           "OrderReport", "run_all_orders", "DEFAULT_ORDERS", "asan_env", "stats", "cache_dir",
           "check_order"]

#: The orders :func:`run_all_orders` tries: fibers (and blocks) forward, reversed, shuffled, and
#: one warp at a time running ahead of the others (first warp first, last warp first).
DEFAULT_ORDERS = ("forward", "reverse", "shuffle", 1, 2, "warps", "warps-reverse")
SHUFFLE_SEED = 0x5EED
_MAX_BLOCK = (1024, 1024, 64)
_MAX_GRID = (2**31 - 1, 65535, 65535)

_loaded: dict[str, ctypes.CDLL] = {}   # library path -> handle, kept for the life of the process


class OrderDependenceError(EmulationError):
    """The same launch gave different bits in different fiber orders (a missing barrier?)."""


def default_workers() -> int:
    return max(1, int(os.environ.get("CUGROUPED_EMULATE_WORKERS", "2")))


def asan_env(base: dict | None = None) -> dict:
    """Environment for a Python subprocess that can load ``sanitize=True`` modules."""
    env = dict(os.environ if base is None else base)
    lib = subprocess.run([os.environ.get("CUGROUPED_EMULATE_CXX", "g++"), "-print-file-name=libasan.so"],
                         capture_output=True, text=True, check=True).stdout.strip()
    env["LD_PRELOAD"] = lib
    env.setdefault("ASAN_OPTIONS", "detect_leaks=0")
    return env


def _asan_loaded() -> bool:
    try:
        return "libasan" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def _dims(v, what: str, limits) -> tuple[int, int, int]:
    t = (v,) if isinstance(v, (int, np.integer)) else tuple(v)
    if not 1 <= len(t) <= 3 or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in t):
        raise TypeError(f"{what} must be an int or a tuple of 1 to 3 ints, got {v!r}")
    t = tuple(int(d) for d in t) + (1,) * (3 - len(t))
    if any(d < 1 or d > m for d, m in zip(t, limits)):
        raise ValueError(f"{what} {t} out of range (each dimension in 1..{limits})")
    return t


def check_order(order) -> None:
    """A fiber order: ``"forward"``, ``"reverse"``, ``"shuffle"``, an int seed, ``"warps"`` or
    ``"warps-reverse"`` (ValueError)."""
    _order(order)


def _order(order) -> tuple[int, int]:
    if order == "forward":
        return 0, 0
    if order == "reverse":
        return 1, 0
    if order == "shuffle":
        return 2, SHUFFLE_SEED
    if isinstance(order, (int, np.integer)) and not isinstance(order, bool):
        return 2, int(order) & (2**64 - 1)
    if order == "warps":            # each warp as far as it goes before the next (first warp first)
        return 3, 0
    if order == "warps-reverse":    # the same, last warp (and last block) first
        return 4, 0
    raise ValueError(f"order: got {order!r}, expected 'forward', 'reverse', 'shuffle', an int "
                     "seed, 'warps' or 'warps-reverse'")


def _record_of(a, kernel: str, i: int):
    """A struct passed by value the way the CUDA path passes it to CuPy
    (:func:`cugrouped.ops._launch.by_value`: a ``CPointer`` at the record's bytes, the record kept
    as ``.arg``) is read as that record, once its pointer is checked to be the record's address
    (what CuPy would hand ``cuLaunchKernel``); anything else is returned as it is."""
    rec = getattr(a, "arg", None)
    if not isinstance(rec, np.ndarray) or not hasattr(a, "ptr"):
        return a
    if rec.ndim != 0 or rec.dtype.names is None or a.ptr != rec.ctypes.data:
        raise TypeError(f"{kernel}: argument {i} is a by-value pointer that does not point at its "
                        f"0-d record (ptr {a.ptr:#x})")
    return rec


class EmuKernel:
    """One kernel of an :class:`EmuModule`; call it like ``cupy.RawKernel``."""

    def __init__(self, module: "EmuModule", name: str, info: int):
        self.module = module
        self.name = name
        self._info = ctypes.c_void_p(info)
        lib = module._lib
        self.num_params = lib.cg_emu_nparams(self._info)
        self.param_sizes = tuple(lib.cg_emu_param_size(self._info, i) for i in range(self.num_params))

    def _marshal(self, args):
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"{self.name}: args must be a tuple, got {type(args).__name__}")
        if len(args) != self.num_params:
            raise TypeError(f"{self.name} takes {self.num_params} arguments, got {len(args)}")
        keep = []
        argv = (ctypes.c_void_p * max(1, len(args)))()
        for i, (a, size) in enumerate(zip(args, self.param_sizes)):
            a = _record_of(a, self.name, i)
            if isinstance(a, np.ndarray) and not (a.ndim == 0 and a.dtype.names is not None):
                buf, what = ctypes.c_void_p(a.ctypes.data), "an array (passed as a pointer)"
                nbytes = ctypes.sizeof(buf)
            elif isinstance(a, (np.generic, np.ndarray)):
                raw = a.tobytes()
                buf, nbytes = ctypes.create_string_buffer(raw, max(1, len(raw))), len(raw)
                # (not str() of a record dtype, which costs ~0.2 ms)
                what = "a record" if a.dtype.names is not None else f"a {a.dtype} value"
            elif isinstance(a, (bool, int, float, complex)):
                raise TypeError(f"{self.name}: argument {i} is a Python {type(a).__name__}, whose width is "
                                f"ambiguous; pass a NumPy scalar such as np.int32({a!r}) or np.float32({a!r})")
            else:
                raise TypeError(f"{self.name}: argument {i} of type {type(a).__name__} is not supported "
                                "(NumPy arrays, NumPy scalars and structured records are)")
            if nbytes != size:
                raise TypeError(f"{self.name}: argument {i} is {what} of {nbytes} bytes, but the kernel "
                                f"parameter has {size} bytes")
            keep.append(buf)
            argv[i] = ctypes.addressof(buf)
        return argv, keep

    def __call__(self, grid, block, args, shared_mem: int = 0, order="forward", workers: int | None = None):
        from . import access

        tracer = access.current()
        if tracer is not None and not self.module.trace:   # inside trace_accesses(): the twin
            return self.module.traced(self.name).get_function(self.name)(
                grid, block, args, shared_mem, order, workers)
        g = _dims(grid, "grid", _MAX_GRID)
        b = _dims(block, "block", _MAX_BLOCK)
        if b[0] * b[1] * b[2] > 1024:
            raise ValueError(f"block {b} has more than 1024 threads")
        if int(shared_mem) < 0:
            raise ValueError("shared_mem must be >= 0")
        mode, seed = _order(order)
        argv, keep = self._marshal(args)
        err = ctypes.create_string_buffer(2048)
        rc = [0]

        def launch(nworkers):
            rc[0] = self.module._lib.cg_emu_launch(
                self._info, argv, (ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b),
                ctypes.c_size_t(int(shared_mem)), mode, ctypes.c_ulonglong(seed), nworkers,
                int(self.module.ftz), err, ctypes.c_size_t(len(err)))

        if self.module.trace and tracer is not None:   # one worker: records in one buffer, in order
            tracer.run(self, lambda: launch(1), g, b)
        else:
            launch(int(workers or self.module.workers))
        del keep
        if rc[0] != 0:
            raise EmulationError(f"{self.name}: {err.value.decode(errors='replace')}")

    def __repr__(self):
        return f"<EmuKernel {self.name} params={self.param_sizes}>"


class EmuModule:
    """A kernel source compiled for the CPU emulator (see the module docstring).

    ``path`` is resolved in ``include_dirs`` then the kernels folder; ``code`` is a source string
    instead. ``name_expressions`` are the kernels (template instantiations included) to expose.
    ``options`` are extra g++ flags (e.g. ``-DFOO=1``). ``sanitize=True`` builds with
    AddressSanitizer: such a library loads only in a process started with ``asan_env()``.
    ``ftz`` flushes float denormals like CuPy's ``-ftz=true``; ``workers`` is the number of OS
    threads the blocks are spread over. ``trace=True`` builds the memory access tracing variant
    (:mod:`cugrouped.emulate.access`; :meth:`traced` gives a module's twin).
    """

    def __init__(self, path: str | os.PathLike | None = None, code: str | None = None,
                 name_expressions=(), include_dirs=(), options=(), sanitize: bool = False,
                 workers: int | None = None, ftz: bool = True, trace: bool = False):
        if (path is None) == (code is None):
            raise ValueError("EmuModule needs exactly one of path= or code=")
        if isinstance(name_expressions, str):
            name_expressions = (name_expressions,)
        self.name_expressions = tuple(name_expressions)
        if not self.name_expressions:
            raise ValueError("EmuModule needs name_expressions (the kernels to expose)")
        self.include_dirs = tuple(Path(d).resolve() for d in include_dirs)
        search = self.include_dirs + (_sources.kernels_dir(),)
        if code is not None:
            src_dir = cache_dir() / "src"
            src_dir.mkdir(parents=True, exist_ok=True)
            source = src_dir / f"{hashlib.sha256(code.encode()).hexdigest()[:32]}.cu"
            if not source.is_file():
                tmp = source.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(code)
                os.replace(tmp, source)
        else:
            source = _sources.resolve_includes(str(path), search)[0]
        self.source = Path(source)
        self.options = tuple(options)
        self.sanitize = bool(sanitize)
        self.trace = bool(trace)
        self._traced: dict[str, EmuModule] = {}
        self.workers = workers or default_workers()
        self.ftz = bool(ftz)
        if self.sanitize and not _asan_loaded():
            raise EmulationError(
                "sanitize=True libraries load only when AddressSanitizer's runtime is preloaded: run "
                "Python with LD_PRELOAD=$(g++ -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 "
                "(cugrouped.emulate.asan_env() builds that environment)")
        self.library = _build(self.source, self.name_expressions, self.include_dirs, self.options,
                              self.sanitize, self.trace)
        self._lib = _load(self.library, self.trace)
        self._kernels: dict[str, EmuKernel] = {}

    def traced(self, name: str) -> "EmuModule":
        """Kernel ``name`` of this module built alone for memory access tracing (built once, then
        kept; alone, so that tracing one kernel compiles one)."""
        if self.trace:
            return self
        mod = self._traced.get(name)
        if mod is None:
            if name not in self.name_expressions:
                raise KeyError(f"{name!r} is not among this module's name_expressions "
                               f"{self.name_expressions}")
            mod = self._traced[name] = EmuModule(
                path=self.source, name_expressions=(name,), include_dirs=self.include_dirs,
                options=self.options, workers=1, ftz=self.ftz, trace=True)
        return mod

    def get_function(self, name: str) -> EmuKernel:
        if name not in self._kernels:
            if name not in self.name_expressions:
                raise KeyError(f"{name!r} is not among this module's name_expressions {self.name_expressions}")
            entry = getattr(self._lib, f"cg_emu_kernel_{self.name_expressions.index(name)}")
            entry.restype = ctypes.c_void_p
            self._kernels[name] = EmuKernel(self, name, entry())
        return self._kernels[name]

    def __repr__(self):
        return f"<EmuModule {self.source.name} {self.name_expressions}>"


def _load(path: Path, trace: bool = False) -> ctypes.CDLL:
    key = str(path)
    lib = _loaded.get(key)
    if lib is None:
        lib = ctypes.CDLL(key, mode=os.RTLD_LOCAL | os.RTLD_NOW)
        if trace:
            lib.cg_emu_trace_begin.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
            lib.cg_emu_trace_begin.restype = None
            lib.cg_emu_trace_end.argtypes = [ctypes.POINTER(ctypes.c_ulonglong)]
            lib.cg_emu_trace_end.restype = ctypes.c_ulonglong
            lib.cg_emu_trace_base.argtypes = []
            lib.cg_emu_trace_base.restype = ctypes.c_ulonglong
        lib.cg_emu_nparams.restype = ctypes.c_int
        lib.cg_emu_nparams.argtypes = [ctypes.c_void_p]
        lib.cg_emu_param_size.restype = ctypes.c_size_t
        lib.cg_emu_param_size.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.cg_emu_launch.restype = ctypes.c_int
        lib.cg_emu_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_size_t, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        _loaded[key] = lib
    return lib


def _clear_memory_cache() -> None:
    """Forget loaded libraries (tests use it to exercise the disk cache); handles stay valid."""
    _loaded.clear()


# ---- order variation ------------------------------------------------------------------------------


@dataclass
class OrderReport:
    """What :func:`run_all_orders` found: the outputs per order and the differences."""

    orders: tuple
    outputs: dict = field(default_factory=dict)      # order -> list of output arrays (copies)
    mismatches: list = field(default_factory=list)   # human-readable differences

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def raise_if_mismatch(self) -> None:
        if self.mismatches:
            raise OrderDependenceError("results depend on the fiber order (missing __syncthreads?):\n  "
                                       + "\n  ".join(self.mismatches))


def run_all_orders(kernel: EmuKernel, grid, block, args, *, shared_mem: int = 0, orders=DEFAULT_ORDERS,
                   outputs=None, workers: int | None = None) -> OrderReport:
    """Launch ``kernel`` once per order from the same initial buffers and compare the bits.

    Every writeable array argument is reset to its initial contents before each launch; the
    arrays named by ``outputs`` (argument indices, default: every array argument) are compared bit
    for bit with the first order's. Afterwards the arrays hold the first order's results.
    """
    arrays = [i for i, a in enumerate(args) if isinstance(a, np.ndarray) and a.ndim > 0]
    outputs = arrays if outputs is None else list(outputs)
    initial = {i: args[i].copy() for i in arrays if args[i].flags.writeable}
    report = OrderReport(tuple(orders))
    for order in orders:
        for i, v in initial.items():
            np.copyto(args[i], v)
        kernel(grid, block, args, shared_mem=shared_mem, order=order, workers=workers)
        report.outputs[order] = [np.array(args[i], copy=True) for i in outputs]
    first = orders[0]
    for order in orders[1:]:
        for i, ref, got in zip(outputs, report.outputs[first], report.outputs[order]):
            a, b = ref.reshape(-1).view(np.uint8), got.reshape(-1).view(np.uint8)
            if not np.array_equal(a, b):
                ne = int(np.count_nonzero((a != b).reshape(ref.size, -1).any(axis=1)))
                report.mismatches.append(f"order {order!r}: argument {i}: {ne} of {ref.size} elements "
                                         f"differ from order {first!r}")
    for i, v in zip(outputs, report.outputs[first]):
        if args[i].flags.writeable:
            np.copyto(args[i], v)
    return report
