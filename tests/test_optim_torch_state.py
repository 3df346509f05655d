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

``optimizer.state`` itself is torch's too. The law, over the same rows: after steps in which
some params have no gradient, each param's ``optimizer.state`` entry holds torch's keys in
torch's order, of torch's dtypes, devices and shapes, equal to torch's optimizer's
``state[p]`` (1e-15 of the largest value in float64, ``step`` exactly, bitwise where both
run torch's fused kernel); and writes through it (in place, key by key, whole entries)
change the next steps as the same writes on torch's optimizer change torch's. The
frameworks' state helpers (Lightning's move to a device, accelerate's wrapper, DCP's get and
set) continue the run as they continue torch's.
"""

from __future__ import annotations

import collections
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
    assert [ours.state[q]["step"].item() for q in qs] == [3, 3, 1]
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


# -- optimizer.state itself is torch's ---------------------------------------------------

# Which params have no gradient at each step of the run before the comparisons: param 2
# misses the first two steps, param 1 the third (each param's own step counts).
_MISSING = [(2,), (2,), (1,), ()]


def _skip_torchs_fused_sgd(name: str, kwargs: dict[str, Any]) -> None:
    if kwargs.get("fused") and name == "SGD":
        pytest.skip("torch's fused SGD itself fails on a param whose first step comes after "
                    "the others' (a None momentum buffer among tensors)")


def _run(opt: Any, ps: list[torch.nn.Parameter], missing: list[tuple[int, ...]]) -> None:
    for skip in missing:
        _steps(opt, ps, 1, skip)


def _pair(name: str, kwargs: dict[str, Any]) -> tuple[Any, list[torch.nn.Parameter],
                                                      Any, list[torch.nn.Parameter]]:
    ps, qs = _params(), _params()
    return (getattr(optim, name)(ps, **copy.deepcopy(kwargs)), ps,
            getattr(torch.optim, name)(qs, **copy.deepcopy(kwargs)), qs)


# Keys whose values differ from torch's by more than 1e-15 of their largest, and the bound:
# RMSprop's momentum buffer sums grad / (sqrt(square_avg) + eps) over steps, each quotient
# rounded on its own (torch's addcdiv_ adds it as it divides), a denominator near 1e-2 here.
_LOOSER = {("RMSprop", "momentum_buffer"): 1e-14}


def _same_state(ours: Any, ps: list[torch.nn.Parameter], theirs: Any,
                qs: list[torch.nn.Parameter], bitwise: bool = False) -> None:
    """Per param, optimizer.state holds torch's keys in torch's order, each of torch's
    dtype, device and shape, equal to torch's (to 1e-15 of its largest value, ``step``
    exactly, ``_LOOSER`` to its bound; ``bitwise`` all, where torch's own kernel steps
    both); the same params have state (torch may keep an empty entry for a param
    without: ``state[q]`` makes one, so torch's is read with ``get``)."""
    assert len(ours.state) == sum(1 for entry in theirs.state.values() if entry)
    for p, q in zip(ps, qs, strict=True):
        assert (p in ours.state) == bool(theirs.state.get(q))
        mine, expected = ours.state[p], theirs.state.get(q, {})
        assert list(mine) == list(expected)
        for key, value in expected.items():
            got = mine[key]
            assert (got.dtype, got.device, got.shape) == (value.dtype, value.device,
                                                          value.shape), key
            if key == "step" or bitwise:
                assert torch.equal(got, value), key
            else:
                scale = max(1.0, value.abs().max().item())
                bound = _LOOSER.get((type(theirs).__name__, key), 1e-15)
                assert (got - value).abs().max().item() <= bound * scale, key


@pytest.mark.parametrize(("name", "kwargs"), _rows())
def test_optimizer_state_holds_torchs_keys_and_values(name: str, kwargs: dict[str, Any]) -> None:
    _skip_torchs_fused_sgd(name, kwargs)
    ours, ps, theirs, qs = _pair(name, kwargs)
    _same_state(ours, ps, theirs, qs)  # before any step (Adagrad's: from construction)
    _run(ours, ps, _MISSING)
    _run(theirs, qs, _MISSING)
    # (fused Adam and AdamW run torch's _fused_adam(w)_ on both sides)
    _same_state(ours, ps, theirs, qs,
                bitwise=bool(kwargs.get("fused")) and name in ("Adam", "AdamW"))


def _edit(opt: Any, ps: list[torch.nn.Parameter]) -> None:
    """Writes through optimizer.state, as code written for torch.optim makes them: in place
    (param 0), replacing values (param 1), and replacing the whole entry (param 2)."""
    state = opt.state
    if ps[0] in state:
        for key, value in state[ps[0]].items():
            if key == "step":
                value.add_(2.0)
            else:
                value.mul_(0.5)
    if ps[1] in state:
        entry = state[ps[1]]
        for key in list(entry):
            value = entry[key]
            entry[key] = (torch.full_like(value, 7.0) if key == "step"
                          else value * 0.25 + 0.01 * value.sign())
    if ps[2] in state:
        state[ps[2]] = {k: v.clone() * (1 if k == "step" else 1.5)
                        for k, v in state[ps[2]].items()}


@pytest.mark.parametrize(("name", "kwargs"), _rows())
def test_writes_through_optimizer_state_change_the_next_steps_as_in_torch(
        name: str, kwargs: dict[str, Any]) -> None:
    _skip_torchs_fused_sgd(name, kwargs)
    ours, ps, theirs, qs = _pair(name, kwargs)
    _, unedited_ps, unedited, _ = _pair(name, kwargs)
    for opt, params in ((ours, ps), (theirs, qs), (unedited, unedited_ps)):
        _run(opt, params, _MISSING)
    held = {k: ours.state[ps[0]][k] for k in ours.state[ps[0]]}  # taken before the edits
    _edit(ours, ps)
    _edit(theirs, qs)
    _same_state(ours, ps, theirs, qs)
    assert all(v is ours.state[ps[0]][k] for k, v in held.items() if k != "step")
    for opt, params in ((ours, ps), (theirs, qs), (unedited, unedited_ps)):
        _steps(opt, params, 2)
    _close(ps, qs)
    _same_state(ours, ps, theirs, qs)
    # the tensors taken before the steps hold the state after them, as torch's step
    # updates its own in place (the pure path's new values are copied into them)
    assert all(v is ours.state[ps[0]][k] for k, v in held.items() if k != "step")
    if len(theirs.state):  # (a class with state: the edits changed the run)
        assert max((a - b).abs().max().item() for a, b in zip(qs, unedited_ps,
                                                               strict=True)) > 0


@pytest.mark.parametrize("restart", ["del", "clear", "empty", "whole state"])
def test_a_param_whose_state_is_removed_restarts_as_in_torch(restart: str) -> None:
    ours, ps, theirs, qs = _pair("Adam", {"lr": 0.1})
    for opt, params in ((ours, ps), (theirs, qs)):
        _run(opt, params, _MISSING)
        if restart == "del":
            del opt.state[params[1]]
        elif restart == "clear":
            opt.state[params[1]].clear()
        elif restart == "empty":
            opt.state[params[1]] = {}
        else:
            opt.state = collections.defaultdict(dict)
    _same_state(ours, ps, theirs, qs)
    for opt, params in ((ours, ps), (theirs, qs)):
        _steps(opt, params, 2)
    _close(ps, qs)
    _same_state(ours, ps, theirs, qs)


def test_a_write_of_one_params_step_leaves_the_others_counts() -> None:
    ours, ps, theirs, qs = _pair("AdamW", {"lr": 0.1, "fused": True})
    for opt, params in ((ours, ps), (theirs, qs)):
        _steps(opt, params, 2)  # one count for all three params
        opt.state[params[0]]["step"] = torch.tensor(10.0, dtype=torch.float32)  # (fused's)
        opt.state[params[1]]["step"].fill_(5.0)  # (in place: taken in by the next step)
    twin = copy.deepcopy(ours)  # (and by a copy)
    for opt, params in ((ours, ps), (theirs, qs), (twin, twin.param_groups[0]["params"])):
        _steps(opt, params, 2)
    assert [ours.state[p]["step"].item() for p in ps] == [12.0, 7.0, 4.0]
    _close(ps, qs)
    _same_state(ours, ps, theirs, qs)
    _same_state(twin, twin.param_groups[0]["params"], theirs, qs)


def test_a_step_taken_is_seen_through_a_view_taken_before_it() -> None:
    ours, ps, theirs, qs = _pair("Adam", {"lr": 0.1})
    _steps(ours, ps, 1)
    _steps(theirs, qs, 1)
    entry = ours.state[ps[0]]
    moment = entry["exp_avg"]
    _steps(ours, ps, 1)
    _steps(theirs, qs, 1)
    assert entry["step"].item() == 2.0
    assert torch.equal(entry["exp_avg"], theirs.state[qs[0]]["exp_avg"])
    assert torch.equal(moment, entry["exp_avg"])  # (the fused step updates it in place)


def test_a_complex_params_state_is_torchs_complex_view() -> None:
    g = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(3, dtype=torch.complex128, generator=g))
    q = torch.nn.Parameter(p.detach().clone())
    ours, theirs = optim.Adam([p], lr=0.1), torch.optim.Adam([q], lr=0.1)
    for opt, param in ((ours, p), (theirs, q)):
        for t in range(2):
            param.grad = torch.full_like(param, complex(0.3 * (t + 1), -0.2))
            opt.step()
        opt.state[param]["exp_avg"].mul_(0.5)  # (in place, through the complex view)
        param.grad = torch.full_like(param, complex(0.1, 0.4))
        opt.step()
    _same_state(ours, [p], theirs, [q])
    _close([p], [q])


