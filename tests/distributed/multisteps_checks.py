"""Rank-side checks of ``MultiSteps`` on the fast paths with DTensor params, run by ``run_all``
in each rank (``tests/test_distributed_multisteps.py`` turns each into a test).

The mixed step around ``MultiSteps(adamw, k)`` on bf16 DTensor params takes the fast path
(``fused_multi_step``): each rank casts, unscales and accumulates its local shards, the
statistics travel in the step's one packed all-reduce, and the closing mini-step runs the
kernels on the shards. The reference is the pure mixed step on the full tensors in one
process: bitwise on mini-steps and overflows (the same operations on each element; a sum
of squares over two shards is added in another order, which the statistics round
alike here, checked through the loss scale and the metrics), to a float32 rounding on
closing mini-steps (the kernel). ``make_step(chain(clip_by_global_norm, MultiSteps(adamw,
k)))`` on shards: the clip's norm in one all-reduce per mini-step, nothing else.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode

import functopt
from distributed.checks import _bits_equal, _full, _mesh
from distributed.fast_checks import _assert_close, _full_params, _shard
from distributed.harness import check_registry, run_checks
from functopt.fast import FastPathWarning, make_step
from functopt.precision import dynamic_loss_scale, mixed_precision

CHECKS, check = check_registry()
SLOW_CHECKS, slow_check = check_registry()  # (a launch of their own, under -m slow)


def run_all(rank: int, world: int) -> dict[str, str | None]:
    """Run every check in this rank; a barrier after each keeps the ranks in step."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    return run_checks(CHECKS, rank, world)


def run_slow(rank: int, world: int) -> dict[str, str | None]:
    """Run every slow check in this rank."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    return run_checks(SLOW_CHECKS, rank, world)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in functopt.tree._core.flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _all_bits_equal(actual: Any, expected: Any) -> bool:
    return all(_bits_equal(a, e) for a, e in zip(_tensors(actual), _tensors(expected),
                                                 strict=True))


@check
def mixed_multisteps_on_shards_one_all_reduce_per_step(rank: int, world: int) -> None:
    """Five steps of mixed_precision(MultiSteps(adamw, 2)) on bf16 shards: windows close at
    steps 1 and 4 (step 2 overflows, on rank 1's rows only, so it is no mini-step); one
    collective per step; every rank decides alike; equal to the pure mixed step on the
    full tensors."""
    del rank
    _mixed_multisteps_run(world, lambda: functopt.adamw(1e-2, weight_decay=0.1))


@check
def mixed_multisteps_inner_clip_in_the_same_all_reduce(rank: int, world: int) -> None:
    """mixed_precision(MultiSteps(chain(clip_by_global_norm, adamw), 2)): on a closing
    mini-step the inner clip measures the accumulated gradients, and its sum of squares
    travels in the statistics' one all-reduce."""
    del rank
    _mixed_multisteps_run(world, lambda: functopt.chain(functopt.clip_by_global_norm(0.05),
                                                        functopt.adamw(1e-2)))


@slow_check
def mixed_multisteps_after_a_clip_in_the_inner_chain(rank: int, world: int) -> None:
    """mixed_precision(chain(clip_by_global_norm, MultiSteps(adamw, 2))): the prefix clip
    runs its own update on the DTensor gradients (its norm in an all-reduce of its own, as
    on the pure step: two collectives per step, one on the overflow, whose results the
    pure step discards; its factor to rounding: the shards' squares are summed apart),
    MultiSteps state at index 1."""
    del rank
    _mixed_multisteps_run(world, lambda: functopt.adamw(1e-2), around=lambda ms: (
        functopt.chain(functopt.clip_by_global_norm(0.05), ms)), collectives=(2, 1))


def _mixed_multisteps_run(world: int, rule: Any, around: Any = None,
                          collectives: tuple[int, int] = (1, 1), compile: bool = False,
                          ) -> None:
    """(collectives: per step, and on the overflow; compile: the fused step's compiled
    tier)"""
    mesh = _mesh(world)

    def inner() -> functopt.GradientTransformation:
        ms = functopt.MultiSteps(rule(), every_k_schedule=2).gradient_transformation()
        return ms if around is None else around(ms)

    def ms_of(inner_state: Any) -> Any:
        return inner_state if around is None else inner_state[1]

    kw: dict[str, Any] = dict(loss_scale=dynamic_loss_scale(init_scale=2.0 ** 10))
    fused = mixed_precision(inner(), compile=compile, **kw)
    pure = mixed_precision(inner(), fused=False, **kw)
    full = _full_params(2, torch.bfloat16)
    params = _shard(full, mesh)
    state, ref_state = fused.init(params), pure.init(full)
    ref_params = dict(full)
    closed = []
    for i in range(5):
        gen = torch.Generator().manual_seed(40 + i)
        scale = ref_state.loss_scale.scale
        gfull = {k: (torch.randn(v.shape, generator=gen) * scale).to(v.dtype)
                 for k, v in full.items()}
        if i == 2:
            gfull["w"][4, 1] = float("inf")  # rows 3-4 of "w" live on rank 1
        grads = _shard(gfull, mesh)
        with torch.no_grad(), CommDebugMode() as comm, warnings.catch_warnings():
            warnings.simplefilter("error", FastPathWarning)
            params, state = fused.step(grads, state, params)
        assert comm.get_total_counts() == collectives[i == 2], ("all-reduces", i,
                                                        comm.get_comm_counts())
        ref_params, ref_state = pure.step(gfull, ref_state, ref_params)
        ms, ref_ms = ms_of(state.inner_state), ms_of(ref_state.inner_state)
        assert bool(state.metrics.found_inf) == (i == 2), i
        assert torch.equal(state.loss_scale.scale, ref_state.loss_scale.scale), i
        assert int(ms.mini_step) == int(ref_ms.mini_step), i
        assert int(ms.gradient_step) == int(ref_ms.gradient_step), i
        # the accumulators: the same operations on each element as the full tensors' (but
        # for a prefix clip's factor, whose norm sums the squares of two shards apart)
        if around is None:
            assert _all_bits_equal(ms.acc_grads, ref_ms.acc_grads), i
        else:
            _assert_close(ms.acc_grads, ref_ms.acc_grads, f"step {i} accumulators")
        for k, p in params.items():
            assert isinstance(p, DTensor) and p.placements == (Shard(0),), k
            assert isinstance(ms.acc_grads[k], DTensor), k
            assert torch.equal(_full(p), _full(state.master[k]).to(p.dtype)), (i, k)
        if int(ms.mini_step) == 0 and i != 2:  # a closing mini-step: the kernel
            closed.append(i)
            _assert_close(state.master, ref_state.master, f"step {i} masters")
            _assert_close(ms.inner_opt_state, ref_ms.inner_opt_state, f"step {i} inner")
        else:  # a mini-step (or the overflow): bitwise, masters plus 0.0
            assert _all_bits_equal(state.master, ref_state.master), i
            assert _all_bits_equal(params, ref_params), i
        ref_params = {k: _full(p) for k, p in params.items()}  # the next step from the same
        ref_state = ref_state._replace(master={k: _full(m) for k, m in state.master.items()},
                                       inner_state=_full_tree(state.inner_state))
    assert closed == [1, 4], closed
    assert int(state.metrics.skipped_steps) == 1


def _full_tree(tree: Any) -> Any:
    leaves, spec = functopt.tree._core.flatten(tree)
    return functopt.tree._core.unflatten(spec, [_full(x) for x in leaves])


@slow_check
def make_step_clip_then_multisteps_on_shards(rank: int, world: int) -> None:
    """make_step(chain(clip_by_global_norm, MultiSteps(adamw, 2))) on float64 shards: the
    clip (its own update) all-reduces its norm once per mini-step, the accumulation and
    the closing kernel need nothing; equal to the pure chain on the full tensors."""
    del rank
    mesh = _mesh(world)
    tx = functopt.chain(functopt.clip_by_global_norm(0.5), functopt.MultiSteps(
        functopt.adamw(1e-2, weight_decay=0.1), every_k_schedule=2).gradient_transformation())
    full = _full_params(3, torch.float64)
    params = _shard(full, mesh)
    state, ref_state = tx.init(params), tx.init(full)
    step = make_step(tx, donate=True)
    for i in range(4):
        gen = torch.Generator().manual_seed(60 + i)
        gfull = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in full.items()}
        grads = _shard(gfull, mesh)
        with torch.no_grad(), CommDebugMode() as comm, warnings.catch_warnings():
            warnings.simplefilter("error", FastPathWarning)
            params, state = step(grads, state, params)
        assert comm.get_total_counts() == 1, ("the clip's all-reduce", i,
                                              comm.get_comm_counts())
        updates, ref_state = tx.update(gfull, ref_state, full)
        full = functopt.apply_updates(full, updates)
        _assert_close(params, full, f"step {i} params")
        _assert_close(state, ref_state, f"step {i} state")
    assert int(state[1].gradient_step) == 2


