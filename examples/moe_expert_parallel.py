"""Expert-parallel MoE training steps with cugrouped's GroupedLinear as each rank's experts.

GPUs (NCCL, one GPU per process, FP8 with delayed scaling)::

    torchrun --nproc-per-node=8 examples/moe_expert_parallel.py --fp8 delayed --check

CPUs (gloo; the casts run the CUDA kernels on the CPU emulator, the GEMMs a NumPy reference)::

    torchrun --standalone --nproc-per-node=2 examples/moe_expert_parallel.py \
        --backend gloo --device cpu --fp8 current --check

Every rank holds ``num_experts / world_size`` experts and a replica of the router. Weights are
made once from a seed as a single block with all experts, and each rank loads its shard
(``load_global_state_dict``), as one would from a checkpoint of the unsharded model. ``--check``
also runs that unsharded block on every rank's tokens and verifies that this rank's outputs are
bit-identical to it. That holds on CPUs, and on one GPU; with several GPU ranks it is not promised:
the unsharded block's router multiplies W times more rows than a rank's, and cuBLAS may pick
another kernel for that shape (other last bits in the logits, so a near-tie can route a token to
another expert); the check then reports the largest difference. The training loop sums the
replicated router's gradient over the ranks (DDP would do it) and leaves each expert's gradient on
its owner. ``--all-to-all single`` sends one all-to-all for all local experts (the default sends
one per expert); ``--recompute`` recomputes the block in backward (``cugrouped.pytorch.checkpoint``);
``--delay-wgrad`` computes the experts' weight gradients after backward (``backward_dw()``).
Compare the per-step times of these choices on a multi-GPU machine.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from cugrouped.pytorch import DelayedScaling, Float8CurrentScaling, checkpoint, fp8_autocast
from cugrouped.pytorch.moe import MoEFeedForward


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="nccl", help="nccl (GPUs) or gloo (CPUs)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default=None, help="bfloat16 (default on cuda) or float32")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=None, help="default: 4 per rank")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=None, help="per rank (default 4096 cuda, 64 cpu)")
    p.add_argument("--activation", default="swiglu")
    p.add_argument("--fp8", default="delayed", choices=["none", "delayed", "current"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--all-to-all", default="per_expert", choices=["per_expert", "single"],
                   help="one all-to-all per local expert, or one for all (regrouped by a copy)")
    p.add_argument("--recompute", action="store_true",
                   help="recompute the block in backward (cugrouped.pytorch.checkpoint)")
    p.add_argument("--delay-wgrad", action="store_true",
                   help="experts' weight gradients after backward, through backward_dw()")
    p.add_argument("--check", action="store_true",
                   help="compare this rank's outputs with the unsharded block")
    return p.parse_args()


def main():
    args = parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group(args.backend, device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group(args.backend)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    experts = args.experts or 4 * world
    tokens = args.tokens or (4096 if args.device == "cuda" else 64)
    recipe = {"none": None, "delayed": DelayedScaling(amax_history_len=16),
              "current": Float8CurrentScaling()}[args.fp8]

    def build(group):
        return MoEFeedForward(args.hidden, args.ffn, experts, args.top_k,
                              activation=args.activation, group=group, params_dtype=dtype,
                              device=device, all_to_all=args.all_to_all,
                              delay_wgrad_compute=args.delay_wgrad)

    # The unsharded block (all experts) from one seed, then this rank's shard of it.
    # (new_group is collective: every rank creates every one-rank group, and keeps its own)
    solo = [dist.new_group([r]) for r in range(world)][rank]    # one rank: no collectives
    torch.manual_seed(0)
    full = build(solo)
    moe = build(None)                                           # the world: experts sharded
    moe.load_global_state_dict(full.state_dict())
    if not args.check:
        del full
    if rank == 0:
        print(f"{world} ranks, {experts} experts ({moe.num_local_experts} per rank), top-{args.top_k}, "
              f"hidden {args.hidden}, ffn {args.ffn}, {tokens} tokens per rank, {dtype}, "
              f"fp8={args.fp8}, all_to_all={args.all_to_all}, recompute={args.recompute}, "
              f"delay_wgrad={args.delay_wgrad}, backend {args.backend}", flush=True)

    gen = torch.Generator(device="cpu").manual_seed(1)
    all_x = torch.randn(world, tokens, args.hidden, generator=gen).to(device=device, dtype=dtype)
    x = all_x[rank]
    target = torch.randn(world, tokens, args.hidden, generator=gen)[rank].to(device=device,
                                                                            dtype=dtype)

    if args.check:
        with torch.no_grad(), fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = moe(x)
            want = full(all_x.reshape(-1, args.hidden))[rank * tokens:(rank + 1) * tokens]
        same = torch.equal(y, want)
        ok = torch.tensor([int(same)], device=device)
        dist.all_reduce(ok)
        if not same:
            print(f"rank {rank}: max |diff| {(y.float() - want.float()).abs().max().item():.3g}",
                  flush=True)
        if rank == 0:
            print(f"check: {ok.item()}/{world} ranks' outputs "
                  + ("match the single-process block bit for bit" if ok.item() == world
                     else "DIFFER from the single-process block"), flush=True)
        if ok.item() != world:
            raise SystemExit(1)
        del full

    opt = torch.optim.SGD(moe.parameters(), lr=args.lr)
    for step in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = checkpoint(moe, x) if args.recompute else moe(x)
        loss = torch.nn.functional.mse_loss(y.float(), target.float())
        loss.backward()
        moe.backward_dw()                         # no-op without --delay-wgrad
        for p in moe.router.parameters():         # the replicated router: average over ranks
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step}: loss {total.item() / world:.6f}  "
                  f"{(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
