"""Run a function on N gloo ranks (CPU processes) with a hard timeout.

A launch costs process start-up plus ``init_process_group``; with the ``spawn`` start
method every rank also re-imports torch (4 to 14 s on two shared cores), with ``fork``
the ranks start from the test process's memory in well under a second. ``fork`` is the
default on Linux (PyTorch's own ``MultiProcessTestCase`` forks too); the test process
must not hold a process group of its own, which these tests never create. Each rank
sets ``torch.set_num_threads(1)``: with several ranks on two cores, extra OpenMP
threads slow collectives and foreach ops tens of times.

The rank function returns a picklable value; ``run_ranks`` returns the list of these
values in rank order, or raises with every rank's traceback.
"""

from __future__ import annotations

import datetime
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Collectives give up after this, so a rank waiting for a rank that failed errors out
# instead of waiting for the hard timeout.
COLLECTIVE_TIMEOUT_S = 20.0


def store_in(folder: str) -> str:
    """The ``init_method`` of a launch: a file store in the launch's own temporary folder.

    No TCP port is picked for the rendezvous, so launches that run at the same time (one
    per test worker) cannot meet at one port, which a port found free and bound a moment
    later allows."""
    return "file://" + os.path.join(folder, "store")


def _rank_main(rank: int, fn: Callable[[int, int], Any], world_size: int, out_dir: str,
               ) -> None:
    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        dist.init_process_group(
            "gloo", init_method=store_in(out_dir), rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        try:
            result = {"ok": True, "value": fn(rank, world_size)}
        finally:
            dist.destroy_process_group()
    except BaseException:  # reported to the parent, which fails the test
        result = {"ok": False, "error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn: Callable[[int, int], Any], world_size: int, *, timeout_s: float = 120.0,
              start_method: str | None = None) -> list[Any]:
    """``[fn(rank, world_size) for each rank]``, run on ``world_size`` gloo processes.

    Args:
        fn: called in each rank after ``init_process_group``; a module-level function
            when ``start_method="spawn"`` (it is pickled by name).
        world_size: number of ranks.
        timeout_s: the whole launch is killed after this many seconds.
        start_method: ``"fork"`` (default on Linux) or ``"spawn"``.

    Raises:
        RuntimeError: a rank failed, exited without a result, or the timeout passed.
    """
    if start_method is None:
        start_method = "fork" if sys.platform == "linux" else "spawn"
    with tempfile.TemporaryDirectory(prefix="functopt-dist-") as out_dir:
        ctx = mp.start_processes(
            _rank_main, args=(fn, world_size, out_dir), nprocs=world_size,
            join=False, start_method=start_method,
        )
        deadline = time.monotonic() + timeout_s
        timed_out = False
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    timed_out = True
                    break
        except mp.ProcessRaisedException as exc:  # a rank died outside _rank_main's handler
            raise RuntimeError(f"a rank failed:\n{exc}") from None
        except mp.ProcessExitedException:
            pass  # reported below from the missing result files
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        results, errors = [], []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {rank}: no result (killed or crashed)")
                results.append(None)
                continue
            with open(path, "rb") as f:
                r = pickle.load(f)
            if r["ok"]:
                results.append(r["value"])
            else:
                errors.append(f"rank {rank}:\n{r['error']}")
                results.append(None)
        if timed_out or errors:
            head = f"timed out after {timeout_s:.0f} s; " if timed_out else ""
            raise RuntimeError(head + "distributed run failed:\n" + "\n".join(errors))
        return results


Check = Callable[[int, int], None]


def check_registry() -> tuple[dict[str, Check], Callable[[Check], Check]]:
    """A dict of named checks and the ``@check`` decorator that fills it (one per module)."""
    checks: dict[str, Check] = {}

    def check(fn: Check) -> Check:
        checks[fn.__name__] = fn
        return fn

    return checks, check


def run_checks(checks: dict[str, Check], rank: int, world: int) -> dict[str, str | None]:
    """Run every check in this rank, each failure reported by name to the parent.

    A barrier after each check keeps the ranks in step; a rank stuck in (or gone from) a
    check's collective makes the barrier fail, which names the check.
    """
    out: dict[str, str | None] = {}
    for name, fn in checks.items():
        try:
            fn(rank, world)
            out[name] = None
        except Exception:  # reported per check to the parent
            out[name] = traceback.format_exc()
        try:
            dist.barrier()
        except RuntimeError as exc:
            raise RuntimeError(f"ranks out of step after check {name!r}; so far: {out}") from exc
    return out


def run_named(checks: dict[str, Callable[[], None]]) -> dict[str, str | None]:
    """Run each check of a rank function, each failure (``pytest.fail``'s "did not raise"
    too, which is not an ``Exception``) reported by name to the parent; a barrier after each
    keeps the ranks in step where a process group is up."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.*")
    out: dict[str, str | None] = {}
    for name, fn in checks.items():
        try:
            fn()
            out[name] = None
        except (Exception, pytest.fail.Exception):  # reported per check to the parent
            out[name] = traceback.format_exc()
        if dist.is_initialized():
            dist.barrier()
    return out


def torchrun(script: Path, ranks: int, *args: str, timeout_s: float = 90.0) -> str:
    """The stdout of ``python -m torch.distributed.run --standalone`` of ``script`` on
    ``ranks`` CPU processes (one thread each), after checking that it succeeded."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(ranks), str(script), *args],
        cwd=script.parents[1], capture_output=True, text=True, timeout=timeout_s, check=False,
        env=env,
    )
    assert result.returncode == 0, f"{script.name} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout
