"""ZeRO-1's step at 2 and 1,024 data-parallel ranks, simulated in one process: host time
per step and peak extra memory.

    .venv/bin/python benchmarks/zero1.py                       # 2 and 1,024 ranks
    .venv/bin/python benchmarks/zero1.py --ranks 2,64,1024 --repeats 9
    .venv/bin/python benchmarks/zero1.py --root /path/to/other/checkout   # another functopt

**How the simulation is faithful.** Each world size $N$ runs in a fresh process that joins
a process group of $N$ ranks as rank 0, through a backend defined here (``Wireless``, a
``torch.distributed.ProcessGroup`` subclass) that completes every collective at once and
moves nothing. Every line of ``zero1``'s step then runs as it runs on rank 0 of a real group
of $N$ ranks: ``torch.distributed`` reports the rank and the size, the step slices every
leaf for $N$ ranks, runs the inner rule on rank 0's slices, enters the statistics'
all-reduce and the all-gather through c10d (coalescing included) with the tensors a real
rank hands over, waits for them within its timeout, and allocates what a real rank
allocates. Only the transfer is left out, so the time is the host's share of the step, to
which a real run adds the wire time (``docs/sharded-state.md``, *What it predicts at 1,024
GPUs*). Rank 0 holds the longest slice of every leaf: it is the busiest rank. (torch's own
``fake`` backend would not do: it stands in for the transfer by copying each input into
every rank's chunk of the output, $N$ copies per leaf, which is the wire's work.)

**The params.** Llama-2-7B's 291 tensors (embedding, 32 layers of q, k, v, o, gate, up and
down projections and two norms, the final norm, the output layer) with every width divided
by 32 (hidden 128, MLP 344, vocabulary 1,000): 6.59M bfloat16 params, bfloat16 gradients
(as after DDP's all-reduce), ``zero1(adamw(1e-4))`` with its defaults (fused kernels,
float32 masters, no clipping, no loss scale).

**What is reported**, per $N$, medians over ``--repeats`` steps after ``--warmup``:

* ``step``: seconds of one ``step`` (public API);
* ``slices`` and ``gather``: the same step in its two parts (the step up to the new slices,
  through ``zero1``'s private ``_zero1_parts``, and the all-gather into the new params);
  only for a checkout that has ``functopt/distributed/_zero_gather.py``;
* ``gather extra``: the all-gather's peak allocation above the bytes of the params it
  returns (their padding counted as extra), in bytes and as a fraction of the param bytes;
* ``step_extra``: the whole step's peak allocation above its result (the new params and
  the new state), as a fraction of the param bytes: the inner step's own temporaries
  (its gradient casts) included.

Memory comes from ``harness.peak_step_bytes`` (the CPU allocator's events recorded by
``torch.profiler``), exact and independent of the machine's load; times depend on the load:
compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def llama_shapes(width_divisor: int = 32) -> dict[str, tuple[int, ...]]:
    """Llama-2-7B's 291 param shapes, every width divided by ``width_divisor``."""
    h, f, v = 4096 // width_divisor, 11008 // width_divisor, 32000 // width_divisor
    shapes: dict[str, tuple[int, ...]] = {"embed": (v, h)}
    for i in range(32):
        layer = f"layers.{i:02d}."
        for name in ("q", "k", "v", "o"):
            shapes[layer + name] = (h, h)
        shapes[layer + "gate"] = (f, h)
        shapes[layer + "up"] = (f, h)
        shapes[layer + "down"] = (h, f)
        shapes[layer + "norm_attn"] = (h,)
        shapes[layer + "norm_mlp"] = (h,)
    shapes["norm"] = (h,)
    shapes["lm_head"] = (v, h)
    return shapes


