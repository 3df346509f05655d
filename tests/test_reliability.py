"""Misuse and faults: each case of docs/reliability.md gets the right result or a clear
error, and the dangerous but legal ones warn (issue 12).

References: PyTorch's own ``torch._amp_update_scale_`` kernel for the loss-scale rule,
float64 arithmetic in Python for norms.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

import functopt
from functopt.adapters import MixedPrecisionOptimizer
from functopt.precision import (
    LossScaleWarning,
    dynamic_loss_scale,
    loss_scale_collapsed,
    mixed_precision,
    static_loss_scale,
)
from functopt.precision import loss_scale as loss_scale_module

TINY = torch.finfo(torch.float32).tiny


def _leaves(tree: Any) -> list[Any]:
    return [x for x in functopt.tree.flatten(tree)[0] if x is not None]


# ------------------------------------------------------------ a collapsing loss scale


def _torch_scale_trace(overflows: int) -> list[float]:
    """The scale after each overflow, by PyTorch's kernel (GradScaler's defaults)."""
    scale = torch.tensor(2.0**16)
    tracker = torch.zeros((), dtype=torch.int32)
    out = []
    for _ in range(overflows):
        torch._amp_update_scale_(scale, tracker, torch.tensor(1.0), 2.0, 0.5, 2000)
        out.append(float(scale))
    return out


def test_default_rule_reaches_zero_like_torch_and_collapse_is_detected() -> None:
    reference = _torch_scale_trace(200)
    ls = dynamic_loss_scale()
    state = ls.init()
    ours, flags = [], []
    for _ in range(200):
        state = ls.adjust(state, torch.tensor(True))
        ours.append(float(state.scale))
        flags.append(bool(loss_scale_collapsed(state)))
    assert ours == reference  # the documented rule is PyTorch's, collapse included
    first_zero = reference.index(0.0)
    assert 160 <= first_zero <= 170  # "about 165 overflows" in the docs
    assert flags == [s < TINY for s in reference]  # below 2**-126, not only at 0.0
    assert flags.index(True) < first_zero


def test_a_floor_never_collapses() -> None:
    ls = dynamic_loss_scale(min_scale=1.0, hysteresis=2)
    state = ls.init()
    for _ in range(1000):
        state = ls.adjust(state, torch.tensor(True))
    assert float(state.scale) == 1.0 and not bool(loss_scale_collapsed(state))


def _overflowing_facade(loss_scale: Any) -> tuple[MixedPrecisionOptimizer, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    opt = MixedPrecisionOptimizer(model.named_parameters(), functopt.adamw(1e-3),
                                  loss_scale=loss_scale)
    return opt, list(model.parameters())


def _overflow_step(opt: MixedPrecisionOptimizer, params: list[torch.Tensor]) -> bool:
    for p in params:
        p.grad = torch.full_like(p, math.inf)
    return opt.step()


def test_facade_warns_once_the_scale_collapses_pointing_at_the_callers_step() -> None:
    opt, params = _overflowing_facade(dynamic_loss_scale())
    before = [p.detach().clone() for p in params]
    collapse_at = [s < TINY for s in _torch_scale_trace(200)].index(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(collapse_at):
            assert not _overflow_step(opt, params)
    assert caught == []  # a scale of 2**-126 and above: no warning
    with pytest.warns(LossScaleWarning, match=r"collapsed to .* every step is being skipped"
                      ) as record:
        assert not _overflow_step(opt, params)
    assert record[0].filename == __file__  # stacklevel: the caller's opt.step()
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b)


@pytest.mark.parametrize(
    "rule", [dynamic_loss_scale(min_scale=1.0, hysteresis=2), static_loss_scale(2.0**10)],
    ids=["megatron", "static"])
def test_facade_with_a_floor_or_static_scale_never_warns(rule) -> None:
    opt, params = _overflowing_facade(rule)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(300):
            assert not _overflow_step(opt, params)
    assert opt.loss_scale == (1.0 if rule.dynamic else 2.0**10)


def test_collapse_message_is_a_named_constant_with_the_fix() -> None:
    text = loss_scale_module.LOSS_SCALE_COLLAPSED.format(scale=0.0, floor=TINY)
    assert "collapsed to 0.0" in text and "min_scale=1.0" in text and "inf or nan" in text


@pytest.mark.parametrize(
    ("rule", "final"),
    [(dynamic_loss_scale(), 0.0), (dynamic_loss_scale(hysteresis=2, min_scale=1.0), 1.0),
     (static_loss_scale(128.0), 128.0)],
    ids=["pytorch", "megatron", "static"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "pure"])
def test_overflow_soak_1000_steps_leaves_no_nan_and_the_documented_scale(rule, final, fused
                                                                           ) -> None:
    params = {"w": torch.randn(4, 3).bfloat16(), "b": torch.zeros(3, dtype=torch.float16)}
    step = mixed_precision(functopt.adamw(1e-3), loss_scale=rule, fused=fused)
    state = step.init(params)
    start = [x.clone() for x in _leaves(params)]
    gen = torch.Generator().manual_seed(0)
    current = params
    for i in range(1000):
        grads = {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in params.items()}
        grads["w" if i % 2 else "b"].view(-1)[i % 3] = math.nan if i % 3 else math.inf
        current, state = step.step(grads, state, current)
    for x, y in zip(_leaves(current), start, strict=True):
        assert torch.equal(x, y)  # every step skipped: params bitwise unchanged
    assert float(state.loss_scale.scale) == final
    for leaf in _leaves(state._replace(metrics=None)):
        if leaf.is_floating_point():
            assert bool(torch.isfinite(leaf).all())  # no nan or inf in any state leaf
