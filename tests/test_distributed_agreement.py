"""``MixedPrecisionOptimizer``'s ranks agree on every skip decision: 2 gloo ranks (see
``tests/distributed/agreement_checks.py``). One launch runs the checks of ``CHECKS``; the
timeout check has a launch of its own."""

from __future__ import annotations

import pytest
from distributed import agreement_checks, harness

LAUNCH_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def results() -> list[dict[str, str | None]]:
    return harness.run_ranks(agreement_checks.run_all, 2, timeout_s=LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("name", list(agreement_checks.CHECKS))
def test_check(results: list[dict[str, str | None]], name: str) -> None:
    failures = [f"rank {rank}:\n{r[name]}" for rank, r in enumerate(results) if r[name]]
    assert not failures, "\n".join(failures)


def test_a_rank_that_never_steps_times_out_the_others() -> None:
    waited, _ = harness.run_ranks(agreement_checks.timeout_check, 2, timeout_s=60.0)
    # within the timeout (plus the step's own work), far below the group's 20 s
    assert agreement_checks.TIMEOUT_S <= waited < agreement_checks.TIMEOUT_S + 3.0, waited
