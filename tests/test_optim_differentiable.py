"""functopt.optim with ``differentiable=True``: the step in the autograd graph, as torch's.

Law: for each class (and the options that change its chain), two steps on a non-leaf
param are differentiable: ``torch.autograd.gradcheck`` of the new param (and the state)
with respect to the starting param and the gradients passes in float64, and the values
and gradients equal torch.optim's with ``differentiable=True`` wherever torch's own step
runs this pattern. The refusals are torch's: ``fused=True``, ``foreach=True`` at the
step, and a leaf param that requires grad (an in-place write to it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from functopt import optim

pytestmark = pytest.mark.usefixtures("float64_default")

# The params and gradients are of order 1: an entry of a gradient that cancels to nearly 0
# (Adam's update barely moves with its gradient) keeps an absolute rounding of a few ulps
# of 1, so its bound is absolute; a wrong derivative is off by orders more.
_ATOL = 1e-13

# class, constructor kwargs
CASES: list[tuple[str, dict[str, Any]]] = [
    ("Adam", {}), ("Adam", {"amsgrad": True, "weight_decay": 0.1}), ("AdamW", {}),
    ("AdamW", {"maximize": True}), ("SGD", {}), ("SGD", {"momentum": 0.9, "nesterov": True}),
    ("SGD", {"momentum": 0.9, "dampening": 0.3, "weight_decay": 0.1}), ("NAdam", {}),
    ("NAdam", {"decoupled_weight_decay": True, "weight_decay": 0.1}), ("RAdam", {}),
    ("Adamax", {}), ("RMSprop", {"centered": True, "momentum": 0.5}), ("Adagrad", {}),
    ("Adadelta", {}), ("Rprop", {}),
]


def _ids() -> list[Any]:
    return [pytest.param(name, kwargs, id=f"{name}-{'-'.join(kwargs) or 'default'}")
            for name, kwargs in CASES]


def _steps(module: Any, name: str, kwargs: dict[str, Any], w: torch.Tensor,
           gs: list[torch.Tensor], lr: Any = 0.1) -> tuple[torch.Tensor, ...]:
    """The param after a step per gradient in ``gs``, from ``w`` (cloned: a non-leaf), and
    the state tensors of the last step."""
    p = w.clone()
    opt = getattr(module, name)([p], lr=lr, differentiable=True, **kwargs)
    for g in gs:
        p.grad = g
        opt.step()
    state = opt.state_dict()["state"].get(0, {})
    return (p, *(v for k, v in sorted(state.items())
                 if k != "step" and isinstance(v, torch.Tensor) and v.requires_grad))


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(4, generator=g).requires_grad_() for _ in range(3))  # type: ignore[return-value]


@pytest.mark.parametrize(("name", "kwargs"), _ids())
def test_two_steps_pass_gradcheck(name: str, kwargs: dict[str, Any]) -> None:
    w, g1, g2 = _inputs()
    assert torch.autograd.gradcheck(
        lambda w, g1, g2: _steps(optim, name, kwargs, w, [g1, g2]), (w, g1, g2))
    p = _steps(optim, name, kwargs, w, [g1, g2])[0]
    assert p.grad_fn is not None and not torch.equal(p.detach(), w.detach())


@pytest.mark.parametrize(("name", "kwargs"), _ids())
def test_a_step_and_its_gradients_equal_torch(name: str, kwargs: dict[str, Any]) -> None:
    w, g1, _ = _inputs()
    _equal_to_torch(name, kwargs, w, g1, _steps(torch.optim, name, kwargs, w, [g1])[0])


def _equal_to_torch(name: str, kwargs: dict[str, Any], w: torch.Tensor, g1: torch.Tensor,
                    theirs: torch.Tensor, lr: Any = 0.1) -> None:
    """functopt's step from ``w`` with ``g1`` is torch's step ``theirs``, and so are the
    param's gradients with respect to ``w`` and ``g1``."""
    ours = _steps(optim, name, kwargs, w, [g1], lr=lr)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=1e-14)
    if name == "SGD" and kwargs.get("momentum"):
        # torch.optim.SGD's first momentum buffer is a detached copy of the gradient, so
        # its step is not differentiated through it; functopt's is (gradcheck)
        return
    mine = torch.autograd.grad(ours.square().sum(), (w, g1), allow_unused=True)
    ref = torch.autograd.grad(theirs.square().sum(), (w, g1), allow_unused=True)
    for a, b in zip(mine, ref, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=_ATOL)


