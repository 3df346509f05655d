"""Applying updates to params: the pure ``apply_updates`` and the in-place ``apply_updates_``."""

from __future__ import annotations

from typing import Any

import torch

from functopt._base import Params, Updates
from functopt.tree import _core


def _lined_up(params: Params, updates: Updates) -> tuple[list[Any], list[Any], _core.TreeSpec]:
    param_leaves, treespec = _core.flatten(params)
    _core.check_tensors(param_leaves, treespec, name="params")
    update_leaves = _core.flatten_like(treespec, updates, name="updates", reference="params")
    _core.check_tensors(update_leaves, treespec, name="updates")
    _core.check_like(update_leaves, param_leaves, treespec, name="update", reference_name="param")
    return param_leaves, update_leaves, treespec


def apply_updates(params: Params, updates: Updates) -> Params:
    """Return ``params + updates``, leaf by leaf, without touching either input.

    A ``None`` update leaves its param as it is (the same tensor object); a ``None`` param
    stays ``None``. Updates must have each param's shape, dtype and device: functopt never
    casts an update silently (for low-precision params, keep a float32 master copy with the
    mixed-precision stages instead).

    Examples:
        >>> import torch, functopt
        >>> functopt.apply_updates({"w": torch.ones(2)}, {"w": torch.tensor([0.5, -1.0])})
        {'w': tensor([1.5000, 0.0000])}
    """
    param_leaves, update_leaves, treespec = _lined_up(params, updates)
    new = [
        p if (p is None or u is None) else p + u
        for p, u in zip(param_leaves, update_leaves, strict=True)
    ]
    return _core.unflatten(treespec, new)


def apply_updates_(params: Params, updates: Updates) -> None:
    """Add ``updates`` to ``params`` in place (for ``nn.Module`` parameters).

    The write happens under ``torch.no_grad()``, so leaf parameters that require grad can
    be updated; the autograd version counter moves as with any in-place op. Same checks as
    [`apply_updates`][functopt.apply_updates].

    Examples:
        >>> import torch, functopt
        >>> model = torch.nn.Linear(2, 1)
        >>> params = dict(model.named_parameters())
        >>> before = model.bias.detach().clone()
        >>> functopt.apply_updates_(params, {"weight": None, "bias": torch.ones(1)})
        >>> torch.equal(model.bias.detach(), before + 1)
        True
    """
    param_leaves, update_leaves, _ = _lined_up(params, updates)
    with torch.no_grad():
        for p, u in zip(param_leaves, update_leaves, strict=True):
            if p is not None and u is not None:
                p.add_(u)
