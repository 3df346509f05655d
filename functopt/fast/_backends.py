r"""The engine's backends: who runs each run of rules of a step's program.

The executor (``functopt/fast/_execute.py``) cuts a program (``functopt/fast/_program.py``)
into *segments* (``functopt/fast/_segments.py``): a run of consecutive `Map` ops, with the
leaves they select and the state they hold. At the first `Map` of a segment it offers the
segment to its backends in order; each accepts it (and then runs all of it) or gives the
reason it does not:

- ``"kernel"``: PyTorch's fused kernels (``torch._fused_adamw_``, ``torch._fused_adam_``,
  ``torch._fused_sgd_``) for the leaves whose rules in the segment are Adam with decoupled
  or L2 decay, or SGD (with a trace, dampened or not, and a decay), ending in a learning
  rate, and for ``set_to_zero`` (nothing to write). The matching and the calls are the
  planner's (the walk's rule bindings, ``functopt/fast/_walk.py``; ``_matches``,
  ``_layout_problem``, ``_hyperparameters`` and ``_run_group``,
  ``functopt/fast/_kernels.py``), so a leaf takes the kernel call the planner's fast path
  makes for it, bitwise.
- ``"foreach"``: torch.optim's foreach implementations of the optimizers with no fused
  kernel (RMSprop, Adamax, NAdam, RAdam, Adadelta, Rprop, Adagrad), for the leaves whose
  rules are the ``functopt.optim`` chain of one of them, where the function computes them
  as the rules do (``functopt/fast/_foreach.py`` says what each row takes).
- ``"perleaf"``: a segment holding a rule that reduces within a leaf (a ``PerLeaf`` spec:
  Muon's Newton-Schulz iteration, Adafactor's factored moments, a trust ratio), which
  neither the kernels nor a foreach implementation computes: its rules' own updates are its
  fast form (Muon's and Adafactor's ``grouped`` updates batch their leaves' matrix products
  and foreach ops), which the executor's ``_map`` calls, as the eager backend's; claimed
  here, so that no lost fast path is warned about. Such a rule's run of rules is cut into
  its parts (a ``partition``'s transforms, ``functopt/fast/_segments.py``): a part beside
  it that the faster backends refuse is claimed too (Muon's Adam leaves with
  ``nesterov=True``, which neither a kernel nor a foreach implementation computes), and a
  part with a leaf that no such rule selects is refused (a learning rate over every leaf
  after Muon's: that leaf's rules have faster forms).
- ``"eager"``: the reference, the rules' own pure updates (the executor's ``_map``); it
  takes every segment.

A kernel writes the new params (the updates and the write of a step in one pass), so the
kernel backend takes only a segment whose updates go to the program's `Write` unread: one
at the top of the program that no later op (a clip, a guard, a reduction) reads. It also
refuses what its arithmetic would not compute as the pure rules do: a rule with a schedule
of its own count or a tensor hyperparameter (the kernels take Python numbers, so a tensor
would be read on the host and rounded to a double), a rule inside an ``inject_hyperparams``
nested in another, a rule with
tree sums, a layout or dtype the kernels do not take, a rule keeping shared state other than
its count, ``set_to_zero`` after a rule with state (the kernels' matching refuses it), a step
whose gradients, params or state entries hold an element that is not finite or so large
that the kernels' intermediates and the rules' overflow apart (checked at every step: one
foreach 2-norm pass over them and one host read; an update a clip scaled is bounded by
the sum of squares that clip measured, and not read), and, when the step is donated, per-leaf
state entries sharing memory with each other or with a param (the kernels write them in
place). A rule inside one ``inject_hyperparams`` is matched on its node in the inner transform built
from placeholder tensors, which the match binds to the injection's values: at each step
the kernels take this step's values (read on the host at each step), so a
``param_groups`` edit of a drop-in reaches them. No clip or loss scale reaches a
kernel as its ``grad_scale``: a clip is a `Scale` op of its own, run before the segment.

The kernels round once where the pure chain rounds at each stage, so their results equal
the pure path's within the conformance suite's fast-path tolerance
(``functopt/testing/_fast.py``) (tests/laws/test_backends.py; the foreach rows equal
torch.optim's classes with ``foreach=True`` bitwise, tests/laws/test_foreach.py); `explain`
gives, per segment, the backend that takes it or every backend's reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from functopt._collective.dtensor import _leaf_names
from functopt._spec import Leafwise, PerLeaf, Spec
from functopt.fast._foreach import FOREACH
from functopt.fast._kernels import (
    Group,
    _hyperparameters,
    _KernelPlan,
    _layout_problem,
    _matches,
    _run_group,
)
from functopt.fast._program import Map, Program, Resolved, resolve_binding
from functopt.fast._programs import _Const, _Env, _Hyper, _Op
from functopt.fast._segments import (
    Backend,
    Leaves,
    Segment,
    Unclaimed,
    _bound_node,
    _hyper_values,
    _kind,
    _shared,
    _table,
    checked_launch,
    laid,
    matched_of,
    segments,
)
from functopt.fast._walk import _Mismatch, _Walk
from functopt.transforms import _common
from functopt.tree import _core

__all__ = ["BACKENDS", "EAGER", "FOREACH", "KERNEL", "Backend", "Explained", "Leaves",
           "Running", "Segment", "explain", "segments", "table", "take", "unwarned"]

# The kernel plans of ``_planner._match_kernel`` this backend runs.
_KERNEL_PLANS = ("adamw", "adam", "sgd", "zero")


# --- the kernel backend -----------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class _Matched:
    """A segment matched to kernels, as far as the structures say: per leaf of the segment
    its plan and group key, and the counts its rules advance (flat state indices)."""

    plans: dict[int, tuple[_KernelPlan, Any]]
    counts: tuple[int, ...]
    bindings: frozenset[int] = frozenset()  # the inject_hyperparams its arguments read


def _binding_problem(op: _Op) -> str | None:
    """Why an argument of ``op`` is not a Python number or an injected hyperparameter (read
    on the host at each step by `_Env.number`), which the kernels take."""
    for name, binding in op.args.items():
        if isinstance(binding, _Hyper):
            continue
        value = binding.value if isinstance(binding, _Const) else None
        if isinstance(value, torch.Tensor):
            return (f"{op.kind}'s {name} is a tensor, which the kernels take as a Python "
                    f"number (read on the host and rounded)")
        if not isinstance(binding, _Const):
            return (f"{op.kind}'s {name} is {binding!r}, a tensor at each step, which the "
                    f"kernels take as a Python number")
    return None


def _match(segment: Segment, run: Leaves) -> _Matched | str:
    """The kernel backend's structural match of ``segment`` (the same at every step of
    these structures), or the reason it has none."""
    if not segment.final:
        return ("its updates are read after it (by a clip, a guard or another reduction, "
                "or it is inside apply_if_finite), and a kernel writes the params")
    walker = _Walk(None, run.treespec, run.params, run.state)
    keep: list[Any] = []  # (the placeholders, alive while the walk binds their ids)
    bindings = frozenset(m.rule.bound[0] for m in segment.maps if m.rule.bound is not None)
    for m in segment.maps:
        rule = m.rule
        spec: Spec | str = rule.spec
        if m.totals is not None or not isinstance(spec, Leafwise) or spec.kernel is None:
            return f"{rule.where or '<root>'}: {_kind(spec)} has no fused kernel"
        if rule.bound is not None:
            spec = _bound_node(walker, rule, run, keep)
            if isinstance(spec, str):
                return spec
        assert isinstance(spec, Leafwise)
        try:
            walker.leafwise(spec, rule.state_at, list(m.sel), rule.where)
        except _Mismatch as mismatch:
            return str(mismatch)
    structure = walker.out
    if structure.opaque:
        return structure.opaque[0]
    name = _leaf_names(run.treespec)
    programs = [structure.programs[i] for i in segment.leaves]
    plans: dict[int, tuple[_KernelPlan, Any]] = {}
    for i, program, (plan, key) in zip(segment.leaves, programs,
                                       _matches(programs, False, False), strict=True):
        if isinstance(plan, str):
            return f"leaf {name(i)!r}: {plan}"
        if plan.kernel not in _KERNEL_PLANS:
            return f"leaf {name(i)!r}: {' -> '.join(map(repr, program))} has no fused kernel"
        problem = next(filter(None, map(_binding_problem, program)), None)
        if problem is not None:
            return f"leaf {name(i)!r}: {problem}"
        plans[i] = (plan, key)
    # (the walk names every rule's count, those of rules on no leaves too)
    counts = set(structure.counters)
    extra = _shared(segment.maps, run.treespec) - counts
    if extra:
        return (f"{segment.where}: a rule keeps shared state besides its count, which the "
                f"kernels do not write")
    return _Matched(plans, tuple(sorted(counts)), bindings)


class _Kernel:
    """PyTorch's fused optimizer kernels (see the module docstring)."""

    name = "kernel"

    def offer(self, segment: Segment, run: Leaves) -> Callable[[], None] | str:
        table, key = _table(run.program), ("kernel", segment)
        matched = matched_of(table, key, lambda: _match(segment, run))
        if isinstance(matched, str):
            return matched
        name = _leaf_names(run.treespec)
        groups: dict[Any, Group] | None = laid(table, key, run, segment)
        checked = groups is not None
        if groups is None:
            groups = {}
            for i in segment.leaves:
                p, u = run.params[i], run.updates[i]
                if p is None or u is None:
                    continue
                plan, plan_key = matched.plans[i]
                problem = _layout_problem(plan, p, run.state)
                if problem is not None:
                    return f"leaf {name(i)!r}: {problem}"
                group = groups.setdefault((p.device, p.dtype, plan_key),
                                          Group(plan, p.device, p.dtype, [], []))
                group.leaves.append(i)
                group.plans.append(plan)
        env = _Env(run.state, _hyper_values(run, matched.bindings))
        resolved: list[tuple[Group, dict[str, Any]]] = []
        for group in groups.values():
            hp = {} if group.plan.kernel == "zero" else _hyperparameters(group.plan, env)
            if isinstance(hp, str):
                return hp
            resolved.append((group, hp))
        written = [(group.dtype, group.leaves, _written_slots(group))
                   for group, _ in resolved if group.plan.kernel != "zero"]
        return checked_launch(table, key, run, groups, written, checked, reread=False,
                              launch=lambda: _launch(segment, run, matched, resolved))


