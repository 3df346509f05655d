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

import inspect
import math
from collections.abc import Callable, Hashable
from typing import Any

import torch

from functopt import _validate
from functopt._base import GradientTransformation, Params
from functopt._collective.dtensor import local_tensor
from functopt.adapters import _param_groups, _state_dict
from functopt.distributed.offloading import OffloadedState, offload, reload
from functopt.precision.loss_scale import (
    LossScale,
    _describe_rule,
    _rule_vector,
    _same_rule,
    _warn_if_collapsed,
    dynamic_loss_scale,
)
from functopt.precision.master import float32_master
from functopt.precision.step import (
    MixedPrecisionState,
    MixedPrecisionTransformation,
    mixed_precision,
    scale_loss,
)
from functopt.transforms.partition import partition
from functopt.tree import _core

__all__ = ["MixedPrecisionOptimizer"]

_OWNER = "MixedPrecisionOptimizer"
_RULE_KEY = "loss_scale_rule"  # the state dict's record of the loss-scale rule

LOSS_SCALE_RULE_MISMATCH = (
    "MixedPrecisionOptimizer.load_state_dict: the checkpoint was saved with {saved}, this "
    "optimizer has {current}. The saved scale only means something under its own rule (a "
    "dynamic scale of 65536 loaded into loss_scale=None would scale every loss by 65536 "
    "and never unscale it). Fix: build the optimizer with the checkpoint's rule (the same "
    "loss_scale=...) to resume; to switch rules on purpose (float16 to bfloat16), replace "
    "the checkpoint's 'loss_scale' and 'loss_scale_rule' entries by this optimizer's own "
    "(from opt.state_dict()) before loading, which restarts the scale under the new rule."
)

TransformOrFactory = GradientTransformation | Callable[..., GradientTransformation]
"""A transform for every param, or a factory ``(**group_options) -> transform``."""


def _scaled(transform: Any, index: int, group: _param_groups.ParamGroup, option: str,
            key: str, mult: float) -> Any:
    """The group's ``option`` (its own, else the factory's default) times ``mult``."""
    if option in group.options:
        base = group.options[option]
    else:
        try:
            parameter = inspect.signature(transform).parameters.get(option)
        except (TypeError, ValueError):  # a callable without a signature
            parameter = None
        if parameter is None or parameter.default is inspect.Parameter.empty:
            raise TypeError(
                f"{_OWNER}: param group {index} sets {key}={mult!r}, which multiplies the "
                f"factory's {option!r}, but the group does not set {option!r} and the factory "
                f"has no {option!r} argument with a default. Fix: give the factory one, e.g. "
                f"transform=lambda learning_rate=1e-3, weight_decay=0.1: functopt.adamw("
                f"learning_rate, weight_decay=weight_decay), or set {option!r} in the group."
            )
        base = parameter.default
    if isinstance(base, torch.Tensor) or (
        isinstance(base, (int, float)) and not isinstance(base, bool)
    ):
        return base * mult
    if callable(base):  # a schedule: scale its value at every step
        return lambda count: base(count) * mult
    raise TypeError(
        f"{_OWNER}: param group {index} sets {key}={mult!r}, but its {option!r} is "
        f"{type(base).__name__} {base!r}, not a number, a 0-d tensor or a schedule, so it "
        f"cannot be multiplied. Fix: give {option!r} a numeric value."
    )


