"""The walk of a transform's spec together with its state: the per-leaf programs and the
`Structure` of a step (see ``functopt/fast/_planner.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from functopt._base import GradientTransformation
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
from functopt.fast import _multi
from functopt.fast._programs import (
    _LR_KINDS,
    CLOSING,
    MINI,
    Accumulation,
    Structure,
    _Clip,
    _Const,
    _Guard,
    _GuardState,
    _Hyper,
    _Injection,
    _NanZeroing,
    _Op,
    _Scheduled,
    _specs_of,
    accumulated_specs,
)
from functopt.transforms.multi_steps import Accumulated
from functopt.tree import _core

__all__ = ["walk"]


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

    def placeholders_of(self, hyper: Iterable[tuple[str, int]], node: int,
                        ) -> dict[str, torch.Tensor]:
        """Fresh tensors holding the ``node``-th injection's values (``hyper``: key, flat
        state index) to build its inner transform from: the walk binds each, where a rule
        takes it, to ``hyperparams[key]`` of this step (`_Hyper`). The caller keeps them
        alive while the walk binds their ids."""
        placeholders = {}
        for k, i in hyper:
            current = self.state_leaves[i]
            placeholders[k] = (current.detach().clone() if isinstance(current, torch.Tensor)
                               else torch.tensor(current, dtype=torch.float64))
            self.placeholders[id(placeholders[k])] = _Hyper(node, k)
        return placeholders

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
            return
        for kind, step in _STEPS:
            if isinstance(spec, kind):
                step(self, spec, idx, sel, where)
                return
        # a Spec subclass of a later layer that this planner does not know
        self.out.opaque.append(f"{where}: {type(spec).__name__} has no lowering")

    def sequence(self, spec: Sequence, idx: Any, sel: list[int], where: str) -> None:
        parts = spec.states(idx)
        if parts is None:
            raise _Mismatch(f"{where}: the state has {len(idx)} entries for "
                            f"{len(spec.children)} transforms")
        for child, sub, label in parts:
            self.walk(child, sub, sel, f"{where}[{label}]" if where else f"[{label}]")

    def select(self, spec: Select, idx: Any, sel: list[int], where: str) -> None:
        chosen = set(sel)
        tree = self.params if len(sel) == len(self.param_leaves) else _core.unflatten(
            self.treespec, [p if i in chosen else None
                            for i, p in enumerate(self.param_leaves)])
        groups = spec.select(tree, self.treespec, _core.flatten(tree)[0])
        for key, child in spec.children.items():
            mine = set(groups.get(key, ()))
            self.walk(child, spec.state_of(idx, key), [i for i in sel if i in mine],
                      f"{where}.{spec.name}[{key!r}]")

    def clip(self, spec: GlobalNormClip, idx: Any, sel: list[int], where: str) -> None:
        if spec.finish is not None and any(_has_rules(self.out.programs[i]) for i in sel):
            self.late_clip(spec, idx, sel, where)
            return
        clip = _Clip(len(self.out.clips), self.bind(spec.max_norm))
        self.out.clips.append(list(sel))
        self.out.clip_bounds.append(clip.max_norm)
        for i in sel:
            self.out.programs[i].append(clip)

    def late_clip(self, spec: GlobalNormClip, idx: Any, sel: list[int], where: str) -> None:
        """A clip after other rules: the norm of their updates, which no gradient pass
        measures; the compiled tier lowers it as a rule with tree sums (the sums pass runs
        the rules before it), the kernels do not."""
        node = self.node()
        max_norm = self.bind(spec.max_norm)
        if not isinstance(max_norm, _Const):
            self.out.opaque.append(f"{where}: clip_by_global_norm after other rules "
                                   f"with an injected max_norm has no fast form")
            return
        assert spec.sums is not None
        self.tree_wide("clip_by_global_norm", {"max_norm": max_norm}, node, spec.sums,
                       spec.finish, idx, sel)

    def tree_wide(self, kind: str, args: dict[str, Any], node: int, sums: Any, finish: Any,
                  idx: Any, sel: list[int]) -> None:
        """A rule with tree sums on ``sel``, whose update is its two halves in one."""
        self.out.tree_wide.append(node)
        late = _Op(kind, args, {}, node,
                   fn=lambda u, state, p: finish(u, state, p, sums(u, state, p)),
                   state_at=idx, sums=sums, finish=finish)
        for i in sel:
            self.out.programs[i].append(late)

    def finite_guard(self, spec: FiniteGuard, idx: Any, sel: list[int], where: str) -> None:
        if self.guard is None and not all(self._leading(self.out.programs[i], sel)
                                          for i in sel):
            self.late_guard(spec, idx, sel, where)
            return
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

    def accumulated(self, spec: Accumulated, idx: Any, sel: list[int], where: str) -> None:
        """A ``MultiSteps`` that `_multi.Split` did not take. It is lowered where it is the
        first rule of its leaves (it then sees their gradients, which the step accumulates
        and decides its window on; a leading ``apply_if_finite`` around it checks them):
        recorded in ``accumulation``, and walked as the mode says."""
        where = where or "<root>"
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
            at = _position(self.accumulating[self.injecting[0]], spec)
            if at is None:
                self.out.opaque.append(f"{where}: a MultiSteps inside inject_hyperparams that "
                                       f"the planner does not find again in it")
                return
            rebuild = (self.injecting[0], at)
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
        if not all(_has_rules(self.out.programs[i]) for i in sel):
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
        self.out.shared.add(node)  # (its counters and inner state move in a group's call)
        self.tree_wide("apply_if_finite", {}, node, spec.sums, spec.finish, idx, sel)

    def injected(self, spec: Injected, idx: Any, sel: list[int], where: str) -> None:
        outer = self.injecting
        parent = None
        if outer is not None:  # (where the walk met it, the outer's inner spec holds it)
            at = _position(self.injections[outer[0]], spec)
            if at is None:
                self.out.opaque.append(f"{where}: an inject_hyperparams inside another that "
                                       f"the planner does not find again in it")
                return
            parent = (outer[0], at)
        hyper_idx = {k: idx.hyperparams[k] for k in spec.names}
        node = len(self.out.injections)
        placeholders = self.placeholders_of(hyper_idx.items(), node)
        inner = spec.build(placeholders)
        self.out.injections.append(_Injection(
            count=idx.count, hyper=hyper_idx,
            constants=tuple(k for k in spec.names if k not in spec.schedules),
            values_at=spec.values_at, guard=self.guard, build=spec.build, parent=parent))
        self.counter(idx.count)
        self.injecting = (node, _specs_of(describe(inner), Leafwise))
        self.accumulating.append(accumulated_specs(describe(inner)))
        self.injections.append(_specs_of(describe(inner), Injected))
        self.walk(describe(inner), idx.inner_state, sel, f"{where}.inject_hyperparams")
        self.injecting = outer
        del placeholders  # ids of freed placeholders must not match later tensors
        self.placeholders = {k: v for k, v in self.placeholders.items() if v.node != node}

    def leafwise(self, spec: Leafwise, idx: Any, sel: list[int], where: str) -> None:
        node = self.node()
        bindings = _BINDINGS.get(spec.kernel)
        found = (bindings(self, spec, idx) if bindings is not None
                 else self.own_update(spec, idx, node, where))
        if found is None:
            return
        args, slots, count = found
        if count is not None:
            self.counter(count)
        rebuild = None
        if self.injecting is not None:
            at = _position(self.injecting[1], spec)
            rebuild = None if at is None else (self.injecting[0], at)
        op = _Op(spec.kind, args, {}, node, count, fn=spec.update,
                 state_at=idx if hasattr(idx, "_fields") else None,
                 injected=bool(self.placeholders), rebuild=rebuild,
                 perleaf=isinstance(spec, PerLeaf), sums=spec.sums, finish=spec.finish,
                 kernel=spec.kernel, grouped=spec.grouped if isinstance(spec, PerLeaf) else None)
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

    # The bindings of a rule with a part in the fused kernels (its spec's ``kernel``): its
    # arguments, its per-leaf state entries (per leaf, by field) and its count's index.

    def schedule(self, spec: Leafwise, idx: Any) -> _Bound:
        count = idx.count
        return {"step_size": _Scheduled(spec.hyper["step_size_fn"], count, spec.kind,
                                        "step_size_fn")}, {}, count

    def rate(self, spec: Leafwise, idx: Any) -> _Bound:
        """A learning rate or a decay: a number, a 0-d tensor (maybe injected) or a
        schedule of the rule's own count."""
        name = spec.kernel
        assert name is not None
        value = spec.hyper[name]
        count = None
        args: dict[str, Any] = {}
        if callable(value) and not isinstance(value, torch.Tensor):
            count = idx.count
            args[name] = _Scheduled(value, count, spec.kind, name)
        else:
            args[name] = self.bind(value)
        if name == "learning_rate":
            args["flip_sign"] = _Const(spec.hyper["flip_sign"])
        return args, {}, count

    def moments(self, spec: Leafwise, idx: Any) -> _Bound:
        hyper, count = spec.hyper, idx.count
        args = {k: self.bind(hyper[k]) for k in ("b1", "b2", "eps", "eps_root")}
        args["nesterov"] = _Const(hyper.get("nesterov", False))
        slots = {"mu": self.per_leaf(idx.mu, "mu"), "nu": self.per_leaf(idx.nu, "nu")}
        if spec.kernel == "amsgrad":
            # torch's AMSGrad (the max of the raw second moments, corrected after) is the
            # kernels' amsgrad=True; optax's (the max of corrected ones) is not
            args["torch_variant"] = _Const(
                bool(hyper.get("correct_after_max")) and hyper.get(
                    "bias_correction_mu", True) is not False and hyper.get(
                    "bias_correction_nu", True) is not False)
            slots["nu_max"] = self.per_leaf(idx.nu_max, "nu_max")
        return args, slots, count

    def momentum(self, spec: Leafwise, idx: Any) -> _Bound:
        hyper, count = spec.hyper, None
        args = {"decay": self.bind(hyper["decay"]), "nesterov": _Const(hyper["nesterov"])}
        slots = {"trace": self.per_leaf(idx.trace, "trace")}
        if spec.kernel == "dampened_momentum":  # torch.optim.SGD's momentum: torch._fused_sgd_'s
            args["dampening"] = self.bind(hyper["dampening"])
            count = idx.count  # (its first step keeps the gradient: is_first_step)
        return args, slots, count

    def own_update(self, spec: Leafwise, idx: Any, node: int, where: str) -> _Bound | None:
        """A rule without a part in the fused kernels, which only its own update computes:
        the per-leaf state entries are the fields its spec names, the others (a count, ...)
        are shared. One that reduces within a leaf takes the per-leaf tier, which runs its
        own (grouped) update on a group's leaves (its shared state moves only with leaves
        that have a gradient, PerLeaf's contract: a step where none has one leaves it as it
        was); an elementwise one the compiled tier, which runs its update on the group's
        leaves laid end to end. None: it has no fast form (the reason is recorded)."""
        if spec.slots is None:  # (a rule without a known layout)
            self.out.opaque.append(
                f"{where}: {spec.kind} has neither a fused kernel nor a compiled lowering "
                f"(its spec names no per-leaf state fields)")
            return None
        slots = {f: self.per_leaf(getattr(idx, f), f) for f in spec.slots}
        fields = getattr(idx, "_fields", ())
        count = idx.count if "count" in fields else None
        if not spec.elementwise:
            self.out.perleaf = True
            return {}, slots, count
        if set(fields) - set(slots) - {"count"}:
            self.out.shared.add(node)  # (NAdam's mu_product) moved by a group's call
        if (spec.sums is None) != (spec.finish is None):
            raise _Mismatch(f"{where}: {spec.kind} gives only one half of its update")
        if spec.sums is not None:
            self.out.tree_wide.append(node)
        return {}, slots, count


