"""Rank-side checks of ``functopt.distributed.zero.zero1`` (ZeRO-1), run by ``run_all`` in each rank.

Every rank holds the same full params and the same gradients (as after DDP's all-reduce);
the reference is ``mixed_precision`` with the same arguments on the whole params, run in
each rank without communication. The params mix bfloat16 (float32 master) and float32
leaves, a ``None`` leaf, and leaves with fewer elements than ranks (empty slices).

Tolerances: without clipping the step is elementwise after one global decision, so
params, masters and inner state are compared bitwise; with ``max_grad_norm`` the global
sum of squares adds per-slice float32 sums (another order), so results are compared to
``rtol=1e-6``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import functopt
from distributed.checks import _assert_tree, _bits_equal, _full
from distributed.harness import check_registry, run_checks
from functopt.distributed.zero import slice_bounds, zero1, zero1_reduce_scatter
from functopt.precision import mixed_precision

CHECKS, check = check_registry()


def run_all(rank: int, world: int) -> dict[str, str | None]:
    """Run every check in this rank; a barrier after each keeps the ranks in step."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    return run_checks(CHECKS, rank, world)


# ----------------------------------------------------------------------------- helpers

def _params() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "w": torch.randn(5, 3).to(torch.bfloat16),
        "v": torch.randn(7).to(torch.bfloat16),
        "b": torch.randn(3),  # float32: no master
        "one": torch.randn(1).to(torch.bfloat16),  # fewer elements than ranks
        "frozen": None,
        "m": torch.randn(4, 4),
    }


def _grads(step: int, params: dict[str, Any]) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + step)  # the same on every rank (DDP)
    out = {k: None if p is None else (torch.randn(p.shape, generator=g) * 64).to(p.dtype)
           for k, p in params.items()}
    if step == 3:
        out["v"] = None  # a param without gradient this step
    return out