def test_what_cannot_be_honoured_raises_naming_the_param_and_key() -> None:
    ours, ps, _, _ = _pair("Adam", {"lr": 0.1})
    _steps(ours, ps, 1, skip=(2,))
    where = r"param 0 of param_groups\[0\]"
    with pytest.raises(ValueError, match=where + r" has no 'momentum_buffer'; its state has "
                                               r"\['step', 'exp_avg', 'exp_avg_sq'\]"):
        ours.state[ps[0]]["momentum_buffer"] = torch.zeros_like(ps[0])
    with pytest.raises(ValueError, match=r"del optimizer.state\[p\]\['exp_avg'\] of " + where):
        del ours.state[ps[0]]["exp_avg"]
    with pytest.raises(ValueError, match=r"\['exp_avg'\] of " + where + r" has shape \(4,\)"):
        ours.state[ps[0]]["exp_avg"] = torch.zeros(4)
    with pytest.raises(ValueError, match=r"\['step'\] of " + where + r" is 1.5"):
        ours.state[ps[0]]["step"] = 1.5
    with pytest.raises(ValueError, match=r"lacks \['exp_avg_sq'\]"):
        ours.state[ps[0]] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(ps[0])}
    with pytest.raises(ValueError, match=r"param 2 of param_groups\[0\]: the param has no "
                                         r"state yet"):
        ours.state[ps[2]]["exp_avg"] = torch.zeros_like(ps[2])
    with pytest.raises(KeyError):
        ours.state[ps[2]]["exp_avg"]  # (no state: torch's entry is empty)
    frozen = optim.Adam([{"params": ps[:1]}, {"params": ps[1:], "frozen": True}], lr=0.1)
    with pytest.raises(ValueError, match=r"param 0 of param_groups\[1\]: the param's group "
                                         r"is frozen and keeps no state"):
        frozen.state[ps[1]] = {"step": torch.tensor(1.0)}


