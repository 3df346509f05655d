"""The in-place forms of the rules that follow a per-leaf rule (``Leafwise.inplace``).

The planner's per-leaf tier writes the scale, learning-rate, decay and Muon shape-factor
rules into the updates an earlier rule of the step made, instead of a fresh tensor per
leaf. Each in-place form is held bitwise to its rule's ``update`` here; the tier is held
bitwise to the pure path where an update is also a state entry (a rule whose update is
its new state tensor: writing into it would scale the state) and where it is the
caller's gradient (a rule at the front, whose updates are the gradients).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch
from test_perleaf_fast import _fast, _pure

import functopt
from functopt import contrib
from functopt._base import GradientTransformation
from functopt._spec import PerLeaf, describe, specified
from functopt.contrib._muon import MuonDimensionNumbers, _scale_by_shape
from functopt.testing import assert_bitwise_equal, clone_tree

F = functopt

_RULES = {
    "scale": lambda: F.scale(-0.37),
    "lr number": lambda: F.scale_by_learning_rate(0.013),
    "lr tensor": lambda: F.scale_by_learning_rate(torch.tensor(0.013, dtype=torch.float64)),
    "decay number": lambda: F.add_decayed_weights(0.1),
    "decay tensor": lambda: F.add_decayed_weights(torch.tensor(0.1, dtype=torch.float64)),
    "decay schedule": lambda: F.add_decayed_weights(lambda count: 0.1 / (count + 1.0)),
    "shape factor": lambda: _scale_by_shape(MuonDimensionNumbers(1, 0), None),
    "shape factor rms": lambda: _scale_by_shape(None, 0.2),
}


def _tree(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(5, 3, generator=g, dtype=dtype),
            "b": torch.randn(3, 7, generator=g, dtype=dtype).mT,  # transposed
            "c": torch.randn(4, 6, generator=g, dtype=dtype)[:, ::2],  # strided
            "e": torch.randn(0, 3, generator=g, dtype=dtype)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(_RULES))
def test_the_in_place_form_gives_the_update_bit_for_bit(name: str, dtype: torch.dtype) -> None:
    tx = _RULES[name]()
    inplace = describe(tx).inplace
    assert inplace is not None, f"{name}: no in-place form"
    params = _tree(dtype, 0)
    state = tx.init(params)
    for step in range(2):
        updates = _tree(dtype, step + 1)
        want, want_state = tx.update(clone_tree(updates), state, params)
        written = clone_tree(updates)
        got_state = inplace(written, state, params)
        assert_bitwise_equal(written, want)
        assert_bitwise_equal(got_state, want_state)
        state = want_state


def _matrices(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 8, generator=g), "v": torch.randn(8, 8, generator=g),
            "u": torch.randn(6, 10, generator=g)}


class _KeepState(NamedTuple):
    mu: Any  # per leaf: the running sum of the updates


def _sum_as_update() -> Any:
    """A per-leaf rule whose update is its new state entry itself (the same tensor)."""

    def init(params: Any) -> _KeepState:
        return _KeepState(mu=torch.utils._pytree.tree_map(torch.zeros_like, params))

    def update(updates: Any, state: _KeepState, params: Any = None, **extra: Any) -> Any:
        mu = {k: None if g is None else state.mu[k] + g for k, g in updates.items()}
        return mu, _KeepState(mu={k: state.mu[k] if mu[k] is None else mu[k] for k in mu})

    return specified(GradientTransformation(init, update),
                     PerLeaf("sum_as_update", {}, slots=("mu",)))


def test_an_update_that_is_a_state_entry_is_not_written_into() -> None:
    tx = F.chain(_sum_as_update(), F.add_decayed_weights(0.05),
                 F.scale_by_learning_rate(0.02))
    params = _matrices(0)
    step = functopt.fast.make_step(tx, donate=True)
    ref_params, ref_state = clone_tree(params), tx.init(params)
    fast_params, fast_state = clone_tree(params), tx.init(params)
    for k in range(3):
        grads = _matrices(k + 1)
        ref_params, ref_state = _pure(tx, clone_tree(grads), ref_state, ref_params)
        fast_params, fast_state = _fast(step, clone_tree(grads), fast_state, fast_params)
        assert_bitwise_equal(fast_params, ref_params)
        assert_bitwise_equal(fast_state, ref_state)


def test_the_callers_gradients_are_not_written_into() -> None:
    # a shape factor first: its updates are the caller's gradients, so it runs out of place
    tx = F.chain(_scale_by_shape(None, None), contrib.scale_by_muon(ns_dtype=None),
                 F.scale_by_learning_rate(0.02))
    params = _matrices(0)
    step = functopt.fast.make_step(tx, donate=True)
    grads = _matrices(1)
    kept = clone_tree(grads)
    _fast(step, grads, tx.init(params), clone_tree(params))
    assert_bitwise_equal(grads, kept)


def test_explain_and_the_step_take_the_tail_in_place() -> None:
    # the drop-in's chain: shape factor, decay and learning rate after Muon's rule
    seen: list[Any] = []
    tx = F.chain(contrib.scale_by_muon(ns_dtype=None), F.add_decayed_weights(0.1),
                 F.scale_by_learning_rate(0.02))
    spec = describe(tx)
    decay = spec.children[1]
    original = decay.inplace

    def spy(updates: Any, state: Any, params: Any) -> Any:
        seen.append(True)
        return original(updates, state, params)

    object.__setattr__(decay, "inplace", spy)
    params = _matrices(0)
    step = functopt.fast.make_step(tx, donate=True)
    _fast(step, _matrices(1), tx.init(params), clone_tree(params))
    assert seen, "the decay ran out of place after Muon's rule"
