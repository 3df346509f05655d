"""Rank-side checks of the fused fast paths on DTensor params, run by ``run_all`` in each rank.

``make_step`` with a fused kernel steps each rank's local shard (the kernels are
elementwise) and rewraps the results as DTensors placed like the params; the fused
mixed-precision step reduces its gradient statistics with one all-reduce, so every rank
decides alike to skip a step. The reference is the pure path on the full tensors in one
process. ``tests/test_distributed_fast.py`` turns each check into a test.

Shards are uneven (``Shard(0)`` splits like ``torch.chunk``: 5 rows over 2 ranks are 3 + 2,
1 row lives on rank 0 only), so some ranks step empty shards.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import functopt
from distributed.checks import _assert_placements_like, _full, _mesh
from distributed.harness import check_registry, run_checks
from functopt.fast import FastPathWarning, make_step
from functopt.precision import dynamic_loss_scale, mixed_precision

CHECKS, check = check_registry()

REL_FLOAT64 = 1e-12
# float32 masters over a short trajectory: the bound of tests/test_mixed_fused.py
ULPS_FLOAT32 = 8.0


def run_all(rank: int, world: int) -> dict[str, str | None]:
    """Run every check in this rank; a barrier after each keeps the ranks in step."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    return run_checks(CHECKS, rank, world)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = _full(a).double(), _full(b).double()
    if b.numel() == 0:
        return 0.0
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def _assert_close(actual: Any, expected: Any, what: str, before: Any = None) -> None:
    """Leaf by leaf within the bound, relative to the leaf's largest magnitude after the
    step or, with ``before``, before it: a moment whose terms nearly cancel
    (``b1 * mu + (1 - b1) * g`` close to 0) is rounded at the size of its terms."""
    a_leaves, spec = functopt.tree._core.flatten(actual)
    e_leaves = functopt.tree._core.flatten_like(spec, expected, name="expected",
                                                reference="actual")
    b_leaves = [None] * len(e_leaves) if before is None else functopt.tree._core.flatten_like(
        spec, before, name="before", reference="actual")
    for path, a, e, b0 in zip(functopt.tree._core.paths(spec), a_leaves, e_leaves, b_leaves,
                              strict=True):
        if a is None or e is None:
            assert a is None and e is None, (what, path)
            continue
        assert a.dtype == e.dtype and a.shape == e.shape, (what, path, a.dtype, e.dtype)
        if not e.is_floating_point():
            assert torch.equal(_full(a), e), (what, path)
            continue
        bound = REL_FLOAT64 if e.dtype == torch.float64 else (
            ULPS_FLOAT32 * torch.finfo(torch.float32).eps)
        rel = _relative(a, e)
        if b0 is not None and e.numel():
            scale = max(_full(e).double().abs().max().item(),
                        _full(b0).double().abs().max().item())
            diff = (_full(a).double() - _full(e).double()).abs().max().item()
            rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
        assert rel <= bound, f"{what} {path}: {rel:.3g} > {bound:.3g}"


def _full_params(seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5, 3, generator=gen).to(dtype),
            "b": torch.randn(1, generator=gen).to(dtype),
            "m": torch.randn(17, 4, generator=gen).to(dtype)}


def _shard(tree: dict[str, Any], mesh: Any) -> dict[str, Any]:
    return {k: None if v is None else distribute_tensor(v, mesh, [Shard(0)])
            for k, v in tree.items()}


@check
def make_step_on_sharded_params_equals_full(rank: int, world: int) -> None:
    del rank
    mesh = _mesh(world)
    for donate in (False, True):
        tx = functopt.adamw(1e-2, weight_decay=0.1)
        full = _full_params(0, torch.float64)
        params = _shard(full, mesh)
        state, ref_state = tx.init(params), tx.init(full)
        step = make_step(tx, donate=donate)
        for i in range(3):
            gen = torch.Generator().manual_seed(10 + i)
            gfull: dict[str, Any] = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype)
                                     for k, v in full.items()}
            if i == 1:
                gfull["b"] = None
            passed, grads = params, _shard(gfull, mesh)
            with CommDebugMode() as comm:
                params, state = step(grads, state, params)
            assert comm.get_total_counts() == 0, "an elementwise step needs no collective"
            updates, ref_state = tx.update(gfull, ref_state, full)
            full = functopt.apply_updates(full, updates)
            for k, p in params.items():
                assert isinstance(p, DTensor) and p.placements == (Shard(0),), (donate, k)
                if gfull[k] is not None:  # a leaf without gradient comes back as passed
                    assert (p is passed[k]) == donate, (donate, k, "in place iff donated")
            assert _assert_placements_like(state, params) == 6  # mu and nu of 3 leaves
            _assert_close(params, full, f"donate={donate} step {i} params")
            _assert_close(state, ref_state, f"donate={donate} step {i} state")


