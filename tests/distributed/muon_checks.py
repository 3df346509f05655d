"""Rank-side checks of Muon on DTensor / FSDP2 params, run by ``run_all`` in each rank.

Newton-Schulz needs whole matrices. ``scale_by_muon`` gives each sharded matrix one owner
rank, gathers the momentum shards to the owners in one all-to-all and scatters the updates
back in another (``functopt/_collective/owners.py``). The checks hold the sharded step to a
single-process run of the same transform on the whole tensors, in this rank (one thread,
so the same kernels run on the same whole matrix): every leaf of the updates and the state
is compared after several steps. They count the collectives with ``CommDebugMode`` and the
bytes each rank sends and receives with a dispatch mode that reads the all-to-all's split
sizes, against sizes computed here from ``torch.chunk``.

Shards are uneven on purpose (5 rows over 2 ranks are 3 + 2; over 4 ranks 2 + 2 + 1 + 0;
a 1-row matrix lives on rank 0 only). ``tests/test_distributed_muon.py`` runs the checks
at 2 and 4 ranks; the 2-D mesh checks (a 2 x 2 mesh of DTensors, and FSDP2 over tensor
parallelism, whose column-parallel weights are FSDP2's strided shards) run at 4.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

import functopt
from distributed import checks as _fsdp
from distributed.checks import _assert_tree, _full, _mesh
from distributed.harness import check_registry, run_checks
from functopt import contrib
from functopt._collective import owners as owners_module
from functopt.contrib import _muon
from functopt.fast import FastPathWarning
from functopt.precision import mixed_precision

CHECKS, check = check_registry()
DN = contrib.MuonDimensionNumbers


def run_all(rank: int, world: int) -> dict[str, str | None]:
    """Run every check in this rank; a barrier after each keeps the ranks in step."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    return run_checks(CHECKS, rank, world)


class _AllToAllBytes(TorchDispatchMode):
    """Records, per ``all_to_all_single``, the bytes this rank sends to and receives from
    other ranks (its own split is a local copy, counted apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int]] = []  # (sent, received) bytes, self excluded

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._overloadpacket is torch.ops.c10d.alltoall_base_:
            _output, inp, _group, out_splits, in_splits = args[:5]
            me = dist.get_rank()
            item = inp.element_size()
            sent = sum(s for r, s in enumerate(in_splits) if r != me) * item
            recv = sum(s for r, s in enumerate(out_splits) if r != me) * item
            assert in_splits[me] == 0 and out_splits[me] == 0, "a rank sends itself nothing"
            self.calls.append((sent, recv))
        return func(*args, **(kwargs or {}))


def _tree(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Matrices wide, tall, square, uneven (5 rows), one row (on rank 0 only), a 3-D leaf
    read with dimension numbers, and a bias for AdamW."""
    torch.manual_seed(0)
    return {
        "wide": torch.randn(5, 9, dtype=dtype),
        "tall": torch.randn(12, 4, dtype=dtype),
        "square": torch.randn(6, 6, dtype=dtype),
        "row": torch.randn(1, 7, dtype=dtype),
        "heads": torch.randn(4, 3, 5, dtype=dtype),
        "bias": torch.randn(5, dtype=dtype),
    }


_DIMS = {"wide": DN(), "tall": DN(), "square": DN(), "row": DN(), "bias": None,
         "heads": DN(reduction_axis=1, output_axis=2)}  # batch axis 0: 4 matrices (3, 5)


def _recipe() -> functopt.GradientTransformation:
    return contrib.muon(0.02, weight_decay=0.01, adaptive=True,
                        muon_weight_dimension_numbers=_DIMS)


def _shard_tree(tree: dict[str, torch.Tensor], mesh: Any,
                placements: dict[str, list[Any]] | None = None) -> dict[str, DTensor]:
    placements = placements or {}
    return {k: distribute_tensor(v, mesh, placements.get(k, [Shard(0)])) for k, v in tree.items()}


def _grads(step: int, tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in tree.items()}


