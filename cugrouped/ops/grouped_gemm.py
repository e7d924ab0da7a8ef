"""Grouped expert GEMMs through cuBLASLt: fprop, dgrad and wgrad for all experts (design.md §4, §5).

For experts ``i = 0..E-1``, in row-major terms:

* fprop  ``y_i = x_i · W_iᵀ (+ b_i)``  into the unpadded ``(Σ m_i, n)`` output;
* dgrad  ``dx_i = dy_i · W_i``         into ``(Σ m_i, k)``;
* wgrad  ``dW_i = dy_iᵀ · x_i``        into ``(E, n, k)`` or per-expert ``main_grad`` buffers
  (``accumulate=True``: ``C = D``, ``beta = 1``).

Operands are either :class:`~cugrouped.GroupedFP8` results of ``multi_pad_cast_transpose``
(FP8 path: every call is "TN", the operands are the row-wise or transposed copies of the layout
table, and each expert's ``scale_inv`` is passed as cuBLASLt's A/B scale pointer, on the device),
:class:`~cugrouped.GroupedBlockFP8` results of ``multi_block_cast_transpose`` (the same copies;
the scale pointer is the expert's first block scale and cuBLASLt's A/B scale modes are
``VEC128_32F`` / ``BLK128x128_32F``; Hopper (sm_90) only, cuBLAS 12.9+, split accumulation,
token counts in multiples of 8; MXFP8's ``GroupedMXFP8``: ``VEC32_UE8M0``, sm_100+), or lists of plain bfloat16 / float16 / float32 arrays (the
same layer without FP8).

Arrays may be NumPy (reference backend), CuPy or CUDA torch tensors (cuBLASLt): every operand,
bias and output is read through its pointer, shape, strides and dtype (:func:`cugrouped._array.as_view`,
which never imports torch), so the torch layer hands its tensors over as they are. One call's
arrays must all be of one kind on one device. Without ``out`` the result is of the operands' kind:
NumPy or CuPy outputs are allocated here; torch operands go through the torch front
(:func:`cugrouped.pytorch.functional.grouped_gemm`), which allocates a torch tensor with torch's
allocator (this module never imports torch; the custom ops in :mod:`cugrouped.pytorch` pass
``out`` themselves).

The implementation lives in package-private modules, one concern each, imported in one direction:
:mod:`._gemm_plan` (blocks, problems and call plans: pure functions of numbers, tested on the CPU)
<- :mod:`._gemm_checks` (operands and outputs -> blocks) <- :mod:`._gemm_memo` (per-call memo)
<- :mod:`._gemm_grouped` (cuBLASLt's grouped GEMM: decision, workspace, descriptors, launch)
<- :mod:`._gemm_launch` (per-device state and the loop of ``cublasLtMatmul`` over the non-empty
experts, spread over a few side streams forked from and joined back to the caller's stream). This
module holds the three ops and re-exports those modules' names. ``backend="reference"`` runs the
NumPy twin in :mod:`cugrouped.reference.grouped_gemm`; there is no ``"emulate"`` backend (cuBLASLt
has no CPU emulation).
"""

from __future__ import annotations

from . import _launch
from ._gemm_checks import (  # noqa: F401  (re-exported)
    FP8_MULTIPLE, OUT_DTYPES, PLAIN_DTYPES, check_alignment, check_dgrad, check_fprop, check_wgrad,
    new_output, outputs, split_rows,
)
from ._gemm_grouped import (  # noqa: F401  (re-exported)
    GROUPED_BAD_VERSIONS, GROUPED_INT_ARRAYS, GROUPED_MAX_GROUPS, GROUPED_MIN_VERSION_BLACKWELL,
    GROUPED_MIN_VERSION_HOPPER, GROUPED_MIN_VERSION_HOPPER_BLOCK, GROUPED_MIN_VERSION_HOPPER_FP8,
    GROUPED_MIN_VERSION_MXFP8, GROUPED_PTR_ARRAYS, _GroupedState, _launch_grouped, choose_path,
    grouped_block_unsupported, grouped_descriptors, grouped_gemm_unsupported,
    grouped_setup_spec, grouped_workspace_layout, path_for,
)
from ._gemm_launch import (  # noqa: F401  (re-exported)
    HEURISTIC_CACHE_SIZE, MAX_SIDE_STREAMS, MIN_CALLS_PER_THREAD, NUM_STREAMS, _DeviceState,
    _launch_loop, _launch_plan, _state, build_descriptors, host_threads, launch_checked,
    set_host_threads, set_side_streams, side_streams,
)
from ._gemm_memo import (  # noqa: F401  (re-exported)
    MEMO_OUTPUTS, MEMO_SIZE, Checked, _call_key, checked, clear_memo, prepared_out,
)
from ._gemm_plan import (  # noqa: F401  (re-exported)
    BLOCK_SCALING_MIN_VERSION, Block, Blocks, ExpertGemm, GemmPlan, Problem, VecPlan, as_blocks,
    bias_dtype_for, block_scaling_unsupported, gemm_config,
    plan_arrays, plan_expert, plan_problem, pointer_alignment, pointer_alignments,
    SCALE_POINTER_ALIGN, SCALE_SPAN_MAX, ScaleCopy, scale_copies, workspace_bytes_for,
)

