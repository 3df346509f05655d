"""``make_step`` of a ``MultiSteps`` inside a combinator (``masked``, ``partition``,
``inject_hyperparams``, a chain beside them): its mini-steps accumulate with ``foreach`` ops
in the caller's state while the other leaves take their kernels, and the closing mini-step
steps its inner transform on the kernels. Held to the pure path: the MultiSteps' state and
its leaves' params on every mini-step bitwise (the same operations), everything else in
float64 to 1e-12 (the kernels order the arithmetic otherwise)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_multisteps_nested import _grads, tree_clone

import functopt
from functopt.testing import assert_bitwise_equal, conformance
from functopt.transforms.multi_steps import MultiStepsState
from functopt.tree import _core

F = functopt
WEIGHTS, BIASES = {"w": True, "b": False}, {"w": False, "b": True}


def _ms(inner: functopt.GradientTransformation, k: int,
        **options: Any) -> functopt.GradientTransformation:
    return F.MultiSteps(inner, every_k_schedule=k, **options).gradient_transformation()


# name -> (the transform for windows of k mini-steps, the leaves of its MultiSteps whose
# params a mini-step leaves bitwise as the pure path)
INSIDE: dict[str, tuple[Callable[[int], functopt.GradientTransformation], tuple[str, ...]]] = {
    "masked ms(adamw), masked sgd": (lambda k: F.chain(
        F.masked(_ms(F.adamw(1e-2, weight_decay=0.1), k), WEIGHTS),
        F.masked(F.sgd(0.1, momentum=0.9), BIASES)), ("w",)),
    "partition ms(adam), clip+sgd": (lambda k: F.partition(
        {"acc": _ms(F.adam(1e-2), k, use_grad_mean=False),
         "sgd": F.chain(F.clip_by_global_norm(0.5), F.sgd(0.1))}, {"w": "acc", "b": "sgd"}),
        ("w",)),
    "inject(ms(adamw))": (lambda k: F.inject_hyperparams(
        lambda learning_rate, weight_decay: _ms(F.adamw(learning_rate,
                                                        weight_decay=weight_decay), k))(
        learning_rate=1e-2, weight_decay=0.1), ("w", "b")),
    "inject(ms(sgd)), scheduled lr": (lambda k: F.inject_hyperparams(
        lambda learning_rate: _ms(F.sgd(learning_rate, momentum=0.9), k))(
        learning_rate=F.schedules.linear_schedule(0.1, 0.01, 5)), ("w", "b")),
    "masked(inject(ms(adamw))), masked sgd": (lambda k: F.named_chain(
        ("acc", F.masked(F.inject_hyperparams(
            lambda learning_rate: _ms(F.adamw(learning_rate), k))(learning_rate=1e-2),
            WEIGHTS)),
        ("sgd", F.masked(F.sgd(0.1), BIASES))), ("w",)),
    # its zero updates reach rules after it (a masked decay, a learning rate): the kernels
    # step them on zero gradients (the decayed leaf to rounding, the other bitwise)
    "ms(adam), masked decay, lr": (lambda k: F.chain(
        _ms(F.scale_by_adam(), k), F.masked(F.add_decayed_weights(0.1), WEIGHTS),
        F.scale_by_learning_rate(1e-2)), ("b",)),
    "apply_if_finite(ms(adamw))": (lambda k: F.apply_if_finite(
        _ms(F.adamw(1e-2, weight_decay=0.1), k), max_consecutive_errors=1), ("w", "b")),
    "apply_if_finite(partition ms(clip+adam), sgd)": (lambda k: F.apply_if_finite(
        F.partition({"acc": _ms(F.chain(F.clip_by_global_norm(0.5), F.adam(1e-2)), k),
                     "sgd": F.sgd(0.1, momentum=0.9)}, {"w": "acc", "b": "sgd"}),
        max_consecutive_errors=1), ("w",)),
    # the inner injection's schedule reads the outer's value: both levels resolved per step
    "inject(inject(ms(sgd)))": (lambda k: F.inject_hyperparams(
        lambda peak: F.inject_hyperparams(lambda learning_rate: _ms(F.sgd(learning_rate), k))(
            learning_rate=lambda count: peak * 0.5 ** count))(peak=0.1), ("w", "b")),
}


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(5, 3, generator=gen, dtype=torch.float64),
              "b": torch.randn(3, generator=gen, dtype=torch.float64)}
    params["w"][0, 0] = -0.0  # a zero update makes it 0.0: checked bitwise
    return params


def _multi_state(state: Any) -> MultiStepsState:
    """The one MultiStepsState within ``state``."""
    found = []

    def visit(node: Any) -> None:
        if isinstance(node, MultiStepsState):
            found.append(node)
        elif isinstance(node, dict):
            for value in node.values():
                visit(value)
        elif isinstance(node, tuple):
            for value in node:
                visit(value)

    visit(state)
    assert len(found) == 1
    return found[0]


def _close(actual: Any, expected: Any) -> None:
    """Equal in float64 to 1e-12 (relative), leaf by leaf; every other leaf exactly."""
    got, spec = _core.flatten(actual)
    want, want_spec = _core.flatten(expected)
    assert spec == want_spec
    for a, e in zip(got, want, strict=True):
        if isinstance(e, torch.Tensor) and e.is_floating_point():
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
        else:
            assert_bitwise_equal(a, e)


def _stepped(tx: Any, step: Any, grads: Any, state: Any, params: Any, *, donate: bool,
             ) -> tuple[Any, Any, Any, Any]:
    """(the pure step's params and state, the fast step's), each from the same inputs."""
    updates, ref_state = tx.update(grads, state, params)
    ref_params = F.apply_updates(params, updates)
    fast_params = {n: p.clone() for n, p in params.items()}
    fast_state = tree_clone(state) if donate else state
    with torch.no_grad():
        fast_params, fast_state = step(grads, fast_state, fast_params)
    return ref_params, ref_state, fast_params, fast_state


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("name", list(INSIDE))
def test_mini_steps_bitwise_closing_steps_to_rounding(name: str, donate: bool) -> None:
    k, (factory, mine) = 3, INSIDE[name]
    tx, params = factory(k), _params()
    got = F.fast.explain(tx, params)
    assert got.fast and got.mini_steps is not None, str(got)  # (and no FastPathWarning below)
    step, state, closed = F.fast.make_step(tx, donate=donate), tx.init(params), 0
    for t in range(2 * k + 1):  # two windows closed, a third begun
        grads = _grads(t, params)
        ref_params, ref_state, fast_params, fast_state = _stepped(
            tx, step, grads, state, params, donate=donate)
        ms, ref_ms = _multi_state(fast_state), _multi_state(ref_state)
        assert_bitwise_equal(ms._replace(inner_opt_state=()),
                             ref_ms._replace(inner_opt_state=()))
        if (t + 1) % k:  # a mini-step: its leaves as the pure path, its inner state untouched
            for leaf in mine:
                assert_bitwise_equal(fast_params[leaf], ref_params[leaf])
            assert_bitwise_equal(ms.inner_opt_state, ref_ms.inner_opt_state)
        else:
            closed += 1
        _close(fast_params, ref_params)
        _close(fast_state, ref_state)
        params, state = ref_params, ref_state  # each step from the pure path's values
    assert closed == 2


@pytest.mark.parametrize("donate", [False, True])
def test_a_donated_step_accumulates_in_the_callers_state(donate: bool) -> None:
    tx = INSIDE["masked ms(adamw), masked sgd"][0](3)
    params = _params()
    state = tx.init(params)
    acc = _multi_state(state).acc_grads["w"]
    step = F.fast.make_step(tx, donate=donate)
    with torch.no_grad():
        for t in range(3):
            params, state = step(_grads(t, params), state, params)
            assert (_multi_state(state).acc_grads["w"] is acc) == donate
            # written in place on the mini-steps, reset in place when the window closes; a
            # step without donation leaves the caller's zeros as they were
            assert (float(acc.abs().max()) > 0) == (donate and t < 2), t


@pytest.mark.parametrize("donate", [False, True])
def test_skipped_mini_steps_are_bitwise_the_pure_path(donate: bool) -> None:
    """skip_not_finite rejects a mini-step with a nan gradient (nothing of the MultiSteps
    moves but its skip_state); the other leaves step as always."""
    tx = F.partition({"acc": _ms(F.adamw(1e-2), 2, should_skip_update_fn=F.skip_not_finite),
                      "sgd": F.sgd(0.1)}, {"w": "acc", "b": "sgd"})
    params = _params()
    state = tx.init(params)
    step = F.fast.make_step(tx, donate=donate)
    for t in range(5):
        grads = _grads(20 + t, params)
        if t in (1, 2):
            grads["w"][2, 1] = float("nan")
        ref_params, ref_state, fast_params, fast_state = _stepped(
            tx, step, grads, state, params, donate=donate)
        if t in (1, 2):
            assert_bitwise_equal(fast_params["w"], ref_params["w"])
            assert_bitwise_equal(_multi_state(fast_state), _multi_state(ref_state))
            assert int(_multi_state(ref_state).skip_state["num_not_finite"]) == 1
        _close(fast_params, ref_params)
        _close(fast_state, ref_state)
        params, state = ref_params, ref_state
    assert int(_multi_state(state).gradient_step) == 1  # (three mini-steps taken, one window)


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("name", ["apply_if_finite(ms(adamw))",
                                  "apply_if_finite(partition ms(clip+adam), sgd)"])
def test_a_guard_around_it_skips_or_applies_as_the_pure_path(name: str, donate: bool) -> None:
    """apply_if_finite around the MultiSteps: a non-finite gradient skips the mini-step
    (nothing inside the guard moves, its leaves get 0.0 added), two in a row make the guard
    apply anyway (max_consecutive_errors=1: the inf is accumulated, and the closing
    mini-step steps on the accumulated inf), and the guard checks the gradients, not the
    accumulated ones, on the closing mini-step."""
    tx = INSIDE[name][0](3)
    params = _params()
    state = tx.init(params)
    step = F.fast.make_step(tx, donate=donate)
    bad = {1, 4, 5}
    for t in range(8):
        grads = _grads(30 + t, params)
        if t in bad:
            grads["w"][1, 1] = float("inf")
        ref_params, ref_state, fast_params, fast_state = _stepped(
            tx, step, grads, state, params, donate=donate)
        assert_bitwise_equal(fast_state[:3], ref_state[:3])  # the guard's counters
        ms, ref_ms = _multi_state(fast_state), _multi_state(ref_state)
        assert_bitwise_equal(ms._replace(inner_opt_state=()),
                             ref_ms._replace(inner_opt_state=()))
        if t in (1, 4):  # skipped: nothing of it moved
            assert_bitwise_equal(ref_ms, _multi_state(state))
            assert_bitwise_equal(fast_params["w"], ref_params["w"])
        for k in params:
            torch.testing.assert_close(fast_params[k], ref_params[k], rtol=1e-12, atol=1e-12,
                                       equal_nan=True)
        params, state = ref_params, ref_state
    # (the forced step accumulated the inf; the window it was in closed at step 7)
    assert int(state.total_notfinite) == 3 and int(_multi_state(state).gradient_step) == 2
    assert bool(torch.isnan(params["w"][1, 1]))


def test_explain_says_what_the_mini_steps_run() -> None:
    params = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
    got = F.fast.explain(INSIDE["masked ms(adamw), masked sgd"][0](4), params)
    lines = str(got).splitlines()
    assert lines[0] == (
        "MultiSteps at [0].masked[True] on 1 leaves (w): each mini-step accumulates their "
        "gradients with a foreach running mean per (device, dtype) group and adds 0.0 to "
        "them; the mini-step's kernels: 1 call(s) (torch._fused_sgd_); the closing one "
        "steps the MultiSteps' inner transform on the accumulated gradients"), lines
    assert lines[1].startswith("closing mini-step: fused path: 2 kernel call(s) per step")
    assert lines[-1].startswith("memory traffic: ")
    assert sorted(line.split(" on ")[0].strip() for line in lines[2:-1]) == [
        "torch._fused_adamw_ + weight decay", "torch._fused_sgd_"]
    summed = F.fast.explain(INSIDE["partition ms(adam), clip+sgd"][0](2), params).mini_steps
    assert summed is not None and "foreach running sum" in summed
    decayed = F.fast.explain(INSIDE["ms(adam), masked decay, lr"][0](2), params).mini_steps
    assert decayed is not None and ("2 of them then stepped on zero gradients by the rules "
                                    "after it; the mini-step's kernels: 2 call(s)") in decayed


def test_what_is_not_lowered_stays_pure_and_says_why() -> None:
    params = {"w": torch.zeros(3), "b": torch.zeros(2)}
    ms = _ms(F.adamw(1e-2), 2)
    cases = {
        # (the planner folds one guard per program)
        "apply_if_finite inside apply_if_finite": F.apply_if_finite(
            _ms(F.apply_if_finite(F.adamw(1e-2), max_consecutive_errors=1), 2),
            max_consecutive_errors=1),
        "MultiSteps after zero_nans has no fast form": F.chain(F.zero_nans(),
                                                              F.masked(ms, WEIGHTS),
                                                              F.masked(F.sgd(0.1), BIASES)),
        "MultiSteps after other rules of its leaves": F.chain(
            F.masked(F.scale(2.0), WEIGHTS), F.masked(ms, WEIGHTS), F.masked(F.sgd(0.1), BIASES)),
        "a second MultiSteps in one transform": F.partition({"a": ms, "b": ms},
                                                            {"w": "a", "b": "b"}),
        # a mini-step's zeros then reach a decay that no learning rate follows: no kernel
        "a mini-step of the MultiSteps: leaf 'w': the program add_decayed_weights does not "
        "end with a learning rate": F.chain(ms, F.masked(F.add_decayed_weights(0.1), WEIGHTS)),
    }
    for expected, tx in cases.items():
        reason = F.fast.explain(tx, params).reason or ""
        assert expected in reason, reason
        step, state, grads = F.fast.make_step(tx), tx.init(params), {
            "w": torch.ones(3), "b": torch.ones(2)}
        # (over a window: the mini-step and the closing one, which may be the one refused)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                params, state = step(grads, state, params)
        assert any(w.category is F.fast.FastPathWarning and expected.split(" (")[0] in str(
            w.message) for w in caught), [str(w.message) for w in caught]


def test_a_state_of_another_layout_gets_the_transforms_own_error() -> None:
    params = _params()
    tx = INSIDE["masked ms(adamw), masked sgd"][0](2)
    state = tx.init(params)
    broken = (state[0]._replace(inner_state=("not", "a MultiStepsState")), state[1])
    with pytest.raises(TypeError, match="MultiSteps"):
        F.fast.make_step(tx)(_grads(0, params), broken, params)


@pytest.mark.parametrize(("name", "key"), [("inject(ms(adamw))", "learning_rate"),
                                         ("inject(inject(ms(sgd)))", "peak")])
def test_an_injected_value_changed_between_steps_is_read_as_the_pure_path_reads_it(
        name: str, key: str) -> None:
    """The Optimizer's case: a scheduler writes the injected learning rate; the closing
    mini-step's kernel and the window's MultiSteps are those built from the new value (in
    a nested injection, the outer's value that the inner's schedule reads)."""
    tx = INSIDE[name][0](2)
    params = _params()
    state = tx.init(params)
    step = F.fast.make_step(tx, donate=True)
    for t in range(6):
        state.hyperparams[key].fill_(1e-2 / (t + 1))
        ref_params, ref_state, fast_params, fast_state = _stepped(
            tx, step, _grads(t, params), state, params, donate=True)
        _close(fast_params, ref_params)
        _close(fast_state, ref_state)
        params, state = ref_params, ref_state


def test_optimizer_over_an_injected_multisteps_takes_the_fast_path() -> None:
    torch.manual_seed(0)
    models = [torch.nn.Linear(3, 2).double() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    tx = INSIDE["inject(ms(adamw))"][0](2)
    fast, pure = (F.Optimizer(m.parameters(), tx, fused=fused)
                  for m, fused in zip(models, (True, False), strict=True))
    assert fast.param_groups[0]["lr"] == 1e-2
    x = torch.randn(4, 3, dtype=torch.float64)
    for t in range(5):
        for opt, model in ((fast, models[0]), (pure, models[1])):
            opt.param_groups[0]["lr"] = 1e-2 / (t + 1)
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _by_rank(params: Any, wide: bool) -> Any:
    return _core.unflatten(_core.structure(params), [
        p.dim() >= 1 if wide else p.dim() < 1 for p in _core.flatten(params)[0]])


@settings(max_examples=6, deadline=None)
@given(case=conformance.cases(dtypes=(torch.float32, torch.float64), max_leaves=3),
       k=st.sampled_from([1, 2]), shape=st.sampled_from(["masked", "injected", "decayed"]))
def test_fast_path_law_over_pytrees(case: tuple[Any, Any, Any], k: int, shape: str) -> None:
    params, grads, _ = case
    # (mask functions: the leaves each part sees depend on the tree)
    wide, narrow = functools.partial(_by_rank, wide=True), functools.partial(_by_rank, wide=False)

    def factory() -> functopt.GradientTransformation:
        if shape == "masked":
            return F.chain(F.masked(_ms(F.adamw(1e-2), k), wide), F.masked(F.sgd(0.1), narrow))
        if shape == "decayed":
            return F.chain(_ms(F.scale_by_adam(), k), F.masked(F.add_decayed_weights(0.1), wide),
                           F.scale_by_learning_rate(1e-2))
        return F.inject_hyperparams(lambda learning_rate: _ms(F.adam(learning_rate), k))(
            learning_rate=1e-2)

    conformance.check_fast_path(factory, params, grads, steps=k + 1)
