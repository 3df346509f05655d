"""The mixed-precision step on fused kernels around ``MultiSteps``: `fused_multi_step`.

``MultiSteps(inner, k).gradient_transformation()`` as the inner transform of
[`mixed_precision`][functopt.precision.mixed_precision], or a chain holding one, takes
this path: the cast and the statistics pass of ``precision/_fused.py`` with the pure path's
arithmetic (so its mini-steps are bitwise the pure ones on the CPU; see ``unscaled_stats``
in ``_collective/stats.py``), the accumulation on a mini-step, and ``inner``'s kernels on
the accumulated gradients when the window closes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from functopt import _validate
from functopt._collective.agreement import Agreement
from functopt._collective.dtensor import _rewrap_like, local_tensor
from functopt._collective.stats import counted_leaves, unscaled_stats
from functopt.fast import _multi, _planned, _planner
from functopt.fast._multi import accumulate as _accumulate
from functopt.fast._multi import plus_zero
from functopt.fast._step import _grouped_apply, _reductions
from functopt.precision._fused import (
    _CLIPS,
    _all_reduced,
    _kernel_step,
    _lowered,
    _scaled,
    _widened,
    _write_params,
)
from functopt.precision.loss_scale import LossScale, LossScaleState, _inverse
from functopt.precision.stats import GradStats, NormClip, _clip_factor, unpack_grad_stats
from functopt.transforms.multi_steps import MultiSteps, MultiStepsState, Window
from functopt.tree import _core

__all__ = ["fused_multi_step"]


def fused_multi_step(
    split: _multi.Split, planner: _planner.Planner, params: list[Any], stores: list[Any],
    views: list[Any], grads: list[Any], state: Any, loss_scale: LossScaleState, *,
    treespec: Any, scale_rule: LossScale, scaled: bool,
    max_grad_norm: float | torch.Tensor | NormClip | None, group: dist.ProcessGroup | None,
    name: Callable[[int], str], count_zeros: bool, donate: bool,
    workspace: list[Any] | None = None, counted: Sequence[bool] | None = None,
    compiled: bool = False, scratch: dict[Any, Any] | None = None,
    agreed: Agreement | None = None,
) -> tuple[list[Any], list[Any], Any, GradStats, LossScaleState] | str:
    """The mixed step around ``MultiSteps(inner, k).gradient_transformation()``, or a chain
    holding one (``split``: ``functopt/fast/_multi.py``), with ``planner`` that of
    ``split.closing``: the pure mixed step's arithmetic up to the inner update with
    ``foreach`` ops (cast, unscale, one statistics pass, loss scale, clip: so bitwise its
    gradients and metrics where ``foreach`` norms are its norms, as on the CPU), then, when
    the step does not overflow, the chain's prefix (its own update) and
    ``MultiSteps.window`` decides the mini-step; a mini-step accumulates with
    ``_accumulate`` (``foreach``, into ``acc_grads`` in place when donated) and adds
    MultiSteps' zero updates to masters and params (0.0; through the chain's suffix when
    there is one), as the pure step does; the closing mini-step runs the inner transform
    (and the suffix) on the kernels over the accumulated gradients and writes the params
    from the new masters. An overflow keeps params, masters and the whole inner state (as
    the pure step's select does), read on the host: the window of the next call depends on
    it (the pure step's select of MultiSteps' CPU counters reads it too). Returns what
    `fused_mixed_step` returns, or the reason it takes the pure path, before anything was
    written.

    DTensor params: ``MultiSteps`` sees DTensor gradients (its checks and skip function
    as on the pure step), the foreach ops run on local shards, and the statistics make the
    step's one all-reduce. The inner chain's clips and guards measure the accumulated
    gradients of a closing mini-step: without ``max_grad_norm``, a skip function and a
    prefix those are known before the statistics and join their all-reduce, with a
    compiled rule's tree sums where no inner clip comes first (one collective per step); otherwise they take a second one on closing mini-steps (and a
    prefix clip its own, as on the pure step, but for an overflowing step: the prefix and
    the skip function do not run where the pure step discards their results).
    """
    ms = split.ms
    ms_state = split.multi_state(state)
    if ms_state is None:
        if not split.path:
            _validate.check_state("MultiSteps", state, MultiStepsState)  # (raises)
        return "the state does not fit the transform's spec (no MultiStepsState in it)"
    structure, inner_leaves, lowered = _lowered(
        planner, treespec, params, stores, views, grads, split.closing_state(state), name,
        donate, compiled)
    if lowered.reason is not None:
        return f"{split.label}: {lowered.reason}"
    unscaled = _widened(grads, views, workspace)
    device = loss_scale.scale.device
    if scaled:  # (without a loss scale the pure path multiplies by 1.0: the same values)
        unscaled = _scaled(unscaled, grads, _inverse(loss_scale))
    local = unscaled_stats(unscaled, counted_leaves(unscaled, name) if counted is None
                           else counted, device, count_zeros)
    counted = None if counted is None else list(counted)
    # Without the step's own clip (a skip function, a prefix) MultiSteps' gradients are
    # known before the statistics: a closing mini-step's inner clips and guards measure
    # the accumulated gradients now, and their sums join the statistics' one all-reduce
    # (and the tree sums of a rule that has them, Prodigy's, unless an inner clip's factor
    # must come first).
    early = max_grad_norm is None and ms.should_skip_update_fn is None and not (
        split.prefix) and bool(structure.clips or structure.guards or structure.tree_wide)
    window = inner_grads = totals = None
    sums: list[torch.Tensor] = []
    if early:
        window, inner_grads, sums, totals = _early_sums(
            ms, lowered, treespec, unscaled, grads, views, inner_leaves, ms_state, name, counted)
        if sums:
            local = torch.cat([local, torch.stack(sums).to(device)])
    packed, sums, totals = _all_reduced(local, totals, len(sums), group, agreed, device)
    stats = unpack_grad_stats(packed[:_CLIPS])
    new_loss_scale = scale_rule.adjust(loss_scale, stats.found_inf)
    if bool(stats.found_inf):  # skipped: everything as it was but the loss scale (the
        # prefix and the skip function, whose results the pure step discards, do not run:
        # no collective of theirs on any rank, as every rank reads the same decision)
        return list(params), list(stores), state, stats, new_loss_scale
    if max_grad_norm is not None:
        unscaled = _scaled(unscaled, grads, _clip_factor(packed, max_grad_norm))
    new_state = state
    if split.prefix:  # (the pure chain's first elements, on what the step gives them)
        unscaled, new_state = _prefixed(split, state, treespec, unscaled, views)
    if window is None:
        window = _window(ms, treespec, unscaled, views, ms_state)
    if window.skip or not window.closes:
        new_params, new_stores, new_state = _mini_step(
            split, window, ms_state, state, new_state, treespec, params, stores, views,
            unscaled, grads, donate)
        return new_params, new_stores, new_state, stats, new_loss_scale
    if inner_grads is None:
        inner_grads = _closing_grads(ms, window, unscaled, _own(unscaled, grads))
    # the kernels scale by the inner clips in place: never a gradient of the caller's
    inner_grads = [u.clone() if structure.clips and u is not None and u is local_tensor(g)
                   else u for u, g in zip(inner_grads, grads, strict=True)]
    if early:  # (the sums of the clips, then one non-finite count per guard)
        n = len(structure.clips)
        sums, finite = sums[:n], [x == 0 for x in sums[n:]]
    else:
        sums, finite, _, _ = _reductions(structure, views, inner_grads, name,
                                         counted=counted, group=group)
    result = _kernel_step(planner, lowered, params, stores, views, grads, inner_grads,
                          inner_leaves, donate, scratch, sums=sums, finite=finite,
                          totals=totals)
    if isinstance(result, str):
        return result
    new_params, new_stores, closed = result
    new_state = _multi.closed(split, new_state, window, closed, in_place=donate)
    return new_params, new_stores, new_state, stats, new_loss_scale


def _early_sums(ms: MultiSteps, lowered: _planned.Lowered, treespec: Any, unscaled: list[Any],
                grads: list[Any], views: list[Any], inner_leaves: list[Any],
                ms_state: MultiStepsState, name: Callable[[int], str],
                counted: list[bool] | None,
                ) -> tuple[Window, list[Any] | None, list[torch.Tensor], dict[int, Any] | None]:
    """`fused_multi_step`'s window decided before the statistics, and on a closing
    mini-step the gradients the inner transform steps on, with this process's sums of its
    clips, non-finite counts of its guards (float64) and tree sums, to join the
    statistics' all-reduce: ``(window, inner grads or None, sums, tree sums or None)``."""
    window = _window(ms, treespec, unscaled, views, ms_state)
    if not window.closes:
        return window, None, [], None
    structure = lowered.structure
    inner_grads = _closing_grads(ms, window, unscaled, _own(unscaled, grads))
    totals = None
    if structure.tree_wide and not structure.clips:
        totals = _planned.local_tree_sums(
            structure, [(g, None) for g in lowered.groups], views, inner_grads, inner_leaves)
    sums, finite, _, _ = _reductions(structure, views, inner_grads, name, counted=counted,
                                     group=None)
    return window, inner_grads, [*sums, *((~f).to(torch.float64) for f in finite)], totals


