"""Rank-side checks of the integrity record of checkpoint dicts, on 2 gloo ranks.

A torn checkpoint is made as a save that dies does it: a DCP save of step 3, then a save of
step 6 into the same ``checkpoint_id`` whose writer raises on rank 1 before writing its
file. Rank 0's file then holds step 6, rank 1's file step 3, and the metadata (written
last, after every rank wrote) is step 3's, whose offsets fit both files: ``dcp.load``
reads rank 0's shards of step 6 and rank 1's of step 3 without an error. The checks load
that checkpoint with ``state_from_dict`` (sharded ``mixed_precision`` state on DTensor
params) and with ``zero1_state_from_dict``, and expect the error on every rank.

Each launch function returns ``{check name: None or the failure's traceback}``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import functopt
from distributed import harness
from distributed import zero_checkpoint_checks as zc
from distributed.checkpoint_checks import (
    _facade,
    _facade_steps,
    _full_params,
    _functional_steps,
    _transform,
)
from distributed.checks import _assert_tree, _mesh, _mlp, _shard
from functopt import distributed as fdist
from functopt.distributed._integrity import RECORD_KEY

TORN = r"do not match the integrity record saved with them"
SAVED, LATER = 3, 6


class _DiesOnRank1(FileSystemWriter):
    """A filesystem writer whose rank 1 dies before writing its data file."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 killed while saving")
        return super().write_data(plan, planner)


def _torn_save(path: str, first: dict[str, Any], second: dict[str, Any]) -> None:
    dcp.save(first, checkpoint_id=path)
    with pytest.raises(CheckpointException) as died:  # DCP re-raises rank 1's error on all
        dcp.save(second, storage_writer=_DiesOnRank1(path))
    assert "rank 1 killed while saving" in repr(died.value.failures)




def _dtensor_params() -> tuple[Any, dict[str, Any]]:
    mesh = _mesh(dist.get_world_size())
    return mesh, {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _full_params().items()}


def _functional(steps: int) -> tuple[dict[str, Any], Any]:
    mesh, params = _dtensor_params()
    return _functional_steps(params, _transform().init(params), range(steps), mesh)


def _template() -> tuple[Any, dict[str, Any]]:
    _, params = _dtensor_params()
    template = _transform().init(params)
    return template, {"opt": fdist.state_to_dict(template, params)}


def _adapter_steps(model: torch.nn.Module, opt: Any, steps: range) -> None:
    if isinstance(opt, functopt.MixedPrecisionOptimizer):
        _facade_steps(model, opt, steps)
        return
    for step in steps:
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
            full = torch.randn(p.shape, generator=g).to(p.dtype)
            p.grad = distribute_tensor(full, p.device_mesh, p.placements)
        opt.step()
        opt.zero_grad()


