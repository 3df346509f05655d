"""The engine's backends' law: a step on the kernel backend equals the pure step to the
fast-path tolerance, and the planner's fast path bitwise.

The executor offers each run of Maps of a program to its backends in order
(``functopt/fast/_backends.py``): the kernel backend (PyTorch's fused kernels, matched and
called as the planner matches and calls them), the foreach backend (torch.optim's foreach
implementations, ``functopt/fast/_foreach.py``; its own law: tests/laws/test_foreach.py),
then the eager reference.

- the registry law: every transform and recipe of the conformance registry (and contrib's)
  and the ``functopt.optim`` chains the foreach backend takes, that the compiler takes, over drawn pytrees (every layout, 0-d and empty leaves, ``None``
  gradients, inf and nan), donated or not: each step, from the pure step's params and
  state, equals the pure step within the tolerance the conformance suite allows the
  planner's kernels (``functopt/testing/_fast.py``), and bitwise where no kernel ran;
  it writes into no gradient, nor into the params and state when not donated;
- the kernel table: Adam, AdamW, Adam with L2 decay, AMSGrad (torch's), maximize, SGD
  (plain, momentum, Nesterov, decay, dampening) and a partition of them, over several
  steps: bitwise the planner's fast path (``make_step`` with the switch off), with the
  kernel seen to run;
- the refusal table: what the kernel and foreach backends do not take, with a reason
  (`explain`),
  one ``FastPathWarning`` per program and reason, and the step still the pure one;
- `explain` per segment of a program cut by a clip; the backend table's names checked.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt as F
from functopt import contrib
from functopt.fast import FastPathWarning, _backends, _engine, _foreach, make_step
from functopt.fast._program import compile_program
from functopt.optim import _chains
from functopt.testing import _fast, assert_bitwise_equal, clone_tree, conformance
from functopt.tree import _core

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_conformance import REGISTRY
from test_contrib import ENTRIES

F64 = torch.float64
# torch.optim's chains (functopt.optim) that its foreach implementations compute (the
# foreach backend: tests/laws/test_foreach.py)
FOREACH: list[tuple[str, Callable[[], Any]]] = [
    ("optim.rmsprop", lambda: _chains.rmsprop(1e-2, 0.9, 1e-8)),
    ("optim.rmsprop[decay,momentum,maximize]",
     lambda: _chains.rmsprop(1e-2, 0.75, 1e-6, 0.1, 0.5, maximize=True)),
    ("optim.rmsprop[eps 0]", lambda: _chains.rmsprop(1e-2, 0.9, 0.0)),
    ("optim.adamax[decay,maximize]",
     lambda: _chains.adamax(1e-2, 0.9, 0.999, 1e-8, 0.1, maximize=True)),
    ("optim.nadam[decay]", lambda: _chains.nadam(1e-2, 0.9, 0.999, 1e-8, 4e-3, 0.1)),
    ("optim.nadam[decoupled,maximize]", lambda: _chains.nadam(
        1e-2, 0.9, 0.999, 1e-8, 4e-3, 0.1, decoupled=True, maximize=True)),
    ("optim.radam[decay]", lambda: _chains.radam(1e-2, 0.9, 0.999, 1e-8, 0.1)),
    ("optim.adadelta[decay,maximize]",
     lambda: _chains.adadelta(1.0, 0.9, 1e-6, 0.1, maximize=True)),
    ("optim.rprop[maximize]", lambda: _chains.rprop(1e-2, maximize=True)),
    ("optim.adagrad[decay]", lambda: _chains.adagrad(1e-2, 0.01, 0.0, 1e-10, 0.1)),
]
_FACTORIES: list[tuple[str, Callable[[], Any]]] = (
    [(e.id, e.factory) for e in REGISTRY] + [(f"contrib.{e[0]}", e[2]) for e in ENTRIES]
    + FOREACH)


@contextlib.contextmanager
def engine(backends: tuple[str, ...] = ("kernel", "foreach", "perleaf", "eager"),
           ) -> Iterator[list[int]]:
    """The switch on with these backends, and a list that grows by one at each segment the
    kernel or the foreach backend runs (on a fused kernel or a foreach implementation)."""
    launched: list[int] = []
    launches = _backends._launch, _foreach._launch

    def counted(launch: Callable[..., None]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            launched.append(1)
            launch(*args)
        return run

    before = _engine.ENABLED, _engine.BACKENDS
    _engine.ENABLED, _engine.BACKENDS = True, backends
    _backends._launch, _foreach._launch = map(counted, launches)  # type: ignore[assignment]
    try:
        yield launched
    finally:
        _engine.ENABLED, _engine.BACKENDS = before
        _backends._launch, _foreach._launch = launches  # type: ignore[assignment]


def _negated(tree: Any) -> Any:
    leaves, spec = _core.flatten(tree)
    return _core.unflatten(spec, [None if g is None else -g for g in leaves])


# --- the registry law ---------------------------------------------------------------------

@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("entry", _FACTORIES, ids=[e[0] for e in _FACTORIES])
@settings(max_examples=4)
@given(data=st.data())
def test_registry_entry_on_the_kernels_equals_pure_path(
        entry: tuple[str, Callable[[], Any]], donate: bool, data: st.DataObject) -> None:
    name, factory = entry
    params, grads, _ = data.draw(conformance.cases(grad_kind="any", max_leaves=4,
                                                   tied=not donate))
    tx = factory()
    state = tx.init(params)
    param_leaves, treespec = _core.flatten(params)
    state_leaves, state_spec = _core.flatten(state)
    if compile_program(tx, params, treespec, param_leaves, state_leaves,
                       state_spec).reason is not None:
        return  # (the refused entries are tests/laws/test_program.py's REFUSED table)
    step = make_step(tx, donate=donate)
    for k, g in enumerate([grads, _negated(grads), grads]):
        try:
            updates, pure_state = tx.update(*clone_tree((g, state, params)))
        except (RuntimeError, ValueError) as error:
            # the pure step refuses these inputs (contrib.muon's spectral preconditioning:
            # no SVD of an inf): the engine's step, running the same rule, refuses alike
            with engine(), warnings.catch_warnings(), pytest.raises(type(error)):
                warnings.simplefilter("ignore", FastPathWarning)
                step(*clone_tree((g, state, params)))
            return
        pure_params = F.apply_updates(params, updates)
        inputs = clone_tree((g, state, params))
        given = clone_tree(inputs)
        with engine() as launched, warnings.catch_warnings():
            warnings.simplefilter("ignore", FastPathWarning)  # (the refusals: below)
            new_params, new_state = step(*given)
        what = f"{name}, step {k + 1}, donate={donate}"
        # nothing written into the inputs (the gradients even when donated)
        assert_bitwise_equal(given[0], inputs[0], what=f"{what}: the gradients")
        if not donate:
            assert_bitwise_equal(given[1:], inputs[1:], what=f"{what}: the state and params")
        for new, pure, before, part in ((new_params, pure_params, params, "params"),
                                        (new_state, pure_state, state, "state")):
            _fast._assert_fast_close(new, pure, before, check="kernel backend",
                                           what=f"{what}, {part}", exact=not launched)
        params, state = pure_params, pure_state


# --- the kernel table: bitwise the planner's fast path ------------------------------------

def _params() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, generator=gen).t(),  # (transposed)
            "h": torch.randn(2, 2, generator=gen, dtype=F64),
            "v": torch.randn(5, generator=gen),
            "s": torch.randn((), generator=gen)}


def _grads(k: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(k + 1)
    out: dict[str, Any] = {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) * 3
                           for n, p in _params().items()}
    if k == 1:
        out["v"] = None  # (a leaf without a gradient: its state stays, the counts move)
    return out


def _weights(p: Any) -> dict[str, bool]:
    return {"w": True, "h": True, "v": False, "s": False}


def _labels(p: Any) -> dict[str, str]:
    return {"w": "adam", "h": "sgd", "v": "sgd", "s": "frozen"}


KERNEL_CHAINS: dict[str, Callable[[], Any]] = {
    "adam": lambda: F.adam(1e-2),
    "adamw": lambda: F.adamw(1e-2, weight_decay=0.1),
    "adamw masked decay": lambda: F.adamw(1e-2, weight_decay=0.1, mask=_weights),
    "adam with l2 decay": lambda: F.chain(F.add_decayed_weights(0.1), F.scale_by_adam(),
                                          F.scale_by_learning_rate(1e-2)),
    "amsgrad (torch's)": lambda: F.chain(F.scale_by_amsgrad(correct_after_max=True),
                                         F.scale_by_learning_rate(1e-2)),
    "maximize": lambda: F.chain(F.scale(-1.0), F.adamw(1e-2)),
    "sgd": lambda: F.sgd(0.1),
    "sgd momentum": lambda: F.sgd(0.1, momentum=0.9),
    "sgd nesterov": lambda: F.sgd(0.1, momentum=0.9, nesterov=True),
    "sgd decay": lambda: F.chain(F.add_decayed_weights(1e-2), F.trace(0.9),
                                 F.scale_by_learning_rate(0.1)),
    "sgd dampened": lambda: F.chain(F.dampened_trace(0.9, dampening=0.25),
                                    F.scale_by_learning_rate(0.1)),
    "partition": lambda: F.partition(
        {"adam": F.adamw(1e-2), "sgd": F.sgd(0.1, momentum=0.5), "frozen": F.set_to_zero()},
        _labels),
    "a part on no leaves": lambda: F.partition(  # (its count moves all the same)
        {"adam": F.adam(1e-2), "sgd": F.sgd(0.1)}, lambda p: dict.fromkeys(p, "sgd")),
    # (the hyperparameters are state tensors, read on the host at each step)
    "injected adamw": lambda: F.inject_hyperparams(F.adamw)(
        learning_rate=1e-2, b1=0.8, weight_decay=0.1),
    "injected sgd with a scheduled lr": lambda: F.inject_hyperparams(F.sgd)(
        learning_rate=lambda count: 0.1 / (1 + count), momentum=0.9),
    "injected in a partition": lambda: F.partition(
        {"adam": F.inject_hyperparams(F.adam)(learning_rate=1e-2),
         "sgd": F.inject_hyperparams(F.sgd)(learning_rate=0.1, momentum=0.5),
         "frozen": F.set_to_zero()}, _labels),
}


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("chain", list(KERNEL_CHAINS), ids=list(KERNEL_CHAINS))
def test_kernel_chain_equals_the_planners_fast_path(chain: str, donate: bool) -> None:
    tx = KERNEL_CHAINS[chain]()
    planner_params, planner_state = _params(), tx.init(_params())
    engine_params, engine_state = clone_tree(planner_params), clone_tree(planner_state)
    planner_step, engine_step = make_step(tx, donate=donate), make_step(tx, donate=donate)
    for k in range(4):
        with warnings.catch_warnings():
            warnings.simplefilter("error", FastPathWarning)  # (both paths fast)
            planner_params, planner_state = planner_step(_grads(k), planner_state,
                                                         planner_params)
            with engine() as launched:
                engine_params, engine_state = engine_step(_grads(k), engine_state,
                                                          engine_params)
        # (one segment each, but three in a partition of injected transforms: the
        # inject_hyperparams' records of their values stand between their rules)
        expected = [1] * (3 if chain == "injected in a partition" else 1)
        assert launched == expected, f"step {k + 1}: the kernel backend did not run"
        assert_bitwise_equal(engine_params, planner_params, what=f"params after step {k + 1}")
        assert_bitwise_equal(engine_state, planner_state, what=f"state after step {k + 1}")


# --- the refusal table --------------------------------------------------------------------

def _trio() -> dict[str, Any]:
    return {"w": torch.ones(2, 3), "b": torch.ones(3)}


def _shared_moments(tx: Any, params: Any) -> Any:
    """An Adam state whose two moments of ``"w"`` are one tensor."""
    state = tx.init(params)
    adam = state[0]
    nu = dict(adam.nu, w=adam.mu["w"])
    return (adam._replace(nu=nu), *state[1:])


def _inf_moment(tx: Any, params: Any) -> Any:
    """An Adam state whose second moment of ``"w"`` holds an inf."""
    state = tx.init(params)
    nu = dict(state[0].nu, w=torch.full_like(params["w"], float("inf")))
    return (state[0]._replace(nu=nu), *state[1:])


def _injected_adamw(learning_rate: Any) -> Any:
    return F.inject_hyperparams(F.adamw)(learning_rate=learning_rate)


# name: (transform, params, state edit or None, donate, a part of the kernel's reason)
REFUSALS: dict[str, tuple[Callable[[], Any], Callable[[], Any], Any, bool, str]] = {
    "a rule without a kernel": (lambda: F.lion(1e-3), _trio, None, False,
                                "scale_by_lion has no fused kernel"),
    "nadam": (lambda: F.adam(1e-2, nesterov=True), _trio, None, False,
              "(NAdam) has no fused kernel"),
    "eps_root": (lambda: F.adam(1e-2, eps_root=1e-8), _trio, None, False,
                 "eps_root > 0"),
    "optax's amsgrad": (lambda: F.amsgrad(1e-2), _trio, None, False,
                        "optax's variant"),
    "a tensor lr": (lambda: F.adamw(torch.tensor(1e-2)), _trio, None, False,
                    "learning_rate is a tensor"),
    "a schedule": (lambda: F.sgd(lambda count: 0.1 / (1 + count)), _trio, None, False,
                   "a tensor at each step"),
    "nested injected": (lambda: F.inject_hyperparams(_injected_adamw)(learning_rate=0.1),
                        _trio, None, False, "an inject_hyperparams inside another"),
    "a clip after": (lambda: F.chain(F.adamw(1e-2), F.clip_by_global_norm(0.5)), _trio,
                     None, False, "its updates are read after it"),
    "inside apply_if_finite": (lambda: F.apply_if_finite(F.adam(1e-2), 1), _trio, None,
                               False, "inside apply_if_finite"),
    "float16 sgd on the cpu": (lambda: F.sgd(0.1, momentum=0.9),
                               lambda: {"w": torch.ones(3, dtype=torch.float16)}, None,
                               False, "pytorch/pytorch#191763"),
    "a param that is not dense": (lambda: F.adam(1e-2),
                                  lambda: {"w": torch.ones(4, 6)[:, ::2]}, None, False,
                                  "is not dense"),
    "trace(decay=0)": (lambda: F.sgd(0.1, momentum=0.0), _trio, None, False,
                       "trace(decay=0)"),
    "donated moments sharing memory": (lambda: F.adam(1e-2), _trio, _shared_moments, True,
                                       "share memory, which the kernels would write"),
    "a rule with tree sums": (lambda: contrib.prodigy(), _trio, None, False,
                              "has no fused kernel"),
    "an inf moment": (lambda: F.adamw(1e-2), _trio, _inf_moment, False,
                      "not finite or beyond the kernels' range"),
    "a param beyond the kernels' range": (  # (above a sixteenth of float32's largest)
        lambda: F.sgd(0.1, momentum=0.9), lambda: {"w": torch.full((3,), 1e38)}, None, False,
        "not finite or beyond the kernels' range"),
    "set_to_zero after a rule with state": (
        lambda: F.chain(F.scale_by_adam(), F.set_to_zero()), _trio, None, False,
        "set_to_zero after other rules (their state advances; the kernels write none)"),
    "donated rmsprop sharing memory": (
        lambda: _chains.rmsprop(1e-2, 0.9, 1e-8), _trio,
        lambda tx, p: (tx.init(p)[0]._replace(nu={"w": p["w"], "b": torch.zeros(3)}),
                       *tx.init(p)[1:]), True, "share memory"),
}


@pytest.mark.parametrize("case", list(REFUSALS), ids=list(REFUSALS))
def test_a_refused_segment_runs_eager_with_its_reason_warned_once(case: str) -> None:
    factory, make_params, edit, donate, reason = REFUSALS[case]
    tx, params = factory(), make_params()
    state = tx.init(params) if edit is None else edit(tx, params)
    grads = F.tree.full_like(params, 0.5)
    explained = _engine.explain(tx, params, grads, state, donate=donate)
    assert not isinstance(explained, str), explained
    reasons = ["; ".join(e.reasons.values()) for e in explained]
    assert any(reason in r for r in reasons), reasons
    assert all(e.backend == "eager" for e in explained)
    updates, pure_state = tx.update(grads, clone_tree(state), params)
    pure_params = F.apply_updates(params, updates)
    step = make_step(tx, donate=donate)
    with engine() as launched, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # (cloned together: a state entry sharing a param's memory still does)
        new_params, new_state = step(*clone_tree((grads, state, params)))
        step(*clone_tree((grads, state, params)))
    assert launched == []
    # (one warning per segment refused for this reason, over both steps)
    found = [str(w.message) for w in caught if reason in str(w.message)]
    assert found and len(found) == len(set(found)), [str(w.message) for w in caught]
    assert all(w.category is FastPathWarning for w in caught)
    assert_bitwise_equal(new_params, pure_params)
    assert_bitwise_equal(new_state, pure_state)


# --- explain and the table ----------------------------------------------------------------

def test_explain_names_the_backend_of_each_segment() -> None:
    # a clip between rules cuts the program in two segments: the first one's updates are
    # measured by the clip, the second (a decay and a learning rate: SGD's kernel with
    # weight decay) goes to the write
    tx = F.chain(F.scale_by_adam(), F.clip_by_global_norm(0.5), F.add_decayed_weights(1e-2),
                 F.scale(-0.1))
    params = _params()
    explained = _engine.explain(tx, params, _grads(0))
    assert not isinstance(explained, str)
    assert [e.backend for e in explained] == ["eager", "kernel"]
    assert "scale_by_adam at [0]" in explained[0].where
    assert "read after it" in explained[0].reasons["kernel"]
    assert explained[1].reasons == {}
    assert "add_decayed_weights at [2]" in explained[1].where
    # and the step on those backends: the pure one within the kernels' tolerance
    state = tx.init(params)
    updates, pure_state = tx.update(_grads(0), state, params)
    with engine() as launched, warnings.catch_warnings():
        warnings.simplefilter("ignore", FastPathWarning)
        new_params, new_state = make_step(tx)(_grads(0), state, params)
    assert launched == [1]
    _fast._assert_fast_close(new_params, F.apply_updates(params, updates), params,
                                   check="explain", what="params", exact=False)
    _fast._assert_fast_close(new_state, pure_state, state, check="explain",
                                   what="state", exact=False)


def test_explain_of_an_eager_only_engine_gives_no_reasons() -> None:
    before = _engine.BACKENDS
    _engine.BACKENDS = ("eager",)
    try:
        explained = _engine.explain(F.adamw(1e-2), _params(), _grads(0))
    finally:
        _engine.BACKENDS = before
    assert not isinstance(explained, str)
    assert [(e.backend, e.reasons) for e in explained] == [("eager", {})]


def test_explain_gives_the_programs_own_reason() -> None:
    opaque = F.GradientTransformation(lambda p: (), lambda u, s, p=None: (u, s))
    explained = _engine.explain(opaque, _params(), _grads(0))
    assert isinstance(explained, str) and "without a spec" in explained


@pytest.mark.parametrize("names", [(), ("kernel",), ("eager", "kernel"), ("fused", "eager")])
def test_the_backend_table_ends_with_eager(names: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="ending with 'eager'"):
        _backends.table(names)


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
def test_a_state_entry_edited_after_a_kernel_step_is_checked_again(donate: bool) -> None:
    # (the range check does not read again what the last kernel call wrote while it is
    # unmodified: an edit in place advances its version, and the check reads it)
    tx = F.adamw(1e-2)
    step, params, state, grads = _fast_steps(tx, _trio(), donate)
    state[0].nu["w"].fill_(float("inf"))
    _refused_step_is_pure(tx, step, params, state, grads, "beyond the kernels' range")


def _fast_steps(tx: Any, params: Any, donate: bool) -> tuple[Any, Any, Any, Any]:
    """Two steps of ``tx`` on the engine, each run by a fast backend: the step function,
    the params, the state and the gradients."""
    state, grads = tx.init(params), F.tree.full_like(params, 0.5)
    step = make_step(tx, donate=donate)
    for k in range(2):
        with engine() as launched, warnings.catch_warnings():
            warnings.simplefilter("error", FastPathWarning)
            params, state = step(grads, state, params)
        assert launched == [1], f"step {k + 1}: no fast backend ran"
    return step, params, state, grads


def _refused_step_is_pure(tx: Any, step: Any, params: Any, state: Any, grads: Any,
                          match: str | None = None) -> None:
    """The next step warns that a fast backend refuses it and equals the pure step."""
    updates, pure_state = tx.update(grads, clone_tree(state), clone_tree(params))
    pure_params = F.apply_updates(clone_tree(params), updates)
    with engine() as launched, pytest.warns(FastPathWarning, match=match):
        params, state = step(grads, state, params)
    assert launched == []
    assert_bitwise_equal(params, pure_params, what="params after the edited step")
    assert_bitwise_equal(state, pure_state, what="state after the edited step")


def test_the_kernels_read_an_injection_without_building_its_transform() -> None:
    # (the kernels take the injected values only: the inner transform is built when the
    # program is compiled and matched, not again at each step)
    built: list[int] = []

    def adamw(learning_rate: Any, weight_decay: Any) -> Any:
        built.append(1)
        return F.adamw(learning_rate, weight_decay=weight_decay)

    tx = F.inject_hyperparams(adamw)(learning_rate=1e-2, weight_decay=0.1)
    params = _trio()
    state, step = tx.init(params), make_step(tx)
    with engine() as launched, warnings.catch_warnings():
        warnings.simplefilter("error", FastPathWarning)
        params, state = step(F.tree.full_like(params, 0.5), state, params)
        first = len(built)
        for _ in range(3):
            params, state = step(F.tree.full_like(params, 0.25), state, params)
    assert launched == [1] * 4
    assert len(built) == first, f"{len(built) - first} builds in 3 steps on the kernels"


def _alias_a_moment(params: Any, state: Any) -> None:
    """A per-leaf state entry of ``"w"`` made a view of the param's memory."""
    entry = next(x for x in _core.flatten(state)[0]
                 if isinstance(x, torch.Tensor) and x.shape == params["w"].shape)
    entry.data = params["w"].data


