"""ADOPT: Adam with the second moment of the *previous* step (Taniguchi et al., 2024)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from functopt import _validate
from functopt._base import GradientTransformation, Numeric, Params, ScalarOrSchedule, Updates
from functopt._rules import state_slots
from functopt._spec import Leafwise, specified
from functopt.contrib import _shared
from functopt.transforms import _common
from functopt.transforms.combining import chain
from functopt.transforms.moments import ScaleByAdamState, init_moments, moment_inputs
from functopt.transforms.scaling import scale_by_learning_rate

__all__ = ["adopt", "scale_by_adopt"]


def _quarter_power(count: torch.Tensor) -> torch.Tensor:
    return count**0.25


def scale_by_adopt(
    b1: Numeric = 0.9,
    b2: Numeric = 0.9999,
    eps: Numeric = 1e-6,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = False,
    use_clipping: bool = True,
    clip_value_fn: Callable[[torch.Tensor], Any] = _quarter_power,
) -> GradientTransformation:
    r"""Rescale updates by ADOPT: normalise by the second moment *before* this gradient.

    With $t$ counting from 0 (the count before the update):

    $$
    \tilde g_t = \operatorname{clip}\big(g_t / \max(\sqrt{v_{t-1}}, \epsilon),\ \pm c(t)\big),
    \quad m_t = \beta_1 m_{t-1} + (1-\beta_1) \tilde g_t, \quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \quad u_t = m_t,
    $$

    except on the first update ($t = 0$), which only sets $v_0 = g_0^2$ and leaves
    $m$ (and the update) zero. $c$ is ``clip_value_fn`` (default $t^{1/4}$), called with
    the count as a 0-d float64 tensor; ``use_clipping=False`` drops the clip. With
    ``nesterov=True`` the update is $\beta_1 m_t + (1-\beta_1)\tilde g_t$. No bias
    correction. The state is [`ScaleByAdamState`][functopt.ScaleByAdamState], as in optax.

    Args:
        b1: decay of the first moment, in [0, 1).
        b2: decay of the second moment, in [0, 1).
        eps: floor of $\sqrt{v}$, >= 0.
        mu_dtype: storage dtype of the first moment (default: the param's dtype).
        nesterov: use the Nesterov form of the update.
        use_clipping: clip the normalised gradient to $\pm c(t)$.
        clip_value_fn: $c$, count -> clip value.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with
        [`ScaleByAdamState`][functopt.ScaleByAdamState].

    Examples:
        >>> import torch
        >>> from functopt import contrib
        >>> tx = contrib.scale_by_adopt()
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> u, state = tx.update({"w": torch.tensor([3.0, -1.0])}, state)
        >>> u["w"], state.nu["w"]  # the first step only records the second moment
        (tensor([0., 0.]), tensor([9., 1.]))
        >>> u, state = tx.update({"w": torch.tensor([3.0, -1.0])}, state)
        >>> u["w"]  # (1 - b1) * g / |g|
        tensor([ 0.1000, -0.1000])

    References:
        Taniguchi et al., *ADOPT: Modified Adam Can Converge with Any β2 with the Optimal
        Rate*, 2024.
    """
    _validate.check_flags("scale_by_adopt", nesterov=nesterov, use_clipping=use_clipping)
    owner = "scale_by_adopt"
    _common.check_betas(owner, b1=b1, b2=b2)
    _validate.check_range(owner, "eps", eps, low=0.0)
    _validate.check_dtype(owner, "mu_dtype", mu_dtype)
    if not callable(clip_value_fn):
        raise TypeError(f"{owner}: clip_value_fn must be callable (count -> clip value), got "
                        f"{type(clip_value_fn).__name__}. Fix: pass e.g. lambda t: t ** 0.25.")

    def init_fn(params: Params) -> ScaleByAdamState:
        return init_moments(params, mu_dtype)

    def update_fn(
        updates: Updates, state: ScaleByAdamState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ScaleByAdamState]:
        del params, extra_args
        grads, treespec, mus, nus, _ = moment_inputs(owner, updates, state,
                                                     ScaleByAdamState)
        started = state.count > 0
        # The first update sets nu = g^2 and keeps mu = 0: b2 -> 0 and b1 -> 1 there.
        b1_t = torch.where(started, _shared.f64(b1, state.count.device), 1.0)
        b2_t = torch.where(started, _shared.f64(b2, state.count.device), 0.0)
        clip_value = clip_value_fn(state.count.to(torch.float64)) if use_clipping else None

        def leaf(g: torch.Tensor, mu: torch.Tensor, nu: torch.Tensor) -> tuple[torch.Tensor, ...]:
            wide = g.to(_common.compute_dtype(g.dtype, mu.dtype, nu.dtype))
            c = functools.partial(_common.scalar, dtype=wide.dtype)
            nu_prev = nu.to(wide.dtype)
            normed = wide / torch.clamp(torch.sqrt(nu_prev), min=c(eps))
            if clip_value is not None:
                limit = c(clip_value)
                normed = torch.clamp(normed, min=-limit, max=limit)
            nu_t = c(b2_t) * nu_prev + c(1 - b2_t) * (wide * wide)
            mu_t = c(b1_t) * mu.to(wide.dtype) + c(1 - b1_t) * normed
            u = c(b1_t) * mu_t + c(1 - b1_t) * normed if nesterov else mu_t
            return u.to(g.dtype), mu_t.to(mu.dtype), nu_t.to(nu.dtype)

        new_u, new_mus, new_nus = _common.map_with_state(leaf, grads, mus, nus)
        return _common.unflatten(treespec, new_u), ScaleByAdamState(
            count=_common.safe_increment(state.count),
            mu=_common.unflatten(treespec, new_mus),
            nu=_common.unflatten(treespec, new_nus),
        )

    return specified(GradientTransformation(init_fn, update_fn), Leafwise(
        "scale_by_adopt", {"b1": b1, "b2": b2, "eps": eps, "mu_dtype": mu_dtype,
            "nesterov": nesterov, "use_clipping": use_clipping},
        slots=state_slots(ScaleByAdamState)))


def adopt(
    learning_rate: ScalarOrSchedule,
    b1: Numeric = 0.9,
    b2: Numeric = 0.9999,
    eps: Numeric = 1e-6,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = False,
    use_clipping: bool = True,
    clip_value_fn: Callable[[torch.Tensor], Any] = _quarter_power,
) -> GradientTransformation:
    r"""ADOPT: ``chain(scale_by_adopt(...), scale_by_learning_rate(learning_rate))``.

    See [`scale_by_adopt`][functopt.contrib.scale_by_adopt] for the rule.

    Examples:
        >>> import torch
        >>> from functopt import contrib
        >>> opt = contrib.adopt(0.1)
        >>> state = opt.init({"w": torch.zeros(1)})
        >>> for _ in range(2):
        ...     updates, state = opt.update({"w": torch.tensor([4.0])}, state)
        >>> updates["w"]  # -lr * (1 - b1) * sign(g)
        tensor([-0.0100])
    """
    _validate.check_flags("adopt", nesterov=nesterov, use_clipping=use_clipping)
    _shared.check_lr("adopt", learning_rate)
    return chain(
        scale_by_adopt(b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype, nesterov=nesterov,
                       use_clipping=use_clipping, clip_value_fn=clip_value_fn),
        scale_by_learning_rate(learning_rate),
    )
