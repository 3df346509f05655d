"""Rank-side checks that ``MixedPrecisionOptimizer``'s ranks agree on every skip decision.

``run_all`` runs the checks of ``CHECKS`` in one launch (a barrier after each);
``timeout_check`` runs alone in a launch of its own: it leaves rank 0's timed-out
all-reduce pending in the process group, which no later collective may meet.

The params are plain tensors (no DTensor) unless a check says otherwise: Megatron-style
tensor-parallel slices (each rank holds half of ``w``'s rows; ``b`` is whole on every
rank), or DDP-style replicated params with the same gradients on every rank. The
reference is one process holding the whole tensors, stepped by the same optimizer.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode

import functopt
from distributed.harness import check_registry, run_checks

CHECKS, check = check_registry()

NAN_STEP = 1  # the step whose gradient on rank 1 holds a nan


def run_all(rank: int, world: int) -> dict[str, str | None]:
    return run_checks(CHECKS, rank, world)


def _full(step: int) -> dict[str, torch.Tensor]:
    """The whole tensors (``'w'``, ``'b'``) and their gradients at ``step``."""
    g = torch.Generator().manual_seed(10 + step)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def _params(rank: int, world: int, *, sliced: bool) -> dict[str, torch.nn.Parameter]:
    """bfloat16 params: ``w``'s rows split over the ranks when ``sliced``, else whole."""
    full = _full(-1)
    w = full["w"].chunk(world)[rank] if sliced else full["w"]
    return {"w": torch.nn.Parameter(w.to(torch.bfloat16).clone()),
            "b": torch.nn.Parameter(full["b"].to(torch.bfloat16).clone())}


def _set_grads(params: dict[str, torch.nn.Parameter], step: int, rank: int, world: int, *,
               sliced: bool, nan_on: int | None) -> None:
    full = _full(step)
    for name, p in params.items():
        g = full[name].chunk(world)[rank] if sliced and name == "w" else full[name]
        g = g.to(torch.bfloat16).clone() * 1024.0  # a scaled gradient (exact: power of two)
        if rank == nan_on and name == "w":
            g[0, 0] = float("nan")
        p.grad = g


def _facade(params: dict[str, torch.nn.Parameter], **options: Any,
            ) -> functopt.MixedPrecisionOptimizer:
    opt = functopt.MixedPrecisionOptimizer(
        params, functopt.adamw(1e-2, weight_decay=0.1),
        loss_scale=functopt.dynamic_loss_scale(init_scale=1024.0), return_grad_stats=True,
        **options)
    opt.clip_grad_norm(None, 0.5)  # below every step's norm: clipping acts
    return opt


def _reference(steps: int, nan_at: int | None) -> list[tuple[Any, ...]]:
    """One process holding the whole tensors: per step ``(result, loss scale, w, b)``.
    (Every rank runs it alike at the same point: its agreement sums equal verdicts.)"""
    params = _params(0, 1, sliced=False)
    opt = _facade(params)
    out = []
    for step in range(steps):
        _set_grads(params, step, 0, 1, sliced=False, nan_on=0 if step == nan_at else None)
        out.append((opt.step(), opt.loss_scale, params["w"].detach().clone(),
                    params["b"].detach().clone()))
    return out


