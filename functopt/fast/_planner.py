r"""The step planner: lowers a composed transform to fused kernels, per group of leaves.

Speed belongs to the transform as the user composed it. The planner reads the transform's
spec (``functopt/_spec.py``) together with its state, and writes down, for every leaf, the
*program* the pure path runs on it: the elementwise rules in order (``scale_by_adam``,
``add_decayed_weights``, the learning rate, ...) with the state entries each reads and
writes, and the global-norm clips that scale it. ``chain``, ``named_chain``, ``masked``,
``partition`` and ``inject_hyperparams`` only decide which leaves a rule sees and where its
state lives, so they disappear in the programs: ``adamw(mask=no_bias)`` gives the weights
the program "Adam, decay, lr" and the biases "Adam, lr".

Programs are then matched against the patterns PyTorch has a fused multi-tensor kernel
for, and the leaves are grouped by (device, dtype, kernel, hyperparameters, clip):

=============================================  ===========================================
program (after an optional leading clip)       kernel
=============================================  ===========================================
``scale_by_adam``, [``add_decayed_weights``],  ``torch._fused_adamw_`` (weight decay 0 where
learning rate                                  the decay is masked off)
[``add_decayed_weights``], [``trace`` or       ``torch._fused_sgd_`` (the decay before the
``dampened_trace``], learning rate             momentum: torch.optim.SGD's weight_decay;
                                               dampening and is_first_step for the latter)
``set_to_zero``                                nothing to do (a frozen group)
=============================================  ===========================================

A leading ``clip_by_global_norm`` (over all leaves or a masked subset) and the unscaling of
a mixed-precision step are folded into the kernel's ``grad_scale``; a skipped step into
its ``found_inf``. The norms every clip needs come from one local ``foreach`` pass and, on
sharded params, one all-reduce of a packed vector: one collective per step whatever the
chain (a rule with tree sums of its own, Prodigy's, has them in the same all-reduce,
unless a clip's factor must be known before its sums are taken: then in a second, see
``_tree_totals``). Anything else (a rule without a kernel, a clip after the moments, an opaque
transform) keeps the pure path for the whole step, and the reason is reported by
[`explain`][functopt.fast.explain] and by a one-time
[`FastPathWarning`][functopt.fast.FastPathWarning].

What the planner checks at every step, since the kernels read memory linearly: each
leaf's value, gradient and moments share dtype, shape and strides and are dense (a
gradient laid out differently is copied into its param's layout first); a leaf that
overlaps itself (an expanded tensor) or two leaves sharing storage (tied weights) cannot be
written in place and raise when donated, as do per-leaf state entries (which a donated fast
step writes in place) sharing memory with each other or with a param.

The structural part of a plan (the walk, the masks and labels, the injected factory's
spec) depends only on the transform and the tree structures, and is cached by the step
function per (params structure, state structure): a mask or label *function* is called
once per structure, not at every step as on the pure path.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from functopt._base import GradientTransformation
from functopt._collective import stats
from functopt._collective.dtensor import (
    _infer_group,
    _leaf_names,
    _rewrap_like,
    is_dtensor,
    local_tensor,
)
from functopt._spec import (
    FiniteGuard,
    GlobalNormClip,
    Injected,
    Leafwise,
    PerLeaf,
    Select,
    Sequence,
    Spec,
    ZeroNans,
    describe,
)
from functopt.fast import _compiled, _multi, _perleaf, _staged
from functopt.fast._layout import dense as _dense
from functopt.fast._layout import overlapping
from functopt.transforms import _common
from functopt.transforms.multi_steps import Accumulated
from functopt.tree import _core, _ops

__all__ = ["Lowered", "Structure", "lower", "match", "run", "walk"]

# The dtypes PyTorch's fused optimizer kernels accept (params, grads and moments alike).
_KERNEL_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# torch._fused_sgd_ on the CPU skips the update of every full SIMD block of float16 and
# bfloat16 params and writes wrong momentum buffers (pytorch/pytorch#191763, fixed after
# 2.13 by #192545), so SGD takes its kernel on the CPU for these dtypes only.
_SGD_CPU_DTYPES = (torch.float64, torch.float32)

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
        found: Leafwise = leafwise_specs(self.inner(node))[position]
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

    def update_of(self, rebuild: tuple[int, int]) -> Any:
        """The update of the rule at ``rebuild`` in the injected transform built from this
        step's hyperparameters."""
        return self.spec_of(rebuild).update

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


