"""A planned step: its leaves grouped by kernel (`lower`), then run (`run`): the values
the kernels take resolved (`_Steady` keeps them between steps), the clips' factors, the
guards' and counters' new values, the groups' calls, and what a skipped step keeps."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from functopt._collective import stats
from functopt._collective.dtensor import _infer_group, is_dtensor
from functopt.fast import _compiled, _perleaf
from functopt.fast._kernels import (
    _PLAIN,
    Group,
    _hyperparameters,
    _KernelPlan,
    _layout_problem,
    _match_compiled,
    _matches,
    _run_group,
)
from functopt.fast._programs import Structure, _Env
from functopt.transforms import _common
from functopt.tree import _core, _ops

__all__ = ["Lowered", "Result", "found_nan", "local_tree_sums", "lower", "run", "zero_nans"]

_Resolved = list[tuple[Group, dict[str, Any]]]  # per group with a kernel: its arguments


@dataclass
class Lowered:
    """A step lowered for these leaves: the groups, or why it stays pure."""

    structure: Structure
    state_spec: _core.TreeSpec
    groups: list[Group]
    reason: str | None  # None: every leaf with a gradient is in a group
    # what the last step resolved, kept while the tensors it read are unchanged (`run`)
    steady: _Steady | None = None

    @property
    def fast(self) -> bool:
        return self.reason is None

    @functools.cached_property
    def kernels_only(self) -> bool:
        """Every group runs a fused kernel (or nothing) and no rule reads a count while the
        step runs: no guard, no tree sums, no per-leaf or compiled rule."""
        structure = self.structure
        return not (structure.guards or structure.tree_wide or structure.perleaf) and all(
            g.plan.kernel in ("adamw", "adam", "sgd", "zero") for g in self.groups)


@dataclass(frozen=True, eq=False)
class _Steady:
    """The kernels' arguments a step resolved (Python numbers only: no tensor is kept) and
    the clips' bounds, with what they were read from: the injected hyperparameters' state
    leaves and every other tensor read on the host (weakly held, with their version
    counters). A later step whose hyperparameter leaves are those very tensors, and whose
    tensors read are unmodified, resolves the same numbers, so it takes them: no
    ``values_at``, no host reads. A step whose values depend on anything else (a schedule
    of the count, a rule rebuilt from the values, SGD's first-step flag) is never kept, nor
    one whose ``values_at`` made new tensors (the next state's hyperparameter leaves must be
    the old ones)."""

    hyper: list[int]  # the flat state indices of the injected hyperparameters
    refs: list[tuple[Any, int]]  # per index of ``hyper``: (weakref, version)
    reads: list[tuple[Any, int]]  # the other tensors read: (weakref, version)
    resolved: _Resolved
    bounds: list[Any]

    @classmethod
    def of(cls, structure: Structure, env: _Env, state_leaves: list[Any],
           resolved: _Resolved, bounds: list[Any]) -> _Steady | None:
        if env.volatile or not all(_plain_number(v) for _, hp in resolved
                                   for v in hp.values()) or not all(map(_plain_number, bounds)):
            return None
        hyper: list[int] = []
        for inj, values in zip(structure.injections, env.hyper, strict=True):
            if len(inj.constants) != len(inj.hyper):
                return None  # a schedule: a value of the count
            for k, i in inj.hyper.items():
                if values[k] is not state_leaves[i]:
                    return None  # values_at made a new tensor: the state moves
                hyper.append(i)
        if any(type(state_leaves[i]) not in _PLAIN for i in hyper):
            return None
        held = {id(state_leaves[i]) for i in hyper}
        others = {id(t): t for t in env.log if id(t) not in held}
        if any(type(t) not in _PLAIN for t in others.values()):
            return None
        return cls(hyper, [(weakref.ref(state_leaves[i]), state_leaves[i]._version)
                           for i in hyper],
                   [(weakref.ref(t), t._version) for t in others.values()], resolved, bounds)

    def holds(self, state_leaves: list[Any]) -> bool:
        """Whether these hyperparameter leaves, and the other tensors read, are the ones
        this was resolved from, unmodified."""
        for i, (ref, version) in zip(self.hyper, self.refs, strict=True):
            x = state_leaves[i]
            if x is not ref() or x._version != version:
                return False
        for ref, version in self.reads:
            x = ref()
            if x is None or x._version != version:
                return False
        return True


def _plain_number(value: Any) -> bool:
    return type(value) in (float, int, bool)


def lower(structure: Structure, state_spec: _core.TreeSpec, values: list[Any],
          grads: list[Any], state_leaves: list[Any], name: Callable[[int], str], *,
          compiled: bool = False, compiled_first: bool = False) -> Lowered:
    """Group the leaves with a gradient by kernel, or say why this step stays pure.
    ``compiled``: programs without a kernel take the compiled tier where they can
    (``compiled_first``: every program it takes, as `_kernels.match`)."""
    if structure.opaque:
        return Lowered(structure, state_spec, [], structure.opaque[0])
    groups: dict[tuple[Any, ...], Group] = {}
    field = ("matched_compiled_first" if compiled_first else "matched_compiled") if (
        compiled) else "matched"
    matched = getattr(structure, field)
    if matched is None:
        matched = _matches(structure.programs, compiled, structure.perleaf, compiled_first)
        setattr(structure, field, matched)
    for i, (v, g) in enumerate(zip(values, grads, strict=True)):
        if v is None or g is None:
            continue
        plan, plan_key = matched[i]
        if isinstance(plan, str):
            if not compiled and isinstance(_match_compiled(structure.programs[i]), _KernelPlan):
                plan += " (make_step(tx, compile=True) compiles it)"
            return Lowered(structure, state_spec, [], f"leaf {name(i)!r}: {plan}")
        problem = _layout_problem(plan, v, state_leaves)
        if problem is not None and compiled and plan.kernel not in ("compiled", "perleaf"):
            # (a kernel refusing these tensors, moments in another dtype, say: the
            # compiled tier where it takes them)
            alternative = _match_compiled(structure.programs[i])
            if isinstance(alternative, _KernelPlan) and _layout_problem(
                    alternative, v, state_leaves) is None:
                plan, plan_key, problem = alternative, alternative.key(), None
        if problem is not None:
            return Lowered(structure, state_spec, [], f"leaf {name(i)!r}: {problem}")
        key = (v.device, v.dtype, plan_key)
        if key not in groups:
            groups[key] = Group(plan, v.device, v.dtype, [], [])
        groups[key].leaves.append(i)
        groups[key].plans.append(plan)
    if structure.shared:
        # such a rule's shared state (NAdam's mu_product) moves in its groups' calls, which
        # need a leaf with elements (by the DTensors' global sizes: a rank whose shards of
        # a group are all empty moves it in a call over no elements, and every rank
        # decides alike)
        moved = {op.node for g in groups.values() if (g.plan.kernel == "compiled"
                 and any(values[i].numel() for i in g.leaves))
                 or g.plan.kernel == "perleaf" for op in g.plan.ops}
        if structure.shared - moved:
            return Lowered(structure, state_spec, [],
                           "a rule with shared state has no leaf with a gradient and elements")
    return Lowered(structure, state_spec, list(groups.values()), None)


@dataclass
class Result:
    values: list[Any]
    leaves: list[Any]  # the new state's leaves, of the treespec ``spec``
    spec: _core.TreeSpec
    # per leaf, the low-precision param the compiled tier wrote (``run``'s ``low``), or None
    low: list[Any] | None = None

    @property
    def state(self) -> Any:
        return _core.unflatten(self.spec, self.leaves)


def zero_nans(structure: Structure, grads: list[Any],
              ) -> tuple[list[Any], list[tuple[int, Any, bool]]]:
    """The gradients after the chain's leading ``zero_nans`` (in chain order; new tensors
    where one applies, the others as given) and their flags: ``(flat state index, this
    process's flag, whether the leaf is a DTensor)``, the DTensor ones still to be OR-ed
    over the mesh (see ``found_nan``)."""
    if not structure.zero_nans:
        return grads, []
    grads = list(grads)
    flags: list[tuple[int, Any, bool]] = []
    for zeroing in structure.zero_nans:
        for i, k in zeroing.flags:
            g = grads[i]
            if g is not None:
                grads[i], flag = zeroing.zeroed(g)
                flags.append((k, flag, is_dtensor(g)))
    return grads, flags


def found_nan(flags: list[tuple[int, Any, bool]], reduced: list[torch.Tensor],
              state_leaves: list[Any]) -> list[tuple[int, torch.Tensor]]:
    """The new ``found_nan`` entries: a plain leaf's flag as computed, a DTensor leaf's
    from ``reduced`` (its flags summed over the mesh, in order), on its old flag's device:
    the pure ``zero_nans``' values."""
    out, sharded = [], iter(reduced)
    for k, flag, on_mesh in flags:
        if on_mesh:
            old = state_leaves[k]
            flag = next(sharded) > 0
            if isinstance(old, torch.Tensor):
                flag = flag.to(old.device)
        out.append((k, flag))
    return out


def _clip_multiplier(sumsq: torch.Tensor, max_norm: Any, acc: torch.dtype) -> torch.Tensor:
    """clip_by_global_norm's factor from a (global) sum of squares, in the norm's dtype (in
    float64 for a norm beyond the norm dtype's range, as the pure path scales then)."""
    wide = torch.sqrt(sumsq)
    norm = wide.to(acc)
    bound = _ops._scalar(max_norm, acc, norm.device)
    factor = torch.where(norm < bound, torch.ones_like(norm),
                         bound / torch.clamp(norm, min=bound)).to(torch.float64)
    if acc != torch.float64:
        bound64 = _ops._scalar(max_norm, torch.float64, norm.device)
        factor = torch.where(torch.isinf(norm) & torch.isfinite(wide),
                             bound64 / torch.clamp(wide, min=bound64), factor)
    return torch.where(torch.isfinite(wide), factor, torch.nan)


def run(lowered: Lowered, values: list[Any], grads: list[Any], state_leaves: list[Any], *,
        donate: bool, donate_grads: bool = False, multiplier: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None, sums: list[torch.Tensor] | None = None,
        finite: list[torch.Tensor] | None = None,
        reads: dict[int, Any] | None = None,
        workspace: dict[Any, Any] | None = None,
        low: list[Any] | None = None,
        nans: list[tuple[int, torch.Tensor]] | None = None,
        totals: dict[int, Any] | None = None,
        checked: bool = False) -> Result | str:
    """One step on the kernels. ``multiplier`` (a 0-d float64 tensor) multiplies the
    gradients before the chain (a mixed step's unscale and clip); ``sums`` are the
    clips' global sums of squares of the multiplied gradients; ``finite`` the guards'
    (``apply_if_finite``) global verdicts on the gradients they check; ``found_inf``
    skips the whole step: values, moments and every counter keep their values (as a
    skipped mixed step restores the inner state whole).

    ``workspace``: scratch buffers the compiled tier may reuse for its gathered copies,
    and the kernels for the copies of gradients they scale (`_staged`), kept by a donating
    caller per thread; or None. ``low``: per leaf, the low-precision
    param of a mixed step (or None): a compiled group whose leaves all have one writes
    each its new value rounded (in place when donated), returned in ``Result.low`` (None
    where the caller must still write it).

    Returns the reason instead when a hyperparameter read at run time has no fused form
    (an injected ``eps_root`` that is not 0, say), before any tensor was written: the
    caller takes the pure path. ``nans``: the ``found_nan`` flags of the chain's leading
    ``zero_nans`` (see `zero_nans`, `found_nan`), whose gradients ``grads`` already are;
    a chain with one and no flags (the mixed step's) takes the pure path. ``totals``: the
    tree sums of the chain's rules that have them, over every leaf and rank, where the
    caller summed them over the ranks with its own values (`local_tree_sums`); None: they
    are computed here.

    ``checked``: the caller found every value, gradient and per-leaf state entry a plain
    tensor (no DTensor or other subclass), each gradient with its value's shape and strides
    (``make_step``'s `_Seen.match`): the kernels then take them as they are, without
    the per-leaf unwrapping and layout checks.
    """
    structure = lowered.structure
    refused = _unfit(structure, nans, sums, finite)
    if refused is not None:
        return refused
    found = _resolve(lowered, state_leaves, reads)
    if isinstance(found, str):
        return found
    env, resolved, bounds = found
    new_values = list(values)
    new_leaves = list(state_leaves)
    new_low: list[Any] | None = None if low is None else [None] * len(low)
    clip_factors = _clip_factors(structure, sums or [], bounds, values)
    skipped = None if found_inf is None else found_inf != 0
    applied = _guards(structure, state_leaves, new_leaves, finite or [], skipped) if (
        structure.guards) else []
    # (a recorded step advances them on their device: a replay does not run Python)
    in_place = donate and skipped is None and low is None and multiplier is None and (
        lowered.kernels_only) and not _ops._recording()
    advanced, hosted, owned = _advance(structure.counter_indices, state_leaves, in_place)
    prepared, perleaf = _scaled(resolved, multiplier, clip_factors, skipped, applied)
    if totals is None and structure.tree_wide:
        totals = _tree_totals(structure, prepared, values, grads, state_leaves)
    for group, hp, scale, flag in prepared:
        _run_group(group, hp, values, grads, state_leaves, new_values, new_leaves,
                   donate=donate, donate_grads=donate_grads, scale=scale, found_inf=flag,
                   advanced=advanced, hosted=hosted, compiled=structure.compiled,
                   workspace=workspace,
                   totals=totals, low=low, new_low=new_low, checked=checked)
    if perleaf:
        _perleaf.run_groups(perleaf, values, grads, state_leaves, new_values, new_leaves,
                            treespec=structure.treespec, donate=donate, env=env)
    for c in owned:  # (new_leaves holds them)
        state_leaves[c].fill_(hosted[c])
    _moved(structure, state_leaves, new_leaves, advanced, env, skipped, applied)
    for index, flag in nans or ():
        new_leaves[index] = flag
    return Result(new_values, new_leaves, lowered.state_spec, new_low)


def _unfit(structure: Structure, nans: Any, sums: list[torch.Tensor] | None,
           finite: list[torch.Tensor] | None) -> str | None:
    """Why `run` cannot take this step (the pure path then does), or None; raises for
    reductions that do not fit the structure."""
    if structure.zero_nans and nans is None:
        return ("zero_nans inside the mixed-precision step has no fast form (the step "
                "skips a nan gradient itself)")
    if structure.clips and (sums is None or len(sums) != len(structure.clips)):
        raise ValueError("the planner's run needs one sum of squares per clip")
    if structure.guards and (finite is None or len(finite) != len(structure.guards)):
        raise ValueError("the planner's run needs one finiteness flag per guard")
    return None


def _resolve(lowered: Lowered, state_leaves: list[Any], reads: dict[int, Any] | None,
             ) -> tuple[_Env | None, _Resolved, list[Any]] | str:
    """This step's values: the environment they were read in (None: the last step's were
    taken, see `_Steady`), the kernels' arguments per group and the clips' bounds; or the
    reason a value read now has no fused form, before any tensor is written."""
    steady = lowered.steady
    if steady is not None and steady.holds(state_leaves) and not _ops._recording():
        # (a recorded step resolves its values again: what a steady step took as a Python
        # number, such as a learning rate in a CPU tensor, a replay must read as a tensor)
        return None, steady.resolved, steady.bounds
    structure = lowered.structure
    env = _Env(state_leaves, []) if reads is None else _Env(state_leaves, [], reads)
    env.resolve(structure.injections)
    bounds = [bound(env) for bound in structure.clip_bounds]
    # every value read at run time first, so that a refusal comes before any write
    resolved = []
    for group in lowered.groups:
        if group.plan.kernel == "zero":
            continue
        hp = _hyperparameters(group.plan, env)
        if isinstance(hp, str):
            return hp
        resolved.append((group, hp))
    lowered.steady = _Steady.of(structure, env, state_leaves, resolved, bounds)
    return env, resolved, bounds


def _clip_factors(structure: Structure, sums: list[torch.Tensor], bounds: list[Any],
                  values: list[Any]) -> list[torch.Tensor]:
    """Each clip's factor, its norm in global_norm's dtype over the leaves it measures:
    float64 if one of them is float64 (computed only for chains that clip)."""
    return [
        _clip_multiplier(s, bound, torch.float64 if any(
            values[i] is not None and values[i].dtype == torch.float64 for i in leaves)
            else torch.float32)
        for s, bound, leaves in zip(sums, bounds, structure.clips, strict=True)]


def _advance(counters: list[int], state_leaves: list[Any], in_place: bool,
             ) -> tuple[dict[int, torch.Tensor], dict[int, int], list[int]]:
    """The counters' new values: by flat index, the new tensors, the new values of those
    kept on the host, and the host counters advanced where they are (``in_place``).

    A donated step of the kernels alone advances its host counters where they are, as
    torch.optim advances its steps: each is written its new value (so a tensor held in
    two counters' places is written the same value twice) after the kernels, which take
    the host values. Any other step (one that may skip, a compiled or per-leaf rule that
    reads its count, the mixed step's) makes new counters.

    A plain 0-d CPU counter is advanced on the host (no kernel launches: a small model's
    step pays for every one; this path never runs under torch.func), except in a recorded
    step (`_ops._recording`), which advances it on its device: a replay runs no Python."""
    advanced: dict[int, torch.Tensor] = {}
    hosted: dict[int, int] = {}
    owned: list[int] = []
    on_host = not _ops._recording()
    for c in counters:
        count = state_leaves[c]
        if on_host and type(count) is torch.Tensor and count.is_cpu and count.dim() == 0:
            n = int(count)
            n = hosted[c] = n + 1 if n < _common.INT32_MAX else n  # (safe_increment)
            if in_place and count._base is None:
                owned.append(c)
            else:
                advanced[c] = torch.scalar_tensor(n, dtype=count.dtype)
        else:
            advanced[c] = _common.safe_increment(count)
    return advanced, hosted, owned


def _scaled(resolved: _Resolved, multiplier: torch.Tensor | None,
            clip_factors: list[torch.Tensor], skipped: torch.Tensor | None,
            applied: list[torch.Tensor]) -> tuple[list[Any], list[Any]]:
    """Per group, its arguments with the scale of its gradients (the multiplier, times its
    clip's factor) and its skip flag (the step's, or its guard's): the groups of the
    kernels and the compiled tier, then those of the per-leaf tier (run together,
    rule-major)."""
    perleaf: list[tuple[Group, torch.Tensor | None, torch.Tensor | None]] = []
    prepared = []
    for group, hp in resolved:
        plan = group.plan
        scale = multiplier
        if plan.clip is not None:
            factor = clip_factors[plan.clip.index].to(torch.float64)
            scale = factor if scale is None else scale * factor
        flag = skipped if plan.guard is None else _or(skipped, ~applied[plan.guard.index])
        if plan.kernel == "perleaf":
            perleaf.append((group, scale, flag))
        else:
            prepared.append((group, hp, scale, flag))
    return prepared, perleaf


def _moved(structure: Structure, state_leaves: list[Any], new_leaves: list[Any],
           advanced: dict[int, torch.Tensor], env: _Env | None,
           skipped: torch.Tensor | None, applied: list[torch.Tensor]) -> None:
    """The new counters and injected hyperparameters in ``new_leaves``, the old ones where
    a skipped step (found_inf, or a guard that skipped) leaves them as they were."""
    if skipped is None and not structure.guards:
        for c, new in advanced.items():
            new_leaves[c] = new
    else:
        for c, new in advanced.items():
            keep = _keep(skipped, applied, structure.counter_guard.get(c))
            new_leaves[c] = new if keep is None else torch.where(
                keep.to(new.device), state_leaves[c], new)
    # (a steady step's hyperparameter leaves are the old ones, which new_leaves holds)
    for inj, hyper in zip(structure.injections, [] if env is None else env.hyper,
                          strict=env is not None):
        keep = _keep(skipped, applied, inj.guard)
        for k, i in inj.hyper.items():
            old, value = state_leaves[i], hyper[k]
            new_leaves[i] = value if keep is None or value is old else torch.where(
                keep.to(old.device), old, value.to(old.dtype))


def _tree_totals(structure: Structure, prepared: list[Any], values: list[Any],
                 grads: list[Any], state_leaves: list[Any]) -> dict[int, Any]:
    """The tree sums of every rule that has them (Prodigy's, ...), over all its leaves: one
    compiled sums pass per group (each with its clip's scale), added over the groups, and
    on DTensor params over the ranks with one all-reduce of them all, packed (a replicated
    shard counts on one rank)."""
    totals = local_tree_sums(structure, [(group, scale) for group, _, scale, _ in prepared],
                             values, grads, state_leaves)
    group = _infer_group(values, _leaf_number)
    if group is not None and totals:
        totals = stats.unpack_sums(totals, stats.all_reduce_parts(stats.pack_sums(totals), group))
    return totals


def _leaf_number(i: int) -> str:
    return f"leaf {i}"  # (words only the errors of inconsistent meshes)


def local_tree_sums(structure: Structure, groups: list[tuple[Group, torch.Tensor | None]],
                    values: list[Any], grads: list[Any], state_leaves: list[Any],
                    ) -> dict[int, Any]:
    """This process's tree sums of every rule that has them, by rule: one compiled sums
    pass per compiled group among ``groups`` (each with its scale: its clip's factor, or
    None), added over the groups."""
    counted = stats.counted_leaves(grads, _leaf_number)
    parts: dict[int, list[Any]] = {node: [] for node in structure.tree_wide}
    for group, scale in groups:
        op = next((op for op in group.plan.ops if op.sums is not None), None)
        if group.plan.kernel == "compiled" and op is not None:
            parts[op.node].append(_compiled.group_sums(
                group, values, grads, state_leaves, counted, scale=scale,
                compiled=structure.compiled))
    return {node: tuple(functools.reduce(torch.add, column)
                        for column in zip(*found, strict=True))
            for node, found in parts.items() if found}


def _or(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else a | b.to(a.device)


def _keep(skipped: torch.Tensor | None, applied: list[torch.Tensor],
          guard: int | None) -> torch.Tensor | None:
    """Where a state entry keeps its old value: the step was skipped, or its guard was."""
    if guard is None:
        return skipped
    return _or(skipped, ~applied[guard])


def _guards(structure: Structure, old: list[Any], new: list[Any],
            finite: list[torch.Tensor], skipped: torch.Tensor | None) -> list[torch.Tensor]:
    """``apply_if_finite``'s counters, as its update moves them; returns per guard whether
    its step is applied. A skipped (mixed) step leaves them as they were."""
    applied = []
    for g, ok in zip(structure.guards, finite, strict=True):
        count, total = old[g.notfinite_count], old[g.total_notfinite]
        ok = ok.to(count.device)
        new_count = torch.where(ok, torch.zeros_like(count), _common.safe_increment(count))
        new_total = torch.where(ok, total, _common.safe_increment(total))
        applied.append(ok | (new_count > g.max_consecutive_errors))
        for k, value in ((g.notfinite_count, new_count), (g.last_finite, ok),
                         (g.total_notfinite, new_total)):
            new[k] = value if skipped is None else torch.where(
                skipped.to(value.device), old[k], value.to(old[k].dtype))
    return applied

