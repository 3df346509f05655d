"""Rank-side checks of functopt on DTensor / FSDP2 params, run by ``run_all`` in each rank.

One launch of the ranks runs every check (a launch costs seconds; a check milliseconds);
``run_all`` returns ``{check name: None or the failure's traceback}`` and the pytest side
(``tests/test_distributed_*.py``) turns each entry into a test. Each check is written for
any world size; the tests run 2 and 4 ranks.

The model: ``Linear(4, 5) -> ReLU -> Linear(5, 1)``, fully sharded on a 1-D mesh.
``Shard(0)`` splits like ``torch.chunk``, so the shards are uneven and some ranks hold
none of a leaf: 5 rows over 2 ranks are 3 + 2, over 4 ranks 2 + 2 + 1 + 0; the single
output row lives on rank 0 only.

Tolerances. Elementwise maths is the same on a shard as on the whole tensor, so where no
global sum enters, sharded results equal the single-process run bitwise. A global norm
sums the same squares in another order (per shard, then over ranks), which moves it by a
few float64 ulps; with clipping, results are compared to ``rtol=1e-6`` (float32 rounding
of a clip factor that differs in its last float64 bits). End to end (FSDP's gradients
against one process's gradients of the whole batch) the gradients differ by float32
rounding of the batch mean, and params after three Adam steps are compared to
``atol=1e-6, rtol=1e-5``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import functopt
from distributed.harness import check_registry, run_checks
from functopt import distributed as fdist
from functopt.precision import grad_stats, mixed_precision, unpack_grad_stats

CHECKS, check = check_registry()


def run_all(rank: int, world: int) -> dict[str, str | None]:
    """Run every check in this rank; a barrier after each keeps the ranks in step."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    warnings.filterwarnings("ignore", message="Full backward hook is firing.*")
    return run_checks(CHECKS, rank, world)


# ----------------------------------------------------------------------------- helpers

def _mesh(world: int):
    return init_device_mesh("cpu", (world,))


def _full(x: Any) -> Any:
    return x.full_tensor() if isinstance(x, DTensor) else x


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = _full(a), _full(b)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


def _assert_tree(actual: Any, expected: Any, *, bitwise: bool = True, **tol: float) -> None:
    a_leaves, spec = functopt.tree._core.flatten(actual)
    e_leaves = functopt.tree._core.flatten_like(spec, expected, name="expected", reference="actual")
    for path, a, e in zip(functopt.tree._core.paths(spec), a_leaves, e_leaves, strict=True):
        if a is None or e is None:
            assert a is None and e is None, path
            continue
        if bitwise:
            assert _bits_equal(a, e), f"{path}: {_full(a)} != {_full(e)}"
        else:
            torch.testing.assert_close(_full(a), _full(e), msg=lambda m, p=path: f"{p}: {m}", **tol)


def _assert_placements_like(state: Any, params: dict[str, DTensor]) -> int:
    """Every per-leaf state tensor of a param's shape is a DTensor on its mesh and placements."""
    by_shape = {tuple(p.shape): p for p in params.values()}
    n = 0
    for path, leaf in functopt.tree._core.leaves_with_path(state):
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            continue  # counters and scalars are plain 0-d tensors, the same on every rank
        p = by_shape[tuple(leaf.shape)]
        assert isinstance(leaf, DTensor), f"{path} is a plain tensor"
        assert leaf.device_mesh == p.device_mesh and leaf.placements == p.placements, path
        n += 1
    return n


def _mlp(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1)
    ).to(dtype)


def _shard(model: torch.nn.Module, mesh, mp_policy: MixedPrecisionPolicy | None = None):
    kwargs = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _batch(step: int, world: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(2 * world, 4, generator=g).to(dtype)
    y = torch.randn(2 * world, 1, generator=g).to(dtype)
    return x, y


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).square().mean()


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in model.named_parameters()}