class _Walk:
    def __init__(self, params: Any, treespec: _core.TreeSpec, param_leaves: list[Any],
                 state_leaves: list[Any], mode: str | None = None) -> None:
        self.params = params
        self.treespec = treespec
        self.param_leaves = param_leaves
        self.state_leaves = state_leaves
        self.out = Structure(programs=[[] for _ in param_leaves])
        self.placeholders: dict[int, Any] = {}  # id(placeholder tensor) -> _Hyper
        self.guard: int | None = None  # the apply_if_finite the walk is inside
        # the (innermost) injection the walk is inside and its inner Leafwise specs
        self.injecting: tuple[int, list[Leafwise]] | None = None
        self.mode = mode  # CLOSING, MINI or None (see `Accumulation`)
        # per injection walked: the Accumulated and the Injected specs of its inner transform
        self.accumulating: list[list[Accumulated]] = []
        self.injections: list[list[Injected]] = []
        # per leaf under a leading apply_if_finite: its program's length when the guard's
        # inner transform ended, and where the guard is (see `after_guards`)
        self.guard_ends: dict[int, tuple[int, str]] = {}

    def after_guards(self) -> None:
        """A leading guard folds into the kernels' skip of the whole program, which is what
        the pure path does only where the rules after the guard (outside it: the guard hands
        them zero updates on a skipped step) leave zeros at zero and their state as it is:
        the learning rates. Any other rule there (a decay, a momentum, on leaves the guard's
        inner transform passes through, say) keeps the step pure."""
        for i, (end, where) in self.guard_ends.items():
            after = [op.kind for op in self.out.programs[i][end:]
                     if op.kind != "identity" and getattr(op, "kernel", None) not in _LR_KINDS]
            if after:
                self.out.opaque.append(
                    f"{where}: {after[0]} after apply_if_finite on the leaves it checks has "
                    f"no fast form (on a skipped step it runs on the guard's zero updates, "
                    f"which the kernels' skip does not)")
                return

    def counter(self, index: int) -> None:
        self.out.counters.append(index)
        if self.guard is not None:
            self.out.counter_guard[index] = self.guard

    def node(self) -> int:
        self.out.nodes += 1
        return self.out.nodes

    def bind(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and id(value) in self.placeholders:
            return self.placeholders[id(value)]
        return _Const(value)

    def per_leaf(self, index_tree: Any, what: str) -> list[int]:
        try:
            indices: list[int] = self.treespec.flatten_up_to(index_tree)  # type: ignore[assignment]
            return indices
        except (ValueError, TypeError):
            raise _Mismatch(f"its state.{what} does not have the params' structure") from None

    def walk(self, spec: Spec | None, idx: Any, sel: list[int], where: str) -> None:
        if spec is None:
            self.out.opaque.append(
                f"{where or '<root>'}: a transform without a spec (one written by hand or "
                f"wrapped, which only its own update can compute; functopt.elementwise_rule "
                f"and functopt.per_leaf_rule describe a rule of your own)")
        elif isinstance(spec, Sequence):
            parts = spec.states(idx)
            if parts is None:
                raise _Mismatch(f"{where}: the state has {len(idx)} entries for "
                                f"{len(spec.children)} transforms")
            for child, sub, label in parts:
                self.walk(child, sub, sel, f"{where}[{label}]" if where else f"[{label}]")
        elif isinstance(spec, Select):
            chosen = set(sel)
            tree = self.params if len(sel) == len(self.param_leaves) else _core.unflatten(
                self.treespec, [p if i in chosen else None
                                for i, p in enumerate(self.param_leaves)])
            groups = spec.select(tree, self.treespec, _core.flatten(tree)[0])
            for key, child in spec.children.items():
                mine = set(groups.get(key, ()))
                self.walk(child, spec.state_of(idx, key), [i for i in sel if i in mine],
                          f"{where}.{spec.name}[{key!r}]")
        elif isinstance(spec, GlobalNormClip) and spec.finish is not None and any(
                not isinstance(op, _Guard) and op.kind != "identity"
                for i in sel for op in self.out.programs[i]):
            # a clip after other rules: the norm of their updates, which no gradient pass
            # measures; the compiled tier lowers it as a rule with tree sums (the sums pass
            # runs the rules before it), the kernels do not
            node = self.node()
            max_norm = self.bind(spec.max_norm)
            if not isinstance(max_norm, _Const):
                self.out.opaque.append(f"{where}: clip_by_global_norm after other rules "
                                       f"with an injected max_norm has no fast form")
                return
            self.out.tree_wide.append(node)
            sums, finish = spec.sums, spec.finish
            assert sums is not None
            late = _Op("clip_by_global_norm", {"max_norm": max_norm}, {}, node,
                       fn=lambda u, state, p: finish(u, state, p, sums(u, state, p)),
                       state_at=idx, sums=sums, finish=finish)
            for i in sel:
                self.out.programs[i].append(late)
        elif isinstance(spec, GlobalNormClip):
            clip = _Clip(len(self.out.clips), self.bind(spec.max_norm))
            self.out.clips.append(list(sel))
            self.out.clip_bounds.append(clip.max_norm)
            for i in sel:
                self.out.programs[i].append(clip)
        elif isinstance(spec, Injected):
            self.injected(spec, idx, sel, where)
        elif isinstance(spec, FiniteGuard) and self.guard is None and not all(
                self._leading(self.out.programs[i], sel) for i in sel):
            self.late_guard(spec, idx, sel, where)
        elif isinstance(spec, FiniteGuard):
            if self.guard is not None:
                self.out.opaque.append(f"{where}: apply_if_finite inside apply_if_finite")
                return
            mark = _Guard(len(self.out.guards))
            self.out.guards.append(_GuardState(
                idx.notfinite_count, idx.last_finite, idx.total_notfinite,
                spec.max_consecutive_errors, list(sel)))
            for i in sel:
                program = self.out.programs[i]
                if self._clip_only(program, sel):
                    # chain(clip_by_global_norm, apply_if_finite(...)): the guard checks
                    # the clipped gradients, which are finite exactly when the gradients
                    # are (the factor is at most 1; a nan or inf among the leaves the
                    # clip measures, all of them checked here, makes every checked leaf
                    # non-finite or leaves one non-finite): it is the leading guard
                    program.insert(len(program) - 1, mark)
                else:
                    program.append(mark)
            self.guard = mark.index
            self.walk(spec.inner, idx.inner_state, sel, f"{where}.apply_if_finite")
            self.guard = None
            for i in sel:
                self.guard_ends[i] = (len(self.out.programs[i]), where or "<root>")
        elif isinstance(spec, ZeroNans):
            self.zero_nans(spec, idx, sel, where)
        elif isinstance(spec, Leafwise):
            self.leafwise(spec, idx, sel, where)
        elif isinstance(spec, Accumulated):
            self.accumulated(spec, idx, sel, where or "<root>")
        else:  # a Spec subclass of a later layer that this planner does not know
            self.out.opaque.append(f"{where}: {type(spec).__name__} has no lowering")

    def accumulated(self, spec: Accumulated, idx: Any, sel: list[int], where: str) -> None:
        """A ``MultiSteps`` that `_multi.Split` did not take. It is lowered where it is the
        first rule of its leaves (it then sees their gradients, which the step accumulates
        and decides its window on; a leading ``apply_if_finite`` around it checks them):
        recorded in ``accumulation``, and walked as the mode says."""
        reason = None
        if self.out.accumulation is not None:
            reason = "a second MultiSteps in one transform has no fast form"
        elif any(i in set(sel) for zeroing in self.out.zero_nans for i, _ in zeroing.flags):
            reason = ("MultiSteps after zero_nans has no fast form (it decides its window on "
                      "the gradients as zero_nans leaves them)")
        elif any(op.kind != "identity" and not (isinstance(op, _Guard)
                                                and op.index == self.guard)
                 for i in sel for op in self.out.programs[i]):
            reason = ("MultiSteps after other rules of its leaves has a fast form only as an "
                      "element of a chain of per-leaf rules and clips (inside masked, "
                      "partition or inject_hyperparams it must come first)")
        if reason is not None:
            self.out.opaque.append(f"{where}: {reason}")
            return
        rebuild = None
        if self.injecting is not None:
            at = [j for j, other in enumerate(self.accumulating[self.injecting[0]])
                  if other is spec]
            if not at:
                self.out.opaque.append(f"{where}: a MultiSteps inside inject_hyperparams that "
                                       f"the planner does not find again in it")
                return
            rebuild = (self.injecting[0], at[0])
        ms = spec.multi_steps
        self.out.accumulation = Accumulation(ms, idx, tuple(sel), where, rebuild, self.guard)
        if self.mode is None:
            self.out.opaque.append(f"{where}: {_multi.NOT_SPLIT}")
        elif self.mode == CLOSING:
            self.walk(describe(ms.inner_opt), idx.inner_opt_state, sel, f"{where}.MultiSteps")
        else:  # its zero updates (see `zero_updates`)
            node = self.node()
            for i in sel:
                self.out.programs[i].append(_Op("set_to_zero", {}, {}, node, kernel="zero"))

    def zero_updates(self) -> None:
        """A mini-step's zero updates, where rules come after the ``MultiSteps`` (a masked
        decay, a learning rate): as it is the first rule of its leaves, those rules see
        what they would see if the leaves' gradients were zeros, so the step gives them
        zero gradients (``zeroed``) and the programs lose the ``set_to_zero``, which the
        kernels take only last."""
        acc = self.out.accumulation
        if self.mode != MINI or acc is None:
            return
        for i in acc.leaves:
            program = self.out.programs[i]
            at = next(j for j, op in enumerate(program) if op.kind == "set_to_zero")
            if any(op.kind != "identity" for op in program[at + 1:]):
                del program[at]
                self.out.zeroed.append(i)

    def zero_nans(self, spec: ZeroNans, idx: Any, sel: list[int], where: str) -> None:
        """A ``zero_nans`` before every rule of its leaves runs on the gradients before the
        step's reductions (the clips measure, and the guards check, the zeroed gradients);
        its DTensor leaves' flags join the step's packed all-reduce."""
        if self.guard is not None or self.injecting is not None or any(
                op.kind != "identity" for i in sel for op in self.out.programs[i]):
            self.out.opaque.append(
                f"{where}: zero_nans has a fast form only before every other rule of its "
                f"leaves, outside apply_if_finite and inject_hyperparams")
            return
        flags = self.per_leaf(idx.found_nan, "found_nan")
        self.out.zero_nans.append(_NanZeroing(spec.zeroed, [(i, flags[i]) for i in sel]))

    def _leading(self, program: list[Any], sel: list[int]) -> bool:
        """Whether a guard over ``sel`` that comes after ``program`` so far checks what a
        leading guard checks: nothing but identities before it, or one clip that measures
        only leaves among ``sel`` (see ``_clip_only``)."""
        return (all(isinstance(op, _Guard) or op.kind == "identity" for op in program)
                or self._clip_only(program, sel))

    def _clip_only(self, program: list[Any], sel: list[int]) -> bool:
        """Whether ``program`` so far is one clip (identities aside) that measures only
        leaves among ``sel``."""
        ops = [op for op in program if op.kind != "identity"]
        return (len(ops) == 1 and isinstance(ops[0], _Clip)
                and set(self.out.clips[ops[0].index]) <= set(sel))

    def late_guard(self, spec: FiniteGuard, idx: Any, sel: list[int], where: str) -> None:
        """An ``apply_if_finite`` after other rules: its check is of their updates, which no
        gradient pass sees, and its skip spares them. The compiled tier lowers it as one
        rule with tree sums (the non-finite count of the updates entering it, over every
        group and rank), whose update is the guard's own with its inner rules inside, when
        those keep no per-leaf state and measure nothing across leaves (`_guarded_whole`)."""
        if not all(any(not isinstance(op, _Guard) and op.kind != "identity"
                       for op in self.out.programs[i]) for i in sel):
            self.out.opaque.append(f"{where}: apply_if_finite after other rules on some of "
                                   f"its leaves only has no fast form")
            return
        if all(self._clip_only(self.out.programs[i], list(range(len(self.param_leaves))))
               for i in sel):
            self.out.opaque.append(
                f"{where}: apply_if_finite after a clip_by_global_norm that also measures "
                f"leaves outside it has no fast form (a nan there makes every leaf it "
                f"checks nan)")
            return
        if (spec.finish is None or spec.sums is None or self.injecting is not None
                or not _guarded_whole(spec.inner)):
            self.out.opaque.append(
                f"{where}: apply_if_finite after other rules has a fast form (the compiled "
                f"tier's) only around add_decayed_weights, clip, identity, "
                f"keep_params_nonnegative, scale, a learning rate or schedule, scale_by_sign "
                f"or another elementwise rule without per-leaf state or tree sums, outside "
                f"inject_hyperparams")
            return
        node = self.node()
        self.out.tree_wide.append(node)
        self.out.shared.add(node)  # (its counters and inner state move in a group's call)
        sums, finish = spec.sums, spec.finish
        late = _Op("apply_if_finite", {}, {}, node,
                   fn=lambda u, state, p: finish(u, state, p, sums(u, state, p)),
                   state_at=idx, sums=sums, finish=finish)
        for i in sel:
            self.out.programs[i].append(late)

    def injected(self, spec: Injected, idx: Any, sel: list[int], where: str) -> None:
        outer = self.injecting
        parent = None
        if outer is not None:  # (where the walk met it, the outer's inner spec holds it)
            at = [j for j, other in enumerate(self.injections[outer[0]]) if other is spec]
            if not at:
                self.out.opaque.append(f"{where}: an inject_hyperparams inside another that "
                                       f"the planner does not find again in it")
                return
            parent = (outer[0], at[0])
        hyper_idx = {k: idx.hyperparams[k] for k in spec.names}
        node = len(self.out.injections)
        placeholders = {}
        for k, i in hyper_idx.items():
            current = self.state_leaves[i]
            placeholders[k] = (current.detach().clone() if isinstance(current, torch.Tensor)
                               else torch.tensor(current, dtype=torch.float64))
            self.placeholders[id(placeholders[k])] = _Hyper(node, k)
        inner = spec.build(placeholders)
        self.out.injections.append(_Injection(
            count=idx.count, hyper=hyper_idx,
            constants=tuple(k for k in spec.names if k not in spec.schedules),
            values_at=spec.values_at, guard=self.guard, build=spec.build, parent=parent))
        self.counter(idx.count)
        self.injecting = (node, leafwise_specs(describe(inner)))
        self.accumulating.append(accumulated_specs(describe(inner)))
        self.injections.append(_specs_of(describe(inner), Injected))
        self.walk(describe(inner), idx.inner_state, sel, f"{where}.inject_hyperparams")
        self.injecting = outer
        del placeholders  # ids of freed placeholders must not match later tensors
        self.placeholders = {k: v for k, v in self.placeholders.items() if v.node != node}

    def leafwise(self, spec: Leafwise, idx: Any, sel: list[int], where: str) -> None:
        kind, hyper, kernel = spec.kind, spec.hyper, spec.kernel
        node = self.node()
        count = None
        slots: dict[str, list[int]] = {}
        args: dict[str, Any] = {}
        if kernel in ("identity", "zero"):
            pass
        elif kernel == "scale":
            args["step_size"] = self.bind(hyper["step_size"])
        elif kernel == "schedule":
            count = idx.count
            args["step_size"] = _Scheduled(hyper["step_size_fn"], count, kind, "step_size_fn")
        elif kernel in ("learning_rate", "weight_decay"):
            # a number, a 0-d tensor (maybe injected) or a schedule of the rule's own count
            name = kernel
            value = hyper[name]
            if callable(value) and not isinstance(value, torch.Tensor):
                count = idx.count
                args[name] = _Scheduled(value, count, kind, name)
            else:
                args[name] = self.bind(value)
            if kernel == "learning_rate":
                args["flip_sign"] = _Const(hyper["flip_sign"])
        elif kernel in ("adam", "amsgrad"):
            count = idx.count
            args = {k: self.bind(hyper[k]) for k in ("b1", "b2", "eps", "eps_root")}
            args["nesterov"] = _Const(hyper.get("nesterov", False))
            slots = {"mu": self.per_leaf(idx.mu, "mu"), "nu": self.per_leaf(idx.nu, "nu")}
            if kernel == "amsgrad":
                # torch's AMSGrad (the max of the raw second moments, corrected after) is
                # the kernels' amsgrad=True; optax's (the max of corrected ones) is not
                args["torch_variant"] = _Const(
                    bool(hyper.get("correct_after_max")) and hyper.get(
                        "bias_correction_mu", True) is not False and hyper.get(
                        "bias_correction_nu", True) is not False)
                slots["nu_max"] = self.per_leaf(idx.nu_max, "nu_max")
        elif kernel in ("momentum", "dampened_momentum"):
            args = {"decay": self.bind(hyper["decay"]), "nesterov": _Const(hyper["nesterov"])}
            slots = {"trace": self.per_leaf(idx.trace, "trace")}
            if kernel == "dampened_momentum":  # torch.optim.SGD's momentum: torch._fused_sgd_'s
                args["dampening"] = self.bind(hyper["dampening"])
                count = idx.count  # (its first step keeps the gradient: is_first_step)
        elif spec.slots is None:
            # a rule without a known layout: only its own update can compute it
            self.out.opaque.append(
                f"{where}: {kind} has neither a fused kernel nor a compiled lowering (its "
                f"spec names no per-leaf state fields)")
            return
        elif not spec.elementwise:
            # a rule that reduces within a leaf: the per-leaf tier runs its own (grouped)
            # update on a group's leaves; the spec names its per-leaf state entries
            # (its shared state moves only with leaves that have a gradient, PerLeaf's
            # contract: a step where none has one leaves it as it was)
            slots = {f: self.per_leaf(getattr(idx, f), f) for f in spec.slots}
            fields = getattr(idx, "_fields", ())
            count = idx.count if "count" in fields else None
            self.out.perleaf = True
        else:
            # an elementwise rule without a PyTorch kernel: the compiled tier runs its own
            # update on the group's leaves laid end to end; its per-leaf state entries are
            # the fields its spec names, the others (a count, ...) are shared
            slots = {f: self.per_leaf(getattr(idx, f), f) for f in spec.slots}
            fields = getattr(idx, "_fields", ())
            count = idx.count if "count" in fields else None
            if set(fields) - set(slots) - {"count"}:
                self.out.shared.add(node)  # (NAdam's mu_product) moved by a group's call
            if (spec.sums is None) != (spec.finish is None):
                raise _Mismatch(f"{where}: {kind} gives only one half of its update")
            if spec.sums is not None:
                self.out.tree_wide.append(node)
        if count is not None:
            self.counter(count)
        rebuild = None
        if self.injecting is not None:
            at = [j for j, other in enumerate(self.injecting[1]) if other is spec]
            rebuild = (self.injecting[0], at[0]) if at else None
        op = _Op(kind, args, {}, node, count, fn=spec.update,
                 state_at=idx if hasattr(idx, "_fields") else None,
                 injected=bool(self.placeholders), rebuild=rebuild,
                 perleaf=isinstance(spec, PerLeaf), sums=spec.sums, finish=spec.finish,
                 kernel=kernel, grouped=spec.grouped if isinstance(spec, PerLeaf) else None)
        programs = self.out.programs
        if not slots:  # (nothing per leaf: every leaf holds the one rule)
            for i in sel:
                programs[i].append(op)
            return
        names, columns = list(slots), list(slots.values())
        for column in columns:
            self.out.slots.extend([column[i] for i in sel])
        for i in sel:
            programs[i].append(op.at(dict(zip(names, [c[i] for c in columns], strict=True))))


def _guarded_whole(spec: Spec | None) -> bool:
    """Whether an apply_if_finite after other rules may guard ``spec`` on the compiled tier:
    its update runs the inner rules on a group's leaves laid end to end, so they must be
    elementwise, keep no per-leaf state and read no other leaf (no tree sums)."""
    if isinstance(spec, Sequence):
        return all(_guarded_whole(child) for child in spec.children)
    return (isinstance(spec, Leafwise) and spec.elementwise and spec.slots == ()
            and spec.sums is None and spec.kernel != "zero")


def leafwise_specs(spec: Spec | None) -> list[Leafwise]:
    """The Leafwise specs of a transform's spec tree, depth first (the order in which an
    injected transform built again from new values is searched for the same rule)."""
    return _specs_of(spec, Leafwise)


def accumulated_specs(spec: Spec | None) -> list[Accumulated]:
    """The ``MultiSteps`` specs of a transform's spec tree, in the same order (see
    `Accumulation.rebuild`)."""
    return _specs_of(spec, Accumulated)


def _specs_of(spec: Spec | None, kind: type[Any]) -> list[Any]:
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


class _Mismatch(Exception):
    """The state does not have the layout the spec describes (a state of another
    transform): the pure path then raises its own, precise error."""


def walk(tx: GradientTransformation, params: Any, treespec: _core.TreeSpec,
         param_leaves: list[Any], state_leaves: list[Any], state_spec: _core.TreeSpec,
         mode: str | None = None) -> Structure:
    """The programs of ``tx`` on these params and this (flattened) state; ``mode``: which
    step of a ``MultiSteps`` inside a combinator they are (see `Accumulation`)."""
    index_tree = _core.unflatten(state_spec, list(range(len(state_leaves))))
    w = _Walk(params, treespec, param_leaves, state_leaves, mode)
    w.out.treespec = treespec
    try:
        w.walk(describe(tx), index_tree, list(range(len(param_leaves))), "")
        w.zero_updates()
        w.after_guards()
    except (_Mismatch, AttributeError, KeyError, TypeError, IndexError) as error:
        w.out.opaque.append(f"the state does not fit the transform's spec ({error})")
    return w.out


# --- matching programs to kernels ---------------------------------------------------------

@dataclass(frozen=True)
class _KernelPlan:
    """The kernel one leaf's program lowers to, with the bindings of its arguments."""

    kernel: str  # "adamw" (decoupled decay), "adam" (L2 decay), "sgd", "zero", "compiled",
    # "perleaf" (the per-leaf tier, functopt/fast/_perleaf.py)
    clip: _Clip | None
    adam: _Op | None = None
    decay: _Op | None = None
    trace: _Op | None = None
    lr: Any = None  # binding of the (positive) learning rate
    guard: _Guard | None = None  # a leading apply_if_finite: its skip joins found_inf
    maximize: bool = False  # a leading scale(-1): the kernels' maximize flag
    ops: tuple[_Op, ...] = ()  # "compiled": the rules, in order, after the clip

    def at(self, **rules: Any) -> _KernelPlan:
        """This plan with other rules in some fields (one leaf's, which hold its per-leaf
        state entries): a copy of its fields, as `_Op.at` makes."""
        plan = object.__new__(_KernelPlan)
        plan.__dict__.update(self.__dict__, **rules)
        return plan

    def key(self) -> tuple[Any, ...]:
        if self.kernel in ("compiled", "perleaf"):
            return (self.kernel, None if self.guard is None else self.guard.index,
                    None if self.clip is None else self.clip.index,
                    tuple(op.node for op in self.ops))
        return (self.kernel, self.maximize, None if self.guard is None else self.guard.index,
                None if self.clip is None else self.clip.index,
                None if self.adam is None else self.adam.node,
                None if self.decay is None else self.decay.node,
                None if self.trace is None else self.trace.node, id(self.lr))


_LR_KINDS = ("learning_rate", "scale", "schedule")  # the rules' kernel parts that are an lr


def _learning_rate(op: _Op) -> Any | None:
    """The binding of the descent step size of an lr op, or None (an ascent, say)."""
    if op.kernel == "learning_rate":
        flip = op.args["flip_sign"].value
        return op.args["learning_rate"] if flip else None
    if op.kernel in ("scale", "schedule"):
        step = op.args["step_size"]
        if isinstance(step, _Const) and isinstance(step.value, (int, float)):
            return _Const(-step.value) if step.value <= 0 else None
        return _Negated(step)
    return None


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def match(program: list[Any], compiled: bool = False, perleaf: bool = False,
          ) -> _KernelPlan | str:
    """The kernel for one leaf's program, or the reason there is none. ``compiled``: a
    program no kernel covers takes the compiled tier when it can. ``perleaf`` (the
    transform has a rule that reduces within a leaf): a program neither covers takes the
    per-leaf tier when it can."""
    if any(getattr(op, "perleaf", False) for op in program):
        found: _KernelPlan | str = _perleaf.match(program, _KernelPlan)
        return found
    plan = _match_kernel(program)
    if compiled:
        # compiled first, the kernels for what it does not take: Adam and SGD compiled run
        # as fast as their kernels, and in a mixed step the same loop writes the
        # low-precision params (docs/architecture.md, "The compiled mixed step")
        alternative = _match_compiled(program)
        if isinstance(alternative, _KernelPlan):
            return alternative
        if isinstance(plan, str):
            plan = f"{plan}, and {alternative}"
    if isinstance(plan, str) and perleaf:
        alternative = _perleaf.match(program, _KernelPlan)
        plan = alternative if isinstance(alternative, _KernelPlan) else (
            f"{plan}, and {alternative}")
    return plan


def _matches(programs: list[list[Any]], compiled: bool, perleaf: bool,
             ) -> list[tuple[_KernelPlan | str, tuple[Any, ...] | None]]:
    """Per program, `match`'s plan (or reason) and the plan's key (None with a reason).
    Programs of the same rules in the same order (the same nodes, clips and guards) differ
    only in their rules' per-leaf state entries: each such run is matched once, and the
    others take its plan with their own rules in the fields that hold such entries."""
    seen: dict[tuple[Any, ...], tuple[Any, Any, dict[str, Any]]] = {}
    out: list[tuple[_KernelPlan | str, tuple[Any, ...] | None]] = []
    for program in programs:
        signature = tuple([op.node if type(op) is _Op else op for op in program])
        found = seen.get(signature)
        if found is None:
            plan = match(program, compiled, perleaf)
            key = None if isinstance(plan, str) else plan.key()
            # (the positions in the program of the plan's rules with per-leaf entries)
            at: dict[str, Any] = {}
            if not isinstance(plan, str):
                for name in ("adam", "decay", "trace"):
                    op = getattr(plan, name)
                    if op is not None and op.slots:
                        at[name] = next(j for j, x in enumerate(program) if x is op)
                if any(op.slots for op in plan.ops):
                    at["ops"] = [next(j for j, x in enumerate(program) if x is op)
                                 for op in plan.ops]
            seen[signature] = (plan, key, at)
            out.append((plan, key))
            continue
        plan, key, at = found
        if at:
            plan = plan.at(**{name: tuple(program[j] for j in js) if name == "ops"
                              else program[js] for name, js in at.items()})
        out.append((plan, key))
    return out


def _match_compiled(program: list[Any]) -> _KernelPlan | str:
    """The compiled tier for a program of elementwise rules after an optional leading
    ``apply_if_finite`` and clip, or the reason it has none."""
    ops = [op for op in program if op.kind != "identity"]
    guard = ops.pop(0) if ops and isinstance(ops[0], _Guard) else None
    clip = ops.pop(0) if ops and isinstance(ops[0], _Clip) else None
    for op in ops:
        if isinstance(op, (_Guard, _Clip)):
            return f"the compiled tier takes {op.kind} only before the rules, not after them"
        if op.kind == "set_to_zero":
            return "the compiled tier has no set_to_zero after other rules"
        if op.perleaf:
            return f"{op.kind} is not elementwise (the per-leaf tier takes it)"
        if op.fn is None or op.state_at is None:
            return f"the compiled tier has no lowering of {op.kind}"
        if op.injected and op.rebuild is None:
            return (f"the compiled tier does not find {op.kind} again in the injected "
                    f"transform built from a step's values")
    if not ops:
        return "no update rule"
    summing = [op.kind for op in ops if op.sums is not None]
    if len(summing) > 1:
        return (f"the compiled tier takes one rule with tree sums per program, not "
                f"{' and '.join(summing)}")
    if summing and any(op.injected for op in ops):
        return (f"the compiled tier does not lower {summing[0]} with inject_hyperparams "
                f"(the tree sums' pass reads the rules built at planning)")
    return _KernelPlan("compiled", clip, guard=guard, ops=tuple(ops))


def _match_kernel(program: list[Any]) -> _KernelPlan | str:
    """The PyTorch kernel for one leaf's program, or the reason there is none."""
    ops = [op for op in program if op.kind != "identity"]
    guard = None
    if ops and isinstance(ops[0], _Guard):
        guard = ops.pop(0)
    for i, op in enumerate(ops):
        if isinstance(op, _Guard):
            return (f"apply_if_finite after {ops[i - 1].kind} has no fused form (only one "
                    f"around the whole rule folds into the kernel's skip)")
    clip = None
    if ops and isinstance(ops[0], _Clip):
        clip = ops.pop(0)
    for i, op in enumerate(ops):
        if isinstance(op, _Clip):
            before = ops[i - 1].kind if i else "another clip"
            return (f"clip_by_global_norm after {before} has no fused form (only a leading "
                    f"clip folds into the kernel)")
    # torch.optim's maximize: the gradient negated first (then decayed, then the rule)
    first = ops[0].args.get("step_size") if ops and ops[0].kernel == "scale" else None
    maximize = isinstance(first, _Const) and _is_number(first.value) and first.value == -1
    if maximize:
        ops.pop(0)
    kinds = tuple(op.kind for op in ops)  # (for the messages; ``parts`` for the patterns)
    parts = tuple(op.kernel for op in ops)
    if not kinds:
        return "no update rule (the updates would be the gradients themselves)"
    if "clip_by_global_norm" in kinds:
        before = kinds[kinds.index("clip_by_global_norm") - 1]
        return (f"clip_by_global_norm after {before} has no fused form (only a leading clip "
                f"folds into the kernel)")
    if "zero" in parts:
        if parts[-1] == "zero":
            return _KernelPlan("zero", None, guard=guard)
        return "set_to_zero followed by other rules"
    if parts[-1] not in _LR_KINDS:
        return f"the program {' -> '.join(kinds)} does not end with a learning rate"
    lr = _learning_rate(ops[-1])
    if lr is None:
        return f"{kinds[-1]} with a positive factor (ascent) has no fused kernel"
    body, body_ops = parts[:-1], ops[:-1]
    # Adam with decoupled decay after the moments (AdamW), or L2 decay before them (Adam's
    # weight_decay, torch._fused_adam_'s): the same moments, two kernels
    moments = ("adam", "amsgrad")
    l2 = len(body) == 2 and body[0] == "weight_decay" and body[1] in moments
    if l2 or (body and body[0] in moments and body[1:] in ((), ("weight_decay",))):
        adam = body_ops[1] if l2 else body_ops[0]
        if adam.kernel == "amsgrad" and not adam.args["torch_variant"].value:
            return ("scale_by_amsgrad (optax's variant, the max of corrected moments) has no "
                    "fused kernel; correct_after_max=True is torch's, which has")
        if adam.args["nesterov"].value:
            return "scale_by_adam(nesterov=True) (NAdam) has no fused kernel"
        if _python(adam.args["eps_root"]) not in (None, 0):
            return "scale_by_adam(eps_root > 0) has no fused kernel"
        decay = body_ops[0] if l2 else (body_ops[1] if len(body_ops) == 2 else None)
        return _KernelPlan("adam" if l2 else "adamw", clip, adam=adam, decay=decay, lr=lr,
                           guard=guard, maximize=maximize)
    if body in ((), ("momentum",), ("weight_decay",), ("weight_decay", "momentum"),
                ("dampened_momentum",), ("weight_decay", "dampened_momentum")):
        decay = body_ops[0] if body and body[0] == "weight_decay" else None
        trace = body_ops[-1] if body and body[-1] in ("momentum", "dampened_momentum") else None
        return _KernelPlan("sgd", clip, decay=decay, trace=trace, lr=lr, guard=guard,
                           maximize=maximize)
    unknown = next((op.kind for op in ops if op.kernel is None and not op.perleaf
                    and op.kind not in ("apply_if_finite", "clip_by_global_norm")), None)
    if unknown is not None:
        return f"{unknown} has no fused kernel"
    return f"the program {' -> '.join(kinds)} matches no fused kernel"


# --- per step: layouts, groups, the kernel calls ------------------------------------------

@dataclass
class Group:
    """Leaves that take one kernel call (one compiled call for the compiled tier)."""

    plan: _KernelPlan  # the first leaf's (the kernel and its bindings are the group's)
    device: torch.device
    dtype: torch.dtype
    leaves: list[int]
    plans: list[_KernelPlan]  # per leaf: its own state entries

    _slots: dict[tuple[str, str], list[int]] = field(default_factory=dict)

    @functools.cached_property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def slots(self, op: str, slot: str) -> list[int]:
        """The flat state indices of ``slot`` of the rule ``op`` ("adam", "trace")."""
        found = self._slots.get((op, slot))
        if found is None:
            found = self._slots[(op, slot)] = [getattr(plan, op).slots[slot]
                                               for plan in self.plans]
        return found


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
    resolved: list[tuple[Group, dict[str, Any]]]
    bounds: list[Any]

    @classmethod
    def of(cls, structure: Structure, env: _Env, state_leaves: list[Any],
           resolved: list[tuple[Group, dict[str, Any]]], bounds: list[Any]) -> _Steady | None:
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


# Tensors whose identity and version counter `_Steady` trusts (a subclass may hold values
# elsewhere).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain_number(value: Any) -> bool:
    return type(value) in (float, int, bool)


def lower(structure: Structure, state_spec: _core.TreeSpec, values: list[Any],
          grads: list[Any], state_leaves: list[Any], name: Callable[[int], str], *,
          compiled: bool = False) -> Lowered:
    """Group the leaves with a gradient by kernel, or say why this step stays pure.
    ``compiled``: programs without a kernel take the compiled tier where they can."""
    if structure.opaque:
        return Lowered(structure, state_spec, [], structure.opaque[0])
    groups: dict[tuple[Any, ...], Group] = {}
    field = "matched_compiled" if compiled else "matched"
    matched = getattr(structure, field)
    if matched is None:
        matched = _matches(structure.programs, compiled, structure.perleaf)
        setattr(structure, field, matched)
    for i, (v, g) in enumerate(zip(values, grads, strict=True)):
        if v is None or g is None:
            continue
        plan, plan_key = matched[i]
        if isinstance(plan, str):
            if not compiled and isinstance(_match_compiled(structure.programs[i]), _KernelPlan):
                plan += " (make_step(tx, compile=True) compiles it)"
            return Lowered(structure, state_spec, [], f"leaf {name(i)!r}: {plan}")
        problem = _layout_problem(plan, v, state_leaves, i, structure)
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


def _layout_problem(plan: _KernelPlan, v: Any, state_leaves: list[Any], i: int,
                    structure: Structure) -> str | None:
    if plan.kernel == "zero":
        return None
    if plan.kernel == "perleaf":
        return _perleaf.layout_problem(plan, v, state_leaves)
    local = local_tensor(v)
    if plan.kernel == "compiled":
        return _compiled.layout_problem(plan, local, state_leaves)
    if local.dtype not in _KERNEL_DTYPES:
        return f"{local.dtype} has no fused kernel"
    if plan.kernel == "sgd" and local.device.type == "cpu" and local.dtype not in (
            _SGD_CPU_DTYPES):
        return (f"torch._fused_sgd_ is wrong for {local.dtype} on the CPU in this torch "
                f"(pytorch/pytorch#191763)")
    ops = [op for op in (plan.adam, plan.trace) if op is not None]
    if not _lined_up(ops, local, state_leaves):  # (else dense, with entries laid out as it)
        if not _dense(local):
            return f"its layout (strides {local.stride()}) is not dense"
        problem = _compiled.entries_problem(ops, local, state_leaves, same_dtype=True)
        if problem is not None:
            return problem
    if plan.trace is not None and _python(plan.trace.args["decay"]) == 0:
        return ("trace(decay=0) keeps a trace equal to the gradient, which "
                "torch._fused_sgd_ does not write without momentum")
    return None


def _lined_up(ops: list[_Op], local: torch.Tensor, state_leaves: list[Any]) -> bool:
    """Whether ``local`` is contiguous and each per-leaf state entry of ``ops`` a plain
    tensor of its dtype, shape, strides and device: the layout nearly every leaf has,
    checked in a few reads (`_compiled.entries_problem` finds the problem otherwise)."""
    if not local.is_contiguous():
        return False
    dtype, shape, stride, device = local.dtype, local.shape, local.stride(), local.device
    for op in ops:
        for k in op.slots.values():
            s = state_leaves[k]
            if type(s) not in _PLAIN or s.dtype != dtype or s.shape != shape or (
                    s.stride() != stride or s.device != device):
                return False
    return True


def _python(binding: Any) -> Any:
    return binding.value if isinstance(binding, _Const) else None


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
    if structure.zero_nans and nans is None:
        return ("zero_nans inside the mixed-precision step has no fast form (the step "
                "skips a nan gradient itself)")
    if structure.clips and (sums is None or len(sums) != len(structure.clips)):
        raise ValueError("the planner's run needs one sum of squares per clip")
    if structure.guards and (finite is None or len(finite) != len(structure.guards)):
        raise ValueError("the planner's run needs one finiteness flag per guard")
    steady = lowered.steady
    env: _Env | None = None
    if steady is not None and steady.holds(state_leaves) and not _ops._recording():
        # (a recorded step resolves its values again: what a steady step took as a Python
        # number, such as a learning rate in a CPU tensor, a replay must read as a tensor)
        resolved, bounds = steady.resolved, steady.bounds
    else:
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
    new_values = list(values)
    new_leaves = list(state_leaves)
    new_low: list[Any] | None = None if low is None else [None] * len(low)
    # each clip's norm in global_norm's dtype over the leaves it measures: float64 if
    # one of them is float64 (computed only for chains that clip)
    clip_factors = [
        _clip_multiplier(s, bound, torch.float64 if any(
            values[i] is not None and values[i].dtype == torch.float64 for i in leaves)
            else torch.float32)
        for s, bound, leaves in zip(sums or [], bounds, structure.clips, strict=True)]
    skipped = None if found_inf is None else found_inf != 0
    applied = _guards(structure, state_leaves, new_leaves, finite or [], skipped) if (
        structure.guards) else []
    advanced: dict[int, torch.Tensor] = {}
    hosted: dict[int, int] = {}  # the new values of the counters kept on the host
    # A donated step of the kernels alone advances its host counters where they are, as
    # torch.optim advances its steps: each is written its new value (so a tensor held in
    # two counters' places is written the same value twice) after the kernels, which take
    # the host values. Any other step (one that may skip, a compiled or per-leaf rule that
    # reads its count, the mixed step's) makes new counters.
    owned: list[int] = []
    # (a recorded step advances them on their device: a replay does not run Python)
    in_place = donate and skipped is None and low is None and multiplier is None and (
        lowered.kernels_only) and not _ops._recording()
    for c in structure.counter_indices:
        count = state_leaves[c]
        # (_on_host and _next_count, inline: two counters a step on a small model)
        if in_place and type(count) is torch.Tensor and count.is_cpu and count.dim() == 0 and (
                count._base is None):
            n = int(count)
            hosted[c] = n + 1 if n < _common.INT32_MAX else n
            owned.append(c)
        else:
            advanced[c] = _increment(count, c, hosted)
    perleaf: list[tuple[Group, torch.Tensor | None, torch.Tensor | None]] = []
    prepared = []
    for group, hp in resolved:
        plan = group.plan
        scale = multiplier
        if plan.clip is not None:
            factor = clip_factors[plan.clip.index]
            scale = factor.to(torch.float64) if scale is None else scale * factor.to(
                torch.float64)
        flag = skipped
        if plan.guard is not None:
            flag = _or(flag, ~applied[plan.guard.index])
        if plan.kernel == "perleaf":  # run together below (rule-major)
            perleaf.append((group, scale, flag))
            continue
        prepared.append((group, hp, scale, flag))
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
    if skipped is None and not structure.guards:
        for c, new in advanced.items():
            new_leaves[c] = new
    else:
        for c, new in advanced.items():
            # a skipped step (found_inf, or a guard that skipped) leaves its counters as
            # they were
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
    for index, flag in nans or ():
        new_leaves[index] = flag
    return Result(new_values, new_leaves, lowered.state_spec, new_low)


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


def _on_host(count: Any) -> bool:
    """A counter whose value is read for free: a plain 0-d CPU tensor (in a step that is not
    recorded, `_ops._recording`)."""
    return type(count) is torch.Tensor and count.is_cpu and count.dim() == 0 and (
        not _ops._recording())


def _next_count(count: torch.Tensor) -> int:
    """``_common.safe_increment`` of a host counter, as a Python int."""
    n = int(count)
    return n + 1 if n < _common.INT32_MAX else n


def _increment(count: torch.Tensor, index: int, hosted: dict[int, int]) -> torch.Tensor:
    """``_common.safe_increment``, on the host for a CPU counter (no kernel launches: a
    small model's step pays for every one; this path never runs under torch.func), whose
    new value is then also put in ``hosted[index]``."""
    if _on_host(count):
        n = hosted[index] = _next_count(count)
        return torch.scalar_tensor(n, dtype=count.dtype)
    return _common.safe_increment(count)


def _owned(xs: list[Any], donate: bool) -> list[torch.Tensor]:
    if donate:  # (a plain tensor is its own shard: no call per leaf)
        return [x if type(x) in _PLAIN else local_tensor(x) for x in xs]
    return [local_tensor(x).clone() for x in xs]


def _kernel_grads(grads: list[Any], values: list[torch.Tensor], owned: bool,
                  needs_write: bool) -> list[torch.Tensor]:
    """The gradients a kernel call reads: in their values' layout (a copy otherwise), and
    copies the kernel may write when it unscales in place and the caller keeps them."""
    out = []
    for g, v in zip(grads, values, strict=True):
        local = g if type(g) in _PLAIN else local_tensor(g)
        if local.stride() != v.stride() and local.numel() > 1:
            local = torch.empty_like(v).copy_(local)
        elif needs_write and not owned:
            local = local.clone()
        out.append(local)
    return out


def _hyperparameters(plan: _KernelPlan, env: _Env) -> dict[str, Any] | str:
    """The kernel's arguments at this step (Python floats, the lr possibly a 0-d tensor), or
    the reason a value read now has no fused form."""
    if plan.kernel == "perleaf":
        # the rules' own updates read their hyperparameters; an injected rule's are taken
        # from the inner transform built with this step's values (in the tier's run), so
        # nothing resolved here may be kept for the next step
        if any(op.rebuild is not None for op in plan.ops):
            env.volatile = True
        return {}
    if plan.kernel == "compiled":
        # the rules' own updates, which read their hyperparameters; an injected rule's from
        # the inner transform built with this step's values, as inject_hyperparams does
        return {"updates": [op.fn if op.rebuild is None else env.update_of(op.rebuild)
                            for op in plan.ops]}
    lr = plan.lr(env)
    if isinstance(lr, torch.Tensor) and lr.device.type == "cpu" and lr.dim() == 0 and (
            not _ops._recording()):
        # a host tensor (an injected lr) is read for free, once while unchanged: the
        # kernels then take the float, which costs less per call than a tensor lr
        lr = env.number(lr)
    hp: dict[str, Any] = {"lr": lr, "weight_decay": 0.0 if plan.decay is None
                          else env.number(plan.decay.args["weight_decay"](env))}
    if plan.kernel in ("adamw", "adam"):
        adam = plan.adam
        assert adam is not None
        if env.number(adam.args["eps_root"](env)) != 0.0:
            return "an injected eps_root other than 0 has no fused kernel"
        hp.update(beta1=env.number(adam.args["b1"](env)),
                  beta2=env.number(adam.args["b2"](env)), eps=env.number(adam.args["eps"](env)))
    else:
        trace = plan.trace
        hp["momentum"] = 0.0 if trace is None else env.number(trace.args["decay"](env))
        hp["nesterov"] = False if trace is None else bool(trace.args["nesterov"].value)
        hp["dampening"], hp["is_first_step"] = 0.0, False
        if trace is not None and trace.kernel == "dampened_momentum":
            # a dampened trace starts as the gradient itself (torch.optim.SGD's first step):
            # the kernel's is_first_step, a Python bool, so the count is read on the host
            # (free for a CPU count; one synchronisation per step elsewhere)
            assert trace.count is not None
            if _ops._recording():
                return ("a dampened trace's first step is torch._fused_sgd_'s is_first_step, "
                        "a Python bool read from the count on the host, which a recorded "
                        "step cannot read")
            hp["dampening"] = env.number(trace.args["dampening"](env))
            env.volatile = True
            hp["is_first_step"] = int(env.leaves[trace.count]) == 0
        if trace is not None and hp["momentum"] == 0.0:
            return ("trace(decay=0) (here an injected momentum of 0) keeps a trace equal to "
                    "the gradient, which torch._fused_sgd_ does not write without momentum")
    return hp


def _kernel_scale(scale: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """A clip factor as the kernels take it: the factor (None where it does not act), the
    kernels' ``grad_scale`` (its float32 reciprocal, or None), and whether the gradients
    are instead multiplied by the factor in their own dtype before the kernel."""
    if scale is None or (_ops._host_branch_ok(scale) and scale.item() == 1.0):
        # no clip, or one that does not act at this step (a norm within its bound), read
        # for free on the CPU: the kernel reads the gradients as they are (g / 1 is g)
        return None, None, False
    grad_scale = scale.reciprocal().to(device=device, dtype=torch.float32)
    # the kernels take grad_scale in float32: a float64 group, or a divisor beyond float32
    # (a clip of a norm above 3.4e38; a free host read on the CPU, elsewhere such a norm
    # divides the gradients to zero), is scaled as the pure path scales
    widened = dtype == torch.float64 or (
        _ops._host_branch_ok(grad_scale) and not math.isfinite(grad_scale.item())
        and math.isfinite(scale.item()))
    return scale, None if widened else grad_scale, widened


def _run_group(group: Group, hp: dict[str, Any], values: list[Any], grads: list[Any],
               state_leaves: list[Any], new_values: list[Any], new_leaves: list[Any], *,
               donate: bool, donate_grads: bool, scale: torch.Tensor | None,
               found_inf: torch.Tensor | None, advanced: dict[int, torch.Tensor],
               hosted: dict[int, int], compiled: dict[Any, Any],
               workspace: dict[Any, Any] | None,
               totals: dict[int, Any] | None = None,
               low: list[Any] | None = None, new_low: list[Any] | None = None,
               checked: bool = False) -> None:
    """One kernel call for the leaves of ``group`` (``checked``: see `run`)."""
    if group.plan.kernel == "compiled":
        _compiled.run_group(group, values, grads, state_leaves, new_values, new_leaves,
                            hp["updates"], donate=donate, scale=scale, found_inf=found_inf,
                            compiled=compiled, workspace=workspace, totals=totals, low=low,
                            new_low=new_low)
        return
    plan, idx, device, dtype = group.plan, group.leaves, group.device, group.dtype
    # (checked and donated: plain tensors, their own shards, each gradient laid out as its
    # value and not written without a scale: _owned and _kernel_grads would return them)
    plain = checked and donate
    p = [values[i] for i in idx] if plain else _owned([values[i] for i in idx], donate)
    scale, grad_scale, widened = _kernel_scale(scale, device, dtype)
    # a kernel that unscales in place on the CPU, on gradients the caller keeps: copied
    # batch by batch into a small scratch buffer (`_staged`), if their layouts allow it
    staged = grad_scale is not None and not donate_grads and group.on_cpu
    local = [grads[i] if plain or type(grads[i]) in _PLAIN else local_tensor(grads[i])
             for i in idx] if staged else []

    def kernel_grads() -> list[torch.Tensor]:
        """The gradients of one kernel call over the whole group."""
        g = [grads[i] for i in idx] if plain and (donate_grads or scale is None) else (
            _kernel_grads([grads[i] for i in idx], p, donate_grads, scale is not None))
        if widened:
            assert scale is not None
            torch._foreach_mul_(g, scale.to(device=device, dtype=dtype))
        return g

    def launch(call: Callable[[list[torch.Tensor], list[list[torch.Tensor]]], None],
               columns: list[list[torch.Tensor]]) -> None:
        if staged and _staged.fits(local, columns):
            _staged.run(call, local, columns, workspace, ("staged", idx[0]))
        else:
            call(kernel_grads(), columns)

    flag = None if found_inf is None else found_inf.to(device=device, dtype=torch.float32)  # 1.0: skip
    lr_value = hp["lr"]
    lr: Any = (lr_value.to(device=device, dtype=torch.promote_types(dtype, torch.float32))
               if isinstance(lr_value, torch.Tensor) else float(lr_value))
    wd = hp["weight_decay"]
    written: list[tuple[list[int], list[torch.Tensor]]] = []
    if plan.kernel in ("adamw", "adam"):
        adam = plan.adam
        assert adam is not None
        mu_at, nu_at = group.slots("adam", "mu"), group.slots("adam", "nu")
        m = [state_leaves[k] for k in mu_at] if plain else _owned(
            [state_leaves[k] for k in mu_at], donate)
        n = [state_leaves[k] for k in nu_at] if plain else _owned(
            [state_leaves[k] for k in nu_at], donate)
        amsgrad = adam.kernel == "amsgrad"
        top = _owned([state_leaves[k] for k in group.slots("adam", "nu_max")], donate) if (
            amsgrad) else []
        assert adam.count is not None
        host = hosted.get(adam.count)
        # (the kernels take the count in float32; made from the host value when there is
        # one)
        step = (advanced[adam.count].to(device=device, dtype=torch.float32) if host is None
                else torch.scalar_tensor(float(host), dtype=torch.float32,
                                         device=None if group.on_cpu else device))
        kernel = torch._fused_adamw_ if plan.kernel == "adamw" else torch._fused_adam_

        def adam_call(g: list[torch.Tensor], c: list[list[torch.Tensor]]) -> None:
            kernel(c[0], g, c[1], c[2], c[3], [step] * len(g), lr=lr, beta1=hp["beta1"],
                   beta2=hp["beta2"], weight_decay=wd, eps=hp["eps"], amsgrad=amsgrad,
                   maximize=plan.maximize, grad_scale=grad_scale, found_inf=flag)

        launch(adam_call, [p, m, n, top])
        written = [(mu_at, m), (nu_at, n)]
        if amsgrad:
            written.append((group.slots("adam", "nu_max"), top))
    else:  # sgd
        trace = plan.trace
        bufs = [] if trace is None else _owned(
            [state_leaves[k] for k in group.slots("trace", "trace")], donate)
        momentum, nesterov = hp["momentum"], hp["nesterov"]
        # A zero momentum buffer makes the first step's ``momentum * 0 + g`` exactly the
        # ``buf = g`` of is_first_step, so trace's zero-initialised buffer fits; a
        # dampened_trace says its first step (its count) instead.

        def sgd_call(g: list[torch.Tensor], c: list[list[torch.Tensor]]) -> None:
            torch._fused_sgd_(c[0], g, c[1], weight_decay=wd, momentum=momentum, lr=lr,
                              dampening=hp["dampening"], nesterov=nesterov,
                              maximize=plan.maximize, is_first_step=hp["is_first_step"],
                              grad_scale=grad_scale, found_inf=flag)

        launch(sgd_call, [p, bufs])
        if trace is not None:
            written = [(group.slots("trace", "trace"), bufs)]
    if not donate:  # donated leaves were written in place: the lists hold them
        for j, i in enumerate(idx):
            new_values[i] = _rewrap_like(values[i], p[j])
        for indices, tensors in written:
            for k, t in zip(indices, tensors, strict=True):
                new_leaves[k] = _rewrap_like(state_leaves[k], t)


class Planner:
    """The structures of one transform, cached per (params structure and shapes, state
    structure): what a step function keeps between calls. It holds no tensor and nothing
    that changes a result (a plan is a function of the structures), so step functions can
    be shared between threads and states."""

    _SIZE = 8

    def __init__(self, tx: GradientTransformation) -> None:
        self.tx = tx
        self._cache: dict[Any, Structure] = {}
        # Lowered steps by the identity of the tensors they were checked on (weakly held):
        # a donated step sees the same params and state tensors every time, whose layouts
        # do not change, so the per-leaf layout and aliasing checks run once.
        self._lowered: dict[Any, tuple[list[Any], Lowered]] = {}
        self.reads: dict[int, Any] = {}  # host reads of unchanged hyperparameter tensors

    def lower(self, structure: Structure, state_spec: _core.TreeSpec, values: list[Any],
              grads: list[Any], state_leaves: list[Any], name: Callable[[int], str], *,
              donated: list[Any] | None = None, compiled: bool = False) -> Lowered:
        """`lower`, remembered for the same tensors; ``donated``: leaves written in place,
        checked with `check_donation` the first time."""
        # (counters move at every step; the per-leaf entries are what is checked)
        slots = [state_leaves[k] for k in structure.slot_indices]
        # (the data pointers catch a param or a moment whose .data was replaced in place,
        # as module.to() or .half() do: same object, new memory, maybe a new dtype; the
        # dtypes and strides one whose .data became another view of its memory, a
        # square weight's transpose, say)
        key = (id(structure), compiled, tuple(map(id, values)),
               tuple([g is None for g in grads]),
               tuple(map(id, slots)), donated is not None,
               tuple([None if v is None else _address(v) for v in values]),
               tuple([_address(x) if isinstance(x, torch.Tensor) else None for x in slots]))
        hit = self._lowered.get(key)
        if hit is not None and all(
                (r() if isinstance(r, weakref.ref) else r) is x
                for r, x in zip(hit[0], itertools.chain(values, slots), strict=True)):
            return hit[1]
        spans = None if donated is None else check_donation(donated, name)
        lowered = lower(structure, state_spec, values, grads, state_leaves, name,
                        compiled=compiled)
        if donated is not None and lowered.fast:
            check_state_donation(values, name, structure.slot_indices, state_leaves,
                                 state_spec, spans if donated is values else None)
        refs = [weakref.ref(x) if isinstance(x, torch.Tensor) else x
                for x in itertools.chain(values, slots)]
        if len(self._lowered) >= self._SIZE:
            self._lowered.pop(next(iter(self._lowered)))
        self._lowered[key] = (refs, lowered)
        return lowered

    def compiled_groups(self, treespec: _core.TreeSpec, param_leaves: list[Any],
                        state_leaves: list[Any], state_spec: _core.TreeSpec,
                        ) -> list[Group] | None:
        """The groups of a step with the compiled tier on these params (values standing in
        for their gradients) and state, or None when it would not be fast: what
        ``init`` and ``lay_out`` lay out before the first step."""
        params = _core.unflatten(treespec, param_leaves)
        structure = self.structure(params, treespec, param_leaves, state_leaves, state_spec)
        lowered = lower(structure, state_spec, param_leaves, param_leaves, state_leaves,
                        _leaf_names(treespec), compiled=True)
        return lowered.groups if lowered.fast else None

    def structure(self, params: Any, treespec: _core.TreeSpec, param_leaves: list[Any],
                  state_leaves: list[Any], state_spec: _core.TreeSpec,
                  mode: str | None = None) -> Structure:
        key = (treespec, state_spec,
               tuple([None if p is None else tuple(p.shape) for p in param_leaves]), mode)
        found = self._cache.get(key)
        if found is None:
            found = walk(self.tx, params, treespec, param_leaves, state_leaves, state_spec,
                         mode)
            if len(self._cache) >= self._SIZE:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = found
        return found


def _address(x: torch.Tensor) -> tuple[Any, ...]:
    """Where a tensor's elements are and how they are read (of its local shard)."""
    local = x if type(x) in _PLAIN else local_tensor(x)
    return (local.data_ptr(), local.dtype, local.stride(), local.shape)


class FastPathWarning(UserWarning):
    """A step that was asked to be fast runs on the pure path (correct, slower); the message
    names the transform or leaf and the reason. ``functopt.fast.explain`` tells the same
    before training starts.

    Examples:
        >>> import warnings, torch, functopt
        >>> step = functopt.fast.make_step(functopt.lion(1e-4))
        >>> params = {"w": torch.zeros(2)}
        >>> state = functopt.lion(1e-4).init(params)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = step({"w": torch.ones(2)}, state, params)
        >>> caught[0].category.__name__, "scale_by_lion has no fused kernel" in str(caught[0].message)
        ('FastPathWarning', True)
    """


class CaptureError(RuntimeError):
    """A step cannot be recorded for replay ([`Step.capture`][functopt.fast.Step.capture]):
    it reads a value back to the host while it runs (a CUDA graph replays the device's work
    only, so such a value would stay what it was when recorded), or its state would leave
    the tensors it was recorded on. The message names the value and the fix.

    Examples:
        >>> import functopt
        >>> issubclass(functopt.fast.CaptureError, RuntimeError)
        True
    """


def warn_lost(owner: str, reason: str, stacklevel: int) -> None:
    """Warn that this step lost its fast path (Python shows each message once per place)."""
    warnings.warn(
        f"{owner}: the fast path is lost, this step runs on the pure per-leaf path (correct, "
        f"several times slower): {reason}. See functopt.fast.explain(tx, params).",
        FastPathWarning, stacklevel=stacklevel + 1)


def check_donation(values: list[Any], name: Callable[[int], str]) -> list[tuple[int, int, int]]:
    """Donated leaves are written in place: each must own its memory (views of one buffer
    are fine as long as they do not overlap). Returns the spans it checked, sorted (see
    `check_state_donation`)."""
    spans = _spans(values, name, "param")
    pair = _first_overlap(spans)
    if pair is not None:
        raise ValueError(
            f"{name(pair[0])!r} and {name(pair[1])!r}: the params share memory (tied weights, "
            f"or overlapping views of one tensor), so a donated step would update that "
            f"memory once per leaf. Fix: pass each shared tensor once (drop the tied copy "
            f"from the params tree), or step without donate.")
    return spans


def check_state_donation(values: list[Any], name: Callable[[int], str], slots: list[int],
                         state_leaves: list[Any], state_spec: _core.TreeSpec,
                         spans: list[tuple[int, int, int]] | None = None) -> None:
    """The per-leaf state entries (``slots``, flat indices) that a donated fast step writes in
    place must own their memory, apart from each other and from the values it writes (the
    params, a mixed step's masters, named by ``name``): where
    two share it (a transform's ``init`` that gave one tensor to two fields, a state loaded
    with such ties), writing one overwrites the other, which the pure step reads as it was.
    ``spans``: those `check_donation` returned for ``values`` (then not read again)."""
    entries = [state_leaves[k] for k in slots]
    given = len(values)

    def named(i: int) -> str:  # (paths only for a message: a state has many leaves)
        if i < given:
            return f"param {name(i)!r}"
        return f"state entry {_core.paths(state_spec)[slots[i - given]] or 'state'!r}"

    if spans is None:
        spans = _spans(values, named, "tensor")
    pair = _first_overlap([*spans, *_spans(
        [x if isinstance(x, torch.Tensor) else None for x in entries], named, "tensor",
        given)])
    if pair is not None:
        raise ValueError(
            f"{named(pair[0])} and {named(pair[1])} share memory, so a donated step "
            f"would write one over the other (the pure step reads each as it was). Fix: give "
            f"each state entry its own tensor (functopt.tree.map(torch.clone, state) copies "
            f"a state; a transform's init must not put one tensor in two fields), or step "
            f"without donate.")


def overlap(values: list[Any], name: Callable[[int], str], what: str,
            ) -> tuple[int, int] | None:
    """The first two leaves (indices) of ``values`` whose memory overlaps, or None; raises
    for a leaf that overlaps itself (an expanded tensor), a ``what`` named by ``name``."""
    return _first_overlap(_spans(values, name, what))


def _spans(values: list[Any], name: Callable[[int], str], what: str, start: int = 0,
           ) -> list[tuple[int, int, int]]:
    """(first byte, end byte, ``start`` + index) of each leaf of ``values`` with elements;
    raises for a leaf that overlaps itself (see `overlap`)."""
    spans: list[tuple[int, int, int]] = []
    for i, v in enumerate(values, start):
        if v is None:
            continue
        local = v if type(v) in _PLAIN else local_tensor(v)
        if local.is_contiguous():  # (nearly every leaf: its bytes from its address on)
            if local.nbytes:
                first = local.data_ptr()
                spans.append((first, first + local.nbytes, i))
            continue
        if local.numel() == 0:
            continue
        if overlapping(local):
            raise ValueError(
                f"{name(i)!r}: the {what} has strides {local.stride()} for shape "
                f"{tuple(local.shape)}, so several of its elements share memory (an "
                f"expanded tensor), and a donated step would write them several times. "
                f"Fix: optimize a tensor that owns its memory (x.clone() or "
                f"x.contiguous()), as torch.optim requires.")
        extent = 1 + sum((n - 1) * st for n, st in zip(local.shape, local.stride(),
                                                       strict=True))
        first = local.data_ptr()  # distinct allocations never share addresses
        spans.append((first, first + int(extent) * local.element_size(), i))
    return spans


def _first_overlap(spans: list[tuple[int, int, int]]) -> tuple[int, int] | None:
    """The first two leaves of ``spans`` (sorted here, in place) whose bytes overlap."""
    spans.sort()
    for a, b in itertools.pairwise(spans):
        if b[0] < a[1]:
            return a[2], b[2]
    return None
