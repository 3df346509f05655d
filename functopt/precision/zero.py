r"""ZeRO-1 for replicated params: shard the optimizer state and the master over the ranks.

With data parallelism (DDP), every rank holds all params and, after DDP's all-reduce, the
same averaged gradients, so every rank would compute the same update with the same
optimizer state: for bfloat16 params and Adam, 12 of the 14 bytes per param (float32
master, ``mu``, ``nu``) are copies. [`zero1`][functopt.precision.zero1] (Megatron-LM's
``DistributedOptimizer``, ZeRO stage 1) keeps on each of the $N$ ranks only the state of
its slice of every param: the rank updates its slices with
[`mixed_precision`][functopt.precision.mixed_precision] around the inner rule, and one
``all_gather`` gives every rank all new params.

Layout: each param leaf is flattened and split with ``torch.tensor_split(N)``, so rank
$r$ owns elements $[rq + \min(r, m), (r+1)q + \min(r+1, m))$ of a leaf of $n = qN + m$
elements (slice sizes differ by at most one element; a leaf with fewer than $N$ elements
leaves some ranks an empty slice). Slicing per leaf rather than flattening all leaves into
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
2. one ``all_gather`` of the new slices, packed as bytes into one buffer (each slice
   aligned to 8 bytes, each rank's buffer padded to the longest), so params of several
   dtypes still travel together.

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

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from functopt._base import GradientTransformation, Params
from functopt.distributed.dtensor import is_dtensor
from functopt.precision.loss_scale import LossScale
from functopt.precision.master import MasterWeights
from functopt.precision.step import (
    MixedPrecisionState,
    MixedPrecisionTransformation,
    mixed_precision,
)
from functopt.tree import _core

__all__ = ["slice_bounds", "zero1"]

_ALIGN = 8  # bytes: every dtype's item size divides it, so a byte slice views as its dtype


def slice_bounds(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, end)`` of the elements of a flattened leaf of ``numel`` elements that ``rank`` owns.

    The split of ``torch.tensor_split(world_size)``: the first ``numel % world_size`` ranks
    own one element more than the others.

    Examples:
        >>> from functopt.precision.zero import slice_bounds
        >>> [slice_bounds(10, r, 4) for r in range(4)]
        [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    q, m = divmod(numel, world_size)
    return rank * q + min(rank, m), (rank + 1) * q + min(rank + 1, m)


class _Layout(NamedTuple):
    """Where each leaf's slices lie: per leaf, per rank, (start, end, byte offset)."""

    slices: list[list[tuple[int, int, int]] | None]  # None for a None param
    buffer_bytes: int  # bytes of every rank's packed buffer (the longest, aligned)


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _layout(leaves: list[Any], world: int) -> _Layout:
    offsets = [0] * world
    slices: list[list[tuple[int, int, int]] | None] = []
    for p in leaves:
        if p is None:
            slices.append(None)
            continue
        per_rank = []
        for r in range(world):
            start, end = slice_bounds(p.numel(), r, world)
            per_rank.append((start, end, offsets[r]))
            offsets[r] += _align((end - start) * p.element_size())
        slices.append(per_rank)
    return _Layout(slices, max(offsets, default=0))


def _slice(x: torch.Tensor | None, bounds: tuple[int, int, int] | None) -> torch.Tensor | None:
    if x is None or bounds is None:
        return None
    return x.detach().reshape(-1)[bounds[0]:bounds[1]]


def _all_gather_bytes(out: torch.Tensor, buf: torch.Tensor, group: dist.ProcessGroup) -> None:
    gather = getattr(dist, "all_gather_single", None)  # torch >= 2.13; the old name warns
    if gather is None:  # pragma: no cover - older torch
        gather = dist.all_gather_into_tensor
    gather(out, buf, group=group)


