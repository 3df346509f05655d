"""The protocol (functopt/_base.py), apply_updates (functopt/_apply.py) and the structure
and leaf checks of functopt/tree/_core.py, with their error messages."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings

import functopt
from functopt import _base
from functopt.testing import strategies as fst
from functopt.tree import _core

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(_INT[x.element_size()]) if x.is_floating_point() else x


def snapshot(tree: Any) -> list[Any]:
    return [None if x is None else (x, x.clone(), x._version) for x in _core.flatten(tree)[0]]


def assert_unchanged(saved: list[Any]) -> None:
    for item in saved:
        if item is not None:
            x, copy, version = item
            assert x._version == version
            assert torch.equal(bits(x), bits(copy))


# --- apply_updates -------------------------------------------------------------------------


@settings(max_examples=40)
@given(fst.params_and_gradients(grad_kind="any", allow_none=True))
def test_apply_updates_adds_leafwise_and_is_pure(pg: tuple[Any, Any]) -> None:
    params, updates = pg
    saved_p, saved_u = snapshot(params), snapshot(updates)
    new = functopt.apply_updates(params, updates)
    assert_unchanged(saved_p)
    assert_unchanged(saved_u)
    new_leaves, spec = _core.flatten(new)
    assert spec == _core.structure(params)
    for p, u, n in zip(_core.flatten(params)[0], _core.flatten(updates)[0], new_leaves,
                       strict=True):
        if u is None:
            assert n is p  # untouched param: the very same tensor
        else:
            assert n is not p and n.dtype == p.dtype and n.shape == p.shape
            assert torch.equal(bits(n), bits(p + u))


def test_apply_updates_keeps_none_params_and_none_updates() -> None:
    w = torch.ones(2)
    out = functopt.apply_updates({"w": w, "frozen": None, "b": torch.zeros(())},
                                 {"w": None, "frozen": None, "b": torch.tensor(2.0)})
    assert out["w"] is w
    assert out["frozen"] is None
    assert out["b"].item() == 2.0
    # A None param with an update: the update has nowhere to go, the param stays None.
    assert functopt.apply_updates([None], [torch.ones(1)]) == [None]


def test_apply_updates_in_place_on_module_parameters() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    params = dict(model.named_parameters())
    before = {k: v.detach().clone() for k, v in params.items()}
    ids = {k: id(v) for k, v in params.items()}
    updates = {k: torch.full_like(v, 0.5) for k, v in params.items()}
    updates["2.bias"] = None
    result = functopt.apply_updates_(params, updates)
    assert result is None
    for k, v in model.named_parameters():
        assert id(v) == ids[k] and v.requires_grad  # the same Parameter objects, updated
        expected = before[k] if k == "2.bias" else before[k] + 0.5
        assert torch.equal(v.detach(), expected), k
    # The model still trains afterwards (no autograd error from the in-place write).
    model(torch.ones(1, 2)).sum().backward()
    assert params["0.weight"].grad is not None


def test_apply_updates_in_place_checks_everything_before_writing() -> None:
    params = {"a": torch.zeros(2), "b": torch.zeros(2)}
    with pytest.raises(TypeError, match=r"'b': float64 update for float32 param"):
        functopt.apply_updates_(params, {"a": torch.ones(2), "b": torch.ones(2, dtype=torch.float64)})
    assert torch.equal(params["a"], torch.zeros(2))  # no partial write


def test_apply_updates_structure_mismatch_names_keys_and_path() -> None:
    params = {"layers": [{"w": torch.ones(1), "b": torch.ones(1)}], "head": torch.ones(1)}
    updates = {"layers": [{"w": torch.ones(1), "bias": torch.ones(1)}], "head": torch.ones(1)}
    with pytest.raises(ValueError, match=r"updates does not have the structure of params \(at "
                                         r"'layers.0': missing key 'b' and unexpected key 'bias' "
                                         r"\(expected keys \['b', 'w'\]\)\)\. Fix: "):
        functopt.apply_updates(params, updates)


def test_structure_mismatch_messages_for_each_kind_of_node() -> None:
    def message(reference: Any, other: Any) -> str:
        return _core._first_difference(reference, other, "<root>")

    assert message({"a": None, "b": None, "c": None}, {"a": 1}) == (
        "at '<root>': missing keys 'b', 'c' (expected keys ['a', 'b', 'c'])")
    assert message({"a": None}, {"a": 1, "z": 2, "y": 3}) == (
        "at '<root>': unexpected keys 'y', 'z' (expected keys ['a'])")
    assert message({"x": [None, None]}, {"x": [1]}) == (
        "at 'x': expected a list of length 2, got a list of length 1")
    assert message((None, None), [1, 2]) == (
        "at '<root>': expected a tuple of length 2, got a list of length 2")

    class Pair(NamedTuple):
        left: Any
        right: Any

    assert message(Pair(None, {"k": None}), Pair(1, {"j": 2})) == (
        "at 'right': missing key 'k' and unexpected key 'j' (expected keys ['k'])")
    assert message({"a": [None]}, {"a": torch.zeros(1)}) == (
        "at 'a': expected a list of length 1, got a float32 tensor of shape (1,)")


def test_apply_updates_shape_mismatch() -> None:
    with pytest.raises(ValueError, match=r"'w': update has shape \(2, 1\) but param has shape "
                                         r"\(2,\)\. Fix: update must have exactly the shape of "
                                         r"param; functopt does not broadcast"):
        functopt.apply_updates({"w": torch.ones(2)}, {"w": torch.ones(2, 1)})


def test_apply_updates_dtype_mismatch() -> None:
    with pytest.raises(TypeError, match=r"'w': float16 update for float32 param\. functopt "
                                        r"never promotes dtypes silently"):
        functopt.apply_updates({"w": torch.ones(2)}, {"w": torch.ones(2, dtype=torch.float16)})


def test_apply_updates_device_mismatch() -> None:
    with pytest.raises(ValueError, match=r"'w': update is on meta but param is on cpu\. Fix: "
                                         r"move them to the same device"):
        functopt.apply_updates({"w": torch.ones(2)}, {"w": torch.ones(2, device="meta")})


def test_apply_updates_non_tensor_leaf() -> None:
    with pytest.raises(TypeError, match=r"updates leaf 'w\.1' is a float; expected a "
                                        r"torch\.Tensor or None\. Fix: convert it with "
                                        r"torch\.as_tensor"):
        functopt.apply_updates({"w": [torch.ones(1), torch.ones(1)]},
                               {"w": [torch.ones(1), 0.5]})
    with pytest.raises(TypeError, match=r"params leaf 'n' is a int; expected a torch\.Tensor"):
        functopt.apply_updates({"n": 3}, {"n": None})


def test_integer_leaves_are_rejected_by_transforms_with_their_path() -> None:
    with pytest.raises(TypeError, match=r"updates leaf 'a\.step' is a int64 tensor of shape "
                                        r"\(\); expected a floating-point tensor\. Fix: "):
        tx = functopt.scale(2.0)
        tx.update({"a": {"step": torch.tensor(3)}}, tx.init(None))
    with pytest.raises(TypeError, match=r"params leaf 'mask' is a bool tensor of shape \(2,\); "
                                        r"expected a floating-point tensor"):
        functopt.scale_by_adam().init({"mask": torch.ones(2, dtype=torch.bool)})
    # apply_updates adds integer updates to integer params (buffers), and refuses a mix.
    out = functopt.apply_updates({"n": torch.tensor(1)}, {"n": torch.tensor(2)})
    assert out["n"].item() == 3 and out["n"].dtype == torch.int64
    with pytest.raises(TypeError, match=r"'n': float32 update for int64 param"):
        functopt.apply_updates({"n": torch.tensor(1)}, {"n": torch.tensor(2.0)})


# --- the protocol --------------------------------------------------------------------------


def test_identity_returns_its_inputs_and_an_empty_state() -> None:
    tx = functopt.identity()
    grads = {"w": torch.ones(2), "n": None}
    state = tx.init({"w": torch.zeros(2), "n": None})
    assert state == functopt.EmptyState()
    updates, new_state = tx.update(grads, state, params=None, loss=1.0)
    assert updates is grads and new_state is state


@settings(max_examples=25)
@given(fst.params_and_gradients(grad_kind="any", allow_none=True))
def test_set_to_zero_gives_zeros_of_each_layout(pg: tuple[Any, Any]) -> None:
    params, grads = pg
    tx = functopt.set_to_zero()
    updates, state = tx.update(grads, tx.init(params), params, unknown_extra=1)
    assert state == functopt.EmptyState()
    for g, u in zip(_core.flatten(grads)[0], _core.flatten(updates)[0], strict=True):
        if g is None:
            assert u is None
        else:
            assert u.dtype == g.dtype and u.shape == g.shape
            assert not bool(u.any()) and not bool(torch.signbit(u).any())


def test_set_to_zero_rejects_non_tensor_leaves() -> None:
    tx = functopt.set_to_zero()
    with pytest.raises(TypeError, match=r"updates leaf '0' is a str"):
        tx.update(["x"], tx.init(None))


def test_stateless_passes_whole_trees_and_params() -> None:
    seen: list[Any] = []

    def f(updates: Any, params: Any) -> Any:
        seen.append(params)
        return {k: v * params[k] for k, v in updates.items()}

    tx = functopt.stateless(f)
    params = {"w": torch.tensor([2.0])}
    updates, state = tx.update({"w": torch.tensor([3.0])}, tx.init(params), params, value=1)
    assert updates["w"].item() == 6.0
    assert seen == [params] and state == functopt.EmptyState()


def test_stateless_with_tree_map_skips_none_and_lines_up_params() -> None:
    calls: list[Any] = []

    def f(g: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
        calls.append(p)
        return g if p is None else g * p

    tx = functopt.stateless_with_tree_map(f)
    grads = {"w": torch.tensor([2.0]), "n": None}
    updates, _ = tx.update(grads, tx.init(None))
    assert updates["n"] is None and calls == [None]
    updates, _ = tx.update(grads, tx.init(None), {"w": torch.tensor([5.0]), "n": torch.ones(1)})
    assert updates["w"].item() == 10.0 and updates["n"] is None
    with pytest.raises(ValueError, match=r"params does not have the structure of updates \(at "
                                         r"'<root>': missing key 'n'"):
        tx.update(grads, tx.init(None), {"w": torch.ones(1)})


def test_with_extra_args_support_wraps_only_when_needed() -> None:
    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return updates, state

    plain = functopt.GradientTransformation(lambda p: (), update)
    wrapped = functopt.with_extra_args_support(plain)
    assert wrapped is not plain and wrapped.init is plain.init
    g = {"w": torch.ones(1)}
    assert wrapped.update(g, (), None, loss=1.0, value=2)[0] is g
    with pytest.raises(TypeError):
        plain.update(g, (), None, loss=1.0)
    adam = functopt.scale_by_adam()
    assert functopt.with_extra_args_support(adam) is adam
    assert _base.accepts_extra_args(adam.update)
    assert not _base.accepts_extra_args(update)
    assert _base.accepts_extra_args(max)  # no signature: assumed to accept (left alone)


def test_gradient_transformation_is_a_pair() -> None:
    tx = functopt.identity()
    init, update = tx
    assert tx._fields == ("init", "update") and init is tx.init and update is tx.update


# --- tree/_core ----------------------------------------------------------------------------


def test_none_is_a_leaf_and_paths_are_dotted() -> None:
    class State(NamedTuple):
        count: Any
        mu: Any

    tree = State(count=torch.zeros(()), mu={"layers": [None, torch.ones(1)]})
    leaves, spec = _core.flatten(tree)
    assert len(leaves) == 3 and leaves[1] is None
    assert _core.paths(spec) == ["count", "mu.layers.0", "mu.layers.1"]
    assert [p for p, _ in _core.leaves_with_path(tree)] == _core.paths(spec)
    assert _core.paths(_core.structure(torch.ones(1))) == ["<root>"]
    rebuilt = _core.unflatten(spec, leaves)
    assert isinstance(rebuilt, State) and rebuilt.mu["layers"][1] is leaves[2]


def test_flatten_like_error_says_how_to_fix() -> None:
    spec = _core.structure({"a": None, "b": None})
    with pytest.raises(ValueError, match=r"state\.mu does not have the structure of updates \(at "
                                         r"'<root>': unexpected key 'c' .*\)\. Fix: build state\.mu"
                                         r" from the same pytree as updates.*pass None \(not a "
                                         r"missing key\)"):
        _core.flatten_like(spec, {"a": 1, "b": 2, "c": 3}, name="state.mu", reference="updates")
    assert _core.flatten_like(spec, {"a": 1, "b": [2, 3]}, name="x", reference="y") == [1, [2, 3]]


def test_transform_state_mismatch_names_the_state_field() -> None:
    tx = functopt.scale_by_adam()
    state = tx.init({"w": torch.zeros(1), "b": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"state\.mu does not have the structure of updates \(at "
                                         r"'<root>': missing key 'b'"):
        tx.update({"w": torch.ones(1), "b": torch.ones(1)}, state._replace(mu={"w": torch.zeros(1)}))


def test_check_like_skips_none_and_can_skip_dtypes() -> None:
    spec = _core.structure([None, None])
    a = [torch.ones(2), None]
    b = [torch.ones(2, dtype=torch.float64), torch.ones(3)]
    _core.check_like(a, b, spec, name="u", reference_name="p", check_dtype=False)
    with pytest.raises(TypeError, match=r"'0': float32 u for float64 p"):
        _core.check_like(a, b, spec, name="u", reference_name="p")


def test_map_leaves_keeps_none() -> None:
    assert _core.map_leaves(lambda x, y: x + y, [1, None], [10, 20]) == [11, None]
