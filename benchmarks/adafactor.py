"""Adafactor's step: ``functopt.optim.Adafactor`` beside ``torch.optim.Adafactor``, and optax's
variant ``functopt.adafactor`` on its pure path and the per-leaf tier, side by side in one
process.

Contenders on each problem (float32 params and gradients, the same values for all):

* ``functopt.optim.Adafactor``: the drop-in for torch's class, built with its defaults and
  ``weight_decay=0.01``;
* ``torch.optim.Adafactor``: torch's class with the same options, its default for-loop
  implementation (``foreach=None`` picks it on the CPU) and ``foreach=True``;
* ``functopt.adafactor pure`` / ``tier``: optax's variant (``learning_rate=1e-2``) stepped
  by its pure update and by ``functopt.fast.make_step(..., donate=True)``.

After the timed steps the drop-in is checked against torch's for-loop run, and the tier
against the pure path (both take the same number of steps from the same start).

    .venv/bin/python benchmarks/adafactor.py --threads 2
    .venv/bin/python benchmarks/adafactor.py --threads 2 --only 512 --repeats 9
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import harness
from contenders import Contender, OptimizerOver, TransformOver

import functopt

PROBLEMS: dict[str, list[tuple[int, ...]]] = {
    "512": [(512, 512)] * 50 + [(512,)] * 50,
    "transformer": ([(256, 256)] * 16 + [(1024, 256), (256, 1024)] * 4 + [(256,)] * 24
                    + [(8, 64, 32)] * 2),
    "small": [(64, 64)] * 100 + [(64,)] * 100,
}


def _problem(shapes: Sequence[tuple[int, ...]], seed: int = 0) -> tuple[list[Any], list[Any]]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    return params, grads


def _optim(name: str, shapes: Sequence[tuple[int, ...]], cls: Any,
           **options: Any) -> Contender:
    return OptimizerOver(name, *_problem(shapes), cls, weight_decay=0.01, **options)


def _optax(name: str, shapes: Sequence[tuple[int, ...]], *, fast: bool) -> Contender:
    """``functopt.adafactor`` (optax's variant), pure or on the per-leaf tier."""
    return TransformOver(name, *_problem(shapes), functopt.adafactor(learning_rate=1e-2),
                         fast=fast)


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / max(float(y.abs().max()), 1e-30))
               for x, y in zip(a, b, strict=True))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--only", default=",".join(PROBLEMS), help="problems: 512,transformer,small")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    harness.begin(args.threads)
    failed = False
    for key in args.only.split(","):
        shapes = PROBLEMS[key]
        cs: list[Contender] = [
            _optim("functopt.optim.Adafactor", shapes, functopt.optim.Adafactor),
            _optim("torch.optim.Adafactor", shapes, torch.optim.Adafactor),
            _optim("torch foreach", shapes, torch.optim.Adafactor, foreach=True),
            _optax("functopt.adafactor pure", shapes, fast=False),
            _optax("functopt.adafactor tier", shapes, fast=True),
        ]
        timings, inner = harness.time_interleaved(cs, repeats=args.repeats, warmup=1,
                                                  block_s=0.2, max_block_s=5.0)
        torch_s = timings["torch.optim.Adafactor"]["median_s"]
        pure_s = timings["functopt.adafactor pure"]["median_s"]
        params = sum(torch.Size(s).numel() for s in shapes)
        print(f"\n{key}: {len(shapes)} tensors, {params / 1e6:.2f}M params, {inner} step(s) "
              f"per block, medians of {args.repeats}")
        for c in cs:
            t = timings[c.name]
            base = pure_s if c.name.startswith("functopt.adafactor") else torch_s
            against = "pure" if c.name.startswith("functopt.adafactor") else "torch"
            print(f"  {c.name:26s} {t['median_s'] * 1e3:9.2f} ms  (IQR "
                  f"{t['iqr_s'] * 1e3:7.2f})  {t['median_s'] / base:5.2f}x {against}")
        by_name = {c.name: c for c in cs}
        pairs = (("functopt.optim.Adafactor", "torch.optim.Adafactor", 1e-4),
                 ("functopt.adafactor tier", "functopt.adafactor pure", 1e-5))
        for ours, theirs, bound in pairs:
            worst = _worst(by_name[ours].result(), by_name[theirs].result())
            if by_name[ours].steps != by_name[theirs].steps or worst > bound:
                print(f"  CHECK FAILED: {ours} differs from {theirs} by {worst:.2e} "
                      f"({by_name[ours].steps} vs {by_name[theirs].steps} steps)")
                failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
