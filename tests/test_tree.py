"""functopt.tree: maps, casts, constructors, reductions and get/set by name."""

from __future__ import annotations

import collections
from typing import NamedTuple

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt import tree as ft
from functopt.testing import strategies as fst


def _clone(tree):
    return optree.tree_map(lambda x: x.clone(), tree, namespace="functopt")


def _bitwise_equal(a, b):
    a_leaves, a_spec = ft.flatten(a)
    b_leaves, b_spec = ft.flatten(b)
    assert a_spec == b_spec
    for x, y in zip(a_leaves, b_leaves, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


class Inner(NamedTuple):
    count: torch.Tensor
    mu: dict


class Outer(NamedTuple):
    count: torch.Tensor
    inner: Inner
    extra: tuple


def _state():
    return Outer(
        count=torch.tensor(1, dtype=torch.int32),
        inner=Inner(count=torch.tensor(2, dtype=torch.int32),
                    mu={"w": torch.ones(2), "b": None}),
        extra=({"lr": torch.tensor(0.1)}, [torch.zeros(1)]),
    )


# --- map / map_with_path ----------------------------------------------------------------


@given(fst.params(allow_none=True, kind="finite"))
def test_map_skips_none_and_is_pure(params):
    before = _clone(params)
    calls = []

    def fn(x):
        calls.append(x)
        return x * 2

    out = ft.map(fn, params)
    _bitwise_equal(params, before)
    leaves, _ = ft.flatten(params)
    assert len(calls) == sum(x is not None for x in leaves)
    for x, y in zip(leaves, ft.flatten(out)[0], strict=True):
        assert (y is None) if x is None else torch.equal(y, x * 2)
    assert ft.structure(out) == ft.structure(params)


def test_map_with_several_trees_passes_their_leaves():
    a = {"x": torch.ones(2), "y": None, "z": torch.zeros(1)}
    b = {"x": torch.full((2,), 3.0), "y": torch.ones(1), "z": None}
    out = ft.map(lambda u, v: (u, v), a, b)
    assert out["y"] is None  # not called: the first tree holds None
    assert out["z"][1] is None  # called, with the None of the second tree
    assert torch.equal(out["x"][1], b["x"])


def test_map_structure_mismatch_names_the_path():
    with pytest.raises(ValueError, match=r"rest\[0\] does not have the structure of tree "
                                         r"\(at 'layer': missing key 'bias'"):
        ft.map(lambda a, b: a, {"layer": {"w": torch.ones(1), "bias": torch.ones(1)}},
               {"layer": {"w": torch.ones(1)}})


def test_map_with_path():
    tree = {"layers": [{"weight": torch.ones(1), "bias": None}], "scale": torch.ones(())}
    out = ft.map_with_path(lambda path, x, y: (path, y), tree, ft.ones_like(tree))
    assert out["layers"][0]["weight"][0] == "layers.0.weight"
    assert out["layers"][0]["bias"] is None
    assert out["scale"][0] == "scale"
    assert ft.map_with_path(lambda p, x: p, torch.ones(1)) == "<root>"
    state = functopt.scale_by_adam().init({"w": torch.zeros(1)})
    paths = ft.leaves_with_path(ft.map_with_path(lambda p, x: p, state))
    assert [p for p, _ in paths] == ["count", "mu.w", "nu.w"]


# --- cast -------------------------------------------------------------------------------


@given(fst.params(allow_none=True), fst.dtypes())
def test_cast_moves_floating_leaves_only(params, dtype):
    tree = {"p": params, "count": torch.tensor(3, dtype=torch.int32), "flag": torch.tensor(True)}
    before = _clone(tree)
    out = ft.cast(tree, dtype)
    _bitwise_equal(tree, before)
    assert out["count"] is tree["count"] and out["flag"] is tree["flag"]
    for x, y in zip(ft.flatten(params)[0], ft.flatten(out["p"])[0], strict=True):
        assert (y is None) if x is None else (y.dtype == dtype and torch.equal(y, x.to(dtype)))


def test_cast_keeps_non_tensor_leaves_and_none_dtype():
    tree = {"a": 1.5, "b": "name", "c": torch.ones(1)}
    assert ft.cast(tree, torch.float16)["a"] == 1.5
    assert ft.cast(tree, None) is tree


def test_cast_is_differentiable():
    x = torch.tensor([1.5, 2.0], dtype=torch.float64)
    g = torch.func.grad(lambda v: ft.cast({"v": v}, torch.float32)["v"].sum())(x)
    assert torch.equal(g, torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.int32, "float32", torch.bool])
