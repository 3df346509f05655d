"""``MixedPrecisionOptimizer``: the stateful facade training stacks call, over the functional step.

LightRFT's ``FSDPadaptOptimizer`` and Megatron-LM's mixed-precision optimizers are objects
that own the parameters, scale the loss in ``backward``, and report whether ``step`` was
taken. This facade has their interface and none of their maths: each ``step()`` gathers
``p.grad`` into a tree keyed by parameter names, runs
[`mixed_precision`][functopt.precision.mixed_precision] on it, and copies the returned
params into the ``nn.Parameter`` objects in place. The state it keeps is that step's state,
so everything the functional step guarantees (bitwise skips, params exactly
``master.to(param.dtype)``) holds here too.
"""

from __future__ import annotations

import datetime
import math
import typing
import weakref
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from functopt import _validate
from functopt._base import GradientTransformation, Params
from functopt._collective.agreement import check_agreement, threshold_verdict
from functopt._collective.counting import Replicated
from functopt._collective.dtensor import local_tensor
from functopt._collective.stats import global_grad_stats
from functopt._spec import Injected, describe
from functopt.adapters import _from_torch, _missing_grads, _param_groups, _state_dict
from functopt.adapters._base import AdapterBase, immutable, lift
from functopt.adapters._facade_groups import (
    _UNSET,
    BOOKKEEPING_KEYS,
    _as_argument,
    _hyper_tensor,
    _Plan,
    _same,
)
from functopt.adapters._megatron import MegatronSurface, check_expert_groups, decoupled_records
from functopt.distributed.offloading import OffloadedState, _restore_target, offload, reload
from functopt.precision.loss_scale import (
    LossScale,
    _describe_rule,
    _inverse,
    _rule_vector,
    _same_rule,
    _warn_if_collapsed,
    dynamic_loss_scale,
)
from functopt.precision.master import float32_master
from functopt.precision.stats import GradStats, NormClip, unpack_grad_stats
from functopt.precision.step import (
    MixedPrecisionState,
    MixedPrecisionTransformation,
    StepMetrics,
    check_loss,
    mixed_precision,
    scale_loss,
)
from functopt.transforms.hyperparams import InjectHyperparamsState
from functopt.transforms.partition import partition
from functopt.tree import _core

__all__ = ["MixedPrecisionOptimizer"]

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

TransformOrFactory = GradientTransformation | Callable[..., GradientTransformation]
"""A transform for every param, or a factory ``(**group_options) -> transform``."""


StepResult = tuple[bool, float | None, int | None]
"""``(ok, grad_norm, num_zeros)``, Megatron-LM's ``step()`` result (``return_grad_stats``)."""


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