def _slice_of(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    start, end = slice_bounds(x.numel(), rank, world)
    return x.reshape(-1)[start:end]


def _slice_tree(tree: Any, rank: int, world: int) -> Any:
    leaves, spec = functopt.tree._core.flatten(tree)
    return functopt.tree._core.unflatten(
        spec, [None if x is None else _slice_of(x, rank, world) for x in leaves])


def _sharded_state_like(reference_state: Any, rank: int, world: int) -> Any:
    """The reference (unsharded) state with every per-leaf tensor sliced like zero1 slices."""
    return reference_state._replace(
        master=_slice_tree(reference_state.master, rank, world),
        inner_state=_slice_inner(reference_state.inner_state, rank, world),
    )


def _slice_inner(inner: Any, rank: int, world: int) -> Any:
    leaves, spec = functopt.tree._core.flatten(inner)
    return functopt.tree._core.unflatten(spec, [
        x if not isinstance(x, torch.Tensor) or x.dim() == 0 else _slice_of(x, rank, world)
        for x in leaves])


def _state_bytes(state: Any) -> int:
    """Bytes of the per-leaf state (masters and inner state; counters excluded)."""
    total = 0
    for part in (state.master, state.inner_state):
        for x in functopt.tree._core.flatten(part)[0]:
            if isinstance(x, torch.Tensor) and x.dim() > 0:
                total += x.numel() * x.element_size()
    return total


def _run(rank: int, world: int, *, max_grad_norm: float | None, steps: int,
         overflow_step: int | None, fused: bool = False) -> None:
    # fused=False: the pure arithmetic is elementwise, so slices step bitwise like the whole
    # leaves; PyTorch's fused CPU kernel rounds a tensor's vector body and tail differently.
    kwargs = {"loss_scale": functopt.dynamic_loss_scale(init_scale=2.0**6, growth_interval=2),
              "max_grad_norm": max_grad_norm, "fused": fused}
    opt = zero1(functopt.adamw(1e-2, weight_decay=0.1), **kwargs)
    ref = mixed_precision(functopt.adamw(1e-2, weight_decay=0.1), **kwargs)
    params = _params()
    ref_params = _params()
    state, ref_state = opt.init(params), ref.init(ref_params)
    bitwise = max_grad_norm is None and not fused
    skipped = 0
    for step in range(steps):
        grads = _grads(step, params)
        ref_grads = _grads(step, params)
        scale = ref_state.loss_scale.scale
        grads = {k: None if g is None else (g.float() * scale).to(g.dtype) for k, g in grads.items()}
        ref_grads = {k: None if g is None else (g.float() * scale).to(g.dtype)
                     for k, g in ref_grads.items()}
        if step == overflow_step:
            # Only the owner of w's first slice element on rank 1 sees the inf (DDP would
            # give it to every rank; one rank suffices for the skip to be global).
            start, _ = slice_bounds(15, 1, world)
            ref_grads["w"] = ref_grads["w"].clone()
            ref_grads["w"].view(-1)[start] = float("inf")
            if rank == 1:
                grads["w"] = grads["w"].clone()
                grads["w"].view(-1)[start] = float("inf")
        before = {k: None if p is None else p.clone() for k, p in params.items()}
        with CommDebugMode() as comm:
            params, state = opt.step(grads, state, params)
        counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
        assert comm.get_total_counts() == 2, counts
        assert sum(v for k, v in counts.items() if "allreduce" in k) == 1, counts
        assert sum(v for k, v in counts.items() if "allgather" in k) == 1, counts
        ref_params, ref_state = ref.step(ref_grads, ref_state, ref_params)
        found = bool(state.metrics.found_inf)
        assert found == (step == overflow_step), (rank, step)
        assert found == bool(ref_state.metrics.found_inf)
        skipped += found
        assert int(state.metrics.skipped_steps) == skipped
        if found:
            _assert_tree(params, before)  # bitwise unchanged everywhere
        # clipped: a bfloat16 param may round the other way (one ulp, 2**-8 relative) when
        # its master moved by a last-bit difference of the clip factor across a tie
        _assert_tree(params, ref_params, bitwise=bitwise, rtol=2.0**-7, atol=0.0)
        expected_state = _sharded_state_like(ref_state, rank, world)
        # the clip factor's relative error (~1e-7) times the gradients (|g| <= 0.05 after
        # clipping) bounds the absolute error of masters and moments
        _assert_tree(state.master, expected_state.master, bitwise=bitwise, rtol=1e-6, atol=1e-8)
        _assert_tree(state.inner_state, expected_state.inner_state, bitwise=bitwise,
                     rtol=1e-6, atol=1e-8)
        assert torch.equal(state.loss_scale.scale, ref_state.loss_scale.scale)
        assert torch.equal(state.metrics.num_zeros, ref_state.metrics.num_zeros)
        torch.testing.assert_close(state.metrics.grad_norm, ref_state.metrics.grad_norm,
                                   rtol=1e-6, atol=0.0)
        for k, p in params.items():  # bfloat16 params: exactly their master, rounded
            if p is not None and p.dtype == torch.bfloat16:
                assert _bits_equal(_slice_of(p, rank, world), state.master[k].to(p.dtype)), k
    assert skipped == (overflow_step is not None)
    # every rank holds the same params
    flat = torch.cat([p.float().reshape(-1) for p in params.values() if p is not None])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, flat) for g in gathered)


# ----------------------------------------------------------------------------- checks

@check
def zero1_bitwise_equals_unsharded_with_overflow(rank: int, world: int) -> None:
    """Five steps of adamw under a dynamic loss scale, one overflow on rank 1 only at step 2
    (every rank skips), a None gradient at step 3; one all_reduce + one all_gather each."""
    _run(rank, world, max_grad_norm=None, steps=5, overflow_step=2)


@check
def zero1_clipped_close_to_unsharded(rank: int, world: int) -> None:
    _run(rank, world, max_grad_norm=0.05, steps=3, overflow_step=1)


@check
def zero1_fused_close_to_unsharded_with_overflow(rank: int, world: int) -> None:
    _run(rank, world, max_grad_norm=None, steps=5, overflow_step=2, fused=True)


@check
def zero1_fused_clipped_close_to_unsharded(rank: int, world: int) -> None:
    _run(rank, world, max_grad_norm=0.05, steps=3, overflow_step=1, fused=True)


@check
def zero1_state_bytes_one_nth(rank: int, world: int) -> None:
    """Masters and Adam moments: the ranks' bytes sum to the unsharded state's, each ~1/N."""
    torch.manual_seed(0)
    params = {"a": torch.randn(301, 7).to(torch.bfloat16), "b": torch.randn(513),
              "c": torch.randn(3).to(torch.bfloat16)}
    opt = zero1(functopt.adamw(1e-3))
    state = opt.init(params)
    total = _state_bytes(mixed_precision(functopt.adamw(1e-3)).init(params))
    mine = torch.tensor([_state_bytes(state)], dtype=torch.int64)
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(every, mine)
    per_rank = [int(x) for x in every]
    assert sum(per_rank) == total, (per_rank, total)
    # the busiest rank: per leaf at most one element (12 bytes: master + mu + nu) above an
    # even share (torch.chunk's split leaves the last ranks less, never more)
    assert max(per_rank) <= total / world + 3 * 12, (per_rank, total / world)


