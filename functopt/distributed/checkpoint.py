"""functopt state as a flat dict of tensors with readable keys, for checkpoints that reshard.

``torch.distributed.checkpoint`` (DCP) saves a state dict on N ranks and loads it on M:
each DTensor is written as its shards with their global offsets, and read back into
whatever sharding the loading ranks have. It does that only for tensors that are values of
(nested) dicts; a NamedTuple, a tuple or a dataclass is pickled whole, shards and all, and
cannot be resharded. functopt states are NamedTuples of tuples and dicts, so they go
through [`state_to_dict`][functopt.distributed.state_to_dict] on the way out and
[`state_from_dict`][functopt.distributed.state_from_dict] on the way back:

```python
import torch.distributed.checkpoint as dcp
from functopt.distributed import state_from_dict, state_to_dict

dcp.save({"opt": state_to_dict(state, params)}, checkpoint_id=path)
# later, maybe on another number of ranks: a template of the right sharding first
template = opt.init(params)              # params sharded as this run shards them
loaded = {"opt": state_to_dict(template, params)}
dcp.load(loaded, checkpoint_id=path)     # in place, into the template's tensors
state = state_from_dict(loaded["opt"], template)
```

DCP loads only the keys present in the dict it is given, into its tensors, so the template
must exist, eagerly initialised, before ``load``.

A checkpoint that cannot be torn: DCP writes one file per rank and the metadata last, so a
save that dies while overwriting a checkpoint leaves files of two saves under the old
metadata, which load without an error as a mix of two steps when their sizes match. The
dict therefore carries its own check. ``state_to_dict`` adds the entry ``'@integrity'``, a
small int64 tensor of checksums of every value, keyed by each element's position in the
global tensor and summed over the ranks' shards (one ``all_reduce`` when the dict holds
DTensors), so it does not depend on how the saving run sharded the state.
``state_from_dict`` sums the loaded values the same way and raises, on every rank alike
(one ``all_reduce`` carries every rank's verdict), naming the keys whose values are not
the ones saved with the record. See ``functopt/distributed/_integrity.py`` for the sums. A
dict without the entry (a checkpoint saved without it) loads unchecked; DCP refuses a
template key the checkpoint lacks, so drop ``'@integrity'`` from the template dict to load
such a checkpoint. A ZeRO-1 state (``zero1``'s slices) is refused here: its pair is
``zero1_state_to_dict`` / ``zero1_state_from_dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

import optree
import torch
import torch.distributed as dist

from functopt._collective.dtensor import is_dtensor
from functopt.distributed import _integrity
from functopt.distributed._zero_state import ZERO1_STATE_REFUSED, Zero1State
from functopt.tree import _core

__all__ = ["state_from_dict", "state_to_dict"]


def _keyed_leaves(owner: str, state: Any) -> tuple[list[Any], _core.TreeSpec, list[str]]:
    """The leaves of ``state``, its treespec and the dotted key of each leaf."""
    leaves, treespec = _core.flatten(state)
    keys = _core.paths(treespec)
    seen: dict[str, int] = {}
    for i, (key, leaf) in enumerate(zip(keys, leaves, strict=True)):
        if leaf is None:
            continue
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{owner}: the state leaf {key!r} is a {type(leaf).__name__}; a state dict "
                f"holds tensors only. Fix: keep every state field a tensor (a 0-d tensor for "
                f"a counter or a hyperparameter)."
            )
        if key in seen:
            raise ValueError(
                f"{owner}: two state leaves have the key {key!r} (leaves {seen[key]} and {i}: "
                f"dict keys with dots, such as {{'a.b': x}} next to {{'a': {{'b': y}}}}, or "
                f"keys that differ only in type, such as 1 and '1'). Fix: give params and "
                f"dict entries distinct names."
            )
        seen[key] = i
    return leaves, treespec, keys


def _check_params(owner: str, state_spec: _core.TreeSpec, params: Any,
                  leaves: list[Any]) -> None:
    """Every param's path ends some per-param state path, if any does (state for these params)."""
    param_paths = {tuple(a) for a in optree.treespec_accessors(_core.structure(params))}
    state_paths = [tuple(a) for a in optree.treespec_accessors(state_spec)]
    found = {p for s in state_paths for n in range(1, len(s) + 1) if (p := s[-n:]) in param_paths}
    # A tensor of a param's rank under a dict key is per-param state: for other params if
    # no path matches (counts under labels, as in partition, are 0-d).
    keyed = [_core.path_str(s) for s, leaf in zip(state_paths, leaves, strict=True)
             if isinstance(leaf, torch.Tensor) and leaf.dim() > 0
             and any(isinstance(e, optree.MappingEntry) for e in s)]
    if not found and param_paths and () not in param_paths and keyed:  # () a lone tensor
        raise ValueError(
            f"{owner}: none of the state's per-param entries ({_listing(keyed, 4)}) belongs to "
            f"the params given ({_listing([_core.path_str(p) for p in param_paths], 4)}): "
            f"the state was initialised on another model. Fix: pass the params the state "
            f"was initialised on (same names and structure)."
        )
    if found and found != param_paths:
        missing = sorted(_core.path_str(p) for p in param_paths - found)
        raise ValueError(
            f"{owner}: the state has per-param entries, but none for the params {missing[:8]}"
            f"{' and more' if len(missing) > 8 else ''}. Fix: pass the params the state was "
            f"initialised on (same names and structure)."
        )


