r"""Gradient statistics over sharded gradients in one collective.

A mixed-precision step needs three numbers about all gradients together: the sum of
squares (global norm, clipping), the count of non-finite elements (overflow), and the
count of zeros (Megatron's ``count_zeros``). Calling ``torch.linalg.vector_norm`` or
``torch.isfinite(g).all()`` on each DTensor gradient makes one collective per leaf and
per statistic (and ``isfinite(dt).all()`` is even a ``Partial`` result whose ``bool()``
is the local rank's answer). Here each rank computes the three numbers over the shards it
holds, for all leaves at once, packs them into one float64 tensor of shape ``(3,)``, and
one ``all_reduce(SUM)`` makes the global statistics, identical on every rank; so an
overflow in one rank's shard makes every rank skip. Each element is counted once:
DTensor leaves by their placements (a leaf replicated along a mesh dimension counts on
one rank of it), plain tensor leaves in a sum over a group by their ``replicated``
declaration (see ``functopt/_collective/counting.py``).

The packed layout is [`functopt.precision.grad_stats`][functopt.precision.grad_stats]'s:
``[sum of squares, non-finite count, zero count]``, unpacked by
[`unpack_grad_stats`][functopt.precision.unpack_grad_stats]. For plain tensors the result
is bitwise ``grad_stats``'s.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from functopt._collective.counting import Replicated, _as_tensor_leaves, _counting, _entries
from functopt._collective.dtensor import (
    _counted_here,
    _leaf_names,
    is_dtensor,
    local_tensor,
)
from functopt.tree import _core
from functopt.tree._ops import _leaf_stats

__all__ = ["all_reduce_stats", "global_grad_stats", "local_grad_stats"]


def local_grad_stats(grads: Any, device: torch.device | None = None, *,
                     group: dist.ProcessGroup | None = None,
                     replicated: Replicated = None) -> torch.Tensor:
    """``[sum of squares, non-finite count, zero count]`` of the shards of ``grads`` this rank counts.

    Over every leaf of the pytree ``grads`` (``None`` leaves skipped): a DTensor
    contributes its local shard (possibly empty), unless another rank counts the same
    replicated values ([`counted_here`][functopt.distributed.counted_here]); a plain tensor
    contributes itself, unless it is declared replicated and another rank of the group
    counts it (see ``replicated`` in
    [`global_grad_stats`][functopt.distributed.global_grad_stats]). Each leaf's sum of squares is accumulated in float32 (float64 for
    float64 leaves), the counts are exact up to $2^{53}$ elements, as in [`grad_stats`][functopt.precision.grad_stats]. No
    collective is made: sum the result over the ranks with
    [`all_reduce_stats`][functopt.distributed.all_reduce_stats].

    Args:
        grads: a pytree of tensors or DTensors (and ``None``).
        device: where the result lives when no leaf is counted (default: the CPU).
        group: the group the result will be summed over, as in ``global_grad_stats``.
        replicated: how plain tensors repeat over the ranks, as in ``global_grad_stats``.

    Returns:
        A plain float64 tensor of shape ``(3,)`` on the first counted leaf's device.

    Raises:
        ValueError: a DTensor leaf has a ``Partial`` placement (naming the leaf), and the
            errors of ``global_grad_stats`` about groups and plain tensors.

    Examples:
        >>> import torch
        >>> from functopt.distributed import local_grad_stats
        >>> local_grad_stats({"w": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0]), "c": None})
        tensor([25.,  0.,  1.], dtype=torch.float64)
    """
    owner = "local_grad_stats"
    leaves, treespec = _core.flatten(grads)
    name = _leaf_names(treespec)
    _as_tensor_leaves(leaves, name, owner)
    _, counted = _counting(owner, leaves, name, group,
                           _entries(owner, replicated, grads, leaves, treespec))
    return _local_stats(leaves, name, device, counted)


def _local_stats(leaves: Sequence[Any], name: Callable[[int], str],
                 device: torch.device | None, counted: Sequence[bool] | None = None,
                 ) -> torch.Tensor:
    """`local_grad_stats` on flattened leaves; ``name(i)`` words errors about leaf ``i``;
    ``counted[i]``: whether this rank counts leaf ``i`` (default: by DTensor placements
    over the whole mesh, plain tensors always)."""
    parts = []
    for i, g in enumerate(leaves):
        if g is None:
            continue
        if not isinstance(g, torch.Tensor):
            raise TypeError(
                f"local_grad_stats: grads leaf {name(i)!r} is a {type(g).__name__}; expected a "
                f"tensor, a DTensor or None."
            )
        if not (counted[i] if counted is not None
                else _counted_here(g, functools.partial(name, i))):
            continue
        parts.append(_leaf_stats(local_tensor(g)))
    if not parts:
        return torch.zeros(3, dtype=torch.float64, device=device)
    return torch.stack(parts).sum(dim=0)


COLLECTIVE_FAILED = (
    "functopt: the all_reduce of the gradient statistics (one per step, over {world} ranks) "
    "failed: a rank died, left the step, or did not reach it within the process group's "
    "timeout. Every rank must run the same step; the ranks still alive cannot go on. Fix: "
    "restart every rank from the last checkpoint (functopt.load_checkpoint); to fail sooner "
    "when a rank hangs, pass a shorter timeout= to init_process_group or new_group."
)


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
    try:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    except RuntimeError as exc:  # gloo's and NCCL's errors (DistBackendError) keep their type
        raise_with_note(exc, COLLECTIVE_FAILED.format(world=dist.get_world_size(group)))
    return out


def raise_with_note(exc: RuntimeError, note: str) -> typing.NoReturn:
    """Re-raise ``exc`` (inside its ``except`` block) with ``note`` added to its message."""
    add_note = getattr(exc, "add_note", None)  # Python 3.11+
    if add_note is None:
        raise RuntimeError(f"{exc}\n{note}") from exc
    add_note(note)
    raise exc


def global_grad_stats(
    grads: Any, group: dist.ProcessGroup | None = None, *, replicated: Replicated = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """[`local_grad_stats`][functopt.distributed.local_grad_stats] summed over the ranks: one collective.

    Args:
        grads: a pytree of tensors or DTensors (and ``None``).
        group: the process group to sum over. ``None`` infers it from the DTensor leaves'
            mesh ([`infer_group`][functopt.distributed.infer_group]); with plain tensors
            only, nothing is reduced (they are whole on every rank). DTensor leaves are
            counted by their placements relative to this group (a ``Replicate()`` along a
            mesh dimension inside the group once, along a dimension outside it once per
            group; see ``functopt/_collective/counting.py``).
        replicated: how the plain tensor leaves repeat over the ranks, required when plain
            tensors meet a group (given, or inferred from DTensor leaves): ``False``, each
            rank's tensor is its own part (summed: a hand-sharded ZeRO slice, a rank's own
            experts); ``True``, every rank of the group holds the same values (counted once,
            on the group's rank 0: a param left out of the tensor-parallel plan, dense params
            beside expert-parallel ones); a ``ProcessGroup``, the same values on the ranks
            of that group, a subgroup of ``group`` (counted once per such group: e.g. the
            tensor-parallel ranks of one pipeline stage). One value for all plain leaves, a
            pytree of them with the grads' structure or a prefix of it, or a function of
            ``grads`` returning one. Entries at DTensor leaves are read only for a
            DTensor on a mesh inside another leaf's mesh (FSDP2 x TP with a param left out
            of the plan): ``True``, its mesh's copies hold the same values; ``False``,
            values of their own; a group, the copies through this rank (see
            ``functopt/_collective/counting.py``).
        device: where the result lives when no leaf is counted.

    Returns:
        A plain float64 tensor ``[sum of squares, non-finite count, zero count]`` of shape
        ``(3,)``, the same on every rank of the group.

    Raises:
        ValueError: DTensors on meshes over different ranks (without an explicit group), a
            plain tensor in a sum over a group without a ``replicated`` declaration (saying
            how to declare it), a group that splits a mesh dimension or leaves out the other
            shards of a sharded dimension, or a ``Partial`` DTensor.
        TypeError: a leaf, or a ``replicated`` entry, of the wrong type.

    Examples:
        >>> import torch
        >>> from functopt.distributed import global_grad_stats
        >>> from functopt.precision import unpack_grad_stats
        >>> unpack_grad_stats(global_grad_stats([torch.tensor([3.0, 4.0])]))
        GradStats(norm=tensor(5.), found_inf=tensor(False), num_zeros=tensor(0))
    """
    owner = "global_grad_stats"
    leaves, treespec = _core.flatten(grads)
    name = _leaf_names(treespec)
    _as_tensor_leaves(leaves, name, owner)
    group, counted = _counting(owner, leaves, name, group,
                               _entries(owner, replicated, grads, leaves, treespec))
    return all_reduce_stats(_local_stats(leaves, name, device, counted), group)
