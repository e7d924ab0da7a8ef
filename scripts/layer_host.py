"""The FP8 layer's host time per training step on the CUDA path, measured on the CPU.

    python scripts/layer_host.py [--profile] [--experts 8 64]

``cuda_path_on_cpu()`` makes the torch layer take its CUDA branch with torch CPU tensors: the
custom ops choose the ``"cuda"`` backend, the ops see the tensors as device-0 arrays (read
through their pointers, as CUDA tensors are), kernel launches build their real argument tuples
(blocks by value, pointers) and stop there, the GEMM loop runs with its device calls faked
(``cugrouped.bench.gemm.host_loop_state``: ``cublasLtMatmul`` called with a NULL handle, so its
argument packing counts), workspaces are host buffers. What is left out, and must be added from
a GPU run to compare with the H200's numbers: CuPy's launch call and ``cuLaunchKernel``, cuBLAS's
own work per ``cublasLtMatmul``, the stream and event calls, torch's CUDA allocations (CPU ones
here), and any wait. Nothing is computed: the buffers hold whatever they held.

Used to find and cut the Python costs of a step without a GPU (scripts/gpu_profile.py measures
the rest on one).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@contextlib.contextmanager
def cuda_path_on_cpu(gemm_path: str = "loop"):
    """Patch the branch points listed in the module docstring for the duration; yields the list
    the fake launcher appends ``(kernel name, grid, block, args)`` to. ``gemm_path="grouped"``:
    the GEMMs as with a cuBLAS that has the grouped GEMM (13.10 on sm_90), its rule that every
    m be a multiple of 16 lifted (``GROUPED_DIM_BYTES``: what the GPU probe asks of cuBLAS), so
    each GEMM is one setup launch and one ``cublasLtMatmul``."""
    from unittest import mock

    import cupy
    import numpy as np
    import torch

    from cugrouped import _array, _jit
    from cugrouped.bench.gemm import host_loop_state
    from cugrouped.ops import _cast_inputs, _gemm_grouped, _launch
    from cugrouped.ops import grouped_gemm as gg
    from cugrouped.pytorch import _custom_ops as cops
    from cugrouped.pytorch import functional

    launches: list = []

    def get_function(spec, name):
        def launch(grid, block, args):
            launches.append((name, grid, block, args))
        return launch

    buffers: dict = {}

    pool = BlockPool()

    class CachingTorch:
        """torch for the custom ops, whose ``empty`` allocates as torch's CUDA caching allocator
        does (:class:`BlockPool`): 512-byte aligned blocks (CPU tensors are 64-byte aligned:
        their pointers' alignments, part of each cuBLASLt call's shape signature, would miss the
        cached algorithms a GPU run hits), freed blocks reused, so a step that repeats the last
        one's allocations gets its addresses (what the plans are memoised on)."""

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(shape, *, dtype, device=None):
            return pool.empty(shape, dtype)

    def host_buffer(name, size, dtype):
        if name not in buffers or buffers[name].size < size:
            buffers[name] = np.zeros(size, dtype)
        return buffers[name]

    def torch_inputs(inputs, m_splits, dtype, splits_on_device):   # the CUDA branch
        tensors = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        return tensors[0].device, inputs, dtype, functional._bytes, m_splits

    state = host_loop_state()
    if gemm_path == "grouped":
        state.cublas_version, state.has_grouped_symbol = 131000, True
        state.grouped = _gemm_grouped._GroupedState(
            alloc=lambda nbytes: host_buffer("grouped workspace", nbytes + 16, np.uint8)[
                -host_buffer("grouped workspace", nbytes + 16, np.uint8).ctypes.data % 16:][:nbytes])
    elif gemm_path != "loop":
        raise ValueError(f"gemm_path: got {gemm_path!r}, expected 'loop' or 'grouped'")
    real_own_device = _cast_inputs._own_device
    patches = [
        mock.patch.object(cops, "torch", CachingTorch()),
        mock.patch.object(_jit, "get_function", get_function),
        mock.patch.object(_launch, "device_workspace", lambda n, ints: host_buffer(n, ints, np.int32)),
        mock.patch.object(_launch, "device_scratch", lambda n, nb: host_buffer(n, nb, np.uint8)),
        mock.patch.object(_launch, "device_scope", lambda backend, device: contextlib.nullcontext()),
        mock.patch.object(gg, "_state", lambda device: state),
        mock.patch.object(cops, "_backend", lambda t, cpu_backend: "cuda"),
        mock.patch.object(cops, "_gemm_backend", lambda t: "cuda"),
        mock.patch.object(cops, "_arr", cops._same),
        mock.patch.object(functional, "_torch_inputs", torch_inputs),
        mock.patch.object(functional, "_gemm_device", lambda problem: torch.device("cpu")),
        # (a gather's row index stays a tensor, as a CUDA one does, not a NumPy view)
        mock.patch.object(functional, "to_array", lambda t: (t, None)),
        # a list of experts read as the tensors' own attributes place them: device 0 too
        mock.patch.object(_cast_inputs, "_own_device",
                          lambda x, kind: 0 if kind == "torch" else real_own_device(x, kind)),
        mock.patch.object(cupy.cuda.runtime, "getDevice", lambda: 0),
        # torch CPU tensors read as device-0 arrays by as_view, at no extra cost per view
        mock.patch.dict(_array._TORCH_DEVICES, {torch.device("cpu"): 0}),
        mock.patch.object(_gemm_grouped, "GROUPED_DIM_BYTES",
                          1 if gemm_path == "grouped" else _gemm_grouped.GROUPED_DIM_BYTES),
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        gg.clear_memo()
        try:
            yield launches
        finally:
            gg.clear_memo()


# The token counts a "router" run cycles through, one set per step, after one cycle of warm-up:
# the steady state of training, where cuBLASLt's per-shape algorithms have been looked up (the
# counts of each expert recur over many steps) but a set of counts is new. Each count-keyed
# cache holds fewer sets than this (the cast's tile plans are cleared every step), so none hits.
ROUTER_DRAWS = 128


ALIGN = 512   # torch's CUDA caching allocator's block alignment


def aligned_empty(shape, dtype, raw=None):
    """An uninitialised CPU tensor whose data starts on an :data:`ALIGN`-byte boundary (in
    ``raw``, a uint8 block of at least its bytes plus ``ALIGN``, when given)."""
    import math

    import torch

    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if raw is None:
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    off = -raw.data_ptr() % ALIGN
    return raw[off:off + nbytes].view(dtype).view(shape)


class BlockPool:
    """Aligned CPU blocks reused as the CUDA caching allocator reuses device memory: a tensor's
    block returns to its size's free list when the tensor is collected, and an allocation of
    that size takes the last one freed. (Nothing here computes with the values, so a block
    handed out again while a view of its old tensor lives only makes garbage values.)"""

    def __init__(self):
        self.free: dict = {}

    def empty(self, shape, dtype):
        import math
        import weakref

        import torch

        nbytes = math.prod((shape,) if isinstance(shape, int) else shape) * dtype.itemsize
        free = self.free.setdefault(nbytes, [])
        raw = free.pop() if free else torch.empty(nbytes + ALIGN, dtype=torch.uint8)
        t = aligned_empty(shape, dtype, raw)
        weakref.finalize(t, free.append, raw)
        return t


def layer_step(experts: int, k: int, n: int, tokens: int, recipe: str = "current",
               counts: str = "fixed"):
    """One training step of a GroupedLinear on CPU tensors (bf16, one (T, k) input and host
    splits), FP8 with ``recipe`` ("current" or "delayed"): forward, then the input's and the
    weights' gradients. ``counts``: "fixed" (the same token counts every step) or "router" (new
    counts every step, as an MoE router makes them: :data:`ROUTER_DRAWS` seeded jagged sets in
    turn, the same tokens in all; run a cycle first for the steady state)."""
    import itertools

    import torch

    from cugrouped.bench.common import moe_splits
    from cugrouped.ops import pad_cast_transpose as pct
    from cugrouped.pytorch import (DelayedScaling, Float8CurrentScaling, Format, GroupedLinear,
                                   fp8_autocast)

    if counts not in ("fixed", "router"):
        raise ValueError(f"counts: expected 'fixed' or 'router', got {counts!r}")
    draws = itertools.cycle([moe_splits(experts, tokens, True, 1 + i)
                             for i in range(ROUTER_DRAWS if counts == "router" else 1)])
    torch.manual_seed(0)
    layer = GroupedLinear(experts, k, n, bias=False, params_dtype=torch.bfloat16, device="cpu")
    params = layer.weights()
    x = aligned_empty((tokens, k), torch.bfloat16).copy_(torch.randn(tokens, k)).requires_grad_()
    dy = aligned_empty((tokens, n), torch.bfloat16).copy_(torch.randn(tokens, n))
    fp8 = (Float8CurrentScaling if recipe == "current" else DelayedScaling)(
        fp8_format=Format.HYBRID)

    def step():
        if counts == "router":
            pct._plan_cached.cache_clear()     # (256 sets: it would hold all of them)
        with fp8_autocast(fp8_recipe=fp8):
            y = layer(x, next(draws))
            return torch.autograd.grad(y, [x, *params], dy)
    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--counts", choices=("router", "fixed"), nargs="+",
                        default=["router", "fixed"],
                        help="new token counts every step (as in MoE training), or the same")
    parser.add_argument("--gemm-path", choices=("loop", "grouped"), default="loop",
                        help="the per-expert loop (cuBLAS 13.1, the H200 image's), or one grouped "
                             "call per GEMM (a cuBLAS with the grouped GEMM, any m)")
    parser.add_argument("--profile", action="store_true", help="a cProfile of 20 steps each")
    args = parser.parse_args(argv)
    import cProfile
    import pstats

    with cuda_path_on_cpu(args.gemm_path) as launches:
        for experts, counts, recipe in itertools.product(args.experts, args.counts,
                                                         ("current", "delayed")):
            step = layer_step(experts, 256, 256, 64 * experts, recipe, counts)
            # warm-up (fixed: the caching allocator's addresses recur every few steps, so each
            # plan is seen again, and its memos and grouped arrays are kept, by the eighth)
            for _ in range(ROUTER_DRAWS if counts == "router" else 8):
                step()
            launches.clear()
            step()
            per_step = len(launches)
            best = float("inf")
            for _ in range(3):
                t0 = time.thread_time()
                for _ in range(20):
                    step()
                best = min(best, (time.thread_time() - t0) / 20)
            print(f"E={experts:3d} {counts:<6} counts {recipe:<8}: {best * 1e6:8.0f} us per "
                  f"step on the CUDA path's host code ({per_step} kernel launches; cuBLAS "
                  f"calls faked)")
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(20):
                    step()
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
