r"""A step's gradient statistics: one local pass over the leaves, packed, one all-reduce.

Every statistic a step takes over its gradients (the sum of squares of a global norm or
of a clip, the non-finite count of an overflow check or of an ``apply_if_finite`` guard,
the zero count of Megatron's ``count_zeros``) is computed here, over the part of each leaf
this rank counts: a DTensor's local shard, each replicated value on one rank (see
``functopt/_collective/counting.py``). Calling ``torch.linalg.vector_norm`` or
``torch.isfinite(g).all()`` on each DTensor gradient would make one collective per leaf
and per statistic (and ``isfinite(dt).all()`` is a ``Partial`` result whose ``bool()`` is
the local rank's answer). Instead the statistics of a step are packed into one float64
tensor and one ``all_reduce(SUM)`` makes them global, identical on every rank; so an
overflow in one rank's shard makes every rank skip.

The local pass has two forms of one arithmetic. `local_stats` is the definition: per leaf
``[sum of squares, non-finite count, zero count]`` (`functopt.tree._ops._leaf_stats`), the
rows summed over the leaves. `square_groups` measures the same squared norms with one
``foreach`` norm per (device, dtype) group (bitwise the per-leaf norms on the CPU), times a
multiplier where a step measures scaled gradients, and on plain CPU tensors with a host
multiplier reads the norms once and finishes in Python (``host``: the same roundings);
`clip_sums`, `nonfinite_counts` and `unscaled_stats` build the step's values from it.

``grad_stats``, `local_grad_stats` and `global_grad_stats` are views of `local_stats`; the
packed layout is ``[sum of squares, non-finite count, zero count]``, unpacked by
[`unpack_grad_stats`][functopt.precision.unpack_grad_stats].
"""

from __future__ import annotations

import functools
import typing
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from functopt._collective.counting import Replicated, _as_tensor_leaves, _counting, _entries
from functopt._collective.dtensor import (
    _counted_here,
    _leaf_names,
    is_dtensor,
    local_tensor,
)
from functopt.tree import _core, _ops
from functopt.tree._ops import _leaf_stats

__all__ = ["all_reduce_stats", "global_grad_stats", "local_grad_stats"]


# The packed layout: [sum of squares, non-finite count, zero count, ...] (a step lays its
# other statistics after these three).
SUMSQ, NONFINITE, ZEROS = 0, 1, 2


