"""What every op shares: backend choice, per-stream workspaces, launch recording, emulator order."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import itertools
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from ..grouped_fp8 import int_tuple

__all__ = ["BACKENDS", "resolve_backend", "check_bool", "record_launches", "note_launch",
           "emulation_order",
           "current_emulation_order", "device_workspace", "device_scratch", "refuse_capture",
           "ChunkLaunch", "chunks_of_tiles", "device_chunks", "ArgMemo", "pack_chunks",
           "pointer_offsets", "exclusive_cumsum", "int_tuple", "device_scope", "by_value"]

BACKENDS = ("cuda", "emulate", "reference")


def resolve_backend(backend: str | None, on_device: bool) -> str:
    """``None`` picks by where the data lives: ``"cuda"`` for device arrays, else ``"reference"``."""
    if backend is None:
        return "cuda" if on_device else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"backend: got {backend!r}, expected one of {BACKENDS} or None")
    if backend == "cuda" and not on_device:
        raise ValueError("backend='cuda' needs device arrays (CuPy or CUDA torch); got host arrays "
                         "(use backend='emulate' to run the CUDA kernel on the CPU)")
    if backend != "cuda" and on_device:
        raise ValueError(f"backend={backend!r} runs on the CPU and needs host (NumPy) arrays; "
                         "got device arrays")
    return backend


def check_bool(value, arg: str) -> None:
    """An on/off option is a bool (NumPy's too): ``"yes"``, 1 or None are refused, not read by
    their truth value."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{arg}: expected a bool, got {value!r}")


