"""Rank-side checks of the transforms that reduce over all elements, on DTensor params.

``apply_if_finite`` (is every update finite?), ``zero_nans`` (did each leaf hold a nan?)
and ``stochastic_rounding`` (random bits per element) each need more than elementwise
maths on the local shard: the first two combine the ranks' answers with one
``all_reduce``, the third must give each rank's shard noise of its own. ``run_all``
returns ``{check name: None or the failure's traceback}``; ``tests/test_distributed_transforms.py``
turns each entry into a test, at 2 and 4 ranks.

The leaves are ``Shard(0)`` DTensors with uneven shards (5 rows over 2 ranks are 3 + 2,
over 4 ranks 2 + 2 + 1 + 0; 1 row lives on rank 0 only), and the non-finite values sit
in one rank's shard only, so a rank that decided on its own shard would decide wrongly.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import functopt
from distributed.checks import _assert_tree, _full, _mesh
from distributed.harness import check_registry, run_checks
from functopt.precision import mixed_precision, static_loss_scale, stochastic_rounding

CHECKS, check = check_registry()


def run_all(rank: int, world: int) -> dict[str, str | None]:
    """Run every check in this rank; a barrier after each keeps the ranks in step."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    return run_checks(CHECKS, rank, world)


def _same_on_all_ranks(x: torch.Tensor) -> bool:
    """Whether the plain tensor ``x`` holds the same value on every rank."""
    assert not isinstance(x, DTensor), "expected a plain tensor"
    gathered = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, x)
    return all(torch.equal(g, x) for g in gathered)


def _full_and_sharded(seed: int, mesh: Any) -> tuple[dict[str, torch.Tensor], dict[str, DTensor]]:
    torch.manual_seed(seed)
    full = {"w": torch.randn(5, 3), "b": torch.randn(1), "d": torch.randn(3, 2, dtype=torch.float64)}
    return full, {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}


def _last_row_owner(rows: int, world: int) -> int:
    """The rank whose ``Shard(0)`` piece (``torch.chunk``) holds the last of ``rows`` rows."""
    return len(torch.ones(rows).chunk(world)) - 1


# ------------------------------------------------------------------- apply_if_finite

@check
def apply_if_finite_decides_alike_on_every_rank(rank: int, world: int) -> None:
    """A nan in one rank's shard skips the step on every rank, with one collective; the
    counters are plain 0-d tensors equal on all ranks and to a single-process run."""
    mesh = _mesh(world)
    full, params = _full_and_sharded(4, mesh)
    tx = functopt.apply_if_finite(functopt.adam(1e-2), max_consecutive_errors=1)
    state, ref_state = tx.init(params), tx.init(full)
    owner = _last_row_owner(5, world)
    for step, bad in enumerate(["w", "b", None, "w", "w"]):
        gfull = {k: torch.randn_like(v) for k, v in full.items()}
        if bad == "w":
            gfull["w"][4, 2] = float("nan")  # on the last row's owner only
        elif bad == "b":
            gfull["b"][0] = float("-inf")  # one row: rank 0 only
        grads = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in gfull.items()}
        if bad == "w":
            assert torch.isnan(grads["w"].to_local()).any() == (rank == owner)
        with CommDebugMode() as comm:
            updates, state = tx.update(grads, state, params)
        assert comm.get_total_counts() == 1, (step, comm.get_total_counts())
        ref_updates, ref_state = tx.update(gfull, ref_state, full)
        for name in ("notfinite_count", "last_finite", "total_notfinite"):
            value = getattr(state, name)
            assert not isinstance(value, DTensor) and value.dim() == 0, (step, name, value)
            assert _same_on_all_ranks(value), (step, name)
            assert torch.equal(value, getattr(ref_state, name)), (step, name, value)
        assert bool(state.last_finite) == (bad is None), step
        _assert_tree(updates, ref_updates)
        _assert_tree(state.inner_state, ref_state.inner_state)
        assert all(isinstance(u, DTensor) and u.placements == (Shard(0),)
                   for u in updates.values())
    # steps: skip (w), applied (b: the second in a row), finite, skip (w), applied (w)
    assert int(state.total_notfinite) == 4 and int(state.notfinite_count) == 2


