"""Gradient statistics of a mixed-precision step, computed in one pass and one reduction.

The step needs three numbers about all gradients together: the sum of squares (for the
global norm and clipping), the count of non-finite elements (for the overflow check), and
the count of zeros (Megatron's ``count_zeros``). They are computed per leaf, locally, and
packed into one small float64 tensor, so that a distributed step needs exactly one
all-reduce for all three, where per-tensor reductions would need one per leaf and per
statistic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["GradStats", "grad_stats", "unpack_grad_stats"]

# Layout of the packed tensor: [sum of squares, non-finite count, zero count].
_SUMSQ, _NONFINITE, _ZEROS = 0, 1, 2


class GradStats(NamedTuple):
    """Statistics of a set of gradients (all 0-d tensors)."""

    norm: torch.Tensor  # float32, (): global L2 norm (inf or nan when found_inf)
    found_inf: torch.Tensor  # bool, (): any element non-finite, or the norm overflowed
    num_zeros: torch.Tensor  # int64, (): number of elements equal to zero


def grad_stats(grads: Sequence[torch.Tensor | None], device: torch.device | None = None) -> torch.Tensor:
    """Pack ``[sum of squares, non-finite count, zero count]`` of ``grads`` into one tensor.

    The sum of squares is accumulated in float32 per leaf (float64 for float64 leaves) and
    the counts are exact; the packed result is a float64 tensor of shape ``(3,)``, ready for
    a single ``all_reduce(SUM)``. ``None`` leaves are skipped.

    Examples:
        >>> import torch
        >>> from functopt.precision import grad_stats, unpack_grad_stats
        >>> packed = grad_stats([torch.tensor([3.0, 0.0]), torch.tensor([4.0])])
        >>> unpack_grad_stats(packed)
        GradStats(norm=tensor(5.), found_inf=tensor(False), num_zeros=tensor(1))
    """
    parts = []
    for g in grads:
        if g is None:
            continue
        acc = torch.float64 if g.dtype == torch.float64 else torch.float32
        sumsq = torch.sum(torch.square(g.to(acc)), dtype=acc).to(torch.float64)
        nonfinite = torch.sum(~torch.isfinite(g), dtype=torch.float64)
        zeros = torch.sum(g == 0, dtype=torch.float64)
        parts.append(torch.stack([sumsq, nonfinite, zeros]))
    if not parts:
        return torch.zeros(3, dtype=torch.float64, device=device)
    return torch.stack(parts).sum(dim=0)


def unpack_grad_stats(packed: torch.Tensor) -> GradStats:
    """Turn a (reduced) packed tensor into `GradStats`.

    The norm is returned in float32; a finite sum of squares whose float32 norm overflows
    counts as an overflow too, because clipping by an infinite norm would zero the update
    rather than bound it.
    """
    norm = torch.sqrt(packed[_SUMSQ]).to(torch.float32)
    found_inf = (packed[_NONFINITE] > 0) | ~torch.isfinite(norm)
    # The zero count travels as float64, exact up to 2**53 elements.
    return GradStats(norm=norm, found_inf=found_inf, num_zeros=packed[_ZEROS].to(torch.int64))
