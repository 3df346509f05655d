"""functopt._collective.owners without a process group: the owner rule and the shard layout.

The collectives themselves run on gloo ranks in tests/distributed/muon_checks.py; here the
two pure parts are held to their specifications on hypothesis inputs: ``assign_owners``
balances (greedy longest-first: no rank's load exceeds the mean by more than the largest
cost) and ``_blocks`` gives each rank the block PyTorch's DTensor gives it
(each placement's own ``_split_tensor``, with which ``distribute_tensor`` splits a tensor
mesh dimension by mesh dimension; FSDP2's strided shards included), the sending blocks
tiling the tensor once.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from functopt._collective.owners import _blocks, _cut, _put, _shape, assign_owners


@given(st.lists(st.floats(0.0, 1e6), max_size=30), st.integers(1, 8))
def test_assign_owners_balances_and_agrees_everywhere(costs: list[float], world: int) -> None:
    owners = assign_owners(costs, world)
    assert len(owners) == len(costs) and all(0 <= o < world for o in owners)
    assert owners == assign_owners(list(costs), world)  # a function of the costs alone
    load = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(world)]
    if costs:
        assert max(load) <= sum(costs) / world + max(costs) + 1e-6 * sum(costs)


def test_assign_owners_spreads_equal_costs_round_robin() -> None:
    assert assign_owners([1.0] * 5, 2) == [0, 1, 0, 1, 0]
    assert assign_owners([9.0, 1.0, 1.0, 1.0], 2) == [0, 1, 1, 1]


def _fake(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: list[Any]) -> Any:
    mesh = SimpleNamespace(mesh=torch.arange(math.prod(mesh_shape)).reshape(mesh_shape))
    return SimpleNamespace(device_mesh=mesh, placements=tuple(placements), shape=shape,
                           dim=lambda: len(shape))


@st.composite
def _layouts(draw: Any) -> tuple[tuple[int, ...], tuple[int, ...], list[Any]]:
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    kinds = [Replicate()] + [Shard(d) for d in range(len(shape))] + [
        _StridedShard(d, split_factor=f) for d in range(len(shape)) for f in (1, 2, 3)]
    placements = [draw(st.sampled_from(kinds)) for _ in mesh_shape]
    return shape, mesh_shape, placements


def _reference_shard(index: torch.Tensor, mesh_shape: tuple[int, ...],
                     placements: list[Any], coordinate: tuple[int, ...]) -> torch.Tensor:
    """The elements of ``index`` the rank at ``coordinate`` holds, split as
    ``distribute_tensor`` splits: mesh dimension by mesh dimension, with each placement's
    own ``_split_tensor``."""
    for dim, placement in enumerate(placements):
        if not placement.is_replicate():
            shards, _ = placement._split_tensor(index, mesh_shape[dim], with_padding=False)
            index = shards[coordinate[dim]]
    return index


@given(_layouts())
def test_blocks_are_dtensors_shards_and_tile_the_tensor_once(layout: Any) -> None:
    shape, mesh_shape, placements = layout
    blocks = _blocks(_fake(shape, mesh_shape, placements), lambda: "w")
    index = torch.arange(math.prod(shape)).reshape(shape)
    coverage = torch.zeros(shape, dtype=torch.int64)
    coords = list(itertools.product(*(range(n) for n in mesh_shape)))
    assert len(blocks) == len(coords)
    for coordinate, (runs, sends) in zip(coords, blocks, strict=True):
        expected = _reference_shard(index, mesh_shape, placements, coordinate)
        assert _shape(runs) == tuple(expected.shape), (coordinate, runs, expected.shape)
        assert torch.equal(_cut(index, runs), expected), (coordinate, runs)
        rebuilt = torch.full(shape, -1, dtype=torch.int64)
        _put(rebuilt, runs, expected)
        assert torch.equal(_cut(rebuilt, runs), expected)
        if sends:
            coverage += (rebuilt >= 0).to(torch.int64)
    assert bool((coverage == 1).all()), coverage


def test_fsdp_over_tensor_parallel_rows_are_contiguous() -> None:
    """fully_shard over ColwiseParallel on a (dp 2, tp 2) mesh: (_StridedShard(0, sf=2),
    Shard(0)) of 10 rows gives rank (i, j) rows 5 j + [0:3] (i = 0) or [3:5] (i = 1)."""
    blocks = _blocks(_fake((10, 6), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
                     lambda: "w")
    assert [runs[0] for runs, _ in blocks] == [((0, 3),), ((5, 3),), ((3, 2),), ((8, 2),)]


def test_blocks_refuse_a_partial_placement_by_name() -> None:
    with pytest.raises(ValueError, match=r"'layers\.0\.weight'.*Partial.*Fix"):
        _blocks(_fake((4, 4), (2,), [Partial()]), lambda: "layers.0.weight")