def _inner_transform(
    transform: Any, groups: list[_param_groups.ParamGroup]
) -> GradientTransformation:
    """One transform over the trainable params; group options go through a factory and
    ``partition``, the multipliers through the factory's ``learning_rate``/``weight_decay``."""
    indexed = [(i, group) for i, group in enumerate(groups) if not group.frozen]
    if isinstance(transform, GradientTransformation):
        for i, group in indexed:
            mults = {k: v for k, v in (("lr_mult", group.lr_mult), ("wd_mult", group.wd_mult))
                     if v != 1.0}
            if group.options or mults:
                raise TypeError(
                    f"{_OWNER}: param group {i} sets {sorted(group.options) + sorted(mults)}, "
                    f"but transform is a GradientTransformation, whose hyperparameters are "
                    f"fixed when it is built. Fix: pass a factory that builds each group's "
                    f"transform from its options, e.g. transform=lambda learning_rate=1e-3, "
                    f"weight_decay=0.01: functopt.adamw(learning_rate, "
                    f"weight_decay=weight_decay)."
                )
        return transform
    if not callable(transform):
        raise TypeError(
            f"{_OWNER}: transform must be a functopt.GradientTransformation (e.g. "
            f"functopt.adamw(1e-3)) or a factory (**group_options) -> GradientTransformation, "
            f"got {type(transform).__name__}."
        )
    transforms: dict[Hashable, GradientTransformation] = {}
    for i, group in indexed:
        options = dict(group.options)
        for option, key, mult in (("learning_rate", "lr_mult", group.lr_mult),
                                  ("weight_decay", "wd_mult", group.wd_mult)):
            if mult != 1.0:  # 1.0 leaves the factory's call as it was
                options[option] = _scaled(transform, i, group, option, key, mult)
        try:
            tx = transform(**options)
        except TypeError as error:
            raise TypeError(
                f"{_OWNER}: the transform factory failed on the options of param group {i} "
                f"({sorted(options)}): {error}. Fix: give the factory a keyword argument "
                f"for every option the groups set."
            ) from error
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"{_OWNER}: the transform factory returned a {type(tx).__name__} for param "
                f"group {i}; expected a functopt.GradientTransformation."
            )
        transforms[i] = tx
    if len(transforms) == 1:
        return next(iter(transforms.values()))
    labels = {name: i for i, group in indexed for name in group.names}
    return partition(transforms, labels)


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


