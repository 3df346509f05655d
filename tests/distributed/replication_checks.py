"""Rank-side checks that a global norm counts every param once under tensor, expert and
pipeline parallelism, run by ``run_all`` in each rank (2 and 4 gloo ranks).

The reference is always one process: the same model (or the same tensors) whole, its
gradients' norm from ``functopt.precision.grad_stats``. The sums of squares are float32
per leaf and added in another order across ranks, so norms are compared to
``rtol=1e-6``; counts exactly.

- Tensor parallel (``parallelize_module`` on the ``"tp"`` dimension of a (world/2, 2)
  mesh, the same batch on every rank): the last ``Linear`` is left out of the plan, so its
  params and gradients are plain tensors holding the same values on both TP ranks
  (NeMo-RL issue 3788 over-clipped because of them); ``RowwiseParallel``'s bias is a
  ``Replicate()`` DTensor. Summing the plain gradients as each rank's part counts them
  twice; declared ``replicated=True`` they count once, with the group inferred from the
  mesh or given.
- Expert parallel: each rank holds its own expert (plain tensors, its part) beside dense
  params every rank holds alike; with ``replicated`` per leaf, the sum over the world is
  the one-process norm of all experts and the dense params once.
- 2-D mesh (4 ranks): DDP x TP DTensors (``[Replicate(), Shard(0)]``) summed over the TP
  group alone count each TP shard once per data-parallel replica, which is right there.
- Pipeline: stages on disjoint ranks with meshes of their own (no common mesh), combined
  through the group the user passes (WORLD); a plain param repeats over its stage's ranks
  (``replicated=<the stage's group>``).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import functopt
from distributed.checks import _assert_tree
from distributed.harness import check_registry, run_checks
from functopt import distributed as fdist
from functopt.precision import grad_stats, mixed_precision

CHECKS, check = check_registry()


def run_all(rank: int, world: int) -> dict[str, str | None]:
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.*")
    return run_checks(CHECKS, rank, world)


def _norm(packed: torch.Tensor) -> float:
    return float(packed[0].sqrt())


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4),
                               torch.nn.Linear(4, 3))  # "3": left out of the TP plan


def _tp_model_and_reference(mesh: DeviceMesh) -> tuple[torch.nn.Module, torch.nn.Module]:
    model = _model()
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))  # the same on every rank
    for m in (model, reference):
        (m(x) * 3.0).square().sum().backward()
    return model, reference


def _grads(model: torch.nn.Module) -> dict[str, Any]:
    return {n: p.grad for n, p in model.named_parameters()}


@check
def tensor_parallel_left_out_param_counted_once(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    model, reference = _tp_model_and_reference(mesh)
    grads = _grads(model)
    assert isinstance(grads["0.weight"], DTensor) and isinstance(grads["2.bias"], DTensor)
    assert grads["2.bias"].placements == (Replicate(),)
    assert type(grads["3.weight"]) is torch.Tensor  # left out of the plan: plain
    expected = grad_stats(list(_grads(reference).values()))
    left_out = grad_stats([grads["3.weight"], grads["3.bias"]])
    tp = mesh["tp"].get_group()
    declared = {n: n.startswith("3.") for n in grads}  # entries at DTensors are not read
    for group, replicated in ((None, True), (tp, True), (None, declared), (tp, declared)):
        with CommDebugMode() as comm:
            packed = fdist.global_grad_stats(grads, group, replicated=replicated)
        assert comm.get_total_counts() == 1
        torch.testing.assert_close(packed[0], expected[0], rtol=1e-6, atol=0.0)
        assert torch.equal(packed[1:], expected[1:]), (packed, expected)
    # the rule before the declaration existed (plain tensors as each rank's part) counts the
    # left-out param once per TP rank: the over-clipping of NeMo-RL issue 3788
    wrong = fdist.global_grad_stats(grads, tp, replicated=False)
    torch.testing.assert_close(wrong[0], expected[0] + left_out[0], rtol=1e-6, atol=0.0)
    assert _norm(wrong) > 1.05 * _norm(expected)
    # without a declaration: an error that says how
    with pytest.raises(ValueError, match=r"'3.bias' is a plain tensor in a sum over a process "
                                         r"group of 2 ranks.*Fix: pass replicated=True"):
        fdist.global_grad_stats(grads, tp)
    with pytest.raises(ValueError, match=r"'3.bias' is a plain tensor but '0.bias' is a "
                                         r"DTensor.*replicated=True"):
        fdist.global_grad_stats(grads)


@check
def tensor_parallel_mixed_precision_clips_like_one_process(rank: int, world: int) -> None:
    """mixed_precision(max_grad_norm) with the left-out param declared: the one-process
    norm, clip and step (pure and fused paths), one collective per step."""
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    model, reference = _tp_model_and_reference(mesh)
    params = {n: p.detach() for n, p in model.named_parameters()}
    ref_params = {n: p.detach() for n, p in reference.named_parameters()}
    for fused in (False, True):
        kwargs = {"max_grad_norm": 1.0, "fused": fused}
        opt = mixed_precision(functopt.adamw(1e-2), replicated=True, **kwargs)
        ref = mixed_precision(functopt.adamw(1e-2), **kwargs)
        with CommDebugMode() as comm:
            new, state = opt.step(_grads(model), opt.init(params), params)
        assert comm.get_total_counts() == 1
        ref_new, ref_state = ref.step(_grads(reference), ref.init(ref_params), ref_params)
        assert float(ref_state.metrics.grad_norm) > 1.0  # the clip is active
        torch.testing.assert_close(state.metrics.grad_norm, ref_state.metrics.grad_norm,
                                   rtol=1e-6, atol=0.0)
        _assert_tree(new, ref_new, bitwise=False, rtol=1e-5, atol=1e-7)
        with pytest.raises(ValueError, match=r"mixed_precision: '3.bias' is a plain tensor"):
            mixed_precision(functopt.adamw(1e-2), process_group=mesh["tp"].get_group(),
                            **kwargs).step(_grads(model), state, params)


def _expert_setup(rank: int, world: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Dense params alike on every rank, expert ``rank`` on rank ``rank``: (this rank's
    gradients, the one-process gradients of all experts)."""
    def grad(seed: int, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

    dense = {"embed": grad(1, 3, 4), "norm": grad(2, 4)}
    experts = [grad(10 + e, 4, 2) for e in range(world)]
    return ({"dense": dense, "expert": experts[rank]},
            {"dense": dense, **{f"expert{e}": x for e, x in enumerate(experts)}})


@check
def expert_parallel_dense_counted_once(rank: int, world: int) -> None:
    grads, everything = _expert_setup(rank, world)
    expected = grad_stats(functopt.tree._core.flatten(everything)[0])
    group = dist.group.WORLD
    for replicated in ({"dense": True, "expert": False}, lambda g: {"dense": True, "expert": False}):
        packed = fdist.global_grad_stats(grads, group, replicated=replicated)
        torch.testing.assert_close(packed[0], expected[0], rtol=1e-6, atol=0.0)
    wrong = fdist.global_grad_stats(grads, group, replicated=False)  # dense counted per rank
    dense = grad_stats(functopt.tree._core.flatten(grads["dense"])[0])
    torch.testing.assert_close(wrong[0], expected[0] + (world - 1) * dense[0], rtol=1e-6,
                               atol=0.0)
    with pytest.raises(ValueError, match=r"'dense.embed' is a plain tensor in a sum over"):
        fdist.global_grad_stats(grads, group)
    # the experts as one Shard(0) DTensor over the world, dense plain: the group inferred
    mesh = init_device_mesh("cpu", (world,))
    stacked = torch.stack([everything[f"expert{e}"] for e in range(world)])
    as_dtensors = {"dense": grads["dense"],
                   "experts": distribute_tensor(stacked, mesh, [Shard(0)])}
    packed = fdist.global_grad_stats(as_dtensors, replicated={"dense": True, "experts": False})
    torch.testing.assert_close(packed[0], expected[0], rtol=1e-6, atol=0.0)


@check
def two_d_mesh_dtensors_with_explicit_groups(rank: int, world: int) -> None:
    """DTensors on the whole (dp, tp) mesh: WORLD and the inferred group count each element
    once; the TP group alone is right for DDP x TP params and refused for FSDP x TP."""
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    y = torch.arange(24.0).reshape(6, 4) - 5.0  # one zero
    expected = grad_stats([y])
    tp = mesh["tp"].get_group()
    for placements, groups in (([Replicate(), Shard(0)], (None, dist.group.WORLD, tp)),
                               ([Shard(0), Shard(1)], (None, dist.group.WORLD)),
                               ([Replicate(), Replicate()], (None, dist.group.WORLD, tp))):
        d = distribute_tensor(y, mesh, placements)
        for group in groups:
            packed = fdist.global_grad_stats({"y": d}, group)
            assert torch.equal(packed[1:], expected[1:]), (placements, group, packed)
            torch.testing.assert_close(packed[0], expected[0], rtol=1e-6, atol=0.0)
    if world >= 4:  # the dp dimension has other ranks: a Shard over it needs them
        d = distribute_tensor(y, mesh, [Shard(0), Shard(1)])
        with pytest.raises(ValueError, match=r"sharded \(Shard\(dim=0\)\) along mesh dimension 0"
                                             r".*not in the process group"):
            fdist.global_grad_stats({"y": d}, tp)


@check
def pipeline_stages_through_the_given_group(rank: int, world: int) -> None:
    """Two stages on disjoint ranks, each with its own mesh; WORLD combines them. Each
    stage holds a TP-sharded DTensor and a plain param alike on its ranks."""
    per_stage = world // 2
    stage = rank // per_stage
    stage_groups = [dist.new_group(list(range(s * per_stage, (s + 1) * per_stage)))
                    for s in range(2)]  # every rank creates every group
    stage_group = stage_groups[stage]
    mesh = DeviceMesh.from_group(stage_group, "cpu")
    full = {f"stage{s}": {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(s)),
                          "b": torch.randn(3, generator=torch.Generator().manual_seed(9 + s))}
            for s in range(2)}
    expected = grad_stats(functopt.tree._core.flatten(full)[0])
    mine = full[f"stage{stage}"]
    grads = {"w": distribute_tensor(mine["w"], mesh, [Shard(0)]), "b": mine["b"]}
    packed = fdist.global_grad_stats(grads, dist.group.WORLD, replicated=stage_group)
    torch.testing.assert_close(packed[0], expected[0], rtol=1e-6, atol=0.0)
    if per_stage > 1:  # True would mean "alike on all of WORLD": stage 1's b never counted
        wrong = fdist.global_grad_stats(grads, dist.group.WORLD, replicated=True)
        assert wrong[0] < expected[0]
    other = stage_groups[1 - stage]
    with pytest.raises(ValueError, match=r"NON_GROUP_MEMBER.*declared replicated over a "
                                         r"process group this rank \(\d\) is not in"):
        fdist.global_grad_stats(grads, dist.group.WORLD, replicated=other)


