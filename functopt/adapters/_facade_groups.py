"""How the param groups of ``MixedPrecisionOptimizer`` reach its transform.

Each group's keys hold the arguments of its transform under torch's names. An argument
that ``inject_hyperparams`` keeps in the state is written there before a step (a 0-d
tensor: nothing is rebuilt, nothing recompiles); any other argument of a factory built the
group's transform, and a new value rebuilds it. A key that no transform reads is refused,
except the records that schedulers and Megatron-LM keep in the groups.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from functopt._base import GradientTransformation
from functopt.adapters import _param_groups

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
