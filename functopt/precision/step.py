"""The mixed-precision step: unscale, check, skip, clip, update a master copy, write params.

A gradient transformation returns updates and leaves the write ``params + updates`` to the
caller. That cannot keep low-precision params exact: ``p + (q - p)`` rounded to bfloat16 is
not ``q`` rounded to bfloat16 when the update nearly cancels the value (DESIGN.md's case:
master ``-0.49991035`` plus ``0.49991038`` must give the bfloat16 of ``2.98e-08``, the delta
path writes ``0.0``). So the mixed-precision step is one level up: it owns the master copy
*and* the write, and returns new params. Inside it runs any ordinary
[`GradientTransformation`][functopt.GradientTransformation] (``chain(...)``, ``adamw(...)``)
on float32 gradients and float32 master params.

Order of operations in ``step(grads, state, params)``, one pass each:

1. cast each gradient to ``master_dtype`` and unscale it by ``1 / loss_scale``;
2. one statistics pass over all leaves: sum of squares, non-finite count, zero count,
   packed into one tensor (one all-reduce when distributed);
3. adjust the loss scale with ``found_inf``;
4. clip by the global norm of step 2 (``max_grad_norm``; no second reduction);
5. the inner transform's update, on the master params (so weight decay reads the master);
6. ``master + updates``, then, only where the step is finite, take the new master, the new
   inner state and the new params (``torch.where``: bitwise the old values on overflow);
7. params = ``master.to(param.dtype)``: each low-precision param is exactly its master
   rounded to nearest.

Nothing is read back to the host: the overflow decision is a tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functopt import _validate
from functopt._base import GradientTransformation, Params, State, with_extra_args_support
from functopt.precision.loss_scale import LossScale, LossScaleState, static_loss_scale
from functopt.precision.master import MasterWeights, float32_master
from functopt.precision.stats import grad_stats, unpack_grad_stats
from functopt.tree import _core

__all__ = [
    "MixedPrecisionState",
    "MixedPrecisionTransformation",
    "StepMetrics",
    "mixed_precision",
    "scale_loss",
    "select_tree",
]


class StepMetrics(NamedTuple):
    """What the last step saw (0-d tensors; reading them is the only host sync)."""

    grad_norm: torch.Tensor  # float32, (): L2 norm of the unscaled gradients before clipping
    found_inf: torch.Tensor  # bool, (): the gradients overflowed, so the step was skipped
    skipped_steps: torch.Tensor  # int32, (): steps skipped since init
    num_zeros: torch.Tensor  # int64, (): gradient elements equal to zero (Megatron's count_zeros)


class MixedPrecisionState(NamedTuple):
    """State of [`mixed_precision`][functopt.precision.mixed_precision]."""

    loss_scale: LossScaleState  # the loss scale and its counters
    master: Params  # like params: each leaf's master-weight store (float32 copy, ...) or None
    inner_state: State  # the inner transform's state, built on the master params
    metrics: StepMetrics  # statistics of the last step
    key: torch.Tensor  # int64, (), on the CPU: steps taken; seeds random rounding


class MixedPrecisionTransformation(NamedTuple):
    """``init(params) -> state`` and ``step(grads, state, params) -> (params, state)``."""

    init: Callable[[Params], MixedPrecisionState]
    step: Callable[..., tuple[Params, MixedPrecisionState]]


def scale_loss(loss: torch.Tensor, state: MixedPrecisionState | LossScaleState) -> torch.Tensor:
    """``loss * scale``, computed in float32 (a float16 loss times 2**16 would overflow).

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.precision.mixed_precision(
        ...     functopt.sgd(0.1), loss_scale=functopt.dynamic_loss_scale())
        >>> state = opt.init({"w": torch.ones(2, dtype=torch.float16)})
        >>> functopt.precision.scale_loss(torch.tensor(0.5, dtype=torch.float16), state)
        tensor(32768.)
    """
    ls = state.loss_scale if isinstance(state, MixedPrecisionState) else state
    wide = torch.promote_types(loss.dtype, torch.float32)
    return loss.to(wide) * ls.scale.to(wide)


def select_tree(found_inf: torch.Tensor, old: Any, new: Any, *, name: str = "state") -> Any:
    """Leaf by leaf, ``old`` where ``found_inf`` is true and ``new`` elsewhere.

    Bitwise: a selected old leaf is exactly the old tensor's values (nan payloads and signed
    zeros included). ``old`` and ``new`` must have the same structure; ``None`` stays ``None``.
    """
    old_leaves, treespec = _core.flatten(old)
    new_leaves = _core.flatten_like(treespec, new, name=f"new {name}", reference=f"old {name}")
    out = [
        n if (o is None or n is None) else torch.where(found_inf, o, n)
        for o, n in zip(old_leaves, new_leaves, strict=True)
    ]
    return _core.unflatten(treespec, out)


def _zero_metrics(device: torch.device) -> StepMetrics:
    return StepMetrics(
        grad_norm=torch.zeros((), dtype=torch.float32, device=device),
        found_inf=torch.zeros((), dtype=torch.bool, device=device),
        skipped_steps=torch.zeros((), dtype=torch.int32, device=device),
        num_zeros=torch.zeros((), dtype=torch.int64, device=device),
    )


def mixed_precision(
    inner: GradientTransformation,
    *,
    loss_scale: LossScale | None = None,
    master_weights: MasterWeights | None = None,
    max_grad_norm: float | None = None,
) -> MixedPrecisionTransformation:
    r"""A complete mixed-precision optimizer step around ``inner``.

    With the default [`float32_master`][functopt.precision.float32_master], params narrower
    than float32 (bfloat16, float16) get a float32 master copy; ``inner`` sees only float32
    gradients and params, and after every step each such param is bitwise
    ``master.to(param.dtype)``. On overflow (an inf or nan anywhere, or a global norm that
    overflows float32) the step is skipped: params, master and inner state stay bitwise as
    they were; only the loss scale, the metrics and the key move. See the module docstring
    for the order of operations.

    Args:
        inner: the update rule, e.g. ``functopt.adamw(1e-3)`` (without its own clipping:
            use ``max_grad_norm``, which reuses the step's single reduction).
        loss_scale: [`dynamic_loss_scale`][functopt.dynamic_loss_scale] (float16),
            [`static_loss_scale`][functopt.static_loss_scale], or None for no scaling
            (usual for bfloat16).
        master_weights: how params are kept exact (default: a float32 master copy).
        max_grad_norm: clip the unscaled gradients to this global L2 norm, or None.

    Returns:
        A [`MixedPrecisionTransformation`][functopt.precision.MixedPrecisionTransformation].

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.precision.mixed_precision(
        ...     functopt.sgd(1.0), loss_scale=functopt.static_loss_scale(4.0))
        >>> params = {"w": torch.tensor([-0.5], dtype=torch.bfloat16)}
        >>> state = opt.init(params)
        >>> # DESIGN.md's case: a master just above -0.5 and an update that nearly cancels it
        >>> state = state._replace(master={"w": torch.tensor([-0.49991035])})
        >>> grads = {"w": torch.tensor([-0.49991038 * 4])}  # scaled by 4
        >>> params, state = opt.step(grads, state, params)
        >>> params["w"]  # the bfloat16 of the new master; p + (q - p) would give 0.0
        tensor([2.9802e-08], dtype=torch.bfloat16)
        >>> torch.equal(params["w"], state.master["w"].to(torch.bfloat16))
        True
    """
    owner = "mixed_precision"
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"{owner}: inner must be a functopt.GradientTransformation, got "
            f"{type(inner).__name__}. Fix: mixed_precision(functopt.adamw(1e-3), ...)."
        )
    inner = with_extra_args_support(inner)
    if loss_scale is not None and not isinstance(loss_scale, LossScale):
        raise TypeError(
            f"{owner}: loss_scale must be a functopt.LossScale (from dynamic_loss_scale() or "
            f"static_loss_scale(...)) or None, got {type(loss_scale).__name__}."
        )
    scale_rule = loss_scale if loss_scale is not None else static_loss_scale(1.0)
    if master_weights is None:
        master_weights = float32_master()
    if not isinstance(master_weights, MasterWeights):
        raise TypeError(
            f"{owner}: master_weights must be a functopt.precision.MasterWeights (from "
            f"float32_master(), ...), got {type(master_weights).__name__}."
        )
    mw = master_weights
    if max_grad_norm is not None:
        _validate.check_range(owner, "max_grad_norm", max_grad_norm, low=0.0, low_open=True)

    def init_fn(params: Params) -> MixedPrecisionState:
        leaves, treespec = _core.flatten(params)
        _core.check_tensors(leaves, treespec, name="params", floating=True)
        store = [None if p is None else mw.init(p) for p in leaves]
        view = [None if p is None else mw.view(p, s) for p, s in zip(leaves, store, strict=True)]
        device = next((p.device for p in leaves if p is not None), torch.device("cpu"))
        return MixedPrecisionState(
            loss_scale=scale_rule.init(device),
            master=_core.unflatten(treespec, store),
            inner_state=inner.init(_core.unflatten(treespec, view)),
            metrics=_zero_metrics(device),
            key=torch.zeros((), dtype=torch.int64),
        )

    def step_fn(
        grads: Any, state: MixedPrecisionState, params: Params, **extra_args: Any
    ) -> tuple[Params, MixedPrecisionState]:
        param_leaves, treespec = _core.flatten(params)
        _core.check_tensors(param_leaves, treespec, name="params", floating=True)
        grad_leaves = _core.flatten_like(treespec, grads, name="grads", reference="params")
        _core.check_tensors(grad_leaves, treespec, name="grads", floating=True)
        _check_grads(grad_leaves, param_leaves, treespec, mw.dtype)
        store = _core.flatten_like(treespec, state.master, name="state.master",
                                   reference="params")
        view = [None if p is None else mw.view(p, s)
                for p, s in zip(param_leaves, store, strict=True)]

        # 1. unscale in master precision; 1/scale rounded once, as GradScaler does.
        inv_scale = state.loss_scale.scale.double().reciprocal().float()
        unscaled = [None if g is None else g.to(mw.dtype) * inv_scale for g in grad_leaves]
        # 2. one statistics pass; 3. the loss scale moves whatever happens.
        stats = unpack_grad_stats(grad_stats(unscaled, device=state.loss_scale.scale.device))
        new_loss_scale = scale_rule.adjust(state.loss_scale, stats.found_inf)
        # 4. clip with the same norm (optax's rule: only when the norm exceeds the bound).
        if max_grad_norm is not None:
            factor = torch.where(stats.norm > max_grad_norm, max_grad_norm / stats.norm,
                                 torch.ones_like(stats.norm))
            unscaled = [None if g is None else g * factor.to(g.dtype) for g in unscaled]
        # 5. the inner rule on master-precision params.
        updates, new_inner = inner.update(
            _core.unflatten(treespec, unscaled), state.inner_state,
            _core.unflatten(treespec, view), **extra_args,
        )
        update_leaves = _core.flatten_like(treespec, updates, name="inner updates",
                                           reference="params")
        # 6. write through the strategy, then keep the old values where the step overflowed.
        generator = None
        if mw.needs_generator:
            device = next((p.device for p in param_leaves if p is not None), torch.device("cpu"))
            generator = torch.Generator(device=device)
            generator.manual_seed(int(state.key))  # a CPU tensor: no device sync
        found = stats.found_inf
        new_params: list[Any] = []
        new_store: list[Any] = []
        for p, s, v, u in zip(param_leaves, store, view, update_leaves, strict=True):
            if p is None or u is None:
                new_params.append(p)
                new_store.append(s)
                continue
            wp, ws = mw.write(p, s, v + u, generator)
            new_params.append(torch.where(found, p, wp))
            new_store.append(None if s is None else torch.where(found, s, ws))
        metrics = StepMetrics(
            grad_norm=stats.norm,
            found_inf=found,
            skipped_steps=state.metrics.skipped_steps + found.to(torch.int32),
            num_zeros=stats.num_zeros,
        )
        new_state = MixedPrecisionState(
            loss_scale=new_loss_scale,
            master=_core.unflatten(treespec, new_store),
            inner_state=select_tree(found, state.inner_state, new_inner, name="inner state"),
            metrics=metrics,
            key=state.key + 1,
        )
        return _core.unflatten(treespec, new_params), new_state

    return MixedPrecisionTransformation(init_fn, step_fn)


def _check_grads(grads: list[Any], params: list[Any], treespec: _core.TreeSpec,
                 master_dtype: torch.dtype) -> None:
    """Gradients come in the param's dtype (the model's) or already in master precision."""
    for i, (g, p) in enumerate(zip(grads, params, strict=True)):
        if g is None or p is None:
            continue
        if g.shape != p.shape:
            raise ValueError(
                f"{_core.paths(treespec)[i]!r}: grad has shape {tuple(g.shape)} but the param "
                f"has shape {tuple(p.shape)}. Fix: pass the gradients of these params."
            )
        if g.dtype not in (p.dtype, master_dtype):
            raise TypeError(
                f"{_core.paths(treespec)[i]!r}: {g.dtype} grad for a {p.dtype} param; "
                f"mixed_precision takes gradients in the param's dtype or in the master dtype "
                f"({master_dtype}). Fix: pass param.grad as autograd produced it."
            )