def _placed_like(state: Any, params: dict[str, DTensor]) -> int:
    """Assert every per-param state leaf (a leaf of the params' shape) is a DTensor placed
    as its param; returns how many there are."""
    by_shape = {tuple(p.shape): p for p in params.values()}
    n = 0
    for leaf in functopt.tree._core.flatten(state)[0]:
        if isinstance(leaf, DTensor):
            p = by_shape[tuple(leaf.shape)]
            assert leaf.placements == p.placements and leaf.device_mesh == p.device_mesh
            n += 1
        elif isinstance(leaf, torch.Tensor):  # counters and coefficients only
            assert tuple(leaf.shape) not in by_shape, f"plain state of shape {leaf.shape}"
    return n


def _run_against_single(tx: functopt.GradientTransformation, full: dict[str, torch.Tensor],
                        params: dict[str, DTensor], steps: int, **tol: float) -> Any:
    state, ref_state = tx.init(params), tx.init(full)
    ref_params = dict(full)
    for step in range(steps):
        gfull = _grads(step, full)
        grads = {k: distribute_tensor(v, p.device_mesh, p.placements)
                 for (k, v), p in zip(gfull.items(), params.values(), strict=True)}
        updates, state = tx.update(grads, state, params)
        ref_updates, ref_state = tx.update(gfull, ref_state, ref_params)
        _assert_tree(updates, ref_updates, bitwise=not tol, **tol)
        params = functopt.apply_updates(params, updates)
        ref_params = functopt.apply_updates(ref_params, ref_updates)
    _assert_tree(state, ref_state, bitwise=not tol, **tol)
    _assert_tree(params, ref_params, bitwise=not tol, **tol)
    return state, params


@check
def muon_shard0_equals_single_process_float64(rank: int, world: int) -> None:
    """muon (adaptive, decay, a 3-D leaf, a bias by AdamW) on Shard(0) float64 params:
    five steps, every update, state and param bitwise the single-process run's."""
    mesh = _mesh(world)
    full = _tree(torch.float64)
    params = _shard_tree(full, mesh)
    state, _ = _run_against_single(_recipe(), full, params, steps=5)
    # mu of the Muon chain and mu, nu of AdamW: all DTensors placed as their params
    assert _placed_like(state, params) == 5 + 2


@check
def muon_tensor_parallel_float32(rank: int, world: int) -> None:
    """Row-wise (Shard(1)), column-wise (Shard(0)) and replicated float32 params, with
    Nesterov off and the spectral preconditioning: bitwise the single-process run."""
    mesh = _mesh(world)
    full = _tree(torch.float32)
    placements = {"wide": [Shard(1)], "tall": [Shard(0)], "square": [Replicate()],
                  "row": [Shard(1)], "heads": [Shard(2)], "bias": [Replicate()]}
    params = _shard_tree(full, mesh, placements)
    tx = contrib.muon(0.02, nesterov=False, preconditioning="spectral",
                      muon_weight_dimension_numbers=_DIMS)
    _run_against_single(tx, full, params, steps=3)


@check
def scale_by_muon_on_fully_sharded_module(rank: int, world: int) -> None:
    """scale_by_muon on the params of a fully_shard-ed module (FSDP2's Shard(0) DTensors):
    equal to the single-process run; its mu is placed as the params."""
    mesh = _mesh(world)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(5, 3, bias=False)).double()
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    fully_shard(model, mesh=mesh)
    params = {k: v.detach() for k, v in model.named_parameters()}
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in params.values())
    tx = contrib.scale_by_muon(weight_dimension_numbers=DN(reduction_axis=1, output_axis=0))
    state, _ = _run_against_single(tx, full, params, steps=3)
    assert _placed_like(state.mu, params) == 2


def _chunk_numel(shape: tuple[int, ...], dim: int, world: int) -> list[int]:
    """Elements of each rank's ``Shard(dim)`` piece, from torch.chunk (an empty list entry
    where chunk makes fewer pieces than ranks)."""
    pieces = [c.numel() for c in torch.empty(shape).chunk(world, dim=dim)]
    return pieces + [0] * (world - len(pieces))


