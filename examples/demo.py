"""Train a small bfloat16 MLP with functopt's mixed-precision step, the functional way.

The model's parameters are bfloat16 tensors in a plain dict (from ``model.named_parameters()``);
the loss is computed with ``torch.func.functional_call``, multiplied by the loss scale with
``functopt.precision.scale_loss`` and differentiated with ``torch.func``. The optimizer is

    mixed_precision(adamw(...), loss_scale=dynamic_loss_scale(...), max_grad_norm=1.0)

which keeps a float32 master copy of every bfloat16 param, unscales the gradients, checks them
for overflow, clips them, runs AdamW on the master copy and writes each param as its master
rounded to bfloat16. Its state is a pytree of tensors that this script holds and passes back.
Two overflows are injected on purpose (the loss is multiplied by inf at two chosen steps):
those steps are skipped (params and optimizer state unchanged) and the loss scale backs off.

Run it with ``make demo`` or ``python examples/demo.py [--steps N] [--out DIR] [--quick]``.
It prints a short summary and writes the loss and the loss scale to ``DIR/demo_loss.png``.
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
from torch.func import functional_call, grad
from tqdm import tqdm

import functopt
from functopt.precision import scale_loss

DEFAULT_STEPS = 600
QUICK_STEPS = 60
DTYPE = torch.bfloat16
INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 50  # short, so that the scale visibly grows during the demo
OVERFLOW_FRACTIONS = (0.4, 0.7)  # where in the run the overflows are injected
MIN_STEPS_FOR_OVERFLOWS = 20  # shorter runs inject none (they could not show a recovery)


def make_data(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth 2-d regression problem with a little noise: y = sin(3 x0) + x1**2 / 2."""
    x = torch.rand(n, 2, generator=generator) * 4 - 2
    y = torch.sin(3 * x[:, :1]) + 0.5 * x[:, 1:] ** 2
    return x, y + 0.05 * torch.randn(n, 1, generator=generator)


def decay_mask(params: dict[str, torch.Tensor]) -> dict[str, bool]:
    """Weight decay on the weight matrices only, not on the biases."""
    return {name: p.ndim > 1 for name, p in params.items()}


def make_optimizer(learning_rate: float) -> functopt.precision.MixedPrecisionTransformation:
    return functopt.precision.mixed_precision(
        functopt.adamw(learning_rate, b1=0.9, b2=0.999, weight_decay=1e-4, mask=decay_mask),
        # PyTorch's GradScaler rule (hysteresis=1): halve on every overflow, double after
        # GROWTH_INTERVAL finite steps in a row.
        loss_scale=functopt.dynamic_loss_scale(init_scale=INIT_SCALE,
                                               growth_interval=GROWTH_INTERVAL),
        max_grad_norm=1.0,
    )


def overflow_steps(steps: int) -> list[int]:
    if steps < MIN_STEPS_FOR_OVERFLOWS:
        return []
    return sorted({round(f * steps) for f in OVERFLOW_FRACTIONS})


def tree_bytes(tree: object) -> int:
    leaves = [x for _, x in functopt.tree.leaves_with_path(tree)]
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor))


def train(steps: int, batch_size: int = 128, learning_rate: float = 3e-3, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():  # seed the initialisation without touching the caller's RNG
        torch.manual_seed(seed)
        model = nn.Sequential(
            nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
        ).to(DTYPE)
    # The params are plain bfloat16 tensors: torch.func differentiates with respect to them,
    # and the mixed-precision step returns new ones each step. The module only supplies the
    # forward computation.
    params = {name: p.detach() for name, p in model.named_parameters()}
    x_train, y_train = make_data(4096, generator)
    x_test, y_test = make_data(1024, generator)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        prediction = functional_call(model, params, (x.to(DTYPE),))
        return torch.mean((prediction.float() - y) ** 2)  # the loss itself in float32

    def scaled_loss_fn(params, x, y, opt_state, spike):
        loss = loss_fn(params, x, y)
        # The gradient is taken of the scaled loss (bfloat16 grads of loss * scale); the
        # step divides the scale out again. ``spike`` is 1, or inf to inject an overflow.
        return scale_loss(loss * spike, opt_state), loss

    optimizer = make_optimizer(learning_rate)
    opt_state = optimizer.init(params)
    grad_fn = grad(scaled_loss_fn, has_aux=True)
    inject = set(overflow_steps(steps))

    losses: list[float] = []
    scales: list[float] = []  # the loss scale used by each step
    skipped: list[int] = []
    events: list[str] = []
    start = time.perf_counter()
    bar = tqdm(range(steps), desc="training (bf16)", unit="step", mininterval=0.2)
    for step in bar:
        idx = torch.randint(0, x_train.shape[0], (batch_size,), generator=generator)
        spike = torch.tensor(math.inf if step in inject else 1.0)
        scale_before = opt_state.loss_scale.scale.item()
        grads, loss = grad_fn(params, x_train[idx], y_train[idx], opt_state, spike)
        old_params = params
        params, opt_state = optimizer.step(grads, opt_state, params)
        losses.append(loss.item())
        scales.append(scale_before)
        if opt_state.metrics.found_inf.item():
            skipped.append(step)
            unchanged = all(torch.equal(params[n], old_params[n]) for n in params)
            events.append(
                f"step {step}: {'injected ' if step in inject else ''}overflow (grads not "
                f"finite) -> step skipped, params unchanged bitwise: {unchanged}, loss scale "
                f"{scale_before:g} -> {opt_state.loss_scale.scale.item():g}"
            )
            bar.write("  " + events[-1])
        if step % 10 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.4f}", scale=f"{scales[-1]:g}")
    bar.close()
    elapsed = time.perf_counter() - start

    with torch.no_grad():
        test_loss = loss_fn(params, x_test, y_test).item()
        baseline = torch.mean((y_test - y_test.mean()) ** 2).item()
    return {
        "losses": losses,
        "scales": scales,
        "skipped": skipped,
        "injected": sorted(inject),
        "events": events,
        "seconds": elapsed,
        "params": params,
        "test_loss": test_loss,
        "baseline": baseline,
        "opt_state": opt_state,
    }