@check
def apply_if_finite_plain_leaf_next_to_dtensors(rank: int, world: int) -> None:
    """A plain leaf enters the one sum: an inf in it on one rank skips every rank."""
    mesh = _mesh(world)
    params = {"d": distribute_tensor(torch.ones(5, 2), mesh, [Shard(0)]), "p": torch.ones(2)}
    tx = functopt.apply_if_finite(functopt.sgd(0.1), max_consecutive_errors=3)
    state = tx.init(params)
    grads = {"d": distribute_tensor(torch.ones(5, 2), mesh, [Shard(0)]),
             "p": torch.tensor([1.0, float("inf") if rank == world - 1 else 1.0])}
    with CommDebugMode() as comm:
        updates, state = tx.update(grads, state, params)
    assert comm.get_total_counts() == 1
    assert not bool(state.last_finite) and int(state.notfinite_count) == 1
    assert torch.equal(updates["p"], torch.zeros(2))
    assert torch.equal(updates["d"].to_local(), torch.zeros_like(params["d"].to_local()))


@check
def apply_if_finite_plain_tensors_make_no_collective(rank: int, world: int) -> None:
    del rank, world
    tx = functopt.apply_if_finite(functopt.sgd(0.1), max_consecutive_errors=0)
    params = {"w": torch.ones(3)}
    with CommDebugMode() as comm:
        _, state = tx.update({"w": torch.tensor([1.0, float("inf"), 0.0])}, tx.init(params))
    assert comm.get_total_counts() == 0 and not bool(state.last_finite)


# ------------------------------------------------------------- clip_by_global_norm

@check
def clip_by_global_norm_on_shards_one_collective(rank: int, world: int) -> None:
    """The pure clip on DTensor updates (the path a facade's chain and torch.func take):
    one all-reduce for the whole tree (per-leaf DTensor norms made one per leaf), the
    single-process result, and DTensors placed like the updates."""
    del rank
    mesh = _mesh(world)
    full, sharded = _full_and_sharded(4, mesh)
    sharded["r"] = distribute_tensor(torch.full((4,), 3.0), mesh, [Replicate()])
    full["r"] = torch.full((4,), 3.0)  # a replicated leaf counts once
    tx = functopt.clip_by_global_norm(0.5)
    with CommDebugMode() as comm:
        got, _ = tx.update(sharded, tx.init(None))
    assert comm.get_total_counts() == 1, comm.get_comm_counts()
    want, _ = tx.update(full, tx.init(None))
    for k, v in got.items():
        assert isinstance(v, DTensor) and v.placements == sharded[k].placements, k
        torch.testing.assert_close(_full(v), want[k], rtol=1e-6, atol=0.0)
    norm = functopt.tree.global_norm({k: _full(v) for k, v in got.items()})
    torch.testing.assert_close(norm, torch.tensor(0.5, dtype=norm.dtype), rtol=1e-6, atol=0.0)


@check
def clip_by_global_norm_on_shards_rescues_a_float32_overflow(rank: int, world: int) -> None:
    """Finite shards of 1e30 (the float32 sums of squares overflow): the rescue measures
    again on every rank (two more collectives, on the CPU only when needed) and clips like
    one process; an inf on one rank's shard still makes every rank's updates nan."""
    del rank
    mesh = _mesh(world)
    full = {"w": torch.full((6, 2), 1e30), "d": torch.full((3,), 1e200, dtype=torch.float64),
            "r": torch.ones(2)}
    sharded = {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
               "d": distribute_tensor(full["d"], mesh, [Shard(0)]),
               "r": distribute_tensor(full["r"], mesh, [Replicate()])}
    tx = functopt.clip_by_global_norm(0.5)
    with CommDebugMode() as comm:
        got, _ = tx.update(sharded, tx.init(None))
    assert comm.get_total_counts() == 3, comm.get_comm_counts()
    want, _ = tx.update(full, tx.init(None))
    assert all(bool(torch.isfinite(v).all()) for v in want.values())
    for k, v in got.items():
        torch.testing.assert_close(_full(v), want[k], rtol=1e-12, atol=0.0)
    full["w"][5, 1] = float("inf")  # the last rank's shard only
    bad = dict(sharded, w=distribute_tensor(full["w"], mesh, [Shard(0)]))
    got, _ = tx.update(bad, tx.init(None))
    assert all(bool(torch.isnan(v.to_local()).all()) for v in got.values())


