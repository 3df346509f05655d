"""``MixedPrecisionTransformation.explain``: the mixed-precision step's path and traffic."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from functopt._collective.dtensor import _leaf_names
from functopt.fast import _multi, _planner
from functopt.fast._explain import Explanation, mixed_explanation
from functopt.precision._fused import _lowered
from functopt.precision.master import MasterWeights
from functopt.tree import _core

__all__: list[str] = []


def not_explained(params: Any, state: Any = None, grads: Any = None) -> Explanation:
    """The ``explain`` of a step that has none (``functopt.distributed.zero1``'s)."""
    raise TypeError(
        "this mixed-precision step has no explain (only mixed_precision()'s steps explain "
        "themselves). Fix: explain the mixed_precision(...) step over the same inner "
        "transform, or functopt.fast.explain(inner, params) for the inner rule.")


def explained(params: Any, state: Any = None, grads: Any = None, *,
              init: Callable[[Any], Any], planner: _planner.Planner,
              master_weights: MasterWeights, accumulated: _multi.Split | None, fused: bool,
              fast: bool, donate: bool, compile: bool, multiplied: bool,
              count_zeros: bool) -> Explanation:
    """The explanation of a step of ``mixed_precision(...)`` (its ``init`` and options as
    keywords: ``fast``, the fused path is open to it; ``accumulated``, its inner
    ``MultiSteps``; ``multiplied``, it unscales or clips) on these params, state (None:
    ``init(params)``) and gradients (None: one per param, in its dtype)."""
    if state is None:
        state = init(params)
    param_leaves, treespec = _core.flatten(params)
    _core.check_tensors(param_leaves, treespec, name="params", floating=True)
    grad_leaves = param_leaves if grads is None else _core.flatten_like(
        treespec, grads, name="grads", reference="params")
    store = _core.flatten_like(treespec, state.master, name="state.master",
                               reference="params")
    view = [None if p is None else master_weights.view(p, s)
            for p, s in zip(param_leaves, store, strict=True)]
    if not fast:
        reason = ("fused=False" if not fused else
                  "the master weights are not plain copies (stochastic rounding)")
        return Explanation(fast=False, reason=reason, groups=(), clips=0,
                           traffic_reason="the pure mixed-precision path is not counted")
    inner_state = state.inner_state
    if accumulated is not None:  # a MultiSteps: the step that closes a window
        if accumulated.multi_state(inner_state) is None:
            raise TypeError("mixed_precision.explain: state.inner_state is not the inner "
                            "transform's. Fix: pass the state init(params) made.")
        inner_state = accumulated.closing_state(inner_state)
    structure, inner_leaves, lowered = _lowered(
        planner, treespec, param_leaves, store, view, grad_leaves, inner_state,
        _leaf_names(treespec), donate, compile)
    got = mixed_explanation(lowered, structure, treespec, param_leaves, store, view,
                            grad_leaves, inner_leaves, multiplied=multiplied,
                            count_zeros=count_zeros, donate=donate)
    if accumulated is None or not got.fast:
        return got
    # (its mini-steps unscale and accumulate on the pure path's arithmetic, and its closing
    # step reads the accumulated gradients: other passes than counted here)
    return dataclasses.replace(
        got, mini_steps=accumulated.summary(), bytes_read=None, bytes_written=None,
        traffic_reason="a MultiSteps inner transform's mini-steps are not counted")