def state_to_dict(state: Any, params: Any = None) -> dict[str, torch.Tensor]:
    """``state`` as a flat dict ``{dotted path: tensor}``, ready for ``torch.distributed.checkpoint``.

    Keys are the state's paths: NamedTuple field names, positions in tuples and, inside
    per-param fields (which have the params' structure), the parameter names, e.g.
    ``'inner_state.0.mu.layers.0.weight'``. ``None`` leaves are left out. DTensor leaves
    stay DTensors (DCP saves their shards and reshards them on load); the values are the
    state's own tensors, not copies, except that a tensor sharing memory with an earlier
    leaf is cloned, so that loading in place into the dict writes every key to memory of
    its own. The entry ``'@integrity'`` is the integrity record that ``state_from_dict``
    checks the loaded values against (see the module docstring); with DTensor leaves,
    computing it makes one ``all_reduce`` over the default process group, so call this on
    every rank, as ``dcp.save`` and ``dcp.load`` are.

    Args:
        state: a functopt state: nested NamedTuples, tuples, lists and dicts of tensors,
            DTensors and ``None``.
        params: the params the state was initialised on (optional). When given, and the
            state has per-param fields, every param must have an entry: this catches a
            state saved with the params of another model.

    Returns:
        A new flat dict of tensors.

    Raises:
        TypeError: a leaf is not a tensor or None (naming its path), or ``state`` is a
            ``zero1`` state (use ``zero1_state_to_dict``).
        ValueError: two leaves map to the same key (or one has the record's key), or
            ``params`` do not match the state.

    Examples:
        >>> import torch, functopt
        >>> from functopt.distributed import state_to_dict
        >>> params = {"w": torch.ones(2)}
        >>> state = functopt.adam(0.1).init(params)
        >>> sorted(state_to_dict(state, params))
        ['0.count', '0.mu.w', '0.nu.w', '@integrity']
    """
    owner = "state_to_dict"
    if isinstance(state, Zero1State):
        raise TypeError(ZERO1_STATE_REFUSED.format(owner=owner, what="the state"))
    return _with_record(_flat(owner, state, params))


def _with_record(out: dict[str, torch.Tensor],
                 owned: AbstractSet[str] = frozenset()) -> dict[str, torch.Tensor]:
    """``out`` with its integrity record added (one all_reduce if it has DTensor entries, or
    ``owned`` plain entries that only this rank holds)."""
    out[_integrity.RECORD_KEY] = _integrity.make_record(out, owned)
    return out


def _flat(owner: str, state: Any, params: Any) -> dict[str, torch.Tensor]:
    """``state_to_dict`` without the integrity record."""
    leaves, treespec, keys = _keyed_leaves(owner, state)
    if _integrity.RECORD_KEY in keys:
        raise ValueError(
            f"{owner}: a state leaf has the key {_integrity.RECORD_KEY!r}, which the "
            f"integrity record of the dict takes. Fix: rename that param or dict entry."
        )
    if params is not None:
        _check_params(owner, treespec, params, leaves)
    out: dict[str, torch.Tensor] = {}
    storages: set[tuple[torch.device, int]] = set()
    for key, leaf in zip(keys, leaves, strict=True):
        if leaf is None:
            continue
        local = leaf.to_local() if is_dtensor(leaf) else leaf
        storage = (local.device, local.untyped_storage().data_ptr())
        if local.numel() > 0 and storage in storages:
            leaf = leaf.clone()  # an alias would receive two keys' values in an in-place load
        elif local.numel() > 0:
            storages.add(storage)
        out[key] = leaf
    return out


def _listing(keys: list[str], limit: int = 8) -> str:
    shown = sorted(keys)[:limit]
    return f"{shown}{f' and {len(keys) - limit} more' if len(keys) > limit else ''}"