@check
def zero1_with_ddp_equals_single_process(rank: int, world: int) -> None:
    """DDP on CPU (gloo) averages the gradients; zero1 then equals mixed_precision run on
    the same averaged gradients, and the model stays in sync over the ranks."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = zero1(functopt.adamw(1e-2), max_grad_norm=None)
    ref = mixed_precision(functopt.adamw(1e-2))
    params = {n: p.detach() for n, p in model.named_parameters()}
    state = opt.init(params)
    ref_params = {n: p.clone() for n, p in params.items()}
    ref_state = ref.init(ref_params)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * world, 4, generator=g), torch.randn(2 * world, 1, generator=g)
        ddp.zero_grad()
        (ddp(x[2 * rank:2 * rank + 2]) - y[2 * rank:2 * rank + 2]).square().mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        new, state = opt.step(grads, state, params)
        ref_params, ref_state = ref.step(grads, ref_state, ref_params)
        _assert_tree(new, ref_params)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(new[n])
        params = {n: p.detach() for n, p in model.named_parameters()}


@check
def zero1_errors(rank: int, world: int) -> None:
    opt = zero1(functopt.sgd(0.1))
    mesh = init_device_mesh("cpu", (world,))
    d = distribute_tensor(torch.ones(4), mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"params leaf 'd' is a DTensor.*mixed_precision"):
        opt.init({"d": d})
    params = {"w": torch.ones(2, 2)}
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"'w': grad has shape \(3,\); expected the param's "
                                         r"shape \(2, 2\) .* or \(\d,\) \(this rank's slice"):
        opt.step({"w": torch.ones(3)}, state, params)


@check
def zero1_on_a_data_parallel_subgroup(rank: int, world: int) -> None:
    """Shard over a subgroup (pairs of ranks at 4 ranks): slices by the rank in the group."""
    groups = [dist.new_group(list(range(r, min(r + 2, world)))) for r in range(0, world, 2)]
    group = groups[rank // 2]
    opt = zero1(functopt.adamw(1e-2), process_group=group)
    ref = mixed_precision(functopt.adamw(1e-2))
    params = _params()
    state, ref_state = opt.init(params), ref.init(params)
    grads = _grads(0, params)
    with CommDebugMode() as comm:
        new, state = opt.step(grads, state, params)
    assert comm.get_total_counts() == 2
    ref_new, ref_state = ref.step(grads, ref_state, params)
    _assert_tree(new, ref_new)
    _assert_tree(state.master, _slice_tree(ref_state.master, rank % 2, 2))


@check
def slice_bounds_are_dtensor_shards(rank: int, world: int) -> None:
    """A rank's slice is its local shard of the flattened leaf as a Shard(0) DTensor (what
    zero1_state_to_dict relies on for checkpoints that reshard)."""
    mesh = init_device_mesh("cpu", (world,))
    for numel in (0, 1, world - 1, world, world + 1, 10, 15, 2 * world + 1):
        x = torch.arange(float(numel))
        start, end = slice_bounds(numel, rank, world)
        assert torch.equal(distribute_tensor(x, mesh, [Shard(0)]).to_local(), x[start:end]), numel


def _local_grads(params: dict[str, Any], rank: int) -> dict[str, Any]:
    """Each rank's own gradients, k/4 for integers |k| <= 3: their means over 2 or 4 ranks
    (and every partial sum) need at most 6 significant bits, so bfloat16 and float32 sum
    them exactly in any order."""
    g = torch.Generator().manual_seed(50 + rank)
    return {k: None if p is None else
            (torch.randint(-3, 4, p.shape, generator=g).float() / 4).to(p.dtype)
            for k, p in params.items()}


@check
def zero1_reduce_scattered_grads_equal_all_reduced(rank: int, world: int) -> None:
    """zero1_reduce_scatter (one reduce_scatter per dtype) hands each rank its slices of the
    mean gradients; zero1 steps on them bitwise as on the all-reduced full gradients, and a
    tree may mix full and slice-shaped leaves."""
    params = _params()
    local = _local_grads(params, rank)
    full = {}
    for k, g in local.items():
        if g is not None:
            g = g.clone()
            dist.all_reduce(g)
            g = g / world
        full[k] = g
    with CommDebugMode() as comm:
        sliced = zero1_reduce_scatter(local)
    counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    assert comm.get_total_counts() == 2 and sum(  # bfloat16 and float32
        v for k, v in counts.items() if "reduce_scatter" in k) == 2, counts
    for k, p in params.items():
        if p is None:
            assert sliced[k] is None
            continue
        assert _bits_equal(sliced[k], _slice_of(full[k], rank, world)), k
    opt = zero1(functopt.adamw(1e-2, weight_decay=0.1), fused=False)
    state = opt.init(params)
    ref_params, ref_state = opt.step(full, state, params)
    with CommDebugMode() as comm:
        new, new_state = opt.step(sliced, state, params)
    assert comm.get_total_counts() == 2
    _assert_tree(new, ref_params)
    _assert_tree(new_state, ref_state)
    mixed = {**sliced, "m": full["m"]}  # one leaf full, the others slices
    _assert_tree(opt.step(mixed, state, params)[0], ref_params)


def _tp_grads(step: int, full: dict[str, torch.Tensor], params: dict[str, Any],
              scale: float) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Synthetic gradients of the whole params (the same on every rank, as after DDP),
    scaled; and, for the TP params, as DTensors placed like them."""
    g = torch.Generator().manual_seed(700 + step)
    whole = {k: torch.randn(v.shape, generator=g) * scale for k, v in full.items()}
    placed = {k: distribute_tensor(whole[k], v.device_mesh, v.placements)
              if isinstance(v, DTensor) else whole[k].clone() for k, v in params.items()}
    return placed, whole


