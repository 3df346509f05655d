"""Memory layouts the fast paths rely on: dense tensors, their memory-order flat views, and
groups of leaves laid end to end in one buffer."""

from __future__ import annotations

import torch

__all__ = ["dense", "end_to_end", "memory_view", "overlapping", "shaped_like"]


def dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill ``numel`` consecutive slots (in some
    order of the dimensions), so an elementwise kernel may read the memory linearly."""
    if t.is_contiguous():
        return True
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1)
    expected = 1
    for s, n in dims:
        if s != expected:
            return False
        expected *= n
    return True


def same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (one shape) have the same strides wherever a dimension has
    more than one element: the stride of a dimension of size 1 places nothing, so such
    tensors, dense, line up element for element in memory."""
    return all(sa == sb or n == 1 for sa, sb, n in zip(a.stride(), b.stride(), a.shape,
                                                        strict=True))


def overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (an expanded tensor, say)."""
    if t.numel() <= 1 or dense(t):
        return False
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1)
    reach = 0  # the largest offset reachable with the dimensions so far
    for s, n in dims:
        if s <= reach:
            return True
        reach += s * (n - 1)
    return False


def memory_view(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements as a 1-d view, in memory order (for channels_last or a
    transposed leaf that is not its logical order; operands with the same strides line up
    element for element)."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def end_to_end(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The one 1-d view over ``tensors`` when they lie end to end in one storage, in this
    order, each dense (what [`make_step(...).init`][functopt.fast.make_step] allocates, and
    what a contiguous parameter buffer gives); None otherwise."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in tensors:
        if (t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset
                or t.dtype != first.dtype or not dense(t)):
            return None
        offset += t.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())


def shaped_like(flat: torch.Tensor, start: int, like: torch.Tensor) -> torch.Tensor:
    """The segment of ``flat`` from ``start`` as a tensor with ``like``'s shape and strides
    (``like`` dense, as laid out by `memory_view`)."""
    return flat.as_strided(like.shape, like.stride(), flat.storage_offset() + start)