@check
def make_step_multisteps_inside_combinators_on_shards(rank: int, world: int) -> None:
    """make_step of a MultiSteps inside a guarded partition (beside SGD) and inside
    inject_hyperparams, on float64 shards (functopt/fast/_inside.py): the window decided on
    the DTensor gradients, the foreach accumulation on the local shards, the guard's verdict
    over every rank (an inf on rank 1's rows of "w" at step 2 skips the step everywhere);
    equal to the pure transform on the full tensors."""
    del rank
    mesh = _mesh(world)

    def ms() -> functopt.GradientTransformation:
        return functopt.MultiSteps(functopt.adamw(1e-2, weight_decay=0.1),
                                   every_k_schedule=2).gradient_transformation()

    cases = {
        "guarded partition": functopt.apply_if_finite(functopt.partition(
            {"acc": ms(), "sgd": functopt.sgd(0.1, momentum=0.9)},
            {"w": "acc", "m": "acc", "b": "sgd"}), max_consecutive_errors=2),
        "injected": functopt.inject_hyperparams(lambda learning_rate: functopt.MultiSteps(
            functopt.adamw(learning_rate), every_k_schedule=2).gradient_transformation())(
            learning_rate=1e-2),
    }
    for name, tx in cases.items():
        full, step = _full_params(4, torch.float64), make_step(tx, donate=True)
        params = _shard(full, mesh)
        state, ref_state = tx.init(params), tx.init(full)
        for i in range(5):
            gfull = {k: torch.randn(v.shape, dtype=v.dtype, generator=torch.Generator(
                ).manual_seed(80 + 7 * i + j)) for j, (k, v) in enumerate(full.items())}
            if i == 2 and name == "guarded partition":
                gfull["w"][4, 1] = float("inf")  # rows 3-4 of "w" live on rank 1
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("error", FastPathWarning)
                params, state = step(_shard(gfull, mesh), state, params)
            updates, ref_state = tx.update(gfull, ref_state, full)
            full = functopt.apply_updates(full, updates)
            _assert_close(params, full, f"{name}: step {i} params")
            _assert_close(_full_tree(state), ref_state, f"{name}: step {i} state")
        if name == "guarded partition":
            assert int(state.total_notfinite) == 1
            assert int(state.inner_state.inner_states["acc"].gradient_step) == 2
