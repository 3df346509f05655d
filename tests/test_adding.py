"""add_decayed_weights: u + weight_decay * p against a float64 reference, with schedules,
masks, None gradients and non-finite values."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functopt
from functopt.testing import assert_bitwise_equal, clone_tree
from functopt.testing import strategies as fst


def _leaves(tree: Any) -> list[Any]:
    return functopt.tree.flatten(tree)[0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)




def _assert_sum_close(out: torch.Tensor, a64: torch.Tensor, b64: torch.Tensor) -> None:
    """``out`` is ``a + b`` rounded to its dtype, up to two roundings of the terms."""
    dtype = out.dtype
    expected = (a64 + b64).to(dtype)
    finite = torch.isfinite(expected)
    assert torch.equal(out[~finite].isnan(), expected[~finite].isnan())
    assert torch.equal(torch.nan_to_num(out[~finite]), torch.nan_to_num(expected[~finite]))
    info = torch.finfo(dtype)
    bound = 2 * info.eps * (a64.abs() + b64.abs()) + info.smallest_normal
    assert ((out.double() - (a64 + b64)).abs() <= bound)[finite].all()


@given(
    fst.params_and_gradients(grad_kind="any", allow_none=True),
    st.sampled_from([0.0, 1e-4, 0.1, 3.0]),
)
def test_add_decayed_weights_matches_reference(pg, weight_decay) -> None:
    params, grads = pg
    tx = functopt.add_decayed_weights(weight_decay)
    state = tx.init(params)
    before = (clone_tree(grads), clone_tree(params))
    out, new_state = tx.update(grads, state, params, unused_extra_arg=1)
    assert_bitwise_equal(grads, before[0], what="input")
    assert_bitwise_equal(params, before[1], what="input")
    assert fst.same_layout(out, grads) and new_state == functopt.EmptyState()
    for g, p, o in zip(_leaves(grads), _leaves(params), _leaves(out), strict=True):
        if g is None:
            assert o is None
        else:
            _assert_sum_close(o, g.double(), weight_decay * p.double())


def test_add_decayed_weights_matches_torch_sgd_weight_decay_bitwise() -> None:
    # torch.optim.SGD without momentum: p <- p - lr * (g + wd * p); the decayed gradient is
    # formed with grad.add(param, alpha=wd), which this transform uses for numbers. lr = 1
    # makes the step itself exact, so that any difference is the decay's.
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(1000, generator=gen)
    g = torch.randn(1000, generator=gen)
    param = p0.clone().requires_grad_(True)
    param.grad = g.clone()
    torch.optim.SGD([param], lr=1.0, weight_decay=0.37, foreach=False).step()
    tx = functopt.chain(functopt.add_decayed_weights(0.37), functopt.scale(-1.0))
    u = tx.update({"p": g}, tx.init({"p": p0}), {"p": p0})[0]
    assert torch.equal(p0 + u["p"], param.detach())


def test_schedule_is_read_at_the_count_before_the_update() -> None:
    seen = []

    def schedule(count):
        seen.append(int(count))
        return 0.1 * (count + 1)

    params = {"w": torch.tensor([2.0])}
    tx = functopt.add_decayed_weights(schedule)
    state = tx.init(params)
    assert isinstance(state, functopt.AddDecayedWeightsState)
    assert state.count.dtype == torch.int32 and state.count.shape == ()
    outs = []
    for _ in range(3):
        u, state = tx.update({"w": torch.zeros(1)}, state, params)
        outs.append(u["w"].item())
    assert seen == [0, 1, 2] and int(state.count) == 3
    assert outs == pytest.approx([0.2, 0.4, 0.6])


def test_zero_weight_decay_returns_the_updates_untouched() -> None:
    params = {"w": torch.tensor([math.inf, math.nan])}
    grads = {"w": torch.tensor([1.0, 2.0])}
    tx = functopt.add_decayed_weights()  # optax's default: 0.0
    out = tx.update(grads, tx.init(params), params)[0]
    assert out is grads  # non-finite params cannot leak into the updates


def test_tensor_weight_decay_gives_the_number_result() -> None:
    params = {"w": torch.tensor([1.0, -3.0], dtype=torch.bfloat16)}
    grads = {"w": torch.tensor([0.5, 0.25], dtype=torch.bfloat16)}
    outs = []
    for wd in (0.5, torch.tensor(0.5, dtype=torch.float64)):
        tx = functopt.add_decayed_weights(wd)
        outs.append(tx.update(grads, tx.init(params), params)[0]["w"])
    assert outs[1].dtype == torch.bfloat16
    assert torch.equal(outs[0], outs[1])


def test_tensor_weight_decay_is_differentiable() -> None:
    wd = torch.tensor(0.1, requires_grad=True)
    params = {"w": torch.tensor([1.0, 2.0])}
    tx = functopt.add_decayed_weights(wd)
    out = tx.update({"w": torch.zeros(2)}, tx.init(params), params)[0]["w"]
    (d_wd,) = torch.autograd.grad(out.sum(), wd)
    assert d_wd.item() == pytest.approx(3.0)


@pytest.mark.parametrize(
    "mask",
    [
        {"w": True, "b": False},
        lambda p: {k: v.dim() > 1 for k, v in p.items()},
    ],
    ids=["tree", "callable"],
)
def test_mask_skips_the_leaves_it_leaves_out(mask) -> None:
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    grads = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    tx = functopt.add_decayed_weights(0.5, mask)
    state = tx.init(params)
    assert state == functopt.MaskedState(inner_state=functopt.EmptyState())
    out, _ = tx.update(grads, state, params)
    assert torch.equal(out["w"], torch.full((2, 2), 0.5))
    assert out["b"] is grads["b"]


def test_none_gradients_stay_none() -> None:
    params = {"w": torch.ones(2), "frozen": torch.ones(3)}
    tx = functopt.add_decayed_weights(0.1)
    out = tx.update({"w": torch.ones(2), "frozen": None}, tx.init(params), params)[0]
    assert out["frozen"] is None


@pytest.mark.parametrize("mask", [None, {"w": True}], ids=["plain", "masked"])
def test_update_without_params_is_an_error(mask) -> None:
    tx = functopt.add_decayed_weights(0.1, mask)
    with pytest.raises(ValueError, match=r"add_decayed_weights reads the params, but update\(\) "
                                         r"was called without them"):
        tx.update({"w": torch.ones(1)}, tx.init({"w": torch.ones(1)}))


def test_update_for_a_none_param_names_the_leaf() -> None:
    tx = functopt.add_decayed_weights(0.1)
    with pytest.raises(ValueError, match=r"leaf 'layer.w' has an update but its param is None"):
        tx.update({"layer": {"w": torch.ones(1)}}, functopt.EmptyState(), {"layer": {"w": None}})


def test_param_dtype_mismatch_names_the_leaf() -> None:
    tx = functopt.add_decayed_weights(0.1)
    with pytest.raises(TypeError, match=r"'w': float32 update for bfloat16 param"):
        tx.update({"w": torch.ones(1)}, functopt.EmptyState(),
                  {"w": torch.ones(1, dtype=torch.bfloat16)})


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: functopt.add_decayed_weights(-0.1), ValueError,
         r"add_decayed_weights: weight_decay must be in \[0, inf\), got -0.1"),
        (lambda: functopt.add_decayed_weights("0.1"), TypeError,
         r"weight_decay must be a number, a 0-d tensor or a schedule"),
        (lambda: functopt.add_decayed_weights(0.1, mask={"w": "yes"}), TypeError,
         r"mask leaf 'w' is a str; expected True or False"),
    ],
)
def test_bad_arguments_are_rejected(make, error, match) -> None:
    with pytest.raises(error, match=match):
        make()
