"""functopt._collective.owners without a process group: the owner rule and the shard layout.

The collectives themselves run on gloo ranks in tests/distributed/muon_checks.py; here the
two pure parts are held to their specifications on hypothesis inputs: ``assign_owners``
balances (greedy longest-first: no rank's load exceeds the mean by more than the largest
cost) and ``_blocks`` gives each rank the block PyTorch's DTensor gives it
(``_compute_local_shape_and_global_offset``, the function ``DTensor.from_local`` and
``distribute_tensor`` lay shards out with), the sending blocks tiling the tensor once.
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
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from functopt._collective.owners import _blocks, assign_owners


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
    placements = [draw(st.sampled_from([Replicate()] + [Shard(d) for d in range(len(shape))]))
                  for _ in mesh_shape]
    return shape, mesh_shape, placements


@given(_layouts())
def test_blocks_are_dtensors_shards_and_tile_the_tensor_once(layout: Any) -> None:
    shape, mesh_shape, placements = layout
    blocks = _blocks(_fake(shape, mesh_shape, placements), lambda: "w")
    coverage = torch.zeros(shape, dtype=torch.int64)
    coords = list(itertools.product(*(range(n) for n in mesh_shape)))
    assert len(blocks) == len(coords)
    for coordinate, ((offset, local), sends) in zip(coords, blocks, strict=True):
        ref_local, ref_offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coordinate), placements)
        assert local == tuple(ref_local), (coordinate, local, ref_local)
        if math.prod(local):  # an empty shard's offset is immaterial
            assert offset == tuple(ref_offset), (coordinate, offset, ref_offset)
        if sends:
            coverage[tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))] += 1
    assert bool((coverage == 1).all()), coverage


def test_blocks_refuse_a_partial_placement_by_name() -> None:
    with pytest.raises(ValueError, match=r"'layers\.0\.weight'.*Partial.*Fix"):
        _blocks(_fake((4, 4), (2,), [Partial()]), lambda: "layers.0.weight")
