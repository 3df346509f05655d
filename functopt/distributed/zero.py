r"""ZeRO-1 for replicated params: shard the optimizer state and the master over the ranks.

With data parallelism (DDP), every rank holds all params and, after DDP's all-reduce, the
same averaged gradients, so every rank would compute the same update with the same
optimizer state: for bfloat16 params and Adam, 12 of the 14 bytes per param (float32
master, ``mu``, ``nu``) are copies. [`zero1`][functopt.distributed.zero1] (Megatron-LM's
``DistributedOptimizer``, ZeRO stage 1) keeps on each of the $N$ ranks only the state of
its slice of every param: the rank updates its slices with
[`mixed_precision`][functopt.precision.mixed_precision] around the inner rule, and one
``all_gather`` gives every rank all new params.

Layout: each param leaf is flattened and split like ``torch.chunk(N)``, which is how
DTensor's ``Shard(0)`` splits: with $c = \lceil n / N \rceil$, rank $r$ owns elements
$[\min(rc, n), \min((r+1)c, n))$ of a leaf of $n$ elements (10 elements over 4 ranks:
3, 3, 3, 1; a leaf with fewer than $N$ elements leaves some ranks an empty slice). No
rank holds more than $c$, one element above an even share, which is what the memory of
the busiest rank and the padded all-gather buffer pay for. The split is DTensor's so that
a rank's slice *is* its local shard of the flattened leaf as a ``Shard(0)`` DTensor:
[`zero1_state_to_dict`][functopt.distributed.zero1_state_to_dict] hands the state to
``torch.distributed.checkpoint`` as such DTensors, which DCP saves per rank without
collision and reshards on load to another data-parallel size. Slicing per leaf rather than flattening all leaves into
one buffer keeps the state a pytree with the params' structure: a path-based ``mask``,
``partition`` or ``named_chain`` inside still finds its leaves, and the state can be
inspected by name. The price: the inner rule sees 1-D slices, so it must be elementwise
(Adam, AdamW, SGD, Lion, ... as in Megatron-LM); rules that read a whole leaf (per-leaf
norms as in LARS/LAMB, Adafactor's factored moments) or its shape (a mask by ``ndim``)
see only a slice and are wrong under ZeRO-1. Global reductions (clipping, overflow) are
done right by the step itself: use ``max_grad_norm``, not an inner ``clip_by_global_norm``.

One step makes two collectives, whatever the number of leaves and dtypes:

1. one ``all_reduce`` of the packed gradient statistics of the rank's slices
   (sum of squares, non-finite count, zero count; see
   [`global_grad_stats`][functopt.distributed.global_grad_stats]), so the norm, the clip
   factor, the overflow decision and the loss scale are global and equal on every rank;
2. one coalesced ``all_gather`` of the new slices, written straight into the new params
   (``functopt/distributed/_zero_gather.py``): no send or receive buffer beside them, and
   params of several dtypes still travel together.

Each collective is bounded by ``timeout`` (600 s by default): a rank that dies or hangs
before it makes the others raise within the bound, naming the collective, the group's
ranks, the timeout and the fix, rather than wait for the process group's timeout. The
step's host work is a few Python operations per leaf, none per rank, so it does not grow
with the number of ranks (``benchmarks/zero1.py``).

Equality with the unsharded run (``mixed_precision`` with the same arguments on the whole
params and gradients): the update is elementwise, so params, masters and inner state are
bitwise those of the unsharded run, skipped steps included, whenever the step does not
clip. With ``max_grad_norm``, the global sum of squares adds per-slice float32 sums
instead of per-leaf ones (another rounding order), so the norm, the clip factor and hence
the params may differ in their last bits (relative $10^{-6}$ in the tests).

A non-finite gradient element counts where its owner's slice reads it. DDP's gradients are
identical on every rank, so this is every non-finite element; with gradients that differ
between ranks (not a ZeRO-1 setting) an element outside a rank's slice is never read.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist

from functopt._base import GradientTransformation, Params
from functopt._collective.agreement import Agreement, check_timeout
from functopt._collective.counting import Replicated, _entries
from functopt._collective.dtensor import _rewrap_like, is_dtensor, local_tensor
from functopt.distributed._zero_gather import ZERO1_TIMEOUT_S, ZERO1_WORDING, bound, gather
from functopt.distributed._zero_state import Zero1State, mesh_of
from functopt.distributed.checkpoint import _checked, _flat, _rebuild, _with_record
from functopt.precision.loss_scale import LossScale
from functopt.precision.master import MasterWeights
from functopt.precision.step import (
    MixedPrecisionState,
    MixedPrecisionTransformation,
    _mixed_precision,
)
from functopt.transforms._common import flatten_params
from functopt.tree import _core

__all__ = [
    "slice_bounds",
    "zero1",
    "zero1_reduce_scatter",
    "zero1_state_from_dict",
    "zero1_state_to_dict",
]

def slice_bounds(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, end)`` of the elements of a flattened leaf of ``numel`` elements that ``rank`` owns.

    The split of ``torch.chunk(world_size)`` and of DTensor's ``Shard(0)``: every rank owns
    ``ceil(numel / world_size)`` elements until the leaf runs out, so the last ranks may own
    fewer or none.

    Examples:
        >>> from functopt.distributed.zero import slice_bounds
        >>> [slice_bounds(10, r, 4) for r in range(4)]
        [(0, 3), (3, 6), (6, 9), (9, 10)]
        >>> [slice_bounds(5, r, 4) for r in range(4)]
        [(0, 2), (2, 4), (4, 5), (5, 5)]
    """
    size = -(-numel // world_size)
    return min(rank * size, numel), min((rank + 1) * size, numel)


def _resolve_group(process_group: dist.ProcessGroup | None,
                   ) -> tuple[dist.ProcessGroup | None, int, int]:
    """``(group, rank in it, its size)``; ``(None, 0, 1)`` for one unsharded rank."""
    group = process_group
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    if group is None:
        return None, 0, 1
    world = dist.get_world_size(group)
    if world == 1:
        return None, 0, 1
    return group, dist.get_rank(group), world


def _model_parallel(owner: str, leaves: list[Any], treespec: _core.TreeSpec,
                    group: dist.ProcessGroup | None) -> Any:
    """The 1-D mesh of the DTensor (tensor-parallel) params, or ``None`` if there are none.

    All of them must lie on one 1-D mesh whose ranks meet the data-parallel group only in
    this rank (the mesh is the tensor-parallel group, the data-parallel group crosses it).
    """
    mesh = None
    for i, p in enumerate(leaves):
        if not is_dtensor(p):
            continue
        where = _core.paths(treespec)[i]
        if p.device_mesh.ndim != 1:
            raise ValueError(
                f"{owner}: params leaf {where!r} is a DTensor on a {p.device_mesh.ndim}-D mesh "
                f"({p.device_mesh}); zero1 takes tensor-parallel params on a 1-D mesh (the "
                f"tensor-parallel dimension, e.g. mesh['tp']), and shards over the data-"
                f"parallel group itself. Fix: parallelize the model on the 1-D sub-mesh. With "
                f"FSDP2 (params sharded over the data-parallel ranks) the state is already "
                f"sharded like them: use functopt.precision.mixed_precision directly."
            )
        if any(pl.is_partial() for pl in p.placements):
            raise ValueError(
                f"{owner}: params leaf {where!r} is a Partial DTensor; expected Shard or "
                f"Replicate (tensor-parallel params)."
            )
        if mesh is None:
            mesh = p.device_mesh
            ranks = {int(r) for r in mesh.mesh.reshape(-1).tolist()}
            dp = set(dist.get_process_group_ranks(group)) if group is not None else {
                dist.get_rank()}
            if ranks & dp != {dist.get_rank()}:
                raise ValueError(
                    f"{owner}: params leaf {where!r} is a DTensor on mesh {mesh}, which shares "
                    f"ranks {sorted(ranks & dp)} with the data-parallel group {sorted(dp)}; "
                    f"zero1 shards over the data-parallel group and expects DTensor params "
                    f"sharded over other ranks (tensor parallel). Fix: pass "
                    f"process_group=mesh_2d['dp'].get_group() and parallelize on "
                    f"mesh_2d['tp']; with FSDP2 params (sharded over the data-parallel ranks) "
                    f"the state is already sharded like them: use "
                    f"functopt.precision.mixed_precision directly."
                )
        elif p.device_mesh != mesh:
            raise ValueError(
                f"{owner}: params leaf {where!r} is a DTensor on mesh {p.device_mesh}, another "
                f"is on {mesh}; zero1 takes tensor-parallel params on one 1-D mesh."
            )
    return mesh

class _Plan(NamedTuple):
    """What one init or step of zero1 works on."""

    leaves: list[Any]  # the params as given (plain tensors, DTensors, None)
    treespec: _core.TreeSpec
    local: list[Any]  # each param's local tensor (its local shard for a DTensor)
    mine: list[tuple[int, int] | None]  # this rank's (start, end) per leaf
    group: dist.ProcessGroup | None  # the data-parallel group (None: one rank)
    rank: int
    world: int
    opt: MixedPrecisionTransformation  # the inner step on the slices
    limit: Agreement | None  # the bound of the all-gather (None: one rank)


def _slice(x: torch.Tensor | None, bounds: tuple[int, int] | None) -> torch.Tensor | None:
    if x is None or bounds is None:
        return None
    return x.detach().reshape(-1)[bounds[0]:bounds[1]]


def zero1(
    inner: GradientTransformation,
    *,
    process_group: dist.ProcessGroup | None = None,
    stats_group: dist.ProcessGroup | None = None,
    replicated: Replicated = None,
    loss_scale: LossScale | None = None,
    master_weights: MasterWeights | None = None,
    max_grad_norm: float | torch.Tensor | None = None,
    fused: bool = True,
    timeout: float | datetime.timedelta | None = None,
) -> MixedPrecisionTransformation:
    r"""[`mixed_precision`][functopt.precision.mixed_precision] with its state sharded over the data-parallel ranks (ZeRO-1).

    For replicated params (DDP: every rank holds all params and the same averaged
    gradients). ``init(params)`` and ``step(grads, state, params) -> (params, state)`` take
    and return the *full* params on every rank, like ``mixed_precision``; the state holds
    only this rank's slice of every leaf (``torch.chunk`` of the flattened leaf,
    see [`slice_bounds`][functopt.distributed.slice_bounds]): master copies and inner
    state take about $1/N$ of the memory on each of the $N$ ranks. It is a
    [`MixedPrecisionState`][functopt.precision.MixedPrecisionState] whose per-leaf fields
    are 1-D slices; ``metrics`` and ``loss_scale`` are global, equal on every rank.

    Each step makes exactly two collectives: one ``all_reduce`` of the packed gradient
    statistics (global norm, overflow, zero count) and one coalesced ``all_gather`` of the
    new slices (all leaves and dtypes together), which writes them straight into the new
    params: the gather allocates nothing beside them (the backend may: gloo's coalesced
    all-gather uses temporaries of its own). With ``fused=False``, params,
    masters and inner state are bitwise those of ``mixed_precision`` on the whole params
    without clipping; with ``max_grad_norm`` the norm is summed in another order
    (last-bit differences). The fused kernels agree to rounding only: PyTorch's CPU kernel
    rounds the vectorised body of a tensor and its tail differently, so an element's
    result can depend on where the slice boundary falls. On overflow every rank skips:
    params, masters and inner state stay bitwise unchanged.
    See ``functopt/distributed/zero.py`` for the layout and its trade-offs.

    ``grads`` may give each leaf either as the full gradient (the param's shape, the same
    on every rank, as after DDP's all-reduce) or as this rank's 1-D slice of it (as
    [`zero1_reduce_scatter`][functopt.distributed.zero1_reduce_scatter] returns it: ZeRO-2's
    reduce-scatter instead of an all-reduce), leaf by leaf. Checkpoints go through
    [`zero1_state_to_dict`][functopt.distributed.zero1_state_to_dict], which lets
    ``torch.distributed.checkpoint`` save every rank's slices and reshard them to another
    data-parallel size.

    ``inner`` must be elementwise (``adamw``, ``adam``, ``sgd``, ``lion``, ...): it sees
    1-D slices of the leaves, not the leaves (the same restriction as Megatron-LM's
    ``DistributedOptimizer``).

    Tensor parallelism composes: params may be DTensors on one 1-D mesh (the
    tensor-parallel ranks, e.g. ``mesh_2d["tp"]``) across which the data-parallel group
    runs. Each rank then slices its *local shard* over the data-parallel group, the
    all-gather reassembles the local shards (returned as DTensors placed like the params),
    and the statistics are summed once over ``stats_group`` (all data- and
    tensor-parallel ranks), each element counted once: a slice of a ``Shard`` piece on
    every rank, of a ``Replicate()`` piece (a row-parallel bias) on tensor-parallel rank
    0, and plain params beside them (left out of the plan) as ``replicated`` declares. So
    every rank agrees on the norm, the clip factor, the skip and the loss scale.

    Args:
        inner: the elementwise update rule, e.g. ``functopt.adamw(1e-3)``.
        process_group: the data-parallel ranks to shard over. ``None`` means the default
            group when ``torch.distributed`` is initialized at ``init``/``step`` time, and
            a single unsharded rank otherwise.
        stats_group: with tensor-parallel (DTensor) params, the ranks the gradient
            statistics are summed over: every rank holding a part of the model. ``None``:
            the world, when the data-parallel group times the tensor-parallel mesh is the
            world (otherwise it raises, asking for it). Without DTensor params the
            statistics are summed over ``process_group``.
        replicated: with tensor-parallel params, how the *plain* params beside them repeat
            over the tensor-parallel ranks: ``True`` (alike on them, as a param left out of
            the tensor-parallel plan; counted once), ``False`` (each rank's own part), a
            ``ProcessGroup`` (alike over that subgroup), or a pytree of these per param.
            Required when plain and DTensor params meet; not read without DTensor params
            (each plain slice is then its rank's part).
        loss_scale: as in ``mixed_precision``.
        master_weights: as in ``mixed_precision`` (default: float32 copies of the
            bfloat16 and float16 slices).
        max_grad_norm: as in ``mixed_precision``: the global norm over all ranks' slices.
        fused: as in ``mixed_precision``: the planner's fused kernels on each slice.
        timeout: how long each collective of the step (the statistics' all-reduce, the
            all-gather) may wait for the other ranks, in seconds or a
            ``datetime.timedelta`` (default 600 s, NCCL's default timeout). Past it, or
            when the backend reports a rank gone, the step raises the backend's
            ``RuntimeError`` with a note naming zero1's collective, the group's ranks, the
            timeout and the fix. The wait holds the host until the collective completes.

    Returns:
        A [`MixedPrecisionTransformation`][functopt.precision.MixedPrecisionTransformation].

    Raises:
        TypeError: ``process_group`` or ``stats_group`` is not a process group (and
            ``mixed_precision``'s argument errors).
        RuntimeError: at ``step``, a collective timed out or a rank is gone (see
            ``timeout``).
        ValueError: a DTensor param is not on one 1-D mesh crossing the data-parallel
            group (FSDP2 params: their state is already sharded like them, use
            ``mixed_precision``), a plain param beside DTensor params without a
            ``replicated`` declaration, or a gradient has neither its param's (local) shape
            nor the shape of this rank's slice; ``timeout`` is not a positive number of
            seconds.

    Examples:
        >>> import torch, functopt
        >>> from functopt.distributed.zero import zero1
        >>> opt = zero1(functopt.adamw(1e-2))  # no process group: one rank, no collectives
        >>> params = {"w": torch.ones(2, 3, dtype=torch.bfloat16)}
        >>> state = opt.init(params)
        >>> params, state = opt.step({"w": torch.ones(2, 3, dtype=torch.bfloat16)}, state, params)
        >>> params["w"].shape, state.master["w"].shape  # this rank's slice: all 6 elements
        (torch.Size([2, 3]), torch.Size([6]))
    """
    init_fn, step_slices, buffers = _zero1_parts(
        "zero1", inner, process_group=process_group, stats_group=stats_group,
        replicated=replicated, loss_scale=loss_scale, master_weights=master_weights,
        max_grad_norm=max_grad_norm, fused=fused, timeout=timeout)

    def step_fn(grads: Any, state: MixedPrecisionState, params: Params,
                **extra_args: Any) -> tuple[Params, MixedPrecisionState]:
        pl, new_leaves, new_state = step_slices(grads, state, params, **extra_args)
        full = gather(new_leaves, pl.local, pl.rank, pl.world, pl.group, pl.limit)
        return _core.unflatten(pl.treespec, _rewrap(pl.leaves, full)), new_state

    return MixedPrecisionTransformation(init_fn, step_fn, buffers)


_Parts = tuple[
    Callable[[Params], MixedPrecisionState],
    Callable[..., tuple[_Plan, list[Any], MixedPrecisionState]],
    Callable[[], list[torch.Tensor]],
]


def _rewrap(leaves: list[Any], full: list[Any]) -> list[Any]:
    """The gathered local tensors, as DTensors placed like the params where they are."""
    return [t if p is None or not is_dtensor(p) else _rewrap_like(p, t)
            for p, t in zip(leaves, full, strict=True)]


def _zero1_parts(
    owner: str,
    inner: GradientTransformation,
    *,
    process_group: dist.ProcessGroup | None,
    stats_group: dist.ProcessGroup | None,
    replicated: Replicated,
    loss_scale: LossScale | None,
    master_weights: MasterWeights | None,
    max_grad_norm: float | torch.Tensor | None,
    fused: bool,
    timeout: float | datetime.timedelta | None,
) -> _Parts:
    """``init``, the step up to the new slices (``(plan, new slices, state)``), and
    ``buffers`` of zero1: what zero1 and zero1_overlapped share; the gather is theirs."""
    _check_groups(owner, process_group, stats_group)
    timeout_s = check_timeout(owner, "timeout", timeout, ZERO1_TIMEOUT_S)
    # The declarations the inner step reads, per slice leaf, for the step in progress: who
    # counts which slice in the statistics (set by `plan` before every init and step).
    current: list[Any] = [None]

    def build(stats: dist.ProcessGroup | None) -> MixedPrecisionTransformation:
        # the statistics' all-reduce bounded by `timeout`: the skip agreement's bound, over
        # the statistics' own group (which it spans: no collective is added)
        return _mixed_precision(
            inner, loss_scale=loss_scale, master_weights=master_weights,
            max_grad_norm=max_grad_norm, process_group=stats,
            replicated=None if stats is None else (lambda _slices: current[0]),
            agree_skip=False if stats is None else stats,
            agree_timeout=None if stats is None else timeout_s, count_zeros=False,
            donate=False, fused=fused, compile=False, wording=ZERO1_WORDING)

    # Built now to validate the arguments; the sharded step is built per group, lazily,
    # because the default group may be created after the optimizer.
    unsharded = build(None)
    by_group: dict[int, tuple[dist.ProcessGroup, MixedPrecisionTransformation]] = {}

    def plan(params: Params) -> _Plan:
        leaves, treespec = flatten_params(params)
        group, rank, world = _resolve_group(process_group)
        mesh = _model_parallel(owner, leaves, treespec, group)
        if mesh is None:  # data parallel only: each slice is its rank's part
            stats, entries = group, [False] * len(leaves)
        else:
            stats = _stats_group(owner, stats_group, world, mesh)
            entries = _tp_entries(owner, mesh.get_group(), _entries(
                owner, replicated, params, leaves, treespec), leaves, treespec)
        if stats is None:
            opt = unsharded
        else:
            cached = by_group.get(id(stats))
            if cached is None or cached[0] is not stats:  # (an id can be reused)
                cached = by_group[id(stats)] = (stats, build(stats))
            opt = cached[1]
        current[0] = _core.unflatten(treespec, entries)
        local = [None if p is None else local_tensor(p) for p in leaves]
        mine = [None if p is None else slice_bounds(p.numel(), rank, world) for p in local]
        limit = None if group is None else bound(group, timeout_s)
        return _Plan(leaves, treespec, local, mine, group, rank, world, opt, limit)

    def init_fn(params: Params) -> MixedPrecisionState:
        pl = plan(params)
        return Zero1State(*pl.opt.init(_core.unflatten(
            pl.treespec, [_slice(p, b) for p, b in zip(pl.local, pl.mine, strict=True)])))

    def step_slices(grads: Any, state: MixedPrecisionState, params: Params,
                    **extra_args: Any) -> tuple[_Plan, list[Any], MixedPrecisionState]:
        pl = plan(params)
        treespec, rank, world = pl.treespec, pl.rank, pl.world
        grad_leaves = _core.flatten_like(treespec, grads, name="grads", reference="params")
        _core.check_tensors(grad_leaves, treespec, name="grads", floating=True)
        grad_slices = [_grad_slice(owner, treespec, i, g, p, lp, b, rank, world)
                       for i, (g, p, lp, b) in enumerate(
                           zip(grad_leaves, pl.leaves, pl.local, pl.mine, strict=True))]
        new_slices, new_state = pl.opt.step(
            _core.unflatten(treespec, grad_slices),
            state,
            _core.unflatten(treespec, [_slice(p, b) for p, b in zip(pl.local, pl.mine,
                                                                      strict=True)]),
            **extra_args,
        )
        new_leaves = _core.flatten_like(treespec, new_slices, name="new params",
                                        reference="params")
        return pl, new_leaves, Zero1State(*new_state)

    def buffers() -> list[torch.Tensor]:
        return [*unsharded.buffers(), *(b for _, mp in by_group.values() for b in mp.buffers())]

    return init_fn, step_slices, buffers


def _check_groups(owner: str, process_group: Any, stats_group: Any) -> None:
    """``process_group`` and ``stats_group`` are process groups or None."""
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"{owner}: process_group must be a torch.distributed.ProcessGroup or None (the "
            f"default group), got {type(process_group).__name__}. Fix: pass e.g. "
            f"torch.distributed.group.WORLD or the data-parallel group."
        )
    if stats_group is not None and not isinstance(stats_group, dist.ProcessGroup):
        raise TypeError(
            f"{owner}: stats_group must be a torch.distributed.ProcessGroup or None, got "
            f"{type(stats_group).__name__}."
        )


