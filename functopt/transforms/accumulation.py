"""Accumulating updates across steps: ``trace`` (momentum) and ``ema`` (moving average)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from functopt import _validate
from functopt._base import GradientTransformation, Numeric, Params, Updates
from functopt._rules import state_slots
from functopt._spec import Leafwise, specified
from functopt.transforms import _common

__all__ = [
    "DampenedTraceState",
    "EmaState",
    "TraceState",
    "dampened_trace",
    "ema",
    "trace",
]


class TraceState(NamedTuple):
    """State of [`trace`][functopt.trace]."""

    trace: Updates  # like params, dtype accumulator_dtype (default: the param's): momentum


def trace(
    decay: Numeric,
    nesterov: bool = False,
    accumulator_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Momentum: a decaying sum of past updates.

    With update $g_t$ and trace $m_0 = 0$:

    $$
    m_t = g_t + \text{decay}\cdot m_{t-1}, \qquad
    u_t = m_t \quad\text{or, with nesterov,}\quad u_t = g_t + \text{decay}\cdot m_t.
    $$

    Chained with ``scale(-lr)`` this is ``torch.optim.SGD(lr, momentum=decay,
    nesterov=nesterov)`` with ``dampening=0``. Compare [`ema`][functopt.ema], which weights the new
    update by ``1 - decay``. The trace is computed in the wider of the update's and the
    trace's dtype and stored in the trace's; the update keeps its dtype. Where an update is
    ``None`` the trace is left as it is.

    Args:
        decay: the momentum coefficient, >= 0.
        nesterov: use Nesterov momentum.
        accumulator_dtype: storage dtype of the trace (default: the param's dtype).

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`TraceState`][functopt.TraceState].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.trace(0.5)
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> u, state = tx.update({"w": torch.tensor([1.0])}, state)
        >>> u, state = tx.update({"w": torch.tensor([1.0])}, state)
        >>> u["w"]
        tensor([1.5000])

    References:
        Polyak, *Some methods of speeding up the convergence of iteration methods*, 1964.
        Sutskever et al., *On the importance of initialization and momentum in deep
        learning*, 2013.
    """
    _validate.check_flags("trace", nesterov=nesterov)
    owner = "trace"
    _validate.check_range(owner, "decay", decay, low=0.0,
                          hint="Fix: pass a momentum coefficient such as 0.9.")
    _validate.check_dtype(owner, "accumulator_dtype", accumulator_dtype)

    def init_fn(params: Params) -> TraceState:
        leaves, treespec = _common.flatten_params(params)
        trace_ = [None if p is None else _common.zeros_like(p, accumulator_dtype) for p in leaves]
        return TraceState(trace=_common.unflatten(treespec, trace_))

    def update_fn(
        updates: Updates, state: TraceState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, TraceState]:
        _common.check_state("trace", state, TraceState)
        del params, extra_args
        grads, treespec = _common.flatten_updates(updates)
        traces = _common.state_like(treespec, state.trace, name="state.trace", like=grads)
        def leaf(g: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
            m = g + _common.scaled(t.to(torch.promote_types(g.dtype, t.dtype)), decay)
            u = g + _common.scaled(m, decay) if nesterov else m
            return u.to(g.dtype), m.to(t.dtype)

        new_updates, new_traces = _common.map_with_state(leaf, grads, traces)
        return _common.unflatten(treespec, new_updates), TraceState(
            trace=_common.unflatten(treespec, new_traces)
        )

    return specified(GradientTransformation(init_fn, update_fn), Leafwise(
        "trace", {"decay": decay, "nesterov": nesterov, "accumulator_dtype": accumulator_dtype},
        slots=state_slots(TraceState), kernel="momentum"))


class DampenedTraceState(NamedTuple):
    """State of [`dampened_trace`][functopt.dampened_trace]."""

    # The name shadows tuple.count (hence the ignore); kept: the name used elsewhere.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far
    trace: Updates  # like params, dtype accumulator_dtype (default: the param's): momentum


def dampened_trace(
    decay: Numeric,
    dampening: Numeric = 0.0,
    nesterov: bool = False,
    accumulator_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Momentum with dampening, as ``torch.optim.SGD`` computes it.

    With update $g_t$, $t$ counting from 1, momentum $\mu$ (``decay``) and dampening
    $\tau$:

    $$
    m_1 = g_1, \qquad m_t = \mu\, m_{t-1} + (1 - \tau)\, g_t, \qquad
    u_t = m_t \quad\text{or, with nesterov,}\quad u_t = g_t + \mu\, m_t.
    $$

    The first step takes the update undamped (torch.optim starts its buffer from a copy of
    the gradient), which is why the state counts steps. With ``dampening=0`` this is
    [`trace`][functopt.trace], which has a fused kernel; prefer it there. Chained with
    ``scale_by_learning_rate(lr)`` this is ``torch.optim.SGD(lr, momentum=decay,
    dampening=dampening, nesterov=nesterov)``. The trace is computed in the wider of the
    update's and the trace's dtype and stored in the trace's; where an update is ``None``
    the trace is left as it is.

    Args:
        decay: the momentum coefficient $\mu$, >= 0.
        dampening: the dampening $\tau$, in [0, 1]: the new update is weighted $1-\tau$.
        nesterov: use Nesterov momentum (torch requires ``dampening=0`` for it; this
            transform does not).
        accumulator_dtype: storage dtype of the trace (default: the param's dtype).

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with
        [`DampenedTraceState`][functopt.DampenedTraceState].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.dampened_trace(0.5, dampening=0.5)
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> u, state = tx.update({"w": torch.tensor([2.0])}, state)
        >>> u["w"]  # the first step is undamped
        tensor([2.])
        >>> u, state = tx.update({"w": torch.tensor([2.0])}, state)
        >>> u["w"]  # 0.5 * 2 + (1 - 0.5) * 2
        tensor([2.])
    """
    _validate.check_flags("dampened_trace", nesterov=nesterov)
    owner = "dampened_trace"
    _validate.check_range(owner, "decay", decay, low=0.0,
                          hint="Fix: pass a momentum coefficient such as 0.9.")
    _validate.check_range(owner, "dampening", dampening, low=0.0, high=1.0,
                          hint="Fix: dampening weights the new update by 1 - dampening.")
    _validate.check_dtype(owner, "accumulator_dtype", accumulator_dtype)

    def init_fn(params: Params) -> DampenedTraceState:
        leaves, treespec = _common.flatten_params(params)
        trace_ = [None if p is None else _common.zeros_like(p, accumulator_dtype) for p in leaves]
        return DampenedTraceState(count=_common.zero_count(leaves),
                                  trace=_common.unflatten(treespec, trace_))

    def update_fn(
        updates: Updates, state: DampenedTraceState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, DampenedTraceState]:
        _common.check_state(owner, state, DampenedTraceState)
        del params, extra_args
        grads, treespec = _common.flatten_updates(updates)
        traces = _common.state_like(treespec, state.trace, name="state.trace", like=grads)
        _common.check_state_present(owner, treespec, grads, trace=traces)
        first = state.count == 0

        def leaf(g: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
            wide = g.to(torch.promote_types(g.dtype, t.dtype))
            later = _common.scaled(t.to(wide.dtype), decay) + _common.scaled(wide, 1 - dampening)
            m = torch.where(first.to(wide.device), wide, later)
            u = wide + _common.scaled(m, decay) if nesterov else m
            return u.to(g.dtype), m.to(t.dtype)

        new_updates, new_traces = _common.map_with_state(leaf, grads, traces)
        return _common.unflatten(treespec, new_updates), DampenedTraceState(
            count=_common.safe_increment(state.count),
            trace=_common.unflatten(treespec, new_traces),
        )

    return specified(GradientTransformation(init_fn, update_fn), Leafwise(
        "dampened_trace", {"decay": decay, "dampening": dampening, "nesterov": nesterov,
                           "accumulator_dtype": accumulator_dtype},
        slots=state_slots(DampenedTraceState), kernel="dampened_momentum"))


class EmaState(NamedTuple):
    """State of [`ema`][functopt.ema]."""

    # The name shadows tuple.count (hence the ignore); kept: optax's name, public API.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far
    ema: Updates  # like params, dtype accumulator_dtype (default: the param's): the average


def ema(
    decay: Numeric,
    debias: bool = True,
    accumulator_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""An exponential moving average of past updates, optionally debiased.

    With update $g_t$, $e_0 = 0$ and $t$ counting from 1:

    $$
    e_t = (1 - \text{decay})\, g_t + \text{decay}\cdot e_{t-1}, \qquad
    u_t = e_t / (1 - \text{decay}^t) \ \text{(debias)} \quad\text{or}\quad u_t = e_t.
    $$

    The stored average is never debiased, only the returned update. Computed in the wider
    of the update's and the average's dtype, stored in the average's; the update keeps its
    dtype. Where an update is ``None`` the average is left as it is (the count still
    advances, as it is shared by all leaves).

    Args:
        decay: the decay rate, in [0, 1) (in [0, 1] with ``debias=False``).
        debias: divide by $1 - \text{decay}^t$ to remove the bias towards zero.
        accumulator_dtype: storage dtype of the average (default: the param's dtype).

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`EmaState`][functopt.EmaState].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.ema(0.9)
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> u, state = tx.update({"w": torch.tensor([2.0])}, state)
        >>> u["w"], state.ema["w"]  # debiased update, raw average
        (tensor([2.]), tensor([0.2000]))
    """
    _validate.check_flags("ema", debias=debias)
    owner = "ema"
    _validate.check_range(owner, "decay", decay, low=0.0, high=1.0, high_open=debias,
                          hint="Fix: pass a decay rate such as 0.9 (1 only with debias=False).")
    _validate.check_dtype(owner, "accumulator_dtype", accumulator_dtype)

    def init_fn(params: Params) -> EmaState:
        leaves, treespec = _common.flatten_params(params)
        averages = [None if p is None else _common.zeros_like(p, accumulator_dtype) for p in leaves]
        return EmaState(count=_common.zero_count(leaves),
                        ema=_common.unflatten(treespec, averages))

    def update_fn(
        updates: Updates, state: EmaState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, EmaState]:
        _common.check_state("ema", state, EmaState)
        del params, extra_args
        grads, treespec = _common.flatten_updates(updates)
        averages = _common.state_like(treespec, state.ema, name="state.ema", like=grads)
        count = _common.safe_increment(state.count)
        correction = _common.bias_correction(decay, count) if debias else None
        def leaf(g: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, ...]:
            # Widen g too: (1 - decay) * g would otherwise round in g's (maybe float16) dtype
            # before it meets a wider average.
            wide = torch.promote_types(g.dtype, e.dtype)
            e_t = _common.scaled(g.to(wide), 1 - decay) + _common.scaled(e.to(wide), decay)
            if correction is None:
                return e_t.to(g.dtype), e_t.to(e.dtype)
            exact = _common.compute_dtype(wide)
            u = e_t.to(exact) / _common.scalar(correction, exact)
            return u.to(g.dtype), e_t.to(e.dtype)

        new_updates, new_averages = _common.map_with_state(leaf, grads, averages)
        return _common.unflatten(treespec, new_updates), EmaState(
            count=count, ema=_common.unflatten(treespec, new_averages)
        )

    # elementwise: the compiled tier runs it, and the per-leaf tier beside a per-leaf rule
    # (Adafactor's momentum)
    return specified(GradientTransformation(init_fn, update_fn), Leafwise("ema", {
        "decay": decay, "debias": debias, "accumulator_dtype": accumulator_dtype},
        slots=state_slots(EmaState)))
