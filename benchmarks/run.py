"""functopt's optimizer step against PyTorch's, side by side in one process.

functopt runs on two paths: "functopt pure", the reference (``tx.update`` then
``functopt.apply_updates``; ``mixed_precision(..., fused=False)``), and "functopt fused",
the step a training loop takes (``functopt.fast.make_step(tx, donate=True)`` under
``torch.no_grad()``; ``mixed_precision(..., fused=True, donate=True)``).

Cases (``--only`` takes a comma-separated list of these names):

* ``adamw``: one plain AdamW step, float32, 20M params in 200 leaves: functopt pure and
  fused vs torch.optim.AdamW(foreach=True) vs AdamW(fused=True).
* ``mixed``: the full mixed-precision step (bfloat16 params, float32 master, dynamic loss
  scale, unscale, overflow check, clip to global norm 1, AdamW, params written from the
  master), functopt pure and fused, vs the best PyTorch idiom for it (see
  ``contenders.TorchMixedIdiom``). The fused contender does not count zero gradients:
  neither does the idiom.
* ``chains``: composed chains as users write them, each against the PyTorch step
  for the same maths: ``chain(clip_by_global_norm, adamw)`` vs ``clip_grad_norm_`` +
  AdamW(fused); ``adamw`` with a no-decay mask vs AdamW(fused) with a no-decay group;
  ``chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate(schedule))`` vs
  AdamW(fused); ``lion`` vs AdamW(fused) (timed beside it, not compared).
* ``mixed_chains``: the full mixed-precision step every way a user writes it (functional
  with ``max_grad_norm``; functional with ``chain(clip_by_global_norm, adamw)``; the
  ``MixedPrecisionOptimizer`` facade with one group and with decay / no-decay groups) vs
  the PyTorch idiom; outside ``--quick`` each also with ``compile=True``.
* ``small``: an MLP of 6 leaves (6,922 params): the fixed per-step cost of
  ``make_step``, ``functopt.Optimizer`` and the facade.
* ``leaves``: per-step time against the number of leaves (tensors of 100 elements).
* ``size``: per-step time against the total size (200 leaves).
* ``memory``: optimizer-state bytes per parameter, and the peak memory of one step, for
  every contender of ``adamw`` and ``mixed``.
* ``compile``: the planner's compiled tier, ``make_step(lion, compile=True)`` at the
  ``adamw`` size: the compile time (wall time of the first call), then the steady state
  against torch's fused AdamW (checked against Lion's pure path).
* ``engine``: the README's chain ``chain(clip_by_global_norm, adamw)`` at 10M params in
  100 leaves (the ``--quick`` size with ``--quick``): the program engine's eager backend
  (a private switch) vs ``make_step(donate=True)`` vs the pure path, with
  ``clip_grad_norm_`` + AdamW(fused) beside them (``benchmarks/engine.py``).
* ``traffic``: the bytes each form of a step reads and writes per param, counted by
  ``functopt.fast.explain`` beside the same count over PyTorch's step, and the time each
  implies at an H200's bandwidth (``benchmarks/traffic.py``; nothing is timed).
* ``optim``: every ``functopt.optim`` class (default arguments) against each implementation
  torch.optim's class of the same name offers (for-loop, foreach, fused), at 10M float32
  params in 100 leaves (``benchmarks/optim.py``; the ``--quick`` size with ``--quick``).
* ``bandwidth``: the machine's streaming bandwidth and the time an AdamW step would take
  at that bound; % of the bound reached by each contender of ``adamw``, ``mixed`` and
  ``compile``.

Timings are medians over ``--repeats`` rounds; in each round every contender runs a block
of the same number of steps, in an order that alternates round by round. The spread is the
interquartile range (IQR). After the timed steps the contenders' params are compared: a
benchmark of a wrong computation is worthless, so a failed check makes the exit status 1.

Usage: ``python benchmarks/run.py [--quick] [--only CASES] [--repeats N] [--threads N]
[--json PATH] [--device cpu|cuda]``. See benchmarks/README.md. With ``--device cuda`` every
timed case runs on the GPU (timings synchronise before each clock reading), the bandwidth
case measures the GPU's memory, and the memory case (the CPU's) is left out.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # harness, contenders
sys.path.insert(1, str(HERE.parent))  # functopt from this checkout

import chains as K  # noqa: E402
import contenders as C  # noqa: E402
import engine as E  # noqa: E402
import harness as H  # noqa: E402
import optim as O  # noqa: E402
import torch  # noqa: E402
import traffic as T  # noqa: E402

CASES = ("adamw", "mixed", "chains", "mixed_chains", "small", "leaves", "size", "memory",
         "compile", "engine", "traffic", "optim", "bandwidth")
PURE, FUSED, COMPILED = "functopt pure", "functopt fused", "functopt compiled"
FOREACH, TORCH_FUSED, IDIOM = "torch foreach", "torch fused", "torch idiom"
ADAPTER = "functopt.Optimizer"  # the torch.optim.Optimizer adapter, in the adamw case
ADAMW_BYTES_PER_PARAM = 28  # fp32 AdamW: read p, g, m, v; write p, m, v
# Mixed step: bf16 grad read twice (statistics pass, then the update), fp32 master, m, v
# read and written, bf16 param written.
MIXED_BYTES_PER_PARAM = 2 + 2 + 24 + 2
LION_BYTES_PER_PARAM = 20  # fp32 Lion: read p, g, m; write p, m

FULL = {"total": 20_000_000, "leaves": 200, "leaf_counts": [10, 100, 1_000, 10_000],
        "sizes": [1_000_000, 5_000_000, 20_000_000, 50_000_000], "bw_numel": 32_000_000,
        "optim_total": 10_000_000, "optim_leaves": 100,
        "block_s": 0.05, "max_block_s": 1.0, "repeats": 15}
QUICK = {"total": 1_000_000, "leaves": 50, "leaf_counts": [10, 100, 1_000],
         "sizes": [1_000_000], "bw_numel": 8_000_000,
         "optim_total": 100_000, "optim_leaves": 20,
         "block_s": 0.005, "max_block_s": 0.1, "repeats": 5}
LEAF_NUMEL = 100
# Final params of functopt and torch agree to this after the timed steps (different but
# equally valid float32 roundings of the same maths, accumulated over the steps: measured
# drift is about 5e-4 relative after 40,000 steps, so the bound grows by 1e-7 per step).
RTOL, ATOL, RTOL_PER_STEP = 1e-4, 1e-6, 1e-7


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in headers]] + [[str(x) for x in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for j, row in enumerate(cells):
        print("  " + "  ".join(x.rjust(w) if i else x.ljust(w)
                               for i, (x, w) in enumerate(zip(row, widths, strict=True))))
        if j == 0:
            print("  " + "  ".join("-" * w for w in widths))


def print_check(check: dict[str, Any]) -> None:
    diffs = ", ".join(f"{k} {v:.2g}" for k, v in check["max_abs_diff"].items())
    verdict = "PASSED" if check["passed"] else "FAILED"
    print(f"  check ({check['steps']} steps each; max |diff| vs {check['reference']}: {diffs};"
          f" rtol {check['rtol']:g}, atol {check['atol']:g}): {verdict}")
    for problem in check["problems"]:
        print(f"    {problem}")


def timing_rows(timings: dict[str, dict[str, Any]], base: str) -> list[list[str]]:
    rows = []
    for name, t in timings.items():
        rel_iqr = 100 * t["iqr_s"] / t["median_s"]
        ratio = t["median_s"] / timings[base]["median_s"]
        rows.append([name, ms(t["median_s"]), ms(t["iqr_s"]), f"{rel_iqr:.1f}%",
                     f"{ratio:.2f}x"])
    return rows


def ratios(timings: dict[str, dict[str, Any]], names: Sequence[str], base: str,
           ) -> dict[str, float]:
    """``"name/base"``: the ratio of median times, for each of ``names``."""
    return {f"{n}/{base}": timings[n]["median_s"] / timings[base]["median_s"] for n in names}


def print_timings(title: str, res: dict[str, Any], base: str, note: str | None = None) -> None:
    """The heading of a timed case (and a note under it), then its table against ``base``."""
    print(f"\n== {title} in {res['leaves']} leaves ({res['steps_per_block']} steps per block) ==")
    if note:
        print(f"  {note}")
    print_table(["contender", "median ms", "IQR ms", "IQR/med", f"vs {base}"],
                timing_rows(res["timings"], base))


def run_point(make: Any, shapes: list[tuple[int, ...]], cfg: dict[str, Any],
              args: argparse.Namespace) -> dict[str, Any]:
    cs = make(shapes)
    timings, inner = H.time_interleaved(cs, repeats=args.repeats, warmup=args.warmup,
                                        block_s=cfg["block_s"], max_block_s=cfg["max_block_s"])
    check = H.compare(cs, rtol=RTOL, atol=ATOL, rtol_per_step=RTOL_PER_STEP)
    numel = sum(math.prod(s) for s in shapes)
    return {"params": numel, "leaves": len(shapes), "steps_per_block": inner,
            "timings": timings, "check": check}


def case_adamw(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    shapes = C.make_shapes(cfg["total"], cfg["leaves"])
    res = run_point(functools.partial(C.adamw_contenders, adapter=True), shapes, cfg, args)
    res["ratios"] = ratios(res["timings"], (FUSED, PURE, ADAPTER, FOREACH), TORCH_FUSED)
    print_timings(f"adamw: one AdamW step, {res['params']:,} float32 params", res, TORCH_FUSED)
    r = res["ratios"]
    print(f"  target: functopt fused <= 1.1x torch fused; now {r[f'{FUSED}/{TORCH_FUSED}']:.2f}x"
          f" (pure {r[f'{PURE}/{TORCH_FUSED}']:.2f}x, {ADAPTER} "
          f"{r[f'{ADAPTER}/{TORCH_FUSED}']:.2f}x, foreach {r[f'{FOREACH}/{TORCH_FUSED}']:.2f}x)")
    print_check(res["check"])
    return res


def case_mixed(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    shapes = C.make_shapes(cfg["total"], cfg["leaves"])
    res = run_point(C.mixed_contenders, shapes, cfg, args)
    res["ratios"] = ratios(res["timings"], (FUSED, PURE), IDIOM)
    print_timings(f"mixed: full mixed-precision step, {res['params']:,} bfloat16 params",
                  res, IDIOM)
    r = res["ratios"]
    print(f"  target: functopt fused <= 1.0x the idiom (aim 0.8x); now "
          f"{r[f'{FUSED}/{IDIOM}']:.2f}x (pure {r[f'{PURE}/{IDIOM}']:.2f}x)")
    print("  (functopt does not count zero gradients, count_zeros' default: neither does "
          "the idiom)")
    print_check(res["check"])
    return res


def _run_set(checked: list[C.Contender], yardsticks: list[C.Contender], cfg: dict[str, Any],
             args: argparse.Namespace, numel: int, leaves: int) -> dict[str, Any]:
    """Time checked contenders and yardsticks side by side; check only the former."""
    cs = [*checked, *yardsticks]
    timings, inner = H.time_interleaved(cs, repeats=args.repeats, warmup=args.warmup,
                                        block_s=cfg["block_s"], max_block_s=cfg["max_block_s"])
    check = H.compare(checked, rtol=RTOL, atol=ATOL, rtol_per_step=RTOL_PER_STEP)
    return {"params": numel, "leaves": leaves, "steps_per_block": inner, "timings": timings,
            "check": check}


def _subcases(title: str, make: Any, names: Sequence[str], shapes: list[tuple[int, ...]],
              cfg: dict[str, Any], args: argparse.Namespace, ours: str) -> dict[str, Any]:
    numel = sum(math.prod(s) for s in shapes)
    print(f"\n== {title}: {numel:,} params in {len(shapes)} leaves ==")
    out: dict[str, Any] = {"params": numel, "leaves": len(shapes), "subcases": {}}
    rows = []
    for name in names:
        checked, yardsticks = make(name, shapes)
        res = _run_set(checked, yardsticks, cfg, args, numel, len(shapes))
        t = res["timings"]
        base = (yardsticks or checked)[-1].name
        # the compiled tier where the chain has it (Lion: no PyTorch kernel)
        mine = COMPILED if COMPILED in t else (
            ours if ours in t else checked[0 if yardsticks else 1].name)
        res["ratio"] = t[mine]["median_s"] / t[base]["median_s"]
        res["ratio_of"] = f"{mine}/{base}"
        pure = t.get(PURE)
        res["pure_ratio"] = None if pure is None else pure["median_s"] / t[base]["median_s"]
        out["subcases"][name] = res
        # every fast contender (the default one first, then e.g. the compiled, laid out)
        others = [c.name for c in checked if c.name not in (mine, PURE, base)]
        res["ratios"] = {f"{c}/{base}": t[c]["median_s"] / t[base]["median_s"]
                         for c in (mine, *others)}
        for c in (mine, *others):
            rows.append([name, c, ms(t[c]["median_s"]), base, ms(t[base]["median_s"]),
                         f"{res['ratios'][f'{c}/{base}']:.2f}x",
                         "-" if pure is None else f"{res['pure_ratio']:.2f}x",
                         "ok" if res["check"]["passed"] else "FAILED"])
    print_table(["chain", "functopt", "ms", "vs", "ms", "ratio", "pure ratio", "check"], rows)
    for res in out["subcases"].values():
        if not res["check"]["passed"]:
            print_check(res["check"])
    out["check"] = {"passed": all(r["check"]["passed"] for r in out["subcases"].values())}
    return out


def case_chains(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    # (compile=True contenders beside the kernels' chains: left out of --quick, see below)
    res = _subcases("chains: composed chains, make_step(donate=True) vs PyTorch",
                    functools.partial(K.chain_contenders, compiled=not args.quick),
                    list(K.CHAINS), C.make_shapes(cfg["total"],
                                                                      cfg["leaves"]),
                    cfg, args, FUSED)
    print("  targets: clip_adamw, masked_decay <= 1.05x; adam_decay_schedule <= 1.1x; "
          "lion <= 1.0x torch fused AdamW")
    return res


def case_mixed_chains(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    # the compile=True contenders compile a graph each (seconds with a cold Inductor cache):
    # left out of --quick, which CI runs
    make = functools.partial(K.mixed_contenders, compiled=not args.quick)
    res = _subcases("mixed_chains: the bf16 mixed-precision step every way it is written",
                    make, list(K.MIXED),
                    C.make_shapes(cfg["total"], cfg["leaves"]), cfg, args, FUSED)
    print("  target: <= 0.75x the idiom for every row (aim 0.6x, floor about 0.5x)")
    return res


def case_small(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    sets = K.small_contenders(K.SMALL_SHAPES)
    numel = sum(math.prod(s) for s in K.SMALL_SHAPES)
    print(f"\n== small: an MLP of {len(K.SMALL_SHAPES)} leaves, {numel:,} params ==")
    out: dict[str, Any] = {"params": numel, "leaves": len(K.SMALL_SHAPES), "subcases": {}}
    rows = []
    for label, (checked, yardsticks) in sets.items():
        res = _run_set(checked, yardsticks, cfg, args, numel, len(K.SMALL_SHAPES))
        out["subcases"][label] = res
        base = checked[-1].name
        for c in checked[:-1]:
            t = res["timings"]
            rows.append([label, c.name, f"{1e6 * t[c.name]['median_s']:.1f}", base,
                         f"{1e6 * t[base]['median_s']:.1f}",
                         f"{t[c.name]['median_s'] / t[base]['median_s']:.2f}x",
                         "ok" if res["check"]["passed"] else "FAILED"])
    print_table(["step", "contender", "us", "vs", "us", "ratio", "check"], rows)
    print("  targets: functopt.Optimizer and functopt.optim.AdamW <= 1.3x, make_step "
          "(functopt fused) <= 1.1x torch fused; facade <= 1.3x the idiom")
    out["check"] = {"passed": all(r["check"]["passed"] for r in out["subcases"].values())}
    for res in out["subcases"].values():
        if not res["check"]["passed"]:
            print_check(res["check"])
    return out


def _scaling(title: str, key: str, points: list[tuple[int, list[tuple[int, ...]]]],
             cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    results = []
    for _, shapes in points:
        results.append(run_point(C.adamw_contenders, shapes, cfg, args))
    print(f"\n== {title} ==")
    rows = []
    names = (FUSED, PURE, FOREACH, TORCH_FUSED)
    params_column = key != "params"  # the size case's key is the params count already
    for r in results:
        t = r["timings"]
        r["ratios"] = ratios(t, names[:-1], TORCH_FUSED)
        r["us_per_leaf"] = {n: 1e6 * t[n]["median_s"] / r["leaves"] for n in t}
        rows.append([f"{r[key]:,}", *([f"{r['params']:,}"] if params_column else []),
                     *(ms(t[n]["median_s"]) for n in names),
                     *(f"{r['ratios'][f'{n}/{TORCH_FUSED}']:.2f}x" for n in names[:-1]),
                     *(f"{r['us_per_leaf'][n]:.3g}" for n in (FUSED, PURE, TORCH_FUSED)),
                     "ok" if r["check"]["passed"] else "FAILED"])
    print_table([key, *(["params"] if params_column else []), "fused ms", "pure ms",
                 "foreach ms", "torch fused ms", "fused/tf", "pure/tf", "foreach/tf",
                 "fused us/leaf", "pure us/leaf", "tf us/leaf", "check"], rows)
    print("  fused, pure: functopt's paths; tf: torch fused. (medians; IQR and samples in "
          "the JSON)")
    for r in results:
        if not r["check"]["passed"]:
            print_check(r["check"])
    return {"points": results, "check": {"passed": all(r["check"]["passed"] for r in results)}}


def case_leaves(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    points: list[tuple[int, list[tuple[int, ...]]]] = [
        (n, [(LEAF_NUMEL,)] * n) for n in cfg["leaf_counts"]]
    res = _scaling(f"leaves: AdamW step vs number of leaves of {LEAF_NUMEL} elements",
                   "leaves", points, cfg, args)
    last = res["points"][-1]
    print(f"  target: at 10,000 leaves, functopt fused's per-step time <= torch fused's; "
          f"at {last['leaves']:,} leaves now {last['ratios'][f'{FUSED}/{TORCH_FUSED}']:.2f}x")
    return res


def case_size(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    points = [(n, C.make_shapes(n, 200))
              for n in cfg["sizes"]]
    return _scaling("size: AdamW step vs total params (transformer-like leaves)", "params",
                    points, cfg, args)


def _memory_of(cs: list[C.Contender], numel: int, args: argparse.Namespace) -> dict[str, Any]:
    for c in cs:
        for _ in range(args.warmup):
            c.step()
    out: dict[str, Any] = {}
    for c in cs:
        held = c.tensors()
        persistent = H.unique_nbytes([t for ts in held.values() for t in ts])
        transient = H.peak_step_bytes(c.step)
        per_param = {role: H.unique_nbytes(ts) / numel for role, ts in held.items()}
        out[c.name] = {"persistent_bytes": persistent, "step_transient_peak_bytes": transient,
                       "step_total_peak_bytes": persistent + transient,
                       "bytes_per_param": per_param,
                       "state_bytes_per_param": per_param.get("state", 0.0)
                       + per_param.get("master", 0.0)}
    return out


def case_memory(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    shapes = C.make_shapes(cfg["total"], cfg["leaves"])
    numel = sum(math.prod(s) for s in shapes)
    res: dict[str, Any] = {"params": numel, "leaves": len(shapes), "method": (
        "torch.profiler(profile_memory=True): running sum of the CPU allocator's "
        "allocation/free events during one step (after warm-up steps); peak total = bytes "
        "held between steps + that peak")}
    checks = []
    for label, make, base in (("adamw", C.adamw_contenders, TORCH_FUSED),
                              ("mixed", C.mixed_contenders, IDIOM)):
        cs = make(shapes)
        mem = _memory_of(cs, numel, args)
        checks.append(H.compare(cs, rtol=RTOL, atol=ATOL, rtol_per_step=RTOL_PER_STEP))
        b = mem[base]
        res[label] = {"base": base, "contenders": mem, "ratios": {
            name: {"state_bytes_per_param": mem[name]["state_bytes_per_param"]
                   / b["state_bytes_per_param"],
                   "step_total_peak": mem[name]["step_total_peak_bytes"]
                   / b["step_total_peak_bytes"]}
            for name in (FUSED, PURE)}}
        del cs
    res["check"] = {"passed": all(c["passed"] for c in checks), "details": checks}
    print(f"\n== memory: {numel:,} params in {len(shapes)} leaves ==")
    print(f"  method: {res['method']}")
    mb = 1e6
    rows = []
    for label in ("adamw", "mixed"):
        for name, m in res[label]["contenders"].items():
            bpp = m["bytes_per_param"]
            rows.append([f"{label}: {name}", f"{m['state_bytes_per_param']:.3f}",
                         f"{bpp.get('grad_buffers', 0.0):.3f}", f"{m['persistent_bytes'] / mb:.1f}",
                         f"{m['step_transient_peak_bytes'] / mb:.1f}",
                         f"{m['step_total_peak_bytes'] / mb:.1f}"])
    print_table(["step: contender", "state B/param", "fp32 grad buf B/param", "held MB",
                 "step extra peak MB", "step total peak MB"], rows)
    print("  state = optimizer state + float32 master copy (+ loss-scale scalars); "
          "held = params, grads, fp32 grad buffers and all of that")
    for label in ("adamw", "mixed"):
        for name in (FUSED, PURE):
            r = res[label]["ratios"][name]
            print(f"  {label}: {name} / {res[label]['base']}: state bytes "
                  f"{r['state_bytes_per_param']:.3f}x (target 1.0x), total step peak "
                  f"{r['step_total_peak']:.2f}x (target <= 1.1x)")
    for c in checks:
        if not c["passed"]:
            print_check(c)
    print(f"  check (contenders equal after their steps): "
          f"{'PASSED' if res['check']['passed'] else 'FAILED'}")
    return res


def case_compile(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The compiled tier: ``make_step(lion, compile=True)`` (no PyTorch kernel) at the
    ``adamw`` size, its state from ``step.init``; checked against Lion's pure path, timed
    beside torch's fused AdamW (the yardstick the planner issue names)."""
    shapes = C.make_shapes(cfg["total"], cfg["leaves"])
    params, grads = C.make_values(shapes, 0)
    # the chains case compiled the same Lion in this process: start from Dynamo's empty
    # in-memory cache, so that the first call compiles (Inductor's disk cache stays)
    torch._dynamo.reset()
    make = K.CHAINS["lion"]
    compiled = K.FunctoptChain(params, grads, make(), fast=True, compile=True)
    one_buffer = K.FunctoptChain(params, grads, make(), fast=True, compile=True,
                                 one_buffer=True)
    checked = [K.FunctoptChain(params, grads, make(), fast=False), compiled, one_buffer]
    yardstick = C.TorchAdamW(params, grads, fused=True)
    res = _run_set(checked, [yardstick], cfg, args, sum(math.prod(s) for s in shapes),
                   len(shapes))
    res["compile_s"] = compiled.call_s[0]
    res["first_calls_s"] = compiled.call_s
    res["ratios"] = ratios(res["timings"], (COMPILED, one_buffer.name, PURE), TORCH_FUSED)
    calls = ", ".join(f"{x:.3g} s" for x in res["first_calls_s"])
    print_timings(f"compile: make_step(lion, compile=True), {res['params']:,} float32 params",
                  res, TORCH_FUSED,
                  note=f"compile time (wall time of the first call): {res['compile_s']:.1f} s "
                       f"(first calls: {calls}; inductor's on-disk cache makes a repeated "
                       f"run faster)")
    r = res["ratios"]
    print(f"  steady state: compiled Lion {r[f'{COMPILED}/{TORCH_FUSED}']:.2f}x torch fused "
          f"AdamW ({r[f'{one_buffer.name}/{TORCH_FUSED}']:.2f}x with step.lay_out: params "
          f"and grads in one buffer), pure Lion {r[f'{PURE}/{TORCH_FUSED}']:.2f}x")
    print_check(res["check"])
    return res


