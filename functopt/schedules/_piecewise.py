"""Piecewise schedules: constant pieces, interpolated pieces, and the one-cycle policies."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from functopt._base import Schedule
from functopt.schedules import _common
from functopt.schedules._common import Value

__all__ = [
    "cosine_onecycle_schedule",
    "linear_onecycle_schedule",
    "piecewise_constant_schedule",
    "piecewise_interpolate_schedule",
]


def _boundaries_and_scales(
    owner: str, boundaries_and_scales: Mapping[int, Value] | None
) -> list[tuple[int, Value]]:
    """The ``{step: scale}`` items sorted by step, checked (steps >= 0 ints, scales >= 0)."""
    if boundaries_and_scales is None:
        return []
    if not isinstance(boundaries_and_scales, Mapping):
        raise TypeError(
            f"{owner}: boundaries_and_scales must be a dict {{step: scale}} or None, got "
            f"{type(boundaries_and_scales).__name__}."
        )
    for boundary, scale in boundaries_and_scales.items():
        _common.check_int(owner, "each boundary (key of boundaries_and_scales)", boundary, low=0)
        _common.check_nonnegative(owner, f"the scale at step {boundary}", scale)
    return sorted(boundaries_and_scales.items(), key=lambda item: item[0])


def piecewise_constant_schedule(
    init_value: Value, boundaries_and_scales: Mapping[int, Value] | None = None
) -> Schedule:
    r"""``init_value`` times the product of every scale whose boundary the step has reached.

    $v(t) = \text{init\_value}\prod_{i:\, t \ge b_i} s_i$ for
    ``boundaries_and_scales = {b_i: s_i}``. This is ``torch.optim.lr_scheduler.MultiStepLR``
    when every scale is its ``gamma``.

    Args:
        init_value: the value before the first boundary.
        boundaries_and_scales: ``{step: scale}``; steps are ints >= 0, scales >= 0.

    Returns:
        A schedule ``step -> value``.

    Examples:
        >>> import functopt.schedules
        >>> schedule = functopt.schedules.piecewise_constant_schedule(
        ...     1.0, {2: 0.5, 4: 0.1})
        >>> [schedule(t) for t in range(6)]
        [1.0, 1.0, 0.5, 0.5, 0.05, 0.05]
    """
    owner = "piecewise_constant_schedule"
    _common.check_value(owner, "init_value", init_value)
    items = _boundaries_and_scales(owner, boundaries_and_scales)

    def compute(t: torch.Tensor) -> torch.Tensor:
        value = _common.lift(init_value, t)
        for boundary, scale in items:
            value = torch.where(t >= boundary, value * _common.f64(scale), value)
        return value

    return _common.make_schedule(owner, compute, [init_value, *(s for _, s in items)])


def _linear(start: Any, end: Any, pct: torch.Tensor) -> torch.Tensor:
    value: torch.Tensor = (end - start) * pct + start
    return value


def _cosine(start: Any, end: Any, pct: torch.Tensor) -> torch.Tensor:
    value: torch.Tensor = end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1)
    return value


_INTERPOLATIONS: dict[str, Callable[[Any, Any, torch.Tensor], torch.Tensor]] = {
    "linear": _linear,
    "cosine": _cosine,
}


def piecewise_interpolate_schedule(
    interpolate_type: str,
    init_value: Value,
    boundaries_and_scales: Mapping[int, Value] | None = None,
) -> Schedule:
    r"""Interpolate (linearly or by a half cosine) between values scaled at boundaries.

    With boundaries $0 = b_0 < b_1 < \dots < b_n$ (from ``boundaries_and_scales``) and
    values $v_0 = \text{init\_value}$, $v_i = v_{i-1} s_i$, step
    $b_i \le t < b_{i+1}$ gets the interpolation from $v_i$ to $v_{i+1}$ at
    $(t - b_i)/\max(b_{i+1} - b_i, 1)$, and steps $t \ge b_n$ get $v_n$.
    As in optax, negative steps give 0 and the scales are accumulated, not interpolated.

    Args:
        interpolate_type: ``"linear"`` or ``"cosine"``.
        init_value: the value at step 0.
        boundaries_and_scales: ``{step: scale}``; steps are ints >= 0, scales >= 0.

    Returns:
        A schedule ``step -> value``.

    Examples:
        >>> import functopt.schedules
        >>> schedule = functopt.schedules.piecewise_interpolate_schedule(
        ...     "linear", 1.0, {4: 0.5})
        >>> [schedule(t) for t in range(6)]
        [1.0, 0.875, 0.75, 0.625, 0.5, 0.5]
    """
    return piecewise_interpolate("piecewise_interpolate_schedule", interpolate_type, init_value,
                                 boundaries_and_scales)


def piecewise_interpolate(
    owner: str,
    interpolate_type: str,
    init_value: Value,
    boundaries_and_scales: Mapping[int, Value] | None = None,
) -> Schedule:
    """[`piecewise_interpolate_schedule`][functopt.schedules.piecewise_interpolate_schedule], with errors naming ``owner``."""
    if interpolate_type not in _INTERPOLATIONS:
        raise ValueError(
            f"{owner}: interpolate_type must be 'linear' or 'cosine', got {interpolate_type!r}."
        )
    interpolate = _INTERPOLATIONS[interpolate_type]
    _common.check_value(owner, "init_value", init_value)
    items = _boundaries_and_scales(owner, boundaries_and_scales)
    bounds = [0] + [b for b, _ in items]
    scales = [s for _, s in items]

    def compute(t: torch.Tensor) -> torch.Tensor:
        values = [_common.f64(init_value)]
        for scale in scales:
            values.append(values[-1] * _common.f64(scale))
        zero = torch.zeros_like(t)
        # A sum of selections, as in optax; torch.where (not a 0/1 product) keeps a
        # non-finite value of an inactive piece out of the result.
        out = torch.where(t >= bounds[-1], _common.lift(values[-1], t), zero)
        for i in range(len(bounds) - 1):
            size = max(bounds[i + 1] - bounds[i], 1)
            piece = interpolate(values[i], values[i + 1], (t - bounds[i]) / size)
            inside = (t >= bounds[i]) & (t < bounds[i + 1])
            out = out + torch.where(inside, piece, zero)
        return out

    return _common.make_schedule(owner, compute, [init_value, *scales])


def _check_onecycle(owner: str, transition_steps: int, peak_value: Value,
                    **positive: Any) -> None:
    _common.check_int(owner, "transition_steps", transition_steps, low=1)
    _common.check_value(owner, "peak_value", peak_value)
    for name, value in positive.items():
        _common.check_positive(owner, name, value)


def _check_fraction(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{owner}: {name} must be a Python number in [0, 1], got {value!r}.")


def linear_onecycle_schedule(
    transition_steps: int,
    peak_value: Value,
    pct_start: float = 0.3,
    pct_final: float = 0.85,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    """The one-cycle policy with three linear phases.

    From ``peak_value / div_factor`` up to ``peak_value`` at step ``int(pct_start *
    transition_steps)``, back down to ``peak_value / div_factor`` at step ``int(pct_final *
    transition_steps)``, then down to ``peak_value / div_factor / final_div_factor`` at step
    ``transition_steps``, where it stays. Built, as in optax, with
    [`piecewise_interpolate_schedule`][functopt.schedules.piecewise_interpolate_schedule] (so a phase that rounds to zero steps is skipped
    the same way).

    Args:
        transition_steps: length of the cycle, > 0.
        peak_value: the highest value.
        pct_start: fraction of the cycle spent rising, in [0, 1].
        pct_final: fraction of the cycle at which the value is back at the start value,
            in [``pct_start``, 1].
        div_factor: start value is ``peak_value / div_factor``; > 0.
        final_div_factor: final value is ``peak_value / div_factor / final_div_factor``; > 0.

    Returns:
        A schedule ``step -> value``.

    Examples:
        >>> import functopt.schedules
        >>> schedule = functopt.schedules.linear_onecycle_schedule(
        ...     10, 1.0, pct_start=0.2, pct_final=0.6, div_factor=4.0, final_div_factor=5.0)
        >>> [round(schedule(t), 4) for t in (0, 1, 2, 4, 6, 8, 10, 11)]
        [0.25, 0.625, 1.0, 0.625, 0.25, 0.15, 0.05, 0.05]

    References:
        Smith & Topin, *Super-Convergence: Very Fast Training of Neural Networks Using Large
        Learning Rates*, 2017.
    """
    owner = "linear_onecycle_schedule"
    _check_onecycle(owner, transition_steps, peak_value, div_factor=div_factor,
                    final_div_factor=final_div_factor)
    _check_fraction(owner, "pct_start", pct_start)
    _check_fraction(owner, "pct_final", pct_final)
    if pct_final < pct_start:
        raise ValueError(
            f"{owner}: pct_final ({pct_final}) must not be less than pct_start ({pct_start}): "
            f"the value rises until pct_start, then falls until pct_final."
        )
    return piecewise_interpolate(
        owner,
        "linear",
        peak_value / div_factor,
        {
            int(pct_start * transition_steps): div_factor,
            int(pct_final * transition_steps): 1.0 / div_factor,
            transition_steps: 1.0 / final_div_factor,
        },
    )


def cosine_onecycle_schedule(
    transition_steps: int,
    peak_value: Value,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    """The one-cycle policy with half-cosine phases (``torch.optim.lr_scheduler.OneCycleLR``).

    From ``peak_value / div_factor`` up to ``peak_value`` at step ``int(pct_start *
    transition_steps)``, then down to ``peak_value / (div_factor * final_div_factor)`` at
    step ``transition_steps``, where it stays; both phases follow a half cosine.

    Args:
        transition_steps: length of the cycle, > 0.
        peak_value: the highest value.
        pct_start: fraction of the cycle spent rising, in [0, 1].
        div_factor: start value is ``peak_value / div_factor``; > 0.
        final_div_factor: final value is ``peak_value / (div_factor * final_div_factor)``; > 0.

    Returns:
        A schedule ``step -> value``.

    Examples:
        >>> import functopt.schedules
        >>> schedule = functopt.schedules.cosine_onecycle_schedule(
        ...     10, 1.0, pct_start=0.2, div_factor=4.0, final_div_factor=5.0)
        >>> [round(schedule(t), 4) for t in (0, 1, 2, 6, 10, 11)]
        [0.25, 0.625, 1.0, 0.525, 0.05, 0.05]

    References:
        Smith & Topin, *Super-Convergence: Very Fast Training of Neural Networks Using Large
        Learning Rates*, 2017.
    """
    owner = "cosine_onecycle_schedule"
    _check_onecycle(owner, transition_steps, peak_value, div_factor=div_factor,
                    final_div_factor=final_div_factor)
    _check_fraction(owner, "pct_start", pct_start)
    return piecewise_interpolate(
        owner,
        "cosine",
        peak_value / div_factor,
        {
            int(pct_start * transition_steps): div_factor,
            transition_steps: 1.0 / (div_factor * final_div_factor),
        },
    )
