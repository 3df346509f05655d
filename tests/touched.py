"""A dispatch mode that counts the bytes a real step reads and writes (held against
``explain``'s count of the same step by tests/test_explain_traffic.py and
tests/test_explain_mixed_traffic.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_DESTINATIONS = {"aten::copy_", "aten::_foreach_copy_", "aten::fill_", "aten::zero_",
                 "aten::_foreach_zero_"}


class Touched(TorchDispatchMode):
    """Bytes read and written by the operations of a real step."""

    def __init__(self, smallest: int) -> None:
        super().__init__()
        self.smallest = smallest
        self.read = 0
        self.written = 0

    def _size(self, t: torch.Tensor) -> int:
        return t.numel() * t.element_size() if t.dim() and t.numel() >= self.smallest else 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        before = [t.clone() if self._size(t) else None for t in inputs]
        out = func(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        if outs and all(t.untyped_storage().data_ptr() in storages for t in outs) and not any(
                a.alias_info is not None and a.alias_info.is_write
                for a in func._schema.arguments):
            return out  # a view: nothing moved
        if func._schema.name.startswith(("aten::empty", "aten::new_empty")):
            return out  # an allocation: nothing written yet
        destination = func._schema.name in _DESTINATIONS
        mutable = {a.name for a in func._schema.arguments
                   if a.alias_info is not None and a.alias_info.is_write}
        for k, arg in enumerate(func._schema.arguments):
            value = args[k] if k < len(args) else kwargs.get(arg.name)
            items = value if isinstance(value, (list, tuple)) else [value]
            for t in items:
                if isinstance(t, torch.Tensor) and not (
                        (destination or arg.name == "out") and arg.name in mutable):
                    self.read += self._size(t)
        for t, old in zip(inputs, before, strict=True):
            if old is not None and not torch.equal(t, old) and not (
                    torch.isnan(t).all() and torch.isnan(old).all()):
                self.written += self._size(t)
        for t in outs:
            if t.untyped_storage().data_ptr() not in storages:
                self.written += self._size(t)
        return out
