"""Scaling by constants, schedules and param magnitudes: ``scale``, ``scale_by_learning_rate``,
``scale_by_schedule``, ``scale_by_param_block_rms``, ``scale_by_param_block_norm``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functopt import _validate
from functopt._base import (
    EmptyState,
    GradientTransformation,
    Numeric,
    Params,
    ScalarOrSchedule,
    Schedule,
    Updates,
)
from functopt._rules import state_slots
from functopt._spec import Leafwise, PerLeaf, specified
from functopt.transforms import _common

__all__ = [
    "ScaleByScheduleState",
    "scale",
    "scale_by_learning_rate",
    "scale_by_param_block_norm",
    "scale_by_param_block_rms",
    "scale_by_schedule",
]


def _scaled(leaves: list[Any], factor: Any) -> list[Any]:
    return [None if g is None else _common.scaled(g, factor) for g in leaves]


def scale(step_size: Numeric) -> GradientTransformation:
    r"""Multiply every update by a constant: $u \leftarrow \text{step\_size}\cdot u$.

    Args:
        step_size: the factor (a number or a 0-d tensor).

    Returns:
        A stateless [`GradientTransformation`][functopt.GradientTransformation].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale(2.0)
        >>> tx.update({"w": torch.tensor([1.0, -3.0])}, tx.init(None))[0]
        {'w': tensor([ 2., -6.])}
    """
    _validate.check_number("scale", "step_size", step_size)
    return specified(_scale_by(lambda: step_size),
                     Leafwise("scale", {"step_size": step_size}, slots=(), kernel="scale"))


def _scale_by(factor: Callable[[], Numeric]) -> GradientTransformation:
    """``scale``, its factor taken from ``factor()`` at every update (a tensor
    learning rate's negation is taken then, so that a write into the tensor between steps
    counts, as the fast paths read it)."""

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(
        updates: Updates, state: EmptyState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, EmptyState]:
        _common.check_state("scale", state, EmptyState)
        del extra_args
        leaves, treespec = _common.flatten_updates(updates)
        _common.check_params_structure("scale", treespec, params)
        return _common.unflatten(treespec, _scaled(leaves, factor())), state

    return GradientTransformation(init_fn, update_fn)


class ScaleByScheduleState(NamedTuple):
    """State of [`scale_by_schedule`][functopt.scale_by_schedule]."""

    # The name shadows tuple.count (hence the ignore); kept: optax's name, public API.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    r"""Multiply updates by ``step_size_fn(count)``, where ``count`` counts the updates done.

    The schedule receives the 0-d int32 count tensor (0 on the first update) and returns a
    number or a 0-d tensor; nothing is read back to the host.

    Args:
        step_size_fn: a schedule, ``count -> factor`` (see `functopt.schedules`).

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_schedule(lambda count: 1.0 / (count + 1))
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> u, state = tx.update({"w": torch.ones(1)}, state)
        >>> u, state = tx.update({"w": torch.ones(1)}, state)
        >>> u["w"]
        tensor([0.5000])
    """
    if not callable(step_size_fn):
        raise TypeError(
            f"scale_by_schedule: step_size_fn must be callable (count -> value), got "
            f"{type(step_size_fn).__name__}. Fix: use functopt.scale for a constant."
        )

    def init_fn(params: Params) -> ScaleByScheduleState:
        leaves, _ = _common.flatten_params(params)
        return ScaleByScheduleState(count=_common.zero_count(leaves))

    def update_fn(
        updates: Updates,
        state: ScaleByScheduleState,
        params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ScaleByScheduleState]:
        _common.check_state("scale_by_schedule", state, ScaleByScheduleState)
        del extra_args
        leaves, treespec = _common.flatten_updates(updates)
        _common.check_params_structure("scale_by_schedule", treespec, params)
        new = _scaled(leaves, _common.schedule_value("scale_by_schedule", "step_size_fn",
                                                     step_size_fn, state.count))
        count = _common.safe_increment(state.count)
        return _common.unflatten(treespec, new), ScaleByScheduleState(count=count)

    return specified(GradientTransformation(init_fn, update_fn),
                     Leafwise("scale_by_schedule", {"step_size_fn": step_size_fn},
                              slots=state_slots(ScaleByScheduleState), kernel="schedule"))


def scale_by_learning_rate(
    learning_rate: ScalarOrSchedule, *, flip_sign: bool = True
) -> GradientTransformation:
    r"""Scale by the learning rate, negated by default (so that ``apply_updates`` descends).

    $u \leftarrow -\eta\, u$ with ``flip_sign=True`` (the default), where
    $\eta$ is ``learning_rate`` or ``learning_rate(count)`` for a schedule.

    Args:
        learning_rate: a number, a 0-d tensor, or a schedule.
        flip_sign: negate the learning rate (gradient descent). ``False`` for ascent.

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_learning_rate(0.1)
        >>> tx.update({"w": torch.tensor([1.0])}, tx.init(None))[0]
        {'w': tensor([-0.1000])}
    """
    _validate.check_flags("scale_by_learning_rate", flip_sign=flip_sign)
    _validate.check_number("scale_by_learning_rate", "learning_rate", learning_rate,
                           allow_callable=True)
    sign = -1 if flip_sign else 1
    spec = Leafwise("scale_by_learning_rate",
                    {"learning_rate": learning_rate, "flip_sign": flip_sign}, slots=(),
                    kernel="learning_rate")
    if callable(learning_rate) and not isinstance(learning_rate, torch.Tensor):
        schedule = learning_rate
        return specified(scale_by_schedule(lambda count: sign * _common.schedule_value(
            "scale_by_learning_rate", "learning_rate", schedule, count)), spec)
    if isinstance(learning_rate, torch.Tensor):
        # negated at every update: the value of the tensor then, written in place or not
        return specified(_scale_by(lambda: sign * learning_rate), spec)
    return specified(scale(sign * learning_rate), spec)


def _param_block_scale(owner: str, min_scale: Numeric, reduce: str) -> GradientTransformation:
    _validate.check_range(owner, "min_scale", min_scale, low=0.0)

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(
        updates: Updates, state: EmptyState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, EmptyState]:
        del extra_args
        leaves, treespec = _common.flatten_updates(updates)
        param_leaves = _common.params_like(treespec, params, leaves, owner=owner)

        def leaf(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            wide = p.to(torch.promote_types(p.dtype, torch.float32))
            if reduce == "rms":
                block = torch.sqrt(torch.mean(wide * wide)) if p.numel() else wide.new_zeros(())
            else:
                block = torch.linalg.vector_norm(wide)
            floored = torch.clamp(block, min=_common.scalar(min_scale, block.dtype))
            return _common.scaled(g, floored)

        new = [None if g is None else leaf(g, p) for g, p in zip(leaves, param_leaves, strict=True)]
        return _common.unflatten(treespec, new), state

    # a factor from the param's own norm: the planner's per-leaf tier runs its update
    return specified(GradientTransformation(init_fn, update_fn),
                     PerLeaf(owner, {"min_scale": min_scale}, slots=state_slots(EmptyState)))


def scale_by_param_block_rms(min_scale: Numeric = 1e-3) -> GradientTransformation:
    r"""Scale each update by the root mean square of its param, floored at ``min_scale``.

    $u \leftarrow u \cdot \max(\sqrt{\operatorname{mean}(p^2)}, \text{min\_scale})$,
    one factor per tensor (Adafactor's ``multiply_by_parameter_scale``). The RMS is taken
    in float32 (float64 for float64 params). Reads the params.

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_param_block_rms()
        >>> p = {"w": torch.tensor([3.0, -3.0])}
        >>> tx.update({"w": torch.ones(2)}, tx.init(p), p)[0]
        {'w': tensor([3., 3.])}
    """
    return _param_block_scale("scale_by_param_block_rms", min_scale, "rms")


def scale_by_param_block_norm(min_scale: Numeric = 1e-3) -> GradientTransformation:
    r"""Scale each update by the L2 norm of its param, floored at ``min_scale``.

    $u \leftarrow u \cdot \max(\lVert p \rVert_2, \text{min\_scale})$, one factor per
    tensor. Reads the params.

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_param_block_norm()
        >>> p = {"w": torch.tensor([3.0, 4.0])}
        >>> tx.update({"w": torch.ones(2)}, tx.init(p), p)[0]
        {'w': tensor([5., 5.])}
    """
    return _param_block_scale("scale_by_param_block_norm", min_scale, "norm")