# A rule's arguments (by name: a binding), its per-leaf state entries (by field: per leaf, a
# flat state index) and its count's flat index (or None).
_Bound = tuple[dict[str, Any], dict[str, list[int]], int | None]

# The bindings of each rule with a part in the fused kernels, by its spec's ``kernel``.
_BINDINGS: dict[str | None, Callable[[_Walk, Leafwise, Any], _Bound]] = {
    "identity": lambda w, spec, idx: ({}, {}, None), "zero": lambda w, spec, idx: ({}, {}, None),
    "scale": lambda w, spec, idx: ({"step_size": w.bind(spec.hyper["step_size"])}, {}, None),
    "schedule": _Walk.schedule, "learning_rate": _Walk.rate, "weight_decay": _Walk.rate,
    "adam": _Walk.moments, "amsgrad": _Walk.moments, "momentum": _Walk.momentum,
    "dampened_momentum": _Walk.momentum}

# How the walk lowers each kind of spec (the first that ``isinstance`` matches).
_STEPS: tuple[tuple[type[Any], Callable[[_Walk, Any, Any, list[int], str], None]], ...] = (
    (Sequence, _Walk.sequence), (Select, _Walk.select), (GlobalNormClip, _Walk.clip),
    (Injected, _Walk.injected), (FiniteGuard, _Walk.finite_guard),
    (ZeroNans, _Walk.zero_nans), (Leafwise, _Walk.leafwise), (Accumulated, _Walk.accumulated))


def _position(specs: list[Any], spec: Spec) -> int | None:
    """Where ``spec`` itself is among ``specs`` (the same object), or None."""
    return next((j for j, other in enumerate(specs) if other is spec), None)


def _has_rules(program: list[Any]) -> bool:
    """Whether ``program`` so far holds a rule (not only identities and guards' marks)."""
    return any(not isinstance(op, _Guard) and op.kind != "identity" for op in program)


def _guarded_whole(spec: Spec | None) -> bool:
    """Whether an apply_if_finite after other rules may guard ``spec`` on the compiled tier:
    its update runs the inner rules on a group's leaves laid end to end, so they must be
    elementwise, keep no per-leaf state and read no other leaf (no tree sums)."""
    if isinstance(spec, Sequence):
        return all(_guarded_whole(child) for child in spec.children)
    return (isinstance(spec, Leafwise) and spec.elementwise and spec.slots == ()
            and spec.sums is None and spec.kernel != "zero")


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
