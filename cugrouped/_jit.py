"""Run-time compilation of ``kernels_cu`` sources with NVRTC, through ``cupy.RawModule``.

A kernel source is described by a :class:`KernelSpec` (the ``.cu`` file and the template
instantiations it must provide). Ops declare their specs at import time with :func:`register`, so
:func:`warmup` and ``python -m cugrouped compile-check`` see every instantiation the library uses.

The code string handed to NVRTC is a two-line stub that ``#include``-s the source through ``-I``
and carries the SHA-256 of the source and all of its transitive includes. CuPy's disk cache hashes
the code string and the options but not the headers it reaches through ``-I``; with the digest in
the string, editing any ``kernels_cu`` file changes the key (DeepGEMM does the same).

Environment knobs (documented in the README):

``CUGROUPED_JIT_VERBOSE=1``
    print the NVRTC options and the code string of every compile.
``CUGROUPED_JIT_DUMP=<dir>``
    write every generated code string, with its options, to ``<dir>``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import sys
import threading
from pathlib import Path

from . import _sources

__all__ = [
    "KernelSpec",
    "register",
    "registered",
    "code_for",
    "nvrtc_options",
    "get_function",
    "get_emulated_function",
    "clear_cache",
    "warmup",
]

# Flags we add to what CuPy's RawModule adds itself (-arch, -ftz=true,
# --device-as-default-execution-space, the CCCL include folders). No --use_fast_math: the FP8 and
# scale arithmetic must be IEEE (round-to-nearest division) to match the reference bits.
BASE_OPTIONS: tuple[str, ...] = ("-std=c++17",)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One kernel source and the instantiations the library needs from it.

    ``source`` is a path relative to ``kernels_cu/``; ``name_expressions`` are the C++ names of the
    ``__global__`` functions (template instantiations spelled out, e.g. ``"k<float, 0>"``);
    ``defines`` are extra ``-D`` macros baked into this module.
    """

    source: str
    name_expressions: tuple[str, ...]
    defines: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name_expressions:
            raise ValueError(f"KernelSpec({self.source!r}): name_expressions is empty")


_REGISTRY: dict[str, KernelSpec] = {}


def register(name: str, spec: KernelSpec) -> KernelSpec:
    """Declare ``spec`` under a short ``name`` (used by compile-check and warmup)."""
    old = _REGISTRY.get(name)
    if old is not None and old != spec:
        raise ValueError(f"kernel spec {name!r} registered twice with different contents")
    _REGISTRY[name] = spec
    return spec


def registered() -> dict[str, KernelSpec]:
    """All specs declared by the ops (importing :mod:`cugrouped` imports every op)."""
    return dict(_REGISTRY)


def code_for(spec: KernelSpec) -> str:
    """The code string NVRTC compiles: the source reached through ``-I``, plus the digest."""
    digest = _sources.source_digest(spec.source)
    return (
        f"// cugrouped kernel {spec.source}; sha256 of it and its includes: {digest}\n"
        f'#include "{spec.source}"\n'
    )


def nvrtc_options(spec: KernelSpec) -> tuple[str, ...]:
    """Our options for ``spec`` (CuPy appends its own: -arch, -ftz=true, CCCL includes)."""
    return BASE_OPTIONS + (f"-I{_sources.kernels_dir()}",) + tuple(f"-D{d}" for d in spec.defines)


def _announce(spec: KernelSpec, code: str, options: tuple[str, ...], where: str) -> None:
    if os.environ.get("CUGROUPED_JIT_VERBOSE", "") not in ("", "0"):
        print(f"[cugrouped.jit] compiling {spec.source} for {where}\n  options: {' '.join(options)}\n"
              f"  instantiations: {', '.join(spec.name_expressions)}\n{code}", file=sys.stderr)
    dump = os.environ.get("CUGROUPED_JIT_DUMP", "")
    if dump:
        out = Path(dump)
        out.mkdir(parents=True, exist_ok=True)
        names = hashlib.sha256("\n".join(spec.name_expressions).encode()).hexdigest()[:8]
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{spec.source}-{names}-{where}")
        (out / f"{stem}.cu").write_text(code)
        (out / f"{stem}.options.txt").write_text("\n".join(options) + "\n"
                                                 + "\n".join(spec.name_expressions) + "\n")


_codes: dict[KernelSpec, str] = {}
_modules: dict[tuple[int, KernelSpec, str], object] = {}
_functions: dict[tuple[int, KernelSpec, str], object] = {}
_lock = threading.Lock()


