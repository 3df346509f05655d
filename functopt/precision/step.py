r"""The mixed-precision step: unscale, check, skip, clip, update a master copy, write params.

A gradient transformation returns updates and leaves the write ``params + updates`` to the
caller. That cannot keep low-precision params exact: ``p + (q - p)`` rounded to bfloat16 is
not ``q`` rounded to bfloat16 when the update nearly cancels the value (for example a
master ``-0.49991035`` plus ``0.49991038`` must give the bfloat16 of ``2.98e-08``, the delta
path writes ``0.0``). So the mixed-precision step is one level up: it owns the master copy
*and* the write, and returns new params. Inside it runs any ordinary
[`GradientTransformation`][functopt.GradientTransformation] (``chain(...)``, ``adamw(...)``)
on float32 gradients and float32 master params.

Order of operations in ``step(grads, state, params)``, one pass each:

1. cast each gradient to the precision of the value it updates (the master's; a param
   without master, such as a float32 or float64 one, its own dtype) and multiply it by
   ``inv_scale``, the float32 rounding of ``1 / loss_scale`` (as ``GradScaler`` rounds it);
2. one statistics pass over all leaves: sum of squares (float64), non-finite count, zero
   count, packed into one tensor; with DTensor params (FSDP2) each rank counts its local
   shards and one all-reduce sums them (see ``functopt.distributed``); with ``agree_skip``
   the overflow verdict is agreed over a group too (``functopt/_collective/agreement.py``);
3. adjust the loss scale with ``found_inf``;
4. clip by the global norm of step 2 (``max_grad_norm``; no second reduction);
5. the inner transform's update, on the master params (so weight decay reads the master);
6. ``master + updates``, then, only where the step is finite, take the new master, the new
   inner state and the new params (``torch.where``: bitwise the old values on overflow);
7. params = ``master.to(param.dtype)``: each low-precision param is exactly its master
   rounded to nearest.

Unscaling is exact when the loss scale is a power of two (the defaults of
[`dynamic_loss_scale`][functopt.dynamic_loss_scale] and every scale it reaches from a
power-of-two ``init_scale`` with ``growth_factor=2`` and ``backoff_factor=0.5``): then
``inv_scale`` is exact and multiplying by it only moves the exponent, so a gradient
``g`` scaled in its own dtype, ``g * scale``, unscales to ``g`` bitwise whenever
``g * scale`` neither overflows (that is an overflow: the step is skipped) nor underflows
into the subnormals (a scale below 1 can do that; the lost bits cannot come back). With any
other scale (a non-power-of-two ``init_scale``, ``growth_factor`` or ``backoff_factor``)
the step still works, but unscaling rounds: ``inv_scale`` is ``1 / scale`` rounded to
float32 and the product is rounded again, so a float32 scaled gradient ``fl(g * scale)``
unscales to $g(1 + \delta)$ with $|\delta| < 2^{-22}$ (three roundings of at most
$2^{-24}$ each), not to ``g`` bitwise. ``GradScaler`` and Megatron-LM behave the same;
exactness is promised only for power-of-two scales, and other scales raise no error.

The overflow check reads the *unscaled* gradients (``GradScaler`` checks the scaled ones:
the two differ only when a scale below 1 makes a finite float32 gradient overflow when
unscaled, which this step catches), and gradients whose global float32 norm overflows
count as an overflow too. ``metrics.num_zeros`` counts zeros of the unscaled gradients
before clipping (Megatron-LM counts after clipping, which can differ only where clipping
underflows an element to zero); it saves a second pass.

Nothing is read back to the host: the overflow decision is a tensor. (The fused path on
the CPU reads its sums once and computes the scalars in Python, bitwise the same: there a
read is free and each 0-d kernel costs microseconds; see ``precision/_host.py``.)
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from functopt._base import GradientTransformation, Params, State, with_extra_args_support
from functopt._collective.agreement import (
    SKIP_AGREEMENT,
    Agreement,
    Wording,
    agreement,
    reduce_stats,
)
from functopt._collective.counting import Replicated
from functopt._collective.dtensor import _leaf_names
from functopt._collective.stats import local_stats
from functopt.fast import _errors, _multi, _planner
from functopt.fast._errors import CaptureError
from functopt.fast._explain import Explanation
from functopt.fast._step import differentiated
from functopt.precision import _explain, _host
from functopt.precision._checks import (
    OWNER,
    Checked,
    check_inner,
    check_options,
    check_updates,
    checked_leaves,
)
from functopt.precision._fused import _lowered, flat_init, fused_mixed_step, lay_out_params
from functopt.precision._fused_multi import fused_multi_step
from functopt.precision._seen import Seen
from functopt.precision.loss_scale import (
    LossScale,
    LossScaleState,
    _inverse,
    static_loss_scale,
)
from functopt.precision.master import MasterWeights, float32_master
from functopt.precision.stats import GradStats, NormClip, _clip_factor, unpack_grad_stats
from functopt.transforms import _common
from functopt.tree import _core, _ops

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
    num_zeros: torch.Tensor  # int64, (): zero gradient elements (Megatron's count_zeros); -1: not counted


class MixedPrecisionState(NamedTuple):
    """State of [`mixed_precision`][functopt.precision.mixed_precision]."""

    loss_scale: LossScaleState  # the loss scale and its counters
    master: Params  # like params: each leaf's master-weight store (float32 copy, ...) or None
    inner_state: State  # the inner transform's state, built on the master params
    metrics: StepMetrics  # statistics of the last step
    key: torch.Tensor  # int64, (), on the CPU: steps taken; seeds random rounding


def _no_buffers() -> list[torch.Tensor]:
    return []


def _as_they_are(params: Params) -> Params:
    return params


class MixedPrecisionTransformation(NamedTuple):
    """``init(params) -> state`` and ``step(grads, state, params) -> (params, state)``.

    ``buffers()`` lists the scratch tensors the step keeps between calls (the gradient casts
    of a donating fused step), for memory accounting; they hold no state.
    ``lay_out(params)`` (with ``compile=True``) moves the params of each compiled group,
    and their gradients, into one buffer per group, as
    [`Step.lay_out`][functopt.fast.Step.lay_out] does; returns ``params``.
    ``explain(params, state=None, grads=None)`` says which path the step takes on these
    params (state: default ``init(params)``; grads: default one per param, in its dtype),
    per group of leaves, and the bytes the whole step reads and writes: an
    [`Explanation`][functopt.fast.Explanation], as [`explain`][functopt.fast.explain]
    gives for a transform (see *Memory traffic* there).

    Examples:
        >>> import torch, functopt
        >>> step = functopt.precision.mixed_precision(functopt.adamw(1e-3), donate=True)
        >>> print(step.explain({"w": torch.zeros(4, 4, dtype=torch.bfloat16)}))
        fused path: 1 kernel call(s) per step, 0 global norm(s) in one pass
          torch._fused_adamw_ + weight decay on 1 float32 leaves (cpu): w
        memory traffic: 44.0 bytes per param per step (416 B read, 288 B written)
    """

    init: Callable[[Params], MixedPrecisionState]
    step: Callable[..., tuple[Params, MixedPrecisionState]]
    buffers: Callable[[], list[torch.Tensor]] = _no_buffers
    lay_out: Callable[[Params], Params] = _as_they_are
    explain: Callable[..., Explanation] = _explain.not_explained


def check_loss(owner: str, loss: Any) -> None:
    """Raise a ``TypeError`` naming ``owner`` unless ``loss`` is a floating-point tensor."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{owner}: loss must be a tensor, got {type(loss).__name__} "
                        f"{loss!r:.60}. Fix: scale each loss separately (a list or tuple of "
                        f"losses: one call per element), or pass the tensor the forward pass "
                        f"returned.")
    if not loss.is_floating_point():
        raise TypeError(f"{owner}: loss must be a floating-point tensor, got a {loss.dtype} "
                        f"tensor. Fix: compute the loss in a floating-point dtype.")


