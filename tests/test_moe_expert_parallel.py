"""Expert parallelism (cugrouped.pytorch.moe) on CPU processes with gloo, against the same block run
in one process with all experts.

One pool of ``POOL_SIZE`` spawned worker processes (loopback gloo, 30 s collective timeout) runs
every case: a 4-rank case on the world, 2-rank cases on subgroups (ranks 0, 1 or ranks 1, 3: any
process group works, not only the world), the other ranks idle. The parent waits at most
``TASK_TIMEOUT`` per case and kills the pool on a timeout, so a hang fails the test instead of
blocking CI.

What is exact and what is not. Every expert sees the same rows in the same order as in the
single-process run (tokens concatenated in rank order), so outputs and expert gradients are
compared bit for bit, with FP8 too. The replicated router is the one part that runs on a
different number of rows per process (a rank's tokens vs all of them), and CPU BLAS results for a
row depend on the matrix's row count (blocking; measured here: ``(a @ W)[:11] != a[:11] @ W`` in
the last bit). So:

* the router's logits are made exact whatever the summation order: inputs are multiples of 1/8
  and router weights multiples of 1/16 (few significant bits, every partial sum representable);
  with that the outputs are bit-identical;
* the input gradient's router term ``dlogits @ W_router`` has no such property: input gradients
  are compared with a relative tolerance ``RTOL`` (max abs error / max abs value);
* the router's weight gradient is a sum over tokens, each rank holding its tokens' part, summed
  here with ``all_reduce``; that reorders the sum: also ``RTOL``.

MKL's results also depend on its thread count, so the single-process reference runs with one
thread, as the workers do.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os
import queue
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from cugrouped.pytorch import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                               MXFP8BlockScaling, fp8_autocast)
from cugrouped.pytorch.moe import (MoEFeedForward, all_to_all_chunks, permute_tokens,
                                   plan_routing, shard_state_dict, unpermute_tokens)

ROOT = Path(__file__).resolve().parents[1]
TASK_TIMEOUT = 90.0      # seconds per case (all ranks), and for the pool's startup
POOL_SIZE = 4
SUBGROUPS = ((0, 1), (1, 3))
RTOL = {"float64": 1e-14, "float32": 1e-6}
RECIPES = {"none": None, "current": Float8CurrentScaling(),
           "delayed": DelayedScaling(amax_history_len=4), "block": Float8BlockScaling(),
           "mx": MXFP8BlockScaling()}


# ---------------------------------------------------------------------------------------------
# Cases: a global block (all experts) and inputs, built the same way in the parent

@dataclasses.dataclass(frozen=True)
class Case:
    world_size: int
    tokens: tuple[int, ...]          # tokens per rank of the expert-parallel group
    recipe: str = "none"
    dtype: str = "float64"
    activation: str = "swiglu"
    bias: bool = True
    steps: int = 1
    num_experts: int = 8
    top_k: int = 2
    hidden: int = 16
    ffn: int = 32
    cold_expert: int = 2             # rank 0's tokens never pick it; the other ranks' often do
    empty_experts: tuple[int, ...] = (5,)   # no token picks them
    ranks: tuple[int, ...] | None = None    # pool ranks forming the group (None: all of them)
    recompute: bool = False          # the ranks run the block under cugrouped's checkpoint
    all_to_all: str = "per_expert"   # MoEFeedForward's all_to_all (the ranks' blocks)
    fuse_permute: bool = False       # the ranks' blocks (the one-process reference never)

    def block(self, group=None, reference: bool = False) -> MoEFeedForward:
        return MoEFeedForward(self.hidden, self.ffn, self.num_experts, self.top_k,
                              activation=self.activation, bias=self.bias, router_bias=True,
                              group=group, params_dtype=getattr(torch, self.dtype), device="cpu",
                              all_to_all=self.all_to_all,
                              fuse_permute=self.fuse_permute and not reference)


def make_global(case: Case):
    """(global block, x (Σ tokens, hidden), dy) with the routing forced as the case says."""
    torch.manual_seed(1234)
    dtype = getattr(torch, case.dtype)
    block = case.block(reference=True)
    with torch.no_grad():
        block.router.weight.copy_(torch.round(torch.randn_like(block.router.weight) * 8) / 16)
        block.router.weight[case.cold_expert].zero_()
        block.router.weight[case.cold_expert, 0] = 4.0
        for e in case.empty_experts:
            block.router.bias[e] = -30.0
        for p in list(block.fc1.biases()) + list(block.fc2.biases()):
            p.normal_(std=0.1)
    x = torch.round(torch.randn(sum(case.tokens), case.hidden, dtype=dtype) * 8) / 8
    x[:, 0] = x[:, 0].abs()
    x[:case.tokens[0], 0] = -3.0        # rank 0: the cold expert's logit is -12
    dy = torch.randn(sum(case.tokens), case.hidden, dtype=dtype)
    return block, x, dy


def run_steps(block, x, dy, recipe, steps, recompute=False):
    """forward + backward ``steps`` times (the block's activations recomputed in backward with
    ``recompute``: its all-to-alls run again there); the last step's output and input
    gradient."""
    from cugrouped.pytorch import checkpoint

    for _ in range(steps):
        block.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_()
        with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = checkpoint(block, xi) if recompute else block(xi)
        y.backward(dy)
    return y.detach(), xi.grad


def reference(case: Case) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(case)
    finally:
        torch.set_num_threads(threads)


def _reference(case: Case) -> dict:
    block, x, dy = make_global(case)
    state = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
             for k, v in block.state_dict().items()}
    with torch.no_grad():
        _, ids = block.router(x)
    y, dx = run_steps(block, x, dy, RECIPES[case.recipe], case.steps)
    grads = {n: p.grad for n, p in block.named_parameters()}
    return {"state": state, "x": x, "dy": dy, "ids": ids, "y": y, "dx": dx, "grads": grads,
            "final_state": block.state_dict()}


# ---------------------------------------------------------------------------------------------
# Worker side

def _np(t):
    return None if t is None else t.detach().numpy().copy()


def _to_np(obj):
    if isinstance(obj, torch.Tensor):
        return _np(obj)
    if isinstance(obj, dict):
        return {k: _to_np(v) for k, v in obj.items()}
    return obj


def _from_np(obj):
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _from_np(v) for k, v in obj.items()}
    return obj


def _ep_case(group, case: Case, state, x, dy) -> dict:
    import torch.distributed as dist

    block = case.block(group)
    rank = block.ep_rank
    block.load_global_state_dict(state)
    lo = sum(case.tokens[:rank])
    xs, dys = x[lo:lo + case.tokens[rank]], dy[lo:lo + case.tokens[rank]]
    y, dx = run_steps(block, xs, dys, RECIPES[case.recipe], case.steps, case.recompute)
    router = {n: p.grad.clone() for n, p in block.router.named_parameters()}
    for g in router.values():
        dist.all_reduce(g, group=group)       # the replicated router: sum of the ranks' parts
    experts = {}
    for name, p in block.named_parameters():
        if not name.startswith("router."):
            head, i = name.rstrip("0123456789"), int(name[len(name.rstrip("0123456789")):])
            experts[f"{head}{block.local_expert_ids[i]}"] = p.grad
    extra = {k: v for k, v in block.state_dict().items() if k.endswith("_extra_state")}
    return {"y": y, "dx": dx, "router": {f"router.{n}": g for n, g in router.items()},
            "experts": experts, "extra": extra}


def _worker(rank, world_size, port, tasks, results):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=30))
        groups = {tuple(range(world_size)): None}
        for ranks in SUBGROUPS:               # new_group is collective: all ranks, same order
            groups[ranks] = dist.new_group(list(ranks))
        results.put((rank, "ready", None))
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, ranks, args = task
        if rank not in ranks:
            results.put((rank, "ok", None))
            continue
        try:
            results.put((rank, "ok", _to_np(globals()[fn](groups[ranks], *_from_np(args)))))
        except Exception:
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pool:
    """``world_size`` spawned gloo ranks that run tasks (a function name of this module and its
    arguments) until closed. Any error or timeout closes the pool."""

    def __init__(self, world_size: int):
        ctx = torch.multiprocessing.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r],
                                                        self.results), daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.alive = True
        self._collect(TASK_TIMEOUT, "ready")

    def _collect(self, timeout, want):
        out, deadline = {}, time.monotonic() + timeout
        while len(out) < self.world_size:
            try:
                rank, status, value = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.close(kill=True)
                pytest.fail(f"expert-parallel workers: no answer from ranks "
                            f"{sorted(set(range(self.world_size)) - set(out))} within {timeout} s")
            if status == "error":          # the other ranks may be stuck in a collective
                self.close(kill=True)
                pytest.fail(f"rank {rank} failed:\n{value}")
            assert status == want, (status, want)
            out[rank] = value
        return [out[r] for r in range(self.world_size)]

    def run(self, fn: str, ranks: tuple[int, ...], *args) -> list:
        """``fn(group, *args)`` on the ranks of ``group`` (the pool's world or one of
        ``SUBGROUPS``); their results in group rank order."""
        args = _to_np(list(args))
        for q in self.tasks:
            q.put((fn, tuple(ranks), args))
        out = self._collect(TASK_TIMEOUT, "ok")
        return [_from_np(out[r]) for r in ranks]

    def close(self, kill: bool = False):
        if not self.alive:
            return
        self.alive = False
        if not kill:
            for q in self.tasks:
                q.put(None)
        deadline = time.monotonic() + (0 if kill else 5)
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


@pytest.fixture(scope="module")
def pool():
    made: list[Pool] = []

    def get() -> Pool:
        if not made or not made[-1].alive:
            made.append(Pool(POOL_SIZE))
        return made[-1]

    yield get
    for p in made:
        p.close()


def run_case(pool, case: Case) -> list[dict]:
    ranks = case.ranks or tuple(range(case.world_size))
    assert len(ranks) == case.world_size == len(case.tokens)
    ref = reference(case)
    return ref, pool().run("_ep_case", ranks, case, ref["state"], ref["x"], ref["dy"])


# ---------------------------------------------------------------------------------------------
# Expert parallel == one process

def check_routing(case: Case, ids: torch.Tensor):
    """The forced routing really happened (otherwise the case tests less than it claims)."""
    counts = torch.bincount(ids.flatten(), minlength=case.num_experts)
    for e in case.empty_experts:
        assert counts[e] == 0, f"expert {e} was meant to get no tokens: {counts.tolist()}"
    rank0 = ids[:case.tokens[0]]
    assert not (rank0 == case.cold_expert).any(), "rank 0 sent tokens to the cold expert"
    assert counts[case.cold_expert] > 0, "no rank sent tokens to the cold expert"


def assert_exact(a, b, label):
    assert a.dtype == b.dtype and a.shape == b.shape, (label, a.dtype, b.dtype, a.shape, b.shape)
    if not torch.equal(a, b):
        diff = (a - b).abs().max().item()
        pytest.fail(f"{label}: not bit-identical (max abs diff {diff:.3g})")


def assert_close(a, b, rtol, label):
    assert a.dtype == b.dtype and a.shape == b.shape, (label, a.dtype, b.dtype, a.shape, b.shape)
    if a.numel():
        err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
        assert err <= rtol, f"{label}: relative error {err:.3g} > {rtol:g}"
        if os.environ.get("CUGROUPED_PRINT_ERRORS"):
            print(f"{label}: relative error {err:.3g}")


def compare(case: Case, ref: dict, ranks: list[dict]):
    lo = 0
    for r, res in enumerate(ranks):
        n = case.tokens[r]
        assert_exact(res["y"], ref["y"][lo:lo + n], f"rank {r} output")
        assert_close(res["dx"], ref["dx"][lo:lo + n], RTOL[case.dtype], f"rank {r} input grad")
        lo += n
    owned = {}
    for r, res in enumerate(ranks):
        for name, g in res["experts"].items():
            assert name not in owned, f"{name} on ranks {owned[name]} and {r}"
            owned[name] = r
            assert_exact(g, ref["grads"][name], f"{name} grad (rank {r})")
        for name, g in res["router"].items():
            assert_close(g, ref["grads"][name], RTOL[case.dtype], f"{name} grad (rank {r})")
    assert set(owned) == {n for n in ref["grads"] if not n.startswith("router.")}
    if case.recipe == "delayed":   # the FP8 scaling state of each shard == that of the global block
        for r, res in enumerate(ranks):
            want = shard_state_dict(ref["final_state"], case.num_experts, r, case.world_size)
            for key, st in res["extra"].items():
                for name in ("amax_history", "amax", "scale", "scale_inv"):
                    assert_exact(st[name], want[key][name], f"rank {r} {key}.{name}")


CASES = {
    # world 2: 4 experts per rank; world 4: 2 per rank, and rank 3 has no tokens of its own
    "w2_float64": Case(2, (11, 6)),
    "w4_float64": Case(4, (9, 5, 13, 0)),
    "w2_float64_gelu_top1": Case(2, (10, 7), activation="gelu", bias=False, top_k=1,
                                 ranks=(1, 3)),
    "w4_float64_top3_relu": Case(4, (3, 8, 6, 5), activation="relu", top_k=3),
    "w2_fp8_current": Case(2, (11, 6), "current", "float32", ranks=(1, 3)),
    # block scaling: every rank pads its experts' received rows to 16 (router counts are not)
    "w2_fp8_block": Case(2, (11, 6), "block", "float32"),
    "w4_fp8_block_single_a2a": Case(4, (9, 5, 13, 0), "block", "float32", all_to_all="single"),
    # MXFP8: padded to 32 rows; features in whole 32-element scale blocks
    "w2_mxfp8": Case(2, (11, 6), "mx", "float32", hidden=32, ffn=64),
    # the single exchange's regroup (and padding) folded into fc1's cast (row_index)
    "w2_float64_single_a2a_fused": Case(2, (11, 6), all_to_all="single", fuse_permute=True),
    "w4_fp8_block_single_a2a_fused": Case(4, (9, 5, 13, 0), "block", "float32",
                                          all_to_all="single", fuse_permute=True),
    "w4_fp8_current_single_a2a_fused": Case(4, (9, 5, 13, 2), "current", "float32",
                                            all_to_all="single", fuse_permute=True),
    "w4_fp8_delayed": Case(4, (9, 5, 13, 2), "delayed", "float32", steps=2),
    "w2_fp8_delayed_geglu": Case(2, (12, 9), "delayed", "float32", activation="geglu", steps=2),
    # the ranks recompute the block in backward (cugrouped.pytorch.checkpoint), the reference
    # does not: same bits
    "w4_fp8_delayed_recompute": Case(4, (9, 5, 13, 2), "delayed", "float32", steps=2,
                                     recompute=True),
    "w2_float64_recompute": Case(2, (11, 6), recompute=True, ranks=(1, 3)),
    # one all-to-all for all local experts, regrouped by expert: the same bits
    "w2_float64_single_a2a": Case(2, (11, 6), all_to_all="single"),
    "w4_fp8_delayed_single_a2a": Case(4, (9, 5, 13, 0), "delayed", "float32", steps=2,
                                      all_to_all="single"),
    "w2_fp8_current_single_a2a_recompute": Case(2, (12, 9), "current", "float32",
                                                all_to_all="single", recompute=True,
                                                ranks=(1, 3)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_equals_one_process(name, pool):
    case = CASES[name]
    ref, ranks = run_case(pool, case)
    check_routing(case, ref["ids"])
    compare(case, ref, ranks)


def _a2a_case(group, world_size: int) -> dict:
    """all_to_all_chunks forward and backward with uneven and empty splits."""
    import torch.distributed as dist

    rank, L = dist.get_rank(group), 2
    # rank r sends (r + l + s) % 3 rows of chunk l to rank s
    send = [[(rank + l + s) % 3 for s in range(world_size)] for l in range(L)]
    recv = [[(s + l + rank) % 3 for s in range(world_size)] for l in range(L)]
    chunks = [torch.full((sum(send[l]), 2), float(100 * rank + l), dtype=torch.float64,
                         requires_grad=True) for l in range(L)]
    out = all_to_all_chunks(chunks, send, recv, group)
    out.backward(torch.arange(out.shape[0], dtype=torch.float64)[:, None].expand(-1, 2))
    return {"out": out.detach(), **{f"grad{l}": c.grad for l, c in enumerate(chunks)}}


def _collectives_case(group, all_to_all: str) -> dict:
    """all_to_all_single calls in one forward of a 2-rank block with 4 local experts."""
    import torch.distributed as dist

    calls = []
    real = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    torch.manual_seed(0)
    block = MoEFeedForward(16, 32, 8, 2, group=group, device="cpu", all_to_all=all_to_all)
    dist.all_to_all_single = counting
    try:
        block(torch.randn(10, 16))
    finally:
        dist.all_to_all_single = real
    return {"calls": len(calls)}


@pytest.mark.parametrize("all_to_all, calls", [("per_expert", 1 + 4 + 4), ("single", 1 + 1 + 1)])
def test_collectives_per_forward(all_to_all, calls, pool):
    """The token counts, then dispatch and combine: one all-to-all per local expert each way,
    or one for all of them."""
    res = pool().run("_collectives_case", (0, 1), all_to_all)
    assert [r["calls"] for r in res] == [calls, calls]


def test_all_to_all_chunks_forward_and_backward(pool):
    W = 4
    res = pool().run("_a2a_case", tuple(range(W)), W)
    for r in range(W):
        want = []
        for l in range(2):
            for s in range(W):
                want += [100.0 * s + l] * ((s + l + r) % 3)
        assert res[r]["out"][:, 0].tolist() == want
        # the gradient of each sent row is its row index at the receiver
        for l in range(2):
            g = []
            for s in range(W):
                recv_s = [[(q + ll + s) % 3 for q in range(W)] for ll in range(2)]
                start = sum(sum(recv_s[ll]) for ll in range(l)) + sum(recv_s[l][:r])
                g += list(range(start, start + recv_s[l][r]))
            assert res[r][f"grad{l}"][:, 0].tolist() == g


def _fsdp2_case(group, recipe: str) -> dict:
    """GroupedLinear under FSDP2 (``fully_shard``) on the ranks of ``group``, each rank its own
    input: the full (all-gathered) gradients, and the per-rank inputs."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from cugrouped.pytorch import GroupedLinear

    torch.manual_seed(0)
    layer = GroupedLinear(4, 32, 48, device="cpu")
    fully_shard(layer, mesh=None if group is None else
                torch.distributed.device_mesh.DeviceMesh.from_group(group, "cpu"))
    rank = dist.get_rank(group)
    xs = [torch.randn(16, 32, generator=torch.Generator().manual_seed(5 + r)) for r in range(2)]
    rec = RECIPES[recipe]
    for _ in range(2):                    # twice: FSDP2 frees and re-gathers the parameters
        for p in layer.parameters():
            p.grad = None
        with fp8_autocast(enabled=rec is not None, fp8_recipe=rec):
            y = layer(xs[rank], [5, 0, 9, 2])
        y.sum().backward()
    return {n: p.grad.full_tensor() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("recipe", ["none", "current"])
def test_grouped_linear_under_fsdp2(recipe, pool):
    """FSDP2 frees the unsharded parameters after backward with ``storage.resize_(0)``: the
    layer's CPU path must leave their storage resizable (``Tensor.numpy()`` does not), and the
    reduced gradients equal the mean of the per-rank gradients of the plain layer."""
    from cugrouped.pytorch import GroupedLinear

    res = pool().run("_fsdp2_case", (0, 1), recipe)
    torch.manual_seed(0)
    ref = GroupedLinear(4, 32, 48, device="cpu")
    rec = RECIPES[recipe]
    for r in range(2):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(5 + r))
        with fp8_autocast(enabled=rec is not None, fp8_recipe=rec):
            ref(x, [5, 0, 9, 2]).sum().backward()
    for name, p in ref.named_parameters():
        for r in range(2):
            assert torch.allclose(res[r][name], p.grad / 2, rtol=1e-5, atol=1e-6), (name, r)


