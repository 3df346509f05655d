"""Tests of scale_by_trust_ratio (the layer-wise scaling of LARS and LAMB)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt.testing import strategies as fst
from functopt.tree import _core


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1).view(torch.uint8)


def _clone(tree: Any) -> Any:
    leaves, spec = _core.flatten(tree)
    return _core.unflatten(spec, [None if x is None else x.clone() for x in leaves])


def _reference(u: torch.Tensor, p: torch.Tensor, min_norm: float, trust_coefficient: float,
               eps: float) -> torch.Tensor:
    """optax's rule, in float64 with Python floats for the norms."""
    def norm(x: torch.Tensor) -> float:
        values = x.double().reshape(-1).tolist()
        # torch.linalg.vector_norm returns |x| for a one-element tensor (no squaring, so no
        # underflow of a subnormal); longer tensors are summed as squares.
        n = abs(values[0]) if len(values) == 1 else math.sqrt(sum(v * v for v in values))
        return min_norm if n <= min_norm else n

    p_norm, u_norm = norm(p), norm(u)
    if p_norm == 0 or u_norm == 0:
        ratio = 1.0
    else:
        ratio = trust_coefficient * p_norm / (u_norm + eps) if u_norm + eps != 0 else math.inf
    return u.double() * ratio


_hypers = st.fixed_dictionaries({
    "min_norm": st.sampled_from([0.0, 1e-3, 1.0]),
    "trust_coefficient": st.sampled_from([1.0, 0.001, -2.0]),
    "eps": st.sampled_from([0.0, 1e-8, 1.0]),
})


