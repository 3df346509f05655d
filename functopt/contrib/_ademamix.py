"""AdEMAMix and its simplified form: Adam with a second, slow momentum (Pagliardini et al.)."""

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
from functopt.transforms.scaling import scale_by_learning_rate

__all__ = [
    "ScaleByAdemamixState",
    "ScaleBySimplifiedAdEMAMixState",
    "ademamix",
    "scale_by_ademamix",
    "scale_by_simplified_ademamix",
    "simplified_ademamix",
]


class ScaleByAdemamixState(NamedTuple):
    """State of [`scale_by_ademamix`][functopt.contrib.scale_by_ademamix]."""

    # The name shadows tuple.count (hence the ignore); kept: optax's name, public API.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far
    count_m2: torch.Tensor  # int32, shape (): the step the b3 / alpha schedules are read at
    m1: Updates  # like params, dtype mu_dtype (default: the param's): fast EMA of g
    m2: Updates  # like params, dtype mu_dtype: slow EMA of g (decay b3, no bias correction)
    nu: Updates  # like params, dtype mu_dtype: EMA of g**2


def scale_by_ademamix(
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    b3: ScalarOrSchedule = 0.9999,
    alpha: ScalarOrSchedule = 6.0,
    eps: Numeric = 1e-8,
    eps_root: Numeric = 0.0,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Rescale updates by AdEMAMix: Adam's step plus ``alpha`` times a slow momentum.

    With $t$ counting from 1:

    $$
    m^{(1)}_t = \beta_1 m^{(1)}_{t-1} + (1-\beta_1) g_t, \quad
    m^{(2)}_t = \beta_3 m^{(2)}_{t-1} + (1-\beta_3) g_t, \quad
    \nu_t = \beta_2 \nu_{t-1} + (1-\beta_2) g_t^2, \\
    u_t = \frac{m^{(1)}_t / (1-\beta_1^t) + \alpha\, m^{(2)}_t}
               {\sqrt{\nu_t / (1-\beta_2^t) + \epsilon_{root}} + \epsilon}.
    $$

    ``b3`` and ``alpha`` may be schedules (the paper warms both up), read at
    ``count_m2`` before the update. All three moments are stored in ``mu_dtype``, as
    optax stores them. Note optax's defaults: ``alpha=6.0`` here, ``5.0`` in
    [`ademamix`][functopt.contrib.ademamix].

    Args:
        b1: decay of the fast momentum, in [0, 1).
        b2: decay of the second moment, in [0, 1).
        b3: decay of the slow momentum (or a schedule), in [0, 1].
        alpha: weight of the slow momentum (or a schedule).
        eps: added to the root, >= 0.
        eps_root: added inside the root, >= 0.
        mu_dtype: storage dtype of the moments (default: the param's dtype).

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with
        [`ScaleByAdemamixState`][functopt.contrib.ScaleByAdemamixState].

    Examples:
        >>> import torch
        >>> from functopt import contrib
        >>> tx = contrib.scale_by_ademamix(b3=0.5, alpha=2.0)
        >>> u, _ = tx.update({"w": torch.tensor([1.0])}, tx.init({"w": torch.zeros(1)}))
        >>> u["w"]  # Adam's first step (1) plus alpha * (1 - b3) * g / |g|
        tensor([2.0000])

    References:
        Pagliardini, Ablin & Grangier, *The AdEMAMix Optimizer: Better, Faster, Older*,
        2024.
    """
    owner = "scale_by_ademamix"
    _common.check_betas(owner, b1=b1, b2=b2)
    _validate.check_range(owner, "b3", b3, low=0.0, high=1.0, allow_callable=True,
                          hint="Fix: b3 is a decay rate in [0, 1]; 0.9999 is usual.")
    _validate.check_number(owner, "alpha", alpha, allow_callable=True)
    _validate.check_range(owner, "eps", eps, low=0.0)
    _validate.check_range(owner, "eps_root", eps_root, low=0.0)
    _validate.check_dtype(owner, "mu_dtype", mu_dtype)

    def init_fn(params: Params) -> ScaleByAdemamixState:
        leaves, treespec = _common.flatten_params(params)
        return ScaleByAdemamixState(count=_common.zero_count(leaves),
                                    count_m2=_common.zero_count(leaves),
                                    m1=_shared.zeros(treespec, leaves, mu_dtype),
                                    m2=_shared.zeros(treespec, leaves, mu_dtype),
                                    nu=_shared.zeros(treespec, leaves, mu_dtype))

    def update_fn(
        updates: Updates, state: ScaleByAdemamixState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ScaleByAdemamixState]:
        _common.check_state("scale_by_ademamix", state, ScaleByAdemamixState)
        del params, extra_args
        grads, treespec = _common.flatten_updates(updates)
        m1s = _common.state_like(treespec, state.m1, name="state.m1", like=grads)
        m2s = _common.state_like(treespec, state.m2, name="state.m2", like=grads)
        nus = _common.state_like(treespec, state.nu, name="state.nu", like=grads)
        _common.check_state_present(owner, treespec, grads, m1=m1s, m2=m2s, nu=nus)
        b3_t = _shared.value_at(b3, state.count_m2)
        alpha_t = _shared.value_at(alpha, state.count_m2)
        count = _common.safe_increment(state.count)
        bc1 = _common.bias_correction(b1, count)
        bc2 = _common.bias_correction(b2, count)

        def leaf(g: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor,
                 nu: torch.Tensor) -> tuple[torch.Tensor, ...]:
            wide = g.to(_common.compute_dtype(g.dtype, m1.dtype, m2.dtype, nu.dtype))
            c = functools.partial(_common.scalar, dtype=wide.dtype)
            m1_t = c(b1) * m1.to(wide.dtype) + c(1 - b1) * wide
            m2_t = c(b3_t) * m2.to(wide.dtype) + c(1 - b3_t) * wide
            nu_t = c(b2) * nu.to(wide.dtype) + c(1 - b2) * (wide * wide)
            u = (m1_t / c(bc1) + c(alpha_t) * m2_t) / (
                torch.sqrt(nu_t / c(bc2) + c(eps_root)) + c(eps))
            return u.to(g.dtype), m1_t.to(m1.dtype), m2_t.to(m2.dtype), nu_t.to(nu.dtype)

        new_u, new_m1, new_m2, new_nu = _common.map_with_state(leaf, grads, m1s, m2s, nus)
        return _common.unflatten(treespec, new_u), ScaleByAdemamixState(
            count=count, count_m2=_common.safe_increment(state.count_m2),
            m1=_common.unflatten(treespec, new_m1), m2=_common.unflatten(treespec, new_m2),
            nu=_common.unflatten(treespec, new_nu))

    return specified(GradientTransformation(init_fn, update_fn), Leafwise(
        "scale_by_ademamix", {"b1": b1, "b2": b2, "b3": b3, "alpha": alpha, "eps": eps,
            "eps_root": eps_root, "mu_dtype": mu_dtype},
        slots=state_slots(ScaleByAdemamixState)))


def ademamix(
    learning_rate: ScalarOrSchedule,
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    b3: ScalarOrSchedule = 0.9999,
    alpha: ScalarOrSchedule = 5.0,
    eps: Numeric = 1e-8,
    eps_root: Numeric = 0.0,
    mu_dtype: torch.dtype | None = None,
    weight_decay: Numeric = 0.0,
    mask: Any = None,
) -> GradientTransformation:
    r"""AdEMAMix: ``chain(scale_by_ademamix, add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate))`` (decoupled decay, as in AdamW).

    See [`scale_by_ademamix`][functopt.contrib.scale_by_ademamix] for the rule.

    Examples:
        >>> import torch
        >>> from functopt import contrib
        >>> opt = contrib.ademamix(0.1, b3=0.5, alpha=2.0)
        >>> params = {"w": torch.zeros(1)}
        >>> u, _ = opt.update({"w": torch.tensor([1.0])}, opt.init(params), params)
        >>> u["w"]  # -lr * (Adam's 1 + alpha * (1 - b3))
        tensor([-0.2000])
    """
    _shared.check_lr("ademamix", learning_rate)
    return chain(
        scale_by_ademamix(b1=b1, b2=b2, b3=b3, alpha=alpha, eps=eps, eps_root=eps_root,
                          mu_dtype=mu_dtype),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


class ScaleBySimplifiedAdEMAMixState(NamedTuple):
    """State of [`scale_by_simplified_ademamix`][functopt.contrib.scale_by_simplified_ademamix]."""

    t: torch.Tensor  # int32, shape (): updates done so far
    m: Updates  # like params, param dtype: the undamped momentum g + b1 * m
    n: Updates  # like params, param dtype: EMA of g**2


def scale_by_simplified_ademamix(
    b1: Numeric = 0.99,
    b2: Numeric = 0.95,
    alpha: ScalarOrSchedule = 0.0,
    eps: Numeric = 1e-8,
    eps_root: Numeric = 0.0,
) -> GradientTransformation:
    r"""Rescale updates by simplified AdEMAMix: one undamped momentum plus ``alpha`` times g.

    With $t$ counting from 1:

    $$
    m_t = \beta_1 m_{t-1} + g_t, \quad n_t = \beta_2 n_{t-1} + (1-\beta_2) g_t^2, \quad
    u_t = \frac{m_t + \alpha\, g_t}{\sqrt{n_t / (1-\beta_2^t) + \epsilon_{root}} + \epsilon}.
    $$

    The momentum is not damped by $1-\beta_1$ (it sums to $1/(1-\beta_1)$ times the
    gradient), so the learning rate is smaller than Adam's by about that factor.
    ``alpha`` may be a schedule read at ``t`` before the update.

    Args:
        b1: decay of the momentum, in [0, 1).
        b2: decay of the second moment, in [0, 1).
        alpha: weight of the current gradient (or a schedule).
        eps: added to the root, >= 0.
        eps_root: added inside the root, >= 0.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with
        [`ScaleBySimplifiedAdEMAMixState`][functopt.contrib.ScaleBySimplifiedAdEMAMixState].

    Examples:
        >>> import torch
        >>> from functopt import contrib
        >>> tx = contrib.scale_by_simplified_ademamix(alpha=1.0)
        >>> u, _ = tx.update({"w": torch.tensor([3.0])}, tx.init({"w": torch.zeros(1)}))
        >>> u["w"]  # (g + alpha g) / |g|
        tensor([2.])

    References:
        Morwani et al., *Connections between Schedule-Free Optimizers, AdEMAMix, and
        Accelerated SGD Variants*, 2025.
    """
    owner = "scale_by_simplified_ademamix"
    _common.check_betas(owner, b1=b1, b2=b2)
    _validate.check_number(owner, "alpha", alpha, allow_callable=True)
    _validate.check_range(owner, "eps", eps, low=0.0)
    _validate.check_range(owner, "eps_root", eps_root, low=0.0)

    def init_fn(params: Params) -> ScaleBySimplifiedAdEMAMixState:
        leaves, treespec = _common.flatten_params(params)
        return ScaleBySimplifiedAdEMAMixState(t=_common.zero_count(leaves),
                                              m=_shared.zeros(treespec, leaves),
                                              n=_shared.zeros(treespec, leaves))

    def update_fn(
        updates: Updates, state: ScaleBySimplifiedAdEMAMixState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ScaleBySimplifiedAdEMAMixState]:
        _common.check_state("scale_by_simplified_ademamix", state, ScaleBySimplifiedAdEMAMixState)
        del params, extra_args
        grads, treespec = _common.flatten_updates(updates)
        ms = _common.state_like(treespec, state.m, name="state.m", like=grads)
        ns = _common.state_like(treespec, state.n, name="state.n", like=grads)
        _common.check_state_present(owner, treespec, grads, m=ms, n=ns)
        alpha_t = _shared.value_at(alpha, state.t)
        t = _common.safe_increment(state.t)
        bc2 = _common.bias_correction(b2, t)

        def leaf(g: torch.Tensor, m: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, ...]:
            wide = g.to(_common.compute_dtype(g.dtype, m.dtype, n.dtype))
            c = functools.partial(_common.scalar, dtype=wide.dtype)
            m_t = wide + c(b1) * m.to(wide.dtype)
            sq = wide * wide
            n_t = sq + c(b2) * (n.to(wide.dtype) - sq)  # optax's lerp(b2, g^2, n)
            u = (m_t + c(alpha_t) * wide) / (torch.sqrt(n_t / c(bc2) + c(eps_root)) + c(eps))
            return u.to(g.dtype), m_t.to(m.dtype), n_t.to(n.dtype)

        new_u, new_m, new_n = _common.map_with_state(leaf, grads, ms, ns)
        return _common.unflatten(treespec, new_u), ScaleBySimplifiedAdEMAMixState(
            t=t, m=_common.unflatten(treespec, new_m), n=_common.unflatten(treespec, new_n))

    return specified(GradientTransformation(init_fn, update_fn), Leafwise(
        "scale_by_simplified_ademamix", {"b1": b1, "b2": b2, "alpha": alpha, "eps": eps,
            "eps_root": eps_root},
        slots=state_slots(ScaleBySimplifiedAdEMAMixState)))


def simplified_ademamix(
    learning_rate: ScalarOrSchedule,
    b1: Numeric = 0.99,
    b2: Numeric = 0.95,
    alpha: ScalarOrSchedule = 0.0,
    eps: Numeric = 1e-8,
    eps_root: Numeric = 0.0,
    weight_decay: Numeric = 0.0,
    mask: Any = None,
) -> GradientTransformation:
    r"""Simplified AdEMAMix: ``chain(scale_by_simplified_ademamix,
    add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate))``.

    See [`scale_by_simplified_ademamix`][functopt.contrib.scale_by_simplified_ademamix].

    Examples:
        >>> import torch
        >>> from functopt import contrib
        >>> opt = contrib.simplified_ademamix(0.1)
        >>> params = {"w": torch.zeros(1)}
        >>> u, _ = opt.update({"w": torch.tensor([3.0])}, opt.init(params), params)
        >>> u["w"]  # -lr * g / |g| on the first step
        tensor([-0.1000])
    """
    _shared.check_lr("simplified_ademamix", learning_rate)
    return chain(
        scale_by_simplified_ademamix(b1=b1, b2=b2, alpha=alpha, eps=eps, eps_root=eps_root),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
