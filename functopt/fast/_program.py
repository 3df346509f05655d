r"""A step as a program: the private engine's representation, and its compiler.

A transform's spec (``functopt/_spec.py``) says what it computes as a tree of combinators
around rules. The engine compiles that tree, with the state it steps, into one flat
*program*: a sequence of operations on the step's *updates* (one entry per param leaf,
the gradients at the start) and its *state* (the state's flat leaves). Every combinator
compiles once, wherever it stands:

- ``chain`` / ``named_chain``: the children's programs, concatenated;
- ``masked`` / ``partition`` (and ``contrib.schedule_free``): each child compiled on the
  leaves it selects (an op's ``sel``), with its own part of the state;
- a rule (`Leafwise` / `PerLeaf`): one `Map`, its own pure ``update`` on its leaves; a rule
  whose update also sums over all its leaves (Prodigy's ``sums`` / ``finish``) is a
  `Reduce` of kind ``"sums"`` and a `Map` of its second half;
- ``clip_by_global_norm``: a `Reduce` of kind ``"sumsq"`` and a `Scale` (the clip's own
  second half, ``GlobalNormClip.finish``), first in a chain, after other rules or between
  them alike: the sum of squares is of the updates where the clip stands;
- ``apply_if_finite``: a `Reduce` of kind ``"nonfinite"`` and a `Gate`, whose ``then``
  branch is the inner transform's program and whose ``otherwise`` branch zeroes the
  updates and keeps the state (the pure path's ``torch.where`` selection, no host read);
- ``inject_hyperparams`` (nested too): a `Binding` that reads the hyperparameters from the
  state at each step and builds the inner transform from them, a `Record` where the pure
  update writes its count and values, and the inner program, whose rules are found again
  by position in the inner transform built from this step's values (``Rule.bound``);
- ``MultiSteps`` (whole, or as ``gradient_transformation()`` anywhere, nested too): a
  `Gate` on its `Window`. The window's decision is read on the host, where its pure update
  reads it (``MultiSteps.window``: the counts with ``_read_count``, ``every_k_schedule``,
  and the verdict of ``should_skip_update_fn``, a sync only where that verdict is an
  accelerator tensor), and only the branch it picks runs. Both branches begin with an
  `Accumulate` of the mini-step into the window's state; ``then`` (the mini-step that
  closes the window) goes on with the inner transform's program on the accumulated
  gradients, ``otherwise`` (every other mini-step, skipped or not) with zero updates, the
  inner state kept. It adds no `Reduce`: a skip function measures the updates' trees
  itself (on DTensor leaves with DTensor's own collectives, as on the pure path).

A program ends with a `Write` (the updates added to the params). A node the compiler does
not handle gives a program with a ``reason`` and no ops: the caller keeps another path and
says why, so a program is never a silent approximation.

A `Gate` thus makes one of two decisions: on a device (a `Decide`: both branches run and
``torch.where`` selects, as ``apply_if_finite`` does) or on the host (a `Window`: one
branch runs, as ``MultiSteps`` runs its inner update only when a window closes).

Why this shape. The ops hold indices (leaves, flat state entries, reduction results), no
tensors, so a program depends only on the transform and the trees' structures and is
built once per structure. Reductions are ops of their own so that an executor can see
where the values of every leaf must be known before the step goes on (a *barrier*) and
make one packed collective per barrier, whatever combinator the reduction came from. A
rule is called as the pure path calls it, on the params' tree with ``None`` outside its
leaves, so the program's arithmetic is the rules' own and the executor's reference backend
equals the pure path bitwise. What the rules are (their per-leaf state fields, whether
they are elementwise) is what their specs state, read through `rule_facts`.

The engine is private and off by default: see ``functopt/fast/_engine.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from functopt._base import set_to_zero
from functopt._spec import (
    FiniteGuard,
    GlobalNormClip,
    Injected,
    Leafwise,
    Select,
    Sequence,
    Spec,
    describe,
)
from functopt.transforms.multi_steps import Accumulated, MultiSteps, MultiStepsState
from functopt.tree import _core

__all__ = ["Accumulate", "Binding", "Decide", "Gate", "Map", "Program", "Record", "Reduce",
           "Resolved", "Rule", "Scale", "Window", "Write", "compile_program", "nodes_of",
           "resolve_binding", "rule_facts"]

def rule_facts(spec: Leafwise) -> tuple[tuple[str, ...], bool] | str:
    """A rule's per-leaf state fields and whether it is elementwise, as its spec states
    them, or why they are not known."""
    if spec.slots is None:
        return f"{spec.kind} has no known state layout (its spec names no per-leaf state fields)"
    return spec.slots, spec.elementwise


# --- the IR -----------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Rule:
    """A spec node the executor calls: a rule, a clip, a guard or a ``MultiSteps``, with its
    state's place."""

    spec: Spec  # the node as compiled (for a bound rule: from the compile-time build)
    state_at: Any  # its state with flat state indices at the leaves
    slots: tuple[str, ...]  # the fields of its state holding one entry per param leaf
    elementwise: bool  # each element from the same element of its inputs (splittable)
    where: str  # its place in the transform, for messages
    # inside inject_hyperparams: (the binding, the node's position in `nodes_of` of that
    # binding's inner spec), to take the node built from this step's values; else None
    bound: tuple[int, int] | None = None


