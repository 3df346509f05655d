"""Megatron-LM's optimizer calls on ``MixedPrecisionOptimizer`` (functopt/adapters/_megatron.py).

Held to megatron-core 0.16.1 where its code runs on the CPU: its ``MegatronOptimizer``
methods called on the facade (``scale_loss``' value), its ``_zero_grad_group_helper``
(``.decoupled_grad``), and a transcription of its ``MixedPrecisionOptimizer.step``
(``prepare_grads``, then ``step_with_ready_grads`` unless they overflowed) against the
facade's own ``step()``. The two-rank checks are in tests/distributed/agreement_checks.py.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import functopt

with warnings.catch_warnings():  # without Transformer Engine and Apex it says so
    warnings.simplefilter("ignore")
    from megatron.core.optimizer import optimizer as megatron_optimizer


def _model(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2)).to(dtype)


def _facade(model: torch.nn.Module, **options: Any) -> functopt.MixedPrecisionOptimizer:
    options.setdefault("loss_scale",
                       functopt.dynamic_loss_scale(init_scale=2.0**10, growth_interval=2))
    return functopt.MixedPrecisionOptimizer(
        model.named_parameters(), functopt.adamw(1e-2, weight_decay=0.1), **options)


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 4, generator=g).to(torch.bfloat16)
    return model(x).float().pow(2).mean()


@pytest.mark.parametrize(("dtype", "shape"), [(torch.bfloat16, ()), (torch.bfloat16, (1,)),
                                              (torch.float32, (1,)), (torch.float16, ()),
                                              (torch.float64, ())])
def test_scale_loss_is_megatrons_value_in_the_losss_dtype(dtype: torch.dtype,
                                                          shape: tuple[int, ...]) -> None:
    opt = _facade(_model())
    loss = torch.full(shape, 0.75, dtype=dtype)
    got = opt.scale_loss(loss)
    theirs = megatron_optimizer.MegatronOptimizer.scale_loss(opt, loss)  # its code, our scale
    assert got.dtype == dtype and got.shape == loss.shape
    assert float(got.sum()) == float(theirs.sum()) == 0.75 * 2.0**10


def test_scale_loss_gradients_are_the_scaled_ones_backward_makes() -> None:
    """What the schedules do with it (backward on the scaled loss) leaves the gradients
    ``backward(loss)`` leaves."""
    ours, ref = _model(), _model()
    a, b = _facade(ours), _facade(ref)
    torch.autograd.backward(a.scale_loss(_loss(ours, 0)))
    b.backward(_loss(ref, 0))
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad, q.grad)
        assert float(p.grad.abs().max()) > 0


@pytest.mark.parametrize("bad", [[torch.tensor(1.0)], 1.0, torch.tensor(3)])
def test_scale_loss_refuses_what_is_not_a_floating_tensor(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"MixedPrecisionOptimizer\.scale_loss: loss must be"):
        _facade(_model()).scale_loss(bad)


def test_get_parameters_is_the_stepped_params_in_group_order() -> None:
    model = _model()
    opt = functopt.MixedPrecisionOptimizer(
        [{"params": model[0].named_parameters(prefix="0"), "frozen": True},
         {"params": [("2.bias", model[2].bias)], "weight_decay": 0.0},
         {"params": [("2.weight", model[2].weight)]}],
        lambda weight_decay=0.1: functopt.adamw(1e-2, weight_decay=weight_decay))
    got = opt.get_parameters()
    assert [id(p) for p in got] == [id(model[2].bias), id(model[2].weight)]


def test_main_grads_for_grad_norm_are_the_unscaled_gradients_of_the_norm() -> None:
    model = _model()
    opt = _facade(model)
    opt.backward(_loss(model, 0))
    model[0].weight.main_grad = model[0].weight.grad.float() * 0.5  # read instead of .grad
    grads = opt.get_main_grads_for_grad_norm()
    scale = opt.loss_scale
    expected = [model[0].weight.main_grad / scale] + [
        p.grad.float() / scale for n, p in model.named_parameters() if n != "0.weight"]
    assert len(grads) == len(expected) == 4
    for got, want in zip(grads, expected, strict=True):
        assert got.dtype == torch.float32
        assert torch.equal(got, want)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    torch.testing.assert_close(norm, opt.get_grad_norm(), rtol=1e-6, atol=0.0)


def test_a_single_process_has_no_grad_stats_group() -> None:
    with pytest.raises(ValueError, match="summed over no process group"):
        _facade(_model()).get_grad_stats_parallel_group()


def _megatron_step(opt: functopt.MixedPrecisionOptimizer) -> tuple[bool, bool, float]:
    """megatron-core 0.16.1's ``MixedPrecisionOptimizer.step``, transcribed (no clip,
    ``clip_grad`` 0; no zero count): ``(found_inf, success, loss scale after
    prepare_grads)``."""
    found = opt.prepare_grads()
    scale = opt.loss_scale
    if found:
        return True, False, scale
    return False, opt.step_with_ready_grads(), scale


def test_prepare_and_step_with_ready_grads_are_the_step() -> None:
    """Megatron's two halves over steps with an overflow among them give the facade's
    ``step()`` bitwise: params, loss scale and each step's verdict."""
    ours, ref = _model(), _model()
    a, b = _facade(ours), _facade(ref)
    for step in range(6):
        for model, opt in ((ours, a), (ref, b)):
            opt.backward(_loss(model, step))
            if step == 2:
                model[2].weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in ours.parameters()]
        scale_before = a.loss_scale
        found, took, prepared_scale = _megatron_step(a)
        assert found == (step == 2)
        assert took == b.step() == (step != 2)
        # the overflow's back-off happens in prepare_grads, as Megatron's scaler update
        assert (prepared_scale == scale_before / 2) == found
        assert a.loss_scale == b.loss_scale
        for p, q, old in zip(ours.parameters(), ref.parameters(), before, strict=True):
            assert torch.equal(p, q)
            assert torch.equal(p, old) == (step == 2)
        a.zero_grad()
        b.zero_grad()
    assert a.loss_scale != 2.0**10  # the scale moved: backed off, grew


