"""``functopt.optim`` classes and ``functopt.Optimizer`` build over params on the meta
device, as torch.optim's do (a model built under ``torch.device("meta")`` and materialised
later with ``to_empty``).

With ``torch.__future__.set_swap_module_params_on_conversion(True)`` ``to_empty`` keeps the
parameter objects, so the optimizer built on the meta params steps the materialised ones:
the run equals the same optimizer built on those params directly, bitwise. Without it
``to_empty`` makes new parameters and the optimizer keeps the meta ones, which never get a
gradient: a step moves nothing and makes no state, as torch.optim's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import functopt
from functopt import optim

NAMES = ["Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "NAdam", "RAdam", "Adamax",
         "Adadelta", "Rprop", "Muon", "Adafactor"]


def _maker(name: str) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    if name == "Optimizer":
        return lambda ps: functopt.Optimizer(ps, functopt.adamw(0.1, weight_decay=0.1))
    options = {"momentum": 0.9} if name == "SGD" else {}
    return lambda ps: getattr(optim, name)(ps, lr=0.1, **options)


@pytest.fixture
def swapping() -> Iterator[None]:
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _model(device: str, name: str) -> torch.nn.Module:
    with torch.device(device):
        return torch.nn.Linear(4, 3, bias=name != "Muon")


def _run(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    x = torch.linspace(-1.0, 1.0, 8).reshape(2, 4)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", [*NAMES, "Optimizer"])
def test_built_on_meta_params_and_materialised_it_runs_as_if_built_on_them(
        name: str, swapping: None) -> None:
    make = _maker(name)
    meta = _model("meta", name)
    opt = make(list(meta.parameters()))
    if name not in ("Adagrad", "Optimizer"):  # (those two hold state from construction)
        assert opt.state_dict()["state"] == {}
    meta.to_empty(device="cpu")
    assert opt.param_groups[0]["params"][0] is meta.weight
    direct = _model("cpu", name)
    with torch.no_grad():
        for p, q in zip(meta.parameters(), direct.parameters(), strict=True):
            p.copy_(torch.linspace(-0.5, 0.5, p.numel()).reshape(p.shape))
            q.copy_(p)
    got = _run(meta, opt)
    want = _run(direct, make(list(direct.parameters())))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert all(t.device.type == "cpu" for entry in opt.state_dict()["state"].values()
               for t in entry.values() if isinstance(t, torch.Tensor))
    assert opt.param_groups[0]["lr"] == 0.1  # a number, read from no meta tensor


@pytest.mark.parametrize("name", ["AdamW", "SGD", "Muon"])
def test_without_the_swap_the_meta_params_are_stepped_as_torch_steps_them(name: str) -> None:
    # to_empty gives new parameters; the optimizer holds the meta ones, which have no grad
    theirs_model, ours_model = _model("meta", name), _model("meta", name)
    options = {"momentum": 0.9} if name == "SGD" else {}
    theirs = getattr(torch.optim, name)(theirs_model.parameters(), lr=0.1, **options)
    ours = getattr(optim, name)(ours_model.parameters(), lr=0.1, **options)
    assert {k: v for k, v in ours.param_groups[0].items() if k != "params"}.items() >= {
        k: v for k, v in theirs.param_groups[0].items() if k != "params"}.items()
    theirs_model.to_empty(device="cpu")
    ours_model.to_empty(device="cpu")
    assert ours.param_groups[0]["params"][0] is not ours_model.weight
    _run(theirs_model, theirs)
    _run(ours_model, ours)
    assert theirs.state_dict()["state"] == {} and ours.state_dict()["state"] == {}
