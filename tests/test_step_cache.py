"""A fused step remembers what it checked and lowered for the tensors it saw
(``functopt.fast.Step``), and the adapters step through it: what changes between two steps
must be seen on the second, never served from what the first checked.

Each case warms a donating step up on some inputs, changes one thing, and steps again; a
step function that has seen nothing (``make_step`` made anew) on the same changed inputs is
the reference: the same result, or the same error, or the same warning. The values of the
unchanged cases come from the pure path (``update`` then ``apply_updates``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import functopt
import functopt.testing
from functopt.fast import FastPathWarning

F64 = torch.float64


def _tx() -> functopt.GradientTransformation:
    return functopt.adamw(1e-2, weight_decay=0.1)


def _inputs(dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], ...]:
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=g, dtype=dtype),
              "b": torch.randn(3, generator=g, dtype=dtype),
              "s": torch.randn(3, 3, generator=g, dtype=dtype)}
    grads = {k: torch.randn(p.shape, generator=g, dtype=dtype) for k, p in params.items()}
    return params, grads


def _outcome(fn: Callable[[], Any]) -> tuple[str, Any, list[str]]:
    """("ok", values, warnings) or ("raised", (type, message), warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            new, state = fn()
        except (TypeError, ValueError, RuntimeError) as error:
            return "raised", (type(error), str(error)), [str(w.message) for w in caught]
    leaves = [x.clone() for x in functopt.tree.flatten((new, state))[0]
              if isinstance(x, torch.Tensor)]
    return "ok", leaves, [str(w.message) for w in caught]


def _same(a: tuple[str, Any, list[str]], b: tuple[str, Any, list[str]]) -> None:
    assert a[0] == b[0], (a, b)
    assert a[2] == b[2]
    if a[0] == "raised":
        assert a[1] == b[1]
    else:
        assert len(a[1]) == len(b[1])
        for x, y in zip(a[1], b[1], strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def _clone(tree: Any) -> Any:
    return functopt.testing.clone_tree(tree)


def _warmed(steps: int = 2) -> tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor],
                                     Any]:
    params, grads = _inputs()
    step = functopt.fast.make_step(_tx(), donate=True)
    state = _tx().init(params)
    with torch.no_grad():
        for _ in range(steps):
            params, state = step(grads, state, params)
    return step, params, grads, state


def _check_against_fresh(change: Callable[[Any, Any, Any], tuple[Any, Any, Any]]) -> None:
    step, params, grads, state = _warmed()
    params, grads, state = change(params, grads, state)
    # the reference first, on copies (the warmed step donates, and may write its inputs),
    # but on the inputs themselves where they share memory (copies would not; both steps
    # then refuse before writing anything)
    shared = change in (_param_tied_in_place, _param_expanded_in_place, _moments_tied_in_place)
    ref_params, ref_grads, ref_state = (params, grads, state) if shared else (
        _clone(params), _clone(grads), _clone(state))
    fresh = functopt.fast.make_step(_tx(), donate=True)
    with torch.no_grad():
        expected = _outcome(lambda: fresh(ref_grads, ref_state, ref_params))
        got = _outcome(lambda: step(grads, state, params))
    _same(got, expected)


def test_unchanged_inputs_step_as_the_pure_path() -> None:
    params, grads = _inputs(F64)
    ref_params, ref_state = _clone(params), _tx().init(params)
    step = functopt.fast.make_step(_tx(), donate=True)
    state = _tx().init(params)
    with torch.no_grad():
        for _ in range(4):
            params, state = step(grads, state, params)
            updates, ref_state = _tx().update(grads, ref_state, ref_params)
            ref_params = functopt.apply_updates(ref_params, updates)
    for k in params:
        torch.testing.assert_close(params[k], ref_params[k], rtol=1e-12, atol=0)


def test_the_second_step_skips_the_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    # (what the cache is for: the planner is asked once for unchanged inputs)
    step, params, grads, state = _warmed(1)
    calls = []
    real = step.planner.structure
    monkeypatch.setattr(step.planner, "structure",
                        lambda *a: calls.append(1) or real(*a))  # type: ignore[func-returns-value]
    with torch.no_grad():
        params, state = step(grads, state, params)
        assert calls == []
        params["w"] = params["w"].clone()  # another tensor: looked up again
        step(grads, state, params)
    assert calls == [1]