def norm_and_overflow(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 norm of packed (reduced) statistics, and whether they overflowed: a
    non-finite element, or a norm that overflows float32."""
    norm = torch.sqrt(packed[SUMSQ]).to(torch.float32)
    return norm, (packed[NONFINITE] > 0) | ~torch.isfinite(norm)

def local_grad_stats(grads: Any, device: torch.device | None = None, *,
                     group: dist.ProcessGroup | None = None,
                     replicated: Replicated = None) -> torch.Tensor:
    """``[sum of squares, non-finite count, zero count]`` of the shards of ``grads`` this rank counts.

    Over every leaf of the pytree ``grads`` (``None`` leaves skipped): a DTensor
    contributes its local shard (possibly empty), unless another rank counts the same
    replicated values ([`counted_here`][functopt.distributed.counted_here]); a plain tensor
    contributes itself, unless it is declared replicated and another rank of the group
    counts it (see ``replicated`` in
    [`global_grad_stats`][functopt.distributed.global_grad_stats]). Each leaf's sum of squares is accumulated in float32 (float64 for
    float64 leaves), the counts are exact up to $2^{53}$ elements, as in [`grad_stats`][functopt.precision.grad_stats]. No
    collective is made: sum the result over the ranks with
    [`all_reduce_stats`][functopt.distributed.all_reduce_stats].

    Args:
        grads: a pytree of tensors or DTensors (and ``None``).
        device: where the result lives when no leaf is counted (default: the CPU).
        group: the group the result will be summed over, as in ``global_grad_stats``.
        replicated: how plain tensors repeat over the ranks, as in ``global_grad_stats``.

    Returns:
        A plain float64 tensor of shape ``(3,)`` on the first counted leaf's device.

    Raises:
        ValueError: a DTensor leaf has a ``Partial`` placement (naming the leaf), and the
            errors of ``global_grad_stats`` about groups and plain tensors.

    Examples:
        >>> import torch
        >>> from functopt.distributed import local_grad_stats
        >>> local_grad_stats({"w": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0]), "c": None})
        tensor([25.,  0.,  1.], dtype=torch.float64)
    """
    leaves, name, _, counted = _counted_tree("local_grad_stats", grads, group, replicated)
    return local_stats(leaves, name, device, counted)


def _counted_tree(owner: str, grads: Any, group: dist.ProcessGroup | None,
                  replicated: Replicated) -> tuple[list[Any], Callable[[int], str],
                                                   dist.ProcessGroup | None, list[bool]]:
    """The leaves of ``grads`` (checked to be tensors or None), their names, the group
    their statistics are reduced over and whether this rank counts each one."""
    leaves, treespec = _core.flatten(grads)
    name = _leaf_names(treespec)
    _as_tensor_leaves(leaves, name, owner)
    found, counted = _counting(owner, leaves, name, group,
                               _entries(owner, replicated, grads, leaves, treespec))
    return leaves, name, found, counted


def local_stats(leaves: Sequence[Any], name: Callable[[int], str],
                 device: torch.device | None, counted: Sequence[bool] | None = None, *,
                 owner: str = "local_grad_stats") -> torch.Tensor:
    """`local_grad_stats` on flattened leaves, the definition of the packed statistics:
    one ``_leaf_stats`` row per counted leaf, the rows summed over the leaves. ``name(i)``
    words errors about leaf ``i``, ``owner`` the function named in them; ``counted[i]``:
    whether this rank counts leaf ``i`` (default: by DTensor placements over the whole
    mesh, plain tensors always)."""
    parts = []
    for i, g in enumerate(leaves):
        if g is None:
            continue
        if not isinstance(g, torch.Tensor):
            raise TypeError(
                f"{owner}: grads leaf {name(i)!r} is a {type(g).__name__}; expected a "
                f"tensor, a DTensor or None."
            )
        if not (counted[i] if counted is not None
                else _counted_here(g, functools.partial(name, i))):
            continue
        parts.append(_leaf_stats(local_tensor(g)))
    if not parts:
        return torch.zeros(3, dtype=torch.float64, device=device)
    return torch.stack(parts).sum(dim=0)



def counted_leaves(grads: Sequence[Any], name: Callable[[int], str]) -> list[bool]:
    """Per leaf, whether this rank counts it in a sum over the ranks (False for None)."""
    return [g is not None and _counted_here(g, functools.partial(name, i))
            for i, g in enumerate(grads)]


# Per (device, dtype) group of the measured leaves: their indices and their squared norms,
# a float64 vector with one entry per index.
Squares = list[tuple[list[int], torch.Tensor]]


def _grouped(tensors: Sequence[Any], counted: Sequence[bool], *, empty: bool = True,
             ) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """The indices of the counted tensors (not None; not empty unless ``empty``), by
    (device, dtype)."""
    found: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (t, c) in enumerate(zip(tensors, counted, strict=True)):
        if c and t is not None and (empty or t.numel()):
            found.setdefault((t.device, t.dtype), []).append(i)
    return found


def square_groups(tensors: Sequence[Any], counted: Sequence[bool],
                  multiplier: torch.Tensor | None = None, *, host: float | None = None,
                  rescue: bool = False, accumulate: torch.dtype | None = None) -> Squares:
    """The squared L2 norms of the counted tensors (plain tensors or local shards), from
    one ``foreach`` norm per (device, dtype) group, accumulated like
    ``tree._ops._sum_of_squares`` (float32, float64 for float64 tensors; ``accumulate``:
    that dtype for every tensor), times ``multiplier`` (a 0-d tensor, applied to the norm
    in its accumulation dtype) before the square is taken in float64.

    ``host`` (plain CPU tensors only): ``multiplier``'s value as a float32 number; the norms
    are read (one ``tolist`` per group) and finished in Python, bitwise the tensor
    arithmetic with fewer kernel launches: a product of two float32 values is exact in
    float64, so rounding it once to float32 is the float32 product, and ``x * x`` is what
    ``** 2`` computes.

    ``rescue`` (no multiplier): where a float32 norm overflowed although the leaf is
    finite, measure it again in float64, as ``clip_by_global_norm``'s pure path does: on
    the CPU only for the leaves that overflowed (the check is a free host read), on an
    accelerator for every leaf, selected on the device (no synchronisation; one more read
    of the gradients). The mixed step does not rescue: it counts such a norm as an
    overflow."""
    groups = []
    for (where, dtype), idx in _grouped(tensors, counted).items():
        acc = accumulate or (torch.float64 if dtype == torch.float64 else torch.float32)
        norms_of = torch._foreach_norm([tensors[i] for i in idx], 2,
                                       dtype=None if dtype == acc else acc)
        if host is not None:
            scaled = [n.item() * host for n in norms_of]
            if acc != torch.float64:
                scaled = list(array("f", scaled))  # (the C cast: round to nearest, inf past)
            # (a tensor over a host array: a fraction of torch.tensor's cost for a list)
            groups.append((idx, torch.frombuffer(array("d", [x * x for x in scaled]),
                                                 dtype=torch.float64)))
            continue
        norms = torch.stack(norms_of)
        if multiplier is not None:
            norms = norms * multiplier.to(device=where, dtype=acc)
        squares = norms.to(torch.float64) ** 2
        if rescue and _ops._host_branch_ok(norms):
            if bool(torch.isinf(norms).any()):
                for j, i in enumerate(idx):
                    if bool(torch.isinf(norms[j])):
                        wide = _ops._safe_norm(tensors[i])
                        if bool(torch.isfinite(wide)):
                            squares[j] = wide ** 2
        elif rescue:
            wide = torch.stack([_ops._safe_norm(tensors[i]).to(where) for i in idx])
            squares = torch.where(torch.isinf(norms) & torch.isfinite(wide), wide ** 2,
                                  squares)
        groups.append((idx, squares))
    return groups


def sum_squares(groups: Squares, leaves: Sequence[int] | None,
                device: torch.device) -> torch.Tensor | None:
    """The float64 sum of the squares of ``leaves`` (None: of every measured leaf) that are
    measured, as ``torch.stack`` of them in this order then ``sum()`` adds them (a group
    that holds exactly these leaves, in order, is that stack already); None if none is."""
    if len(groups) == 1 and (leaves is None or list(leaves) == groups[0][0]):
        return groups[0][1].sum().to(device)
    square = {i: sq[j] for idx, sq in groups for j, i in enumerate(idx)}
    order = sorted(square) if leaves is None else [i for i in leaves if i in square]
    if not order:
        return None
    if len(groups) == 1 and order == groups[0][0]:
        return groups[0][1].sum().to(device)
    return torch.stack([square[i] for i in order]).sum().to(device)


def clip_sums(grads: Sequence[Any], counted: Sequence[bool], clips: Sequence[Sequence[int]],
              device: torch.device) -> list[torch.Tensor]:
    """Per clip (the leaves it measures), this rank's float64 sum of squares of the counted
    gradients, as ``global_norm`` takes it: rescued float32 norms, or float64 norms of every
    leaf for a clip that measures a float64 leaf (a float32 accumulation of its float32
    leaves would round its factor to float32)."""
    tensors = [None if g is None else local_tensor(g) for g in grads]
    wide = [any(t is not None and t.dtype == torch.float64 for t in (tensors[i] for i in leaves))
            for leaves in clips]
    members = {i for leaves, w in zip(clips, wide, strict=True) if w for i in leaves}
    narrow = (square_groups(tensors, counted, rescue=True) if not all(wide) else [])
    broad = (square_groups(tensors, [c and i in members for i, c in enumerate(counted)],
                           accumulate=torch.float64) if members else [])
    out = []
    for leaves, w in zip(clips, wide, strict=True):
        found = sum_squares(broad if w else narrow, leaves, device)
        out.append(torch.zeros((), dtype=torch.float64, device=device) if found is None
                   else found)
    return out


def nonfinite_counts(grads: Sequence[Any], counted: Sequence[bool],
                     guards: Sequence[Sequence[int]], device: torch.device,
                     ) -> list[torch.Tensor]:
    """Per guard (the leaves it checks), this rank's float64 count of the counted leaves
    that hold an inf or a nan, from one ``foreach`` max-norm per (device, dtype) group
    (exact: the largest magnitude of finite values is finite, and inf and nan propagate;
    an empty shard holds nothing non-finite, and its max-norm has no identity)."""
    if not guards:
        return []
    tensors: list[Any] = [None if g is None else local_tensor(g) for g in grads]
    bad: list[Any] = [None] * len(grads)
    for idx in _grouped(tensors, counted, empty=False).values():
        norms = torch._foreach_norm([tensors[i] for i in idx], float("inf"))
        for i, flag in zip(idx, ~torch.isfinite(torch.stack(norms)), strict=True):
            bad[i] = flag
    out = []
    for leaves in guards:
        mine = [bad[i].to(device) for i in leaves if bad[i] is not None]
        out.append(torch.stack(mine).sum().to(device=device, dtype=torch.float64) if mine
                   else torch.zeros((), dtype=torch.float64, device=device))
    return out


def zero_count(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The float64 count of the zeros of ``tensors`` (exact up to $2^{53}$ elements;
    ``count_nonzero`` is several times faster than summing a ``== 0`` mask on the CPU); None
    for no tensor."""
    if not tensors:
        return None
    nonzero = torch.stack([torch.count_nonzero(t).to(device) for t in tensors]).sum()
    return sum(t.numel() for t in tensors) - nonzero.to(torch.float64)


