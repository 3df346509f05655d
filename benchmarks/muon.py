"""Muon's step: functopt's pure path, its per-leaf tier (at several batch caps), and
``torch.optim.Muon``, side by side in one process.

    .venv/bin/python benchmarks/muon.py --threads 1
    .venv/bin/python benchmarks/muon.py --threads 2 --caps 0,1M,4M,inf --only 512

Three problems of float32 matrices: 50 of 256 x 256, 50 of 512 x 512, and the matrices of
a small transformer (4 layers of width 256: four 256 x 256 attention matrices, a 1024 x 256
and a 256 x 1024 MLP matrix per layer, and 64 x 64 matrices of a per-head projection).
Every contender updates the same matrices (``torch.optim.Muon`` takes matrices only) and
steps under ``torch.no_grad()``:

* ``pure``: ``contrib.muon(0.02)``'s ``update`` and ``functopt.apply_updates``;
* ``tier <cap>``: ``functopt.fast.make_step(contrib.muon(0.02), donate=True)`` with the
  per-leaf tier's CPU batches capped at ``cap`` bytes (``0``: every matrix alone, ``inf``:
  every same-shape matrix in one batch);
* ``tier bf16``: the same at the default cap with ``ns_dtype=torch.bfloat16``;
* ``functopt.optim.Muon``: the drop-in for torch's class (Newton-Schulz in bfloat16, the
  default), and ``functopt.optim.Muon f32`` with ``ns_dtype=None``;
* ``torch.optim.Muon``: torch's class (its Newton-Schulz in bfloat16; other maths than
  ``contrib.muon``'s: no bias correction, its own learning-rate adjustment);
* ``Keller f32``: the loop researchers copy, Keller Jordan's Muon (the algorithm of
  https://github.com/KellerJordan/Muon, transcribed here) with its Newton-Schulz in
  float32: the yardstick for ``functopt.optim.Muon f32``. Its Nesterov momentum is taken
  out of place, as torch's, since every contender keeps its gradients between steps.

``functopt.optim.Muon`` is checked against ``torch.optim.Muon`` after the timed steps (the
same steps, to bfloat16 rounding), and ``functopt.optim.Muon f32`` against ``Keller f32``
(the same maths in float32 but for where the norm's ``eps`` enters: relative 1e-4).

The pure and tier contenders are checked equal after the timed steps (bitwise but for the
batched products' rounding: relative 1e-5 in float32).
"""

from __future__ import annotations

import argparse
import math
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
from functopt import contrib
from functopt.contrib import _muon

PROBLEMS = {
    "256": [(256, 256)] * 50,
    "512": [(512, 512)] * 50,
    "transformer": [(256, 256)] * 16 + [(1024, 256), (256, 1024)] * 4 + [(64, 64)] * 32,
}


def _problem(shapes: Sequence[tuple[int, int]], seed: int = 0) -> tuple[list[Any], list[Any]]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    return params, grads


class _Functopt(TransformOver):
    """``contrib.muon(0.02)``, pure or on the per-leaf tier with its CPU batches capped."""

    def __init__(self, name: str, shapes: Sequence[tuple[int, int]], *, fast: bool,
                 cap: float | None = None, ns_dtype: torch.dtype | None = None) -> None:
        super().__init__(name, *_problem(shapes), contrib.muon(0.02, ns_dtype=ns_dtype),
                         fast=fast)
        self.cap = cap

    def step(self) -> None:
        default = _muon._BATCH_BYTES["cpu"]
        if self.run is not None and self.cap is not None:
            _muon._BATCH_BYTES["cpu"] = int(min(self.cap, 1 << 62))
        try:
            super().step()
        finally:
            _muon._BATCH_BYTES["cpu"] = default