def _grad_shape(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    return params, {**grads, "w": torch.zeros(3, 4)}, state


def _grad_dtype(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    return params, {**grads, "b": grads["b"].to(F64)}, state


def _grad_int(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    return params, {**grads, "b": torch.zeros(3, dtype=torch.int64)}, state


def _grad_sparse(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    return params, {**grads, "b": grads["b"].to_sparse()}, state


def _grad_strides(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    # the same values laid out column-major: the kernels read a copy in the param's layout
    return params, {**grads, "w": grads["w"].t().contiguous().t()}, state


def _grad_transposed(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    # a square gradient's transpose: the param's shape, other strides (read as laid out, it
    # would pair each element with another's param)
    return params, {**grads, "s": grads["s"].t()}, state


def _grad_none(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    return params, {**grads, "b": None}, state


def _grad_not_tensor(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    return params, {**grads, "b": [1.0, 2.0, 3.0]}, state


def _grad_structure(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    return params, {"w": grads["w"]}, state


def _param_swapped(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    return {**params, "w": params["w"] * 2}, grads, state


def _param_dtype_in_place(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    w = params["w"]
    w.data = w.data.to(F64)  # as module.double() does: the same object
    return params, {**grads, "w": grads["w"].to(F64)}, state


def _param_strides_in_place(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    w = params["w"]
    w.data = w.data.t().contiguous().t()  # channels-last-like: same shape, other strides
    return params, grads, state


def _param_transposed_in_place(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    s = params["s"]
    s.data = s.data.t()  # a square weight: the same memory, shape and dtype, other strides
    return params, grads, state


def _param_shape_in_place(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    w = params["w"]
    w.data = torch.zeros(2, 6)
    return params, {**grads, "w": torch.zeros(2, 6)}, state


def _param_view_same_memory(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    w = params["w"]
    w.data = w.data.view(3, 4)  # the same memory, seen with another shape
    return params, {**grads, "w": torch.zeros(3, 4)}, state


def _param_tied_in_place(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    b = params["b"]
    b.data = params["w"].data[0]  # now shares the weight's memory: a donated step refuses
    return params, grads, state


def _param_expanded_in_place(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    b = params["b"]
    b.data = torch.zeros(1).expand(3)
    return params, grads, state


def _moment_swapped(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    adam = state[0]
    return params, grads, (adam._replace(mu={**adam.mu, "w": adam.mu["w"] + 1.0}),
                           *state[1:])


def _moment_other_dtype(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    adam = state[0]
    return params, grads, (adam._replace(nu={**adam.nu, "b": adam.nu["b"].to(F64)}),
                           *state[1:])


def _moment_data_in_place(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    state[0].mu["w"].data = torch.zeros(4, 3, dtype=F64)
    return params, grads, state


def _moment_transposed_in_place(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    nu = state[0].nu["s"]
    nu.data = nu.data.t()  # the same memory, other strides: no kernel reads it so
    return params, grads, state


def _moment_narrowed_in_place(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    mu = state[0].mu["w"]
    mu.data = mu.data[:2]  # the same address and strides, another shape
    return params, grads, state


def _moments_tied_in_place(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    nu = state[0].nu["w"]
    nu.data = state[0].mu["w"].data  # one memory for two entries: a donated step refuses
    return params, grads, state


def _state_structure(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    return params, grads, state[0]


def _count_not_tensor(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    return params, grads, (state[0]._replace(count={"n": state[0].count}), *state[1:])


CHANGES = [_grad_shape, _grad_dtype, _grad_int, _grad_sparse, _grad_strides, _grad_transposed,
           _grad_none, _grad_not_tensor,
           _grad_structure, _param_swapped, _param_dtype_in_place, _param_strides_in_place,
           _param_transposed_in_place,
           _param_shape_in_place, _param_view_same_memory, _param_tied_in_place,
           _param_expanded_in_place, _moment_swapped, _moment_other_dtype,
           _moment_data_in_place, _moment_transposed_in_place, _moment_narrowed_in_place,
           _moments_tied_in_place, _state_structure, _count_not_tensor]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_a_change_is_seen_on_the_next_step(change: Callable[..., Any]) -> None:
    _check_against_fresh(change)


def test_refusals_still_name_the_leaf_after_warm_steps() -> None:
    # (spelled out for two of the cases above: the errors a user reads)
    step, params, grads, state = _warmed()
    with torch.no_grad(), pytest.raises(ValueError, match=r"'w'.*shape \(3, 4\)"):
        step({**grads, "w": torch.zeros(3, 4)}, state, params)
    params["b"].data = params["w"].data[0]
    with torch.no_grad(), pytest.raises(ValueError, match="share memory"):
        step(grads, state, params)


def test_two_param_trees_on_one_step_each_stay_correct() -> None:
    # (one step function, two trees in turn, as an Optimizer's groups share one)
    step = functopt.fast.make_step(_tx(), donate=True)
    trees = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        p = {"a": torch.randn(5, generator=g, dtype=F64)}
        trees.append((p, {"a": torch.randn(5, generator=g, dtype=F64)}, _tx().init(p),
                      _clone(p), _tx().init(p)))
    with torch.no_grad():
        for _ in range(3):
            for i, (p, gr, s, rp, rs) in enumerate(trees):
                p, s = step(gr, s, p)
                updates, rs = _tx().update(gr, rs, rp)
                rp = functopt.apply_updates(rp, updates)
                trees[i] = (p, gr, s, rp, rs)
    for p, _, _, rp, _ in trees:
        torch.testing.assert_close(p["a"], rp["a"], rtol=1e-12, atol=0)


def test_a_lost_fast_path_after_warm_steps_still_warns() -> None:
    # a moment of another dtype than its param: no kernel; the pure path, and the warning
    step, params, grads, state = _warmed()
    adam = state[0]
    state = (adam._replace(nu={**adam.nu, "b": adam.nu["b"].to(F64)}), *state[1:])
    with torch.no_grad(), pytest.warns(FastPathWarning, match="'b'"):
        step(grads, state, params)


def test_optimizer_sees_a_param_moved_to_float64_in_place() -> None:
    # module.double() after steps: torch.optim's AdamW keeps its float32 state and steps;
    # the state functopt.Optimizer gathers then differs from the params' dtype, which the
    # fused step must see (not serve the float32 lowering)
    model = torch.nn.Linear(3, 2)
    opt = functopt.Optimizer(model.parameters(), functopt.adamw(1e-2))
    x = torch.randn(4, 3)
    for _ in range(2):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    model.double()
    opt.state.clear()  # restart from init: the state follows the params, as torch's does
    opt.zero_grad()
    model(x.double()).sum().backward()
    before = model.weight.detach().clone()
    opt.step()
    assert model.weight.dtype == F64
    assert opt.state[model.weight]["inner_state.0.mu"].dtype == F64
    # Adam's first step from a fresh state: m_hat = g, v_hat = g^2, so the update is
    # lr * (g / (|g| + eps) + weight_decay * w), functopt.adamw's defaults eps 1e-8, 1e-4
    g = model.weight.grad
    expected = before - 1e-2 * (g / (g.abs() + 1e-8) + 1e-4 * before)
    torch.testing.assert_close(model.weight.detach(), expected, rtol=1e-6, atol=1e-9)


def test_optimizer_sees_a_param_swapped_in_its_group() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = functopt.Optimizer([p], functopt.sgd(0.5))
    p.grad = torch.ones(3)
    opt.step()
    q = torch.nn.Parameter(torch.full((3,), 4.0))
    q.grad = torch.full((3,), 2.0)
    opt.param_groups[0]["params"][0] = q
    opt.step()
    torch.testing.assert_close(q.detach(), torch.full((3,), 3.0))  # 4 - 0.5 * 2
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.5))  # not stepped again


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    lambda ps: functopt.Optimizer(ps, functopt.adamw(1e-2)),
    lambda ps: functopt.optim.AdamW(ps, lr=1e-2),
], ids=["torch", "functopt.Optimizer", "functopt.optim"])
def test_step_hooks_run_once_per_step(make: Callable[[Any], Any]) -> None:
    # torch wraps the step of every optimizer class it sees built; functopt.optim's classes
    # subclass functopt.Optimizer, whose step must not be wrapped a second time inside
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = make([p])
    seen: list[str] = []
    opt.register_step_pre_hook(lambda *_: seen.append("pre"))
    opt.register_step_post_hook(lambda *_: seen.append("post"))
    opt.step()
    opt.step()
    assert seen == ["pre", "post"] * 2


# -- the kernels' arguments a warm step keeps (functopt.fast._planned._Steady) ------------
# A step keeps the Python numbers it passed to the kernels while the tensors it read them
# from (the injected hyperparameters in the state, a tensor given to the factory) are the
# same, unmodified tensors. Every other way a value can move must reach the next step: the
# reference is the pure path (update, then apply_updates) on the same states.

def _injected() -> functopt.GradientTransformation:
    return functopt.inject_hyperparams(functopt.adamw)(learning_rate=1e-2, weight_decay=0.1)


def _pure_and_fast(tx: functopt.GradientTransformation, edits: list[Callable[[Any], Any]],
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Steps of ``tx`` (float64), each after its edit of the state: (pure, fast) params."""
    params, grads = _inputs(F64)
    ref_params, ref_state = _clone(params), tx.init(params)
    step = functopt.fast.make_step(tx, donate=True)
    state = tx.init(params)
    with torch.no_grad():
        for edit in edits:
            state, ref_state = edit(state), edit(ref_state)
            params, state = step(grads, state, params)
            updates, ref_state = tx.update(grads, ref_state, ref_params)
            ref_params = functopt.apply_updates(ref_params, updates)
    return ref_params, params


def _assert_same_params(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-12, atol=0)


def _keep(state: Any) -> Any:
    return state


def _new_lr(value: float) -> Callable[[Any], Any]:
    def edit(state: Any) -> Any:  # another tensor in the hyperparameter's place
        return state._replace(hyperparams={**state.hyperparams,
                                           "learning_rate": torch.tensor(value, dtype=F64)})
    return edit


def _lr_in_place(value: float) -> Callable[[Any], Any]:
    def edit(state: Any) -> Any:  # the same tensor, written in place
        state.hyperparams["learning_rate"].fill_(value)
        return state
    return edit


@pytest.mark.parametrize("edits", [
    [_keep, _keep, _new_lr(3e-2), _keep, _new_lr(1e-3)],
    [_keep, _keep, _lr_in_place(3e-2), _keep, _lr_in_place(1e-3)],
], ids=["replaced", "in place"])
def test_an_injected_hyperparameter_changed_after_warm_steps_reaches_the_kernel(
        edits: list[Callable[[Any], Any]]) -> None:
    ref, got = _pure_and_fast(_injected(), edits)
    _assert_same_params(ref, got)
    # the edits are no no-op: without them the params differ
    unedited, _ = _pure_and_fast(_injected(), [_keep] * len(edits))
    assert not torch.allclose(unedited["w"], ref["w"])


def test_a_tensor_given_to_the_factory_changed_in_place_reaches_the_kernel() -> None:
    # (the pure path reads the weight decay's tensor at every update)
    decay = torch.tensor(0.1, dtype=F64)
    tx = functopt.adamw(1e-2, weight_decay=decay)

    def scaled(value: float) -> Callable[[Any], Any]:
        def edit(state: Any) -> Any:
            decay.fill_(value)
            return state
        return edit

    ref, got = _pure_and_fast(tx, [_keep, _keep, scaled(0.5), _keep, scaled(0.0)])
    _assert_same_params(ref, got)
    unedited, _ = _pure_and_fast(functopt.adamw(1e-2, weight_decay=0.1), [_keep] * 5)
    assert not torch.allclose(unedited["w"], ref["w"])


@pytest.mark.parametrize("make", [
    lambda: functopt.adamw(functopt.schedules.linear_schedule(1e-2, 1e-3, 4),
                           weight_decay=0.1),
    lambda: functopt.inject_hyperparams(functopt.adamw)(
        learning_rate=functopt.schedules.linear_schedule(1e-2, 1e-3, 4), weight_decay=0.1),
    lambda: functopt.chain(functopt.dampened_trace(0.9, dampening=0.5),
                           functopt.scale_by_learning_rate(1e-2)),
], ids=["schedule", "injected schedule", "dampened trace"])
def test_values_of_the_count_move_at_every_warm_step(
        make: Callable[[], functopt.GradientTransformation]) -> None:
    # (a schedule of the count, and the dampened trace's first-step flag, differ per step:
    # never kept)
    ref, got = _pure_and_fast(make(), [_keep] * 5)
    _assert_same_params(ref, got)


def test_a_warm_step_resolves_its_kernel_arguments_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # (what the memo is for: unchanged hyperparameters are not read again)
    from functopt.fast import _planned
    tx = _injected()
    params, grads = _inputs()
    step = functopt.fast.make_step(tx, donate=True)
    state = tx.init(params)
    calls = []
    real = _planned._hyperparameters
    monkeypatch.setattr(_planned, "_hyperparameters",
                        lambda *a: calls.append(1) or real(*a))  # type: ignore[func-returns-value]
    with torch.no_grad():
        params, state = step(grads, state, params)
        params, state = step(grads, state, params)
        assert calls == [1]
        state = _new_lr(3e-2)(state)
        params, state = step(grads, state, params)
    assert calls == [1, 1]


# -- counters: advanced in place by a donated step of the kernels alone -------------------

def test_a_donated_kernel_step_advances_its_counters_in_place() -> None:
    # as torch.optim advances state["step"]; the values are the pure path's
    tx = _injected()
    params, grads = _inputs()
    step = functopt.fast.make_step(tx, donate=True)
    state = tx.init(params)
    counts = (state.count, state.inner_state[0].count)
    with torch.no_grad():
        for _ in range(3):
            params, state = step(grads, state, params)
    assert state.count is counts[0] and state.inner_state[0].count is counts[1]
    assert int(state.count) == int(state.inner_state[0].count) == 3


def test_a_donated_kernel_step_keeps_a_counter_at_the_int32_maximum() -> None:
    # safe_increment's saturation, on the counters a donated step advances in place; the
    # values are the pure path's (update then apply_updates)
    tx = _injected()
    params, grads = _inputs(F64)
    top = torch.iinfo(torch.int32).max

    def at_max(state: Any) -> Any:
        inner = state.inner_state
        return state._replace(count=torch.tensor(top, dtype=torch.int32), inner_state=(
            inner[0]._replace(count=torch.tensor(top, dtype=torch.int32)), *inner[1:]))

    step = functopt.fast.make_step(tx, donate=True)
    state = tx.init(params)
    with torch.no_grad():
        params, state = step(grads, state, params)  # warm: the next step is recalled
        state = at_max(state)
        ref_params, ref_state = _clone(params), _clone(state)
        params, state = step(grads, state, params)
    updates, ref_state = tx.update(grads, ref_state, ref_params)
    ref_params = functopt.apply_updates(ref_params, updates)
    assert int(state.count) == int(state.inner_state[0].count) == top
    assert int(ref_state.count) == int(ref_state.inner_state[0].count) == top
    for a, b in zip(functopt.tree.flatten(params)[0], functopt.tree.flatten(ref_params)[0],
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_counter_held_twice_is_advanced_once_per_place() -> None:
    # one tensor in both counters' places (each gets its new value, not a second + 1)
    tx = _injected()

    def shared(state: Any) -> Any:
        inner = state.inner_state
        return state._replace(inner_state=(inner[0]._replace(count=state.count), *inner[1:]))

    params, grads = _inputs(F64)
    ref_params, ref_state = _clone(params), shared(tx.init(params))
    step = functopt.fast.make_step(tx, donate=True)
    state = shared(tx.init(params))
    with torch.no_grad():
        for _ in range(3):
            params, state = step(grads, state, params)
            updates, ref_state = tx.update(grads, ref_state, ref_params)
            ref_params = functopt.apply_updates(ref_params, updates)
    _assert_same_params(ref_params, params)
    assert int(state.count) == int(state.inner_state[0].count) == 3


def test_a_step_that_is_not_donated_leaves_the_counters_given() -> None:
    tx = _injected()
    params, grads = _inputs()
    step = functopt.fast.make_step(tx)
    state = tx.init(params)
    with torch.no_grad():
        _, new = step(grads, state, params)
    assert int(state.count) == 0 and int(new.count) == 1