def _amax_reduction_case(group, reduce):
    """One delayed-scaling step of a GroupedLinear replicated on every rank (same weights), each
    rank with its own input scaled by (rank + 1); ``fp8_group`` = the world when ``reduce``
    (``"off"``: given, but the recipe says ``reduce_amax=False``)."""
    import torch.distributed as dist

    from cugrouped.pytorch import GroupedLinear

    rank = dist.get_rank(group)
    torch.manual_seed(0)
    layer = GroupedLinear(3, 32, 16, bias=False, device="cpu")
    x = (torch.randn(40, 32, generator=torch.Generator().manual_seed(7 + rank)) * (rank + 1)
         ).requires_grad_()
    with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4, reduce_amax=reduce is True),
                      fp8_group=(group or dist.group.WORLD) if reduce else None):
        y = layer(x, [10, 0, 30])
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(11 + rank)))
    return {"history": layer.fp8_amax_history.clone(), "scale": layer.fp8_scale.clone()}


def test_fp8_group_reduces_amaxes_to_identical_scales(pool):
    """With fp8_group, every rank's amax history holds the max over the ranks of each tensor's
    amax and the scales agree bit for bit; without it they are each rank's own."""
    W = 2
    own = pool().run("_amax_reduction_case", tuple(range(W)), False)
    red = pool().run("_amax_reduction_case", tuple(range(W)), True)
    off = pool().run("_amax_reduction_case", tuple(range(W)), "off")
    for r in range(W):      # DelayedScaling(reduce_amax=False): the group is not used
        assert torch.equal(off[r]["history"], own[r]["history"])
    assert not torch.equal(own[0]["history"][:, 0], own[1]["history"][:, 0])
    want = torch.maximum(own[0]["history"][:, 0], own[1]["history"][:, 0])
    for r in range(W):
        assert torch.equal(red[r]["history"][:, 0], want)
        assert torch.equal(red[r]["scale"], red[0]["scale"])
    # tensors 3..5 are the weights: the same on every rank, so already equal without reduction
    assert torch.equal(own[0]["history"][3:6, 0], own[1]["history"][3:6, 0])
    assert torch.count_nonzero(want[3:6]) == 3


