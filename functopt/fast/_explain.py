"""``explain``: which path each group of leaves takes, and why, before training starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from functopt._base import GradientTransformation
from functopt._collective.dtensor import _leaf_names, local_tensor
from functopt.fast import _inside, _multi, _multi_injected, _planned, _programs, _traffic, _walk
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
    # the bytes its kernel or compiled call and the copies it makes read and write per step
    # (None: the per-leaf tier, counted for all its groups together in the Explanation)
    bytes_read: int | None = None
    bytes_written: int | None = None


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
    # the memory traffic of one step (``functopt/fast/_traffic.py``): bytes read and
    # written by every group, pass and copy, over ``elements`` param elements with a
    # gradient; None where it could not be counted, ``traffic_reason`` then says why
    bytes_read: int | None = None
    bytes_written: int | None = None
    elements: int = 0
    traffic_reason: str | None = None

    @property
    def bytes_per_param(self) -> float | None:
        """Bytes read and written per param element per step (None: not counted)."""
        if self.bytes_read is None or self.bytes_written is None or not self.elements:
            return None
        return (self.bytes_read + self.bytes_written) / self.elements

    def _traffic_line(self) -> str:
        per = self.bytes_per_param
        if per is None:
            return f"memory traffic: not counted ({self.traffic_reason or 'no gradients'})"
        assert self.bytes_read is not None and self.bytes_written is not None
        return (f"memory traffic: {per:.1f} bytes per param per step ("
                f"{_size(self.bytes_read)} read, {_size(self.bytes_written)} written)")

    def __str__(self) -> str:
        if not self.fast:
            return f"pure path: {self.reason}\n{self._traffic_line()}"
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
        lines.append(self._traffic_line())
        return "\n".join(lines)


def _size(n: int) -> str:
    """A byte count, readable."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def explain(tx: GradientTransformation | MultiSteps, params: Any, state: Any = None,
            grads: Any = None, *, compile: bool = False, donate: bool = False,
            donate_grads: bool = False) -> Explanation:
    """Say which path a fast step of ``tx`` takes on these params, per group of leaves.

    Args:
        tx: the transform (a mixed-precision step explains itself, its casts and
            writes included: ``step.explain(params)`` of
            [`mixed_precision`][functopt.precision.mixed_precision]'s result).
        params: the params the step will see.
        state: the state (default: ``tx.init(params)``).
        grads: the gradients (default: every param has one, laid out like it).
        compile: explain ``make_step(tx, compile=True)``: groups without a PyTorch kernel
            take the compiled tier where their rules are elementwise.
        donate, donate_grads: as [`make_step`][functopt.fast.make_step]'s; they change
            the copies a step makes, so its memory traffic (``bytes_read``,
            ``bytes_written``, ``bytes_per_param``: see *Memory traffic*).

    Returns:
        An [`Explanation`][functopt.fast.Explanation].

    Memory traffic: the bytes one step reads and writes, counted from the plan for the
    groups PyTorch's kernels and the compiled tier step (each call's tensors and every
    copy, gather and norm pass the step makes), and by a run of the eager operations on
    meta tensors for the pure path and the per-leaf tier. Tensors of at least one
    dimension are counted (not step counts, learning rates or norms); a clip is counted
    as a step that clips. On an accelerator a step takes about its bytes divided by the
    memory bandwidth.

    Examples:
        >>> import torch, functopt
        >>> params = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
        >>> tx = functopt.chain(functopt.clip_by_global_norm(1.0),
        ...                     functopt.adamw(1e-3, mask={"w": True, "b": False}))
        >>> print(functopt.fast.explain(tx, params, donate=True))
        fused path: 2 kernel call(s) per step, 1 global norm(s) in one pass
          torch._fused_adamw_ + clip on 1 float32 leaves (cpu): b
          torch._fused_adamw_ + clip, weight decay on 1 float32 leaves (cpu): w
        memory traffic: 44.0 bytes per param per step (480 B read, 400 B written)
        >>> functopt.fast.explain(functopt.lion(1e-4), params).reason
        "leaf 'b': scale_by_lion has no fused kernel (make_step(tx, compile=True) compiles it)"
        >>> print(functopt.fast.explain(functopt.lion(1e-4), params, compile=True))
        fused path: 1 kernel call(s) per step, 0 global norm(s) in one pass
          compiled (scale_by_lion -> add_decayed_weights -> scale_by_learning_rate) on 2 float32 leaves (cpu): b, w
        memory traffic: 44.0 bytes per param per step (480 B read, 400 B written)
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
            inner = explain(injected.closing, params, closing_state, grads, compile=compile,
                            donate=donate, donate_grads=donate_grads)
            if not inner.fast:
                return dataclasses.replace(inner, reason=f"{inner_split.label}: {inner.reason}")
            return dataclasses.replace(inner, mini_steps=inner_split.summary())
    split = _multi.Split.of(tx)
    if split is not None:  # MultiSteps: foreach accumulation, then the closing fast step
        state = tx.init(params) if state is None else state
        if split.multi_state(state) is not None:
            inner = explain(split.closing, params, split.closing_state(state), grads,
                            compile=compile, donate=donate, donate_grads=donate_grads)
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
    structure = _walk.walk(tx, params, treespec, leaves, state_leaves, state_spec)
    lowered = _planned.lower(structure, state_spec, leaves, grad_leaves, state_leaves, name,
                             compiled=compile)
    paths = _core.paths(treespec)
    mini_steps = None
    accumulation = structure.accumulation
    if accumulation is not None and not lowered.fast:  # a MultiSteps inside a combinator

        def lower(mode: str) -> _planned.Lowered:
            found = _walk.walk(tx, params, treespec, leaves, state_leaves, state_spec, mode)
            return _planned.lower(found, state_spec, leaves, grad_leaves, state_leaves, name,
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
    traffic, total = _step_traffic(tx, params, state, lowered, structure, leaves,
                                   grad_leaves, state_leaves, treespec, donate=donate,
                                   donate_grads=donate_grads)
    return _explanation(lowered, structure, paths, grad_leaves, traffic, total, mini_steps)


def _explanation(lowered: _planned.Lowered, structure: _programs.Structure, paths: list[str],
                 grad_leaves: list[Any], traffic: dict[int, _traffic.Traffic],
                 total: _traffic.Traffic | str, mini_steps: str | None = None,
                 ) -> Explanation:
    """The explanation of a lowering with its traffic (per group by index, and in all)."""
    groups = tuple(
        GroupPath(kernel=_KERNELS[g.plan.kernel], device=g.device, dtype=g.dtype,
                  leaves=tuple(paths[i] for i in g.leaves), clip=g.plan.clip is not None,
                  weight_decay=g.plan.decay is not None,
                  skip_if_nonfinite=g.plan.guard is not None,
                  rules=tuple(op.kind for op in g.plan.ops),
                  bytes_read=traffic[k].read if k in traffic else None,
                  bytes_written=traffic[k].written if k in traffic else None)
        for k, g in enumerate(lowered.groups))
    elements = sum(local_tensor(g).numel() for g in grad_leaves if g is not None)
    return Explanation(fast=lowered.fast, reason=lowered.reason, groups=groups,
                       bytes_read=None if isinstance(total, str) else total.read,
                       bytes_written=None if isinstance(total, str) else total.written,
                       elements=elements,
                       traffic_reason=total if isinstance(total, str) else None,
                       clips=len(structure.clips), guards=len(structure.guards),
                       tree_sums=len({op.node for g in lowered.groups
                                      if g.plan.kernel == "compiled"
                                      for op in g.plan.ops if op.sums is not None}),
                       mini_steps=mini_steps)


def mixed_explanation(lowered: _planned.Lowered, structure: _programs.Structure,
                      treespec: Any, params: list[Any], stores: list[Any], views: list[Any],
                      grads: list[Any], inner_leaves: list[Any], *, multiplied: bool,
                      count_zeros: bool, donate: bool) -> Explanation:
    """The explanation of a mixed-precision step lowered by the planner
    (``MixedPrecisionTransformation.explain``), its traffic the whole step's."""
    paths = _core.paths(treespec)
    if not lowered.fast:
        return _explanation(lowered, structure, paths, grads, {},
                            "the pure mixed-precision path is not counted")
    traffic, total = _traffic.mixed_traffic(
        lowered, params, views, grads, inner_leaves, multiplied=multiplied,
        count_zeros=count_zeros, donate=donate, stores=stores, treespec=treespec)
    return _explanation(lowered, structure, paths, grads, traffic, total)


