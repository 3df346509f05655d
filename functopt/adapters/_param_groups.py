"""Reading the ``params`` argument of a training-stack facade into named parameter groups.

``torch.optim`` takes an iterable of tensors or a list of group dicts; LightRFT and
Megatron build their groups the same way. The facades of functopt also accept names,
``model.named_parameters()`` or a ``{name: param}`` dict, because their state is keyed by
parameter names. Everything is checked here, once, with the parameter's name in the message.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

import torch

__all__: list[str] = []

_GROUP_FIX = (
    "Fix: pass model.named_parameters() (or model.parameters(), a {name: param} dict, or a "
    "list of group dicts such as [{'params': [...], 'weight_decay': 0.0}, ...])."
)


class ParamGroup(NamedTuple):
    """One group: its parameters, their names, its options, and its multipliers and flag."""

    names: list[str]
    params: list[torch.Tensor]
    options: dict[str, Any]  # every key but params, param_names, lr_mult, wd_mult, frozen
    lr_mult: float = 1.0  # folded into the group's learning rate when it is added
    wd_mult: float = 1.0  # folded into the group's weight decay when it is added
    frozen: bool = False  # no state, no update, outside the global norm and skip decision


class GroupFlags(NamedTuple):
    """The group options the adapters read themselves (Megatron's names for the multipliers)."""

    lr_mult: float
    wd_mult: float
    frozen: bool


FLAG_KEYS = ("lr_mult", "wd_mult", "frozen")


def group_flags(owner: str, where: str, group: Mapping[str, Any]) -> GroupFlags:
    """Read and check ``lr_mult``, ``wd_mult`` (numbers >= 0, default 1) and ``frozen`` (bool).

    ``where`` names the group in the messages (``'param_groups[1]'``, ``'param group 1'``).
    """
    mults = []
    for key in ("lr_mult", "wd_mult"):
        value = group.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"{owner}: {where} sets {key}={value!r} ({type(value).__name__}); expected a "
                f"Python number >= 0 (default 1.0). Fix: pass a float such as {key}=0.1."
            )
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(
                f"{owner}: {where} sets {key}={value!r}; expected a finite number >= 0 "
                f"(default 1.0). Fix: pass a finite non-negative multiplier; to keep a group's "
                f"params unchanged without optimizer state, set frozen=True."
            )
        mults.append(float(value))
    frozen = group.get("frozen", False)
    if not isinstance(frozen, bool):
        raise TypeError(
            f"{owner}: {where} sets frozen={frozen!r} ({type(frozen).__name__}); expected "
            f"True or False. Fix: pass a bool, frozen=True to leave the group's params out of "
            f"the step."
        )
    return GroupFlags(mults[0], mults[1], frozen)


def _is_group(item: Any) -> bool:
    return isinstance(item, Mapping)


def _named(owner: str, items: Any, start: int) -> list[tuple[str, Any]]:
    """``(name, param)`` pairs of one group's params; unnamed params are named by position."""
    if isinstance(items, torch.Tensor):
        raise TypeError(
            f"{owner}: params must be an iterable of tensors, got a single tensor of shape "
            f"{tuple(items.shape)}. Fix: wrap it in a list, [param]."
        )
    if isinstance(items, Mapping):
        return [(_check_name(owner, k), v) for k, v in items.items()]
    if isinstance(items, torch.nn.Module):
        raise TypeError(
            f"{owner}: params is a {type(items).__name__} module; pass its parameters. "
            f"{_GROUP_FIX}"
        )
    try:
        listed = list(items)
    except TypeError:
        raise TypeError(
            f"{owner}: params must be an iterable, got {type(items).__name__}. {_GROUP_FIX}"
        ) from None
    out: list[tuple[str, Any]] = []
    for i, item in enumerate(listed):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            out.append((_check_name(owner, item[0]), item[1]))
        else:
            out.append((str(start + i), item))
    return out


def _check_name(owner: str, name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"{owner}: parameter names must be non-empty strings, got {name!r}. {_GROUP_FIX}"
        )
    return name


