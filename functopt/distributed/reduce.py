r"""Gradient statistics over sharded gradients in one collective.

A mixed-precision step needs three numbers about all gradients together: the sum of
squares (global norm, clipping), the count of non-finite elements (overflow), and the
count of zeros (Megatron's ``count_zeros``). Calling ``torch.linalg.vector_norm`` or
``torch.isfinite(g).all()`` on each DTensor gradient makes one collective per leaf and
per statistic (and ``isfinite(dt).all()`` is even a ``Partial`` result whose ``bool()``
is the local rank's answer). Here each rank computes the three numbers over the shards it
holds, for all leaves at once, packs them into one float64 tensor of shape ``(3,)``, and
one ``all_reduce(SUM)`` makes the global statistics, identical on every rank; so an
overflow in one rank's shard makes every rank skip. Leaves replicated along a mesh
dimension are counted once (see [`counted_here`][functopt.distributed.counted_here]).

The packed layout is [`functopt.precision.grad_stats`][functopt.precision.grad_stats]'s:
``[sum of squares, non-finite count, zero count]``, unpacked by
[`unpack_grad_stats`][functopt.precision.unpack_grad_stats]. For plain tensors the result
is bitwise ``grad_stats``'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from functopt.distributed.dtensor import (
    _counted_here,
    _infer_group,
    _leaf_names,
    is_dtensor,
    local_tensor,
)
from functopt.tree import _core
from functopt.tree._ops import _leaf_stats

__all__ = ["all_reduce_stats", "global_grad_stats", "local_grad_stats"]


def local_grad_stats(grads: Any, device: torch.device | None = None) -> torch.Tensor:
    """``[sum of squares, non-finite count, zero count]`` of the shards of ``grads`` this rank counts.

    Over every leaf of the pytree ``grads`` (``None`` leaves skipped): a DTensor
    contributes its local shard (possibly empty), unless another rank counts the same
    replicated values ([`counted_here`][functopt.distributed.counted_here]); a plain tensor
    contributes itself. Each leaf's sum of squares is accumulated in float32 (float64 for
    float64 leaves), the counts are exact up to $2^{53}$ elements, as in [`grad_stats`][functopt.precision.grad_stats]. No
    collective is made: sum the result over the ranks with
    [`all_reduce_stats`][functopt.distributed.all_reduce_stats].

    Args:
        grads: a pytree of tensors or DTensors (and ``None``).
        device: where the result lives when no leaf is counted (default: the CPU).

    Returns:
        A plain float64 tensor of shape ``(3,)`` on the first counted leaf's device.

    Raises:
        ValueError: a DTensor leaf has a ``Partial`` placement (naming the leaf).

    Examples:
        >>> import torch
        >>> from functopt.distributed import local_grad_stats
        >>> local_grad_stats({"w": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0]), "c": None})
        tensor([25.,  0.,  1.], dtype=torch.float64)
    """
    leaves, treespec = _core.flatten(grads)
    return _local_stats(leaves, _leaf_names(treespec), device)


def _local_stats(leaves: Sequence[Any], name: Callable[[int], str],
                 device: torch.device | None) -> torch.Tensor:
    """`local_grad_stats` on flattened leaves; ``name(i)`` words errors about leaf ``i``."""
    parts = []
    for i, g in enumerate(leaves):
        if g is None:
            continue
        if not isinstance(g, torch.Tensor):
            raise TypeError(
                f"local_grad_stats: grads leaf {name(i)!r} is a {type(g).__name__}; expected a "
                f"tensor, a DTensor or None."
            )
        if not _counted_here(g, functools.partial(name, i)):
            continue
        parts.append(_leaf_stats(local_tensor(g)))
    if not parts:
        return torch.zeros(3, dtype=torch.float64, device=device)
    return torch.stack(parts).sum(dim=0)


def all_reduce_stats(packed: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``packed`` over the ranks of ``group`` with exactly one ``all_reduce``.

    ``packed`` itself is left unchanged (the collective runs on a copy), so this is pure
    from the caller's side. ``group=None`` means no reduction (one rank, or plain tensors
    whole on every rank) and returns ``packed``; pass ``torch.distributed.group.WORLD``
    for the default group.

    Args:
        packed: a small plain tensor (e.g. from
            [`local_grad_stats`][functopt.distributed.local_grad_stats]).
        group: the process group to sum over, or ``None``.

    Returns:
        The sum over ranks, a tensor like ``packed``.

    Examples:
        >>> import torch
        >>> from functopt.distributed import all_reduce_stats, local_grad_stats
        >>> packed = local_grad_stats({"w": torch.tensor([3.0, 4.0, 0.0])})
        >>> packed.tolist()  # [sum of squares, non-finite count, zero count]
        [25.0, 0.0, 1.0]
        >>> all_reduce_stats(packed, None) is packed  # no group: nothing to reduce
        True
    """
    if group is None:
        return packed
    if is_dtensor(packed):
        raise TypeError(
            "all_reduce_stats: packed is a DTensor; expected the plain tensor of local "
            "statistics from local_grad_stats (which reads the DTensors' local shards)."
        )
    out = packed.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def global_grad_stats(
    grads: Any, group: dist.ProcessGroup | None = None, *, device: torch.device | None = None
) -> torch.Tensor:
    """[`local_grad_stats`][functopt.distributed.local_grad_stats] summed over the ranks: one collective.

    Args:
        grads: a pytree of tensors or DTensors (and ``None``).
        group: the process group to sum over. ``None`` infers it from the DTensor leaves'
            mesh ([`infer_group`][functopt.distributed.infer_group]); with plain tensors
            only, nothing is reduced (they are whole on every rank). An explicit group
            sums over its ranks, treating plain tensors as this rank's part of the
            gradients (as in a hand-sharded ZeRO setup).
        device: where the result lives when no leaf is counted.

    Returns:
        A plain float64 tensor ``[sum of squares, non-finite count, zero count]`` of shape
        ``(3,)``, the same on every rank of the group.

    Raises:
        ValueError: DTensors mixed with plain tensors or on meshes over different ranks
            (without an explicit group), or a ``Partial`` DTensor.

    Examples:
        >>> import torch
        >>> from functopt.distributed import global_grad_stats
        >>> from functopt.precision import unpack_grad_stats
        >>> unpack_grad_stats(global_grad_stats([torch.tensor([3.0, 4.0])]))
        GradStats(norm=tensor(5.), found_inf=tensor(False), num_zeros=tensor(0))
    """
    leaves, treespec = _core.flatten(grads)
    name = _leaf_names(treespec)
    if group is None:
        group = _infer_group(leaves, name)
    return all_reduce_stats(_local_stats(leaves, name, device), group)
