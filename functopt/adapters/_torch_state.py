"""The drop-ins' state model: each param keeps its own step count, and a ``functopt.optim``
class's state dict is the torch.optim class's.

**Per-param counts.** torch.optim keeps ``state[p]["step"]`` per param and skips a param
whose ``.grad`` is None. A functopt transform keeps its counts (and any other leaf that
belongs to no one param, such as NAdam's momentum product) once per state, for all the
params it runs over. The entries the steps read (``functopt.Optimizer``'s store, which a
``functopt.optim`` class shows in torch's layout through ``_torch_view``) hold these
*group leaves* in every param's entry;
params whose counts are equal share the very tensors, so that a step over them is one run
of the transform, as if the counts were one. A step

- where every param of the group has a gradient and all share their group leaves (the
  usual case) runs as it always did: nothing here is consulted;
- otherwise groups the params that have a gradient by the group leaves they hold (one
  *class* per count), and runs the transform once per class, over the state of the
  group with that class's group leaves and the gradients of the class's params only (a
  param without a gradient is left as it is by the transform), writing the class's new
  group leaves into its own params' entries only.

A param without a gradient keeps its group leaves: its count does not advance, as in
torch.optim. After such a step, classes whose group leaves hold equal values share them
again (``merge``), so that the group comes back to one run as soon as its counts agree.

**torch's layout.** A ``TorchLayout`` declares, for one torch.optim class, which leaf of
its functopt chain's state each of torch's per-param keys is (``"exp_avg"`` is
``ScaleByAdamState.mu``): data, read by ``to_torch`` and ``from_torch``. Every count of
the chain's state is torch's ``step`` (they all count the steps the param took);
``step`` and the other 0-d values torch keeps (``mu_product``) are stored as torch stores
them (``torch.optim.optimizer._get_scalar_dtype``, on the param's device with
``capturable`` or ``fused``, else on the CPU). A param that never stepped has no entry,
as in torch, unless the class makes every param's state at construction
(``eager``: Adagrad).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import optree
import torch

from functopt.adapters import _state_dict
from functopt.tree import _core

__all__: list[str] = []

Slots = Sequence[tuple[int, str]]  # (leaf index in the state, entry name) of each group leaf


# -- per-param counts ---------------------------------------------------------------------

def _key(entry: Mapping[str, Any], slots: Slots) -> tuple[int, ...]:
    return tuple(id(entry[name]) for _, name in slots)


class Counts:
    """Which groups (by index) hold params whose group leaves differ."""

    def __init__(self) -> None:
        self.split: set[int] = set()

    def classes(self, index: int, slots: Slots, entries: list[Any] | None,
                leaves: list[Any], grads: list[Any],
                missing: list[int]) -> list[list[int]] | None:
        """The params (positions in the group) of each run of this step, or None when the
        step is one run over all params as they are (every param has a gradient and the
        group's params share their group leaves).

        A param without a gradient that shares its group leaves with a param that steps gets
        copies of them first (a step may update its counts in place); with ``entries`` None
        (the state starts from init: ``leaves`` is it) such params get copies of ``leaves``'
        group leaves, written into their entries by ``restore``. ``missing``: the positions
        of the params without a gradient."""
        if not slots or (not missing and index not in self.split):
            return None
        stepping = [j for j, g in enumerate(grads) if g is not None]
        if entries is None:
            self._fresh = {name: leaves[i].clone() for i, name in slots
                           if isinstance(leaves[i], torch.Tensor)}
            return [stepping]
        self._fresh = {}
        runs: dict[tuple[int, ...], list[int]] = {}
        for j in stepping:
            runs.setdefault(_key(entries[j], slots), []).append(j)
        if not missing and len(runs) == 1:
            self.split.discard(index)
            return None
        copies: dict[tuple[int, ...], dict[str, Any]] = {}
        for j in missing:
            key = _key(entries[j], slots)
            if key in runs:
                if key not in copies:
                    copies[key] = {name: _copy(entries[j][name]) for _, name in slots}
                entries[j].update(copies[key])
        return list(runs.values())

    def kept(self, store: Mapping[Any, Any], params: list[Any], slots: Slots,
             members: list[int]) -> dict[int, dict[str, Any]]:
        """The group leaves of the params outside ``members``, to ``restore`` after the run
        (which writes the run's group leaves into every param's entry)."""
        inside = set(members)
        fresh = self._fresh
        if fresh:
            return {j: fresh for j in range(len(params)) if j not in inside}
        return {j: {name: store[p][name] for _, name in slots}
                for j, p in enumerate(params) if j not in inside}

    @staticmethod
    def leaves(leaves: list[Any], slots: Slots, entry: Mapping[str, Any]) -> list[Any]:
        """A run's state: ``leaves`` with the group leaves of ``entry`` (a member's)."""
        out = list(leaves)
        for i, name in slots:
            out[i] = entry[name]
        return out

    @staticmethod
    def restore(store: MutableMapping[Any, Any], params: list[Any],
                kept: Mapping[int, Mapping[str, Any]]) -> None:
        for j, values in kept.items():
            store[params[j]].update(values)

    def merge(self, index: int, store: Mapping[Any, Any], params: list[Any],
              slots: Slots) -> None:
        """Let params whose group leaves hold equal values share them; mark the group
        split when they still differ."""
        self.split.discard(index)
        got = [store.get(p) for p in params]
        if not slots or not all(got):
            return
        entries: list[Any] = got
        first: dict[tuple[int, ...], Mapping[str, Any]] = {}
        for entry in entries:
            first.setdefault(_key(entry, slots), entry)
        if len(first) == 1:
            return
        reps: list[Mapping[str, Any]] = []
        by_key: dict[tuple[int, ...], Mapping[str, Any]] = {}
        for key, entry in first.items():
            rep = next((r for r in reps if _equal(r, entry, slots)), None)
            if rep is None:
                reps.append(entry)
                rep = entry
            by_key[key] = rep
        for entry in entries:
            rep = by_key[_key(entry, slots)]
            if rep is not entry:
                entry.update({name: rep[name] for _, name in slots})
        if len(reps) > 1:
            self.split.add(index)


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _equal(a: Mapping[str, Any], b: Mapping[str, Any], slots: Slots) -> bool:
    for _, name in slots:
        x, y = a[name], b[name]
        if x is y:
            continue
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or \
                x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y.to(x.device)):
            return False
    return True


# -- torch's layout -----------------------------------------------------------------------

STEP = "step"
CONSTANT = ""  # (the key of a constant slot: torch stores nothing under it)
_COUNT = "count"


@dataclasses.dataclass(frozen=True)
class TorchLayout:
    """How the state of a torch.optim class maps onto its functopt chain's state.

    Attributes:
        keys: torch's per-param keys, in torch's order, each with the state slots
            (``"<State class>.<field>"``) it may be: the one the chain has (Adam's
            ``exp_avg`` is ``ScaleByAdamState.mu``, or ``ScaleByAmsgradState.mu`` with
            ``amsgrad``). A key whose slots the chain has none of is not kept
            (``max_exp_avg_sq`` without ``amsgrad``).
        step: torch keeps ``step`` (every count of the chain's state).
        eager: torch makes every param's state at construction (an entry for every param,
            stepped or not).
        scalars: keys of 0-d values torch keeps in its scalar dtype, as it keeps ``step``.
        constants: slots of the chain's state that torch keeps nothing for because they
            never change (Muon's Newton-Schulz coefficients): not saved, and taken from
            init on load.
    """

    keys: Mapping[str, tuple[str, ...]]
    step: bool = True
    eager: bool = False
    scalars: frozenset[str] = frozenset()
    constants: frozenset[str] = frozenset()


def slot_names(treespec: _core.TreeSpec, pspec: _core.TreeSpec) -> dict[str, str]:
    """Per entry name of ``optimizer.state`` (a state path without the param), its slot:
    the state class and field the leaf sits in (``"ScaleByAdamState.mu"``)."""
    out: dict[str, str] = {}

    def walk(spec: _core.TreeSpec, prefix: str, slot: str) -> None:
        if spec == pspec or spec.is_leaf():
            out[prefix or "<root>"] = slot
            return
        one_level = optree.treespec_one_level(spec)
        assert one_level is not None  # (spec is no leaf)
        kind = spec.type
        name = kind.__name__ if kind is not None and hasattr(kind, "_fields") else None
        for child, entry in zip(spec.children(), _core.paths(one_level), strict=True):
            walk(child, f"{prefix}.{entry}" if prefix else entry,
                 f"{name}.{entry}" if name else slot)

    walk(treespec, "", "")
    return out


UNMAPPED = (
    "{owner}: the state of its chain holds {slot!r} (at {name!r}), which torch.optim.{cls}'s "
    "state has no key for, so torch's state dict cannot hold it. This is a gap in "
    "functopt.optim.{cls}'s table of torch's keys (_torch_state); please report it."
)


def entry_keys(owner: str, cls: str, layout: TorchLayout,
               slots: Mapping[str, str]) -> dict[str, str]:
    """Per functopt entry name, the torch key it is stored under (``step`` for a count)."""
    by_slot = {slot: key for key, options in layout.keys.items() for slot in options}
    out: dict[str, str] = {}
    for name, slot in slots.items():
        if slot in by_slot:
            out[name] = by_slot[slot]
        elif slot.rsplit(".", 1)[-1] == _COUNT:
            out[name] = STEP
        elif slot in layout.constants:
            out[name] = CONSTANT
        elif not name.startswith("hyperparams."):
            raise ValueError(UNMAPPED.format(owner=owner, slot=slot, name=name, cls=cls))
    return out


def _scalar_place(key: str, group: Mapping[str, Any], param: torch.Tensor
                  ) -> tuple[torch.dtype, torch.device]:
    """Where torch keeps a 0-d value (``torch/optim``'s rule for ``step`` and
    ``mu_product``): float32 with ``fused`` (``step`` only), else its scalar dtype; on the
    param's device with ``capturable`` (or ``fused``), else on the CPU."""
    from torch.optim.optimizer import _get_scalar_dtype

    fused = bool(group.get("fused")) and key == STEP
    dtype: torch.dtype = _get_scalar_dtype(is_fused=fused or None)  # type: ignore[no-untyped-call]
    on_device = bool(group.get("capturable")) or fused
    return dtype, (param.device if on_device else torch.device("cpu"))


def to_torch(layout: TorchLayout, keys: Mapping[str, str], group: Mapping[str, Any],
             params: list[torch.Tensor], entries: list[Any]) -> list[dict[str, Any] | None]:
    """Each param's torch entry (None: torch would have none) from its functopt entry."""
    counts: dict[int, int] = {}  # id of a count tensor -> its value (read once)
    count_name = next((n for n, k in keys.items() if k == STEP), None)
    out: list[dict[str, Any] | None] = []
    pending: list[tuple[int, int, tuple[torch.dtype, torch.device]]] = []
    step_places: dict[torch.device, tuple[torch.dtype, torch.device]] = {}
    for p, entry in zip(params, entries, strict=True):
        if not entry:
            out.append(None)
            continue
        count = 1
        if count_name is not None:
            held = entry[count_name]
            count = counts.get(id(held), -1)
            if count < 0:  # (a count on the meta device is construction's: no step yet)
                count = counts[id(held)] = 0 if held.is_meta else int(held)
        if count == 0 and not layout.eager:
            out.append(None)
            continue
        if layout.step:
            place = step_places.get(p.device)
            if place is None:
                place = step_places[p.device] = _scalar_place(STEP, group, p)
            pending.append((len(out), count, place))
        # (torch keeps no entry without state: SGD without momentum)
        out.append(_torch_values(layout, keys, group, p, entry) or None)
    # One step tensor per param (torch adds to each in place): views of one tensor per place.
    places: dict[tuple[torch.dtype, torch.device], list[tuple[int, int]]] = {}
    for k, count, place in pending:
        places.setdefault(place, []).append((k, count))
    for (dtype, device), rows in places.items():
        made = torch.tensor([float(c) for _, c in rows], dtype=dtype, device=device).unbind(0)
        for (k, _), step in zip(rows, made, strict=True):
            out[k] = {STEP: step, **(out[k] or {})}
    return out


def _torch_values(layout: TorchLayout, keys: Mapping[str, str], group: Mapping[str, Any],
                  p: torch.Tensor, entry: Mapping[str, Any]) -> dict[str, Any]:
    """The torch entry of param ``p`` from its functopt ``entry``, without its step: each
    key's tensor, in torch's order of keys."""
    torch_entry: dict[str, Any] = {}
    for name, key in keys.items():
        if key in (STEP, CONSTANT):
            continue
        value = entry.get(name)
        if value is None:  # (a leaf the param has no state for: Adafactor's factors)
            continue
        if p.is_complex() and value.shape == (*p.shape, 2):
            value = torch.view_as_complex(value)  # (torch keeps a complex param's state so)
        if key in layout.scalars:
            dtype, device = _scalar_place(key, group, p)
            value = value.to(dtype=dtype, device=device, copy=True)
        torch_entry[key] = value
    return {k: torch_entry[k] for k in (STEP, *layout.keys) if k in torch_entry}


def from_torch(layout: TorchLayout, keys: Mapping[str, str], expected: Mapping[str, Any],
               entry: Any, fresh: Callable[[], Mapping[str, Any]],
               counts: dict[tuple[Any, ...], torch.Tensor]) -> Any:
    """A param's functopt entry (entry name -> tensor) from its torch entry; a param torch
    has no state for (never stepped) gets ``fresh()``, its state from init. ``expected``
    is the param's entry as this optimizer holds it (its names, dtypes and devices);
    ``counts`` the count tensors made so far (params of one count share them)."""
    if not isinstance(entry, Mapping):
        return entry  # (refused, naming it, by the codec's check)
    if not entry:
        return dict(fresh())
    torch_keys = set(keys.values())
    # (a key this optimizer does not keep stays as it is: the codec's check names it)
    out: dict[str, Any] = {k: v for k, v in entry.items() if k not in torch_keys and k != STEP}
    if layout.step and STEP in entry:
        step = entry[STEP]
        count = int(step.item() if isinstance(step, torch.Tensor) else step)
    else:
        count = 1  # torch keeps state for a param that stepped
    for name, key in keys.items():
        if key == STEP:
            held = expected[name]
            made = counts.get((name, count, held.dtype, held.device))
            if made is None:  # (one per name: a step updates each count in place)
                made = counts[(name, count, held.dtype, held.device)] = torch.tensor(
                    count, dtype=held.dtype, device=held.device)
            out[name] = made
        elif key == CONSTANT:
            out[name] = fresh()[name]
        elif key in entry and entry[key] is not None:
            value = entry[key]
            # (torch's SGD keeps a sparse momentum buffer for a sparse gradient: the same
            # values, held dense here; a complex param's state is held as real pairs)
            if getattr(value, "is_sparse", False):
                value = value.to_dense()
            if isinstance(value, torch.Tensor) and value.is_complex():
                value = torch.view_as_real(value)
            out[name] = value
    return out


def looks_torch(entries: Sequence[Any], keys: Mapping[str, str]) -> bool:
    """Whether saved entries are in torch's layout (no key of functopt's own paths)."""
    names = set(keys)
    torch_keys = set(keys.values()) | {STEP}
    for entry in entries:
        if isinstance(entry, Mapping) and entry:
            given = set(map(str, entry))
            if given & (names - torch_keys):
                return False
    return True


def plan_keys(owner: str, cls: str, layout: TorchLayout, plan: Any) -> dict[str, str]:
    """``entry_keys`` of a group's plan (``functopt.Optimizer``'s), made once per plan."""
    cached: dict[str, str] | None = plan.__dict__.get("torch_keys")
    if cached is None:
        stored = set(plan.fields[0]) if plan.fields else set()
        slots = {name: slot for name, slot in slot_names(plan.treespec, plan.pspec).items()
                 if name in stored}
        cached = plan.torch_keys = entry_keys(owner, cls, layout, slots)
    return cached


def state_dict(opt: Any, layout: TorchLayout) -> dict[str, Any]:
    """torch.optim's ``state_dict()`` of ``opt`` (a ``functopt.optim`` class): its groups as
    torch packs them (every key but ``params``, then the params' ids), and per param that
    has state in torch's layout its torch entry; the state-dict hooks run as in torch."""
    cls = type(opt).__name__
    owner = f"functopt.optim.{cls}.state_dict"
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    ids: dict[int, int] = {}
    groups: list[dict[str, Any]] = []
    state: dict[int, Any] = {}
    plans = opt._plans
    pending = opt._pending  # groups whose state is still to be made: none yet, as in torch
    store = opt.__dict__["_store"]  # (opt.state would make it)
    for i, group in enumerate(opt.param_groups):
        params = group["params"]
        for p in params:
            ids.setdefault(id(p), len(ids))
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [ids[id(p)] for p in params]
        groups.append(packed)
        plan = plans[i] if i < len(plans) else None
        if plan is None or not params or i in pending:  # frozen, empty or unstepped
            continue
        keys = plan_keys(owner, cls, layout, plan)
        get = store.get
        made = to_torch(layout, keys, group, params, [get(p) for p in params])
        for p, entry in zip(params, made, strict=True):
            if entry is not None:
                state[ids[id(p)]] = entry
    saved: dict[str, Any] = {"state": _state_dict.packed_state(state, _state_dict.own_keys(store)),
                             "param_groups": groups}
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        result = post_hook(opt, saved)
        if result is not None:
            saved = result
    return saved


def loaded_entries(opt: Any, layout: TorchLayout, owner: str, group: dict[str, Any],
                   plan: Any, config: Any, entries: list[Any],
                   hyper: dict[str, Any]) -> list[Any]:
    """The saved entries of a group in functopt's layout: torch's translated (a param torch
    has no state for starts from init), functopt's own (a record ``config`` of the format,
    or its paths) as saved."""
    keys = plan_keys(owner, type(opt).__name__, layout, plan)
    if config is not None or not any(entries) or not looks_torch(entries, keys):
        return entries
    fresh: list[Any] = []

    def init(j: int) -> dict[str, Any]:
        if not fresh:
            fresh.extend(plan.fresh(plan.transform, opt._tree(group, group["params"]),
                                    opt._init_hyper(hyper)))
        return {name: fresh[k] for k, name in plan.entry_slots[j] if fresh[k] is not None}

    counts: dict[tuple[Any, ...], torch.Tensor] = {}
    return [from_torch(layout, keys, plan.fields[j], entry, functools.partial(init, j), counts)
            for j, entry in enumerate(entries)]
