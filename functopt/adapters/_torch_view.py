"""``optimizer.state`` of a ``functopt.optim`` class, in torch.optim's layout.

A drop-in keeps its state as every ``functopt.Optimizer`` does (its *store*: per param, the
entry of the chain's state by state path, the counts shared by the params whose counts
agree), and that is what its steps read and write. ``StateView`` shows the store as the
torch.optim class shows its state, with the keys and the ``step`` its state dict has
(``_torch_state``): per param that has state in torch's layout, torch's keys in torch's
order, each the very tensor the step reads and writes (a complex param's as its
``torch.view_as_complex``, the same storage), read from the store at each access.

Two kinds of key are torch's representation of a value the chain keeps otherwise: ``step``
(the param's counts) and the 0-d values torch keeps in its scalar dtype (NAdam's
``mu_product``). Each param's is one tensor of torch's, kept by the view and refreshed
from the store whenever it is read through the view; written in place, it is taken back
into the store before the next step reads it (its version counter says so), or when it is
next read through the view.

A tensor read through the view (or written into it) and still held when a step replaces
the store's tensor by a new one (the pure path's new moments; the fused kernels step in
place) takes the new values, and the store holds it again, as torch's in-place step keeps
its state tensors (``kept_in_place``); not after a step that was not donated, whose new
tensors leave a state dict taken before it as it was.

Writes go into the store: a moment, after checks of its shape, dtype and device; a
``step`` or scalar, converted to the chain's dtype and device, into that param's own
copies of the group leaves (so the params that shared them keep theirs, and the next step
runs the param with its own count, as ``_torch_state.Counts`` runs split counts); a whole
entry (``state[p] = {...}``), checked to hold exactly torch's keys for the param; an empty
one, ``del state[p]`` or ``state[p].clear()``, the param's state from init. What cannot be
honoured raises, naming the param and the key: a key torch's class has no state for, a
deleted key (the step reads it), a single key written to a param without state yet (torch
makes a param's whole state at once), a write into a frozen group.
"""

from __future__ import annotations

import collections
import copy
import weakref
from collections import defaultdict
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch

from functopt.adapters import _param_groups, _torch_state
from functopt.adapters._torch_state import CONSTANT, STEP, TorchLayout

__all__: list[str] = []


class _Keys:
    """A group plan's torch keys: per key, the entry names whose value it shows."""

    def __init__(self, layout: TorchLayout, keys: Mapping[str, str], plan: Any) -> None:
        self.names: dict[str, list[str]] = {}
        for name, key in keys.items():
            if key != CONSTANT:
                self.names.setdefault(key, []).append(name)
        self.order = [k for k in (STEP, *layout.keys) if k in self.names
                      and (k != STEP or layout.step)]
        self.converted = frozenset({STEP, *layout.scalars})
        counts = self.names.get(STEP)
        self.count = counts[0] if counts else None
        self.group = [name for _, name in plan.group_slots]
        # per param (its position in the group), the keys its state has in torch's layout,
        # and how many leaves its entry then holds
        self.full = [[k for k in self.order if any(field.get(n) is not None
                                                   for n in self.names[k])]
                     for field in plan.fields]
        self.sizes = [sum(v is not None for v in field.values()) for field in plan.fields]

    def present(self, entry: Mapping[str, Any], j: int) -> list[str]:
        """The keys the entry of the group's j-th param holds (its full set, as a step
        leaves it, at the cost of a length)."""
        if len(entry) == self.sizes[j]:
            return self.full[j]
        return [k for k in self.order if any(entry.get(n) is not None for n in self.names[k])]

    def name(self, entry: Mapping[str, Any], key: str) -> str:
        """The entry name that holds ``key``'s value (the first the entry has)."""
        names = self.names[key]
        return next((n for n in names if entry.get(n) is not None), names[0])


