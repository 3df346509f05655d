"""Rescaling by root-mean-square statistics of the gradient: ``scale_by_rms`` (RMSProp),
``scale_by_stddev`` (centered RMSProp) and ``scale_by_rss`` (Adagrad)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from functopt import _validate
from functopt._base import GradientTransformation, Numeric, Params, Updates
from functopt._rules import state_slots
from functopt._spec import Leafwise, specified
from functopt.transforms import _common

__all__ = [
    "ScaleByAdaDeltaState",
    "ScaleByRStdDevState",
    "ScaleByRmsState",
    "ScaleByRssState",
    "scale_by_adadelta",
    "scale_by_rms",
    "scale_by_rss",
    "scale_by_stddev",
]


def _check_rms_args(owner: str, decay: Any, eps: Any, initial_scale: Any,
                    bias_correction: bool) -> None:
    _common.check_betas(owner, closed=not bias_correction, decay=decay)
    _validate.check_range(owner, "eps", eps, low=0.0)
    _validate.check_range(owner, "initial_scale", initial_scale, low=0.0,
                          hint="Fix: it is the starting second moment, a square; use >= 0.")


def _rms_scaling(second: torch.Tensor, eps: Numeric, eps_in_sqrt: bool) -> torch.Tensor:
    eps = _common.scalar(eps, second.dtype)
    if eps_in_sqrt:
        return torch.rsqrt(second + eps)
    return 1 / (torch.sqrt(second) + eps)


class ScaleByRmsState(NamedTuple):
    """State of [`scale_by_rms`][functopt.scale_by_rms]."""

    # The name shadows tuple.count (hence the ignore); kept: optax's name, public API.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far
    nu: Updates  # like params, the param's dtype: EMA of the squared gradient


def scale_by_rms(
    decay: Numeric = 0.9,
    eps: Numeric = 1e-8,
    initial_scale: Numeric = 0.0,
    eps_in_sqrt: bool = True,
    bias_correction: bool = False,
) -> GradientTransformation:
    r"""Rescale updates by the root of an EMA of the squared gradient (RMSProp).

    With $\nu_0 =$ ``initial_scale`` and $t$ counting from 1:

    $$
    \nu_t = d\,\nu_{t-1} + (1-d)\,g_t^2, \quad
    \hat\nu_t = \nu_t / (1-d^t) \text{ if bias\_correction else } \nu_t, \\
    u_t = g_t / \sqrt{\hat\nu_t + \epsilon} \text{ if eps\_in\_sqrt else }
    g_t / (\sqrt{\hat\nu_t} + \epsilon),
    $$

    where $d$ is ``decay``. ``chain(scale_by_rms(decay=alpha, eps=eps,
    eps_in_sqrt=False), scale(-lr))`` is ``torch.optim.RMSprop(lr, alpha, eps)``;
    ``scale_by_rms(decay=b2, eps_in_sqrt=False, bias_correction=True)`` is
    ``scale_by_adam(b1=0, b2=b2)`` without storing a first moment.

    With ``eps = 0`` a zero gradient over a zero second moment is $0/0 =$ NaN, as in optax
    and ``torch.optim.RMSprop(eps=0)``: before any non-zero gradient (``initial_scale=0``),
    and wherever the EMA has left the float32 range of the maths (a ``decay`` of 1e-205
    times ``initial_scale`` flushes to zero, although float64 would keep it). Keep ``eps``
    positive to guard against that. (Adagrad's [`scale_by_rss`][functopt.scale_by_rss]
    returns 0 there instead, as optax's does.)

    Unlike optax, whose state is ``ScaleByRmsState(nu)`` or, with ``bias_correction``,
    ``ScaleByRmsWithCountState(count, nu)``, the state here always holds the count (one
    state type, whatever the flags).

    Args:
        decay: decay of the squared-gradient EMA, in [0, 1] ([0, 1) with
            ``bias_correction``).
        eps: stabilizer of the denominator, >= 0.
        initial_scale: starting value of the EMA, >= 0.
        eps_in_sqrt: add ``eps`` inside the root (True) or outside it (False, as torch).
        bias_correction: divide the EMA by $1-d^t$.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`ScaleByRmsState`][functopt.ScaleByRmsState].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_rms(decay=0.75, eps=0.0)
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> u, state = tx.update({"w": torch.tensor([1.0, -4.0])}, state)
        >>> u["w"]  # g / sqrt(0.25 g^2)
        tensor([ 2., -2.])

    References:
        Tieleman & Hinton, *Lecture 6.5 - RMSProp*, COURSERA: Neural Networks for Machine
        Learning, 2012.
    """
    _validate.check_flags("scale_by_rms", eps_in_sqrt=eps_in_sqrt,
                          bias_correction=bias_correction)
    owner = "scale_by_rms"
    _check_rms_args(owner, decay, eps, initial_scale, bias_correction)

    def init_fn(params: Params) -> ScaleByRmsState:
        leaves, treespec = _common.flatten_params(params)
        return ScaleByRmsState(
            count=_common.zero_count(leaves),
            nu=_common.unflatten(treespec, _common.full(leaves, initial_scale)),
        )

    def update_fn(
        updates: Updates, state: ScaleByRmsState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ScaleByRmsState]:
        _common.check_state("scale_by_rms", state, ScaleByRmsState)
        del params, extra_args
        grads, treespec = _common.flatten_updates(updates)
        nus = _common.state_like(treespec, state.nu, name="state.nu", like=grads)
        _common.check_state_present(owner, treespec, grads, nu=nus)
        count = _common.safe_increment(state.count)
        bc = _common.bias_correction(decay, count) if bias_correction else None

        def leaf(g: torch.Tensor, nu: torch.Tensor) -> tuple[torch.Tensor, ...]:
            wide = g.to(_common.compute_dtype(g.dtype, nu.dtype))
            c = functools.partial(_common.scalar, dtype=wide.dtype)
            nu_t = c(decay) * nu.to(wide.dtype) + c(1 - decay) * (wide * wide)
            nu_hat = nu_t if bc is None else nu_t / c(bc)
            return ((_rms_scaling(nu_hat, eps, eps_in_sqrt) * wide).to(g.dtype),
                    nu_t.to(nu.dtype))

        new_updates, new_nus = _common.map_with_state(leaf, grads, nus)
        new_state = ScaleByRmsState(count=count, nu=_common.unflatten(treespec, new_nus))
        return _common.unflatten(treespec, new_updates), new_state

    return specified(GradientTransformation(init_fn, update_fn), Leafwise(
        "scale_by_rms", {"decay": decay, "eps": eps, "initial_scale": initial_scale,
        "eps_in_sqrt": eps_in_sqrt, "bias_correction": bias_correction},
        slots=state_slots(ScaleByRmsState)))


class ScaleByRStdDevState(NamedTuple):
    """State of [`scale_by_stddev`][functopt.scale_by_stddev]."""

    # The name shadows tuple.count (hence the ignore); kept: optax's name, public API.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far
    mu: Updates  # like params, the param's dtype: EMA of the gradient
    nu: Updates  # like params, the param's dtype: EMA of the squared gradient


def scale_by_stddev(
    decay: Numeric = 0.9,
    eps: Numeric = 1e-8,
    initial_scale: Numeric = 0.0,
    eps_in_sqrt: bool = True,
    bias_correction: bool = False,
) -> GradientTransformation:
    r"""Rescale updates by the root of a centered EMA of the squared gradient.

    Like [`scale_by_rms`][functopt.scale_by_rms], with the EMA of the gradient $\mu_t$ (starting at 0)
    subtracted as a running estimate of the variance:

    $$
    \mu_t = d\,\mu_{t-1} + (1-d)\,g_t, \quad
    \nu_t = d\,\nu_{t-1} + (1-d)\,g_t^2, \\
    u_t = g_t / \sqrt{\hat\nu_t - \hat\mu_t^2 + \epsilon} \text{ if eps\_in\_sqrt else }
    g_t / (\sqrt{\hat\nu_t - \hat\mu_t^2} + \epsilon),
    $$

    with the hats dividing by $1-d^t$ when ``bias_correction``. With
    ``eps_in_sqrt=False`` this is ``torch.optim.RMSprop(centered=True)``. As in optax and
    torch the difference is not clamped: where rounding makes it negative (possible in
    low precision once the gradient is nearly constant) the update is NaN; keep ``eps``
    inside the root to guard against that. With ``eps = 0`` a zero gradient over a zero
    variance is $0/0 =$ NaN, as in [`scale_by_rms`][functopt.scale_by_rms].

    The state always holds the count (optax adds it only with ``bias_correction``, in a
    second state type).

    Args:
        decay: decay of both EMAs, in [0, 1] ([0, 1) with ``bias_correction``).
        eps: stabilizer of the denominator, >= 0.
        initial_scale: starting value of the squared-gradient EMA, >= 0.
        eps_in_sqrt: add ``eps`` inside the root (True) or outside it (False, as torch).
        bias_correction: divide both EMAs by $1-d^t$.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`ScaleByRStdDevState`][functopt.ScaleByRStdDevState].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_stddev(decay=0.5, eps=0.0)
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> u, state = tx.update({"w": torch.tensor([2.0])}, state)
        >>> u["w"]  # 2 / sqrt(0.5 * 4 - 1 ** 2)
        tensor([2.])

    References:
        Graves, *Generating Sequences With Recurrent Neural Networks*, 2013 (eq. 38-45).
    """
    _validate.check_flags("scale_by_stddev", eps_in_sqrt=eps_in_sqrt,
                          bias_correction=bias_correction)
    owner = "scale_by_stddev"
    _check_rms_args(owner, decay, eps, initial_scale, bias_correction)

    def init_fn(params: Params) -> ScaleByRStdDevState:
        leaves, treespec = _common.flatten_params(params)
        mu = [None if p is None else _common.zeros_like(p) for p in leaves]
        return ScaleByRStdDevState(
            count=_common.zero_count(leaves),
            mu=_common.unflatten(treespec, mu),
            nu=_common.unflatten(treespec, _common.full(leaves, initial_scale)),
        )

    def update_fn(
        updates: Updates, state: ScaleByRStdDevState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ScaleByRStdDevState]:
        _common.check_state("scale_by_stddev", state, ScaleByRStdDevState)
        del params, extra_args
        grads, treespec = _common.flatten_updates(updates)
        mus = _common.state_like(treespec, state.mu, name="state.mu", like=grads)
        nus = _common.state_like(treespec, state.nu, name="state.nu", like=grads)
        _common.check_state_present(owner, treespec, grads, mu=mus, nu=nus)
        count = _common.safe_increment(state.count)
        bc = _common.bias_correction(decay, count) if bias_correction else None

        def leaf(g: torch.Tensor, mu: torch.Tensor, nu: torch.Tensor) -> tuple[torch.Tensor, ...]:
            wide = g.to(_common.compute_dtype(g.dtype, mu.dtype, nu.dtype))
            c = functools.partial(_common.scalar, dtype=wide.dtype)
            mu_t = c(decay) * mu.to(wide.dtype) + c(1 - decay) * wide
            nu_t = c(decay) * nu.to(wide.dtype) + c(1 - decay) * (wide * wide)
            mu_hat, nu_hat = (mu_t, nu_t) if bc is None else (mu_t / c(bc), nu_t / c(bc))
            scaling = _rms_scaling(nu_hat - mu_hat * mu_hat, eps, eps_in_sqrt)
            return (scaling * wide).to(g.dtype), mu_t.to(mu.dtype), nu_t.to(nu.dtype)

        new_updates, new_mus, new_nus = _common.map_with_state(leaf, grads, mus, nus)
        new_state = ScaleByRStdDevState(
            count=count,
            mu=_common.unflatten(treespec, new_mus),
            nu=_common.unflatten(treespec, new_nus),
        )
        return _common.unflatten(treespec, new_updates), new_state

    return specified(GradientTransformation(init_fn, update_fn), Leafwise(
        "scale_by_stddev", {"decay": decay, "eps": eps, "initial_scale": initial_scale,
        "eps_in_sqrt": eps_in_sqrt, "bias_correction": bias_correction},
        slots=state_slots(ScaleByRStdDevState)))


class ScaleByRssState(NamedTuple):
    """State of [`scale_by_rss`][functopt.scale_by_rss]."""

    sum_of_squares: Updates  # like params, the param's dtype: initial value + sum of g**2


def scale_by_rss(
    initial_accumulator_value: Numeric = 0.1, eps: Numeric = 1e-7, *, eps_in_sqrt: bool = True
) -> GradientTransformation:
    r"""Rescale updates by the root of the sum of all squared gradients so far (Adagrad).

    With $s_0 =$ ``initial_accumulator_value``:

    $$
    s_t = s_{t-1} + g_t^2, \quad
    u_t = g_t / \sqrt{s_t + \epsilon} \text{ where } s_t > 0, \text{ else } 0
    $$

    (or $g_t / (\sqrt{s_t} + \epsilon)$ with ``eps_in_sqrt=False``, torch's placement).

    ``torch.optim.Adagrad`` differs in its defaults (``initial_accumulator_value=0``,
    ``eps=1e-10``) and puts ``eps`` outside the root ($g/(\sqrt{s}+\epsilon)$):
    ``chain(scale_by_rss(v, eps, eps_in_sqrt=False), scale(-lr))`` is
    ``Adagrad(lr, initial_accumulator_value=v, eps=eps)``. The zero branch is written so
    that gradients through this transform stay finite where $s_t = 0$.

    Args:
        initial_accumulator_value: starting value of the accumulator, >= 0.
        eps: added to the accumulator inside the root, >= 0.
        eps_in_sqrt: add ``eps`` inside the root (True, optax) or to the root (False, as
            torch.optim.Adagrad). Not in optax's ``scale_by_rss``.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`ScaleByRssState`][functopt.ScaleByRssState].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_rss(initial_accumulator_value=0.0, eps=0.0)
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> u, state = tx.update({"w": torch.tensor([3.0, 0.0])}, state)
        >>> u, state = tx.update({"w": torch.tensor([4.0, 0.0])}, state)
        >>> u["w"]  # 4 / sqrt(9 + 16); 0 where nothing was accumulated
        tensor([0.8000, 0.0000])

    References:
        Duchi, Hazan & Singer, *Adaptive Subgradient Methods for Online Learning and
        Stochastic Optimization*, JMLR 2011.
    """
    _validate.check_flags("scale_by_rss", eps_in_sqrt=eps_in_sqrt)
    owner = "scale_by_rss"
    _validate.check_range(owner, "initial_accumulator_value", initial_accumulator_value,
                          low=0.0, hint="Fix: it starts a sum of squares; use >= 0.")
    _validate.check_range(owner, "eps", eps, low=0.0)

    def init_fn(params: Params) -> ScaleByRssState:
        leaves, treespec = _common.flatten_params(params)
        return ScaleByRssState(
            sum_of_squares=_common.unflatten(treespec, _common.full(leaves, initial_accumulator_value))
        )

    def update_fn(
        updates: Updates, state: ScaleByRssState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ScaleByRssState]:
        _common.check_state("scale_by_rss", state, ScaleByRssState)
        del params, extra_args
        grads, treespec = _common.flatten_updates(updates)
        sums = _common.state_like(treespec, state.sum_of_squares, name="state.sum_of_squares",
                                  like=grads)
        _common.check_state_present(owner, treespec, grads, sum_of_squares=sums)
        def leaf(g: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
            wide = g.to(_common.compute_dtype(g.dtype, s.dtype))
            s_t = s.to(wide.dtype) + wide * wide
            positive = s_t > 0
            # Feed rsqrt a harmless 1 off the selected branch: rsqrt(0) = inf would turn the
            # (zero) backward of torch.where into 0 * inf = nan.
            # A factor times g (as optax): a NaN gradient stays NaN where s_t is not > 0.
            e = _common.scalar(eps, wide.dtype)
            if eps_in_sqrt:
                inv = torch.where(positive, torch.rsqrt(torch.where(positive, s_t + e, 1.0)), 0.0)
            else:
                inv = torch.where(positive, 1 / (torch.sqrt(torch.where(positive, s_t, 1.0)) + e),
                                  0.0)
            return (inv * wide).to(g.dtype), s_t.to(s.dtype)

        new_updates, new_sums = _common.map_with_state(leaf, grads, sums)
        new_state = ScaleByRssState(sum_of_squares=_common.unflatten(treespec, new_sums))
        return _common.unflatten(treespec, new_updates), new_state

    return specified(GradientTransformation(init_fn, update_fn), Leafwise(
        "scale_by_rss", {"initial_accumulator_value": initial_accumulator_value, "eps": eps,
        "eps_in_sqrt": eps_in_sqrt}, slots=state_slots(ScaleByRssState)))


class ScaleByAdaDeltaState(NamedTuple):
    """State of [`scale_by_adadelta`][functopt.scale_by_adadelta]."""

    e_g: Updates  # like params, the param's dtype: EMA of the squared gradient
    e_x: Updates  # like params, the param's dtype: EMA of the squared update


def scale_by_adadelta(rho: Numeric = 0.9, eps: Numeric = 1e-6) -> GradientTransformation:
    r"""Rescale updates by Adadelta (Zeiler, 2012).

    With $E[g^2]_0 = E[\Delta x^2]_0 = 0$:

    $$
    E[g^2]_t = \rho E[g^2]_{t-1} + (1-\rho) g_t^2, \quad
    u_t = \frac{\sqrt{E[\Delta x^2]_{t-1} + \epsilon}}{\sqrt{E[g^2]_t + \epsilon}}\, g_t,
    \quad E[\Delta x^2]_t = \rho E[\Delta x^2]_{t-1} + (1-\rho) u_t^2.
    $$

    optax's rule; chained with ``scale_by_learning_rate(lr)`` it is
    ``torch.optim.Adadelta(lr, rho, eps)``. The maths runs in the widest of the leaf's
    dtypes and float32.

    Args:
        rho: decay of both averages, in [0, 1].
        eps: added inside both roots, >= 0.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`ScaleByAdaDeltaState`][functopt.ScaleByAdaDeltaState].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_adadelta(rho=0.5, eps=1e-4)
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> u, state = tx.update({"w": torch.tensor([1.0])}, state)
        >>> u["w"]  # sqrt(1e-4) / sqrt(0.5 + 1e-4)
        tensor([0.0141])

    References:
        Zeiler, *ADADELTA: An Adaptive Learning Rate Method*, 2012.
    """
    owner = "scale_by_adadelta"
    _common.check_betas(owner, closed=True, rho=rho)
    _validate.check_range(owner, "eps", eps, low=0.0)

    def init_fn(params: Params) -> ScaleByAdaDeltaState:
        leaves, treespec = _common.flatten_params(params)
        zeros = [None if p is None else _common.zeros_like(p) for p in leaves]
        return ScaleByAdaDeltaState(e_g=_common.unflatten(treespec, zeros),
                                    e_x=_common.unflatten(treespec, list(map(_clone, zeros))))

    def update_fn(
        updates: Updates, state: ScaleByAdaDeltaState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ScaleByAdaDeltaState]:
        _common.check_state(owner, state, ScaleByAdaDeltaState)
        del params, extra_args
        grads, treespec = _common.flatten_updates(updates)
        e_gs = _common.state_like(treespec, state.e_g, name="state.e_g", like=grads)
        e_xs = _common.state_like(treespec, state.e_x, name="state.e_x", like=grads)
        _common.check_state_present(owner, treespec, grads, e_g=e_gs, e_x=e_xs)

        def leaf(g: torch.Tensor, e_g: torch.Tensor,
                 e_x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            wide = g.to(_common.compute_dtype(g.dtype, e_g.dtype, e_x.dtype))
            c = functools.partial(_common.scalar, dtype=wide.dtype)
            e_g_t = c(rho) * e_g.to(wide.dtype) + c(1 - rho) * (wide * wide)
            u = torch.sqrt(e_x.to(wide.dtype) + c(eps)) / torch.sqrt(e_g_t + c(eps)) * wide
            e_x_t = c(rho) * e_x.to(wide.dtype) + c(1 - rho) * (u * u)
            return u.to(g.dtype), e_g_t.to(e_g.dtype), e_x_t.to(e_x.dtype)

        new_updates, new_e_gs, new_e_xs = _common.map_with_state(leaf, grads, e_gs, e_xs)
        return _common.unflatten(treespec, new_updates), ScaleByAdaDeltaState(
            e_g=_common.unflatten(treespec, new_e_gs), e_x=_common.unflatten(treespec, new_e_xs))

    return specified(GradientTransformation(init_fn, update_fn), Leafwise(
        "scale_by_adadelta", {"rho": rho, "eps": eps}, slots=state_slots(ScaleByAdaDeltaState)))


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()