@pytest.mark.parametrize("name", ["Adam", "AdamW", "RAdam"])
def test_a_tensor_learning_rate_gets_torchs_gradient(name: str) -> None:
    # (torch's other classes refuse a tensor lr under differentiable=True)
    w, g1, g2 = _inputs()
    grads = []
    for module in (optim, torch.optim):
        lr = torch.tensor(0.1, requires_grad=True)
        p = _steps(module, name, {}, w, [g1, g2], lr=lr)[0]
        (grad,) = torch.autograd.grad(p.square().sum(), (lr,))
        grads.append(grad)
    assert grads[0].abs().item() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=0)


def test_the_refusals_are_torchs() -> None:
    w = torch.ones(2, requires_grad=True)
    for module in (optim, torch.optim):
        with pytest.raises(RuntimeError, match="`fused` does not support `differentiable`"):
            module.Adam([w.clone()], differentiable=True, fused=True)
        p = w.clone()
        opt = module.Adam([p], differentiable=True, foreach=True)
        p.grad = torch.ones(2)
        with pytest.raises(AssertionError, match="_foreach ops don't support autograd"):
            opt.step()
        leaf = torch.nn.Parameter(torch.ones(2))
        opt = module.Adam([leaf], differentiable=True)
        leaf.grad = torch.ones(2)
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
            opt.step()
    with pytest.raises(ValueError, match="can't optimize a non-leaf Tensor"):
        optim.Adam([w.clone()])  # (without differentiable, as torch)


def test_without_differentiable_the_step_stays_outside_the_graph() -> None:
    w, g1, _ = _inputs()
    p = torch.nn.Parameter(w.detach().clone())
    opt = optim.Adam([p], lr=0.1)
    p.grad = g1.detach()
    opt.step()
    assert p.grad_fn is None and opt.param_groups[0]["differentiable"] is False


def _db_configs() -> list[Any]:
    from torch.testing._internal.common_optimizers import optim_db

    rows = []
    for entry in optim_db:
        name = entry.optim_cls.__name__
        if not hasattr(optim, name) or name in ("Muon", "Adafactor"):  # (no such option)
            continue
        for config in entry.optim_inputs_func(device="cpu"):
            kwargs = dict(config.kwargs)
            if config.params is not None or any(kwargs.get(k) for k in
                                                ("foreach", "fused", "capturable")):
                continue
            rows.append(pytest.param(name, kwargs, id=f"{name}-{config.desc}"))
    return rows


@pytest.mark.parametrize(("name", "kwargs"), _db_configs())
def test_every_optim_db_configuration_steps_differentiably(name: str,
                                                            kwargs: dict[str, Any]) -> None:
    # torch's own test database: each configuration's step, with differentiable=True,
    # passes gradcheck and equals torch's differentiable step (values; the param's
    # gradient where torch's runs it: not through SGD's detached first momentum buffer)
    kwargs = {"lr": 0.1, **kwargs}
    lr = kwargs.pop("lr")
    if isinstance(lr, torch.Tensor):
        lr = lr.to(torch.float64)
    w, g1, _ = _inputs()
    assert torch.autograd.gradcheck(
        lambda w, g1: _steps(optim, name, kwargs, w, [g1], lr=lr)[0], (w, g1))
    try:
        theirs = _steps(torch.optim, name, kwargs, w, [g1], lr=lr)[0]
    except TypeError as error:  # torch's in-place ops take no tensor lr there
        assert isinstance(lr, torch.Tensor), error
        return
    _equal_to_torch(name, kwargs, w, g1, theirs, lr=lr)
