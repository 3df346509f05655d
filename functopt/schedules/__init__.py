"""Schedules: functions ``step -> value`` for learning rates and other hyperparameters.

A schedule takes the step as a Python int or as a 0-d integer tensor (the ``count`` that
transforms keep in their state) and returns a Python float for an int step, a 0-d float64
tensor for a tensor step (or when a hyperparameter of the schedule is itself a tensor).
Tensor steps never cause a host sync, so schedules run inside ``update`` under
``torch.compile``, ``torch.func.grad`` and ``vmap``. Names, arguments and values follow
optax's schedules; where functopt differs (stricter checks), the docstring says so.

Examples:
    >>> import torch, functopt.schedules
    >>> lr = functopt.schedules.warmup_cosine_decay_schedule(
    ...     0.0, 1e-3, warmup_steps=100, decay_steps=1000)
    >>> lr(50)
    0.0005
    >>> lr(torch.tensor(100, dtype=torch.int32))
    tensor(0.0010, dtype=torch.float64)
"""

from functopt.schedules._cosine import (
    cosine_decay_schedule,
    sgdr_schedule,
    warmup_cosine_decay_schedule,
)
from functopt.schedules._exponential import (
    exponential_decay,
    warmup_exponential_decay_schedule,
)
from functopt.schedules._join import join_schedules
from functopt.schedules._piecewise import (
    cosine_onecycle_schedule,
    linear_onecycle_schedule,
    piecewise_constant_schedule,
    piecewise_interpolate_schedule,
)
from functopt.schedules._polynomial import (
    constant_schedule,
    linear_schedule,
    polynomial_schedule,
    warmup_constant_schedule,
)

__all__ = [
    "constant_schedule",
    "cosine_decay_schedule",
    "cosine_onecycle_schedule",
    "exponential_decay",
    "join_schedules",
    "linear_onecycle_schedule",
    "linear_schedule",
    "piecewise_constant_schedule",
    "piecewise_interpolate_schedule",
    "polynomial_schedule",
    "sgdr_schedule",
    "warmup_constant_schedule",
    "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule",
]
