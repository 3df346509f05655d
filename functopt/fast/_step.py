r"""``make_step``: one call that updates params and state, on the fastest path that is exact.

The pure protocol splits a step in two: ``tx.update`` returns updates, and
``apply_updates`` adds them. Both are per-leaf and out-of-place, which keeps them
differentiable with ``torch.func`` and easy to read, and costs one pass over memory per
elementary operation (Adam's update alone is about fifteen). A training loop that does
not differentiate through its optimizer wants the whole step instead, and may hand its old
params and state over to be overwritten (donation). ``make_step(tx)`` is that step:

1. the planner (``functopt/fast/_planner.py``) reads the transform as composed (through
   ``chain``, ``masked``, ``partition``, ``inject_hyperparams``, schedules) and lowers
   each (device, dtype) group of leaves to one of PyTorch's fused kernels, with a leading
   ``clip_by_global_norm`` folded in (one ``foreach`` norm pass, one all-reduce on
   sharded params);
2. a transform the planner cannot lower runs its pure ``update``, and the updates are
   added with one ``torch._foreach_add`` per (device, dtype) group (in place when
   donated); a [`FastPathWarning`][functopt.fast.FastPathWarning] says why, once;
3. ``compile=True`` adds the planner's compiled tier (``functopt/fast/_compiled.py``):
   a group of leaves whose rules are elementwise but have no PyTorch kernel (Lion, NAdam,
   RAdam, Adamax, Adadelta, Rprop, dampened SGD, ...) runs as one ``torch.compile``\ d
   call over the group's tensors laid end to end, the rules' own pure ``update`` fused
   into one loop; ``step.init(params)`` lays the state out that way.

Every path returns ``(new_params, new_state)`` with the state in the transform's own
layout, so the paths are interchangeable at any step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from functopt import _validate
from functopt._apply import apply_updates
from functopt._base import GradientTransformation, Params, State, Updates
from functopt._collective.dtensor import _infer_group, _leaf_names, _rewrap_like, local_tensor
from functopt._collective.reduce import all_reduce_stats
from functopt.fast import _compiled, _planner
from functopt.tree import _core

__all__ = ["Step", "differentiated", "make_step"]

StepFn = Callable[..., tuple[Params, State]]


def differentiated(*trees: Any) -> bool:
    """Whether a step on these pytrees must stay differentiable: autograd records (grad
    mode on and a tensor that requires grad) or a ``torch.func`` transform is active. The
    fused kernels write in place and have no derivative, so such a step is pure.

    The trees are flattened only when grad mode is on: a training step under
    ``torch.no_grad()`` pays two mode checks.
    """
    if torch._C._functorch.maybe_current_level() is not None:
        return True  # inside torch.func.grad, vmap, ...: every input may be wrapped
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(x, torch.Tensor) and x.requires_grad
               for tree in trees for x in _core.flatten(tree)[0])


def make_step(
    tx: GradientTransformation, *, donate: bool = False, compile: bool = False,
    fused: bool = True, donate_grads: bool = False,
) -> Step:
    r"""``step(grads, state, params, **extra_args) -> (new_params, new_state)`` for ``tx``.

    Equal to ``updates, state = tx.update(grads, state, params, **extra_args)`` followed
    by ``params = functopt.apply_updates(params, updates)``: bitwise where the arithmetic
    is the same (the grouped ``foreach`` apply), to rounding where a fused kernel orders
    the arithmetic differently (a relative $10^{-12}$ in float64; tests/test_fast.py).

    Args:
        tx: any transformation, composed as you like. The planner lowers it to fused
            kernels where every leaf's rule has one (see
            [`explain`][functopt.fast.explain]); otherwise the pure ``update`` runs and
            the updates are added with grouped ``foreach`` kernels, and a
            [`FastPathWarning`][functopt.fast.FastPathWarning] says why (once per
            reason). A step that must stay differentiable (grad mode on and an input that
            requires grad, as for a meta-gradient, or inputs wrapped by ``torch.func``)
            always takes the pure path, ``update`` then ``apply_updates``, and writes
            into nothing: call the step under ``torch.no_grad()`` to allow the kernels
            and donation.
        donate: the caller hands ``params`` and ``state`` over: the step may overwrite
            their tensors and return them (the params of an ``nn.Module``, for instance,
            are then updated in place). The caller must not read the old values
            afterwards. Gradients are written only with ``donate_grads``; without donation nothing passed in
            is modified.
        donate_grads: the caller hands the gradients over too: a fused step may scale them
            in place (a clip folded into the kernel divides them, as
            ``clip_grad_norm_`` and ``GradScaler.unscale_`` do), which saves a copy of
            every gradient on steps with a clip. Without it gradients are never written.
        fused: False keeps every step on the pure ``update`` (with the grouped ``foreach``
            apply, and donation), without a warning: the reference path, for comparison.
        compile: the compiled tier for the groups no PyTorch kernel covers: each such
            group of leaves (one program of elementwise rules, one device and dtype) is one
            ``torch.compile``\ d call over its gradients, values and state laid end to end,
            running the rules' own ``update`` (groups with a kernel keep it). The first step
            of each group compiles (seconds; Inductor's on-disk cache makes later processes
            faster; a change of sizes recompiles). Initialise the state with
            ``step.init(params)`` so that it is read and written in place; params that are
            views of one buffer are too. Held to the pure path by the conformance law.

    Returns:
        The step function (a [`Step`][functopt.fast.Step]: ``step(...)`` and
        ``step.init(params)``).

    Raises:
        TypeError: ``tx`` is not a transformation; at each call, leaves that are not
            floating tensors, or grads of another dtype than their params (naming the leaf).
        ValueError: grads of another structure, shape or device than the params; with
            ``donate``, params that share memory (tied weights) or overlap themselves
            (expanded tensors).

    Examples:
        >>> import torch, functopt
        >>> tx = functopt.adamw(0.1, weight_decay=0.0)
        >>> step = functopt.fast.make_step(tx, donate=True)
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> state = tx.init(params)
        >>> new, state = step({"w": torch.tensor([0.5, -2.0])}, state, params)
        >>> new["w"], new["w"] is params["w"]  # Adam's first step is lr * sign(g); in place
        (tensor([ 0.9000, -0.9000]), True)
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(
            f"make_step: tx must be a functopt.GradientTransformation, got "
            f"{type(tx).__name__}. Fix: make_step(functopt.adamw(1e-3))."
        )
    _validate.check_flags("make_step", donate=donate, compile=compile, fused=fused,
                          donate_grads=donate_grads)
    return Step(tx, donate=donate, compile=compile, fused=fused, donate_grads=donate_grads)


