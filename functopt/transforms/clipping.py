"""Clipping updates: elementwise (``clip``), per leaf (``clip_by_block_rms``), over the whole
tree (``clip_by_global_norm``) and per unit relative to the params (``adaptive_grad_clip``).

Norms are reduced in float32 (float64 where float64 leaves are involved), so float16 and
bfloat16 updates neither overflow nor lose precision in the sum; the clipped updates keep
their dtype.

Non-finite norms. A norm that is inf or nan cannot give a meaningful scale: dividing by it
would turn the finite entries into zeros (optax and ``torch.nn.utils.clip_grad_norm_`` do
that) and would do so silently where the norm overflowed although every entry is finite.
[`clip_by_global_norm`][functopt.clip_by_global_norm] measures again in float64 where a
float32 sum of squares overflowed, so its norm of finite updates is finite. The
norm-based clips here return nan wherever the norm they scale by is not finite (the whole tree for [`clip_by_global_norm`][functopt.clip_by_global_norm], the leaf for
[`clip_by_block_rms`][functopt.clip_by_block_rms], the unit for [`adaptive_grad_clip`][functopt.adaptive_grad_clip]), so that a finite check
further down the chain (``apply_if_finite``, the loss scaler's overflow check) sees the
problem and skips the step.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from functopt import _validate
from functopt._base import EmptyState, GradientTransformation, Numeric, Params, Updates
from functopt._collective.dtensor import (
    _counted_here,
    _infer_group,
    _leaf_names,
    is_dtensor,
    local_tensor,
)
from functopt._collective.stats import all_reduce_stats, local_stats
from functopt._rules import state_slots
from functopt._spec import GlobalNormClip, Leafwise, PerLeaf, specified
from functopt.transforms import _common
from functopt.tree import _core, _ops

__all__ = [
    "adaptive_grad_clip",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
]

# Keeps a zero unit norm from dividing by zero in adaptive_grad_clip; as in optax it can only
# matter when clipping * max(param_norm, eps) is below it.
_DIV_EPS = 1e-6


def _init_empty(params: Params) -> EmptyState:
    del params
    return EmptyState()


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _nan_unless_finite(norm: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` where ``norm`` is finite, nan elsewhere (see the module docstring)."""
    return torch.where(torch.isfinite(norm), value, torch.nan)


def clip(max_delta: Numeric) -> GradientTransformation:
    r"""Clip every update elementwise to $[-\text{max\_delta}, \text{max\_delta}]$.

    $u \leftarrow \min(\max(u, -\text{max\_delta}), \text{max\_delta})$. nan stays nan;
    $\pm\infty$ becomes $\pm\text{max\_delta}$.

    Args:
        max_delta: the largest magnitude an update element may have, >= 0.

    Returns:
        A stateless [`GradientTransformation`][functopt.GradientTransformation].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.clip(1.0)
        >>> tx.update({"w": torch.tensor([3.0, -0.5, -7.0])}, tx.init(None))[0]
        {'w': tensor([ 1.0000, -0.5000, -1.0000])}
    """
    _validate.check_range("clip", "max_delta", max_delta, low=0.0,
                          hint="Fix: max_delta is a magnitude; pass a non-negative bound.")

    def update_fn(
        updates: Updates, state: EmptyState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, EmptyState]:
        _common.check_state("clip", state, EmptyState)
        del params, extra_args
        leaves, treespec = _common.flatten_updates(updates)
        new: list[Any] = []
        for g in leaves:
            if g is None:
                new.append(None)
                continue
            # Compared in the leaf's dtype, as torch compares a tensor with dimensions.
            bound = _common.scalar(max_delta, g.dtype)
            new.append(torch.clamp(g, -bound, bound).to(g.dtype))
        return _common.unflatten(treespec, new), state

    # elementwise: the compiled tier runs this update over a group's leaves laid end to end
    return specified(GradientTransformation(_init_empty, update_fn),
                     Leafwise("clip", {"max_delta": max_delta}, slots=state_slots(EmptyState)))


