"""Megatron-core's grouped experts on cugrouped's layers under expert tensor parallelism
(cugrouped/pytorch/megatron.py), two spawned gloo processes on the CPU: each rank holds a shard
of every expert as Megatron's own SequentialMLP does (fc1 the rows of both halves of a gated
unit, fc2 the columns), the shards' partial outputs sum to the whole experts' output, and
distributed checkpoints move between the two and between tensor-parallel sizes 2 and 1."""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install megatron-core; "
                                            "the test extra installs it)")

E, HIDDEN, FFN, TP = 4, 64, 96, 2
SPLITS = [9, 0, 14, 5]
TIMEOUT = 240           # s for both ranks, spawn and Megatron's import included

from test_pytorch_megatron import pair, shards  # noqa: E402


def _config(dtype=torch.float64):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=E,
        moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN, use_cpu_initialization=True,
        add_bias_linear=False, bias_dropout_fusion=False, gated_linear_unit=True,
        expert_tensor_parallel_size=TP,     # Megatron: no expert biases at this size
        activation_func=torch.nn.functional.silu, params_dtype=dtype, moe_router_topk=2,
        moe_grouped_gemm=True, moe_token_dispatcher_type="allgather")


def _pair(cfg, seed):
    """test_pytorch_megatron's pair, each rank's shards drawn apart."""
    gen = torch.Generator().manual_seed(100 * seed + torch.distributed.get_rank())
    return pair(cfg, seed, gen)


def _save(mlp, ckpt_dir: str, name: str) -> str:
    """``mlp``'s distributed checkpoint (every rank) into a new folder ``name``; its path."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    path = os.path.join(ckpt_dir, name)
    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    dist_checkpointing.save(mlp.sharded_state_dict(prefix="experts."), path)
    return path


def _load(mlp, ckpt):
    from megatron.core import dist_checkpointing

    sd = dist_checkpointing.load(mlp.sharded_state_dict(prefix="experts."), ckpt)
    mlp.load_state_dict({k[len("experts."):]: v for k, v in sd.items()})


def _gathered(grp):
    """Each expert's whole fc1 and fc2 weights from the ranks' shards: fc1's rows are
    [a_0; b_0] on rank 0 and [a_1; b_1] on rank 1 for a gated unit's halves a and b."""
    import torch.distributed as dist

    def gather(t):
        parts = [torch.empty_like(t) for _ in range(TP)]
        dist.all_gather(parts, t.detach().contiguous())
        return parts

    out = []
    for i in range(E):
        w1 = [p.chunk(2) for p in gather(grp.linear_fc1.weights()[i])]
        out.append({
            "fc1.weight": torch.cat([a for a, _ in w1] + [b for _, b in w1]),
            "fc2.weight": torch.cat(gather(grp.linear_fc2.weights()[i]), dim=1)})
    return out


