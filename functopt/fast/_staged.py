"""A fused kernel's gradients staged through a small scratch buffer, on the CPU.

The fused kernels (``torch._fused_adamw_``, ``_fused_adam_``, ``_fused_sgd_``) divide the
gradients by ``grad_scale`` in place. A step that folds a clip into ``grad_scale`` and was
not handed the gradients (``make_step(..., donate_grads=False)``) must give the kernel
copies. Copying every gradient at once doubles the gradients' memory traffic; here the
leaves are taken in batches of about `BUDGET_BYTES` instead (a leaf above it in pieces),
each batch's gradients copied into one scratch buffer of that size and the kernel called
on the batch at once, so that the kernel reads and writes the copies while they are still
in the core's cache. The scratch memory is one buffer of `BUDGET_BYTES`, whatever the
model's size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from functopt.fast._layout import dense, memory_view, same_strides

__all__ = ["BUDGET_BYTES", "fits", "run"]

# The scratch buffer's size: about a core's L2 cache (1 to 2 MiB on current x86 server
# cores; a copy pushed out of it is still in the shared L3), and large enough that the
# kernel calls, one per batch, cost little (40 for 20M float32 gradients). On the
# benchmark's clip chain it was as fast as 1 MiB and faster than 256 or 512 KiB.
BUDGET_BYTES = 2 << 20

# A batch: per piece, (the leaf's position in the group, its first and last element in
# memory order, or None for the whole leaf), and the scratch views its gradients are
# copied into.
_Piece = tuple[int, int, int | None]
_Plan = tuple[Any, torch.Tensor, list[tuple[list[_Piece], list[torch.Tensor]]]]


def fits(grads: list[torch.Tensor], columns: list[list[torch.Tensor]]) -> bool:
    """Whether `run` takes these leaves: each value (``columns[0]``) dense and every other
    column (the kernel's state lists) laid out as it; a leaf larger than the buffer is cut
    into pieces in memory order, so its gradient must be laid out as its value too."""
    values = columns[0]
    limit = BUDGET_BYTES // values[0].element_size() if values else 0
    for j, v in enumerate(values):
        if not dense(v) or not all(same_strides(column[j], v) for column in columns[1:] if column):
            return False
        if v.numel() > limit and not same_strides(grads[j], v):
            return False
    return True


def run(call: Callable[[list[torch.Tensor], list[list[torch.Tensor]]], None],
        grads: list[torch.Tensor], columns: list[list[torch.Tensor]],
        workspace: dict[Any, Any] | None, key: Any) -> None:
    """``call(grad_copies, column_pieces)`` once per batch, after the batch's gradients
    were copied into the scratch buffer; ``grads`` are never written. ``columns``: lists
    parallel to ``grads``, the values first (an empty list stays empty). The buffer and
    the batches are kept in ``workspace[key]`` for the next step when there is a
    workspace (`fits` must hold)."""
    values = columns[0]
    signature = tuple((v.shape, v.stride()) for v in values), values[0].dtype, values[0].device
    found = None if workspace is None else workspace.get(key)
    plan: _Plan = found if found is not None and found[0] == signature else _plan(
        signature, values)
    if workspace is not None:
        workspace[key] = plan
    for pieces, views in plan[2]:
        sources = [grads[j] if stop is None else memory_view(grads[j])[start:stop]
                   for j, start, stop in pieces]
        torch._foreach_copy_(views, sources)
        call(views, [[] if not column else [
            column[j] if stop is None else memory_view(column[j])[start:stop]
            for j, start, stop in pieces] for column in columns])


def _plan(signature: Any, values: list[torch.Tensor]) -> _Plan:
    """The scratch buffer and the batches for leaves laid out as ``values``."""
    limit = max(1, BUDGET_BYTES // values[0].element_size())
    slab = torch.empty(limit, dtype=values[0].dtype, device=values[0].device)
    batches: list[tuple[list[_Piece], list[torch.Tensor]]] = []
    pieces: list[_Piece] = []
    views: list[torch.Tensor] = []
    used = 0
    for j, v in enumerate(values):
        n = v.numel()
        cuts = [(0, None, n)] if n <= limit else [
            (start, min(start + limit, n), min(start + limit, n) - start)
            for start in range(0, n, limit)]
        for start, stop, size in cuts:
            if used + size > limit:
                batches.append((pieces, views))
                pieces, views, used = [], [], 0
            # (a whole leaf's copy is laid out as its value, a piece's is 1-d)
            views.append(slab.as_strided(v.shape, v.stride(), used) if stop is None
                         else slab[used:used + size])
            pieces.append((j, start, stop))
            used += size
    if pieces:
        batches.append((pieces, views))
    return signature, slab, batches
