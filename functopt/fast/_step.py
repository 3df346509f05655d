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
   a group of leaves whose rules are elementwise (Lion, NAdam, RAdam, Adamax, Adadelta,
   Rprop, ..., and Adam, AdamW and SGD, which then leave their kernels) runs as one
   ``torch.compile``\ d call over the group's tensors laid end to end, the rules' own
   pure ``update`` fused into one loop; ``step.init(params)`` lays the state out that way.

``MultiSteps`` (the whole transform, or one element of a chain) is stepped by
``functopt/fast/_multi.py``: its mini-steps accumulate with ``foreach`` ops in the state,
and the mini-step that closes a window runs the inner transform's own fast step (the
mixed-precision step does the same: ``functopt/precision/_fused.py``).

Every path returns ``(new_params, new_state)`` with the state in the transform's own
layout, so the paths are interchangeable at any step.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from functopt import _validate
from functopt._apply import apply_updates
from functopt._base import GradientTransformation, Params, State, Updates
from functopt._collective import stats
from functopt._collective.dtensor import _infer_group, _leaf_names, _rewrap_like, local_tensor
from functopt.fast import _capture, _compiled, _engine, _inside, _multi, _multi_injected, _planned
from functopt.fast._capture import CapturedStep
from functopt.fast._errors import warn_lost
from functopt.fast._planner import Planner, check_donation
from functopt.fast._programs import Structure
from functopt.transforms.multi_steps import MultiSteps
from functopt.tree import _core, _ops

__all__ = ["Step", "differentiated", "make_step"]

