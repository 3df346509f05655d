"""Exponential decay, with or without a linear warmup."""

from __future__ import annotations

import torch

from functopt import _validate
from functopt._base import Schedule
from functopt.schedules import _common, _join, _polynomial
from functopt.schedules._common import Value

__all__ = [
    "exponential_decay",
    "warmup_exponential_decay_schedule",
]


def exponential_decay(
    init_value: Value,
    transition_steps: int,
    decay_rate: Value,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: Value | None = None,
) -> Schedule:
    r"""Decay ``init_value`` by ``decay_rate`` every ``transition_steps`` steps.

    With $B$ = ``transition_begin`` and $T$ = ``transition_steps``:

    $$
    p = \frac{\max(t - B, 0)}{T} \quad (\lfloor p \rfloor \text{ with staircase}), \qquad
    v(t) = \text{init\_value} \cdot \text{decay\_rate}^{\,p},
    $$

    then, if ``end_value`` is given, $v$ is clipped to it from below (``decay_rate <
    1``) or from above (``decay_rate > 1``). ``staircase=True`` with ``transition_begin=0``
    is ``torch.optim.lr_scheduler.StepLR(step_size=transition_steps, gamma=decay_rate)``.

    Unlike optax, which logs a message and falls back to a constant schedule (or to
    ``transition_begin=0``), this raises for ``transition_steps <= 0``, ``decay_rate <= 0``
    and ``transition_begin < 0``: optax documents all three as invalid.

    Args:
        init_value: the value up to step ``transition_begin``.
        transition_steps: steps per factor of ``decay_rate``, > 0.
        decay_rate: the factor, > 0 (below 1 to decay).
        transition_begin: steps to hold ``init_value`` first, >= 0.
        staircase: decay in jumps, every ``transition_steps`` steps.
        end_value: the bound the value stops at (``None``: no bound).

    Returns:
        A schedule ``step -> value``.

    Examples:
        >>> import functopt.schedules
        >>> schedule = functopt.schedules.exponential_decay(
        ...     1.0, transition_steps=2, decay_rate=0.5, staircase=True, end_value=0.2)
        >>> [schedule(t) for t in range(7)]
        [1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.2]
    """
    return exponential("exponential_decay", init_value, transition_steps, decay_rate,
                       transition_begin, staircase, end_value)


def exponential(
    owner: str,
    init_value: Value,
    transition_steps: int,
    decay_rate: Value,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: Value | None = None,
) -> Schedule:
    """[`exponential_decay`][functopt.schedules.exponential_decay], with errors naming ``owner``."""
    _common.check_value(owner, "init_value", init_value)
    _common.check_int(owner, "transition_steps", transition_steps, low=1,
                      hint="Fix: it is the number of steps per factor of decay_rate; use "
                      "constant_schedule for a value that never changes.")
    _common.check_positive(owner, "decay_rate", decay_rate)
    _common.check_int(owner, "transition_begin", transition_begin, low=0,
                      hint="Fix: pass 0 to start the decay at the first step.")
    _validate.check_flags(owner, staircase=staircase)
    if end_value is not None:
        _common.check_value(owner, "end_value", end_value)

    def compute(t: torch.Tensor) -> torch.Tensor:
        # Clamping before the power (instead of selecting init_value afterwards with
        # torch.where) keeps gradients finite: decay_rate ** p for p < 0 may overflow.
        p = torch.clamp(t - transition_begin, min=0) / transition_steps
        if staircase:
            p = torch.floor(p)
        rate = _common.f64(decay_rate)
        value: torch.Tensor = _common.f64(init_value) * rate ** p
        if end_value is None:
            return value
        bound = _common.lift(end_value, value)
        if isinstance(rate, torch.Tensor):
            return torch.where(rate < 1, torch.maximum(value, bound), torch.minimum(value, bound))
        return torch.maximum(value, bound) if rate < 1 else torch.minimum(value, bound)

    values = [init_value, decay_rate] + ([] if end_value is None else [end_value])
    return _common.make_schedule(owner, compute, values)


def warmup_exponential_decay_schedule(
    init_value: Value,
    peak_value: Value,
    warmup_steps: int,
    transition_steps: int,
    decay_rate: Value,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: Value | None = None,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value``, then [`exponential_decay`][functopt.schedules.exponential_decay].

    Steps ``0 .. warmup_steps`` rise linearly; from step ``warmup_steps`` on the value is
    ``exponential_decay(peak_value, transition_steps, decay_rate, transition_begin,
    staircase, end_value)`` evaluated at ``step - warmup_steps``.

    Args:
        init_value: value at step 0.
        peak_value: value at the end of the warmup.
        warmup_steps: length of the warmup, >= 0.
        transition_steps: steps per factor of ``decay_rate``, > 0.
        decay_rate: the factor, > 0.
        transition_begin: steps to hold ``peak_value`` after the warmup, >= 0.
        staircase: decay in jumps.
        end_value: the bound the decay stops at (``None``: no bound).

    Returns:
        A schedule ``step -> value``.

    Examples:
        >>> import functopt.schedules
        >>> schedule = functopt.schedules.warmup_exponential_decay_schedule(
        ...     0.0, 1.0, warmup_steps=2, transition_steps=1, decay_rate=0.5)
        >>> [schedule(t) for t in range(5)]
        [0.0, 0.5, 1.0, 0.5, 0.25]
    """
    owner = "warmup_exponential_decay_schedule"
    _common.check_int(owner, "warmup_steps", warmup_steps, low=0)
    warmup = _polynomial.polynomial(owner, init_value, peak_value, 1, warmup_steps)
    decay = exponential(owner, peak_value, transition_steps, decay_rate, transition_begin,
                        staircase, end_value)
    return _join.join(owner, [warmup, decay], [warmup_steps])