def state_from_dict(d: Mapping[str, Any], template: Any) -> Any:
    """Rebuild a state of ``template``'s structure from a dict made by [`state_to_dict`][functopt.distributed.state_to_dict].

    ``template`` is a state of the same transform, initialised on params sharded as the
    loading run shards them (it gives the structure, the ``None`` leaves, and each
    tensor's expected shape, dtype and DTensor placements). The result holds the dict's
    tensors themselves (no copies): after an in-place ``dcp.load`` into
    ``state_to_dict(template)``, those are already the template's sharding.

    When ``d`` has the integrity record ``'@integrity'``, the loaded values are checked
    against it: a torn checkpoint (files of two saves), a changed value, or a dict that one
    rank cannot rebuild raises on every rank (with a DTensor template, one ``all_reduce``
    over the default process group carries the verdicts: call this on every rank). A dict
    without the record is rebuilt unchecked.

    Args:
        d: ``{dotted path: tensor}``, every key of ``state_to_dict(template)`` and no other
            (the record is optional).
        template: a state of the same structure.

    Returns:
        The state, bitwise the saved one (resharded where the template is sharded
        differently).

    Raises:
        ValueError: naming missing and unexpected keys, or a key whose tensor has another
            (global) shape or other placements; naming the keys whose values fail the
            integrity record; on every rank when one rank's dict fails (DTensor template).
        TypeError: naming a key whose value is not a tensor, has another dtype, or is a
            plain tensor where the template has a DTensor (or the reverse); ``template`` is
            a ``zero1`` state (use ``zero1_state_from_dict``).

    Examples:
        >>> import torch, functopt, functopt.testing
        >>> from functopt.distributed import state_from_dict, state_to_dict
        >>> params = {"w": torch.ones(2)}
        >>> tx = functopt.adam(0.1)
        >>> state = tx.update(params, tx.init(params), params)[1]
        >>> restored = state_from_dict(state_to_dict(state), tx.init(params))
        >>> functopt.testing.bitwise_equal(restored, state)
        True
    """
    owner = "state_from_dict"
    if not isinstance(d, Mapping):
        raise TypeError(
            f"{owner}: expected a dict {{dotted path: tensor}} as state_to_dict returns, got "
            f"{type(d).__name__}."
        )
    if isinstance(template, Zero1State):
        raise TypeError(ZERO1_STATE_REFUSED.format(owner=owner, what="the template"))
    sharded = dist.is_available() and dist.is_initialized() and any(
        is_dtensor(x) for x in _core.flatten(template)[0])
    return _checked(owner, d, lambda body: _rebuild(owner, body, template), sharded)


def _checked(owner: str, d: Mapping[str, Any], rebuild: Callable[[dict[str, Any]], Any],
             sharded: bool, owned: AbstractSet[str] = frozenset()) -> Any:
    """``rebuild(d without its record)``, checked against the record when ``d`` has one.

    With ``sharded`` (DTensor entries: one ``all_reduce`` over the default group) every rank
    raises if any rank's dict fails the record or the rebuild."""
    body = {k: v for k, v in d.items() if k != _integrity.RECORD_KEY}
    if _integrity.RECORD_KEY not in d:  # a dict saved without the record: nothing to check
        return rebuild(body)
    error: BaseException | None = None
    try:
        state = rebuild(dict(body))  # (a copy: the record is checked on the dict as loaded)
    except Exception as exc:  # re-raised after the ranks agree: none waits for this one
        error = exc
    _integrity.check_record(owner, body, d[_integrity.RECORD_KEY], collective=sharded,
                            owned=owned, error=error)
    return state


def _rebuild(owner: str, d: Mapping[str, Any], template: Any) -> Any:
    """``state_from_dict`` of a dict without the integrity record."""
    leaves, treespec, keys = _keyed_leaves(owner, template)
    expected = {k for k, leaf in zip(keys, leaves, strict=True) if leaf is not None}
    missing = [k for k in keys if k in expected and k not in d]
    unexpected = [str(k) for k in d if k not in expected]
    if missing or unexpected:
        parts = [f"missing keys {_listing(missing)}"] if missing else []
        parts += [f"unexpected keys {_listing(unexpected)}"] if unexpected else []
        raise ValueError(
            f"{owner}: the dict does not match the template state: {'; '.join(parts)}. Fix: "
            f"build the template with the same transform, on params of the same names, as "
            f"the saved state was."
        )
    out: list[Any] = []
    for key, ref in zip(keys, leaves, strict=True):
        if ref is None:
            out.append(None)
            continue
        value = d[key]
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{owner}: entry {key!r} is a {type(value).__name__}, expected "
                f"{_core._describe(ref)}."
            )
        if is_dtensor(ref) != is_dtensor(value):
            kinds = ("a DTensor", "a plain tensor")
            got, want = (kinds[0], kinds[1]) if is_dtensor(value) else (kinds[1], kinds[0])
            raise TypeError(
                f"{owner}: entry {key!r} is {got} but the template's is {want}. Fix: load "
                f"into state_to_dict(template) with torch.distributed.checkpoint, which "
                f"reads each entry into the template's sharding."
            )
        if value.shape != ref.shape:
            raise ValueError(
                f"{owner}: entry {key!r} has shape {tuple(value.shape)}, the template's has "
                f"shape {tuple(ref.shape)}. Fix: load a state saved for params of the same "
                f"shapes."
            )
        if value.dtype != ref.dtype:
            raise TypeError(
                f"{owner}: entry {key!r} is {_core._dtype_name(value.dtype)}, the template's "
                f"is {_core._dtype_name(ref.dtype)}. Fix: save and load the state without "
                f"casting it."
            )
        if is_dtensor(ref) and is_dtensor(value) and (
                value.device_mesh != ref.device_mesh
                or tuple(value.placements) != tuple(ref.placements)):
            raise ValueError(
                f"{owner}: entry {key!r} is a DTensor with placements "
                f"{tuple(value.placements)} on {value.device_mesh}, the template's has "
                f"{tuple(ref.placements)} on {ref.device_mesh}. Fix: load into "
                f"state_to_dict(template), which gives the entries the template's sharding."
            )
        out.append(value)
    return _core.unflatten(treespec, out)