@check
def communication_two_all_to_alls_and_their_bytes(rank: int, world: int) -> None:
    """One muon step on Shard(0) params makes exactly two collectives (all-to-alls), and
    each rank sends and receives the bytes the owner rule predicts: the gather sends each
    shard a rank does not own to its owner, the scatter sends each non-owner its shard."""
    mesh = _mesh(world)
    full = _tree(torch.float32)
    params = _shard_tree(full, mesh)
    tx = _recipe()
    state = tx.init(params)
    grads = _shard_tree(_grads(0, full), mesh)
    with CommDebugMode() as comm, _AllToAllBytes() as seen:
        tx.update(grads, state, params)
    assert comm.get_total_counts() == 2, comm.get_comm_counts()
    assert comm.get_comm_counts()[torch.ops.c10d.alltoall_base_] == 2
    matrices = [k for k, d in _DIMS.items() if d is not None]
    costs = [_muon._ns_cost(full[k].shape, _DIMS[k]) for k in matrices]
    owner_of = dict(zip(matrices, owners_module.assign_owners(costs, world), strict=True))
    item = 4  # float32 momentum and float32 updates
    sent = sum(_chunk_numel(full[k].shape, 0, world)[rank] * item
               for k in matrices if owner_of[k] != rank)
    received = sum((full[k].numel() - _chunk_numel(full[k].shape, 0, world)[rank]) * item
                   for k in matrices if owner_of[k] == rank)
    # the scatter is the gather reversed
    assert seen.calls == [(sent, received), (received, sent)], (seen.calls, sent, received)


@check
def communication_bytes_with_replicated_and_column_shards(rank: int, world: int) -> None:
    """The byte rule with copies: a Replicate() matrix needs no gather at all (its owner
    holds it whole) and its update goes to the W - 1 other copies; Shard(1) pieces are
    torch.chunk's along the columns; a float64 matrix travels at 8 bytes an element."""
    mesh = _mesh(world)
    full = {"rep": torch.randn(6, 5), "col": torch.randn(4, 7),
            "wide64": torch.randn(3, 9, dtype=torch.float64)}
    placements = {"rep": [Replicate()], "col": [Shard(1)], "wide64": [Shard(0)]}
    params = _shard_tree(full, mesh, placements)
    tx = contrib.scale_by_muon()
    grads = _shard_tree(_grads(0, full), mesh, placements)
    with CommDebugMode() as comm, _AllToAllBytes() as seen:
        tx.update(grads, tx.init(params), params)
    assert comm.get_total_counts() == 2, comm.get_comm_counts()
    keys = list(full)
    owner_of = dict(zip(keys, owners_module.assign_owners(
        [_muon._ns_cost(full[k].shape, DN()) for k in keys], world), strict=True))
    mine = {"rep": full["rep"].numel(), "col": _chunk_numel((4, 7), 1, world)[rank],
            "wide64": _chunk_numel((3, 9), 0, world)[rank]}
    copies = {"rep": world, "col": 1, "wide64": 1}
    item = {k: full[k].element_size() for k in keys}
    gather_sent = sum(mine[k] * item[k] for k in keys if owner_of[k] != rank and copies[k] == 1)
    gather_recv = sum((full[k].numel() - mine[k]) * item[k] for k in keys if owner_of[k] == rank)
    scatter_sent = sum((copies[k] * full[k].numel() - mine[k]) * item[k]
                       for k in keys if owner_of[k] == rank)
    scatter_recv = sum(mine[k] * item[k] for k in keys if owner_of[k] != rank)
    assert seen.calls == [(gather_sent, gather_recv), (scatter_sent, scatter_recv)], (
        seen.calls, owner_of)


@check
def work_is_spread_over_the_ranks(rank: int, world: int) -> None:
    """Each matrix is orthogonalised on exactly one rank, and every rank gets work when
    there are at least as many matrices as ranks (the owners balance the iteration cost)."""
    mesh = _mesh(world)
    full = _tree(torch.float32)
    params = _shard_tree(full, mesh)
    tx = _recipe()
    state = tx.init(params)
    seen: list[tuple[int, ...]] = []
    real = _muon._orthogonalize

    def counting(x: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return real(x, *args)

    _muon._orthogonalize = counting
    try:
        tx.update(_shard_tree(_grads(0, full), mesh), state, params)
    finally:
        _muon._orthogonalize = real
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, seen)
    shapes = sorted(s for per_rank in everyone for s in per_rank)
    assert shapes == sorted([(1, 5, 9), (1, 12, 4), (1, 6, 6), (1, 1, 7), (4, 3, 5)])
    assert all(everyone), f"a rank without work: {everyone}"