def _stats_group(owner: str, stats_group: dist.ProcessGroup | None, world: int,
                 mesh: Any) -> dist.ProcessGroup | None:
    """The group the gradient statistics are summed over beside a tensor-parallel mesh:
    ``stats_group``, or the world where it is the data-parallel group times the mesh."""
    if stats_group is not None:
        return stats_group
    if world * mesh.size() != dist.get_world_size():
        raise ValueError(
            f"{owner}: the data-parallel group ({world} ranks) times the tensor-parallel mesh "
            f"({mesh.size()} ranks) is not the world ({dist.get_world_size()} ranks), so the "
            f"group the gradient statistics are summed over cannot be inferred. Fix: pass "
            f"stats_group, the group of all ranks holding a part of this model (data- and "
            f"tensor-parallel).")
    return dist.group.WORLD


def _tp_entries(owner: str, tp_group: dist.ProcessGroup, declared: list[Any],
                leaves: list[Any], treespec: _core.TreeSpec) -> list[Any]:
    """Who counts each slice in the statistics beside a tensor-parallel mesh: False (a part),
    or the group over which it is a copy."""
    entries: list[Any] = []
    for i, (p, entry) in enumerate(zip(leaves, declared, strict=True)):
        if p is None or is_dtensor(p):
            # a slice of a Shard piece is a part; of a Replicate one, a copy over TP
            replicate = p is not None and p.placements[0].is_replicate()
            entries.append(tp_group if replicate else False)
        elif entry is None:
            raise ValueError(
                f"{owner}: params leaf {_core.paths(treespec)[i]!r} is a plain tensor beside "
                f"tensor-parallel (DTensor) params; it is unclear whether the tensor-parallel "
                f"ranks hold the same values (count it once) or each its own part. Fix: pass "
                f"replicated=True (alike on the tensor-parallel ranks: a param left out of the "
                f"plan), replicated=False, or a pytree of such bools (or of process groups) per "
                f"param.")
        else:
            entries.append(tp_group if entry is True else entry)
    return entries