@check
def fsdp_tp_left_out_param_declared_on_its_sub_mesh(rank: int, world: int) -> None:
    """FSDP2 x TP on a (world/2, 2) mesh with the last Linear left out of the TP plan: FSDP2
    shards it over the dp sub-mesh alone, a DTensor inside the 2-D mesh of the others. A sum
    over WORLD counted it once per TP rank (a norm of 2.58 for 1.97 at 4 ranks); undeclared
    it now raises, declared True or over the TP group it is counted once."""
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    model = _model()
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    dp, rows = mesh["dp"].get_local_rank(), 8 // (world // 2)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    model(x[dp * rows:(dp + 1) * rows]).square().mean().backward()
    reference(x).square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["3.weight"].device_mesh.ndim == 1 and grads["0.weight"].device_mesh.ndim == 2
    expected = grad_stats([p.grad for p in reference.parameters()])
    with pytest.raises(ValueError, match=r"'3\.\w+' is a DTensor on mesh .* inside the mesh of "
                                         r"'0\.\w+'.*Fix: declare it with replicated=True"):
        fdist.global_grad_stats(grads, dist.group.WORLD)
    per_leaf = {n: n.startswith("3.") for n in grads}  # read at the sub-mesh leaves only
    for declared in (True, mesh["tp"].get_group(), per_leaf):
        packed = fdist.global_grad_stats(grads, dist.group.WORLD, replicated=declared)
        torch.testing.assert_close(packed[0], expected[0], rtol=1e-5, atol=0.0)
        assert torch.equal(packed[1:], expected[1:])
    # False: values of their own on each TP rank, summed: the old over-count
    wrong = fdist.global_grad_stats(grads, dist.group.WORLD, replicated=False)
    left_out = grad_stats([reference[3].weight.grad, reference[3].bias.grad])[0]
    torch.testing.assert_close(wrong[0], expected[0] + left_out, rtol=1e-5, atol=0.0)
    if world >= 4:  # the dp group is the leaf's own mesh: it does not cross it
        with pytest.raises(ValueError, match=r"must cross its mesh .* in this rank"):
            fdist.global_grad_stats(grads, dist.group.WORLD, replicated=mesh["dp"].get_group())
    # the mixed-precision step clips by the one-process norm
    params = {n: p.detach() for n, p in model.named_parameters()}
    opt = mixed_precision(functopt.adamw(1e-2), max_grad_norm=0.01,
                          process_group=dist.group.WORLD, replicated=True)
    _, state = opt.step(grads, opt.init(params), params)
    torch.testing.assert_close(state.metrics.grad_norm, expected[0].sqrt().float(), rtol=1e-5,
                               atol=0.0)
