"""``python -m cugrouped compile-check``: compile every kernel for real GPU architectures, no GPU needed.

CuPy's front door (``RawModule``) asks the driver for the current device and fails on a machine
without a GPU, but NVRTC itself needs neither. This module feeds CuPy's own NVRTC program class the
exact flags ``RawModule`` would use (``assemble_cupy_compiler_options`` + ``-ftz=true`` + ``-arch`` +
``--device-as-default-execution-space``), so what is checked here is what runs on the GPU, and adds
``-Xptxas=-v`` to read registers, spills, stack and shared memory per kernel from the NVRTC log.

Compiles run in threads (NVRTC releases the GIL) and are remembered on disk, keyed by the exact
source, flags, instantiations and NVRTC library (``CUGROUPED_COMPILE_CACHE``, default
``$CUGROUPED_CACHE_DIR/nvrtc``, i.e. ``~/.cache/cugrouped/nvrtc``; ``0`` turns it off): the test
suite's SASS checks then read what ``compile-check`` compiled instead of compiling it again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import os
import pickle
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import _jit, _sources

ARCHS: tuple[str, ...] = ("80", "89", "90", "100")

__all__ = ["ARCHS", "KernelResources", "offline_options", "compile_offline", "parse_ptxas_log",
           "compile_check"]


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one kernel on one architecture."""

    arch: str
    name: str               # the name expression (template instantiation)
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    shared_bytes: int

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


def offline_options(spec: _jit.KernelSpec, arch: str, *, verbose_ptxas: bool = True) -> tuple[str, ...]:
    """The NVRTC flags RawModule would use for ``spec`` on ``sm_<arch>``, computed without a GPU.

    The CUDA toolkit include folder that CuPy adds is dropped: kernels_cu must compile with no CUDA
    header at all (NVRTC 13 ships none, and the toolkit is not on users' machines).
    """
    from cupy._core.core import assemble_cupy_compiler_options

    opts = tuple(o for o in assemble_cupy_compiler_options(_jit.nvrtc_options(spec))
                 if not re.fullmatch(r"-I.*/cuda[^/]*/include/?", o))
    opts += ("-ftz=true", f"-arch=sm_{arch}", "--device-as-default-execution-space")
    if verbose_ptxas:
        opts += ("-Xptxas=-v",)
    return opts


def compile_offline(spec: _jit.KernelSpec, arch: str, method: str = "cubin"):
    """Compile ``spec`` for ``arch`` with NVRTC; return (image bytes, {name expr: mangled}, log).
    A compile already on disk (module doc) is read back instead; errors are never stored."""
    from cupy.cuda import nvrtc
    from cupy.cuda.compiler import _NVRTCProgram

    options = offline_options(spec, arch, verbose_ptxas=(method == "cubin"))
    if method == "ptx":
        options = tuple(o.replace(f"-arch=sm_{arch}", f"-arch=compute_{arch}") for o in options)
    code = _jit.code_for(spec)
    key = hashlib.sha256(repr((code, spec.source, options, spec.name_expressions, method,
                               nvrtc.getVersion(), _nvrtc_identity())).encode()).hexdigest()
    _jit._announce(spec, code, options, f"sm_{arch}")   # (the JIT knobs' dump, cached or not)
    cache = _cache_dir()
    path = cache / f"{key}.pkl" if cache else None
    if path is not None and path.is_file():
        try:
            return pickle.loads(path.read_bytes())
        except Exception:       # a torn or foreign file: compile again and replace it
            pass
    prog = _NVRTCProgram(code, f"{spec.source}.cu", name_expressions=list(spec.name_expressions),
                         method=method)
    log = io.StringIO()
    image, mapping = prog.compile(options, log)
    result = (image, mapping, log.getvalue())
    if path is not None:
        try:
            cache.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.{id(result)}.tmp")
            tmp.write_bytes(pickle.dumps(result))
            tmp.replace(path)   # atomic: a reader sees a whole file or none
        except OSError:
            pass
    return result


def _cache_dir() -> Path | None:
    where = os.environ.get("CUGROUPED_COMPILE_CACHE", "")
    if where == "0":
        return None
    if where:
        return Path(where)
    root = _sources.cache_root()
    return None if root.parts[0] == "~" else root / "nvrtc"     # no home directory: off