def _step_traffic(tx: GradientTransformation, params: Any, state: Any,
                  lowered: _planned.Lowered, structure: _programs.Structure, leaves: list[Any],
                  grad_leaves: list[Any], state_leaves: list[Any], treespec: Any, *,
                  donate: bool, donate_grads: bool,
                  ) -> tuple[dict[int, _traffic.Traffic], _traffic.Traffic | str]:
    """The traffic of each kernel or compiled group (by its index) and of the whole step,
    or why the step's could not be counted (see ``functopt/fast/_traffic.py``)."""
    if not lowered.fast:
        return {}, _traffic.pure_traffic(tx, params, state, grad_leaves, donate=donate)
    traffic: dict[int, _traffic.Traffic] = {}
    total = _traffic.pass_traffic(structure, grad_leaves)
    perleaf = []
    for k, g in enumerate(lowered.groups):
        if g.plan.kernel == "perleaf":
            perleaf.append((g, g.plan.clip is not None))
            continue
        traffic[k] = _traffic.group_traffic(
            g, leaves, grad_leaves, state_leaves, scaled=g.plan.clip is not None,
            donate=donate, donate_grads=donate_grads)
        total = total + traffic[k]
    if not perleaf:
        return traffic, total
    eager = _traffic.perleaf_traffic(perleaf, leaves, grad_leaves, state_leaves, treespec,
                                     donate=donate)
    return traffic, eager if isinstance(eager, str) else total + eager
