"""The shortest complete use of functopt: init, update, apply_updates.

Minimises ``f(w) = sum((w - target) ** 2)`` with Adam. The optimizer is a pair of pure
functions (``functopt.adam`` is ``chain(scale_by_adam(), scale_by_learning_rate(lr))``);
its state is a pytree of tensors that you hold.
"""

import torch

import functopt

target = torch.tensor([1.0, -2.0, 3.0])
params = {"w": torch.zeros(3)}

optimizer = functopt.adam(learning_rate=0.1)
state = optimizer.init(params)  # (ScaleByAdamState(count, mu, nu), EmptyState())

for step in range(200):
    grads = {"w": 2 * (params["w"] - target)}  # the gradient of f, written out by hand
    updates, state = optimizer.update(grads, state, params)  # new updates and a new state
    params = functopt.apply_updates(params, updates)  # params + updates, out of place
    if step in (0, 199):
        loss = torch.sum((params["w"] - target) ** 2).item()
        w = ", ".join(f"{x:.4f}" for x in params["w"].tolist())
        print(f"step {step + 1:3d}: loss {loss:.6f}, w = [{w}]")

print(f"Adam step count in the state: {int(state[0].count)}")
