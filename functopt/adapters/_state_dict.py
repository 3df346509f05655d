"""The one state codec of the adapters: optimizer state as dicts of tensors keyed by
parameter names and state paths, and back.

**The format** (``FORMAT`` 3; 2 is read too), shared by ``functopt.Optimizer`` and
``MixedPrecisionOptimizer``, is the layout of
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``::

    {"state": {param_name: {state_path: tensor, ...}, ...},
     "param_groups": [{"params": [param_name, ...], <the group's keys>,
                       "functopt": {"format": 3, <the configuration the state needs>}}]}

``state_path`` is the dotted path of a state leaf with the param's own entry left out
(``'inner_state.0.mu'``, ``'master'``); a leaf that belongs to no one param (a step count,
the loss scale) is in the entry of every param of its group, the same tensor, as
``torch.optim`` keeps ``step`` per param. ``named_state_dict()`` returns this;
``state_dict()`` is the view ``torch.optim`` code expects, the same dict with int ids in
place of the names in ``state`` and in each group's ``params``, and the names in each
group's ``param_names`` (``torch_to_named`` and ``named_to_torch`` go between them). DCP
only carries ``state`` and ``param_groups``: that is why the shared leaves and the
configuration live inside them.

The older nested layout below (``to_nested``/``from_nested``, the facade's format before
``FORMAT`` 2) is kept to read old checkpoints.

**The nested layout.**

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

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist

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


# -- the named format (FORMAT 2) --------------------------------------------------------

FORMAT = 3  # 3: a group's lr / weight_decay hold their lr_mult / wd_mult
CONFIG_KEY = "functopt"  # each saved group's record of the configuration its state needs


def check_entry(owner: str, where: str, expected: Mapping[str, Any], entry: Any, *,
                cast: bool, copy: bool) -> dict[str, torch.Tensor]:
    """One param's saved entry checked against ``expected`` (state path -> the tensor the
    optimizer holds there, or None for a leaf it holds none of): the same keys, tensors of
    the same shapes, placed on the held tensor's device. ``cast`` moves a tensor to the held
    dtype (torch.optim's rule for its state); without it another dtype raises.

    Raises:
        ValueError: naming the unexpected and missing keys, or a key of another shape.
        TypeError: naming a key that holds no tensor, or one of another dtype.
    """
    if not isinstance(entry, Mapping):
        raise TypeError(f"{owner}: the state of {where} is a {type(entry).__name__}, "
                        f"expected a dict of tensors.")
    unknown = sorted(map(str, set(entry) - set(expected)))
    missing = sorted(k for k, t in expected.items() if t is not None and k not in entry)
    if unknown or missing:
        raise ValueError(
            f"{owner}: the state of {where} has unexpected keys {unknown} and lacks "
            f"{missing}; this optimizer keeps {sorted(expected)}. Fix: load a state dict "
            f"saved by an optimizer built the same way (the same transform and groups)."
        )
    loaded: dict[str, torch.Tensor] = {}
    for name, value in entry.items():
        held = expected[name]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{owner}: the state of {where} has {name!r} = "
                            f"{type(value).__name__}; expected a tensor.")
        if held is not None:
            if value.shape != held.shape:
                raise ValueError(
                    f"{owner}: {name!r} of {where} has shape {tuple(value.shape)}, this "
                    f"optimizer's state has {tuple(held.shape)}. Fix: load the state dict "
                    f"into an optimizer over the same model."
                )
            if not cast and value.dtype != held.dtype:
                raise TypeError(
                    f"{owner}: {name!r} of {where} is {_core._dtype_name(value.dtype)}, but "
                    f"this optimizer keeps it in {_core._dtype_name(held.dtype)}. The state is "
                    f"not cast on load (a float16 loss scale, say, would overflow at 65504). "
                    f"Fix: load the state dict as state_dict() returned it, without casting."
                )
            value = value.to(dtype=held.dtype, device=held.device, copy=copy)
        loaded[name] = value
    return loaded


class Layout:
    """Where each leaf of a state tree goes in the named format: the param it belongs to
    (the first dict key on its path that names a param, at a dict keyed by param names only)
    or none (a shared leaf), and its state path (its dotted path without that key)."""

    def __init__(self, owner: str, tree: Any, names: list[str]) -> None:
        leaves, self.treespec, _ = _tensor_leaves(owner, tree)
        accessors = optree.treespec_accessors(self.treespec)
        known = set(names)
        self.names = list(names)
        node_keys: dict[Key, set[Any]] = {}
        parts = [_core.path_parts(a) for a in accessors]
        for accessor, path in zip(accessors, parts, strict=True):
            for i, step in enumerate(accessor):
                if isinstance(step, optree.MappingEntry):
                    node_keys.setdefault(path[:i], set()).add(step.entry)
        # the dicts keyed by param names only (decided once per dict, not once per leaf)
        by_names = {node for node, keys in node_keys.items() if keys <= known}
        self.owners: list[str | None] = []
        self.fields: list[str] = []
        for accessor, path in zip(accessors, parts, strict=True):
            owner_name: str | None = None
            field = path
            for i, step in enumerate(accessor):
                if isinstance(step, optree.MappingEntry) and isinstance(step.entry, str) \
                        and step.entry in known and path[:i] in by_names:
                    owner_name, field = step.entry, path[:i] + path[i + 1:]
                    break
            self.owners.append(owner_name)
            self.fields.append(_dotted(field) or "<root>")
        # (no tensors kept: a layout is cached, and would hold on to an old state)
        shared = {f for o, f, leaf in zip(self.owners, self.fields, leaves, strict=True)
                  if o is None and leaf is not None}
        seen: set[tuple[str, str]] = set()
        for o, f, leaf in zip(self.owners, self.fields, leaves, strict=True):
            if o is not None and leaf is not None:
                if f in shared or (o, f) in seen:
                    raise ValueError(
                        f"{owner}: two leaves of the state share the key {f!r} of param "
                        f"{o!r} in the state dict. Fix: keep per-param state under dicts "
                        f"keyed by the param names.")
                seen.add((o, f))
        self._shared = sorted(shared)
        self._none = [leaf is None for leaf in leaves]

    def entries(self, tree: Any) -> dict[str, dict[str, Any]]:
        """Each param's entry of ``tree`` (a state of this layout): the tensors themselves."""
        leaves = _core.flatten(tree)[0]
        out: dict[str, dict[str, Any]] = {name: {} for name in self.names}
        shared: dict[str, Any] = {}
        for o, f, leaf in zip(self.owners, self.fields, leaves, strict=True):
            if leaf is None:
                continue
            if o is None:
                shared[f] = leaf
            else:
                out[o][f] = leaf
        for entry in out.values():
            entry.update(shared)
        return out

    def tree(self, owner: str, template: Any, entries: Mapping[str, Any]) -> Any:
        """The state of this layout from each param's entry, checked by ``check_entry``
        against ``template`` (a state of this layout: the optimizer's own), copies on its
        devices; a shared leaf must be bitwise the same in every entry."""
        missing = [name for name in self.names if name not in entries]
        if missing:
            raise ValueError(
                f"{owner}: the state dict has no entry for the params "
                f"{_listing([(m,) for m in missing])}. Fix: load a state dict saved by an "
                f"optimizer over the same params.")
        expected = self.entries(template)
        loaded = {name: check_entry(owner, f"param {name!r}", expected[name],
                                    entries[name], cast=False, copy=True)
                  for name in self.names}
        first = self.names[0]
        for f in self._shared:
            for name in self.names[1:]:
                a, b = loaded[first].get(f), loaded[name].get(f)
                if a is not None and b is not None and not _same_value(a, b):
                    raise ValueError(
                        f"{owner}: {f!r} is one value for all params, but the entries of "
                        f"params {first!r} and {name!r} differ. Fix: load a state dict as "
                        f"state_dict() wrote it.")
        out = []
        for o, f, none in zip(self.owners, self.fields, self._none, strict=True):
            out.append(None if none else (loaded[first] if o is None else loaded[o])[f])
        return _core.unflatten(self.treespec, out)


def relocated(entries: Mapping[str, Mapping[str, Any]], old: str, new: Sequence[str],
              expected: Mapping[str, Collection[str]],
              added: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Entries of a layout whose subtree at the state path ``old`` has moved to the places
    ``new`` (one per param group, say), in the new layout: in each param's entry a key
    ``old.<rest>`` becomes ``<place>.<rest>`` for each place whose key the param's entry of
    the new layout has (``expected[name]``), so a leaf of one param moves to the place of
    that param's group and a leaf all params shared (a step count) to every place; the
    leaves the new layout has besides (``added``: state path -> tensor, shared by all) are
    added. A key with no place stays as it is. Nothing else is checked here: the result
    loads through ``Layout.tree``, which checks every key, shape and dtype against the
    optimizer's own state (a key left over is refused as unexpected).

    The facade's checkpoints of a plain recipe from before it ran such a recipe as
    ``inject_hyperparams`` of itself keep the recipe's state at ``'inner_state'``; this
    moves it under the injected state (``'inner_state.inner_state'``, or
    ``'inner_state.inner_states.<group>.inner_state'`` with several groups).

    Examples:
        >>> relocated({"w": {"inner_state.0.mu": 1, "key": 2}}, "inner_state",
        ...           ["inner_state.inner_state"],
        ...           {"w": {"inner_state.inner_state.0.mu", "key", "inner_state.count"}},
        ...           {"inner_state.count": 3})
        {'w': {'inner_state.inner_state.0.mu': 1, 'key': 2, 'inner_state.count': 3}}
    """
    out: dict[str, dict[str, Any]] = {}
    for name, entry in entries.items():
        moved: dict[str, Any] = {}
        keys = expected.get(name, ())
        for key, value in entry.items():
            if key.startswith(old + "."):
                places = [place + key[len(old):] for place in new
                          if place + key[len(old):] in keys]
                if places:
                    moved.update(dict.fromkeys(places, value))
                    continue
            moved[key] = value
        moved.update(added)
        out[name] = moved
    return out


def _same_value(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (a skipped step's norm)."""
    if a.is_floating_point() and b.is_floating_point():
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0),
                                                           b.masked_fill(nan, 0))
    return torch.equal(a, b)