def _transpose_a_param(params: Any, state: Any) -> None:
    """The param ``"w"``'s ``.data`` made column-major (its moments stay row-major): the
    fused kernels, which walk the params' and moments' memory in step, refuse it."""
    params["w"].data = params["w"].data.t().contiguous().t()


_ADAMW, _RMSPROP = (lambda: F.adamw(1e-2)), (lambda: _chains.rmsprop(1e-2, 0.9, 1e-8))


@pytest.mark.parametrize(("make", "donate", "edit"), [
    (_ADAMW, True, _alias_a_moment), (_RMSPROP, True, _alias_a_moment),
    (_ADAMW, True, _transpose_a_param), (_ADAMW, False, _transpose_a_param)],
    ids=["kernel donated, a moment aliasing its param",
         "foreach donated, a moment aliasing its param",
         "kernel donated, a param transposed", "kernel kept, a param transposed"])
def test_a_layout_edited_after_a_step_is_checked_again(make: Callable[[], Any], donate: bool,
                                                       edit: Callable[[Any, Any], None],
                                                       ) -> None:
    # (a backend whose layout and memory checks passed takes the same layout again
    # unchecked: a .data assignment moves what the checks read, and they run again)
    tx = make()
    step, params, state, grads = _fast_steps(
        tx, {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}, donate)
    edit(params, state)
    _refused_step_is_pure(tx, step, params, state, grads)


