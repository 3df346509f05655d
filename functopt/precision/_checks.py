"""The mixed-precision step's checks: its arguments, its inputs' leaves against each other
and the state's masters, and the inner transform's updates against what they update.

Each error names the leaf by its tree path, says what it received and what was expected,
and how to fix it.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from functopt import _validate
from functopt._base import GradientTransformation
from functopt._collective.agreement import check_agreement
from functopt._collective.counting import Replicated, _counting, _entries
from functopt._collective.dtensor import _leaf_names
from functopt.precision.loss_scale import LossScale
from functopt.precision.master import MasterWeights
from functopt.precision.stats import NormClip
from functopt.tree import _core

__all__ = ["OWNER", "Checked", "check_inner", "check_options", "check_updates",
           "checked_leaves"]

OWNER = "mixed_precision"


def check_inner(inner: Any) -> None:
    """Raise unless ``inner`` is a transformation (naming the factory it may be)."""
    if not isinstance(inner, GradientTransformation):
        hint = (
            " It is callable: did you pass the factory instead of calling it "
            "(functopt.adamw instead of functopt.adamw(1e-3))?" if callable(inner) else ""
        )
        raise TypeError(
            f"{OWNER}: inner must be a functopt.GradientTransformation, got "
            f"{type(inner).__name__}.{hint} Fix: mixed_precision(functopt.adamw(1e-3), ...)."
        )


def check_options(loss_scale: Any, master_weights: Any, max_grad_norm: Any, process_group: Any,
                  agree_skip: bool | dist.ProcessGroup,
                  agree_timeout: float | datetime.timedelta | None,
                  flags: dict[str, bool]) -> float | None:
    """Raise on an option of the wrong type or range; returns the agreement's timeout in
    seconds (`check_agreement`)."""
    if loss_scale is not None and not isinstance(loss_scale, LossScale):
        hint = (
            f" For a constant scale pass functopt.static_loss_scale({loss_scale!r})."
            if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool) else ""
        )
        raise TypeError(
            f"{OWNER}: loss_scale must be a functopt.LossScale (from dynamic_loss_scale() or "
            f"static_loss_scale(...)) or None, got {type(loss_scale).__name__} "
            f"{loss_scale!r}.{hint}"
        )
    if not isinstance(master_weights, MasterWeights):
        raise TypeError(
            f"{OWNER}: master_weights must be a functopt.precision.MasterWeights (from "
            f"float32_master(), ...), got {type(master_weights).__name__}."
        )
    _validate.check_flags(OWNER, **flags)
    if max_grad_norm is not None and not isinstance(max_grad_norm, NormClip):
        _validate.check_range(OWNER, "max_grad_norm", max_grad_norm, low=0.0, low_open=True,
                              hint="Fix: pass a positive norm bound such as 1.0, or None "
                                   "for no clipping.")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"{OWNER}: process_group must be a torch.distributed.ProcessGroup or None (to "
            f"infer it from DTensor params), got {type(process_group).__name__}. Fix: pass "
            f"e.g. torch.distributed.group.WORLD or device_mesh.get_group()."
        )
    return check_agreement(OWNER, agree_skip, agree_timeout)


class Checked(NamedTuple):
    """The leaves of one step's inputs, checked (`checked_leaves`)."""

    params: list[Any]
    treespec: _core.TreeSpec
    grads: list[Any]
    store: list[Any]  # per param, its master-weight store
    view: list[Any]  # per param, the master-precision value it is updated as
    name: Callable[[int], str]
    group: dist.ProcessGroup | None  # where the statistics are summed
    counted: list[bool]  # per leaf, whether this rank counts it in the statistics


