"""Building an optimizer and taking its state dict grow linearly with the params
(``functopt.optim``, ``functopt.Optimizer``, ``MixedPrecisionOptimizer`` over a torch
optimizer).

The law is a ratio, not a speed: four times the params (1-element ones, so that the time is
the per-param bookkeeping, not the arithmetic) take under eight times as long, for the
constructor, for a fresh optimizer's first ``state_dict()`` and for its later calls. Linear
work makes the ratio about 4 and a piece of work per param that walks every param
(quadratic) about 16: eight sits a factor of two from each, and bounds the growth's
exponent below 1.5 (a ratio of 3 at twice the params bounds it below 1.58, where the same
noise on the ratio weighs twice as much on the exponent). Timing on a shared machine is
noisy (torch.optim's own ``state_dict()`` shows ratios from 2 to 4 between runs at twice
the params), so the two sizes are timed in turn, each time is the least of a few repeats
of one call with the garbage collector paused (other processes only ever add time, and a
least over single calls keeps an interruption out of every sample but the one it lands
in), and a ratio of 8 or more is measured again, up to three times in all.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import functopt
from functopt import optim

SMALL, LARGE = 5_000, 20_000
BOUND = 8  # linear: 4, quadratic: 16
REPEATS, ATTEMPTS = 3, 3

Make = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
MAKERS: dict[str, Make] = {
    "AdamW": lambda ps: optim.AdamW(ps, lr=1e-3),
    "SGD-momentum": lambda ps: optim.SGD(ps, lr=1e-3, momentum=0.9),
    "Optimizer-adamw": lambda ps: functopt.Optimizer(ps, functopt.adamw(1e-3)),
    "MixedPrecisionOptimizer-AdamW": lambda ps: functopt.MixedPrecisionOptimizer(
        torch.optim.AdamW(ps, lr=1e-3)),
}


def _least_s(timed: Callable[[], Any], calls: int) -> float:
    """The least time of ``calls`` calls of ``timed``, each timed alone."""
    gc.collect()
    gc.disable()
    try:
        least = float("inf")
        for _ in range(calls):
            start = time.perf_counter()
            timed()
            least = min(least, time.perf_counter() - start)
        return least
    finally:
        gc.enable()


def _least(make: Make, params: dict[int, list[torch.Tensor]]) -> dict[str, dict[int, float]]:
    """Per measure and size, the least time over REPEATS, the sizes taken in turn."""
    out: dict[str, dict[int, float]] = {
        "constructor": {}, "first state_dict()": {}, "state_dict()": {}}
    for _ in range(REPEATS):
        for n, ps in params.items():
            samples = {"constructor": _least_s(lambda ps=ps: make(ps), 1),
                       "first state_dict()": _least_s(make(ps).state_dict, 1),
                       "state_dict()": _least_s(make(ps).state_dict, 20)}
            for what, t in samples.items():
                out[what][n] = min(out[what].get(n, t), t)
    return out


@pytest.mark.serial  # (timed: run alone, with no other test process beside it)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(MAKERS))
def test_construction_and_state_dict_grow_linearly(name: str) -> None:
    make = MAKERS[name]
    make([torch.nn.Parameter(torch.zeros(1))])  # first-call costs (imports) out of the way
    params = {n: [torch.nn.Parameter(torch.zeros(1)) for _ in range(n)] for n in (SMALL, LARGE)}
    for _ in range(ATTEMPTS):
        times = _least(make, params)
        ratios = {what: t[LARGE] / t[SMALL] for what, t in times.items()}
        if all(r < BOUND for r in ratios.values()):
            return
    raise AssertionError(f"{name}: {LARGE} params take {ratios} times as long as {SMALL} "
                         f"(times in s: {times})")
