"""``MixedPrecisionOptimizer``'s state seen as ``torch.optim``'s: ``optimizer.state`` and
its state dicts.

The facade keeps one step's state (a ``MixedPrecisionState``); `FacadeState` shows it in
torch's layout, as each param's entry of state paths to its tensors (`_StateView`, rebuilt
at each read), saves it so (``state_dict()``, through ``_state_dict``'s codec) and loads it
back: the layout of today, the nested one of the format before 2, and the state of a plain
recipe saved before the facade ran it as ``inject_hyperparams`` of itself.
"""

from __future__ import annotations

import math
import typing
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from functopt._collective.dtensor import local_tensor
from functopt.adapters import _missing_grads, _param_groups, _state_dict
from functopt.adapters._base import AdapterBase, check_frozen_entries
from functopt.adapters._facade_groups import _Plan
from functopt.distributed.offloading import OffloadedState
from functopt.precision.loss_scale import LossScale, _describe_rule, _rule_vector, _same_rule
from functopt.precision.master import MasterWeights
from functopt.precision.step import MixedPrecisionState
from functopt.tree import _core

_OWNER = "MixedPrecisionOptimizer"

_RULE_KEY = "loss_scale_rule"  # the state dict's record of the loss-scale rule
_GROUPS_KEY = "param_groups"  # the state dict's group values (when the groups hold any)

LOSS_SCALE_RULE_MISMATCH = (
    "MixedPrecisionOptimizer.load_state_dict: the checkpoint was saved with {saved}, this "
    "optimizer has {current}. The saved scale only means something under its own rule (a "
    "dynamic scale of 65536 loaded into loss_scale=None would scale every loss by 65536 "
    "and never unscale it). Fix: build the optimizer with the checkpoint's rule (the same "
    "loss_scale=...) to resume; to switch rules on purpose (float16 to bfloat16), replace "
    "the checkpoint's loss-scale entries (the 'loss_scale.*' keys of every param's entry and "
    "each group's ['functopt']['loss_scale_rule']) by this optimizer's own (from "
    "opt.state_dict()) before loading, which restarts the scale under the new rule."
)


def _unaliased(state: MixedPrecisionState, params: list[torch.Tensor]) -> MixedPrecisionState:
    """``state`` with a copy of every tensor that shares memory with a param.

    A transform may keep the params it is initialised with (slow weights, a reference
    point); in the functional world they never change, but here ``step()`` writes the
    params in place, which would change that state behind the transform's back.
    """
    # A DTensor has no storage of its own: compare its local shard's (FSDP2 params).
    storages = {local_tensor(p).untyped_storage().data_ptr() for p in params
                if local_tensor(p).numel() > 0}
    leaves, treespec = _core.flatten(state)
    out = [
        leaf.clone()
        if isinstance(leaf, torch.Tensor) and local_tensor(leaf).numel() > 0
        and local_tensor(leaf).untyped_storage().data_ptr() in storages
        else leaf
        for leaf in leaves
    ]
    unaliased: MixedPrecisionState = _core.unflatten(treespec, out)
    return unaliased


_PARTITION = "inner_state.inner_states."  # the state path of each group's transform state


def _relabelled(entry: Mapping[str, Any], order: list[int]) -> dict[str, Any]:
    """A saved param entry with each group's partition state moved to the group that holds
    those params here (``order[i]``: the saved position of group ``i``)."""
    label = {f"{_PARTITION}{saved}.": f"{_PARTITION}{i}." for i, saved in enumerate(order)}
    out = {}
    for key, value in entry.items():
        if key.startswith(_PARTITION):
            head = key[:key.index(".", len(_PARTITION)) + 1]
            key = label.get(head, head) + key[len(head):]
        out[key] = value
    return out


class _StateView(defaultdict):  # type: ignore[type-arg]
    """``MixedPrecisionOptimizer.state``: each param's entry of the step's state, and the
    keys that are no tensor, which code such as a state-dict hook stores there; those are
    kept in ``own`` (the optimizer's), as torch.optim keeps them in its ``state``."""

    def __init__(self, own: dict[Any, Any]) -> None:
        super().__init__(dict)
        self._own = own

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(key, torch.Tensor):
            raise TypeError(_VIEW_WRITE)
        self._own[key] = value
        super().__setitem__(key, value)

    def __missing__(self, key: Any) -> Any:
        # (as torch's defaultdict reads an empty entry for a tensor that is no param here,
        # without storing it: the view is rebuilt at each read)
        if isinstance(key, torch.Tensor):
            return _Entry()
        return super().__missing__(key)

    def __delitem__(self, key: Any) -> None:
        if isinstance(key, torch.Tensor):
            raise TypeError(_VIEW_WRITE)
        self._own.pop(key, None)
        super().__delitem__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        if isinstance(key, torch.Tensor):
            raise TypeError(_VIEW_WRITE)
        self._own.pop(key, None)
        return super().pop(key, *default)


