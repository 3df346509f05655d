"""The hypothesis strategies of ``functopt.testing.strategies`` produce what they claim.

"Appears" claims are checked with ``hypothesis.find`` (it fails if no example among many
satisfies the condition); "never" claims with ``@given`` over many draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from functopt.testing import strategies as fst
from functopt.tree import _core

FIND = settings(max_examples=2000, derandomize=True, database=None, phases=[Phase.generate])


def found(strategy: st.SearchStrategy[Any], condition: Callable[[Any], bool]) -> Any:
    """An example of ``strategy`` satisfying ``condition`` (raises NoSuchExample if none)."""
    return find(strategy, condition, settings=FIND)


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in _core.flatten(tree)[0] if isinstance(x, torch.Tensor)]


# --- dtypes and shapes ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", fst.FLOAT_DTYPES, ids=str)
def test_every_dtype_appears_in_params(dtype: torch.dtype) -> None:
    tree = found(fst.params(), lambda t: any(x.dtype == dtype for x in tensor_leaves(t)))
    assert any(x.dtype == dtype for x in tensor_leaves(tree))


def test_trees_mix_dtypes() -> None:
    tree = found(fst.params(), lambda t: len({x.dtype for x in tensor_leaves(t)}) >= 3)
    assert len({x.dtype for x in tensor_leaves(tree)}) >= 3


@settings(max_examples=100)
@given(fst.params(dtypes=(torch.bfloat16, torch.float64)))
def test_params_only_use_the_given_dtypes(tree: Any) -> None:
    assert {x.dtype for x in tensor_leaves(tree)} <= {torch.bfloat16, torch.float64}


def test_zero_dim_and_empty_tensors_appear() -> None:
    assert found(fst.tensors(), lambda x: x.dim() == 0).shape == ()
    empty = found(fst.tensors(), lambda x: x.dim() >= 1 and x.numel() == 0)
    assert 0 in empty.shape
    tree = found(fst.params(), lambda t: any(x.dim() == 0 for x in tensor_leaves(t))
                 and any(x.numel() == 0 for x in tensor_leaves(t)))
    assert tree is not None


@settings(max_examples=200)
@given(fst.shapes(max_dims=2, max_side=3, allow_empty=False))
def test_shapes_respect_their_bounds(shape: tuple[int, ...]) -> None:
    assert len(shape) <= 2
    assert all(1 <= side <= 3 for side in shape)


def test_pytrees_nest_dicts_lists_and_tuples() -> None:
    def kinds(tree: Any) -> set[type]:
        out = set()
        stack = [tree]
        while stack:
            node = stack.pop()
            if isinstance(node, (dict, list, tuple)):
                out.add(type(node))
                stack.extend(node.values() if isinstance(node, dict) else node)
        return out

    tree = found(fst.params(), lambda t: kinds(t) == {dict, list, tuple})
    assert kinds(tree) == {dict, list, tuple}
    assert isinstance(found(fst.params(), lambda t: isinstance(t, torch.Tensor)), torch.Tensor)


@settings(max_examples=100)
@given(fst.params(max_leaves=3))
def test_max_leaves_is_respected(tree: Any) -> None:
    assert 1 <= len(_core.flatten(tree)[0]) <= 3


# --- values --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", fst.FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_values_appear_for_kind_any(dtype: torch.dtype, value: float) -> None:
    if math.isnan(value):
        def hit(x: torch.Tensor) -> bool:
            return bool(torch.isnan(x).any())
    else:
        def hit(x: torch.Tensor) -> bool:
            return bool((x == value).any())
    assert hit(found(fst.tensors(dtype, kind="any"), hit))


@pytest.mark.parametrize("dtype", fst.FLOAT_DTYPES, ids=str)
def test_finite_kind_reaches_huge_tiny_and_subnormal_values(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    strategy = fst.tensors(dtype, kind="finite")
    assert found(strategy, lambda x: bool((x.abs() >= info.max / 64).any())) is not None
    assert found(strategy, lambda x: bool(((x != 0) & (x.abs() < info.smallest_normal)).any()))\
        is not None
    assert found(strategy, lambda x: bool((x == 0).any() and torch.signbit(x).any())) is not None


@settings(max_examples=150)
@given(st.data())
def test_finite_and_typical_kinds_never_give_non_finite_values(data: st.DataObject) -> None:
    dtype = data.draw(fst.dtypes())
    kind = data.draw(st.sampled_from(["finite", "typical"]))
    x = data.draw(fst.tensors(dtype, kind=kind))
    assert x.dtype == dtype
    assert bool(torch.isfinite(x).all()), (dtype, kind, x)


@settings(max_examples=250)
@given(st.data())
def test_values_are_representable_without_overflow(data: st.DataObject) -> None:
    dtype = data.draw(fst.dtypes())
    v = data.draw(fst.values(dtype, "finite"))
    assert math.isfinite(v)
    assert abs(v) <= torch.finfo(dtype).max
    assert bool(torch.isfinite(torch.tensor(v, dtype=torch.float64).to(dtype)))


@settings(max_examples=200)
@given(st.data())
def test_typical_values_are_moderate(data: st.DataObject) -> None:
    v = data.draw(fst.values(data.draw(fst.dtypes()), "typical"))
    assert -10.0 <= v <= 10.0


# --- gradients and layouts -----------------------------------------------------------------


@settings(max_examples=40)
@given(fst.params_and_gradients())
def test_gradients_have_the_params_layout(pg: tuple[Any, Any]) -> None:
    params, grads = pg
    assert fst.same_layout(params, grads)
    assert all(bool(torch.isfinite(g).all()) for g in tensor_leaves(grads))


@settings(max_examples=40)
@given(fst.params_and_gradients(allow_none=True, grad_kind="any"))
def test_allow_none_only_replaces_leaves_by_none(pg: tuple[Any, Any]) -> None:
    params, grads = pg
    p_leaves, p_spec = _core.flatten(params)
    g_leaves, g_spec = _core.flatten(grads)
    assert p_spec == g_spec
    for p, g in zip(p_leaves, g_leaves, strict=True):
        assert g is None or (g.shape == p.shape and g.dtype == p.dtype)


def test_allow_none_gives_none_gradients_sometimes() -> None:
    params, grads = found(fst.params_and_gradients(allow_none=True),
                          lambda pg: any(g is None for g in _core.flatten(pg[1])[0]))
    assert any(g is None for g in _core.flatten(grads)[0])
    assert all(p is not None for p in _core.flatten(params)[0])


def test_params_with_allow_none_have_none_leaves_and_gradients_follow() -> None:
    tree = found(fst.params(allow_none=True), lambda t: None in _core.flatten(t)[0])
    assert None in _core.flatten(tree)[0]

    @settings(max_examples=30)
    @given(st.data())
    def grads_are_none_where_params_are(data: st.DataObject) -> None:
        params = data.draw(fst.params(allow_none=True))
        grads = data.draw(fst.gradients_like(params))
        for p, g in zip(_core.flatten(params)[0], _core.flatten(grads)[0], strict=True):
            assert (p is None) == (g is None)

    grads_are_none_where_params_are()


def test_same_layout_detects_each_difference() -> None:
    a = {"w": torch.zeros(2), "b": None}
    assert fst.same_layout(a, {"w": torch.ones(2), "b": None})
    assert not fst.same_layout(a, {"w": torch.zeros(3), "b": None})
    assert not fst.same_layout(a, {"w": torch.zeros(2, dtype=torch.float64), "b": None})
    assert not fst.same_layout(a, {"w": torch.zeros(2), "b": torch.zeros(())})
    assert not fst.same_layout(a, {"w": torch.zeros(2), "c": None})
    assert not fst.same_layout(a, [torch.zeros(2), None])
