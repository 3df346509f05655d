"""Tests for functopt.MultiSteps and its skip rules."""

from __future__ import annotations

import functools
from typing import Any

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
F64 = torch.float64

# --------------------------------------------------------------------------- helpers






def counting(inner: functopt.GradientTransformation, calls: list[int]) -> functopt.GradientTransformation:
    """``inner``, counting its update calls."""

    def update_fn(updates, state, params=None, **extra_args):
        calls.append(1)
        return inner.update(updates, state, params, **extra_args)

    return functopt.GradientTransformation(inner.init, update_fn)


def sgd_momentum() -> functopt.GradientTransformation:
    # A stateful inner chain: Adam's moments, then a learning rate.
    return functopt.chain(functopt.scale_by_adam(b1=0.8), functopt.scale(-0.1))


def random_grads(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {"w": torch.randn(3, 2, generator=gen, dtype=F64), "b": torch.randn(2, generator=gen, dtype=F64)}
        for _ in range(n)
    ]


# --------------------------------------------------------------------------- maths


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_equals_inner_on_averaged_gradients_float64(k):
    n = 4
    params = {"w": torch.zeros(3, 2, dtype=F64), "b": torch.zeros(2, dtype=F64)}
    ms = functopt.MultiSteps(sgd_momentum(), every_k_schedule=k)
    inner = sgd_momentum()
    state, ref_state = ms.init(params), inner.init(params)
    grads = random_grads(k * n, seed=k)
    for step, g in enumerate(grads):
        updates, state = ms.update(g, state, params)
        if (step + 1) % k:
            assert torch.equal(updates["w"], torch.zeros(3, 2, dtype=F64))
            assert torch.equal(updates["b"], torch.zeros(2, dtype=F64))
            continue
        window = grads[step + 1 - k: step + 1]
        mean = {name: sum(w[name] for w in window) / k for name in ("w", "b")}
        ref, ref_state = inner.update(mean, ref_state, params)
        for name in ("w", "b"):
            torch.testing.assert_close(updates[name], ref[name], rtol=1e-12, atol=1e-12)
    assert int(state.gradient_step) == n and int(state.mini_step) == 0
    torch.testing.assert_close(state.inner_opt_state, ref_state, rtol=1e-12, atol=1e-12)


def test_use_grad_mean_false_sums():
    ms = functopt.MultiSteps(functopt.identity(), every_k_schedule=3, use_grad_mean=False)
    state = ms.init([torch.zeros(2, dtype=F64)])
    grads = [torch.tensor([1.0, 2.0], dtype=F64), torch.tensor([10.0, 20.0], dtype=F64),
             torch.tensor([100.0, 200.0], dtype=F64)]
    for g in grads:
        updates, state = ms.update([g], state)
    assert torch.equal(updates[0], torch.tensor([111.0, 222.0], dtype=F64))
    # With the mean (the default) the same window gives the average.
    ms = functopt.MultiSteps(functopt.identity(), every_k_schedule=3)
    state = ms.init([torch.zeros(2, dtype=F64)])
    for g in grads:
        updates, state = ms.update([g], state)
    assert torch.equal(updates[0], torch.tensor([37.0, 74.0], dtype=F64))


def test_inner_state_untouched_on_mini_steps():
    ms = functopt.MultiSteps(sgd_momentum(), every_k_schedule=3)
    params = {"w": torch.zeros(3, 2, dtype=F64), "b": torch.zeros(2, dtype=F64)}
    state = ms.init(params)
    grads = random_grads(6)
    _, state = ms.update(grads[0], state, params)
    _, state = ms.update(grads[1], state, params)
    _, state = ms.update(grads[2], state, params)  # closes a window
    inner_before = state.inner_opt_state
    copy = clone(inner_before)
    for g in grads[3:5]:
        _, state = ms.update(g, state, params)
        assert state.inner_opt_state is inner_before  # the very same object
        assert bitwise_equal(state.inner_opt_state, copy)
    _, state = ms.update(grads[5], state, params)
    assert not bitwise_equal(state.inner_opt_state, copy)


def test_inner_update_is_not_called_on_mini_steps():
    calls: list[int] = []
    k, n = 4, 3
    ms = functopt.MultiSteps(counting(sgd_momentum(), calls), every_k_schedule=k)
    params = {"w": torch.zeros(3, 2, dtype=F64), "b": torch.zeros(2, dtype=F64)}
    state = ms.init(params)
    for step, g in enumerate(random_grads(k * n)):
        _, state = ms.update(g, state, params)
        assert len(calls) == (step + 1) // k
    assert len(calls) == n


