"""Constant, linear and polynomial schedules."""

from __future__ import annotations

import torch

from functopt._base import Schedule
from functopt.schedules import _common
from functopt.schedules._common import Value

__all__ = [
    "constant_schedule",
    "linear_schedule",
    "polynomial_schedule",
    "warmup_constant_schedule",
]


def constant_schedule(value: Value) -> Schedule:
    """The schedule that returns ``value`` at every step.

    Args:
        value: a number or a 0-d tensor.

    Returns:
        A schedule ``step -> value`` (a Python float for an int step, a 0-d float64 tensor
        for a tensor step or a tensor ``value``).

    Examples:
        >>> import torch, functopt.schedules
        >>> schedule = functopt.schedules.constant_schedule(0.5)
        >>> schedule(0), schedule(100)
        (0.5, 0.5)
        >>> schedule(torch.tensor(7, dtype=torch.int32))
        tensor(0.5000, dtype=torch.float64)
    """
    owner = "constant_schedule"
    _common.check_value(owner, "value", value)

    def compute(t: torch.Tensor) -> torch.Tensor:
        return _common.lift(value, t)

    return _common.make_schedule(owner, compute, [value])


def polynomial_schedule(
    init_value: Value,
    end_value: Value,
    power: Value,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    r"""Move from ``init_value`` to ``end_value`` along a polynomial of degree ``power``.

    With $I$ = ``init_value``, $E$ = ``end_value``, $P$ = ``power``,
    $B$ = ``transition_begin`` and $T$ = ``transition_steps``, the value at step
    $t$ is

    $$
    v(t) = (I - E)\left(1 - \frac{\min(\max(t - B, 0), T)}{T}\right)^{P} + E,
    $$

    so $I$ up to step $B$, and $E$ from step $B + T$ on. As in optax,
    ``transition_steps <= 0`` gives the constant schedule ``init_value``.

    Args:
        init_value: value before and at ``transition_begin``.
        end_value: value from ``transition_begin + transition_steps`` on.
        power: degree of the polynomial (1 is linear).
        transition_steps: length of the transition, in steps.
        transition_begin: steps to hold ``init_value`` before the transition starts, >= 0.

    Returns:
        A schedule ``step -> value``.

    Examples:
        >>> import functopt.schedules
        >>> schedule = functopt.schedules.polynomial_schedule(1.0, 0.0, power=2,
        ...                                                   transition_steps=10)
        >>> [round(schedule(t), 4) for t in (0, 5, 10, 20)]
        [1.0, 0.25, 0.0, 0.0]
    """
    return polynomial("polynomial_schedule", init_value, end_value, power, transition_steps,
                      transition_begin)


def polynomial(
    owner: str,
    init_value: Value,
    end_value: Value,
    power: Value,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    """[`polynomial_schedule`][functopt.schedules.polynomial_schedule], with errors naming ``owner`` (for the schedules built on it)."""
    for name, value in (("init_value", init_value), ("end_value", end_value), ("power", power)):
        _common.check_value(owner, name, value)
    _common.check_int(owner, "transition_steps", transition_steps)
    _common.check_int(owner, "transition_begin", transition_begin, low=0,
                      hint="Fix: pass 0 to start the transition at the first step.")
    if transition_steps <= 0:
        return constant_schedule(init_value)

    def compute(t: torch.Tensor) -> torch.Tensor:
        done = torch.clamp(t - transition_begin, 0, transition_steps)
        frac = 1 - done / transition_steps
        init, end = _common.f64(init_value), _common.f64(end_value)
        value: torch.Tensor = (init - end) * frac ** _common.f64(power) + end
        return value

    return _common.make_schedule(owner, compute, [init_value, end_value, power])


def linear_schedule(
    init_value: Value,
    end_value: Value,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    r"""Move linearly from ``init_value`` to ``end_value`` over ``transition_steps`` steps.

    This is [`polynomial_schedule`][functopt.schedules.polynomial_schedule] with ``power=1``: $I$ up to step $B$,
    then $I + \frac{t - B}{T}(E - I)$, then $E$ from step $B + T$ on.

    Args:
        init_value: value before and at ``transition_begin``.
        end_value: value from ``transition_begin + transition_steps`` on.
        transition_steps: length of the transition (``<= 0``: constant ``init_value``).
        transition_begin: steps to hold ``init_value`` first, >= 0.

    Returns:
        A schedule ``step -> value``.

    Examples:
        >>> import functopt.schedules
        >>> schedule = functopt.schedules.linear_schedule(0.0, 1.0, transition_steps=4)
        >>> [schedule(t) for t in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    return polynomial("linear_schedule", init_value, end_value, 1, transition_steps,
                      transition_begin)


def warmup_constant_schedule(init_value: Value, peak_value: Value, warmup_steps: int) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value``, then constant ``peak_value``.

    Args:
        init_value: value at step 0.
        peak_value: value from step ``warmup_steps`` on.
        warmup_steps: length of the warmup (0: ``peak_value`` from the first step, as
            optax's).

    Returns:
        A schedule ``step -> value``.

    Examples:
        >>> import functopt.schedules
        >>> schedule = functopt.schedules.warmup_constant_schedule(0.0, 1.0, warmup_steps=2)
        >>> [schedule(t) for t in range(4)]
        [0.0, 0.5, 1.0, 1.0]
    """
    owner = "warmup_constant_schedule"
    _common.check_int(owner, "warmup_steps", warmup_steps, low=0)
    warmup = polynomial(owner, init_value, peak_value, 1, warmup_steps)  # (checks the values)
    return warmup if warmup_steps > 0 else constant_schedule(peak_value)