def _check_param(owner: str, name: str, p: Any, frozen: bool = False) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(
            f"{owner}: param {name!r} is a {type(p).__name__}, expected a torch.Tensor "
            f"(an nn.Parameter). {_GROUP_FIX}"
        )
    if not p.is_floating_point():
        raise TypeError(
            f"{owner}: param {name!r} is {str(p.dtype).removeprefix('torch.')}; only "
            f"floating-point params (float16, bfloat16, float32, float64) can be optimized. "
            f"Fix: leave integer and complex tensors out of the params (store complex weights "
            f"as torch.view_as_real pairs)."
        )
    if not p.requires_grad and not frozen:
        raise ValueError(
            f"{owner}: param {name!r} does not require grad, so it would never be updated. "
            f"Fix: leave frozen params out, e.g. "
            f"[(n, p) for n, p in model.named_parameters() if p.requires_grad], or put them "
            f"in a group with frozen=True."
        )
    if not p.is_leaf:
        raise ValueError(
            f"{owner}: param {name!r} is not a leaf tensor (it was computed from other "
            f"tensors), so autograd does not keep its .grad. Fix: pass the model's "
            f"nn.Parameters themselves, not tensors derived from them."
        )


def collect(owner: str, params: Any) -> list[ParamGroup]:
    """Read ``params`` (tensors, named tensors, or group dicts) into checked groups.

    Unnamed params are named by their position over all groups (``'0'``, ``'1'``, ...), as
    ``torch.optim`` numbers them in its state dict. A group dict may carry ``param_names``
    (``torch.optim``'s key) to name a list of tensors, and ``lr_mult``, ``wd_mult`` and
    ``frozen`` (see `group_flags`); the params of a frozen group need not require grad.
    """
    specs, grouped = _group_specs(owner, params)
    groups: list[ParamGroup] = []
    seen_names: dict[str, int] = {}
    seen_ids: dict[int, str] = {}
    count = 0
    for i, spec in enumerate(specs):
        named = _group_named(owner, i, spec, grouped, count)
        count += len(named)
        flags = group_flags(owner, f"param_groups[{i}]", spec)
        for key in FLAG_KEYS:
            spec.pop(key, None)
        for name, p in named:
            _check_param(owner, name, p, flags.frozen)
            _check_unique(owner, i, name, p, seen_names, seen_ids)
        groups.append(ParamGroup([n for n, _ in named], [p for _, p in named], spec, *flags))
    if count == 0:
        raise ValueError(f"{owner}: got an empty list of params. {_GROUP_FIX}")
    return groups


def _group_specs(owner: str, params: Any) -> tuple[list[dict[str, Any]], bool]:
    """``params`` as one dict per group (each with its ``"params"``), and whether they were
    given as group dicts."""
    if isinstance(params, Mapping) and "params" in params and not isinstance(
        params["params"], torch.Tensor
    ):
        raw: list[Any] = [params]  # a single group dict
        grouped = True
    elif isinstance(params, (Mapping, torch.Tensor, torch.nn.Module)):
        raw = [params]
        grouped = False
    else:
        try:
            raw = list(params)
        except TypeError:
            raise TypeError(
                f"{owner}: params must be an iterable, got {type(params).__name__}. "
                f"{_GROUP_FIX}"
            ) from None
        grouped = bool(raw) and all(_is_group(item) for item in raw)
        if any(_is_group(item) for item in raw) and not grouped:
            raise TypeError(
                f"{owner}: params mixes group dicts with tensors. Fix: put every tensor in a "
                f"group dict, [{{'params': [...]}}, ...]."
            )
        if not grouped:
            raw = [raw]
    if not grouped:
        return [{"params": item} for item in raw], False
    for i, item in enumerate(raw):
        if "params" not in item:
            raise ValueError(
                f"{owner}: param group {i} has no 'params' key (keys: {sorted(map(str, item))})."
                f" {_GROUP_FIX}"
            )
    return [dict(item) for item in raw], True


def _group_named(owner: str, i: int, spec: dict[str, Any], grouped: bool,
                 count: int) -> list[tuple[str, Any]]:
    """The ``(name, param)`` pairs of group ``i``, taken out of ``spec`` (its ``"params"``
    and ``"param_names"``); unnamed params are numbered from ``count``."""
    items = spec.pop("params")
    if grouped and isinstance(items, torch.Tensor):  # as torch.optim, in a group dict
        items = [items]
    named = _named(owner, items, count)
    names_given = spec.pop("param_names", None)
    if names_given is None:
        return named
    names_given = list(names_given)
    if len(names_given) != len(named):
        raise ValueError(
            f"{owner}: param group {i} has {len(named)} params but "
            f"{len(names_given)} param_names. Fix: give one name per param."
        )
    return [(_check_name(owner, n), p) for n, (_, p) in zip(names_given, named, strict=True)]