def scale_loss(loss: torch.Tensor, state: MixedPrecisionState | LossScaleState) -> torch.Tensor:
    """``loss * scale``, computed in float32 or wider.

    A float16 loss is widened first (times ``2**16`` it would overflow float16); a float64
    loss stays float64, as ``GradScaler.scale`` leaves it.

    Raises:
        TypeError: ``loss`` is not a floating-point tensor (a list of losses, an integer
            tensor), or ``state`` holds no loss scale.

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.precision.mixed_precision(
        ...     functopt.sgd(0.1), loss_scale=functopt.dynamic_loss_scale())
        >>> state = opt.init({"w": torch.ones(2, dtype=torch.float16)})
        >>> functopt.precision.scale_loss(torch.tensor(0.5, dtype=torch.float16), state)
        tensor(32768.)
    """
    check_loss("scale_loss", loss)
    if not isinstance(state, (MixedPrecisionState, LossScaleState)):
        raise TypeError(f"scale_loss: state must be a MixedPrecisionState (the state of "
                        f"mixed_precision) or a LossScaleState, got {type(state).__name__}.")
    ls = state.loss_scale if isinstance(state, MixedPrecisionState) else state
    wide = torch.promote_types(loss.dtype, torch.float32)
    return loss.to(wide) * ls.scale.to(wide)