@check
def zero1_with_tensor_parallel_agrees(rank: int, world: int) -> None:
    """ZeRO-1 over the data-parallel ranks of a (world/2, 2) mesh with TP params on the
    "tp" dimension (a column- and a row-parallel Linear, one left out of the plan): every
    rank gets the one-process norm, skip decision (an inf in one TP rank's shard only) and
    loss scale, and the params of the one-process step; two collectives per step (one at a
    data-parallel size of 1)."""
    _zero1_tensor_parallel(world, 2)


@check
def zero1_with_tensor_parallel_over_all_ranks_agrees(rank: int, world: int) -> None:
    """The same with a TP size of world (a (1, world) mesh: uneven and empty TP shards of
    the 6-row column-parallel weight at 4 ranks), so ZeRO-1 over TP sizes 2 and 4."""
    _zero1_tensor_parallel(world, world)


def _zero1_tensor_parallel(world: int, tp: int) -> None:
    from distributed.replication_checks import _model
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    model = _model()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    params = {n: p.detach() for n, p in model.named_parameters()}
    assert isinstance(params["2.bias"], DTensor) and params["2.bias"].placements == (Replicate(),)
    kwargs = {"loss_scale": functopt.dynamic_loss_scale(init_scale=2.0**4, growth_interval=1),
              "max_grad_norm": 2.0, "fused": False}
    opt = zero1(functopt.adamw(1e-2, weight_decay=0.1), process_group=mesh["dp"].get_group(),
                replicated=True, **kwargs)
    ref = mixed_precision(functopt.adamw(1e-2, weight_decay=0.1), **kwargs)
    # the overlapped gather (buckets of 64 bytes) on the same TP params: bitwise zero1
    from functopt.distributed import zero1_overlapped
    ov = zero1_overlapped(functopt.adamw(1e-2, weight_decay=0.1), bucket_bytes=64,
                          process_group=mesh["dp"].get_group(), replicated=True, **kwargs)
    state, ref_state, ov_state = opt.init(params), ref.init(full), ov.init(params)
    ref_params, ov_params = full, params
    for step in range(4):
        grads, whole = _tp_grads(step, full, params, float(ref_state.loss_scale.scale))
        if step == 1:  # an inf in row 3 of the column-parallel weight: one TP rank's only
            whole["0.weight"][3, 0] = float("inf")
            rows = -(-6 // tp)  # Shard(0) of 6 rows: torch.chunk's split
            if mesh["tp"].get_local_rank() == 3 // rows:
                grads["0.weight"].to_local()[3 % rows, 0] = float("inf")
        with CommDebugMode() as comm:
            params, state = opt.step(grads, state, params)
        # the stats all_reduce, and the all_gather when the data-parallel size is above 1
        assert comm.get_total_counts() == (2 if world > tp else 1), comm.get_comm_counts()
        pending, ov_state = ov.step(grads, ov_state, ov_params)
        ov_params = pending.wait()
        _assert_tree(ov_params, params)
        _assert_tree(ov_state, state)
        assert all(type(ov_params[k]) is type(v) for k, v in params.items())
        ref_params, ref_state = ref.step(whole, ref_state, ref_params)
        ours = torch.stack([state.metrics.grad_norm.double(), state.loss_scale.scale.double(),
                            state.metrics.found_inf.double()])
        every = [torch.zeros_like(ours) for _ in range(world)]
        dist.all_gather(every, ours)
        assert all(torch.equal(e, ours) for e in every), every  # all ranks agree
        assert bool(state.metrics.found_inf) == (step == 1)
        assert torch.equal(state.loss_scale.scale, ref_state.loss_scale.scale)
        torch.testing.assert_close(state.metrics.grad_norm, ref_state.metrics.grad_norm,
                                   rtol=1e-6, atol=0.0)
        for k, v in params.items():
            if isinstance(v, DTensor):
                assert v.placements == model.get_parameter(k).placements, k
        _assert_tree({k: _full(v) for k, v in params.items()}, ref_params, bitwise=False,
                     rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"'3.bias' is a plain tensor beside tensor-parallel "
                                         r"\(DTensor\) params.*Fix: pass replicated=True"):
        zero1(functopt.adamw(1e-2), process_group=mesh["dp"].get_group()).init(params)


@check
def zero1_overlapped_equals_zero1(rank: int, world: int) -> None:
    """zero1_overlapped: the same step with the gather cut into buckets and left in flight.
    wait() and the forward pre-hooks of attach() give params bitwise zero1's, the state is
    bitwise zero1's, and a step makes one all_reduce and, on gloo, one all_gather per leaf
    of its buckets."""
    from functopt.distributed import zero1_overlapped
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3),
                                torch.nn.Linear(3, 1)).to(torch.bfloat16)
    kwargs = {"loss_scale": functopt.dynamic_loss_scale(init_scale=2.0**4), "max_grad_norm": 1.0}
    ref = zero1(functopt.adamw(1e-2, weight_decay=0.1), **kwargs)
    # at most 16 bytes of a rank's slices per bucket: several buckets at 2 and 4 ranks
    opt = zero1_overlapped(functopt.adamw(1e-2, weight_decay=0.1), bucket_bytes=16, **kwargs)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref_params = dict(params)
    state, ref_state = opt.init(params), ref.init(ref_params)
    from functopt.distributed.overlap import _buckets
    leaves = functopt.tree._core.flatten(params)[0]
    expected_buckets = len(_buckets(leaves, leaves, world, 16))
    assert expected_buckets >= 2, expected_buckets
    for step in range(3):
        g = torch.Generator().manual_seed(50 + step)
        grads = {n: torch.randn(p.shape, generator=g).to(p.dtype) for n, p in params.items()}
        with CommDebugMode() as comm:
            pending, state = opt.step(grads, state, params)
            new = pending.wait() if step != 1 else None
        counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
        assert sum(v for k, v in counts.items() if "allreduce" in k) == 1, counts
        assert sum(v for k, v in counts.items() if "allgather" in k) == len(leaves), counts
        ref_params, ref_state = ref.step(grads, ref_state, ref_params)
        if step == 1:  # through the module: each layer's forward waits for its params
            handles = pending.attach(model)
            assert len(handles) == 3  # the three Linear layers own params
            model(torch.ones(2, 6, dtype=torch.bfloat16))
            new = {n: p.detach().clone() for n, p in model.named_parameters()}
            assert not any(m._forward_pre_hooks for m in model)  # each hook removed itself
        assert new is not None
        _assert_tree(new, ref_params)  # bitwise
        _assert_tree(state, ref_state)
        params = new
    more = {**params, "extra": torch.ones(3, dtype=torch.bfloat16)}
    pending, s = opt.step({k: torch.ones_like(v) for k, v in more.items()}, opt.init(more), more)
    with pytest.raises(ValueError, match=r"PendingParams.attach: params leaves \['extra'\] are "
                                         r"not parameters of the module"):
        pending.attach(model)
    # a next step before the params arrived would step from stale params: refused
    assert not pending.arrived and pending.arrived_buckets == 0
    with pytest.raises(RuntimeError, match=r"the previous step's params are still being "
                                           r"gathered \(0 of \d+ buckets arrived\)"):
        opt.step({k: torch.ones_like(v) for k, v in more.items()}, s, more)
    pending.leaf("extra")  # one bucket
    assert 0 < pending.arrived_buckets < expected_buckets + 1
    pending.wait()
    assert pending.arrived
    opt.step({k: torch.ones_like(v) for k, v in more.items()}, s, more)[0].wait()


