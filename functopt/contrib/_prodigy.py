"""Prodigy and D-Adaptation Adam: Adam whose step size estimates the distance to the solution."""

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

__all__ = ["DAdaptAdamWState", "ProdigyState", "dadapt_adamw", "prodigy"]


def _tree_sum(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The sum of per-leaf 0-d values, in ``dtype`` (0 for a tree without gradients)."""
    total = torch.zeros((), dtype=dtype, device=device)
    for v in values:
        total = total + v.to(dtype)
    return total


def _step_correction(beta1: Any, beta2: Any, bias_correction: bool) -> Any:
    """``count, dtype -> sqrt(1 - beta2**count) / (1 - beta1**count)``, the Adam bias
    correction of the step size of Prodigy and D-Adaptation, or 1 without it."""
    def correction(count: torch.Tensor, dtype: torch.dtype) -> Any:
        if not bias_correction:
            return 1.0
        bc = (torch.sqrt(_common.bias_correction(beta2, count))
              / _common.bias_correction(beta1, count))
        return bc.to(dtype)

    return correction


class ProdigyState(NamedTuple):
    """State of [`prodigy`][functopt.contrib.prodigy]."""

    exp_avg: Updates  # like params, param dtype: EMA of estim_lr * g
    exp_avg_sq: Updates  # like params, param dtype: EMA of (estim_lr * g)**2
    grad_sum: Updates  # like params, param dtype: the weighted gradient sum s of the estimate
    params0: Params  # like params: a copy of the params given to init
    estim_lr: torch.Tensor  # shape (), the params' widest dtype (>= float32): the distance d
    numerator_weighted: torch.Tensor  # shape (), as estim_lr: the numerator of the estimate
    # The name shadows tuple.count (hence the ignore); kept: optax's name, public API.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far


def prodigy(
    learning_rate: ScalarOrSchedule = 1.0,
    betas: tuple[Numeric, Numeric] = (0.9, 0.999),
    beta3: Numeric | None = None,
    eps: Numeric = 1e-8,
    estim_lr0: Numeric = 1e-6,
    estim_lr_coef: Numeric = 1.0,
    weight_decay: Numeric = 0.0,
    safeguard_warmup: bool = False,
    *,
    bias_correction: bool = True,
) -> GradientTransformation:
    r"""Prodigy: Adam with a learning rate $d$ that estimates the distance to the solution.

    With $t$ counting from 1, $\eta_t$ the ``learning_rate`` (read at $t-1$), $d_0$ =
    ``estim_lr0``, $\beta_3$ = ``beta3`` (default $\sqrt{\beta_2}$) and
    $\gamma_t = d_{t-1}\eta_t \sqrt{1-\beta_2^t}/(1-\beta_1^t)$:

    $$
    m_t = \beta_1 m_{t-1} + (1-\beta_1) d_{t-1} g_t, \quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) d_{t-1}^2 g_t^2, \\
    r_t = \beta_3 r_{t-1} + \tfrac{d_{t-1}}{d_0}\gamma_t \langle g_t, x_0 - x_t\rangle, \quad
    s_t = \beta_3 s_{t-1} + \tfrac{\gamma_t}{d_0} d_{t-1} g_t, \quad
    d_t = \max\big(d_{t-1},\ \text{coef}\cdot r_t / \lVert s_t\rVert_1\big), \\
    u_t = -\lambda\gamma_t x_t - \gamma_t m_t / (\sqrt{v_t} + d_t\epsilon).
    $$

    ``safeguard_warmup=True`` uses $d_{t-1}$ for $\gamma_t$ in $s_t$.
    ``bias_correction=False`` drops Adam's bias correction from the step size,
    $\gamma_t = d_{t-1}\eta_t$, which is the default of the authors' package (prodigyopt's
    ``use_bias_correction=False``); optax always corrects. The update is the
    whole step (the learning rate is inside), and it reads the params. The inner product and
    the norm run over the whole tree, over the leaves that have a gradient this step. As in
    optax, a tree whose first gradients are all zero gives $0/0$ and a NaN estimate. The
    tree-wide scalars live in the widest param dtype and at least float32 (optax: the lowest
    param dtype; the same for float32 and float64 trees). The moments are stored in the
    param's dtype, as in optax: with float16 params, $(d g)^2$ (from $d_0 = 10^{-6}$)
    underflows the float16 second moment to zero and the step blows up; train float16 models
    with float32 master weights ([`mixed_precision`][functopt.precision.mixed_precision]).

    Args:
        learning_rate: $\eta$, a multiplier of the estimate (a number, tensor or schedule).
        betas: $(\beta_1, \beta_2)$, each in [0, 1).
        beta3: decay of the estimate's sums, in [0, 1) (default $\sqrt{\beta_2}$).
        eps: added to the root (scaled by $d_t$), >= 0.
        estim_lr0: the initial estimate $d_0$, > 0.
        estim_lr_coef: a multiplier of the estimate, >= 0.
        weight_decay: $\lambda$, decoupled and scaled by $\gamma_t$.
        safeguard_warmup: see above.
        bias_correction: the factor $\sqrt{1-\beta_2^t}/(1-\beta_1^t)$ in $\gamma_t$
            (default, as optax); ``False`` leaves it out, as prodigyopt does by default.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with
        [`ProdigyState`][functopt.contrib.ProdigyState].

    Examples:
        >>> import torch, functopt
        >>> from functopt import contrib
        >>> opt = contrib.prodigy()
        >>> params = {"w": torch.tensor([5.0, -3.0])}
        >>> state = opt.init(params)
        >>> for _ in range(30):
        ...     updates, state = opt.update({"w": params["w"].sign()}, state, params)
        ...     params = functopt.apply_updates(params, updates)
        >>> bool(state.estim_lr > 1e-3)  # the estimate grew from 1e-6 by orders of magnitude
        True

    References:
        Mishchenko & Defazio, *Prodigy: An Expeditiously Adaptive Parameter-Free Learner*,
        2023.
    """
    _validate.check_flags("prodigy", safeguard_warmup=safeguard_warmup,
                          bias_correction=bias_correction)
    owner = "prodigy"
    _shared.check_lr(owner, learning_rate)
    beta1, beta2 = _shared.check_betas_pair(owner, betas)
    if beta3 is None:
        beta3 = beta2**0.5
    _common.check_betas(owner, beta3=beta3)
    _validate.check_range(owner, "eps", eps, low=0.0)
    _validate.check_range(owner, "estim_lr0", estim_lr0, low=0.0, low_open=True,
                          hint="Fix: the initial estimate must be positive; 1e-6 is usual.")
    _validate.check_range(owner, "estim_lr_coef", estim_lr_coef, low=0.0)
    _validate.check_number(owner, "weight_decay", weight_decay)
    adam_correction = _step_correction(beta1, beta2, bias_correction)

    def init_fn(params: Params) -> ProdigyState:
        leaves, treespec = _common.flatten_params(params)
        dtype = _shared.scalar_dtype(leaves)
        device = _common.first_device(leaves)

        return ProdigyState(
            exp_avg=_shared.zeros(treespec, leaves), exp_avg_sq=_shared.zeros(treespec, leaves),
            grad_sum=_shared.zeros(treespec, leaves),
            params0=_common.unflatten(treespec, [None if p is None else p.clone() for p in leaves]),
            estim_lr=_shared.f64(estim_lr0, device).to(dtype),
            numerator_weighted=torch.zeros((), dtype=dtype, device=device),
            count=_common.zero_count(leaves),
        )

    def leaves(updates: Updates, state: ProdigyState, params: Params | None) -> Any:
        _common.check_state("prodigy", state, ProdigyState)
        grads, treespec = _common.flatten_updates(updates)
        ps = _common.params_like(treespec, params, grads, owner=owner)
        eas = _common.state_like(treespec, state.exp_avg, name="state.exp_avg", like=grads)
        sqs = _common.state_like(treespec, state.exp_avg_sq, name="state.exp_avg_sq", like=grads)
        sums = _common.state_like(treespec, state.grad_sum, name="state.grad_sum", like=grads)
        p0s = _common.state_like(treespec, state.params0, name="state.params0", like=grads)
        _common.check_state_present(owner, treespec, grads, exp_avg=eas, exp_avg_sq=sqs,
                                    grad_sum=sums, params0=p0s)
        return grads, treespec, ps, eas, sqs, sums, p0s

    def scalars(state: ProdigyState) -> tuple[Any, ...]:
        dtype = state.estim_lr.dtype
        count = _common.safe_increment(state.count)
        sched = _shared.value_at(learning_rate, state.count)
        d = state.estim_lr
        dlr = (d * _common.scalar(sched, dtype) * adam_correction(count, dtype)).to(dtype)
        s_scale = d / estim_lr0 if safeguard_warmup else dlr / estim_lr0
        return count, d, dlr, s_scale

    def grad_sum(wide: torch.Tensor, s: torch.Tensor, d: Any, s_scale: Any) -> torch.Tensor:
        c = functools.partial(_common.scalar, dtype=wide.dtype)
        s_t: torch.Tensor = c(beta3) * s.to(wide.dtype) + c(s_scale) * (c(d) * wide)
        return s_t

    def tree_sums(updates: Updates, state: ProdigyState, params: Params | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first half of the update: <g, x0 - x> and ||s_t||_1 over the leaves given."""
        grads, _, ps, eas, _, sums, p0s = leaves(updates, state, params)
        _, d, _, s_scale = scalars(state)
        dtype, device = state.estim_lr.dtype, state.estim_lr.device
        inners, l1s = [], []
        for g, p, ea, s, p0 in zip(grads, ps, eas, sums, p0s, strict=True):
            if g is None:
                continue
            wide = g.to(_common.compute_dtype(g.dtype, p.dtype, ea.dtype, dtype))
            inners.append(torch.sum(wide * (p0.to(wide.dtype) - p.to(wide.dtype))))
            l1s.append(grad_sum(wide, s, d, s_scale).abs().sum())
        return _tree_sum(inners, dtype, device), _tree_sum(l1s, dtype, device)

    def finish(updates: Updates, state: ProdigyState, params: Params | None,
               totals: tuple[torch.Tensor, torch.Tensor]) -> tuple[Updates, ProdigyState]:
        """The second half: the moments, the estimate from ``totals`` (the sums over every
        leaf), the step."""
        grads, treespec, ps, eas, sqs, sums, _ = leaves(updates, state, params)
        count, d, dlr, s_scale = scalars(state)
        dtype = state.estim_lr.dtype

        def moments(g: torch.Tensor, p: torch.Tensor, ea: torch.Tensor, sq: torch.Tensor,
                    s: torch.Tensor) -> tuple[Any, ...]:
            wide = g.to(_common.compute_dtype(g.dtype, p.dtype, ea.dtype, dtype))
            c = functools.partial(_common.scalar, dtype=wide.dtype)
            dg = c(d) * wide
            ea_t = c(beta1) * ea.to(wide.dtype) + c(1 - beta1) * dg
            sq_t = c(beta2) * sq.to(wide.dtype) + c(1 - beta2) * dg * dg
            s_t = grad_sum(wide, s, d, s_scale)
            return None, ea_t.to(ea.dtype), sq_t.to(sq.dtype), s_t.to(s.dtype)

        _, _, new_eas, new_sqs, new_sums = _shared.map_with_params(
            moments, grads, ps, eas, sqs, sums)
        inner, l1 = totals
        numerator = beta3 * state.numerator_weighted + (d / estim_lr0) * dlr * inner
        new_d = torch.maximum(d, estim_lr_coef * numerator / l1)

        # the step, with the new estimate in the denominator's eps
        def step(g: torch.Tensor, p: torch.Tensor, ea: torch.Tensor,
                 sq: torch.Tensor) -> tuple[Any, ...]:
            wide_dtype = _common.compute_dtype(g.dtype, p.dtype, ea.dtype, dtype)
            c = functools.partial(_common.scalar, dtype=wide_dtype)
            x = p.to(wide_dtype)
            u = (-c(weight_decay) * c(dlr) * x
                 - c(dlr) * ea.to(wide_dtype) / (torch.sqrt(sq.to(wide_dtype)) + c(new_d) * c(eps)))
            return u.to(g.dtype), ea, sq

        new_u, _, _, _ = _shared.map_with_params(step, grads, ps, new_eas, new_sqs)
        return _common.unflatten(treespec, new_u), ProdigyState(
            exp_avg=_common.unflatten(treespec, new_eas),
            exp_avg_sq=_common.unflatten(treespec, new_sqs),
            grad_sum=_common.unflatten(treespec, new_sums),
            params0=state.params0,
            estim_lr=new_d.to(dtype),
            numerator_weighted=numerator.to(dtype),
            count=count,
        )

    def update_fn(
        updates: Updates, state: ProdigyState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, ProdigyState]:
        del extra_args
        return finish(updates, state, params, tree_sums(updates, state, params))

    # elementwise but for the two tree sums: the compiled tier lowers it when the sums run
    # over one call (one group of whole tensors; the planner's TREE_WIDE)
    return specified(GradientTransformation(init_fn, update_fn), Leafwise("prodigy", {
        "learning_rate": learning_rate, "betas": betas, "beta3": beta3, "eps": eps,
        "estim_lr0": estim_lr0, "estim_lr_coef": estim_lr_coef, "weight_decay": weight_decay,
        "safeguard_warmup": safeguard_warmup, "bias_correction": bias_correction},
        sums=tree_sums, finish=finish, slots=state_slots(ProdigyState)))