__all__ = [
    "grouped_fprop", "grouped_dgrad", "grouped_wgrad",
    "Block", "ExpertGemm", "GemmPlan", "Problem", "pointer_alignment", "plan_expert",
    "plan_problem", "check_fprop", "check_dgrad", "check_wgrad", "outputs", "check_alignment",
    "gemm_config", "bias_dtype_for", "workspace_bytes_for", "build_descriptors",
    "FP8_MULTIPLE", "NUM_STREAMS", "MAX_SIDE_STREAMS", "side_streams", "set_side_streams",
    "host_threads", "set_host_threads",
    "OUT_DTYPES", "Blocks", "as_blocks", "pointer_alignments",
    "VecPlan", "plan_arrays", "grouped_gemm_unsupported", "choose_path", "grouped_workspace_layout",
    "grouped_descriptors", "GROUPED_MAX_GROUPS", "block_scaling_unsupported",
    "grouped_block_unsupported",
    "BLOCK_SCALING_MIN_VERSION",
]


# ---------------------------------------------------------------------------------------------
# The ops.

def _backend(backend: str | None, on_device: bool) -> str:
    if backend == "emulate":
        raise ValueError("backend='emulate' is not available for the grouped GEMMs: they run in "
                         "cuBLASLt, which has no CPU emulation; use backend='reference' (NumPy) "
                         "for host arrays or 'cuda' for device arrays")
    if backend == "cuda" and not on_device:   # not resolve_backend's hint: no 'emulate' here
        raise ValueError("backend='cuda' needs device arrays (CuPy or CUDA torch); got host arrays "
                         "(use backend='reference' to run the NumPy twin on the CPU)")
    return _launch.resolve_backend(backend, on_device)


def grouped_fprop(x, w, bias=None, *, m_splits=None, out=None, out_dtype: str | None = None,
                  fast_accum: bool = True, backend: str | None = None, path: str | None = None):
    """``y_i = x_i · W_iᵀ (+ b_i)`` for every expert, into one unpadded ``(Σ m_i, n)`` array.

    Parameters
    ----------
    x : GroupedFP8 (row-wise copy used, ``k % 16 == 0``) or list of E ``(m_i, k)`` arrays, or
        one ``(sum(m_splits), k)`` array with ``m_splits``.
    w : GroupedFP8 from ``multi_pad_cast_transpose(w_list, align=1)`` (row-wise ``(n, k)`` per
        expert, ``n % 16 == 0``), or list of E ``(n, k)`` arrays / one ``(E, n, k)`` array.
        FP8 pairs: E4M3xE4M3, E4M3xE5M2, E5M2xE4M3. Plain operands share one dtype.
    m_splits : host split sizes of a single plain ``x`` (split into row views, no copy); None
        for a list or a GroupedFP8 (which carry their own).
    bias : None, ``(E, n)`` array or list of E ``(n,)`` vectors, contiguous, of the output dtype
        (bfloat16 for an FP8 GEMM with float32 output); added by cuBLASLt's ``BIAS`` epilogue.
    out : ``(Σ m_i, n)`` array (unit column stride), or None to allocate one of the operands'
        kind (torch operands: a torch tensor from torch's allocator, on their device). CuPy
        bfloat16 is a ``uint16`` array tagged by ``out_dtype``.
    out_dtype : ``"bfloat16"``, ``"float16"`` or ``"float32"``, or the dtype of one (NumPy's
        ``np.float32``, ``ml_dtypes.bfloat16``, ``torch.bfloat16``); None (default): bfloat16 for
        FP8 operands, the operands' dtype for plain ones (float32 for :func:`grouped_wgrad`).
    fast_accum : FP8 fast accumulation (cuBLASLt ``FAST_ACCUM``); ignored without FP8.
    backend : ``"cuda"`` (cuBLASLt, device arrays), ``"reference"`` (NumPy twin, host arrays) or
        None to pick by where the data lives. NumPy, CuPy and torch operands (one kind per call)
        give a result of the same kind; CUDA torch tensors run on ``torch.cuda.current_stream()``
        with the output from torch's allocator, CPU torch tensors run the twin on zero-copy views.

    path : None (the grouped GEMM where cuBLASLt and the operands allow it, else the per-expert
        loop; see :func:`choose_path`), ``"loop"``, or ``"grouped"`` (raise if it cannot run).
        Launch records name the path that ran (``cublasLtMatmul`` / ``cublasLtMatmul[grouped]``).

    Experts with ``m_i == 0`` are skipped. Returns ``out``.
    """
    kw = dict(out_dtype=out_dtype, fast_accum=fast_accum)
    return _run(checked("fprop", (split_rows(x, m_splits, "x"), w, bias), kw), out, backend, path)