@check
def zero1_tensor_parallel_reduce_scattered_grads(rank: int, world: int) -> None:
    """ZeRO-1 x TP with reduce-scattered gradients: each data-parallel rank's own TP grads
    (DTensors placed like the params, plain for the Linear left out of the plan) go through
    zero1_reduce_scatter over the dp group, and the step on these slices is bitwise the step
    on the averaged grads (with 2 dp ranks the sum of two halves is the same either way)."""
    from distributed.replication_checks import _model
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    dp_group, dp = mesh["dp"].get_group(), mesh["dp"].size()
    model = _model()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    params = {n: p.detach() for n, p in model.named_parameters()}

    def place(tree: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {k: distribute_tensor(tree[k], v.device_mesh, v.placements)
                if isinstance(v, DTensor) else tree[k].clone() for k, v in params.items()}

    kwargs = {"max_grad_norm": 2.0, "fused": False}
    opt = zero1(functopt.adamw(1e-2), process_group=dp_group, replicated=True, **kwargs)
    state, ref_state = opt.init(params), opt.init(params)
    ref_params = params
    for step in range(3):
        # each dp rank's own gradients (alike over its TP ranks, as after the TP backward)
        own = [{k: torch.randn(v.shape, generator=torch.Generator().manual_seed(
            100 * step + 10 * d + i)) for i, (k, v) in enumerate(sorted(full.items()))}
            for d in range(dp)]
        mean = {k: sum((o[k] / dp for o in own), torch.zeros(())) for k in full}
        slices = zero1_reduce_scatter(place(own[mesh["dp"].get_local_rank()]),
                                      process_group=dp_group)
        assert all(not isinstance(s, DTensor) and s.dim() == 1 for s in slices.values())
        params, state = opt.step(slices, state, params)
        ref_params, ref_state = opt.step(place(mean), ref_state, ref_params)
        _assert_tree({k: _full(v) for k, v in params.items()},
                     {k: _full(v) for k, v in ref_params.items()})
        _assert_tree(state, ref_state)
    partial = DTensor.from_local(torch.ones(2), mesh["tp"], [Partial()])
    with pytest.raises(ValueError, match=r"'p' is a Partial DTensor"):
        zero1_reduce_scatter({"p": partial}, process_group=dp_group)


# ------------------------------------------------------------ bounded collectives
# Each runs alone in a launch of its own: a timed-out collective stays pending in the
# process group, which no later collective may meet.

TIMEOUT_S = 2.0


def stopped_rank_check(rank: int, world: int, where: str) -> tuple[float, str]:
    """Rank 1 stops at ``where`` of the step: ``"before the step"`` (it never steps: rank
    0 waits in the statistics' all-reduce), ``"before the all-gather"`` (it makes the
    step's statistics all-reduce, then waits), or ``"exits before the all-gather"`` (it
    makes the all-reduce and leaves: the harness destroys its process group and the
    process exits). Rank 0 steps with ``timeout=TIMEOUT_S``; returns its wait, in seconds,
    and the error's message with its notes."""
    import datetime
    import time

    from functopt.distributed.zero import _zero1_parts

    store = dist.distributed_c10d._get_default_store()
    params = {k: v for k, v in _params().items() if v is not None}
    grads = _grads(0, params)
    if rank != 0:
        if where != "before the step":  # this rank's part of the step, up to the gather
            init_fn, step_slices, _ = _zero1_parts(
                "zero1", functopt.adamw(1e-3), process_group=None, stats_group=None,
                replicated=None, loss_scale=None, master_weights=None, max_grad_norm=None,
                fused=True, timeout=TIMEOUT_S)
            step_slices(grads, init_fn(params), params)
        if where != "exits before the all-gather":
            store.wait(["raised"], datetime.timedelta(seconds=60))
        return 0.0, ""
    opt = zero1(functopt.adamw(1e-3), timeout=TIMEOUT_S)
    state = opt.init(params)
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError) as raised:
            opt.step(grads, state, params)
    finally:
        store.set("raised", "1")
    message = str(raised.value) + "\n".join(getattr(raised.value, "__notes__", []))
    return time.monotonic() - start, message