def run_all(rank: int, world: int, path: str) -> dict[str, str | None]:
    intact = os.path.join(path, "intact")

    def torn_functional_raises_on_every_rank() -> None:
        where = os.path.join(path, "torn_functional")
        params3, state3 = _functional(SAVED)
        params6, state6 = _functional(LATER)
        _torn_save(where, {"opt": fdist.state_to_dict(state3, params3)},
                   {"opt": fdist.state_to_dict(state6, params6)})
        template, loaded = _template()
        dcp.load(loaded, checkpoint_id=where)  # no error from DCP: a mix of steps 6 and 3
        master = {k: v for k, v in loaded["opt"].items() if k.startswith("master.")}
        mine = [state6, state3][rank].master
        assert all(torch.equal(v.to_local(), mine[k[len("master."):]].to_local())
                   for k, v in master.items()), "the checkpoint is not the mix it should be"
        with pytest.raises(ValueError, match=TORN + r".*'master\.0\.weight'"):
            fdist.state_from_dict(loaded["opt"], template)

    def torn_adapters_raise_on_every_rank() -> None:
        """The facade and functopt.Optimizer as DCP ``Stateful`` objects on FSDP2, saved and
        loaded as the docs show."""
        mesh = _mesh(world)
        builders = {"facade": _facade,
                    "optimizer": lambda m: functopt.Optimizer(m.parameters(),
                                                              functopt.adamw(1e-2))}
        for name, build in builders.items():
            where = os.path.join(path, f"torn_{name}")
            model3, model6 = (_shard(_mlp(torch.bfloat16), mesh),
                              _shard(_mlp(torch.bfloat16), mesh))
            opt3, opt6 = build(model3), build(model6)
            _adapter_steps(model3, opt3, range(SAVED))
            _adapter_steps(model6, opt6, range(LATER))
            _torn_save(where, {"optim": opt3}, {"optim": opt6})
            opt = build(_shard(_mlp(torch.bfloat16), mesh))
            with pytest.raises(ValueError, match=TORN + r".*'0(\.weight)?/"):
                dcp.load({"optim": opt}, checkpoint_id=where)
            intact = os.path.join(path, f"intact_{name}")
            dcp.save({"optim": opt3}, checkpoint_id=intact)
            dcp.load({"optim": opt}, checkpoint_id=intact)  # intact: loads, as saved
            _assert_tree(opt.state_dict()["state"], opt3.state_dict()["state"])

    def torn_zero1_raises_on_every_rank() -> None:
        where = os.path.join(path, "torn_zero1")
        opt = zc._zero1("pure")
        params = zc._params()
        p3, s3 = zc._train(opt, params, opt.init(params), range(SAVED))
        p6, s6 = zc._train(opt, p3, s3, range(SAVED, LATER))
        _torn_save(where, {"opt": fdist.zero1_state_to_dict(s3, p3)},
                   {"opt": fdist.zero1_state_to_dict(s6, p6)})
        zeros = {k: None if p is None else torch.zeros_like(p) for k, p in params.items()}
        template = opt.init(zeros)
        loaded = {"opt": fdist.zero1_state_to_dict(template, zeros)}
        dcp.load(loaded, checkpoint_id=where)
        mine = [s6, s3][rank]
        assert torch.equal(loaded["opt"]["master.w"].to_local(), mine.master["w"])
        with pytest.raises(ValueError, match=TORN + r".*'inner_state\.0\.mu\.w'"):
            fdist.zero1_state_from_dict(loaded["opt"], template, zeros)

    def intact_loads_bitwise() -> None:
        params, state = _functional(SAVED)
        dcp.save({"opt": fdist.state_to_dict(state, params)}, checkpoint_id=intact)
        template, loaded = _template()
        dcp.load(loaded, checkpoint_id=intact)
        _assert_tree(fdist.state_from_dict(loaded["opt"], template), state)

    def one_changed_element_on_one_rank_raises_on_every_rank() -> None:
        template, loaded = _template()
        dcp.load(loaded, checkpoint_id=intact)
        if rank == 1:
            x = loaded["opt"]["inner_state.0.nu.0.weight"].to_local()
            x.view(-1)[3] = torch.nextafter(x.view(-1)[3], torch.tensor(float("inf")))
        with pytest.raises(ValueError, match=TORN + r".*'inner_state\.0\.nu\.0\.weight'"):
            fdist.state_from_dict(loaded["opt"], template)

    def swapped_elements_raise() -> None:
        template, loaded = _template()
        dcp.load(loaded, checkpoint_id=intact)
        if rank == 0:
            x = loaded["opt"]["master.0.weight"].to_local().view(-1)
            assert not torch.equal(x[0], x[1])
            x[[0, 1]] = x[[1, 0]]
        with pytest.raises(ValueError, match=TORN + r".*'master\.0\.weight'"):
            fdist.state_from_dict(loaded["opt"], template)

    def error_on_one_rank_raises_on_every_rank() -> None:
        template, loaded = _template()
        dcp.load(loaded, checkpoint_id=intact)
        d = dict(loaded["opt"])
        if rank == 1:
            del d["master.0.weight"]  # this rank cannot rebuild: the other must not wait
        match = (r"missing keys \['master\.0\.weight'\]" if rank == 1
                 else r"did not match the template on rank\(s\) \[1\]")
        with pytest.raises(ValueError, match=match):
            fdist.state_from_dict(d, template)

    def saved_without_record_loads() -> None:
        where = os.path.join(path, "without_record")
        params, state = _functional(SAVED)
        d = fdist.state_to_dict(state, params)
        del d[RECORD_KEY]
        dcp.save({"opt": d}, checkpoint_id=where)
        template, loaded = _template()
        del loaded["opt"][RECORD_KEY]  # DCP raises on a template key the checkpoint lacks
        dcp.load(loaded, checkpoint_id=where)
        _assert_tree(fdist.state_from_dict(loaded["opt"], template), state)

    def placements_reshard_and_verify() -> None:
        """Blocks that are not contiguous in the global tensor (``Shard(1)``, a 2-D mesh
        with a replicated dimension) are checked element by element after another split."""
        mesh = _mesh(world)
        mesh2 = init_device_mesh("cpu", (1, world))
        g = torch.Generator().manual_seed(5)
        full = {"cols": torch.randn(6, 5, generator=g), "rows": torch.randn(7, 3, generator=g),
                "rep": torch.randn(4, generator=g), "mesh2": torch.randn(3, 4, generator=g)}
        saved = {"cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
                 "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
                 "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
                 "mesh2": distribute_tensor(full["mesh2"], mesh2, [Replicate(), Shard(1)])}
        where = os.path.join(path, "placements")
        dcp.save({"s": fdist.state_to_dict(saved)}, checkpoint_id=where)
        template = {"cols": distribute_tensor(torch.zeros(6, 5), mesh, [Shard(0)]),
                    "rows": distribute_tensor(torch.zeros(7, 3), mesh, [Shard(1)]),
                    "rep": distribute_tensor(torch.zeros(4), mesh, [Shard(0)]),
                    "mesh2": distribute_tensor(torch.zeros(3, 4), mesh2, [Shard(1), Shard(0)])}
        loaded = {"s": fdist.state_to_dict(template)}
        dcp.load(loaded, checkpoint_id=where)
        back = fdist.state_from_dict(loaded["s"], template)
        assert all(torch.equal(back[k].full_tensor(), full[k]) for k in full)
        if rank == 1:
            back["cols"].to_local().view(-1)[-1] += 1.0
        with pytest.raises(ValueError, match=TORN + r".*\['cols'"):
            fdist.state_from_dict(loaded["s"], template)

    return harness.run_named({f.__name__: f for f in (
        torn_functional_raises_on_every_rank, torn_zero1_raises_on_every_rank,
        torn_adapters_raise_on_every_rank, intact_loads_bitwise, one_changed_element_on_one_rank_raises_on_every_rank,
        swapped_elements_raise, error_on_one_rank_raises_on_every_rank,
        saved_without_record_loads, placements_reshard_and_verify)})


def load_single_process_save(rank: int, world: int, path: str) -> dict[str, str | None]:
    """Load on 2 ranks (DTensor shards) a checkpoint saved by one process (plain tensors)."""

    def one_to_two_ranks_verifies() -> None:
        template, loaded = _template()
        dcp.load(loaded, checkpoint_id=os.path.join(path, "single"))
        state = fdist.state_from_dict(loaded["opt"], template)
        _, expected = _functional(SAVED)
        assert all(isinstance(v, DTensor) for v in state.master.values() if v is not None)
        _assert_tree(state, expected)

    return harness.run_named({"one_to_two_ranks_verifies": one_to_two_ranks_verifies})


__all__ = ["SAVED", "load_single_process_save", "run_all"]