def test_schedule_of_the_gradient_step():
    seen: list[torch.Tensor] = []

    def every_k(gradient_step):
        seen.append(gradient_step)
        return gradient_step + 1  # windows of 1, 2, 3, ... mini-steps (a 0-d CPU tensor)

    calls: list[int] = []
    ms = functopt.MultiSteps(counting(functopt.identity(), calls), every_k)
    state = ms.init([torch.zeros(1, dtype=F64)])
    emitted = []
    for step in range(10):
        updates, state = ms.update([torch.tensor([float(step)], dtype=F64)], state)
        if ms.has_updated(state):
            emitted.append((step, float(updates[0])))
    assert emitted == [(0, 0.0), (2, 1.5), (5, 4.0), (9, 7.5)]
    assert all(s.device.type == "cpu" and s.dtype == torch.int32 for s in seen)


def test_has_updated():
    ms = functopt.MultiSteps(functopt.identity(), 2)
    state = ms.init([torch.zeros(1)])
    assert not bool(ms.has_updated(state))
    state = ms.update([torch.ones(1)], state)[1]
    assert not bool(ms.has_updated(state))
    state = ms.update([torch.ones(1)], state)[1]
    assert bool(ms.has_updated(state))


def test_counters_live_on_the_cpu_and_the_branch_reads_no_device_value():
    # Meta tensors have no data: a host read of any gradient-derived value would raise.
    calls: list[int] = []
    ms = functopt.MultiSteps(counting(sgd_momentum(), calls), every_k_schedule=2)
    params = {"w": torch.empty(4, device="meta")}
    state = ms.init(params)
    assert state.mini_step.device.type == "cpu" and state.gradient_step.device.type == "cpu"
    assert state.mini_step.dtype == torch.int32 and state.gradient_step.dtype == torch.int32
    for _ in range(4):
        updates, state = ms.update({"w": torch.empty(4, device="meta")}, state, params)
        assert updates["w"].device.type == "meta"
    assert len(calls) == 2
    assert state.acc_grads["w"].device.type == "meta"
    assert state.mini_step.device.type == "cpu" and state.gradient_step.device.type == "cpu"


def test_gradient_transformation_composes():
    ms = functopt.MultiSteps(functopt.scale(-1.0), 2)
    tx = functopt.chain(ms.gradient_transformation(), functopt.scale(2.0))
    state = tx.init([torch.zeros(1)])
    u, state = tx.update([torch.tensor([1.0])], state)
    assert torch.equal(u[0], torch.zeros(1))
    u, state = tx.update([torch.tensor([3.0])], state)
    assert torch.equal(u[0], torch.tensor([-4.0]))
    assert ms.inner_opt is not None


def test_extra_args_reach_the_inner_transform_on_emitting_steps():
    seen: list[dict[str, Any]] = []

    def update_fn(updates, state, params=None, **extra_args):
        seen.append(extra_args)
        return updates, state

    ms = functopt.MultiSteps(functopt.GradientTransformation(lambda p: (), update_fn), 2)
    state = ms.init([torch.zeros(1)])
    state = ms.update([torch.ones(1)], state, loss=1.0)[1]
    ms.update([torch.ones(1)], state, loss=2.0)
    assert seen == [{"loss": 2.0}]


def test_accumulator_dtype():
    params = {"h": torch.zeros(2, dtype=torch.float16), "d": torch.zeros(1, dtype=F64),
              "f": torch.zeros(1)}
    state = functopt.MultiSteps(functopt.identity(), 2).init(params)
    dtypes = {k: v.dtype for k, v in state.acc_grads.items()}
    assert dtypes == {"h": torch.float32, "d": F64, "f": torch.float32}
    state = functopt.MultiSteps(functopt.identity(), 2, accumulator_dtype=F64).init(params)
    assert all(v.dtype == F64 for v in state.acc_grads.values())


def test_float16_gradients_are_averaged_in_float32():
    ms = functopt.MultiSteps(functopt.identity(), 2)
    state = ms.init([torch.zeros(1, dtype=torch.float16)])
    big = torch.tensor([60000.0], dtype=torch.float16)  # big + big overflows float16
    state = ms.update([big], state)[1]
    updates, _ = ms.update([big], state)
    assert updates[0].dtype == torch.float16 and torch.equal(updates[0], big)


def test_none_gradients_pass_through():
    calls: list[Any] = []

    def update_fn(updates, state, params=None, **extra_args):
        calls.append(updates)
        return updates, state

    ms = functopt.MultiSteps(functopt.GradientTransformation(lambda p: (), update_fn), 2)
    state = ms.init({"a": torch.zeros(1), "frozen": torch.zeros(1)})
    updates, state = ms.update({"a": torch.ones(1), "frozen": None}, state)
    assert updates["frozen"] is None
    assert torch.equal(state.acc_grads["frozen"], torch.zeros(1))
    updates, state = ms.update({"a": torch.ones(1), "frozen": None}, state)
    assert calls[0]["frozen"] is None and updates["frozen"] is None


# --------------------------------------------------------------------------- skipping


