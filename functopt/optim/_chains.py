"""The chains behind ``functopt.optim``: torch.optim's rules as functopt transforms.

Each factory takes the numeric hyperparameters under the names ``functopt.Optimizer``
exposes in ``param_groups`` (``learning_rate`` as ``lr``, ``b1, b2`` as ``betas``, the others
as they are) and the options that select stages as keywords. A hyperparameter passed as
None has no stage (torch skips its maths when it is 0). ``maximize`` negates the gradient
first, as torch does, so that the weight decay then pulls towards 0 as in descent.
"""

from __future__ import annotations

from typing import Any

import torch

from functopt._base import GradientTransformation, identity
from functopt.contrib._muon import MuonDimensionNumbers, _scale_by_shape, scale_by_muon
from functopt.transforms.accumulation import dampened_trace, trace
from functopt.transforms.adding import add_decayed_weights
from functopt.transforms.combining import chain
from functopt.transforms.moments import (
    scale_by_adam,
    scale_by_adamax,
    scale_by_amsgrad,
    scale_by_nadam,
    scale_by_radam,
)
from functopt.transforms.rms import scale_by_adadelta, scale_by_rms, scale_by_rss, scale_by_stddev
from functopt.transforms.scaling import scale, scale_by_learning_rate
from functopt.transforms.sign import scale_by_rprop

__all__: list[str] = []


def _stages(maximize: bool, l2: Any, *middle: GradientTransformation) -> list[Any]:
    stages: list[Any] = [scale(-1.0)] if maximize else []
    if l2 is not None:
        stages.append(add_decayed_weights(l2))
    return [*stages, *middle]


def adam(
    learning_rate: Any, b1: Any, b2: Any, eps: Any, weight_decay: Any = None, *,
    decoupled: bool = False, amsgrad: bool = False, maximize: bool = False,
) -> GradientTransformation:
    """torch.optim.Adam / AdamW: the fused-kernel chain ``adam`` / ``adamw`` where it can be."""
    moments = (scale_by_amsgrad(b1=b1, b2=b2, eps=eps, correct_after_max=True) if amsgrad
               else scale_by_adam(b1=b1, b2=b2, eps=eps))
    if decoupled:
        return chain(*_stages(maximize, None, moments), add_decayed_weights(weight_decay),
                     scale_by_learning_rate(learning_rate))
    return chain(*_stages(maximize, weight_decay, moments), scale_by_learning_rate(learning_rate))


def sgd(
    learning_rate: Any, weight_decay: Any, momentum: Any = None, *,
    dampening: float = 0.0, nesterov: bool = False, maximize: bool = False,
) -> GradientTransformation:
    """torch.optim.SGD: ``[scale(-1)], add_decayed_weights, [trace], lr``."""
    if momentum is None:
        accumulate: GradientTransformation = identity()
    elif dampening == 0:
        accumulate = trace(decay=momentum, nesterov=nesterov)
    else:
        accumulate = dampened_trace(decay=momentum, dampening=dampening, nesterov=nesterov)
    return chain(*_stages(maximize, weight_decay, accumulate),
                 scale_by_learning_rate(learning_rate))


def rmsprop(
    learning_rate: Any, alpha: Any, eps: Any, weight_decay: Any = None, momentum: Any = None,
    *, centered: bool = False, maximize: bool = False,
) -> GradientTransformation:
    """torch.optim.RMSprop: eps outside the root, the momentum before the learning rate."""
    rms = (scale_by_stddev if centered else scale_by_rms)(decay=alpha, eps=eps,
                                                          eps_in_sqrt=False)
    accumulate = identity() if momentum is None else trace(decay=momentum)
    return chain(*_stages(maximize, weight_decay, rms, accumulate),
                 scale_by_learning_rate(learning_rate))


