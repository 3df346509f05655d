"""Megatron-LM's optimizer calls on ``MixedPrecisionOptimizer``.

The methods of megatron-core's ``MegatronOptimizer`` (0.16.1,
``megatron/core/optimizer/optimizer.py``) that its training loop, its pipeline schedules
and its ``ChainedOptimizer`` call: ``scale_loss`` (the schedules' ``grad_scale_func``),
``get_parameters``, ``get_main_grads_for_grad_norm``, ``get_grad_stats_parallel_group``,
and the two halves of a step, ``prepare_grads`` and ``step_with_ready_grads``. A mixin of
the facade: it reads the facade's params, gradients, loss scale and distributed
declarations, and takes steps only through the facade's own ``step()``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import optree
import torch
import torch.distributed as dist

from functopt._collective.agreement import threshold_verdict
from functopt._collective.counting import _counting, _entries
from functopt._collective.dtensor import _leaf_names, local_tensor
from functopt.precision.loss_scale import _inverse
from functopt.precision.master import MasterWeights
from functopt.precision.stats import GradStats
from functopt.precision.step import MixedPrecisionState, check_loss, scale_loss
from functopt.tree import _core

__all__ = ["MegatronSurface"]

_OWNER = "MixedPrecisionOptimizer"
_FROM = f"{_OWNER}.from_optimizer_config"

# OptimizerConfig's fields the builder reads (megatron-core 0.16.1), and those Megatron
# itself reads only under an option the builder refuses or that only check other fields
_READ = frozenset({
    "lr", "min_lr", "weight_decay", "fp16", "bf16", "optimizer", "loss_scale",
    "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis", "adam_beta1",
    "adam_beta2", "adam_eps", "decoupled_weight_decay", "sgd_momentum", "clip_grad",
    "log_num_zeros_in_grad", "grad_norm_skip_threshold", "decoupled_lr", "decoupled_min_lr",
    "apply_wd_to_qk_layernorm"})
_INERT = frozenset({
    "params_dtype", "main_grads_dtype", "main_params_dtype", "exp_avg_dtype",
    "exp_avg_sq_dtype", "store_param_remainders", "optimizer_offload_fraction",
    "use_torch_optimizer_for_cpu_offload", "overlap_cpu_optimizer_d2h_h2d", "pin_cpu_grads",
    "pin_cpu_params", "barrier_with_L1_time", "muon_momentum", "muon_split_qkv",
    "muon_use_nesterov", "muon_scale_mode", "muon_fp32_matmul_prec", "muon_num_ns_steps",
    "muon_tp_mode", "muon_extra_scale_factor"})
_FIXES = {
    "use_distributed_optimizer": "functopt.distributed.zero1 shards the optimizer state",
    "optimizer_cpu_offload": "call offload_to_cpu() / restore_from_cpu() between steps",
    "timers": "functopt's step has no timed phases; set timers=None",
}


def decoupled_records(index: int, book: dict[str, Any]) -> dict[str, Any]:
    """A group's bookkeeping keys with Megatron's decoupled learning rate read: a group
    with ``is_decoupled_lr=True`` and ``decoupled_lr`` (``decoupled_min_lr``) peaks at it
    (ends at it) under Megatron's scheduler, which reads a group's ``max_lr`` and
    ``min_lr`` (megatron-core 0.16.1 builds such groups with those records)."""
    if "decoupled_lr" not in book and "decoupled_min_lr" not in book:
        return book
    where = f"{_OWNER}: param group {index}"
    if book.get("is_decoupled_lr") is not True:
        raise ValueError(
            f"{where} sets decoupled_lr / decoupled_min_lr but not is_decoupled_lr=True, so "
            f"they would change nothing. Fix: is_decoupled_lr=True on the embedding and "
            f"output-layer group they are for, or leave them out.")
    out = dict(book)
    for key, record in (("decoupled_lr", "max_lr"), ("decoupled_min_lr", "min_lr")):
        if key not in book:
            continue
        value = book[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}: {key} must be a number >= 0, got {value!r}.")
        if record in book and book[record] != value:
            raise ValueError(
                f"{where} sets {key}={value!r} and {record}={book[record]!r}; the scheduler "
                f"reads {record}, which {key} sets. Fix: give one of them.")
        out[record] = value
    return out


def check_expert_groups(groups: list[Any], process_group: Any, replicated: Any) -> None:
    """Refuse expert-parallel groups whose gradient statistics nothing sums: their params
    hold other values on each rank, so each rank would clip by its own norm and the ranks'
    dense params would diverge."""
    if process_group is not None or replicated is not None or not (
            dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    for i, group in enumerate(groups):
        if not group.frozen and group.options.get("is_expert_parallel") is True:
            raise ValueError(
                f"{_OWNER}: param group {i} is expert-parallel (is_expert_parallel=True): "
                f"each rank holds other experts, so the global norm and the overflow check "
                f"must sum their statistics over the ranks, and no process_group says over "
                f"which. Fix: pass process_group= (the ranks of one model replica's "
                f"statistics, Megatron's expert tensor x pipeline group with the dense "
                f"model-parallel group: often the default group) and replicated= (each "
                f"param's replication: the dense ones over their data-parallel group, the "
                f"expert ones over their expert data-parallel group).")


class MegatronSurface:
    """Megatron-LM's ``MegatronOptimizer`` methods, over the facade's own state."""

    # the facade's (functopt/adapters/mixed_precision_optimizer.py)
    _params: list[torch.Tensor]
    _names: list[str]
    _distributed: dict[str, Any]
    _agree: tuple[Any, Any]
    _master_weights: MasterWeights
    _state: MixedPrecisionState

    if TYPE_CHECKING:
        def _grads(self) -> list[torch.Tensor | None]: ...

        def _tree(self, leaves: list[Any]) -> Any: ...

        def _stats(self, grads: list[torch.Tensor | None]) -> GradStats: ...

        def step(self, closure: Any = None) -> Any: ...

        def clip_grad_norm(self, *args: Any, **kwargs: Any) -> Any: ...

        def named_state_dict(self) -> dict[str, Any]: ...

        def load_named_state_dict(self, state_dict: dict[str, Any]) -> None: ...

        def _check_train_mode(self, method: str) -> None: ...

    @classmethod
    def from_optimizer_config(cls, megatron_config: Any, params: Any,
                              config_overrides: Any = None, **options: Any) -> Any:
        """The facade Megatron's ``get_megatron_optimizer(config, model_chunks)`` would build.

        ``config`` is a megatron-core ``OptimizerConfig`` (or ``AdamOptimizerConfig``,
        ``SGDOptimizerConfig``; megatron-core 0.16.1's fields). ``params``: a module or a
        list of modules (Megatron's model chunks), whose params that require grad are
        grouped as megatron-core's ``_get_param_groups`` groups them, or any ``params``
        the constructor takes (your groups). The groups of modules: each param takes the
        overrides of every key of ``config_overrides`` (``{ParamKey: ParamGroupOverride}``:
        any key with a ``matches(param, name)`` method, a dict of group fields) that
        matches it, merged (two values for one field raise); params with the same merged
        overrides and the same expert flag (``allreduce=False``: ``is_expert_parallel``)
        share a group, the groups without overrides first. Without ``config_overrides``,
        Megatron's standard ones: ``wd_mult=0`` for biases and 1-D params (with
        ``apply_wd_to_qk_layernorm``, all but the q/k LayerNorms'), and with
        ``decoupled_lr`` its ``max_lr`` (and ``decoupled_min_lr``'s ``min_lr``) for the
        params marked ``is_embedding_or_output_parameter``. What else is read, as
        megatron-core 0.16.1 reads it:

        - ``optimizer="adam"``: ``torch.optim.AdamW`` (``torch.optim.Adam`` with
          ``decoupled_weight_decay=False``) of ``lr``, ``weight_decay``,
          ``(adam_beta1, adam_beta2)``, ``adam_eps``; ``"sgd"``: ``torch.optim.SGD`` of
          ``lr``, ``weight_decay``, ``momentum=sgd_momentum``; translated as
          ``MixedPrecisionOptimizer(torch_optimizer)`` translates them. Each group also
          records ``max_lr=lr`` and ``min_lr`` for Megatron's ``OptimizerParamScheduler``.
        - the loss scale, with ``fp16`` or ``bf16``: ``loss_scale`` set, a static scale;
          otherwise with ``fp16``, ``dynamic_loss_scale(init_scale=initial_loss_scale,
          growth_interval=loss_scale_window, hysteresis=hysteresis,
          min_scale=min_loss_scale)`` (Megatron's ``DynamicGradScaler``); else none.
        - ``clip_grad`` > 0: clipping at every step by Megatron's rule,
          ``clip_grad / (norm + 1e-6)`` ([`NormClip`][functopt.precision.NormClip]).
        - ``log_num_zeros_in_grad``: ``count_zeros``; ``grad_norm_skip_threshold`` where
          the config has it. ``step()`` returns Megatron's ``(ok, grad_norm, num_zeros)``.

        ``options`` go to the constructor (``process_group``, ``replicated``, ``fused``,
        ...; expert params on more than one rank need the first two). A field the facade
        cannot honour with a value other than its default (the distributed optimizer, CPU
        offload, the precision-aware optimizer, fp8, timers, another ``optimizer``)
        raises, naming it and the fix; so does ``decoupled_lr`` beside
        ``config_overrides``, which megatron-core would ignore.

        Raises:
            TypeError: ``config`` is not a dataclass of Megatron's fields, or a key of
                ``config_overrides`` has no ``matches`` method.
            ValueError: a field that cannot be honoured, ``lr`` unset, or two overrides
                of one param that disagree.
        """
        config = megatron_config
        if not dataclasses.is_dataclass(type(config)) or not hasattr(config, "optimizer"):
            raise TypeError(f"{_FROM}: config must be a megatron.core.optimizer."
                            f"OptimizerConfig, got {type(config).__name__}.")
        for field in dataclasses.fields(config):
            if field.name in _READ or field.name in _INERT:
                continue
            value = getattr(config, field.name)
            default = field.default if field.default is not dataclasses.MISSING else (
                field.default_factory() if field.default_factory is not dataclasses.MISSING
                else dataclasses.MISSING)
            if value != default:
                fix = _FIXES.get(field.name, "leave it at its default")
                raise ValueError(f"{_FROM}: config.{field.name}={value!r} is not honoured "
                                 f"by the facade (default {default!r}). Fix: {fix}.")
        if config.lr is None:
            raise ValueError(f"{_FROM}: config.lr is None. Fix: set the learning rate.")
        groups = _megatron_groups(params, config, config_overrides)
        if config.optimizer == "adam":
            adam = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
            torch_optimizer: torch.optim.Optimizer = adam(
                groups, lr=config.lr, weight_decay=config.weight_decay,
                betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
        elif config.optimizer == "sgd":
            torch_optimizer = torch.optim.SGD(groups, lr=config.lr,
                                              weight_decay=config.weight_decay,
                                              momentum=config.sgd_momentum)
        else:
            raise ValueError(f"{_FROM}: config.optimizer={config.optimizer!r} is not one "
                             f"the facade builds (megatron-core builds 'adam' and 'sgd'). "
                             f"Fix: build the facade from your own functopt transform.")
        from functopt.precision.loss_scale import dynamic_loss_scale, static_loss_scale
        from functopt.precision.stats import NormClip

        rule = None
        if config.fp16 or config.bf16:
            if config.loss_scale:
                rule = static_loss_scale(float(config.loss_scale))
            elif config.fp16:
                window = config.loss_scale_window
                if window != int(window):
                    raise ValueError(f"{_FROM}: config.loss_scale_window={window!r} is not a "
                                     f"whole number of steps. Fix: an integer.")
                rule = dynamic_loss_scale(
                    init_scale=float(config.initial_loss_scale), growth_factor=2.0,
                    backoff_factor=0.5, growth_interval=int(window),
                    hysteresis=config.hysteresis, min_scale=float(config.min_loss_scale))
        options.setdefault("count_zeros", bool(config.log_num_zeros_in_grad))
        options.setdefault("return_grad_stats", True)
        threshold = getattr(config, "grad_norm_skip_threshold", None)
        if threshold is not None:
            options.setdefault("grad_norm_skip_threshold", float(threshold))
        build: Any = cls  # (the facade, whose constructor this mixin does not declare)
        facade = build(torch_optimizer, loss_scale=rule, **options)
        if config.clip_grad > 0.0:
            facade.clip_grad_norm(None, NormClip(float(config.clip_grad), eps=1e-6))
        return facade

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale, in ``loss``'s dtype and shape.

        Megatron's pipeline schedules call it as ``config.grad_scale_func`` on each
        micro-batch's loss before running backward themselves, and on ``torch.ones(1)``
        for the MoE auxiliary losses' scale; set ``config.grad_scale_func =
        optimizer.scale_loss``. The product is taken in float32 (float64 for a float64
        loss) and rounded once to ``loss``'s dtype (Megatron's returns its scale's float32
        shape ``[1]``); gradients flow through it as through ``loss * scale``.
        [`backward`][functopt.MixedPrecisionOptimizer.backward] keeps the float32
        product instead, where a float16 loss times ``2**16`` would overflow.

        Raises:
            TypeError: ``loss`` is not a floating-point tensor.
        """
        check_loss(f"{_OWNER}.scale_loss", loss)
        return scale_loss(loss, self._state).to(loss.dtype)

    def save_parameter_state(self, filename: str | os.PathLike[str],
                             group: dist.ProcessGroup | None = None) -> None:
        """Megatron's ``DistributedOptimizer.save_parameter_state``: the optimizer's whole
        state (each param's master and inner state, DTensor shards gathered into whole
        tensors, on the CPU; the shared loss scale and counters; the groups), written to
        ``filename`` by rank 0 of ``group``, the data-parallel group whose ranks hold the
        same state (default: the default process group, when one is initialized). Every
        rank of the params' meshes takes part (each gather is a collective).

        The file is ``named_state_dict()``'s layout with whole tensors:
        [`load_parameter_state`][functopt.MixedPrecisionOptimizer.load_parameter_state]
        loads it on any number of ranks and any sharding, and
        ``load_named_state_dict(torch.load(filename))`` on one process.
        """
        saved = self.named_state_dict()
        state: dict[Any, Any] = {}
        for name, entry in saved["state"].items():
            state[name] = ({k: _whole(v) for k, v in entry.items()}
                           if isinstance(entry, dict) else _whole(entry))
        if _rank_of(group) == 0:
            torch.save({"state": state, "param_groups": saved["param_groups"]}, filename)
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group)

    def load_parameter_state(self, filename: str | os.PathLike[str], *,
                             update_legacy_format: bool = False,
                             group: dist.ProcessGroup | None = None) -> None:
        """Megatron's ``DistributedOptimizer.load_parameter_state``: the state
        [`save_parameter_state`][functopt.MixedPrecisionOptimizer.save_parameter_state]
        wrote, read by rank 0 of ``group`` (the other ranks need not see the file) and
        sent to its ranks tensor by tensor, each laid out as this optimizer's own state
        (a DTensor entry as its shard of the mesh), then loaded as
        ``load_named_state_dict`` loads (params with a master are set from it).

        Raises:
            ValueError: ``update_legacy_format=True``: the file has one format, no legacy
                one to update.
        """
        owner = f"{_OWNER}.load_parameter_state"
        if update_legacy_format:
            raise ValueError(
                f"{owner}: update_legacy_format=True updates Megatron's older file formats; "
                f"save_parameter_state writes one format. Fix: leave it False.")
        distributed = dist.is_available() and dist.is_initialized()
        reader = _rank_of(group) == 0
        loaded: Any = (torch.load(filename, map_location="cpu", weights_only=True) if reader
                       else None)
        template = self.named_state_dict()["state"]
        skeleton: Any
        if distributed:
            described = [_described(loaded) if reader else None]
            dist.broadcast_object_list(described, src=_source(group), group=group)
            skeleton = described[0]
        else:
            skeleton = _described(loaded)
        state: dict[Any, Any] = {}
        for name, entry in skeleton["state"].items():
            like = template.get(name, {})
            if not isinstance(entry, dict):
                state[name] = _received(loaded["state"][name] if reader else None, entry,
                                        None, group, distributed)
                continue
            state[name] = {k: _received(loaded["state"][name][k] if reader else None, v,
                                        like.get(k) if isinstance(like, dict) else None,
                                        group, distributed)
                           for k, v in entry.items()}
        self.load_named_state_dict({"state": state, "param_groups": skeleton["param_groups"]})

    def sharded_state_dict(self, model_sharded_state_dict: Any, is_loading: bool = False,
                           metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Megatron's ``sharded_state_dict``: ``state_dict()`` for megatron-core's
        ``dist_checkpointing``, each param's entries sharded as the model's sharded state
        dict shards the param (functopt/adapters/_megatron_sharded.py says how).

        Save with ``dist_checkpointing.save(optimizer.sharded_state_dict(model_sd), dir)``;
        load with ``optimizer.load_state_dict(dist_checkpointing.load(
        optimizer.sharded_state_dict(model_sd, is_loading=True), dir))``, on any layout
        whose model sharded state dict names the same global tensors. ``is_loading``
        changes nothing: the state it templates exists from construction. ``metadata``
        takes the keys megatron-core passes, which choose among its distributed
        optimizer's formats; the facade has one.

        Raises:
            ValueError: a param the optimizer steps has no sharded tensor in
                ``model_sharded_state_dict``; a state entry of a split param is neither of
                its local shape nor a scalar; an unknown ``metadata`` key.
        """
        from functopt.adapters._megatron_sharded import sharded_state_dict

        return sharded_state_dict(self, model_sharded_state_dict, metadata)

    def reload_model_params(self, state_dict: Mapping[str, Any] | None = None) -> None:
        """Set the master weights from the params, or from a model ``state_dict``.

        Megatron-LM's signature: after loading a model checkpoint into the params, call it
        without arguments to copy the params into the masters. With ``state_dict`` (keyed
        by the param names, as ``model.state_dict()``; other keys such as buffers are not
        read), each master becomes that tensor in the master precision and each param its
        rounding (params without a master copy take the value itself), so a float32
        checkpoint of a bfloat16 model restores the masters without loss. The transform's
        state and the loss scale are kept, as in Megatron.

        Raises:
            ValueError: naming the params the state dict lacks, or a tensor of another
                shape.
        """
        self._check_train_mode("reload_model_params")
        mw = self._master_weights
        if state_dict is None:
            with torch.no_grad():
                master = [mw.init(p.detach()) for p in self._params]
            self._state = self._state._replace(master=self._tree(master))
            return
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{_OWNER}.reload_model_params: state_dict must be a mapping of "
                            f"param names to tensors, got {type(state_dict).__name__}.")
        missing = [name for name in self._names if name not in state_dict]
        if missing:
            raise ValueError(
                f"{_OWNER}.reload_model_params: the state dict has no entry for the params "
                f"{missing[:5]}{' ...' if len(missing) > 5 else ''} (it has "
                f"{sorted(map(str, state_dict))[:5]} ...). Fix: pass model.state_dict() of the "
                f"model whose named_parameters() built this optimizer."
            )
        stores = []
        with torch.no_grad():
            for p, name in zip(self._params, self._names, strict=True):
                value, store = state_dict[name], self._state.master[name]
                if not isinstance(value, torch.Tensor) or value.shape != p.shape:
                    got = (tuple(value.shape) if isinstance(value, torch.Tensor)
                           else type(value).__name__)
                    raise ValueError(
                        f"{_OWNER}.reload_model_params: state dict entry {name!r} is {got}, "
                        f"the param has shape {tuple(p.shape)}. Fix: load the checkpoint of "
                        f"this model.")
                view = mw.view(p.detach(), store)
                new_param, new_store = mw.write(p, store, value.detach().to(
                    dtype=view.dtype, device=view.device, copy=True), None)
                p.copy_(new_param)
                stores.append(new_store)
        self._state = self._state._replace(master=self._tree(stores))

    def get_parameters(self) -> list[torch.Tensor]:
        """The params the step updates, in group order (frozen groups left out, as
        Megatron leaves params that do not require grad out of its groups)."""
        return list(self._params)

    def _counted(self) -> tuple[dist.ProcessGroup | None, list[bool]]:
        """The group the gradient statistics are summed over and, per param (in
        ``_params`` order), whether this rank counts it, as the step decides them."""
        tree = self._tree(list(self._params))
        leaves, treespec = _core.flatten(tree)
        group, counted = _counting(
            f"{_OWNER}.get_main_grads_for_grad_norm", leaves, _leaf_names(treespec),
            self._distributed["process_group"],
            _entries(_OWNER, self._distributed["replicated"], tree, leaves, treespec))
        order = optree.tree_leaves(self._tree(list(range(len(self._params)))))
        mine = [False] * len(self._params)
        for position, index in enumerate(order):
            mine[index] = counted[position]
        return group, mine

    def get_grad_stats_parallel_group(self) -> dist.ProcessGroup:
        """The process group the gradient norm and zero count are summed over.

        The ``process_group`` given at construction, or the group inferred from DTensor
        params (FSDP2); Megatron's model-parallel group.

        Raises:
            ValueError: the statistics are summed over no group (plain tensors without
                ``process_group``: each rank's own), where Megatron's would name the
                model-parallel group.
        """
        group, _ = self._counted()
        if group is None:
            raise ValueError(
                f"{_OWNER}.get_grad_stats_parallel_group: the gradient statistics are "
                f"summed over no process group here (plain tensor params and no "
                f"process_group): each rank's norm is its own. Fix: pass process_group= "
                f"(Megatron's model-parallel group) and replicated= at construction.")
        return group

    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:
        """The unscaled gradients this rank counts in the global norm, as new tensors.

        Megatron's filter, by functopt's declarations: params with a gradient (read from
        ``.decoupled_grad``, ``.main_grad`` or ``.grad``, as the step reads them), each
        counted once over the statistics group (a param ``replicated`` over it on one of
        its ranks only, where Megatron keeps tensor-parallel duplicates on tensor rank 0),
        DTensor gradients as their local shards. Each is divided by the loss scale in
        the step's precision (the masters' dtype or wider), so the sum of their squares
        over ``get_grad_stats_parallel_group()`` is the square of ``get_grad_norm()``.
        """
        _, counted = self._counted()
        inv_scale = _inverse(self._state.loss_scale)
        master = self._master_weights.dtype
        out = []
        with torch.no_grad():
            for p, g, mine in zip(self._params, self._grads(), counted, strict=True):
                if g is None or not mine:
                    continue
                wide = torch.promote_types(p.dtype, master)
                out.append(local_tensor(g).to(wide) * inv_scale.to(g.device, wide))
        return out

    def prepare_grads(self) -> bool:
        """The first half of Megatron's step: True when the current gradients overflowed.

        The overflow verdict of the next ``step()``, agreed as the step agrees it (over
        the statistics group and ``agree_skip``'s ranks). On overflow the skipped step is
        taken here, as Megatron's ``prepare_grads`` updates its loss scale: params,
        masters and the transform's state are left unchanged, the loss scale backs off,
        and the caller must not call ``step_with_ready_grads``. On finite gradients
        nothing changes: clip or inspect them, then call ``step_with_ready_grads()``. The
        verdict costs a statistics pass (and its all-reduce) of its own, beside the one of
        the step that follows; ``step()`` alone makes one.
        """
        _, found = self._verdict()
        if bool(found):
            self.step()
            return True
        return False

    def _verdict(self) -> tuple[GradStats, torch.Tensor]:
        """The statistics of the current gradients and their overflow verdict, agreed as
        the step agrees it."""
        stats = self._stats(self._grads())
        _, found = threshold_verdict(stats.norm, stats.found_inf, math.inf,
                                     self._distributed["process_group"], *self._agree)
        return stats, found

    def step_with_ready_grads(self) -> bool:
        """The second half of Megatron's step: ``step()`` on the current gradients, True
        when it was taken (False only where they overflowed or exceed
        ``grad_norm_skip_threshold``: call ``prepare_grads()`` first)."""
        result = self.step()
        return bool(result[0] if isinstance(result, tuple) else result)


@dataclasses.dataclass(frozen=True)
class _Shape:
    """A tensor of the parameter-state file, described for the ranks that do not read it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _whole(value: Any) -> Any:
    """A state entry's value as saved: a whole tensor on the CPU (a DTensor gathered)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _rank_of(group: dist.ProcessGroup | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def _source(group: dist.ProcessGroup | None) -> int:
    """The global rank of ``group``'s rank 0 (the reader)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def _described(loaded: Any) -> Any:
    """The loaded file with each tensor of its entries replaced by its `_Shape`."""
    def describe(v: Any) -> Any:
        return _Shape(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v

    return {"param_groups": loaded["param_groups"], "state": {
        name: ({k: describe(v) for k, v in entry.items()} if isinstance(entry, dict)
               else describe(entry))
        for name, entry in loaded["state"].items()}}


def _received(value: Any, described: Any, like: Any, group: dist.ProcessGroup | None,
              distributed: bool) -> Any:
    """One value of the file on this rank: a tensor sent from the reader (``value`` there)
    and laid out as ``like``, this optimizer's entry (its DTensor shard, its device); any
    other value as described."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(described, _Shape):
        return described
    device = local_tensor(like).device if isinstance(like, torch.Tensor) else torch.device("cpu")
    if distributed:
        full = (value.to(device) if value is not None
                else torch.empty(described.shape, dtype=described.dtype, device=device))
        dist.broadcast(full, src=_source(group), group=group)
    else:
        full = value.to(device)
    if isinstance(like, DTensor) and tuple(like.shape) == described.shape:
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full


def _standard_overrides(config: Any) -> list[tuple[Any, dict[str, Any]]]:
    """megatron-core 0.16.1's ``get_standard_config_overrides``: (matcher, override)."""
    def no_decay(p: torch.nn.Parameter, name: str) -> bool:
        if config.apply_wd_to_qk_layernorm:
            return (p.ndim == 1 or name.endswith(".bias")) and not (
                "q_layernorm." in name or "k_layernorm." in name)
        return fnmatch.fnmatch(name, "*.bias") or p.ndim == 1

    def decoupled(p: torch.nn.Parameter, name: str) -> bool:
        return bool(getattr(p, "is_embedding_or_output_parameter", False))

    overrides: list[tuple[Any, dict[str, Any]]] = [(no_decay, {"wd_mult": 0.0})]
    if config.decoupled_lr is not None:
        peak = {"max_lr": config.decoupled_lr}
        if config.decoupled_min_lr is not None:
            peak["min_lr"] = config.decoupled_min_lr
        overrides.append((decoupled, peak))
    return overrides


def _given_overrides(config: Any, config_overrides: Any) -> list[tuple[Any, dict[str, Any]]]:
    """The user's ``{ParamKey: ParamGroupOverride}`` as (matcher, override) pairs."""
    if not isinstance(config_overrides, Mapping):
        raise TypeError(f"{_FROM}: config_overrides must be a dict of ParamKey -> "
                        f"ParamGroupOverride (a dict), got {type(config_overrides).__name__}.")
    if config.decoupled_lr is not None or config.decoupled_min_lr is not None:
        raise ValueError(
            f"{_FROM}: config.decoupled_lr / decoupled_min_lr are read only into the "
            f"standard overrides, which config_overrides replaces (megatron-core would "
            f"ignore the fields). Fix: put {{'max_lr': ..., 'min_lr': ...}} under a key of "
            f"your config_overrides, or pass config_overrides=None.")
    pairs = []
    for key, override in config_overrides.items():
        if not callable(getattr(key, "matches", None)):
            raise TypeError(f"{_FROM}: the config_overrides key {key!r} has no "
                            f"matches(param, name) method. Fix: a megatron.core.optimizer."
                            f"ParamKey.")
        if not isinstance(override, Mapping) or "params" in override:
            raise TypeError(f"{_FROM}: the override under {key!r} must be a dict of group "
                            f"fields without 'params', got {override!r}.")
        pairs.append((key.matches, dict(override)))
    return pairs


def _megatron_groups(params: Any, config: Any, config_overrides: Any = None) -> Any:
    """Megatron's param groups of modules (megatron-core 0.16.1's ``_get_param_groups``:
    params keyed by their merged overrides and expert flag, the groups without overrides
    first), each with the records Megatron's scheduler and logging read; any other
    ``params`` as given, those records added to group dicts that lack them."""
    records = {"wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False,
               "max_lr": config.lr, "min_lr": config.min_lr}
    chunks = [params] if isinstance(params, torch.nn.Module) else None
    if chunks is None and isinstance(params, (list, tuple)) and params and all(
            isinstance(m, torch.nn.Module) for m in params):
        chunks = list(params)
    if chunks is None:
        if config_overrides is not None:
            raise ValueError(f"{_FROM}: config_overrides group the params of modules; "
                             f"your own groups carry their fields themselves. Fix: pass "
                             f"the model chunks, or leave config_overrides out.")
        if isinstance(params, (list, tuple)) and params and all(
                isinstance(g, dict) for g in params):
            return [{**records, **g} for g in params]
        return params
    overrides = (_standard_overrides(config) if config_overrides is None
                 else _given_overrides(config, config_overrides))
    keyed: dict[tuple[Any, bool], list[tuple[str, torch.nn.Parameter]]] = {}
    for k, chunk in enumerate(chunks):
        prefix = f"{k}." if len(chunks) > 1 else ""
        for name, p in chunk.named_parameters():
            if not p.requires_grad:
                continue
            merged: dict[str, Any] = {}
            matched = False
            for matches, override in overrides:
                if not matches(p, name):
                    continue
                matched = True
                for field, value in override.items():
                    if field in merged and merged[field] != value:
                        raise ValueError(
                            f"{_FROM}: param {prefix + name!r} matches overrides that set "
                            f"{field} to {merged[field]!r} and to {value!r}. Fix: make "
                            f"the keys of config_overrides agree on it.")
                    merged[field] = value
            override_key = tuple(sorted(merged.items())) if matched else None
            expert = not getattr(p, "allreduce", True)
            keyed.setdefault((override_key, expert), []).append((prefix + name, p))
    groups = []
    for override_key, expert in sorted(keyed, key=lambda k: (k[0] is not None, k[0])):
        override = dict(override_key or ())
        groups.append({"params": keyed[override_key, expert], **records,
                       "is_expert_parallel": expert,
                       "default_config": not any("lr" in f for f in override), **override})
    return groups