def select_tree(found_inf: torch.Tensor, old: Any, new: Any, *, name: str = "state") -> Any:
    """Leaf by leaf, ``old`` where ``found_inf`` is true and ``new`` elsewhere.

    Bitwise: a selected old leaf is exactly the old tensor (nan payloads and signed zeros
    included), and every result leaf has the old leaf's dtype, so a state's dtypes do not
    drift from step to step. ``old`` and ``new`` must have the same structure and, leaf by
    leaf, the same shape (``torch.where`` would otherwise broadcast a stale value silently);
    a leaf that is the same object on both sides (``None``, a constant) is kept as it is.

    Raises:
        ValueError: the structures differ, or a leaf changed shape (naming the leaf).
        TypeError: a leaf that changed is not a tensor on both sides (naming the leaf).

    Examples:
        >>> import torch
        >>> from functopt.precision import select_tree
        >>> old = {"m": torch.tensor([1.0]), "c": None}
        >>> new = {"m": torch.tensor([2.0]), "c": None}
        >>> select_tree(torch.tensor(True), old, new), select_tree(torch.tensor(False), old, new)
        ({'m': tensor([1.]), 'c': None}, {'m': tensor([2.]), 'c': None})
    """
    return _common.select_tree(found_inf, old, new, owner="select_tree", name=name)


def _zero_metrics(device: torch.device, count_zeros: bool) -> StepMetrics:
    """The metrics before any step: nothing measured; ``num_zeros`` -1 where zeros are not
    counted, as every step then reports."""
    return StepMetrics(
        grad_norm=torch.zeros((), dtype=torch.float32, device=device),
        found_inf=torch.zeros((), dtype=torch.bool, device=device),
        skipped_steps=torch.zeros((), dtype=torch.int32, device=device),
        num_zeros=torch.full((), 0 if count_zeros else -1, dtype=torch.int64, device=device),
    )


