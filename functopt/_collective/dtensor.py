"""DTensor helpers: which part of a leaf this rank holds and counts, and over which group.

A DTensor (FSDP2's ``fully_shard`` makes its params DTensors) is a global tensor split
over a [`DeviceMesh`](https://docs.pytorch.org/docs/stable/distributed.html): along each
mesh dimension its placement says whether the ranks hold disjoint pieces (``Shard(d)``,
split like ``torch.chunk``, so some ranks may hold fewer rows or none), identical copies
(``Replicate()``), or summands of a value not yet reduced (``Partial()``). Elementwise
maths needs none of this: DTensor runs it on the local shards. A *reduction* over all
elements (a norm, a count) does: summing one number per rank over the mesh counts every
shard once, but counts a replicated piece once per copy. These helpers let a reduction
read each leaf's local shard, skip the copies that another rank already counts, and find
the process group to sum over.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist

from functopt.tree import _core

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = ["counted_here", "infer_group", "is_dtensor", "local_tensor"]


def _dtensor_class() -> type | None:
    # Importing torch.distributed.tensor costs about 0.7 s, half of `import torch`; functopt
    # does not pay it at import. No DTensor can exist before that module is imported.
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(x: Any) -> TypeGuard[DTensor]:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor``.

    Examples:
        >>> import torch
        >>> from functopt.distributed import is_dtensor
        >>> is_dtensor(torch.ones(2)), is_dtensor(None)
        (False, False)
    """
    cls = _dtensor_class()
    return cls is not None and isinstance(x, cls)


def local_tensor(x: torch.Tensor) -> torch.Tensor:
    """The shard of ``x`` this rank holds (``x.to_local()``), or ``x`` itself if it is a plain tensor.

    The local shard may be empty: ``Shard(0)`` of 3 rows over 4 ranks gives ranks 0 to 2
    one row each and rank 3 none.

    Examples:
        >>> import torch
        >>> from functopt.distributed import local_tensor
        >>> x = torch.ones(3)
        >>> local_tensor(x) is x  # a plain tensor is its own shard
        True
    """
    # the common cases, without the DTensor lookup (nn.Parameter of a DTensor keeps the
    # DTensor type, so it is not caught here)
    if type(x) is torch.Tensor or type(x) is torch.nn.Parameter:
        return x
    return x.to_local() if is_dtensor(x) else x


def _rewrap_like(original: Any, local: torch.Tensor) -> Any:
    """``local`` as a DTensor placed like ``original`` (a new shard of the same global
    tensor), or ``local`` itself when ``original`` is a plain tensor."""
    if type(original) is torch.Tensor or not is_dtensor(original):
        return local
    cls: Any = _dtensor_class()
    return cls.from_local(local, original.device_mesh, original.placements, run_check=False,
                          shape=original.shape, stride=original.stride())


def counted_here(x: torch.Tensor, *, where: str = "<leaf>") -> bool:
    """Whether this rank's shard of ``x`` enters a sum over all ranks of the mesh.

    Along a mesh dimension where ``x`` is ``Replicate()``, every rank holds the same
    values; only the rank at coordinate 0 of that dimension counts them, so a sum over the
    mesh counts each element of the global tensor exactly once (dividing each copy's
    contribution by the number of copies would do it too, but would turn exact counts into
    rounded fractions). Sharded dimensions (``Shard``, FSDP2's strided shards) count on
    every rank. A plain tensor always counts here. This is the rule for a sum over all
    ranks of ``x``'s mesh; [`global_grad_stats`][functopt.distributed.global_grad_stats]
    with another group, or with plain tensors declared ``replicated``, applies the rules
    of ``functopt/_collective/counting.py``.

    Args:
        x: a DTensor or a plain tensor.
        where: the leaf's path, for the error message.

    Raises:
        ValueError: ``x`` has a ``Partial`` placement (its local values are summands, not
            elements: a sum of their squares is not the square of their sum), or this rank
            is not part of ``x``'s mesh.

    Examples:
        >>> import torch
        >>> from functopt.distributed import counted_here
        >>> counted_here(torch.ones(2))  # a plain tensor is whole on this rank
        True
    """
    return _counted_here(x, lambda: where)


