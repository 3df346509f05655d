"""Tests for functopt.chain and functopt.named_chain."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings

import functopt
from functopt.testing import bitwise_equal
from functopt.testing import clone_tree as clone
from functopt.testing import strategies as fst

# --------------------------------------------------------------------------- helpers






def clamp(limit: float) -> functopt.GradientTransformation:
    return functopt.stateless_with_tree_map(lambda g, p: g.clamp(-limit, limit))


def three() -> tuple[functopt.GradientTransformation, ...]:
    """Three transforms, two of them stateful, that do not commute."""
    return (
        functopt.scale_by_adam(b1=0.5),
        clamp(0.75),
        functopt.scale_by_schedule(lambda count: 1.0 / (count + 2)),
    )


def run(tx: functopt.GradientTransformation, params: Any, grads: list[Any]) -> list[Any]:
    state = tx.init(params)
    out = []
    for g in grads:
        u, state = tx.update(g, state, params)
        out.append(u)
    return out


def recording(name: str, log: list[tuple[str, Any]]) -> functopt.GradientTransformation:
    def update_fn(updates, state, params=None, **extra_args):
        log.append((name, extra_args))
        return updates, state

    return functopt.GradientTransformation(lambda p: functopt.EmptyState(), update_fn)


# --------------------------------------------------------------------------- laws


def test_empty_chain_is_the_identity():
    tx = functopt.chain()
    g = {"w": torch.tensor([1.0, float("nan")]), "b": None}
    state = tx.init({"w": torch.zeros(2), "b": None})
    assert state == ()
    updates, new_state = tx.update(g, state)
    assert updates is g and new_state == ()


@settings(max_examples=20)
@given(fst.params_and_gradients(grad_kind="any", allow_none=True))
def test_chain_is_associative_in_its_updates(case):
    params, grads = case
    a, b, c = three()
    grads_seq = [grads, grads]  # two steps, so the states matter
    flat = run(functopt.chain(a, b, c), params, grads_seq)
    right = run(functopt.chain(a, functopt.chain(b, c)), params, grads_seq)
    left = run(functopt.chain(functopt.chain(a, b), c), params, grads_seq)
    assert all(bitwise_equal(x, y) for x, y in zip(flat, right, strict=True))
    assert all(bitwise_equal(x, y) for x, y in zip(flat, left, strict=True))


@settings(max_examples=20)
@given(fst.params_and_gradients(grad_kind="any", allow_none=True))
def test_identity_is_neutral_and_chain_is_pure(case):
    params, grads = case
    adam = functopt.scale_by_adam()
    alone = run(adam, params, [grads])
    for tx in (
        functopt.chain(functopt.identity(), adam),
        functopt.chain(adam, functopt.identity()),
        functopt.chain(adam),
    ):
        assert bitwise_equal(run(tx, params, [grads])[0], alone[0])
    tx = functopt.chain(*three())
    state = tx.init(params)
    before = clone((params, grads, state))
    updates, _ = tx.update(grads, state, params)
    assert bitwise_equal((params, grads, state), before)
    assert fst.same_layout(updates, grads)


def test_chain_applies_in_order_and_keeps_a_tuple_of_states():
    tx = functopt.chain(functopt.scale(2.0), clamp(1.0))
    updates, state = tx.update([torch.tensor([0.4, 3.0])], tx.init(None))
    assert torch.equal(updates[0], torch.tensor([0.8, 1.0]))
    tx = functopt.chain(clamp(1.0), functopt.scale(2.0))
    updates, state = tx.update([torch.tensor([0.4, 3.0])], tx.init(None))
    assert torch.equal(updates[0], torch.tensor([0.8, 2.0]))
    assert isinstance(state, tuple) and len(state) == 2


def test_state_as_a_list_is_accepted():
    # Checkpoint round trips may turn tuples into lists.
    tx = functopt.chain(functopt.scale_by_adam(), functopt.scale(-1.0))
    state = list(tx.init([torch.zeros(1)]))
    _, new_state = tx.update([torch.ones(1)], state)
    assert isinstance(new_state, tuple) and int(new_state[0].count) == 1


def test_named_chain_computes_what_chain_computes():
    params = {"w": torch.randn(3, dtype=torch.float64)}
    grads = [{"w": torch.randn(3, dtype=torch.float64)} for _ in range(3)]
    a, b, c = three()
    plain = run(functopt.chain(a, b, c), params, grads)
    named = run(functopt.named_chain(("adam", a), ("clip", b), ("lr", c)), params, grads)
    assert all(bitwise_equal(x, y) for x, y in zip(plain, named, strict=True))
    tx = functopt.named_chain(("adam", a), ("lr", c))
    state = tx.init(params)
    assert list(state) == ["adam", "lr"]
    _, state = tx.update(grads[0], state)
    assert int(state["adam"].count) == 1 and int(state["lr"].count) == 1
    assert functopt.named_chain().init(params) == {}


def test_params_reach_every_transform():
    seen = []
    tx = functopt.chain(
        functopt.stateless(lambda u, p: seen.append(p) or u),
        functopt.stateless(lambda u, p: seen.append(p) or u),
    )
    params = [torch.ones(1)]
    tx.update([torch.ones(1)], tx.init(params), params)
    assert seen == [params, params]


# --------------------------------------------------------------------------- extra args


def test_extra_args_reach_transforms_that_take_them():
    log: list[tuple[str, Any]] = []
    calls: list[tuple[Any, ...]] = []

    def plain_update(updates, state, params=None):  # no **extra_args
        calls.append((updates, params))
        return updates, state

    plain = functopt.GradientTransformation(lambda p: (), plain_update)
    for tx in (
        functopt.chain(recording("a", log), plain, recording("b", log)),
        functopt.named_chain(("a", recording("a", log)), ("p", plain), ("b", recording("b", log))),
    ):
        log.clear()
        params = [torch.zeros(1)]
        updates, _ = tx.update([torch.ones(1)], tx.init(params), params, loss=0.5, step=3)
        assert log == [("a", {"loss": 0.5, "step": 3}), ("b", {"loss": 0.5, "step": 3})]
        assert calls[-1][1] is params
        assert torch.equal(updates[0], torch.ones(1))


def test_extra_args_reach_nested_chains():
    log: list[tuple[str, Any]] = []
    tx = functopt.chain(functopt.chain(recording("inner", log)), functopt.scale(1.0))
    tx.update([torch.ones(1)], tx.init(None), value=torch.tensor(2.0))
    assert log[0][0] == "inner" and float(log[0][1]["value"]) == 2.0


# --------------------------------------------------------------------------- errors


def test_error_wrong_state_for_chain():
    tx = functopt.chain(functopt.scale(1.0), functopt.scale(2.0))
    with pytest.raises(ValueError, match=r"chain of 2 transforms expects a tuple of 2 states, got a tuple of length 3"):
        tx.update([torch.ones(1)], ((), (), ()))
    with pytest.raises(TypeError, match=r"expects a tuple of 2 states, got a dict\. Fix: pass the state"):
        tx.update([torch.ones(1)], {})


def test_error_non_transform_argument():
    with pytest.raises(TypeError, match=r"chain: argument 1 must be a functopt.GradientTransformation, got float"):
        functopt.chain(functopt.identity(), 0.1)


def test_error_factory_passed_uncalled():
    with pytest.raises(TypeError, match=r"argument 0 .* callable \(scale_by_adam\): did you pass the factory"):
        functopt.chain(functopt.scale_by_adam, functopt.scale(-1.0))
    with pytest.raises(TypeError, match=r"transform 'adam' .* did you pass the factory"):
        functopt.named_chain(("adam", functopt.scale_by_adam))


def test_error_init_update_pair_not_wrapped():
    pair = (lambda p: (), lambda u, s, p=None: (u, s))
    with pytest.raises(TypeError, match=r"wrap the pair as functopt.GradientTransformation\(init_fn, update_fn\)"):
        functopt.chain(pair)


def test_error_multi_steps_passed_directly():
    ms = functopt.MultiSteps(functopt.identity(), 2)
    with pytest.raises(TypeError, match=r"got MultiSteps\. Fix: pass tx.gradient_transformation\(\)"):
        functopt.chain(ms)


def test_error_duplicate_names():
    with pytest.raises(ValueError, match=r"the name 'lr' is used twice \(arguments 0 and 2\)"):
        functopt.named_chain(
            ("lr", functopt.scale(1.0)), ("adam", functopt.scale_by_adam()), ("lr", functopt.scale(2.0))
        )


def test_error_named_chain_argument_not_a_pair():
    with pytest.raises(TypeError, match=r"argument 0 must be a \(name, transform\) pair .*without a name"):
        functopt.named_chain(functopt.scale(1.0))
    with pytest.raises(TypeError, match=r"argument 0 must be a \(name, transform\) pair .*got tuple"):
        functopt.named_chain((1, functopt.scale(1.0)))


def test_error_wrong_state_for_named_chain():
    tx = functopt.named_chain(("a", functopt.identity()), ("b", functopt.identity()))
    with pytest.raises(ValueError, match=r"keys \['a', 'b'\], got a dict with keys \['a'\]"):
        tx.update([torch.ones(1)], {"a": ()})
    with pytest.raises(TypeError, match=r"keys \['a', 'b'\], got a tuple"):
        tx.update([torch.ones(1)], ((), ()))


def test_chain_rejects_a_step_level_object_with_the_right_advice() -> None:
    step = functopt.precision.mixed_precision(functopt.sgd(0.1))
    with pytest.raises(TypeError, match=r"returns new params, not updates.*mixed_precision\(chain"):
        functopt.chain(step)
