"""The program engine's step (``functopt/fast/_engine.py``, a private switch) beside today's.

The README's chain ``chain(clip_by_global_norm(1.0), adamw(...))``, on three functopt
paths side by side: the pure path (``update`` + ``apply_updates``), today's
``make_step(donate=True)`` (the planner: the clip folded into torch's fused AdamW kernel),
and the same call with the engine switched on, whose eager backend runs the program's
reductions and each rule's own pure ``update``; ``clip_grad_norm_`` + ``AdamW(fused=True)``
as the yardstick. The eager backend is the engine's reference, not its fast tier: it is
expected near the pure path.
"""

from __future__ import annotations

from typing import Any

import contenders as C
import torch
from chains import CHAINS, FunctoptChain, TorchAdamWFor

from functopt.fast import _engine

ENGINE = "functopt program (eager)"


class EngineChain(FunctoptChain):
    """``make_step(tx, donate=True)`` with the program engine switched on for its steps."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor], tx: Any) -> None:
        super().__init__(params, grads, tx, fast=True)
        self.name = ENGINE

    def step(self) -> None:
        before, _engine.ENABLED = _engine.ENABLED, True
        try:
            super().step()
        finally:
            _engine.ENABLED = before


def engine_contenders(shapes: list[tuple[int, ...]], seed: int = 0,
                      ) -> tuple[list[C.Contender], list[C.Contender]]:
    """(the contenders checked against each other, the timed-only yardsticks)."""
    params, grads = C.make_values(shapes, seed, grad_scale=10.0)  # norms above the bound
    make = CHAINS["clip_adamw"]
    return [FunctoptChain(params, grads, make(), fast=False),
            FunctoptChain(params, grads, make(), fast=True),
            EngineChain(params, grads, make()),
            TorchAdamWFor(params, grads, clip=True)], []