class Entry(MutableMapping[str, Any]):
    """``optimizer.state[param]``: the param's state in torch's keys (see the module)."""

    __slots__ = ("_param", "_view")

    def __init__(self, view: StateView, param: torch.Tensor) -> None:
        self._view = view
        self._param = param

    def __getitem__(self, key: str) -> Any:
        return self._view._get(self._param, key)

    def __setitem__(self, key: str, value: Any) -> None:
        self._view._set(self._param, key, value)

    def __delitem__(self, key: str) -> None:
        self._view._delete(self._param, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._view._keys_of(self._param))

    def __len__(self) -> int:
        return len(self._view._keys_of(self._param))

    def __contains__(self, key: object) -> bool:
        return key in self._view._keys_of(self._param)

    def clear(self) -> None:
        """The param's state from init (torch's ``state[p].clear()``: no state)."""
        self._view._reset(self._param)

    def __repr__(self) -> str:
        return repr(dict(self.items()))

    # copies are plain dicts of the tensors, as torch.optim's entries are; a pickle is an
    # OrderedDict of them (a dict that torch.load's weights_only unpickler takes)
    def __copy__(self) -> dict[str, Any]:
        return dict(self.items())

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        return copy.deepcopy(dict(self.items()), memo)

    def __reduce__(self) -> tuple[Any, ...]:
        return (collections.OrderedDict, (list(self.items()),))


