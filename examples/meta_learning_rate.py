"""Learn the learning rate by differentiating through the optimizer with torch.func.

The inner problem is a linear regression trained for K steps of ``functopt.sgd(lr,
momentum=0.9)`` from the same start each time. The validation loss after those K steps is
a differentiable function of the learning rate, because functopt's transforms are pure
functions of tensors: ``torch.func.grad`` goes through every ``update`` and
``apply_updates``. The learning rate is ``lr = exp(log_lr)`` (a 0-d tensor, kept positive
by the log), and ``log_lr`` is trained by an outer ``functopt.adam``.

Run it with ``python examples/meta_learning_rate.py [--quick]``. It prints the learning
rate and the validation loss along the outer steps, checks the meta-gradient against
central finite differences once, and ends with a verdict line.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch.func import grad

import functopt

DTYPE = torch.float64  # float64 makes the finite-difference check sharp


def make_data(generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Train and validation sets of y = x @ w_true + 0.3 + noise, with features of different scales."""
    scales = torch.tensor([1.5, 1.0, 0.7, 0.5, 1.2, 1.0, 0.8, 0.6], dtype=DTYPE)
    w_true = torch.randn(8, generator=generator, dtype=DTYPE)

    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, 8, generator=generator, dtype=DTYPE) * scales
        return x, x @ w_true + 0.3 + 0.1 * torch.randn(n, generator=generator, dtype=DTYPE)

    return (*sample(64), *sample(64))


def mse(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.mean((x @ params["w"] + params["b"] - y) ** 2)


def validation_loss_after_training(log_lr: torch.Tensor, data: tuple[torch.Tensor, ...],
                                   inner_steps: int) -> torch.Tensor:
    """The validation loss after ``inner_steps`` of SGD with lr = exp(log_lr): a function
    of ``log_lr`` that torch.func can differentiate."""
    x_train, y_train, x_val, y_val = data
    params = {"w": torch.zeros(8, dtype=DTYPE), "b": torch.zeros((), dtype=DTYPE)}
    inner = functopt.sgd(learning_rate=torch.exp(log_lr), momentum=0.9)
    state = inner.init(params)
    for _ in range(inner_steps):
        grads = grad(mse)(params, x_train, y_train)
        updates, state = inner.update(grads, state, params)
        params = functopt.apply_updates(params, updates)
    return mse(params, x_val, y_val)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds' run, for CI")
    args = parser.parse_args(argv)
    outer_steps, inner_steps = (30, 10) if args.quick else (100, 20)

    data = make_data(torch.Generator().manual_seed(0))
    meta_loss = lambda log_lr: validation_loss_after_training(log_lr, data, inner_steps)  # noqa: E731
    meta_grad_fn = grad(meta_loss)

    meta_params = {"log_lr": torch.tensor(math.log(1e-3), dtype=DTYPE)}  # a too-small start
    outer = functopt.adam(learning_rate=0.1)
    outer_state = outer.init(meta_params)

    # The meta-gradient, once, against central finite differences.
    log_lr, h = meta_params["log_lr"], 1e-5
    autograd = meta_grad_fn(log_lr).item()
    finite_diff = ((meta_loss(log_lr + h) - meta_loss(log_lr - h)) / (2 * h)).item()
    rel_error = abs(autograd - finite_diff) / max(abs(finite_diff), 1e-30)

    print(f"meta-learning the learning rate of sgd(lr, momentum=0.9) through {inner_steps} "
          f"inner steps, with an outer adam(0.1) on log(lr)")
    print(f"{'outer step':>10}  {'lr':>10}  {'validation loss':>15}")
    first_loss = None
    for step in range(outer_steps + 1):
        log_lr = meta_params["log_lr"]
        loss = meta_loss(log_lr).item()
        first_loss = loss if first_loss is None else first_loss
        if step % max(1, outer_steps // 10) == 0 or step == outer_steps:
            print(f"{step:>10}  {math.exp(log_lr.item()):>10.5f}  {loss:>15.6f}")
        if step == outer_steps:
            break
        meta_grads = {"log_lr": meta_grad_fn(log_lr)}
        updates, outer_state = outer.update(meta_grads, outer_state, meta_params)
        meta_params = functopt.apply_updates(meta_params, updates)

    last_loss = loss
    print(f"meta-gradient check at lr=1e-3: autograd {autograd:.8e}, finite differences "
          f"{finite_diff:.8e}, relative error {rel_error:.2e}")
    print(f"learning rate: 0.001 -> {math.exp(meta_params['log_lr'].item()):.5f}")
    print(f"validation loss: {first_loss:.6f} -> {last_loss:.6f} "
          f"({first_loss / last_loss:.1f}x lower)")
    improved = math.isfinite(last_loss) and last_loss < first_loss
    grad_ok = rel_error < 1e-6
    print(f"verdict: validation loss improved: {improved}; meta-gradient matches finite "
          f"differences: {grad_ok}")
    if not (improved and grad_ok):
        raise SystemExit("the meta-learning example did not do what it claims")


if __name__ == "__main__":
    torch.set_num_threads(1)  # tensors this small gain nothing from intra-op threads
    main()