def _cases(rank: int, ckpt_dir: str) -> str:
    """Every check, on both ranks; raises on the first failure."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from cugrouped.pytorch import DelayedScaling, fp8_autocast
    from cugrouped.pytorch.megatron import (ColumnParallelGroupedLinear, MegatronGroupedLinear,
                                            RowParallelGroupedLinear)

    # Megatron's checkpoint writer syncs the device and keeps a status tensor on it (module doc
    # of test_pytorch_megatron.py): nothing to wait for on the CPU, and gloo takes CPU tensors
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1,
                                 expert_tensor_parallel_size=TP)
    cfg = _config()
    seq, grp = _pair(cfg, seed=0)

    # this rank's shard of every expert: the shapes SequentialMLP has
    for i, expert in enumerate(seq.local_experts):
        for fc in ("linear_fc1", "linear_fc2"):
            assert getattr(grp, fc).weights()[i].shape == getattr(expert, fc).weight.shape
    assert grp.linear_fc1.weights()[0].shape == (2 * FFN // TP, HIDDEN)
    assert grp.linear_fc2.weights()[0].shape == (HIDDEN, FFN // TP)
    assert grp.linear_fc1.explicit_expert_comm and grp.linear_fc2.parallel_mode is None

    # the partial outputs, summed over the ranks (the dispatcher's reduce-scatter), are the
    # whole experts' output; so are the input gradients; each shard's weight gradient is its
    # part of the whole weight's
    torch.manual_seed(1)                              # the same tokens on both ranks
    x = torch.randn(sum(SPLITS), HIDDEN, dtype=torch.float64)
    probs = torch.rand(x.shape[0], dtype=torch.float64)
    dy = torch.linspace(-1, 1, x.numel(), dtype=x.dtype).view_as(x)
    xg = x.clone().requires_grad_()
    out, bias = grp(xg, torch.tensor(SPLITS), probs)
    assert bias is None
    out.backward(dy)
    y, dx = out.detach().clone(), xg.grad.clone()
    dist.all_reduce(y)
    dist.all_reduce(dx)
    whole = _gathered(grp)
    xr = x.clone().requires_grad_()
    ys, row, params = [], 0, []
    for w, m in zip(whole, SPLITS):
        w1 = w["fc1.weight"].clone().requires_grad_()
        params.append(w1)
        xe, pe = xr[row:row + m], probs[row:row + m, None]
        a, b = torch.chunk(xe @ w1.t(), 2, dim=-1)
        ys.append((torch.nn.functional.silu(a) * b * pe) @ w["fc2.weight"].t())
        row += m
    yr = torch.cat(ys)
    yr.backward(dy)
    torch.testing.assert_close(y, yr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, xr.grad, rtol=1e-12, atol=1e-12)
    for i, w1 in enumerate(params):
        g = w1.grad.chunk(2)                          # rank r's rows of a and of b
        want = torch.cat([g[0].chunk(TP)[rank], g[1].chunk(TP)[rank]])
        torch.testing.assert_close(grp.linear_fc1.weights()[i].grad, want, rtol=1e-12,
                                   atol=1e-12)

    # checkpoints: SequentialMLP's shards, both ways
    assert shards(grp) == shards(seq), "shards"
    a = _save(seq, ckpt_dir, "seq_tp2")
    _, fresh = _pair(cfg, seed=5)
    _load(fresh, a)
    for i, expert in enumerate(seq.local_experts):
        for fc in ("linear_fc1", "linear_fc2"):
            assert torch.equal(getattr(fresh, fc).weights()[i], getattr(expert, fc).weight), fc

    # FP8, delayed scaling: the shards' amaxes are reduced over expt_tp, so both ranks hold one
    # state (checked below to be the whole experts' at size 1); a checkpoint keeps TP rank 0's,
    # as Megatron does, which therefore restores every rank exactly
    cfg32 = _config(torch.float32)
    _, g8 = _pair(cfg32, seed=2)
    recipe = DelayedScaling(amax_history_len=4)

    def fp8_steps(mlp):
        for _ in range(2):          # the second step casts with the first one's scales
            with fp8_autocast(fp8_recipe=recipe):
                xi = x.float().requires_grad_()
                mlp(xi, torch.tensor(SPLITS), probs.float())[0].sum().backward()
        return {fc: getattr(mlp, fc).fp8_state().tensors for fc in ("linear_fc1", "linear_fc2")}

    state8 = fp8_steps(g8)
    for fc, st in state8.items():
        assert st["scale"].ne(1).any(), fc
        for name, t in st.items():
            theirs = [torch.empty_like(t) for _ in range(TP)]
            dist.all_gather(theirs, t)
            assert torch.equal(theirs[0], theirs[1]), (fc, name)
    whole8 = _gathered(g8)
    b = _save(g8, ckpt_dir, "grp_fp8_tp2")
    _, f8 = _pair(cfg32, seed=6)
    for fc in ("linear_fc1", "linear_fc2"):
        getattr(f8, fc).init_fp8_state(recipe)
    _load(f8, b)
    for fc, st in state8.items():
        got = getattr(f8, fc).fp8_state().tensors
        assert all(torch.equal(got[k], st[k]) for k in st), fc

    # errors: a size the shards cannot divide; a bias (Megatron allows expert biases only at
    # expert tensor-parallel size 1: each rank would add fc2's before the sum)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    for cls, args, bias, name in (
            (ColumnParallelGroupedLinear, (HIDDEN, 2 * FFN + 1), False, "output_size"),
            (RowParallelGroupedLinear, (FFN + 1, HIDDEN), False, "input_size"),
            (ColumnParallelGroupedLinear, (HIDDEN, 2 * FFN), True, "bias"),
            (RowParallelGroupedLinear, (FFN, HIDDEN), True, "bias")):
        try:
            cls(E, *args, config=cfg, init_method=None, bias=bias, skip_bias_add=False,
                is_expert=True, pg_collection=pgc)
        except ValueError as exc:
            assert str(exc).startswith(f"{name}: ") and "expert tensor-parallel size 2" in \
                str(exc), exc
        else:
            raise AssertionError(f"{cls.__name__}: no error for {name}")
    # no parallel mode: nothing divided (as TEGroupedLinear)
    plain = MegatronGroupedLinear(E, HIDDEN, FFN, config=cfg, init_method=None, bias=False,
                                  skip_bias_add=False, is_expert=True, pg_collection=pgc)
    assert plain.weights()[0].shape == (FFN, HIDDEN)

    # a tensor-parallel size 2 checkpoint (cugrouped's) loads at size 1 into both: the shards
    # join into the whole weights
    c = _save(grp, ckpt_dir, "grp_tp2")
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1,
                                 expert_tensor_parallel_size=1)
    seq1, grp1 = _pair(cfg, seed=7)
    _load(seq1, c)
    _load(grp1, c)
    for i, (expert, w) in enumerate(zip(seq1.local_experts, whole)):
        for fc, mlp in (("linear_fc1", "fc1"), ("linear_fc2", "fc2")):
            assert torch.equal(getattr(expert, fc).weight, w[f"{mlp}.weight"]), (fc, i)
            assert torch.equal(getattr(grp1, fc).weights()[i], w[f"{mlp}.weight"]), (fc, i)
    # the FP8 state at size 2 is the whole experts' at size 1 after the same steps
    _, g1 = _pair(cfg32, seed=8)
    with torch.no_grad():
        for i, w in enumerate(whole8):
            g1.linear_fc1.weights()[i].copy_(w["fc1.weight"])
            g1.linear_fc2.weights()[i].copy_(w["fc2.weight"])
    for fc, st in fp8_steps(g1).items():
        assert all(torch.equal(st[k], state8[fc][k]) for k in st), fc
    ps.destroy_model_parallel()
    return "ok"


def _worker(rank, port, ckpt_dir, results):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        import warnings

        warnings.simplefilter("ignore")     # Megatron: TransformerEngine and Apex are absent
        dist.init_process_group("gloo", rank=rank, world_size=TP,
                                timeout=datetime.timedelta(seconds=60))
        results.put((rank, "ok", _cases(rank, ckpt_dir)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_expert_tensor_parallel_shards_are_sequential_mlps(tmp_path):
    """Two ranks at expert tensor-parallel size 2 (module doc)."""
    ctx = torch.multiprocessing.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = ctx.Queue()
    # not daemonic: Megatron's checkpoint writer starts a process of its own (killed below)
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path), results))
             for r in range(TP)]
    for p in procs:
        p.start()
    try:
        got = {}
        while len(got) < TP:
            try:
                rank, status, value = results.get(timeout=TIMEOUT)
            except queue.Empty:
                pytest.fail(f"no answer from ranks {sorted(set(range(TP)) - set(got))} "
                            f"within {TIMEOUT} s")
            if status == "error":
                pytest.fail(f"rank {rank} failed:\n{value}")
            got[rank] = value
        assert got == {0: "ok", 1: "ok"}
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
