r"""The planner's per-leaf tier: rules that reduce within a leaf, groups at a time.

Some rules are not elementwise: Muon orthogonalises each matrix by Newton-Schulz
iterations, a trust ratio divides a leaf by its own norm, a shape factor depends on the
leaf's dimensions, Adafactor keeps row and column means of each matrix's squared
gradients, block RMS clipping divides a leaf by its own rms, gradient centralization
subtracts each output unit's mean, adaptive gradient clipping scales each unit against
its param's norm. Their spec is a [`PerLeaf`][functopt._spec.PerLeaf]: neither PyTorch's
kernels nor the compiled tier (which lays leaves end to end) can take them. Here the
groups of leaves (one device, one dtype, one program after an optional leading clip or
``apply_if_finite``) run their programs' rules in order, rule-major: at each position, the
groups whose rule is the same transform call it once, on all their leaves together (a
decay mask that splits Muon's matrices into two groups still batches them, and on shards
still makes one pair of all-to-alls):

- a ``PerLeaf`` rule runs its ``grouped`` update when it has one (Muon's: the momentum
  with ``torch._foreach_*`` ops over the group, then the Newton-Schulz iteration over
  same-shape matrices stacked into batches of matrix products, at most 256 KiB each on
  the CPU, where larger batches leave the cache; Adafactor's: foreach
  ops over the unfactored leaves, the factored ones stacked by shape and layout; the trust
  ratio's and block RMS clipping's: their norms in ``torch._foreach_norm`` calls), else
  its own ``update``;
- an elementwise rule after it (the shape factor, decay, the learning rate) runs its own
  ``update``, on the group's leaves together;
- the updates are added to the values with one ``foreach`` add (in place when donated).

Each rule is called on the params' tree with ``None`` at the leaves outside its groups, so
it sees the paths, masks and dimension numbers the pure path gives it; its per-leaf state
entries for those leaves and its shared state (not its count: the planner advances
every count once per step) are taken from its new state. A transform that has a
``PerLeaf`` rule also hosts here the programs of its other leaves that no kernel (or,
with ``compile=True``, no compiled group) covers, such as Muon's Adam leaves with
``nesterov=True``: they run their rules' own updates, a group at a time.

The arithmetic is the pure path's. Where a grouped update batches matrix products, the
batched product may round differently than one product per matrix (the conformance law's
float32 tolerance is a few ulps; float64 to 1e-12); the measured differences are in
docs/performance.md.

DTensor shards are taken: the rules run on them as on the pure path (sharded Muon's
grouped update sends each matrix to its owner rank and back, two all-to-alls per call),
and the apply adds the local shards. A rule inside ``inject_hyperparams`` runs the update
(and ``grouped`` update) of the inner transform built from the step's hyperparameters, as
the pure ``inject_hyperparams`` builds it (one nested in another: the inner transform of
the one built from the outer's values, built from its own). Not taken (the reason goes to
``explain`` and the ``FastPathWarning``): a clip or guard after the rules, a per-leaf state
entry that is not a tensor on its leaf's device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from functopt._collective.dtensor import _rewrap_like, is_dtensor, local_tensor
from functopt.transforms import _common
from functopt.tree import _core

__all__ = ["layout_problem", "match", "run_groups"]

_LEADING = ("apply_if_finite", "clip_by_global_norm")


def match(program: list[Any], plan: Any) -> Any:
    """The per-leaf tier's plan (a ``plan("perleaf", clip, guard=..., ops=...)``) for one
    leaf's program, or the reason it has none."""
    ops = [op for op in program if op.kind != "identity"]
    guard = ops.pop(0) if ops and ops[0].kind == "apply_if_finite" else None
    clip = ops.pop(0) if ops and ops[0].kind == "clip_by_global_norm" else None
    for op in ops:
        if op.kind in _LEADING:
            return f"the per-leaf tier takes {op.kind} only before the rules, not after them"
        if op.kind == "set_to_zero":
            return "the per-leaf tier has no set_to_zero after other rules"
        if op.fn is None or op.state_at is None:
            return f"the per-leaf tier has no lowering of {op.kind}"
        if op.injected and op.rebuild is None:
            return (f"the per-leaf tier does not find {op.kind} again in the injected "
                    f"transform built from a step's values")
    if not ops:
        return "no update rule"
    return plan("perleaf", clip, guard=guard, ops=tuple(ops))


