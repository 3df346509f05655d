"""Gradient statistics of a mixed-precision step, computed in one pass and one reduction.

The step needs three numbers about all gradients together: the sum of squares (for the
global norm and clipping), the count of non-finite elements (for the overflow check), and
the count of zeros (Megatron's ``count_zeros``). They are computed per leaf, locally, and
packed into one small float64 tensor, so that a distributed step needs exactly one
all-reduce for all three, where per-tensor reductions would need one per leaf and per
statistic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from functopt._collective.stats import SUMSQ, ZEROS, local_stats, norm_and_overflow

__all__ = ["GradStats", "NormClip", "grad_stats", "unpack_grad_stats"]


class GradStats(NamedTuple):
    """Statistics of a set of gradients (all 0-d tensors)."""

    norm: torch.Tensor  # float32, (): global L2 norm (inf or nan when found_inf)
    found_inf: torch.Tensor  # bool, (): any element non-finite, or the norm overflowed
    num_zeros: torch.Tensor  # int64, (): number of elements equal to zero


@dataclass(frozen=True)
class NormClip:
    r"""A clip by the global norm with ``eps`` added to the norm: LightRFT's rule.

    Given as ``max_grad_norm`` (to [`mixed_precision`][functopt.precision.mixed_precision]
    or to ``MixedPrecisionOptimizer.clip_grad_norm(model, ...)``), the step multiplies the
    unscaled gradients by

    $$\frac{1}{\max\left(1, (\lVert g\rVert + \text{eps}) / \text{max\_norm}\right)}$$

    in float64, from the step's one statistics pass. ``eps=1e-6`` is the rule of
    LightRFT's ``FSDPadaptOptimizer`` (``lightrft/strategy/fsdp/fsdp_optimizer.py``,
    ``_unscale_and_clip_grads``), which clips slightly before the norm reaches
    ``max_norm``. ``eps=0`` is the rule of a plain number ``max_grad_norm``
    ([`clip_by_global_norm`][functopt.clip_by_global_norm]'s), bitwise.

    Attributes:
        max_norm: the bound, a finite number > 0.
        eps: added to the norm, a finite number >= 0.

    Raises:
        TypeError: a field is not a Python number.
        ValueError: a field is out of its range.

    Examples:
        >>> from functopt.precision import NormClip
        >>> NormClip(1.0, eps=1e-6)
        NormClip(max_norm=1.0, eps=1e-06)
    """

    max_norm: float
    eps: float = 0.0

    def __post_init__(self) -> None:
        for name, low in (("max_norm", None), ("eps", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"NormClip: {name} must be a Python number, got "
                    f"{type(value).__name__}."
                )
            if not math.isfinite(value) or (value < 0 if low is not None else value <= 0):
                raise ValueError(
                    f"NormClip: {name} must be a finite number "
                    f"{'>= 0' if low is not None else '> 0'}, got {value!r}."
                )
            object.__setattr__(self, name, float(value))


def grad_stats(grads: Sequence[torch.Tensor | None], device: torch.device | None = None) -> torch.Tensor:
    """Pack ``[sum of squares, non-finite count, zero count]`` of ``grads`` into one tensor.

    Each leaf's sum of squares is accumulated in float32 (float64 for float64 leaves) and
    the leaves' sums are added in float64; a leaf whose float32 norm overflows (above about
    ``1.8e19``) makes the norm inf, and the step counts it as an overflow, as
    ``clip_grad_norm_`` and Megatron do (a float64 accumulator would cost a float64 copy
    of every gradient, 20-35x the time of the float32 reduction on CPU). The counts are
    exact (up to $2^{53}$ elements).
    The packed result is a float64 tensor of shape ``(3,)``, ready for a single
    ``all_reduce(SUM)``. ``None`` leaves are skipped; a DTensor contributes its local
    shard where this rank counts it, as in
    [`local_grad_stats`][functopt.distributed.local_grad_stats], of which this is the
    view on a list.

    Examples:
        >>> import torch
        >>> from functopt.precision import grad_stats, unpack_grad_stats
        >>> packed = grad_stats([torch.tensor([3.0, 0.0]), torch.tensor([4.0])])
        >>> unpack_grad_stats(packed)
        GradStats(norm=tensor(5.), found_inf=tensor(False), num_zeros=tensor(1))
    """
    return local_stats(list(grads), "grads[{}]".format, device, owner="grad_stats")


def unpack_grad_stats(packed: torch.Tensor) -> GradStats:
    """Turn a (reduced) packed tensor into `GradStats`.

    The norm is returned in float32. Gradients whose float32 norm overflows (above about
    ``3.4e38``) count as an overflow even when every element is finite: the float32 norm
    reported in the metrics would be inf, and a step taken with such gradients has
    diverged anyway.

    Examples:
        >>> import torch
        >>> from functopt.precision import grad_stats, unpack_grad_stats
        >>> unpack_grad_stats(grad_stats([torch.tensor([3.0, 4.0, 0.0]), None]))
        GradStats(norm=tensor(5.), found_inf=tensor(False), num_zeros=tensor(1))
    """
    norm, found_inf = norm_and_overflow(packed)
    # The zero count travels as float64, exact up to 2**53 elements.
    return GradStats(norm=norm, found_inf=found_inf, num_zeros=packed[ZEROS].to(torch.int64))


def _clip_factor(packed: torch.Tensor,
                 max_norm: float | torch.Tensor | NormClip) -> torch.Tensor:
    r"""The factor that clips gradients to global norm ``max_norm``, as a 0-d float64 tensor.

    $\min(1, \text{max\_norm} / \lVert g\rVert)$ from the packed (reduced) statistics,
    computed in float64 from the float64 sum of squares (so float64 gradients are clipped
    with a float64 factor). Exactly 1 when $\lVert g\rVert \le$ ``max_norm``. The sum
    is clamped to at least $\text{max\_norm}^2$ before the square root, so gradients of
    the factor stay finite when every gradient is zero (no $0 \cdot \infty$ under
    ``torch.func.grad``). A [`NormClip`][functopt.precision.NormClip] with
    ``eps > 0`` gives its rule, the sum clamped likewise (to where the factor is 1).
    """
    sumsq = packed[SUMSQ]
    if isinstance(max_norm, NormClip):
        if max_norm.eps:
            floor = max(max_norm.max_norm - max_norm.eps, 0.0) ** 2
            ratio = (torch.sqrt(torch.clamp(sumsq, min=floor)) + max_norm.eps) / max_norm.max_norm
            return 1.0 / torch.clamp(ratio, min=1.0)
        max_norm = max_norm.max_norm
    bound = torch.as_tensor(max_norm, dtype=torch.float64, device=packed.device)
    limit = bound * bound
    factor = bound / torch.sqrt(torch.clamp(sumsq, min=limit))
    return torch.where(sumsq > limit, factor, torch.ones_like(factor))


def _host_clip_factor(max_norm: float | torch.Tensor | NormClip, sumsq: float) -> float:
    """`_clip_factor` on the host, from the reduced sum of squares as a Python float (the
    same float64 operations, so the same bits)."""
    if isinstance(max_norm, NormClip):
        if max_norm.eps:
            return 1.0 / max(1.0, (math.sqrt(sumsq) + max_norm.eps) / max_norm.max_norm)
        max_norm = max_norm.max_norm
    bound = float(max_norm)
    return bound / math.sqrt(sumsq) if sumsq > bound * bound else 1.0