StepFn = Callable[..., tuple[Params, State]]
_INFERRED: Any = object()  # `_reductions`: the group from the params' DTensor meshes


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
    tx: GradientTransformation | MultiSteps, *, donate: bool = False, compile: bool = False,
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
            every gradient on steps with a clip. Without it gradients are never written:
            the kernel reads copies, which on the CPU are made batch by batch into one
            scratch buffer of 2 MiB (kept by a donated step, per thread) so that the
            kernel finds them in cache; a clip that does not act at a step (a factor of
            exactly 1, read on the host there) copies nothing.
        fused: False keeps every step on the pure ``update`` (with the grouped ``foreach``
            apply, and donation), without a warning: the reference path, for comparison.
        compile: the compiled tier: each group of leaves whose program of elementwise
            rules it lowers and no PyTorch kernel takes (one program, one device and
            dtype; Lion, NAdam, ..., and what the kernels refuse, such as Adam's moments
            in another dtype than the param) is one ``torch.compile``\ d call over its
            gradients, values and state laid end to end, running the rules' own
            ``update``; Adam, AdamW and SGD keep their kernels (as fast as a compiled call
            over laid-out tensors, faster than one gathering separate tensors). The first step
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
            (expanded tensors), and on a fast path per-leaf state entries that share
            memory with each other or with a param (``init`` must give each its own).

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
    if isinstance(tx, MultiSteps):
        tx = tx.gradient_transformation()
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
    path. It keeps the plans it derived (structures, no tensors), what its last fused steps
    checked (weak references to the params and moments with their dtypes, shapes,
    strides, devices and addresses: a step on the same unchanged tensors skips the checks
    and the plan lookup, any change runs them again), the kernels' arguments its last step
    resolved (Python numbers, kept while the hyperparameter tensors they were read from are
    the same and unmodified) and, with ``compile=True``, the compiled functions: nothing
    that changes a result.

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
        self.planner = Planner(tx)
        # MultiSteps: mini-steps accumulate here, a closing step runs the inner
        # transform's own fast step
        # (whole, one element of a chain, or such a chain inside inject_hyperparams)
        self._accumulated: _multi.Split | _multi_injected.InjectedSplit | None = (
            _multi.Split.of(tx) or _multi_injected.InjectedSplit.of(tx))
        self._inner = None if self._accumulated is None else Step(
            self._accumulated.closing, donate=donate, compile=compile, fused=fused,
            donate_grads=donate_grads)
        # The compiled tier's gather buffers of a donating step, per thread (two threads
        # stepping their own states with one step must not share them). Scratch: every
        # step overwrites them before reading, so they carry nothing between steps.
        self._workspace = threading.local()
        # What the last steps checked and lowered, by the tensors they saw (weakly held):
        # a training loop steps the same params and state tensors every time, so the
        # structure, dtype, shape, layout and aliasing checks and the plan lookup run once
        # and are re-run when a tensor, its metadata or its memory changes (`_Seen.match`).
        self._seen: list[_Seen] = []

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
        groups = self.planner.compiled_groups(treespec, param_leaves, state_leaves, state_spec)
        if groups is None:
            return state
        _, laid = _compiled.flat_layout(param_leaves, [False] * len(param_leaves),
                                        state_leaves, groups)
        return _core.unflatten(state_spec, laid)

    def lay_out(self, params: Params) -> Params:
        """Move the params of every compiled group, and their gradients, into one buffer per
        group, so that the compiled tier reads the gradients and writes the params in place
        instead of gathering them (for Lion at 20M params, about 16 of the 36 bytes per
        param it moves otherwise; docs/performance.md). Call it once, before
        ``init`` and before the first backward; returns ``params``.

        Each param keeps its identity, shape, strides and values: ``param.data`` becomes a
        view of the group's buffer (an ``nn.Module`` keeps working, and its parameters are
        those the step updates in place with ``donate=True``), and ``param.grad`` a view of
        the group's gradient buffer, which autograd accumulates into. Zero the gradients in
        place (``model.zero_grad(set_to_none=False)``): a gradient set to None and created
        again by autograd is a separate tensor, which the step then gathers (correct, and
        as slow as without the layout). Groups that take a PyTorch kernel, or no fast path,
        are left as they are; without ``compile=True`` nothing is moved.

        Raises:
            TypeError: a param of a compiled group is not a plain tensor or
                ``nn.Parameter`` (a DTensor, say), naming it.
            ValueError: a param that is not a leaf tensor, or params that share memory
                (tied weights, overlapping views), as a donated step refuses them.

        Examples:
            >>> import torch, functopt
            >>> model = torch.nn.Linear(2, 2)
            >>> step = functopt.fast.make_step(functopt.lion(1e-4), compile=True, donate=True)
            >>> params = step.lay_out(dict(model.named_parameters()))
            >>> w, b = model.weight, model.bias
            >>> w.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            True
            >>> w.grad.untyped_storage().data_ptr() == b.grad.untyped_storage().data_ptr()
            True
        """
        if not self.compile:
            return params
        param_leaves, treespec = _core.flatten(params)
        _core.check_tensors(param_leaves, treespec, name="params", floating=True)
        # one buffer cannot hold two params that share memory (in one group or two)
        check_donation(param_leaves, _leaf_names(treespec))
        state_leaves, state_spec = _core.flatten(self.tx.init(params))
        groups = self.planner.compiled_groups(treespec, param_leaves, state_leaves, state_spec)
        if groups is not None:
            with torch.no_grad():
                _compiled.lay_out_params(param_leaves, groups, _leaf_names(treespec))
        return params

    def capture(self, grads: Updates, state: State, params: Params, *,
                warmup: int = 2) -> CapturedStep:
        """Record this step once as a CUDA graph and return it: ``captured()`` then replays
        it, one launch for the whole step, on these very tensors: the params and the state
        are updated in place and the gradients read where they are (backward into the same
        ``.grad`` tensors, ``model.zero_grad(set_to_none=False)``; ``captured(grads)``
        copies gradients held elsewhere in first). Equal to calling the step, bitwise (the
        same kernels), for static shapes on one CUDA device.

        While it is recorded the step takes its device forms: counters advance by kernels,
        the learning rate (a tensor, injected or a schedule of the count) reaches the
        kernels as a tensor and is read at every replay. What the step resolved on the host
        is fixed when recorded: the plan, and the hyperparameters the kernels take as Python
        numbers (betas, eps, weight decay; an injected one is read once, and changing it in
        place later does not reach the replays: capture again). ``warmup`` real steps run
        first (planning, compiling, the kernels' workspaces) and are then undone: capture
        leaves every value as it was (it holds a copy of the params and the state
        meanwhile). A lost fast path is recorded too: the pure update, if it reads nothing
        on the host. ``functopt.testing.conformance.check_capture`` holds a chain's captured
        step to the pure path, on a CPU too. (A donated step recorded by the caller's own
        ``torch.cuda.graph``, around a whole training step, behaves the same: it writes
        every new tensor it makes into the one it replaces and returns its inputs.)

        Raises:
            ValueError: the step is not donated (``make_step(tx, donate=True)``); a tensor
                not on the params' CUDA device (a counter on the CPU, as ``MultiSteps``
                keeps its window, would stay what it was when recorded); a param without a
                gradient tensor; tied params, as a donated step refuses them.
            TypeError: a DTensor or another tensor subclass.
            CaptureError: the step reads a tensor on the host while it runs (a transform
                that branches on a value, an injected beta that is a schedule), naming
                where; or replaces a state entry with another kind of value.

        Examples:
            >>> import torch, functopt
            >>> step = functopt.fast.make_step(functopt.adamw(1e-3), donate=True)
            >>> params = {"w": torch.ones(2)}  # on the CPU: a CUDA graph needs CUDA
            >>> try:
            ...     step.capture({"w": torch.ones(2)}, step.init(params), params)
            ... except ValueError as error:
            ...     print(str(error).split(";")[0])
            Step.capture: param 'w' is on cpu
        """
        return _capture.capture(self, grads, state, params, warmup=warmup)

    def _scratch(self) -> dict[Any, Any]:
        found: dict[Any, Any] | None = getattr(self._workspace, "buffers", None)
        if found is None:
            found = self._workspace.buffers = {}
        return found

    def __call__(self, grads: Updates, state: State, params: Params, **extra_args: Any,
                 ) -> tuple[Params, State]:
        seen = self._recall(grads, params, state, None)
        if seen is not None and not differentiated(params, grads, state):
            lowered, param_leaves, treespec, grad_leaves, state_leaves = seen
            result = self._fused(params, param_leaves, treespec, grad_leaves, state_leaves,
                                 lowered.state_spec, _leaf_names(treespec), lowered)
            if not isinstance(result, str):
                if self.donate and _ops._recording():
                    self._flat_kept(param_leaves, treespec, state_leaves, lowered.state_spec,
                                    result.values, result.leaves, result.spec)
                    return params, state
                return _core.unflatten(treespec, result.values), result.state
        new_params, new_state = self._call(grads, state, params, extra_args)
        if self.donate and _ops._recording():
            return self._kept(params, state, new_params, new_state)
        return new_params, new_state

    def _kept(self, params: Params, state: State, new_params: Params, new_state: State,
              ) -> tuple[Params, State]:
        """A donated step being recorded (a CUDA graph, `_ops._recording`) returns its inputs,
        each new tensor it made (a counter, a guard's counters, an injected value, the pure
        path's updates) copied into the tensor it replaces: a replay then writes where the
        next replay reads, and whoever holds the params and the state (an ``nn.Module``,
        ``optimizer.state``) holds the graph's outputs."""
        param_leaves, treespec = _core.flatten(params)
        state_leaves, state_spec = _core.flatten(state)
        new_leaves, new_spec = _core.flatten(new_state)
        self._flat_kept(param_leaves, treespec, state_leaves, state_spec,
                        _core.flatten_like(treespec, new_params, name="new params",
                                           reference="params"), new_leaves, new_spec)
        return params, state

    def _call(self, grads: Updates, state: State, params: Params, extra_args: dict[str, Any],
              ) -> tuple[Params, State]:
        """A step with every check run: the first for these tensors, or a step whose inputs
        changed since (or that takes another path than the kernels)."""
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
                check_donation(param_leaves, name)
            updates, new_state = tx.update(grads, state, params, **extra_args)
            return _grouped_apply(param_leaves, treespec, updates, donate), new_state
        if _engine.ENABLED and (taken := _engine.step(  # (the private program engine)
                self, param_leaves, treespec, grad_leaves, state, params, extra_args)):
            return taken
        if self._accumulated is not None:
            if donate:
                check_donation(param_leaves, name)
            return self._multi_step(self._accumulated, grads, state, params, extra_args)
        state_leaves, state_spec = _core.flatten(state)
        result = self._fused(params, param_leaves, treespec, grad_leaves, state_leaves,
                             state_spec, name)
        if not isinstance(result, str):
            return _core.unflatten(treespec, result.values), result.state
        if result is not _inside.FOREIGN:  # (a state of another transform: its own error)
            warn_lost("make_step", result, stacklevel=3)
        updates, new_state = tx.update(grads, state, params, **extra_args)
        return _grouped_apply(param_leaves, treespec, updates, donate), new_state

    def _recall(self, grads: Updates, params: Params, state: State,
                state_leaves: list[Any] | None,
                ) -> tuple[_planned.Lowered, list[Any], _core.TreeSpec, list[Any], list[Any]] | None:
        """The lowering a fused step made for these very inputs, with their leaves, if
        nothing it checked has changed since (see `_Seen.match`); None otherwise, and
        the caller runs every check. ``state_leaves``: the state given as leaves (of the
        remembered state structure), or None to flatten ``state``."""
        if not self.fused or self._accumulated is not None:
            return None
        for seen in self._seen:
            found = seen.match(grads, params, state, state_leaves)
            if found is not None:
                return (seen.lowered, *found)
        return None

    def _remember(self, param_leaves: list[Any], treespec: _core.TreeSpec,
                  grad_leaves: list[Any], state_leaves: list[Any],
                  lowered: _planned.Lowered) -> None:
        seen = _Seen.of(param_leaves, treespec, grad_leaves, state_leaves, lowered)
        if seen is None:
            return
        kept = [s for s in self._seen if s.treespec != treespec][:_Seen.KEPT - 1]
        self._seen = [seen, *kept]  # (replaced whole: a thread iterating it keeps its list)

    def _fused(self, params: Params, param_leaves: list[Any], treespec: _core.TreeSpec,
               grad_leaves: list[Any], state_leaves: list[Any], state_spec: _core.TreeSpec,
               name: Callable[[int], str], lowered: _planned.Lowered | None = None,
               ) -> _planned.Result | str:
        """The planner's step on checked leaves, or the reason it has no fast path (before
        anything was written). ``lowered``: the lowering `_recall` found for them (whose
        `_Seen.match` checked them: plain tensors, each gradient laid out as its param)."""
        donate, planner = self.donate, self.planner
        checked = lowered is not None
        if lowered is None:
            structure = planner.structure(params, treespec, param_leaves, state_leaves,
                                          state_spec)
            lowered = planner.lower(structure, state_spec, param_leaves, grad_leaves,
                                    state_leaves, name,
                                    donated=param_leaves if donate else None,
                                    compiled=self.compile)
            if lowered.reason is not None:
                if structure.accumulation is None:
                    return lowered.reason
                return self._inside(structure, params, param_leaves, treespec, grad_leaves,
                                    state_leaves, state_spec, name)
            if donate:  # (a step that is not donated returns new tensors: never seen again)
                self._remember(param_leaves, treespec, grad_leaves, state_leaves, lowered)
        if torch.is_grad_enabled():  # donated params may be leaves that require grad
            with torch.no_grad():
                return self._run(lowered, param_leaves, grad_leaves, state_leaves, name,
                                 checked)
        return self._run(lowered, param_leaves, grad_leaves, state_leaves, name, checked)

    def _inside(self, structure: Structure, params: Params, param_leaves: list[Any],
                treespec: _core.TreeSpec, grad_leaves: list[Any], state_leaves: list[Any],
                state_spec: _core.TreeSpec, name: Callable[[int], str],
                ) -> _planned.Result | str:
        """A step of a transform with a ``MultiSteps`` inside a combinator
        (``functopt/fast/_inside.py``): the planner's step of this mini-step, or the reason
        there is none (before anything was written)."""
        planner = self.planner

        def lower(mode: str) -> _planned.Lowered:
            found = planner.structure(params, treespec, param_leaves, state_leaves,
                                      state_spec, mode)
            return planner.lower(found, state_spec, param_leaves, grad_leaves, state_leaves,
                                 name, donated=param_leaves if self.donate else None,
                                 compiled=self.compile)

        def run(lowered: _planned.Lowered, grads: list[Any],
                verdicts: dict[int, torch.Tensor]) -> _planned.Result | str:
            return self._run(lowered, param_leaves, grads, state_leaves, name,
                             verdicts=verdicts)

        def finite(guard: int) -> torch.Tensor:
            return _reductions(structure, param_leaves, grad_leaves, name)[1][guard]

        with torch.no_grad():
            return _inside.inside_step(structure, lower, run, finite, treespec, param_leaves,
                                       grad_leaves, state_leaves, donate=self.donate)

    def _run(self, lowered: _planned.Lowered, param_leaves: list[Any], grad_leaves: list[Any],
             state_leaves: list[Any], name: Callable[[int], str], checked: bool = False,
             verdicts: dict[int, torch.Tensor] | None = None) -> _planned.Result | str:
        """The planner's run with the step's reductions; ``verdicts``: guards whose verdict
        the caller gives (a guard around a MultiSteps checks other gradients than those its
        closing mini-step steps on: `_inside.inside_step`)."""
        structure = lowered.structure
        workspace = self._scratch() if self.donate else None
        if not (structure.zero_nans or structure.clips or structure.guards):
            # (no gradient to zero, no value to reduce: zero_nans hands the gradients back,
            # _reductions and found_nan no values)
            return _planned.run(lowered, param_leaves, grad_leaves, state_leaves,
                                donate=self.donate, donate_grads=self.donate_grads, sums=[],
                                finite=[], reads=self.planner.reads, workspace=workspace,
                                nans=[], checked=checked)
        grad_leaves, flags = _planned.zero_nans(structure, grad_leaves)
        totals = None
        if structure.tree_wide and not structure.clips:
            # (the sums passes need no clip's factor, which only the reduction gives: their
            # sums join the guards' counts and the nan flags in the step's one all-reduce)
            totals = _planned.local_tree_sums(
                structure, [(group, None) for group in lowered.groups], param_leaves,
                grad_leaves, state_leaves)
        sums, finite, reduced, totals = _reductions(
            structure, param_leaves, grad_leaves, name,
            nans=[flag for _, flag, on_mesh in flags if on_mesh], totals=totals)
        for index, verdict in (verdicts or {}).items():
            finite[index] = verdict
        return _planned.run(lowered, param_leaves, grad_leaves, state_leaves,
                            donate=self.donate, donate_grads=self.donate_grads, sums=sums,
                            finite=finite, reads=self.planner.reads,
                            # (a zero_nans' gradients are new tensors, of any layout)
                            workspace=workspace, checked=checked and not structure.zero_nans,
                            nans=_planned.found_nan(flags, reduced, state_leaves),
                            totals=totals)

    def _step_leaves(self, grads: Updates, state_leaves: list[Any], state_spec: _core.TreeSpec,
                     params: Params) -> tuple[list[Any], list[Any], _core.TreeSpec]:
        """``self(grads, state, params)`` with the state given and returned as its leaves and
        treespec, and the new params as their leaves: for a caller that keeps the state flat
        (``functopt.Optimizer`` keeps it in torch's per-param layout), the fused path then
        neither rebuilds nor flattens it. Any other path takes ``__call__`` (and its
        warning) on the rebuilt tree."""
        seen = self._recall(grads, params, None, state_leaves)
        if seen is not None and seen[0].state_spec is not state_spec and (
                seen[0].state_spec != state_spec):
            seen = None
        if seen is not None and not differentiated(params, grads, state_leaves):
            lowered, param_leaves, treespec, grad_leaves, _ = seen
            result = self._fused(params, param_leaves, treespec, grad_leaves, state_leaves,
                                 state_spec, _leaf_names(treespec), lowered)
            if not isinstance(result, str):
                return result.values, result.leaves, result.spec
        elif self.fused:
            param_leaves, treespec, grad_leaves = _check(grads, params)
            if not differentiated(params, grads, state_leaves):
                result = self._fused(params, param_leaves, treespec, grad_leaves, state_leaves,
                                     state_spec, _leaf_names(treespec))
                if not isinstance(result, str):
                    return result.values, result.leaves, result.spec
        new, state = self._call(grads, _core.unflatten(state_spec, state_leaves), params, {})
        leaves, spec = _core.flatten(state)
        news = _core.flatten_like(_core.structure(params), new, name="new params",
                                  reference="params")
        return news, leaves, spec

    def _step_flat(self, param_leaves: list[Any], grad_leaves: list[Any],
                   treespec: _core.TreeSpec, state_leaves: list[Any],
                   state_spec: _core.TreeSpec) -> tuple[list[Any], list[Any], _core.TreeSpec]:
        """`_step_leaves` with the params and grads given as their leaves, of ``treespec``
        (the params' structure), for a caller that holds them so (``functopt.Optimizer``):
        a step on the inputs the last fused step saw, unchanged (`_Seen.match_leaves`),
        takes the kernels without building their trees; any other step builds them and
        takes `_step_leaves`. The new params are returned as leaves of ``treespec``."""
        if _engine.ENABLED and self.fused and not differentiated(  # (the program engine)
                param_leaves, grad_leaves, state_leaves) and (taken := _engine.step_flat(
                    self, param_leaves, treespec, grad_leaves, state_leaves, state_spec)):
            return self._flat_kept(param_leaves, treespec, state_leaves, state_spec, *taken)
        if self.fused and self._accumulated is None:
            for seen in self._seen:
                lowered = seen.lowered
                if (seen.treespec is treespec or seen.treespec == treespec) and (
                        lowered.state_spec is state_spec or lowered.state_spec == state_spec
                        ) and seen.match_leaves(param_leaves, grad_leaves, state_leaves):
                    if torch._C._functorch.maybe_current_level() is not None or (
                            torch.is_grad_enabled()):
                        # (autograd may record, or torch.func wraps: every check again)
                        break
                    # (_fused's run, under no_grad already)
                    result = self._run(lowered, param_leaves, grad_leaves, state_leaves,
                                       _leaf_names(seen.treespec), True)
                    if isinstance(result, str):
                        break
                    return self._flat_kept(param_leaves, treespec, state_leaves, state_spec,
                                           result.values, result.leaves, result.spec)
        return self._flat_kept(param_leaves, treespec, state_leaves, state_spec,
                               *self._step_leaves(_core.unflatten(treespec, grad_leaves),
                                                  state_leaves, state_spec,
                                                  _core.unflatten(treespec, param_leaves)))

    def _flat_kept(self, param_leaves: list[Any], treespec: _core.TreeSpec,
                   state_leaves: list[Any], state_spec: _core.TreeSpec, values: list[Any],
                   leaves: list[Any], spec: _core.TreeSpec,
                   ) -> tuple[list[Any], list[Any], _core.TreeSpec]:
        """`_kept` for `_step_flat`'s leaves (the step's result unchanged when it is not a
        donated step being recorded)."""
        if not (self.donate and _ops._recording()):
            return values, leaves, spec
        return _capture.written_back(param_leaves, treespec, state_leaves, state_spec, values,
                                     leaves, spec)

    def _multi_step(self, split: _multi.Split | _multi_injected.InjectedSplit, grads: Updates,
                    state: Any, params: Params,
                    extra_args: dict[str, Any]) -> tuple[Params, State]:
        """A ``MultiSteps`` step, whole or in a chain (``functopt/fast/_multi.py``): its
        window decided as its ``update`` decides it, the gradients accumulated with
        ``foreach`` ops (in place in ``state.acc_grads`` when donated), and on the
        mini-step that closes a window the fast step of the inner transform (and of what
        follows it in the chain) on the accumulated gradients."""
        assert self._inner is not None
        if isinstance(split, _multi_injected.InjectedSplit):
            return split.step(self._inner, _grouped_apply, grads, state, params, extra_args,
                              donate=self.donate)
        return _multi.multi_step(split, self._inner, _grouped_apply, grads, state, params,
                                 extra_args, donate=self.donate)