def mixed_precision(
    inner: GradientTransformation,
    *,
    loss_scale: LossScale | None = None,
    master_weights: MasterWeights | None = None,
    max_grad_norm: float | torch.Tensor | NormClip | None = None,
    process_group: dist.ProcessGroup | None = None,
    replicated: Replicated = None,
    agree_skip: bool | dist.ProcessGroup = False,
    agree_timeout: float | datetime.timedelta | None = None,
    count_zeros: bool = False,
    donate: bool = False,
    fused: bool = True,
    compile: bool = False,
) -> MixedPrecisionTransformation:
    r"""A complete mixed-precision optimizer step around ``inner``.

    With the default [`float32_master`][functopt.precision.float32_master], params narrower
    than float32 (bfloat16, float16) get a float32 master copy; ``inner`` sees only float32
    gradients and params, and after every step each such param is bitwise
    ``master.to(param.dtype)``. On overflow (an inf or nan anywhere, or a global norm that
    overflows float32) the step is skipped: params, master and inner state stay bitwise as
    they were; only the loss scale, the metrics and the key move. Params without a master
    (float32, float64) are updated as ``param + update`` in their own precision.

    The order of operations (as Megatron-LM's ``MixedPrecisionOptimizer.step``): unscale
    the gradients into the master precision, compute their norm, non-finite count and zero
    count in one pass, adjust the loss scale, clip by that norm, run ``inner`` on the
    masters (so weight decay reads the master), and write the params from the new masters
    where the step is finite. Unscaling is exact for power-of-two loss scales (every scale
    of [`dynamic_loss_scale`][functopt.dynamic_loss_scale] with its default factors and a
    power-of-two ``init_scale``); other scales work but round, to a relative error below
    $2^{-22}$, as in ``GradScaler``.

    Gradients come in each param's dtype (as autograd makes them) or in its master's
    precision (float32 main grads, as Megatron-LM accumulates them). The step raises, naming
    the leaf, on gradients of another structure, shape, dtype or device, on a gradient for
    a ``None`` param, and on a state whose masters do not fit the params. A ``None``
    gradient leaves its param, master and per-leaf inner state unchanged.

    Args:
        inner: the update rule, e.g. ``functopt.adamw(1e-3)`` (without its own clipping:
            use ``max_grad_norm``, which reuses the step's single reduction).
        loss_scale: [`dynamic_loss_scale`][functopt.dynamic_loss_scale] (float16),
            [`static_loss_scale`][functopt.static_loss_scale], or None for no scaling
            (usual for bfloat16).
        master_weights: how params are kept exact (default: a float32 master copy).
        max_grad_norm: clip the unscaled gradients to this global L2 norm, or None
            (a positive number, or a 0-d tensor; or a
            [`NormClip`][functopt.precision.NormClip] for LightRFT's rule). ``metrics.grad_norm`` is the norm before
            clipping, as in Megatron-LM and ``torch.nn.utils.clip_grad_norm_``.
        process_group: the ranks the gradient statistics are summed over, with one
            ``all_reduce`` per step. ``None`` infers it from DTensor params (FSDP2): the
            group of their device mesh; plain tensor params need no reduction. Pass a group
            to sum over its ranks (DTensors are then counted by their placements relative
            to it); plain tensor params in such a sum need ``replicated``.
        replicated: how plain tensor params repeat over the ranks of the group (given, or
            inferred from DTensor params): ``False`` for this rank's own part (summed: a
            hand-sharded slice), ``True`` for the same values on every rank (counted once:
            a param left out of the tensor-parallel plan), a ``ProcessGroup`` for the same
            values over a subgroup; one value, a pytree of them with the params' structure
            (or a prefix), or a function of the params. See
            [`global_grad_stats`][functopt.distributed.global_grad_stats]. Without it, a
            plain param in a sum over a group raises, saying how to declare it. A DTensor
            param on a sub-mesh of the group (under FSDP2 x TP, a param left out of the
            tensor-parallel plan lives on the data-parallel mesh only) needs a declaration
            too: ``True``, the group it repeats over, or ``False``.
        agree_skip: agree the skip decision over a process group as well, so that no rank
            of it steps while another skips: ``True``, over the default group whenever
            ``torch.distributed`` is initialized; a ``ProcessGroup``, over its ranks (an
            optimizer that steps on some ranks only); ``False``, only where the statistics
            are summed (DTensor params, ``process_group``), each rank deciding alone
            otherwise. Only the overflow verdict is agreed, never the norm: packed into the
            statistics' all-reduce where that spans the group, else one all-reduce of one
            float64 (see ``functopt/_collective/agreement.py``).
            [`MixedPrecisionOptimizer`][functopt.MixedPrecisionOptimizer] agrees by
            default.
        agree_timeout: how long the agreement's collective may wait for the other ranks,
            in seconds or a ``datetime.timedelta`` (default 600 s); past it the step raises
            a ``RuntimeError`` naming the collective, the group's size and the likely
            cause. Only with ``agree_skip``.
        count_zeros: count the zero gradient elements into ``metrics.num_zeros``
            (Megatron-LM's ``count_zeros``; one more read of the gradients). Off by
            default, as in Megatron-LM: ``metrics.num_zeros`` is then -1.
        donate: the caller hands ``params`` and ``state`` over at every step: the fused
            path may overwrite their tensors (params, masters and moments are then
            updated in place, and returned) instead of writing new ones. The caller must
            not read the old values afterwards. Gradients are never written, and the
            pure path never writes into its inputs. The fused path then also keeps its
            float32 gradient casts between steps, in buffers reused by the next step
            (4 bytes per low-precision param, as the idiom's float32 main grads), one
            set per thread: threads may share the step function, each with its own
            state. It also remembers (weakly) the tensors it checked, so that a step over
            the same params, masters and moments skips the checks and the planner's
            lookup; the scalars a state shares with the previous one (an unchanged loss
            scale or flag) may be the same tensors.
        fused: lower ``inner`` to fused kernels when the step planner can (Adam/AdamW/SGD
            rules however composed: chains, masks, partitions, injected
            hyperparameters, a leading ``clip_by_global_norm``, a ``MultiSteps`` around
            them as the whole inner transform, whose mini-steps accumulate with
            ``foreach`` ops after the unscale, check and clip; see
            [`explain`][functopt.fast.explain]) and the masters are plain copies; the
            step then makes four passes over memory instead of about twenty, and agrees
            with the pure path to rounding (``functopt/precision/_fused.py`` lists the
            differences). Where it cannot, the step runs on the pure path and a
            [`FastPathWarning`][functopt.fast.FastPathWarning] says why. False forces the
            pure path (no warning), and so does a step that must stay differentiable
            (grad mode on and an input that requires grad, or ``torch.func`` inputs).
        compile: the planner's compiled tier for the inner elementwise rules (Lion,
            NAdam, RAdam, ..., and Adam, AdamW and SGD instead of their kernels; see
            [`make_step`][functopt.fast.make_step]): each
            group is one ``torch.compile``\ d call over the masters, the gradient casts and
            the state laid end to end; ``init`` then allocates each group's masters and
            per-leaf state as views of one buffer, which the call writes in place, and
            the call also writes the low-precision params (``lay_out(params)`` puts them,
            with their gradients, in one buffer per group, written in place). The first
            step of a group compiles (seconds). One pass then reads the gradient casts
            and writes masters, moments and params, where the kernels need a copy into the
            params after them.

    Returns:
        A [`MixedPrecisionTransformation`][functopt.precision.MixedPrecisionTransformation].

    Examples:
        >>> import torch, functopt
        >>> opt = functopt.precision.mixed_precision(
        ...     functopt.sgd(1.0), loss_scale=functopt.static_loss_scale(4.0))
        >>> params = {"w": torch.tensor([-0.5], dtype=torch.bfloat16)}
        >>> state = opt.init(params)
        >>> # a master just above -0.5 and an update that nearly cancels it
        >>> state = state._replace(master={"w": torch.tensor([-0.49991035])})
        >>> grads = {"w": torch.tensor([-0.49991038 * 4])}  # scaled by 4
        >>> params, state = opt.step(grads, state, params)
        >>> params["w"]  # the bfloat16 of the new master; p + (q - p) would give 0.0
        tensor([2.9802e-08], dtype=torch.bfloat16)
        >>> torch.equal(params["w"], state.master["w"].to(torch.bfloat16))
        True
    """
    return _mixed_precision(
        inner, loss_scale=loss_scale, master_weights=master_weights,
        max_grad_norm=max_grad_norm, process_group=process_group, replicated=replicated,
        agree_skip=agree_skip, agree_timeout=agree_timeout, count_zeros=count_zeros,
        donate=donate, fused=fused, compile=compile, wording=SKIP_AGREEMENT)