def saved_order(owner: str, index: int, count: int, names: Any, saved: Any) -> list[int]:
    """For each param of a group, the position of its entry in the saved group: by name when
    both groups name their params (a model whose parameters were registered in another order
    loads each param's own state), by position otherwise. Names that do not match raise."""
    if names is None or saved is None:
        return list(range(count))
    names, saved = list(names), list(saved)
    if names == saved:
        return list(range(len(names)))
    missing, extra = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
    if missing or extra or len(set(saved)) != len(saved):
        raise ValueError(
            f"{owner}: param_groups[{index}] names its params {names}, the state dict's group "
            f"{saved}: this group's {missing} have no saved state and the saved {extra} no "
            f"param here. Fix: load the state dict into an optimizer over the same model "
            f"(the same parameter names in each group)."
        )
    position = {name: k for k, name in enumerate(saved)}
    return [position[name] for name in names]


def _group_names(group: Mapping[str, Any], saved: bool) -> frozenset[str] | None:
    """The names of a group's params (a saved group's ids where DCP gives names), or None."""
    names = group.get("param_names")
    if names is None and saved:
        ids = list(group.get("params", ()))
        if ids and all(isinstance(k, str) for k in ids):
            names = ids
    return None if names is None else frozenset(names)


def group_order(groups: list[dict[str, Any]], saved: Any) -> list[int]:
    """For each of ``groups``, the position of its saved group in ``saved``: the one naming
    the same params (Megatron reorders its groups between runs), where every group on both
    sides names its params and the name sets pair up one to one; else the same position
    (matched by position, and by name within each group)."""
    same = list(range(len(groups)))
    if not isinstance(saved, list) or len(saved) != len(groups) or not all(
            isinstance(g, Mapping) for g in saved):
        return same
    mine = [_group_names(g, saved=False) for g in groups]
    theirs = [_group_names(g, saved=True) for g in saved]
    if mine == theirs or None in mine or None in theirs or len(set(theirs)) != len(theirs):
        return same
    where = {names: k for k, names in enumerate(theirs)}
    if not all(names in where for names in mine):
        return same
    return [where[names] for names in mine]