def _check_unique(owner: str, i: int, name: str, p: Any, seen_names: dict[str, int],
                  seen_ids: dict[int, str]) -> None:
    """Record param ``p`` of group ``i`` under ``name``; raise where the name or the tensor
    was seen before."""
    if name in seen_names:
        raise ValueError(
            f"{owner}: the name {name!r} is used by two params (groups "
            f"{seen_names[name]} and {i}). Fix: give each param a unique name."
        )
    if id(p) in seen_ids:
        raise ValueError(
            f"{owner}: the same tensor appears twice, as {seen_ids[id(p)]!r} and "
            f"{name!r}; it would be updated twice per step. Fix: list each param once "
            f"(model.named_parameters() already removes tied duplicates)."
        )
    seen_names[name] = i
    seen_ids[id(p)] = name


# Each recipe's hyperparameters as param-group keys: group key -> the recipe's arguments it
# holds (several make a tuple, as torch's ``betas``), under torch.optim's names where torch has
# the same quantity. The one place the adapters map recipes onto torch's groups: a plain recipe
# exposes these (those given as numbers), inject_hyperparams of a recipe names its injected
# ones by it. A recipe argument not listed here is fixed when the recipe is built.
RECIPE_GROUP_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "sgd": {"lr": ("learning_rate",), "momentum": ("momentum",)},
    "adam": {"lr": ("learning_rate",), "betas": ("b1", "b2"), "eps": ("eps",),
             "eps_root": ("eps_root",)},
    "adamw": {"lr": ("learning_rate",), "betas": ("b1", "b2"), "eps": ("eps",),
              "eps_root": ("eps_root",), "weight_decay": ("weight_decay",)},
    "nadam": {"lr": ("learning_rate",), "betas": ("b1", "b2"), "eps": ("eps",),
              "eps_root": ("eps_root",)},
    "nadamw": {"lr": ("learning_rate",), "betas": ("b1", "b2"), "eps": ("eps",),
               "eps_root": ("eps_root",), "weight_decay": ("weight_decay",)},
    "amsgrad": {"lr": ("learning_rate",), "betas": ("b1", "b2"), "eps": ("eps",),
                "eps_root": ("eps_root",)},
    "radam": {"lr": ("learning_rate",), "betas": ("b1", "b2"), "eps": ("eps",),
              "eps_root": ("eps_root",)},
    "adamax": {"lr": ("learning_rate",), "betas": ("b1", "b2"), "eps": ("eps",)},
    "lion": {"lr": ("learning_rate",), "betas": ("b1", "b2"),
             "weight_decay": ("weight_decay",)},
    "lamb": {"lr": ("learning_rate",), "betas": ("b1", "b2"), "eps": ("eps",),
             "eps_root": ("eps_root",), "weight_decay": ("weight_decay",)},
    "rmsprop": {"lr": ("learning_rate",), "alpha": ("decay",), "eps": ("eps",),
                "momentum": ("momentum",), "initial_scale": ("initial_scale",)},
    "adagrad": {"lr": ("learning_rate",),
                "initial_accumulator_value": ("initial_accumulator_value",), "eps": ("eps",)},
    "adadelta": {"lr": ("learning_rate",), "rho": ("rho",), "eps": ("eps",),
                 "weight_decay": ("weight_decay",)},
    "rprop": {"lr": ("learning_rate",), "etas": ("eta_minus", "eta_plus"),
              "step_sizes": ("min_step_size", "max_step_size")},
    "lars": {"lr": ("learning_rate",), "momentum": ("momentum",),
             "weight_decay": ("weight_decay",), "trust_coefficient": ("trust_coefficient",),
             "eps": ("eps",)},
    "adafactor": {"lr": ("learning_rate",), "eps": ("eps",), "momentum": ("momentum",),
                  "weight_decay": ("weight_decay_rate",), "decay_rate": ("decay_rate",),
                  "clipping_threshold": ("clipping_threshold",)},
    "sign_sgd": {"lr": ("learning_rate",)},
}

# torch.optim group keys whose quantity a recipe has in another form: setting one raises with
# this explanation instead of being ignored (torch.optim.Adafactor's d and beta2_decay).
FOREIGN_GROUP_KEYS: dict[str, dict[str, str]] = {
    "adafactor": {
        "d": "torch.optim.Adafactor's update clipping threshold d is functopt.adafactor's "
             "'clipping_threshold' (the same rule, clip the update's RMS to d)",
        "beta2_decay": "torch.optim.Adafactor's beta2_decay (-0.8) is functopt.adafactor's "
                       "'decay_rate' with the sign flipped (0.8: beta2_t = 1 - t**-0.8)",
    },
}