def _written_slots(group: Group) -> list[int]:
    """The per-leaf state entries a kernel call of ``group`` writes (flat indices)."""
    plan = group.plan
    if plan.kernel in ("adamw", "adam"):
        assert plan.adam is not None
        names = ["mu", "nu", *(["nu_max"] if plan.adam.kernel == "amsgrad" else [])]
        return [k for slot in names for k in group.slots("adam", slot)]
    if plan.kernel == "sgd" and plan.trace is not None:
        return group.slots("trace", "trace")
    return []


def _launch(segment: Segment, run: Leaves, matched: _Matched,
            resolved: list[tuple[Group, dict[str, Any]]]) -> None:
    """The kernel calls of a segment: the new params into ``run.params`` (their updates
    consumed: None), the new state into ``run.state``, each count advanced once."""
    advanced = {c: _common.safe_increment(run.state[c]) for c in matched.counts}
    new_params, new_state = list(run.params), list(run.state)
    for group, hp in resolved:
        if group.plan.kernel != "zero":  # (set_to_zero: the params stay as they are)
            _run_group(group, hp, run.params, run.updates, run.state, new_params, new_state,
                       donate=run.donate, donate_grads=False, scale=None, found_inf=None,
                       advanced=advanced, hosted={}, compiled={}, workspace=None)
        for i in group.leaves:
            run.params[i], run.updates[i] = new_params[i], None
    for k, value in enumerate(new_state):
        run.state[k] = value
    for c, count in advanced.items():
        run.state[c] = count


