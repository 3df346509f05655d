"""The pure transforms under torch.func: meta-gradients through optimizer steps, and
ensembles of models optimized at once with vmap."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, vmap

import functopt


def _regression_data(seed: int = 0, n: int = 16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.1
    return x, y


def _loss(params, x, y):
    pred = x @ params["w"] + params["b"]
    return ((pred - y) ** 2).mean()


def _train(make_tx, lr, steps: int = 5, seed: int = 0):
    x, y = _regression_data(seed)
    params = {"w": torch.zeros(3, dtype=torch.float64), "b": torch.zeros((), dtype=torch.float64)}
    tx = make_tx(lr)
    state = tx.init(params)
    for _ in range(steps):
        grads = grad(_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        params = functopt.apply_updates(params, updates)
    return _loss(params, x, y)


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda lr: functopt.sgd(lr, momentum=0.9),
        lambda lr: functopt.adam(lr, eps_root=1e-12),
        lambda lr: functopt.adamw(lr, weight_decay=0.1),
        lambda lr: functopt.chain(functopt.clip_by_global_norm(1.0), functopt.adam(lr)),
    ],
    ids=["sgd-momentum", "adam", "adamw", "clip+adam"],
)
def test_meta_gradient_of_learning_rate_matches_finite_differences(make_tx) -> None:
    lr = torch.tensor(0.05, dtype=torch.float64)
    meta_grad = grad(lambda lr_: _train(make_tx, lr_))(lr)
    h = 1e-6
    fd = (_train(make_tx, lr + h) - _train(make_tx, lr - h)) / (2 * h)
    assert torch.isfinite(meta_grad)
    assert abs(fd.item()) > 1e-4, "the loss must depend on the learning rate for the test to mean anything"
    torch.testing.assert_close(meta_grad, fd, rtol=1e-5, atol=1e-9)


def test_meta_gradient_through_initial_params() -> None:
    # MAML-style: differentiate the post-training loss with respect to the initial params.
    x, y = _regression_data(1)
    tx = functopt.adam(0.1)

    def outer(init_params):
        params, state = init_params, tx.init(init_params)
        for _ in range(3):
            g = grad(_loss)(params, x, y)
            u, state = tx.update(g, state, params)
            params = functopt.apply_updates(params, u)
        return _loss(params, x, y)

    p0 = {"w": torch.full((3,), 0.3, dtype=torch.float64), "b": torch.tensor(0.2, dtype=torch.float64)}
    g = grad(outer)(p0)
    h = 1e-6
    for i in range(3):
        e = torch.zeros(3, dtype=torch.float64)
        e[i] = h
        fd = (outer({**p0, "w": p0["w"] + e}) - outer({**p0, "w": p0["w"] - e})) / (2 * h)
        torch.testing.assert_close(g["w"][i], fd, rtol=1e-5, atol=1e-9)


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(3, 8)
        self.fc2 = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))).squeeze(-1)


@pytest.mark.parametrize(
    "make_tx",
    [lambda: functopt.adamw(1e-2, weight_decay=0.01), lambda: functopt.sgd(0.05, momentum=0.9)],
    ids=["adamw", "sgd-momentum"],
)
def test_vmap_ensemble_equals_loop(make_tx) -> None:
    members, steps = 4, 5
    torch.manual_seed(0)
    models = [_MLP() for _ in range(members)]
    base = _MLP()
    stacked = {k: torch.stack([dict(m.named_parameters())[k].detach() for m in models])
               for k, _ in base.named_parameters()}
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(members, 10, 3, generator=gen)
    y = torch.randn(members, 10, generator=gen)
    tx = make_tx()

    def loss(params, xb, yb):
        return ((functional_call(base, params, (xb,)) - yb) ** 2).mean()

    def step(params, state, xb, yb):
        g = grad(loss)(params, xb, yb)
        u, state = tx.update(g, state, params)
        return functopt.apply_updates(params, u), state

    params, state = stacked, vmap(tx.init)(stacked)
    for _ in range(steps):
        params, state = vmap(step)(params, state, x, y)

    for i in range(members):
        p_i = {k: v[i] for k, v in stacked.items()}
        s_i = tx.init(p_i)
        for _ in range(steps):
            p_i, s_i = step(p_i, s_i, x[i], y[i])
        for k in p_i:
            torch.testing.assert_close(params[k][i], p_i[k], rtol=1e-6, atol=1e-7)
    # the members really moved apart from where they started
    assert not torch.allclose(params["fc1.weight"], stacked["fc1.weight"])
