"""How ``functopt.Optimizer`` lays a group's transform state out in ``optimizer.state``.

A group's `_Plan` says where each leaf of its transform's state lives: a per-parameter
field in its param's entry, a group-level leaf (a counter) in every entry, an injected
hyperparameter in the group itself. `PlanState` is the optimizer's half of that mapping:
the hyperparameters read from the group (converted and checked as the factory checks its
arguments), the leaves gathered from the entries for a step, and the step's new state
scattered back into them.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import optree
import torch

from functopt._base import GradientTransformation, State
from functopt._spec import Injected, describe
from functopt.adapters import _group_init, _param_groups, _state_dict
from functopt.adapters._base import immutable, is_number
from functopt.transforms.hyperparams import InjectHyperparamsState
from functopt.tree import _core

# What a plan says about one leaf of the transform's state.
_FIELD = 0  # a per-parameter leaf: stored in optimizer.state[param][field path]
_GROUP = 1  # a group-level leaf (a counter): stored, the same tensor, in every param's entry
_HYPER = 2  # an injected hyperparameter: read from the param group on every step
_UNSET = object()


def _recipe_of_injected(tx: GradientTransformation, hyper: dict[str, torch.Tensor]) -> str | None:
    """What recipe an ``inject_hyperparams`` transform builds, with its fixed arguments
    (``"adamw(mu_dtype=None, nesterov=False)"``), or None if it builds none."""
    if not isinstance(describe(tx), Injected):
        return None
    return _state_dict.recipe_signature(tx, hyper)


def _python_value(t: torch.Tensor) -> Any:
    # Schedulers do Python arithmetic on group values; a tensor that carries a graph keeps it.
    return t if t.requires_grad else t.item()


def _readable(transform: GradientTransformation, hyper: dict[str, Any]) -> dict[str, Any]:
    """The injected hyperparameters ``hyper``, or, where they are on the meta device (params
    of a model built there, to be materialised with ``to_empty``) and so hold no values, the
    same hyperparameters initialised over no params (on the CPU)."""
    if not any(isinstance(t, torch.Tensor) and t.is_meta for t in hyper.values()):
        return hyper
    with torch.no_grad():
        host = transform.init({})
    return dict(host.hyperparams) if isinstance(host, InjectHyperparamsState) else hyper



class _Plan:
    """How one group's transform state maps onto ``optimizer.state`` and ``param_groups``.

    Made in two parts: the group-level part (the injected hyperparameters, the group keys,
    the checks' caches) when the group is added, and the per-param layout (``lay_out``,
    from a ``transform.init`` of the group's params) when its state is first made: at the
    first step, or when ``optimizer.state`` is first read, as torch.optim makes its state
    lazily."""

    def __init__(self, key: Any, transform: GradientTransformation,
                 hyper: dict[str, torch.Tensor], recipe: str | None,
                 kept: frozenset[str]) -> None:
        self.key = key
        self.transform = transform  # the group's
        self.signature = recipe  # the recipe with its fixed arguments, saved in state dicts
        self.recipe = None if recipe is None else recipe.split("(", 1)[0]
        self.hyper: dict[str, torch.Tensor] = dict(hyper)
        self.exposed = _param_groups.recipe_group_keys("functopt.Optimizer", self.recipe,
                                                       list(self.hyper))
        # The keys a group may hold: everything else is a value no step would read.
        self.allowed = frozenset({"params", "param_names", *_param_groups.FLAG_KEYS,
                                  *_param_groups.SCHEDULER_GROUP_KEYS, *self.exposed, *kept})
        self.cache: dict[str, tuple[Any, torch.Tensor]] = {}
        self.checked: dict[str, Any] = {}  # injected name -> the group value last validated
        # The last step's hyperparameters: (the group values they came from, the
        # multipliers, the tensors the step read). A step whose group holds the very same
        # immutable values takes them as they are (nothing converted, checked or multiplied
        # again); any other value (a new number, a tensor, a list) goes the whole way.
        self.last_hyper: tuple[list[Any], dict[str, Any]] | None = None
        # The hyperparameters the group's state was made from by add_param_group.
        self.made_from: dict[str, Any] = {}
        self.laid_out = False

    def lay_out(self, template: State, ptree: Any, order: list[int],
                params: list[torch.Tensor]) -> None:
        """The per-param part: where each leaf of ``template`` (the transform's init over
        ``ptree``, the group's params as the tree holds them) lives in ``optimizer.state``.
        ``order``: per leaf of the params' tree, the index of its param in the group."""
        self.placement = _placement(params)
        self.complex = any([p.is_complex() for p in params])  # (stepped as real pairs)
        self.template, self.treespec = _core.flatten(template)
        pspec = self.pspec = _core.structure(ptree)
        # per leaf of the params' tree, the index of its param in the group (a named group's
        # dict flattens by sorted name); None when that is the group's own order
        self.order: list[int] | None = None if order == list(range(len(order))) else order
        hyper = (
            {f"hyperparams.{name}": name for name in template.hyperparams}
            if isinstance(template, InjectHyperparamsState) else {}
        )
        self.leaves: list[tuple[int, int, str]] = []

        # Paths are built node by node (each node's entries once), not from every leaf's
        # accessor: a state holds several leaves per param.
        def walk(spec: _core.TreeSpec, prefix: str) -> None:
            if spec == pspec:  # a field with the params' structure: one leaf per param
                field = prefix or "<root>"
                self.leaves.extend([(_FIELD, j, field) for j in order])
            elif spec.is_leaf():
                path = prefix or "<root>"
                if path in hyper:
                    self.leaves.append((_HYPER, -1, hyper[path]))
                else:
                    self.leaves.append((_GROUP, -1, path))
            else:
                one_level = optree.treespec_one_level(spec)
                assert one_level is not None  # (spec is no leaf)
                entries = _core.paths(one_level)
                for child, entry in zip(spec.children(), entries, strict=True):
                    walk(child, f"{prefix}.{entry}" if prefix else entry)

        walk(self.treespec, "")
        group_leaves: dict[str, Any] = {}
        fields: list[dict[str, Any]] = [{} for _ in order]
        for (kind, j, name), leaf in zip(self.leaves, self.template, strict=True):
            if kind == _HYPER:
                self.hyper[name] = leaf
            elif kind == _GROUP:
                group_leaves[name] = leaf
            else:
                fields[j][name] = leaf
        clash = sorted({name for f in fields for name in f} & set(group_leaves))
        if clash:
            raise ValueError(
                f"functopt.Optimizer: the transform's state has both a leaf and a per-parameter "
                f"field at the paths {clash}, which would share a key in optimizer.state."
            )
        # Entry name -> template leaf, for the entry of the group's j-th param.
        self.fields = [{**group_leaves, **f} for f in fields]
        # The hyperparameters are now the template's, on its device: a value converted for
        # the group-level part (on the device of params since moved, the meta device of a
        # model built there) is converted again.
        self.cache.clear()
        self.last_hyper = None
        if any(isinstance(v, torch.Tensor) and k in self.hyper
               and v.device != self.hyper[k].device for k, v in self.made_from.items()):
            self.made_from = {}
        # Per param, the (leaf index, entry name) pairs of its optimizer.state entry, in
        # the order of the state's leaves: the group-level leaves and its own fields.
        # (one pass over the leaves: a param's fields are the leaves whose j is its index)
        group_slots = [(i, name) for i, (kind, _, name) in enumerate(self.leaves)
                       if kind == _GROUP]
        own: list[list[tuple[int, str]]] = [[] for _ in order]
        for i, (kind, j, name) in enumerate(self.leaves):
            if kind == _FIELD:
                own[j].append((i, name))
        self.entry_slots: list[list[tuple[int, str]]] = [
            sorted(group_slots + slots) for slots in own]
        self.group_slots = group_slots  # each param keeps its own (see _torch_state)
        # Leaves that may be None in a state (None in the template): a None read from
        # optimizer.state anywhere else is a missing entry.
        self.nullable = [leaf is None for leaf in self.template]
        self.any_nullable = any(self.nullable)
        # Per leaf, where a step reads it: (-1, name) from the hyperparameters, else (the
        # param whose entry holds it, its name in the entry), a group-level leaf from the
        # first param's entry. Per stored leaf (not a hyperparameter), every entry that
        # holds it: (param, name).
        self.reads = [(-1 if kind == _HYPER else (j if kind == _FIELD else 0), name)
                      for kind, j, name in self.leaves]
        self.stored = [i for i, (kind, _, _) in enumerate(self.leaves) if kind != _HYPER]
        self.targets = [[(k, name) for k in range(len(order))] if kind == _GROUP else
                        [(j, name)] for kind, j, name in self.leaves]
        # Whether the state holds tensors a step updates (in place, with donation): then a
        # restart needs a fresh init, not the template the first step already took.
        self.stateful = any(kind != _HYPER and leaf is not None
                            for (kind, _, _), leaf in zip(self.leaves, self.template,
                                                          strict=True))
        self.template_taken = False
        self.laid_out = True

    def fresh(self, transform: GradientTransformation, ptree: Any,
              hyper: dict[str, torch.Tensor]) -> list[Any]:
        """Leaves of a new ``transform.init`` state (the template, if no step has it yet),
        made from the group's hyperparameters ``hyper`` where they are not the template's."""
        if _group_init.differs(self.hyper, hyper):
            with torch.no_grad():
                return self._checked(_group_init.init_from_group(transform, ptree, hyper))
        if not self.template_taken or not self.stateful:
            self.template_taken = True
            return self.template
        with torch.no_grad():
            return self._checked(transform.init(ptree))

    def _checked(self, state: State) -> list[Any]:
        leaves, treespec = _core.flatten(state)
        if treespec != self.treespec:
            raise ValueError(
                f"functopt.Optimizer: the transform's init returned a state of structure "
                f"{treespec}, earlier {self.treespec}. Fix: a transform's init must give the "
                f"same structure for the same params.")
        return leaves



class PlanState:
    """``functopt.Optimizer``'s reads and writes of a group's state through its plan."""

    if TYPE_CHECKING:
        param_groups: list[dict[str, Any]]
        _unstepped: dict[int, _Plan]

        _plans: list[_Plan | None]
        _pending: dict[int, dict[str, Any]]
        _transform: GradientTransformation
        _fused: bool

        def _made_store(self) -> defaultdict[torch.Tensor, Any]: ...

    def _kept_keys(self) -> frozenset[str]:
        """Group keys this optimizer keeps beyond the transform's (torch's fixed options)."""
        return frozenset()

    def _group_transform(self, index: int, group: dict[str, Any]) -> GradientTransformation:
        """The transform the group's state belongs to and its steps run (the one given;
        ``functopt.optim`` builds one per combination of its fixed options)."""
        return self._transform

    def _group_fused(self, transform: GradientTransformation) -> bool:
        """Whether ``transform``'s steps take a fused kernel where it has one."""
        return self._fused

    def _stepped(self, index: int, group: dict[str, Any]) -> bool:
        """Whether the group's state is no longer the one add_param_group made (a step, or
        a load, changed it)."""
        if index in self._pending or index in self._unstepped:
            return False
        store = self._made_store()
        return any(store.get(p) for p in group["params"])

    def _changed_transform(self, index: int, group: dict[str, Any], plan: _Plan) -> Exception:
        """The error for a group whose transform changed after its state was made."""
        return ValueError(
            f"functopt.Optimizer: param_groups[{index}] now runs another transform than the "
            f"one its state was made for. Fix: clear the group's state (optimizer.state) to "
            f"restart it.")

    # Injected hyperparameters whose value when a group's state is created is the one the
    # transform was built with, not the group's (torch.optim.Adagrad's accumulator).
    _init_from_defaults: frozenset[str] = frozenset()

    def _init_hyper(self, hyper: dict[str, Any]) -> dict[str, Any]:
        """The hyperparameters a group's first state is made from."""
        skip = self._init_from_defaults
        return {k: v for k, v in hyper.items() if k not in skip} if skip else hyper

    def _describe(self, group: dict[str, Any], j: int) -> str:
        names = group.get("param_names")
        index = next(i for i, g in enumerate(self.param_groups) if g is group)
        return f"param {j}{'' if names is None else f' ({names[j]!r})'} of param_groups[{index}]"

    @staticmethod
    def _tree(group: dict[str, Any], leaves: list[Any]) -> Any:
        names = group.get("param_names")
        return list(leaves) if names is None else dict(zip(names, leaves, strict=True))

    def _plan(self, index: int, group: dict[str, Any], placed: bool = False,
              laid_out: bool = True) -> _Plan:
        """The group's plan, made again if its params (or names) changed; with ``placed``,
        also if they moved to other dtypes or devices (the template, the state a restart
        takes, follows the params as torch.optim's lazily created state does; checked only
        where a template is about to be used, as reading every param's device costs). With
        ``laid_out`` False, the group-level part may be all there is (see ``_Plan``)."""
        params = group["params"]
        names = group.get("param_names")
        key = (tuple(map(id, params)), None if names is None else tuple(names))
        while len(self._plans) <= index:
            self._plans.append(None)
        plan = self._plans[index]
        transform = self._group_transform(index, group)
        if plan is not None and plan.transform is not transform:
            # another combination of options: a state made for the old one cannot step
            if self._stepped(index, group):
                raise self._changed_transform(index, group, plan)
            plan = None
        if plan is not None and placed and plan.laid_out and (
                plan.placement != _placement(params)):
            plan = None
        template = None
        if plan is None or plan.key != key:
            if names is not None and len(set(names)) != len(names):
                dup = sorted({n for n in names if names.count(n) > 1})
                raise ValueError(
                    f"functopt.Optimizer: param_groups[{index}] names several params {dup}; "
                    f"the transform sees the group as a {{name: param}} dict. Fix: give each "
                    f"param its own name (model.named_parameters() does)."
                )
            spec = describe(transform)
            initial = spec.initial if isinstance(spec, Injected) else None
            if initial is not None:  # the hyperparameters alone, without an init
                hyper = initial(_first_device(params, names))
            else:
                template = self._template(transform, group)
                hyper = (template.hyperparams if isinstance(template, InjectHyperparamsState)
                         else {})
            plan = self._plans[index] = _Plan(key, transform, hyper,
                                              _recipe_of_injected(transform, hyper),
                                              self._kept_keys())
        if template is not None or (laid_out and not plan.laid_out):
            if template is None:
                template = self._template(transform, group)
            order = _core.flatten(self._tree(group, list(range(len(params)))))[0]
            plan.lay_out(template, self._tree(group, self._real(params)), order, params)
        return plan

    def _template(self, transform: GradientTransformation, group: dict[str, Any]) -> State:
        """``transform.init`` over the group's params."""
        with torch.no_grad():
            return transform.init(self._tree(group, self._real(group["params"])))

    def _real(self, params: list[Any]) -> list[Any]:
        """``params`` with each complex one as its ``torch.view_as_real`` pairs (what the
        transform steps, as torch.optim steps complex params), one view per param kept
        while it views the param's storage."""
        if not any([isinstance(p, torch.Tensor) and p.is_complex() for p in params]):
            return params
        views: dict[int, tuple[Any, torch.Tensor]] = self.__dict__.setdefault(
            "_real_views", {})
        out = []
        for p in params:
            if not (isinstance(p, torch.Tensor) and p.is_complex()):
                out.append(p)
                continue
            held = views.get(id(p))
            if held is None or held[0] is not p or held[1].data_ptr() != p.data_ptr() or (
                    held[1].shape[:-1] != p.shape):
                with torch.no_grad():
                    held = views[id(p)] = (p, torch.view_as_real(p))
            out.append(held[1])
        return out

    def _hyperparams(self, index: int, group: dict[str, Any], plan: _Plan) -> dict[str, Any]:
        values: dict[str, Any] = {}
        raws: dict[str, Any] = {}
        where = f"param_groups[{index}]"
        for key, names in plan.exposed.items():
            raw = group[key]
            parts = _param_groups.split_value("functopt.Optimizer", where, key, names, raw)
            for name, value in zip(names, parts, strict=True):
                values[name] = self._as_tensor(index, key, name, value, plan)
                raws[name] = value
        checked = plan.checked
        if any(checked.get(name, _UNSET) is not value for name, value in raws.items()):
            changed = [name for name, value in raws.items()
                       if checked.get(name, _UNSET) is not value]
            lr: Any = raws.get("learning_rate")
            # The value a scheduler moves at every step: every recipe accepts any finite
            # learning rate > 0, so such a value needs no build of the recipe to check it.
            if not (changed == ["learning_rate"] and plan.recipe is not None
                    and is_number(lr) and 0.0 < lr < math.inf):
                self._validate(index, plan, raws)
            plan.checked = raws
        return values

    def _validate(self, index: int, plan: _Plan, raws: dict[str, Any]) -> None:
        """Check the group's values as the factory checks its arguments (a value out of
        range, b1 = 1 or a negative momentum, raises the factory's error), on every path: the
        transform is built once from them as Python numbers."""
        spec = describe(plan.transform)
        if not isinstance(spec, Injected):
            return
        probe: dict[str, Any] = dict(plan.hyper)
        for name, value in raws.items():
            if isinstance(value, torch.Tensor):
                if value.requires_grad:  # a meta-gradient's tensor: trusted, as elsewhere
                    continue
                value = value.item()
            probe[name] = value
        try:
            spec.build(probe)
        except (ValueError, TypeError) as error:
            shown = ", ".join(
                f"{key!r}: {tuple(raws[n] for n in names) if len(names) > 1 else raws[names[0]]!r}"
                for key, names in plan.exposed.items())
            raise type(error)(
                f"functopt.Optimizer: param_groups[{index}] holds {{{shown}}}, which the "
                f"transform rejects: {error}"
            ) from None

    @staticmethod
    def _as_tensor(index: int, key: str, name: str, value: Any, plan: _Plan) -> torch.Tensor:
        held = plan.hyper[name]
        cached = plan.cache.get(name)
        if cached is not None and cached[0] is value:
            return cached[1]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            # Not cached: schedulers update a tensor lr in place. (A one-element tensor of
            # any shape, as torch.optim takes an lr.)
            return value.reshape(()).to(dtype=held.dtype, device=held.device)
        if not is_number(value):
            raise TypeError(
                f"functopt.Optimizer: param_groups[{index}][{key!r}] (the transform's "
                f"{name!r}) must be a number or a one-element tensor, got "
                f"{type(value).__name__} {value!r}."
            )
        tensor = torch.scalar_tensor(value, dtype=held.dtype, device=held.device)
        plan.cache[name] = (value, tensor)
        return tensor

    def _step_hyperparams(self, index: int, group: dict[str, Any],
                          plan: _Plan) -> dict[str, Any]:
        """The injected hyperparameters a step reads: the group's values as tensors. A
        group that holds the very values of the last step (the same Python numbers and
        tuples) gets the tensors that step read: they were converted and checked then."""
        raw = [group[key] for key in plan.exposed]
        last = plan.last_hyper
        if last is not None and len(last[0]) == len(raw) and all(
                map(operator.is_, last[0], raw)):
            return last[1]  # (read only: the callers take the tensors out)
        hyper = self._hyperparams(index, group, plan)
        # (a tensor value may be changed in place, a list item by item: read them anew)
        plan.last_hyper = (raw, dict(hyper)) if all(map(immutable, raw)) else None
        return hyper

    def _gather(
        self, index: int, group: dict[str, Any], plan: _Plan, flags: _param_groups.GroupFlags
    ) -> list[Any]:
        """The leaves of the group's transform state (of ``plan.treespec``): its entries in
        ``optimizer.state``, the hyperparameters from the group."""
        return self._collect(index, group, plan, flags)[0]

    def _collect(
        self, index: int, group: dict[str, Any], plan: _Plan, flags: _param_groups.GroupFlags
    ) -> tuple[list[Any], list[Any] | None]:
        """`_gather`'s leaves, and the ``optimizer.state`` entries they were read from (None
        when the state starts from init)."""
        params = group["params"]
        get = self._made_store().get
        entries: list[Any] = [get(p) for p in params]
        hyper = self._step_hyperparams(index, group, plan)
        # No state (cleared, or a stateless transform), or the state add_param_group made
        # for params that have moved since: start from init, on the params as they are now.
        # So does a state made for values the group no longer holds at its first step (a
        # scheduler set the lr after construction): torch.optim makes it at the first step.
        unstepped = self._unstepped.get(index)
        if not any(entries) or (unstepped is not None and (
                unstepped is not plan
                or _group_init.differs(plan.made_from, self._init_hyper(hyper)))):
            template = plan.fresh(plan.transform, self._tree(group, self._real(params)),
                                  self._init_hyper(hyper))
            return [hyper[name] if kind == _HYPER else leaf
                    for (kind, _, name), leaf in zip(plan.leaves, template, strict=True)], None
        if not plan.any_nullable:
            try:  # every entry holds every key it must: read them (else say which is not)
                leaves = [hyper[name] if j < 0 else entries[j][name] for j, name in plan.reads]
            except (KeyError, TypeError):
                pass
            else:
                if not any(map(operator.is_, leaves, itertools.repeat(None))):
                    return leaves, entries
        return self._gather_checked(group, plan, hyper, entries), entries

    def _gather_checked(self, group: dict[str, Any], plan: _Plan, hyper: dict[str, Any],
                        entries: list[Any]) -> list[Any]:
        """`_collect`'s leaves from ``entries``, each checked (a missing one raises, naming
        the param and the key; a nullable one may be absent)."""
        first = entries[0]
        nullable = plan.nullable
        leaves: list[Any] = []
        for i, (kind, j, name) in enumerate(plan.leaves):
            if kind == _HYPER:
                leaves.append(hyper[name])
                continue
            entry = entries[j] if kind == _FIELD else first
            value = entry.get(name) if entry else None
            if value is None and not nullable[i]:
                where = self._describe(group, j if kind == _FIELD else 0)
                raise ValueError(
                    f"functopt.Optimizer: optimizer.state for {where} has no {name!r} (it has "
                    f"{sorted(entry or {})}). Fix: load a state_dict saved by a "
                    f"functopt.Optimizer with the same transform, or clear the state of the "
                    f"whole group to restart it from transform.init."
                )
            leaves.append(value)
        return leaves

    def _scatter(self, group: dict[str, Any], plan: _Plan, state: Any,
                 treespec: _core.TreeSpec | None = None,
                 old: tuple[list[Any], list[Any]] | None = None) -> None:
        """Write the group's transform state into ``optimizer.state``: a state tree, or its
        leaves of ``treespec`` (a step's), or, without ``treespec``, the template's leaves.
        ``old``: the leaves this step read and the entries it read them from, which are
        then updated where a leaf changed (a step that hands no state dict's tensors over)."""
        if isinstance(state, list):
            leaves = state
        else:
            leaves, treespec = _core.flatten(state)
        # (the fused step hands back the very treespec it was given; not compared under
        # torch.compile, which cannot compare optree specs)
        if treespec is not None and treespec is not plan.treespec and (
                not torch.compiler.is_compiling() and treespec != plan.treespec):
            raise ValueError(
                f"functopt.Optimizer: the transform's update returned a state of structure "
                f"{treespec}, but its init gave {plan.treespec}. Fix: a transform's state must "
                f"keep the structure init gives it."
            )
        if old is not None:
            # The entries the step read, updated in place where a leaf is another tensor
            # (a donated step of the kernels alone keeps every tensor: nothing to write;
            # the pure path's new moments, or new counters, are), as torch.optim updates
            # its entries. A state dict taken since the last step holds
            # these dicts: then this step is not donated and writes new ones (below).
            before, entries = old
            targets = plan.targets
            for i in plan.stored:
                value = leaves[i]
                if value is not before[i]:
                    for j, name in targets[i]:
                        if value is None:
                            entries[j].pop(name, None)
                        else:
                            entries[j][name] = value
            return
        # New dicts: a state_dict taken earlier keeps its values. Every param has
        # an entry, empty for a stateless transform, as torch.optim's SGD keeps
        # {'momentum_buffer': None}: torch.distributed.checkpoint's state-dict helpers take a
        # zero-gradient step to create the state of an optimizer whose state is empty, which
        # a transform that does not scale with lr (a weight decay) would apply. An entry
        # holds the group-level leaves and the param's own fields, in the state's order.
        store = self.__dict__["_store"]
        for p, slots in zip(group["params"], plan.entry_slots, strict=True):
            store[p] = {name: leaves[i] for i, name in slots if leaves[i] is not None}


def _first_device(params: list[Any], names: list[str] | None) -> torch.device:
    """The device of the first param of the group's tree (a named group's dict flattens by
    sorted name), where a transform's init puts its counts."""
    if not params:
        return torch.device("cpu")
    first = params[0] if names is None else params[names.index(min(names))]
    return first.device if isinstance(first, torch.Tensor) else torch.device("cpu")


def _placement(params: list[torch.Tensor]) -> tuple[tuple[torch.dtype, torch.device], ...]:
    return tuple([(p.dtype, p.device) for p in params])
