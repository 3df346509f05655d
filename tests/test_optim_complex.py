"""Complex params on the ``functopt.optim`` classes and ``functopt.Optimizer``.

torch.optim steps a complex param as its ``torch.view_as_real`` pairs, and keeps its state
complex. The law: for every configuration of torch's optim_db for the ten classes that
step complex params, complex and real params trained 6 steps by the functopt class and by
torch's agree in float64 to 1e-14 of the largest param; a state dict (complex entries, as
torch's) carries the run over to the other side, both ways. Adafactor and Muon refuse a
complex param at the step, as torch's do.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch.testing._internal.common_optimizers import optim_db

import functopt
from functopt import optim

pytestmark = pytest.mark.usefixtures("float64_default")

NAMES = ["Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "NAdam", "RAdam", "Adamax",
         "Adadelta", "Rprop"]
ENTRIES = {e.optim_cls.__name__: e for e in optim_db if e.optim_cls.__name__ in NAMES}
# options torch's own complex steps do not take on the CPU
_NOT_ON_COMPLEX = ("fused", "capturable", "differentiable")


def _rows() -> list[Any]:
    return [pytest.param(name, dict(c.kwargs), id=f"{name}-{c.desc}")
            for name in NAMES for c in ENTRIES[name].optim_inputs_func(device="cpu")
            if not any(c.kwargs.get(k) for k in _NOT_ON_COMPLEX)]


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, 4, dtype=torch.complex128, generator=g)),
            torch.nn.Parameter(torch.randn(3, generator=g)),
            torch.nn.Parameter(torch.randn((), dtype=torch.complex128, generator=g))]


def _steps(opt: Any, ps: list[torch.nn.Parameter], start: int, n: int) -> None:
    for t in range(start, start + n):
        g = torch.Generator().manual_seed(10 + t)
        for p in ps:
            p.grad = torch.randn(p.shape, dtype=p.dtype, generator=g)
        opt.step()


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    scale = max(float(x.detach().abs().max()) for x in b)
    worst = max(float((x - y).detach().abs().max()) for x, y in zip(a, b, strict=True))
    assert worst <= 1e-14 * scale, worst


@pytest.mark.parametrize(("name", "kwargs"), _rows())
def test_complex_params_train_as_torch(name: str, kwargs: dict[str, Any]) -> None:
    ours, theirs = _params(), _params()
    _steps(getattr(optim, name)(ours, **kwargs), ours, 0, 6)
    _steps(getattr(torch.optim, name)(theirs, **kwargs), theirs, 0, 6)
    _close(ours, theirs)
    assert all(p.is_complex() for p in (ours[0], ours[2]))
    assert not torch.equal(theirs[0], _params()[0])


def _through_file(state_dict: dict[str, Any]) -> Any:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer)


@pytest.mark.parametrize(("name", "kwargs"), [
    ("Adam", {"lr": 0.1, "amsgrad": True}), ("SGD", {"lr": 0.1, "momentum": 0.9}),
    ("Adagrad", {"lr": 0.1}), ("NAdam", {"lr": 0.1}), ("Rprop", {"lr": 0.1}),
    ("RMSprop", {"lr": 0.01, "centered": True, "momentum": 0.5})], ids=str)
@pytest.mark.parametrize("direction", ["torch to functopt", "functopt to torch"])
def test_a_state_dict_of_complex_state_carries_the_run_over(
        name: str, kwargs: dict[str, Any], direction: str) -> None:
    first, second = ((getattr(torch.optim, name), getattr(optim, name))
                     if direction == "torch to functopt"
                     else (getattr(optim, name), getattr(torch.optim, name)))
    ps = _params()
    opt = first(ps, **kwargs)
    _steps(opt, ps, 0, 3)
    saved = _through_file(opt.state_dict())
    for entry in saved["state"].values():  # torch's layout: a complex param's state complex
        assert all(v.is_complex() for k, v in entry.items() if v.dim() == 2), entry
    other = second(ps, **kwargs)
    other.load_state_dict(saved)
    _steps(other, ps, 3, 3)
    reference = _params()
    _steps(second(reference, **kwargs), reference, 0, 6)
    _close(ps, reference)


def test_functopt_optimizer_steps_a_complex_param_as_its_real_pairs() -> None:
    tx = functopt.chain(functopt.clip_by_global_norm(1.0), functopt.adamw(0.1))
    ps = _params()
    pairs = [torch.nn.Parameter(torch.view_as_real(p.detach()).clone()) if p.is_complex()
             else torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, ref = functopt.Optimizer(ps, tx), functopt.Optimizer(pairs, tx)
    for t in range(4):
        g = torch.Generator().manual_seed(10 + t)
        for p, q in zip(ps, pairs, strict=True):
            p.grad = torch.randn(p.shape, dtype=p.dtype, generator=g)
            q.grad = torch.view_as_real(p.grad).clone() if p.is_complex() else p.grad.clone()
        opt.step()
        ref.step()
    for p, q in zip(ps, pairs, strict=True):
        assert torch.equal(torch.view_as_real(p.detach()) if p.is_complex() else p, q)
    # and its own state dict holds the state: a copy loaded from it takes the same step
    again = functopt.Optimizer(ps, tx)
    again.load_state_dict(_through_file(opt.state_dict()))
    g = torch.Generator().manual_seed(99)
    for p in ps:
        p.grad = torch.randn(p.shape, dtype=p.dtype, generator=g)
    before = [p.detach().clone() for p in ps]
    again.step()
    by_copy = [p.detach().clone() for p in ps]
    with torch.no_grad():
        for p, v in zip(ps, before, strict=True):
            p.copy_(v)
    opt.step()
    assert all(torch.equal(x, y.detach()) for x, y in zip(by_copy, ps, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(by_copy, before, strict=True))


@pytest.mark.parametrize("name", ["Adafactor", "Muon"])
def test_adafactor_and_muon_refuse_a_complex_param_at_the_step_as_torch(name: str) -> None:
    messages = []
    for cls in (getattr(optim, name), getattr(torch.optim, name)):
        p = torch.nn.Parameter(torch.rand(2, 3, dtype=torch.complex64))
        opt = cls([p])  # (built, as torch builds it)
        p.grad = torch.rand_like(p)
        with pytest.raises(RuntimeError) as raised:
            opt.step()
        messages.append(str(raised.value))
    ours, theirs = messages
    assert ours.startswith(theirs) and "param 0 of param_groups[0]" in ours


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "Adagrad"])
@pytest.mark.parametrize("first", [True, False], ids=["complex-first", "complex-second"])
def test_fused_refuses_a_complex_param_as_torch_at_the_step(name: str, first: bool) -> None:
    made = {}
    for module in (torch.optim, optim):
        ps = _params()[:2] if first else _params()[1::-1]
        for p in ps:
            p.grad = torch.ones_like(p)
        opt = getattr(module, name)(ps, lr=0.1, fused=True)
        with pytest.raises(RuntimeError) as raised:
            opt.step()
        made[module] = str(raised.value)
        assert all(torch.equal(p, q) for p, q in zip(ps, _params()[:2] if first
                                                     else _params()[1::-1], strict=True))
    # every param with a gradient is checked, not only the first; torch's words for a
    # complex param after the first are its kernel's (SGD) or a shorter message
    assert f"param {0 if first else 1} of param_groups[0] is complex128" in made[optim]
    if first:
        assert made[optim].startswith(made[torch.optim])
