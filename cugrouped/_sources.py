"""Finding, reading and fingerprinting the CUDA sources in ``kernels_cu/``.

The sources are installed as package data of ``cugrouped.kernels_cu``; in a checkout that was not
installed they are read from the top-level ``kernels_cu/`` folder. Every compiled artefact (NVRTC
module, emulated shared library) is keyed by :func:`source_digest`, which hashes the source *and
every file it includes*, transitively: CuPy's own disk cache only hashes the code string, so a
header edit would otherwise be served stale.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

__all__ = ["kernels_dir", "read_source", "resolve_includes", "source_digest", "list_sources",
           "cache_root"]


def cache_root() -> Path:
    """Where built artefacts are cached (emulated libraries, offline NVRTC compiles):
    ``$CUGROUPED_CACHE_DIR``, else ``~/.cache/cugrouped`` (relative ``~/...`` without a home)."""
    return Path(os.environ.get("CUGROUPED_CACHE_DIR")
                or os.path.join(os.path.expanduser("~"), ".cache", "cugrouped"))

_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


@functools.lru_cache(maxsize=None)
def kernels_dir() -> Path:
    """The folder that holds the ``.cu``/``.cuh`` sources of the installed (or checked-out) package.

    A wheel installs them as ``cugrouped/kernels_cu/`` (package data); a checkout, also when it is
    installed in editable mode, has them at the top level beside ``cugrouped/``.
    """
    here = Path(__file__).resolve().parent
    for path in (here / "kernels_cu", here.parent / "kernels_cu"):
        if path.is_dir() and any(path.glob("*.cu")):
            return path
    raise FileNotFoundError(
        f"cugrouped: kernel sources not found in {here / 'kernels_cu'} (installed package) nor in "
        f"{here.parent / 'kernels_cu'} (checkout)")


def list_sources(suffix: str = ".cu") -> list[str]:
    """Names (relative to :func:`kernels_dir`) of the sources with the given suffix."""
    root = kernels_dir()
    return sorted(p.relative_to(root).as_posix() for p in root.rglob(f"*{suffix}"))


def _resolve(name: str, including: Path | None, search: tuple[Path, ...]) -> Path:
    candidates = ([including.parent] if including is not None else []) + list(search)
    for base in candidates:
        path = (base / name).resolve()
        if path.is_file():
            return path
    where = f" (included from {including})" if including is not None else ""
    raise FileNotFoundError(f"cugrouped: cannot find kernel source {name!r}{where}; searched {candidates}")


def resolve_includes(name: str, search: tuple[Path, ...] | None = None) -> list[Path]:
    """The source ``name`` followed by every file it ``#include "..."``-s, transitively, in order.

    Quoted includes are resolved like the compilers do: first beside the including file, then in
    ``search`` (default: the kernels folder). Angle-bracket includes are not followed (the kernels
    must not use any: NVRTC 13 ships no headers).
    """
    search = (kernels_dir(),) if search is None else tuple(search)
    first = _resolve(name, None, search)
    seen: dict[Path, None] = {first: None}
    stack = [first]
    while stack:
        path = stack.pop()
        for inc in _INCLUDE_RE.findall(path.read_text()):
            dep = _resolve(inc, path, search)
            if dep not in seen:
                seen[dep] = None
                stack.append(dep)
    return list(seen)


def read_source(name: str) -> str:
    """Text of one kernel source, e.g. ``read_source("pad_cast_transpose.cu")``."""
    return _resolve(name, None, (kernels_dir(),)).read_text()


def source_digest(name: str, search: tuple[Path, ...] | None = None) -> str:
    """SHA-256 over the source and all its transitive includes (names and contents)."""
    h = hashlib.sha256()
    for path in resolve_includes(name, search):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()
