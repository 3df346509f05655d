"""``explain``: which path each group of leaves takes, and why, before training starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from functopt._base import GradientTransformation
from functopt._collective.dtensor import _leaf_names
from functopt.fast import _inside, _multi, _multi_injected, _planner
from functopt.transforms.hyperparams import InjectHyperparamsState
from functopt.transforms.multi_steps import MultiSteps
from functopt.tree import _core

__all__ = ["Explanation", "explain"]

_KERNELS = {"adamw": "torch._fused_adamw_", "adam": "torch._fused_adam_",
            "sgd": "torch._fused_sgd_",
            "zero": "nothing (the updates are zero)",
            "compiled": "compiled",
            "perleaf": "per-leaf"}


@dataclass(frozen=True)
class GroupPath:
    """One group of leaves and the kernel call that steps them."""

    kernel: str  # the PyTorch kernel, "compiled" (the compiled tier) or "per-leaf"
    device: torch.device
    dtype: torch.dtype
    leaves: tuple[str, ...]  # paths of the leaves in the group
    clip: bool  # a global-norm clip is folded into the kernel's grad_scale
    weight_decay: bool  # the group is decayed (by the kernel; compiled rules say it in ``rules``)
    skip_if_nonfinite: bool = False  # an apply_if_finite is folded into the kernel's skip
    rules: tuple[str, ...] = ()  # the compiled tier: the rules its one call runs, in order


@dataclass(frozen=True)
class Explanation:
    """What [`make_step`][functopt.fast.make_step] (and the mixed-precision step) would do.

    ``fast`` is True when every leaf with a gradient is stepped by a fused kernel;
    ``reason`` then is None, else it names the transform or leaf that keeps the step on
    the pure path. ``str()`` gives a readable table.

    Examples:
        >>> import torch, functopt
        >>> got = functopt.fast.explain(functopt.sgd(0.1, momentum=0.9), {"w": torch.zeros(3)})
        >>> got.fast, got.groups[0].kernel, got.groups[0].leaves
        (True, 'torch._fused_sgd_', ('w',))
    """

    fast: bool
    reason: str | None
    groups: tuple[GroupPath, ...]
    clips: int  # global-norm clips, all measured in one pass (and one all-reduce)
    guards: int = 0  # apply_if_finite checks, in the same reduction
    # rules the compiled tier runs with a sums pass over every leaf before the step
    # (Prodigy's and D-Adaptation's sums, a clip after other rules), added over groups
    # and ranks (the per-leaf tier runs such a rule's own update on all its leaves)
    tree_sums: int = 0
    # MultiSteps (whole, in a chain, or inside a combinator): what its mini-steps run; the
    # groups then step the mini-step that closes a window
    mini_steps: str | None = None

    def __str__(self) -> str:
        if not self.fast:
            return f"pure path: {self.reason}"
        lines = [f"fused path: {len(self.groups)} kernel call(s) per step, "
                 f"{self.clips} global norm(s) in one pass" + (
                     f", {self.tree_sums} tree sum(s) in a sums pass" if self.tree_sums
                     else "")]
        if self.mini_steps is not None:
            lines = [self.mini_steps, f"closing mini-step: {lines[0]}"]
        for g in self.groups:
            extras = [x for x, on in (("apply_if_finite", g.skip_if_nonfinite),
                                      ("clip", g.clip), ("weight decay", g.weight_decay))
                      if on]
            more = f" + {', '.join(extras)}" if extras else ""
            if g.rules:
                more += f" ({' -> '.join(g.rules)})"
            shown = ", ".join(g.leaves[:4]) + (", ..." if len(g.leaves) > 4 else "")
            lines.append(f"  {g.kernel}{more} on {len(g.leaves)} {_core._dtype_name(g.dtype)} "
                         f"leaves ({g.device}): {shown}")
        return "\n".join(lines)


def explain(tx: GradientTransformation | MultiSteps, params: Any, state: Any = None,
            grads: Any = None, *, compile: bool = False) -> Explanation:
    """Say which path a fast step of ``tx`` takes on these params, per group of leaves.

    Args:
        tx: the transform (the inner one of a mixed-precision step: pass its masters, or
            float32 params of the same shapes, as ``params``).
        params: the params the step will see.
        state: the state (default: ``tx.init(params)``).
        grads: the gradients (default: every param has one, laid out like it).
        compile: explain ``make_step(tx, compile=True)``: groups without a PyTorch kernel
            take the compiled tier where their rules are elementwise.

    Returns:
        An [`Explanation`][functopt.fast.Explanation].

    Examples:
        >>> import torch, functopt
        >>> params = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
        >>> tx = functopt.chain(functopt.clip_by_global_norm(1.0),
        ...                     functopt.adamw(1e-3, mask={"w": True, "b": False}))
        >>> print(functopt.fast.explain(tx, params))
        fused path: 2 kernel call(s) per step, 1 global norm(s) in one pass
          torch._fused_adamw_ + clip on 1 float32 leaves (cpu): b
          torch._fused_adamw_ + clip, weight decay on 1 float32 leaves (cpu): w
        >>> functopt.fast.explain(functopt.lion(1e-4), params).reason
        "leaf 'b': scale_by_lion has no fused kernel (make_step(tx, compile=True) compiles it)"
        >>> print(functopt.fast.explain(functopt.lion(1e-4), params, compile=True))
        fused path: 1 kernel call(s) per step, 0 global norm(s) in one pass
          compiled (scale_by_lion -> add_decayed_weights -> scale_by_learning_rate) on 2 float32 leaves (cpu): b, w
    """
    if isinstance(tx, MultiSteps):
        tx = tx.gradient_transformation()
    if not isinstance(tx, GradientTransformation):
        raise TypeError(
            f"explain: tx must be a functopt.GradientTransformation, got "
            f"{type(tx).__name__}. Fix: explain(functopt.adamw(1e-3), params).")
    injected = _multi_injected.InjectedSplit.of(tx)
    if injected is not None:  # such a chain inside inject_hyperparams: the same, injected
        state = tx.init(params) if state is None else state
        found = injected.split_of(state)
        if found is not None:
            inner_split = found[0]
            closing_state = InjectHyperparamsState(
                state.count, state.hyperparams, inner_split.closing_state(state.inner_state))
            inner = explain(injected.closing, params, closing_state, grads, compile=compile)
            if not inner.fast:
                return dataclasses.replace(inner, reason=f"{inner_split.label}: {inner.reason}")
            return dataclasses.replace(inner, mini_steps=inner_split.summary())
    split = _multi.Split.of(tx)
    if split is not None:  # MultiSteps: foreach accumulation, then the closing fast step
        state = tx.init(params) if state is None else state
        if split.multi_state(state) is not None:
            inner = explain(split.closing, params, split.closing_state(state), grads,
                            compile=compile)
            if not inner.fast:
                return dataclasses.replace(inner, reason=f"{split.label}: {inner.reason}")
            return dataclasses.replace(inner, mini_steps=split.summary())
    leaves, treespec = _core.flatten(params)
    if state is None:
        state = tx.init(params)
    grad_leaves = leaves if grads is None else _core.flatten_like(
        treespec, grads, name="grads", reference="params")
    state_leaves, state_spec = _core.flatten(state)
    name = _leaf_names(treespec)
    structure = _planner.walk(tx, params, treespec, leaves, state_leaves, state_spec)
    lowered = _planner.lower(structure, state_spec, leaves, grad_leaves, state_leaves, name,
                             compiled=compile)
    paths = _core.paths(treespec)
    mini_steps = None
    accumulation = structure.accumulation
    if accumulation is not None and not lowered.fast:  # a MultiSteps inside a combinator

        def lower(mode: str) -> _planner.Lowered:
            found = _planner.walk(tx, params, treespec, leaves, state_leaves, state_spec,
                                  mode)
            return _planner.lower(found, state_spec, leaves, grad_leaves, state_leaves, name,
                                  compiled=compile)

        mini, lowered = _inside.explained(structure, lower)
        structure = lowered.structure
        if lowered.fast:
            mine = accumulation.leaves
            others = [g for g in mini.groups if g.plan.kernel != "zero"]
            mini_steps = "".join((
                f"MultiSteps at {accumulation.where} on {len(mine)} leaves (",
                ", ".join(paths[i] for i in mine[:4]), ", ..." if len(mine) > 4 else "",
                "): each mini-step accumulates their gradients with a foreach running ",
                "mean" if accumulation.multi_steps.use_grad_mean else "sum",
                " per (device, dtype) group",
                f", {len(mini.structure.zeroed)} of them then stepped on zero gradients by "
                "the rules after it" if mini.structure.zeroed else " and adds 0.0 to them",
                f"; the mini-step's kernels: {len(others)} call(s) (" if others else "",
                ", ".join(_KERNELS[g.plan.kernel] for g in others),
                ")" if others else "",
                "; the closing one steps the MultiSteps' inner transform on the accumulated "
                "gradients"))
    groups = tuple(
        GroupPath(kernel=_KERNELS[g.plan.kernel], device=g.device, dtype=g.dtype,
                  leaves=tuple(paths[i] for i in g.leaves), clip=g.plan.clip is not None,
                  weight_decay=g.plan.decay is not None,
                  skip_if_nonfinite=g.plan.guard is not None,
                  rules=tuple(op.kind for op in g.plan.ops))
        for g in lowered.groups)
    return Explanation(fast=lowered.fast, reason=lowered.reason, groups=groups,
                       clips=len(structure.clips), guards=len(structure.guards),
                       tree_sums=len({op.node for g in lowered.groups
                                      if g.plan.kernel == "compiled"
                                      for op in g.plan.ops if op.sums is not None}),
                       mini_steps=mini_steps)