# --- the per-leaf backend: rules that reduce within a leaf, on their own updates ----------

_MATRICES = {"w": torch.arange(24.0).reshape(4, 6) / 24, "v": torch.ones(6, 4)}


@pytest.mark.parametrize("make", [lambda: _chains.muon(1e-2, 0.95, 0.1),
                                  lambda: F.adafactor(1e-2)], ids=["optim.muon", "adafactor"])
@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
def test_a_rule_reducing_within_a_leaf_takes_the_perleaf_backend(make: Callable[[], Any],
                                                                 donate: bool) -> None:
    tx = make()
    params = clone_tree(_MATRICES)
    state = tx.init(params)
    explained = _engine.explain(tx, params, F.tree.full_like(params, 0.5), state)
    assert not isinstance(explained, str)
    assert [e.backend for e in explained] == ["perleaf"], explained
    step = make_step(tx, donate=donate)
    pure_params, pure_state = clone_tree(params), clone_tree(state)
    for k in range(3):
        grads = F.tree.map(lambda p, k=k: torch.cos(p * (k + 1)), params)
        updates, pure_state = tx.update(grads, pure_state, pure_params)
        pure_params = F.apply_updates(pure_params, updates)
        with engine() as launched, warnings.catch_warnings():
            warnings.simplefilter("error", FastPathWarning)
            params, state = step(grads, state, params)
        assert launched == []  # (the rules' own updates: no kernel, no foreach call)
    assert_bitwise_equal(params, pure_params, what="params on the per-leaf backend")
    assert_bitwise_equal(state, pure_state, what="state on the per-leaf backend")