@check
def mixed_precision_bf16_params_fp32_masters(rank: int, world: int) -> None:
    """mixed_precision(muon) on bfloat16 Shard(0) params with float32 masters: the mixed
    step takes the planner's per-leaf tier (no FastPathWarning), and after three steps
    params, masters and Muon's state equal the single-process run bitwise; every param is
    its master rounded."""
    mesh = _mesh(world)
    full = {k: v.to(torch.bfloat16) for k, v in _tree(torch.float32).items()}
    params: dict[str, Any] = _shard_tree(full, mesh)
    opt = mixed_precision(_recipe(), loss_scale=functopt.dynamic_loss_scale(init_scale=2.0**4))
    state, ref_state = opt.init(params), opt.init(full)
    ref_params: dict[str, Any] = dict(full)
    for step in range(3):
        gfull = {k: (v * 2.0**4).to(torch.bfloat16) for k, v in _grads(step, full).items()}
        with warnings.catch_warnings():
            warnings.simplefilter("error", FastPathWarning)
            params, state = opt.step(_shard_tree(gfull, mesh), state, params)
            ref_params, ref_state = opt.step(gfull, ref_state, ref_params)
    _assert_tree(params, ref_params)
    _assert_tree(state.master, ref_state.master)
    _assert_tree(state.inner_state, ref_state.inner_state)
    assert _placed_like(state.inner_state, params) == 5 + 2
    for k, p in params.items():
        assert isinstance(p, DTensor) and p.dtype == torch.bfloat16
        assert torch.equal(_full(state.master[k]).to(torch.bfloat16), _full(p)), k


@check
def a_partial_placement_is_refused_by_name(rank: int, world: int) -> None:
    """A DTensor whose placement is not Shard or Replicate cannot be gathered: a ValueError
    names the leaf and the placement."""
    mesh = _mesh(world)
    partial = DTensor.from_local(torch.ones(3, 4), mesh, [Partial()])
    with pytest.raises(ValueError, match=r"'layers\.0'.*Partial"):
        owners_module.gather_to_owners([partial], [0], names=lambda j: "layers.0")


@check
def two_dimensional_mesh(rank: int, world: int) -> None:
    """On a 2 x 2 mesh (4 ranks): [Shard(0), Shard(1)] (both dimensions sharded),
    [Replicate(), Shard(0)] (data-parallel copies of a tensor-parallel shard) and
    [Shard(1), Replicate()]: bitwise the single-process run."""
    if world != 4:
        return
    mesh = init_device_mesh("cpu", (2, 2))
    full = _tree(torch.float64)
    placements = {"wide": [Shard(0), Shard(1)], "tall": [Replicate(), Shard(0)],
                  "square": [Shard(1), Replicate()], "row": [Shard(1), Shard(1)],
                  "heads": [Shard(0), Shard(2)], "bias": [Replicate(), Shard(0)]}
    params = _shard_tree(full, mesh, placements)
    _run_against_single(_recipe(), full, params, steps=2)
    assert math.prod(mesh.mesh.shape) == world


@check
def fsdp2_training_equals_single_process_float64(rank: int, world: int) -> None:
    """Three training steps of a float64 MLP under FSDP2 (each rank its slice of the batch,
    FSDP averaging the gradients) with muon against one process on the whole batch: the
    params agree to 1e-12 (the gradients differ by the rounding of the batch mean only)."""
    model = _fsdp._shard(_fsdp._mlp(torch.float64), _mesh(world))
    single = _fsdp._mlp(torch.float64)
    torch_layout = {"0.weight": DN(reduction_axis=1, output_axis=0), "0.bias": None,
                    "2.weight": DN(reduction_axis=1, output_axis=0), "2.bias": None}
    tx = contrib.muon(0.05, weight_decay=0.01, muon_weight_dimension_numbers=torch_layout)
    state, ref_state = tx.init(_fsdp._params(model)), tx.init(_fsdp._params(single))
    for step in range(3):
        _fsdp._sharded_backward(model, step, rank, world)
        params = _fsdp._params(model)
        updates, state = tx.update(_fsdp._grads(model), state, params)
        _fsdp._write(model, functopt.apply_updates(params, updates))
        _fsdp._loss(single, *_fsdp._batch(step, world, torch.float64)).backward()
        ref = _fsdp._params(single)
        ref_updates, ref_state = tx.update(_fsdp._grads(single), ref_state, ref)
        _fsdp._write(single, functopt.apply_updates(ref, ref_updates))
    _assert_tree(_fsdp._params(model), _fsdp._params(single), bitwise=False,
                 rtol=0.0, atol=1e-12)


