r"""The engine's backends: who runs each run of rules of a step's program.

The executor (``functopt/fast/_execute.py``) cuts a program (``functopt/fast/_program.py``)
into *segments*: a run of consecutive `Map` ops, with the leaves they select and the state
they hold. At the first `Map` of a segment it offers the segment to its backends in order;
each accepts it (and then runs all of it) or gives the reason it does not:

- ``"kernel"``: PyTorch's fused kernels (``torch._fused_adamw_``, ``torch._fused_adam_``,
  ``torch._fused_sgd_``) for the leaves whose rules in the segment are Adam with decoupled
  or L2 decay, or SGD (with a trace, dampened or not, and a decay), ending in a learning
  rate, and for ``set_to_zero`` (nothing to write). The matching and the calls are the
  planner's (the walk's rule bindings, ``functopt/fast/_walk.py``; ``_matches``,
  ``_layout_problem``, ``_hyperparameters`` and ``_run_group``,
  ``functopt/fast/_kernels.py``), so a leaf takes the kernel call the planner's fast path
  makes for it, bitwise. For a rule torch has no fused kernel of, torch.optim's foreach
  implementation where one computes the rules: ``torch.optim.rmsprop._multi_tensor_rmsprop`` for ``functopt.optim.RMSprop``'s
  chain (``[scale(-1)], [add_decayed_weights], scale_by_rms(eps_in_sqrt=False), [trace],
  scale_by_learning_rate``, not centered), in float32 and float64 (the rules compute a
  narrow dtype's moments in float32 and round once, the function rounds at each op), with
  an ``eps`` whose reciprocal is finite (the rule multiplies by ``1 / (sqrt(nu) + eps)``,
  the function divides by ``sqrt(nu) + eps``: they agree on what is finite only then).
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
foreach 2-norm pass over them and one host read), and, when the step is donated, per-leaf
state entries sharing memory with each other or with a param (the kernels write them in
place). A rule inside one ``inject_hyperparams`` is matched on its node in the inner transform built
from placeholder tensors, which the match binds to the injection's values: at each step
the kernels take this step's values (read on the host at each step), so a
``param_groups`` edit of a drop-in reaches them. No clip or loss scale reaches a
kernel as its ``grad_scale``: a clip is a `Scale` op of its own, run before the segment.

The kernels round once where the pure chain rounds at each stage, so their results equal
the pure path's within the conformance suite's fast-path tolerance
(``functopt/testing/_fast.py``)
(tests/laws/test_backends.py; the foreach RMSprop equals ``torch.optim.RMSprop(foreach=True)``
bitwise); `explain` gives, per segment, the backend that takes it or every backend's
reason.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from functopt._collective.dtensor import _leaf_names, local_tensor
from functopt._spec import Leafwise, Spec, describe
from functopt.fast._kernels import (
    _PLAIN,
    Group,
    _hyperparameters,
    _KernelPlan,
    _layout_problem,
    _matches,
    _run_group,
)
from functopt.fast._planner import overlap
from functopt.fast._program import (
    Gate,
    Map,
    Op,
    Program,
    Resolved,
    Rule,
    nodes_of,
    resolve_binding,
)
from functopt.fast._programs import _Const, _Env, _Hyper, _Op
from functopt.fast._walk import _Mismatch, _Walk
from functopt.transforms import _common
from functopt.tree import _core

__all__ = ["BACKENDS", "EAGER", "KERNEL", "Backend", "Explained", "Leaves", "Running",
           "Segment", "explain", "segments", "table", "take", "unwarned"]

# The kernel plans of ``_planner._match_kernel`` this backend runs.
_KERNEL_PLANS = ("adamw", "adam", "sgd", "zero")


class Leaves(Protocol):
    """What a backend reads of a step in flight (the executor's run)."""

    program: Program
    treespec: _core.TreeSpec
    params: list[Any]
    updates: list[Any]  # per leaf: its update where the segment stands
    state: list[Any]  # the flat state
    donate: bool

    def bound(self, index: int) -> Resolved:
        """Binding ``index`` at this step (its values; its inner transform's nodes)."""
        ...


@dataclass(frozen=True, eq=False)
class Segment:
    """A run of consecutive `Map` ops: ``leaves`` (in index order) are those they select;
    ``final``: it stands at the top of the program and no op after it reads its leaves'
    updates, so a backend may add them to the params itself."""

    maps: tuple[Map, ...]
    leaves: tuple[int, ...]
    final: bool

    @property
    def where(self) -> str:
        """Its rules and their places in the transform, for messages."""
        return ", ".join(f"{_kind(m.rule.spec)} at {m.rule.where or '<root>'}"
                         for m in self.maps)


def _kind(spec: Any) -> str:
    return str(getattr(spec, "kind", type(spec).__name__))


class Backend(Protocol):
    name: str

    def offer(self, segment: Segment, run: Leaves) -> Callable[[], None] | str:
        """The call that runs ``segment`` on ``run``, or the reason this backend does not
        take it (before anything is written)."""
        ...


# --- segments ---------------------------------------------------------------------------

def _sel(op: Op) -> tuple[int, ...]:
    """The leaves whose updates ``op`` reads or writes (every op with a ``sel``)."""
    found: tuple[int, ...] = getattr(op, "sel", ())
    return found


def _cut(ops: tuple[Op, ...], top: bool) -> list[Segment]:
    found: list[Segment] = []
    run: list[Map] = []

    def close(at: int) -> None:
        if not run:
            return
        leaves = tuple(sorted({i for m in run for i in m.sel}))
        mine = set(leaves)
        final = top and not any(mine.intersection(_sel(later)) for later in ops[at:])
        found.append(Segment(tuple(run), leaves, final))
        run.clear()

    for at, op in enumerate(ops):
        if isinstance(op, Map):
            run.append(op)
            continue
        close(at)
        if isinstance(op, Gate):
            found += _cut(op.then, False) + _cut(op.otherwise, False)
    close(len(ops))
    return found


@dataclass(eq=False)
class _Table:
    """What the backends keep per program: its segments, by their first `Map`, the kernel
    backend's structural match per segment, and the refusals not yet warned about."""

    segments: tuple[Segment, ...]
    first: dict[Map, Segment]
    matched: dict[Segment, _Matched | str] = field(default_factory=dict)
    foreach: dict[Segment, dict[int, _RmsProp] | str | None] = field(default_factory=dict)
    refused: dict[str, None] = field(default_factory=dict)  # (ordered) since the last warning
    warned: set[str] = field(default_factory=set)
    # per segment: the params and state entries its last kernel call wrote, as
    # id -> (a weak reference, its version), which `_range_problem` does not read again
    written: dict[Segment, dict[int, tuple[Any, int]]] = field(default_factory=dict)


_TABLES: weakref.WeakKeyDictionary[Program, _Table] = weakref.WeakKeyDictionary()


def _table(program: Program) -> _Table:
    found = _TABLES.get(program)
    if found is None:
        cut = tuple(_cut(program.ops, True))
        found = _TABLES[program] = _Table(cut, {s.maps[0]: s for s in cut})
    return found


def segments(program: Program) -> tuple[Segment, ...]:
    """The program's segments, in program order (a `Gate`'s after the ops before it)."""
    return _table(program).segments


# --- the kernel backend -----------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class _Matched:
    """A segment matched to kernels, as far as the structures say: per leaf of the segment
    its plan and group key, and the counts its rules advance (flat state indices)."""

    plans: dict[int, tuple[_KernelPlan, Any]]
    counts: tuple[int, ...]
    bindings: frozenset[int] = frozenset()  # the inject_hyperparams its arguments read


def _hyper_values(run: Leaves, bindings: frozenset[int]) -> list[dict[str, Any]]:
    """Per binding of the program, this step's values where the kernels read them (the
    `_Hyper` arguments of a match: ``hyperparams[key]`` of binding ``node``)."""
    return [run.bound(i).values if i in bindings else {}
            for i in range(len(run.program.bindings))]


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


def _bound_node(walker: _Walk, rule: Rule, run: Leaves, keep: list[Any]) -> Spec | str:
    """A rule inside ``inject_hyperparams`` as the kernels' match reads it: its node in the
    inner transform built from placeholder tensors, which the walk binds to this step's
    values (`_Hyper`); or why it is not matched."""
    assert rule.bound is not None
    index, position = rule.bound
    binding = run.program.bindings[index]
    if binding.parent is not None:
        return (f"{rule.where}: an inject_hyperparams inside another, whose values the "
                f"kernels' match does not bind")
    placeholders = walker.placeholders_of(binding.hyper, index)
    keep.append(placeholders)
    node = nodes_of(describe(binding.spec.build(placeholders)))[position]
    if type(node) is not type(rule.spec):
        return (f"{rule.where}: the injected transform built anew has {node!r} where "
                f"{rule.spec!r} was compiled")
    return node


def _shared(maps: tuple[Map, ...], treespec: _core.TreeSpec) -> set[int]:
    """The flat state entries of the segment's rules that are not per leaf."""
    shared: set[int] = set()
    for m in maps:
        at = m.rule.state_at
        per_leaf = {k for name in m.rule.slots
                    for k in treespec.flatten_up_to(getattr(at, name)) if isinstance(k, int)}
        shared |= {k for k in _core.flatten(at)[0] if isinstance(k, int)} - per_leaf
    return shared


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
    """PyTorch's fused optimizer kernels, and its foreach implementations (see the module
    docstring)."""

    name = "kernel"

    def offer(self, segment: Segment, run: Leaves) -> Callable[[], None] | str:
        fused = self._fused(segment, run)
        if not isinstance(fused, str):
            return fused
        foreach = _foreach_offer(segment, run)
        if foreach is None:  # (rules torch has no foreach implementation of)
            return fused
        if isinstance(foreach, str):
            return f"{fused}; torch.optim's foreach RMSprop: {foreach}"
        return foreach

    def _fused(self, segment: Segment, run: Leaves) -> Callable[[], None] | str:
        table = _table(run.program)
        matched = table.matched.get(segment)
        if matched is None:
            matched = table.matched[segment] = _match(segment, run)
        if isinstance(matched, str):
            return matched
        name = _leaf_names(run.treespec)
        groups: dict[Any, Group] = {}
        for i in segment.leaves:
            p, u = run.params[i], run.updates[i]
            if p is None or u is None:
                continue
            plan, key = matched.plans[i]
            problem = _layout_problem(plan, p, run.state)
            if problem is not None:
                return f"leaf {name(i)!r}: {problem}"
            group = groups.setdefault((p.device, p.dtype, key),
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
        problem = _range_problem(run, written, table.written.get(segment))
        if problem is None and run.donate:
            problem = _donation_problem(run, [i for _, leaves, _ in written for i in leaves],
                                        [k for _, _, entries in written for k in entries],
                                        name)
        if problem is not None:
            return problem

        def launch() -> None:
            _launch(segment, run, matched, resolved)
            table.written[segment] = _versions(
                [run.params[i] for _, leaves, _ in written for i in leaves]
                + [run.state[k] for _, _, entries in written for k in entries])

        return launch


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


def _range_problem(run: Leaves, groups: list[tuple[torch.dtype, list[int], list[int]]],
                   written: dict[int, tuple[Any, int]] | None = None) -> str | None:
    """Why the kernels' results may not equal the rules' to rounding on these values: an
    element of a gradient, a param or a state entry (per group: its dtype, its leaves, the
    flat indices of its state entries) is not finite, or so large that an intermediate of
    the kernels' arithmetic and not of the rules' overflows (or the reverse: Adam's
    ``(1 - b2) * g * g`` against the rule's ``(1 - b2) * (g * g)``, the kernels'
    ``mu + (1 - b1) * (g - mu)`` against ``b1 * mu + (1 - b1) * g``), both computing in
    float32 (float64 for float64). Each tensor's 2-norm (a bound of its largest element,
    not finite where an element is not) is held to a sixteenth of that dtype's largest
    value, a gradient's to a sixteenth of its root: one foreach pass, one host read.

    ``written``: the params and state entries the segment's last kernel call wrote (see
    `_versions`), not read again while they are the same tensors, unmodified. From values
    within these bounds the kernels write values within them: Adam's moments are convex
    combinations of the old ones and of the gradient (or its square), SGD's trace grows by
    at most the gradient's bound over ``1 - momentum`` per step, and a param moves by the
    learning rate times a ratio bounded by the betas (Adam) or by that trace (SGD), far
    from a sixteenth of the largest value at any learning rate that keeps the pure path
    finite. (A write through ``.data`` does not advance a tensor's version: a param edited
    so in place is not read again.)"""
    checks = []
    for dtype, leaves, entries in groups:
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        largest = torch.finfo(wide).max
        kept = [run.params[i] for i in leaves] + [run.state[k] for k in entries]
        if written:
            kept = [x for x in kept if not _unchanged(x, written)]
        for tensors, bound in (([run.updates[i] for i in leaves], math.sqrt(largest) / 16),
                               (kept, largest / 16)):
            tensors = [x for x in map(local_tensor, tensors) if x.numel()]
            if tensors:
                norms = torch._foreach_norm(tensors, 2, dtype=wide)
                checks.append((torch.stack(norms).max() <= bound).cpu())
    if not checks or bool(torch.stack(checks).all()):
        return None
    return ("an element of a gradient, param or state entry is not finite or beyond the "
            "kernels' range (where their arithmetic and the rules' overflow apart)")


def _versions(tensors: list[Any]) -> dict[int, tuple[Any, int]]:
    """The tensors a kernel call wrote, by id: a weak reference and the version."""
    return {id(x): (weakref.ref(x), x._version) for x in tensors if isinstance(x, torch.Tensor)}


def _unchanged(x: Any, written: dict[int, tuple[Any, int]]) -> bool:
    found = written.get(id(x))
    return found is not None and found[0]() is x and found[1] == x._version


def _donation_problem(run: Leaves, leaves: list[int], entries: list[int],
                      name: Callable[[int], str]) -> str | None:
    """Why the kernels may not write these donated params (leaf indices) and state entries
    (flat indices) in place: two of them share memory."""
    # (what each tensor is, named only for a message: the paths cost a tree walk)
    written = [("param", i) for i in leaves] + [("state", k) for k in entries]

    def named(j: int) -> str:
        kind, at = written[j]
        return f"param {name(at)!r}" if kind == "param" else f"state entry {at}"

    pair = overlap([run.params[at] if kind == "param" else run.state[at]
                    for kind, at in written], named, "tensor")
    if pair is None:
        return None
    return (f"{named(pair[0])} and {named(pair[1])} share memory, which the kernels would "
            f"write in place")


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


# --- torch.optim's foreach RMSprop ------------------------------------------------------

_FOREACH_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True, eq=False)
class _RmsProp:
    """One leaf's rules as ``torch.optim.rmsprop._multi_tensor_rmsprop`` computes them:
    ``[scale(-1)], [add_decayed_weights], scale_by_rms(eps_in_sqrt=False), [trace],
    scale_by_learning_rate`` (``functopt.optim.RMSprop``'s chain, not centered)."""

    maps: tuple[Map, ...]  # the segment's Maps on the leaf (leaves with the same: one call)
    args: dict[str, Any]  # the function's keyword arguments
    nu: int  # the flat state index of the leaf's second moment
    trace: int | None  # and of its momentum buffer


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _rmsprop_of(maps: tuple[Map, ...], leaf: int, treespec: _core.TreeSpec) -> _RmsProp | str:
    """The leaf's rules as torch's foreach RMSprop, or why they are not."""
    rest = [(_kind(m.rule.spec), m) for m in maps if _kind(m.rule.spec) != "identity"]
    args: dict[str, Any] = {"maximize": False, "weight_decay": 0.0, "momentum": 0.0,
                            "centered": False}

    def first(kind: str) -> Any:
        """The hyperparameters of the next rule if it is a ``kind`` (taken), else None."""
        if not rest or rest[0][0] != kind:
            return None
        spec = rest.pop(0)[1].rule.spec
        return spec.hyper if isinstance(spec, Leafwise) else None

    if (h := first("scale")) is not None:
        if not (_number(h["step_size"]) and h["step_size"] == -1):
            return "a scale other than scale(-1.0) (torch's maximize) before the rule"
        args["maximize"] = True
    if (h := first("add_decayed_weights")) is not None:
        if not _number(h["weight_decay"]):
            return "add_decayed_weights with a weight_decay that is not a Python number"
        args["weight_decay"] = float(h["weight_decay"])
    rms = rest[0][1] if rest and rest[0][0] == "scale_by_rms" else None
    if (h := first("scale_by_rms")) is None or rms is None:
        return "its rules are not [scale(-1)], [add_decayed_weights], scale_by_rms, ..."
    if h["eps_in_sqrt"] or h["bias_correction"]:
        return "scale_by_rms with eps_in_sqrt=True or bias_correction=True is not torch's"
    if not (_number(h["decay"]) and _number(h["eps"])):
        return "scale_by_rms with a decay or eps that is not a Python number"
    args.update(alpha=float(h["decay"]), eps=float(h["eps"]))
    nu = _entry(treespec, rms.rule.state_at.nu, leaf)
    trace = None
    traced = rest[0][1] if rest and rest[0][0] == "trace" else None
    if (h := first("trace")) is not None and traced is not None:
        if not _number(h["decay"]) or h["decay"] <= 0 or h["nesterov"] or (
                h["accumulator_dtype"] is not None):
            return ("a trace other than trace(decay > 0) in the param's dtype (torch's "
                    "momentum) after scale_by_rms")
        args["momentum"] = float(h["decay"])
        trace = _entry(treespec, traced.rule.state_at.trace, leaf)
    if (h := first("scale_by_learning_rate")) is None or not (
            _number(h["learning_rate"]) and h["flip_sign"]):
        return "it does not end with scale_by_learning_rate of a Python number"
    args["lr"] = float(h["learning_rate"])
    if rest:
        return f"{rest[0][0]} after the learning rate"
    return _RmsProp(maps, args, nu, trace)


def _entry(treespec: _core.TreeSpec, index_tree: Any, leaf: int) -> int:
    """A per-leaf state entry's flat index, from its field's index tree."""
    found = treespec.flatten_up_to(index_tree)[leaf]
    assert isinstance(found, int)
    return found


def _foreach_match(segment: Segment, run: Leaves) -> dict[int, _RmsProp] | str | None:
    """Per leaf of ``segment``, its rules as torch's foreach RMSprop; the reason they are
    not; or None when the segment has no rule of it."""
    if not any(_kind(m.rule.spec) == "scale_by_rms" for m in segment.maps):
        return None
    if not segment.final:
        return "its updates are read after it, and the function writes the params"
    name = _leaf_names(run.treespec)
    plans: dict[int, _RmsProp] = {}
    for i in segment.leaves:
        found = _rmsprop_of(tuple(m for m in segment.maps if i in m.sel), i, run.treespec)
        if isinstance(found, str):
            return f"leaf {name(i)!r}: {found}"
        plans[i] = found
    counts = {m.rule.state_at.count for m in segment.maps
              if _kind(m.rule.spec) == "scale_by_rms"}
    if _shared(segment.maps, run.treespec) - counts:
        return f"{segment.where}: a rule keeps shared state besides scale_by_rms's count"
    return plans


def _foreach_offer(segment: Segment, run: Leaves) -> Callable[[], None] | str | None:
    table = _table(run.program)
    if segment not in table.foreach:
        table.foreach[segment] = _foreach_match(segment, run)
    plans = table.foreach[segment]
    if plans is None or isinstance(plans, str):
        return plans
    name = _leaf_names(run.treespec)
    groups: dict[Any, list[int]] = {}
    for i in segment.leaves:
        p, u = run.params[i], run.updates[i]
        if p is None or u is None:
            continue
        plan = plans[i]
        problem = _foreach_problem(plan, p, u, run.state)
        if problem is not None:
            return f"leaf {name(i)!r}: {problem}"
        groups.setdefault((p.device, p.dtype, plan.maps), []).append(i)
    calls = [(plans[leaves[0]], leaves) for leaves in groups.values()]
    written = [(run.params[leaves[0]].dtype, leaves,
                [k for i in leaves for k in (plans[i].nu, plans[i].trace) if k is not None])
               for _, leaves in calls]
    problem = _range_problem(run, written)
    if problem is None and run.donate:
        problem = _donation_problem(run, [i for _, leaves, _ in written for i in leaves],
                                    [k for _, _, entries in written for k in entries], name)
    if problem is not None:
        return problem
    counts = sorted({m.rule.state_at.count for m in segment.maps
                     if _kind(m.rule.spec) == "scale_by_rms"})
    return lambda: _foreach_launch(run, plans, calls, counts)


def _foreach_problem(plan: _RmsProp, p: Any, u: Any, state: list[Any]) -> str | None:
    """Why torch's foreach RMSprop cannot take this leaf as the rules compute it."""
    if type(p) not in _PLAIN or type(u) not in _PLAIN:
        return "torch's foreach RMSprop takes plain tensors (not a DTensor or a subclass)"
    if p.dtype not in _FOREACH_DTYPES:
        # (the rules compute a narrow dtype's moments in float32 and round once; the
        # function rounds at each of its ops)
        return f"torch's foreach RMSprop rounds {p.dtype} at each op, the rules once"
    entries = [state[plan.nu], *([] if plan.trace is None else [state[plan.trace]])]
    for x in (u, *entries):
        if type(x) not in _PLAIN or x.dtype != p.dtype or x.shape != p.shape or (
                x.device != p.device):
            return "its gradient or state entries differ from the param in dtype or shape"
    if plan.args["eps"] * torch.finfo(p.dtype).max <= 1:
        # (the rule multiplies by 1 / (sqrt(nu) + eps), the function divides by
        # sqrt(nu) + eps: they agree on what is finite where 1 / eps is)
        return f"an eps of {plan.args['eps']} whose reciprocal overflows {p.dtype}"
    return None


def _foreach_launch(run: Leaves, plans: dict[int, _RmsProp],
                    calls: list[tuple[_RmsProp, list[int]]], counts: list[int]) -> None:
    """The foreach calls of a segment, each of its leaves' params and state written as
    `_launch` writes the kernels' (torch's own step counts are scratch: the rule keeps
    its count)."""
    from torch.optim.rmsprop import _multi_tensor_rmsprop

    def owned(x: torch.Tensor) -> torch.Tensor:
        return x if run.donate else x.clone()

    advanced = {c: _common.safe_increment(run.state[c]) for c in counts}
    for plan, leaves in calls:
        params = [owned(run.params[i]) for i in leaves]
        nus = [owned(run.state[plans[i].nu]) for i in leaves]
        at = [plans[i].trace for i in leaves]
        traces = [owned(run.state[k]) for k in at if k is not None]
        steps = [torch.zeros(())] * len(leaves)
        _multi_tensor_rmsprop(params, [run.updates[i] for i in leaves], nus, [], traces, steps,
                              differentiable=False, capturable=False, has_complex=False,
                              **plan.args)
        for j, i in enumerate(leaves):
            run.params[i], run.updates[i] = params[j], None
            run.state[plans[i].nu] = nus[j]
        for k, trace in zip([k for k in at if k is not None], traces, strict=True):
            run.state[k] = trace
    for c, count in advanced.items():
        run.state[c] = count


# --- the eager backend ------------------------------------------------------------------

class _Eager:
    """The rules' own pure updates: the executor's reference, which takes every segment."""

    name = "eager"

    def offer(self, segment: Segment, run: Leaves) -> Callable[[], None] | str:
        return _EAGER_RUNS


def _EAGER_RUNS() -> None:
    """(A marker: the executor's own `_map` runs the segment's ops one by one.)"""


KERNEL: Backend = _Kernel()
EAGER: Backend = _Eager()
BACKENDS: dict[str, Backend] = {b.name: b for b in (KERNEL, EAGER)}


def table(names: tuple[str, ...]) -> tuple[Backend, ...]:
    """The backends named, in order; the last must be ``"eager"``, which takes anything."""
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names or names[-1] != "eager":
        raise ValueError(f"the engine's backends: got {names!r}; expected names among "
                         f"{tuple(BACKENDS)} ending with 'eager' (the reference, which takes "
                         f"every segment). Fix: e.g. ('kernel', 'eager') or ('eager',).")
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
    for name, reason in reasons.items():
        message = f"{name} backend does not take {segment.where}: {reason}"
        if message not in found.warned:
            found.refused[message] = None
    if backend is EAGER:
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

    def bound(self, index: int) -> Resolved:
        return resolve_binding(self.program, self.state, self.resolved, index)


def explain(program: Program, treespec: _core.TreeSpec, param_leaves: list[Any],
            grad_leaves: list[Any], state_leaves: list[Any], *, donate: bool = False,
            backends: tuple[str, ...] = ("kernel", "eager")) -> list[Explained]:
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

