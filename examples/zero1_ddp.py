"""Train a DDP model with ZeRO-1: the optimizer state sharded over the data-parallel ranks.

``DistributedDataParallel`` all-reduces the gradients, so every rank holds all params and
the same averaged gradients; ``functopt.distributed.zero1`` keeps on each of the N ranks
only the float32 master and the AdamW moments of its 1/N slice of every param, updates
that slice and all-gathers the new bfloat16 params: one all-reduce (the packed gradient
statistics: norm, overflow, zero count) and one all-gather per step.

The script trains twice from the same start: with ``zero1`` (the all-gather blocks the
step) and with ``zero1_overlapped`` (the step returns with the all-gathers in flight, one
per bucket, and each layer's forward waits for its own params through a pre-forward
hook). It checks that both give the same params bitwise, that the first step equals the
unsharded ``mixed_precision`` step, the state bytes per rank, and prints the time of
(optimizer step + next forward) for both.

    torchrun --standalone --nproc-per-node 2 examples/zero1_ddp.py --quick

Rank 0 prints the progress and the verdict lines.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel

import functopt
from functopt.distributed import zero1, zero1_overlapped


def make_model(width: int, depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def batch(step: int, rank: int, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data: a fixed random teacher, a different batch per rank."""
    w = torch.randn(width, 1, generator=torch.Generator().manual_seed(1234)) / width**0.5
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(10_000 * step + rank))
    return x.to(torch.bfloat16), torch.tanh(x @ w).to(torch.bfloat16)


def state_bytes(state: Any) -> int:
    return sum(x.numel() * x.element_size() for x in functopt.tree._core.flatten(state)[0]
               if isinstance(x, torch.Tensor) and x.dim() > 0)


def train(args: argparse.Namespace, overlapped: bool) -> dict[str, Any]:
    """Train ``args.steps`` steps; the params after each step, timings and counts."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    model = DistributedDataParallel(make_model(args.width, args.depth).to(torch.bfloat16))
    inner = functopt.adamw(args.lr, weight_decay=0.01)
    opt: Any = (zero1_overlapped(inner, max_grad_norm=1.0, bucket_bytes=args.bucket_bytes)
                if overlapped else zero1(inner, max_grad_norm=1.0))
    params = {n: p.detach() for n, p in model.module.named_parameters()}
    state = opt.init(params)
    out: dict[str, Any] = {"params": [], "losses": [], "seconds": 0.0, "comms": set(),
                           "state_bytes": state_bytes(state)}
    timed_from = min(2, args.steps - 1)  # the first steps warm up
    tick = None
    for step in range(args.steps):
        x, y = batch(step, rank, args.rows, args.width)
        loss = (model(x).float() - y.float()).square().mean()  # waits for pending params
        if tick is not None and step > timed_from:
            out["seconds"] += time.perf_counter() - tick
        loss.backward()  # DDP all-reduces (averages) the gradients
        grads = {n: p.grad for n, p in model.module.named_parameters()}
        if step == 0:
            out["grads0"] = {n: g.clone() for n, g in grads.items()}
        tick = time.perf_counter()
        with CommDebugMode() as comm:
            new, state = opt.step(grads, state, params)
        out["comms"].add(tuple(sorted((str(k).split(".")[-1], v)
                                      for k, v in comm.get_comm_counts().items())))
        if overlapped:
            new.attach(model.module)  # the next forward copies the params in, layer by layer
        else:
            with torch.no_grad():
                for n, p in model.module.named_parameters():
                    p.copy_(new[n])
        for p in model.module.parameters():
            p.grad = None
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out["losses"].append(float(mean) / world)
        if not overlapped or step == args.steps - 1:  # the overlapped run records the end
            finished = new.wait() if overlapped else new
            out["params"].append({n: v.clone() for n, v in finished.items()})
        if rank == 0 and (step % max(1, args.steps // 5) == 0 or step == args.steps - 1):
            print(f"  step {step:3d}  loss {out['losses'][-1]:.5f}", flush=True)
    out["timed_steps"] = args.steps - 1 - timed_from
    return out


def main() -> bool:
    """Both runs and the comparisons; rank 0 returns the verdict, the others True."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rows", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bucket-bytes", type=int, default=1 << 16)
    parser.add_argument("--quick", action="store_true", help="12 steps of a small model (CI)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.width, args.depth = 12, 256, 3
    torch.set_num_threads(1)  # several ranks share the CPU cores
    dist.init_process_group("gloo")  # CPU tensors here; with GPUs: nccl and .cuda()
    rank, world = dist.get_rank(), dist.get_world_size()

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    n = sum(p.numel() for p in make_model(args.width, args.depth).parameters())
    log(f"world {world} (gloo, cpu), DDP, {n} params in bfloat16, {args.steps} steps")
    log("zero1 (blocking all-gather):")
    blocking = train(args, overlapped=False)
    log("zero1_overlapped (all-gathers in flight until each layer's forward):")
    overlapped = train(args, overlapped=True)

    # the first step against the unsharded mixed-precision step on the same gradients
    torch.manual_seed(0)
    start = {k: p.detach() for k, p in make_model(args.width, args.depth)
             .to(torch.bfloat16).named_parameters()}
    ref = functopt.precision.mixed_precision(functopt.adamw(args.lr, weight_decay=0.01),
                                             max_grad_norm=1.0)
    ref_state = ref.init(start)
    ref_params, _ = ref.step(blocking["grads0"], ref_state, start)
    first = blocking["params"][0]
    # bfloat16 params: equal, or one bfloat16 step apart where the masters (which agree to
    # the clip factor's last bits) straddle a rounding boundary
    off = max(float(((first[k].float() - ref_params[k].float()).abs()
                     / ref_params[k].float().abs().clamp(min=1e-30)).max()) for k in first)
    same = all(torch.equal(a, b) for a, b in zip(blocking["params"][-1].values(),
                                                  overlapped["params"][-1].values(), strict=True))
    log(f"collectives per optimizer step: zero1 {sorted(blocking['comms'])}, "
        f"zero1_overlapped {sorted(overlapped['comms'])}")
    log(f"optimizer state per rank: {blocking['state_bytes']} bytes, unsharded "
        f"{state_bytes(ref_state)} bytes ({blocking['state_bytes'] / state_bytes(ref_state):.3f})")
    log(f"first step vs unsharded mixed_precision: max relative difference {off:.1e} "
        f"(within 2**-7: {off <= 2.0**-7})")
    log(f"overlapped params bitwise the blocking run's after {args.steps} steps: {same}")
    per = lambda r: 1e3 * r["seconds"] / r["timed_steps"]  # noqa: E731
    log(f"optimizer step + next forward: blocking {per(blocking):.2f} ms, overlapped "
        f"{per(overlapped):.2f} ms per step (mean of {blocking['timed_steps']} steps)")
    b, o = blocking["losses"], overlapped["losses"]
    log(f"loss {b[0]:.5f} -> {b[-1]:.5f} (decreased: {b[-1] < b[0]}); overlapped run "
        f"{o[0]:.5f} -> {o[-1]:.5f}")
    two = {(("allgather_into_tensor_coalesced_", 1), ("allreduce_", 1))}
    ok = same and off <= 2.0**-7 and blocking["comms"] == two and b[-1] < b[0]
    log(f"verdict: zero1 trains with 2 collectives per step, overlapped equals it bitwise: {ok}")
    return ok or rank != 0


def teardown() -> None:
    """Tear the process group down while the interpreter is fully alive (see
    examples/fsdp2_train.py)."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    verdict = main()
    teardown()
    sys.exit(0 if verdict else 1)
