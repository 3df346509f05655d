"""Train a small residual MLP with FSDP2 and functopt's mixed-precision step.

The model is sharded with ``fully_shard`` (FSDP2) and a
``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``: forward and backward run in bfloat16,
the sharded params and their gradients stay float32 DTensors. The optimizer is

    functopt.precision.mixed_precision(functopt.adamw(...), max_grad_norm=1.0)

applied to the sharded params as they are: AdamW's state is made of DTensors with the
params' placements (each rank holds the state of its shards), the elementwise maths runs on
the local shards, and the global gradient norm (for clipping) and the overflow check come
from one all-reduce of three packed numbers. The script checks and prints that count, and
compares the first sharded step with the same step computed in one piece on the gathered
params and gradients.

Run on CPUs (gloo) with

    torchrun --standalone --nproc-per-node 2 examples/fsdp2_train.py --quick

and unchanged on GPUs (nccl, one GPU per rank) with ``--nproc-per-node <number of GPUs>``.
Rank 0 prints the progress and a summary.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import functopt


class Block(torch.nn.Module):
    """A pre-norm residual MLP block, the feed-forward half of a transformer layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def make_model(width: int, depth: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[Block(width) for _ in range(depth)],
                               torch.nn.LayerNorm(width), torch.nn.Linear(width, 1))


def batch(step: int, rank: int, size: int, width: int, device: torch.device):
    """Synthetic regression data: a fixed random teacher, a different batch per rank."""
    teacher = torch.Generator().manual_seed(1234)
    w = torch.randn(width, 1, generator=teacher) / width**0.5
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(size, width, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.sin(3 * x[:, :1])
    return x.to(device), y.to(device)


def full(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if isinstance(x, DTensor) else x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--quick", action="store_true", help="30 steps of a small model (CI)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.width, args.depth, args.batch = 30, 32, 2, 16

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(1)  # several ranks share the CPU cores
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)  # the same initial model on every rank
    model = make_model(args.width, args.depth).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, Block):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)

    opt = functopt.precision.mixed_precision(
        functopt.adamw(args.lr, weight_decay=0.01), max_grad_norm=1.0)
    params = {n: p.detach() for n, p in model.named_parameters()}
    state = opt.init(params)

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    n_params = sum(p.numel() for p in params.values())
    log(f"world {world} ({'nccl' if cuda else 'gloo'}, {device.type}), {n_params} params, "
        f"{args.steps} steps, bfloat16 compute, float32 sharded params")
    losses, max_comms, max_diff = [], 0, None
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = batch(step, rank, args.batch, args.width, device)
        loss = (model(x).float() - y).square().mean()
        loss.backward()  # FSDP2 reduce-scatters the averaged gradients into the shards
        params = {n: p.detach() for n, p in model.named_parameters()}
        grads = {n: p.grad for n, p in model.named_parameters()}
        if step == 0:  # the same step in one piece, on the gathered params and gradients
            full_params = {n: full(p) for n, p in params.items()}
            full_grads = {n: full(g) for n, g in grads.items()}
            ref_params, _ = opt.step(full_grads, opt.init(full_params), full_params)
        with CommDebugMode() as comm:
            new, state = opt.step(grads, state, params)
        max_comms = max(max_comms, comm.get_total_counts())
        if step == 0:
            max_diff = max(float(((full(new[n]) - ref_params[n]).abs()
                                  / ref_params[n].abs().clamp(min=1e-30)).max())
                           for n in new)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(new[n])
                p.grad = None
        # the mean loss over ranks, for printing only
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(float(mean_loss) / world)
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            log(f"step {step:4d}  loss {losses[-1]:.5f}  grad norm "
                f"{float(state.metrics.grad_norm):.4f}")
    elapsed = time.perf_counter() - start
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    # every rank must have taken the same decisions: compare the last global norm
    norms = [torch.zeros((), dtype=torch.float32, device=device) for _ in range(world)]
    dist.all_gather(norms, state.metrics.grad_norm.to(device))
    agree = all(torch.equal(n, norms[0]) for n in norms)
    log(f"loss {first:.5f} -> {last:.5f} (decreased: {last < first}) in {elapsed:.1f} s")
    log(f"collectives per optimizer step: {max_comms}")
    log(f"exactness: first sharded step vs the same step in one piece: max relative "
        f"difference {max_diff:.1e} (within 1e-6: {max_diff <= 1e-6}); ranks agree on the "
        f"global norm: {agree}")


def teardown() -> None:
    """Tear the process group down while the interpreter is fully alive.

    ``main`` has returned, so the model, its device mesh and the optimizer state (which
    hold references to the group) are gone; ``gc.collect`` frees any cycle among them. Then
    every rank leaves the last collective before any destroys the group. Left to
    interpreter shutdown, gloo's worker threads can outlive the objects they use and abort
    the rank ("terminate called without an active exception").
    """
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    teardown()
