"""How the param groups of ``MixedPrecisionOptimizer`` reach its transform.

Each group's keys hold the arguments of its transform under torch's names. An argument
that ``inject_hyperparams`` keeps in the state is written there before a step (a 0-d
tensor: nothing is rebuilt, nothing recompiles); any other argument of a factory built the
group's transform, and a new value rebuilds it. A key that no transform reads is refused,
except the records that schedulers and Megatron-LM keep in the groups.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch

from functopt._base import GradientTransformation
from functopt.adapters import _param_groups, _state_dict
from functopt.adapters._base import immutable
from functopt.adapters._megatron import decoupled_records
from functopt.precision.master import MasterWeights
from functopt.precision.step import MixedPrecisionState, MixedPrecisionTransformation
from functopt.transforms.hyperparams import InjectHyperparamsState
from functopt.transforms.partition import partition
from functopt.tree import _core

__all__: list[str] = []

_OWNER = "MixedPrecisionOptimizer"

# Keys a param group may hold that no transform reads (schedulers' and Megatron-LM's
# records): the one set functopt.Optimizer allows too. Any other key the transform does not
# read is an error, never ignored.
# the scheduler's records, and Megatron's decoupled learning rate of a group (read by the
# facade into the group's max_lr / min_lr: functopt/adapters/_megatron.py)
BOOKKEEPING_KEYS = _param_groups.SCHEDULER_GROUP_KEYS | {"decoupled_lr",
                                                          "decoupled_min_lr"}
_OWN_KEYS = ("params", "param_names", *_param_groups.FLAG_KEYS)
_UNSET = object()

def _numeric(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
        isinstance(value, torch.Tensor) and value.dim() == 0)


def _same(a: Any, b: Any) -> bool:
    """Whether a group value is the one already applied (identity for tensors)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or callable(a):
        return False
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # values without a plain equality
        return False


def _signature(factory: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(factory).parameters)
    except (TypeError, ValueError):  # a callable without a signature
        return {}


def _scaled(factory: Any, index: int, options: dict[str, Any], option: str, key: str,
            mult: float) -> Any:
    """The group's ``option`` (its own, else the factory's default) times ``mult``."""
    if option in options:
        base = options[option]
    else:
        parameter = _signature(factory).get(option)
        if parameter is None or parameter.default is inspect.Parameter.empty:
            raise TypeError(
                f"{_OWNER}: param group {index} sets {key}={mult!r}, which multiplies the "
                f"factory's {option!r}, but the group does not set {option!r} and the factory "
                f"has no {option!r} argument with a default. Fix: give the factory one, e.g. "
                f"transform=lambda learning_rate=1e-3, weight_decay=0.1: functopt.adamw("
                f"learning_rate, weight_decay=weight_decay), or set {option!r} in the group."
            )
        base = parameter.default
    if isinstance(base, torch.Tensor) or (
        isinstance(base, (int, float)) and not isinstance(base, bool)
    ):
        return base * mult
    if callable(base):  # a schedule: scale its value at every step
        return lambda count: base(count) * mult
    raise TypeError(
        f"{_OWNER}: param group {index} sets {key}={mult!r}, but its {option!r} is "
        f"{type(base).__name__} {base!r}, not a number, a 0-d tensor or a schedule, so it "
        f"cannot be multiplied. Fix: give {option!r} a numeric value."
    )


def _call_factory(factory: Any, index: int, options: dict[str, Any],
                  given: list[str]) -> GradientTransformation:
    """``factory(**options)``, checked."""
    try:
        tx = factory(**options)
    except TypeError as error:
        raise TypeError(
            f"{_OWNER}: the transform factory failed on the options of param group {index} "
            f"({sorted(given)}): {error}. Fix: give the factory a keyword argument "
            f"for every option the groups set."
        ) from error
    if not isinstance(tx, GradientTransformation):
        raise TypeError(
            f"{_OWNER}: the transform factory returned a {type(tx).__name__} for param "
            f"group {index}; expected a functopt.GradientTransformation."
        )
    return tx


