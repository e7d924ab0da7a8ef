"""Setup kernel of cuBLASLt's grouped GEMM: host side of ``kernels_cu/grouped_gemm_setup.cu``.

The grouped matmul reads per-group pointers, shapes and scale pointers from device arrays (laid out
by :func:`cugrouped.ops.grouped_gemm.grouped_workspace_layout`). This module describes them as
affine functions of the experts' token counts (:class:`SetupSpec`, pure, tested on the CPU), packs
the kernel's by-value argument block, and launches it on the CUDA device, on the CPU emulator, or
runs the NumPy twin (:func:`cugrouped.reference.grouped_gemm_setup.grouped_gemm_setup`). The counts
may be host ints (packed into the argument block) or a device int64 array read by the kernel (no
host sync).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from .. import _jit
from .._array import data_ptr
from . import _launch

__all__ = ["KERNEL_SPEC", "KERNEL_NAME", "MAX_GROUPS", "THREADS", "ARRAY_NAMES", "MatrixSpec",
           "ScaleSpec", "SetupSpec", "args_dtype", "pack_args", "grouped_gemm_setup"]

MAX_GROUPS = 256           # must match CG_GGS_MAX_GROUPS in kernels_cu/grouped_gemm_setup.cu
THREADS = MAX_GROUPS
KERNEL_NAME = "cg::grouped_gemm_setup_kernel"
# The order of enum GgsArray in the kernel: names of grouped_workspace_layout's offsets.
ARRAY_NAMES = ("a", "b", "c", "d", "a_scale", "b_scale", "a_rows", "a_cols", "a_ld", "b_rows",
               "b_cols", "b_ld", "d_rows", "d_cols", "d_ld", "alpha", "beta")

KERNEL_SPEC = _jit.register("grouped_gemm_setup", _jit.KernelSpec(
    source="grouped_gemm_setup.cu", name_expressions=(KERNEL_NAME,)))

TOKENS = -1                # a rows/cols/ld value that means "this expert's tokens"


@dataclasses.dataclass(frozen=True)
class MatrixSpec:
    """One operand of the grouped call: expert ``e``'s pointer is ``base + group_stride * e +
    token_stride * P_e`` (bytes; ``P_e`` the exclusive prefix of the tokens); ``rows``, ``cols``,
    ``ld`` are constants or :data:`TOKENS`."""

    base: int
    group_stride: int
    token_stride: int
    rows: int
    cols: int
    ld: int


@dataclasses.dataclass(frozen=True)
class ScaleSpec:
    """The scale pointers of one operand: expert ``e``'s is ``base + group_stride * e +
    token_stride * Q_e`` (bytes), ``Q_e`` the exclusive prefix of ``q(t) = roundup(ceil(t / div),
    mult)`` over the tokens: the rows of the expert's scale layout that grow with its tokens.
    ``base`` 0: no scales (null pointers)."""

    base: int = 0
    group_stride: int = 0
    token_stride: int = 0
    div: int = 1
    mult: int = 1

    def __post_init__(self):
        if self.div < 1 or self.mult < 1:
            raise ValueError(f"div, mult: expected >= 1, got {self.div}, {self.mult}")

    @classmethod
    def per_expert_float(cls, base: int) -> "ScaleSpec":
        """One float32 ``scale_inv`` per expert, back to back (per-tensor scaling)."""
        return cls(base, 4 if base else 0, 0)

    def q(self, tokens):
        """``roundup(ceil(tokens / div), mult)`` (ints or int64 arrays)."""
        return ((tokens + self.div - 1) // self.div + self.mult - 1) // self.mult * self.mult


@dataclasses.dataclass(frozen=True)
class SetupSpec:
    """Everything the setup kernel computes from, besides the counts.

    ``token_align``: an expert's tokens are its count rounded up to it (1: rows; 16: the padded
    transposed copies wgrad reduces over). ``scales``: the A and B scale pointers, each a
    :class:`ScaleSpec` or an int: the base of one float32 ``scale_inv`` per expert, 0 for none
    (stored as ``ScaleSpec.per_expert_float``). ``slots``: per expert, its group index or -1 to
    drop it (None: expert ``e`` is group ``e``); ``groups`` the number of groups written.
    """

    a: MatrixSpec
    b: MatrixSpec
    d: MatrixSpec
    num_experts: int
    token_align: int = 1
    scales: tuple = (0, 0)
    alpha: float = 1.0
    beta: float = 0.0
    slots: tuple[int, ...] | None = None

    def __post_init__(self):
        if len(self.scales) != 2:
            raise ValueError(f"scales: expected (A, B), got {self.scales!r}")
        object.__setattr__(self, "scales", tuple(
            s if isinstance(s, ScaleSpec) else ScaleSpec.per_expert_float(int(s))
            for s in self.scales))
        if not 1 <= self.num_experts <= MAX_GROUPS:
            raise ValueError(f"num_experts: expected 1..{MAX_GROUPS}, got {self.num_experts}")
        if self.token_align < 1:
            raise ValueError(f"token_align: expected >= 1, got {self.token_align}")
        if self.slots is not None:
            if len(self.slots) != self.num_experts:
                raise ValueError(f"slots: expected {self.num_experts} entries, got {len(self.slots)}")
            used = sorted(filter((0).__le__, self.slots))
            if used != list(range(len(used))):
                raise ValueError(f"slots: the kept experts must fill groups 0..G-1 once each, got "
                                 f"{self.slots}")

    @property
    def groups(self) -> int:
        if self.slots is None:
            return self.num_experts
        return sum(map((0).__le__, self.slots))


@functools.lru_cache(maxsize=None)
def args_dtype() -> np.dtype:
    """NumPy twin of ``struct cg::GgsArgs`` (passed to the kernel by value)."""
    mat = np.dtype([("base", "<u8"), ("group_stride", "<i8"), ("token_stride", "<i8"),
                    ("rows", "<i4"), ("cols", "<i4"), ("ld", "<i4"), ("pad_", "<i4")], align=True)
    scale = np.dtype([("base", "<u8"), ("group_stride", "<i8"), ("token_stride", "<i8"),
                      ("div", "<i4"), ("mult", "<i4")], align=True)
    return np.dtype([("mat", mat, 3), ("scale", scale, 2), ("m_dev", "<u8"),
                     ("total_rows", "<i8"), ("workspace", "<u8"),
                     ("offset", "<i4", len(ARRAY_NAMES)), ("num_experts", "<i4"),
                     ("token_align", "<i4"), ("alpha", "<f4"), ("beta", "<f4"),
                     ("m_host", "<i4", MAX_GROUPS), ("slot", "<i2", MAX_GROUPS)], align=True)


_templates: dict = {}     # pack_args' argument blocks without counts and slots, per call shape


def pack_args(spec: SetupSpec, workspace_ptr: int, offsets: dict[str, int], *,
              m_host=None, m_dev_ptr: int = 0, total_rows: int = 0) -> np.ndarray:
    """The kernel's argument block: counts by value (``m_host``) or a device array address
    (``m_dev_ptr``, clamped by the kernel to ``total_rows``)."""
    if (m_host is None) == (not m_dev_ptr):
        raise ValueError("give exactly one of m_host (host counts) and m_dev_ptr (device counts)")
    E = spec.num_experts
    offs = tuple(offsets[n] for n in ARRAY_NAMES)
    key = (spec.a, spec.b, spec.d, spec.scales, E, spec.token_align, spec.alpha, spec.beta,
           workspace_ptr, offs)
    template = _templates.get(key)
    if template is None:      # all but the counts and slots: the same call after call
        template = np.zeros((), dtype=args_dtype())
        for i, m in enumerate((spec.a, spec.b, spec.d)):
            template["mat"][i] = (m.base, m.group_stride, m.token_stride, m.rows, m.cols, m.ld, 0)
        for i, sc in enumerate(spec.scales):
            template["scale"][i] = (sc.base, sc.group_stride, sc.token_stride, sc.div, sc.mult)
        template["workspace"] = workspace_ptr
        template["offset"] = offs
        template["num_experts"] = E
        template["token_align"] = spec.token_align
        template["alpha"], template["beta"] = spec.alpha, spec.beta
        template["slot"][:E] = np.arange(E)
        template["slot"][E:] = -1
        if len(_templates) >= 64:
            del _templates[next(iter(_templates))]
        template = _templates[key] = template.tobytes()
    # (a structured array's copy() goes field by field: ~7 us; bytes into a fresh buffer: ~0.5)
    arg = np.frombuffer(bytearray(template), dtype=args_dtype()).reshape(())
    if m_host is not None:
        m = np.asarray(m_host, dtype=np.int64)
        if m.shape != (E,) or (m < 0).any() or int(m.sum()) >= 2**31:
            raise ValueError(f"m_host: expected {E} non-negative counts summing below 2^31, got {m_host}")
        arg["m_host"][:E] = m
    else:
        if not 0 <= total_rows < 2**31:
            raise ValueError(f"total_rows: expected 0 <= total_rows < 2^31, got {total_rows}")
        arg["m_dev"], arg["total_rows"] = m_dev_ptr, total_rows
    if spec.slots is not None:
        arg["slot"][:E] = spec.slots
    return arg


def grouped_gemm_setup(spec: SetupSpec, workspace, *, m_host=None, m_dev=None, total_rows: int = 0,
                       backend: str = "cuda") -> None:
    """Fill ``workspace`` (a uint8 array of at least ``grouped_workspace_layout(spec.groups)[1]``
    bytes, 16-byte aligned) for the grouped call described by ``spec``; one launch, no sync.

    Counts: ``m_host`` (host ints) or ``m_dev`` (a contiguous int64 array where the workspace
    lives, clamped to ``total_rows``). ``backend``: ``"cuda"``, ``"emulate"`` or ``"reference"``.
    """
    from .grouped_gemm import grouped_workspace_layout

    offsets, nbytes = grouped_workspace_layout(spec.groups)
    if workspace.dtype != np.uint8 or workspace.ndim != 1 or workspace.size < nbytes:
        raise ValueError(f"workspace: expected a 1-D uint8 array of at least {nbytes} bytes, got "
                         f"{workspace.dtype} {workspace.shape}")
    ws_ptr = data_ptr(workspace)
    if ws_ptr % 16:
        raise ValueError(f"workspace: address {ws_ptr:#x} is not 16-byte aligned")
    m_dev_ptr = 0
    if m_dev is not None:
        if m_dev.dtype != np.int64 or m_dev.shape != (spec.num_experts,):
            raise ValueError(f"m_dev: expected a contiguous int64 array of shape "
                             f"({spec.num_experts},), got {m_dev.dtype} {m_dev.shape}")
        m_dev_ptr = data_ptr(m_dev)
    if backend == "reference":
        from ..reference.grouped_gemm_setup import grouped_gemm_setup as ref

        return ref(spec, workspace, m_host=m_host, m_dev=m_dev, total_rows=total_rows)
    arg = pack_args(spec, ws_ptr, offsets, m_host=m_host, m_dev_ptr=m_dev_ptr, total_rows=total_rows)
    _launch.note_launch(backend, KERNEL_NAME, 1, THREADS)
    if backend == "cuda":
        _jit.get_function(KERNEL_SPEC, KERNEL_NAME)((1,), (THREADS,), (_launch.by_value(arg),))
    elif backend == "emulate":
        _jit.get_emulated_function(KERNEL_SPEC, KERNEL_NAME)(
            (1,), (THREADS,), (arg,), order=_launch.current_emulation_order())
    else:
        raise ValueError(f"backend: got {backend!r}, expected 'cuda', 'emulate' or 'reference'")
    return None
