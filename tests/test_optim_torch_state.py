"""``functopt.optim`` state dicts are torch.optim's, both ways.

The law: for every configuration torch's ``optim_db`` lists for the eleven classes (and a few
more rows), a run of 3 steps on one side (functopt.optim or torch.optim), its
``state_dict()`` saved and loaded with ``torch.save``/``torch.load`` (``weights_only``)
into the other side, and 3 more steps there, equals an uninterrupted 6-step run of the
other side (float64, to 1e-15 of the largest param), both ways; also with a param that had
no gradient in the first 3 steps (torch then keeps no state for it). The layout itself is
torch's: the same keys per param, ``step`` in torch's dtype and place, the same group keys.
A checkpoint written by the functopt.optim classes in functopt's own format
(tests/data/optim_state_format2.pt, written by ``state_dict()`` before the classes wrote
torch's layout: 2 steps of each row below over ``torch.nn.Linear(2, 1)``, float64, with
the gradients of ``_fixture_grads``) still loads and continues the run.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing._internal.common_optimizers import optim_db

import functopt
from functopt import optim

pytestmark = pytest.mark.usefixtures("float64_default")

NAMES = ["Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "NAdam", "RAdam", "Adamax",
         "Adadelta", "Rprop", "Adafactor"]
ENTRIES = {e.optim_cls.__name__: e for e in optim_db if e.optim_cls.__name__ in NAMES}
# rows optim_db does not list
EXTRA = [("AdamW", {"amsgrad": True, "maximize": True}), ("RMSprop", {"momentum": 0.5}),
         ("SGD", {"momentum": 0.9, "dampening": 0.3, "weight_decay": 0.1}),
         ("Adam", {"lr": 0.1, "fused": True}), ("SGD", {"momentum": 0.9, "fused": True}),
         ("NAdam", {"lr": 0.1, "decoupled_weight_decay": True, "weight_decay": 0.1})]


def _rows() -> list[Any]:
    out = [pytest.param(name, dict(config.kwargs), id=f"{name}-{config.desc}")
           for name in NAMES for config in ENTRIES[name].optim_inputs_func(device="cpu")]
    out += [pytest.param(name, kwargs, id=f"{name}-extra{i}")
            for i, (name, kwargs) in enumerate(EXTRA)]
    # torch's fused Adagrad keeps step in float32 on the param's device (functopt.optim runs
    # the pure path for it, and warns so)
    out.append(pytest.param("Adagrad", {"lr": 0.1, "fused": True}, id="Adagrad-fused",
                            marks=pytest.mark.filterwarnings(
                                "ignore::functopt.fast.FastPathWarning")))
    return out


_X = torch.randn(8, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
_Y = torch.randn(8, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=g, dtype=torch.float64))
            for shape in ((3, 4), (3,), ())]


def _steps(opt: Any, ps: list[torch.nn.Parameter], n: int, skip: tuple[int, ...] = ()) -> None:
    for _ in range(n):
        opt.zero_grad()
        w, b, s = ps
        (((torch.tanh(_X @ w.T + b) * s - _Y) ** 2).mean()).backward()
        for k in skip:
            ps[k].grad = None
        opt.step()


def _through_file(state_dict: dict[str, Any]) -> Any:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # (weights_only=True: torch's default)


def _close(got: list[torch.nn.Parameter], expected: list[torch.nn.Parameter]) -> None:
    for g, e in zip(got, expected, strict=True):
        scale = max(1.0, e.detach().abs().max().item())
        assert (g.detach() - e.detach()).abs().max().item() <= 1e-15 * scale


def _interchanged(first: type, second: type, kwargs: dict[str, Any],
                  skip: tuple[int, ...]) -> None:
    ps = _params()
    a = first(ps, **copy.deepcopy(kwargs))
    _steps(a, ps, 3, skip)
    saved = _through_file(a.state_dict())
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    b = second(qs, **copy.deepcopy(kwargs))
    b.load_state_dict(saved)
    _steps(b, qs, 3)
    rs = _params()
    c = second(rs, **copy.deepcopy(kwargs))
    _steps(c, rs, 3, skip)
    _steps(c, rs, 3)
    _close(qs, rs)
    assert max((r - s).abs().max().item() for r, s in zip(rs, _params(), strict=True)) > 0


@pytest.mark.parametrize(("name", "kwargs"), _rows())
@pytest.mark.parametrize("skip", [(), (2,)], ids=["all-stepped", "one-never-stepped"])
@pytest.mark.parametrize("direction", ["to-torch", "from-torch"])
def test_a_state_dict_continues_the_run_on_the_other_side(
        name: str, kwargs: dict[str, Any], skip: tuple[int, ...], direction: str) -> None:
    if skip and kwargs.get("fused") and name == "SGD":
        pytest.skip("torch's fused SGD itself fails on a param whose first step comes after "
                    "the others' (a None momentum buffer among tensors)")
    ours, theirs = getattr(optim, name), getattr(torch.optim, name)
    if direction == "to-torch":
        _interchanged(ours, theirs, kwargs, skip)
    else:
        _interchanged(theirs, ours, kwargs, skip)


@pytest.mark.parametrize(("name", "kwargs"), _rows())
def test_the_state_dict_is_torchs_layout(name: str, kwargs: dict[str, Any]) -> None:
    ps, qs = _params(), _params()
    ours = getattr(optim, name)(ps, **copy.deepcopy(kwargs))
    theirs = getattr(torch.optim, name)(qs, **copy.deepcopy(kwargs))
    _steps(ours, ps, 2, skip=(2,))
    _steps(theirs, qs, 2, skip=(2,))
    got, expected = ours.state_dict(), theirs.state_dict()
    assert sorted(got["state"]) == sorted(expected["state"])
    for k, entry in expected["state"].items():
        assert list(got["state"][k]) == list(entry)
        for key, value in entry.items():
            mine = got["state"][k][key]
            assert (mine.dtype, mine.device, mine.shape) == (value.dtype, value.device,
                                                            value.shape), key
    assert [sorted(g) for g in got["param_groups"]] == [
        sorted(g) for g in expected["param_groups"]]
    assert [g["params"] for g in got["param_groups"]] == [
        g["params"] for g in expected["param_groups"]]


def test_param_names_are_kept_as_torch_keeps_them() -> None:
    model = torch.nn.Linear(4, 3)
    ours = optim.AdamW(model.named_parameters(), lr=0.1)
    theirs = torch.optim.AdamW(model.named_parameters(), lr=0.1)
    model(_X).sum().backward()
    ours.step()
    assert ours.state_dict()["param_groups"][0]["param_names"] == ["weight", "bias"]
    theirs.load_state_dict(ours.state_dict())
    assert theirs.state_dict()["param_groups"] == ours.state_dict()["param_groups"]


def test_issue_case_sgd_momentum_carries_over() -> None:
    # functopt.optim.SGD(momentum=0.9)'s state loaded into torch.optim.SGD keeps the momentum
    ps = _params()
    a = optim.SGD(ps, lr=0.1, momentum=0.9)
    _steps(a, ps, 2)
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    b = torch.optim.SGD(qs, lr=0.1, momentum=0.9)
    b.load_state_dict(a.state_dict())
    assert all(torch.equal(b.state[q]["momentum_buffer"], a.state_dict()["state"][k][
        "momentum_buffer"]) for k, q in enumerate(qs))
    _steps(b, qs, 2)
    rs = _params()
    c = torch.optim.SGD(rs, lr=0.1, momentum=0.9)
    _steps(c, rs, 4)
    _close(qs, rs)


def test_a_torch_checkpoint_with_differing_counts_steps_each_param_at_its_own() -> None:
    # torch saved mid-run: param 2 stepped once, the others three times
    ps, rs = _params(), _params()
    theirs, ref = torch.optim.Adam(ps, lr=0.1), torch.optim.Adam(rs, lr=0.1)
    for o, params in ((theirs, ps), (ref, rs)):
        _steps(o, params, 2, skip=(2,))
        _steps(o, params, 1)
    ours = optim.Adam([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=0.1)
    ours.load_state_dict(_through_file(theirs.state_dict()))
    qs = ours.param_groups[0]["params"]
    assert [ours.state[q]["count"].item() for q in qs] == [3, 3, 1]
    _steps(ours, qs, 3)
    _steps(ref, rs, 3)
    _close(qs, rs)


def test_a_state_dict_of_other_options_continues_with_them() -> None:
    # torch's load_state_dict takes the saved groups' options (amsgrad=True here) with the
    # state: so does functopt's, the group running the chain of those options
    ps, rs = _params(), _params()
    theirs = torch.optim.Adam(ps, lr=0.1, amsgrad=True)
    _steps(theirs, ps, 1)
    ref = torch.optim.Adam(rs, lr=0.1)
    ref.load_state_dict(theirs.state_dict())
    ours = optim.Adam(qs := _params(), lr=0.1)
    ours.load_state_dict(_through_file(theirs.state_dict()))
    assert ours.param_groups[0]["amsgrad"] is True
    with torch.no_grad():
        for q, r, p in zip(qs, rs, ps, strict=True):
            q.copy_(p)
            r.copy_(p)
    _steps(ours, qs, 3)
    _steps(ref, rs, 3)
    _close(qs, rs)


def test_a_state_dict_of_other_keys_raises_naming_them() -> None:
    ps = _params()
    theirs = torch.optim.Adam(ps, lr=0.1, amsgrad=True)
    _steps(theirs, ps, 1)
    saved = theirs.state_dict()
    saved["param_groups"][0]["amsgrad"] = False  # the entries then hold a key too many
    ours = optim.Adam(_params(), lr=0.1)
    with pytest.raises(ValueError, match=r"param 0 of param_groups\[0\] has unexpected keys "
                                         r"\['max_exp_avg_sq'\] and lacks \[\]"):
        ours.load_state_dict(saved)


def _fixture_grads(model: torch.nn.Module, t: int) -> None:
    model.weight.grad = torch.full_like(model.weight, 0.3 * (t + 1))
    model.bias.grad = torch.full_like(model.bias, -0.2 * (t + 2))


FIXTURE = Path(__file__).parent / "data" / "optim_state_format2.pt"


@pytest.mark.parametrize("index", range(14))
def test_a_checkpoint_in_functopts_own_format_still_loads(index: int) -> None:
    saved = torch.load(FIXTURE)[index]
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    ref.load_state_dict(model.state_dict())
    name, kwargs = saved["name"], saved["kwargs"]
    if name == "functopt.adamw":
        opt: Any = functopt.Optimizer(model.named_parameters(), functopt.adamw(**kwargs))
        torch_opt: Any = torch.optim.AdamW(ref.parameters(), lr=kwargs["learning_rate"],
                                           weight_decay=1e-4)
    else:
        opt = getattr(optim, name)(model.named_parameters(), **kwargs)
        torch_opt = getattr(torch.optim, name)(ref.parameters(), **kwargs)
    for t in range(2):
        _fixture_grads(ref, t)
        torch_opt.step()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved["params"][n])
    assert "functopt" in saved["state_dict"]["param_groups"][0]  # functopt's own format
    opt.load_state_dict(saved["state_dict"])
    for t in range(2, 4):
        for m, o in ((model, opt), (ref, torch_opt)):
            _fixture_grads(m, t)
            o.step()
    _close(list(model.parameters()), list(ref.parameters()))