def saved_groups(owner: str, state_dict: Mapping[str, Any],
                 groups: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[Any]]]:
    """Pair each of ``groups`` (an optimizer's param_groups) with its saved group (the one
    naming the same params, whatever the groups' order, where both sides name them; else
    the one at its position) and the saved entries of its params, in the group's order:
    from torch's view (int ids), from
    the named format, or from what ``set_optimizer_state_dict`` passes (names as ids). The
    saved group is a copy without ``params``, and without ``param_names`` where the group
    names its own params (a group without names takes the saved ones, as torch's load
    does).

    Raises:
        ValueError: the dict has no ``state``/``param_groups``, another number of groups or
            of params in a group, or params named otherwise.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"{owner}: expected a state dict (a dict with keys 'state' and 'param_groups', as "
            f"optimizer.state_dict() returns), got {type(state_dict).__name__}.")
    if not {"state", "param_groups"} <= set(state_dict):
        raise ValueError(
            f"{owner}: expected a dict with keys 'state' and 'param_groups' (from "
            f"optimizer.state_dict()), got keys {sorted(map(str, state_dict))}.")
    saved_list = state_dict["param_groups"]
    if len(saved_list) != len(groups):
        raise ValueError(
            f"{owner}: the state dict has {len(saved_list)} param groups, this optimizer "
            f"{len(groups)}. Fix: build the optimizer with the param groups of the one that "
            f"saved it (and add_param_group the same groups) before loading."
        )
    out = []
    state = state_dict["state"]
    saved_list = [saved_list[k] for k in group_order(groups, saved_list)]
    for i, (group, saved) in enumerate(zip(groups, saved_list, strict=True)):
        ids = list(saved["params"])
        if len(ids) != len(group["params"]):
            raise ValueError(
                f"{owner}: param_groups[{i}] has {len(group['params'])} params, the state "
                f"dict's has {len(ids)}. Fix: build the groups from the same model as the "
                f"one that saved it.")
        saved_names = saved.get("param_names")
        if saved_names is None and ids and all(isinstance(k, str) for k in ids):
            saved_names = ids  # DCP passes the names as the ids
        order = saved_order(owner, i, len(ids), group.get("param_names"), saved_names)
        entries = [state.get(ids[k]) or {} for k in order]
        rest = _folded({k: v for k, v in saved.items() if k not in ("params", "param_names")})
        if "param_names" in saved and "param_names" not in group:
            rest["param_names"] = saved["param_names"]  # an unnamed group takes the names
        out.append((rest, entries))
    return out


def _folded(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved group of format 2, whose ``lr`` / ``weight_decay`` (and schedulers' lrs) did
    not hold their ``lr_mult`` / ``wd_mult`` (its step multiplied them in), with the
    products in their place, as the groups of format 3 hold them; any other group as it is
    (torch's own groups hold what their steps use)."""
    config = saved.get(CONFIG_KEY)
    if not (isinstance(config, Mapping) and config.get("format") == 2):
        return saved
    from functopt.adapters._param_groups import LR_RECORDS, times

    lr_mult, wd_mult = saved.get("lr_mult", 1.0), saved.get("wd_mult", 1.0)
    out = dict(saved)
    for key in ("lr", *LR_RECORDS):
        if key in out and not isinstance(lr_mult, bool) and isinstance(lr_mult, (int, float)):
            out[key] = times(out[key], float(lr_mult))
    if "weight_decay" in out and not isinstance(wd_mult, bool) and isinstance(
            wd_mult, (int, float)):
        out["weight_decay"] = times(out["weight_decay"], float(wd_mult))
    return out