def _grad_slice(owner: str, treespec: _core.TreeSpec, i: int, g: torch.Tensor | None, p: Any,
                lp: Any, b: tuple[int, int] | None, rank: int, world: int) -> torch.Tensor | None:
    """This rank's slice of gradient leaf ``i`` (param ``p``, its local tensor ``lp``, the
    slice ``b``): taken from a full gradient, or the gradient itself if it is the slice."""
    if g is None or p is None or b is None:
        return None if g is None or b is None else _slice(g, b)
    if is_dtensor(g) != is_dtensor(p) and not (not is_dtensor(g) and g.dim() == 1
                                               and g.shape == (b[1] - b[0],)):
        raise ValueError(
            f"{owner}: {_core.paths(treespec)[i]!r}: the grad is "
            f"{'a DTensor' if is_dtensor(g) else 'a plain tensor'} but the param is "
            f"{'a DTensor' if is_dtensor(p) else 'a plain tensor'}. Fix: pass the gradients "
            f"autograd gives the params (or this rank's slices).")
    lg = local_tensor(g)
    if lg.shape == lp.shape:
        return _slice(lg, b)  # a full gradient: take the slice
    if not is_dtensor(g) and g.shape == (b[1] - b[0],):
        return g.detach()  # already this rank's slice (reduce-scattered)
    what = "local shard's" if is_dtensor(p) else "param's"
    raise ValueError(
        f"{owner}: {_core.paths(treespec)[i]!r}: grad has shape {tuple(lg.shape)}; expected "
        f"the {what} shape {tuple(lp.shape)} (the full, all-reduced gradient) or "
        f"({b[1] - b[0]},) (this rank's slice, rank {rank} of {world}: elements {b[0]} to "
        f"{b[1]} of the flattened param, as zero1_reduce_scatter returns it). Fix: pass one "
        f"of the two.")


