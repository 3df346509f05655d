"""Rescaling by moment estimates of the gradient: ``scale_by_adam`` and its relatives."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from functopt import _validate
from functopt._base import GradientTransformation, Numeric, Params, Updates
from functopt.transforms import _common

__all__ = [
    "ScaleByAdamState",
    "scale_by_adam",
]


def _check_betas(owner: str, **betas: Any) -> None:
    for name, value in betas.items():
        _validate.check_range(owner, name, value, low=0.0, high=1.0, high_open=True,
                              hint="Fix: decay rates are in [0, 1); 0.9 and 0.999 are usual.")


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`."""

    count: torch.Tensor  # int32, shape (): number of updates done so far
    mu: Updates  # like params, dtype mu_dtype (default: the param's): EMA of the gradient
    nu: Updates  # like params, dtype nu_dtype (default: the param's): EMA of its square


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

    With gradient :math:`g_t` and :math:`t` counting from 1:

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad
        v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \\
        \hat m_t = m_t / (1-\beta_1^t), \quad \hat v_t = v_t / (1-\beta_2^t), \quad
        u_t = \hat m_t / (\sqrt{\hat v_t + \epsilon_{root}} + \epsilon).

    With ``nesterov=True`` (NAdam), :math:`\hat m_t = \beta_1 m_t / (1-\beta_1^{t+1}) +
    (1-\beta_1) g_t / (1-\beta_1^t)`. The moments are computed in the wider of the gradient's
    and the moment's dtype, then stored in ``mu_dtype`` / ``nu_dtype``; the update keeps the
    gradient's dtype. Where a gradient is ``None`` the moments are left as they are.

    Args:
        b1: decay of the first moment, in [0, 1).
        b2: decay of the second moment, in [0, 1).
        eps: added to the root of the second moment, >= 0.
        eps_root: added to the second moment inside the root, >= 0 (for meta-gradients).
        mu_dtype: storage dtype of the first moment (default: the param's dtype).
        nesterov: use Nesterov momentum (NAdam).
        nu_dtype: storage dtype of the second moment (default: the param's dtype).

    Returns:
        A :class:`~functopt.GradientTransformation` with :class:`ScaleByAdamState`.

    Example:
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
    owner = "scale_by_adam"
    _check_betas(owner, b1=b1, b2=b2)
    _validate.check_range(owner, "eps", eps, low=0.0)
    _validate.check_range(owner, "eps_root", eps_root, low=0.0)
    _validate.check_dtype(owner, "mu_dtype", mu_dtype)
    _validate.check_dtype(owner, "nu_dtype", nu_dtype)

    def init_fn(params: Params) -> ScaleByAdamState:
        leaves, treespec = _common.flatten_params(params)
        mu = [None if p is None else _common.zeros_like(p, mu_dtype) for p in leaves]
        nu = [None if p is None else _common.zeros_like(p, nu_dtype) for p in leaves]
        return ScaleByAdamState(
            count=_common.zero_count(leaves),
            mu=_common.unflatten(treespec, mu),
            nu=_common.unflatten(treespec, nu),
        )

    def update_fn(
        updates: Updates, state: ScaleByAdamState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ScaleByAdamState]:
        del params, extra_args
        grads, treespec = _common.flatten_updates(updates)
        mus = _common.state_like(treespec, state.mu, name="state.mu")
        nus = _common.state_like(treespec, state.nu, name="state.nu")
        count = _common.safe_increment(state.count)
        bc1 = _common.bias_correction(b1, count)
        bc2 = _common.bias_correction(b2, count)
        bc1_next = _common.bias_correction(b1, _common.safe_increment(count)) if nesterov else bc1

        new_updates: list[Any] = []
        new_mus: list[Any] = []
        new_nus: list[Any] = []
        for g, mu, nu in zip(grads, mus, nus, strict=True):
            if g is None:
                new_updates.append(None)
                new_mus.append(mu)
                new_nus.append(nu)
                continue
            # Compute in the wider of the two dtypes: a bfloat16 moment is widened before
            # it is decayed, so storage precision is the only precision given up.
            mu_t = b1 * mu.to(torch.promote_types(g.dtype, mu.dtype)) + (1 - b1) * g
            nu_t = b2 * nu.to(torch.promote_types(g.dtype, nu.dtype)) + (1 - b2) * (g * g)
            if nesterov:
                mu_hat = b1 * mu_t / bc1_next + (1 - b1) * g / bc1
            else:
                mu_hat = mu_t / bc1
            u = mu_hat / (torch.sqrt(nu_t / bc2 + eps_root) + eps)
            new_updates.append(u.to(g.dtype))
            new_mus.append(mu_t.to(mu.dtype))
            new_nus.append(nu_t.to(nu.dtype))
        new_state = ScaleByAdamState(
            count=count,
            mu=_common.unflatten(treespec, new_mus),
            nu=_common.unflatten(treespec, new_nus),
        )
        return _common.unflatten(treespec, new_updates), new_state

    return GradientTransformation(init_fn, update_fn)
