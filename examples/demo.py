"""Train a small MLP with a functopt chain, the functional way.

The model's parameters live in a plain dict (from ``model.named_parameters()``); the loss is
computed with ``torch.func.functional_call`` and differentiated with ``torch.func``; the
optimizer is ``chain(clip_by_global_norm(1.0), adamw(...))`` and its state is a pytree of
tensors that this script holds and passes back every step. Nothing is updated in place.

Run it with ``make demo`` or ``python examples/demo.py [--steps N] [--out DIR] [--quick]``.
It prints a short summary and writes the loss curve to ``DIR/demo_loss.png``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed: the plot goes to a file

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.func import functional_call, grad_and_value
from tqdm import tqdm

import functopt

DEFAULT_STEPS = 600
QUICK_STEPS = 60


def make_data(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth 2-d regression problem with a little noise: y = sin(3 x0) + x1**2 / 2."""
    x = torch.rand(n, 2, generator=generator) * 4 - 2
    y = torch.sin(3 * x[:, :1]) + 0.5 * x[:, 1:] ** 2
    return x, y + 0.05 * torch.randn(n, 1, generator=generator)


def decay_mask(params: dict[str, torch.Tensor]) -> dict[str, bool]:
    """Weight decay on the weight matrices only, not on the biases."""
    return {name: p.ndim > 1 for name, p in params.items()}


def make_optimizer(learning_rate: float) -> functopt.GradientTransformation:
    return functopt.chain(
        functopt.clip_by_global_norm(1.0),
        functopt.adamw(learning_rate, b1=0.9, b2=0.999, weight_decay=1e-4, mask=decay_mask),
    )


def train(steps: int, batch_size: int = 128, learning_rate: float = 3e-3, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():  # seed the initialisation without touching the caller's RNG
        torch.manual_seed(seed)
        model = nn.Sequential(
            nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
        )
    # The params are plain tensors: torch.func differentiates with respect to them, and
    # functopt returns new ones each step. The module only supplies the forward computation.
    params = {name: p.detach() for name, p in model.named_parameters()}
    x_train, y_train = make_data(4096, generator)
    x_test, y_test = make_data(1024, generator)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.mean((functional_call(model, params, (x,)) - y) ** 2)

    optimizer = make_optimizer(learning_rate)
    opt_state = optimizer.init(params)
    grad_fn = grad_and_value(loss_fn)

    losses: list[float] = []
    start = time.perf_counter()
    bar = tqdm(range(steps), desc="training", unit="step", mininterval=0.2)
    for step in bar:
        idx = torch.randint(0, x_train.shape[0], (batch_size,), generator=generator)
        grads, loss = grad_fn(params, x_train[idx], y_train[idx])
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = functopt.apply_updates(params, updates)
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    bar.close()
    elapsed = time.perf_counter() - start

    with torch.no_grad():
        test_loss = loss_fn(params, x_test, y_test).item()
        baseline = torch.mean((y_test - y_test.mean()) ** 2).item()
    return {
        "losses": losses,
        "seconds": elapsed,
        "num_params": sum(p.numel() for p in params.values()),
        "test_loss": test_loss,
        "baseline": baseline,
        "opt_state": opt_state,
    }


def plot(losses: list[float], path: Path) -> None:
    half = max(1, len(losses) // 50)  # a centred moving average shows the trend without lag
    smooth = []
    for i in range(len(losses)):
        window = losses[max(0, i - half) : i + half + 1]
        smooth.append(sum(window) / len(window))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(losses, color="tab:blue", alpha=0.3, linewidth=1, label="mini-batch loss")
    ax.plot(smooth, color="tab:blue", linewidth=2, label=f"moving average ({2 * half + 1} steps)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("mean squared error")
    ax.set_title("functopt demo: MLP regression, chain(clip_by_global_norm(1.0), adamw(3e-3))")
    ax.title.set_fontsize(9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None,
                        help=f"training steps (default {DEFAULT_STEPS}; {QUICK_STEPS} with --quick)")
    parser.add_argument("--out", type=Path, default=Path("out"),
                        help="directory for demo_loss.png (default: out)")
    parser.add_argument("--quick", action="store_true", help="a few seconds' run, for CI")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    if steps < 1:
        parser.error(f"--steps must be at least 1, got {steps}")

    result = train(steps)
    losses = result["losses"]
    png = args.out / "demo_loss.png"
    plot(losses, png)

    state_leaves = [x for _, x in functopt.tree.leaves_with_path(result["opt_state"])]
    state_numel = sum(x.numel() for x in state_leaves if isinstance(x, torch.Tensor))
    k = max(1, min(10, len(losses) // 10))  # average a few steps: mini-batch losses are noisy
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print("functopt demo: 2-64-64-1 MLP, chain(clip_by_global_norm(1.0), adamw(3e-3))")
    print(f"  params:          {result['num_params']:,} in 6 tensors "
          f"(optimizer state: {state_numel:,} numbers in {len(state_leaves)} tensors)")
    print(f"  steps:           {steps} in {result['seconds']:.2f} s "
          f"({1e3 * result['seconds'] / steps:.2f} ms/step)")
    print(f"  first loss:      {first:.4f} (mean of the first {k} steps)")
    print(f"  last loss:       {last:.4f} (mean of the last {k} steps)")
    print(f"  test loss:       {result['test_loss']:.4f} "
          f"(predicting the mean: {result['baseline']:.4f})")
    print(f"  loss curve:      {png}")
    if not math.isfinite(last) or last >= first:
        raise SystemExit("the loss did not decrease: something is wrong")


if __name__ == "__main__":
    torch.set_num_threads(1)  # tensors this small gain nothing from intra-op threads
    main()