# --- the per-leaf and the eager backends -----------------------------------------------

class _PerLeaf:
    """The rules' own updates of a segment with a rule that reduces within a leaf (see the
    module docstring)."""

    name = "perleaf"

    def offer(self, segment: Segment, run: Leaves) -> Callable[[], None] | str:
        reduced = {i for m in segment.maps if isinstance(m.rule.spec, PerLeaf) for i in m.sel}
        if not reduced and segment.beside:  # (the faster backends refused it)
            return _EAGER_RUNS
        if not reduced:
            return Unclaimed("no rule of the segment reduces within a leaf")
        other = next((i for i in segment.leaves if i not in reduced), None)
        if other is not None:
            return (f"leaf {_leaf_names(run.treespec)(other)!r} has no rule that reduces "
                    f"within a leaf, and its rules' own updates are not their fast form")
        return _EAGER_RUNS


class _Eager:
    """The rules' own pure updates: the executor's reference, which takes every segment."""

    name = "eager"

    def offer(self, segment: Segment, run: Leaves) -> Callable[[], None] | str:
        return _EAGER_RUNS


def _EAGER_RUNS() -> None:
    """(A marker: the executor's own `_map` runs the segment's ops one by one.)"""


KERNEL: Backend = _Kernel()
PERLEAF: Backend = _PerLeaf()
EAGER: Backend = _Eager()
BACKENDS: dict[str, Backend] = {b.name: b for b in (KERNEL, FOREACH, PERLEAF, EAGER)}