_emulated: dict[tuple[KernelSpec, str], object] = {}


def get_emulated_function(spec: KernelSpec, name_expression: str):
    """The same instantiation built for the CPU emulator (:mod:`cugrouped.emulate`), kept in memory
    per (spec, instantiation) like :func:`get_function`: building the ``EmuModule`` re-hashes the
    sources (~ms), so it is done once per process (or after :func:`clear_cache`)."""
    if name_expression not in spec.name_expressions:
        raise ValueError(f"{name_expression!r} is not one of the instantiations of "
                         f"{spec.source}: {spec.name_expressions}")
    key = (spec, name_expression)
    fn = _emulated.get(key)
    if fn is None:
        from . import emulate

        options = tuple(f"-D{d}" for d in spec.defines)
        mod = emulate.EmuModule(path=spec.source, name_expressions=spec.name_expressions,
                                options=options)
        fn = _emulated[key] = mod.get_function(name_expression)
    return fn


def clear_cache() -> None:
    """Forget the in-memory code strings, modules and kernels: the next launch re-reads and
    re-hashes the sources (for editing kernels in a running process; CuPy's disk cache still
    serves unchanged code)."""
    with _lock:
        _codes.clear()
        _modules.clear()
        _functions.clear()
        _emulated.clear()


def _code(spec: KernelSpec) -> str:
    code = _codes.get(spec)
    if code is None:   # reading and hashing the sources costs ~1 ms: once per process, not per launch
        code = _codes[spec] = code_for(spec)
    return code


def _module(spec: KernelSpec, device: int):
    code = _code(spec)
    key = (device, spec, code)
    mod = _modules.get(key)
    if mod is None:
        import cupy

        with _lock:
            mod = _modules.get(key)
            if mod is None:
                options = nvrtc_options(spec)
                _announce(spec, code, options, f"device{device}")
                mod = cupy.RawModule(code=code, options=options, backend="nvrtc",
                                     name_expressions=list(spec.name_expressions))
                _modules[key] = mod
    return mod


def get_function(spec: KernelSpec, name_expression: str):
    """The ``cupy.RawKernel`` for one instantiation, compiled for the current device on first use.

    Kernels are kept in memory per (device, spec, instantiation): after the first call a launch
    costs a dictionary lookup. The sources are read and hashed once per process (see
    :func:`clear_cache` to pick up an edit without restarting); CuPy's disk cache, keyed by that
    hash, makes the next process start warm.
    """
    import cupy

    if name_expression not in spec.name_expressions:
        raise ValueError(f"{name_expression!r} is not one of the instantiations of "
                         f"{spec.source}: {spec.name_expressions}")
    key = (cupy.cuda.runtime.getDevice(), spec, name_expression)
    fn = _functions.get(key)
    if fn is None:
        fn = _functions[key] = _module(spec, key[0]).get_function(name_expression)
    return fn


def warmup(names=None, parallel: bool = False) -> list[str]:
    """Compile every registered kernel (or the modules ``names``) for the current device ahead of
    use; return what was built. Needs a GPU (``python -m cugrouped compile-check`` compiles for
    named architectures without one; the CPU backends need no compilation).

    ``parallel``: first compile each module in a process of its own (NVRTC is single-threaded;
    the biggest module takes ~40 s on a CI core), which fills CuPy's disk cache, then load them
    all here from it."""
    from . import gpu_available, ops  # noqa: F401  (imports register the specs)

    specs = registered()
    names = list(specs) if names is None else list(names)
    unknown = set(names) - set(specs)
    if unknown:
        raise ValueError(f"names: unknown kernel modules {sorted(unknown)}; known: {sorted(specs)}")
    if not gpu_available():
        raise RuntimeError("warmup: no CUDA GPU is visible to CuPy, so there is no device to "
                           "compile for; the CPU backends ('reference', 'emulate') need no "
                           "warm-up, and `python -m cugrouped compile-check` compiles every "
                           "kernel for sm_80/89/90/100 without a GPU")
    if parallel and len(names) > 1:
        import subprocess
        import sys

        procs = [subprocess.Popen([sys.executable, "-c", "import cugrouped._jit as j; "
                                   f"j.warmup([{n!r}])"]) for n in names]
        failed = [n for n, p in zip(names, procs) if p.wait() != 0]
        if failed:
            raise RuntimeError(f"warmup: compiling {failed} failed (see the output above)")
    built = []
    for name in names:
        spec = specs[name]
        for expr in spec.name_expressions:
            get_function(spec, expr)
        built.append(name)
    return built