# Keys that torch's and the training stacks' schedulers keep in the groups for themselves
# (LRScheduler's initial_lr, OneCycleLR's max/min lr and momenta, SWALR's swa_lr) and
# Megatron-LM's param-group fields (its OptimizerParamScheduler reads max_lr, min_lr,
# start_wd and end_wd): allowed in every group of both adapters, never read by a transform.
SCHEDULER_GROUP_KEYS = frozenset({
    "initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr",
    "is_expert_parallel", "is_decoupled_lr", "default_config", "start_wd", "end_wd",
})


def recipe_group_keys(
    owner: str, recipe: str | None, names: list[str]
) -> dict[str, tuple[str, ...]]:
    """Group key -> injected hyperparameters, for a transform injecting ``names``.

    ``recipe`` (the name of the recipe inside ``inject_hyperparams``, if one is) picks its
    row of ``RECIPE_GROUP_KEYS``; a key is exposed when all its arguments are injected. Any
    other factory gets the rule every Adam-like one follows: ``lr`` for ``learning_rate``,
    ``betas`` for ``(b1, b2)``, ``momentum`` for ``momentum`` or a lone ``b1``. The injected
    names no key takes are exposed as they are.
    """
    if recipe in RECIPE_GROUP_KEYS:
        table = RECIPE_GROUP_KEYS[recipe]
    else:
        table = {"lr": ("learning_rate",), "betas": ("b1", "b2"), "momentum": ("momentum",)}
        if "b1" in names and "b2" not in names and "momentum" not in names:
            table["momentum"] = ("b1",)
    exposed = {key: args for key, args in table.items() if all(a in names for a in args)}
    used = {a for args in exposed.values() for a in args}
    for name in names:
        if name in used:
            continue
        if name in exposed or name in ("params", "param_names", *FLAG_KEYS):
            raise ValueError(
                f"{owner}: the transform injects a hyperparameter named {name!r}, which clashes "
                f"with the param group key {name!r} (group keys: {sorted(exposed)}). Fix: "
                f"rename the factory's argument."
            )
        exposed[name] = (name,)
    return exposed


def split_value(owner: str, where: str, key: str, names: tuple[str, ...],
                value: Any) -> tuple[Any, ...]:
    """The values of the arguments ``names`` that the group key ``key`` holds: the value
    itself for one argument, the items of a tuple or list of as many for several (torch's
    ``betas`` for ``b1, b2``). ``where`` names the group (``'param_groups[0]'``).

    Examples:
        >>> split_value("opt", "param_groups[0]", "betas", ("b1", "b2"), [0.9, 0.99])
        (0.9, 0.99)
    """
    if len(names) == 1:
        return (value,)
    if isinstance(value, (tuple, list)) and len(value) == len(names):
        return tuple(value)
    raise ValueError(
        f"{owner}: {where}[{key!r}] must be a {len(names)}-tuple ({', '.join(names)}), got "
        f"{value!r}. Fix: set it to a tuple of {len(names)} numbers, in that order."
    )


def group_arguments(owner: str, where: str, keys: Mapping[str, tuple[str, ...]],
                    values: Mapping[str, Any]) -> dict[str, Any]:
    """Group values under the transform's argument names: a key of ``keys`` (group key ->
    arguments, as `recipe_group_keys` gives them) is its argument, or its arguments when it
    holds several (`split_value`); any other key stays as it is. ``where`` names the group
    in the message.

    Examples:
        >>> group_arguments("opt", "param_groups[0]", {"betas": ("b1", "b2")},
        ...                 {"betas": (0.9, 0.99), "nesterov": True})
        {'b1': 0.9, 'b2': 0.99, 'nesterov': True}
    """
    out: dict[str, Any] = {}
    for key, value in values.items():
        names = keys.get(key)
        if names is None:
            out[key] = value
        else:
            out.update(zip(names, split_value(owner, where, key, names, value), strict=True))
    return out


MULTIPLIED = (("lr_mult", "learning_rate"), ("wd_mult", "weight_decay"))
"""Each multiplier's group key and the injected hyperparameter it multiplies."""