class MixedPrecisionOptimizer:
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
    advances). A ``step()`` where no param has a gradient is an error: ``backward`` was
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
    Learning-rate schedules belong in the transform (a functopt schedule, or
    [`inject_hyperparams`][functopt.inject_hyperparams]); there is no ``param_groups``
    list for a ``torch.optim.lr_scheduler`` to edit.

    Three group options are read by the optimizer itself, not passed to the factory:

    - ``lr_mult`` and ``wd_mult`` (numbers $\ge 0$, default 1; Megatron's names): the
      group's transform is built as ``transform(**options, learning_rate=lr * lr_mult,
      weight_decay=wd * wd_mult)``, where ``lr`` and ``wd`` are the group's own
      ``learning_rate``/``weight_decay`` options, or else the factory's defaults for them
      (a schedule is multiplied at every step). A multiplier of 1 leaves the call as it
      was; a multiplier other than 1 needs a factory with that argument. So the
      effective learning rate is $\eta \cdot$ ``lr_mult`` and the effective weight decay
      $\lambda \cdot$ ``wd_mult``, as in Megatron, where the scheduler writes
      ``lr * lr_mult`` into each group.
    - ``frozen=True``: the group's params are left out of the step altogether: they get
      no state (no master copy, no transform state, no entry in ``state_dict()``), are
      never written, even if they have gradients, and their gradients count neither in
      the global norm (clipping, ``get_grad_norm()``) nor in the overflow decision, as if
      the params were not passed (Megatron leaves params with ``requires_grad=False`` out
      of its groups). They need not require grad; ``zero_grad`` clears their gradients,
      as ``torch.optim`` does for every param of its groups. ``lr_mult=0`` is not the
      same: such a group keeps its state, and its gradients still count.

    **Clipping.** ``clip_grad_norm(model, max_norm)`` sets the global L2 norm the
    *following* ``step()`` calls clip the unscaled gradients to (``max_norm=0`` or None:
    no clipping, the initial setting); the step computes the norm in its single
    statistics pass, so clipping costs no extra reduction. It returns None, as LightRFT's
    does: the norm exists only inside the step; read it afterwards with
    ``get_grad_norm()``. Differences from LightRFT: its ``clip_grad_norm`` is a no-op and
    its step always clips at 1.0 with the factor $\max(1, (\|g\| + 10^{-6}) / c)$; here
    nothing is clipped until ``clip_grad_norm`` is called, and the rule is
    [`clip_by_global_norm`][functopt.clip_by_global_norm]'s, $g \cdot c / \|g\|$ when
    $\|g\| > c$ (no $10^{-6}$).

    **Checkpoints.** ``state_dict()`` returns the step's state as nested dicts of tensors
    (loss scale and its counters, master weights, the transform's state, the last step's
    metrics, the step key), keyed by field names and parameter names, loadable with
    ``torch.load(weights_only=True)`` and by ``torch.distributed.checkpoint``. It records
    the loss-scale rule (``"loss_scale_rule"``, a float64 tensor of the rule's arguments),
    and ``load_state_dict`` refuses a checkpoint saved under another rule. The rest of
    the configuration (transform, clipping norm) is not in it: build the optimizer the
    same way (and call ``clip_grad_norm`` again), then ``load_state_dict``;
    it continues bitwise as the original would have. Loading also sets each param that
    has a master copy to ``master.to(param.dtype)`` (as LightRFT does), so loading the
    optimizer alone restores the low-precision weights as well.

    **Host syncs.** ``step()`` reads its skip decision (one bool), and on a skipped step
    with a dynamic scale the scale too, to warn with a
    [`LossScaleWarning`][functopt.precision.LossScaleWarning] when it has collapsed (below
    float32's smallest normal number, on its way to 0.0); ``loss_scale`` reads the scale
    as a Python float. Nothing else syncs: ``backward`` multiplies by the scale
    tensor, and ``get_loss_scale()``, ``get_grad_norm()`` and ``count_zeros()`` return
    0-d tensors.

    Args:
        params: the parameters to optimize (see *Param groups*). Each must be a
            floating-point leaf tensor that requires grad.
        transform: the update rule, e.g. ``functopt.adamw(1e-3)``, without clipping of its
            own (use ``clip_grad_norm``); or a factory ``(**group_options) -> transform``.
        loss_scale: the loss-scale rule: ``dynamic_loss_scale()`` (the default:
            PyTorch's ``GradScaler`` rule; ``hysteresis=2, min_scale=1.0`` for Megatron's
            and LightRFT's), ``static_loss_scale(s)``, or None for no scaling (usual for
            bfloat16).
        master_dtype: the precision of the master copy and of the update maths.
        fused: run the planner's fused kernels where the transform has them (see ``fused`` in
            [`mixed_precision`][functopt.precision.mixed_precision]); the step then also
            updates masters and moments in place. False keeps the pure path, which is
            bitwise independent of how FSDP2 shards the params.
        count_zeros: count the zero gradient elements at every step (``count_zeros()``;
            one more read of the gradients). False, Megatron-LM's default, saves it and
            ``count_zeros()`` returns -1.

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
        >>> master = opt.state_dict()["master"]
        >>> sorted(master)
        ['bias', 'weight']
        >>> torch.equal(model.weight, master["weight"].to(torch.bfloat16))
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
        >>> inner = opt.state_dict()["inner_state"]["inner_states"]  # no state for group 0
        >>> sorted(inner), sorted(inner["1"]["0"]["mu"]), sorted(inner["2"]["0"]["mu"])
        (['1', '2'], ['1.weight'], ['1.bias'])
    """

    def __init__(
        self,
        params: Any,
        transform: TransformOrFactory,
        *,
        # A LossScale is immutable (two pure functions), so one default can be shared.
        loss_scale: LossScale | None = dynamic_loss_scale(),  # noqa: B008
        master_dtype: torch.dtype = torch.float32,
        fused: bool = True,
        count_zeros: bool = True,
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
        groups = _param_groups.collect(_OWNER, params)
        if all(group.frozen for group in groups):
            raise ValueError(
                f"{_OWNER}: every param group is frozen, so there is nothing to optimize. "
                f"Fix: leave at least one group unfrozen (frozen=False, the default)."
            )
        self._inner = _inner_transform(transform, groups)
        # Frozen params stay out of the step: no state, no master copy, no statistics.
        trainable = [group for group in groups if not group.frozen]
        self._names = [name for group in trainable for name in group.names]
        self._params = [p for group in trainable for p in group.params]
        self._frozen = [p for group in groups if group.frozen for p in group.params]
        self._loss_scale_rule = loss_scale
        self._master_weights = float32_master(master_dtype)
        _validate.check_flags(_OWNER, fused=fused, count_zeros=count_zeros)
        self._fused = fused
        self._count_zeros = count_zeros
        self._max_grad_norm: float | None = None
        self._tx = self._build()
        with torch.no_grad():
            state = self._tx.init(self._tree([p.detach() for p in self._params]))
        self._state = _unaliased(state, self._params)
        self._state_shared = False  # state_dict() handed the live tensors out
        # offload_to_cpu: the state held on the host, and the host buffers kept for reuse
        self._offloaded: OffloadedState | None = None
        self._offload_buffers: tuple[Any, ...] | None = None

    def _build(self, *, donate: bool = True) -> MixedPrecisionTransformation:
        return mixed_precision(
            self._inner,
            loss_scale=self._loss_scale_rule,
            master_weights=self._master_weights,
            max_grad_norm=self._max_grad_norm,
            fused=self._fused,
            count_zeros=self._count_zeros,
            # This object owns its state and writes the params in place anyway: the fused
            # path may update both where they are (unless a state dict shares them).
            donate=donate,
        )

    def _tree(self, leaves: list[Any]) -> Params:
        return dict(zip(self._names, leaves, strict=True))

    # -- the training loop ------------------------------------------------------------

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``(loss * loss_scale).backward(retain_graph=retain_graph)``, the product in float32."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"{_OWNER}.backward: loss must be a tensor, got {type(loss).__name__}."
            )
        torch.autograd.backward(scale_loss(loss, self._state), retain_graph=retain_graph)

    def step(self) -> bool:
        """Update the params from their ``.grad``; False when the step was skipped (overflow).

        Raises:
            RuntimeError: when no param has a gradient.

        Warns:
            LossScaleWarning: on a skipped step that left a dynamic loss scale collapsed
                (see [`loss_scale_collapsed`][functopt.precision.loss_scale_collapsed]).
        """
        self._check_not_offloaded("step")
        grads = [p.grad for p in self._params]
        if all(g is None for g in grads):
            shown = self._names[:5] + (["..."] if len(self._names) > 5 else [])
            raise RuntimeError(
                f"{_OWNER}.step: none of the {len(self._params)} params has a gradient "
                f"({shown} all have .grad None). Fix: call backward(loss) before step(), and "
                f"zero_grad() after it, not between them."
            )
        with torch.no_grad():
            old = [p.detach() for p in self._params]
            # After state_dict() the live state is shared with the caller's dict: this one
            # step writes new tensors, so the dict keeps its values.
            tx = self._build(donate=False) if self._state_shared else self._tx
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
        self._state = new_state
        self._state_shared = False
        if not took and self._loss_scale_rule is not None and self._loss_scale_rule.dynamic:
            # A second host read, on skipped steps only.
            _warn_if_collapsed(new_state.loss_scale, stacklevel=2)
        return took

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the params' gradients (set them to None, or zero them in place).

        Frozen params included, as ``torch.optim`` clears every param of its groups.
        """
        for p in self._params + self._frozen:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    def clip_grad_norm(self, model: Any, max_norm: float | None) -> None:
        """Clip the unscaled gradients of the following steps to global L2 norm ``max_norm``.

        The setting stays until changed; ``max_norm`` 0 or None switches clipping off.
        ``model`` is not used (LightRFT's signature). Returns None: the norm is computed
        inside ``step()``; read it after the step with ``get_grad_norm()``.
        """
        del model
        if max_norm is not None and (
            isinstance(max_norm, bool) or not isinstance(max_norm, (int, float))
        ):
            raise TypeError(
                f"{_OWNER}.clip_grad_norm: max_norm must be a Python number or None, got "
                f"{type(max_norm).__name__}."
            )
        if max_norm is not None and not (math.isfinite(max_norm) and max_norm >= 0):
            raise ValueError(
                f"{_OWNER}.clip_grad_norm: max_norm must be a finite number >= 0 (0 switches "
                f"clipping off), got {max_norm!r}."
            )
        value = float(max_norm) if max_norm else None
        if value != self._max_grad_norm:
            self._max_grad_norm = value
            self._tx = self._build()  # same state layout: only the step's closure changes

    # -- reading the state ------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """The current loss scale as a Python float (a host sync; see `get_loss_scale`)."""
        return float(self._state.loss_scale.scale)

    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale, a 0-d float32 tensor (no host sync; Megatron's name)."""
        return self._state.loss_scale.scale

    def get_grad_norm(self) -> torch.Tensor:
        """The last step's global L2 norm of the unscaled gradients, before clipping.

        A 0-d float32 tensor (no host sync): inf or nan after a skipped step, 0 before the
        first. Megatron's ``get_grad_norm`` computes the norm of the current gradients and
        returns a float; here the step has already computed it.
        """
        return self._state.metrics.grad_norm

    def count_zeros(self) -> torch.Tensor:
        """The number of zero elements in the last step's gradients (0-d int64 tensor).

        Megatron's ``count_zeros``, counted in the step's statistics pass; no host sync.
        -1 when the optimizer was built with ``count_zeros=False``.
        """
        return self._state.metrics.num_zeros

    def reload_model_params(self) -> None:
        """Re-copy the params into the master weights (after loading a model checkpoint).

        The transform's state and the loss scale are kept, as in Megatron.
        """
        mw = self._master_weights
        with torch.no_grad():
            master = [mw.init(p.detach()) for p in self._params]
        self._state = self._state._replace(master=self._tree(master))

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state as nested dicts of tensors, keyed by field and param names.

        The tensors are the live state, not copies; the next step then writes new tensors
        instead of updating these in place, so a dict taken before a step keeps its
        values (later steps update the optimizer's own tensors in place again). For
        ``torch.distributed.checkpoint``, take the state dict of the optimizer to restore as
        the template, ``load`` into it in place, then pass it to ``load_state_dict``.
        """
        self._state_shared = True
        if self._offloaded is not None:  # the dict holds the host buffers: never reuse them
            self._offload_buffers = None
        out = _state_dict.to_nested(f"{_OWNER}.state_dict", self._state)
        out[_RULE_KEY] = _rule_vector(self._loss_scale_rule)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by ``state_dict()``; params with a master copy are set from it.

        The optimizer keeps copies of the given tensors (moved to the params' devices), so
        the dict can be reused or changed afterwards without touching the optimizer.

        Raises:
            ValueError: naming missing or unexpected keys (other param names, another
                transform), or a key whose tensor has another shape.
            TypeError: naming a key whose tensor has another dtype (a float16 loss scale).
        """
        self._check_not_offloaded("load_state_dict")
        if isinstance(state_dict, dict) and _RULE_KEY in state_dict:
            # (A checkpoint from before the rule was recorded has no entry: not checked.)
            state_dict = dict(state_dict)
            self._check_rule(state_dict.pop(_RULE_KEY))
        state: MixedPrecisionState = _state_dict.from_nested(
            f"{_OWNER}.load_state_dict", self._state, state_dict
        )
        mw = self._master_weights
        with torch.no_grad():
            for p, name in zip(self._params, self._names, strict=True):
                store = state.master[name]
                if store is not None:  # as LightRFT: the model follows the loaded master
                    p.copy_(mw.write(p, store, mw.view(p, store), None)[0])
        self._state = state

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

    def restore_from_cpu(self) -> None:
        """Move the state back to the devices it came from (Megatron-LM's name).

        The inverse of ``offload_to_cpu``, bitwise (LightRFT's ``load_fsdp_optimizer``).
        The host buffers stay allocated for the next ``offload_to_cpu``. A call while
        not offloaded does nothing.
        """
        if self._offloaded is None:
            return
        self._state = reload(self._offloaded)
        self._offloaded = None

    def _check_not_offloaded(self, method: str) -> None:
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