def _mixed_precision(
    inner: GradientTransformation, *, loss_scale: LossScale | None,
    master_weights: MasterWeights | None, max_grad_norm: float | torch.Tensor | NormClip | None,
    process_group: dist.ProcessGroup | None, replicated: Replicated,
    agree_skip: bool | dist.ProcessGroup, agree_timeout: float | datetime.timedelta | None,
    count_zeros: bool, donate: bool, fused: bool, compile: bool, wording: Wording,
) -> MixedPrecisionTransformation:
    """`mixed_precision`, whose bounded collectives' errors say ``wording`` (``zero1``
    bounds its statistics' all-reduce with its own ``timeout`` and words it as its own)."""
    check_inner(inner)
    inner = with_extra_args_support(inner)
    # MultiSteps as the inner transform, or in its chain: the step lowers it whole
    # (``fused_multi_step``), with the planner of what steps on a closing mini-step
    accumulated = _multi.Split.of(inner)
    planner = _planner.Planner(inner if accumulated is None else accumulated.closing)
    mw = float32_master() if master_weights is None else master_weights
    agree_timeout_s = check_options(
        loss_scale, mw, max_grad_norm, process_group, agree_skip, agree_timeout,
        dict(count_zeros=count_zeros, donate=donate, fused=fused, compile=compile))
    # the kernels write the store in place: only a plain copy allows it
    fast = fused and mw.plain_copy and not mw.needs_generator
    step = _MixedStep(
        inner=inner, accumulated=accumulated, planner=planner,
        scale_rule=loss_scale if loss_scale is not None else static_loss_scale(1.0),
        scaled=loss_scale is not None, mw=mw, max_grad_norm=max_grad_norm,
        process_group=process_group, replicated=replicated,
        agreed=functools.partial(agreement, agree_skip, agree_timeout_s, wording),
        count_zeros=count_zeros, donate=donate, compile=compile, fast=fast,
        # init and lay_out lay the compiled groups out for the planner's state (not
        # MultiSteps')
        laid_out=compile and fast and accumulated is None,
        # a donated fused step remembers the inputs it checked and lowered (_seen.py): a
        # later step on them skips the checks and the lowering
        remembers=fast and donate and accumulated is None and not compile and (
            process_group is None and replicated is None))
    explain_fn = functools.partial(
        _explain.explained, init=step.init, planner=planner, master_weights=mw,
        accumulated=accumulated, fused=fused, fast=fast, donate=donate, compile=compile,
        multiplied=loss_scale is not None or max_grad_norm is not None, count_zeros=count_zeros)
    return MixedPrecisionTransformation(step.init, step.step, step.buffers, step.lay_out,
                                        explain_fn)


