"""Gradient accumulation over mini-steps: ``MultiSteps``, and the skip rules it can use."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from functopt import _validate
from functopt._base import GradientTransformation, Params, State, Updates
from functopt._spec import Spec, specified
from functopt.transforms import _common
from functopt.transforms.combining import _check_transform
from functopt.tree import _core

__all__ = [
    "MultiSteps",
    "MultiStepsState",
    "ShouldSkipUpdateFunction",
    "skip_large_updates",
    "skip_not_finite",
]


class ShouldSkipUpdateFunction(Protocol):
    """``(updates, gradient_step, params) -> (should_skip, skip_state)`` for [`MultiSteps`][functopt.MultiSteps].

    ``should_skip`` is a Python bool or a 0-d bool tensor (read on the host: a CPU tensor
    or a bool costs no device sync); ``skip_state`` is any pytree, stored in
    `MultiStepsState.skip_state` for monitoring.
    """

    def __call__(
        self, updates: Updates, gradient_step: torch.Tensor, params: Params | None
    ) -> tuple[bool | torch.Tensor, Any]: ...


def skip_not_finite(
    updates: Updates, gradient_step: torch.Tensor, params: Params | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Skip a mini-step whose updates hold an inf or a nan.

    Returns:
        ``(should_skip, {"should_skip": ..., "num_not_finite": ...})``: a 0-d bool tensor,
        and the number of non-finite entries as a 0-d int32 tensor (``None`` leaves count 0).

    Examples:
        >>> import torch, functopt
        >>> functopt.skip_not_finite({"w": torch.tensor([1.0, float("inf")])}, None, None)[0]
        tensor(True)
    """
    del gradient_step, params
    leaves, _ = _common.flatten_updates(updates)
    tensors = [x for x in leaves if x is not None]
    device = _common.first_device(tensors)
    counts = [(~torch.isfinite(x)).sum(dtype=torch.int32).to(device) for x in tensors]
    num = torch.stack(counts).sum(dtype=torch.int32) if counts else _common.zero_count(tensors)
    should_skip = num > 0
    return should_skip, {"should_skip": should_skip, "num_not_finite": num}