def check_multipliers(owner: str, where: str, flags: GroupFlags,
                      injected: Collection[str]) -> None:
    """Raise if a multiplier other than 1 would multiply a hyperparameter the transform does
    not inject (``injected``: the names it does), which would leave it ignored.

    Examples:
        >>> check_multipliers("opt", "param_groups[0]", GroupFlags(2.0, 1.0, False),
        ...                   ["learning_rate"])
    """
    for (key, name), mult in zip(MULTIPLIED, (flags.lr_mult, flags.wd_mult), strict=True):
        if mult != 1.0 and name not in injected:
            raise ValueError(
                f"{owner}: {where} sets {key}={mult!r}, which multiplies the injected "
                f"{name!r}, but the transform does not inject it (it injects "
                f"{sorted(injected) or 'none'}), so the multiplier would be ignored. Fix: "
                f"remove {key!r}, or inject {name!r}: give the recipe a number for it (a "
                f"schedule is not injected), or build the transform with "
                f"functopt.inject_hyperparams(factory)(...)."
            )


def times(value: Any, mult: float) -> Any:
    """A group's number or tensor times its multiplier (a multiplier of 1 leaves it as it
    is); any other value is left for the hyperparameter checks to refuse."""
    if mult == 1.0 or isinstance(value, bool) or not isinstance(
            value, (int, float, torch.Tensor)):
        return value
    return value * mult


LR_RECORDS = ("initial_lr", "max_lr", "min_lr")
"""The learning rates schedulers keep in a group and compute its lr from: torch's
``initial_lr``, and the ``max_lr`` / ``min_lr`` that megatron-core 0.16.1's
``OptimizerParamScheduler`` reads (``get_lr``, megatron/core/optimizer_param_scheduler.py)
without ever reading ``lr_mult``."""


def scaled_lr_records(lr_mult: float, group: Mapping[str, Any]) -> dict[str, Any]:
    """``group``'s `LR_RECORDS` that are numbers, times ``lr_mult``: the group's lr and the
    lrs a scheduler computes it from are scaled alike, so that the scheduler's writes keep
    the multiplier.

    Examples:
        >>> scaled_lr_records(2.0, {"max_lr": 0.1, "min_lr": 0.01, "lr": 0.1})
        {'max_lr': 0.2, 'min_lr': 0.02}
    """
    return {k: times(group[k], lr_mult) for k in LR_RECORDS
            if k in group and not isinstance(group[k], torch.Tensor)}


def check_megatron_flags(owner: str, where: str, group: Mapping[str, Any]) -> None:
    """Raise on Megatron's group flags where they would be ignored: ``is_expert_parallel``
    and ``is_decoupled_lr`` that are not bools, and ``is_decoupled_lr=True`` on a group
    that holds no decoupled learning rate (``decoupled_lr``, or the ``max_lr`` Megatron's
    scheduler reads), which its scheduler would run on its own ``max_lr`` / ``min_lr``.

    Examples:
        >>> check_megatron_flags("opt", "param_groups[0]",
        ...                      {"is_decoupled_lr": True, "max_lr": 0.02})
    """
    for key in ("is_expert_parallel", "is_decoupled_lr"):
        if key in group and not isinstance(group[key], bool):
            raise TypeError(
                f"{owner}: {where} sets {key}={group[key]!r} "
                f"({type(group[key]).__name__}); expected True or False (Megatron's flag). "
                f"Fix: pass a bool.")
    if group.get("is_decoupled_lr") is True and not (
            "decoupled_lr" in group or "max_lr" in group):
        raise ValueError(
            f"{owner}: {where} sets is_decoupled_lr=True but holds no decoupled learning "
            f"rate, so Megatron's OptimizerParamScheduler would run it on its own max_lr / "
            f"min_lr and the flag would change nothing (megatron-core 0.16.1 reads a "
            f"group's max_lr / min_lr, never is_decoupled_lr). Fix: give the group its "
            f"peak as max_lr (and its floor as min_lr), or leave is_decoupled_lr out.")


def check_unchanged_multipliers(owner: str, where: str, flags: GroupFlags,
                                folded: tuple[float, float]) -> None:
    """Raise if the group's multipliers are no longer the ``folded`` ones, those its values
    were multiplied by at construction: a new one would change nothing.

    Examples:
        >>> check_unchanged_multipliers("opt", "param_groups[0]", GroupFlags(2.0, 1.0, False),
        ...                             (2.0, 1.0))
    """
    if (flags.lr_mult, flags.wd_mult) != folded:
        raise ValueError(
            f"{owner}: {where} changed lr_mult / wd_mult to {flags.lr_mult!r} / "
            f"{flags.wd_mult!r} after construction (they were {folded[0]!r} / "
            f"{folded[1]!r}). The multipliers act once, when the group is added: its lr and "
            f"weight_decay hold their products and are what its step uses, so a new "
            f"multiplier would change nothing. Fix: write the group's lr / weight_decay "
            f"instead, and leave lr_mult / wd_mult as they were.")


