"""Tests for functopt.apply_if_finite."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt.testing import bitwise_equal, conformance
from functopt.testing import clone_tree as clone
from functopt.testing import strategies as fst
from functopt.tree import _core

NAN = float("nan")
INF = float("inf")

# --------------------------------------------------------------------------- helpers






def counters(state: functopt.ApplyIfFiniteState) -> tuple[int, bool, int]:
    return int(state.notfinite_count), bool(state.last_finite), int(state.total_notfinite)


# --------------------------------------------------------------------------- behaviour


def test_init_state():
    tx = functopt.apply_if_finite(functopt.scale_by_adam(), 3)
    state = tx.init({"w": torch.zeros(2, dtype=torch.float64)})
    assert counters(state) == (0, True, 0)
    assert state.notfinite_count.dtype == torch.int32
    assert state.total_notfinite.dtype == torch.int32
    assert state.last_finite.dtype == torch.bool and state.last_finite.shape == ()
    assert state.inner_state.mu["w"].dtype == torch.float64


def test_finite_step_is_the_inner_step_bitwise():
    inner = functopt.scale_by_adam()
    tx = functopt.apply_if_finite(inner, 1)
    params = {"w": torch.randn(4), "b": torch.randn(2, dtype=torch.bfloat16)}
    state, ref_state = tx.init(params), inner.init(params)
    for _ in range(3):
        g = {"w": torch.randn(4), "b": torch.randn(2, dtype=torch.bfloat16)}
        updates, state = tx.update(g, state, params)
        ref, ref_state = inner.update(g, ref_state, params)
        assert bitwise_equal(updates, ref)
        assert bitwise_equal(state.inner_state, ref_state)
    assert counters(state) == (0, True, 0)


def test_skipped_step_returns_zeros_and_keeps_inner_state_bitwise():
    tx = functopt.apply_if_finite(functopt.scale_by_adam(), 5)
    params = {"w": torch.zeros(3, dtype=torch.float16), "b": torch.zeros(2)}
    state = tx.init(params)
    state = tx.update({"w": torch.ones(3, dtype=torch.float16), "b": torch.ones(2)}, state)[1]
    before = clone(state.inner_state)
    # The candidate inner state (Adam's moments after a nan gradient) holds nans; none of
    # them may leak into the kept state.
    g = {"w": torch.tensor([1.0, NAN, 2.0], dtype=torch.float16), "b": torch.tensor([INF, 0.0])}
    updates, state = tx.update(g, state)
    assert bitwise_equal(state.inner_state, before)
    assert updates["w"].dtype == torch.float16 and torch.equal(updates["w"], torch.zeros(3, dtype=torch.float16))
    assert torch.equal(updates["b"], torch.zeros(2))
    assert counters(state) == (1, False, 1)


def test_skip_restores_state_that_already_held_nan():
    # A nan already in the inner state (with its own bit pattern) must come back bitwise.
    odd_nan = torch.tensor([0x7FC12345], dtype=torch.int32).view(torch.float32)
    trace = functopt.GradientTransformation(
        lambda p: {"acc": torch.cat([odd_nan, torch.ones(1)])},
        lambda u, s, p=None, **kw: (u, {"acc": s["acc"] + u["w"]}),
    )
    tx = functopt.apply_if_finite(trace, 2)
    state = tx.init(None)
    before = clone(state.inner_state)
    _, state = tx.update({"w": torch.tensor([1.0, NAN])}, state)
    assert bitwise_equal(state.inner_state, before)


def test_counters_over_a_sequence():
    tx = functopt.apply_if_finite(functopt.scale(1.0), 10)
    state = tx.init([torch.zeros(1)])
    seq = [1.0, NAN, INF, 1.0, -INF, 2.0]
    expected = [(0, True, 0), (1, False, 1), (2, False, 2), (0, True, 2), (1, False, 3),
                (0, True, 3)]
    for value, want in zip(seq, expected, strict=True):
        _, state = tx.update([torch.tensor([value])], state)
        assert counters(state) == want


def test_gives_up_after_max_consecutive_errors():
    inner = functopt.scale_by_adam()
    tx = functopt.apply_if_finite(inner, 2)
    params = [torch.zeros(2)]
    state = tx.init(params)
    bad = [torch.tensor([NAN, 1.0])]
    ref_state = inner.init(params)
    for _ in range(2):  # two skipped
        updates, state = tx.update(bad, state)
        assert torch.equal(updates[0], torch.zeros(2))
        assert int(state.inner_state.count) == 0
    updates, state = tx.update(bad, state)  # the third in a row goes through
    ref, ref_state = inner.update(bad, ref_state)
    assert bitwise_equal(updates, ref) and torch.isnan(updates[0][0])
    assert bitwise_equal(state.inner_state, ref_state)
    assert counters(state) == (3, False, 3)
    updates, state = tx.update(bad, state)  # and so does every later one, until a finite one
    assert int(state.inner_state.count) == 2
    _, state = tx.update([torch.ones(2)], state)
    assert counters(state) == (0, True, 4)


def test_max_consecutive_errors_zero_applies_everything():
    tx = functopt.apply_if_finite(functopt.scale(2.0), 0)
    updates, state = tx.update([torch.tensor([INF])], tx.init([torch.zeros(1)]))
    assert torch.equal(updates[0], torch.tensor([INF]))
    assert counters(state) == (1, False, 1)


def test_none_leaves_pass_through_and_are_not_checked():
    tx = functopt.apply_if_finite(functopt.scale(2.0), 1)
    state = tx.init({"a": torch.zeros(1), "b": torch.zeros(1)})
    updates, state = tx.update({"a": torch.ones(1), "b": None}, state)
    assert updates["b"] is None and torch.equal(updates["a"], torch.full((1,), 2.0))
    assert bool(state.last_finite)
    updates, state = tx.update({"a": None, "b": None}, state)
    assert updates == {"a": None, "b": None} and bool(state.last_finite)


def test_extra_args_reach_the_inner_transform():
    seen = {}

    def update_fn(updates, state, params=None, **extra_args):
        seen.update(extra_args)
        return updates, state

    tx = functopt.apply_if_finite(functopt.GradientTransformation(lambda p: (), update_fn), 1)
    tx.update([torch.ones(1)], tx.init([torch.ones(1)]), loss=torch.tensor(1.5))
    assert float(seen["loss"]) == 1.5
    # An inner update without **extra_args is wrapped, so extra args are dropped for it.
    plain = functopt.GradientTransformation(lambda p: (), lambda u, s, p=None: (u, s))
    tx = functopt.apply_if_finite(plain, 1)
    tx.update([torch.ones(1)], tx.init(None), loss=1.0)


def test_no_host_sync_on_meta_tensors():
    # Meta tensors have no data: any .item()/bool() on the flag or the counters would raise.
    tx = functopt.apply_if_finite(functopt.chain(functopt.scale_by_adam(), functopt.scale(-1e-3)), 2)
    params = {"w": torch.empty(5, device="meta"), "b": torch.empty(3, device="meta")}
    state = tx.init(params)
    updates, state = tx.update({"w": torch.empty(5, device="meta"), "b": None}, state, params)
    assert updates["w"].device.type == "meta" and updates["b"] is None
    assert state.notfinite_count.device.type == "meta"


def test_works_under_torch_func_grad_through_the_inner_update():
    # The select is differentiable: d(update)/d(grad) flows through a finite step.
    tx = functopt.apply_if_finite(functopt.scale(3.0), 1)
    state = tx.init([torch.zeros(2)])

    def f(g):
        return tx.update([g], state)[0][0].sum()

    assert torch.equal(torch.func.grad(f)(torch.ones(2)), torch.full((2,), 3.0))


# --------------------------------------------------------------------------- properties


@settings(max_examples=20)
@given(
    st.data(),
    fst.params(max_leaves=4),
    st.integers(0, 3),
    st.lists(st.booleans(), min_size=1, max_size=6),
)
def test_property_against_a_branching_reference(data, params, max_errors, finite_flags):
    """Compare with a reference that branches in Python and runs the inner update only on
    applied steps; updates and inner state must agree bitwise, and the inputs stay intact."""
    inner = functopt.scale_by_adam()
    tx = functopt.apply_if_finite(inner, max_errors)
    state = tx.init(params)
    ref_inner = inner.init(params)
    ref_consecutive = ref_total = 0
    for want_finite in finite_flags:
        kind = "finite" if want_finite else "any"
        grads = data.draw(fst.gradients_like(params, kind=kind, allow_none=True))
        g_leaves = [x for x in _core.flatten(grads)[0] if x is not None]
        finite = all(bool(torch.isfinite(x).all()) for x in g_leaves)
        old_state = state
        grads_before, state_before = clone(grads), clone(state)

        updates, state = tx.update(grads, state, params)

        assert bitwise_equal(grads, grads_before) and bitwise_equal(old_state, state_before)
        assert fst.same_layout(updates, grads)
        ref_consecutive = 0 if finite else ref_consecutive + 1
        ref_total += 0 if finite else 1
        if finite or ref_consecutive > max_errors:
            ref_updates, ref_inner = inner.update(grads, ref_inner, params)
        else:
            ref_updates = _core.unflatten(
                _core.structure(grads),
                [None if x is None else torch.zeros_like(x) for x in _core.flatten(grads)[0]],
            )
        assert bitwise_equal(updates, ref_updates)
        assert bitwise_equal(state.inner_state, ref_inner)
        assert counters(state) == (ref_consecutive, finite, ref_total)


@settings(max_examples=15)
@given(fst.params_and_gradients(grad_kind="any", allow_none=True))
def test_property_inputs_unchanged(case):
    params, grads = case
    tx = functopt.apply_if_finite(functopt.scale_by_adam(), 1)
    state = tx.init(params)
    before = clone((params, grads, state))
    tx.update(grads, state, params)
    assert bitwise_equal((params, grads, state), before)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bad", [1.5, True, "3", None])
def test_error_max_consecutive_errors_not_int(bad):
    with pytest.raises(TypeError, match=r"max_consecutive_errors must be an int, got"):
        functopt.apply_if_finite(functopt.identity(), bad)


def test_error_max_consecutive_errors_negative():
    with pytest.raises(ValueError, match=r"max_consecutive_errors must be >= 0, got -1"):
        functopt.apply_if_finite(functopt.identity(), -1)


def test_error_inner_not_a_transform():
    with pytest.raises(TypeError, match=r"apply_if_finite: inner must be .*factory"):
        functopt.apply_if_finite(functopt.scale_by_adam, 1)


def test_error_wrong_state():
    tx = functopt.apply_if_finite(functopt.identity(), 1)
    with pytest.raises(TypeError, match=r"apply_if_finite: state must be the ApplyIfFiniteState .* got a tuple of 0"):
        tx.update([torch.ones(1)], ())


def test_error_inner_state_leaf_not_a_tensor():
    bad = functopt.GradientTransformation(lambda p: {"n": 0}, lambda u, s, p=None: (u, {"n": s["n"] + 1}))
    tx = functopt.apply_if_finite(bad, 1)
    with pytest.raises(TypeError, match=r"inner state leaf 'n' went from a int to a int"):
        tx.update([torch.ones(1)], tx.init(None))


def test_error_inner_state_changes_shape():
    bad = functopt.GradientTransformation(
        lambda p: {"acc": torch.zeros(1)},
        lambda u, s, p=None: (u, {"acc": torch.cat([s["acc"], s["acc"]])}),
    )
    tx = functopt.apply_if_finite(bad, 1)
    with pytest.raises(ValueError, match=r"inner state leaf 'acc' changed shape from \(1,\) to \(2,\)"):
        tx.update([torch.ones(1)], tx.init(None))


# --------------------------------------------------------------------------- conformance

test_conformance = conformance.conformance_test(
    lambda: functopt.apply_if_finite(functopt.scale_by_adam(), 1), max_examples=10, steps=3
)
