"""scripts/layer_host.py: the torch layer's CUDA branch run on the CPU with its device calls
stopped at the launch. It must really take that branch (every launch a CUDA one, every GEMM a
cublasLtMatmul call, nothing computed by the reference or the emulator): otherwise its host
times would measure the CPU backends instead."""

from __future__ import annotations

import pathlib
import sys
from unittest import mock

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))

import layer_host  # noqa: E402

import cugrouped  # noqa: E402


@pytest.mark.parametrize("recipe,casts", [("current", 6), ("delayed", 3)])
def test_a_layer_step_takes_the_cuda_path_and_launches_only(recipe, casts):
    from cugrouped.bench.common import moe_splits
    from cugrouped.ops import grouped_gemm as gg

    experts = 5
    live = sum(1 for m in moe_splits(experts, 64 * experts, True, 1) if m)
    from cugrouped.ops import _gemm_direct
    from cugrouped.pytorch import _custom_ops as cops

    routed = []
    real_run = _gemm_direct.run
    with layer_host.cuda_path_on_cpu() as launches:
        step = layer_host.layer_step(experts, 32, 48, 64 * experts, recipe)
        step()
        launches.clear()
        state = gg._state(0)
        seen = []
        state.matmul = lambda *a: seen.append(a) or 0
        # the layer's casts and GEMMs take their direct routes (not the public ops' checks)
        with cugrouped.record_launches() as log, \
                mock.patch.object(cops._functional, "multi_pad_cast_transpose",
                                  side_effect=AssertionError("the public cast")), \
                mock.patch.object(gg, "checked", side_effect=AssertionError("the public GEMM")), \
                mock.patch.object(_gemm_direct, "run",
                                  lambda *a, **k: routed.append(a[0]) or real_run(*a, **k)):
            grads = step()
    assert routed == ["fprop", "dgrad", "wgrad"]
    assert {e.backend for e in log} == {"cuda"}
    kernels = [e.kernel for e in log]
    assert sum("pad_cast_transpose_kernel" in k for k in kernels) == casts
    assert sum("update" in k for k in kernels) == (1 if recipe == "delayed" else 0)
    assert kernels.count("cublasLtMatmul") == len(seen) == 3 * live   # fprop, dgrad, wgrad
    assert len(launches) == casts + (recipe == "delayed")
    assert len(grads) == 1 + experts and grads[0].shape == (64 * experts, 32)


def test_the_grouped_gemm_path_makes_one_call_per_gemm():
    """``--gemm-path grouped``: each GEMM of the step is one setup launch and one grouped
    ``cublasLtMatmul`` (jagged counts: the 16-multiple rule lifted), everything else as on the
    loop; the rule is back after."""
    from cugrouped.ops import _gemm_grouped
    from cugrouped.ops import grouped_gemm as gg

    rule = _gemm_grouped.GROUPED_DIM_BYTES
    with layer_host.cuda_path_on_cpu("grouped") as launches:
        step = layer_host.layer_step(6, 32, 48, 64 * 6, "current", "router")
        step()
        launches.clear()
        seen = []
        gg._state(0).matmul = lambda *a: seen.append(a) or 0
        with cugrouped.record_launches() as log:
            step()
    kernels = [e.kernel for e in log]
    assert kernels.count("cublasLtMatmul[grouped]") == len(seen) == 3
    assert "cublasLtMatmul" not in kernels
    assert sum("grouped_gemm_setup" in k for k in kernels) == 3
    assert sum("pad_cast_transpose_kernel" in k for k in kernels) == 6
    assert len(launches) == 6 + 3
    assert _gemm_grouped.GROUPED_DIM_BYTES == rule
    with pytest.raises(ValueError, match="gemm_path: got 'fast'"):
        with layer_host.cuda_path_on_cpu("fast"):
            pass


def test_the_patches_are_undone():
    from cugrouped import _jit
    from cugrouped.pytorch import _custom_ops as cops

    before = (_jit.get_function, cops._backend)
    with layer_host.cuda_path_on_cpu():
        assert _jit.get_function is not before[0]
    assert (_jit.get_function, cops._backend) == before


def test_main_prints_a_time_per_step(capsys):
    assert layer_host.main(["--experts", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("us per step on the CUDA path's host code") == 4   # 2 counts x 2 recipes
    assert out.count("router counts") == out.count("fixed  counts") == 2


def test_router_counts_change_every_step_and_fixed_ones_do_not():
    from cugrouped.pytorch import GroupedLinear

    seen = []
    real = GroupedLinear.forward

    def forward(self, inp, m_splits=None, *args, **kwargs):
        seen.append(tuple(m_splits))
        return real(self, inp, m_splits, *args, **kwargs)

    with layer_host.cuda_path_on_cpu(), mock.patch.object(GroupedLinear, "forward", forward):
        for counts in ("router", "fixed"):
            step = layer_host.layer_step(4, 16, 16, 256, "current", counts)
            for _ in range(layer_host.ROUTER_DRAWS + 1):
                step()
    router, fixed = seen[:layer_host.ROUTER_DRAWS + 1], seen[layer_host.ROUTER_DRAWS + 1:]
    assert len(set(router)) == layer_host.ROUTER_DRAWS and router[0] == router[-1]
    assert len(set(fixed)) == 1
    assert all(sum(m) == 256 for m in seen)
    with pytest.raises(ValueError, match="counts"):
        layer_host.layer_step(4, 16, 16, 256, "current", "random")


def test_custom_op_outputs_start_where_cuda_allocations_do():
    """The harness's torch.empty for the custom ops: 512-byte aligned, the shape and dtype asked
    for (the pointer alignments key cuBLASLt's cached algorithms)."""
    import torch

    for shape, dtype in (((3, 5), torch.bfloat16), ((7,), torch.uint8), ((0, 4), torch.float32),
                         (9, torch.float32)):
        t = layer_host.aligned_empty(shape, dtype)
        assert t.data_ptr() % layer_host.ALIGN == 0
        assert t.shape == ((shape,) if isinstance(shape, int) else shape) and t.dtype == dtype
        assert t.is_contiguous()


def test_the_block_pool_reuses_a_freed_block_of_the_same_size():
    """The harness's caching allocator: a collected tensor's block is the next one of its size
    (the addresses a repeated step gets on a GPU), aligned; other sizes get their own."""
    import gc

    import torch

    pool = layer_host.BlockPool()
    a = pool.empty((4, 8), torch.float32)
    ptr = a.data_ptr()
    other = pool.empty(7, torch.uint8)
    del a
    gc.collect()
    b = pool.empty((8, 4), torch.float32)            # the same bytes
    assert b.data_ptr() == ptr and b.data_ptr() % layer_host.ALIGN == 0 and b.shape == (8, 4)
    c = pool.empty((4, 8), torch.float32)            # b is alive: a new block
    assert c.data_ptr() not in (ptr, other.data_ptr())