def _write(model: torch.nn.Module, new: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(new[n])
            p.grad = None


def _sharded_backward(model: torch.nn.Module, step: int, rank: int, world: int,
                      state: Any = None) -> None:
    """Each rank its slice of the batch; FSDP averages the gradients over the ranks. With
    a mixed-precision ``state``, the loss is scaled by its loss scale."""
    x, y = _batch(step, world, next(model.parameters()).dtype)
    loss = _loss(model, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
    (loss if state is None else functopt.precision.scale_loss(loss, state)).backward()


# ------------------------------------------------------------- transforms on DTensors

@check
def transforms_on_uneven_dtensors(rank: int, world: int) -> None:
    """The built-in transforms run unchanged on Shard(0) DTensors, with empty shards."""
    mesh = _mesh(world)
    torch.manual_seed(1)
    full = {"w": torch.randn(5, 3), "b": torch.randn(1), "d": torch.randn(3, 2, dtype=torch.float64)}
    gfull = {k: torch.randn_like(v) for k, v in full.items()}
    params = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    grads = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in gfull.items()}
    assert any(p.to_local().numel() == 0 for p in params.values()) == (rank > 0)
    elementwise = {
        "scale_by_adam": functopt.scale_by_adam(),
        "adamw": functopt.adamw(1e-2, weight_decay=0.1),
        "sgd": functopt.sgd(0.1, momentum=0.9, nesterov=True),
    }
    for name, tx in {**elementwise, "clip_by_global_norm": functopt.clip_by_global_norm(0.5)}.items():
        state, ref_state = tx.init(params), tx.init(full)
        if name != "clip_by_global_norm":
            assert _assert_placements_like(state, params) > 0, name
        for _ in range(2):
            with CommDebugMode() as comm:
                updates, state = tx.update(grads, state, params)
            comms = comm.get_total_counts()
            ref_updates, ref_state = tx.update(gfull, ref_state, full)
            if name in elementwise:
                assert comms == 0, (name, comms)  # elementwise: no communication at all
                _assert_tree(updates, ref_updates)
                _assert_tree(state, ref_state)
            else:
                _assert_tree(updates, ref_updates, bitwise=False, rtol=1e-6, atol=0.0)
            assert all(isinstance(u, DTensor) and u.placements == (Shard(0),)
                       for u in updates.values()), name


# ------------------------------------------------------------------ packed statistics

@check
def stats_one_collective_equal_single_process(rank: int, world: int) -> None:
    mesh = _mesh(world)
    torch.manual_seed(2)
    full = {"w": torch.randn(5, 3), "b": torch.zeros(1), "h": torch.randn(3).to(torch.bfloat16)}
    full["w"][4, 1] = float("nan")  # the last row: on rank 1 of 2 and rank 2 of 4
    full["w"][0, 0] = 0.0
    grads = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    grads["none"] = None
    with CommDebugMode() as comm:
        packed = fdist.global_grad_stats(grads)
    assert comm.get_total_counts() == 1
    assert not isinstance(packed, DTensor) and packed.dtype == torch.float64
    expected = grad_stats(list(full.values()))
    assert torch.isnan(packed[0]) and torch.equal(packed[1:], expected[1:]), (packed, expected)
    # every rank holds the same result
    gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, packed)
    assert all(torch.equal(g[1:], packed[1:]) for g in gathered)
    # finite: each shard's squares are summed in float32, so the split changes the sum of
    # squares by float32 roundings only; the counts are exact
    full["w"][4, 1] = 1.5
    grads = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    packed = fdist.global_grad_stats(grads)
    expected = grad_stats(list(full.values()))
    torch.testing.assert_close(packed[0], expected[0], rtol=1e-6, atol=0.0)
    assert torch.equal(packed[1:], expected[1:])
    stats = unpack_grad_stats(packed)
    assert not bool(stats.found_inf) and int(stats.num_zeros) == 2
    # the local statistics of this rank are those of its shards alone
    local = fdist.local_grad_stats(grads)
    assert torch.equal(local, grad_stats([g.to_local() for g in grads.values()]))