_VIEW_WRITE = (
    f"{_OWNER}: optimizer.state is a view of the step's state, rebuilt at each read: a "
    f"write into a param's entry would be lost. Fix: change the state with "
    f"load_state_dict(...) (edit the dict state_dict() returns), or write into the tensors "
    f"an entry holds (opt.state[p]['key'].copy_(...)), which are the live state."
)


class _Entry(dict):  # type: ignore[type-arg]
    """A param's entry of `_StateView`: its tensors are the live state. A tensor written
    over one of the same shape is copied into it (a framework that moves the state to the
    params' device writes each tensor back; the live state stays where the step keeps it);
    any other change raises."""

    def __setitem__(self, key: Any, value: Any) -> None:
        held = self.get(key)
        if not (isinstance(held, torch.Tensor) and isinstance(value, torch.Tensor)
                and value.shape == held.shape):
            raise TypeError(_VIEW_WRITE)
        if value is not held:
            with torch.no_grad():
                held.copy_(value)

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(_VIEW_WRITE)

    __delitem__ = update = pop = popitem = setdefault = clear = _refuse


class FacadeState(AdapterBase):
    """The facade's ``optimizer.state`` and state dicts (see the module's docstring)."""

    # the facade's (functopt/adapters/mixed_precision_optimizer.py)
    _state: MixedPrecisionState
    _names: list[str]
    _params: list[torch.Tensor]
    _frozen: list[torch.Tensor]
    _plans: list[_Plan]
    _labels: dict[str, int]
    _partitioned: bool
    _lifted: bool
    _plain: Any
    _master_weights: MasterWeights
    _loss_scale_rule: LossScale | None
    _offloaded: OffloadedState | None
    _offload_buffers: tuple[Any, ...] | None
    _missed: _missing_grads.TorchCounts | None
    _synced: Any

    if typing.TYPE_CHECKING:
        def _group_state(self, state: MixedPrecisionState, index: int) -> Any: ...

        def _tree(self, leaves: list[Any]) -> Any: ...

    # The facade's state is its step's state; ``optimizer.state`` is a view of it, keyed by
    # param as torch.optim's is (torch.distributed.checkpoint's helpers read it to tell
    # whether the state exists, and would otherwise take a zero-gradient step).
    def _read_state(self) -> defaultdict[torch.Tensor, dict[str, Any]]:
        if "_state" not in self.__dict__:  # during torch's __init__
            return defaultdict(dict)
        entries = self._layout().entries(self._state)
        own = self.__dict__.setdefault("_own_keys", {})
        view = _StateView(own)
        view.update({p: _Entry() for p in self._frozen})
        view.update({p: _Entry(entries[name]) for p, name in zip(self._params, self._names,
                                                                 strict=True)})
        view.update(own)
        return view

    def _write_state(self, value: Any) -> None:
        if value:
            raise TypeError(
                f"{_OWNER}: optimizer.state is a view of the step's state and cannot be "
                f"replaced. Fix: load a state with load_state_dict(...).")

    def _layout(self) -> _state_dict.Layout:
        layout = self.__dict__.get("_layout_cache")
        spec = _core.structure(self._state)
        if layout is None or layout.treespec != spec:
            layout = self.__dict__["_layout_cache"] = _state_dict.Layout(
                _OWNER, self._state, self._names)
        return typing.cast(_state_dict.Layout, layout)

    def _config(self, plan: _Plan) -> dict[str, Any]:
        """The configuration a group's saved state needs (``_state_dict.CONFIG_KEY``)."""
        rule = [None if math.isnan(v) else v for v in _rule_vector(self._loss_scale_rule).tolist()]
        return {"format": _state_dict.FORMAT,
                "transform": None if plan.frozen or plan.transform is None else
                _state_dict.recipe_signature(plan.transform, plan.injected),
                _RULE_KEY: rule,
                "master_dtype": str(self._master_weights.dtype).removeprefix("torch.")}

    def _unsealed_state_dict(self) -> dict[str, Any]:
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._state_shared = True
        if self._offloaded is not None:  # the dict holds the host buffers: never reuse them
            self._offload_buffers = None
        entries = self._layout().entries(self._state)
        state: dict[int, dict[str, Any]] = {}
        groups = []
        start = 0
        for plan, group in zip(self._plans, self.param_groups, strict=True):
            names = list(group["param_names"])
            ids = list(range(start, start + len(names)))
            start += len(names)
            for pid, name in zip(ids, names, strict=True):
                state[pid] = dict(entries.get(name, {}))
            groups.append({**{k: v for k, v in group.items()
                              if k not in ("params", "param_names")},
                           "params": ids, "param_names": names,
                           _state_dict.CONFIG_KEY: self._config(plan)})
        saved = {"state": _state_dict.packed_state(state, self.__dict__.get("_own_keys", {})), "param_groups": groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, saved)
            if result is not None:
                saved = result
        return saved

    def _load(self, owner: str, state_dict: dict[str, Any]) -> None:
        if "state" not in state_dict:
            self._load_nested(state_dict)
        else:
            self._load_torch_layout(owner, state_dict)

    def _load_torch_layout(self, owner: str, state_dict: Mapping[str, Any]) -> None:
        """Load ``state_dict()``'s layout (``load_state_dict`` ran the hooks)."""
        pairs = _state_dict.saved_groups(owner, state_dict, self.param_groups)
        saved_groups = []
        entries: dict[str, Any] = {}
        for plan, group, (saved, group_entries) in zip(self._plans, self.param_groups, pairs,
                                                       strict=True):
            config = saved.pop(_state_dict.CONFIG_KEY, None)
            if isinstance(config, Mapping) and config.get(_RULE_KEY) is not None:
                self._check_rule(torch.tensor([math.nan if v is None else v
                                               for v in config[_RULE_KEY]],
                                              dtype=torch.float64))
            ours = self._config(plan)
            _state_dict.check_config(owner, plan.index, config,
                                     {k: v for k, v in ours.items() if k != _RULE_KEY})
            if plan.frozen:
                check_frozen_entries(owner, plan.index, group_entries)
            else:
                entries.update(zip(group["param_names"], group_entries, strict=True))
            saved_groups.append(saved)
        groups = self._check_groups(saved_groups)
        order = _state_dict.group_order(self.param_groups, state_dict["param_groups"])
        if self._partitioned and order != sorted(order):
            entries = {name: _relabelled(entry, order) for name, entry in entries.items()}
        state = self._layout().tree(owner, self._state, self._lifted_entries(entries))
        self._install(state, groups)
        self.__dict__["_own_keys"] = _state_dict.unpacked_extras(state_dict)

    def _load_nested(self, state_dict: Mapping[str, Any]) -> None:
        """Load the nested layout of the format before 2 (``_state_dict.from_nested``)."""
        groups = None
        if _RULE_KEY in state_dict or _GROUPS_KEY in state_dict:
            # (A checkpoint from before the rule was recorded has no entry: not checked.)
            state_dict = dict(state_dict)
            if _RULE_KEY in state_dict:
                self._check_rule(state_dict.pop(_RULE_KEY))
            groups = self._check_groups(state_dict.pop(_GROUPS_KEY, None))
        owner = f"{_OWNER}.load_state_dict"
        lifted = set(_state_dict.to_nested(owner, self._state).get("inner_state", {}))
        inner = state_dict.get("inner_state", {})
        if self._lifted and not lifted & set(inner if isinstance(inner, Mapping) else ()):
            # saved before the lift: read it as the plain recipe's state, then lift it
            template = self._state._replace(inner_state=self._unlifted_inner())
            old = _state_dict.from_nested(owner, template, state_dict)
            entries = _state_dict.Layout(owner, old, self._names).entries(old)
            state = self._layout().tree(owner, self._state, self._lifted_entries(entries))
        else:
            state = _state_dict.from_nested(owner, self._state, state_dict)
        self._install(state, groups)

    # The paths of a lifted plain recipe's state: the injected state of each group.
    def _injected_paths(self) -> dict[int, str]:
        return {plan.index: f"inner_state.inner_states.{plan.index}" if self._partitioned
                else "inner_state" for plan in self._plans if not plan.frozen}

    def _lifted_entries(self, entries: dict[str, Any]) -> dict[str, Any]:
        """``entries`` as they are, or, when this optimizer lifted a plain recipe and they
        were saved before the lift (the recipe's own state at ``'inner_state'``, one
        state for all groups: main's layout until then), in the lifted layout: the recipe's
        state under each group's injected state, its hyperparameters the ones this
        optimizer was built with (the plain recipe's fixed values), its count of updates the
        steps taken less the steps skipped (``key - metrics.skipped_steps``, both in the
        checkpoint)."""
        paths = self._injected_paths()
        if not self._lifted or any(key.startswith(f"{paths[self._labels[name]]}.hyperparams.")
                                   for name, entry in entries.items() for key in entry):
            return entries
        first: Mapping[str, Any] = next((entry for entry in entries.values() if entry), {})
        steps, skipped = first.get("key"), first.get("metrics.skipped_steps")
        added: dict[str, torch.Tensor] = {}
        for index, path in paths.items():
            found = self._group_state(self._state, index)
            if isinstance(steps, torch.Tensor) and isinstance(skipped, torch.Tensor):
                # (a checkpoint without them lacks the 'key' entry too, and is refused so)
                added[f"{path}.count"] = (steps.to(torch.int64) - skipped.cpu().to(
                    torch.int64)).to(dtype=found.count.dtype, device=found.count.device)
            added.update({f"{path}.hyperparams.{name}": value.clone()
                          for name, value in found.hyperparams.items()})
        expected = {name: set(entry) for name, entry in
                    self._layout().entries(self._state).items()}
        return _state_dict.relocated(entries, "inner_state",
                                     [f"{path}.inner_state" for path in paths.values()],
                                     expected, added)

    def _unlifted_inner(self) -> Any:
        """The state of the plain recipe this optimizer lifted, over all trainable params (a
        template: what the facade kept before the lift)."""
        mw = self._master_weights
        with torch.no_grad():
            views = [mw.view(p.detach(), self._state.master[name])
                     for p, name in zip(self._params, self._names, strict=True)]
            assert self._plain is not None  # (only a lifted optimizer reads old checkpoints)
            return self._plain.init(self._tree(views))

    def _install(self, state: MixedPrecisionState, groups: list[dict[str, Any]] | None) -> None:
        mw = self._master_weights
        with torch.no_grad():
            for p, name in zip(self._params, self._names, strict=True):
                store = state.master[name]
                if store is not None:  # as LightRFT: the model follows the loaded master
                    p.copy_(mw.write(p, store, mw.view(p, store), None)[0])
        self._state = state
        missed = self._missed
        if missed is not None:  # one count for all again
            missed.missed.reset()
        for group, saved in zip(self.param_groups, groups or [], strict=False):
            group.update(saved)
        for plan in self._plans:  # the next step writes the group values into the state
            plan.written.clear()
        self._synced = None

    def _check_groups(self, saved: Any) -> list[dict[str, Any]] | None:
        if saved is None:
            return None
        where = f"{_OWNER}.load_state_dict"
        if not isinstance(saved, list) or len(saved) != len(self.param_groups) or not all(
                isinstance(g, dict) for g in saved):
            raise ValueError(
                f"{where}: the state dict's 'param_groups' is not a list of "
                f"{len(self.param_groups)} dicts (one per param group of this optimizer). "
                f"Fix: build the optimizer with the param groups of the one that saved it."
            )
        mults = []
        for plan, group in zip(self._plans, saved, strict=True):
            if group.get("frozen", False) != plan.frozen:
                raise ValueError(
                    f"{where}: param_groups[{plan.index}] is {'' if plan.frozen else 'not '}"
                    f"frozen here but was {'not ' if plan.frozen else ''}frozen when saved. "
                    f"Fix: build the optimizer with the groups of the one that saved it."
                )
            if not plan.frozen:
                plan.check_keys(where, f"param_groups[{plan.index}]", group)
            flags = _param_groups.group_flags(where, f"param_groups[{plan.index}]", group)
            mults.append((flags.lr_mult, flags.wd_mult))
        for plan, folded in zip(self._plans, mults, strict=True):
            plan.mults = folded  # (the saved values hold the saved multipliers' products)
        return saved

    def _check_rule(self, saved: Any) -> None:
        current = _rule_vector(self._loss_scale_rule)
        if not isinstance(saved, torch.Tensor) or not _same_rule(saved.cpu(), current):
            got = (_describe_rule(saved.cpu()) if isinstance(saved, torch.Tensor)
                   and saved.shape == current.shape else repr(saved))
            raise ValueError(LOSS_SCALE_RULE_MISMATCH.format(
                saved=got, current=_describe_rule(current)))
