"""Loss-scale rules: golden traces, PyTorch's kernel, and a state machine against small
models of each rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import functopt
from functopt.precision import dynamic_loss_scale, static_loss_scale

GOLDEN_INPUT = "FFFIFIIIFFF"  # DESIGN.md: init 16, interval 3, hysteresis 2, floor 1, x2 / x0.5
GOLDEN_PYTORCH = [16, 16, 32, 16, 16, 8, 4, 2, 2, 2, 4]
GOLDEN_MEGATRON = [16, 16, 32, 32, 32, 16, 8, 4, 4, 4, 8]


def _trace(ls, steps: str) -> list[float]:
    state, out = ls.init(), []
    for c in steps:
        state = ls.adjust(state, torch.tensor(c == "I"))
        out.append(state.scale.item())
    return out


def test_golden_trace_pytorch_rule() -> None:
    ls = dynamic_loss_scale(16.0, growth_interval=3)
    assert _trace(ls, GOLDEN_INPUT) == GOLDEN_PYTORCH


def test_golden_trace_megatron_rule() -> None:
    ls = dynamic_loss_scale(16.0, growth_interval=3, hysteresis=2, min_scale=1.0)
    assert _trace(ls, GOLDEN_INPUT) == GOLDEN_MEGATRON


def test_top_level_names() -> None:
    assert functopt.dynamic_loss_scale is dynamic_loss_scale
    assert functopt.static_loss_scale is static_loss_scale


def test_static_scale_never_moves() -> None:
    ls = static_loss_scale(1024.0)
    assert _trace(ls, "IIFFFI") == [1024.0] * 6
    assert not ls.dynamic and dynamic_loss_scale().dynamic


def test_defaults_are_gradscaler_defaults() -> None:
    state = dynamic_loss_scale().init()
    scaler = torch.amp.GradScaler("cpu")
    assert state.scale.item() == scaler.get_scale() == 2.0**16
    assert state.scale.dtype == torch.float32 and state.scale.shape == ()


@settings(max_examples=60)
@given(
    overflows=st.lists(st.booleans(), min_size=1, max_size=60),
    init_exp=st.integers(-10, 127),
    growth=st.sampled_from([2.0, 4.0, 1.5, 3.0]),
    backoff=st.sampled_from([0.5, 0.25, 0.7]),
    interval=st.integers(1, 4),
)
def test_hysteresis_one_is_pytorch_kernel(overflows, init_exp, growth, backoff, interval) -> None:
    # torch._amp_update_scale_ is the kernel GradScaler.update runs; ours must equal it
    # bitwise, including near float32's maximum where growth must be refused.
    init = 2.0**init_exp
    ls = dynamic_loss_scale(init, growth_factor=growth, backoff_factor=backoff,
                            growth_interval=interval)
    state = ls.init()
    scale = torch.tensor(init, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    for overflow in overflows:
        found_inf = torch.tensor(1.0 if overflow else 0.0)
        torch._amp_update_scale_(scale, tracker, found_inf, growth, backoff, interval)
        state = ls.adjust(state, found_inf)
        assert torch.equal(state.scale, scale), (state.scale.item(), scale.item())
        assert torch.equal(state.growth_tracker, tracker)


class _ReferenceScaler:
    """A plain-Python model of both rules, written from their definitions."""

    def __init__(self, init, growth, backoff, interval, hysteresis, lo, hi):
        self.scale, self.growth, self.backoff = init, growth, backoff
        self.interval, self.hysteresis, self.lo, self.hi = interval, hysteresis, lo, hi
        self.good_steps, self.overflows_left = 0, hysteresis

    def step(self, overflow: bool) -> None:
        if overflow:
            self.good_steps = 0
            self.overflows_left = max(self.overflows_left - 1, 0)
            if self.overflows_left == 0:
                self.scale *= self.backoff
        else:
            self.good_steps += 1
            if self.good_steps == self.interval:
                self.good_steps = 0
                self.overflows_left = self.hysteresis
                if self.scale * self.growth <= torch.finfo(torch.float32).max:
                    self.scale *= self.growth
        if self.lo is not None:
            self.scale = max(self.scale, self.lo)
        if self.hi is not None:
            self.scale = min(self.scale, self.hi)


class LossScaleMachine(RuleBasedStateMachine):
    @initialize(
        init_exp=st.integers(0, 20),
        interval=st.integers(1, 5),
        hysteresis=st.integers(1, 4),
        floor=st.sampled_from([None, 1.0, 4.0]),
        ceiling=st.sampled_from([None, 2.0**24]),
    )
    def setup(self, init_exp, interval, hysteresis, floor, ceiling):
        init = float(2**init_exp)
        if floor is not None:
            init = max(init, floor)
        self.ls = dynamic_loss_scale(init, growth_interval=interval, hysteresis=hysteresis,
                                     min_scale=floor, max_scale=ceiling)
        self.state = self.ls.init()
        self.model = _ReferenceScaler(init, 2.0, 0.5, interval, hysteresis, floor, ceiling)

    @rule()
    def finite_step(self):
        self.state = self.ls.adjust(self.state, torch.tensor(False))
        self.model.step(False)

    @rule()
    def overflow_step(self):
        self.state = self.ls.adjust(self.state, torch.tensor(True))
        self.model.step(True)

    @invariant()
    def same_scale(self):
        if hasattr(self, "state"):
            assert self.state.scale.item() == self.model.scale
            assert self.state.growth_tracker.item() == self.model.good_steps


TestLossScaleMachine = LossScaleMachine.TestCase
TestLossScaleMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: dynamic_loss_scale(0.0), "init_scale must be in \\(0, inf\\)"),
        (lambda: dynamic_loss_scale(growth_factor=1.0), "growth_factor must be in \\(1, inf\\)"),
        (lambda: dynamic_loss_scale(backoff_factor=1.0), "backoff_factor must be in \\(0, 1\\)"),
        (lambda: dynamic_loss_scale(growth_interval=0), "growth_interval must be an int >= 1"),
        (lambda: dynamic_loss_scale(hysteresis=1.5), "hysteresis must be an int >= 1"),
        (lambda: dynamic_loss_scale(min_scale=8.0, max_scale=4.0), "must not exceed max_scale"),
        (lambda: dynamic_loss_scale(2.0, min_scale=4.0), "outside \\[min_scale, max_scale\\]"),
        (lambda: static_loss_scale(1e39), "finite float32"),
    ],
)
def test_errors(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("loss", [[torch.tensor(1.0)], (torch.tensor(1.0),), 1.0,
                                  torch.tensor(3)], ids=["list", "tuple", "float", "int64"])
def test_scale_loss_refuses_what_is_not_a_floating_loss_tensor(loss: object) -> None:
    state = dynamic_loss_scale().init()
    with pytest.raises(TypeError, match=r"scale_loss: loss must be a (floating-point )?tensor, "
                                         r"got (list|tuple|float|a torch\.int64 tensor)"):
        functopt.precision.scale_loss(loss, state)  # type: ignore[arg-type]


def test_scale_loss_refuses_a_state_without_a_loss_scale() -> None:
    state = functopt.sgd(0.1).init({"w": torch.ones(2)})
    with pytest.raises(TypeError, match=r"scale_loss: state must be a MixedPrecisionState"):
        functopt.precision.scale_loss(torch.tensor(1.0), state)  # type: ignore[arg-type]
