"""Train an ensemble of small models at once: torch.func.vmap over functopt.adamw's update.

Each member is the same small MLP with its own initialisation and its own bootstrap sample
of the data. Their parameters are stacked along a new leading dimension; one training step
for one member (``grad``, ``adamw.update``, ``apply_updates``) is written as a pure
function, and ``torch.func.vmap`` runs it for all members at once. The optimizer state is
stacked the same way (``vmap(optimizer.init)``). Nothing in functopt knows about the
ensemble: its update is a pure function of tensors, so vmap batches it.

Run it with ``python examples/vmap_ensemble.py [--quick]``. It prints each member's loss,
the largest difference from training the members one by one in a Python loop, the speed
ratio between the two, and a verdict line.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, stack_module_state, vmap

import functopt


def make_data(members: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One bootstrap sample of a 1-d regression problem per member: (members, n, 1) each."""
    x = torch.rand(256, 1, generator=generator) * 6 - 3
    y = torch.sin(x) + 0.1 * torch.randn(256, 1, generator=generator)
    idx = torch.randint(0, 256, (members, 256), generator=generator)
    return x[idx], y[idx]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds' run, for CI")
    args = parser.parse_args(argv)
    members, steps = (8, 40) if args.quick else (16, 300)

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 1))
              for _ in range(members)]
    # Stacked params: {name: tensor of shape (members, *param.shape)}.
    stacked, _ = stack_module_state(models)
    stacked = {name: p.detach() for name, p in stacked.items()}
    base = models[0]  # supplies the forward computation only
    x, y = make_data(members, torch.Generator().manual_seed(1))

    optimizer = functopt.adamw(learning_rate=1e-2, weight_decay=1e-4)

    def loss_fn(params, x, y):
        return torch.mean((functional_call(base, params, (x,)) - y) ** 2)

    def train_step(params, state, x, y):
        """One step for one member; vmap runs it for all of them."""
        grads, loss = grad_and_value(loss_fn)(params, x, y)
        updates, state = optimizer.update(grads, state, params)
        return functopt.apply_updates(params, updates), state, loss

    ensemble_step = vmap(train_step)

    # All members at once.
    params, state = stacked, vmap(optimizer.init)(stacked)
    ensemble_step(params, state, x, y)  # warm-up: the timings below measure steps only
    start = time.perf_counter()
    losses = []
    for _ in range(steps):
        params, state, loss = ensemble_step(params, state, x, y)  # loss: shape (members,)
        losses.append(loss)
    vmap_seconds = time.perf_counter() - start
    final_losses = vmap(loss_fn)(params, x, y)

    # The same training, one member after the other.
    start = time.perf_counter()
    loop_params = []
    for i in range(members):
        p_i = {name: p[i] for name, p in stacked.items()}
        s_i = optimizer.init(p_i)
        for _ in range(steps):
            p_i, s_i, _loss = train_step(p_i, s_i, x[i], y[i])
        loop_params.append(p_i)
    loop_seconds = time.perf_counter() - start
    max_diff = max((params[name][i] - loop_params[i][name]).abs().max().item()
                   for i in range(members) for name in params)

    print(f"ensemble of {members} MLPs (1-32-1), {steps} steps of adamw(1e-2) each, "
          f"trained with vmap(train_step)")
    print(f"{'member':>6}  {'first loss':>10}  {'final loss':>10}")
    for i in range(members):
        print(f"{i:>6}  {losses[0][i].item():>10.4f}  {final_losses[i].item():>10.4f}")
    print(f"vmap vs a loop over members: max abs difference of the params {max_diff:.3e}")
    print(f"time: vmap {vmap_seconds:.3f} s, loop {loop_seconds:.3f} s, "
          f"speed ratio {loop_seconds / vmap_seconds:.1f}x")
    trained = bool((final_losses < 0.5 * losses[0]).all())
    equal = max_diff < 1e-4  # float32 rounding: vmap batches the same maths differently
    print(f"verdict: every member trained: {trained}; vmap equals the loop: {equal}")
    if not (trained and equal):
        raise SystemExit("the ensemble example did not do what it claims")


if __name__ == "__main__":
    torch.set_num_threads(1)  # a fair comparison: one thread for both
    main()