class _Workspace(threading.local):
    """What a donating fused step keeps between its calls, per thread: two threads stepping
    two states with one step function must not cast into the same buffers."""

    def __init__(self) -> None:
        # the gradient casts, written over at every step (4 bytes per low-precision param,
        # as the PyTorch idiom's float32 main grads)
        self.buffers: list[Any] = []
        self.scratch: dict[Any, Any] = {}  # the compiled tier's gathered copies
        self.seen: list[Seen] = []  # the inputs it checked and lowered (_seen.py)


@dataclass(eq=False)
class _MixedStep:
    """The functions of a `mixed_precision` step, with its options resolved."""

    inner: GradientTransformation
    accumulated: _multi.Split | None
    planner: _planner.Planner
    scale_rule: LossScale
    scaled: bool  # a loss scale is given (without one the pure path multiplies by 1.0)
    mw: MasterWeights
    max_grad_norm: float | torch.Tensor | NormClip | None
    process_group: dist.ProcessGroup | None
    replicated: Replicated
    agreed: Callable[[], Agreement | None]  # the skip agreement of a step now
    count_zeros: bool
    donate: bool
    compile: bool
    fast: bool  # the fused path is tried
    laid_out: bool  # init and lay_out lay the compiled groups out
    remembers: bool  # the step remembers the inputs it checked (workspace.seen)
    workspace: _Workspace = field(default_factory=_Workspace)

    def __deepcopy__(self, memo: dict[int, Any]) -> _MixedStep:
        # a copied transformation shares its step, as it shares functions (deepcopy keeps
        # a function as it is): the per-thread workspace is scratch, the planner a memo
        return self

    def init(self, params: Params) -> MixedPrecisionState:
        mw = self.mw
        leaves, treespec = _core.flatten(params)
        _core.check_tensors(leaves, treespec, name="params", floating=True)
        store = [None if p is None else mw.init(p) for p in leaves]
        view = [None if p is None else mw.view(p, s) for p, s in zip(leaves, store, strict=True)]
        device = _first_device(leaves)
        inner_state = self.inner.init(_core.unflatten(treespec, view))
        if self.laid_out:
            # the compiled groups' masters and per-leaf state laid end to end
            store, inner_state = flat_init(self.planner, treespec, store, view, inner_state)
        return MixedPrecisionState(
            loss_scale=self.scale_rule.init(device),
            master=_core.unflatten(treespec, store),
            inner_state=inner_state,
            metrics=_zero_metrics(device, self.count_zeros),
            key=torch.zeros((), dtype=torch.int64),
        )

    def step(self, grads: Any, state: MixedPrecisionState, params: Params,
             **extra_args: Any) -> tuple[Params, MixedPrecisionState]:
        if _ops._recording():
            raise CaptureError(
                f"{OWNER}: the mixed-precision step cannot be recorded for replay (a CUDA "
                f"graph) yet: it keeps its key, the step count that seeds random rounding, "
                f"on the CPU, where a replay would not advance it. Fix: run this step "
                f"outside the recording (the forward and backward can still be captured), "
                f"or record a functopt.fast.make_step of a float32 chain.")
        if not isinstance(state, MixedPrecisionState):
            raise TypeError(
                f"{OWNER}: state must be the MixedPrecisionState returned by init or step, got "
                f"{type(state).__name__}. Fix: call step(grads, state, params) in this order, "
                f"with state = opt.init(params) before the first step."
            )
        if self.remembers and not differentiated(params, grads, state):
            again = self.recalled(grads, state, params)
            if again is not None:
                return again
        checked = checked_leaves(self.mw, self.process_group, self.replicated, grads,
                                 state.master, params)
        if self.fast and not differentiated(params, grads, state):
            lowered = self.fused_step(checked, state)
            if isinstance(lowered, str):
                _errors.warn_lost(OWNER, lowered, stacklevel=2)
            else:
                return self.fast_result(lowered, checked.treespec, state)
        return self.pure_step(checked, state, extra_args)

    def fused_step(self, c: Checked, state: MixedPrecisionState,
                   ) -> tuple[list[Any], list[Any], Any, GradStats, LossScaleState] | str:
        """The step on the planner's kernels, or why it has none (before any write)."""
        with torch.no_grad():  # donated params may be leaves that require grad
            options = self.fast_options(c.treespec, c.group, c.name, c.counted)
            if self.accumulated is not None:
                return fused_multi_step(
                    self.accumulated, self.planner, c.params, c.store, c.view, c.grads,
                    state.inner_state, state.loss_scale, **options)
            lowering = _lowered(self.planner, c.treespec, c.params, c.store, c.view, c.grads,
                                state.inner_state, c.name, self.donate, self.compile)
            lowered = fused_mixed_step(
                self.planner, c.params, c.store, c.view, c.grads, state.inner_state,
                state.loss_scale, lowering=lowering, metrics=state.metrics, **options)
            if self.remembers and not isinstance(lowered, str):
                seen = Seen.of(c.params, c.treespec, c.grads, c.store, c.view, lowering,
                               c.name, c.counted)
                if seen is not None:  # (replaced whole: a reader keeps its list)
                    self.workspace.seen = [seen, *[s for s in self.workspace.seen if (
                        s.treespec != c.treespec)][:Seen.KEPT - 1]]
            return lowered

    def pure_step(self, c: Checked, state: MixedPrecisionState, extra_args: dict[str, Any],
                  ) -> tuple[Params, MixedPrecisionState]:
        """The step as the module docstring writes it, one pass per operation."""
        mw, treespec = self.mw, c.treespec
        # 1. unscale in the precision of the value updated; 1/scale rounded once to float32,
        # as GradScaler does (exact for power-of-two scales).
        inv_scale = _inverse(state.loss_scale)
        # (checked_leaves made sure that every gradient has a param, hence a view.)
        unscaled = [None if g is None or v is None else g.to(v.dtype) * inv_scale
                    for g, v in zip(c.grads, c.view, strict=True)]
        # 2. one statistics pass over the local shards, one all-reduce when the params are
        # DTensors (or a group is given): every rank then skips or steps alike; with
        # agree_skip, the overflow verdict of plain tensors too.
        # 3. The loss scale moves whatever happens.
        packed = reduce_stats(
            local_stats(unscaled, c.name, state.loss_scale.scale.device, c.counted), c.group,
            self.agreed())
        stats = unpack_grad_stats(packed)
        new_loss_scale = self.scale_rule.adjust(state.loss_scale, stats.found_inf)
        # 4. clip with the same statistics (optax's rule: only when the norm exceeds the bound).
        if self.max_grad_norm is not None:
            factor = _clip_factor(packed, self.max_grad_norm)
            unscaled = [None if g is None else g * factor.to(g.dtype) for g in unscaled]
        # 5. the inner rule on master-precision params.
        updates, new_inner = self.inner.update(
            _core.unflatten(treespec, unscaled), state.inner_state,
            _core.unflatten(treespec, c.view), **extra_args,
        )
        update_leaves = _core.flatten_like(treespec, updates, name="the inner updates",
                                           reference="params")
        check_updates(update_leaves, c.view, treespec)
        # 6. write through the strategy, then keep the old values where the step overflowed.
        generator = None
        if mw.needs_generator:
            generator = torch.Generator(device=_first_device(c.params))
            generator.manual_seed(int(state.key))  # a CPU tensor: no device sync
        found = stats.found_inf
        cond = _common.OnDevice(found)
        new_params: list[Any] = []
        new_store: list[Any] = []
        for i, (p, s, v, u) in enumerate(
            zip(c.params, c.store, c.view, update_leaves, strict=True)
        ):
            if p is None or u is None:
                new_params.append(p)
                new_store.append(s)
                continue
            wp, ws = mw.write(p, s, v + u, generator)
            if wp.dtype != p.dtype or wp.shape != p.shape:
                raise ValueError(
                    f"{OWNER}: {_core.paths(treespec)[i]!r}: the master-weight strategy wrote "
                    f"{_core._describe(wp)} for {_core._describe(p)}. Fix: build the state with "
                    f"init(params) on the params you step (state.master must match them)."
                )
            keep = cond.on(p.device)
            new_params.append(torch.where(keep, p, wp))
            new_store.append(None if s is None or ws is None else torch.where(keep, s, ws))
        new_state = MixedPrecisionState(
            loss_scale=new_loss_scale,
            master=_core.unflatten(treespec, new_store),
            inner_state=select_tree(found, state.inner_state, new_inner, name="inner state"),
            metrics=_metrics(stats, state.metrics, self.count_zeros),
            key=state.key + 1,
        )
        return _core.unflatten(treespec, new_params), new_state

    def fast_options(self, treespec: Any, group: Any, name: Callable[[int], str],
                     counted: list[bool]) -> dict[str, Any]:
        donate = self.donate
        return dict(treespec=treespec, scale_rule=self.scale_rule, scaled=self.scaled,
                    max_grad_norm=self.max_grad_norm, group=group, name=name, counted=counted,
                    agreed=self.agreed(), count_zeros=self.count_zeros, donate=donate,
                    compiled=self.compile,
                    workspace=self.workspace.buffers if donate else None,
                    scratch=self.workspace.scratch if donate else None)

    def fast_result(self, result: tuple[list[Any], list[Any], Any, GradStats, LossScaleState],
                    treespec: Any, state: MixedPrecisionState,
                    ) -> tuple[Params, MixedPrecisionState]:
        fast_params, fast_store, fast_inner, fast_stats, fast_scale = result
        host = _host.on_host(fast_stats.found_inf, *state.metrics, state.key)
        return _core.unflatten(treespec, fast_params), MixedPrecisionState(
            loss_scale=fast_scale,
            master=_core.unflatten(treespec, fast_store),
            inner_state=fast_inner,
            metrics=_host_metrics(fast_stats, state.metrics, self.count_zeros, self.donate)
            if host else _metrics(fast_stats, state.metrics, self.count_zeros),
            key=_host.scalar(_host.wrap(int(state.key) + 1, _host.INT64), state.key)
            if host else state.key + 1,
        )

    def recalled(self, grads: Any, state: MixedPrecisionState, params: Params,
                 ) -> tuple[Params, MixedPrecisionState] | None:
        """The step on inputs a previous step checked and lowered (None: not those)."""
        for seen in self.workspace.seen:
            found = seen.match(grads, state, params)
            if found is None:
                continue
            param_leaves, grad_leaves, store, inner_leaves = found
            view = [None if p is None else self.mw.view(p, s)
                    for p, s in zip(param_leaves, store, strict=True)]
            structure, _, lowered = seen.lowering
            with torch.no_grad():
                result = fused_mixed_step(
                    self.planner, param_leaves, store, view, grad_leaves, state.inner_state,
                    state.loss_scale, lowering=(structure, inner_leaves, lowered),
                    metrics=state.metrics, casts=seen.casts,
                    **self.fast_options(seen.treespec, None, seen.name, seen.counted))
            # (a refusal: the full step says why, and warns)
            return None if isinstance(result, str) else self.fast_result(
                result, seen.treespec, state)
        return None

    def buffers(self) -> list[torch.Tensor]:
        return [t for t in self.workspace.buffers if t is not None]

    def lay_out(self, params: Params) -> Params:
        if self.laid_out:
            leaves, treespec = _core.flatten(params)
            _core.check_tensors(leaves, treespec, name="params", floating=True)
            lay_out_params(self.planner, treespec, leaves, self.mw, self.inner,
                           _leaf_names(treespec))
        return params