def test_skip_not_finite_makes_a_mini_step_vanish():
    params = {"w": torch.zeros(3, 2, dtype=F64), "b": torch.zeros(2, dtype=F64)}
    grads = random_grads(4)
    bad = {"w": torch.full((3, 2), NAN, dtype=F64), "b": torch.zeros(2, dtype=F64)}

    plain = functopt.MultiSteps(sgd_momentum(), 2)
    skipping = functopt.MultiSteps(sgd_momentum(), 2, should_skip_update_fn=functopt.skip_not_finite)
    s_plain, s_skip = plain.init(params), skipping.init(params)
    assert int(s_skip.skip_state["num_not_finite"]) == 0
    outs_plain, outs_skip = [], []
    for g in grads:
        u, s_plain = plain.update(g, s_plain, params)
        outs_plain.append(u)
    for g in [grads[0], bad, grads[1], grads[2], bad, grads[3]]:
        before = s_skip
        u, s_skip = skipping.update(g, s_skip, params)
        if g is bad:
            assert bool(s_skip.skip_state["should_skip"])
            assert int(s_skip.skip_state["num_not_finite"]) == 6
            assert torch.equal(u["w"], torch.zeros(3, 2, dtype=F64))
            assert s_skip.acc_grads is before.acc_grads
            assert s_skip.inner_opt_state is before.inner_opt_state
            assert s_skip.mini_step is before.mini_step
        else:
            outs_skip.append(u)
    assert all(bitwise_equal(a, b) for a, b in zip(outs_plain, outs_skip, strict=True))


def test_skip_large_updates():
    fn = functools.partial(functopt.skip_large_updates, max_squared_norm=10.5)
    skip, info = fn({"a": torch.tensor([3.0]), "b": torch.tensor([1.0]), "c": None}, None, None)
    assert not bool(skip) and float(info["norm_squared"]) == 10.0
    assert bool(info["should_skip"]) is False
    skip, _ = fn({"a": torch.tensor([3.0, 1.5])}, None, None)
    assert bool(skip)
    skip, _ = functopt.skip_large_updates([torch.tensor([3.0, 1.0])], None, None, 10.0)
    assert bool(skip)  # the bound itself is too large: the norm must be strictly below
    skip, _ = fn({"a": torch.tensor([NAN])}, None, None)
    assert bool(skip)  # a nan norm is not "small enough"
    ms = functopt.MultiSteps(functopt.identity(), 1, should_skip_update_fn=fn)
    state = ms.init([torch.zeros(2)])
    updates, state = ms.update([torch.tensor([4.0, 0.0])], state)
    assert torch.equal(updates[0], torch.zeros(2)) and int(state.gradient_step) == 0
    updates, state = ms.update([torch.tensor([1.0, 0.0])], state)
    assert torch.equal(updates[0], torch.tensor([1.0, 0.0])) and int(state.gradient_step) == 1


def test_skip_large_updates_uses_the_norm_not_its_root():
    skip, info = functopt.skip_large_updates([torch.tensor([3.0, 4.0])], None, None, 24.0)
    assert float(info["norm_squared"]) == 25.0 and bool(skip)


def test_skip_not_finite_counts_and_handles_empty_trees():
    skip, info = functopt.skip_not_finite([torch.tensor([NAN, 1.0, float("-inf")]), None], None, None)
    assert bool(skip) and int(info["num_not_finite"]) == 2
    assert info["num_not_finite"].dtype == torch.int32
    skip, info = functopt.skip_not_finite([None], None, None)
    assert not bool(skip) and int(info["num_not_finite"]) == 0


def test_should_skip_may_return_a_python_bool():
    ms = functopt.MultiSteps(functopt.identity(), 1, should_skip_update_fn=lambda u, s, p: (True, {"why": 1}))
    updates, state = ms.update([torch.ones(1)], ms.init([torch.zeros(1)]))
    assert torch.equal(updates[0], torch.zeros(1)) and state.skip_state == {"why": 1}


# --------------------------------------------------------------------------- properties


