"""The mixed-precision step against PyTorch: torch.amp.GradScaler + torch.optim.AdamW over
runs with overflows, the golden loss-scale traces driven through the step, and torch.func
meta-gradients through the step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad

import functopt
from functopt.precision import dynamic_loss_scale, mixed_precision, scale_loss

GOLDEN_INPUT = "FFFIFIIIFFF"  # DESIGN.md: init 16, interval 3, hysteresis 2, floor 1, x2 / x0.5
GOLDEN_PYTORCH = [16, 16, 32, 16, 16, 8, 4, 2, 2, 2, 4]
GOLDEN_MEGATRON = [16, 16, 32, 32, 32, 16, 8, 4, 4, 4, 8]

# --- 4. parity with torch.amp.GradScaler + torch.optim.AdamW --------------------------------

# float32: torch.optim.AdamW and functopt.adamw round differently (torch multiplies the param
# by 1 - lr * wd before the Adam step and divides by a float bias correction; functopt adds
# lr * (adam + wd * p) as one update, with float64 bias corrections). Measured over runs of
# up to 40 steps the params differ by at most 10 float32 eps times the largest param (about
# 1), so 2e-6 absolute and relative (about 16 eps) holds with margin and still catches any
# real difference (a missing or doubled update of lr = 1e-2). float64: the same algebra
# differs by under 1e-14, so 1e-10 leaves room for rounding only.
TOLERANCE = {torch.float32: {"rtol": 2e-6, "atol": 2e-6},
             torch.float64: {"rtol": 1e-10, "atol": 1e-10}}


def _loss(params: list[torch.Tensor], target: list[torch.Tensor]) -> torch.Tensor:
    return sum(((p - t) ** 2 * (i + 1)).sum() + p.sum() ** 3 * 1e-2
               for i, (p, t) in enumerate(zip(params, target, strict=True)))


def _run_parity(dtype, events: str, init_scale: float, interval: int, lr: float, wd: float,
                seed: int):
    gen = torch.Generator().manual_seed(seed)
    start = [torch.randn(3, generator=gen, dtype=dtype), torch.randn(2, 2, generator=gen,
                                                                     dtype=dtype)]
    target = [torch.randn_like(p) for p in start]
    torch_params = [torch.nn.Parameter(p.clone()) for p in start]
    torch_opt = torch.optim.AdamW(torch_params, lr=lr, weight_decay=wd)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=interval)

    ls = dynamic_loss_scale(init_scale, growth_interval=interval)  # PyTorch's rule
    opt = mixed_precision(functopt.adamw(lr, weight_decay=wd), loss_scale=ls)
    params = [p.clone() for p in start]
    state = opt.init(params)
    trace = []
    for i, kind in enumerate(events):
        loss = _loss(torch_params, target)
        scaled = scaler.scale(loss)
        assert torch.equal(scaled, scale_loss(loss.detach(), state))  # scaled identically
        grads = list(torch.autograd.grad(scaled, torch_params))
        if kind != "F":  # inject an overflow into the scaled grads both sides receive
            leaf = i % 2
            grads[leaf] = grads[leaf].clone()
            grads[leaf].view(-1)[i % grads[leaf].numel()] = {"I": float("inf"),
                                                           "N": float("nan"),
                                                           "M": float("-inf")}[kind]
        for p, g in zip(torch_params, grads, strict=True):
            p.grad = g.clone()
        steps_before = int(torch_opt.state[torch_params[0]].get("step", 0))
        scaler.step(torch_opt)
        scaler.update()
        torch_skipped = int(torch_opt.state[torch_params[0]].get("step", 0)) == steps_before

        params, state = opt.step([g.clone() for g in grads], state, params)
        assert bool(state.metrics.found_inf) == torch_skipped == (kind != "F"), i
        assert torch.equal(state.loss_scale.scale, scaler._scale), (i, state.loss_scale.scale)
        assert torch.equal(state.loss_scale.growth_tracker, scaler._growth_tracker), i
        trace.append(state.loss_scale.scale.item())
        for p, tp in zip(params, torch_params, strict=True):
            assert p.dtype == dtype and state.master[0] is None
            torch.testing.assert_close(p, tp.detach(), **TOLERANCE[dtype])
    assert int(state.metrics.skipped_steps) == sum(k != "F" for k in events)
    return trace


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_parity_with_gradscaler_and_adamw_fixed_run(dtype) -> None:
    # growth, an overflow right after a growth, runs of overflows (inf, nan, -inf), regrowth
    trace = _run_parity(dtype, "FFFIFFNMIFFFFF", init_scale=2.0**10, interval=2, lr=1e-2,
                        wd=0.1, seed=0)
    assert trace == [2.0**e for e in (10, 11, 11, 10, 10, 11, 10, 9, 8, 8, 9, 9, 10, 10)]


@settings(max_examples=20)
@given(events=st.lists(st.sampled_from("FFFFINM"), min_size=3, max_size=12).map("".join),
       interval=st.integers(1, 3), init_exp=st.integers(0, 16),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 3))
def test_parity_with_gradscaler_and_adamw_hypothesis(events, interval, init_exp, dtype, seed) -> None:
    _run_parity(dtype, events, init_scale=2.0**init_exp, interval=interval, lr=1e-2, wd=0.05,
                seed=seed)


def test_parity_tolerance_detects_a_tiny_difference() -> None:
    # the float64 tolerance is not vacuous: weight decay off by one part in a million fails it
    with pytest.raises(AssertionError):
        _run_parity_mismatched()


def _run_parity_mismatched() -> None:
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(3, generator=gen, dtype=torch.float64)
    tp = torch.nn.Parameter(p0.clone())
    torch_opt = torch.optim.AdamW([tp], lr=1e-2, weight_decay=0.1)
    opt = mixed_precision(functopt.adamw(1e-2, weight_decay=0.1 * (1 + 1e-6)))
    params, state = [p0.clone()], opt.init([p0])
    for _ in range(3):
        g = torch.autograd.grad((tp**2).sum(), [tp])[0]
        tp.grad = g.clone()
        torch_opt.step()
        params, state = opt.step([g], state, params)
    torch.testing.assert_close(params[0], tp.detach(), **TOLERANCE[torch.float64])


# --- golden loss-scale traces through the step ---------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "golden"),
    [
        ({}, GOLDEN_PYTORCH),
        ({"hysteresis": 2, "min_scale": 1.0}, GOLDEN_MEGATRON),
    ],
    ids=["pytorch", "megatron"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_golden_traces_through_the_step(kwargs, golden, dtype) -> None:
    ls = dynamic_loss_scale(16.0, growth_interval=3, **kwargs)
    opt = mixed_precision(functopt.adam(1e-2), loss_scale=ls)
    params = {"w": torch.tensor([0.5, -1.0], dtype=dtype)}
    state = opt.init(params)
    trace, moved = [], []
    for kind in GOLDEN_INPUT:
        g = torch.tensor([1.0, float("inf") if kind == "I" else -2.0], dtype=dtype)
        before = params["w"].clone()
        params, state = opt.step({"w": g * state.loss_scale.scale.to(dtype)}, state, params)
        trace.append(int(state.loss_scale.scale))
        moved.append(not torch.equal(before, params["w"]))
    assert trace == golden
    assert moved == [kind == "F" for kind in GOLDEN_INPUT]
    assert int(state.metrics.skipped_steps) == GOLDEN_INPUT.count("I")


# --- 8. torch.func: a meta-gradient through the step -----------------------------------------


def _data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=gen, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.1
    return x, y


def _regression(params, x, y):
    return ((x @ params["w"] + params["b"] - y) ** 2).mean()


def _train(make_inner, lr, steps: int = 4, max_grad_norm=None):
    x, y = _data()
    params = {"w": torch.zeros(3, dtype=torch.float64), "b": torch.zeros((), dtype=torch.float64)}
    opt = mixed_precision(make_inner(lr), loss_scale=dynamic_loss_scale(2.0**8, growth_interval=2),
                          max_grad_norm=max_grad_norm)
    state = opt.init(params)
    assert state.master == {"w": None, "b": None}  # float64: no master copy
    for _ in range(steps):
        grads = grad(lambda p, s=state: scale_loss(_regression(p, x, y), s))(params)
        params, state = opt.step(grads, state, params)
    return _regression(params, x, y)


@pytest.mark.parametrize(
    ("make_inner", "max_grad_norm"),
    [
        (lambda lr: functopt.sgd(lr, momentum=0.9), None),
        (lambda lr: functopt.adamw(lr, weight_decay=0.1), None),
        (lambda lr: functopt.adam(lr), 1.0),
    ],
    ids=["sgd-momentum", "adamw", "adam-clipped"],
)
def test_meta_gradient_of_the_learning_rate_through_the_step(make_inner, max_grad_norm) -> None:
    lr = torch.tensor(0.05, dtype=torch.float64)
    meta = grad(lambda lr_: _train(make_inner, lr_, max_grad_norm=max_grad_norm))(lr)
    h = 1e-6
    fd = (_train(make_inner, lr + h, max_grad_norm=max_grad_norm)
          - _train(make_inner, lr - h, max_grad_norm=max_grad_norm)) / (2 * h)
    assert torch.isfinite(meta)
    assert abs(fd.item()) > 1e-4  # the loss depends on the learning rate
    torch.testing.assert_close(meta, fd, rtol=1e-5, atol=1e-9)