def unscaled_stats(unscaled: Sequence[Any], counted: Sequence[bool], device: torch.device,
                   count_zeros: bool) -> torch.Tensor:
    """`local_stats` of the counted tensors with its arithmetic but from `square_groups`:
    each leaf's squared norm and (when asked; 0 otherwise) zero count as a row, the rows
    summed over the leaves as `local_stats` sums them; the non-finite count 0: a
    non-finite gradient makes the norm non-finite, which `unpack_grad_stats` reads as the
    same overflow."""
    squares: list[Any] = [None] * len(unscaled)
    for idx, sq in square_groups(unscaled, counted):
        for j, i in enumerate(idx):
            squares[i] = sq[j]
    none = torch.zeros((), dtype=torch.float64, device=device)
    rows = [torch.stack([s.to(device), none, (u.numel() - torch.count_nonzero(u)).to(
        device=device, dtype=torch.float64) if count_zeros else none])
            for s, u in zip(squares, unscaled, strict=True) if s is not None]
    if not rows:
        return torch.zeros(3, dtype=torch.float64, device=device)
    return torch.stack(rows).sum(dim=0)


def pack_sums(totals: dict[int, Any]) -> list[torch.Tensor]:
    """Rules' tree sums (per rule, a tuple of 0-d tensors) in float64, in one list, to be
    summed over the ranks with a step's other statistics in one all-reduce."""
    return [t.to(torch.float64) for node in totals for t in totals[node]]


