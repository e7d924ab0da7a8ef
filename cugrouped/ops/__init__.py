"""Framework-neutral ops: NumPy / CuPy arrays in, same kind out; CUDA torch tensors are read
through their pointers when the caller provides the outputs (what :mod:`cugrouped.pytorch` does;
this package never imports torch). Importing it registers every kernel spec with the JIT
(compile-check and warmup rely on it)."""

from ._launch import emulation_order, record_launches
from .grouped_gemm import grouped_dgrad, grouped_fprop, grouped_wgrad
from .pad_cast_transpose import multi_pad_cast_transpose
from .scale_update import update_scales

__all__ = ["multi_pad_cast_transpose", "grouped_fprop", "grouped_dgrad", "grouped_wgrad",
           "update_scales", "record_launches", "emulation_order"]
