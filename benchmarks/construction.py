"""Construction and ``state_dict()`` of the drop-in optimizers against torch.optim's.

For each size (a number of 1-element params) and each class, builds the functopt.optim
optimizer and the torch.optim one over the same params ``--repeats`` times and reports the
median wall time of the constructor and of ``state_dict()``. Both must grow linearly with
the number of params; the ratio to torch is printed beside them. Both make a param's
state when it is first needed (the first step; functopt also on a read of
``optimizer.state``), Adagrad in its constructor.

Usage: ``python benchmarks/construction.py [--sizes 8000,100000] [--classes AdamW,SGD]
[--repeats 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # harness
sys.path.insert(1, str(HERE.parent))  # functopt from this checkout
from harness import machine_facts  # noqa: E402

import functopt  # noqa: E402


def _median_s(fn: Any, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(name: str, n: int, repeats: int) -> dict[str, Any]:
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(n)]
    row: dict[str, Any] = {"class": name, "params": n}
    for label, module in (("functopt", functopt.optim), ("torch", torch.optim)):
        cls = getattr(module, name)
        row[f"{label}_construct_s"] = _median_s(lambda cls=cls: cls(params, lr=1e-3), repeats)
        opt = cls(params, lr=1e-3)
        row[f"{label}_state_dict_s"] = _median_s(opt.state_dict, repeats)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8000,100000")
    parser.add_argument("--classes", default="AdamW,SGD")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    facts = machine_facts()
    print(" ".join(f"{k}={v}" for k, v in facts.items()))
    functopt.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # imports and first builds
    rows = []
    print(f"{'class':<7} {'params':>8} | {'construct: functopt':>20} {'torch':>9} {'ratio':>7} | "
          f"{'state_dict: functopt':>20} {'torch':>9} {'ratio':>7}")
    for name in args.classes.split(","):
        for n in (int(s) for s in args.sizes.split(",")):
            row = measure(name, n, args.repeats)
            rows.append(row)
            fc, tc = row["functopt_construct_s"], row["torch_construct_s"]
            fs, ts = row["functopt_state_dict_s"], row["torch_state_dict_s"]
            print(f"{name:<7} {n:>8} | {fc * 1e3:>17.1f} ms {tc * 1e3:>6.1f} ms {fc / tc:>6.1f}x"
                  f" | {fs * 1e3:>17.1f} ms {ts * 1e3:>6.1f} ms {fs / ts:>6.1f}x")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": facts, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
