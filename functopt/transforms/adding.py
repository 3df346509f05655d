"""Adding terms to the updates: ``add_decayed_weights`` (decoupled weight decay)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functopt import _validate
from functopt._base import EmptyState, GradientTransformation, Params, ScalarOrSchedule, Updates
from functopt._rules import state_slots
from functopt._spec import Leafwise, specified
from functopt.transforms import _common
from functopt.transforms.masking import Mask, masked
from functopt.tree import _core, _ops

__all__ = [
    "AddDecayedWeightsState",
    "add_decayed_weights",
]


class AddDecayedWeightsState(NamedTuple):
    """State of [`add_decayed_weights`][functopt.add_decayed_weights] when ``weight_decay`` is a schedule (optax:
    ``WeightDecaySchedule``); with a constant it is [`EmptyState`][functopt.EmptyState]."""

    # The name shadows tuple.count (hence the ignore); kept: optax's name, public API.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far


def _readable(rate: torch.Tensor) -> bool:
    """Whether a 0-d tensor rate may be read as a Python number: on the CPU (no device
    synchronisation), without a gradient to carry, outside ``torch.func`` and
    ``torch.compile`` (which would graph-break on the read), and in a step that is not
    recorded for replay (``Step.capture``, where the read would stay what it was). Then
    the decay is ``torch.add(g, p, alpha=rate)``, bitwise what the number gives (one
    rounding; the tensor form, kept for the rest, rounds the product first)."""
    return (rate.device.type == "cpu" and rate.dim() == 0 and not rate.requires_grad
            and torch._C._functorch.maybe_current_level() is None
            and not torch.compiler.is_compiling() and not _ops._recording())


def add_decayed_weights(
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Mask | Callable[[Params], Mask] | None = None,
) -> GradientTransformation:
    r"""Add the params scaled by ``weight_decay`` to the updates: $u \leftarrow u + \lambda p$.

    $\lambda$ is ``weight_decay``, or ``weight_decay(count)`` for a schedule (``count``
    counts the updates done, from 0). Placed before the learning-rate scaling this is the
    decoupled weight decay of AdamW; placed before momentum it is ``torch.optim.SGD``'s
    ``weight_decay``. With a Python ``0`` the updates are returned as they are (so non-finite
    params do not leak into them). A ``None`` update stays ``None``.

    Args:
        weight_decay: $\lambda$ >= 0: a number, a 0-d tensor or a schedule.
        mask: where to decay: a pytree of bools with the params' structure (or a prefix of
            it), or ``params -> such a pytree``; see [`functopt.masked`][functopt.masked]. Typical use:
            no decay for biases and norm scales. ``None`` decays every leaf.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] (wrapped in [`functopt.masked`][functopt.masked] when
        ``mask`` is given); ``update`` needs ``params``.

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.add_decayed_weights(0.1)
        >>> params = {"w": torch.tensor([1.0, -2.0])}
        >>> tx.update({"w": torch.tensor([0.5, 0.5])}, tx.init(params), params)[0]
        {'w': tensor([0.6000, 0.3000])}

    References:
        Loshchilov & Hutter, *Decoupled Weight Decay Regularization*, 2019.
    """
    owner = "add_decayed_weights"
    _validate.check_range(owner, "weight_decay", weight_decay, low=0.0, allow_callable=True,
                          hint="Fix: pass a non-negative decay rate such as 1e-4.")
    is_schedule = callable(weight_decay) and not isinstance(weight_decay, torch.Tensor)
    is_python_zero = isinstance(weight_decay, (int, float)) and weight_decay == 0

    def init_fn(params: Params) -> AddDecayedWeightsState | EmptyState:
        if not is_schedule:
            return EmptyState()
        leaves, _ = _common.flatten_params(params)
        return AddDecayedWeightsState(count=_common.zero_count(leaves))

    def decay(g: torch.Tensor, p: torch.Tensor, rate: Any) -> torch.Tensor:
        if isinstance(rate, (int, float)):
            # torch.optim.SGD's own grad.add(param, alpha=weight_decay), bit for bit.
            return torch.add(g, p, alpha=rate)
        out: torch.Tensor = (g + _common.scaled(p, rate)).to(g.dtype)
        return out

    def update_fn(
        updates: Updates, state: Any, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, Any]:
        del extra_args
        _common.check_state(owner, state, AddDecayedWeightsState if is_schedule else EmptyState)
        leaves, treespec = _common.flatten_updates(updates)
        # Checked even for a zero decay, so that a chain missing its params fails at once.
        param_leaves = _common.params_like(treespec, params, leaves, owner=owner)
        new_state = state
        if is_schedule:
            new_state = AddDecayedWeightsState(count=_common.safe_increment(state.count))
        if is_python_zero:
            return updates, new_state
        rate = _common.schedule_value(owner, "weight_decay", weight_decay, state.count) if (
            callable(weight_decay)) else weight_decay
        if isinstance(rate, torch.Tensor) and _readable(rate):
            rate = float(rate)  # an injected value: the same bits as the number, read once
        new: list[torch.Tensor | None] = []
        for i, (g, p) in enumerate(zip(leaves, param_leaves, strict=True)):
            if g is None:
                new.append(None)
            elif p is None:
                where = _core.paths(treespec)[i]
                raise ValueError(
                    f"{owner}: leaf {where!r} has an update but its param is None. Fix: pass "
                    f"the param, or pass None as its update too."
                )
            else:
                new.append(decay(g, p, rate))
        return _common.unflatten(treespec, new), new_state

    tx = specified(GradientTransformation(init_fn, update_fn),
                   Leafwise("add_decayed_weights", {"weight_decay": weight_decay},
                            slots=state_slots(AddDecayedWeightsState), kernel="weight_decay"))
    return tx if mask is None else masked(tx, mask)