@check
def stats_count_replicated_leaves_once(rank: int, world: int) -> None:
    mesh = _mesh(world)
    x = torch.tensor([3.0, 0.0, float("inf"), 4.0])
    rep = distribute_tensor(x, mesh, [Replicate()])
    assert fdist.counted_here(rep) == (rank == 0)
    packed = fdist.global_grad_stats({"r": rep, "s": distribute_tensor(x, mesh, [Shard(0)])})
    assert torch.equal(packed[1:], torch.tensor([2.0, 2.0], dtype=torch.float64)), packed
    if world == 4:  # a 2-D mesh: replicated over one dimension, sharded over the other
        mesh2 = init_device_mesh("cpu", (2, 2))
        y = torch.arange(12.0).reshape(6, 2) - 5.0  # one zero
        for placements in ([Replicate(), Shard(0)], [Shard(0), Replicate()],
                           [Replicate(), Replicate()], [Shard(0), Shard(1)]):
            d = distribute_tensor(y, mesh2, placements)
            with CommDebugMode() as comm:
                packed = fdist.global_grad_stats([d, None])
            assert comm.get_total_counts() == 1
            # counts exact; the sum of squares up to float32 roundings of the split
            assert torch.equal(packed[1:], grad_stats([y])[1:]), (placements, packed)
            torch.testing.assert_close(packed[0], grad_stats([y])[0], rtol=1e-6, atol=0.0)


@check
def stats_errors(rank: int, world: int) -> None:
    mesh = _mesh(world)
    d = distribute_tensor(torch.ones(4), mesh, [Shard(0)])
    partial = DTensor.from_local(torch.ones(2), mesh, [Partial()])
    with pytest.raises(ValueError, match=r"'p'.*Partial placement.*Fix: reduce it first"):
        fdist.local_grad_stats({"p": partial})
    with pytest.raises(ValueError, match=r"'x' is a plain tensor but 'd' is a DTensor.*"
                                         r"Fix: declare it with replicated=True"):
        fdist.global_grad_stats({"d": d, "x": torch.ones(2)})
    with pytest.raises(TypeError, match=r"'x' is a str"):
        fdist.local_grad_stats({"x": "nope"})
    with pytest.raises(TypeError, match="packed is a DTensor"):
        fdist.all_reduce_stats(d, mesh.get_group())
    if world == 4:
        sub = dist.new_group([0, 1])  # collective over WORLD: every rank creates it
        if rank < 2:
            sub_mesh = torch.distributed.device_mesh.DeviceMesh.from_group(sub, "cpu")
            e = distribute_tensor(torch.ones(2), sub_mesh, [Shard(0)])
            with pytest.raises(ValueError, match="over other ranks"):
                fdist.infer_group([d, e])
    # an explicit group sums plain tensors as this rank's parts
    packed = fdist.global_grad_stats([torch.full((2,), float(rank))], dist.group.WORLD,
                                     replicated=False)
    assert packed[0].item() == pytest.approx(2 * sum(r * r for r in range(world)), rel=1e-6)
    # no DTensor: nothing to reduce, no collective
    with CommDebugMode() as comm:
        packed = fdist.global_grad_stats([torch.ones(2)])
    assert comm.get_total_counts() == 0 and packed[0].item() == pytest.approx(2.0, rel=1e-6)


# ----------------------------------------------------------------------------- FSDP2