def adagrad(
    learning_rate: Any, lr_decay: Any, initial_accumulator_value: Any, eps: Any,
    weight_decay: Any = None, *, maximize: bool = False,
) -> GradientTransformation:
    """torch.optim.Adagrad: eps outside the root, lr / (1 + (t - 1) lr_decay)."""

    def decayed(count: Any) -> Any:
        return learning_rate / (1 + count * lr_decay)

    return chain(*_stages(maximize, weight_decay, scale_by_rss(
        initial_accumulator_value=initial_accumulator_value, eps=eps, eps_in_sqrt=False)),
        scale_by_learning_rate(decayed))


def nadam(
    learning_rate: Any, b1: Any, b2: Any, eps: Any, momentum_decay: Any,
    weight_decay: Any = None, *, decoupled: bool = False, maximize: bool = False,
) -> GradientTransformation:
    """torch.optim.NAdam: Dozat's momentum schedule (``scale_by_nadam``)."""
    moments = scale_by_nadam(b1=b1, b2=b2, eps=eps, momentum_decay=momentum_decay)
    if decoupled:
        return chain(*_stages(maximize, None, moments), add_decayed_weights(weight_decay),
                     scale_by_learning_rate(learning_rate))
    return chain(*_stages(maximize, weight_decay, moments), scale_by_learning_rate(learning_rate))


def radam(
    learning_rate: Any, b1: Any, b2: Any, eps: Any, weight_decay: Any = None, *,
    decoupled: bool = False, maximize: bool = False,
) -> GradientTransformation:
    """torch.optim.RAdam: ``scale_by_radam`` with torch's placement of eps."""
    moments = scale_by_radam(b1=b1, b2=b2, eps=eps, eps_before_correction=True)
    if decoupled:
        return chain(*_stages(maximize, None, moments), add_decayed_weights(weight_decay),
                     scale_by_learning_rate(learning_rate))
    return chain(*_stages(maximize, weight_decay, moments), scale_by_learning_rate(learning_rate))


def adamax(
    learning_rate: Any, b1: Any, b2: Any, eps: Any, weight_decay: Any = None, *,
    maximize: bool = False,
) -> GradientTransformation:
    """torch.optim.Adamax."""
    return chain(*_stages(maximize, weight_decay, scale_by_adamax(b1=b1, b2=b2, eps=eps)),
                 scale_by_learning_rate(learning_rate))


def adadelta(
    learning_rate: Any, rho: Any, eps: Any, weight_decay: Any = None, *,
    maximize: bool = False,
) -> GradientTransformation:
    """torch.optim.Adadelta."""
    return chain(*_stages(maximize, weight_decay, scale_by_adadelta(rho=rho, eps=eps)),
                 scale_by_learning_rate(learning_rate))


def rprop(
    learning_rate: Any, *, etas: tuple[float, float] = (0.5, 1.2),
    step_sizes: tuple[float, float] = (1e-6, 50.0), maximize: bool = False,
) -> GradientTransformation:
    """torch.optim.Rprop: the learning rate is the initial step size."""
    return chain(*_stages(maximize, None, scale_by_rprop(
        learning_rate, eta_minus=etas[0], eta_plus=etas[1], min_step_size=step_sizes[0],
        max_step_size=step_sizes[1])), scale(-1.0))


def muon(
    learning_rate: Any, momentum: Any, weight_decay: Any = None, *, nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315), eps: float = 1e-7,
    ns_steps: int = 5, adjust_lr_fn: str | None = None,
    ns_dtype: torch.dtype | None = torch.bfloat16,
) -> GradientTransformation:
    """torch.optim.Muon: ``(out, in)`` matrices, no bias correction, the norm clamped at
    eps, the decoupled weight decay at the unadjusted learning rate."""
    dims = MuonDimensionNumbers(reduction_axis=1, output_axis=0)
    return chain(
        scale_by_muon(ns_coeffs=ns_coefficients, ns_steps=ns_steps, beta=momentum, eps=eps,
                      nesterov=nesterov, weight_dimension_numbers=dims, ns_dtype=ns_dtype,
                      bias_correction=False, clamp_norm=True),
        _scale_by_shape(dims, 0.2 if adjust_lr_fn == "match_rms_adamw" else None),
        *([] if weight_decay is None else [add_decayed_weights(weight_decay)]),
        scale_by_learning_rate(learning_rate))
