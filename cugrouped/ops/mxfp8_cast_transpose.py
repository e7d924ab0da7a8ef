"""``multi_mxfp8_cast_transpose``: pad + MXFP8 cast + transpose of all experts in one launch.

TransformerEngine's ``MXFP8BlockScaling`` (the OCP microscaling format that sm_100 tensor cores
read): every 32 consecutive elements of a row get an E8M0 scale byte of their own, from their
amax, in the pass that casts them. The kernel is ``kernels_cu/block_cast_transpose.cu`` with
``DIMS == BCT_MX`` (the tile loop, the gather, the column sums and the launch planning are the
block-scaled cast's: :mod:`.block_cast_transpose`); the scales are written straight into the tiled
layout cuBLASLt's ``VEC32_UE8M0`` mode reads, so no swizzle pass runs before the GEMMs.
"""

from __future__ import annotations

from .._array import array_kind
from ..grouped_block_fp8 import MX_DIMS, GroupedMXFP8
from .block_cast_transpose import block_cast_arrays

__all__ = ["multi_mxfp8_cast_transpose"]


def multi_mxfp8_cast_transpose(inputs, m_splits=None, *, fp8_format: str = "e4m3", align: int = 32,
                               rowwise: bool = True, columnwise: bool = True, out=None,
                               dtype: str | None = None, splits_on_device: bool | None = None,
                               backend: str | None = None, row_index=None,
                               column_sums: bool = False,
                               activation: str | None = None) -> GroupedMXFP8:
    """Pad, cast to MXFP8 and transpose every expert's rows in one pass; return a
    :class:`~cugrouped.GroupedMXFP8`.

    ``data`` (``(sum m_i, k)``) has a scale per 32 columns of a row; ``data_t`` (expert ``i`` a
    ``(k, roundup(m_i, align))`` block, columns ``m_i:`` zero) a scale per 32 tokens of a
    feature, as the wgrad GEMM contracts over tokens. Scale byte ``e`` of a block with amax ``a``
    is the power of two ``2^(e - 127) >= a / fp8_max`` rounded up (TransformerEngine's
    ``float_to_e8m0(amax * max_norm_rcp)``); its elements are multiplied by ``2^(127 - e)`` and
    converted with round-to-nearest-even and saturation. There are no scaling options: MXFP8 has
    no epsilon, no margin and only powers of two.

    ``align``: each expert's tokens padded to a divisor of 128; the GEMMs need 32 (a whole
    scale block), as TransformerEngine's MoE padding for MXFP8 does. The other arguments are
    :func:`cugrouped.multi_block_cast_transpose`'s (``row_index``: the fused MoE permute;
    ``column_sums``: dbias in the same pass; ``activation``: ``"swiglu"`` of the input's halves
    ``[a | b]``, as there). One launch per 64 experts, no host sync.
    """
    first = inputs[0] if isinstance(inputs, (list, tuple)) and inputs else inputs
    if array_kind(first) == "torch":
        from ..pytorch.functional import multi_mxfp8_cast_transpose as torch_op

        return torch_op(inputs, m_splits, fp8_format=fp8_format, align=align, rowwise=rowwise,
                        columnwise=columnwise, out=out, dtype=dtype,
                        splits_on_device=splits_on_device, backend=backend, row_index=row_index,
                        column_sums=column_sums, activation=activation)
    return block_cast_arrays(inputs, m_splits, fp8_format=fp8_format, block_scaling_dim=MX_DIMS,
                             align=align, rowwise=rowwise, columnwise=columnwise, out=out,
                             dtype=dtype, splits_on_device=splits_on_device, backend=backend,
                             row_index=row_index, column_sums=column_sums,
                             activation=activation)
