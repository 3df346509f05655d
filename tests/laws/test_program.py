"""The program engine's law: its step equals the pure step, bitwise.

``make_step`` with the private switch on (``functopt/fast/_engine.py``) compiles the
transform into a program (``functopt/fast/_program.py``) and runs it with the executor
(``functopt/fast/_execute.py``) on its eager backend alone, whose arithmetic is the rules'
own: its params and state after several steps are bitwise those of ``update`` then
``apply_updates``. (The faster backends' law, to the fast-path tolerance, is
tests/laws/test_backends.py.)

- the registry law: every transform and recipe of the conformance registry (and contrib's)
  that the compiler takes, over drawn pytrees (channels_last, transposed, strided, 0-d and
  empty leaves, ``None`` gradients, inf and nan), donated or not; the entries it does not
  take are a table here, each with the reason the program gives;
- the chain table: clips before, after and between rules, ``apply_if_finite`` with an inf
  or a nan injected, ``inject_hyperparams`` (nested too) with a value changed between
  steps, ``masked`` / ``partition``;
- barriers: a program's count of barriers, and on 2 gloo ranks with DTensor shards the
  step's collectives (``CommDebugMode``) equal to it;
- the switch: off, the engine is not called; a program that cannot be built keeps the
  planner's path with one FastPathWarning naming the reason.

``MultiSteps`` has its own table beside this one: tests/laws/test_program_multisteps.py.
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
from functopt.fast import FastPathWarning, _engine, make_step
from functopt.fast._program import Program, compile_program
from functopt.testing import assert_bitwise_equal, clone_tree, conformance
from functopt.tree import _core

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_conformance import REGISTRY, inverse_count
from test_contrib import ENTRIES

F64 = torch.float64
STEPS = 3

_FACTORIES: list[tuple[str, Callable[[], Any]]] = (
    [(e.id, e.factory) for e in REGISTRY] + [(f"contrib.{e[0]}", e[2]) for e in ENTRIES])

# The entries the compiler does not take yet, and a part of the reason it gives.
REFUSED: dict[str, str] = {
    "stateless": "without a spec",
    "stateless_with_tree_map": "without a spec",
    "with_extra_args_support": "without a spec",
    "zero_nans": "ZeroNans has no program yet",
}


@contextlib.contextmanager
def engine(backends: tuple[str, ...] = ("eager",)) -> Iterator[list[int]]:
    """The switch on with these backends (by default the eager one alone, the reference
    this file's law is about), and a list that grows by one at each step the engine runs."""
    calls: list[int] = []
    run = _engine.execute_leaves

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return run(*args, **kwargs)

    before = _engine.ENABLED, _engine.BACKENDS
    _engine.ENABLED, _engine.BACKENDS = True, backends
    _engine.execute_leaves = counted  # type: ignore[assignment]
    try:
        yield calls
    finally:
        _engine.ENABLED, _engine.BACKENDS = before
        _engine.execute_leaves = run  # type: ignore[assignment]


def program_of(tx: Any, params: Any) -> Program:
    param_leaves, treespec = _core.flatten(params)
    state_leaves, state_spec = _core.flatten(tx.init(params))
    return compile_program(tx, params, treespec, param_leaves, state_leaves,
                           state_spec)


def _negated(tree: Any) -> Any:
    leaves, spec = _core.flatten(tree)
    return _core.unflatten(spec, [None if g is None else -g for g in leaves])


def check_equal(tx: Any, params: Any, grads: list[Any], *, donate: bool = False,
                between: Callable[[int, Any], Any] | None = None) -> None:
    """``make_step(tx)`` on the engine, step by step over ``grads``, equals the pure step
    bitwise; ``between(k, state)`` edits the state before step ``k`` (on both paths)."""
    pure_params, pure_state = clone_tree(params), tx.init(params)
    fast_params, fast_state = clone_tree(params), clone_tree(pure_state)
    step = make_step(tx, donate=donate)
    with engine() as calls:
        for k, g in enumerate(grads):
            if between is not None:
                pure_state, fast_state = between(k, pure_state), between(k, fast_state)
            updates, pure_state = tx.update(g, pure_state, pure_params)
            pure_params = F.apply_updates(pure_params, updates)
            fast_params, fast_state = step(g, fast_state, fast_params)
            assert_bitwise_equal(fast_params, pure_params, what=f"params after step {k + 1}")
            assert_bitwise_equal(fast_state, pure_state, what=f"state after step {k + 1}")
    assert len(calls) == len(grads), "the engine did not run every step"


# --- the registry law ---------------------------------------------------------------------

@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("entry", _FACTORIES, ids=[e[0] for e in _FACTORIES])
@settings(max_examples=4)
@given(data=st.data())
def test_registry_entry_equals_pure_path(entry: tuple[str, Callable[[], Any]], donate: bool,
                                         data: st.DataObject) -> None:
    name, factory = entry
    params, grads, _ = data.draw(conformance.cases(grad_kind="any", max_leaves=4,
                                                   tied=not donate))
    tx = factory()
    program = program_of(tx, params)
    if name in REFUSED:
        assert program.reason is not None and REFUSED[name] in program.reason, program.reason
        return
    assert program.reason is None, f"{name}: {program.reason}"
    check_equal(tx, params, [grads, _negated(grads), grads], donate=donate)


# --- the chain table ----------------------------------------------------------------------

def _params() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, generator=gen).t(),  # (transposed)
            "b": torch.randn(3, generator=gen, dtype=torch.bfloat16),
            "h": torch.randn(2, 2, generator=gen, dtype=F64),
            "s": torch.randn((), generator=gen)}


