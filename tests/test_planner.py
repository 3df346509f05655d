"""The step planner (functopt/fast/_planner.py): layouts, aliases, composed chains at random.

The pure path (``tx.update`` then ``apply_updates``) is the law: every planned step must
equal it, to a relative 1e-12 in float64 (the kernels order the arithmetic differently),
for every layout a training loop hands over (channels_last, transposed, gradients laid out
unlike their params, 0-d and empty leaves), and a donated step must refuse memory it
cannot write once per element (expanded params, tied weights).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functopt
from functopt.fast import FastPathWarning, explain, make_step
from functopt.testing import assert_bitwise_equal, conformance
from functopt.tree import _core

REL = 1e-12


def _pure(tx: Any, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
    updates, state = tx.update(grads, state, params)
    return functopt.apply_updates(params, updates), state


def _clone(tree: Any) -> Any:
    leaves, spec = _core.flatten(tree)
    return _core.unflatten(spec, [x.clone() if isinstance(x, torch.Tensor) else x
                                  for x in leaves])


def _assert_close(actual: Any, expected: Any, what: str) -> None:
    a_leaves, a_spec = _core.flatten(actual)
    e_leaves, e_spec = _core.flatten(expected)
    assert a_spec == e_spec, what
    for path, a, e in zip(_core.paths(e_spec), a_leaves, e_leaves, strict=True):
        if not isinstance(e, torch.Tensor):
            assert a == e, (what, path)
            continue
        assert a.dtype == e.dtype and a.shape == e.shape, (what, path)
        if e.numel() == 0 or not e.is_floating_point():
            assert torch.equal(a, e), (what, path)
            continue
        scale = e.double().abs().max().item()
        diff = (a.double() - e.double()).abs().max().item()
        assert diff <= REL * max(scale, 1e-300), (what, path, diff, scale)


def _layouts() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    return {
        "conv": r(4, 3, 3, 5).to(memory_format=torch.channels_last),
        "t": r(6, 4).t(),  # transposed: dense, not contiguous
        "w": r(5, 7),
        "b": r(7),
        "s": r(),
        "e": r(0, 3),
    }


COMPOSED = {
    "clip_adamw": lambda: functopt.chain(functopt.clip_by_global_norm(0.3),
                                         functopt.adamw(1e-2, weight_decay=0.1)),
    "masked_adamw": lambda: functopt.adamw(1e-2, weight_decay=0.1,
                                           mask=lambda p: {k: v.dim() > 1 for k, v in p.items()}),
    "sgd_momentum": lambda: functopt.sgd(0.1, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("grad_layout", ["like_params", "contiguous"])
@pytest.mark.parametrize("donate", [False, True], ids=["copy", "donate"])
@pytest.mark.parametrize("chain", list(COMPOSED))
def test_layouts_equal_the_pure_path(chain: str, donate: bool, grad_layout: str) -> None:
    """channels_last, transposed, 0-d and empty params, with gradients laid out like the
    params or contiguous (as a hand-made gradient is): the kernels read memory linearly, so
    the planner must hand them one layout per leaf."""
    tx = COMPOSED[chain]()
    params = _layouts()
    state = tx.init(params)
    assert explain(tx, params, state).fast
    ref_params, ref_state = _clone(params), _clone(state)
    step = make_step(tx, donate=donate)
    gen = torch.Generator().manual_seed(1)
    for i in range(4):
        grads = {k: torch.randn(v.shape, dtype=v.dtype, generator=gen) * 3
                 for k, v in params.items()}
        if grad_layout == "like_params":
            grads = {k: torch.empty_like(params[k]).copy_(g) for k, g in grads.items()}
        ref_params, ref_state = _pure(tx, grads, ref_state, ref_params)
        with torch.no_grad():
            params, state = step(_clone(grads), state, params)
        _assert_close(params, ref_params, f"step {i} params")
        _assert_close(state, ref_state, f"step {i} state")
    assert params["conv"].is_contiguous(memory_format=torch.channels_last)


def test_donated_tied_weights_raise_and_undonated_ones_step_like_pure() -> None:
    shared = torch.randn(3, 4, dtype=torch.float64)
    params = {"embed": shared, "head": shared}
    tx = functopt.adamw(1e-2)
    state = tx.init(params)
    grads = {"embed": torch.ones(3, 4, dtype=torch.float64),
             "head": torch.full((3, 4), 2.0, dtype=torch.float64)}
    with torch.no_grad(), pytest.raises(ValueError, match=r"'embed' and 'head': the params "
                                                          r"share memory \(tied weights"):
        make_step(tx, donate=True)(grads, state, params)
    assert torch.equal(params["embed"], shared)  # nothing was written before the error
    got = make_step(tx)(grads, state, params)
    _assert_close(got, _pure(tx, grads, state, params), "undonated tied weights")
    # disjoint views of one buffer own their memory: donation is fine
    flat = torch.randn(12, dtype=torch.float64)
    views = {"a": flat[:5], "b": flat[5:]}
    ref = _pure(tx, {"a": torch.ones(5, dtype=torch.float64),
                     "b": torch.ones(7, dtype=torch.float64)}, tx.init(views), _clone(views))
    with torch.no_grad():
        new, _ = make_step(tx, donate=True)({"a": torch.ones(5, dtype=torch.float64),
                                             "b": torch.ones(7, dtype=torch.float64)},
                                            tx.init(views), views)
    assert new["a"].data_ptr() == flat.data_ptr()
    _assert_close(new, ref[0], "disjoint views")


@pytest.mark.parametrize("tx", [functopt.adamw(1e-2), functopt.lion(1e-3)],
                         ids=["planned", "pure"])
def test_donated_expanded_params_raise_instead_of_corrupting_memory(tx: Any) -> None:
    params = {"w": torch.ones(3).expand(4, 3)}
    state = tx.init({"w": torch.ones(4, 3)})
    with torch.no_grad(), pytest.raises(ValueError, match=r"'w': the param has strides "
                                                          r"\(0, 1\).*expanded"):
        make_step(tx, donate=True)({"w": torch.ones(4, 3)}, state, params)


def test_two_threads_step_independent_states() -> None:
    """A step function holds no mutable state: two threads share one on their own states."""
    tx = functopt.chain(functopt.clip_by_global_norm(1.0), functopt.adamw(1e-2))
    step = make_step(tx, donate=True)
    results: dict[int, Any] = {}

    def train(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        params = {"w": torch.randn(64, 33, generator=gen, dtype=torch.float64)}
        state = tx.init(params)
        ref_p, ref_s = _clone(params), _clone(state)
        for _ in range(20):
            g = {"w": torch.randn(64, 33, generator=gen, dtype=torch.float64)}
            ref_p, ref_s = _pure(tx, g, ref_s, ref_p)
            with torch.no_grad():
                params, state = step(g, state, params)
        results[seed] = (params, ref_p)

    threads = [threading.Thread(target=train, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in results.values():
        _assert_close(got, want, "thread")


# --------------------------------------------------------- composed chains at random

def _rule(kind: str, lr: float) -> functopt.GradientTransformation:
    return {
        "adamw": lambda: functopt.adamw(lr, weight_decay=0.05),
        "adam": lambda: functopt.adam(lr),
        "sgd": lambda: functopt.sgd(lr, momentum=0.8),
        "sgd_plain": lambda: functopt.sgd(lr),
        "adam_chain": lambda: functopt.chain(
            functopt.scale_by_adam(b1=0.8), functopt.add_decayed_weights(0.01),
            functopt.scale_by_learning_rate(functopt.schedules.exponential_decay(lr, 3, 0.5))),
    }[kind]()


@st.composite
def _composed(draw: Any) -> tuple[Any, dict[str, bool]]:
    """A chain as users compose them: a rule, maybe clipped (all leaves or a mask), maybe
    masked decay, maybe partitioned with another rule, maybe injected."""
    names = ("w", "b", "s", "m")
    mask = {k: draw(st.booleans()) for k in names}
    lr = draw(st.sampled_from([1e-3, 3e-2]))
    kind = draw(st.sampled_from(["adamw", "adam", "sgd", "sgd_plain", "adam_chain"]))
    how = draw(st.sampled_from(["plain", "partition", "injected", "masked_decay"]))
    if how == "partition":
        other = draw(st.sampled_from(["adamw", "sgd", "frozen"]))
        rule = functopt.partition(
            {"x": _rule(kind, lr),
             "y": functopt.set_to_zero() if other == "frozen" else _rule(other, lr)},
            {k: "x" if mask[k] else "y" for k in names})
    elif how == "injected":
        rule = functopt.inject_hyperparams(functopt.adamw, static_args="mask")(
            learning_rate=lr, weight_decay=0.1, mask=mask)
    elif how == "masked_decay":
        rule = functopt.chain(functopt.masked(functopt.add_decayed_weights(0.1), mask),
                              _rule("sgd", lr))
    else:
        rule = _rule(kind, lr)
    clip = draw(st.sampled_from(["none", "all", "masked"]))
    # a guard around all of it folds into the kernels' skip, and so does one right after a
    # clip of every leaf (it checks the clipped gradients: the same verdict)
    guard = draw(st.sampled_from(["none", "around"] + (["after_clip"] if clip == "all"
                                                       else [])))
    if guard == "after_clip":
        rule = functopt.apply_if_finite(rule, draw(st.integers(0, 2)))
    if clip == "all":
        rule = functopt.chain(functopt.clip_by_global_norm(0.5), rule)
    elif clip == "masked":
        rule = functopt.chain(functopt.masked(functopt.clip_by_global_norm(0.2), mask), rule)
    if guard == "around":
        rule = functopt.apply_if_finite(rule, draw(st.integers(0, 2)))
    return rule, mask


@given(data=st.data(), composed=_composed(), donate=st.booleans())
def test_property_composed_chains_equal_the_pure_path(data: Any, composed: Any,
                                                      donate: bool) -> None:
    tx, _ = composed
    shapes = {"w": (6, 5), "b": (5,), "s": (), "m": (0,)}
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in shapes.items()}
    state = tx.init(params)
    assert explain(tx, params, state).fast, explain(tx, params, state).reason
    ref_params, ref_state = _clone(params), _clone(state)
    step = make_step(tx, donate=donate)
    for i in range(3):
        grads: dict[str, Any] = {k: torch.randn(s, generator=gen, dtype=torch.float64) * 4
                                 for k, s in shapes.items()}
        if data.draw(st.booleans()):
            grads["b"] = None  # a param without gradient this step
        ref_params, ref_state = _pure(tx, grads, ref_state, ref_params)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", FastPathWarning)  # must stay on the kernels
            params, state = step(_clone(grads), state, params)
        _assert_close(params, ref_params, f"step {i} params")
        _assert_close(state, ref_state, f"step {i} state")


def _nan_mask_and_close(actual: Any, expected: Any, what: str) -> None:
    """Non-finite exactly where the pure path is (an applied inf may be nan on the kernel
    and inf on the pure path: both are lost), finite values to REL."""
    a_leaves, spec = _core.flatten(actual)
    e_leaves = _core.flatten_like(spec, expected, name="expected", reference="actual")
    for path, a, e in zip(_core.paths(spec), a_leaves, e_leaves, strict=True):
        if not isinstance(e, torch.Tensor):
            continue
        assert a.dtype == e.dtype and a.shape == e.shape, (what, path)
        if not e.is_floating_point():
            assert torch.equal(a, e), (what, path, a, e)
            continue
        finite = torch.isfinite(e)
        assert torch.equal(torch.isfinite(a), finite), (what, path, a, e)
        if finite.any():
            diff = (a.double() - e.double())[finite].abs().max().item()
            scale = e.double()[finite].abs().max().item()
            assert diff <= REL * max(scale, 1e-300), (what, path, diff)


GUARDED = {
    "adamw": lambda: functopt.apply_if_finite(functopt.adamw(0.1, weight_decay=0.1), 2),
    "clip_adam_then_schedule": lambda: functopt.chain(
        functopt.apply_if_finite(functopt.chain(functopt.clip_by_global_norm(0.5),
                                                functopt.scale_by_adam()), 1),
        # outside the guard: its count moves on skipped steps too
        functopt.scale_by_learning_rate(functopt.schedules.cosine_decay_schedule(0.1, 10))),
    "injected_sgd": lambda: functopt.apply_if_finite(functopt.inject_hyperparams(
        functopt.sgd)(learning_rate=functopt.schedules.cosine_decay_schedule(0.1, 10),
                      momentum=0.9), 0),
    # a guard after a clip of every leaf: it checks the clipped gradients, finite exactly
    # when the gradients are, so it folds into the kernels' skip as a leading guard does
    "clip_then_guarded_adamw": lambda: functopt.chain(
        functopt.clip_by_global_norm(0.5),
        functopt.apply_if_finite(functopt.adamw(0.1, weight_decay=0.1), 2)),
    "clip_then_guarded_lamb": lambda: functopt.chain(
        functopt.clip_by_global_norm(0.5), functopt.apply_if_finite(functopt.lamb(0.1), 2)),
}


def _guard_state(state: Any) -> Any:
    """The ApplyIfFiniteState in ``state`` (at the root or an entry of a chain's tuple)."""
    if hasattr(state, "total_notfinite"):
        return state
    return next(s for s in state if hasattr(s, "total_notfinite"))


@pytest.mark.parametrize("donate", [False, True], ids=["copy", "donate"])
@pytest.mark.parametrize("chain", list(GUARDED))
def test_apply_if_finite_folds_into_the_kernels_skip(chain: str, donate: bool) -> None:
    """apply_if_finite around a lowerable rule: its finiteness check is one foreach pass
    (packed with the clips' norms), its skip the kernels' found_inf; its counters, the
    counters inside it (held on a skip) and outside it (moving on) as on the pure path,
    including the step that gives up after max_consecutive_errors."""
    def spoil(i: int, grads: dict[str, torch.Tensor]) -> None:
        if i in (2, 3, 4, 6):  # three bad steps in a row: a guard of 2 gives up on the third
            grads["b"][0] = float("nan") if i % 2 else float("inf")

    *_, (_, state) = _beside_pure(GUARDED[chain](), 3, 8, spoil, _nan_mask_and_close, donate)
    assert int(_guard_state(state).total_notfinite) == 4


def _beside_pure(tx: Any, seed: int, steps: int, spoil: Any, compare: Any, donate: bool,
                 ) -> Any:
    """``steps`` fast steps of ``tx`` (no FastPathWarning: it must stay fast) on float64
    params ``w`` (5, 3) and ``b`` (3,), each beside the pure step, on gradients drawn from
    ``seed`` and changed by ``spoil(i, grads)``; ``compare(actual, expected, what)`` holds
    params and state to the pure path's after each; yields ``(i, fast state)``."""
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(5, 3, generator=gen, dtype=torch.float64),
              "b": torch.randn(3, generator=gen, dtype=torch.float64)}
    state = tx.init(params)
    assert explain(tx, params, state).fast, explain(tx, params, state).reason
    ref_params, ref_state = _clone(params), _clone(state)
    step = make_step(tx, donate=donate)
    for i in range(steps):
        grads = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in
                 params.items()}
        spoil(i, grads)
        ref_params, ref_state = _pure(tx, grads, ref_state, ref_params)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", FastPathWarning)
            params, state = step(_clone(grads), state, params)
        compare(params, ref_params, f"step {i} params")
        compare(state, ref_state, f"step {i} state")
        yield i, state