def table(names: tuple[str, ...]) -> tuple[Backend, ...]:
    """The backends named, in order; the last must be ``"eager"``, which takes anything."""
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names or names[-1] != "eager":
        raise ValueError(f"the engine's backends: got {names!r}; expected names among "
                         f"{tuple(BACKENDS)} ending with 'eager' (the reference, which takes "
                         f"every segment). Fix: e.g. ('kernel', 'foreach', 'perleaf', 'eager') or "
                         f"('eager',).")
    return tuple(BACKENDS[n] for n in names)


def _offers(segment: Segment, run: Leaves, backends: tuple[Backend, ...],
            ) -> tuple[Backend, Callable[[], None], dict[str, str]]:
    """The first backend taking ``segment``, its call, and the earlier ones' reasons."""
    reasons: dict[str, str] = {}
    for backend in backends:
        found = backend.offer(segment, run)
        if not isinstance(found, str):
            return backend, found, reasons
        reasons[backend.name] = found
    raise AssertionError("the eager backend takes every segment")


class Running(Leaves, Protocol):
    """A step in flight as the executor's hook sees it."""

    backends: tuple[Backend, ...]  # the backends it offers segments to, in order
    taken: set[Map]  # the ops a backend other than the eager one ran


def take(run: Running, op: Map) -> bool:
    """Whether a backend other than the eager one ran ``op`` (the executor's hook in
    ``_map``): at the first `Map` of a segment, the segment is offered to
    ``run.backends``; one that takes it runs all of its ops, which the executor then skips.
    False: the executor's eager ``_map`` runs ``op``."""
    if op in run.taken:
        return True
    if len(run.backends) == 1:
        return False
    found = _table(run.program)
    segment = found.first.get(op)
    if segment is None:
        return False
    backend, call, reasons = _offers(segment, run, run.backends)
    if backend is EAGER:  # (the faster backends' reasons, warned about once each)
        for name, reason in reasons.items():
            if isinstance(reason, Unclaimed):
                continue
            message = f"{name} backend does not take {segment.where}: {reason}"
            if message not in found.warned:
                found.refused[message] = None
    if call is _EAGER_RUNS:  # (the executor's `_map` runs the segment's ops)
        return False
    call()
    run.taken.update(segment.maps)
    return True


def unwarned(program: Program) -> list[str]:
    """The refusals of faster backends this program met since last asked and not before
    (each given once per program: the engine warns about them)."""
    found = _table(program)
    new = [m for m in found.refused if m not in found.warned]
    found.warned.update(new)
    found.refused.clear()
    return new


# --- explain ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Explained:
    """One segment of a program: its rules, the backend that takes it, and the reasons of
    the backends before that one."""

    where: str
    backend: str
    reasons: dict[str, str]


@dataclass
class _Given:
    program: Program
    treespec: _core.TreeSpec
    params: list[Any]
    updates: list[Any]
    state: list[Any]
    donate: bool
    resolved: dict[int, Resolved] = field(default_factory=dict)
    clipped: dict[int, torch.Tensor] = field(default_factory=dict)

    def bound(self, index: int) -> Resolved:
        return resolve_binding(self.program, self.state, self.resolved, index)


def explain(program: Program, treespec: _core.TreeSpec, param_leaves: list[Any],
            grad_leaves: list[Any], state_leaves: list[Any], *, donate: bool = False,
            backends: tuple[str, ...] = ("kernel", "foreach", "perleaf", "eager"),
            ) -> list[Explained]:
    """Per segment of ``program`` on these leaves, which backend takes it and why the ones
    before it do not. Nothing is run: each segment is offered the gradients as its updates
    (the updates' layouts where the rules before it keep them)."""
    chosen = table(backends)
    run = _Given(program, treespec, list(param_leaves), list(grad_leaves),
                 list(state_leaves), donate)
    out = []
    for segment in segments(program):
        backend, _, reasons = _offers(segment, run, chosen)
        out.append(Explained(segment.where, backend.name, reasons))
    return out


