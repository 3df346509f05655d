"""masked: equal to the inner transform run on the masked leaves alone; everything else passes
through as the same tensor objects and gets no inner state."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt.testing import assert_bitwise_equal, clone_tree
from functopt.testing import strategies as fst


def _leaves(tree: Any) -> list[Any]:
    return functopt.tree.flatten(tree)[0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)




def _assert_same(a: Any, b: Any) -> None:
    assert (a is None) == (b is None)
    if a is not None:
        assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _inner() -> functopt.GradientTransformation:
    # Stateful, and with a reduction over all its leaves: a masked-out leaf that leaked into
    # the inner transform would change the norm of the others.
    return functopt.chain(functopt.clip_by_global_norm(1.0), functopt.trace(0.5))


@settings(max_examples=20)
@given(st.data())
def test_masked_equals_inner_on_the_masked_subset(data) -> None:
    params, grads1 = data.draw(fst.params_and_gradients(allow_none=True))
    grads2 = data.draw(fst.gradients_like(params, allow_none=True))
    p_leaves, treespec = functopt.tree.flatten(params)
    keep = [data.draw(st.booleans()) for _ in p_leaves]
    mask = functopt.tree.unflatten(treespec, keep)

    tx = functopt.masked(_inner(), mask)
    state = tx.init(params)
    # The reference: the inner transform alone, on a tree holding only the masked leaves
    # (keys zero-padded so that they flatten in the original order).
    def sub(tree: Any) -> dict[str, Any]:
        pairs = zip(_leaves(tree), keep, strict=True)
        return {f"{i:03d}": x for i, (x, m) in enumerate(pairs) if m}

    ref_tx = _inner()
    ref_state = ref_tx.init(sub(params))

    for grads in (grads1, grads2):
        before = (clone_tree(grads), clone_tree(params))
        out, state = tx.update(grads, state, params)
        assert_bitwise_equal(grads, before[0], what="input")
        assert_bitwise_equal(params, before[1], what="input")
        assert fst.same_layout(out, grads)
        ref_out, ref_state = ref_tx.update(sub(grads), ref_state, sub(params))
        for i, (g, o, m) in enumerate(zip(_leaves(grads), _leaves(out), keep, strict=True)):
            if m:
                _assert_same(o, ref_out[f"{i:03d}"])
            else:
                assert o is g  # passed through: the very same object

    # No inner state for the leaves the mask leaves out.
    traces = _leaves(state.inner_state[1].trace)
    for t, m, p in zip(traces, keep, p_leaves, strict=True):
        assert (t is None) == (not m)
        if m:
            assert t.shape == p.shape and t.dtype == p.dtype
    for t, r in zip([t for t in traces if t is not None], _leaves(ref_state[1].trace), strict=True):
        _assert_same(t, r)


def test_prefix_masks_cover_whole_subtrees() -> None:
    params = {"encoder": {"w": torch.ones(2), "b": torch.ones(1)}, "head": [torch.ones(3)]}
    grads = {"encoder": {"w": torch.ones(2), "b": torch.ones(1)}, "head": [torch.ones(3)]}
    tx = functopt.masked(functopt.scale(-2.0), {"encoder": False, "head": True})
    out, state = tx.update(grads, tx.init(params), params)
    assert out["encoder"]["w"] is grads["encoder"]["w"] and out["encoder"]["b"] is grads["encoder"]["b"]
    assert torch.equal(out["head"][0], torch.full((3,), -2.0))
    assert isinstance(state, functopt.MaskedState)

    everything = functopt.masked(functopt.scale(-2.0), True)
    nothing = functopt.masked(functopt.scale(-2.0), False)
    all_out = everything.update(grads, everything.init(params), params)[0]
    none_out = nothing.update(grads, nothing.init(params), params)[0]
    assert all(torch.equal(x, -2 * torch.ones_like(x)) for x in _leaves(all_out))
    assert all(a is b for a, b in zip(_leaves(none_out), _leaves(grads), strict=True))


@pytest.mark.parametrize("keep", [True, False])
def test_a_bare_tensor_tree_can_be_masked_in_or_out(keep) -> None:
    # With a one-tensor tree, masking the only leaf out hands the inner transform None for
    # the whole updates and params trees.
    param, grad = torch.ones(2), torch.full((2,), 3.0)
    tx = functopt.masked(functopt.add_decayed_weights(0.5), keep)
    out, state = tx.update(grad, tx.init(param), param)
    if keep:
        assert torch.equal(out, torch.full((2,), 3.5))
    else:
        assert out is grad
    assert state == functopt.MaskedState(inner_state=functopt.EmptyState())


def test_callable_mask_is_called_on_the_params_or_else_the_updates() -> None:
    seen = []

    def mask_fn(tree):
        seen.append(tree)
        return {k: v.dim() > 1 for k, v in tree.items()}

    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    grads = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    tx = functopt.masked(functopt.scale(0.5), mask_fn)
    state = tx.init(params)
    out, state = tx.update(grads, state, params)
    assert seen == [params, params]
    assert torch.equal(out["w"], torch.full((2, 2), 0.5)) and out["b"] is grads["b"]
    tx.update(grads, state)  # no params: the mask function gets the updates
    assert seen[-1] is grads


def test_frozen_leaves_get_none_state_in_the_inner_transform() -> None:
    params = {"w": torch.ones(3), "frozen": torch.ones(2)}
    tx = functopt.masked(functopt.scale_by_adam(), {"w": True, "frozen": False})
    state = tx.init(params)
    assert state.inner_state.mu["frozen"] is None and state.inner_state.nu["frozen"] is None
    assert state.inner_state.mu["w"].shape == (3,)
    out, state = tx.update({"w": torch.ones(3), "frozen": torch.full((2,), 7.0)}, state, params)
    assert torch.equal(out["frozen"], torch.full((2,), 7.0))
    assert state.inner_state.mu["frozen"] is None


def _recording(seen: dict[str, Any]) -> functopt.GradientTransformation:
    def update(updates, state, params=None, **extra_args):
        seen.update(extra_args, params=params)
        return updates, state

    return functopt.GradientTransformation(lambda p: functopt.EmptyState(), update)


def test_extra_args_are_passed_and_masked_only_when_asked() -> None:
    grads = {"a": torch.ones(1), "b": torch.ones(1)}
    tags = {"a": torch.zeros(1), "b": torch.ones(1)}
    mask = {"a": True, "b": False}
    for compatible in (False, True):
        seen: dict[str, Any] = {}
        tx = functopt.masked(_recording(seen), mask, mask_compatible_extra_args=compatible)
        tx.update(grads, tx.init(grads), grads, tags=tags, loss=torch.tensor(2.0))
        assert seen["loss"].item() == 2.0
        assert seen["params"]["b"] is None and seen["params"]["a"] is grads["a"]
        assert seen["tags"]["a"] is tags["a"]
        assert (seen["tags"]["b"] is None) == compatible


def test_inner_without_extra_args_support_is_wrapped() -> None:
    inner = functopt.GradientTransformation(
        lambda p: functopt.EmptyState(),
        lambda updates, state, params=None: ({k: 2 * v for k, v in updates.items()}, state),
    )
    tx = functopt.masked(inner, {"a": True})
    out = tx.update({"a": torch.ones(1)}, tx.init({"a": torch.ones(1)}), value=3.0)[0]
    assert out["a"].item() == 2.0


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        ({"w": torch.tensor(True), "b": False}, TypeError,
         r"masked: mask leaf 'w' is a bool tensor of shape \(\); expected True or False"),
        ({"w": None, "b": False}, TypeError, r"mask leaf 'w' is None; expected True or False"),
        ({"w": 1, "b": False}, TypeError, r"mask leaf 'w' is a int; expected True or False"),
    ],
)
def test_non_bool_mask_leaves_are_rejected_by_path(mask, error, match) -> None:
    with pytest.raises(error, match=match):
        functopt.masked(functopt.scale(1.0), mask)


def test_mask_that_is_not_a_prefix_names_where_it_differs() -> None:
    params = {"layer": {"w": torch.ones(1), "b": torch.ones(1)}}
    tx = functopt.masked(functopt.scale(1.0), {"layer": {"w": True, "bias": False}})
    with pytest.raises(ValueError, match=r"mask must have the structure of the params, or of a "
                                         r"prefix of it; it differs at 'layer'"):
        tx.init(params)


def test_callable_mask_returning_a_bad_tree_is_reported() -> None:
    tx = functopt.masked(functopt.scale(1.0), lambda p: [True, False])
    with pytest.raises(ValueError, match=r"mask must have the structure of the params"):
        tx.init({"w": torch.ones(1)})
    tx = functopt.masked(functopt.scale(1.0), lambda p: {k: v.sum() > 0 for k, v in p.items()})
    with pytest.raises(TypeError, match=r"mask leaf 'w' is a bool tensor"):
        tx.init({"w": torch.ones(1)})


def test_masked_rejects_a_non_transform_and_a_foreign_state() -> None:
    with pytest.raises(TypeError, match=r"masked: inner must be a functopt.GradientTransformation, got function"):
        functopt.masked(functopt.scale, True)
    tx = functopt.masked(functopt.scale(1.0), True)
    with pytest.raises(TypeError, match=r"state must be the MaskedState .* got EmptyState"):
        tx.update({"w": torch.ones(1)}, functopt.EmptyState())