def _prefixed(split: _multi.Split, state: Any, treespec: Any, unscaled: list[Any],
              views: list[Any]) -> tuple[list[Any], Any]:
    """The chain's elements before the ``MultiSteps`` on the step's gradients, as the pure
    chain runs them: ``(their updates, as local shards; the state with theirs)``."""
    new_state = state
    tree, views_tree = _shards_as_given(treespec, unscaled, views), _core.unflatten(
        treespec, views)
    for tx, path in split.prefix:
        tree, sub = tx.update(tree, _multi.get(state, path), views_tree)
        new_state = _multi.put(new_state, path, sub)
    return [None if u is None else local_tensor(u)
            for u in _core.flatten_like(treespec, tree, name="the prefix's updates",
                                        reference="params")], new_state


def _mini_step(split: _multi.Split, window: Window, ms_state: MultiStepsState, state: Any,
               new_state: Any, treespec: Any, params: list[Any], stores: list[Any],
               views: list[Any], unscaled: list[Any], grads: list[Any], donate: bool,
               ) -> tuple[list[Any], list[Any], Any]:
    """A mini-step that does not close the window (or that the skip function skips): the
    accumulation (or the skip state) written into MultiSteps' state, and its zero updates
    added to masters and params (through the chain's suffix when there is one), as the pure
    step adds them. Returns ``(new params, new stores, new state)``."""
    if window.skip:
        new_ms = ms_state._replace(skip_state=window.skip_state)
    else:
        present = [i for i, g in enumerate(window.leaves) if g is not None]
        new_accs = _accumulate(split.ms, window, present, in_place=donate,
                               scratch=_own(unscaled, grads))
        new_ms = window.next_state(ms_state, _core.unflatten(treespec, new_accs))
    new_state = _multi.put(new_state, split.path, new_ms)
    if split.suffix:  # the suffix on MultiSteps' zeros, added as the pure step adds
        zeros = _core.unflatten(treespec, _core.map_leaves(torch.zeros_like, window.leaves))
        for tx, path in split.suffix:
            zeros, sub = tx.update(zeros, _multi.get(state, path),
                                   _core.unflatten(treespec, views))
            new_state = _multi.put(new_state, path, sub)
        values = _core.flatten(_grouped_apply(views, treespec, zeros, donate))[0]
    else:
        values = plus_zero(views, unscaled, donate=donate)  # master (or param) + 0.0
    new_params, new_stores = _write_params(params, stores, unscaled, values, None, donate)
    return new_params, new_stores, new_state