@check
def make_step_runs_sharded_muon_on_the_per_leaf_tier(rank: int, world: int) -> None:
    """functopt.fast.make_step(muon), donating, on Shard(0) params: the planner's per-leaf
    tier (explain says so, no FastPathWarning), bitwise the update plus apply_updates,
    params and state still DTensors placed as before, and still two collectives per step;
    inside inject_hyperparams too, its values changed between steps."""
    mesh = _mesh(world)
    full = _tree(torch.float32)
    # the recipe, and the recipe inside inject_hyperparams (as functopt.Optimizer lifts
    # it) with a learning rate and decay that change between steps
    injected = functopt.inject_hyperparams(contrib.muon, static_args=(
        "muon_weight_dimension_numbers",))(learning_rate=0.02, weight_decay=0.01,
                                           adaptive=True, muon_weight_dimension_numbers=_DIMS)

    def new_values(i: int, state: Any) -> Any:
        return state._replace(hyperparams={
            **state.hyperparams, "learning_rate": torch.tensor(0.02 / (1 + i)),
            "weight_decay": torch.tensor(0.01 * i)})

    for tx, edit in ((_recipe(), None), (injected, new_values)):
        step = functopt.fast.make_step(tx, donate=True)
        params, ref_params = _shard_tree(full, mesh), _shard_tree(full, mesh)
        explained = functopt.fast.explain(tx, params)
        assert explained.fast and {g.kernel for g in explained.groups} == {"per-leaf"}, (
            explained)
        _two_exchanges_per_step(tx, step, full, mesh, params, ref_params, edit)


@check
def per_leaf_tier_with_a_decay_mask_still_makes_two_exchanges(rank: int,
                                                              world: int) -> None:
    """A weight-decay mask splits Muon's matrices into two per-leaf groups (decayed or
    not); the tier runs the rules rule-major, so Muon is called once for both groups:
    still two all-to-alls per step, bitwise update plus apply_updates, the state placed as
    the params."""
    mesh = _mesh(world)
    full = _tree(torch.float32)
    tx = contrib.muon(0.02, weight_decay=0.1, muon_weight_dimension_numbers=_DIMS,
                      weight_decay_mask=lambda p: {k: k in ("wide", "square") for k in p})
    step = functopt.fast.make_step(tx)
    params, ref_params = _shard_tree(full, mesh), _shard_tree(full, mesh)
    explained = functopt.fast.explain(tx, params)
    muon_groups = [g for g in explained.groups if g.rules[0] == "scale_by_muon"]
    assert len(muon_groups) == 2, explained
    _two_exchanges_per_step(tx, step, full, mesh, params, ref_params)


def _two_exchanges_per_step(tx: functopt.GradientTransformation, step: Any,
                            full: dict[str, torch.Tensor], mesh: Any, params: Any,
                            ref_params: Any, new_values: Any = None) -> None:
    """Two fast steps on the shards, each with two collectives (Muon's all-to-alls) and no
    FastPathWarning, bitwise update plus apply_updates, the state placed as the params;
    ``new_values(i, state)``, when given, edits both states before step ``i``."""
    state, ref_state = tx.init(params), tx.init(ref_params)
    for i in range(2):
        if new_values is not None:
            state, ref_state = new_values(i, state), new_values(i, ref_state)
        grads = _shard_tree(_grads(i, full), mesh)
        ref_updates, ref_state = tx.update(grads, ref_state, ref_params)
        ref_params = functopt.apply_updates(ref_params, ref_updates)
        with CommDebugMode() as comm, warnings.catch_warnings():
            warnings.simplefilter("error", FastPathWarning)
            params, state = step(grads, state, params)
        assert comm.get_total_counts() == 2, comm.get_comm_counts()
    _assert_tree(params, ref_params)
    _assert_tree(state, ref_state)
    assert _placed_like(state, ref_params) == 5 + 2


