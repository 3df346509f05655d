"""Sparse gradients on the ``functopt.optim`` classes whose torch twins step them: SGD and
Adagrad.

The law: an embedding with ``sparse=True`` (batches that repeat rows and miss others) and a
dense layer, trained for 8 steps by the functopt class and by torch's, agree in float64 to
1e-14 of the largest param, for each option torch takes with sparse gradients; a state
dict carries the run over to the other side both ways (torch's sparse momentum buffer
included). Where torch refuses a sparse gradient for an option (the fused kernels, the
weight decay), the functopt class raises torch's RuntimeError with torch's message.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from functopt import optim

pytestmark = [pytest.mark.usefixtures("float64_default"),
              # (torch's sparse Adagrad step builds sparse tensors without checks, and says so)
              pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")]

ROWS = [("SGD", {"lr": 0.05}), ("SGD", {"lr": 0.05, "momentum": 0.9}),
        ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
        ("SGD", {"lr": 0.05, "momentum": 0.5, "dampening": 0.3, "maximize": True}),
        ("SGD", {"lr": torch.tensor(0.05), "momentum": 0.9}),
        ("Adagrad", {"lr": 0.1}), ("Adagrad", {"lr": 0.1, "lr_decay": 0.1}),
        ("Adagrad", {"lr": 0.1, "eps": 0.0, "initial_accumulator_value": 0.1}),
        ("Adagrad", {"lr": 0.1, "maximize": True})]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(12, 4, sparse=True), torch.nn.Linear(4, 1))


def _steps(model: torch.nn.Module, opt: Any, start: int, n: int) -> None:
    for t in range(start, start + n):
        opt.zero_grad()
        g = torch.Generator().manual_seed(10 + t)
        idx = torch.randint(0, 8, (6,), generator=g)  # rows 8-11 never, others repeated
        target = torch.randn(6, 1, generator=g)
        torch.nn.functional.mse_loss(model(idx), target).backward()
        opt.step()


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    scale = max(float(x.abs().max()) for x in b)
    worst = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
    assert worst <= 1e-14 * scale, worst


def _ids() -> list[str]:
    return [f"{name}-{i}" for i, (name, _) in enumerate(ROWS)]


@pytest.mark.parametrize(("name", "kwargs"), ROWS, ids=_ids())
def test_sparse_gradients_train_as_torch(name: str, kwargs: dict[str, Any]) -> None:
    runs = []
    for cls in (getattr(optim, name), getattr(torch.optim, name)):
        model = _model()
        assert model[0].weight.requires_grad
        _steps(model, cls(model.parameters(), **kwargs), 0, 8)
        runs.append(_params(model))
    ours, theirs = runs
    _close(ours, theirs)
    start = _params(_model())
    assert not torch.equal(theirs[0][:8], start[0][:8])  # the rows it saw moved
    assert torch.equal(theirs[0][8:], start[0][8:])  # the rows it never saw did not
    assert torch.equal(ours[0][8:], start[0][8:])


def _through_file(state_dict: dict[str, Any]) -> Any:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer)


@pytest.mark.parametrize(("name", "kwargs"), [ROWS[1], ROWS[2], ROWS[6]], ids=str)
@pytest.mark.parametrize("direction", ["torch to functopt", "functopt to torch"])
def test_a_state_dict_carries_the_sparse_run_over(name: str, kwargs: dict[str, Any],
                                                  direction: str) -> None:
    first, second = ((getattr(torch.optim, name), getattr(optim, name))
                     if direction == "torch to functopt"
                     else (getattr(optim, name), getattr(torch.optim, name)))
    model = _model()
    opt = first(model.parameters(), **kwargs)
    _steps(model, opt, 0, 3)
    saved = _through_file(opt.state_dict())
    other = second(model.parameters(), **kwargs)
    other.load_state_dict(saved)
    _steps(model, other, 3, 3)
    reference = _model()
    _steps(reference, second(reference.parameters(), **kwargs), 0, 6)
    _close(_params(model), _params(reference))


@pytest.mark.parametrize(("name", "kwargs"), [
    ("SGD", {"lr": 0.05, "fused": True}), ("SGD", {"lr": 0.05, "weight_decay": 0.1}),
    ("Adagrad", {"lr": 0.1, "weight_decay": 0.1}), ("Adagrad", {"lr": 0.1, "fused": True})],
    ids=["SGD-fused", "SGD-weight_decay", "Adagrad-weight_decay", "Adagrad-fused"])
def test_options_torch_refuses_with_sparse_gradients_raise_its_error(
        name: str, kwargs: dict[str, Any]) -> None:
    messages = []
    for cls in (getattr(optim, name), getattr(torch.optim, name)):
        model = _model()
        with pytest.raises(RuntimeError) as raised:
            _steps(model, cls(model.parameters(), **kwargs), 0, 1)
        messages.append(str(raised.value))
    ours, theirs = messages
    assert ours.startswith(theirs) and "param 0 of param_groups[0]" in ours


def test_a_sparse_gradients_momentum_buffer_is_shown_dense_and_taken_sparse() -> None:
    # torch's SGD keeps it sparse; the chain keeps it dense (the same values)
    p = torch.nn.Parameter(torch.arange(6.0).reshape(3, 2))
    q = torch.nn.Parameter(p.detach().clone())
    ours, theirs = optim.SGD([p], lr=0.1, momentum=0.9), torch.optim.SGD([q], lr=0.1,
                                                                         momentum=0.9)
    grad = torch.sparse_coo_tensor([[0, 2]], torch.ones(2, 2), (3, 2))
    for opt, param in ((ours, p), (theirs, q)):
        param.grad = grad.clone()
        opt.step()
    buffer = theirs.state[q]["momentum_buffer"]
    assert buffer.is_sparse and torch.equal(ours.state[p]["momentum_buffer"], buffer.to_dense())
    for opt, param in ((ours, p), (theirs, q)):
        opt.state[param]["momentum_buffer"] = buffer * 2.0  # (sparse, as torch's is)
        param.grad = grad.clone()
        opt.step()
    assert torch.allclose(p, q, rtol=1e-14, atol=0)
