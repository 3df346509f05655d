"""Projections of the updates: ``centralize`` (gradient centralization)."""

from __future__ import annotations

import math
from typing import Any

import torch

from functopt._base import EmptyState, GradientTransformation, Params, Updates
from functopt._rules import state_slots
from functopt._spec import PerLeaf, specified
from functopt.transforms import _common
from functopt.tree import _core

__all__ = [
    "centralize",
]


def _subtract_mean(g: torch.Tensor) -> torch.Tensor:
    if g.dim() <= 1:
        return g
    dims = tuple(range(1, g.dim()))
    n = max(math.prod(g.shape[1:]), 1)
    acc = g.to(torch.promote_types(g.dtype, torch.float32))
    # Divide before summing: the sum of n values of magnitude <= max/n cannot overflow, where
    # torch.mean's running sum can (two float32 values near 3e38 already do).
    mean = (acc / n).sum(dim=dims, keepdim=True)
    return (acc - mean).to(g.dtype)


def centralize() -> GradientTransformation:
    r"""Gradient centralization (Yong et al., 2020): remove each output unit's mean.

    For a leaf $u$ with more than one dim, the mean over all dims but the first is
    subtracted: $u_{i\cdot} \leftarrow u_{i\cdot} - \operatorname{mean}(u_{i\cdot})$
    (per row of a ``Linear`` weight ``(out, in)``, per output channel of a ``Conv`` weight),
    as optax does. Leaves with 0 or 1 dims (biases, scalars) are returned as they are (the
    same tensor). The mean is computed in float32 (float64 for float64 leaves) without
    overflowing; a unit holding inf or nan gets a non-finite mean and so non-finite entries,
    as in optax.

    Returns:
        A stateless [`GradientTransformation`][functopt.GradientTransformation].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.centralize()
        >>> u = {"w": torch.tensor([[1.0, 3.0], [0.0, 4.0]]), "b": torch.tensor([1.0, 3.0])}
        >>> tx.update(u, tx.init(None))[0]
        {'w': tensor([[-1.,  1.],
                [-2.,  2.]]), 'b': tensor([1., 3.])}

    References:
        Yong, Huang, Hua & Zhang, *Gradient Centralization: A New Optimization Technique for
        Deep Neural Networks*, 2020.
    """

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(
        updates: Updates, state: EmptyState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, EmptyState]:
        _common.check_state("centralize", state, EmptyState)
        del params, extra_args
        leaves, treespec = _common.flatten_updates(updates)
        return _common.unflatten(treespec, _core.map_leaves(_subtract_mean, leaves)), state

    # each unit's own mean: the planner's per-leaf tier runs this update a group at a time
    return specified(GradientTransformation(init_fn, update_fn), PerLeaf("centralize", {},
                                                                       slots=state_slots(EmptyState)))
