"""The drop-in optimizers: every ``functopt.optim`` class against every implementation of
``torch.optim``'s class of the same name, side by side in one process.

For each class (``--classes``; by default every ``functopt.optim`` class that torch.optim
also has) the contenders are, over the same float32 params and gradients:

* ``functopt``: ``functopt.optim.<Class>(params)``, its default arguments;
* ``torch for-loop``, ``torch foreach``, ``torch fused``: ``torch.optim.<Class>(params)``
  with ``foreach=False``, ``foreach=True`` and ``fused=True``, each where the class offers
  it on the device (probed by building one over a small tensor and stepping it; a class
  without a ``foreach`` argument, such as Muon, has its one implementation as the
  for-loop);
* with ``--compile``: ``functopt compile``, ``functopt.optim.<Class>(params,
  compile=True)`` where the class takes that argument (probed the same way), and
  ``torch.compile``, ``torch.compile(opt.step)`` of torch's default implementation. The
  wall time of each compiled step's first call (the compile) is reported.

The params are transformer-like leaves (``contenders.make_shapes``); Muon's are the
matrices of the same block only, as ``torch.optim.Muon`` takes matrices only. Timing is the
harness's: warm-up steps, blocks of the same step count for every contender, rounds in an
alternating order, medians over ``--repeats``. The ratio is functopt's median over the
fastest torch implementation's (compiled: functopt compile over ``torch.compile``).

After the timed steps every contender's params are checked against torch's for-loop run
(the same number of steps from the same start): ``allclose`` with ``rtol = 1e-4 + 1e-7 *
steps`` and ``atol = 1e-6`` (run.py's bound for float32: equally valid roundings of the
same step drift apart by a fraction of an ulp per step), and for Muon, whose Newton-Schulz
iteration runs in bfloat16 in both libraries, ``rtol = 1e-2`` and ``atol = 1e-4`` (a
hundredth of the params' scale, 0.02). A failed check makes the exit status 1.

    .venv/bin/python benchmarks/optim.py --threads 2
    .venv/bin/python benchmarks/optim.py --classes Adam,NAdam --params 200000 --compile
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # harness, contenders
sys.path.insert(1, str(HERE.parent))  # functopt from this checkout

import contenders as C  # noqa: E402
import harness as H  # noqa: E402

import functopt  # noqa: E402

FUNCTOPT, FUNCTOPT_COMPILE, TORCH_COMPILE = "functopt", "functopt compile", "torch.compile"
REFERENCE = "torch for-loop"
# torch's eager implementations, as (name, constructor options); the for-loop first: it is
# the reference every contender is checked against.
IMPLEMENTATIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    (REFERENCE, {"foreach": False}),
    ("torch foreach", {"foreach": True}),
    ("torch fused", {"fused": True}),
)
CLASSES = tuple(name for name in functopt.optim.__all__
                if isinstance(getattr(functopt.optim, name), type)
                and isinstance(getattr(torch.optim, name, None), type))
RTOL, ATOL, RTOL_PER_STEP = 1e-4, 1e-6, 1e-7
# (rtol, atol) where both libraries round through bfloat16 (see the module docstring)
BF16_BOUNDS = {"Muon": (1e-2, 1e-4)}
MATRICES_ONLY = {"Muon"}
_MATRIX_BLOCK = [(3, 1), (1, 1), (4, 1), (1, 4)]  # contenders' block, its matrices only


def matrix_shapes(total: int, leaves: int) -> list[tuple[int, ...]]:
    """``leaves`` matrices of a transformer's block (``3d x d``, ``d x d``, ``4d x d``,
    ``d x 4d``, cycled) with about ``total`` elements: ``d`` the largest that stays within."""
    kinds = [_MATRIX_BLOCK[i % len(_MATRIX_BLOCK)] for i in range(leaves)]
    d = max(1, math.isqrt(total // sum(r * c for r, c in kinds)))
    return [(r * d, c * d) for r, c in kinds]


def unavailable(cls: Any, options: dict[str, Any], *, step: bool = True) -> str | None:
    """Why ``cls(params, **options)`` cannot step on the device, or None where it can.

    The options must be arguments of the constructor, and an optimizer built with them over
    one small float32 tensor must take a step (torch raises where, say, ``fused=True`` has
    no kernel for the device). ``step=False``: it must be built only (a compiled step
    compiles at its first call, which the contender's own first call times).
    """
    accepted = inspect.signature(cls).parameters
    missing = [k for k in options if k not in accepted]
    if missing:
        return f"no {missing[0]}= argument"
    p = torch.nn.Parameter(torch.ones(2, 2, device=C.DEVICE))
    p.grad = torch.full_like(p, 0.5)
    try:
        built = cls([p], **options)
        if step:
            built.step()
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return None


class Compiled(C.OptimizerOver):
    """An optimizer whose step is ``torch.compile(opt.step)`` (``wrap``), or whose class
    compiles its own step; ``call_s`` keeps the wall time of the first three calls (the
    first one compiles)."""

    def __init__(self, name: str, params: list[torch.Tensor], grads: list[torch.Tensor],
                 cls: Any, *, wrap: bool, **options: Any) -> None:
        super().__init__(name, params, grads, cls, **options)
        self.run = torch.compile(self.opt.step) if wrap else self.opt.step
        self.call_s: list[float] = []

    def step(self) -> None:
        start = time.perf_counter()
        self.run()
        if len(self.call_s) < 3:
            self.call_s.append(time.perf_counter() - start)
        self.steps += 1


def _copies(params: list[torch.Tensor], grads: list[torch.Tensor],
            ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [p.clone() for p in params], [g.clone() for g in grads]


def contenders_for(name: str, params: list[torch.Tensor], grads: list[torch.Tensor], *,
                   compile: bool = False) -> tuple[list[C.Contender], dict[str, str]]:
    """The contenders of one class, the torch for-loop first, each over its own copy of
    ``params`` and ``grads``; and, by contender name, why the ones not built are missing."""
    ours, theirs = getattr(functopt.optim, name), getattr(torch.optim, name)
    built: list[C.Contender] = []
    missing: dict[str, str] = {}
    for label, options in IMPLEMENTATIONS:
        if label == REFERENCE and "foreach" not in inspect.signature(theirs).parameters:
            options = {}  # the class's one implementation
        why = unavailable(theirs, options)
        if why is None:
            built.append(C.OptimizerOver(label, *_copies(params, grads), theirs, **options))
        else:
            missing[label] = why
    if not built or built[0].name != REFERENCE:
        raise RuntimeError(f"torch.optim.{name} has no for-loop step on {C.DEVICE}: "
                           f"{missing.get(REFERENCE)}; the check needs it as reference")
    built.append(C.OptimizerOver(FUNCTOPT, *_copies(params, grads), ours))
    if compile:
        why = unavailable(ours, {"compile": True}, step=False)
        if why is None:
            built.append(Compiled(FUNCTOPT_COMPILE, *_copies(params, grads), ours,
                                  wrap=False, compile=True))
        else:
            missing[FUNCTOPT_COMPILE] = why
        built.append(Compiled(TORCH_COMPILE, *_copies(params, grads), theirs, wrap=True))
    return built, missing


def measure(name: str, *, total: int, leaves: int, repeats: int, warmup: int = 2,
            block_s: float = 0.05, max_block_s: float = 1.0, compile: bool = False,
            seed: int = 0) -> dict[str, Any]:
    """One class's row: timings of every contender, the ratios and the check."""
    shapes = (matrix_shapes if name in MATRICES_ONLY else C.make_shapes)(total, leaves)
    params, grads = C.make_values(shapes, seed)
    if compile:
        torch._dynamo.reset()  # each class's compile time is its own
    cs, missing = contenders_for(name, params, grads, compile=compile)
    timings, inner = H.time_interleaved(cs, repeats=repeats, warmup=warmup, block_s=block_s,
                                        max_block_s=max_block_s)
    rtol, atol = BF16_BOUNDS.get(name, (RTOL, ATOL))
    check = H.compare(cs, rtol=rtol, atol=atol, rtol_per_step=RTOL_PER_STEP)
    eager = [label for label, _ in IMPLEMENTATIONS if label in timings]
    fastest = min(eager, key=lambda label: timings[label]["median_s"])
    row: dict[str, Any] = {
        "class": name, "params": sum(math.prod(s) for s in shapes), "leaves": len(shapes),
        "steps_per_block": inner, "timings": timings, "missing": missing,
        "torch_fastest": fastest,
        "ratio": timings[FUNCTOPT]["median_s"] / timings[fastest]["median_s"],
        "check": check,
    }
    if compile:
        row["compile_s"] = {c.name: c.call_s[0] for c in cs if isinstance(c, Compiled)}
        row["compiled_ratio"] = (
            timings[FUNCTOPT_COMPILE]["median_s"] / timings[TORCH_COMPILE]["median_s"]
            if FUNCTOPT_COMPILE in timings else None)
    return row


def _cell(row: dict[str, Any], name: str) -> str:
    t = row["timings"].get(name)
    if t is None:
        return "-"
    return f"{t['median_s'] * 1e3:.4g} ({100 * t['iqr_s'] / t['median_s']:.0f}%)"


def _verdict(row: dict[str, Any]) -> str:
    check = row["check"]
    worst = max(check["max_abs_diff"].values(), default=0.0)
    return f"{'ok' if check['passed'] else 'FAILED'} ({worst:.1e})"


def print_tables(rows: Sequence[dict[str, Any]], *, compile: bool) -> None:
    """The eager table (and with ``compile`` the compiled one), as markdown."""
    eager = [label for label, _ in IMPLEMENTATIONS]
    print("\n| class | params / leaves | functopt ms | " + " | ".join(f"{e} ms" for e in eager)
          + " | torch fastest | functopt / fastest | check (max abs diff) |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in eager) + " | --- | ---: | --- |")
    for r in rows:
        print(f"| {r['class']} | {r['params']:,} / {r['leaves']} | {_cell(r, FUNCTOPT)} | "
              + " | ".join(_cell(r, e) for e in eager)
              + f" | {r['torch_fastest']} | {r['ratio']:.2f}x | {_verdict(r)} |")
    print("\nmedian ms per step (IQR as % of the median); '-': torch offers no such "
          "implementation on this device")
    if compile:
        print(f"\n| class | {FUNCTOPT_COMPILE} ms | {TORCH_COMPILE} ms | "
              "functopt compile / torch.compile | compile s (functopt / torch) |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for r in rows:
            ratio = r["compiled_ratio"]
            secs = r["compile_s"]
            ours = f"{secs[FUNCTOPT_COMPILE]:.1f}" if FUNCTOPT_COMPILE in secs else "-"
            print(f"| {r['class']} | {_cell(r, FUNCTOPT_COMPILE)} | {_cell(r, TORCH_COMPILE)} "
                  f"| {'-' if ratio is None else f'{ratio:.2f}x'} | {ours} / "
                  f"{secs[TORCH_COMPILE]:.1f} |")
    notes = sorted({f"{r['class']}: {who}: {why}" for r in rows
                    for who, why in r["missing"].items()})
    for note in notes:
        print(f"  not built: {note}")
    for r in rows:
        if not r["check"]["passed"]:
            print(f"  CHECK FAILED: {r['class']}: {r['check']}")


def run(classes: Sequence[str], *, total: int, leaves: int, repeats: int, warmup: int = 2,
        block_s: float = 0.05, max_block_s: float = 1.0, compile: bool = False,
        ) -> dict[str, Any]:
    """Every class's row, printed as a markdown table; ``check.passed`` is all rows'."""
    rows = []
    for name in classes:
        rows.append(measure(name, total=total, leaves=leaves, repeats=repeats, warmup=warmup,
                            block_s=block_s, max_block_s=max_block_s, compile=compile))
        gc.collect()
    print_tables(rows, compile=compile)
    return {"rows": rows, "check": {"passed": all(r["check"]["passed"] for r in rows)}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", default=",".join(CLASSES),
                        help=f"comma-separated (default: {','.join(CLASSES)})")
    parser.add_argument("--params", type=int, default=10_000_000, help="total params")
    parser.add_argument("--leaves", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true",
                        help="also functopt's compile=True and torch.compile of torch's step")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = parser.parse_args(argv)
    classes = [c.strip() for c in args.classes.split(",") if c.strip()]
    unknown = [c for c in classes if c not in CLASSES]
    if unknown:
        parser.error(f"--classes: unknown {unknown}; choose from {list(CLASSES)}")
    if min(args.params, args.leaves, args.threads, args.repeats, args.warmup) < 1:
        parser.error("--params, --leaves, --threads, --repeats and --warmup must be >= 1")
    torch.optim.AdamW([torch.zeros(1)], fused=True)  # torch.optim's lazy imports, untimed
    gc.collect()
    gc.freeze()  # import-time objects out of the collector run before each timed block
    threads = torch.get_num_threads()
    try:
        H.begin(args.threads)
        print(f"functopt.optim vs torch.optim: {args.params:,} float32 params in "
              f"{args.leaves} leaves, {args.repeats} repeats, {args.warmup} warm-up steps")
        res = run(classes, total=args.params, leaves=args.leaves, repeats=args.repeats,
                  warmup=args.warmup, compile=args.compile)
    finally:
        gc.unfreeze()  # main may run inside a longer process (the tests)
        torch.set_num_threads(threads)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": H.machine_facts(), **res}, indent=1))
    return 0 if res["check"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
