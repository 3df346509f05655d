"""``apply_if_finite`` after other rules (``chain(scale_by_adam(), apply_if_finite(lr))``) on
the compiled tier: a rule with tree sums (the non-finite count of the updates entering the
guard, over every group), whose update is the guard's own.

The default run checks what is lowered and why the rest is not, and that the guard's two
halves are its update; ``-m slow`` compiles (seconds per structure) and holds the compiled
step to the pure one over skipped steps, steps past ``max_consecutive_errors`` and the
conformance law over every layout.
"""

from __future__ import annotations

import pytest
import torch
from compiled_cases import every_layout, grads_for

import functopt
from functopt import fast
from functopt._spec import FiniteGuard, describe
from functopt.testing import assert_bitwise_equal, conformance

F = functopt

# Inductor's first import warns about a deprecated torch.jit decorator (PyTorch's, not ours)
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def _late_guard(max_consecutive_errors: int = 1) -> functopt.GradientTransformation:
    return F.chain(F.scale_by_adam(), F.add_decayed_weights(0.1), F.apply_if_finite(
        F.chain(F.scale_by_learning_rate(F.schedules.linear_schedule(1e-2, 1e-3, 4)),
                F.scale(0.5)), max_consecutive_errors))


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {"w": torch.randn(5, 3, generator=gen), "c": torch.randn(4, generator=gen),
            "b": torch.randn(3, generator=gen, dtype=torch.float64)}


def test_explain_compiles_it_and_names_what_it_does_not() -> None:
    params = _params()
    plain = fast.explain(_late_guard(), params)
    assert not plain.fast and "make_step(tx, compile=True) compiles it" in str(plain.reason)
    got = fast.explain(_late_guard(), params, compile=True)
    assert got.fast and got.tree_sums == 1 and got.guards == 0, str(got)
    assert {g.rules for g in got.groups} == {
        ("scale_by_adam", "add_decayed_weights", "apply_if_finite")}
    # around rules with per-leaf state, or a clip (which would measure one group), no
    refused = [F.chain(F.scale_by_lion(), F.apply_if_finite(F.trace(0.9), 1)),
               F.chain(F.scale_by_lion(), F.apply_if_finite(F.clip_by_global_norm(1.0), 1))]
    for tx in refused:
        reason = str(fast.explain(tx, params, compile=True).reason)
        assert "apply_if_finite after other rules has a fast form (the compiled tier's) " \
               "only around add_decayed_weights, clip, identity, keep_params_nonnegative, " \
               "scale" in reason, reason


@pytest.mark.parametrize("bad", [False, True])
def test_the_two_halves_are_the_guards_update(bad: bool) -> None:
    """What the compiled tier runs, ``finish(u, state, p, sums(u, state, p))``, is the
    guard's update bitwise: the same decision and the same operations (its counters
    past ``max_consecutive_errors`` too)."""
    params = _params()
    guard = F.apply_if_finite(F.scale_by_learning_rate(1e-2), max_consecutive_errors=1)
    spec = describe(guard)
    assert isinstance(spec, FiniteGuard) and spec.sums is not None and spec.finish is not None
    state = guard.init(params)
    for t in range(3):
        updates = grads_for(params, t)
        if bad:
            updates["c"][1] = float("nan")
        expected, expected_state = guard.update(updates, state, params)
        (count,) = spec.sums(updates, state, params)
        assert float(count) == (1.0 if bad else 0.0)
        got, got_state = spec.finish(updates, state, params, (count,))
        assert_bitwise_equal(got, expected)
        assert_bitwise_equal(got_state, expected_state)
        state = expected_state
    assert int(state.total_notfinite) == (3 if bad else 0)


@pytest.mark.slow
def test_compiled_step_equals_the_pure_step_over_skips() -> None:
    """Two groups (two dtypes, the inf in one of them): every group skips the guarded rules
    alike on a step whose updates hold an inf, Adam's moments and the decay move anyway;
    past max_consecutive_errors the update goes through. Bitwise the pure path."""
    tx = _late_guard()
    params = _params()
    step = fast.make_step(tx, compile=True)
    state, ref_state, now, ref = step.init(params), tx.init(params), params, params
    for t in range(5):
        grads = grads_for(params, t)
        if t in (1, 2, 3):
            grads["c"][1] = float("inf")
        updates, ref_state = tx.update(grads, ref_state, ref)
        ref = F.apply_updates(ref, updates)
        with torch.no_grad():
            now, state = step(grads, state, now)
        assert_bitwise_equal(now, ref)
        assert_bitwise_equal(state, ref_state)
    # the inf reached Adam's moments, outside the guard, at step 1: every later update is
    # non-finite, skipped twice (max_consecutive_errors=1 lets the third through)
    assert int(state[2].total_notfinite) == 4 and int(state[2].notfinite_count) == 4


@pytest.mark.slow
def test_the_law_over_every_layout() -> None:
    params = every_layout(torch.float64)
    conformance.check_fast_path(_late_guard, params, grads_for(params, 1), steps=3,
                                compile=True)
