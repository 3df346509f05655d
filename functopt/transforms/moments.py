"""Rescaling by moment estimates of the gradient: ``scale_by_adam`` and its relatives.

Every transform here follows one numeric rule: the moment maths runs in the widest of the
gradient's dtype, the moment's storage dtype and float32, and only then is each result
rounded to where it lives (the moment to its storage dtype, the update to the gradient's
dtype). A float16 gradient of 300 therefore squares to 90,000 without overflowing, and
``eps = 1e-8`` is not flushed to zero for half-precision params. The scalars (bias
corrections, hyperparameters that are 0-d tensors) are cast to that dtype before they meet a
leaf, so a 0-d leaf is computed exactly like a one-element leaf. Where a gradient is
``None`` (a param without gradient) the update stays ``None`` and that leaf's moments are
left exactly as they were; only the shared step counter moves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functopt import _validate
from functopt._base import GradientTransformation, Numeric, Params, Updates
from functopt._rules import state_slots
from functopt._spec import Leafwise, specified
from functopt.transforms import _common
from functopt.transforms.sign import _sign
from functopt.tree import _core

__all__ = [
    "ScaleByAdamState",
    "ScaleByAmsgradState",
    "ScaleByLionState",
    "ScaleByNadamState",
    "scale_by_adam",
    "scale_by_adamax",
    "scale_by_amsgrad",
    "scale_by_lion",
    "scale_by_nadam",
    "scale_by_radam",
]


class ScaleByAdamState(NamedTuple):
    """State of [`scale_by_adam`][functopt.scale_by_adam]."""

    # The name shadows tuple.count (hence the ignore); kept: optax's name, public API.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far
    mu: Updates  # like params, dtype mu_dtype (default: the param's): EMA of the gradient
    nu: Updates  # like params, dtype nu_dtype (default: the param's): EMA of its square


def init_moments(params: Params, mu_dtype: torch.dtype | None = None,
                 nu_dtype: torch.dtype | None = None) -> ScaleByAdamState:
    """A fresh Adam-like state: a zero count and zero moments like the params (``None``
    where a param is ``None``), stored in ``mu_dtype`` / ``nu_dtype`` (default: the param's).
    Shared by every transform whose state is a ``ScaleByAdamState`` (or holds its fields)."""
    leaves, treespec = _common.flatten_params(params)
    mu = [None if p is None else _common.zeros_like(p, mu_dtype) for p in leaves]
    nu = [None if p is None else _common.zeros_like(p, nu_dtype) for p in leaves]
    return ScaleByAdamState(count=_common.zero_count(leaves),
                            mu=_common.unflatten(treespec, mu),
                            nu=_common.unflatten(treespec, nu))


def moment_inputs(owner: str, updates: Updates, state: Any, expected: type,
                  ) -> tuple[list[Any], _core.TreeSpec, list[Any], list[Any], torch.Tensor]:
    """The start of an Adam-like update: the state checked by its type, the gradients
    flattened, ``state.mu`` and ``state.nu`` lined up with them (each present where a
    gradient is), and the step count after this update."""
    _common.check_state(owner, state, expected)
    grads, treespec = _common.flatten_updates(updates)
    mus = _common.state_like(treespec, state.mu, name="state.mu", like=grads)
    nus = _common.state_like(treespec, state.nu, name="state.nu", like=grads)
    _common.check_state_present(owner, treespec, grads, mu=mus, nu=nus)
    return grads, treespec, mus, nus, _common.safe_increment(state.count)


def _adam_denominator(nu: torch.Tensor, bc2: torch.Tensor, eps_root: Any, eps: Any,
                      c: Callable[[Any], Any]) -> torch.Tensor:
    r"""$\sqrt{\nu / (1-\beta_2^t) + \epsilon_{root}} + \epsilon$, computed as torch.optim
    computes Adam's denominator: ``sqrt(nu) / sqrt(1 - b2**t) + eps``.

    The order matters at the ends of the range, where the fused kernels and the pure path
    must agree on what overflows. ``torch/optim/adam.py`` (``_single_tensor_adam``, torch
    2.13) takes ``exp_avg_sq.sqrt() / bias_correction2_sqrt + eps`` and then
    ``param.addcdiv_(exp_avg, denom, value=-step_size)`` with ``step_size = lr /
    bias_correction1``: the moment is divided by the denominator *before* the bias
    correction of the first moment scales it; ``torch._fused_adam(w)_`` (CPU:
    ``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``) does the same per element. Dividing
    ``nu`` by the correction first overflows for ``nu`` near the dtype's maximum, and
    ``mu / bc1`` first turns a huge finite ``mu`` over an infinite ``nu`` into inf / inf =
    NaN where torch gets 0. So callers compute ``mu / denominator / bc1``. ``eps_root``
    (optax's, for meta-gradients; torch has none) enters as ``nu + eps_root * bc2`` under
    the root, the same value, and exactly ``nu`` when it is 0.
    """
    root = torch.sqrt(nu + c(eps_root) * c(bc2)) if _nonzero(eps_root) else torch.sqrt(nu)
    denominator: torch.Tensor = root / c(torch.sqrt(bc2)) + c(eps)
    return denominator


def _nonzero(value: Any) -> bool:
    """Whether a hyperparameter may be nonzero (a tensor is not read: it may be)."""
    return isinstance(value, torch.Tensor) or value != 0


def scale_by_adam(
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    eps: Numeric = 1e-8,
    eps_root: Numeric = 0.0,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = False,
    nu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Rescale updates by Adam's bias-corrected moment estimates (Kingma & Ba, 2014).

    With gradient $g_t$ and $t$ counting from 1:

    $$
    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \\
    \hat m_t = m_t / (1-\beta_1^t), \quad \hat v_t = v_t / (1-\beta_2^t), \quad
    u_t = \hat m_t / (\sqrt{\hat v_t + \epsilon_{root}} + \epsilon).
    $$

    With ``nesterov=True`` (NAdam), $\hat m_t = \beta_1 m_t / (1-\beta_1^{t+1}) +
    (1-\beta_1) g_t / (1-\beta_1^t)$. The moments are computed in the widest of the
    gradient's dtype, the moment's dtype and float32, then stored in ``mu_dtype`` /
    ``nu_dtype``; the update keeps the gradient's dtype. Where a gradient is ``None`` the
    moments are left as they are.

    Args:
        b1: decay of the first moment, in [0, 1).
        b2: decay of the second moment, in [0, 1).
        eps: added to the root of the second moment, >= 0.
        eps_root: added to the second moment inside the root, >= 0 (for meta-gradients).
        mu_dtype: storage dtype of the first moment (default: the param's dtype).
        nesterov: use Nesterov momentum (NAdam).
        nu_dtype: storage dtype of the second moment (default: the param's dtype). Not in
            optax, which always stores ``nu`` in the param's dtype.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`ScaleByAdamState`][functopt.ScaleByAdamState].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_adam()
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> updates, state = tx.update({"w": torch.tensor([0.5, -2.0])}, state)
        >>> updates["w"]  # the first Adam step is about sign(g)
        tensor([ 1.0000, -1.0000])

    References:
        Kingma & Ba, *Adam: A Method for Stochastic Optimization*, 2014.
        Dozat, *Incorporating Nesterov Momentum into Adam*, 2016.
    """
    _validate.check_flags("scale_by_adam", nesterov=nesterov)
    owner = "scale_by_adam"
    _common.check_betas(owner, b1=b1, b2=b2)
    _validate.check_range(owner, "eps", eps, low=0.0)
    _validate.check_range(owner, "eps_root", eps_root, low=0.0)
    _validate.check_dtype(owner, "mu_dtype", mu_dtype)
    _validate.check_dtype(owner, "nu_dtype", nu_dtype)

    def init_fn(params: Params) -> ScaleByAdamState:
        return init_moments(params, mu_dtype, nu_dtype)

    def update_fn(
        updates: Updates, state: ScaleByAdamState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ScaleByAdamState]:
        del params, extra_args
        grads, treespec, mus, nus, count = moment_inputs(owner, updates, state,
                                                         ScaleByAdamState)
        bc1 = _common.bias_correction(b1, count)
        bc2 = _common.bias_correction(b2, count)
        bc1_next = _common.bias_correction(b1, _common.safe_increment(count)) if nesterov else bc1

        def leaf(g: torch.Tensor, mu: torch.Tensor, nu: torch.Tensor) -> tuple[torch.Tensor, ...]:
            # Storage precision is the only precision given up: a bfloat16 moment is
            # widened before it is decayed, and g*g cannot overflow a float16 range.
            wide = g.to(_common.compute_dtype(g.dtype, mu.dtype, nu.dtype))
            c = functools.partial(_common.scalar, dtype=wide.dtype)
            mu_t = c(b1) * mu.to(wide.dtype) + c(1 - b1) * wide
            nu_t = c(b2) * nu.to(wide.dtype) + c(1 - b2) * (wide * wide)
            denom = _adam_denominator(nu_t, bc2, eps_root, eps, c)
            if nesterov:
                mu_hat = c(b1) * mu_t / c(bc1_next) + c(1 - b1) * wide / c(bc1)
                u = mu_hat / denom
            else:
                u = mu_t / denom / c(bc1)  # torch's order (see _adam_denominator)
            return u.to(g.dtype), mu_t.to(mu.dtype), nu_t.to(nu.dtype)

        new_updates, new_mus, new_nus = _common.map_with_state(leaf, grads, mus, nus)
        new_state = ScaleByAdamState(
            count=count,
            mu=_common.unflatten(treespec, new_mus),
            nu=_common.unflatten(treespec, new_nus),
        )
        return _common.unflatten(treespec, new_updates), new_state

    return specified(GradientTransformation(init_fn, update_fn), Leafwise("scale_by_adam", {
        "b1": b1, "b2": b2, "eps": eps, "eps_root": eps_root, "mu_dtype": mu_dtype,
        "nesterov": nesterov, "nu_dtype": nu_dtype}, slots=state_slots(ScaleByAdamState), kernel="adam"))


class ScaleByAmsgradState(NamedTuple):
    """State of [`scale_by_amsgrad`][functopt.scale_by_amsgrad]."""

    # The name shadows tuple.count (hence the ignore); kept: optax's name, public API.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far
    mu: Updates  # like params, dtype mu_dtype (default: the param's): EMA of the gradient
    nu: Updates  # like params, dtype nu_dtype (default: the param's): EMA of its square
    nu_max: Updates  # like params, dtype as nu: running max of the (corrected) EMA nu


def scale_by_amsgrad(
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    eps: Numeric = 1e-8,
    eps_root: Numeric = 0.0,
    mu_dtype: torch.dtype | None = None,
    bias_correction_mu: bool = True,
    bias_correction_nu: bool = True,
    *,
    nu_dtype: torch.dtype | None = None,
    correct_after_max: bool = False,
) -> GradientTransformation:
    r"""Rescale updates by AMSGrad: Adam with a never-decreasing second moment.

    With Adam's $m_t, v_t$ (see [`scale_by_adam`][functopt.scale_by_adam]) and $t$ from 1:

    $$
    \hat m_t = m_t / (1-\beta_1^t), \quad
    \hat v_t = v_t / (1-\beta_2^t), \quad
    v^{max}_t = \max(v^{max}_{t-1}, \hat v_t), \quad
    u_t = \hat m_t / (\sqrt{v^{max}_t + \epsilon_{root}} + \epsilon).
    $$

    ``bias_correction_mu=False`` uses $m_t$ for $\hat m_t$, and
    ``bias_correction_nu=False`` uses $v_t$ for $\hat v_t$ (both ``False`` is
    the algorithm of the paper). This is optax's definition: the maximum is taken over the
    *bias-corrected* $\hat v$. ``torch.optim.Adam(amsgrad=True)`` differs: it keeps
    the maximum of the raw $v_t$ and divides it by the current
    $1-\beta_2^t$, i.e. $\sqrt{\max_{s\le t} v_s / (1-\beta_2^t)}$. The two
    agree while $v_t$ grows, and differ once it shrinks (then torch's denominator
    keeps shrinking as $1-\beta_2^t \to 1$ while optax's stays at its peak).
    ``correct_after_max=True`` gives torch's variant: ``nu_max`` then holds the maximum of
    the raw $v_t$ and the update is $\hat m_t / (\sqrt{v^{max}_t / (1-\beta_2^t) +
    \epsilon_{root}} + \epsilon)$ (what [`functopt.optim.Adam`][functopt.optim.Adam] uses
    for ``amsgrad=True``).

    Args:
        b1: decay of the first moment, in [0, 1).
        b2: decay of the second moment, in [0, 1).
        eps: added to the root of the second moment, >= 0.
        eps_root: added to the second moment inside the root, >= 0 (for meta-gradients).
        mu_dtype: storage dtype of the first moment (default: the param's dtype).
        bias_correction_mu: bias-correct the first moment.
        bias_correction_nu: bias-correct the second moment before taking the maximum.
        nu_dtype: storage dtype of ``nu`` and ``nu_max`` (default: the param's dtype). Not
            in optax.
        correct_after_max: take the maximum of the raw second moment and bias-correct it
            afterwards, as ``torch.optim.Adam(amsgrad=True)`` does. Not in optax; needs
            ``bias_correction_nu=True``.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`ScaleByAmsgradState`][functopt.ScaleByAmsgradState].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_amsgrad()
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> u, state = tx.update({"w": torch.tensor([2.0])}, state)
        >>> u, state = tx.update({"w": torch.tensor([0.0])}, state)
        >>> state.nu_max["w"]  # stays at the peak of the corrected second moment
        tensor([4.])

    References:
        Reddi, Kale & Kumar, *On the Convergence of Adam and Beyond*, ICLR 2018.
    """
    _validate.check_flags("scale_by_amsgrad", bias_correction_mu=bias_correction_mu,
                          bias_correction_nu=bias_correction_nu,
                          correct_after_max=correct_after_max)
    owner = "scale_by_amsgrad"
    _common.check_betas(owner, b1=b1, b2=b2)
    _validate.check_range(owner, "eps", eps, low=0.0)
    _validate.check_range(owner, "eps_root", eps_root, low=0.0)
    _validate.check_dtype(owner, "mu_dtype", mu_dtype)
    _validate.check_dtype(owner, "nu_dtype", nu_dtype)
    if correct_after_max and not bias_correction_nu:
        raise ValueError(
            f"{owner}: correct_after_max=True moves the second moment's bias correction after "
            f"the maximum, but bias_correction_nu=False removes that correction. Fix: drop "
            f"one of the two (bias_correction_nu=False alone is the paper's algorithm)."
        )

    def init_fn(params: Params) -> ScaleByAmsgradState:
        leaves, treespec = _common.flatten_params(params)
        mu = [None if p is None else _common.zeros_like(p, mu_dtype) for p in leaves]
        nu = [None if p is None else _common.zeros_like(p, nu_dtype) for p in leaves]
        nu_max = [None if p is None else _common.zeros_like(p, nu_dtype) for p in leaves]
        return ScaleByAmsgradState(
            count=_common.zero_count(leaves),
            mu=_common.unflatten(treespec, mu),
            nu=_common.unflatten(treespec, nu),
            nu_max=_common.unflatten(treespec, nu_max),
        )

    def update_fn(
        updates: Updates, state: ScaleByAmsgradState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ScaleByAmsgradState]:
        _common.check_state("scale_by_amsgrad", state, ScaleByAmsgradState)
        del params, extra_args
        grads, treespec = _common.flatten_updates(updates)
        mus = _common.state_like(treespec, state.mu, name="state.mu", like=grads)
        nus = _common.state_like(treespec, state.nu, name="state.nu", like=grads)
        maxes = _common.state_like(treespec, state.nu_max, name="state.nu_max", like=grads)
        _common.check_state_present(owner, treespec, grads, mu=mus, nu=nus, nu_max=maxes)
        count = _common.safe_increment(state.count)
        bc1 = _common.bias_correction(b1, count)
        bc2 = _common.bias_correction(b2, count)

        def leaf(g: torch.Tensor, mu: torch.Tensor, nu: torch.Tensor,
                 nu_max: torch.Tensor) -> tuple[torch.Tensor, ...]:
            wide = g.to(_common.compute_dtype(g.dtype, mu.dtype, nu.dtype, nu_max.dtype))
            c = functools.partial(_common.scalar, dtype=wide.dtype)
            mu_t = c(b1) * mu.to(wide.dtype) + c(1 - b1) * wide
            nu_t = c(b2) * nu.to(wide.dtype) + c(1 - b2) * (wide * wide)
            if correct_after_max:
                max_t = torch.maximum(nu_max.to(wide.dtype), nu_t)
                u = mu_t / _adam_denominator(max_t, bc2, eps_root, eps, c)
            else:
                nu_hat = nu_t / c(bc2) if bias_correction_nu else nu_t
                max_t = torch.maximum(nu_max.to(wide.dtype), nu_hat)
                u = mu_t / (torch.sqrt(max_t + c(eps_root)) + c(eps))
            if bias_correction_mu:
                u = u / c(bc1)  # torch's order (see _adam_denominator)
            return u.to(g.dtype), mu_t.to(mu.dtype), nu_t.to(nu.dtype), max_t.to(nu_max.dtype)

        new_updates, new_mus, new_nus, new_maxes = _common.map_with_state(
            leaf, grads, mus, nus, maxes
        )
        new_state = ScaleByAmsgradState(
            count=count,
            mu=_common.unflatten(treespec, new_mus),
            nu=_common.unflatten(treespec, new_nus),
            nu_max=_common.unflatten(treespec, new_maxes),
        )
        return _common.unflatten(treespec, new_updates), new_state

    return specified(GradientTransformation(init_fn, update_fn), Leafwise("scale_by_amsgrad", {
        "b1": b1, "b2": b2, "eps": eps, "eps_root": eps_root, "mu_dtype": mu_dtype,
        "bias_correction_mu": bias_correction_mu, "bias_correction_nu": bias_correction_nu,
        "nu_dtype": nu_dtype, "correct_after_max": correct_after_max},
        slots=state_slots(ScaleByAmsgradState), kernel="amsgrad"))


class ScaleByLionState(NamedTuple):
    """State of [`scale_by_lion`][functopt.scale_by_lion]."""

    # The name shadows tuple.count (hence the ignore); kept: optax's name, public API.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far
    mu: Updates  # like params, dtype mu_dtype (default: the param's): EMA of the gradient


def scale_by_lion(
    b1: Numeric = 0.9,
    b2: Numeric = 0.99,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Rescale updates by Lion: the sign of an interpolation of momentum and gradient.

    $$
    u_t = \operatorname{sign}\big((1-\beta_1)\, g_t + \beta_1 m_{t-1}\big), \quad
    m_t = \beta_2 m_{t-1} + (1-\beta_2)\, g_t.
    $$

    The update uses the *previous* momentum; the momentum is then refreshed with its own
    decay ``b2``. Where the interpolation is ±0 or NaN the update is that value (NaN is not
    hidden as 0, unlike ``torch.sign``).

    Recent optax versions add keyword-only ``mode`` / ``smooth_beta`` (tanh or clipped
    variants of the sign); they are not provided here (compose the variant you need from
    [`scale_by_lion`][functopt.scale_by_lion]'s maths or a custom transform).

    Args:
        b1: weight of the momentum in the interpolation, in [0, 1].
        b2: decay of the momentum, in [0, 1].
        mu_dtype: storage dtype of the momentum (default: the param's dtype).

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`ScaleByLionState`][functopt.ScaleByLionState].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_lion()
        >>> state = tx.init({"w": torch.zeros(3)})
        >>> u, state = tx.update({"w": torch.tensor([0.3, -2.0, 0.0])}, state)
        >>> u["w"]
        tensor([ 1., -1.,  0.])

    References:
        Chen et al., *Symbolic Discovery of Optimization Algorithms*, 2023.
    """
    owner = "scale_by_lion"
    _common.check_betas(owner, closed=True, b1=b1, b2=b2)
    _validate.check_dtype(owner, "mu_dtype", mu_dtype)

    def init_fn(params: Params) -> ScaleByLionState:
        leaves, treespec = _common.flatten_params(params)
        mu = [None if p is None else _common.zeros_like(p, mu_dtype) for p in leaves]
        return ScaleByLionState(
            count=_common.zero_count(leaves), mu=_common.unflatten(treespec, mu)
        )

    def update_fn(
        updates: Updates, state: ScaleByLionState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ScaleByLionState]:
        _common.check_state("scale_by_lion", state, ScaleByLionState)
        del params, extra_args
        grads, treespec = _common.flatten_updates(updates)
        mus = _common.state_like(treespec, state.mu, name="state.mu", like=grads)
        _common.check_state_present(owner, treespec, grads, mu=mus)
        def leaf(g: torch.Tensor, mu: torch.Tensor) -> tuple[torch.Tensor, ...]:
            wide = g.to(_common.compute_dtype(g.dtype, mu.dtype))
            c = functools.partial(_common.scalar, dtype=wide.dtype)
            mu_prev = mu.to(wide.dtype)
            return (_sign(c(1 - b1) * wide + c(b1) * mu_prev).to(g.dtype),
                    (c(b2) * mu_prev + c(1 - b2) * wide).to(mu.dtype))

        new_updates, new_mus = _common.map_with_state(leaf, grads, mus)
        new_state = ScaleByLionState(
            count=_common.safe_increment(state.count), mu=_common.unflatten(treespec, new_mus)
        )
        return _common.unflatten(treespec, new_updates), new_state

    return specified(GradientTransformation(init_fn, update_fn), Leafwise(
        "scale_by_lion", {"b1": b1, "b2": b2, "mu_dtype": mu_dtype},
        slots=state_slots(ScaleByLionState)))


def scale_by_adamax(
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    eps: Numeric = 1e-8,
) -> GradientTransformation:
    r"""Rescale updates by Adamax: Adam with the infinity norm for the second moment.

    With gradient $g_t$ and $t$ counting from 1:

    $$
    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad
    v_t = \max(\beta_2 v_{t-1}, |g_t| + \epsilon), \quad
    u_t = \frac{m_t}{(1-\beta_1^t)\, v_t}.
    $$

    The infinity moment needs no bias correction. As in optax, the state is a
    [`ScaleByAdamState`][functopt.ScaleByAdamState] whose ``nu`` holds $v_t$. Chained with
    ``scale_by_learning_rate(lr)`` this is ``torch.optim.Adamax(lr, betas=(b1, b2), eps)``.
    The maths runs in the widest of the leaf's dtypes and float32.

    Args:
        b1: decay of the first moment, in [0, 1).
        b2: decay of the infinity moment, in [0, 1].
        eps: added to $|g_t|$, >= 0 (with 0, a zero gradient over a zero moment is NaN).

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`ScaleByAdamState`][functopt.ScaleByAdamState].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_adamax(eps=0.0)
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> u, state = tx.update({"w": torch.tensor([2.0, -0.5])}, state)
        >>> u["w"]  # the first step is sign(g)
        tensor([ 1., -1.])

    References:
        Kingma & Ba, *Adam: A Method for Stochastic Optimization*, 2014 (section 7.1).
    """
    owner = "scale_by_adamax"
    _common.check_betas(owner, b1=b1)
    _common.check_betas(owner, closed=True, b2=b2)
    _validate.check_range(owner, "eps", eps, low=0.0)

    def init_fn(params: Params) -> ScaleByAdamState:
        return init_moments(params)

    def update_fn(
        updates: Updates, state: ScaleByAdamState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ScaleByAdamState]:
        del params, extra_args
        grads, treespec, mus, nus, count = moment_inputs(owner, updates, state,
                                                         ScaleByAdamState)
        bc1 = _common.bias_correction(b1, count)

        def leaf(g: torch.Tensor, mu: torch.Tensor, nu: torch.Tensor) -> tuple[torch.Tensor, ...]:
            wide = g.to(_common.compute_dtype(g.dtype, mu.dtype, nu.dtype))
            c = functools.partial(_common.scalar, dtype=wide.dtype)
            mu_t = c(b1) * mu.to(wide.dtype) + c(1 - b1) * wide
            nu_t = torch.maximum(c(b2) * nu.to(wide.dtype), wide.abs() + c(eps))
            u = mu_t / (c(bc1) * nu_t)
            return u.to(g.dtype), mu_t.to(mu.dtype), nu_t.to(nu.dtype)

        new_updates, new_mus, new_nus = _common.map_with_state(leaf, grads, mus, nus)
        return _common.unflatten(treespec, new_updates), ScaleByAdamState(
            count=count, mu=_common.unflatten(treespec, new_mus),
            nu=_common.unflatten(treespec, new_nus))

    return specified(GradientTransformation(init_fn, update_fn), Leafwise(
        "scale_by_adamax", {"b1": b1, "b2": b2, "eps": eps}, slots=state_slots(ScaleByAdamState)))


def scale_by_radam(
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    eps: Numeric = 1e-8,
    eps_root: Numeric = 0.0,
    threshold: Numeric = 5.0,
    *,
    nesterov: bool = False,
    eps_before_correction: bool = False,
) -> GradientTransformation:
    r"""Rescale updates by Rectified Adam (Liu et al., 2020).

    With Adam's moments $m_t, v_t$ and corrections (see
    [`scale_by_adam`][functopt.scale_by_adam]), $\rho_\infty = 2/(1-\beta_2) - 1$ and
    $\rho_t = \rho_\infty - 2t\beta_2^t/(1-\beta_2^t)$:

    $$
    u_t = r_t\, \frac{\hat m_t}{\sqrt{\hat v_t + \epsilon_{root}} + \epsilon}
    \ \text{ if } \rho_t \ge \text{threshold}, \text{ else } \hat m_t, \qquad
    r_t = \sqrt{\frac{(\rho_t-4)(\rho_t-2)\rho_\infty}{(\rho_\infty-4)(\rho_\infty-2)\rho_t}}.
    $$

    ``eps_before_correction=True`` adds ``eps`` to the root of the raw $v_t$ and divides by
    the correction afterwards, $\sqrt{1-\beta_2^t} / (\sqrt{v_t + \epsilon_{root}} +
    \epsilon)$, as ``torch.optim.RAdam`` does (not in optax). ``nesterov`` uses the NAdam
    look-ahead for $\hat m_t$. As in optax, the state is a
    [`ScaleByAdamState`][functopt.ScaleByAdamState].

    Args:
        b1: decay of the first moment, in [0, 1).
        b2: decay of the second moment, in [0, 1).
        eps: stabilizer of the denominator, >= 0.
        eps_root: added inside the root, >= 0.
        threshold: the $\rho_t$ from which the rectified step is taken (torch: 5).
        nesterov: use Nesterov momentum.
        eps_before_correction: torch.optim.RAdam's placement of ``eps``.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`ScaleByAdamState`][functopt.ScaleByAdamState].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_radam()
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> u, state = tx.update({"w": torch.tensor([3.0])}, state)
        >>> u["w"]  # rho_1 = 1 < 5: the bias-corrected momentum, unscaled
        tensor([3.])

    References:
        Liu et al., *On the Variance of the Adaptive Learning Rate and Beyond*, ICLR 2020.
    """
    _validate.check_flags("scale_by_radam", nesterov=nesterov,
                          eps_before_correction=eps_before_correction)
    owner = "scale_by_radam"
    _common.check_betas(owner, b1=b1, b2=b2)
    _validate.check_range(owner, "eps", eps, low=0.0)
    _validate.check_range(owner, "eps_root", eps_root, low=0.0)
    _validate.check_range(owner, "threshold", threshold, low=4.0, low_open=True,
                          hint="Fix: the rectifier needs rho_t > 4; torch and optax use 5.")

    def init_fn(params: Params) -> ScaleByAdamState:
        return init_moments(params)

    def update_fn(
        updates: Updates, state: ScaleByAdamState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ScaleByAdamState]:
        del params, extra_args
        grads, treespec, mus, nus, count = moment_inputs(owner, updates, state,
                                                         ScaleByAdamState)
        bc1 = _common.bias_correction(b1, count)
        bc2 = _common.bias_correction(b2, count)
        bc1_next = _common.bias_correction(b1, _common.safe_increment(count)) if nesterov else bc1
        # float64 scalars, as torch.optim computes them with Python floats
        ro_inf = 2 / (1 - _common.scalar(b2, torch.float64)) - 1
        ro = ro_inf - 2 * count.to(torch.float64) * (1 - bc2) / bc2
        rectified = ro >= _common.scalar(threshold, torch.float64)
        # Off the rectified branch the ratio may be negative: take the root of a harmless 1.
        ratio = (ro - 4) * (ro - 2) * ro_inf / ((ro_inf - 4) * (ro_inf - 2) * ro)
        r = torch.sqrt(torch.where(rectified, ratio, 1.0))

        def leaf(g: torch.Tensor, mu: torch.Tensor, nu: torch.Tensor) -> tuple[torch.Tensor, ...]:
            wide = g.to(_common.compute_dtype(g.dtype, mu.dtype, nu.dtype))
            c = functools.partial(_common.scalar, dtype=wide.dtype)
            mu_t = c(b1) * mu.to(wide.dtype) + c(1 - b1) * wide
            nu_t = c(b2) * nu.to(wide.dtype) + c(1 - b2) * (wide * wide)
            if nesterov:
                mu_hat = c(b1) * mu_t / c(bc1_next) + c(1 - b1) * wide / c(bc1)
            else:
                mu_hat = mu_t / c(bc1)
            if eps_before_correction:
                adaptive = torch.sqrt(c(bc2)) / (torch.sqrt(nu_t + c(eps_root)) + c(eps))
            else:
                adaptive = 1 / (torch.sqrt(nu_t / c(bc2) + c(eps_root)) + c(eps))
            u = torch.where(rectified.to(wide.device), mu_hat * c(r) * adaptive, mu_hat)
            return u.to(g.dtype), mu_t.to(mu.dtype), nu_t.to(nu.dtype)

        new_updates, new_mus, new_nus = _common.map_with_state(leaf, grads, mus, nus)
        return _common.unflatten(treespec, new_updates), ScaleByAdamState(
            count=count, mu=_common.unflatten(treespec, new_mus),
            nu=_common.unflatten(treespec, new_nus))

    return specified(GradientTransformation(init_fn, update_fn), Leafwise("scale_by_radam", {
        "b1": b1, "b2": b2, "eps": eps, "eps_root": eps_root, "threshold": threshold,
        "nesterov": nesterov, "eps_before_correction": eps_before_correction},
        slots=state_slots(ScaleByAdamState)))


class ScaleByNadamState(NamedTuple):
    """State of [`scale_by_nadam`][functopt.scale_by_nadam]."""

    # The name shadows tuple.count (hence the ignore); kept: the name used elsewhere.
    count: torch.Tensor  # type: ignore[assignment]  # int32, shape (): updates done so far
    mu_product: torch.Tensor  # float64, shape (): the product of the momentum schedule
    mu: Updates  # like params, the param's dtype: EMA of the gradient
    nu: Updates  # like params, the param's dtype: EMA of its square


def scale_by_nadam(
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    eps: Numeric = 1e-8,
    momentum_decay: Numeric = 4e-3,
) -> GradientTransformation:
    r"""Rescale updates by NAdam with Dozat's momentum schedule (``torch.optim.NAdam``).

    With Adam's moments $m_t, v_t$, $t$ counting from 1, the schedule
    $\mu_t = \beta_1 (1 - \tfrac12 \cdot 0.96^{t\psi})$ ($\psi$ is ``momentum_decay``)
    and its running product $\Pi_t = \prod_{s \le t} \mu_s$:

    $$
    u_t = \Big(\frac{1-\mu_t}{1-\Pi_t}\, g_t + \frac{\mu_{t+1}}{1-\Pi_t\,\mu_{t+1}}\, m_t
    \Big) \Big/ \Big(\sqrt{v_t / (1-\beta_2^t)} + \epsilon\Big).
    $$

    Chained with ``scale_by_learning_rate(lr)`` this is ``torch.optim.NAdam(lr, betas,
    eps, momentum_decay=momentum_decay)``. optax's NAdam
    ([`nadam`][functopt.nadam], ``scale_by_adam(nesterov=True)``) has no schedule: it is a
    different rule. $\Pi_t$ is kept in float64 (torch keeps it in the default dtype,
    float32 unless changed, so the two differ by float32 rounding there).

    Args:
        b1: decay of the first moment, in [0, 1).
        b2: decay of the second moment, in [0, 1).
        eps: stabilizer of the denominator, >= 0.
        momentum_decay: $\psi$, >= 0.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`ScaleByNadamState`][functopt.ScaleByNadamState].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_nadam()
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> u, state = tx.update({"w": torch.tensor([1.0])}, state)
        >>> u["w"], state.mu_product  # 1 + 0.1 * mu_2 / (1 - mu_1 * mu_2), mu_1
        (tensor([1.0565]), tensor(0.4501, dtype=torch.float64))

    References:
        Dozat, *Incorporating Nesterov Momentum into Adam*, 2016.
    """
    owner = "scale_by_nadam"
    _common.check_betas(owner, b1=b1, b2=b2)
    _validate.check_range(owner, "eps", eps, low=0.0)
    _validate.check_range(owner, "momentum_decay", momentum_decay, low=0.0)

    def init_fn(params: Params) -> ScaleByNadamState:
        fresh = init_moments(params)
        return ScaleByNadamState(
            count=fresh.count,
            mu_product=torch.ones((), dtype=torch.float64, device=fresh.count.device),
            mu=fresh.mu, nu=fresh.nu)

    def update_fn(
        updates: Updates, state: ScaleByNadamState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ScaleByNadamState]:
        del params, extra_args
        grads, treespec, mus, nus, count = moment_inputs(owner, updates, state,
                                                         ScaleByNadamState)
        t = count.to(torch.float64)
        b1_64 = _common.scalar(b1, torch.float64)
        psi = _common.scalar(momentum_decay, torch.float64)
        mu_now = b1_64 * (1 - 0.5 * 0.96 ** (t * psi))
        mu_next = b1_64 * (1 - 0.5 * 0.96 ** ((t + 1) * psi))
        product = state.mu_product * mu_now
        g_coef = (1 - mu_now) / (1 - product)
        m_coef = mu_next / (1 - product * mu_next)
        bc2 = _common.bias_correction(b2, count)

        def leaf(g: torch.Tensor, mu: torch.Tensor, nu: torch.Tensor) -> tuple[torch.Tensor, ...]:
            wide = g.to(_common.compute_dtype(g.dtype, mu.dtype, nu.dtype))
            c = functools.partial(_common.scalar, dtype=wide.dtype)
            mu_t = c(b1) * mu.to(wide.dtype) + c(1 - b1) * wide
            nu_t = c(b2) * nu.to(wide.dtype) + c(1 - b2) * (wide * wide)
            denom = torch.sqrt(nu_t / c(bc2)) + c(eps)
            u = (c(g_coef) * wide + c(m_coef) * mu_t) / denom
            return u.to(g.dtype), mu_t.to(mu.dtype), nu_t.to(nu.dtype)

        new_updates, new_mus, new_nus = _common.map_with_state(leaf, grads, mus, nus)
        return _common.unflatten(treespec, new_updates), ScaleByNadamState(
            count=count, mu_product=product, mu=_common.unflatten(treespec, new_mus),
            nu=_common.unflatten(treespec, new_nus))

    return specified(GradientTransformation(init_fn, update_fn), Leafwise("scale_by_nadam", {
        "b1": b1, "b2": b2, "eps": eps, "momentum_decay": momentum_decay},
        slots=state_slots(ScaleByNadamState)))