def skip_large_updates(
    updates: Updates,
    gradient_step: torch.Tensor,
    params: Params | None,
    max_squared_norm: float | torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""Skip a mini-step unless $\lVert u \rVert_2^2 <$ ``max_squared_norm`` (nan skips).

    Bind ``max_squared_norm`` with ``functools.partial`` to pass it as
    ``should_skip_update_fn``. The squared norm is summed in float32 (float64 if a leaf is
    float64).

    Returns:
        ``(should_skip, {"should_skip": ..., "norm_squared": ...})``.

    Examples:
        >>> import functools, torch, functopt
        >>> fn = functools.partial(functopt.skip_large_updates, max_squared_norm=10.0)
        >>> fn({"w": torch.tensor([3.0, 0.5])}, None, None)[0]
        tensor(False)
        >>> fn({"w": torch.tensor([3.0, 1.0])}, None, None)[0]
        tensor(True)
    """
    del gradient_step, params
    leaves, _ = _common.flatten_updates(updates)
    tensors = [x for x in leaves if x is not None]
    dtype = torch.float64 if any(x.dtype == torch.float64 for x in tensors) else torch.float32
    device = _common.first_device(tensors)
    squares = [torch.linalg.vector_norm(x, dtype=dtype).to(device) ** 2 for x in tensors]
    norm_sq = torch.stack(squares).sum() if squares else torch.zeros((), dtype=dtype)
    should_skip = torch.logical_not(norm_sq < max_squared_norm)
    return should_skip, {"should_skip": should_skip, "norm_squared": norm_sq}


class MultiStepsState(NamedTuple):
    """State of [`MultiSteps`][functopt.MultiSteps]."""

    mini_step: torch.Tensor  # int32, shape (), on the CPU: mini-steps taken in this window
    gradient_step: torch.Tensor  # int32, shape (), on the CPU: inner updates done so far
    inner_opt_state: State  # the inner transform's state; touched only when a window closes
    acc_grads: Updates  # like params, accumulator dtype: mean (or sum) of the window's grads
    skip_state: Any = ()  # second output of should_skip_update_fn at the last call, or ()


def _read_count(count: Any, name: str) -> int:
    if not (isinstance(count, torch.Tensor) and count.dim() == 0 and not count.is_floating_point()):
        raise TypeError(
            f"MultiSteps: state.{name} must be a 0-d integer tensor, got "
            f"{_core._describe(count)}. Fix: pass the state returned by this MultiSteps' "
            f"init/update."
        )
    return int(count)  # a CPU tensor (as init and update make it): no device sync


def _read_skip(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() == 0:
        return bool(value)
    raise TypeError(
        f"MultiSteps: should_skip_update_fn must return (should_skip, skip_state) with "
        f"should_skip a bool or a 0-d bool tensor; its first output was {_core._describe(value)}."
        f" Fix: return for example (norm_sq > limit, {{}}), a 0-d bool tensor."
    )


class MultiSteps:
    r"""Accumulate gradients over ``k`` mini-steps, then make one inner update on them.

    With $g_1, \dots, g_k$ the gradients of one window and $k$ =
    ``every_k_schedule(gradient_step)``, mini-steps $1, \dots, k-1$ return zeros and
    leave the inner state as it is; mini-step $k$ returns

    $$
    T\Big(\tfrac{1}{k}\textstyle\sum_{i=1}^{k} g_i\Big) \quad (\text{use\_grad\_mean}),
    \qquad T\Big(\textstyle\sum_{i=1}^{k} g_i\Big) \quad (\text{otherwise}),
    $$

    where $T$ is the inner transform's update, and starts a new window. The mean is
    accumulated as a running mean, $a_i = a_{i-1} + (g_i - a_{i-1}) / i$ (as optax
    does), which stays in range where a plain sum of large same-sign gradients overflows.

    Unlike optax, the inner update runs only when a window closes, not on every mini-step
    (optax computes it every time and discards it under ``lax.cond``). To branch without a
    device sync, ``mini_step`` and ``gradient_step`` are kept as CPU tensors and read on the
    host; reading a CPU tensor costs no synchronisation with the accelerator. For the same
    reason ``every_k_schedule`` should return a Python int or a CPU tensor, and the skip
    decision of ``should_skip_update_fn`` is read on the host (one sync per step if it is an
    accelerator tensor, as from [`skip_not_finite`][functopt.skip_not_finite] on GPU gradients).

    A ``None`` gradient leaves its leaf's accumulator as it is on a mini-step, and reaches
    the inner transform as ``None`` when a window closes (the leaf's accumulator is then
    reset with the others): give a param a gradient on every mini-step of a window or on
    none (use zeros for a param that got no gradient in one micro-batch).

    Args:
        opt: the inner transform.
        every_k_schedule: the window length ``k`` (an int >= 1), or a schedule
            ``gradient_step -> k`` (its argument is the 0-d int32 CPU tensor
            ``gradient_step``), to grow the effective batch size during training.
        use_grad_mean: average the window's gradients (default); ``False`` sums them.
        should_skip_update_fn: optional [`ShouldSkipUpdateFunction`][functopt.ShouldSkipUpdateFunction]; a mini-step it
            rejects returns zeros and changes nothing but ``skip_state``, as if it had never
            happened. See [`skip_not_finite`][functopt.skip_not_finite] and [`skip_large_updates`][functopt.skip_large_updates].
        accumulator_dtype: dtype of ``acc_grads``. Default ``None``: the wider of float32
            and each param's dtype (optax's default is float32 for every leaf, which would
            round float64 gradients).

    Examples:
        >>> import torch, functopt
        >>> ms = functopt.MultiSteps(functopt.scale(-1.0), every_k_schedule=2)
        >>> state = ms.init({"w": torch.zeros(1)})
        >>> updates, state = ms.update({"w": torch.tensor([1.0])}, state)
        >>> updates["w"], state.mini_step
        (tensor([0.]), tensor(1, dtype=torch.int32))
        >>> updates, state = ms.update({"w": torch.tensor([3.0])}, state)
        >>> updates["w"], state.gradient_step
        (tensor([-2.]), tensor(1, dtype=torch.int32))
        >>> tx = ms.gradient_transformation()  # to use it inside chain, partition, ...
    """

    def __init__(
        self,
        opt: GradientTransformation,
        every_k_schedule: int | Callable[[torch.Tensor], Any],
        use_grad_mean: bool = True,
        should_skip_update_fn: ShouldSkipUpdateFunction | None = None,
        accumulator_dtype: torch.dtype | None = None,
    ) -> None:
        self._opt = _check_transform("MultiSteps", "opt", opt)
        if isinstance(every_k_schedule, int) and not isinstance(every_k_schedule, bool):
            if every_k_schedule < 1:
                raise ValueError(
                    f"MultiSteps: every_k_schedule must be >= 1, got {every_k_schedule}. "
                    f"Fix: 1 updates on every call; k accumulates k mini-steps per update."
                )
            k = every_k_schedule
            self._every_k_schedule: Callable[[torch.Tensor], Any] = lambda step: k
        elif callable(every_k_schedule):
            self._every_k_schedule = every_k_schedule
        else:
            raise TypeError(
                f"MultiSteps: every_k_schedule must be an int >= 1 or a schedule "
                f"(gradient_step -> int), got {type(every_k_schedule).__name__} "
                f"{every_k_schedule!r}."
            )
        if should_skip_update_fn is not None and not callable(should_skip_update_fn):
            raise TypeError(
                f"MultiSteps: should_skip_update_fn must be None or callable "
                f"(updates, gradient_step, params) -> (should_skip, skip_state), got "
                f"{type(should_skip_update_fn).__name__}."
            )
        _validate.check_dtype("MultiSteps", "accumulator_dtype", accumulator_dtype)
        self._use_grad_mean = bool(use_grad_mean)
        self._should_skip_update_fn = should_skip_update_fn
        self._accumulator_dtype = accumulator_dtype

    @property
    def inner_opt(self) -> GradientTransformation:
        """The wrapped transform."""
        return self._opt

    def _acc_dtype(self, param: torch.Tensor) -> torch.dtype:
        if self._accumulator_dtype is not None:
            return self._accumulator_dtype
        return torch.promote_types(param.dtype, torch.float32)

    def _k_steps(self, gradient_step: torch.Tensor) -> int:
        k = self._every_k_schedule(gradient_step)
        value = k.item() if isinstance(k, torch.Tensor) and k.numel() == 1 else k
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value != int(value)
            or value < 1
        ):
            raise ValueError(
                f"MultiSteps: every_k_schedule returned {k!r} at gradient_step "
                f"{int(gradient_step)}; expected an integer >= 1 (an int or a 0-d tensor). "
                f"Fix: make the schedule return the number of mini-steps per update."
            )
        return int(value)

    def init(self, params: Params) -> MultiStepsState:
        """Zero accumulators, zero counters (on the CPU) and the inner transform's state."""
        leaves, treespec = _common.flatten_params(params)
        acc = [None if p is None else torch.zeros_like(p, dtype=self._acc_dtype(p)) for p in leaves]
        gradient_step = torch.zeros((), dtype=torch.int32)
        skip_state: Any = ()
        if self._should_skip_update_fn is not None:
            zeros = _core.unflatten(treespec, _core.map_leaves(torch.zeros_like, leaves))
            _, skip_state = self._should_skip_update_fn(zeros, gradient_step, params)
        return MultiStepsState(
            mini_step=torch.zeros((), dtype=torch.int32),
            gradient_step=gradient_step,
            inner_opt_state=self._opt.init(params),
            acc_grads=_core.unflatten(treespec, acc),
            skip_state=skip_state,
        )

    def update(
        self,
        updates: Updates,
        state: MultiStepsState,
        params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, MultiStepsState]:
        """Accumulate ``updates``; return zeros, or the inner update when the window closes."""
        window = self.window(updates, state, params)
        leaves, treespec, accs, mini_step = window.leaves, window.treespec, window.accs, (
            window.mini_step)
        if window.skip or not window.closes:
            zeros = _core.unflatten(treespec, _core.map_leaves(torch.zeros_like, leaves))
            if window.skip:
                return zeros, state._replace(skip_state=window.skip_state)
            new_accs = [
                acc if g is None else self._accumulate(g, acc, mini_step)
                for g, acc in zip(leaves, accs, strict=True)
            ]
            return zeros, window.next_state(state, _core.unflatten(treespec, new_accs))

        if mini_step == 0:
            grads = updates  # a window of one: its mean and its sum are the gradient itself
        else:
            grads = _core.unflatten(treespec, [
                None if g is None else self._accumulate(g, acc, mini_step).to(g.dtype)
                for g, acc in zip(leaves, accs, strict=True)
            ])
        new_updates, new_inner_state = self._opt.update(
            grads, state.inner_opt_state, params, **extra_args
        )
        return new_updates, window.next_state(
            state, _core.unflatten(treespec, _core.map_leaves(torch.zeros_like, accs)),
            new_inner_state)

    def window(self, updates: Updates, state: MultiStepsState, params: Params | None,
               ) -> Window:
        """Where this mini-step stands (the checks, the skip decision, whether the window
        closes): the part of `update` that the fast step (``functopt.fast.make_step``)
        shares, so that both decide alike."""
        _common.check_state("MultiSteps", state, MultiStepsState)
        leaves, treespec = _common.flatten_updates(updates)
        accs = _common.state_like(treespec, state.acc_grads, name="state.acc_grads", like=leaves)
        for i, (g, acc) in enumerate(zip(leaves, accs, strict=True)):
            if g is not None and acc is None:
                where = _core.paths(treespec)[i]
                raise ValueError(
                    f"MultiSteps: updates leaf {where!r} is a tensor, but state.acc_grads holds "
                    f"None there (the param was None at init). Fix: init with the params "
                    f"you update."
                )
        _core.check_like(leaves, accs, treespec, name="update", reference_name="accumulator",
                         check_dtype=False)
        mini_step = _read_count(state.mini_step, "mini_step")
        _read_count(state.gradient_step, "gradient_step")

        skip_state = state.skip_state
        if self._should_skip_update_fn is not None:
            should_skip, skip_state = self._should_skip_update_fn(
                updates, state.gradient_step, params
            )
            if _read_skip(should_skip):
                return Window(leaves, treespec, accs, mini_step, True, False, skip_state)
        closes = mini_step + 1 >= self._k_steps(state.gradient_step)
        return Window(leaves, treespec, accs, mini_step, False, closes, skip_state)

    def _accumulate(self, g: torch.Tensor, acc: torch.Tensor, mini_step: int) -> torch.Tensor:
        g = g.to(acc.dtype)
        if self._use_grad_mean:
            return acc + (g - acc) / (mini_step + 1)
        return acc + g

    @property
    def should_skip_update_fn(self) -> ShouldSkipUpdateFunction | None:
        """The skip rule given, or None."""
        return self._should_skip_update_fn

    @property
    def use_grad_mean(self) -> bool:
        """Whether the window's gradients are averaged (else summed)."""
        return self._use_grad_mean

    def has_updated(self, state: MultiStepsState) -> torch.Tensor:
        """Whether the last ``update`` closed a window (a 0-d bool CPU tensor)."""
        return torch.logical_and(state.mini_step == 0, state.gradient_step > 0)

    def gradient_transformation(self) -> GradientTransformation:
        """This wrapper as a [`GradientTransformation`][functopt.GradientTransformation]
        (with a spec: ``functopt.fast.make_step`` accumulates with ``foreach`` ops and steps
        the inner transform on its own fast path when a window closes)."""
        return specified(GradientTransformation(self.init, self.update), Accumulated(self))