def test_cast_rejects_non_floating_dtypes(dtype):
    with pytest.raises(TypeError, match=r"functopt.tree.cast: dtype must be None or a floating "
                                        r"torch.dtype \(e.g. torch.bfloat16\), got"):
        ft.cast({"a": torch.ones(1)}, dtype)


# --- zeros_like / ones_like / full_like --------------------------------------------------


@given(fst.params(allow_none=True))
def test_constructors(params):
    for fn, value in ((ft.zeros_like, 0.0), (ft.ones_like, 1.0),
                      (lambda t: ft.full_like(t, -2.5), -2.5)):
        out = fn(params)
        assert fst.same_layout(out, params)
        for x in ft.flatten(out)[0]:
            assert x is None or bool((x == value).all())
    out = ft.zeros_like(params, dtype=torch.float64)
    for x, y in zip(ft.flatten(params)[0], ft.flatten(out)[0], strict=True):
        assert (y is None) if x is None else (y.dtype == torch.float64 and y.shape == x.shape)


def test_constructor_dtype_applies_to_every_leaf():
    out = ft.ones_like({"count": torch.tensor(0, dtype=torch.int32)}, dtype=torch.float32)
    assert out["count"].dtype == torch.float32
    assert ft.full_like([torch.zeros(2)], 3, dtype=torch.int64)[0].tolist() == [3, 3]


def test_constructor_errors():
    with pytest.raises(TypeError, match=r"functopt.tree.zeros_like: tree leaf 'a' is a float; "
                                        r"expected a torch.Tensor or None"):
        ft.zeros_like({"a": 1.0})
    with pytest.raises(TypeError, match="fill_value must be a Python number, got Tensor"):
        ft.full_like({"a": torch.ones(1)}, torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"functopt.tree.ones_like: dtype must be None or a "
                                        r"torch.dtype, got 'float32'"):
        ft.ones_like({"a": torch.ones(1)}, dtype="float32")


# --- sum / vdot / global_norm -----------------------------------------------------------


def _ref_sum(tree):
    return sum(float(x.double().sum()) for x in ft.flatten(tree)[0] if x is not None)


@given(fst.params(allow_none=True, dtypes=(torch.float32, torch.float64, torch.bfloat16)))
def test_sum_matches_float64_reference(params):
    out = ft.sum(params)
    leaves = [x for x in ft.flatten(params)[0] if x is not None]
    wide = any(x.dtype == torch.float64 for x in leaves)
    assert out.shape == () and out.dtype == (torch.float64 if wide else torch.float32)
    assert abs(out.item() - _ref_sum(params)) <= 1e-5 * (1 + sum(
        float(x.double().abs().sum()) for x in leaves))


def test_sum_accumulates_low_precision_in_float32():
    x = torch.full((4096,), 1.0, dtype=torch.bfloat16)
    assert ft.sum({"x": x, "n": None}).item() == 4096.0  # a bfloat16 sum stalls at 256
    assert ft.sum({}).item() == 0.0


@given(st.data())
def test_vdot_matches_float64_reference(data):
    xs = data.draw(fst.params(allow_none=True, dtypes=(torch.float32, torch.float64)))
    ys = data.draw(fst.gradients_like(xs, kind="typical", allow_none=True))
    out = ft.vdot(xs, ys)
    want = sum(float((x.double() * y.double()).sum())
               for x, y in zip(ft.flatten(xs)[0], ft.flatten(ys)[0], strict=True)
               if x is not None and y is not None)
    assert abs(out.item() - want) <= 1e-4 * (1 + abs(want))


def test_vdot_mixed_dtypes_and_errors():
    a = {"w": torch.ones(3, dtype=torch.bfloat16)}
    b = {"w": torch.full((3,), 2.0, dtype=torch.float16)}
    out = ft.vdot(a, b)
    assert out.item() == 6.0 and out.dtype == torch.float32
    with pytest.raises(ValueError, match=r"'w': tree_x has shape \(3,\) but tree_y has shape "
                                         r"\(1, 3\)"):
        ft.vdot(a, {"w": torch.ones(1, 3)})
    with pytest.raises(ValueError, match="tree_y does not have the structure of tree_x"):
        ft.vdot(a, {"v": torch.ones(3)})
    with pytest.raises(TypeError, match=r"functopt.tree.vdot: tree_y leaf 'w' is a str"):
        ft.vdot(a, {"w": "x"})


