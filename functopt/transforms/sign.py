"""Sign-based rescaling: ``scale_by_sign`` (signSGD) and ``scale_by_rprop`` (Rprop)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from functopt import _validate
from functopt._base import EmptyState, GradientTransformation, Numeric, Params, Updates
from functopt._rules import state_slots
from functopt._spec import Leafwise, specified
from functopt.transforms import _common

__all__ = [
    "ScaleByRpropState",
    "scale_by_rprop",
    "scale_by_sign",
]


def _sign(x: torch.Tensor) -> torch.Tensor:
    """Elementwise sign with XLA's (so jax's, so optax's) conventions (private helper).

    ``torch.sign`` maps NaN to 0 and -0.0 to +0.0; this keeps NaN and signed zeros as they
    are, so that a NaN gradient is not silently turned into a zero update.
    """
    return torch.where((x > 0) | (x < 0), torch.sign(x), x)


def scale_by_sign() -> GradientTransformation:
    r"""Replace each update by its elementwise sign: $u \leftarrow \operatorname{sign}(u)$.

    $\operatorname{sign}$ is 1 or -1, and ±0 and NaN are kept as they are (as
    ``jnp.sign`` does; ``torch.sign`` would turn NaN into 0 and hide it). The update keeps
    its dtype; ``None`` updates stay ``None``. signSGD is ``chain(scale_by_sign(),
    scale(-lr))``.

    Returns:
        A stateless [`GradientTransformation`][functopt.GradientTransformation].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_sign()
        >>> tx.update({"w": torch.tensor([0.2, -7.0, 0.0])}, tx.init(None))[0]
        {'w': tensor([ 1., -1.,  0.])}

    References:
        Bernstein et al., *signSGD: Compressed Optimisation for Non-Convex Problems*,
        ICML 2018.
    """

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(
        updates: Updates, state: EmptyState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, EmptyState]:
        _common.check_state("scale_by_sign", state, EmptyState)
        del params, extra_args
        leaves, treespec = _common.flatten_updates(updates)
        return _common.unflatten(treespec, [None if u is None else _sign(u)
                                            for u in leaves]), state

    # elementwise: the compiled tier runs this update over a group's leaves laid end to end
    return specified(GradientTransformation(init_fn, update_fn), Leafwise("scale_by_sign", {},
                                                                      slots=state_slots(EmptyState)))


class ScaleByRpropState(NamedTuple):
    """State of [`scale_by_rprop`][functopt.scale_by_rprop]."""

    step_sizes: Updates  # like params, the param's dtype: each element's step size
    prev_updates: Updates  # like params, the param's dtype: the last gradient (0 where it
    # changed sign)


def scale_by_rprop(
    learning_rate: Numeric,
    eta_minus: Numeric = 0.5,
    eta_plus: Numeric = 1.2,
    min_step_size: Numeric = 1e-6,
    max_step_size: Numeric = 50.0,
) -> GradientTransformation:
    r"""Rescale updates by Rprop: a per-element step size driven by sign changes.

    With step sizes $s_0 =$ ``learning_rate`` and $g'_0 = 0$, per element:

    $$
    s_t = \operatorname{clip}\big(s_{t-1} \cdot \eta_t, s_{min}, s_{max}\big), \quad
    \eta_t = \begin{cases}\eta_+ & g_t g'_{t-1} > 0 \\ \eta_- & g_t g'_{t-1} < 0
    \\ 1 & \text{else}\end{cases}, \quad
    g'_t = 0 \text{ where } g_t g'_{t-1} < 0 \text{, else } g_t, \quad
    u_t = \operatorname{sign}(g'_t)\, s_t.
    $$

    This is ``torch.optim.Rprop``'s rule (chained with ``scale(-1)``): after a sign change
    the element does not move and its next step counts as a fresh start. optax's
    ``scale_by_rprop`` has the same signature; it clips only where the sign product is
    non-zero (the two agree while ``learning_rate`` lies in the clip range).

    Args:
        learning_rate: the initial step size, > 0.
        eta_minus: the factor after a sign change, in (0, 1).
        eta_plus: the factor while the sign holds, > 1.
        min_step_size: the smallest step size, >= 0.
        max_step_size: the largest step size, >= ``min_step_size``.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`ScaleByRpropState`][functopt.ScaleByRpropState].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_rprop(0.1)
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> u, state = tx.update({"w": torch.tensor([1.0, -1.0])}, state)
        >>> u, state = tx.update({"w": torch.tensor([2.0, 1.0])}, state)
        >>> u["w"]  # same sign: 0.1 * 1.2; sign change: no move
        tensor([0.1200, 0.0000])

    References:
        Riedmiller & Braun, *A direct adaptive method for faster backpropagation learning:
        the RPROP algorithm*, 1993.
    """
    owner = "scale_by_rprop"
    _validate.check_range(owner, "learning_rate", learning_rate, low=0.0, low_open=True)
    _validate.check_range(owner, "eta_minus", eta_minus, low=0.0, high=1.0, low_open=True,
                          high_open=True, hint="Fix: torch's default is 0.5.")
    _validate.check_range(owner, "eta_plus", eta_plus, low=1.0, low_open=True,
                          hint="Fix: torch's default is 1.2.")
    _validate.check_range(owner, "min_step_size", min_step_size, low=0.0)
    _validate.check_range(owner, "max_step_size", max_step_size, low=0.0)

    def init_fn(params: Params) -> ScaleByRpropState:
        leaves, treespec = _common.flatten_params(params)
        return ScaleByRpropState(
            step_sizes=_common.unflatten(treespec, _common.full(leaves, learning_rate)),
            prev_updates=_common.unflatten(treespec, [None if p is None else
                                                      _common.zeros_like(p) for p in leaves]))

    def update_fn(
        updates: Updates, state: ScaleByRpropState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ScaleByRpropState]:
        _common.check_state(owner, state, ScaleByRpropState)
        del params, extra_args
        grads, treespec = _common.flatten_updates(updates)
        sizes = _common.state_like(treespec, state.step_sizes, name="state.step_sizes", like=grads)
        prevs = _common.state_like(treespec, state.prev_updates, name="state.prev_updates",
                                   like=grads)
        _common.check_state_present(owner, treespec, grads, step_sizes=sizes,
                                    prev_updates=prevs)

        def leaf(g: torch.Tensor, size: torch.Tensor,
                 prev: torch.Tensor) -> tuple[torch.Tensor, ...]:
            wide = g.to(_common.compute_dtype(g.dtype, size.dtype, prev.dtype))
            c = functools.partial(_common.scalar, dtype=wide.dtype)
            product = wide * prev.to(wide.dtype)
            ones = torch.ones_like(wide)
            factor = torch.where(product > 0, ones * c(eta_plus),
                                 torch.where(product < 0, ones * c(eta_minus), ones))
            size_t = size.to(wide.dtype) * factor
            low, high = ones * c(min_step_size), ones * c(max_step_size)
            size_t = torch.where(size_t < low, low, torch.where(size_t > high, high, size_t))
            kept = torch.where(product < 0, 0.0, wide)
            return ((torch.sign(kept) * size_t).to(g.dtype), size_t.to(size.dtype),
                    kept.to(prev.dtype))

        new_updates, new_sizes, new_prevs = _common.map_with_state(leaf, grads, sizes, prevs)
        return _common.unflatten(treespec, new_updates), ScaleByRpropState(
            step_sizes=_common.unflatten(treespec, new_sizes),
            prev_updates=_common.unflatten(treespec, new_prevs))

    return specified(GradientTransformation(init_fn, update_fn), Leafwise("scale_by_rprop", {
        "learning_rate": learning_rate, "eta_minus": eta_minus, "eta_plus": eta_plus,
        "min_step_size": min_step_size, "max_step_size": max_step_size},
        slots=state_slots(ScaleByRpropState)))