def setting(n, allowed, expected: str) -> int:
    """A tuning knob's new value ``n`` as an int, if it is an int (NumPy's too, not a bool) in
    ``allowed`` (a range or a tuple); else a ValueError naming ``expected``."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n not in allowed:
        raise ValueError(f"n: expected {expected}, got {n!r}")
    return int(n)


@dataclasses.dataclass(frozen=True)
class Launch:
    backend: str
    kernel: str
    grid: int
    block: int


_recorders: contextvars.ContextVar[tuple[list, ...]] = contextvars.ContextVar("_recorders", default=())


@contextlib.contextmanager
def record_launches():
    """Collect every launch made inside the block (tests assert launch counts with it): CUDA
    launches (kernels, and the GEMMs' ``cublasLtMatmul`` calls) and emulated kernel launches
    only. The reference backend (NumPy, the default for host arrays) launches nothing, so its
    calls record nothing."""
    log: list[Launch] = []
    token = _recorders.set(_recorders.get() + (log,))
    try:
        yield log
    finally:
        _recorders.reset(token)


def note_launch(backend: str, kernel: str, grid: int, block: int) -> None:
    for log in _recorders.get():
        log.append(Launch(backend, kernel, grid, block))


_order: contextvars.ContextVar[object] = contextvars.ContextVar("_order", default="forward")


@contextlib.contextmanager
def emulation_order(order):
    """Run emulated kernels with fibers started in ``order`` (``"forward"``, ``"reverse"``,
    ``"shuffle"`` or an int seed): a kernel whose result depends on it has a race. Any other
    ``order`` is a ValueError here, on entry."""
    from ..emulate import check_order      # the emulator's own rule (light: no compiler run)

    check_order(order)
    token = _order.set(order)
    try:
        yield
    finally:
        _order.reset(token)


def current_emulation_order():
    return _order.get()


_workspaces: dict[tuple[int, int, str], object] = {}


def device_workspace(name: str, ints: int):
    """A zero-initialised int32 device buffer per (device, stream, name), kept for reuse.

    Kernels that use one must leave it zero when they finish (the "last block" reduction pattern):
    it is zeroed once, at allocation, never per call. One per stream, so launches on different
    streams never share counters: launches on one stream run one after the other, and that is the
    only ordering the pattern needs. A buffer outgrown by a larger call is retired, not freed
    (a graph captured earlier may still use it).

    What the key cannot see (each would let two launches share counters concurrently):

    * a CUDA graph captured on stream S holds S's buffer; replaying it on another stream while
      eager launches run on S, or two replays of it at once, race on that buffer (and the first
      allocation, ``cupy.zeros``, must not happen during capture: run the op once on S before
      capturing; an allocation during capture raises a RuntimeError saying so);
    * a destroyed stream whose handle is reused by a new stream while the old one's kernels still
      run.
    """
    import cupy

    return _kept(_workspaces, name, ints, lambda size: cupy.zeros(size, dtype=np.int32))


_scratch: dict[tuple[int, int, str], object] = {}
# Buffers outgrown by a larger call: never handed back to CuPy's pool, since a CUDA graph captured
# before the growth still reads and writes them on replay (the pool would give that memory to the
# next allocation). Growth at least doubles, so they hold less than the live buffers.
_retired: list = []


def _grown(buf, need: int) -> int:
    return need if buf is None else max(need, 2 * buf.size)


def refuse_capture(stream: int, name: str) -> None:
    """A new buffer needs CuPy's pool, whose cudaMalloc is not allowed while the stream is being
    captured into a CUDA graph (it invalidates the capture with a bare CUDA error): say so first."""
    import cupy

    if stream and cupy.cuda.runtime.streamIsCapturing(stream):
        raise RuntimeError(
            f"{name}: this stream's workspace would be allocated inside a CUDA graph capture; run "
            "the op once on the capturing stream before capturing (with torch: warm up under "
            "torch.cuda.stream(s), then capture with torch.cuda.graph(g, stream=s)), with sizes "
            "at least as large as the captured call's")


def _kept(table: dict, name: str, size: int, make):
    """The buffer of ``table`` for (current device, current stream, ``name``) with at least
    ``size`` items: kept from an earlier call, else made by ``make(n)`` (growth at least doubles;
    the outgrown one is retired), never inside a graph capture."""
    import cupy

    stream = cupy.cuda.get_current_stream().ptr
    key = (cupy.cuda.Device().id, stream, name)
    buf = table.get(key)
    if buf is None or buf.size < size:
        refuse_capture(stream, name)
        buf = _replace(table, key, buf, make(_grown(buf, size)))
    return buf


def _replace(table: dict, key, old, new):
    if old is not None:
        _retired.append(old)
    table[key] = new
    return new


def device_scratch(name: str, nbytes: int):
    """An uninitialised byte buffer per (device, stream, name), kept and grown as needed: scratch
    that a kernel writes before it reads it (per-tile partial sums). Kept rather than allocated
    per call, so no pool allocation or free sits in the launch path (a buffer freed right after
    its launch would go back to CuPy's pool while a captured CUDA graph still uses it). Launches
    on one stream are ordered, so they can share it; an outgrown one is retired, not freed, for
    the same reason. See :func:`device_workspace` for what the key cannot see."""
    import cupy

    return _kept(_scratch, name, nbytes,
                 lambda size: cupy.empty(max(size, 1 << 16), dtype=np.uint8))


# ---------------------------------------------------------------------------------------------
# The multi-tensor casts' launches: experts in chunks of one by-value argument block each.

@dataclasses.dataclass(frozen=True)
class ChunkLaunch:
    """One launch: experts ``[first, first + count)`` of the group and its grid of tiles.

    ``tile_start`` (count + 1 offsets) is known with host splits; with device splits it is empty,
    the blocks derive it, and ``grid`` is an upper bound (surplus blocks exit at once).
    """

    first: int
    count: int
    tile_start: tuple[int, ...]
    grid: int


def chunks_of_tiles(tiles: Sequence[int], max_experts: int) -> tuple[ChunkLaunch, ...]:
    """Chunks of at most ``max_experts`` experts with the exclusive prefix sums of their
    ``tiles`` (tiles per expert) as tile offsets; a grid must stay below 2^31 blocks. The
    sums are Python ints, summed in Python (NumPy costs ~6 us a chunk for 65 offsets)."""
    plans, tiles = [], int_tuple(tiles)
    for first in range(0, len(tiles), max_experts):
        chunk = tiles[first:first + max_experts]
        start = tuple(itertools.accumulate(chunk, initial=0))
        if start[-1] >= 2**31:
            raise ValueError(f"too many tiles ({start[-1]}) for one launch")
        plans.append(ChunkLaunch(first, len(chunk), start, start[-1]))
    return tuple(plans)


def device_chunks(num_experts: int, max_experts: int, grid: Callable[[int], int]
                  ) -> list[ChunkLaunch]:
    """Chunks for counts that stay on the device: ``grid(count)`` is the worst case of a chunk
    of ``count`` experts."""
    plans = []
    for first in range(0, num_experts, max_experts):
        count = min(max_experts, num_experts - first)
        blocks = grid(count)
        if blocks >= 2**31:
            raise ValueError(f"too many tiles ({blocks}) for one launch")
        plans.append(ChunkLaunch(first, count, (), blocks))
    return plans


class ArgMemo:
    """Packed argument blocks remembered per argument values, least recently used out first: a
    training step repeats the same splits with buffers the caching allocators hand out again, so
    the blocks repeat too. A key must hold every value written into them."""

    def __init__(self, size: int = 64):
        self.size = size
        self._table: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: Hashable, make: Callable[[], list]) -> list:
        args = self._table.get(key)
        if args is None:
            args = self._table[key] = make()
            if len(self._table) > self.size:
                self._table.popitem(last=False)
        else:
            self._table.move_to_end(key)
        return args


def pack_chunks(dtype: np.dtype, plans: Sequence[ChunkLaunch], per_expert: dict,
                scalars: Callable[[ChunkLaunch], dict] | None = None) -> list:
    """The by-value argument block (a 0-d array of the kernel's struct ``dtype``) of every chunk
    of host-split experts: ``num_experts``, each ``per_expert`` array sliced to the chunk's
    experts, the chunk's ``count + 1`` tile offsets (the kernels search no further) and the
    fields ``scalars(chunk)`` gives."""
    args = []
    for chunk in plans:
        sl = slice(chunk.first, chunk.first + chunk.count)
        arg = np.zeros((), dtype=dtype)
        arg["num_experts"] = chunk.count
        for name, values in per_expert.items():
            arg[name][: chunk.count] = values[sl]
        arg["tile_start"][: chunk.count + 1] = chunk.tile_start
        for name, value in (scalars(chunk) if scalars else {}).items():
            arg[name] = value
        args.append(arg)
    return args


_BY_VALUE = None


def by_value(arg: np.ndarray):
    """A kernel's struct argument block (a 0-d array of a structured dtype) as a CuPy launch
    argument: its address as a ``cupy.cuda.function.CPointer``, the array kept alive with it.

    CuPy passes a NumPy array by value from ``arr.__array_interface__["data"][0]``, and for a
    structured dtype that property describes every field first: ~21 us per launch for the cast
    kernels' argument block on a CI core, against ~2 us this way (``cuLaunchKernel`` copies the
    bytes when it is called, so the array only has to outlive the call)."""
    global _BY_VALUE
    if _BY_VALUE is None:
        from cupy.cuda.function import CPointer

        class ByValue(CPointer):
            __slots__ = ("arg",)

            def __init__(self, arg: np.ndarray):
                super().__init__(arg.ctypes.data)
                self.arg = arg

        _BY_VALUE = ByValue
    if not isinstance(arg, np.ndarray) or arg.shape != () or arg.dtype.fields is None:
        raise TypeError(f"arg: expected a 0-d NumPy array of a structured dtype, got {arg!r:.80}")
    return _BY_VALUE(arg)


def exclusive_cumsum(sizes) -> np.ndarray:
    """int64 ``[0, s0, s0 + s1, ...]``: where each item starts (``[0]`` for no items). Into one
    buffer: ``np.concatenate([[0], np.cumsum(...)])`` costs twice as much on small arrays."""
    if not isinstance(sizes, np.ndarray):     # np.cumsum converts a tuple ~10x slower
        sizes = np.array(sizes, dtype=np.int64)
    first = np.zeros(max(len(sizes), 1), dtype=np.int64)
    sizes[:-1].cumsum(dtype=np.int64, out=first[1:])
    return first


def pointer_offsets(base: int, sizes: np.ndarray, itemsize: int, like: np.ndarray) -> np.ndarray:
    """Per-expert addresses ``base + itemsize * (exclusive prefix sum of sizes)`` as uint64, or
    nulls shaped like ``like`` when ``base`` is 0 (a buffer that is not written)."""
    if not base:
        return np.zeros_like(like)
    first = exclusive_cumsum(sizes)
    return np.uint64(base) + (first if itemsize == 1 else first * itemsize).astype(np.uint64)


def device_scope(backend: str, device: int):
    """The operands' device made current for the allocations and launches of a ``"cuda"`` call
    (CuPy allocates, and kernels and cuBLASLt run, on the current device); a no-op otherwise."""
    if backend != "cuda":
        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.Device(device)
