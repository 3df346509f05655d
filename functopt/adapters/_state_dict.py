"""Optimizer state as nested dicts of tensors with readable keys, and back.

functopt states are pytrees of NamedTuples, tuples and dicts. A checkpoint needs plain
nested dicts of tensors: ``torch.load(weights_only=True)`` refuses unknown classes, and
``torch.distributed.checkpoint`` pickles a NamedTuple whole instead of resharding its
tensors. Keys are the tree's own path entries: NamedTuple field names, dict keys (parameter
names), and positions in tuples (``'0'``, ``'1'``, ...). ``None`` leaves and subtrees without
tensors are left out.

Loading goes the other way against a *template*, the state the optimizer already holds: its
structure decides which keys must be present, and its tensors the shape, dtype and device
each loaded tensor must have.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optree
import torch

from functopt.tree import _core

__all__: list[str] = []

Key = tuple[str, ...]


def _keys(treespec: _core.TreeSpec) -> list[Key]:
    """The path of every leaf as a tuple of strings (field names, dict keys, positions)."""
    return [_core.path_parts(a) for a in optree.treespec_accessors(treespec)]


def _dotted(key: Key) -> str:
    return ".".join(key)


def _tensor_leaves(owner: str, tree: Any) -> tuple[list[Any], _core.TreeSpec, list[Key]]:
    leaves, treespec = _core.flatten(tree)
    keys = _keys(treespec)
    seen: set[Key] = set()
    for key, leaf in zip(keys, leaves, strict=True):
        if leaf is None:
            continue
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{owner}: the state leaf {_dotted(key)!r} is a {type(leaf).__name__}; a state "
                f"dict holds tensors only. Fix: keep every state field of the transform a "
                f"tensor (a 0-d tensor for a counter or a hyperparameter)."
            )
        if not key or key in seen:
            raise ValueError(
                f"{owner}: two state leaves share the key {_dotted(key)!r} (dict keys that "
                f"differ only in type, such as 1 and '1'). Fix: use string keys."
            )
        seen.add(key)
    return leaves, treespec, keys


def to_nested(owner: str, tree: Any) -> dict[str, Any]:
    """``tree`` as nested dicts of its tensors (the tensors themselves, not copies)."""
    leaves, _, keys = _tensor_leaves(owner, tree)
    out: dict[str, Any] = {}
    for key, leaf in zip(keys, leaves, strict=True):
        if leaf is None:
            continue
        node = out
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = leaf
    return out


def _flatten_nested(nested: Mapping[Any, Any], prefix: Key, out: dict[Key, Any]) -> None:
    for k, v in nested.items():
        key = (*prefix, str(k))
        if isinstance(v, Mapping):
            _flatten_nested(v, key, out)
        else:
            out[key] = v


def _listing(keys: list[Key], limit: int = 8) -> str:
    shown = [_dotted(k) for k in sorted(keys)[:limit]]
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return f"{shown}{more}"


def from_nested(owner: str, template: Any, nested: Any) -> Any:
    """Rebuild a tree of ``template``'s structure from ``nested`` (as ``to_nested`` makes it).

    Every tensor of ``template`` must have a key in ``nested`` with a tensor of the same
    shape and dtype, and ``nested`` must hold nothing else. The result holds copies of the
    loaded tensors on the template's devices, so that nothing done later to ``nested`` (an
    in-place ``torch.distributed.checkpoint.load`` into it, say) reaches the loaded state.

    Raises:
        ValueError: naming the missing and unexpected keys, or the key of a shape mismatch.
        TypeError: naming the key of a non-tensor value or of a dtype mismatch.
    """
    if not isinstance(nested, Mapping):
        raise TypeError(
            f"{owner}: expected a state dict (nested dicts of tensors, as state_dict() returns),"
            f" got {type(nested).__name__}."
        )
    leaves, treespec, keys = _tensor_leaves(owner, template)
    expected = {key: leaf for key, leaf in zip(keys, leaves, strict=True) if leaf is not None}
    given: dict[Key, Any] = {}
    _flatten_nested(nested, (), given)
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {_listing(unexpected)}")
        raise ValueError(
            f"{owner}: the state dict does not match this optimizer: {'; '.join(parts)}. A "
            f"state dict loads into an optimizer over the same params (same names and dtypes), "
            f"with the same transform, param groups and loss-scale rule. Fix: build the "
            f"optimizer the way the saved one was built."
        )
    out: list[Any] = []
    for key, ref in zip(keys, leaves, strict=True):
        if ref is None:
            out.append(None)
            continue
        value = given[key]
        where = _dotted(key)
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{owner}: state dict entry {where!r} is a {type(value).__name__}, expected a "
                f"tensor like {_core._describe(ref)}."
            )
        if value.shape != ref.shape:
            raise ValueError(
                f"{owner}: state dict entry {where!r} has shape {tuple(value.shape)}, but this "
                f"optimizer's has shape {tuple(ref.shape)}. Fix: load a state dict saved for "
                f"params of the same shapes."
            )
        if value.dtype != ref.dtype:
            raise TypeError(
                f"{owner}: state dict entry {where!r} is {_core._dtype_name(value.dtype)}, but "
                f"this optimizer keeps it in {_core._dtype_name(ref.dtype)}. The state is not "
                f"cast on load (a float16 loss scale, say, would overflow at 65504). Fix: load "
                f"the state dict as state_dict() returned it, without casting it."
            )
        out.append(value.to(device=ref.device, copy=True))
    return _core.unflatten(treespec, out)


def torch_to_named(owner: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A torch-layout optimizer state dict (int ids in ``state`` and in each group's
    ``params``) keyed by parameter names instead: ``state`` maps each param's name to its
    entry and each group lists its params' names, the layout of
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``. Needs the groups'
    ``param_names`` (torch.optim stores them for ``model.named_parameters()``). Other
    top-level keys are kept."""
    groups, state = state_dict["param_groups"], state_dict["state"]
    named_state: dict[str, Any] = {}
    named_groups = []
    for i, group in enumerate(groups):
        names = group.get("param_names")
        if names is None:
            raise ValueError(
                f"{owner}: param_groups[{i}] has no param_names, so its state cannot be keyed by "
                f"name. Fix: build the optimizer from model.named_parameters() (or groups of "
                f"(name, param) pairs)."
            )
        for sid, name in zip(group["params"], names, strict=True):
            if name in named_state:
                raise ValueError(f"{owner}: the param name {name!r} is in two groups.")
            named_state[name] = state.get(sid, {})
        named_groups.append({**{k: v for k, v in group.items() if k != "param_names"},
                             "params": list(names)})
    extra = {k: v for k, v in state_dict.items() if k not in ("state", "param_groups")}
    return {**extra, "state": named_state, "param_groups": named_groups}


def named_to_torch(owner: str, named: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of ``torch_to_named``: int ids numbered in group order, each group's
    ``param_names`` its saved names (so a load matches entries to params by name)."""
    if not isinstance(named, Mapping) or not {"state", "param_groups"} <= set(named):
        raise ValueError(f"{owner}: expected a dict with 'state' (name -> entry) and "
                         f"'param_groups' (groups listing param names).")
    state: dict[int, Any] = {}
    groups = []
    sid = 0
    for group in named["param_groups"]:
        names = list(group["params"])
        for name in names:
            entry = named["state"].get(name)
            if entry:
                state[sid] = dict(entry)
            sid += 1
        groups.append({**group, "params": list(range(sid - len(names), sid)),
                       "param_names": names})
    unknown = sorted(set(named["state"]) - {n for g in groups for n in g["param_names"]})
    if unknown:
        raise ValueError(f"{owner}: the state names params {unknown} that no group lists.")
    extra = {k: v for k, v in named.items() if k not in ("state", "param_groups")}
    return {**extra, "state": state, "param_groups": groups}