def _grads(k: int, bad: float | None = None) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(k + 1)
    out = {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) * 3
           for n, p in _params().items()}
    if bad is not None:
        out["h"][0, 1] = bad
    return out


def _weights(p: Any) -> dict[str, bool]:
    return {"w": True, "b": False, "h": True, "s": False}


def _nothing(p: Any) -> dict[str, bool]:
    return {"w": False, "b": False, "h": False, "s": False}


def _labels(p: Any) -> dict[str, str]:
    return {"w": "adam", "b": "sgd", "h": "adam", "s": "frozen"}


def _nested(learning_rate: Any) -> Any:
    """A chain with an injection inside, to be injected itself."""
    return F.chain(F.inject_hyperparams(F.scale_by_adam)(b1=0.5), F.clip_by_global_norm(1.0),
                   F.scale_by_learning_rate(learning_rate))


CHAINS: dict[str, Callable[[], Any]] = {
    "clip before": lambda: F.chain(F.clip_by_global_norm(1.0), F.adamw(1e-2)),
    "clip after": lambda: F.chain(F.adamw(1e-2), F.clip_by_global_norm(0.05)),
    "clip between": lambda: F.chain(F.scale_by_adam(), F.clip_by_global_norm(0.5),
                                    F.add_decayed_weights(1e-2), F.scale(-0.1)),
    "two clips": lambda: F.chain(F.clip_by_global_norm(2.0), F.scale_by_lion(),
                                 F.clip_by_global_norm(0.5), F.scale(-0.1)),
    "masked clip": lambda: F.chain(F.masked(F.clip_by_global_norm(0.5), _weights),
                                   F.sgd(0.1, momentum=0.9)),
    "partition": lambda: F.partition(
        {"adam": F.chain(F.clip_by_global_norm(1.0), F.adam(1e-2)),
         "sgd": F.sgd(0.1, momentum=0.5), "frozen": F.set_to_zero()}, _labels),
    "masked decay": lambda: F.adamw(1e-2, weight_decay=0.1, mask=_weights),
    "a part on no leaves": lambda: F.partition(  # (its count moves all the same)
        {"adam": F.adam(1e-2), "sgd": F.sgd(0.1)}, lambda p: dict.fromkeys(p, "sgd")),
    "masked on no leaf": lambda: F.chain(F.masked(F.adam(1e-2), _nothing), F.sgd(0.1)),
    "guard": lambda: F.apply_if_finite(F.adam(1e-2), max_consecutive_errors=1),
    "guard after clip": lambda: F.chain(F.clip_by_global_norm(1.0),
                                        F.apply_if_finite(F.adam(1e-2), 2)),
    "clip in guard": lambda: F.apply_if_finite(
        F.chain(F.clip_by_global_norm(1.0), F.lion(1e-3)), 1),
    "guard after rules": lambda: F.chain(F.scale_by_adam(),
                                         F.apply_if_finite(F.scale(-0.1), 0)),
    "injected": lambda: F.inject_hyperparams(F.adamw)(learning_rate=0.1, b1=0.8),
    "injected schedule": lambda: F.inject_hyperparams(F.sgd)(learning_rate=inverse_count),
    "injected clip": lambda: F.inject_hyperparams(F.clip_by_global_norm)(max_norm=0.5),
    "nested injection": lambda: F.inject_hyperparams(_nested)(learning_rate=0.1),
    "guard around injection": lambda: F.apply_if_finite(
        F.inject_hyperparams(F.adam)(learning_rate=0.1), 1),
    "clip before prodigy": lambda: F.chain(F.clip_by_global_norm(1.0), contrib.prodigy()),
}


def _halve_learning_rate(k: int, state: Any) -> Any:
    """Halve every injected ``learning_rate`` (in place of the state entry) before step 2."""
    if k != 1:
        return state
    leaves, spec = _core.flatten(state)
    paths = _core.paths(spec)
    return _core.unflatten(spec, [x / 2 if "learning_rate" in path else x
                                  for path, x in zip(paths, leaves, strict=True)])


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")],
                         ids=["finite", "inf", "nan"])