def _metrics(stats: GradStats, old: StepMetrics, count_zeros: bool) -> StepMetrics:
    found = stats.found_inf
    return StepMetrics(
        grad_norm=stats.norm,
        found_inf=found,
        skipped_steps=torch.where(found, _common.safe_increment(old.skipped_steps),
                                  old.skipped_steps),
        num_zeros=stats.num_zeros if count_zeros else torch.full_like(stats.num_zeros, -1),
    )


def _host_metrics(stats: GradStats, old: StepMetrics, count_zeros: bool,
                  reuse: bool) -> StepMetrics:
    """`_metrics` on the host, for plain CPU tensors (one read of ``found_inf``): bitwise
    the same metrics. ``reuse``: an entry that does not move keeps its tensor (the state
    was donated)."""
    found = bool(stats.found_inf)
    skipped = int(old.skipped_steps)
    if found and skipped < _common.INT32_MAX:  # (safe_increment saturates)
        skipped += 1
    return StepMetrics(
        grad_norm=stats.norm,
        found_inf=stats.found_inf,
        skipped_steps=_host.kept(skipped, old.skipped_steps, reuse),
        num_zeros=stats.num_zeros if count_zeros else _host.kept(-1, old.num_zeros, reuse),
    )


def _first_device(leaves: list[Any]) -> torch.device:
    return next((p.device for p in leaves if p is not None), torch.device("cpu"))