class Step:
    """The step function [`make_step`][functopt.fast.make_step] returns:
    ``step(grads, state, params, **extra_args) -> (new_params, new_state)``, plus
    ``step.init(params)``, the transform's initial state laid out for this step's fast
    path. It keeps the plans it derived (structures, no tensors) and, with
    ``compile=True``, the compiled functions: nothing that changes a result.

    Examples:
        >>> import torch, functopt
        >>> step = functopt.fast.make_step(functopt.sgd(0.1))
        >>> params = {"w": torch.ones(2)}
        >>> new, state = step({"w": torch.tensor([1.0, -1.0])}, step.init(params), params)
        >>> new["w"]
        tensor([0.9000, 1.1000])
    """

    def __init__(self, tx: GradientTransformation, *, donate: bool, compile: bool,
                 fused: bool, donate_grads: bool) -> None:
        self.tx = tx
        self.donate = donate
        self.compile = compile
        self.fused = fused
        self.donate_grads = donate_grads
        self.planner = _planner.Planner(tx)
        # The compiled tier's gather buffers of a donating step, per thread (two threads
        # stepping their own states with one step must not share them). Scratch: every
        # step overwrites them before reading, so they carry nothing between steps.
        self._workspace = threading.local()

    def __repr__(self) -> str:
        return (f"make_step({self.tx!r}, donate={self.donate}, compile={self.compile}, "
                f"fused={self.fused}, donate_grads={self.donate_grads})")

    def init(self, params: Params) -> State:
        """``tx.init(params)``, with the per-leaf state entries of every compiled group laid
        end to end in one buffer per entry (the leaves stay views with their params'
        shapes and strides, so the state is used and saved as any other): the compiled
        tier then reads and writes the state in place instead of gathering it. Equal to
        ``tx.init(params)`` value for value; without ``compile=True`` it is that.

        Examples:
            >>> import torch, functopt
            >>> step = functopt.fast.make_step(functopt.lion(1e-4), compile=True)
            >>> params = {"a": torch.zeros(2), "b": torch.zeros(3)}
            >>> state = step.init(params)
            >>> mu = state[0].mu
            >>> mu["a"].untyped_storage().data_ptr() == mu["b"].untyped_storage().data_ptr()
            True
        """
        state = self.tx.init(params)
        if not self.compile:
            return state
        param_leaves, treespec = _core.flatten(params)
        state_leaves, state_spec = _core.flatten(state)
        structure = self.planner.structure(params, treespec, param_leaves, state_leaves,
                                           state_spec)
        lowered = _planner.lower(structure, state_spec, param_leaves, param_leaves,
                                 state_leaves, _leaf_names(treespec), compiled=True)
        if not lowered.fast:
            return state
        _, laid = _compiled.flat_layout(param_leaves, [False] * len(param_leaves),
                                        state_leaves, lowered.groups)
        return _core.unflatten(state_spec, laid)

    def _scratch(self) -> dict[Any, Any]:
        found: dict[Any, Any] | None = getattr(self._workspace, "buffers", None)
        if found is None:
            found = self._workspace.buffers = {}
        return found

    def __call__(self, grads: Updates, state: State, params: Params, **extra_args: Any,
                 ) -> tuple[Params, State]:
        tx, donate = self.tx, self.donate
        param_leaves, treespec, grad_leaves = _check(grads, params)
        if differentiated(params, grads, state):
            # autograd records (or torch.func transforms) this step: the pure path, whose
            # every operation has a derivative, and no writes into the inputs
            updates, new_state = tx.update(grads, state, params, **extra_args)
            return apply_updates(params, updates), new_state
        name = _leaf_names(treespec)
        if not self.fused:
            if donate:
                _planner.check_donation(param_leaves, name)
            updates, new_state = tx.update(grads, state, params, **extra_args)
            return _grouped_apply(param_leaves, treespec, updates, donate), new_state
        state_leaves, state_spec = _core.flatten(state)
        result = self._fused(params, param_leaves, treespec, grad_leaves, state_leaves,
                             state_spec, name)
        if not isinstance(result, str):
            return _core.unflatten(treespec, result.values), result.state
        _planner.warn_lost("make_step", result, stacklevel=2)
        updates, new_state = tx.update(grads, state, params, **extra_args)
        return _grouped_apply(param_leaves, treespec, updates, donate), new_state


    def _fused(self, params: Params, param_leaves: list[Any], treespec: _core.TreeSpec,
               grad_leaves: list[Any], state_leaves: list[Any], state_spec: _core.TreeSpec,
               name: Callable[[int], str]) -> _planner.Result | str:
        """The planner's step on checked leaves, or the reason it has no fast path (before
        anything was written)."""
        donate, planner = self.donate, self.planner
        structure = planner.structure(params, treespec, param_leaves, state_leaves, state_spec)
        lowered = planner.lower(structure, state_spec, param_leaves, grad_leaves, state_leaves,
                                name, donated=param_leaves if donate else None,
                                compiled=self.compile)
        if lowered.reason is not None:
            return lowered.reason
        with torch.no_grad():  # donated params may be leaves that require grad
            sums, finite = _reductions(structure, param_leaves, grad_leaves, name)
            return _planner.run(lowered, param_leaves, grad_leaves, state_leaves,
                                donate=donate, donate_grads=self.donate_grads, sums=sums,
                                finite=finite, reads=planner.reads,
                                workspace=self._scratch() if donate else None)

    def _step_leaves(self, grads: Updates, state_leaves: list[Any], state_spec: _core.TreeSpec,
                    params: Params) -> tuple[Params, list[Any], _core.TreeSpec]:
        """``self(grads, state, params)`` with the state given and returned as its leaves and
        treespec: for a caller that keeps the state flat (``functopt.Optimizer`` keeps it in
        torch's per-param layout), the fused path then neither rebuilds nor flattens it.
        Any other path takes ``__call__`` (and its warning) on the rebuilt tree."""
        if self.fused:
            param_leaves, treespec, grad_leaves = _check(grads, params)
            if not differentiated(params, grads, state_leaves):
                result = self._fused(params, param_leaves, treespec, grad_leaves, state_leaves,
                                     state_spec, _leaf_names(treespec))
                if not isinstance(result, str):
                    return _core.unflatten(treespec, result.values), result.leaves, result.spec
        new, state = self(grads, _core.unflatten(state_spec, state_leaves), params)
        leaves, spec = _core.flatten(state)
        return new, leaves, spec


