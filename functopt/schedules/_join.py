"""Joining schedules end to end: ``join_schedules``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from functopt._base import Schedule
from functopt.schedules import _common

__all__ = ["join_schedules"]


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    r"""Run ``schedules`` one after another, switching at ``boundaries``.

    With boundaries $b_1 \le \dots \le b_{n-1}$ (and $b_0 = 0$), step $t$
    with $b_i \le t < b_{i+1}$ gets ``schedules[i](t - b_i)``: each schedule counts
    its steps from its own start. Steps before $b_1$ (negative ones too) go to
    ``schedules[0](t)``.

    For a tensor step every schedule is evaluated and the result picked with
    ``torch.where`` (no host sync); each schedule must then accept the step shifted below
    zero (all of `functopt.schedules` do). For a Python step only the schedule in force
    is called. Unlike optax, the lengths are checked (``len(boundaries) ==
    len(schedules) - 1``) and boundaries must not decrease.

    Args:
        schedules: the schedules, in order; at least one.
        boundaries: the steps at which to switch to the next schedule (Python ints).

    Returns:
        A schedule ``step -> value``: a Python float for an int step (unless a schedule
        returns a tensor), a 0-d float64 tensor for a tensor step.

    Examples:
        >>> import functopt.schedules
        >>> from functopt import schedules
        >>> warmup = schedules.linear_schedule(0.0, 1.0, transition_steps=2)
        >>> decay = schedules.linear_schedule(1.0, 0.5, transition_steps=2)
        >>> schedule = schedules.join_schedules([warmup, decay], boundaries=[2])
        >>> [schedule(t) for t in range(6)]
        [0.0, 0.5, 1.0, 0.75, 0.5, 0.5]
    """
    return join("join_schedules", schedules, boundaries)


def join(owner: str, schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """[`join_schedules`][functopt.schedules.join_schedules], with errors naming ``owner`` (for the schedules built on it)."""
    schedules = list(schedules)
    boundaries = list(boundaries)
    if not schedules:
        raise ValueError(f"{owner}: expected at least one schedule, got none.")
    for i, item in enumerate(schedules):
        if not callable(item):
            raise TypeError(
                f"{owner}: schedules[{i}] must be a schedule (step -> value), got "
                f"{type(item).__name__} {item!r}. Fix: wrap a constant with "
                f"functopt.schedules.constant_schedule(...)."
            )
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"{owner}: {len(schedules)} schedules need {len(schedules) - 1} boundaries (one "
            f"per switch), got {len(boundaries)}: {boundaries}."
        )
    for i, boundary in enumerate(boundaries):
        _common.check_int(owner, f"boundaries[{i}]", boundary)
    for i in range(1, len(boundaries)):
        if boundaries[i] < boundaries[i - 1]:
            raise ValueError(
                f"{owner}: boundaries must not decrease, got {boundaries} "
                f"(boundaries[{i}] = {boundaries[i]} < boundaries[{i - 1}] = "
                f"{boundaries[i - 1]}). Fix: list the switching steps in order."
            )

    def schedule(step: Any) -> Any:
        _common.check_step(owner, step)
        if isinstance(step, torch.Tensor):
            out = _common.as_output(schedules[0](step), step)
            for boundary, later in zip(boundaries, schedules[1:], strict=True):
                out = torch.where(step < boundary, out,
                                  _common.as_output(later(step - boundary), step))
            return out
        current, start = schedules[0], 0
        for boundary, later in zip(boundaries, schedules[1:], strict=True):
            if step >= boundary:
                current, start = later, boundary
        return _common.as_output(current(step - start), step)

    schedule.__name__ = schedule.__qualname__ = owner
    return schedule