@given(pg=fst.params_and_gradients(grad_kind="any", allow_none=True), h=_hypers)
def test_pure_and_layout_preserving(pg: Any, h: dict[str, float]) -> None:
    params, grads = pg
    tx = functopt.scale_by_trust_ratio(**h)
    state = tx.init(params)
    grads_before, params_before = _clone(grads), _clone(params)
    updates, new_state = tx.update(grads, state, params, value=1.0)
    assert new_state == functopt.EmptyState()
    assert fst.same_layout(updates, grads)
    for a, b in ((grads, grads_before), (params, params_before)):
        for x, y in zip(_core.flatten(a)[0], _core.flatten(b)[0], strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                assert torch.equal(_bits(x), _bits(y))


@settings(max_examples=40)
@given(pg=fst.params_and_gradients(dtypes=(torch.float64,), param_kind="finite",
                                   grad_kind="finite", allow_none=True),
       h=_hypers)
def test_matches_float64_reference(pg: Any, h: dict[str, float]) -> None:
    params, grads = pg
    tx = functopt.scale_by_trust_ratio(**h)
    updates, _ = tx.update(grads, tx.init(params), params)
    for g, p, u in zip(_core.flatten(grads)[0], _core.flatten(params)[0],
                       _core.flatten(updates)[0], strict=True):
        if g is None:
            assert u is None
            continue
        torch.testing.assert_close(u, _reference(g, p, **h), rtol=1e-12, atol=1e-300,
                                   equal_nan=True)


@settings(max_examples=15)
@given(pg=fst.params_and_gradients(dtypes=(torch.float16, torch.bfloat16, torch.float32),
                                   grad_kind="typical"))
def test_low_precision_is_the_rounded_wide_result(pg: Any) -> None:
    params, grads = pg
    tx = functopt.scale_by_trust_ratio()
    updates, _ = tx.update(grads, tx.init(params), params)
    for g, p, u in zip(_core.flatten(grads)[0], _core.flatten(params)[0],
                       _core.flatten(updates)[0], strict=True):
        assert u.dtype == g.dtype
        want = _reference(g, p, 0.0, 1.0, 0.0).to(g.dtype).double()
        tol = 2 * torch.finfo(g.dtype).eps
        torch.testing.assert_close(u.double(), want, rtol=tol, atol=0.0)


def test_float16_norms_do_not_overflow() -> None:
    """||(300, 300)||**2 = 180,000 > float16 max: the norms are taken in float32."""
    p = {"w": torch.tensor([300.0, 300.0], dtype=torch.float16)}
    g = {"w": torch.tensor([3.0, 4.0], dtype=torch.float16)}
    tx = functopt.scale_by_trust_ratio()
    u, _ = tx.update(g, tx.init(p), p)
    want = torch.tensor([3.0, 4.0]) * (300 * math.sqrt(2) / 5)
    torch.testing.assert_close(u["w"].float(), want, rtol=1e-3, atol=0)


def test_zero_norms_leave_the_update_alone() -> None:
    tx = functopt.scale_by_trust_ratio(trust_coefficient=0.5)
    params = {"zero_param": torch.zeros(2), "zero_update": torch.ones(2), "both": torch.ones(2)}
    grads = {"zero_param": torch.tensor([1.0, 2.0]), "zero_update": torch.zeros(2),
             "both": torch.tensor([0.0, 2.0])}
    u, _ = tx.update(grads, tx.init(params), params)
    assert torch.equal(u["zero_param"], grads["zero_param"])
    assert torch.equal(u["zero_update"], torch.zeros(2))
    # 0.5 * sqrt(2) / 2
    torch.testing.assert_close(u["both"], torch.tensor([0.0, 2.0]) * 0.5 * math.sqrt(2) / 2)


def test_min_norm_floors_both_norms() -> None:
    tx = functopt.scale_by_trust_ratio(min_norm=1.0)
    params = {"w": torch.tensor([0.0, 0.1])}
    u, _ = tx.update({"w": torch.tensor([0.0, 4.0])}, tx.init(params), params)
    torch.testing.assert_close(u["w"], torch.tensor([0.0, 1.0]))  # 4 * max(0.1, 1) / 4


def test_tensor_hyperparameters_and_gradients() -> None:
    """0-d tensor hyperparameters work, and gradients through a zero update stay finite."""
    coefficient = torch.tensor(0.01, dtype=torch.float64)
    tx = functopt.scale_by_trust_ratio(torch.tensor(0.0), coefficient, torch.tensor(1e-9))
    params = {"a": torch.ones(3, dtype=torch.float64), "b": torch.ones(2, dtype=torch.float64)}

    def f(c: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        t = functopt.scale_by_trust_ratio(trust_coefficient=c)
        u, _ = t.update({"a": g, "b": torch.zeros(2, dtype=torch.float64)}, t.init(params),
                        params)
        return u["a"].sum() + u["b"].sum()

    g = torch.tensor([1.0, 2.0, 2.0], dtype=torch.float64)
    d_c, d_g = torch.func.grad(f, argnums=(0, 1))(coefficient, g)
    torch.testing.assert_close(d_c, torch.tensor(math.sqrt(3) / 3 * 5, dtype=torch.float64))
    assert torch.isfinite(d_g).all()
    u, _ = tx.update({"a": g, "b": torch.zeros(2, dtype=torch.float64)}, tx.init(params), params)
    torch.testing.assert_close(u["a"], g * 0.01 * math.sqrt(3) / (3 + 1e-9))


def test_lamb_like_chain_runs_end_to_end() -> None:
    torch.manual_seed(0)
    tx = functopt.chain(functopt.scale_by_adam(), functopt.scale_by_trust_ratio(),
                        functopt.scale(-0.01))
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    state = tx.init(params)
    for _ in range(3):
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        u, state = tx.update(grads, state, params)
        for k in params:  # each leaf moves by exactly 1% of its norm
            torch.testing.assert_close(torch.linalg.vector_norm(u[k]),
                                       0.01 * torch.linalg.vector_norm(params[k]))
        params = functopt.apply_updates(params, u)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"min_norm": -1.0}, ValueError, r"scale_by_trust_ratio: min_norm must be in \[0, inf\)"),
        ({"eps": -1e-3}, ValueError, r"eps must be in \[0, inf\), got -0.001"),
        ({"trust_coefficient": "1"}, TypeError, "trust_coefficient must be a number"),
        ({"trust_coefficient": torch.ones(3)}, TypeError, "must be a number or a 0-d tensor"),
    ],
)
def test_bad_hyperparameters(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        functopt.scale_by_trust_ratio(**kwargs)


def test_needs_params() -> None:
    tx = functopt.scale_by_trust_ratio()
    with pytest.raises(ValueError, match=r"scale_by_trust_ratio reads the params.*update\("):
        tx.update({"w": torch.ones(1)}, tx.init(None))


def test_update_for_a_none_param() -> None:
    tx = functopt.scale_by_trust_ratio()
    with pytest.raises(ValueError, match=r"'b' has an update but its param is None"):
        tx.update({"a": torch.ones(1), "b": torch.ones(1)}, tx.init(None),
                  {"a": torch.ones(1), "b": None})


def test_param_of_another_shape() -> None:
    tx = functopt.scale_by_trust_ratio()
    with pytest.raises(ValueError, match=r"'w': update has shape \(2,\) but param has shape"):
        tx.update({"w": torch.ones(2)}, tx.init(None), {"w": torch.ones(3)})