def unpack_sums(totals: dict[int, Any], summed: Sequence[torch.Tensor]) -> dict[int, Any]:
    """``totals`` with their values replaced by ``summed`` (as `pack_sums` laid them out),
    each in its own dtype again."""
    flat = [t for node in totals for t in totals[node]]
    it = iter(t.to(like.dtype) for t, like in zip(summed, flat, strict=True))
    return {node: tuple(next(it) for _ in found) for node, found in totals.items()}


def all_reduce_parts(parts: Sequence[torch.Tensor], group: dist.ProcessGroup | None,
                     ) -> list[torch.Tensor]:
    """0-d float64 statistics, each summed over the ranks of ``group``: packed into one
    tensor, one `all_reduce_stats`, unpacked (``parts`` as given without a group)."""
    if group is None or not parts:
        return list(parts)
    return list(all_reduce_stats(torch.stack(list(parts)), group).unbind())


COLLECTIVE_FAILED = (
    "functopt: the all_reduce of the gradient statistics (one per step, over {world} ranks) "
    "failed: a rank died, left the step, or did not reach it within the process group's "
    "timeout. Every rank must run the same step; the ranks still alive cannot go on. Fix: "
    "restart every rank from the last checkpoint (functopt.load_checkpoint); to fail sooner "
    "when a rank hangs, pass a shorter timeout= to init_process_group or new_group."
)


