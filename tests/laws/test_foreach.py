"""The engine's foreach backend's law: a ``functopt.optim`` chain on torch.optim's foreach
implementation equals ``torch.optim.<class>(foreach=True)`` bitwise and the pure path within
the fast-path tolerance.

The foreach backend (``functopt/fast/_foreach.py``) runs the chains of the torch.optim
classes with no fused kernel on their ``_multi_tensor_*`` functions. For each row:

- the class's injected chain (``functopt.optim.<class>(...).transform``, stepped by
  ``make_step`` as the engine takes it), with default options and with decay, maximize and
  the row's own options, over float32 and float64 leaves, donated or not, for seven steps
  with an lr edit before the last (as a scheduler edits ``param_groups``): its params
  bitwise ``torch.optim.<class>(foreach=True)``'s, the foreach launch seen at every step
  and no ``FastPathWarning``; each step within the fast-path tolerance of the pure step
  from the same params and state; `explain` naming the foreach backend;
- the refusal table: a bfloat16 leaf, and an option the function does not compute as the
  rules do, each refused with its reason, warned, and run on the eager backend (the pure
  step, bitwise).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import functopt as F
import functopt.optim as O
from functopt.fast import FastPathWarning, _engine, _foreach, make_step
from functopt.optim import _chains
from functopt.testing import _fast, assert_bitwise_equal, clone_tree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fronts import _run

STEPS = 7  # (RAdam rectifies from its sixth step)


@contextlib.contextmanager
def engine() -> Iterator[list[int]]:
    """The switch on with every backend, and a list that grows by one at each segment the
    foreach backend runs."""
    launched: list[int] = []
    launch = _foreach._launch

    def counted(*args: Any) -> None:
        launched.append(1)
        launch(*args)

    before = _engine.ENABLED, _engine.BACKENDS
    _engine.ENABLED, _engine.BACKENDS = True, ("kernel", "foreach", "perleaf", "eager")
    _foreach._launch = counted  # type: ignore[assignment]
    try:
        yield launched
    finally:
        _engine.ENABLED, _engine.BACKENDS = before
        _foreach._launch = launch  # type: ignore[assignment]


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=gen), "b": torch.randn(4, generator=gen),
            "v": torch.randn(5, generator=gen, dtype=torch.float64)}


def _grads(k: int, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + k)
    return {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in params.items()}


# (class, options): the defaults, and decay, maximize and the row's own options
ROWS: list[tuple[str, dict[str, Any]]] = [
    ("RMSprop", {}),
    ("RMSprop", {"lr": 0.05, "alpha": 0.75, "eps": 1e-6, "weight_decay": 0.1,
                 "momentum": 0.5, "maximize": True}),
    ("Adamax", {}),
    ("Adamax", {"lr": 0.05, "betas": (0.8, 0.99), "weight_decay": 0.1, "maximize": True}),
    ("NAdam", {}),
    ("NAdam", {"weight_decay": 0.1, "maximize": True, "momentum_decay": 0.01}),
    ("NAdam", {"weight_decay": 0.1, "decoupled_weight_decay": True}),
    ("RAdam", {}),
    ("RAdam", {"lr": 0.05, "weight_decay": 0.1, "maximize": True}),
    ("RAdam", {"weight_decay": 0.1, "decoupled_weight_decay": True}),
    ("Adadelta", {}),
    ("Adadelta", {"lr": 0.5, "rho": 0.8, "weight_decay": 0.1, "maximize": True}),
    ("Rprop", {}),
    ("Rprop", {"lr": 0.02, "etas": (0.4, 1.3), "step_sizes": (1e-4, 1.0), "maximize": True}),
    ("Adagrad", {}),
    ("Adagrad", {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.1, "maximize": True,
                 "initial_accumulator_value": 0.1}),
]
_IDS = [f"{name}{options}" for name, options in ROWS]


def _halve_lr(opt: torch.optim.Optimizer, state: Any, name: str) -> Any:
    """A scheduler's edit: the lr halved in torch's groups and in the injected state (the
    drop-in's groups); Rprop's lr is its initial step size, read at its first step only."""
    if name == "Rprop":
        return state
    for group in opt.param_groups:
        group["lr"] *= 0.5
    state.hyperparams["learning_rate"] = state.hyperparams["learning_rate"] * 0.5
    return state


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("row", ROWS, ids=_IDS)
def test_row_equals_torchs_foreach_class_and_the_pure_path(
        row: tuple[str, dict[str, Any]], donate: bool) -> None:
    name, options = row
    params = _params()
    torch_params = [p.clone() for p in params.values()]
    opt = getattr(torch.optim, name)(torch_params, foreach=True, **options)
    tx = getattr(O, name)([p.clone() for p in params.values()], **options).transform
    state, step = tx.init(params), make_step(tx, donate=donate)
    explained = _engine.explain(tx, params, _grads(0, params), state)
    assert not isinstance(explained, str), explained
    assert [e.backend for e in explained] == ["foreach"], explained
    for k in range(STEPS):
        if k == STEPS - 1:
            state = _halve_lr(opt, state, name)
        grads = _grads(k, params)
        for p, g in zip(torch_params, grads.values(), strict=True):
            p.grad = g.clone()
        # (torch keeps NAdam's mu_product in the default dtype, the rule in float64)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64 if name == "NAdam" else default)
        try:
            opt.step()
        finally:
            torch.set_default_dtype(default)
        before = clone_tree((params, state))
        updates, pure_state = tx.update(*clone_tree((grads, state, params)))
        pure_params = F.apply_updates(clone_tree(params), updates)
        with engine() as launched, warnings.catch_warnings():
            warnings.simplefilter("error", FastPathWarning)
            params, state = step(grads, state, params)
        what = f"{name}{options}, step {k + 1}"
        assert launched == [1], f"{what}: the foreach backend did not run"
        assert_bitwise_equal(params, dict(zip(params, torch_params, strict=True)),
                             what=f"{what}: params vs torch.optim.{name}(foreach=True)")
        for new, pure, old, part in ((params, pure_params, before[0], "params"),
                                     (state, pure_state, before[1], "state")):
            _fast._assert_fast_close(new, pure, old, check="foreach backend",
                                     what=f"{what}, {part}", exact=False)


@pytest.mark.parametrize("options", [{}, {"lr_decay": 0.01, "weight_decay": 0.1}],
                         ids=["defaults", "decay"])
def test_the_adagrad_drop_in_steps_on_the_foreach_backend_and_reads_group_edits(
        options: dict[str, Any]) -> None:
    # (Adagrad takes fused=True, which the engine takes: torch has no fused Adagrad kernel
    # the kernel backend runs, and its foreach function runs the class's chain); float64
    # and float32 params, transposed and channels_last, the lr halved before the last step
    def halved(opt: Any, k: int) -> None:
        if k == 2:
            for group in opt.param_groups:
                group["lr"] *= 0.5

    expected = _run(lambda ps: torch.optim.Adagrad(ps, foreach=True, **options), False,
                    halved)
    with engine() as launched, warnings.catch_warnings():
        warnings.simplefilter("error", FastPathWarning)
        found = _run(lambda ps: O.Adagrad(ps, fused=True, **options), False, halved)
    assert len(launched) == 3, launched
    for k, (p, e) in enumerate(zip(found[0], expected[0], strict=True)):
        assert_bitwise_equal(p, e, what=f"param {k} vs torch.optim.Adagrad(foreach=True)")


def test_the_foreach_backend_is_offered_after_the_kernels() -> None:
    assert _engine.BACKENDS == ("kernel", "foreach", "perleaf", "eager")
    tx = O.RMSprop([torch.zeros(2)]).transform
    params = _params()
    explained = _engine.explain(tx, params, _grads(0, params))
    assert not isinstance(explained, str)
    assert "no fused kernel" in explained[0].reasons["kernel"]


# --- the refusal table --------------------------------------------------------------------

def _bf16() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(2, 3), "h": torch.ones(3, dtype=torch.bfloat16)}


def _trio() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(2, 3), "b": torch.ones(3)}


def _rss_chain() -> Any:
    return F.chain(F.scale_by_rss(initial_accumulator_value=0.0, eps=1e-10, eps_in_sqrt=False),
                   F.scale_by_learning_rate(lambda count: 0.1 / (1 + count)))


# name: (transform, params, a part of the foreach backend's reason)
REFUSALS: dict[str, tuple[Callable[[], Any], Callable[[], Any], str]] = {
    **{f"bfloat16 {name}": (lambda name=name: getattr(O, name)([torch.zeros(1)]).transform,
                            _bf16, "rounds torch.bfloat16 at each op")
       for name in ("RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta", "Rprop", "Adagrad")},
    "optax's rmsprop": (lambda: F.rmsprop(1e-2), _trio,
                        "eps_in_sqrt=True or bias_correction=True is not torch's"),
    "rmsprop with eps 0": (lambda: _chains.rmsprop(1e-2, 0.9, 0.0), _trio,
                           "whose reciprocal overflows"),
    "rmsprop with an injected momentum of 0": (
        lambda: F.inject_hyperparams(_chains.rmsprop)(
            learning_rate=1e-2, alpha=0.9, eps=1e-8, momentum=0.0), _trio,
        "a trace(decay=0), which torch's momentum=0 does not keep"),
    "adamax with a tensor lr": (lambda: _chains.adamax(torch.tensor(1e-2), 0.9, 0.999, 1e-8),
                                _trio, "which the function takes as a Python number"),
    "nadam decayed before and after": (
        lambda: F.chain(F.add_decayed_weights(0.1), F.scale_by_nadam(),
                        F.add_decayed_weights(0.1), F.scale_by_learning_rate(1e-2)),
        _trio, "add_decayed_weights both before and after the rule"),
    "optax's radam": (lambda: F.radam(1e-2), _trio,
                      "nesterov=True or eps_before_correction=False is not torch's"),
    "radam with eps_root": (
        lambda: F.chain(F.scale_by_radam(eps_root=1e-8, eps_before_correction=True),
                        F.scale_by_learning_rate(1e-2)), _trio, "eps_root > 0"),
    "radam with eps 0": (lambda: _chains.radam(1e-2, 0.9, 0.999, 0.0), _trio,
                         "an eps of 0, whose nan where a second moment is 0"),
    "adagrad with eps 0": (lambda: _chains.adagrad(1e-2, 0.0, 0.0, 0.0), _trio,
                           "an eps of 0, where the function divides 0 by 0"),
    "adadelta with a schedule": (lambda: _chains.adadelta(lambda count: 1.0, 0.9, 1e-6),
                                 _trio, "which the function takes as a Python number"),
    "rprop scaled by another step": (
        lambda: F.chain(F.scale_by_rprop(1e-2), F.scale(-0.5)), _trio,
        "scale_by_rprop not followed by scale(-1.0)"),
    "adagrad with another schedule": (_rss_chain, _trio,
                                      "is not functopt.optim.Adagrad's schedule"),
    "a clip after": (lambda: F.chain(_chains.adamax(1e-2, 0.9, 0.999, 1e-8),
                                     F.clip_by_global_norm(0.5)), _trio,
                     "its updates are read after it"),
}


@pytest.mark.parametrize("case", list(REFUSALS), ids=list(REFUSALS))
def test_a_refused_row_runs_eager_with_its_reason(case: str) -> None:
    factory, make_params, reason = REFUSALS[case]
    tx, params = factory(), make_params()
    state, grads = tx.init(params), F.tree.full_like(params, 0.5)
    explained = _engine.explain(tx, params, grads, state)
    assert not isinstance(explained, str), explained
    reasons = [e.reasons.get("foreach", "") for e in explained]
    assert any(reason in r for r in reasons), reasons
    assert all(e.backend == "eager" for e in explained)
    updates, pure_state = tx.update(grads, clone_tree(state), params)
    pure_params = F.apply_updates(params, updates)
    with engine() as launched, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new_params, new_state = make_step(tx)(*clone_tree((grads, state, params)))
    assert launched == []
    assert any(reason in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert_bitwise_equal(new_params, pure_params)
    assert_bitwise_equal(new_state, pure_state)