def _guarded_chain_run(world: int, rule: Any, *, compile: bool, seed: int) -> None:
    """apply_if_finite(chain(clip_by_global_norm, rule)) stepped 3 times on Shard(0)
    params, donated and not: one all-reduce per step, DTensors placed like the params,
    equal to the full tensors' pure path, an inf in the last rank's shard skipping every
    rank's step. ``compile``: the compiled tier, its state from ``step.init``."""
    mesh = _mesh(world)
    for donate in (False, True):
        tx = functopt.apply_if_finite(functopt.chain(functopt.clip_by_global_norm(0.5),
                                                     rule()), 3)
        full = _full_params(seed, torch.float64)
        params = _shard(full, mesh)
        step = make_step(tx, donate=donate, compile=compile)
        state, ref_state = step.init(params), tx.init(full)
        assert functopt.fast.explain(tx, params, state, compile=compile).fast
        for i in range(3):
            gen = torch.Generator().manual_seed(10 * seed + 10 + i)
            gfull = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) * 2
                     for k, v in full.items()}
            if i == 1:
                gfull["m"][-1, 0] = float("inf")  # the last rows: the last rank's shard
            grads = _shard(gfull, mesh)
            with CommDebugMode() as comm, torch.no_grad():
                params, state = step(grads, state, params)
            assert comm.get_total_counts() == 1, ("one collective", comm.get_comm_counts())
            updates, ref_state = tx.update(gfull, ref_state, full)
            full = functopt.apply_updates(full, updates)
            for k, p in params.items():
                assert isinstance(p, DTensor) and p.placements == (Shard(0),), (donate, k)
            what = f"compile={compile} donate={donate} step {i}"
            _assert_close(params, full, f"{what} params")
            _assert_close(state, ref_state, f"{what} state")
        assert int(state.total_notfinite) == 1  # the skipped step, on every rank


@check
def composed_chain_on_sharded_params_one_collective(rank: int, world: int) -> None:
    """The guarded chain of `_guarded_chain_run` with adamw and a no-decay mask, on the
    kernels (the clip's sum of squares and the guard's non-finite count in one packed
    all-reduce)."""
    del rank
    _guarded_chain_run(world, lambda: functopt.adamw(
        1e-2, weight_decay=0.1, mask={"w": True, "b": False, "m": True}), compile=False,
        seed=2)


@check
def compiled_tier_on_sharded_params_one_collective(rank: int, world: int) -> None:
    """The guarded chain of `_guarded_chain_run` with lion, on the compiled tier over each
    rank's local shards."""
    del rank
    warnings.filterwarnings("ignore", message=r".*torch\.jit\.script_method.*")
    _guarded_chain_run(world, lambda: functopt.lion(1e-2, weight_decay=0.1), compile=True,
                       seed=4)


@check
def zero_nans_flags_join_the_one_collective(rank: int, world: int) -> None:
    """chain(zero_nans, apply_if_finite(chain(clip, adamw))) on Shard(0) params: the nans
    are made 0 before the clip measures, each leaf's found_nan flag is OR-ed over the
    mesh in the step's one all-reduce (with the clip's sum and the guard's count); a nan in
    the last rank's shard sets the flag on every rank, an inf there skips the step."""
    del rank
    mesh = _mesh(world)
    tx = functopt.chain(functopt.zero_nans(), functopt.apply_if_finite(functopt.chain(
        functopt.clip_by_global_norm(0.5), functopt.adamw(1e-2, weight_decay=0.1)), 3))
    full = _full_params(5, torch.float64)
    params = _shard(full, mesh)
    step = make_step(tx, donate=True)
    state, ref_state = tx.init(params), tx.init(full)
    assert functopt.fast.explain(tx, params, state).fast
    for i in range(3):
        gen = torch.Generator().manual_seed(60 + i)
        gfull = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in full.items()}
        gfull["m"][-1, 0] = (0.0, float("nan"), float("inf"))[i]  # the last rank's shard
        grads = _shard(gfull, mesh)
        with CommDebugMode() as comm, torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", FastPathWarning)
            params, state = step(grads, state, params)
        assert comm.get_total_counts() == 1, ("one collective", comm.get_comm_counts())
        updates, ref_state = tx.update(gfull, ref_state, full)
        full = functopt.apply_updates(full, updates)
        _assert_close(params, full, f"step {i} params")
        _assert_close(state, ref_state, f"step {i} state")
        assert bool(state[0].found_nan["m"]) == (i == 1)
    assert int(state[1].total_notfinite) == 1