class KellerMuon(torch.optim.Optimizer):
    """Keller Jordan's Muon step with its Newton-Schulz iteration in float32."""

    def __init__(self, params: Any, lr: float = 0.02, weight_decay: float = 0.0,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay,
                                  "momentum": momentum, "nesterov": nesterov,
                                  "ns_steps": ns_steps})

    @staticmethod
    def orthogonalize(g: torch.Tensor, steps: int) -> torch.Tensor:
        a, b, c = (3.4445, -4.7750, 2.0315)
        x = g.float()
        tall = x.size(-2) > x.size(-1)
        if tall:
            x = x.mT
        x = x / (x.norm() + 1e-7)
        for _ in range(steps):
            gram = x @ x.mT
            poly = b * gram + c * gram @ gram
            x = a * x + poly @ x
        return x.mT if tall else x

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                u = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                u = self.orthogonalize(u, group["ns_steps"])
                u *= max(1, p.size(-2) / p.size(-1)) ** 0.5
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(u.reshape(p.shape), alpha=-group["lr"])


def _torch_muon(shapes: Sequence[tuple[int, int]], cls: Any = None,
                name: str = "torch.optim.Muon", **options: Any) -> Contender:
    return OptimizerOver(name, *_problem(shapes), cls or torch.optim.Muon, lr=0.02,
                         weight_decay=0.0, **options)


def _cap(text: str) -> float:
    if text == "inf":
        return math.inf
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:].upper(), 1)
    return float(text[:-1] if scale > 1 else text) * scale


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--only", default=",".join(PROBLEMS), help="problems: 256,512,transformer")
    ap.add_argument("--caps", default="0,1M,inf", help="tier batch caps in bytes (K, M, inf)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-torch", action="store_true", help="leave torch.optim.Muon out")
    args = ap.parse_args(argv)
    harness.begin(args.threads)
    failed = False
    for key in args.only.split(","):
        shapes = PROBLEMS[key]
        cs: list[Contender] = [_Functopt("pure", shapes, fast=False)]
        cs += [_Functopt(f"tier {c}", shapes, fast=True, cap=_cap(c))
               for c in args.caps.split(",")]
        cs.append(_Functopt("tier bf16", shapes, fast=True, ns_dtype=torch.bfloat16))
        cs.append(_torch_muon(shapes, functopt.optim.Muon, "functopt.optim.Muon"))
        cs.append(_torch_muon(shapes, functopt.optim.Muon, "functopt.optim.Muon f32",
                             ns_dtype=None))
        cs.append(_torch_muon(shapes, KellerMuon, "Keller f32"))
        if not args.no_torch:
            cs.append(_torch_muon(shapes))
        timings, inner = harness.time_interleaved(cs, repeats=args.repeats, warmup=1,
                                                  block_s=0.2, max_block_s=5.0)
        base = timings["pure"]["median_s"]
        print(f"\n{key}: {len(shapes)} matrices, {inner} step(s) per block, "
              f"medians of {args.repeats}")
        for c in cs:
            t = timings[c.name]
            line = (f"  {c.name:24s} {t['median_s'] * 1e3:9.1f} ms  (IQR "
                    f"{t['iqr_s'] * 1e3:7.1f})  {t['median_s'] / base:5.2f}x pure")
            if not args.no_torch:
                line += f"  {t['median_s'] / timings['torch.optim.Muon']['median_s']:5.2f}x torch"
            line += f"  {t['median_s'] / timings['Keller f32']['median_s']:5.2f}x Keller f32"
            print(line)
        # the same steps from the same start; bfloat16 roundings compound over them
        pairs = [("functopt.optim.Muon f32", "Keller f32", 1e-4)]
        if not args.no_torch:
            pairs.append(("functopt.optim.Muon", "torch.optim.Muon", 1e-2))
        for mine, yardstick, bound in pairs:
            ours, theirs = (next(c for c in cs if c.name == n).result()
                            for n in (mine, yardstick))
            worst = max(float((a - b).abs().max() / b.abs().max())
                        for a, b in zip(ours, theirs, strict=True))
            if worst > bound:
                print(f"  CHECK FAILED: {mine} differs from {yardstick} by {worst:.2e}")
                failed = True
        ref = cs[0].result()
        for c in cs[1:]:
            if not isinstance(c, _Functopt) or c.name == "tier bf16":
                continue
            worst = max(float((a - b).abs().max() / a.abs().max())
                        for a, b in zip(ref, c.result(), strict=True))
            if worst > 1e-5:
                print(f"  CHECK FAILED: {c.name} differs from pure by {worst:.2e}")
                failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