def test_prepare_grads_on_finite_gradients_changes_nothing() -> None:
    model = _model()
    opt = _facade(model)
    opt.backward(_loss(model, 0))
    before = [p.detach().clone() for p in model.parameters()]
    state = opt.state_dict()
    assert opt.prepare_grads() is False
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    after = opt.state_dict()
    assert after["state"].keys() == state["state"].keys()
    for k, entry in state["state"].items():
        for name, value in entry.items():
            other = after["state"][k][name]
            assert (torch.equal(value, other) if isinstance(value, torch.Tensor)
                    else value == other), name


def test_a_decoupled_grad_is_read_and_cleared_as_megatrons() -> None:
    """A param's ``.decoupled_grad`` (Megatron's precision-aware optimizer) is the gradient
    the step reads, before ``.main_grad`` and ``.grad``; ``zero_grad`` leaves it as
    megatron-core's ``_zero_grad_group_helper(use_decoupled_grad=True)`` does."""
    ours, ref = _model(), _model()
    a, b = _facade(ours, loss_scale=None), _facade(ref, loss_scale=None)
    b.backward(_loss(ref, 0))
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        p.decoupled_grad = q.grad.clone()
        p.grad = torch.full_like(p, float("nan"))  # not read
    assert a.step() and b.step()
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters(),
                                                   strict=True))
    for set_to_none in (False, True):
        mine = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
        theirs = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
        for p in mine + theirs:
            p.decoupled_grad = torch.full((2,), 3.0)
        opt = functopt.MixedPrecisionOptimizer(mine, functopt.sgd(0.1), loss_scale=None)
        opt.zero_grad(set_to_none=set_to_none)
        megatron_optimizer._zero_grad_group_helper(theirs, set_to_none,
                                                   use_decoupled_grad=True)
        for p, q in zip(mine, theirs, strict=True):
            assert (p.decoupled_grad is None) == (q.decoupled_grad is None) == set_to_none
            if not set_to_none:
                assert torch.equal(p.decoupled_grad, q.decoupled_grad)
                assert not p.decoupled_grad.any()