def _flat_keys(state: Any) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Each non-``None`` state leaf's dict key (as `state_to_dict` words it) and accessor path."""
    leaves, treespec = _core.flatten(state)
    keys = _core.paths(treespec)
    accessors = [tuple(a) for a in optree.treespec_accessors(treespec)]
    kept = [(k, a) for k, a, x in zip(keys, accessors, leaves, strict=True) if x is not None]
    return [k for k, _ in kept], [a for _, a in kept]


def _slice_keys(owner: str, state: Any, params: Params, rank: int,
                world: int) -> dict[str, tuple[int, int]]:
    """``{key: (numel of the param, this rank's slice length)}`` for the per-param state leaves.

    A state leaf is per-param when it lies in ``master`` or ``inner_state``, is not 0-d
    (a slice is 1-D even for a 0-d param; counters are 0-d), and its path ends with a
    param's path (the longest such param); it must then be this rank's slice of that param.
    """
    if not isinstance(state, MixedPrecisionState):
        raise TypeError(
            f"{owner}: state must be the MixedPrecisionState of zero1(...).init or .step, got "
            f"{type(state).__name__}."
        )
    leaves, treespec = flatten_params(params)
    leaves = [None if p is None else local_tensor(p) for p in leaves]  # slices of local shards
    by_path = {tuple(a): p for a, p in zip(optree.treespec_accessors(treespec), leaves,
                                              strict=True)}
    longest = max((len(a) for a in by_path), default=0)
    state_leaves = [x for x in _core.flatten(state)[0] if x is not None]
    out: dict[str, tuple[int, int]] = {}
    for key, path, x in zip(*_flat_keys(state), state_leaves, strict=True):
        if key.split(".", 1)[0] not in ("master", "inner_state"):
            continue  # the loss scale, the metrics, the key: equal on every rank
        if isinstance(x, torch.Tensor) and x.dim() == 0:
            continue  # a counter or a hyperparameter of the inner rule
        param = next((by_path[path[len(path) - n:]]
                      for n in range(min(longest, len(path)), -1, -1)
                      if path[len(path) - n:] in by_path), None)
        if param is None:
            continue
        start, end = slice_bounds(param.numel(), rank, world)
        if not isinstance(x, torch.Tensor) or is_dtensor(x) or x.shape != (end - start,):
            raise ValueError(
                f"{owner}: state leaf {key!r} belongs to a param of {param.numel()} elements "
                f"but is {_core._describe(x)}, not this rank's slice of shape "
                f"({end - start},) (rank {rank} of {world}). Fix: pass a state made by "
                f"zero1(...).init or .step on these params, with the same process group."
            )
        out[key] = (param.numel(), end - start)
    return out