def checked_leaves(mw: MasterWeights, process_group: dist.ProcessGroup | None,
                   replicated: Replicated, grads: Any, master: Any, params: Any) -> Checked:
    """The leaves of a step's inputs (``master``: the state's), checked, with where the
    statistics are summed and which leaves this rank counts in them."""
    param_leaves, treespec = _core.flatten(params)
    _core.check_tensors(param_leaves, treespec, name="params", floating=True)
    grad_leaves = _core.flatten_like(treespec, grads, name="grads", reference="params")
    _core.check_tensors(grad_leaves, treespec, name="grads", floating=True)
    store = _core.flatten_like(treespec, master, name="state.master", reference="params")
    view = [None if p is None else mw.view(p, s)
            for p, s in zip(param_leaves, store, strict=True)]
    _check_views(view, param_leaves, store, treespec, mw.dtype)
    _check_grads(grad_leaves, param_leaves, view, treespec)
    name = _leaf_names(treespec)
    if process_group is None and replicated is None and all(
            p is None or type(p) is torch.Tensor or type(p) is torch.nn.Parameter
            for p in param_leaves):
        # plain tensors and nothing to sum over: _counting's answer, without its walk
        group, counted = None, [p is not None for p in param_leaves]
    else:
        group, counted = _counting(
            OWNER, param_leaves, name, process_group,
            _entries(OWNER, replicated, params, param_leaves, treespec))
    return Checked(param_leaves, treespec, grad_leaves, store, view, name, group, counted)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_views(views: list[Any], params: list[Any], stores: list[Any],
                 treespec: _core.TreeSpec, master_dtype: torch.dtype) -> None:
    """state.master fits the params: each param's master-precision value has its shape and
    at least the bits of the strategy's dtype (a store missing from a state built for other
    params would leave it narrower)."""
    for i, (v, p, s) in enumerate(zip(views, params, stores, strict=True)):
        if v is None:
            continue
        fix = "Fix: build the state with init(params) on the params you step."
        if v.shape != p.shape:
            raise ValueError(
                f"mixed_precision: {_core.paths(treespec)[i]!r}: state.master holds "
                f"{_core._describe(v)} for {_core._describe(p)}. {fix}"
            )
        if v.dtype.itemsize < master_dtype.itemsize:  # (floating dtypes: fewer bits)
            held = "None" if s is None else _core._describe(s)
            raise ValueError(
                f"mixed_precision: {_core.paths(treespec)[i]!r}: state.master holds {held} "
                f"for a {_dtype(p.dtype)} param, so it would be updated in "
                f"{_dtype(v.dtype)} rather than in the master dtype {_dtype(master_dtype)} "
                f"(was the state built for params of another dtype?). {fix}"
            )


def _check_grads(grads: list[Any], params: list[Any], views: list[Any],
                 treespec: _core.TreeSpec) -> None:
    """A gradient comes in its param's dtype (as autograd makes it) or in the precision of the
    value it updates (a float32 main grad for a bfloat16 param, as Megatron accumulates)."""
    name = _leaf_names(treespec)  # paths are computed only for an error message
    for i, (g, p, v) in enumerate(zip(grads, params, views, strict=True)):
        if g is None:
            continue
        if p is None or g.shape != p.shape or g.dtype not in (p.dtype, v.dtype) or (
                g.device != p.device):
            _grad_error(name(i), g, p, v)


def _grad_error(where: str, g: torch.Tensor, p: Any, v: Any) -> None:
    """Raise the error for the first problem of this gradient (see `_check_grads`)."""
    if p is None:
        raise ValueError(
            f"mixed_precision: {where!r}: grads hold {_core._describe(g)} where params "
            f"hold None. Fix: pass None as the gradient of a leaf that is not optimized."
        )
    if g.shape != p.shape:
        raise ValueError(
            f"mixed_precision: {where!r}: grad has shape {tuple(g.shape)} but the param "
            f"has shape {tuple(p.shape)}. Fix: pass the gradients of these params."
        )
    if g.dtype not in (p.dtype, v.dtype):
        allowed = _dtype(p.dtype) if v.dtype == p.dtype else (
            f"{_dtype(p.dtype)} (the param's) or {_dtype(v.dtype)} (its master's)"
        )
        raise TypeError(
            f"mixed_precision: {where!r}: {_dtype(g.dtype)} grad for a {_dtype(p.dtype)} "
            f"param; expected a {allowed} grad. Fix: pass param.grad as autograd "
            f"produced it."
        )
    if g.device != p.device:
        raise ValueError(
            f"mixed_precision: {where!r}: grad is on {g.device} but the param is on "
            f"{p.device}. Fix: move the gradients to their params' devices."
        )


def check_updates(updates: list[Any], views: list[Any], treespec: _core.TreeSpec) -> None:
    """The inner transform keeps the shape and dtype of what it updates (no silent promotion
    of the master or of a float32 param)."""
    for i, (u, v) in enumerate(zip(updates, views, strict=True)):
        if u is None or v is None:
            continue
        if not isinstance(u, torch.Tensor) or u.shape != v.shape or u.dtype != v.dtype:
            raise TypeError(
                f"mixed_precision: {_core.paths(treespec)[i]!r}: the inner transform returned "
                f"{_core._describe(u)} to update {_core._describe(v)}. Fix: the inner "
                f"transform must return updates of its gradients' dtype and shape."
            )
