"""How an emulated kernel touches memory, per source line: the 32-byte sectors each warp's global
loads and stores take, and the bank wavefronts (conflicts) of its shared-memory accesses.

Coalescing and bank conflicts decide whether a memory-bound kernel reaches the GPU's bandwidth,
and neither shows in the bits. Inside :func:`trace_accesses`, every emulated launch runs a
tracing build of its library (``-fsanitize=thread`` instrumentation, answered by
``emu_trace.cpp``: every load, store and atomic of the kernel's code is recorded with its call
site, address, size, block and thread; one worker, so the records come in the emulator's order).
:class:`LaunchTrace` then forms warp requests as a GPU does: the lanes of a warp executing the
same access site for the same time (their n-th execution of it) are one request. Per request:

* global memory: the distinct 32-byte sectors it touches, against the fewest that could hold its
  distinct bytes (``efficiency = bytes / (32 * sectors)``; 1.0: every sector fully used);
* shared memory: wavefronts, NVIDIA's model of bank conflicts: 32 banks of 4 bytes; accesses of
  up to 4 bytes are served for 32 lanes at once, 8-byte ones for 16 lanes, 16-byte ones for 8
  lanes (one *phase* each); a phase takes as many wavefronts as the most distinct 4-byte words
  it reads from one bank (lanes reading the same word share it). ``conflicts = wavefronts /
  phases`` (1.0: conflict-free).

What it is not: timing, caches, the GPU's own instruction choice (a 16-byte access here is a
16-byte access in the source: the SASS checks of ``compile-check`` show the GPU's), or warps that
diverge (lanes are matched by how often they reached a site). Accesses to the fiber's stack
(registers and local memory on a GPU) are not recorded; ``__constant__`` reads count as global.

Usage::

    from cugrouped.emulate.access import trace_accesses
    with trace_accesses() as tr:
        multi_pad_cast_transpose(xs, ..., backend="emulate")
    print(tr.report())
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import dataclasses
import functools
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np

__all__ = ["trace_accesses", "AccessTrace", "LaunchTrace", "Site", "RECORD"]

#: One access as emu_trace.cpp writes it (struct emu::TraceRecord).
RECORD = np.dtype([("pc", "<u8"), ("addr", "<u8"), ("block", "<u4"), ("thread", "<u2"),
                   ("size", "<u2"), ("kind", "u1"), ("space", "u1"), ("pad", "V6")])
KINDS = ("load", "store", "atomic")
SPACES = ("global", "shared")
SECTOR = 32
_EMULATOR_DIR = Path(__file__).resolve().parent

_RUN_LOCK = threading.Lock()
_active: contextvars.ContextVar["AccessTrace | None"] = contextvars.ContextVar("_active",
                                                                        default=None)


def current() -> "AccessTrace | None":
    """The trace that emulated launches record into now (None outside :func:`trace_accesses`)."""
    return _active.get()


@contextlib.contextmanager
def trace_accesses(capacity: int = 4_000_000):
    """Record the memory accesses of every emulated launch made inside the block (each launch
    runs on one worker, in the tracing build of its library). ``capacity``: records per launch
    (32 bytes each); a launch with more is an error naming the count, never a silent cut."""
    if int(capacity) < 1:
        raise ValueError(f"capacity: expected a positive number of records, got {capacity}")
    if shutil.which("addr2line") is None:
        raise RuntimeError("trace_accesses needs addr2line (GNU binutils, which g++ comes with) "
                           "to find the source line of each access; none is on PATH")
    tr = AccessTrace(int(capacity))
    token = _active.set(tr)
    try:
        yield tr
    finally:
        _active.reset(token)


@dataclasses.dataclass(frozen=True)
class Site:
    """The accesses of one source line in one launch, in one space and of one kind."""

    kernel: str
    location: str       # file:line of the innermost frame in the kernel's own sources
    via: str            # file:line that called it, when it is a helper's line; else ""
    space: str          # "global" | "shared"
    kind: str           # "load" | "store" | "atomic"
    size: int           # bytes per lane access (the largest, if the line has several)
    requests: int       # warp requests
    bytes: int          # distinct bytes, summed over the requests
    units: int          # sectors (global) or wavefronts (shared), summed over the requests
    ideal: int          # the fewest sectors for those bytes, or one wavefront per phase

    @property
    def efficiency(self) -> float:
        """``ideal / units``: 1.0 when every request takes the fewest sectors (global) or
        wavefronts (shared) its bytes allow."""
        return self.ideal / self.units if self.units else 1.0


@dataclasses.dataclass
class LaunchTrace:
    """One traced launch: its records (kernel code only) and where each access site is."""

    kernel: str
    grid: tuple
    block: tuple
    records: np.ndarray
    locations: np.ndarray     # per record: its site, "file:line" or "file:line<file:line" (via)
    _sites: list | None = dataclasses.field(default=None, repr=False, compare=False)

    def sites(self) -> list[Site]:
        """Per (line, space, kind): requests and sectors or wavefronts (see the module); worked
        out once per launch (a report and the caller's checks read the same list)."""
        if self._sites is None:
            self._sites = self._count_sites()
        return list(self._sites)

    def _count_sites(self) -> list[Site]:
        r = self.records
        if r.size == 0:
            return []
        req = _request_ids(r)
        out = []
        keys = np.char.add(np.char.add(self.locations.astype(str), "|"),
                           (r["space"] * 3 + r["kind"]).astype(str))
        def order(key):
            where, sk = key.rsplit("|", 1)
            return tuple(_file_line(w) for w in where.split("<")), int(sk)

        for key in sorted(np.unique(keys), key=order):
            m = keys == key
            where, sk = key.rsplit("|", 1)
            loc, _, via = where.partition("<")
            space, kind = SPACES[int(sk) // 3], KINDS[int(sk) % 3]
            sub, sub_req = r[m], req[m]
            _, sub_req = np.unique(sub_req, return_inverse=True)
            nbytes = _distinct_bytes(sub, sub_req)
            if space == "global":
                units = _sectors(sub, sub_req)
                ideal = -(-nbytes // SECTOR)
            else:
                units, ideal = _wavefronts(sub, sub_req)
            out.append(Site(self.kernel, loc, via, space, kind, int(sub["size"].max()),
                            int(sub_req.max()) + 1, int(nbytes.sum()), int(units.sum()),
                            int(ideal.sum())))
        return out

    def global_sectors(self) -> dict[str, int]:
        """Distinct 32-byte sectors of global memory the launch reads and writes (atomics count as
        both): the least DRAM traffic it can cause, caches being perfect."""
        r = self.records[self.records["space"] == 0]
        res = {}
        for name, kinds in (("read", (0, 2)), ("written", (1, 2))):
            sel = r[np.isin(r["kind"], kinds)]
            res[name] = int(np.unique(_expand(sel, SECTOR)[1]).size)
        return res


class AccessTrace:
    """The launches recorded by one :func:`trace_accesses` block."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.launches: list[LaunchTrace] = []

    def sites(self) -> list[Site]:
        return [s for launch in self.launches for s in launch.sites()]

    def report(self) -> str:
        """A table per launch: per source line, the requests and their sectors or wavefronts."""
        lines = []
        for launch in self.launches:
            gs = launch.global_sectors()
            lines.append(f"{launch.kernel}  grid {launch.grid}  block {launch.block}  "
                         f"global sectors read {gs['read']}, written {gs['written']}")
            sites = launch.sites()
            wheres = [_short(s.location) + (f" < {_short(s.via)}" if s.via else "") for s in sites]
            w = max([34, *map(len, wheres)])
            lines.append(f"  {'line':<{w}} {'space':<6} {'kind':<6} {'size':>4} {'requests':>9} "
                         f"{'bytes':>10} {'sectors/wavefronts':>19} {'ideal':>9} "
                         f"{'efficiency':>10}")
            for where, s in zip(wheres, sites):
                lines.append(f"  {where:<{w}} {s.space:<6} {s.kind:<6} {s.size:>4} "
                             f"{s.requests:>9} {s.bytes:>10} {s.units:>19} {s.ideal:>9} "
                             f"{s.efficiency:>10.1%}")
        return "\n".join(lines)

    # -- called by cugrouped.emulate.EmuKernel for each launch of a tracing library ------------
    def run(self, kernel, launch, grid, block) -> None:
        """Run ``launch()`` (one emulated launch of ``kernel``, a tracing build) with the buffer
        armed, and keep its records."""
        lib = kernel.module._lib
        buf = np.zeros(self.capacity, dtype=RECORD)
        lost = ctypes.c_ulonglong(0)
        with _RUN_LOCK:   # the library's buffer pointer is one per process
            lib.cg_emu_trace_begin(ctypes.c_void_p(buf.ctypes.data), ctypes.c_ulonglong(buf.size))
            try:
                launch()
            finally:
                n = lib.cg_emu_trace_end(ctypes.byref(lost))
        if lost.value:
            raise RuntimeError(f"trace_accesses: {kernel.name} made {n + lost.value} accesses, "
                               f"more than capacity={self.capacity}; trace a smaller launch or "
                               f"raise it")
        recs = buf[:n].copy()
        base = lib.cg_emu_trace_base()
        sites = tuple(int(p) for p in np.unique(recs["pc"]) - base)
        where = _symbolize(str(kernel.module.library), sites)
        pcs = recs["pc"] - base
        locs = np.array([where.get(int(p)) for p in pcs], dtype=object)
        keep = locs != None  # noqa: E711 (elementwise)
        self.launches.append(LaunchTrace(kernel.name, grid, block, recs[keep], locs[keep]))


# ---- analysis (NumPy) ---------------------------------------------------------------------------

def _request_ids(r: np.ndarray) -> np.ndarray:
    """Per record, its warp request: (block, warp, site, n) with n the lane's n-th execution of
    the site (records are in each lane's program order)."""
    n = r.size
    order = np.lexsort((np.arange(n), r["pc"], r["thread"], r["block"]))
    s = r[order]
    new = np.ones(n, bool)
    new[1:] = ((s["block"][1:] != s["block"][:-1]) | (s["thread"][1:] != s["thread"][:-1])
               | (s["pc"][1:] != s["pc"][:-1]))
    start = np.maximum.accumulate(np.where(new, np.arange(n), 0))
    occ = np.empty(n, np.int64)
    occ[order] = np.arange(n) - start
    key = np.zeros(n, dtype=[("b", "<u4"), ("w", "<u2"), ("pc", "<u8"), ("n", "<i8")])
    key["b"], key["w"], key["pc"], key["n"] = r["block"], r["thread"] // 32, r["pc"], occ
    return np.unique(key, return_inverse=True)[1].reshape(-1)


def _expand(r: np.ndarray, unit: int):
    """Every ``unit``-byte granule each record touches: (record index, granule)."""
    first = r["addr"] // unit
    count = ((r["addr"] + np.maximum(r["size"], 1) - 1) // unit - first + 1).astype(np.int64)
    idx = np.repeat(np.arange(r.size), count)
    offs = np.arange(idx.size) - np.repeat(np.cumsum(count) - count, count)
    return idx, first[idx] + offs.astype(np.uint64)


def _count_distinct(groups: np.ndarray, values: np.ndarray, ngroups: int) -> np.ndarray:
    pairs = np.unique(np.stack([groups.astype(np.uint64), values.astype(np.uint64)]), axis=1)
    return np.bincount(pairs[0].astype(np.int64), minlength=ngroups)


def _distinct_bytes(r: np.ndarray, req: np.ndarray) -> np.ndarray:
    idx, byte = _expand(r, 1)
    return _count_distinct(req[idx], byte, int(req.max()) + 1)


def _sectors(r: np.ndarray, req: np.ndarray) -> np.ndarray:
    idx, sector = _expand(r, SECTOR)
    return _count_distinct(req[idx], sector, int(req.max()) + 1)


def _wavefronts(r: np.ndarray, req: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(wavefronts, phases) per request: lanes in phases of 128 bytes of accesses (32 lanes up to
    4 bytes, 16 of 8, 8 of 16); per phase the most distinct 4-byte words of one bank."""
    nreq = int(req.max()) + 1
    lanes_per_phase = 128 // np.maximum(r["size"].astype(np.int64), 4).clip(max=128)
    phase = req.astype(np.uint64) * 32 + ((r["thread"] % 32) // lanes_per_phase).astype(np.uint64)
    idx, word = _expand(r, 4)
    pw = np.unique(np.stack([phase[idx], word]), axis=1)          # distinct (phase, word)
    pb, per_bank = np.unique(np.stack([pw[0], pw[1] % 32]), axis=1, return_counts=True)
    ph, first = np.unique(pb[0], return_index=True)
    worst = np.maximum.reduceat(per_bank, first)                  # per phase
    preq = (ph // 32).astype(np.int64)
    return (np.bincount(preq, weights=worst, minlength=nreq).astype(np.int64),
            np.bincount(preq, minlength=nreq))


# ---- where an access site is ---------------------------------------------------------------

def _kernel_frame(path: str) -> bool:
    p = Path(path)
    return (p.suffix in (".cu", ".cuh", ".h", ".hpp") and not path.startswith("/usr/")
            and _EMULATOR_DIR not in p.resolve().parents)


@functools.lru_cache(maxsize=64)
def _symbolize(library: str, offsets: tuple[int, ...]) -> dict[int, str]:
    """``{offset: site}`` for each call site (the instruction before the return address): the
    innermost inlined frame in the kernel's own sources, ``"file:line"``, followed by
    ``"<file:line"`` of the frame that called it when there is one (so a helper such as
    ``store16`` called from two lines gives two sites); sites with none (the emulator's runtime,
    the C++ library) are left out."""
    if not offsets:
        return {}
    out = subprocess.run(["addr2line", "-e", library, "-i", "-a", *[hex(o - 1) for o in offsets]],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    frames: dict[int, list[str]] = {}
    cur = None
    for line in out:     # per address: its inlined frames, innermost first
        if line.startswith("0x"):
            cur = frames.setdefault(int(line, 16) + 1, [])
            continue
        path, _, num = line.rpartition(":")
        num = num.split()[0] if num else "?"
        if cur is not None and path and num.isdigit() and _kernel_frame(path):
            cur.append(f"{path}:{num}")
    return {pc: f[0] + (f"<{f[1]}" if len(f) > 1 else "") for pc, f in frames.items() if f}


def _file_line(location: str) -> tuple[str, int]:
    path, _, num = location.rpartition(":")
    return path, int(num)


def _short(location: str) -> str:
    path, num = _file_line(location)
    return f"{Path(path).name}:{num}"
