"""The program engine on DTensor shards: collectives per step == the program's barriers.

Run on gloo ranks by tests/laws/test_program.py. Each check steps a chain's program with
the eager executor on ``Shard(0)`` DTensor params of a 1-D mesh over every rank, counts the
step's collectives with ``CommDebugMode`` and compares the new params with the pure step
on the same DTensors.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import functopt as F
from distributed.harness import check_registry, run_checks
from functopt.fast._execute import execute
from functopt.fast._program import compile_program
from functopt.tree import _core

CHECKS, check = check_registry()


def run_all(rank: int, world: int) -> dict[str, str | None]:
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.*")
    return run_checks(CHECKS, rank, world)


def _labels(p: Any) -> dict[str, str]:
    return {"a": "adam", "b": "sgd", "c": "adam", "d": "sgd"}


# (name, the transform, the barriers its program has)
CHAINS: list[tuple[str, Callable[[], Any], int]] = [
    ("adamw", lambda: F.adamw(1e-2), 0),
    ("clip before", lambda: F.chain(F.clip_by_global_norm(1.0), F.adamw(1e-2)), 1),
    ("clip after", lambda: F.chain(F.adamw(1e-2), F.clip_by_global_norm(0.05)), 1),
    ("two clips", lambda: F.chain(F.clip_by_global_norm(2.0), F.scale_by_lion(),
                                  F.clip_by_global_norm(0.5), F.scale(-0.1)), 2),
    ("clip in guard", lambda: F.apply_if_finite(
        F.chain(F.clip_by_global_norm(1.0), F.adam(1e-2)), 1), 1),
    ("partition", lambda: F.partition(
        {"adam": F.chain(F.clip_by_global_norm(1.0), F.adam(1e-2)), "sgd": F.sgd(0.1)},
        _labels), 1),
]


def _params(world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    full = {"a": torch.randn(5, 3, generator=gen), "b": torch.randn(7, generator=gen),
            "c": torch.randn(3, generator=gen), "d": torch.randn(4, 4, generator=gen)}
    return {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}


def _grads(params: dict[str, Any], k: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(k + 1)
    return {n: distribute_tensor(torch.randn(p.shape, generator=gen) * 3, p.device_mesh,
                                 p.placements) for n, p in params.items()}


def _checked(factory: Callable[[], Any], barriers: int, world: int) -> None:
    tx, params = factory(), _params(world)
    param_leaves, treespec = _core.flatten(params)
    state = tx.init(params)
    state_leaves, state_spec = _core.flatten(state)
    program = compile_program(tx, params, treespec, param_leaves, state_leaves, state_spec)
    assert program.reason is None, program.reason
    assert program.barriers == barriers, program.barriers
    pure_params, pure_state = params, state
    for k in range(2):
        grads = _grads(params, k)
        with CommDebugMode() as comm:
            params, state = execute(program, grads, state, params)
        assert comm.get_total_counts() == barriers, comm.get_comm_counts()
        updates, pure_state = tx.update(grads, pure_state, pure_params)
        pure_params = F.apply_updates(pure_params, updates)
        for n in params:
            torch.testing.assert_close(params[n].full_tensor(), pure_params[n].full_tensor(),
                                       rtol=1e-6, atol=1e-7)


for _name, _factory, _barriers in CHAINS:
    def _one(rank: int, world: int, factory: Any = _factory, barriers: int = _barriers,
             ) -> None:
        _checked(factory, barriers, world)

    _one.__name__ = _name
    check(_one)