@dataclass(frozen=True, eq=False)
class Map:
    """``rule`` on the leaves ``sel``: their updates and its state become its outputs."""

    rule: Rule
    sel: tuple[int, ...]
    # the `Reduce` whose sums the rule's second half (``spec.finish``) takes, or None: its
    # whole ``update``
    totals: int | None = None


@dataclass(frozen=True, eq=False)
class Reduce:
    """A value over the leaves ``sel`` of the updates where it stands, summed over the
    ranks: ``"sumsq"`` (a float64 sum of squares, accumulated as ``global_norm``),
    ``"nonfinite"`` (a float64 count of leaves holding an inf or a nan) or ``"sums"``
    (``rule.spec.sums``, a tuple of 0-d tensors)."""

    kind: str
    sel: tuple[int, ...]
    out: int  # the index of its result among the program's reductions
    rule: Rule | None = None  # for "sums"


@dataclass(frozen=True, eq=False)
class Scale:
    """The updates of ``sel`` scaled by a clip: ``rule.spec.finish`` given the sum of
    squares ``source``."""

    rule: Rule
    sel: tuple[int, ...]
    source: int


@dataclass(frozen=True, eq=False)
class Decide:
    """``apply_if_finite``'s decision from the non-finite count ``source``, and its
    counters (flat state indices), which it advances as the pure update does."""

    source: int
    notfinite_count: int
    last_finite: int
    total_notfinite: int
    max_consecutive_errors: int


@dataclass(frozen=True, eq=False)
class Window:
    """``MultiSteps``' decision on its window (``rule``: its ``Accumulated`` node and its
    state's place), made on the host by its own ``MultiSteps.window`` on the updates of
    ``sel``: whether ``should_skip_update_fn`` skips the mini-step and whether the
    mini-step count reaches ``every_k_schedule(gradient_step)``. It writes the state's new
    ``skip_state`` and keeps its verdict as window ``out`` of the step (numbered in the
    program from 0), for the `Accumulate` ops of its gate."""

    rule: Rule
    sel: tuple[int, ...]
    out: int


@dataclass(frozen=True, eq=False)
class Accumulate:
    """The mini-step taken into the window ``window``'s state (``rule``'s), as the pure
    ``MultiSteps.update`` takes it: a skipped one changes nothing; one that does not close
    the window adds each update of ``sel`` into its accumulator (``use_grad_mean``: the
    running mean) and advances ``mini_step``; the one that closes it makes the updates of
    ``sel`` the accumulated gradients (in the updates' dtypes; at the window's first
    mini-step, the updates as they are), resets every accumulator to zeros and
    ``mini_step`` to 0, and advances ``gradient_step``."""

    rule: Rule
    sel: tuple[int, ...]
    window: int


@dataclass(frozen=True, eq=False)
class Gate:
    """Two branches, and a decision between them.

    ``decide`` a `Decide`: both branches run from the same updates and state, and the
    decision picks, per updates leaf of ``sel`` and per state entry either branch wrote,
    ``then``'s where it applies and ``otherwise``'s elsewhere (``torch.where``: a device
    decision, no host read). ``decide`` a `Window`: the decision is read on the host and
    only its branch runs, ``then`` on the mini-step that closes the window, ``otherwise``
    on the others."""

    decide: Decide | Window
    then: tuple[Op, ...]
    otherwise: tuple[Op, ...]
    sel: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Record:
    """Where ``inject_hyperparams``' update writes its state: the count advanced and this
    step's values of binding ``binding`` recorded (inside a `Gate`, kept on a skip)."""

    binding: int