def clip_by_block_rms(threshold: Numeric) -> GradientTransformation:
    r"""Clip each leaf ("block") of the updates to a root mean square of at most ``threshold``.

    For each leaf $u$ with $n$ elements,
    $\text{rms} = \sqrt{\tfrac{1}{n}\sum_i u_i^2}$ and
    $u \leftarrow u / \max(1, \text{rms} / \text{threshold})$. A leaf whose rms is not
    finite (it holds inf or nan, or its sum of squares overflows) becomes nan; see the module
    docstring.

    Args:
        threshold: the largest rms a leaf may have, > 0.

    Returns:
        A stateless [`GradientTransformation`][functopt.GradientTransformation].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.clip_by_block_rms(1.0)
        >>> tx.update({"w": torch.tensor([3.0, -3.0]), "b": torch.tensor([0.5])}, tx.init(None))[0]
        {'w': tensor([ 1., -1.]), 'b': tensor([0.5000])}
    """
    _validate.check_range("clip_by_block_rms", "threshold", threshold, low=0.0, low_open=True,
                          hint="Fix: pass a positive rms bound, such as 1.0.")

    def denominators(norms: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
        # (0-d on the pure path, a vector of them on the grouped one: the same elementwise
        # operations)
        rms = norms / roots
        ratio = rms / _common.scalar(threshold, rms.dtype)
        return _nan_unless_finite(rms, torch.clamp(ratio, min=1.0))

    def clip_leaf(u: torch.Tensor) -> torch.Tensor:
        norm = torch.linalg.vector_norm(u, dtype=_accumulation_dtype(u.dtype))
        return (u / denominators(norm, max(u.numel(), 1) ** 0.5)).to(u.dtype)

    def update_fn(
        updates: Updates, state: EmptyState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, EmptyState]:
        _common.check_state("clip_by_block_rms", state, EmptyState)
        del params, extra_args
        leaves, treespec = _common.flatten_updates(updates)
        return _common.unflatten(treespec, _core.map_leaves(clip_leaf, leaves)), state

    def grouped_fn(
        updates: Updates, state: EmptyState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, EmptyState]:
        # the planner's per-leaf tier: every norm of a (device, dtype) group in one
        # torch._foreach_norm call and the scales as one vector; DTensor shards leaf by leaf
        _common.check_state("clip_by_block_rms", state, EmptyState)
        del params, extra_args
        leaves, treespec = _common.flatten_updates(updates)
        new: list[Any] = list(leaves)
        groups: dict[Any, list[int]] = {}
        for i, u in enumerate(leaves):
            if u is None:
                continue
            if is_dtensor(u):
                new[i] = clip_leaf(u)
            else:
                groups.setdefault((u.device, u.dtype), []).append(i)
        for (device, dtype), idx in groups.items():
            wide = _accumulation_dtype(dtype)
            norms = torch.stack(torch._foreach_norm([leaves[i] for i in idx], 2, dtype=wide))
            roots = torch.tensor([max(leaves[i].numel(), 1) ** 0.5 for i in idx], dtype=wide,
                                 device=device)
            scaled = torch._foreach_div([leaves[i] for i in idx],
                                        list(denominators(norms, roots).unbind(0)))
            for i, x in zip(idx, scaled, strict=True):
                new[i] = x.to(dtype)
        return _common.unflatten(treespec, new), state

    # a leaf's own rms: the planner's per-leaf tier runs it a group at a time
    return specified(GradientTransformation(_init_empty, update_fn), PerLeaf(
        "clip_by_block_rms", {"threshold": threshold}, grouped=grouped_fn,
        slots=state_slots(EmptyState)))


def clip_by_global_norm(max_norm: Numeric) -> GradientTransformation:
    r"""Clip the updates by their global norm (Pascanu et al., 2012).

    With $\lVert u\rVert$ the L2 norm of all leaves together
    ([`functopt.tree.global_norm`][functopt.tree.global_norm]): the updates are returned unchanged when
    $\lVert u\rVert < \text{max\_norm}$, and scaled by
    $\text{max\_norm} / \lVert u\rVert$ otherwise, so that their global norm becomes
    ``max_norm``. ``None`` leaves are skipped.

    The norm of finite updates is always finite: where a float32 sum of squares overflows
    (norms above about ``1.8e19``), the leaf is measured again in float64 (see
    [`global_norm`][functopt.tree.global_norm]), and a norm beyond float32's range is
    turned into a scale in float64, so updates of ``1e30`` are clipped where
    ``torch.nn.utils.clip_grad_norm_`` turns them into zeros and optax into nan.

    Where the global norm is not finite (an update holds inf or nan), every update becomes nan instead of optax's zeros (finite entries)
    and nan (non-finite ones): zeros would be a silent no-op step where the sum overflowed,
    and a finite check downstream should skip such a step anyway. The scale is computed with
    the norm clamped to at least ``max_norm``, so that gradients through a tensor
    ``max_norm`` stay finite when the updates are all zero.

    Args:
        max_norm: the largest global norm the updates may have, > 0.

    Returns:
        A stateless [`GradientTransformation`][functopt.GradientTransformation].

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.clip_by_global_norm(1.0)
        >>> tx.update({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, tx.init(None))[0]
        {'a': tensor([0.6000]), 'b': tensor([0.8000])}

    References:
        Pascanu et al., *On the difficulty of training Recurrent Neural Networks*, 2012.
    """
    _validate.check_range("clip_by_global_norm", "max_norm", max_norm, low=0.0, low_open=True,
                          hint="Fix: pass a positive norm bound, such as 1.0.")

    def update_fn(
        updates: Updates, state: EmptyState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, EmptyState]:
        _common.check_state("clip_by_global_norm", state, EmptyState)
        del params, extra_args
        leaves, treespec = _common.flatten_updates(updates)
        wide = _sharded_norm(leaves, treespec) if any(map(is_dtensor, leaves)) else (
            _plain_norm(leaves))
        return _scaled_by_norm(leaves, treespec, wide, max_norm), state

    def sums(updates: Updates, state: EmptyState, params: Params | None = None,
             ) -> tuple[torch.Tensor]:
        # the planner's compiled tier, for a clip after other rules: this process's sum of
        # squares of the updates it is given, in float64 (no float32 overflow to rescue)
        del state, params
        tensors = [x for x in _core.flatten(updates)[0] if x is not None]
        total = torch.zeros((), dtype=torch.float64, device=tensors[0].device if tensors
                            else None)
        for x in tensors:
            total = total + torch.square(x.to(torch.float64)).sum()
        return (total,)

    def finish(updates: Updates, state: EmptyState, params: Params | None,
               totals: tuple[torch.Tensor],
               ) -> tuple[Updates, EmptyState]:
        # ... and the updates clipped by the norm of those sums over every leaf and rank
        leaves, treespec = _common.flatten_updates(updates)
        return _scaled_by_norm(leaves, treespec, torch.sqrt(totals[0]), max_norm), state

    return specified(GradientTransformation(_init_empty, update_fn),
                     GlobalNormClip(max_norm, sums=sums, finish=finish))


def _scaled_by_norm(leaves: list[Any], treespec: _core.TreeSpec, wide: torch.Tensor,
                    max_norm: Numeric) -> Updates:
    """The updates (``leaves`` of ``treespec``) clipped to ``max_norm`` given their global
    norm ``wide`` (0-d float64)."""
    norm = wide.to(_ops._accumulation_dtype([x for x in leaves if x is not None]))
    keep = norm < max_norm
    # A tensor numerator: torch computes `number / tensor` as `number * (1 / tensor)`,
    # and 1 / a subnormal norm overflows to inf.
    bound = _ops._scalar(max_norm, norm.dtype, norm.device)
    scale = bound / torch.clamp(norm, min=bound)
    if norm.dtype != torch.float64:
        # A finite norm beyond float32's range (rescued in float64): scale in float64.
        bound64 = _ops._scalar(max_norm, torch.float64, wide.device)
        far = (bound64 / torch.clamp(wide, min=bound64)).to(norm.dtype)
        scale = torch.where(torch.isfinite(norm), scale, far)
    scale = _nan_unless_finite(wide, scale)
    # `scaled`: a float64 norm (from a float64 leaf elsewhere in the tree) must not
    # promote a 0-d float32 leaf.
    new = [None if g is None else torch.where(keep, g, _common.scaled(g, scale))
           for g in leaves]
    return _common.unflatten(treespec, new)


def _plain_norm(leaves: list[Any]) -> torch.Tensor:
    """The global norm of plain tensor updates, float64 (``global_norm`` before its cast)."""
    tensors = [x for x in leaves if x is not None]
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    return _ops._global_norm64(tensors)


def _sharded_norm(leaves: list[Any], treespec: _core.TreeSpec) -> torch.Tensor:
    """``global_norm`` of DTensor updates with one collective: each rank sums the squares of
    the shards it counts (a replicated copy once), one all-reduce over the mesh sums them.
    Per-leaf DTensor norms would make one collective per leaf. The result is a plain 0-d
    float64 tensor, the same on every rank. Where the float32 sums overflowed although
    every element is finite, the rescue of ``global_norm`` measures again with two more
    collectives (the largest norm, then the scaled sum); on the CPU only then, on an
    accelerator at every call (see ``functopt.tree._ops._rescued``)."""
    name = _leaf_names(treespec)
    group = _infer_group(leaves, name)
    tensors = [x for x in leaves if x is not None]
    local = next(x.to_local() if is_dtensor(x) else x for x in tensors)
    packed = all_reduce_stats(local_stats(leaves, name, local.device), group)

    def rescue() -> torch.Tensor:
        # Every rank measures its counted shards again in float64; the largest norm over
        # the mesh scales the sum, so that float64 leaves cannot overflow it either.
        counted = [local_tensor(x) for i, x in enumerate(leaves)
                   if x is not None and _counted_here(x, functools.partial(name, i))]
        norms = torch.stack([_ops._safe_norm(x).to(local.device) for x in counted]) if (
            counted) else torch.zeros(1, dtype=torch.float64, device=local.device)
        peak = norms.max()
        if group is not None:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        unit = torch.where((peak > 0) & torch.isfinite(peak), peak, torch.ones_like(peak))
        scaled = all_reduce_stats(((norms / unit) ** 2).sum().reshape(1), group)[0]
        return torch.where(peak > 0, unit * torch.sqrt(scaled), peak)

    # The reduced sum is the same on every rank, so every rank takes the same branch.
    norm = torch.sqrt(packed[0])
    return _ops._rescued(norm, torch.isfinite(norm), norm, rescue)


def _reduction_dims(x: torch.Tensor, axis: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The dims a unit spans; ``None`` means the whole tensor is one unit."""
    if axis is not None:
        return axis
    if sum(1 for side in x.shape if side != 1) <= 1:  # scalars and vectors, maybe unsqueezed
        return None
    return tuple(range(1, x.dim()))


def _unitwise_norm(x: torch.Tensor, axis: tuple[int, ...] | None) -> torch.Tensor:
    """The L2 norm of each unit of ``x`` (float32 or wider), broadcast to ``x``'s shape."""
    dims = _reduction_dims(x, axis)
    norm = torch.linalg.vector_norm(
        x, dim=dims, keepdim=dims is not None, dtype=_accumulation_dtype(x.dtype)
    )
    out: torch.Tensor = norm.expand(x.shape)
    return out


def _canonical_axis(axis: Any) -> tuple[int, ...] | None:
    if axis is None:
        return None
    items = (axis,) if isinstance(axis, int) else axis
    if (
        isinstance(axis, bool)
        or not isinstance(items, (tuple, list))
        or not items
        or not all(isinstance(a, int) and not isinstance(a, bool) for a in items)
    ):
        raise TypeError(
            f"adaptive_grad_clip: axis must be None, an int or a non-empty tuple of ints, got "
            f"{axis!r}. Fix: axis=(1, 2, 3) makes each out-channel of an (out, in, h, w) "
            f"weight a unit."
        )
    return tuple(items)


def adaptive_grad_clip(
    clipping: Numeric, eps: Numeric = 1e-3, axis: int | Sequence[int] | None = None
) -> GradientTransformation:
    r"""Clip each unit of the updates relative to the norm of its params (AGC; Brock et al., 2021).

    For each unit with update $g$ and param $p$:
    $m = \text{clipping}\cdot\max(\lVert p\rVert, \text{eps})$; the unit is kept when
    $\lVert g\rVert < m$ and scaled to $g\, m / \max(\lVert g\rVert, 10^{-6})$
    otherwise. ``eps`` keeps zero-initialised params from freezing. A unit whose update norm
    is not finite becomes nan (see the module docstring). Norms are computed in float32
    (float64 for float64 leaves).

    A unit is one output unit in PyTorch's layout: the slice ``x[i]`` along the first dim (a
    row of a ``Linear`` weight of shape ``(out, in)``, an output channel of a ``Conv`` weight
    of shape ``(out, in, *kernel)``), for any number of dims; a leaf with at most one dim
    longer than 1 (a scalar, a bias) is a single unit. ``axis`` names the reduction dims
    instead, for every leaf. This differs from optax on purpose: optax's defaults follow
    JAX/Flax layouts (``(in, out)`` kernels, HWIO convolutions) and reduce over the leading
    dims, which on PyTorch weights would clip per input unit; optax also rejects leaves with
    more than 4 dims.

    Args:
        clipping: the largest allowed ratio of unit update norm to unit param norm, >= 0.
        eps: the smallest param norm used, >= 0.
        axis: the dims each unit's norm reduces over (default: per output unit, as above).

    Returns:
        A stateless [`GradientTransformation`][functopt.GradientTransformation]; ``update`` needs ``params``.

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.adaptive_grad_clip(0.1)
        >>> params = {"w": torch.tensor([[3.0, 4.0], [30.0, 40.0]])}
        >>> tx.update({"w": torch.tensor([[6.0, 8.0], [0.6, 0.8]])}, tx.init(params), params)[0]
        {'w': tensor([[0.3000, 0.4000],
                [0.6000, 0.8000]])}

    References:
        Brock, Smith, De & Simonyan, *High-Performance Large-Scale Image Recognition Without
        Normalization*, 2021.
    """
    owner = "adaptive_grad_clip"
    _validate.check_range(owner, "clipping", clipping, low=0.0,
                          hint="Fix: pass a ratio such as 0.01.")
    _validate.check_range(owner, "eps", eps, low=0.0)
    dims = _canonical_axis(axis)

    def clip_leaf(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        g_norm = _unitwise_norm(g, dims)
        p_norm = _unitwise_norm(p, dims)
        floor = _common.scalar(eps, p_norm.dtype)
        max_norm = _common.scalar(clipping, p_norm.dtype) * torch.clamp(p_norm, min=floor)
        ratio = _nan_unless_finite(g_norm, max_norm / torch.clamp(g_norm, min=_DIV_EPS))
        return torch.where(g_norm < max_norm, g, (g * ratio).to(g.dtype))

    def check_leaf(g: torch.Tensor, p: torch.Tensor | None, i: int, treespec: Any) -> None:
        if p is None:
            where = _core.paths(treespec)[i]
            raise ValueError(
                f"{owner}: leaf {where!r} has an update but its param is None. Fix: pass the "
                f"param, or pass None as its update too."
            )
        if dims is not None and any(not -g.dim() <= d < g.dim() for d in dims):
            where = _core.paths(treespec)[i]
            raise ValueError(
                f"{owner}: axis={axis!r} does not fit leaf {where!r} of shape "
                f"{tuple(g.shape)}. Fix: apply this transform with masked(...) or "
                f"partition(...) only to leaves that have those dims."
            )

    def update_fn(
        updates: Updates, state: EmptyState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, EmptyState]:
        _common.check_state("adaptive_grad_clip", state, EmptyState)
        del extra_args
        leaves, treespec = _common.flatten_updates(updates)
        param_leaves = _common.params_like(treespec, params, leaves, owner=owner)
        new: list[torch.Tensor | None] = []
        for i, (g, p) in enumerate(zip(leaves, param_leaves, strict=True)):
            if g is None:
                new.append(None)
                continue
            check_leaf(g, p, i, treespec)
            new.append(clip_leaf(g, p))
        return _common.unflatten(treespec, new), state

    # each unit against its own param's norm: the planner's per-leaf tier runs this update
    # a group at a time
    return specified(GradientTransformation(_init_empty, update_fn), PerLeaf(
        "adaptive_grad_clip", {"clipping": clipping, "eps": eps, "axis": dims},
        slots=state_slots(EmptyState)))