def test_the_perleaf_backend_hosts_the_parts_beside_and_refuses_a_leaf_without_such_a_rule(
        ) -> None:
    # (contrib.muon sends a vector to Adam with nesterov=True, which no faster backend
    # computes: that part is claimed beside Muon's; a learning rate over every leaf joins
    # a vector with Muon's matrices, and that vector's rules have faster forms)
    params = {"w": torch.ones(4, 6), "b": torch.ones(6)}
    grads = F.tree.full_like(params, 0.5)
    explained = _engine.explain(contrib.muon(1e-2), params, grads)
    assert not isinstance(explained, str)
    assert [e.backend for e in explained] == ["perleaf", "perleaf"], explained
    joined = F.chain(F.masked(contrib.scale_by_muon(), {"w": True, "b": False}),
                     F.scale_by_learning_rate(1e-2))
    explained = _engine.explain(joined, params, grads)
    assert not isinstance(explained, str)
    assert [e.backend for e in explained] == ["eager"], explained
    assert "'b' has no rule that reduces within a leaf" in explained[0].reasons["perleaf"]


# --- a clip's sum of squares bounds the updates it scaled --------------------------------

@contextlib.contextmanager
def _range_reads() -> Iterator[list[int]]:
    """A list that grows by the number of tensors each foreach norm of the range check
    reads (`_segments._in_range`)."""
    reads: list[int] = []
    norm = torch._foreach_norm

    def counted(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if sys._getframe(1).f_code.co_name == "_in_range":
            reads.append(len(tensors))
        return norm(tensors, *args, **kwargs)

    torch._foreach_norm = counted  # type: ignore[assignment]
    try:
        yield reads
    finally:
        torch._foreach_norm = norm  # type: ignore[assignment]


@pytest.mark.parametrize("scale", [1.0, 1e30], ids=["in range", "clipped from beyond"])
def test_a_clips_sum_of_squares_bounds_the_updates_it_scaled(scale: float) -> None:
    # (the README's chain, donated: after the first step the range check reads neither the
    # kernels' own writes nor the clipped updates, whose clip measured them; gradients
    # whose squares overflow float32, clipped back into range, are read after all, and the
    # kernel takes them as the pure chain does)
    tx = F.chain(F.clip_by_global_norm(1.0), F.adamw(1e-2))
    params = _trio()
    state, step = tx.init(params), make_step(tx, donate=True)
    grads = F.tree.full_like(params, 0.5)
    with engine() as launched, warnings.catch_warnings():
        warnings.simplefilter("error", FastPathWarning)
        params, state = step(grads, state, params)
    grads = F.tree.map(lambda g: g * scale, grads)
    before = clone_tree((params, state))
    updates, pure_state = tx.update(grads, clone_tree(state), clone_tree(params))
    pure_params = F.apply_updates(clone_tree(params), updates)
    with engine() as launched, _range_reads() as reads, warnings.catch_warnings():
        warnings.simplefilter("error", FastPathWarning)
        params, state = step(grads, state, params)
    assert launched == [1]
    assert reads == ([] if scale == 1.0 else [2]), reads
    for new, pure, old, part in ((params, pure_params, before[0], "params"),
                                 (state, pure_state, before[1], "state")):
        _fast._assert_fast_close(new, pure, old, check="kernel backend", what=part,
                                 exact=False)