def test_global_norm_still_there():
    assert ft.global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}).item() == 5.0


# --- get / set --------------------------------------------------------------------------


def test_get_finds_fields_keys_and_namedtuples():
    state = _state()
    assert ft.get(state, "lr") is state.extra[0]["lr"]
    assert ft.get(state, "mu") is state.inner.mu
    assert ft.get(state, "w") is state.inner.mu["w"]
    assert ft.get(state, "Inner") is state.inner
    assert ft.get(state, "b") is None  # a field holding None is found, not missing
    assert ft.get(state, "nothing", default=7) == 7
    assert ft.get(state, "b", default=7) is None
    assert ft.get({1: torch.ones(1)}, 1) is not None  # non-string dict keys


def test_get_ambiguous_lists_the_paths():
    with pytest.raises(KeyError, match=r"functopt.tree.get: 'count' is ambiguous: it is found "
                                       r"at 2 places: 'count', 'inner.count'. Fix: call get on "
                                       r"the subtree"):
        ft.get(_state(), "count")
    assert ft.get(_state().inner, "count").item() == 2


def test_get_missing_lists_what_exists():
    with pytest.raises(KeyError) as info:
        ft.get(_state(), "mus")
    message = str(info.value)
    assert message.startswith("functopt.tree.get: no field, dict key or NamedTuple named 'mus'")
    assert "Names found: 'Inner', 'Outer', 'b', 'count', 'extra', 'inner', 'lr', 'mu', 'w'." \
        in message
    assert message.endswith("Did you mean 'mu'?")
    with pytest.raises(KeyError, match=r"Names found: none \(the tree has no named fields\)"):
        ft.get([torch.ones(1)], "count")


def test_set_replaces_every_match_without_mutating():
    state = _state()
    before = _clone(ft.map(lambda x: x, state))
    zero = torch.tensor(0, dtype=torch.int32)
    new = ft.set(state, count=zero, lr=torch.tensor(0.5))
    assert new.count is zero and new.inner.count is zero
    assert new.extra[0]["lr"].item() == 0.5
    assert new.inner.mu is state.inner.mu  # untouched subtrees are shared
    _bitwise_equal(state, before)
    assert state.count.item() == 1 and state.extra[0]["lr"].item() == pytest.approx(0.1)


def test_set_namedtuple_by_name_and_container_types():
    state = _state()
    replacement = Inner(count=torch.tensor(9), mu={})
    assert ft.set(state, Inner=replacement).inner is replacement
    ordered = collections.OrderedDict([("z", torch.ones(1)), ("a", torch.zeros(1))])
    out = ft.set({"outer": ordered}, a=None)
    assert type(out["outer"]) is collections.OrderedDict
    assert list(out["outer"]) == ["z", "a"] and out["outer"]["a"] is None
    assert ft.set(state) is state


def test_set_missing_name_is_an_error():
    with pytest.raises(KeyError, match=r"functopt.tree.set: no field, dict key or NamedTuple "
                                       r"named 'counts' in the tree.*Did you mean 'count'\?"):
        ft.set(_state(), count=torch.tensor(0), counts=torch.tensor(0))


def test_get_set_on_a_real_chain_state():
    tx = functopt.named_chain(("adam", functopt.scale_by_adam()), ("lr", functopt.scale(-0.1)))
    state = tx.init({"w": torch.zeros(2)})
    assert ft.get(state, "ScaleByAdamState") is state["adam"]
    new = ft.set(state, count=torch.tensor(5, dtype=torch.int32))
    _, after = tx.update({"w": torch.ones(2)}, new)
    assert after["adam"].count.item() == 6


@settings(max_examples=10)
@given(fst.params(allow_none=True))
def test_set_then_get_roundtrip(params):
    state = functopt.scale_by_adam().init(params)
    mu = ft.zeros_like(params)
    new = ft.set(state, mu=mu)
    assert ft.get(new, "mu") is mu and ft.get(new, "nu") is state.nu