@dataclass(frozen=True, eq=False)
class Write:
    """The end of the step: ``"apply"``, the updates added to the params."""

    kind: str = "apply"


@dataclass(frozen=True, eq=False)
class Binding:
    """An ``inject_hyperparams``: its values read from the state at each step where the
    step first needs them (outer bindings first; inside a ``MultiSteps``, only on the
    mini-steps that close its window, the only ones its update runs on), and its inner
    transform built from them."""

    count: int  # flat index of its state.count
    hyper: tuple[tuple[str, int], ...]  # (key, flat index of state.hyperparams[key])
    constants: tuple[str, ...]  # the keys that are values (the others are schedules)
    spec: Injected  # the node as compiled
    # inside another binding's inner transform: (that binding, the node's position in
    # `nodes_of` of its inner spec), to take the node built from the outer's values
    parent: tuple[int, int] | None = None


Op = Map | Reduce | Scale | Gate | Accumulate | Record | Write


@dataclass(frozen=True, eq=False)
class Program:
    """A step: ``ops`` on ``leaves`` updates entries and the flat state, with ``bindings``
    resolved where they are first needed; ``reason`` (and no ops) when the compiler does
    not take the transform."""

    leaves: int
    ops: tuple[Op, ...]
    bindings: tuple[Binding, ...] = ()
    reductions: int = 0  # the number of `Reduce` results
    reason: str | None = None

    @property
    def barriers(self) -> int:
        """How many times a step must resolve reductions in program order: an op that
        reads a result (a `Scale`, a gate's `Decide`, a `Map` with ``totals``) while
        reductions are pending resolves all of them at once, one packed collective on a
        mesh. A gate on a `Window` runs one branch: it counts its branch with more (a
        ``MultiSteps``' closing mini-step), so this is the most a step makes."""

        def visit(ops: tuple[Op, ...], pending: set[int]) -> int:
            count = 0
            for op in ops:
                if isinstance(op, Reduce):
                    pending.add(op.out)
                    continue
                if isinstance(op, Gate) and isinstance(op.decide, Window):
                    then, otherwise = set(pending), set(pending)
                    count += max(visit(op.then, then), visit(op.otherwise, otherwise))
                    pending.clear()
                    pending.update(then | otherwise)
                    continue
                if isinstance(op, Gate):
                    count += visit(op.then, pending) + visit(op.otherwise, pending)
                needs = _reads(op)
                if needs is not None and needs in pending:
                    count += 1
                    pending.clear()
            return count

        return visit(self.ops, set())


def _reads(op: Op) -> int | None:
    """The reduction result ``op`` reads, if any."""
    if isinstance(op, Scale):
        return op.source
    if isinstance(op, Gate) and isinstance(op.decide, Decide):
        return op.decide.source
    if isinstance(op, Map):
        return op.totals
    return None


@dataclass(eq=False)
class Resolved:
    """A binding at one step: its ``values``, and its inner transform's ``nodes`` (built
    from them at first use: a backend that reads only the values builds nothing)."""

    values: dict[str, Any]
    spec: Injected  # the node the values are of (for an inner binding: the outer's build)
    built: list[Spec] | None = None

    @property
    def nodes(self) -> list[Spec]:
        if self.built is None:
            self.built = nodes_of(describe(self.spec.build(self.values)))
        return self.built


def resolve_binding(program: Program, state: list[Any], resolved: dict[int, Resolved],
                    index: int) -> Resolved:
    """Binding ``index`` at a step whose flat state is ``state``, kept in ``resolved`` (the
    step's, resolved once each): its values read from its state entries, which only its
    `Record` changes, its outer bindings first."""
    found = resolved.get(index)
    if found is None:
        b = program.bindings[index]
        node = b.spec if b.parent is None else resolve_binding(
            program, state, resolved, b.parent[0]).nodes[b.parent[1]]
        if not isinstance(node, Injected):
            raise ValueError(f"the injected transform built from this step's values has "
                             f"{node!r} where an inject_hyperparams was compiled")
        constants = {k: state[i] for k, i in b.hyper if k in b.constants}
        found = resolved[index] = Resolved(node.values_at(state[b.count], constants), node)
    return found


