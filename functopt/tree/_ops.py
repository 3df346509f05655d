"""Public tree utilities: reductions, casts, constructors and field access."""

from __future__ import annotations

from typing import Any

import torch

from functopt.tree import _core

__all__ = ["global_norm"]


def _accumulation_dtype(leaves: list[Any]) -> torch.dtype:
    if any(isinstance(x, torch.Tensor) and x.dtype == torch.float64 for x in leaves):
        return torch.float64
    return torch.float32


def global_norm(tree: Any) -> torch.Tensor:
    r"""The L2 norm of all leaves together, :math:`\sqrt{\sum_i \lVert x_i \rVert_2^2}`.

    Each leaf is reduced in float32 (float64 if any leaf is float64), so bfloat16 and
    float16 leaves do not lose precision or overflow in the sum. ``None`` leaves are
    skipped; an empty tree has norm 0. The result is a 0-d tensor on the first leaf's
    device; nothing is read back to the host.

    Example:
        >>> import torch, functopt
        >>> functopt.tree.global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0]), "c": None})
        tensor(5.)
    """
    leaves, treespec = _core.flatten(tree)
    _core.check_tensors(leaves, treespec, name="tree")
    tensors = [x for x in leaves if x is not None]
    dtype = _accumulation_dtype(tensors)
    if not tensors:
        return torch.zeros((), dtype=dtype)
    device = tensors[0].device
    squares = [torch.linalg.vector_norm(x, dtype=dtype).to(device) ** 2 for x in tensors]
    return torch.sqrt(torch.stack(squares).sum())