# ------------------------------------------------------------------------ zero_nans

@check
def zero_nans_flags_match_single_process(rank: int, world: int) -> None:
    mesh = _mesh(world)
    full, params = _full_and_sharded(5, mesh)
    params["none"] = None
    tx = functopt.zero_nans()
    state = tx.init(params)
    assert all(not isinstance(f, DTensor) for f in state.found_nan.values() if f is not None)
    ref_state = tx.init({**full, "none": None})
    owner = _last_row_owner(5, world)
    for bad in (["w", "b"], ["d"], []):
        gfull = {k: torch.randn_like(v) for k, v in full.items()}
        gfull["w"][0, 0] = float("inf")  # inf is not a nan: never flagged
        if "w" in bad:
            gfull["w"][4, 1] = float("nan")  # the last row's owner only
        if "b" in bad:
            gfull["b"][0] = float("nan")  # rank 0 only
        if "d" in bad:
            gfull["d"][2, 0] = float("nan")
        grads: dict[str, Any] = {k: distribute_tensor(v, mesh, [Shard(0)])
                                 for k, v in gfull.items()}
        grads["none"] = None
        if "w" in bad:
            assert torch.isnan(grads["w"].to_local()).any() == (rank == owner)
        with CommDebugMode() as comm:
            updates, state = tx.update(grads, state, params)
        assert comm.get_total_counts() == 1, comm.get_total_counts()
        ref_updates, ref_state = tx.update({**gfull, "none": None}, ref_state)
        for k, flag in state.found_nan.items():
            if k == "none":
                assert flag is None
                continue
            assert not isinstance(flag, DTensor) and flag.dtype == torch.bool and flag.dim() == 0
            assert _same_on_all_ranks(flag), k
            assert bool(flag) == (k in bad), (k, bad, flag)
            assert torch.equal(flag, ref_state.found_nan[k]), k
        _assert_tree(updates, ref_updates)


# ---------------------------------------------------------------- stochastic_rounding

