"""cugrouped for PyTorch: ``GroupedLinear`` over a list of per-expert tensors, FP8 recipes and
``fp8_autocast`` (TransformerEngine-style). The only part of cugrouped that imports torch.

::

    import torch
    from cugrouped.pytorch import GroupedLinear, fp8_autocast, DelayedScaling, Format

    layer = GroupedLinear(num_gemms=8, in_features=1024, out_features=4096, device="cuda",
                          params_dtype=torch.bfloat16)
    with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(fp8_format=Format.HYBRID)):
        ys = layer([x0, x1, ..., x7])          # list in -> list out (views of one buffer)
        y = layer(x, m_splits=[m0, ..., m7])   # one tensor + split sizes -> one tensor

CUDA tensors run the NVRTC kernels and cuBLASLt on ``torch.cuda.current_stream()``; CPU tensors
run the same kernels on the CPU emulator and the GEMMs' NumPy reference (for debugging and tests).
"""

try:
    import torch  # noqa: F401
except ImportError as exc:
    raise ImportError("cugrouped.pytorch needs PyTorch: pip install torch (or the torch extra, "
                      "pip install '.[cuda13,torch]' in the checkout); the ops in cugrouped "
                      "itself run without it") from exc

from . import _custom_ops  # noqa: F401  (registers the torch.library ops)
from .checkpoint import checkpoint
from .fp8_state import DelayedScalingState
from .frozen import FrozenGroupedLinear
from .grouped_linear import GroupedLinear, cpu_cast_backend, set_cpu_cast_backend
from .moe import MoEFeedForward, shard_state_dict
from .recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MMParams,
                     MXFP8BlockScaling, QParams, autocast, fp8_autocast, get_fp8_group,
                     get_fp8_recipe, is_fp8_enabled)
from .te_checkpoint import from_te_extra_state, from_te_state_dict

__all__ = ["GroupedLinear", "fp8_autocast", "autocast", "DelayedScaling", "Float8CurrentScaling",
           "Float8BlockScaling", "MXFP8BlockScaling",
           "QParams", "MMParams", "Format", "get_fp8_recipe", "get_fp8_group", "is_fp8_enabled",
           "DelayedScalingState",
           "set_cpu_cast_backend", "cpu_cast_backend", "MoEFeedForward", "shard_state_dict",
           "checkpoint", "from_te_state_dict", "from_te_extra_state", "FrozenGroupedLinear"]