def all_reduce_stats(packed: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``packed`` over the ranks of ``group`` with exactly one ``all_reduce``.

    ``packed`` itself is left unchanged (the collective runs on a copy), so this is pure
    from the caller's side. ``group=None`` means no reduction (one rank, or plain tensors
    whole on every rank) and returns ``packed``; pass ``torch.distributed.group.WORLD``
    for the default group.

    Args:
        packed: a small plain tensor (e.g. from
            [`local_grad_stats`][functopt.distributed.local_grad_stats]).
        group: the process group to sum over, or ``None``.

    Returns:
        The sum over ranks, a tensor like ``packed``.

    Examples:
        >>> import torch
        >>> from functopt.distributed import all_reduce_stats, local_grad_stats
        >>> packed = local_grad_stats({"w": torch.tensor([3.0, 4.0, 0.0])})
        >>> packed.tolist()  # [sum of squares, non-finite count, zero count]
        [25.0, 0.0, 1.0]
        >>> all_reduce_stats(packed, None) is packed  # no group: nothing to reduce
        True
    """
    if group is None:
        return packed
    if is_dtensor(packed):
        raise TypeError(
            "all_reduce_stats: packed is a DTensor; expected the plain tensor of local "
            "statistics from local_grad_stats (which reads the DTensors' local shards)."
        )
    out = packed.clone()
    try:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    except RuntimeError as exc:  # gloo's and NCCL's errors (DistBackendError) keep their type
        raise_with_note(exc, COLLECTIVE_FAILED.format(world=dist.get_world_size(group)))
    return out


def raise_with_note(exc: RuntimeError, note: str) -> typing.NoReturn:
    """Re-raise ``exc`` (inside its ``except`` block) with ``note`` added to its message."""
    add_note = getattr(exc, "add_note", None)  # Python 3.11+
    if add_note is None:
        raise RuntimeError(f"{exc}\n{note}") from exc
    add_note(note)
    raise exc


def global_grad_stats(
    grads: Any, group: dist.ProcessGroup | None = None, *, replicated: Replicated = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """[`local_grad_stats`][functopt.distributed.local_grad_stats] summed over the ranks: one collective.

    Args:
        grads: a pytree of tensors or DTensors (and ``None``).
        group: the process group to sum over. ``None`` infers it from the DTensor leaves'
            mesh ([`infer_group`][functopt.distributed.infer_group]); with plain tensors
            only, nothing is reduced (they are whole on every rank). DTensor leaves are
            counted by their placements relative to this group (a ``Replicate()`` along a
            mesh dimension inside the group once, along a dimension outside it once per
            group; see ``functopt/_collective/counting.py``).
        replicated: how the plain tensor leaves repeat over the ranks, required when plain
            tensors meet a group (given, or inferred from DTensor leaves): ``False``, each
            rank's tensor is its own part (summed: a hand-sharded ZeRO slice, a rank's own
            experts); ``True``, every rank of the group holds the same values (counted once,
            on the group's rank 0: a param left out of the tensor-parallel plan, dense params
            beside expert-parallel ones); a ``ProcessGroup``, the same values on the ranks
            of that group, a subgroup of ``group`` (counted once per such group: e.g. the
            tensor-parallel ranks of one pipeline stage). One value for all plain leaves, a
            pytree of them with the grads' structure or a prefix of it, or a function of
            ``grads`` returning one. Entries at DTensor leaves are read only for a
            DTensor on a mesh inside another leaf's mesh (FSDP2 x TP with a param left out
            of the plan): ``True``, its mesh's copies hold the same values; ``False``,
            values of their own; a group, the copies through this rank (see
            ``functopt/_collective/counting.py``).
        device: where the result lives when no leaf is counted.

    Returns:
        A plain float64 tensor ``[sum of squares, non-finite count, zero count]`` of shape
        ``(3,)``, the same on every rank of the group.

    Raises:
        ValueError: DTensors on meshes over different ranks (without an explicit group), a
            plain tensor in a sum over a group without a ``replicated`` declaration (saying
            how to declare it), a group that splits a mesh dimension or leaves out the other
            shards of a sharded dimension, or a ``Partial`` DTensor.
        TypeError: a leaf, or a ``replicated`` entry, of the wrong type.

    Examples:
        >>> import torch
        >>> from functopt.distributed import global_grad_stats
        >>> from functopt.precision import unpack_grad_stats
        >>> unpack_grad_stats(global_grad_stats([torch.tensor([3.0, 4.0])]))
        GradStats(norm=tensor(5.), found_inf=tensor(False), num_zeros=tensor(0))
    """
    leaves, name, group, counted = _counted_tree("global_grad_stats", grads, group, replicated)
    return all_reduce_stats(local_stats(leaves, name, device, counted), group)
