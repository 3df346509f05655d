"""What the planner writes down for a transform (see ``functopt/fast/_planner.py``): per
leaf its *program*, the rules in order (`_Op`, `_Clip`, `_Guard`), and in `Structure` the
state entries every step moves; the bindings of the rules' hyperparameters (`_Const`,
`_Hyper`, `_Scheduled`, `_Negated`) and `_Env`, which resolves them at each step; the search
of a spec tree for the rules an injected transform rebuilds."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from functopt._spec import FiniteGuard, Injected, Leafwise, Select, Sequence, Spec, describe
from functopt.fast._errors import CaptureError
from functopt.transforms import _common
from functopt.transforms.multi_steps import Accumulated
from functopt.tree import _ops

__all__ = ["CLOSING", "MINI", "Accumulation", "Structure", "accumulated_specs", "injected_spec"]

# --- where a hyperparameter's value comes from at run time ------------------------------


@dataclass(frozen=True, eq=False)
class _Const:
    value: Any

    def __call__(self, env: _Env) -> Any:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)


@dataclass(frozen=True, eq=False)
class _Hyper:
    """``state.hyperparams[key]`` of the ``node``-th injected transform (this step's value)."""

    node: int
    key: str

    def __call__(self, env: _Env) -> Any:
        return env.hyper[self.node][self.key]

    def __repr__(self) -> str:
        return f"hyperparams[{self.key!r}]"


@dataclass(frozen=True, eq=False)
class _Scheduled:
    """``schedule(count)``, the count read from the state entry ``count``."""

    schedule: Callable[[Any], Any]
    count: int
    owner: str = "schedule"  # the transform and argument, for the error of a bad value
    arg: str = "schedule"

    def __call__(self, env: _Env) -> Any:
        env.volatile = True  # a value of the count: another at every step
        # checked as the pure path checks it: a number or a 0-d tensor
        return _common.schedule_value(self.owner, self.arg, self.schedule,
                                      env.leaves[self.count])

    def __repr__(self) -> str:
        return "schedule(count)"


@dataclass(frozen=True, eq=False)
class _Negated:
    inner: Any

    def __call__(self, env: _Env) -> Any:
        return -self.inner(env)

    def __repr__(self) -> str:
        return f"-{self.inner!r}"


@dataclass
class _Env:
    leaves: list[Any]  # the flat state
    hyper: list[dict[str, Any]]  # per injected node: this step's hyperparameters
    # the planner's memo of host reads: id(tensor) -> (weakref, version, value)
    reads: dict[int, tuple[Any, int, float]] = field(default_factory=dict)
    # per injected node: its build, and its inner transform's spec built from this step's
    # values (for the compiled and per-leaf tiers, which run the rules' own updates, and the
    # injections inside it), made when first asked
    builds: list[Any] = field(default_factory=list)
    built: dict[int, Spec | None] = field(default_factory=dict)
    # whether a value read depends on more than the tensors in ``log`` (a count, a rebuilt
    # rule): then what this step resolved is not kept for the next (see `_Steady`)
    volatile: bool = False
    log: list[torch.Tensor] = field(default_factory=list)  # the tensors `number` read

    def spec_of(self, rebuild: tuple[int, int]) -> Leafwise:
        """The spec of the rule at ``rebuild`` (see ``_Op.rebuild``) in the injected
        transform built from this step's hyperparameters (built once per step)."""
        node, position = rebuild
        found: Leafwise = _specs_of(self.inner(node), Leafwise)[position]
        return found

    def inner(self, node: int) -> Spec | None:
        """The spec of the ``node``-th injection's inner transform built from this step's
        hyperparameters (built once per step)."""
        self.volatile = True
        if node not in self.built:
            self.built[node] = describe(self.builds[node](self.hyper[node]))
        return self.built[node]

    def resolve(self, injections: list[_Injection]) -> None:
        """This step's hyperparameters and build of every injection, outer ones first: an
        injection inside another is the one in the outer's inner transform built from the
        outer's values (its schedules, its static arguments), as the pure outer update
        builds it."""
        for inj in injections:
            values_at, build = inj.values_at, inj.build
            if inj.parent is not None:
                node, position = inj.parent
                spec: Injected = _specs_of(self.inner(node), Injected)[position]
                values_at, build = spec.values_at, spec.build
            constants = {k: self.leaves[inj.hyper[k]] for k in inj.constants}
            self.hyper.append(values_at(self.leaves[inj.count], constants))
            self.builds.append(build)

    def number(self, value: Any) -> float:
        """A hyperparameter as the Python float the kernels take. A tensor is read on the
        host once and remembered while it is the same, unmodified tensor (its version
        counter unchanged): an injected constant costs one read, not one per step (on an
        accelerator each read is a synchronisation)."""
        if not isinstance(value, torch.Tensor):
            return float(value)
        self.log.append(value)
        found = self.reads.get(id(value))
        if found is not None and found[0]() is value and found[1] == value._version:
            return found[2]
        if _ops._recording():
            raise CaptureError(
                f"a recorded step cannot read a hyperparameter tensor on the host (one of "
                f"shape {tuple(value.shape)} on {value.device} that the kernels take as a "
                f"Python number, and which is not the one the warm-up steps read: a "
                f"schedule of the count, say). Fix: inject only the learning rate (the "
                f"kernels read it as a tensor), make the others Python numbers, or step "
                f"without capture.")
        number = float(value.item())
        if len(self.reads) > 64:
            self.reads.clear()
        self.reads[id(value)] = (weakref.ref(value), value._version, number)
        return number


# --- programs -----------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class _Op:
    """One elementwise rule of a leaf's program; ``node`` identifies the transform (leaves
    of one transform share it, and so do their bindings)."""

    kind: str  # the rule's name (its spec's kind)
    args: dict[str, Any]  # name -> binding (_Const, _Hyper, _Scheduled, _Negated)
    slots: dict[str, int]  # per-leaf state entries (flat state indices): "mu", "nu", "trace"
    node: int
    count: int | None = None  # the flat index of the transform's step count
    # for the compiled tier: the transform's own update, the index tree of its state (the
    # state with flat state indices for leaves), and whether it sits in inject_hyperparams
    fn: Any = None
    state_at: Any = None
    injected: bool = False
    # inside inject_hyperparams: (the innermost injection's index, the position of this
    # rule's spec among the Leafwise specs of its inner transform), to find its update again
    # in the inner transform built from this step's values (see `_Env.resolve`)
    rebuild: tuple[int, int] | None = None
    # a PerLeaf rule (not elementwise): the per-leaf tier runs ``grouped`` (or ``fn``)
    perleaf: bool = False
    grouped: Any = None
    # a rule with tree sums (Leafwise.sums / .finish): its update's two halves
    sums: Any = None
    finish: Any = None
    kernel: str | None = None  # its part of the fused kernels (its spec's ``kernel``)

    def __repr__(self) -> str:
        return self.kind

    def at(self, slots: dict[str, int]) -> _Op:
        """This rule with one leaf's per-leaf state entries: a copy of its fields (the
        dataclass's __init__ sets them one by one, and a walk makes one rule per leaf)."""
        op = object.__new__(_Op)
        op.__dict__.update(self.__dict__, slots=slots)
        return op


@dataclass(frozen=True, eq=False)
class _Clip:
    """A global-norm clip: ``index`` into the structure's clips."""

    index: int
    max_norm: Any  # binding

    @property
    def kind(self) -> str:
        return "clip_by_global_norm"

    def __repr__(self) -> str:
        return "clip_by_global_norm"


@dataclass(frozen=True, eq=False)
class _Guard:
    """``apply_if_finite``: ``index`` into the structure's guards."""

    index: int

    @property
    def kind(self) -> str:
        return "apply_if_finite"

    def __repr__(self) -> str:
        return "apply_if_finite"


@dataclass
class _GuardState:
    """Where an ``apply_if_finite`` keeps its counters, and what it checks."""

    notfinite_count: int  # flat state indices
    last_finite: int
    total_notfinite: int
    max_consecutive_errors: int
    leaves: list[int]  # the leaves whose updates it checks


@dataclass
class _NanZeroing:
    """A ``zero_nans`` before every rule of its leaves: its update of one leaf (see
    ``ZeroNans.zeroed``) and, per leaf it sees, the flat index of its ``found_nan`` flag."""

    zeroed: Callable[[Any], tuple[Any, Any]]
    flags: list[tuple[int, int]]  # (leaf, flat state index of state.found_nan[leaf])


@dataclass
class _Injection:
    count: int  # flat index of the injected transform's count
    hyper: dict[str, int]  # key -> flat index of state.hyperparams[key]
    constants: tuple[str, ...]
    values_at: Callable[[Any, dict[str, Any]], dict[str, Any]]
    guard: int | None = None  # the apply_if_finite it sits in
    build: Callable[[dict[str, Any]], Any] | None = None  # the inner transform from values
    # inside another injection: (that one's index, the position of this one's spec among the
    # Injected specs of its inner transform), to find it again in the inner transform built
    # from this step's values (see `_Env.resolve`)
    parent: tuple[int, int] | None = None


@dataclass
class Structure:
    """What the walk found: per leaf its program, plus the state entries every step moves."""

    programs: list[list[Any]]
    counters: list[int] = field(default_factory=list)  # flat indices of counts to advance
    injections: list[_Injection] = field(default_factory=list)
    clips: list[list[int]] = field(default_factory=list)  # leaves each clip measures
    clip_bounds: list[Any] = field(default_factory=list)  # each clip's max_norm binding
    guards: list[_GuardState] = field(default_factory=list)
    # each leading zero_nans, in chain order: its per-leaf function and (leaf, flag index)
    zero_nans: list[_NanZeroing] = field(default_factory=list)
    counter_guard: dict[int, int] = field(default_factory=dict)  # counter -> its guard
    opaque: list[str] = field(default_factory=list)  # why the whole step must stay pure
    nodes: int = 0
    # per leaf: match(program) and the plan's key (None with a reason), computed once
    matched: list[Any] | None = None
    matched_compiled: list[Any] | None = None  # the same with the compiled tier
    matched_compiled_first: list[Any] | None = None  # and with it first (the mixed step)
    compiled: dict[Any, Any] = field(default_factory=dict)  # the compiled tier's functions
    # the rules (nodes) that keep state beside their count that only their update moves
    shared: set[int] = field(default_factory=set)
    treespec: Any = None  # the params' structure (the per-leaf tier rebuilds trees)
    perleaf: bool = False  # some rule is a PerLeaf one: the per-leaf tier is on
    tree_wide: list[int] = field(default_factory=list)  # the rules with tree sums
    # a MultiSteps inside a combinator (functopt/fast/_inside.py): where it is and what it
    # sees; the walk's ``mode`` says which of its steps the programs are
    accumulation: Accumulation | None = None
    # MINI mode: its leaves whose zero updates reach other rules after it; the step hands
    # the kernels zero gradients there (the other leaves of it take set_to_zero)
    zeroed: list[int] = field(default_factory=list)
    # the flat state indices of the rules' per-leaf state entries, as the walk met them
    slots: list[int] = field(default_factory=list)

    @functools.cached_property
    def counter_indices(self) -> list[int]:
        """``counters`` without repeats, in order."""
        return list(dict.fromkeys(self.counters))

    @functools.cached_property
    def slot_indices(self) -> list[int]:
        """The flat state indices of every per-leaf state entry (moments, traces)."""
        return sorted(set(self.slots))


@dataclass(frozen=True, eq=False)
class Accumulation:
    """A ``MultiSteps`` the walk met inside a combinator (``masked``, ``partition``,
    ``inject_hyperparams``, a chain beside them), first on its leaves."""

    multi_steps: Any  # the MultiSteps (inside an injection: built from the placeholders)
    state_at: Any  # its state, with flat state indices for leaves (a MultiStepsState)
    leaves: tuple[int, ...]  # the leaves it sees
    where: str  # its place in the transform, for explain
    # inside inject_hyperparams: (the injection's index, the position of its spec among the
    # Accumulated specs of the inner transform), to find it again in the inner transform
    # built from this step's values (its window is decided by that one); else None
    rebuild: tuple[int, int] | None = None
    guard: int | None = None  # the apply_if_finite it sits in (its index in ``guards``)


# The walk's modes for a MultiSteps inside a combinator (`Accumulation`): its closing
# mini-step (its inner transform on its state's inner_opt_state) or another mini-step (zero
# updates: set_to_zero on its leaves); None: it is opaque.
CLOSING, MINI = "closing", "mini"

_LR_KINDS = ("learning_rate", "scale", "schedule")  # the rules' kernel parts that are an lr


def accumulated_specs(spec: Spec | None) -> list[Accumulated]:
    """The ``MultiSteps`` specs of a transform's spec tree, in `_specs_of`'s order (see
    `Accumulation.rebuild`)."""
    return _specs_of(spec, Accumulated)


def _specs_of(spec: Spec | None, kind: type[Any]) -> list[Any]:
    """The specs of ``kind`` in a spec tree, depth first (the order in which an injected
    transform built again from new values is searched for the same rule)."""
    if isinstance(spec, kind):
        return [spec]
    children: Any = ()
    if isinstance(spec, Sequence):
        children = spec.children
    elif isinstance(spec, Select):
        children = spec.children.values()
    elif isinstance(spec, FiniteGuard):
        children = (spec.inner,)
    elif isinstance(spec, Accumulated):
        children = (describe(spec.multi_steps.inner_opt),)
    # (an injection inside: its rules are not searched, see _Op.rebuild)
    return [x for child in children for x in _specs_of(child, kind)]


def injected_spec(structure: Structure, state_leaves: list[Any], node: int) -> Spec | None:
    """The spec of the ``node``-th injection's inner transform built from this step's
    hyperparameters (those of the injections around it too), as the pure update builds it."""
    env = _Env(state_leaves, [])
    env.resolve(structure.injections[:node + 1])  # (the outer ones come first)
    return env.inner(node)
