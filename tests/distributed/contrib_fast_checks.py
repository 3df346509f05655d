"""Rank-side checks of functopt.contrib on the compiled tier with DTensor params, run by
``run_all`` in each rank (``tests/test_contrib_fast.py`` turns each into a test).

Schedule-free is elementwise with scalar state: each rank's compiled call steps its local
shards and the result equals the pure path on the full tensors in one process. Prodigy
sums over every leaf inside its update: each rank sums over its shards, one all-reduce
makes the sums global, then each rank steps its shards; so does a global-norm clip after
Adam's moments (the same lowering: a rule with tree sums).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import functopt
from distributed.checks import _full, _mesh
from distributed.fast_checks import _mixed_run
from distributed.harness import check_registry, run_checks
from distributed.multisteps_checks import _mixed_multisteps_run
from functopt import contrib
from functopt.fast import FastPathWarning, explain, make_step
from functopt.precision import dynamic_loss_scale

CHECKS, check = check_registry()

REL_FLOAT64 = 1e-12


def run_all(rank: int, world: int) -> dict[str, str | None]:
    """Run every check in this rank; a barrier after each keeps the ranks in step."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    warnings.filterwarnings("ignore", message="`torch.jit.script_method` is deprecated")
    return run_checks(CHECKS, rank, world)


def _full_params(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # 5 rows over 2 ranks are 3 + 2; 1 row lives on rank 0 only (an empty shard on rank 1)
    return {"w": torch.randn(5, 3, generator=gen, dtype=torch.float64),
            "b": torch.randn(1, generator=gen, dtype=torch.float64),
            "v": torch.randn(4, generator=gen, dtype=torch.float64)}


def _shard(tree: dict[str, Any], mesh: Any) -> dict[str, Any]:
    return {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in tree.items()}


def _assert_close(actual: Any, expected: Any, what: str) -> None:
    a_leaves, spec = functopt.tree._core.flatten(actual)
    e_leaves = functopt.tree._core.flatten_like(spec, expected, name="expected",
                                                reference="actual")
    for path, a, e in zip(functopt.tree._core.paths(spec), a_leaves, e_leaves, strict=True):
        a = _full(a)
        assert a.dtype == e.dtype and a.shape == e.shape, (what, path)
        if not e.is_floating_point():
            assert torch.equal(a, e), (what, path)
            continue
        rtol = REL_FLOAT64 if e.dtype == torch.float64 else 4 * torch.finfo(e.dtype).eps
        torch.testing.assert_close(a, e, rtol=rtol, atol=1e-300, msg=f"{what} {path}")


@check
def schedule_free_compiles_on_shards_without_collectives(rank: int, world: int) -> None:
    del rank
    mesh = _mesh(world)
    tx = contrib.schedule_free_adamw(0.1, warmup_steps=2, weight_decay=0.01)
    full = _full_params(0)
    params = _shard(full, mesh)
    assert explain(tx, params, compile=True).fast
    stepped, _ = _steps_equal_the_full_tensors(tx, full, params, mesh, seed=10,
                                               collectives=0)
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),)
               for p in stepped.values())


def _steps_equal_the_full_tensors(tx: Any, full: dict[str, torch.Tensor],
                                  params: dict[str, Any], mesh: Any, *, collectives: int,
                                  seed: int | None = None, each: Any = None,
                                  steps: int = 3, spoil: Any = None,
                                  ) -> tuple[dict[str, Any], Any]:
    """``steps`` compiled steps on the shards, each with ``collectives`` all-reduces, equal
    to the pure path on the full tensors (``each(before, after)`` checks those); returns
    the stepped params and state. The gradients are drawn from ``seed + step``, or with no
    seed are half the first params at every step (Prodigy's sums then grow);
    ``spoil(step, grads)`` sees the full gradients of a step first (and may change them in
    place)."""
    step = make_step(tx, compile=True)
    state, ref_state = tx.init(params), tx.init(full)
    fixed = {k: v * 0.5 for k, v in full.items()}
    for i in range(steps):
        gfull = fixed
        if seed is not None:
            gen = torch.Generator().manual_seed(seed + i)
            gfull = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype)
                     for k, v in full.items()}
        if spoil is not None:
            spoil(i, gfull)
        grads = _shard(gfull, mesh)
        with torch.no_grad(), CommDebugMode() as comm, warnings.catch_warnings():
            warnings.simplefilter("error", FastPathWarning)
            params, state = step(grads, state, params)
        counts = comm.get_comm_counts()
        assert comm.get_total_counts() == collectives and all(
            "allreduce" in str(op) for op in counts), counts
        updates, ref_state = tx.update(gfull, ref_state, full)
        before, full = full, functopt.apply_updates(full, updates)
        if each is not None:
            each(before, full)
        _assert_close(params, full, f"step {i} params")
        _assert_close(state, ref_state, f"step {i} state")
    return params, state