# a rank that receives no token at all: all of rank 1's experts are empty
IDLE_RANK = Case(2, (8, 7), empty_experts=(4, 5, 6, 7))


@pytest.mark.parametrize("recipe", ["none", "current"])
def test_rank_that_receives_no_tokens(recipe, pool):
    case = dataclasses.replace(IDLE_RANK, recipe=recipe,
                               dtype="float64" if recipe == "none" else "float32")
    ref, ranks = run_case(pool, case)
    check_routing(case, ref["ids"])
    compare(case, ref, ranks)
    for e in case.empty_experts:         # experts without tokens: zero gradients, not None
        assert torch.count_nonzero(ref["grads"][f"fc1.weight{e}"]) == 0


# ---------------------------------------------------------------------------------------------
# One process: routing helpers, the block's math, state sharding, errors

def test_plan_routing_sorts_stably_by_local_expert_then_rank():
    ids = torch.tensor([[3, 0], [1, 2], [0, 3], [2, 1], [3, 1]])
    plan = plan_routing(ids, 4, ep_size=2)          # L = 2: expert e -> (l, r) = (e % 2, e // 2)
    flat = ids.flatten()
    key = (flat % 2) * 2 + flat // 2
    assert torch.equal(plan.sort_idx, torch.argsort(key, stable=True))
    assert key[plan.sort_idx].tolist() == sorted(key.tolist())
    assert torch.equal(plan.sort_idx[plan.inverse], torch.arange(10))
    assert plan.tokens_per_expert.tolist() == [2, 3, 2, 3]
    assert plan.send_counts(plan.tokens_per_expert.tolist()) == [[2, 2], [3, 3]]
    one = plan_routing(ids, 4)
    assert flat[one.sort_idx].tolist() == sorted(flat.tolist())
    rank_major = plan_routing(ids, 4, ep_size=2, order="rank_major")   # by e = r·L + l
    assert torch.equal(rank_major.sort_idx, torch.argsort(flat, stable=True))
    assert rank_major.tokens_per_expert.tolist() == [2, 3, 2, 3]