class _Plan:
    """How one param group's keys reach its transform.

    A key holds one or two (``betas``) of the transform's arguments. An argument injected
    by ``inject_hyperparams`` (at the root of the group's transform) lives in the state:
    a new value is written there before the step. Any other argument of a factory was
    used to build the group's transform: a new value rebuilds it (the state is kept).
    """

    def __init__(self, index: int, group: _param_groups.ParamGroup, factory: Any,
                 given: dict[str, Any]) -> None:
        self.index = index
        self.frozen = group.frozen
        self.factory = factory  # None: the one transform given to the constructor
        self.given = sorted(given)  # the option names the group set at construction
        self.built: dict[str, Any] = dict(given)  # factory argument -> value built with
        # the factory's arguments (read once: a step checks the group keys against them)
        self.arguments = frozenset(_signature(factory)) if factory is not None else frozenset()
        if factory is not None:
            for name, parameter in _signature(factory).items():
                if name not in self.built and _numeric(parameter.default):
                    self.built[name] = parameter.default
        # the multipliers, folded into the group's values here (plain numbers; see fold)
        self.mults = (group.lr_mult, group.wd_mult)
        self.injected: dict[str, torch.Tensor] = {}  # injected name -> its state tensor
        self.written: dict[str, Any] = {}  # injected name -> value last written
        self.keys: dict[str, tuple[str, ...]] = {}  # group key -> argument names
        self.recipe: str | None = None  # the recipe a fixed transform injects into, if one
        self.allowed: frozenset[str] = frozenset()  # every key a group may hold
        # the options a group of a fixed transform set (torch's names), read once the
        # keys are known
        self.pending: dict[str, Any] = {}
        self.transform: GradientTransformation | None = None
        if factory is not None:  # (a fixed transform's: once its state shows its values)
            self.fold()

    def fold(self, injected: dict[str, torch.Tensor] | None = None) -> None:
        """Multiply the group's learning rate and weight decay by its ``lr_mult`` and
        ``wd_mult``, once: the group holds the products, the values its step uses. The
        value multiplied is the group's own, else the factory's default (a schedule's
        value is multiplied at every step), else (a fixed transform) the one ``injected``
        holds."""
        for (key, option), mult in zip(_param_groups.MULTIPLIED, self.mults, strict=True):
            if mult == 1.0:
                continue
            options = dict(self.built)
            if option not in options and injected is not None and option in injected:
                held = injected[option]
                options[option] = held if held.requires_grad else held.item()
            self.built[option] = _scaled(self.factory, self.index, options, option, key, mult)

    def build(self) -> GradientTransformation:
        # (An injected argument's value in the state, not this one, is what the step uses.)
        self.transform = _call_factory(self.factory, self.index, self.built, self.given)
        return self.transform

    def expose(self, hyperparams: dict[str, torch.Tensor] | None,
               recipe: str | None = None) -> None:
        """Name the group keys, once the state (and so the injected tensors) exists:
        ``recipe`` (the recipe a fixed transform injects into, if one) picks its row of
        torch's names, as in functopt.Optimizer."""
        self.injected = dict(hyperparams or {})
        self.recipe = recipe
        names = list(dict.fromkeys([*self.built, *self.injected]))
        # the one group-key rule functopt.Optimizer uses
        self.keys = _param_groups.recipe_group_keys(_OWNER, recipe, names)
        self.allowed = frozenset({*_OWN_KEYS, *BOOKKEEPING_KEYS, *self.readable()})

    def readable(self) -> set[str]:
        """The group keys this group's transform reads (plus the factory's other arguments)."""
        return set(self.keys) | self.arguments

    def check_keys(self, owner: str, where: str, group: dict[str, Any]) -> None:
        """Raise on a key of ``group`` that no step reads (the rule of both adapters)."""
        _param_groups.check_group_keys(owner, where, group, self.allowed, self.keys,
                                       self.recipe, self.arguments - set(self.keys))