def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values just below and just above (or at) the float32 ``x`` (x > 0)."""
    down = (x.view(torch.int32) & -65536).view(torch.float32)  # truncation: toward 0
    up = (down.view(torch.int32) + 65536).view(torch.float32)
    exact = down == x
    return down.to(torch.bfloat16), torch.where(exact, down, up).to(torch.bfloat16)


@check
def stochastic_rounding_on_sharded_bf16_params(rank: int, world: int) -> None:
    """mixed_precision(sgd, master_weights=stochastic_rounding()) on bfloat16 DTensors:
    each element becomes one of its two neighbours, every rank's shard gets noise of its
    own, replicated params stay identical across ranks, and a step is reproducible."""
    mesh = _mesh(world)
    rows = 17 * world - 1  # uneven: 17 rows on every rank but the last, which has 16
    full = {
        "w": torch.ones(rows, 32, dtype=torch.bfloat16),
        "u": torch.ones(5, 3, dtype=torch.bfloat16),  # uneven, empty shards at 4 ranks
        "f": torch.ones(3, dtype=torch.float32),  # float32: written as is
    }
    params = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    params["r"] = distribute_tensor(torch.ones(64, dtype=torch.bfloat16), mesh, [Replicate()])
    # sgd(1.0) adds 2**-10 to every master value: 1 + 2**-10 lies between the bfloat16
    # neighbours 1 and 1 + 2**-7, and rounds up with probability 1/8
    grads = {k: DTensor.from_local(torch.full_like(p.to_local(), -(2.0 ** -10)), mesh,
                                   p.placements, shape=p.shape, stride=p.stride())
             for k, p in params.items()}
    opt = mixed_precision(functopt.sgd(1.0), loss_scale=static_loss_scale(1.0),
                          master_weights=stochastic_rounding())
    state = opt.init(params)
    with CommDebugMode() as comm:
        new, new_state = opt.step(grads, state, params)
    assert comm.get_total_counts() == 1  # the step's statistics; the rounding adds none
    again, _ = opt.step(grads, state, params)
    for k, p in new.items():
        assert isinstance(p, DTensor), k
        assert p.placements == params[k].placements and p.shape == params[k].shape, k
        assert p.dtype == params[k].dtype, k
        assert torch.equal(p.to_local(), again[k].to_local()), k  # reproducible
        local = p.to_local()
        if k == "f":
            assert torch.equal(local, params[k].to_local() + 2.0 ** -10), k
            continue
        exact = params[k].to_local().float() + 2.0 ** -10
        low, high = _neighbours(exact)
        assert bool(((local == low) | (local == high)).all()), (k, local)
    # independent noise per shard: the first 16 rows of every rank's "w" differ from
    # rank 0's (same content, 512 elements, each rounded up with probability 1/8)
    head = new["w"].to_local()[:16].contiguous()
    gathered = [torch.zeros_like(head) for _ in range(world)]
    dist.all_gather(gathered, head)
    for r in range(1, world):
        assert not torch.equal(gathered[r], gathered[0]), f"ranks 0 and {r} drew the same noise"
    ups = torch.stack(gathered).float().gt(1.0).double().mean().item()
    assert 0.05 < ups < 0.2, ups  # about 1/8 round up
    # replicas of a replicated param got the same noise: still identical on every rank
    r_local = new["r"].to_local()
    assert _same_on_all_ranks(r_local)
    assert not bool((r_local == r_local[0]).all()), "64 draws, all the same"
    # the next step draws other noise (the key moved)
    later, _ = opt.step(grads, new_state, params)
    assert not torch.equal(later["w"].to_local(), new["w"].to_local())
    # a DTensor param needs a DTensor value
    mw, gen = stochastic_rounding(), torch.Generator().manual_seed(0)
    with pytest.raises(TypeError, match=r"param is a DTensor but the new value is Tensor"):
        mw.write(params["w"], None, torch.ones(3), gen)
    # the sharded result is a proper DTensor: gathering it works
    assert _full(new["w"]).shape == (rows, 32)


# ------------------------------------------------------- adafactor on the per-leaf tier

def _per_leaf_step_on_shards(world: int, tx: Any, full: dict[str, torch.Tensor],
                             seed: int) -> tuple[Any, Any]:
    """Two donated ``make_step(tx)`` steps on uneven Shard(0) params, on the planner's
    per-leaf tier (explain says so, no FastPathWarning): bitwise the sharded pure step,
    with the same collectives, and equal to one process's step on the whole tensors.
    Returns the stepped params and state."""
    mesh = _mesh(world)
    params = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    ref_params = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    state, ref_state = tx.init(params), tx.init(ref_params)
    single, single_state = full, tx.init(full)
    explained = functopt.fast.explain(tx, params)
    assert explained.fast and {g.kernel for g in explained.groups} == {"per-leaf"}, explained
    step = functopt.fast.make_step(tx, donate=True)
    for i in range(2):
        torch.manual_seed(seed + i)
        grads = {k: torch.randn_like(v) for k, v in full.items()}
        sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in grads.items()}
        with CommDebugMode() as pure_comm:
            updates, ref_state = tx.update(sharded, ref_state, ref_params)
        ref_params = functopt.apply_updates(ref_params, updates)
        with CommDebugMode() as comm, warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("error", functopt.fast.FastPathWarning)
            params, state = step(sharded, state, params)
        assert comm.get_total_counts() == pure_comm.get_total_counts() > 0, (
            comm.get_comm_counts(), pure_comm.get_comm_counts())
        updates, single_state = tx.update(grads, single_state, single)
        single = functopt.apply_updates(single, updates)
    _assert_tree(params, ref_params)
    _assert_tree(state, ref_state)
    _assert_tree(params, single, bitwise=False, rtol=1e-12, atol=1e-15)
    return params, state


@check
def adafactor_make_step_on_shards_takes_the_per_leaf_tier(rank: int, world: int) -> None:
    """functopt.fast.make_step(adafactor) on the per-leaf tier (`_per_leaf_step_on_shards`;
    the factored means and block norms of a sharded matrix are DTensor reductions across
    the shards, as on the pure path), the statistics still DTensors."""
    del rank
    torch.manual_seed(5)
    full = {"w": torch.randn(5, 6, dtype=torch.float64), "w2": torch.randn(5, 6, dtype=torch.float64),
            "tall": torch.randn(7, 3, dtype=torch.float64), "b": torch.randn(5, dtype=torch.float64)}
    # (one recipe: ranks are slow)
    tx = functopt.adafactor(1e-2, min_dim_size_to_factor=2, momentum=0.9, weight_decay_rate=0.1)
    params, state = _per_leaf_step_on_shards(world, tx, full, seed=10)
    factored = state[0]
    assert all(isinstance(x, DTensor) for x in (factored.v_row["w"], factored.v_col["w"],
                                                 params["w"]))


@check
def unit_rules_make_step_on_shards_take_the_per_leaf_tier(rank: int, world: int) -> None:
    """functopt.fast.make_step(chain(centralize, adaptive_grad_clip, adamw)) on the
    per-leaf tier (`_per_leaf_step_on_shards`), which calls the two rules' own updates on
    the shards: a matrix's units are its rows, within a shard; a vector is one unit, whose
    norm is a DTensor reduction across the shards, as on the pure path."""
    del rank
    torch.manual_seed(6)
    full = {"w": torch.randn(5, 6, dtype=torch.float64),
            "k": torch.randn(5, 2, 3, dtype=torch.float64), "b": torch.randn(5, dtype=torch.float64)}
    tx = functopt.chain(functopt.centralize(), functopt.adaptive_grad_clip(0.05),
                        functopt.adamw(1e-2, weight_decay=0.1))
    _per_leaf_step_on_shards(world, tx, full, seed=20)


@check
def mixed_precision_adafactor_on_bf16_shards_takes_the_per_leaf_tier(rank: int,
                                                                     world: int) -> None:
    """mixed_precision(adafactor) on bfloat16 Shard(0) params with float32 masters: the
    fused mixed step takes the per-leaf tier (no FastPathWarning) and equals the pure
    mixed step on the same shards bitwise, masters and statistics still DTensors. The
    second step overflows in the last row (one rank's shard) and is skipped: the per-leaf
    tier keeps the statistics, whose placement the first step changed (Adafactor's row
    means start Replicate and come back Shard(0)). At 2 ranks only (the step's DTensor ops
    cost seconds at 4 on two cores; the 4-rank shards, one of them empty, are the check
    above's)."""
    del rank
    if world != 2:
        return
    mesh = _mesh(world)
    torch.manual_seed(6)
    full = {"w": torch.randn(5, 6), "w2": torch.randn(5, 6), "b": torch.randn(5)}
    full = {k: v.to(torch.bfloat16) for k, v in full.items()}

    def build() -> functopt.GradientTransformation:
        return functopt.adafactor(1e-2, min_dim_size_to_factor=2, momentum=0.9)

    fast, pure = mixed_precision(build(), max_grad_norm=1.0), mixed_precision(
        build(), max_grad_norm=1.0, fused=False)
    params = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    ref_params = dict(params)
    state, ref_state = fast.init(params), pure.init(ref_params)
    for i in range(3):
        torch.manual_seed(20 + i)
        plain = {k: torch.randn(v.shape).to(torch.bfloat16) for k, v in full.items()}
        if i == 1:
            plain["w"][4, 0] = float("inf")
        grads = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in plain.items()}
        masters = {k: _full(v) for k, v in state.master.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("error", functopt.fast.FastPathWarning)
            params, state = fast.step(grads, state, params)
        ref_params, ref_state = pure.step(grads, ref_state, ref_params)
        if i == 1:
            _assert_tree({k: _full(v) for k, v in state.master.items()}, masters)
    _assert_tree(params, ref_params)
    _assert_tree(state.master, ref_state.master)
    _assert_tree(state.inner_state, ref_state.inner_state)
    factored = state.inner_state[0]
    assert all(isinstance(x, DTensor) for x in (factored.v_row["w"], state.master["w"]))