@pytest.mark.parametrize("chain", list(CHAINS), ids=list(CHAINS))
def test_chain_equals_pure_path(chain: str, bad: float | None, donate: bool) -> None:
    # a bad value at the second step only: a guard skips it, and recovers
    grads = [_grads(k, bad if k == 1 else None) for k in range(STEPS + 1)]
    check_equal(CHAINS[chain](), _params(), grads, donate=donate, between=_halve_learning_rate)


def test_a_changed_hyperparameter_reaches_the_step() -> None:
    # the table's law holds with the edit; here the edit is seen to matter
    tx = F.inject_hyperparams(F.sgd)(learning_rate=0.1)
    params, step = _params(), make_step(tx)
    with engine():
        kept, _ = step(_grads(0), tx.init(params), params)
        halved, _ = step(_grads(0), _halve_learning_rate(1, tx.init(params)), params)
    assert not torch.equal(kept["w"], halved["w"])


# --- barriers -----------------------------------------------------------------------------

BARRIERS = [
    ("adamw", lambda: F.adamw(1e-2), 0),
    ("clip before", CHAINS["clip before"], 1),
    ("clip after", CHAINS["clip after"], 1),
    ("two clips", CHAINS["two clips"], 2),
    ("partition", CHAINS["partition"], 1),
    ("clip in guard", CHAINS["clip in guard"], 1),
    ("guard after clip", CHAINS["guard after clip"], 2),
    ("prodigy", lambda: contrib.prodigy(), 1),
    ("clip before prodigy", CHAINS["clip before prodigy"], 2),
    # (a MultiSteps' gate runs one branch: its closing mini-step's barriers count)
    ("clip in MultiSteps", lambda: F.MultiSteps(F.chain(F.clip_by_global_norm(1.0),
                                                        F.adam(1e-2)), 2), 1),
    ("clip before MultiSteps with a guard", lambda: F.chain(
        F.clip_by_global_norm(1.0),
        F.MultiSteps(F.apply_if_finite(F.sgd(0.1), 1), 2).gradient_transformation()), 2),
]


@pytest.mark.parametrize(("name", "factory", "barriers"), BARRIERS, ids=[b[0] for b in BARRIERS])
def test_barriers(name: str, factory: Callable[[], Any], barriers: int) -> None:
    program = program_of(factory(), _params())
    assert program.reason is None
    assert program.barriers == barriers


# --- the switch ---------------------------------------------------------------------------

def test_switch_off_leaves_make_step_alone() -> None:
    tx, params = F.adamw(1e-2), _params()
    with engine() as calls:
        _engine.ENABLED = False
        make_step(tx)(_grads(0), tx.init(params), params)
    assert calls == []


def _opaque() -> F.GradientTransformation:
    return F.GradientTransformation(lambda p: (), lambda u, s, p=None: (u, s))


def test_a_refused_program_warns_once_and_keeps_the_planner_path() -> None:
    tx = F.chain(_opaque(), F.sgd(0.1))
    params = _params()
    state, step = tx.init(params), make_step(tx)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FastPathWarning)  # (the planner's own, the same)
        reference, _ = make_step(tx)(_grads(0), state, params)
    with engine() as calls, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new, _ = step(_grads(0), state, params)
        step(_grads(1), state, params)
    engine_warnings = [w for w in caught if "program engine" in str(w.message)]
    assert len(engine_warnings) == 1 and engine_warnings[0].category is FastPathWarning
    assert "[0]: a transform without a spec" in str(engine_warnings[0].message)
    assert calls == []
    assert_bitwise_equal(new, reference)


def test_extra_args_keep_the_planner_path_with_a_warning() -> None:
    tx, params = F.sgd(0.1), {"w": torch.ones(3)}
    with engine() as calls, pytest.warns(FastPathWarning, match="extra arguments"):
        make_step(tx)({"w": torch.ones(3)}, tx.init(params), params, unused=1)
    assert calls == []


# --- collectives on a mesh ----------------------------------------------------------------

@pytest.fixture(scope="module")
def mesh_results() -> list[dict[str, str | None]]:
    from distributed import harness, program_checks

    return harness.run_ranks(program_checks.run_all, 2, timeout_s=120.0)


@pytest.mark.parametrize("name", ["adamw", "clip before", "clip after", "two clips",
                                  "clip in guard", "partition"])
def test_collectives_per_step_are_the_barriers(mesh_results: list[dict[str, str | None]],
                                               name: str) -> None:
    # 2 gloo ranks, Shard(0) DTensor params: CommDebugMode's count == program.barriers,
    # and the params equal the pure step's (tests/distributed/program_checks.py)
    failures = [f"rank {rank}:\n{r[name]}" for rank, r in enumerate(mesh_results) if r[name]]
    assert not failures, "\n".join(failures)