def test_a_guard_after_a_clip_of_more_leaves_than_it_checks_stays_pure() -> None:
    # the clip measures "b" too: a nan there makes the clip's factor nan, so the guard on
    # "w" alone would see a non-finite "w" that a check of the gradients does not
    tx = functopt.chain(functopt.clip_by_global_norm(0.5), functopt.partition(
        {"g": functopt.apply_if_finite(functopt.adamw(0.1), 2), "s": functopt.sgd(0.1)},
        {"w": "g", "b": "s"}))
    params = {"w": torch.ones(5, 3, dtype=torch.float64), "b": torch.ones(3, dtype=torch.float64)}
    got = explain(tx, params)
    assert not got.fast and "after a clip_by_global_norm that also measures" in str(got.reason)
    grads = {"w": torch.ones(5, 3, dtype=torch.float64),
             "b": torch.tensor([float("nan"), 1.0, 1.0], dtype=torch.float64)}
    state = tx.init(params)
    with torch.no_grad(), pytest.warns(FastPathWarning, match="also measures leaves outside"):
        new, new_state = make_step(tx)(grads, state, params)
    ref, ref_state = _pure(tx, grads, tx.init(params), params)
    assert_bitwise_equal(new, ref)
    assert_bitwise_equal(new_state, ref_state)
    assert int(_guard_state(new_state[1].inner_states["g"]).notfinite_count) == 1


