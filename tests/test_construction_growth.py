"""Building an optimizer and taking its state dict grow linearly with the params
(``functopt.optim``, ``functopt.Optimizer``, ``MixedPrecisionOptimizer`` over a torch
optimizer).

The law is a ratio, not a speed: twice the params (1-element ones, so that the time is the
per-param bookkeeping, not the arithmetic) take under three times as long, for the
constructor and for ``state_dict()``. A piece of work per param that walks every param
(quadratic) makes the ratio about 4. Each time is the median of a few repeats with the
garbage collector paused, so that a collection of unrelated objects is not counted.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import functopt
from functopt import optim

SMALL, LARGE = 10_000, 20_000


def _median_s(fn: Callable[[], Callable[[], Any]], repeats: int = 3, calls: int = 1) -> float:
    """The median over ``repeats`` of the time of ``calls`` calls of what ``fn()`` returns
    (made untimed, afresh each repeat: a first call that caches something is counted)."""
    samples = []
    for _ in range(repeats):
        timed = fn()
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            for _ in range(calls):
                timed()
            samples.append(time.perf_counter() - start)
        finally:
            gc.enable()
    return statistics.median(samples)


def _times(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
           n: int) -> tuple[float, float]:
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(n)]
    construct = _median_s(lambda: lambda: make(params))
    return construct, _median_s(lambda: make(params).state_dict, calls=5)


MAKERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "AdamW": lambda ps: optim.AdamW(ps, lr=1e-3),
    "SGD-momentum": lambda ps: optim.SGD(ps, lr=1e-3, momentum=0.9),
    "Optimizer-adamw": lambda ps: functopt.Optimizer(ps, functopt.adamw(1e-3)),
    "MixedPrecisionOptimizer-AdamW": lambda ps: functopt.MixedPrecisionOptimizer(
        torch.optim.AdamW(ps, lr=1e-3)),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(MAKERS))
def test_construction_and_state_dict_grow_linearly(name: str) -> None:
    make = MAKERS[name]
    make([torch.nn.Parameter(torch.zeros(1))])  # first-call costs (imports) out of the way
    small = _times(make, SMALL)
    large = _times(make, LARGE)
    for what, t_small, t_large in zip(("constructor", "state_dict()"), small, large,
                                      strict=True):
        assert t_large < 3 * t_small, (f"{name} {what}: {t_large:.3f} s at {LARGE} params, "
                                       f"{t_small:.3f} s at {SMALL}")