def _own(unscaled: list[Any], grads: list[Any]) -> list[bool]:
    """Per leaf, whether its unscaled gradient is the step's own (a cast or a scaled copy,
    not the caller's gradient): the accumulation may write it."""
    return [u is not None and u is not local_tensor(g)
            for u, g in zip(unscaled, grads, strict=True)]


def _shards_as_given(treespec: Any, unscaled: list[Any], views: list[Any]) -> Any:
    """The step's gradients (local shards) as the pure step gives them to the inner
    transform: DTensors placed like their masters on DTensor params."""
    return _core.unflatten(treespec, [
        None if u is None else _rewrap_like(v, u) for u, v in zip(unscaled, views, strict=True)])


def _window(ms: MultiSteps, treespec: Any, unscaled: list[Any], views: list[Any],
            state: MultiStepsState) -> Window:
    """``MultiSteps.window`` on the step's gradients, as the pure step gives them to it
    (the foreach ops then run on the local shards)."""
    return ms.window(_shards_as_given(treespec, unscaled, views), state,
                     _core.unflatten(treespec, views))


def _closing_grads(ms: MultiSteps, window: Window, unscaled: list[Any],
                   mine: list[bool]) -> list[Any]:
    """The gradients the inner transform steps on at a closing mini-step (local shards):
    the window's accumulated mean (or sum) in the gradients' dtype, or the gradient itself
    for a window of one, as on the pure path."""
    if window.mini_step == 0:
        return unscaled
    present = [i for i, g in enumerate(window.leaves) if g is not None]
    summed = _accumulate(ms, window, present, in_place=False, scratch=mine)
    return [None if g is None else local_tensor(a).to(local_tensor(g).dtype)
            for g, a in zip(window.leaves, summed, strict=True)]
