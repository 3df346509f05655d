"""functopt.optim with several param groups: every per-group value torch.optim lets differ.

Law: for every class and each numeric hyperparameter torch.optim lets a group set, an
optimizer of two groups, the second setting its own value, trains as torch.optim's over 3
steps in float64, and its second group is bitwise the one-group optimizer built with that
value. The options that choose the chain's stages (``amsgrad``, ``maximize``, ...) may
differ per group too: such a group runs its own chain, trains as torch.optim's, and is
bitwise the one-group optimizer built with its options.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import functopt
from functopt import optim

# class: (constructor kwargs, {group key: a value other than the constructor's})
GROUP_VALUES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "SGD": ({"lr": 0.1, "momentum": 0.9},
            {"lr": 0.3, "momentum": 0.5, "weight_decay": 0.1}),
    "Adam": ({"lr": 0.1}, {"lr": 0.3, "betas": (0.8, 0.99), "eps": 1e-3, "weight_decay": 0.1}),
    "AdamW": ({"lr": 0.1}, {"lr": 0.3, "betas": (0.8, 0.99), "eps": 1e-3, "weight_decay": 0.1}),
    "NAdam": ({"lr": 0.1}, {"lr": 0.3, "betas": (0.8, 0.99), "eps": 1e-3, "weight_decay": 0.1,
                            "momentum_decay": 0.01}),
    "RAdam": ({"lr": 0.1}, {"lr": 0.3, "betas": (0.8, 0.99), "eps": 1e-3, "weight_decay": 0.1}),
    "Adamax": ({"lr": 0.1}, {"lr": 0.3, "betas": (0.8, 0.99), "eps": 1e-3,
                             "weight_decay": 0.1}),
    "RMSprop": ({"lr": 0.1}, {"lr": 0.3, "alpha": 0.8, "eps": 1e-3, "weight_decay": 0.1,
                              "momentum": 0.5}),
    "Adagrad": ({"lr": 0.1}, {"lr": 0.3, "lr_decay": 0.1, "eps": 1e-3, "weight_decay": 0.1,
                              "initial_accumulator_value": 0.5}),
    "Adadelta": ({"lr": 0.1}, {"lr": 0.3, "rho": 0.5, "eps": 1e-3, "weight_decay": 0.1}),
    "Rprop": ({"lr": 0.1}, {"lr": 0.5}),
}
# class: {option that chooses the chain's stages: a value other than the default}
OPTIONS: dict[str, dict[str, Any]] = {
    "SGD": {"dampening": 0.2, "nesterov": True, "maximize": True},
    "Adam": {"amsgrad": True, "maximize": True, "decoupled_weight_decay": True},
    "AdamW": {"amsgrad": True, "maximize": True},
    "NAdam": {"decoupled_weight_decay": True, "maximize": True},
    "RAdam": {"decoupled_weight_decay": True, "maximize": True},
    "Adamax": {"maximize": True},
    "RMSprop": {"centered": True, "maximize": True},
    "Adagrad": {"maximize": True},
    "Adadelta": {"maximize": True},
    "Rprop": {"etas": (0.4, 1.5), "step_sizes": (1e-3, 0.11), "maximize": True},
}
# constructor kwargs an option needs beside the class's usual ones
NEEDS: dict[str, dict[str, Any]] = {"nesterov": {"momentum": 0.9},
                                    "decoupled_weight_decay": {"weight_decay": 0.1}}
STEPS = 3


pytestmark = pytest.mark.usefixtures("float64_default")


def _start() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, generator=g), torch.randn(2, 2, generator=g)


def _train(make: Any, groups: list[dict[str, Any]] | None = None) -> list[torch.Tensor]:
    """Params a and b after STEPS steps of ``make(params or groups)``."""
    a, b = (torch.nn.Parameter(t.clone()) for t in _start())
    opt = make([a, b] if groups is None else [{**g, "params": [p]}
                                              for g, p in zip(groups, (a, b), strict=True)])
    for t in range(STEPS):
        a.grad = torch.sin(a.detach() * (t + 1))
        b.grad = torch.cos(b.detach() * (t + 2))
        opt.step()
    return [a.detach(), b.detach()]


def _rows() -> list[Any]:
    return [pytest.param(name, key, value, id=f"{name}-{key}")
            for name, (_, values) in GROUP_VALUES.items() for key, value in values.items()]


@pytest.mark.parametrize(("name", "key", "value"), _rows())
def test_a_group_value_trains_as_torch(name: str, key: str, value: Any) -> None:
    kwargs = GROUP_VALUES[name][0]
    groups: list[dict[str, Any]] = [{}, {key: value}]
    expected = _train(lambda ps: getattr(torch.optim, name)(ps, **kwargs), groups)
    got = _train(lambda ps: getattr(optim, name)(ps, **kwargs), groups)
    for g, e, s in zip(got, expected, _start(), strict=True):
        assert (g - e).abs().max().item() <= 1e-14 * max(1.0, e.abs().max().item()), (name, key)
        assert not torch.equal(e, s)
    # the second group is the one-group optimizer built with the group's value, bitwise
    alone = _train(lambda ps: getattr(optim, name)(
        ps, **{**kwargs, **({} if name == "Adagrad" and key == "initial_accumulator_value"
                            else {key: value})}))
    assert torch.equal(got[1], alone[1]), (name, key)


@pytest.mark.parametrize(("name", "key", "value"), _rows())
def test_a_group_back_at_the_default_trains_as_torch(name: str, key: str, value: Any) -> None:
    # the constructor sets the value, a group torch's default (HF Trainer's no-decay group)
    default = inspect.signature(getattr(torch.optim, name)).parameters[key].default
    kwargs = {**GROUP_VALUES[name][0], key: value}
    groups: list[dict[str, Any]] = [{}, {key: default}]
    expected = _train(lambda ps: getattr(torch.optim, name)(ps, **kwargs), groups)
    got = _train(lambda ps: getattr(optim, name)(ps, **kwargs), groups)
    for g, e in zip(got, expected, strict=True):
        assert (g - e).abs().max().item() <= 1e-14 * max(1.0, e.abs().max().item()), (name, key)


@pytest.mark.parametrize("name", list(GROUP_VALUES))
def test_add_param_group_with_a_group_value(name: str) -> None:
    kwargs, values = GROUP_VALUES[name]
    key, value = next(iter(values.items()))

    def make(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        opt = getattr(optim if make.functopt else torch.optim, name)([groups[0]], **kwargs)
        opt.add_param_group(groups[1])
        return opt

    make.functopt = False  # type: ignore[attr-defined]
    expected = _train(make, [{}, {key: value}])
    make.functopt = True  # type: ignore[attr-defined]
    got = _train(make, [{}, {key: value}])
    for g, e in zip(got, expected, strict=True):
        assert (g - e).abs().max().item() <= 1e-14 * max(1.0, e.abs().max().item())


def test_sgd_groups_as_hf_trainer_builds_them() -> None:
    # HF Trainer: optimizer_cls(grouped_parameters, **optimizer_kwargs), the groups
    # setting weight_decay (0.0 for biases and norms)
    model = torch.nn.Linear(3, 2)
    groups = [{"params": [model.weight], "weight_decay": 0.01},
              {"params": [model.bias], "weight_decay": 0.0}]
    opt = optim.SGD(groups, lr=0.1, momentum=0.9)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert all(g["dampening"] == 0 and g["nesterov"] is False for g in opt.param_groups)
    ref_model = torch.nn.Linear(3, 2)
    ref_model.load_state_dict(model.state_dict())
    ref = torch.optim.SGD([{"params": [ref_model.weight], "weight_decay": 0.01},
                           {"params": [ref_model.bias], "weight_decay": 0.0}],
                          lr=0.1, momentum=0.9)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert (p - q).abs().max().item() <= 1e-14


def test_rprop_group_lr_is_the_initial_step() -> None:
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = optim.Rprop([{"params": [a], "lr": 0.5}, {"params": [b]}], lr=0.01)
    a.grad, b.grad = torch.ones(1), torch.ones(1)
    opt.step()
    assert a.item() == -0.5 and b.item() == -0.01


def test_rprop_lr_a_scheduler_sets_before_the_first_step() -> None:
    # torch.optim.Rprop makes its step sizes at the first step, from the lr then
    got = []
    for cls in (torch.optim.Rprop, optim.Rprop):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = cls([p], lr=0.1)
        torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5)
        p.grad = torch.ones(1)
        opt.step()
        got.append(p.item())
    assert got == [-0.05, -0.05]


def test_a_functopt_optimizer_group_starts_from_its_values() -> None:
    # rprop reads its learning rate when the state is created
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = functopt.Optimizer([{"params": [a], "lr": 0.5}, {"params": [b]}],
                             functopt.rprop(0.01), fused=False)
    a.grad, b.grad = torch.ones(1), torch.ones(1)
    opt.step()
    assert a.item() == -0.5 and b.item() == -0.01


def _option_rows() -> list[Any]:
    return [pytest.param(name, key, value, id=f"{name}-{key}")
            for name, options in OPTIONS.items() for key, value in options.items()]


@pytest.mark.parametrize(("name", "key", "value"), _option_rows())
def test_a_group_option_trains_as_torch(name: str, key: str, value: Any) -> None:
    kwargs = {**GROUP_VALUES[name][0], **NEEDS.get(key, {})}
    groups: list[dict[str, Any]] = [{}, {key: value}]
    expected = _train(lambda ps: getattr(torch.optim, name)(ps, **kwargs), groups)
    got = _train(lambda ps: getattr(optim, name)(ps, **kwargs), groups)
    for g, e in zip(got, expected, strict=True):
        assert (g - e).abs().max().item() <= 1e-14 * max(1.0, e.abs().max().item()), (name, key)
    # the first group is the constructor's chain, the second the one of its own options
    alone = _train(lambda ps: getattr(optim, name)(ps, **kwargs))
    assert torch.equal(got[0], alone[0]), (name, key)
    alone = _train(lambda ps: getattr(optim, name)(ps, **{**kwargs, key: value}))
    assert torch.equal(got[1], alone[1]), (name, key)
    # the option changes the second group's params wherever it changes torch's (AMSGrad's
    # maximum of a second moment that never fell equals the moment itself)
    if not torch.equal(expected[1], _train(lambda ps: getattr(torch.optim, name)(ps, **kwargs))[1]):
        assert not torch.equal(got[1], _train(lambda ps: getattr(optim, name)(ps, **kwargs))[1])

    def added(ps: list[dict[str, Any]]) -> torch.optim.Optimizer:
        opt = getattr(optim, name)([ps[0]], **kwargs)
        opt.add_param_group(ps[1])
        return opt

    for g, e in zip(_train(added, groups), expected, strict=True):
        assert (g - e).abs().max().item() <= 1e-14 * max(1.0, e.abs().max().item()), (name, key)


@pytest.mark.parametrize(("name", "key", "value"), _option_rows())
def test_a_group_option_changed_after_its_first_step_raises(name: str, key: str,
                                                           value: Any) -> None:
    kwargs = {**GROUP_VALUES[name][0], **NEEDS.get(key, {})}
    a = torch.nn.Parameter(torch.ones(2))
    opt = getattr(optim, name)([a], **kwargs)
    a.grad = torch.ones(2)
    opt.step()
    before = a.detach().clone()
    old = opt.param_groups[0][key]
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=rf"param_groups\[0\] changed {key}=.* after its "
                                         rf"first step.*Fix: set them when the group is added"):
        opt.step()
    assert torch.equal(a.detach(), before)
    opt.param_groups[0][key] = old  # back to the options its state was made for
    opt.step()
    assert not torch.equal(a.detach(), before)


def test_a_group_option_the_constructor_rejects_raises_naming_the_group() -> None:
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match=r"param_groups\[1\] holds \{'amsgrad': 'yes'\}.*"
                                        r"amsgrad"):
        optim.Adam([{"params": [a]}, {"params": [b], "amsgrad": "yes"}])
    opt = optim.Rprop([a])
    with pytest.raises(ValueError, match=r"param_groups\[1\] holds \{'etas'"):
        opt.add_param_group({"params": [b], "etas": (2.0, 0.5)})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize(("name", "key", "value"), [
    ("SGD", "momentum", 0.9), ("RMSprop", "momentum", 0.5), ("Adam", "weight_decay", 0.1),
    ("Adagrad", "weight_decay", 0.1), ("Adadelta", "weight_decay", 0.1)])
def test_a_later_group_needing_a_stage_the_constructor_left_out_trains_as_torch(
        name: str, key: str, value: Any) -> None:
    # 0 in the constructor and every group: the constructor's chain has no such stage (as
    # torch skips the maths); a group added later with another value gets a chain with it
    def make(module: Any) -> Any:
        def build(ps: list[dict[str, Any]]) -> torch.optim.Optimizer:
            opt = getattr(module, name)([ps[0]], lr=0.1)
            opt.add_param_group(ps[1])
            return opt
        return build

    groups: list[dict[str, Any]] = [{}, {key: value}]
    expected = _train(make(torch.optim), groups)
    got = _train(make(optim), groups)
    for g, e in zip(got, expected, strict=True):
        assert (g - e).abs().max().item() <= 1e-14 * max(1.0, e.abs().max().item())
    assert not torch.equal(got[1], _train(lambda ps: getattr(optim, name)(ps, lr=0.1))[1])


def test_an_optimizer_with_a_group_option_pickles_and_continues_bitwise() -> None:
    import pickle

    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = optim.AdamW([{"params": [a]}, {"params": [b], "amsgrad": True, "maximize": True}],
                      lr=0.1)
    for t in range(2):
        a.grad, b.grad = torch.full((3,), 0.3 * (t + 1)), torch.full((2,), -0.2 * (t + 1))
        opt.step()
    copy = pickle.loads(pickle.dumps(opt))
    qa, qb = (g["params"][0] for g in copy.param_groups)
    assert copy.param_groups[1]["amsgrad"] is True
    for o, (x, y) in ((opt, (a, b)), (copy, (qa, qb))):
        x.grad, y.grad = torch.full((3,), 0.5), torch.full((2,), 0.5)
        o.step()
    assert torch.equal(a, qa) and torch.equal(b, qb)
    assert sorted(copy.state_dict()["state"][1]) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                                     "step"]


@pytest.mark.parametrize("name", ["Rprop", "Adadelta"])
def test_a_zero_weight_decay_on_a_class_without_it_is_kept_and_steps_as_torch(
        name: str) -> None:
    # code written for several torch.optim classes sets weight_decay=0.0 on a bias group
    made = {}
    for module in (torch.optim, optim):
        g = torch.Generator().manual_seed(0)
        w, b = (torch.nn.Parameter(torch.randn(3, 2, generator=g, dtype=torch.float64))
                for _ in range(2))
        groups = [{"params": [w]}, {"params": [b], "weight_decay": 0.0}]
        if name == "Rprop":
            opt = getattr(module, name)(groups, lr=0.1)
        else:
            opt = getattr(module, name)(groups, lr=0.1, weight_decay=0.1)
        for t in range(3):
            for p in (w, b):
                p.grad = torch.sin(p.detach() * (t + 1))
            opt.step()
        made[module] = (w.detach(), b.detach(), opt.param_groups[1]["weight_decay"])
    assert torch.equal(made[optim][0], made[torch.optim][0])
    assert torch.equal(made[optim][1], made[torch.optim][1])
    assert made[optim][2] == made[torch.optim][2] == 0.0


def test_a_nonzero_weight_decay_on_a_class_without_it_still_raises() -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="'weight_decay'"):
        optim.Rprop([{"params": [w], "weight_decay": 0.1}])
    opt = optim.Rprop([{"params": [w], "weight_decay": 0.0}])
    opt.param_groups[0]["weight_decay"] = 0.01
    w.grad = torch.ones(2)
    with pytest.raises(ValueError, match="'weight_decay'"):
        opt.step()