@dataclass(frozen=True)
class Window:
    """One mini-step of [`MultiSteps`][functopt.MultiSteps], decided (see `MultiSteps.window`)."""

    leaves: list[Any]  # the updates, flattened
    treespec: _core.TreeSpec
    accs: list[Any]  # state.acc_grads lined up with them
    mini_step: int  # state.mini_step, read on the host
    skip: bool  # should_skip_update_fn rejected the mini-step
    closes: bool  # this mini-step closes the window: the inner transform updates
    skip_state: Any  # the new skip_state

    def next_state(self, state: MultiStepsState, acc_grads: Updates,
                   inner_opt_state: State | None = None) -> MultiStepsState:
        """The state after this (not skipped) mini-step, with these accumulators and, when
        the window closes, the inner transform's new state."""
        if not self.closes:
            return MultiStepsState(
                mini_step=torch.tensor(self.mini_step + 1, dtype=torch.int32),
                gradient_step=state.gradient_step, inner_opt_state=state.inner_opt_state,
                acc_grads=acc_grads, skip_state=self.skip_state)
        return MultiStepsState(
            mini_step=torch.zeros((), dtype=torch.int32),
            gradient_step=_common.safe_increment(state.gradient_step.cpu()),
            inner_opt_state=inner_opt_state, acc_grads=acc_grads, skip_state=self.skip_state)


@dataclass(frozen=True, eq=False)
class Accumulated(Spec):
    """The spec of ``MultiSteps(...).gradient_transformation()``: the wrapper itself (its
    window decisions, ``use_grad_mean``, ``inner_opt``). Only a step function that owns the
    whole step lowers it (the planner's per-leaf programs do not: inside a chain it is
    opaque)."""

    multi_steps: MultiSteps
