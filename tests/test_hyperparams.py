"""inject_hyperparams: bitwise equal to the plain transform, editable and scheduled
hyperparameters, meta-gradients through the injected values, and its errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt import schedules
from functopt import tree as ft
from functopt.testing import strategies as fst


def adam_like(learning_rate, b1=0.9, b2=0.999, eps=1e-8, *, nesterov: bool = False):
    return functopt.chain(
        functopt.scale_by_adam(b1=b1, b2=b2, eps=eps, nesterov=nesterov),
        functopt.scale_by_learning_rate(learning_rate),
    )


def sgd(learning_rate):
    return functopt.scale_by_learning_rate(learning_rate)


def _bits(x):
    return x.reshape(-1).view(torch.uint8)


def _assert_bitwise(a, b):
    a_leaves, a_spec = ft.flatten(a)
    b_leaves, b_spec = ft.flatten(b)
    assert a_spec == b_spec
    for x, y in zip(a_leaves, b_leaves, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(_bits(x), _bits(y))


def _clone(tree):
    return ft.map(lambda x: x.clone(), tree)


# 0-d leaves included: the transforms cast each 0-d float64 hyperparameter to the dtype the
# leaf's maths runs in, so it cannot promote a 0-d leaf (see tests/test_zero_dim.py).
_SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@settings(max_examples=15)
@given(
    st.sampled_from(["finite", "any"]),
    st.booleans(),
    st.data(),
)
def test_injected_equals_plain_bitwise(grad_kind, nesterov, data):
    leaf = st.one_of(st.none(), fst.tensors(fst.dtypes(), _SHAPES, "typical"))
    params = data.draw(fst.pytrees(leaf))
    lr = schedules.cosine_decay_schedule(0.1, 5)
    plain = adam_like(lr, b1=0.8, b2=0.99, eps=1e-6, nesterov=nesterov)
    injected = functopt.inject_hyperparams(adam_like)(lr, b1=0.8, b2=0.99, eps=1e-6,
                                                      nesterov=nesterov)
    plain_state, state = plain.init(params), injected.init(params)
    for step in range(3):
        grads = data.draw(fst.gradients_like(params, kind=grad_kind, allow_none=True))
        old_state, snapshot, grads_before = state, _clone(state), _clone(grads)
        u_plain, plain_state = plain.update(grads, plain_state, params)
        u, state = injected.update(grads, state, params)
        _assert_bitwise(u, u_plain)
        _assert_bitwise(state.inner_state[0], plain_state[0])
        _assert_bitwise(grads, grads_before)  # pure: inputs untouched
        _assert_bitwise(old_state, snapshot)
        assert state.count.item() == step + 1
        assert state.hyperparams["learning_rate"].item() == lr(step)


def _zero_dim_chain(make_tx):
    params = {"a": torch.tensor(0.5), "b": torch.tensor(-1.0, dtype=torch.bfloat16)}
    grads = {"a": torch.tensor(0.25), "b": torch.tensor(2.0, dtype=torch.bfloat16)}
    plain = make_tx(False)
    injected = make_tx(True)
    u_plain, _ = plain.update(grads, plain.init(params), params)
    u, _ = injected.update(grads, injected.init(params), params)
    return u_plain, u


def test_zero_dim_leaves_keep_their_dtype():
    # The float64 hyperparameters are cast to the dtype of the leaf's maths before they meet
    # a 0-d leaf, so the update keeps the leaf's dtype and equals the plain one bitwise.
    def make(inject):
        factory = functopt.inject_hyperparams(functopt.scale_by_adam) if inject else (
            functopt.scale_by_adam)
        return factory(b1=0.8, b2=0.99)

    u_plain, u = _zero_dim_chain(make)
    _assert_bitwise(u, u_plain)


def test_zero_dim_leaves_keep_their_dtype_through_scale():
    def make(inject):
        return (functopt.inject_hyperparams(sgd) if inject else sgd)(learning_rate=0.1)

    u_plain, u = _zero_dim_chain(make)
    _assert_bitwise(u, u_plain)


def test_state_layout_and_dtypes():
    tx = functopt.inject_hyperparams(adam_like)(learning_rate=1e-3)
    state = tx.init({"w": torch.zeros(2, dtype=torch.bfloat16)})
    assert isinstance(state, functopt.InjectHyperparamsState)
    assert state.count.dtype == torch.int32 and state.count.item() == 0
    assert sorted(state.hyperparams) == ["b1", "b2", "eps", "learning_rate"]
    for value in state.hyperparams.values():
        assert value.dtype == torch.float64 and value.shape == ()
    assert state.hyperparams["b2"].item() == 0.999
    assert ft.get(state, "learning_rate") is state.hyperparams["learning_rate"]


def test_editing_a_constant_changes_the_next_update():
    tx = functopt.inject_hyperparams(sgd)(learning_rate=0.1)
    params = {"w": torch.zeros(2)}
    grads = {"w": torch.tensor([1.0, -2.0])}
    state = tx.init(params)
    u, state = tx.update(grads, state)
    assert torch.equal(u["w"], grads["w"] * -0.1)
    state.hyperparams["learning_rate"] = torch.tensor(0.5, dtype=torch.float64)
    u, state = tx.update(grads, state)
    assert torch.equal(u["w"], grads["w"] * -0.5)
    assert state.hyperparams["learning_rate"].item() == 0.5  # the edit persists
    state.hyperparams["learning_rate"] = 0.25  # a Python number is converted
    u, state = tx.update(grads, state)
    assert torch.equal(u["w"], grads["w"] * -0.25)
    assert state.hyperparams["learning_rate"].dtype == torch.float64
    state = ft.set(state, learning_rate=torch.tensor(2.0, dtype=torch.float64))
    u, _ = tx.update(grads, state)
    assert torch.equal(u["w"], grads["w"] * -2.0)


def test_schedules_are_evaluated_at_the_count_and_recorded():
    schedule = schedules.piecewise_constant_schedule(1.0, {2: 0.1})
    tx = functopt.inject_hyperparams(sgd)(learning_rate=schedule)
    state = tx.init({"w": torch.zeros(1)})
    assert state.hyperparams["learning_rate"].item() == 1.0  # value at count 0
    used = []
    for _ in range(4):
        u, state = tx.update({"w": torch.ones(1)}, state)
        used.append(-u["w"].item())
        assert state.hyperparams["learning_rate"].item() == pytest.approx(used[-1])
    assert used == pytest.approx([1.0, 1.0, 0.1, 0.1])
    # Editing a scheduled value has no effect: the schedule wins, as in optax.
    state.hyperparams["learning_rate"] = torch.tensor(5.0, dtype=torch.float64)
    u, _ = tx.update({"w": torch.ones(1)}, state)
    assert u["w"].item() == pytest.approx(-0.1)


def test_what_stays_static():
    def factory(learning_rate, steps: int = 3, flag=True, name="x", fn=None, size=2):
        assert isinstance(steps, int) and isinstance(flag, bool) and isinstance(size, int)
        assert name == "x" and (fn is None or fn(0) == "called")
        return sgd(learning_rate)

    tx = functopt.inject_hyperparams(factory, static_args="fn")(
        0.1, steps=torch.tensor(4), flag=False, fn=lambda _: "called", size=5)
    state = tx.init({"w": torch.zeros(1)})
    assert sorted(state.hyperparams) == ["learning_rate"]
    tx.update({"w": torch.ones(1)}, state)
    # An int for a parameter that also admits floats is injected (as in optax).
    tx = functopt.inject_hyperparams(sgd)(learning_rate=1)
    state = tx.init({"w": torch.zeros(1)})
    assert state.hyperparams["learning_rate"].dtype == torch.float64


def test_hyperparam_dtype_and_tensor_values():
    lr = torch.tensor(0.5, dtype=torch.float32)
    tx = functopt.inject_hyperparams(adam_like)(learning_rate=lr)
    state = tx.init({"w": torch.zeros(1)})
    assert state.hyperparams["learning_rate"] is lr  # a tensor keeps its dtype (and graph)
    assert state.hyperparams["b1"].dtype == torch.float64
    tx = functopt.inject_hyperparams(adam_like, hyperparam_dtype=torch.float32)(
        learning_rate=schedules.constant_schedule(0.5), b1=torch.tensor(0.9, dtype=torch.float64))
    state = tx.init({"w": torch.zeros(1)})
    assert {v.dtype for v in state.hyperparams.values()} == {torch.float32}
    _, state = tx.update({"w": torch.ones(1)}, state)
    assert {v.dtype for v in state.hyperparams.values()} == {torch.float32}


def test_extra_args_reach_the_inner_transform():
    seen = {}

    def factory(learning_rate):
        def update(updates, state, params=None, **extra):
            seen.update(extra)
            return updates, state
        return functopt.GradientTransformation(lambda p: functopt.EmptyState(), update)

    tx = functopt.inject_hyperparams(factory)(learning_rate=0.1)
    tx.update({"w": torch.ones(1)}, tx.init({"w": torch.zeros(1)}), loss=3.0)
    assert seen == {"loss": 3.0}
    plain = functopt.inject_hyperparams(sgd)(learning_rate=0.1)  # sgd ignores extra args
    plain.update({"w": torch.ones(1)}, plain.init({"w": torch.zeros(1)}), loss=3.0)
    assert functopt.inject_hyperparams(sgd).__name__ == "sgd"


def _quadratic_data():
    a = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    b = torch.tensor([1.0, -1.0], dtype=torch.float64)
    return a, b


def _loss(w, a, b):
    return 0.5 * w @ a @ w - b @ w


def _loss_after_two_sgd_steps(lr, *, edit_state=False):
    a, b = _quadratic_data()
    params = {"w": torch.tensor([0.3, -0.2], dtype=torch.float64)}
    if edit_state:
        tx = functopt.inject_hyperparams(sgd)(learning_rate=0.01)
        state = tx.init(params)
        state.hyperparams["learning_rate"] = lr
    else:
        tx = functopt.inject_hyperparams(sgd)(learning_rate=lr)
        state = tx.init(params)
    for _ in range(2):
        grads = {"w": torch.func.grad(_loss)(params["w"], a, b)}
        updates, state = tx.update(grads, state, params)
        params = functopt.apply_updates(params, updates)
    return _loss(params["w"], a, b)


@pytest.mark.parametrize("edit_state", [False, True])
def test_meta_gradient_equals_finite_differences(edit_state):
    lr = torch.tensor(0.3, dtype=torch.float64)
    meta = torch.func.grad(lambda v: _loss_after_two_sgd_steps(v, edit_state=edit_state))(lr)
    h = 1e-6
    fd = (_loss_after_two_sgd_steps(lr + h) - _loss_after_two_sgd_steps(lr - h)) / (2 * h)
    assert math.isclose(meta.item(), fd.item(), rel_tol=1e-7)
    assert meta.item() != 0.0


def test_meta_gradient_through_an_injected_adam():
    def final_loss(lr):
        a, b = _quadratic_data()
        params = {"w": torch.tensor([0.3, -0.2], dtype=torch.float64)}
        tx = functopt.inject_hyperparams(adam_like)(learning_rate=lr)
        state = tx.init(params)
        for _ in range(2):
            grads = {"w": torch.func.grad(_loss)(params["w"], a, b)}
            updates, state = tx.update(grads, state, params)
            params = functopt.apply_updates(params, updates)
        return _loss(params["w"], a, b)

    lr = torch.tensor(0.05, dtype=torch.float64)
    meta = torch.func.grad(final_loss)(lr)
    h = 1e-6
    fd = (final_loss(lr + h) - final_loss(lr - h)) / (2 * h)
    assert math.isclose(meta.item(), fd.item(), rel_tol=1e-6)


# --- Errors -----------------------------------------------------------------------------


def test_construction_errors():
    with pytest.raises(TypeError, match=r"inject_hyperparams: inner_factory must be a transform "
                                        r"factory such as functopt.adam, got SpecifiedTransformation"):
        functopt.inject_hyperparams(sgd(0.1))
    with pytest.raises(ValueError, match=r"static_args \['lr'\] are not parameters of sgd, "
                                         r"whose parameters are \['learning_rate'\]"):
        functopt.inject_hyperparams(sgd, static_args=["lr"])
    with pytest.raises(TypeError, match=r"hyperparam_dtype must be None or a floating "
                                        r"torch.dtype, got torch.int32"):
        functopt.inject_hyperparams(sgd, hyperparam_dtype=torch.int32)
    with pytest.raises(TypeError, match=r"inject_hyperparams\(chain\): chain takes 'transforms' "
                                        r"as variadic positional; inject_hyperparams rebuilds"):
        functopt.inject_hyperparams(functopt.chain)(sgd(0.1))


def test_bad_values_fail_at_construction_with_the_factory_message():
    with pytest.raises(ValueError, match=r"scale_by_adam: b1 must be in \[0, 1\), got 1.5"):
        functopt.inject_hyperparams(adam_like)(learning_rate=0.1, b1=1.5)
    with pytest.raises(TypeError, match=r"inject_hyperparams\(sgd\): missing a required "
                                        r"argument: 'learning_rate'. Its signature is "
                                        r"\(learning_rate\)"):
        functopt.inject_hyperparams(sgd)(lr=0.1)


def test_update_errors():
    tx = functopt.inject_hyperparams(sgd)(learning_rate=0.1)
    state = tx.init({"w": torch.zeros(1)})
    grads = {"w": torch.ones(1)}
    with pytest.raises(TypeError, match=r"inject_hyperparams\(sgd\): expected an "
                                        r"InjectHyperparamsState, got tuple"):
        tx.update(grads, (state,))
    bad = state._replace(hyperparams={"lr": torch.tensor(0.1)})
    with pytest.raises(ValueError, match=r"state.hyperparams has keys \['lr'\], expected "
                                         r"\['learning_rate'\]. Fix: edit the values"):
        tx.update(grads, bad)
    bad = state._replace(hyperparams={"learning_rate": "fast"})
    with pytest.raises(TypeError, match=r"state.hyperparams\['learning_rate'\] must be a number "
                                        r"or a tensor, got str 'fast'"):
        tx.update(grads, bad)


def test_callables_that_are_not_schedules_need_static_args():
    def factory(learning_rate, mask=None):
        assert mask is None or callable(mask)
        return sgd(learning_rate)

    with pytest.raises(TypeError, match=r"inject_hyperparams\(factory\): the callable passed "
                                        r"as 'mask' is taken for a schedule, but at step 0 it "
                                        r"returned dict.*static_args='mask'"):
        functopt.inject_hyperparams(factory)(0.1, mask=lambda params: {"w": True})

    def failing(params):
        return {k: True for k in params}

    with pytest.raises(TypeError, match=r"calling it with the step count \(a 0-d int32 tensor\) "
                                        r"failed: TypeError: .*static_args='mask'"):
        functopt.inject_hyperparams(factory)(0.1, mask=failing)
    tx = functopt.inject_hyperparams(factory, static_args=("mask",))(0.1, mask=failing)
    assert sorted(tx.init({"w": torch.zeros(1)}).hyperparams) == ["learning_rate"]


@pytest.mark.parametrize("make, kwargs", [
    (functopt.adamw, {"learning_rate": 1e-3, "weight_decay": 0.01}),
    (functopt.sgd, {"learning_rate": 0.1, "momentum": 0.9}),
    (functopt.add_decayed_weights, {"weight_decay": 0.01}),
])
def test_injected_recipe_is_bitwise_the_plain_one(make, kwargs) -> None:
    """inject_hyperparams(f)(**kw) computes what f(**kw) does, bit for bit (float32, five
    steps): a decay rate injected as a 0-d CPU tensor is read as the number, so the decay
    is the same single-rounding torch.add(g, p, alpha=rate) (it was one ulp off)."""
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(1000, generator=gen)}
    grads = {"w": torch.randn(1000, generator=gen)}
    plain, injected = make(**kwargs), functopt.inject_hyperparams(make)(**kwargs)
    s_plain, s_inj = plain.init(params), injected.init(params)
    p_plain, p_inj = dict(params), dict(params)
    for _ in range(5):
        u, s_plain = plain.update(grads, s_plain, p_plain)
        p_plain = functopt.apply_updates(p_plain, u)
        u, s_inj = injected.update(grads, s_inj, p_inj)
        p_inj = functopt.apply_updates(p_inj, u)
    assert torch.equal(p_plain["w"], p_inj["w"])