@functools.lru_cache(maxsize=1)
def _nvrtc_identity() -> tuple:
    """The loaded libnvrtc's path, size and mtime (its version says major.minor only; a patch
    release may change ptxas's registers): part of the cache key."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        path = load_nvidia_dynamic_lib("nvrtc").abs_path
        st = os.stat(path)
        return (path, st.st_size, st.st_mtime_ns)
    except Exception:   # another loader (a CUDA toolkit through CuPy): the version only
        return ()


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for 'sm_(\d+a?)'")
_STACK_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_log(log: str, arch: str, mapping: dict[str, str]) -> list[KernelResources]:
    """Resource usage per entry function from an ``-Xptxas=-v`` log (names demangled via ``mapping``)."""
    by_mangled = {v: k for k, v in mapping.items()}
    out: list[KernelResources] = []
    current = None
    stack = (0, 0, 0)
    for line in log.splitlines():
        if m := _ENTRY_RE.search(line):
            current = m.group(1)
            stack = (0, 0, 0)
        elif current and (m := _STACK_RE.search(line)):
            stack = tuple(int(g) for g in m.groups())
        elif current and (m := _USED_RE.search(line)):
            out.append(KernelResources(
                arch=arch, name=by_mangled.get(current, current), registers=int(m.group(1)),
                stack_bytes=stack[0], spill_stores=stack[1], spill_loads=stack[2],
                shared_bytes=int(m.group(2) or 0)))
            current = None
    return out


def compile_check(archs: tuple[str, ...] = ARCHS, *, names: tuple[str, ...] | None = None,
                  echo=print, sass: bool = False) -> int:
    """Compile every registered kernel for ``archs``; print a table; return a process exit code.

    Non-zero when a compile fails, when ptxas reports no entry for an instantiation, or when any
    kernel spills. ``sass``: also disassemble each cubin (``nvdisasm``) and print, per kernel,
    its 16-byte global loads/stores, FP8 conversion instructions and local-memory accesses.
    """
    try:
        import cupy  # noqa: F401  (NVRTC is reached through CuPy)
    except ImportError:
        echo("compile-check: needs CuPy and NVRTC: pip install '.[cuda13]' (or '.[cuda12]') in the "
             "checkout; no GPU or CUDA toolkit is needed")
        return 2
    from . import ops  # noqa: F401  (importing the ops registers their kernel specs)

    specs = _jit.registered()
    if names:
        unknown = set(names) - set(specs)
        if unknown:
            raise ValueError(f"names: unknown kernels {sorted(unknown)}; known: {sorted(specs)}")
        specs = {n: specs[n] for n in names}
    if not specs:
        echo("compile-check: no kernels registered")
        return 1
    echo(f"kernel sources: {_sources.kernels_dir()}")
    header = f"{'arch':>6}  {'regs':>4}  {'spill st/ld':>11}  {'stack':>5}  {'smem':>6}  kernel"
    echo(header)
    echo("-" * len(header))
    failures = 0
    count = 0
    jobs = [(spec, arch) for spec in specs.values() for arch in archs]
    if not jobs:
        echo("compile-check: no architectures given")
        return 1

    def run(job):
        try:
            return compile_offline(*job)
        except Exception as exc:  # CompileException carries the NVRTC log
            return exc

    # all compiles in threads (NVRTC releases the GIL), reported in a fixed order; the first one
    # alone (NVRTC opens libnvrtc-builtins on first use: two threads racing there, one failed)
    results = [run(jobs[0])]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), cores or 1, 8))) as pool:
        results += list(pool.map(run, jobs[1:]))
    for (spec, arch), result in zip(jobs, results):
        if isinstance(result, Exception):
            failures += 1
            echo(f"sm_{arch:<3}  COMPILE ERROR in {spec.source}:\n{result}")
            continue
        image, mapping, log = result
        found = parse_ptxas_log(log, arch, mapping)
        if sass:
            from ._sass import disassemble_image, summary

            code = disassemble_image(image, mapping)
        missing = set(spec.name_expressions) - {r.name for r in found}
        for name in sorted(missing):
            failures += 1
            echo(f"sm_{arch:<3}  NO PTXAS REPORT for {name}")
        for r in found:
            count += 1
            flag = "   <-- SPILLS" if r.spills else ""
            failures += bool(r.spills)
            echo(f"sm_{arch:<3}  {r.registers:>4}  {r.spill_stores:>5}/{r.spill_loads:<5}  "
                 f"{r.stack_bytes:>5}  {r.shared_bytes:>6}  {r.name}{flag}")
            if sass:
                echo(f"{'':>42}SASS: {summary(code[r.name])}")
    echo(f"compile-check: {count} kernel compiles over {len(archs)} architectures, "
         f"{failures} problem(s)")
    return 1 if failures else 0
