"""Framework-neutral ops: NumPy / CuPy / torch in, same kind out. Device arrays of any kind are
read through their pointers; torch outputs come from torch's allocator and torch's current stream
is used (:mod:`cugrouped.pytorch.functional`, imported only when torch tensors are given: this
package never imports torch itself). Importing it registers every kernel spec with the JIT
(compile-check and warmup rely on it)."""

from ._launch import emulation_order, record_launches
from .block_cast_transpose import multi_block_cast_transpose
from .block_scaled_weights import block_scaled_weights
from .grouped_gemm import grouped_dgrad, grouped_fprop, grouped_wgrad
from .mxfp8_cast_transpose import multi_mxfp8_cast_transpose
from .pad_cast_transpose import multi_pad_cast_transpose
from .scale_update import update_scales
from . import scatter_rows as _scatter_rows  # noqa: F401  (registers its kernel)

__all__ = ["multi_pad_cast_transpose", "multi_block_cast_transpose", "block_scaled_weights",
           "multi_mxfp8_cast_transpose",
           "grouped_fprop", "grouped_dgrad", "grouped_wgrad",
           "update_scales", "record_launches", "emulation_order"]
