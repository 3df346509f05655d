"""Tests of scale_by_factored_rms (Adafactor's second-moment estimator)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopt
from functopt.testing import strategies as fst
from functopt.transforms.factored import _factored_dims
from functopt.tree import _core


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1).view(torch.uint8)


def _clone(tree: Any) -> Any:
    leaves, spec = _core.flatten(tree)
    return _core.unflatten(spec, [None if x is None else x.clone() for x in leaves])


def _optax_dims(shape: tuple[int, ...], factored: bool, min_size: int) -> tuple[int, int] | None:
    """optax's rule, with numpy's argsort made stable.

    optax calls ``np.argsort(shape)`` with numpy's default (not stable) sort, so which of two
    equal sides is "largest" can depend on the numpy build for some shapes of 3+ dims (it
    gives (1, 0) for (1, 1, 0, 0) here). Only the state's layout depends on it: with equal
    sides the estimate R C / mean(R) is symmetric. functopt fixes it: lower index first.
    """
    if not factored or len(shape) < 2:
        return None
    order = np.argsort(shape, kind="stable")
    if shape[order[-2]] < min_size:
        return None
    return int(order[-2]), int(order[-1])


def _beta(step: int, exponent: float) -> float:
    """Adafactor's decay for a step, rounded through float32 like optax's schedule."""
    t = torch.tensor(step + 1, dtype=torch.float32)
    return float(1.0 - t ** (-exponent))


def _reference(h: dict[str, Any], shape: tuple[int, ...], grads: list[Any],
               dims: Any = "optax"):
    """Shazeer & Stern's estimate, written with the two factored dims moved last.

    Returns the updates and the final statistics: ``("full", V)`` or ``("factored", R, C)``
    with R over the second-largest dim and C over the largest, both in the moved layout.
    """
    if dims == "optax":
        dims = _optax_dims(shape, h["factored"], h["min_dim_size_to_factor"])
    eps, offset = h["epsilon"], h["step_offset"]
    out: list[Any] = []
    if dims is None:
        v = torch.zeros(shape, dtype=torch.float64)
        for t, g in enumerate(grads):
            if g is None:
                out.append(None)
                continue
            beta = _beta(t - offset, h["decay_rate"])
            v = beta * v + (1 - beta) * (g * g + eps)
            out.append(g / torch.sqrt(v))
        return out, ("full", v)
    d1, d0 = dims
    moved = (*[s for i, s in enumerate(shape) if i not in dims], shape[d1], shape[d0])
    r = torch.zeros(moved[:-1], dtype=torch.float64)
    c = torch.zeros(moved[:-2] + moved[-1:], dtype=torch.float64)
    for t, g in enumerate(grads):
        if g is None:
            out.append(None)
            continue
        beta = _beta(t - offset, h["decay_rate"])
        sq = torch.movedim(g, (d1, d0), (-2, -1)) ** 2 + eps
        r = beta * r + (1 - beta) * sq.mean(-1)
        c = beta * c + (1 - beta) * sq.mean(-2)
        v_hat = r[..., :, None] * c[..., None, :] / r.mean(-1)[..., None, None]
        u = torch.movedim(g, (d1, d0), (-2, -1)) / torch.sqrt(v_hat)
        out.append(torch.movedim(u, (-2, -1), (d1, d0)))
    return out, ("factored", r, c)


def _state_in_reference_layout(state: Any, i: int, shape: tuple[int, ...], dims: Any):
    rows, cols, fulls = (_core.flatten(getattr(state, f))[0] for f in ("v_row", "v_col", "v"))
    if dims is None:
        return ("full", fulls[i])
    d1, d0 = dims
    row = torch.movedim(rows[i], d1 - (d1 > d0), -1)
    col = torch.movedim(cols[i], d0 - (d0 > d1), -1)
    return ("factored", row, col)


_hypers = st.fixed_dictionaries({
    "factored": st.booleans(),
    "decay_rate": st.sampled_from([0.8, 0.5, 0.0]),
    "step_offset": st.sampled_from([0, -3]),
    "min_dim_size_to_factor": st.sampled_from([0, 1, 2, 3, 128]),
    "epsilon": st.sampled_from([1e-30, 1e-3, 0.0]),
})


# ----------------------------------------------------------------- which dims are factored


@settings(max_examples=60)
@given(shape=fst.shapes(max_dims=5, max_side=6), factored=st.booleans(),
       min_size=st.integers(0, 7))
def test_factored_dims_follow_optax_rule(shape: tuple[int, ...], factored: bool,
                                         min_size: int) -> None:
    assert _factored_dims(shape, factored, min_size) == _optax_dims(shape, factored, min_size)


@pytest.mark.parametrize(
    ("shape", "dims", "row_shape", "col_shape"),
    [
        ((128, 128), (0, 1), (128,), (128,)),  # ties: lower index is the "second largest"
        ((256, 128), (1, 0), (128,), (256,)),
        ((3, 200, 150), (2, 1), (3, 150), (3, 200)),  # extra dims are a batch
        ((130, 4, 129), (2, 0), (4, 129), (130, 4)),
        ((127, 512), None, (1,), (1,)),  # second largest side below 128
        ((4096,), None, (1,), (1,)),
        ((), None, (1,), (1,)),
    ],
)
def test_state_layout_for_default_min_size(shape: tuple[int, ...], dims: Any,
                                           row_shape: tuple[int, ...],
                                           col_shape: tuple[int, ...]) -> None:
    assert _factored_dims(shape, True, 128) == dims
    state = functopt.scale_by_factored_rms().init({"w": torch.zeros(shape, dtype=torch.bfloat16)})
    assert tuple(state.v_row["w"].shape) == row_shape
    assert tuple(state.v_col["w"].shape) == col_shape
    assert tuple(state.v["w"].shape) == ((1,) if dims else shape)
    for field in (state.v_row, state.v_col, state.v):
        assert field["w"].dtype == torch.bfloat16  # state in the param's dtype, as optax


def test_tie_break_does_not_change_the_update() -> None:
    """With two equal largest sides, swapping their roles gives the same estimate."""
    torch.manual_seed(0)
    h = {"factored": True, "decay_rate": 0.8, "step_offset": 0, "min_dim_size_to_factor": 2,
         "epsilon": 1e-30}
    grads = [torch.randn(3, 4, 2, 4, dtype=torch.float64) for _ in range(3)]
    tx = functopt.scale_by_factored_rms(min_dim_size_to_factor=2)
    params = {"w": torch.zeros(3, 4, 2, 4, dtype=torch.float64)}
    state = tx.init(params)
    ours = []
    for g in grads:
        u, state = tx.update({"w": g}, state)
        ours.append(u["w"])
    swapped, _ = _reference(h, (3, 4, 2, 4), grads, dims=(3, 1))
    for a, b in zip(ours, swapped, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


def test_factored_false_never_factors() -> None:
    state = functopt.scale_by_factored_rms(factored=False).init({"w": torch.zeros(256, 256)})
    assert state.v["w"].shape == (256, 256) and state.v_row["w"].shape == (1,)


# ------------------------------------------------------------------------ protocol laws


@settings(max_examples=20)
@given(data=st.data())
def test_protocol_laws(data: st.DataObject) -> None:
    h = data.draw(_hypers)
    params = data.draw(fst.params(allow_none=True))
    tx = functopt.scale_by_factored_rms(**h)
    state = tx.init(params)
    params_before = _clone(params)
    for _ in range(2):
        grads = data.draw(fst.gradients_like(params, kind="any", allow_none=True))
        grads_before, state_before = _clone(grads), _clone(state)
        updates, new_state = tx.update(grads, state, params if data.draw(st.booleans()) else None,
                                       loss=0.5)
        assert fst.same_layout(updates, grads)
        for tree, before in ((grads, grads_before), (state, state_before),
                             (params, params_before)):
            for x, y in zip(_core.flatten(tree)[0], _core.flatten(before)[0], strict=True):
                assert (x is None) == (y is None)
                if x is not None:
                    assert torch.equal(_bits(x), _bits(y))
        assert int(new_state.count) == int(state.count) + 1
        g_leaves = _core.flatten(grads)[0]
        for field in ("v_row", "v_col", "v"):
            old, new = _core.flatten(getattr(state, field))[0], _core.flatten(
                getattr(new_state, field))[0]
            for g, a, b in zip(g_leaves, old, new, strict=True):
                if a is None:
                    assert b is None
                    continue
                assert a.shape == b.shape and a.dtype == b.dtype
                if g is None:
                    assert torch.equal(_bits(a), _bits(b))
        state = new_state


# ---------------------------------------------------------------------------- references


@settings(max_examples=40)
@given(data=st.data())
def test_matches_float64_reference(data: st.DataObject) -> None:
    h = data.draw(_hypers)
    params = data.draw(fst.params(dtypes=(torch.float64,), allow_none=True))
    steps = [data.draw(fst.gradients_like(params, kind="any", allow_none=True))
             for _ in range(3)]
    tx = functopt.scale_by_factored_rms(**h)
    state = tx.init(params)
    updates = []
    for grads in steps:
        u, state = tx.update(grads, state, params)
        updates.append(_core.flatten(u)[0])
    for i, p in enumerate(_core.flatten(params)[0]):
        if p is None:
            continue
        shape = tuple(p.shape)
        want, want_state = _reference(h, shape, [_core.flatten(g)[0][i] for g in steps])
        for step, w in enumerate(want):
            if w is None:
                assert updates[step][i] is None
            else:
                torch.testing.assert_close(updates[step][i], w, rtol=1e-9, atol=1e-300,
                                           equal_nan=True)
        dims = _optax_dims(shape, h["factored"], h["min_dim_size_to_factor"])
        got_state = _state_in_reference_layout(state, i, shape, dims)
        assert got_state[0] == want_state[0]
        for a, b in zip(got_state[1:], want_state[1:], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-300, equal_nan=True)


@settings(max_examples=15)
@given(data=st.data())
def test_low_precision_first_step_is_the_rounded_wide_result(data: st.DataObject) -> None:
    h = {**data.draw(_hypers), "step_offset": 0}
    params = data.draw(fst.params(dtypes=(torch.float16, torch.bfloat16, torch.float32)))
    grads = data.draw(fst.gradients_like(params, kind="typical"))
    tx = functopt.scale_by_factored_rms(**h)
    u, _ = tx.update(grads, tx.init(params), params)
    for g, got in zip(_core.flatten(grads)[0], _core.flatten(u)[0], strict=True):
        assert got.dtype == g.dtype
        (want,), _ = _reference(h, tuple(g.shape), [g.double()])
        # g**2 underflows even float32 below ~1e-19 (bfloat16 reaches 1e-38): there the
        # wide maths is not float64, as documented; compare the rest.
        keep = (g.double().abs() > 1e-15) | (g == 0)
        tol = 2 * torch.finfo(g.dtype).eps
        torch.testing.assert_close(got.double()[keep], want.to(g.dtype).double()[keep],
                                   rtol=tol, atol=tol, equal_nan=True)


def test_zero_float16_gradient_gives_zero_update_not_nan() -> None:
    """optax computes g**2 + 1e-30 in float16 (0) and returns 0 * inf = NaN; not here."""
    tx = functopt.scale_by_factored_rms(min_dim_size_to_factor=2)
    params = {"m": torch.zeros(2, 3, dtype=torch.float16), "v": torch.zeros(3, dtype=torch.float16)}
    state = tx.init(params)
    for _ in range(2):
        u, state = tx.update({k: torch.zeros_like(p) for k, p in params.items()}, state, params)
        for x in u.values():
            assert x.dtype == torch.float16 and torch.equal(x, torch.zeros_like(x))


def test_adafactor_update_has_unit_rms_on_a_constant_gradient() -> None:
    torch.manual_seed(0)
    tx = functopt.scale_by_factored_rms()
    params = {"w": torch.zeros(256, 130)}
    g = torch.randn(256, 130)
    u, state = tx.update({"w": g}, tx.init(params), params)
    # first step: R, C are the row and column means of g**2; the rank-1 estimate is exact
    # in expectation, so the update's RMS is about 1
    assert 0.8 < u["w"].pow(2).mean().sqrt().item() < 1.25
    assert state.v_row["w"].shape == (130,) and state.v_col["w"].shape == (256,)


def test_custom_decay_rate_fn_sees_offset_step() -> None:
    seen: list[tuple[int, float]] = []

    def capped(step: torch.Tensor, rate: float) -> torch.Tensor:
        seen.append((int(step), rate))
        return torch.clamp(1.0 - (step + 1.0) ** -0.8, max=rate)

    tx = functopt.scale_by_factored_rms(decay_rate=0.5, step_offset=-2, decay_rate_fn=capped)
    params = {"w": torch.zeros(2)}
    state = tx.init(params)
    for g in (1.0, 3.0):
        u, state = tx.update({"w": torch.full((2,), g)}, state, params)
    assert seen == [(2, 0.5), (3, 0.5)]
    # both steps decay 0.5: v = 0.5 * (0.5 * 1) + 0.5 * 9 = 4.75
    torch.testing.assert_close(state.v["w"], torch.full((2,), 4.75))
    torch.testing.assert_close(u["w"], torch.full((2,), 3.0 / 4.75**0.5))


def test_tensor_hyperparameters() -> None:
    params = {"w": torch.zeros(3, 4, dtype=torch.float64)}
    g = {"w": torch.arange(12.0, dtype=torch.float64).reshape(3, 4)}
    a = functopt.scale_by_factored_rms(decay_rate=0.8, min_dim_size_to_factor=2, epsilon=1e-3)
    b = functopt.scale_by_factored_rms(decay_rate=torch.tensor(0.8), min_dim_size_to_factor=2,
                                       epsilon=torch.tensor(1e-3, dtype=torch.float64),
                                       step_offset=torch.tensor(0))
    ua, _ = a.update(g, a.init(params))
    ub, _ = b.update(g, b.init(params))
    torch.testing.assert_close(ua["w"], ub["w"], rtol=1e-12, atol=0)


# -------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"factored": 1}, TypeError, "factored must be True or False, got int 1"),
        ({"decay_rate": -0.8}, ValueError, r"decay_rate must be in \[0, inf\), got -0.8"),
        ({"step_offset": 1.5}, TypeError, "step_offset must be an int, got float 1.5"),
        ({"min_dim_size_to_factor": -1}, ValueError, "min_dim_size_to_factor must be an int >= 0"),
        ({"min_dim_size_to_factor": 128.0}, ValueError, "must be an int >= 0, got 128.0"),
        ({"epsilon": -1e-30}, ValueError, r"epsilon must be in \[0, inf\)"),
        ({"decay_rate_fn": 0.8}, TypeError, r"decay_rate_fn must be callable"),
    ],
)
def test_bad_hyperparameters(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        functopt.scale_by_factored_rms(**kwargs)


@pytest.mark.parametrize(
    ("make_call", "match"),
    [
        (lambda tx, s: tx.update({"a": torch.ones(2), "b": torch.ones(1)}, s),
         r"'b' has a gradient but state\.v_row holds None"),
        (lambda tx, s: tx.update({"c": torch.ones(2)}, s),
         r"state\.v_row does not have the structure of updates"),
        (lambda tx, s: tx.update({"a": torch.ones(2), "b": None}, s,
                                 {"a": torch.ones(3), "b": None}),
         r"'a': update has shape \(2,\) but param has shape \(3,\)"),
        (lambda tx, s: tx.update({"a": torch.ones(3), "b": None}, s),
         r"'a': the state \(v_row, v_col, v\) has shapes \(1,\), \(1,\), \(2,\), but a "
         r"gradient of shape \(3,\) needs"),
    ],
)
def test_bad_update_calls(make_call: Callable[..., Any], match: str) -> None:
    tx = functopt.scale_by_factored_rms()
    state = tx.init({"a": torch.zeros(2), "b": None})
    with pytest.raises(ValueError, match=match):
        make_call(tx, state)