def packed_state(per_param: Mapping[Any, Any], extras: Mapping[Any, Any]) -> dict[Any, Any]:
    """A state dict's ``state``: the params' entries ``per_param`` in the order of their ids,
    then ``extras`` as they are: the keys of the optimizer's ``state`` that are no param,
    which torch.optim keeps (what code such as a state-dict hook stores there)."""
    out = dict(sorted(per_param.items(), key=lambda item: item[0]))
    out.update(extras)
    return out


def own_keys(state: Mapping[Any, Any]) -> dict[Any, Any]:
    """The keys of an optimizer's ``state`` that are no param, with their values."""
    return {k: v for k, v in state.items() if not isinstance(k, torch.Tensor)}


def unpacked_extras(state_dict: Mapping[str, Any]) -> dict[Any, Any]:
    """The keys of a state dict's ``state`` that no saved group lists as a param's, as they
    are: what ``packed_state`` kept of the optimizer's own keys, for ``load_state_dict``
    to put back (as torch.optim's does)."""
    ids = {k for group in state_dict["param_groups"] for k in group["params"]}
    return {k: v for k, v in state_dict["state"].items() if k not in ids}


def check_config(owner: str, index: int, saved: Any, current: Mapping[str, Any],
                 describe: Mapping[str, Callable[[Any], str]] | None = None) -> None:
    """Compare a saved group's configuration record (``CONFIG_KEY``) with this optimizer's:
    each key both have must hold the same value (``describe`` shows a value in the
    message). A record of a later format raises; a missing record (a checkpoint older than
    the record) or key is not checked."""
    if saved is None:
        return
    if not isinstance(saved, Mapping):
        raise TypeError(f"{owner}: param_groups[{index}][{CONFIG_KEY!r}] is a "
                        f"{type(saved).__name__}; expected the dict state_dict() writes.")
    version = saved.get("format")
    if isinstance(version, int) and version > FORMAT:
        raise ValueError(
            f"{owner}: the state dict is in functopt's state format {version}, this version "
            f"reads up to {FORMAT}. Fix: load it with the functopt version that saved it.")
    show = describe or {}
    for key, ours in current.items():
        if key == "format" or key not in saved or saved[key] == ours:
            continue
        if isinstance(ours, float) and isinstance(saved[key], float) and \
                math.isnan(ours) and math.isnan(saved[key]):
            continue
        fmt = show.get(key, repr)
        raise ValueError(
            f"{owner}: param_groups[{index}] was saved with {key} {fmt(saved[key])}, this "
            f"optimizer has {fmt(ours)}. The saved state only means something under its own "
            f"{key}. Fix: build the optimizer the way the saved one was built (the same "
            f"{key}) before loading."
        )