def _reductions(structure: _planner.Structure, params: list[Any], grads: list[Any],
                name: Callable[[int], str]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The global values the chain's clips (sums of squares) and ``apply_if_finite`` guards
    (is every gradient finite) need: one local pass each, and one all-reduce of them all,
    packed, when the params are sharded."""
    if not (structure.clips or structure.guards):
        return [], []
    device = next((local_tensor(g).device for g in grads if g is not None),
                  torch.device("cpu"))
    counted = _planner.counted_leaves(grads, name)
    local = [*_planner.clip_sums(structure, grads, counted, device),
             *_planner.nonfinite_counts(structure, grads, counted, device)]
    group = _infer_group(params, name)
    if group is not None:
        local = list(all_reduce_stats(torch.stack(local), group).unbind())
    n = len(structure.clips)
    return local[:n], [count == 0 for count in local[n:]]


def _check(grads: Updates, params: Params) -> tuple[list[Any], _core.TreeSpec, list[Any]]:
    param_leaves, treespec = _core.flatten(params)
    _core.check_tensors(param_leaves, treespec, name="params", floating=True)
    grad_leaves = _core.flatten_like(treespec, grads, name="grads", reference="params")
    _core.check_tensors(grad_leaves, treespec, name="grads", floating=True)
    _core.check_like(grad_leaves, param_leaves, treespec, name="grad", reference_name="param")
    return param_leaves, treespec, grad_leaves


def _grouped_apply(param_leaves: list[Any], treespec: _core.TreeSpec, updates: Updates,
                   donate: bool) -> Params:
    """``apply_updates`` with one ``foreach`` add per (device, dtype) group (bitwise equal:
    the same elementwise additions)."""
    update_leaves = _core.flatten_like(treespec, updates, name="updates", reference="params")
    _core.check_tensors(update_leaves, treespec, name="updates")
    _core.check_like(update_leaves, param_leaves, treespec, name="update",
                     reference_name="param")
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (p, u) in enumerate(zip(param_leaves, update_leaves, strict=True)):
        if p is not None and u is not None:
            groups.setdefault((p.device, p.dtype), []).append(i)
    new = list(param_leaves)
    with torch.no_grad():
        for idx in groups.values():
            ps = [local_tensor(param_leaves[i]) for i in idx]
            us = [local_tensor(update_leaves[i]) for i in idx]
            if donate:
                torch._foreach_add_(ps, us)
            else:
                for i, out in zip(idx, torch._foreach_add(ps, us), strict=True):
                    new[i] = _rewrap_like(param_leaves[i], out)
    return _core.unflatten(treespec, new)
