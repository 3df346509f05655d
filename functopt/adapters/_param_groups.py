"""Reading the ``params`` argument of a training-stack facade into named parameter groups.

``torch.optim`` takes an iterable of tensors or a list of group dicts; LightRFT and
Megatron build their groups the same way. The facades of functopt also accept names,
``model.named_parameters()`` or a ``{name: param}`` dict, because their state is keyed by
parameter names. Everything is checked here, once, with the parameter's name in the message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

__all__: list[str] = []

_GROUP_FIX = (
    "Fix: pass model.named_parameters() (or model.parameters(), a {name: param} dict, or a "
    "list of group dicts such as [{'params': [...], 'weight_decay': 0.0}, ...])."
)


class ParamGroup(NamedTuple):
    """One group: its parameters, their names, and its options (every key but ``params``)."""

    names: list[str]
    params: list[torch.Tensor]
    options: dict[str, Any]


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


def _check_param(owner: str, name: str, p: Any) -> None:
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
    if not p.requires_grad:
        raise ValueError(
            f"{owner}: param {name!r} does not require grad, so it would never be updated. "
            f"Fix: leave frozen params out, e.g. "
            f"[(n, p) for n, p in model.named_parameters() if p.requires_grad]."
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
    (``torch.optim``'s key) to name a list of tensors.
    """
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
    specs: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        if not grouped:
            specs.append({"params": item})
            continue
        if "params" not in item:
            raise ValueError(
                f"{owner}: param group {i} has no 'params' key (keys: {sorted(map(str, item))})."
                f" {_GROUP_FIX}"
            )
        specs.append(dict(item))

    groups: list[ParamGroup] = []
    seen_names: dict[str, int] = {}
    seen_ids: dict[int, str] = {}
    count = 0
    for i, spec in enumerate(specs):
        items = spec.pop("params")
        if grouped and isinstance(items, torch.Tensor):  # as torch.optim, in a group dict
            items = [items]
        named = _named(owner, items, count)
        names_given = spec.pop("param_names", None)
        if names_given is not None:
            names_given = list(names_given)
            if len(names_given) != len(named):
                raise ValueError(
                    f"{owner}: param group {i} has {len(named)} params but "
                    f"{len(names_given)} param_names. Fix: give one name per param."
                )
            named = [(_check_name(owner, n), p) for n, (_, p) in zip(names_given, named,
                                                                     strict=True)]
        count += len(named)
        for name, p in named:
            _check_param(owner, name, p)
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
        groups.append(ParamGroup([n for n, _ in named], [p for _, p in named], spec))
    if count == 0:
        raise ValueError(f"{owner}: got an empty list of params. {_GROUP_FIX}")
    return groups
