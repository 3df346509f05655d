"""Measuring: interleaved timing, robust statistics, peak memory, bandwidth, machine facts."""

from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from contenders import Contender


def machine_facts() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name")), cpu)
    affinity: int | None
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count()
    commit = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=Path(__file__).resolve().parent, timeout=5, check=True,
        ).stdout.strip() or commit
    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "cores_available": affinity,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "git_commit": commit,
    }



def begin(threads: int | None) -> None:
    """Set torch's thread count (when given) and print the machine facts, one line."""
    if threads:
        torch.set_num_threads(threads)
    print(" | ".join(f"{k}: {v}" for k, v in machine_facts().items()))


def summarize(samples: Sequence[float]) -> dict[str, Any]:
    """Median, quartiles and IQR of per-step times in seconds (inclusive quartiles)."""
    xs = sorted(samples)
    if len(xs) >= 2:
        q25, _, q75 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q25 = q75 = xs[0]
    return {"median_s": statistics.median(xs), "q25_s": q25, "q75_s": q75,
            "iqr_s": q75 - q25, "min_s": xs[0], "samples_s": list(samples)}


def _sync() -> None:
    """Wait for queued device work, so that a wall-clock reading covers it (CUDA runs
    kernels asynchronously; the CPU needs nothing)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_interleaved(
    contenders: Sequence[Contender], *, repeats: int, warmup: int, block_s: float,
    max_block_s: float,
) -> tuple[dict[str, dict[str, Any]], int]:
    """Time every contender round by round, alternating the order each round.

    All contenders take the same number of steps (``inner`` per block, chosen so the
    fastest contender's block lasts about ``block_s`` while the slowest one's stays under
    ``max_block_s``), so their final results stay comparable. Returns per-step statistics
    by contender name, and ``inner``.
    """
    for c in contenders:
        for _ in range(warmup):
            c.step()
    once = {}
    for c in contenders:  # calibration: one step each, also equal for all
        _sync()
        t0 = time.perf_counter()
        c.step()
        _sync()
        once[c.name] = max(time.perf_counter() - t0, 1e-7)
    fastest, slowest = min(once.values()), max(once.values())
    inner = max(1, min(math.ceil(block_s / fastest), int(max_block_s / slowest)))
    samples: dict[str, list[float]] = {c.name: [] for c in contenders}
    for r in range(repeats):
        order = contenders if r % 2 == 0 else list(reversed(contenders))
        for c in order:
            gc.collect()  # a collection started by another contender's garbage is not ours
            _sync()
            t0 = time.perf_counter()
            for _ in range(inner):
                c.step()
            _sync()
            samples[c.name].append((time.perf_counter() - t0) / inner)
    return {name: summarize(xs) for name, xs in samples.items()}, inner


def compare(contenders: Sequence[Contender], *, rtol: float, atol: float,
            rtol_per_step: float = 0.0) -> dict[str, Any]:
    """Check every contender ended where the first did (same step count, values close).

    The relative tolerance is ``rtol + rtol_per_step * steps``: equally valid roundings of
    the same step differ by a fraction of an ulp per step, and some of that difference is
    systematic (``1 - lr * weight_decay`` rounded to float32 is off by up to 3e-8), so it
    grows linearly with the number of steps. Also reports each contender's own
    ``problems()`` (low-precision params not bitwise their float32 masters rounded to
    nearest; a fast path that fell back to the pure one).
    """
    ref = contenders[0]
    ref_values = ref.result()
    rtol = rtol + rtol_per_step * ref.steps
    worst: dict[str, float] = {}
    passed = True
    problems = []
    for c in contenders[1:]:
        if c.steps != ref.steps:
            passed = False
            problems.append(f"{c.name} took {c.steps} steps, {ref.name} {ref.steps}")
            continue
        diff = 0.0
        for a, b in zip(ref_values, c.result(), strict=True):
            a64, b64 = a.double(), b.double()
            if not torch.allclose(a64, b64, rtol=rtol, atol=atol):
                passed = False
            diff = max(diff, (a64 - b64).abs().max().item())
        worst[c.name] = diff
    for c in contenders:
        for problem in c.problems():
            passed = False
            problems.append(f"{c.name}: {problem}")
    return {"passed": passed, "reference": ref.name, "steps": ref.steps, "rtol": rtol,
            "atol": atol, "max_abs_diff": worst, "problems": problems}


def unique_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and aliases counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the profiler's C++ log lines (written to fd 2, not to sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def peak_step_bytes(step: Callable[[], Any]) -> int:
    """Peak bytes that ``step()`` allocates above what was live when it started.

    Method: ``torch.profiler`` with ``profile_memory=True`` records every CPU allocator
    allocation and free (size and time) during the step. The running sum of those events,
    in time order, is the memory the step added at each moment; its maximum is the peak.
    Frees of tensors allocated outside any profiling session (the old params and state a
    pure step drops when its caller rebinds them, at the very end) are not reported, so
    they cannot hide the peak. Allocator caching and page reuse do not blur the number, as
    they would with RSS. The return value of ``step`` is dropped after the profiler stops.
    """
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with _quiet_stderr():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = step()
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    del out
    events.sort(key=lambda e: e.start_ns())
    return int(max([0, *itertools.accumulate(e.nbytes() for e in events)]))


def bandwidth(numel: int, repeats: int, device: Any = "cpu") -> dict[str, Any]:
    """Streaming bandwidth of float32 adds, counting 12 bytes/element (2 reads, 1 write).

    ``add_out``: ``torch.add(a, b, out=c)`` into a buffer written before (so no page
    faults; the write-allocate read of ``c`` is not counted, as it is not counted for AdamW).
    ``add_inplace``: ``a.add_(b)``. ``add_fresh``: ``a + b`` into a new tensor each time,
    page faults of the fresh pages included (what an out-of-place step pays on CPU; on a
    GPU the caching allocator hands back the same memory). On a CUDA ``device`` the clock
    is read after a synchronisation on both sides of each operation.
    """
    device = torch.device(device)
    a = torch.rand(numel, device=device)
    b = torch.rand(numel, device=device)
    c = torch.empty(numel, device=device)
    ops: dict[str, Callable[[], Any]] = {
        "add_out": lambda: torch.add(a, b, out=c),
        "add_inplace": lambda: a.add_(b),
        "add_fresh": lambda: a + b,
    }
    ok = torch.equal(torch.add(a, b, out=c), a + b)
    out: dict[str, Any] = {"numel": numel, "bytes_per_element": 12, "check_passed": ok}
    times: dict[str, list[float]] = {k: [] for k in ops}
    for op in ops.values():
        op()  # warm the pages and the thread pool
    for r in range(repeats):
        for name, op in (ops.items() if r % 2 == 0 else reversed(list(ops.items()))):
            _sync()
            t0 = time.perf_counter()
            res = op()
            _sync()
            times[name].append(time.perf_counter() - t0)
            del res
        a.mul_(0.5)  # keep the in-place operand bounded
    for name, xs in times.items():
        s = summarize(xs)
        s["gb_per_s"] = 12 * numel / s["median_s"] / 1e9
        out[name] = s
    return out
