"""Tests for functopt.partition."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt.testing import bitwise_equal, conformance
from functopt.testing import clone_tree as clone
from functopt.testing import strategies as fst
from functopt.tree import _core

# --------------------------------------------------------------------------- helpers






def recording(log: list[dict[str, Any]]) -> functopt.GradientTransformation:
    """An identity that records what init and update received."""

    def init_fn(params):
        log.append({"init": params})
        return functopt.EmptyState()

    def update_fn(updates, state, params=None, **extra_args):
        log.append({"updates": updates, "params": params, "extra_args": extra_args})
        return updates, state

    return functopt.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------- maths


def test_each_group_gets_its_own_transform_float64():
    params = {"w": torch.randn(3, dtype=torch.float64), "b": torch.randn(2, dtype=torch.float64)}
    tx = functopt.partition(
        {"adam": functopt.scale_by_adam(), "sgd": functopt.scale(-0.5)},
        {"w": "adam", "b": "sgd"},
    )
    adam = functopt.scale_by_adam()
    state = tx.init(params)
    ref_state = adam.init({"w": params["w"]})
    for step in range(4):
        g = {"w": torch.randn(3, dtype=torch.float64), "b": torch.randn(2, dtype=torch.float64)}
        updates, state = tx.update(g, state, params)
        ref_w, ref_state = adam.update({"w": g["w"]}, ref_state)
        assert torch.equal(updates["w"], ref_w["w"]), step
        assert torch.equal(updates["b"], -0.5 * g["b"]), step
    assert list(updates) == ["w", "b"]  # the updates keep the params' key order
    assert torch.equal(state.inner_states["adam"].count, torch.tensor(4, dtype=torch.int32))


def test_inner_state_holds_tensors_only_for_its_leaves():
    params = {"w": torch.ones(3), "b": torch.ones(2), "frozen": None}
    tx = functopt.partition(
        {"a": functopt.scale_by_adam(), "b": functopt.scale_by_adam()},
        {"w": "a", "b": "b", "frozen": "a"},
    )
    state = tx.init(params)
    assert isinstance(state, functopt.PartitionState)
    mu_a = state.inner_states["a"].mu
    mu_b = state.inner_states["b"].mu
    assert mu_a["b"] is None and mu_a["frozen"] is None and mu_a["w"].shape == (3,)
    assert mu_b["w"] is None and mu_b["frozen"] is None and mu_b["b"].shape == (2,)
    # The other group's leaves stay None through updates too.
    _, state = tx.update({"w": torch.ones(3), "b": torch.ones(2), "frozen": None}, state)
    assert state.inner_states["a"].mu["b"] is None
    assert state.inner_states["b"].nu["w"] is None


def test_inner_transforms_see_masked_updates_params_and_extra_args():
    log_a: list[dict[str, Any]] = []
    log_b: list[dict[str, Any]] = []
    params = {"x": torch.zeros(1), "y": torch.zeros(2)}
    tx = functopt.partition({"a": recording(log_a), "b": recording(log_b)}, {"x": "a", "y": "b"})
    state = tx.init(params)
    assert log_a[0]["init"]["y"] is None and log_a[0]["init"]["x"] is params["x"]
    assert log_b[0]["init"]["x"] is None and log_b[0]["init"]["y"] is params["y"]
    g = {"x": torch.ones(1), "y": torch.ones(2)}
    tx.update(g, state, params, loss=torch.tensor(3.0))
    upd_a = log_a[1]
    assert upd_a["updates"]["x"] is g["x"] and upd_a["updates"]["y"] is None
    assert upd_a["params"]["x"] is params["x"] and upd_a["params"]["y"] is None
    assert float(upd_a["extra_args"]["loss"]) == 3.0
    assert log_b[1]["updates"]["x"] is None and log_b[1]["updates"]["y"] is g["y"]
    tx.update(g, state)  # without params, the inner transforms get None
    assert log_a[2]["params"] is None


def test_transform_without_extra_args_support_is_wrapped():
    def update_fn(updates, state, params=None):  # no **extra_args
        return updates, state

    plain = functopt.GradientTransformation(lambda p: (), update_fn)
    tx = functopt.partition({"a": plain}, "a")
    updates, _ = tx.update({"w": torch.ones(1)}, tx.init({"w": torch.ones(1)}), lr=0.1)
    assert torch.equal(updates["w"], torch.ones(1))


def test_prefix_labels_label_whole_subtrees():
    generator = {"w": torch.ones(2), "b": torch.ones(1)}
    discriminator = [torch.ones(3), None]
    params = (generator, discriminator)
    tx = functopt.partition(
        {"gen": functopt.scale(2.0), "disc": functopt.scale(-1.0)}, ("gen", "disc")
    )
    state = tx.init(params)
    grads = ({"w": torch.ones(2), "b": torch.ones(1)}, [torch.ones(3), None])
    updates, _ = tx.update(grads, state)
    assert torch.equal(updates[0]["w"], torch.full((2,), 2.0))
    assert torch.equal(updates[0]["b"], torch.full((1,), 2.0))
    assert torch.equal(updates[1][0], torch.full((3,), -1.0))
    assert updates[1][1] is None
    # A single label at the root labels everything.
    tx = functopt.partition({"all": functopt.scale(3.0)}, "all")
    updates, _ = tx.update(grads, tx.init(params))
    assert torch.equal(updates[1][0], torch.full((3,), 3.0))


def test_callable_labels_get_params_at_init_and_updates_at_update():
    seen: list[Any] = []

    def label_fn(tree):
        seen.append(tree)
        return {k: ("decay" if k.endswith("weight") else "plain") for k in tree}

    params = {"fc.weight": torch.ones(2), "fc.bias": torch.ones(1)}
    tx = functopt.partition({"decay": functopt.scale(0.0), "plain": functopt.identity()}, label_fn)
    state = tx.init(params)
    assert seen[0] is params
    grads = {"fc.weight": torch.ones(2), "fc.bias": torch.ones(1)}
    updates, _ = tx.update(grads, state, params)
    assert seen[1] is grads
    assert torch.equal(updates["fc.weight"], torch.zeros(2))
    assert torch.equal(updates["fc.bias"], torch.ones(1))


def test_unused_transform_is_allowed_and_still_updated():
    params = {"w": torch.ones(2)}
    tx = functopt.partition(
        {"used": functopt.scale(-1.0), "unused": functopt.scale_by_adam()}, {"w": "used"}
    )
    state = tx.init(params)
    assert state.inner_states["unused"].mu == {"w": None}
    updates, state = tx.update({"w": torch.ones(2)}, state)
    assert torch.equal(updates["w"], -torch.ones(2))
    assert int(state.inner_states["unused"].count) == 1


def test_fixed_labels_follow_a_change_of_tree_structure():
    # The cached label layout must not leak to a call with another structure.
    tx = functopt.partition({"a": functopt.scale(2.0), "b": functopt.scale(3.0)}, ("a", "b"))
    p1 = (torch.ones(1), torch.ones(1))
    u1, _ = tx.update(p1, tx.init(p1))
    p2 = ({"x": torch.ones(1), "y": torch.ones(1)}, torch.ones(1))
    u2, _ = tx.update(p2, tx.init(p2))
    assert float(u1[1]) == 3.0 and float(u2[0]["y"]) == 2.0 and float(u2[1]) == 3.0


def test_none_label_is_accepted_where_the_leaf_is_none():
    import optree

    # optree.tree_map skips None by default and keeps it in place: a None label results.
    def label_fn(tree):
        return optree.tree_map(lambda x: "a", tree)

    params = {"w": torch.ones(2), "frozen": None}
    tx = functopt.partition({"a": functopt.scale_by_adam()}, label_fn)
    state = tx.init(params)
    assert state.inner_states["a"].mu["frozen"] is None
    updates, _ = tx.update({"w": torch.ones(2), "frozen": None}, state, params)
    assert updates["frozen"] is None and updates["w"].shape == (2,)
    # With the update at w missing, its label is None too: the leaf passes through as None.
    updates, _ = tx.update({"w": None, "frozen": None}, state, params)
    assert updates == {"w": None, "frozen": None}


def test_error_none_label_at_a_tensor_even_after_caching():
    tx = functopt.partition({"a": functopt.scale(2.0)}, {"w": "a", "g": None})
    state = tx.init({"w": torch.ones(1), "g": None})
    updates, _ = tx.update({"w": torch.ones(1), "g": None}, state)  # fills the cache
    assert updates["g"] is None
    with pytest.raises(ValueError, match=r"leaf 'g' of the updates is a float32 tensor .* label None"):
        tx.update({"w": torch.ones(1), "g": torch.ones(1)}, state)
    with pytest.raises(ValueError, match=r"leaf 'g' of the params .* Fix: give it one of the labels \['a'\]"):
        tx.init({"w": torch.ones(1), "g": torch.ones(1)})


# --------------------------------------------------------------------------- properties


@st.composite
def labelled(draw: st.DrawFn, grad_kind: fst.ValueKind) -> tuple[Any, Any, list[str]]:
    params, grads = draw(fst.params_and_gradients(grad_kind=grad_kind, allow_none=True))
    n = _core.structure(params).num_leaves
    labels = draw(st.lists(st.sampled_from(["adam", "sgd"]), min_size=n, max_size=n))
    return params, grads, labels


@settings(max_examples=25)
@given(labelled("any"))
def test_property_matches_separate_runs_and_is_pure(case):
    params, grads, flat_labels = case
    spec = _core.structure(params)
    labels = _core.unflatten(spec, flat_labels)
    tx = functopt.partition(
        {"adam": functopt.scale_by_adam(), "sgd": functopt.scale(-2.0)}, labels
    )
    state = tx.init(params)
    params_before, grads_before, state_before = clone(params), clone(grads), clone(state)
    updates, new_state = tx.update(grads, state, params)

    # Inputs untouched, bitwise.
    assert bitwise_equal(params, params_before)
    assert bitwise_equal(grads, grads_before)
    assert bitwise_equal(state, state_before)
    # Layout preserved: the structure, and each leaf's dtype and shape (None stays None).
    assert fst.same_layout(updates, grads)

    # Adam's leaves: what scale_by_adam gives on a flat dict of just those leaves.
    p_leaves, _ = _core.flatten(params)
    g_leaves, _ = _core.flatten(grads)
    u_leaves, _ = _core.flatten(updates)
    adam_idx = [i for i, label in enumerate(flat_labels) if label == "adam"]
    adam = functopt.scale_by_adam()
    sub_params = {str(i): p_leaves[i] for i in adam_idx}
    sub_grads = {str(i): g_leaves[i] for i in adam_idx}
    ref, _ = adam.update(sub_grads, adam.init(sub_params))
    for i in adam_idx:
        assert bitwise_equal(u_leaves[i], ref[str(i)])
    for i, label in enumerate(flat_labels):
        if label == "sgd" and g_leaves[i] is not None:
            assert bitwise_equal(u_leaves[i], g_leaves[i] * -2.0)
    assert int(new_state.inner_states["adam"].count) == 1


# --------------------------------------------------------------------------- errors


def test_error_label_without_transform_names_the_leaf():
    tx = functopt.partition({"adam": functopt.scale(1.0)}, {"layer": {"w": "adam", "b": "adma"}})
    with pytest.raises(ValueError, match=r"leaf 'layer.b' has label 'adma'.*keys: \['adam'\]"):
        tx.init({"layer": {"w": torch.ones(1), "b": torch.ones(1)}})


def test_error_label_without_transform_from_callable_at_update():
    calls = []

    def label_fn(tree):
        calls.append(1)
        return "a" if len(calls) == 1 else "b"

    tx = functopt.partition({"a": functopt.identity()}, label_fn)
    state = tx.init([torch.ones(1)])
    with pytest.raises(ValueError, match=r"leaf '0' has label 'b'"):
        tx.update([torch.ones(1)], state)


def test_error_labels_do_not_line_up_with_params():
    tx = functopt.partition({"a": functopt.identity()}, {"w": "a", "b": "a"})
    with pytest.raises(ValueError, match=r"param_labels does not line up with the params.*'<root>'"):
        tx.init({"w": torch.ones(1), "bias": torch.ones(1)})
    tx = functopt.partition({"a": functopt.identity()}, {"layer": ["a", "a"]})
    with pytest.raises(ValueError, match=r"line up with the updates.*'layer'.*list of length 2"):
        tx.update({"layer": [torch.ones(1)]}, functopt.PartitionState({"a": ()}))


def test_error_unhashable_label():
    tx = functopt.partition({"a": functopt.identity()}, lambda tree: {"w": {"a"}})
    with pytest.raises(ValueError, match=r"leaf 'w' has label set"):
        tx.init({"w": torch.ones(1)})


def test_error_transforms_not_a_mapping():
    with pytest.raises(TypeError, match=r"transforms must be a mapping.*got list"):
        functopt.partition([functopt.identity()], "a")


def test_error_transform_value_is_a_factory():
    with pytest.raises(TypeError, match=r"transforms\['a'\] must be a functopt.Gradient.*factory"):
        functopt.partition({"a": functopt.scale_by_adam}, "a")


def test_error_wrong_state():
    tx = functopt.partition({"a": functopt.identity(), "b": functopt.identity()}, "a")
    with pytest.raises(TypeError, match=r"partition: state must be the PartitionState .* got a tuple of 0"):
        tx.update({"w": torch.ones(1)}, ())
    with pytest.raises(ValueError, match=r"got inner states for \['a'\]"):
        tx.update({"w": torch.ones(1)}, functopt.PartitionState({"a": ()}))


def test_error_inner_transform_returns_another_structure():
    bad = functopt.GradientTransformation(
        lambda p: (), lambda u, s, p=None, **kw: ([torch.ones(1)], s)
    )
    tx = functopt.partition({"a": bad}, "a")
    with pytest.raises(ValueError, match=r"updates returned by transforms\['a'\] does not have"):
        tx.update({"w": torch.ones(1)}, tx.init({"w": torch.ones(1)}))


# --------------------------------------------------------------------------- conformance


def _alternate_labels(tree: Any) -> Any:
    spec = _core.structure(tree)
    return _core.unflatten(spec, ["adam" if i % 2 else "sgd" for i in range(spec.num_leaves)])


test_conformance = conformance.conformance_test(
    lambda: functopt.partition(
        {"adam": functopt.scale_by_adam(), "sgd": functopt.scale(-1.0)}, _alternate_labels
    ),
    max_examples=10,
)