def _register_wireless() -> None:
    """The ``wireless`` backend: every collective completes at once, nothing moves."""
    import torch.distributed as dist

    class Done(dist.Work):
        def wait(self, timeout: Any = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    class Wireless(dist.ProcessGroup):
        def allreduce(self, tensors: Any, opts: Any = None) -> Any:
            return Done()

        def allgather_into_tensor_coalesced(self, outs: Any, ins: Any, opts: Any = None) -> Any:
            return Done()

        def all_gather_single(self, out: Any, inp: Any, opts: Any = None) -> Any:
            return Done()

        def getBackendName(self) -> str:
            return "wireless"

    dist.Backend.register_backend(
        "wireless", lambda store, rank, world, timeout: Wireless(rank, world), devices=["cpu"])


def _median_time(fn: Any, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def one_world(world: int, repeats: int, warmup: int) -> dict[str, Any]:
    """The figures at ``world`` ranks, in this process (which joins the fake backend)."""
    import torch
    import torch.distributed as dist

    import functopt
    from functopt.distributed import zero1

    sys.path.insert(0, str(HERE))
    import harness

    torch.manual_seed(0)
    _register_wireless()
    dist.init_process_group("wireless", rank=0, world_size=world, store=dist.HashStore())
    params = {k: torch.randn(s).to(torch.bfloat16) for k, s in llama_shapes().items()}
    grads = {k: torch.randn(p.shape).to(torch.bfloat16) for k, p in params.items()}
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    opt = zero1(functopt.adamw(1e-4))
    state = opt.init(params)
    out: dict[str, Any] = {"world": world, "leaves": len(params),
                           "params": sum(p.numel() for p in params.values()),
                           "param_bytes": param_bytes, "functopt": functopt.__file__}

    def step() -> Any:
        return opt.step(grads, state, params)

    out["step_s"] = _median_time(step, repeats, warmup)
    peak = harness.peak_step_bytes(step)
    new_params, new_state = step()
    result = harness.unique_nbytes([t for t in functopt.tree._core.flatten(
        (new_params, new_state))[0] if isinstance(t, torch.Tensor)])
    out["step_extra_bytes"] = peak - result
    out["step_extra_of_params"] = (peak - result) / param_bytes
    try:
        from functopt.distributed._zero_gather import gather
        from functopt.distributed.zero import _zero1_parts
    except ImportError:  # another checkout: the public step only
        return out
    _, step_slices, _ = _zero1_parts(
        "zero1", functopt.adamw(1e-4), process_group=None, stats_group=None,
        replicated=None, loss_scale=None, master_weights=None, max_grad_norm=None,
        fused=True, timeout=None)
    pl, new_slices, _ = step_slices(grads, state, params)

    def gather_now() -> Any:
        return gather(new_slices, pl.local, pl.rank, pl.world, pl.group, pl.limit)

    out["slices_s"] = _median_time(lambda: step_slices(grads, state, params), repeats, warmup)
    out["gather_s"] = _median_time(gather_now, repeats, warmup)
    peak = harness.peak_step_bytes(gather_now)
    result = harness.unique_nbytes([t for t in gather_now() if t is not None])
    # above the new params' elements: their padding (at most N - 1 elements a leaf) counts
    out["gather_extra_bytes"] = peak - param_bytes
    out["gather_extra_of_params"] = (peak - param_bytes) / param_bytes
    out["gathered_bytes"] = result
    dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,1024", help="world sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--root", default=str(HERE.parent),
                        help="the checkout whose functopt is measured (default: this one)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: one world
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one_world(args.one, args.repeats, args.warmup)))
        return 0
    env = {**os.environ, "PYTHONPATH": args.root, "OMP_NUM_THREADS": "1"}
    rows = []
    for world in (int(w) for w in args.ranks.split(",")):
        proc = subprocess.run(
            [sys.executable, __file__, "--one", str(world), "--repeats", str(args.repeats),
             "--warmup", str(args.warmup)],
            capture_output=True, text=True, env=env, cwd=args.root, check=False)
        if proc.returncode != 0:
            print(proc.stdout, proc.stderr, file=sys.stderr)
            return 1
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first = rows[0]
    print(f"functopt from {first['functopt']}; {first['leaves']} leaves, {first['params']:,} "
          f"params, {first['param_bytes']:,} param bytes; medians of {args.repeats} steps")
    print(f"{'ranks':>6} {'step ms':>9} {'slices ms':>10} {'gather ms':>10} "
          f"{'gather extra':>18} {'step extra':>11}")

    def ms(r: dict[str, Any], key: str, width: int) -> str:
        return f"{1e3 * r[key]:{width}.2f}" if key in r else f"{'-':>{width}}"

    for r in rows:
        extra = (f"{r['gather_extra_bytes']:>9,} B {100 * r['gather_extra_of_params']:5.2f}%"
                 if "gather_extra_bytes" in r else f"{'-':>18}")
        print(f"{r['world']:>6} {ms(r, 'step_s', 9)} {ms(r, 'slices_s', 10)} {ms(r, 'gather_s', 10)} {extra} "
              f"{100 * r['step_extra_of_params']:10.1f}%")
    last = rows[-1]
    print(f"step time at {last['world']} ranks / at {first['world']} ranks: "
          f"{last['step_s'] / first['step_s']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