@check
def prodigy_on_shards_one_all_reduce_per_step(rank: int, world: int) -> None:
    """Each rank sums over its local shards (a compiled pass per group), one all-reduce
    of the packed sums makes them global, then each rank steps its shards: equal to the
    pure path on the full tensors. Two groups (float64, float32); rank 1 holds nothing of
    the float32 one (one row), whose call over no elements still moves Prodigy's scalar
    state there."""
    del rank
    mesh = _mesh(world)
    tx = contrib.prodigy(weight_decay=0.1)
    full = dict(_full_params(1), c=torch.randn(1, 2, generator=torch.Generator().manual_seed(2)))
    params = _shard(full, mesh)
    assert len(explain(tx, params, compile=True).groups) == 2
    _, state = _steps_equal_the_full_tensors(tx, full, params, mesh, collectives=1)
    assert float(state.numerator_weighted) > 0


@check
def late_clip_on_shards_one_all_reduce_per_step(rank: int, world: int) -> None:
    """chain(scale_by_adam, clip_by_global_norm, lr) compiled on shards: the clip measures
    Adam's updates (a compiled sums pass), one all-reduce makes the norm global; equal to
    the pure path on the full tensors, with the clip active."""
    del rank
    mesh = _mesh(world)
    tx = functopt.chain(functopt.scale_by_adam(), functopt.clip_by_global_norm(0.5),
                        functopt.scale_by_learning_rate(0.1))
    full = _full_params(3)
    params = _shard(full, mesh)
    got = explain(tx, params, compile=True)
    assert got.fast and got.tree_sums == 1 and got.clips == 0, str(got)

    def clipped(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
        moved = functopt.tree.global_norm({k: after[k] - before[k] for k in after})
        assert float(moved) == pytest.approx(0.05, rel=1e-9)  # lr * max_norm

    _steps_equal_the_full_tensors(tx, full, params, mesh, seed=20, collectives=1,
                                  each=clipped)


@check
def late_guard_on_shards_one_all_reduce_per_step(rank: int, world: int) -> None:
    """chain(scale_by_adam, apply_if_finite(lr, 3)) compiled on shards, a float64 group and
    a float32 one (one row: rank 1 holds none of it): the guard's non-finite count of
    Adam's updates (a compiled sums pass per group) made global in one all-reduce; an inf
    gradient in rank 1's shard at step 2 skips every rank's guarded update (and at step 3,
    its inf in Adam's moments making the updates nan), the moments moving anyway; equal to
    the pure path on the full tensors."""
    del rank
    mesh = _mesh(world)
    tx = functopt.chain(functopt.scale_by_adam(), functopt.apply_if_finite(
        functopt.scale_by_learning_rate(1e-3), 3))
    full = dict(_full_params(5), c=torch.randn(1, 2, generator=torch.Generator().manual_seed(6)))
    params = _shard(full, mesh)
    got = explain(tx, params, compile=True)
    assert got.fast and got.tree_sums == 1 and len(got.groups) == 2, str(got)

    def spoil(i: int, grads: dict[str, torch.Tensor]) -> None:
        if i == 2:
            grads["w"][4, 1] = float("inf")  # rows 3-4 of "w" live on rank 1

    def skipped_from_step_2(before: dict[str, torch.Tensor],
                            after: dict[str, torch.Tensor]) -> None:
        moved.append(any(not torch.equal(before[k], after[k]) for k in after))

    moved: list[bool] = []
    params, state = _steps_equal_the_full_tensors(
        tx, full, params, mesh, seed=40, collectives=1, steps=4, spoil=spoil,
        each=skipped_from_step_2)
    assert moved == [True, True, False, False], moved
    guard = state[1]
    assert int(guard.total_notfinite) == 2 and int(guard.notfinite_count) == 2
    assert int(state[0].count) == 4  # Adam's moments moved at every step


@check
def clip_prodigy_on_shards_two_all_reduces_per_step(rank: int, world: int) -> None:
    """chain(clip_by_global_norm, prodigy) compiled on shards, the clip active: two
    all-reduces per step, the clip's sum of squares, then Prodigy's sums of the clipped
    gradients. ||beta3 s + c f g||_1 is not a function of sums taken before the clip
    factor f is known (docs/architecture.md, "A clip before a rule with tree sums"), so
    they cannot share one. Equal to the pure path on the full tensors."""
    del rank
    mesh = _mesh(world)
    tx = functopt.chain(functopt.clip_by_global_norm(0.5), contrib.prodigy(weight_decay=0.1))
    full = _full_params(7)
    params = _shard(full, mesh)
    got = explain(tx, params, compile=True)
    assert got.fast and got.tree_sums == 1 and got.clips == 1, str(got)

    def clip_active(i: int, grads: dict[str, torch.Tensor]) -> None:
        assert float(functopt.tree.global_norm(grads)) > 0.5, i

    _, state = _steps_equal_the_full_tensors(tx, full, params, mesh, seed=50, collectives=2,
                                             spoil=clip_active)
    assert float(state[1].numerator_weighted) != 0


@check
def guarded_prodigy_on_shards_one_all_reduce_per_step(rank: int, world: int) -> None:
    """chain(zero_nans, apply_if_finite(prodigy, 3)) compiled on shards: the nan flags, the
    guard's non-finite count and Prodigy's sums (which need neither) in one all-reduce; a
    nan in rank 1's shard (step 1) is made 0 and flagged on every rank, an inf there (step
    2) skips every rank's step; equal to the pure path on the full tensors."""
    del rank
    mesh = _mesh(world)
    tx = functopt.chain(functopt.zero_nans(), functopt.apply_if_finite(
        contrib.prodigy(weight_decay=0.1), 3))
    full = _full_params(8)
    params = _shard(full, mesh)
    got = explain(tx, params, compile=True)
    assert got.fast and got.tree_sums == 1 and got.guards == 1, str(got)

    def spoil(i: int, grads: dict[str, torch.Tensor]) -> None:
        grads["w"][4, 1] = (1.0, float("nan"), float("inf"))[i]  # rows 3-4: rank 1's

    _, state = _steps_equal_the_full_tensors(tx, full, params, mesh, seed=60, collectives=1,
                                             spoil=spoil)
    assert int(state[1].total_notfinite) == 1 and int(state[1].inner_state.count) == 2


@check
def mixed_compiled_prodigy_on_shards_one_all_reduce_per_step(rank: int, world: int) -> None:
    """mixed_precision(prodigy, compile=True) on bf16 shards (`fast_checks._mixed_run`):
    Prodigy's sums of the unscaled gradients (the unscale known before the statistics)
    join the step's one all-reduce; an inf in rank 1's shard skips every rank's step. With
    the built-in loss-scale rule (the step's scalars on the host) and one built by hand
    (they stay tensors)."""
    del rank
    rule = dynamic_loss_scale(init_scale=2.0 ** 10)
    by_hand = rule._replace(adjust=lambda state, found_inf: rule.adjust(state, found_inf),
                            config=())
    for loss_scale in (rule, by_hand):
        _mixed_run(world, 1, lambda: contrib.prodigy(weight_decay=0.1), compile=True,
                   loss_scale=loss_scale)


@check
def mixed_multisteps_prodigy_on_shards_one_all_reduce_per_step(rank: int, world: int) -> None:
    """mixed_precision(MultiSteps(prodigy, 2), compile=True) on bf16 shards
    (`multisteps_checks._mixed_multisteps_run`): a closing mini-step's Prodigy sums of the
    accumulated gradients join the statistics' one all-reduce."""
    del rank
    _mixed_multisteps_run(world, lambda: contrib.prodigy(weight_decay=0.1), compile=True)


@check
def clip_adamw_compiled_on_shards_one_all_reduce_per_step(rank: int, world: int) -> None:
    """compile=True takes AdamW onto the compiled tier on shards too: the leading clip's
    norm in one all-reduce, each rank's call over its shards; equal to the full tensors."""
    del rank
    mesh = _mesh(world)
    tx = functopt.chain(functopt.clip_by_global_norm(0.5),
                        functopt.adamw(0.1, weight_decay=0.1))
    full = _full_params(4)
    params = _shard(full, mesh)
    got = explain(tx, params, compile=True)
    assert got.fast and {g.kernel for g in got.groups} == {"compiled"}, str(got)
    _steps_equal_the_full_tensors(tx, full, params, mesh, seed=30, collectives=1)


@check
def prodigy_on_a_rank_holding_nothing(rank: int, world: int) -> None:
    """Every leaf one row: rank 1 holds no element at all, yet decides like rank 0 (the
    fast path), joins the all-reduce with zero sums and moves Prodigy's scalar state in
    calls over no elements; both equal the full tensors' pure path."""
    del rank
    mesh = _mesh(world)
    tx = contrib.prodigy()
    gen = torch.Generator().manual_seed(3)
    full = {"b": torch.randn(1, generator=gen, dtype=torch.float64),
            "c": torch.randn(1, 3, generator=gen, dtype=torch.float64)}
    params = _shard(full, mesh)
    _steps_equal_the_full_tensors(tx, full, params, mesh, collectives=1)
