"""One param-group compiler behind both adapters (``functopt/adapters/_param_groups.py``).

``functopt.Optimizer`` and ``MixedPrecisionOptimizer`` read their groups through the same
functions: the group keys of a recipe (torch's names, ``RECIPE_GROUP_KEYS``), their split
into the recipe's arguments (``betas`` into ``b1, b2``), the flags (``lr_mult``,
``wd_mult``, ``frozen``), the multiplier check and the refusal of a key no step reads
(``check_group_keys``). So the same group gives the same keys
in both, and the same bad group raises the same exception with the same message (the
owner's name aside) from both, at the same call.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import functopt
from functopt import MixedPrecisionOptimizer, Optimizer
from functopt.adapters import _param_groups


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]


def _adapters() -> dict[str, Callable[..., Any]]:
    return {"functopt.Optimizer": lambda groups, tx: Optimizer(groups, tx),
            "MixedPrecisionOptimizer": lambda groups, tx: MixedPrecisionOptimizer(
                groups, tx, loss_scale=None)}


def _raised(owner: str, call: Callable[[], Any]) -> tuple[type[BaseException], str]:
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{owner}: "), message
    return type(info.value), message.removeprefix(f"{owner}: ")


def _step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()


# Bad groups, and where they raise: "build" at construction, "step" at the next step after
# the edit. Each: (name, transform, groups given the params, edit of param_groups[-1]).
_SCHEDULED = functopt.adamw(functopt.schedules.constant_schedule(0.1))  # its lr is not injected
_CASES: list[tuple[str, Any, Callable[[list[Any]], Any], dict[str, Any] | None]] = [
    ("lr_mult without an injected lr", _SCHEDULED,
     lambda ps: [{"params": ps, "lr_mult": 2.0}], None),
    ("wd_mult without a weight decay", functopt.adam(0.1),
     lambda ps: [{"params": ps, "wd_mult": 0.5}], None),
    ("negative lr_mult", functopt.adamw(0.1),
     lambda ps: [{"params": ps[:1]}, {"params": ps[1:], "lr_mult": -1.0}], None),
    ("non-finite wd_mult", functopt.adamw(0.1),
     lambda ps: [{"params": ps[:1]}, {"params": ps[1:], "wd_mult": math.inf}], None),
    ("a string lr_mult", functopt.adamw(0.1),
     lambda ps: [{"params": ps[:1]}, {"params": ps[1:], "lr_mult": "2"}], None),
    ("an int frozen", functopt.adamw(0.1),
     lambda ps: [{"params": ps[:1]}, {"params": ps[1:], "frozen": 1}], None),
    ("betas not a pair, set later", functopt.adamw(0.1), lambda ps: ps, {"betas": 0.9}),
    ("etas of three, set later", functopt.rprop(0.1), lambda ps: ps,
     {"etas": (0.5, 1.2, 2.0)}),
    ("wd_mult set later on adam", functopt.adam(0.1), lambda ps: ps, {"wd_mult": 0.5}),
    ("a torch key the recipe has not", functopt.adamw(0.1),
     lambda ps: [{"params": ps, "momentum": 0.9}], None),
    ("the recipe's own name for lr", functopt.adamw(0.1),
     lambda ps: [{"params": ps, "learning_rate": 0.1}], None),
    ("torch.optim.Adafactor's d", functopt.adafactor(0.1),
     lambda ps: [{"params": ps, "d": 1.0}], None),
    ("a note set later", functopt.sgd(0.1), lambda ps: ps, {"foo": 1}),
]


@pytest.mark.parametrize(("transform", "groups", "edit"),
                         [case[1:] for case in _CASES], ids=[case[0] for case in _CASES])
def test_the_same_bad_group_raises_the_same_error_from_both_adapters(
        transform: Any, groups: Callable[[list[Any]], Any], edit: dict[str, Any] | None) -> None:
    raised = []
    for owner, build in _adapters().items():
        ps = _params()
        if edit is None:
            raised.append(_raised(owner, lambda b=build, ps=ps: b(groups(ps), transform)))
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", functopt.fast.FastPathWarning)  # rprop: pure path
            opt = build(groups(ps), transform)
            _step(opt, ps)  # the group as built steps
            opt.param_groups[-1].update(edit)
            raised.append(_raised(owner, lambda opt=opt, ps=ps: _step(opt, ps)))
    (kind, message), other = raised
    assert other == (kind, message)
    assert kind is ValueError or kind is TypeError
    assert "param_groups[" in message and "Fix:" in message, message


def test_the_multiplier_message_names_the_injected_hyperparameters() -> None:
    _, message = _raised("functopt.Optimizer",
                         lambda: Optimizer([{"params": _params(), "wd_mult": 0.5}],
                                           functopt.adam(0.1)))
    assert message.startswith("param_groups[0] sets wd_mult=0.5, which multiplies the injected "
                              "'weight_decay', but the transform does not inject it (it "
                              "injects ['b1', 'b2', 'eps', 'eps_root', 'learning_rate'])")


_RECIPES = {name: factory for name, factory in vars(functopt).items()
            if name in _param_groups.RECIPE_GROUP_KEYS}


@pytest.mark.parametrize("name", sorted(_RECIPES))
def test_a_plain_recipe_has_the_same_group_keys_and_values_in_both_adapters(name: str) -> None:
    recipe = _RECIPES[name](0.1)
    groups = [dict(_adapters()[owner](_params(), recipe).param_groups[0])
              for owner in _adapters()]
    for group in groups:
        del group["params"]
        group.pop("param_names", None)  # (the facade names its params)
    assert groups[0] == groups[1]
    # every key of the recipe's row whose arguments it got as numbers
    assert set(groups[0]) <= set(_param_groups.RECIPE_GROUP_KEYS[name])
    assert "lr" in groups[0]


def test_a_renamed_key_reaches_the_same_argument_in_both_adapters() -> None:
    """rmsprop's ``decay`` is torch's ``alpha`` in both groups; a value written there is the
    one the next step reads (float32 params: the facade keeps no master copy, and both
    adapters take the same pure update)."""
    results = []
    for owner, build in _adapters().items():
        ps = _params()
        opt = build(ps, functopt.rmsprop(0.1))
        opt.param_groups[0]["alpha"] = 0.5
        with pytest.warns(functopt.fast.FastPathWarning):
            _step(opt, ps)
        results.append([p.detach().clone() for p in ps])
        reference = _params()
        for p in reference:
            p.grad = torch.ones_like(p)
        ref = torch.optim.RMSprop(reference, lr=0.1, alpha=0.5, eps=1e-8)
        ref.step()
        for p, q in zip(ps, reference, strict=True):
            # functopt's eps is inside the root, torch's outside: equal up to eps
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=owner)
    for p, q in zip(*results, strict=True):
        assert torch.equal(p, q)
