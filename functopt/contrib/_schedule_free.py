"""Schedule-free learning: interpolation and averaging in place of momentum (Defazio et al.)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from functopt import _validate
from functopt._base import (
    GradientTransformation,
    Numeric,
    Params,
    ScalarOrSchedule,
    State,
    Updates,
)
from functopt._rules import state_slots
from functopt._spec import Leafwise, Select, describe, specified
from functopt.contrib import _shared
from functopt.optimizers import sgd
from functopt.schedules import _common as _schedule_checks
from functopt.schedules import warmup_constant_schedule
from functopt.transforms import _common
from functopt.transforms.adding import add_decayed_weights
from functopt.transforms.combining import _check_transform, chain
from functopt.transforms.rms import scale_by_rms
from functopt.transforms.scaling import scale_by_learning_rate
from functopt.tree import _core

__all__ = [
    "ScheduleFreeState",
    "schedule_free",
    "schedule_free_adamw",
    "schedule_free_eval_params",
    "schedule_free_sgd",
]


class ScheduleFreeState(NamedTuple):
    """State of [`schedule_free`][functopt.contrib.schedule_free]."""

    b1: torch.Tensor  # shape (), the params' widest dtype (>= float32): the interpolation b1
    weight_sum: torch.Tensor  # shape (), as b1: the sum of the averaging weights so far
    step_count: torch.Tensor  # int32, shape (): 1 + updates done (the schedule's argument)
    max_lr: torch.Tensor  # shape (), as b1: the largest learning rate seen
    base_optimizer_state: State  # the state of the base optimizer
    z: Params  # like params, dtype state_dtype (default: the param's): the base iterate z


def _check_b1(owner: str, b1: Any) -> None:
    _validate.check_range(
        owner, "b1", b1, low=0.0, high=1.0, low_open=True,
        hint="Fix: b1 is in (0, 1] (the params are recovered by dividing by it); 0.9 is usual.")


def schedule_free(
    base_optimizer: GradientTransformation,
    learning_rate: ScalarOrSchedule,
    b1: Numeric = 0.9,
    weight_lr_power: Numeric = 2.0,
    state_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Make ``base_optimizer`` schedule-free: replace its momentum by interpolation and
    averaging.

    The params the transform sees are the gradient points $y_t$. It keeps the base
    iterate $z_t$ in its state and recovers the averaged iterate
    $x_t = (y_t - (1-\beta_1) z_t)/\beta_1$ from the two. With $\Delta_t$ the base
    optimizer's update, $\gamma_t$ the running maximum of ``learning_rate`` (read at
    ``step_count``, which starts at 1) and $c_t = \gamma_t^p / \sum_{k\le t}\gamma_k^p$
    ($p$ = ``weight_lr_power``):

    $$
    z_{t+1} = z_t + \Delta_t, \quad x_{t+1} = (1-c_t) x_t + c_t z_{t+1}, \quad
    y_{t+1} = \beta_1 x_{t+1} + (1-\beta_1) z_{t+1},
    $$

    and the update is $y_{t+1} - y_t$. Evaluate the model at $x$:
    [`schedule_free_eval_params`][functopt.contrib.schedule_free_eval_params]. Switch the
    base optimizer's own momentum off (``adam(b1=0)``, plain ``sgd``). Reads the params.
    A leaf without a gradient keeps its $z$ and gets a ``None`` update.

    Args:
        base_optimizer: the transform whose updates move $z$ (its learning rate included).
        learning_rate: the learning rate (or schedule, with warmup and without decay) the
            averaging weights follow; normally the base optimizer's.
        b1: the interpolation $\beta_1$, in (0, 1].
        weight_lr_power: $p$, how strongly the averaging weights follow the learning rate.
        state_dtype: storage dtype of $z$ (default: the param's dtype).

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with
        [`ScheduleFreeState`][functopt.contrib.ScheduleFreeState].

    Examples:
        >>> import torch, functopt
        >>> from functopt import contrib
        >>> opt = contrib.schedule_free(functopt.sgd(0.5), learning_rate=0.5)
        >>> params = {"w": torch.tensor([2.0])}
        >>> state = opt.init(params)
        >>> for _ in range(20):  # minimise w^2 / 2
        ...     updates, state = opt.update({"w": params["w"]}, state, params)
        ...     params = functopt.apply_updates(params, updates)
        >>> x = contrib.schedule_free_eval_params(state, params)
        >>> bool(x["w"].abs() < 0.2)
        True

    References:
        Defazio et al., *The Road Less Scheduled*, NeurIPS 2024.
    """
    owner = "schedule_free"
    base = _check_transform(owner, "base_optimizer", base_optimizer)
    _shared.check_lr(owner, learning_rate)
    _check_b1(owner, b1)
    _validate.check_number(owner, "weight_lr_power", weight_lr_power)
    _validate.check_dtype(owner, "state_dtype", state_dtype)

    def init_fn(params: Params) -> ScheduleFreeState:
        leaves, treespec = _common.flatten_params(params)
        dtype = _shared.scalar_dtype(leaves)
        device = _common.first_device(leaves)
        z = [None if p is None else p.to(state_dtype or p.dtype).clone() for p in leaves]
        return ScheduleFreeState(
            b1=_shared.f64(b1, device).to(dtype),
            weight_sum=torch.zeros((), dtype=dtype, device=device),
            step_count=_common.zero_count(leaves) + 1,
            max_lr=torch.zeros((), dtype=dtype, device=device),
            base_optimizer_state=base.init(params),
            z=_common.unflatten(treespec, z),
        )

    average = _averaging(learning_rate, b1, weight_lr_power)

    def update_fn(
        updates: Updates, state: ScheduleFreeState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ScheduleFreeState]:
        _common.check_state("schedule_free", state, ScheduleFreeState)
        grads, treespec = _common.flatten_updates(updates)
        # the averaging's own checks first: a bad z or params fails before the base steps
        _common.params_like(treespec, params, grads, owner=owner)
        zs = _common.state_like(treespec, state.z, name="state.z", like=grads)
        _common.check_state_present(owner, treespec, grads, z=zs)
        base_updates, base_state = base.update(updates, state.base_optimizer_state, params,
                                               **extra_args)
        deltas = _core.flatten_like(treespec, base_updates, name="base_optimizer's updates",
                                    reference="updates")
        for g, delta in zip(grads, deltas, strict=True):
            if g is not None and delta is None:
                raise ValueError(
                    f"{owner}: the base optimizer returned None for a leaf with a gradient. "
                    f"Fix: use a base optimizer that updates every leaf it is given.")
        # (a leaf without a gradient keeps its z whatever the base returned for it)
        deltas = [None if g is None else d for g, d in zip(grads, deltas, strict=True)]
        new_updates, averaged = average(_common.unflatten(treespec, deltas), _AveragingState(
            state.b1, state.weight_sum, state.step_count, state.max_lr, state.z), params)
        return new_updates, ScheduleFreeState(
            b1=averaged.b1,
            weight_sum=averaged.weight_sum,
            step_count=averaged.step_count,
            max_lr=averaged.max_lr,
            base_optimizer_state=base_state,
            z=averaged.z,
        )

    def select(params: Params, treespec: _core.TreeSpec, leaves: list[Any],
               ) -> dict[Any, list[int]]:
        every = list(range(len(leaves)))
        return {"base_optimizer": every, "averaging": every}

    def state_of(state: Any, key: Any) -> Any:
        if key == "base_optimizer":
            return state.base_optimizer_state
        return _AveragingState(state.b1, state.weight_sum, state.step_count, state.max_lr,
                               state.z)

    # The spec: the base optimizer's rules, then the averaging as one elementwise rule that
    # reads their output (both see every leaf, in this order), so the planner lowers the
    # whole transform when it lowers the base (the compiled tier for the recipes below).
    averaging = Leafwise("schedule_free", {"learning_rate": learning_rate, "b1": b1,
                                           "weight_lr_power": weight_lr_power}, update=average,
                         slots=state_slots(_AveragingState))
    return specified(GradientTransformation(init_fn, update_fn), Select(
        {"base_optimizer": describe(base), "averaging": averaging}, select, state_of,
        "schedule_free"))


