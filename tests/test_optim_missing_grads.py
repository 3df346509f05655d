"""Params without a gradient on some steps: exact as torch.optim.

torch.optim counts steps per param and skips a param whose ``.grad`` is None; so do the
drop-ins (each param keeps its own count; a step runs once per count among the params that
have a gradient). The law: for every pattern of missing gradients, a drop-in optimizer trains
as torch.optim's (float64, to 1e-15). ``MixedPrecisionOptimizer`` over a torch optimizer
still counts per optimizer and raises, before anything is written, naming the param, where
the counts would differ.
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
           ("Adagrad", {"lr": 0.1, "lr_decay": 0.1}),
           ("Adam", {"lr": 0.1, "amsgrad": True, "weight_decay": 0.1}),
           ("AdamW", {"lr": 0.1, "maximize": True}),
           ("NAdam", {"lr": 0.1, "decoupled_weight_decay": True, "weight_decay": 0.1}),
           ("RAdam", {"lr": 0.1, "weight_decay": 0.1}),
           ("Adafactor", {"lr": 0.1}), ("Adafactor", {"weight_decay": 0.1, "maximize": True})]
# rules that read no count
UNCOUNTED = [("SGD", {"lr": 0.1}), ("SGD", {"lr": 0.1, "momentum": 0.9}),
             ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
             ("RMSprop", {"lr": 0.1}), ("RMSprop", {"lr": 0.1, "momentum": 0.5, "centered": True}),
             ("Adagrad", {"lr": 0.1}), ("Adadelta", {"lr": 0.1}), ("Rprop", {"lr": 0.1})]
DAMPENED = ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.3})
ROWS = [*COUNTED, *UNCOUNTED, DAMPENED]


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
        assert (g - e).abs().max().item() <= 1e-15 * max(1.0, e.abs().max().item())


def _torch(name: str, kwargs: dict[str, Any]) -> Any:
    return lambda ps: getattr(torch.optim, name)([p for _, p in ps], **kwargs)


def _ids(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [f"{name}-{i}" for i, (name, _) in enumerate(rows)]


@pytest.mark.parametrize(("name", "kwargs"), ROWS, ids=_ids(ROWS))
@pytest.mark.parametrize("pattern", [LATE, GAP, NEVER, ALWAYS],
                         ids=["late", "gap", "never", "always"])
def test_every_class_is_exact_under_missing_gradients(name: str, kwargs: dict[str, Any],
                                                      pattern: tuple[bool, ...]) -> None:
    _close(_train(lambda ps: getattr(optim, name)(ps, **kwargs), pattern),
           _train(_torch(name, kwargs), pattern))


def test_issue_case_adam_is_torchs() -> None:
    # b without a gradient at step 1: torch's b is 0.9000 after step 2 (its first step)
    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    ref = [torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))]
    opt, torch_opt = optim.Adam([a, b], lr=0.1), torch.optim.Adam(ref, lr=0.1)
    for o, (x, y) in ((opt, (a, b)), (torch_opt, ref)):
        x.grad = torch.ones(1)
        o.step()
        x.grad, y.grad = torch.ones(1), torch.ones(1)
        o.step()
    assert ref[1].item() == pytest.approx(0.9)
    assert torch.equal(a.detach(), ref[0].detach()) and torch.equal(b.detach(), ref[1].detach())
    # each param's own count, as torch's step
    assert opt.state[a]["step"].item() == 2
    assert opt.state[b]["step"].item() == 1


def test_functopt_optimizer_over_adamw_is_torchs() -> None:
    for pattern in (LATE, GAP):
        _close(_train(lambda ps: functopt.Optimizer(ps, functopt.adamw(0.1)), pattern),
               _train(lambda ps: torch.optim.AdamW([p for _, p in ps], lr=0.1,
                                                   weight_decay=1e-4), pattern))


def test_counts_that_agree_again_share_one_run() -> None:
    # a misses step 1, b step 2: both have stepped once, and step as one again
    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    opt = optim.Adam([a, b], lr=0.1)
    b.grad = torch.ones(1)
    opt.step()
    a.grad, b.grad = torch.ones(1), None
    opt.step()
    store = opt._made_store()  # (the entries the step reads: one count tensor for both)
    assert store[a]["count"] is store[b]["count"]
    assert opt.state[a]["step"].item() == opt.state[b]["step"].item() == 1


def test_mixed_precision_optimizer_over_torch_adam_raises() -> None:
    # (its translated torch optimizer counts per optimizer: a late param is refused)
    model = _params()
    opt = functopt.MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()
    start = [p.detach().clone() for p in model.parameters()]
    model.weight.grad, model.bias.grad = torch.ones_like(model.weight), torch.ones_like(
        model.bias)
    with pytest.raises(ValueError, match=r"MixedPrecisionOptimizer.step: param '1' has a "
                                         r"gradient at this step, but had none at 1"):
        opt.step()
    assert all(torch.equal(p.detach(), s)
               for p, s in zip(model.parameters(), start, strict=True))


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
    model, ref = _params(), _params()
    opt = optim.Adam(model.parameters(), lr=0.1)
    torch_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    for m, o in ((model, opt), (ref, torch_opt)):
        m.weight.grad = torch.ones_like(m.weight)
        o.step()  # the bias misses it
    saved = copy.deepcopy(opt.state_dict())  # torch's layout: the bias has no entry
    for m, o in ((model, opt), (ref, torch_opt)):
        m.bias.grad = torch.ones_like(m.bias)
        o.step()
    _close([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()])
    opt.load_state_dict(saved)
    torch_opt.load_state_dict(saved)
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            p.copy_(q)
    for o in (opt, torch_opt):
        o.step()
    _close([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()])
    assert opt.state[model.bias]["step"].item() == 1
    opt.state.clear()  # restarts from init: every count from 0
    torch_opt.state.clear()
    model.bias.grad = ref.bias.grad = None
    opt.step()
    torch_opt.step()
    assert opt.state[model.weight]["step"].item() == 1
    assert model.bias not in opt.state and ref.bias not in torch_opt.state  # no step yet


@settings(max_examples=60, deadline=None)
@given(row=st.sampled_from([*ROWS, ("functopt.adamw", {})]),
       pattern=st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=1,
                        max_size=6),
       fused=st.booleans())
def test_any_pattern_of_missing_gradients_is_torchs(
        row: tuple[str, dict[str, Any]], pattern: list[tuple[bool, bool, bool]],
        fused: bool) -> None:
    # Which of three params have a gradient at each step (up to three counts at once).
    name, kwargs = row

    def model() -> list[torch.nn.Parameter]:
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]

    ps, qs = model(), model()
    if name == "functopt.adamw":
        opt: Any = functopt.Optimizer(ps, functopt.adamw(0.1), fused=fused)
        torch_opt: Any = torch.optim.AdamW(qs, lr=0.1, weight_decay=1e-4)
    else:
        opt = getattr(optim, name)(ps, **kwargs)
        torch_opt = getattr(torch.optim, name)(qs, **kwargs)
    for t, has in enumerate(pattern):
        for params in (ps, qs):
            for k, (p, h) in enumerate(zip(params, has, strict=True)):
                p.grad = torch.full_like(p, 0.1 * (t + 1) - 0.05 * k) if h else None
        opt.step()
        torch_opt.step()
        _close([p.detach() for p in ps], [q.detach() for q in qs])


def test_a_frozen_group_that_missed_steps_keeps_its_counts() -> None:
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
    opt.param_groups[0]["frozen"] = False  # stepping again: each its own count
    opt.step()
    assert opt.state[a]["count"].item() == 2 and opt.state[b]["count"].item() == 1
