"""Constraints on updates and params: ``zero_nans`` and ``keep_params_nonnegative``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from functopt._base import EmptyState, GradientTransformation, Params, Updates
from functopt._collective.dtensor import _infer_group, _leaf_names, is_dtensor
from functopt._collective.stats import all_reduce_stats
from functopt._rules import state_slots
from functopt._spec import Leafwise, ZeroNans, specified
from functopt.transforms import _common
from functopt.tree import _core

__all__ = [
    "ZeroNansState",
    "keep_params_nonnegative",
    "zero_nans",
]


class ZeroNansState(NamedTuple):
    """State of [`zero_nans`][functopt.zero_nans]."""

    found_nan: Any  # like params, bool, shape (): whether the leaf's last update held a nan


def zero_nans() -> GradientTransformation:
    r"""Replace nan in the updates by 0, and record per leaf whether there was one.

    $u_i \leftarrow 0$ where $u_i$ is nan; inf and every other value pass
    unchanged. ``found_nan`` in the state holds, per leaf, a 0-d bool tensor: whether that
    leaf's update held a nan at the last ``update``. It is for monitoring only; the
    transform never reads it. Where an update is ``None`` the flag is left as it is.

    DTensor updates (FSDP2): the flags of all DTensor leaves are computed from the local
    shards and combined over the mesh with one ``all_reduce``, so each flag is a plain 0-d
    bool tensor saying whether the whole (global) update held a nan, the same on every
    rank; the zeroing itself is elementwise, without communication.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`ZeroNansState`][functopt.ZeroNansState].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.zero_nans()
        >>> params = {"w": torch.zeros(3)}
        >>> u, state = tx.update({"w": torch.tensor([1.0, float("nan"), float("inf")])},
        ...                      tx.init(params))
        >>> u["w"], state.found_nan["w"]
        (tensor([1., 0., inf]), tensor(True))
    """

    def init_fn(params: Params) -> ZeroNansState:
        leaves, treespec = _common.flatten_params(params)
        flags = [
            None if p is None else torch.zeros((), dtype=torch.bool, device=p.device)
            for p in leaves
        ]
        return ZeroNansState(found_nan=_common.unflatten(treespec, flags))

    def update_fn(
        updates: Updates, state: ZeroNansState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, ZeroNansState]:
        _common.check_state("zero_nans", state, ZeroNansState)
        del params, extra_args
        leaves, treespec = _common.flatten_updates(updates)
        flags = _common.state_like(treespec, state.found_nan, name="state.found_nan", like=leaves)
        new_updates: list[Any] = []
        new_flags: list[Any] = []
        sharded: list[int] = []  # positions in new_flags of DTensor leaves' local flags
        for g, flag in zip(leaves, flags, strict=True):
            if g is None:
                new_updates.append(None)
                new_flags.append(flag)
                continue
            zeroed, flag = _zeroed(g)
            new_updates.append(zeroed)
            if is_dtensor(g):
                # the local flag of a shard: all of them are reduced below, in one collective
                sharded.append(len(new_flags))
            new_flags.append(flag)
        if sharded:
            _reduce_flags(new_flags, sharded, leaves, treespec, flags)
        return _common.unflatten(treespec, new_updates), ZeroNansState(
            found_nan=_common.unflatten(treespec, new_flags)
        )

    return specified(GradientTransformation(init_fn, update_fn), ZeroNans(_zeroed))


def _zeroed(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One leaf's update with its nans made 0, and whether it held one: this process's flag,
    of the local shard for a DTensor (whose ``any()`` would be a Partial DTensor)."""
    is_nan = torch.isnan(g)
    return torch.where(is_nan, 0.0, g), (is_nan.to_local() if is_dtensor(is_nan)
                                         else is_nan).any()


def _reduce_flags(new_flags: list[Any], sharded: list[int], leaves: list[Any],
                  treespec: _core.TreeSpec, old_flags: list[Any]) -> None:
    """OR the local flags at ``sharded`` over the DTensors' mesh, in place in ``new_flags``.

    The flags are packed into one int64 vector, summed over the ranks with one
    ``all_reduce``, and each becomes a plain 0-d bool tensor on its old flag's device
    (the same value on every rank).
    """
    group = _infer_group([x if is_dtensor(x) else None for x in leaves], _leaf_names(treespec))
    anchor = next(x for x in leaves if is_dtensor(x))
    local_device = anchor.to_local().device  # the collective runs on the mesh's device
    packed = torch.stack([new_flags[i].to(local_device, torch.int64) for i in sharded])
    total = all_reduce_stats(packed, group) > 0
    for j, i in enumerate(sharded):
        device = old_flags[i].device if isinstance(old_flags[i], torch.Tensor) else local_device
        new_flags[i] = total[j].to(device)


def keep_params_nonnegative() -> GradientTransformation:
    r"""Change the updates so that no param becomes negative: $u \leftarrow -p$ where
    $p + u < 0$, else $u$.

    Put it last in a chain (it must see the final updates). It expects non-negative params:
    a negative param with any update that keeps it negative is moved to 0. A ``None`` update
    stays ``None``.

    Returns:
        A stateless [`GradientTransformation`][functopt.GradientTransformation]; ``update`` needs ``params``.

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.keep_params_nonnegative()
        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> tx.update({"w": torch.tensor([-3.0, -1.0])}, tx.init(params), params)[0]
        {'w': tensor([-1., -1.])}
    """
    owner = "keep_params_nonnegative"

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(
        updates: Updates, state: EmptyState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, EmptyState]:
        _common.check_state("keep_params_nonnegative", state, EmptyState)
        del extra_args
        leaves, treespec = _common.flatten_updates(updates)
        param_leaves = _common.params_like(treespec, params, leaves, owner=owner)
        new: list[torch.Tensor | None] = []
        for i, (u, p) in enumerate(zip(leaves, param_leaves, strict=True)):
            if u is None:
                new.append(None)
            elif p is None:
                where = _core.paths(treespec)[i]
                raise ValueError(
                    f"{owner}: leaf {where!r} has an update but its param is None. Fix: pass "
                    f"the param, or pass None as its update too."
                )
            else:
                new.append(torch.where(p + u < 0, -p, u))
        return _common.unflatten(treespec, new), state

    # elementwise in the updates and params: the compiled tier runs this update over a
    # group's leaves laid end to end
    return specified(GradientTransformation(init_fn, update_fn),
                     Leafwise("keep_params_nonnegative", {}, slots=state_slots(EmptyState)))
