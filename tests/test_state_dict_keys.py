"""What torch.optim keeps in a state dict besides the params' entries, kept the same way by
``functopt.optim``, ``functopt.Optimizer`` and ``MixedPrecisionOptimizer``.

torch.optim's ``state_dict()`` packs every key of ``optimizer.state`` that is no param as
it is (a state-dict hook may store one there), and its ``load_state_dict`` puts such keys
back; the state-dict and load hooks run around both; a group loaded into an optimizer whose
group has no ``param_names`` takes the saved names. Each case runs on torch.optim.AdamW too,
so the expectations are torch's behaviour, not this file's.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import functopt
from functopt import optim

Make = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
MAKERS: dict[str, Make] = {
    "torch.optim.AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.1),
    "functopt.optim.AdamW": lambda ps: optim.AdamW(ps, lr=0.1),
    "functopt.Optimizer": lambda ps: functopt.Optimizer(ps, functopt.adamw(0.1)),
    "MixedPrecisionOptimizer": lambda ps: functopt.MixedPrecisionOptimizer(
        torch.optim.AdamW(ps, lr=0.1)),
}


def _stepped(make: Make) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.full((2,), 2.0))]
    opt = make(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt, params


@pytest.mark.parametrize("name", list(MAKERS))
def test_a_key_of_state_that_is_no_param_is_saved_and_loaded_as_it_is(name: str) -> None:
    opt, params = _stepped(MAKERS[name])
    opt.state["note"] = {"epoch": 3}
    saved = opt.state_dict()
    assert list(saved["state"]) == [0, 1, "note"]
    assert saved["state"]["note"] == {"epoch": 3}
    again = MAKERS[name](params)
    again.load_state_dict(saved)
    assert again.state["note"] == {"epoch": 3}
    for p in params:  # the params' entries still load and step
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    again.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, params, strict=True))
    assert list(again.state_dict()["state"]) == [0, 1, "note"]


@pytest.mark.parametrize("name", list(MAKERS))
def test_state_dict_and_load_hooks_run_around_save_and_load(name: str) -> None:
    opt, params = _stepped(MAKERS[name])
    seen: list[str] = []

    def pre(o: torch.optim.Optimizer) -> None:
        seen.append("pre")
        o.state["from_pre_hook"] = 1

    def post(o: torch.optim.Optimizer, sd: dict) -> dict:
        seen.append("post")
        assert sd["state"].pop("from_pre_hook") == 1  # the pre hook's key reached the dict
        return {**sd, "ran": True}

    opt.register_state_dict_pre_hook(pre)
    opt.register_state_dict_post_hook(post)
    saved = opt.state_dict()
    assert seen == ["pre", "post"] and saved["ran"] is True
    assert "from_pre_hook" not in saved["state"]

    again = MAKERS[name](params)

    def load_pre(o: torch.optim.Optimizer, sd: dict) -> dict:
        seen.append("load_pre")
        sd = {**sd, "param_groups": [dict(g) for g in sd["param_groups"]]}
        sd["param_groups"][0]["lr"] = 0.002
        return sd

    again.register_load_state_dict_pre_hook(load_pre)
    again.register_load_state_dict_post_hook(lambda o: seen.append("load_post"))
    again.load_state_dict(saved)
    assert seen == ["pre", "post", "load_pre", "load_post"]
    assert again.param_groups[0]["lr"] == 0.002  # the pre hook's dict is the one loaded


@pytest.mark.parametrize("name", [n for n in MAKERS if n != "MixedPrecisionOptimizer"])
def test_an_unnamed_group_takes_the_saved_param_names(name: str) -> None:
    # (MixedPrecisionOptimizer names every group's params itself)
    model = torch.nn.Linear(2, 1)
    named = MAKERS[name](list(model.named_parameters()))  # type: ignore[arg-type]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    named.step()
    unnamed = MAKERS[name](list(model.parameters()))
    assert "param_names" not in unnamed.state_dict()["param_groups"][0]
    unnamed.load_state_dict(named.state_dict())
    assert unnamed.state_dict()["param_groups"][0]["param_names"] == ["weight", "bias"]
    assert unnamed.param_groups[0]["param_names"] == ["weight", "bias"]


def _facade() -> tuple[functopt.MixedPrecisionOptimizer, torch.nn.Parameter]:
    p = torch.nn.Parameter(torch.ones(3))
    opt = functopt.MixedPrecisionOptimizer([p], functopt.adam(0.1))
    p.grad = torch.ones(3)
    opt.step()
    return opt, p


def test_the_facades_state_view_takes_a_tensor_written_over_one_and_refuses_other_writes(
) -> None:
    opt, p = _facade()
    entry = opt.state[p]
    name = next(k for k, v in entry.items() if isinstance(v, torch.Tensor) and v.shape == (3,))
    entry[name] = torch.full((3,), 7.0)  # (what a framework's move to a device does)
    assert torch.equal(opt.state[p][name], torch.full((3,), 7.0))  # it reached the live state
    for write in (lambda: entry.__setitem__("new", torch.ones(3)),
                  lambda: entry.__setitem__(name, torch.ones(4)),
                  lambda: entry.pop(name), lambda: entry.update({name: 1}),
                  lambda: opt.state.__setitem__(p, {}), lambda: opt.state.pop(p),
                  lambda: opt.state.__delitem__(p)):
        with pytest.raises(TypeError, match="view of the step's state"):
            write()
    assert name in opt.state[p]
    other = torch.nn.Parameter(torch.ones(1))  # a tensor that is no param of it reads empty
    assert dict(opt.state[other]) == {} and other not in opt.state