@settings(max_examples=15)
@given(st.data(), fst.params(max_leaves=4), st.integers(1, 3), st.booleans())
def test_property_emits_the_window_mean(data, params, k, use_mean):
    """Mixed dtypes, None grads: zeros on mini-steps, the mean (sum) in the gradient's dtype
    when a window closes, inputs untouched, layout kept."""
    ms = functopt.MultiSteps(functopt.identity(), k, use_grad_mean=use_mean)
    state = ms.init(params)
    pattern = data.draw(fst.gradients_like(params, kind="typical", allow_none=True))
    none_at = [x is None for x in _core.flatten(pattern)[0]]
    window: list[Any] = []
    for _ in range(2 * k):
        drawn = data.draw(fst.gradients_like(params, kind="typical"))
        leaves, spec = _core.flatten(drawn)
        grads = _core.unflatten(spec, [None if n else x for x, n in zip(leaves, none_at, strict=True)])
        old_state, before = state, clone((grads, state))
        updates, state = ms.update(grads, state)
        assert bitwise_equal((grads, old_state), before)
        assert fst.same_layout(updates, grads)
        window.append(grads)
        u_leaves = _core.flatten(updates)[0]
        if len(window) < k:
            assert all(u is None or not u.any() for u in u_leaves)
            continue
        for i, u in enumerate(u_leaves):
            if u is None:
                continue
            parts = [_core.flatten(g)[0][i].to(F64) for g in window]
            ref = sum(parts) / (k if use_mean else 1)
            tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}.get(u.dtype, 1e-6)
            torch.testing.assert_close(u.to(F64), ref.to(u.dtype).to(F64), rtol=tol, atol=tol)
        window = []


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bad", [0, -2])
def test_error_every_k_below_one(bad):
    with pytest.raises(ValueError, match=rf"every_k_schedule must be >= 1, got {bad}"):
        functopt.MultiSteps(functopt.identity(), bad)


@pytest.mark.parametrize("bad", [True, "2", 2.0, None])
def test_error_every_k_wrong_type(bad):
    with pytest.raises(TypeError, match=r"every_k_schedule must be an int >= 1 or a schedule"):
        functopt.MultiSteps(functopt.identity(), bad)


@pytest.mark.parametrize("value", [0, 2.5, torch.tensor(0), "3", float("nan")])
def test_error_schedule_returns_a_bad_k(value):
    ms = functopt.MultiSteps(functopt.identity(), lambda step: value)
    state = ms.init([torch.zeros(1)])
    with pytest.raises(ValueError, match=r"every_k_schedule returned .* at gradient_step 0; expected an integer >= 1"):
        ms.update([torch.ones(1)], state)


def test_schedule_may_return_integral_tensor_or_float():
    for k in (torch.tensor(2), 2.0):
        ms = functopt.MultiSteps(functopt.identity(), lambda step, k=k: k)
        state = ms.init([torch.zeros(1)])
        state = ms.update([torch.ones(1)], state)[1]
        assert int(state.mini_step) == 1


def test_error_opt_not_a_transform():
    with pytest.raises(TypeError, match=r"MultiSteps: opt must be .*factory"):
        functopt.MultiSteps(functopt.scale_by_adam, 2)
    inner = functopt.MultiSteps(functopt.identity(), 2)
    with pytest.raises(TypeError, match=r"gradient_transformation\(\)"):
        functopt.MultiSteps(inner, 2)


def test_error_should_skip_not_callable():
    with pytest.raises(TypeError, match=r"should_skip_update_fn must be None or callable"):
        functopt.MultiSteps(functopt.identity(), 2, should_skip_update_fn=True)


@pytest.mark.parametrize("decision", [torch.tensor([True]), torch.tensor(1), 1])
def test_error_should_skip_returns_wrong_decision(decision):
    ms = functopt.MultiSteps(functopt.identity(), 2, should_skip_update_fn=lambda u, s, p: (decision, ()))
    state = ms.init([torch.zeros(1)])
    with pytest.raises(TypeError, match=r"should_skip a bool or a 0-d bool tensor"):
        ms.update([torch.ones(1)], state)


def test_error_accumulator_dtype():
    with pytest.raises(TypeError, match=r"accumulator_dtype must be None or a floating"):
        functopt.MultiSteps(functopt.identity(), 2, accumulator_dtype=torch.int32)


def test_error_gradient_for_a_none_param():
    ms = functopt.MultiSteps(functopt.identity(), 2)
    state = ms.init({"a": torch.zeros(1), "b": None})
    with pytest.raises(ValueError, match=r"updates leaf 'b' is a tensor, but state.acc_grads holds None"):
        ms.update({"a": torch.ones(1), "b": torch.ones(1)}, state)


def test_error_gradient_shape_differs_from_accumulator():
    ms = functopt.MultiSteps(functopt.identity(), 2)
    state = ms.init({"a": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"'a': update has shape \(3,\) but accumulator has shape \(2,\)"):
        ms.update({"a": torch.ones(3)}, state)


def test_error_state_structure():
    ms = functopt.MultiSteps(functopt.identity(), 2)
    state = ms.init({"a": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"state.acc_grads does not have the structure of updates"):
        ms.update({"b": torch.ones(2)}, state)
    with pytest.raises(TypeError, match=r"state.mini_step must be a 0-d integer tensor, got a int"):
        ms.update({"a": torch.ones(2)}, state._replace(mini_step=0))


# --------------------------------------------------------------------------- conformance

test_conformance = conformance.conformance_test(
    lambda: functopt.MultiSteps(functopt.scale_by_adam(), 2).gradient_transformation(),
    max_examples=10, steps=3,
)
