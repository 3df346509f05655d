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
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from functopt import _validate
from functopt._base import GradientTransformation, Params
from functopt._collective.agreement import check_agreement, threshold_verdict
from functopt._collective.counting import Replicated
from functopt._collective.stats import global_grad_stats
from functopt._spec import Injected, describe
from functopt.adapters import _from_torch, _missing_grads, _param_groups
from functopt.adapters._base import lift
from functopt.adapters._facade_groups import BOOKKEEPING_KEYS, FacadeGroups, group_plans
from functopt.adapters._facade_state import (
    LOSS_SCALE_RULE_MISMATCH,
    FacadeState,
    _unaliased,
)
from functopt.adapters._megatron import MegatronSurface, check_expert_groups
from functopt.distributed.offloading import OffloadedState, _restore_target, offload, reload
from functopt.precision.loss_scale import (
    LossScale,
    _inverse,
    _warn_if_collapsed,
    dynamic_loss_scale,
)
from functopt.precision.master import float32_master
from functopt.precision.stats import GradStats, NormClip, unpack_grad_stats
from functopt.precision.step import (
    MixedPrecisionTransformation,
    StepMetrics,
    check_loss,
    mixed_precision,
    scale_loss,
)

__all__ = ["LOSS_SCALE_RULE_MISMATCH", "MixedPrecisionOptimizer"]

_OWNER = "MixedPrecisionOptimizer"
TransformOrFactory = GradientTransformation | Callable[..., GradientTransformation]
"""A transform for every param, or a factory ``(**group_options) -> transform``."""


StepResult = tuple[bool, float | None, int | None]
"""``(ok, grad_norm, num_zeros)``, Megatron-LM's ``step()`` result (``return_grad_stats``)."""


def _rule_source(params: Any, transform: Any) -> tuple[Any, list[Any] | None, Any]:
    """``params`` as the groups to collect, the factory of each group where a torch.optim
    optimizer gives the rule (else None), and that optimizer (else None); raise for a
    missing or malformed rule."""
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
    return params, factories, torch_source


class MixedPrecisionOptimizer(MegatronSurface, FacadeGroups, FacadeState):
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
    ``master_dtype`` or wider have no copy and are updated in their own dtype. A param
    whose ``.grad`` is None at ``step()`` is left unchanged, and so is its per-param state,
    as in ``torch.optim``; a ``step()`` where no param has a gradient is an error. The
    transform's state is built once, by the constructor (a state tensor that shares memory
    with a param is copied then).

    It is a ``torch.optim.Optimizer``: ``param_groups`` hold each group's params and its
    transform's arguments under torch's names (a plain recipe runs as
    ``inject_hyperparams`` of itself, as in ``functopt.Optimizer``), and a value written
    there is used by the next ``step()``, so torch's and Megatron's schedulers drive it.
    Groups may set options (then ``transform`` is a factory ``(**options) -> transform``,
    one per group, combined with [`partition`][functopt.partition]: one loss scale, skip
    decision and clipping norm), ``lr_mult`` / ``wd_mult`` (applied once, at construction)
    and ``frozen=True`` (left out of the step and its statistics). ``params`` may also be a
    ``torch.optim`` optimizer (LightRFT's ``FSDPadaptOptimizer`` form), translated into the
    chain of the same numerics. ``clip_grad_norm`` takes LightRFT's and Megatron-LM's
    signatures, and Megatron-LM's surface is here (``get_grad_norm()``,
    ``grad_norm_skip_threshold``, ``return_grad_stats``, ``prepare_grads()`` /
    ``step_with_ready_grads()``, ``from_optimizer_config``, ...). Param groups,
    checkpoints, host syncs and the skip agreed over the ranks: docs/mixed-precision.md,
    *The object-style facade*.

    Args:
        params: the parameters to optimize (tensors, named tensors or group dicts), each
            a floating-point leaf tensor that requires grad. Or a ``torch.optim`` optimizer
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
            elementwise rules run as one ``torch.compile``\ d call per group of params,
            whose params and gradients are moved at construction into one buffer per group
            (``param.data`` and ``param.grad`` become views; ``zero_grad()`` then zeroes
            them in place by default). The first step compiles (seconds).
        process_group: the ranks the gradient statistics (norm, non-finite count, zero
            count) are summed over, as in ``mixed_precision``; None infers it from DTensor
            params (FSDP2), plain tensors are then not summed.
        replicated: how plain tensor params repeat over the ranks of the group, as in
            ``mixed_precision`` (True: every rank holds the same values, counted once;
            False: each rank's own part; a group, or a pytree keyed by param names).
        agree_skip: where the skip decision is agreed: True, over the
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
        params, factories, torch_source = _rule_source(params, transform)
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
        self._plans, kept = group_plans(groups, transform, factories, fixed,
                                        self._fixed_injected)
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
        torch_groups = self._torch_groups(groups, kept)
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

    # -- checkpoints ------------------------------------------------------------------

    def _copied(self) -> dict[str, Any]:
        # torch.optim.Optimizer's keeps defaults, state and param_groups only; the facade's
        # state lives in its own attributes, so a copy.deepcopy keeps them all.
        return dict(self.__dict__)

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