@check
def fsdp_fp32_adamw_equals_single_process(rank: int, world: int) -> None:
    """fp32 FSDP2 + functopt.adamw + apply_updates: equal to one process, step by step."""
    mesh = _mesh(world)
    model = _shard(_mlp(), mesh)
    reference = _mlp()  # same init, unsharded
    opt = functopt.adamw(1e-2, weight_decay=0.1)
    state = opt.init(_params(model))
    assert _assert_placements_like(state, _params(model)) == 4 * 2  # mu and nu
    ref_params = _params(reference)
    ref_state = opt.init(ref_params)
    shadow_state = opt.init({k: _full(v) for k, v in _params(model).items()})
    for step in range(3):
        _sharded_backward(model, step, rank, world)
        params, grads = _params(model), _grads(model)
        # Optimizer level: the single-process step on the gathered gradients, bitwise.
        shadow_params = {k: _full(v) for k, v in params.items()}
        full_grads = {k: _full(v) for k, v in grads.items()}
        with CommDebugMode() as comm:
            updates, state = opt.update(grads, state, params)
        assert comm.get_total_counts() == 0
        new = functopt.apply_updates(params, updates)
        shadow_updates, shadow_state = opt.update(full_grads, shadow_state, shadow_params)
        _assert_tree(new, functopt.apply_updates(shadow_params, shadow_updates))
        _assert_tree(state, shadow_state)
        _write(model, new)
        # End to end: one process on the whole batch.
        x, y = _batch(step, world)
        reference.zero_grad()
        _loss(reference, x, y).backward()
        ref_updates, ref_state = opt.update(_grads(reference), ref_state, ref_params)
        ref_params = functopt.apply_updates(ref_params, ref_updates)
        _write(reference, ref_params)
    _assert_tree(_params(model), ref_params, bitwise=False, atol=1e-6, rtol=1e-5)


def _mixed_precision_run(rank: int, world: int, *, model_dtype: torch.dtype,
                         mp_policy: MixedPrecisionPolicy | None, max_grad_norm: float | None,
                         steps: int = 3) -> None:
    """mixed_precision(adamw) on FSDP2 params, against a single-process shadow run on the
    gathered gradients; exactly one collective per step; master params exact."""
    mesh = _mesh(world)
    model = _shard(_mlp(model_dtype), mesh, mp_policy)
    opt = mixed_precision(functopt.adamw(1e-2, weight_decay=0.1),
                          loss_scale=functopt.dynamic_loss_scale(init_scale=2.0**4),
                          max_grad_norm=max_grad_norm)
    state = opt.init(_params(model))
    n = _assert_placements_like(state, _params(model))
    narrow = model_dtype != torch.float32
    assert n == 4 * (3 if narrow else 2)  # master (bfloat16 params only), mu, nu
    shadow_params = {k: _full(v) for k, v in _params(model).items()}
    shadow_state = opt.init(shadow_params)
    bitwise = max_grad_norm is None
    for step in range(steps):
        _sharded_backward(model, step, rank, world, state)
        params, grads = _params(model), _grads(model)
        with CommDebugMode() as comm:
            new, state = opt.step(grads, state, params)
        comms = comm.get_total_counts()
        assert comms == 1, f"{comms} collectives in one optimizer step"
        assert not bool(state.metrics.found_inf)
        full_grads = {k: _full(v) for k, v in grads.items()}
        shadow_params, shadow_state = opt.step(full_grads, shadow_state, shadow_params)
        _assert_tree(new, shadow_params, bitwise=bitwise, rtol=1e-6, atol=0.0)
        _assert_tree(state.master, shadow_state.master, bitwise=bitwise, rtol=1e-6, atol=0.0)
        torch.testing.assert_close(state.metrics.grad_norm, shadow_state.metrics.grad_norm,
                                   rtol=1e-6, atol=0.0)
        assert torch.equal(state.metrics.num_zeros, shadow_state.metrics.num_zeros)
        assert torch.equal(state.loss_scale.scale, shadow_state.loss_scale.scale)
        for k, p in new.items():
            assert isinstance(p, DTensor) and p.placements == params[k].placements
            if narrow:  # each bfloat16 shard is exactly its master shard, rounded
                assert torch.equal(p.to_local(), state.master[k].to_local().to(p.dtype)), k
        _write(model, new)


@check
def fsdp_fp32_mixed_precision_one_collective(rank: int, world: int) -> None:
    _mixed_precision_run(rank, world, model_dtype=torch.float32, mp_policy=None,
                         max_grad_norm=None)


@check
def fsdp_bf16_policy_mixed_precision_clipped(rank: int, world: int) -> None:
    """MixedPrecisionPolicy(param_dtype=bfloat16): bfloat16 compute and reduction, float32
    sharded params and gradients; the clipped step uses the one reduction's norm."""
    _mixed_precision_run(rank, world, model_dtype=torch.float32,
                         mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                         max_grad_norm=0.05)


