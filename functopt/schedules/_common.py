"""What every schedule shares: step handling, value conversion, hyperparameter checks (private).

A schedule's maths is written once, on a 0-d float64 tensor holding the step. A Python step
is lifted to such a tensor (on the CPU, or on the device of a tensor hyperparameter) and the
result read back with ``.item()``, which costs no device sync for a CPU tensor; a tensor step
(the int32 ``count`` of a transform state) is only converted, so the schedule runs without
reading anything back to the host and works under ``torch.func.grad`` / ``vmap``. One code
path for both kinds of step means an int step and a tensor step give bitwise the same value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from functopt import _validate
from functopt._base import Schedule

Value = float | int | torch.Tensor
"""A schedule hyperparameter that may be a tensor: a Python number or a 0-d tensor."""


def check_int(owner: str, name: str, value: Any, *, low: int | None = None, hint: str = "") -> None:
    """A Python ``int`` (not ``bool``), at least ``low`` if given."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{owner}: {name} must be a Python int (a number of steps), got "
            f"{type(value).__name__} {value!r}. Fix: pass int({value!r}) if that is what you mean."
        )
    if low is not None and value < low:
        fix = f" {hint}" if hint else ""
        raise ValueError(f"{owner}: {name} must be >= {low}, got {value}.{fix}")


def check_value(owner: str, name: str, value: Any) -> None:
    """A Python number or a 0-d tensor (tensors are trusted: reading them would sync)."""
    _validate.check_number(owner, name, value)


def check_nonnegative(owner: str, name: str, value: Any) -> None:
    _validate.check_range(owner, name, value, low=0.0)


def check_positive(owner: str, name: str, value: Any) -> None:
    _validate.check_range(owner, name, value, low=0.0, low_open=True)


def f64(value: Value) -> Any:
    """``value`` ready to combine with the float64 step: a float, or a float64 tensor."""
    if isinstance(value, torch.Tensor):
        return value.to(torch.float64)
    return float(value)


def lift(value: Value, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a float64 tensor shaped and placed like ``like`` (for ``torch.where``)."""
    if isinstance(value, torch.Tensor):
        return value.to(torch.float64).expand_as(like)
    return torch.full_like(like, float(value))


def check_step(owner: str, step: Any) -> None:
    """A Python int (or float) or a 0-d real tensor; metadata checks only, no host sync."""
    if isinstance(step, torch.Tensor):
        if step.dim() != 0 or step.dtype == torch.bool or step.is_complex():
            raise TypeError(
                f"{owner}: the step must be a Python int or a 0-d real tensor, got a "
                f"{str(step.dtype).removeprefix('torch.')} tensor of shape {tuple(step.shape)}. "
                f"Fix: pass the transform's count (a 0-d int32 tensor) or an int."
            )
    elif isinstance(step, bool) or not isinstance(step, (int, float)):
        raise TypeError(
            f"{owner}: the step must be a Python int or a 0-d integer tensor, got "
            f"{type(step).__name__} {step!r}."
        )


def _step_tensor(owner: str, step: Any, device: torch.device) -> tuple[torch.Tensor, bool]:
    """The step as a 0-d float64 tensor, and whether the caller passed a Python number."""
    check_step(owner, step)
    if isinstance(step, torch.Tensor):
        return step.to(torch.float64), False
    return torch.tensor(float(step), dtype=torch.float64, device=device), True


def make_schedule(
    owner: str, compute: Callable[[torch.Tensor], torch.Tensor], values: Sequence[Any]
) -> Schedule:
    """Wrap ``compute(t) -> value`` (``t`` a 0-d float64 step tensor) as a schedule.

    The schedule returns a Python float for a Python step when every hyperparameter in
    ``values`` is a Python number, and a 0-d float64 tensor otherwise.
    """
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")

    def schedule(step: Any) -> Any:
        t, is_number = _step_tensor(owner, step, device)
        out = compute(t)
        if is_number and not tensors:
            return out.item()
        return out

    schedule.__name__ = schedule.__qualname__ = owner
    return schedule


def as_output(value: Any, step: Any) -> Any:
    """Normalise what a (possibly user-written) schedule returned, for ``join_schedules``.

    For a tensor step, a 0-d float64 tensor on the step's device; for a Python step, a Python
    float unless the schedule itself returned a tensor.
    """
    if isinstance(step, torch.Tensor):
        if isinstance(value, torch.Tensor):
            return value.to(torch.float64)
        return torch.full((), float(value), dtype=torch.float64, device=step.device)
    if isinstance(value, torch.Tensor):
        return value.to(torch.float64)
    return float(value)