# Tensors whose metadata ``_Seen`` reads directly (a DTensor's, or another subclass's, may
# not say where its memory is: such steps run every check every time).
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_OR_NONE = frozenset({*_PLAIN, type(None)})


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    """What the checks and the lowering of a fused step read of a param: its dtype, shape,
    strides, device and memory (the address also tells a param whose ``.data`` was
    replaced, as ``module.to()`` does: the same object, a new tensor inside)."""
    return (t.dtype, t.shape, t.stride(), t.device, t.data_ptr())


@dataclass(eq=False)
class _Seen:
    """The inputs of a fused step whose checks passed and which the planner lowered: the
    params (weakly held) with their metadata, which gradients were None, the state's
    structure and its per-leaf entries (weakly held, with their addresses, strides and
    shapes). A later step on inputs that `match` it skips the checks and the lookup;
    anything else (another tensor in a param's or a moment's place, a param's dtype, shape,
    strides, device or memory changed in place, a moment's memory, strides or shape, a gradient that is not a plain dense tensor of its param's
    dtype, shape and device, another structure) runs them all again. Holds no tensor."""

    KEPT = 8  # remembered per step function (one per param group of an Optimizer)

    treespec: _core.TreeSpec
    # per param leaf: None for a None param, else (weakref, address, strides, shape, dtype,
    # device, whether it had a gradient): one list to walk per step
    rows: list[tuple[Any, ...] | None]
    # per per-leaf state entry: (flat state index, weakref, address, strides, shape)
    slot_rows: list[tuple[Any, ...]]
    plain_state: bool  # every state leaf a tensor or None: flatten_up_to is the flatten
    lowered: _planned.Lowered

    @classmethod
    def of(cls, param_leaves: list[Any], treespec: _core.TreeSpec, grad_leaves: list[Any],
           state_leaves: list[Any], lowered: _planned.Lowered) -> _Seen | None:
        # (the types in a set: one pass in C, not a Python test per leaf)
        if not set(map(type, param_leaves)) <= _PLAIN_OR_NONE:
            return None
        slots = lowered.structure.slot_indices
        entries = [state_leaves[k] for k in slots]
        if not set(map(type, entries)) <= _PLAIN_OR_NONE - {type(None)}:
            return None
        rows = [None if p is None else (weakref.ref(p), p.data_ptr(), p.stride(), p.shape,
                                        p.dtype, p.device, g is not None)
                for p, g in zip(param_leaves, grad_leaves, strict=True)]
        slot_rows = [(k, weakref.ref(e), e.data_ptr(), e.stride(), e.shape)
                     for k, e in zip(slots, entries, strict=True)]
        return cls(treespec, rows, slot_rows,
                   all(t is type(None) or issubclass(t, torch.Tensor)
                       for t in set(map(type, state_leaves))), lowered)

    def match(self, grads: Any, params: Any, state: Any, state_leaves: list[Any] | None,
              ) -> tuple[list[Any], _core.TreeSpec, list[Any], list[Any]] | None:
        """(param leaves, treespec, grad leaves, state leaves) if these inputs are the ones
        seen, unchanged in everything the checks and the lowering read; else None."""
        treespec = self.treespec
        try:
            param_leaves = treespec.flatten_up_to(params)
            grad_leaves = treespec.flatten_up_to(grads)
            if state_leaves is None:
                if not self.plain_state:
                    return None
                state_leaves = self.lowered.state_spec.flatten_up_to(state)
        except (ValueError, TypeError):
            return None
        if state is not None and not all(
                x is None or isinstance(x, torch.Tensor) for x in state_leaves):
            return None  # (a subtree where a tensor was: not the structure seen)
        if not self.match_leaves(param_leaves, grad_leaves, state_leaves):
            return None
        return param_leaves, treespec, grad_leaves, state_leaves

    def match_leaves(self, param_leaves: list[Any], grad_leaves: list[Any],
                     state_leaves: list[Any]) -> bool:
        """`match` on inputs given as leaves (of ``treespec``, and of the state structure
        seen): whether they are the ones seen, unchanged in everything the checks and the
        lowering read."""
        strided = torch.strided
        rows = self.rows
        if len(param_leaves) != len(rows) or len(grad_leaves) != len(rows):
            return False
        for p, g, row in zip(param_leaves, grad_leaves, rows, strict=True):
            if row is None:
                if p is not None or g is not None:
                    return False
                continue
            ref, ptr, stride, shape, dtype, device, had = row
            # (the metadata _meta reads, one value at a time: a small model's step pays for
            # every read)
            if p is None or p is not ref() or p.data_ptr() != ptr or p.stride() != stride or (
                    p.shape != shape or p.dtype is not dtype or p.device != device):
                return False
            if g is None:
                if had:
                    return False
                continue
            # the checks of _check, against the param's dtype, shape and device seen, and
            # the param's strides (the kernels then take the gradient as it is: `run`'s
            # ``checked``)
            if not had or type(g) not in _PLAIN or g.layout is not strided or (
                    g.dtype is not dtype or g.shape != shape or g.stride() != stride
                    or g.device != device):
                return False
        # (a moment whose .data became another view of its memory, transposed or narrowed,
        # keeps its address: the kernels would read it as laid out before)
        for k, ref, ptr, stride, shape in self.slot_rows:
            entry = state_leaves[k]
            if entry is None or entry is not ref() or entry.data_ptr() != ptr or (
                    entry.stride() != stride or entry.shape != shape):
                return False
        return True