@pytest.mark.parametrize("E, W, T, k", [(8, 1, 50, 2), (8, 2, 37, 3), (12, 4, 29, 2),
                                         (6, 3, 1, 1), (8, 4, 0, 2)])
def test_plan_counts_equal_bincount_without_it(E, W, T, k):
    """tokens_per_expert comes from the sorted keys (torch.bincount syncs the host on CUDA); it
    must equal bincount in global expert order, empty experts included."""
    g = torch.Generator().manual_seed(E * 100 + W * 10 + T)
    ids = torch.randint(0, E - 1, (T, k), generator=g)      # expert E - 1 never chosen
    plan = plan_routing(ids, E, ep_size=W)
    assert plan.tokens_per_expert.dtype == torch.int64
    assert plan.tokens_per_expert.tolist() == torch.bincount(ids.flatten(), minlength=E).tolist()


@pytest.mark.parametrize("seed", range(8))
def test_regroup_index_by_hand(seed):
    """The single all-to-all's regroup (``fuse_permute``): received rows come by source rank,
    (s, l) blocks; grouped by expert they are (l, s) blocks. Its index, computed on the counts'
    device, against the rows listed one by one; empty blocks, ranks and experts included."""
    from cugrouped.pytorch.moe import _regroup_index

    rng = np.random.default_rng(seed)
    W, L = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    recv = rng.integers(0, 4, W * L) * (rng.random(W * L) > 0.3)
    received = [(s, l, j) for s in range(W) for l in range(L) for j in range(recv[s * L + l])]
    grouped = [(s, l, j) for l in range(L) for s in range(W) for j in range(recv[s * L + l])]
    at = {row: i for i, row in enumerate(received)}
    want = [at[row] for row in grouped]
    row_index, where = _regroup_index(torch.tensor(recv, dtype=torch.int64), W, L, len(want))
    assert row_index.tolist() == want
    assert where.tolist() == [grouped.index(row) for row in received]