@pytest.mark.parametrize(("after", "kind"), [
    (lambda: functopt.masked(functopt.sgd(0.1, momentum=0.9), {"w": False, "b": True}),
     "trace"),
    (lambda: functopt.chain(functopt.add_decayed_weights(0.1),
                            functopt.scale_by_learning_rate(0.1)), "add_decayed_weights"),
], ids=["momentum_on_passed_leaves", "decay_after_the_guard"])
def test_a_rule_after_a_leading_guard_on_its_leaves_stays_pure(after: Any, kind: str) -> None:
    """On a skipped step the rules after an apply_if_finite run on its zero updates (a
    momentum moves on, a decay moves the params), which the kernels' skip of the whole
    program would not: such a step stays pure with that reason. (A learning rate after it
    keeps zeros at zero: "clip_adam_then_schedule" above folds.)"""
    tx = functopt.chain(functopt.apply_if_finite(
        functopt.masked(functopt.adamw(0.1), {"w": True, "b": False}), 2), after())
    params = {"w": torch.ones(5, 3, dtype=torch.float64), "b": torch.ones(3, dtype=torch.float64)}
    reason = str(explain(tx, params).reason)
    assert f"{kind} after apply_if_finite on the leaves it checks has no fast form" in reason
    state, step = tx.init(params), make_step(tx)
    for i in range(3):
        grads = {k: torch.full_like(v, 0.5) for k, v in params.items()}
        if i == 2:
            grads["w"][0, 0] = float("inf")
        with torch.no_grad(), pytest.warns(FastPathWarning, match="after apply_if_finite"):
            new, new_state = step(grads, state, params)
        ref, ref_state = _pure(tx, grads, state, params)
        assert_bitwise_equal(new, ref)
        assert_bitwise_equal(new_state, ref_state)
        params, state = ref, ref_state
    assert int(_guard_state(state[0]).total_notfinite) == 1


