"""Cosine decay, with warmup, and with warm restarts (SGDR)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from functopt._base import Schedule
from functopt.schedules import _common, _join, _polynomial
from functopt.schedules._common import Value

__all__ = [
    "cosine_decay_schedule",
    "sgdr_schedule",
    "warmup_cosine_decay_schedule",
]


def cosine_decay_schedule(
    init_value: Value,
    decay_steps: int,
    alpha: Value = 0.0,
    exponent: Value = 1.0,
) -> Schedule:
    r"""Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps`` steps.

    With $T$ = ``decay_steps``, $\alpha$ = ``alpha`` and $p$ = ``exponent``:

    $$
    c(t) = \tfrac12\left(1 + \cos\left(\pi\,\frac{\min(t, T)}{T}\right)\right), \qquad
    v(t) = \text{init\_value}\,\bigl((1 - \alpha)\, c(t)^{p} + \alpha\bigr),
    $$

    so the value stays at ``alpha * init_value`` after step $T$. With ``alpha=0`` and
    ``exponent=1`` this is ``torch.optim.lr_scheduler.CosineAnnealingLR(T_max=decay_steps,
    eta_min=0)`` for steps up to ``T_max`` (which then rises again; this stays put).

    Args:
        init_value: the value at step 0.
        decay_steps: length of the decay, > 0.
        alpha: the final value as a fraction of ``init_value``.
        exponent: the power applied to the cosine factor.

    Returns:
        A schedule ``step -> value``.

    Examples:
        >>> import functopt.schedules
        >>> schedule = functopt.schedules.cosine_decay_schedule(1.0, decay_steps=4, alpha=0.1)
        >>> [round(schedule(t), 4) for t in range(6)]
        [1.0, 0.8682, 0.55, 0.2318, 0.1, 0.1]

    References:
        Loshchilov & Hutter, *SGDR: Stochastic Gradient Descent with Warm Restarts*, 2017.
    """
    return cosine("cosine_decay_schedule", init_value, decay_steps, alpha, exponent)


def cosine(
    owner: str, init_value: Value, decay_steps: int, alpha: Value, exponent: Value
) -> Schedule:
    """[`cosine_decay_schedule`][functopt.schedules.cosine_decay_schedule], with errors naming ``owner``."""
    for name, value in (("init_value", init_value), ("alpha", alpha), ("exponent", exponent)):
        _common.check_value(owner, name, value)
    _common.check_int(owner, "decay_steps", decay_steps, low=1)

    def compute(t: torch.Tensor) -> torch.Tensor:
        # Like optax, only the top is clamped: a negative step mirrors a positive one.
        done = torch.clamp(t, max=decay_steps)
        factor = 0.5 * (1 + torch.cos(math.pi * done / decay_steps))
        a = _common.f64(alpha)
        value: torch.Tensor = _common.f64(init_value) * (
            (1 - a) * factor ** _common.f64(exponent) + a
        )
        return value

    return _common.make_schedule(owner, compute, [init_value, alpha, exponent])


def warmup_cosine_decay_schedule(
    init_value: Value,
    peak_value: Value,
    warmup_steps: int,
    decay_steps: int,
    end_value: Value = 0.0,
    exponent: Value = 1.0,
) -> Schedule:
    r"""Linear warmup from ``init_value`` to ``peak_value``, then cosine decay to ``end_value``.

    Steps ``0 .. warmup_steps`` rise linearly; then the value is [`cosine_decay_schedule`][functopt.schedules.cosine_decay_schedule]
    with ``init_value=peak_value``, ``decay_steps=decay_steps - warmup_steps`` and
    ``alpha=end_value / peak_value`` (0 if ``peak_value`` is 0), evaluated at
    ``step - warmup_steps``. Note that ``decay_steps`` counts the warmup too.

    Args:
        init_value: value at step 0.
        peak_value: value at the end of the warmup.
        warmup_steps: length of the warmup, >= 0.
        decay_steps: total length, warmup included; > ``warmup_steps``.
        end_value: value at step ``decay_steps`` and after.
        exponent: the power applied to the cosine factor.

    Returns:
        A schedule ``step -> value``.

    Examples:
        >>> import functopt.schedules
        >>> schedule = functopt.schedules.warmup_cosine_decay_schedule(
        ...     0.0, 1.0, warmup_steps=2, decay_steps=4, end_value=0.1)
        >>> [round(schedule(t), 4) for t in range(6)]
        [0.0, 0.5, 1.0, 0.55, 0.1, 0.1]
    """
    return warmup_cosine("warmup_cosine_decay_schedule", init_value, peak_value, warmup_steps,
                         decay_steps, end_value, exponent)


def warmup_cosine(
    owner: str,
    init_value: Value,
    peak_value: Value,
    warmup_steps: int,
    decay_steps: int,
    end_value: Value = 0.0,
    exponent: Value = 1.0,
) -> Schedule:
    """[`warmup_cosine_decay_schedule`][functopt.schedules.warmup_cosine_decay_schedule], with errors naming ``owner``."""
    _common.check_value(owner, "peak_value", peak_value)
    _common.check_value(owner, "end_value", end_value)
    _common.check_int(owner, "warmup_steps", warmup_steps, low=0)
    _common.check_int(owner, "decay_steps", decay_steps)
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"{owner}: decay_steps must be greater than warmup_steps, got decay_steps="
            f"{decay_steps} and warmup_steps={warmup_steps}. decay_steps is the total length "
            f"of the schedule, warmup included (as in optax). Fix: pass decay_steps="
            f"{warmup_steps} + the number of cosine steps."
        )
    alpha: Value
    if isinstance(peak_value, torch.Tensor) or isinstance(end_value, torch.Tensor):
        peak, end = _common.f64(peak_value), _common.f64(end_value)
        zero = torch.as_tensor(peak) == 0
        # The safe denominator keeps the gradient finite where peak_value is 0.
        alpha = torch.where(zero, 0.0, end / torch.where(zero, 1.0, torch.as_tensor(peak)))
    else:
        alpha = 0.0 if peak_value == 0 else end_value / peak_value
    warmup = _polynomial.polynomial(owner, init_value, peak_value, 1, warmup_steps)
    decay = cosine(owner, peak_value, decay_steps - warmup_steps, alpha, exponent)
    return _join.join(owner, [warmup, decay], [warmup_steps])


_CYCLE_REQUIRED = frozenset({"init_value", "peak_value", "warmup_steps", "decay_steps"})
_CYCLE_ARGS = _CYCLE_REQUIRED | {"end_value", "exponent"}


def sgdr_schedule(cosine_kwargs: Iterable[Mapping[str, Any]]) -> Schedule:
    """Stochastic gradient descent with warm restarts: warmup-cosine cycles joined end to end.

    Each element of ``cosine_kwargs`` holds the keyword arguments of one
    [`warmup_cosine_decay_schedule`][functopt.schedules.warmup_cosine_decay_schedule] cycle; the cycle lasts its ``decay_steps`` steps and
    the next one starts (from its own step 0) when it ends.

    Args:
        cosine_kwargs: one mapping of [`warmup_cosine_decay_schedule`][functopt.schedules.warmup_cosine_decay_schedule] arguments per
            cycle (``init_value``, ``peak_value``, ``warmup_steps``, ``decay_steps``, ...).

    Returns:
        A schedule ``step -> value``.

    Examples:
        >>> import functopt.schedules
        >>> cycle = dict(init_value=0.0, peak_value=1.0, warmup_steps=1, decay_steps=3)
        >>> schedule = functopt.schedules.sgdr_schedule([cycle, cycle])
        >>> [round(schedule(t), 4) for t in range(7)]
        [0.0, 1.0, 0.5, 0.0, 1.0, 0.5, 0.0]

    References:
        Loshchilov & Hutter, *SGDR: Stochastic Gradient Descent with Warm Restarts*, 2017.
    """
    owner = "sgdr_schedule"
    cycles = list(cosine_kwargs)
    if not cycles:
        raise ValueError(
            f"{owner}: expected at least one cycle, got none. Fix: pass a list of "
            f"warmup_cosine_decay_schedule keyword dicts."
        )
    schedules: list[Schedule] = []
    boundaries: list[int] = []
    step = 0
    for i, kwargs in enumerate(cycles):
        if not isinstance(kwargs, Mapping):
            raise TypeError(
                f"{owner}: cycle {i} must be a dict of warmup_cosine_decay_schedule arguments, "
                f"got {type(kwargs).__name__} {kwargs!r}."
            )
        unknown = sorted(set(kwargs) - _CYCLE_ARGS)
        missing = sorted(_CYCLE_REQUIRED - set(kwargs))
        if unknown or missing:
            raise TypeError(
                f"{owner}: cycle {i} has unknown arguments {unknown} and lacks {missing}; "
                f"a cycle takes the arguments of warmup_cosine_decay_schedule: "
                f"{sorted(_CYCLE_ARGS)} (the first four required)."
            )
        schedules.append(warmup_cosine(f"{owner} (cycle {i})", **kwargs))
        step += kwargs["decay_steps"]
        boundaries.append(step)
    return _join.join(owner, schedules, boundaries[:-1])
