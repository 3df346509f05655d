"""Replace torch.optim in an existing training loop: a 2-line diff, or the functional way.

Loop A is ordinary PyTorch: ``torch.optim.AdamW``, a ``torch.amp.GradScaler`` and a
``CosineAnnealingLR`` scheduler. Loop B is the same function with the optimizer built by

    import functopt
    opt = functopt.Optimizer(model.parameters(),
                             functopt.inject_hyperparams(functopt.adamw)(learning_rate=LR,
                                                                          weight_decay=WD))

(``inject_hyperparams`` puts the learning rate in ``param_groups[0]["lr"]``, where the
scheduler finds it; GradScaler and the scheduler are unchanged). Loop C is the functional
version: ``functopt.precision.mixed_precision`` does the loss scaling, the overflow check
and the step, with the cosine schedule given to ``adamw`` directly.

On CPU in float32 the loss scale is a power of two, so scaling and unscaling are exact and
the three loss curves agree to float32 rounding. Run it with
``python examples/replace_torch_optim.py [--quick]``; it prints the curves' largest
difference and a verdict line.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn
from torch.func import functional_call, grad

import functopt
from functopt.precision import mixed_precision, scale_loss

LR, WD, INIT_SCALE = 1e-2, 1e-2, 2.0**16


def train_torch(model, make_optimizer, x, y, steps):
    """The existing loop. Only the optimizer it is given changes between A and B."""
    opt = make_optimizer(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.mean((model(x) - y) ** 2)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scheduler.step()
        losses.append(loss.item())
    return losses


def torch_adamw(model):  # loop A
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)


def functopt_adamw(model):  # loop B: the drop-in
    return functopt.Optimizer(model.parameters(),
                              functopt.inject_hyperparams(functopt.adamw)(learning_rate=LR,
                                                                           weight_decay=WD))


def train_functional(model, x, y, steps):
    """Loop C: params in, params out; the loss scale lives in the optimizer state."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    schedule = functopt.schedules.cosine_decay_schedule(init_value=LR, decay_steps=steps)
    opt = mixed_precision(functopt.adamw(learning_rate=schedule, weight_decay=WD),
                          loss_scale=functopt.dynamic_loss_scale(init_scale=INIT_SCALE))
    state = opt.init(params)

    def scaled_loss(params, state):
        loss = torch.mean((functional_call(model, params, (x,)) - y) ** 2)
        return scale_loss(loss, state), loss

    losses = []
    for _ in range(steps):
        grads, loss = grad(scaled_loss, has_aux=True)(params, state)
        params, state = opt.step(grads, state, params)
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds' run, for CI")
    args = parser.parse_args(argv)
    steps = 60 if args.quick else 300

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=generator)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))

    curves = {
        "A torch.optim.AdamW + GradScaler + CosineAnnealingLR":
            train_torch(copy.deepcopy(model), torch_adamw, x, y, steps),
        "B functopt.Optimizer(inject_hyperparams(adamw)), same loop":
            train_torch(copy.deepcopy(model), functopt_adamw, x, y, steps),
        "C mixed_precision(adamw(cosine_decay_schedule))":
            train_functional(copy.deepcopy(model), x, y, steps),
    }
    reference = curves["A torch.optim.AdamW + GradScaler + CosineAnnealingLR"]
    print(f"{steps} steps of AdamW(lr={LR}, weight_decay={WD}) with a cosine schedule, "
          f"loss scale {INIT_SCALE:g}, CPU float32")
    print("the diff from loop A to loop B:")
    print("  + import functopt")
    print("  - torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)")
    print("  + functopt.Optimizer(model.parameters(), functopt.inject_hyperparams("
          "functopt.adamw)(learning_rate=LR, weight_decay=WD))")
    max_diff = 0.0
    for name, losses in curves.items():
        diff = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
        max_diff = max(max_diff, diff)
        print(f"  {name:<58} loss {losses[0]:.6f} -> {losses[-1]:.6f}, "
              f"max |diff| from A {diff:.2e}")
    agree = max_diff < 1e-5
    trained = reference[-1] < 0.5 * reference[0]
    print(f"the three loss curves: max difference {max_diff:.2e}")
    print(f"verdict: the loss curves agree: {agree}; the model trained: {trained}")
    if not (agree and trained):
        raise SystemExit("the three loops disagree: something is wrong")


if __name__ == "__main__":
    torch.set_num_threads(1)  # tensors this small gain nothing from intra-op threads
    main()