def test_injected_constants_are_read_on_the_host_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels take betas, eps, weight decay and a host lr as Python floats: an injected constant
    is read once and remembered while it is the same, unmodified tensor (each read is a
    synchronisation on an accelerator); an edit in place or a new tensor is read again."""
    tx = functopt.inject_hyperparams(functopt.adamw)(learning_rate=1e-2, weight_decay=0.1)
    params = {"w": torch.randn(4, 3, dtype=torch.float64)}
    state, ref_state, ref_params = tx.init(params), tx.init(params), _clone(params)
    step = make_step(tx)
    reads: list[float] = []
    real_item = torch.Tensor.item

    def item(self: torch.Tensor) -> Any:
        value = real_item(self)
        reads.append(value)
        return value

    monkeypatch.setattr(torch.Tensor, "item", item)
    per_step = []
    for i in range(5):
        if i == 3:  # an edit in place (as a scheduler does) and a replaced tensor
            for s in (state, ref_state):
                s.hyperparams["b1"].fill_(0.5)
                s.hyperparams["weight_decay"] = torch.tensor(0.3, dtype=torch.float64)
        grads = {"w": torch.randn(4, 3, dtype=torch.float64)}
        before = len(reads)
        with torch.no_grad():
            params, state = step(grads, state, params)
        per_step.append(len(reads) - before)
        ref_params, ref_state = _pure(tx, grads, ref_state, ref_params)
        _assert_close(params, ref_params, f"step {i}")
        _assert_close(state, ref_state, f"step {i} state")
    # b1, b2, eps, eps_root, weight_decay and (a host tensor) the learning rate at the
    # first step; nothing until the edit; then the two changed ones
    assert per_step == [6, 0, 0, 2, 0], per_step


def test_a_param_whose_data_is_replaced_is_checked_again() -> None:
    """module.to(dtype) replaces each parameter's .data in place (same object): the
    remembered lowering must not be reused for the new memory."""
    model = torch.nn.Linear(3, 2)
    params = dict(model.named_parameters())
    tx = functopt.adamw(1e-2)
    step = make_step(tx, donate=True)
    state = tx.init({k: p.detach() for k, p in params.items()})
    grads = {k: torch.ones_like(p) for k, p in params.items()}
    with torch.no_grad():
        params, state = step(grads, state, params)
    model.double()  # float64 params, float32 moments: no kernel takes both
    grads = {k: torch.ones_like(p) for k, p in params.items()}
    with torch.no_grad(), pytest.warns(FastPathWarning, match="one dtype per leaf"):
        new, _ = step(grads, state, params)
    assert new["weight"].dtype == torch.float64


@pytest.mark.parametrize("magnitude", [1e20, 1e30, 1e37])
def test_huge_finite_grads_are_clipped_like_the_pure_path(magnitude: float) -> None:
    """A float32 sum of squares overflows above a norm of about 1.8e19: the pure clip
    measures such leaves again in float64 (and scales in float64 beyond float32's range);
    the fused step does the same instead of clipping to nan (or dividing to zero)."""
    tx = functopt.chain(functopt.clip_by_global_norm(1.0), functopt.adamw(1e-2, weight_decay=0.1))
    gen = torch.Generator().manual_seed(5)
    params = {"w": torch.randn(50, 40, generator=gen), "b": torch.randn(40, generator=gen)}
    grads = {k: torch.randn(v.shape, generator=gen) * magnitude for k, v in params.items()}
    state = tx.init(params)
    want, _ = _pure(tx, grads, state, params)
    with torch.no_grad():
        got, _ = make_step(tx)(grads, state, params)
    for k in params:
        assert torch.isfinite(got[k]).all(), k
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)


def test_a_schedule_returning_a_vector_is_refused_on_the_fast_path_too() -> None:
    tx = functopt.adamw(lambda count: torch.ones(3) * 1e-3)
    params = {"w": torch.zeros(3)}
    state = tx.init(params)
    with torch.no_grad(), pytest.raises(TypeError, match="schedule"):
        make_step(tx)({"w": torch.ones(3)}, state, params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("dampening", "nesterov"), [(0.3, False), (0.0, True), (0.5, True)])
def test_dampened_trace_takes_fused_sgd_and_equals_torch_sgd(
        dtype: torch.dtype, dampening: float, nesterov: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(7, 3, generator=gen, dtype=dtype)
    grads = [torch.randn(7, 3, generator=gen, dtype=dtype) for _ in range(4)]
    tx = functopt.chain(functopt.add_decayed_weights(0.01),
                        functopt.dampened_trace(0.9, dampening=dampening, nesterov=nesterov),
                        functopt.scale_by_learning_rate(0.1))
    got = functopt.fast.explain(tx, w)
    assert got.fast and got.groups[0].kernel == "torch._fused_sgd_"
    q = w.clone().requires_grad_()
    # (torch.optim.SGD refuses nesterov with dampening; its kernel computes it)
    ref = torch.optim.SGD([q], lr=0.1, momentum=0.9, dampening=dampening, weight_decay=0.01,
                          nesterov=nesterov, foreach=False) if not (
                              nesterov and dampening) else None
    step, state, x = functopt.fast.make_step(tx, donate=True), tx.init(w), w.clone()
    for g in grads:
        with torch.no_grad():
            x, state = step(g, state, x)
        if ref is not None:
            q.grad = g.clone()
            ref.step()
            if nesterov or dtype != torch.float64:  # (the CPU kernel rounds its vectorised
                # body apart from the single-tensor path in float32, and g + m * buf)
                torch.testing.assert_close(x, q.detach(), rtol=1e-6, atol=1e-7)
            else:  # bitwise torch.optim.SGD's single-tensor path
                assert torch.equal(x, q.detach())
    conformance.check_fast_path(lambda: tx, w, grads[0], steps=3)
    # a skipped first step (apply_if_finite) keeps the next one first: the count says so
    guarded = functopt.apply_if_finite(tx, max_consecutive_errors=2)
    bad = torch.full_like(w, float("inf"))
    state = guarded.init(w)
    with torch.no_grad():
        x, state = functopt.fast.make_step(guarded)(bad, state, w)
    assert torch.equal(x, w)
    conformance.check_fast_path(lambda: guarded, w, grads[0], steps=2)


ZEROED = {
    "adamw": lambda: functopt.chain(functopt.zero_nans(), functopt.adamw(0.1, weight_decay=0.1)),
    "clip_adamw": lambda: functopt.chain(functopt.zero_nans(), functopt.clip_by_global_norm(0.5),
                                         functopt.adamw(0.1)),
    "guarded_sgd": lambda: functopt.chain(functopt.zero_nans(), functopt.apply_if_finite(
        functopt.sgd(0.1, momentum=0.9), 2)),
    "masked_lamb": lambda: functopt.chain(
        functopt.masked(functopt.zero_nans(), {"w": True, "b": False}), functopt.lamb(0.1)),
}


@pytest.mark.parametrize("donate", [False, True], ids=["copy", "donate"])
@pytest.mark.parametrize("chain", list(ZEROED))
def test_a_leading_zero_nans_keeps_the_fast_path(chain: str, donate: bool) -> None:
    """zero_nans before every rule: the nans become 0 before the clip measures and the
    guard checks (an inf still skips a guarded step), its found_nan flags are the pure
    path's, and the rest of the chain keeps its kernels (or the per-leaf tier)."""
    def spoil(i: int, grads: dict[str, torch.Tensor]) -> None:
        if i in (1, 3):
            grads["w"][1, 2] = float("nan")
        if i == 2 and chain == "guarded_sgd":
            grads["b"][0] = float("inf")

    for i, state in _beside_pure(ZEROED[chain](), 5, 5, spoil, _assert_close, donate):
        zeroing = state[0].inner_state if chain == "masked_lamb" else state[0]
        assert bool(zeroing.found_nan["w"]) == (i in (1, 3)), i


def test_zero_nans_after_a_rule_and_in_the_mixed_step_stay_pure() -> None:
    params = {"w": torch.ones(4, dtype=torch.float64)}
    late = functopt.chain(functopt.clip_by_global_norm(1.0), functopt.zero_nans(),
                          functopt.adamw(0.1))
    got = explain(late, params)
    assert not got.fast and "zero_nans has a fast form only before" in str(got.reason)
    # the mixed step skips any nan itself: zero_nans inside it runs pure, and says so
    from functopt.precision import mixed_precision

    low = {"w": torch.ones(4, dtype=torch.bfloat16)}
    grads = {"w": torch.full((4,), 0.5, dtype=torch.bfloat16)}
    fast_tx = mixed_precision(functopt.chain(functopt.zero_nans(), functopt.adamw(0.1)))
    pure_tx = mixed_precision(functopt.chain(functopt.zero_nans(), functopt.adamw(0.1)),
                              fused=False)
    with pytest.warns(FastPathWarning, match="zero_nans inside the mixed-precision step"):
        fast = fast_tx.step(grads, fast_tx.init(low), low)
    assert_bitwise_equal(fast, pure_tx.step(grads, pure_tx.init(low), low))


@pytest.mark.parametrize("fast", [False, True], ids=["pure", "fast"])
def test_a_tensor_learning_rate_written_in_place_counts_on_every_path(fast: bool) -> None:
    # torch.optim reads a tensor lr at every step: halving it in place between steps
    # halves the next step, on functopt's pure path as on its kernels
    lr = torch.tensor(0.1, dtype=torch.float64)
    torch_lr = lr.clone()
    tx = functopt.adamw(lr, weight_decay=0.1)
    gen = torch.Generator().manual_seed(9)
    start = torch.randn(7, generator=gen, dtype=torch.float64)
    params = {"w": start.clone()}
    state = tx.init(params)
    ref = torch.nn.Parameter(start.clone())
    opt = torch.optim.AdamW([ref], lr=torch_lr, weight_decay=0.1, foreach=False)
    step = make_step(tx)
    for _ in range(3):
        g = torch.randn(7, generator=gen, dtype=torch.float64)
        if fast:
            with warnings.catch_warnings():
                warnings.simplefilter("error", FastPathWarning)
                params, state = step({"w": g}, state, params)
        else:
            params, state = _pure(tx, {"w": g}, state, params)
        ref.grad = g.clone()
        opt.step()
        lr.mul_(0.5)
        torch_lr.mul_(0.5)
    torch.testing.assert_close(params["w"], ref.detach(), rtol=1e-12, atol=0)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("compile", [False, True])
def test_moments_strided_otherwise_on_size_1_dims_keep_the_fast_path(compile: bool) -> None:
    """A moment whose strides differ from its param's only where a dimension has one
    element (as the pure path's results can come back) is laid out as the param in memory:
    the kernels (and the compiled tier) take it, equal to the pure step; a moment strided
    otherwise on a longer dimension is still refused."""
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(2, 2, 1, 2, generator=gen, dtype=torch.float64)}
    grads = {"w": torch.randn(2, 2, 1, 2, generator=gen, dtype=torch.float64)}
    tx = functopt.adam(1e-2)
    state = tx.init(params)

    def restrided(x: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
        return torch.empty_strided(x.shape, strides, dtype=x.dtype).copy_(x)

    adam = state[0]
    odd = (adam._replace(mu={"w": restrided(adam.mu["w"], (4, 2, 4, 1))},
                         nu={"w": restrided(adam.nu["w"], (4, 2, 4, 1))}), *state[1:])
    assert functopt.fast.explain(tx, params, odd, grads, compile=compile).fast
    want = _pure(tx, grads, odd, params)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", functopt.fast.FastPathWarning)
        got = functopt.fast.make_step(tx, donate=True, compile=compile)(
            grads, _clone(odd), _clone(params))
    _assert_close(got, want, "size-1 strides")
    other = (adam._replace(mu={"w": restrided(adam.mu["w"], (1, 2, 4, 4))}), *state[1:])
    assert not functopt.fast.explain(tx, params, other, grads, compile=compile).fast


@pytest.mark.parametrize("before", [
    lambda: functopt.scale_by_adam(),
    lambda: functopt.trace(decay=0.9),
    lambda: functopt.chain(functopt.scale_by_adam(), functopt.scale_by_schedule(
        functopt.schedules.constant_schedule(1.0))),
], ids=["adam", "trace", "adam-then-schedule"])
def test_set_to_zero_after_rules_with_state_advances_their_state(before: Any) -> None:
    # the updates are zero, but the rules before still move their moments and counts
    make = lambda: functopt.chain(before(), functopt.set_to_zero())  # noqa: E731
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    grads = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FastPathWarning)
        conformance.check_fast_path(make, params, grads, steps=3)
    assert "set_to_zero after other rules" in str(explain(make(), params))


def test_a_lone_set_to_zero_keeps_its_plan_of_no_work() -> None:
    params = {"w": torch.randn(4, 3)}
    assert "the updates are zero" in str(explain(functopt.set_to_zero(), params))
