"""How a mixed-precision step keeps low-precision params exact: master-weight strategies.

A strategy is three per-leaf functions. ``init(param)`` builds the leaf's store (a float32
copy, a compensation buffer, or nothing); ``view(param, store)`` is the master-precision
value the update rule sees (and weight decay reads); ``write(param, store, value, generator)``
turns the new master-precision value into the new param and store. The step applies the
skip around them, so a strategy never needs to know about overflows.

Bytes per parameter for a bfloat16 param (the param itself included, Adam's moments not):

| strategy | store | bytes |
| --- | --- | --- |
| [`float32_master`][functopt.precision.float32_master] | float32 copy | 2 + 4 = 6 |
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["MasterWeights", "float32_master"]


class MasterWeights(NamedTuple):
    """A master-weight strategy (see the module docstring)."""

    init: Callable[[torch.Tensor], torch.Tensor | None]
    view: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    write: Callable[
        [torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Generator | None],
        tuple[torch.Tensor, torch.Tensor | None],
    ]
    dtype: torch.dtype  # precision of view() and of the update maths
    needs_generator: bool  # whether write() draws random numbers


def float32_master(dtype: torch.dtype = torch.float32) -> MasterWeights:
    """Keep a ``dtype`` copy of every param narrower than ``dtype``; write params from it.

    After every step a low-precision param is bitwise ``master.to(param.dtype)``
    (round-to-nearest-even of the exact master), however nearly an update cancels the
    master value. Params already of ``dtype`` or wider get no copy and are updated in
    place of it.

    Examples:
        >>> import torch
        >>> from functopt.precision import float32_master
        >>> mw = float32_master()
        >>> p = torch.tensor([1.0], dtype=torch.bfloat16)
        >>> store = mw.init(p)
        >>> mw.write(p, store, store + 1e-3, None)
        (tensor([1.], dtype=torch.bfloat16), tensor([1.0010]))
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"float32_master: dtype must be a floating torch.dtype, got {dtype!r}.")

    def init(param: torch.Tensor) -> torch.Tensor | None:
        if torch.finfo(param.dtype).bits < torch.finfo(dtype).bits:
            return param.detach().to(dtype)
        return None

    def view(param: torch.Tensor, store: torch.Tensor | None) -> torch.Tensor:
        return param if store is None else store

    def write(
        param: torch.Tensor, store: torch.Tensor | None, value: torch.Tensor,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        del generator
        if store is None:
            return value, None
        return value.to(param.dtype), value

    return MasterWeights(init, view, write, dtype, needs_generator=False)