def layout_problem(plan: Any, value: Any, state_leaves: list[Any]) -> str | None:
    """Why a leaf cannot join a per-leaf group, or None: any layout is fine (the rules' own
    updates read it, DTensor shards included), but each per-leaf state entry must be a
    tensor on the leaf's device."""
    device = local_tensor(value).device
    for op in plan.ops:
        for slot, k in op.slots.items():
            s = state_leaves[k]
            if not isinstance(s, torch.Tensor):
                return f"its {op.kind} state.{slot} is {_core._describe(s)}"
            if local_tensor(s).device != device:
                return (f"its {op.kind} state.{slot} is on {local_tensor(s).device}, the "
                        f"param on {device}")
    return None


def _where(skip: torch.Tensor, old: Any, new: Any) -> Any:
    """``old`` where the step is skipped, else ``new`` (on local shards for DTensors).

    A rule may return a state entry placed otherwise than it came (Adafactor's row means of
    a ``Shard(0)`` matrix start ``Replicate`` and come back ``Shard(0)``, on the pure path
    too): the old entry is then redistributed to the new placement first (the same values;
    a skipped step keeps them placed as a taken step would)."""
    if (is_dtensor(old) and is_dtensor(new) and (
            old.placements != new.placements or old.device_mesh != new.device_mesh)):
        old = old.redistribute(new.device_mesh, new.placements)
    local = local_tensor(new)
    return _rewrap_like(new, torch.where(skip.to(local.device), local_tensor(old), local))


def _placed(leaf_plan: Any, value: Any, state_leaves: list[Any]) -> Any:
    """What a leaf's value and gradient are placed like: the value, or the first of its
    per-leaf state entries that is a DTensor when the value is a local shard."""
    if is_dtensor(value):
        return value
    for op in leaf_plan.ops:
        for k in op.slots.values():
            if is_dtensor(state_leaves[k]):
                return state_leaves[k]
    return value


def _tree(treespec: _core.TreeSpec, leaves: dict[int, Any]) -> Any:
    return _core.unflatten(treespec, [leaves.get(i) for i in range(treespec.num_leaves)])


@dataclass
class _Run:
    """One group in flight: its leaves' current updates and its skip flag."""

    group: Any
    updates: list[Any]
    skip: torch.Tensor | None


def run_groups(batch: list[tuple[Any, torch.Tensor | None, torch.Tensor | None]],
               values: list[Any], grads: list[Any], state_leaves: list[Any],
               new_values: list[Any], new_leaves: list[Any], *, treespec: _core.TreeSpec,
               donate: bool, env: Any) -> None:
    """One step of the per-leaf groups in ``batch`` (each with its gradient multiplier and
    skip flag, see the module docstring): writes the new values into ``new_values`` (into
    the values themselves when donated) and the rules' new state entries into
    ``new_leaves``.

    The rules run rule-major: at each position of the programs, the groups whose rule
    there is the same transform (and under the same ``apply_if_finite``) call it once
    together, so that a decay mask that splits Muon's matrices into two groups still
    batches them in one iteration and, on shards, one pair of all-to-alls."""
    runs: list[_Run] = []
    placed: dict[int, Any] = {}  # leaf -> its value, placed like its state
    for group, scale, found_inf in batch:
        # (a mixed step hands over its masters' and gradients' local shards, with the
        # state sharded: the rules see them placed like their state, as on the pure path)
        likes = [_placed(leaf_plan, values[i], state_leaves)
                 for leaf_plan, i in zip(group.plans, group.leaves, strict=True)]
        us = [_rewrap_like(like, local_tensor(grads[i]))
              for like, i in zip(likes, group.leaves, strict=True)]
        if scale is not None:  # a folded clip or a mixed step's unscale, as a clip scales
            us = [_rewrap_like(u, _common.scaled(local_tensor(u), scale)) for u in us]
        for like, i in zip(likes, group.leaves, strict=True):
            placed[i] = _rewrap_like(like, local_tensor(values[i]))
        skip = None if found_inf is None else found_inf.to(device=group.device,
                                                           dtype=torch.bool)
        runs.append(_Run(group, us, skip))
    for j in range(max(len(r.group.plan.ops) for r in runs)):
        together: dict[Any, list[_Run]] = {}
        for r in runs:
            if j < len(r.group.plan.ops):
                guard = r.group.plan.guard
                together.setdefault((r.group.plan.ops[j].node,
                                     None if guard is None else guard.index), []).append(r)
        for members in together.values():
            _call(members, j, placed, state_leaves, new_leaves, treespec, env)
    for r in runs:
        _apply(r, values, new_values, donate)