def _gather(new_slices: list[Any], old: list[Any], layout: _Layout, rank: int, world: int,
            group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's new slices of every leaf, reassembled into full params: one all_gather."""
    if group is None or world == 1:
        return [None if p is None else s.reshape(p.shape)
                for p, s in zip(old, new_slices, strict=True)]
    device = next(p.device for p in old if p is not None)
    pieces = []
    used = 0
    for s, bounds in zip(new_slices, layout.slices, strict=True):
        if bounds is None:
            continue
        raw = s.reshape(-1).view(torch.uint8)
        pieces.append(raw)
        pad = _align(raw.numel()) - raw.numel()
        if pad:
            pieces.append(raw.new_zeros(pad))
        used += raw.numel() + pad
    if used < layout.buffer_bytes:
        pieces.append(torch.zeros(layout.buffer_bytes - used, dtype=torch.uint8, device=device))
    buf = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8, device=device)
    out = torch.empty(world * layout.buffer_bytes, dtype=torch.uint8, device=device)
    _all_gather_bytes(out, buf, group)
    rows = out.view(world, layout.buffer_bytes)
    full = []
    for p, bounds in zip(old, layout.slices, strict=True):
        if p is None or bounds is None:
            full.append(p)
            continue
        size = p.element_size()
        parts = [rows[r, off:off + (end - start) * size].view(p.dtype)
                 for r, (start, end, off) in enumerate(bounds)]
        full.append(torch.cat(parts).reshape(p.shape))
    return full


