"""Compare functopt.contrib's research optimizers with AdamW on one small regression task.

Every optimizer trains the same MLP (2 -> 64 -> 64 -> 1, tanh) from the same initial
params on the same full-batch data (y = sin(3 x0) + x1**2 / 2, plus noise), for the same
number of steps, with the hyperparameters listed in ``OPTIMIZERS``. Each step is the
functional loop: gradients with ``torch.func.grad``, then ``update`` and ``apply_updates``.
The schedule-free optimizer is evaluated where it should be, at
``schedule_free_eval_params(state, params)``.

Run it with ``python examples/contrib_compare.py [--steps N] [--out DIR] [--quick]``. It
prints each optimizer's first and last loss and writes the loss curves to
``DIR/contrib_compare.png`` (default ``out/``). The verdict: every optimizer reached a
loss below half the initial one, and every loss is finite.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display needed: the plot goes to a file

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.func import functional_call, grad

import functopt
from functopt import contrib

DEFAULT_STEPS = 300
QUICK_STEPS = 60

def torch_linear_layout(params: dict[str, Any]) -> dict[str, Any]:
    """Muon's dimension numbers for torch's ``nn.Linear`` weights, which are (out, in).

    optax's default reads a matrix as (in, out) (``x @ W``, fan-in first); for torch's layout
    the reduction axis is 1. It matters for the shape factor sqrt(max(1, fan_out / fan_in)):
    read the wrong way round, the 1 x 64 output layer would get 8 times its step.
    """
    return {k: contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=0)
            if v is not None and v.dim() == 2 else None for k, v in params.items()}


# name -> a zero-argument factory; learning rates are each optimizer's usual scale for this
# problem, none tuned beyond one try (Prodigy and D-Adaptation take their defaults: they
# estimate the step size themselves).
OPTIMIZERS: dict[str, Callable[[], functopt.GradientTransformation]] = {
    "adamw": lambda: functopt.adamw(1e-2, weight_decay=1e-4),
    "muon": lambda: contrib.muon(0.02, adam_learning_rate=1e-2,
                                 muon_weight_dimension_numbers=torch_linear_layout),
    "schedule_free_adamw": lambda: contrib.schedule_free_adamw(1e-2, warmup_steps=10),
    "adopt": lambda: contrib.adopt(1e-2),
    "ademamix": lambda: contrib.ademamix(1e-2, b3=0.999, alpha=2.0),
    "prodigy": lambda: contrib.prodigy(),
    "dadapt_adamw": lambda: contrib.dadapt_adamw(),
    "madgrad": lambda: contrib.madgrad(1e-2),
}


def make_data(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.rand(n, 2, generator=generator) * 4 - 2
    y = torch.sin(3 * x[:, :1]) + 0.5 * x[:, 1:] ** 2
    return x, y + 0.05 * torch.randn(n, 1, generator=generator)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 1))


def train(name: str, model: nn.Module, params0: dict[str, torch.Tensor], x: torch.Tensor,
          y: torch.Tensor, steps: int) -> list[float]:
    """The loss before each step and after the last (at the eval params for schedule-free)."""

    def loss_fn(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.mean((functional_call(model, params, (x,)) - y) ** 2)

    grad_fn = grad(loss_fn)
    opt = OPTIMIZERS[name]()
    params = {k: v.clone() for k, v in params0.items()}
    state = opt.init(params)

    def evaluated(params: dict[str, torch.Tensor], state: Any) -> float:
        if name.startswith("schedule_free"):
            params = contrib.schedule_free_eval_params(state, params)
        return float(loss_fn(params))

    losses = [evaluated(params, state)]
    for _ in range(steps):
        updates, state = opt.update(grad_fn(params), state, params)
        params = functopt.apply_updates(params, updates)
        losses.append(evaluated(params, state))
    return losses


def plot(curves: dict[str, list[float]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, losses in curves.items():
        ax.plot(losses, label=name, linewidth=2.0 if name == "adamw" else 1.3,
                color="black" if name == "adamw" else None)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (MSE, full batch)")
    ax.set_title("functopt.contrib optimizers vs AdamW, 2-64-64-1 tanh MLP")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_STEPS} steps (what the test suite runs)")
    args = parser.parse_args()
    steps = QUICK_STEPS if args.quick else args.steps
    torch.manual_seed(0)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    x, y = make_data(256, generator)
    model = make_model()
    params0 = {k: v.detach().clone() for k, v in model.named_parameters()}

    print(f"steps:           {steps}")
    matrices = [k for k, v in params0.items() if v.dim() == 2]
    print(f"params:          {sum(p.numel() for p in params0.values()):,} in "
          f"{len(params0)} tensors; muon orthogonalises the {len(matrices)} matrices "
          f"({', '.join(matrices)}) and gives the {len(params0) - len(matrices)} biases to AdamW")
    curves: dict[str, list[float]] = {}
    for name in OPTIMIZERS:
        start = time.perf_counter()
        curves[name] = train(name, model, params0, x, y, steps)
        seconds = time.perf_counter() - start
        print(f"{name:20s} first loss {curves[name][0]:.4f}  last loss {curves[name][-1]:.4f}"
              f"  ({1e3 * seconds / steps:.1f} ms/step)")
    path = args.out / "contrib_compare.png"
    plot(curves, path)
    print(f"plot:            {path}")
    ok = all(all(math.isfinite(v) for v in c) and c[-1] < 0.5 * c[0] for c in curves.values())
    print(f"verdict: {'every optimizer halved the loss' if ok else 'FAILED'}: {ok}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
