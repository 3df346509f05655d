"""The program engine's law for ``MultiSteps``: its step equals the pure step, bitwise.

``MultiSteps`` compiles, wherever it stands, into one `Gate` on its `Window`
(``functopt/fast/_program.py``): the window decided on the host, the mini-step
accumulated into its state, and the inner program run on the accumulated gradients where
the window closes. Held here, beside the registry law of tests/laws/test_program.py:

- the window table: every option of ``MultiSteps`` at the root (``use_grad_mean``, both
  skip rules, ``every_k_schedule`` as an int and as a schedule, ``accumulator_dtype``) and
  every position (in a chain after a clip, ``masked``, ``partition``, inside and around
  ``inject_hyperparams``, clips, ``apply_if_finite`` and ``masked`` inside, a guard around,
  nested), over several windows with an inf, a nan or ``None`` gradients, donated or not;
- the same over hypothesis pytrees (``functopt.testing.strategies``, through
  ``conformance.cases``: 0-d, empty, strided leaves, ``None`` gradients, inf and nan);
- one gate per ``MultiSteps``; the windows the engine steps through on the table's
  gradients (skipped mini-steps, accumulating ones, closing ones); the inner transform's
  hyperparameters read only where a window closes; and the errors: the pure update's
  own, a skip_state whose structure changes, and the reasons of what the compiler does
  not take.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt as F
from functopt.fast import make_step
from functopt.fast._program import Gate, Op, Window, compile_program
from functopt.testing import conformance
from functopt.tree import _core

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_conformance import inverse_count
from test_program import (
    _grads,
    _halve_learning_rate,
    _labels,
    _negated,
    _nothing,
    _params,
    _weights,
    check_equal,
    engine,
    program_of,
)

STEPS = 8
BAD_AT = (2, 5)  # the steps whose gradients hold the bad value
LARGE = functools.partial(F.skip_large_updates, max_squared_norm=200.0)  # skips some steps


def _windowed(learning_rate: Any) -> Any:
    """A MultiSteps whose inner transform reads an injected value."""
    return F.MultiSteps(F.sgd(learning_rate, momentum=0.9), 2).gradient_transformation()


def _gt(tx: F.MultiSteps) -> Any:
    return tx.gradient_transformation()


def _cycle(gradient_step: torch.Tensor) -> int:
    """Windows of 1, 2 and 3 mini-steps in turn."""
    return 1 + int(gradient_step) % 3


# name: (factory, the number of MultiSteps in it)
WINDOWS: dict[str, tuple[Callable[[], Any], int]] = {
    "mean": (lambda: F.MultiSteps(F.adam(1e-2), 3), 1),
    "sum": (lambda: F.MultiSteps(F.adam(1e-2), 3, use_grad_mean=False), 1),
    "skip not finite": (lambda: F.MultiSteps(F.sgd(0.1, momentum=0.9), 2,
                                             should_skip_update_fn=F.skip_not_finite), 1),
    "skip large": (lambda: F.MultiSteps(F.adamw(1e-2), 2, should_skip_update_fn=LARGE), 1),
    "schedule": (lambda: F.MultiSteps(F.adamw(1e-2), _cycle), 1),
    "window of one": (lambda: F.MultiSteps(F.sgd(0.1), 1, accumulator_dtype=torch.float16), 1),
    "float64 accumulator": (lambda: F.MultiSteps(F.lion(1e-3), 2,
                                                 accumulator_dtype=torch.float64), 1),
    "every option": (lambda: F.MultiSteps(
        F.adam(1e-2), _cycle, use_grad_mean=False, should_skip_update_fn=F.skip_not_finite,
        accumulator_dtype=torch.float64), 1),
    "in chain": (lambda: F.chain(F.clip_by_global_norm(1.0),
                                 _gt(F.MultiSteps(F.adam(1e-2), 2)), F.scale(0.5)), 1),
    "masked": (lambda: F.masked(_gt(F.MultiSteps(F.adam(1e-2), 2,
                                                 should_skip_update_fn=LARGE)), _weights), 1),
    "masked on no leaf": (lambda: F.masked(_gt(F.MultiSteps(F.adam(1e-2), 1)), _nothing), 1),
    "partition": (lambda: F.partition(
        {"adam": _gt(F.MultiSteps(F.adam(1e-2), 2)),
         "sgd": _gt(F.MultiSteps(F.sgd(0.1, momentum=0.5), 3, use_grad_mean=False)),
         "frozen": F.set_to_zero()}, _labels), 2),
    "in injection": (lambda: F.inject_hyperparams(_windowed)(learning_rate=0.1), 1),
    "injection inside": (lambda: F.MultiSteps(
        F.inject_hyperparams(F.adamw)(learning_rate=0.1, b1=0.8), 2), 1),
    "injected schedule inside": (lambda: F.MultiSteps(
        F.inject_hyperparams(F.sgd)(learning_rate=inverse_count), 2), 1),
    "clips inside": (lambda: F.MultiSteps(F.chain(
        F.clip_by_global_norm(1.0), F.scale_by_adam(), F.clip_by_global_norm(0.5),
        F.scale(-0.1)), 2), 1),
    "guard inside": (lambda: F.MultiSteps(F.apply_if_finite(F.adam(1e-2), 1), 2), 1),
    "masked inside": (lambda: F.MultiSteps(
        F.adamw(1e-2, weight_decay=0.1, mask=_weights), 2), 1),
    "guard around": (lambda: F.apply_if_finite(_gt(F.MultiSteps(F.adam(1e-2), 2)), 1), 1),
    "nested": (lambda: F.MultiSteps(_gt(F.MultiSteps(F.sgd(0.1, momentum=0.9), 2)), 3,
                                    use_grad_mean=False), 2),
    "nested with skips": (lambda: F.MultiSteps(
        _gt(F.MultiSteps(F.adam(1e-2), 2, should_skip_update_fn=F.skip_not_finite)), 2,
        should_skip_update_fn=LARGE), 2),
}


def _steps(bad: str) -> list[dict[str, Any]]:
    """The table's gradients: an inf or a nan at `BAD_AT`, or ``None`` for one leaf at
    every step (a param without a gradient, as the MultiSteps docstring asks)."""
    value = {"inf": float("inf"), "nan": float("nan")}.get(bad)
    grads = [_grads(k, value if k in BAD_AT else None) for k in range(STEPS)]
    if bad == "none":
        for g in grads:
            g["b"] = None
    return grads


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("bad", ["finite", "inf", "nan", "none"])
@pytest.mark.parametrize("name", list(WINDOWS), ids=list(WINDOWS))
def test_window_equals_pure_path(name: str, bad: str, donate: bool) -> None:
    factory, _ = WINDOWS[name]
    check_equal(factory(), _params(), _steps(bad), donate=donate,
                between=_halve_learning_rate)


def _gates(ops: tuple[Op, ...]) -> int:
    """The gates on a window in ``ops``, at any depth."""
    return sum((isinstance(op, Gate) and isinstance(op.decide, Window))
               + (_gates(op.then) + _gates(op.otherwise) if isinstance(op, Gate) else 0)
               for op in ops)


@pytest.mark.parametrize("name", list(WINDOWS), ids=list(WINDOWS))
def test_each_multisteps_is_one_gate_on_its_window(name: str) -> None:
    factory, count = WINDOWS[name]
    program = program_of(factory(), _params())
    assert program.reason is None, program.reason
    assert _gates(program.ops) == count


def _counters(tx: F.MultiSteps, grads: list[Any]) -> list[tuple[int, int]]:
    """(mini_step, gradient_step) before the first step and after each, on the engine."""
    params, state = _params(), tx.init(_params())
    step, out = make_step(tx), [(0, 0)]
    with engine():
        for g in grads:
            params, state = step(g, state, params)
            out.append((int(state.mini_step), int(state.gradient_step)))
    return out


@pytest.mark.parametrize("name", ["skip not finite", "skip large", "every option"])
def test_the_engine_skips_accumulates_and_closes_windows(name: str) -> None:
    # over the table's gradients (those with an inf), some mini-steps are skipped (the
    # counters stay), some accumulate (mini_step grows) and several windows close
    # (gradient_step grows): the law's scenario holds every branch of the gate
    counters = _counters(WINDOWS[name][0](), _steps("inf"))
    pairs = list(itertools.pairwise(counters))
    assert any(new == old for old, new in pairs), counters
    assert any(new[0] > old[0] for old, new in pairs), counters
    assert sum(new[1] > old[1] for old, new in pairs) >= 2, counters


# --- hypothesis pytrees -------------------------------------------------------------------

DRAWN: dict[str, Callable[[], Any]] = {
    "mean": lambda: F.MultiSteps(F.scale_by_adam(), 2),
    "sum, schedule": lambda: F.MultiSteps(F.sgd(0.1, momentum=0.9), _cycle,
                                          use_grad_mean=False),
    "skip not finite": lambda: F.MultiSteps(F.adamw(1e-2), 2,
                                            should_skip_update_fn=F.skip_not_finite),
    "skip large": lambda: F.MultiSteps(
        F.lion(1e-3), 2, should_skip_update_fn=functools.partial(
            F.skip_large_updates, max_squared_norm=4.0)),
    "float64 accumulator": lambda: F.MultiSteps(F.scale(-0.5), 3,
                                                accumulator_dtype=torch.float64),
    "in chain": lambda: F.chain(F.clip_by_global_norm(1.0),
                                _gt(F.MultiSteps(F.adam(1e-2), 2)), F.scale(0.5)),
    "nested": lambda: F.MultiSteps(_gt(F.MultiSteps(F.apply_if_finite(F.adam(1e-2), 1), 2)),
                                   2, should_skip_update_fn=F.skip_not_finite),
}


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("name", list(DRAWN), ids=list(DRAWN))
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_drawn_pytrees_equal_pure_path(name: str, donate: bool, data: st.DataObject) -> None:
    params, grads, _ = data.draw(conformance.cases(grad_kind="any", max_leaves=4,
                                                   tied=not donate))
    negated = _negated(grads)
    check_equal(DRAWN[name](), params, [grads, negated, grads, grads, negated, grads],
                donate=donate)


# --- where the inner transform runs, and the errors ---------------------------------------

def test_an_inner_schedule_is_read_only_where_a_window_closes() -> None:
    # the inner inject_hyperparams' values are read where its update runs (as on the pure
    # path: on the closing mini-steps only), not once per mini-step
    calls: list[int] = []

    def counted(count: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return inverse_count(count)

    tx, params = F.MultiSteps(F.inject_hyperparams(F.sgd)(learning_rate=counted), 3), _params()
    pure_state, fast_state = tx.init(params), tx.init(params)
    step, pure, fast = make_step(tx), [], []
    with engine() as ran:
        for k in range(6):
            calls.clear()
            _, pure_state = tx.update(_grads(k), pure_state, params)
            pure.append(len(calls))
            calls.clear()
            _, fast_state = step(_grads(k), fast_state, params)
            fast.append(len(calls))
    assert len(ran) == 6
    assert pure[1:] == fast[1:]  # (the first step compiles the program, which reads it too)
    assert [n > 0 for n in pure] == [False, False, True, False, False, True]


def _changing(updates: Any, gradient_step: torch.Tensor, params: Any) -> tuple[bool, Any]:
    return False, {"seen": torch.ones(())} if int(gradient_step) > 0 else ()


def test_a_skip_state_that_changes_structure_raises() -> None:
    tx, params = F.MultiSteps(F.sgd(0.1), 1, should_skip_update_fn=_changing), _params()
    step, state = make_step(tx), tx.init(params)
    with engine():
        params, state = step(_grads(0), state, params)  # (skip_state () as at init)
        with pytest.raises(ValueError, match=r"returned a skip_state of structure .* "
                                             r"Fix: return a skip_state"):
            step(_grads(1), state, params)


def test_the_pure_updates_errors_reach_the_caller() -> None:
    tx, params = F.MultiSteps(F.adam(1e-2), 2), _params()
    state = tx.init(params)._replace(mini_step=torch.zeros(()))
    with engine() as calls, pytest.raises(TypeError, match=r"state\.mini_step must be a 0-d "
                                                           r"integer tensor"):
        make_step(tx)(_grads(0), state, params)
    assert calls == [1]  # (raised by the engine's step, from MultiSteps.window)


def _opaque() -> F.GradientTransformation:
    return F.GradientTransformation(lambda p: (), lambda u, s, p=None: (u, s))


def test_what_the_compiler_does_not_take_inside_a_multisteps_is_named() -> None:
    params = _params()
    program = program_of(F.chain(F.scale(2.0), _gt(F.MultiSteps(_opaque(), 2))), params)
    assert program.reason is not None and program.ops == ()
    assert program.reason.startswith("[1].MultiSteps: a transform without a spec")
    tx = F.chain(F.scale(2.0), _gt(F.MultiSteps(F.sgd(0.1), 2)))
    state = tx.init(params)
    wrong = (state[0], tuple(state[1]))  # (its MultiStepsState as a plain tuple)
    _, treespec = _core.flatten(params)
    found = compile_program(tx, params, treespec, _core.flatten(params)[0],
                            *_core.flatten(wrong))
    assert found.reason == "[1]: the state of a MultiSteps is tuple, not a MultiStepsState"
