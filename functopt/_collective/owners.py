r"""Whole DTensors on one rank each, and the results back into their shards.

Some per-leaf maths needs the whole tensor, not a shard: Muon's Newton-Schulz iteration
multiplies the matrix by its transpose. Gathering every such leaf on every rank
(``full_tensor()``) makes each rank receive every matrix and compute every iteration. Here
each leaf has one *owner* rank ([`assign_owners`][functopt._collective.owners.assign_owners]
spreads the leaves by cost); [`gather_to_owners`][functopt._collective.owners.gather_to_owners]
sends each rank's shard of a leaf to its owner only, and
[`scatter_from_owners`][functopt._collective.owners.scatter_from_owners] sends each rank its
shard of the owner's result. Each is **one** ``all_to_all_single`` over bytes for all
leaves together (every dtype in one buffer), so a step makes two collectives whatever the
number of leaves, and a leaf's bytes cross the network at most once each way:

- gather: rank $q$ sends its shard of leaf $j$ to the owner $o_j$ unless $q = o_j$ or $q$
  holds a copy that another rank already sends (``Replicate()`` along a mesh dimension:
  only coordinate 0 sends), so the owner receives $N_j - n_{j,o_j}$ elements of leaf $j$
  ($N_j$ its elements, $n_{j,q}$ those in $q$'s shard).
- scatter: the owner sends every other rank its shard (copies included), so rank $q$
  receives $n_{j,q}$ elements of each leaf it does not own.

The placements read are ``Shard(d)`` and ``Replicate()`` along each mesh dimension
(several mesh dimensions, several on one tensor dimension; ``Shard`` splits like
``torch.chunk``). Other placements (``Partial``, FSDP2's strided shards of a 2-D mesh)
raise naming the leaf. The meshes of all leaves must span the same ranks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from functopt._collective.dtensor import _infer_group, _rewrap_like, is_dtensor

__all__ = ["assign_owners", "gather_to_owners", "scatter_from_owners"]

_Block = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape) in the global tensor


def assign_owners(costs: Sequence[float], world: int) -> list[int]:
    """An owner rank in ``range(world)`` for each cost: the costliest first, each to the
    least loaded rank so far (ties to the lower rank). The same costs give the same owners
    on every rank, with no communication.

    Examples:
        >>> from functopt._collective.owners import assign_owners
        >>> assign_owners([4.0, 1.0, 3.0, 2.0], 2)  # loads 4 + 1 and 3 + 2
        [0, 0, 1, 1]
    """
    load = [0.0] * world
    owners = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[j] = rank
        load[rank] += costs[j]
    return owners


def _chunk(start: int, length: int, parts: int, index: int) -> tuple[int, int]:
    # torch.chunk's split, as DTensor's Shard: pieces of ceil(length / parts), the last ones
    # shorter or empty.
    size = -(-length // parts) if length else 0
    lo = min(index * size, length)
    return start + lo, max(0, min(size, length - lo))


def _blocks(x: Any, where: Callable[[], str]) -> list[tuple[_Block, bool]]:
    """Per rank of ``x``'s mesh, in mesh order: its block of the global tensor, and whether it
    sends it (False for a copy of a block that a rank with a lower coordinate sends)."""
    from torch.distributed.tensor import Shard  # imported once DTensors exist

    mesh = x.device_mesh
    for dim, placement in enumerate(x.placements):
        # type(...) is Shard: FSDP2's _StridedShard subclasses Shard but splits otherwise
        if not (placement.is_replicate() or type(placement) is Shard):
            raise ValueError(
                f"{where()!r}: placement {placement!r} on mesh dimension {dim} of {mesh}; the "
                f"whole tensor can be gathered from Shard(d) and Replicate() placements only. "
                f"Fix: redistribute it first (x.redistribute(placements=[Shard(0)])), or keep "
                f"it off a strided (2-D FSDP) layout."
            )
    grid = mesh.mesh
    out: list[tuple[_Block, bool]] = []
    for coordinate in _coordinates(tuple(grid.shape)):
        start = [0] * x.dim()
        length = list(x.shape)
        sends = True
        for dim, placement in enumerate(x.placements):
            if placement.is_replicate():
                sends = sends and coordinate[dim] == 0
                continue
            d = placement.dim % x.dim()
            start[d], length[d] = _chunk(start[d], length[d], grid.shape[dim], coordinate[dim])
        out.append(((tuple(start), tuple(length)), sends))
    return out


def _coordinates(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    coords: list[tuple[int, ...]] = [()]
    for n in shape:
        coords = [(*c, i) for c in coords for i in range(n)]
    return coords


def _layout(leaves: Sequence[Any], name: Callable[[int], str],
            group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, list[list[Any]]]:
    """The group and, per leaf, per group rank: ``(block, sends)`` of that rank."""
    if group is None:
        group = _infer_group(leaves, name)
    if group is None:
        raise ValueError("gather_to_owners: no DTensor leaf; plain tensors are already whole.")
    world = dist.get_world_size(group)
    per_leaf: list[list[Any]] = []
    for j, x in enumerate(leaves):
        if not is_dtensor(x):
            raise TypeError(f"{name(j)!r}: expected a DTensor, got {type(x).__name__}.")
        ranks = [dist.get_group_rank(group, int(r)) for r in x.device_mesh.mesh.reshape(-1)]
        blocks = _blocks(x, functools.partial(name, j))
        row: list[Any] = [None] * world
        for r, block in zip(ranks, blocks, strict=True):
            row[r] = block
        mine = row[dist.get_rank(group)]
        if tuple(x.to_local().shape) != mine[0][1]:
            raise ValueError(
                f"{name(j)!r}: this rank's shard has shape {tuple(x.to_local().shape)} but its "
                f"placements {tuple(x.placements)} give {mine[0][1]}; the shards are not laid "
                f"out like torch.chunk. Fix: build it with distribute_tensor or fully_shard."
            )
        per_leaf.append(row)
    return group, per_leaf


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(buf: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    if buf.storage_offset() % dtype.itemsize:  # views need aligned storage
        buf = buf.clone()
    return buf.view(dtype).reshape(tuple(shape))


def _exchange(send: list[list[torch.Tensor]], recv_sizes: list[int],
              group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """One ``all_to_all_single``: ``send[r]`` (byte tensors) to rank ``r``; the received
    bytes, from rank 0 on, ``recv_sizes[r]`` from rank ``r``."""
    parts = [p for per_rank in send for p in per_rank]
    buf = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, buf, output_split_sizes=recv_sizes,
                           input_split_sizes=[sum(p.numel() for p in s) for s in send],
                           group=group)
    return out


def _moves(owners: Sequence[int], layout: list[list[Any]]) -> bool:
    """Whether any rank holds a piece of a leaf it does not own (the same answer on every
    rank, so that all of them make the collective or none does)."""
    return any(q != owner and math.prod(block[1]) > 0
               for owner, row in zip(owners, layout, strict=True)
               for q, (block, _) in enumerate(row))


def _region(block: _Block) -> tuple[slice, ...]:
    return tuple(slice(s, s + n) for s, n in zip(block[0], block[1], strict=True))


def gather_to_owners(leaves: Sequence[Any], owners: Sequence[int], *,
                     names: Callable[[int], str] = str,
                     group: dist.ProcessGroup | None = None) -> list[torch.Tensor | None]:
    """For each DTensor leaf, its whole value (a plain tensor) on its owner, ``None`` elsewhere.

    One ``all_to_all_single`` for all leaves (none if every leaf lives on one rank). The
    ranks must all call it with the same leaves (the same global shapes and placements)
    and owners.

    Args:
        leaves: DTensors on meshes spanning the same ranks.
        owners: each leaf's owner, a rank of ``group``.
        names: ``j -> leaf j's path``, for error messages.
        group: the group of the meshes' ranks (default: inferred from the leaves).
    """
    group, layout = _layout(leaves, names, group)
    me, world = dist.get_rank(group), dist.get_world_size(group)
    send: list[list[torch.Tensor]] = [[] for _ in range(world)]
    recv = [0] * world
    for x, owner, row in zip(leaves, owners, layout, strict=True):
        (_, _), sends = row[me]
        if sends and owner != me:
            send[owner].append(_as_bytes(x.to_local()))
        if owner == me:
            for q, ((_, shape), q_sends) in enumerate(row):
                if q_sends and q != me:
                    recv[q] += math.prod(shape) * x.dtype.itemsize
    device = leaves[0].to_local().device if leaves else torch.device("cpu")
    received = _exchange(send, recv, group, device) if _moves(owners, layout) else None
    cursor = [sum(recv[:q]) for q in range(world)]
    out: list[torch.Tensor | None] = []
    for x, owner, row in zip(leaves, owners, layout, strict=True):
        if owner != me:
            out.append(None)
            continue
        whole = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.to_local().device)
        for q, (block, q_sends) in enumerate(row):
            if q == me:
                whole[_region(block)] = x.to_local()
            elif q_sends:
                size = math.prod(block[1]) * x.dtype.itemsize
                assert received is not None
                piece = received[cursor[q]:cursor[q] + size]
                cursor[q] += size
                whole[_region(block)] = _from_bytes(piece, x.dtype, block[1])
        out.append(whole)
    return out


def scatter_from_owners(values: Sequence[torch.Tensor | None], like: Sequence[Any],
                        owners: Sequence[int], dtypes: Sequence[torch.dtype], *,
                        names: Callable[[int], str] = str,
                        group: dist.ProcessGroup | None = None) -> list[Any]:
    """For each leaf, the owner's whole ``values[j]`` as a DTensor placed like ``like[j]``.

    ``values[j]`` is a plain tensor of ``like[j]``'s global shape and dtype ``dtypes[j]`` on
    the owner (``None`` elsewhere). One ``all_to_all_single`` for all leaves; each rank's
    shard is the owner's values bitwise.
    """
    group, layout = _layout(like, names, group)
    me, world = dist.get_rank(group), dist.get_world_size(group)
    send: list[list[torch.Tensor]] = [[] for _ in range(world)]
    recv = [0] * world
    for value, owner, row, dtype in zip(values, owners, layout, dtypes, strict=True):
        if owner == me:
            assert value is not None, "the owner holds the whole value"
            for q, (block, _) in enumerate(row):
                if q != me:
                    send[q].append(_as_bytes(value[_region(block)]))
        else:
            recv[owner] += math.prod(row[me][0][1]) * dtype.itemsize
    device = like[0].to_local().device if like else torch.device("cpu")
    received = _exchange(send, recv, group, device) if _moves(owners, layout) else None
    cursor = [sum(recv[:q]) for q in range(world)]
    out: list[Any] = []
    for value, x, owner, row, dtype in zip(values, like, owners, layout, dtypes, strict=True):
        block = row[me][0]
        if owner == me:
            assert value is not None
            local = value[_region(block)].contiguous()
        else:
            size = math.prod(block[1]) * dtype.itemsize
            assert received is not None
            local = _from_bytes(received[cursor[owner]:cursor[owner] + size], dtype, block[1])
            cursor[owner] += size
        local = local.to(x.to_local().device)
        out.append(_rewrap_like(x, local))
    return out
