"""Loss scales: the rule that moves the scale of a mixed-precision step, as pure functions.

A loss scale is a pair of functions over an explicit [`LossScaleState`][functopt.LossScaleState] (0-d tensors,
so no host sync is needed and nothing recompiles when the scale moves). One dynamic rule
covers both systems users migrate between:

* ``hysteresis=1`` and no floor: PyTorch's ``GradScaler`` rule (backoff on every overflow;
  grow after ``growth_interval`` finite steps in a row; never grow to inf), the rule of
  PyTorch's own ``torch._amp_update_scale_`` kernel.
* ``hysteresis=H``: Megatron-LM's ``DynamicGradScaler`` (also LightRFT's): an overflow
  resets the growth count and uses up one of ``H`` tolerated overflows; the scale backs off
  only when none is left; the count of tolerated overflows is refilled on growth, not on
  every finite step. The scale is clamped to ``[min_scale, max_scale]``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from functopt import _validate
from functopt.precision import _host

__all__ = [
    "LossScale",
    "LossScaleState",
    "LossScaleWarning",
    "dynamic_loss_scale",
    "loss_scale_collapsed",
    "static_loss_scale",
]

# Below float32's smallest normal number a loss scale has no use: any loss below about 1
# times it is subnormal or zero in float32, and with no floor the next backoffs reach 0.0,
# where every later step scales the loss to zero and never recovers.
COLLAPSED_BELOW = torch.finfo(torch.float32).tiny

LOSS_SCALE_COLLAPSED = (
    "the dynamic loss scale has collapsed to {scale!r} (below float32's smallest normal "
    "number, {floor!r}) after a run of overflowing steps: every step is being skipped, and "
    "a scale of 0.0 never takes a step again. The gradients are inf or nan at any scale: "
    "look for an inf or nan in the loss or the model (a bad batch, a too large learning "
    "rate, a float16 overflow in the forward pass). Fix: find the non-finite values; to "
    "stop the collapse itself, give the rule a floor (dynamic_loss_scale(min_scale=1.0), "
    "Megatron-LM's default), and resume from a checkpoint taken before the run."
)


class LossScaleWarning(UserWarning):
    """A dynamic loss scale has collapsed (see
    [`loss_scale_collapsed`][functopt.precision.loss_scale_collapsed]): the steps are being
    skipped and the training has stopped making progress. Raised by
    [`MixedPrecisionOptimizer.step`][functopt.adapters.MixedPrecisionOptimizer] on a skipped
    step (it reads the skip decision anyway); the functional step never reads a value back,
    so a loop over [`mixed_precision`][functopt.precision.mixed_precision] checks
    ``loss_scale_collapsed(state.loss_scale)`` where it reads its metrics.

    Examples:
        >>> import warnings, torch, functopt
        >>> from functopt.precision import LossScaleWarning
        >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> opt = functopt.adapters.MixedPrecisionOptimizer([w], functopt.sgd(0.1))
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     for _ in range(170):  # 2**16 halved on every overflow: 0.0 after 166
        ...         w.grad = torch.full_like(w, float("inf"))
        ...         _ = opt.step()
        >>> caught[0].category is LossScaleWarning, opt.loss_scale
        (True, 0.0)
    """


def loss_scale_collapsed(state: LossScaleState) -> torch.Tensor:
    """Whether the loss scale has collapsed: a 0-d bool tensor, read nothing back to the host.

    True when ``state.scale`` is below float32's smallest normal number (``2**-126``):
    PyTorch's rule with no floor (the default ``dynamic_loss_scale()``, like
    ``torch.amp.GradScaler``) halves the scale on every overflow and reaches ``0.0``
    after about 165 overflows in a row from ``2**16``, from where no step is ever taken
    again; no legitimate loss needs a scale that small. A rule with a ``min_scale`` never
    collapses.

    Examples:
        >>> import torch, functopt
        >>> from functopt.precision import loss_scale_collapsed
        >>> ls = functopt.dynamic_loss_scale(init_scale=2.0**-125)
        >>> state = ls.init()
        >>> bool(loss_scale_collapsed(state))
        False
        >>> bool(loss_scale_collapsed(ls.adjust(ls.adjust(state, torch.tensor(True)),
        ...                                     torch.tensor(True))))
        True
    """
    out: torch.Tensor = state.scale < COLLAPSED_BELOW
    return out


def _warn_if_collapsed(state: LossScaleState, stacklevel: int) -> bool:
    """Warn with ``LossScaleWarning`` (one host read of the scale) if it has collapsed;
    ``stacklevel`` counts from the caller of this function."""
    scale = float(state.scale)
    if not scale < COLLAPSED_BELOW:
        return False
    warnings.warn(LOSS_SCALE_COLLAPSED.format(scale=scale, floor=COLLAPSED_BELOW),
                  LossScaleWarning, stacklevel=stacklevel + 1)
    return True


class LossScaleState(NamedTuple):
    """State of a loss scale."""

    scale: torch.Tensor  # float32, shape (): the current loss scale
    growth_tracker: torch.Tensor  # int32, shape (): finite steps since the last growth/overflow
    hysteresis_tracker: torch.Tensor  # int32, shape (): overflows still tolerated before backoff


class LossScale(NamedTuple):
    """A loss-scale rule: ``init(device=None) -> state``, ``adjust(state, found_inf) -> state``.

    ``found_inf`` is a 0-d tensor (bool, or float as PyTorch's kernels produce: nonzero
    means the step's gradients had an inf or nan). ``dynamic`` tells whether ``adjust`` can
    move the scale.
    """

    init: Callable[..., LossScaleState]
    adjust: Callable[[LossScaleState, torch.Tensor], LossScaleState]
    dynamic: bool
    # The factory's arguments, for checkpoints to record and check (see _RULE_FIELDS):
    # (scale,) for static_loss_scale, the seven arguments of dynamic_loss_scale (None for
    # no floor or ceiling); () for a rule built by hand.
    config: tuple[float | None, ...] = ()


# A rule as a fixed-length vector, for a checkpoint (nan: not given or not applicable).
_RULE_FIELDS = ("kind", "init_scale", "growth_factor", "backoff_factor", "growth_interval",
                "hysteresis", "min_scale", "max_scale")
_KINDS = {0.0: "no loss scale (loss_scale=None)", 1.0: "static_loss_scale",
          2.0: "dynamic_loss_scale", 3.0: "a LossScale built by hand"}


def _rule_vector(rule: LossScale | None) -> torch.Tensor:
    """``rule`` as a float64 tensor of shape (8,) (``_RULE_FIELDS``), the same length for
    every rule so that a checkpoint template of any optimizer can load any checkpoint."""
    values = [math.nan] * len(_RULE_FIELDS)
    if rule is None:
        values[0] = 0.0
    elif not rule.config:
        values[0] = 3.0
    elif not rule.dynamic:
        values[0], values[1] = 1.0, float(rule.config[0] or math.nan)
    else:
        values[0] = 2.0
        for i, v in enumerate(rule.config):
            values[1 + i] = math.nan if v is None else float(v)
    return torch.tensor(values, dtype=torch.float64)


def _describe_rule(vector: torch.Tensor) -> str:
    values = vector.tolist()
    kind = _KINDS.get(values[0], f"an unknown rule code {values[0]!r}")
    args = [f"{name}={int(v) if name in ('growth_interval', 'hysteresis') else v!r}"
            for name, v in zip(_RULE_FIELDS[1:], values[1:], strict=True) if not math.isnan(v)]
    return f"{kind}({', '.join(args)})" if args else kind


def _same_rule(saved: torch.Tensor, current: torch.Tensor) -> bool:
    """Whether a checkpoint's rule is this one's: the kind and every argument but the
    initial scale (the checkpoint carries the scale reached)."""
    if saved.shape != current.shape:
        return False
    keep = torch.ones(len(_RULE_FIELDS), dtype=torch.bool)
    keep[1] = bool(current[0] == 1.0)  # a static scale is its initial scale
    a, b = saved.double()[keep], current.double()[keep]
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _inverse(state: LossScaleState) -> torch.Tensor:
    """``1 / scale`` computed in float64 and rounded once to float32, as ``GradScaler``
    does: exact for power-of-two scales."""
    return state.scale.double().reciprocal().float()


def _check_scale(owner: str, name: str, value: float | None) -> None:
    if value is None:
        return
    _validate.check_range(owner, name, value, low=0.0, low_open=True)
    if not math.isfinite(value) or value > torch.finfo(torch.float32).max:
        raise ValueError(f"{owner}: {name} must be a finite float32 value, got {value!r}.")


def _state(scale: float, hysteresis: int, device: torch.device | str | None) -> LossScaleState:
    return LossScaleState(
        scale=torch.tensor(scale, dtype=torch.float32, device=device),
        growth_tracker=torch.zeros((), dtype=torch.int32, device=device),
        hysteresis_tracker=torch.tensor(hysteresis, dtype=torch.int32, device=device),
    )


class _Static:
    """``static_loss_scale``'s ``adjust``: the state as it is."""

    def __call__(self, state: LossScaleState, found_inf: torch.Tensor) -> LossScaleState:
        del found_inf
        return state


class _Dynamic:
    """``dynamic_loss_scale``'s ``adjust`` (``__call__``, on 0-d tensors), and the same rule
    on the host (`host`, for the fused step's CPU bookkeeping: see precision/_host.py)."""

    def __init__(self, growth_factor: float, backoff_factor: float, growth_interval: int,
                 hysteresis: int, min_scale: float | None, max_scale: float | None) -> None:
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.min_scale, self.max_scale = min_scale, max_scale
        # the host rule reproduces the int32 arithmetic of arguments that fit in int32
        # (a larger one is compared and multiplied by torch's own rules: left to them)
        self.on_host = _host.fits_int32(growth_interval) and _host.fits_int32(hysteresis)

    def __call__(self, state: LossScaleState, found_inf: torch.Tensor) -> LossScaleState:
        overflow = found_inf.to(device=state.scale.device, dtype=torch.bool)
        one = torch.ones((), dtype=torch.int32, device=state.scale.device)
        # Overflow branch: spend one tolerated overflow; back off when none is left.
        # (Floored at 0: below that every overflow backs off anyway, and int32 cannot wrap.)
        hysteresis_left = torch.clamp(state.hysteresis_tracker - one, min=0)
        # Products in float64, rounded once to float32, as PyTorch's kernel computes them.
        wide = state.scale.to(torch.float64)
        backed_off = torch.where(
            hysteresis_left <= 0, (wide * self.backoff_factor).to(torch.float32), state.scale
        )
        # Finite branch: count; grow (if the grown scale stays finite) at the interval.
        grown_count = state.growth_tracker + one
        at_interval = grown_count >= self.growth_interval
        candidate = (wide * self.growth_factor).to(torch.float32)
        grows = at_interval & torch.isfinite(candidate)
        scale = torch.where(overflow, backed_off, torch.where(grows, candidate, state.scale))
        if self.min_scale is not None or self.max_scale is not None:
            scale = torch.clamp(scale, min=self.min_scale, max=self.max_scale)
        growth_tracker = torch.where(overflow | at_interval, 0 * one, grown_count)
        hysteresis_tracker = torch.where(
            overflow, hysteresis_left, torch.where(at_interval, self.hysteresis * one,
                                                   state.hysteresis_tracker)
        )
        return LossScaleState(scale, growth_tracker, hysteresis_tracker)

    def host(self, scale: float, growth_tracker: int, hysteresis_tracker: int,
             overflow: bool) -> tuple[float, int, int]:
        """`__call__` on the state's values read on the host: ``(scale, growth_tracker,
        hysteresis_tracker)`` after a step that overflowed or not; bitwise the tensors'."""
        f32, wrap = _host.f32, _host.wrap
        hysteresis_left = max(wrap(hysteresis_tracker - 1, _host.INT32), 0)
        grown_count = wrap(growth_tracker + 1, _host.INT32)
        at_interval = grown_count >= self.growth_interval
        if overflow:
            new = f32(scale * self.backoff_factor) if hysteresis_left <= 0 else scale
        else:
            candidate = f32(scale * self.growth_factor)
            new = candidate if at_interval and math.isfinite(candidate) else scale
        if not math.isnan(new):  # (clamp keeps a nan)
            if self.min_scale is not None:
                new = max(new, f32(self.min_scale))  # the bounds in the scale's dtype
            if self.max_scale is not None:
                new = min(new, f32(self.max_scale))
        if overflow:
            return new, 0, hysteresis_left
        if at_interval:
            return new, 0, self.hysteresis
        return new, grown_count, hysteresis_tracker


def has_host_rule(rule: LossScale) -> bool:
    """Whether `host_adjust` can run ``rule`` (a built-in rule; not one built by hand,
    whose ``adjust`` only the tensors can run)."""
    adjust = rule.adjust
    return isinstance(adjust, _Static) or (isinstance(adjust, _Dynamic) and adjust.on_host)


def host_adjust(rule: LossScale, state: LossScaleState, overflow: bool,
                reuse: bool) -> LossScaleState:
    """``rule.adjust(state, found_inf)`` computed on the host, for a rule `has_host_rule`
    accepts and a state of plain CPU tensors, with the overflow decision read already:
    bitwise the same state. ``reuse``: a value that does not move keeps its tensor (the
    state was donated), else every entry is a new tensor."""
    adjust = rule.adjust
    if isinstance(adjust, _Static):
        return state  # as its adjust returns it
    assert isinstance(adjust, _Dynamic)
    scale, growth, hysteresis = adjust.host(state.scale.item(), int(state.growth_tracker),
                                            int(state.hysteresis_tracker), overflow)
    return LossScaleState(_host.kept(scale, state.scale, reuse),
                          _host.kept(growth, state.growth_tracker, reuse),
                          _host.kept(hysteresis, state.hysteresis_tracker, reuse))


def static_loss_scale(scale: float) -> LossScale:
    """A constant loss scale (``adjust`` returns the state unchanged).

    Examples:
        >>> import torch, functopt
        >>> ls = functopt.static_loss_scale(128.0)
        >>> state = ls.adjust(ls.init(), torch.tensor(True))
        >>> state.scale
        tensor(128.)
    """
    _check_scale("static_loss_scale", "scale", scale)

    def init(device: torch.device | str | None = None) -> LossScaleState:
        return _state(scale, 1, device)

    return LossScale(init, _Static(), dynamic=False, config=(scale,))


def dynamic_loss_scale(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    hysteresis: int = 1,
    min_scale: float | None = None,
    max_scale: float | None = None,
) -> LossScale:
    r"""A dynamic loss scale: back off on overflow, grow after a run of finite steps.

    On a finite step the growth count rises; when it reaches ``growth_interval`` the scale
    is multiplied by ``growth_factor`` (unless that would overflow float32), the count
    restarts and the hysteresis count is refilled to ``hysteresis``. On an overflow the
    growth count restarts and the hysteresis count drops by one; when it reaches zero the
    scale is multiplied by ``backoff_factor``. The result is clamped to
    ``[min_scale, max_scale]``.

    ``hysteresis=1`` with no ``min_scale``/``max_scale`` is PyTorch's ``GradScaler`` rule
    (bitwise the rule of ``torch._amp_update_scale_``); ``hysteresis=2, min_scale=1`` is
    Megatron-LM's defaults for its ``DynamicGradScaler``. Without ``min_scale`` a long run of
    overflows halves the scale down to ``0.0`` (from ``2**16``, about 165 overflows),
    from where no step is taken again, as with PyTorch's rule;
    [`loss_scale_collapsed`][functopt.precision.loss_scale_collapsed] detects it and
    [`MixedPrecisionOptimizer`][functopt.adapters.MixedPrecisionOptimizer] warns with a
    [`LossScaleWarning`][functopt.precision.LossScaleWarning].

    Args:
        init_scale: the first scale (PyTorch: 2**16; Megatron: 2**32).
        growth_factor: > 1. Powers of two keep scaling and unscaling exact.
        backoff_factor: in (0, 1).
        growth_interval: finite steps in a row before a growth, >= 1.
        hysteresis: overflows tolerated (since the last growth) before a backoff, >= 1.
        min_scale: floor of the scale, or None.
        max_scale: ceiling of the scale, or None.

    Examples:
        >>> import torch, functopt
        >>> ls = functopt.dynamic_loss_scale(init_scale=16.0, growth_interval=3, hysteresis=2,
        ...                                  min_scale=1.0)
        >>> state, trace = ls.init(), []
        >>> for overflow in "FFFIFIIIFFF":
        ...     state = ls.adjust(state, torch.tensor(overflow == "I"))
        ...     trace.append(int(state.scale))
        >>> trace  # Megatron's rule
        [16, 16, 32, 32, 32, 16, 8, 4, 4, 4, 8]
    """
    owner = "dynamic_loss_scale"
    _check_scale(owner, "init_scale", init_scale)
    _validate.check_range(owner, "growth_factor", growth_factor, low=1.0, low_open=True)
    _validate.check_range(owner, "backoff_factor", backoff_factor, low=0.0, high=1.0,
                          low_open=True, high_open=True)
    for name, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}: {name} must be an int >= 1, got {value!r}.")
    _check_scale(owner, "min_scale", min_scale)
    _check_scale(owner, "max_scale", max_scale)
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        raise ValueError(
            f"{owner}: min_scale ({min_scale!r}) must not exceed max_scale ({max_scale!r})."
        )
    if (min_scale is not None and init_scale < min_scale) or (
        max_scale is not None and init_scale > max_scale
    ):
        raise ValueError(
            f"{owner}: init_scale {init_scale!r} lies outside [min_scale, max_scale] = "
            f"[{min_scale!r}, {max_scale!r}]."
        )

    def init(device: torch.device | str | None = None) -> LossScaleState:
        return _state(init_scale, hysteresis, device)

    adjust = _Dynamic(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
                      max_scale)
    return LossScale(init, adjust, dynamic=True, config=(
        init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
        max_scale))