def _clip_adamw() -> functopt.GradientTransformation:
    return functopt.chain(functopt.clip_by_global_norm(0.05),
                          functopt.adamw(1e-2, weight_decay=0.1))


def _mixed_run(world: int, inf_rank: int | None, inner: Any = None, *,
               max_grad_norm: float | None = None, compile: bool = False,
               loss_scale: Any = None) -> None:
    """The fused mixed step of ``inner()`` (adamw by default; ``compile``: on the compiled
    tier) on bf16 Shard(0) params, 4 steps, each one all-reduce, equal to the pure mixed
    step on the full tensors; an inf in rank ``inf_rank``'s shard at step 2 skips the step
    on every rank. ``loss_scale``: the rule (dynamic from 2**10 by default)."""
    mesh = _mesh(world)
    kw: dict[str, Any] = dict(
        loss_scale=loss_scale or dynamic_loss_scale(init_scale=2.0 ** 10),
        max_grad_norm=max_grad_norm)
    if inner is None:
        def inner() -> functopt.GradientTransformation:
            return functopt.adamw(1e-2, weight_decay=0.1)
    fused = mixed_precision(inner(), fused=True, compile=compile, **kw)
    pure = mixed_precision(inner(), fused=False, **kw)
    full = _full_params(1, torch.bfloat16)
    params = _shard(full, mesh)
    state, ref_state = fused.init(params), pure.init(full)
    ref_params = dict(full)
    for i in range(4):
        gen = torch.Generator().manual_seed(20 + i)
        scale = ref_state.loss_scale.scale
        gfull = {k: (torch.randn(v.shape, generator=gen) * scale).to(v.dtype)
                 for k, v in full.items()}
        if i == 2 and inf_rank is not None:
            # "w" rows 0-2 live on rank 0, rows 3-4 on rank 1 (at 2 ranks)
            gfull["w"][0 if inf_rank == 0 else 4, 1] = float("inf")
        grads = _shard(gfull, mesh)
        if i == 2 and inf_rank is not None:
            local_bad = not torch.isfinite(grads["w"].to_local()).all()
            assert bool(local_bad) == (torch.distributed.get_rank() == inf_rank)
        before = [_full(x).clone() for x in (*params.values(), *state.master.values())]
        inner_before = ref_state.inner_state
        with CommDebugMode() as comm, torch.no_grad():
            params, state = fused.step(grads, state, params)
        assert comm.get_total_counts() == 1, ("one all-reduce per step", i,
                                              comm.get_total_counts())
        ref_params, ref_state = pure.step(gfull, ref_state, ref_params)
        skipped = i == 2 and inf_rank is not None
        assert bool(state.metrics.found_inf) == skipped, i
        assert torch.equal(state.loss_scale.scale, ref_state.loss_scale.scale), i
        assert torch.equal(state.metrics.found_inf, ref_state.metrics.found_inf), i
        for k, p in params.items():
            assert isinstance(p, DTensor) and p.placements == (Shard(0),), k
            assert torch.equal(_full(p), _full(state.master[k]).to(p.dtype)), (i, k)
        _assert_close(state.master, ref_state.master, f"step {i} masters")
        _assert_close(state.inner_state, ref_state.inner_state, f"step {i} inner state",
                      before=inner_before)
        if skipped:
            after = [_full(x) for x in (*params.values(), *state.master.values())]
            assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       for a, b in zip(after, before, strict=True)), "the skipped step wrote"
    assert int(state.metrics.skipped_steps) == (0 if inf_rank is None else 1)


@check
def mixed_fused_bf16_dtensor_equals_full_one_collective(rank: int, world: int) -> None:
    del rank
    _mixed_run(world, None)


@check
def mixed_fused_composed_chain_one_collective(rank: int, world: int) -> None:
    """mixed_precision(chain(clip_by_global_norm, adamw), max_grad_norm=...) on bf16
    DTensors: both clips' norms travel in the step's one all-reduce."""
    del rank
    _mixed_run(world, None, _clip_adamw, max_grad_norm=0.5)  # the step's clip, the chain's


@check
def mixed_fused_inf_on_one_rank_skips_everywhere(rank: int, world: int) -> None:
    del rank
    for inf_rank in range(world):
        _mixed_run(world, inf_rank)