def _counted_here(x: torch.Tensor, where: Callable[[], str]) -> bool:
    # ``where`` is called only to word an error: paths cost more than the check itself.
    if not is_dtensor(x):
        return True
    coordinate = x.device_mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(
            f"{where()!r}: this rank ({dist.get_rank()}) is not part of the leaf's device mesh "
            f"{x.device_mesh}. Fix: call the step only on the ranks of the params' mesh."
        )
    for dim, placement in enumerate(x.placements):
        if placement.is_partial():
            raise ValueError(
                f"{where()!r}: a DTensor with a Partial placement on mesh dimension {dim} "
                f"({tuple(x.placements)}); its local values are summands of an unreduced "
                f"tensor, so statistics of its elements cannot be computed locally. Fix: "
                f"reduce it first, e.g. x.redistribute(placements=[Replicate()] * "
                f"x.device_mesh.ndim) or [Shard(0)] (FSDP2 already hands reduced gradients)."
            )
        if placement.is_replicate() and coordinate[dim] != 0:
            return False
    return True


def _mesh_ranks(mesh: DeviceMesh) -> frozenset[int]:
    return frozenset(int(r) for r in mesh.mesh.flatten().tolist())


def _mesh_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD  # type: ignore[return-value]
    # A sub-mesh of a larger world with several dimensions: PyTorch builds (once, cached
    # per mesh) the group over all its ranks. Private API; pass a group to avoid it.
    return mesh._flatten().get_group()


def infer_group(leaves: Sequence[Any], *, names: Sequence[str] | None = None) -> dist.ProcessGroup | None:
    """The process group a reduction over ``leaves`` sums over, from their device mesh.

    ``None`` when no leaf is a DTensor: plain tensors are whole on every rank and need no
    reduction. Otherwise every tensor leaf must be a DTensor, and their meshes must span
    the same ranks (FSDP2 puts all params of a model on one mesh); the group spans all
    ranks of that mesh (all its dimensions, since shards and copies lie along each).
    ``None`` leaves are skipped.

    Args:
        leaves: flattened leaves (tensors or ``None``).
        names: the leaves' paths, for error messages (default: their indices).

    Raises:
        ValueError: DTensor leaves mixed with plain tensors, or meshes over different ranks.
            Pass a ``group`` explicitly where the reduction takes one if this is intended.

    Examples:
        >>> import torch
        >>> from functopt.distributed import infer_group
        >>> infer_group([torch.ones(2), None]) is None  # plain tensors: nothing to reduce
        True
    """
    if names is None:
        return _infer_group(leaves, str)
    names = list(names)
    return _infer_group(leaves, names.__getitem__)


def _infer_group(leaves: Sequence[Any], name: Callable[[int], str],
                 declared: Callable[[int], bool] | None = None) -> dist.ProcessGroup | None:
    # ``name(i)`` is called only to word an error; ``declared(i)``: whether plain leaf i has
    # a declaration of how it repeats over the ranks (see functopt._collective.counting).
    if _dtensor_class() is None:
        return None
    first: tuple[int, DTensor] | None = None
    plain: int | None = None
    for i, leaf in enumerate(leaves):
        if is_dtensor(leaf):
            if first is None:
                first = (i, leaf)
            elif _mesh_ranks(leaf.device_mesh) != _mesh_ranks(first[1].device_mesh):
                raise ValueError(
                    f"{name(i)!r} is a DTensor on mesh {leaf.device_mesh} but {name(first[0])!r} "
                    f"is on mesh {first[1].device_mesh}, over other ranks; one reduction cannot "
                    f"cover both. Fix: put every param on one mesh, or pass the process group "
                    f"to reduce over explicitly (pipeline stages: the group over all stages; "
                    f"a param left out of the tensor-parallel plan under FSDP2: the group of "
                    f"all ranks, declaring the leaf with replicated=True)."
                )
        elif (isinstance(leaf, torch.Tensor) and plain is None
              and not (declared is not None and declared(i))):
            plain = i
    if first is None:
        return None
    if plain is not None:
        raise ValueError(
            f"{name(plain)!r} is a plain tensor but {name(first[0])!r} is a DTensor: it is "
            f"unclear whether the plain tensor is whole on every rank (count it once) or this "
            f"rank's part (sum it over ranks). Fix: declare it with replicated=True (the same "
            f"values on every rank, e.g. a param left out of the tensor-parallel plan) or "
            f"replicated=False (this rank's part), or a pytree of such bools; or make it a "
            f"DTensor (distribute_tensor(x, mesh, [Replicate()]) if every rank holds all of it)."
        )
    return _mesh_group(first[1].device_mesh)


def _leaf_names(treespec: _core.TreeSpec) -> Callable[[int], str]:
    """``i -> path of leaf i``, computing the paths only when first asked."""
    cache: list[str] = []

    def name(i: int) -> str:
        if not cache:
            cache.extend(_core.paths(treespec))
        return cache[i]

    return name