def _assert_like_reference(rank: int, world: int, results: list[tuple[Any, ...]], *,
                           sliced: bool, nan_at: int | None) -> None:
    for step, (got, ref) in enumerate(zip(results, _reference(len(results), nan_at),
                                          strict=True)):
        (ok, norm, _), scale, w, b = got
        (ref_ok, ref_norm, _), ref_scale, ref_w, ref_b = ref
        assert ok == ref_ok == (step != nan_at), (rank, step, ok, ref_ok)
        assert scale == ref_scale, (rank, step, scale, ref_scale)
        if ok:  # the same squares summed in another order: a few float64 ulps
            assert norm == pytest.approx(ref_norm, rel=1e-6), (rank, step, norm, ref_norm)
        ref_w = ref_w.chunk(world)[rank] if sliced else ref_w
        # Adam is elementwise; the clip factor may differ in its last bits
        torch.testing.assert_close(w, ref_w, rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(b, ref_b, rtol=1e-2, atol=1e-3)


def _run(opt: functopt.MixedPrecisionOptimizer, params: dict[str, torch.nn.Parameter],
         rank: int, world: int, *, steps: int, sliced: bool, nan_at: int | None,
         ) -> tuple[list[tuple[Any, ...]], list[int]]:
    """Per step ``(result, loss scale, w, b)``, and the collectives of each step."""
    out, counts = [], []
    for step in range(steps):
        _set_grads(params, step, rank, world, sliced=sliced,
                   nan_on=1 if step == nan_at else None)
        with CommDebugMode() as comm:
            result = opt.step()
        counts.append(comm.get_total_counts())
        out.append((result, opt.loss_scale, params["w"].detach().clone(),
                    params["b"].detach().clone()))
    return out, counts


# -------------------------------------------------------------------------------- checks

@check
def plain_shards_nan_on_one_rank_skips_every_rank(rank: int, world: int) -> None:
    """Plain-tensor slices, no declaration: the nan in rank 1's slice skips every rank and
    halves every rank's loss scale (the verdict's one small all-reduce per step), on the
    fused and the pure path."""
    for fused in (True, False):
        params = _params(rank, world, sliced=True)
        opt = _facade(params, fused=fused)
        results, counts = _run(opt, params, rank, world, steps=3, sliced=True, nan_at=NAN_STEP)
        oks = [r[0][0] for r in results]
        assert oks == [True, False, True], (rank, fused, oks)
        assert [r[1] for r in results] == [1024.0, 512.0, 512.0], (rank, fused)
        skipped = results[NAN_STEP]
        before = results[NAN_STEP - 1]
        assert torch.equal(skipped[2], before[2]) and torch.equal(skipped[3], before[3])
        assert counts == [1, 1, 1], counts


@check
def tensor_parallel_slices_equal_one_process(rank: int, world: int) -> None:
    """Plain-tensor slices of ``w`` (each rank its rows) and ``b`` whole on every rank,
    declared: the norm, the clipping and the skip decision are those of one process
    holding the whole tensors, in the statistics' one all-reduce per step."""
    params = _params(rank, world, sliced=True)
    opt = _facade(params, process_group=dist.group.WORLD,
                  replicated={"w": False, "b": True})
    results, counts = _run(opt, params, rank, world, steps=3, sliced=True, nan_at=NAN_STEP)
    _assert_like_reference(rank, world, results, sliced=True, nan_at=NAN_STEP)
    assert counts == [1, 1, 1], counts
    opt.zero_grad()
    _set_grads(params, 3, rank, world, sliced=True, nan_on=None)
    ref = _full(3)  # the whole gradients, scaled as _set_grads scales them, unscaled
    whole = torch.cat([ref["w"].flatten(), ref["b"]]).to(torch.bfloat16) * 1024.0
    assert float(opt.get_grad_norm()) == pytest.approx(
        float((whole.float() / opt.loss_scale).norm()), rel=1e-6)


@check
def megatron_halves_and_norm_grads_under_tensor_parallel_slices(rank: int, world: int,
                                                                 ) -> None:
    """Megatron's calls on the declared slices: ``get_grad_stats_parallel_group()`` is the
    group given; the squares of ``get_main_grads_for_grad_norm()`` (``w``'s slice on every
    rank, the replicated ``b`` on one) summed over it are ``get_grad_norm()`` squared, as
    Megatron's ``get_grad_norm_fp32`` sums them; ``prepare_grads()`` with a nan on rank 1
    only is True on every rank."""
    params = _params(rank, world, sliced=True)
    opt = _facade(params, process_group=dist.group.WORLD,
                  replicated={"w": False, "b": True})
    assert opt.get_grad_stats_parallel_group() is dist.group.WORLD
    _set_grads(params, 0, rank, world, sliced=True, nan_on=None)
    grads = opt.get_main_grads_for_grad_norm()
    assert len(grads) == (2 if rank == 0 else 1), len(grads)
    squares = sum((g.double() ** 2).sum() for g in grads)
    dist.all_reduce(squares)
    assert float(squares.sqrt()) == pytest.approx(float(opt.get_grad_norm()), rel=1e-6)
    assert opt.prepare_grads() is False
    assert opt.step_with_ready_grads() is True
    _set_grads(params, 1, rank, world, sliced=True, nan_on=1)
    scale = opt.loss_scale
    assert opt.prepare_grads() is True
    assert opt.loss_scale == scale / 2


@check
def expert_parallel_groups_sum_their_statistics(rank: int, world: int) -> None:
    """A group marked ``is_expert_parallel`` (each rank its own experts: ``w``'s rows) with
    no process group is refused (each rank would clip by its own norm); declared, the norm
    is the whole tensors' norm, as in one process."""
    params = _params(rank, world, sliced=True)

    def groups() -> list[dict[str, Any]]:
        return [{"params": [("w", params["w"])], "is_expert_parallel": True},
                {"params": [("b", params["b"])]}]

    with pytest.raises(ValueError, match=r"param group 0 is expert-parallel"):
        functopt.MixedPrecisionOptimizer(groups(), functopt.adamw(1e-2))
    with pytest.raises(ValueError, match=r"param_groups\[0\] is expert-parallel .*sums none"):
        functopt.Optimizer(groups(), functopt.adamw(1e-2))  # (it reduces nothing)
    opt = functopt.MixedPrecisionOptimizer(groups(), functopt.adamw(1e-2),
                                           process_group=dist.group.WORLD,
                                           replicated={"w": False, "b": True})
    _set_grads(params, 0, rank, world, sliced=True, nan_on=None)
    ref = _full(0)
    whole = torch.cat([ref["w"].flatten(), ref["b"]]).to(torch.bfloat16) * 1024.0
    assert float(opt.get_grad_norm()) == pytest.approx(
        float((whole.float() / opt.loss_scale).norm()), rel=1e-6)


@check
def replicated_grads_norm_of_one_process_skip_agreed(rank: int, world: int) -> None:
    """DDP-style params, the same gradients on every rank, no declaration: the norm is one
    process's (the agreement sums no squares), the result too; a nan on rank 1 alone skips
    every rank."""
    params = _params(rank, world, sliced=False)
    opt = _facade(params)
    results, counts = _run(opt, params, rank, world, steps=3, sliced=False, nan_at=None)
    assert all(result[0][0] for result in results)
    for got, ref in zip(results, _reference(3, None), strict=True):
        assert got[0] == ref[0], (got[0], ref[0])  # the norm bitwise
        assert torch.equal(got[2], ref[2]) and torch.equal(got[3], ref[3])
    _set_grads(params, 3, rank, world, sliced=False, nan_on=1)
    assert opt.step() == (False, None, None)
    assert opt.loss_scale == 512.0
    assert counts == [1, 1, 1], counts


@check
def norm_threshold_verdict_agreed(rank: int, world: int) -> None:
    """grad_norm_skip_threshold on plain slices: rank 1's slice alone above it skips every
    rank for the norm (the scale kept); a nan on rank 0 with rank 1 above it is an
    overflow on every rank (the scale halved), as one process sees it."""
    params = _params(rank, world, sliced=True)
    opt = _facade(params)
    opt.grad_norm_skip_threshold = 1.0e3
    for nan_on, scale in ((None, 1024.0), (0, 512.0)):
        _set_grads(params, 0, rank, world, sliced=True, nan_on=None)
        assert params["w"].grad is not None
        if rank == 1:
            params["w"].grad.mul_(1.0e4)  # a norm of about 3e4 here, below 10 elsewhere
        elif rank == nan_on:
            params["w"].grad[0, 0] = float("nan")
        ok, norm, _ = opt.step()
        assert not ok and (norm is None) == (nan_on is not None), (rank, nan_on, norm)
        assert opt.loss_scale == scale, (rank, nan_on, opt.loss_scale)


@check
def statistics_over_a_smaller_group_then_the_verdict(rank: int, world: int) -> None:
    """Statistics summed over a group smaller than the default one (here each rank's own):
    that group's all-reduce, then the verdict's over the default group, two collectives;
    a nan on rank 1 skips every rank."""
    own, _ = dist.new_subgroups(group_size=1)
    params = _params(rank, world, sliced=True)
    opt = _facade(params, process_group=own, replicated=False)
    results, counts = _run(opt, params, rank, world, steps=2, sliced=True, nan_at=NAN_STEP)
    assert [r[0][0] for r in results] == [True, False], (rank, results)
    assert counts == [2, 2], counts
    first = dist.new_group([0])
    if rank != 0:  # what new_group gives the ranks outside it
        with pytest.raises(ValueError, match="NON_GROUP_MEMBER"):
            _facade(params, agree_skip=first)


@check
def functional_step_agrees_on_every_path(rank: int, world: int) -> None:
    """mixed_precision(agree_skip=True) on plain slices, on its fused, pure and MultiSteps
    paths: a nan on rank 1 skips every rank (off by default: rank 0 steps)."""
    params = {k: v.detach() for k, v in _params(rank, world, sliced=True).items()}
    inners = {"fused": (functopt.adamw(1e-2), True), "pure": (functopt.adamw(1e-2), False),
              "multisteps": (functopt.MultiSteps(functopt.adamw(1e-2), 1)
                             .gradient_transformation(), True)}
    for label, (inner, fused) in inners.items():
        for agree in (True, False):
            tx = functopt.precision.mixed_precision(inner, fused=fused, agree_skip=agree)
            state = tx.init(params)
            grads = {k: torch.ones_like(v) for k, v in params.items()}
            if rank == 1:
                grads["w"][0, 0] = float("nan")
            with CommDebugMode() as comm:
                _, state = tx.step(grads, state, params)
            skipped = bool(state.metrics.found_inf)
            assert skipped == (agree or rank == 1), (label, agree, rank, skipped)
            assert comm.get_total_counts() == int(agree), (label, agree)


@check
def fsdp2_agreement_in_the_one_all_reduce(rank: int, world: int) -> None:
    """FSDP2 params over every rank: the agreement adds nothing to the statistics' one
    all-reduce, which is bounded by agree_timeout, and an inf in rank 1's shard skips
    every rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(),
                                torch.nn.Linear(6, 1)).to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = functopt.MixedPrecisionOptimizer(model.named_parameters(), functopt.adamw(1e-2),
                                           agree_timeout=30.0)
    for step in range(3):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step + 10 * rank))
        opt.backward(model(x.to(torch.bfloat16)).float().square().mean())
        if step == NAN_STEP and rank == 1:
            model[0].weight.grad.to_local()[0, 0] = float("inf")
        with CommDebugMode() as comm:
            ok = opt.step()
        assert comm.get_total_counts() == 1, (step, comm.get_total_counts())
        assert ok == (step != NAN_STEP), (rank, step, ok)
        opt.zero_grad()
    assert opt.loss_scale == 65536.0 / 2


@check
def opt_out_makes_no_collective(rank: int, world: int) -> None:
    """agree_skip=False: no collective, each rank decides alone (rank 1 skips, the others
    step); an optimizer stepping on rank 0 only does not wait for the others."""
    params = _params(rank, world, sliced=True)
    opt = _facade(params, agree_skip=False)
    results, counts = _run(opt, params, rank, world, steps=2, sliced=True, nan_at=NAN_STEP)
    assert results[NAN_STEP][0][0] == (rank != 1)
    assert counts == [0, 0], counts
    alone = _params(rank, world, sliced=True)
    actor = _facade(alone, agree_skip=False)
    if rank == 0:
        _set_grads(alone, 0, rank, world, sliced=True, nan_on=None)
        with CommDebugMode() as comm:
            assert actor.step()[0]
        assert comm.get_total_counts() == 0


@check
def contradictory_options_raise(rank: int, world: int) -> None:
    """A timeout without an agreement, and a malformed agree_skip or agree_timeout, raise
    at construction, naming the option."""
    del rank, world
    params = _params(0, 1, sliced=False)
    with pytest.raises(ValueError, match="agree_skip=False makes none"):
        _facade(params, agree_skip=False, agree_timeout=5.0)
    with pytest.raises(TypeError, match="agree_skip must be True"):
        _facade(params, agree_skip="world")
    for bad in (0.0, -1.0, float("inf"), "5", datetime.timedelta(0)):
        with pytest.raises(ValueError, match="agree_timeout must be"):
            _facade(params, agree_timeout=bad)


TIMEOUT_S = 2.0


def timeout_check(rank: int, world: int) -> float:
    """Rank 1 never steps: rank 0's step raises within ``TIMEOUT_S`` (plus slack), naming
    the collective, the group size, the timeout and the likely cause. Rank 1 waits, on
    the store, for rank 0 to have raised, then both tear down (the harness destroys the
    group). Returns rank 0's wait, in seconds."""
    store = dist.distributed_c10d._get_default_store()
    params = _params(rank, world, sliced=True)
    opt = _facade(params, agree_timeout=TIMEOUT_S)
    if rank != 0:
        store.wait(["raised"], datetime.timedelta(seconds=60))
        return 0.0
    _set_grads(params, 0, rank, world, sliced=True, nan_on=None)
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError) as raised:
            opt.step()
    finally:
        store.set("raised", "1")
    waited = time.monotonic() - start
    message = str(raised.value) + "".join(getattr(raised.value, "__notes__", []))
    for part in ("all_reduce of the overflow verdict", f"over {world} ranks",
                 f"agree_timeout={TIMEOUT_S:g} s", "a rank skipped step()", "agree_skip="):
        assert part in message, (part, message)
    return waited