def zero1_state_to_dict(state: MixedPrecisionState, params: Params, *,
                        process_group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    r"""A [`zero1`][functopt.distributed.zero1] state as a flat dict for ``torch.distributed.checkpoint``, resharding included.

    The keys are [`state_to_dict`][functopt.distributed.state_to_dict]'s, its integrity
    record included (over the DTensors below: one ``all_reduce``). Each rank's slice
    of a param's state (master, moments) becomes its local shard of a ``Shard(0)``
    DTensor over the data-parallel group whose global tensor is the flattened leaf, of
    ``param.numel()`` elements (no copy: the DTensor wraps the slice). DCP therefore saves
    every rank's slice at its own offset, and loads it on another data-parallel size
    (``N -> M``) into the slices of the loading run. Counters, the loss scale and the
    metrics are plain tensors, equal on every rank. On one rank (no group, or a group of
    one), the slices are the whole flattened leaves, as plain tensors.

    With tensor-parallel (DTensor) params, a rank's slices are slices of its *local*
    shards, whose global tensor is the flattened local shard; the keys of these entries
    end with ``@tp<tensor-parallel rank>`` (``'master.0.weight@tp1'``), so the
    tensor-parallel ranks' slices are saved side by side. Such a checkpoint loads on any
    data-parallel size with the same tensor-parallel size.

    Args:
        state: a state of ``zero1(...)`` (from ``init`` or ``step``).
        params: the full params that state belongs to (for each leaf's global size).
        process_group: the group given to ``zero1`` (``None``: the default group if
            ``torch.distributed`` is initialized, as in ``zero1``).

    Returns:
        A new flat dict of tensors and DTensors.

    Raises:
        ValueError: a per-param state leaf is not this rank's slice (a state of another
            group size or of other params), or a param is a DTensor; and
            ``state_to_dict``'s errors.

    Examples:
        >>> import torch, functopt
        >>> from functopt.distributed import zero1, zero1_state_to_dict
        >>> params = {"w": torch.ones(2, 3, dtype=torch.bfloat16)}
        >>> state = zero1(functopt.adamw(1e-2)).init(params)
        >>> d = zero1_state_to_dict(state, params)  # one rank: whole flattened leaves
        >>> d["master.w"].shape, d["inner_state.0.mu.w"].shape
        (torch.Size([6]), torch.Size([6]))
    """
    owner = "zero1_state_to_dict"
    out = _flat(owner, state, params)
    group, rank, world = _resolve_group(process_group)
    slices = _slice_keys(owner, state, params, rank, world)
    suffix = _tp_suffix(owner, params, group)
    if group is not None:
        from torch.distributed.tensor import DTensor, Shard  # (importing it costs 0.7 s)
    for key, (numel, _) in slices.items():
        local = out.pop(key)
        out[key + suffix] = local if group is None else DTensor.from_local(
            local, mesh_of(group, local.device.type), [Shard(0)], run_check=False,
            shape=torch.Size((numel,)), stride=(1,))
    return _with_record(out, {k + suffix for k in slices} if suffix else set())  # TP, 1 DP rank


def _tp_suffix(owner: str, params: Params, group: dist.ProcessGroup | None) -> str:
    """``''``, or ``'@tp<rank>'`` with tensor-parallel params: each tensor-parallel rank's
    slices (of its own local shards) are saved under keys of their own."""
    leaves, treespec = flatten_params(params)
    mesh = _model_parallel(owner, leaves, treespec, group)
    return "" if mesh is None else f"@tp{mesh.get_local_rank()}"


def zero1_state_from_dict(d: dict[str, Any], template: MixedPrecisionState, params: Params, *,
                          process_group: dist.ProcessGroup | None = None) -> MixedPrecisionState:
    r"""Rebuild a [`zero1`][functopt.distributed.zero1] state from a dict of [`zero1_state_to_dict`][functopt.distributed.zero1_state_to_dict].

    ``template`` is ``zero1(...).init(params)`` on the loading ranks (their data-parallel
    size may differ from the saving run's). Load into ``zero1_state_to_dict(template,
    params)`` with ``torch.distributed.checkpoint``, which reads every DTensor entry into
    this rank's slice, then call this:

    ```text
    dcp.save({"opt": zero1_state_to_dict(state, params)}, checkpoint_id=path)  # N ranks
    # later, on M ranks:
    template = opt.init(params)
    loaded = {"opt": zero1_state_to_dict(template, params)}
    dcp.load(loaded, checkpoint_id=path)            # each rank reads its slices
    state = zero1_state_from_dict(loaded["opt"], template, params)
    ```

    Args:
        d: the dict, with every key of ``zero1_state_to_dict(template, params)``.
        template: a state of the same ``zero1`` on these ranks.
        params: the full params.
        process_group: as given to ``zero1``.

    Returns:
        The state, holding the dict's local tensors (no copies).

    Raises:
        ValueError: a DTensor entry of another global shape (a checkpoint of other
            params), and ``state_from_dict``'s errors (naming the key; on every rank
            for a dict that fails its integrity record, e.g. a torn checkpoint).
        TypeError: an entry is a plain tensor where this rank expects a DTensor slice,
            or the reverse.

    Examples:
        >>> import torch, functopt, functopt.testing
        >>> from functopt.distributed import zero1, zero1_state_from_dict, zero1_state_to_dict
        >>> opt = zero1(functopt.adamw(1e-2))
        >>> params = {"w": torch.ones(2, 3)}
        >>> params, state = opt.step({"w": torch.ones(2, 3)}, opt.init(params), params)
        >>> d = zero1_state_to_dict(state, params)
        >>> back = zero1_state_from_dict(d, opt.init(params), params)
        >>> functopt.testing.bitwise_equal(back, state)
        True
    """
    owner = "zero1_state_from_dict"
    group, rank, world = _resolve_group(process_group)
    slices = _slice_keys(owner, template, params, rank, world)
    suffix = _tp_suffix(owner, params, group)

    def rebuild(plain: dict[str, Any]) -> MixedPrecisionState:
        plain.update({k: plain.pop(k + suffix) for k in slices if k + suffix in plain})
        for key, (numel, _) in slices.items() if group is not None else ():
            value = plain.get(key)
            if value is None:
                continue  # _rebuild names the missing key
            if not is_dtensor(value):
                raise TypeError(
                    f"{owner}: entry {key!r} is {_core._describe(value)}; on rank {rank} of "
                    f"{world} it must be the DTensor of zero1_state_to_dict(template, "
                    f"params) (the flattened leaf of {numel} elements, Shard(0)). Fix: load "
                    f"the checkpoint into zero1_state_to_dict(template, params) with "
                    f"torch.distributed.checkpoint."
                )
            if value.shape != (numel,):
                raise ValueError(
                    f"{owner}: entry {key!r} is a flattened leaf of {tuple(value.shape)} "
                    f"elements, the param has {numel}. Fix: load a state saved for params "
                    f"of the same shapes."
                )
            plain[key] = value.to_local()
        return _rebuild(owner, plain, template)  # type: ignore[no-any-return]

    owned = {k + suffix for k in slices} if suffix else set()  # TP, 1 DP rank: plain, own
    state = _checked(owner, d, rebuild, group is not None or bool(owned), owned)
    return state  # type: ignore[no-any-return]


def _reduce_scatter(out: torch.Tensor, buf: torch.Tensor, group: dist.ProcessGroup) -> None:
    scatter = getattr(dist, "reduce_scatter_single", None)  # torch >= 2.13; the old name warns
    if scatter is None:  # pragma: no cover - older torch
        scatter = dist.reduce_scatter_tensor
    scatter(out, buf, group=group)


def zero1_reduce_scatter(grads: Any, *, process_group: dist.ProcessGroup | None = None,
                         average: bool = True) -> Any:
    r"""Sum each rank's full local gradients over the group, and keep only this rank's slices.

    The gradient collective of ZeRO-2: instead of an all-reduce of the full gradients
    (DDP), a reduce-scatter that leaves each rank only the slices it updates
    ([`slice_bounds`][functopt.distributed.slice_bounds]), which
    [`zero1`][functopt.distributed.zero1]'s ``step`` takes in place of full gradients. A
    ring reduce-scatter sends $(N-1)/N$ of the gradient bytes per rank where a ring
    all-reduce sends twice that. One ``reduce_scatter`` per gradient dtype: every rank's
    slices of all leaves of that dtype are packed into one buffer (padded to the longest
    rank's), so the number of collectives does not grow with the number of leaves.

    Every rank must pass gradients of the same structure, shapes, dtypes and ``None``
    leaves (the collective is matched by position). With ``average``, each gradient is
    divided by the group size before the sum, as DDP's default communication hook does.

    With tensor parallelism (``zero1`` given DTensor params on a tensor-parallel mesh), a
    gradient may be a DTensor placed like its param: its local shard is reduce-scattered
    over the data-parallel group, and the result is this rank's slice of the local shard,
    as ``zero1`` slices it (a plain 1-D tensor).

    Args:
        grads: a pytree of this rank's full local gradients (plain tensors, DTensors of
            tensor-parallel params, or ``None``).
        process_group: the group given to ``zero1`` (``None``: the default group when
            ``torch.distributed`` is initialized).
        average: divide by the group size (the mean over ranks, as DDP), or sum.

    Returns:
        A pytree like ``grads`` whose leaves are this rank's 1-D slices of the summed (or
        averaged) gradients; on one rank, each gradient flattened (averaged over one rank:
        unchanged).

    Raises:
        TypeError: a leaf is not a floating tensor or ``None`` (naming it).
        ValueError: a leaf is a ``Partial`` DTensor (naming it).

    Examples:
        >>> import torch
        >>> from functopt.distributed import zero1_reduce_scatter
        >>> zero1_reduce_scatter({"w": torch.ones(2, 2)})  # one rank: the flattened gradient
        {'w': tensor([1., 1., 1., 1.])}
    """
    owner = "zero1_reduce_scatter"
    leaves, treespec = _core.flatten(grads)
    _core.check_tensors(leaves, treespec, name="grads", floating=True)
    for i, g in enumerate(leaves):
        if is_dtensor(g):
            if any(pl.is_partial() for pl in g.placements):
                raise ValueError(
                    f"{owner}: grads leaf {_core.paths(treespec)[i]!r} is a Partial DTensor "
                    f"({tuple(g.placements)}); expected the gradient of a tensor-parallel "
                    f"param, placed like it (Shard or Replicate over the tensor-parallel "
                    f"mesh). Fix: reduce it over that mesh first (redistribute)."
                )
            leaves[i] = g.to_local()  # a TP grad: its local shard, sliced over the dp group
    group, rank, world = _resolve_group(process_group)
    if group is None:
        return _core.unflatten(treespec, [None if g is None else g.detach().reshape(-1)
                                          for g in leaves])
    by_dtype: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(leaves):
        if g is not None:
            by_dtype.setdefault((g.device, g.dtype), []).append(i)
    out: list[Any] = [None] * len(leaves)
    for (device, dtype), indices in by_dtype.items():
        # rank r's row holds its slice of every leaf, each at the leaf's offset and padded to
        # the leaf's chunk c (rank 0's slice, the longest): a leaf's c-element rows are its
        # chunks, so it is copied in with two copies, whatever the number of ranks
        chunks = [-(-leaves[i].numel() // world) for i in indices]
        buf = torch.zeros(world, sum(chunks), dtype=dtype, device=device)
        at = 0
        for i, c in zip(indices, chunks, strict=True):
            flat, rows = leaves[i].detach().reshape(-1), leaves[i].numel() // max(c, 1)
            buf[:rows, at:at + c] = flat[:rows * c].view(rows, c)
            if rows * c < flat.numel():
                buf[rows, at:at + flat.numel() - rows * c] = flat[rows * c:]
            at += c
        if average:
            buf /= world
        mine = torch.empty(buf.shape[1], dtype=dtype, device=device)
        _reduce_scatter(mine, buf.reshape(-1), group)
        at = 0
        for i, c in zip(indices, chunks, strict=True):
            start, end = slice_bounds(leaves[i].numel(), rank, world)
            out[i] = mine[at:at + end - start]
            at += c
    return _core.unflatten(treespec, out)