def grouped_dgrad(dy, w, *, m_splits=None, out=None, out_dtype: str | None = None,
                  fast_accum: bool = False, backend: str | None = None, path: str | None = None):
    """``dx_i = dy_i · W_i`` for every expert, into one unpadded ``(Σ m_i, k)`` array.

    ``dy``: GroupedFP8 (row-wise ``(m_i, n)``, ``n % 16 == 0``) or list of ``(m_i, n)`` arrays
    (or one ``(sum(m_splits), n)`` array with ``m_splits``);
    ``w``: GroupedFP8 with the transposed copy (``(k, n)`` per expert, ``k % 16 == 0``) or list of
    ``(n, k)`` arrays / one ``(E, n, k)`` array. Other arguments as :func:`grouped_fprop`.
    """
    kw = dict(out_dtype=out_dtype, fast_accum=fast_accum)
    return _run(checked("dgrad", (split_rows(dy, m_splits, "dy"), w), kw), out, backend, path)


def grouped_wgrad(x, dy, *, m_splits=None, out=None, accumulate: bool = False,
                  out_dtype: str | None = None, fast_accum: bool = False,
                  backend: str | None = None, path: str | None = None):
    """``dW_i = dy_iᵀ · x_i`` for every expert.

    ``x``, ``dy``: GroupedFP8 with transposed copies (``(k, m_pad_i)``, ``(n, m_pad_i)``, cast with
    the same ``align``, a multiple of 16; the zero padding adds nothing), or lists of ``(m_i, k)``
    and ``(m_i, n)`` arrays (or single ``(sum(m_splits), ·)`` arrays with ``m_splits``).
    ``out``: ``(E, n, k)`` array or list of E ``(n, k)`` arrays;
    ``accumulate=True`` adds into it (``beta = 1``; fp32 ``main_grad``) and requires it. An expert
    with ``m_i == 0`` gets a zero gradient, or keeps its accumulated one untouched.
    """
    kw = dict(out_dtype=out_dtype, fast_accum=fast_accum, accumulate=accumulate)
    args = (split_rows(x, m_splits, "x"), split_rows(dy, m_splits, "dy"))
    return _run(checked("wgrad", args, kw), out, backend, path)


def _run(call: "Checked", out, backend, path=None):
    if path not in (None, "loop", "grouped"):
        raise ValueError(f"path: got {path!r}, expected None, 'loop' or 'grouped'")
    if call.problem.place[2] == "torch":   # torch in, torch out: outputs and stream from torch
        from ..pytorch.functional import grouped_gemm as torch_front

        return torch_front(call, out, backend, path, _run_arrays)
    return _run_arrays(call, out, backend, path)


def _run_arrays(call: "Checked", out, backend, path=None):
    problem = call.problem
    on_device, device, kind = problem.place
    backend = _backend(backend, on_device)
    if backend == "reference":
        if kind == "torch":
            raise TypeError("torch CPU tensors: the reference backend computes on NumPy arrays; "
                            "pass NumPy arrays (zero-copy: Tensor.numpy()) or use the torch layer "
                            "(cugrouped.pytorch), which converts them")
        from ..reference import grouped_gemm as ref

        return getattr(ref, f"grouped_{problem.pass_name}")(*call.args, out=out,
                                                            backend="reference", **call.kwargs)
    # CUDA: CuPy arrays and CUDA torch tensors alike are read through their pointers (a torch
    # caller passes out=: the ops allocate CuPy outputs only, see new_output).
    import cupy

    with _launch.device_scope("cuda", device):
        return launch_checked(call, out, cupy, _state(device), path)

