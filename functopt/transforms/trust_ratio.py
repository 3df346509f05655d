"""Layer-wise trust ratios (LARS, LAMB): ``scale_by_trust_ratio``."""

from __future__ import annotations

from typing import Any

import torch

from functopt import _validate
from functopt._base import EmptyState, GradientTransformation, Numeric, Params, Updates
from functopt._collective.dtensor import is_dtensor
from functopt._rules import state_slots
from functopt._spec import PerLeaf, specified
from functopt.transforms import _common
from functopt.tree import _core

__all__ = [
    "scale_by_trust_ratio",
]


def scale_by_trust_ratio(
    min_norm: Numeric = 0.0,
    trust_coefficient: Numeric = 1.0,
    eps: Numeric = 0.0,
) -> GradientTransformation:
    r"""Scale each leaf's update by the ratio of the param's norm to the update's norm.

    For every leaf, with the whole-tensor Euclidean norms floored at ``min_norm``,
    $\|x\| = \max(\|x\|_2, \text{min\_norm})$:

    $$
    r = \text{trust\_coefficient} \cdot \frac{\|p\|}{\|u\| + \epsilon}, \quad
    u \leftarrow r\, u,
    $$

    except that $r = 1$ where $\|p\| = 0$ or $\|u\| = 0$ (a param at zero,
    or a zero update, is left to the rest of the chain). The norms and the ratio are
    computed in at least float32, so a float16 leaf's norm does not overflow; the update
    keeps its dtype. ``None`` updates stay ``None``.

    LARS is ``chain(add_decayed_weights(wd), scale_by_trust_ratio(), scale(-lr))`` (plus
    momentum) and LAMB is ``chain(scale_by_adam(), add_decayed_weights(wd),
    scale_by_trust_ratio(), scale(-lr))``.

    Args:
        min_norm: floor of both norms, >= 0 (0: no floor).
        trust_coefficient: factor of the ratio (LARS's $\eta$).
        eps: added to the update's norm in the denominator, >= 0.

    Returns:
        A stateless [`GradientTransformation`][functopt.GradientTransformation]; its ``update`` needs
        ``params``.

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.scale_by_trust_ratio()
        >>> params = {"w": torch.tensor([3.0, 4.0])}  # norm 5
        >>> u, _ = tx.update({"w": torch.tensor([0.0, 0.5])}, tx.init(params), params)
        >>> u["w"]  # scaled to norm 5
        tensor([0., 5.])

    References:
        You, Gitman & Ginsburg, *Large Batch Training of Convolutional Networks*, 2017.
        You et al., *Large Batch Optimization for Deep Learning: Training BERT in 76
        minutes*, ICLR 2020.
    """
    owner = "scale_by_trust_ratio"
    _validate.check_range(owner, "min_norm", min_norm, low=0.0)
    _validate.check_number(owner, "trust_coefficient", trust_coefficient)
    _validate.check_range(owner, "eps", eps, low=0.0)

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def ratio(param_norm: torch.Tensor, update_norm: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
        # (0-d norms on the pure path, a vector of them on the grouped one: the same
        # elementwise operations)
        floor = _common.scalar(min_norm, dtype)
        param_norm = torch.where(param_norm <= floor, floor, param_norm)
        update_norm = torch.where(update_norm <= floor, floor, update_norm)
        zero_norm = (param_norm == 0) | (update_norm == 0)
        # Divide by 1 off the selected branch, so that the (zero) backward of the
        # where does not meet x / 0 and turn into NaN.
        denominator = torch.where(zero_norm, 1.0, update_norm + _common.scalar(eps, dtype))
        coefficient = _common.scalar(trust_coefficient, dtype)
        return torch.where(zero_norm, 1.0, coefficient * param_norm / denominator)

    def step(updates: Updates, state: EmptyState, params: Params | None,
             grouped: bool) -> tuple[Updates, EmptyState]:
        _common.check_state("scale_by_trust_ratio", state, EmptyState)
        leaves, treespec = _common.flatten_updates(updates)
        param_leaves = _common.params_like(treespec, params, leaves, owner=owner)
        new: list[Any] = [None] * len(leaves)
        groups: dict[Any, list[int]] = {}
        for i, (u, p) in enumerate(zip(leaves, param_leaves, strict=True)):
            if u is None:
                continue
            if p is None:
                raise ValueError(
                    f"{owner}: {_core.paths(treespec)[i]!r} has an update but its param is "
                    f"None; the trust ratio needs the param's norm. Fix: pass the param, "
                    f"or pass None as the update for a param without value."
                )
            dtype = _common.compute_dtype(u.dtype, p.dtype)
            if grouped and not (is_dtensor(u) or is_dtensor(p)):
                groups.setdefault((u.device, dtype), []).append(i)
                continue
            wide = u.to(dtype)
            r = ratio(torch.linalg.vector_norm(p.to(dtype)), torch.linalg.vector_norm(wide),
                      dtype)
            new[i] = (wide * r).to(u.dtype)
        for (_, dtype), idx in groups.items():
            # the planner's per-leaf tier: every norm of the group in two foreach calls and
            # the ratios as one vector (the same values as leaf by leaf)
            wide = [leaves[i].to(dtype) for i in idx]
            ratios = ratio(torch.stack(torch._foreach_norm([param_leaves[i].to(dtype)
                                                           for i in idx])),
                           torch.stack(torch._foreach_norm(wide)), dtype)
            for j, i in enumerate(idx):
                new[i] = (wide[j] * ratios[j]).to(leaves[i].dtype)
        return _common.unflatten(treespec, new), state

    def update_fn(
        updates: Updates, state: EmptyState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, EmptyState]:
        del extra_args
        return step(updates, state, params, grouped=False)

    def grouped_fn(
        updates: Updates, state: EmptyState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, EmptyState]:
        del extra_args
        return step(updates, state, params, grouped=True)

    # a ratio of the leaf's own norms: the planner's per-leaf tier runs it a group at a time
    return specified(GradientTransformation(init_fn, update_fn), PerLeaf(
        "scale_by_trust_ratio", {"min_norm": min_norm, "trust_coefficient": trust_coefficient,
                                 "eps": eps}, grouped=grouped_fn,
        slots=state_slots(EmptyState)))