class MixedPrecisionOptimizer(MegatronSurface, AdapterBase):
    r"""A LightRFT/Megatron-style mixed-precision optimizer over ``nn.Parameter`` objects.

    The calls of a training loop, and what they do:

    - ``backward(loss)``: ``(loss * scale).backward()`` with the loss in float32
      ([`scale_loss`][functopt.precision.scale_loss]).
    - ``step() -> bool``: one [`mixed_precision`][functopt.precision.mixed_precision] step
      over the params' ``.grad`` (unscale, one statistics pass, loss-scale update, clip,
      ``transform`` on float32 master params, exact write), then
      ``param.copy_(new_param)`` under ``torch.no_grad()``. Returns False when the
      gradients overflowed and the step was skipped (params, master weights and the
      transform's state bitwise unchanged; only the loss scale moved). Reading that
      decision is the step's one host sync.
    - ``zero_grad(set_to_none=True)``: as ``torch.optim``. ``step()`` leaves the gradients
      alone (LightRFT's ``step`` clears them itself; here, as in ``torch.optim`` and
      Megatron, the loop calls ``zero_grad``).

    Params narrower than ``master_dtype`` (bfloat16, float16) get a master copy; after
    every step each such param is bitwise ``master.to(param.dtype)``. Params of
    ``master_dtype`` or wider (float32, float64) have no copy and are updated in their own
    dtype. A param whose
    ``.grad`` is None at ``step()`` is left unchanged, and so is its per-param state, as in
    ``torch.optim`` (a counter shared by all params, such as Adam's ``count``, still
    advances; built from a torch.optim optimizer whose rule reads that count per param, a
    step where a param that missed earlier steps has a gradient raises, naming it). A
    ``step()`` where no param has a gradient is an error: ``backward`` was
    not called, or the gradients were cleared before the step.

    The transform's state is built once, by the constructor, from the params as they are
    then. ``step()`` writes the params in place, so a state tensor that shares memory with
    a param (a transform keeping the params it was initialised with) is copied at that
    point; a transform must not keep the params it is handed in later updates.

    **Param groups.** ``params`` may be an iterable of tensors (named ``'0'``, ``'1'``, ...
    by position, as ``torch.optim`` numbers them), ``model.named_parameters()`` or a
    ``{name: param}`` dict (named by those names, the keys of the state dict), or a list
    of group dicts ``{"params": ..., **options}`` (``"params"`` in any of the forms before;
    ``"param_names"`` may name a list of tensors). Group options configure the transform:
    when a group sets options, ``transform`` must be a factory, called once per group as
    ``transform(**options)``, and the groups' transforms are combined with
    [`partition`][functopt.partition] (one shared loss scale, skip decision and clipping
    norm, as Megatron's ``ChainedOptimizer``). For example, no weight decay on biases:
    ``[{"params": weights}, {"params": biases, "weight_decay": 0.0}]`` with
    ``transform=lambda weight_decay=0.1: functopt.adamw(1e-3, weight_decay=weight_decay)``.
    **A torch.optim.Optimizer.** The facade is one, so it goes where an optimizer goes
    (torch's schedulers, Lightning's ``configure_optimizers``, accelerate's ``prepare``).
    ``param_groups`` are plain dicts holding each group's params and its transform's
    arguments under torch's names (``lr`` for ``learning_rate``, ``betas`` for ``b1, b2``,
    a recipe's others by ``functopt.Optimizer``'s table, ``alpha`` for RMSprop's
    ``decay``, ...), and a value written there is used by the next ``step()``:
    an argument that ``inject_hyperparams`` put in the state (a plain recipe, which runs
    as ``inject_hyperparams`` of itself as in ``functopt.Optimizer``, so that
    ``functopt.adamw(1e-3)``'s groups hold ``lr``, ``betas``, ``eps``, ``eps_root`` and
    ``weight_decay``; a transform built by
    [`inject_hyperparams`][functopt.inject_hyperparams], a factory that returns one, or a
    translated torch optimizer) is written into the state, a 0-d tensor, so nothing is
    rebuilt; any other argument of a factory rebuilds that group's transform (the state
    is kept; an edit that changes the state's layout, such as ``amsgrad`` or a momentum
    from 0, raises, checked on meta tensors). A rebuild re-plans the fused step (measured: 5-8 ms more per step for 20
    leaves), so for a value a scheduler writes at every step pass
    ``functopt.inject_hyperparams(factory)`` as the factory. A fixed ``transform`` of
    your own that does not inject (a ``chain``) has no hyperparameters in the groups, and
    a group that sets any raises. With several groups, a fixed transform that injects
    (a plain recipe too) gets one state per group, through ``partition``, so each group's
    values are its own. A key that no transform reads raises at construction and at
    ``step()`` (``momentum`` on an AdamW), except the records of torch's schedulers (``initial_lr``, ...) and of
    Megatron's groups (``max_lr``, ``min_lr``, ...): ``BOOKKEEPING_KEYS``. Of those,
    Megatron's ``decoupled_lr`` / ``decoupled_min_lr`` (with ``is_decoupled_lr=True``)
    become the group's ``max_lr`` / ``min_lr``, which Megatron's scheduler reads
    (``is_decoupled_lr=True`` without either of them or a ``max_lr`` raises, and so do
    flags that are not bools); a group
    with ``is_expert_parallel=True`` on more than one rank needs ``process_group`` and
    ``replicated`` (its params differ from rank to rank, so their statistics must be
    summed), else the constructor raises.
    ``add_param_group`` after construction raises: master copies and state are made
    then.

    **From a torch.optim optimizer.** ``MixedPrecisionOptimizer(torch.optim.AdamW(
    model.parameters(), lr=1e-4), ...)`` (LightRFT's ``FSDPadaptOptimizer`` form) reads the
    optimizer's param groups and picks the chain of the same numerics for ``Adam``,
    ``AdamW``, ``SGD``, ``RMSprop`` and ``Adagrad`` (and ``functopt.optim``'s classes of
    those names; ``functopt/optim/_chains.py``), injected, so that every group's numeric
    options (``lr``, ``betas``, ``eps``, ``weight_decay``, ``momentum``, ...) are in
    ``param_groups``; RMSprop and Adagrad have no fused kernel (the step says so with a
    ``FastPathWarning``; ``fused=False`` runs the pure path without it); any other class, an optimizer that has already stepped, or a group
    key the translation does not read raises. Params keep the torch optimizer's
    ``param_names``, else are numbered; its groups' ``lr_mult`` and ``wd_mult`` are read
    as below.

    Three group options are read by the optimizer itself, not passed to the factory:

    - ``lr_mult`` and ``wd_mult`` (numbers $\ge 0$, default 1; Megatron's names) act
      once, at construction: the group's ``lr`` becomes ``lr * lr_mult`` and its
      ``weight_decay`` ``weight_decay * wd_mult`` (the group's own values, else the
      factory's defaults or the recipe's; a schedule is multiplied at every step), and so
      do the lrs a scheduler computes the group's lr from (``initial_lr``, ``max_lr``,
      ``min_lr``). From then on a group's ``lr`` and ``weight_decay`` are what its step
      uses, as in ``torch.optim`` and in the torch optimizer megatron-core steps; the
      multipliers stay in the group as records (Megatron's scheduler reads ``wd_mult``,
      its checkpoints match groups by both), and changing one later raises (write ``lr``
      / ``weight_decay`` instead). So ``torch.optim.lr_scheduler`` anneals each group from
      its own product, as torch's groups of those lrs; megatron-core 0.16.1's
      ``OptimizerParamScheduler``, which writes ``lr`` from the group's ``max_lr`` /
      ``min_lr`` and never reads ``lr_mult``, and writes ``weight_decay`` times
      ``wd_mult``, gives every group the values megatron-core's optimizer would use, a
      group with ``lr_mult`` those of megatron-core's group whose ``max_lr`` / ``min_lr``
      are the products (tests/test_megatron_surface.py). A scheduler that writes a
      group's lr from numbers of its own (OneCycleLR's ``max_lr``, Megatron's scheduler
      for a group without ``max_lr`` / ``min_lr``) sets it, multiplier or not, as in
      ``torch.optim``. A multiplier other than 1 needs the option: a factory with that
      argument, or a transform that injects it.
    - ``frozen=True``: the group's params are left out of the step altogether: they get
      no state (no master copy, no transform state, no entry in ``state_dict()``), are
      never written, even if they have gradients, and their gradients count neither in
      the global norm (clipping, ``get_grad_norm()``) nor in the overflow decision, as if
      the params were not passed (Megatron leaves params with ``requires_grad=False`` out
      of its groups). They need not require grad; ``zero_grad`` clears their gradients,
      as ``torch.optim`` does for every param of its groups. ``lr_mult=0`` is not the
      same: such a group keeps its state, and its gradients still count.

    **Clipping.** ``clip_grad_norm(model, max_norm)`` (LightRFT's signature) sets the
    global L2 norm the *following* ``step()`` calls clip the unscaled gradients to
    (``max_norm=0`` or None: no clipping, the initial setting); the step computes the
    norm in its single statistics pass, so clipping costs no extra reduction. It returns
    None. A number clips by [`clip_by_global_norm`][functopt.clip_by_global_norm]'s rule,
    $g \cdot c / \|g\|$ when $\|g\| > c$; ``NormClip(c, eps=1e-6)`` by LightRFT's,
    $g / \max(1, (\|g\| + 10^{-6}) / c)$. LightRFT's own step always clips at 1.0 by that
    rule; [`functopt.lightrft.FSDPadaptOptimizer`][functopt.lightrft.FSDPadaptOptimizer]
    keeps it on by default. ``clip_grad_norm(clip_grad)`` (one number: Megatron's
    signature) clips the current gradients now, by Megatron's rule, and returns their norm.

    **Megatron-LM's surface.** ``get_grad_norm()`` is the norm of the current gradients
    (the last step's when they are unchanged since); ``grad_norm_skip_threshold``
    skips a step whose norm exceeds it (counted in ``metrics.skipped_steps`` like an
    overflow); ``return_grad_stats=True`` makes ``step()`` return Megatron's
    ``(ok, grad_norm, num_zeros)``; ``reload_model_params(state_dict=None)``; a param's
    ``.decoupled_grad`` (Megatron's precision-aware optimizer) or ``.main_grad`` (its
    float32 accumulation buffer) is read instead of its ``.grad`` when it has one;
    ``scale_loss(loss)`` for the pipeline schedules' ``grad_scale_func`` (the loss's
    dtype kept); ``get_parameters()``, ``get_main_grads_for_grad_norm()``,
    ``get_grad_stats_parallel_group()``, and a step in Megatron's two halves,
    ``prepare_grads()`` (the agreed overflow verdict; an overflowed step is skipped there)
    and ``step_with_ready_grads()``; and ``from_optimizer_config(config, model)``, the
    facade Megatron's ``get_megatron_optimizer`` builds from an ``OptimizerConfig``
    (functopt/adapters/_megatron.py).

    **Schedule-free.** With a ``schedule_free`` transform
    ([`schedule_free_adamw`][functopt.contrib.schedule_free_adamw], ...), ``eval()`` puts
    the averaged iterate into the params and ``train()`` restores the training params
    bitwise, as the schedulefree package's optimizers do.

    **Checkpoints.** ``state_dict()`` returns the step's state in torch's layout,
    through the codec ``functopt.Optimizer`` uses too: each param's entry maps state
    paths to its tensors (``'master'``, ``'inner_state.0.mu'``) and holds the leaves all
    params share (loss scale and its counters, the last step's metrics, the step key);
    each group holds its values and, under ``"functopt"``, the configuration the state
    needs (recipe, loss-scale rule, master dtype). ``named_state_dict()`` keys it by
    param names. It loads with ``torch.load(weights_only=True)``, into DCP as a
    ``Stateful``, and through ``torch.distributed.checkpoint.state_dict``'s
    ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (``optimizer.state`` is
    a view of the state, so they take no initialising step). ``load_state_dict`` matches
    entries by param name and refuses a checkpoint saved under another loss-scale rule,
    recipe or master dtype, naming it; a checkpoint in the nested format of before still
    loads, and so does one of a plain recipe from before it was run as
    ``inject_hyperparams`` of itself (its state moves under the injected state; see
    ``_state_dict.relocated``). The clipping norm is not in it: build the optimizer the same way (and call
    ``clip_grad_norm`` again), then ``load_state_dict``; it continues bitwise as the
    original would have. Loading also sets each param that has a master copy to
    ``master.to(param.dtype)`` (as LightRFT does), so loading the optimizer alone
    restores the low-precision weights as well.

    **Host syncs.** ``step()`` reads its skip decision (one bool), and on a skipped step
    with a dynamic scale the scale too, to warn with a
    [`LossScaleWarning`][functopt.precision.LossScaleWarning] when it has collapsed (below
    float32's smallest normal number, on its way to 0.0); ``loss_scale`` reads the scale
    as a Python float. A finite ``grad_norm_skip_threshold`` adds two reads per step (the
    norm's finiteness and its value; with an agreement and no ``process_group`` spanning
    it, one all-reduce of its verdict too), ``return_grad_stats=True`` the norm and the zero
    count (Megatron's Python numbers), and Megatron's ``clip_grad_norm(clip_grad)`` the
    norm. Nothing else syncs: ``backward`` multiplies by the scale tensor, and
    ``get_loss_scale()``, ``get_grad_norm()`` and ``count_zeros()`` return 0-d tensors.

    **Distributed.** The ranks never diverge on a skip: whenever ``torch.distributed`` is
    initialized, the overflow verdict is agreed over the default process group
    (``agree_skip=True``), as ``ShardedGradScaler`` agrees its ``found_inf``, so a nan on
    one rank skips the step and moves the loss scale on every rank. Only the verdict is
    agreed, never the norm (DDP's gradients are the same on every rank: their squares are
    not summed over it). With FSDP2 params over all the ranks it travels in the step's one
    all-reduce of the statistics; with plain tensors it is one all-reduce of one float64
    per step. ``process_group`` and ``replicated`` are
    [`mixed_precision`][functopt.precision.mixed_precision]'s: for Megatron-style
    tensor-parallel slices (plain tensors), ``process_group`` sums the norm and the
    non-finite count over the ranks holding the slices and ``replicated`` says which
    params every rank of it holds whole, so the norm, the clipping and the skip are those
    of one process holding the whole tensors. An optimizer that steps on some ranks only
    (an RLHF actor and critic stepping at different times) passes ``agree_skip=`` the
    group of its ranks, or ``False``; a rank that does not reach the agreement within
    ``agree_timeout`` makes the others raise, naming the likely cause.

    Args:
        params: the parameters to optimize (see *Param groups*). Each must be a
            floating-point leaf tensor that requires grad. Or a ``torch.optim`` optimizer
            (then without ``transform``), translated into the matching chain.
        transform: the update rule, e.g. ``functopt.adamw(1e-3)``, without clipping of its
            own (use ``clip_grad_norm``); or a factory ``(**group_options) -> transform``.
        loss_scale: the loss-scale rule: ``dynamic_loss_scale()`` (the default:
            PyTorch's ``GradScaler`` rule; ``hysteresis=2, min_scale=1.0`` for Megatron's),
            ``static_loss_scale(s)`` (LightRFT's ``FSDPadaptOptimizer``: 1.0), or None for
            no scaling (usual for bfloat16).
        master_dtype: the precision of the master copy and of the update maths.
        fused: run the planner's fused kernels where the transform has them (see ``fused`` in
            [`mixed_precision`][functopt.precision.mixed_precision]); the step then also
            updates masters and moments in place. False keeps the pure path, which is
            bitwise independent of how FSDP2 shards the params.
        count_zeros: count the zero gradient elements at every step (``count_zeros()``;
            one more read of the gradients). Off by default, as in Megatron-LM:
            ``count_zeros()`` then returns -1.
        grad_norm_skip_threshold: skip steps whose gradient norm exceeds it (Megatron's
            option; ``inf``, the default, never skips).
        return_grad_stats: ``step()`` returns ``(ok, grad_norm, num_zeros)`` as
            Megatron-LM's does, instead of ``ok``.
        compile: the compiled mixed step (``mixed_precision(..., compile=True)``): the
            elementwise rules (Lion, NAdam, ..., and Adam, AdamW and SGD instead of their
            kernels) run as one ``torch.compile``\ d call per group of params, which
            also writes the params. Those groups' params and gradients are
            moved at
            construction into one buffer per group (``param.data`` and ``param.grad``
            become views, as Megatron-LM's contiguous buffers; the module keeps working),
            and ``zero_grad()`` then zeroes the gradients in place by default, so that
            backward keeps accumulating into the buffer (``zero_grad(set_to_none=True)``
            still sets them to None; the step then gathers the new ones, correct and
            slower). The first step compiles (seconds).
        process_group: the ranks the gradient statistics (norm, non-finite count, zero
            count) are summed over, as in ``mixed_precision``; None infers it from DTensor
            params (FSDP2), plain tensors are then not summed.
        replicated: how plain tensor params repeat over the ranks of the group, as in
            ``mixed_precision`` (True: every rank holds the same values, counted once;
            False: each rank's own part; a group, or a pytree keyed by param names).
        agree_skip: where the skip decision is agreed (see *Distributed*): True, over the
            default process group when one is initialized; a ``ProcessGroup``, over its
            ranks; False, only where the statistics are summed, each rank deciding alone
            otherwise.
        agree_timeout: how long the agreement waits for the other ranks, in seconds or a
            ``datetime.timedelta`` (default 600 s); passing it with ``agree_skip=False``
            raises.

    Raises:
        TypeError: for a malformed ``params`` or ``transform``, or naming a param of a
            non-floating dtype (integer, bool, complex).
        ValueError: naming a param that does not require grad, is not a leaf, or appears
            twice; or for an empty ``params``.

    Examples:
        >>> import torch, functopt
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(2, 1).to(torch.bfloat16)
        >>> opt = functopt.MixedPrecisionOptimizer(model.named_parameters(),
        ...                                        functopt.adamw(1e-2))
        >>> x = torch.ones(4, 2, dtype=torch.bfloat16)
        >>> opt.backward(model(x).float().pow(2).mean())
        >>> opt.step()
        True
        >>> opt.zero_grad()
        >>> opt.loss_scale
        65536.0
        >>> state = opt.named_state_dict()["state"]  # each param's entry, by name
        >>> sorted(state)
        ['bias', 'weight']
        >>> torch.equal(model.weight, state["weight"]["master"].to(torch.bfloat16))
        True

        Per-group multipliers and a frozen group (one global norm and one skip decision
        for the groups that are not frozen):

        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> opt = functopt.MixedPrecisionOptimizer(
        ...     [{"params": net[0].named_parameters(prefix="0"), "frozen": True},
        ...      {"params": [("1.weight", net[1].weight)], "wd_mult": 0.5},
        ...      {"params": [("1.bias", net[1].bias)], "lr_mult": 2.0, "wd_mult": 0.0}],
        ...     lambda learning_rate=1e-2, weight_decay=0.1: functopt.adamw(
        ...         learning_rate, weight_decay=weight_decay),
        ...     loss_scale=None)
        >>> net(torch.ones(3, 2)).pow(2).mean().backward()
        >>> before = net[0].weight.clone()
        >>> opt.step()
        True
        >>> torch.equal(net[0].weight, before)
        True
        >>> state = opt.named_state_dict()["state"]
        >>> state["0.weight"], [k for k in state["1.bias"] if k.endswith("mu")]  # none: frozen
        ({}, ['inner_state.inner_states.2.0.mu'])

        From a torch optimizer (LightRFT's form), driven by a torch scheduler:

        >>> model = torch.nn.Linear(2, 1).to(torch.bfloat16)
        >>> opt = functopt.MixedPrecisionOptimizer(
        ...     torch.optim.AdamW(model.parameters(), lr=1e-2), loss_scale=None)
        >>> isinstance(opt, torch.optim.Optimizer), opt.param_groups[0]["weight_decay"]
        (True, 0.01)
        >>> scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        >>> model(torch.ones(3, 2, dtype=torch.bfloat16)).float().sum().backward()
        >>> opt.step()
        True
        >>> scheduler.step()
        >>> opt.param_groups[0]["lr"]  # the next step uses it
        0.005
    """

    _owner = _OWNER
    _constructing = False
    # the step without the clip of clip_grad_norm (a ChainedOptimizer's), and the clipped
    # step it was built beside
    _unclipped: tuple[MixedPrecisionTransformation, MixedPrecisionTransformation] | None = None

    def __init__(
        self,
        params: Any,
        transform: TransformOrFactory | None = None,
        *,
        # A LossScale is immutable (two pure functions), so one default can be shared.
        loss_scale: LossScale | None = dynamic_loss_scale(),  # noqa: B008
        master_dtype: torch.dtype = torch.float32,
        fused: bool = True,
        count_zeros: bool = False,
        grad_norm_skip_threshold: float = math.inf,
        return_grad_stats: bool = False,
        compile: bool = False,
        process_group: dist.ProcessGroup | None = None,
        replicated: Replicated = None,
        agree_skip: bool | dist.ProcessGroup = True,
        agree_timeout: float | datetime.timedelta | None = None,
    ) -> None:
        if not isinstance(master_dtype, torch.dtype) or not master_dtype.is_floating_point:
            raise TypeError(
                f"{_OWNER}: master_dtype must be a floating torch.dtype (torch.float32 or "
                f"torch.float64), got {master_dtype!r}."
            )
        if loss_scale is not None and not isinstance(loss_scale, LossScale):
            raise TypeError(
                f"{_OWNER}: loss_scale must be a functopt.LossScale (from "
                f"functopt.dynamic_loss_scale() or functopt.static_loss_scale(...)) or None, "
                f"got {type(loss_scale).__name__}."
            )
        factories: list[Any] | None = None
        torch_source = None
        if isinstance(params, torch.optim.Optimizer):
            if transform is not None:
                raise TypeError(
                    f"{_OWNER}: got a {type(params).__name__} optimizer and a transform; the "
                    f"optimizer's class and param groups already give the update rule. Fix: "
                    f"pass one of them, MixedPrecisionOptimizer(torch_optimizer, ...) or "
                    f"MixedPrecisionOptimizer(params, transform, ...)."
                )
            torch_source = params  # (its rule's per-param step counts: _missing_grads)
            translated = _from_torch.translate(_OWNER, params, BOOKKEEPING_KEYS)
            params = [spec for spec, _ in translated]
            factories = [factory for _, factory in translated]
        elif transform is None:
            raise TypeError(
                f"{_OWNER}: expected a transform after the params (functopt.adamw(1e-3), or "
                f"a factory (**group_options) -> transform), or a torch.optim optimizer in "
                f"place of both: MixedPrecisionOptimizer(torch.optim.AdamW("
                f"model.parameters(), lr=1e-4))."
            )
        elif not isinstance(transform, GradientTransformation) and not callable(transform):
            raise TypeError(
                f"{_OWNER}: transform must be a functopt.GradientTransformation (e.g. "
                f"functopt.adamw(1e-3)) or a factory (**group_options) -> GradientTransformation, "
                f"got {type(transform).__name__}."
            )
        _validate.check_flags(_OWNER, fused=fused, count_zeros=count_zeros,
                              return_grad_stats=return_grad_stats, compile=compile)
        self._agree = (agree_skip, check_agreement(_OWNER, agree_skip, agree_timeout))
        self._distributed = dict(process_group=process_group, replicated=replicated,
                                 agree_skip=agree_skip, agree_timeout=agree_timeout)
        self._compile = compile
        self.grad_norm_skip_threshold = grad_norm_skip_threshold
        self._return_grad_stats = return_grad_stats
        groups = _param_groups.collect(_OWNER, params)
        check_expert_groups(groups, process_group, replicated)
        if all(group.frozen for group in groups):
            raise ValueError(
                f"{_OWNER}: every param group is frozen, so there is nothing to optimize. "
                f"Fix: leave at least one group unfrozen (frozen=False, the default)."
            )
        # A plain recipe runs as inject_hyperparams of itself (as in functopt.Optimizer), so
        # that its hyperparameters are in param_groups, where schedulers write them.
        fixed = lift(transform) if isinstance(transform, GradientTransformation) else None
        self._fixed = fixed
        self._lifted = fixed is not None and fixed is not transform
        # the recipe as given (checkpoints from before the lift hold its state)
        self._plain = transform if self._lifted and isinstance(
            transform, GradientTransformation) else None
        self._fixed_injected = fixed is not None and isinstance(describe(fixed), Injected)
        self._plans: list[_Plan] = []
        kept: list[dict[str, Any]] = []  # each group's bookkeeping keys
        for i, group in enumerate(groups):
            _param_groups.check_megatron_flags(_OWNER, f"param_groups[{i}]", group.options)
            options = {k: v for k, v in group.options.items() if k not in BOOKKEEPING_KEYS}
            book = decoupled_records(i, {k: v for k, v in group.options.items()
                                         if k in BOOKKEEPING_KEYS})
            kept.append({**book, **_param_groups.scaled_lr_records(group.lr_mult, book)})
            factory = factories[i] if factories is not None else (
                None if fixed is not None else transform)
            if fixed is not None and not group.frozen and not self._fixed_injected:
                mults = {k: v for k, v in (("lr_mult", group.lr_mult),
                                           ("wd_mult", group.wd_mult)) if v != 1.0}
                if options or mults:
                    raise TypeError(
                        f"{_OWNER}: param group {i} sets {sorted(options) + sorted(mults)}, "
                        f"but transform is a GradientTransformation, whose hyperparameters "
                        f"are fixed when it is built. Fix: pass a factory that builds each "
                        f"group's transform from its options, e.g. transform=lambda "
                        f"learning_rate=1e-3, weight_decay=0.01: functopt.adamw("
                        f"learning_rate, weight_decay=weight_decay), or inject them: "
                        f"functopt.inject_hyperparams(functopt.adamw)(learning_rate=1e-3)."
                    )
            if factory is None:  # named once the state shows what the transform injects
                self._plans.append(_Plan(i, group, None, {}))
                self._plans[-1].pending = options
            else:
                self._plans.append(_Plan(i, group, factory, _as_argument(factory, i, options)))
        # Frozen params stay out of the step: no state, no master copy, no statistics.
        trainable = [group for group in groups if not group.frozen]
        self._names = [name for group in trainable for name in group.names]
        self._params = [p for group in trainable for p in group.params]
        self._missed = (None if torch_source is None
                        else _missing_grads.TorchCounts(torch_source, self._params))
        self._labels = {name: i for i, group in enumerate(groups) if not group.frozen
                        for name in group.names}
        self._frozen = [p for group in groups if group.frozen for p in group.params]
        self._partitioned = False
        self._inner = self._compose()
        self._loss_scale_rule = loss_scale
        self._master_weights = float32_master(master_dtype)
        self._fused = fused
        self._count_zeros = count_zeros
        self._max_grad_norm: float | NormClip | None = None
        self._tx = self._build()
        if compile:  # each compiled group's params and gradients in one buffer
            self._tx.lay_out(self._tree(list(self._params)))
        with torch.no_grad():
            state = self._tx.init(self._tree([p.detach() for p in self._params]))
        self._state = _unaliased(state, self._params)
        self._state_shared = False  # state_dict() handed the live tensors out
        # offload_to_cpu: the state held on the host, and the host buffers kept for reuse
        self._offloaded: OffloadedState | None = None
        self._offload_buffers: tuple[Any, ...] | None = None
        # the gradients the last step read, to tell whether get_grad_norm() may reuse its norm
        self._last_grads: list[tuple[Any, int] | None] = []
        torch_groups = []
        for plan, group, book in zip(self._plans, groups, kept, strict=True):
            if not plan.frozen:
                found = self._group_state(self._state, plan.index)
                hyper = found.hyperparams if isinstance(found, InjectHyperparamsState) else None
                signature = None if plan.factory is not None or hyper is None else \
                    _state_dict.recipe_signature(plan.transform, hyper)
                plan.expose(hyper, None if signature is None else signature.split("(", 1)[0])
                if plan.factory is None:  # its groups' options: the keys it exposes
                    where = f"param_groups[{plan.index}]"
                    _param_groups.check_group_keys(_OWNER, where, plan.pending, plan.keys,
                                                   plan.keys, plan.recipe)
                    plan.built.update(_param_groups.group_arguments(_OWNER, where, plan.keys,
                                                                    plan.pending))
                    _param_groups.check_multipliers(
                        _OWNER, f"param_groups[{plan.index}]", _param_groups.GroupFlags(
                            group.lr_mult, group.wd_mult, group.frozen), plan.injected)
                    plan.fold(plan.injected)
            flags = {k: v for k, v in (("lr_mult", group.lr_mult), ("wd_mult", group.wd_mult),
                                       ("frozen", group.frozen))
                     if v != (k != "frozen" and 1.0)}
            torch_groups.append({"params": list(zip(group.names, group.params, strict=True)),
                                 **self._group_values(plan), **flags, **book})
        first = next(plan for plan in self._plans if not plan.frozen)
        self._constructing = True
        try:  # torch's checks and layout; frozen groups get the first group's values
            super().__init__(torch_groups, defaults=self._group_values(first))
        finally:
            self._constructing = False

    # -- param groups -------------------------------------------------------------------

    def _add_group(self, group: dict[str, Any]) -> None:
        if not self._constructing:
            raise TypeError(
                f"{_OWNER}.add_param_group: the param groups are fixed when the optimizer is "
                f"built (their master copies, state and the partition of the transform are "
                f"made then). Fix: build the optimizer with all its groups."
            )
        torch.optim.Optimizer.add_param_group(self, group)

    @property
    def grad_norm_skip_threshold(self) -> float:
        """Skip the step when the global norm of the unscaled gradients exceeds this.

        Megatron-LM's ``OptimizerConfig.grad_norm_skip_threshold`` (default ``inf``: off).
        A step skipped for it leaves params, masters and the transform's state bitwise
        unchanged, counts in ``metrics.skipped_steps`` like an overflow, and moves the loss
        scale as a finite step does (Megatron updates its scaler before the check). A
        finite threshold costs one more statistics pass over the gradients per step.
        """
        return self._skip_threshold

    @grad_norm_skip_threshold.setter
    def grad_norm_skip_threshold(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(
                f"{_OWNER}: grad_norm_skip_threshold must be a Python number > 0 (math.inf "
                f"switches it off), got {value!r}."
            )
        self._skip_threshold = float(value)

    def _compose(self) -> GradientTransformation:
        """The transform over the trainable params: one per group through ``partition``."""
        plans = [plan for plan in self._plans if not plan.frozen]
        if self._fixed is not None:
            for plan in plans:
                plan.transform = self._fixed
            if len(plans) == 1 or not self._fixed_injected:
                self._partitioned = False
                return self._fixed
            transforms: dict[Hashable, GradientTransformation] = {
                plan.index: self._fixed for plan in plans}
        else:
            transforms = {plan.index: plan.build() for plan in plans}
            if len(transforms) == 1:
                self._partitioned = False
                return next(iter(transforms.values()))
        self._partitioned = True
        return partition(transforms, self._labels)

    def _group_state(self, state: MixedPrecisionState, index: int) -> Any:
        inner = state.inner_state
        return inner.inner_states[index] if self._partitioned else inner

    def _with_group_state(self, state: MixedPrecisionState, index: int,
                          group_state: Any) -> MixedPrecisionState:
        inner = state.inner_state
        if self._partitioned:
            inner = inner._replace(inner_states={**inner.inner_states, index: group_state})
        else:
            inner = group_state
        return state._replace(inner_state=inner)

    def _group_values(self, plan: _Plan) -> dict[str, Any]:
        """The group keys of ``plan`` and their values (torch's names)."""
        out: dict[str, Any] = {}
        for key, names in plan.keys.items():
            values = []
            for name in names:
                if name in plan.built:
                    values.append(plan.built[name])
                else:  # an injected value the constructor was not given: as built
                    held = plan.injected[name]
                    values.append(held if held.requires_grad else held.item())
            out[key] = values[0] if len(values) == 1 else tuple(values)
        return out

    def _sync(self) -> None:
        """Bring the group values into the step: write injected ones into the state,
        rebuild the transform of a group whose other values changed; raise on keys no
        transform reads. Groups holding the very values of the last sync, none of them
        mutable, have nothing to bring (the usual step: read in one pass)."""
        seen = self.__dict__.get("_synced")
        if seen is not None and len(seen) == len(self.param_groups) and all(
                len(group) == len(items) and all(
                    key == k and value is v for (key, value), (k, v) in zip(
                        group.items(), items, strict=True))
                for group, items in zip(self.param_groups, seen, strict=True)):
            return
        self._synced = None
        self._sync_groups()
        snapshot = [tuple(group.items()) for group in self.param_groups]
        if all(immutable(v) for items in snapshot for k, v in items
               if k not in ("params", "param_names")):
            self._synced = snapshot

    def _sync_groups(self) -> None:
        state = self._state
        rebuild = False
        before = [dict(plan.built) for plan in self._plans]
        for plan, group in zip(self._plans, self.param_groups, strict=True):
            if not plan.frozen:  # (before any group's values are written)
                where = f"param_groups[{plan.index}]"
                _param_groups.check_unchanged_multipliers(
                    _OWNER, where, _param_groups.group_flags(_OWNER, where, group), plan.mults)
        for plan, group in zip(self._plans, self.param_groups, strict=True):
            where = f"param_groups[{plan.index}]"
            flags = _param_groups.group_flags(_OWNER, where, group)
            if flags.frozen != plan.frozen:
                raise ValueError(
                    f"{_OWNER}: {where} changed frozen to {flags.frozen}; which params a step "
                    f"updates is fixed when the optimizer is built (their state is made then). "
                    f"Fix: build a new optimizer with the groups frozen as wanted."
                )
            if plan.frozen:
                continue
            readable = plan.readable()
            if not plan.allowed.issuperset(group):
                plan.check_keys(_OWNER, where, group)
            values = _param_groups.group_arguments(
                _OWNER, where, plan.keys, {k: group[k] for k in group if k in readable})
            found = None
            for name, value in values.items():
                if name in plan.injected:
                    if not _same(plan.written.get(name, _UNSET), value):
                        found = self._group_state(state, plan.index) if found is None else found
                        found = found._replace(hyperparams={
                            **found.hyperparams,
                            name: _hyper_tensor(where, name, value, plan.injected[name])})
                        plan.written[name] = value
                    plan.built[name] = value
                elif not _same(plan.built.get(name, _UNSET), value):
                    plan.built[name] = value
                    rebuild = True
            if found is not None:
                state = self._with_group_state(state, plan.index, found)
        if rebuild:
            inner = self._compose()
            if self._changes_layout(inner):
                changed = sorted({
                    f"param_groups[{plan.index}][{k!r}]"
                    for plan, built in zip(self._plans, before, strict=True)
                    for k in plan.built if not _same(built.get(k, _UNSET), plan.built[k])})
                for plan, built in zip(self._plans, before, strict=True):
                    plan.built = built
                self._compose()  # the transforms as they were
                raise ValueError(
                    f"{_OWNER}: the new values of {changed} change the layout of the "
                    f"transform's state (a stage added or removed, such as amsgrad or a "
                    f"momentum from 0), which the state built at construction cannot follow. "
                    f"Fix: build a new optimizer with these values (the state of this one "
                    f"does not carry over), or leave them as they were."
                )
            self._inner = inner
            self._tx = self._build()
        self._state = state

    def _changes_layout(self, inner: GradientTransformation) -> bool:
        """Whether ``inner``'s state has another structure than the one held (its init on
        meta tensors: nothing is allocated)."""
        mw = self._master_weights
        with torch.no_grad():
            views = [torch.empty_like(mw.view(p.detach(), self._state.master[name]),
                                      device="meta")
                     for p, name in zip(self._params, self._names, strict=True)]
            try:
                fresh = inner.init(self._tree(views))
            except Exception:  # an init that cannot run on meta tensors: not checked
                return False
        return _core.structure(fresh) != _core.structure(self._state.inner_state)

    def _build(self, *, donate: bool = True, clip: bool = True) -> MixedPrecisionTransformation:
        return mixed_precision(
            self._inner,
            loss_scale=self._loss_scale_rule,
            master_weights=self._master_weights,
            max_grad_norm=self._max_grad_norm if clip else None,
            fused=self._fused,
            count_zeros=self._count_zeros,
            # This object owns its state and writes the params in place anyway: the fused
            # path may update both where they are (unless a state dict shares them).
            donate=donate,
            compile=self._compile,
            **self._distributed,
        )

    def _tree(self, leaves: list[Any]) -> Params:
        return dict(zip(self._names, leaves, strict=True))

    def _grads(self) -> list[torch.Tensor | None]:
        # Megatron-LM's precision-aware optimizer hands its gradients over in
        # .decoupled_grad, and its buffers accumulate into a float32 .main_grad: read the
        # first of them a param has, else .grad.
        out = []
        for p in self._params:
            found = getattr(p, "decoupled_grad", None)
            if found is None:
                found = getattr(p, "main_grad", None)
            out.append(found if found is not None else p.grad)
        return out

    # -- the training loop ------------------------------------------------------------

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``(loss * loss_scale).backward(retain_graph=retain_graph)``, the product in float32."""
        check_loss(f"{_OWNER}.backward", loss)
        torch.autograd.backward(scale_loss(loss, self._state), retain_graph=retain_graph)

    def step(  # type: ignore[override]  # torch types step() -> None; this one reports
        self, closure: Callable[[], Any] | None = None
    ) -> bool | StepResult:
        """Update the params from their gradients; False when the step was skipped.

        ``closure`` (as ``torch.optim``'s, with grad enabled) runs first: Lightning's
        automatic optimization and ``torch.optim.LBFGS``-style loops pass one.

        Returns:
            False when the step was skipped (overflow, or a global norm above
            ``grad_norm_skip_threshold``), True otherwise; with ``return_grad_stats=True``
            the triple ``(ok, grad_norm, num_zeros)`` of Megatron-LM (Python numbers,
            ``(False, None, None)`` on overflow, ``num_zeros`` None without
            ``count_zeros``).

        Raises:
            RuntimeError: when no param has a gradient, or in ``eval()`` mode.

        Warns:
            LossScaleWarning: on a skipped step that left a dynamic loss scale collapsed
                (see [`loss_scale_collapsed`][functopt.precision.loss_scale_collapsed]).
        """
        return self._step(closure, clip=True)

    def _step(self, closure: Callable[[], Any] | None, *, clip: bool) -> bool | StepResult:
        """``step()``; without the clip set by ``clip_grad_norm`` where ``clip`` is False
        (a ``ChainedOptimizer`` clips by the norm of all its optimizers' gradients)."""
        self._check_ready("step")
        self._check_train_mode("step")
        if closure is not None:
            with torch.enable_grad():
                closure()
        self._sync()
        grads = self._grads()
        if all(g is None for g in grads):
            shown = self._names[:5] + (["..."] if len(self._names) > 5 else [])
            raise RuntimeError(
                f"{_OWNER}.step: none of the {len(self._params)} params has a gradient "
                f"({shown} all have .grad None). Fix: call backward(loss) before step(), and "
                f"zero_grad() after it, not between them."
            )
        if math.isfinite(self._skip_threshold):
            stats = self._stats(grads)
            over, found = threshold_verdict(stats.norm, stats.found_inf, self._skip_threshold,
                                            self._distributed["process_group"], *self._agree)
            # Two host reads, on steps with a threshold only; an overflow is the step's own.
            if not bool(found) and bool(over):
                self._skip_for_norm(stats)
                self._remember(grads)
                return self._result(False)
        missed = self._missed
        if missed is not None:
            missed.check(f"{_OWNER}.step", grads, self._names)
        with torch.no_grad():
            old = list(self._params)  # (no detach per param: six ops per step here)
            # After state_dict() the live state is shared with the caller's dict: this one
            # step writes new tensors, so the dict keeps its values.
            if self._state_shared:
                tx = self._build(donate=False, clip=clip)
            elif clip or self._max_grad_norm is None:
                tx = self._tx
            else:  # built once per build of the clipped step
                if self._unclipped is None or self._unclipped[0] is not self._tx:
                    self._unclipped = (self._tx, self._build(clip=False))
                tx = self._unclipped[1]
            new_params, new_state = tx.step(self._tree(grads), self._state,
                                            self._tree(old))
            # The one host sync. A skipped step returns the old params bitwise, so there
            # is nothing to write then.
            took = not bool(new_state.metrics.found_inf)
            if took:
                for p, before, name in zip(self._params, old, self._names, strict=True):
                    after = new_params[name]
                    if after is not before:  # a param without grad comes back as it was
                        p.copy_(after)
        if took and missed is not None:
            missed.advance(grads)
        self._state = new_state
        self._state_shared = False
        self._remember(grads)
        if not took and self._loss_scale_rule is not None and self._loss_scale_rule.dynamic:
            # A second host read, on skipped steps only.
            # 4: past step() and torch.optim's step wrapper (profile_hook_step), to the
            # caller (a ChainedOptimizer's step: past its step_with_ready_grads)
            _warn_if_collapsed(new_state.loss_scale, stacklevel=4)
        return self._result(took)

    def _remember(self, grads: list[torch.Tensor | None]) -> None:
        self._last_grads = [None if g is None else (weakref.ref(g), g._version) for g in grads]

    def _seen(self, grads: list[torch.Tensor | None]) -> bool:
        """Whether ``grads`` are the tensors the last step read, unmodified since."""
        if len(grads) != len(self._last_grads):
            return False
        for g, seen in zip(grads, self._last_grads, strict=True):
            if (g is None) != (seen is None):
                return False
            if g is not None and seen is not None and (seen[0]() is not g
                                                       or g._version != seen[1]):
                return False
        return True

    def _result(self, took: bool) -> bool | StepResult:
        if not self._return_grad_stats:
            return took
        metrics = self._state.metrics
        if bool(metrics.found_inf):
            return False, None, None
        zeros = int(metrics.num_zeros) if self._count_zeros else None
        return took, float(metrics.grad_norm), zeros

    def _stats(self, grads: list[torch.Tensor | None]) -> GradStats:
        """Norm, overflow and zeros of the unscaled ``grads``, computed as the step does."""
        inv_scale = _inverse(self._state.loss_scale)
        master = self._master_weights.dtype
        with torch.no_grad():
            unscaled = [None if g is None else g.to(torch.promote_types(p.dtype, master))
                        * inv_scale for p, g in zip(self._params, grads, strict=True)]
            return unpack_grad_stats(global_grad_stats(
                self._tree(unscaled), self._distributed["process_group"],
                replicated=self._distributed["replicated"]))

    def _skip_for_norm(self, stats: GradStats, *, overflow: bool = False) -> None:
        """Skip this step without running it: for a norm over the threshold (the loss scale
        moves as on a finite step), or with ``overflow`` as on an overflow (a
        ``ChainedOptimizer`` whose other optimizer overflowed)."""
        state = self._state
        m = state.metrics
        found = torch.full((), overflow, dtype=torch.bool, device=m.found_inf.device)
        rule = self._loss_scale_rule
        self._state = state._replace(
            loss_scale=state.loss_scale if rule is None else rule.adjust(state.loss_scale,
                                                                         found),
            metrics=StepMetrics(
                grad_norm=stats.norm.to(m.grad_norm.dtype),
                found_inf=found,
                skipped_steps=m.skipped_steps + 1,
                num_zeros=stats.num_zeros.to(m.num_zeros.dtype) if self._count_zeros
                else m.num_zeros),
            key=state.key + 1,
        )
        # (_state_shared stays: the masters and the transform's state are still the
        # tensors a state dict may hold, which the next step must not update in place.)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the params' gradients (set them to None, or zero them in place).

        ``set_to_none`` defaults to True, as ``torch.optim``'s, except with
        ``compile=True``, where the gradients are views of one buffer per group that
        backward accumulates into: they are zeroed in place unless ``set_to_none=True``.
        Frozen params included, as ``torch.optim`` clears every param of its groups. A
        ``.main_grad`` (Megatron-LM's accumulation buffer, usually a view into one flat
        buffer) is zeroed in place, never set to None; a ``.decoupled_grad`` (Megatron's
        precision-aware optimizer's) is cleared as ``.grad`` is.
        """
        if set_to_none is None:
            set_to_none = not self._compile
        for p in self._params + self._frozen:
            main = getattr(p, "main_grad", None)
            if isinstance(main, torch.Tensor):
                main.zero_()
            for attr in ("grad", "decoupled_grad"):
                grad = getattr(p, attr, None)
                if grad is None:
                    continue
                if set_to_none:
                    setattr(p, attr, None)
                    continue
                if grad.grad_fn is not None:
                    grad.detach_()
                else:
                    grad.requires_grad_(False)
                grad.zero_()

    @typing.overload
    def clip_grad_norm(self, clip_grad: float, /) -> float: ...

    @typing.overload
    def clip_grad_norm(self, model: Any, max_norm: float | NormClip | None) -> None: ...

    def clip_grad_norm(self, *args: Any, **kwargs: Any) -> float | None:
        """Clipping, with LightRFT's signature or Megatron-LM's (told apart by the arguments).

        - ``clip_grad_norm(model, max_norm)`` (LightRFT): the following ``step()`` calls
          clip the unscaled gradients to global L2 norm ``max_norm`` (a number:
          [`clip_by_global_norm`][functopt.clip_by_global_norm]'s rule; a ``NormClip``,
          its own; in the step's one statistics pass); the setting stays until changed, 0 or None
          switches clipping off. ``model`` is not used. Returns None.
        - ``clip_grad_norm(clip_grad)`` (Megatron-LM, one number): now, computes the global
          norm of the unscaled current gradients, scales the gradients in place by
          $c / (\\|g\\| + 10^{-6})$ when that is below 1 (Megatron's
          ``clip_grad_by_total_norm_fp32``; not when the norm is not finite: the step
          then skips), and returns the norm before clipping as a float (a host sync).
        """
        if len(args) + len(kwargs) == 1 and (
                (args and not isinstance(args[0], torch.nn.Module)) or "clip_grad" in kwargs):
            return self._clip_now(args[0] if args else kwargs["clip_grad"])

        def lightrft(model: Any, max_norm: float | None) -> None:
            del model
            self._set_max_grad_norm(max_norm)

        lightrft(*args, **kwargs)
        return None

    def _set_max_grad_norm(self, max_norm: float | NormClip | None) -> None:
        if max_norm is not None and not isinstance(max_norm, NormClip) and (
                isinstance(max_norm, bool) or not isinstance(max_norm, (int, float))):
            raise TypeError(
                f"{_OWNER}.clip_grad_norm: max_norm must be a Python number or None, got "
                f"{type(max_norm).__name__} (or a functopt.precision.NormClip).")
        if isinstance(max_norm, (int, float)) and not (math.isfinite(max_norm) and max_norm >= 0):
            raise ValueError(
                f"{_OWNER}.clip_grad_norm: max_norm must be a finite number >= 0 (0 switches "
                f"clipping off), got {max_norm!r}."
            )
        value = max_norm if isinstance(max_norm, NormClip) else float(max_norm) if max_norm else None
        if value != self._max_grad_norm:
            self._max_grad_norm = value
            self._tx = self._build()  # same state layout: only the step's closure changes

    def _clip_now(self, clip_grad: Any) -> float:
        if isinstance(clip_grad, bool) or not isinstance(clip_grad, (int, float)) or not (
                math.isfinite(clip_grad) and clip_grad >= 0):
            raise ValueError(
                f"{_OWNER}.clip_grad_norm: clip_grad must be a finite Python number >= 0 (0: "
                f"compute the norm without clipping), got {clip_grad!r}."
            )
        grads = self._grads()
        if all(g is None for g in grads):
            raise RuntimeError(
                f"{_OWNER}.clip_grad_norm: no param has a gradient. Fix: call backward(loss) "
                f"first."
            )
        norm = float(self._stats(grads).norm)
        if clip_grad > 0 and math.isfinite(norm):
            coeff = clip_grad / (norm + 1.0e-6)
            if coeff < 1.0:
                with torch.no_grad():
                    for g in grads:
                        if g is not None:
                            g.mul_(coeff)
        return norm

    # -- schedule-free: train / eval ------------------------------------------------------

    def _schedule_free_state(self, index: int, group: dict[str, Any]) -> Any:
        plan = self._plans[index]
        return None if plan.frozen else self._group_state(self._state, index)

    def _evaluation_point(self, index: int, group: dict[str, Any],
                          stage: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # (y: the masters; a stage of a partition moves its own group's leaves only)
        from functopt.contrib import schedule_free_eval_params

        mw = self._master_weights
        x = schedule_free_eval_params(stage, self._tree([
            mw.view(p.detach(), self._state.master[name])
            for p, name in zip(self._params, self._names, strict=True)]))
        return [(p, x[name]) for p, name in zip(group["params"], group["param_names"],
                                                strict=True)]

    # -- reading the state ------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """The current loss scale as a Python float (a host sync; see `get_loss_scale`)."""
        return float(self._state.loss_scale.scale)

    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale, a 0-d float32 tensor (no host sync; Megatron's name)."""
        return self._state.loss_scale.scale

    def get_grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the current unscaled gradients (Megatron-LM's name).

        A 0-d float32 tensor (no host sync), over the params that are not frozen, read
        from ``.main_grad`` where a param has one. Where the gradients are the ones the
        last step read, unmodified, it is that step's norm before clipping (no second
        pass); where no param has a gradient (after ``zero_grad``), the last step's norm
        (0 before the first step; inf or nan after an overflow); otherwise it is computed
        now, as the step computes it (with ``process_group``, or DTensor params, an
        all-reduce: call it on every rank then).
        """
        grads = self._grads()
        if all(g is None for g in grads) or self._seen(grads):
            return self._state.metrics.grad_norm
        return self._stats(grads).norm.to(self._state.metrics.grad_norm.dtype)

    def count_zeros(self) -> torch.Tensor:
        """The number of zero elements in the last step's gradients (0-d int64 tensor).

        Megatron's ``count_zeros``, counted in the step's statistics pass; no host sync.
        -1 when the optimizer was built with ``count_zeros=False``.
        """
        return self._state.metrics.num_zeros

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

    # -- checkpoints ------------------------------------------------------------------

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
                if any(group_entries):
                    raise ValueError(
                        f"{owner}: param_groups[{plan.index}] is frozen, but the state dict "
                        f"holds optimizer state for its params; a frozen group has none. "
                        f"Fix: load a state dict saved with the same groups frozen.")
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

    def _copied(self) -> dict[str, Any]:
        # torch.optim.Optimizer's keeps defaults, state and param_groups only; the facade's
        # state lives in its own attributes, so a copy.deepcopy keeps them all.
        return dict(self.__dict__)

    def _check_rule(self, saved: Any) -> None:
        current = _rule_vector(self._loss_scale_rule)
        if not isinstance(saved, torch.Tensor) or not _same_rule(saved.cpu(), current):
            got = (_describe_rule(saved.cpu()) if isinstance(saved, torch.Tensor)
                   and saved.shape == current.shape else repr(saved))
            raise ValueError(LOSS_SCALE_RULE_MISMATCH.format(
                saved=got, current=_describe_rule(current)))

    # -- offloading ---------------------------------------------------------------------

    def offload_to_cpu(self) -> None:
        """Move the state (master weights, the transform's state, loss scale) to host memory.

        Megatron-LM's name (LightRFT's ``offload_fsdp_optimizer(optimizer)`` does the
        same); frees the device memory the state held once nothing else references it. The
        host buffers are allocated on the first call (pinned when CUDA is available) and
        reused by later calls, without allocating (see
        [`offload`][functopt.distributed.offload]). Until ``restore_from_cpu()``, ``step()``
        and ``load_state_dict`` raise; ``state_dict()`` and the loss scale read the host
        copy. A second call while offloaded does nothing.
        """
        if self._offloaded is not None:
            return
        self._offloaded, self._offload_buffers = offload(
            self._state, buffers=self._offload_buffers
        )
        self._state = self._offloaded.state

    def restore_from_cpu(self, device_id: torch.device | str | int | None = None) -> None:
        """Move the state back to ``device_id``, the device it came from (None: that one).

        The inverse of ``offload_to_cpu``, bitwise (Megatron-LM's name; LightRFT's
        ``load_fsdp_optimizer(optimizer, device_id)``). The host buffers stay allocated for
        the next ``offload_to_cpu``. Raises ``ValueError`` for a ``device_id`` other than
        the params' device, and ``RuntimeError`` when the state is not offloaded.
        """
        owner = f"{_OWNER}.restore_from_cpu"
        if self._offloaded is None:
            raise RuntimeError(f"{owner}: the state is not offloaded (no offload_to_cpu() since "
                               f"the last restore). Fix: call it once per offload_to_cpu().")
        self._state = reload(self._offloaded, _restore_target(owner, self._offloaded, device_id))
        self._offloaded = None

    def _check_ready(self, method: str) -> None:
        if self._offloaded is not None:
            raise RuntimeError(
                f"{_OWNER}.{method}: the optimizer state is offloaded to the CPU. Fix: call "
                f"restore_from_cpu() first."
            )

    def __repr__(self) -> str:
        rule = self._loss_scale_rule
        kind = "None" if rule is None else "dynamic" if rule.dynamic else "static"
        return (
            f"{_OWNER}({len(self._params)} params, loss_scale={kind}, "
            f"master_dtype={self._master_weights.dtype}, max_grad_norm={self._max_grad_norm})"
        )
