"""A rule of the user's own on the compiled tier: Adan, written with public API only, beside a
hand-written ``torch._foreach_*`` Adan, side by side in one process.

The rule is the one tests/test_rule_protocol.py writes (``scale_by_adan``, described by
``functopt.elementwise_rule``), in ``chain(scale_by_adan(), add_decayed_weights(wd),
scale_by_learning_rate(lr))``. Contenders (float32, a transformer-like model of about 10M
params in 100 leaves by default, the same values for all):

* ``functopt pure``: the chain's pure update and ``apply_updates`` (the reference);
* ``functopt compiled``: ``make_step(tx, compile=True, donate=True)``, state from
  ``step.init`` (one compiled call for the one group);
* ``functopt compiled, lay_out``: the same after ``step.lay_out`` (params and gradients as
  views of one buffer, nothing gathered);
* ``torch foreach Adan``: the same maths as in-place ``torch._foreach_*`` calls over the
  leaves, the way torch.optim writes its foreach optimizers (`foreach_adan_`).

After the timed steps every contender is checked against the pure path.

    .venv/bin/python benchmarks/adan.py --threads 2
    .venv/bin/python benchmarks/adan.py --threads 2 --params 1000000 --leaves 50 --repeats 5
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import contenders as C
import harness
from chains import FunctoptChain

import functopt

LR, WEIGHT_DECAY = 1e-3, 0.02
B1, B2, B3, EPS = 0.98, 0.92, 0.99, 1e-8
FOREACH = "torch foreach Adan"
COMPILED = "functopt compiled"


def foreach_adan_(params: list[torch.Tensor], grads: list[torch.Tensor],
                  m: list[torch.Tensor], v: list[torch.Tensor], n: list[torch.Tensor],
                  prev: list[torch.Tensor], t: int, *, lr: float, weight_decay: float,
                  b1: float = B1, b2: float = B2, b3: float = B3, eps: float = EPS) -> None:
    """Adan's step ``t`` (from 1) in place, with decoupled weight decay inside the step:
    ``p -= lr * (direction + weight_decay * p)``; the first step's difference is 0."""
    diff = torch._foreach_sub(grads, prev) if t > 1 else [torch.zeros_like(g) for g in grads]
    torch._foreach_lerp_(m, grads, 1 - b1)
    torch._foreach_lerp_(v, diff, 1 - b2)
    u = torch._foreach_add(grads, diff, alpha=b2)
    torch._foreach_mul_(n, b3)
    torch._foreach_addcmul_(n, u, u, value=1 - b3)
    denom = torch._foreach_sqrt(n)
    torch._foreach_div_(denom, math.sqrt(1 - b3 ** t))
    torch._foreach_add_(denom, eps)
    direction = torch._foreach_div(m, 1 - b1 ** t)
    torch._foreach_add_(direction, v, alpha=b2 / (1 - b2 ** t))
    torch._foreach_div_(direction, denom)
    torch._foreach_add_(direction, params, alpha=weight_decay)
    torch._foreach_add_(params, direction, alpha=-lr)
    torch._foreach_copy_(prev, grads)


class ForeachAdan(C.Contender):
    """`foreach_adan_` over the leaves: four state buffers per param, updated in place."""

    name = FOREACH

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        super().__init__()
        self.params = [p.clone() for p in params]
        self.grads = [g.clone() for g in grads]
        self.state = [[torch.zeros_like(p) for p in params] for _ in range(4)]

    def step(self) -> None:
        foreach_adan_(self.params, self.grads, *self.state, self.steps + 1, lr=LR,
                      weight_decay=WEIGHT_DECAY)
        self.steps += 1

    def result(self) -> list[torch.Tensor]:
        return self.params

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": self.params, "grads": self.grads,
                "state": [x for xs in self.state for x in xs]}


def adan_chain() -> functopt.GradientTransformation:
    from test_rule_protocol import scale_by_adan  # (the rule as a user's own file has it)

    return functopt.chain(scale_by_adan(B1, B2, B3, EPS),
                          functopt.add_decayed_weights(WEIGHT_DECAY),
                          functopt.scale_by_learning_rate(LR))


def contenders(shapes: list[tuple[int, ...]], seed: int = 0) -> list[C.Contender]:
    params, grads = C.make_values(shapes, seed)
    return [FunctoptChain(params, grads, adan_chain(), fast=False),
            FunctoptChain(params, grads, adan_chain(), fast=True, compile=True),
            FunctoptChain(params, grads, adan_chain(), fast=True, compile=True,
                          one_buffer=True),
            ForeachAdan(params, grads)]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--leaves", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    harness.begin(args.threads)
    shapes = C.make_shapes(args.params, args.leaves)
    cs = contenders(shapes)
    explained = functopt.fast.explain(adan_chain(), {str(i): torch.zeros(s) for i, s in
                                                     enumerate(shapes)}, compile=True)
    print(f"explain(compile=True): {explained.groups[0].kernel} "
          f"{explained.groups[0].rules}" if explained.fast else explained.reason)
    timings, inner = harness.time_interleaved(cs, repeats=args.repeats, warmup=2,
                                              block_s=0.3, max_block_s=5.0)
    check = harness.compare(cs, rtol=1e-4, atol=1e-6, rtol_per_step=1e-7)
    numel = sum(math.prod(s) for s in shapes)
    base = timings[FOREACH]["median_s"]
    print(f"\nadan: {numel:,} float32 params in {len(shapes)} leaves, {inner} step(s) per "
          f"block, medians of {args.repeats}, {torch.get_num_threads()} thread(s)")
    for c in cs:
        t = timings[c.name]
        print(f"  {c.name:30s} {t['median_s'] * 1e3:9.2f} ms  (IQR {t['iqr_s'] * 1e3:7.2f})"
              f"  {t['median_s'] / base:5.2f}x {FOREACH}")
    compiled = next(c for c in cs if c.name == COMPILED)
    assert isinstance(compiled, FunctoptChain)
    print(f"  first compiled call (the compile): {compiled.call_s[0]:.1f} s")
    print(f"  check against the pure path: {'PASSED' if check['passed'] else 'FAILED'} "
          f"(max abs diff {check['max_abs_diff']}; {check['problems'] or 'no problems'})")
    explained_ok = explained.fast and explained.groups[0].kernel == "compiled"
    return 0 if check["passed"] and explained_ok else 1


if __name__ == "__main__":
    sys.exit(main())
