"""State entries own their memory: what a donated step needs, since it writes them in place.

A donated fast step (the kernels, the compiled tier, the mixed step) writes each per-leaf
state entry in place, where the pure step reads every entry as it was and returns new
tensors. Two entries that share memory would be written one over the other:
``contrib.madgrad``'s and ``contrib.simplified_ademamix``'s ``init`` gave their two moments
one zeros tensor per leaf, and their donated compiled steps came out wrong (a moment off by
0.019, another by 101%: ``tests/test_compiled.py``, ``-m slow``). So every built-in's
``init`` gives each entry its own tensor, and a donated step refuses entries that share
memory (with each other or with a param) before it writes anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_conformance import REGISTRY
from test_contrib import ENTRIES
from test_planner import _assert_close, _pure

import functopt
from functopt import contrib
from functopt.fast import _planner, make_step
from functopt.testing import assert_bitwise_equal, clone_tree

F64 = torch.float64

_FACTORIES = [(e.id, e.factory) for e in REGISTRY] + [(f"contrib.{e[0]}", e[2]) for e in ENTRIES]


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 2, generator=gen, dtype=F64),
            "b": torch.randn(2, generator=gen, dtype=F64),
            "s": torch.randn((), generator=gen, dtype=F64)}


def _shared_memory(state: Any, params: Any) -> tuple[str, str] | None:
    """Two leaves with elements of the state, or one of the state and one of the params,
    that share memory (by their paths), or None."""
    rows = [(f"param {p!r}", x) for p, x in functopt.tree.leaves_with_path(params)]
    rows += [(f"state {p!r}", x) for p, x in functopt.tree.leaves_with_path(state)]
    pair = _planner.overlap([x if isinstance(x, torch.Tensor) else None for _, x in rows],
                            lambda i: rows[i][0], "leaf")
    return None if pair is None else (rows[pair[0]][0], rows[pair[1]][0])


@pytest.mark.parametrize("factory", [f for _, f in _FACTORIES], ids=[i for i, _ in _FACTORIES])
def test_every_state_entry_owns_its_memory(factory: Callable[[], Any]) -> None:
    """After ``init`` and after an update, no two state leaves share memory, nor one with a
    param (every built-in transform and recipe, and every contrib one)."""
    params = _params()
    tx = factory()
    state = tx.init(params)
    assert _shared_memory(state, params) is None, "after init"
    _, state = tx.update({k: torch.ones_like(v) for k, v in params.items()}, state, params)
    assert _shared_memory(state, params) is None, "after an update"


def _adam_moments_tied(params: Any) -> Any:
    adam, *rest = functopt.adam(1e-2).init(params)
    return (adam._replace(nu=adam.mu), *rest)


def _adam_moment_is_the_param(params: Any) -> Any:
    adam, *rest = functopt.adam(1e-2).init(params)
    return (adam._replace(mu={**adam.mu, "b": params["b"]}), *rest)


def _madgrad_moments_tied(params: Any) -> Any:
    # what madgrad's init gave before: one zeros tensor for both sums, per leaf
    decay, madgrad = contrib.madgrad(1e-2).init(params)
    return (decay, madgrad._replace(s=madgrad.grad_sum_sq))


CASES = {
    "adam moments tied": (lambda: functopt.adam(1e-2), _adam_moments_tied, False,
                          r"state entry '0\.mu\.(\w)' and state entry '0\.nu\.\1' share memory"),
    "adam moment is the param": (lambda: functopt.adam(1e-2), _adam_moment_is_the_param, False,
                                 r"param 'b' and state entry '0\.mu\.b' share memory"),
    # (the first leaf the message names is the one first in memory; refused while
    # lowering, before anything compiles)
    "compiled madgrad sums tied": (
        lambda: contrib.madgrad(1e-2), _madgrad_moments_tied, True,
        r"state entry '1\.grad_sum_sq\.(\w)' and state entry '1\.s\.\1' share memory"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_donated_step_refuses_state_entries_that_share_memory(case: str) -> None:
    make_tx, make_state, compiled, message = CASES[case]
    tx, params = make_tx(), _params()
    state = make_state(params)
    grads = {k: torch.full_like(v, 0.5) for k, v in params.items()}
    assert functopt.fast.explain(tx, params, state, compile=compiled).fast
    before = clone_tree((params, state))
    step = make_step(tx, donate=True, compile=compiled)
    with torch.no_grad(), pytest.raises(ValueError, match=message + r".*Fix: give each state "):
        step(grads, state, params)
    assert_bitwise_equal((params, state), before)  # nothing was written before the error
    expected = _pure(tx, grads, state, params)
    if compiled:
        return  # (the rest compiles: tests/test_compiled.py holds the tier to the law)
    with torch.no_grad():
        _assert_close(make_step(tx)(grads, state, params), expected, "not donated")
        # the fix the message gives: a copy of the state, each entry its own tensor
        copied = functopt.tree.map(torch.clone, state)
        _assert_close(step(grads, copied, clone_tree(params)), expected, "donated copy")
    assert_bitwise_equal((params, state), before)


def test_entries_without_a_write_may_share_memory() -> None:
    """A donated step that stays pure (no kernel for the rule, without compile) writes only
    the params, so madgrad's tied sums step there as the pure step does."""
    tx, params = contrib.madgrad(1e-2), _params()
    state = _madgrad_moments_tied(params)
    grads = {k: torch.full_like(v, 0.5) for k, v in params.items()}
    expected = _pure(tx, grads, state, clone_tree(params))
    with torch.no_grad(), pytest.warns(functopt.fast.FastPathWarning):
        got = make_step(tx, donate=True)(grads, state, params)
    assert_bitwise_equal(got, expected)
    assert got[0]["w"] is params["w"]  # (donated: written in place)
    assert _shared_memory(got[1], got[0]) is None  # the pure step's new state


def test_a_donated_mixed_step_refuses_masters_that_share_memory() -> None:
    """Two bfloat16 params whose masters are one tensor (a state edited by hand): refused
    by name before anything is written (the message named no master before: its names
    were the params')."""
    params = {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.ones(3, dtype=torch.bfloat16)}
    grads = {k: torch.full((3,), 0.5, dtype=torch.bfloat16) for k in params}
    mp = functopt.precision.mixed_precision(functopt.adamw(1e-2), donate=True)
    state = mp.init(params)
    tied = state._replace(master={"a": state.master["a"], "b": state.master["a"]})
    before = clone_tree((params, tied))
    with pytest.raises(ValueError, match=r"state.master 'a' and state.master 'b' share memory"):
        mp.step(grads, tied, params)
    assert_bitwise_equal((params, tied), before)