def _hyper_tensor(where: str, name: str, value: Any, held: torch.Tensor) -> torch.Tensor:
    """A group value as the injected 0-d tensor, in the dtype and device the state keeps."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.to(dtype=held.dtype, device=held.device)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{_OWNER}: {where} gives the transform's {name!r} as {type(value).__name__} "
            f"{value!r}; expected a number or a 0-d tensor."
        )
    return torch.tensor(value, dtype=held.dtype, device=held.device)


def _as_argument(factory: Any, index: int, options: dict[str, Any]) -> dict[str, Any]:
    """Group options under the factory's argument names: the keys its arguments have in the
    groups (``recipe_group_keys``, the rule of both adapters: ``lr`` for ``learning_rate``,
    ``betas`` for ``b1, b2``, ...) are mapped to them; any other key is passed as it is."""
    keys = _param_groups.recipe_group_keys(_OWNER, None, list(_signature(factory)))
    return _param_groups.group_arguments(_OWNER, f"param_groups[{index}]", keys, options)


def group_plans(groups: list[_param_groups.ParamGroup], transform: Any,
                factories: list[Any] | None, fixed: GradientTransformation | None,
                fixed_injected: bool) -> tuple[list[_Plan], list[dict[str, Any]]]:
    """Each group's plan (its factory and options: ``factories[i]``, else ``transform``
    when no ``fixed`` transform serves every group) and the bookkeeping keys it keeps
    (Megatron's decoupled lrs as its ``max_lr`` / ``min_lr``, the scheduler records times
    ``lr_mult``). A fixed transform that does not inject takes no options."""
    plans: list[_Plan] = []
    kept: list[dict[str, Any]] = []  # each group's bookkeeping keys
    for i, group in enumerate(groups):
        _param_groups.check_megatron_flags(_OWNER, f"param_groups[{i}]", group.options)
        options = {k: v for k, v in group.options.items() if k not in BOOKKEEPING_KEYS}
        book = decoupled_records(i, {k: v for k, v in group.options.items()
                                     if k in BOOKKEEPING_KEYS})
        kept.append({**book, **_param_groups.scaled_lr_records(group.lr_mult, book)})
        factory = factories[i] if factories is not None else (
            None if fixed is not None else transform)
        if fixed is not None and not group.frozen and not fixed_injected:
            mults = {k: v for k, v in (("lr_mult", group.lr_mult),
                                       ("wd_mult", group.wd_mult)) if v != 1.0}
            if options or mults:
                raise TypeError(
                    f"{_OWNER}: param group {i} sets {sorted(options) + sorted(mults)}, "
                    f"but transform is a GradientTransformation, whose hyperparameters "
                    f"are fixed when it is built. Fix: pass a factory that builds each "
                    f"group's transform from its options, e.g. transform=lambda "
                    f"learning_rate=1e-3, weight_decay=0.01: functopt.adamw("
                    f"learning_rate, weight_decay=weight_decay), or inject them: "
                    f"functopt.inject_hyperparams(functopt.adamw)(learning_rate=1e-3)."
                )
        if factory is None:  # named once the state shows what the transform injects
            plans.append(_Plan(i, group, None, {}))
            plans[-1].pending = options
        else:
            plans.append(_Plan(i, group, factory, _as_argument(factory, i, options)))
    return plans, kept


class FacadeGroups:
    """The facade's param groups over its transform: one transform per group through
    ``partition``, the group values written into the state or rebuilding a group's
    transform before each step (see the module's docstring)."""

    # the facade's (functopt/adapters/mixed_precision_optimizer.py)
    param_groups: list[dict[str, Any]]
    _plans: list[_Plan]
    _fixed: GradientTransformation | None
    _fixed_injected: bool
    _partitioned: bool
    _labels: dict[str, int]
    _state: MixedPrecisionState
    _params: list[torch.Tensor]
    _names: list[str]
    _master_weights: MasterWeights
    _inner: GradientTransformation
    _tx: MixedPrecisionTransformation
    _synced: list[tuple[tuple[str, Any], ...]] | None

    if TYPE_CHECKING:
        def _build(self) -> MixedPrecisionTransformation: ...

        def _tree(self, leaves: list[Any]) -> Any: ...

    def _torch_groups(self, groups: list[_param_groups.ParamGroup],
                      kept: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The groups torch's constructor takes: each group's named params, its values
        (the keys its transform exposes, named once the state shows what it injects), its
        flags other than their defaults and its bookkeeping keys."""
        torch_groups = []
        for plan, group, book in zip(self._plans, groups, kept, strict=True):
            if not plan.frozen:
                found = self._group_state(self._state, plan.index)
                hyper = found.hyperparams if isinstance(found, InjectHyperparamsState) else None
                signature = None if plan.factory is not None or hyper is None else \
                    _state_dict.recipe_signature(plan.transform, hyper)
                plan.expose(hyper, None if signature is None else signature.split("(", 1)[0])
                if plan.factory is None:  # its groups' options: the keys it exposes
                    where = f"param_groups[{plan.index}]"
                    _param_groups.check_group_keys(_OWNER, where, plan.pending, plan.keys,
                                                   plan.keys, plan.recipe)
                    plan.built.update(_param_groups.group_arguments(_OWNER, where, plan.keys,
                                                                    plan.pending))
                    _param_groups.check_multipliers(
                        _OWNER, f"param_groups[{plan.index}]", _param_groups.GroupFlags(
                            group.lr_mult, group.wd_mult, group.frozen), plan.injected)
                    plan.fold(plan.injected)
            flags = {k: v for k, v in (("lr_mult", group.lr_mult), ("wd_mult", group.wd_mult),
                                       ("frozen", group.frozen))
                     if v != (k != "frozen" and 1.0)}
            torch_groups.append({"params": list(zip(group.names, group.params, strict=True)),
                                 **self._group_values(plan), **flags, **book})
        return torch_groups

    def _compose(self) -> GradientTransformation:
        """The transform over the trainable params: one per group through ``partition``."""
        plans = [plan for plan in self._plans if not plan.frozen]
        if self._fixed is not None:
            for plan in plans:
                plan.transform = self._fixed
            if len(plans) == 1 or not self._fixed_injected:
                self._partitioned = False
                return self._fixed
            transforms: dict[Hashable, GradientTransformation] = {
                plan.index: self._fixed for plan in plans}
        else:
            transforms = {plan.index: plan.build() for plan in plans}
            if len(transforms) == 1:
                self._partitioned = False
                return next(iter(transforms.values()))
        self._partitioned = True
        return partition(transforms, self._labels)

    def _group_state(self, state: MixedPrecisionState, index: int) -> Any:
        inner = state.inner_state
        return inner.inner_states[index] if self._partitioned else inner

    def _with_group_state(self, state: MixedPrecisionState, index: int,
                          group_state: Any) -> MixedPrecisionState:
        inner = state.inner_state
        if self._partitioned:
            inner = inner._replace(inner_states={**inner.inner_states, index: group_state})
        else:
            inner = group_state
        return state._replace(inner_state=inner)

    def _group_values(self, plan: _Plan) -> dict[str, Any]:
        """The group keys of ``plan`` and their values (torch's names)."""
        out: dict[str, Any] = {}
        for key, names in plan.keys.items():
            values = []
            for name in names:
                if name in plan.built:
                    values.append(plan.built[name])
                else:  # an injected value the constructor was not given: as built
                    held = plan.injected[name]
                    values.append(held if held.requires_grad else held.item())
            out[key] = values[0] if len(values) == 1 else tuple(values)
        return out

    def _sync(self) -> None:
        """Bring the group values into the step: write injected ones into the state,
        rebuild the transform of a group whose other values changed; raise on keys no
        transform reads. Groups holding the very values of the last sync, none of them
        mutable, have nothing to bring (the usual step: read in one pass)."""
        seen = self.__dict__.get("_synced")
        if seen is not None and len(seen) == len(self.param_groups) and all(
                len(group) == len(items) and all(
                    key == k and value is v for (key, value), (k, v) in zip(
                        group.items(), items, strict=True))
                for group, items in zip(self.param_groups, seen, strict=True)):
            return
        self._synced = None
        self._sync_groups()
        snapshot = [tuple(group.items()) for group in self.param_groups]
        if all(immutable(v) for items in snapshot for k, v in items
               if k not in ("params", "param_names")):
            self._synced = snapshot

    def _sync_groups(self) -> None:
        state = self._state
        rebuild = False
        before = [dict(plan.built) for plan in self._plans]
        for plan, group in zip(self._plans, self.param_groups, strict=True):
            if not plan.frozen:  # (before any group's values are written)
                where = f"param_groups[{plan.index}]"
                _param_groups.check_unchanged_multipliers(
                    _OWNER, where, _param_groups.group_flags(_OWNER, where, group), plan.mults)
        for plan, group in zip(self._plans, self.param_groups, strict=True):
            where = f"param_groups[{plan.index}]"
            flags = _param_groups.group_flags(_OWNER, where, group)
            if flags.frozen != plan.frozen:
                raise ValueError(
                    f"{_OWNER}: {where} changed frozen to {flags.frozen}; which params a step "
                    f"updates is fixed when the optimizer is built (their state is made then). "
                    f"Fix: build a new optimizer with the groups frozen as wanted."
                )
            if plan.frozen:
                continue
            readable = plan.readable()
            if not plan.allowed.issuperset(group):
                plan.check_keys(_OWNER, where, group)
            values = _param_groups.group_arguments(
                _OWNER, where, plan.keys, {k: group[k] for k in group if k in readable})
            found = None
            for name, value in values.items():
                if name in plan.injected:
                    if not _same(plan.written.get(name, _UNSET), value):
                        found = self._group_state(state, plan.index) if found is None else found
                        found = found._replace(hyperparams={
                            **found.hyperparams,
                            name: _hyper_tensor(where, name, value, plan.injected[name])})
                        plan.written[name] = value
                    plan.built[name] = value
                elif not _same(plan.built.get(name, _UNSET), value):
                    plan.built[name] = value
                    rebuild = True
            if found is not None:
                state = self._with_group_state(state, plan.index, found)
        if rebuild:
            inner = self._compose()
            if self._changes_layout(inner):
                changed = sorted({
                    f"param_groups[{plan.index}][{k!r}]"
                    for plan, built in zip(self._plans, before, strict=True)
                    for k in plan.built if not _same(built.get(k, _UNSET), plan.built[k])})
                for plan, built in zip(self._plans, before, strict=True):
                    plan.built = built
                self._compose()  # the transforms as they were
                raise ValueError(
                    f"{_OWNER}: the new values of {changed} change the layout of the "
                    f"transform's state (a stage added or removed, such as amsgrad or a "
                    f"momentum from 0), which the state built at construction cannot follow. "
                    f"Fix: build a new optimizer with these values (the state of this one "
                    f"does not carry over), or leave them as they were."
                )
            self._inner = inner
            self._tx = self._build()
        self._state = state

    def _changes_layout(self, inner: GradientTransformation) -> bool:
        """Whether ``inner``'s state has another structure than the one held (its init on
        meta tensors: nothing is allocated)."""
        mw = self._master_weights
        with torch.no_grad():
            views = [torch.empty_like(mw.view(p.detach(), self._state.master[name]),
                                      device="meta")
                     for p, name in zip(self._params, self._names, strict=True)]
            try:
                fresh = inner.init(self._tree(views))
            except Exception:  # an init that cannot run on meta tensors: not checked
                return False
        return _core.structure(fresh) != _core.structure(self._state.inner_state)
