"""examples/zero1_ddp.py under torchrun on 2 CPU ranks (gloo): ZeRO-1 with a DDP model,
blocking and overlapped parameter all-gathers."""

from __future__ import annotations

import re
from pathlib import Path

from distributed.harness import torchrun

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "zero1_ddp.py"


def test_zero1_ddp_example_quick() -> None:
    out = torchrun(EXAMPLE, 2, "--quick")
    assert "world 2 (gloo, cpu), DDP" in out, out
    comms = re.search(r"collectives per optimizer step: zero1 \[\(\('allgather_into_tensor_coalesced_', (\d+)\), "
                      r"\('allreduce_', (\d+)\)\)\], zero1_overlapped \[\(\('_allgather_base_', "
                      r"(\d+)\), \('allreduce_', (\d+)\)\)\]", out)
    assert comms, out
    assert (int(comms.group(1)), int(comms.group(2)), int(comms.group(4))) == (1, 1, 1), out
    # the overlapped buckets on gloo: one all-gather per param (4 linear layers' weights
    # and biases)
    assert int(comms.group(3)) == 8, out
    share = re.search(r"optimizer state per rank: (\d+) bytes, unsharded (\d+) bytes", out)
    assert share and abs(int(share.group(1)) / int(share.group(2)) - 0.5) < 1e-3, out
    first = re.search(r"max relative difference ([0-9.e+-]+) \(within 2\*\*-7: True\)", out)
    assert first and float(first.group(1)) <= 2.0**-7, out
    assert "overlapped params bitwise the blocking run's after 12 steps: True" in out, out
    times = re.search(r"blocking ([0-9.]+) ms, overlapped ([0-9.]+) ms per step", out)
    assert times and float(times.group(1)) > 0 and float(times.group(2)) > 0, out
    loss = re.search(r"loss ([0-9.]+) -> ([0-9.]+) \(decreased: True\); overlapped run "
                     r"\1 -> \2", out)
    assert loss, out
    assert ("verdict: zero1 trains with 2 collectives per step, overlapped equals it bitwise: "
            "True") in out, out