# -- the integrity record of a sharded state dict ---------------------------------------

INTEGRITY_KEY = "integrity"  # in the first group's CONFIG_KEY record: the checksums


def _flat(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The dict's tensors keyed by param name and state path (the same keys whatever the
    number of ranks, so a record of N ranks is checked on M)."""
    names: dict[Any, str] = {}
    for group in state_dict["param_groups"]:
        ids = group["params"]
        names.update(zip(ids, map(str, group.get("param_names", ids)), strict=True))
    flat: dict[str, torch.Tensor] = {}
    for pid, entry in state_dict["state"].items():
        name = names.get(pid, repr(pid))
        if isinstance(entry, Mapping):
            flat.update((f"{name}/{k}", v) for k, v in entry.items()
                        if isinstance(v, torch.Tensor))
        elif isinstance(entry, torch.Tensor):
            flat[name] = entry
    return flat


def seal(state_dict: dict[str, Any]) -> None:
    """Add the integrity record (``functopt/distributed/_integrity.py``) of a state dict
    whose state holds DTensor shards to its first group's ``CONFIG_KEY`` record: one
    ``all_reduce`` over the default group, so ``state_dict()`` of such an optimizer is a
    collective, as DCP's save around it is. A dict of plain tensors gets none (there is no
    other rank's file to tear it)."""
    from functopt.distributed import _integrity
    groups = state_dict["param_groups"]
    if not (groups and isinstance(groups[0].get(CONFIG_KEY), dict)
            and dist.is_available() and dist.is_initialized()):
        return  # (no process group: no shard of another rank)
    flat = _flat(state_dict)
    if _integrity._sharded(flat):
        groups[0][CONFIG_KEY][INTEGRITY_KEY] = _integrity.make_record(flat).tolist()


def check_seal(owner: str, state_dict: Mapping[str, Any]) -> None:
    """Raise, on every rank alike, when a sealed state dict's tensors do not match its
    record: a torn checkpoint (ranks' files of different saves) or one changed after the
    save. A dict without a record is not checked."""
    from functopt.distributed import _integrity

    groups = state_dict.get("param_groups")
    config = groups[0].get(CONFIG_KEY) if groups and isinstance(groups[0], Mapping) else None
    record = config.get(INTEGRITY_KEY) if isinstance(config, Mapping) else None
    if record is None:
        return
    flat = _flat(state_dict)
    given = (torch.tensor(record, dtype=torch.int64)
             if isinstance(record, list) and all(isinstance(v, int) for v in record)
             else record)
    _integrity.check_record(owner, flat, given, collective=_integrity._sharded(flat),
                            owned=frozenset(), error=None)


def recipe_signature(tx: Any, hyper: Mapping[str, torch.Tensor]) -> str | None:
    """What recipe a transform is, with its fixed non-numeric arguments
    (``"adamw(mu_dtype=None, nesterov=False)"``), or None if it is none: a plain recipe, or
    one ``inject_hyperparams`` builds from ``hyper`` (its injected values)."""
    from functopt._spec import Injected, describe
    from functopt.optimizers import recipe_of

    spec = describe(tx)
    try:
        record = recipe_of(spec.build(dict(hyper)) if isinstance(spec, Injected) else tx)
    except Exception:  # a factory of the user's that takes no such values: no recipe row
        return None
    if record is None:
        return None
    fixed = ", ".join(f"{k}={v!r}" for k, v in record.arguments.items()
                      if k not in hyper and (v is None or isinstance(v, (bool, int, str,
                                                                          torch.dtype))))
    return f"{record.name}({fixed})"
