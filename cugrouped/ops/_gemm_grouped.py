"""cuBLASLt's grouped GEMM (one call for all experts): the path decision, the device-workspace
layout, the descriptors, the setup kernel's description and the grouped launch. Package-private:
the public names are re-exported by :mod:`cugrouped.ops.grouped_gemm`."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .._array import data_ptr
from ..cublaslt import _enums as E
from ..cublaslt._lib import CublasLtError
from ..cublaslt import descriptors as _D  # imports without loading libcublasLt
from . import _launch
from . import grouped_gemm_setup as _setup  # registers the setup kernel (compile-check, warmup)
from ._gemm_plan import _ITEMSIZE, Problem, VecPlan, as_blocks

if TYPE_CHECKING:
    from ._gemm_launch import _DeviceState

# ---------------------------------------------------------------------------------------------
# cuBLASLt's grouped GEMM (one call for all experts): capability rules and descriptors.
#
# The decision (``choose_path``: pure, tested), the device-workspace layout the per-group arrays
# live in, the descriptors over it (tested on the CPU against the real library), the setup spec
# that ``kernels_cu/grouped_gemm_setup.cu`` fills those arrays from in one launch, and the one
# grouped ``cublasLtMatmul`` through them. When ``choose_path`` refuses (old cuBLAS, bias, more
# than 256 experts, unevenly placed operands, ...) the ops run the per-expert loop. Never run on
# a GPU yet: the GPU tests in tests/test_grouped_gemm.py are what will prove it.

# cuBLAS versions (cublasLtGetVersion: major*10000 + minor*100 + patch), from TransformerEngine's
# cublaslt_grouped_gemm.cu and design.md §5.
GROUPED_MIN_VERSION_BLACKWELL = 130300     # sm_100..sm_110, BF16/FP16 and FP8
GROUPED_MIN_VERSION_HOPPER = 130400        # sm_90, BF16/FP16
GROUPED_MIN_VERSION_HOPPER_FP8 = 130500    # sm_90, FP8 per-tensor scaling (PER_BATCH_SCALAR_32F)
GROUPED_BAD_VERSIONS = (130700, 130801)    # [lo, hi): TE reports data corruption with per-group outputs
# Block-scaled operands (per-group scale pointer arrays, the loop's scale layouts), after
# TransformerEngine's grouped path: MXFP8 (VEC32_UE8M0) on sm_100..sm_110 from the first grouped
# cuBLAS; Hopper's 1 x 128 / 128 x 128 blocks (VEC128_32F, BLK128x128_32F; never both 2-D) on sm_90
# from 13.6 (13.4 has them, but TE enables them from 13.6: its algorithm selection fix; 2-D x 2-D
# is refused by the operand checks on every path).
GROUPED_MIN_VERSION_MXFP8 = 130300
GROUPED_MIN_VERSION_HOPPER_BLOCK = 130600
GROUPED_MAX_GROUPS = 256                   # what one setup launch's argument block will hold
# Every group's m, n and k a multiple of this many bytes of the input type: NVIDIA's grouped
# samples state it; scripts/gpu_probe_gemm.py's grouped probe tries 1 (MoE token counts are any
# m) on the GPU, to relax it once a GPU shows cuBLAS right without it.
GROUPED_DIM_BYTES = 16
_GROUPED_INPUTS = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


def grouped_gemm_unsupported(version: int, compute_capability: int, *, fp8: bool, in_dtype: str,
                             has_symbol: bool = True) -> str | None:
    """Why cuBLASLt's grouped GEMM cannot run this configuration, or None if it can."""
    if not has_symbol:
        return f"libcublasLt {version} has no cublasLtGroupedMatrixLayoutCreate (needs 13.2+)"
    if in_dtype not in _GROUPED_INPUTS:
        return f"grouped GEMM inputs must be FP8, bfloat16 or float16, got {in_dtype}"
    cc = int(compute_capability)
    if cc < 90 or cc > 110:
        return f"grouped GEMM runs on sm_90 (Hopper) and sm_100..sm_110 (Blackwell), not sm_{cc}"
    need = (GROUPED_MIN_VERSION_BLACKWELL if cc >= 100
            else GROUPED_MIN_VERSION_HOPPER_FP8 if fp8 else GROUPED_MIN_VERSION_HOPPER)
    if version < need:
        return (f"grouped {'FP8' if fp8 else in_dtype} GEMM on sm_{cc} needs cuBLAS "
                f"{need // 10000}.{need // 100 % 100}+, this is {version // 10000}.{version // 100 % 100}")
    return None


