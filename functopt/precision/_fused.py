r"""The mixed-precision step on fused kernels: the same step in four passes over memory.

[`mixed_precision`][functopt.precision.mixed_precision] takes this path when the step
planner (``functopt/fast/_planner.py``) lowers its inner transform, however composed
(``adamw``, ``chain(clip_by_global_norm(1.0), adamw(...))``, a masked or partitioned
chain, an injected recipe), and the masters are plain copies
([`float32_master`][functopt.precision.float32_master]). Per step, over the gradients'
and the masters' bytes:

1. one cast of the gradients to the masters' precision (``torch._foreach_copy_``, into
   the previous step's buffers when the step is donated);
2. one read of the casts: each leaf's norm (``torch._foreach_norm``), times
   ``1 / loss_scale``, gives the statistics and the sums of squares of every clip of the
   inner chain, and one all-reduce of them packed together makes them global (the zero
   count, when asked for, is a second read);
3. the fused kernels, one per group of leaves: unscale and both clips folded into one
   divisor (``grad_scale``), the skip on overflow (``found_inf``), the update of master
   and moments, read once and written once;
4. one copy of the masters into the low-precision params.

The PyTorch idiom for the same step (float32 main grads, ``GradScaler.unscale_``,
``clip_grad_norm_``, fused AdamW, copy back) makes six passes.

How it differs from the pure path, and why that is the same step:

- The norm is measured on the scaled gradients and multiplied by ``1 / loss_scale``. For
  a power-of-two scale this is bitwise the pure path's norm of the unscaled gradients,
  unless a square of a scaled gradient leaves float32's range (a scaled gradient above
  $2^{64}$ or below $2^{-75}$ in magnitude; float16 gradients never do). A non-finite
  gradient makes the norm non-finite, which is the overflow test: the pure path's
  non-finite count and its norm-overflow rule give the same decision.
- The zero count (``count_zeros=True``) reads the gradients before unscaling: an element
  that unscaling would underflow to zero (a scaled gradient below $2^{-149}$ times the
  scale, in the subnormals) is counted by the pure path only.
- Unscaling and clipping are one division by ``loss_scale / clip_factor`` instead of two
  multiplications: the gradients agree to rounding (float64 leaves are divided in
  float64, the kernels take a float32 divisor).
- On overflow the kernel leaves masters and moments untouched and the params are
  copied from the unchanged masters, which gives back the params bitwise when they are
  the rounded masters (as every step leaves them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from functopt._collective.dtensor import _rewrap_like, local_tensor
from functopt._collective.reduce import all_reduce_stats
from functopt.fast import _compiled, _planner
from functopt.fast._layout import end_to_end
from functopt.precision.loss_scale import LossScale, LossScaleState, _inverse
from functopt.precision.stats import (
    _SUMSQ,
    _ZEROS,
    GradStats,
    _clip_factor,
    unpack_grad_stats,
)
from functopt.tree import _core

# The packed statistics: grad_stats' three entries, then one sum of squares per clip of
# the inner chain (one all-reduce for all of them).
_CLIPS = 3


def fused_stats(grads: list[Any], wide: list[Any], name: Callable[[int], str],
                inv_scale: torch.Tensor, device: torch.device, count_zeros: bool,
                clips: list[list[int]], counted: Sequence[bool] | None = None,
                ) -> torch.Tensor:
    """The packed ``[sum of squares, non-finite flag, zero count, clip sums...]`` of the
    unscaled gradients this rank counts, from one ``foreach`` norm per (device, dtype)
    group.

    ``wide`` holds the gradients in the precision of the values they update (local
    shards); each is reduced in float32, or float64 when it is float64, as the pure path
    reduces its unscaled gradients. ``grads`` (the gradients as given) decide which leaves
    this rank counts, unless ``counted`` (one bool per leaf) says it; ``clips`` lists the
    leaves each clip of the inner chain measures.
    """
    if counted is None:
        counted = _planner.counted_leaves(grads, name)
    counted = [c and w is not None for c, w in zip(counted, wide, strict=True)]
    squares = _planner.leaf_squares(wide, list(counted), inv_scale)
    packed = torch.zeros(_CLIPS + len(clips), dtype=torch.float64, device=device)
    present = [s for s in squares if s is not None]
    if present:
        packed[_SUMSQ] = torch.stack(present).sum().to(device)
    for j, leaves in enumerate(clips):
        mine = [squares[i] for i in leaves if squares[i] is not None]
        if mine:
            packed[_CLIPS + j] = torch.stack(mine).sum().to(device)
    if count_zeros:
        # on the gradients as given (a cast keeps zeros): half the bytes of a float32 cast;
        # count_nonzero is several times faster than summing a ``== 0`` mask on the CPU
        given = [local_tensor(g) for g, c in zip(grads, counted, strict=True) if c]
        if given:
            nonzero = torch.stack([torch.count_nonzero(g).to(device) for g in given]).sum()
            packed[_ZEROS] = sum(g.numel() for g in given) - nonzero.to(torch.float64)
    # packed[_NONFINITE] stays 0: a non-finite gradient makes the sum of squares
    # non-finite, which unpack_grad_stats reads as an overflow (as a norm overflow).
    return packed


def _widened(grads: list[Any], views: list[Any], workspace: list[Any] | None) -> list[Any]:
    """Each gradient's local shard in its view's dtype: itself, or a cast.

    The casts are grouped by (device, dtype to dtype) into one ``foreach`` copy each,
    which runs several times faster on the CPU than a ``.to()`` per leaf. With a
    ``workspace`` (a list kept by the caller between steps), each cast is written into the
    buffer of the previous step when it fits: fresh memory costs page faults on first touch
    (on the CPU, several times the copy itself).
    """
    out: list[Any] = [None] * len(grads)
    if workspace is not None and len(workspace) != len(grads):
        workspace[:] = [None] * len(grads)
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype],
                 tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for i, (g, v) in enumerate(zip(grads, views, strict=True)):
        if g is None or v is None:
            continue
        local = local_tensor(g)
        if local.dtype == v.dtype:
            out[i] = local
            continue
        wide = None if workspace is None else workspace[i]
        if not (isinstance(wide, torch.Tensor) and wide.shape == local.shape
                and wide.dtype == v.dtype and wide.device == local.device):
            wide = torch.empty(local.shape, dtype=v.dtype, device=local.device)
            if workspace is not None:
                workspace[i] = wide
        dst, src = groups.setdefault((local.device, local.dtype, v.dtype), ([], []))
        dst.append(wide)
        src.append(local)
        out[i] = wide
    for dst, src in groups.values():
        torch._foreach_copy_(dst, src)
    return out


def _flat_casts(groups: list[Any], grads: list[Any], views: list[Any],
                workspace: list[Any]) -> None:
    """Lay the gradient casts of each compiled group (whose gradients all need one) in
    ``workspace`` as views of one buffer, in the group's order and its values' layout, so
    that `_widened` casts into them and the group's call reads them without gathering.
    Buffers laid out so at an earlier step are kept."""
    if len(workspace) != len(grads):
        workspace[:] = [None] * len(grads)
    for group in groups:
        if group.plan.kernel != "compiled":
            continue
        idx = [i for i in group.leaves if local_tensor(views[i]).numel()]
        values = [local_tensor(views[i]) for i in idx]
        if not idx or any(local_tensor(grads[i]).dtype == v.dtype
                          for i, v in zip(idx, values, strict=True)):
            continue
        have = [workspace[i] for i in idx]
        if all(isinstance(w, torch.Tensor) and w.shape == v.shape and w.dtype == v.dtype
               and w.stride() == v.stride() for w, v in zip(have, values, strict=True)) and (
                end_to_end(have) is not None):
            continue
        flat = torch.empty(sum(v.numel() for v in values), dtype=values[0].dtype,
                           device=values[0].device)
        for i, view in zip(idx, _compiled._scatter(flat, values), strict=True):
            workspace[i] = view


def lay_out_params(planner: _planner.Planner, treespec: Any, params: list[Any],
                   master_weights: Any, inner: Any, name: Callable[[int], str]) -> None:
    """A compiled mixed step's ``lay_out``: the params of each compiled group (all of one
    dtype; a group mixing float32 params with bfloat16 ones is left as it is, as its
    gradients are then cast anyway) and their gradients moved into one buffer per group."""
    stores = [None if p is None else master_weights.init(p) for p in params]
    views = [None if p is None else master_weights.view(p, s)
             for p, s in zip(params, stores, strict=True)]
    _planner.check_donation(params, name)  # one buffer cannot hold params sharing memory
    inner_leaves, inner_spec = _core.flatten(inner.init(_core.unflatten(treespec, views)))
    groups = planner.compiled_groups(treespec, views, inner_leaves, inner_spec)
    if groups is not None:
        with torch.no_grad():
            _compiled.lay_out_params(
                params, [g for g in groups if len({params[i].dtype for i in g.leaves}) == 1],
                name)


def flat_init(planner: _planner.Planner, treespec: Any, stores: list[Any], views: list[Any],
              inner_state: Any) -> tuple[list[Any], Any]:
    """The masters and inner state of a new mixed step laid out for the compiled tier:
    each compiled group's masters and per-leaf state entries as views of one buffer (equal
    values). Returns ``(stores, inner_state)``."""
    inner_leaves, inner_spec = _core.flatten(inner_state)
    groups = planner.compiled_groups(treespec, views, inner_leaves, inner_spec)
    if groups is None:
        return stores, inner_state
    laid_views, laid = _compiled.flat_layout(
        views, [s is not None and s is v for s, v in zip(stores, views, strict=True)],
        inner_leaves, groups)
    new_stores = [laid_views[i] if s is not None and s is views[i] else s
                  for i, s in enumerate(stores)]
    return new_stores, _core.unflatten(inner_spec, laid)


def fused_mixed_step(
    planner: _planner.Planner, params: list[Any], stores: list[Any], views: list[Any],
    grads: list[Any], inner_state: Any, loss_scale: LossScaleState, *, treespec: Any,
    scale_rule: LossScale, scaled: bool, max_grad_norm: float | torch.Tensor | None,
    group: dist.ProcessGroup | None, name: Callable[[int], str], count_zeros: bool,
    donate: bool, workspace: list[Any] | None = None, counted: Sequence[bool] | None = None,
    compiled: bool = False, scratch: dict[Any, Any] | None = None,
) -> tuple[list[Any], list[Any], Any, GradStats, LossScaleState] | str:
    """The mixed-precision step on the planner's kernels (see the module docstring), or the
    reason the planner gives why it cannot lower these leaves (the caller then takes the
    pure path).

    ``workspace``: a list the caller keeps between steps, where the gradient casts are
    written (see `_widened`); ``None`` allocates them at every step. ``counted``: per leaf,
    whether this rank counts it in the statistics (``functopt._collective.counting``).
    ``compiled``: inner rules without a kernel take the planner's compiled tier, with
    ``scratch`` (kept by a donating caller) for its gathered copies.

    Returns ``(new params, new stores, new inner state, statistics, new loss scale)``.
    """
    proxies = [None if g is None else v for g, v in zip(grads, views, strict=True)]
    inner_leaves, inner_spec = _core.flatten(inner_state)
    structure = planner.structure(_core.unflatten(treespec, views), treespec, views,
                                  inner_leaves, inner_spec)
    lowered = planner.lower(structure, inner_spec, views, proxies, inner_leaves, name,
                            donated=[*params, *(v for v, s in zip(views, stores, strict=True)
                                                if s is not None)] if donate else None,
                            compiled=compiled)
    if lowered.reason is not None:
        return lowered.reason
    # the gradients in the precision of the values they update (a cast is a new tensor);
    # a compiled group's casts go into one buffer, which its call then reads in place
    if workspace is not None and compiled:
        _flat_casts(lowered.groups, grads, views, workspace)
    wide = _widened(grads, views, workspace)
    device = loss_scale.scale.device
    inv_scale = _inverse(loss_scale)
    packed = all_reduce_stats(
        fused_stats(grads, wide, name, inv_scale, device, count_zeros, structure.clips,
                    counted), group)
    stats = unpack_grad_stats(packed[:_CLIPS])
    new_loss_scale = scale_rule.adjust(loss_scale, stats.found_inf)

    # one multiplier for unscale and clip, in float64 (the kernel rounds its divisor)
    multiplier = None
    sums = list(packed[_CLIPS:].unbind())
    if scaled or max_grad_norm is not None:
        multiplier = inv_scale.to(torch.float64)
        if max_grad_norm is not None:
            outer = _clip_factor(packed, max_grad_norm).to(device)
            multiplier = multiplier * outer
            sums = [s * outer * outer for s in sums]  # the inner clips see clipped grads

    # The kernels unscale in place: a gradient that needed no cast is the caller's, never
    # written, so it is copied when it will be scaled.
    cast = [w if w is None or w is not local_tensor(g) or (
        multiplier is None and not structure.clips) else w.clone()
            for g, w in zip(grads, wide, strict=True)]
    # an apply_if_finite in the inner chain sees finite gradients whenever the step is not
    # skipped (a non-finite gradient makes the norm non-finite, which skips the step)
    finite = [~stats.found_inf] * len(structure.guards)
    result = _planner.run(lowered, views, cast, inner_leaves, donate=donate,
                          donate_grads=True, multiplier=multiplier,
                          found_inf=stats.found_inf, sums=sums, finite=finite,
                          reads=planner.reads, workspace=scratch,
                          low=[p if s is not None else None
                               for p, s in zip(params, stores, strict=True)])
    if isinstance(result, str):
        return result
    written = result.low or [None] * len(params)

    new_params = list(params)
    new_stores = list(stores)
    copies: dict[tuple[torch.device, torch.dtype], tuple[list[Any], list[Any]]] = {}
    for i, (p, s, g) in enumerate(zip(params, stores, grads, strict=True)):
        if p is None or g is None:
            continue
        value = result.values[i]
        if s is None:  # the param is its own master
            new_params[i] = value
            continue
        new_stores[i] = value
        if written[i] is not None:  # the compiled call rounded it into the param
            new_params[i] = written[i]
            continue
        if donate:
            dst, src = copies.setdefault((p.device, p.dtype), ([], []))
            dst.append(local_tensor(p))
            src.append(local_tensor(value))
        else:
            new_params[i] = _rewrap_like(p, local_tensor(value).to(p.dtype))
    for dst, src in copies.values():
        torch._foreach_copy_(dst, src)  # round to nearest, in place (params are donated)
    return new_params, new_stores, result.state, stats, new_loss_scale
