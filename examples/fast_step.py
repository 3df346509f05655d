"""The fast path: functopt's AdamW step at torch.optim's fused speed, with explicit state.

Three copies of one MLP train on the same batches:

* ``torch.optim.AdamW(fused=True)``, the fastest optimizer PyTorch has on this device;
* ``functopt.fast.make_step(functopt.adamw(...), donate=True)``: the same step as a
  function of ``(grads, state, params)``; the planner's fused kernel updates the module's
  parameters and the explicit state in place;
* the pure path, ``adamw.update`` then ``apply_updates``: the reference, per leaf and out
  of place, which also works under ``torch.func``.

The fast path calls the same PyTorch kernel as ``fused=True`` on the same values, so its
parameters stay bitwise equal to torch's, step after step; the pure path rounds differently
at each step and drifts slowly (Adam magnifies rounding where gradients are tiny): it stays
within 1% of the distance the params moved. The script times the optimizer steps of the three side by side (medians) and
prints a verdict line. Run it with ``python examples/fast_step.py [--quick]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import functopt

LR, WD = 1e-3, 1e-2


def make_model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def grads_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's gradients of the batch loss, in its params' ``.grad``."""
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="a small model, 20 steps (CI)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.width, args.depth = 20, 128, 4

    torch.manual_seed(0)
    torch_model = make_model(args.width, args.depth)
    fast_model, pure_model = copy.deepcopy(torch_model), copy.deepcopy(torch_model)
    initial = [p.detach().clone() for p in torch_model.parameters()]
    n_params = sum(p.numel() for p in torch_model.parameters())

    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=LR, weight_decay=WD, fused=True)

    tx = functopt.adamw(LR, weight_decay=WD)
    fast_params = dict(fast_model.named_parameters())
    fast_state = tx.init(fast_params)
    fast_step = functopt.fast.make_step(tx, donate=True)

    pure_params = {k: p.detach().clone() for k, p in pure_model.named_parameters()}
    pure_state = tx.init(pure_params)

    times: dict[str, list[float]] = {"torch fused": [], "functopt fast": [], "functopt pure": []}
    bitwise = True
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(64, args.width, generator=gen)
        y = torch.sin(x[:, :1])

        grads_of(torch_model, x, y)
        start = time.perf_counter()
        torch_opt.step()
        times["torch fused"].append(time.perf_counter() - start)

        grads = grads_of(fast_model, x, y)
        start = time.perf_counter()
        with torch.no_grad():  # a training step: the kernel, in place
            fast_params, fast_state = fast_step(grads, fast_state, fast_params)
        times["functopt fast"].append(time.perf_counter() - start)

        with torch.no_grad():
            for name, p in pure_model.named_parameters():
                p.copy_(pure_params[name])
        grads = {k: g.clone() for k, g in grads_of(pure_model, x, y).items()}
        start = time.perf_counter()
        updates, pure_state = tx.update(grads, pure_state, pure_params)
        pure_params = functopt.apply_updates(pure_params, updates)
        times["functopt pure"].append(time.perf_counter() - start)

        bitwise &= all(torch.equal(a, b) for a, b in zip(
            torch_model.parameters(), fast_model.parameters(), strict=True))

    pure_diff = max(float((pure_params[k] - p.detach()).abs().max())
                    for k, p in torch_model.named_parameters())
    # Per step the two paths differ by float32 rounding; Adam divides by sqrt(v), which
    # magnifies such differences where gradients are tiny, so the trajectories drift apart
    # slowly. Compare with how far training moved the params.
    moved = max(float((p.detach() - p0).abs().max()) for p, p0 in zip(
        torch_model.parameters(), initial, strict=True))
    in_place = all(fast_params[k] is p for k, p in fast_model.named_parameters())
    warm = max(1, args.steps // 4)  # the first steps pay allocation and warm-up
    median = {k: statistics.median(v[warm:]) for k, v in times.items()}
    print(f"{n_params:,} float32 params in {len(fast_params)} tensors, {args.steps} AdamW steps")
    for name, t in median.items():
        print(f"  {name:14s} {1e3 * t:8.3f} ms/step  ({t / median['torch fused']:.2f}x torch fused)")
    print(f"functopt fast vs torch fused: params bitwise equal after every step: {bitwise}")
    print(f"functopt fast updated the module's own parameters in place: {in_place}")
    print(f"functopt pure vs torch fused: max |diff| {pure_diff:.2e}, "
          f"{pure_diff / moved:.1e} of the params' largest move ({moved:.2e})")
    fast_ok, pure_ok = bitwise and in_place, pure_diff < 1e-2 * moved
    print(f"verdict: fast path bitwise equal to torch: {fast_ok}; pure path agrees: {pure_ok}")
    if not (fast_ok and pure_ok):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
