"""``make_step`` of a chain holding a ``MultiSteps``: the prefix runs on every mini-step, the
accumulation is ``foreach`` in the caller's state, the suffix sees MultiSteps' zeros, and the
closing mini-step is the fast step of ``chain(inner, suffix...)``. Held to the pure chain:
bitwise on mini-steps and skipped mini-steps (the same operations), bitwise the closing
chain's own fast step on the accumulated gradients, to rounding the pure path there (the
kernel)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt.testing import assert_bitwise_equal, conformance

F = functopt


def _ms(inner: functopt.GradientTransformation, k: int = 3,
        **options: Any) -> functopt.GradientTransformation:
    return F.MultiSteps(inner, every_k_schedule=k, **options).gradient_transformation()


# name -> the chain, for windows of k mini-steps
NESTED: dict[str, Callable[[int], functopt.GradientTransformation]] = {
    "clip, ms(adamw)": lambda k: F.chain(F.clip_by_global_norm(0.5),
                                         _ms(F.adamw(1e-2, weight_decay=0.1), k)),
    "named clip, ms(sgd)": lambda k: F.named_chain(
        ("clip", F.clip_by_global_norm(0.5)), ("ms", _ms(F.sgd(0.1, momentum=0.9), k))),
    "block rms, ms(adamw)": lambda k: F.chain(F.clip_by_block_rms(0.5),
                                              _ms(F.adamw(1e-2), k)),  # (a PerLeaf prefix)
    "ms(adam), decay, lr": lambda k: F.chain(
        _ms(F.scale_by_adam(), k), F.add_decayed_weights(0.1), F.scale_by_learning_rate(0.01)),
    "nested chain, schedule": lambda k: F.chain(
        F.chain(F.scale(2.0), F.clip_by_global_norm(0.5)), _ms(F.scale_by_adam(), k),
        F.scale_by_schedule(F.schedules.linear_schedule(-0.01, -0.001, 5))),
}


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(5, 3, generator=gen),
              "b": torch.randn(3, generator=gen, dtype=torch.float64)}
    params["w"][0, 0] = -0.0  # a zero update makes it 0.0: checked bitwise
    return params


def _grads(seed: int, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: 3 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()}


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("name", list(NESTED))
def test_mini_steps_bitwise_closing_step_the_closing_chains_fast_step(name: str,
                                                                      donate: bool) -> None:
    k = 3
    tx = NESTED[name](k)
    params = _params()
    got = F.fast.explain(tx, params)
    assert got.fast and got.mini_steps is not None, str(got)  # (and no FastPathWarning below)
    step = F.fast.make_step(tx, donate=donate)
    state = tx.init(params)
    closed = 0
    for t in range(2 * k):
        grads = _grads(t, params)
        updates, ref_state = tx.update(grads, state, params)
        ref_params = F.apply_updates(params, updates)
        fast_params, fast_state = {n: p.clone() for n, p in params.items()}, state
        if donate:
            fast_state = tree_clone(state)
        with torch.no_grad():
            fast_params, fast_state = step(grads, fast_state, fast_params)
        closes = (t + 1) % k == 0
        if not closes:  # a mini-step: the same operations as the pure chain
            assert_bitwise_equal(fast_params, ref_params)
            assert_bitwise_equal(fast_state, ref_state)
        else:  # the closing chain's own fast step on the window's accumulated gradients
            closed += 1
            _check_closing(tx, grads, state, params, fast_params, fast_state, ref_params)
        params, state = ref_params, ref_state  # each step from the pure path's values
    assert closed == 2


def tree_clone(tree: Any) -> Any:
    leaves, spec = functopt.tree._core.flatten(tree)
    return functopt.tree._core.unflatten(
        spec, [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves])


def _check_closing(tx: Any, grads: Any, state: Any, params: Any, fast_params: Any,
                   fast_state: Any, ref_params: Any) -> None:
    from functopt.fast._multi import Split

    split = Split.of(tx)
    assert split is not None
    # the prefix by hand, then the running mean as MultiSteps computes it
    updates = grads
    for element, path in split.prefix:
        updates, _ = element.update(updates, _at(state, path), params)
    ms_state = _at(state, split.path)
    n = int(ms_state.mini_step) + 1
    mean = {p: (a + (updates[p].to(a.dtype) - a) / n).to(updates[p].dtype)
            for p, a in ms_state.acc_grads.items()}
    with torch.no_grad():
        expected, closed = F.fast.make_step(split.closing)(mean, split.closing_state(state),
                                                           params)
    assert_bitwise_equal(fast_params, expected)
    assert_bitwise_equal(split.closing_state(fast_state), closed)
    assert int(_at(fast_state, split.path).mini_step) == 0
    assert all(float(a.abs().max()) == 0 for a in _at(fast_state, split.path).acc_grads.values())
    for p in params:
        torch.testing.assert_close(fast_params[p], ref_params[p], rtol=1e-5, atol=1e-7)


def _at(state: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        state = state[key]
    return state


def test_skipped_and_overflowing_mini_steps_are_bitwise_the_pure_chain() -> None:
    """A nan gradient: the prefix clip makes every update nan, MultiSteps'
    skip_not_finite rejects the mini-step (nothing moves but skip_state); an inf at a
    closing mini-step without the skip reaches the inner apply_if_finite, which skips."""
    params = _params()
    tx = F.chain(F.clip_by_global_norm(0.5),
                 _ms(F.adamw(1e-2), 2, should_skip_update_fn=F.skip_not_finite))
    guarded = F.chain(F.clip_by_global_norm(0.5),
                      _ms(F.apply_if_finite(F.adamw(1e-2), max_consecutive_errors=2), 2))
    for chain_tx, bad_at in ((tx, {1, 2}), (guarded, {1})):
        state, fast_state, fast_params = chain_tx.init(params), chain_tx.init(params), params
        step = F.fast.make_step(chain_tx)
        ref = params
        for t in range(4):
            grads = _grads(10 + t, params)
            if t in bad_at:
                grads["w"][2, 1] = float("nan") if chain_tx is tx else float("inf")
            updates, state = chain_tx.update(grads, state, ref)
            ref = F.apply_updates(ref, updates)
            with torch.no_grad():
                fast_params, fast_state = step(grads, fast_state, fast_params)
            if t in bad_at:
                assert_bitwise_equal(fast_params, ref)
                assert_bitwise_equal(fast_state, state)
            fast_params, fast_state = ref, state
    assert int(state[1].inner_opt_state.total_notfinite) == 1  # (the guard did skip)


def test_what_is_not_split_stays_pure_and_says_why() -> None:
    """Chains that are not a Split (a combinator before the MultiSteps, two of them) and
    that the planner does not lower either (tests/test_multisteps_inside.py: a MultiSteps
    inside a combinator)."""
    params = {"w": torch.zeros(3)}
    ms = _ms(F.adamw(1e-2), 2)
    for tx, expected in ((F.chain(F.masked(F.scale(2.0), {"w": True}), ms),
                          "MultiSteps after other rules of its leaves"),
                         (F.chain(ms, ms), "a second MultiSteps in one transform")):
        reason = F.fast.explain(tx, params).reason or ""
        assert expected in reason, reason
        with pytest.warns(F.fast.FastPathWarning, match=expected):
            F.fast.make_step(tx)({"w": torch.ones(3)}, tx.init(params), params)
    # the closing chain's own reason, named as such
    lion = F.chain(F.clip_by_global_norm(1.0), _ms(F.lion(1e-4), 2))
    assert (F.fast.explain(lion, params).reason or "").startswith("MultiSteps' closing step")


def test_explain_says_what_the_mini_steps_run() -> None:
    params = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
    tx = F.chain(F.clip_by_global_norm(1.0), _ms(F.scale_by_adam(), 4),
                 F.scale_by_learning_rate(1e-3))
    lines = str(F.fast.explain(tx, params)).splitlines()
    assert lines[0].startswith("MultiSteps: each mini-step runs clip_by_global_norm(1.0) "
                               "(its update), a foreach accumulation"), lines
    assert "scale_by_learning_rate(learning_rate=0.001, flip_sign=True) on the zero " in lines[0]
    assert lines[1] == ("closing mini-step: fused path: 1 kernel call(s) per step, "
                        "0 global norm(s) in one pass")
    assert lines[2].startswith("  torch._fused_adamw_ on 2 float32 leaves")


@settings(max_examples=4, deadline=None)
@given(case=conformance.cases(dtypes=(torch.float32, torch.float64), max_leaves=3),
       k=st.sampled_from([1, 2]), name=st.sampled_from(sorted(NESTED)))
def test_fast_path_law_over_pytrees(case: tuple[Any, Any, Any], k: int, name: str) -> None:
    params, grads, _ = case
    conformance.check_fast_path(functools.partial(NESTED[name], k), params, grads,
                                steps=k + 1)


@settings(max_examples=4, deadline=None)
@given(case=conformance.cases(dtypes=(torch.float32, torch.float64), max_leaves=3),
       k=st.sampled_from([1, 2]))
def test_fast_path_law_over_pytrees_injected(case: tuple[Any, Any, Any], k: int) -> None:
    params, grads, _ = case
    conformance.check_fast_path(functools.partial(_injected_chain, k), params, grads,
                                steps=k + 1)


def _injected_chain(k: int) -> functopt.GradientTransformation:
    """A clip before the MultiSteps, inside inject_hyperparams: a scheduled learning rate of
    the inner AdamW and an injected constant of the clip."""
    return F.inject_hyperparams(lambda learning_rate, max_norm: F.chain(
        F.clip_by_global_norm(max_norm), _ms(F.adamw(learning_rate, weight_decay=0.1), k)))(
        learning_rate=F.schedules.linear_schedule(0.1, 0.01, 6), max_norm=0.5)


@pytest.mark.parametrize("donate", [False, True])
def test_a_chain_inside_inject_hyperparams_is_split_with_this_steps_values(
        donate: bool) -> None:
    """The chain built from each step's hyperparameters (the clip's max_norm edited between
    steps, the learning rate a schedule of the injection's count): mini-steps bitwise the
    pure path, closing mini-steps to the kernel's rounding, the injection's count and values
    as its update writes them."""
    k, params = 3, {n: p.double() for n, p in _params().items()}
    tx = _injected_chain(k)
    got = F.fast.explain(tx, params)
    assert got.fast and (got.mini_steps or "").startswith(
        "MultiSteps: each mini-step runs clip_by_global_norm("), str(got)
    step, state = F.fast.make_step(tx, donate=donate), tx.init(params)
    for t in range(2 * k + 1):
        state.hyperparams["max_norm"].fill_(0.5 + t)
        grads = _grads(t, params)
        updates, ref_state = tx.update(grads, state, params)
        ref_params = F.apply_updates(params, updates)
        with torch.no_grad():
            fast_params, fast_state = step(grads, tree_clone(state) if donate else state,
                                           {n: p.clone() for n, p in params.items()})
        if (t + 1) % k:
            assert_bitwise_equal((fast_params, fast_state), (ref_params, ref_state))
        leaves, spec = functopt.tree._core.flatten((fast_params, fast_state))
        ref_leaves, ref_spec = functopt.tree._core.flatten((ref_params, ref_state))
        assert spec == ref_spec
        for a, e in zip(leaves, ref_leaves, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
        params, state = ref_params, ref_state
    assert int(state.count) == 2 * k + 1 and int(state.inner_state[1].gradient_step) == 2


def test_an_injected_chain_that_changes_with_the_values_stays_pure_and_says_why() -> None:
    def factory(learning_rate: Any) -> functopt.GradientTransformation:
        # (a MultiSteps only for the value the structure was probed with)
        inner = _ms(F.sgd(learning_rate), 2) if float(learning_rate) == 1.0 else F.sgd(
            learning_rate)
        return F.chain(F.clip_by_global_norm(1.0), inner)

    tx = F.inject_hyperparams(factory)(learning_rate=0.5)
    params = {"w": torch.ones(3)}
    grads, state = {"w": torch.full((3,), 0.5)}, tx.init(params)
    with pytest.warns(F.fast.FastPathWarning, match="built from this step's values"):
        new, new_state = F.fast.make_step(tx)(grads, state, params)
    updates, ref_state = tx.update(grads, state, params)
    assert_bitwise_equal((new, new_state), (F.apply_updates(params, updates), ref_state))


def test_a_state_of_another_layout_gets_the_chains_own_error() -> None:
    params = {"w": torch.zeros(3)}
    tx = NESTED["clip, ms(adamw)"](2)
    state = tx.init(params)
    step = F.fast.make_step(tx)
    with pytest.raises(ValueError, match="chain of 2 transforms expects a tuple of 2 states"):
        step({"w": torch.ones(3)}, (*state, ()), params)
    named = NESTED["named clip, ms(sgd)"](2)
    with pytest.raises(ValueError, match="named_chain expects a state dict with keys"):
        F.fast.make_step(named)({"w": torch.ones(3)}, {"ms": named.init(params)["ms"]}, params)