def exactness(params: dict[str, torch.Tensor], master: dict[str, torch.Tensor | None]) -> tuple[int, int]:
    """(elements equal bitwise to their master rounded to the param's dtype, elements)."""
    equal = total = 0
    for name, p in params.items():
        rounded = master[name].to(p.dtype) if master[name] is not None else p
        equal += int((p.view(torch.int16) == rounded.view(torch.int16)).sum())
        total += p.numel()
    return equal, total


def plot(losses: list[float], scales: list[float], skipped: list[int], path: Path) -> None:
    half = max(1, len(losses) // 50)  # a centred moving average shows the trend without lag
    smooth = []
    for i in range(len(losses)):
        window = losses[max(0, i - half) : i + half + 1]
        smooth.append(sum(window) / len(window))
    fig, (ax_loss, ax_scale) = plt.subplots(2, 1, figsize=(7, 6), dpi=120, sharex=True,
                                            gridspec_kw={"height_ratios": [3, 2]})
    ax_loss.plot(losses, color="tab:blue", alpha=0.3, linewidth=1, label="mini-batch loss")
    ax_loss.plot(smooth, color="tab:blue", linewidth=2,
                 label=f"moving average ({2 * half + 1} steps)")
    for i, step in enumerate(skipped):
        for ax in (ax_loss, ax_scale):
            ax.axvline(step, color="tab:red", linestyle="--", linewidth=1,
                       label="skipped step (overflow)" if i == 0 and ax is ax_loss else None)
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("mean squared error")
    ax_loss.set_title("functopt demo: bfloat16 MLP, mixed_precision(adamw(3e-3), "
                      "max_grad_norm=1.0)", fontsize=9)
    ax_loss.grid(True, which="both", alpha=0.3)
    ax_loss.legend(fontsize=8)

    ax_scale.step(range(len(scales)), scales, where="post", color="tab:green",
                  label="loss scale used by the step")
    ax_scale.plot(skipped, [scales[s] for s in skipped], "x", color="tab:red", markersize=8,
                  label="skipped: scale halved after it")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_title(f"dynamic_loss_scale(init_scale=2**10, growth_interval={GROWTH_INTERVAL})",
                       fontsize=9)
    ax_scale.set_xlabel("step")
    ax_scale.set_ylabel("loss scale")
    ax_scale.grid(True, which="both", alpha=0.3)
    ax_scale.legend(fontsize=8, loc="upper left")
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
    losses, params, state = result["losses"], result["params"], result["opt_state"]
    png = args.out / "demo_loss.png"
    plot(losses, result["scales"], result["skipped"], png)

    num_params = sum(p.numel() for p in params.values())
    master_bytes = tree_bytes(state.master)
    inner_bytes = tree_bytes(state.inner_state)
    state_bytes = tree_bytes(state)
    equal, total = exactness(params, state.master)
    k = max(1, min(10, len(losses) // 10))  # average a few steps: mini-batch losses are noisy
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    skipped = result["skipped"]
    print("functopt demo: bfloat16 2-64-64-1 MLP, mixed_precision(adamw(3e-3), "
          "dynamic_loss_scale(2**10, growth_interval=50), max_grad_norm=1.0)")
    print(f"  params:          {num_params:,} in {len(params)} tensors, "
          f"{', '.join(sorted({str(p.dtype) for p in params.values()}))}")
    print(f"  steps:           {steps} in {result['seconds']:.2f} s "
          f"({1e3 * result['seconds'] / steps:.2f} ms/step)")
    print(f"  first loss:      {first:.4f} (mean of the first {k} steps)")
    print(f"  last loss:       {last:.4f} (mean of the last {k} steps)")
    print(f"  test loss:       {result['test_loss']:.4f} "
          f"(predicting the mean: {result['baseline']:.4f})")
    print(f"  overflows:       injected at steps {result['injected'] or 'none'}")
    print(f"  skipped steps:   {len(skipped)} {skipped} "
          f"(the state counts {int(state.metrics.skipped_steps)})")
    print(f"  loss scale:      {INIT_SCALE:g} -> {state.loss_scale.scale.item():g} "
          f"(halved on each overflow, doubled after {GROWTH_INTERVAL} finite steps)")
    print(f"  state bytes:     {state_bytes / num_params:.2f} per param "
          f"(float32 master {master_bytes / num_params:.2f} + AdamW "
          f"{inner_bytes / num_params:.2f} + scalars), plus 2 for the bfloat16 param itself")
    print(f"  exact master:    {equal == total} (bf16 param == float32 master rounded to "
          f"bfloat16, bitwise, for {equal:,} of {total:,} elements)")
    print(f"  plot:            {png}")
    if not math.isfinite(last) or last >= first:
        raise SystemExit("the loss did not decrease: something is wrong")
    if equal != total or len(skipped) != len(result["injected"]):
        raise SystemExit("the mixed-precision step broke its promises: something is wrong")


if __name__ == "__main__":
    torch.set_num_threads(1)  # tensors this small gain nothing from intra-op threads
    main()