class DAdaptAdamWState(NamedTuple):
    """State of [`dadapt_adamw`][functopt.contrib.dadapt_adamw]."""

    exp_avg: Updates  # like params, param dtype: EMA of dlr * g
    exp_avg_sq: Updates  # like params, param dtype: EMA of g**2
    grad_sum: Updates  # like params, param dtype: the weighted gradient sum s
    estim_lr: torch.Tensor  # shape (), the params' widest dtype (>= float32): the distance d
    numerator_weighted: torch.Tensor  # shape (), as estim_lr: the numerator of the estimate
    # The name shadows tuple.count (hence the ignore); kept: optax's name, public API.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far


def dadapt_adamw(
    learning_rate: ScalarOrSchedule = 1.0,
    betas: tuple[Numeric, Numeric] = (0.9, 0.999),
    eps: Numeric = 1e-8,
    estim_lr0: Numeric = 1e-6,
    weight_decay: Numeric = 0.0,
    *,
    bias_correction: bool = True,
) -> GradientTransformation:
    r"""D-Adaptation AdamW: Adam whose learning rate $d$ is a lower bound on the distance
    to the solution.

    With $t$ counting from 1, $\eta_t$ the ``learning_rate`` (read at $t-1$),
    $\beta = \sqrt{\beta_2}$ and $\gamma_t = d_{t-1}\eta_t\sqrt{1-\beta_2^t}/(1-\beta_1^t)$:

    $$
    r_t = \beta r_{t-1} + (1-\beta)\gamma_t \langle g_t, s_{t-1}/(\sqrt{v_{t-1}}+\epsilon)
    \rangle, \quad
    m_t = \beta_1 m_{t-1} + (1-\beta_1)\gamma_t g_t, \quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \\
    s_t = \beta s_{t-1} + (1-\beta)\gamma_t g_t, \quad
    d_t = \max\big(d_{t-1},\ r_t / ((1-\beta)\lVert s_t\rVert_1)\big), \quad
    u_t = -\lambda\gamma_t x_t - m_t / (\sqrt{v_t} + \epsilon).
    $$

    ``bias_correction=False`` drops Adam's bias correction from the step size,
    $\gamma_t = d_{t-1}\eta_t$, which is the default of the authors' package (dadaptation's
    ``DAdaptAdam(use_bias_correction=False)``); optax always corrects. The update is the
    whole step and reads the params; the sums run over the leaves that have a gradient; the
    scalars' dtype is as in [`prodigy`][functopt.contrib.prodigy].

    Args:
        learning_rate: $\eta$, a multiplier of the estimate (a number, tensor or schedule).
        betas: $(\beta_1, \beta_2)$, each in [0, 1).
        eps: added to the root, >= 0.
        estim_lr0: the initial estimate $d_0$, > 0.
        weight_decay: $\lambda$, decoupled and scaled by $\gamma_t$.
        bias_correction: the factor $\sqrt{1-\beta_2^t}/(1-\beta_1^t)$ in $\gamma_t$
            (default, as optax); ``False`` leaves it out, as dadaptation does by default.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with
        [`DAdaptAdamWState`][functopt.contrib.DAdaptAdamWState].

    Examples:
        >>> import torch, functopt
        >>> from functopt import contrib
        >>> opt = contrib.dadapt_adamw()
        >>> params = {"w": torch.tensor([5.0, -3.0])}
        >>> state = opt.init(params)
        >>> for _ in range(30):
        ...     updates, state = opt.update({"w": params["w"].sign()}, state, params)
        ...     params = functopt.apply_updates(params, updates)
        >>> bool(state.estim_lr > 1e-4)
        True

    References:
        Defazio & Mishchenko, *Learning-Rate-Free Learning by D-Adaptation*, ICML 2023.
    """
    owner = "dadapt_adamw"
    _validate.check_flags(owner, bias_correction=bias_correction)
    _shared.check_lr(owner, learning_rate)
    beta1, beta2 = _shared.check_betas_pair(owner, betas)
    _validate.check_range(owner, "eps", eps, low=0.0)
    _validate.check_range(owner, "estim_lr0", estim_lr0, low=0.0, low_open=True,
                          hint="Fix: the initial estimate must be positive; 1e-6 is usual.")
    _validate.check_number(owner, "weight_decay", weight_decay)
    sb2 = beta2**0.5
    adam_correction = _step_correction(beta1, beta2, bias_correction)

    def init_fn(params: Params) -> DAdaptAdamWState:
        leaves, treespec = _common.flatten_params(params)
        dtype = _shared.scalar_dtype(leaves)
        device = _common.first_device(leaves)

        return DAdaptAdamWState(
            exp_avg=_shared.zeros(treespec, leaves), exp_avg_sq=_shared.zeros(treespec, leaves),
            grad_sum=_shared.zeros(treespec, leaves),
            estim_lr=_shared.f64(estim_lr0, device).to(dtype),
            numerator_weighted=torch.zeros((), dtype=dtype, device=device),
            count=_common.zero_count(leaves),
        )

    def leaves(updates: Updates, state: DAdaptAdamWState, params: Params | None) -> Any:
        _common.check_state("dadapt_adamw", state, DAdaptAdamWState)
        grads, treespec = _common.flatten_updates(updates)
        ps = _common.params_like(treespec, params, grads, owner=owner)
        eas = _common.state_like(treespec, state.exp_avg, name="state.exp_avg", like=grads)
        sqs = _common.state_like(treespec, state.exp_avg_sq, name="state.exp_avg_sq", like=grads)
        sums = _common.state_like(treespec, state.grad_sum, name="state.grad_sum", like=grads)
        _common.check_state_present(owner, treespec, grads, exp_avg=eas, exp_avg_sq=sqs,
                                    grad_sum=sums)
        return grads, treespec, ps, eas, sqs, sums

    def step_size(state: DAdaptAdamWState) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = state.estim_lr.dtype
        count = _common.safe_increment(state.count)
        sched = _shared.value_at(learning_rate, state.count)
        return count, (state.estim_lr * _common.scalar(sched, dtype)
                       * adam_correction(count, dtype)).to(dtype)

    def grad_sum(wide: torch.Tensor, s_prev: torch.Tensor, dlr: Any) -> torch.Tensor:
        c = functools.partial(_common.scalar, dtype=wide.dtype)
        s_t: torch.Tensor = c(sb2) * s_prev + c(1 - sb2) * c(dlr) * wide
        return s_t

    def tree_sums(updates: Updates, state: DAdaptAdamWState, params: Params | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first half of the update: <g, s / (sqrt(v) + eps)> and ||s_t||_1 over the
        leaves given."""
        grads, _, ps, eas, sqs, sums = leaves(updates, state, params)
        _, dlr = step_size(state)
        dtype, device = state.estim_lr.dtype, state.estim_lr.device
        inners, l1s = [], []
        for g, p, ea, sq, s in zip(grads, ps, eas, sqs, sums, strict=True):
            if g is None:
                continue
            wide = g.to(_common.compute_dtype(g.dtype, p.dtype, ea.dtype, dtype))
            c = functools.partial(_common.scalar, dtype=wide.dtype)
            s_prev = s.to(wide.dtype)
            inners.append(torch.sum(wide * (s_prev / (torch.sqrt(sq.to(wide.dtype)) + c(eps)))))
            l1s.append(grad_sum(wide, s_prev, dlr).abs().sum())
        return _tree_sum(inners, dtype, device), _tree_sum(l1s, dtype, device)

    def finish(updates: Updates, state: DAdaptAdamWState, params: Params | None,
               totals: tuple[torch.Tensor, torch.Tensor],
               ) -> tuple[Updates, DAdaptAdamWState]:
        """The second half: the moments and the step, and the estimate from ``totals`` (the
        sums over every leaf)."""
        grads, treespec, ps, eas, sqs, sums = leaves(updates, state, params)
        count, dlr = step_size(state)
        dtype = state.estim_lr.dtype

        def moments(g: torch.Tensor, p: torch.Tensor, ea: torch.Tensor, sq: torch.Tensor,
                    s: torch.Tensor) -> tuple[Any, ...]:
            wide = g.to(_common.compute_dtype(g.dtype, p.dtype, ea.dtype, dtype))
            c = functools.partial(_common.scalar, dtype=wide.dtype)
            ea_t = c(beta1) * ea.to(wide.dtype) + c(1 - beta1) * c(dlr) * wide
            sq_t = c(beta2) * sq.to(wide.dtype) + c(1 - beta2) * wide * wide
            s_t = grad_sum(wide, s.to(wide.dtype), dlr)
            x = p.to(wide.dtype)
            u = -c(weight_decay) * c(dlr) * x - ea_t / (torch.sqrt(sq_t) + c(eps))
            return u.to(g.dtype), ea_t.to(ea.dtype), sq_t.to(sq.dtype), s_t.to(s.dtype)

        new_u, _, new_eas, new_sqs, new_sums = _shared.map_with_params(
            moments, grads, ps, eas, sqs, sums)
        inner, l1 = totals
        numerator = sb2 * state.numerator_weighted + (1 - sb2) * dlr * inner
        new_d = torch.maximum(state.estim_lr, numerator / ((1 - sb2) * l1))
        return _common.unflatten(treespec, new_u), DAdaptAdamWState(
            exp_avg=_common.unflatten(treespec, new_eas),
            exp_avg_sq=_common.unflatten(treespec, new_sqs),
            grad_sum=_common.unflatten(treespec, new_sums),
            estim_lr=new_d.to(dtype),
            numerator_weighted=numerator.to(dtype),
            count=count,
        )

    def update_fn(
        updates: Updates, state: DAdaptAdamWState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, DAdaptAdamWState]:
        del extra_args
        return finish(updates, state, params, tree_sums(updates, state, params))

    return specified(GradientTransformation(init_fn, update_fn), Leafwise("dadapt_adamw", {
        "learning_rate": learning_rate, "betas": betas, "eps": eps, "estim_lr0": estim_lr0,
        "weight_decay": weight_decay, "bias_correction": bias_correction},
        sums=tree_sums, finish=finish, slots=state_slots(DAdaptAdamWState)))
