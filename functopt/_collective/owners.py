r"""Whole DTensors on one rank each, and the results back into their shards.

Some per-leaf maths needs the whole tensor, not a shard: Muon's Newton-Schulz iteration
multiplies the matrix by its transpose. Gathering every such leaf on every rank
(``full_tensor()``) makes each rank receive every matrix and compute every iteration. Here
each leaf has one *owner* rank (``assign_owners`` spreads the leaves by cost);
``gather_to_owners`` sends each rank's shard of a leaf to its owner only, and
``scatter_from_owners`` sends each rank its shard of the owner's result. Each is **one** ``all_to_all_single`` over bytes for all
leaves together (every dtype in one buffer), so a step makes two collectives whatever the
number of leaves, and a leaf's bytes cross the network at most once each way:

- gather: rank $q$ sends its shard of leaf $j$ to the owner $o_j$ unless $q = o_j$, the
  owner holds the same block (a copy along a ``Replicate()`` mesh dimension), or another
  copy of it is sent (only the copy at coordinate 0 of the replicated mesh dimensions is),
  so the owner receives $N_j - n_{j,o_j}$ elements of leaf $j$ ($N_j$ its elements,
  $n_{j,q}$ those in $q$'s shard).
- scatter: the owner sends every other rank its shard (copies included), so rank $q$
  receives $n_{j,q}$ elements of each leaf it does not own.

The placements read are ``Shard(d)``, ``Replicate()`` and FSDP2's strided shards (what
``fully_shard`` makes of a tensor-parallel param on a 2-D mesh), along each mesh dimension
of a mesh of any number of dimensions, as DTensor lays them out (``Shard`` splits like
``torch.chunk``). A shard is a product of runs of consecutive indices along each tensor
dimension (one run for ``Shard``), so it is cut and pasted with slices. ``Partial`` (and
any other placement) raises naming the leaf. The meshes of all leaves must span the same
ranks.
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


_Runs = tuple[tuple[int, int], ...]  # (global start, length) runs along one tensor dimension


def _take(runs: _Runs, lo: int, hi: int) -> _Runs:
    """Elements ``lo:hi`` of the index list that ``runs`` spell, as runs."""
    out: list[tuple[int, int]] = []
    pos = 0
    for start, n in runs:
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            if out and out[-1][0] + out[-1][1] == start + a - pos:
                out[-1] = (out[-1][0], out[-1][1] + b - a)
            else:
                out.append((start + a - pos, b - a))
        pos += n
    return tuple(out)


def _chunk(runs: _Runs, parts: int, index: int) -> _Runs:
    # torch.chunk's split, as DTensor's Shard: pieces of ceil(length / parts), the last ones
    # shorter or empty.
    length = sum(n for _, n in runs)
    size = -(-length // parts)
    lo = min(index * size, length)
    return _take(runs, lo, min(lo + size, length))


def _strided(runs: _Runs, split_factor: int, parts: int, index: int) -> _Runs:
    # FSDP2's _StridedShard (a dimension already split split_factor ways by a later mesh
    # dimension, then each piece split again here): piece ``index`` of every one of the
    # split_factor chunks, in order; contiguous when the later split is a plain Shard.
    pieces = [_chunk(_chunk(runs, split_factor, k), parts, index) for k in range(split_factor)]
    joined = tuple(r for piece in pieces for r in piece)
    return _take(joined, 0, sum(n for _, n in joined))  # merges adjacent runs


@functools.lru_cache(maxsize=1024)
def _grid_blocks(shape: tuple[int, ...], grid: tuple[int, ...],
                 placements: tuple[Any, ...]) -> tuple[tuple[tuple[_Runs, ...], bool], ...]:
    """Per coordinate of a mesh of shape ``grid`` (row-major): the runs of the global tensor
    it holds along each dimension, and whether it sends them (False for a copy of what a
    rank at a lower coordinate of a replicated mesh dimension sends)."""
    from torch.distributed.tensor import Shard  # imported once DTensors exist

    out = []
    for coordinate in _coordinates(grid):
        runs: list[_Runs] = [((0, n),) if n else () for n in shape]
        sends = True
        for dim, placement in enumerate(placements):
            if placement.is_replicate():
                sends = sends and coordinate[dim] == 0
                continue
            d = placement.dim % len(shape)
            if type(placement) is Shard:
                runs[d] = _chunk(runs[d], grid[dim], coordinate[dim])
            else:  # _StridedShard, checked by the caller
                runs[d] = _strided(runs[d], int(placement.split_factor), grid[dim],
                                   coordinate[dim])
        out.append((tuple(runs), sends))
    return tuple(out)


def _blocks(x: Any, where: Callable[[], str]) -> tuple[tuple[tuple[_Runs, ...], bool], ...]:
    """Per rank of ``x``'s mesh, in mesh order: the runs of the global tensor its shard holds
    along each dimension, and whether it sends them (see ``_grid_blocks``)."""
    from torch.distributed.tensor import Shard  # imported once DTensors exist

    for dim, placement in enumerate(x.placements):
        strided = type(placement).__name__ == "_StridedShard" and hasattr(placement,
                                                                           "split_factor")
        if not (placement.is_replicate() or type(placement) is Shard or strided):
            raise ValueError(
                f"{where()!r}: placement {placement!r} on mesh dimension {dim} of "
                f"{x.device_mesh}; the whole tensor can be gathered from Shard(d), FSDP2's "
                f"strided shards and Replicate() placements only. Fix: redistribute it first "
                f"(x.redistribute(placements=[Shard(0)] * mesh.ndim))."
            )
    return _grid_blocks(tuple(x.shape), tuple(x.device_mesh.mesh.shape), tuple(x.placements))


def _shape(runs: tuple[_Runs, ...]) -> tuple[int, ...]:
    return tuple(sum(n for _, n in r) for r in runs)


def _regions(runs: tuple[_Runs, ...]) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
    """``(global region, local region)`` pairs, one per product of runs: the shard's
    elements sit at ``whole[global]`` and ``local[local]``."""
    pairs: list[tuple[tuple[slice, ...], tuple[slice, ...]]] = [((), ())]
    for dim_runs in runs:
        step: list[tuple[slice, slice]] = []
        pos = 0
        for start, n in dim_runs:
            step.append((slice(start, start + n), slice(pos, pos + n)))
            pos += n
        pairs = [((*g, gs), (*loc, ls)) for g, loc in pairs for gs, ls in step]
    return pairs


def _coordinates(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    coords: list[tuple[int, ...]] = [()]
    for n in shape:
        coords = [(*c, i) for c in coords for i in range(n)]
    return coords


@functools.lru_cache(maxsize=64)
def _group_ranks_of(mesh: Any, group: dist.ProcessGroup) -> tuple[int, ...]:
    """The rank in ``group`` of each rank of ``mesh``, in mesh order."""
    return tuple(dist.get_group_rank(group, int(r)) for r in mesh.mesh.reshape(-1))


_Row = list[tuple[tuple[_Runs, ...], bool]]  # per group rank: its runs, whether it sends


def _layout(leaves: Sequence[Any], name: Callable[[int], str],
            group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, list[_Row]]:
    """The group and, per leaf, per group rank: ``(runs, sends)`` of that rank's shard."""
    if group is None:
        group = _infer_group(leaves, name)
    if group is None:
        raise ValueError("gather_to_owners: no DTensor leaf; plain tensors are already whole.")
    world = dist.get_world_size(group)
    per_leaf: list[_Row] = []
    for j, x in enumerate(leaves):
        if not is_dtensor(x):
            raise TypeError(f"{name(j)!r}: expected a DTensor, got {type(x).__name__}.")
        ranks = _group_ranks_of(x.device_mesh, group)
        row: list[Any] = [None] * world
        for r, block in zip(ranks, _blocks(x, functools.partial(name, j)), strict=True):
            row[r] = block
        expected = _shape(row[dist.get_rank(group)][0])
        if tuple(x.to_local().shape) != expected:
            raise ValueError(
                f"{name(j)!r}: this rank's shard has shape {tuple(x.to_local().shape)} but its "
                f"placements {tuple(x.placements)} give {expected}; the shards are not laid "
                f"out as DTensor lays them out. Fix: build it with distribute_tensor or "
                f"fully_shard."
            )
        per_leaf.append(row)
    return group, per_leaf


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(buf: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    if buf.storage_offset() % dtype.itemsize:  # views need aligned storage
        buf = buf.clone()
    return buf.view(dtype).reshape(tuple(shape))


def _put(whole: torch.Tensor, runs: tuple[_Runs, ...], local: torch.Tensor) -> None:
    """Write a shard (laid out as ``runs`` say) into the whole tensor."""
    for g, loc in _regions(runs):
        whole[g] = local[loc]


def _cut(whole: torch.Tensor, runs: tuple[_Runs, ...]) -> torch.Tensor:
    """The shard that ``runs`` spell, read out of the whole tensor (contiguous)."""
    regions = _regions(runs)
    if len(regions) == 1:
        return whole[regions[0][0]].contiguous()
    local = whole.new_empty(_shape(runs))
    for g, loc in regions:
        local[loc] = whole[g]
    return local


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


def _moves(owners: Sequence[int], layout: list[_Row]) -> bool:
    """Whether any rank holds a piece of a leaf it does not own (the same answer on every
    rank, so that all of them make the collective or none does)."""
    return any(q != owner and math.prod(_shape(runs)) > 0
               for owner, row in zip(owners, layout, strict=True)
               for q, (runs, _) in enumerate(row))


def _sends(row: _Row, q: int, owner: int) -> bool:
    """Whether rank ``q`` sends its shard to ``owner``: one copy of each block (the one at
    coordinate 0 of the replicated mesh dimensions), and none of the owner's own block."""
    runs, first_copy = row[q]
    return q != owner and first_copy and runs != row[owner][0] and math.prod(_shape(runs)) > 0


def gather_to_owners(leaves: Sequence[Any], owners: Sequence[int], *,
                     names: Callable[[int], str] = str,
                     group: dist.ProcessGroup | None = None) -> list[torch.Tensor | None]:
    """For each DTensor leaf, its whole value (a plain tensor) on its owner, ``None`` elsewhere.

    One ``all_to_all_single`` for all leaves (none if every leaf lives on its owner). The
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
        if owner != me and _sends(row, me, owner):
            send[owner].append(_as_bytes(x.to_local()))
        if owner == me:
            for q, (runs, _) in enumerate(row):
                if _sends(row, q, owner):
                    recv[q] += math.prod(_shape(runs)) * x.dtype.itemsize
    device = leaves[0].to_local().device
    received = _exchange(send, recv, group, device) if _moves(owners, layout) else None
    cursor = [sum(recv[:q]) for q in range(world)]
    out: list[torch.Tensor | None] = []
    for x, owner, row in zip(leaves, owners, layout, strict=True):
        if owner != me:
            out.append(None)
            continue
        whole = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.to_local().device)
        for q, (runs, _) in enumerate(row):
            if q == me:
                _put(whole, runs, x.to_local())
            elif _sends(row, q, owner):
                size = math.prod(_shape(runs)) * x.dtype.itemsize
                assert received is not None
                piece = received[cursor[q]:cursor[q] + size]
                cursor[q] += size
                _put(whole, runs, _from_bytes(piece, x.dtype, _shape(runs)))
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
            for q, (runs, _) in enumerate(row):
                if q != me:
                    send[q].append(_as_bytes(_cut(value, runs)))
        else:
            recv[owner] += math.prod(_shape(row[me][0])) * dtype.itemsize
    device = like[0].to_local().device
    received = _exchange(send, recv, group, device) if _moves(owners, layout) else None
    cursor = [sum(recv[:q]) for q in range(world)]
    out: list[Any] = []
    for value, x, owner, row, dtype in zip(values, like, owners, layout, dtypes, strict=True):
        runs = row[me][0]
        if owner == me:
            assert value is not None
            local = _cut(value, runs)
        else:
            size = math.prod(_shape(runs)) * dtype.itemsize
            assert received is not None
            local = _from_bytes(received[cursor[owner]:cursor[owner] + size], dtype,
                                _shape(runs))
            cursor[owner] += size
        out.append(_rewrap_like(x, local.to(x.to_local().device)))
    return out