@check
def fsdp2_over_tensor_parallel_2d_mesh(rank: int, world: int) -> None:
    """fully_shard over ColwiseParallel / RowwiseParallel on a (dp 2, tp 2) mesh (4 ranks):
    the column-parallel weight becomes (_StridedShard(0, sf=2), Shard(0)), the row-parallel
    one (Shard(0), Shard(1)). Muon's updates of the real gradients equal one process's on
    the gradients DTensor itself gathers (full_tensor), bitwise, over two steps."""
    if world != 4:
        return
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(),
                                torch.nn.Linear(10, 5)).double()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    params = {k: v.detach() for k, v in model.named_parameters()}
    strided = params["0.weight"].placements[0]
    assert type(strided).__name__ == "_StridedShard", params["0.weight"].placements
    assert params["2.weight"].placements == (Shard(0), Shard(1))
    layout = {k: DN(reduction_axis=1, output_axis=0) if v.dim() == 2 else None
              for k, v in params.items()}
    tx = contrib.muon(0.02, muon_weight_dimension_numbers=layout)
    state = tx.init(params)
    ref_state = tx.init({k: _full(v) for k, v in params.items()})
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
        dp = mesh.get_coordinate()[0]
        model(x[4 * dp:4 * dp + 4]).square().mean().backward()
        params = {k: v.detach() for k, v in model.named_parameters()}
        grads = {k: v.grad for k, v in model.named_parameters()}
        with CommDebugMode() as comm:
            updates, state = tx.update(grads, state, params)
        assert comm.get_comm_counts()[torch.ops.c10d.alltoall_base_] == 2
        ref_updates, ref_state = tx.update({k: _full(g) for k, g in grads.items()}, ref_state,
                                           {k: _full(p) for k, p in params.items()})
        for k, u in updates.items():
            assert isinstance(u, DTensor) and u.placements == params[k].placements, k
            assert torch.equal(_full(u), ref_updates[k]), k
        new = functopt.apply_updates(params, updates)
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(new[k])
                p.grad = None
    _assert_tree(state, ref_state)


@check
def checkpoint_of_sharded_state_continues_bitwise(rank: int, world: int) -> None:
    """Muon's sharded state saved with torch.distributed.checkpoint after two steps and
    loaded into a fresh state: two more steps are bitwise the uninterrupted run."""
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp

    from functopt import distributed as fdist

    mesh = _mesh(world)
    full = _tree(torch.float32)
    tx = _recipe()

    def steps(params: Any, state: Any, which: range) -> tuple[Any, Any]:
        for i in which:
            updates, state = tx.update(_shard_tree(_grads(i, full), mesh), state, params)
            params = functopt.apply_updates(params, updates)
        return params, state

    params = _shard_tree(full, mesh)
    ref_params, ref_state = steps(params, tx.init(params), range(4))
    params, state = steps(params, tx.init(params), range(2))
    box = [tempfile.mkdtemp(prefix="functopt-muon-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    try:
        dcp.save({"params": params, "opt": fdist.state_to_dict(state, params)},
                 checkpoint_id=box[0])
        loaded_params = _shard_tree({k: torch.zeros_like(v) for k, v in full.items()}, mesh)
        template = tx.init(loaded_params)
        target = {"params": loaded_params, "opt": fdist.state_to_dict(template, loaded_params)}
        dcp.load(target, checkpoint_id=box[0])
        loaded = fdist.state_from_dict(target["opt"], template)
        assert _placed_like(loaded, loaded_params) == 5 + 2
        params, state = steps(target["params"], loaded, range(2, 4))
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)
    _assert_tree(params, ref_params)
    _assert_tree(state, ref_state)