@pytest.mark.gpu
def test_gpu_regroup_and_padding_indices_sync_nothing():
    """The fused single exchange's indices (regroup, then the block recipes' pad rows) from the
    received counts on the device: no stream sync (torch's sync debug mode raises on one, e.g.
    a pageable host-to-device copy), the same indices as on the CPU."""
    from cugrouped.pytorch.moe import _padded_rows, _regroup_index

    W, L = 3, 2
    recv = [5, 0, 17, 3, 0, 9]
    m_splits = [sum(recv[s * L + l] for s in range(W)) for l in range(L)]
    host = _regroup_index(torch.tensor(recv), W, L, sum(recv))
    host_pad = _padded_rows(m_splits, torch.tensor(recv).view(W, L).sum(0), 16)
    dev = torch.tensor(recv, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _regroup_index(dev, W, L, sum(recv))
        padded, dest = _padded_rows(m_splits, dev.view(W, L).sum(0), 16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [t.tolist() for t in got] == [t.tolist() for t in host]
    assert padded == host_pad[0] and dest.tolist() == host_pad[1].tolist()


def test_permute_unpermute_round_trip_and_gradcheck():
    torch.manual_seed(0)
    T, k, E, H = 7, 3, 5, 4
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    plan = plan_routing(ids, E)
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    xp = permute_tokens(x, plan)
    assert torch.equal(xp, x[plan.sort_idx // k])
    probs = torch.rand(T, k, dtype=torch.float64, requires_grad=True)
    back = unpermute_tokens(xp, plan, probs)
    assert torch.allclose(back, x * probs.sum(1, keepdim=True), rtol=1e-15, atol=0)
    assert torch.autograd.gradcheck(lambda a, p: unpermute_tokens(permute_tokens(a, plan) ** 2,
                                                                  plan, p), (x, probs))
    empty = plan_routing(torch.empty(0, 2, dtype=torch.int64), E)
    z = torch.empty(0, H, requires_grad=True)
    unpermute_tokens(permute_tokens(z, empty), empty, torch.empty(0, 2)).sum().backward()
    assert z.grad.shape == (0, H)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_one_process_block_equals_per_token_loop(activation):
    case = Case(1, (13,), activation=activation)
    block, x, _ = make_global(case)
    y = block(x.unsqueeze(0)).squeeze(0)
    probs, ids = block.router(x)
    ws1, bs1, ws2, bs2 = block.fc1.weights(), block.fc1.biases(), block.fc2.weights(), block.fc2.biases()
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(case.top_k):
            e = int(ids[t, j])
            h = block._act(x[t] @ ws1[e].T + bs1[e])
            want[t] += probs[t, j] * (h @ ws2[e].T + bs2[e])
    assert (y - want).abs().max() <= 1e-15 * want.abs().max()
    assert torch.allclose(probs.sum(1), torch.ones(13, dtype=torch.float64), rtol=1e-15, atol=0)


@pytest.mark.parametrize("recipe,top_k", [("none", 2), ("current", 2), ("delayed", 2),
                                           ("delayed", 4)])
def test_fuse_permute_equals_the_permuted_block(recipe, top_k):
    """MoEFeedForward(fuse_permute=True): fc1 gathers through the routing order instead of a
    permuted copy. Outputs and weight gradients equal the default block's bit for bit; the input
    gradient too for top-2 (two addends: the sum order cannot matter), and within float32
    summation order for top-4."""
    case = Case(1, (19,), recipe=recipe, dtype="float32", top_k=top_k, steps=2)
    plain, x, dy = make_global(case)
    fused = copy.deepcopy(plain)
    fused.fuse_permute = True
    a = run_steps(plain, x, dy, RECIPES[recipe], case.steps)
    b = run_steps(fused, x, dy, RECIPES[recipe], case.steps)
    assert torch.equal(a[0], b[0])
    for p, q in zip(plain.parameters(), fused.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
    if top_k <= 2:
        assert torch.equal(a[1], b[1])
    else:
        torch.testing.assert_close(b[1], a[1], rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="fuse_permute"):
        MoEFeedForward(16, 32, 4, device="cpu", fuse_permute=1)


def test_shard_state_dict_maps_experts_and_fp8_state():
    case = Case(1, (20,), recipe="delayed", dtype="float32", steps=1)
    block, x, dy = make_global(case)
    run_steps(block, x, dy, RECIPES["delayed"], 1)
    sd = block.state_dict()
    shard = shard_state_dict(sd, 8, ep_rank=1, ep_size=4)    # experts 2, 3
    assert torch.equal(shard["fc1.weight0"], sd["fc1.weight2"])
    assert torch.equal(shard["fc2.bias1"], sd["fc2.bias3"])
    assert "fc1.weight2" not in shard and torch.equal(shard["router.weight"], sd["router.weight"])
    st, full = shard["fc1._extra_state"], sd["fc1._extra_state"]
    assert st["num_experts"] == 2
    for w in range(3):                          # input, weight, grad output rows of experts 2, 3
        assert torch.equal(st["amax_history"][2 * w:2 * w + 2], full["amax_history"][8 * w + 2:8 * w + 4])
    small = MoEFeedForward(16, 32, 2, 2, router_bias=True, bias=True, device="cpu",
                           params_dtype=torch.float32)
    small.load_state_dict({**shard, "router.weight": sd["router.weight"][:2],
                           "router.bias": sd["router.bias"][:2]})
    assert torch.equal(small.fc1.fp8_scale, st["scale"])
    assert shard_state_dict({"m.router.weight": 1, "other": 2}, 8, 0, 2, prefix="m.") == \
        {"router.weight": 1}
    # no FP8 state (TransformerEngine's empty uint8 tensor, as a stateless recipe saves it)
    none = torch.empty(0, dtype=torch.uint8)
    assert shard_state_dict({"fc1._extra_state": none}, 8, 1, 4)["fc1._extra_state"] is none


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="activation"):
        MoEFeedForward(16, 32, 4, activation="tanh", device="cpu")
    with pytest.raises(ValueError, match="top_k"):
        MoEFeedForward(16, 32, 4, top_k=5, device="cpu")
    with pytest.raises(ValueError, match="num_experts"):
        plan_routing(torch.zeros(3, 2, dtype=torch.int64), 6, ep_size=4)
    with pytest.raises(ValueError, match="order: expected"):
        plan_routing(torch.zeros(3, 2, dtype=torch.int64), 4, ep_size=2, order="random")
    with pytest.raises(ValueError, match="all_to_all: expected 'per_expert' or 'single'"):
        MoEFeedForward(16, 32, 4, device="cpu", all_to_all="many")
    block = MoEFeedForward(16, 32, 4, device="cpu")
    with pytest.raises(ValueError, match="hidden_size=16"):
        block(torch.randn(3, 8))
    with pytest.raises(TypeError, match=r"x: dtype torch.bfloat16 differs from the parameters' "
                                        r"torch.float32 \(params_dtype"):
        block(torch.randn(3, 16, dtype=torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):           # autocast casts instead
        assert block(torch.randn(3, 16, dtype=torch.bfloat16)).shape == (3, 16)
    with pytest.raises(TypeError, match="params_dtype: expected a torch.dtype"):
        MoEFeedForward(16, 32, 4, device="cpu", params_dtype="float32")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cpu'"):
            MoEFeedForward(16, 32, 4)
    assert (block.ep_rank, block.ep_size, list(block.local_expert_ids)) == (0, 1, [0, 1, 2, 3])


# ---------------------------------------------------------------------------------------------
# The example script, as torchrun runs it

def test_example_runs_under_torchrun_on_cpu():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "examples" / "moe_expert_parallel.py"), "--backend", "gloo", "--device",
           "cpu", "--steps", "2", "--fp8", "current", "--check", "--hidden", "32", "--ffn", "64",
           "--tokens", "16", "--all-to-all", "single", "--recompute", "--delay-wgrad"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"example did not finish in 120 s:\n{exc.stdout}\n{exc.stderr}")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2/2 ranks' outputs match the single-process block bit for bit" in res.stdout, res.stdout
    assert "step 1" in res.stdout and "all_to_all=single, recompute=True, delay_wgrad=True" \
        in res.stdout, res.stdout
