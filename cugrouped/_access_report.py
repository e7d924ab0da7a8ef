"""``python -m cugrouped access``: the memory accesses of the cast kernels, counted on the CPU.

Runs each cast on a small MoE-like problem under the emulator with access tracing
(:mod:`cugrouped.emulate.access`) and prints, per kernel, the sectors of every global access line
and the bank wavefronts of every shared one, then the whole launch against the least traffic the
op needs: the DRAM side of "how close to the copy bandwidth can it get", without a GPU.
"""

from __future__ import annotations

import numpy as np

from ._array import DeviceLikeHost

def _inputs(dtype: str, k: int, splits) -> list:
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(0)
    xs = []
    for m in splits:
        x = DeviceLikeHost.empty((m, k), dt)   # placed like a device allocation
        x[...] = rng.standard_normal((m, k)).astype(dt)
        xs.append(x)
    return xs


def _runs(what: str, xs):
    from . import multi_block_cast_transpose, multi_mxfp8_cast_transpose, multi_pad_cast_transpose

    E = len(xs)
    if what in ("cast", "all"):
        yield "per-tensor (given scales)", lambda: multi_pad_cast_transpose(
            xs, scale=np.ones(E, np.float32), backend="emulate")
        yield "per-tensor (current scaling)", lambda: multi_pad_cast_transpose(
            xs, backend="emulate")
    if what in ("block", "all"):
        yield "block 1 x 128", lambda: multi_block_cast_transpose(xs, backend="emulate")
        yield "block 128 x 128", lambda: multi_block_cast_transpose(
            xs, block_scaling_dim=2, backend="emulate")
    if what in ("mxfp8", "all"):
        yield "mxfp8 1 x 32", lambda: multi_mxfp8_cast_transpose(xs, backend="emulate")


def _nbytes(res) -> int:
    return sum(int(a.nbytes) for a in (res.data, res.data_t) if a is not None)


def run_access_report(what: str = "all", dtype: str = "bfloat16", k: int = 256,
                      splits=(128, 0, 161, 64)) -> int:
    from .emulate.access import SECTOR, trace_accesses

    xs = _inputs(dtype, k, splits)
    in_sectors = sum(x.nbytes for x in xs) // SECTOR
    print(f"memory accesses of the cast kernels, emulated on the CPU: {dtype}, k={k}, "
          f"splits={list(splits)}\n(sectors: 32-byte pieces of global memory a warp request "
          f"touches; wavefronts: shared-memory passes, more than the ideal = bank conflicts)\n")
    for title, call in _runs(what, xs):
        with trace_accesses() as tr:
            res = call()
        print(f"== {title}")
        print(tr.report())
        sites = tr.sites()
        shared = [s for s in sites if s.space == "shared"]
        extra = sum(s.units - s.ideal for s in shared)
        read = sum(t.global_sectors()["read"] for t in tr.launches)
        written = sum(t.global_sectors()["written"] for t in tr.launches)
        print(f"   DRAM floor: read {read} sectors over {len(tr.launches)} launch(es) (the inputs "
              f"are {in_sectors}), wrote {written} (the FP8 outputs are "
              f"{_nbytes(res) // SECTOR}, plus scales); shared memory: "
              f"{sum(s.units for s in shared)} wavefronts, {extra} from bank conflicts\n")
    return 0
