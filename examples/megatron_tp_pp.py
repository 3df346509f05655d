"""Megatron-style tensor x pipeline parallelism on plain tensors, with the facade: a nan on
one rank skips every rank, a rank killed mid-save, the run resumed from the checkpoint
before.

Four ranks: two pipeline stages of two tensor-parallel ranks each (rank = 2 * stage + tp).
Each stage holds pre-norm MLP blocks written as Megatron writes them, with plain tensors
(no DTensor): the first linear column-parallel (each TP rank its rows of the weight), the
second row-parallel (its columns; the partial outputs summed over the TP group), the
LayerNorms and the embedding and head replicated over the TP group, and in each stage an
expert layer with one expert per TP rank (each rank's own weights; the experts' outputs
summed). Stage 0 sends its activations to stage 1 and receives their gradients back.

The optimizer is one ``functopt.MixedPrecisionOptimizer`` per rank over its stage's
bfloat16 params (float32 masters, a dynamic loss scale), with Megatron's groups: the
matrices, the biases and norms with ``wd_mult=0``, and the experts as an
``is_expert_parallel`` group with ``lr_mult=0.5``. ``process_group=WORLD`` sums the
gradient statistics over every stage and ``replicated=`` says how each param repeats
(the TP-replicated ones over their TP group, the slices and the experts each rank's own),
so the norm is the whole model's, every element counted once, and the overflow check is
every rank's: at ``--nan-at`` a nan in rank 3's expert gradient skips the step on all four.

Checkpoints go through ``functopt.save_rank_checkpoint`` (a folder per step,
each rank's file atomic, a completion record once all have written). Three runs:

    torchrun --standalone --nproc-per-node 4 examples/megatron_tp_pp.py --dir A
    torchrun --standalone --nproc-per-node 4 examples/megatron_tp_pp.py --dir B --kill-at 6
    torchrun --standalone --nproc-per-node 4 examples/megatron_tp_pp.py --dir B --resume A

The first trains ``--steps`` steps, saving after steps 3 and 6, and writes its losses to
``A``. The second is killed at the save of step 6: rank 1 dies (SIGKILL) while the others
write. The third loads the newest complete checkpoint (step 3: the save of step 6 has no
completion record), trains the steps after it and compares its losses with the first
run's: equal, bitwise (the same ranks, batches and order of sums). Rank 0 prints.

The same model in the data-parallel x TP layout (each rank both stages, the rows split over
two replicas of the TP pair, the gradients summed in float32 into ``.main_grad`` over the
DP group, the slices and experts declared replicated over it):

    torchrun --standalone --nproc-per-node 4 examples/megatron_tp_pp.py --dir D \
        --layout dp-tp --compare A

gives the norm by hand, the skip on every rank, and the first run's losses within
``TOLERANCE`` (the batch split changes the roundings).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import functopt
from functopt import load_rank_checkpoint, save_rank_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_tp_train import global_batch

VOCAB, WIDTH, SEQ, ROWS = 32, 16, 8, 8
TP, PP = 2, 2
# the dp-tp run against the tp-pp run: bfloat16 gradients of half the rows summed in
# float32, against those of all the rows (measured 3e-4; without the DP sum, 1.5e-2)
TOLERANCE = 2e-3


class _CopyToTP(torch.autograd.Function):
    """Identity forward; the gradient summed over the TP group (before column-parallel)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """The partial outputs summed over the TP group (after row-parallel); identity back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class Block(torch.nn.Module):
    """A pre-norm MLP block with Megatron's column- then row-parallel linears, and an
    expert layer: this TP rank's expert, the experts' outputs summed over the group."""

    def __init__(self, tp_group: Any, gen: torch.Generator, tp_rank: int) -> None:
        super().__init__()
        self.group = tp_group
        hidden = 4 * WIDTH // TP

        def param(*shape: int, scale: float = 0.2) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(*shape, generator=gen) * scale)

        self.norm = torch.nn.LayerNorm(WIDTH)
        # the whole matrices drawn on every rank alike, this rank's slice kept
        up, down = param(4 * WIDTH, WIDTH), param(WIDTH, 4 * WIDTH)
        self.up_w = torch.nn.Parameter(up.detach()[tp_rank * hidden:(tp_rank + 1) * hidden])
        self.up_b = torch.nn.Parameter(torch.zeros(hidden))
        self.down_w = torch.nn.Parameter(
            down.detach()[:, tp_rank * hidden:(tp_rank + 1) * hidden].clone())
        self.down_b = torch.nn.Parameter(torch.zeros(WIDTH))
        experts = [param(WIDTH, WIDTH, scale=0.05) for _ in range(TP)]
        self.expert_w = torch.nn.Parameter(experts[tp_rank].detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _CopyToTP.apply(self.norm(x), self.group)
        h = torch.nn.functional.gelu(h @ self.up_w.T + self.up_b)
        x = x + _ReduceFromTP.apply(h @ self.down_w.T, self.group) + self.down_b
        e = _CopyToTP.apply(x, self.group) @ self.expert_w.T
        return x + _ReduceFromTP.apply(e, self.group)


class Stage(torch.nn.Module):
    """Stage 0: embedding and a block; stage 1: a block, the final norm and the head."""

    def __init__(self, stage: int, tp_group: Any, tp_rank: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(100 + stage)
        self.stage = stage
        if stage == 0:
            self.embed = torch.nn.Embedding(VOCAB, WIDTH)
            with torch.no_grad():
                self.embed.weight.copy_(torch.randn(VOCAB, WIDTH, generator=gen))
        self.block = Block(tp_group, gen, tp_rank)
        if stage == 1:
            self.norm = torch.nn.LayerNorm(WIDTH)
            self.head = torch.nn.Linear(WIDTH, VOCAB)
            with torch.no_grad():
                self.head.weight.copy_(torch.randn(VOCAB, WIDTH, generator=gen) * 0.2)
                self.head.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stage == 0:
            x = self.embed(x)
        x = self.block(x)
        return self.head(self.norm(x)) if self.stage == 1 else x


class Whole(torch.nn.Sequential):
    """Both stages on one rank (the data-parallel x TP layout), the same params as theirs."""

    def __init__(self, tp_group: Any, tp_rank: int) -> None:
        super().__init__(*(Stage(stage, tp_group, tp_rank) for stage in range(PP)))


def batch(step: int) -> torch.Tensor:
    """The token sequences of ``step`` (the rule of the FSDP x TP example's data)."""
    return global_batch(step, ROWS, SEQ, VOCAB)


def groups_of(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Megatron's groups: matrices; biases and norms without decay; the experts."""
    matrices, flat, experts = [], [], []
    for name, p in model.named_parameters():
        (experts if "expert" in name else flat if p.ndim == 1 else matrices).append((name, p))
    return [{"params": matrices},
            {"params": flat, "wd_mult": 0.0},
            {"params": experts, "is_expert_parallel": True, "lr_mult": 0.5}]


OWN = ("up_w", "up_b", "down_w", "expert_w")  # the TP slices and the experts


def replication(model: torch.nn.Module, own: Any, rest: Any) -> dict[str, Any]:
    """Each param's repetition over the ranks: ``own`` for the slices and experts (the
    params another TP rank holds other values of), ``rest`` for the others (norms,
    row-parallel biases, embedding, head: whole on every TP rank)."""
    return {name: (own if name.rsplit(".", 1)[-1] in OWN else rest)
            for name, _ in model.named_parameters()}


def train_step(model: Stage, opt: functopt.MixedPrecisionOptimizer, step: int, rank: int,
               nan_at: int | None) -> tuple[bool, float | None, float, float]:
    """One pipelined step (one micro-batch): ``(ok, grad norm, loss, the norm counted by
    hand)``, the loss on every rank (stage 1's, summed over the world)."""
    tokens = batch(step)
    peer = rank + TP if model.stage == 0 else rank - TP
    act_shape = (ROWS, SEQ, WIDTH)
    if model.stage == 0:
        out = model(tokens[:, :-1])
        dist.send(out.detach().float().contiguous(), peer)
        grad = torch.empty(act_shape)
        dist.recv(grad, peer)
        out.backward(grad.to(out.dtype))
        loss = torch.zeros(())
    else:
        received = torch.empty(act_shape)
        dist.recv(received, peer)
        x = received.to(torch.bfloat16).requires_grad_()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB),
                                                 tokens[:, 1:].reshape(-1))
        opt.backward(loss)
        assert x.grad is not None
        dist.send(x.grad.float().contiguous(), peer)
        loss = loss.detach()
    if step == nan_at and rank == 3:
        model.block.expert_w.grad[0, 0] = float("nan")  # one element of one rank's shard
    by_hand = reference_norm(model, opt, rank % TP, 0)
    ok, norm, _ = opt.step()
    opt.zero_grad()
    losses = torch.stack([loss.float(), torch.zeros(())])
    dist.all_reduce(losses)  # stage 1's two TP ranks hold the same loss: halve the sum
    return ok, norm, float(losses[0]) / TP, by_hand


