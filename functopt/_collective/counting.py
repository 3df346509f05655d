r"""Which rank counts which leaf in a sum over a process group: each element exactly once.

A global statistic (a norm, an overflow count, a zero count) is a sum over the ranks of a
group of what each rank reads. A DTensor says by its placements which of its pieces are
copies (``Replicate()`` along a mesh dimension) and which are disjoint (``Shard``); a plain
tensor says nothing, and the same plain tensor can be either: a param left out of a tensor
parallel plan, or the dense layers beside expert-parallel experts, hold *the same values*
on every rank, while a hand-sharded (ZeRO) slice or a rank's own experts are *its part*.
Summing copies counts them once per rank (Megatron-LM avoids it with
``param_is_not_tensor_parallel_duplicate``; forgetting it over-clips, as in NeMo-RL
issue 3788). The rules here:

- **DTensor leaves** follow their placements, relative to the group summed over. Along a
  mesh dimension whose ranks are all in the group, a ``Replicate()`` piece is counted by
  the rank at coordinate 0 only and a ``Shard`` piece by every rank. Along a dimension
  outside the group (a ``Replicate()`` over the data-parallel ranks while the group is the
  tensor-parallel one), each group sees one copy, counted. A ``Shard`` along a dimension
  outside the group would leave the other shards out of the sum and raises, as does a
  group holding only part of a dimension's ranks, and a ``Partial`` placement.
- **Plain tensor leaves** in a sum over a group are declared with ``replicated``: ``False``
  (this rank's own part: counted on every rank), ``True`` (the same values on every rank
  of the group: counted on the group's rank 0), or a process group (the same values on
  the ranks of that group, e.g. the tensor-parallel ranks of one pipeline stage: counted on
  its rank 0; it must lie inside the group summed over). ``replicated`` is one such value
  for all plain leaves, a pytree of them with the grads' structure or a prefix of it (one
  value for a whole subtree), or a function of the tree returning one. Entries at DTensor
  leaves are not read: placements already say it. Without a declaration, a plain tensor in
  a sum over a group raises, saying how to declare it; with no group and no DTensor there
  is nothing to sum, and plain tensors are whole on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
import torch.distributed as dist

from functopt._collective.dtensor import _dtensor_class, _infer_group, _mesh_ranks, is_dtensor
from functopt.tree import _core

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Replicated"]

Replicated: TypeAlias = Any
"""How plain tensor leaves repeat over the ranks: ``bool``, a ``ProcessGroup``, a pytree of
those (the grads' structure or a prefix of it), or a function of the tree returning one."""

_Entry = bool | dist.ProcessGroup | None  # one leaf's declaration (None: none given)

_HOW = (
    "Fix: pass replicated=True if every rank of the group holds the same values (a param "
    "left out of the tensor-parallel plan, dense params beside expert-parallel experts), "
    "replicated=False if each rank's tensor is its own part (a hand-sharded slice, a rank's "
    "own experts), or a pytree of such bools (or of the process groups over which a leaf "
    "repeats) with the grads' structure; or make the leaf a DTensor whose placements say it."
)


def _non_member(entry: Any) -> bool:
    """Whether ``entry`` is what ``new_group`` returns on the ranks outside the group."""
    return (type(entry) is type(dist.GroupMember.NON_GROUP_MEMBER)
            and entry == dist.GroupMember.NON_GROUP_MEMBER)


def _check_entry(owner: str, where: str, entry: Any) -> None:
    if _non_member(entry):
        raise ValueError(
            f"{owner}: replicated entry {where!r} is GroupMember.NON_GROUP_MEMBER, what "
            f"torch.distributed.new_group returns on the ranks outside the new group: it is "
            f"declared replicated over a process group this rank ({dist.get_rank()}) is not "
            f"in. Fix: give each rank the group of the ranks that hold the same copy as it."
        )
    if not isinstance(entry, (bool, dist.ProcessGroup)):
        raise TypeError(
            f"{owner}: replicated entry {where!r} is {_core._describe(entry)}; expected True, "
            f"False or a torch.distributed.ProcessGroup. {_HOW}"
        )


def _entries(owner: str, replicated: Replicated, tree: Any, leaves: Sequence[Any],
             treespec: _core.TreeSpec) -> list[_Entry]:
    """One declaration per leaf of ``tree`` (``None`` everywhere when none is given)."""
    if replicated is None:
        return [None] * len(leaves)
    if callable(replicated) and not isinstance(replicated, dist.ProcessGroup):
        replicated = replicated(tree)
    if isinstance(replicated, (bool, dist.ProcessGroup)):
        return [replicated] * len(leaves)
    if _non_member(replicated):
        _check_entry(owner, "<root>", replicated)
    prefix_leaves, prefix_spec = _core.flatten(replicated)
    for where, entry in zip(_core.paths(prefix_spec), prefix_leaves, strict=True):
        _check_entry(owner, where, entry)
    try:
        return list(_core.broadcast_prefix(replicated, tree, treespec))
    except ValueError as where:
        raise ValueError(
            f"{owner}: replicated must have the structure of the grads, or of a prefix of "
            f"it; it differs {where}. Fix: one bool per leaf, or one for a whole subtree."
        ) from None


@functools.lru_cache(maxsize=256)
def _group_ranks(group: dist.ProcessGroup) -> frozenset[int]:
    return frozenset(dist.get_process_group_ranks(group))


@functools.lru_cache(maxsize=256)
def _span(mesh: DeviceMesh, group: dist.ProcessGroup) -> tuple[bool | None, ...]:
    """Per mesh dimension: all ranks along it (through this rank) in ``group`` (True), only
    this rank (False), or some (None)."""
    inside = _group_ranks(group)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # checked by the caller
    out: list[bool | None] = []
    for dim in range(mesh.ndim):
        index: list[Any] = list(coordinate)
        index[dim] = slice(None)
        along = {int(r) for r in mesh.mesh[tuple(index)].reshape(-1).tolist()}
        common = along & inside
        out.append(True if common == along else False if len(common) <= 1 else None)
    return tuple(out)


def _dtensor_counted(x: Any, where: Callable[[], str], group: dist.ProcessGroup | None) -> bool:
    """Whether this rank counts its shard of the DTensor ``x`` in a sum over ``group``
    (``None``: the group of all of ``x``'s mesh)."""
    mesh = x.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(
            f"{where()!r}: this rank ({dist.get_rank()}) is not part of the leaf's device mesh "
            f"{mesh}. Fix: call the step only on the ranks of the params' mesh."
        )
    span: tuple[bool | None, ...] = (True,) * mesh.ndim
    if group is not None and len(_group_ranks(group)) != dist.get_world_size():
        span = _span(mesh, group)
    counted = True
    for dim, placement in enumerate(x.placements):
        if placement.is_partial():
            raise ValueError(
                f"{where()!r}: a DTensor with a Partial placement on mesh dimension {dim} "
                f"({tuple(x.placements)}); its local values are summands of an unreduced "
                f"tensor, so statistics of its elements cannot be computed locally. Fix: "
                f"reduce it first, e.g. x.redistribute(placements=[Replicate()] * "
                f"x.device_mesh.ndim) or [Shard(0)] (FSDP2 already hands reduced gradients)."
            )
        if span[dim] is None:
            raise ValueError(
                f"{where()!r}: the process group holds some but not all ranks along mesh "
                f"dimension {dim} of {mesh}; a sum over it counts neither each copy once nor "
                f"every shard. Fix: pass a group spanning whole mesh dimensions, or None to "
                f"infer it from the mesh."
            )
        if not span[dim] and not placement.is_replicate():
            raise ValueError(
                f"{where()!r} is sharded ({placement!r}) along mesh dimension {dim} of {mesh}, "
                f"whose other ranks are not in the process group: a sum over the group would "
                f"leave their shards out. Fix: pass a group that spans that dimension (or "
                f"None to infer it from the mesh)."
            )
        if span[dim] and placement.is_replicate() and coordinate[dim] != 0:
            counted = False
    return counted


def _plain_counted(entry: bool | dist.ProcessGroup, where: Callable[[], str],
                   group: dist.ProcessGroup) -> bool:
    if entry is False:
        return True
    if entry is True:
        return dist.get_rank(group) == 0
    if dist.get_rank(entry) < 0:
        raise ValueError(
            f"{where()!r}: declared replicated over a process group this rank "
            f"({dist.get_rank()}) is not in. Fix: give each rank the group of the ranks "
            f"that hold the same copy as it does."
        )
    if not _group_ranks(entry) <= _group_ranks(group):
        raise ValueError(
            f"{where()!r}: declared replicated over ranks {sorted(_group_ranks(entry))}, not "
            f"all in the process group summed over ({sorted(_group_ranks(group))}). Fix: "
            f"declare it over a subgroup of that group (or True: over all of it)."
        )
    return dist.get_rank(entry) == 0


@functools.lru_cache(maxsize=256)
def _ranks_of(mesh: DeviceMesh) -> frozenset[int]:
    return _mesh_ranks(mesh)


def _enclosing(leaves: Sequence[Any]) -> dict[frozenset[int], tuple[int, frozenset[int]]]:
    """For each mesh (by its ranks) of a DTensor leaf lying strictly inside the mesh of
    another DTensor leaf on this rank: (that other leaf, the union of the larger meshes)."""
    meshes: dict[frozenset[int], int] = {}
    for i, x in enumerate(leaves):
        if x is not None and is_dtensor(x):
            meshes.setdefault(_ranks_of(x.device_mesh), i)
    out: dict[frozenset[int], tuple[int, frozenset[int]]] = {}
    if len(meshes) < 2:
        return out
    for ranks in meshes:
        larger = [r for r in meshes if ranks < r]
        if larger:
            out[ranks] = (meshes[larger[0]], frozenset().union(*larger))
    return out


def _nested_counted(entry: _Entry, x: Any, where: Callable[[], str], other: str,
                    larger: frozenset[int]) -> bool:
    """Whether this rank counts the DTensor ``x``, whose mesh lies inside the larger mesh
    ``larger`` of the leaf ``other``, beyond what its placements say (its mesh's copies)."""
    ranks = _ranks_of(x.device_mesh)
    if entry is None:
        raise ValueError(
            f"{where()!r} is a DTensor on mesh {x.device_mesh} (ranks {sorted(ranks)}), inside "
            f"the mesh of {other!r} (ranks {sorted(larger)}); in a sum over a group it is "
            f"unclear whether the other ranks of that larger mesh hold copies of it (a param "
            f"left out of the tensor-parallel plan, which FSDP2 then shards over the data-"
            f"parallel sub-mesh only) or values of their own (experts on an expert-parallel "
            f"sub-mesh). Fix: declare it with replicated=True (copies: counted once, on the "
            f"copy holding rank {min(larger)}), replicated=False (values of their own), or "
            f"the process group over which its mesh repeats (e.g. mesh['tp'].get_group()); "
            f"or put it in the tensor-parallel plan."
        )
    if entry is False:
        return True
    if entry is True:
        return min(larger) in ranks
    if dist.get_rank(entry) < 0 or _group_ranks(entry) & ranks != {dist.get_rank()}:
        raise ValueError(
            f"{where()!r}: declared replicated over ranks {sorted(_group_ranks(entry))}, "
            f"which must cross its mesh {x.device_mesh} (ranks {sorted(ranks)}) in this rank "
            f"({dist.get_rank()}) alone: one rank of each copy of the mesh. Fix: pass the "
            f"group of the copies through this rank, e.g. mesh['tp'].get_group() for a "
            f"DTensor on mesh['dp']."
        )
    return dist.get_rank(entry) == 0


def _counting(owner: str, leaves: Sequence[Any], name: Callable[[int], str],
              group: dist.ProcessGroup | None, entries: Sequence[_Entry],
              ) -> tuple[dist.ProcessGroup | None, list[bool]]:
    """The group to sum over (``group``, or inferred from the DTensor leaves) and, per leaf,
    whether this rank counts it (``False`` for ``None`` leaves)."""
    explicit = group is not None
    if not explicit:
        group = _infer_group(leaves, name, lambda i: entries[i] is not None)
    nested = _enclosing(leaves) if explicit and _dtensor_class() is not None else {}
    counted: list[bool] = []
    for i, (x, entry) in enumerate(zip(leaves, entries, strict=True)):
        if x is None:
            counted.append(False)
        elif _dtensor_class() is not None and is_dtensor(x):
            here = _dtensor_counted(x, functools.partial(name, i), group if explicit else None)
            inside = nested.get(_ranks_of(x.device_mesh)) if nested else None
            if inside is not None:
                here = _nested_counted(entry, x, functools.partial(name, i), name(inside[0]),
                                       inside[1]) and here
            counted.append(here)
        elif group is None:
            counted.append(True)  # no DTensor, no group: whole on every rank, nothing summed
        elif entry is None:
            raise ValueError(
                f"{owner}: {name(i)!r} is a plain tensor in a sum over a process "
                f"group of {dist.get_world_size(group)} ranks; it is unclear whether every "
                f"rank holds the same values (count them once) or its own part (sum them). "
                f"{_HOW}"
            )
        else:
            counted.append(_plain_counted(entry, functools.partial(name, i), group))
    return group, counted


def _as_tensor_leaves(leaves: Sequence[Any], name: Callable[[int], str], owner: str) -> None:
    for i, g in enumerate(leaves):
        if g is not None and not isinstance(g, torch.Tensor):
            raise TypeError(
                f"{owner}: grads leaf {name(i)!r} is a {type(g).__name__}; expected a "
                f"tensor, a DTensor or None."
            )