# Option names of torch.optim's optimizers. A group that sets one the transform does not
# read would be silently ignored; that is an error instead, with the way to inject it.
TORCH_OPTIONS = frozenset({
    "lr", "betas", "momentum", "weight_decay", "eps", "dampening", "nesterov", "amsgrad",
    "maximize", "foreach", "fused", "capturable", "differentiable", "alpha", "centered",
    "lr_decay", "initial_accumulator_value", "rho", "lambd", "t0", "etas", "step_sizes",
    "momentum_decay", "decoupled_weight_decay", "ns_coefficients", "ns_steps",
    "adjust_lr_fn", "beta2_decay", "d",
})
HOW_TO_INJECT = (
    "Fix: pass a recipe, whose hyperparameters the groups hold under torch's names "
    "(functopt.adamw(1e-3)'s groups have lr, betas, eps, eps_root, weight_decay), or inject "
    "them into a transform of your own with functopt.inject_hyperparams(factory)(...): only "
    "the hyperparameters a step reads appear in param_groups."
)


def is_label(key: str, value: Any, renamed: Collection[str] = (),
             foreign: Collection[str] = ()) -> bool:
    """Whether a group key is a label, kept as torch keeps it and read by no step: a string
    under a key that names no torch option (``"name"``: ``"encoder"``). A string under a
    torch option's key (``adjust_lr_fn``) is an option, which a group may not set in vain.
    """
    return (isinstance(value, str) and key not in TORCH_OPTIONS and key not in renamed
            and key not in foreign)


def _asks_nothing(key: str, value: Any) -> bool:
    """Whether a group value asks for nothing, so that a transform without the option
    honours it as it is: a weight decay of 0 (torch's default, which code written for
    several torch.optim classes sets on groups of any class)."""
    return key == "weight_decay" and isinstance(value, (int, float)) and (
        not isinstance(value, bool)) and value == 0


def check_group_keys(owner: str, where: str, group: Mapping[str, Any],
                     allowed: Collection[str], exposed: Mapping[str, tuple[str, ...]],
                     recipe: str | None, arguments: Collection[str] = ()) -> None:
    """Raise on the first key of ``group`` outside ``allowed`` (the keys a step reads, the
    flags and the schedulers' records) that is not a label (`is_label`), which would be
    ignored: naming torch's name for a
    hyperparameter set under the recipe's (``learning_rate`` for ``lr``), what a foreign
    torch key is in the recipe (``FOREIGN_GROUP_KEYS``), how to inject a torch option, and
    what the groups do hold. ``exposed`` maps the group keys of the transform's
    hyperparameters to them; ``arguments`` are the other keys a factory reads.

    Examples:
        >>> check_group_keys("opt", "param_groups[0]", {"params": [], "lr": 0.1},
        ...                  {"params", "lr"}, {"lr": ("learning_rate",)}, "sgd")
    """
    renamed = {name: k for k, names in exposed.items() for name in names if name != k}
    foreign = FOREIGN_GROUP_KEYS.get(recipe or "", {})
    for key in group:
        if key in allowed or is_label(key, group[key], renamed, foreign) or (
                _asks_nothing(key, group[key])):
            continue
        others = f", the factory's arguments {sorted(arguments)}" if arguments else ""
        reads = (f"its groups hold the transform's hyperparameters {sorted(exposed)}{others}, "
                 f"besides params, param_names, {list(FLAG_KEYS)} and the schedulers' own "
                 f"{sorted(SCHEDULER_GROUP_KEYS)}")
        start = f"{owner}: {where} sets {key!r}"
        if key in renamed:
            raise ValueError(f"{start}, which its groups call {renamed[key]!r} (torch's name). "
                             f"Fix: set {renamed[key]!r} instead.")
        if key in foreign:
            raise ValueError(f"{start}, which {recipe} does not read: {foreign[key]}. Fix: "
                             f"remove it, and set the recipe's own key ({reads}).")
        if key in TORCH_OPTIONS:
            raise ValueError(
                f"{start}, but the transform has no hyperparameter for it that a step reads "
                f"from the groups ({reads}), so the value would be ignored. Remove it, or "
                f"build the transform with it. {HOW_TO_INJECT}")
        raise ValueError(f"{start}, which the transform does not read ({reads}), so the value "
                         f"would be ignored. Fix: remove it (a string, such as a group's "
                         f"'name', is kept as a label).")