def _reductions(structure: Structure, params: list[Any], grads: list[Any],
                name: Callable[[int], str], *, counted: list[bool] | None = None,
                group: Any = _INFERRED, nans: list[torch.Tensor] | None = None,
                totals: dict[int, Any] | None = None,
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
                           dict[int, Any] | None]:
    """The global values the chain's clips (sums of squares) and ``apply_if_finite`` guards
    (is every gradient finite) need: one local pass each, and one all-reduce of them all,
    packed, when the params are sharded (over ``group`` when given: the mixed step's; and
    ``counted``, per leaf, whether this rank counts it, when given). ``nans``: the local
    ``found_nan`` flags of DTensor leaves (a leading ``zero_nans``'), summed in the same
    all-reduce and returned third; ``totals``: this process's tree sums
    (`_planned.local_tree_sums`), summed there too and returned fourth."""
    nans = nans or []
    if not (structure.clips or structure.guards or nans or totals):
        return [], [], [], totals
    device = next((local_tensor(g).device for g in grads if g is not None),
                  torch.device("cpu"))
    if counted is None:
        counted = stats.counted_leaves(grads, name)
    else:
        counted = [c and g is not None for c, g in zip(counted, grads, strict=True)]
    local = [*stats.clip_sums(grads, counted, structure.clips, device),
             *stats.nonfinite_counts(grads, counted, [g.leaves for g in structure.guards],
                                     device),
             *(flag.to(device, torch.float64) for flag in nans)]
    m = len(local)
    if group is _INFERRED:
        group = _infer_group(params, name)
    if group is not None:
        local = stats.all_reduce_parts([*local, *stats.pack_sums(totals or {})], group)
        if totals:
            totals = stats.unpack_sums(totals, local[m:])
    n, k = len(structure.clips), len(structure.clips) + len(structure.guards)
    return local[:n], [count == 0 for count in local[n:k]], local[k:m], totals


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
