"""Construction, ``state_dict()`` and the first two steps of the drop-in optimizers against
torch.optim's.

For each size (a number of 1-element params) and each class (``SGD`` is SGD with
momentum 0.9), builds the functopt.optim optimizer and the torch.optim one (its default
implementation, ``foreach=None``: the for-loop on the CPU) over the same params
``--repeats`` times and reports the median wall time of the constructor, of a fresh
optimizer's ``state_dict()``, of its first ``step()`` (which makes the state and, for
functopt, plans the fast step) and of its second. Each grows linearly with the number of
params; the ratio to torch is printed beside them. Both make a param's state when it is
first needed (the first step; functopt also on a read of ``optimizer.state``), Adagrad in
its constructor. After the steps the two optimizers' params are compared: the exit status
is 1 where they differ.

``--profile`` also prints cProfile's 25 costliest functions (by their own time) of
functopt's first step at the largest size.

Usage: ``python benchmarks/construction.py [--sizes 10000,100000] [--classes AdamW,SGD]
[--repeats 3] [--profile] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # harness
sys.path.insert(1, str(HERE.parent))  # functopt from this checkout
from harness import machine_facts  # noqa: E402

import functopt  # noqa: E402

OPTIONS: dict[str, dict[str, Any]] = {"SGD": {"momentum": 0.9}}
PHASES = ("construct", "state_dict", "first_step", "second_step")


def _params(n: int) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.full((1,), 0.5)) for _ in range(n)]
    for i, p in enumerate(params):
        p.grad = torch.full((1,), 1.0 + (i % 7) / 8)
    return params


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _run(cls: Any, name: str, n: int) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One optimizer over fresh params: the time of each phase, and the params after."""
    params = _params(n)
    gc.collect()
    times: dict[str, float] = {}

    def make() -> Any:
        return cls(params, lr=1e-3, **OPTIONS.get(name, {}))

    # (the state dict of another optimizer: a step after one hands its state out is
    # not donated, as the dict holds the state's tensors)
    times["state_dict"], _ = _timed(make().state_dict)
    times["construct"], opt = _timed(make)
    times["first_step"], _ = _timed(opt.step)
    times["second_step"], _ = _timed(opt.step)
    return times, [p.detach() for p in params]


def measure(name: str, n: int, repeats: int) -> tuple[dict[str, Any], bool]:
    """The row of medians for one class and size, and whether the two agreed."""
    samples: dict[str, list[float]] = {}
    agree = True
    for _ in range(repeats):
        finals = {}
        for label, module in (("functopt", functopt.optim), ("torch", torch.optim)):
            times, finals[label] = _run(getattr(module, name), name, n)
            for phase, t in times.items():
                samples.setdefault(f"{label}_{phase}_s", []).append(t)
        ours, theirs = torch.cat(finals["functopt"]), torch.cat(finals["torch"])
        agree = agree and torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    row: dict[str, Any] = {"class": name, "params": n, "agree": agree}
    row.update({k: statistics.median(v) for k, v in samples.items()})
    return row, agree


def profile_first_step(name: str, n: int) -> str:
    """cProfile's costliest functions of functopt's first step, by their own time."""
    params = _params(n)
    opt = getattr(functopt.optim, name)(params, lr=1e-3, **OPTIONS.get(name, {}))
    profiler = cProfile.Profile()
    profiler.runcall(opt.step)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--classes", default="AdamW,SGD")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    facts = machine_facts()
    print(" ".join(f"{k}={v}" for k, v in facts.items()))
    _run(functopt.optim.AdamW, "AdamW", 1)  # imports and first builds
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    ok = True
    print(f"{'class':<7} {'params':>8} |" + "|".join(
        f" {phase + ': functopt':>22} {'torch':>9} {'ratio':>6} " for phase in PHASES))
    for name in args.classes.split(","):
        for n in sizes:
            row, agree = measure(name, n, args.repeats)
            rows.append(row)
            ok = ok and agree
            cells = []
            for phase in PHASES:
                ours, theirs = row[f"functopt_{phase}_s"], row[f"torch_{phase}_s"]
                cells.append(f" {ours * 1e3:>19.1f} ms {theirs * 1e3:>6.1f} ms "
                             f"{ours / theirs:>5.2f}x ")
            print(f"{name:<7} {n:>8} |" + "|".join(cells)
                  + ("" if agree else "  PARAMS DIFFER"))
    if args.profile:
        for name in args.classes.split(","):
            print(f"\nfunctopt.optim.{name}: the first step at {max(sizes)} params")
            print(profile_first_step(name, max(sizes)))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": facts, "rows": rows}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
