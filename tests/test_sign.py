"""Tests of scale_by_sign (signSGD's transform)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functopt
from functopt.testing import strategies as fst
from functopt.tree import _core


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1).view(torch.uint8)


def _clone(tree: Any) -> Any:
    leaves, spec = _core.flatten(tree)
    return _core.unflatten(spec, [None if x is None else x.clone() for x in leaves])


def _reference_sign(x: torch.Tensor) -> torch.Tensor:
    """jax's sign, elementwise in Python: +-1, and +-0 and NaN returned as they are."""
    out = [1.0 if v > 0 else -1.0 if v < 0 else v for v in x.double().reshape(-1).tolist()]
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape).to(x.dtype)


@given(pg=fst.params_and_gradients(grad_kind="any", allow_none=True),
       with_params=st.booleans())
def test_sign_of_every_element_pure_and_layout_preserving(pg: Any, with_params: bool) -> None:
    params, grads = pg
    tx = functopt.scale_by_sign()
    state = tx.init(params)
    before = _clone(grads)
    updates, new_state = tx.update(grads, state, params if with_params else None, step=3)
    assert new_state == functopt.EmptyState()
    assert fst.same_layout(updates, grads)
    for g, b, u in zip(_core.flatten(grads)[0], _core.flatten(before)[0],
                       _core.flatten(updates)[0], strict=True):
        if g is None:
            assert u is None
            continue
        assert torch.equal(_bits(g), _bits(b))  # input untouched, bit for bit
        assert torch.equal(_bits(u), _bits(_reference_sign(g)))  # NaN and -0.0 included


def test_nan_and_signed_zeros_are_kept() -> None:
    """Unlike torch.sign (NaN -> 0, -0.0 -> 0.0): a NaN gradient must not vanish."""
    g = torch.tensor([float("nan"), -0.0, 0.0, float("-inf"), 3e-40, -2.0])
    u = functopt.scale_by_sign().update({"w": g}, functopt.EmptyState())[0]["w"]
    assert torch.isnan(u[0])
    assert torch.signbit(u[1]) and u[1] == 0
    assert not torch.signbit(u[2]) and u[2] == 0
    assert u[3:].tolist() == [-1.0, 1.0, -1.0]


def test_sign_sgd_step() -> None:
    tx = functopt.chain(functopt.scale_by_sign(), functopt.scale(-0.1))
    params = {"w": torch.tensor([1.0, 1.0, 1.0])}
    u, _ = tx.update({"w": torch.tensor([5.0, -1e-3, 0.0])}, tx.init(params), params)
    assert torch.equal(functopt.apply_updates(params, u)["w"], torch.tensor([0.9, 1.1, 1.0]))


def test_differentiable_almost_everywhere() -> None:
    tx = functopt.scale_by_sign()
    grad = torch.func.grad(lambda g: tx.update([g], functopt.EmptyState())[0][0].sum())(
        torch.tensor([2.0, -3.0]))
    assert torch.equal(grad, torch.zeros(2))


@pytest.mark.parametrize(
    ("updates", "error", "match"),
    [
        ({"w": torch.ones(2, dtype=torch.int32)}, TypeError,
         r"'w' is a int32 tensor .* expected a floating-point tensor"),
        ({"w": [1.0, 2.0]}, TypeError, r"'w.0' is a float; expected a torch.Tensor or None"),
    ],
)
def test_bad_updates(updates: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        functopt.scale_by_sign().update(updates, functopt.EmptyState())
