"""Port an optax optimizer to functopt by changing the import.

The optax code below (JAX, not run here) builds AdamW by hand: clip the gradients by their
global norm, scale them by Adam, add weight decay to the weight matrices only (a mask), and
scale by a warmup-then-cosine learning-rate schedule. The functopt version is the same code
with ``optax`` replaced by ``functopt``, ``jax.tree.map`` by ``functopt.tree.map`` and
``jax.grad`` by ``torch.func.grad``; the schedule lives in ``functopt.schedules``.

    # JAX + optax
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=3e-2, warmup_steps=20, decay_steps=STEPS, end_value=1e-3)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.scale_by_adam(b1=0.9, b2=0.999),
        optax.add_decayed_weights(1e-4, mask=decay_mask),
        optax.scale_by_learning_rate(schedule),
    )
    state = tx.init(params)
    for x, y in batches:
        grads = jax.grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)

Run it with ``python examples/port_optax.py [--quick]``. It prints the name mapping (each
functopt name is looked up, not just printed), trains a small classifier with the port and
ends with a verdict line.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.func import functional_call, grad

import functopt

# optax name -> functopt name, for everything the optax code above uses.
MAPPING = {
    "optax.chain": "functopt.chain",
    "optax.clip_by_global_norm": "functopt.clip_by_global_norm",
    "optax.scale_by_adam": "functopt.scale_by_adam",
    "optax.add_decayed_weights": "functopt.add_decayed_weights",
    "optax.scale_by_learning_rate": "functopt.scale_by_learning_rate",
    "optax.warmup_cosine_decay_schedule": "functopt.schedules.warmup_cosine_decay_schedule",
    "optax.apply_updates": "functopt.apply_updates",
    "jax.tree.map": "functopt.tree.map",
    "jax.grad": "torch.func.grad",
}


def lookup(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    root = {"functopt": functopt, "torch": torch}[module.split(".")[0]]
    for part in module.split(".")[1:]:
        root = getattr(root, part)
    return getattr(root, name)


def make_data(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two interleaved half-moons: 2-d points, labels 0 and 1."""
    t = torch.rand(512, generator=generator) * torch.pi
    label = torch.randint(0, 2, (512,), generator=generator)
    x = torch.stack([torch.cos(t) + label, torch.sin(t) * (1 - 2 * label) + 0.5 * label], dim=1)
    return x + 0.1 * torch.randn(512, 2, generator=generator), label


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds' run, for CI")
    args = parser.parse_args(argv)
    steps = 150 if args.quick else 600

    print("optax -> functopt")
    for optax_name, functopt_name in MAPPING.items():
        lookup(functopt_name)  # fails loudly if the port named something that does not exist
        print(f"  {optax_name:<36} -> {functopt_name}")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 2))
    params = {name: p.detach() for name, p in model.named_parameters()}
    x, y = make_data(torch.Generator().manual_seed(0))

    def loss_fn(params, x, y):
        return nn.functional.cross_entropy(functional_call(model, params, (x,)), y)

    # --- the port: the optax code with `optax` replaced by `functopt` ---
    schedule = functopt.schedules.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=3e-2, warmup_steps=20, decay_steps=steps, end_value=1e-3)
    decay_mask = lambda params: functopt.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731
    tx = functopt.chain(
        functopt.clip_by_global_norm(1.0),
        functopt.scale_by_adam(b1=0.9, b2=0.999),
        functopt.add_decayed_weights(1e-4, mask=decay_mask),
        functopt.scale_by_learning_rate(schedule),
    )
    state = tx.init(params)
    losses = []
    for _ in range(steps):
        losses.append(loss_fn(params, x, y).item())
        grads = grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        params = functopt.apply_updates(params, updates)
    # --- end of the port ---

    final_loss = loss_fn(params, x, y).item()
    accuracy = (functional_call(model, params, (x,)).argmax(dim=1) == y).float().mean().item()
    print(f"decay mask: {decay_mask(params)}")
    lrs = ", ".join(f"{t}: {float(schedule(t)):.4f}"
                    for t in (0, 10, 20, steps // 2, steps - 1))
    print(f"learning rate by step: {lrs}")
    print(f"Adam step count in the state: {int(state[1].count)}")
    print(f"loss: {losses[0]:.4f} -> {final_loss:.4f}; training accuracy {accuracy:.1%}")
    ok = final_loss < 0.5 * losses[0] and accuracy > 0.9
    print(f"verdict: the port trains: {ok}")
    if not ok:
        raise SystemExit("the port did not train: something is wrong")


if __name__ == "__main__":
    torch.set_num_threads(1)  # tensors this small gain nothing from intra-op threads
    main()
