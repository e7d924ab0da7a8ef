"""cugrouped: FP8 expert layers for mixture-of-experts models on NVIDIA GPUs, with no compiled
extension (CUDA C in ``kernels_cu/``, compiled at run time by NVRTC through CuPy).

Public API::

    multi_pad_cast_transpose(inputs, m_splits=None, *, fp8_format="e4m3", scale=None, ...)
    GroupedFP8                      # its result: FP8 row-wise + transposed copies, amax, scales
    multi_block_cast_transpose(inputs, m_splits=None, *, block_scaling_dim=1, ...)
    GroupedBlockFP8                 # its result: FP8 copies with a scale per 1x128 / 128x128 block
    block_scaled_weights(data, scale_inv)  # weights quantized in 128x128 blocks elsewhere
                                    # (DeepSeek-V3's checkpoints) as a GroupedBlockFP8
    multi_mxfp8_cast_transpose(inputs, m_splits=None, *, align=32, ...)
    GroupedMXFP8                    # its result: MXFP8 copies, an E8M0 scale per 32 elements
    grouped_fprop(x, w, bias=None)  # y_i = x_i W_i^T for all experts (cuBLASLt; FP8 or bf16/fp16/fp32)
    grouped_dgrad(dy, w)            # dx_i = dy_i W_i
    grouped_wgrad(x, dy)            # dW_i = dy_i^T x_i (or accumulate into fp32 main_grad)
    update_scales(...)              # delayed scaling: amax histories -> scales, all tensors, one launch
    warmup()                        # compile every kernel for the current GPU ahead of use
    kernel_sources()                # where the installed CUDA sources live
    gpu_available()                 # whether CuPy sees a CUDA device here
    record_launches()               # context manager: the CUDA / emulated launches inside it
    emulation_order(order)          # context manager: the emulator's fiber order (race hunting)

PyTorch users: ``cugrouped.pytorch`` (``GroupedLinear``, ``fp8_autocast``, recipes); importing
``cugrouped`` itself never imports torch.

The casts, ``update_scales`` and ``cugrouped.ops.scatter_rows.scatter_rows`` take
``backend="cuda" | "emulate" | "reference"``; the GEMMs ``"cuda" | "reference"`` (cuBLASLt has no
CPU emulation); see docs/ops.md.
"""

from ._jit import warmup
from ._sources import kernels_dir as kernel_sources
from .grouped_block_fp8 import GroupedBlockFP8, GroupedMXFP8
from .grouped_fp8 import GroupedFP8
from .ops import (block_scaled_weights, emulation_order, grouped_dgrad, grouped_fprop,
                  grouped_wgrad,
                  multi_block_cast_transpose, multi_mxfp8_cast_transpose,
                  multi_pad_cast_transpose, record_launches,
                  update_scales)

__version__ = "0.1.0"

__all__ = ["multi_pad_cast_transpose", "GroupedFP8", "multi_block_cast_transpose", "GroupedBlockFP8",
           "block_scaled_weights",
           "multi_mxfp8_cast_transpose", "GroupedMXFP8",
           "grouped_fprop", "grouped_dgrad", "grouped_wgrad",
           "update_scales", "warmup", "kernel_sources",
           "record_launches", "emulation_order", "gpu_available", "__version__"]


def gpu_available() -> bool:
    """True when CuPy is installed and sees at least one CUDA device (never raises)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False