class StateView(MutableMapping[Any, Any]):
    """``optimizer.state`` of a ``functopt.optim`` class (see the module): keys are the
    params that have state in torch's layout, then the store's keys that are no param (a
    state-dict hook's), which it holds as they are."""

    def __init__(self, opt: Any, layout: TorchLayout) -> None:
        self._opt = opt
        self._layout = layout
        self._owner = f"functopt.optim.{type(opt).__name__}"
        self._where: dict[int, tuple[int, int]] = {}
        self._entries: dict[int, Entry] = {}
        # (id of the param, key) -> [param, the tensor shown (kept: a temporary written in
        # place is taken in at the next step), its version when last synced, the store's
        # tensor it was synced from and that tensor's version then]
        self._shown: dict[tuple[int, str], list[Any]] = {}
        self._count_values: dict[int, tuple[torch.Tensor, int, int]] = {}
        # (id of the param, entry name) -> [param, a weak reference to the tensor read]
        self._handed: dict[tuple[int, str], list[Any]] = {}

    # -- where a param's state is ---------------------------------------------------------

    def _store(self) -> defaultdict[Any, Any]:
        store: defaultdict[Any, Any] = self._opt._made_store()
        return store

    def _locate(self, key: Any) -> tuple[int, int] | None:
        """(group index, position in the group) of the param ``key``, None if it is none."""
        if not isinstance(key, torch.Tensor):
            return None
        groups = self._opt.param_groups
        where = self._where.get(id(key))
        if where is None or not _at(groups, where, key):
            self._where = {id(p): (i, j) for i, g in enumerate(groups)
                           for j, p in enumerate(g["params"])}
            where = self._where.get(id(key))
            if where is None or not _at(groups, where, key):
                return None
        return where

    def _keys(self, index: int) -> tuple[Any, _Keys] | None:
        """The group's plan and its torch keys; None for a group without state (frozen)."""
        opt = self._opt
        plans = opt._plans
        plan = plans[index] if index < len(plans) else None
        if plan is None or not plan.laid_out:
            # (a copy's plans are made again at its next step; a frozen group has none)
            group = opt.param_groups[index]
            if _param_groups.group_flags(self._owner, f"param_groups[{index}]",
                                         group).frozen:
                return None
            plan = opt._plan(index, group)
        keys: _Keys | None = plan.__dict__.get("torch_view")
        if keys is None:
            names = _torch_state.plan_keys(self._owner, type(self._opt).__name__, self._layout,
                                           plan)
            keys = plan.torch_view = _Keys(self._layout, names, plan)
        return plan, keys

    def _describe(self, where: tuple[int, int]) -> str:
        i, j = where
        described: str = self._opt._describe(self._opt.param_groups[i], j)
        return described

    def _count(self, entry: Mapping[str, Any], keys: _Keys) -> int:
        """The param's step count (1 for a chain without one: its state is from steps)."""
        if keys.count is None:
            return 1
        held = entry.get(keys.count)
        if held is None or held.is_meta:  # (a count on the meta device: no step yet)
            return 0
        known = self._count_values.get(id(held))
        if known is not None and known[0] is held and known[1] == held._version:
            return known[2]
        value = int(held)
        if len(self._count_values) > 256:
            self._count_values.clear()
        self._count_values[id(held)] = (held, held._version, value)
        return value

    def _state_of(self, param: torch.Tensor) -> tuple[Any, ...] | None:
        """(store, entry, where, plan, keys, the keys it has) of a param that has state in
        torch's layout, else None."""
        store = self._store()
        where = self._locate(param)
        if where is None:
            return None
        found = self._keys(where[0])
        entry = store.get(param)
        if found is None or not entry:
            return None
        plan, keys = found
        if not self._layout.eager and self._count(entry, keys) <= 0:
            return None  # never stepped: torch keeps no state for it
        present = keys.present(entry, where[1])
        return (store, entry, where, plan, keys, present) if present else None

    def _keys_of(self, param: torch.Tensor) -> list[str]:
        found = self._state_of(param)
        return [] if found is None else list(found[5])

    # -- reads ----------------------------------------------------------------------------

    def _get(self, param: torch.Tensor, key: str) -> Any:
        found = self._state_of(param)
        if found is None or key not in found[5]:
            raise KeyError(key)
        _, entry, where, _, keys, _ = found
        if key in keys.converted:
            return self._shown_value(param, where, key, entry, keys)
        name = keys.name(entry, key)
        value = entry[name]
        if param.is_complex() and value.shape == (*param.shape, 2):
            value = torch.view_as_complex(value)  # (torch keeps a complex param's state so)
        self._handed[(id(param), name)] = [param, weakref.ref(value)]
        return value

    def kept_in_place(self, donated: bool) -> None:
        """After a step: each tensor read through the view that is still alive and that the
        step replaced by a new one (the pure path's new moments) takes the new values, and
        the store holds it again, as torch's in-place step keeps its state tensors. Not
        after a step that was not donated (a state dict taken since holds those tensors and
        keeps their values), nor for a tensor in an autograd graph."""
        if not self._handed:
            return
        store = self._opt.__dict__["_store"]
        for key, (param, ref) in list(self._handed.items()):
            held = ref()
            entry = store.get(param)
            current = None if held is None or not entry else entry.get(key[1])
            if current is None:
                del self._handed[key]
                continue
            base = torch.view_as_real(held) if held.is_complex() and not (
                current.is_complex()) else held
            if base is current or (base.data_ptr() == current.data_ptr()
                                   and base.shape == current.shape):
                del self._handed[key]  # (stepped in place: it stays the step's tensor)
                continue
            if not donated or current.requires_grad or base.requires_grad or (
                    base.shape, base.dtype, base.device) != (current.shape, current.dtype,
                                                            current.device):
                del self._handed[key]
                continue
            with torch.no_grad():
                base.copy_(current)
            entry[key[1]] = base

    @staticmethod
    def _held(key: str, entry: Mapping[str, Any], keys: _Keys) -> tuple[torch.Tensor, int]:
        """The tensor of the store ``key``'s value comes from, and its version (the tensor
        kept, so that no other can take its id)."""
        name = keys.count if key == STEP and keys.count is not None else keys.name(entry, key)
        held: torch.Tensor = entry[name]
        return held, held._version

    def _source(self, param: torch.Tensor, where: tuple[int, int], key: str,
                entry: Mapping[str, Any], keys: _Keys) -> torch.Tensor:
        """A new tensor of ``key``'s value in torch's representation."""
        dtype, device = _torch_state._scalar_place(key, self._opt.param_groups[where[0]], param)
        if key == STEP:
            return torch.tensor(float(self._count(entry, keys)), dtype=dtype, device=device)
        value: torch.Tensor = entry[keys.name(entry, key)]
        return value.detach().to(dtype=dtype, device=device, copy=True)

    def _shown_value(self, param: torch.Tensor, where: tuple[int, int], key: str,
                     entry: dict[str, Any], keys: _Keys) -> torch.Tensor:
        slot = self._shown.get((id(param), key))
        if slot is not None and slot[0] is param:
            shown: torch.Tensor = slot[1]
            if shown._version != slot[2]:  # written in place: the param's value now
                self._take(param, where, key, shown, entry, keys)
                slot[2], slot[3] = shown._version, self._held(key, entry, keys)
                return shown
            held = self._held(key, entry, keys)
            if held[0] is slot[3][0] and held[1] == slot[3][1]:  # (unchanged since shown)
                return shown
            source = self._source(param, where, key, entry, keys)
            if (shown.dtype, shown.device, shown.shape) == (source.dtype, source.device,
                                                            source.shape):
                with torch.no_grad():
                    shown.copy_(source)
                slot[2], slot[3] = shown._version, held
                return shown
        else:
            source = self._source(param, where, key, entry, keys)
        self._shown[(id(param), key)] = [param, source, source._version,
                                         self._held(key, entry, keys)]
        return source

    def flush(self) -> None:
        """Take every shown ``step`` (or scalar) written in place since it was shown into the
        store: before a step reads the store, or a state dict is made from it."""
        if not self._shown:
            return
        for (_, key), slot in self._shown.items():
            param, shown, version, _ = slot
            if shown._version == version:
                continue
            found = self._state_of(param)
            if found is not None:
                _, entry, where, _, keys, _ = found
                self._take(param, where, key, shown, entry, keys)
                slot[3] = self._held(key, entry, keys)
            slot[2] = shown._version

    def forget(self) -> None:
        """Drop the shown tensors (the store was replaced: a loaded state dict)."""
        self._shown.clear()
        self._count_values.clear()
        self._handed.clear()

    # -- writes ---------------------------------------------------------------------------

    def _take(self, param: torch.Tensor, where: tuple[int, int], key: str, value: Any,
              entry: dict[str, Any], keys: _Keys) -> None:
        """Write a ``step`` or scalar into ``entry`` (the param's), into its own copies of
        the group leaves, and let the next step run the param with its own counts."""
        described = self._describe(where)
        for name in keys.group:  # (the params that shared them keep theirs)
            held = entry.get(name)
            if isinstance(held, torch.Tensor):
                entry[name] = held.clone()
        for name in keys.names[key]:
            held = entry.get(name)
            if held is not None:
                entry[name] = self._converted(described, key, value, held)
        self._opt._counts.split.add(where[0])
        self._opt._unstepped.pop(where[0], None)

    def _converted(self, described: str, key: str, value: Any,
                   held: torch.Tensor) -> torch.Tensor:
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            number = value.detach().reshape(())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            number = torch.tensor(value)
        else:
            raise TypeError(
                f"{self._owner}: optimizer.state[p][{key!r}] of {described} must be a number "
                f"or a one-element tensor, got {_shown_type(value)}.")
        if key == STEP:
            count = float(number)
            if not (count >= 0 and count == int(count)):
                raise ValueError(
                    f"{self._owner}: optimizer.state[p]['step'] of {described} is {count}; a "
                    f"step count is a whole number >= 0. Fix: write the number of steps the "
                    f"param has taken.")
            return torch.tensor(int(count), dtype=held.dtype, device=held.device)
        return number.to(dtype=held.dtype, device=held.device, copy=True)

    def _field(self, param: torch.Tensor, where: tuple[int, int], plan: Any, keys: _Keys,
               key: str, value: Any, entry: Mapping[str, Any]) -> tuple[str, torch.Tensor]:
        """The entry name and the tensor a write of a moment puts there, checked."""
        described = self._describe(where)
        template = plan.fields[where[1]]
        name = next(n for n in keys.names[key] if template.get(n) is not None)
        held = entry.get(name)
        held = template[name] if held is None else held
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{self._owner}: optimizer.state[p][{key!r}] of {described} must be a tensor "
                f"of the param's shape, got {_shown_type(value)}.")
        if value.layout is torch.sparse_coo:  # (torch's SGD buffer of sparse gradients)
            value = value.to_dense()
        if param.is_complex() and value.is_complex():
            value = torch.view_as_real(value)  # (the chain steps a complex param's real pairs)
        if value.shape != held.shape:
            raise ValueError(
                f"{self._owner}: optimizer.state[p][{key!r}] of {described} has shape "
                f"{tuple(value.shape)}; the optimizer's state has {tuple(held.shape)}. Fix: "
                f"write a tensor of the param's shape (torch.zeros_like(p)).")
        if value.dtype != held.dtype:
            raise TypeError(
                f"{self._owner}: optimizer.state[p][{key!r}] of {described} is {value.dtype}; "
                f"the optimizer keeps it in {held.dtype}. Fix: write value.to({held.dtype}).")
        if value.device not in (held.device, param.device):
            raise ValueError(
                f"{self._owner}: optimizer.state[p][{key!r}] of {described} is on "
                f"{value.device}, the param on {param.device}. Fix: write "
                f"value.to(p.device).")
        return name, value

    def _set(self, param: torch.Tensor, key: str, value: Any) -> None:
        found = self._state_of(param)
        if found is None:
            where = self._writable(param)
            raise ValueError(
                f"{self._owner}: optimizer.state[p][{key!r}] of {self._describe(where)}: the "
                f"param has no state yet (it has not stepped), and torch.optim makes a "
                f"param's state whole. Fix: write the whole entry (optimizer.state[p] = "
                f"{{...}}, with every key the param's state has), or step first.")
        _, entry, where, plan, keys, present = found
        if key not in present:
            raise ValueError(
                f"{self._owner}: optimizer.state[p] of {self._describe(where)} has no "
                f"{key!r}; its state has {present} (torch.optim's keys for these options). "
                f"Fix: write one of them.")
        if key in keys.converted:
            self._take(param, where, key, value, entry, keys)
            self._shown.pop((id(param), key), None)
            return
        name, tensor = self._field(param, where, plan, keys, key, value, entry)
        entry[name] = tensor
        self._handed[(id(param), name)] = [param, weakref.ref(value)]  # (the state now)
        self._opt._unstepped.pop(where[0], None)

    def _delete(self, param: torch.Tensor, key: str) -> None:
        found = self._state_of(param)
        if found is None or key not in found[5]:
            raise KeyError(key)
        raise ValueError(
            f"{self._owner}: del optimizer.state[p][{key!r}] of {self._describe(found[2])}: "
            f"the step reads it, so it cannot be left out. Fix: write a new value "
            f"(optimizer.state[p][{key!r}] = ...), or clear the param's whole state "
            f"(optimizer.state[p].clear(), or del optimizer.state[p]) to restart it from "
            f"init.")

    def _writable(self, param: torch.Tensor) -> tuple[int, int]:
        """Where a param whose state may be written is; raise for one in a frozen group."""
        self._store()
        where = self._locate(param)
        assert where is not None  # (entries are handed out for params only)
        if self._keys(where[0]) is None:
            raise ValueError(
                f"{self._owner}: optimizer.state[p] of {self._describe(where)}: the param's "
                f"group is frozen and keeps no state. Fix: unfreeze the group "
                f"(param_groups[{where[0]}]['frozen'] = False) and step it first.")
        return where

    def _fresh(self, index: int) -> list[dict[str, Any]]:
        """Every param's entry of a new init of the group's state."""
        opt = self._opt
        group = opt.param_groups[index]
        found = self._keys(index)
        assert found is not None  # (the caller's check)
        plan = found[0]
        hyper = opt._hyperparams(index, group, plan)
        leaves = plan.fresh(plan.transform, opt._tree(group, opt._real(group["params"])),
                            opt._init_hyper(hyper))
        return [{name: leaves[k] for k, name in slots if leaves[k] is not None}
                for slots in plan.entry_slots]

    def _fill(self, index: int, store: defaultdict[Any, Any]) -> list[dict[str, Any]] | None:
        """Fresh entries for the group's params that have none (a cleared store written
        param by param); the fresh entries, None if every param had one."""
        params = self._opt.param_groups[index]["params"]
        if all(store.get(p) for p in params):
            return None
        fresh = self._fresh(index)
        for p, entry in zip(params, fresh, strict=True):
            if not store.get(p):
                store[p] = entry
        return fresh

    def _reset(self, param: torch.Tensor) -> None:
        """The param's state from init: torch's ``state[p] = {}``."""
        where = self._writable(param)
        store = self._store()
        fresh = self._fill(where[0], store) or self._fresh(where[0])
        store[param] = fresh[where[1]]
        self._forget_param(param)
        self._opt._counts.split.add(where[0])

    def _forget_param(self, param: torch.Tensor) -> None:
        """Drop what the view kept of a param whose state was replaced."""
        for key in [k for k in self._shown if k[0] == id(param)]:
            del self._shown[key]
        for key in [k for k in self._handed if k[0] == id(param)]:
            del self._handed[key]

    def _set_entry(self, param: torch.Tensor, value: Any) -> None:
        where = self._writable(param)
        if not isinstance(value, Mapping):
            raise TypeError(
                f"{self._owner}: optimizer.state[p] of {self._describe(where)} must be a dict "
                f"of the param's state in torch's keys, got {_shown_type(value)}.")
        if not value:
            self._reset(param)
            return
        found = self._keys(where[0])
        assert found is not None  # (_writable's check)
        plan, keys = found
        expected = keys.full[where[1]]
        unknown = sorted(map(str, set(value) - set(expected)))
        missing = [k for k in expected if k not in value]
        if unknown or missing:
            raise ValueError(
                f"{self._owner}: optimizer.state[p] of {self._describe(where)} was given "
                f"unexpected keys {unknown} and lacks {missing}; torch.optim's state for this "
                f"param has {expected}. Fix: write an entry with exactly these keys, or an "
                f"empty one to restart the param from init.")
        store = self._store()
        fresh = self._fill(where[0], store)
        entry = dict(store[param]) if fresh is None else fresh[where[1]]
        given: dict[str, Any] = {}
        for key in expected:  # (each checked before the store is written)
            if key in keys.converted:
                self._take(param, where, key, value[key], entry, keys)
            else:
                name, tensor = self._field(param, where, plan, keys, key, value[key], entry)
                entry[name] = tensor
                given[name] = value[key]
        store[param] = entry
        self._forget_param(param)
        for name, obj in given.items():  # (the state now: kept as the steps go)
            self._handed[(id(param), name)] = [param, weakref.ref(obj)]
        self._opt._unstepped.pop(where[0], None)

    # -- the mapping ----------------------------------------------------------------------

    def __getitem__(self, key: Any) -> Any:
        store = self._store()
        if self._locate(key) is None:
            return store[key]
        entry = self._entries.get(id(key))
        if entry is None or entry._param is not key:
            entry = self._entries[id(key)] = Entry(self, key)
        return entry

    def __setitem__(self, key: Any, value: Any) -> None:
        store = self._store()
        if self._locate(key) is None:
            store[key] = value
        else:
            self._set_entry(key, value)

    def __delitem__(self, key: Any) -> None:
        store = self._store()
        if self._locate(key) is None:
            del store[key]
        elif self._state_of(key) is None:
            raise KeyError(key)
        else:
            self._reset(key)

    def __contains__(self, key: object) -> bool:
        store = self._store()
        if self._locate(key) is None:
            return key in store
        assert isinstance(key, torch.Tensor)
        return self._state_of(key) is not None

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __iter__(self) -> Iterator[Any]:
        store = self._store()
        params: set[int] = set()
        for group in self._opt.param_groups:
            for p in group["params"]:
                params.add(id(p))
                if self._state_of(p) is not None:
                    yield p
        for key in list(store):
            if id(key) not in params:
                yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def clear(self) -> None:
        """Every group's state from init at its next step (torch's ``state.clear()``)."""
        self._store().clear()
        self.forget()

    def replace(self, value: Any) -> None:
        """``optimizer.state = value``: the state cleared, then each item written."""
        if not isinstance(value, Mapping):
            raise TypeError(f"{self._owner}: optimizer.state must be a dict keyed by params, "
                            f"got {_shown_type(value)}.")
        items = list(value.items())
        self.clear()
        for key, entry in items:
            self[key] = entry

    def __repr__(self) -> str:
        return repr(dict(self.items()))

    def __copy__(self) -> defaultdict[Any, Any]:
        return defaultdict(dict, {k: copy.copy(v) for k, v in self.items()})

    def __deepcopy__(self, memo: dict[int, Any]) -> defaultdict[Any, Any]:
        return copy.deepcopy(self.__copy__(), memo)

    def __reduce__(self) -> str | tuple[Any, ...]:
        return self.__copy__().__reduce__()


def _at(groups: list[dict[str, Any]], where: tuple[int, int], key: torch.Tensor) -> bool:
    i, j = where
    return i < len(groups) and j < len(groups[i]["params"]) and groups[i]["params"][j] is key


def _shown_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:120]
