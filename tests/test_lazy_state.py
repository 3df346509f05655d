"""An optimizer's state is made when it is first needed, as torch.optim makes its state:
at the first step, or when ``optimizer.state`` is first read.

So a constructor does per-param bookkeeping only (no tensor per param), a fresh
``functopt.optim`` optimizer's ``state_dict()`` is torch's (no state, made by nothing), the
first step (which makes the state and plans the fast step) does work linear in the params,
and the state that is made is the one a constructor making it would have made.
"""

from __future__ import annotations

import copy
import pickle
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import functopt
from functopt import optim

# torch.optim.Adagrad makes its state in its constructor, and so does functopt's.
LAZY = ["Adam", "AdamW", "SGD", "RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta", "Rprop",
        "Muon", "Adafactor"]


class _Ops(TorchDispatchMode):
    """Counts the tensor operations run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _ops(run: Callable[[], Any]) -> int:
    with _Ops() as counted:
        run()
    return counted.count


def _params(n: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.full((2, 2), float(i))) for i in range(n)]


def _make(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    options = {"momentum": 0.9} if name == "SGD" else {}
    return getattr(optim, name)(params, lr=0.1, **options)


@pytest.mark.parametrize("name", LAZY)
def test_construction_and_a_fresh_state_dict_run_as_many_tensor_ops_for_any_number_of_params(
        name: str) -> None:
    few, many = _params(3), _params(300)
    built: dict[int, torch.optim.Optimizer] = {}
    counts = {}
    for ps in (few, many):
        counts[len(ps)] = _ops(lambda ps=ps: built.__setitem__(len(ps), _make(name, ps)))
    assert counts[3] == counts[300], counts
    for n, opt in built.items():
        assert _ops(opt.state_dict) == 0, n
        assert opt.state_dict()["state"] == {}


def _calls(run: Callable[[], Any]) -> tuple[int, int]:
    """The Python-level functions and the builtins ``run`` calls (sys.setprofile's events:
    a count that does not depend on the machine or its load)."""
    counts = {"call": 0, "c_call": 0}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in counts:
            counts[event] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return counts["call"], counts["c_call"]


# Python-level calls per param of a first step (the planning is per run of leaves with the
# same rules: what is left per param is reading its metadata, its state entry and its
# rows for the later steps' checks); a walk over every param per param is thousands
PER_PARAM_CALLS = 24


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_the_first_and_second_steps_do_work_linear_in_the_params(name: str) -> None:
    """Twice the params take less than twice the calls (linear work plus a fixed part);
    work per param that walks every param takes four times as many."""
    counts: dict[str, dict[int, tuple[int, int]]] = {"first": {}, "second": {}}
    for n in (2000, 4000):
        ps = _params(n)
        for p in ps:
            p.grad = torch.ones(2, 2)
        opt = _make(name, ps)
        counts["first"][n] = _calls(opt.step)
        counts["second"][n] = _calls(opt.step)
        # (the steps stepped every param: none was skipped to count less)
        assert all(not torch.equal(p, torch.full((2, 2), float(i))) for i, p in enumerate(ps))
    for step, by_size in counts.items():
        for kind in (0, 1):
            assert by_size[4000][kind] <= 2 * by_size[2000][kind], (step, kind, by_size)
    python_calls = counts["first"][4000][0] - counts["first"][2000][0]
    assert python_calls <= PER_PARAM_CALLS * 2000, python_calls / 2000


def _counted_sgd(calls: list[int]) -> functopt.GradientTransformation:
    """An injected SGD with momentum whose ``init`` records each of its calls."""

    def counted(learning_rate: float) -> functopt.GradientTransformation:
        inner = functopt.sgd(learning_rate, momentum=0.9)

        def init(params: Any) -> Any:
            calls.append(len(params))
            return inner.init(params)

        return functopt.GradientTransformation(init, inner.update)

    return functopt.inject_hyperparams(counted)(learning_rate=0.1)


def test_the_state_is_made_once_when_optimizer_state_is_first_read() -> None:
    calls: list[int] = []
    ps = _params(4)
    opt = functopt.Optimizer(ps, _counted_sgd(calls), fused=False)
    assert calls == []
    entries = opt.state
    assert calls == [4]
    assert list(entries) == ps  # every param has its entry (DCP then takes no step)
    assert all(torch.equal(entries[p]["inner_state.0.trace"], torch.zeros(2, 2)) for p in ps)
    for p in ps:
        p.grad = torch.ones(2, 2)
    opt.step()
    opt.step()
    assert calls == [4]  # the steps took the state made on reading
    assert all(torch.allclose(opt.state[p]["inner_state.0.trace"], torch.full((2, 2), 1.9))
               for p in ps)


def test_the_first_step_makes_the_state_and_equals_an_optimizer_whose_state_was_read() -> None:
    calls: list[int] = []
    ps, qs = _params(3), _params(3)
    lazy = functopt.Optimizer(ps, _counted_sgd(calls), fused=False)
    read = functopt.Optimizer(qs, _counted_sgd(calls), fused=False)
    assert read.state and calls == [3]
    for _ in range(3):
        for p, q in zip(ps, qs, strict=True):
            p.grad = p.detach() * 0.5 + 1.0
            q.grad = q.detach() * 0.5 + 1.0
        lazy.step()
        read.step()
    assert calls == [3, 3]
    for p, q in zip(ps, qs, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", ["AdamW", "SGD", "Muon"])
def test_params_moved_before_the_first_step_get_their_state_where_they_are(name: str) -> None:
    moved = torch.nn.Linear(3, 2, bias=name != "Muon")
    direct = copy.deepcopy(moved).double()
    opt = _make(name, list(moved.parameters()))
    moved.double()  # (in place: the optimizer holds the same Parameter objects)
    other = _make(name, list(direct.parameters()))
    x = torch.linspace(-1.0, 1.0, 6, dtype=torch.float64).reshape(2, 3)
    for _ in range(3):
        for model, o in ((moved, opt), (direct, other)):
            o.zero_grad()
            model(x).square().sum().backward()
            o.step()
    for p, q in zip(moved.parameters(), direct.parameters(), strict=True):
        assert torch.equal(p, q)
    assert {t.dtype for entry in opt.state.values() for k, t in entry.items()
            if k != "step" and t.is_floating_point()} == {torch.float64}  # (step: torch's)


@pytest.mark.parametrize("copied", ["deepcopy", "pickle"])
def test_an_optimizer_copied_before_its_first_step_steps_as_the_original(copied: str) -> None:
    ps = _params(3)
    opt = optim.AdamW(ps, lr=0.1, weight_decay=0.1)
    twin = copy.deepcopy(opt) if copied == "deepcopy" else pickle.loads(pickle.dumps(opt))
    qs = twin.param_groups[0]["params"]
    for _ in range(2):
        for p, q in zip(ps, qs, strict=True):
            p.grad = torch.ones(2, 2)
            q.grad = torch.ones(2, 2)
        opt.step()
        twin.step()
    for p, q in zip(ps, qs, strict=True):
        assert torch.equal(p, q)
    saved, theirs = opt.state_dict(), twin.state_dict()
    assert saved["state"].keys() == theirs["state"].keys() == {0, 1, 2}
    assert all(torch.equal(saved["state"][k]["exp_avg"], theirs["state"][k]["exp_avg"])
               for k in saved["state"])
