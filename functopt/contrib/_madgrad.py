"""MADGRAD: dual averaging with a cube-root second moment (Defazio & Jelassi, 2021)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from functopt import _validate
from functopt._base import GradientTransformation, Numeric, Params, ScalarOrSchedule, Updates
from functopt._rules import state_slots
from functopt._spec import Leafwise, specified
from functopt.contrib import _shared
from functopt.transforms import _common
from functopt.transforms.adding import add_decayed_weights
from functopt.transforms.combining import chain
from functopt.transforms.scaling import scale

__all__ = ["MadgradState", "madgrad", "scale_by_madgrad"]


class MadgradState(NamedTuple):
    """State of [`scale_by_madgrad`][functopt.contrib.scale_by_madgrad]."""

    # The name shadows tuple.count (hence the ignore); kept: optax's name, public API.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far
    grad_sum_sq: Updates  # like params, param dtype: sum of lambda_k * g_k**2
    s: Updates  # like params, param dtype: sum of lambda_k * g_k (the dual average)
    x0: Params  # like params: a copy of the params given to init (the dual anchor)


def scale_by_madgrad(
    learning_rate: ScalarOrSchedule, momentum: Numeric = 0.9, eps: Numeric = 1e-6
) -> GradientTransformation:
    r"""MADGRAD's step as an update: the new iterate minus the params (reads the params).

    With $k$ counting from 0, $\lambda_k = (\eta_k + \epsilon)\sqrt{k + 1}$:

    $$
    v_k = v_{k-1} + \lambda_k g_k^2, \quad s_k = s_{k-1} + \lambda_k g_k, \quad
    z_k = x_0 - s_k / (\sqrt[3]{v_k} + \epsilon), \\
    u_k = (1 - \text{momentum})\, z_k + \text{momentum}\, x_k - x_k.
    $$

    The learning rate is inside the rule (it weighs the dual average), so the update is the
    whole step: nothing scales it afterwards. ``learning_rate(count)`` is evaluated at the
    count before the update (0 first), as optax does.

    Args:
        learning_rate: $\eta$, a number, 0-d tensor or schedule, >= 0.
        momentum: interpolation weight of the current iterate, in [0, 1).
        eps: added to the learning rate and to the cube root, >= 0.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with
        [`MadgradState`][functopt.contrib.MadgradState].

    Examples:
        >>> import torch
        >>> from functopt import contrib
        >>> tx = contrib.scale_by_madgrad(0.1, momentum=0.0)
        >>> params = {"w": torch.tensor([1.0])}
        >>> u, _ = tx.update({"w": torch.tensor([2.0])}, tx.init(params), params)
        >>> u["w"]  # -lambda g / cbrt(lambda g^2): about -0.1**(2/3) * 2**(1/3)
        tensor([-0.2714])

    References:
        Defazio & Jelassi, *Adaptivity without Compromise: A Momentumized, Adaptive, Dual
        Averaged Gradient Method for Stochastic Optimization*, 2021.
    """
    owner = "scale_by_madgrad"
    _shared.check_lr(owner, learning_rate)
    _validate.check_range(owner, "momentum", momentum, low=0.0, high=1.0, high_open=True,
                          hint="Fix: momentum is in [0, 1); 0.9 is usual.")
    _validate.check_range(owner, "eps", eps, low=0.0)

    def init_fn(params: Params) -> MadgradState:
        leaves, treespec = _common.flatten_params(params)
        return MadgradState(
            count=_common.zero_count(leaves),
            grad_sum_sq=_shared.zeros(treespec, leaves),
            s=_shared.zeros(treespec, leaves),
            x0=_common.unflatten(treespec, [None if p is None else p.clone() for p in leaves]),
        )

    def update_fn(
        updates: Updates, state: MadgradState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, MadgradState]:
        _common.check_state("scale_by_madgrad", state, MadgradState)
        del extra_args
        grads, treespec = _common.flatten_updates(updates)
        ps = _common.params_like(treespec, params, grads, owner=owner)
        sqs = _common.state_like(treespec, state.grad_sum_sq, name="state.grad_sum_sq", like=grads)
        ss = _common.state_like(treespec, state.s, name="state.s", like=grads)
        x0s = _common.state_like(treespec, state.x0, name="state.x0", like=grads)
        _common.check_state_present(owner, treespec, grads, grad_sum_sq=sqs, s=ss, x0=x0s)
        device = _common.first_device(grads)
        lr = _shared.f64(_shared.value_at(learning_rate, state.count), device)
        lamb = (lr + eps) * torch.sqrt(state.count.to(device=device, dtype=torch.float64) + 1)

        def leaf(g: torch.Tensor, p: torch.Tensor, sq: torch.Tensor, s: torch.Tensor,
                 x0: torch.Tensor) -> tuple[torch.Tensor, ...]:
            wide = g.to(_common.compute_dtype(g.dtype, p.dtype, sq.dtype, s.dtype, x0.dtype))
            c = functools.partial(_common.scalar, dtype=wide.dtype)
            sq_t = sq.to(wide.dtype) + c(lamb) * (wide * wide)
            s_t = s.to(wide.dtype) + c(lamb) * wide
            # The cube root of a sum of squares (>= 0), so pow(1/3) is the real cube root.
            z = x0.to(wide.dtype) - s_t / (torch.pow(sq_t, 1.0 / 3.0) + c(eps))
            x = p.to(wide.dtype)
            u = c(1 - momentum) * z + c(momentum) * x - x
            return u.to(g.dtype), sq_t.to(sq.dtype), s_t.to(s.dtype), x0

        new_u, _, new_sqs, new_ss, new_x0s = _shared.map_with_params(leaf, grads, ps, sqs, ss, x0s)
        return _common.unflatten(treespec, new_u), MadgradState(
            count=_common.safe_increment(state.count),
            grad_sum_sq=_common.unflatten(treespec, new_sqs),
            s=_common.unflatten(treespec, new_ss),
            x0=_common.unflatten(treespec, new_x0s),
        )

    return specified(GradientTransformation(init_fn, update_fn), Leafwise(
        "scale_by_madgrad", {"learning_rate": learning_rate, "momentum": momentum,
            "eps": eps}, slots=state_slots(MadgradState)))


def madgrad(
    learning_rate: ScalarOrSchedule,
    momentum: Numeric = 0.9,
    weight_decay: Numeric = 0.0,
    eps: Numeric = 1e-6,
    *,
    decouple_decay: bool = False,
) -> GradientTransformation:
    r"""MADGRAD: ``chain(add_decayed_weights(weight_decay), scale_by_madgrad(...))``.

    The weight decay $\lambda$ is added to the gradient before the dual averaging (coupled,
    as in the paper's reference implementation and optax). ``decouple_decay=True`` leaves
    the gradient alone and subtracts $(\eta_k + \epsilon)\lambda x_k$ from the step instead,
    as the madgrad package's ``decouple_decay=True`` does (it adds $\epsilon$ to the learning
    rate for the whole step); it is ``chain(scale_by_madgrad(...), scale(-1),
    add_decayed_weights((eta + eps) * weight_decay), scale(-1))``, the negations exact, and
    needs ``weight_decay >= 0``. See [`scale_by_madgrad`][functopt.contrib.scale_by_madgrad]
    for the rule.

    Examples:
        >>> import torch, functopt
        >>> from functopt import contrib
        >>> opt = contrib.madgrad(0.01)
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> state = opt.init(params)
        >>> for _ in range(3):
        ...     updates, state = opt.update({"w": params["w"]}, state, params)  # f = |w|^2/2
        ...     params = functopt.apply_updates(params, updates)
        >>> bool((params["w"].abs() < 1.0).all())
        True
    """
    _validate.check_flags("madgrad", decouple_decay=decouple_decay)
    _validate.check_number("madgrad", "weight_decay", weight_decay)
    rule = scale_by_madgrad(learning_rate=learning_rate, momentum=momentum, eps=eps)
    if not decouple_decay:
        return chain(add_decayed_weights(weight_decay), rule)
    _validate.check_range("madgrad", "weight_decay", weight_decay, low=0.0,
                          hint="Fix: a decoupled decay rate is non-negative, such as 1e-4.")
    rate: Any
    if callable(learning_rate) and not isinstance(learning_rate, torch.Tensor):
        def rate(count: torch.Tensor) -> Any:
            return (learning_rate(count) + eps) * weight_decay
    else:
        rate = (learning_rate + eps) * weight_decay
    return chain(rule, scale(-1.0), add_decayed_weights(rate), scale(-1.0))