def zero1(
    inner: GradientTransformation,
    *,
    process_group: dist.ProcessGroup | None = None,
    loss_scale: LossScale | None = None,
    master_weights: MasterWeights | None = None,
    max_grad_norm: float | torch.Tensor | None = None,
    fused: bool = True,
) -> MixedPrecisionTransformation:
    r"""[`mixed_precision`][functopt.precision.mixed_precision] with its state sharded over the data-parallel ranks (ZeRO-1).

    For replicated params (DDP: every rank holds all params and the same averaged
    gradients). ``init(params)`` and ``step(grads, state, params) -> (params, state)`` take
    and return the *full* params on every rank, like ``mixed_precision``; the state holds
    only this rank's slice of every leaf (``torch.tensor_split`` of the flattened leaf,
    see [`slice_bounds`][functopt.precision.slice_bounds]): master copies and inner
    state take about $1/N$ of the memory on each of the $N$ ranks. It is a
    [`MixedPrecisionState`][functopt.precision.MixedPrecisionState] whose per-leaf fields
    are 1-D slices; ``metrics`` and ``loss_scale`` are global, equal on every rank.

    Each step makes exactly two collectives: one ``all_reduce`` of the packed gradient
    statistics (global norm, overflow, zero count) and one ``all_gather`` of the new
    slices (all leaves and dtypes in one byte buffer). With ``fused=False``, params,
    masters and inner state are bitwise those of ``mixed_precision`` on the whole params
    without clipping; with ``max_grad_norm`` the norm is summed in another order
    (last-bit differences). The fused kernels agree to rounding only: PyTorch's CPU kernel
    rounds the vectorised body of a tensor and its tail differently, so an element's
    result can depend on where the slice boundary falls. On overflow every rank skips:
    params, masters and inner state stay bitwise unchanged.
    See ``functopt/precision/zero.py`` for the layout and its trade-offs.

    ``inner`` must be elementwise (``adamw``, ``adam``, ``sgd``, ``lion``, ...): it sees
    1-D slices of the leaves, not the leaves (the same restriction as Megatron-LM's
    ``DistributedOptimizer``).

    Args:
        inner: the elementwise update rule, e.g. ``functopt.adamw(1e-3)``.
        process_group: the data-parallel ranks to shard over. ``None`` means the default
            group when ``torch.distributed`` is initialized at ``init``/``step`` time, and
            a single unsharded rank otherwise.
        loss_scale: as in ``mixed_precision``.
        master_weights: as in ``mixed_precision`` (default: float32 copies of the
            bfloat16 and float16 slices).
        max_grad_norm: as in ``mixed_precision``: the global norm over all ranks' slices.
        fused: as in ``mixed_precision``: the inner recipe's fused kernel on each slice.

    Returns:
        A [`MixedPrecisionTransformation`][functopt.precision.MixedPrecisionTransformation].

    Raises:
        TypeError: ``process_group`` is not a process group (and ``mixed_precision``'s
            argument errors).
        ValueError: a param is a DTensor (FSDP2 already shards the state: use
            ``mixed_precision`` directly), or a gradient's shape differs from its param's.

    Examples:
        >>> import torch, functopt
        >>> from functopt.precision.zero import zero1
        >>> opt = zero1(functopt.adamw(1e-2))  # no process group: one rank, no collectives
        >>> params = {"w": torch.ones(2, 3, dtype=torch.bfloat16)}
        >>> state = opt.init(params)
        >>> params, state = opt.step({"w": torch.ones(2, 3, dtype=torch.bfloat16)}, state, params)
        >>> params["w"].shape, state.master["w"].shape  # this rank's slice: all 6 elements
        (torch.Size([2, 3]), torch.Size([6]))
    """
    owner = "zero1"
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"{owner}: process_group must be a torch.distributed.ProcessGroup or None (the "
            f"default group), got {type(process_group).__name__}. Fix: pass e.g. "
            f"torch.distributed.group.WORLD or the data-parallel group."
        )

    def build(group: dist.ProcessGroup | None) -> MixedPrecisionTransformation:
        return mixed_precision(inner, loss_scale=loss_scale, master_weights=master_weights,
                               max_grad_norm=max_grad_norm, process_group=group, fused=fused)

    # Built now to validate the arguments; the sharded step is built per group, lazily,
    # because the default group may be created after the optimizer.
    unsharded = build(None)
    by_group: dict[int, tuple[dist.ProcessGroup, MixedPrecisionTransformation]] = {}

    def resolve() -> tuple[dist.ProcessGroup | None, int, int, MixedPrecisionTransformation]:
        group = process_group
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        if group is None:
            return None, 0, 1, unsharded
        world = dist.get_world_size(group)
        if world == 1:
            return None, 0, 1, unsharded
        cached = by_group.get(id(group))
        if cached is None or cached[0] is not group:  # (an id can be reused by a new group)
            cached = by_group[id(group)] = (group, build(group))
        return group, dist.get_rank(group), world, cached[1]

    def check_params(params: Params) -> tuple[list[Any], _core.TreeSpec]:
        leaves, treespec = _core.flatten(params)
        _core.check_tensors(leaves, treespec, name="params", floating=True)
        for i, p in enumerate(leaves):
            if is_dtensor(p):
                raise ValueError(
                    f"{owner}: params leaf {_core.paths(treespec)[i]!r} is a DTensor; zero1 "
                    f"shards the state of replicated (plain tensor) params. Fix: with FSDP2 "
                    f"params the state is already sharded like them: use "
                    f"functopt.precision.mixed_precision directly."
                )
        return leaves, treespec

    def init_fn(params: Params) -> MixedPrecisionState:
        leaves, treespec = check_params(params)
        _, rank, world, opt = resolve()
        layout = _layout(leaves, world)
        mine = [None if b is None else b[rank] for b in layout.slices]
        return opt.init(_core.unflatten(treespec, [_slice(p, b) for p, b in zip(leaves, mine, strict=True)]))

    def step_fn(grads: Any, state: MixedPrecisionState, params: Params,
                **extra_args: Any) -> tuple[Params, MixedPrecisionState]:
        leaves, treespec = check_params(params)
        grad_leaves = _core.flatten_like(treespec, grads, name="grads", reference="params")
        _core.check_tensors(grad_leaves, treespec, name="grads", floating=True)
        for i, (g, p) in enumerate(zip(grad_leaves, leaves, strict=True)):
            if g is not None and p is not None and g.shape != p.shape:
                raise ValueError(
                    f"{owner}: {_core.paths(treespec)[i]!r}: grad has shape {tuple(g.shape)} "
                    f"but the param has shape {tuple(p.shape)}. Fix: pass the full (all-reduced) "
                    f"gradients of these params on every rank."
                )
        group, rank, world, opt = resolve()
        layout = _layout(leaves, world)
        mine = [None if b is None else b[rank] for b in layout.slices]
        new_slices, new_state = opt.step(
            _core.unflatten(treespec, [_slice(g, b) for g, b in zip(grad_leaves, mine, strict=True)]),
            state,
            _core.unflatten(treespec, [_slice(p, b) for p, b in zip(leaves, mine, strict=True)]),
            **extra_args,
        )
        new_leaves = _core.flatten_like(treespec, new_slices, name="new params",
                                        reference="params")
        full = _gather(new_leaves, leaves, layout, rank, world, group)
        return _core.unflatten(treespec, full), new_state

    def buffers() -> list[torch.Tensor]:
        return [*unsharded.buffers(), *(b for _, mp in by_group.values() for b in mp.buffers())]

    return MixedPrecisionTransformation(init_fn, step_fn, buffers)