def dp_tp_step(model: Whole, opt: functopt.MixedPrecisionOptimizer, step: int, rank: int,
               nan_at: int | None, dp_group: Any) -> tuple[bool, float | None, float, float]:
    """One data-parallel x TP step: this DP rank's half of the rows, the gradients summed
    in float32 over the DP group into ``.main_grad`` and averaged (as Megatron's DDP
    does), then the facade's step. Returns what ``train_step`` returns."""
    dp_rank, dp = rank // TP, dist.get_world_size(dp_group)
    rows = batch(step).chunk(dp)[dp_rank]
    logits = model(rows[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB),
                                             rows[:, 1:].reshape(-1))
    opt.backward(loss)
    if step == nan_at and rank == 3:
        model[1].block.expert_w.grad[0, 0] = float("nan")  # reaches its DP peer's too
    for p in model.parameters():
        assert p.grad is not None
        p.main_grad = p.grad.float()
        p.grad = None
        dist.all_reduce(p.main_grad, group=dp_group)
        p.main_grad /= dp
    by_hand = reference_norm(model, opt, rank % TP, dp_rank)
    ok, norm, _ = opt.step()
    opt.zero_grad()
    losses = loss.detach().reshape(1)
    dist.all_reduce(losses)  # each DP rank's loss on each of its TP ranks
    return ok, norm, float(losses[0]) / (TP * dp), by_hand


