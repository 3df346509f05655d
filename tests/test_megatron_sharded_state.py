"""``MixedPrecisionOptimizer.sharded_state_dict`` through megatron-core's ``dist_checkpointing``.

megatron-core 0.16.1's ``dist_checkpointing.save`` / ``load`` run on gloo ranks here;
their default writer calls ``torch.cuda.synchronize()`` and puts its failure flag on
``torch.cuda.current_device()``, which a CPU build cannot do, so the ranks replace those
two calls with a no-op and ``"cpu"`` (`_cpu_only`) and run megatron-core's code otherwise
as it is (its loader calls DCP's deprecated ``load_state_dict``: that warning is let pass).

The model is Megatron-style tensor parallel on plain tensors (no DTensor): a linear split
by rows over the TP ranks (its weight and bias, each rank its slice of the global
tensor), and a norm weight replicated over them. Gradients are synthetic, a function of
the step and the global param (each rank takes its slice), and the norm weight (a group of its
own) has none at the first step, so the groups' step counts differ. No clipping is done, so every step
is elementwise on the shards and a sharded run equals one process on whole tensors,
bitwise. Checked: saved on 2 TP ranks after ``SAVE`` steps, loaded on 2 and on 1 rank
(another sharding of the same global tensors), the run continued to ``STEPS``: equal to
the uninterrupted single-process run.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from distributed import harness

import functopt

with warnings.catch_warnings():  # without Transformer Engine and Apex it says so
    warnings.simplefilter("ignore")
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

SAVE, STEPS = 3, 5
LAUNCH_TIMEOUT_S = 240.0
# global shapes; "split" params are split by rows over the TP ranks
SHAPES = {"linear.weight": (8, 3), "linear.bias": (8,), "norm.weight": (8,)}
SPLIT = {"linear.weight", "linear.bias"}


@contextmanager
def _cpu_only() -> Iterator[None]:
    sync, current = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r"`load_state_dict` is deprecated", FutureWarning)
            yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = sync, current  # type: ignore[assignment]


def _global(name: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=g)


def _part(name: str, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return full.chunk(world)[rank].clone() if name in SPLIT else full.clone()


def _build(rank: int, world: int) -> tuple[dict[str, torch.nn.Parameter],
                                          functopt.MixedPrecisionOptimizer]:
    params = {n: torch.nn.Parameter(_part(n, _global(n, 0), rank, world).to(torch.bfloat16))
              for n in SHAPES}
    opt = functopt.MixedPrecisionOptimizer(
        torch.optim.AdamW([{"params": [params["linear.weight"]]},
                           {"params": [params["linear.bias"], params["norm.weight"]],
                            "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1),
        loss_scale=functopt.dynamic_loss_scale(init_scale=2.0**8, growth_interval=2))
    return params, opt


def _steps(params: dict[str, torch.nn.Parameter], opt: Any, steps: range, rank: int,
           world: int) -> None:
    for step in steps:
        for n, p in params.items():
            full = _global(n, 1000 * (step + 1))
            p.grad = _part(n, full, rank, world).to(torch.bfloat16)
        opt.step()


def _sharded(params: dict[str, torch.nn.Parameter], rank: int, world: int) -> dict[str, Any]:
    """The model's sharded state dict, as Megatron's TP layers make theirs."""
    out = {}
    for n, p in params.items():
        if n in SPLIT:
            out[n] = ShardedTensor.from_rank_offsets(n, p, (0, rank, world))
        else:  # the same values on every TP rank: rank 0's is the main replica
            out[n] = ShardedTensor.from_rank_offsets(n, p, replica_id=rank)
    return out


def _reference() -> dict[str, torch.Tensor]:
    params, opt = _build(0, 1)
    _steps(params, opt, range(STEPS), 0, 1)
    return {n: p.detach().clone() for n, p in params.items()}


def _save(rank: int, world: int, path: str) -> None:
    params, opt = _build(rank, world)
    _steps(params, opt, range(SAVE), rank, world)
    model = _sharded(params, rank, world)
    with _cpu_only():
        dist_checkpointing.save({"model": model, "optimizer": opt.sharded_state_dict(model)},
                                path)


def _resume(rank: int, world: int, path: str) -> dict[str, bool]:
    params, opt = _build(rank, world)
    model = _sharded(params, rank, world)
    with _cpu_only():
        loaded = dist_checkpointing.load(
            {"model": model, "optimizer": opt.sharded_state_dict(model, is_loading=True)},
            path)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(loaded["model"][n])
    opt.load_state_dict(loaded["optimizer"])
    _steps(params, opt, range(SAVE, STEPS), rank, world)
    want = _reference()
    return {n: torch.equal(p.detach(), _part(n, want[n], rank, world))
            for n, p in params.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("megatron_sharded"))
    harness.run_ranks(lambda rank, world: _save(rank, world, path), 2,
                      timeout_s=LAUNCH_TIMEOUT_S)
    return path


@pytest.mark.parametrize("world", [2, 1], ids=lambda w: f"load_on_{w}_ranks")
def test_saved_on_2_tp_ranks_resumes_bitwise(saved: str, world: int) -> None:
    results = harness.run_ranks(lambda rank, w: _resume(rank, w, saved), world,
                                timeout_s=LAUNCH_TIMEOUT_S)
    assert all(all(r.values()) for r in results), results


def test_sharded_entries_follow_their_params(saved: str) -> None:
    # Each param-shaped entry is a sharded tensor of its param's global tensor; the
    # counts and the loss scale are objects of their own, one per param.
    params, opt = _build(0, 1)
    _steps(params, opt, range(2), 0, 1)
    sharded = opt.sharded_state_dict(_sharded(params, 0, 1))
    entry = sharded["state"][0]
    assert isinstance(entry["master"], ShardedTensor)
    assert entry["master"].key == "optimizer.state.master.linear.weight"
    assert entry["master"].global_shape == SHAPES["linear.weight"]
    assert entry["master"].dtype == torch.float32
    count = sharded["state"][2]["inner_state.inner_states.1.count"]
    assert type(count).__name__ == "ShardedObject"
    assert count.key == "optimizer.state.inner_state.inner_states.1.count.norm.weight"
    assert count.data.item() == 2
    assert sharded["state"][2]["loss_scale.scale"].data == opt.get_loss_scale()
    assert type(sharded["param_groups"][0]["params"]).__name__ == "LocalNonpersistentObject"
    assert sharded["param_groups"][1]["weight_decay"] == 0.0


def test_errors_name_the_param_and_the_key() -> None:
    params, opt = _build(0, 1)
    model = _sharded(params, 0, 1)
    del model["norm.weight"]
    with pytest.raises(ValueError, match=r"no sharded tensor whose data is the param '2'"
                       r"|no sharded tensor whose data is the param 'norm"):
        opt.sharded_state_dict(model)
    with pytest.raises(ValueError, match=r"metadata key 'shard_everything'"):
        opt.sharded_state_dict(_sharded(params, 0, 1), metadata={"shard_everything": True})


def test_chained_optimizer_keys_each_optimizer_apart() -> None:
    params, first = _build(0, 1)
    torch.manual_seed(1)
    other = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    second = functopt.MixedPrecisionOptimizer(
        torch.optim.AdamW([other], lr=1e-2),
        loss_scale=functopt.dynamic_loss_scale(init_scale=2.0**8, growth_interval=2))
    chain = functopt.ChainedOptimizer([first, second])
    model = _sharded(params, 0, 1)
    model["other"] = ShardedTensor.from_rank_offsets("other", other)
    sharded = chain.sharded_state_dict(model)
    assert set(sharded) == {0, 1}
    assert sharded[1]["state"][0]["master"].key == "chained_1.optimizer.state.master.other"
    kept = chain.sharded_state_dict(model, metadata={"chained_optim_avoid_prefix": True})
    assert kept[1]["state"][0]["master"].key == "optimizer.state.master.other"


def test_chained_optimizer_loads_the_dicts_by_position() -> None:
    # dist_checkpointing.load gives a chain of several optimizers their dicts keyed by
    # position, as sharded_state_dict() keyed them.
    params, first = _build(0, 1)
    other = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    second = functopt.MixedPrecisionOptimizer(
        torch.optim.AdamW([other], lr=1e-2),
        loss_scale=functopt.dynamic_loss_scale(init_scale=2.0**8, growth_interval=2))
    chain = functopt.ChainedOptimizer([first, second])
    other.grad = torch.ones_like(other)
    _steps(params, chain, range(1), 0, 1)
    saved = copy.deepcopy(chain.state_dict())
    _steps(params, chain, range(1, 2), 0, 1)
    master = chain.state_dict()[0]["state"][0]["master"]
    assert not torch.equal(master, saved[0]["state"][0]["master"])
    chain.load_state_dict(dict(enumerate(saved)))
    assert torch.equal(chain.state_dict()[0]["state"][0]["master"], saved[0]["state"][0]["master"])