@check
def fsdp_bf16_params_float32_master(rank: int, world: int) -> None:
    """bfloat16 FSDP2 params with float32 master DTensors (LightRFT's setting), bitwise."""
    _mixed_precision_run(rank, world, model_dtype=torch.bfloat16, mp_policy=None,
                         max_grad_norm=None)


@check
def fsdp_overflow_on_one_rank_skips_everywhere(rank: int, world: int) -> None:
    mesh = _mesh(world)
    model = _shard(_mlp(torch.bfloat16), mesh)
    opt = mixed_precision(functopt.adamw(1e-2), loss_scale=functopt.dynamic_loss_scale(),
                          max_grad_norm=1.0)
    state = opt.init(_params(model))
    _sharded_backward(model, 0, rank, world)
    params, grads = _params(model), _grads(model)
    target = 1  # rank 1 holds rows of the first weight at 2 and 4 ranks
    assert grads["0.weight"].to_local().numel() > 0 or rank != target
    if rank == target:
        local = grads["0.weight"].to_local()
        local[0, 0] = float("inf")
    before = {k: v.to_local().clone() for k, v in params.items()}
    master_before = {k: v.to_local().clone() for k, v in state.master.items()}
    with CommDebugMode() as comm:
        new, new_state = opt.step(grads, state, params)
    assert comm.get_total_counts() == 1
    assert bool(new_state.metrics.found_inf), f"rank {rank} did not see the overflow"
    assert int(new_state.metrics.skipped_steps) == 1
    assert new_state.loss_scale.scale.item() == state.loss_scale.scale.item() / 2
    for k in params:
        assert _bits_equal(new[k].to_local(), before[k]), k
        assert _bits_equal(new_state.master[k].to_local(), master_before[k]), k
    inner_old = functopt.tree._core.flatten(state.inner_state)[0]
    inner_new = functopt.tree._core.flatten(new_state.inner_state)[0]
    for a, b in zip(inner_old, inner_new, strict=True):
        if isinstance(a, torch.Tensor):
            assert _bits_equal(functopt.distributed.local_tensor(a),
                               functopt.distributed.local_tensor(b))


@check
def explicit_group_sums_plain_shards(rank: int, world: int) -> None:
    """A hand-sharded (ZeRO-style) run with plain tensors: each rank holds a torch.chunk of
    every leaf; process_group=WORLD makes the one reduction, so clipping and the skip
    decision are global and each chunk equals the single-process run's chunk."""
    torch.manual_seed(3)
    full = {"w": torch.randn(5, 3).to(torch.bfloat16), "b": torch.randn(3)}
    gfull = {k: torch.randn_like(v) for k, v in full.items()}
    chunk = lambda t: {k: v.chunk(world)[rank] if rank < len(v.chunk(world)) else v[:0]  # noqa: E731
                       for k, v in t.items()}
    opt = mixed_precision(functopt.adamw(1e-2), max_grad_norm=0.5,
                          process_group=dist.group.WORLD, replicated=False)
    single = mixed_precision(functopt.adamw(1e-2), max_grad_norm=0.5)  # no group: no reduction
    params, grads = chunk(full), chunk(gfull)
    state = opt.init(params)
    with CommDebugMode() as comm:
        new, state = opt.step(grads, state, params)
    assert comm.get_total_counts() == 1
    ref_new, ref_state = single.step(gfull, single.init(full), full)
    _assert_tree(new, chunk(ref_new), bitwise=False, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(state.metrics.grad_norm, ref_state.metrics.grad_norm,
                               rtol=1e-6, atol=0.0)
    # a nan in one rank's chunk only (the last that holds rows of w: torch.chunk makes
    # 3 chunks of 5 rows for 4 ranks): every rank skips
    if rank == len(full["w"].chunk(world)) - 1:
        grads["w"] = grads["w"].clone().fill_(float("nan"))
    skipped, skipped_state = opt.step(grads, state, new)
    assert bool(skipped_state.metrics.found_inf)
    _assert_tree(skipped, new)