def reference_norm(model: torch.nn.Module, opt: functopt.MixedPrecisionOptimizer,
                   tp_rank: int, dp_rank: int) -> float:
    """The global norm by hand, squares summed over the world: each TP rank's slices and
    experts, the TP-replicated params on TP rank 0, on DP rank 0 only."""
    total = torch.zeros((), dtype=torch.float64)
    for name, p in model.named_parameters():
        grad = getattr(p, "main_grad", None)
        grad = p.grad if grad is None else grad
        counted = dp_rank == 0 and (tp_rank == 0 or name.rsplit(".", 1)[-1] in OWN)
        if grad is not None and counted:
            total += (grad.double() / opt.loss_scale).pow(2).sum()
    dist.all_reduce(total)
    return math.sqrt(float(total))


def compared(args: argparse.Namespace, losses: dict[int, float]) -> list[tuple[str, bool]]:
    """The verdicts on this run's losses against the runs named by --resume / --compare."""
    def read(run: str) -> dict[int, float]:
        return {int(k): v for k, v in json.loads((Path(run) / "losses.json").read_text()).items()}

    verdicts = []
    if args.resume is not None:
        theirs = read(args.resume)
        same = all(theirs[k] == v for k, v in losses.items())
        verdicts.append((f"losses of steps {min(losses)}-{max(losses)} equal the "
                         f"uninterrupted run's", same))
    if args.compare is not None:
        theirs = read(args.compare)
        gap = max(abs(v - theirs[k]) / theirs[k] for k, v in losses.items())
        verdicts.append((f"losses equal the TP x PP run's within {TOLERANCE:g} (largest "
                         f"relative difference {gap:.1e})", gap <= TOLERANCE))
    return verdicts