def grouped_block_unsupported(version: int, compute_capability: int, a_mode: int, b_mode: int
                              ) -> str | None:
    """Why cuBLASLt's grouped GEMM cannot take these block-scaled operands (scale modes of A and
    B), or None if it can (on top of :func:`grouped_gemm_unsupported`)."""
    cc = int(compute_capability)
    if E.CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0 in (a_mode, b_mode):
        if cc < 100:
            return f"grouped MXFP8 GEMMs run on sm_100..sm_110, not sm_{cc}"
        need = GROUPED_MIN_VERSION_MXFP8
    else:
        if cc >= 100:
            return f"grouped 128-element block-scaled GEMMs run on Hopper (sm_90), not sm_{cc}"
        need = GROUPED_MIN_VERSION_HOPPER_BLOCK
    if version < need:
        return (f"grouped block-scaled GEMMs on sm_{cc} need cuBLAS {need // 10000}."
                f"{need // 100 % 100}+, this is {version // 10000}.{version // 100 % 100}")
    return None


def choose_path(problem: Problem, vp: VecPlan, *, version: int, compute_capability: int,
                has_symbol: bool, discrete_out: bool, requested: str | None = None) -> tuple[str, str]:
    """``("grouped" | "loop", reason)`` for a planned problem.

    The loop is kept when the library or GPU lacks the grouped GEMM (for block-scaled operands:
    :func:`grouped_block_unsupported`), for a bias epilogue (not offered by the grouped path),
    more than :data:`GROUPED_MAX_GROUPS` experts, the cuBLAS
    versions with the per-group-output corruption (``discrete_out``: wgrad into a list of
    ``main_grad`` buffers), and when a group's m, n or k is not a multiple of
    :data:`GROUPED_DIM_BYTES` (16) bytes of its
    input type (NVIDIA's grouped samples state that requirement; to be relaxed once a GPU test
    shows more works), or fewer than two experts compute anything.
    ``requested="loop"`` forces the loop; ``"grouped"`` raises if the grouped GEMM cannot run.
    """
    if requested not in (None, "loop", "grouped"):
        raise ValueError(f"path: got {requested!r}, expected None, 'loop' or 'grouped'")
    if requested == "loop":
        return "loop", "requested"
    in_dtype = as_blocks(problem.left).dtype
    reason = grouped_gemm_unsupported(version, compute_capability, fp8=problem.fp8,
                                      in_dtype=in_dtype, has_symbol=has_symbol)
    if reason is None and problem.block_scaled:
        reason = grouped_block_unsupported(version, compute_capability, problem.right_scale_mode,
                                           problem.left_scale_mode)
    if reason is None and problem.bias is not None:
        reason = "the grouped GEMM has no bias epilogue"
    if reason is None and len(problem.reduction) > GROUPED_MAX_GROUPS:
        reason = f"more than {GROUPED_MAX_GROUPS} experts"
    if reason is None and GROUPED_BAD_VERSIONS[0] <= version < GROUPED_BAD_VERSIONS[1]:
        if discrete_out:
            reason = f"cuBLAS {version} corrupts per-group outputs (fixed in 13.8.1)"
        elif int(compute_capability) >= 100:     # CUDA 13.4 U1's known issue [6798616]
            reason = (f"cuBLAS {version}'s grouped GEMM can give wrong results on Blackwell "
                      f"(13.7.0 to 13.8.0)")
    if reason is None:
        unit = max(1, GROUPED_DIM_BYTES // _ITEMSIZE[in_dtype])
        if np.any(vp.mnk % unit):
            reason = (f"a group's m, n or k is not a multiple of {unit} elements "
                      f"({GROUPED_DIM_BYTES} bytes)")
    if reason is None:
        # the grouped call's pointers and leading dimensions live on the device, where cuBLAS
        # cannot check them: 16 bytes each, every dtype (NVIDIA's grouped samples and the
        # 13.1 notes); the checks hold FP8 to it, a 16-bit operand may come sliced
        isz = (_ITEMSIZE[as_blocks(problem.right).dtype], _ITEMSIZE[in_dtype],
               _ITEMSIZE[problem.out_dtype])
        lds = vp.keys[:, [3, 7, 11]] * np.array(isz, dtype=np.int64)
        if np.any(vp.keys[:, 12:16] < 16) or np.any(lds % 16):
            reason = "a group's A, B or D pointer or leading dimension is not 16-byte aligned"
    if reason is None and vp.mnk.shape[0] < 2:
        reason = "fewer than two experts to compute"
    if reason is None:
        return "grouped", "supported"
    if requested == "grouped":
        raise RuntimeError(f"path='grouped' cannot run: {reason}")
    return "loop", reason


# Device workspace of one grouped call: 6 pointer arrays (A, B, C, D, A scale, B scale; each
# 16-byte aligned, as cuBLAS requires for pointer arrays), 9 int32 arrays (rows, cols, ld of A,
# B and D; C shares D's) and the two float scalars alpha, beta (device pointer mode).
GROUPED_PTR_ARRAYS = ("a", "b", "c", "d", "a_scale", "b_scale")
GROUPED_INT_ARRAYS = ("a_rows", "a_cols", "a_ld", "b_rows", "b_cols", "b_ld", "d_rows", "d_cols",
                      "d_ld")


@functools.lru_cache(maxsize=None)
def grouped_workspace_layout(groups: int) -> tuple[Mapping[str, int], int]:
    """Byte offsets of every array of a grouped call's device workspace (read-only), and its
    total size."""
    off, pos = {}, 0
    for name in GROUPED_PTR_ARRAYS:
        pos = -(-pos // 16) * 16
        off[name], pos = pos, pos + 8 * groups
    for name in GROUPED_INT_ARRAYS:
        off[name], pos = pos, pos + 4 * groups
    pos = -(-pos // 16) * 16
    off["alpha"], off["beta"] = pos, pos + 4
    return types.MappingProxyType(off), pos + 16


def grouped_descriptors(config, groups: int, base: int, vp: VecPlan, workspace_bytes: int):
    """The descriptors of one grouped call whose workspace starts at device address ``base``:
    ``(desc, a_layout, b_layout, c_layout, d_layout, preference)``. ``config`` must be the plan's
    config with ``grouped=True``; the scale pointers point at the workspace's pointer arrays; the
    preference carries the average D rows, D columns and reduction (the heuristic's only view of
    the device-side shapes). Needs no GPU."""
    off, _ = grouped_workspace_layout(groups)
    desc = _D.MatmulDesc()
    for name, value in config.attributes().items():
        desc.set(name, value)
    if config.scaled:
        desc.set("A_SCALE_POINTER", base + off["a_scale"])
        desc.set("B_SCALE_POINTER", base + off["b_scale"])
    k0 = vp.keys[0]
    lay = {x: _D.GroupedMatrixLayout(int(k0[t]), groups, base + off[f"{x}_rows"],
                                     base + off[f"{x}_cols"], base + off[f"{x}_ld"])
           for x, t in (("a", 0), ("b", 4), ("d", 8))}
    c = _D.GroupedMatrixLayout(int(k0[8]), groups, base + off["d_rows"], base + off["d_cols"],
                               base + off["d_ld"])
    pref = _D.MatmulPreference()
    pref.set("MAX_WORKSPACE_BYTES", workspace_bytes)
    avg = np.maximum(vp.mnk.sum(axis=0) // max(groups, 1), 1)
    pref.set("GROUPED_DESC_D_AVERAGE_ROWS", int(avg[0]))
    pref.set("GROUPED_DESC_D_AVERAGE_COLS", int(avg[1]))
    pref.set("GROUPED_AVERAGE_REDUCTION_DIM", int(avg[2]))
    return desc, lay["a"], lay["b"], c, lay["d"], pref


# ---------------------------------------------------------------------------------------------
# The grouped launch: the setup kernel fills the workspace arrays, one cublasLtMatmul reads them.

def _affine(ptrs: np.ndarray, prefix: np.ndarray) -> tuple[int, int] | None:
    """``(group_stride, token_stride)`` with ``ptrs[e] == ptrs[0] + gs * e + ts * prefix[e]`` for
    every expert (one of the two is 0), or None."""
    E_ = ptrs.shape[0]
    e = np.arange(E_, dtype=np.int64)
    if E_ == 1:
        return 0, 0
    gs = int(ptrs[1] - ptrs[0])
    if np.array_equal(ptrs, ptrs[0] + gs * e):
        return gs, 0
    nz = np.nonzero(prefix)[0]
    if nz.size:
        i = int(nz[0])
        ts = int(ptrs[i] - ptrs[0]) // int(prefix[i])
        if np.array_equal(ptrs, ptrs[0] + ts * prefix):
            return 0, ts
    return None


def _dim(values: np.ndarray, tokens: np.ndarray, const: int | None = None) -> int | None:
    """A per-expert rows / cols / ld as the setup kernel takes it: one constant, the tokens
    (:data:`_setup.TOKENS`), or None. ``const``: the one value, when the maker knew it."""
    if const is not None:
        return const
    if values is tokens:            # (the builders' count array itself)
        return _setup.TOKENS
    if np.all(values == values[0]):
        return int(values[0])
    if np.array_equal(values, tokens):
        return _setup.TOKENS
    return None


def grouped_tokens(problem: Problem) -> np.ndarray:
    """The setup kernel's per-expert tokens (int64): the rows of fprop's and dgrad's left operand
    (and output), the padded reduction of wgrad. The spec is fitted to them and the launch passes
    them, so both come from here."""
    if problem.pass_name == "wgrad":
        return np.asarray(problem.reduction, dtype=np.int64)
    return np.asarray(as_blocks(problem.left).rows, dtype=np.int64)


def grouped_setup_spec(problem: Problem, vp: VecPlan, out) -> "_setup.SetupSpec | None":
    """The setup kernel's description of ``problem`` writing ``out`` (host counts: the tokens are
    the per-expert token dimension of the plan -- rows of fprop/dgrad, the padded reduction of
    wgrad), or None when an operand's experts are not evenly placed (lists of separate weight or
    ``main_grad`` arrays) or a shape is neither constant nor the token count. Experts with nothing
    to compute are dropped (their outputs are zeroed by the caller, as for the loop)."""
    L, R, O = as_blocks(problem.left), as_blocks(problem.right), as_blocks(out)
    E_ = len(L)
    if not 1 <= E_ <= _setup.MAX_GROUPS:
        return None
    red = problem.reduction
    r = (np.asarray(red, dtype=np.int64), red[0] if len(set(red)) == 1 else None)
    tokens = grouped_tokens(problem)
    prefix = None
    rt, lt = problem.right_t, problem.left_t
    p, q = (O.rows, O.consts[0]), (O.cols, O.consts[1])     # (values, the one value or None)
    dims = {"a": ((r, q) if rt else (q, r), R), "b": ((p, r) if lt else (r, p), L),
            "d": ((q, p), O)}
    mats = {}
    for name, ((rows, cols), blk) in dims.items():
        aff = blk.affine
        if aff is None:
            if prefix is None:
                prefix = np.concatenate([[0], np.cumsum(tokens)[:-1]]).astype(np.int64)
            aff = _affine(blk.ptr, prefix)
        d = [_dim(v, tokens, c) for v, c in (rows, cols, (blk.ld, blk.consts[2]))]
        if aff is None or None in d:
            return None
        gs, ts = aff
        mats[name] = _setup.MatrixSpec(int(blk.ptr[0]), gs, ts, *d)  # strides in bytes
    if vp.skipped:
        keep = np.ones(E_, bool)
        keep[list(vp.skipped)] = False
        slots = tuple(np.where(keep, np.cumsum(keep) - 1, -1).tolist())
    else:
        slots = tuple(range(E_))
    scales = tuple(_scale_spec(sc, tokens, problem.block_scaled)
                   for sc in (problem.right_scale, problem.left_scale))
    if None in scales:
        return None
    return _setup.SetupSpec(mats["a"], mats["b"], mats["d"], E_, 1, scales, 1.0, vp.beta, slots)


# q(t) of the block-scale layouts (grouped_block_fp8): (div, mult) for roundup(t, 4) (1 x 128
# rows), ceil(t / 128) (128-row blocks, MXFP8 tile rows), roundup(ceil(t / 32), 4) (MXFP8
# columns) and roundup(ceil(t / 128), 4) (128 x 128 columns).
_SCALE_ROWS = ((1, 4), (128, 1), (32, 4), (128, 4))


def _scale_spec(ptrs, tokens: np.ndarray, block: bool) -> "_setup.ScaleSpec | None":
    """The setup kernel's description of one operand's per-expert scale pointers (those the loop
    passes), or None when no rule reproduces every one of them: per-tensor, one float32 per
    expert; block scales, a constant size per expert (weights) or one that grows with
    q(tokens) (activations and gradients)."""
    if ptrs is None:
        return _setup.ScaleSpec()
    p = np.asarray(ptrs, dtype=np.int64)
    if not block:
        ok = p.shape[0] < 2 or bool((p[1:] - p[:-1] == 4).all())
        return _setup.ScaleSpec.per_expert_float(int(p[0])) if ok else None
    for div, mult in _SCALE_ROWS:
        q = _setup.ScaleSpec(int(p[0]), 0, 0, div, mult).q(tokens)
        aff = _affine(p, np.concatenate([[0], np.cumsum(q)[:-1]]).astype(np.int64))
        if aff is not None:
            gs, ts = aff
            return _setup.ScaleSpec(int(p[0]), gs, ts, div, mult) if ts else \
                _setup.ScaleSpec(int(p[0]), gs, 0)
    return None


def _path_key(st: "_DeviceState", requested: str | None) -> tuple:
    return ("_path", st.device, st.compute_capability, st.cublas_version, requested)


def forget_path(vp: VecPlan, st: "_DeviceState", requested: str | None, reason: str) -> None:
    """Make the loop this plan's path from now on (cuBLAS refused its grouped call)."""
    vp.__dict__[_path_key(st, requested)] = ("loop", reason, None)


def path_for(problem: Problem, vp: VecPlan, out, st: "_DeviceState", requested: str | None = None):
    """``(path, reason, setup spec or None)``, decided once per plan, device and request."""
    key = _path_key(st, requested)
    hit = vp.__dict__.get(key)
    if hit is not None:
        return hit
    # whether wgrad writes per-expert buffers: choose_path reads it for the cuBLAS versions that
    # corrupt them only, so it is worked out (a few array operations) for those alone
    discrete = (problem.pass_name == "wgrad"
                and GROUPED_BAD_VERSIONS[0] <= st.cublas_version < GROUPED_BAD_VERSIONS[1]
                and _affine(as_blocks(out).ptr, np.zeros(len(out), np.int64)) is None)
    path, reason = choose_path(problem, vp, version=st.cublas_version,
                               compute_capability=st.compute_capability,
                               has_symbol=st.has_grouped_symbol, discrete_out=discrete,
                               requested=requested)
    spec = None
    if path == "grouped":
        spec = grouped_setup_spec(problem, vp, out)
        if spec is None:
            reason = "operands or outputs are not evenly placed per expert"
            if requested == "grouped":
                raise RuntimeError(f"path='grouped' cannot run: {reason}")
            path = "loop"
    hit = vp.__dict__[key] = (path, reason, spec)
    return hit


GROUPED_CALLS_CACHED = 256     # descriptor sets kept per device (oldest dropped)


class GroupedRefused(Exception):
    """cuBLAS turned a grouped call down (no algorithm, or ``NOT_SUPPORTED``): the loop runs
    it instead, unless the caller asked for ``path="grouped"``."""


OWN_WORKSPACES_MAX = 64    # plans given a workspace of their own, per device (never freed)


class _GroupedState:
    """Per device: one setup workspace per caller stream (sized for the most groups), the
    grouped descriptors per (config, groups, workspace, average dims), at most
    :data:`GROUPED_CALLS_CACHED` of them, the algorithm per (config, groups, average dims), and
    the calls cuBLAS refused (``refused``: that key -> reason; those run as the loop without
    asking again).

    A plan launched a second time gets a workspace and descriptors of its own (at most
    :data:`OWN_WORKSPACES_MAX`), filled by the setup kernel once per stream: from then on its
    call is one ``cublasLtMatmul`` (the same counts and buffers every step, as with fixed
    capacities or in a benchmark's loop). They are kept for the life of the process, never
    handed back: a CUDA graph captured with such a call reads them on every replay."""

    def __init__(self, alloc=None, setup_backend: str = "cuda"):
        self.workspaces: dict[int, Any] = {}
        self.calls: dict[tuple, tuple] = {}
        self.algos: dict[tuple, Any] = {}
        self.refused: dict[tuple, str] = {}
        self.owned: list = []         # the plans' own workspaces (kept: see above)
        self.alloc = alloc            # nbytes -> 16-byte aligned uint8 array (default: CuPy)
        self.setup_backend = setup_backend  # "emulate" / "reference" run the CPU tests

    def _new(self, nbytes: int, stream_ptr: int, what: str):
        if self.alloc is not None:
            return self.alloc(nbytes)
        import cupy

        _launch.refuse_capture(stream_ptr, what)
        return cupy.empty(nbytes, dtype=np.uint8)

    def workspace(self, stream_ptr: int):
        ws = self.workspaces.get(stream_ptr)
        if ws is None:
            _, nbytes = grouped_workspace_layout(_setup.MAX_GROUPS)
            ws = self.workspaces[stream_ptr] = self._new(nbytes, stream_ptr,
                                                          "grouped GEMM pointer arrays")
        return ws

    def refuse(self, key: tuple, why: str) -> None:
        if len(self.refused) >= GROUPED_CALLS_CACHED:
            del self.refused[next(iter(self.refused))]
        self.refused[key] = why

    def algorithm(self, st: "_DeviceState", key: tuple, descs):
        """The heuristic's algorithm for the shape ``key`` (config, groups, average dims),
        asked once; :class:`GroupedRefused` where cuBLAS has none."""
        res = self.algos.get(key)
        if res is None:
            why = self.refused.get(key)
            if why is not None:
                raise GroupedRefused(why)
            desc, la, lb, lc, ld, pref = descs
            try:
                res = st.heuristic(desc, la, lb, ld, pref,
                                   f"grouped {key[0]} x{key[1]} avg {key[2]}")
            except CublasLtError as exc:   # no algorithm is NOT_SUPPORTED; anything else
                if exc.status != E.CUBLAS_STATUS_NOT_SUPPORTED:   # is a mistake: raised
                    raise
                self.refuse(key, str(exc))
                raise GroupedRefused(str(exc)) from None
            if len(self.algos) >= GROUPED_CALLS_CACHED:
                del self.algos[next(iter(self.algos))]
            self.algos[key] = res
        return res


def _capturing(stream_ptr: int) -> bool:
    import cupy

    return bool(stream_ptr) and bool(cupy.cuda.runtime.streamIsCapturing(stream_ptr))


@functools.lru_cache(maxsize=256)
def _grouped_config(config):
    """The plan's config for the grouped call (``grouped=True``), made once per config."""
    return dataclasses.replace(config, grouped=True)


def _own(st: "_DeviceState", g: _GroupedState, vp: VecPlan, config, groups: int, caller):
    """The plan's own workspace and descriptors ``[ws, base, descs, filled streams]`` from its
    second launch on (None before, during a graph capture, or past the cap)."""
    key = ("_grouped_own", st.device)
    own = vp.__dict__.get(key)
    if own is not None:
        return own
    seen = ("_grouped_seen", st.device)
    if not vp.__dict__.get(seen):
        vp.__dict__[seen] = True
        return None
    if len(g.owned) >= OWN_WORKSPACES_MAX or (g.alloc is None and _capturing(caller.ptr)):
        return None
    ws = g._new(grouped_workspace_layout(groups)[1], caller.ptr, "a plan's grouped GEMM arrays")
    g.owned.append(ws)
    base = data_ptr(ws)
    own = vp.__dict__[key] = [ws, base, grouped_descriptors(config, groups, base, vp,
                                                            st.workspace_bytes), set()]
    return own


def _launch_grouped(st: "_DeviceState", vp: VecPlan, problem: Problem, spec) -> None:
    """Setup kernel (workspace arrays from the counts) and one grouped ``cublasLtMatmul``, both on
    the caller's stream, device pointer mode (alpha, beta and the per-group scales read from the
    workspace). A plan launched again has its arrays in a workspace of its own already
    (:class:`_GroupedState`): the matmul alone."""
    if st.grouped is None:
        st.grouped = _GroupedState()
    g = st.grouped
    caller = st.current_stream()
    groups = spec.groups
    config = _grouped_config(vp.config)
    avg = tuple((vp.mnk.sum(axis=0) // max(groups, 1)).tolist())
    shape = (config, groups, avg)
    why = g.refused.get(shape)
    if why is not None:
        raise GroupedRefused(why)
    own = _own(st, g, vp, config, groups, caller)
    if own is not None:
        ws, base, descs, filled = own
        fill = caller.ptr not in filled
    else:
        ws = g.workspace(caller.ptr)
        base = data_ptr(ws)
        key = (config, groups, base, avg)
        descs = g.calls.get(key)
        if descs is None:
            descs = grouped_descriptors(config, groups, base, vp, st.workspace_bytes)
            if len(g.calls) >= GROUPED_CALLS_CACHED:
                del g.calls[next(iter(g.calls))]
            g.calls[key] = descs
        fill = True
    res = g.algorithm(st, shape, descs)
    if fill:
        _setup.grouped_gemm_setup(spec, ws[:grouped_workspace_layout(groups)[1]],
                                  m_host=grouped_tokens(problem).tolist(),
                                  backend=g.setup_backend)
        if own is not None:
            own[3].add(caller.ptr)
    desc, la, lb, lc, ld, _ = descs
    off, _ = grouped_workspace_layout(groups)
    for log in _launch._recorders.get():
        log.append(_launch.Launch("cuda", "cublasLtMatmul[grouped]", 1, 1))
    status = st.matmul(st.handle, desc.handle, base + off["alpha"], base + off["a"], la.handle,
                       base + off["b"], lb.handle, base + off["beta"], base + off["c"], lc.handle,
                       base + off["d"], ld.handle, ctypes.byref(res.algo),
                       st.caller_workspace(caller.ptr), st.workspace_bytes, caller.ptr)
    if status == E.CUBLAS_STATUS_NOT_SUPPORTED:     # (before anything ran: the loop can)
        why = f"cublasLtMatmul: CUBLAS_STATUS_NOT_SUPPORTED for {groups} groups"
        g.refuse(shape, why)
        g.algos.pop(shape, None)
        raise GroupedRefused(why)
    if status:
        from ..cublaslt import check

        check(status, "cublasLtMatmul", f"grouped call of {groups} groups")
