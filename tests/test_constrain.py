"""zero_nans and keep_params_nonnegative: their rules over mixed dtypes, non-finite values and
None gradients."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given

import functopt
from functopt.testing import assert_bitwise_equal, clone_tree
from functopt.testing import strategies as fst


def _leaves(tree: Any) -> list[Any]:
    return functopt.tree.flatten(tree)[0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)




# -------------------------------------------------------------------------------- zero_nans


@given(fst.params_and_gradients(grad_kind="any", allow_none=True))
def test_zero_nans_zeroes_exactly_the_nans_and_flags_them(pg) -> None:
    params, grads = pg
    tx = functopt.zero_nans()
    state = tx.init(params)
    for p, flag in zip(_leaves(params), _leaves(state.found_nan), strict=True):
        assert flag.dtype == torch.bool and flag.shape == () and not flag
        assert flag.device == p.device
    # A first step with nan everywhere sets every flag, so that the second step can show
    # which flags a None gradient leaves alone.
    all_nan = functopt.tree.unflatten(
        functopt.tree.structure(params), [torch.full_like(p, math.nan) for p in _leaves(params)]
    )
    _, state = tx.update(all_nan, state)
    before = (clone_tree(grads), clone_tree(state))
    out, new_state = tx.update(grads, state, params, unused_extra_arg=None)
    assert_bitwise_equal(grads, before[0], what="input")
    assert_bitwise_equal(state, before[1], what="input")
    assert fst.same_layout(out, grads)
    for g, p, o, old_flag, flag in zip(_leaves(grads), _leaves(params), _leaves(out),
                                       _leaves(state.found_nan), _leaves(new_state.found_nan),
                                       strict=True):
        if g is None:
            assert o is None and flag is old_flag
            continue
        nan = g.isnan()
        assert not o.isnan().any()
        assert torch.equal(_bits(o[~nan]), _bits(g[~nan]))  # inf and -0.0 included
        assert torch.equal(_bits(o[nan]), _bits(torch.zeros_like(o[nan])))  # +0.0
        assert flag.item() == bool(nan.any().item())
        if p.numel() > 0:
            assert old_flag.item()


def test_zero_nans_example() -> None:
    tx = functopt.zero_nans()
    params = {"a": torch.zeros(2), "b": torch.zeros(1, dtype=torch.bfloat16)}
    u, state = tx.update(
        {"a": torch.tensor([math.nan, -math.inf]), "b": torch.tensor([2.0], dtype=torch.bfloat16)},
        tx.init(params),
    )
    assert u["a"].tolist() == [0.0, -math.inf] and u["b"].dtype == torch.bfloat16
    assert state.found_nan["a"].item() and not state.found_nan["b"].item()


# ------------------------------------------------------------------ keep_params_nonnegative


@given(fst.params_and_gradients(grad_kind="any", allow_none=True))
def test_keep_params_nonnegative_rule_and_invariant(pg) -> None:
    params, grads = pg
    params = functopt.tree.unflatten(
        functopt.tree.structure(params), [p.abs() for p in _leaves(params)]
    )
    tx = functopt.keep_params_nonnegative()
    before = (clone_tree(grads), clone_tree(params))
    out, state = tx.update(grads, tx.init(params), params)
    assert_bitwise_equal(grads, before[0], what="input")
    assert_bitwise_equal(params, before[1], what="input")
    assert fst.same_layout(out, grads) and state == functopt.EmptyState()
    new_params = functopt.apply_updates(params, out)
    for g, p, o, q in zip(_leaves(grads), _leaves(params), _leaves(out), _leaves(new_params),
                          strict=True):
        if g is None:
            assert o is None
            continue
        negative = (p + g) < 0  # in the param's dtype, as the rule is stated
        assert torch.equal(_bits(o[negative]), _bits(-p[negative]))
        assert torch.equal(_bits(o[~negative]), _bits(g[~negative]))
        assert ((q >= 0) | q.isnan()).all()  # nan updates pass (optax): nothing to compare


def test_keep_params_nonnegative_moves_negative_params_to_zero() -> None:
    params = {"w": torch.tensor([-1.0, 2.0])}
    tx = functopt.keep_params_nonnegative()
    u = tx.update({"w": torch.tensor([-0.5, -3.0])}, tx.init(params), params)[0]
    assert functopt.apply_updates(params, u)["w"].tolist() == [0.0, 0.0]


def test_keep_params_nonnegative_needs_params() -> None:
    tx = functopt.keep_params_nonnegative()
    with pytest.raises(ValueError, match=r"keep_params_nonnegative reads the params, but "
                                         r"update\(\) was called without them"):
        tx.update({"w": torch.ones(1)}, tx.init(None))


def test_keep_params_nonnegative_names_the_leaf_with_a_none_param() -> None:
    tx = functopt.keep_params_nonnegative()
    with pytest.raises(ValueError, match=r"leaf 'b' has an update but its param is None"):
        tx.update({"a": None, "b": torch.ones(1)}, tx.init(None), {"a": torch.ones(1), "b": None})


def test_zero_nans_rejects_a_state_for_other_params() -> None:
    tx = functopt.zero_nans()
    state = tx.init({"w": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"state.found_nan does not have the structure of updates"):
        tx.update({"v": torch.zeros(1)}, state)
