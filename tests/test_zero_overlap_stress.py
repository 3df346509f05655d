"""zero1_overlapped's all-gathers in flight together on gloo, 1,000 steps, beside another
collective: the ranks finish and agree. With gloo's coalesced all-gather per bucket, this
run aborted within a few hundred steps (glibc: ``malloc(): unaligned tcache chunk
detected``), as examples/zero1_ddp.py did now and then."""

from __future__ import annotations

from pathlib import Path

from distributed.harness import torchrun

SCRIPT = Path(__file__).resolve().parent / "distributed" / "overlap_stress.py"


def test_buckets_in_flight_together_step_after_step_do_not_corrupt_the_heap() -> None:
    out = torchrun(SCRIPT, 2, "1000", timeout_s=150.0)
    assert "steps 1000, ranks agree: True" in out, out
