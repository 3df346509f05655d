"""Params without a gradient on some steps: exact as torch.optim, or a clear error.

torch.optim counts steps per param; a functopt transform counts them per group. The law:
for every pattern of missing gradients, a drop-in optimizer either trains as torch.optim's
(float64, to 1e-14) or raises, before anything is written, naming the param, where the
rule reads the count and the param's own count would not be the group's. The rows that
raise are the ones where the result would differ; the rows that do not are exact.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt import optim

# patterns of which steps param b has a gradient at (a has one at every step)
LATE = (False, True, True)  # b's first gradient after the others stepped
GAP = (True, False, True)  # b skips a step in the middle
NEVER = (False, False, False)  # b never has one
ALWAYS = (True, True, True)

# (class, kwargs): rules that read the step count at every step
COUNTED = [("Adam", {"lr": 0.1}), ("AdamW", {"lr": 0.1}), ("NAdam", {"lr": 0.1}),
           ("RAdam", {"lr": 0.1}), ("Adamax", {"lr": 0.1}),
           ("Adagrad", {"lr": 0.1, "lr_decay": 0.1})]
# rules that read no count: exact under any pattern
UNCOUNTED = [("SGD", {"lr": 0.1}), ("SGD", {"lr": 0.1, "momentum": 0.9}),
             ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
             ("RMSprop", {"lr": 0.1}), ("RMSprop", {"lr": 0.1, "momentum": 0.5, "centered": True}),
             ("Adagrad", {"lr": 0.1}), ("Adadelta", {"lr": 0.1}), ("Rprop", {"lr": 0.1})]
DAMPENED = ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.3})


pytestmark = pytest.mark.usefixtures("float64_default")


def _params() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(2, 1)  # 'weight' (a) and 'bias' (b)


def _train(make: Any, pattern: tuple[bool, ...], named: bool = True) -> list[torch.Tensor]:
    model = _params()
    opt = make(list(model.named_parameters()) if named else list(model.parameters()))
    for t, has in enumerate(pattern):
        model.weight.grad = torch.full_like(model.weight, 0.3 * (t + 1))
        model.bias.grad = torch.full_like(model.bias, -0.2 * (t + 2)) if has else None
        opt.step()
    return [model.weight.detach(), model.bias.detach()]


def _close(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for g, e in zip(got, expected, strict=True):
        assert (g - e).abs().max().item() <= 1e-14 * max(1.0, e.abs().max().item())


def _torch(name: str, kwargs: dict[str, Any]) -> Any:
    return lambda ps: getattr(torch.optim, name)([p for _, p in ps], **kwargs)


def _raises_naming_bias(make: Any, pattern: tuple[bool, ...], where: str) -> None:
    model = _params()
    opt = make(list(model.named_parameters()))
    start = [p.detach().clone() for p in model.parameters()]
    # the first step at which b has a gradient after missing one
    raising = next(t for t, has in enumerate(pattern) if has and not all(pattern[:t]))
    for t, has in enumerate(pattern):
        model.weight.grad = torch.full_like(model.weight, 0.3 * (t + 1))
        model.bias.grad = torch.full_like(model.bias, -0.2 * (t + 2)) if has else None
        if t < raising:
            opt.step()
            start = [p.detach().clone() for p in model.parameters()]
            continue
        with pytest.raises(ValueError, match=f"{where} has a gradient at this step, but had "
                                             f"none at 1 of the .* earlier steps.*Fix: give "
                                             f"the param a zero gradient"):
            opt.step()
        # nothing was written: not the param, not the others
        assert all(torch.equal(p.detach(), s)
                   for p, s in zip(model.parameters(), start, strict=True))
        return
    raise AssertionError("no step raised")


@pytest.mark.parametrize(("name", "kwargs"), COUNTED, ids=[c[0] + str(len(c[1])) for c in COUNTED])
@pytest.mark.parametrize("pattern", [LATE, GAP], ids=["late", "gap"])
def test_a_counted_rule_raises_naming_the_param(name: str, kwargs: dict[str, Any],
                                                pattern: tuple[bool, ...]) -> None:
    _raises_naming_bias(lambda ps: getattr(optim, name)(ps, **kwargs), pattern,
                        r"param 1 \('bias'\) of param_groups\[0\]")


def test_unnamed_params_are_named_by_group_and_position() -> None:
    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    opt = optim.Adam([{"params": [a]}, {"params": [a.new_ones(1).requires_grad_(), b]}],
                     lr=0.1)
    c = opt.param_groups[1]["params"][0]
    a.grad, c.grad = torch.ones(1), torch.ones(1)
    opt.step()
    b.grad = torch.ones(1)
    with pytest.raises(ValueError, match=r"functopt.optim.Adam.step: param 1 of "
                                         r"param_groups\[1\] has a gradient"):
        opt.step()


def test_issue_case_adam_would_have_been_off() -> None:
    # b without a gradient at step 1: torch's b is 0.9000 after step 2 (its first step)
    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    ref = [torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))]
    opt, torch_opt = optim.Adam([a, b], lr=0.1), torch.optim.Adam(ref, lr=0.1)
    for o, (x, y) in ((opt, (a, b)), (torch_opt, ref)):
        x.grad = torch.ones(1)
        o.step()
        x.grad, y.grad = torch.ones(1), torch.ones(1)
    torch_opt.step()
    assert ref[1].item() == pytest.approx(0.9)
    with pytest.raises(ValueError, match=r"param 1 of param_groups\[0\].*step count for "
                                         r"this param would be 1.*it would use 2"):
        opt.step()
    # the fix the message gives: a zero gradient on the steps without one
    b.grad = None
    fixed = optim.Adam([a, b], lr=0.1)
    a.grad, b.grad = torch.ones(1), torch.zeros(1)
    fixed.step()
    a.grad, b.grad = torch.ones(1), torch.ones(1)
    fixed.step()


def test_functopt_optimizer_over_adamw_raises() -> None:
    _raises_naming_bias(lambda ps: functopt.Optimizer(ps, functopt.adamw(0.1)), LATE,
                        r"functopt.Optimizer.step: param 1 \('bias'\) of param_groups\[0\]")


def test_mixed_precision_optimizer_over_torch_adam_raises() -> None:
    _raises_naming_bias(lambda ps: functopt.MixedPrecisionOptimizer(
        torch.optim.Adam([p for _, p in ps], lr=0.1)), LATE,
        r"MixedPrecisionOptimizer.step: param '1'")


@pytest.mark.parametrize(("name", "kwargs"), COUNTED + UNCOUNTED + [DAMPENED],
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(COUNTED + UNCOUNTED
                                                                   + [DAMPENED])])
@pytest.mark.parametrize("pattern", [NEVER, ALWAYS], ids=["never", "always"])
def test_params_that_never_or_always_step_are_exact(name: str, kwargs: dict[str, Any],
                                                    pattern: tuple[bool, ...]) -> None:
    _close(_train(lambda ps: getattr(optim, name)(ps, **kwargs), pattern),
           _train(_torch(name, kwargs), pattern))


@pytest.mark.parametrize(("name", "kwargs"), UNCOUNTED, ids=[f"{c[0]}-{i}" for i, c in
                                                            enumerate(UNCOUNTED)])
@pytest.mark.parametrize("pattern", [LATE, GAP], ids=["late", "gap"])
def test_a_rule_without_counts_is_exact(name: str, kwargs: dict[str, Any],
                                        pattern: tuple[bool, ...]) -> None:
    _close(_train(lambda ps: getattr(optim, name)(ps, **kwargs), pattern),
           _train(_torch(name, kwargs), pattern))


def test_dampened_momentum_raises_on_a_late_first_step_only() -> None:
    name, kwargs = DAMPENED
    # a gap after the first step: both take their first gradient undamped, exact
    _close(_train(lambda ps: getattr(optim, name)(ps, **kwargs), GAP),
           _train(_torch(name, kwargs), GAP))
    _raises_naming_bias(lambda ps: optim.SGD(ps, **kwargs), LATE,
                        r"param 1 \('bias'\) of param_groups\[0\]")


def test_a_group_whose_params_miss_steps_together_is_exact() -> None:
    # a group without gradients does not step, so its count stays its params' count
    def groups(ps: list[Any]) -> list[dict[str, Any]]:
        return [{"params": [ps[0]]}, {"params": [ps[1]]}]

    _close(_train(lambda ps: optim.Adam(groups(ps), lr=0.1), LATE, named=False),
           _train(lambda ps: torch.optim.Adam(groups(ps), lr=0.1), LATE, named=False))
    _close(_train(lambda ps: functopt.Optimizer(groups(ps), functopt.adamw(0.1)), LATE,
                  named=False),
           _train(lambda ps: torch.optim.AdamW(groups(ps), lr=0.1, weight_decay=1e-4), LATE,
                  named=False))


def test_a_restart_or_a_loaded_state_counts_from_there() -> None:
    model = _params()
    opt = optim.Adam(model.parameters(), lr=0.1)
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    model.bias.grad = torch.ones_like(model.bias)
    with pytest.raises(ValueError, match="had none at 1"):
        opt.step()
    opt.load_state_dict(saved)  # one count for all params again
    opt.step()
    opt.state.clear()  # restarts from init: one count for all again
    model.bias.grad = None
    opt.step()
    opt.state.clear()
    model.bias.grad = torch.ones_like(model.bias)
    opt.step()


@settings(max_examples=40, deadline=None)
@given(row=st.sampled_from(COUNTED + UNCOUNTED + [DAMPENED]),
       pattern=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=5))
def test_any_pattern_is_exact_or_raises_where_torch_counts_differ(
        row: tuple[str, dict[str, Any]], pattern: list[tuple[bool, bool]]) -> None:
    # Which of a and b have a gradient at each step. torch's count per param against the
    # group's: a step must raise exactly where a rule reading it would see them differ.
    name, kwargs = row
    reads_every = row in COUNTED
    starts_apart = row == DAMPENED
    model, ref = _params(), _params()
    opt = getattr(optim, name)(model.parameters(), **kwargs)
    torch_opt = getattr(torch.optim, name)(ref.parameters(), **kwargs)
    group, own = 0, [0, 0]
    for t, has in enumerate(pattern):
        for m in (model, ref):
            for p, h in zip(m.parameters(), has, strict=True):
                p.grad = torch.full_like(p, 0.1 * (t + 1)) if h else None
        stepping = [i for i in (0, 1) if has[i]]
        differs = any((reads_every and own[i] != group)
                      or (starts_apart and own[i] == 0 and group > 0) for i in stepping)
        if differs:
            with pytest.raises(ValueError, match="has a gradient at this step"):
                opt.step()
            return
        opt.step()
        torch_opt.step()
        if stepping:
            group += 1
            for i in stepping:
                own[i] += 1
        _close([p.detach() for p in model.parameters()],
               [p.detach() for p in ref.parameters()])


def test_a_frozen_group_that_missed_steps_does_not_raise() -> None:
    # a frozen group does not step, whatever gradients its params have
    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    c = torch.nn.Parameter(torch.ones(1))
    opt = functopt.Optimizer([{"params": [a, b]}, {"params": [c]}], functopt.adamw(0.1))
    a.grad = torch.ones(1)
    opt.step()  # b misses it
    b.grad, c.grad = torch.ones(1), torch.ones(1)
    opt.param_groups[0]["frozen"] = True
    before = [a.detach().clone(), b.detach().clone()]
    opt.step()
    assert torch.equal(a.detach(), before[0]) and torch.equal(b.detach(), before[1])
    opt.param_groups[0]["frozen"] = False  # stepping again with b: its count is behind
    with pytest.raises(ValueError, match=r"param 1 of param_groups\[0\]"):
        opt.step()
