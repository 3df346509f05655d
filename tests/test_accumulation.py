"""trace and ema: torch.optim.SGD momentum in float64, and per-step float64 references over
mixed dtypes, accumulator dtypes, None gradients and non-finite values."""

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




def _assert_close(out: torch.Tensor, expected64: torch.Tensor, scale64: torch.Tensor) -> None:
    """``out`` equals ``expected64`` up to a few roundings of terms of size ``scale64``; the
    non-finite entries (after rounding to ``out``'s dtype) must match exactly."""
    dtype = out.dtype
    expected = expected64.to(dtype)
    finite = torch.isfinite(expected) & torch.isfinite(scale64)
    assert torch.equal(out[~finite].isnan(), expected[~finite].isnan())
    assert torch.equal(torch.nan_to_num(out[~finite]), torch.nan_to_num(expected[~finite]))
    info = torch.finfo(dtype)
    bound = 4 * info.eps * scale64.abs() + info.smallest_normal
    assert ((out.double() - expected64).abs() <= bound)[finite].all()


# ------------------------------------------------------------------ torch.optim.SGD momentum


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, generator=gen, dtype=torch.float64),
            "b": torch.randn(4, generator=gen, dtype=torch.float64)}


def _grads(step: int, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {k: 0.3 * v + torch.randn(v.shape, generator=gen, dtype=torch.float64)
            for k, v in params.items()}


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_trace_equals_torch_sgd_momentum_in_float64(nesterov, weight_decay) -> None:
    lr, momentum, steps = 0.1, 0.9, 8
    theirs = {k: v.clone().requires_grad_(True) for k, v in _params().items()}
    opt = torch.optim.SGD(list(theirs.values()), lr=lr, momentum=momentum, dampening=0,
                          nesterov=nesterov, weight_decay=weight_decay, foreach=False)
    tx = functopt.chain(functopt.add_decayed_weights(weight_decay),
                        functopt.trace(momentum, nesterov=nesterov), functopt.scale(-lr))
    ours = _params()
    state = tx.init(ours)
    for step in range(steps):
        grads = _grads(step, ours)
        their_grads = _grads(step, {k: p.detach() for k, p in theirs.items()})
        for k, p in theirs.items():
            p.grad = their_grads[k]
        opt.step()
        updates, state = tx.update(grads, state, ours)
        ours = functopt.apply_updates(ours, updates)
        for k in ours:
            torch.testing.assert_close(ours[k], theirs[k].detach(), rtol=0, atol=1e-13)


# ---------------------------------------------------------------------------------- trace


@settings(max_examples=20)
@given(
    st.data(),
    st.sampled_from([0.0, 0.5, 0.9]),
    st.booleans(),
    st.sampled_from([None, torch.float32, torch.bfloat16]),
)
def test_trace_step_matches_reference(data, decay, nesterov, accumulator_dtype) -> None:
    params, grads1 = data.draw(fst.params_and_gradients(grad_kind="any", allow_none=True))
    grads2 = data.draw(fst.gradients_like(params, kind="finite", allow_none=True))
    tx = functopt.trace(decay, nesterov=nesterov, accumulator_dtype=accumulator_dtype)
    state = tx.init(params)
    for p, t in zip(_leaves(params), _leaves(state.trace), strict=True):
        assert t.shape == p.shape and t.dtype == (accumulator_dtype or p.dtype)
        assert not t.any()
    for grads in (grads1, grads2):
        before = (clone_tree(grads), clone_tree(state))
        out, new_state = tx.update(grads, state, params, unused_extra_arg=0)
        assert_bitwise_equal(grads, before[0], what="input")
        assert_bitwise_equal(state, before[1], what="input")
        assert fst.same_layout(out, grads)
        triples = zip(_leaves(grads), _leaves(state.trace), _leaves(new_state.trace), _leaves(out),
                      strict=True)
        for g, t, new_t, o in triples:
            if g is None:
                assert o is None and new_t is t  # no gradient: the trace is left alone
                continue
            assert new_t.dtype == t.dtype
            g64, t64 = g.double(), t.double()
            m64 = g64 + decay * t64
            scale = g64.abs() + decay * t64.abs()
            _assert_close(new_t, m64, scale)
            if nesterov:
                _assert_close(o, g64 + decay * m64, g64.abs() + decay * scale)
            else:
                _assert_close(o, m64, scale)
        state = new_state


def test_trace_accumulates_in_the_wider_dtype() -> None:
    # A bfloat16 trace of float32 gradients: the sum is formed in float32 and only rounded
    # to bfloat16 for storage, so the update keeps float32 precision.
    tx = functopt.trace(0.5, accumulator_dtype=torch.bfloat16)
    state = tx.init({"w": torch.zeros(1)})
    g = torch.tensor([1.0 + 2**-20])
    out, state = tx.update({"w": g}, state)
    assert torch.equal(out["w"], g)
    assert state.trace["w"].dtype == torch.bfloat16 and state.trace["w"].item() == 1.0


def test_tensor_decay_gives_the_number_result() -> None:
    params = _params()
    outs = []
    for decay in (0.9, torch.tensor(0.9, dtype=torch.float64)):
        tx = functopt.trace(decay, nesterov=True)
        state = tx.init(params)
        for step in range(3):
            out, state = tx.update(_grads(step, params), state)
        outs.append(out)
    for k in params:
        torch.testing.assert_close(outs[0][k], outs[1][k], rtol=1e-15, atol=0)


# ------------------------------------------------------------------------------------ ema


@settings(max_examples=20)
@given(
    st.data(),
    st.sampled_from([0.0, 0.5, 0.99]),
    st.booleans(),
    st.sampled_from([None, torch.float32]),
)
def test_ema_step_matches_reference(data, decay, debias, accumulator_dtype) -> None:
    params, grads1 = data.draw(fst.params_and_gradients(grad_kind="any", allow_none=True))
    grads2 = data.draw(fst.gradients_like(params, kind="finite", allow_none=True))
    tx = functopt.ema(decay, debias=debias, accumulator_dtype=accumulator_dtype)
    state = tx.init(params)
    assert state.count.dtype == torch.int32 and int(state.count) == 0
    for step, grads in enumerate((grads1, grads2), start=1):
        before = (clone_tree(grads), clone_tree(state))
        out, new_state = tx.update(grads, state, params)
        assert_bitwise_equal(grads, before[0], what="input")
        assert_bitwise_equal(state, before[1], what="input")
        assert fst.same_layout(out, grads)
        assert int(new_state.count) == step  # shared by all leaves, None or not
        correction = 1 - decay**step if debias else 1.0
        for g, e, new_e, o in zip(_leaves(grads), _leaves(state.ema), _leaves(new_state.ema),
                                  _leaves(out), strict=True):
            if g is None:
                assert o is None and new_e is e
                continue
            assert new_e.dtype == e.dtype
            g64, e64 = g.double(), e.double()
            e_new = (1 - decay) * g64 + decay * e64
            scale = (1 - decay) * g64.abs() + decay * e64.abs()
            _assert_close(new_e, e_new, scale)
            _assert_close(o, e_new / correction, scale / correction)
        state = new_state


def test_debiased_ema_of_a_constant_is_the_constant() -> None:
    tx = functopt.ema(0.9)
    c = torch.tensor([0.5, -3.0], dtype=torch.float64)
    state = tx.init({"w": c})
    for step in range(1, 6):
        out, state = tx.update({"w": c}, state)
        torch.testing.assert_close(out["w"], c, rtol=1e-14, atol=0)
        torch.testing.assert_close(state.ema["w"], c * (1 - 0.9**step), rtol=1e-14, atol=0)


def test_ema_without_debias_accepts_decay_one() -> None:
    tx = functopt.ema(1.0, debias=False)
    state = tx.init({"w": torch.zeros(1)})
    out, state = tx.update({"w": torch.ones(1)}, state)
    assert out["w"].item() == 0.0


# --------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: functopt.trace(-0.1), ValueError, r"trace: decay must be in \[0, inf\), got -0.1"),
        (lambda: functopt.trace(None), TypeError, r"trace: decay must be a number or a 0-d tensor, got NoneType"),
        (lambda: functopt.trace(0.9, accumulator_dtype=torch.int32), TypeError,
         r"trace: accumulator_dtype must be None or a floating torch.dtype"),
        (lambda: functopt.ema(1.0), ValueError, r"ema: decay must be in \[0, 1\), got 1.0"),
        (lambda: functopt.ema(1.5, debias=False), ValueError, r"ema: decay must be in \[0, 1\], got 1.5"),
        (lambda: functopt.ema(0.9, accumulator_dtype="bf16"), TypeError,
         r"ema: accumulator_dtype must be None or a floating torch.dtype"),
    ],
)
def test_bad_hyperparameters_are_rejected(make, error, match) -> None:
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize(
    ("tx", "field"), [(functopt.trace(0.9), "state.trace"), (functopt.ema(0.9), "state.ema")]
)
def test_state_of_other_params_is_rejected_by_path(tx, field) -> None:
    state = tx.init({"layer": {"w": torch.zeros(1)}})
    with pytest.raises(ValueError, match=rf"{field} does not have the structure of updates "
                                         rf"\(at 'layer'"):
        tx.update({"layer": {"w": torch.ones(1), "b": torch.ones(1)}}, state)