def built(layout: str, rank: int) -> tuple[Stage | Whole, Any, Any]:
    """This rank's model, its optimizer and its data-parallel group, for the layout."""
    outer, tp_rank = divmod(rank, TP)  # the stage (tp-pp) or the DP rank (dp-tp)
    tp_groups = [dist.new_group([s * TP + t for t in range(TP)]) for s in range(PP)]
    dp_groups = [dist.new_group([s * TP + t for s in range(PP)]) for t in range(TP)]
    tp_group, dp_group = tp_groups[outer], dp_groups[tp_rank]
    model: Stage | Whole
    if layout == "tp-pp":
        model = Stage(outer, tp_group, tp_rank).to(torch.bfloat16)
        replicated = replication(model, False, tp_group)
    else:  # the slices and experts repeat over the DP group, the rest on every rank
        model = Whole(tp_group, tp_rank).to(torch.bfloat16)
        replicated = replication(model, dp_group, True)
    opt = functopt.MixedPrecisionOptimizer(
        groups_of(model),
        lambda learning_rate=3e-2, weight_decay=0.1: functopt.adamw(
            learning_rate, weight_decay=weight_decay),
        loss_scale=functopt.dynamic_loss_scale(init_scale=2.0**12),
        return_grad_stats=True, process_group=dist.group.WORLD, replicated=replicated)
    opt.clip_grad_norm(None, 1.0)
    return model, opt, dp_group


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="checkpoints and losses")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-at", default="3,6")
    parser.add_argument("--nan-at", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=None,
                        help="rank 1 is killed at the save of this step")
    parser.add_argument("--resume", default=None,
                        help="the uninterrupted run's --dir: resume from --dir, compare")
    parser.add_argument("--layout", choices=("tp-pp", "dp-tp"), default="tp-pp",
                        help="dp-tp: both stages on every rank, the rows split over two "
                             "data-parallel replicas of the TP pair")
    parser.add_argument("--compare", default=None,
                        help="a tp-pp run's --dir whose losses a dp-tp run must match")
    return parser.parse_args()


def saved_at(step: int, model: torch.nn.Module, opt: Any, out: Path, killed: bool) -> None:
    """The checkpoint after ``step``; a ``killed`` rank dies while the others write."""
    if killed:
        os.kill(os.getpid(), signal.SIGKILL)
    save_rank_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict()},
                         out, step)
    if dist.get_rank() == 0:
        print(f"saved a checkpoint after step {step} on {dist.get_world_size()} ranks",
              flush=True)


def main() -> bool:
    args = arguments()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != TP * PP:
        raise SystemExit(f"run on {TP * PP} ranks (torchrun --nproc-per-node {TP * PP})")
    model, opt, dp_group = built(args.layout, rank)
    saves = {int(s) for s in args.save_at.split(",") if s}
    first = 0
    out = Path(args.dir)
    if args.resume is not None:
        done, saved = load_rank_checkpoint(out)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        first = done + 1
        if rank == 0:
            print(f"resumed after step {done}, the newest complete checkpoint", flush=True)
    losses: dict[int, float] = {}
    verdicts = []
    worst = 0.0  # the norms' largest relative difference from the hand count
    for step in range(first, args.steps):
        if isinstance(model, Whole):
            ok, norm, loss, by_hand = dp_tp_step(model, opt, step, rank, args.nan_at,
                                                 dp_group)
        else:
            ok, norm, loss, by_hand = train_step(model, opt, step, rank, args.nan_at)
        oks = torch.tensor([float(ok)])
        dist.all_reduce(oks)
        if step == args.nan_at:
            verdicts.append(("a nan on rank 3's shard skipped the step on every rank",
                             float(oks) == 0.0))
        elif norm is not None:
            worst = max(worst, abs(norm - by_hand) / by_hand)
        losses[step] = loss
        if rank == 0:
            shown = "skipped" if not ok else f"grad norm {norm:.6f}"
            print(f"step {step:2d}  loss {loss:.6f}  {shown}  loss scale {opt.loss_scale:g}",
                  flush=True)
        if step in saves:
            saved_at(step, model, opt, out, killed=step == args.kill_at and rank == 1)
    verdicts.append((f"the norm over every stage is the hand count's, each element once "
                     f"(largest relative difference {worst:.1e})", worst <= 1e-5))
    if rank == 0:
        verdicts += compared(args, losses)
    if args.resume is None and rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))
    for what, held in verdicts:
        if rank == 0:
            print(f"verdict: {what}: {held}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return all(held for _, held in verdicts)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