class _AveragingState(NamedTuple):
    """The averaging's share of [`ScheduleFreeState`][functopt.contrib.ScheduleFreeState]
    (its fields without the base optimizer's state): what the planner hands the averaging
    rule (private)."""

    b1: torch.Tensor
    weight_sum: torch.Tensor
    step_count: torch.Tensor
    max_lr: torch.Tensor
    z: Params


def _averaging(learning_rate: Any, b1: Any, weight_lr_power: Any) -> Any:
    """The update of schedule-free's averaging: the base optimizer's updates (the deltas of
    z) in, the move of y out. Elementwise per leaf, with scalar state: it is both the pure
    path's second half and the rule the compiled tier runs on a group's leaves laid end to
    end."""
    owner = "schedule_free"

    def average(deltas: Updates, state: _AveragingState, params: Params | None = None,
                **extra_args: Any) -> tuple[Updates, _AveragingState]:
        del extra_args
        leaves, treespec = _common.flatten_updates(deltas)
        ps = _common.params_like(treespec, params, leaves, owner=owner)
        zs = _common.state_like(treespec, state.z, name="state.z", like=leaves)
        dtype = state.max_lr.dtype
        lr = _common.scalar(_shared.f64(_shared.value_at(learning_rate, state.step_count),
                                        state.max_lr.device), dtype)
        max_lr = torch.maximum(state.max_lr, lr)
        weight = max_lr**weight_lr_power
        total = state.weight_sum + weight
        ratio = torch.nan_to_num(weight / total, nan=0.0, posinf=float("inf"))
        ck = torch.where(torch.isnan(weight) | torch.isnan(total), float("nan"), ratio)

        def leaf(delta: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> tuple[Any, ...]:
            wide = _common.compute_dtype(y.dtype, z.dtype, delta.dtype, dtype)
            c = functools.partial(_common.scalar, dtype=wide)
            z_old = z.to(wide)
            z_new = (z_old + delta.to(wide)).to(z.dtype).to(wide)
            y_old = y.to(wide)
            x_old = (y_old - c(1.0 - b1) * z_old) / c(b1)
            x_new = c(1.0 - ck) * x_old + c(ck) * z_new
            y_new = c(b1) * x_new + c(1.0 - b1) * z_new
            return (y_new - y_old).to(delta.dtype), z_new.to(z.dtype)

        new_u, _, new_zs = _shared.map_with_params(leaf, leaves, ps, zs)
        return _common.unflatten(treespec, new_u), _AveragingState(
            b1=state.b1, weight_sum=total, step_count=_common.safe_increment(state.step_count),
            max_lr=max_lr, z=_common.unflatten(treespec, new_zs))

    return average


def schedule_free_eval_params(state: ScheduleFreeState, params: Params) -> Params:
    r"""The averaged iterate $x = (y - (1-\beta_1) z)/\beta_1$, where to evaluate the model.

    ``params`` are the params being trained ($y$); ``state`` is the
    [`ScheduleFreeState`][functopt.contrib.ScheduleFreeState] of the
    [`schedule_free`][functopt.contrib.schedule_free] transform (the outer state of
    [`schedule_free_adamw`][functopt.contrib.schedule_free_adamw] and
    [`schedule_free_sgd`][functopt.contrib.schedule_free_sgd]). Pure: nothing is modified.

    Examples:
        >>> import torch
        >>> from functopt import contrib
        >>> opt = contrib.schedule_free_sgd(0.1)
        >>> params = {"w": torch.tensor([1.0])}
        >>> state = opt.init(params)
        >>> contrib.schedule_free_eval_params(state, params)  # before any step, x = y = z
        {'w': tensor([1.])}
    """
    if not isinstance(state, ScheduleFreeState):
        raise TypeError(
            f"schedule_free_eval_params: state must be the ScheduleFreeState of a schedule_free "
            f"transform, got {type(state).__name__}. Fix: pass the state returned by the "
            f"schedule_free / schedule_free_adamw / schedule_free_sgd transform itself (when "
            f"it is inside a chain, pick its element of the chain's state)."
        )
    leaves, treespec = _core.flatten(params)
    zs = _core.flatten_like(treespec, state.z, name="state.z", reference="params")

    def leaf(y: Any, z: Any) -> Any:
        if y is None or z is None:
            return y
        wide = _common.compute_dtype(y.dtype, z.dtype, state.b1.dtype)
        b1 = state.b1.to(wide)
        x = (y.to(wide) - (1.0 - b1) * z.to(wide)) / b1
        return x.to(y.dtype)

    return _core.unflatten(treespec, [leaf(y, z) for y, z in zip(leaves, zs, strict=True)])


def _warmup(owner: str, learning_rate: Any, warmup_steps: int | None,
            warmup_from_zero: bool) -> tuple[Any, Any]:
    """The learning rates of the base optimizer (read at its count, 0 first) and of the
    averaging (read at ``step_count``, 1 first).

    optax's warmup is one schedule, ``lr * min(t / W, 1)``, for both: the base's first step
    has rate 0, the averaging's first weight ``lr / W``. The schedulefree package's is
    ``lr * min((k + 1) / W, 1)`` at its step ``k`` (0 first) for both, which the averaging
    already reads; the base then reads the warmup from ``lr / W`` to ``lr`` over ``W - 1``
    steps, the same values one step earlier. ``W = 0`` is no warmup in both (a linear warmup
    over no steps has no value to start from: read as optax's ``t / W`` it would hold the
    rate at 0 forever, and the optimizer would never move).
    """
    _validate.check_flags(owner, warmup_from_zero=warmup_from_zero)
    if warmup_steps is not None:
        _schedule_checks.check_int(owner, "warmup_steps", warmup_steps, low=0)
    if warmup_steps is None or warmup_steps == 0:
        return learning_rate, learning_rate
    averaging = warmup_constant_schedule(init_value=0.0, peak_value=learning_rate,
                                         warmup_steps=warmup_steps)
    if warmup_from_zero:
        return averaging, averaging
    base = warmup_constant_schedule(init_value=learning_rate / warmup_steps,
                                    peak_value=learning_rate, warmup_steps=warmup_steps - 1)
    return base, averaging


def schedule_free_sgd(
    learning_rate: Numeric = 1.0,
    warmup_steps: int | None = None,
    b1: Numeric = 0.9,
    weight_decay: Numeric | None = None,
    weight_lr_power: Numeric = 2.0,
    state_dtype: torch.dtype | None = None,
    *,
    warmup_from_zero: bool = True,
) -> GradientTransformation:
    r"""Schedule-free SGD: ``schedule_free(sgd(lr), lr, b1, ...)``.

    With ``warmup_steps`` $W \ge 1$ the learning rate warms up linearly from 0
    (``warmup_constant_schedule``): the $t$-th update ($t$ from 1) moves $z$ with rate
    $\eta\min((t-1)/W, 1)$, so the first one does not move it, as in optax;
    ``warmup_from_zero=False`` uses $\eta\min(t/W, 1)$, the first update taking $\eta/W$,
    as the schedulefree package does. The averaging weights follow $\eta\min(t/W, 1)$
    either way. With ``weight_decay`` the decay is added to the gradient first
    (``chain(add_decayed_weights(weight_decay), sgd(lr))``). See
    [`schedule_free`][functopt.contrib.schedule_free].

    Examples:
        >>> import torch, functopt
        >>> from functopt import contrib
        >>> opt = contrib.schedule_free_sgd(0.5)
        >>> params = {"w": torch.tensor([2.0])}
        >>> state = opt.init(params)
        >>> for _ in range(20):
        ...     updates, state = opt.update({"w": params["w"]}, state, params)
        ...     params = functopt.apply_updates(params, updates)
        >>> bool(contrib.schedule_free_eval_params(state, params)["w"].abs() < 0.2)
        True
    """
    owner = "schedule_free_sgd"
    _shared.check_lr(owner, learning_rate)
    base_lr, lr = _warmup(owner, learning_rate, warmup_steps, warmup_from_zero)
    optimizer = sgd(base_lr)
    if weight_decay is not None:
        optimizer = chain(add_decayed_weights(weight_decay), optimizer)
    return schedule_free(optimizer, learning_rate=lr, b1=b1, weight_lr_power=weight_lr_power,
                         state_dtype=state_dtype)


def schedule_free_adamw(
    learning_rate: Numeric = 0.0025,
    warmup_steps: int | None = None,
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    eps: Numeric = 1e-8,
    weight_decay: Numeric = 0.0,
    weight_lr_power: Numeric = 2.0,
    state_dtype: torch.dtype | None = None,
    *,
    warmup_from_zero: bool = True,
) -> GradientTransformation:
    r"""Schedule-free AdamW: ``schedule_free`` around Adam without momentum.

    The base optimizer is ``chain(scale_by_rms(b2, eps, eps_in_sqrt=False,
    bias_correction=True), add_decayed_weights(weight_decay),
    scale_by_learning_rate(lr))``: Adam with $\beta_1 = 0$ without its zero first moment,
    as in optax. With ``warmup_steps`` of 1 or more the learning rate warms up linearly
    from 0 (0 steps: no warmup), and ``warmup_from_zero=False`` starts it at
    ``lr / warmup_steps`` as the schedulefree package does ([`schedule_free_sgd`][functopt.contrib.schedule_free_sgd] has the maths).
    See [`schedule_free`][functopt.contrib.schedule_free].

    Examples:
        >>> import torch, functopt
        >>> from functopt import contrib
        >>> opt = contrib.schedule_free_adamw(0.1)
        >>> params = {"w": torch.tensor([1.0, -2.0])}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.tensor([1.0, -1.0])}, state, params)
        >>> updates["w"]  # the first step moves y by lr * sign(g) (c_1 = 1)
        tensor([-0.1000,  0.1000])
    """
    owner = "schedule_free_adamw"
    _shared.check_lr(owner, learning_rate)
    base_lr, lr = _warmup(owner, learning_rate, warmup_steps, warmup_from_zero)
    optimizer = chain(
        scale_by_rms(decay=b2, eps=eps, eps_in_sqrt=False, bias_correction=True),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(base_lr),
    )
    return schedule_free(optimizer, learning_rate=lr, b1=b1, weight_lr_power=weight_lr_power,
                         state_dtype=state_dtype)
