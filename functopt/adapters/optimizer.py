"""``functopt.Optimizer``: a ``torch.optim.Optimizer`` that runs a functopt transform.

The transform's state is kept in torch's layout, so that everything written for
``torch.optim`` works on it: learning-rate schedulers read and write ``param_groups``,
``GradScaler`` unscales the gradients of ``param_groups``' params, checkpoints go through
``state_dict()`` / ``load_state_dict()``, and ``optimizer.state[param]`` holds the tensors
that belong to ``param``.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from functopt import _validate
from functopt._base import GradientTransformation
from functopt._collective.dtensor import _leaf_names
from functopt.adapters import _base, _param_groups, _state_dict, _torch_state
from functopt.adapters._base import (
    OPTIMIZER_NOT_PICKLABLE,
    AdapterBase,
    HeldTransform,
    check_frozen_entries,
    collector_paused,
    lift,
)
from functopt.adapters._plan import (
    PlanState,
    _Plan,
    _python_value,
    _readable,
)
from functopt.fast import _compiled, _planner
from functopt.fast._step import Step, make_step
from functopt.fast._step import _check as _step_checks
from functopt.optimizers import recipe_of
from functopt.transforms.combining import _check_transform
from functopt.tree import _core

__all__ = ["COMPILE_NOT_FUSED", "OPTIMIZER_NOT_PICKLABLE", "Optimizer"]

NO_TRANSFORM = (
    "functopt.Optimizer: expected a functopt transform after the params, got {given}. "
    "functopt.Optimizer drives a transform; torch.optim's hyperparameters (lr, betas, "
    "weight_decay, ...) are the arguments of the transform, or of the drop-in classes. "
    "Fix: functopt.optim.AdamW(params, lr=1e-3) (torch's names and defaults), or "
    "functopt.Optimizer(params, functopt.inject_hyperparams(functopt.adamw)("
    "learning_rate=1e-3)) (optax's)."
)
TORCH_OPTIMIZER = (
    "functopt.Optimizer: the transform is torch.optim's {name}, not a functopt transform. "
    "Fix: functopt.optim.{name}(params, ...) is the drop-in with torch's signature (if "
    "functopt.optim has it), or pass the matching recipe, e.g. "
    "functopt.Optimizer(params, functopt.adamw(1e-3))."
)

COMPILE_NOT_FUSED = (
    "{owner}: compile=True with fused=False: the compiled tier is one of the fast paths, "
    "and fused=False keeps every step on the pure update. Fix: leave fused at its default "
    "with compile=True, or pass compile=False for the pure path."
)


class Optimizer(PlanState, AdapterBase):
    r"""A ``torch.optim.Optimizer`` whose step is a functopt transform.

    Each param group holds its own state of ``transform``; a step computes, per group,
    ``updates, state = transform.update(grads, state, params)`` and then
    $p \leftarrow p + u$ in place, so that the optimizer drops into code written for
    ``torch.optim`` (Lightning, ``GradScaler``, learning-rate schedulers, checkpoints).
    It takes that step with [`make_step`][functopt.fast.make_step] and donation: a recipe
    with a fused kernel (``adamw``, ``adam``, ``sgd``, also under ``inject_hyperparams``)
    runs ``torch._fused_adamw_`` and friends wherever the step planner can lower the
    transform (see [`explain`][functopt.fast.explain]), updating params and state in place,
    as ``torch.optim``'s ``fused=True`` does; any other transform runs its pure update and
    grouped in-place adds.

    Hyperparameters. A recipe's hyperparameters appear in each param group under torch's
    names, with nothing to wrap: ``functopt.Optimizer(params, functopt.adamw(1e-3))`` has
    groups with ``lr``, ``betas`` (``(b1, b2)``), ``eps``, ``eps_root`` and
    ``weight_decay``; ``sgd`` has ``lr`` and ``momentum``, ``rmsprop`` ``alpha`` for its
    ``decay``, ``rprop`` ``etas`` and ``step_sizes`` (one table,
    ``functopt.adapters._param_groups.RECIPE_GROUP_KEYS``, gives every recipe's keys). The
    optimizer runs such a recipe as ``inject_hyperparams`` of itself (``opt.transform``), so
    the fused kernels still take the step. A transform built by
    [`inject_hyperparams`][functopt.inject_hyperparams] exposes what it injects, under the
    same names (for another factory: ``lr`` for ``learning_rate``, ``betas`` for
    ``(b1, b2)``, ``momentum`` for ``momentum`` or a lone ``b1``, any other under its own
    name). A transform of your own (a ``chain``) exposes nothing; inject its
    hyperparameters to schedule them. A recipe argument given as a schedule is not in the
    groups: the transform computes it from its own count.

    The group values are read on every step, so ``torch.optim.lr_scheduler`` (and HF
    Trainer's and Lightning's schedulers) schedule them (OneCycleLR cycles ``betas[0]`` or
    ``momentum``), a group may set its own (``{"params": ..., "lr": 0.1}``), and every
    value is checked, on the fused and the pure path alike, as the factory checks its
    arguments (``betas=(1.0, 0.999)`` or a negative ``momentum`` raises its ``ValueError``
    before anything is written); a 0-d tensor value is checked when it is put in the group,
    not when it is changed in place. A group key that no step reads raises, at
    construction, at ``load_state_dict`` and at the step (``group["foo"] = 1``,
    ``momentum`` for a recipe without momentum, torch.optim.Adafactor's ``d`` for
    ``functopt.adafactor``, whose key is ``clipping_threshold``); the keys schedulers keep
    for themselves (``initial_lr``, OneCycleLR's ``max_lr``, ...) are allowed, and
    Megatron's flags where they are honoured: ``is_decoupled_lr=True`` with the group's
    ``max_lr`` (which Megatron's scheduler reads; without it the flag raises), and
    ``is_expert_parallel`` on one process (on more, it raises: this optimizer sums no
    statistics over ranks, ``MixedPrecisionOptimizer`` does). Only the
    hyperparameters of ``transform`` itself are exposed; those injected deeper (inside a
    ``chain`` or a ``partition``) stay in ``optimizer.state``. The groups are plain dicts,
    so ``torch.compile(opt.step)`` traces them.

    Parameters. ``params`` is what ``torch.optim`` takes: tensors, ``(name, tensor)`` pairs
    (``model.named_parameters()``), or group dicts. The transform sees a group's params as
    a list, or, when they are named, as a ``{name: param}`` dict (so masks and
    ``partition`` labels can go by name). A param whose ``.grad`` is None is skipped, as in
    ``torch.optim``: it and its state are left as they are, its step counts included, and a
    group in which no param has a gradient is not stepped at all. Each param keeps its own
    counts (torch.optim's ``state[p]["step"]``): params whose counts agree step as one run
    of the transform, and a step whose params hold different counts runs the transform once
    per count, over the params of that count, so Adam's bias correction of a param that
    missed steps is torch.optim's. A complex param is stepped as its ``torch.view_as_real``
    pairs, as torch.optim steps it (the transform sees a real tensor with a last dim of 2).

    State. Every param of a group that is not frozen has an entry in ``optimizer.state``
    from the start (empty for a stateless transform, as torch.optim's SGD keeps
    ``{'momentum_buffer': None}``), so ``torch.distributed.checkpoint``'s
    ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` load into it and never take
    their zero-gradient initialisation step (which would apply a weight decay to the
    params). The state follows the params as torch.optim's lazily created state does: a
    group not stepped yet whose params moved to another dtype or device (``model.to(...)``)
    starts from ``transform.init`` on the params as they are at its first step, and so does a
    group whose state was cleared (``optimizer.state.clear()``). It is kept in torch's
    layout: ``optimizer.state[param]`` maps the dotted path of each per-parameter state
    field to that param's tensor (``'inner_state.0.mu'``), and holds the group-level leaves
    (``'count'``, ``'inner_state.0.count'``) too, the param's own counts (one tensor shared
    by the params whose counts agree), as torch.optim keeps ``step`` per param. A
    ``functopt.optim`` class shows the same entries in torch's keys instead, ``step`` as
    torch keeps it, and no entry for a param that has not stepped, as torch.optim (so DCP's
    helpers take their step at lr 0 on it, as on torch's class;
    docs/coming-from-torch-optim.md). Injected hyperparameters live in
    ``param_groups`` only. ``state_dict()`` is torch's, with each group's recipe recorded
    under ``"functopt"`` (the state format ``MixedPrecisionOptimizer`` shares;
    ``named_state_dict()`` keys it by names); ``load_state_dict`` refuses another recipe,
    checks every entry against the transform's state (names, shapes) and moves it to the
    dtype and device the transform holds it in. When both the saved group and this one name their params
    (``model.named_parameters()``), each param gets the entry saved under its name, whatever
    the order; names that differ raise, naming them.

    Multipliers and frozen groups. A group may set ``lr_mult`` and ``wd_mult`` (numbers
    $\ge 0$, default 1; Megatron's names). They act once, when the group is added: its
    ``lr`` becomes ``lr * lr_mult`` and its ``weight_decay`` ``weight_decay * wd_mult``
    (its own values, else the defaults; a tensor is multiplied into a new tensor), and so
    do the lrs schedulers compute a group's lr from (``initial_lr``, ``max_lr``,
    ``min_lr``). From then on the group's values are what its steps use, as in
    ``torch.optim``; the multipliers stay as records, and changing one later raises
    (write ``lr`` / ``weight_decay`` instead). So a ``torch.optim.lr_scheduler`` anneals
    each group from its own product, as torch's groups of those lrs, and megatron-core
    0.16.1's ``OptimizerParamScheduler``, which writes ``lr`` from a group's ``max_lr`` /
    ``min_lr`` without reading ``lr_mult`` and ``weight_decay`` already times
    ``wd_mult`` (megatron/core/optimizer_param_scheduler.py, ``step``), applies each
    multiplier once. A scheduler that writes a group's lr from numbers of its own
    (OneCycleLR's ``max_lr``) sets it, as in torch.optim. A multiplier other than 1 needs
    the transform to inject ``learning_rate`` (``weight_decay``); one given as a schedule
    to ``inject_hyperparams`` is not multiplied.
    A group with ``frozen=True`` is left out of the transform: its params get no state
    (no entry in ``optimizer.state`` or the state dict) and are never updated, even if
    they have gradients (they need not require grad). ``frozen`` may be changed between
    steps: an unfrozen group starts from ``transform.init``; a frozen one keeps the state
    it had (clear it from ``optimizer.state`` to free it). ``lr_mult=0`` is not the same:
    such a group keeps its state, and a transform may still move it (a weight decay that
    does not scale with the learning rate).

    Mixed precision: ``torch.amp.GradScaler`` works through ``unscale_`` (it skips the step
    on overflow); the fused ``grad_scale``/``found_inf`` protocol is not implemented.

    Args:
        params: an iterable of tensors, of ``(name, tensor)`` pairs, or of group dicts.
        transform: the transform to run, e.g. ``functopt.adamw(1e-3, weight_decay=1e-2)``.
        fused: take the transform's fused kernel when it has one. False runs its pure
            update (bitwise ``transform.update`` then ``apply_updates_``).
        compile: each group steps on the compiled tier of
            [`make_step`][functopt.fast.make_step] (``compile=True``): its leaves whose
            rules are elementwise and have no PyTorch kernel run as one
            ``torch.compile``\ d call per (device, dtype) group (Adam, AdamW and SGD keep
            their kernels, as `make_step` does with ``compile=True``). The tier is a
            fast path, so it needs ``fused=True``. A transform it cannot take runs on the
            path ``fused`` gives, with a ``FastPathWarning`` naming the reason; a group that
            steps under autograd takes the pure update. A group's first step compiles
            (seconds); its state is made end to end in memory, so the tier updates it in
            place. Copies and pickles keep the flag; the state dict is the same as without.

    Examples:
        >>> import torch, functopt
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = functopt.Optimizer(model.parameters(), functopt.adamw(0.1, weight_decay=0.0))
        >>> opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]
        (0.1, (0.9, 0.999))
        >>> scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> opt.step()
        >>> scheduler.step()
        >>> opt.param_groups[0]["lr"]
        0.05
        >>> sorted(opt.state[model.bias])
        ['count', 'inner_state.0.count', 'inner_state.0.mu', 'inner_state.0.nu']

        A group with ten times the learning rate and no weight decay, and a frozen group:

        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> tx = functopt.adamw(0.1, weight_decay=0.01)
        >>> opt = functopt.Optimizer([
        ...     {"params": net[0].parameters(), "frozen": True},
        ...     {"params": [net[1].weight], "lr_mult": 10.0, "wd_mult": 0.0},
        ...     {"params": [net[1].bias]}], tx)
        >>> scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        >>> net(torch.ones(1, 2)).sum().backward()
        >>> opt.step()
        >>> scheduler.step()
        >>> [group["lr"] for group in opt.param_groups]  # [1]: 0.1 * 10, halved
        [0.05, 0.5, 0.05]
        >>> [len(entry) for entry in opt.state_dict()["state"].values()]  # frozen: empty
        [0, 0, 4, 4]
    """

    _owner = "functopt.Optimizer"
    _differentiable_default = False  # (functopt.optim: the constructor's differentiable)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
        | Iterable[dict[str, Any]],
        transform: GradientTransformation | None = None,
        *,
        fused: bool = True,
        compile: bool = False,
        **torch_kwargs: Any,
    ) -> None:
        owner = "functopt.Optimizer"
        if transform is None or torch_kwargs:
            given = ", ".join(f"{k}={v!r}" for k, v in torch_kwargs.items()) or "no transform"
            raise TypeError(NO_TRANSFORM.format(given=given))
        torch_class = transform if isinstance(transform, type) else type(transform)
        if issubclass(torch_class, torch.optim.Optimizer):
            raise TypeError(TORCH_OPTIMIZER.format(name=torch_class.__name__))
        self._transform = lift(_check_transform(owner, "transform", transform))
        # the recipe's call that built it, which a pickle stores in place of its closures
        self._source = recipe_of(transform)
        _validate.check_flags(owner, fused=fused, compile=compile)
        if compile and not fused:
            raise ValueError(COMPILE_NOT_FUSED.format(owner=self._step_owner()))
        self._fused = fused
        self._compile = compile
        # Groups whose state is still the one add_param_group made (no step yet): a step
        # makes it again if the params moved to another dtype or device since.
        self._unstepped: dict[int, _Plan] = {}
        # Groups (by index) whose state is still to be made (see the ``state`` property).
        self._pending: dict[int, dict[str, Any]] = {}
        self._state_shared = False  # state_dict()/load_state_dict() handed tensors over
        self._plans: list[_Plan | None] = []
        # The groups whose params' counts differ (torch.optim counts steps per param).
        self._counts = _torch_state.Counts()
        if isinstance(params, torch.Tensor):
            raise TypeError(
                f"{owner}: params must be an iterable of tensors, (name, tensor) pairs or "
                f"group dicts, got a single tensor of shape {tuple(params.shape)}. Fix: wrap "
                f"it in a list, or pass model.parameters()."
            )
        # Filled from the first group's injected hyperparameters (add_param_group);
        # torch.optim's add_param_group takes non-leaf params where defaults say
        # differentiable (a subclass's _differentiable_default).
        with collector_paused():  # (see add_param_group)
            super().__init__(params, defaults={"differentiable": True}
                             if self._differentiable_default else {})

    @property
    def transform(self) -> GradientTransformation:
        """The transform the steps run: the one given, except that a plain recipe
        (``functopt.adamw(1e-3)``) is its ``inject_hyperparams`` form, so that the values in
        ``param_groups`` are the ones it reads (``functopt.fast.explain(opt.transform,
        params)`` says which path it takes)."""
        return self._transform

    # -- param groups -------------------------------------------------------------------

    def _add_group(self, group: dict[str, Any]) -> None:
        # A group's plan and state are a few small containers per param: the cyclic
        # collector would run many times over them while they are made (at 20,000 params,
        # 80% of the time), and none of them forms a cycle.
        with collector_paused():
            self._add_param_group(group)

    def _add_param_group(self, group: dict[str, Any]) -> None:
        torch.optim.Optimizer.add_param_group(self, group)  # normalises params, names; appends
        index = len(self.param_groups) - 1
        try:
            flags = _param_groups.group_flags(
                "functopt.Optimizer", f"param_groups[{index}]", group
            )
            plan = self._plan(index, group, laid_out=False)
            if not self.defaults.keys() - {"differentiable"}:  # (the first group)
                given = self.__dict__.get("_given_defaults", {})
                values = _readable(self._transform, plan.hyper)
                self.defaults.update({
                    key: given[key] if key in given else (
                        tuple(_python_value(values[n]) for n in names) if len(names) > 1
                        else _python_value(values[names[0]]))
                    for key, names in plan.exposed.items()
                })
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            self._check_options(index, group, plan)
            self._check_megatron_flags(index, group)
            self._check_multipliers(index, group, plan, flags)
            self._fold(index, group, plan, flags)
            hyper = self._hyperparams(index, group, plan)  # type-checks the values now
        except Exception:
            self.param_groups.pop()
            del self._plans[index:]
            raise
        if flags.frozen:  # no state: the plan (and its template) was only for the checks
            self._plans[index] = None
            return
        plan.made_from = self._init_hyper(hyper)
        # The state is made when it is first needed (_made_state): at the first step, or
        # when optimizer.state is first read.
        self._pending[index] = group
        if self._eager_state:
            self._made_state()

    # Whether a group's state is made when the group is added (torch.optim.Adagrad makes its
    # state in its constructor), not when it is first needed.
    _eager_state = False

    def _read_state(self) -> Any:
        return self._shown_state(self._made_store())

    def _write_state(self, value: Any) -> None:
        if "_store" not in self.__dict__:  # (torch.optim's constructor)
            self.__dict__["_store"] = value
        else:
            self._set_shown_state(value)

    def _made_store(self) -> defaultdict[torch.Tensor, Any]:
        """The entries the steps read and write (every group's made: see ``state``)."""
        if self.__dict__.get("_pending"):
            self._made_state()
        store: defaultdict[torch.Tensor, Any] = self.__dict__["_store"]
        return store

    def _shown_state(self, store: defaultdict[torch.Tensor, Any]) -> Any:
        """What ``optimizer.state`` shows of ``store``: the entries themselves (a transform
        has no other layout)."""
        return store

    def _set_shown_state(self, value: Any) -> None:
        """``optimizer.state = value``: the entries, as given."""
        self.__dict__["_store"] = value

    def _made_state(self) -> None:
        """Make the state of every group whose state is still to be made (``_pending``)."""
        pending = self.__dict__.get("_pending")
        if not pending:
            return
        with collector_paused():  # (see add_param_group)
            while pending:
                index, group = pending.popitem()
                groups = self.param_groups
                if index >= len(groups) or groups[index] is not group:
                    continue  # (the group was removed from param_groups since)
                plan = self._plan(index, group, placed=True)
                if not plan.made_from:
                    plan.made_from = self._init_hyper(plan.hyper)
                self._scatter(group, plan, plan.fresh(
                    plan.transform, self._tree(group, self._real(group["params"])),
                    plan.made_from))
                self._unstepped[index] = plan

    @staticmethod
    def _check_multipliers(
        index: int, group: dict[str, Any], plan: _Plan, flags: _param_groups.GroupFlags
    ) -> None:
        _param_groups.check_multipliers("functopt.Optimizer", f"param_groups[{index}]", flags,
                                        plan.hyper)

    @staticmethod
    def _check_megatron_flags(index: int, group: dict[str, Any]) -> None:
        """Megatron's flags honoured or refused: ``is_decoupled_lr`` as both adapters
        check it; an expert-parallel group on more than one rank raises, since this
        optimizer sums no statistics over ranks and its experts differ from rank to rank."""
        where = f"param_groups[{index}]"
        _param_groups.check_megatron_flags("functopt.Optimizer", where, group)
        if group.get("is_expert_parallel") is True and torch.distributed.is_available() and (
                torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
            raise ValueError(
                f"functopt.Optimizer: {where} is expert-parallel (is_expert_parallel=True): "
                f"each rank holds other experts, so a global norm or overflow check must sum "
                f"their statistics over the ranks, and functopt.Optimizer sums none. Fix: "
                f"use functopt.MixedPrecisionOptimizer with process_group= and replicated= "
                f"(its statistics over the ranks), or leave the key out where no stage "
                f"reads statistics across params.")

    def _fold(self, index: int, group: dict[str, Any], plan: _Plan,
              flags: _param_groups.GroupFlags) -> None:
        """Multiply the new group's learning rate and weight decay by its ``lr_mult`` and
        ``wd_mult``, once, and its schedulers' lrs (``LR_RECORDS``) by ``lr_mult``: the
        group holds the products, the values its steps use."""
        for (_, name), mult in zip(_param_groups.MULTIPLIED, (flags.lr_mult, flags.wd_mult),
                                   strict=True):
            for key, names in plan.exposed.items():
                if names == (name,) and key in group:
                    group[key] = _param_groups.times(group[key], mult)
        group.update(_param_groups.scaled_lr_records(flags.lr_mult, group))
        self.__dict__.setdefault("_folded", {})[index] = (flags.lr_mult, flags.wd_mult)

    def _check_options(self, index: int, group: dict[str, Any], plan: _Plan) -> None:
        _param_groups.check_group_keys("functopt.Optimizer", f"param_groups[{index}]", group,
                                       plan.allowed, plan.exposed, plan.recipe)

    # -- step -----------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure`` (with grad enabled) if given, then update every param group.

        Returns:
            The closure's return value (the loss), or None.
        """
        return self._step(closure)

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        """``step``'s body: torch.optim wraps the ``step`` of every class it sees built
        (profiling, the step hooks), so a subclass whose ``step`` does more calls this, not
        ``super().step``, to be wrapped once."""
        self._check_train_mode("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):  # (before any group steps)
            self._flags(index, group)
        # A group's first step makes its state and plans its fast step: a few small
        # containers per param, none in a cycle, over which the cyclic collector would
        # run many times (at 10,000 params, half the time of the step); the collector is
        # paused as in add_param_group. (Not while torch.compile traces the step.)
        paused = (contextlib.nullcontext() if torch.compiler.is_compiling()
                  else collector_paused())
        with torch.no_grad(), paused:
            for index, group in enumerate(self.param_groups):
                if self._differentiable(index, group):
                    with torch.enable_grad():
                        self._step_group(index, group)
                else:
                    self._step_group(index, group)
        self._state_shared = False
        return loss

    def _differentiable(self, index: int, group: dict[str, Any]) -> bool:
        """Whether the group steps under autograd (``torch.optim``'s
        ``differentiable=True``: the pure update, the params written in place in the
        graph)."""
        return False

    # -- schedule-free: train / eval (AdapterBase's) -------------------------------------

    def _schedule_free_state(self, index: int, group: dict[str, Any]) -> Any:
        flags = _param_groups.group_flags(self._owner, f"param_groups[{index}]", group)
        if flags.frozen:
            return None
        plan = self._plan(index, group)
        return _core.unflatten(plan.treespec, self._gather(index, group, plan, flags))

    def _evaluation_point(self, index: int, group: dict[str, Any],
                          stage: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from functopt.contrib import schedule_free_eval_params

        x = schedule_free_eval_params(stage, self._tree(group, [p.detach() for p in
                                                                group["params"]]))
        # paired in the tree's order (a named group's dict flattens by sorted key, not in
        # the order of group["params"])
        params = _core.flatten(self._tree(group, list(group["params"])))[0]
        return list(zip(params, _core.flatten(x)[0], strict=True))

    def _unsealed_state_dict(self) -> dict[str, Any]:
        self._state_shared = True
        saved = torch.optim.Optimizer.state_dict(self)
        # Which recipe each group runs (None: not a recipe), checked by load_state_dict.
        for i, group in enumerate(saved["param_groups"]):
            plan = self._plans[i] if i < len(self._plans) else None
            if plan is None:  # a frozen group: empty entries, as DCP's strict load wants
                for pid in group["params"]:
                    saved["state"].setdefault(pid, {})
            group[_state_dict.CONFIG_KEY] = {
                "format": _state_dict.FORMAT,
                "transform": None if plan is None else plan.signature}
        # (torch's own state_dict() packed the keys that are no param, and its hooks ran)
        extras = _state_dict.unpacked_extras(saved)
        saved["state"] = _state_dict.packed_state(
            {k: v for k, v in saved["state"].items() if k not in extras}, extras)
        return saved

    def _flags(self, index: int, group: dict[str, Any]) -> _param_groups.GroupFlags:
        """``group_flags`` of the group, read again only when one of its values is another
        object than at the last step (they are numbers and bools: replaced to be changed)."""
        raw = (group.get("lr_mult"), group.get("wd_mult"), group.get("frozen"))
        known: dict[int, Any] = self.__dict__.setdefault("_known_flags", {})
        last = known.get(index)
        if last is not None and all(map(operator.is_, last[0], raw)):
            flags: _param_groups.GroupFlags = last[1]
            return flags
        where = f"param_groups[{index}]"
        flags = _param_groups.group_flags("functopt.Optimizer", where, group)
        folded = self.__dict__.setdefault("_folded", {})
        _param_groups.check_unchanged_multipliers("functopt.Optimizer", where, flags,
                                                  folded.setdefault(index, flags[:2]))
        known[index] = (raw, flags)
        return flags

    def _dense_grad(self, group: dict[str, Any], j: int, grad: torch.Tensor) -> torch.Tensor:
        """The sparse (or other non-strided) gradient of the group's j-th param as the step
        takes it: refused here (a drop-in whose torch class steps it makes it dense)."""
        raise TypeError(
            f"functopt.Optimizer: {self._describe(group, j)} has a {grad.layout} gradient; "
            f"functopt transforms take dense gradients. Fix: use a dense embedding "
            f"(sparse=False), or call grad.to_dense() before the step."
        )

    def _step_group(self, index: int, group: dict[str, Any]) -> None:
        flags = self._flags(index, group)
        params = group["params"]
        grads = [p.grad for p in params]
        if flags.frozen:
            return
        stepped = False
        strided = torch.strided
        missing: list[int] = []
        for j, g in enumerate(grads):
            if g is None:
                missing.append(j)
            else:
                if g.layout is not strided:
                    grads[j] = self._dense_grad(group, j, g)
                stepped = True
        if not stepped:  # as in torch.optim: a group without gradients is not stepped
            return
        plan = self._plan(index, group)
        # A fresh state (none yet: not stepped, cleared, stateless) follows the params.
        store = self._made_store()
        if index in self._unstepped or not store.get(params[0]):
            plan = self._plan(index, group, placed=True)
        if not plan.allowed.issuperset(group):
            self._check_options(index, group, plan)
        state, entries = self._collect(index, group, plan, flags)
        counts, slots = self._counts, plan.group_slots
        runs = counts.classes(index, slots, entries, state, grads, missing)
        if runs is None:  # one run over all params: they share their counts
            if entries is None:
                counts.split.discard(index)
            self._run(index, group, plan, state, entries, grads)
            return
        # A run per count, over the params of that count (torch.optim counts per param).
        for r, members in enumerate(runs):
            if r:
                state, entries = self._collect(index, group, plan, flags)
            if entries is not None:
                state = counts.leaves(state, slots, entries[members[0]])
            kept = counts.kept(store, params, slots, members)
            inside = set(members)
            self._run(index, group, plan, state, entries,
                      [g if j in inside else None for j, g in enumerate(grads)])
            counts.restore(store, params, kept)
        counts.merge(index, store, params, slots)

    def _run(self, index: int, group: dict[str, Any], plan: _Plan, state: list[Any],
             entries: list[Any] | None, grads: list[Any]) -> None:
        """One run of the transform over the group's params with ``state`` (its leaves, read
        from ``entries``, or from init with None), written back into ``optimizer.state``."""
        params = group["params"]
        if plan.complex:  # (their real pairs: as torch.optim steps complex params)
            self._check_complex(group, grads)
            params = self._real(params)
            grads = [torch.view_as_real(g) if g is not None and g.is_complex() else g
                     for g in grads]
        if plan.order is not None:  # the leaves in the tree's order
            params = [params[k] for k in plan.order]
            grads = [grads[k] for k in plan.order]
        # A recipe with a fused kernel runs it, any other transform its pure update and
        # grouped adds. The step may update the gathered state where it is (donation),
        # unless a state dict handed those tensors out since the last step: then this one
        # step writes new state tensors, and the params are copied into.
        if torch.is_grad_enabled():  # (differentiable: the pure update, in the graph)
            tree = plan.transform.update(_core.unflatten(plan.pspec, grads),
                                         _core.unflatten(plan.treespec, state),
                                         _core.unflatten(plan.pspec, params))
            for p, u in zip(params, plan.pspec.flatten_up_to(tree[0]), strict=True):
                if u is not None:
                    p.add_(u)
            new_state, treespec = _core.flatten(tree[1])
            self._scatter(group, plan, new_state, treespec)
            self._unstepped.pop(index, None)
            return
        donate = not self._state_shared
        if self._in_place_argument is not None:
            self._run_in_place(index, group, plan, state, entries, grads, params, donate)
            return
        steppers = self.__dict__.setdefault("_steppers", {})
        transform = plan.transform
        stepper = steppers.get((transform, donate))
        if stepper is None:  # one step function each: they cache their plans
            fused = self._group_fused(transform)
            stepper = steppers[transform, donate] = make_step(
                transform, donate=donate, fused=fused, compile=self._compile and fused)
        read = state
        relaid: set[int] = self.__dict__.setdefault("_relaid", set())
        if stepper.compile and (index not in relaid or (entries is None and plan.stateful)):
            # (a fresh or loaded state: laid end to end, as Step.init lays it out, so that
            # the compiled tier reads and writes it in place from now on)
            read = _laid_flat(stepper, params, plan.pspec, state, plan.treespec)
            relaid.add(index)
        new, new_state, treespec = stepper._step_flat(
            params, grads, plan.pspec, read, plan.treespec)
        if not donate:  # (the step wrote new tensors, laid out as it made them)
            relaid.discard(index)
        if not donate:
            for p, n in zip(params, new, strict=True):
                if n is not p:
                    p.copy_(n)
        self._scatter(group, plan, new_state, treespec,
                      None if entries is None or not donate else (state, entries))
        self._unstepped.pop(index, None)

    # The extra argument with which the transform's update adds each run of its updates
    # into the params itself (a drop-in whose rule does: Adafactor's), or None.
    _in_place_argument: str | None = None

    def _run_in_place(self, index: int, group: dict[str, Any], plan: _Plan, state: list[Any],
                      entries: list[Any] | None, grads: list[Any], params: list[Any],
                      donate: bool) -> None:
        """`_run` for a transform whose update adds its updates into the params as it goes
        (``_in_place_argument``): the pure path's checks, then the update, which steps
        the params with the very additions the pure path's apply makes."""
        pspec = plan.pspec
        grad_tree, param_tree = _core.unflatten(pspec, grads), _core.unflatten(pspec, params)
        param_leaves, treespec, _ = _step_checks(grad_tree, param_tree)
        _planner.check_donation(param_leaves, _leaf_names(treespec))
        argument = self._in_place_argument
        assert argument is not None  # (the caller's check)
        _, new_tree = plan.transform.update(grad_tree, _core.unflatten(plan.treespec, state),
                                            param_tree, **{argument: True})
        new_state, new_spec = _core.flatten(new_tree)
        self._scatter(group, plan, new_state, new_spec,
                      None if entries is None or not donate else (state, entries))
        self._unstepped.pop(index, None)

    def _check_complex(self, group: dict[str, Any], grads: list[Any]) -> None:
        """Raise where the optimizer does not step the group's complex params that have a
        gradient (``grads``, in the group's order); here every transform steps their real
        pairs."""

    def _step_owner(self) -> str:
        return "functopt.Optimizer"

    # -- checkpoints ----------------------------------------------------------------------

    def _load(self, owner: str, state_dict: dict[str, Any]) -> None:
        pairs = _state_dict.saved_groups(owner, state_dict, self.param_groups)
        # (checkpoints before the format's version 2 kept the recipes at the top level)
        legacy = (state_dict.get("functopt") or {}).get("transforms") or []
        new_groups: list[dict[str, Any]] = []
        new_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for i, (group, (saved, entries)) in enumerate(zip(self.param_groups, pairs,
                                                          strict=True)):
            saved = copy.deepcopy(saved)
            config = saved.pop(_state_dict.CONFIG_KEY, None)
            if config is None and i < len(legacy):
                config = {"transform": legacy[i]}
            plan_i = self._plans[i] if i < len(self._plans) else None
            ours = None if plan_i is None else plan_i.signature
            if config is not None and config.get("transform") is not None and ours is not None:
                _state_dict.check_config(owner, i, config, {"transform": ours})
            new_group = dict(saved)
            # The group's params and names stay this optimizer's (they shape the
            # transform's tree; an unnamed group takes the saved names, as torch's load
            # does); the saved entries were matched to them by name.
            new_group["params"] = group["params"]
            if "param_names" in group:
                new_group["param_names"] = group["param_names"]
            flags = _param_groups.group_flags(owner, f"param_groups[{i}]", new_group)
            # (the saved values hold the products of the saved multipliers)
            self.__dict__.setdefault("_folded", {})[i] = (flags.lr_mult, flags.wd_mult)
            if flags.frozen:
                check_frozen_entries(owner, i, entries)
                new_groups.append(new_group)
                continue
            plan = self._plan(i, new_group, placed=True)  # loaded tensors go where params are
            self._check_options(i, new_group, plan)
            self._check_multipliers(i, new_group, plan, flags)
            hyper = self._hyperparams(i, new_group, plan)
            entries = self._loaded_entries(owner, new_group, plan, config, entries, hyper)
            for j, (p, entry) in enumerate(zip(group["params"], entries, strict=True)):
                new_state[p] = (_state_dict.check_entry(
                    owner, f"param {j} of param_groups[{i}]", plan.fields[j], entry,
                    cast=True, copy=False) if any(entries) else {})
            new_groups.append(new_group)
        new_state.update(_state_dict.unpacked_extras(state_dict))
        self._pending.clear()  # (every group's state is the loaded one)
        self.__dict__["_store"] = new_state
        self.param_groups = new_groups
        self._unstepped.clear()
        self.__dict__.get("_relaid", set()).clear()
        self._counts.split.clear()
        for i, group in enumerate(self.param_groups):  # equal counts share their tensors
            held = self._plans[i] if i < len(self._plans) else None
            if held is not None and not _param_groups.group_flags(
                    owner, f"param_groups[{i}]", group).frozen:
                self._counts.merge(i, new_state, group["params"], held.group_slots)
        self._state_shared = True  # the loaded tensors may be the caller's own

    def _loaded_entries(self, owner: str, group: dict[str, Any], plan: _Plan, config: Any,
                        entries: list[Any], hyper: dict[str, Any]) -> list[Any]:
        """The saved entries of a group's params in this optimizer's layout (``config``: the
        group's saved configuration record, None if it has none)."""
        return entries

    def _copied(self) -> dict[str, Any]:
        # Plans are rebuilt on the next step; the transform's closures travel as they are.
        # A copy holds copies of the state tensors: it shares nothing with a state dict.
        state = {**torch.optim.Optimizer.__getstate__(self), "state": self._made_store(),
                 "_plans": [],
                 "_fused": self._fused, "_compile": self._compile,
                 "_state_shared": False, "_unstepped": {}, "_pending": {},
                 "_counts": copy.deepcopy(self._counts)}
        state["_transform"] = HeldTransform(self._transform, self.__dict__.get("_source"))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        held = state.get("_transform")
        if isinstance(held, HeldTransform):
            state = {**state, "_transform": held.transform, "_source": held.source}
        state = dict(state)
        store = state.pop("state", None)
        if store is None:
            store = state.pop("_store", defaultdict(dict))
        super().__setstate__(state)
        self.__dict__["_store"] = store
        self.__dict__.setdefault("_counts", _torch_state.Counts())
        self.__dict__.setdefault("_pending", {})
        self.__dict__.setdefault("_compile", False)


def _laid_flat(stepper: Step, params: list[Any], pspec: _core.TreeSpec, state: list[Any],
               state_spec: _core.TreeSpec) -> list[Any]:
    """``state`` (leaves of ``state_spec``) with the per-leaf entries of each group the
    compiled tier steps moved into one buffer per entry, values equal, as ``Step.init``
    lays them out; ``state`` itself where the tier takes no group."""
    groups = stepper.planner.compiled_groups(pspec, params, state, state_spec)
    if groups is None:
        return state
    return _compiled.flat_layout(params, [False] * len(params), state, groups)[1]


# The names under which a pickled Optimizer holds its transform (its pickles keep them).
_HeldTransform = HeldTransform
_remade = _base._remade
