"""functopt.schedules: values against optax's documented formulas (written out here in
Python floats), int and tensor steps agreeing bitwise, boundaries, torch.optim.lr_scheduler
parity, vmap/grad through schedules, and every error message."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from functopt import schedules as fs

# --- Reference formulas (optax's docstrings), in Python floats ---------------------------


def ref_polynomial(init, end, power, steps, begin, t):
    if steps <= 0:
        return init
    done = min(max(t - begin, 0), steps)
    return (init - end) * (1 - done / steps) ** power + end


def ref_linear(init, end, steps, begin, t):
    # optax's cases: I before B, I + (t - B)/T (E - I) during, E after.
    if steps <= 0 or t < begin:
        return init
    if t < begin + steps:
        return init + (t - begin) / steps * (end - init)
    return end


def ref_exponential(init, steps, rate, begin, staircase, end, t):
    d = t - begin
    if d <= 0:
        value = init
    else:
        p = math.floor(d / steps) if staircase else d / steps
        value = init * rate**p
    if end is not None:
        value = max(value, end) if rate < 1 else min(value, end)
    return value


def ref_cosine(init, steps, alpha, exponent, t):
    c = min(t, steps)
    factor = 0.5 * (1 + math.cos(math.pi * c / steps))
    return init * ((1 - alpha) * factor**exponent + alpha)


def ref_warmup_cosine(init, peak, warmup, total, end, exponent, t):
    if t < warmup:
        return ref_linear(init, peak, warmup, 0, t)
    # After the warmup: from peak to end along the cosine, i.e. (peak - end) c^p + end.
    c = min(t - warmup, total - warmup)
    factor = 0.5 * (1 + math.cos(math.pi * c / (total - warmup)))
    if peak == 0:
        return 0.0
    return (peak - end) * factor**exponent + end


def ref_piecewise_constant(init, boundaries_and_scales, t):
    value = init
    for boundary, scale in sorted(boundaries_and_scales.items()):
        if t >= boundary:
            value *= scale
    return value


def ref_piecewise_interpolate(kind, init, boundaries_and_scales, t):
    bounds = [0, *sorted(boundaries_and_scales)]
    values = [init]
    for b in sorted(boundaries_and_scales):
        values.append(values[-1] * boundaries_and_scales[b])
    if t < 0:
        return 0.0
    if t >= bounds[-1]:
        return values[-1]
    i = max(j for j in range(len(bounds) - 1) if bounds[j] <= t)
    pct = (t - bounds[i]) / max(bounds[i + 1] - bounds[i], 1)
    start, end = values[i], values[i + 1]
    if kind == "linear":
        return start + pct * (end - start)
    return end + (start - end) * (1 + math.cos(math.pi * pct)) / 2


def ref_linear_onecycle(steps, peak, pct_start, pct_final, div, final_div, t):
    # The three phases of optax's docstring, with integer phase ends.
    start, first, second = peak / div, int(pct_start * steps), int(pct_final * steps)
    final = start / final_div
    if t < first:
        return start + (peak - start) * t / first
    if t < second:
        return peak + (start - peak) * (t - first) / (second - first)
    if t < steps:
        return start + (final - start) * (t - second) / (steps - second)
    return final


def ref_cosine_onecycle(steps, peak, pct_start, div, final_div, t):
    start, first = peak / div, int(pct_start * steps)
    final = start / final_div

    def half_cosine(a, b, pct):
        return b + (a - b) * (1 + math.cos(math.pi * pct)) / 2

    if t < first:
        return half_cosine(start, peak, t / first)
    if t < steps:
        return half_cosine(peak, final, (t - first) / (steps - first))
    return final


def close(a, b, scale=1.0):
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12 * max(abs(scale), 1e-300))


steps = st.integers(-5, 3000)
values = st.floats(-10.0, 10.0, allow_nan=False).filter(lambda v: abs(v) > 1e-3)
positive = st.floats(1e-3, 10.0)
lengths = st.integers(1, 500)
begins = st.integers(0, 300)


# --- Golden values at many steps ---------------------------------------------------------


@given(values, values, st.floats(0.25, 4.0), st.integers(-3, 500), begins, steps)
def test_polynomial_matches_formula(init, end, power, n, begin, t):
    schedule = fs.polynomial_schedule(init, end, power, n, begin)
    assert close(schedule(t), ref_polynomial(init, end, power, n, begin, t), abs(init) + abs(end))


@given(values, values, st.integers(-3, 500), begins, steps)
def test_linear_matches_formula(init, end, n, begin, t):
    schedule = fs.linear_schedule(init, end, n, begin)
    assert close(schedule(t), ref_linear(init, end, n, begin, t), abs(init) + abs(end))


@given(positive, lengths, st.floats(0.05, 1.2), begins, st.booleans(),
       st.one_of(st.none(), positive), steps)
def test_exponential_decay_matches_formula(init, n, rate, begin, staircase, end, t):
    schedule = fs.exponential_decay(init, n, rate, begin, staircase, end)
    want = ref_exponential(init, n, rate, begin, staircase, end, t)
    assert math.isclose(schedule(t), want, rel_tol=1e-11)


@given(values, lengths, st.floats(0.0, 1.0), st.floats(0.5, 3.0), steps)
def test_cosine_decay_matches_formula(init, n, alpha, exponent, t):
    schedule = fs.cosine_decay_schedule(init, n, alpha, exponent)
    assert close(schedule(t), ref_cosine(init, n, alpha, exponent, t), init)


@given(st.floats(0.0, 1.0), positive, st.integers(0, 200), st.integers(1, 500),
       st.floats(0.0, 1e-2), st.floats(0.5, 2.0), steps)
def test_warmup_cosine_matches_formula(init, peak, warmup, cosine_steps, end, exponent, t):
    total = warmup + cosine_steps
    schedule = fs.warmup_cosine_decay_schedule(init, peak, warmup, total, end, exponent)
    want = ref_warmup_cosine(init, peak, warmup, total, end, exponent, t)
    assert close(schedule(t), want, peak + init)


@given(positive, positive, st.integers(0, 100), lengths, st.floats(0.05, 0.99), begins,
       st.booleans(), st.one_of(st.none(), st.floats(1e-4, 1e-2)), steps)
def test_warmup_exponential_matches_formula(init, peak, warmup, n, rate, begin, staircase, end,
                                            t):
    schedule = fs.warmup_exponential_decay_schedule(init, peak, warmup, n, rate, begin,
                                                    staircase, end)
    if t < warmup:
        want = ref_linear(init, peak, warmup, 0, t)
    else:
        want = ref_exponential(peak, n, rate, begin, staircase, end, t - warmup)
    assert math.isclose(schedule(t), want, rel_tol=1e-11)


@given(values, st.dictionaries(st.integers(0, 2000), st.floats(0.0, 3.0), max_size=4), steps)
def test_piecewise_constant_matches_formula(init, boundaries_and_scales, t):
    schedule = fs.piecewise_constant_schedule(init, boundaries_and_scales)
    assert close(schedule(t), ref_piecewise_constant(init, boundaries_and_scales, t), init)


@given(st.sampled_from(["linear", "cosine"]), values,
       st.dictionaries(st.integers(0, 2000), st.floats(0.0, 3.0), max_size=4), steps)
def test_piecewise_interpolate_matches_formula(kind, init, boundaries_and_scales, t):
    schedule = fs.piecewise_interpolate_schedule(kind, init, boundaries_and_scales)
    want = ref_piecewise_interpolate(kind, init, boundaries_and_scales, t)
    assert close(schedule(t), want, abs(init) * 30)


@given(st.integers(20, 2000), positive, st.floats(0.1, 0.4), st.floats(0.5, 0.9),
       st.floats(2.0, 50.0), st.floats(10.0, 1e4), st.integers(0, 2500))
def test_linear_onecycle_matches_formula(n, peak, pct_start, pct_final, div, final_div, t):
    schedule = fs.linear_onecycle_schedule(n, peak, pct_start, pct_final, div, final_div)
    want = ref_linear_onecycle(n, peak, pct_start, pct_final, div, final_div, t)
    assert close(schedule(t), want, peak)


@given(st.integers(20, 2000), positive, st.floats(0.1, 0.9), st.floats(2.0, 50.0),
       st.floats(10.0, 1e4), st.integers(0, 2500))
def test_cosine_onecycle_matches_formula(n, peak, pct_start, div, final_div, t):
    schedule = fs.cosine_onecycle_schedule(n, peak, pct_start, div, final_div)
    want = ref_cosine_onecycle(n, peak, pct_start, div, final_div, t)
    assert close(schedule(t), want, peak)


@given(st.lists(st.tuples(positive, st.integers(0, 20), st.integers(1, 100)), min_size=1,
                max_size=4), st.integers(0, 600))
def test_sgdr_restarts_each_cycle(cycles, t):
    kwargs = [dict(init_value=0.0, peak_value=peak, warmup_steps=w, decay_steps=w + n)
              for peak, w, n in cycles]
    schedule = fs.sgdr_schedule(kwargs)
    start = 0
    for i, k in enumerate(kwargs):
        if t < start + k["decay_steps"] or i == len(kwargs) - 1:
            break
        start += k["decay_steps"]
    want = ref_warmup_cosine(0.0, k["peak_value"], k["warmup_steps"], k["decay_steps"], 0.0,
                             1.0, t - start)
    assert close(schedule(t), want, k["peak_value"])


def test_optax_documented_examples():
    # The values printed in optax's docstrings.
    poly = fs.polynomial_schedule(1.0, 0.01, power=2, transition_steps=100, transition_begin=5)
    got = [f"{poly(t):.4f}" for t in (0, 5, 6, 104, 105, 110)]
    assert got == ["1.0000", "1.0000", "0.9803", "0.0101", "0.0100", "0.0100"]
    pc = fs.piecewise_constant_schedule(1.0, {100: 0.1, 200: 0.01})
    assert [pc(50), pc(150)] == [1.0, 0.1]
    assert math.isclose(pc(250), 0.001, rel_tol=1e-15)
    pi = fs.piecewise_interpolate_schedule("linear", 1.0, {4: 0.1, 8: 0.01})
    got = [f"{pi(t):.6f}" for t in range(0, 11, 2)]
    assert got == ["1.000000", "0.550000", "0.100000", "0.050500", "0.001000", "0.001000"]
    assert fs.constant_schedule(5)(100) == 5.0


# --- Int and tensor steps ---------------------------------------------------------------

ALL = {
    "constant": fs.constant_schedule(0.3),
    "polynomial": fs.polynomial_schedule(1.0, 0.1, 2.5, 37, 5),
    "linear": fs.linear_schedule(0.2, 1.0, 50, 3),
    "warmup_constant": fs.warmup_constant_schedule(0.0, 1.0, 7),
    "exponential": fs.exponential_decay(1.0, 9, 0.7, 4, False, 0.05),
    "exponential_staircase": fs.exponential_decay(2.0, 5, 1.5, 0, True, 6.0),
    "cosine": fs.cosine_decay_schedule(1.0, 40, 0.1, 1.5),
    "warmup_cosine": fs.warmup_cosine_decay_schedule(0.0, 1.0, 10, 60, 0.01),
    "warmup_exponential": fs.warmup_exponential_decay_schedule(0.1, 1.0, 10, 7, 0.8, 2),
    "piecewise_constant": fs.piecewise_constant_schedule(1.0, {10: 0.5, 20: 0.1}),
    "piecewise_interpolate": fs.piecewise_interpolate_schedule("cosine", 1.0, {10: 3, 30: 0.1}),
    "linear_onecycle": fs.linear_onecycle_schedule(80, 1.0),
    "cosine_onecycle": fs.cosine_onecycle_schedule(80, 1.0),
    "sgdr": fs.sgdr_schedule([dict(init_value=0.0, peak_value=1.0, warmup_steps=3,
                                   decay_steps=20)] * 3),
    "join": fs.join_schedules([fs.constant_schedule(1.0), fs.linear_schedule(1.0, 0.0, 10),
                               fs.cosine_decay_schedule(0.5, 10)], [5, 15]),
}


@pytest.mark.parametrize("name", sorted(ALL))
def test_int_and_tensor_steps_agree_bitwise(name):
    schedule = ALL[name]
    for t in range(-3, 100):
        value = schedule(t)
        assert type(value) is float
        for dtype in (torch.int32, torch.int64):
            out = schedule(torch.tensor(t, dtype=dtype))
            assert out.dtype == torch.float64 and out.shape == ()
            assert out.item() == value, (t, dtype)


@pytest.mark.parametrize("name", sorted(ALL))
def test_tensor_steps_need_no_host_sync(name):
    # vmap refuses .item() and Python branching on tensor values, so a schedule that maps
    # over a batch of steps reads nothing back to the host.
    schedule = ALL[name]
    counts = torch.arange(-3, 100, dtype=torch.int32)
    batched = torch.func.vmap(schedule)(counts)
    assert batched.dtype == torch.float64
    # Vectorised kernels (pow, cos) may round differently from the 0-d ones, in the last bit.
    want = torch.tensor([schedule(t) for t in range(-3, 100)], dtype=torch.float64)
    torch.testing.assert_close(batched, want, rtol=1e-14, atol=0.0)


@pytest.mark.parametrize("name", sorted(ALL))
def test_saturated_int32_count(name):
    # The count saturates at the int32 maximum; the schedule must not overflow on it.
    value = ALL[name](torch.tensor(2**31 - 1, dtype=torch.int32))
    assert math.isfinite(value.item())


def test_tensor_hyperparameters_give_tensors_and_gradients():
    init = torch.tensor(2.0, dtype=torch.float64)
    schedule = fs.cosine_decay_schedule(init, 10, alpha=0.1)
    out = schedule(3)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    slope = torch.func.grad(lambda v: fs.cosine_decay_schedule(v, 10, alpha=0.1)(3))(init)
    assert close(slope.item(), ref_cosine(1.0, 10, 0.1, 1.0, 3))
    rate = torch.tensor(0.5, dtype=torch.float64)
    d_rate = torch.func.grad(lambda r: fs.exponential_decay(1.0, 1, r)(torch.tensor(3)))(rate)
    assert close(d_rate.item(), 3 * 0.5**2)
    # Before the decay starts the gradient is exactly zero, not nan.
    d_rate = torch.func.grad(lambda r: fs.exponential_decay(1.0, 1, r, 5)(torch.tensor(2)))(rate)
    assert d_rate.item() == 0.0
    peak = torch.tensor(0.0, dtype=torch.float64)
    d_peak = torch.func.grad(
        lambda p: fs.warmup_cosine_decay_schedule(0.0, p, 2, 10, 0.1)(torch.tensor(5)))(peak)
    assert math.isfinite(d_peak.item())


def test_float_step_tensor_accepted():
    schedule = fs.linear_schedule(0.0, 1.0, 4)
    assert schedule(torch.tensor(2.0)).item() == 0.5


# --- Boundaries -------------------------------------------------------------------------


def test_transition_begin_boundary():
    schedule = fs.linear_schedule(1.0, 3.0, transition_steps=10, transition_begin=5)
    assert [schedule(t) for t in (0, 4, 5, 6, 15, 16)] == [1.0, 1.0, 1.0, 1.2, 3.0, 3.0]
    decay = fs.exponential_decay(1.0, 2, 0.5, transition_begin=3, staircase=True)
    assert [decay(t) for t in (2, 3, 4, 5, 6)] == [1.0, 1.0, 1.0, 0.5, 0.5]


def test_end_of_warmup_is_exactly_peak():
    schedule = fs.warmup_cosine_decay_schedule(0.0, 0.7, warmup_steps=10, decay_steps=30,
                                               end_value=0.1)
    assert schedule(10) == 0.7 and schedule(9) < 0.7 and schedule(11) < 0.7
    assert close(schedule(30), 0.1) and close(schedule(1000), 0.1)
    expo = fs.warmup_exponential_decay_schedule(0.0, 0.7, 10, 5, 0.5)
    assert expo(10) == 0.7 and close(expo(15), 0.35)


def test_zero_warmup_starts_at_peak():
    schedule = fs.warmup_cosine_decay_schedule(0.5, 1.0, warmup_steps=0, decay_steps=10)
    assert schedule(0) == 1.0
    # optax's warmup_constant_schedule joins its warmup and the constant at warmup_steps:
    # with none, the peak from the first step (not the init value forever)
    constant = fs.warmup_constant_schedule(0.5, 1.0, warmup_steps=0)
    assert [constant(t) for t in (0, 1, 100)] == [1.0, 1.0, 1.0]
    assert float(constant(torch.tensor(3, dtype=torch.int32))) == 1.0
    expo = fs.warmup_exponential_decay_schedule(0.5, 1.0, 0, 5, 0.5)
    assert expo(0) == 1.0 and close(expo(5), 0.5)


def test_join_boundaries_restart_the_count():
    seen = []

    def recorder(tag):
        def schedule(step):
            seen.append((tag, step))
            return float(tag)
        return schedule

    joined = fs.join_schedules([recorder(0), recorder(1), recorder(2)], [3, 3 + 4])
    assert [joined(t) for t in range(9)] == [0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert seen[3] == (1, 0) and seen[7] == (2, 0)


def test_join_equal_boundaries_skip_a_schedule():
    joined = fs.join_schedules(
        [fs.constant_schedule(0.0), fs.constant_schedule(1.0), fs.constant_schedule(2.0)], [3, 3])
    assert [joined(t) for t in range(5)] == [0.0, 0.0, 0.0, 2.0, 2.0]
    assert joined(torch.tensor(3)).item() == 2.0


def test_negative_steps_follow_optax():
    assert fs.linear_schedule(1.0, 0.0, 10)(-5) == 1.0  # clamped at the start
    cosine = fs.cosine_decay_schedule(1.0, 10)
    assert cosine(-3) == cosine(3)  # only the top is clamped
    assert fs.piecewise_interpolate_schedule("linear", 1.0, {5: 2.0})(-1) == 0.0


def test_non_positive_transition_steps_give_a_constant():
    assert fs.linear_schedule(0.5, 1.0, 0)(10) == 0.5
    assert fs.polynomial_schedule(0.5, 1.0, 2, -4)(10) == 0.5


# --- torch.optim.lr_scheduler parity ----------------------------------------------------


def _torch_lrs(make_scheduler, base_lr, n):
    param = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=base_lr)
    scheduler = make_scheduler(optimizer)
    lrs = []
    for _ in range(n):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("t_max", [1, 7, 100])
def test_cosine_decay_equals_cosine_annealing_lr(t_max):
    want = _torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=t_max),
                      0.1, t_max + 1)
    schedule = fs.cosine_decay_schedule(0.1, t_max)
    for t, lr in enumerate(want):
        assert math.isclose(schedule(t), lr, rel_tol=1e-9, abs_tol=1e-15), t


@pytest.mark.parametrize("step_size,gamma", [(1, 0.5), (3, 0.1), (10, 0.9)])
def test_staircase_exponential_decay_equals_step_lr(step_size, gamma):
    want = _torch_lrs(
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=step_size, gamma=gamma), 0.1, 60)
    schedule = fs.exponential_decay(0.1, step_size, gamma, staircase=True)
    for t, lr in enumerate(want):
        assert math.isclose(schedule(t), lr, rel_tol=1e-12), t


def test_exponential_decay_equals_exponential_lr():
    want = _torch_lrs(lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.95), 0.1, 60)
    schedule = fs.exponential_decay(0.1, 1, 0.95)
    for t, lr in enumerate(want):
        assert math.isclose(schedule(t), lr, rel_tol=1e-12), t


def test_piecewise_constant_equals_multi_step_lr():
    want = _torch_lrs(
        lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[5, 12], gamma=0.3), 0.1, 20)
    schedule = fs.piecewise_constant_schedule(0.1, {5: 0.3, 12: 0.3})
    for t, lr in enumerate(want):
        assert math.isclose(schedule(t), lr, rel_tol=1e-12), t


def test_polynomial_equals_polynomial_lr():
    want = _torch_lrs(
        lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=12, power=2.0), 0.1, 20)
    schedule = fs.polynomial_schedule(0.1, 0.0, 2.0, 12)
    for t, lr in enumerate(want):
        assert math.isclose(schedule(t), lr, rel_tol=1e-9, abs_tol=1e-15), t


# --- Errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build,error,match",
    [
        (lambda: fs.constant_schedule("a"), TypeError, "constant_schedule: value must be"),
        (lambda: fs.constant_schedule(torch.ones(2)), TypeError, "0-d tensor"),
        (lambda: fs.linear_schedule(0.0, 1.0, 10.0), TypeError,
         r"linear_schedule: transition_steps must be a Python int .* got float 10.0"),
        (lambda: fs.linear_schedule(0.0, 1.0, 10, -1), ValueError,
         r"linear_schedule: transition_begin must be >= 0, got -1"),
        (lambda: fs.polynomial_schedule(0.0, 1.0, None, 10), TypeError,
         "polynomial_schedule: power must be"),
        (lambda: fs.warmup_constant_schedule(0.0, 1.0, -2), ValueError,
         "warmup_constant_schedule: warmup_steps must be >= 0"),
        (lambda: fs.exponential_decay(1.0, 0, 0.5), ValueError,
         "exponential_decay: transition_steps must be >= 1, got 0. Fix"),
        (lambda: fs.exponential_decay(1.0, 10, 0.0), ValueError,
         r"exponential_decay: decay_rate must be in \(0, inf\), got 0.0"),
        (lambda: fs.exponential_decay(1.0, 10, 0.5, -3), ValueError,
         "exponential_decay: transition_begin must be >= 0"),
        (lambda: fs.exponential_decay(1.0, 10, 0.5, staircase=1), TypeError,
         "staircase must be True or False"),
        (lambda: fs.exponential_decay(1.0, 10, 0.5, end_value="x"), TypeError,
         "end_value must be"),
        (lambda: fs.cosine_decay_schedule(1.0, 0), ValueError,
         "cosine_decay_schedule: decay_steps must be >= 1, got 0"),
        (lambda: fs.cosine_decay_schedule(1.0, 10, alpha=[0.1]), TypeError, "alpha must be"),
        (lambda: fs.warmup_cosine_decay_schedule(0.0, 1.0, 10, 10), ValueError,
         "decay_steps must be greater than warmup_steps, got decay_steps=10 and "
         "warmup_steps=10.*warmup included"),
        (lambda: fs.warmup_cosine_decay_schedule(0.0, 1.0, -1, 10), ValueError,
         "warmup_cosine_decay_schedule: warmup_steps must be >= 0"),
        (lambda: fs.warmup_exponential_decay_schedule(0.0, 1.0, 5, 0, 0.5), ValueError,
         "warmup_exponential_decay_schedule: transition_steps must be >= 1"),
        (lambda: fs.piecewise_constant_schedule(1.0, {10: -0.5}), ValueError,
         r"piecewise_constant_schedule: the scale at step 10 must be in \[0, inf\), got -0.5"),
        (lambda: fs.piecewise_constant_schedule(1.0, {-2: 0.5}), ValueError,
         "each boundary .* must be >= 0, got -2"),
        (lambda: fs.piecewise_constant_schedule(1.0, {2.5: 0.5}), TypeError,
         "each boundary .* must be a Python int"),
        (lambda: fs.piecewise_constant_schedule(1.0, [(2, 0.5)]), TypeError,
         r"boundaries_and_scales must be a dict \{step: scale\} or None, got list"),
        (lambda: fs.piecewise_interpolate_schedule("quadratic", 1.0), ValueError,
         "interpolate_type must be 'linear' or 'cosine', got 'quadratic'"),
        (lambda: fs.linear_onecycle_schedule(0, 1.0), ValueError,
         "linear_onecycle_schedule: transition_steps must be >= 1"),
        (lambda: fs.linear_onecycle_schedule(100, 1.0, pct_start=1.5), ValueError,
         r"pct_start must be a Python number in \[0, 1\], got 1.5"),
        (lambda: fs.linear_onecycle_schedule(100, 1.0, pct_start=0.6, pct_final=0.5), ValueError,
         r"pct_final \(0.5\) must not be less than pct_start \(0.6\)"),
        (lambda: fs.linear_onecycle_schedule(100, 1.0, div_factor=0.0), ValueError,
         r"div_factor must be in \(0, inf\)"),
        (lambda: fs.cosine_onecycle_schedule(-5, 1.0), ValueError,
         "cosine_onecycle_schedule: transition_steps must be >= 1"),
        (lambda: fs.cosine_onecycle_schedule(100, 1.0, final_div_factor=-1.0), ValueError,
         "final_div_factor must be in"),
        (lambda: fs.join_schedules([], []), ValueError, "expected at least one schedule"),
        (lambda: fs.join_schedules([fs.constant_schedule(1.0), 0.5], [3]), TypeError,
         r"schedules\[1\] must be a schedule .* got float 0.5. Fix: wrap a constant"),
        (lambda: fs.join_schedules([fs.constant_schedule(1.0)] * 2, [3, 4]), ValueError,
         r"2 schedules need 1 boundaries \(one per switch\), got 2: \[3, 4\]"),
        (lambda: fs.join_schedules([fs.constant_schedule(1.0)] * 3, [5, 2]), ValueError,
         r"boundaries must not decrease, got \[5, 2\]"),
        (lambda: fs.join_schedules([fs.constant_schedule(1.0)] * 2, [2.0]), TypeError,
         r"boundaries\[0\] must be a Python int"),
        (lambda: fs.sgdr_schedule([]), ValueError, "sgdr_schedule: expected at least one cycle"),
        (lambda: fs.sgdr_schedule([5]), TypeError, "cycle 0 must be a dict"),
        (lambda: fs.sgdr_schedule([dict(init_value=0.0, peak_value=1.0, decay_steps=5,
                                        steps=3)]), TypeError,
         r"cycle 0 has unknown arguments \['steps'\] and lacks \['warmup_steps'\]"),
        (lambda: fs.sgdr_schedule([dict(init_value=0.0, peak_value=1.0, warmup_steps=5,
                                        decay_steps=5)]), ValueError,
         r"sgdr_schedule \(cycle 0\): decay_steps must be greater than warmup_steps"),
    ],
)
def test_errors(build, error, match):
    with pytest.raises(error, match=match):
        build()


@pytest.mark.parametrize(
    "step,match",
    [
        ("3", "the step must be a Python int or a 0-d integer tensor, got str '3'"),
        (True, "got bool True"),
        (torch.arange(3), r"got a int64 tensor of shape \(3,\)"),
        (torch.tensor(True), "got a bool tensor"),
    ],
)
@pytest.mark.parametrize("name", ["linear", "join", "cosine"])
def test_bad_steps(name, step, match):
    with pytest.raises(TypeError, match=match):
        ALL[name](step)


def test_step_errors_name_the_schedule_called():
    with pytest.raises(TypeError, match=r"^warmup_cosine_decay_schedule: the step must be"):
        ALL["warmup_cosine"]("1")
    with pytest.raises(TypeError, match=r"^sgdr_schedule: the step must be"):
        ALL["sgdr"](None)
    with pytest.raises(TypeError, match=r"^linear_onecycle_schedule: the step must be"):
        ALL["linear_onecycle"](1j)