# --- the compiler -----------------------------------------------------------------------

class _Refused(Exception):
    """The compiler does not take a node: the message names it and says why."""


def nodes_of(spec: Spec | None) -> list[Spec]:
    """The nodes of a spec tree, depth first, not entering an `Injected`'s inner transform
    (the order in which a node is found again in an inner transform built anew)."""
    if spec is None:
        return []
    children: Any = ()
    if isinstance(spec, Sequence):
        children = spec.children
    elif isinstance(spec, Select):
        children = spec.children.values()
    elif isinstance(spec, FiniteGuard):
        children = (spec.inner,)
    elif isinstance(spec, Accumulated):
        children = (describe(spec.multi_steps.inner_opt),)
    return [spec, *(node for child in children for node in nodes_of(child))]


class _Compiler:
    def __init__(self, params: Any, treespec: _core.TreeSpec, param_leaves: list[Any],
                 state_leaves: list[Any]) -> None:
        self.params = params
        self.treespec = treespec
        self.param_leaves = param_leaves
        self.state_leaves = state_leaves
        self.bindings: list[Binding] = []
        self.reductions = 0
        self.windows = 0
        # the innermost binding being compiled and its inner spec's nodes
        self.inside: tuple[int, list[Spec]] | None = None

    def reduction(self) -> int:
        self.reductions += 1
        return self.reductions - 1

    def bound(self, spec: Spec) -> tuple[int, int] | None:
        if self.inside is None:
            return None
        binding, found = self.inside
        at = [j for j, node in enumerate(found) if node is spec]
        if not at:
            raise _Refused(f"{spec!r} is not found again in its injected transform")
        return binding, at[0]

    def rule(self, spec: Spec, idx: Any, slots: tuple[str, ...], elementwise: bool,
             where: str) -> Rule:
        return Rule(spec, idx, slots, elementwise, where, self.bound(spec))

    def node(self, spec: Spec | None, idx: Any, sel: tuple[int, ...], where: str,
             ) -> list[Op]:
        if spec is None:
            raise _Refused(f"{where or '<root>'}: a transform without a spec (one written by "
                           f"hand or wrapped), which only its own update can compute")
        if isinstance(spec, Sequence):
            return self.sequence(spec, idx, sel, where)
        if isinstance(spec, Select):
            return self.select(spec, idx, sel, where)
        if isinstance(spec, GlobalNormClip):
            out = self.reduction()
            clip = self.rule(spec, idx, (), True, where)
            return [Reduce("sumsq", sel, out), Scale(clip, sel, out)]
        if isinstance(spec, FiniteGuard):
            return self.guard(spec, idx, sel, where)
        if isinstance(spec, Injected):
            return self.injected(spec, idx, sel, where)
        if isinstance(spec, Leafwise):
            return self.leafwise(spec, idx, sel, where)
        if isinstance(spec, Accumulated):
            return self.accumulated(spec, idx, sel, where)
        raise _Refused(f"{where or '<root>'}: {type(spec).__name__} has no program yet")

    def sequence(self, spec: Sequence, idx: Any, sel: tuple[int, ...], where: str,
                 ) -> list[Op]:
        parts = spec.states(idx)
        if parts is None:
            raise _Refused(f"{where or '<root>'}: the state has {len(idx)} entries for "
                           f"{len(spec.children)} transforms")
        ops: list[Op] = []
        for child, sub, label in parts:
            ops += self.node(child, sub, sel, f"{where}[{label}]")
        return ops

    def select(self, spec: Select, idx: Any, sel: tuple[int, ...], where: str) -> list[Op]:
        chosen = set(sel)
        tree = self.params if len(sel) == len(self.param_leaves) else _core.unflatten(
            self.treespec, [p if i in chosen else None for i, p in enumerate(self.param_leaves)])
        groups = spec.select(tree, self.treespec, _core.flatten(tree)[0])
        ops: list[Op] = []
        for key, child in spec.children.items():
            mine = set(groups.get(key, ()))
            ops += self.node(child, spec.state_of(idx, key), tuple(i for i in sel if i in mine),
                             f"{where}.{spec.name}[{key!r}]")
        return ops

    def guard(self, spec: FiniteGuard, idx: Any, sel: tuple[int, ...], where: str,
              ) -> list[Op]:
        out = self.reduction()
        then = self.node(spec.inner, idx.inner_state, sel, f"{where}.apply_if_finite")
        zero = self.zeroing(f"{where}.apply_if_finite(skipped)")
        decide = Decide(out, idx.notfinite_count, idx.last_finite, idx.total_notfinite,
                        spec.max_consecutive_errors)
        return [Reduce("nonfinite", sel, out),
                Gate(decide, tuple(then), (Map(zero, sel),), sel)]

    def zeroing(self, where: str) -> Rule:
        """A skip branch's rule: ``set_to_zero``, whose zeros have the updates' dtypes."""
        tx = set_to_zero()
        zero = describe(tx)
        assert zero is not None
        # (its state has no leaves: the state itself stands for its index tree)
        return Rule(zero, tx.init(None), (), True, where)

    def accumulated(self, spec: Accumulated, idx: Any, sel: tuple[int, ...], where: str,
                    ) -> list[Op]:
        if not isinstance(idx, MultiStepsState):
            raise _Refused(f"{where or '<root>'}: the state of a MultiSteps is "
                           f"{type(idx).__name__}, not a MultiStepsState")
        rule = self.rule(spec, idx, ("acc_grads",), True, where)
        out = self.windows
        self.windows += 1
        inner = self.node(describe(spec.multi_steps.inner_opt), idx.inner_opt_state, sel,
                          f"{where}.MultiSteps")
        taken = Accumulate(rule, sel, out)
        zero = self.zeroing(f"{where}.MultiSteps(accumulating)")
        return [Gate(Window(rule, sel, out), (taken, *inner), (taken, Map(zero, sel)), sel)]

    def injected(self, spec: Injected, idx: Any, sel: tuple[int, ...], where: str,
                 ) -> list[Op]:
        parent = self.bound(spec)
        binding = len(self.bindings)
        hyper = tuple((k, idx.hyperparams[k]) for k in spec.names)
        constants = tuple(k for k in spec.names if k not in spec.schedules)
        self.bindings.append(Binding(idx.count, hyper, constants, spec, parent))
        # built from the state's values, as a step builds it (outer bindings' values too)
        built = spec.values_at(self.state_leaves[idx.count],
                               {k: self.state_leaves[i] for k, i in hyper if k in constants})
        inner = describe(spec.build(built))
        outer, self.inside = self.inside, (binding, nodes_of(inner))
        try:
            ops = self.node(inner, idx.inner_state, sel, f"{where}.inject_hyperparams")
        finally:
            self.inside = outer
        return [*ops, Record(binding)]

    def leafwise(self, spec: Leafwise, idx: Any, sel: tuple[int, ...], where: str,
                 ) -> list[Op]:
        facts = rule_facts(spec)
        if isinstance(facts, str):
            raise _Refused(f"{where or '<root>'}: {facts}")
        slots, elementwise = facts
        if spec.update is None:
            raise _Refused(f"{where or '<root>'}: {spec.kind} carries no update")
        rule = self.rule(spec, idx, slots, elementwise, where)
        if spec.sums is None or spec.finish is None:
            return [Map(rule, sel)]
        out = self.reduction()
        return [Reduce("sums", sel, out, rule), Map(rule, sel, out)]


def compile_program(tx: Any, params: Any, treespec: _core.TreeSpec,
                    param_leaves: list[Any], state_leaves: list[Any],
                    state_spec: _core.TreeSpec) -> Program:
    """The program of ``tx`` on these params and this (flattened) state, or a program with
    the reason it has none."""
    n = len(param_leaves)
    if isinstance(tx, MultiSteps):  # (a class of its own: its transform has the spec)
        tx = tx.gradient_transformation()
    spec = describe(tx)
    compiler = _Compiler(params, treespec, param_leaves, state_leaves)
    index = _core.unflatten(state_spec, list(range(len(state_leaves))))
    try:
        ops = compiler.node(spec, index, tuple(range(n)), "")
    except _Refused as refused:
        return Program(n, (), reason=str(refused))
    except (AttributeError, KeyError, TypeError, IndexError, ValueError) as error:
        return Program(n, (), reason=f"the state does not fit the transform's spec ({error})")
    return Program(n, (*ops, Write()), tuple(compiler.bindings), compiler.reductions)
