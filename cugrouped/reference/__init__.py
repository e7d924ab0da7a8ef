"""NumPy references: the exact output bits every cugrouped kernel must reproduce (design.md §2, §6)."""

from .fp8 import (FLT_MAX, FP8_FORMAT_ID, FP8_MAX, FP8_NAN_BYTE, amax_of, amax_usable, cast_to_fp8,
                  compute_scale, dequantize, fp8_dtype, fp8_to_float, ftz, normalize_format,
                  quantize, scale_inverse, to_float32)
from .block_cast_transpose import multi_block_cast_transpose, multi_mxfp8_cast_transpose
from .grouped_gemm import grouped_dgrad, grouped_fprop, grouped_wgrad
from .pad_cast_transpose import merge_amax, multi_pad_cast_transpose
from .scale_update import reduce_history, update_scales
from .scatter_rows import scatter_plan, scatter_rows

__all__ = [
    "FP8_MAX", "FP8_FORMAT_ID", "FP8_NAN_BYTE", "FLT_MAX", "fp8_dtype", "normalize_format",
    "ftz", "to_float32", "cast_to_fp8", "fp8_to_float", "quantize", "dequantize",
    "compute_scale", "scale_inverse", "amax_of", "amax_usable", "multi_pad_cast_transpose",
    "multi_block_cast_transpose", "multi_mxfp8_cast_transpose",
    "merge_amax",
    "grouped_fprop", "grouped_dgrad", "grouped_wgrad", "update_scales", "reduce_history",
    "scatter_plan", "scatter_rows",
]
