"""Megatron's ``sharded_state_dict``: the facade's state for ``megatron.core.dist_checkpointing``.

megatron-core (0.16.1, ``megatron/core/optimizer/optimizer.py``) saves an optimizer with
``dist_checkpointing.save(optimizer.sharded_state_dict(model_sharded_state_dict), dir)``
and loads it with ``optimizer.load_state_dict(dist_checkpointing.load(
optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=True), dir))``. The
model's sharded state dict says, for each param, which part of which global tensor this
rank holds (its key, global shape and offset, and which rank is the main replica); the
optimizer's entries follow their params. The checkpoint is then in model space: it loads
on any tensor, pipeline and data parallel layout whose model sharded state dict names the
same global tensors.

Each param's entry of the facade's ``state_dict()`` (torch's layout: its master, its inner
state, the shared loss scale and counters) becomes, key by key:

- a tensor of the param's local shape (the master, Adam's moments): a ``ShardedTensor`` of
  the param's global tensor, keyed ``optimizer.state.<entry key>.<param's key>``, laid out
  and replicated as the param is (megatron-core's ``make_sharded_optimizer_tensor``);
- anything else (the per-param counts, the loss scale, a whole factored moment of a param
  that is not split): a ``ShardedObject`` under the same key, written by one rank, the
  param's main replica that holds the start of the global tensor, and read by every rank
  that holds part of the param. Counts stay per param, so params that stepped a different
  number of times keep their own (megatron-core saves one step for the whole optimizer
  and refuses other ones).

The groups' ``params`` and ``param_names`` are each rank's own
(``LocalNonpersistentObject``); the other group keys are saved once, as megatron-core
saves them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from functopt._collective.dtensor import local_tensor

__all__ = ["add_prefix", "sharded_state_dict"]

# OptimizerConfig metadata megatron-core passes to every optimizer's sharded_state_dict;
# each selects among the formats of its DistributedOptimizer (or drops a prefix of its
# ChainedOptimizer, read there), and the facade's one format is model space already.
_METADATA = frozenset({"distrib_optim_sharding_type", "distrib_optim_fully_reshardable_mem_efficient",
                       "dp_cp_group", "chained_optim_avoid_prefix", "non_homogeneous_layers",
                       "singleton_local_shards"})


def _dist_checkpointing() -> Any:
    try:
        from megatron.core import dist_checkpointing  # type: ignore[import-untyped]
        from megatron.core.dist_checkpointing import (  # type: ignore[import-untyped]  # noqa: F401
            optimizer,
            utils,
        )
    except ImportError as err:  # pragma: no cover - megatron-core is a test dependency
        raise ImportError(
            "MixedPrecisionOptimizer.sharded_state_dict builds megatron-core's "
            "dist_checkpointing objects, and megatron-core is not installed. Fix: pip "
            "install megatron-core, or save with state_dict() / torch.distributed.checkpoint."
        ) from err
    return dist_checkpointing


def _main_replica(sharded: Any) -> tuple[int, ...]:
    """A replica id under which exactly one rank writes a per-param object: the param's
    main replica that holds the start of the global tensor."""
    replica = sharded.replica_id if isinstance(sharded.replica_id, tuple) else (
        sharded.replica_id,)
    first = all(offset == 0 for offset in sharded.global_offset)
    return (0 if first else 1, *replica)


def _by_param(model_sharded_state_dict: Any, ids: dict[int, torch.Tensor],
             names: Mapping[int, str]) -> dict[int, Any]:
    """Each param's state-dict id to the model's sharded tensor of it."""
    dc = _dist_checkpointing()
    tensors, _ = dc.utils.extract_sharded_tensors_and_factories(model_sharded_state_dict)
    place = {id(p): i for i, p in ids.items()}
    found: dict[int, Any] = {}
    for sharded in dc.dict_utils.nested_values(tensors):
        index = place.get(id(sharded.data))
        if index is not None:
            found[index] = sharded
    missing = [names[i] for i in ids if i not in found]
    if missing:
        raise ValueError(
            f"MixedPrecisionOptimizer.sharded_state_dict: the model's sharded state dict "
            f"has no sharded tensor whose data is the param {missing[0]!r}"
            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, so its "
            f"optimizer state has no place in the checkpoint. Expected every param the "
            f"optimizer steps, each a ShardedTensor over the param itself (its .data, as "
            f"megatron-core's make_sharded_tensor_for_checkpoint makes them). Fix: pass the "
            f"sharded state dict of the model whose params this optimizer steps.")
    return found


def _sharded_entry(entry: Mapping[str, Any], sharded: Any, name: str) -> dict[str, Any]:
    dc = _dist_checkpointing()
    out: dict[str, Any] = {}
    whole = tuple(sharded.global_shape) == tuple(sharded.local_shape)
    for key, value in entry.items():
        prefix = f"optimizer.state.{key}"
        local = local_tensor(value) if isinstance(value, torch.Tensor) else value
        if isinstance(local, torch.Tensor) and tuple(local.shape) == tuple(
                sharded.local_shape) and local.dim() > 0:
            out[key] = dc.optimizer.make_sharded_optimizer_tensor(sharded, local, prefix=prefix)
        elif whole or not isinstance(local, torch.Tensor) or local.dim() == 0:
            out[key] = dc.mapping.ShardedObject(f"{prefix}.{sharded.key}", local, (1,), (0,),
                                                replica_id=_main_replica(sharded))
        else:
            raise ValueError(
                f"MixedPrecisionOptimizer.sharded_state_dict: the state entry {key!r} of "
                f"param {name!r} has shape {tuple(local.shape)}, neither the param's local "
                f"shape {tuple(sharded.local_shape)} nor a scalar, and the param is split "
                f"over ranks (global shape {tuple(sharded.global_shape)}), so the entry has "
                f"no layout in the model's space. Fix: save this optimizer with "
                f"save_parameter_state() or torch.distributed.checkpoint.")
    return out


def sharded_state_dict(opt: Any, model_sharded_state_dict: Any,
                       metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """``opt.state_dict()`` with each param's entries sharded as the param is."""
    dc = _dist_checkpointing()
    unknown = sorted(set(metadata or {}) - _METADATA)
    if unknown:
        raise ValueError(
            f"MixedPrecisionOptimizer.sharded_state_dict: metadata key {unknown[0]!r} is "
            f"not one megatron-core passes to an optimizer (expected some of "
            f"{sorted(_METADATA)}, which choose among the distributed optimizer's formats; "
            f"the facade saves one format, in the model's space). Fix: leave it out.")
    saved = opt.state_dict()
    named = {id(p): n for p, n in zip(opt._params, opt._names, strict=True)}
    ids: dict[int, torch.Tensor] = {}
    for given, group in zip(saved["param_groups"], opt.param_groups, strict=True):
        ids.update(zip(given["params"], group["params"], strict=True))
    names = {i: named.get(id(p), f"param {i}") for i, p in ids.items()}
    stepped = {i: p for i, p in ids.items() if i in saved["state"]}
    found = _by_param(model_sharded_state_dict, stepped, names)
    state: dict[Any, Any] = {}
    for key, entry in saved["state"].items():
        if key in found and isinstance(entry, Mapping):
            state[key] = _sharded_entry(entry, found[key], names[key])
        else:  # a key a state-dict hook stored: saved once, as the groups' keys
            state[key] = entry
    local = dc.mapping.LocalNonpersistentObject
    groups = []
    for given in saved["param_groups"]:
        group = copy.deepcopy({k: v for k, v in given.items()
                               if k not in ("params", "param_names")})
        group["params"] = local(given["params"])
        if "param_names" in given:
            group["param_names"] = local(given["param_names"])
        groups.append(group)
    out = {k: v for k, v in saved.items() if k not in ("state", "param_groups")}
    out.update(state=state, param_groups=groups)
    return out


def add_prefix(sharded: Any, prefix: str) -> None:
    """Prepend ``prefix`` to the key of every sharded object in ``sharded`` (in place), as
    megatron-core's ``ChainedOptimizer`` keys each optimizer's state apart."""
    _dist_checkpointing().utils.add_prefix_for_sharding(sharded, prefix)
