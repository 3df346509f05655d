"""Skipping steps on non-finite gradients: ``apply_if_finite``.

On DTensor updates (FSDP2) the finiteness of the step is decided with one ``all_reduce``
over the mesh, so that every rank skips or applies alike and the state's counters stay
plain 0-d tensors, equal on all ranks.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from functopt._base import GradientTransformation, Params, State, Updates
from functopt._collective.dtensor import _infer_group, _leaf_names, is_dtensor
from functopt._collective.stats import all_reduce_stats
from functopt._spec import FiniteGuard, describe, specified
from functopt.transforms import _common
from functopt.transforms.combining import _check_transform
from functopt.tree import _core

__all__ = [
    "ApplyIfFiniteState",
    "apply_if_finite",
]


class ApplyIfFiniteState(NamedTuple):
    """State of [`apply_if_finite`][functopt.apply_if_finite]."""

    notfinite_count: torch.Tensor  # int32, shape (): non-finite steps in a row (0 if last finite)
    last_finite: torch.Tensor  # bool, shape (): whether the last updates were all finite
    total_notfinite: torch.Tensor  # int32, shape (): non-finite steps since init (never reset)
    inner_state: State  # the inner transform's state, bitwise unchanged by a skipped step


def _all_finite(leaves: list[Any], device: torch.device) -> torch.Tensor:
    """A 0-d bool tensor on ``device``: whether every tensor leaf is free of inf and nan."""
    flags = [torch.isfinite(x).all().to(device) for x in leaves if x is not None]
    if not flags:
        return torch.ones((), dtype=torch.bool, device=device)
    return torch.stack(flags).all()


def _all_finite_sharded(leaves: list[Any], treespec: _core.TreeSpec,
                        device: torch.device) -> torch.Tensor:
    """``_all_finite`` when some leaves are DTensors: one ``all_reduce`` over their mesh.

    ``isfinite(dt).all()`` on a sharded DTensor is a ``Partial`` DTensor whose ``bool()`` is
    the local rank's answer, and reducing each leaf would be one collective per leaf.
    Instead each rank counts the leaves with a non-finite value in the part it holds
    (a DTensor's local shard, possibly empty; a plain tensor whole), and one sum over the
    ranks decides for all of them. Counting a replicated copy once per rank is harmless:
    only whether the sum is zero matters. Plain leaves enter the sum too, so a rank whose
    plain tensor holds an inf makes every rank skip.
    """
    group = _infer_group([x if is_dtensor(x) else None for x in leaves], _leaf_names(treespec))
    counts = []
    for x in leaves:
        if x is None:
            continue
        # On a Shard/Replicate DTensor this is elementwise on the local shard (no
        # communication); a Partial one is reduced first, so its pending sum is checked.
        finite = torch.isfinite(x)
        local = finite.to_local() if is_dtensor(finite) else finite
        counts.append((~local).any().to(torch.int64))
    anchor = next(x for x in leaves if is_dtensor(x))
    local_device = anchor.to_local().device  # the collective runs on the mesh's device
    packed = torch.stack([c.to(local_device) for c in counts]).sum().reshape(1)
    return (all_reduce_stats(packed, group)[0] == 0).to(device)


def apply_if_finite(
    inner: GradientTransformation, max_consecutive_errors: int
) -> GradientTransformation:
    r"""Skip the inner transform's step when the updates hold an inf or a nan.

    With $c$ the number of consecutive steps whose updates were not all finite
    (counting this one; 0 when this one is finite), the step is applied when

    $$
    \text{finite}(u) \;\lor\; c > \text{max\_consecutive\_errors}.
    $$

    An applied step returns the inner transform's updates and state. A skipped step returns
    zeros (the updates' dtypes and shapes) and leaves the inner state bitwise as it was, so
    that after ``max_consecutive_errors`` skipped steps in a row the next non-finite update
    goes through (the wrapper gives up, as in optax).

    No host sync: the finiteness flag stays a 0-d device tensor; the inner update is always
    computed and ``torch.where`` picks, leaf by leaf, its result or the old value (optax
    branches with ``lax.cond`` instead, which under ``jit`` also computes both sides).
    ``None`` update leaves are ignored by the check and pass through.

    DTensor updates (FSDP2): each rank checks the shards it holds and one ``all_reduce``
    over the DTensors' mesh combines the answers, so a nan or inf in any rank's shard
    makes every rank skip; the counters stay plain 0-d tensors, equal on all ranks. All
    DTensor leaves must share one mesh's ranks (a ``ValueError`` names the leaves
    otherwise); plain tensor leaves next to them are checked on every rank and enter the
    same sum. Plain tensors alone make no collective.

    Args:
        inner: the transform to protect.
        max_consecutive_errors: how many non-finite steps in a row are skipped (an int
            >= 0); the next one is applied.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`ApplyIfFiniteState`][functopt.ApplyIfFiniteState].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.apply_if_finite(functopt.scale_by_adam(), max_consecutive_errors=2)
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> updates, state = tx.update({"w": torch.tensor([1.0, float("nan")])}, state)
        >>> updates["w"], state.notfinite_count, state.inner_state.count
        (tensor([0., 0.]), tensor(1, dtype=torch.int32), tensor(0, dtype=torch.int32))
        >>> updates, state = tx.update({"w": torch.tensor([1.0, -1.0])}, state)
        >>> updates["w"], state.notfinite_count, state.total_notfinite
        (tensor([ 1.0000, -1.0000]), tensor(0, dtype=torch.int32), tensor(1, dtype=torch.int32))
    """
    if (
        not isinstance(max_consecutive_errors, int)
        or isinstance(max_consecutive_errors, bool)
    ):
        raise TypeError(
            f"apply_if_finite: max_consecutive_errors must be an int, got "
            f"{type(max_consecutive_errors).__name__} {max_consecutive_errors!r}."
        )
    if max_consecutive_errors < 0:
        raise ValueError(
            f"apply_if_finite: max_consecutive_errors must be >= 0, got "
            f"{max_consecutive_errors}. Fix: 0 skips no step in a row, 5 skips up to five."
        )
    inner = _check_transform("apply_if_finite", "inner", inner)

    def init_fn(params: Params) -> ApplyIfFiniteState:
        leaves, _ = _core.flatten(params)
        count = _common.zero_count(leaves)
        return ApplyIfFiniteState(
            notfinite_count=count,
            last_finite=torch.ones((), dtype=torch.bool, device=count.device),
            total_notfinite=_common.zero_count(leaves),  # (its own tensor: a step
            # written in place, as a captured one is, moves the two counters apart)
            inner_state=inner.init(params),
        )

    def update_fn(
        updates: Updates, state: ApplyIfFiniteState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, ApplyIfFiniteState]:
        _common.check_state("apply_if_finite", state, ApplyIfFiniteState)
        leaves, treespec = _common.flatten_updates(updates)
        device = state.notfinite_count.device
        if any(is_dtensor(x) for x in leaves):
            finite = _all_finite_sharded(leaves, treespec, device)
        else:
            finite = _all_finite(leaves, device)
        return decided(updates, state, params, finite, extra_args)

    def sums(updates: Updates, state: ApplyIfFiniteState, params: Params | None = None,
             ) -> tuple[torch.Tensor]:
        # the planner's compiled tier, for a guard after other rules: this process's count
        # of the non-finite entries of the updates it is given
        del params
        tensors = [x for x in _core.flatten(updates)[0] if x is not None]
        total = torch.zeros((), dtype=torch.float64, device=state.notfinite_count.device)
        for x in tensors:
            total = total + (~torch.isfinite(x)).sum().to(total)
        return (total,)

    def finish(updates: Updates, state: ApplyIfFiniteState, params: Params | None,
               totals: tuple[torch.Tensor]) -> tuple[Updates, ApplyIfFiniteState]:
        # ... and the update given that count over every leaf and rank
        _common.check_state("apply_if_finite", state, ApplyIfFiniteState)
        finite = (totals[0] == 0).to(state.notfinite_count.device)
        return decided(updates, state, params, finite, {})

    def decided(updates: Updates, state: ApplyIfFiniteState, params: Params | None,
                finite: torch.Tensor, extra_args: dict[str, Any],
                ) -> tuple[Updates, ApplyIfFiniteState]:
        # the update once it is known whether every update is finite (0-d bool)
        _, treespec = _common.flatten_updates(updates)
        notfinite_count = torch.where(
            finite, torch.zeros_like(state.notfinite_count),
            _common.safe_increment(state.notfinite_count),
        )
        total_notfinite = torch.where(
            finite, state.total_notfinite, _common.safe_increment(state.total_notfinite)
        )
        apply = finite | (notfinite_count > max_consecutive_errors)

        new_updates, new_inner_state = inner.update(
            updates, state.inner_state, params, **extra_args
        )
        applied = _common.OnDevice(apply)
        out_leaves = _core.flatten_like(
            treespec, new_updates, name="the inner transform's updates", reference="updates"
        )
        # A scalar 0 keeps each leaf's dtype, and where() never lets a nan of the rejected
        # side through.
        out = [
            None if u is None else torch.where(applied.on(u.device), u, 0)
            for u in out_leaves
        ]
        return _core.unflatten(treespec, out), ApplyIfFiniteState(
            notfinite_count=notfinite_count,
            last_finite=finite,
            total_notfinite=total_notfinite,
            inner_state=_common.select_tree(~apply, state.inner_state, new_inner_state,
                                            owner="apply_if_finite", name="inner state"),
        )

    return specified(GradientTransformation(init_fn, update_fn),
                     FiniteGuard(describe(inner), max_consecutive_errors, sums=sums,
                                 finish=finish))