def test_muons_state_is_torchs() -> None:
    g = torch.Generator().manual_seed(4)
    ps = [torch.nn.Parameter(torch.randn(4, 3, generator=g)) for _ in range(2)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours, theirs = optim.Muon(ps, lr=0.02), torch.optim.Muon(qs, lr=0.02)
    for t, skip in enumerate([(1,), (), ()]):
        for k, (p, q) in enumerate(zip(ps, qs, strict=True)):
            p.grad = None if k in skip else torch.full_like(p, 0.1 * (t + 1)) + 0.1 * p.detach()
            q.grad = None if p.grad is None else p.grad.clone()
        ours.step()
        theirs.step()
        _same_state(ours, ps, theirs, qs)
        for opt, params in ((ours, ps), (theirs, qs)):
            opt.state[params[0]]["momentum_buffer"].mul_(0.5)
    _close(ps, qs)


def test_copies_of_optimizer_state_are_torchs_plain_dicts() -> None:
    ours, ps, theirs, qs = _pair("NAdam", {"lr": 0.1})
    _steps(ours, ps, 2)
    _steps(theirs, qs, 2)
    copied = copy.deepcopy(ours.state)  # (its keys copies of the params, as torch's)
    assert type(copied) is collections.defaultdict and len(copied) == len(ps)
    for p, q, entry in zip(ps, qs, copied.values(), strict=True):
        assert type(entry) is dict and entry.keys() == theirs.state[q].keys()
        assert all(v is not ours.state[p][k] and torch.equal(v, ours.state[p][k])
                   for k, v in entry.items())
        assert type(copy.copy(ours.state[p])) is dict
        loaded = _through_file(ours.state[p])  # (weights_only: an OrderedDict of tensors)
        assert list(loaded) == list(theirs.state[q])
        assert all(torch.equal(v, ours.state[p][k]) for k, v in loaded.items())


def test_keys_that_are_no_param_are_kept_as_in_torch() -> None:
    ours, ps, _, _ = _pair("Adam", {"lr": 0.1})
    _steps(ours, ps, 1)
    ours.state["note"] = {"epoch": 3}  # (what a state-dict hook may keep there)
    assert "note" in ours.state and ours.state["note"] == {"epoch": 3}
    assert list(ours.state) == [*ps, "note"]
    saved = _through_file(ours.state_dict())
    assert saved["state"]["note"] == {"epoch": 3}
    other = optim.Adam(_params(), lr=0.1)
    other.load_state_dict(saved)
    assert other.state["note"] == {"epoch": 3}
    del other.state["note"]
    assert "note" not in other.state and len(other.state) == 3


def test_functopt_optimizer_over_a_transform_keeps_its_state_paths() -> None:
    ps = _params()
    opt = functopt.Optimizer(ps, functopt.adamw(0.1))
    _steps(opt, ps, 1)
    assert sorted(opt.state[ps[0]]) == ['count', 'inner_state.0.count', 'inner_state.0.mu',
                                        'inner_state.0.nu']


class _Holder(torch.nn.Module):
    """A module over the params (DCP's helpers take the model)."""

    def __init__(self, ps: list[torch.nn.Parameter]) -> None:
        super().__init__()
        for k, p in enumerate(ps):
            self.register_parameter(f"p{k}", p)


def _lightning_move(opt: Any, ps: list[torch.nn.Parameter], fresh: Any) -> Any:
    from lightning_fabric.utilities.optimizer import _optimizer_to_device
    _optimizer_to_device(opt, torch.device("cpu"))
    return opt


def _accelerate(opt: Any, ps: list[torch.nn.Parameter], fresh: Any) -> Any:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    Accelerator(cpu=True)
    return AcceleratedOptimizer(opt, device_placement=True)


def _dcp_round_trip(opt: Any, ps: list[torch.nn.Parameter], fresh: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    model = _Holder(ps)
    set_optimizer_state_dict(model, opt, get_optimizer_state_dict(model, opt))
    return opt


def _dcp_into_a_fresh_optimizer(opt: Any, ps: list[torch.nn.Parameter], fresh: Any) -> Any:
    # the fresh optimizer's state is empty: the helpers take their zero-gradient step first
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    saved = copy.deepcopy(get_optimizer_state_dict(_Holder(ps), opt))
    other = fresh(ps)
    set_optimizer_state_dict(_Holder(ps), other, saved)
    return other


_HELPERS = {"lightning-optimizer-to-device": _lightning_move, "accelerate": _accelerate,
            "dcp-get-set": _dcp_round_trip, "dcp-into-fresh": _dcp_into_a_fresh_optimizer}
_HELPER_ROWS = [("Adam", {"lr": 0.1}), ("AdamW", {"lr": 0.1, "fused": True}),
                ("SGD", {"lr": 0.1, "momentum": 0.9}), ("NAdam", {"lr": 0.1}),
                ("Adagrad", {"lr": 0.1}), ("Adafactor", {"lr": 0.1})]


@pytest.mark.parametrize("helper", sorted(_HELPERS))
@pytest.mark.parametrize(("name", "kwargs"), _HELPER_ROWS,
                         ids=[name for name, _ in _HELPER_ROWS])
def test_frameworks_state_helpers_continue_the_run_as_torchs(
        helper: str, name: str, kwargs: dict[str, Any]) -> None:
    pytest.importorskip("lightning_fabric")
    pytest.importorskip("accelerate")
    ours, ps, theirs, qs = _pair(name, kwargs)
    _run(ours, ps, _MISSING)
    _run(theirs, qs, _MISSING)
    ours = _HELPERS[helper](ours, ps, lambda ps: getattr(optim, name)(ps, **kwargs))
    theirs = _HELPERS[helper](theirs, qs, lambda qs: getattr(torch.optim, name)(qs, **kwargs))
    _same_state(ours, ps, theirs, qs)
    _steps(ours, ps, 2)
    _steps(theirs, qs, 2)
    _close(ps, qs)
    _same_state(ours, ps, theirs, qs)