def case_engine(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    total, leaves = (cfg["total"], cfg["leaves"]) if args.quick else (10_000_000, 100)
    checked, yardsticks = E.engine_contenders(C.make_shapes(total, leaves))
    res = _run_set(checked, yardsticks, cfg, args, total, leaves)
    res["ratios"] = ratios(res["timings"], (E.ENGINE, FUSED, PURE), TORCH_FUSED)
    t = res["timings"]
    for other in (FUSED, PURE):
        res["ratios"][f"{E.ENGINE}/{other}"] = t[E.ENGINE]["median_s"] / t[other]["median_s"]
    print_timings(f"engine: chain(clip_by_global_norm, adamw), {total:,} params", res,
                  TORCH_FUSED)
    r = res["ratios"]
    print(f"  program (eager) / make_step(donate=True) {r[f'{E.ENGINE}/{FUSED}']:.2f}x, "
          f"/ pure {r[f'{E.ENGINE}/{PURE}']:.2f}x")
    print_check(res["check"])
    return res


def case_optim(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    total, leaves = cfg["optim_total"], cfg["optim_leaves"]
    print(f"\n== optim: functopt.optim vs torch.optim's implementations, {total:,} float32 "
          f"params in {leaves} leaves ==")
    res = O.run(O.CLASSES, total=total, leaves=leaves, repeats=args.repeats,
                warmup=args.warmup, block_s=cfg["block_s"], max_block_s=cfg["max_block_s"])
    print("  target: functopt <= 1.0x torch's fastest implementation for every class")
    return res


def case_bandwidth(cfg: dict[str, Any], args: argparse.Namespace,
                   done: dict[str, Any]) -> dict[str, Any]:
    bw = H.bandwidth(cfg["bw_numel"], max(args.repeats, 3), C.DEVICE)
    bound = bw["add_inplace"]["gb_per_s"] * 1e9  # AdamW works in place: the fitting bound
    res: dict[str, Any] = {"streams": bw, "bound_bytes_per_s": bound,
                           "check": {"passed": bw["check_passed"]}}
    print(f"\n== bandwidth: float32 add over {cfg['bw_numel']:,} elements "
          f"(12 bytes/element) ==")
    print_table(["stream", "median ms", "IQR ms", "GB/s"],
                [[k, ms(bw[k]["median_s"]), ms(bw[k]["iqr_s"]), f"{bw[k]['gb_per_s']:.1f}"]
                 for k in ("add_out", "add_inplace", "add_fresh")])
    rows = []
    for case, per_param in (("adamw", ADAMW_BYTES_PER_PARAM), ("mixed", MIXED_BYTES_PER_PARAM),
                            ("compile", LION_BYTES_PER_PARAM)):
        numel = done[case]["params"] if case in done else cfg["total"]
        at_bound = per_param * numel / bound
        entry: dict[str, Any] = {"params": numel, "bytes_per_param": per_param,
                                 "time_at_bound_s": at_bound, "percent_of_bound": {}}
        if case in done:
            for name, t in done[case]["timings"].items():
                pct = 100 * at_bound / t["median_s"]
                entry["percent_of_bound"][name] = pct
                rows.append([case, name, f"{numel:,}", per_param, ms(at_bound),
                             ms(t["median_s"]), f"{pct:.0f}%"])
        else:
            rows.append([case, "(case not run)", f"{numel:,}", per_param, ms(at_bound), "-", "-"])
        res[case] = entry
    print_table(["step", "contender", "params", "B/param", "ms at bound", "median ms",
                 "% of bound"], rows)
    print("  bound = bytes a step must move / in-place add bandwidth")
    return res


def _checked(parser: argparse.ArgumentParser, args: argparse.Namespace,
             ) -> tuple[torch.device, dict[str, Any], list[str]]:
    """The run's device, configuration and cases from its arguments (an error for bad
    ones), with the thread count set."""
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"--device {args.device!r}: {error}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch has no CUDA device "
                     f"(torch {torch.__version__}); run on a machine with a GPU")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: expected cpu or cuda")
    C.DEVICE = device
    cfg = QUICK if args.quick else FULL
    if args.repeats is None:
        args.repeats = cfg["repeats"]
    if args.repeats < 1 or args.warmup < 1:
        parser.error("--repeats and --warmup must be >= 1")
    wanted = list(CASES)
    if args.only:
        wanted = [x.strip() for item in args.only for x in item.split(",") if x.strip()]
        unknown = sorted(set(wanted) - set(CASES))
        if unknown:
            parser.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    if device.type != "cpu":
        if args.only and "memory" in wanted:
            parser.error(f"memory measures the CPU only; leave it out with --device "
                         f"{args.device}")
        wanted = [c for c in wanted if c != "memory"]
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    return device, cfg, wanted


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="CI-sized: 1M params / 50 leaves, fewer points (a few seconds)")
    parser.add_argument("--only", action="append", default=None, metavar="CASE",
                        help=f"run only these cases (comma-separated or repeated): {CASES}")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed rounds per contender (default 15, --quick 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads(N) (default: torch's default)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write every number to this JSON file")
    parser.add_argument("--device", default="cpu",
                        help="where the params, grads and state live: cpu (default) or "
                             "cuda (the memory case measures the CPU only)")
    args = parser.parse_args(argv)
    device, cfg, wanted = _checked(parser, args)

    # torch.optim imports torch._dynamo on first use: pay that here, then freeze the
    # import-time objects so the gc.collect() before each timed block stays cheap.
    torch.optim.AdamW([torch.zeros(1)], fused=True)
    gc.collect()
    gc.freeze()
    facts = H.machine_facts()
    print(f"functopt benchmarks ({'quick' if args.quick else 'full'}): "
          f"repeats {args.repeats}, warmup {args.warmup}, device {device}")
    for k, v in facts.items():
        print(f"  {k}: {v}")
    funcs = {"adamw": case_adamw, "mixed": case_mixed, "chains": case_chains,
             "mixed_chains": case_mixed_chains, "small": case_small, "leaves": case_leaves,
             "size": case_size, "memory": case_memory, "compile": case_compile,
             "engine": case_engine, "traffic": T.case, "optim": case_optim}
    results: dict[str, Any] = {}
    started = time.perf_counter()
    for name in CASES:
        if name not in wanted:
            continue
        t0 = time.perf_counter()
        if name == "bandwidth":
            results[name] = case_bandwidth(cfg, args, results)
        else:
            results[name] = funcs[name](cfg, args)
        results[name]["wall_s"] = time.perf_counter() - t0
    passed = all(r["check"]["passed"] for r in results.values())
    total = time.perf_counter() - started
    print(f"\nall checks {'PASSED' if passed else 'FAILED'}; {total:.1f} s")
    if args.json is not None:
        report = {"machine": facts, "config": {
            **cfg, "quick": args.quick, "repeats": args.repeats, "warmup": args.warmup,
            "threads": torch.get_num_threads(), "cases": wanted, "device": str(device),
            "hyperparameters": {"lr": C.LR, "betas": C.BETAS, "eps": C.EPS,
                                "weight_decay": C.WEIGHT_DECAY,
                                "max_grad_norm": C.MAX_GRAD_NORM, "init_scale": C.INIT_SCALE}},
            "cases": results, "checks_passed": passed, "wall_s": total}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