def _call(members: list[_Run], j: int, placed: dict[int, Any], state_leaves: list[Any],
          new_leaves: list[Any], treespec: _core.TreeSpec, env: Any) -> None:
    """The ``j``-th rule of the groups ``members`` (one transform), called once on all
    their leaves; their updates become its output. A rule inside ``inject_hyperparams``
    is taken from the inner transform built with this step's values (``env.spec_of``), as
    the pure ``inject_hyperparams`` builds it."""
    op = members[0].group.plan.ops[j]
    if op.rebuild is not None:
        spec = env.spec_of(op.rebuild)
        op = dataclasses.replace(op, fn=spec.update, grouped=getattr(spec, "grouped", None))
    skip = members[0].skip
    leaves = {i: u for r in members for i, u in zip(r.group.leaves, r.updates, strict=True)}
    index_leaves, index_spec = _core.flatten(op.state_at)
    state = _core.unflatten(index_spec, [state_leaves[k] for k in index_leaves])
    update = op.grouped if op.grouped is not None else op.fn
    out, new = update(_tree(treespec, leaves), state,
                      _tree(treespec, {i: placed[i] for i in leaves}))
    flat = treespec.flatten_up_to(out)
    written: list[tuple[int, Any]] = []
    for r in members:
        r.updates = [flat[i] for i in r.group.leaves]
        for name in op.slots:
            entries = treespec.flatten_up_to(getattr(new, name))
            written.extend((leaf_plan.ops[j].slots[name], entries[i])
                           for leaf_plan, i in zip(r.group.plans, r.group.leaves,
                                                   strict=True))
    for name in type(op.state_at)._fields:
        if name in op.slots:
            continue
        keys = _core.flatten(getattr(op.state_at, name))[0]
        news = _core.flatten(getattr(new, name))[0]
        written.extend((k, v) for k, v in zip(keys, news, strict=True) if k != op.count)
    for k, v in written:
        new_leaves[k] = v if skip is None or not isinstance(v, torch.Tensor) else (
            _where(skip, state_leaves[k], v))


def _apply(r: _Run, values: list[Any], new_values: list[Any], donate: bool) -> None:
    """The group's updates added to its values: one ``foreach`` add (in place when
    donated), the old values kept where the step is skipped."""
    idx, skip = r.group.leaves, r.skip
    ps = [local_tensor(values[i]) for i in idx]
    us = [local_tensor(u) for u in r.updates]
    if donate and skip is None:
        torch._foreach_add_(ps, us)  # the pure path's grouped apply, in place
        return
    stepped = list(torch._foreach_add(ps, us))
    if skip is not None:
        stepped = [torch.where(skip, p, x) for p, x in zip(ps, stepped, strict=True)]
    if donate:
        torch._foreach_copy_(ps, stepped)
        return
    for i, x in zip(idx, stepped, strict=True):
        new_values[i] = _rewrap_like(values[i], x)
